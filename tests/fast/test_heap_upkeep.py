"""The eviction heaps stay O(live entries) when nothing is evicted (fast/structures.py
``LazyHeap.upkeep``).

Every touch of an evictable leaf pushes a fresh ``(stamp, node)`` entry and leaves the old one
stale; before, stale entries were dropped only at the end of an eviction.  A cache whose hot
prefixes are matched again and again with no eviction between (a server with room to spare)
grew its heap by one entry per match for ever: one leaf matched 20,000 times held 20,001
entries, about 100 bytes each, where upstream's cache holds nothing per match.  The host
tier's host-leaf heap grew the same way from matches that restamp evicted nodes.  Now every
public call that can push ends with the upkeep: a heap past its ``cap`` (twice the live
entries the last compaction kept, plus ``COMPACT_MIN``) is compacted, which
``violations()`` checks after every call.
"""

from __future__ import annotations

import pytest

from uniradix import fast
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import make_config, record
from uniradix.fast.structures import COMPACT_MIN, LazyHeap

CONFIGS = ["full-p1", "full-p16", "swa-w8-p1", "mamba-p1", "hicache-wt-p1", "hicache-wb-p1",
           "host-swa-wt-p1", "host-mamba-wt-p1"]


class Item:
    def __init__(self, i: int) -> None:
        self.id, self.last_access_time, self.member = i, 0, True

    def __lt__(self, other: Item) -> bool:
        return self.id < other.id


def test_upkeep_compacts_past_the_cap_and_resets_it():
    h = LazyHeap()
    it = Item(0)
    for stamp in range(1, COMPACT_MIN + 1):  # 64 entries, one live: at the cap, kept
        it.last_access_time = stamp
        h.push(stamp, it)
        h.upkeep(lambda n: n.member)
    assert len(h) == COMPACT_MIN and h.cap == COMPACT_MIN
    it.last_access_time = COMPACT_MIN + 1
    h.push(it.last_access_time, it)
    h.upkeep(lambda n: n.member)  # past the cap: the one live entry is kept
    assert h.entries == [(COMPACT_MIN + 1, it)] and h.cap == 2 + COMPACT_MIN
    h.clear()
    assert h.cap == COMPACT_MIN


def _nodes(cache) -> int:
    return sum(1 for _ in cache.all_nodes())


def _pure_full(adapter) -> None:
    """The Full cache's Python methods on this instance (the C core's wrappers skipped)."""
    cache = adapter.cache
    cache.match_prefix, cache.insert = cache._match_prefix_py, cache._insert_py
    cache.inc_lock_ref, cache.dec_lock_ref = cache._inc_lock_ref_py, cache._dec_lock_ref_py


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize("name", CONFIGS)
def test_heaps_stay_bounded_under_repeated_matches(name, pure):
    if pure and not name.startswith("full"):
        pytest.skip("the composed tree's general paths: tests/fast/test_one_aux.py switches")
    config = make_config(name, 3)
    adapter = make_adapter("fast", config)
    steps = record(adapter, config, 3, 200)
    if pure:
        _pure_full(adapter)
    cache = adapter.cache
    keys = [(s["args"]["tokens"], s["args"].get("extra_key")) for s in steps
            if s["op"] == "insert"][-12:]
    assert keys, "the recording inserted nothing"
    host = getattr(cache, "tier", None)
    if host is not None:  # every backed-up leaf to the host: the matches restamp host leaves
        cache.check_hicache_events()
        cache.evict(fast.EvictParams(num_tokens=10**9))
        cache.check_hicache_events()
        assert host.host_leaves, "nothing on the host to match"
    for r in range(400):
        for tokens, extra_key in keys:
            m = cache.match_prefix(fast.MatchPrefixParams(key=adapter._key(tokens, extra_key)))
            node = m.last_device_node
            if r % 7 == 0 and node is not cache.root_node:  # an unlock pushes too
                cache.dec_lock_ref(node, cache.inc_lock_ref(node).to_dec_params())
        bound = 2 * _nodes(cache) + 2 * COMPACT_MIN
        assert len(cache._heap) <= bound, (r, len(cache._heap), bound)
        if host is not None:
            assert len(host.host_leaf_heap) <= bound, (r, len(host.host_leaf_heap), bound)
    assert cache.violations() == []
