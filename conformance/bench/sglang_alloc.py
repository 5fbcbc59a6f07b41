"""``uniradix bench --allocator sglang`` in every configuration: fast and upstream 0.5.13.post1
each over its own instance of sglang's own allocators and pools, built as sglang builds them,
and fast built from sglang's own ``CacheInitParams`` and called with sglang's ``RadixKey`` and
param types (the drop-in boundary), as loop.py's ``_fast_from_sglang_objects`` does for Full.

What each configuration is built from (all on the CPU; one attention layer of one head of
dimension 1 behind each KV pool: the cache moves slots only, no KV data is copied):

* **Full**: loop.py's own bundles (``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``).
* **SWA**: ``SWATokenToKVPoolAllocator`` over an ``SWAKVPool`` (one full and one SWA layer),
  ``need_sort`` off, as sglang's model runner builds them; the SWA pool is half the KV pool
  (conformance/bench/configs.py sizes).  At page 1 the loop allocates with the allocator's
  ``alloc``.  At page > 1 sglang's scheduler allocates with ``alloc_extend``, a Triton kernel
  that needs a GPU; for the bench's page-aligned requests it takes the first free pages of the
  full and of the SWA allocator and maps them, which :class:`PagedSwaAlloc` does with the
  allocator's own parts (each side's page-aligned ``alloc``, then ``set_full_to_swa_mapping``).
* **Mamba**: ``HybridReqToTokenPool`` (as conformance/adapters/upstream_requests.py builds one:
  a tiny Mamba2 state shape, one Mamba layer) with :data:`~configs.MAMBA_SLOTS` states; the
  loop's Mamba step takes and frees states with its ``mamba_allocator``.
* **Host tier**: sglang's host pools: ``MHATokenToKVPoolHost`` over the KV pool (and one over
  the SWA pool with SWA), ``MambaPoolHost`` over the Mamba pool, each twice its device pool
  (sglang adds one page); with an aux component upstream's controller gets them as sglang's
  ``HostPoolGroup`` with the KV host pool as the anchor.  fast gets the same pools in its
  ``HiCacheConfig`` on sglang's ``CacheInitParams`` and attaches the tier with
  ``init_hicache``, as sglang's cache registry does.  The cache controller is not sglang's:
  its ``HiCacheController`` copies on CUDA streams, so upstream runs behind the project's model
  of it (conformance/adapters/upstream_host.py, upstream_host_aux.py), transfers completing on
  submit, as with the bench's own allocators; each comparison says so in its ``notes``
  (:data:`CONTROLLER_NOTE`).

Refused by name (``ImplMissing``, recorded in the comparison's ``missing``, naming the
configuration): upstream with a host tier and SWA and Mamba together (the controller model
takes one aux component; its declared capabilities refuse it first), and every configuration
where sglang does not import.  Nothing falls back to the bench's own free lists.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from uniradix.conformance.adapters import spec_api
from uniradix.conformance.bench import alloc_time
from uniradix.conformance.bench import configs as C
from uniradix.conformance.bench import loop as B

ROWS = 8  # request rows of the Mamba request pool (the bench takes states only, not rows)
MAX_CONTEXT = 64  # its row length
HOST_RATIO = 2.0  # each host pool: twice its device pool (configs.py)
CONTROLLER_NOTE = ("--allocator sglang with a host tier: sglang's host pools, but the "
                   "project's model of sglang's cache controller (its HiCacheController copies "
                   "on CUDA streams), transfers completing on submit")


class PagedSwaAlloc:
    """sglang's ``SWATokenToKVPoolAllocator`` as the loop allocates from it at page > 1 (module
    docstring): ``alloc`` takes ``need`` page-aligned slots from each side and maps them, what
    the allocator's ``alloc_extend`` kernel does for a page-aligned prefix; everything else is
    the allocator's own."""

    def __init__(self, alloc: Any) -> None:
        self.sglang = alloc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sglang, name)

    def alloc(self, need_size: int) -> Any:
        a = self.sglang
        if need_size > a.full_available_size() or need_size > a.swa_available_size():
            return None
        full = a.full_attn_allocator.alloc(need_size)
        a.set_full_to_swa_mapping(full, a.swa_attn_allocator.alloc(need_size))
        return full


