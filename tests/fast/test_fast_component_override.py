"""``CacheInitParams.component_registry_override`` on the fast path (fast/compat.py
``component_overrides``): a uniradix plug-in subclass replaces the built-in SWA or Mamba
plug-in; upstream's own class for a component changes nothing; anything else is refused by
name; entries for components the cache does not have are ignored, as upstream ignores them."""

from __future__ import annotations

import pytest
import torch

from uniradix import fast
from uniradix.conformance.adapters.fast_hybrid import MambaReqPool
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.components.mamba import MambaComponent
from uniradix.spec.world import PagedPool


class CountingMamba(MambaComponent):
    """A replacement Mamba plug-in: the built-in one, counting the states it takes."""

    taken = 0

    def on_set(self, value: torch.Tensor) -> None:
        type(self).taken += 1
        super().on_set(value)


def _mamba_cache(override):
    kv, states = PagedPool(32, 1, "kv"), PagedPool(4, 1, "mamba")
    return fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=MambaReqPool(states),
        token_to_kv_pool_allocator=PoolAllocator(kv, torch), page_size=1,
        tree_components=("full", "mamba"), component_registry_override=override)), kv, states


def test_a_plugin_subclass_replaces_the_built_in_one():
    cache, kv, states = _mamba_cache({"mamba": CountingMamba})
    assert type(cache.mamba) is CountingMamba
    CountingMamba.taken = 0
    cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2]),
                                   value=torch.tensor(kv.alloc(2), dtype=torch.int64),
                                   mamba_value=torch.tensor(states.alloc(1), dtype=torch.int64)))
    assert CountingMamba.taken == 1 and cache.violations() == []
    m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey([1, 2])))
    assert m.device_indices.tolist() == [1, 2]


def test_upstreams_own_class_is_the_default():
    upstream_mamba = type("MambaComponent", (), {
        "__module__": "sglang.srt.mem_cache.unified_cache_components.mamba_component"})
    cache, _, _ = _mamba_cache({2: upstream_mamba})  # upstream's ComponentType.MAMBA == 2
    assert type(cache.mamba) is MambaComponent


@pytest.mark.parametrize("override, what", [
    ({"mamba": object}, "mamba"),
    ({"full": MambaComponent}, "full"),
    ({0: object}, "full"),
])
def test_anything_else_is_refused_by_name(override, what):
    with pytest.raises(fast.Unsupported, match=f"component_registry_override.*{what}"):
        _mamba_cache(override)


def test_entries_for_absent_components_are_ignored_and_unknown_ones_rejected():
    kv = PagedPool(16, 1, "kv")
    params = dict(disable=False, req_to_token_pool=None,
                  token_to_kv_pool_allocator=PoolAllocator(kv, torch), page_size=1)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        **params, component_registry_override={"swa": object}))
    assert cache.core in ("c", "python")
    with pytest.raises(fast.InvalidInput, match="unknown component"):
        fast.UnifiedRadixCache(fast.CacheInitParams(
            **params, component_registry_override={"ssm": object}))
