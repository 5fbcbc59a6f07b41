"""The lockstep runner, the Hypothesis state machine and ``uniradix conform``.

* spec against spec finds nothing (random runner across every named config, and the machine);
* deliberately broken adapters (a SpecAdapter subclass with one bug each) ARE found, by the
  machine and by conform's random runner; the shrunk trace is short, replays clean on the spec
  and diverges on the broken adapter;
* every implementation registered besides the spec (``fast`` once it exists) runs >= 20k
  lockstep steps against the spec across configs (two processes: well under two minutes).
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import re

import pytest

from uniradix.conformance.adapters.base import ADAPTERS, SpecAdapter, args_of
from uniradix.conformance.explore import conform as conform_mod
from uniradix.conformance.explore.lockstep import (
    DIVERGENCE,
    VIOLATION,
    Lockstep,
    LockstepError,
    first_difference,
    renumber,
    shrink,
)
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec import cache as rules
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import Unsupported
from uniradix.spec.state import all_nodes

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from uniradix.conformance.explore.machine import draw_device_config, make_machine  # noqa: E402

OTHER_IMPLS = sorted(k for k in ADAPTERS if k != "spec")


# ----------------------------------------------------------------------------------------------
# Deliberately broken adapters (one bug each)
# ----------------------------------------------------------------------------------------------


class MatchOneFewer(SpecAdapter):
    """match_prefix reports one device slot fewer (an observation bug)."""

    def op_match_prefix(self, step):
        obs = super().op_match_prefix(step)
        if obs["device_indices"]:
            obs["device_indices"] = obs["device_indices"][:-1]
        return obs


class EvictIgnoresLocks(SpecAdapter):
    """evict takes the oldest device leaf whether or not it is locked."""

    def op_evict(self, step):
        (n,) = args_of(step, "num_tokens")
        rules.check_count("num_tokens", n)
        st = self.state
        freed = 0
        while not st.config.disable and freed < n:
            leaves = [x for x in all_nodes(st) if not x.is_root and x.value is not None
                      and all(c.value is None for c in x.children.values())]
            if not leaves:
                break
            freed += rules.evict_device_leaf(st, min(leaves, key=lambda x: x.stamp))
        return {"num_tokens_evicted": freed, "freed": st.kv.take_freed()}


class UnlockLeaksTopLock(SpecAdapter):
    """unlock leaves one lock behind on the topmost node of a path of two or more nodes
    (a state bug its own invariants notice)."""

    def op_unlock(self, step):
        obs = super().op_unlock(step)
        h = self.handles.get(step["args"]["handle"])
        nodes = h.locked_nodes() if h is not None else []
        if len(nodes) >= 2:
            nodes[-1].lock_ref += 1
        return obs


class MatchDoesNotTouch(SpecAdapter):
    """match_prefix does not refresh access stamps (seen first in the snapshot's LRU order)."""

    def op_match_prefix(self, step):
        saved = [(n, n.stamp) for n in all_nodes(self.state)]
        obs = super().op_match_prefix(step)
        for n, stamp in saved:
            n.stamp = stamp
        return obs


BROKEN = {"broken-match": MatchOneFewer, "broken-evict": EvictIgnoresLocks,
          "broken-unlock": UnlockLeaksTopLock, "broken-lru": MatchDoesNotTouch}


def test_broken_adapters_override_real_adapter_methods():
    """Guard against an adapter refactor silently turning a broken adapter into the spec."""
    for cls in BROKEN.values():
        own = [k for k in vars(cls) if k.startswith("op_")]
        assert own and all(callable(getattr(SpecAdapter, k, None)) for k in own), cls


@pytest.fixture
def broken_registered(monkeypatch):
    for name, cls in BROKEN.items():
        monkeypatch.setitem(ADAPTERS, name, cls)
    return BROKEN


# ----------------------------------------------------------------------------------------------
# The runner itself
# ----------------------------------------------------------------------------------------------


def test_first_difference_names_nodes_by_path():
    a = {"nodes": [{"path": {"tokens": [1], "extra_key": None}, "lock_ref": 0},
                   {"path": {"tokens": [1, 2], "extra_key": None}, "lock_ref": 1}],
         "sizes": {"full_evictable": 1}}
    b = {"nodes": [{"path": {"tokens": [1], "extra_key": None}, "lock_ref": 0},
                   {"path": {"tokens": [1, 2], "extra_key": None}, "lock_ref": 2}],
         "sizes": {"full_evictable": 1}}
    assert first_difference(a, a) is None
    assert first_difference(a, b) == ("nodes[extra_key=None tokens=[1, 2]].lock_ref", 1, 2)
    c = {"nodes": a["nodes"][:1], "sizes": a["sizes"]}
    path, va, vb = first_difference(a, c)
    assert path == "nodes[extra_key=None tokens=[1, 2]]" and vb == "<missing>"
    assert first_difference({"freed": [1, 2]}, {"freed": [1, 3]}) == ("freed[1]", 2, 3)


def test_rejected_step_compares_error_type_only_and_state():
    ls = Lockstep.from_impls(["spec", "spec"], CacheConfig(kv_slots=16))
    ls.prime()
    obs = ls.apply({"i": 0, "op": "unlock", "args": {"handle": 7}})
    assert obs["error"] == "HandleError"
    assert ls.apply({"i": 1, "op": "alloc", "args": {"n": 2}}) == {"slots": [1, 2]}


def test_a_rejection_on_one_side_only_is_a_divergence():
    class RejectsSizes(SpecAdapter):
        def op_sizes(self, step):
            raise rules.InvalidInput("no")

    ls = Lockstep.from_impls(["spec", RejectsSizes], CacheConfig(kv_slots=16))
    with pytest.raises(LockstepError) as e:
        ls.apply({"i": 0, "op": "sizes", "args": {}})
    f = e.value.finding
    assert (f.kind, f.where, f.step, f.op) == (DIVERGENCE, "rejection", 0, "sizes")
    assert f.values["RejectsSizes"]["error"] == "InvalidInput"


def test_a_rejected_step_that_changes_state_is_found():
    class EvictsThenRejects(SpecAdapter):
        def op_evict(self, step):
            rules.evict(self.state, 1)  # a side effect before the input check
            return super().op_evict(step)

    ls = Lockstep.from_impls(["spec", EvictsThenRejects], CacheConfig(kv_slots=16))
    ls.prime()
    ls.apply({"i": 0, "op": "alloc", "args": {"n": 2}})
    ls.apply({"i": 1, "op": "insert", "args": {"tokens": [1, 2], "value": [1, 2]}})
    f = ls.check({"i": 2, "op": "evict", "args": {"num_tokens": -1}})[1]
    assert (f.kind, f.where, f.impls) == (DIVERGENCE, "unchanged", ("EvictsThenRejects",))
    assert f.path == "nodes[extra_key=None tokens=[1, 2]]"


def test_crash_is_a_finding():
    class Crashes(SpecAdapter):
        def op_sizes(self, step):
            raise ZeroDivisionError("boom")

    ls = Lockstep.from_impls(["spec", Crashes], CacheConfig(kv_slots=16))
    f = ls.check({"i": 0, "op": "sizes", "args": {}})[1]
    assert f.kind == VIOLATION and f.where == "crash" and f.impls == ("Crashes",)


def test_a_crash_is_written_as_a_trace_that_replays_it(tmp_path):
    """A crash (upstream's own assertions) is a finding: writing its trace re-runs the steps
    on the crashing implementation, which must not take the writer down with it."""
    class CrashesOnSizes(SpecAdapter):
        def op_sizes(self, step):
            raise AssertionError("upstream's own assertion")

    steps = [{"i": 0, "op": "alloc", "args": {"n": 2}}, {"i": 1, "op": "sizes", "args": {}}]
    path = conform_mod.write_finding_trace(str(tmp_path), "crash", ["spec", CrashesOnSizes],
                                           CacheConfig(kv_slots=16), steps, source="test")
    trace = load_trace(path)
    assert [s["op"] for s in trace.steps] == ["alloc", "sizes"]
    assert "probes_appended" not in trace.header


def test_renumber_keeps_handles_valid_or_makes_them_unknown():
    steps = [{"i": 3, "op": "lock", "args": {"node": {"tokens": [], "extra_key": None}}},
             {"i": 5, "op": "unlock", "args": {"handle": 3}},
             {"i": 9, "op": "unlock", "args": {"handle": 4}}]
    out = renumber(steps)
    assert [s["i"] for s in out] == [0, 1, 2]
    assert out[1]["args"]["handle"] == 0
    assert out[2]["args"]["handle"] < 0  # step 4 was dropped: never issued


# ----------------------------------------------------------------------------------------------
# spec against spec: nothing to find
# ----------------------------------------------------------------------------------------------


def test_spec_vs_spec_random_lockstep_across_configs_is_clean():
    # 8 segments of 500 steps: one per named config (full-p1/p2/p4, eagle-p1/p4, disable,
    # swa, mamba)
    res = conform_mod.run_conform(["spec", "spec"], steps=4000, seed=11, out=None,
                                  segment_steps=500, progress=False, log=lambda m: None)
    assert res.finding is None, str(res.finding)
    assert (res.steps, res.segments) == (4000, 8)


def test_spec_vs_spec_machine_is_clean():
    Machine = make_machine(["spec", "spec"])
    run_state_machine_as_test(Machine, settings=settings(
        max_examples=25, stateful_step_count=60, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


# ----------------------------------------------------------------------------------------------
# Broken adapters are found; the shrunk trace replays the finding
# ----------------------------------------------------------------------------------------------


def assert_trace_reproduces(path: str, broken: str) -> None:
    trace = load_trace(path)
    assert "shrunk" in trace.header["source"] or "machine" in trace.header["source"]
    assert len(trace.steps) <= 30, f"{len(trace.steps)} steps"
    assert all("ret" in s for s in trace.steps)
    clean = replay_trace(trace, "spec")
    assert clean.divergence is None, str(clean.divergence)
    bad = replay_trace(trace, broken)
    assert bad.divergence is not None, f"{broken} replays {path} clean"


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_conform_finds_broken_adapter_and_writes_short_trace(broken, broken_registered, tmp_path):
    # no shrink time cap (a deterministic result whatever the load; the shrinker stops by itself)
    res = conform_mod.run_conform(["spec", broken], steps=20_000, seed=3, out=str(tmp_path),
                                  progress=False, shrink_seconds=math.inf, log=lambda m: None)
    assert res.finding is not None, f"{broken} not found in {res.steps} steps"
    assert res.trace_path is not None and os.path.exists(res.trace_path)
    assert os.path.dirname(res.trace_path) == str(tmp_path)
    assert_trace_reproduces(res.trace_path, broken)
    header = load_trace(res.trace_path).header
    assert header["finding"]["impls"][0] == "spec"


@pytest.mark.parametrize("broken", ["broken-match", "broken-evict", "broken-unlock"])
def test_machine_finds_broken_adapter(broken, broken_registered, tmp_path):
    """The machine finds the bug (generation only, no Hypothesis shrinking: that takes
    minutes); the failing run, written as a trace, shrinks with the lockstep shrinker. The
    broken adapters break device-tier rules, so the runs draw device-tier configs."""
    path = str(tmp_path / "machine.jsonl")
    Machine = make_machine(["spec", broken], trace_path=path, draw=draw_device_config)
    with pytest.raises(LockstepError) as e:
        run_state_machine_as_test(Machine, settings=settings(
            max_examples=300, stateful_step_count=60, deadline=None, database=None,
            derandomize=True, phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck)))
    finding = e.value.finding
    trace = load_trace(path)
    assert trace.steps[-1]["i"] == finding.step
    # no wall-clock cap (a cap makes the result depend on the machine's load): the shrinker
    # stops by itself (a round ending at single-step chunks that drop nothing), and on
    # this derandomized run its work is a fixed number of trials (14, 23 and 47 here)
    sr = shrink(["spec", broken], trace.config, trace.steps, finding, max_seconds=math.inf)
    assert sr.trials <= 100, sr.trials
    assert len(sr.steps) <= 30
    assert sr.finding.signature() == finding.signature() or sr.finding.op == finding.op
    conform_mod.write_finding(str(tmp_path), ["spec", broken], ["spec", broken], trace.config,
                              "machine", 0, 0, sr.steps, sr.finding)
    written = [p for p in os.listdir(tmp_path) if p.startswith("conform-machine")]
    assert len(written) == 1
    assert_trace_reproduces(str(tmp_path / written[0]), broken)


@pytest.mark.slow
def test_machine_shrinks_broken_match_with_hypothesis(broken_registered, tmp_path):
    path = str(tmp_path / "machine.jsonl")
    Machine = make_machine(["spec", "broken-match"], trace_path=path)
    with pytest.raises(LockstepError):
        run_state_machine_as_test(Machine, settings=settings(
            max_examples=200, stateful_step_count=60, deadline=None, database=None,
            derandomize=True, suppress_health_check=list(HealthCheck)))
    trace = load_trace(path)
    # alloc, insert, match_prefix (+ a few steps Hypothesis's shrinker leaves in)
    assert len(trace.steps) <= 10
    assert replay_trace(trace, "broken-match").divergence is not None


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------

SUMMARY = re.compile(r"^conform: (\d+) steps, (\d+) divergences, (\d+) violations$")


def test_conform_cli_clean_run_last_line(capsys):
    rc = conform_mod.main(["conform", "--impls", "spec,spec", "--steps", "400", "--seed", "2",
                           "--config", "eagle-p4", "--no-progress"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert lines[-1] == "conform: 400 steps, 0 divergences, 0 violations"


def test_conform_cli_json_config_and_seconds(capsys):
    rc = conform_mod.main(["conform", "--impls", "spec,spec", "--seconds", "0.5",
                           "--config", '{"page_size": 2, "kv_slots": 24}'])
    captured = capsys.readouterr()
    assert rc == 0
    m = SUMMARY.match(captured.out.strip().splitlines()[-1])
    assert m and int(m.group(1)) > 0 and m.group(2) == m.group(3) == "0"
    assert "steps/s" in captured.err  # the progress bar


def test_conform_cli_finding_writes_trace_and_exits_1(broken_registered, tmp_path, capsys):
    rc = conform_mod.main(["conform", "--impls", "spec,broken-match", "--steps", "5000",
                           "--out", str(tmp_path), "--no-progress"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 1
    m = SUMMARY.match(lines[-1])
    assert m and (m.group(2), m.group(3)) == ("1", "0")
    # the trace's path, then (when the run compared KV events) the events line
    rest = lines[:-1]
    if rest and rest[-1].startswith("conform: KV events compared on "):
        rest = rest[:-1]
    path = rest[-1]
    assert path.startswith(str(tmp_path)) and path.endswith(".jsonl")
    assert_trace_reproduces(path, "broken-match")


def test_conform_cli_rejects_unknown_config():
    assert conform_mod.main(["conform", "--impls", "spec,spec", "--config", "nope"]) == 2


def test_record_shared_prefix_replays_clean(tmp_path, capsys):
    out = str(tmp_path / "sp.jsonl")
    assert conform_mod.main(["record", "--impl", "spec", "--workload", "shared-prefix",
                             "--steps", "6", "--seed", "4", "--out", out]) == 0
    trace = load_trace(out)
    assert trace.header["seed"] == 4 and "shared-prefix" in trace.header["source"]
    assert {s["op"] for s in trace.steps} >= {"req_arrive", "req_admit", "req_chunk", "req_finish"}
    assert replay_trace(trace, "spec").divergence is None


def test_record_random_replays_clean(tmp_path):
    pytest.importorskip("uniradix.conformance.explore.driver")
    out = str(tmp_path / "rnd.jsonl")
    assert conform_mod.main(["record", "--impl", "spec", "--workload", "random", "--steps", "150",
                             "--seed", "5", "--out", out]) == 0
    trace = load_trace(out)
    assert len(trace.steps) == 150
    assert replay_trace(trace, "spec").divergence is None


@pytest.mark.parametrize("config", ["hicache-wt-p1", "swa-w8-p1", "mamba-p1"])
def test_record_random_with_events_replays_with_its_events(tmp_path, capsys, config):
    out = str(tmp_path / "ev.jsonl")
    assert conform_mod.main(["record", "--impl", "spec", "--workload", "random", "--steps", "120",
                             "--seed", "6", "--config", config, "--events", "--out", out]) == 0
    trace = load_trace(out)
    n = sum(len(s["events"]) for s in trace.steps)
    assert capsys.readouterr().out.strip().endswith(f"120 steps, {n} events")
    assert trace.header["event_key_mode"] == "namespaced" and n > 0
    result = replay_trace(trace, "spec")
    assert result.divergence is None and result.events_compared == 120
    # a changed event is a divergence of the replay
    step = next(s for s in trace.steps if s["events"])
    step["events"] = step["events"][1:]
    assert replay_trace(trace, "spec").divergence is not None


def test_record_events_refused_where_there_are_none(tmp_path, capsys, monkeypatch):
    from uniradix.conformance.adapters.fast_adapter import FastAdapter

    monkeypatch.setattr(FastAdapter, "emits_kv_events", False)  # (fast emits them: issue 17)
    out = str(tmp_path / "x.jsonl")
    assert conform_mod.main(["record", "--impl", "fast", "--workload", "random", "--steps", "5",
                             "--events", "--out", out]) == 2
    assert "fast emits no KV events" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert conform_mod.main(["record", "--impl", "spec", "--workload", "shared-prefix",
                             "--steps", "2", "--events", "--out", out]) == 2
    assert not os.path.exists(out)


# ----------------------------------------------------------------------------------------------
# Every registered implementation against the spec (fast, once it is registered)
# ----------------------------------------------------------------------------------------------

FAST_STEPS = 20_000


def _req(op, **args) -> dict:
    return {"op": op, "args": args}


@pytest.mark.parametrize("eagle", [False, True])
def test_requests_reusing_a_row_lockstep_spec_fast(eagle):
    """Request rows are reused (the fast adapter's req_to_token rows, lowest first) and only
    the computed positions are written, as in SGLang: a finish, abort or disabled-cache free
    that read past the committed length would free the previous user's stale slots (pages
    the tree holds) and diverge from the spec."""
    from uniradix.conformance.explore.lockstep import run_steps
    steps = [
        _req("req_arrive", rid="a", tokens=[1, 2, 3, 4, 5, 6, 7, 8]), _req("req_admit", rid="a"),
        _req("req_chunk", rid="a", n=8, chunked=False), _req("req_finish", rid="a"),
        _req("req_arrive", rid="b", tokens=[9, 9, 9, 9, 7, 7]), _req("req_admit", rid="b"),
        _req("req_chunk", rid="b", n=6, chunked=False), _req("req_finish", rid="b"),
        _req("req_arrive", rid="c", tokens=[1, 2, 3, 4, 5, 6, 7, 8, 5, 5]),
        _req("req_admit", rid="c"), _req("req_chunk", rid="c", n=1), _req("req_decode", rid="c", n=1),
        _req("req_abort", rid="c"),
        _req("req_arrive", rid="d", tokens=[3, 3, 3, 3, 3, 3, 3]), _req("req_admit", rid="d"),
        _req("req_chunk", rid="d", n=5), _req("req_abort", rid="d"),
        _req("sizes"),
    ]
    for disable in (False, True):
        config = CacheConfig(page_size=4, kv_slots=64, eagle=eagle, disable=disable)
        finding = run_steps(["spec", "fast"], config, renumber(steps))
        assert finding is None, f"disable={disable}: {finding}"


def _conform_worker(impl: str, seed: int, steps: int, out: str) -> tuple:
    res = conform_mod.run_conform(["spec", impl], steps=steps, seed=seed, out=out,
                                  segment_steps=1000, progress=False, shrink_seconds=60,
                                  log=lambda m: None)
    return res.steps, str(res.finding) if res.finding else None, res.trace_path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", OTHER_IMPLS)
def test_registered_impl_matches_spec_in_lockstep(impl, tmp_path):
    """>= 20k lockstep steps, every named config, split over two processes."""
    jobs = 2
    per = FAST_STEPS // jobs
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as ex:
        futs = [ex.submit(_conform_worker, impl, 100 + k, per, str(tmp_path)) for k in range(jobs)]
        results = [f.result() for f in futs]
    for _steps, finding, path in results:
        assert finding is None, f"{finding}\nshrunk trace: {path}"
    assert sum(r[0] for r in results) >= FAST_STEPS


@pytest.mark.slow
@pytest.mark.parametrize("impl", OTHER_IMPLS)
def test_registered_impl_matches_spec_long(impl, tmp_path):
    res = conform_mod.run_conform(["spec", impl], steps=300_000, seed=7, out=str(tmp_path),
                                  progress=False, log=lambda m: None)
    assert res.finding is None, f"{res.finding}\nshrunk trace: {res.trace_path}"


@pytest.mark.slow
@pytest.mark.parametrize("impl", OTHER_IMPLS)
def test_registered_impl_machine(impl):
    run_state_machine_as_test(make_machine(["spec", impl]), settings=settings(
        max_examples=300, stateful_step_count=100, deadline=None,
        suppress_health_check=list(HealthCheck)))


# ----------------------------------------------------------------------------------------------
# Comparison rules a peer declares (what conform against upstream does and does not compare)
# ----------------------------------------------------------------------------------------------


class CountsHitsPeer(SpecAdapter):
    """Stands in for upstream 0.5.13.post1 in process: tree-level API only (request ops are
    unknown to it) and its own hit counts without a host tier, declared as not compared."""

    tree_only = True

    @property
    def uncompared_node_fields(self):
        return () if self.config.has_host_tier else ("hit_count",)

    def apply(self, step):
        if str(step.get("op", "")).startswith("req_"):
            return {"error": "UnknownOp"}
        return super().apply(step)

    def snapshot(self):
        snap = super().snapshot()
        for n in snap["nodes"]:
            n["hit_count"] = n["hit_count"] + len(n["path"]["tokens"])
        return snap


class CountsHitsUndeclared(CountsHitsPeer):
    """The same hit counts, not declared: a plain divergence."""

    uncompared_node_fields = ()


def _ops_seen(factory, seen):
    def build(config):
        a = factory(config)
        apply = a.apply

        def rec(step):
            seen.append(step["op"])
            return apply(step)
        a.apply = rec
        return a
    build.impl_name = getattr(factory, "impl_name", factory.__name__)
    return build


def test_conform_with_a_tree_only_peer_drives_tree_ops_and_skips_its_hit_counts(tmp_path):
    seen, logged = [], []
    res = conform_mod.run_conform(["spec", _ops_seen(CountsHitsPeer, seen)], config="full-p2",
                                  steps=3000, seed=4, out=str(tmp_path), progress=False,
                                  log=logged.append)
    assert res.finding is None, str(res.finding)
    assert seen and not [op for op in seen if op.startswith("req_")]
    assert "sizes" in seen and "lock" in seen
    text = "\n".join(logged)
    assert "request-level ops (req_*) are not generated" in text
    assert "hit_count not compared" in text
    # the same run with a peer that has the request API generates request ops (incl. misuses)
    seen2 = []
    conform_mod.run_conform(["spec", _ops_seen(SpecAdapter, seen2)], config="full-p2",
                            steps=3000, seed=4, out=None, progress=False, log=lambda m: None)
    assert {"req_arrive", "req_admit", "req_finish"} <= set(seen2)


def test_undeclared_hit_counts_diverge_and_the_rule_is_per_peer(tmp_path):
    res = conform_mod.run_conform(["spec", CountsHitsUndeclared], config="full-p1", steps=3000,
                                  seed=4, out=None, progress=False, log=lambda m: None)
    assert res.finding is not None and res.finding.field.endswith("hit_count")
    # spec vs the declaring peer is clean, but spec vs a third, undeclared one is still compared
    res = conform_mod.run_conform(["spec", CountsHitsPeer, CountsHitsUndeclared],
                                  config="full-p1", steps=3000, seed=4, out=None,
                                  progress=False, log=lambda m: None)
    assert res.finding is not None and res.finding.field.endswith("hit_count")
    assert res.finding.impls == ("spec", "CountsHitsUndeclared")


class _Fixed:
    """A minimal adapter whose snapshot is one node with the given hit count."""

    def __init__(self, config, hits, declare):
        self.config, self.hits = config, hits
        if declare:
            self.uncompared_node_fields = () if config.has_host_tier else ("hit_count",)

    def apply(self, step):
        return {}

    def snapshot(self):
        return {"nodes": [{"path": {"tokens": [1], "extra_key": None}, "lock_ref": 0,
                           "hit_count": self.hits}]}

    def violations(self):
        return []


@pytest.mark.parametrize("host_slots, found", [(0, False), (64, True)])
def test_hit_counts_are_compared_with_a_host_tier(host_slots, found):
    cfg = CacheConfig(page_size=1, kv_slots=16, host_slots=host_slots)
    ls = Lockstep([_Fixed(cfg, 0, False), _Fixed(cfg, 3, True)], ["spec", "peer"])
    _, finding = ls.check({"i": 0, "op": "sizes", "args": {}})
    assert (finding is not None) == found
    if found:
        assert finding.path.endswith("hit_count")


class EagleUnsupported(SpecAdapter):
    def __init__(self, config):
        if config.eagle:
            raise Unsupported("no eagle here")
        super().__init__(config)


def test_conform_skips_or_refuses_configs_a_peer_does_not_support(monkeypatch, capsys):
    monkeypatch.setitem(ADAPTERS, "no-eagle", EagleUnsupported)
    logged = []
    res = conform_mod.run_conform(["spec", "no-eagle"], steps=2000, seed=1, out=None,
                                  progress=False, log=logged.append, segment_steps=200)
    assert res.finding is None and res.steps == 2000 and res.segments == 10
    assert set(res.skipped_configs) == {"eagle-p1", "eagle-p4", "eagle-swa-p2", "eagle-mamba-p1"}
    assert any("skipping config eagle-p1: no-eagle: no eagle here" in m for m in logged)
    with pytest.raises(conform_mod.ConformUnsupported):
        conform_mod.run_conform(["spec", "no-eagle"], config="eagle-p1", steps=100, out=None,
                                progress=False, log=lambda m: None)
    rc = conform_mod.main(["conform", "--impls", "spec,no-eagle", "--config", "eagle-p4",
                           "--steps", "100", "--no-progress"])
    assert rc == 2
    assert "not run" in capsys.readouterr().err


def test_conform_counts_the_documented_held_tombstone_difference_and_nothing_else():
    """`conform --impls spec,upstream --config swa --seed 1` diverges at its step 1178: an insert
    over an SWA tombstone a lock holds (the issue-18 rule, docs/SPEC.md). conform counts such a
    divergence as a documented difference and goes on; the same step between spec and fast, or
    a divergence elsewhere, stays a divergence. The trace is that run, shrunk."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import ConformResult, documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions", "conform-swa-s1-upstream-held-tombstone.jsonl"))
    last = trace.steps[-1]
    finding = Finding(DIVERGENCE, last["i"], "insert", "observation", "freed[0]",
                      {"spec": 22, "upstream": 14}, ("spec", "upstream"), last["args"])
    assert "issue 18" in documented_difference(["spec", "upstream"], trace.config, trace.steps, finding)
    assert documented_difference(["spec", "fast"], trace.config, trace.steps, finding) is None
    earlier = trace.steps[:-1]
    other = Finding(DIVERGENCE, earlier[-1]["i"], earlier[-1]["op"], "observation", "x", {})
    assert documented_difference(["spec", "upstream"], trace.config, earlier, other) is None
    assert "1 documented" in ConformResult(steps=5, documented=1).summary()


def test_conform_compares_fast_on_its_c_core_every_other_segment(monkeypatch):
    """Events move a Full-only fast cache to the composed tree, so conform compares events with
    fast on even segments only and runs fast's C core in the odd ones."""
    from uniradix.conformance.explore import conform as conform_mod
    from uniradix.fast.cache import NATIVE
    cores = []
    real = conform_mod._build_segment_adapters

    def spy(impls, labels, cfg):
        adapters = real(impls, labels, cfg)
        cores.append(adapters)
        return adapters

    monkeypatch.setattr(conform_mod, "_build_segment_adapters", spy)
    res = conform_mod.run_conform(["spec", "fast"], config="full-p1", steps=400,
                                  segment_steps=100, seed=3, out=None, progress=False,
                                  log=lambda m: None)
    assert res.divergences == res.violations == 0 and res.segments == 4
    assert res.event_steps == 200  # segments 0 and 2
    fast_cores = [ads[1].cache.core for ads in cores]
    assert fast_cores == (["python", "c"] * 2 if NATIVE else ["python"] * 4)


@pytest.mark.parametrize("name", ["upstream-crash-hicache-wb-p4-unlock-after-split.jsonl",
                                  "upstream-crash-hicache-wb-p1-unlock-after-insert-split.jsonl"])
def test_conform_counts_upstreams_unlock_after_a_split_of_a_skipped_node(name):
    """docs/SPEC.md, "HiCache", the shared defects: a lock on an evicted node skips it; a later
    split (a match's in the p4 trace, an insert's in the p1 trace, found by conform
    spec,upstream on hicache-wb-p1, seed 2030) cuts the skipped node, and 0.5.13.post1's unlock
    then asserts on the new upper part.  conform counts upstream's crash at that unlock as the
    documented difference; the same steps without the split, a crash of the spec or fast, or a
    crash at another step are not."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import releases_after_split_of_skipped_node
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions", name))
    last = trace.steps[-1]
    assert last["op"] == "unlock"

    def crash(impl, step=last["i"], op="unlock"):
        return Finding(VIOLATION, step, op, "crash", "", {impl: "AssertionError: "}, (impl,))

    labels = ["spec", "upstream"]
    assert releases_after_split_of_skipped_node(trace, last["i"]) == [last["i"]]
    assert "never locked" in documented_difference(labels, trace.config, trace.steps,
                                                    crash("upstream"))
    assert documented_difference(labels, trace.config, trace.steps, crash("spec")) is None
    assert documented_difference(["spec", "fast"], trace.config, trace.steps,
                                 crash("fast")) is None
    split = max(i for i, s in enumerate(trace.steps)
                if s["op"] in ("match_prefix", "insert"))  # the step that splits
    assert split > [s["op"] for s in trace.steps].index("lock")
    unsplit = trace.steps[:split] + trace.steps[split + 1:]
    assert not releases_after_split_of_skipped_node(Trace(trace.header, trace.config, unsplit),
                                                    last["i"])
    assert documented_difference(labels, trace.config, unsplit, crash("upstream")) is None
    before = trace.steps[split]
    assert documented_difference(labels, trace.config, trace.steps,
                                 crash("upstream", before["i"], before["op"])) is None


def test_conform_counts_a_write_locks_release_after_a_split_of_a_skipped_swa_tombstone():
    """docs/SPEC.md, "SWA unlock skips the tombstones the lock skipped by node identity"
    (found by conform spec,upstream on host-swa-wt-p1, seed 2035): a write-through's lock skips
    SWA tombstones in its window; a load back gives one of them SWA data and locks it, a match
    splits it, and at the write's ack 0.5.13.post1 takes the load's SWA lock off the new upper
    part.  conform counts that divergence at the release as documented; the same steps without
    the split, a spec-fast divergence, or a divergence at the split itself are not."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import releases_after_split_of_skipped_node
    from uniradix.conformance.traces.trace import Trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        "upstream-host-swa-wt-p1-write-ack-after-split-of-a-skipped-tombstone.jsonl"))
    steps = [s for s in trace.steps if s["op"] != "sizes"]  # (without the probe)
    ack = steps[-1]
    assert ack["op"] == "check_hicache_events"
    field = "nodes[extra_key='a' tokens=[1, 2]].swa.lock_ref"

    def taken(labels=("spec", "upstream"), step=ack):
        return Finding(DIVERGENCE, step["i"], step["op"], "snapshot", field,
                       {labels[0]: 1, labels[1]: 0}, labels)

    assert releases_after_split_of_skipped_node(trace, ack["i"]) == [ack["i"]]
    said = documented_difference(["spec", "upstream"], trace.config, steps, taken())
    assert said is not None and "never locked" in said
    assert documented_difference(["spec", "fast"], trace.config, steps,
                                 taken(("spec", "fast"))) is None
    (split,) = [k for k, s in enumerate(steps) if s["op"] == "match_prefix"]
    assert documented_difference(["spec", "upstream"], trace.config, steps,
                                 taken(step=steps[split])) is None
    unsplit = steps[:split] + steps[split + 1:]
    assert not releases_after_split_of_skipped_node(Trace(trace.header, trace.config, unsplit),
                                                    ack["i"])
    assert documented_difference(["spec", "upstream"], trace.config, unsplit, taken()) is None


def test_conform_counts_upstreams_load_back_of_a_window_ending_at_a_tombstone():
    """docs/SPEC.md, "A load back whose window ends at an SWA tombstone" (found by conform
    spec,upstream on sessions-host-swa-p1, seed 2033): an insert with ``swa_evicted_seqlen``
    leaves the node above the leaf an SWA tombstone, an evict takes both to the host, and a
    load back of the leaf walks its window into the tombstone: 0.5.13.post1 asserts, the spec
    loads the window it has.  Counted as documented for upstream's crash only; without the
    tombstone (the insert given its whole window) neither the rule nor the count applies."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import load_back_window_ends_at_a_tombstone
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        "upstream-crash-sessions-host-swa-p1-load-back-window-ends-at-a-tombstone.jsonl"))
    last = trace.steps[-1]
    assert last["op"] == "load_back"

    def crash(impl):
        return Finding(VIOLATION, last["i"], "load_back", "crash", "AssertionError",
                       {impl: "AssertionError: "}, (impl,))

    labels = ["spec", "upstream"]
    assert load_back_window_ends_at_a_tombstone(trace, last["i"])
    assert "SWA window ends at a tombstone" in documented_difference(
        labels, trace.config, trace.steps, crash("upstream"))
    assert documented_difference(labels, trace.config, trace.steps, crash("spec")) is None
    assert not any(load_back_window_ends_at_a_tombstone(trace, s["i"]) for s in trace.steps[:-1])
    # the same load back before the evict: the node is on the device, nothing is loaded
    early = [s for s in trace.steps[:-1] if s["op"] != "evict"] + [last]
    assert not load_back_window_ends_at_a_tombstone(
        Trace(trace.header, trace.config, early), last["i"])
    whole = [dict(s, args={k: v for k, v in s["args"].items() if k != "swa_evicted_seqlen"})
             for s in trace.steps]
    assert whole != trace.steps
    assert not load_back_window_ends_at_a_tombstone(
        Trace(trace.header, trace.config, whole), last["i"])
    assert documented_difference(labels, trace.config, whole, crash("upstream")) is None


def test_conform_counts_a_split_of_a_host_locked_swa_copy():
    """docs/SPEC.md, "A split of a host-locked SWA copy" (found by conform spec,upstream on
    sessions-host-swa-p1, seed 2034): a host lock holds a node's SWA host copy and an insert
    splits the node; the spec's upper part keeps the lock's count, 0.5.13.post1's loses it.
    Counted for a host field from the split on; not before it, not for another field, and not
    without the host lock."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import split_of_a_host_locked_swa_copy
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        "conform-sessions-host-swa-p1-split-of-a-host-locked-swa-copy.jsonl"))
    last = trace.steps[-1]
    assert last["op"] == "insert"
    path = "host.nodes[extra_key='a' tokens=[4, 4, 2, 3, 2]].swa.host_lock_ref"

    def div(step, where_path):
        return Finding(DIVERGENCE, step, "insert", "snapshot", where_path,
                       {"spec": 1, "upstream": 0}, ("spec", "upstream"))

    labels = ["spec", "upstream"]
    assert split_of_a_host_locked_swa_copy(trace, last["i"])
    assert not split_of_a_host_locked_swa_copy(trace, last["i"] - 1)
    assert "loses the host lock" in documented_difference(labels, trace.config, trace.steps,
                                                          div(last["i"], path))
    assert documented_difference(labels, trace.config, trace.steps,
                                 div(last["i"], "nodes[extra_key='a' tokens=[4]].lock_ref")) is None
    assert documented_difference(["spec", "fast"], trace.config, trace.steps,
                                 div(last["i"], path)) is None
    # an insert elsewhere while the host lock holds: no split, nothing counted
    elsewhere = trace.steps[:-1] + [{"i": last["i"], "op": "insert", "args": {
        "tokens": [9, 9], "extra_key": "a", "value": [12, 14], "prev_prefix_len": 0,
        "chunked": False}}]
    assert not split_of_a_host_locked_swa_copy(Trace(trace.header, trace.config, elsewhere),
                                               last["i"])
    unlocked = [s for s in trace.steps if s["op"] != "host_lock"]
    assert not split_of_a_host_locked_swa_copy(Trace(trace.header, trace.config, unlocked),
                                               last["i"])


def test_conform_counts_a_hit_on_a_split_node_upstream_backs_up_sooner():
    """docs/SPEC.md, HiCache (found by conform spec,upstream-requests on hicache-wt, seed 11):
    under ``lru`` with write_through_selective at threshold 2, 0.5.13.post1's split copies the
    leaf's one hit to the new upper node, so the next insert through it backs it up (and holds
    the write lock); the spec's upper node starts at 0 and stays below the threshold.  Counted
    at that insert only; not at threshold 1, not under a policy whose hits the spec copies
    too, not without the first hit, not under write-back."""
    import dataclasses

    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import split_hit_count_reaches_threshold
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions", "upstream-hicache-wt-selective-split-copies-hit-count.jsonl"))
    ins = [s for s in trace.steps if s["op"] == "insert"]
    assert len(ins) == 2 and trace.config.write_through_threshold == 2
    at = ins[-1]["i"]
    div = Finding(DIVERGENCE, at, "insert", "snapshot",
                  "nodes[extra_key='b' tokens=[2, 1, 3]].lock_ref",
                  {"spec": 0, "upstream": 1}, ("spec", "upstream"))
    labels = ["spec", "upstream"]
    assert split_hit_count_reaches_threshold(trace, at)
    assert not split_hit_count_reaches_threshold(trace, ins[0]["i"])
    assert not split_hit_count_reaches_threshold(trace, at + 1)  # (the sizes step after it)
    assert "copies the lower part's hit count" in documented_difference(labels, trace.config,
                                                                        trace.steps, div)
    assert documented_difference(["spec", "fast"], trace.config, trace.steps, div) is None
    for other in (dict(write_through_threshold=1), dict(eviction_policy="lfu"),
                  dict(write_policy="write_back")):
        cfg = dataclasses.replace(trace.config, **other)
        assert not split_hit_count_reaches_threshold(Trace(trace.header, cfg, trace.steps), at)
    # the first insert chunked: it counts no hit, so the split passes nothing on
    chunked = [dict(s, args=dict(s["args"], chunked=True)) if s is ins[0] else s
               for s in trace.steps]
    assert not split_hit_count_reaches_threshold(Trace(trace.header, trace.config, chunked), at)


def test_conform_counts_upstreams_mamba_load_back_without_a_state_slot():
    """docs/SPEC.md, "A Mamba load back with no device state to be had": the caller holds every
    device state slot (found by conform spec,upstream on host-mamba-wb-p4, seed 2030), so the
    spec loads nothing where 0.5.13.post1 asserts (``Cannot alloc mamba for load_back``).
    conform counts that assertion as documented; with one slot free the load back happens and
    the same crash is not counted, nor another crash message, nor a crash of the spec's."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import load_back_without_a_state_slot
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        "upstream-crash-host-mamba-wb-p4-load-back-with-every-state-slot-the-callers.jsonl"))
    last = trace.steps[-1]
    assert last["op"] == "load_back"

    def crash(impl, message="AssertionError: Cannot alloc mamba for load_back"):
        return Finding(VIOLATION, last["i"], "load_back", "crash", "AssertionError",
                       {impl: message}, (impl,))

    labels = ["spec", "upstream"]
    assert load_back_without_a_state_slot(trace, last["i"])
    assert "no device state slot" in documented_difference(labels, trace.config, trace.steps,
                                                           crash("upstream"))
    assert documented_difference(labels, trace.config, trace.steps,
                                 crash("upstream", "AssertionError: ")) is None
    assert documented_difference(labels, trace.config, trace.steps, crash("spec")) is None
    # one state slot fewer taken by the caller: the load back has its slot
    allocs = [k for k, s in enumerate(trace.steps) if s["op"] == "mamba_alloc"]
    freer = trace.steps[:allocs[-1]] + trace.steps[allocs[-1] + 1:]
    assert not load_back_without_a_state_slot(Trace(trace.header, trace.config, freer), last["i"])
    assert documented_difference(labels, trace.config, freer, crash("upstream")) is None


@pytest.mark.parametrize("component,path,node", [
    ("mamba", "regressions/host-locked-mamba-state-host-lru.jsonl",
     {"tokens": [2, 1, 2, 3], "extra_key": "b"}),
    ("swa", "regressions-host-aux/host-locked-swa-copy-host-lru-host-swa-wb-p4.jsonl",
     {"tokens": [4, 4, 2, 4], "extra_key": "a"})])
def test_conform_counts_a_host_locked_copy_upstream_lists_after_an_evict(component, path, node):
    """docs/SPEC.md, "Host locks": upstream lists a host-locked Mamba state or SWA copy that an
    evict leaves on the host only in that component's host LRU list, the spec does not.
    conform counts upstream's extra entry as documented, for that component's list only, and
    not once the host lock is gone from the steps."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(os.path.join(CORPUS, *path.split("/")))
    step = trace.steps[-1]["i"]
    labels = ["spec", "upstream"]

    def listed(comp):
        return Finding(DIVERGENCE, step, "evict", "snapshot", f"host.{comp}_host_lru_order[0]",
                       {"spec": "<missing>", "upstream": node}, ("spec", "upstream"))

    assert documented_difference(labels, trace.config, trace.steps, listed(component))
    other = "swa" if component == "mamba" else "mamba"
    assert documented_difference(labels, trace.config, trace.steps, listed(other)) is None
    unlocked = [s for s in trace.steps if s["op"] != "host_lock"]
    assert documented_difference(labels, trace.config, unlocked, listed(component)) is None


def test_conform_counts_upstreams_crash_at_a_full_load_back_that_evicted_its_node():
    """docs/SPEC.md, "HiCache", the shared defects: under write-back a load back's room-making
    backs a device leaf up, and that backup's host room takes the node being loaded off the
    host; the spec (and fast) load nothing, 0.5.13.post1 fails on the node's missing host copy
    (a TypeError; conform spec,upstream met it on hicache-wb-p1, seed 2030, segment 99).
    conform counts that crash as documented; with host room to spare the load back happens
    and the same crash is not counted."""
    import dataclasses

    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import load_back_lost_its_host_state
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions",
                                    "hicache-load-back-evicts-itself-from-host.jsonl"))
    (step,) = [s["i"] for s in trace.steps if s["op"] == "load_back"]
    crash = Finding(VIOLATION, step, "load_back", "crash", "TypeError",
                    {"upstream": "TypeError: object of type 'NoneType' has no len()"},
                    ("upstream",))
    labels = ["spec", "upstream"]
    assert load_back_lost_its_host_state(trace, step)
    assert "took the node" in documented_difference(labels, trace.config, trace.steps, crash)
    roomy = dataclasses.replace(trace.config, host_slots=8)
    steps = [{k: v for k, v in s.items() if k != "ret"} for s in trace.steps]
    assert not load_back_lost_its_host_state(Trace(trace.header, roomy, steps), step)
    assert documented_difference(labels, roomy, steps, crash) is None


