"""The golden corpus of a Full + Mamba cache's request path, with and without the Mamba extra
buffer (tests/corpus/upstream-mamba-requests, recorded from sglang 0.5.13.post1 by
scripts/record-upstream-mamba-requests.py) replays on the spec and on fast with 0 divergences,
sound invariants after every step and the KV check (conformance/env/kvcheck.py): seed 1 of each
config in the default suite, every trace with ``-m slow`` (the 40 extra-buffer traces cost
about 25 s of CPU per implementation, twice that with the KV check)."""

from __future__ import annotations

import collections
import glob
import json
import os
import re

import pytest

from conftest import CORPUS
from corpus_checks import check_divergence
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace

BASE = os.path.join(CORPUS, "upstream-mamba-requests")
TRACES = sorted(glob.glob(os.path.join(BASE, "*.jsonl")))


def _seed(path: str) -> int:
    m = re.search(r"-s(\d+)\.jsonl$", path)
    assert m, path
    return int(m.group(1))


def _replay_params() -> list:
    return [pytest.param(t, marks=() if _seed(t) == 1 else (pytest.mark.slow,),
                         id=os.path.basename(t)) for t in TRACES]


@pytest.mark.parametrize("impl", ["spec", "fast"])
@pytest.mark.parametrize("path", _replay_params())
def test_replay_with_the_kv_check(path, impl):
    trace = load_trace(path)
    result = replay_trace(trace, impl, check_kv=True)
    assert result.unsupported is None, result.unsupported
    check_divergence(path, trace, result)


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def test_the_extra_buffer_corpus_is_there():
    """At least 20 traces of at least 300 steps for each of mamba-xbuf-p1 and -p4, recorded
    from upstream with the extra buffer on, one and two track slots among them."""
    track_slots = set()
    for cfg in ("mamba-xbuf-p1", "mamba-xbuf-p4"):
        found = [t for t in TRACES if os.path.basename(t).startswith(cfg + "-s")]
        assert len(found) >= 20, f"{cfg}: {len(found)} traces"
        for t in found:
            lines = _lines(t)
            header = lines[0]
            assert "sglang 0.5.13.post1" in header["source"], t
            assert header["config"]["mamba_extra_buffer"] is True, t
            assert header["config"]["page_size"] == int(cfg[-1]), t
            track_slots.add(header["config"]["mamba_track_slots"])
            assert len(lines) - 1 >= 300, t
    assert track_slots == {1, 2}


def test_the_corpus_runs_the_request_path():
    """Across the corpus (from the recorded observations): over a third of the steps are
    requests (conform's workload has about one in seven); chunks and
    decode steps run, admissions hit cached prefixes, finishes hand state slots back, and some
    admissions wait for state slots."""
    ops: collections.Counter = collections.Counter()
    for t in TRACES:
        for s in _lines(t)[1:]:
            ret = s.get("ret") or {}
            ops[s["op"]] += 1
            if s["op"] == "req_admit":
                ops["hit"] += ret.get("prefix_len", 0) > 0
                ops["waited"] += "mamba_pool_idx" in ret and ret["mamba_pool_idx"] is None
            if s["op"] == "req_finish":
                ops["states back"] += bool(ret.get("mamba_freed"))
            if s["op"] in ("req_chunk", "req_decode"):
                ops["ran"] += ret.get("ok") is True
    requests = sum(v for k, v in ops.items() if k.startswith("req_"))
    assert requests * 3 > sum(v for k, v in ops.items() if k not in
                              ("hit", "waited", "states back", "ran")), ops
    assert all(ops[k] > 0 for k in ("hit", "waited", "states back", "ran")), ops


@pytest.mark.slow
def test_the_extra_buffer_rules_are_exercised(monkeypatch):
    """Replaying the extra-buffer traces on the spec: chunks hand a tracked state to the tree,
    chunks cache nothing (no track point since the last cache), finishes are cut at their
    last track point and finishes cache whole."""
    from uniradix.spec import requests as rules

    seen: collections.Counter = collections.Counter()
    track_cache, cut = rules.unfinished_track_cache, rules.finished_track_cut

    def counted_track_cache(state, req, tokens):
        out = track_cache(state, req, tokens)
        seen["donated" if out else "not cached"] += 1
        return out

    def counted_cut(state, req, tokens, kv):
        out = cut(state, req, tokens, kv)
        seen["cut" if len(out[0]) < len(tokens) else "whole"] += 1
        return out

    monkeypatch.setattr(rules, "unfinished_track_cache", counted_track_cache)
    monkeypatch.setattr(rules, "finished_track_cut", counted_cut)
    for t in TRACES:
        if "-xbuf-" in os.path.basename(t):
            assert replay_trace(load_trace(t), "spec").divergence is None, t
    assert all(seen[k] > 0 for k in ("donated", "not cached", "cut", "whole")), seen
