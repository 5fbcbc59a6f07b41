"""One unit test per rule of the spec's device tier, with hand-computed expectations.

Every number below is written literally and worked out by hand from the rules in
``spec/cache.py`` and the pool contract in TRACE.md ("Pools"); the comments show the working.
Every step goes through a helper that runs ``sanity_check`` afterwards, so each test also
checks the invariants after every step.

Pool reminder (page_size 1): page 0 is reserved, so the first alloc(n) returns ``[1 .. n]`` and
allocation is lowest-free-first.  Clock reminder: every touch takes the next tick; an insert
touches the root, then each node on its path (a split stamps the new upper part, then touches
the lower part), then stamps the new leaf; a match stamps its whole path with one tick T, the
matched node ``(T, 0)``, its parent ``(T, -1)``, ...
"""

from __future__ import annotations

import pytest

from uniradix.spec import cache as rules
from uniradix.spec import queries
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import AllocatorError, HandleError, NodeNotFound
from uniradix.spec.invariants import sanity_check
from uniradix.spec.snapshot import snapshot
from uniradix.spec.state import new_state

# ----------------------------------------------------------------------------------------------
# Helpers: each one is a single step followed by the sanity check
# ----------------------------------------------------------------------------------------------


def sound(state):
    assert sanity_check(state) == []


def make(**cfg):
    state = new_state(CacheConfig(**cfg))
    sound(state)
    return state


def alloc(state, n):
    slots = state.kv.alloc(n)
    sound(state)
    return slots


def insert(state, tokens, value, extra_key=None, prev_prefix_len=0):
    """Insert; returns (prefix_len, slots freed by this insert)."""
    state.kv.take_freed()
    out = rules.insert(state, tokens, extra_key, value, prev_prefix_len)
    sound(state)
    return out.prefix_len, state.kv.take_freed()


def match(state, tokens, extra_key=None):
    m = rules.match_prefix(state, tokens, extra_key)
    sound(state)
    return m


def lock(state, tokens, extra_key=None):
    h = rules.inc_lock_ref(state, rules.find_node(state, tokens, extra_key))
    sound(state)
    return h


def unlock(state, handle):
    rules.dec_lock_ref(state, handle)
    sound(state)


def evict(state, n):
    """Evict; returns (tokens evicted, slots freed)."""
    state.kv.take_freed()
    got = rules.evict(state, n)
    sound(state)
    return got, state.kv.take_freed()


def nodes(state):
    """{path tokens (tuple): value} of every node (snapshot order: sorted by path)."""
    return {tuple(n["path"]["tokens"]): n["value"] for n in snapshot(state)["nodes"]}


def locks(state):
    return {tuple(n["path"]["tokens"]): n["lock_ref"] for n in snapshot(state)["nodes"]}


def sizes(state):
    return (queries.evictable_size(state), queries.protected_size(state))


def leaf_order(state):
    return [tuple(p["tokens"]) for p in snapshot(state)["device_leaf_order"]]


A = [10, 11, 12, 13]
B = [10, 11, 30, 31, 32]  # shares the 2-token prefix [10, 11] with A


def tree_ab(state, prev_prefix_len_b=0):
    """A on slots [1,2,3,4], then B on fresh slots [5..9]; B's first two are duplicates."""
    assert alloc(state, 4) == [1, 2, 3, 4]
    assert insert(state, A, [1, 2, 3, 4]) == (0, [])
    assert alloc(state, 5) == [5, 6, 7, 8, 9]
    return insert(state, B, [5, 6, 7, 8, 9], prev_prefix_len=prev_prefix_len_b)


# ----------------------------------------------------------------------------------------------
# insert
# ----------------------------------------------------------------------------------------------


def test_insert_shared_prefix_frees_duplicates_from_zero():
    s = make(kv_slots=32)
    # B walks into A's node, shares 2 tokens -> prefix_len 2; with prev_prefix_len 0 the
    # request's own copies of those 2 tokens (value[0:2] = [5, 6]) are duplicates and are freed.
    assert tree_ab(s) == (2, [5, 6])
    # A is split after 2 tokens: upper [10,11] keeps A's slots [1,2], the rest [12,13] keeps
    # [3,4]; B's remainder [30,31,32] becomes a new leaf with value[2:] = [7,8,9].
    assert nodes(s) == {
        (10, 11): [1, 2],
        (10, 11, 12, 13): [3, 4],
        (10, 11, 30, 31, 32): [7, 8, 9],
    }
    # 9 slots were allocated, 2 came back: 32 - 9 + 2 = 25 free.
    assert s.kv.available_size() == 25
    # all 7 tree tokens are unlocked
    assert sizes(s) == (7, 0)


