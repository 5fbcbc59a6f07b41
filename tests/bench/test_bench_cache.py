"""pytest-benchmark runs of the benchmark harness (conformance/bench/loop.py) for spec, fast and
upstream (each skipped where it cannot be built: fast until it exists, upstream outside the
throwaway sglang venv). Skipped by default (``--benchmark-skip``); ``make bench`` runs them and
writes the JSON.

pytest-benchmark's own timings are the whole run's wall time (workload generation and harness
included); the number to compare is ``extra_info["requests_per_s"]``: finished requests over the
time of the cache calls only, the median over the rounds (see conformance/bench/loop.py). Each test
also records the outcome every implementation must share (hit rate, evicted tokens, digest).

Sizes keep the whole file to a few minutes: shared-prefix scaled to 1,000 requests (page 1 and
16) and the first 150 Mooncake requests with a 524,288-token pool (half the CLI's, so that so
short a run evicts), page 16. The spec runs one round, the others three.

``test_bench_config`` runs every other configuration of conformance/bench/configs.py (hybrid
models, the host tier, both) on fast and upstream, shared-prefix at 1,000 requests, pages 1
and 16; a configuration an implementation refuses is skipped with the reason.
"""

import statistics

import pytest

from uniradix.conformance.bench import configs
from uniradix.conformance.bench import loop as bench

CASES = {
    "shared-prefix-p1": lambda: bench.shared_prefix_workload(1, 1000),
    "shared-prefix-p16": lambda: bench.shared_prefix_workload(16, 1000),
    "mooncake-p16": lambda: bench.mooncake_workload(16, requests=150, kv_slots=1 << 19),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", list(bench.IMPLS))
def test_bench_cache(benchmark, impl, case):
    try:
        bundle = bench.get_bundle(impl)
    except bench.ImplMissing as e:
        pytest.skip(str(e))
    workload = CASES[case]()
    runs = []

    def once():
        runs.append(bench.run_bench(bundle, workload))

    benchmark.pedantic(once, rounds=1 if impl == "spec" else 3, iterations=1, warmup_rounds=0)
    record(benchmark, workload, runs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("config", [c.name for c in configs.MATRIX if not c.is_full])
@pytest.mark.parametrize("impl", list(configs.CONFIG_IMPLS))
def test_bench_config(benchmark, impl, config, page_size):
    try:
        bundle = configs.config_bundle(impl, configs.BenchConfig.parse(config), page_size)
    except bench.ImplMissing as e:
        pytest.skip(str(e))
    workload = bench.shared_prefix_workload(page_size, 1000)
    runs = []

    def once():
        runs.append(bench.run_bench(bundle, workload))

    benchmark.pedantic(once, rounds=3, iterations=1, warmup_rounds=0)
    record(benchmark, workload, runs)


def record(benchmark, workload, runs) -> None:
    """The figures the dashboard reads (conformance/bench/results.py), in ``extra_info``."""
    s = runs[0]
    assert s.requests + s.aborted == workload.requests
    assert all(r.outcome() == s.outcome() for r in runs)
    benchmark.extra_info.update(
        impl=s.impl, version=s.version, workload=s.workload, page_size=workload.page_size,
        kv_slots=workload.kv_slots, requests=s.requests, aborted=s.aborted,
        requests_per_s=round(statistics.median(r.requests_per_s for r in runs), 1),
        requests_per_s_runs=[round(r.requests_per_s, 1) for r in runs],
        requests_per_s_ex_pool=round(statistics.median(r.requests_per_s_ex_pool for r in runs), 1),
        hit_rate=round(s.hit_rate, 6), evicted_tokens=s.evicted_tokens, digest=s.digest,
        op_median_us={op: round(statistics.median(r.op_medians_us()[op] for r in runs), 2)
                      for op in s.op_medians_us()})
