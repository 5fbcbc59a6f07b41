"""``uniradix bench-storage --cache``: the cache's operations with the storage tier on, fast beside
upstream 0.5.13.post1's own cache, host tier and ``HybridCacheController`` with its storage
threads (docs/CLI.md, docs/PERFORMANCE.md).

**The loop** (one scheduler step per request, the same calls on both caches, each under a fresh
rid): ``match_prefix``; ``prefetch_from_storage`` of what follows the match (anchored at its
``last_host_node``), then ``check_hicache_events`` and ``check_prefetch_progress`` until it says
done (stop policy ``wait_complete``; a hit below the threshold is revoked through the events)
and ``pop_prefetch_loaded_tokens``; a second match, and when it has a host part
``init_load_back`` plus ``ready_to_load_host_cache``; ``inc_lock_ref``; room for the rest of the
prompt and the output (``evict`` when the device pool is short; a request that still does not fit
is aborted); its KV written into the new device slots (untimed); ``insert`` of prompt and output;
``dec_lock_ref``; ``check_hicache_events`` until no backup to storage is in flight (so every step
starts from the same store on both sides and outcomes do not depend on thread timing).
Write-through (threshold 1), ``load_back_threshold`` 10, a host pool twice the device pool, a
prefetch threshold of one page.  Timed per request: ``match`` (both matches), ``prefetch``
(the call, the wait, the pop: the storage reads are in it), ``load_back``, ``insert`` (lock, evict,
alloc, insert, unlock), ``events`` (the acks and the backups' wait: the storage writes are in it).

**Outcomes** must be identical: per request the device hit, the tokens prefetched from storage,
the host hit loaded back, the prefix on the device after it (the hit rate counts these) and
whether it was aborted, folded into a digest; and the KV a request
finds on the device after its load back is checked against what was written for those tokens
(every token's K and V hold a value of its token and position, so a page that came back from
storage into the wrong slots, or not at all, fails the bench).

**Backends**: ``file`` (uniradix's ``FileStore`` under fast, upstream's ``HiCacheFile`` under
upstream, each in its own folder) and ``mooncake`` (uniradix's ``MooncakeStore``, upstream's
``MooncakeStore``, both on one ``mooncake_master`` started on loopback).

**Upstream on CPU** needs three things from this harness, and only them:

* a one-rank ``torch.distributed`` world over gloo with SGLang's model-parallel groups (its
  controller asks for the tensor-parallel rank when it attaches storage);
* host pool buffers allocated unpinned (SGLang pins them with ``cudaHostRegister``, which needs
  CUDA): ``ALLOC_MEMORY_FUNCS["cpu"]`` of ``sglang.srt.mem_cache.memory_pool_host``, and the
  host pool's ``pin_memory`` flag off once built (the scratch pages of its generic storage reads
  are allocated with ``pin_memory=True`` otherwise, which CPU torch refuses);
* the device<->host copy functions of its ``direct`` I/O backend, which that module imports from
  ``sgl_kernel`` only when CUDA is there (``NameError: transfer_kv_direct`` otherwise): this module
  puts plain-torch functions of the same semantics (every page of the given indices copied,
  per layer and K/V plane) into that module's namespace, ``transfer_kv_direct`` for
  ``layer_first`` (the file backend) and ``transfer_kv_all_layer_direct_lf_pf`` /
  ``transfer_kv_per_layer_direct_pf_lf`` for ``page_first_direct`` (Mooncake: upstream's
  Mooncake store takes MHA pages only in a page-first layout).  A GPU kernel is replaced by a CPU
  copy; fast's host tier copies with torch on CPU too (``copy_impl="torch"``), so both sides
  pay a comparable copy.  Nothing is installed when sglang already has the names (a CUDA build).

Rounds alternate the implementations (the order rotates each round), torch runs on one thread,
and the result is a ``uniradix bench`` comparison (``{"comparisons": [...], "machine"}``), which
``uniradix dashboard --add`` files as a ``figures.throughput`` figure with the configuration
``write_through+storage-<backend>`` (docs/BENCH_JSON.md).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

from uniradix.conformance.bench.results import machine_info

BACKENDS = ("file", "mooncake")
IMPLS = ("fast", "upstream")
OPS = ("match", "prefetch", "load_back", "insert", "events")
LAYOUT = {"file": "layer_first", "mooncake": "page_first_direct"}
POLL_S = 0.0002  # between two polls of a wait (lets the storage threads run)
WAIT_S = 60.0  # the longest one prefetch or one step's backups may take before the bench fails


class BenchFailure(RuntimeError):
    """The implementations disagreed, or one loaded wrong KV, or I/O did not finish."""


# ----------------------------------------------------------------------------------------------
# Upstream on CPU (see the module docstring: exactly what is substituted)
# ----------------------------------------------------------------------------------------------


def _direct_copy(src_layers: list, dst_layers: list, src_indices: Any, dst_indices: Any,
                 page_size: int) -> None:
    """``transfer_kv_direct`` on CPU: for each (source, destination) layer buffer pair, the
    tokens at ``src_indices`` copied to ``dst_indices`` (whole pages; the page size is implied)."""
    for s, d in zip(src_layers, dst_layers, strict=True):
        d[dst_indices] = s[src_indices]


def _all_layer_lf_to_pfd(src_ptrs: list, dst_ptrs: list, src_indices: Any, dst_indices: Any,
                         page_size: int) -> None:
    """``transfer_kv_all_layer_direct_lf_pf`` on CPU: device layer buffers (K layers then V
    layers, ``[slots, heads, dim]`` each) into the host's ``page_first_direct`` K and V buffers
    (``[pages, layers, page_size, heads, dim]``)."""
    layers = len(src_ptrs) // 2
    pages = dst_indices.reshape(-1, page_size)[:, 0] // page_size
    for plane in range(2):
        dst = dst_ptrs[plane]
        for layer in range(layers):
            rows = src_ptrs[plane * layers + layer][src_indices]
            dst[pages, layer] = rows.reshape(len(pages), page_size, *rows.shape[1:])


def _per_layer_pfd_to_lf(src_ptrs: list, dst_ptrs: list, src_indices: Any, dst_indices: Any,
                         layer_id: int, page_size: int) -> None:
    """``transfer_kv_per_layer_direct_pf_lf`` on CPU: one layer of the host's
    ``page_first_direct`` K and V buffers into the device's layer buffers."""
    pages = src_indices.reshape(-1, page_size)[:, 0] // page_size
    for plane in range(2):
        rows = src_ptrs[plane][pages, layer_id]
        dst_ptrs[plane][dst_indices] = rows.reshape(-1, *rows.shape[2:])


