"""The fast path's pure helpers behave like the spec's: ``crosshair diffbehavior`` on each pair
of tests/equiv_targets.py, and an exhaustive comparison of each pair over a small domain.

The pairs: page alignment (``aligned_len``, ``aligned_units_len``), the EAGLE bigram view
(``units``), child keys and whether two keys share a child (page size 1 and 2, namespaced,
bigram units), the common prefix length in pages and the split point of a walk
(``shared_len``, ``walk_step``), and victim selection over the fast path's lazily deleted heap
(``victim``, ``leaf_order``) against the spec's oldest-leaf choice.

CrossHair runs one ``diffbehavior`` subprocess per pair, two at a time, with
``--per_condition_timeout 4 --per_path_timeout 2`` (about 40 s of wall time on two cores).
Its search is not exhaustive (it says "All paths exhausted" when it is), so every pair is
also compared on every input of a small domain (``DOMAINS``: two token values, keys up to
five units, every namespace pairing, every stamp order of three nodes with stale entries),
which is a proof within those bounds.

A difference CrossHair reports is re-run concretely: the ``Given: (...)`` arguments are
parsed and both functions called; only a difference that shows concretely fails the test
(CrossHair can report false differences, as with equal symbolic lists comparing unequal).
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest

import equiv_targets as targets
import uniradix.spec.keys as sk

PER_CONDITION_TIMEOUT = 4
PER_PATH_TIMEOUT = 2
SUBPROCESS_TIMEOUT = 180
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# crosshair imports equiv_targets (in tests/) and this module (in its own folder)
CROSSHAIR_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [os.path.dirname(os.path.abspath(__file__))]
    + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}

HAVE_CROSSHAIR = importlib.util.find_spec("crosshair") is not None


# ----------------------------------------------------------------------------------------------
# Running diffbehavior and re-running its reports
# ----------------------------------------------------------------------------------------------


def run_diff(first: str, second: str) -> dict:
    cmd = [sys.executable, "-m", "crosshair", "diffbehavior", first, second,
           f"--per_condition_timeout={PER_CONDITION_TIMEOUT}",
           f"--per_path_timeout={PER_PATH_TIMEOUT}", "--exception_equivalence=SAME_TYPE"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                              cwd=HERE, env=CROSSHAIR_ENV)
    except subprocess.TimeoutExpired:
        return {"timeout": True, "seconds": time.monotonic() - start, "cmd": cmd}
    return {"timeout": False, "seconds": time.monotonic() - start, "cmd": cmd,
            "rc": proc.returncode, "out": (proc.stdout + proc.stderr).strip()}


GIVEN = re.compile(r"^Given: \((?P<args>.*)\),\s*$")


def parse_given(report: str) -> list[dict]:
    """The keyword arguments of every ``Given: (a=1, b='x'),`` line of a report."""
    out = []
    for line in report.splitlines():
        m = GIVEN.match(line.strip())
        if not m:
            continue
        call = ast.parse(f"f({m.group('args')})", mode="eval").body
        assert isinstance(call, ast.Call) and not call.args
        out.append({k.arg: ast.literal_eval(k.value) for k in call.keywords})
    return out


def outcome(fn, kwargs: dict) -> Any:
    try:
        return ("returns", fn(**kwargs))
    except Exception as e:  # noqa: BLE001 - compared by type, as --exception_equivalence
        return ("raises", type(e).__name__)


def resolve(dotted: str):
    mod, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(mod), name)


def confirmed_differences(first: str, second: str, report: str) -> list[str]:
    """The reported differences that show when the functions are called for real."""
    f, g = resolve(first), resolve(second)
    given = parse_given(report)
    if not given:
        return [f"no re-runnable difference in the report:\n{report}"]
    real = []
    for kwargs in given:
        a, b = outcome(f, kwargs), outcome(g, kwargs)
        if a != b:
            real.append(f"{kwargs}: {first} {a}, {second} {b}")
    return real


@pytest.fixture(scope="module")
def diff_results():
    if not HAVE_CROSSHAIR:
        pytest.skip("crosshair-tool is not installed (pip install crosshair-tool==0.0.113)")
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = {name: pool.submit(run_diff, f"equiv_targets.spec_{name}",
                                  f"equiv_targets.fast_{name}") for name in targets.PAIRS}
        results = {name: f.result() for name, f in futs.items()}
    print(f"\ncrosshair diffbehavior: {len(results)} pairs, 2 at a time, "
          f"{time.monotonic() - start:.1f} s wall: "
          + ", ".join(f"{n} {r['seconds']:.1f}s" for n, r in results.items()))
    return results


# ----------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------


# the symbolic sweep (about 70 s of the default suite on two cores) runs behind `slow`
# (`pytest -m slow`, README); the default suite keeps the exhaustive small-domain comparison of
# every pair below and the planted-difference check of the harness
@pytest.mark.slow
@pytest.mark.parametrize("name", targets.PAIRS)
def test_diffbehavior_finds_no_difference(diff_results, name):
    res = diff_results[name]
    assert not res["timeout"], f"crosshair ran over {SUBPROCESS_TIMEOUT}s: {res['cmd']}"
    out = res["out"]
    if res["rc"] == 0 and "No differences found" in out:
        return
    first, second = f"equiv_targets.spec_{name}", f"equiv_targets.fast_{name}"
    if "Given:" not in out:
        pytest.fail(f"crosshair diffbehavior failed (rc={res['rc']}):\n{out}")
    real = confirmed_differences(first, second, out)
    assert not real, "spec and fast differ (confirmed concretely):\n" + "\n".join(real)


@pytest.mark.parametrize("name", targets.PAIRS)
def test_pairs_agree_on_every_input_of_a_small_domain(name):
    spec, fast = getattr(targets, f"spec_{name}"), getattr(targets, f"fast_{name}")
    domain = targets.DOMAINS[name]()
    assert len(domain) > 20
    checked = 0
    for args in domain:
        a = outcome(spec, dict(zip(_params(spec), args, strict=True)))
        b = outcome(fast, dict(zip(_params(fast), args, strict=True)))
        assert a == b, f"{name}{args}: spec {a}, fast {b}"
        checked += a != ("returns", None)
    assert checked > 0, f"{name}: every input of the domain was outside the guard"


def _params(fn) -> list[str]:
    import inspect
    return list(inspect.signature(fn).parameters)


def test_every_pair_has_both_sides_and_a_domain():
    for name in targets.PAIRS:
        spec, fast = getattr(targets, f"spec_{name}"), getattr(targets, f"fast_{name}")
        assert _params(spec) == _params(fast), name
        assert name in targets.DOMAINS


# ----------------------------------------------------------------------------------------------
# The machinery: a planted difference is found and confirmed; a false one is not
# ----------------------------------------------------------------------------------------------


def planted_aligned_len(n: int, page_size: int) -> int | None:
    """``fast_aligned_len`` with an off-by-one at a page boundary."""
    r = targets.fast_aligned_len(n, page_size)
    return r + 1 if r is not None and n == 5 and page_size == 2 else r


def test_diffbehavior_finds_a_planted_difference_and_the_rerun_confirms_it():
    if not HAVE_CROSSHAIR:
        pytest.skip("crosshair-tool is not installed")
    first, second = "equiv_targets.spec_aligned_len", "test_crosshair_equiv.planted_aligned_len"
    res = run_diff(first, second)
    assert not res["timeout"] and res["rc"] != 0 and "Given:" in res["out"], res
    real = confirmed_differences(first, second, res["out"])
    assert real and "'n': 5" in real[0] and "'page_size': 2" in real[0], real


def test_rerun_clears_a_false_report():
    report = ("Given: (n=7, page_size=4),\n"
              "  equiv_targets.spec_aligned_len : returns 4\n"
              "  equiv_targets.fast_aligned_len : returns 5\n")
    assert parse_given(report) == [{"n": 7, "page_size": 4}]
    assert confirmed_differences("equiv_targets.spec_aligned_len",
                                 "equiv_targets.fast_aligned_len", report) == []
    assert parse_given("Given: (ek1=None, a0=0, a1=1, ek2='a', b0=0, b1=1),") == [
        {"ek1": None, "a0": 0, "a1": 1, "ek2": "a", "b0": 0, "b1": 1}]
    assert confirmed_differences("equiv_targets.spec_aligned_len",
                                 "equiv_targets.fast_aligned_len", "garbage")


def test_spec_oldest_is_the_victim_rule_the_pairs_use():
    assert sk.oldest([(3, 0), (1, 0), (2, 0)]) == 1
