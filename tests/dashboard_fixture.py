"""A small bench-results history for the dashboard tests (tests/conformance/bench/test_dashboard.py and
tests/conformance/bench/test_dashboard_browser.py): real ``uniradix bench`` numbers from a tiny workload, in
the JSON shapes the producers write, stored for two commits."""

from __future__ import annotations

import copy
import json
import os

from uniradix.conformance.bench import loop as bench
from uniradix.conformance.bench import results as R

COMMIT_A = {"sha": "a1" * 20, "date": "2026-11-20T09:00:00+00:00", "subject": "older commit",
            "dirty": False}
COMMIT_B = {"sha": "b2" * 20, "date": "2026-11-27T09:00:00+00:00", "subject": "newer commit",
            "dirty": False}
MACHINE = {"cpus": 2, "cpus_usable": 2, "load": [0.5, 0.4, 0.3], "load_source": "now",
           "cpu_model": "test CPU", "platform": "Linux x86_64", "python": "3.11"}

_BENCH_CACHE: dict = {}


def bench_json(requests: int = 60, page_sizes: tuple = (1, 16)) -> dict:
    """What ``uniradix bench --impl spec,fast --repeat 3 --spec-repeat 1 --memory --json``
    writes, measured now on a tiny shared-prefix workload (cached for the session)."""
    key = (requests, page_sizes)
    if key not in _BENCH_CACHE:
        comparisons = []
        for ps in page_sizes:
            w = bench.shared_prefix_workload(page_size=ps, requests=requests)
            cmp = bench.compare(["spec", "fast"], w, repeats=3, strict=True,
                                repeats_for={"spec": 1})
            comparisons.append(cmp.summary())
        memory = [bench.memory_per_token("fast", 16, 3).summary()]
        _BENCH_CACHE[key] = {"comparisons": comparisons, "memory": memory}
    return copy.deepcopy(_BENCH_CACHE[key])


def scale_impl(data: dict, impl: str, factor: float) -> dict:
    """A copy of a bench JSON with ``impl``'s requests/s (every round) times ``factor``."""
    out = copy.deepcopy(data)
    for c in out["comparisons"]:
        d = c["impls"].get(impl)
        if d is None:
            continue
        d["requests_per_s_runs"] = [round(x * factor, 1) for x in d["requests_per_s_runs"]]
        d["requests_per_s_median"] = round(d["requests_per_s_median"] * factor, 1)
        for r in d["runs"]:
            r["requests_per_s"] = round(r["requests_per_s"] * factor, 1)
    return out


def run_json(divergences: int = 0) -> dict:
    """The conformance part of ``uniradix run --json`` (its bench part left out)."""
    return {"corpus": {"spec": {"traces": 40, "steps": 12000, "divergences": 0},
                       "fast": {"traces": 40, "steps": 12000, "divergences": divergences}},
            "lockstep": {"steps": 5000, "divergences": 0, "violations": 0, "seconds": 9.5},
            "bench": [], "machine": dict(MACHINE)}


def kernels_json() -> dict:
    """The shape ``python -m uniradix.kernels.bench --json`` writes (fixture numbers)."""
    rows = []
    for layout in ("layer_first", "page_first_direct"):
        for direction in ("backup", "load_all"):
            for kib, triton, memcpy in ((4, 40.0, 9.0), (64, 50.0, 30.0)):
                ceiling = 55.0
                rows.append({"layout": layout, "direction": direction, "page_size": 16,
                             "page_kib": kib, "bytes": 1 << 27, "verified": True,
                             "triton_gbps": triton, "torch_gbps": 20.0, "memcpy_gbps": memcpy,
                             "ceiling_gbps": ceiling, "triton_of_ceiling": triton / ceiling,
                             "triton_over_memcpy": triton / memcpy,
                             "target_ceiling_90": (triton / ceiling >= 0.9) if kib >= 64 else None,
                             "target_3x_memcpy": (triton / memcpy >= 3) if kib < 16 else None})
    return {"env": {"device": "fixture GPU", "torch": "2.x", "triton": "3.x",
                    "memcpy_engine": "cudaMemcpyAsync", "dtype": "torch.float16", "layers": 4,
                    "payload_bytes": 1 << 27, "reps": 5, "seconds": 100.0},
            "ceilings_gbps": {"d2d": 3000.0, "h2d": 55.0, "d2h": 55.0}, "rows": rows,
            "skipped": []}


def write(path: str, data: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path


def make_history(root: str) -> str:
    """``root/history``: commit A (bench, run, kernels) and commit B (bench, run); returns the
    results folder."""
    results_dir = os.path.join(root, "history")
    data = bench_json()
    for commit, files in ((COMMIT_A, [data, run_json(), kernels_json()]),
                          (COMMIT_B, [scale_impl(data, "fast", 1.02), run_json()])):
        for k, d in enumerate(files):
            rec = R.normalize(d, commit=commit, machine=MACHINE,
                              recorded_at=commit["date"][:17] + f"{k:02d}+00:00")
            R.store(rec, results_dir)
    return results_dir
