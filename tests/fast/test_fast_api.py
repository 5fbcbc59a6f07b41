"""The fast path's public surface: upstream's names and fields, typed errors on bad input with
the cache unchanged, sanity_check, and the request-level rules through Req objects."""

import dataclasses
from array import array

import pytest
import torch

import uniradix.fast as fast
from uniradix.conformance.adapters.fast_adapter import FastAdapter, Req, ReqToTokenPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.world import PagedPool


def make_cache(page_size=1, slots=64, whole_pages=False, **kw):
    pool = PoolAllocator(PagedPool(slots, page_size), torch, whole_pages=whole_pages)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=ReqToTokenPool(), token_to_kv_pool_allocator=pool,
        page_size=page_size, **kw))
    return cache, pool


def key(tokens, extra_key=None):
    return fast.RadixKey(array("q", tokens), extra_key)


def test_upstream_field_names():
    assert [f.name for f in dataclasses.fields(fast.InsertParams)] == [
        "key", "value", "mamba_value", "prev_prefix_len", "swa_evicted_seqlen", "chunked", "priority"]
    assert [f.name for f in dataclasses.fields(fast.EvictResult)] == [
        "num_tokens_evicted", "swa_num_tokens_evicted", "mamba_num_evicted"]
    assert fast.MatchResult._fields[:5] == (
        "device_indices", "last_device_node", "last_host_node", "best_match_node", "host_hit_length")
    assert [f.name for f in dataclasses.fields(fast.InsertResult)] == [
        "prefix_len", "total_len", "mamba_exist", "inserted_host_node"]


def test_insert_match_evict_story():
    cache, pool = make_cache()
    v = pool.alloc(6)  # slots 1..6
    assert cache.insert(fast.InsertParams(key=key([1, 2, 3, 4, 5, 6]), value=v)).prefix_len == 0
    m = cache.match_prefix(fast.MatchPrefixParams(key=key([1, 2, 3, 9])))
    assert m.device_indices.tolist() == [1, 2, 3] and m.device_indices.dtype == torch.int64
    assert cache.evictable_size() == 6 and cache.protected_size() == 0
    r = cache.inc_lock_ref(m.last_device_node)
    assert r.delta == 3 and cache.protected_size() == 3 and cache.evictable_size() == 3
    # the unlocked leaf [4, 5, 6] is the only evictable node
    assert cache.evict(fast.EvictParams(num_tokens=1)).num_tokens_evicted == 3
    assert pool.pool.take_freed() == [4, 5, 6]
    assert cache.evict(fast.EvictParams(num_tokens=10)).num_tokens_evicted == 0
    cache.dec_lock_ref(m.last_device_node, r.to_dec_params())
    assert cache.evict(fast.EvictParams(num_tokens=10)).num_tokens_evicted == 3
    cache.sanity_check()


def snapshot(cache):
    return FastAdapter.snapshot.__get__(_Wrap(cache))()


class _Wrap:
    """Borrow FastAdapter.snapshot for a bare cache."""

    def __init__(self, cache):
        self.cache = cache
        self.config = CacheConfig()
        self.pool = cache.token_to_kv_pool_allocator.pool
        self.requests = {}

    _tokens_of = FastAdapter._tokens_of
    _path = FastAdapter._path
    _snapshot = FastAdapter._snapshot
    _paths = None


@pytest.mark.parametrize("call", [
    lambda c, p: c.insert(fast.InsertParams(key=key([1, 2]), value=torch.tensor([7]))),
    lambda c, p: c.insert(fast.InsertParams(key=key([1, 2]), value=torch.tensor([7.0, 8.0]))),
    lambda c, p: c.insert(fast.InsertParams(key=key([1]), value=p[:1], prev_prefix_len=-1)),
    lambda c, p: c.insert(fast.InsertParams(key=[1, 2], value=p[:2])),
    lambda c, p: c.evict(fast.EvictParams(num_tokens=-1)),
    lambda c, p: c.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2.5]))),
    lambda c, p: c.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, True]))),
    lambda c, p: c.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1], extra_key=3))),
    lambda c, p: c.find_node(key([1, 2, 3, 4, 5])),
    lambda c, p: c.dec_lock_ref(c.find_node(key([1, 2, 3]))),
    # slots the tree already holds, handed over again
    lambda c, p: c.insert(fast.InsertParams(key=key([9, 9]), value=torch.tensor([1, 2]))),
])
def test_bad_input_is_typed_and_changes_nothing(call):
    cache, pool = make_cache()
    cache.insert(fast.InsertParams(key=key([1, 2, 3]), value=pool.alloc(3)))
    spare = pool.alloc(4)
    before, avail = snapshot(cache), pool.available_size()
    with pytest.raises(fast.CacheError):
        call(cache, spare)
    assert snapshot(cache) == before
    assert pool.available_size() == avail and pool.pool.take_freed() == []
    cache.sanity_check()


