"""The host tier with Mamba on the fast path (fast/tiers/host.py with fast/components/mamba.py):
a state backed up with its node, evicted to the host with it, counted as a host hit and loaded
back into a fresh device slot and the requester's; each step on the spec and on fast side by
side (same observations and snapshots, no invariant violated)."""

from __future__ import annotations

import types

import pytest
import torch

from stories import Story
from uniradix import fast
from uniradix.conformance.adapters.fast_hybrid import MambaReqPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.world import PagedPool

CFG = dict(components=("full", "mamba"), kv_slots=16, mamba_slots=4, host_slots=32,
           write_policy="write_through", write_through_threshold=1, load_back_threshold=0,
           mamba_cache_chunk_size=4)
ROOT = {"tokens": [], "extra_key": None}
A = {"tokens": [1, 2, 3, 4], "extra_key": None}


def both(op: str, pair: tuple, **args) -> dict:
    spec, fst = pair
    a, b = spec.step(op, **args), fst.step(op, **args)
    a.pop("message", None), b.pop("message", None)
    assert a == b, (op, args, a, b)
    assert spec.a.snapshot() == fst.a.snapshot(), (op, args)
    return a


def test_a_state_goes_to_the_host_and_comes_back():
    pair = (Story("spec", **CFG), Story("fast", **CFG))
    assert both("alloc", pair, n=4) == {"slots": [1, 2, 3, 4]}
    assert both("mamba_alloc", pair, n=1) == {"slots": [1]}
    # write-through at threshold 1: the node and its state are backed up, the node locked
    both("insert", pair, tokens=[1, 2, 3, 4], value=[1, 2, 3, 4], mamba_value=[1])
    host = pair[1].a.snapshot()["host"]
    assert host["writes"] == [{"node": A, "done": False, "locked": True}]
    both("io_complete", pair, writes=-1)
    both("check_hicache_events", pair)
    # the leaf goes to the host with its state: device slots and the device state freed
    r = both("evict", pair, num_tokens=4)
    assert r["num_tokens_evicted"] == 4 and r["freed"] == [1, 2, 3, 4] and r["mamba_freed"] == [1]
    assert pair[1].a.snapshot()["host"]["mamba_host_lru_order"] == [A]
    # a match ends at the node (its state is on the host): 4 host tokens, one host state
    m = both("match_prefix", pair, tokens=[1, 2, 3, 4])
    assert (m["device_indices"], m["host_hit_length"], m["mamba_host_hit_length"]) == ([], 4, 1)
    assert m["last_device_node"] == 0 and m["best_match_node"] == 4
    # the load back takes the requester's state slot first, then the node's
    r = both("load_back", pair, node=A, last_device_node=ROOT)
    assert r["device_indices"] == [1, 2, 3, 4] and r["last_node"] == 4
    assert r["mamba_pool_idx"] == 1 and r["mamba_device_indices"] == [2]
    assert pair[1].a.snapshot()["host"]["mamba_host_lru_order"] == []
    both("io_complete", pair, loads=-1)
    both("check_hicache_events", pair)
    r = both("evict_host", pair, num_tokens=4)  # on the device again: no host leaf
    assert r["num_evicted"] == 0


def _mamba_params(hicache=None) -> fast.CacheInitParams:
    rtt = MambaReqPool(PagedPool(4, 1, "mamba"))
    rtt.mamba_allocator.size = 4  # (SGLang's state pool has one: the host pool's default)
    alloc = PoolAllocator(PagedPool(16, 1, "kv"), torch)
    alloc.size = 16  # what init_hicache sizes the host pool from
    return fast.CacheInitParams(disable=False, req_to_token_pool=rtt,
                                token_to_kv_pool_allocator=alloc, page_size=1,
                                tree_components=("full", "mamba"), hicache=hicache)


