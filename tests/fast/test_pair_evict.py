"""fast/pair_evict.py ``evict_pair`` (the evict of the stock SWA and Mamba plug-ins together, no
host tier: fast/hybrid.py's general driver written out), with its loops in C (fast/_core.c
"composed tree: pair evict", ``pair_evict``) and with the Python loops alone (the C core's
function taken away), against the general driver, in one process.

Two caches driven alike: one runs ``evict`` as it is (``_evict_fast`` is ``evict_pair``,
counted), its twin with ``_evict_fast`` off (the general driver: ``_evict_units``, then each
component's ``drive``).  After every step the two must agree on everything an evict writes:
each node's fields and both records, both LRU orders, the counters, the leaf heap entry by
entry (the list's own layout), the free batch each ``_release`` got (its runs of ``free`` /
``free_swa`` pieces and its states, in order), the frees the pools logged, the slot ledgers,
the KV events in order, and the results.  Recorded random sequences of Full + SWA + Mamba at
pages 1 and 4 (components in both orders, the conformance pools: slot validation on), random
requests over the bench's SWA free-list allocator and a plain state allocator (their free
lists compared; no slot validation, KV events on), and scenarios: an SWA drop of an internal
node that cascades to its Mamba state, a locked state there kept, Mamba drops of internal
nodes, leaves evicted through either list, an event callback that raises half way; and no
reference left behind by the C loops."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from aux_twins import (
    Counting,
    Twins,
    assert_no_leaks,
    evict_or_unlock,
    hold_or_unlock,
    insert_with_state,
    pages,
    recorded_run,
    tree_state,
)

torch = pytest.importorskip("torch")

from test_one_aux_c_cevict import Events, StateAllocator, _give_back, _outcome  # noqa: E402

import uniradix.fast as fast  # noqa: E402
from stories import replay_twins  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.bench.hybrid import SwaFreeListAllocator  # noqa: E402
from uniradix.conformance.explore.driver import make_config  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import pair_evict  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

ORDERS = [("full", "swa", "mamba"), ("full", "mamba", "swa")]


class _Core:
    """pair_evict's view of the C core: the real module, with ``pair_evict`` counted."""

    def __init__(self, counting: Counting) -> None:
        self.pair_evict = counting

    def __getattr__(self, name: str) -> Any:
        return getattr(_core, name)


@pytest.fixture(params=["c", "python"])
def loops(request, monkeypatch):
    """How ``evict_pair`` runs its loops: "c" (the C core's ``pair_evict``, counted: the
    fixture's value) or "python" (no C core for it: None)."""
    if request.param == "python":
        monkeypatch.setattr(pair_evict, "_core", None)
        return None
    if _core is None:
        pytest.skip("the C core is not built or not in use")
    counting = Counting(_core.pair_evict)
    monkeypatch.setattr(pair_evict, "_core", _Core(counting))
    return counting


def _watch(cache) -> list:
    """Each ``_release`` of ``cache`` logged: the batch's runs and states as lists."""
    log: list = []
    inner = cache._release

    def release(batch):
        log.append(([(m, [p.tolist() for p in pieces]) for m, pieces in batch.runs],
                    [s.tolist() for s in batch.states]))
        inner(batch)

    cache._release = release
    return log


def _ours(cache) -> Counting:
    """``cache`` on evict_pair, counted (taken: it answered, not None)."""
    assert cache._evict_fast is pair_evict.evict_pair
    counting = Counting(pair_evict.evict_pair)
    cache._evict_fast = counting
    return counting


def _general(cache):
    assert cache._evict_fast is pair_evict.evict_pair
    cache._evict_fast = None
    return cache


def _ledgers(cache) -> tuple:
    return (sorted(cache._owned), sorted(cache.mamba.owned))


def _same(c_cache, py_cache, logs) -> None:
    assert tree_state(c_cache) == tree_state(py_cache)
    assert logs[0] == logs[1]
    assert _ledgers(c_cache) == _ledgers(py_cache)
    assert c_cache.take_events() == py_cache.take_events()


@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("name,seed", [("full-swa-mamba-p1", 21), ("full-swa-mamba-p1", 22),
                                       ("full-swa-mamba-p4", 23), ("full-swa-mamba-p4", 24)])
