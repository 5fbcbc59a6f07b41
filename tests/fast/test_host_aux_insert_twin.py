"""fast/_core.c ``host_aux_insert`` (fast/host_aux.py ``insert_host_aux``: fast/hybrid.py
``_insert`` for one stock SWA or Mamba plug-in over the host tier, its checks in Python, the
rest from the root's stamp on in C) against ``_insert`` itself.

Two caches built alike and driven alike, both without the slot ledger (the fast path declines
with it on): one runs ``insert`` as it is (``_insert_fast`` is ``insert_host_aux``, its C
call counted), its twin the Python ``_insert`` (``_insert_fast`` off).  Each side draws its
node ids from a counter of its own, so ids must come out the same, in the same order.  After
every step the two must agree on the answers (or errors) and the whole state: every node's
fields with its id and records (device and host), every LRU order and host list, the leaf heap
and the host leaves' heap entry by entry, the clock and counters, the ack queue, the in-flight
backups with their locks, the allocators' free sizes and the pieces each call freed.  Recorded
conformance runs in the eight host+aux configurations and at page 16; the bench's shared-prefix
and Mooncake runs over sglang's allocators (the upstream venv) or the bench's own; the declines
(nothing changed, the Python loop answers); bad arguments (declined, then refused alike); the
settings left to Python; and no reference left behind."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import sys

import pytest

torch = pytest.importorskip("torch")

from test_host_insert_twin import Switch as InsertSwitch  # noqa: E402
from test_host_insert_twin import install_switch, record_release  # noqa: E402

from aux_twins import assert_no_leaks, tree_state  # noqa: E402  (tests/aux_twins.py)
from stories import replay_twins  # noqa: E402
from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.driver import make_config, record  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import host_aux, hybrid  # noqa: E402
from uniradix.fast import node as node_mod  # noqa: E402
from uniradix.fast.components import AuxData  # noqa: E402
from uniradix.fast.tiers import host as host_mod  # noqa: E402

pytestmark = pytest.mark.skipif(
    host_aux._core is None or not hasattr(host_aux._core, "host_aux_insert"),
    reason="the C core is not built (or UNIRADIX_PURE_PYTHON=1): no twin to compare")

CONFIGS = ["host-swa-wt-p1", "host-swa-wb-p1", "host-swa-wt-p4", "host-swa-wb-p4",
           "host-mamba-wt-p1", "host-mamba-wb-p1", "host-mamba-wt-p4", "host-mamba-wb-p4"]


class Switch(InsertSwitch):
    """host_aux's C core with ``host_aux_insert`` switched on or off (off: None, so ``_insert``
    runs), counted as tests/fast/test_host_insert_twin.py's switch counts; its ``check``
    compares this file's :func:`state`."""

    switched = "host_aux_insert"

    def state(self, cache):
        return state(cache)


@pytest.fixture
def switch(monkeypatch):
    return install_switch(monkeypatch, host_aux, Switch)


class Current:
    """The side that is running (its id counter set, its frees recorded)."""

    side = None


@pytest.fixture
def record_frees(monkeypatch):
    """hybrid's ``release`` records the pieces of the side that is running."""
    record_release(monkeypatch, lambda: Current.side)


def _no_ledger(cache) -> None:
    cache.validate_slots = False
    cache.reset()  # (the Mamba plug-in's ledger follows the setting)


def _listed(v):
    return None if v is None else v.tolist()