def test_conform_counts_a_device_leaf_upstream_leaves_out_after_an_unlock():
    """docs/SPEC.md, "HiCache", the shared defects: with SWA and a host tier, a lock on an
    evicted node locks the device node above it; at the unlock 0.5.13.post1's Full release
    re-checks that node's leaf status while SWA still holds its lock, and the final re-check
    covers only the evicted node, so the device leaf stays out of upstream's evictable leaf set
    (conform spec,upstream met it on sessions-host-swa-p1, seed 2030, after 205,930 steps).
    conform counts the spec's extra leaf as documented; a lock on the device node itself, or
    another node in the finding, is not."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import unlock_left_a_device_leaf_out
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions-host-aux",
                                    "upstream-leaf-left-out-after-unlock-host-swa-p1.jsonl"))
    last = trace.steps[-1]
    assert last["op"] == "unlock"
    leaf = {"tokens": [1], "extra_key": None}

    def missing(node, labels=("spec", "upstream")):
        return Finding(DIVERGENCE, last["i"], "unlock", "snapshot", "device_leaf_order[0]",
                       {labels[0]: node, labels[1]: "<missing>"}, labels)

    labels = ["spec", "upstream"]
    assert unlock_left_a_device_leaf_out(trace, last["i"], leaf)
    assert "evictable leaf set" in documented_difference(labels, trace.config, trace.steps,
                                                         missing(leaf))
    other = {"tokens": [1, 1], "extra_key": None}
    assert documented_difference(labels, trace.config, trace.steps, missing(other)) is None
    unlocked = {"tokens": [1, 1, 1, 2], "extra_key": None}  # below the handle's node
    assert not unlock_left_a_device_leaf_out(trace, last["i"], unlocked)
    assert documented_difference(["spec", "fast"], trace.config, trace.steps,
                                 missing(leaf, ("spec", "fast"))) is None
    direct = [dict(s, args={"node": leaf}) if s["op"] == "lock" else s for s in trace.steps]
    assert not unlock_left_a_device_leaf_out(Trace(trace.header, trace.config, direct),
                                             last["i"], leaf)
    assert documented_difference(labels, trace.config, direct, missing(leaf)) is None


def test_conform_counts_a_device_leaf_upstream_leaves_out_after_a_load_back_that_gave_up():
    """The same shared defect through a load back (conform spec,upstream met it on
    host-swa-wt-p1, seed 2035, segment 665): the load back locks the path of the evicted node
    it is to load, cannot take the SWA slots for its window, and releases the lock; the device
    node above, now unlocked with only evicted children, stays out of 0.5.13.post1's evictable
    leaf set.  conform counts the spec's extra leaf as documented; not another node, the
    evicted node itself, a spec-fast finding, or the node above when a lock of its own still
    holds it."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import unlock_left_a_device_leaf_out
    from uniradix.conformance.traces.trace import Trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        "upstream-violation-host-swa-wt-p1-load-back-leaves-a-device-leaf-out.jsonl"))
    last = trace.steps[-1]
    assert last["op"] == "load_back" and last["ret"]["device_indices"] == []
    leaf = {"tokens": [3, 2], "extra_key": None}

    def missing(node, labels=("spec", "upstream"), op="load_back"):
        return Finding(DIVERGENCE, last["i"], op, "snapshot", "device_leaf_order[0]",
                       {labels[0]: node, labels[1]: "<missing>"}, labels)

    labels = ["spec", "upstream"]
    assert unlock_left_a_device_leaf_out(trace, last["i"], leaf)
    said = documented_difference(labels, trace.config, trace.steps, missing(leaf))
    assert "load back that gave up" in said and "evictable leaf set" in said
    assert not unlock_left_a_device_leaf_out(trace, last["i"], {"tokens": [1], "extra_key": None})
    assert documented_difference(labels, trace.config, trace.steps,
                                 missing({"tokens": [1], "extra_key": None})) is None
    assert documented_difference(["spec", "fast"], trace.config, trace.steps,
                                 missing(leaf, ("spec", "fast"))) is None
    # the evicted node the load back is to load, not the device node above it
    assert not unlock_left_a_device_leaf_out(trace, last["i"], last["args"]["node"])
    # a lock of its own on the node above: the load back's release leaves it locked
    held = trace.steps[:-1] + [{"i": last["i"], "op": "lock", "args": {"node": leaf}},
                               dict(last, i=last["i"] + 1)]
    assert not unlock_left_a_device_leaf_out(Trace(trace.header, trace.config, held),
                                             last["i"] + 1, leaf)


