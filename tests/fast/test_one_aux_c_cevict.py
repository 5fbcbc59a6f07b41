"""The C loops of the one-component evicts (fast/_core.c "composed tree: cevict":
``aux_evict_swa`` and ``aux_evict_mamba``, called by fast/one_aux.py ``evict_swa`` and
``_evict_mamba``) against the Python loops they stand for.

Twin caches in one process: one runs the C loops, its twin the Python loops of the same
function (one_aux's view of the C core is a proxy whose evict functions decline for the
twin).  Both get the same random requests (shared prefixes, held locks, SWA windows evicted by
the caller, Mamba states, evictions of random sizes, pages 1 and 16) and must agree at every
step: the answers, the whole tree (keys, slots, records, locks, stamps), the Full heap as a
list (heapq's layout, not only its entries), the component's LRU order, the counters, the
allocators' free lists and the KV events.  An event callback that reads the counters and one
that raises half way check the error path: the same exception, the same state after it."""

from __future__ import annotations

import random
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_mamba_direct_frees import ListAllocator  # noqa: E402  (tests/fast's own)

import uniradix.fast as fast  # noqa: E402
from aux_twins import assert_no_leaks, hold_or_unlock  # noqa: E402  (tests/aux_twins.py)
from uniradix.conformance.bench.hybrid import SwaFreeListAllocator  # noqa: E402
from uniradix.fast import one_aux  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

pytestmark = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


class _Core:
    """one_aux's ``_core``: the real module, except that the two evict loops decline (None)
    for a cache marked ``_cevict_python`` (the twin: the Python loops run), and the C calls
    that did the work are counted."""

    def __init__(self) -> None:
        self.done: list = []

    def __getattr__(self, name: str) -> Any:
        return getattr(_core, name)

    def aux_evict_swa(self, cache, *args):
        if getattr(cache, "_cevict_python", False):
            return None
        r = _core.aux_evict_swa(cache, *args)
        self.done.append(r)
        return r

    def aux_evict_mamba(self, cache, *args):
        if getattr(cache, "_cevict_python", False):
            return None
        r = _core.aux_evict_mamba(cache, *args)
        self.done.append(r)
        return r


class StateAllocator(ListAllocator):
    """A Mamba state / KV allocator outside sglang (test_mamba_direct_frees.py's: a free list
    ``free`` appends to, and a log of every ``free`` call's slots) that says its frees append."""

    uniradix_free_order = "append"


class Events:
    """A cache's KV event queue seen through a proxy: each ``removed`` call records the node's
    key and the counters at that moment (Full, then each component's), and the ``fail_at``-th
    call raises.  (tests/fast/test_pair_evict.py's too.)"""

    def __init__(self, cache, inner) -> None:
        self.cache, self.inner, self.seen, self.fail_at = cache, inner, [], -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def removed(self, node) -> None:
        c = self.cache
        self.seen.append((tuple(node.key), c._evictable, *[a.evictable for a in c.components]))
        if len(self.seen) == self.fail_at:
            raise RuntimeError(f"removed failed at {tuple(node.key)}")
        self.inner.removed(node)


def _build(kind: str, ps: int, python: bool, events: bool, window: int):
    if kind == "swa":
        alloc = SwaFreeListAllocator(48 * ps, 24 * ps, ps, torch)
        pool, comps, states = None, ("full", "swa"), None
    else:
        alloc, states = StateAllocator(48 * ps), StateAllocator(10)
        pool = type("Pool", (), {"mamba_allocator": states, "mamba_pool": None})()
        comps = ("full", "mamba")
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=comps, sliding_window_size=window if kind == "swa" else None,
        enable_kv_cache_events=events, validate_slots=False))
    assert cache._evict_fast is not None  # (the one-component fast paths)
    cache._cevict_python = python
    if events:
        cache._events = Events(cache, cache._events)
    return cache, alloc, states


def _path(node) -> tuple:
    out = []
    while node.parent is not None:
        out.append(tuple(node.key))
        node = node.parent
    return tuple(reversed(out))


