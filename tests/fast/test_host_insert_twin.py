"""fast/_core.c ``host_insert`` (fast/host_full.py ``insert_host`` from the root's stamp on, with
the write-through backup ``HostTier._write_backup_full`` written out) against the Python loop it
stands for: two caches built alike and driven alike, one with the C twin and one with the twin
switched off (``insert_host``'s own loop runs), each step's answer and the whole state compared
after every step -- every node's fields with its id (each side draws its ids from a counter of
its own, so ids must come out the same, in the same order), the leaf heap list entry by entry,
the host leaves and their heap, the counters, the ack queue's node ids, the in-flight backups
with their lock anchors, the slot ledger and the pieces each call freed."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import random
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from aux_twins import assert_no_leaks  # noqa: E402  (tests/aux_twins.py)
from uniradix import fast  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast import host_full, hybrid  # noqa: E402
from uniradix.fast import node as node_mod  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig  # noqa: E402
from uniradix.fast.tiers import host as host_mod  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

pytestmark = pytest.mark.skipif(host_full._core is None, reason="the C core is not built "
                                "(or UNIRADIX_PURE_PYTHON=1): no twin to compare")


class Switch:
    """host_full's C core with one twin (``switched``: ``host_insert`` here) switched on or
    off (off: None, so the Python loop runs), counting the calls made to it (answered or
    raised), answered and declined; the core's other functions as they are.  ``check``, when
    set, is called with the cache's ``state`` before and the answer after each call."""

    switched = "host_insert"
    check = None

    def __init__(self, core):
        self.core, self.on, self.taken, self.declined, self.calls = core, True, 0, 0, 0

    def __getattr__(self, name):
        fn = getattr(self.core, name)
        return functools.partial(self._counted, fn) if name == self.switched else fn

    def state(self, cache):
        """What ``check`` compares (the subclass that sets one says)."""
        raise NotImplementedError

    def _counted(self, fn, *args):
        if not self.on:
            return None
        self.calls += 1
        before = self.state(args[0]) if self.check is not None else None
        r = fn(*args)
        self.taken += r is not None
        self.declined += r is None
        if self.check is not None:
            self.check(before, r, args[0])
        return r


def install_switch(monkeypatch, module, cls=Switch):
    """``module``'s ``_core`` replaced by a ``cls`` over it for the test (the host twins'
    test files' ``switch`` fixtures)."""
    s = cls(module._core)
    monkeypatch.setattr(module, "_core", s)
    return s


def record_release(monkeypatch, current) -> None:
    """fast/hybrid.py's ``release`` records, on ``current()`` (the side that runs now, or
    None), the pieces each call frees (the host twins' ``record_frees`` fixtures)."""
    orig = hybrid.release

    def release(alloc, pieces):
        side = current()
        if side is not None:
            side.freed.append([p.tolist() for p in pieces])
        return orig(alloc, pieces)
    monkeypatch.setattr(hybrid, "release", release)


@pytest.fixture
def switch(monkeypatch):
    return install_switch(monkeypatch, host_full)


class Side:
    """One cache of a pair: its own id counter, twin on or off, the pieces its calls freed."""

    current: Side | None = None

    def __init__(self, switch: Switch, twin: bool, build):
        self.switch, self.twin, self.ids, self.freed = switch, twin, itertools.count(1), []
        with self.active():
            self.cache, self.alloc = build()

    @contextlib.contextmanager
    def active(self):
        saved = node_mod._ids
        node_mod._ids, self.switch.on, Side.current = self.ids, self.twin, self
        try:
            yield
        finally:
            node_mod._ids, self.switch.on, Side.current = saved, True, None


@pytest.fixture
def record_frees(monkeypatch):
    """hybrid's ``release`` records the pieces of the side that is running."""
    record_release(monkeypatch, lambda: Side.current)


def _listed(v):
    return None if v is None else v.tolist()


