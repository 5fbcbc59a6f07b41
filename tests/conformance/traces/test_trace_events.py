"""KV events in traces, replay and lockstep (docs/TRACE.md "KV events"): the optional per-step
``events`` field is checked when read, compared by ``replay`` when the implementation emits
events (and counted as not compared otherwise), and compared by the lockstep among the
implementations that emit them."""

import json

import pytest

from uniradix.conformance.adapters.base import SpecAdapter, make_adapter
from uniradix.conformance.adapters.fast_adapter import FastAdapter
from uniradix.conformance.explore.driver import make_config, record
from uniradix.conformance.explore.lockstep import Lockstep, run_steps
from uniradix.conformance.traces.replay import replay_paths, replay_trace
from uniradix.conformance.traces.trace import dump_trace, load_trace, make_header
from uniradix.spec.errors import ConfigError, InvalidInput
from uniradix.spec.events import BlockRemoved, EventEmitter


def recorded(tmp_path, name="full-p1", seed=3, steps=120):
    config = make_config(name, seed)
    out = record(make_adapter("spec", config), config, seed, steps, events=True)
    path = str(tmp_path / f"{name}.jsonl")
    dump_trace(path, make_header(config, "test", seed=seed, event_key_mode="namespaced"), out)
    return path, out


def test_a_recording_carries_every_steps_events_and_replays_with_them(tmp_path):
    path, steps = recorded(tmp_path)
    assert all("events" in s for s in steps)
    assert sum(len(s["events"]) for s in steps) > 0
    result = replay_trace(load_trace(path), "spec")
    assert result.divergence is None and result.events_compared == len(steps)


def test_replay_finds_a_changed_event(tmp_path):
    path, steps = recorded(tmp_path)
    k = next(i for i, s in enumerate(steps) if s["events"])
    steps[k]["events"] = steps[k]["events"][1:]
    trace = load_trace(path)
    trace.steps[k]["events"] = steps[k]["events"]
    result = replay_trace(trace, "spec")
    assert result.divergence is not None and result.divergence.step == steps[k]["i"]
    assert result.divergence.field.startswith("events")


def test_replay_says_when_it_cannot_compare_events(tmp_path, monkeypatch):
    path, steps = recorded(tmp_path)
    lines = []
    assert replay_paths([path], "fast", out=lines.append) == 0  # fast emits them (issue 17)
    assert f"KV events compared on {len(steps)} steps" in lines
    monkeypatch.setattr(FastAdapter, "emits_kv_events", False)  # an implementation that does not
    lines = []
    assert replay_paths([path], "fast", out=lines.append) == 0
    assert f"KV events NOT compared on {len(steps)} steps: fast does not emit KV events" in lines
    lines = []
    assert replay_paths([path], "spec", out=lines.append) == 0
    assert f"KV events compared on {len(steps)} steps" in lines


def test_traces_without_events_replay_as_before(tmp_path):
    config = make_config("full-p4", 2)
    out = record(make_adapter("spec", config), config, 2, 60)
    assert not any("events" in s for s in out)
    path = str(tmp_path / "plain.jsonl")
    dump_trace(path, make_header(config, "test"), out)
    lines = []
    assert replay_paths([path], "spec", out=lines.append) == 0
    assert lines == ["replayed 60 steps in 1 traces: 0 divergences"]


@pytest.mark.parametrize("events", [{"x": 1}, [["BlockRemoved", [1.5], "GPU"]], [["Nope"]]])
def test_malformed_events_are_refused_naming_the_line(tmp_path, events):
    path = tmp_path / "bad.jsonl"
    config = make_config("full-p1", 1)
    path.write_text(json.dumps(make_header(config, "t")) + "\n"
                    + json.dumps({"i": 0, "op": "sizes", "args": {}, "events": events}) + "\n")
    with pytest.raises(InvalidInput, match=":2:"):
        load_trace(str(path))


def test_an_unknown_event_key_mode_is_a_config_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(make_header(make_config("full-p1", 1), "t", event_key_mode="x")) + "\n")
    with pytest.raises(ConfigError, match="event_key_mode"):
        load_trace(str(path))


class ForgetsRemovals(SpecAdapter):
    """A spec that emits events itself and leaves every BlockRemoved out."""

    emits_kv_events = True
    event_key_mode = "namespaced"

    def __init__(self, config):
        super().__init__(config)
        self._em = EventEmitter(self.state)
        self._out = []

    def apply(self, step):
        obs = super().apply(step)
        cleared = step.get("op") == "reset" and "error" not in obs
        self._out = [e for e in self._em.step(self.state, cleared) if not isinstance(e, BlockRemoved)]
        return obs

    def take_events(self):
        out, self._out = self._out, []
        return out


