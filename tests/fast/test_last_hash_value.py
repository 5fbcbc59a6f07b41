"""`Node.get_last_hash_value()` (fast/node.py), which SGLang's scheduler calls on a request's
last host node before `prefetch_from_storage`: the storage key of the node's last page, from the
storage tier's page keys (fast/tiers/storage.py).

Stories: the root and caches without a storage tier answer None (as upstream's nodes without
hash values); a node answers the last key of its path's chain, before and after a split and
after a reset; with an `extra_key` the namespaced keys differ from 0.5.13.post1's on purpose and
the `compat` keys equal them; and, in the upstream venv, the value equals upstream's own
(`compute_node_hash_values` over its `TreeNode`s, `get_last_hash_value`) for the same tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from uniradix import fast  # noqa: E402
from uniradix.conformance.adapters import upstream as upstream_mod  # noqa: E402
from uniradix.conformance.adapters.base import make_adapter  # noqa: E402
from uniradix.spec import pagekeys  # noqa: E402
from uniradix.spec.config import CacheConfig  # noqa: E402

PS = 4
A = list(range(10, 22))                 # 3 pages
B = A[:8] + list(range(90, 98))          # shares 2 pages with A, then 2 pages of its own


def cache_for(storage: bool = True, key_mode: str = "namespaced"):
    cfg = CacheConfig(kv_slots=64, host_slots=128, page_size=PS, storage=storage,
                      prefetch_threshold=PS, storage_key_mode=key_mode)
    return make_adapter("fast", cfg).cache


def insert(cache, tokens, extra_key=None):
    slots = cache.token_to_kv_pool_allocator.alloc(len(tokens))
    cache.insert(fast.InsertParams(key=fast.RadixKey(tokens, extra_key), value=slots))
    return cache.find_node(fast.RadixKey(tokens, extra_key))


def last_key(tokens, extra_key=None, key_mode="namespaced"):
    prior = pagekeys.namespace_prior(extra_key, key_mode)
    return pagekeys.chain_keys(tokens, PS, prior)[-1]


def test_the_root_and_a_cache_without_storage_have_none():
    cache = cache_for()
    assert cache.root_node.get_last_hash_value() is None
    plain = cache_for(storage=False)
    node = insert(plain, A)
    assert node.get_last_hash_value() is None and plain.root_node.get_last_hash_value() is None


def test_the_last_page_key_of_the_path_before_and_after_a_split_and_a_reset():
    cache = cache_for()
    a = insert(cache, A)
    assert a.get_last_hash_value() == last_key(A)
    b = insert(cache, B)                          # splits A's node after 8 tokens
    upper = b.parent
    assert len(upper.key) == 8 and a.parent is upper
    assert upper.get_last_hash_value() == last_key(A[:8])
    assert a.get_last_hash_value() == last_key(A)
    assert b.get_last_hash_value() == last_key(B)
    assert b.get_last_hash_value() == cache.storage_tier.keys_of(b)[-1]
    cache.reset()
    assert cache.root_node.get_last_hash_value() is None
    again = insert(cache, B)
    assert again.get_last_hash_value() == last_key(B)
    assert a.get_last_hash_value() == last_key(A)    # a node of the old tree keeps its keys


def test_extra_keys_namespaced_differ_on_purpose_compat_match_upstreams_chain():
    ns = insert(cache_for(), A, "tenant")
    compat = insert(cache_for(key_mode="compat"), A, "tenant")
    assert ns.get_last_hash_value() == last_key(A, "tenant")
    assert ns.get_last_hash_value() != last_key(A)
    assert compat.get_last_hash_value() == last_key(A) == last_key(A, "tenant", "compat")


@pytest.mark.upstream
@pytest.mark.skipif(not upstream_mod.upstream_available(),
                    reason="upstream sglang is not importable here (build the venv with "
                           "scripts/upstream-venv.sh and run pytest with its python)")
@pytest.mark.parametrize("key_mode,extra_key,equal", [
    ("namespaced", None, True), ("compat", None, True), ("compat", "tenant", True),
    ("namespaced", "tenant", False),     # namespaced keys absorb the extra key; upstream's do not
])
def test_equal_to_upstreams_for_the_same_tokens(key_mode, extra_key, equal):
    upstream_mod.load_upstream()
    from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
    from sglang.srt.mem_cache.utils import compute_node_hash_values

    def up_node(parent, tokens):
        n = TreeNode()
        n.parent = parent
        n.key = RadixKey(tokens, extra_key)
        n.hash_value = compute_node_hash_values(n, PS)   # what upstream computes at creation
        return n

    up_root = TreeNode()
    up_root.key = RadixKey([], extra_key)
    up_root.hash_value = []                 # as upstream's reset sets it
    up_upper = up_node(up_root, A[:8])
    up_a, up_b = up_node(up_upper, A[8:]), up_node(up_upper, B[8:])

    cache = cache_for(key_mode=key_mode)
    a = insert(cache, A, extra_key)
    b = insert(cache, B, extra_key)
    assert cache.root_node.get_last_hash_value() is None is up_root.get_last_hash_value()
    for ours, theirs in ((b.parent, up_upper), (a, up_a), (b, up_b)):
        assert (ours.get_last_hash_value() == theirs.get_last_hash_value()) is equal


def test_a_cache_given_storage_by_server_args_answers_too(tmp_path):
    """SGLang's path: a cache built first (on the C core), then `init_hicache` with a storage
    backend; the scheduler then asks a host node for its last hash."""
    import json
    import types

    import torch

    from uniradix import kernels
    from uniradix.conformance.env.pools import PoolAllocator
    from uniradix.fast.hicache import HiCacheConfig
    from uniradix.spec.world import PagedPool
    geo = kernels.KVGeometry.mha(1, 1, 4, PS, torch.float32)
    alloc = PoolAllocator(PagedPool(32, PS, "kv"), torch, whole_pages=True)
    params = fast.CacheInitParams(disable=False, req_to_token_pool=None,
                                  token_to_kv_pool_allocator=alloc, page_size=PS)
    cache = fast.UnifiedRadixCache(params)
    params.hicache = HiCacheConfig(
        host_slots=64, device_kv=kernels.DevicePool.allocate(geo, 32 + PS),
        host_kv=kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 64 + PS, pin_memory=False),
        copy_impl="torch")
    args = types.SimpleNamespace(
        hicache_write_policy="write_through", hicache_ratio=2.0, hicache_size=0,
        hicache_storage_backend="file", hicache_storage_prefetch_policy="best_effort",
        hicache_storage_backend_extra_config=json.dumps({"file_path": str(tmp_path)}))
    cache.init_hicache(args, params)
    try:
        node = insert(cache, A)
        assert cache.hicache_storage_pass_prefix_keys is False
        assert node.backuped and node.get_last_hash_value() == last_key(A)
        assert cache.root_node.get_last_hash_value() is None
    finally:
        cache.storage_tier.close()