def test_sanity_check_reports_corruption():
    cache, pool = make_cache()
    cache.insert(fast.InsertParams(key=key([1, 2, 3]), value=pool.alloc(3)))
    cache._evictable += 1  # corrupt a counter
    with pytest.raises(AssertionError, match="evictable"):
        cache.sanity_check()


def test_cache_unfinished_then_finished_req_page_4():
    cache, pool = make_cache(page_size=4, slots=64, whole_pages=True)
    rtt = cache.req_to_token_pool
    req = Req("a", list(range(1, 12)), None)
    req.req_pool_idx = rtt.take_row()
    req.last_node = cache.root_node
    req.dec_lock_params = cache.inc_lock_ref(cache.root_node).to_dec_params()
    rtt.ensure(12)
    rtt.req_to_token[req.req_pool_idx, :12] = pool.alloc(12)  # slots 4..15
    req.committed = 11
    cache.cache_unfinished_req(req)
    # 8 aligned tokens cached and locked by the request; the tail stays the request's own
    assert req.cache_protected_len == 8 and cache.protected_size() == 8
    cache.cache_finished_req(req)
    # finish: the 8 are already cached; slots 12..15 (tokens 8..10 + the unused slot) freed
    assert pool.pool.take_freed() == [12, 13, 14, 15]
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    cache.sanity_check()


def test_pretty_print_runs(capsys):
    cache, pool = make_cache()
    cache.insert(fast.InsertParams(key=key([1, 2, 3]), value=pool.alloc(3)))
    cache.pretty_print()
    assert "lock=" in capsys.readouterr().out


BAD_STEPS = [  # the list of bad input, as trace steps
    ("match_prefix", {"tokens": [1, 2.5]}),
    ("match_prefix", {"tokens": [1, "2"]}),
    ("match_prefix", {"tokens": [True, 2]}),
    ("insert", {"tokens": [1, 2, 3], "value": [9, 10]}),
    ("insert", {"tokens": [1, 2], "value": [9, 10], "prev_prefix_len": -1}),
    ("evict", {"num_tokens": -3}),
    ("alloc", {"n": -4}),
    ("teleport", {}),
    ("unlock", {"handle": 999}),
    ("unlock", {"handle": 2}),  # released at step 3 below: unlocking twice
    ("lock", {"node": {"tokens": [1, 2], "extra_key": None}}),  # ends inside a node
    ("lock", {"node": {"tokens": [7, 7, 7, 7], "extra_key": None}}),  # no such path
    ("lock", {"node": {"tokens": [1, 2, 3, 4], "extra_key": "other"}}),  # wrong namespace
    ("insert", {"tokens": [5, 6], "value": [1, 2]}),  # slots the tree holds
]


@pytest.mark.parametrize("page_size", [1, 2])
def test_bad_input_rejected_alike_through_the_lockstep_runner(page_size):
    from uniradix.conformance.explore.lockstep import Lockstep
    ls = Lockstep.from_impls(["spec", "fast"], CacheConfig(page_size=page_size, kv_slots=32))
    ls.prime()
    ls.apply({"i": 0, "op": "alloc", "args": {"n": 4}})
    ls.apply({"i": 1, "op": "insert", "args": {"tokens": [1, 2, 3, 4],
                                                "value": [page_size + j for j in range(4)]}})
    node = {"tokens": [1, 2, 3, 4], "extra_key": None}
    assert ls.apply({"i": 2, "op": "lock", "args": {"node": node}}) == {"handle": 2}
    ls.apply({"i": 3, "op": "unlock", "args": {"handle": 2}})
    for k, (op, args) in enumerate(BAD_STEPS, start=4):
        if op == "insert" and args.get("value") == [1, 2]:
            args = dict(args, value=[page_size, page_size + 1])
        before = [a.snapshot() for a in ls.adapters]
        obs = ls.apply({"i": k, "op": op, "args": args})  # raises LockstepError on any difference
        assert "error" in obs, (op, args, obs)
        assert [a.snapshot() for a in ls.adapters] == before
