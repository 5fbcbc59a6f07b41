"""The storage tier against sglang 0.5.13.post1 (needs sglang importable: run with the upstream
venv's python; skipped everywhere else): the committed storage corpus replays on upstream, the
storage workload runs the spec and upstream in lockstep, and the Hypothesis storage machine
does too."""

from __future__ import annotations

import glob
import os

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_storage_machine import make_machine, storage_configs

from stories import LockstepFace
from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.conformance.explore.storage_driver import (
    STORAGE_CONFIG_NAMES,
    make_storage_config,
    storage_segment,
)
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (run with the upstream venv's python)",
                allow_module_level=True)

BASE = os.path.join(os.path.dirname(__file__), "..", "..", "corpus", "upstream-storage")


@pytest.mark.parametrize("name", STORAGE_CONFIG_NAMES)
def test_committed_storage_trace_replays_on_upstream(name):
    paths = sorted(glob.glob(os.path.join(BASE, f"{name}-s*.jsonl")))
    if not paths:
        pytest.skip(f"no committed {name} traces")
    result = replay_trace(load_trace(paths[0]), "upstream")
    assert result.unsupported is None and result.divergence is None, str(result.divergence)


@pytest.mark.parametrize("name", ["storage-wt-p1-wc", "storage-wb-p4-to"])
def test_storage_workload_in_lockstep(name):
    config = make_storage_config(name, 77)
    ls = Lockstep([make_adapter("spec", config), make_adapter("upstream", config)],
                  ["spec", "upstream"])
    taken, finding = storage_segment(ls, config, "lockstep-test", 300)
    assert finding is None, str(finding)
    assert len(taken) >= 300


def test_storage_machine_in_lockstep():
    def build(config):
        return _Pair(config)
    run_state_machine_as_test(make_machine(build, storage_configs()), settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None, database=None))


class _Pair(LockstepFace):
    """Spec and upstream behind one adapter face: every step in lockstep."""

    def __init__(self, config) -> None:
        super().__init__(config, "upstream")


def test_upstream_hangs_prefetched_pages_below_a_node_without_a_host_copy():
    """docs/SPEC.md (storage tier): under write-through a prefetch whose walk ends in a
    device-only node (its backup failed for lack of host room) hangs its pages there on
    0.5.13.post1; the spec and fast drop them (spec/storage.py ``may_take_host_child``) and free
    their host slots, so the trace's last step frees 36 host slots where upstream frees 32."""
    path = os.path.join(BASE, "..", "regressions",
                        "conform-storage-wt-p4-to-s2-prefetch-below-device-only-node.jsonl")
    trace = load_trace(path)
    result = replay_trace(trace, "upstream")
    d = result.divergence
    assert d is not None and (d.step, d.op, d.field) == (20, "check_prefetch_progress",
                                                         "host_freed"), str(d)
    assert len(trace.steps[20]["ret"]["host_freed"]) == 36 and len(d.actual) == 32