def test_one_composed_type_with_and_without_a_host_tier():
    host = fast.HiCacheConfig(host_slots=32, host_mamba_slots=8)
    cache = fast.UnifiedRadixCache(_mamba_params(host))
    assert isinstance(cache, fast.HiCacheRadixCache) and isinstance(cache, fast.UnifiedRadixCache)
    assert cache.core == "python" and "host tier" in cache.core_reason
    assert cache.supports_mamba() and cache.tier is not None
    # init_hicache turns a hybrid cache into the host-tier one, its components kept
    params = _mamba_params()
    hybrid = fast.UnifiedRadixCache(params)
    assert type(hybrid).__name__ == "HybridRadixCache" and hybrid.tier is None
    hybrid.init_hicache(types.SimpleNamespace(hicache_write_policy="write_back",
                                              hicache_ratio=2.0), params)
    assert isinstance(hybrid, fast.HiCacheRadixCache) and hybrid.supports_mamba()
    assert hybrid.write_policy == "write_back" and hybrid.mamba.host_allocator is not None
    with pytest.raises(fast.Unsupported, match="already has a host tier"):
        hybrid.init_hicache(None, params)
    assert hybrid.mamba.host_allocator.available_size() == 8  # twice the device pool


def test_a_refused_init_hicache_leaves_the_cache_as_it_was():
    params = _mamba_params()
    del params.req_to_token_pool.mamba_allocator.size  # no default host pool size
    hybrid = fast.UnifiedRadixCache(params)
    with pytest.raises(fast.InvalidInput, match="host_mamba_slots"):
        hybrid.init_hicache(types.SimpleNamespace(hicache_ratio=2.0), params)
    assert type(hybrid).__name__ == "HybridRadixCache" and hybrid.tier is None
    assert hybrid.violations() == []


def test_mamba_states_are_not_moved_by_a_kv_moving_host_tier():
    host = fast.HiCacheConfig(host_slots=32, host_mamba_slots=8, device_kv=object(),
                              host_kv=object())
    with pytest.raises(fast.Unsupported, match="Mamba states"):
        fast.UnifiedRadixCache(_mamba_params(host))


def test_the_scheduler_polls_are_no_ops_without_a_host_tier():
    """A scheduler polls every step, host tier or not (upstream's cache then does nothing)."""
    hybrid = fast.UnifiedRadixCache(_mamba_params())
    hybrid.check_hicache_events()
    hybrid.flush_write_through_acks()
    assert hybrid.ready_to_load_host_cache() == 0
    with pytest.raises(fast.Unsupported, match="no host tier"):
        hybrid.evict_host(4)


def _evicted_state_cache():
    """A host-tier Mamba cache (sync io) whose node [1, 2, 3, 4] and its state are on the host
    only; returns (cache, the match's best node)."""
    cache = fast.UnifiedRadixCache(_mamba_params(fast.HiCacheConfig(
        host_slots=32, host_mamba_slots=8, load_back_threshold=0)))
    alloc, states = cache.token_to_kv_pool_allocator, cache.mamba_allocator
    kv, st = alloc.alloc(4), states.alloc(1)
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4]), value=kv, mamba_value=st))
    cache.check_hicache_events()  # the write-through backup's ack: the node is unlocked
    assert cache.evict(fast.EvictParams(num_tokens=4)).num_tokens_evicted == 4
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3, 4])))
    assert m.host_hit_length == 4 and len(m.device_indices) == 0
    return cache, m.best_match_node


def test_a_load_back_gives_the_request_its_state_slot():
    """SGLang's scheduler reads the requester's state slot from ``req.mamba_pool_idx`` after
    ``init_load_back`` and frees it with the request (0.5.13.post1 sets it there): fast took
    that slot but kept it to itself, so the scheduler took a second one and the first leaked
    (the bench's host+Mamba outcome difference, docs/SPEC.md)."""
    cache, best = _evicted_state_cache()
    states = cache.mamba_allocator
    before = states.available_size()
    req = types.SimpleNamespace(last_node=cache.root_node, mamba_pool_idx=None)
    new, last = cache.init_load_back(fast.InitLoadBackParams(best_match_node=best, req=req))
    assert new.tolist() and last is best
    assert isinstance(req.mamba_pool_idx, torch.Tensor) and req.mamba_pool_idx.dim() == 0
    slot = int(req.mamba_pool_idx)
    assert states.available_size() == before - 2  # the node's state and the request's
    assert slot != int(best.aux[cache.mamba.i].value[0]) and slot not in cache.mamba.owned
    assert cache.violations() == []


