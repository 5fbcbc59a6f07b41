"""fast/hybrid.py ``inc_lock_ref`` / ``dec_lock_ref`` for the stock SWA and Mamba plug-ins
together without a host tier (the pair) in C (fast/_core.c "composed tree: pair locks",
``pair_inc`` / ``pair_dec``) against the general path's Python code, in one process.

Two caches driven alike: one runs the locks as they are (``_inc_lock_fast`` /
``_dec_lock_fast`` are the C twins, counted), its twin with them off (the general path:
``_inc_lock_py``, each component's ``lock``; ``_dec_full_lock``, each component's ``unlock``,
the pushes of the ``unlocked`` list).  After every step the two must agree on everything a
lock or an unlock writes: each node's fields, both records of each node (counts, boundary
marks, split marks), both LRU orders, the counters (the cache's and each component's, the
next boundary mark, the split epoch), the leaf heap entry by entry (the same pushes in the
same order), and every lock's result (delta, the window's mark, the skipped ids as paths, the
skip dict's keys in order) or error.  Recorded random sequences of Full + SWA + Mamba at pages
1 and 4 (components in both orders), and scenarios: a window across tombstones, a node
without a Mamba state, a double unlock, an unlock after splits of a skipped node, the
declines."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from aux_twins import Counting, insert_with_state, pages, path_of, recorded_run, tree_state

torch = pytest.importorskip("torch")

from stories import replay_twins  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.components import MAMBA_ID, SWA_ID  # noqa: E402
from uniradix.fast.components.swa import SWA_SPLIT_EPOCH  # noqa: E402
from uniradix.fast.errors import HandleError, NodeNotFound  # noqa: E402
from uniradix.fast.params import DecLockRefParams  # noqa: E402
from uniradix.fast.radix_key import RadixKey  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")

ORDERS = [("full", "swa", "mamba"), ("full", "mamba", "swa")]


def state(cache) -> tuple:
    """aux_twins.tree_state, and what else a lock may write: each record's split marks (their
    epochs: the origin ids differ between two caches), the SWA component's next boundary mark
    and split epoch."""
    marks = []
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        marks.append((path_of(node), [[e for e, _ in r.split_from] for r in node.aux]))
        stack.extend(node.children.values())
    swa = cache.swa
    return tree_state(cache), dict(marks), (swa._next_boundary, swa._split_epoch)


def result_view(res, node) -> tuple:
    """A lock's result with the skipped ids as the paths of the nodes they name (on the
    locked path; ("gone", id) for one no longer there), the skip dict's keys in order."""
    by_id = {}
    cur = node
    while cur is not None:
        by_id[cur.id] = path_of(cur)
        cur = cur.parent
    skips = {k: v if k == SWA_SPLIT_EPOCH else sorted(by_id.get(i, ("gone",)) for i in v)
             for k, v in res.skip_lock_node_ids.items()}
    return (type(res).__name__, res.delta, res.swa_uuid_for_lock, res.swa_uuid_for_host_lock,
            list(res.skip_lock_node_ids), skips)


def logging(cache, log: list):
    """``cache`` whose ``inc_lock_ref`` / ``dec_lock_ref`` (an instance's own, over the class's
    methods) log every result and error in ``log``."""
    cls = type(cache)

    def inc_lock_ref(node):
        try:
            res = cls.inc_lock_ref(cache, node)
        except Exception as e:
            log.append(("inc raised", type(e).__name__, str(e)))
            raise
        log.append(("inc", result_view(res, node)))
        return res

    def dec_lock_ref(node, params=None):
        try:
            res = cls.dec_lock_ref(cache, node, params)
        except Exception as e:
            log.append(("dec raised", type(e).__name__, str(e)))
            raise
        log.append(("dec", type(res).__name__, res.delta))
        return res

    cache.inc_lock_ref, cache.dec_lock_ref = inc_lock_ref, dec_lock_ref
    return cache


def c_side(adapter):
    """The adapter's cache with the C twins counted (``.inc``, ``.dec``)."""
    cache = adapter.cache
    assert cache._inc_lock_fast is _core.pair_inc and cache._dec_lock_fast is _core.pair_dec
    cache._inc_lock_fast, cache._dec_lock_fast = Counting(_core.pair_inc), Counting(_core.pair_dec)
    return adapter


