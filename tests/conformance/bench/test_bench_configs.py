"""conformance/bench/configs.py and the steps of the one scheduler loop: configurations by
name, refusals from the declared capabilities (so a capability that lands is measured), the
steps composed (Full+SWA+Mamba), ``--matrix`` and ``--memory`` per configuration."""

import dataclasses
import json

import pytest

from uniradix.conformance.adapters import capabilities as caps_mod
from uniradix.conformance.bench import configs as C
from uniradix.conformance.bench import loop as bench
from uniradix.conformance.env.workload import SharedPrefix

SMALL = SharedPrefix(requests=120, prompts=8, prompt_min=20, prompt_max=160, kv_slots=768,
                     inflight=4)
# SWA (window 512, an SWA pool of half the KV pool) needs a pool of a few windows to evict
HYBRID = SharedPrefix(requests=150, prompts=10, prompt_min=100, prompt_max=900, kv_slots=4096,
                      inflight=4)


def small(page_size: int = 1) -> bench.BenchWorkload:
    return bench.shared_prefix_workload(page_size, base=SMALL)


def fast_or_skip() -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    try:
        bench.get_bundle("fast")
    except bench.ImplMissing as e:
        pytest.skip(str(e))


def test_config_names_round_trip_and_the_matrix_covers_issue_15():
    names = [c.name for c in C.MATRIX]
    assert names == ["full", "swa", "mamba", "swa+mamba", "write_through", "write_back",
                     "write_through+swa", "write_back+swa", "write_through+mamba",
                     "write_back+mamba"]
    assert all(C.BenchConfig.parse(n) == c for n, c in zip(names, C.MATRIX, strict=True))
    with pytest.raises(ValueError, match="unknown bench configuration"):
        C.BenchConfig.parse("swa+swa")
    with pytest.raises(ValueError, match="components"):
        C.BenchConfig(("swa",))
    with pytest.raises(ValueError, match="hicache"):
        C.BenchConfig(hicache="write_sometimes")
    assert bench.workload_label("mooncake", "full") == "mooncake"
    assert bench.workload_label("mooncake", "write_back+swa") == "mooncake+write_back+swa"


def test_refusals_come_from_the_declared_capabilities(monkeypatch):
    """A capability fast does not declare is refused by name (here the host tier with SWA,
    taken off its declaration); declared, it is built (and a declaration taken away is refused
    by name): no list of configurations in the bench."""
    fast_or_skip()
    host_swa = C.BenchConfig(("full", "swa"), "write_through")
    declared = caps_mod.CAPABILITIES["fast"]
    assert "swa" in declared.host_aux
    monkeypatch.setitem(caps_mod.CAPABILITIES, "fast", dataclasses.replace(
        declared, host_aux=frozenset({"mamba"}), host_all_aux=False))
    with pytest.raises(bench.ImplMissing, match="refused: it does not model a host tier with "
                                                "the aux component swa"):
        C.config_bundle("fast", host_swa, 1)
    monkeypatch.setitem(caps_mod.CAPABILITIES, "fast", declared)
    try:  # fast builds it, or says why it cannot: either way not refused by the bench
        C.config_bundle("fast", host_swa, 1)
    except bench.ImplMissing as e:
        assert "refused" not in str(e) and "cannot be built here" in str(e)
    less = dataclasses.replace(declared, components=frozenset({("full",), ("full", "mamba")}))
    monkeypatch.setitem(caps_mod.CAPABILITIES, "fast", less)
    with pytest.raises(bench.ImplMissing, match=r"refused: .*components \['full', 'swa'\]"):
        C.config_bundle("fast", C.BenchConfig(("full", "swa")), 1)


def test_spec_and_speed_peers_are_refused_outside_full_with_the_reason():
    for impl, why in (("spec", "Full component on the device tier only"),
                      ("upstream-cpp", "Full configuration only")):
        with pytest.raises(bench.ImplMissing, match=why):
            C.config_bundle(impl, C.BenchConfig(("full", "mamba")), 1)


