"""0.5.13.post1's own KV events against the spec's (needs sglang importable: run in the upstream
venv). The lockstep compares the two streams on every step (the spec renders its hashes the
upstream way, `compat`); the committed corpus replays on upstream with its events; and the storage
tier's one documented difference (prefetch inserts unannounced) is exactly what differs."""

from __future__ import annotations

import glob
import os

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.explore.driver import make_config, record
from uniradix.conformance.explore.lockstep import Lockstep
from uniradix.conformance.traces.events import SpecEvents, TakenEvents, event_source
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import Trace, load_trace, make_header

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh)", allow_module_level=True)

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "corpus", "upstream-events")


HYBRID = ["swa-w8-p1", "swa-w8-p4", "swa-w32-p1", "mamba-p1", "full-swa-mamba-p1",
          "full-swa-mamba-p4"]


@pytest.mark.parametrize("name", ["full-p1", "full-p16", "hicache-wt-p1", "hicache-wb-p4"] + HYBRID)
def test_lockstep_compares_upstreams_events_with_the_specs(name):
    """Full, the host tier, and SWA and Mamba (and both in one tree): upstream's adapters turn
    its KV-event mixin on, so the lockstep compares its stream with the spec's on every step."""
    config = make_config(name, 41)
    steps = record(make_adapter("spec", config), config, 41, 250, check_violations=False)
    ls = Lockstep([make_adapter("spec", config), make_adapter("upstream", config)],
                  ["spec", "upstream"])
    assert ls.events_note == "" and ls.event_sources[0].key_mode == "compat"
    for step in steps:
        ls.apply(step)
    assert ls.stats["event_steps"] == len(steps)


@pytest.mark.parametrize("name", ["swa-w8-p1", "mamba-p1", "full-swa-mamba-p4", "host-swa-wt-p1",
                                  "host-mamba-wb-p4"])
def test_every_hybrid_adapter_emits_upstreams_events(name):
    """The hybrid adapters and the host-tier adapter with an aux component emit 0.5.13.post1's
    own events (``compat`` hashes), Full pages only: an aux eviction emits nothing."""
    config = make_config(name, 5)
    adapter = make_adapter("upstream", config)
    src = event_source(adapter)
    assert isinstance(src, TakenEvents) and src.key_mode == "compat"
    steps = record(adapter, config, 5, 200, events=True)
    events = [e for s in steps for e in s["events"]]
    assert events and {e[0] for e in events} <= {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    media = {e[-1] for e in events if e[0] != "AllBlocksCleared"}
    assert media == ({"GPU", "CPU_PINNED"} if config.has_host_tier else {"GPU"})


@pytest.mark.parametrize("name", ["host-mamba-wt-p1", "host-mamba-wb-p4"])
def test_host_mamba_events_replay_on_the_spec(name):
    """The host tier with Mamba: upstream's recorded stream (both media) is the spec's rendered
    with compat hashes (a replay; the lockstep's snapshots of this config differ elsewhere)."""
    config = make_config(name, 7)
    adapter = make_adapter("upstream", config)
    steps = record(adapter, config, 7, 250, events=True)
    trace = Trace(make_header(config, "test", seed=7, event_key_mode="compat"), config, steps)
    result = replay_trace(trace, "spec")
    assert result.divergence is None, str(result.divergence)
    assert result.events_compared == len(steps)


def test_committed_hybrid_event_traces_replay_on_upstream():
    path = os.path.join(CORPUS + "-hybrid", "swa-w8-p4-s002.jsonl")
    result = replay_trace(load_trace(path), "upstream")
    assert result.divergence is None, str(result.divergence)
    assert result.events_compared == 300


def test_the_recorder_takes_upstreams_events_step_by_step():
    config = make_config("hicache-wt-p1", 3)
    adapter = make_adapter("upstream", config)
    assert event_source(adapter).key_mode == "compat"
    steps = record(adapter, config, 3, 150, events=True)
    media = {e[-1] for s in steps for e in s["events"] if e[0] != "AllBlocksCleared"}
    assert media == {"GPU", "CPU_PINNED"}


@pytest.mark.parametrize("name", ["full-p16", "hicache-wb-p4"])
def test_committed_event_traces_replay_on_upstream(name):
    path = sorted(glob.glob(os.path.join(CORPUS, f"{name}-s*.jsonl")))[0]
    result = replay_trace(load_trace(path), "upstream")
    assert result.divergence is None, str(result.divergence)
    assert result.events_compared == 300


def test_storage_prefetch_inserts_are_the_one_documented_difference():
    """A storage run (seed 22 of storage-wb-p4-wc) whose prefetch inserts host pages: with the
    upstream storage adapter's declared difference the streams agree on every step; without it,
    they differ at the prefetch's insert, and only by CPU_PINNED stores upstream never emits."""
    from uniradix.conformance.explore.storage_driver import make_storage_config, storage_segment

    config = make_storage_config("storage-wb-p4-wc", 22)
    ls = Lockstep([make_adapter("spec", config), make_adapter("upstream", config)],
                  ["spec", "upstream"])
    assert ls.event_sources[0].differences == ("prefetch-inserts-unannounced",)
    taken, finding = storage_segment(ls, config, "s22", 300)
    assert finding is None, str(finding)

    ls = Lockstep([make_adapter("spec", config), make_adapter("upstream", config)],
                  ["spec", "upstream"])
    ls.event_sources[0] = SpecEvents(ls.adapters[0], "compat")  # the spec's stream as it is
    taken, finding = storage_segment(ls, config, "s22", 300)
    assert finding is not None and finding.where == "events", str(finding)
    assert finding.op == "check_prefetch_progress"
    assert finding.values["upstream only"] == []
    assert all("'BlockStored'" in e and "'CPU_PINNED'" in e for e in finding.values["spec only"])
