"""The host tier with the SWA component (spec/host.py, spec/components.py), story by story,
with hand-computed expectations, and where the spec departs from 0.5.13.post1 (docs/SPEC.md,
"The host tier with SWA").

Pools (page_size 1): page 0 is reserved, so a fresh pool's first alloc(n) is ``[1 .. n]``; the
device KV (full and SWA), host KV and SWA host pools all hand out the lowest free slots first.
Every step is followed by ``sanity_check`` (host and aux-host invariants included).
"""

from __future__ import annotations

from tests.stories import acks_done, node_at, sound
from uniradix.spec import cache as rules
from uniradix.spec import components, host
from uniradix.spec.config import CacheConfig
from uniradix.spec.state import new_state


def make(**cfg):
    base = dict(components=("full", "swa"), kv_slots=16, swa_slots=16, host_slots=32,
                sliding_window=4, write_through_threshold=1)
    base.update(cfg)
    state = new_state(CacheConfig(**base))
    sound(state)
    return state


def put(state, tokens, prev=0, **kw):
    """Insert ``tokens``: the tree's own slots for the first ``prev`` (the caller's cached
    prefix, on the device), fresh KV slots (their SWA slots mapped) for the rest; returns the
    freed log."""
    cached = [x for n in reversed(list(node_at(state, tokens[:prev]).ancestors_to_root()))
              for x in n.value] if prev else []
    slots = cached + state.kv.alloc(len(tokens) - prev)
    if "mamba" in state.config.components:
        kw["mamba_value"] = state.mamba.alloc(1)
    rules.insert(state, tokens, None, slots, prev, **kw)
    sound(state)
    return state.kv.take_freed()


def swa(node):
    return node.aux["swa"]


def test_backup_copies_the_window_data_and_a_load_back_brings_it_back():
    s = make()
    put(s, [1, 2, 3, 4, 5, 6])               # A: full [1..6], SWA [1..6]; hit 1 -> backed up
    a = node_at(s, [1, 2, 3, 4, 5, 6])
    assert a.host_value == (1, 2, 3, 4, 5, 6) and swa(a).host_value == (1, 2, 3, 4, 5, 6)
    assert s.host.swa_copies == [("backup", [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6])]
    acks_done(s)
    assert components.evict(s, 6)["swa"] == 6   # A goes to the host with its SWA data
    sound(s)
    assert a.value is None and swa(a).value is None and components.host_lru_order(s, "swa") == [a]
    held = s.kv.alloc(2)                     # a request holds full 1, 2 and SWA 1, 2
    m = rules.match_prefix(s, [1, 2, 3, 4, 5, 6])
    assert (m.best_match_node, m.last_device_node) == (a, s.root)
    assert (m.host_hit_length, m.swa_host_hit_length) == (6, 6)
    assert rules.match_prefix(s, [1, 2, 3, 4, 5, 6]).device_indices == ()
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    # full slots 3..8 alone (no SWA slots paired), then SWA slots 3..8 for the window, mapped
    assert last is a and indices == (3, 4, 5, 6, 7, 8)
    assert swa(a).value == (3, 4, 5, 6, 7, 8) and components.swa_pool(s).translate(a.value) == \
        swa(a).value
    assert s.host.swa_copies[-1] == ("load", [1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8])
    assert components.host_lru_order(s, "swa") == [] and components.lru_order(s, "swa") == [a]
    assert held == [1, 2]


