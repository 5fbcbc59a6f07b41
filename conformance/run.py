"""``uniradix run``: the main job.  Replays the golden corpus on every implementation, runs the
built-in shared-prefix workload on each, and prints one summary table (optionally JSON)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

from uniradix.conformance.adapters import ADAPTERS, make_adapter
from uniradix.conformance.replay import replay_trace
from uniradix.conformance.trace import load_trace
from uniradix.conformance.workload import SharedPrefix, run_shared_prefix


def find_corpus(explicit: str | None) -> list[str]:
    folder = explicit or os.path.join("tests", "corpus")
    return sorted(glob.glob(os.path.join(folder, "**", "*.jsonl"), recursive=True))


def progress_bar(label: str):
    tty = sys.stderr.isatty()
    last = [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if done != total and now - last[0] < 0.5:
            return
        last[0] = now
        width = 30
        fill = int(width * done / max(total, 1))
        line = f"{label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}"
        if tty:
            print("\r" + line, end="" if done != total else "\n", file=sys.stderr, flush=True)
        elif done == total or done % max(total // 4, 1) == 0:
            print(line, file=sys.stderr, flush=True)
    return show


def main_run(args: argparse.Namespace) -> int:
    impls = sorted(ADAPTERS)
    results: dict = {"corpus": {}, "workloads": []}
    status = 0

    paths = find_corpus(args.corpus)
    for impl in impls:
        steps = divergences = traces = 0
        bar = progress_bar(f"replay {impl}")
        for k, path in enumerate(paths, 1):
            r = replay_trace(load_trace(path), impl)
            if r.unsupported is not None:
                continue
            traces += 1
            steps += r.steps
            if r.divergence is not None:
                divergences += 1
                print(str(r.divergence))
            bar(k, len(paths))
        results["corpus"][impl] = {"traces": traces, "steps": steps, "divergences": divergences}
        status |= 1 if divergences else 0

    for page_size in (1, 16):
        w = SharedPrefix(page_size=page_size).scaled(args.requests)
        for impl in impls:
            adapter = make_adapter(impl, w.config())
            stats = run_shared_prefix(adapter, w, progress_bar(f"shared-prefix p{page_size} {impl}"))
            bad = adapter.violations()
            if bad:
                print(f"{impl}: invariants violated after the workload: {bad[:3]}")
                status = 1
            results["workloads"].append({
                "workload": "shared-prefix", "page_size": page_size, "impl": impl,
                "requests": stats.requests, "aborted": stats.aborted, "kv_slots": w.kv_slots,
                "requests_per_s": round(stats.requests_per_s, 1),
                "hit_rate": round(stats.hit_rate, 4), "evicted_tokens": stats.evicted_tokens,
                "op_median_us": {k: round(v, 1) for k, v in stats.op_medians_us().items()},
            })

    print()
    print("conformance (golden corpus replay)")
    print(f"  {'impl':<8} {'traces':>7} {'steps':>8} {'divergences':>12}")
    for impl, c in results["corpus"].items():
        print(f"  {impl:<8} {c['traces']:>7} {c['steps']:>8} {c['divergences']:>12}")
    print()
    print(f"benchmark (shared-prefix, {args.requests} requests; cache work only)")
    print(f"  {'impl':<8} {'page':>4} {'req/s':>9} {'hit rate':>9} {'evicted':>9} "
          f"{'admit us':>9} {'prefill us':>10} {'finish us':>9}")
    for row in results["workloads"]:
        med = row["op_median_us"]
        print(f"  {row['impl']:<8} {row['page_size']:>4} {row['requests_per_s']:>9.1f} "
              f"{row['hit_rate']:>9.3f} {row['evicted_tokens']:>9} {med.get('req_admit', 0):>9.0f} "
              f"{med.get('req_chunk', 0):>10.0f} {med.get('req_finish', 0):>9.0f}")
    if args.json:
        if os.path.dirname(args.json):
            os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {args.json}")
    return status