def state(cache) -> dict:
    """Everything an insert may write (tests/aux_twins.py ``tree_state`` and the host side),
    node ids included."""
    nodes = []
    stack = [cache.root_node]
    while stack:
        n = stack.pop()
        recs = tuple((_listed(r.host_value), r.host_lock, r.host_boundary, r.split_from,
                      r.lru_prev is None, r.lru_next is None) for r in n.aux)
        nodes.append((n.id, n.parent.id if n.parent is not None else None, tuple(n.key),
                      _listed(n.host_value), n.host_lock_ref, n.hit_count, recs))
        stack.extend(n.children.values())
    tier = cache.tier
    cc = tier.controller
    comps = cache.components
    alloc = cache.token_to_kv_pool_allocator
    mamba = getattr(cache, "mamba_allocator", None)
    return {
        "tree": tree_state(cache),
        "nodes": nodes,
        "heap_ids": [(s, n.id) for s, n in cache._heap],
        "lru_ids": [[r.node.id for r in c.lru.oldest_first()] for c in comps],
        "host_lru": [[r.node.id for r in c.host_lru] for c in comps],
        "host_heap": [(s, n.id) for s, n in tier.host_leaf_heap.entries],
        "host_leaves": sorted(n.id for n in tier.host_leaves),
        "host": (tier.host_tokens, cc.mem_pool_host.available_size(),
                 [c.host_allocator.available_size() for c in comps]),
        "acks": [(type(a).__name__, a.start_event, a.finish_event.query(), a.node_ids)
                 for a in cc.ack_write_queue],
        "ongoing": [(k, e.node.id, type(e.lock).__name__,
                     None if e.lock is None else (e.lock.anchor.id, e.lock.skip_lock_node_ids,
                                                  e.lock.swa_uuid_for_lock,
                                                  e.lock.swa_uuid_for_host_lock))
                    for k, e in tier.ongoing_write_through.items()],
        "free": (alloc.available_size(),
                 None if mamba is None else mamba.available_size()),
    }


class Side:
    """One adapter of a pair: its own id counter, the pieces its calls freed; its cache on the
    fast path (``twin``) or on ``_insert``."""

    def __init__(self, adapter_of, twin: bool, prepare=None):
        self.ids, self.freed, self.twin = itertools.count(1), [], twin
        with self.active():
            self.adapter = adapter_of()
            self.cache = self.adapter.cache
            _no_ledger(self.cache)
        assert self.cache._insert_fast is host_aux.insert_host_aux
        if not twin:
            self.cache._insert_fast = None
        apply = self.adapter.apply

        def run(step):
            with self.active():
                if prepare is not None:
                    prepare(self.cache)
                return apply(step)
        self.adapter.apply = run

    def active(self):
        side = self

        class Ctx:
            def __enter__(self):
                self.saved = node_mod._ids
                node_mod._ids, Current.side = side.ids, side

            def __exit__(self, *exc):
                node_mod._ids, Current.side = self.saved, None
        return Ctx()


def _replay(config, seed: int, n: int = 400, prepare=None, prepare_twin=None) -> list[Side]:
    """``n`` steps recorded on fast with ``config`` replayed on twin sides in lockstep, the
    whole states and the frees compared after every step (``prepare(cache)``, when given, on
    both sides before every step; ``prepare_twin`` once on the twin's).  The sides."""
    steps = record(make_adapter("fast", config), config, seed, n, check_violations=False)
    sides = [Side(lambda: make_adapter("fast", config), True, prepare),
             Side(lambda: make_adapter("fast", config), False, prepare)]
    if prepare_twin is not None:
        prepare_twin(sides[0].cache)
    ls = Lockstep([s.adapter for s in sides], ["C host_aux_insert", "Python _insert"],
                  events=False)

    def same(step):
        assert state(sides[0].cache) == state(sides[1].cache), step
        assert sides[0].freed == sides[1].freed, step

    ops = replay_twins(ls, steps, same)
    assert "insert" in ops
    assert sides[0].cache.violations() == [] and sides[1].cache.violations() == []
    return sides


# ----------------------------------------------------------------------------------------------
# Recorded conformance runs
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("run", [0, 1])
@pytest.mark.parametrize("name", CONFIGS)
def test_recorded_runs_in_lockstep(switch, record_frees, name, run):
    seed = 11 + CONFIGS.index(name) + 100 * run
    _replay(make_config(name, seed), seed, 450)
    assert switch.calls > 15 and switch.declined == 0, (switch.calls, switch.declined)


@pytest.mark.parametrize("aux", ["swa", "mamba"])
@pytest.mark.parametrize("policy", ["wt", "wb"])
def test_recorded_runs_page_16(switch, record_frees, aux, policy):
    base = make_config(f"host-{aux}-{policy}-p4", 7)
    extra = dict(sliding_window=32, swa_slots=4096) if aux == "swa" else \
        dict(mamba_slots=64, mamba_cache_chunk_size=16)
    config = dataclasses.replace(base, page_size=16, kv_slots=4096, host_slots=8192, **extra)
    _replay(config, 7)
    assert switch.calls > 20 and switch.declined == 0, (switch.calls, switch.declined)


