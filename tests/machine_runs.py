"""One way to run the Hypothesis lockstep machine, spec against fast with the request-level
ops on, for the machine tests of one config draw (importing this skips the test module when
hypothesis or torch is missing)."""

from collections.abc import Callable
from typing import Any

import pytest

from uniradix.conformance.explore.machine import ACTIONS, make_machine

pytest.importorskip("hypothesis")
pytest.importorskip("torch")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402


def run_machine(draw: Callable[[Any], Any], name: str, *, examples: int, steps: int) -> None:
    """``examples`` runs of up to ``steps`` steps, each on a config ``draw`` draws; a finding
    fails the test with the steps that led to it."""
    run_state_machine_as_test(
        make_machine(["spec", "fast"], draw=draw, actions=ACTIONS, name=name),
        settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                          database=None, suppress_health_check=list(HealthCheck)))
