"""Benchmarks of the spec on the built-in shared-prefix workload (skipped by default; run with
`make bench`).  Reported as requests/s in extra_info; compare ratios measured in one run."""

import pytest

from uniradix.conformance.adapters import make_adapter
from uniradix.conformance.workload import SharedPrefix, run_shared_prefix


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_spec(benchmark, page_size):
    w = SharedPrefix(page_size=page_size).scaled(500)

    def once():
        return run_shared_prefix(make_adapter("spec", w.config()), w)

    stats = benchmark.pedantic(once, rounds=3, iterations=1)
    benchmark.extra_info.update(impl="spec", workload="shared-prefix", page_size=page_size,
                                requests=stats.requests, hit_rate=round(stats.hit_rate, 4),
                                evicted_tokens=stats.evicted_tokens,
                                requests_per_s=round(stats.requests_per_s, 1))
    assert stats.requests + stats.aborted == w.requests