def test_the_paths_an_insert_takes(switch, record_frees):
    """Splits, evicted nodes restored (SWA's ``recover`` too), SWA tombstones taken over
    (``overlap``), Mamba states already there (``_stamp``), write-through backups: each
    called from inside the twin on the twin's side."""
    seen = dict.fromkeys(("_split", "_unevict", "_stamp", "write_backup", "recover",
                          "overlap"), 0)
    in_twin = [False]
    real = switch.core

    class Marking:
        def __getattr__(self, name):
            return getattr(real, name)

        def host_aux_insert(self, *args):
            in_twin[0] = True
            try:
                return real.host_aux_insert(*args)
            finally:
                in_twin[0] = False
    switch.core = Marking()

    def prepare_twin(cache):
        owners = [(cache, "_split"), (cache, "_unevict"), (cache, "_stamp"),
                  (cache.tier, "write_backup")]
        if cache.swa is not None:
            owners += [(cache.swa, "recover"), (cache.swa, "overlap")]
        for owner, name in owners:
            orig = getattr(owner, name)

            def counted(*a, _orig=orig, _name=name, **kw):
                seen[_name] += in_twin[0]
                return _orig(*a, **kw)
            setattr(owner, name, counted)
    for name, seed in (("host-swa-wt-p1", 3), ("host-swa-wb-p4", 4), ("host-swa-wt-p4", 5),
                       ("host-mamba-wt-p1", 5), ("host-mamba-wb-p1", 6)):
        _replay(make_config(name, seed), seed, 600, prepare_twin=prepare_twin)
    assert min(seen.values()) > 0, seen


# ----------------------------------------------------------------------------------------------
# The bench's runs (sglang's allocators where sglang imports)
# ----------------------------------------------------------------------------------------------


def _bench_log(switch, aux: str, policy: str, page: int, twin: bool, workload: str,
               requests: int, every: int = 1) -> list:
    """One bench run of ``workload`` on fast with a host tier and ``aux``, the answer, the
    state and the pieces freed after every insert."""
    from uniradix.conformance.bench import loop as B
    from uniradix.conformance.bench.configs import BenchConfig, config_bundle
    config = BenchConfig(components=("full", aux), hicache=policy)
    try:
        bundle = config_bundle("fast", config, page, allocator="sglang")
    except B.ImplMissing:
        bundle = config_bundle("fast", config, page)
    log: list = []
    freed: list = []

    def build(pool):
        built = bundle.build(pool)
        cache = built[0]
        assert not cache.validate_slots and cache._insert_fast is host_aux.insert_host_aux
        insert = cache.insert
        release = hybrid.release

        def logged(params):
            hybrid.release = lambda alloc, pieces: (
                freed.append([p.tolist() for p in pieces]), release(alloc, pieces))[1]
            try:
                r = insert(params)
            finally:
                hybrid.release = release
            # (a digest of the state, every ``every``-th insert: the Mooncake trees are large)
            log.append(((r.prefix_len, r.total_len, r.mamba_exist), hashlib.sha1(
                repr((state(cache), freed)).encode()).hexdigest() if len(log) % every == 0
                else repr(freed)))
            freed.clear()
            return r
        cache.insert = logged
        return built
    work = B.make_workload(workload, page, requests)
    saved = node_mod._ids
    node_mod._ids, switch.on = itertools.count(1), twin
    try:
        B.run_bench(dataclasses.replace(bundle, build=build), work)
    finally:
        node_mod._ids, switch.on = saved, True
    return log


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("aux", ["swa", "mamba"])
def test_recorded_bench_runs(switch, aux, policy, page):
    _bench_twins(switch, aux, policy, page, "shared-prefix", 60)


@pytest.mark.parametrize("aux,policy,page", [("mamba", "write_back", 16),
                                             ("swa", "write_through", 16)])
def test_recorded_mooncake_runs(switch, aux, policy, page):
    _bench_twins(switch, aux, policy, page, "mooncake", 30, every=5)


def _bench_twins(switch, aux, policy, page, workload, requests, every=1):
    twin = _bench_log(switch, aux, policy, page, True, workload, requests, every)
    assert switch.taken > 20 and switch.declined == 0, (switch.taken, switch.declined)
    python = _bench_log(switch, aux, policy, page, False, workload, requests, every)
    assert len(twin) == len(python) > 20
    for i, (a, b) in enumerate(zip(twin, python, strict=True)):
        assert a == b, i


# ----------------------------------------------------------------------------------------------
# Declines, bad arguments, settings
# ----------------------------------------------------------------------------------------------