def test_a_load_back_keeps_the_slot_the_request_holds():
    """A requester with a state slot already gets the loaded state there: no second slot."""
    cache, best = _evicted_state_cache()
    states = cache.mamba_allocator
    own = states.alloc(1)[0]
    before = states.available_size()
    req = types.SimpleNamespace(last_node=cache.root_node, mamba_pool_idx=own)
    new, last = cache.init_load_back(fast.InitLoadBackParams(best_match_node=best, req=req))
    assert new.tolist() and last is best
    assert req.mamba_pool_idx is own
    assert states.available_size() == before - 1  # the node's state only
    assert cache.violations() == []


@pytest.mark.parametrize("bad", [torch.tensor([1.0]), torch.tensor([1, 2]), "1", "tree"])
def test_a_request_slot_that_is_no_slot_is_refused_with_nothing_changed(bad):
    cache, best = _evicted_state_cache()
    if bad == "tree":  # a state the tree holds
        st = cache.mamba_allocator.alloc(1)
        cache.insert(fast.InsertParams(key=fast.RadixKey([9, 9]),
                                       value=cache.token_to_kv_pool_allocator.alloc(2),
                                       mamba_value=st))
        bad = int(st[0])
        assert bad in cache.mamba.owned
    before = (cache.mamba_allocator.available_size(), cache.evictable_size(),
              cache.token_to_kv_pool_allocator.available_size())
    req = types.SimpleNamespace(last_node=cache.root_node, mamba_pool_idx=bad)
    with pytest.raises(fast.InvalidInput, match="mamba_pool_idx"):
        cache.init_load_back(fast.InitLoadBackParams(best_match_node=best, req=req))
    assert req.mamba_pool_idx is bad and best.evicted
    assert (cache.mamba_allocator.available_size(), cache.evictable_size(),
            cache.token_to_kv_pool_allocator.available_size()) == before
    assert cache.violations() == []


def test_a_load_back_of_a_requester_with_a_slot_on_spec_and_fast():
    """The trace's ``mamba_slot``: the spec's rule and fast's agree step by step; refused (the
    state unchanged) for a state the tree holds, and without Mamba."""
    pair = (Story("spec", **CFG), Story("fast", **CFG))
    both("alloc", pair, n=6)
    both("mamba_alloc", pair, n=3)
    both("insert", pair, tokens=[1, 2, 3, 4], value=[1, 2, 3, 4], mamba_value=[1])
    both("insert", pair, tokens=[7, 7], value=[5, 6], mamba_value=[2])
    both("io_complete", pair, writes=-1)
    both("check_hicache_events", pair)
    assert both("evict", pair, num_tokens=4)["mamba_freed"] == [1]
    for bad in (2, True):  # the tree's state (of [7, 7]); not an int
        r = both("load_back", pair, node=A, last_device_node=ROOT, mamba_slot=bad)
        assert r["error"] == "InvalidInput"
    r = both("load_back", pair, node=A, last_device_node=ROOT, mamba_slot=3)
    assert r["mamba_pool_idx"] == 3 and r["mamba_device_indices"] == [1]
    full = dict(CFG, components=("full",))
    full.pop("mamba_slots"), full.pop("mamba_cache_chunk_size")
    spec, fst = Story("spec", **full), Story("fast", **full)
    for s in (spec, fst):
        r = s.step("load_back", node=ROOT, last_device_node=ROOT, mamba_slot=1)
        assert r["error"] == "InvalidInput" and "needs the Mamba component" in r["message"]


