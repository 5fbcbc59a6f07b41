"""The nightly run: the Hypothesis lockstep machine (spec against fast, conformance/explore/machine.py)
under the ``nightly`` profile of tests/conftest.py: CrossHair as Hypothesis's backend
(hypothesis-crosshair), 2,000 runs of up to 200 steps each (318 s here; the default suite's
machine runs 25 of 60, with spec against spec).  Skipped unless that profile is loaded:

    .venv/bin/python -m pytest tests/conformance/explore/test_nightly.py --hypothesis-profile=nightly

The machine's config chooser realizes each draw at once (its choices size pools and index
lists, and the fast path hands them to torch), so CrossHair steers the choice sequence (which
rule, which seed, which config) rather than the cache's own branches; docs/CHECKS.md says
what that does and does not cover.
"""

from __future__ import annotations

import importlib.util

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from uniradix.conformance.explore import machine  # noqa: E402


def nightly_loaded() -> bool:
    return getattr(settings.default, "backend", "hypothesis") == "crosshair"


def _realizing_integer(self, lo: int, hi: int) -> int:
    """HypothesisChooser.integer, with the drawn value made concrete (a symbolic value cannot
    be a dict key or a bound of a strategy outside CrossHair's tracing)."""
    if lo == hi:
        return lo
    value = self.data.draw(st.integers(int(lo), int(hi)))
    provider = getattr(getattr(self.data, "conjecture_data", None), "provider", None)
    realize = getattr(provider, "realize", None)
    return int(realize(value)) if realize is not None else value


@pytest.mark.timeout(0)
def test_lockstep_machine_nightly(monkeypatch):
    if not nightly_loaded():
        pytest.skip("the nightly profile is not loaded (--hypothesis-profile=nightly)")
    if importlib.util.find_spec("hypothesis_crosshair_provider") is None:
        pytest.fail("the nightly profile needs hypothesis-crosshair "
                    "(pip install hypothesis-crosshair)")
    monkeypatch.setattr(machine.HypothesisChooser, "integer", _realizing_integer)
    run_state_machine_as_test(machine.make_machine(["spec", "fast"], name="NightlyMachine"),
                              settings=settings.default)
