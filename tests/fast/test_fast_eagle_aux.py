"""EAGLE bigram keys with the SWA and Mamba components on the fast path (fast/hybrid.py: the
tree's units are the bigram pairs, which the component plug-ins count as any unit), in
lockstep with the spec, with the KV check."""

from __future__ import annotations

import os

import pytest

from conftest import CORPUS
from uniradix.conformance.env.kvcheck import kv_checked
from uniradix.conformance.explore.conform import run_conform
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace


@pytest.mark.parametrize("config", ["eagle-swa-p2", "eagle-mamba-p1"])
def test_conform_eagle_with_aux_is_clean(config):
    res = run_conform([kv_checked("spec"), kv_checked("fast")], config=config, steps=400,
                      seed=2, out=None, progress=False, log=lambda m: None)
    assert res.steps == 400 and res.finding is None


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_kv_check_computes_the_state_of_the_bigram_path(impl):
    path = os.path.join(CORPUS, "regressions",
                        "kvcheck-eagle-swa-mamba-p2-state-of-the-bigram-path.jsonl")
    result = replay_trace(load_trace(path), impl, check_kv=True)
    assert result.unsupported is None and result.divergence is None, str(result.divergence)