def _unpinned(dims: Any, dtype: Any, device: str, pin_memory: bool, allocator: Any) -> Any:
    """A host pool buffer without ``cudaHostRegister`` (there is no GPU to pin it for)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def upstream_on_cpu() -> list[str]:
    """Install what upstream's host tier needs on CPU (module docstring); returns what was
    installed, by name (nothing on a CUDA build)."""
    import sglang.srt.mem_cache.memory_pool_host as mph
    done = []
    for name, fn in (("transfer_kv_direct", _direct_copy),
                     ("transfer_kv_all_layer_direct_lf_pf", _all_layer_lf_to_pfd),
                     ("transfer_kv_per_layer_direct_pf_lf", _per_layer_pfd_to_lf)):
        if not hasattr(mph, name):
            setattr(mph, name, fn)
            done.append(name)
    if done and mph.ALLOC_MEMORY_FUNCS.get("cpu") is not _unpinned:
        mph.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned
        done.append("ALLOC_MEMORY_FUNCS['cpu'] (unpinned)")
    return done


def one_rank_world() -> None:
    """A one-rank gloo world with SGLang's model-parallel groups, once per process."""
    import torch.distributed as dist
    from sglang.srt.distributed import parallel_state as ps
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(1, backend="gloo")


# ----------------------------------------------------------------------------------------------
# The two caches
# ----------------------------------------------------------------------------------------------


