"""fast/hybrid.py ``match_prefix``'s pair branch (the stock SWA and Mamba plug-ins together, no
host tier) in C (fast/_core.c "composed tree: cmatch", ``pair_match``) against the general
path's Python code, in one process.

Two caches driven alike: one runs ``match_prefix`` as it is (``_match_fast`` is
``_core.pair_match``, where it does not decline), its twin with ``_match_fast`` off (the
general path).  After every step the two must agree on everything a match writes or reads:
each node's fields (stamps included), both records of each node, both LRU orders, the clock,
the counters, the leaf heap entry by entry, and the results.  Recorded random sequences of
Full + SWA + Mamba at pages 1 and 4 (components in both orders), and scenarios: the Mamba
state rule with the SWA run counted on, splits, tombstones, locks, the branching length, a
copy-on-write match and an EAGLE cache left to the general path."""

from __future__ import annotations

import dataclasses

import pytest

from aux_twins import (
    Counting,
    Twins,
    insert_with_state,
    pages,
    result_view,
    tree_state,
    twins_on_recorded_run,
)

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


def _general(adapter):
    """The adapter's cache on the general path (its pair match off)."""
    assert adapter.cache._match_fast is _core.pair_match
    adapter.cache._match_fast = None
    return adapter


ORDERS = [("full", "swa", "mamba"), ("full", "mamba", "swa")]


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("name,seed", [("full-swa-mamba-p1", 1), ("full-swa-mamba-p1", 2),
                                       ("full-swa-mamba-p4", 3), ("full-swa-mamba-p4", 4)])
def test_c_pair_match_equals_general_path_in_lockstep(name, seed, order, monkeypatch):
    counting = Counting(_core.pair_match)
    twins_on_recorded_run(name, seed, order, _general, ["C match", "general match"],
                          lambda c_side: setattr(c_side.cache, "_match_fast", counting))
    assert counting.taken == counting.calls > 20


class Twin(Twins):
    """``c`` with the C pair match (counted), ``py`` on the general path."""

    def __init__(self, config):
        super().__init__(make_adapter("fast", config), _general(make_adapter("fast", config)))
        self.counting = Counting(_core.pair_match)
        self.c.cache._match_fast = self.counting

    def match(self, tokens, **params):
        return self.both(lambda side: result_view(side.cache.match_prefix(
            fast.MatchPrefixParams(key=fast.RadixKey(list(tokens)), **params))))


def _twin(ps: int, order=ORDERS[0]):
    base = make_config("full-swa-mamba-p1", 1)
    return Twin(dataclasses.replace(base, page_size=ps, kv_slots=4096, swa_slots=4096,
                                    sliding_window=2 * ps, mamba_slots=64,
                                    mamba_cache_chunk_size=ps, components=order))


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_pair_scenario(ps, order):
    t = _twin(ps, order)
    a = pages(ps, *range(1, 9))
    t.match(a)  # an empty tree
    insert_with_state(t, a[:3 * ps])  # a state at page 3, SWA data on all three
    insert_with_state(t, a, prev=3 * ps, swa_evicted_seqlen=4 * ps)  # pages 4: a tombstone, 5-8 data
    r = t.match(a)
    assert len(r[0]) == 8 * ps  # the run after the tombstone fills the window, a state there
    t.match(a[:6 * ps])  # a split below the state: matched up to page 3, a branching length
    t.match(a[:2 * ps])  # a split above the first state: nothing, a branching length
    t.match(a[:4 * ps] + pages(ps, 9))  # a split inside the tombstone
    t("evict", num_tokens=0, mamba_num=1)  # the oldest state goes: SWA data without a state
    t.match(a)
    t.match(a[:3 * ps])
    h = t("lock", node={"tokens": a[:3 * ps], "extra_key": None})["handle"]
    t.match(a[:3 * ps])  # a locked node: no leaf push
    t("evict", num_tokens=0, swa_num_tokens=3 * ps)  # tombstones: the run restarts
    t.match(a)
    t("unlock", handle=h)
    insert_with_state(t, a[:3 * ps] + pages(ps, 20, 21))  # a branch
    t.match(a[:3 * ps] + pages(ps, 20, 21))
    t("evict", num_tokens=4 * ps, swa_num_tokens=0)
    t.match(a)
    t.match(a[: ps - 1] if ps > 1 else [])  # no whole page: the empty answer
    assert t.counting.taken == t.counting.calls >= 12


@needs_core
def test_left_to_the_general_path():
    """A copy-on-write match is declined, nothing changed (the general path answers); an
    EAGLE cache, a subclass with its own hook and a policy order never take the C match."""
    t = _twin(1)
    a = pages(1, *range(1, 6))
    insert_with_state(t, a)
    before = tree_state(t.c.cache)
    p = fast.MatchPrefixParams(key=fast.RadixKey(a), cow_mamba=True)
    assert _core.pair_match(t.c.cache, p) is None
    assert tree_state(t.c.cache) == before
    t.c.cache._pair = (0, 2 ** 80, 1)  # a window that is not an int64: declined
    assert _core.pair_match(t.c.cache, fast.MatchPrefixParams(key=fast.RadixKey(a))) is None
    assert tree_state(t.c.cache) == before
    base = make_config("full-swa-mamba-p1", 1)
    eagle = make_adapter("fast", dataclasses.replace(base, eagle=True)).cache
    assert eagle._pair is not None and eagle._match_fast is None
    lfu = make_adapter("fast", dataclasses.replace(base, eviction_policy="lfu")).cache
    assert lfu._match_fast is None
    cache = make_adapter("fast", base).cache
    assert cache._match_fast is _core.pair_match

    class Own(type(cache)):
        def _stamp_path(self, node):
            super()._stamp_path(node)

    cache.__class__ = Own
    cache._pick_fast_paths()
    assert cache._match_fast is None
