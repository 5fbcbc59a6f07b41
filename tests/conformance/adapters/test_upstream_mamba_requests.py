"""MambaUpstreamRequestAdapter: sglang 0.5.13.post1's request path for a Full + Mamba cache,
with and without the Mamba extra buffer, over sglang's own HybridReqToTokenPool
(conformance/adapters/upstream_requests.py; needs sglang importable), and the two places where
the spec departs from it on purpose (docs/SPEC.md "The Mamba extra buffer").

Run inside the upstream venv: VENV/bin/python -m pytest
tests/conformance/adapters/test_upstream_mamba_requests.py.  Everywhere else it is skipped.
"""

from __future__ import annotations

import os

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.spec.config import CacheConfig

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh and run pytest with its python)",
                allow_module_level=True)

from conftest import CORPUS  # noqa: E402
from uniradix.conformance.adapters.base import SpecAdapter, make_adapter  # noqa: E402
from uniradix.conformance.adapters.upstream_requests import (  # noqa: E402
    MambaUpstreamRequestAdapter,
    UpstreamRequestAdapter,
    record_mamba,
)
from uniradix.conformance.traces.replay import replay_trace  # noqa: E402
from uniradix.conformance.traces.trace import load_trace  # noqa: E402
from uniradix.spec.errors import Unsupported  # noqa: E402
from uniradix.spec.requests import output_token_id  # noqa: E402
from upstream_lockstep import lockstep_steps  # noqa: E402


def xbuf(ps: int, slots: int = 8, track_slots: int = 2, chunk: int | None = None,
         interval: int | None = None) -> CacheConfig:
    return CacheConfig(page_size=ps, kv_slots=64, components=("full", "mamba"),
                       mamba_slots=slots, mamba_extra_buffer=True,
                       mamba_track_slots=track_slots, mamba_cache_chunk_size=chunk or ps,
                       mamba_track_interval=interval or 2 * ps)


def _both(config: CacheConfig, steps: list, up=None) -> tuple:
    up = up if up is not None else MambaUpstreamRequestAdapter(config)
    spec = SpecAdapter(config)
    return lockstep_steps(up, spec, steps), up, spec


PROMPT = list(range(1, 18))  # 17 tokens
OUT3 = [output_token_id(PROMPT, k) for k in range(3)]  # its first three output tokens


@pytest.mark.parametrize("ps, track_slots", [(1, 2), (1, 1), (4, 2)])
def test_track_points_donation_and_the_cut_finish_as_the_spec_says(ps, track_slots):
    """Admission takes the running slot and the track slots (sglang's
    HybridReqToTokenPool.alloc); a chunk tracks at its last whole chunk and its cache hands
    the tracked slot to the tree (a fresh one takes its place); decode tracks at the
    interval; the finish caches up to the last track point only, with the kept track slot;
    a second request then hits the cached prefix.  Every step and snapshot as the spec's."""
    cfg = xbuf(ps, track_slots=track_slots, chunk=4, interval=4)
    steps = [("req_arrive", {"rid": "a", "tokens": PROMPT}), ("req_admit", {"rid": "a"}),
             ("req_chunk", {"rid": "a", "n": 8, "chunked": True}),
             ("req_chunk", {"rid": "a", "n": 9, "chunked": False}),
             ("req_decode", {"rid": "a", "n": 2}), ("req_decode", {"rid": "a", "n": 1}),
             ("req_finish", {"rid": "a"}),
             ("req_arrive", {"rid": "b", "tokens": PROMPT + OUT3 + [99]}),
             ("req_admit", {"rid": "b"}), ("req_abort", {"rid": "b"})]
    obs, up, spec = _both(cfg, steps[:3])
    view = up.snapshot()["requests"][0]
    assert view["mamba_track_len"] is None  # used up by the cache of the chunk
    assert len(view["mamba_track"]) == track_slots
    held = [n for n in up.snapshot()["nodes"] if n["mamba"]["value"] is not None]
    assert [len(n["path"]["tokens"]) for n in held] == [8]  # the donated tracked state
    obs, _, _ = _both(cfg, steps, up=None)
    assert obs[8]["prefix_len"] == 20  # the finish cached up to its track point at 20
    assert obs[1]["mamba_pool_idx"] is not None