def test_conform_counts_the_later_effects_of_upstreams_unlock_after_a_split():
    """The same shared defect where the split's upper part is on the device again by the
    unlock (a load back, tests/corpus/regressions/hicache-unlock-after-split-of-skipped-node.jsonl;
    an insert over the evicted part in conform spec,upstream's hicache-wb-p1 run, seed 2031):
    upstream takes the load's lock count at the unlock (a lock_ref divergence there, no
    crash) and the load's release asserts later, in check_hicache_events.  conform counts
    both; without the match that splits, neither."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, VIOLATION, Finding
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions",
                                    "hicache-unlock-after-split-of-skipped-node.jsonl"))
    (unlock,) = [s["i"] for s in trace.steps if s["op"] == "unlock"]
    release = [s["i"] for s in trace.steps if s["op"] == "check_hicache_events"][-1]
    taken = Finding(DIVERGENCE, unlock, "unlock", "snapshot",
                    "nodes[extra_key=None tokens=[1, 2]].lock_ref", {"spec": 1, "upstream": 0},
                    ("spec", "upstream"))
    crash = Finding(VIOLATION, release, "check_hicache_events", "crash", "AssertionError",
                    {"upstream": "AssertionError: "}, ("upstream",))
    labels = ["spec", "upstream"]
    for finding in (taken, crash):
        assert "never locked" in documented_difference(labels, trace.config, trace.steps, finding)
    unsplit = [s for s in trace.steps if s["op"] != "match_prefix"]
    for finding in (taken, crash):
        assert documented_difference(labels, trace.config, unsplit, finding) is None


def test_conform_counts_upstreams_unlock_after_an_insert_revived_the_split_part():
    """conform spec,upstream on hicache-wb-p1, seed 2031 (shrunk to 16 steps): a lock on an
    evicted node; an insert splits it and puts the upper part back on the device, a second
    lock holds that part; the first lock's unlock in 0.5.13.post1 takes the second lock's
    count (lock_ref 0 where the spec keeps 1).  conform counts it; without the splits after
    the lock, not."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(os.path.join(
        CORPUS, "regressions",
        "upstream-hicache-wb-p1-unlock-takes-a-lock-after-insert-revives-split-part.jsonl"))
    (first_lock, _), unlock = [s["i"] for s in trace.steps if s["op"] == "lock"], \
        next(s["i"] for s in trace.steps if s["op"] == "unlock")
    taken = Finding(DIVERGENCE, unlock, "unlock", "snapshot",
                    "nodes[extra_key='a' tokens=[3]].lock_ref", {"spec": 1, "upstream": 0},
                    ("spec", "upstream"))
    labels = ["spec", "upstream"]
    assert documented_difference(labels, trace.config, trace.steps, taken)
    unsplit = [s for s in trace.steps
               if s["i"] <= first_lock or s["op"] not in ("insert", "match_prefix", "lock")]
    assert documented_difference(labels, trace.config, unsplit, taken) is None