def general(adapter):
    """The adapter's cache on the general lock paths (the C twins off)."""
    cache = adapter.cache
    assert cache._inc_lock_fast is _core.pair_inc
    cache._inc_lock_fast = cache._dec_lock_fast = None
    return adapter


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("name,seed", [("full-swa-mamba-p1", 1), ("full-swa-mamba-p1", 2),
                                       ("full-swa-mamba-p4", 3), ("full-swa-mamba-p4", 4),
                                       ("full-swa-mamba-p1", 5)])
def test_c_pair_locks_equal_general_path_in_lockstep(name, seed, order):
    """A recorded workload (inserts, matches, locks, unlocks, evictions, resets: splits of
    locked nodes, tombstones in locked windows) on both caches in lockstep."""
    config, steps = recorded_run(name, seed, order)
    logs: tuple[list, list] = ([], [])
    c, py = c_side(make_adapter("fast", config)), general(make_adapter("fast", config))
    logging(c.cache, logs[0])
    logging(py.cache, logs[1])
    ls = Lockstep([c, py], ["C locks", "general locks"], events=False)

    def same(step):
        assert logs[0] == logs[1], step
        assert state(c.cache) == state(py.cache), step

    replay_twins(ls, steps, same)
    inc, dec = c.cache._inc_lock_fast, c.cache._dec_lock_fast
    assert inc.taken == inc.calls > 20 and dec.taken == dec.calls > 20, (inc.calls, dec.calls)


# ----------------------------------------------------------------------------------------------
# scenarios: both caches built here, every call compared
# ----------------------------------------------------------------------------------------------