def test_pair_evict_equals_the_general_driver_in_lockstep(name, seed, order, loops):
    config, steps = recorded_run(name, seed, order)
    if loops is not None:  # (the recording's evicts ran through it too)
        loops.calls = loops.taken = 0
    c_side, py_side = make_adapter("fast", config), make_adapter("fast", config)
    counting = _ours(c_side.cache)
    _general(py_side.cache)
    assert c_side.cache.validate_slots and py_side.cache.validate_slots
    logs = [_watch(c_side.cache), _watch(py_side.cache)]
    ls = Lockstep([c_side, py_side], ["pair evict", "general evict"], events=False)
    ops = replay_twins(ls, steps, lambda step: _same(c_side.cache, py_side.cache, logs))
    assert "evict" in ops
    # the pair's evict took every call with amounts it takes (a recorded bad amount goes to
    # the general path, which refuses it)
    assert counting.calls > 10 and counting.taken >= 0.9 * counting.calls
    assert any(runs or states for runs, states in logs[0])
    if loops is not None:  # (C: it did every one)
        assert loops.calls == counting.taken and loops.taken == loops.calls


# ----------------------------------------------------------------------------------------------
# Random requests over free-list allocators (their lists compared), KV events on
# ----------------------------------------------------------------------------------------------


def _build(ps: int, order: tuple, general: bool):
    alloc = SwaFreeListAllocator(64 * ps, 32 * ps, ps, torch)
    states = StateAllocator(12)
    pool = type("Pool", (), {"mamba_allocator": states, "mamba_pool": None})()
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=order, sliding_window_size=2 * ps, enable_kv_cache_events=True,
        validate_slots=False))
    counting = _general(cache) if general else _ours(cache)
    cache._events = Events(cache, cache._events)
    return cache, alloc, states, counting, _watch(cache)


def _pools(alloc, states) -> tuple:
    return (alloc._free.tolist(), [p.tolist() for p in alloc._released],
            alloc.swa._free.tolist(), [p.tolist() for p in alloc.swa._released],
            alloc.full_to_swa.tolist(), states.free_slots.tolist(), states.log)


def slots_for(side, node, lock, need: int) -> tuple:
    """A request's ``need`` slots and one state, its shortfall evicted first: (the evict's
    outcome, the slots, the state); the slots None where either could not be had (what was
    taken went back, the lock too).  (tests/fast/test_pair_insert_api.py's too.)"""
    cache, alloc, states = side[:3]
    ev = _outcome(lambda: cache.evict(fast.EvictParams(
        num_tokens=max(need - alloc.full_available_size(), 0),
        swa_num_tokens=max(need - alloc.swa_available_size(), 0),
        mamba_num=max(1 - states.available_size(), 0))))
    fresh = alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
    state = states.alloc(1)
    if fresh is None or state is None:
        _give_back(cache, alloc, states, node, lock, need, fresh, state)
        return ev, None, None
    return ev, fresh, state


