"""``uniradix check --exhaustive`` (conformance/explore/exhaustive.py, docs/CHECKS.md).

* the default suite (every named universe at its default depth, spec vs fast, two worker
  processes) finds nothing; about 25 s here;
* a bug planted in the fast path (eviction that ignores locks) is found with a shortest
  counterexample (insert, lock, evict), written as a trace that ``uniradix replay`` reproduces;
* the dedup key keeps apart what decides the future and merges what does not.
"""

from __future__ import annotations

import re
import time

import pytest

from uniradix import fast
from uniradix.conformance import cli
from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore import exhaustive as ex
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec.errors import ConfigError, HandleError
from uniradix.spec.state import all_nodes

LAST_LINE = re.compile(r"^check: (\d+) states, (\d+) transitions, depth ([\d-]+), [\d.]+ s: (.*)$")


# ----------------------------------------------------------------------------------------------
# The default suite
# ----------------------------------------------------------------------------------------------


DEVICE_ONLY = [u for u in ex.UNIVERSES.values() if not u.host]
HOST = [u for u in ex.UNIVERSES.values() if u.host]
# the host universes in the default suite: smaller bounds than ``make check``'s (a few seconds)
HOST_QUICK_DEPTH = {"host-p1-wt": 2, "host-p1-wb": 3}


@pytest.mark.timeout(600)
def test_default_suite_finds_nothing():
    """The device-only universes at their default depths (the host ones: below)."""
    t0 = time.monotonic()
    results = ex.run_check(DEVICE_ONLY, ["spec", "fast"], jobs=2, out=None,
                           progress=False, log=lambda m: print(m))
    seconds = time.monotonic() - t0
    print(ex.total_line(results, seconds))
    assert [r.universe for r in results] == [u.name for u in DEVICE_ONLY]
    for r, u in zip(results, DEVICE_ONLY, strict=True):
        assert r.finding is None, f"{u.name}: {r.finding}\n{r.labels}"
        assert r.complete and r.depth == u.depth, (u.name, r.depth, r.levels)
        assert r.states > 1 and r.transitions >= r.states - 1
    assert sum(r.transitions for r in results) > 20_000


@pytest.mark.timeout(300)
def test_host_universes_find_nothing_small_bound():
    assert sorted(HOST_QUICK_DEPTH) == sorted(u.name for u in HOST)
    for u in HOST:
        res = ex.explore(u, ["spec", "fast"], depth=HOST_QUICK_DEPTH[u.name], progress=False)
        print(res.summary(u.name), res.levels)
        assert res.finding is None, f"{u.name}: {res.finding}\n{res.labels}"
        assert res.complete and res.depth == HOST_QUICK_DEPTH[u.name]
        assert res.states > 50


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_host_universes_find_nothing_default_depth():
    """``make check``'s bound for the host universes (about a minute on two cores)."""
    results = ex.run_check(HOST, ["spec", "fast"], jobs=2, out=None, progress=False,
                           log=lambda m: print(m))
    for r, u in zip(results, HOST, strict=True):
        assert r.finding is None, f"{u.name}: {r.finding}\n{r.labels}"
        assert r.complete and r.depth == u.depth, (u.name, r.depth, r.levels)


# ----------------------------------------------------------------------------------------------
# A planted bug in the fast path
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def evict_ignores_locks(monkeypatch):
    """The fast path's eviction does not see locks (every lock count reads 0 meanwhile)."""
    real = fast.UnifiedRadixCache.evict

    def evict(self, params):
        saved = [(n, n.lock_ref) for n in self.all_nodes() if n is not self.root_node]
        for n, _ in saved:
            n.lock_ref = 0
        try:
            return real(self, params)
        finally:
            for n, k in saved:
                n.lock_ref = k

    monkeypatch.setattr(fast.UnifiedRadixCache, "evict", evict)