def test_without_the_extra_buffer_the_request_state_is_copied_and_kept():
    """Full + Mamba at page 1 without the buffer: one state slot a request, a chunk's cache
    copies it into a fresh slot, the finish gives the tree the request's own slot."""
    cfg = CacheConfig(page_size=1, kv_slots=64, components=("full", "mamba"), mamba_slots=4)
    obs, up, _ = _both(cfg, [
        ("req_arrive", {"rid": "a", "tokens": PROMPT}), ("req_admit", {"rid": "a"}),
        ("req_chunk", {"rid": "a", "n": 5, "chunked": True}),
        ("req_chunk", {"rid": "a", "n": 12, "chunked": False}),
        ("req_decode", {"rid": "a", "n": 3}), ("req_finish", {"rid": "a"}),
        ("req_arrive", {"rid": "b", "tokens": PROMPT + [7]}), ("req_admit", {"rid": "b"}),
        ("req_finish", {"rid": "b"})])
    assert obs[7]["prefix_len"] == 17
    assert up.departures == []


def test_an_admission_short_of_state_slots_waits_holding_nothing():
    """Three slots, a request takes three (its own, two track slots): the next one evicts
    what it can and waits, its lock undone; after the first finishes it is admitted."""
    cfg = xbuf(1, slots=3, chunk=2, interval=4)
    obs, _, _ = _both(cfg, [
        ("req_arrive", {"rid": "a", "tokens": [5]}), ("req_admit", {"rid": "a"}),
        ("req_arrive", {"rid": "b", "tokens": [1, 2, 3, 9]}), ("req_admit", {"rid": "b"}),
        ("req_chunk", {"rid": "a", "n": 1, "chunked": False}), ("req_finish", {"rid": "a"}),
        ("req_admit", {"rid": "b"}), ("req_abort", {"rid": "b"})])
    assert obs[3] == {"prefix_len": 0, "mamba_pool_idx": None, "freed": [], "mamba_freed": []}
    assert obs[6]["mamba_pool_idx"] is not None


def test_a_track_length_inside_a_page_is_the_spec_s_departure():
    """docs/SPEC.md: a chunk that starts inside a page tracks an unaligned length; upstream
    caches that state on the page-aligned node below it, the spec caches it nowhere.  The
    regression trace replays on the adapter (the spec's rule applied, and recorded as a
    departure) and diverges on upstream's own behaviour."""
    path = os.path.join(CORPUS, "regressions",
                        "conform-mamba-xbuf-p4-track-len-inside-a-page.jsonl")
    trace = load_trace(path)
    up = MambaUpstreamRequestAdapter(trace.config)
    for s in trace.steps:
        got = up.apply(s)
        assert got == s["ret"], (s, got)
    assert up.departures and "inside a page" in up.departures[0]
    own = MambaUpstreamRequestAdapter(trace.config, spec_rules=False)
    diverged = [s["i"] for s in trace.steps if own.apply(s) != s["ret"]]
    # upstream's own: the state tracked at 9 tokens sits on the 8-token node, which the
    # match at step 7 then hits
    assert diverged == [7]
    eight = [n for n in own.snapshot()["nodes"] if len(n["path"]["tokens"]) == 8]
    assert eight and eight[0]["mamba"]["value"] is not None
    assert own.departures == []


def test_no_state_slot_for_a_chunk_s_cache_is_the_spec_s_departure():
    """Every state slot is the running request's (its own and two track slots) and the tree
    holds none: the cache of a tracked chunk finds no fresh slot.  Upstream's
    ``_alloc_mamba_slot`` asserts; the spec caches nothing and uses the track length up."""
    cfg = xbuf(1, slots=3, chunk=2, interval=4)
    steps = [("req_arrive", {"rid": "a", "tokens": [1, 2, 3, 4, 5]}),
             ("req_admit", {"rid": "a"}), ("req_chunk", {"rid": "a", "n": 4, "chunked": True}),
             ("req_finish", {"rid": "a"})]
    obs, up, _ = _both(cfg, steps)
    assert up.departures and "no state slot" in up.departures[0]
    own = MambaUpstreamRequestAdapter(cfg, spec_rules=False)
    for k, (op, args) in enumerate(steps[:2]):
        own.apply({"i": k, "op": op, "args": args})
    with pytest.raises(AssertionError, match="Can not alloc mamba cache"):
        own.apply({"i": 2, "op": "req_chunk", "args": steps[2][1]})