def _state(cache, alloc, states) -> tuple:
    """Everything an evict may change, in a form two caches of one process compare in."""
    nodes, todo = [], [cache.root_node]
    while todo:
        node = todo.pop()
        rec = node.aux[0] if node.aux else None
        nodes.append((_path(node), None if node.value is None else node.value.tolist(),
                      None if rec is None or rec.value is None else rec.value.tolist(),
                      None if rec is None else rec.lock, node.lock_ref, node.aux_lock,
                      node.dev_children, node.last_access_time))
        todo.extend(sorted(node.children.values(), key=lambda c: tuple(c.key), reverse=True))
    comp = cache._one_aux[0]
    lru, x = [], comp.lru.head.lru_next
    while x is not comp.lru.tail:
        lru.append(_path(x.node))
        x = x.lru_next
    heap = [(stamp, _path(node)) for stamp, node in cache._heap]  # (the list's own layout)
    if isinstance(alloc, SwaFreeListAllocator):
        pools = (alloc._free.tolist(), [p.tolist() for p in alloc._released],
                 alloc.swa._free.tolist(), [p.tolist() for p in alloc.swa._released],
                 alloc.full_to_swa.tolist())
    else:
        pools = (alloc.free_slots.tolist(), alloc.log, states.free_slots.tolist(), states.log)
    return (nodes, lru, heap, cache._evictable, cache._protected, comp.evictable,
            comp.protected, pools)


def _outcome(fn) -> Any:
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001 - the error itself is compared
        return ("raised", type(e).__name__, str(e))
    if isinstance(r, fast.EvictResult):
        return (r.num_tokens_evicted, r.swa_num_tokens_evicted, r.mamba_num_evicted)
    return r


def _give_back(cache, alloc, states, node, lock, need, fresh, state) -> None:
    """A request that did not get all its slots: what it got goes back, its lock goes.
    (tests/fast/test_pair_evict.py's too.)"""
    if fresh is not None and need:
        alloc.free(fresh)
    if state is not None:
        states.free(state)
    cache.dec_lock_ref(node, lock.to_dec_params())


def _request(cache, alloc, states, tokens, pick, held) -> tuple:
    """One scheduler round trip: match, lock, evict the shortfall, alloc, insert, unlock
    (or keep the lock: ``held``)."""
    kind_swa = states is None
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
    node = m.last_device_node
    lock = cache.inc_lock_ref(node)
    matched = len(m.device_indices)
    need = len(tokens) - matched
    if kind_swa:
        short = (need - alloc.full_available_size(), need - alloc.swa_available_size(), 0)
    else:
        short = (need - alloc.available_size(), 0, 1 - states.available_size())
    ev = _outcome(lambda: cache.evict(fast.EvictParams(
        num_tokens=max(short[0], 0), swa_num_tokens=max(short[1], 0),
        mamba_num=max(short[2], 0))))
    fresh = alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
    state = None if kind_swa else states.alloc(1)
    if fresh is None or (not kind_swa and state is None):
        _give_back(cache, alloc, states, node, lock, need, fresh, state)
        return ("aborted", ev)
    value = torch.cat([m.device_indices, fresh.to(torch.int64)])
    ps = cache.page_size
    if kind_swa:
        e = (0, 0, matched // ps * ps, len(tokens) // 2 // ps * ps)[pick]
        params = fast.InsertParams(key=fast.RadixKey(tokens), value=value,
                                   prev_prefix_len=matched, swa_evicted_seqlen=e)
    else:
        params = fast.InsertParams(key=fast.RadixKey(tokens), value=value,
                                   mamba_value=state.reshape(1).clone(), prev_prefix_len=matched)
    res = cache.insert(params)
    if not kind_swa and res.mamba_exist:
        states.free(state.reshape(1))
    hold_or_unlock(cache, node, lock, held)
    return (m.device_indices.tolist(), ev, res.prefix_len)


def _twins(kind: str, ps: int, seed: int, events: bool, monkeypatch, window: int = 4):
    proxy = _Core()
    monkeypatch.setattr(one_aux, "_core", proxy)
    return proxy, [_build(kind, ps, python, events, window) for python in (False, True)]


def _run(kind: str, ps: int, seed: int, events: bool, monkeypatch, rounds: int = 220) -> list:
    """Random requests and evictions on the twins, compared after every step; returns the C
    calls' answers."""
    proxy, twins = _twins(kind, ps, seed, events, monkeypatch)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 6) * ps)] for _ in range(6)]
    helds: list[list] = [[], []]
    for step in range(rounds):
        r = rng.random()
        if r < 0.2:  # an evict of random size (sometimes more than the tree holds)
            aux = rng.randrange(0, 12 * ps)
            params = fast.EvictParams(
                num_tokens=rng.choice((0, ps, 3 * ps, 40 * ps, 2 ** 70)),
                swa_num_tokens=aux if kind == "swa" else 0, mamba_num=0 if kind == "swa" else aux % 4)
            outs = [_outcome(lambda c=c, p=params: c.evict(p)) for c, _, _ in twins]
        elif r < 0.3 and helds[0]:  # a held lock goes
            i = rng.randrange(len(helds[0]))
            outs = []
            for (c, _, _), held in zip(twins, helds, strict=True):
                node, lock = held.pop(i)
                outs.append(c.dec_lock_ref(node, lock.to_dec_params()).delta)
        else:
            tokens = rng.choice(prompts) + [rng.randrange(1, 9)
                                            for _ in range(rng.randrange(0, 4) * ps)]
            pick = rng.randrange(4)
            hold = rng.random() < 0.15 and len(helds[0]) < 3
            outs = [_request(c, a, s, tokens, pick, held if hold else None)
                    for (c, a, s), held in zip(twins, helds, strict=True)]
        assert outs[0] == outs[1], (step, outs)
        assert _state(*twins[0]) == _state(*twins[1]), step
        if events:
            assert twins[0][0]._events.seen == twins[1][0]._events.seen, step
            assert twins[0][0].take_events() == twins[1][0].take_events(), step
        for c, _, _ in twins:
            assert c.violations() == [], step
    return proxy.done


