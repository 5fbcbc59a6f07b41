"""CrossHair checks the PEP 316 contracts of the pure key helpers (``uniradix.spec.keys``).

One ``crosshair check`` subprocess per contracted function (so a known finding on one function
can be an xfail without hiding the others), run two at a time in a module-scoped fixture, with
bounded time: ``--per_condition_timeout 4 --per_path_timeout 2`` and a 150 s subprocess limit.
About 70 s of CPU in all; roughly 40 s of wall time on a 2-core machine.

Targets are given as ``<file of uniradix.spec.keys>:<line of the def>``, not as the dotted name:
``crosshair check uniradix.spec.keys`` (crosshair-tool 0.0.113) crashes with
``NotADirectoryError: MultiplexedPath only supports directories`` in
``crosshair.codeconfig.collect_options``, because ``uniradix`` is a namespace package served by
setuptools' editable finder (there is no ``uniradix/__init__.py`` to read options from).

CrossHair has a known false alarm: two equal symbolic lists can compare unequal with ``==``.
So every reported counterexample is re-run concretely with the real function: the call is
parsed from the report (``... when calling common_prefix_len([0], [0], 1) (which returns 0)``),
the ``pre:`` lines are evaluated (a counterexample that violates them is no counterexample), the
function is called, and the ``post:`` lines are evaluated on the real result.  The test fails
only when the concrete re-run violates the contract too (or the report cannot be re-run).
"""

from __future__ import annotations

import ast
import concurrent.futures
import copy
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time

import pytest

import uniradix.spec.keys as keys

PER_CONDITION_TIMEOUT = 4
PER_PATH_TIMEOUT = 2
SUBPROCESS_TIMEOUT = 300

HAVE_CROSSHAIR = importlib.util.find_spec("crosshair") is not None

# Spec contract bugs CrossHair finds (strict xfail: the test starts passing when they are fixed).
KNOWN_SPEC_BUGS: dict[str, str] = {}


# ----------------------------------------------------------------------------------------------
# Contracts and the concrete re-run
# ----------------------------------------------------------------------------------------------


def contract_lines(fn, kind: str) -> list[str]:
    out = []
    for line in (fn.__doc__ or "").splitlines():
        line = line.strip()
        if line.startswith(kind + ":"):
            out.append(line[len(kind) + 1:].strip())
    return out


def contracted_functions() -> list[str]:
    return [name for name, fn in inspect.getmembers(keys, inspect.isfunction)
            if fn.__module__ == keys.__name__ and contract_lines(fn, "post")]


