"""fast/_core.c ``one_insert`` (fast/one_aux.py ``insert_one``'s walk, new leaf, commit and the
Mamba queue's release in C) against ``insert_one``'s own Python loop, in one process.

Two caches get the same calls: one runs the C path, its twin the Python loop (``one_aux._core``
seen through a proxy whose ``one_insert`` declines, so everything else the twin does, its
other C helpers included, is the same).  After every step the whole state must agree: the
tree with every node's stamps, locks, slots and SWA/Mamba data, the component's LRU order, the
Full heap list entry by entry (same pushes in the same order), the counters and the clock;
over sglang's allocators also their free lists.  Errors raised half-way (a split that fails)
must leave both caches in the same state.  Where the C path declines (KV events, the slot
ledger) it changes nothing and the Python loop answers.
"""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import types
from array import array

import pytest

from stories import replay_twins

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config, record  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import one_aux  # noqa: E402
from uniradix.fast.cache import UnifiedRadixCache  # noqa: E402
from uniradix.fast.hybrid import HybridRadixCache  # noqa: E402
from uniradix.spec.config import CacheConfig  # noqa: E402

_real = one_aux._core
pytestmark = pytest.mark.skipif(_real is None or not hasattr(_real, "one_insert"),
                                reason="the C core is not built or not in use")


class _Proxy:
    """``one_aux``'s view of the C core: every helper the real one's, ``one_insert`` either
    declining (the Python loop runs) or counted (answers, declines), ``one_plan`` the C walk
    or fast/cache.py's ``_plan``."""

    def __init__(self, c_insert: bool) -> None:
        self.c_insert = c_insert
        self.answers = self.declines = 0

    def __getattr__(self, name):
        return getattr(_real, name)

    def one_plan(self, root, units, ek, ps, step):
        if self.c_insert:
            return _real.one_plan(root, units, ek, ps, step)
        # the Python loop's twin plans with fast/cache.py's own _plan
        return UnifiedRadixCache._plan(types.SimpleNamespace(root_node=root, page_size=ps),
                                       ek, units)

    def one_insert(self, *args):
        if not self.c_insert:
            return None
        r = _real.one_insert(*args)
        if r is None:
            self.declines += 1
        else:
            self.answers += 1
        return r


@pytest.fixture(autouse=True)
def _insert_one_itself(monkeypatch):
    """Caches here run ``insert_one`` (its C walk against its Python loop), not the C entry in
    front of it (``one_insert_api``: tests/fast/test_one_insert_api.py)."""
    pick = HybridRadixCache._pick_fast_paths

    def pick_without_api(cache):
        pick(cache)
        if cache._insert_next is one_aux.insert_one:
            cache._insert_fast, cache._insert_next = one_aux.insert_one, None

    monkeypatch.setattr(HybridRadixCache, "_pick_fast_paths", pick_without_api)


@contextlib.contextmanager
def _core_as(proxy: _Proxy):
    saved = one_aux._core
    one_aux._core = proxy
    try:
        yield
    finally:
        one_aux._core = saved


def _path(node) -> tuple:
    out = []
    while node is not None and node.parent is not None:
        out.append((node.extra_key, tuple(node.key)))
        node = node.parent
    if node is not None and not out and node.key is not None and len(node.key):
        out.append((node.extra_key, tuple(node.key)))  # (a detached node: its own key)
    return tuple(reversed(out))


def _state(cache) -> dict:
    """Everything insert may touch, in a form two caches of one process can compare (node ids
    differ: nodes are named by their keys from the top)."""
    comp = cache.components[0]
    nodes, todo = [], [cache.root_node]
    while todo:
        node = todo.pop()
        rec = node.aux[0] if node.aux else None
        nodes.append((
            _path(node), None if node.value is None else node.value.tolist(),
            node.lock_ref, node.aux_lock, node.last_access_time, node.dev_children,
            node.created, node.hit_count, node.priority, node.ck,
            None if rec is None else (
                None if rec.value is None else rec.value.tolist(), rec.lock, rec.boundary,
                tuple(epoch for epoch, _ in rec.split_from))))
        todo.extend(sorted(node.children.values(), key=lambda c: tuple(c.key), reverse=True))
    lru, rec = [], comp.lru.head.lru_next
    while rec is not comp.lru.tail:
        lru.append(_path(rec.node))
        rec = rec.lru_next
    return {
        "nodes": nodes, "lru": lru,
        "heap": [(stamp, _path(node)) for stamp, node in cache._heap],
        "counters": (cache._clock, cache._evictable, cache._protected, comp.evictable,
                     comp.protected),
    }


