"""How much one torch call costs inside the benchmark loop versus in a hot loop.

Wraps ``torch.narrow_copy`` as the fast path calls it (one call per new leaf, two per split),
runs the shared-prefix workload at page 1, and prints the median time of those calls in situ
next to the median of the same call repeated in a tight loop. The gap is what cold caches
cost; it is why the fast path counts torch calls (docs/PERFORMANCE.md).

Run: .venv/bin/python scripts/torch-call-cost.py [REQUESTS]
"""

import statistics
import sys
import time

import torch

import uniradix.fast.cache as fast_cache
from uniradix.conformance.bench import loop as bench

_orig = torch.narrow_copy
_calls: list[tuple[int, int]] = []


def _timed(value, dim, start, length):
    t0 = time.perf_counter_ns()
    out = _orig(value, dim, start, length)
    _calls.append((length, time.perf_counter_ns() - t0))
    return out


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    fast_cache._narrow_copy = _timed
    try:
        bench.run_bench(bench.get_bundle("fast"), bench.make_workload("shared-prefix", 1, requests))
    finally:
        fast_cache._narrow_copy = _orig
    v = torch.arange(3000, dtype=torch.int64)
    hot = []
    for _ in range(5000):
        t0 = time.perf_counter_ns()
        _orig(v, 0, 1000, 1500)
        hot.append(time.perf_counter_ns() - t0)
    print(f"narrow_copy in the benchmark loop: {len(_calls)} calls, median "
          f"{statistics.median(t for _, t in _calls) / 1000:.1f} us "
          f"(median length {statistics.median(n for n, _ in _calls):.0f} slots)")
    print(f"narrow_copy in a hot loop:         5000 calls, median "
          f"{statistics.median(hot) / 1000:.1f} us")


if __name__ == "__main__":
    main()
