"""Upstream's storage tier (HiCache L3) behind the trace interface: :class:`UpstreamStorageAdapter`.

sglang 0.5.13.post1's ``UnifiedRadixCache`` reaches the storage service through its cache
controller (``HybridCacheController``), whose prefetch and backup threads call a
``HiCacheStorage`` backend.  On CPU, without threads, this module gives the cache
:class:`StorageController`: the host-tier controller model of conformance/adapters/upstream_host.py plus
the controller's storage surface, where every piece of work a thread would do runs on a trace
environment op, through upstream's own controller code wherever it is a function of its own:

* ``prefetch`` / ``write_storage`` / ``terminate_prefetch`` / ``append_host_mem_release`` /
  ``prefetch_rate_limited`` / ``clear_storage_backend``: upstream's methods;
* ``storage_query``: the prefetch thread's step for the oldest queued prefetches: upstream's
  ``_storage_hit_query`` (keys from ``get_hash_str``, the backend's ``batch_exists``), then the
  threshold decision (revoke and release all, or keep the hit and release the rest);
* ``storage_load``: the I/O thread's transfer, page by page, with upstream's
  ``_generic_page_get`` (the backend's ``batch_get``, ``set_from_flat_data_page``,
  ``increment``); a short read terminates the prefetch, and the end of a transfer releases the
  slots not loaded, as ``prefetch_io_aux_func`` does;
* ``storage_backup``: the backup thread's step: upstream's ``_page_backup`` (with
  ``_generic_page_set`` and the backend's ``batch_set``), then the ack;
* ``storage_tick``: the clock ``time.monotonic`` reads in the cache and the controller module.

The backend is :class:`InMemoryStorage`, a deterministic dict behind upstream's own
``HiCacheStorage`` interface.  One tensor-parallel rank.
"""

from __future__ import annotations

from array import array
from queue import Queue
from typing import Any

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.conformance.adapters.storage_ops import STORAGE_HOST_EFFECT_OPS
from uniradix.conformance.adapters.upstream import UpstreamAdapter, _path
from uniradix.conformance.adapters.upstream_host import (
    HostPoolModel,
    ModelController,
    UpstreamHostAdapter,
)
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import InvalidInput, Unsupported

# argument names of the storage ops (the upstream adapter checks args itself)
_F = frozenset
upstream_mod._ARGS.update({
    "prefetch_from_storage": (_F({"rid", "node", "tokens"}), _F()),
    "check_prefetch_progress": (_F({"rid"}), _F()),
    "terminate_prefetch": (_F({"rid"}), _F()),
    "pop_prefetch_loaded_tokens": (_F({"rid"}), _F()),
    "release_aborted_request": (_F({"rid"}), _F()),
    "attach_storage_backend": (_F(), _F()),
    "detach_storage_backend": (_F(), _F()),
    "clear_storage_backend": (_F(), _F()),
    "storage_query": (_F(), _F({"count"})),
    "storage_load": (_F({"rid"}), _F({"pages"})),
    "storage_backup": (_F(), _F({"count"})),
    "storage_tick": (_F(), _F({"ticks"})),
})


class LogicalClock:
    """What ``time`` is inside upstream's cache and controller modules while one is driven:
    ``monotonic()`` is the trace's storage clock; the rest is the real module."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.now = 0

    def monotonic(self) -> float:
        return float(self.now)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


_CLOCK: LogicalClock | None = None


def _install_clock() -> LogicalClock:
    global _CLOCK
    if _CLOCK is None:
        from sglang.srt.mem_cache import unified_radix_cache as urc
        from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hcc
        _CLOCK = LogicalClock(urc.time)
        urc.time = _CLOCK
        hcc.time = _CLOCK
    return _CLOCK


def _backend_class() -> type:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    class InMemoryStorage(HiCacheStorage):
        """A deterministic in-memory store behind upstream's ``HiCacheStorage`` interface."""

        def __init__(self) -> None:
            self.data: dict[str, Any] = {}

        def get(self, key, target_location=None, target_sizes=None):
            return self.data.get(key)

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            return [self.data.get(k) for k in keys]

        def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
            self.data[key] = value
            return True

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
            for k, v in zip(keys, values, strict=True):
                self.data[k] = v
            return True

        def exists(self, key) -> bool:
            return key in self.data

        def clear(self) -> None:
            self.data.clear()

    return InMemoryStorage


