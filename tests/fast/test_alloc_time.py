"""``bench --alloc-time`` (conformance/bench/loop.py ``AllocTimer``) and the C core's free timer
(fast/_core.c ``free_timer``): the time the timed cache calls spend inside the KV allocator's
frees, in all and for evict and insert, and the cap it gives (upstream's timed seconds over
fast's seconds inside the frees)."""

import json

import pytest

torch = pytest.importorskip("torch")

from uniradix.conformance.bench import loop as bench  # noqa: E402
from uniradix.conformance.env.workload import SharedPrefix  # noqa: E402

SMALL = SharedPrefix(requests=300, prompts=12, prompt_min=20, prompt_max=200, kv_slots=2048,
                     inflight=6)


def small(page_size: int) -> bench.BenchWorkload:
    return bench.shared_prefix_workload(page_size, base=SMALL)


def _core_or_skip():
    from uniradix.fast import cache as cache_mod
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not loaded (pure-Python fallback)")
    from uniradix.fast import _core
    return _core


def test_free_timer_refuses_an_unknown_clock_and_resets():
    core = _core_or_skip()
    with pytest.raises(ValueError, match="clock must be 0"):
        core.free_timer(3)
    with pytest.raises(ValueError, match="clock must be 0"):
        core.free_timer(-1)
    core.free_timer(2)
    assert core.free_timer(2) == 0.0  # nothing freed since: nothing summed
    assert core.free_timer(0) == 0.0


@pytest.mark.parametrize("clock", ["wall", "cpu"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_time_of_fast_on_the_freelist_allocator(clock, page_size):
    w = small(page_size)
    plain = bench.run_bench(bench.get_bundle("fast"), w, clock=clock)
    assert plain.alloc_seconds is None and plain.op_alloc_seconds == {}
    s = bench.run_bench(bench.get_bundle("fast"), w, clock=clock, alloc_time=True)
    assert s.outcome() == plain.outcome()  # timing changes nothing the cache does
    assert s.evict_calls > 0 and s.free_calls
    assert s.alloc_seconds is not None and s.alloc_seconds > 0
    shares = s.op_alloc_seconds
    assert set(shares) <= {"evict", "insert"} and shares.get("evict", 0.0) > 0
    # every free happens inside evict or insert: their shares add up to the total
    assert sum(shares.values()) == pytest.approx(s.alloc_seconds, rel=1e-6, abs=1e-9)
    assert s.alloc_seconds <= s.seconds + 1e-3 * s.requests  # (the clock cost is subtracted)
    row = s.summary()
    assert row["alloc_s"] == round(s.alloc_seconds, 6) and set(row["op_alloc_s"]) == set(shares)
    assert sum(row["op_total_s"].values()) == pytest.approx(s.seconds, abs=1e-5)


def test_alloc_time_leaves_the_spec_unmeasured():
    s = bench.run_bench(bench.get_bundle("spec"), small(1), alloc_time=True)
    assert s.alloc_seconds is None  # its pool model is not an allocator count_frees wraps


def _stats(impl: str, seconds: float, alloc: float | None) -> bench.BenchStats:
    s = bench.BenchStats(impl, "v", "w", 1, 64, requests=10, seconds=seconds)
    s.alloc_seconds = alloc
    return s


def test_cap_is_upstreams_time_over_fasts_time_inside_the_frees():
    runs = {"fast": [_stats("fast", 1.0, 0.2), _stats("fast", 1.0, 0.4), _stats("fast", 1.0, 0.3)],
            "upstream": [_stats("upstream", 6.0, 2.0), _stats("upstream", 9.0, 2.0),
                         _stats("upstream", 12.0, 2.0)]}
    cmp = bench.Comparison("w", 1, 10, 64, runs, {}, alloc_time=True)
    assert cmp.median_alloc_seconds("fast") == pytest.approx(0.3)
    assert cmp.cap() == pytest.approx(9.0 / 0.3)
    assert cmp.summary()["cap"] == pytest.approx(30.0)
    cmp.identical = False  # different work: no cap, as no ratio
    assert cmp.cap() is None
    none = bench.Comparison("w", 1, 10, 64, {"fast": [_stats("fast", 1.0, None)]}, {})
    assert none.cap() is None and none.median_alloc_seconds("fast") is None


def test_bench_cli_alloc_time(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["bench", "--impl", "fast", "--requests", "200", "--repeat", "1",
                       "--page-size", "4", "--alloc-time", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "inside the allocator's frees (medians): fast" in text
    cmp = json.loads(out.read_text())["comparisons"][0]
    assert cmp["alloc_time"] is True and cmp["cap"] is None  # no upstream measured
    assert cmp["impls"]["fast"]["alloc_s_median"] > 0


@pytest.mark.upstream
@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_time_counts_the_native_frees_into_sglang_allocators(page_size):
    """Over sglang's own allocators the C core writes their lists itself (no free() call):
    the free timer counts that time, and upstream's free() calls are timed in the wrapper."""
    _core_or_skip()
    w = small(page_size)
    got = {}
    for impl in ("fast", "upstream"):
        try:
            b = bench.get_bundle(impl, "sglang")
        except bench.ImplMissing as e:
            pytest.skip(str(e))
        keep: list = []
        s = bench.run_bench(b, w, keep=keep, clock="cpu", alloc_time=True)
        got[impl] = (s, keep[1]._bench_free_timing[1])
    (fs, fast_python), (us, up_python) = got["fast"], got["upstream"]
    assert fs.outcome() == us.outcome()
    assert fs.alloc_seconds > fast_python  # the native part was counted
    assert us.alloc_seconds == pytest.approx(up_python) and up_python > 0
