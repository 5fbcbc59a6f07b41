"""One story per rule of the spec's host tier (spec/host.py), with hand-computed expectations.

Pools (page_size 1): page 0 is reserved, so the first device alloc(n) is ``[1 .. n]`` and the
first host slots a backup takes are ``[1 .. n]`` too; both pools hand out the lowest free
pages first.  Every step is followed by ``sanity_check`` (host invariants included).
"""

from __future__ import annotations

import pytest

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.spec import cache as rules
from uniradix.spec import host, queries
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import HandleError, InvalidInput
from uniradix.spec.invariants import sanity_check
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import new_state


def sound(state):
    assert sanity_check(state) == []


def make(**cfg):
    cfg.setdefault("kv_slots", 16)
    cfg.setdefault("host_slots", 32)
    state = new_state(CacheConfig(**cfg))
    sound(state)
    return state


def put(state, tokens, extra_key=None, chunked=False):
    """Alloc fresh slots for ``tokens`` and insert them; returns the slots."""
    slots = state.kv.alloc(len(tokens))
    rules.insert(state, tokens, extra_key, slots, 0, chunked)
    sound(state)
    return slots


def node_at(state, tokens):
    return rules.find_node(state, tokens, None)


def events(state):
    host.check_hicache_events(state)
    sound(state)


def test_write_through_backs_up_parent_first_and_locks_until_ack():
    s = make(write_policy="write_through", write_through_threshold=1)
    put(s, [1, 2, 3])                    # leaf A=[1,2,3], hit 1 -> backed up to host [1,2,3]
    a = node_at(s, [1, 2, 3])
    assert a.host_value == (1, 2, 3) and a.lock_ref == 1
    assert [ack.node for ack in s.host.writes] == [a]
    put(s, [1, 2, 3, 4, 5])              # A hit 2 (backed up); new leaf B=[4,5] -> host [4,5]
    b = node_at(s, [1, 2, 3, 4, 5])
    assert b.host_value == (4, 5) and a.lock_ref == 2 and b.lock_ref == 1
    events(s)                            # nothing is done yet: locks stay
    assert a.lock_ref == 2 and len(s.host.writes) == 2
    host.io_complete(s, 1, 0)            # A's write done; B's not
    events(s)
    assert a.lock_ref == 1 and b.lock_ref == 1 and [k.node for k in s.host.writes] == [b]
    host.io_complete(s, -1, 0)
    events(s)
    assert a.lock_ref == 0 and b.lock_ref == 0 and s.host.writes == []


def test_write_through_selective_waits_for_the_threshold():
    s = make(write_policy="write_through_selective", write_through_threshold=2)
    put(s, [7, 8])
    n = node_at(s, [7, 8])
    assert n.hit_count == 1 and n.host_value is None
    slots = s.kv.alloc(2)
    rules.insert(s, [7, 8], None, slots, 0)   # hit 2: backed up; the duplicate slots freed
    sound(s)
    assert n.hit_count == 2 and n.host_value == (1, 2)


def test_chunked_inserts_do_not_count_hits():
    s = make(write_through_threshold=1)
    put(s, [5, 6], chunked=True)
    assert node_at(s, [5, 6]).host_value is None and s.host.writes == []


def test_eviction_to_host_keeps_the_node_and_match_reports_host_hits():
    s = make(write_through_threshold=1)
    put(s, [1, 2, 3])
    host.io_complete(s, -1, 0)
    events(s)
    assert rules.evict(s, 1) == 3        # the backed-up leaf goes to the host
    sound(s)
    a = node_at(s, [1, 2, 3])
    assert a.value is None and a.host_value == (1, 2, 3) and s.kv.available_size() == 16
    m = rules.match_prefix(s, [1, 2, 3, 9], None)
    assert m.device_indices == () and m.last_device_node is s.root
    assert m.best_match_node is a and m.last_host_node is a and m.host_hit_length == 3
    assert [n for n in host.host_eviction_order(s)] == [a]


def test_match_splits_an_evicted_node_host_copy_and_all():
    s = make(write_through_threshold=1)
    put(s, [1, 2, 3, 4])
    host.io_complete(s, -1, 0)
    events(s)
    rules.evict(s, 4)
    m = rules.match_prefix(s, [1, 2, 9], None)
    sound(s)
    upper = m.best_match_node
    assert upper.key == (1, 2) and upper.host_value == (1, 2) and upper.value is None
    lower = node_at(s, [1, 2, 3, 4])
    assert lower.host_value == (3, 4) and m.host_hit_length == 2


def test_write_through_leaf_without_backup_is_deleted():
    s = make(write_through_threshold=2)
    put(s, [1, 2])                       # hit 1 < 2: no backup
    assert rules.evict(s, 1) == 2
    sound(s)
    assert s.root.children == {}


def test_load_back_copies_the_evicted_segment_and_locks_until_ack():
    s = make(write_through_threshold=1)
    put(s, [1, 2])
    put(s, [1, 2, 3, 4])                 # A=[1,2] host (1,2); B=[3,4] host (3,4)
    host.io_complete(s, -1, 0)
    events(s)
    assert rules.evict(s, 16) == 4       # B (newest leaf is B; A becomes a leaf after it)
    sound(s)
    b = node_at(s, [1, 2, 3, 4])
    indices, last = host.init_load_back(s, b, s.root, None)
    sound(s)
    # the device pool hands out the lowest free pages: 1, 2 (for A), 3, 4 (for B)
    assert indices == (1, 2, 3, 4) and last is b and b.value == (3, 4)
    assert b.lock_ref == 1 and node_at(s, [1, 2]).lock_ref == 1
    assert rules.evict(s, 16) == 0       # locked: nothing to evict
    host.io_complete(s, 0, 1)
    events(s)
    assert b.lock_ref == 0 and s.host.loads == []


