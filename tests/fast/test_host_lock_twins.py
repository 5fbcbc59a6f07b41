"""The host tier's C twins for the Full component alone (fast/_core.c "host tier: Full match,
locks, acks": ``host_match``, ``host_inc``, ``host_dec``, ``host_unlock``, ``host_writing``)
against the Python functions they stand for (fast/host_full.py ``match_host``,
``inc_lock_host``, ``dec_lock_host``; fast/tiers/host.py ``HostTier._full_write_unlock``,
``HostTier.writing_check``), in one process.

Two caches built alike: one runs with the C core (the twins counted), the other with
``_core`` off in fast/host_full.py and fast/tiers/host.py for every call it gets, so its
paths are the Python functions.  After every step the two must agree on everything these
write: each node's fields (keys, values, host values, lock counts, stamps, hit counts), the
leaf heap and the host leaf heap entry by entry (the same pushes in the same order), the host
leaves, the counters, the in-flight maps and the ack queues, and every answer (results as
views, errors by type and message).  Recorded conformance runs (write-through and write-back,
pages 1 and 4), random steps over sglang's allocators (where sglang imports) and the project's
own (with acks completed by hand), and scenarios: an evicted bottom skipped, a double unlock,
an ack whose unlock is refused, the declines, and the references a call leaves behind."""

from __future__ import annotations

import contextlib
import random
import sys
import types

import pytest

from aux_twins import Counting, path_of, recorded_run

torch = pytest.importorskip("torch")

from test_host_fast_paths import _cache, _step  # noqa: E402

from stories import replay_twins  # noqa: E402
from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import host_full  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.errors import HandleError  # noqa: E402
from uniradix.fast.hicache import HostDecLockRefParams  # noqa: E402
from uniradix.fast.tiers import host as host_tier  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")

TWINS = ("host_match", "host_inc", "host_dec", "host_unlock", "host_writing")


class CountedCore:
    """The C core with the twins counted (``counts[name]``: a :class:`Counting`)."""

    def __init__(self) -> None:
        self.counts = {name: Counting(getattr(_core, name)) for name in TWINS}

    def __getattr__(self, name: str):
        return self.counts[name] if name in TWINS else getattr(_core, name)


@contextlib.contextmanager
def core_as(core):
    """fast/host_full.py's and fast/tiers/host.py's ``_core`` set to ``core`` (None: their
    Python functions alone) for the calls inside."""
    saved = host_full._core, host_tier._core
    host_full._core = host_tier._core = core
    try:
        yield
    finally:
        host_full._core, host_tier._core = saved


class Side:
    """A conformance adapter whose every call runs with ``_core`` as ``core``."""

    def __init__(self, adapter, core) -> None:
        self.adapter, self.core = adapter, core

    @property
    def cache(self):
        return self.adapter.cache

    def apply(self, step):
        with core_as(self.core):
            return self.adapter.apply(step)

    def snapshot(self):
        with core_as(self.core):
            return self.adapter.snapshot()

    def violations(self):
        return self.adapter.violations()

    def __getattr__(self, name):
        return getattr(self.adapter, name)


def listed(v):
    return None if v is None else v.tolist()


def state(cache) -> dict:
    """Everything the twins may write, with nodes named by their paths (ids differ between
    two caches)."""
    nodes, by_id = {}, {}
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        p = path_of(node)
        by_id[node.id] = p
        nodes[p] = (node.ck, listed(node.value), listed(node.host_value), node.lock_ref,
                    node.host_lock_ref, node.aux_lock, node.dev_children,
                    node.last_access_time, node.hit_count, node.created, node.priority)
        stack.extend(node.children.values())
    tier = cache.tier
    cc = tier.controller

    def entry(e):
        lock = e.lock
        return (path_of(e.node), None if lock is None else
                (type(lock).__name__, path_of(lock.anchor) if lock.anchor is not None else None,
                 {k: sorted((by_id.get(i, ("gone",)) for i in v), key=repr)
                  for k, v in lock.skip_lock_node_ids.items()}))

    def acks(queue):
        return [(type(a.finish_event).__name__, a.finish_event.query(),
                 [by_id.get(i, ("gone",)) for i in a.node_ids]) for a in queue]
    return {
        "nodes": nodes,
        "heap": [(s, path_of(n), n.parent is not None) for s, n in cache._heap],
        "host heap": [(s, path_of(n)) for s, n in tier.host_leaf_heap.entries],
        "host leaves": sorted((path_of(n) for n in tier.host_leaves), key=repr),
        "counts": (cache._clock, cache._evictable, cache._protected, tier.host_tokens,
                   cc.mem_pool_host.available_size()),
        "in flight": ([(by_id.get(i, ("gone",)), entry(e))
                       for i, e in tier.ongoing_write_through.items()],
                      [(by_id.get(i, ("gone",)), entry(e))
                       for i, e in tier.ongoing_load_back.items()]),
        "acks": (acks(cc.ack_write_queue), acks(cc.ack_load_queue)),
    }


