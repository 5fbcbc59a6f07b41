"""Streaming sessions on the fast path (fast/sessions.py): the spec's session stories
(tests/spec/test_spec_sessions.py) run again with the spec and fast in lockstep, observations
and snapshots (the session slots included) compared after every step; then the engine-facing
API (upstream's names: ``match_prefix`` with a streaming request, ``cache_finished_req``,
``release_session``, ``session_held_*``) on the C core and on the composed Python tree, and
random session workloads in lockstep."""

from __future__ import annotations

import importlib.util
import os
import random
from types import SimpleNamespace

import pytest
import torch

from stories import SpecAndFast
from uniradix import fast
from uniradix.conformance.adapters.fast_adapter import ReqToTokenPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.world import PagedPool

_HERE = os.path.dirname(os.path.abspath(__file__))
_SPEC_PATH = os.path.join(_HERE, "..", "spec", "test_spec_sessions.py")
_loader = importlib.util.spec_from_file_location("spec_session_stories", _SPEC_PATH)
assert _loader is not None and _loader.loader is not None
stories = importlib.util.module_from_spec(_loader)
_loader.loader.exec_module(stories)


class Both(SpecAndFast):
    """The spec and fast in lockstep; ``a`` is the spec's adapter (what the stories read)."""

    def __init__(self, **cfg) -> None:
        super().__init__(CacheConfig(**cfg))

    held = stories.Story.held
    sizes = stories.Story.sizes
    tree = stories.Story.tree


STORIES = [name for name in dir(stories) if name.startswith("test_")
           and name != "test_session_ops_with_an_aux_component_run_on_the_spec_and_fasts_"
           "adapter_refuses_them"]


@pytest.mark.parametrize("name", STORIES)
def test_spec_session_story_in_lockstep_with_fast(name, monkeypatch):
    monkeypatch.setattr(stories, "Story", Both)
    fn = getattr(stories, name)
    marks = getattr(fn, "pytestmark", [])
    params = [m for m in marks if m.name == "parametrize"]
    if not params:
        fn()
        return
    argnames = [a.strip() for a in params[0].args[0].split(",")]
    for values in params[0].args[1]:
        fn(**dict(zip(argnames, values, strict=True)))


# ----------------------------------------------------------------------------------------------
# The engine-facing API
# ----------------------------------------------------------------------------------------------


def _cache(**kw):
    kv = PagedPool(32, 1, "kv")
    rtt = ReqToTokenPool()
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=rtt,
        token_to_kv_pool_allocator=PoolAllocator(kv, torch), page_size=1, **kw))
    return cache, kv, rtt


def _req(rtt, kv, tokens, outputs, session):
    """A request whose prompt and outputs were computed into fresh slots (no prefix)."""
    idx = rtt.take_row()
    n = len(tokens) + len(outputs)
    rtt.req_to_token[idx, :n] = torch.tensor(kv.alloc(n), dtype=torch.int64)
    return SimpleNamespace(
        rid="r", origin_input_ids=list(tokens), output_ids=list(outputs), extra_key=None,
        req_pool_idx=idx, kv_committed_len=n, kv_allocated_len=n, cache_protected_len=0,
        last_node=None, dec_lock_params=None, finished_len=None, to_finish=None,
        session=SimpleNamespace(session_id=session, streaming=True, finished=[],
                                finish_req=lambda r: None))


@pytest.mark.parametrize("python_tree", [False, True])
def test_park_restore_release_through_upstreams_names(python_tree):
    cache, kv, rtt = _cache()
    if python_tree:  # the composed Python tree, Full only (as compat.PYTHON_TREE builds it)
        from uniradix.fast.hybrid import HybridRadixCache
        cache = HybridRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=rtt,
            token_to_kv_pool_allocator=PoolAllocator(kv, torch), page_size=1))
    assert cache.supports_streaming_session()
    plain_match = type(cache).match_prefix
    req = _req(rtt, kv, [1, 2, 3], [7, 8], "s")
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2]), req=req))
    req.last_node = m.last_device_node
    req.dec_lock_params = cache.inc_lock_ref(m.last_device_node).to_dec_params()
    cache.cache_finished_req(req)
    assert req.req_pool_idx is None and cache.session_held_tokens() == 5
    assert cache.session_held_req_count() == 1 and cache.session_held_mamba_slots() == 0
    assert "match_prefix" in cache.__dict__  # the session-aware entries, while a slot exists

    nxt = _req(rtt, kv, [1, 2, 3, 7, 8, 9], [], "s")
    rtt.free_rows.append(nxt.req_pool_idx)  # (the scheduler gives it no row of its own)
    nxt.req_pool_idx = None
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3, 7, 8]), req=nxt))
    assert m.device_indices.tolist() == [1, 2, 3, 4, 5] and m.cache_protected_len == 0
    assert cache.inc_lock_ref(m.last_device_node).delta is None  # the virtual node: no-op
    assert cache.session_held_tokens({nxt.req_pool_idx}) == 0
    with pytest.raises(fast.InvalidInput, match="running"):
        cache.release_session("s")
    cache.cache_finished_req(nxt)
    cache.release_session("s")
    assert "match_prefix" not in cache.__dict__ and type(cache).match_prefix is plain_match
    assert cache.session_held_tokens() == 0 and cache.violations() == []
    cache.release_session("s")  # unknown now: a no-op, as upstream


