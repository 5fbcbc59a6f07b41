"""UpstreamRequestAdapter: sglang 0.5.13.post1's request path with streaming sessions, driven
with sglang's own Req (conformance/adapters/upstream_requests.py; needs sglang importable).

Run inside the upstream venv: VENV/bin/python -m pytest
tests/conformance/adapters/test_upstream_requests.py.  Everywhere else the module is skipped.
"""

from __future__ import annotations

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.spec.config import CacheConfig
from uniradix.spec.requests import output_token_id

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh and run pytest with its python)",
                allow_module_level=True)

from uniradix.conformance.adapters.base import SpecAdapter  # noqa: E402
from uniradix.conformance.adapters.upstream_requests import (  # noqa: E402
    UpstreamRequestAdapter,
    record_sessions,
)
from uniradix.conformance.traces.replay import replay_trace  # noqa: E402
from uniradix.conformance.traces.trace import load_trace  # noqa: E402
from upstream_lockstep import lockstep_steps  # noqa: E402


def _both(config: CacheConfig, steps: list) -> list:
    return lockstep_steps(UpstreamRequestAdapter(config), SpecAdapter(config), steps)


@pytest.mark.parametrize("ps", [1, 4])
def test_a_session_turn_is_parked_and_restored_as_the_spec_says(ps):
    """First turn through the tree (parked at finish, its lock kept), the next turn restored
    from the slot (prefix = the parked tokens), session_held, release."""
    cfg = CacheConfig(page_size=ps, kv_slots=64)
    turn = [1, 2, 3, 4, 5] + [output_token_id([1, 2, 3, 4, 5], k) for k in range(2)]
    obs = _both(cfg, [
        ("req_arrive", {"rid": "a", "tokens": [1, 2, 3, 4, 5], "session": "s"}),
        ("req_admit", {"rid": "a"}),
        ("req_chunk", {"rid": "a", "n": 5, "chunked": False}),
        ("req_decode", {"rid": "a", "n": 2}),
        ("req_finish", {"rid": "a"}),
        ("session_held", {}),
        ("req_arrive", {"rid": "b", "tokens": turn + [8, 9], "session": "s"}),
        ("req_arrive", {"rid": "c", "tokens": [1], "session": "s"}),  # busy: rejected
        ("req_admit", {"rid": "b"}),
        ("req_chunk", {"rid": "b", "n": 2, "chunked": False}),
        ("req_finish", {"rid": "b"}),
        ("req_arrive", {"rid": "d", "tokens": [9, 9], "session": "s"}),  # not continuing
        ("release_session", {"session": "s"}),
        ("session_held", {}),
    ])
    assert obs[5]["req_count"] == 1 and obs[5]["tokens"] > 0
    assert obs[8] == {"prefix_len": 7}
    assert obs[7]["error"] == "InvalidInput" and obs[11]["error"] == "InvalidInput"
    assert obs[12]["freed"] and obs[13] == {"tokens": 0, "full_tokens": 0, "req_count": 0}


def test_an_aborted_session_request_ends_the_session():
    cfg = CacheConfig(page_size=1, kv_slots=32)
    obs = _both(cfg, [
        ("req_arrive", {"rid": "a", "tokens": [1, 2, 3], "session": "s"}),
        ("req_admit", {"rid": "a"}),
        ("req_chunk", {"rid": "a", "n": 3, "chunked": True}),
        ("req_abort", {"rid": "a"}),
        ("session_held", {}),
        ("req_arrive", {"rid": "b", "tokens": [7], "session": "s"}),  # a fresh session
    ])
    assert obs[3]["freed"] == [1, 2, 3] and obs[4]["req_count"] == 0 and obs[5] == {}


def test_a_recording_replays_on_spec_and_fast(tmp_path):
    path = str(tmp_path / "t.jsonl")
    steps = record_sessions("sessions-p4", 3, 150, path)
    assert len(steps) == 150 and any(s["op"] == "req_admit" for s in steps)
    trace = load_trace(path)
    assert "StreamingSession" in trace.header["source"]
    for impl in ("spec", "fast"):
        assert replay_trace(trace, impl).divergence is None, impl
    with pytest.raises(ValueError, match="unknown sessions config"):
        record_sessions("full-p1", 1, 10, path)


def test_reachable_by_name_in_conform():
    """``upstream-requests`` names this adapter for ``make_adapter`` and ``conform``: a session
    config runs its request-level ops and sessions against upstream, not the tree level only."""
    import collections

    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.explore.conform import run_conform
    from uniradix.spec.errors import Unsupported

    assert type(make_adapter("upstream-requests", CacheConfig())) is UpstreamRequestAdapter
    with pytest.raises(Unsupported, match="components"):  # (Full + Mamba: its own file)
        make_adapter("upstream-requests", CacheConfig(components=("full", "swa"),
                                                      swa_slots=16, sliding_window=4))
    ops: collections.Counter = collections.Counter()

    class Counted(UpstreamRequestAdapter):
        def apply(self, step: dict) -> dict:
            ops[step["op"]] += 1
            ops["a session's"] += bool((step.get("args") or {}).get("session"))
            return super().apply(step)

    Counted.impl_name = "upstream-requests"  # type: ignore[attr-defined]
    res = run_conform(["spec", Counted], config="sessions-p1", steps=200, seed=1, out=None,
                      progress=False, log=lambda m: None)
    assert (res.steps, res.divergences, res.violations) == (200, 0, 0)
    assert ops["req_finish"] > 0 and ops["a session's"] > 0