def test_insert_with_prev_prefix_len_frees_nothing_of_the_shared_part():
    s = make(kv_slots=32)
    assert alloc(s, 4) == [1, 2, 3, 4]
    assert insert(s, A, [1, 2, 3, 4]) == (0, [])
    # The scheduler's flow: match B first (gets the tree's slots [1,2] for [10,11]; the match
    # ends inside A's node, so A is split), allocate 3 slots for the rest, insert with
    # prev_prefix_len = 2: value[0:2] *are* the tree's slots, so nothing is a duplicate.
    m = match(s, B)
    assert m.device_indices == (1, 2)
    assert alloc(s, 3) == [5, 6, 7]
    assert insert(s, B, [1, 2, 5, 6, 7], prev_prefix_len=2) == (2, [])
    assert nodes(s) == {
        (10, 11): [1, 2],
        (10, 11, 12, 13): [3, 4],
        (10, 11, 30, 31, 32): [5, 6, 7],
    }
    # 7 slots allocated, none freed: 32 - 7 = 25
    assert s.kv.available_size() == 25


def test_insert_same_key_again_frees_every_fresh_slot():
    s = make(kv_slots=32)
    assert alloc(s, 4) == [1, 2, 3, 4]
    assert insert(s, A, [1, 2, 3, 4]) == (0, [])
    # A again on fresh slots [5..8]: all 4 tokens already cached -> prefix_len 4, all 4 fresh
    # slots are duplicates (prev_prefix_len 0), no node added.
    assert alloc(s, 4) == [5, 6, 7, 8]
    assert insert(s, A, [5, 6, 7, 8]) == (4, [5, 6, 7, 8])
    assert nodes(s) == {(10, 11, 12, 13): [1, 2, 3, 4]}
    # With prev_prefix_len 1 only value[1:4] are duplicates: slot 1 is the tree's own.
    assert alloc(s, 3) == [5, 6, 7]
    assert insert(s, A, [1, 5, 6, 7], prev_prefix_len=1) == (4, [5, 6, 7])
    assert nodes(s) == {(10, 11, 12, 13): [1, 2, 3, 4]}


# ----------------------------------------------------------------------------------------------
# match_prefix / split_node
# ----------------------------------------------------------------------------------------------


def test_match_inside_a_node_splits_it():
    s = make(kv_slots=32)
    assert alloc(s, 4) == [1, 2, 3, 4]
    assert insert(s, A, [1, 2, 3, 4]) == (0, [])
    assert len(nodes(s)) == 1
    # [10, 11, 99] shares 2 tokens with the 4-token node: split after 2.
    m = match(s, [10, 11, 99])
    assert m.device_indices == (1, 2)
    assert len(m.last_device_node.path_units()) == 2
    assert m.last_device_node is m.best_match_node
    # 1 node became 2: the upper part holds slots [1,2], the lower part [3,4]
    assert nodes(s) == {(10, 11): [1, 2], (10, 11, 12, 13): [3, 4]}
    # a match that ends at a node end splits nothing
    m = match(s, A + [14])
    assert m.device_indices == (1, 2, 3, 4)
    assert len(m.last_device_node.path_units()) == 4
    assert len(nodes(s)) == 2
    # a match sharing nothing: empty, last node is the root (path length 0)
    m = match(s, [99])
    assert m.device_indices == ()
    assert m.last_device_node is s.root
    assert len(nodes(s)) == 2


# ----------------------------------------------------------------------------------------------
# inc_lock_ref / dec_lock_ref
# ----------------------------------------------------------------------------------------------


def test_lock_protects_the_path_to_the_root():
    s = make(kv_slots=32)
    tree_ab(s)
    # nodes: P=[10,11] (2 tokens), A'=[..12,13] (2), B'=[..30,31,32] (3)
    assert sizes(s) == (7, 0)
    h = lock(s, B)
    # B' and its parent P are locked: protected 3 + 2 = 5; A' stays evictable: 2
    assert sizes(s) == (2, 5)
    assert locks(s) == {(10, 11): 1, (10, 11, 12, 13): 0, (10, 11, 30, 31, 32): 1}
    h2 = lock(s, [10, 11])  # P a second time
    assert sizes(s) == (2, 5)
    assert locks(s)[(10, 11)] == 2
    unlock(s, h)
    # P still held by h2: protected 2, evictable 2 + 3 = 5
    assert sizes(s) == (5, 2)
    unlock(s, h2)
    assert sizes(s) == (7, 0)
    assert set(locks(s).values()) == {0}


