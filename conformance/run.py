"""``uniradix run``: the main job behind ``make run``.

1. Conformance: replay every trace under ``tests/corpus/`` on the spec and the fast path, then a
   short randomized lockstep run of spec vs fast (``uniradix conform``'s loop).
2. Benchmark: the built-in shared-prefix workload, shortened, at page size 1 and 16, through the
   bench harness (``uniradix bench``'s loop) on spec, fast and, where sglang imports, upstream.
3. One summary table; ``--json FILE`` writes the same numbers.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

from uniradix.conformance.bench.loop import compare, print_comparison, shared_prefix_workload, write_json
from uniradix.conformance.explore.conform import run_conform
from uniradix.conformance.traces.replay import expected_divergence, replay_trace
from uniradix.conformance.traces.trace import load_trace

IMPLS = ("spec", "fast")

# Corpus folders the fast path does not model yet, replayed on the spec only (none now: Mamba
# copy-on-write was the last). Folder names or trace file names; take an entry off once fast
# replays it.
SPEC_ONLY_CORPORA: tuple[str, ...] = ()

# Corpora the spec cannot replay yet (none now: the host tier with SWA was the last).
# Folder names or trace file names; skipped, unread, by `uniradix run` and
# tests/conformance/traces/test_corpus_replay.py with this reason.  Take an entry off once the spec replays
# it.
AWAITING_SPEC: tuple[str, ...] = ()
AWAITING_SPEC_REASON = "awaits the spec's host tier with SWA (conformance/run.py AWAITING_SPEC)"


def find_corpus(explicit: str | None) -> list[str]:
    folder = explicit or os.path.join("tests", "corpus")
    return sorted(glob.glob(os.path.join(folder, "**", "*.jsonl"), recursive=True))


def is_spec_only(path: str) -> bool:
    """Whether a corpus trace lies in a folder (or is a file) that only the spec replays so far."""
    parts = os.path.normpath(path).split(os.sep)
    return any(d in parts[:-1] for d in SPEC_ONLY_CORPORA) or parts[-1] in SPEC_ONLY_CORPORA


def is_awaiting_spec(path: str) -> bool:
    """Whether a corpus trace is one the spec cannot replay yet (:data:`AWAITING_SPEC`)."""
    parts = os.path.normpath(path).split(os.sep)
    return any(d in parts[:-1] for d in AWAITING_SPEC) or parts[-1] in AWAITING_SPEC


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
        elif done == total:
            print(line, file=sys.stderr, flush=True)
    return show


def main_run(args: argparse.Namespace) -> int:
    from uniradix.conformance.bench.results import machine_info
    results: dict = {"corpus": {}, "lockstep": {}, "bench": [], "machine": machine_info()}
    status = 0

    paths = find_corpus(args.corpus)
    waiting = [p for p in paths if is_awaiting_spec(p)]
    if waiting:
        print(f"skipped {len(waiting)} corpus traces: {AWAITING_SPEC_REASON}", file=sys.stderr)
        paths = [p for p in paths if not is_awaiting_spec(p)]
    for impl in IMPLS:
        steps = divergences = traces = 0
        bar = progress_bar(f"replay {impl}")
        for k, path in enumerate(paths, 1):
            bar(k, len(paths))
            if impl != "spec" and is_spec_only(path):
                continue
            r = replay_trace(load_trace(path), impl)
            if r.unsupported is not None:
                continue
            traces += 1
            steps += r.steps
            if r.divergence is not None and r.divergence.step == expected_divergence(path):
                # on purpose (docs/SPEC.md, issue 18); tests/conformance/traces/test_corpus_replay.py
                continue
            if r.divergence is not None:
                divergences += 1
                print(str(r.divergence))
        results["corpus"][impl] = {"traces": traces, "steps": steps, "divergences": divergences}
        status |= 1 if divergences else 0

    t0 = time.monotonic()
    lock = run_conform(list(IMPLS), steps=args.lockstep_steps, seed=0,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    results["lockstep"] = {"steps": lock.steps, "divergences": lock.divergences,
                           "violations": lock.violations, "seconds": round(time.monotonic() - t0, 1)}
    if lock.divergences or lock.violations:
        status = 1

    impls = list(IMPLS) + (["upstream"] if args.upstream else [])
    comparisons = []
    for page_size in (1, 16):
        workload = shared_prefix_workload(page_size=page_size, requests=args.requests)
        cmp = compare(impls, workload, repeats=args.repeat, strict=False,
                      log=lambda m: print(m, file=sys.stderr, flush=True), repeats_for={"spec": 1})
        comparisons.append(cmp)
        results["bench"].append(cmp.summary())
        if not cmp.identical:
            status = 1

    print()
    print("conformance")
    print(f"  golden corpus replay   {'impl':<6} {'traces':>7} {'steps':>8} {'divergences':>12}")
    for impl, c in results["corpus"].items():
        print(f"  {'':<22} {impl:<6} {c['traces']:>7} {c['steps']:>8} {c['divergences']:>12}")
    lk = results["lockstep"]
    print(f"  lockstep spec vs fast  {lk['steps']} random steps, {lk['divergences']} divergences, "
          f"{lk['violations']} violations ({lk['seconds']} s)")
    print()
    print(f"benchmark: shared-prefix, {args.requests} requests (uniradix bench for the full size)")
    for cmp in comparisons:
        print_comparison(cmp)
    if args.json:
        print()
        write_json(args.json, results)
    if getattr(args, "dashboard", None):
        from uniradix.conformance.bench.dashboard import record_run
        record_run(results, args.dashboard)
    return status
