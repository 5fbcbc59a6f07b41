"""Upstream's host tier (HiCache) behind the trace interface: :class:`UpstreamHostAdapter`.

Upstream's ``UnifiedRadixCache`` talks to the host tier through a *cache controller*
(UPSTREAM.md, "Host tier").  On a CPU machine there is no copy engine, so this module gives it
:class:`ModelController`, the trace contract's I/O environment (TRACE.md, "Host I/O") in the
controller's shape: ``write`` takes host slots from the host pool (a
:class:`~uniradix.spec.world.PagedPool`, lowest-first) and queues one ack; ``load`` takes device
slots from the KV pool and ``start_loading`` queues one ack for the loads since the last call;
an ack's events report done only once ``io_complete`` (or a blocking ``synchronize``, which is
how upstream waits for write-backs) has finished it.  No data moves: slot bookkeeping is what
the cache observes.

Only the Full component is driven (host tier + SWA/Mamba stays unsupported).
"""

from __future__ import annotations

from typing import Any

from uniradix.conformance.adapters.base import check_load_back_slot
from uniradix.conformance.adapters.upstream import (
    UpstreamAdapter,
    _count,
    _path,
)
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import HandleError, InvalidInput, Unsupported
from uniradix.spec.world import PagedPool


class ModelEvent:
    """A CUDA event stand-in: done once the environment completes its transfer."""

    __slots__ = ("done",)

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # waiting on an event completes the transfer
        self.done = True


class HostPoolModel(PoolAllocator):
    """The host KV pool as upstream's controller exposes it (``mem_pool_host``)."""

    entry_map: dict = {}


class ModelController:
    """The controller surface upstream's cache uses for the device<->host tier."""

    def __init__(self, write_policy: str, host_pool: Any, device_alloc: Any,
                 done_on_submit: bool = False) -> None:
        self.done_on_submit = done_on_submit  # (the benchmark: a copy engine that keeps up)
        self.write_policy = write_policy
        self.enable_storage = False
        self.mem_pool_host = host_pool
        self.device_alloc = device_alloc
        self.ack_write_queue: list = []   # (start_event, finish_event, node_ids)
        self.ack_load_queue: list = []
        self._pending_loads: list = []
        self.copies: list = []  # ("backup", device, host) / ("load", host, device), in order

    def write(self, device_indices, priority=None, node_id: int = -1, extra_pools=None):
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.copies.append(("backup", device_indices.tolist(), host_indices.tolist()))
        self.ack_write_queue.append((ModelEvent(), ModelEvent(self.done_on_submit), [node_id]))
        return host_indices

    def load(self, host_indices, priority=None, node_id: int = -1, extra_pools=None):
        device_indices = self.device_alloc.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.copies.append(("load", host_indices.tolist(), device_indices.tolist()))
        self._pending_loads.append(node_id)
        return device_indices

    def start_loading(self) -> int:
        if not self._pending_loads:
            return -1
        self.ack_load_queue.append((ModelEvent(), ModelEvent(self.done_on_submit),
                                    list(self._pending_loads)))
        self._pending_loads.clear()
        return 0

    def complete(self, writes: int, loads: int) -> None:
        """``io_complete``: the oldest not-done acks of each queue are done (-1: all)."""
        for queue, k in ((self.ack_write_queue, writes), (self.ack_load_queue, loads)):
            for _, finish, _ in queue:
                if k == 0:
                    break
                if not finish.done:
                    finish.done = True
                    k -= 1

    def append_host_mem_release(self, host_indices) -> None:
        self.mem_pool_host.free(host_indices)

    def reset(self) -> None:
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self._pending_loads.clear()


def refuse_requester(args: dict) -> None:
    """``load_back {rid}`` names a waiting request as the requester: upstream's host tier is
    driven tree-level only here (its request path, conformance/adapters/upstream_requests.py,
    has no host tier), so there is no such request: Unsupported."""
    if args.get("rid") is not None:
        raise Unsupported("load_back: rid (a waiting request as the requester) needs the "
                          "request path, which upstream's host tier is not driven on here")


