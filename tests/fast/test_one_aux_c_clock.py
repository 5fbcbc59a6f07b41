"""fast/_core.c "composed tree: clock": ``clock_inc`` / ``clock_dec``, the C lock paths of
fast/one_aux.py's ``inc_lock_one`` / ``dec_lock_one``, against the Python functions they stand
for (``inc_lock_one_py`` / ``dec_lock_one_py``, the reference).

Two caches in one process go through the same steps: one runs the C functions (through
``inc_lock_one`` / ``dec_lock_one``, as ``HybridRadixCache`` picks them), its twin the Python
ones.  After every step the whole trees (keys, slots, counts, records, boundary marks, split
marks), the components' and the cache's counters, the Full heap as a list (the same entries in
the same order: the C path pushes what heapq would, where heapq would) and every lock's result
must be the same; errors must be the same errors, leaving both caches as they were."""

from __future__ import annotations

import random
import sys
import tracemalloc
from typing import Any

import pytest

from stories import replay_twins
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import make_config, record
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.fast import one_aux
from uniradix.fast.cache import _core
from uniradix.fast.components import MAMBA_ID, SWA_ID
from uniradix.fast.components.swa import SWA_SPLIT_EPOCH, split_off_skipped
from uniradix.fast.errors import HandleError, NodeNotFound
from uniradix.fast.params import DecLockRefParams, EvictParams, MatchPrefixParams
from uniradix.fast.radix_key import RadixKey
from uniradix.spec.config import CacheConfig

pytestmark = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")

# configs: the recorded SWA and Mamba ones, and SWA at page 16 (windows of one and two pages)
P16 = {"swa-w16-p16": CacheConfig(page_size=16, components=("full", "swa"), kv_slots=1024,
                                  sliding_window=16, swa_slots=640),
       "swa-w32-p16": CacheConfig(page_size=16, components=("full", "swa"), kv_slots=768,
                                  sliding_window=32, swa_slots=512)}


def _config(name: str, seed: int) -> CacheConfig:
    return P16[name] if name in P16 else make_config(name, seed)


# ----------------------------------------------------------------------------------------------
# comparators
# ----------------------------------------------------------------------------------------------


def _path(node: Any) -> tuple:
    out = []
    while node is not None and node.parent is not None:
        out.append((node.extra_key, tuple(node.key)))
        node = node.parent
    return tuple(reversed(out))


def _slots(t: Any) -> Any:
    return None if t is None else t.tolist()


def tree_state(cache: Any) -> list:
    """Everything the lock paths read or write, top-down (children in key order), node ids left
    out (they differ between two caches of one process)."""
    out: list = []
    todo = [cache.root_node]
    while todo:
        node = todo.pop()
        recs = [(_slots(r.value), r.lock, r.boundary, [e for e, _ in r.split_from],
                 r.lru_prev is None, r.lru_next is None) for r in node.aux]
        out.append((_path(node), _slots(node.value), node.lock_ref, node.aux_lock,
                    node.dev_children, node.last_access_time, node.hit_count, recs))
        todo.extend(sorted(node.children.values(), key=lambda c: (str(c.extra_key),
                                                                   tuple(c.key)), reverse=True))
    comp = cache.components[0]
    counters = (cache._evictable, cache._protected, comp.evictable, comp.protected,
                getattr(comp, "_next_boundary", None), getattr(comp, "_split_epoch", None))
    # the heap as a list, in order: the same pushes in the same order give the same list
    heap = [(stamp, _path(node)) for stamp, node in cache._heap]
    return [out, counters, heap]


def result_view(res: Any, node: Any) -> tuple:
    """A lock's result with the skipped node ids as paths (they are on the locked path)."""
    by_id = {}
    cur = node
    while cur is not None:
        by_id[cur.id] = _path(cur)
        cur = cur.parent
    skips = {k: sorted(by_id.get(i, ("gone", i)) for i in v) if k != SWA_SPLIT_EPOCH else v
             for k, v in res.skip_lock_node_ids.items()}
    return (type(res).__name__, res.delta, getattr(res, "swa_uuid_for_lock", None),
            getattr(res, "swa_uuid_for_host_lock", None), list(res.skip_lock_node_ids), skips)


# ----------------------------------------------------------------------------------------------
# the twins: C paths (counted) and the Python paths
# ----------------------------------------------------------------------------------------------