def _twin(adapter, proxy: _Proxy):
    """``adapter`` with every step applied under ``proxy`` (a reset step builds a new cache)."""
    apply = adapter.apply

    def apply_with(step):
        with _core_as(proxy):
            return apply(step)

    adapter.apply = apply_with
    return adapter


def _p16_swa(seed: int) -> CacheConfig:
    rng = random.Random(seed)
    kv = rng.choice((256, 384, 512))
    return CacheConfig(page_size=16, components=("full", "swa"), kv_slots=kv,
                       sliding_window=32, swa_slots=kv // 2 // 16 * 16)


CONFIGS = [("swa-w8-p1", 11), ("swa-w8-p1", 12), ("swa-w8-p4", 13), ("swa-w32-p1", 14),
           ("swa-p16", 15), ("swa-p16", 16), ("mamba-p1", 17), ("mamba-p1", 18)]


@pytest.mark.parametrize("name,seed", CONFIGS)
def test_c_insert_equals_the_python_loop(name, seed):
    """The recorded random workload (inserts with prev_prefix_len and evicted SWA windows,
    matches, locks, evictions, splits, tombstones) on a C-path cache and its Python-loop twin:
    every step's observation and the whole state agree, and the C path answered inserts."""
    config = _p16_swa(seed) if name == "swa-p16" else make_config(name, seed)
    steps = record(make_adapter("fast", config), config, seed, 1200, check_violations=False)
    c_proxy, py_proxy = _Proxy(True), _Proxy(False)
    c_side = _twin(make_adapter("fast", config), c_proxy)
    py_side = _twin(make_adapter("fast", config), py_proxy)
    assert c_side.cache._insert_fast is one_aux.insert_one
    assert c_side.cache.validate_slots  # (the adapters keep the slot ledger: _own, _free)
    ls = Lockstep([c_side, py_side], ["C insert", "Python insert"], events=False)

    def same_states(step):
        assert _state(c_side.cache) == _state(py_side.cache), step

    inserts = replay_twins(ls, steps, same_states).count("insert")
    assert inserts > 40 and c_proxy.answers > 0.8 * inserts, (inserts, c_proxy.answers)


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_one_plan_equals_the_cache_plan(ps):
    """``one_plan`` against fast/cache.py ``_plan`` on a grown tree (extra keys, splits that
    end inside a node, keys ending mid-node, no match): the same pairs, the same node objects;
    with a step that is not the C core's own (keys.match_step_py) too."""
    from uniradix.fast import keys
    rng = random.Random(ps)
    cache = _list_alloc_cache(ps)
    alloc = cache.token_to_kv_pool_allocator
    base = [rng.randrange(1, 5) for _ in range(6 * ps)]
    for _ in range(60):
        toks = base[:rng.randrange(0, 6) * ps] + [rng.randrange(1, 5)
                                                   for _ in range(rng.randrange(1, 4) * ps)]
        ek = rng.choice((None, None, "a"))
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks, ek), value=alloc.alloc(len(toks))))
    checked = 0
    for _ in range(300):
        toks = base[:rng.randrange(0, 7) * ps] + [rng.randrange(1, 5)
                                                   for _ in range(rng.randrange(0, 4) * ps)]
        units, ek = array("q", toks), rng.choice((None, "a", "b"))
        want = cache._plan(ek, units)
        for step in (keys.match_step, keys.match_step_py):
            got = _real.one_plan(cache.root_node, units, ek, ps, step)
            assert len(got) == len(want)
            assert all(a[0] is b[0] and a[1] == b[1] for a, b in zip(got, want, strict=True))
        checked += len(want) > 1
    assert checked > 30


# ---- direct drivers: allocators, errors, declines ---------------------------------------------