def view(r, node=None):
    """An answer with its nodes as paths."""
    if isinstance(r, fast.MatchResult):
        return (r.device_indices.tolist(), path_of(r.last_device_node),
                path_of(r.last_host_node), path_of(r.best_match_node), r.host_hit_length,
                r.swa_host_hit_length, r.mamba_host_hit_length, r.mamba_branching_seqlen,
                r.cache_protected_len)
    if isinstance(r, host_tier.HostIncLockRefResult):
        by_id = {}
        cur = node
        while cur is not None:
            by_id[cur.id] = path_of(cur)
            cur = cur.parent
        return (type(r).__name__, r.delta, r.swa_uuid_for_lock, r.swa_uuid_for_host_lock,
                {k: sorted((by_id.get(i, ("gone",)) for i in v), key=repr)
                 for k, v in r.skip_lock_node_ids.items()},
                None if r.anchor is None else path_of(r.anchor))
    if isinstance(r, fast.DecLockRefResult):
        return (type(r).__name__, r.delta)
    return r


class Pair:
    """Two caches built alike: ``c`` runs the C twins (counted in ``core.counts``), ``py``
    their Python functions; ``both(fn)`` runs ``fn(cache, k)`` on each and compares."""

    def __init__(self, c, py) -> None:
        self.c, self.py = c, py
        self.core = CountedCore()

    def both(self, fn):
        outs = []
        for k, (cache, core) in enumerate(((self.c, self.core), (self.py, None))):
            with core_as(core):
                try:
                    outs.append(("ok", fn(cache, k)))
                except Exception as e:  # noqa: BLE001 - the two must raise alike
                    outs.append(("raised", type(e), str(e)))
        assert outs[0] == outs[1]
        assert state(self.c) == state(self.py)
        return outs[0]

    def taken(self) -> dict:
        return {name: (c.calls, c.taken) for name, c in self.core.counts.items()}


# ----------------------------------------------------------------------------------------------
# recorded conformance runs
# ----------------------------------------------------------------------------------------------


@needs_core
@pytest.mark.parametrize("name,seed", [("hicache-wt-p1", 1), ("hicache-wt-p1", 2),
                                       ("hicache-wt-p4", 3), ("hicache-wb-p1", 4),
                                       ("hicache-wb-p4", 5)])
def test_c_twins_equal_python_functions_on_recorded_runs(name, seed):
    """A recorded workload (inserts, matches, locks, unlocks, evictions to the host and off
    it, load backs, acks, resets) on both caches in lockstep."""
    config, steps = recorded_run(name, seed, ("full",))
    core = CountedCore()
    c, py = Side(make_adapter("fast", config), core), Side(make_adapter("fast", config), None)
    assert c.cache._match_fast is host_full.match_host  # (fast/host_full.py's paths)
    ls = Lockstep([c, py], ["C twins", "Python functions"], events=False)

    def same(step):
        assert state(c.cache) == state(py.cache), step

    replay_twins(ls, steps, same)
    counts = core.counts
    for twin in ("host_match", "host_inc", "host_dec"):
        assert counts[twin].taken == counts[twin].calls > 10, (twin, counts[twin].calls)
    if "wt" in name:  # (write-through: every backup's lock released at its ack)
        assert counts["host_writing"].taken > 5, counts["host_writing"].calls


# ----------------------------------------------------------------------------------------------
# random steps: sglang's allocators (where sglang imports), the project's own
# ----------------------------------------------------------------------------------------------


def _sglang_cache(policy: str, page: int):
    from uniradix.conformance.bench.configs import BenchConfig
    from uniradix.conformance.bench.sglang_alloc import fast_build
    cache, alloc, _ = fast_build(BenchConfig(hicache=policy), 64, page)
    return cache, alloc


def _sglang_importable() -> bool:
    try:
        from uniradix.conformance.bench.sglang_alloc import _sglang
        _sglang()
    except Exception:  # noqa: BLE001 - absent, or an install that fails at import
        return False
    return True


def _random_pair(policy, page, io, allocator):
    if allocator == "sglang":
        if not _sglang_importable():
            pytest.skip("sglang's allocators do not import here")
        (a, alloc_a), (b, alloc_b) = _sglang_cache(policy, page), _sglang_cache(policy, page)
    else:
        (a, alloc_a), (b, alloc_b) = _cache(policy, io, page), _cache(policy, io, page)
    assert a._match_fast is host_full.match_host and a._dec_lock_host is host_full.dec_lock_host
    return Pair(a, b), alloc_a, alloc_b


@needs_core
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 2])
@pytest.mark.parametrize("io,allocator", [("manual", "own"), ("sync", "own"),
                                          ("sync", "sglang")])
