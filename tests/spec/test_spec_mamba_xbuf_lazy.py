"""The lazy Mamba extra buffer (``mamba_extra_buffer_lazy``; spec/requests.py, docs/SPEC.md
"The lazy extra buffer"): one track slot a request, a decode track point taking a fresh slot
for its state and freeing the old one, written in place when none can be had (a finish on
that step caches nothing).  Its rules, config checks, stories on the spec and the fast path,
the KV check of the state it caches, its invariant, and the fast path's refusals."""

from __future__ import annotations

import dataclasses

import pytest

from stories import XBUF_STORY, run_steps
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.env.kvcheck import KVChecked
from uniradix.spec import requests as reqs
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError

LAZY = CacheConfig(components=("full", "mamba"), kv_slots=64, mamba_slots=8,
                   mamba_extra_buffer=True, mamba_extra_buffer_lazy=True,
                   mamba_cache_chunk_size=4, mamba_track_interval=8)


def test_config_default_off_keeps_headers():
    xbuf = dataclasses.replace(LAZY, mamba_extra_buffer_lazy=False)
    assert "mamba_extra_buffer_lazy" not in xbuf.to_dict()
    assert "mamba_extra_buffer_lazy" not in CacheConfig().to_dict()
    d = LAZY.to_dict()
    assert d["mamba_extra_buffer_lazy"] is True and CacheConfig.from_dict(d) == LAZY


@pytest.mark.parametrize("changes, words", [
    ({"mamba_extra_buffer": False}, "needs mamba_extra_buffer"),
    ({"mamba_track_slots": 1}, "mamba_track_slots=2"),  # upstream: the overlap schedule only
    ({"mamba_extra_buffer_lazy": 1}, "true or false"),
])
def test_config_refusals(changes, words):
    with pytest.raises(ConfigError, match=words):
        CacheConfig.from_dict({**LAZY.to_dict(), **changes})


def nodes_of(a) -> dict:
    return {len(n["path"]["tokens"]): n["mamba"]["value"] for n in a.snapshot()["nodes"]}


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_one_track_slot_and_a_fresh_one_at_a_decode_track_point(impl):
    """Admission takes two states (the own slot 1, the track slot 2); each chunk's track
    point writes the only track slot in place and hands it to the tree (4, then 10), a fresh
    slot taking its place; the decode's track point (16) takes the fresh slot 5 and frees 4;
    the finish caches up to 16 with slot 5 and frees the own slot only."""
    out, a = run_steps(impl, LAZY, XBUF_STORY[:5])
    assert out[1]["mamba_pool_idx"] == 1 and out[1]["mamba_freed"] == []
    req = a.snapshot()["requests"][0]
    assert req["mamba_track"] == [5] and req["mamba_track_len"] == 16
    assert req["mamba_track_overwritten"] is False
    assert out[4]["mamba_freed"] == [4]
    out, a = run_steps(impl, LAZY, XBUF_STORY)
    assert nodes_of(a) == {4: [2], 10: [3], 16: [5]}
    assert out[5]["freed"] == [17, 18] and out[5]["mamba_freed"] == [1]
    assert a.snapshot()["mamba_pool"] == [2, 3, 5]


TIGHT = dataclasses.replace(LAZY, mamba_slots=2)  # one request's two states fill the pool
ONE = [("req_arrive", {"rid": "a", "tokens": [1, 2, 3]}), ("req_admit", {"rid": "a"}),
       ("req_chunk", {"rid": "a", "n": 3, "chunked": False})]


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_no_fresh_slot_on_the_finishing_step_caches_nothing(impl):
    """No state to evict at the track point (8): the state goes over the only track slot and
    the request, finishing on that step, is released as an abort: nothing cached, both of its
    states and its pages freed."""
    out, a = run_steps(impl, TIGHT, ONE + [("req_decode", {"rid": "a", "n": 5}),
                                     ("req_finish", {"rid": "a"})])
    assert out[3]["mamba_freed"] == []
    assert out[4]["mamba_freed"] == [1, 2] and out[4]["freed"] == list(range(1, 9))
    assert nodes_of(a) == {} and a.snapshot()["mamba_pool"] == []


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_no_fresh_slot_then_more_steps_caches_the_overwritten_state(impl):
    """The same track point found no fresh slot, but the request decodes on (upstream marks
    only a request finishing on that step): the finish caches up to 8 with the slot written
    in place.  A track point with the pool empty evicts a state for its fresh slot."""
    out, a = run_steps(impl, TIGHT, ONE + [("req_decode", {"rid": "a", "n": 6}),
                                     ("req_finish", {"rid": "a"})])
    assert a.snapshot()["requests"] == [] and nodes_of(a) == {8: [2]}
    assert out[4]["mamba_freed"] == [1]
    # with a third state slot: a's track point takes it; b's, with the pool empty, evicts the
    # state a cached (unlocked) for its fresh slot and frees its old track slot
    cfg = dataclasses.replace(LAZY, mamba_slots=3)
    out, a = run_steps(impl, cfg, ONE + [("req_decode", {"rid": "a", "n": 6}),
                                   ("req_finish", {"rid": "a"}),
                                   ("req_arrive", {"rid": "b", "tokens": [9, 8, 7]}),
                                   ("req_admit", {"rid": "b"}),
                                   ("req_chunk", {"rid": "b", "n": 3, "chunked": False}),
                                   ("req_decode", {"rid": "b", "n": 5})])
    assert out[3]["mamba_freed"] == [2] and out[4]["mamba_freed"] == [1]
    assert sorted(out[8]["mamba_freed"]) == [2, 3]
    req = a.snapshot()["requests"][0]
    assert req["mamba_track"] == [3] and req["mamba_track_overwritten"] is False
    assert nodes_of(a) == {}  # (a leaf without its state leaves the tree)