def _list_alloc_cache(ps: int, events: bool = False, validate: bool = False,
                      slots: int = 1 << 16):
    """An SWA cache over the bench's plain free-list allocator (no sglang)."""
    from uniradix.conformance.bench.hybrid import SwaFreeListAllocator
    alloc = SwaFreeListAllocator(slots, slots // 2, ps, torch)
    return fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
        page_size=ps, tree_components=("full", "swa"), sliding_window_size=8,
        enable_kv_cache_events=events, validate_slots=validate))


def _swa_inserts(rng: random.Random, ps: int, count: int):
    """(tokens, prev_prefix_len, swa_evicted_seqlen) for ``count`` inserts over a few shared
    prefixes (the walk splits, finds duplicates, tombstones from evicted windows)."""
    base = [rng.randrange(1, 6) for _ in range(4 * ps)]  # (prefixes of one base: splits)
    prefixes = [base[:rng.randrange(1, 5) * ps]
                + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 3) * ps)]
                for _ in range(4)]
    out = []
    for _ in range(count):
        toks = rng.choice(prefixes) + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 5) * ps)]
        n = len(toks)
        prev = rng.randrange(0, n // ps + 1) * ps if rng.random() < 0.5 else 0
        e = rng.choice((0, 0, rng.randrange(0, n // ps + 1) * ps))
        out.append((toks, prev, e))
    return out


def _run(cache, proxy, toks, value, prev, e):
    """One insert under ``proxy``: its answer, or its error.  ``value`` None: fresh slots from
    the cache's own allocator (two caches in lockstep get the same ones)."""
    if value is None:
        value = cache.token_to_kv_pool_allocator.alloc(len(toks))
    with _core_as(proxy):
        try:
            r = cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=value.clone(),
                                               prev_prefix_len=prev, swa_evicted_seqlen=e))
        except Exception as exc:  # noqa: BLE001 - the error itself is compared
            return type(exc).__name__, str(exc)
        return r.prefix_len, r.total_len, r.mamba_exist


@pytest.mark.parametrize("method", ["_split", "_free"])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", [1, 2])
def test_a_call_failing_half_way_leaves_the_same_state(method, ps, seed, monkeypatch):
    """A ``_split`` (inside the walk, or the commit's split at the window) or a ``_free`` (a
    node's duplicates) that raises on its k-th call raises the same error from both paths and
    leaves the same state: the stamps, heap entries and LRU moves made before it stay, the
    clock as far as it went."""
    rng = random.Random(seed)
    own = getattr(HybridRadixCache, method)
    budget: dict[int, int] = {}

    def failing(self, *args):
        left = budget.get(id(self), -1)
        if left == 0:
            raise RuntimeError(f"{method} refused")
        budget[id(self)] = left - 1
        return own(self, *args)

    monkeypatch.setattr(HybridRadixCache, method, failing)
    caches = [_list_alloc_cache(ps), _list_alloc_cache(ps)]
    proxies = [_Proxy(True), _Proxy(False)]
    errors = 0
    for toks, prev, e in _swa_inserts(rng, ps, 120):
        k = rng.choice((-1, -1, 0, 1))
        outs = []
        for cache, proxy in zip(caches, proxies, strict=True):
            budget[id(cache)] = k
            outs.append(_run(cache, proxy, toks, None, prev, e))
        assert outs[0] == outs[1]
        errors += outs[0][0] == "RuntimeError"
        assert _state(caches[0]) == _state(caches[1])
    assert errors > 2 and proxies[0].answers > 20, (errors, proxies[0].answers)


@pytest.mark.parametrize("seed", [3, 4])
def test_kv_events(seed):
    """KV events (``stored`` per new leaf): the C path makes the same call; the same events
    and state as the Python loop's.  (The slot ledger: the lockstep test above, whose caches
    keep one.)"""
    rng = random.Random(seed)
    caches = [_list_alloc_cache(1, True) for _ in range(2)]
    proxies = [_Proxy(True), _Proxy(False)]
    for toks, _prev, e in _swa_inserts(rng, 1, 60):
        outs = [_run(c, p, toks, None, 0, e) for c, p in zip(caches, proxies, strict=True)]
        assert outs[0] == outs[1]
        assert _state(caches[0]) == _state(caches[1])
        assert caches[0].take_events() == caches[1].take_events()
    assert proxies[0].answers > 40 and proxies[0].declines == 0


def test_declines_change_nothing():
    """What ``one_insert`` does not take (a plan that is not a list of (node, int) pairs, units
    that are not an int64 buffer of n items, a heap that is not a list): None, the cache as it
    was."""
    cache = _list_alloc_cache(1)
    with _core_as(_Proxy(True)):
        cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4]),
                                       value=torch.arange(1, 5, dtype=torch.int64)))
    comp, root = cache.components[0], cache.root_node
    child = next(iter(root.children.values()))
    value = torch.arange(10, 16, dtype=torch.int64)
    units = array("q", [1, 2, 3, 4, 5, 6])
    good = [(child, 4)]
    before = _state(cache)

    def call(plan=good, units=units, n=6, cache=cache):
        return _real.one_insert(cache, comp, cache.swa, plan, value, units, None, 0, 0, n, 6,
                                None, False, 1)

    assert call(plan=tuple(good)) is None
    assert call(plan=[[child, 4]]) is None
    assert call(plan=[(child, 4.0)]) is None
    assert call(plan=[(child, True)]) is None
    assert call(units=[1, 2, 3, 4, 5, 6]) is None
    assert call(units=array("i", [1, 2, 3, 4, 5, 6])) is None
    assert call(n=5) is None
    heap = cache._heap
    cache._heap = tuple(heap)
    assert call() is None
    cache._heap = heap
    assert _state(cache) == before
    r = call()  # and the same call with what it takes answers
    assert (r.prefix_len, r.total_len) == (4, 6) and _state(cache) != before


