"""The Mamba extra buffer (``mamba_extra_buffer``; spec/requests.py, docs/SPEC.md "The Mamba
extra buffer"): its track-point rules, its config checks, request stories on the spec and the
fast path, and the KV check covering the tracked state it caches."""

from __future__ import annotations

import dataclasses

import pytest

from stories import XBUF_STORY, run_steps
from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.env.kvcheck import KVChecked
from uniradix.spec import requests as reqs
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError, Unsupported

XBUF = CacheConfig(components=("full", "mamba"), kv_slots=64, mamba_slots=8,
                   mamba_extra_buffer=True, mamba_cache_chunk_size=4, mamba_track_interval=8)


@pytest.mark.parametrize("prefix, n, branching, want", [
    (0, 3, None, None),     # shorter than a chunk: no track point
    (0, 6, None, 4),        # the chunk's last whole chunk
    (10, 9, None, 18),
    (10, 9, 14, 14),        # the branching length, a whole chunk into the chunk
    (10, 9, 13, 18),        # not a whole number of chunks from the start
    (10, 9, 10, 18),        # not strictly inside
    (10, 8, 18, 18),        # at the end: the last whole chunk anyway
])
def test_extend_track_len(prefix, n, branching, want):
    assert reqs.extend_track_len(prefix, n, 4, branching) == want


def test_decode_track_lens_and_slots():
    assert reqs.decode_track_lens(11, 7, 8) == [16]
    assert reqs.decode_track_lens(7, 17, 8) == [8, 16, 24]
    assert reqs.decode_track_lens(8, 7, 8) == []
    assert [reqs.next_track_after(k, 2) for k in (0, 1)] == [1, 0]
    assert reqs.next_track_after(0, 1) == 0


def test_config_default_off_keeps_headers():
    for f in ("mamba_extra_buffer", "mamba_track_interval", "mamba_track_slots"):
        assert f not in CacheConfig(components=("full", "mamba"), mamba_slots=4).to_dict()
    d = XBUF.to_dict()
    assert d["mamba_extra_buffer"] is True and CacheConfig.from_dict(d) == XBUF


@pytest.mark.parametrize("changes, error", [
    ({"components": ("full",)}, ConfigError),  # needs Mamba
    ({"components": ("full", "swa", "mamba"), "sliding_window": 4}, Unsupported),
    ({"host_slots": 64}, Unsupported),
    ({"page_size": 4, "mamba_cache_chunk_size": 6}, ConfigError),  # not whole pages
    ({"page_size": 4, "mamba_track_interval": 6}, ConfigError),
    ({"mamba_track_slots": 3}, ConfigError),
    ({"mamba_extra_buffer": 1}, ConfigError),
])
def test_config_refusals(changes, error):
    with pytest.raises(error):
        CacheConfig.from_dict({**XBUF.to_dict(), **changes, "components": list(
            changes.get("components", XBUF.components))})


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_tracked_states_are_cached_at_their_lengths(impl):
    """Two ping-pong slots: each chunk hands its tracked slot to the tree at the track length
    (4, then 10), a fresh slot taking its place; the finish caches up to the decode's track
    point (16), not the committed 18, and frees the own slot and the other track slot."""
    out, a = run_steps(impl, XBUF, XBUF_STORY)
    assert out[1]["mamba_pool_idx"] == 1
    nodes = {len(n["path"]["tokens"]): n["mamba"]["value"] for n in a.snapshot()["nodes"]}
    assert nodes == {4: [2], 10: [3], 16: [4]}
    assert out[5]["freed"] == [17, 18] and out[5]["mamba_freed"] == [1, 5]
    assert a.snapshot()["mamba_pool"] == [2, 3, 4]


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_one_track_slot_and_abort(impl):
    """One track slot: the finish keeps it in the tree and frees the own slot only; a
    request without a track point caches nothing at its finish; an abort frees all three."""
    cfg = dataclasses.replace(XBUF, mamba_track_slots=1)
    out, a = run_steps(impl, cfg, XBUF_STORY + [
        ("req_arrive", {"rid": "b", "tokens": [50, 51, 52]}), ("req_admit", {"rid": "b"}),
        ("req_chunk", {"rid": "b", "n": 3, "chunked": False}), ("req_finish", {"rid": "b"}),
        ("req_arrive", {"rid": "c", "tokens": [60, 61]}), ("req_admit", {"rid": "c"}),
        ("req_abort", {"rid": "c"})])
    assert out[5]["mamba_freed"] == [1]
    assert out[9]["mamba_freed"] == [1, 5] and out[9]["freed"] == [17, 18, 19]
    assert out[12]["mamba_freed"] == [1, 5]
    assert not any(n["path"]["tokens"][0] == 50 for n in a.snapshot()["nodes"])


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_admission_waits_without_room_for_three_states(impl):
    cfg = dataclasses.replace(XBUF, mamba_slots=5)
    out, _ = run_steps(impl, cfg, [
        ("req_arrive", {"rid": "a", "tokens": [1, 2]}), ("req_admit", {"rid": "a"}),
        ("req_arrive", {"rid": "b", "tokens": [3, 4]}), ("req_admit", {"rid": "b"})])
    assert out[3]["prefix_len"] == 0 and out[3]["mamba_pool_idx"] is None