class Counts:
    """How often the C functions took a call (returned a result) and declined it."""

    def __init__(self) -> None:
        self.inc = self.dec = self.declined = 0
        self.skipped = self.cskip = self.split_skip = 0  # results with skips; unlocks with
        # the component's skips; such unlocks passing a locked node split off a skipped one


@pytest.fixture
def counted(monkeypatch):
    """``_core.clock_inc`` / ``clock_dec`` wrapped to count what they take and decline (one_aux
    looks them up on the module at each call, so the wrappers are what it runs)."""
    counts = Counts()
    inc, dec = _core.clock_inc, _core.clock_dec

    def clock_inc(cache, node):
        res = inc(cache, node)
        if res is None:
            counts.declined += 1
        else:
            counts.inc += 1
            counts.skipped += bool(res.skip_lock_node_ids)
        return res

    def clock_dec(cache, node, params):
        res = dec(cache, node, params)
        if res is None:
            counts.declined += 1
        else:
            counts.dec += 1
            comp_id = cache._one_aux[2]
            cskip = params.skip_lock_node_ids.get(comp_id) if params is not None else None
            if cskip:
                counts.cskip += 1
        return res

    def clock_dec_counted(cache, node, params):
        comp_id = cache._one_aux[2]
        cskip = params.skip_lock_node_ids.get(comp_id) if params is not None else None
        if cskip and comp_id == SWA_ID:
            seen = -1 - min(params.skip_lock_node_ids.get(SWA_SPLIT_EPOCH, (0,)))
            cur = node
            while cur is not cache.root_node:
                rec = cur.aux[0]
                if rec.lock and cur.id not in cskip and split_off_skipped(rec, cskip, seen):
                    counts.split_skip += 1
                cur = cur.parent
        return clock_dec(cache, node, params)

    monkeypatch.setattr(_core, "clock_inc", clock_inc)
    monkeypatch.setattr(_core, "clock_dec", clock_dec_counted)
    return counts


def _python_paths(cache: Any) -> None:
    cache._inc_lock_fast = one_aux.inc_lock_one_py
    cache._dec_lock_fast = one_aux.dec_lock_one_py


def _recording(adapter: Any, log: list, python: bool) -> Any:
    """``adapter`` whose cache (a reset builds a new one) runs the C paths (the Python ones with
    ``python``) and logs every lock's result and error."""
    apply = adapter.apply

    def apply_step(step):
        cache = adapter.cache
        assert cache._inc_lock_fast is not None  # (the one-component shape)
        inc = one_aux.inc_lock_one_py if python else one_aux.inc_lock_one
        dec = one_aux.dec_lock_one_py if python else one_aux.dec_lock_one

        def inc_fast(c, node):
            try:
                res = inc(c, node)
            except Exception as e:
                log.append(("inc raised", type(e).__name__, str(e)))
                raise
            log.append(("inc", result_view(res, node)))
            return res

        def dec_fast(c, node, params):
            try:
                res = dec(c, node, params)
            except Exception as e:
                log.append(("dec raised", type(e).__name__, str(e)))
                raise
            log.append(("dec", res.delta))
            return res

        cache._inc_lock_fast, cache._dec_lock_fast = inc_fast, dec_fast
        return apply(step)

    adapter.apply = apply_step
    return adapter


@pytest.mark.parametrize("name,seed", [("swa-w8-p1", 1), ("swa-w8-p4", 2), ("swa-w32-p1", 3),
                                       ("swa-w16-p16", 4), ("swa-w32-p16", 5), ("mamba-p1", 6),
                                       ("swa-w8-p1", 7), ("mamba-p1", 8)])
def test_c_locks_equal_the_python_locks(name, seed, counted):
    """A recorded workload (inserts, matches, locks, unlocks, evictions: splits of locked
    nodes, SWA tombstones skipped by locks) on the C twin and the Python twin in lockstep."""
    config = _config(name, seed)
    steps = record(make_adapter("fast", config), config, seed, 400, check_violations=False)
    logs: tuple[list, list] = ([], [])
    c_twin = _recording(make_adapter("fast", config), logs[0], python=False)
    py_twin = _recording(make_adapter("fast", config), logs[1], python=True)
    ls = Lockstep([c_twin, py_twin], ["C locks", "Python locks"], events=False)

    def same_trees_and_logs(step):
        assert tree_state(c_twin.cache) == tree_state(py_twin.cache), step
        assert logs[0] == logs[1], step

    replay_twins(ls, steps, same_trees_and_logs)
    assert counted.inc > 20 and counted.dec > 20, vars(counted)
    assert counted.declined == 0, vars(counted)


