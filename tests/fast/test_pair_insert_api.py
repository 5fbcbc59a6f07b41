"""fast/hybrid.py ``_insert`` whole in C for the stock SWA and Mamba plug-ins together
(fast/_core.c "cinsert", ``pair_insert_api``: the key read in place, the argument checks, the
cut to whole pages, the plan, the pair's aux checks, the state's copy, the root's stamp, then
``pair_insert``'s walk, leaf and commits) against the Python function, in one process.

Two caches driven alike, both without the slot ledger (the C entry declines with it on): one
runs ``insert`` as it is (``_insert_fast`` is ``pair_insert_api``, counted), its twin the
Python ``_insert`` with its own loop (``_insert_fast`` and ``_pair_insert`` off).  After every
step the two must agree on the tree (each node's fields and records, stamps included), both
LRU orders, the leaf heap entry by entry, the clock and counters, the free lists of the
allocators, the frees released, and the results or errors.  Recorded random sequences at
pages 1, 4 and 16 (components in both orders); random requests over the bench's SWA free-list
allocator with random ``prev_prefix_len`` (inside SWA tombstones too: the Python error, with
the cache unchanged by the C entry), ``swa_evicted_seqlen``, ``chunked`` and ``priority``;
every kind of bad argument (declined by the C entry with nothing changed, then the Python
error); the settings it leaves to Python; keys of SGLang's ``RadixKey`` shape; and no
reference left behind."""

from __future__ import annotations

import dataclasses
import random
import sys
from array import array

import pytest

from aux_twins import (
    PAIR_ORDERS,
    Counting,
    evict_or_unlock,
    hold_or_unlock,
    pages,
    tree_state,
    twins_on_recorded_run,
)

torch = pytest.importorskip("torch")

from test_one_aux_c_cevict import StateAllocator, _outcome  # noqa: E402
from test_pair_evict import slots_for  # noqa: E402

import uniradix.fast as fast  # noqa: E402
from stories import replay_twins  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.bench.hybrid import SwaFreeListAllocator  # noqa: E402
from uniradix.conformance.explore.driver import make_config, record  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

pytestmark = pytest.mark.skipif(_core is None or not hasattr(_core, "pair_insert_api"),
                                reason="the C core is not built or not in use")
IDS = ["swa-first", "mamba-first"]


def _no_ledger(cache) -> None:
    cache.validate_slots = False
    cache.reset()  # (the Mamba plug-in's ledger follows the setting)


def _api(cache, entry=None) -> Counting:
    """``cache`` on the C entry (``entry``, default the pair's), counted (taken: it answered,
    not None)."""
    entry = entry or _core.pair_insert_api
    _no_ledger(cache)
    assert cache._insert_fast is entry
    cache._insert_fast = counting = Counting(entry)
    return counting


def _python(cache):
    """``cache`` on the Python ``_insert`` and its own loop."""
    _no_ledger(cache)
    assert cache._insert_fast is _core.pair_insert_api and cache._pair_insert
    cache._insert_fast = None
    cache._pair_insert = False
    return cache


# ----------------------------------------------------------------------------------------------
# Recorded runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("order", PAIR_ORDERS, ids=IDS)
@pytest.mark.parametrize("name,seed", [("full-swa-mamba-p1", 31), ("full-swa-mamba-p1", 32),
                                       ("full-swa-mamba-p4", 33), ("full-swa-mamba-p4", 34)])
def test_recorded_runs_in_lockstep(name, seed, order):
    box: dict = {}

    def prepare(adapter):
        box["c"] = _api(adapter.cache)

    def general(adapter):
        _python(adapter.cache)
        return adapter

    ops = twins_on_recorded_run(name, seed, order, general, ["C insert_api", "Python insert"],
                                prepare=prepare)
    assert "insert" in ops
    c = box["c"]
    assert c.calls > 10 and c.taken >= 0.8 * c.calls, (c.calls, c.taken)


