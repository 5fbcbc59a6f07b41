"""The benchmark harness (conformance/bench/loop.py) on tiny workloads: sane statistics for the spec,
and identical outcomes (hit rate, evictions, aborts, per-request digest) for every other
implementation that can be built in this interpreter (upstream where sglang imports, fast once
it exists)."""

import json

import pytest

from uniradix.conformance.bench import loop as bench
from uniradix.conformance.env.workload import SharedPrefix

TINY = SharedPrefix(requests=150, prompts=10, prompt_min=20, prompt_max=120, kv_slots=2048,
                    inflight=4)


def tiny(page_size: int) -> bench.BenchWorkload:
    return bench.shared_prefix_workload(page_size, base=TINY)


def bundle_or_skip(impl: str) -> bench.ApiBundle:
    try:
        return bench.get_bundle(impl)
    except bench.ImplMissing as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("page_size", [1, 4])
def test_spec_stats_are_sane(page_size):
    keep = []
    w = tiny(page_size)
    s = bench.run_bench(bench.get_bundle("spec"), w, keep=keep)
    cache, _allocator, pool = keep
    assert s.requests == w.requests and s.aborted == 0
    assert 0.2 < s.hit_rate < 1.0
    assert s.evicted_tokens > 0 and s.evict_calls == len(s.op_times["evict"]) > 0
    for op in ("match", "lock", "insert", "unlock"):
        assert len(s.op_times[op]) == w.requests
    assert s.seconds > 0 and s.requests_per_s > 0
    assert set(s.op_medians_us()) == set(bench.OPS)
    # every request unlocked; every slot in use belongs to the tree
    assert cache.protected_size() == 0
    assert cache.evictable_size() == s.cached_tokens == pool.num_pages * page_size - pool.available_size()
    assert s.cached_tokens % page_size == 0


def test_spec_is_deterministic():
    a = bench.run_bench(bench.get_bundle("spec"), tiny(1))
    b = bench.run_bench(bench.get_bundle("spec"), tiny(1))
    assert a.outcome() == b.outcome()