def test_planted_bug_is_found_with_a_shortest_counterexample(evict_ignores_locks, tmp_path):
    u = ex.UNIVERSES["full-p1"]
    res = ex.explore(u, ["spec", "fast"], progress=False)
    f = res.finding
    assert f is not None
    assert (f.kind, f.op, f.where, f.path) == ("divergence", "evict", "observation",
                                               "num_tokens_evicted")
    assert f.values == {"spec": 0, "fast": 1}
    # insert, lock, evict: nothing shorter shows it (every sequence of two was explored)
    assert [lab.split()[0] for lab in res.labels] == ["insert", "lock", "evict"], res.labels
    assert res.depth == 2 and res.levels[:3] == [1, 12, 160]
    assert [s["op"] for s in res.counterexample] == ["alloc", "insert", "lock", "evict"]

    path = ex.write_counterexample(str(tmp_path), u, ["spec", "fast"], res)
    trace = load_trace(path)
    assert trace.header["transitions"] == res.labels
    assert [s["op"] for s in trace.steps] == ["alloc", "insert", "lock", "evict"]
    assert trace.steps[-1]["ret"] == {"num_tokens_evicted": 0, "freed": []}
    assert replay_trace(trace, "spec").divergence is None
    bad = replay_trace(trace, "fast").divergence
    assert bad is not None and (bad.op, bad.field) == ("evict", "num_tokens_evicted")
    # and through the command line
    assert cli.main(["replay", path, "--impl", "spec"]) == 0
    assert cli.main(["replay", path, "--impl", "fast"]) == 1


@pytest.fixture
def evict_host_leaks_a_slot(monkeypatch):
    """The fast path's host eviction forgets to free one host slot of what it evicts (the last
    slot of each free of more than one, all of a free of one)."""
    from uniradix.fast import hicache
    real = hicache.HiCacheRadixCache.evict_host

    def evict_host(self, num_tokens, component_type=None):
        pool = self.cache_controller.mem_pool_host
        free = pool.free

        def leaky(slots):
            if len(slots) > 1:
                free(slots[:-1])
        pool.free = leaky
        try:
            return real(self, num_tokens, component_type)
        finally:
            del pool.free

    monkeypatch.setattr(hicache.HiCacheRadixCache, "evict_host", evict_host)


@pytest.mark.parametrize("name", ["host-p1-wt", "host-p1-wb"])
def test_planted_host_bug_is_found(evict_host_leaks_a_slot, name, tmp_path):
    """A host slot the fast path forgets to free shows as a missing ``host_freed`` effect at
    the first host eviction (explicit, or an insert's or backup's room-making), and the
    written trace replays clean on the spec and diverges on the broken fast path."""
    u = ex.UNIVERSES[name]
    res = ex.explore(u, ["spec", "fast"], progress=False)
    f = res.finding
    assert f is not None and res.labels is not None
    assert (f.kind, f.where) == ("divergence", "observation") and f.path.startswith("host_freed")
    assert len(res.labels) <= 3, res.labels
    path = ex.write_counterexample(str(tmp_path), u, ["spec", "fast"], res)
    trace = load_trace(path)
    assert replay_trace(trace, "spec").divergence is None
    assert replay_trace(trace, "fast").divergence is not None