def test_c_twins_equal_python_functions_on_random_steps(policy, page, io, allocator):
    """Random inserts, matches (scheduler-shaped keys, extra keys, tails), locks of matched
    nodes (evicted ones too), unlocks (some twice), device and host evictions, load backs,
    acks completed by hand and processed."""
    pair, alloc_a, alloc_b = _random_pair(policy, page, io, allocator)
    ra, rb = random.Random(5), random.Random(5)
    held: tuple[list, list] = ([], [])
    allocs = (alloc_a, alloc_b)
    rngs = (ra, rb)
    for i in range(400):
        got = pair.both(lambda cache, k: _step(cache, allocs[k], rngs[k], page, True, held[k]))
        # (an unlock twice may take a write-through lock's count: its ack's unlock is refused)
        assert got[0] == "ok" or got[1] is HandleError, (i, got)
        if i % 50 == 0:  # (the same, which a misuse above may make non-empty)
            assert len(pair.c.violations()) == len(pair.py.violations()), i
    counts = pair.taken()
    assert counts["host_match"][1] == counts["host_match"][0] > 50, counts
    assert counts["host_inc"][1] == counts["host_inc"][0] > 5, counts
    assert counts["host_dec"][1] > 5, counts  # (a refused one raised from C: not taken)
    if policy == "write_through":
        assert counts["host_writing"][1] > 5 or counts["host_unlock"][1] > 5, counts


# ----------------------------------------------------------------------------------------------
# scenarios
# ----------------------------------------------------------------------------------------------


def _insert(pair: Pair, allocs, toks: list) -> None:
    def ins(cache, k):
        r = cache.insert(fast.InsertParams(key=fast.RadixKey(toks),
                                           value=allocs[k].alloc(len(toks))))
        return (r.prefix_len, r.total_len)
    pair.both(ins)


def _match(pair: Pair, toks: list, extra=None):
    return pair.both(lambda cache, k: view(cache.match_prefix(
        fast.MatchPrefixParams(key=fast.RadixKey(toks, extra)))))


@needs_core
def test_lock_of_an_evicted_bottom_then_a_double_unlock():
    """A lock of a node evicted to the host skips it and its evicted ancestors (their ids
    remembered, the anchor above them); its unlock releases the anchor's path once; the same
    unlock again is refused (HandleError) with nothing changed, on both."""
    (a, alloc_a), (b, alloc_b) = _cache("write_back", "sync", 1), _cache("write_back", "sync", 1)
    pair, allocs = Pair(a, b), (alloc_a, alloc_b)
    for toks in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9]):
        _insert(pair, allocs, toks)
    # the two bottom nodes to the host (write-back: backed up as they go)
    pair.both(lambda cache, k: cache.evict(fast.EvictParams(num_tokens=4)).num_tokens_evicted)
    m = _match(pair, [1, 2, 3, 4, 5, 6, 7, 8])
    assert m[1][4] > 0  # (host tokens below the device part)
    handles: list = [[], []]

    def lock(cache, k):
        node = cache.match_prefix(fast.MatchPrefixParams(
            key=fast.RadixKey([1, 2, 3, 4, 5, 6, 7, 8]))).best_match_node
        r = cache.inc_lock_ref(node)
        handles[k].append((node, r.to_dec_params()))
        return view(r, node)
    got = pair.both(lock)
    assert got[1][4] and got[1][4][0], got  # (skipped ids)
    for _ in range(2):  # the second unlock: refused, nothing changed
        out = pair.both(lambda cache, k: view(cache.dec_lock_ref(*handles[k][0])))
    assert out[0] == "raised" and out[1] is HandleError, out
    assert pair.taken()["host_dec"] == (2, 1)  # (the refused one raised from C)

    def partly_released(cache, k):  # a path whose upper part lost its count: refused whole
        deep = cache.find_node(fast.RadixKey([1, 2, 9]))
        r = cache.inc_lock_ref(deep)
        upper = deep.parent
        cache.dec_lock_ref(upper, HostDecLockRefParams(anchor=upper))
        return cache.dec_lock_ref(deep, r.to_dec_params())
    out = pair.both(partly_released)
    assert out[0] == "raised" and out[1] is HandleError, out


@needs_core
def test_split_of_an_evicted_node_with_a_host_copy():
    """A match ending inside a node evicted to the host splits it (its host copy cut) and
    counts the host tokens of the upper part; the stamps re-enter host leaves on the host
    heap."""
    (a, alloc_a), (b, alloc_b) = _cache("write_back", "sync", 1), _cache("write_back", "sync", 1)
    pair, allocs = Pair(a, b), (alloc_a, alloc_b)
    for toks in ([5, 6], [5, 6, 7, 8, 9, 10], [5, 11]):
        _insert(pair, allocs, toks)
    pair.both(lambda cache, k: cache.evict(fast.EvictParams(num_tokens=5)).num_tokens_evicted)
    for toks in ([5, 6, 7, 8, 99], [5, 6, 7, 8, 9, 10], [5, 6, 7], [5, 11, 12]):
        _match(pair, toks)
    assert pair.taken()["host_match"] == (4, 4)


