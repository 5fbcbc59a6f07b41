"""An unlock whose walk passes a node split off after the lock was taken (spec and fast in
lockstep, snapshots and invariants compared after every step).

Full path locks: the upper part of a split takes the lower part's lock count, so an unlock that
walks through it takes off exactly what the split copied there (not a bug, as in 0.5.13.post1).
Skipped nodes are another matter: a lock skips the evicted nodes (Full, with a host tier) or the
nodes without SWA data (a window lock); an upper part split off one of them after the lock must
be skipped too, or the unlock takes off a lock another holder took on it since
(tests/corpus/regressions-host-aux/host-swa-unlock-after-split-of-skipped-node.jsonl)."""

from stories import SpecAndFast
from uniradix.spec.config import CacheConfig


def locks(adapter) -> dict:
    """Per node path: (Full lock count, SWA lock count or None)."""
    out = {}
    for n in adapter.snapshot()["nodes"]:
        swa = n.get("swa")
        out[tuple(n["path"]["tokens"])] = (n["lock_ref"], None if swa is None else swa["lock_ref"])
    return out


def node(tokens):
    return {"tokens": tokens, "extra_key": None}


def test_full_unlock_through_an_upper_part_takes_the_copied_count():
    s = SpecAndFast(CacheConfig(page_size=1, kv_slots=32))
    s.step("alloc", n=4)
    s.step("insert", tokens=[1, 2, 3, 4], extra_key=None, value=[1, 2, 3, 4])
    h1 = s.step("lock", node=node([1, 2, 3, 4]))["handle"]
    s.step("alloc", n=2)
    s.step("insert", tokens=[1, 2, 5, 6], extra_key=None, value=[1, 2, 5, 6],
           prev_prefix_len=2)  # splits at 2
    assert locks(s.a) == {(1, 2): (1, None), (1, 2, 3, 4): (1, None), (1, 2, 5, 6): (0, None)}
    h2 = s.step("lock", node=node([1, 2, 5, 6]))["handle"]
    s.step("unlock", handle=h1)  # walks [1,2,3,4] and the split-off [1,2]: both counted it
    assert locks(s.a) == {(1, 2): (1, None), (1, 2, 3, 4): (0, None), (1, 2, 5, 6): (1, None)}
    assert s.step("sizes") == {"full_evictable": 2, "full_protected": 4}
    s.step("unlock", handle=h2)
    assert s.step("sizes") == {"full_evictable": 6, "full_protected": 0}


def test_full_lock_on_an_evicted_node_skips_its_upper_part_after_a_split():
    s = SpecAndFast(CacheConfig(page_size=1, kv_slots=16, host_slots=32))
    s.step("alloc", n=4)
    s.step("insert", tokens=[1, 2, 3, 4], extra_key=None, value=[1, 2, 3, 4])
    s.step("io_complete", writes=-1, loads=0)
    s.step("check_hicache_events")
    s.step("evict", num_tokens=4)
    h1 = s.step("lock", node=node([1, 2, 3, 4]))["handle"]  # skips the evicted node
    s.step("match_prefix", tokens=[1, 2, 9], extra_key=None)  # splits it at 2
    s.step("load_back", node=node([1, 2]), last_device_node=node([]), mem_quota=None)
    h2 = s.step("lock", node=node([1, 2]))["handle"]
    s.step("unlock", handle=h1)
    assert locks(s.a)[(1, 2)] == (2, None)  # the load's lock and h2's
    s.step("io_complete", writes=0, loads=-1)
    s.step("check_hicache_events")
    assert s.step("sizes") == {"full_evictable": 0, "full_protected": 2}
    s.step("unlock", handle=h2)
    assert s.step("sizes") == {"full_evictable": 2, "full_protected": 0}