@pytest.mark.parametrize("order", PAIR_ORDERS, ids=IDS)
@pytest.mark.parametrize("seed", [41, 42])
def test_recorded_runs_page_16(seed, order):
    base = make_config("full-swa-mamba-p4", seed)
    config = dataclasses.replace(base, page_size=16, kv_slots=4096, swa_slots=4096,
                                 sliding_window=32, mamba_slots=64, mamba_cache_chunk_size=16,
                                 components=order)
    check_recorded(config, seed, (_api, _python))


def check_recorded(config, seed: int, on: tuple) -> None:
    """400 steps recorded on fast with ``config`` replayed on twin adapters (``on[0]`` sets
    up the C entry, ``on[1]`` the Python path): the same tree after every step, the C entry
    taking most inserts."""
    steps = record(make_adapter("fast", config), config, seed, 400, check_violations=False)
    c_side, py_side = make_adapter("fast", config), make_adapter("fast", config)
    counting = on[0](c_side.cache)
    on[1](py_side.cache)
    ls = Lockstep([c_side, py_side], ["C insert_api", "Python insert"], events=False)

    def same(step):
        assert tree_state(c_side.cache) == tree_state(py_side.cache), step

    ops = replay_twins(ls, steps, same)
    assert "insert" in ops
    assert counting.calls > 10 and counting.taken >= 0.8 * counting.calls, \
        (counting.calls, counting.taken)


# ----------------------------------------------------------------------------------------------
# Random requests over free lists
# ----------------------------------------------------------------------------------------------


def _build(ps: int, order: tuple, python: bool, pages_: int = 64, on: tuple | None = None):
    """A cache of ``order`` over the bench's SWA free-list allocator and a state allocator,
    on the C entry (``on[0]``, default :func:`_api`) or the Python path (``on[1]``,
    :func:`_python`): (cache, allocator, states, what ``on`` gave).  (The one-component
    entry's tests too: tests/fast/test_one_insert_api.py.)"""
    alloc = SwaFreeListAllocator(pages_ * ps, pages_ // 2 * ps, ps, torch)
    states = StateAllocator(12)
    pool = type("Pool", (), {"mamba_allocator": states, "mamba_pool": None})()
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=order, sliding_window_size=2 * ps, validate_slots=False))
    api, python_ = on or (_api, _python)
    return cache, alloc, states, python_(cache) if python else api(cache)


def _pools(alloc, states) -> tuple:
    return (alloc._free.tolist(), [p.tolist() for p in alloc._released],
            alloc.swa._free.tolist(), [p.tolist() for p in alloc.swa._released],
            alloc.full_to_swa.tolist(), states.free_slots.tolist(), states.log)


def _result(r):
    if isinstance(r, fast.InsertResult):
        return ("ok", r.prefix_len, r.total_len, r.mamba_exist)
    return r