def test_a_step_past_the_step_timeout_is_a_hang_finding():
    """conform --step-timeout: an implementation that does not answer a step in time is
    stopped and reported as a crash (StepTimeout) of that implementation; within the time, or
    with no limit set, nothing is reported."""
    import time

    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.explore.lockstep import VIOLATION, Lockstep, step_timeout
    from uniradix.spec.config import CacheConfig

    class Slow:
        def __init__(self, inner, seconds):
            self.inner, self.seconds = inner, seconds

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def apply(self, step):
            if step["op"] == "evict":
                time.sleep(self.seconds)
            return self.inner.apply(step)

    cfg = CacheConfig(page_size=1, kv_slots=16)
    steps = [{"i": 0, "op": "alloc", "args": {"n": 2}},
             {"i": 1, "op": "evict", "args": {"num_tokens": 1}}]

    def run(seconds, limit):
        ls = Lockstep([make_adapter("spec", cfg), Slow(make_adapter("spec", cfg), seconds)],
                      ["spec", "slow"], events=False)
        with step_timeout(limit):
            return [ls.check(s)[1] for s in steps]

    t0 = time.monotonic()
    _, hung = run(30, 0.2)
    assert time.monotonic() - t0 < 10
    assert hung is not None and hung.kind == VIOLATION and hung.where == "crash"
    assert hung.impls == ("slow",) and hung.values["slow"].startswith("StepTimeout")
    assert run(0.05, 5) == [None, None]
    assert run(0.05, None) == [None, None]
    with pytest.raises(ValueError):
        with step_timeout(0):
            pass