class Pair:
    """Two adapters: ``c`` with the C twins (counted), ``py`` on the general path; each call
    goes to both, their outcomes (results as views, or errors) and states must agree."""

    def __init__(self, ps: int, order=ORDERS[0], window: int = 2):
        base = make_config("full-swa-mamba-p1", 1)
        config = dataclasses.replace(base, page_size=ps, kv_slots=4096, swa_slots=4096,
                                     sliding_window=window * ps, mamba_slots=64,
                                     mamba_cache_chunk_size=ps, components=order)
        self.ps = ps
        self.c, self.py = c_side(make_adapter("fast", config)), general(make_adapter("fast", config))
        self.i = 0

    @property
    def sides(self):
        return (self.c, self.py)

    def step(self, op: str, **args) -> Any:
        """An adapter op on both, the same answer."""
        self.i += 1
        outs = [side.apply({"i": self.i, "op": op, "args": args}) for side in self.sides]
        assert outs[0] == outs[1]
        assert state(self.c.cache) == state(self.py.cache)
        return outs[0]

    def insert(self, tokens: list, prev: int = 0, **extra) -> None:
        insert_with_state(self, tokens, prev, **extra)

    def __call__(self, op: str, **args) -> Any:  # (insert_with_state's calls)
        return self.step(op, **args)

    def nodes(self, tokens: list) -> list:
        return [side.cache.find_node(RadixKey(tokens)) for side in self.sides]

    def both(self, fn) -> Any:
        """``fn(cache, node index)`` on each side: the same outcome, the same state after."""
        outs = []
        for k, side in enumerate(self.sides):
            try:
                outs.append(("ok", fn(side.cache, k)))
            except Exception as e:  # noqa: BLE001 - the two must raise alike
                outs.append(("raised", type(e), str(e)))
        assert outs[0] == outs[1]
        assert state(self.c.cache) == state(self.py.cache)
        return outs[0]

    def lock(self, tokens: list) -> tuple:
        """Lock the node of ``tokens`` on both; (the result's view, the two handles)."""
        ns = self.nodes(tokens)
        res = [side.cache.inc_lock_ref(n) for side, n in zip(self.sides, ns, strict=True)]
        assert result_view(res[0], ns[0]) == result_view(res[1], ns[1])
        assert state(self.c.cache) == state(self.py.cache)
        return result_view(res[0], ns[0]), [(n, r.to_dec_params()) for n, r in zip(ns, res, strict=True)]

    def unlock(self, handles: list) -> Any:
        return self.both(lambda cache, k: cache.dec_lock_ref(*handles[k]).delta)

    @property
    def taken(self) -> tuple:
        cache = self.c.cache
        return cache._inc_lock_fast.taken, cache._dec_lock_fast.taken


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps,seed", [(1, 1), (1, 2), (4, 3), (16, 4)])
def test_random_locks_anywhere(ps, seed, order):
    """The recorded runs lock only where a match ends (never a tombstone in the window, always
    a state): here random inserts (some with their window moved on: tombstones), locks of
    any node, unlocks (some twice), Full, SWA and Mamba evictions, on both caches."""
    t = Pair(ps, order, window=rng_window(seed))
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 6) for _ in range(rng.randrange(1, 9) * ps)] for _ in range(12)]
    held: list = []
    skipped = raised = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3:
            tokens = rng.choice(prompts)
            got = t.step("match_prefix", tokens=tokens)["device_indices"]
            new = t("alloc", n=len(tokens) - len(got))["slots"] if len(tokens) > len(got) else []
            (st,) = t("mamba_alloc", n=1)["slots"]
            extra = {"swa_evicted_seqlen": rng.randrange(len(tokens) // ps) * ps} \
                if rng.random() < 0.5 else {}
            ret = t("insert", tokens=tokens, value=got + list(new), prev_prefix_len=len(got),
                    mamba_value=[st], **extra)
            if ret.get("mamba_exist"):
                t("mamba_free", slots=[st])
        elif op < 0.6:
            paths = sorted(p for p in tree_state(t.c.cache)["nodes"] if p)  # (not the root)
            if paths:
                toks = [x for _, k in rng.choice(paths) for x in k]
                view, h = t.lock(toks)
                skipped += bool(view[5])
                held.append(h)
        elif op < 0.85 and held:
            h = held.pop(rng.randrange(len(held)))
            for _ in range(2 if rng.random() < 0.15 else 1):  # some released twice: where no
                # other lock holds the path HandleError (else another lock's release may find
                # its path released already, or its node evicted meanwhile: NodeNotFound)
                raised += t.unlock(h)[0] == "raised"
        else:
            t("evict", num_tokens=rng.randrange(3) * ps, swa_num_tokens=rng.randrange(4) * ps,
              mamba_num=rng.randrange(2))
    while held:
        raised += t.unlock(held.pop())[0] == "raised"
    inc, dec = t.taken
    assert inc > 30 and dec > 30 and skipped > 3 and raised, (inc, dec, skipped, raised)
    # (every call taken, or raised from C)
    assert (inc, dec + raised) == (t.c.cache._inc_lock_fast.calls, t.c.cache._dec_lock_fast.calls)


def rng_window(seed: int) -> int:
    return 1 + seed % 3  # (pages)


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 4])
def test_window_across_tombstones(ps, order):
    """A lock whose window crosses a tombstone (skipped, with the split epoch), fills up above
    it (the mark), a second lock on the same window (the mark kept), their unlocks in either
    order; an unlock without params walks to the root."""
    t = Pair(ps, order, window=3)
    a = pages(ps, *range(1, 9))
    t.insert(a[:2 * ps])  # P: pages 1-2 with SWA data
    t.insert(a[:6 * ps], prev=2 * ps, swa_evicted_seqlen=5 * ps)  # T: 3-5 tombstones, 6 data
    view, h1 = t.lock(a[:6 * ps])
    assert SWA_ID in view[5] and view[4].index(SWA_ID) + 1 == view[4].index(SWA_SPLIT_EPOCH)
    assert view[2] is not None  # the window filled up on P: marked
    view2, h2 = t.lock(a[:6 * ps])
    assert view2[2] == view[2] and view2[1] == 0  # the same mark, nothing newly Full-locked
    t.unlock(h1)
    t.unlock(h2)
    t.unlock(h2)  # released twice: HandleError on both
    _, h3 = t.lock(a[:6 * ps])
    t.both(lambda cache, k: cache.dec_lock_ref(h3[k][0]).delta)  # no params: no skips, no mark
    # a node without a state whose window crosses the tombstone: both components skip, their
    # keys in the components' order
    t.insert(a[:8 * ps], prev=6 * ps, swa_evicted_seqlen=5 * ps)  # L: 7-8, a state at 8
    t.insert(a[:7 * ps] + pages(ps, 30), swa_evicted_seqlen=5 * ps)  # L split at 7: its upper
    # part holds no state
    view4, h4 = t.lock(a[:7 * ps])
    keys = [MAMBA_ID, SWA_ID, SWA_SPLIT_EPOCH] if order[1] == "mamba" \
        else [SWA_ID, SWA_SPLIT_EPOCH, MAMBA_ID]
    assert view4[4] == keys, view4
    t.unlock(h4)
    assert t.taken == (4, 4)


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 16])
def test_node_without_a_mamba_state(ps, order):
    """A split leaves the upper part without a state: a lock there skips it (MAMBA_ID), and
    its unlock leaves the state below alone."""
    t = Pair(ps, order)
    a = pages(ps, *range(1, 7))
    t.insert(a)
    t.insert(a[:3 * ps] + pages(ps, 9))  # a split at page 3: the upper part has no state
    view, h = t.lock(a[:3 * ps])
    assert view[5].get(MAMBA_ID) == [path_of(t.nodes(a[:3 * ps])[0])]
    view2, h2 = t.lock(a)  # below: its state locked
    assert MAMBA_ID not in view2[5]
    t.unlock(h)
    t("evict", num_tokens=0, mamba_num=2)  # the unlocked state goes, the locked one stays
    t.unlock(h2)
    t.unlock(h2)
    assert t.taken == (2, 2)


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
def test_double_unlock_changes_nothing(order):
    """A second unlock of one lock: HandleError on both sides, nothing changed (the check walk
    comes before any write); the root's lock and unlock."""
    t = Pair(1, order)
    a = pages(1, *range(1, 7))
    t.insert(a)
    t.insert(a[:2] + [77])
    _, h = t.lock(a)
    _, hb = t.lock(a[:2] + [77])
    t.unlock(h)
    before = state(t.c.cache)
    out = t.unlock(h)
    assert out[:2] == ("raised", HandleError)
    assert state(t.c.cache) == before
    t.unlock(hb)
    roots = [side.cache.root_node for side in t.sides]
    t.both(lambda cache, k: result_view(cache.inc_lock_ref(roots[k]), roots[k]))
    t.both(lambda cache, k: cache.dec_lock_ref(roots[k]).delta)
    assert t.taken == (3, 3)