@functools.cache
def _sglang() -> Any:
    """sglang's classes this module builds from (:class:`~loop.ImplMissing` where sglang does not
    import)."""
    from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream
    try:
        up = load_upstream()
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool
        from sglang.srt.mem_cache.memory_pool_host import (
            HostPoolGroup,
            MambaPoolHost,
            MHATokenToKVPoolHost,
            PoolEntry,
        )
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    except (UpstreamMissing, Exception) as e:  # absent, or an install that fails at import
        raise B.ImplMissing(f"--allocator sglang: sglang's allocators and pools do not import "
                            f"here ({type(e).__name__}: {e})") from e
    return types.SimpleNamespace(
        up=up, Mamba2CacheParams=Mamba2CacheParams, Mamba2StateShape=Mamba2StateShape,
        SWATokenToKVPoolAllocator=SWATokenToKVPoolAllocator,
        InitLoadBackParams=InitLoadBackParams, PoolName=PoolName,
        HybridReqToTokenPool=HybridReqToTokenPool, MHATokenToKVPool=MHATokenToKVPool,
        HostPoolGroup=HostPoolGroup, MambaPoolHost=MambaPoolHost,
        MHATokenToKVPoolHost=MHATokenToKVPoolHost, PoolEntry=PoolEntry, SWAKVPool=SWAKVPool)


def sglang_parts(config: C.BenchConfig, kv_slots: int, page_size: int) -> types.SimpleNamespace:
    """sglang's objects for ``config``: ``alloc`` (the KV allocator the cache gets), ``loop``
    (what the loop allocates from: ``alloc``, or :class:`PagedSwaAlloc` of it), ``req_pool``
    (the Mamba request pool, None without Mamba), ``host`` (the KV host pool, None without a
    host tier), ``aux_host`` (name -> aux host pool) and ``kv`` (the KV data pool)."""
    s = _sglang()
    ps, dt = page_size, s.up.torch.float16
    req_pool: Any = None
    kv: Any = None
    if "swa" in config.components:
        swa_slots = kv_slots // 2 // ps * ps
        kv = s.SWAKVPool(size=kv_slots, size_swa=swa_slots, page_size=ps, dtype=dt, head_num=1,
                         head_dim=1, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
                         enable_kvcache_transpose=False, device="cpu")
        alloc = s.SWATokenToKVPoolAllocator(kv_slots, swa_slots, page_size=ps, dtype=dt,
                                            device="cpu", kvcache=kv, need_sort=False)
    else:
        alloc = B.sglang_allocator(kv_slots, ps)
        if config.hicache:  # the KV data pool the host pool is sized and laid out after
            kv = s.MHATokenToKVPool(kv_slots, page_size=ps, dtype=dt, head_num=1, head_dim=1,
                                    layer_num=1, device="cpu", enable_memory_saver=False)
    if "mamba" in config.components:
        shape = s.Mamba2StateShape.create(tp_world_size=1, intermediate_size=4, n_groups=1,
                                          num_heads=1, head_dim=2, state_size=2, conv_kernel=2)
        req_pool = s.HybridReqToTokenPool(
            size=ROWS, mamba_size=C.MAMBA_SLOTS, mamba_spec_state_size=C.MAMBA_SLOTS,
            max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False,
            cache_params=s.Mamba2CacheParams(shape=shape, layers=[0]), mamba_layer_ids=[0],
            enable_mamba_extra_buffer=_extra_buffer(config, ps))
    host, aux_host = None, {}
    if config.hicache:
        def host_pool(device_pool: Any) -> Any:
            return s.MHATokenToKVPoolHost(device_pool, HOST_RATIO, 0, ps, "layer_first",
                                          pin_memory=False, device="cpu")
        host = host_pool(kv.full_kv_pool if "swa" in config.components else kv)
        if "swa" in config.components:
            aux_host["swa"] = host_pool(kv.swa_kv_pool)
        if "mamba" in config.components:
            aux_host["mamba"] = s.MambaPoolHost(req_pool.mamba_pool, HOST_RATIO, 0,
                                                pin_memory=False, device="cpu")
    # every free counted (and with --alloc-time timed) before the cache keeps a bound method
    alloc_time.watch_pools(alloc, None if req_pool is None else req_pool.mamba_allocator,
                           [host, *aux_host.values()])
    loop = PagedSwaAlloc(alloc) if "swa" in config.components and ps > 1 else alloc
    return types.SimpleNamespace(alloc=alloc, loop=loop, req_pool=req_pool, host=host,
                                 aux_host=aux_host, kv=kv)