def test_lock_on_the_root_locks_nothing():
    s = make(kv_slots=32)
    tree_ab(s)
    h = lock(s, [])
    assert h.node is s.root
    assert sizes(s) == (7, 0)
    assert set(locks(s).values()) == {0}
    unlock(s, h)
    assert sizes(s) == (7, 0)
    with pytest.raises(HandleError):  # released once already
        rules.dec_lock_ref(s, h)
    sound(s)


def test_lock_survives_a_split():
    s = make(kv_slots=32)
    assert alloc(s, 4) == [1, 2, 3, 4]
    assert insert(s, A, [1, 2, 3, 4]) == (0, [])
    h = lock(s, A)
    assert sizes(s) == (0, 4)
    # the match splits the locked node after 2 tokens; the new upper part inherits the count
    m = match(s, [10, 11, 50])
    assert m.device_indices == (1, 2)
    assert locks(s) == {(10, 11): 1, (10, 11, 12, 13): 1}
    assert sizes(s) == (0, 4)
    # an insert that splits the lower part again ([12] | [13]) keeps every count too
    assert alloc(s, 4) == [5, 6, 7, 8]
    assert insert(s, [10, 11, 12, 77], [5, 6, 7, 8]) == (3, [5, 6, 7])
    assert locks(s) == {(10, 11): 1, (10, 11, 12): 1, (10, 11, 12, 13): 1, (10, 11, 12, 77): 0}
    # protected: 2 + 1 + 1 = 4 (the old path); evictable: the new leaf [77] on slot 8
    assert sizes(s) == (1, 4)
    unlock(s, h)  # walks the path again, through both new upper parts
    assert set(locks(s).values()) == {0}
    assert sizes(s) == (5, 0)


# ----------------------------------------------------------------------------------------------
# evict
# ----------------------------------------------------------------------------------------------


def test_evict_skips_locked_leaves_oldest_first_whole_nodes():
    s = make(kv_slots=32)
    # X=[1,2] on slots [1,2] (stamp tick 2), Y=[3,4,5] on [3,4,5] (tick 4), Z=[6] on [6]
    # (tick 6): each insert touches the root first, then stamps its new leaf.
    assert alloc(s, 2) == [1, 2]
    assert insert(s, [1, 2], [1, 2]) == (0, [])
    assert alloc(s, 3) == [3, 4, 5]
    assert insert(s, [3, 4, 5], [3, 4, 5]) == (0, [])
    assert alloc(s, 1) == [6]
    assert insert(s, [6], [6]) == (0, [])
    assert leaf_order(s) == [(1, 2), (3, 4, 5), (6,)]
    hx = lock(s, [1, 2])
    assert leaf_order(s) == [(3, 4, 5), (6,)]
    # oldest unlocked leaf is Y: asking for 1 token frees all of Y's 3
    assert evict(s, 1) == (3, [3, 4, 5])
    assert evict(s, 1) == (1, [6])
    # only the locked X is left: nothing evictable
    assert evict(s, 5) == (0, [])
    assert nodes(s) == {(1, 2): [1, 2]}
    unlock(s, hx)
    assert evict(s, 1) == (2, [1, 2])
    assert nodes(s) == {}
    assert s.kv.available_size() == 32


def test_evict_parent_becomes_leaf_and_goes_next():
    s = make(kv_slots=32)
    # ticks: insert A: root 1, A 2.  insert B: root 3, A 4, split -> upper P 5, lower A' 6,
    # new leaf B' 7.  Slots 5,6 came back, so Z=[40] gets slot 5: root 8, Z 9.
    tree_ab(s)
    assert alloc(s, 1) == [5]
    assert insert(s, [40], [5]) == (0, [])
    assert leaf_order(s) == [(10, 11, 12, 13), (10, 11, 30, 31, 32), (40,)]
    assert evict(s, 1) == (2, [3, 4])  # A' (tick 6)
    assert evict(s, 1) == (3, [7, 8, 9])  # B' (tick 7); P (tick 5) is a leaf now
    assert leaf_order(s) == [(10, 11), (40,)]
    assert evict(s, 1) == (2, [1, 2])  # P (tick 5) before Z (tick 9)
    assert evict(s, 1) == (1, [5])
    assert nodes(s) == {}


def test_evict_many_at_once():
    s = make(kv_slots=32)
    tree_ab(s)
    # asking for 3 tokens: A' (2) is not enough, B' (3) makes 5 >= 3, stop there
    assert evict(s, 3) == (5, [3, 4, 7, 8, 9])
    assert nodes(s) == {(10, 11): [1, 2]}
    assert evict(s, 0) == (0, [])