def test_full_swa_mamba_composes_both_steps():
    fast_or_skip()
    cmp = bench.compare(["fast", "upstream"], bench.shared_prefix_workload(1, base=HYBRID),
                        repeats=2, config=C.BenchConfig(("full", "swa", "mamba")))
    assert cmp.workload == "shared-prefix+swa+mamba" and cmp.identical, cmp.mismatches
    s = cmp.runs["fast"][0]
    assert s.requests + s.aborted == HYBRID.requests and s.evicted_tokens > 0
    assert s.requests > HYBRID.requests // 2
    assert "upstream" in cmp.runs or "upstream" in cmp.missing


@pytest.mark.parametrize("name,page_size", [("mamba", 1), ("mamba", 16), ("swa+mamba", 1),
                                             ("write_through+mamba", 1)])
def test_mamba_rows_hit_the_prefixes_the_prefill_cached(name, page_size):
    """The Mamba step caches each prompt's state after its prefill (at the match's branching
    seqlen, else the prompt's last chunk boundary), so requests sharing a prefix hit it:
    without that only prompt + output held a state and every Mamba row measured misses only.
    Against upstream (where it runs this configuration) the outcomes are identical."""
    fast_or_skip()
    cmp = bench.compare(["fast", "upstream"],
                        bench.shared_prefix_workload(page_size, base=HYBRID), repeats=1,
                        config=C.BenchConfig.parse(name))
    assert cmp.identical, cmp.mismatches
    s = cmp.runs["fast"][0]
    assert s.hit_rate > 0.2 and s.requests > HYBRID.requests // 2, (s.hit_rate, s.requests)
    assert len(s.op_times["insert"]) > s.requests  # the prefill's inserts beside the finishes