class Shape:
    """The model and pools: ``layers`` x ``heads`` x ``head_dim`` bf16, ``page_size`` tokens per
    page, ``kv_slots`` device slots (the host pool about twice that)."""

    def __init__(self, page_size: int, kv_slots: int, layers: int, heads: int,
                 head_dim: int) -> None:
        self.page_size, self.kv_slots = page_size, kv_slots
        self.layers, self.heads, self.head_dim = layers, heads, head_dim
        # upstream's host pool for a ratio of 2: twice the device pool, rounded down to whole
        # pages, plus one page (MHATokenToKVPoolHost); fast's gets as many slots
        self.host_slots = (2 * kv_slots // page_size + 1) * page_size


class Side:
    """One implementation's cache with what the loop needs around it."""

    def __init__(self, name: str, version: str, cache: Any, alloc: Any, api: Any,
                 write_kv: Callable[[Any, Any], None], read_kv: Callable[[Any], Any],
                 backups_in_flight: Callable[[], int], close: Callable[[], None],
                 prefetch_slots: Callable[[str], Any],
                 slots_back: Callable[[Any], bool]) -> None:
        self.name, self.version, self.cache, self.alloc, self.api = name, version, cache, alloc, api
        self.write_kv, self.read_kv = write_kv, read_kv
        self.backups_in_flight, self.close = backups_in_flight, close
        # the host slots a prefetch of ``rid`` took (None: none started), and whether every
        # one of them is back: in the tree or free in the host pool (see run_side)
        self.prefetch_slots, self.slots_back = prefetch_slots, slots_back


def _kv_values(tokens: Any, start: int, torch: Any) -> Any:
    """The value every K and V element of token ``tokens[i]`` at position ``start + i`` holds:
    a small integer (exact in bf16) of the token and its position."""
    t = torch.as_tensor(tokens, dtype=torch.int64)
    pos = torch.arange(start, start + len(t), dtype=torch.int64)
    return ((t * 7 + pos * 13) % 97 + 1).to(torch.bfloat16)


def build_fast(shape: Shape, backend: str, directory: str, address: str | None) -> Side:
    import torch

    from uniradix import fast, kernels
    from uniradix.conformance.env.pools import PoolAllocator
    from uniradix.fast.hicache import HiCacheConfig
    from uniradix.fast.tiers.storage import StorageConfig
    from uniradix.spec.world import PagedPool
    ps = shape.page_size
    geo = kernels.KVGeometry.mha(shape.layers, shape.heads, shape.head_dim, ps, torch.bfloat16)
    dev = kernels.DevicePool.allocate(geo, shape.kv_slots + ps)
    host_slots = shape.host_slots
    host = kernels.HostPool.allocate(geo, kernels.Layout(LAYOUT[backend]), host_slots + ps,
                                     pin_memory=False)
    alloc = PoolAllocator(PagedPool(shape.kv_slots, ps, "kv"), torch, whole_pages=True)
    store: Any
    if backend == "file":
        from uniradix.fast.storage import FileStore
        store = FileStore(directory)
    else:
        from uniradix.fast.storage import MooncakeStore
        assert address is not None
        store = MooncakeStore(address, global_segment_size=_segment(shape), namespace="bench-fast")
    store.register_mem_pool_host(host)
    storage = StorageConfig(backend=store, io="threads", prefetch_threshold=ps,
                            prefetch_stop_policy="wait_complete")
    cfg = HiCacheConfig(host_slots=host_slots, io="sync", device_kv=dev, host_kv=host,
                        copy_impl="torch", load_back_threshold=10, storage=storage)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=ps,
        hicache=cfg))
    tier: Any = getattr(cache, "storage_tier")  # noqa: B009 (a HiCacheRadixCache attribute)

    def write_kv(slots: Any, values: Any) -> None:
        dev.buffer[:, :, slots] = values[None, None, :, None, None]

    def read_kv(slots: Any) -> Any:
        return dev.buffer[:, :, slots]

    def close() -> None:
        tier.close()
        store.clear()
        close_store = getattr(store, "close", None)
        if close_store is not None:
            close_store()

    api = types.SimpleNamespace(
        RadixKey=fast.RadixKey, MatchPrefixParams=fast.MatchPrefixParams,
        InsertParams=fast.InsertParams, EvictParams=fast.EvictParams,
        InitLoadBackParams=fast.hicache.InitLoadBackParams)
    def in_flight() -> int:  # backups not acked, or storage jobs still queued
        return len(tier.ongoing_backup) + (0 if tier.wait_idle(0) else 1)

    def prefetch_slots(rid: str) -> Any:
        op = tier.ongoing.get(rid)
        return None if op is None else op.slots

    def slots_back(slots: Any) -> bool:  # the tier holds no host slot outside the tree
        return not tier.held_host_slots()
    return Side("fast", "uniradix", cache, alloc, api, write_kv, read_kv, in_flight, close,
                prefetch_slots, slots_back)