def test_cli_check_exits_1_and_writes_the_counterexample(evict_ignores_locks, tmp_path, capsys):
    rc = cli.main(["check", "--exhaustive", "--config", "full-p1", "--out", str(tmp_path),
                   "--no-progress"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 1
    m = LAST_LINE.match(out[-1])
    assert m and m.group(4).startswith("FAILED (full-p1): DIVERGENCE at step 3 (evict)"), out[-1]
    assert out[-2].startswith(str(tmp_path)) and out[-2].endswith(".jsonl")
    assert replay_trace(load_trace(out[-2]), "fast").divergence is not None


def test_a_step_that_must_be_rejected_but_is_accepted_is_a_finding():
    class LaxUnlock(SpecAdapter):
        def op_unlock(self, step):
            if step["args"].get("handle") == -1:
                return {}
            return super().op_unlock(step)

    res = ex.explore(ex.UNIVERSES["full-p1"], [LaxUnlock, LaxUnlock], progress=False)
    assert res.finding is not None
    assert (res.finding.where, res.finding.op) == ("must_reject", "unlock")
    assert res.labels == ["invalid: unlock unknown handle"]


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


def test_cli_check_clean_run_last_line_and_progress(capsys):
    rc = cli.main(["check", "--exhaustive", "--config", "disable", "--depth", "2"])
    cap = capsys.readouterr()
    assert rc == 0
    m = LAST_LINE.match(cap.out.strip().splitlines()[-1])
    assert m and m.group(3) == "2" and m.group(4) == "ok", cap.out
    assert int(m.group(1)) > 1 and int(m.group(2)) > 1
    assert "check disable [" in cap.err and "transitions" in cap.err  # the progress bar


def test_cli_check_json_universe_and_time_limit(capsys):
    rc = cli.main(["check", "--exhaustive", "--config", '{"base": "full-p1", "max_len": 1}',
                   "--depth", "9", "--seconds", "1", "--no-progress"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0
    assert last.endswith("ok (time limit: search incomplete)"), last


def test_cli_check_needs_exhaustive_and_rejects_bad_universes(capsys):
    assert cli.main(["check"]) == 2
    assert cli.main(["check", "--exhaustive", "--config", "nope"]) == 2
    with pytest.raises(ConfigError, match="host tier"):
        ex.parse_universe('{"base": "req-p1", "host_slots": 8}')
    with pytest.raises(ConfigError, match="unknown key"):
        ex.parse_universe('{"base": "full-p1", "host_pages": 8}')
    with pytest.raises(ConfigError, match="need a host tier"):
        ex.parse_universe('{"base": "full-p1", "write_policy": "write_back"}')
    with pytest.raises(ConfigError, match="write_policy"):
        ex.parse_universe('{"base": "host-p1-wt", "write_policy": "write_sometimes"}')
    with pytest.raises(ConfigError):
        ex.parse_universe('{"page_size": 2, "kv_slots": 5}')


# ----------------------------------------------------------------------------------------------
# The dedup key
# ----------------------------------------------------------------------------------------------


def _pair(u: ex.Universe, steps: list) -> Lockstep:
    ls = Lockstep.from_impls(["spec", "fast"], u.config())
    for k, (op, args) in enumerate(steps):
        ls.apply({"i": k, "op": op, "args": args})
    ls.prime()
    return ls


def _key(ls: Lockstep) -> bytes:
    return ex.state_key(ls.snapshots(), ls.adapters)


def test_key_ignores_the_clock_and_handle_numbers():
    u = ex.UNIVERSES["full-p1"]
    ins = [("alloc", {"n": 1}), ("insert", {"tokens": [1], "value": [1]})]
    base = _pair(u, ins)
    # a match of an uncached key only moves the clock (the root's stamp)
    miss = _pair(u, ins + [("match_prefix", {"tokens": [2]})])
    assert _key(base) == _key(miss)
    # the same lock taken at different step numbers (handle 2 vs handle 3)
    lock = ("lock", {"node": {"tokens": [1], "extra_key": None}})
    a = _pair(u, ins + [lock])
    b = _pair(u, ins + [("match_prefix", {"tokens": [2]}), lock])
    assert _key(a) == _key(b) != _key(base)


def test_key_keeps_inner_access_order_apart():
    """Same snapshot (the leaves' order included), different place of an inner node in the
    access order: the futures differ (what eviction takes once the inner node is a leaf), so
    the keys must differ."""
    u = ex.UNIVERSES["full-p1"]
    steps = [("alloc", {"n": 2}), ("insert", {"tokens": [1, 1], "value": [1, 2]}),
             ("alloc", {"n": 1}),
             ("insert", {"tokens": [1, 2], "value": [1, 3], "prev_prefix_len": 1}),
             ("alloc", {"n": 1}), ("insert", {"tokens": [2], "value": [4]})]
    a, b = _pair(u, steps), _pair(u, steps)
    # in b, the inner node [1] becomes newer than the leaf [2] (in both implementations)
    spec_inner = next(n for n in all_nodes(b.adapters[0].state) if n.path_units() == (1,))
    spec_inner.stamp = (10**6, 0)
    fa = b.adapters[1]
    fast_inner = next(n for n in fa.cache.all_nodes() if n is not fa.cache.root_node
                      and fa._tokens_of(n) == [1])
    fast_inner.last_access_time = 10**15
    assert a.snapshots() == b.snapshots()
    assert _key(a) != _key(b)
    freed = []
    for ls in (a, b):
        assert ls.apply({"i": 10, "op": "evict", "args": {"num_tokens": 2}})["freed"] == [2, 3]
        freed.append(ls.apply({"i": 11, "op": "evict", "args": {"num_tokens": 1}})["freed"])
    assert freed == [[1], [4]]


@pytest.mark.parametrize("name", sorted(ex.UNIVERSES))
def test_every_universe_reads_the_fast_paths_hidden_state(name):
    """The fast fingerprint is built in every universe.  It used to catch AttributeError and
    answer one constant ``opaque`` tuple: the host universes had done so since fast/ became a
    tree of plug-ins (the cache's ``_host_heap`` became the tier's ``host_leaf_heap``), which
    left their dedup to the snapshot and the spec's fingerprint without anyone noticing."""
    u = ex.UNIVERSES[name]
    fa = _pair(u, [("alloc", {"n": 1}), ("insert", {"tokens": [1], "value": [1]})]).adapters[1]
    fp = ex.fingerprint(fa)
    assert fp[0] == "fast" and fp[1] != "opaque" and len(fp) == 7
    assert (fp[-1] != ()) == bool(u.host)
    if name == "host-p1-wt":  # the write-through backup's ack is pending: the key sees it
        assert fp[-1][1][0], fp[-1]


def test_key_records_when_the_heaps_compactions_are_due():
    """What decides whether the next call compacts a heap is its own ``cap`` (twice the live
    entries of the last compaction plus COMPACT_MIN) and, in an eviction, ``needs_compaction``;
    the key used to record only "more than 64 entries"."""
    from uniradix.fast.structures import COMPACT_MIN, LazyHeap
    heap = LazyHeap()
    heap.entries.extend((k, None) for k in range(COMPACT_MIN + 6))
    heap.cap = 2 * 40 + COMPACT_MIN  # (as a compaction that kept 40 live entries leaves it)
    assert ex._heap_due(heap, 40) == (False, False)
    assert ex._heap_due(heap, 0) == (False, True)  # stale entries clearly outnumber live ones
    heap.entries.extend((k, None) for k in range(heap.cap))
    assert ex._heap_due(heap, 40) == (True, False)


def test_transitions_are_a_table_a_tier_can_extend():
    u = ex.UNIVERSES["full-p1"]
    w = ex.World.of(u, SpecAdapter(u.config()))
    names = [k.name for k in ex.OP_KINDS]
    assert names[:7] == ["match_prefix", "insert", "serve", "lock", "unlock", "evict", "reset"]
    n = len(ex.transitions(u, w))
    extra = ex.OpKind("sizes", lambda u, w: [ex.Transition("sizes", ex.single("sizes", {}))])
    assert len(ex.transitions(u, w, ex.OP_KINDS + (extra,))) == n + 1
    res = ex.explore(u, ["spec", "fast"], depth=1, progress=False,
                     kinds=ex.OP_KINDS + (extra,))
    assert res.finding is None and res.transitions == n + 1


def test_host_rows_apply_to_host_universes_only():
    names = {t.label.split()[0] for t in ex.transitions(
        ex.UNIVERSES["full-p1"], ex.World.of(ex.UNIVERSES["full-p1"],
                                             SpecAdapter(ex.UNIVERSES["full-p1"].config())))}
    assert not names & {"evict_host", "load_back", "host_lock", "settle", "serve+settle"}
    u = ex.UNIVERSES["host-p1-wt"]
    # a node backed up, its ack processed, then evicted from the device: everything applies
    ls = _pair(u, [("alloc", {"n": 1}), ("insert", {"tokens": [1], "value": [1]}),
                   ("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {}),
                   ("evict", {"num_tokens": 2})])
    w = ex.World.of(u, ls.adapters[0])
    one = {"tokens": [1], "extra_key": None}
    assert w.backed_up == [one] and w.loadable == [(one, {"tokens": [], "extra_key": None})]
    labels = [t.label for t in ex.transitions(u, w)]
    assert "load_back [1] from []" in labels and "host_lock [1]" in labels
    assert "evict_host 3" in labels and "serve+settle [1] None" in labels
    assert not any(lab.startswith(("io_complete", "settle", "check_hicache")) for lab in labels)


def test_key_ignores_host_handle_numbers_and_keeps_host_locks_apart():
    u = ex.UNIVERSES["host-p1-wt"]
    base = [("alloc", {"n": 1}), ("insert", {"tokens": [1], "value": [1]}),
            ("io_complete", {"writes": -1, "loads": -1}), ("check_hicache_events", {})]
    hl = ("host_lock", {"node": {"tokens": [1], "extra_key": None}})
    a = _pair(u, base + [hl])
    b = _pair(u, base + [("match_prefix", {"tokens": [2]}), hl])
    assert _key(a) == _key(b) != _key(_pair(u, base))
    w = ex.World.of(u, a.adapters[0])
    assert w.n_host_held == 1 and [m for _, m in w.host_held] == [((False, "", (1,)), True)]
    assert list(ex.t_host_lock(u, w)) == []  # max_host_locks 1


def test_unlock_of_unknown_handle_is_rejected_alike():
    """The invalid transitions are rejected by the spec, with the error the trace records."""
    s = SpecAdapter(ex.UNIVERSES["full-p1"].config())
    obs = s.apply({"i": 0, "op": "unlock", "args": {"handle": -1}})
    assert obs["error"] == HandleError.__name__