def state(cache) -> dict:
    """Everything an insert may write, node ids included."""
    nodes = []
    stack = [cache.root_node]
    while stack:
        n = stack.pop()
        nodes.append((n.id, n.parent.id if n.parent is not None else None, tuple(n.key), n.ck,
                      n.extra_key, _listed(n.value), n.lock_ref, n.last_access_time,
                      n.hit_count, n.dev_children, _listed(n.host_value),
                      n.host_value is not None and n.host_value._base is None, n.host_lock_ref,
                      n.created, n.priority, n.aux, n.aux_lock, list(n.children)))
        stack.extend(n.children.values())
    tier = cache.tier
    cc = tier.controller
    return {
        "nodes": nodes,
        "heap": [(s, n.id) for s, n in cache._heap],
        "host_heap": [(s, n.id) for s, n in tier.host_leaf_heap.entries],
        "host_leaves": sorted(n.id for n in tier.host_leaves),
        "counts": (cache._clock, cache._evictable, cache._protected, tier.host_tokens),
        "acks": [(type(a).__name__, a.start_event, type(a.finish_event).__name__,
                  a.finish_event.query(), a.node_ids) for a in cc.ack_write_queue],
        "ongoing": [(k, type(e).__name__, e.node.id, type(e.lock).__name__,
                     None if e.lock is None else e.lock.anchor.id,
                     None if e.lock is None else (e.lock.skip_lock_node_ids,
                                                 e.lock.swa_uuid_for_lock,
                                                 e.lock.swa_uuid_for_host_lock))
                    for k, e in tier.ongoing_write_through.items()],
        "owned": sorted(cache._owned),
        "host_free": cc.mem_pool_host.available_size(),
    }


class ViewHost(host_mod.HostSlotAllocator):
    """A host pool handing out views of a tensor of its own (as sglang's host pools hand out
    views of their free list): the backup keeps a copy."""

    def alloc(self, n):
        t = super().alloc(n)
        return None if t is None else torch.cat([t, t])[:len(t)]


def _build(policy: str, io: str, page: int, threshold: int, host_slots: int,
           views: bool = False):
    def build():
        alloc = PoolAllocator(PagedPool(64, page, "kv"), torch)
        cfg = HiCacheConfig(host_slots=host_slots, write_policy=policy, io=io,
                            load_back_threshold=0, write_through_threshold=threshold,
                            host_allocator=ViewHost(host_slots, page) if views else None)
        cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=page, hicache=cfg))
        return cache, alloc
    return build