@pytest.mark.parametrize("name", ["upstream-hang-host-mamba-wb-p1-evict-backup-fails.jsonl",
                                  "upstream-hang-host-swa-wb-p1-evict-backup-fails.jsonl"])
def test_conform_counts_upstreams_hang_in_a_write_back_aux_eviction(name):
    """docs/SPEC.md, "Write-back eviction that cannot back its victim up": upstream's SWA /
    Mamba eviction takes a leaf whose backup fails again and again; the spec passes it over.
    conform (with its step timeout) counts upstream's hang at that evict as documented, and
    nothing else: another step, another crash, or a hang of the spec's."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import aux_evict_passes_over_a_leaf
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions-host-aux", name))
    last = trace.steps[-1]
    assert last["op"] == "evict"

    def crash(impl, message="StepTimeout: no answer within 20 s (a hang)", step=last["i"]):
        return Finding(VIOLATION, step, "evict", "crash", message.split(":")[0],
                       {impl: message}, (impl,))

    labels = ["spec", "upstream"]
    assert aux_evict_passes_over_a_leaf(trace, last["i"])
    assert not any(aux_evict_passes_over_a_leaf(trace, s["i"]) for s in trace.steps[:-1])
    assert "hang" in documented_difference(labels, trace.config, trace.steps, crash("upstream"))
    assert documented_difference(labels, trace.config, trace.steps,
                                 crash("upstream", "AssertionError: ")) is None
    assert documented_difference(labels, trace.config, trace.steps, crash("spec")) is None
    assert documented_difference(labels, trace.config, trace.steps,
                                 crash("upstream", step=trace.steps[-2]["i"])) is None


@pytest.mark.parametrize("name", [
    "upstream-violation-host-swa-wt-p1-host-lock-of-an-evicted-leaf.jsonl",
    "upstream-violation-host-mamba-wt-p1-host-lock-of-an-evicted-leaf.jsonl",
    "upstream-violation-host-swa-wt-p1-host-lock-window-takes-a-host-only-copy.jsonl"])
def test_conform_counts_upstreams_check_after_a_host_lock_of_host_only_aux_data(name):
    """docs/SPEC.md, "Host locks": a host lock that takes a node's aux data where it is on the
    host only (the locked node's own, or with SWA a node in the window of host copies above it:
    the third trace, written by hand after conform spec,upstream, seed 2031, met it on
    sessions-host-swa-p1) makes upstream's own sanity check fail.  conform counts that
    violation as documented; without the evict that left the data host-only, not."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import VIOLATION, Finding
    from uniradix.conformance.traces.replay import host_lock_on_host_only_aux
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions-host-aux", name))
    last = trace.steps[-1]
    assert last["op"] == "host_lock"
    check = Finding(VIOLATION, last["i"], "host_lock", "violations", "",
                    {"upstream": ["Sanity check FAILED"]}, ("upstream",))
    labels = ["spec", "upstream"]
    assert host_lock_on_host_only_aux(trace, last["i"])
    assert documented_difference(labels, trace.config, trace.steps, check) is not None
    kept = [s for s in trace.steps if s["op"] != "evict"]
    assert not host_lock_on_host_only_aux(Trace(trace.header, trace.config, kept), last["i"])
    assert documented_difference(labels, trace.config, kept, check) is None


