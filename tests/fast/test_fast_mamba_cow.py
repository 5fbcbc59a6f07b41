"""Mamba copy-on-write on the fast path (fast/components/mamba.py ``match_prefix_cow``):
``match_prefix {cow_mamba: true}`` for a request, run in lockstep with the spec
(spec/mamba_cow.py) through the trace ops, observations and snapshots compared after every
step (the spec's stories run on spec and fast too: tests/spec/test_spec_mamba_cow.py's
``spec+fast`` cases; here the ones with a lock elsewhere and a host tier); then the
engine-facing call itself (``MatchPrefixParams(cow_mamba=True, req=...)``), and
the golden corpus recorded from upstream (tests/corpus/upstream-mamba-cow) replayed on fast.

Pools: page 0 is reserved, lowest-free-first; the Mamba pool holds ``mamba_slots`` states
numbered from 1.
"""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import CORPUS
from stories import SpecAndFast
from uniradix import fast
from uniradix.conformance.adapters.fast_hybrid import MambaReqPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.spec.config import CacheConfig
from uniradix.spec.world import PagedPool


class Both(SpecAndFast):
    """The spec and fast in lockstep: every step's observations and snapshots must agree."""

    def __init__(self, **cfg) -> None:
        base = dict(components=("full", "mamba"), kv_slots=64, mamba_slots=3,
                    mamba_cache_chunk_size=4)
        base.update(cfg)
        super().__init__(CacheConfig(**base))

    def cache(self, tokens: list) -> int:
        slots = self.step("alloc", n=len(tokens))["slots"]
        state = self.step("mamba_alloc", n=1)["slots"][0]
        assert self.step("insert", tokens=tokens, value=slots, mamba_value=[state])[
            "mamba_exist"] is False
        return state

    def cow(self, tokens: list, mamba_slot=None) -> dict:
        return self.step("match_prefix", tokens=tokens, cow_mamba=True, mamba_slot=mamba_slot)


def pick(obs: dict, *names: str) -> tuple:
    return tuple(obs[n] for n in names)


def test_every_state_locked_leaves_the_request_without_a_slot():
    s = Both(mamba_slots=2)
    s.cache([1, 2]), s.cache([5, 6])
    assert "error" not in s.step("lock", node={"tokens": [5, 6], "extra_key": None})
    obs = s.cow([1, 2])
    assert pick(obs, "mamba_cow_src", "mamba_pool_idx", "mamba_freed") == (1, None, [])
    node = [n for n in s.fast.snapshot()["nodes"] if n["path"]["tokens"] == [1, 2]][0]
    assert node["lock_ref"] == 0  # the temporary lock is gone


def test_with_a_host_tier_too():
    s = Both(host_slots=32, write_policy="write_through", mamba_slots=4)
    s.cache([1, 2]), s.cache([5, 6]), s.cache([7, 8])
    assert pick(s.cow([5, 6, 1]), "mamba_cow_src", "mamba_pool_idx") == (2, 4)
    # the pool is empty and write-through backups in flight lock every state: no slot
    assert pick(s.cow([7, 8]), "mamba_cow_src", "mamba_pool_idx") == (3, None)


# ----------------------------------------------------------------------------------------------
# The engine-facing call
# ----------------------------------------------------------------------------------------------


def _cache(slots: int = 2):
    kv, states = PagedPool(64, 1, "kv"), PagedPool(slots, 1, "mamba")
    rtt = MambaReqPool(states)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=rtt,
        token_to_kv_pool_allocator=PoolAllocator(kv, torch), page_size=1,
        tree_components=("full", "mamba"), mamba_cache_chunk_size=2))
    return cache, kv, states


def _insert(cache, kv, states, tokens):
    value = torch.tensor(kv.alloc(len(tokens)), dtype=torch.int64)
    state = torch.tensor(states.alloc(1), dtype=torch.int64)
    cache.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=value, mamba_value=state))


def test_the_request_object_is_filled_in_as_upstream_does():
    cache, kv, states = _cache()
    _insert(cache, kv, states, [1, 2, 3])
    req = SimpleNamespace(mamba_pool_idx=None, mamba_cow_src_index=None, mamba_needs_clear=True)
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2, 3, 4]),
                                                  cow_mamba=True, req=req))
    assert m.device_indices.tolist() == [1, 2, 3]
    assert req.mamba_cow_src_index.tolist() == [1] and int(req.mamba_pool_idx) == 2
    assert req.mamba_needs_clear is False
    assert cache.violations() == []


def test_cow_without_a_request_is_refused_before_anything_changes():
    cache, kv, states = _cache()
    _insert(cache, kv, states, [1, 2, 3])
    with pytest.raises(fast.InvalidInput, match="request"):
        cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2]), cow_mamba=True))
    assert [len(n.key) for n in cache.all_nodes() if n is not cache.root_node] == [3]


def test_a_full_only_cache_ignores_cow_as_upstream():
    kv = PagedPool(16, 1, "kv")
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None,
        token_to_kv_pool_allocator=PoolAllocator(kv, torch), page_size=1))
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1]), cow_mamba=True))
    assert len(m.device_indices) == 0


# ----------------------------------------------------------------------------------------------
# The golden corpus recorded from upstream
# ----------------------------------------------------------------------------------------------

COW_TRACES = sorted(glob.glob(os.path.join(CORPUS, "upstream-mamba-cow", "*.jsonl")))


@pytest.mark.parametrize("path", COW_TRACES[:4], ids=[os.path.basename(t) for t in COW_TRACES[:4]])
def test_cow_corpus_replays_on_fast(path):
    result = replay_trace(load_trace(path), "fast")
    assert result.unsupported is None and result.divergence is None, str(result.divergence)


# ----------------------------------------------------------------------------------------------
# conform's copy-on-write config (a short run; `uniradix conform --config mamba-cow` runs long)
# ----------------------------------------------------------------------------------------------


def test_conform_mamba_cow_config_is_clean():
    from uniradix.conformance.env.kvcheck import kv_checked
    from uniradix.conformance.explore.conform import run_conform

    res = run_conform([kv_checked("spec"), kv_checked("fast")], config="mamba-cow", steps=400,
                      seed=3, out=None, progress=False, log=lambda m: None)
    assert res.steps == 400 and res.finding is None
