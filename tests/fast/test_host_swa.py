"""The host tier with SWA on the fast path (fast/tiers/host.py with fast/components/swa.py): the
window data backed up with its node, evicted to the host, counted as a host hit and loaded back
to fresh SWA slots mapped from the full ones; host locks of one window; host eviction; the
write-back hang of 0.5.13.post1 that must not happen.  Each step on the spec and on fast side by
side (same observations and snapshots, no invariant violated)."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import CORPUS
from stories import Story
from uniradix import fast
from uniradix.conformance.adapters.fast_adapter import ReqToTokenPool
from uniradix.conformance.adapters.fast_hybrid import SwaPoolAllocator
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.fast.hicache import HostSlotAllocator
from uniradix.spec.world import HybridKVPool

CFG = dict(components=("full", "swa"), kv_slots=32, swa_slots=32, host_slots=64,
           sliding_window=4, write_policy="write_through", write_through_threshold=1,
           load_back_threshold=0)
ROOT = {"tokens": [], "extra_key": None}


def path(*tokens: int) -> dict:
    return {"tokens": list(tokens), "extra_key": None}


def pair(**cfg) -> tuple:
    return Story("spec", **dict(CFG, **cfg)), Story("fast", **dict(CFG, **cfg))


def both(op: str, stories: tuple, **args) -> dict:
    spec, fst = stories
    a, b = spec.step(op, **args), fst.step(op, **args)
    a.pop("message", None), b.pop("message", None)
    assert a == b, (op, args, a, b)
    assert spec.a.snapshot() == fst.a.snapshot(), (op, args)
    return a


def put(stories: tuple, tokens: list, prev_slots: list | None = None, **kw) -> dict:
    """Insert ``tokens`` with fresh slots past ``prev_slots`` (the caller's cached prefix)."""
    prev = prev_slots or []
    fresh = both("alloc", stories, n=len(tokens) - len(prev))["slots"]
    return both("insert", stories, tokens=tokens, value=prev + fresh, prev_prefix_len=len(prev),
                **kw)


def acks(stories: tuple) -> None:
    both("io_complete", stories, writes=-1, loads=-1)
    both("check_hicache_events", stories)


def test_a_window_goes_to_the_host_and_comes_back():
    s = pair()
    put(s, [1, 2, 3, 4, 5, 6])  # backed up at hit 1, with its SWA data
    host = s[1].a.snapshot()["host"]
    assert host["nodes"][0]["swa"]["host_value"] == [1, 2, 3, 4, 5, 6]
    acks(s)
    r = both("evict", s, num_tokens=6)
    assert r["freed"] == [1, 2, 3, 4, 5, 6] and r["swa_freed"] == [1, 2, 3, 4, 5, 6]
    assert s[1].a.snapshot()["host"]["swa_host_lru_order"] == [path(1, 2, 3, 4, 5, 6)]
    both("alloc", s, n=2)  # a request holds full and SWA slots 1, 2
    m = both("match_prefix", s, tokens=[1, 2, 3, 4, 5, 6])
    assert (m["host_hit_length"], m["swa_host_hit_length"], m["best_match_node"]) == (6, 6, 6)
    r = both("load_back", s, node=path(1, 2, 3, 4, 5, 6), last_device_node=ROOT)
    # full slots 3..8 taken alone, then SWA slots 3..8 for the window, mapped to them
    assert r["device_indices"] == [3, 4, 5, 6, 7, 8] and r["swa_device_indices"] == [3, 4, 5, 6, 7, 8]
    assert s[1].a.snapshot()["host"]["swa_host_lru_order"] == []
    acks(s)


def test_a_load_back_brings_back_one_window_only():
    s = pair()
    put(s, [1, 2, 3, 4, 5, 6])
    put(s, list(range(1, 13)), prev_slots=[1, 2, 3, 4, 5, 6])
    acks(s)
    both("evict", s, num_tokens=12)
    m = both("match_prefix", s, tokens=list(range(1, 13)))
    assert (m["host_hit_length"], m["swa_host_hit_length"]) == (12, 6)
    r = both("load_back", s, node=path(*range(1, 13)), last_device_node=ROOT)
    assert len(r["device_indices"]) == 12 and len(r["swa_device_indices"]) == 6
    # the upper node's SWA data stays on the host only
    assert s[1].a.snapshot()["host"]["swa_host_lru_order"] == [path(1, 2, 3, 4, 5, 6)]


def test_a_host_lock_holds_one_window_and_host_eviction_waits_for_it():
    s = pair(sliding_window=8)
    put(s, [1, 2, 3, 4])
    put(s, list(range(1, 9)), prev_slots=[1, 2, 3, 4])
    acks(s)
    both("evict", s, num_tokens=8)
    h = both("host_lock", s, node=path(*range(1, 9)))["handle"]
    nodes = s[1].a.snapshot()["host"]["nodes"]
    assert [n["swa"]["host_lock_ref"] for n in nodes] == [1, 1]  # both nodes of the window
    assert both("evict_host", s, num_tokens=8)["num_evicted"] == 0
    both("host_unlock", s, handle=h)
    assert both("evict_host", s, num_tokens=8)["num_evicted"] == 8
    assert s[1].a.snapshot()["host"]["nodes"] == []


def test_a_short_swa_host_pool_evicts_host_only_swa_data_for_a_backup():
    s = pair(host_swa_slots=4)
    put(s, [1, 2, 3, 4])  # fills the SWA host pool
    acks(s)
    put(s, [1, 2, 3, 4, 5, 6], prev_slots=[1, 2, 3, 4])  # no SWA host room: not backed up
    assert both("evict", s, num_tokens=0, swa_num_tokens=4)["swa_num_tokens_evicted"] == 4
    r = put(s, [1, 2, 3, 4, 5, 6], prev_slots=[1, 2, 3, 4, 5, 6])
    assert r["host_swa_freed"] == [1, 2, 3, 4]  # the upper node's host-only SWA data made room


def test_swa_and_mamba_under_one_host_tier():
    s = pair(components=("full", "swa", "mamba"), mamba_slots=4, mamba_cache_chunk_size=4)
    both("alloc", s, n=4)
    both("mamba_alloc", s, n=1)
    both("insert", s, tokens=[1, 2, 3, 4], value=[1, 2, 3, 4], mamba_value=[1])
    acks(s)
    both("evict", s, num_tokens=4)
    m = both("match_prefix", s, tokens=[1, 2, 3, 4])
    assert (m["swa_host_hit_length"], m["mamba_host_hit_length"]) == (4, 1)
    r = both("load_back", s, node=path(1, 2, 3, 4), last_device_node=ROOT)
    assert r["swa_device_indices"] == [1, 2, 3, 4] and r["mamba_device_indices"] == [2]


def test_the_write_back_hang_of_upstream_does_not_happen():
    """0.5.13.post1 spins forever in a write-back SWA eviction whose least recently used leaf
    cannot be backed up (the host pools are full of device-resident backups); fast passes the
    leaf over, as the spec."""
    trace = load_trace(os.path.join(CORPUS, "regressions-host-aux",
                                    "upstream-hang-host-swa-wb-p1-evict-backup-fails.jsonl"))
    result = replay_trace(trace, "fast")
    assert result.unsupported is None and result.divergence is None


def _params(alloc, hicache) -> fast.CacheInitParams:
    return fast.CacheInitParams(disable=False, req_to_token_pool=ReqToTokenPool(),
                                token_to_kv_pool_allocator=alloc, page_size=1,
                                tree_components=("full", "swa"), sliding_window_size=4,
                                hicache=hicache)


class _PairingOnly(PoolAllocator):
    """An SWA allocator that cannot take full and SWA slots apart."""

    def free_swa(self, free_index) -> None: ...

    def translate_loc_from_full_to_swa(self, kv_indices):
        return kv_indices


def test_construction_and_the_refusals_that_remain():
    pool = HybridKVPool(16, 16)
    cache = fast.UnifiedRadixCache(_params(SwaPoolAllocator(pool, torch),
                                           fast.HiCacheConfig(host_slots=32, host_swa_slots=8)))
    assert isinstance(cache, fast.HiCacheRadixCache) and cache.supports_swa()
    assert cache.core == "python" and cache.swa.host_allocator.available_size() == 8
    # by default as many SWA host slots as the KV host pool holds (given or sized)
    given = fast.HiCacheConfig(host_allocator=HostSlotAllocator(24))
    cache = fast.UnifiedRadixCache(_params(SwaPoolAllocator(HybridKVPool(16, 16), torch), given))
    assert cache.swa.host_allocator.available_size() == 24
    with pytest.raises(fast.InvalidInput, match="full_attn_allocator"):
        fast.UnifiedRadixCache(_params(_PairingOnly(pool, torch),
                                       fast.HiCacheConfig(host_slots=32)))
    with pytest.raises(fast.Unsupported, match="SWA KV to the host"):
        fast.UnifiedRadixCache(_params(SwaPoolAllocator(pool, torch), fast.HiCacheConfig(
            host_slots=32, device_kv=object(), host_kv=object())))


def test_swa_data_keeps_its_tokens_through_host_trips_on_fast():
    """The KV check follows the SWA pool (device and host) through fast's backups, host
    eviction and load backs of a golden trace (conformance/env/kvcheck.py)."""
    trace = load_trace(os.path.join(CORPUS, "upstream-host-swa", "host-swa-wb-p1-s016.jsonl"))
    result = replay_trace(trace, "fast", check_kv=True)
    assert result.unsupported is None and result.divergence is None, result.divergence


def test_an_swa_mixup_on_fasts_host_trip_is_found_by_the_kv_check(monkeypatch):
    """A planted bug: fast's SWA load backs copy the host slots in reverse order."""
    from uniradix.fast.components.swa import SwaComponent
    orig = SwaComponent._copy

    def reversed_loads(self, kind, src, dst):
        orig(self, kind, src.flip(0) if kind == "load" else src, dst)

    monkeypatch.setattr(SwaComponent, "_copy", reversed_loads)
    trace = load_trace(os.path.join(CORPUS, "upstream-host-swa", "host-swa-wb-p1-s016.jsonl"))
    assert replay_trace(trace, "fast").divergence is None
    assert replay_trace(trace, "fast", check_kv=True).divergence is not None


@pytest.mark.parametrize("component", ["swa", "mamba"])
def test_a_host_slot_two_nodes_hold_is_a_violation_of_either_component(component):
    """fast's own check (components' ``host_tree_violations``, one rule for SWA and Mamba):
    two nodes' host data of one component on the same host slot."""
    s = pair(components=("full", "swa", "mamba"), mamba_slots=4, mamba_cache_chunk_size=4)
    for tokens in ([1, 2, 3, 4], [9, 10, 11, 12]):
        slots = both("alloc", s, n=4)["slots"]
        state = both("mamba_alloc", s, n=1)["slots"]
        both("insert", s, tokens=tokens, value=slots, mamba_value=state)
    acks(s)
    cache = s[1].a.cache
    i = [c.name for c in cache.components].index(component)
    a, b = (n.aux[i] for n in cache.root_node.children.values())
    assert a.host_value is not None and b.host_value is not None
    assert s[1].a.violations() == []
    b.host_value = a.host_value.clone()
    assert f"[aux-host] a {component} host slot is held twice in the tree" in s[1].a.violations()