# ----------------------------------------------------------------------------------------------
# direct scenarios: both twins built here, every call compared
# ----------------------------------------------------------------------------------------------


def _twins(name: str, seed: int = 0) -> tuple[Any, Any]:
    config = _config(name, seed)
    a, b = make_adapter("fast", config), make_adapter("fast", config)
    _python_paths(b.cache)
    return a, b


def _insert(adapter: Any, tokens: list[int], swa_evicted: int = 0, fresh: bool = False) -> None:
    """Insert ``tokens`` (whole pages) as a request would: its cached prefix (``fresh``: none,
    new slots for every token), new slots for the rest, a new state (Mamba; back to its pool
    when the tree keeps its own)."""
    cache = adapter.cache
    ps = cache.page_size
    tokens = tokens[:len(tokens) // ps * ps]
    have = [] if fresh else \
        cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_indices.tolist()
    new = adapter.op_alloc({"op": "alloc", "args": {"n": len(tokens) - len(have)}})["slots"] \
        if len(tokens) > len(have) else []
    args = {"tokens": tokens, "value": have + list(new), "prev_prefix_len": len(have)}
    if swa_evicted:  # (the request's window moved on: no SWA data for that many tokens)
        args["swa_evicted_seqlen"] = swa_evicted
    if cache.mamba is not None:
        args["mamba_value"] = adapter.op_mamba_alloc({"op": "mamba_alloc",
                                                      "args": {"n": 1}})["slots"]
    ret = adapter.op_insert({"op": "insert", "args": args})
    if ret.get("mamba_exist"):
        adapter.op_mamba_free({"op": "mamba_free", "args": {"slots": args["mamba_value"]}})


def _node(cache: Any, tokens: list[int]) -> Any:
    """The node whose path is ``tokens``; where there is none (evicted, or a page cut), the
    deepest node a match reaches."""
    tokens = tokens[:len(tokens) // cache.page_size * cache.page_size]
    try:
        return cache.find_node(RadixKey(tokens))
    except NodeNotFound:
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).last_device_node


def _both(a: Any, b: Any, fn: Any) -> Any:
    """fn(cache) on both twins: the same outcome (result or error), the same state after."""
    outs = []
    for ad in (a, b):
        try:
            outs.append(("ok", fn(ad.cache)))
        except Exception as e:  # noqa: BLE001 (compared below)
            outs.append(("raised", type(e), str(e)))
    ra, rb = outs
    if ra[0] == "ok" and rb[0] == "ok":
        va, vb = ra[1], rb[1]
        assert type(va) is type(vb)
    else:
        assert ra == rb
    assert tree_state(a.cache) == tree_state(b.cache)
    return ra


@pytest.mark.parametrize("name", ["swa-w8-p1", "swa-w16-p16", "mamba-p1"])
def test_scenarios_locks_splits_tombstones_errors(name, counted):
    """Locks over shared prefixes, a split of a locked node, SWA evictions that leave
    tombstones under and inside a lock's window, unlocks in another order, then the errors:
    a second release (HandleError) and a node out of the tree (NodeNotFound)."""
    a, b = _twins(name)
    ps = a.cache.page_size
    rng = random.Random(11)
    base = [rng.randrange(1, 40) for _ in range(6 * ps)]
    seqs = [base + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 5) * ps)]
            for _ in range(4)]
    held: list[tuple[list[int], Any, Any]] = []
    for s in seqs:
        for ad in (a, b):
            _insert(ad, s)
        assert tree_state(a.cache) == tree_state(b.cache)
        # lock it: both results compared
        ra = a.cache.inc_lock_ref(_node(a.cache, s))
        rb = b.cache.inc_lock_ref(_node(b.cache, s))
        assert result_view(ra, _node(a.cache, s)) == result_view(rb, _node(b.cache, s))
        assert tree_state(a.cache) == tree_state(b.cache)
        held.append((s, (_node(a.cache, s), ra.to_dec_params()),
                     (_node(b.cache, s), rb.to_dec_params())))
    # a split of locked nodes: a request sharing half of the base
    half = base[:3 * ps] + [99] * (2 * ps)
    for ad in (a, b):
        _insert(ad, half)
    assert tree_state(a.cache) == tree_state(b.cache)
    # release two, evict SWA (tombstones) and Full, lock again over the tombstones
    for s, ha, hb in held[:2]:
        da, db = a.cache.dec_lock_ref(*ha), b.cache.dec_lock_ref(*hb)
        held.remove((s, ha, hb))
        assert da.delta == db.delta
        assert tree_state(a.cache) == tree_state(b.cache)
    _both(a, b, lambda c: c.evict(EvictParams(num_tokens=0, swa_num_tokens=4 * ps,
                                              mamba_num=2)).num_tokens_evicted)
    for s in seqs[:2] + [half]:
        na, nb = _node(a.cache, s), _node(b.cache, s)
        ra, rb = a.cache.inc_lock_ref(na), b.cache.inc_lock_ref(nb)
        assert result_view(ra, na) == result_view(rb, nb)
        assert tree_state(a.cache) == tree_state(b.cache)
        held.append((s, (na, ra.to_dec_params()), (nb, rb.to_dec_params())))
    # another split under the new locks, then release everything in another order
    for ad in (a, b):
        _insert(ad, base[:2 * ps] + [77] * ps)
    rng.shuffle(held)
    for _, ha, hb in held:
        da, db = a.cache.dec_lock_ref(*ha), b.cache.dec_lock_ref(*hb)
        assert da.delta == db.delta
        assert tree_state(a.cache) == tree_state(b.cache)
    # a second release of a handle (of a node in the tree): HandleError, nothing changed
    s, ha, hb = next(h for h in held if h[1][0].parent is not None)
    out = _both(a, b, lambda c: c.dec_lock_ref(*(ha if c is a.cache else hb)))
    assert out[:2] == ("raised", HandleError), out
    # a node out of the tree (evicted): NodeNotFound on both paths
    na = a.cache.root_node
    while na.children:  # (a leaf; its twin by its tokens)
        na = na.children[min(na.children, key=str)]
    toks = [t for _, k in _path(na) for t in k]
    nb = b.cache.find_node(RadixKey(toks))
    assert na.parent is not None and _path(na) == _path(nb)
    _both(a, b, lambda c: c.evict(EvictParams(num_tokens=10 ** 6)).num_tokens_evicted)
    assert na.parent is None and nb.parent is None
    out = _both(a, b, lambda c: c.inc_lock_ref(na if c is a.cache else nb))
    assert out[:2] == ("raised", NodeNotFound), out
    out = _both(a, b, lambda c: c.dec_lock_ref(na if c is a.cache else nb))
    assert out[:2] == ("raised", NodeNotFound), out
    assert counted.inc >= 7 and counted.dec >= 6 and counted.declined == 0, vars(counted)