def _spoils() -> list:
    """Changes to a cache the twin declines: its heap a list subclass, its tier a HostTier
    subclass, a threshold that is not a plain int, the component's index not 0."""
    class Heap(list):
        pass

    class Tier(host_mod.HostTier):
        pass

    def spoil_heap(c):
        c._heap = c._leaf_heap.entries = Heap(c._heap)

    def spoil_tier(c):
        c.tier.__class__ = Tier

    def spoil_threshold(c):
        c.tier.write_through_threshold = 1.0

    def spoil_clock(c):
        c._clock = float(c._clock)
    return [spoil_heap, spoil_tier, spoil_threshold, spoil_clock]


@pytest.mark.parametrize("name", ["host-swa-wt-p1", "host-mamba-wt-p1"])
def test_declines_change_nothing(switch, record_frees, name):
    """Where the twin declines, it changes nothing (the state before and after the call) and
    ``_insert`` answers: the two sides stay equal.  (A threshold that is not a plain int is
    read, as ``_insert`` reads it, only by an insert that counts hits: not a chunked one.)"""
    for k, spoil in enumerate(_spoils()):
        answers = []

        def check(before, r, cache, _answers=answers):
            _answers.append(r)
            if r is None:
                assert state(cache) == before

        switch.check = check
        try:
            _replay(make_config(name, 3), 3, 150, prepare=spoil)
        finally:
            switch.check = None
        assert answers.count(None) > 5, spoil
        if k != 2:  # (all but the threshold's)
            assert all(a is None for a in answers), spoil


def _cache(name: str):
    adapter = make_adapter("fast", make_config(name, 1))
    _no_ledger(adapter.cache)
    return adapter.cache


def _insert_params(cache, toks, **kw):
    alloc = cache.token_to_kv_pool_allocator
    params = fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(len(toks)), **kw)
    if cache.mamba is not None and "mamba_value" not in kw:
        params.mamba_value = cache.mamba_allocator.alloc(1)
    return params


@pytest.mark.parametrize("name", ["host-swa-wt-p1", "host-mamba-wb-p4"])
def test_bad_arguments_declined_then_refused_alike(switch, name):
    """The C call given what the Python function never passes declines, nothing changed; bad
    insert arguments are refused by both sides with the same errors, nothing changed."""
    cache = _cache(name)
    ps = cache.page_size
    for i in range(6):
        cache.insert(_insert_params(cache, [i % 3] * ps + [7 + i] * 2 * ps))
    toks = [1] * ps + [9] * ps
    params = _insert_params(cache, toks)
    comp = cache.components[0]
    swa = comp if cache.swa is not None else None
    prepared = None if swa is not None else params.mamba_value.clone()
    units = host_aux.one_aux._key_parts(params.key)[0]
    cache._deferred = []
    plan = host_aux._core.one_plan(cache.root_node, units, None, ps, host_aux.keys.match_step)
    good = [cache, comp, swa, plan, params.value, units, None, 0, False, 0, len(toks),
            len(toks), ps, cache._deferred, prepared]
    bads = {3: [tuple(plan), [(1, 2)] + plan[1:] if plan else [(1, 2)], [[p for p in plan[0]]]
                if plan else [[1, 2]]],
            5: [units[:-1]], 7: [0.0, True], 8: [0, None], 9: [1.0], 10: [len(toks) - 1],
            12: [0], 13: [(), None], 2: [object()] if swa is None else [None, object()]}
    if swa is None:  # (a state ``mamba_state`` refuses: declined, ``_insert`` raises)
        bads[14] = [None, torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
                    [0]]
    core = switch.core
    for i, vals in bads.items():
        for v in vals:
            args = list(good)
            args[i] = v
            if i == 10:  # (n no longer the units' length)
                args[5] = units
            before = state(cache)
            assert core.host_aux_insert(*args) is None, (i, v)
            assert state(cache) == before, (i, v)
    assert core.host_aux_insert(*good) is not None  # (the same call, well made, answers)
    cache._deferred = None
    with pytest.raises(TypeError):
        core.host_aux_insert(*good[:-1])

    # bad insert arguments: the same error on both sides, nothing changed
    twin, python = _cache(name), _cache(name)
    python._insert_fast = None

    def bad_params(c):
        good_ = _insert_params(c, [5] * ps + [6] * ps)
        yield dataclasses.replace(good_, value=good_.value.to(torch.int32))
        yield dataclasses.replace(good_, value=good_.value[:-1])
        yield dataclasses.replace(good_, prev_prefix_len=-1)
        yield dataclasses.replace(good_, prev_prefix_len=1.0)
        yield dataclasses.replace(good_, chunked=1)
        yield dataclasses.replace(good_, swa_evicted_seqlen=-ps)
        yield dataclasses.replace(good_, swa_evicted_seqlen=ps + 1 if ps > 1 else 0.5)
        if c.mamba is not None:
            yield dataclasses.replace(good_, mamba_value=None)
            yield dataclasses.replace(good_, mamba_value=good_.mamba_value.to(torch.int32))
            yield dataclasses.replace(good_, swa_evicted_seqlen=ps)
        else:
            yield dataclasses.replace(good_, mamba_value=torch.zeros(1, dtype=torch.int64))
        yield dataclasses.replace(good_, value=good_.value.tolist())
    for a, b in zip(bad_params(twin), bad_params(python), strict=True):
        outs = []
        for c, p in ((twin, a), (python, b)):
            before = state(c)
            try:
                c.insert(p)
                outs.append("answered")
            except Exception as e:  # noqa: BLE001 - the two must raise alike
                outs.append((type(e), str(e)))
            assert state(c) == before
        assert outs[0] == outs[1] != "answered", outs


