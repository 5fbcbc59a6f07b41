"""Record golden traces from upstream SGLang under each eviction policy, in one process.

Usage (with the upstream virtualenv's python, uniradix importable there):

    python scripts/record-upstream-policies.py OUT_DIR CONFIGS POLICIES FIRST-LAST [STEPS]

e.g. ``python scripts/record-upstream-policies.py tests/corpus/upstream-policies
full-p1 lfu,fifo,mru,filo,priority,slru 1-20``.  CONFIGS and POLICIES are comma-separated
(conformance/explore/driver.py's CONFIG_NAMES and POLICY_CHOICES); seeds FIRST..LAST; STEPS default 400.
Files: OUT_DIR/<config>-<policy>-s<seed, 3 digits>.jsonl (for ``lru``: <config>-s<seed>.jsonl;
``mamba-cow-p1`` under ``lru`` records tests/corpus/upstream-mamba-cow).  Each trace is what
``python -m uniradix.conformance.explore.driver --impl upstream --config C --policy P --seed K`` records
(upstream's sanity_check() after every step); one process saves importing sglang per trace.
A recording upstream rejects or crashes on is reported (no file) and the others go on.
"""

import sys

from uniradix.conformance.explore.driver import config_label
from uniradix.conformance.explore.driver import main as record


def run(argv: list) -> int:
    if len(argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    out, configs, policies, seeds = argv[:4]
    steps = argv[4] if len(argv) == 5 else "400"
    first, last = (int(x) for x in seeds.split("-"))
    failed = 0
    for config in configs.split(","):
        for policy in policies.split(","):
            for seed in range(first, last + 1):
                path = f"{out}/{config_label(config, policy)}-s{seed:03d}.jsonl"
                try:
                    failed += record(["--impl", "upstream", "--config", config, "--policy",
                                      policy, "--seed", str(seed), "--steps", steps,
                                      "--out", path]) != 0
                except Exception as e:  # noqa: BLE001 - an upstream crash: report, go on
                    print(f"{path}: upstream crashed: {type(e).__name__}: {e}")
                    failed += 1
    print(f"{failed} recordings failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