def test_eviction_order_after_a_match_refreshes_a_path():
    s = make(kv_slots=32)
    tree_ab(s)  # ticks: P 5, A' 6, B' 7 (see the test above)
    assert alloc(s, 1) == [5]
    assert insert(s, [40], [5]) == (0, [])  # root 8, Z 9
    # match A (tick 10): A' -> (10, 0), P -> (10, -1), root -> (10, -2)
    assert match(s, A).device_indices == (1, 2, 3, 4)
    p, a, b, z = (rules.find_node(s, t, None) for t in ([10, 11], A, B, [40]))
    assert a.stamp == (10, 0) and p.stamp == (10, -1) and s.root.stamp == (10, -2)
    assert b.stamp == (7, 0) and z.stamp == (9, 0)
    # the ancestor is older than its descendant, newer than everything stamped before
    assert z.stamp < p.stamp < a.stamp
    assert alloc(s, 1) == [6]
    assert insert(s, [50], [6]) == (0, [])  # root 11, W 12
    assert leaf_order(s) == [(10, 11, 30, 31, 32), (40,), (10, 11, 12, 13), (50,)]
    assert evict(s, 1) == (3, [7, 8, 9])  # B' (7)
    assert evict(s, 1) == (1, [5])  # Z (9)
    assert evict(s, 1) == (2, [3, 4])  # A' (10, 0)
    assert leaf_order(s) == [(10, 11), (50,)]  # P (10, -1) before W (12, 0)
    assert evict(s, 1) == (2, [1, 2])
    assert evict(s, 1) == (1, [6])
    assert nodes(s) == {}


# ----------------------------------------------------------------------------------------------
# page_size > 1
# ----------------------------------------------------------------------------------------------


def test_page_size_4_truncates_to_whole_pages():
    s = make(page_size=4, kv_slots=32)
    # page 0 (slots 0..3) is reserved: the first alloc(8) gets pages 1,2 = slots 4..11
    slots = alloc(s, 8)
    assert slots == [4, 5, 6, 7, 8, 9, 10, 11]
    # 7 tokens -> one whole page of 4: value cut to slots [4,5,6,7]
    assert insert(s, [1, 2, 3, 4, 5, 6, 7], slots[:7]) == (0, [])
    assert nodes(s) == {(1, 2, 3, 4): [4, 5, 6, 7]}
    m = match(s, [1, 2, 3, 4, 5, 6, 7])
    assert m.device_indices == (4, 5, 6, 7)
    assert len(m.last_device_node.path_units()) == 4
    # a 3-token query is shorter than a page: matches nothing and changes nothing (not even
    # the clock)
    before, clock = snapshot(s), s.clock
    m = match(s, [1, 2, 3])
    assert m.device_indices == () and m.last_device_node is s.root
    assert snapshot(s) == before and s.clock == clock
    # a 3-token insert caches nothing and frees nothing
    assert insert(s, [1, 2, 3], [8, 9, 10]) == (0, [])
    assert snapshot(s) == before
    # 7 tokens again on fresh pages 3,4 (slots 12..19): the first page is cached -> prefix_len
    # 4, the duplicate page [12..15] is freed; the unaligned tail stays with the caller
    assert alloc(s, 8) == [12, 13, 14, 15, 16, 17, 18, 19]
    assert insert(s, [1, 2, 3, 4, 5, 6, 7], [12, 13, 14, 15, 16, 17, 18]) == (4, [12, 13, 14, 15])
    assert s.kv.is_allocated(16) and not s.kv.is_allocated(12)


def test_page_size_4_splits_on_page_boundaries():
    s = make(page_size=4, kv_slots=32)
    assert alloc(s, 8) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert insert(s, [1, 2, 3, 4, 5, 6, 7, 8], [4, 5, 6, 7, 8, 9, 10, 11]) == (0, [])
    # [1,2,3,4,5,6,9,9] shares 6 tokens, i.e. 1 whole page: split after 4
    m = match(s, [1, 2, 3, 4, 5, 6, 9, 9])
    assert m.device_indices == (4, 5, 6, 7)
    assert nodes(s) == {(1, 2, 3, 4): [4, 5, 6, 7], (1, 2, 3, 4, 5, 6, 7, 8): [8, 9, 10, 11]}


# ----------------------------------------------------------------------------------------------
# extra_key namespaces
# ----------------------------------------------------------------------------------------------


