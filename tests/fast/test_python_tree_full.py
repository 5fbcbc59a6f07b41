"""The device-only Full cache on the composed pure-Python tree (fast/hybrid.py with no aux
component and no tier), which a Full-only cache runs on when it asks for a setting only that tree
honours (``fast.compat.PYTHON_TREE``): it replays the Full corpus with 0 divergences, as the C
core does, and says why it runs there."""

import glob
import os

import pytest
import torch

from conftest import CORPUS
from uniradix import fast
from uniradix.conformance.traces.replay import replay_trace
from uniradix.conformance.traces.trace import load_trace
from uniradix.fast import compat
from uniradix.fast.hybrid import HybridRadixCache

# one seed per Full config of the upstream corpus, and the regression traces of the Full path
TRACES = [t for t in sorted(glob.glob(os.path.join(CORPUS, "upstream", "*-s00[12].jsonl"))
                             + glob.glob(os.path.join(CORPUS, "regressions", "*.jsonl")))
          if load_trace(t).config.components == ("full",) and not load_trace(t).config.has_host_tier]


def test_there_are_traces():
    assert len(TRACES) >= 5


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_full_corpus_replays_on_the_python_tree(path, monkeypatch):
    trace = load_trace(path)
    built = []

    def python_tree(params):
        cache = HybridRadixCache(params)
        built.append(cache)
        return cache

    monkeypatch.setattr(fast, "UnifiedRadixCache", python_tree)
    result = replay_trace(trace, "fast")
    assert built and built[0].core == "python" and not built[0].components
    assert result.unsupported is None and result.divergence is None, result.divergence


def test_a_python_tree_setting_moves_a_full_cache_to_the_python_tree(monkeypatch):
    """``UnifiedRadixCache(params)`` follows ``compat.PYTHON_TREE`` (checked with a made-up
    entry: the real ones are added with the features that need them)."""
    from uniradix.conformance.adapters.fast_adapter import ReqToTokenPool
    from uniradix.conformance.env.pools import PoolAllocator
    from uniradix.spec.world import PagedPool

    class Params(fast.CacheInitParams):  # a subclass takes the made-up attribute
        made_up_setting = 0

    def params(**kw):
        p = Params(disable=False, req_to_token_pool=ReqToTokenPool(),
                                 token_to_kv_pool_allocator=PoolAllocator(PagedPool(64, 1, "kv"),
                                                                          torch, whole_pages=True),
                                 page_size=1)
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    monkeypatch.setattr(compat, "PYTHON_TREE", (("made_up_setting", 0, "a made-up feature"),))
    plain = fast.UnifiedRadixCache(params())
    assert type(plain) is fast.UnifiedRadixCache
    moved = fast.UnifiedRadixCache(params(made_up_setting=3))
    assert isinstance(moved, HybridRadixCache) and moved.core == "python"
    assert "made_up_setting=3" in moved.core_reason and "a made-up feature" in moved.core_reason