@needs_core
@pytest.mark.parametrize("order", ORDERS, ids=["swa-first", "mamba-first"])
@pytest.mark.parametrize("ps", [1, 4])
def test_unlock_after_splits_of_a_skipped_node(ps, order):
    """A lock skips a tombstone T, inserts split T twice, then the unlock: the split parts
    keep T's skip (split_off_skipped); and a locked node marked by hand as split off T since
    the lock (its count another lock's) is passed by alike."""
    t = Pair(ps, order, window=3)
    a = pages(ps, *range(1, 10))
    t.insert(a[:2 * ps])
    t.insert(a[:7 * ps], prev=2 * ps, swa_evicted_seqlen=6 * ps)  # T: pages 3-6
    _, h = t.lock(a[:7 * ps])
    t.insert(a[:4 * ps] + pages(ps, 20))  # T split at page 4
    t.insert(a[:3 * ps] + pages(ps, 21))  # and at page 3
    epochs = []
    for side in t.sides:
        cache = side.cache
        tomb = cache.find_node(RadixKey(a[:6 * ps]))
        p = cache.find_node(RadixKey(a[:2 * ps]))
        assert tomb.aux[cache.swa.i].value is None and p.aux[cache.swa.i].lock == 1
        p.aux[cache.swa.i].split_from = ((cache.swa._split_epoch + 1, tomb.id),)
        epochs.append(cache.swa._split_epoch)
    assert epochs[0] == epochs[1] > 0
    t.unlock(h)
    for side in t.sides:  # P's count was passed by, T's parts were skipped
        cache = side.cache
        assert cache.find_node(RadixKey(a[:2 * ps])).aux[cache.swa.i].lock == 1
    assert t.taken == (1, 1)