def _step(side: Side, rng: random.Random, page: int) -> object:
    """One random step: mostly inserts (the caller's own prefix as prev_prefix_len, chunked,
    extra keys, a tail shorter than a page), device and host evictions, acks processed."""
    cache, alloc = side.cache, side.alloc
    op = rng.random()
    tokens = [rng.randrange(3) for _ in range(page * rng.randrange(1, 6) + rng.randrange(page))]
    key = fast.RadixKey(tokens, rng.choice([None, None, None, "x"]))
    if op < 0.55:
        n = len(tokens) - len(tokens) % page
        prefix = torch.zeros(0, dtype=torch.int64)
        if rng.random() < 0.4:  # the caller's own prefix: a match's slots, whole pages of it
            # (a cut inside a node: its fresh duplicates from prev on are the caller's to free)
            prefix = cache.match_prefix(fast.MatchPrefixParams(key=key)).device_indices
            prefix = prefix[:rng.randrange(len(prefix) // page + 1) * page]
        slots = alloc.alloc(n - len(prefix))
        if slots is None:
            return ("evicted", cache.evict(fast.EvictParams(num_tokens=n)).num_tokens_evicted)
        value = torch.cat([prefix, slots, torch.zeros(len(tokens) - n, dtype=torch.int64)])
        r = cache.insert(fast.InsertParams(key=key, value=value, prev_prefix_len=len(prefix),
                                           chunked=rng.random() < 0.2))
        return ("insert", type(r), r.prefix_len, r.total_len, r.mamba_exist,
                r.inserted_host_node)
    if op < 0.7:
        return ("evict", cache.evict(fast.EvictParams(num_tokens=rng.randrange(1, 16)))
                .num_tokens_evicted)
    if op < 0.75:
        return ("evict_host", cache.evict_host(rng.randrange(1, 8)))
    if op < 0.85 and cache.tier.controller.io == "manual":
        cache.cache_controller.complete(rng.randrange(-1, 3), 0)
        return None
    if op < 0.9:
        m = cache.match_prefix(fast.MatchPrefixParams(key=key))
        return ("match", m.device_indices.tolist(), m.host_hit_length)
    return ("acks", cache.check_hicache_events())


def _lockstep(switch, sides, seed: int, page: int, steps: int, check: bool = True) -> int:
    """``steps`` random steps on both sides, compared after each; the most host tokens held."""
    rngs = [random.Random(seed), random.Random(seed)]
    most = 0
    for i in range(steps):
        got = []
        for side, rng in zip(sides, rngs, strict=True):
            with side.active():
                try:
                    got.append(_step(side, rng, page))
                except Exception as e:  # noqa: BLE001 - the two must raise alike
                    got.append(("raised", type(e), str(e)))
        assert got[0] == got[1], i
        assert state(sides[0].cache) == state(sides[1].cache), i
        assert sides[0].freed == sides[1].freed, i
        most = max(most, sides[0].cache.tier.host_tokens)
    if check:
        assert sides[0].cache.violations() == [] and sides[1].cache.violations() == []
    return most


@pytest.mark.parametrize("policy,io,page,threshold,host_slots,views", [
    ("write_through", "sync", 1, 1, 24, False),   # host pool short: host evictions on backup
    ("write_through", "sync", 1, 1, 32, True),    # a host pool handing out views
    ("write_through", "manual", 1, 1, 64, False),  # acks pending: write locks held
    ("write_through", "sync", 2, 3, 32, False),   # threshold > 1: parents backed up first
    ("write_through", "manual", 4, 2, 24, False),
    ("write_through_selective", "sync", 1, 2, 48, False),
    ("write_back", "sync", 1, 1, 32, False),      # no backup on insert
    ("write_back", "manual", 2, 1, 24, True),
])
def test_twin_equals_the_python_loop(switch, record_frees, policy, io, page, threshold,
                                     host_slots, views):
    build = _build(policy, io, page, threshold, host_slots, views)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    assert sides[0].cache._insert_fast is host_full.insert_host
    assert sides[0].cache.validate_slots  # (the pool model: the slot ledger is kept)
    most = _lockstep(switch, sides, 5 + page + threshold, page, 400)
    assert switch.taken > 100 and switch.declined == 0
    assert most > 0  # (backups on insert, or under write-back on eviction)


def test_the_paths_a_hit_needs(switch, record_frees):
    """Splits, evicted nodes restored by an insert, parents backed up first, a short host pool
    (host eviction inside a backup), all seen on the twin's side."""
    build = _build("write_through", "sync", 1, 2, 12)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    seen = {"split": 0, "unevict": 0, "evict_host": 0}
    for name, method in (("split", "_split"), ("unevict", "_unevict")):
        orig = getattr(sides[0].cache, method)

        def counted(*a, _orig=orig, _name=name):
            seen[_name] += 1
            return _orig(*a)
        setattr(sides[0].cache, method, counted)
    orig_eh = sides[0].cache.tier.evict_host

    def evict_host(k):
        seen["evict_host"] += 1
        return orig_eh(k)
    sides[0].cache.tier.evict_host = evict_host
    _lockstep(switch, sides, 3, 1, 400)
    assert min(seen.values()) > 0, seen
    assert switch.taken > 100


def _bench_log(switch, policy: str, page: int, twin: bool, requests: int) -> list:
    """One bench run of the shared-prefix workload on fast with a host tier (sglang's
    allocators and host pool where sglang imports, the bench's own otherwise), the state after
    every insert."""
    from uniradix.conformance.bench import loop as B
    from uniradix.conformance.bench.configs import BenchConfig, config_bundle
    config = BenchConfig(hicache=policy)
    try:
        bundle = config_bundle("fast", config, page, allocator="sglang")
    except B.ImplMissing:
        bundle = config_bundle("fast", config, page)
    log: list = []

    def build(pool):
        built = bundle.build(pool)
        cache = built[0]
        insert = cache.insert

        def logged(params):
            r = insert(params)
            log.append(((r.prefix_len, r.total_len), state(cache)))
            return r
        cache.insert = logged
        return built
    saved = node_mod._ids
    node_mod._ids, switch.on = itertools.count(1), twin
    try:
        B.run_bench(dataclasses.replace(bundle, build=build),
                    B.shared_prefix_workload(page, requests))
    finally:
        node_mod._ids, switch.on = saved, True
    return log


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 16])
def test_recorded_bench_runs(switch, policy, page):
    twin = _bench_log(switch, policy, page, True, 150)
    assert switch.taken > 100 and switch.declined == 0
    python = _bench_log(switch, policy, page, False, 150)
    assert len(twin) == len(python) > 100
    for i, (a, b) in enumerate(zip(twin, python, strict=True)):
        assert a == b, i