@needs_core
def test_write_acks_with_a_refused_unlock():
    """An ack whose lock's path was released meanwhile: the ack loop raises HandleError at
    that ack (the acks before it processed, it off the queue and out of the map) on both."""
    (a, alloc_a), (b, alloc_b) = (_cache("write_through", "manual", 1),
                                  _cache("write_through", "manual", 1))
    pair, allocs = Pair(a, b), (alloc_a, alloc_b)
    for toks in ([1, 2, 3], [1, 2, 3, 4, 5], [7, 8]):
        _insert(pair, allocs, toks)

    def release_second(cache, k):  # the second backup's lock released by hand
        entries = list(cache.tier.ongoing_write_through.values())
        with core_as(None):
            cache.tier._full_write_unlock(entries[1].lock.anchor)
        cache.cache_controller.complete(-1, -1)
        return len(entries)
    pair.both(release_second)
    out = pair.both(lambda cache, k: cache.check_hicache_events())
    assert out[0] == "raised" and out[1] is HandleError, out
    pair.both(lambda cache, k: cache.check_hicache_events())  # (the rest processed)
    assert pair.taken()["host_writing"][0] == 2


@needs_core
def test_declines_change_nothing():
    """What the twins leave to the Python functions: other params, an unlock without an
    anchor, a disabled cache, a tier of another class, a heap that is not a list, a KV events
    log, an ack of another shape."""
    cache, alloc = _cache("write_through", "manual", 1)
    for toks in ([1, 2, 3], [1, 2, 4]):
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(3)))
    node = cache.find_node(fast.RadixKey([1, 2, 3]))
    cache.cache_controller.complete(-1, -1)  # (the acks done: the loop would run)
    before = state(cache)
    units = host_full.match_key(cache, fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3])))
    assert _core.host_dec(cache, node, fast.DecLockRefParams()) is None
    assert _core.host_dec(cache, node, HostDecLockRefParams()) is None
    cache.disable = True
    assert _core.host_inc(cache, node) is None
    assert _core.host_dec(cache, node, HostDecLockRefParams(anchor=node)) is None
    cache.disable = False
    heap = cache._heap
    cache._heap = tuple(heap)
    assert _core.host_match(cache, *units) is None
    assert _core.host_unlock(cache, node) is None
    cache._heap = heap
    cache._events = object()
    assert _core.host_writing(cache.tier) is None
    cache._events = None
    q = cache.cache_controller.ack_write_queue
    q.append(tuple(q[0]))  # (a plain tuple, not an Ack)
    assert _core.host_writing(cache.tier) is None
    q.pop()
    tier = cache.tier
    cache.tier = types.SimpleNamespace(cache=cache)
    assert _core.host_dec(cache, node, HostDecLockRefParams(anchor=node)) is None
    cache.tier = tier
    assert state(cache) == before


@needs_core
def test_no_references_left_behind():
    """Repeated matches, locks, unlocks and acks leave no reference behind: the refcounts
    of the nodes, the values and the cache's objects stay as they were."""
    cache, alloc = _cache("write_through", "manual", 1)
    for toks in ([1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 6], [9, 9]):
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(len(toks))))
    cache.cache_controller.complete(-1, -1)
    cache.check_hicache_events()
    node = cache.find_node(fast.RadixKey([1, 2, 3, 4, 5]))
    params = fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3, 4, 5, 7]))

    tier = cache.tier
    core = CountedCore()

    def cycle():
        with core_as(core):
            for _ in range(50):
                cache.match_prefix(params)
                r = cache.inc_lock_ref(node)
                cache.dec_lock_ref(node, r.to_dec_params())
                # a write-through backup's ack, processed (its lock released)
                tier.ongoing_write_through[node.id] = host_tier.InFlight(
                    node, tier._full_write_lock(node))
                cache.cache_controller.ack_write_queue.append(
                    host_tier.Ack(None, host_tier._Event(True), [node.id]))
                cache.check_hicache_events()
        cache._heap.clear()  # (the pushes' entries, not references the calls kept)
        tier.host_leaf_heap.entries.clear()

    cycle()
    watched = [node, node.parent, node.value, node.key, cache.root_node, cache._empty]
    before = [sys.getrefcount(o) for o in watched]
    cycle()
    assert [sys.getrefcount(o) for o in watched] == before
    assert {name: c.taken for name, c in core.counts.items()} == {
        "host_match": 100, "host_inc": 100, "host_dec": 100, "host_unlock": 0,
        "host_writing": 100}
