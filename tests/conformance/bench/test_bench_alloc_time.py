"""``bench --alloc-time`` in every configuration (conformance/bench/alloc_time.py): the timers
count a known spin and a known number of free calls, per pool, nested calls once, the harness's
own frees not at all; in hybrid and host configurations over the free lists (here) and over
sglang's allocators and pools (the upstream venv); and the keys it adds to the JSON."""

import json
import time

import pytest

torch = pytest.importorskip("torch")

from uniradix.conformance.bench import alloc_time as AT  # noqa: E402
from uniradix.conformance.bench import loop as bench  # noqa: E402
from uniradix.conformance.bench.configs import BenchConfig, config_bundle  # noqa: E402
from uniradix.conformance.env.workload import SharedPrefix  # noqa: E402

SPIN = 0.002  # seconds of this thread's CPU time per spun free
SMALL = SharedPrefix(requests=300, prompts=12, prompt_min=20, prompt_max=200, kv_slots=2048,
                     inflight=6)


def spin(seconds: float = SPIN) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Pool:
    """A pool whose free spins (and logs what it was given)."""

    def __init__(self) -> None:
        self.freed: list = []

    def free(self, slots) -> None:
        spin()
        self.freed.append(slots)


class AppendPool(Pool):
    """A pool that frees a concatenation as its pieces in turn (fast/frees.py APPEND)."""

    uniradix_free_order = "append"


class SwaLike(Pool):
    """An SWA allocator's shape: free frees both sides and calls free_swa; all nested."""

    def __init__(self) -> None:
        super().__init__()
        self.full_attn_allocator = Pool()
        self.swa_attn_allocator = Pool()

    def free(self, slots) -> None:
        self.full_attn_allocator.free(slots)
        self.free_swa(slots)

    def free_swa(self, slots) -> None:
        self.swa_attn_allocator.free(slots)


@pytest.fixture
def timing():
    AT.TIMING.start(time.thread_time, None)
    yield AT.TIMING
    AT.TIMING.stop()


def test_known_spins_per_pool_nested_calls_once(timing):
    kv, states, host = SwaLike(), Pool(), Pool()
    AT.watch_pools(kv, states, [host, None])
    for i in range(3):
        kv.free(i)  # 2 spins each (both sides), one call: the SWA allocator's
    kv.free_swa(9)  # 1 spin, one call
    kv.swa_attn_allocator.free(8)  # directly: 1 spin, one call
    for i in range(2):
        states.free(i)
    host.free(0)
    assert timing.calls == {"kv": 5, "mamba": 2, "host": 1}
    assert timing.by_pool["kv"] == pytest.approx(9 * SPIN, rel=0.5)
    assert timing.by_pool["mamba"] == pytest.approx(2 * SPIN, rel=0.5)
    assert timing.by_pool["host"] == pytest.approx(SPIN, rel=0.5)
    assert timing.by_pool["kv"] > 8 * SPIN  # nested spins are inside the outer call's time
    assert timing.seconds == pytest.approx(sum(timing.by_pool.values()))
    # the calls are counted on each method; the wrappers only observe
    assert kv._bench_free_calls == [3] and kv._bench_free_swa_calls == [4]
    assert kv.swa_attn_allocator._bench_free_calls == [5]
    assert callable(kv.free.uniradix_on_batch) and callable(host.free.uniradix_on_batch)
    assert kv.swa_attn_allocator.freed == [0, 1, 2, 9, 8]
    before = (timing.seconds, dict(timing.calls))
    AT.harness_free(kv, 7)  # the scheduler's own free: nothing under it timed
    AT.harness_free(states, 7)
    assert (timing.seconds, timing.calls) == before
    assert kv._bench_free_calls == [3] and states.freed[-1] == 7
    AT.watch_pools(kv)  # wrapping again changes nothing
    kv.free(1)
    assert timing.calls["kv"] == 6 and kv._bench_free_calls == [4]


def test_nothing_is_timed_when_off():
    p = Pool()
    AT.wrap(p, "free", "host")
    p.free(1)
    assert p._bench_free_calls == [1] and p._bench_free_timing == ["host", 0.0]
    AT.TIMING.start(time.thread_time, None)
    AT.TIMING.stop()
    p.free(2)
    assert AT.TIMING.calls == {} and p._bench_free_timing[1] == 0.0


