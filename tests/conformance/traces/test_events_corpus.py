"""The golden corpus with KV events (tests/corpus/upstream-events, README there): it is there,
upstream's recorded streams equal the spec's rendered the upstream way (replay), and the one
documented difference shows: upstream's stream breaks a router's fold where namespaces share
tokens, the spec's own stream never does."""

import glob
import os

import pytest

from conftest import CORPUS
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.traces.events import RouterCheck, event_source
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace

BASE = os.path.join(CORPUS, "upstream-events")
CONFIGS = ("full-p1", "full-p16", "hicache-wt-p1", "hicache-wb-p4")


@pytest.mark.parametrize("name", CONFIGS)
def test_corpus_is_there(name):
    paths = sorted(glob.glob(os.path.join(BASE, f"{name}-s*.jsonl")))
    assert len(paths) >= 20, f"{name}: {len(paths)} traces"
    for p in paths:
        trace = load_trace(p)
        assert len(trace.steps) >= 300 and all("events" in s for s in trace.steps), p
        assert trace.header["event_key_mode"] == "compat"
    if name.startswith("hicache"):
        media = {e[-1] for p in paths[:3] for s in load_trace(p).steps for e in s["events"]
                 if e[0] != "AllBlocksCleared"}
        assert media == {"GPU", "CPU_PINNED"}


def _first_trace(name):
    return load_trace(sorted(glob.glob(os.path.join(BASE, f"{name}-s*.jsonl")))[0])


@pytest.mark.parametrize("name", CONFIGS)
def test_upstreams_stream_is_the_spec_stream_rendered_with_compat_hashes(name):
    trace = _first_trace(name)
    result = replay_trace(trace, "spec")
    assert result.divergence is None, str(result.divergence)
    assert result.events_compared == len(trace.steps)


@pytest.mark.parametrize("name", CONFIGS)
def test_only_the_spec_stream_keeps_the_routers_invariant(name):
    """Fold both streams step by step: the spec's (namespaced) gives its cached pages per
    medium exactly; upstream's recorded one contradicts a router somewhere in the traces."""
    upstream_anomalies = 0
    for path in sorted(glob.glob(os.path.join(BASE, f"{name}-s*.jsonl")))[:3]:
        trace = load_trace(path)
        adapter = make_adapter("spec", trace.config)
        spec = event_source(adapter)  # the config's own (namespaced) hashes
        assert spec.key_mode == "namespaced"
        mine, theirs = RouterCheck(), RouterCheck()
        for step in trace.steps:
            events = spec.after_step(step, adapter.apply(step))
            assert mine.fold(events) == [] and mine.compare(spec.hashes()) == [], step["i"]
            upstream_anomalies += len(theirs.fold(step["events"]))
    assert upstream_anomalies > 0