@pytest.mark.parametrize("impl", ["upstream", "fast"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_other_impls_match_spec(impl, page_size):
    other = bundle_or_skip(impl)
    w = tiny(page_size)
    cmp_spec = bench.run_bench(bench.get_bundle("spec"), w)
    s = bench.run_bench(other, w)
    assert s.hit_rate == cmp_spec.hit_rate
    assert s.evicted_tokens == cmp_spec.evicted_tokens
    assert s.outcome() == cmp_spec.outcome()


def test_compare_reports_identical_outcomes():
    cmp = bench.compare(["spec"], tiny(1), repeats=2)
    assert cmp.identical and len(cmp.runs["spec"]) == 2
    assert cmp.summary()["impls"]["spec"]["evicted_tokens"] > 0


def test_mismatch_is_detected():
    a = bench.run_bench(bench.get_bundle("spec"), tiny(1))
    b = bench.run_bench(bench.get_bundle("spec"), tiny(1))
    b.evicted_tokens += 1
    assert bench.check_identical([a, b])


def test_mooncake_tokens_follow_the_blocks():
    rows = bench.mooncake_rows()
    assert len(rows) == 12031
    (in0, out0, ids0), (in1, _out1, ids1) = rows[0], rows[1]
    p0, p1 = bench.mooncake_prompt(in0, ids0), bench.mooncake_prompt(in1, ids1)
    assert len(p0) == in0 and len(p1) == in1
    shared_blocks = next(k for k in range(min(len(ids0), len(ids1))) if ids0[k] != ids1[k])
    common = next(k for k in range(min(in0, in1)) if p0[k] != p1[k])
    assert common == shared_blocks * bench.MOONCAKE_BLOCK
    out = bench.mooncake_output(0, out0)
    assert len(out) == out0 and not set(out) & set(p0)


def test_mooncake_short_run():
    w = bench.mooncake_workload(16, requests=6, kv_slots=1 << 14, inflight=2)
    s = bench.run_bench(bench.get_bundle("spec"), w)
    assert s.requests == 6 and s.evicted_tokens > 0 and s.hit_rate > 0


def test_memory_per_token():
    rep = bench.memory_per_token("spec", page_size=16, requests=2)
    assert rep.cached_tokens > 10_000
    assert 8 < rep.bytes_per_token < 2_000


def test_cli(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench.main(["bench", "--impl", "spec", "--requests", "40", "--repeat", "1",
                     "--page-size", "1,16", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "spec" in text and "identical" in text
    data = json.loads(out.read_text())
    assert [c["page_size"] for c in data["comparisons"]] == [1, 16]
    assert data["comparisons"][0]["impls"]["spec"]["requests_per_s_median"] > 0


def test_add_bench_parser_defaults():
    import argparse
    p = argparse.ArgumentParser()
    bench.add_bench_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["bench"])
    assert args.impl == list(bench.IMPLS) and args.workload == ["shared-prefix"]
    assert args.page_size == [1, 16] and args.requests is None and args.func is bench.cmd_bench
    args = p.parse_args(["bench", "--workload", "mooncake", "--limit", "50", "--impl", "spec"])
    assert args.workload == ["mooncake"] and args.requests == 50 and args.impl == ["spec"]
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--impl", "nope"])


class _MissingCache:
    """A cache that never reports a hit (wraps the spec's): a peer with other outcomes."""

    def __init__(self, inner):
        self.inner = inner

    def match_prefix(self, params):
        params.key.token_ids = params.key.token_ids[:0]
        return self.inner.match_prefix(params)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _never_hits_bundle() -> bench.ApiBundle:
    spec = bench.get_bundle("spec")

    def build(pool):
        cache, alloc = spec.build(pool)
        return _MissingCache(cache), alloc

    return bench.dataclasses.replace(spec, name="upstream-cpp", build=build)


def test_speed_peer_outcomes_are_reported_not_failed(monkeypatch, capsys):
    monkeypatch.setitem(bench.BUNDLES, "upstream-cpp", _never_hits_bundle)
    cmp = bench.compare(["spec", "upstream-cpp"], tiny(1), repeats=1)
    assert cmp.identical and not cmp.mismatches
    assert len(cmp.peer_differences) == 1 and "hit_tokens" in cmp.peer_differences[0]
    assert cmp.summary()["peer_differences"] == cmp.peer_differences
    bench.print_comparison(cmp)
    out = capsys.readouterr().out
    assert "speed peer, not a conforming implementation" in out
    # the same different outcomes from a conforming implementation are a failure
    monkeypatch.setitem(bench.BUNDLES, "fast", _never_hits_bundle)
    with pytest.raises(bench.ConformanceMismatch):
        bench.compare(["spec", "fast"], tiny(1), repeats=1)


def test_upstream_cpp_runs_the_workload():
    other = bundle_or_skip("upstream-cpp")
    keep = []
    s = bench.run_bench(other, tiny(1), keep=keep)
    cache, allocator, _pool = keep
    assert s.requests == TINY.requests and s.aborted == 0 and 0.2 < s.hit_rate < 1.0
    assert cache.cache.protected_size() == 0
    # every slot is either free or held by the tree: nothing leaked, nothing freed twice
    assert cache.cache.evictable_size() + allocator.available_size() == TINY.kv_slots


def test_cli_accepts_the_speed_peer():
    import argparse
    p = argparse.ArgumentParser()
    bench.add_bench_parser(p.add_subparsers(dest="command"))
    assert p.parse_args(["bench", "--impl", "fast,upstream-cpp"]).impl == ["fast", "upstream-cpp"]


def test_upstream_rust_is_reported_missing_or_conforms():
    """Where the installed sglang has no Rust tree core the bundle says why; where it has one
    (0.5.17+), its outcomes equal the spec's."""
    other = bundle_or_skip("upstream-rust")
    w = tiny(1)
    assert bench.run_bench(other, w).outcome() == bench.run_bench(bench.get_bundle("spec"), w).outcome()


def test_free_segment_is_free():
    torch = pytest.importorskip("torch")
    a = bench.FreeListAllocator(8, 1, torch)
    taken = a.alloc(3)
    a.free_segment(taken[1:], start_pos=1)
    assert a.available_size() == 7


def test_a_speed_peer_that_fails_is_reported_missing(monkeypatch):
    class Broken:
        def __init__(self, inner):
            self.inner = inner

        def insert(self, params):
            raise TypeError("incompatible function arguments\nlong detail")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    spec = bench.get_bundle("spec")

    def broken_bundle():
        def build(pool):
            cache, alloc = spec.build(pool)
            return Broken(cache), alloc
        return bench.dataclasses.replace(spec, name="upstream-cpp", build=build)

    monkeypatch.setitem(bench.BUNDLES, "upstream-cpp", broken_bundle)
    cmp = bench.compare(["spec", "upstream-cpp"], tiny(1), repeats=2)
    assert "upstream-cpp" not in cmp.runs and len(cmp.runs["spec"]) == 2
    assert cmp.missing["upstream-cpp"] == ("failed on shared-prefix: TypeError: incompatible "
                                           "function arguments")
    # a conforming implementation that fails is an error, not a footnote
    monkeypatch.setitem(bench.BUNDLES, "fast", broken_bundle)
    with pytest.raises(TypeError):
        bench.compare(["spec", "fast"], tiny(1), repeats=1)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_bench_loads_host_hits_back_and_agrees(policy):
    """conformance/bench/host.py: a host pool of twice the device pool; host hits are loaded
    back; outcomes are the same run to run (and, where sglang imports, on upstream)."""
    from uniradix.conformance.bench import host as bench_host
    w = bench.shared_prefix_workload(1, base=SharedPrefix(
        requests=150, prompts=10, prompt_min=20, prompt_max=120, kv_slots=512, inflight=4))
    cmp = bench_host.compare_host(["fast", "upstream", "spec"], w, policy, repeats=2)
    assert "spec" in cmp.missing and cmp.identical, cmp.mismatches
    assert cmp.summary()["notes"] == [bench_host.LOAD_BACK_RULE]
    s = cmp.runs["fast"][0]
    assert s.requests + s.aborted == w.requests and s.evicted_tokens > 0
    assert len(s.op_times["load_back"]) > 0 and len(s.op_times["events"]) == w.requests


# --------------------------------------------------------------------------------------------
# --device (issue 15 item 5) and peers pinned to their core (item 6)
# --------------------------------------------------------------------------------------------


def _torch_or_skip():
    return pytest.importorskip("torch", reason="torch is not installed")


def test_freelist_allocator_lives_on_the_device_it_is_given():
    torch = _torch_or_skip()
    alloc = bench.FreeListAllocator(64, 4, torch, "cpu")
    assert alloc.device == torch.device("cpu")
    taken = alloc.alloc(8)
    assert taken.device == alloc.device and taken.tolist() == list(range(4, 12))
    alloc.free(taken)
    assert alloc.available_size() == 64


def test_bench_device_cpu_explicit_gives_the_cpu_figures(tmp_path, capsys):
    _torch_or_skip()
    bundle_or_skip("fast")
    out = tmp_path / "cpu.json"
    rc = bench.main(["--impl", "spec,fast", "--device", "cpu", "--requests", "120",
                     "--page-size", "4", "--repeat", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["torch_threads"] == 1
    (c,) = data["comparisons"]
    assert c["device"] == "cpu" and c["workload"] == "shared-prefix"  # no "+cpu" configuration
    assert c["identical_outcomes"] and set(c["impls"]) == {"spec", "fast"}
    assert c["torch_threads"] == 1
    assert data["fast_core"] in ("C", "pure Python")


def test_bench_refuses_cuda_by_name_where_torch_sees_none(capsys):
    torch = _torch_or_skip()
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert bench.main(["--impl", "fast", "--device", "cuda", "--requests", "50"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "CUDA" in err
    with pytest.raises(bench.ImplMissing, match="--device cuda"):
        bench.get_bundle("fast", device="cuda")


def test_spec_is_cpu_only_and_unknown_devices_are_refused():
    with pytest.raises(bench.ImplMissing, match="CPU only"):
        bench.get_bundle("spec", device="cuda")
    with pytest.raises(ValueError, match="unknown device"):
        bench.get_bundle("spec", device="tpu")
    with pytest.raises(SystemExit):  # argparse: not one of cpu, cuda
        bench.main(["--device", "tpu"])


def test_device_cuda_is_full_only(capsys):
    assert bench.main(["--device", "cuda", "--components", "swa"]) == 2
    assert "Full configuration only" in capsys.readouterr().err


def test_a_cuda_comparison_is_its_own_dashboard_configuration(tmp_path):
    """What gpu-bench.sh's scheduler step writes: `uniradix dashboard --add` takes it, as the
    configuration "+cuda" beside (not mixed into) the CPU figures."""
    from uniradix.conformance.bench import results as R
    from uniradix.conformance.cli import main as cli_main
    w = tiny(4)
    cmp = bench.compare(["spec"], w, repeats=1)
    cmp.device = "cuda"  # as a --device cuda run labels its comparison
    data = {"comparisons": [cmp.summary()], "memory": [], "device": "cuda", "torch_threads": 1,
            "not_measured": {"upstream": "sglang is not importable here"}}
    f = tmp_path / "scheduler-cuda.json"
    f.write_text(json.dumps(data))
    (fig,) = R.normalize(json.loads(f.read_text()), file=str(f))["figures"]["throughput"]
    assert fig["workload"] == "shared-prefix" and fig["config"] == "cuda"
    assert fig["id"].startswith("shared-prefix/cuda/p4/")
    rc = cli_main(["dashboard", "--results", str(tmp_path / "res"), "--add", str(f),
                   "--commit", "abcdef1", "--out", str(tmp_path / "page.html")])
    assert rc == 0 and (tmp_path / "page.html").exists()


def test_budget_skips_the_comparisons_it_has_no_time_for(tmp_path):
    out = tmp_path / "b.json"
    rc = bench.main(["--impl", "spec", "--requests", "60", "--page-size", "1,4", "--repeat", "1",
                     "--budget", "1e-9", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["comparisons"] == [] and len(data["skipped"]) == 2
    assert bench.main(["--impl", "spec", "--budget", "0"]) == 2


def test_tree_core_in_use_names_the_core_by_class():
    class UnifiedTreeCore:
        pass

    class RustUnifiedTreeCore:
        pass

    UnifiedTreeCore.__module__ = "sglang.srt.mem_cache.unified_cache.unified_tree_core"
    RustUnifiedTreeCore.__module__ = "sglang.srt.mem_cache.rust_tree_core.adapter"
    cache = lambda core: type("C", (), {"tree_core": core})()  # noqa: E731
    assert bench.tree_core_in_use(object()) == "python"  # 0.5.13.post1: the tree is the cache
    assert bench.tree_core_in_use(cache(UnifiedTreeCore())) == "python"
    assert bench.tree_core_in_use(cache(RustUnifiedTreeCore())) == "rust"
    assert bench.tree_core_in_use(cache(object())).startswith("unknown (builtins.object")


def test_match_result_without_device_indices_is_named():
    import collections
    Old = collections.namedtuple("MatchResult", "device_indices last_device_node last_host_node")
    New = collections.namedtuple("MatchResult", "device_prefix_len last_device_node last_host_node")
    assert bench.match_result_problem(Old(None, None, None)) is None
    why = bench.match_result_problem(New(0, None, None))
    assert "no device_indices" in why and "device_prefix_len" in why


def test_cpp_tree_problem_wants_a_compiled_tree():
    class PyTree:
        pass

    assert "not a class of a compiled extension" in bench.cpp_tree_problem(
        type("C", (), {"tree": PyTree()})())
    assert "has no tree" in bench.cpp_tree_problem(object())


def _fake_pluggable_release(monkeypatch, *, core_module, core_name, match_fields):
    """A stand-in for sglang 0.5.17+ as upstream_bundle sees it: a pluggable tree core (the one
    built is fixed, whatever is asked for) and a MatchResult with ``match_fields``."""
    import collections
    import types
    torch = _torch_or_skip()
    from uniradix.conformance.adapters import upstream
    MatchResult = collections.namedtuple("MatchResult", match_fields)
    Core = type(core_name, (), {})
    Core.__module__ = core_module
    asked = []

    class Cache:
        def __init__(self, params):
            import os
            asked.append(os.environ.get(bench.TREE_CORE_ENV))
            self.tree_core = Core()

        def match_prefix(self, params):
            return MatchResult(*([None] * len(MatchResult._fields)))

    up = types.SimpleNamespace(
        torch=torch, version="0.5.99", RadixKey=lambda tokens: tokens,
        ComponentType=types.SimpleNamespace(FULL="full"), UnifiedRadixCache=Cache,
        CacheInitParams=lambda **kw: kw, MatchPrefixParams=lambda key: key,
        InsertParams=None, EvictParams=None)
    monkeypatch.setattr(upstream, "load_upstream", lambda: up)
    monkeypatch.setattr(upstream, "rust_tree_core_available", lambda: True)
    return asked


def test_upstream_asks_for_the_python_core_and_refuses_another(monkeypatch):
    asked = _fake_pluggable_release(
        monkeypatch, core_module="sglang.srt.mem_cache.rust_tree_core.adapter",
        core_name="RustUnifiedTreeCore",
        match_fields="device_indices last_device_node last_host_node")
    with pytest.raises(bench.ImplMissing, match="asked sglang 0.5.99 for its python tree core .* "
                                                "built the rust one"):
        bench.get_bundle("upstream")
    assert asked == ["python"]
    assert bench.get_bundle("upstream-rust").version == "sglang 0.5.99 (rust tree core)"
    assert asked[-1] == "rust"


def test_upstream_without_device_indices_is_not_measured_with_the_reason(monkeypatch):
    """sglang 0.5.23: MatchResult reports device_prefix_len; the peer is reported, not run."""
    _fake_pluggable_release(
        monkeypatch, core_module="sglang.srt.mem_cache.unified_cache.unified_tree_core",
        core_name="UnifiedTreeCore",
        match_fields="device_prefix_len last_device_node last_host_node best_match_node")
    with pytest.raises(bench.ImplMissing, match="no device_indices"):
        bench.get_bundle("upstream")
    cmp = bench.compare(["spec", "upstream"], tiny(1), repeats=1)
    assert "upstream" not in cmp.runs and "no device_indices" in cmp.missing["upstream"]


@pytest.mark.upstream
def test_upstream_peer_is_pinned_to_the_python_tree():
    b = bundle_or_skip("upstream")
    assert "(python tree core" in b.version  # (0.5.23 adds how its slots are read)


@pytest.mark.parametrize("args", [["--components", "swa"], ["--hicache", "write_through"]])
def test_hybrid_and_host_loops_run_under_the_thread_pin(monkeypatch, tmp_path, args):
    torch = _torch_or_skip()
    bundle_or_skip("fast")
    seen = []
    real = bench.run_bench

    def spy(*a, **kw):  # the one scheduler loop, whatever the steps
        seen.append(torch.get_num_threads())
        return real(*a, **kw)

    monkeypatch.setattr(bench, "run_bench", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = tmp_path / "t.json"
        assert bench.main(["--impl", "fast", "--requests", "60", "--page-size", "4",
                           "--repeat", "1", "--json", str(out)] + args) == 0
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    (c,) = json.loads(out.read_text())["comparisons"]
    assert c["torch_threads"] == 1


def test_differing_outcomes_withhold_the_ratios(capsys):
    """A speed ratio over different work means nothing: when conforming implementations'
    outcomes differ the comparison gives no ratio between them, in the JSON and the output."""
    a = bench.run_bench(bench.get_bundle("spec"), tiny(1))
    b = bench.run_bench(bench.get_bundle("spec"), tiny(1))
    b.impl, b.evicted_tokens = "fast", b.evicted_tokens + 1
    cmp = bench.Comparison("shared-prefix", 1, a.requests, a.kv_slots,
                           {"spec": [a], "fast": [b]}, {})
    assert cmp.ratio("fast", "spec") is not None  # (identical until told otherwise)
    cmp.mismatches = bench.check_identical([a, b])
    cmp.identical = not cmp.mismatches
    summary = cmp.summary()
    assert summary["ratios"]["fast/spec"] is None
    assert "outcomes differ" in summary["ratios_withheld"]
    bench.print_comparison(cmp)
    out = capsys.readouterr().out
    assert "ratios (req/s): withheld" in out and "fast/spec" not in out
    assert "OUTCOMES DIFFER" in out


def test_cpu_clock_times_the_same_work_and_is_recorded(tmp_path):
    """``--clock cpu``: the same outcomes as the wall clock, every sample the thread's CPU time
    less the clock's own cost (never negative), the clock named in the stats, the comparison,
    the JSON and the dashboard record; the default stays ``wall``."""
    from uniradix.conformance.bench import results as R
    spec = bench.get_bundle("spec")
    wall = bench.run_bench(spec, tiny(4))
    cpu = bench.run_bench(spec, tiny(4), clock="cpu")
    assert (wall.clock, cpu.clock) == ("wall", "cpu") and wall.outcome() == cpu.outcome()
    assert all(t >= 0 for ts in cpu.op_times.values() for t in ts) and cpu.seconds > 0
    assert cpu.summary()["clock"] == "cpu"
    cost = bench.clock_cost(bench.time.thread_time)
    assert 0 <= cost < 1e-4  # a reading costs well under 100 us
    assert bench.bench_clock("wall") == (bench.time.perf_counter, 0.0)
    with pytest.raises(ValueError, match="unknown clock 'tsc'"):
        bench.bench_clock("tsc")
    out = tmp_path / "c.json"
    assert bench.main(["--impl", "spec", "--requests", "40", "--page-size", "4", "--repeat",
                       "1", "--clock", "cpu", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["clock"] == "cpu" and data["comparisons"][0]["clock"] == "cpu"
    assert data["comparisons"][0]["impls"]["spec"]["runs"][0]["clock"] == "cpu"
    (fig,) = R.normalize(data, file=str(out))["figures"]["throughput"]
    assert fig["clock"] == "cpu"
    old = dict(data["comparisons"][0])
    del old["clock"]  # a bench JSON from before the option
    (fig,) = R.normalize({"comparisons": [old], "memory": []}, file="old.json")["figures"][
        "throughput"]
    assert fig["clock"] == "wall"


def test_clock_defaults_to_wall_and_unknown_or_cuda_cpu_are_refused(capsys):
    import argparse
    p = argparse.ArgumentParser()
    bench.add_bench_parser(p.add_subparsers(dest="command"))
    assert p.parse_args(["bench"]).clock == "wall"
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "--clock", "tsc"])
    assert bench.main(["--clock", "cpu", "--device", "cuda", "--impl", "fast"]) == 2
    assert "--clock cpu with --device cuda" in capsys.readouterr().err


@pytest.mark.parametrize("mode", bench.GC_MODES)
def test_gc_mode_freezes_the_heap_for_the_run_only(mode, tmp_path):
    """--gc freeze: what exists before a run is in the permanent generation during it and back
    after it; --gc collect freezes nothing. The collector stays on in both; the JSON says which."""
    import gc
    seen = []
    bundle = bench.get_bundle("spec")
    real_build = bundle.build

    def build(*a, **k):  # the cache is built before the run; sample the freeze in its match
        built = real_build(*a, **k)
        cache = built[0]
        match = cache.match_prefix

        def watched(params):
            seen.append((gc.get_freeze_count(), gc.isenabled()))
            return match(params)
        cache.match_prefix = watched
        return built
    import dataclasses
    before = gc.get_freeze_count()
    bench.run_bench(dataclasses.replace(bundle, build=build), tiny(1), gc_mode=mode)
    assert gc.get_freeze_count() == before and seen
    assert all(enabled for _, enabled in seen)
    if mode == "freeze":
        assert all(frozen > before + 1000 for frozen, _ in seen)
    else:
        assert all(frozen == before for frozen, _ in seen)
    out = tmp_path / "b.json"
    assert bench.main(["--impl", "spec", "--requests", "30", "--page-size", "1", "--repeat", "1",
                       "--gc", mode, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["gc"] == mode and data["comparisons"][0]["gc"] == mode
    with pytest.raises(ValueError, match="unknown gc mode"):
        with bench.gc_during_run("off"):
            pass