@pytest.mark.parametrize("name", ["host-swa-wt-p1", "host-mamba-wt-p1"])
def test_settings_left_to_python(switch, name):
    """The slot ledger, KV events, a storage tier, a disabled cache, a bigram key: the fast
    path declines before its C call (the general path answers)."""
    cache = _cache(name)
    ps = cache.page_size
    cache.insert(_insert_params(cache, [1] * 4 * ps))
    calls = switch.calls
    assert calls == 1
    for attr, val in (("validate_slots", True), ("disable", True), ("_events", object()),
                      ("storage_tier", object())):
        old = getattr(cache, attr)
        setattr(cache, attr, val)
        cache._deferred = []
        try:
            assert host_aux.insert_host_aux(cache, _insert_params(cache, [2] * ps)) is None
        finally:
            setattr(cache, attr, old)
            cache._deferred = None
    bigram = fast.RadixKey([3] * 2 * ps, None, is_bigram=True)
    cache._deferred = []
    assert host_aux.insert_host_aux(cache, dataclasses.replace(
        _insert_params(cache, [3] * 2 * ps), key=bigram)) is None
    cache._deferred = None
    assert host_aux.insert_host_aux(cache, _insert_params(cache, [2] * ps)) is None  # (no queue)
    assert switch.calls == calls


def test_subclass_hook_keeps_the_general_insert():
    """A subclass overriding a hook the twin writes out keeps ``_insert``."""
    class Own(hybrid.HybridRadixCache):
        def _touch(self, node):
            super()._touch(node)
    cache = _cache("host-mamba-wt-p1")
    cache.__class__ = Own
    cache._pick_fast_paths()
    assert cache._insert_fast is None
    cache.__class__ = hybrid.HybridRadixCache if type(cache) is Own else type(cache)


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------


def _churn(name: str):
    cache = _cache(name)
    ps = cache.page_size
    alloc = cache.token_to_kv_pool_allocator
    for i in range(40):
        toks = [i % 3, i % 5, 7, i % 4] * ps + [i] * (i % 3) * ps
        if alloc.available_size() < len(toks) + 8 * ps:
            cache.evict(fast.EvictParams(num_tokens=16 * ps, swa_num_tokens=16 * ps,
                                         mamba_num=2))
        params = _insert_params(cache, toks, prev_prefix_len=0)
        if params.value is None or (cache.mamba is not None and params.mamba_value is None):
            continue
        cache.insert(params)
        if i % 7 == 0:
            cache.check_hicache_events()
            cache.evict(fast.EvictParams(num_tokens=8 * ps))
    cache.check_hicache_events()
    cache.evict(fast.EvictParams(num_tokens=100000, swa_num_tokens=100000, mamba_num=100))
    return cache


