"""fast/_core.c ``host_aux_evict`` (fast/hybrid.py ``_evict_units(want, wants)`` for one stock
SWA or Mamba plug-in over the host tier: the heap loop with ``HostTier.evict_leaf`` and the
component's part of ``_drop_device``, the component's ``drive``, the passed-over leaves, the
write-back check, the batch's release, the heap's compaction) against the Python path it
stands for.

Two caches built alike and driven alike, one with the twin and one with it switched off (only
``host_aux_evict``: every other twin runs on both sides), compared after every step: every
node's fields and its component record (nodes named by their paths), the component's LRU list
and host list in order, the leaf heap and the host leaf heap entry by entry, the host leaves,
the counters (the cache's, the component's, the host pools'), the in-flight maps and ack
queues, every piece freed (in order, with its allocator method) and the allocators' free
lists, and the tier's and the component's calls (``_take_host``, ``write_backup``,
``writing_check``, ``backup``).  Recorded conformance runs (the project's allocators), the
bench's shared-prefix and Mooncake workloads (sglang's allocators and host pools where sglang
imports, the bench's own otherwise) at pages 1 and 16, random steps; the declines, a failed
write-back backup, an error half way, the references a call leaves behind."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import random
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from test_host_evict_twin import evict_failing_third_backup  # noqa: E402  (tests/fast's own)
from test_host_insert_twin import Switch, install_switch  # noqa: E402
from test_host_lock_twins import state as path_state  # noqa: E402

from aux_twins import assert_no_leaks, listed, path_of, recorded_run  # noqa: E402
from stories import replay_twins  # noqa: E402
from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import frees, host_full, hybrid  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.components.mamba import MambaComponent  # noqa: E402
from uniradix.fast.components.swa import SwaComponent  # noqa: E402
from uniradix.fast.frees import FreeBatch  # noqa: E402
from uniradix.fast.structures import LazyHeap  # noqa: E402
from uniradix.fast.tiers import host as host_mod  # noqa: E402

pytestmark = pytest.mark.skipif(_core is None, reason="the C core is not built (or "
                                "UNIRADIX_PURE_PYTHON=1): no twin to compare")


class AuxEvictSwitch(Switch):
    """host_full's C core with ``host_aux_evict`` switched on or off, counted as
    :class:`Switch` counts."""

    switched = "host_aux_evict"


@pytest.fixture
def switch(monkeypatch):
    return install_switch(monkeypatch, host_full, AuxEvictSwitch)


class Recorder:
    """What the side that runs now frees (fast/frees.py ``release``, as ``FreeBatch.release``
    calls it, and fast/hybrid.py's) and which tier and component calls it makes."""

    current: list | None = None


@pytest.fixture(autouse=True)
def record_frees(monkeypatch):
    for mod in (frees, hybrid):
        orig = mod.release

        def release(alloc, pieces, *rest, _orig=orig):
            if Recorder.current is not None:
                Recorder.current.append(("free", rest, [p.tolist() for p in pieces]))
            return _orig(alloc, pieces, *rest)
        monkeypatch.setattr(mod, "release", release)
    for cls, names in ((host_mod.HostTier, ("_take_host", "write_backup", "writing_check")),
                       (SwaComponent, ("backup",)), (MambaComponent, ("backup",))):
        for name in names:
            orig = getattr(cls, name)

            def call(self, *args, _orig=orig, _name=name, **kw):
                r = _orig(self, *args, **kw)
                if Recorder.current is not None:
                    Recorder.current.append((_name, r is None or r is False or (type(r) is int and r == 0)))
                return r
            monkeypatch.setattr(cls, name, call)


def alloc_state(cache) -> tuple:
    """The allocators' free lists: KV (with its full and SWA sides), Mamba's, the host pools."""
    out = []
    kv = cache.token_to_kv_pool_allocator
    allocs = [kv, getattr(kv, "full_attn_allocator", None), getattr(kv, "swa_attn_allocator", None),
              getattr(kv, "swa", None), getattr(cache.mamba, "allocator", None)]
    for a in allocs:
        if a is None:
            continue
        pool = getattr(a, "pool", None)
        if pool is not None and hasattr(pool, "_free_pages"):
            out.append((list(pool._free_pages), sorted(pool._allocated)))
        for name in ("free_pages", "release_pages", "free_slots", "free_list", "_free"):
            v = getattr(a, name, None)
            if isinstance(v, torch.Tensor):
                out.append(v.tolist())
            elif isinstance(v, list):
                out.append(list(v))
    comp = cache.components[0]
    out.append((cache.tier.controller.mem_pool_host.available_size(),
                comp.host_allocator.available_size()))
    return tuple(out)


def state(cache) -> dict:
    """path_state (tests/fast/test_host_lock_twins.py: nodes, heaps, host leaves, counters,
    in-flight maps, acks) with the component: each node's record, its LRU list and host list
    in order, its counters."""
    s = path_state(cache)
    comp = cache.components[0]
    recs = {}
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        recs[path_of(node)] = tuple(
            (listed(r.value), listed(r.host_value), r.lock, r.host_lock, r.boundary,
             r.host_boundary) for r in node.aux)
        stack.extend(node.children.values())
    s["recs"] = recs
    s["lru"] = [path_of(r.node) for r in comp.lru.oldest_first()]
    s["host lru"] = [(path_of(r.node), r.node.parent is not None, listed(r.host_value))
                     for r in comp.host_lru]
    s["comp"] = (comp.evictable, comp.protected)
    return s


class TwinSide:
    """A conformance adapter whose every call runs with the twin on or off, its frees and
    calls recorded."""

    def __init__(self, adapter, switch, on: bool) -> None:
        self.adapter, self.switch, self.on, self.log = adapter, switch, on, []

    @property
    def cache(self):
        return self.adapter.cache

    @contextlib.contextmanager
    def active(self):
        self.switch.on, Recorder.current = self.on, self.log
        try:
            yield
        finally:
            self.switch.on, Recorder.current = True, None

    def apply(self, step):
        with self.active():
            return self.adapter.apply(step)

    def snapshot(self):
        with self.active():
            return self.adapter.snapshot()

    def violations(self):
        return self.adapter.violations()

    def __getattr__(self, name):
        return getattr(self.adapter, name)


# ----------------------------------------------------------------------------------------------
# recorded conformance runs (the project's allocators)
# ----------------------------------------------------------------------------------------------


NAMES = [f"host-{aux}-{p}-p{page}" for aux in ("swa", "mamba") for p in ("wt", "wb")
         for page in (1, 4)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [1, 3])
def test_recorded_conformance_runs(switch, name, seed):
    """A recorded workload (inserts, matches, locks, evictions of every kind, load backs,
    acks, resets) on both caches in lockstep, the whole state after every step."""
    aux = name.split("-")[1]
    config, steps = recorded_run(name, seed, ("full", aux))
    c = TwinSide(make_adapter("fast", config), switch, True)
    py = TwinSide(make_adapter("fast", config), switch, False)
    assert c.cache._host_aux_evict
    ls = Lockstep([c, py], ["C twin", "Python path"], events=False)

    def same(step):
        assert state(c.cache) == state(py.cache), step
        assert alloc_state(c.cache) == alloc_state(py.cache), step
        assert c.log == py.log, step

    replay_twins(ls, steps, same)
    assert switch.taken > 5 and switch.declined == 0, (switch.taken, switch.declined)


# ----------------------------------------------------------------------------------------------
# the bench's workloads (sglang's allocators where sglang imports), pages 1 and 16
# ----------------------------------------------------------------------------------------------


def _bench_log(switch, aux: str, policy: str, page: int, workload: str, twin: bool,
               requests: int) -> tuple[list, str]:
    """One bench run on fast with a host tier and ``aux``, in a third of its KV pool (it
    evicts from its first requests on): the state after every evict, every answer, the frees
    and calls made; and the allocator the run had."""
    from uniradix.conformance.bench import loop as B
    from uniradix.conformance.bench.configs import BenchConfig, config_bundle
    config = BenchConfig(components=("full", aux), hicache=policy)
    try:
        bundle, kind = config_bundle("fast", config, page, allocator="sglang"), "sglang"
    except B.ImplMissing:
        bundle, kind = config_bundle("fast", config, page), "own"
    log: list = []
    calls: list = []

    def build(pool):
        built = bundle.build(pool)
        cache = built[0]
        for name in ("insert", "evict"):
            orig = getattr(cache, name)

            def logged(params, _orig=orig, _name=name):
                Recorder.current = calls
                try:
                    r = _orig(params)
                finally:
                    Recorder.current = None
                if _name == "evict":  # (what the twin writes, as a digest: Mooncake's trees
                    # are big; an insert's answer alone)
                    log.append((_name, repr(r), hashlib.sha1(repr(
                        (state(cache), alloc_state(cache), calls)).encode()).hexdigest()))
                else:
                    log.append((_name, repr(r), repr(calls)))
                calls.clear()
                return r
            setattr(cache, name, logged)
        return built
    w = (B.shared_prefix_workload(page, requests) if workload == "shared-prefix"
         else B.mooncake_workload(page, requests))
    # (SWA: a smaller pool leaves no room for its window pool and the requests abort)
    cut = (3 if aux == "mamba" else 1.2) if workload == "shared-prefix" else 12
    w = dataclasses.replace(w, kv_slots=max(int(w.kv_slots / cut) // page * page, 64 * page))
    switch.on = twin
    try:
        B.run_bench(dataclasses.replace(bundle, build=build), w)
    finally:
        switch.on = True
    return log, kind


@pytest.mark.parametrize("aux", ["swa", "mamba"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("workload", ["shared-prefix", "mooncake"])
def test_recorded_bench_runs(switch, aux, policy, page, workload):
    # (Mooncake's prompts are long; SWA's shared-prefix run evicts now and then)
    n = 50 if workload == "mooncake" else 120 if aux == "mamba" else 200
    try:
        twin, kind = _bench_log(switch, aux, policy, page, workload, True, n)
    except Exception as e:  # noqa: BLE001 - a configuration the bench refuses here
        from uniradix.conformance.bench.loop import ImplMissing
        if isinstance(e, ImplMissing):
            pytest.skip(str(e))
        raise
    assert switch.taken > 3 and switch.declined == 0, (switch.taken, switch.declined)
    python, _ = _bench_log(switch, aux, policy, page, workload, False, n)
    assert len(twin) == len(python) >= n
    assert sum(e[0] == "evict" and e[1] != repr(fast.EvictResult()) for e in twin) > 3
    for i, (a, b) in enumerate(zip(twin, python, strict=True)):
        assert a == b, (kind, i)


# ----------------------------------------------------------------------------------------------
# random steps
# ----------------------------------------------------------------------------------------------


def _cache(aux: str, policy: str, page: int, allocator: str, seed: int):
    """A host-tier cache with ``aux``: conformance's (the project's allocators, a small host
    pool) or the bench's over sglang's allocators."""
    if allocator == "sglang":
        from test_host_lock_twins import _sglang_importable
        if not _sglang_importable():
            pytest.skip("sglang's allocators do not import here")
        from uniradix.conformance.bench.configs import BenchConfig
        from uniradix.conformance.bench.sglang_alloc import fast_build
        cache, _, _ = fast_build(BenchConfig(components=("full", aux), hicache=policy),
                                 48 * page, page)
        return cache
    name = f"host-{aux}-{'wt' if policy == 'write_through' else 'wb'}-p{min(page, 4)}"
    from uniradix.conformance.explore.driver import make_config
    config = dataclasses.replace(  # (pools sized for the steps below: short now and then)
        make_config(name, seed), page_size=page, kv_slots=64 * page, host_slots=96 * page)
    if aux == "swa":
        config = dataclasses.replace(config, swa_slots=48 * page, host_swa_slots=64 * page)
    else:
        config = dataclasses.replace(config, mamba_slots=16, host_mamba_slots=24)
    cache = make_adapter("fast", config).cache
    cc = cache.tier.controller  # (acks done at once: the recorded runs hold them pending)
    cc.io, cc.sync = "sync", True
    return cache


def _random_step(cache, rng: random.Random, page: int, held: list) -> object:
    """One random step: an insert of a random key (fresh slots, a fresh Mamba state), a match,
    a lock kept, an unlock, an evict of random amounts, the acks processed."""
    r = rng.random()
    if r < 0.45:
        n = rng.randrange(1, 7) * page
        if _insert(cache, [rng.randrange(4) for _ in range(n)]):
            return "insert"
        res = cache.evict(fast.EvictParams(num_tokens=n, swa_num_tokens=n, mamba_num=1))
        return ("short", res.num_tokens_evicted, res.swa_num_tokens_evicted,
                res.mamba_num_evicted)
    if r < 0.6:
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 7) * page)]
        m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(toks)))
        if rng.random() < 0.4 and m.last_device_node is not cache.root_node:
            lock = cache.inc_lock_ref(m.last_device_node)
            held.append((m.last_device_node, lock))
        return ("match", len(m.device_indices))
    if r < 0.7 and held:
        node, lock = held.pop(rng.randrange(len(held)))
        return ("unlock", cache.dec_lock_ref(node, lock.to_dec_params()).delta)
    if r < 0.85:
        res = cache.evict(fast.EvictParams(num_tokens=rng.choice((0, page, 3 * page, 40 * page)),
                                           swa_num_tokens=rng.randrange(0, 12 * page),
                                           mamba_num=rng.randrange(0, 4)))
        return ("evict", res.num_tokens_evicted, res.swa_num_tokens_evicted,
                res.mamba_num_evicted)
    cache.check_hicache_events()
    return "acks"