def _request(side, tokens, e_pick, held) -> tuple:
    """A scheduler round trip: match, lock, evict the shortfall (Full, SWA and one state),
    alloc, insert (its SWA window per ``e_pick``), unlock or keep the lock (``held``)."""
    cache, alloc, states = side[:3]
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
    node = m.last_device_node
    lock = cache.inc_lock_ref(node)
    matched = len(m.device_indices)
    need = len(tokens) - matched
    ev, fresh, state = slots_for(side, node, lock, need)
    if fresh is None:
        return ("aborted", ev)
    ps = cache.page_size
    e = (0, 0, matched // ps * ps, len(tokens) // 2 // ps * ps)[e_pick]
    res = cache.insert(fast.InsertParams(
        key=fast.RadixKey(tokens), value=torch.cat([m.device_indices, fresh.to(torch.int64)]),
        prev_prefix_len=matched, swa_evicted_seqlen=e, mamba_value=state.reshape(1).clone()))
    if res.mamba_exist:
        states.free(state.reshape(1))
    hold_or_unlock(cache, node, lock, held)
    return (m.device_indices.tolist(), ev, res.prefix_len, res.mamba_exist)


def _compare(sides, step, violations: bool = True) -> None:
    (c, ca, cs, _, clog), (p, pa, ps_, _, plog) = sides
    assert tree_state(c) == tree_state(p), step
    assert [(s, tuple(n.key)) for s, n in c._heap] == [(s, tuple(n.key)) for s, n in p._heap]
    assert _pools(ca, cs) == _pools(pa, ps_), step
    assert clog == plog, step
    assert c._events.seen == p._events.seen, step
    assert c.take_events() == p.take_events(), step
    if violations:
        assert c.violations() == [] and p.violations() == [], step


@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(2))
def test_random_requests_over_free_lists(ps, order, seed, loops):
    sides = [_build(ps, order, general) for general in (False, True)]
    rng = random.Random(seed * 31 + ps)
    prompts = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 6) * ps)] for _ in range(6)]
    helds: list[list] = [[], []]
    for step in range(220):
        # an evict of random amounts (sometimes more than the tree holds), a held lock going
        outs = evict_or_unlock(rng.random(), rng, sides, helds, ps, _outcome, (2 ** 70,))
        if outs is None:
            tokens = rng.choice(prompts) + [rng.randrange(1, 9)
                                            for _ in range(rng.randrange(0, 4) * ps)]
            pick = rng.randrange(4)
            hold = rng.random() < 0.15 and len(helds[0]) < 3
            outs = [_request(s, tokens, pick, held if hold else None)
                    for s, held in zip(sides, helds, strict=True)]
        assert outs[0] == outs[1], (step, outs)
        _compare(sides, step)
    counting = sides[0][3]
    assert counting.calls > 30 and counting.taken == counting.calls
    # the evicts freed through every branch: leaves off the heap, SWA tombstones, states
    runs = [m for batch_runs, _ in sides[0][4] for m, _ in batch_runs]
    assert "free" in runs and "free_swa" in runs
    assert any(states for _, states in sides[0][4])
    if loops is not None:
        assert loops.taken == loops.calls == counting.calls


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_an_event_error_half_way_leaves_what_the_general_driver_leaves(fail_at, loops):
    """``events.removed`` raising at its n-th call of an evict: the same exception, and after
    it the same tree, heap, counters, free lists and batches as the general driver leaves
    (what was taken before the error is freed, in the ``finally``); then they go on alike."""
    sides = [_build(1, ORDERS[0], general) for general in (False, True)]
    rng = random.Random(7)
    for _ in range(40):
        tokens = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 7))]
        outs = [_request(s, tokens, 0, None) for s in sides]
        assert outs[0] == outs[1]
    _compare(sides, "setup")
    for s in sides:
        s[0]._events.seen.clear()
        s[0]._events.fail_at = fail_at
    params = fast.EvictParams(num_tokens=6, swa_num_tokens=8, mamba_num=3)
    outs = [_outcome(lambda s=s: s[0].evict(params)) for s in sides]
    assert outs[0] == outs[1] and outs[0][0] == "raised", outs
    assert len(sides[0][0]._events.seen) == fail_at
    # (the leaf whose event raised was popped and is no longer on the heap, under both: the
    # general driver's own state after such an error, which the invariants flag)
    _compare(sides, "failed", violations=False)
    for s in sides:
        s[0]._events.fail_at = -1
    params = fast.EvictParams(num_tokens=100, swa_num_tokens=100, mamba_num=100)
    outs = [_outcome(lambda s=s: s[0].evict(params)) for s in sides]
    assert outs[0] == outs[1]
    _compare(sides, "after", violations=False)  # (the lost leaf stays lost)


# ----------------------------------------------------------------------------------------------
# Scenarios on the conformance pools (slot validation on), KV events on
# ----------------------------------------------------------------------------------------------


class Twin(Twins):
    """``c`` on evict_pair (counted), ``py`` on the general driver; after every step the
    batches, ledgers and KV events agree too, and the invariants hold on both."""

    def __init__(self, config):
        super().__init__(make_adapter("fast", config), make_adapter("fast", config))
        for side in (self.c, self.py):
            side.start_kv_events(None)
        self.counting = _ours(self.c.cache)
        _general(self.py.cache)
        self.logs = [_watch(self.c.cache), _watch(self.py.cache)]
        assert self.c.cache.validate_slots

    def both(self, fn):
        out = super().both(fn)
        _same(self.c.cache, self.py.cache, self.logs)
        assert self.c.violations() == [] and self.py.violations() == []
        return out

    def each(self, fn) -> None:
        """``fn(cache)`` on both caches (a change the ops cannot make), then compared."""
        self.both(lambda side: fn(side.cache))

    def node(self, tokens):
        return self.c.cache.find_node(fast.RadixKey(list(tokens)))

    def last_batch(self):
        return self.logs[0][-1]


