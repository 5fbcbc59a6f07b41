"""The ``uniradix`` command line (docs/CLI.md).

    uniradix replay TRACE... [--impl spec|fast|upstream] [--keep-going] [--skip-unsupported] [--check-kv]
    uniradix conform --impls spec,fast [--config NAME] [--steps N | --seconds S] [--seed K] [--check-kv]
    uniradix record --impl {spec,fast,upstream} --workload W --out T.jsonl
    uniradix bench [--impl spec,fast,upstream] [--workload shared-prefix|mooncake] [--json FILE]
    uniradix bench-storage [--storage file,upstream-file,mooncake,upstream-mooncake] [--json FILE]
    uniradix run [--requests N] [--json FILE]
    uniradix check --exhaustive [--depth D] [--config NAME|JSON] [--seconds S] [--out DIR]
    uniradix dashboard [--results DIR] [--add FILE...] [--out PAGE] [--compare BASE [--current CUR]]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from uniradix.spec.errors import CacheError

DESCRIPTION = ("uniradix: the unified radix prefix cache: its executable spec, fast path and "
               "conformance tools (docs/CLI.md)")


def cmd_replay(args: argparse.Namespace) -> int:
    from uniradix.conformance.traces.replay import replay_paths
    return replay_paths(args.traces, args.impl, keep_going=args.keep_going,
                        skip_unsupported=args.skip_unsupported,
                        check_invariants=not args.no_invariants, verbose=args.verbose,
                        check_kv=args.check_kv)


def cmd_run(args: argparse.Namespace) -> int:
    from uniradix.conformance.run import main_run
    return main_run(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="uniradix", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("replay", help="replay traces on an implementation and check every ret")
    r.add_argument("traces", nargs="+", metavar="TRACE", help="trace files (JSON Lines)")
    r.add_argument("--impl", default="spec",
                   choices=["spec", "fast", "upstream", "upstream-requests"],
                   help="implementation to replay on (default: spec)")
    r.add_argument("--keep-going", action="store_true",
                   help="go on with the next trace after a divergence (one per trace)")
    r.add_argument("--skip-unsupported", action="store_true",
                   help="report traces whose config is not supported yet, but do not fail")
    r.add_argument("--no-invariants", action="store_true",
                   help="do not run the implementation's invariants after each step")
    r.add_argument("--check-kv", action="store_true",
                   help="keep a fingerprinted KV pool and check every slot the cache hands out "
                        "(conformance/env/kvcheck.py); a wrong slot fails like an invariant")
    r.add_argument("-v", "--verbose", action="store_true", help="one line per trace")
    r.set_defaults(func=cmd_replay)

    from uniradix.conformance.bench.loop import add_bench_parser
    from uniradix.conformance.explore.conform import add_conform_parser, add_record_parser
    add_conform_parser(sub)
    add_record_parser(sub)
    add_bench_parser(sub)
    from uniradix.conformance.bench.storage import add_bench_storage_parser
    add_bench_storage_parser(sub)
    from uniradix.conformance.explore.exhaustive import add_check_parser
    add_check_parser(sub)
    from uniradix.conformance.bench.dashboard import add_dashboard_parser
    add_dashboard_parser(sub)

    w = sub.add_parser("run", help="the main job: conformance (corpus replay, lockstep) and a "
                       "short benchmark, with one summary table")
    w.add_argument("--requests", type=int, default=1000,
                   help="shared-prefix requests per benchmark run (default 1000)")
    w.add_argument("--repeat", type=int, default=3,
                   help="benchmark rounds for fast (and upstream); the spec runs once")
    w.add_argument("--lockstep-steps", type=int, default=5000,
                   help="random lockstep steps of spec vs fast (default 5000)")
    w.add_argument("--upstream", action="store_true",
                   help="also benchmark upstream sglang (needs it importable)")
    w.add_argument("--corpus", default=None, help="folder of traces to replay (default tests/corpus)")
    w.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    w.add_argument("--dashboard", default=None, metavar="PAGE",
                   help="also keep the results in PAGE's folder's history/ (by commit) and "
                        "write the dashboard page PAGE from that history")
    w.set_defaults(func=cmd_run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CacheError as e:
        print(f"uniradix: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"uniradix: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