class StorageHostPool(HostPoolModel):
    """The host pool with page contents (what a storage read writes and a backup reads)."""

    def __init__(self, pool: Any, torch_module: Any, size: int) -> None:
        super().__init__(pool, torch_module)
        self.size = size
        self.pages: dict[int, Any] = {}

    def get_data_page(self, index, flat: bool = True) -> Any:
        return self.pages.get(int(index), ("host-page", int(index)))

    def get_dummy_flat_data_page(self) -> Any:
        return None

    def set_from_flat_data_page(self, index: int, data_page: Any) -> None:
        self.pages[int(index)] = data_page

    def clear(self) -> None:
        super().clear()
        self.pages.clear()


class StorageController(ModelController):
    """The host-tier controller model plus the storage surface of ``HybridCacheController``
    (conformance/adapters/upstream_host.py; this module's docstring)."""

    def __init__(self, config: CacheConfig, host_pool: Any, device_alloc: Any, up: Any) -> None:
        super().__init__(config.write_policy, host_pool, device_alloc)
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        from sglang.srt.mem_cache.utils import get_hash_str
        self._base = HiCacheController
        self._hybrid = HybridCacheController
        self.torch = up.torch
        self.enable_storage = True
        self.page_size = config.page_size
        self.get_hash_str = get_hash_str
        self.storage_backend = _backend_class()()
        self.storage_backend.register_mem_pool_host(host_pool)
        self.has_draft = False
        self.backup_skip = False
        self.prefetch_threshold = max(config.prefetch_threshold, config.page_size)
        self.prefetch_capacity_limit = max(0, int(0.8 * (config.host_slots - config.kv_slots)))
        self.prefetch_tokens_occupied = 0
        self.extra_host_mem_release_queues: dict = {}
        self._new_queues()

    def _new_queues(self) -> None:
        self.prefetch_queue: Queue = Queue()
        self.backup_queue: Queue = Queue()
        self.prefetch_revoke_queue: Queue = Queue()
        self.ack_backup_queue: Queue = Queue()
        self.host_mem_release_queue: Queue = Queue()
        self.transfers: list = []  # prefetches queried and loading (the I/O thread's buffer)

    # -- upstream's methods ------------------------------------------------------------------
    def prefetch(self, request_id, host_indices, new_input_tokens, last_hash=None,
                 prefix_keys=None, extra_pools=None):
        return self._hybrid.prefetch(self, request_id, host_indices, new_input_tokens,
                                     last_hash, prefix_keys, extra_pools)

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None,
                      extra_pools=None):
        return self._hybrid.write_storage(self, host_indices, token_ids, hash_value,
                                          prefix_keys, extra_pools)

    def terminate_prefetch(self, operation):
        return self._base.terminate_prefetch(self, operation)

    def append_host_mem_release(self, host_indices=None, extra_pools=None) -> None:
        self._hybrid.append_host_mem_release(self, host_indices, extra_pools)

    def _append_host_mem_release_pages(self, release_queue, host_indices, page_size) -> None:
        self._hybrid._append_host_mem_release_pages(self, release_queue, host_indices, page_size)

    def prefetch_rate_limited(self) -> bool:
        return self._base.prefetch_rate_limited(self)

    def clear_storage_backend(self) -> bool:
        return self._hybrid.clear_storage_backend(self)

    def page_get_func(self, operation, hash_values, host_indices, extra_info=None):
        return self._base._generic_page_get(self, operation, hash_values, host_indices,
                                            extra_info)

    def page_set_func(self, hash_values, host_indices, extra_info=None) -> bool:
        return self._base._generic_page_set(self, hash_values, host_indices, extra_info)

    def reset(self) -> None:
        super().reset()
        self._new_queues()
        self.prefetch_tokens_occupied = 0

    # -- the threads' work, on command ----------------------------------------------------------
    def env_query(self, count: int) -> int:
        """The prefetch thread's step for the ``count`` oldest queued prefetches (-1: all)."""
        ran = 0
        while count != 0 and not self.prefetch_queue.empty():
            op = self.prefetch_queue.get_nowait()
            hash_value, hit = self._hybrid._storage_hit_query(self, op)
            if hit < self.prefetch_threshold:
                self.prefetch_revoke_queue.put(op.request_id)
                self.append_host_mem_release(op.host_indices)
            else:
                op.hash_value = hash_value[: hit // self.page_size]
                self.append_host_mem_release(op.host_indices[hit:])
                op.host_indices = op.host_indices[:hit]
                self.transfers.append(op)
            ran += 1
            count -= 1
        return ran

    def env_load(self, rid: str, pages: int) -> int:
        """The I/O thread's transfer of ``rid``'s oldest loading prefetch, ``pages`` pages
        (-1: all), page by page; a short read terminates it; its end releases the rest."""
        op = next((o for o in self.transfers if o.request_id == rid), None)
        if op is None:
            return 0
        ps = self.page_size
        total = len(op.hash_value) * ps
        read = 0
        while pages != 0 and op.completed_tokens < total:
            i = op.completed_tokens // ps
            before = op.completed_tokens
            self.page_get_func(op, op.hash_value[i: i + 1], op.host_indices[i * ps: (i + 1) * ps])
            if op.completed_tokens != before + ps:
                op.mark_terminate()
                break
            read += 1
            pages -= 1
        if op.is_terminated() or op.completed_tokens == total:
            self.append_host_mem_release(op.host_indices[op.completed_tokens:])
            self.transfers.remove(op)
        return read

    def env_backup(self, count: int) -> int:
        """The backup thread's step for the ``count`` oldest queued backups (-1: all)."""
        done = 0
        while count != 0 and not self.backup_queue.empty():
            op = self.backup_queue.get_nowait()
            self._base._page_backup(self, op)
            self.ack_backup_queue.put(op)
            done += 1
            count -= 1
        return done


def _k(args: dict, name: str, default: int) -> int:
    k = args.get(name, default)
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise InvalidInput(f"{name} must be an int >= -1, got {k!r}")
    return k


def _rid(args: dict) -> str:
    rid = args.get("rid")
    if not isinstance(rid, str):
        raise InvalidInput(f"rid must be a string, got {rid!r}")
    return rid


class UpstreamStorageAdapter(UpstreamHostAdapter):
    """:class:`UpstreamHostAdapter` with the storage tier (the storage ops of
    conformance/adapters/storage_ops.py) and a ``storage`` snapshot view like the spec's."""

    EFFECT_OPS = UpstreamHostAdapter.EFFECT_OPS + STORAGE_HOST_EFFECT_OPS
    #: KV events: 0.5.13.post1 announces no host pages a prefetch inserts (docs/SPEC.md)
    event_differences = ("prefetch-inserts-unannounced",)

    def __init__(self, config: CacheConfig) -> None:
        super().__init__(config)
        self.clock = _install_clock()
        self.clock.now = 0
        self._ops.update({
            "prefetch_from_storage": self._op_prefetch,
            "check_prefetch_progress": self._op_check_progress,
            "terminate_prefetch": self._op_terminate,
            "pop_prefetch_loaded_tokens": self._op_pop_loaded,
            "release_aborted_request": self._op_release_aborted,
            "attach_storage_backend": self._op_attach,
            "detach_storage_backend": self._op_detach,
            "clear_storage_backend": self._op_clear,
            "storage_query": self._op_storage_query,
            "storage_load": self._op_storage_load,
            "storage_backup": self._op_storage_backup,
            "storage_tick": self._op_storage_tick,
        })

    @staticmethod
    def _check_supported(config: CacheConfig) -> None:
        if not config.storage:
            raise Unsupported("UpstreamStorageAdapter needs a storage tier")
        UpstreamHostAdapter._check_supported(config.__class__(
            **{**config.to_dict(), "components": config.components, "storage": False}))

    def _build_cache(self):
        cache = UpstreamAdapter._build_cache(self)
        host = StorageHostPool(self.host_pool, self.up.torch, self.config.host_slots)
        self.controller = StorageController(self.config, host, self.allocator, self.up)
        cache.cache_controller = self.controller
        cache.write_through_threshold = self.config.write_through_threshold
        cache.load_back_threshold = self.config.load_back_threshold
        cache.components[self.up.ComponentType.FULL]._full_kv_pool_host = host
        cache.enable_storage = True
        cache.prefetch_stop_policy = self.config.prefetch_stop_policy
        cache.prefetch_threshold = self.config.prefetch_threshold
        cache.prefetch_timeout_base = self.config.prefetch_timeout_base
        cache.prefetch_timeout_per_page = self.config.prefetch_timeout_per_page
        cache.hicache_storage_pass_prefix_keys = False
        cache.enable_storage_metrics = False
        cache.root_node.hash_value = []
        return cache

    def apply(self, step: dict) -> dict:
        self.clock = _install_clock()
        return super().apply(step)

    # -- snapshot ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        snap = super().snapshot()
        cache, cc = self.cache, self.controller
        keys: list[dict[str, Any]] = []
        for node in self._walk_nodes():
            if node is self.root:
                continue
            extra, tokens = self._path_of(node)
            keys.append({"path": {"tokens": tokens, "extra_key": extra},
                         "page_keys": list(node.hash_value or ())})
        keys.sort(key=lambda e: (e["path"]["extra_key"] is not None,
                                 e["path"]["extra_key"] or "", e["path"]["tokens"]))
        ongoing = []
        for rid in sorted(cache.ongoing_prefetch):
            anchor, key, host_indices, op, _, _ = cache.ongoing_prefetch[rid]
            extra, tokens = self._path_of(anchor)
            ongoing.append({"rid": rid, "anchor": {"tokens": tokens, "extra_key": extra},
                            "tokens": len(key), "host_slots": [int(v) for v in host_indices.tolist()],
                            "hit_pages": len(op.hash_value), "completed": int(op.completed_tokens),
                            "terminated": bool(op.is_terminated())})
        snap["storage"] = {
            "page_keys": keys,
            "stored": sorted(cc.storage_backend.data),
            "ongoing": ongoing,
            "ongoing_backups": len(cache.ongoing_backup),
            "revoke_queue": list(cc.prefetch_revoke_queue.queue),
            "release_queue": [[int(v) for v in p.tolist()] for p in cc.host_mem_release_queue.queue],
            "loaded_tokens": dict(sorted(cache.prefetch_loaded_tokens_by_reqid.items())),
            "occupied": int(cc.prefetch_tokens_occupied),
            "clock": self.clock.now,
        }
        return snap

    # -- cache ops -----------------------------------------------------------------------------
    def _op_prefetch(self, step: dict, args: dict) -> dict:
        rid = _rid(args)
        tokens = args.get("tokens")
        if not isinstance(tokens, list) or any(
                isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise InvalidInput("tokens must be a list of ints")
        node = self._find_node(*_path(args.get("node")))
        if rid in self.cache.ongoing_prefetch:
            raise InvalidInput(f"prefetch: request {rid!r} already has a prefetch in flight")
        if not (node is self.root or node.backuped):  # the scheduler's condition
            return {"tokens": 0}
        self.cache.prefetch_from_storage(rid, node, array("q", tokens),
                                         node.get_last_hash_value(), None)
        entry = self.cache.ongoing_prefetch.get(rid)
        return {"tokens": 0 if entry is None else len(entry[1])}

    def _op_check_progress(self, step: dict, args: dict) -> dict:
        done = self.cache.check_prefetch_progress(_rid(args))
        return {"done": bool(done), "freed": self.pool.take_freed()}

    def _op_terminate(self, step: dict, args: dict) -> dict:
        self.cache.terminate_prefetch(_rid(args))
        return {}

    def _op_pop_loaded(self, step: dict, args: dict) -> dict:
        return {"tokens": int(self.cache.pop_prefetch_loaded_tokens(_rid(args)))}

    def _op_release_aborted(self, step: dict, args: dict) -> dict:
        self.cache.release_aborted_request(_rid(args))
        return {}

    def _op_attach(self, step: dict, args: dict) -> dict:
        return {"ok": bool(self.cache.attach_storage_backend("dynamic")[0])}

    def _op_detach(self, step: dict, args: dict) -> dict:
        return {"ok": bool(self.cache.detach_storage_backend()[0])}

    def _op_clear(self, step: dict, args: dict) -> dict:
        return {"ok": bool(self.cache.clear_storage_backend())}

    # -- environment ops -------------------------------------------------------------------------
    def _op_storage_query(self, step: dict, args: dict) -> dict:
        return {"queried": self.controller.env_query(_k(args, "count", -1))}

    def _op_storage_load(self, step: dict, args: dict) -> dict:
        rid = _rid(args)
        return {"pages": self.controller.env_load(rid, _k(args, "pages", -1))}

    def _op_storage_backup(self, step: dict, args: dict) -> dict:
        return {"written": self.controller.env_backup(_k(args, "count", -1))}

    def _op_storage_tick(self, step: dict, args: dict) -> dict:
        ticks = args.get("ticks", 1)
        if isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 0:
            raise InvalidInput(f"storage_tick: ticks must be an int >= 0, got {ticks!r}")
        self.clock.now += ticks
        return {}