def test_swa_window_lock_skips_the_upper_part_of_a_skipped_node_after_a_split():
    s = SpecAndFast(CacheConfig(page_size=1, components=["full", "swa"], kv_slots=16,
                                swa_slots=16, sliding_window=2, host_slots=32, host_swa_slots=32))
    s.step("alloc", n=4)
    s.step("insert", tokens=[1, 2, 3, 4], extra_key=None, value=[1, 2, 3, 4])
    s.step("io_complete", writes=-1, loads=0)
    s.step("check_hicache_events")
    s.step("evict", num_tokens=4)
    h1 = s.step("lock", node=node([1, 2, 3, 4]))["handle"]  # Full and SWA skip the node
    s.step("match_prefix", tokens=[1, 2, 9], extra_key=None)
    s.step("load_back", node=node([1, 2]), last_device_node=node([]), mem_quota=None)
    h2 = s.step("lock", node=node([1, 2]))["handle"]
    assert locks(s.a)[(1, 2)] == (2, 2)
    s.step("unlock", handle=h1)  # took h2's SWA lock off before the fix
    assert locks(s.a)[(1, 2)] == (2, 2)
    s.step("io_complete", writes=0, loads=-1)
    s.step("check_hicache_events")
    assert locks(s.a)[(1, 2)] == (1, 1)
    assert s.step("sizes") == {"full_evictable": 0, "full_protected": 2,
                               "swa_evictable": 0, "swa_protected": 2}
    s.step("unlock", handle=h2)
    assert locks(s.a)[(1, 2)] == (0, 0)


def test_swa_window_lock_over_a_tombstone_split_by_an_insert():
    """Without a host tier: the window lock skips an SWA tombstone that its Full lock holds; an
    insert splits the tombstone (it keeps its slots: another holder's) and another lock is
    taken below; every SWA count stays what the live locks took."""
    s = SpecAndFast(CacheConfig(page_size=1, components=["full", "swa"], kv_slots=32,
                                swa_slots=32, sliding_window=4))
    s.step("alloc", n=6)
    s.step("insert", tokens=[1, 2, 3, 4, 5, 6], extra_key=None, value=[1, 2, 3, 4, 5, 6],
           swa_evicted_seqlen=4)  # [1..4] is an SWA tombstone
    h1 = s.step("lock", node=node([1, 2, 3, 4, 5, 6]))["handle"]
    s.step("alloc", n=2)
    s.step("insert", tokens=[1, 2, 7, 8], extra_key=None, value=[1, 2, 7, 8],
           prev_prefix_len=2)  # splits at 2
    h2 = s.step("lock", node=node([1, 2, 7, 8]))["handle"]
    assert locks(s.a) == {(1, 2): (2, 0), (1, 2, 3, 4): (1, 0), (1, 2, 3, 4, 5, 6): (1, 1),
                          (1, 2, 7, 8): (1, 1)}
    s.step("unlock", handle=h1)
    assert locks(s.a) == {(1, 2): (1, 0), (1, 2, 3, 4): (0, 0), (1, 2, 3, 4, 5, 6): (0, 0),
                          (1, 2, 7, 8): (1, 1)}
    s.step("unlock", handle=h2)
    assert all(v == (0, 0) for v in locks(s.a).values())


def test_swa_lock_count_invariant_catches_a_count_no_lock_took():
    from uniradix.spec import cache as rules
    from uniradix.spec.components import data, swa_lock_counts
    from uniradix.spec.state import new_state

    state = new_state(CacheConfig(page_size=1, components=["full", "swa"], kv_slots=8,
                                  swa_slots=8, sliding_window=2))
    slots = state.kv.alloc(2)
    rules.insert(state, [1, 2], None, tuple(slots))
    leaf = rules.find_node(state, [1, 2], None)
    handle = rules.inc_lock_ref(state, leaf)
    assert swa_lock_counts(state) == []
    data(leaf, "swa").lock_ref -= 1
    assert any("swa lock_ref=0 but 1" in e for e in swa_lock_counts(state))
    data(leaf, "swa").lock_ref += 1
    rules.dec_lock_ref(state, handle)
    assert swa_lock_counts(state) == []