def _segment(shape: Shape) -> int:
    page = 2 * shape.layers * shape.heads * shape.head_dim * 2 * shape.page_size
    return max(64 << 20, 8 * shape.kv_slots // shape.page_size * page)


def build_upstream(shape: Shape, backend: str, directory: str, address: str | None) -> Side:
    import json

    import torch

    from uniradix.conformance.adapters.upstream import load_upstream
    up = load_upstream()
    upstream_on_cpu()
    one_rank_world()
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    ps = shape.page_size
    kv = MHATokenToKVPool(shape.kv_slots, ps, torch.bfloat16, shape.heads, shape.head_dim,
                          shape.layers, "cpu", False)
    alloc = PagedTokenToKVPoolAllocator(shape.kv_slots, ps, torch.bfloat16, "cpu", kv, False)
    params = up.CacheInitParams(disable=False, req_to_token_pool=None,
                                token_to_kv_pool_allocator=alloc, page_size=ps,
                                tree_components=(up.ComponentType.FULL,))
    cache = up.UnifiedRadixCache(params)
    extra: dict = {"prefetch_threshold": ps}
    env = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"  # where HiCacheFile writes (read at attach)
    before = os.environ.get(env)
    if backend == "file":
        os.environ[env] = directory
    else:
        extra.update(master_server_address=address, protocol="tcp", local_hostname="127.0.0.1",
                     global_segment_size=_segment(shape))
    server_args = types.SimpleNamespace(
        hicache_io_backend="direct", hicache_mem_layout=LAYOUT[backend], hicache_ratio=2.0,
        hicache_size=0, hicache_write_policy="write_through", hicache_storage_backend=backend,
        hicache_storage_backend_extra_config=json.dumps(extra),
        hicache_storage_prefetch_policy="wait_complete", extra_metric_labels=None,
        served_model_name="bench")
    try:
        cache.init_hicache(server_args, params)
    finally:
        if before is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = before
    ctl = cache.cache_controller
    for entry in ctl.mem_pool_host.entries:  # its buffers are unpinned (upstream_on_cpu): so
        entry.host_pool.pin_memory = False     # are the scratch pages its generic reads allocate
    if not ctl.enable_storage:
        raise BenchFailure("upstream: the storage backend did not attach")
    if ctl.mem_pool_host.size != shape.host_slots:
        raise BenchFailure(f"upstream's host pool has {ctl.mem_pool_host.size} slots, fast's "
                           f"{shape.host_slots}")

    def write_kv(slots: Any, values: Any) -> None:
        v = values[:, None, None]
        for layer in range(shape.layers):
            kv.k_buffer[layer][slots] = v
            kv.v_buffer[layer][slots] = v

    def read_kv(slots: Any) -> Any:
        return torch.stack([torch.stack([b[slots] for b in bufs])
                            for bufs in (kv.k_buffer, kv.v_buffer)])

    def close() -> None:
        ctl.storage_stop_event.set()
        for t in (getattr(ctl, "prefetch_thread", None), getattr(ctl, "backup_thread", None)):
            if t is not None:
                t.join(timeout=5)
        store = ctl.storage_backend
        if backend == "mooncake":
            store.store.remove_all(True)  # forced: its clear() leaves leased objects
            store.close()
        else:
            store.clear()

    api = types.SimpleNamespace(
        RadixKey=up.RadixKey, MatchPrefixParams=up.MatchPrefixParams,
        InsertParams=up.InsertParams, EvictParams=up.EvictParams,
        InitLoadBackParams=InitLoadBackParams)
    def in_flight() -> int:  # host writes not acked (their backups not yet issued), backups
        return len(ctl.ack_write_queue) + len(cache.ongoing_backup)  # not acked

    def prefetch_slots(rid: str) -> Any:
        entry = cache.ongoing_prefetch.get(rid)
        return None if entry is None else entry[2]

    def slots_back(slots: Any) -> bool:  # each slot free in the host pool or held by a node
        from sglang.srt.mem_cache.unified_radix_cache import BASE_COMPONENT_TYPE
        held = [cd.host_value for n in cache._collect_all_nodes()
                if (cd := n.component_data[BASE_COMPONENT_TYPE]).host_value is not None]
        back = torch.cat([_free_slots(ctl.mem_pool_host), *held])
        return bool(torch.isin(slots, back).all())
    return Side("upstream", up.version, cache, alloc, api, write_kv, read_kv, in_flight, close,
                prefetch_slots, slots_back)


def _free_slots(pool: Any) -> Any:
    """The free slots of upstream's host KV pool (a pool group keeps them in its KV entry)."""
    free = getattr(pool, "free_slots", None)
    if free is not None:
        return free
    return pool.entries[0].host_pool.free_slots


# ----------------------------------------------------------------------------------------------
# The workload and the loop
# ----------------------------------------------------------------------------------------------


def workload(requests: int, groups: int, prefix_pages: int, suffix_pages: int,
             output_pages: int, page_size: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """``(prompt, output)`` per request: a shared prefix of one of ``groups`` (drawn at random,
    so reuse distances vary), then a suffix and an output of its own; whole pages."""
    rng = random.Random(seed)
    out = []
    for r in range(requests):
        g = rng.randrange(groups)
        prefix = [1_000_000 + g * 10_000 + i for i in range(prefix_pages * page_size)]
        suffix = [5_000_000 + r * 10_000 + i for i in range(suffix_pages * page_size)]
        output = [9_000_000 + r * 10_000 + i for i in range(output_pages * page_size)]
        out.append((prefix + suffix, output))
    return out


class _Req:
    def __init__(self, last_node: Any) -> None:
        self.last_node = last_node


def _wait(cond: Callable[[], bool], what: str, side: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        if time.monotonic() > deadline:
            raise BenchFailure(f"{side}: {what} did not finish within {WAIT_S:.0f} s")
        time.sleep(POLL_S)


def run_side(side: Side, reqs: list[tuple[list[int], list[int]]], tag: str) -> dict:
    """One pass of the workload on ``side``; returns the summed time per op, the outcomes and
    their digest.  Raises :class:`BenchFailure` on wrong KV or I/O that does not finish."""
    import torch
    api, cache, alloc = side.api, side.cache, side.alloc
    times = dict.fromkeys(OPS, 0.0)
    digest = hashlib.sha256()
    outcome = {"device_hit": 0, "storage_loaded": 0, "host_loaded": 0, "reused": 0,
               "aborted": 0, "prompt_tokens": 0}
    per_request: list[list[int]] = []
    release_waits = 0
    clock = time.perf_counter
    for r, (prompt, output) in enumerate(reqs):
        rid = f"{tag}-{r}"
        key = api.RadixKey(prompt)
        t0 = clock()
        m = cache.match_prefix(api.MatchPrefixParams(key=key))
        t1 = clock()
        device_hit = len(m.device_indices)
        have = device_hit + m.host_hit_length
        cache.prefetch_from_storage(rid, m.last_host_node, prompt[have:])
        taken = side.prefetch_slots(rid)

        def prefetched(rid: str = rid) -> bool:  # a scheduler step: queues, then the request
            cache.check_hicache_events()
            return bool(cache.check_prefetch_progress(rid))
        _wait(prefetched, "a prefetch", side.name)
        loaded = int(cache.pop_prefetch_loaded_tokens(rid))
        t2 = clock()
        # (untimed) the prefetch's host slots are all back before anything else allocates
        # host slots: upstream's prefetch thread queues a revoke before the release of the
        # revoked slots, so a drain can end the prefetch with its slots still on the way, and
        # this step's write-through would evict host nodes for them (docs/STORAGE.md
        # "Upstream's outcomes with Mooncake"); counted, never hidden
        if taken is not None and not side.slots_back(taken):
            release_waits += 1

            def back(taken: Any = taken) -> bool:
                cache.check_hicache_events()
                return side.slots_back(taken)
            _wait(back, "the release of a prefetch's host slots", side.name)
        t2m = clock()
        m = cache.match_prefix(api.MatchPrefixParams(key=key))
        t3 = clock()
        host_hit = m.host_hit_length
        if host_hit > 0:
            cache.init_load_back(api.InitLoadBackParams(m.best_match_node, host_hit, None,
                                                        _Req(m.last_device_node)))
            cache.ready_to_load_host_cache()
            m = cache.match_prefix(api.MatchPrefixParams(key=key))
        t4 = clock()
        prefix = m.device_indices
        n = len(prefix)
        # the KV found on the device is the KV written for those tokens (untimed)
        if n and not bool((side.read_kv(prefix) == _kv_values(prompt[:n], 0, torch)[
                None, None, :, None, None]).all()):
            raise BenchFailure(f"{side.name}: request {r}: wrong KV on the device for its "
                               f"{n} matched tokens")
        full = prompt + output
        need = len(full) - n
        t5 = clock()
        node = m.last_device_node
        cache.inc_lock_ref(node)
        if alloc.available_size() < need:
            cache.evict(api.EvictParams(num_tokens=need - alloc.available_size()))
        slots = alloc.alloc(need) if alloc.available_size() >= need else None
        t6 = clock()
        aborted = slots is None
        if slots is not None:
            side.write_kv(slots, _kv_values(full[n:], n, torch))
        t7 = clock()
        if slots is not None:
            value = torch.cat([prefix.to(torch.int64), slots.to(torch.int64)])
            res = cache.insert(api.InsertParams(key=api.RadixKey(full), value=value,
                                                prev_prefix_len=n))
            kept = getattr(res, "prefix_len", res)
            if kept > n:  # pages the tree already had: their new slots go back
                alloc.free(value[n:kept])
        cache.dec_lock_ref(node)
        t8 = clock()
        cache.check_hicache_events()

        def settled() -> bool:
            cache.check_hicache_events()
            return side.backups_in_flight() == 0
        _wait(settled, "the step's backups", side.name)
        t9 = clock()
        times["match"] += (t1 - t0) + (t3 - t2m)
        times["prefetch"] += t2 - t1
        times["load_back"] += t4 - t3
        times["insert"] += (t6 - t5) + (t8 - t7)
        times["events"] += t9 - t8
        outcome["device_hit"] += device_hit
        outcome["storage_loaded"] += loaded
        outcome["host_loaded"] += host_hit
        outcome["reused"] += n  # on the device after the load back: the request's hit
        outcome["aborted"] += int(aborted)
        outcome["prompt_tokens"] += len(prompt)
        digest.update(f"{r}:{device_hit}:{loaded}:{host_hit}:{n}:{int(aborted)};".encode())
        per_request.append([device_hit, loaded, host_hit, n, int(aborted)])
    return {"times": times, "outcome": outcome, "digest": digest.hexdigest()[:16],
            "per_request": per_request, "release_waits": release_waits}


def run_cache_bench(backend: str, *, requests: int = 60, page_size: int = 16, kv_slots: int = 1024,
                    groups: int = 12, prefix_pages: int = 16, suffix_pages: int = 2,
                    output_pages: int = 2, layers: int = 4, heads: int = 8, head_dim: int = 128,
                    rounds: int = 3, warmup: int = 1, threads: int = 1,
                    impls: tuple[str, ...] = IMPLS) -> dict:
    """Run the loop on each implementation in ``impls``, ``warmup`` + ``rounds`` alternating
    rounds, each on a fresh cache and store; returns ``{"comparisons": [...], "machine"}``.
    Raises :class:`BenchFailure` when outcomes differ or KV is wrong, ``ValueError`` on bad
    settings."""
    import torch

    from uniradix.conformance.bench.results import stat
    if backend not in BACKENDS:
        raise ValueError(f"unknown storage backend {backend!r} (known: {', '.join(BACKENDS)})")
    for what, v in (("requests", requests), ("page_size", page_size), ("kv_slots", kv_slots),
                    ("groups", groups), ("prefix_pages", prefix_pages),
                    ("suffix_pages", suffix_pages), ("output_pages", output_pages),
                    ("layers", layers), ("heads", heads), ("head_dim", head_dim),
                    ("rounds", rounds), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be an int >= 1, got {v!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if kv_slots % page_size:
        raise ValueError(f"kv_slots must be whole pages of {page_size}, got {kv_slots}")
    for impl in impls:
        if impl not in IMPLS:
            raise ValueError(f"unknown implementation {impl!r} (known: {', '.join(IMPLS)})")
    torch.set_num_threads(threads)
    shape = Shape(page_size, kv_slots, layers, heads, head_dim)
    reqs = workload(requests, groups, prefix_pages, suffix_pages, output_pages, page_size)
    builders = {"fast": build_fast, "upstream": build_upstream}
    missing: dict[str, str] = {}
    if "upstream" in impls:
        from uniradix.conformance.adapters.upstream import UpstreamMissing, load_upstream
        try:
            load_upstream()
        except UpstreamMissing as e:
            missing["upstream"] = f"sglang is not importable ({e})"
    if backend == "mooncake":
        from uniradix.fast.storage import mooncake_available
        why = mooncake_available()
        if why is not None:
            missing.update({i: f"Mooncake is not usable here ({why})" for i in impls})
    run_impls = [i for i in impls if i not in missing]
    master = None
    root = tempfile.mkdtemp(prefix="uniradix-bench-storage-cache-")
    results: dict[str, list[dict]] = {i: [] for i in run_impls}
    substituted: list[str] = []
    try:
        if backend == "mooncake" and run_impls:
            from uniradix.fast.storage import MooncakeMaster
            master = MooncakeMaster().start()
        for rnd in range(-warmup, rounds):
            first = rnd % len(run_impls) if run_impls else 0
            for impl in run_impls[first:] + run_impls[:first]:
                d = os.path.join(root, f"{impl}-{rnd + warmup}")
                os.makedirs(d)
                side = builders[impl](shape, backend, d, master.address if master else None)
                try:
                    res = run_side(side, reqs, f"{impl}{rnd}")
                finally:
                    side.close()
                res["version"] = side.version
                if rnd >= 0:
                    results[impl].append(res)
        if "upstream" in run_impls:
            substituted = upstream_on_cpu() or _installed_names()
    finally:
        if master is not None:
            master.stop()
        shutil.rmtree(root, ignore_errors=True)

    mismatches = []
    ref = None
    for impl in run_impls:
        for i, res in enumerate(results[impl]):
            key = (res["digest"], res["outcome"])
            if ref is None:
                ref = (f"{impl} round {i}", key, res["per_request"])
            elif key != ref[1]:
                first = next(r for r, (a, b) in enumerate(zip(res["per_request"], ref[2],
                                                              strict=True)) if a != b)
                mismatches.append(f"{impl} round {i}: outcome {res['outcome']} (digest "
                                  f"{res['digest']}) differs from {ref[0]}'s {ref[1][1]} "
                                  f"(digest {ref[1][0]}); first at request {first}: "
                                  f"{_outcome_of(res['per_request'][first])} against "
                                  f"{_outcome_of(ref[2][first])}")
    comparison_impls: dict[str, dict] = {}
    for impl in run_impls:
        runs = []
        for res in results[impl]:
            total = sum(res["times"].values())
            runs.append({"requests_per_s": round(requests / total, 1),
                         "op_median_us": {op: round(res["times"][op] / requests * 1e6, 2)
                                          for op in OPS},
                         "digest": res["digest"], "outcome": res["outcome"],
                         "release_waits": res["release_waits"]})
        o = results[impl][0]["outcome"] if results[impl] else {}
        rps = [r["requests_per_s"] for r in runs]
        s = stat(rps, 1)
        comparison_impls[impl] = {
            "version": results[impl][0]["version"] if results[impl] else None,
            "runs": runs, "requests_per_s_runs": rps,
            "requests_per_s_median": s["median"] if s else None,
            "hit_rate": round(o["reused"] / max(1, o["prompt_tokens"]), 4) if o else None,
            "storage_loaded_tokens": o.get("storage_loaded"),
            "host_loaded_tokens": o.get("host_loaded"),
            "evicted_tokens": None, "aborted": o.get("aborted"),
            "digest": results[impl][0]["digest"] if results[impl] else None}
    ratios: dict[str, Any] = {}
    if "fast" in comparison_impls and "upstream" in comparison_impls and not mismatches:
        from uniradix.conformance.bench.results import ratio_stat
        ratios["fast/upstream"] = ratio_stat(
            stat(comparison_impls["fast"]["requests_per_s_runs"], 1),
            stat(comparison_impls["upstream"]["requests_per_s_runs"], 1))
    comparison = {
        "workload": f"storage-prefix+write_through+storage-{backend}", "page_size": page_size,
        "requests": requests, "kv_slots": kv_slots, "repeats": rounds, "warmup": warmup,
        "torch_threads": threads, "layout": LAYOUT[backend],
        "geometry": {"kind": "mha", "layers": layers, "heads": heads, "head_dim": head_dim,
                     "dtype": "bfloat16"},
        "shape": {"groups": groups, "prefix_pages": prefix_pages, "suffix_pages": suffix_pages,
                  "output_pages": output_pages, "host_slots": shape.host_slots},
        "identical_outcomes": (not mismatches) if len(run_impls) > 1 else None,
        "mismatches": mismatches, "missing": missing, "impls": comparison_impls,
        "ratios": ratios, "ops": list(OPS),
        "upstream_cpu_substitutes": substituted,
        "notes": ["upstream's direct I/O copy functions (sgl_kernel, CUDA only) replaced by "
                  "plain-torch copies of the same semantics, its host pool unpinned, a one-rank "
                  "gloo world (conformance/bench/storage_cache.py)"]}
    return {"comparisons": [comparison], "machine": machine_info()}


def _outcome_of(row: list[int]) -> str:
    device_hit, loaded, host_hit, n, aborted = row
    return (f"device hit {device_hit}, prefetched {loaded}, host hit {host_hit}, "
            f"on device {n}{', aborted' if aborted else ''}")


def _installed_names() -> list[str]:
    """What :func:`upstream_on_cpu` put into upstream's module (after a first call)."""
    import sglang.srt.mem_cache.memory_pool_host as mph
    out = [n for n, f in (("transfer_kv_direct", _direct_copy),
                          ("transfer_kv_all_layer_direct_lf_pf", _all_layer_lf_to_pfd),
                          ("transfer_kv_per_layer_direct_pf_lf", _per_layer_pfd_to_lf))
           if getattr(mph, n, None) is f]
    if mph.ALLOC_MEMORY_FUNCS.get("cpu") is _unpinned:
        out.append("ALLOC_MEMORY_FUNCS['cpu'] (unpinned)")
    return out


def format_table(result: dict) -> str:
    lines = []
    for c in result["comparisons"]:
        lines.append(f"{c['workload']}: {c['requests']} requests, page {c['page_size']}, "
                     f"{c['kv_slots']} device slots, host {c['shape']['host_slots']}, "
                     f"{c['layout']}, median of {c['repeats']} alternating rounds")
        lines.append(f"{'impl':<10}{'req/s':>9}  " + "".join(f"{op + ' us':>14}" for op in OPS)
                     + "   hit rate  storage  host  aborted")
        for impl, d in c["impls"].items():
            runs = d["runs"]
            med = {op: sorted(r["op_median_us"][op] for r in runs)[len(runs) // 2] for op in OPS}
            lines.append(f"{impl:<10}{d['requests_per_s_median']:>9,.1f}  "
                         + "".join(f"{med[op]:>14,.1f}" for op in OPS)
                         + f"   {d['hit_rate']:>8}  {d['storage_loaded_tokens']:>7}  "
                           f"{d['host_loaded_tokens']:>4}  {d['aborted']:>7}")
        waits = {impl: [r.get("release_waits", 0) for r in d["runs"]]
                 for impl, d in c["impls"].items()}
        lines.append("requests whose prefetch ended with host slots still on the way back, "
                     "per round (waited for, untimed): "
                     + "; ".join(f"{impl} {w}" for impl, w in waits.items()))
        for pair, r in c["ratios"].items():
            if r:
                lines.append(f"ratio {pair}: {r['median']:.2f}x ({r['min']:.2f}..{r['max']:.2f})")
        lines.append("identical outcomes: " + {True: "yes", False: "NO", None: "not checked"}[
            c["identical_outcomes"]])
        for m in c["mismatches"]:
            lines.append("  " + m)
        for impl, why in c["missing"].items():
            lines.append(f"{impl:<10}not measured: {why}")
        if c["upstream_cpu_substitutes"]:
            lines.append("upstream on CPU with: " + ", ".join(c["upstream_cpu_substitutes"]))
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - a quick look; the CLI is `uniradix bench-storage --cache`
    print(format_table(run_cache_bench(sys.argv[1] if len(sys.argv) > 1 else "file",
                                       requests=20, rounds=1, warmup=0)))
