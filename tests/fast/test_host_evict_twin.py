"""fast/_core.c ``host_evict`` (fast/hybrid.py ``_evict_units(want)`` for the Full component
alone over the host tier: the heap loop, ``HostTier.evict_leaf`` written out, the write-back
check, the batch's release and the heap's compaction) against the Python loop it stands for.

Two caches built alike and driven alike, one with the twin and one with it switched off (only
``host_evict``: every other twin runs on both sides), compared after every step: every node's
fields with its id (tests/fast/test_host_insert_twin.py's harness: each side draws ids from a
counter of its own), or with nodes named by their paths (tests/fast/test_host_lock_twins.py's,
over recorded conformance runs and sglang's allocators), the leaf heap and the host leaf heap
entry by entry, the host leaves, the counters, the in-flight maps and ack queues, every piece
freed (in order, with its allocator method) and the allocators' free lists.  Also: the
declines change nothing, and repeated evictions leave no references behind."""

from __future__ import annotations

import dataclasses
import random
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from test_host_fast_paths import _cache  # noqa: E402  (tests/fast's own)
from test_host_fast_paths import _step as _rich_step  # noqa: E402
from test_host_insert_twin import (  # noqa: E402
    Side,
    Switch,
    _bench_log,
    _build,
    _lockstep,
    check_declines,
    churn,
    heap_and_tier_spoils,
    install_switch,
)
from test_host_insert_twin import state as id_state  # noqa: E402
from test_host_lock_twins import Side as AdapterSide  # noqa: E402
from test_host_lock_twins import _sglang_cache, _sglang_importable, core_as  # noqa: E402
from test_host_lock_twins import state as path_state  # noqa: E402

from aux_twins import assert_no_leaks, recorded_run  # noqa: E402  (tests/aux_twins.py)
from stories import replay_twins  # noqa: E402
from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import frees, host_full, hybrid  # noqa: E402
from uniradix.fast import node as node_mod  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402
from uniradix.fast.frees import FreeBatch  # noqa: E402
from uniradix.fast.structures import LazyHeap  # noqa: E402
from uniradix.fast.tiers import host as host_mod  # noqa: E402

pytestmark = pytest.mark.skipif(_core is None, reason="the C core is not built (or "
                                "UNIRADIX_PURE_PYTHON=1): no twin to compare")


class EvictSwitch(Switch):
    """host_full's C core with ``host_evict`` switched on or off (``host_insert`` always on),
    counted as :class:`Switch` counts."""

    switched = "host_evict"


@pytest.fixture
def switch(monkeypatch):
    return install_switch(monkeypatch, host_full, EvictSwitch)


@pytest.fixture
def record_frees(monkeypatch):
    """The pieces each side frees, in order with their method: a batch's runs
    (fast/frees.py ``release``, what ``FreeBatch.release`` calls) and an insert's duplicates
    (fast/hybrid.py's ``release``)."""
    for mod in (frees, hybrid):
        orig = mod.release

        def release(alloc, pieces, *rest, _orig=orig):
            if Side.current is not None:
                Side.current.freed.append((rest, [p.tolist() for p in pieces]))
            return _orig(alloc, pieces, *rest)
        monkeypatch.setattr(mod, "release", release)


def alloc_state(alloc) -> tuple:
    """An allocator's free lists: the project's pool model, or sglang's tensors."""
    pool = getattr(alloc, "pool", None)
    if pool is not None and hasattr(pool, "_free_pages"):
        return (list(pool._free_pages), sorted(pool._allocated), list(pool._freed_log))
    return tuple(getattr(alloc, name).tolist() for name in ("free_pages", "release_pages")
                 if isinstance(getattr(alloc, name, None), torch.Tensor))


def _counted_tier(cache, seen: dict) -> None:
    """Count the tier's methods the loop calls (the Python calls the twin makes as the Python
    loop makes them): ``_take_host`` (and how often it failed: a leaf passed over),
    ``write_backup`` and ``writing_check``."""
    tier = cache.tier
    take, backup, check = tier._take_host, tier.write_backup, tier.writing_check

    def take_host(node):
        seen["take_host"] += 1
        r = take(node)
        seen["failed"] += r is None
        return r

    def write_backup(node, write_back=False):
        seen["write_backup"] += 1
        return backup(node, write_back)
    def writing_check(write_back=False):
        seen["writing_check"] = seen.get("writing_check", 0) + 1
        return check(write_back)
    tier._take_host, tier.write_backup, tier.writing_check = take_host, write_backup, \
        writing_check