def heap_and_tier_spoils() -> list:
    """Two changes to a cache every host twin declines: its heap a list subclass, its tier a
    HostTier subclass."""
    class Heap(list):
        pass

    class Tier(host_mod.HostTier):
        pass

    def spoil_heap(c):
        c._heap = Heap(c._heap)

    def spoil_tier(c):
        c.tier.__class__ = Tier
    return [spoil_heap, spoil_tier]


def check_declines(switch, sides, name, spoils, steps, keep=()) -> None:
    """Each spoil in turn on both sides, then lockstep steps: every call of the twin ``name``
    declines with the cache's state unchanged (the Python loop answers), and there is one.
    ``keep``: the core's other functions the steps use."""
    for spoil in spoils:
        for side in sides:
            spoil(side.cache)
        calls = []
        real = switch.core

        def checked(*args, _real=real, _calls=calls):
            before = state(args[0])
            r = getattr(_real, name)(*args)
            _calls.append(r)
            assert r is None and state(args[0]) == before
            return r
        switch.core = types.SimpleNamespace(**{k: getattr(real, k) for k in keep},
                                            **{name: checked})
        try:
            # (a heap swapped for another object: the checker's own heap is not it)
            _lockstep(switch, sides, 10, 1, steps, check=False)
        finally:
            switch.core = real
        assert calls, spoil


def test_declines_change_nothing(switch, record_frees):
    """Where the twin declines (a heap that is not a plain list, a tier of another class, a
    threshold that is not a plain int) it changes nothing and the Python loop answers."""
    build = _build("write_through", "sync", 1, 1, 32)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    _lockstep(switch, sides, 9, 1, 60)

    def spoil_threshold(c):
        c.tier.write_through_threshold = 1.0
    check_declines(switch, sides, "host_insert", [*heap_and_tier_spoils(), spoil_threshold],
                   30, keep=("one_plan",))


def churn(cache, alloc, rounds: int, room: int, every_seventh: int = 0):
    """The same small inserts over and over (new leaves, hits, backups, splits): an evict of
    ``room`` tokens where the pool is short, the acks checked every seventh (with an evict of
    ``every_seventh`` tokens, if any), all evicted at the end.  Returns the cache."""
    for i in range(rounds):
        toks = [i % 3, i % 5, 7, i % 4] + [i] * (i % 3)
        slots = alloc.alloc(len(toks))
        if slots is None:
            cache.evict(fast.EvictParams(num_tokens=room))
            continue
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=slots))
        if i % 7 == 0:
            cache.check_hicache_events()
            if every_seventh:
                cache.evict(fast.EvictParams(num_tokens=every_seventh))
    cache.check_hicache_events()
    cache.evict(fast.EvictParams(num_tokens=1000))
    return cache


def test_no_reference_left_behind(switch):
    """The same inserts over and over (new leaves, hits, backups, splits, short host pool):
    the reference counts of the classes whose objects the twin makes or keeps, and the number
    of live objects, do not grow."""

    def round_trip():
        return churn(*_build("write_through", "sync", 1, 1, 16)(), 30, 64)

    probe = round_trip()
    classes = (node_mod.Node, host_mod._Event, host_mod.Ack, host_mod.InFlight,
               host_mod.HostDecLockRefParams, host_mod.HostTier, fast.InsertResult)

    def marks():
        return tuple(sys.getrefcount(o) for o in classes + (probe.root_node, probe.tier, probe))

    assert_no_leaks(round_trip, marks, runs=30)
    assert switch.taken > 500


def test_a_tier_of_its_own_backup_is_called(switch, record_frees):
    """A tier whose ``write_backup`` is not the written-out one (here a wrapper of the general
    ``write_backup`` that answers None) is called by the twin as by the Python loop, its answer
    dropped as the loop drops it."""
    build = _build("write_through", "sync", 1, 2, 24)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    calls = [0, 0]
    for i, side in enumerate(sides):
        tier = side.cache.tier

        def own(node, write_back=False, _tier=tier, _i=i):
            calls[_i] += 1
            host_mod.HostTier.write_backup(_tier, node, write_back)
        tier.write_backup = own
    _lockstep(switch, sides, 21, 1, 300)
    assert calls[0] == calls[1] > 5
    assert switch.taken > 50