def _request(side, tokens, rng_pick, held) -> tuple:
    """Match, lock, evict the shortfall, alloc, insert with the picked extras (a
    ``prev_prefix_len`` at the match or anywhere, a window where the cache has SWA, chunked, a
    priority), unlock or keep the lock.  What an insert refuses goes back, and the state where
    the cache keeps none (it has no Mamba, or the node had one)."""
    cache, alloc, states, _ = side
    prev_pick, e_pick, chunked, priority, key_kind = rng_pick
    ps = cache.page_size
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(tokens)))
    node = m.last_device_node
    lock = cache.inc_lock_ref(node)
    matched = len(m.device_indices)
    prev = matched if prev_pick < 0 else min(prev_pick * ps, matched)
    if key_kind == 1:  # (another namespace: nothing matched there)
        prev = 0
    need = len(tokens) - prev  # (the caller's own slots from prev on: duplicates or new)
    ev, fresh, state = slots_for(side, node, lock, need)
    if fresh is None:
        return ("aborted", ev)
    e = (0, 0, matched // ps * ps, len(tokens) // 2 // ps * ps, prev // ps * ps)[e_pick] \
        if cache.swa is not None else 0
    mamba = cache.mamba is not None
    key = fast.RadixKey(tokens) if key_kind == 0 else fast.RadixKey(array("q", tokens), "x")
    value = torch.cat([m.device_indices[:prev], fresh.to(torch.int64)])
    res = _outcome(lambda: cache.insert(fast.InsertParams(
        key=key, value=value, prev_prefix_len=prev, swa_evicted_seqlen=e,
        mamba_value=state.reshape(1).clone() if mamba else None, chunked=chunked,
        priority=priority)))
    if not isinstance(res, fast.InsertResult):  # refused: the request's slots go back
        if need:
            alloc.free(fresh)
        states.free(state.reshape(1))
    elif res.mamba_exist or not mamba:
        states.free(state.reshape(1))
    hold_or_unlock(cache, node, lock, held)
    return (m.device_indices.tolist(), ev, _result(res))


def _compare(sides, step, violations: bool = True) -> None:
    (c, ca, cs, _), (p, pa, ps_, _) = sides
    assert tree_state(c) == tree_state(p), step
    assert [(s, tuple(n.key)) for s, n in c._heap] == [(s, tuple(n.key)) for s, n in p._heap]
    assert _pools(ca, cs) == _pools(pa, ps_), step
    if violations:
        assert c.violations() == [] and p.violations() == [], step


@pytest.mark.parametrize("order", PAIR_ORDERS, ids=IDS)
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", range(2))
def test_random_requests_over_free_lists(ps, order, seed):
    check_random_requests(ps, order, seed, (_api, _python))


def check_random_requests(ps: int, order: tuple, seed: int, on: tuple) -> None:
    """Twin caches (:func:`_build` with ``on``) through random requests, evicts and unlocks:
    the same answers and states at every step, the C entry taking what it writes out."""
    sides = [_build(ps, order, python, on=on) for python in (False, True)]
    rng = random.Random(seed * 37 + ps)
    prompts = [[rng.randrange(1, 9) for _ in range(rng.randrange(1, 6) * ps)] for _ in range(6)]
    helds: list[list] = [[], []]
    refused = 0
    for step in range(260):
        # an evict of random amounts (SWA tombstones, states dropped), a held lock going
        outs = evict_or_unlock(rng.random(), rng, sides, helds, ps, _outcome)
        if outs is None:
            tokens = rng.choice(prompts) + [rng.randrange(1, 9)
                                            for _ in range(rng.randrange(0, 4) * ps)]
            if rng.random() < 0.5 and ps > 1:  # a key that is not whole pages: cut
                tokens = tokens + [rng.randrange(1, 9) for _ in range(rng.randrange(1, ps))]
            pick = (rng.choice((-1, -1, rng.randrange(0, 6))), rng.randrange(5),
                    rng.random() < 0.3, rng.choice((0, 0, 3, -2)), int(rng.random() < 0.15))
            hold = rng.random() < 0.15 and len(helds[0]) < 3
            outs = [_request(s, tokens, pick, held if hold else None)
                    for s, held in zip(sides, helds, strict=True)]
            refused += outs[0][0] != "aborted" and outs[0][2][0] == "raised"
        assert outs[0] == outs[1], (step, outs)
        _compare(sides, step)
    counting = sides[0][3]
    assert counting.calls > 30 and counting.taken >= counting.calls - refused - 2
    assert counting.taken > 0.7 * counting.calls


def test_prev_inside_a_tombstone_is_refused_by_python_with_nothing_changed():
    for order in PAIR_ORDERS:
        sides = [_build(1, order, python) for python in (False, True)]
        toks = pages(1, *range(1, 13))
        for side in sides:  # a node of 8 with a leaf of 4 below, then the 8 a tombstone
            for k in (8, 12):
                side[0].insert(fast.InsertParams(
                    key=fast.RadixKey(toks[:k]), value=torch.cat([
                        side[0].match_prefix(fast.MatchPrefixParams(
                            key=fast.RadixKey(toks[:k]))).device_indices, side[1].alloc(4 if k > 8 else 8)]),
                    prev_prefix_len=k - (4 if k > 8 else 8),
                    mamba_value=side[2].alloc(1).reshape(1)))
            side[0].evict(fast.EvictParams(num_tokens=0, swa_num_tokens=8))
        _compare(sides, "setup")
        c = sides[0][0]
        assert c.swa.evictable == 4  # (the upper node a tombstone)
        v = torch.arange(12, dtype=torch.int64)
        params = fast.InsertParams(key=fast.RadixKey(toks), value=v, prev_prefix_len=3,
                                   mamba_value=torch.tensor([5]))
        before = tree_state(c)
        assert _core.pair_insert_api(c, params) is None
        assert tree_state(c) == before
        outs = [_outcome(lambda s=s, p=params: s[0].insert(p)) for s in sides]
        assert outs[0] == outs[1] and outs[0][0] == "raised" and "tombstone" in outs[0][2]
        _compare(sides, "refused")
        # the same insert from prev 0 (nothing the caller's inside a tombstone): taken
        params = dataclasses.replace(params, prev_prefix_len=0)
        assert _core.pair_insert_api(c, params) is not None


# ----------------------------------------------------------------------------------------------
# Bad arguments, settings left to Python, foreign keys
# ----------------------------------------------------------------------------------------------


class ShapedKey:
    """A key of SGLang's RadixKey shape that is not uniradix's type."""

    def __init__(self, token_ids, extra_key=None, is_bigram=False):
        self.token_ids, self.extra_key, self.is_bigram = token_ids, extra_key, is_bigram


def _bad_variants(ps: int, n: int, mamba: bool = True, swa: bool = True) -> list:
    """Insert arguments the C entries decline (each one thing wrong, or left to Python) for a
    cache with Mamba and/or SWA."""
    good = dict(value=torch.arange(n, dtype=torch.int64),
                mamba_value=torch.tensor([5]) if mamba else None)
    toks = list(range(1, n + 1))
    return [
        dict(good, value=torch.arange(n, dtype=torch.int32)),
        dict(good, value=torch.arange(n, dtype=torch.int64).reshape(1, n)),
        dict(good, value=torch.arange(n + 1, dtype=torch.int64)),
        dict(good, value=list(range(n))),
        dict(good, value=torch.arange(n, dtype=torch.float64)),
        dict(good, prev_prefix_len=-1),
        dict(good, prev_prefix_len=1.0),
        dict(good, prev_prefix_len=None),
        dict(good, chunked=1),
        dict(good, chunked=None),
        dict(good, priority="high"),
        dict(good, priority=None),
        dict(good, priority=1.5),
        *([dict(good, mamba_value=None)] if mamba else []),
        dict(good, mamba_value=torch.tensor([5], dtype=torch.int32)),
        dict(good, mamba_value=torch.tensor([5, 6])),
        dict(good, mamba_value=torch.tensor([[5]])),
        dict(good, mamba_value=[5]),
        dict(good, swa_evicted_seqlen=-ps),
        dict(good, swa_evicted_seqlen=float(ps)),
        dict(good, swa_evicted_seqlen=None),
        dict(good, swa_evicted_seqlen=True),
        *([dict(good, swa_evicted_seqlen=ps + 1)] if ps > 1 else []),
        *([] if swa else [dict(good, swa_evicted_seqlen=ps)]),
        dict(good, key=toks),
        dict(good, key=fast.RadixKey(toks, is_bigram=True)),
        dict(good, key=ShapedKey(toks)),  # (list token ids: left to Python)
        dict(good, key=ShapedKey(array("q", toks), 7)),
        dict(good, key=ShapedKey(array("q", toks), None, 0)),
        dict(good, key=ShapedKey(array("i", toks))),
    ]


@pytest.mark.parametrize("order", PAIR_ORDERS, ids=IDS)
@pytest.mark.parametrize("ps", [1, 4])
def test_bad_arguments_are_declined_with_nothing_changed(ps, order):
    check_bad_arguments(ps, order, (_api, _python), _core.pair_insert_api)


def check_bad_arguments(ps: int, order: tuple, on: tuple, entry) -> None:
    """Every kind of bad argument (:func:`_bad_variants`) declined by ``entry`` with nothing
    changed, then refused (or taken) alike by twin caches (:func:`_build` with ``on``)."""
    sides = [_build(ps, order, python, on=on) for python in (False, True)]
    mamba, swa = "mamba" in order, "swa" in order
    n = 6 * ps
    toks = list(range(1, n + 1))
    for side in sides:  # a tree to walk: a prefix of the key, a tombstone
        side[0].insert(fast.InsertParams(key=fast.RadixKey(toks[:4 * ps]), value=side[1].alloc(4 * ps),
                                         mamba_value=side[2].alloc(1).reshape(1) if mamba else None))
        side[0].evict(fast.EvictParams(num_tokens=0, swa_num_tokens=ps if swa else 0))
    _compare(sides, "setup")
    c = sides[0][0]
    for k, extra in enumerate(_bad_variants(ps, n, mamba, swa)):
        key = extra.pop("key", fast.RadixKey(toks))
        params = fast.InsertParams(key=key, **extra)
        before = (tree_state(c), _pools(*sides[0][1:3]))
        assert entry(c, params) is None, (k, extra)
        assert (tree_state(c), _pools(*sides[0][1:3])) == before, k
        outs = [_outcome(lambda s=s, p=params: s[0].insert(p)) for s in sides]
        assert outs[0] == outs[1], (k, outs)
        # (those Python takes, a bigram key or a priority of None, hold slots the tree holds
        # already: both trees alike)
        _compare(sides, k, violations=False)


def test_settings_left_to_python():
    """The slot ledger, a disabled cache, KV events, the cache's C insert off, a policy
    order, EAGLE and a subclass with its own ``_units`` or ``_check_aux``: declined with
    nothing changed, or never chosen."""
    cache, alloc, states, _ = _build(1, PAIR_ORDERS[0], False)
    toks = pages(1, *range(1, 6))
    params = fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(5),
                               mamba_value=torch.tensor([3]))
    before = tree_state(cache)
    for name, off, on in (("validate_slots", False, True), ("disable", False, True),
                          ("_events", None, object()), ("_pair_insert", True, False),
                          ("_policy_key", None, len), ("storage_tier", None, object())):
        setattr(cache, name, on)
        assert _core.pair_insert_api(cache, params) is None, name
        setattr(cache, name, off)
        assert tree_state(cache) == before
    assert _core.pair_insert_api(cache, params) is not None
    base = make_config("full-swa-mamba-p1", 1)
    assert make_adapter("fast", dataclasses.replace(base, eagle=True)).cache._insert_fast is None
    assert make_adapter("fast", dataclasses.replace(
        base, eviction_policy="lfu")).cache._insert_fast is None
    plain = make_adapter("fast", base).cache
    assert plain._insert_fast is _core.pair_insert_api
    for hook in ("_units", "_check_aux", "_plan", "_insert"):
        cls = type(plain)
        inner = getattr(cls, hook)
        own = type("Own", (cls,), {hook: lambda self, *a, _f=inner: _f(self, *a)})
        plain.__class__ = own
        plain._pick_fast_paths()
        assert plain._insert_fast is None, hook
        plain.__class__ = cls
        plain._pick_fast_paths()
        assert plain._insert_fast is _core.pair_insert_api