def test_sessions_refused():
    a = make_adapter("spec", XBUF)
    got = a.apply({"i": 0, "op": "req_arrive", "args": {"rid": "a", "tokens": [1], "session": "s"}})
    assert got["error"] == "Unsupported" and "mamba_extra_buffer" in got["message"]


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_kv_check_covers_the_tracked_state(impl, monkeypatch):
    """The KV check writes each track point's state into its slot and checks a node that
    takes one: caching a state unaligned to its page on the node below it is reported."""
    cfg = dataclasses.replace(XBUF, page_size=4, mamba_cache_chunk_size=8,
                              mamba_track_interval=12, mamba_track_slots=1)
    steps = [("req_arrive", {"rid": "r", "tokens": [1, 3, 3, 2, 1, 3, 2, 1, 1, 1]}),
             ("req_admit", {"rid": "r"}), ("req_chunk", {"rid": "r", "n": 1, "chunked": True}),
             ("req_chunk", {"rid": "r", "n": 8, "chunked": True})]
    a = KVChecked(make_adapter(impl, cfg), cfg)
    for i, (op, args) in enumerate(steps):
        a.apply({"i": i, "op": op, "args": args})
    assert a.violations() == []
    # planted: the state tracked at 9 cached on the 8-token node
    monkeypatch.setattr(reqs, "cached_track_len", lambda state, n: 0 if n is None else n // 4 * 4)
    from uniradix.fast.components.mamba import MambaComponent
    monkeypatch.setattr(MambaComponent, "_cached_len",
                        lambda self, n: 0 if n is None else int(n) // 4 * 4)
    a = KVChecked(make_adapter(impl, cfg), cfg)
    for i, (op, args) in enumerate(steps):
        a.apply({"i": i, "op": op, "args": args})
    assert any("does not hold the state of its path" in v for v in a.violations())


def test_invariant_a_track_slot_the_tree_holds():
    """spec/requests.py ``request_state_slots``: a request's track slot that the tree holds
    (a hand-over that kept the slot among the track slots) is reported."""
    from uniradix.spec.invariants import sanity_check
    _, a = run_steps("spec", XBUF, XBUF_STORY[:3])
    state = a.state
    assert sanity_check(state) == []
    req = state.requests["a"]
    req.mamba_track[0] = 2  # the slot the first chunk handed to the tree
    assert any("holds a state slot the tree holds" in e for e in sanity_check(state))
    req.mamba_track[0] = req.mamba_slot
    assert any("a state slot held twice" in e for e in sanity_check(state))