def test_no_reference_leaks():
    """Thousands of inserts through the C path (walks, splits, duplicates, new leaves) leave
    the reference counts of the objects they pass through as they were and leave no objects
    behind (nor do the same inserts through the Python loop)."""
    growth = []
    for c_insert in (True, False):
        cache = _list_alloc_cache(1, slots=256)  # (small: the free list's pieces get joined)
        proxy = _Proxy(c_insert)
        alloc = cache.token_to_kv_pool_allocator
        ek = "ns-" + str(random.random())  # (a fresh string: only this test holds it)
        comp = cache.components[0]

        def one_round(cache=cache, proxy=proxy, alloc=alloc, ek=ek):
            for toks in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 7], [1, 2, 3, 4, 5, 6]):
                with _core_as(proxy):
                    cache.insert(fast.InsertParams(key=fast.RadixKey(toks, ek),
                                                   value=alloc.alloc(len(toks))))
            cache.evict(fast.EvictParams(num_tokens=100, swa_num_tokens=100))
            cache._heap.clear()

        one_round()
        gc.collect()
        watched = (cache, comp, comp.lru.head, comp.lru.tail, cache.root_node, ek, cache._heap)
        before = [sys.getrefcount(x) for x in watched]
        objects = len(gc.get_objects())
        for _ in range(1500):
            one_round()
        gc.collect()
        assert [sys.getrefcount(x) for x in watched] == before
        growth.append(len(gc.get_objects()) - objects)
        assert not c_insert or proxy.answers >= 6000
    assert max(growth) < 500, growth  # (one object per insert kept would be 6000)


# ---- over sglang's allocators (the upstream venv) ---------------------------------------------


def _sglang_swa(slots: int, ps: int):
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        t = load_upstream().torch
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    kv = SWAKVPool(size=slots, size_swa=slots // 2, page_size=ps, dtype=t.float16, head_num=1,
                   head_dim=1, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                   enable_kvcache_transpose=False, device="cpu")
    return SWATokenToKVPoolAllocator(slots, slots // 2, page_size=ps, dtype=t.float16,
                                     device="cpu", kvcache=kv, need_sort=False)


def _sglang_take(alloc, n: int, ps: int):
    if ps == 1:
        return alloc.alloc(n)
    from uniradix.conformance.bench import sglang_alloc
    return sglang_alloc.PagedSwaAlloc(alloc).alloc(n)


def _swa_alloc_state(a) -> list:
    out = []
    for s in (a.full_attn_allocator, a.swa_attn_allocator):
        out += [s.free_pages.tolist(), s.release_pages.tolist()]
    return out + [a.full_to_swa_index_mapping.tolist()]