def test_load_back_threshold_and_mem_quota_refuse():
    s = make(write_through_threshold=1, load_back_threshold=3)
    put(s, [1, 2])
    host.io_complete(s, -1, 0)
    events(s)
    rules.evict(s, 2)
    a = node_at(s, [1, 2])
    assert host.init_load_back(s, a, s.root, None) == ((), s.root)   # 2 < threshold 3
    s2 = make(write_through_threshold=1)
    put(s2, [1, 2])
    host.io_complete(s2, -1, 0)
    events(s2)
    rules.evict(s2, 2)
    a2 = node_at(s2, [1, 2])
    assert host.init_load_back(s2, a2, s2.root, 1) == ((), s2.root)  # 2 > quota 1 + 0
    assert a2.value is None and s2.host.loads == []
    sound(s2)


def test_load_back_evicts_device_leaves_for_room():
    s = make(kv_slots=4, host_slots=8, write_through_threshold=1)
    put(s, [1, 2])
    host.io_complete(s, -1, 0)
    events(s)
    rules.evict(s, 2)                    # [1,2] on host only
    put(s, [5, 6, 7, 8])                 # fills the device pool; backed up to host [3..6]
    host.io_complete(s, -1, 0)
    events(s)
    a = node_at(s, [1, 2])
    s.kv.take_freed()
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    assert s.kv.take_freed() == [1, 2, 3, 4] and indices == (1, 2) and last is a
    assert node_at(s, [5, 6, 7, 8]).value is None


def test_evict_host_takes_the_oldest_host_leaf_and_tombstones_above():
    s = make(write_through_threshold=1)
    put(s, [1, 2])
    put(s, [3, 4])
    host.io_complete(s, -1, 0)
    events(s)
    rules.evict(s, 4)
    s.host.pool.take_freed()
    assert host.evict_host(s, 1) == 2
    sound(s)
    assert s.host.pool.take_freed() == [1, 2]       # [1,2] is the older host leaf
    assert list(s.root.children.values())[0].key == (3, 4)


def test_host_lock_protects_from_host_eviction():
    s = make(write_through_threshold=1)
    put(s, [1, 2])
    host.io_complete(s, -1, 0)
    events(s)
    rules.evict(s, 2)
    a = node_at(s, [1, 2])
    h = host.inc_host_lock_ref(s, a)
    sound(s)
    assert host.evict_host(s, 2) == 0 and a.host_lock_ref == 1
    host.dec_host_lock_ref(s, h)
    sound(s)
    with pytest.raises(HandleError):
        host.dec_host_lock_ref(s, h)
    assert host.evict_host(s, 2) == 2


def test_write_back_backs_up_at_eviction_and_waits():
    s = make(write_policy="write_back")
    put(s, [1, 2, 3])
    assert s.host.writes == [] and node_at(s, [1, 2, 3]).host_value is None
    assert rules.evict(s, 1) == 3
    sound(s)
    a = node_at(s, [1, 2, 3])
    assert a.value is None and a.host_value == (1, 2, 3) and s.host.writes == []


def test_write_back_passes_over_a_leaf_whose_backup_fails():
    s = make(write_policy="write_back", kv_slots=8, host_slots=2)
    put(s, [1, 2, 3])                    # older, 3 tokens: cannot fit the 2-slot host pool
    put(s, [7, 8])
    assert rules.evict(s, 1) == 2        # [1,2,3] passed over, [7,8] written back, evicted
    sound(s)
    assert node_at(s, [1, 2, 3]).value == (1, 2, 3)
    assert node_at(s, [7, 8]).host_value == (1, 2)


def test_io_complete_and_load_back_reject_bad_input_unchanged():
    s = make(write_through_threshold=1)
    put(s, [1, 2])
    before = snapshot(s)
    for w, loads in ((-2, 0), (0, "1"), (True, 0)):
        with pytest.raises(InvalidInput):
            host.io_complete(s, w, loads)
    a = node_at(s, [1, 2])
    with pytest.raises(InvalidInput):
        host.init_load_back(s, s.root, a, None)     # last_device_node below the node
    with pytest.raises(InvalidInput):
        host.init_load_back(s, a, s.root, -1)
    assert snapshot(s) == before


def test_reset_clears_the_host_tier():
    s = make(write_through_threshold=1)
    put(s, [1, 2])
    rules.reset(s)
    sound(s)
    assert s.host.writes == [] and s.host.pool.available_size() == 32
    assert queries.total_size(s) == 0


def test_adapter_effects_carry_host_freed():
    ad = SpecAdapter(CacheConfig(kv_slots=8, host_slots=4, write_through_threshold=1))
    ad.apply({"i": 0, "op": "alloc", "args": {"n": 4}})
    obs = ad.apply({"i": 1, "op": "insert", "args": {"tokens": [1, 2, 3, 4],
                                                      "value": [1, 2, 3, 4]}})
    assert obs == {"prefix_len": 0, "freed": [], "host_freed": []}
    ad.apply({"i": 2, "op": "io_complete", "args": {"writes": -1, "loads": 0}})
    assert ad.apply({"i": 3, "op": "check_hicache_events", "args": {}}) == {
        "freed": [], "host_freed": []}
    assert ad.apply({"i": 4, "op": "evict", "args": {"num_tokens": 1}}) == {
        "num_tokens_evicted": 4, "freed": [1, 2, 3, 4], "host_freed": []}
    assert ad.apply({"i": 5, "op": "evict_host", "args": {"num_tokens": 1}}) == {
        "num_evicted": 4, "host_freed": [1, 2, 3, 4]}
    assert ad.violations() == []