# ----------------------------------------------------------------------------------------------
# random steps, node ids compared (the project's allocators)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy,io,page,threshold,host_slots,views", [
    ("write_through", "sync", 1, 1, 24, False),   # host pool short: host evictions on backup
    ("write_through", "sync", 1, 2, 32, True),    # leaves without a host copy deleted
    ("write_through", "manual", 1, 1, 64, False),  # acks pending: write locks held
    ("write_through", "sync", 2, 3, 32, False),
    ("write_through", "manual", 4, 2, 24, False),
    ("write_through_selective", "sync", 1, 2, 48, False),
    ("write_back", "sync", 1, 1, 32, False),      # backups on eviction
    ("write_back", "sync", 1, 1, 8, False),       # a short host pool: backups fail
    ("write_back", "manual", 2, 1, 24, True),
    ("write_back", "copy", 1, 1, 24, False),      # copies queued: write_backup, writing_check
    ("write_back", "sync", 4, 1, 16, False),
])
def test_twin_equals_the_python_loop(switch, record_frees, policy, io, page, threshold,
                                     host_slots, views):
    copy = io == "copy"  # (a controller that copies: every backup through submit_write)
    build = _build(policy, "sync" if copy else io, page, threshold, host_slots, views)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    assert sides[0].cache._host_evict
    for side in sides if copy else ():
        side.cache.tier.controller.ack_only = False
    seen = {"take_host": 0, "failed": 0, "write_backup": 0}
    seen_py = dict(seen)
    if policy == "write_back":
        _counted_tier(sides[0].cache, seen)
        _counted_tier(sides[1].cache, seen_py)
    _lockstep(switch, sides, 7 + page + threshold + host_slots, page, 500)
    assert switch.taken > 50 and switch.declined == 0, (switch.taken, switch.declined)
    assert alloc_state(sides[0].alloc) == alloc_state(sides[1].alloc)
    assert seen == seen_py  # (the same backups called, the same failed)
    if policy == "write_back":
        assert seen["take_host"] > 5, seen
        if copy:
            assert seen["write_backup"] > 5, seen
        if host_slots == 8:
            assert seen["failed"] > 0, seen


