"""The eviction policies and Mamba copy-on-write against upstream SGLang 0.5.13.post1 (needs
sglang importable).

Run inside the upstream venv: VENV/bin/python -m pytest tests/conformance/adapters/test_upstream_policies.py.
Everywhere else the module is skipped.  What it checks: upstream still answers every recorded
``ret`` of the policy corpus (tests/corpus/upstream-policies), recording a seed again gives the
committed file, and a short ``conform --impls spec,upstream --policy P`` run finds nothing.
"""

from __future__ import annotations

import os

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import make_config, record, verify_recording, with_policy
from uniradix.conformance.traces.trace import load_trace

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh and run pytest with its python)",
                allow_module_level=True)

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "corpus", "upstream-policies")
POLICIES = ("lfu", "fifo", "mru", "filo", "priority", "slru")


@pytest.mark.parametrize("policy", POLICIES)
def test_upstream_answers_the_committed_corpus(policy):
    trace = load_trace(os.path.join(CORPUS, f"full-p1-{policy}-s002.jsonl"))
    stats = verify_recording(make_adapter("upstream", trace.config), trace.steps)
    assert stats.evictions_with_freed > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_recording_again_gives_the_committed_trace(policy):
    trace = load_trace(os.path.join(CORPUS, f"full-p1-{policy}-s003.jsonl"))
    config = with_policy(make_config("full-p1", 3), policy)
    assert config == trace.config
    steps = record(make_adapter("upstream", config), config, 3, len(trace.steps))
    assert steps == trace.steps


@pytest.mark.parametrize("policy", POLICIES)
def test_conform_spec_against_upstream_under_the_policy(policy, tmp_path):
    from uniradix.conformance.explore.conform import run_conform
    res = run_conform(["spec", "upstream"], config="full-p1", steps=1500, seed=7,
                      out=str(tmp_path), progress=False, log=lambda m: None, policy=policy)
    assert res.finding is None and res.steps == 1500


def test_upstream_answers_and_rerecords_the_copy_on_write_corpus():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "corpus", "upstream-mamba-cow",
                        "mamba-cow-p1-s004.jsonl")
    trace = load_trace(path)
    verify_recording(make_adapter("upstream", trace.config), trace.steps)
    config = make_config("mamba-cow-p1", 4)
    assert config == trace.config
    assert record(make_adapter("upstream", config), config, 4, len(trace.steps),
                  cow=True) == trace.steps