def test_lockstep_compares_the_event_streams():
    config = make_config("full-p1", 4)
    steps = record(make_adapter("spec", config), config, 4, 200)
    finding = run_steps(["spec", "spec"], config, steps)
    assert finding is None
    finding = run_steps(["spec", ForgetsRemovals], config, steps)
    assert finding is not None and finding.where == "events"
    assert finding.values["spec only"] and finding.values["ForgetsRemovals only"] == []
    assert "BlockRemoved" in finding.values["spec only"][0]


def test_lockstep_says_which_implementations_do_not_emit_events(monkeypatch):
    config = make_config("full-p1", 4)
    assert Lockstep.from_impls(["spec", "fast"], config).events_note == ""
    monkeypatch.setattr(FastAdapter, "emits_kv_events", False)
    ls = Lockstep.from_impls(["spec", "fast"], config)
    assert ls.events_note == ("KV events not compared for fast (does not emit them); fewer than "
                              "two implementations emit them")
    ls = Lockstep.from_impls(["spec", "spec"], config)
    assert ls.events_note == ""
    for step in record(make_adapter("spec", config), config, 4, 30):
        ls.apply(step)
    assert ls.stats["event_steps"] == 30


def test_conform_compares_events_and_notes_who_does_not_emit_them(monkeypatch):
    from uniradix.conformance.explore.conform import run_conform

    res = run_conform(["spec", "fast"], config="full-p1", steps=40, out=None, progress=False,
                      log=[].append)
    assert res.divergences == 0 and res.event_steps == 40 and not res.notes
    monkeypatch.setattr(FastAdapter, "emits_kv_events", False)
    logs = []
    res = run_conform(["spec", "fast"], config="full-p1", steps=40, out=None, progress=False,
                      log=logs.append)
    assert res.divergences == 0
    assert ("config full-p1: KV events not compared for fast (does not emit them); fewer than "
            "two implementations emit them") in res.notes and res.event_steps == 0
    logs = []
    res = run_conform(["spec", "spec"], config="hicache-wt-p1", steps=60, out=None,
                      progress=False, log=logs.append)
    assert res.divergences == 0 and not any("KV events" in n for n in res.notes)
    assert res.event_steps == 60


@pytest.mark.parametrize("events, compared", [("even", 40), ("every", 60), ("off", 0)])
def test_conform_events_option_says_which_segments_compare_events(events, compared):
    """Three segments of 20 steps: ``even`` compares fast's events on segments 0 and 2 (fast's
    Full config runs on its C core in segment 1), ``every`` on all three, ``off`` on none."""
    from uniradix.conformance.explore.conform import run_conform

    res = run_conform(["spec", "fast"], config="full-p1", steps=60, segment_steps=20, out=None,
                      progress=False, log=[].append, events=events)
    assert res.divergences == 0 and res.violations == 0 and res.segments == 3
    assert res.event_steps == compared


def test_conform_events_option_is_checked():
    from uniradix.conformance.cli import build_parser
    from uniradix.conformance.explore.conform import run_conform

    with pytest.raises(ValueError, match="events must be one of"):
        run_conform(["spec", "fast"], config="full-p1", steps=1, out=None, progress=False,
                    events="odd")
    assert build_parser().parse_args(["conform", "--events", "every"]).events == "every"
    assert build_parser().parse_args(["conform"]).events == "even"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["conform", "--events", "odd"])


def test_a_page_stored_and_removed_within_a_step_cancels_out():
    """0.5.13.post1 under write-back backs a leaf up and evicts that host copy in one eviction
    (found by `uniradix conform --impls spec,upstream --steps 12000 --seed 3`); the spec, a
    difference of states, emits neither."""
    from uniradix.conformance.traces.events import events_differ, net_events

    gpu_rm = ["BlockRemoved", [7], "GPU"]
    transient = [["BlockStored", [7], 3, [1], 1, None, "CPU_PINNED"], gpu_rm,
                 ["BlockRemoved", [7], "CPU_PINNED"]]
    assert net_events(transient) == [gpu_rm]
    assert events_differ([gpu_rm], transient) is None
    back = [["BlockRemoved", [7], "GPU"], ["BlockStored", [7], 3, [1], 1, None, None]]
    assert net_events(back) == []
    # a store and a removal on different media, or of different hashes, stay
    assert events_differ([], transient[:1] + [["BlockRemoved", [8], "CPU_PINNED"]]) is not None