def test_lazy_track_rule():
    """``lazy_track`` directly: a fresh slot replaces the track slot, which goes back; with
    the pool empty and nothing to evict, the state is written in place."""
    a = make_adapter("spec", TIGHT)
    for i, (op, args) in enumerate(ONE):
        a.apply({"i": i, "op": op, "args": args})
    state = a.state
    req = state.requests["a"]
    assert reqs.held_track_slots(state) == 1 and req.mamba_track == [2]
    assert reqs.lazy_track(state, req, 8) is False
    assert req.mamba_track == [2] and req.mamba_track_len == 8
    state.mamba.free([1])  # room for one
    assert reqs.lazy_track(state, req, 16) is True
    assert req.mamba_track == [1] and not state.mamba.is_allocated(2)
    assert reqs.finish_inserts(req)
    req.mamba_track_overwritten = True
    assert not reqs.finish_inserts(req)


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_kv_check_covers_the_lazily_tracked_state(impl, monkeypatch):
    """The KV check writes a lazy decode track point's state into the slot the request holds
    after the step, and checks the node the finish gives it: caching it one track point
    early (the fresh slot holds the state at 16, the node is at 8) is reported."""
    steps = ONE + [("req_decode", {"rid": "a", "n": 14}), ("req_finish", {"rid": "a"})]
    a = KVChecked(make_adapter(impl, LAZY), LAZY)
    for i, (op, args) in enumerate(steps):
        a.apply({"i": i, "op": op, "args": args})
    assert a.violations() == []
    monkeypatch.setattr(reqs, "cached_track_len", lambda state, n: 0 if n is None else n - 8)
    from uniradix.fast.components.mamba import MambaComponent
    monkeypatch.setattr(MambaComponent, "_cached_len",
                        lambda self, n: 0 if n is None else int(n) - 8)
    a = KVChecked(make_adapter(impl, LAZY), LAZY)
    for i, (op, args) in enumerate(steps):
        a.apply({"i": i, "op": op, "args": args})
    assert any("does not hold the state of its path" in v for v in a.violations())


def test_invariant_one_track_slot_between_steps():
    """spec/requests.py ``request_state_slots``: a lazy request holding two track slots
    between steps (a track point that did not give the old one back) is reported."""
    from uniradix.spec.invariants import sanity_check
    _, a = run_steps("spec", LAZY, XBUF_STORY[:2])
    state = a.state
    assert sanity_check(state) == []
    state.requests["a"].mamba_track.append(state.mamba.alloc(1)[0])
    assert any("holds 2 track slots, not 1" in e for e in sanity_check(state))


LAZY_CONFIGS = ["mamba-xbuf-lazy-p1", "mamba-xbuf-lazy-p4"]


def conform_lazy(name: str, steps: int, seed: int):
    from uniradix.conformance.env.kvcheck import kv_checked
    from uniradix.conformance.explore.conform import run_conform
    return run_conform([kv_checked("spec"), kv_checked("fast")], steps=steps, seed=seed,
                       config=name, out=None, progress=False, log=lambda m: None)


@pytest.mark.parametrize("name", LAZY_CONFIGS)
def test_conform_configs_draw_lazy_with_two_track_slots_and_run_clean(name):
    """conform's named lazy configs: every segment lazy, two track slots, its page size;
    a short spec-against-fast run with the KV check is clean."""
    from uniradix.conformance.explore.conform import segment_config
    for seg in range(4):
        _, cfg = segment_config(name, 1, seg)
        assert cfg.mamba_extra_buffer_lazy and cfg.mamba_track_slots == 2
        assert cfg.page_size == int(name[-1])
    res = conform_lazy(name, 300, 1)
    assert res.finding is None, str(res.finding)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", LAZY_CONFIGS)
def test_conform_lazy_long(name, seed):
    res = conform_lazy(name, 5000, seed)
    assert res.finding is None, str(res.finding)