class CountingStep(bench.Step):
    """A step of a test: counts the hooks the loop calls."""

    name = "count"
    ops = ("noop",)

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def _hit(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def after_match(self, run, req, match):
        self._hit("after_match")
        run.timed("noop", lambda: None)

    def inserted(self, run, req, result):
        self._hit("inserted")
        return (7,)

    def request_done(self, run):
        self._hit("request_done")


def test_a_step_plugs_into_the_loop_without_changing_outcomes():
    fast_or_skip()
    base = bench.get_bundle("fast")
    plain = bench.run_bench(base, small(4))
    made: list = []

    def make():
        made.append(CountingStep())
        return made[-1]

    s = bench.run_bench(dataclasses.replace(base, steps=(make,), label="count"), small(4))
    n = SMALL.requests
    assert made[0].calls == {"after_match": n, "request_done": n, "inserted": s.requests}
    assert len(s.op_times["noop"]) == n and s.workload == "shared-prefix+count"
    assert (s.hit_rate, s.evicted_tokens, s.aborted) == (plain.hit_rate, plain.evicted_tokens,
                                                         plain.aborted)
    assert s.digest != plain.digest  # the step's digest number is in it


def test_matrix_records_every_configuration_and_each_refusal(tmp_path):
    fast_or_skip()
    out = tmp_path / "m.json"
    assert bench.main(["--matrix", "--impl", "fast,spec", "--requests", "60", "--page-size",
                       "1", "--repeat", "1", "--memory", "--memory-requests", "2",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    got = [c["workload"] for c in data["comparisons"]]
    assert got == [bench.workload_label("shared-prefix", c.name) for c in C.MATRIX]
    by = dict(zip(got, data["comparisons"], strict=True))
    assert set(by["shared-prefix"]["impls"]) == {"fast", "spec"}
    assert "Full component" in by["shared-prefix+swa"]["missing"]["spec"]
    refused = by["shared-prefix+write_back+mamba"]["missing"]
    if not caps_mod.CAPABILITIES["fast"].host_aux:
        assert refused["fast"].startswith("fast: refused: it does not model a host tier")
    mem = {(m["impl"], m["config"]) for m in data["memory"]}
    assert {("fast", c.name) for c in C.MATRIX[:6]} <= mem and ("spec", "full") in mem
    assert all(m["bytes_per_token"] > 0 for m in data["memory"])
    table = C.matrix_table(data)
    assert len(table) == 1 + len(C.MATRIX) + 2 + len({(m["config"], m["page_size"])
                                                      for m in data["memory"]})
    assert table[1].split()[:3] == ["full", "shared-prefix", "1"] and "yes" in table[1]
    assert " one " in table[2] and "spec" in table[2]  # swa: fast alone, the spec refused
    assert bench.main(["--matrix", "--components", "swa"]) == 2


@pytest.mark.upstream
@pytest.mark.parametrize("name", ["write_back+swa", "write_through+mamba"])
def test_upstream_host_tier_with_an_aux_component_runs_the_same_loop(name):
    """upstream's hybrid cache controller over the bench's free lists: host hits loaded back
    (with SWA), and every request accounted for, run to run identical."""
    pytest.importorskip("torch", reason="torch is not installed")
    try:
        C.config_bundle("upstream", C.BenchConfig.parse(name), 1)
    except bench.ImplMissing as e:
        pytest.skip(str(e))
    cmp = bench.compare(["upstream"], bench.shared_prefix_workload(1, base=HYBRID), repeats=2,
                        config=C.BenchConfig.parse(name))
    s = cmp.runs["upstream"][0]
    assert cmp.identical and s.requests + s.aborted == HYBRID.requests
    assert s.requests > HYBRID.requests // 2 and s.evicted_tokens > 0
    assert len(s.op_times["events"]) == HYBRID.requests
    if "swa" in name:
        assert len(s.op_times["load_back"]) > 0


def test_python_dash_m_refuses_outside_full_instead_of_crashing(tmp_path):
    """``python -m uniradix.conformance.bench.loop`` runs the imported module: a refusal raised
    by configs.py (which imports the loop by name) is caught as one, not a traceback."""
    import os
    import subprocess
    import sys
    fast_or_skip()
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "uniradix.conformance.bench.loop", "--impl", "fast,upstream-cpp",
         "--components", "mamba", "--requests", "30", "--page-size", "1", "--repeat", "1",
         "--json", str(out)], capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (c,) = json.loads(out.read_text())["comparisons"]
    assert "Full configuration only" in c["missing"]["upstream-cpp"] and "fast" in c["impls"]


def test_two_steps_that_make_room_are_refused_by_name():
    fast_or_skip()
    from uniradix.conformance.bench.hybrid import SwaStep

    class Greedy(bench.Step):
        name = "greedy"

        def make_room(self, run, req):
            run.evict(req, num_tokens=req.need)

    bundle = dataclasses.replace(bench.get_bundle("fast"), steps=(SwaStep, Greedy))
    with pytest.raises(ValueError, match="swa, greedy each make room"):
        bench.run_bench(bundle, small(1))


@pytest.mark.upstream
def test_host_swa_outcomes_agree_under_the_load_back_rule_and_differ_without_it(monkeypatch,
                                                                                capsys):
    """The host+SWA bench drives upstream's load back as the trace's op (no host hit lengths:
    only an evicted best node is loaded, docs/SPEC.md): fast and upstream then agree.  Given the
    match's host hit lengths, as SGLang's scheduler passes them, 0.5.13.post1 also loads SWA
    windows under a node whose Full data is on the device, the outcomes differ, and the bench
    says so instead of giving a speed ratio (JSON and output)."""
    fast_or_skip()
    from uniradix.conformance.bench import host as bench_host
    cfg = C.BenchConfig.parse("write_through+swa")
    try:
        C.config_bundle("upstream", cfg, 1)
    except bench.ImplMissing as e:
        pytest.skip(str(e))
    w = bench.shared_prefix_workload(1, base=HYBRID)
    cmp = bench.compare(["fast", "upstream"], w, repeats=1, strict=False, config=cfg)
    assert cmp.identical, cmp.mismatches
    summary = cmp.summary()
    assert summary["ratios"]["fast/upstream"] is not None and summary["ratios_withheld"] is None
    assert summary["notes"] == [bench_host.LOAD_BACK_RULE]
    monkeypatch.setattr(bench_host.HostStep, "scheduler_hit_lengths", True)
    cmp = bench.compare(["fast", "upstream"], w, repeats=1, strict=False, config=cfg)
    fast, up = cmp.runs["fast"][0], cmp.runs["upstream"][0]
    assert not cmp.identical and up.hit_rate > fast.hit_rate
    summary = cmp.summary()
    assert summary["ratios"]["fast/upstream"] is None and summary["ratios_withheld"]
    bench.print_comparison(cmp)
    out = capsys.readouterr().out
    assert "ratios (req/s): withheld" in out and "fast/upstream" not in out
    assert "OUTCOMES DIFFER" in out and "note: load back as the trace's load_back op" in out