@pytest.mark.parametrize("kind", ["swa", "mamba"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_c_loops_equal_the_python_loops(kind, ps, seed, monkeypatch):
    done = _run(kind, ps, seed, seed == 1, monkeypatch)
    # the C loops ran and did the work: calls that took both Full units and the component's
    assert all(d is not None for d in done)
    assert sum(1 for full, units in done if full and units) >= 3, done


@pytest.mark.parametrize("kind", ["swa", "mamba"])
@pytest.mark.parametrize("ps", [1, 16])
def test_internal_records_dropped(kind, ps, monkeypatch):
    """The LRU loop's other branch: records of internal nodes (a prompt, then longer ones
    through it) lose their data without their node (SWA: a tombstone, its SWA slots a
    ``free_swa`` run; Mamba: the state), oldest first, locked ones passed over."""
    proxy, twins = _twins(kind, ps, 3, True, monkeypatch)
    base = [1] * ps + [2] * ps
    held: list[list] = [[], []]
    for i, tail in enumerate(([], [3] * ps, [4] * ps, [3] * ps + [5] * ps)):
        outs = [_request(c, a, s, base + tail, 0, h if i == 2 else None)
                for (c, a, s), h in zip(twins, held, strict=True)]
        assert outs[0] == outs[1]

    def nodes(cache, internal_with_data: bool) -> set:
        """The internal nodes holding the component's data, or every node without it."""
        out, todo = set(), list(cache.root_node.children.values())
        while todo:
            node = todo.pop()
            todo.extend(node.children.values())
            has = node.aux[0].value is not None
            if (bool(node.children) and has) if internal_with_data else not has:
                out.add(_path(node))
        return out

    before = nodes(twins[0][0], True)
    assert before
    outs = [_outcome(lambda c=c: c.evict(fast.EvictParams(
        num_tokens=0, swa_num_tokens=100 * ps, mamba_num=100))) for c, _, _ in twins]
    assert outs[0] == outs[1]
    assert _state(*twins[0]) == _state(*twins[1])
    assert twins[0][0]._events.seen == twins[1][0]._events.seen
    assert before & nodes(twins[0][0], False)  # (data dropped, their nodes kept)
    assert proxy.done[-1] is not None and proxy.done[-1][1] > 0


@pytest.mark.parametrize("kind", ["swa", "mamba"])
@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_an_error_half_way_leaves_what_the_python_leaves(kind, fail_at, monkeypatch):
    """``events.removed`` raising at its n-th call of an evict: the same exception, and the
    tree, counters, heap and free lists after it as under the Python loops (what was taken
    before the error is freed, in the ``finally``)."""
    proxy, twins = _twins(kind, 1, 7, True, monkeypatch)
    rng = random.Random(7)
    for _ in range(30):
        tokens = [rng.randrange(1, 5) for _ in range(rng.randrange(1, 7))]
        outs = [_request(c, a, s, tokens, 0, None) for c, a, s in twins]
        assert outs[0] == outs[1]
    for c, _, _ in twins:
        c.take_events()
        c._events.seen.clear()
        c._events.fail_at = fail_at
    outs = [_outcome(lambda c=c: c.evict(fast.EvictParams(
        num_tokens=10, swa_num_tokens=6 if kind == "swa" else 0,
        mamba_num=0 if kind == "swa" else 3))) for c, _, _ in twins]
    assert outs[0] == outs[1] and outs[0][0] == "raised", outs
    assert len(twins[0][0]._events.seen) == fail_at
    assert twins[0][0]._events.seen == twins[1][0]._events.seen
    assert _state(*twins[0]) == _state(*twins[1])
    assert twins[0][0].take_events() == twins[1][0].take_events()
    for c, _, _ in twins:  # and the caches go on as equals
        c._events.fail_at = -1
    outs = [_outcome(lambda c=c: c.evict(fast.EvictParams(num_tokens=100, swa_num_tokens=100,
                                                          mamba_num=100))) for c, _, _ in twins]
    assert outs[0] == outs[1]
    assert _state(*twins[0]) == _state(*twins[1])
    assert proxy.done and all(d is not None for d in proxy.done)


def test_declines_change_nothing():
    """What the C loops decline (None) leaves everything as it was: amounts that are not exact
    ints, free lists that are not lists."""
    cache, alloc, states = _build("swa", 1, False, False, 4)
    for i in range(4):
        _request(cache, alloc, states, [i + 1, 2, 3, 4], 0, None)
    before = _state(cache, alloc, states)
    comp = cache._one_aux[0]
    assert _core.aux_evict_swa(cache, comp, True, 1, []) is None
    assert _core.aux_evict_swa(cache, comp, 1, 1.0, []) is None
    assert _core.aux_evict_swa(cache, comp, 1, 1, ()) is None
    assert _core.aux_evict_mamba(cache, comp, 1, 1, [], ()) is None
    assert _state(cache, alloc, states) == before
    for owner, name in ((comp, "evictable"), (cache, "_evictable")):
        kept = getattr(owner, name)
        setattr(owner, name, float(kept))  # (a counter that is not an exact int)
        assert _core.aux_evict_swa(cache, comp, 1, 1, []) is None
        setattr(owner, name, kept)
    heap = cache._heap
    cache._heap = tuple(heap)  # (not a list)
    assert _core.aux_evict_swa(cache, comp, 1, 1, []) is None
    cache._heap = heap
    assert _state(cache, alloc, states) == before
    with pytest.raises(TypeError):
        _core.aux_evict_swa(cache, comp, 1, 1)
    assert _state(cache, alloc, states) == before


def test_no_reference_left_behind(monkeypatch):
    """The same evicts over and over: the reference counts of the objects the loops touch
    and the number of live objects do not grow."""

    def round_trip():
        cache, alloc, states = _build("swa", 1, False, True, 4)
        for i in range(12):
            _request(cache, alloc, states, [i % 3 + 1, i % 5 + 2, 7, i + 1], i % 4, None)
        cache.evict(fast.EvictParams(num_tokens=1000, swa_num_tokens=1000))
        return cache

    probe = round_trip()
    assert_no_leaks(round_trip, lambda: (sys.getrefcount(probe.root_node),
                                         sys.getrefcount(probe._one_aux[0].lru.head)), runs=50)