@pytest.mark.parametrize("name", ["swa-w8-p1", "swa-w32-p16", "mamba-p1"])
def test_skips_and_split_off_skips(name, counted):
    """SWA: a lock A skips a tombstone T (a request whose window moved on), T is split, and
    A's unlock skips T by id and passes by a node marked as split off T since (its count is
    another lock's; made by hand: without a host tier a skipped node stays Full-locked, so no
    other lock can count its upper part).  Mamba: a lock of a node without a state (the upper
    part of a split) skips it, its unlock too."""
    a, b = _twins(name)
    ps = a.cache.page_size
    rng = random.Random(5)
    st = [rng.randrange(100, 140) for _ in range(10 * ps)]

    def lock(tokens):
        na, nb = _node(a.cache, tokens), _node(b.cache, tokens)
        ra, rb = a.cache.inc_lock_ref(na), b.cache.inc_lock_ref(nb)
        assert result_view(ra, na) == result_view(rb, nb)
        assert tree_state(a.cache) == tree_state(b.cache)
        return (na, ra.to_dec_params()), (nb, rb.to_dec_params())

    def unlock(ha, hb):
        da, db = a.cache.dec_lock_ref(*ha), b.cache.dec_lock_ref(*hb)
        assert da.delta == db.delta
        assert tree_state(a.cache) == tree_state(b.cache)

    if name.startswith("swa"):
        st = st[:7 * ps]
        for ad in (a, b):  # P (2 pages, SWA data), T (a tombstone of 4 pages), L (1 page)
            _insert(ad, st[:2 * ps])
            _insert(ad, st, swa_evicted=6 * ps)
        assert _node(a.cache, st).parent.aux[0].value is None
        lock_a = lock(st)  # L and P locked, T skipped
        assert lock_a[0][1].skip_lock_node_ids.get(SWA_ID)
        for ad in (a, b):  # T split: its upper part U is split off a skipped node
            _insert(ad, st[:3 * ps] + [7] * ps)
        # P as if it had been split off T since A's lock (the count it holds then is another
        # lock's): A's unlock must pass it by (split_off_skipped), on both paths alike
        for ad in (a, b):
            t = ad.cache.find_node(RadixKey(st[:6 * ps]))
            p = ad.cache.find_node(RadixKey(st[:2 * ps]))
            assert t.aux[0].value is None and p.aux[0].lock == 1
            p.aux[0].split_from = ((ad.cache.components[0]._split_epoch + 1, t.id),)
        unlock(*lock_a)
        assert counted.split_skip >= 1, vars(counted)
        assert a.cache.find_node(RadixKey(st[:2 * ps])).aux[0].lock == 1
    else:
        for ad in (a, b):
            _insert(ad, st)
            _insert(ad, st[:4] + [7] * 3)  # a split: the upper part holds no state
        assert _node(a.cache, st[:4]).aux[0].value is None
        held = [lock(st[:4]), lock(st), lock(st[:4])]
        assert held[0][0][1].skip_lock_node_ids.get(MAMBA_ID)
        for h in (held[1], held[0], held[2]):
            unlock(*h)
    assert counted.skipped and counted.cskip and counted.declined == 0, vars(counted)