@pytest.mark.parametrize("aux", ["swa", "mamba"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("allocator", ["own", "sglang"])
def test_random_steps(switch, aux, policy, page, allocator):
    if allocator == "sglang" and aux == "swa" and page > 1:
        pytest.skip("sglang's SWA allocator's alloc() is for page 1 only (the bench's runs "
                    "over it cover page 16)")
    caches = [_cache(aux, policy, page, allocator, 3), _cache(aux, policy, page, allocator, 3)]
    assert caches[0]._host_aux_evict
    rngs, helds, logs = [random.Random(7), random.Random(7)], [[], []], [[], []]
    kinds: collections.Counter = collections.Counter()
    for i in range(600):
        outs = []
        for k, cache in enumerate(caches):
            switch.on, Recorder.current = k == 0, logs[k]
            try:
                outs.append(_random_step(cache, rngs[k], page, helds[k]))
            except Exception as e:  # noqa: BLE001 - the two must raise alike
                outs.append(("raised", type(e), str(e)))
            finally:
                switch.on, Recorder.current = True, None
        assert outs[0] == outs[1], i
        assert state(caches[0]) == state(caches[1]), i
        assert alloc_state(caches[0]) == alloc_state(caches[1]), i
        assert logs[0] == logs[1], i
        kinds[outs[0][0] if isinstance(outs[0], tuple) else outs[0]] += 1
    assert switch.taken > 20 and switch.declined == 0, (switch.taken, switch.declined)
    assert kinds["insert"] > 100 and kinds["evict"] > 50 and not kinds["raised"], kinds


# ----------------------------------------------------------------------------------------------
# scenarios: a failed backup, compaction, an error half way
# ----------------------------------------------------------------------------------------------


def _pair(aux: str, policy: str, page: int = 1, seed: int = 3):
    return _cache(aux, policy, page, "own", seed), _cache(aux, policy, page, "own", seed)


def _insert(cache, toks: list) -> bool:
    """An insert of ``toks`` with fresh slots (and a fresh state); False, nothing done, where
    a pool is short."""
    kv = cache.token_to_kv_pool_allocator
    slots = kv.alloc(len(toks))
    if slots is None:
        return False
    params = fast.InsertParams(key=fast.RadixKey(toks), value=slots)
    if cache.mamba is not None:
        params.mamba_value = cache.mamba.allocator.alloc(1)
        if params.mamba_value is None:
            kv.free(slots)
            return False
    if cache.insert(params).mamba_exist:  # (the state is the caller's again)
        cache.mamba.allocator.free(params.mamba_value)
    return True


def _insert_or_evict(cache, toks: list) -> bool:
    """``_insert``, or where a pool is short an evict of some of every kind (False)."""
    if _insert(cache, toks):
        return True
    cache.evict(fast.EvictParams(num_tokens=64, swa_num_tokens=8, mamba_num=2))
    return False


@pytest.mark.parametrize("aux", ["swa", "mamba"])
@pytest.mark.parametrize("short", ["kv", "aux"])
def test_a_failed_backup_passes_the_leaf_over(switch, aux, short):
    """Write-back with a host pool (the KV one, or the component's) full of slots no host copy
    holds: each leaf's backup fails (the component's ``backup`` failing undoes the KV one) and
    it is passed over, a second heap entry of it in the same call is not tried again, it is
    pushed back once at the end; the component's drive meets the same leaves and leaves them."""
    caches = _pair(aux, "write_back")
    logs = [[], []]
    for k, cache in enumerate(caches):
        switch.on, Recorder.current = k == 0, logs[k]
        try:
            for toks in ([1, 2, 3], [1, 2, 4], [5, 6]):
                assert _insert(cache, toks)
            for _stamp, node in list(cache._heap):  # (a second entry of each leaf)
                cache._push_if_leaf(node)
            pool = (cache.tier.controller.mem_pool_host if short == "kv"
                    else cache.components[0].host_allocator)
            while pool.alloc(1) is not None:  # (the pool full)
                pass
            r = cache.evict(fast.EvictParams(num_tokens=100, swa_num_tokens=100, mamba_num=5))
            assert r.num_tokens_evicted == 0, r
        finally:
            switch.on, Recorder.current = True, None
    assert logs[0] == logs[1]
    assert sum(1 for e in logs[0] if e[0] == "_take_host" and e[1]) >= 3, logs[0]
    assert state(caches[0]) == state(caches[1])
    assert switch.taken == 1


@pytest.mark.parametrize("aux", ["swa", "mamba"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_locked_copies_stay_off_the_host_list(switch, aux, policy):
    """Nodes whose host copies are host-locked (``inc_host_lock_ref``) lose their device data
    (leaves to the host, an inner node's component data through the drive): a record whose
    host copy is host-locked does not join the component's host list, the others do, in the
    Python path's order."""
    caches = _pair(aux, policy)
    logs = [[], []]
    for k, cache in enumerate(caches):
        switch.on, Recorder.current = k == 0, logs[k]
        try:
            for toks in ([1, 2, 3], [1, 2, 4], [1, 5], [6, 7], [6, 8, 9]):
                assert _insert(cache, toks)
            cache.check_hicache_events()
            if policy == "write_back":  # (the copies made first: an evict backs up)
                for toks in ([1, 2, 3], [1, 2, 4], [1, 5], [6, 7], [6, 8, 9]):
                    node = cache.find_node(fast.RadixKey(toks))
                    cache.write_backup(node, write_back=True)
                cache.writing_check(write_back=True)
            for toks in ([1, 2, 3], [6, 7], [1, 5]):
                node = cache.find_node(fast.RadixKey(toks))
                assert node.host_value is not None, toks
                cache.inc_host_lock_ref(node)
            r = cache.evict(fast.EvictParams(num_tokens=4, swa_num_tokens=100, mamba_num=100))
            assert r.num_tokens_evicted > 0, r
            r = cache.evict(fast.EvictParams(num_tokens=100, swa_num_tokens=100, mamba_num=100))
        finally:
            switch.on, Recorder.current = True, None
    assert logs[0] == logs[1]
    assert state(caches[0]) == state(caches[1])
    recs = _records(caches[0])  # (both kinds met: host-locked copies off, others on)
    assert any(r.host_lock and r.value is None and r.host_value is not None for r in recs)
    assert caches[0].components[0].host_lru
    assert switch.taken == 2


def _records(cache) -> list:
    out, stack = [], [cache.root_node]
    while stack:
        node = stack.pop()
        out.extend(node.aux)
        stack.extend(node.children.values())
    return out


@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_many_leaves_each_call_and_compaction(switch, aux, monkeypatch):
    """Big evictions (leaves deleted with their tombstone chains, leaves to the host, parents
    becoming leaves in the same call, the component's drive over tombstones) and the heap's
    compaction after a mostly stale heap."""
    caches = _pair(aux, "write_through")
    compacted = [0, 0]
    orig = LazyHeap.compact
    side = [0]

    def compact(self, is_member):
        compacted[side[0]] += 1
        return orig(self, is_member)
    monkeypatch.setattr(LazyHeap, "compact", compact)
    logs = [[], []]
    for i in range(400):
        for k, cache in enumerate(caches):
            switch.on, Recorder.current, side[0] = k == 0, logs[k], k
            try:
                r = random.Random(i)
                toks = [r.randrange(5) for _ in range(r.randrange(1, 9))]
                if not _insert_or_evict(cache, toks):
                    continue
                for _ in range(r.randrange(3)):  # (restamps: stale heap entries)
                    cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(toks)))
                if i % 5 == 0:
                    cache.check_hicache_events()
                if i % 11 == 0:
                    cache.evict(fast.EvictParams(num_tokens=r.randrange(1, 40),
                                                 swa_num_tokens=r.randrange(20),
                                                 mamba_num=r.randrange(3)))
                if i % 50 == 0:  # (a heap of mostly stale entries: compacted after the evict)
                    cache.check_hicache_events()
                    leaves = [n for _s, n in cache._heap if cache._is_leaf(n)]
                    for _ in range(40):
                        for node in leaves:
                            cache._push_if_leaf(node)
                    cache.evict(fast.EvictParams(num_tokens=1))
            finally:
                switch.on, Recorder.current = True, None
        assert state(caches[0]) == state(caches[1]), i
        assert logs[0] == logs[1], i
    assert switch.taken > 50 and switch.declined == 0
    assert compacted[0] == compacted[1] > 0, compacted


@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_an_error_half_way_still_releases(switch, aux):
    """A backup that raises half way through an eviction (the tier's ``_take_host``, a Python
    call the loop makes): the same error on both sides, the frees taken in before it released
    (the Python path's ``finally``), the same state after."""
    caches = _pair(aux, "write_back")
    outs, logs = [], [[], []]
    for k, cache in enumerate(caches):
        switch.on, Recorder.current = k == 0, logs[k]
        try:
            for toks in ([1, 2, 3], [1, 2, 4], [5, 6], [7], [8, 9]):
                assert _insert(cache, toks)
            outs.append(evict_failing_third_backup(cache))
        finally:
            switch.on, Recorder.current = True, None
    assert outs == ["host pool gone"] * 2
    assert switch.calls == 1 and switch.taken == 0  # (the twin's call raised)
    assert logs[0] == logs[1] and any(e[0] == "free" for e in logs[0]), logs[0]
    assert state(caches[0]) == state(caches[1])
    assert alloc_state(caches[0]) == alloc_state(caches[1])


# ----------------------------------------------------------------------------------------------
# declines, references
# ----------------------------------------------------------------------------------------------


def _filled(aux: str, policy: str = "write_through"):
    cache = _cache(aux, policy, 1, "own", 3)
    rng = random.Random(5)
    for _ in range(40):
        if not _insert(cache, [rng.randrange(4) for _ in range(rng.randrange(1, 6))]):
            break
    return cache


@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_declines_change_nothing(aux):
    """Where the twin declines it changes nothing (and the Python path answers): what
    host_evict's prepare checks (the heap a list subclass, a tier of another class, an
    ``_evict_leaf`` that is not the tier's, a counter that is not a plain int, a storage tier,
    an eviction policy key, KV events, a disabled cache, a tp group, write_back not a bool),
    and its own: a component of another class or at another index, its counter or host list
    of another type, ``_pair`` set, an amount that is not a non-negative int."""
    class Heap(list):
        pass

    class Tier(host_mod.HostTier):
        pass

    class Comp(SwaComponent if aux == "swa" else MambaComponent):
        pass

    def on_cache(attr, value):
        return lambda c: setattr(c, attr, value)

    def on_tier(attr, value):
        return lambda c: setattr(c.tier, attr, value)

    def on_comp(attr, value):
        return lambda c: setattr(c.components[0], attr, value)

    spoils = {
        "heap": lambda c: setattr(c, "_heap", Heap(c._heap)),
        "tier class": lambda c: setattr(c.tier, "__class__", Tier),
        "evict_leaf": lambda c: setattr(c, "_evict_leaf", types.MethodType(
            lambda self, *a: host_mod.HostTier.evict_leaf(self, *a), c.tier)),
        "counter": lambda c: setattr(c, "_evictable", float(c._evictable)),
        "storage": on_cache("storage_tier", object()),
        "policy": on_cache("_policy_key", len),
        "events": on_cache("_events", []),
        "disable": on_cache("disable", True),
        "pair": on_cache("_pair", (0, 1, 2)),
        "tp": on_tier("tp_group", object()),
        "write_back": on_tier("write_back", 1),
        "comp class": lambda c: setattr(c.components[0], "__class__", Comp),
        "comp index": on_comp("i", 1),
        "comp counter": lambda c: setattr(c.components[0], "evictable",
                                          float(c.components[0].evictable)),
        "host list": lambda c: setattr(c.components[0], "host_lru",
                                       types.MappingProxyType(c.components[0].host_lru)),
    }
    for what, spoil in spoils.items():
        cache = _filled(aux)
        spoil(cache)
        before = state(cache)
        assert _core.host_aux_evict(cache, 10, 3) is None, what
        assert state(cache) == before, what
    cache = _filled(aux)
    before = state(cache)
    for want, aux_want in ((10.0, 1), (10, -1), (-1, 0), (True, 0), (10, None)):
        assert _core.host_aux_evict(cache, want, aux_want) is None, (want, aux_want)
    assert state(cache) == before
    assert _core.host_aux_evict(cache, 10, 3) is not None  # (and as it is, it takes the call)


def test_a_subclass_hook_runs_the_python_path():
    """A cache class that overrides one of the hooks the twin stands for does not use it."""
    class Cache(fast.HiCacheRadixCache):
        def _cascade(self, *a):
            return super()._cascade(*a)
    cache = _filled("mamba")
    assert cache._host_aux_evict
    cache.__class__ = Cache
    cache._pick_fast_paths()
    assert not cache._host_aux_evict


@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_no_reference_left_behind(switch, aux):
    """The same inserts and evictions over and over, each round on a fresh cache (leaves to
    the host and deleted, tombstones dropped, write-back backups, short pools): the reference
    counts of what the twin touches or makes (the classes: their instances), and the number
    of live objects, do not grow."""

    def round_trip(policy):
        cache = _cache(aux, policy, 1, "own", 4)
        rng = random.Random(1)
        for _ in range(30):
            if not _insert_or_evict(cache, [rng.randrange(4) for _ in range(rng.randrange(1, 6))]):
                continue
            if rng.random() < 0.3:
                cache.evict(fast.EvictParams(num_tokens=rng.randrange(8),
                                             swa_num_tokens=rng.randrange(8),
                                             mamba_num=rng.randrange(3)))
            cache.check_hicache_events()
        cache.evict(fast.EvictParams(num_tokens=10 ** 6, swa_num_tokens=10 ** 6,
                                     mamba_num=10 ** 6))
        return cache

    for policy in ("write_through", "write_back"):
        probe = round_trip(policy)
        comp = probe.components[0]
        classes = (hybrid.Node, FreeBatch, host_mod.HostTier, type(comp), hybrid.AuxData)

        def marks(probe=probe, comp=comp, classes=classes):
            return tuple(sys.getrefcount(o) for o in classes + (
                probe.root_node, probe.tier, probe, probe._heap, probe.tier.host_leaves,
                comp, comp.host_lru, comp.lru, comp.lru.head, comp.lru.tail))

        before = switch.taken
        assert_no_leaks(lambda policy=policy: round_trip(policy), marks, runs=20)
        assert switch.taken - before > 100
