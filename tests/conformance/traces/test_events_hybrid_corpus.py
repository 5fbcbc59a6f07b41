"""The golden corpus of hybrid models with KV events (tests/corpus/upstream-events-hybrid, README
there): it is there, upstream's recorded streams equal the spec's rendered the upstream way
(replay, one seed per config here; tests/conformance/traces/test_corpus_replay.py replays the
rest behind `slow`), and upstream's hybrid streams break a router's fold in no new way: folded
step by step, each gives the router view that the spec's `compat` stream gives."""

import glob
import os

import pytest

from conftest import CORPUS
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.traces.events import RouterCheck, SpecEvents, event_source
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace

BASE = os.path.join(CORPUS, "upstream-events-hybrid")
CONFIGS = ("swa-w8-p1", "swa-w8-p4", "mamba-p1", "full-swa-mamba-p1")


def _paths(name: str) -> list[str]:
    return sorted(glob.glob(os.path.join(BASE, f"{name}-s*.jsonl")))


@pytest.mark.parametrize("name", CONFIGS)
def test_corpus_is_there(name):
    paths = _paths(name)
    assert len(paths) >= 10, f"{name}: {len(paths)} traces"
    for p in paths:
        trace = load_trace(p)
        assert len(trace.steps) >= 300 and all("events" in s for s in trace.steps), p
        assert trace.header["event_key_mode"] == "compat"
        assert len(trace.config.components) >= 2, p
    assert sum(len(s["events"]) for s in load_trace(paths[0]).steps) > 0


@pytest.mark.parametrize("name", CONFIGS)
def test_upstreams_stream_is_the_spec_stream_rendered_with_compat_hashes(name):
    trace = load_trace(_paths(name)[0])
    result = replay_trace(trace, "spec")
    assert result.divergence is None, str(result.divergence)
    assert result.events_compared == len(trace.steps)


@pytest.mark.parametrize("name", CONFIGS)
def test_upstreams_hybrid_stream_breaks_the_routers_fold_in_no_new_way(name):
    """Fold upstream's recorded stream and the spec's ``compat`` stream side by side: the same
    anomalies on the same steps and the same cached blocks per medium after every step (so
    the only breaks are the namespace collisions of ``compat`` hashes, docs/SPEC.md); the spec's
    own (namespaced) stream folds to exactly its cached pages."""
    trace = load_trace(_paths(name)[0])
    compat_side, own_side = make_adapter("spec", trace.config), make_adapter("spec", trace.config)
    compat, own = SpecEvents(compat_side, "compat"), event_source(own_side)
    assert own is not None and own.key_mode == "namespaced"
    theirs, ours, mine = RouterCheck(), RouterCheck(), RouterCheck()
    anomalies = 0
    for step in trace.steps:
        a = theirs.fold(step["events"])
        b = ours.fold(compat.after_step(step, compat_side.apply(step)))
        assert len(a) == len(b), (step["i"], a, b)
        anomalies += len(a)
        for m in ("GPU", "CPU_PINNED"):
            assert theirs.view.cached(m) == ours.view.cached(m), (step["i"], m)
        events = own.after_step(step, own_side.apply(step))
        assert mine.fold(events) == [] and mine.compare(own.hashes()) == [], step["i"]
    print(name, "anomalies of both compat folds:", anomalies)