def _twin(ps: int, order) -> Twin:
    base = make_config("full-swa-mamba-p1", 1)
    return Twin(dataclasses.replace(base, page_size=ps, kv_slots=4096, swa_slots=4096,
                                    sliding_window=ps, mamba_slots=64,
                                    mamba_cache_chunk_size=ps, components=order))


def _internal_with_state(t, ps, a):
    """``a[:2ps]`` an internal node with SWA data and a state (older in both lists than its
    leaf ``a[2ps:4ps]``, which holds both too)."""
    insert_with_state(t, a[:2 * ps])
    insert_with_state(t, a[:4 * ps])
    node = t.node(a[:2 * ps])
    assert node.children and all(r.value is not None for r in node.aux)
    return node


def _scene(ps: int, order) -> tuple:
    """Twins (:func:`_twin`), the pages, and the internal node of :func:`_internal_with_state`."""
    t = _twin(ps, order)
    a = pages(ps, *range(1, 9))
    return t, a, _internal_with_state(t, ps, a)


def _recs(node, cache) -> tuple:
    return node.aux[cache.swa.i], node.aux[cache.mamba.i]


@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 4])
def test_swa_drop_of_an_internal_node_cascades_to_its_state(ps, order, loops):
    t, a, node = _scene(ps, order)
    out = t("evict", num_tokens=0, swa_num_tokens=1)
    assert (out["num_tokens_evicted"], out["swa_num_tokens_evicted"],
            out["mamba_num_evicted"]) == (0, 2 * ps, 1)
    swa_rec, mamba_rec = _recs(node, t.c.cache)
    assert swa_rec.value is None and mamba_rec.value is None and node.value is not None
    runs, states = t.last_batch()
    assert [m for m, _ in runs] == ["free_swa"] and len(states) == 1
    assert t.counting.taken == t.counting.calls >= 1


@pytest.mark.parametrize("ps", [1, 4])
def test_a_locked_state_stays_through_the_cascade(ps, loops):
    """An internal node whose SWA data is not locked but whose Mamba state is (the stock lock
    walks lock SWA data on the node they lock, so the state's lock is set on both caches
    alike, with its counts): the SWA drop tombstones the node, the state stays."""
    t, a, node = _scene(ps, ORDERS[0])
    h = t("lock", node={"tokens": a[:4 * ps], "extra_key": None})["handle"]

    def lock_state(cache, d=1):
        n = cache.find_node(fast.RadixKey(a[:2 * ps]))
        rec = n.aux[cache.mamba.i]
        rec.lock += d
        n.aux_lock += d
        cache.mamba.evictable -= d
        cache.mamba.protected += d

    t.each(lock_state)
    out = t("evict", num_tokens=0, swa_num_tokens=2 * ps + 1)
    assert out["swa_num_tokens_evicted"] == 2 * ps and out["mamba_num_evicted"] == 0
    swa_rec, mamba_rec = _recs(node, t.c.cache)
    assert swa_rec.value is None and mamba_rec.value is not None
    t.each(lambda cache: lock_state(cache, -1))
    t("unlock", handle=h)
    out = t("evict", num_tokens=0, mamba_num=1)
    assert out["mamba_num_evicted"] == 1 and mamba_rec.value is None
    assert t.counting.taken == t.counting.calls >= 2


@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 4])
def test_mamba_drops_of_internal_nodes_and_leaves_through_either_list(ps, order, loops):
    t, a, node = _scene(ps, order)
    swa_rec, mamba_rec = _recs(node, t.c.cache)
    out = t("evict", num_tokens=0, mamba_num=1)  # the internal node's state: the oldest
    assert (out["num_tokens_evicted"], out["swa_num_tokens_evicted"],
            out["mamba_num_evicted"]) == (0, 0, 1)
    assert mamba_rec.value is None and swa_rec.value is not None  # (no cascade up)
    assert t.last_batch()[0] == [] and len(t.last_batch()[1]) == 1  # (no KV or SWA run)
    out = t("evict", num_tokens=0, mamba_num=1)  # the leaf, whole, through the Mamba list
    assert (out["num_tokens_evicted"], out["swa_num_tokens_evicted"],
            out["mamba_num_evicted"]) == (2 * ps, 2 * ps, 1)
    assert [m for m, _ in t.last_batch()[0]] == ["free"]
    assert not node.children  # (a leaf now, without a state)
    out = t("evict", num_tokens=0, swa_num_tokens=1)  # it, whole, through the SWA list
    assert (out["num_tokens_evicted"], out["swa_num_tokens_evicted"],
            out["mamba_num_evicted"]) == (2 * ps, 2 * ps, 0)
    assert not t.c.cache.root_node.children
    # off the heap: the leaf, then its parent through the entry the deletion pushed
    b = pages(ps, *range(11, 19))
    node = _internal_with_state(t, ps, b)
    out = t("evict", num_tokens=1)
    assert (out["num_tokens_evicted"], out["mamba_num_evicted"]) == (2 * ps, 1)
    assert t.node(b[:2 * ps]) is node and not node.children
    out = t("evict", num_tokens=1)
    assert (out["num_tokens_evicted"], out["mamba_num_evicted"]) == (2 * ps, 1)
    assert not t.c.cache.root_node.children
    assert t.counting.taken == t.counting.calls >= 5