def test_a_load_back_without_a_requester_takes_no_slot_for_one():
    """``init_load_back`` without ``req`` and the public ``load_back(node)`` (upstream's
    ``req=None``): the node's state comes back, and no slot is taken for a requester nobody
    would free (fast took one, which leaked)."""
    for call in ("init_load_back", "load_back"):
        cache, best = _evicted_state_cache()
        states = cache.mamba_allocator
        before = states.available_size()
        if call == "init_load_back":
            new, last = cache.init_load_back(fast.InitLoadBackParams(best_match_node=best))
            assert new.tolist() and last is best
        else:
            assert cache.load_back(best) is True
        assert states.available_size() == before - 1, call  # the node's state only
        assert best.aux[cache.mamba.i].value is not None
        assert cache.violations() == []
        # a later load back with a requester takes one for it again
        req = types.SimpleNamespace(last_node=cache.root_node, mamba_pool_idx=None)
        cache.ready_to_load_host_cache()
        cache.check_hicache_events()  # the load's ack: the node is unlocked
        assert cache.evict(fast.EvictParams(num_tokens=4)).num_tokens_evicted == 4
        assert cache.load_back(best, req=req) is True
        assert req.mamba_pool_idx is not None and states.available_size() == before - 2


def test_a_load_back_for_a_waiting_request_on_spec_and_fast():
    """The trace's ``rid``: a waiting request as the requester.  The loaded state goes into a
    fresh slot that is the request's (the driver holds nothing), its admission keeps it and
    takes no other; refused, with nothing changed, for an unknown or admitted request and with
    ``mamba_slot`` besides."""
    pair = (Story("spec", **CFG), Story("fast", **CFG))
    both("alloc", pair, n=4)
    both("mamba_alloc", pair, n=1)
    both("insert", pair, tokens=[1, 2, 3, 4], value=[1, 2, 3, 4], mamba_value=[1])
    both("io_complete", pair, writes=-1)
    both("check_hicache_events", pair)
    assert both("evict", pair, num_tokens=4)["mamba_freed"] == [1]
    both("req_arrive", pair, rid="a", tokens=[1, 2, 3, 4, 5])
    both("req_arrive", pair, rid="b", tokens=[1, 2, 3, 4, 6])
    before = pair[0].a.snapshot()
    for bad in ({"rid": "zz"}, {"rid": "a", "mamba_slot": 2}, {"rid": 3}):
        r = both("load_back", pair, node=A, last_device_node=ROOT, **bad)
        assert r["error"] == "InvalidInput", bad
    assert pair[0].a.snapshot() == before
    r = both("load_back", pair, node=A, last_device_node=ROOT, rid="a")
    assert r["device_indices"] == [1, 2, 3, 4] and r["mamba_pool_idx"] == 1
    assert r["mamba_device_indices"] == [2]
    assert [q["mamba_slot"] for q in pair[0].a.snapshot()["requests"]] == [1, None]
    r = both("req_admit", pair, rid="a")
    assert r["prefix_len"] == 4 and r["mamba_pool_idx"] == 1 and r["mamba_freed"] == []
    assert both("mamba_alloc", pair, n=1) == {"slots": [3]}  # no third slot was taken
    r = both("load_back", pair, node=A, last_device_node=ROOT, rid="a")  # admitted now
    assert r["error"] == "InvalidInput"
    assert both("req_abort", pair, rid="b")["mamba_freed"] == []  # it held none


def test_a_load_back_for_a_session_request_restored_from_its_slot_is_refused():
    """A session's next turn is restored from the session's slot, not matched, so no load back
    names it: InvalidInput on spec and fast, nothing changed; its first turn may be named."""
    pair = (Story("spec", **CFG), Story("fast", **CFG))
    both("req_arrive", pair, rid="a", tokens=[1, 2, 3, 4, 5], session="s")
    r = both("load_back", pair, node=ROOT, last_device_node=ROOT, rid="a")  # a first turn
    assert r["device_indices"] == [] and r["mamba_pool_idx"] is None
    both("req_admit", pair, rid="a")
    both("req_chunk", pair, rid="a", n=5, chunked=False)
    both("req_finish", pair, rid="a")  # parks the row in the session's slot
    both("req_arrive", pair, rid="b", tokens=[1, 2, 3, 4, 5, 6, 7], session="s")
    before = pair[0].a.snapshot()
    r = both("load_back", pair, node=ROOT, last_device_node=ROOT, rid="b")
    assert r["error"] == "InvalidInput"
    assert pair[0].a.snapshot() == before