def test_a_load_back_brings_back_one_window_of_swa_data_only():
    s = make(kv_slots=32, swa_slots=32, host_slots=64)
    put(s, [1, 2, 3, 4, 5, 6])               # A
    put(s, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # B below A
    a, b = node_at(s, [1, 2, 3, 4, 5, 6]), node_at(s, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    acks_done(s)
    components.evict(s, 12)                  # B, then A, go to the host
    sound(s)
    assert a.value is None and b.value is None
    m = rules.match_prefix(s, list(range(1, 13)))
    assert m.best_match_node is b and (m.host_hit_length, m.swa_host_hit_length) == (12, 6)
    indices, last = host.init_load_back(s, b, s.root, None)
    sound(s)
    assert last is b and len(indices) == 12 and a.value is not None
    # B's 6 units fill the window of 4: A's SWA data stays on the host only
    assert swa(b).value is not None and swa(a).value is None and swa(a).host_value is not None
    assert components.host_lru_order(s, "swa") == [a]


def test_a_short_swa_host_pool_evicts_host_only_swa_data_for_a_backup():
    s = make(host_swa_slots=4)
    put(s, [1, 2, 3, 4])                     # A backed up: its SWA data fills the SWA host pool
    a = node_at(s, [1, 2, 3, 4])
    acks_done(s)
    put(s, [1, 2, 3, 4, 5, 6])               # B below A: no SWA host room, the backup fails
    b = node_at(s, [1, 2, 3, 4, 5, 6])
    assert b.host_value is None and swa(b).host_value is None and s.host.pool.available_size() == 28
    assert components.evict(s, 0, swa_num_tokens=4)["swa"] == 4   # A (internal): SWA tombstone
    sound(s)
    assert swa(a).value is None and components.host_lru_order(s, "swa") == [a]
    put(s, [1, 2, 3, 4, 5, 6], prev=4)       # B's next hit: A's host-only SWA data makes room
    assert swa(b).host_value == (1, 2) and swa(a).host_value is None
    assert a.host_value == (1, 2, 3, 4)      # A keeps its Full host copy
    assert components.host_lru_order(s, "swa") == []


def test_a_load_back_without_swa_room_fails_and_changes_nothing():
    s = make(swa_slots=8)
    put(s, [1, 2, 3, 4])
    a = node_at(s, [1, 2, 3, 4])
    acks_done(s)
    components.evict(s, 4)                   # A to the host
    s.kv.alloc(8)                            # a request holds every SWA slot
    s.kv.take_freed()
    kv_before, swa_before = s.kv.available_size(), s.kv.swa.available_size()
    assert host.init_load_back(s, a, s.root, None) == ((), s.root)
    sound(s)
    assert a.value is None and swa(a).value is None and swa(a).host_value == (1, 2, 3, 4)
    assert (s.kv.available_size(), s.kv.swa.available_size()) == (kv_before, swa_before)
    assert s.host.loads == [] and s.host.swa_load is None


def test_an_insert_keeps_the_full_slots_of_a_tombstone_its_pending_backup_reads():
    """Issue 18 under a host tier: an SWA tombstone is backed up (its Full data only) and held
    by its write-through backup's lock, whose copy reads its full slots.  0.5.13.post1 frees
    them at an insert over it (and hands them out again while the copy is in flight); the spec
    keeps them and frees the caller's duplicates.  Such locks (a write's or a load's) hold the
    tombstone in 32 of the 35 known divergences of tests/corpus/upstream-host-swa."""
    s = make(write_through_threshold=3)
    put(s, [1, 2, 3, 4])                     # A: full [1..4], hit 1: not backed up yet
    put(s, [1, 2, 3, 4, 5, 6, 7, 8], prev=4)  # B below A (A's hit 2)
    a = node_at(s, [1, 2, 3, 4])
    assert components.evict(s, 0, swa_num_tokens=4)["swa"] == 4   # A: an SWA tombstone
    put(s, [1, 2, 3, 4], prev=4)             # A's third hit: backed up, locked by its write
    assert swa(a).value is None and a.host_value == (1, 2, 3, 4) and a.lock_ref == 1
    assert s.host.copies[-1] == ("backup", [1, 2, 3, 4], [1, 2, 3, 4])
    freed = put(s, [1, 2, 3, 4, 5, 6, 7, 8])  # inside its window: the seed would take A over
    assert freed == [9, 10, 11, 12, 13, 14, 15, 16]  # the caller's duplicates, all of them
    assert a.value == (1, 2, 3, 4) and swa(a).value is None
    assert s.host.writes[-1].node is a and all(s.kv.is_allocated(x) for x in a.value)


def test_a_host_lock_keeps_swa_host_data_from_host_eviction():
    s = make()
    put(s, [1, 2, 3, 4])
    a = node_at(s, [1, 2, 3, 4])
    acks_done(s)
    components.evict(s, 4)                   # A: on the host only, a host leaf
    handle = host.inc_host_lock_ref(s, a)
    sound(s)
    assert swa(a).host_lock_ref == 1 and components.host_lru_order(s, "swa") == []
    assert host.evict_host(s, 4) == 0 and components.evict_swa_host(s, 4) == 0
    host.dec_host_lock_ref(s, handle)
    sound(s)
    assert swa(a).host_lock_ref == 0 and components.host_lru_order(s, "swa") == [a]
    assert components.evict_swa_host(s, 4) == 4 and not rules.is_in_tree(s, a)
    sound(s)


def test_swa_and_mamba_under_a_host_tier_compose():
    s = make(components=("full", "swa", "mamba"), mamba_slots=4)
    put(s, [1, 2, 3, 4])
    a = node_at(s, [1, 2, 3, 4])
    assert swa(a).host_value == (1, 2, 3, 4) and a.aux["mamba"].host_value == (1,)
    acks_done(s)
    components.evict(s, 4)
    sound(s)
    m = rules.match_prefix(s, [1, 2, 3, 4])
    assert m.best_match_node is a
    assert (m.swa_host_hit_length, m.mamba_host_hit_length) == (4, 1)
    indices, last = host.init_load_back(s, a, s.root, None)
    sound(s)
    assert last is a and swa(a).value is not None and a.aux["mamba"].value is not None