@needs_core
def test_declines_change_nothing():
    """What the C twins leave to the general path, having changed nothing: a disabled cache,
    params of another class or with skips that are not sets, a node without Full data, fields
    of another type, a pair that is not the cache's components; a node out of the tree is
    NodeNotFound.  Through ``inc_lock_ref`` / ``dec_lock_ref`` the general path then answers
    as the twin does."""
    t = Pair(1)
    a = pages(1, *range(1, 7))
    t.insert(a)
    t.insert(a[:3] + [55, 56])
    cache = t.c.cache
    node = cache.find_node(RadixKey(a))

    def declined(fn):
        before = state(cache)
        assert fn() is None
        assert state(cache) == before

    _, h = t.lock(a)
    params = h[0][1]

    class Sub(DecLockRefParams):
        pass

    declined(lambda: _core.pair_dec(cache, node, Sub(params.swa_uuid_for_lock)))
    bad = DecLockRefParams(params.swa_uuid_for_lock, None, {0: [1, 2]})
    declined(lambda: _core.pair_dec(cache, node, bad))
    declined(lambda: _core.pair_dec(cache, node, DecLockRefParams("x", None, {})))
    declined(lambda: _core.pair_dec(cache, node, DecLockRefParams(None, None, {SWA_ID: {1},
                                                                                SWA_SPLIT_EPOCH: set()})))
    cache.disable = True
    declined(lambda: _core.pair_inc(cache, node))
    declined(lambda: _core.pair_dec(cache, node, params))
    cache.disable = False
    node.lock_ref = float(node.lock_ref)
    declined(lambda: _core.pair_inc(cache, node))
    declined(lambda: _core.pair_dec(cache, node, params))
    node.lock_ref = int(node.lock_ref)
    rec = node.aux[cache.mamba.i]
    rec.lock, lock = None, rec.lock
    declined(lambda: _core.pair_inc(cache, node))
    rec.lock = lock
    cache._heap, heap = tuple(cache._heap), cache._heap
    declined(lambda: _core.pair_dec(cache, node, params))
    cache._heap = heap
    pair = cache._pair
    cache._pair = (pair[0], pair[1], pair[0])
    declined(lambda: _core.pair_inc(cache, node))
    cache._pair = pair
    node.value, value = None, node.value  # no Full data: _inc_lock_py's skipped segment
    declined(lambda: _core.pair_inc(cache, node))
    node.value = value
    up = node.parent  # an ancestor cut off the root (a broken tree: the walks meet None)
    up.parent, above = None, up.parent
    declined(lambda: _core.pair_inc(cache, node))
    declined(lambda: _core.pair_dec(cache, node, params))
    up.parent = above
    # the hook's None: the general path answers (a Full skip list, empty: the same unlock)
    t.both(lambda c, k: c.dec_lock_ref(h[k][0], DecLockRefParams(
        h[k][1].swa_uuid_for_lock, None, {**h[k][1].skip_lock_node_ids, 0: []})).delta)
    assert t.c.cache._dec_lock_fast.calls == 1 + t.c.cache._dec_lock_fast.taken
    # a node out of the tree
    gone = [side.cache.find_node(RadixKey(a[:3] + [55, 56])) for side in t.sides]
    t("evict", num_tokens=10 ** 6)
    assert gone[0].parent is None
    out = t.both(lambda c, k: c.inc_lock_ref(gone[k]))
    assert out[:2] == ("raised", NodeNotFound)
    out = t.both(lambda c, k: c.dec_lock_ref(gone[k]))
    assert out[:2] == ("raised", NodeNotFound)
    with pytest.raises(NodeNotFound):
        _core.pair_inc(cache, gone[0])
    with pytest.raises(NodeNotFound):
        _core.pair_dec(cache, gone[0], None)


@needs_core
def test_left_to_the_general_path():
    """An EAGLE cache, a policy order and a subclass with its own lock hook keep the general
    locks; one component keeps fast/one_aux.py's."""
    base = make_config("full-swa-mamba-p1", 1)
    eagle = make_adapter("fast", dataclasses.replace(base, eagle=True)).cache
    assert eagle._pair is not None and eagle._inc_lock_fast is None and eagle._dec_lock_fast is None
    lfu = make_adapter("fast", dataclasses.replace(base, eviction_policy="lfu")).cache
    assert lfu._inc_lock_fast is None and lfu._dec_lock_fast is None
    cache = make_adapter("fast", base).cache
    assert cache._inc_lock_fast is _core.pair_inc

    class Own(type(cache)):
        def _dec_full_lock(self, node, skip):
            return super()._dec_full_lock(node, skip)

    cache.__class__ = Own
    cache._pick_fast_paths()
    assert cache._inc_lock_fast is None and cache._dec_lock_fast is None