def test_left_to_the_general_driver():
    """Amounts that are not non-negative ints and a cache with metrics go to the general
    driver (evict_pair answers None); a policy order, an EAGLE cache, a host tier and a
    subclass with its own leaf deletion never take it; the C loops decline arguments that
    are not what evict_pair passes, having changed nothing."""
    base = make_config("full-swa-mamba-p1", 1)
    cache = make_adapter("fast", base).cache
    assert cache._evict_fast is pair_evict.evict_pair
    for bad in ({"num_tokens": -1}, {"num_tokens": 1.0}, {"num_tokens": 1, "mamba_num": True}):
        params = fast.EvictParams(**{"num_tokens": 0, **bad})
        assert pair_evict.evict_pair(cache, params) is None
    assert make_adapter("fast", dataclasses.replace(base, eagle=True)).cache._evict_fast is None
    assert make_adapter("fast", dataclasses.replace(
        base, eviction_policy="lfu")).cache._evict_fast is None
    hosted = make_adapter("fast", dataclasses.replace(base, host_slots=2 * base.kv_slots))
    assert hosted.cache.tier is not None and hosted.cache._evict_fast is None

    class Own(type(cache)):
        def _delete_leaf(self, node, tracker, batch):
            return super()._delete_leaf(node, tracker, batch)

    cache.__class__ = Own
    cache._pick_fast_paths()
    assert cache._evict_fast is None
    if _core is None:
        return
    t = _twin(1, ORDERS[0])
    a = pages(1, *range(1, 9))
    _internal_with_state(t, 1, a)
    c = t.c.cache
    before = tree_state(c)
    swa, mamba = c.swa, c.mamba
    for args in ((1, 1, 1, [], ()), (1, 1, 1, (), []), (True, 1, 1, [], []),
                 (1, -1, 1, [], []), (1, 1, 1.0, [], [])):
        assert _core.pair_evict(c, swa, mamba, *args) is None
    for owner, name in ((swa, "evictable"), (mamba, "evictable"), (c, "_evictable"),
                        (swa, "i")):
        kept = getattr(owner, name)
        setattr(owner, name, float(kept))  # (not an exact int)
        assert _core.pair_evict(c, swa, mamba, 1, 1, 1, [], []) is None
        setattr(owner, name, kept)
    heap = c._heap
    c._heap = tuple(heap)
    assert _core.pair_evict(c, swa, mamba, 1, 1, 1, [], []) is None
    c._heap = heap
    assert tree_state(c) == before
    with pytest.raises(TypeError):
        _core.pair_evict(c, swa, mamba, 1, 1, 1, [])
    assert tree_state(c) == before


def test_no_reference_left_behind(loops):
    """The same evicts over and over: the reference counts of the objects the loops touch
    (the root, both lists' ends, the components) and the number of live objects do not
    grow."""
    import sys

    def round_trip():
        side = _build(1, ORDERS[0], False)
        cache = side[0]
        for i in range(12):
            _request(side, [i % 3 + 1, i % 5 + 2, 7, i + 1], i % 4, None)
        cache.evict(fast.EvictParams(num_tokens=3, swa_num_tokens=2, mamba_num=1))
        cache.evict(fast.EvictParams(num_tokens=1000, swa_num_tokens=1000, mamba_num=1000))
        return cache

    probe = round_trip()

    def marks():
        return tuple(sys.getrefcount(o) for o in (
            probe.root_node, probe.swa.lru.head, probe.mamba.lru.tail, probe.swa, probe.mamba))

    assert_no_leaks(round_trip, marks)