def _extra_buffer(config: C.BenchConfig, page_size: int) -> bool:
    """``enable_mamba_extra_buffer`` of the cache params and of the Mamba request pool alike (as
    sglang builds both from one server argument): on where configs.py's ``upstream_build`` turns
    it on to lift upstream's page-size-1 check for Mamba."""
    return (len(config.components) == 3 or bool(config.hicache)) and page_size > 1


def _init_params(config: C.BenchConfig, parts: Any, page_size: int, upstream: bool) -> Any:
    """sglang's ``CacheInitParams`` for ``config`` over ``parts`` (upstream's with the seed-era
    SWA component, as configs.py's ``upstream_build``)."""
    s = _sglang()
    up, ct = s.up, s.up.ComponentType
    named = {"full": ct.FULL, "swa": ct.SWA, "mamba": ct.MAMBA}
    kw: dict[str, Any] = {}
    if config.aux:
        if "mamba" in config.components:  # sglang's Mamba component reads it from server args
            from uniradix.conformance.adapters.upstream_hybrid import load_hybrid
            load_hybrid().server_args._global_server_args = types.SimpleNamespace(
                mamba_cache_chunk_size=C.MAMBA_CHUNK,
                strip_thinking_cache=False)  # (what sglang's Req reads when it is cached)
        kw.update(
            sliding_window_size=C.SWA_WINDOW if "swa" in config.components else None,
            # lifts upstream's page-size-1 check for Mamba (as configs.py's upstream_build)
            enable_mamba_extra_buffer=_extra_buffer(config, page_size))
        if upstream and "swa" in config.components:
            from uniradix.conformance.adapters.upstream_hybrid import load_hybrid
            kw["component_registry_override"] = {ct.SWA: load_hybrid().SeedEraSWAComponent}
    return up.CacheInitParams(
        disable=False, req_to_token_pool=parts.req_pool, token_to_kv_pool_allocator=parts.alloc,
        page_size=page_size, is_eagle=False,
        tree_components=tuple(named[c] for c in config.components), **kw)


def fast_build(config: C.BenchConfig, kv_slots: int, page_size: int) -> tuple:
    """(cache, loop allocator, request pool) of ``uniradix.fast`` built from sglang's
    ``CacheInitParams`` over :func:`sglang_parts`."""
    import uniradix.fast as fast
    parts = sglang_parts(config, kv_slots, page_size)
    params = _init_params(config, parts, page_size, upstream=False)
    cache = fast.UnifiedRadixCache(params)
    if not config.hicache:
        return cache, parts.loop, parts.req_pool
    from uniradix.fast.hicache import HiCacheConfig
    params.hicache = HiCacheConfig(  # uniradix's option on sglang's params: sglang's host pools
        host_allocator=parts.host, write_policy=config.hicache, write_through_threshold=1,
        load_back_threshold=0, io="sync", host_swa_allocator=parts.aux_host.get("swa"),
        host_mamba_allocator=parts.aux_host.get("mamba"))
    cache.init_hicache(types.SimpleNamespace(  # as sglang's cache registry attaches the tier
        hicache_write_policy=config.hicache, hicache_ratio=HOST_RATIO, hicache_size=0,
        hicache_storage_backend=None), params)
    return cache, parts.loop, parts.req_pool


def upstream_build(config: C.BenchConfig, kv_slots: int, page_size: int) -> tuple:
    """(cache, loop allocator, request pool) of sglang's ``UnifiedRadixCache`` over
    :func:`sglang_parts`, its host tier (if any) behind the project's controller model."""
    s = _sglang()
    up = s.up
    parts = sglang_parts(config, kv_slots, page_size)
    cache = up.UnifiedRadixCache(_init_params(config, parts, page_size, upstream=True))
    if config.hicache:
        _wire_host(cache, config, parts)
    return cache, parts.loop, parts.req_pool


