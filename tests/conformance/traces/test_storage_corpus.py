"""The golden storage corpus (tests/corpus/upstream-storage, recorded from sglang 0.5.13.post1)
is there and complete, and replays on the spec with 0 divergences and sound invariants after
every step: seeds 1-3 of each config in the default suite, every trace with ``-m slow`` (all
240 cost about 190 s of CPU).  The same on fast (fast/tiers/storage.py): seed 1 of each config in
the default suite, every trace with ``-m slow`` (about 40 s of CPU)."""

from __future__ import annotations

import glob
import os
import re

import pytest

from conftest import CORPUS
from uniradix.conformance.explore.storage_driver import STORAGE_CONFIG_NAMES
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace

BASE = os.path.join(CORPUS, "upstream-storage")


def test_storage_corpus_has_20_traces_of_300_steps_per_config():
    for name in STORAGE_CONFIG_NAMES:
        found = sorted(glob.glob(os.path.join(BASE, f"{name}-s*.jsonl")))
        assert len(found) >= 20, f"{name}: {len(found)} traces"
        for t in found:
            trace = load_trace(t)
            assert trace.config.storage and len(trace.steps) >= 300, t
            assert "0.5.13.post1" in trace.header.get("source", ""), t


def test_storage_corpus_exercises_prefetch_and_backup():
    """Across the corpus: pages are stored, prefetches start, pages are read and inserted."""
    seen = {"written": 0, "prefetched": 0, "pages": 0, "loaded": 0, "revoked_or_done": 0}
    for t in sorted(glob.glob(os.path.join(BASE, "*.jsonl"))):
        for s in load_trace(t).steps:
            ret = s.get("ret", {})
            if s["op"] == "storage_backup":
                seen["written"] += ret.get("written", 0) > 0
            elif s["op"] == "prefetch_from_storage":
                seen["prefetched"] += ret.get("tokens", 0) > 0
            elif s["op"] == "storage_load":
                seen["pages"] += ret.get("pages", 0) > 0
            elif s["op"] == "pop_prefetch_loaded_tokens":
                seen["loaded"] += ret.get("tokens", 0) > 0
            elif s["op"] == "check_prefetch_progress":
                seen["revoked_or_done"] += bool(ret.get("done"))
    assert all(v > 0 for v in seen.values()), seen


def _replay_params(default_seeds: int) -> list:
    """Every trace, seeds 1..``default_seeds`` in the default suite, the rest behind slow."""
    out = []
    for t in sorted(glob.glob(os.path.join(BASE, "*.jsonl"))):
        seed = int(re.search(r"-s(\d+)\.jsonl$", t).group(1))
        marks = () if seed <= default_seeds else (pytest.mark.slow,)
        out.append(pytest.param(t, marks=marks, id=os.path.basename(t)))
    return out


@pytest.mark.parametrize("path", _replay_params(default_seeds=3))
def test_replay_on_spec(path):
    result = replay_trace(load_trace(path), "spec")
    assert result.unsupported is None, result.unsupported
    assert result.divergence is None, str(result.divergence)


@pytest.mark.parametrize("path", _replay_params(default_seeds=1))
def test_replay_on_fast(path):
    result = replay_trace(load_trace(path), "fast")
    assert result.unsupported is None, result.unsupported
    assert result.divergence is None, str(result.divergence)