@pytest.mark.parametrize("name", ["host-swa-wt-p1", "host-mamba-wt-p1", "host-swa-wb-p4"])
def test_no_reference_left_behind(switch, name):
    probe = _churn(name)
    # (not torch.Tensor: the process's slabs and spare buffers hold a varying number of them,
    # the Python path's runs as much as the twin's)
    classes = (node_mod.Node, AuxData, host_mod.HostTier, fast.InsertResult)

    def marks():
        return tuple(sys.getrefcount(o) for o in classes + (probe.root_node, probe.tier, probe,
                                                            probe.components[0]))

    assert_no_leaks(lambda: _churn(name), marks, runs=15)
    assert switch.taken > 100


# ----------------------------------------------------------------------------------------------
# Rare commits, driven directly
# ----------------------------------------------------------------------------------------------


def _twin_caches(name: str) -> list[Side]:
    return [Side(lambda: make_adapter("fast", make_config(name, 1)), twin)
            for twin in (True, False)]


def _both(sides: list[Side], fn) -> list:
    """``fn(cache)`` on each side (its ids, its frees recorded); the answers and the whole
    states must agree."""
    outs = []
    for side in sides:
        with side.active():
            try:
                r = fn(side.cache)
                outs.append(r if not isinstance(r, fast.InsertResult) else
                            (r.prefix_len, r.total_len, r.mamba_exist))
            except Exception as e:  # noqa: BLE001 - the two must raise alike
                outs.append(("raised", type(e), str(e)))
    assert outs[0] == outs[1]
    assert state(sides[0].cache) == state(sides[1].cache)
    assert sides[0].freed == sides[1].freed
    return outs[0]


def _ins(toks, **kw):
    def run(cache):
        return cache.insert(_insert_params(cache, toks, **kw))
    return run


def test_swa_remainder_outside_the_window(switch, record_frees):
    """An SWA insert whose remainder lies wholly outside the window (``skips_leaf``): its
    slots freed, no leaf; then one whose window starts inside the new leaf (split off)."""
    sides = _twin_caches("host-swa-wt-p1")
    _both(sides, _ins([1, 2, 3, 4]))
    taken = switch.taken
    assert _both(sides, _ins([1, 2, 3, 4, 5, 6, 7, 8], swa_evicted_seqlen=8)) == (4, 0, False)
    assert _both(sides, _ins([1, 2, 3, 4, 9, 9, 9, 9, 9, 9], swa_evicted_seqlen=6))[0] == 4
    assert switch.taken == taken + 2 and sides[0].freed
    assert sides[0].cache.violations() == []


def test_mamba_state_back_on_a_node_with_a_host_copy(switch, record_frees):
    """A Mamba state set on a node whose state is on the host only (evicted from the device
    after its backup): the record leaves the host list."""
    sides = _twin_caches("host-mamba-wt-p1")
    _both(sides, _ins([1, 2, 3, 4]))
    _both(sides, _ins([1, 2, 3, 4, 5, 6]))
    _both(sides, lambda c: c.writing_check(True))  # (the backups' acks: their locks go)
    _both(sides, lambda c: c.evict(fast.EvictParams(mamba_num=1)).mamba_num_evicted)
    for side in sides:
        rec = side.cache.find_node(fast.RadixKey([1, 2, 3, 4])).aux[0]
        assert rec.value is None and rec.host_value is not None
        assert rec in side.cache.mamba.host_lru
    taken = switch.taken
    assert _both(sides, _ins([1, 2, 3, 4])) == (4, 4, False)
    assert switch.taken == taken + 1
    for side in sides:
        rec = side.cache.find_node(fast.RadixKey([1, 2, 3, 4])).aux[0]
        assert rec.value is not None and rec not in side.cache.mamba.host_lru
    assert _both(sides, _ins([1, 2, 3, 4])) == (4, 4, True)  # (a state there: mamba_exist)
    assert sides[0].cache.violations() == []


def test_the_tree_keeps_its_own_state(switch):
    """The twin's Mamba state is the tree's own copy (``mamba_state``'s), not the caller's
    tensor: a later write to the caller's changes nothing in the tree."""
    cache = _cache("host-mamba-wb-p1")
    params = _insert_params(cache, [4, 5, 6, 7])
    given = int(params.mamba_value[0])
    cache.insert(params)
    assert switch.taken == 1
    rec = cache.find_node(fast.RadixKey([4, 5, 6, 7])).aux[0]
    assert rec.value is not params.mamba_value
    params.mamba_value[0] = given + 1
    assert rec.value.tolist() == [given]
