"""The match of a host tier with one aux component in C (fast/_core.c ``host_match`` given the
component: fast/host_aux.py ``match_host_aux``'s walk, validators, list moves, stamps and host
hits) against ``match_host_aux``'s Python code, in one process.

Two fast adapters built alike replay a recorded conformance run in lockstep: one with the C
core as it is (``host_match`` counted), the other with ``host_match`` declining the
component's calls, so ``match_host_aux``'s own code answers them.  After every step the two
must agree on every node's fields and records (device and host values of both), the
component's LRU order, the leaf heap and the host leaf heap entry by entry, the host leaves,
the counters and the in-flight maps; the answers (match results with their nodes as paths)
are compared by the lockstep.  Then: the declines, and the references a call leaves behind."""

from __future__ import annotations

import pytest

from aux_twins import assert_no_leaks, listed, path_of, recorded_run, result_view

torch = pytest.importorskip("torch")

from test_host_lock_twins import Side, core_as  # noqa: E402
from test_host_lock_twins import state as host_state  # noqa: E402

from stories import replay_twins  # noqa: E402
from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.conformance.explore.lockstep import Lockstep  # noqa: E402
from uniradix.fast import host_aux  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


class MatchCore:
    """The C core, its ``host_match`` with a component (seven arguments) counted, or (``on``
    False) declining those calls so that ``match_host_aux``'s Python code runs; its other
    functions as they are."""

    def __init__(self, on: bool) -> None:
        self.on, self.calls, self.taken = on, 0, 0

    def __getattr__(self, name: str):
        fn = getattr(_core, name)
        if name != "host_match":
            return fn

        def match(*args):
            if len(args) != 7:
                return fn(*args)
            if not self.on:
                return None
            self.calls += 1
            r = fn(*args)
            self.taken += r is not None
            return r
        return match


def state(cache) -> dict:
    """:func:`test_host_lock_twins.state` with the component's records (device and host
    values, locks, boundaries) and its LRU order."""
    out = host_state(cache)
    recs = {}
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        recs[path_of(node)] = tuple((listed(r.value), listed(r.host_value), r.lock, r.host_lock,
                                     r.boundary, r.host_boundary) for r in node.aux)
        stack.extend(node.children.values())
    out["records"] = recs
    out["lru"] = [[path_of(r.node) for r in comp.lru.oldest_first()] for comp in cache.components]
    out["aux counts"] = [(c.evictable, c.protected) for c in cache.components]
    return out


CONFIGS = [("host-swa-wt-p1", 21), ("host-swa-wb-p1", 22), ("host-swa-wt-p4", 23),
           ("host-swa-wb-p4", 24), ("host-mamba-wt-p1", 25), ("host-mamba-wb-p1", 26),
           ("host-mamba-wt-p4", 27), ("host-mamba-wb-p4", 28)]


@needs_core
@pytest.mark.parametrize("name,seed", CONFIGS)
def test_c_match_equals_python_on_recorded_runs(name, seed):
    """A recorded workload (inserts, matches through device and host nodes with splits,
    locks, evictions to the host and off it, load backs, acks, resets) on both in lockstep."""
    comp = name.split("-")[1]
    config, steps = recorded_run(name, seed, ("full", comp))
    on, off = MatchCore(True), MatchCore(False)
    c, py = Side(make_adapter("fast", config), on), Side(make_adapter("fast", config), off)
    assert c.cache._match_fast is host_aux.match_host_aux
    ls = Lockstep([c, py], ["C match", "Python match"], events=False)

    def same(step):
        assert state(c.cache) == state(py.cache), step

    ops = replay_twins(ls, steps, same)
    assert "match_prefix" in ops
    assert on.taken == on.calls > 30, (on.calls, on.taken)


def _filled(comp: str):
    """A host-tier cache (write-through) with ``comp`` and a path of three nodes, each
    inserted with its acks processed."""
    from uniradix.conformance.explore.driver import make_config
    adapter = make_adapter("fast", make_config(f"host-{comp}-wt-p1", 3))
    cache = adapter.cache
    alloc = cache.token_to_kv_pool_allocator
    for toks in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]):
        params = fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(len(toks)))
        if comp == "mamba":
            params.mamba_value = cache.mamba_allocator.alloc(1)
        cache.insert(params)
        cache.writing_check(True)
    return cache


@needs_core
@pytest.mark.parametrize("comp", ["swa", "mamba"])
def test_c_match_declines_odd_arguments(comp):
    """Odd component arguments (not a bool, not an int window, the wrong count) and a clock
    that is not an int: declined or refused before anything changes."""
    cache = _filled(comp)
    units, ek, n = host_aux.host_full.match_key(cache, fast.MatchPrefixParams(
        key=fast.RadixKey([1, 2, 3, 4, 5, 6])))
    c, is_swa, _ = cache._one_aux
    before = state(cache)
    assert _core.host_match(cache, units, ek, n, c, 1, 4) is None
    assert _core.host_match(cache, units, ek, n, c, is_swa, 4.0) is None
    assert _core.host_match(cache, units, ek, n, c, is_swa, 2 ** 70) is None
    with pytest.raises(TypeError):
        _core.host_match(cache, units, ek, n, c, is_swa)
    clock = cache._clock  # (a clock that is not an int: the Python code stamps with it)
    cache._clock = float(clock)
    assert _core.host_match(cache, units, ek, n, c, is_swa, c.window if is_swa else 0) is None
    cache._clock = clock
    assert state(cache) == before
    window = c.window if is_swa else 0
    got = _core.host_match(cache, units, ek, n, c, is_swa, window)  # (a split: 4 + 2 units)
    twin = _filled(comp)
    with core_as(MatchCore(False)):
        want = host_aux.match_host_aux(twin, fast.MatchPrefixParams(
            key=fast.RadixKey([1, 2, 3, 4, 5, 6])))
    assert got is not None and result_view(got) == result_view(want)
    assert state(cache) == state(twin)


@needs_core
@pytest.mark.parametrize("comp", ["swa", "mamba"])
def test_c_match_leaves_no_references_behind(comp):
    """Matches answered in C over and over (a split on the first) leave no objects and no
    references on the nodes, records and the component behind."""
    cache = _filled(comp)
    c, is_swa, _ = cache._one_aux
    window = c.window if is_swa else 0
    keys = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 9]]

    def run():
        for toks in keys:
            units, ek, n = host_aux.host_full.match_key(
                cache, fast.MatchPrefixParams(key=fast.RadixKey(toks)))
            assert _core.host_match(cache, units, ek, n, c, is_swa, window) is not None

    def marks():
        import sys
        out = [sys.getrefcount(c), sys.getrefcount(c.lru), sys.getrefcount(c.lru.head)]
        stack = [cache.root_node]
        while stack:
            node = stack.pop()
            out.append(sys.getrefcount(node))
            out.extend(sys.getrefcount(r) for r in node.aux)
            stack.extend(node.children.values())
        return out

    assert_no_leaks(run, marks)