def _sglang():
    """sglang's own RadixKey and InsertParams (the upstream venv), else a skip."""
    from uniradix.conformance.adapters import upstream as upstream_mod
    if not upstream_mod.upstream_available():
        pytest.skip("upstream sglang is not importable here")
    up = upstream_mod.load_upstream()
    return up.RadixKey, up.InsertParams


@pytest.mark.parametrize("kind", ["shaped", "sglang"])
@pytest.mark.parametrize("ps", [1, 16])
def test_keys_of_sglang_shape_are_read_in_place(ps, kind):
    """A key of SGLang's RadixKey shape over an array('q') (what sglang's Req builds; sglang's
    own class and params in the upstream venv), with and without an extra key: taken, the
    same tree as the Python function's."""
    check_sglang_keys(ps, kind, PAIR_ORDERS[1], (_api, _python))


def check_sglang_keys(ps: int, kind: str, order: tuple, on: tuple) -> None:
    """See :func:`test_keys_of_sglang_shape_are_read_in_place` (twin caches: :func:`_build`
    with ``on``)."""
    key_type, params_type = (ShapedKey, fast.InsertParams) if kind == "shaped" else _sglang()
    sides = [_build(ps, order, python, 256, on) for python in (False, True)]
    mamba, swa = "mamba" in order, "swa" in order
    rng = random.Random(ps)
    for step in range(60):
        toks = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 5) * ps + rng.randrange(ps))]
        ek, e = rng.choice((None, "t")), rng.choice((0, ps)) if swa else 0
        outs = []
        for s in sides:
            s[0].evict(fast.EvictParams(num_tokens=len(toks), swa_num_tokens=len(toks),
                                        mamba_num=1))
            v = s[1].alloc(-(-len(toks) // ps) * ps)[:len(toks)]  # (whole pages)
            state = s[2].alloc(1)
            r = s[0].insert(params_type(key=key_type(array("q", toks), ek), value=v,
                                        mamba_value=state.reshape(1) if mamba else None,
                                        swa_evicted_seqlen=e))
            outs.append(_result(r))
            if r.mamba_exist or not mamba:
                s[2].free(state.reshape(1))
        assert outs[0] == outs[1], step
        _compare(sides, step)
    assert sides[0][3].taken == sides[0][3].calls == 60


def test_no_reference_left_behind():
    """The same inserts over and over (taken with the path there, cut to whole pages, no whole
    page, declined): the reference counts of what the C entry reads (the cache's objects, the
    params and their key, tokens, value and state) and the number of live objects do not
    grow."""
    import gc

    cache, alloc, states, counting = _build(4, PAIR_ORDERS[0], False)
    toks = array("q", range(1, 19))
    slots = alloc.alloc(20)[:18]
    first = fast.InsertParams(key=fast.RadixKey(toks[:16]), value=slots[:16],
                              mamba_value=states.alloc(1).reshape(1))
    cache.insert(first)
    key = fast.RadixKey(toks, "ns")
    shaped = ShapedKey(toks)
    mv = torch.tensor([11])
    many = [
        fast.InsertParams(key=fast.RadixKey(toks[:16]), value=slots[:16], prev_prefix_len=16,
                          mamba_value=mv),
        fast.InsertParams(key=shaped, value=slots, prev_prefix_len=16, mamba_value=mv,
                          swa_evicted_seqlen=4),
        fast.InsertParams(key=fast.RadixKey(toks[:3]), value=slots[:3], mamba_value=mv),
        fast.InsertParams(key=key, value=slots, prev_prefix_len=-1, mamba_value=mv),
        fast.InsertParams(key=key, value=slots, mamba_value=None),
    ]

    def marks():
        return tuple(sys.getrefcount(o) for o in (
            cache, cache.root_node, cache.swa, cache.mamba, cache.swa.lru.head,
            cache.mamba.lru.head, cache._heap, key, toks, shaped, slots, mv, *many))

    def rounds(k):
        for _ in range(k):
            for p in many:
                _outcome(lambda p=p: cache.insert(p))

    rounds(5)
    gc.collect()
    # (the leaf heap grows by its lazy entries: one tuple per push)
    before, objects = marks(), len(gc.get_objects()) - len(cache._heap)
    taken = counting.taken
    rounds(200)
    gc.collect()
    assert counting.taken - taken == 600  # (the first three taken, the bad two declined)
    assert len(gc.get_objects()) - len(cache._heap) <= objects + 50
    assert marks() == before