def test_fast_list_writes_are_observed_once_and_restored():
    frees = pytest.importorskip("uniradix.fast.frees")
    original = frees.append_release
    flushes: list = []
    pool = AppendPool()
    AT.wrap(pool, "free", "kv")
    AT.TIMING.start(time.thread_time, flushes.append)
    try:
        assert frees.append_release is not original
        assert frees.append_release.__wrapped__ is original
        # not an exact sglang allocator: nothing written (False), so nothing counted; release
        # then frees the concatenation through the pool's free: one timed call
        frees.release(pool, [torch.tensor([1, 2]), torch.tensor([3])])
        assert AT.TIMING.calls == {"kv": 1} and len(pool.freed) == 1
        assert flushes == [False, True]  # the C core's time read before, dropped after
    finally:
        AT.TIMING.stop()
    assert frees.append_release is original


def small(page_size: int) -> bench.BenchWorkload:
    return bench.shared_prefix_workload(page_size, base=SMALL)


def _run(impl: str, config: BenchConfig, page_size: int, allocator: str, **kw):
    try:
        bundle = config_bundle(impl, config, page_size, allocator)
    except bench.ImplMissing as e:
        pytest.skip(str(e))
    keep: list = []
    return bench.run_bench(bundle, small(page_size), keep=keep, **kw), keep


def _check_run(impl: str, config: BenchConfig, page_size: int, allocator: str) -> dict:
    """One plain and one --alloc-time run: the same outcome; every timed KV free call counted
    (the loop allocator's count, which leaves out the harness's frees, equals the timed calls),
    the pools' parts adding up, and under a known spin per free each call's spin counted."""
    plain, _ = _run(impl, config, page_size, allocator, clock="cpu")
    s, keep = _run(impl, config, page_size, allocator, clock="cpu", alloc_time=True)
    assert s.outcome() == plain.outcome()
    assert s.alloc_seconds is not None and s.alloc_seconds > 0
    assert s.alloc_seconds == pytest.approx(sum(s.alloc_pools.values()), rel=1e-6, abs=1e-9)
    assert s.alloc_seconds <= s.seconds + 1e-3 * s.requests
    kv_calls = keep[1]._bench_free_calls[0]
    assert s.free_calls == kv_calls > 0
    if "swa" not in config.components:  # (SWA: free_swa and the sub-allocators count too)
        assert s.alloc_calls.get("kv", 0) == kv_calls
    row = s.summary()
    assert row["alloc_share"] == pytest.approx(s.alloc_seconds / s.seconds, abs=1e-4)
    assert row["requests_per_s_ex_alloc"] > row["requests_per_s"]
    assert set(row["alloc_s_by_pool"]) <= set(AT.POOLS)
    return {"stats": s, "keep": keep}


@pytest.mark.parametrize("config", ["write_through+mamba", "swa"])
def test_alloc_time_of_fast_over_the_free_lists(config, monkeypatch):
    cfg = BenchConfig.parse(config)
    got = _check_run("fast", cfg, 1, "freelist")
    s = got["stats"]
    if "mamba" in cfg.components:
        states = got["keep"][3].mamba_allocator
        assert s.alloc_calls.get("mamba", 0) == states._bench_free_calls[0] > 0
    # a known spin in every free of the bench's free lists: each timed call holds one or more
    monkeypatch.setattr(bench.FreeListAllocator, "free", _spun(bench.FreeListAllocator.free))
    spun, _ = _run("fast", cfg, 1, "freelist", clock="cpu", alloc_time=True)
    assert spun.outcome() == s.outcome()
    calls = sum(spun.alloc_calls.values())
    assert calls > 0 and spun.alloc_seconds >= 0.9 * SPIN * calls
    assert spun.seconds >= spun.alloc_seconds


def _spun(free):
    def spun_free(self, slots):
        spin()
        return free(self, slots)
    return spun_free


