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


@pytest.mark.timeout(600)
def test_default_suite_finds_nothing():
    t0 = time.monotonic()
    results = ex.run_check(list(ex.UNIVERSES.values()), ["spec", "fast"], jobs=2, out=None,
                           progress=False, log=lambda m: print(m))
    seconds = time.monotonic() - t0
    print(ex.total_line(results, seconds))
    assert [r.universe for r in results] == list(ex.UNIVERSES)
    for r, u in zip(results, ex.UNIVERSES.values(), strict=True):
        assert r.finding is None, f"{u.name}: {r.finding}\n{r.labels}"
        assert r.complete and r.depth == u.depth, (u.name, r.depth, r.levels)
        assert r.states > 1 and r.transitions >= r.states - 1
    assert sum(r.transitions for r in results) > 20_000


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
        ex.parse_universe('{"base": "full-p1", "host_slots": 8}')
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


def test_unlock_of_unknown_handle_is_rejected_alike():
    """The invalid transitions are rejected by the spec, with the error the trace records."""
    s = SpecAdapter(ex.UNIVERSES["full-p1"].config())
    obs = s.apply({"i": 0, "op": "unlock", "args": {"handle": -1}})
    assert obs["error"] == HandleError.__name__
