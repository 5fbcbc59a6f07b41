"""Every committed trace replays on the spec and on the fast path with 0 divergences and sound invariants after
every step (the golden corpus recorded from upstream, and the regression traces)."""

import glob
import os

import pytest

from uniradix.conformance.replay import replay_trace
from uniradix.conformance.trace import load_trace

from conftest import CORPUS

# Traces under other eviction policies than lru, and of Mamba copy-on-write, replay in
# tests/test_spec_policies.py and tests/test_spec_mamba_cow.py (the fast path refuses both
# until it models them).
# The storage corpus has its own replay test (tests/test_storage_corpus.py; spec only so far).
SPEC_ONLY = ("upstream-policies", "upstream-mamba-cow", "upstream-storage")
TRACES = sorted(t for t in glob.glob(os.path.join(CORPUS, "**", "*.jsonl"), recursive=True)
                if not any(os.sep + d + os.sep in t for d in SPEC_ONLY))


def test_corpus_is_there():
    upstream = [t for t in TRACES if os.sep + "upstream" + os.sep in t]
    assert len(upstream) >= 40, f"expected >= 40 upstream traces, found {len(upstream)}"
    for t in upstream:
        assert len(load_trace(t).steps) >= 300, t


@pytest.mark.parametrize("folder, prefixes", [
    ("upstream-swa", ("swa-w8-p1-", "swa-w8-p4-", "swa-w32-p1-")),
    ("upstream-mamba", ("mamba-p1-",)),
])
def test_hybrid_corpora_are_there(folder, prefixes):
    """Golden traces of hybrid models: at least 20 per config, each of at least 300 steps."""
    names = [os.path.basename(t) for t in TRACES if os.sep + folder + os.sep in t]
    for prefix in prefixes:
        mine = [n for n in names if n.startswith(prefix)]
        assert len(mine) >= 20, f"{folder}: {len(mine)} traces {prefix}*"
    for t in TRACES:
        if os.sep + folder + os.sep in t:
            assert len(load_trace(t).steps) >= 300, t


def test_host_tier_corpus_is_there():
    """At least 20 upstream traces for each of write-through / write-back, pages 1 and 4."""
    base = os.path.join(CORPUS, "upstream-hicache")
    for cfg in ("hicache-wt-p1", "hicache-wt-p4", "hicache-wb-p1", "hicache-wb-p4"):
        found = glob.glob(os.path.join(base, f"{cfg}-s*.jsonl"))
        assert len(found) >= 20, f"{cfg}: {len(found)} traces"
        for t in found:
            trace = load_trace(t)
            assert trace.config.has_host_tier and len(trace.steps) >= 300, t


@pytest.mark.parametrize("impl", ["spec", "fast"])
@pytest.mark.parametrize("path", TRACES, ids=[os.path.relpath(t, CORPUS) for t in TRACES])
def test_replay(path, impl):
    result = replay_trace(load_trace(path), impl)
    assert result.unsupported is None, result.unsupported
    assert result.divergence is None, str(result.divergence)