def parse_call(report: str) -> tuple[str, list, dict]:
    """``name(args...)`` after the last "when calling " of a CrossHair report, as literals."""
    at = report.rfind("when calling ")
    if at < 0:
        raise ValueError(f"no call in report: {report!r}")
    text = report[at + len("when calling "):]
    for end in range(len(text)):
        if text[end] != ")":
            continue
        try:
            tree = ast.parse(text[: end + 1], mode="eval")
        except SyntaxError:
            continue
        call = tree.body
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            break
        args = [ast.literal_eval(a) for a in call.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
        return call.func.id, args, kwargs
    raise ValueError(f"cannot parse the call in report: {report!r}")


def concrete_violation(report: str) -> str | None:
    """Re-run a reported counterexample with the real function; the violation it shows, or
    None when the contract holds concretely (a CrossHair false alarm)."""
    try:
        name, args, kwargs = parse_call(report)
        fn = getattr(keys, name)
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
    except Exception as e:  # noqa: BLE001 - cannot re-run: count it as real
        return f"cannot re-run the report concretely ({type(e).__name__}: {e}): {report}"
    scope = dict(vars(keys))
    scope.update(copy.deepcopy(dict(bound.arguments)))
    for pre in contract_lines(fn, "pre"):
        try:
            if not eval(pre, dict(scope)):  # noqa: S307 - our own docstrings
                return None
        except Exception:  # noqa: BLE001 - a precondition that cannot hold
            return None
    try:
        ret = fn(*copy.deepcopy(bound.args), **copy.deepcopy(bound.kwargs))
    except Exception as e:  # noqa: BLE001
        return f"{name}{tuple(args)} raises {type(e).__name__}: {e}"
    scope["__return__"] = ret
    for post in contract_lines(fn, "post"):
        try:
            ok = eval(post, dict(scope))  # noqa: S307
        except Exception as e:  # noqa: BLE001
            return f"{name}{tuple(args)} -> {ret!r}: post {post!r} raises {type(e).__name__}"
        if not ok:
            return f"{name}{tuple(args)} -> {ret!r}: post {post!r} is false"
    return None


ERROR_LINE = re.compile(r"^(?P<file>.*?):(?P<line>\d+): error: (?P<msg>.*)$")


def run_crosshair(name: str) -> dict:
    fn = getattr(keys, name)
    line = inspect.getsourcelines(fn)[1]
    target = f"{inspect.getsourcefile(keys)}:{line}"
    cmd = [sys.executable, "-m", "crosshair", "check",
           f"--per_condition_timeout={PER_CONDITION_TIMEOUT}",
           f"--per_path_timeout={PER_PATH_TIMEOUT}", target]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                              cwd=os.path.dirname(inspect.getsourcefile(keys)))
    except subprocess.TimeoutExpired:
        return {"timeout": True, "seconds": time.monotonic() - start, "cmd": cmd}
    return {"timeout": False, "seconds": time.monotonic() - start, "cmd": cmd,
            "rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


@pytest.fixture(scope="module")
def crosshair_results():
    if not HAVE_CROSSHAIR:
        pytest.skip("crosshair-tool is not installed (pip install crosshair-tool==0.0.113)")
    names = contracted_functions()
    workers = max(1, min(len(names), os.cpu_count() or 1))
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = dict(zip(names, pool.map(run_crosshair, names), strict=True))
    total = time.monotonic() - start
    print(f"\ncrosshair: {len(names)} functions, {workers} at a time, {total:.1f} s wall: "
          + ", ".join(f"{n} {r['seconds']:.1f}s" for n, r in results.items()))
    return results


# ----------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------


def test_keys_has_contracted_functions():
    names = contracted_functions()
    assert {"common_prefix_len", "page_aligned_len", "split_point_ok", "oldest"} <= set(names)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_SPEC_BUGS[n]))
    if n in KNOWN_SPEC_BUGS else n
    for n in contracted_functions()
])
def test_crosshair_contract(crosshair_results, name):
    res = crosshair_results[name]
    assert not res["timeout"], f"crosshair ran over {SUBPROCESS_TIMEOUT}s: {res['cmd']}"
    out = (res["stdout"] + res["stderr"]).strip()
    if res["rc"] == 0 and not out:
        return
    reports = [m.group("msg") for m in map(ERROR_LINE.match, out.splitlines()) if m]
    assert reports, f"crosshair failed without a report (rc={res['rc']}):\n{out}"
    real = [v for v in map(concrete_violation, reports) if v is not None]
    assert not real, "contract violated (confirmed concretely):\n" + "\n".join(real)


# ----------------------------------------------------------------------------------------------
# The re-run machinery itself (fast, no crosshair needed)
# ----------------------------------------------------------------------------------------------


def test_parse_call():
    name, args, kwargs = parse_call(
        "false when calling common_prefix_len([0], [0], 1) (which returns 0)")
    assert (name, args, kwargs) == ("common_prefix_len", [[0], [0], 1], {})
    assert parse_call("IndexError: x when calling units_to_tokens(('',), True)") == (
        "units_to_tokens", [("",), True], {})
    assert parse_call("false when calling oldest(stamps=[(1, 2), (0, 5)])") == (
        "oldest", [], {"stamps": [(1, 2), (0, 5)]})
    with pytest.raises(ValueError):
        parse_call("false when calling f(<object at 0x1>)")


def test_concrete_rerun_clears_the_known_false_alarm():
    # CrossHair's equal-lists-compare-unequal false alarm: concretely the contract holds
    assert concrete_violation(
        "false when calling common_prefix_len([0], [0], 1) (which returns 0)") is None
    assert concrete_violation("false when calling page_aligned_len(7, 4)") is None
    # a report whose arguments break a precondition is no counterexample
    assert concrete_violation("false when calling page_aligned_len(-1, 4)") is None


def test_concrete_rerun_confirms_a_real_violation(monkeypatch):
    # Plant a bug (same contracts, wrong body): the re-run must confirm the violation.
    def page_aligned_len(n, page_size):
        return n - n % page_size + (1 if n == 5 else 0)
    page_aligned_len.__doc__ = keys.page_aligned_len.__doc__
    monkeypatch.setattr(keys, "page_aligned_len", page_aligned_len)
    found = concrete_violation("false when calling page_aligned_len(5, 4) (which returns 5)")
    assert found is not None and "page_aligned_len" in found
    # Before the pre: line on bigram units, this raised IndexError; now it is no counterexample.
    assert concrete_violation(
        "error: IndexError: string index out of range when calling units_to_tokens(('',), True)") is None
    assert concrete_violation("false when calling f(<unreprable>)") is not None