class _Req:
    """What upstream's ``init_load_back`` reads from a request."""

    def __init__(self, last_node: Any) -> None:
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0


class UpstreamHostAdapter(UpstreamAdapter):
    """:class:`UpstreamAdapter` with the host tier: ops ``evict_host``, ``load_back``,
    ``io_complete``, ``check_hicache_events``, ``host_lock`` / ``host_unlock``, and
    ``host_freed`` effects."""

    EFFECT_OPS: tuple[str, ...] = ("insert", "evict", "load_back", "check_hicache_events", "evict_host")

    def __init__(self, config: CacheConfig) -> None:
        self.host_pool = PagedPool(config.host_slots, config.page_size, name="host")
        super().__init__(config)
        # handle -> (node, locked); the host tier with SWA or Mamba (upstream_host_aux.py) adds
        # the lock's dec params
        self._host_handles: dict[int, tuple[Any, ...]] = {}
        self._ops.update({
            "evict_host": self._op_evict_host,
            "load_back": self._op_load_back,
            "io_complete": self._op_io_complete,
            "check_hicache_events": self._op_check_hicache_events,
            "host_lock": self._op_host_lock,
            "host_unlock": self._op_host_unlock,
        })

    @staticmethod
    def _check_supported(config: CacheConfig) -> None:
        if not config.has_host_tier:
            raise Unsupported("UpstreamHostAdapter needs a host tier")
        UpstreamAdapter._check_supported(config.__class__(
            **{**config.to_dict(), "components": config.components, "host_slots": 0}))

    def _build_cache(self):
        cache = super()._build_cache()
        host = HostPoolModel(self.host_pool, self.up.torch)
        self.controller = ModelController(self.config.write_policy, host, self.allocator)
        cache.cache_controller = self.controller
        cache.write_through_threshold = self.config.write_through_threshold
        cache.load_back_threshold = self.config.load_back_threshold
        cache.components[self.up.ComponentType.FULL]._full_kv_pool_host = host
        return cache

    # -- the interface -----------------------------------------------------------------------
    def apply(self, step: dict) -> dict:
        self.host_pool.take_freed()
        obs = super().apply(step)
        host_freed = self.host_pool.take_freed()
        if "error" not in obs and step.get("op") in self.EFFECT_OPS:
            obs["host_freed"] = host_freed
        return obs

    def snapshot(self) -> dict:
        snap = super().snapshot()
        full = self.up.ComponentType.FULL
        nodes: list[dict[str, Any]] = []
        for node in self._walk_nodes():
            cd = node.component_data[full]
            if node is self.root or (cd.host_value is None and not cd.host_lock_ref):
                continue
            extra, tokens = self._path_of(node)
            nodes.append({"path": {"tokens": tokens, "extra_key": extra},
                          "host_value": None if cd.host_value is None
                          else [int(v) for v in cd.host_value.tolist()],
                          "host_lock_ref": int(cd.host_lock_ref)})
        nodes.sort(key=lambda n: (n["path"]["extra_key"] is not None,
                                  n["path"]["extra_key"] or "", n["path"]["tokens"]))
        strategy = self.cache.eviction_strategy
        order = []
        for leaf in sorted(self.cache.evictable_host_leaves, key=strategy.get_priority):
            extra, tokens = self._path_of(leaf)
            order.append({"tokens": tokens, "extra_key": extra})

        def acks(queue, ongoing) -> list:
            out = []
            for _, finish, ids in queue:
                for i in ids:
                    entry = ongoing.get(i)
                    if entry is None:
                        continue
                    extra, tokens = self._path_of(entry[0])
                    out.append({"node": {"tokens": tokens, "extra_key": extra},
                                "done": finish.done, "locked": entry[1] is not None})
            return out
        snap["host"] = {
            "nodes": nodes,
            "host_leaf_order": order,
            "pool": sorted(self.host_pool.allocated_pages()),
            "writes": acks(self.controller.ack_write_queue, self.cache.ongoing_write_through),
            "loads": acks(self.controller.ack_load_queue, self.cache.ongoing_load_back),
        }
        return snap

    def take_copies(self) -> list:
        out = list(self.controller.copies)
        self.controller.copies.clear()
        return out

    # -- ops ---------------------------------------------------------------------------------
    def _op_evict_host(self, step: dict, args: dict) -> dict:
        n = _count(args.get("num_tokens"), "num_tokens")
        return {"num_evicted": int(self.cache.evict_host(n))}

    def _op_load_back(self, step: dict, args: dict) -> dict:
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        node = self._find_node(*_path(args.get("node")))
        last = self._find_node(*_path(args.get("last_device_node")))
        mem_quota = args.get("mem_quota")
        if mem_quota is not None:
            _count(mem_quota, "mem_quota")
        check_load_back_slot(self.config, args.get("mamba_slot"), args.get("rid"))  # (no
        # Mamba: refused)
        cur = node
        while cur is not None and cur is not last:
            cur = cur.parent
        if cur is None:
            raise InvalidInput("load_back: last_device_node is not on the path of the node")
        indices, last_node = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=node, host_hit_length=0, mem_quota=mem_quota,
            req=self._requester(args, last)))
        self.cache.ready_to_load_host_cache()
        return {"device_indices": [int(v) for v in indices.tolist()],
                "last_node": self._depth(last_node), "freed": self.pool.take_freed()}

    def _requester(self, args: dict, last: Any) -> Any:
        """The request a ``load_back`` hands ``init_load_back``: the driver's, whose last
        device node is the step's (``rid`` is refused: this adapter drives the tree-level API
        only; the request path's adapters name the request, conformance/adapters/
        upstream_requests.py)."""
        refuse_requester(args)
        return _Req(last)

    def _op_io_complete(self, step: dict, args: dict) -> dict:
        writes, loads = args.get("writes", 0), args.get("loads", 0)
        for name, k in (("writes", writes), ("loads", loads)):
            if isinstance(k, bool) or not isinstance(k, int) or k < -1:
                raise InvalidInput(f"io_complete: {name} must be an int >= -1")
        self.controller.complete(writes, loads)
        return {}

    def _op_check_hicache_events(self, step: dict, args: dict) -> dict:
        self.cache.check_hicache_events()
        return {"freed": self.pool.take_freed()}

    def _op_host_lock(self, step: dict, args: dict) -> dict:
        node, handle, locked = self._host_lock_target(step, args)
        self.cache.inc_host_lock_ref(node)
        self._host_handles[handle] = (node, locked)
        return {"handle": handle}

    def _host_lock_target(self, step: dict, args: dict) -> tuple[Any, int, bool]:
        """A host_lock step checked: the node, the new handle, and whether the node's Full part
        has a host copy (only that part takes a host lock)."""
        node = self._find_node(*_path(args.get("node")))
        handle = step.get("i")
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise InvalidInput("a host_lock step needs an integer 'i' (the handle)")
        if handle in self._host_handles:
            raise HandleError(f"host handle {handle} is already held")
        return node, handle, node.component_data[self.up.ComponentType.FULL].host_value is not None

    def _op_host_unlock(self, step: dict, args: dict) -> dict:
        handle = args.get("handle")
        if handle not in self._host_handles or isinstance(handle, bool):
            raise HandleError(f"host handle {handle!r} is not held")
        node, locked = self._host_handles.pop(handle)
        if locked:
            self.cache.dec_host_lock_ref(node)
        return {}

    def _op_reset(self, step: dict, args: dict) -> dict:
        out = super()._op_reset(step, args)
        self.host_pool.reset()
        self._host_handles.clear()
        return out