@pytest.mark.upstream
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("seed", [1, 2])
def test_over_sglang_swa_allocator(ps, seed):
    """SWA over sglang's own allocator: the C path's new leaves take their SWA slots from the
    map in one pass (``swa_leaf``), its duplicates and tombstone overlaps go back through the
    queue; the allocator's free lists and map, the trees and the answers equal the twin's."""
    rng = random.Random(seed)
    allocs = [_sglang_swa(1024, ps), _sglang_swa(1024, ps)]
    caches = [fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=a, page_size=ps,
        tree_components=("full", "swa"), sliding_window_size=2 * ps)) for a in allocs]
    assert caches[0].swa.map_pool is not None
    proxies = [_Proxy(True), _Proxy(False)]
    prompts = [[rng.randrange(1, 30) for _ in range(rng.randrange(1, 4) * ps)] for _ in range(5)]
    for _ in range(150):
        toks = rng.choice(prompts) + [rng.randrange(1, 30)
                                      for _ in range(rng.randrange(0, 4) * ps)]
        pick = rng.randrange(4)
        outs = []
        for cache, alloc, proxy in zip(caches, allocs, proxies, strict=True):
            with _core_as(proxy):
                m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(toks)))
                lock = cache.inc_lock_ref(m.last_device_node)
                matched = len(m.device_indices)
                need = len(toks) - matched
                cache.evict(fast.EvictParams(
                    num_tokens=max(need - alloc.full_available_size(), 0),
                    swa_num_tokens=max(need - alloc.swa_available_size(), 0)))
                fresh = _sglang_take(alloc, need, ps) if need else torch.empty(0, dtype=torch.int64)
                if fresh is None:
                    cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
                    outs.append("aborted")
                    continue
                value = torch.cat([m.device_indices, fresh.to(torch.int64)])
                e = (0, 0, matched // ps * ps, len(toks) // 2 // ps * ps)[pick]
                res = cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=value,
                                                     prev_prefix_len=matched,
                                                     swa_evicted_seqlen=e))
                cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
                outs.append((m.device_indices.tolist(), res.prefix_len))
        assert outs[0] == outs[1]
        assert _state(caches[0]) == _state(caches[1])
        assert _swa_alloc_state(allocs[0]) == _swa_alloc_state(allocs[1])
    assert proxies[0].answers > 50


@pytest.mark.upstream
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_over_sglang_mamba_allocators(seed):
    """Mamba over sglang's ``TokenToKVPoolAllocator`` and ``MambaSlotAllocator``: the C path
    queues the duplicates and writes them into the KV allocator itself at its end (the direct
    frees); the free lists, trees, answers and counters equal the twin's, whose Python loop
    does the same through ``native_release``."""
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        load_upstream()
        from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    rng = random.Random(seed)
    sides = []
    for c_insert in (True, False):
        kv = TokenToKVPoolAllocator(96, torch.float16, "cpu", None, False)
        states = MambaSlotAllocator(12, "cpu")
        pool = types.SimpleNamespace(mamba_allocator=states, mamba_pool=None)
        cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=kv, page_size=1,
            tree_components=("full", "mamba"), validate_slots=False))
        sides.append((cache, kv, states, _Proxy(c_insert)))
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 8))] for _ in range(4)]
    for _ in range(300):
        toks = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        n = len(toks)
        outs = []
        for cache, kv, st, proxy in sides:
            with _core_as(proxy):
                if kv.available_size() < n or st.available_size() < 1:
                    cache.evict(fast.EvictParams(num_tokens=n, mamba_num=1))
                    if kv.available_size() < n or st.available_size() < 1:
                        outs.append("full")
                        continue
                value, state = kv.alloc(n), st.alloc(1)
                res = cache.insert(fast.InsertParams(
                    key=fast.RadixKey(toks), value=value, mamba_value=state.reshape(1).clone(),
                    prev_prefix_len=0))
                if res.mamba_exist:
                    st.free(state.reshape(1))
                outs.append((res.prefix_len, res.mamba_exist, value.tolist()))
        assert outs[0] == outs[1]
        (c1, kv1, st1, _), (c2, kv2, st2, _) = sides
        assert (kv1.free_pages.tolist(), st1.free_slots.tolist()) == \
            (kv2.free_pages.tolist(), st2.free_slots.tolist())
        assert _state(c1) == _state(c2)
    assert sides[0][3].answers > 100
