"""uniradix's storage backends inside SGLang 0.5.13.post1 (needs sglang importable: the upstream
venv, with this worktree on PYTHONPATH; skipped everywhere else).

SGLang's own backend factory builds ours from `--hicache-storage-backend dynamic` settings, and
they round-trip the pages of SGLang's own host pools (`MHATokenToKVPoolHost`,
`MLATokenToKVPoolHost`) in every layout both sides know, byte for byte as SGLang's
`get_data_page` sees them.  The Mooncake cases also show the two traps on upstream's own
`MooncakeStore`, next to ours."""
from __future__ import annotations

import types

import pytest
import torch

from uniradix.conformance.adapters import upstream as upstream_mod

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with scripts/upstream-venv.sh "
                "and run pytest with its python)", allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from uniradix.fast.storage import MooncakeMaster, StorageInputError, mooncake_available  # noqa: E402

PAGE = 4
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def host_pool(layout: str, kind: str, seed: int = 0):
    if kind == "mha":
        dev = types.SimpleNamespace(store_dtype=torch.bfloat16, size=32, start_layer=0, end_layer=3,
                                    head_num=2, head_dim=8, layer_num=3, device="cpu")
        pool = MHATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")
    else:
        dev = types.SimpleNamespace(store_dtype=torch.bfloat16, size=32, start_layer=0, end_layer=3,
                                    kv_lora_rank=12, qk_rope_head_dim=4, layer_num=3, device="cpu")
        pool = MLATokenToKVPoolHost(dev, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu")
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
    return pool


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1, mla: bool = False):
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="org/model", extra_config=extra)


def dynamic(class_name: str, **settings) -> dict:
    return {"backend_name": "uniradix", "module_path": "uniradix.fast.storage.sglang_backend",
            "class_name": class_name, "interface_v1": 1, **settings}


def slots(pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def round_trip(backend, layout, kind):
    """What SGLang's controller does: register the pool, back pages up, prefetch them back."""
    pool = host_pool(layout, kind)
    backend.register_mem_pool_host(pool)
    want = {p: pool.get_data_page(p * PAGE, flat=True).clone() for p in (1, 4, 7)}
    keys = [f"{layout}-{kind}-{p}" for p in (1, 4, 7)]
    assert backend.batch_set_v1(keys, slots([1, 4, 7])) == [True] * 3
    assert backend.batch_exists(keys + ["absent"]) == 3
    assert backend.batch_get_v1(keys, slots([10, 11, 12])) == [True] * 3
    for src, dst in zip((1, 4, 7), (10, 11, 12), strict=True):
        assert torch.equal(pool.get_data_page(dst * PAGE, flat=True), want[src])
    # SGLang's generic path (no interface_v1): set/get of flat pages through the pool's accessors.
    assert backend.set("generic", pool.get_data_page(2 * PAGE, flat=True))
    page = backend.get("generic", pool.get_dummy_flat_data_page())
    assert page is not None
    pool.set_from_flat_data_page(13 * PAGE, page)
    assert torch.equal(pool.get_data_page(13 * PAGE, flat=True), pool.get_data_page(2 * PAGE, flat=True))
    # SGLang's collector: its own type only
    assert backend.get_stats() is None and backend.stats.pages_set == 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_sglangs_dynamic_factory_loads_our_file_store(tmp_path, layout, kind):
    cfg = storage_config(dynamic("UniradixFileStorage", file_dir=str(tmp_path), capacity_bytes=1 << 24),
                         mla=kind == "mla")
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    assert isinstance(backend, HiCacheStorage)
    round_trip(backend, layout, kind)


def test_tp_ranks_keep_their_own_pages(tmp_path):
    pools = [host_pool("page_first", "mha", seed=r) for r in (0, 1)]
    backends = [StorageBackendFactory.create_backend(
        "dynamic", storage_config(dynamic("UniradixFileStorage", file_dir=str(tmp_path)), r, 2), None)
        for r in (0, 1)]
    for b, p in zip(backends, pools, strict=True):
        b.register_mem_pool_host(p)
        assert b.batch_set_v1(["shared-hash"], slots([0])) == [True]
    for b, p in zip(backends, pools, strict=True):
        assert b.batch_get_v1(["shared-hash"], slots([5])) == [True]
        assert torch.equal(p.get_data_page(5 * PAGE), p.get_data_page(0))


def test_unknown_settings_are_refused_by_name(tmp_path):
    with pytest.raises(StorageInputError, match="file_dirr"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(dynamic("UniradixFileStorage", file_dirr=str(tmp_path))), None)
    with pytest.raises(StorageInputError, match="file_dir"):
        StorageBackendFactory.create_backend("dynamic", storage_config(dynamic("UniradixFileStorage")), None)


needs_mooncake = pytest.mark.skipif(mooncake_available() is not None, reason=f"{mooncake_available()}")


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@needs_mooncake
@pytest.mark.parametrize("layout,kind", [("page_first", "mha"), ("layer_first", "mha"),
                                         ("page_first_direct", "mla")])
def test_sglangs_dynamic_factory_loads_our_mooncake_store(master, layout, kind):
    cfg = storage_config(dynamic("UniradixMooncakeStorage", master_server_address=master.address,
                                 global_segment_size=64 << 20, namespace=f"u-{layout}-{kind}"),
                         mla=kind == "mla")
    backend = StorageBackendFactory.create_backend("dynamic", cfg, None)
    try:
        round_trip(backend, layout, kind)
        backend.clear()
        assert backend.batch_exists([f"{layout}-{kind}-1"]) == 0
    finally:
        backend.close()


@needs_mooncake
def test_upstreams_mooncake_store_falls_into_both_traps(master):
    """Upstream's own backend, on the same master: exists() is False right after a write, and
    clear() right after reads leaves every page in place.  (Ours: the tests above and
    tests/fast/storage/test_mooncake_store.py.)"""
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore as Upstream
    cfg = storage_config({"master_server_address": master.address, "protocol": "tcp",
                          "local_hostname": "127.0.0.1", "global_segment_size": 64 << 20})
    pool = host_pool("page_first", "mha")
    up = Upstream(cfg, pool)
    up.register_mem_pool_host(pool)
    assert up.batch_set_v1(["t1", "t2"], slots([0, 1])) == [True, True]
    assert up.batch_exists(["t1", "t2"]) == 2
    assert not up.exists("t1")                                # trap 2: asks about the bare key
    assert up.batch_get_v1(["t1", "t2"], slots([5, 6])) == [True, True]
    up.clear()                                                # trap 1: reads hold a lease
    assert up.batch_exists(["t1", "t2"]) == 2
    up.store.remove_all(True)
    assert up.batch_exists(["t1", "t2"]) == 0