def test_extra_key_isolation():
    s = make(kv_slots=32)
    assert alloc(s, 3) == [1, 2, 3]
    assert insert(s, [1, 2, 3], [1, 2, 3], extra_key="a") == (0, [])
    assert alloc(s, 3) == [4, 5, 6]
    # same tokens under "b": nothing shared, nothing freed
    assert insert(s, [1, 2, 3], [4, 5, 6], extra_key="b") == (0, [])
    snap = snapshot(s)["nodes"]
    assert [(n["path"]["extra_key"], n["path"]["tokens"], n["value"]) for n in snap] == [
        ("a", [1, 2, 3], [1, 2, 3]), ("b", [1, 2, 3], [4, 5, 6])]
    assert match(s, [1, 2, 3], "a").device_indices == (1, 2, 3)
    assert match(s, [1, 2, 3], "b").device_indices == (4, 5, 6)
    m = match(s, [1, 2, 3], None)
    assert m.device_indices == () and m.last_device_node is s.root
    # sharing a prefix across namespaces splits nothing
    assert match(s, [1, 2], "c").device_indices == ()
    assert len(snapshot(s)["nodes"]) == 2
    # locking "a" leaves "b" evictable: evict frees exactly b's slots
    h = lock(s, [1, 2, 3], "a")
    assert evict(s, 100) == (3, [4, 5, 6])
    unlock(s, h)
    assert evict(s, 100) == (3, [1, 2, 3])


# ----------------------------------------------------------------------------------------------
# EAGLE bigram keys
# ----------------------------------------------------------------------------------------------


def test_bigram_keys():
    s = make(kv_slots=32, eagle=True)
    # 4 tokens -> 3 bigram units (1,2),(2,3),(3,4); value cut to 3 slots: [1,2,3]
    assert alloc(s, 4) == [1, 2, 3, 4]
    assert insert(s, [1, 2, 3, 4], [1, 2, 3, 4]) == (0, [])
    assert nodes(s) == {(1, 2, 3, 4): [1, 2, 3]}
    assert s.kv.is_allocated(4)  # the cut slot is still the caller's
    # [1,2,3,9] differs only in the last token: units (1,2),(2,3) shared = n - 2 = 2
    assert alloc(s, 4) == [5, 6, 7, 8]
    assert insert(s, [1, 2, 3, 9], [5, 6, 7, 8]) == (2, [5, 6])
    # split after 2 units: upper spans tokens [1,2,3] (slots [1,2]); lower unit (3,4) keeps
    # slot [3]; the new leaf unit (3,9) gets value[2] = 7
    assert nodes(s) == {(1, 2, 3): [1, 2], (1, 2, 3, 4): [3], (1, 2, 3, 9): [7]}
    m = match(s, [1, 2, 3, 4])
    assert m.device_indices == (1, 2, 3)
    assert len(m.last_device_node.path_units()) == 3
    m = match(s, [1, 2, 3, 5])
    assert m.device_indices == (1, 2)
    assert len(m.last_device_node.path_units()) == 2
    # a single token is no unit at all
    assert match(s, [1]).device_indices == ()


# ----------------------------------------------------------------------------------------------
# disable
# ----------------------------------------------------------------------------------------------


def test_disable_mode():
    s = make(kv_slots=32, disable=True)
    assert alloc(s, 3) == [1, 2, 3]
    assert insert(s, [1, 2, 3], [1, 2, 3]) == (0, [])
    assert insert(s, [1, 2, 3], [1, 2, 3]) == (0, [])  # frees nothing, caches nothing
    assert nodes(s) == {}
    m = match(s, [1, 2, 3])
    assert m.device_indices == () and m.last_device_node is s.root
    assert evict(s, 10) == (0, [])
    h = lock(s, [])
    unlock(s, h)
    assert s.kv.available_size() == 29  # the 3 slots are still the caller's


# ----------------------------------------------------------------------------------------------
# reset
# ----------------------------------------------------------------------------------------------


def test_reset_empties_everything_and_rejects_old_handles():
    s = make(kv_slots=32)
    tree_ab(s)
    h = lock(s, B)
    old_node = h.node
    rules.reset(s)
    sound(s)
    assert snapshot(s) == {"nodes": [], "device_leaf_order": [],
                           "sizes": {"full_evictable": 0, "full_protected": 0},
                           "pool": [], "requests": []}
    assert s.kv.available_size() == 32
    assert s.kv.allocated_pages() == frozenset()
    with pytest.raises(HandleError):
        rules.dec_lock_ref(s, h)
    with pytest.raises(NodeNotFound):
        rules.inc_lock_ref(s, old_node)
    with pytest.raises(AllocatorError):  # the old slots are no longer allocated
        s.kv.free([1])
    sound(s)
    # the pool is lowest-first from scratch
    assert alloc(s, 2) == [1, 2]
    assert insert(s, A[:2], [1, 2]) == (0, [])
    assert nodes(s) == {(10, 11): [1, 2]}