def _wire_host(cache: Any, config: C.BenchConfig, parts: Any) -> None:
    """Upstream's host tier over sglang's host pools (the model controllers, as
    conformance/bench/host.py's ``wire_upstream_host`` over the bench's free lists)."""
    from uniradix.conformance.adapters.upstream_host import ModelController
    s = _sglang()
    up, ct, alloc = s.up, s.up.ComponentType, parts.alloc
    policy = str(config.hicache)
    if not config.aux:
        ctrl: Any = ModelController(policy, parts.host, alloc, done_on_submit=True)
        host: Any = parts.host
    else:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )

        from uniradix.conformance.adapters.upstream_host_aux import AuxModelController
        (name,) = config.aux
        aux_host = parts.aux_host[name]
        if name == "swa":
            entry = s.PoolEntry(
                name=s.PoolName.SWA, host_pool=aux_host, device_pool=None,
                layer_mapper=lambda i: i, is_primary_index_anchor=False,
                host_evict_fn=lambda n: cache.evict_host(n, ct.SWA),
                device_evict_fn=lambda n: cache.evict(EvictParams(swa_num_tokens=n)),
                device_alloc_fn=alloc.swa_attn_allocator.alloc,
                device_free_fn=alloc.swa_attn_allocator.free)
            cache.components[ct.SWA]._swa_kv_pool_host = aux_host
            cache.swa_kv_pool_host = aux_host
            full_alloc = alloc.full_attn_allocator.alloc  # the SWA side is paired separately
        else:
            states = parts.req_pool.mamba_allocator
            entry = s.PoolEntry(
                name=s.PoolName.MAMBA, host_pool=aux_host, device_pool=None,
                layer_mapper=lambda i: i, is_primary_index_anchor=False,
                host_evict_fn=lambda n: cache.evict_host(n, ct.MAMBA),
                device_evict_fn=lambda n: cache.evict(EvictParams(mamba_num=n)),
                device_alloc_fn=states.alloc, device_free_fn=states.free)
            cache.components[ct.MAMBA]._mamba_pool_host = aux_host
            cache.mamba_pool_host = aux_host
            full_alloc = parts.loop.alloc
        host = s.HostPoolGroup([
            s.PoolEntry(name=s.PoolName.KV, host_pool=parts.host, device_pool=None,
                        layer_mapper=lambda i: i, is_primary_index_anchor=True),
            entry])
        ctrl = AuxModelController(policy, host, full_alloc, alloc.free,
                                  HybridCacheController._resolve_pool_transfers_allocation,
                                  up.torch)
        ctrl.done_on_submit = True
        cache.full_kv_pool_host = host
    cache.cache_controller = ctrl
    cache.write_through_threshold = 1
    cache.load_back_threshold = 0
    cache.components[ct.FULL]._full_kv_pool_host = host


BUILDS = {"fast": fast_build, "upstream": upstream_build}


def config_bundle(impl: str, config: C.BenchConfig) -> B.ApiBundle:
    """``impl`` (fast or upstream) for ``config`` over sglang's allocators and pools, called with
    sglang's key and param types; :class:`~loop.ImplMissing` names what is refused and why."""
    if impl not in BUILDS:
        raise B.ImplMissing(f"{impl}: --allocator sglang builds fast and upstream only "
                            f"in the {config.name} configuration")
    if impl == "upstream" and config.hicache and len(config.aux) > 1:
        raise B.ImplMissing(f"upstream: --allocator sglang, {config.name}: refused: a host "
                            f"tier with SWA and Mamba together (the controller model of "
                            f"conformance/adapters/upstream_host_aux.py takes one aux "
                            f"component)")
    try:
        s = _sglang()
    except B.ImplMissing as e:
        raise B.ImplMissing(f"{impl}: --allocator sglang, {config.name}: not measured: {e}") \
            from e
    up = s.up
    if impl == "fast":
        try:
            import uniradix.fast as fast
        except ImportError as e:
            raise B.ImplMissing(f"fast: uniradix.fast does not import ({e})") from e
        version = getattr(fast, "__version__", "dev")
    else:
        version = f"sglang {up.version}"
    build = functools.partial(BUILDS[impl], config)
    return B.ApiBundle(impl, version, up.RadixKey, up.MatchPrefixParams, up.InsertParams,
                       up.EvictParams, spec_api.TorchValues(up.torch),
                       lambda pool: build(pool.num_pages * pool.page_size, pool.page_size),
                       C._steps(config, s.InitLoadBackParams), config.name)