def test_conform_counts_upstream_freeing_a_host_locked_copy():
    """docs/SPEC.md, "Host locks" (conform spec,upstream, seed 2031, segment 158 of
    sessions-host-swa-p1): an evict leaves a host-locked SWA copy host-only; upstream lists it
    in its SWA host LRU list and the same evict's host SWA eviction frees it (host slot 1)
    where the spec frees others.  conform counts that host-free divergence as documented,
    for a slot of such a copy only, and not once the host lock is gone from the steps."""
    from conftest import CORPUS
    from uniradix.conformance.explore.conform import documented_difference
    from uniradix.conformance.explore.lockstep import DIVERGENCE, Finding
    from uniradix.conformance.traces.replay import host_locked_copy_freed
    from uniradix.conformance.traces.trace import Trace, load_trace
    trace = load_trace(os.path.join(CORPUS, "regressions-host-aux",
                                    "upstream-frees-a-host-locked-swa-copy-sessions-host-swa-p1.jsonl"))
    last = trace.steps[-1]
    assert last["op"] == "evict"

    def freed(up, field="host_swa_freed"):
        return Finding(DIVERGENCE, last["i"], "evict", "observation", f"{field}[0]",
                       {"spec": 5, "upstream": up}, ("spec", "upstream"))

    labels = ["spec", "upstream"]
    assert host_locked_copy_freed(trace, last["i"], 1, "swa")
    assert "host-locked" in documented_difference(labels, trace.config, trace.steps, freed(1))
    assert documented_difference(labels, trace.config, trace.steps, freed(11)) is None
    assert documented_difference(labels, trace.config, trace.steps,
                                 freed(1, "host_freed")) is None
    unlocked = [s for s in trace.steps if s["op"] != "host_lock"]
    assert not host_locked_copy_freed(Trace(trace.header, trace.config, unlocked), last["i"], 1,
                                      "swa")
