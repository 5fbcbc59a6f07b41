"""fast/structures.py: the lazy heap and the LRU list on their own, against plain models."""

from __future__ import annotations

import random

import pytest

from uniradix.fast.structures import LazyHeap, LruList


class Item:
    """A stand-in node: an id for heap ties, a stamp, membership, and the LRU links."""

    __slots__ = ("id", "last_access_time", "member", "lru_prev", "lru_next")

    def __init__(self, i: int) -> None:
        self.id, self.last_access_time, self.member = i, 0, False
        self.lru_prev = self.lru_next = None

    def __lt__(self, other: Item) -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        return f"Item({self.id})"


def live(item: Item) -> bool:  # membership; the heap checks the stamp
    return item.member


def test_heap_pops_oldest_live_and_skips_stale():
    h = LazyHeap()
    a, b, c = Item(1), Item(2), Item(3)
    for stamp, it in ((5, a), (3, b), (7, c)):
        it.last_access_time, it.member = stamp, True
        h.push(stamp, it)
    b.last_access_time = 9  # touched: the entry (3, b) is stale now
    h.push(9, b)
    c.member = False  # left the order: (7, c) is stale
    assert h.ordered(live) == [a, b]
    assert h.live_ids(live) == {id(a), id(b)}
    popped = [h.pop() for _ in range(len(h))]
    assert popped == [(3, b), (5, a), (7, c), (9, b)]
    assert not h
    with pytest.raises(IndexError):
        h.pop()


def test_heap_ties_break_on_the_node_order():
    h = LazyHeap()
    items = [Item(i) for i in (4, 2, 3)]
    for it in items:
        h.push(1, it)
    assert [h.pop()[1].id for _ in range(3)] == [2, 3, 4]


def test_compact_keeps_the_list_object_and_one_live_entry_per_node():
    h = LazyHeap()
    entries = h.entries
    items = [Item(i) for i in range(100)]
    for it in items:
        it.member = True
        for stamp in range(1, 4):  # three entries each, only the last is live
            it.last_access_time = stamp * 1000 + it.id
            h.push(it.last_access_time, it)
    for it in items[::2]:
        it.member = False
    assert h.needs_compaction(live_bound=50)  # 300 > 4 * (50 + 16)
    want = h.ordered(live)
    h.compact(live)
    assert h.entries is entries  # the C core holds this list: never replaced
    assert len(h) == 50 and h.ordered(live) == want
    assert [h.pop()[1] for _ in range(50)] == want
    assert not h.needs_compaction(live_bound=0)


def test_needs_compaction_threshold():
    h = LazyHeap()
    for i in range(65):
        h.push(i, Item(i))
    assert h.needs_compaction(0)  # 65 > 64 and 65 > 4 * 16
    assert not h.needs_compaction(1)  # 65 <= 4 * 17
    h.clear()
    assert len(h) == 0 and not h.needs_compaction(0)


def test_heap_matches_a_sorted_model_under_random_touches():
    rng = random.Random(12)
    h = LazyHeap()
    items = [Item(i) for i in range(30)]
    clock = 0
    for _ in range(500):
        it = rng.choice(items)
        op = rng.random()
        if op < 0.6:
            clock += 1
            it.last_access_time, it.member = clock, True
            h.push(clock, it)
        elif op < 0.8:
            it.member = False
        elif h.needs_compaction(sum(x.member for x in items)) or op < 0.85:
            h.compact(live)
        model = sorted((x for x in items if x.member), key=lambda x: (x.last_access_time, x.id))
        assert h.ordered(live) == model


def lru_model_check(lst: LruList, model: list) -> None:
    assert lst.oldest_first() == model
    assert list(lst) == model
    assert lst.oldest() is (model[0] if model else None)
    assert lst.violations({id(x) for x in model}) == []


def test_lru_list_against_a_python_list():
    rng = random.Random(7)
    lst = LruList()
    items = [Item(i) for i in range(20)]
    model: list = []  # oldest first
    lru_model_check(lst, model)
    for _ in range(400):
        it = rng.choice(items)
        if it in model:
            op = rng.random()
            if op < 0.4:
                lst.remove(it)
                model.remove(it)
                assert it.lru_prev is None and it.lru_next is None
            elif op < 0.7:
                lst.move_to_front(it)
                model.remove(it)
                model.append(it)
            else:
                others = [x for x in model if x is not it]
                prev = rng.choice(others) if others else lst.head
                lst.move_after(prev, it)
                model.remove(it)
                # after prev in newest-first order = just before prev in oldest-first order
                model.insert(model.index(prev) if prev is not lst.head else len(model), it)
        else:
            lst.push_front(it)
            model.append(it)
        lru_model_check(lst, model)


def test_lru_iteration_survives_unlinking_the_current_member():
    lst = LruList()
    items = [Item(i) for i in range(5)]
    for it in items:
        lst.push_front(it)
    seen = []
    for it in lst:
        seen.append(it)
        if it.id % 2 == 0:
            lst.remove(it)
    assert seen == items
    assert lst.oldest_first() == [items[1], items[3]]


def test_lru_violations_name_the_damage():
    lst = LruList()
    a, b = Item(1), Item(2)
    lst.push_front(a)
    lst.push_front(b)
    assert lst.violations({id(a)}) == [
        "[lru] list holds 2 nodes, 1 hold aux data (or different ones)"]
    a.lru_prev = lst.head  # b -> a, but a points back past b
    assert any("broken back link" in e for e in lst.violations({id(a), id(b)}))
    a.lru_next = None  # the list stops before its tail
    assert any("does not reach its tail" in e for e in lst.violations({id(a), id(b)}))
