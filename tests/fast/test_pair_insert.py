"""fast/hybrid.py ``_insert``'s pair path (the stock SWA and Mamba plug-ins together, no host
tier) with its walk, new leaf and commits in C (fast/_core.c "composed tree: cinsert",
``pair_insert``, and the plan's ``one_plan``) against the general path's Python loop, in one
process.

Two caches driven alike: one runs ``insert`` as it is (``_pair_insert`` on), its twin with
``_pair_insert`` off (the Python loop and ``_plan``).  After every step the two must agree on
everything an insert writes: each node's fields (stamps included), both records of each
node, both LRU orders, the clock, the counters, the leaf heap entry by entry, the frees the
allocators saw, and the results.  Recorded random sequences of Full + SWA + Mamba at pages 1
and 4 (components in both orders), and scenarios: a new leaf split at the window's start, a
leaf wholly outside the window, SWA tombstones taking the caller's slots, a locked
tombstone, a node that already holds a state, splits of planned nodes."""

from __future__ import annotations

import dataclasses

import pytest

from aux_twins import Counting, Twins, insert_with_state, pages, tree_state, twins_on_recorded_run

torch = pytest.importorskip("torch")

from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config  # noqa: E402
from uniradix.fast import hybrid  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")

ORDERS = [("full", "swa", "mamba"), ("full", "mamba", "swa")]


@pytest.fixture
def counting(monkeypatch):
    c = Counting(_core.pair_insert)
    monkeypatch.setattr(hybrid, "_core", _Core(c))
    return c


class _Core:
    """The C core's module with ``pair_insert`` counted (hybrid.py reads it there)."""

    def __init__(self, counting):
        self.pair_insert = counting

    def __getattr__(self, name):
        return getattr(_core, name)


def _general(adapter):
    assert adapter.cache._pair_insert is True
    adapter.cache._pair_insert = False
    return adapter


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("name,seed", [("full-swa-mamba-p1", 11), ("full-swa-mamba-p1", 12),
                                       ("full-swa-mamba-p4", 13), ("full-swa-mamba-p4", 14)])
def test_c_pair_insert_equals_general_path_in_lockstep(name, seed, order, counting):
    ops = twins_on_recorded_run(name, seed, order, _general, ["C insert", "general insert"])
    assert "insert" in ops
    assert counting.taken == counting.calls > 10


class Twin(Twins):
    """``c`` with the C pair insert, ``py`` on the general path; the invariants hold after
    every step on both."""

    def __init__(self, config):
        super().__init__(make_adapter("fast", config), _general(make_adapter("fast", config)))

    def __call__(self, op: str, **args):
        out = super().__call__(op, **args)
        assert self.c.violations() == [] and self.py.violations() == []
        return out


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_pair_insert_scenario(ps, order, counting):
    base = make_config("full-swa-mamba-p1", 1)
    t = Twin(dataclasses.replace(base, page_size=ps, kv_slots=4096, swa_slots=4096,
                                 sliding_window=2 * ps, mamba_slots=64,
                                 mamba_cache_chunk_size=ps, components=order))
    a = pages(ps, *range(1, 9))
    insert_with_state(t, a[:3 * ps], swa_evicted_seqlen=ps)  # a new leaf split at the window's start
    insert_with_state(t, a[:3 * ps])  # the same key: the node holds a state already (mamba_exist)
    insert_with_state(t, a[:5 * ps], swa_evicted_seqlen=5 * ps)  # wholly outside the window: no leaf
    insert_with_state(t, a[:6 * ps], swa_evicted_seqlen=4 * ps)  # a leaf below, a tombstone split off
    insert_with_state(t, a[:2 * ps] + pages(ps, 9))  # a split of a planned node
    t("evict", num_tokens=0, swa_num_tokens=2 * ps)  # tombstones
    h = t("lock", node={"tokens": a[:3 * ps], "extra_key": None})["handle"]
    insert_with_state(t, a[:8 * ps])  # the tombstones take the caller's slots (or keep them: locked)
    t("unlock", handle=h)
    t("evict", num_tokens=0, mamba_num=2)
    insert_with_state(t, a[:3 * ps])  # a node without a state: it takes one, its stamp renewed
    insert_with_state(t, a[:8 * ps], prev=3 * ps)
    t("evict", num_tokens=0, swa_num_tokens=4 * ps)
    insert_with_state(t, a[:8 * ps], prev=2 * ps, swa_evicted_seqlen=2 * ps)
    insert_with_state(t, a[:4 * ps] + pages(ps, 30, 31), extra_key=None)
    assert counting.taken == counting.calls >= 9


@needs_core
def test_left_to_the_general_path():
    """A planned node without Full data is declined with nothing changed; a policy order, an
    EAGLE cache and a subclass with its own ``_new_node`` never take the C insert."""
    base = make_config("full-swa-mamba-p1", 1)
    t = Twin(dataclasses.replace(base, kv_slots=4096, swa_slots=4096, mamba_slots=64))
    a = pages(1, *range(1, 6))
    insert_with_state(t, a)
    cache = t.c.cache
    node = next(iter(cache.root_node.children.values()))
    before = tree_state(t.c.cache)
    value = torch.arange(100, 105, dtype=torch.int64)
    state_ = torch.tensor([7], dtype=torch.int64)
    saved, node.value = node.value, None
    plan = [(node, 5)]
    from array import array
    assert _core.pair_insert(cache, cache.swa, cache.mamba, plan, value, array("q", a), None,
                             0, 0, 5, 5, state_, 1) is None
    node.value = saved
    assert tree_state(t.c.cache) == before
    assert make_adapter("fast", dataclasses.replace(base, eagle=True)).cache._pair_insert is False
    assert make_adapter("fast", dataclasses.replace(
        base, eviction_policy="lfu")).cache._pair_insert is False
    plain = make_adapter("fast", base).cache
    assert plain._pair_insert is True

    class Own(type(plain)):
        def _new_node(self, *args):
            return super()._new_node(*args)

    plain.__class__ = Own
    plain._pick_fast_paths()
    assert plain._pair_insert is False