def test_the_request_path_with_a_host_tier_against_the_spec():
    """``upstream-requests`` with a host tier (Full): conform's host scenario, request-level
    ops included, where the admission's load back names the request (``load_back {rid}``,
    ``init_load_back(req=req)`` with sglang's own ``Req``), runs spec against upstream with no
    divergence on both write policies; a request whose session has a slot is refused as the
    spec refuses it; a host tier with Mamba stays refused by name."""
    import collections

    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.adapters.upstream_requests import HostUpstreamRequestAdapter
    from uniradix.conformance.explore.conform import run_conform
    from uniradix.spec.errors import Unsupported

    host = CacheConfig(kv_slots=32, host_slots=64, write_policy="write_through")
    assert type(make_adapter("upstream-requests", host)) is HostUpstreamRequestAdapter
    with pytest.raises(Unsupported, match="aux component at page_size 4"):  # (upstream's
        # extra buffer past page 1)
        make_adapter("upstream-requests", CacheConfig(
            components=("full", "mamba"), kv_slots=32, host_slots=64, mamba_slots=4,
            page_size=4))
    ops: collections.Counter = collections.Counter()

    class Counted(HostUpstreamRequestAdapter):
        def apply(self, step: dict) -> dict:
            obs = super().apply(step)
            named = step["op"] == "load_back" and "rid" in (step.get("args") or {})
            ops[step["op"] + (" {rid}" if named else "")] += 1
            ops["loaded for a request"] += named and bool(obs.get("device_indices"))
            return obs

    Counted.impl_name = "upstream-requests"  # type: ignore[attr-defined]
    for config in ("hicache-wt-p1", "hicache-wb-p4"):
        res = run_conform(["spec", Counted], config=config, steps=1500, seed=3, out=None,
                          progress=False, log=lambda m: None)
        assert (res.divergences, res.violations) == (0, 0), (config, res.finding)
    assert ops["req_finish"] > 0 and ops["load_back {rid}"] > 0
    assert ops["loaded for a request"] > 0
    steps = [{"op": "req_arrive", "args": {"rid": "a", "tokens": [1, 2, 3], "session": "s"}},
             {"op": "req_admit", "args": {"rid": "a"}},
             {"op": "req_chunk", "args": {"rid": "a", "n": 3, "chunked": False}},
             {"op": "req_finish", "args": {"rid": "a"}},
             {"op": "req_arrive", "args": {"rid": "b", "tokens": [1, 2, 3, 4], "session": "s"}},
             {"op": "load_back", "args": {"rid": "b", "node": {"tokens": [], "extra_key": None},
                                          "last_device_node": {"tokens": [], "extra_key": None}}}]
    for impl in ("spec", "upstream-requests"):
        a = make_adapter(impl, host)
        for k, s in enumerate(steps):
            obs = a.apply({"i": k, **s})
        assert obs.get("error") == "InvalidInput", (impl, obs)


def test_the_request_path_with_a_host_tier_and_mamba_against_the_spec():
    """``upstream-requests`` on host-mamba-wt-p1: a load back naming a waiting request gives
    the loaded state's slot to that request's sglang ``Req`` (``mamba_pool_idx``), and its
    admission keeps it (sglang's ``HybridReqToTokenPool.alloc``), as the spec says; the
    regression trace of that replays on upstream's request path, and conform runs clean but
    for documented differences."""
    import os

    from conftest import CORPUS
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.adapters.upstream_requests import HostMambaUpstreamRequestAdapter
    from uniradix.conformance.explore.conform import run_conform
    trace = load_trace(os.path.join(
        CORPUS, "regressions-host-aux",
        "load-back-for-a-waiting-request-its-admission-keeps-the-slot.jsonl"))
    assert type(make_adapter("upstream-requests", trace.config)) is \
        HostMambaUpstreamRequestAdapter
    assert replay_trace(trace, "upstream-requests").divergence is None
    kept = []

    class Counted(HostMambaUpstreamRequestAdapter):
        def apply(self, step: dict) -> dict:
            obs = super().apply(step)
            if step["op"] == "req_admit" and "error" not in obs:
                r = self.requests.get(step["args"]["rid"])
                kept.append(getattr(r, "from_load_back", None) == obs["mamba_pool_idx"])
            if step["op"] == "load_back" and "rid" in step["args"] and "error" not in obs:
                self.requests[step["args"]["rid"]].from_load_back = obs["mamba_pool_idx"]
            return obs

    Counted.impl_name = "upstream-requests"  # type: ignore[attr-defined]
    res = run_conform(["spec", Counted], config="host-mamba-wt-p1", steps=3000, seed=11,
                      out=None, progress=False, log=lambda m: None)
    assert (res.divergences, res.violations) == (0, 0), res.finding
    assert any(kept)
    # the request aborted while it waits, holding the slot: sglang's release_kv_cache frees it
    steps = [{k: v for k, v in st.items() if k != "ret"} for st in trace.steps[:-1]]
    steps.append({"i": len(steps), "op": "req_abort", "args": {"rid": "r21"}})
    for impl in ("spec", "upstream-requests"):
        a = make_adapter(impl, trace.config)
        for st in steps:
            obs = a.apply(st)
        assert obs["mamba_freed"] == [1], (impl, obs)
        assert a.snapshot()["requests"] == []