def test_bench_cli_alloc_time_json_keys_in_a_host_config(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["bench", "--impl", "fast", "--requests", "200", "--repeat", "2",
                       "--page-size", "4", "--hicache", "write_back", "--components", "mamba",
                       "--clock", "cpu", "--alloc-time", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "inside the allocator's frees (medians): fast" in text and "mamba" in text
    cmp = json.loads(out.read_text())["comparisons"][0]
    assert cmp["alloc_time"] is True and cmp["cap"] is None  # no upstream measured
    f = cmp["impls"]["fast"]
    assert 0 < f["alloc_share_median"] < 1 and f["alloc_s_median"] > 0
    assert f["requests_per_s_ex_alloc_median"] > f["requests_per_s_median"]
    assert set(f["alloc_s_by_pool_median"]) <= set(AT.POOLS)
    run = f["runs"][0]
    assert {"alloc_share", "requests_per_s_ex_alloc", "alloc_s_by_pool",
            "alloc_calls_by_pool"} <= set(run)


def test_alloc_table_reads_the_json():
    c = {"workload": "mooncake+swa", "page_size": 16, "alloc_time": True, "cap": 3.456,
         "ratios": {"fast/upstream": 1.5},
         "impls": {"fast": {"alloc_share_median": 0.5, "requests_per_s_ex_alloc_median": 200.0},
                   "upstream": {"alloc_share_median": 0.25,
                                "requests_per_s_ex_alloc_median": 120.0}}}
    lines = AT.alloc_table({"comparisons": [c, {**c, "alloc_time": False}]})
    assert len(lines) == 2
    assert lines[1].split() == ["swa", "mooncake", "16", "1.50x", "50.0", "25.0", "200.0",
                                "120.0", "3.46x"]


@pytest.mark.upstream
@pytest.mark.parametrize("config,page_size", [("write_through+mamba", 1), ("swa", 1),
                                              ("write_back", 16)])
def test_alloc_time_over_sglangs_allocators(config, page_size):
    """fast and upstream over sglang's own allocators and pools: identical outcomes, every
    timed KV free call counted on both sides (fast's list writes into the exact allocators
    included), the Mamba state frees too."""
    cfg = BenchConfig.parse(config)
    got = {impl: _check_run(impl, cfg, page_size, "sglang") for impl in ("fast", "upstream")}
    f, u = got["fast"]["stats"], got["upstream"]["stats"]
    assert f.outcome() == u.outcome()
    if "mamba" in cfg.components:
        for impl in ("fast", "upstream"):
            s, keep = got[impl]["stats"], got[impl]["keep"]
            states = keep[3].mamba_allocator
            assert s.alloc_calls.get("mamba", 0) == states._bench_free_calls[0]
    cmp = bench.Comparison("w", page_size, 10, 64, {"fast": [f], "upstream": [u]}, {},
                           alloc_time=True)
    assert cmp.cap() == pytest.approx(u.seconds / f.alloc_seconds)


def test_the_dashboard_record_keeps_the_pool_share_and_the_cap():
    from uniradix.conformance.bench import results

    def stats(impl: str, seconds: float, alloc: float) -> bench.BenchStats:
        s = bench.BenchStats(impl, "v", "mooncake+swa", 16, 64, requests=10, seconds=seconds)
        s.alloc_seconds = alloc
        return s
    runs = {"fast": [stats("fast", 1.0, 0.5), stats("fast", 2.0, 0.5)],
            "upstream": [stats("upstream", 4.0, 1.0), stats("upstream", 4.0, 2.0)]}
    c = bench.Comparison("mooncake+swa", 16, 10, 64, runs, {}, alloc_time=True).summary()
    fig = results._throughput_from_comparison(c)
    assert fig["cap"] == pytest.approx(4.0 / 0.5)
    f, u = fig["impls"]["fast"], fig["impls"]["upstream"]
    assert f["alloc_share"] == {"median": 0.375, "min": 0.25, "max": 0.5, "n": 2}
    assert f["requests_per_s_ex_alloc"]["min"] == pytest.approx(6.7, abs=0.05)  # 10 / 1.5
    assert u["alloc_share"]["median"] == pytest.approx(0.375)
    plain = results._throughput_from_comparison({**c, "alloc_time": False})
    assert "cap" not in plain and "alloc_share" not in plain["impls"]["fast"]


def test_a_run_after_one_that_raised_times_nothing():
    frees = pytest.importorskip("uniradix.fast.frees")
    original = frees.append_release
    AT.TIMING.start(time.thread_time, None)  # as a run that raised inside would leave it
    s, _ = _run("fast", BenchConfig.parse("mamba"), 1, "freelist")
    assert AT.TIMING.clock is None and frees.append_release is original
    assert s.alloc_seconds is None and AT.TIMING.calls == {}