@pytest.mark.parametrize("name,seed", [("swa-w8-p1", 1), ("swa-w8-p4", 2), ("swa-w16-p16", 3),
                                       ("mamba-p1", 4), ("swa-w32-p1", 5), ("mamba-p1", 6)])
def test_random_lock_sequences(name, seed, counted):
    """Random inserts, locks, unlocks (some released twice), SWA and Full evictions, on both
    twins: every call's outcome and the whole state after it the same."""
    a, b = _twins(name, seed)
    ps = a.cache.page_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 12) for _ in range(rng.randrange(1, 9) * ps)]
               for _ in range(10)]
    held: list[tuple[Any, Any]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            s = rng.choice(prompts)[:rng.randrange(1, 9) * ps]
            try:
                for ad in (a, b):
                    _insert(ad, s)
            except Exception:  # noqa: BLE001 (a full pool: make room)
                _both(a, b, lambda c: c.evict(EvictParams(num_tokens=8 * ps)).num_tokens_evicted)
                continue
            assert tree_state(a.cache) == tree_state(b.cache)
        elif op < 0.6:
            s = rng.choice(prompts)
            na, nb = _node(a.cache, s), _node(b.cache, s)
            ra, rb = a.cache.inc_lock_ref(na), b.cache.inc_lock_ref(nb)
            assert result_view(ra, na) == result_view(rb, nb)
            assert tree_state(a.cache) == tree_state(b.cache)
            held.append(((na, ra.to_dec_params()), (nb, rb.to_dec_params())))
        elif op < 0.85 and held:
            hs = held.pop(rng.randrange(len(held))) if rng.random() < 0.9 else held[-1]
            _both(a, b, lambda c, hs=hs: c.dec_lock_ref(*hs[c is b.cache]).delta)
        else:
            full, swa = rng.randrange(0, 3) * ps, rng.randrange(0, 6) * ps
            params = EvictParams(num_tokens=full, swa_num_tokens=swa, mamba_num=1)
            _both(a, b, lambda c, p=params: c.evict(p).num_tokens_evicted)
    assert counted.inc > 30 and counted.dec > 30 and counted.declined == 0, vars(counted)


@pytest.mark.parametrize("name", ["swa-w8-p1", "mamba-p1"])
def test_heap_ties_as_heapq(name, counted):
    """Leaves with one stamp, unlocked in a shuffled order: the heap's ties are broken by node
    id (Node.__lt__), so its list must be what heapq builds on the Python twin, entry for
    entry (the C path compares such entries itself)."""
    a, b = _twins(name)
    rng = random.Random(3)
    seqs = [[t] + [rng.randrange(1, 30) for _ in range(5)] for t in range(1, 13)]
    held = []
    for s in seqs:
        for ad in (a, b):
            _insert(ad, s)
    for s in seqs:
        na, nb = _node(a.cache, s), _node(b.cache, s)
        held.append(((na, a.cache.inc_lock_ref(na).to_dec_params()),
                     (nb, b.cache.inc_lock_ref(nb).to_dec_params())))
        na.last_access_time = nb.last_access_time = 5  # (one stamp for all)
    a.cache._heap.clear()
    b.cache._heap.clear()
    rng.shuffle(held)
    for ha, hb in held:
        assert a.cache.dec_lock_ref(*ha).delta == b.cache.dec_lock_ref(*hb).delta
        assert tree_state(a.cache) == tree_state(b.cache)
    assert len(a.cache._heap) >= len(seqs)
    assert counted.dec == len(seqs) and counted.declined == 0, vars(counted)


# ----------------------------------------------------------------------------------------------
# what the C functions decline (None, nothing changed): the Python function runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["swa-w8-p1", "mamba-p1"])
def test_declines_change_nothing(name):
    a, b = _twins(name)
    s = list(range(1, 13))
    for ad in (a, b):
        _insert(ad, s)
    cache = a.cache
    node = _node(cache, s)
    res = cache.inc_lock_ref(node)
    before = tree_state(cache)

    class Params(DecLockRefParams):
        pass

    comp_id = SWA_ID if name.startswith("swa") else MAMBA_ID
    odd = [Params(res.swa_uuid_for_lock, None, dict(res.skip_lock_node_ids)),
           DecLockRefParams(res.swa_uuid_for_lock, None, {0: [node.id]}),  # not a set
           DecLockRefParams(res.swa_uuid_for_lock, None, {comp_id: (node.id,)}),
           DecLockRefParams("x", None, {})]
    for p in odd:
        if p.swa_uuid_for_lock == "x" and comp_id == MAMBA_ID:
            continue  # (Mamba does not read the mark)
        assert _core.clock_dec(cache, node, p) is None
        assert tree_state(cache) == before
    assert _core.clock_inc(cache, object()) is None
    assert _core.clock_dec(cache, object(), None) is None
    key = node.key
    node.key = list(key) + [0]  # a list is fine ...
    assert _core.clock_inc(cache, node) is not None
    assert _core.clock_dec(cache, node, res.to_dec_params()) is not None
    node.key = tuple(key)  # ... a tuple is not
    assert _core.clock_inc(cache, node) is None
    node.key = key
    assert tree_state(cache) == before
    cache.disable = True
    assert _core.clock_inc(cache, node) is None
    assert _core.clock_dec(cache, node, None) is None
    cache.disable = False
    lr = node.lock_ref
    node.lock_ref = float(lr)  # not a plain int
    assert _core.clock_inc(cache, node) is None
    assert _core.clock_dec(cache, node, None) is None
    node.lock_ref = lr
    assert tree_state(cache) == before


def test_no_reference_leaks():
    """Many lock and unlock calls through the C paths: the reference counts of the objects they
    read and store (a node, its record, the boundary mark, the component, the root) do not
    grow, nor does the memory Python's allocators hand out (tracemalloc)."""
    def cycle(cache: Any, node: Any) -> None:
        res = _core.clock_inc(cache, node)
        assert res is not None
        assert _core.clock_dec(cache, node, res.to_dec_params()) is not None
        assert cache._heap[-1][1] is node  # (the unlock pushed the leaf: dropped again)
        cache._heap.clear()

    for name in ("swa-w8-p1", "mamba-p1"):
        a, _ = _twins(name)
        cache = a.cache
        s = list(range(1, 21))
        _insert(a, s)
        node = _node(cache, s)
        rec, comp, root = node.aux[0], cache.components[0], cache.root_node
        for _ in range(100):
            cycle(cache, node)
        objs = [o for o in (node, rec, comp, root, cache, rec.boundary, node.key, cache._heap)
                if o is not None]
        counts = [sys.getrefcount(o) for o in objs]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(10000):
                cycle(cache, node)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 64 * 1024, (name, grown)  # (a leaked object a call: 10000 of them)
        assert [sys.getrefcount(o) for o in objs] == counts, name