def test_a_restore_that_does_not_continue_the_session_changes_nothing():
    cache, kv, rtt = _cache()
    req = _req(rtt, kv, [1, 2, 3], [7], "s")
    req.last_node = cache.root_node
    cache.cache_finished_req(req)
    other = SimpleNamespace(req_pool_idx=None, to_finish=None, extra_key=None,
                            session=SimpleNamespace(session_id="s", streaming=True))
    before = kv.available_size()
    with pytest.raises(fast.InvalidInput, match="continue"):
        cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 9]), req=other))
    assert kv.available_size() == before and other.req_pool_idx is None


def test_a_parked_turn_keeps_its_mamba_state_and_release_frees_it():
    """fast's Mamba plug-in: the request's state slot is parked with the row (the request's
    refs cleared), counted by ``session_held_mamba_slots``, given back to the next turn, and
    freed by ``release_session``; a state eviction cannot take it meanwhile."""
    kv, states = PagedPool(32, 1, "kv"), PagedPool(4, 1, "mamba")
    from uniradix.conformance.adapters.fast_hybrid import MambaReqPool
    rtt = MambaReqPool(states)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=rtt, token_to_kv_pool_allocator=PoolAllocator(kv, torch),
        page_size=1, tree_components=("full", "mamba")))
    req = _req(rtt, kv, [1, 2], [5], "s")
    req.last_node = cache.root_node
    req.mamba_pool_idx = torch.tensor(states.alloc(1)[0])
    req.swa_evicted_seqlen = 0
    cache.cache_finished_req(req)
    assert req.mamba_pool_idx is None and cache.session_held_mamba_slots() == 1
    assert cache.session_held_mamba_slots({cache.sessions.slots["s"].req_pool_idx}) == 0
    assert states.allocated_pages() == {1}
    assert cache.evict(fast.EvictParams(num_tokens=0, mamba_num=4)).mamba_num_evicted == 0
    nxt = SimpleNamespace(req_pool_idx=None, to_finish=None, extra_key=None,
                          session=SimpleNamespace(session_id="s", streaming=True))
    cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 5]), req=nxt))
    assert int(nxt.mamba_pool_idx) == 1 and nxt.swa_evicted_seqlen == 0
    cache.sessions.slots["s"].active = None  # (the turn ends without running)
    cache.release_session("s")
    assert states.allocated_pages() == set() and cache.session_held_mamba_slots() == 0
    assert cache.violations() == []


# ----------------------------------------------------------------------------------------------
# Random session workloads in lockstep
# ----------------------------------------------------------------------------------------------