def test_many_leaves_each_call(switch, record_frees, monkeypatch):
    """Big evictions (leaves deleted and their tombstone chains, leaves to the host, parents
    becoming leaves in the same call) and the heap's compaction."""
    build = _build("write_through", "sync", 1, 2, 64)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    compacted = [0, 0]
    orig = LazyHeap.compact

    def compact(self, is_member):
        compacted[Side.current is sides[1]] += 1
        return orig(self, is_member)
    monkeypatch.setattr(LazyHeap, "compact", compact)
    for i in range(600):
        for side in sides:
            with side.active():
                r = random.Random(i)
                cache, alloc = side.cache, side.alloc
                toks = [r.randrange(5) for _ in range(r.randrange(1, 9))]
                slots = alloc.alloc(len(toks))
                if slots is None:
                    cache.evict(fast.EvictParams(num_tokens=64))
                    continue
                cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=slots))
                for _ in range(r.randrange(3)):  # (restamps: stale heap entries)
                    cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(toks)))
                if i % 5 == 0:
                    cache.check_hicache_events()
                if i % 11 == 0:
                    cache.evict(fast.EvictParams(num_tokens=r.randrange(1, 40)))
                if i % 50 == 0:  # (a heap of mostly stale entries: compacted after the evict)
                    for _ in range(300):
                        cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(toks)))
                    cache.evict(fast.EvictParams(num_tokens=1))
        assert id_state(sides[0].cache) == id_state(sides[1].cache), i
        assert sides[0].freed == sides[1].freed, i
    assert switch.taken > 50
    assert compacted[0] == compacted[1] > 0, compacted


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 16])
def test_recorded_bench_runs(switch, policy, page, monkeypatch):
    """The bench's shared-prefix workload (sglang's allocators and host pool where sglang
    imports) in a third of its KV pool, so that it evicts from its first requests on; the
    state after every insert."""
    from uniradix.conformance.bench import loop
    orig = loop.shared_prefix_workload

    def smaller(ps, requests):
        w = orig(ps, requests)
        return dataclasses.replace(w, kv_slots=w.kv_slots // 3 // ps * ps)
    monkeypatch.setattr(loop, "shared_prefix_workload", smaller)
    twin = _bench_log(switch, policy, page, True, 150)
    assert switch.taken > 20 and switch.declined == 0, (switch.taken, switch.declined)
    python = _bench_log(switch, policy, page, False, 150)
    assert len(twin) == len(python) > 100
    for i, (a, b) in enumerate(zip(twin, python, strict=True)):
        assert a == b, i


# ----------------------------------------------------------------------------------------------
# recorded conformance runs and sglang's allocators, nodes by path (the other twins on both)
# ----------------------------------------------------------------------------------------------


class EvictCore:
    """The C core with ``host_evict`` counted (on) or declining (off)."""

    def __init__(self, on: bool) -> None:
        self.on, self.calls, self.taken = on, 0, 0

    def __getattr__(self, name):
        return getattr(_core, name)

    def host_evict(self, cache, want):
        self.calls += 1
        if not self.on:
            return None
        r = _core.host_evict(cache, want)
        self.taken += r is not None
        return r


@pytest.mark.parametrize("name,seed", [("hicache-wt-p1", 1), ("hicache-wt-p1", 2),
                                       ("hicache-wt-p4", 3), ("hicache-wb-p1", 4),
                                       ("hicache-wb-p4", 5)])
def test_recorded_conformance_runs(name, seed):
    """A recorded workload (inserts, matches, locks, evictions to the host and off it, load
    backs, acks, resets) on both caches in lockstep."""
    config, steps = recorded_run(name, seed, ("full",))
    on, off = EvictCore(True), EvictCore(False)
    c, py = AdapterSide(make_adapter("fast", config), on), AdapterSide(make_adapter("fast", config),
                                                                       off)
    assert c.cache._host_evict
    ls = Lockstep([c, py], ["C twin", "Python loop"], events=False)

    def same(step):
        assert path_state(c.cache) == path_state(py.cache), step

    replay_twins(ls, steps, same)
    assert on.taken == on.calls > 5, (on.calls, on.taken)
    assert off.calls == on.calls


def evict_failing_third_backup(cache) -> str:
    """An evict of 100 tokens whose third write-back backup raises (the tier's ``_take_host``
    replaced on the instance): "ok", or the error's message."""
    take, calls = cache.tier._take_host, [0]

    def take_host(node):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("host pool gone")
        return take(node)
    cache.tier._take_host = take_host
    try:
        cache.evict(fast.EvictParams(num_tokens=100))
        return "ok"
    except RuntimeError as e:
        return str(e)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page", [1, 2])
@pytest.mark.parametrize("allocator", ["own", "sglang"])
def test_random_steps(policy, page, allocator):
    """Random inserts, matches, locks held and released, device and host evictions, load
    backs and acks, over sglang's allocators (where sglang imports) and the project's."""
    if allocator == "sglang":
        if not _sglang_importable():
            pytest.skip("sglang's allocators do not import here")
        (a, alloc_a), (b, alloc_b) = _sglang_cache(policy, page), _sglang_cache(policy, page)
    else:
        (a, alloc_a), (b, alloc_b) = _cache(policy, "sync", page), _cache(policy, "sync", page)
    assert a._host_evict
    on, off = EvictCore(True), EvictCore(False)
    sides = ((a, alloc_a, on, random.Random(11), []), (b, alloc_b, off, random.Random(11), []))
    for i in range(500):
        outs = []
        for cache, alloc, core, rng, held in sides:
            with core_as(core):
                try:
                    outs.append(("ok", _rich_step(cache, alloc, rng, page, True, held)))
                except Exception as e:  # noqa: BLE001 - the two must raise alike
                    outs.append(("raised", type(e), str(e)))
        assert outs[0] == outs[1], i
        assert path_state(a) == path_state(b), i
        assert alloc_state(alloc_a) == alloc_state(alloc_b), i
    assert on.taken == on.calls > 10, (on.calls, on.taken)


# ----------------------------------------------------------------------------------------------
# declines, references
# ----------------------------------------------------------------------------------------------


def test_declines_change_nothing(switch, record_frees):
    """Where the twin declines (a heap that is not a plain list, a tier of another class, an
    ``_evict_leaf`` that is not the tier's, a counter that is not a plain int, a storage tier
    or an eviction policy key set, KV events on) it changes nothing and the Python loop
    answers."""
    build = _build("write_through", "sync", 1, 2, 32)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    _lockstep(switch, sides, 9, 1, 80)

    def spoil_evict_leaf(c):
        c._evict_leaf = types.MethodType(lambda self, *a: host_mod.HostTier.evict_leaf(
            self, *a), c.tier)

    def spoil_counter(c):
        c._evictable = float(c._evictable)

    def spoil_entries(c):
        c._leaf_heap.entries = list(c._heap)
        c._heap = c._leaf_heap.entries
    check_declines(switch, sides, "host_evict",
                   [*heap_and_tier_spoils(), spoil_evict_leaf, spoil_counter, spoil_entries],
                   40, keep=("host_insert", "one_plan"))
    # what the cache's state decides, one at a time, read straight from the C function (on
    # a cache the spoils above left alone, which it takes)
    side = Side(switch, True, build)
    _lockstep(switch, [side, Side(switch, False, build)], 9, 1, 80)
    cache = side.cache
    for attr, value in (("storage_tier", object()), ("_policy_key", len), ("_events", []),
                        ("disable", True), ("components", (None,))):
        saved = getattr(cache, attr)
        setattr(cache, attr, value)
        try:
            before = id_state(cache)
            assert _core.host_evict(cache, 10) is None, attr
            assert id_state(cache) == before
        finally:
            setattr(cache, attr, saved)
    for attr, value in (("tp_group", object()), ("storage", object()), ("write_back", 1)):
        saved = getattr(cache.tier, attr)
        setattr(cache.tier, attr, value)
        try:
            before = id_state(cache)
            assert _core.host_evict(cache, 10) is None, attr
            assert id_state(cache) == before
        finally:
            setattr(cache.tier, attr, saved)
    assert _core.host_evict(cache, 10.0) is None  # (a want that is not a plain int)
    assert _core.host_evict(cache, 1) is not None  # (and as it is, it takes the call)


def test_a_failed_backup_passes_the_leaf_over_once(switch, record_frees):
    """Write-back with the host pool full of slots no host leaf holds: each leaf's backup
    fails and it is passed over, a second heap entry of it in the same call is not tried
    again, and it is pushed back once at the end."""
    build = _build("write_back", "sync", 1, 1, 8)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    seen = [{"take_host": 0, "failed": 0, "write_backup": 0} for _ in sides]
    for side, counts in zip(sides, seen, strict=True):
        with side.active():
            cache, alloc = side.cache, side.alloc
            for toks in ([1, 2, 3], [1, 2, 4], [5, 6]):
                cache.insert(fast.InsertParams(key=fast.RadixKey(toks),
                                               value=alloc.alloc(len(toks))))
            for _stamp, node in list(cache._heap):  # (a second entry of each leaf)
                cache._push_if_leaf(node)
            assert cache.tier.controller.mem_pool_host.alloc(8) is not None  # (pool full)
            _counted_tier(cache, counts)
            assert cache.evict(fast.EvictParams(num_tokens=100)).num_tokens_evicted == 0
    assert seen[0] == seen[1] and seen[0]["failed"] == 3, seen
    assert id_state(sides[0].cache) == id_state(sides[1].cache)
    assert switch.taken == 1


def test_no_reference_left_behind(switch):
    """The same inserts and evictions over and over (leaves to the host and deleted,
    tombstones, write-back backups, a short host pool): the reference counts of what the twin
    touches or makes, and the number of live objects, do not grow."""

    def round_trip(policy):
        return churn(*_build(policy, "sync", 1, 2, 12)(), 40, 6, every_seventh=3)

    for policy in ("write_through", "write_back"):
        probe = round_trip(policy)
        classes = (node_mod.Node, FreeBatch, host_mod.HostTier, host_mod.InFlight,
                   host_mod.Ack)

        def marks(probe=probe, classes=classes):
            return tuple(sys.getrefcount(o) for o in classes + (
                probe.root_node, probe.tier, probe, probe._heap, probe.tier.host_leaves))

        before = switch.taken
        assert_no_leaks(lambda policy=policy: round_trip(policy), marks, runs=25)
        assert switch.taken - before > 200


def test_an_error_half_way_still_releases(switch, record_frees):
    """A backup that raises half way through an eviction (the tier's ``_take_host``, a Python
    call the loop makes): the same error on both sides, the frees taken in before it released
    (the Python loop's ``finally``), the same state after."""
    build = _build("write_back", "sync", 1, 1, 32)
    sides = [Side(switch, True, build), Side(switch, False, build)]
    outs = []
    for side in sides:
        with side.active():
            cache, alloc = side.cache, side.alloc
            for toks in ([1, 2, 3], [1, 2, 4], [5, 6], [7], [8, 9]):
                cache.insert(fast.InsertParams(key=fast.RadixKey(toks),
                                               value=alloc.alloc(len(toks))))
            outs.append(evict_failing_third_backup(cache))
    assert outs == ["host pool gone"] * 2
    assert switch.calls == 1 and switch.taken == 0  # (the twin's call raised)
    assert sides[0].freed == sides[1].freed and sides[0].freed, sides[0].freed
    assert id_state(sides[0].cache) == id_state(sides[1].cache)
    assert alloc_state(sides[0].alloc) == alloc_state(sides[1].alloc)
