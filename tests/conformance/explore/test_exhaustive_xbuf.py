"""``uniradix check --exhaustive`` over the Mamba extra buffer (issue 18 item 5;
conformance/explore/exhaustive.py, docs/CHECKS.md "The Mamba extra buffer").

The named universes run at their default depth in the default suite
(tests/conformance/explore/test_exhaustive.py); here: a whole request tracks, caches its
tracked state and is cut at its last track point; a second request waits when the state pool
is held; faults planted in fast's extra-buffer code (fast/components/mamba.py) are found
within two transitions and written as traces that replay; bad universes are refused by name.
One level deeper than the default suite is behind ``slow``.
"""

from __future__ import annotations

import pytest

from exhaustive_steps import after, assert_nothing_found, assert_refused
from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore import exhaustive as ex
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.fast.components.mamba import MambaComponent

XBUF = ("mamba-xbuf-p1", "mamba-xbuf-p2")


def test_the_xbuf_universes_are_named_small_and_request_driven():
    for name in XBUF:
        u = ex.UNIVERSES[name]
        assert ex.parse_universe(name) is u
        assert ex.Universe.from_dict(u.to_dict()) == u  # a trace header's universe reads back
        cfg = u.config()
        assert cfg.mamba_extra_buffer and cfg.components == ("full", "mamba")
        assert u.depth == 2 and not u.tree_ops
        labels = {t.label.split()[0] for t in ex.transitions(u, ex.World.of(u, SpecAdapter(cfg)))}
        assert labels == {"req_start", "req_run", "evict"}, labels
    assert {ex.UNIVERSES[n].mamba_track_slots for n in XBUF} == {1, 2}
    assert {ex.UNIVERSES[n].page_size for n in XBUF} == {1, 2}


def test_a_whole_request_tracks_caches_and_is_cut_at_its_last_track_point():
    """p1, interval 2: prefill [1, 2] (tracked at 2, that state cached with the prompt),
    decode 3 (across the track point at 4), finish: cached up to 4, the fifth slot freed."""
    u = ex.UNIVERSES["mamba-xbuf-p1"]
    spec, steps = after(u, ["req_run r0 [1, 2] None"])
    assert [s["op"] for s in steps] == ["req_arrive", "req_admit", "req_chunk", "req_decode",
                                       "req_finish"]
    assert steps[3]["args"]["n"] == 3
    obs = SpecAdapter(u.config())
    rets = [obs.apply(s) for s in steps]
    assert rets[-1]["freed"] == [5], rets[-1]
    snap = obs.snapshot()
    states = {tuple(n["path"]["tokens"]): n["mamba"]["value"] for n in snap["nodes"]}
    assert len(max(states, key=len)) == 4 and all(v for v in states.values()), states
    assert not spec.state.requests


def test_the_single_steps_decode_to_the_track_point_and_a_second_request_waits():
    u = ex.UNIVERSES["mamba-xbuf-p1"]
    spec, steps = after(u, ["req_start r0 [1, 2] None", "req_chunk r0 2"])
    w = ex.World.of(u, spec)
    labels = [t.label for t in ex.transitions(u, w)]
    assert "req_decode r0 1" in labels and "req_decode r0 2" in labels  # 2: onto the point
    # r0 holds 2 of the 3 state slots (its own and one track slot), the tree one: r1 waits
    spec, steps = after(u, ["req_start r0 [1, 2] None", "req_chunk r0 2",
                             "req_start r1 [2] None"])
    assert steps[-1]["op"] == "req_admit"
    obs = SpecAdapter(u.config())
    ret = [obs.apply(s) for s in steps][-1]
    assert ret["mamba_pool_idx"] is None, ret
    w = ex.World.of(u, spec)
    assert "req_admit r1" in [t.label for t in ex.transitions(u, w)]
    assert w.mamba_held == []  # track slots are the request's, not the driver's


def _short(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tracked state cached a page short (the Hypothesis machine's planted fault)."""
    orig = MambaComponent._cached_len

    def short(self, length):
        return max(0, orig(self, length) - self.cache.page_size)
    monkeypatch.setattr(MambaComponent, "_cached_len", short)


def _keep(monkeypatch: pytest.MonkeyPatch) -> None:
    """The track slot the next track point writes taken for the one holding the last state."""
    monkeypatch.setattr(MambaComponent, "keep_index",
                        staticmethod(lambda req: int(req.mamba_next_track_idx)))


def _used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A donated track length not used up (the next cache would hand it over again)."""
    orig = MambaComponent.donate_tracked

    def donate(self, req):
        before = req.mamba_last_track_seqlen
        out = orig(self, req)
        req.mamba_last_track_seqlen = before
        return out
    monkeypatch.setattr(MambaComponent, "donate_tracked", donate)


@pytest.mark.parametrize("plant,name,replays", [
    (_short, "mamba-xbuf-p1", True), (_short, "mamba-xbuf-p2", True),
    (_keep, "mamba-xbuf-p2", True), (_used, "mamba-xbuf-p1", False)])
def test_a_fault_planted_in_fasts_extra_buffer_is_found(monkeypatch, tmp_path, plant, name,
                                                        replays):
    """Found within two transitions; the written trace replays clean on the spec and, where
    observations show the fault, diverges on the broken fast path only.  A track length not
    used up shows first in the request view of the snapshots, which a plain replay (and its
    appended probes: sizes, evictions) cannot see: the trace header says so."""
    u = ex.UNIVERSES[name]
    plant(monkeypatch)
    res = ex.explore(u, ["spec", "fast"], depth=2, progress=False)
    assert res.finding is not None and res.labels is not None, res.summary()
    assert res.finding.kind == "divergence" and 1 <= len(res.labels) <= 2, res.labels
    path = ex.write_counterexample(str(tmp_path), u, ["spec", "fast"], res)
    trace = load_trace(path)
    assert trace.header["config"]["mamba_extra_buffer"] is True
    assert trace.header["universe"]["name"] == name
    assert replay_trace(trace, "spec").divergence is None
    if replays:
        assert replay_trace(trace, "fast").divergence is not None
    else:
        assert "mamba_track_len" in str(res.finding) and not trace.header["probes_appended"]
    monkeypatch.undo()
    assert replay_trace(trace, "fast").divergence is None


def test_the_keep_fault_cannot_show_with_one_track_slot(monkeypatch):
    """With one track slot the next track point writes the slot that holds the last state,
    so the planted ``keep_index`` is right there: every whole request of the one-slot
    universe (depth 1) passes."""
    _keep(monkeypatch)
    res = ex.explore(ex.UNIVERSES["mamba-xbuf-p1"], ["spec", "fast"], depth=1, progress=False)
    assert res.finding is None and res.complete and res.transitions > 10


def test_bad_xbuf_universes_are_refused_by_name():
    assert_refused(
        ('{"base": "mamba-xbuf-p1", "requests": 0, "tree_ops": true}', "requests > 0"),
        ('{"base": "mamba-xbuf-p1", "cow": true}', "without cow"),
        ('{"base": "full-p1", "tree_ops": false}', "tree_ops false needs requests"),
        ('{"base": "mamba-xbuf-p1", "mamba_extra_buffer": false}',
         "requests only with the extra buffer"),
        ('{"base": "mamba-xbuf-p1", "mamba_track_slots": 3}', "mamba_track_slots"),
        ('{"base": "mamba-xbuf-p2", "mamba_track_interval": 3}', "mamba_track_interval"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_xbuf_universes_find_nothing_one_level_deeper():
    """Depth 3 (docs/CHECKS.md has the numbers; p2 at depth 4 is a manual run)."""
    assert_nothing_found(XBUF, 3)