def _session_workload(both: Both, rng: random.Random, turns: int) -> None:
    """Sessions taking turns among plain requests: each turn continues its session's tokens
    (read from the spec's slot) with a few new ones, prefilled in chunks (chunked or not),
    decoded, then finished or aborted; sessions are released now and then."""
    sessions: dict[str, list] = {}
    n = 0
    for _ in range(turns):
        n += 1
        rid = f"r{n}"
        name = rng.choice(["s1", "s2", "s3", None])
        if name is None:
            tokens = [rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
        else:
            view = {v["session"]: v for v in both.a.snapshot().get("sessions", [])}
            base = sessions.get(name, []) if name in view else []
            tokens = base + [rng.randint(1, 3) for _ in range(rng.randint(1, 4))]
        if "error" in both.step("req_arrive", rid=rid, tokens=tokens, session=name):
            continue
        if "error" in both.step("req_admit", rid=rid):
            both.step("req_abort", rid=rid)
            continue
        req = [r for r in both.a.snapshot()["requests"] if r["rid"] == rid][0]
        left = len(tokens) - req["committed"]
        while left > 0:
            k = rng.randint(1, left)
            if not both.step("req_chunk", rid=rid, n=k, chunked=rng.random() < 0.5)["ok"]:
                break
            left -= k
        if left == 0 and rng.random() < 0.8:
            both.step("req_decode", rid=rid, n=rng.randint(1, 3))
        state = both.a.state.requests.get(rid)
        if rng.random() < 0.15 or left > 0:
            both.step("req_abort", rid=rid)
            sessions.pop(name, None) if name is not None else None
        else:
            all_ids = list(state.all_ids) if state is not None else tokens
            both.step("req_finish", rid=rid)
            if name is not None:
                sessions[name] = all_ids
        if rng.random() < 0.2:
            gone = rng.choice(["s1", "s2", "s3"])
            both.step("release_session", session=gone)
            sessions.pop(gone, None)
        if rng.random() < 0.3:
            both.step("session_held")
        if rng.random() < 0.1:
            both.step("evict", num_tokens=rng.randint(1, 8))


@pytest.mark.parametrize("page_size, seed, extra", [(1, 0, {}), (1, 1, {}), (2, 2, {}), (4, 3, {}),
                                                    (1, 7, {"disable": True}),
                                                    (2, 9, {"eagle": True})])
def test_random_session_workloads_in_lockstep(page_size, seed, extra):
    both = Both(kv_slots=48 // page_size * page_size, page_size=page_size, **extra)
    _session_workload(both, random.Random(seed), 60)


def test_conform_sessions_config_is_clean():
    from uniradix.conformance.env.kvcheck import kv_checked
    from uniradix.conformance.explore.conform import run_conform

    res = run_conform([kv_checked("spec"), kv_checked("fast")], config="sessions-p4", steps=400,
                      seed=5, out=None, progress=False, log=lambda m: None)
    assert res.steps == 400 and res.finding is None


def test_the_hybrid_adapter_reports_parked_swa_and_mamba_state_as_the_spec_does():
    """session_ops.py's session_held and sessions view on the hybrid adapter (Full + SWA +
    Mamba): a first turn parked through the cache's API; the adapter answers the spec's
    fields (``swa_tokens``, ``mamba_slots``, each slot's ``swa_evicted_seqlen`` and
    ``mamba_slot``), and release_session reports the aux pools' frees."""
    from uniradix.conformance.adapters.fast_hybrid import HybridFastAdapter
    a = HybridFastAdapter(CacheConfig(kv_slots=32, swa_slots=32, sliding_window=2,
                                      components=("full", "swa", "mamba"), mamba_slots=4))
    cache, rtt = a.cache, a.rtt
    req = SimpleNamespace(
        rid="r", origin_input_ids=[1, 2, 3], output_ids=[7, 8, 9], extra_key=None,
        req_pool_idx=rtt.take_row(), kv_committed_len=6, kv_allocated_len=6,
        cache_protected_len=0, last_node=cache.root_node, dec_lock_params=None,
        finished_len=None, to_finish=None, swa_evicted_seqlen=0, swa_uuid_for_lock=None,
        mamba_pool_idx=torch.tensor(a.mamba.alloc(1)[0]),
        session=SimpleNamespace(session_id="s", streaming=True, finish_req=lambda r: None))
    rtt.ensure(6)
    rtt.req_to_token[req.req_pool_idx, :6] = a.alloc.alloc(6)
    a.alloc.free_swa(rtt.req_to_token[req.req_pool_idx, :2])  # positions 0, 1 left the window
    req.swa_evicted_seqlen = 2
    cache.cache_finished_req(req)
    assert a.op_session_held({"op": "session_held", "args": {}}) == {
        "tokens": 6, "full_tokens": 6, "req_count": 1, "swa_tokens": 4, "mamba_slots": 1}
    (view,) = a.sessions_view()
    assert (view["swa_evicted_seqlen"], view["mamba_slot"], view["row"]) == (
        2, 1, [1, 2, 3, 4, 5, 6])
    a._drain_pools()
    obs = a.op_release_session({"op": "release_session", "args": {"session": "s"}})
    assert obs["freed"] == [1, 2, 3, 4, 5, 6] and len(obs["swa_freed"]) == 4
    assert obs["mamba_freed"] == [1]
    assert a.op_session_held({"op": "session_held", "args": {}})["swa_tokens"] == 0