def test_one_track_slot_admission_evicts_only_what_it_takes_unlike_upstream():
    """docs/SPEC.md: with one track slot a request takes two states, and the spec evicts only
    the shortfall of those two; sglang's ``alloc_req_slots`` evicts against a fixed three, so
    upstream drops a cached state (and its pages) that the spec keeps."""
    cfg = xbuf(1, slots=4, track_slots=1, chunk=2, interval=4)
    steps = []
    for rid, toks in (("a", [1, 2, 3, 4, 5]), ("c", [7, 8, 9, 10, 11])):
        steps += [("req_arrive", {"rid": rid, "tokens": toks}), ("req_admit", {"rid": rid}),
                  ("req_chunk", {"rid": rid, "n": 5, "chunked": False}),
                  ("req_finish", {"rid": rid})]
    steps += [("req_arrive", {"rid": "b", "tokens": [20, 21, 22]}), ("req_admit", {"rid": "b"})]
    obs, up, spec = _both(cfg, steps)
    assert obs[-1]["freed"] == [] and obs[-1]["mamba_freed"] == []

    def states(adapter) -> list[int]:
        return sorted(len(n["path"]["tokens"]) for n in adapter.snapshot()["nodes"]
                      if n["mamba"]["value"] is not None)

    assert states(spec) == states(up) == [4, 4]
    own = MambaUpstreamRequestAdapter(cfg, spec_rules=False)
    got = [own.apply({"i": k, "op": op, "args": args}) for k, (op, args) in enumerate(steps)]
    assert got[:-1] == obs[:-1]
    assert got[-1]["mamba_freed"] and got[-1]["freed"]  # one cached state evicted for nothing
    assert states(own) == [4]


def test_refusals_by_name():
    cfg = xbuf(1)
    up = MambaUpstreamRequestAdapter(cfg)
    obs = up.apply({"i": 0, "op": "req_arrive",
                    "args": {"rid": "a", "tokens": [1, 2], "session": "s"}})
    assert obs == {"error": "Unsupported"}
    with pytest.raises(Unsupported, match="components"):
        MambaUpstreamRequestAdapter(CacheConfig(components=("full", "swa"), swa_slots=16,
                                                sliding_window=4))
    assert type(make_adapter("upstream-requests", cfg)) is MambaUpstreamRequestAdapter
    assert type(make_adapter("upstream-requests", CacheConfig())) is UpstreamRequestAdapter


def test_a_recording_replays_on_spec_and_fast(tmp_path):
    path = str(tmp_path / "t.jsonl")
    steps = record_mamba("mamba-xbuf-p4", 5, 120, path)
    assert len(steps) == 120 and any(s["op"] == "req_chunk" for s in steps)
    trace = load_trace(path)
    assert "HybridReqToTokenPool" in trace.header["source"]
    assert trace.config.mamba_extra_buffer
    for impl in ("spec", "fast"):
        assert replay_trace(trace, impl, check_kv=True).divergence is None, impl
    with pytest.raises(ValueError, match="unknown Mamba config"):
        record_mamba("full-p1", 1, 10, path)


@pytest.mark.parametrize("config", ["mamba-xbuf-p4", "mamba"])
def test_conform_runs_the_request_path_against_upstream(config):
    """``conform --impls spec,upstream-requests`` on a Mamba config drives requests, not the
    tree level only."""
    import collections

    from uniradix.conformance.explore.conform import run_conform

    ops: collections.Counter = collections.Counter()

    class Counted(MambaUpstreamRequestAdapter):
        def apply(self, step: dict) -> dict:
            ops[step["op"]] += 1
            return super().apply(step)

    Counted.impl_name = "upstream-requests"  # type: ignore[attr-defined]
    res = run_conform(["spec", Counted], config=config, steps=150, seed=3, out=None,
                      progress=False, log=lambda m: None)
    assert (res.steps, res.divergences, res.violations) == (150, 0, 0)
    assert ops["req_chunk"] > 0 and ops["req_finish"] + ops["req_abort"] > 0
