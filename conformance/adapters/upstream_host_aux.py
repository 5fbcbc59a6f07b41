"""Upstream's host tier with the SWA or Mamba component: :class:`HostAuxUpstreamAdapter`.

0.5.13.post1 composes a host tier with an aux component through its hybrid cache controller
(``hybrid_cache/hybrid_cache_controller.py``): a host pool group whose anchor is the KV host
pool and whose other entries are the aux host pools, each with an aux device allocator and two
eviction callbacks (``cache.evict_host(n, SWA/MAMBA)`` when an aux host alloc fails,
``cache.evict(swa_num_tokens=n / mamba_num=n)`` when an aux device alloc fails).  The cache's
components build their own transfers at backup and load back (the SWA window data, the Mamba
state, and at a Mamba load back a copy into the request's own state slot); the controller
allocates what those transfers leave open.

:class:`AuxModelController` is that controller over the environment model (TRACE.md "Pools" and
"Host I/O"): host slots from lowest-first host pools (``host_slots``; ``host_swa_slots``,
default ``host_slots``; ``host_mamba_slots``, default 2 x ``mamba_slots``, page size 1), device
slots from the KV pool (full slots only at a load back: the SWA slots are taken separately and
paired with them), the SWA pool and the Mamba pool; acks as in
:mod:`uniradix.conformance.adapters.upstream_host`.  The allocation of the aux parts is upstream's own
code (``HybridCacheController._resolve_pool_transfers_allocation``), so its fallbacks (evict,
retry, roll back) are the recorded behaviour.  The SWA component is the seed-era one, as in
:mod:`uniradix.conformance.adapters.upstream_hybrid`.

What the trace sees besides the host and hybrid adapters' observations (docs/TRACE.md):

* ``match_prefix``: ``swa_host_hit_length`` / ``mamba_host_hit_length``.
* ``load_back``: ``swa_device_indices`` / ``mamba_device_indices`` (the aux device slots the
  load back gave the loaded nodes, in transfer order), and with Mamba ``mamba_pool_idx``: the
  state slot the load back took for the request (null when none).  The request has no state
  slot before its load back (the scheduler admits it first), and 0.5.13.post1's
  ``init_load_back`` gets the match's aux host hit lengths as 0 (the seed's guard: a load back
  runs when the best match node is evicted).
* effects ``host_swa_freed`` / ``host_mamba_freed`` on the host-effect ops, and the aux device
  effects (``swa_freed`` / ``mamba_freed``) on ``load_back`` and ``check_hicache_events`` too.
* ``host_lock`` locks what upstream's ``inc_host_lock_ref`` locks in every component; its
  ``host_unlock`` undoes exactly that (the Full part only when the Full part was locked).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from uniradix.conformance.adapters.base import check_load_back_slot
from uniradix.conformance.adapters.upstream import _path, unmodelled_settings
from uniradix.conformance.adapters.upstream_host import (
    HostPoolModel,
    ModelController,
    ModelEvent,
    UpstreamHostAdapter,
    refuse_requester,
)
from uniradix.conformance.adapters.upstream_hybrid import HybridUpstreamAdapter
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import AllocatorError, HandleError, InvalidInput, Unsupported
from uniradix.spec.world import PagedPool

# The recording configs of the host tier with an aux component (conformance/explore/driver.py draws the
# pool sizes from the seed): the one table of them, shared with the spec's conform configs.
#   host-swa-*:   components full+swa, sliding_window 8, swa_slots 50-100% of kv_slots,
#                 host_slots 1-2 x kv_slots, host_swa_slots host_slots or half of it
#   host-mamba-*: components full+mamba, mamba_slots from MAMBA_SLOT_CHOICES, chunk size 4,
#                 host_slots 1-2 x kv_slots, host_mamba_slots default (2 x mamba_slots) or
#                 mamba_slots
HOST_AUX_CONFIGS: dict[str, dict[str, Any]] = {
    f"host-{aux}-{wp}-p{ps}": {
        "components": ("full", aux), "page_size": ps,
        "write_policy": {"wt": "write_through", "wb": "write_back"}[wp],
        "write_through_threshold": 1,
        **({"sliding_window": 8} if aux == "swa" else {"mamba_cache_chunk_size": 4}),
    }
    for aux in ("swa", "mamba") for wp in ("wt", "wb") for ps in (1, 4)
}

_AUX_EFFECT_OPS = ("load_back", "check_hicache_events")  # besides insert / evict (hybrid)


def host_aux_slots(config: CacheConfig) -> int:
    """Usable slots of the aux host pool (TRACE.md header defaults)."""
    if "swa" in config.components:
        return config.host_swa_slots if config.host_swa_slots is not None else config.host_slots
    if config.host_mamba_slots is not None:
        return config.host_mamba_slots
    return 2 * config.mamba_slots


class HostGroupModel(HostPoolModel):
    """The host pool group: the KV host pool (the anchor: ``alloc``, ``free``,
    ``available_size``) and an ``entry_map`` of the aux pools; ``clear`` clears all."""

    def __init__(self, pool: PagedPool, torch_module: Any) -> None:
        super().__init__(pool, torch_module)
        self.entry_map: dict = {}

    def clear(self) -> None:
        super().clear()
        for entry in self.entry_map.values():
            entry.host_pool.clear()


class AuxModelController(ModelController):
    """:class:`ModelController` with the aux pools of a hybrid model (module docstring)."""

    def __init__(self, write_policy: str, host_group: HostGroupModel,
                 full_alloc: Callable[[int], Any], full_free: Callable[[Any], None],
                 resolve: Callable[..., Any], torch_module: Any) -> None:
        super().__init__(write_policy, host_group, device_alloc=None)
        self._full_alloc = full_alloc
        self._full_free = full_free
        self._resolve = resolve  # upstream's HybridCacheController._resolve_pool_transfers_allocation
        self._torch = torch_module
        self.loaded_aux: dict[str, list[int]] = {}  # pool name -> device slots given at load backs

    def write(self, device_indices, priority=None, node_id: int = -1, extra_pools=None):
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        if extra_pools and self._resolve(self, extra_pools, alloc_host=True,
                                         kv_device_indices=device_indices,
                                         kv_host_indices=host_indices) is None:
            self.mem_pool_host.free(host_indices)
            return None
        self.copies.append(("backup", device_indices.tolist(), host_indices.tolist()))
        self.ack_write_queue.append((ModelEvent(), ModelEvent(self.done_on_submit), [node_id]))
        return host_indices

    def load(self, host_indices, priority=None, node_id: int = -1, extra_pools=None):
        need_kv = host_indices.numel() > 0
        if need_kv:
            device_indices = self._full_alloc(len(host_indices))
            if device_indices is None:
                return None
        else:
            device_indices = self._torch.empty((0,), dtype=self._torch.int64)
        open_before = [p.device_indices is None and p.indices_from_pool is None
                       for p in extra_pools or ()]
        if extra_pools and self._resolve(self, extra_pools, alloc_host=False,
                                         kv_device_indices=device_indices,
                                         kv_host_indices=host_indices) is None:
            if need_kv:
                self._full_free(device_indices)
            return None
        for p, was_open in zip(extra_pools or (), open_before, strict=True):
            if was_open and p.device_indices is not None:
                name = p.name.value if hasattr(p.name, "value") else str(p.name)
                self.loaded_aux.setdefault(name, []).extend(int(v) for v in p.device_indices.tolist())
        if need_kv:
            self.copies.append(("load", host_indices.tolist(), device_indices.tolist()))
        self._pending_loads.append(node_id)
        return device_indices


class _Req:
    """What upstream's ``init_load_back`` and the aux components' load back read from a request
    (no state slot yet: the load back takes one for it when the node has a host state)."""

    def __init__(self, last_node: Any) -> None:
        self.last_node = last_node
        self.swa_host_hit_length = 0
        self.mamba_host_hit_length = 0
        self.mamba_pool_idx = None


class HostAuxUpstreamAdapter(UpstreamHostAdapter, HybridUpstreamAdapter):
    """Upstream's cache with the host tier and ``components: ["full", "swa"]`` or
    ``["full", "mamba"]`` (pages 1 and 4; write-through, selective or write-back)."""

    def __init__(self, config: CacheConfig) -> None:
        aux = "swa" if "swa" in config.components else "mamba"
        self.host_aux_pool = PagedPool(host_aux_slots(config),
                                       config.page_size if aux == "swa" else 1,
                                       name=f"host_{aux}")
        super().__init__(config)

    @staticmethod
    def _check_supported(config: CacheConfig) -> None:
        reasons = []
        if config.components == ("full",):
            reasons.append("no aux component (use UpstreamHostAdapter)")
        if len(config.components) > 2:
            reasons.append("SWA and Mamba together")
        if not config.has_host_tier:
            reasons.append("no host tier (use HybridUpstreamAdapter)")
        reasons += unmodelled_settings(config)
        if reasons:
            raise Unsupported("HostAuxUpstreamAdapter drives the host tier with SWA or Mamba, "
                              "not " + ", ".join(reasons))

    @property
    def _aux(self) -> str:
        """The one aux component (SWA and Mamba together are refused above)."""
        return "swa" if "swa" in self.config.components else "mamba"

    def _mamba_extra_buffer(self) -> bool:
        return self.config.page_size > 1

    def _build_cache(self):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
            HybridCacheController,
        )
        cache = HybridUpstreamAdapter._build_cache(self)
        torch = self.up.torch
        ct = self.up.ComponentType
        group = HostGroupModel(self.host_pool, torch)
        aux_host = HostPoolModel(self.host_aux_pool, torch)
        if "swa" in self.config.components:
            swa_pool = self.pool.swa
            entry = types.SimpleNamespace(
                name=PoolName.SWA, host_pool=aux_host, device_pool=None,
                is_primary_index_anchor=False,
                host_evict_fn=lambda n: cache.evict_host(n, ct.SWA),
                device_evict_fn=lambda n: cache.evict(EvictParams(swa_num_tokens=n)),
                device_alloc_fn=_allocating(swa_pool, torch),
                device_free_fn=lambda idx: swa_pool.free([int(v) for v in idx.tolist()]))
            group.entry_map[PoolName.SWA] = entry
            cache.components[ct.SWA]._swa_kv_pool_host = aux_host
            cache.swa_kv_pool_host = aux_host
            full_alloc = _allocating(self.pool, torch, full_only=True)
        else:
            mamba_alloc = cache.req_to_token_pool.mamba_allocator
            entry = types.SimpleNamespace(
                name=PoolName.MAMBA, host_pool=aux_host, device_pool=None,
                is_primary_index_anchor=False,
                host_evict_fn=lambda n: cache.evict_host(n, ct.MAMBA),
                device_evict_fn=lambda n: cache.evict(EvictParams(mamba_num=n)),
                device_alloc_fn=mamba_alloc.alloc, device_free_fn=mamba_alloc.free)
            group.entry_map[PoolName.MAMBA] = entry
            cache.components[ct.MAMBA]._mamba_pool_host = aux_host
            cache.mamba_pool_host = aux_host
            full_alloc = self.allocator.alloc
        self.controller = AuxModelController(
            self.config.write_policy, group, full_alloc, self.allocator.free,
            HybridCacheController._resolve_pool_transfers_allocation, torch)
        cache.cache_controller = self.controller
        cache.write_through_threshold = self.config.write_through_threshold
        cache.load_back_threshold = self.config.load_back_threshold
        cache.components[ct.FULL]._full_kv_pool_host = group
        cache.full_kv_pool_host = group
        return cache

    # -- the interface -------------------------------------------------------------------------
    @property
    def _host_aux_effect(self) -> str:
        return f"host_{self._aux}_freed"

    def apply(self, step: dict) -> dict:
        self.host_aux_pool.take_freed()
        self.controller.loaded_aux.clear()
        obs = super().apply(step)
        freed = self.host_aux_pool.take_freed()
        if "error" not in obs and step.get("op") in self.EFFECT_OPS:
            obs[self._host_aux_effect] = freed
        return obs

    def snapshot(self) -> dict:
        snap = super().snapshot()
        ct = self.up.ComponentType
        full, aux = ct.FULL, (ct.SWA if self._aux == "swa" else ct.MAMBA)
        nodes: list[dict[str, Any]] = []
        for node in self._walk_nodes():
            if node is self.root:
                continue
            f, a = node.component_data[full], node.component_data[aux]
            if f.host_value is None and not f.host_lock_ref and a.host_value is None \
                    and not a.host_lock_ref:
                continue
            extra, tokens = self._path_of(node)
            nodes.append({
                "path": {"tokens": tokens, "extra_key": extra},
                "host_value": _ints(f.host_value), "host_lock_ref": int(f.host_lock_ref),
                self._aux: {"host_value": _ints(a.host_value),
                            "host_lock_ref": int(a.host_lock_ref)}})
        nodes.sort(key=lambda n: (n["path"]["extra_key"] is not None,
                                  n["path"]["extra_key"] or "", n["path"]["tokens"]))
        snap["host"]["nodes"] = nodes
        lru = self.cache.host_lru_lists[aux]
        order = []
        x = lru.tail.lru_prev[lru._pt]
        while x is not lru.head:
            extra, tokens = self._path_of(x)
            order.append({"tokens": tokens, "extra_key": extra})
            x = x.lru_prev[lru._pt]
        snap["host"][f"{self._aux}_host_lru_order"] = order
        snap["host"][f"{self._aux}_pool"] = sorted(self.host_aux_pool.allocated_pages())
        return snap

    # -- ops -----------------------------------------------------------------------------------
    def _op_load_back(self, step: dict, args: dict) -> dict:
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
        node = self._find_node(*_path(args.get("node")))
        last = self._find_node(*_path(args.get("last_device_node")))
        mem_quota = args.get("mem_quota")
        if mem_quota is not None and (isinstance(mem_quota, bool) or not isinstance(mem_quota, int)
                                      or mem_quota < 0):
            raise InvalidInput("mem_quota must be null or a non-negative int")
        cur = node
        while cur is not None and cur is not last:
            cur = cur.parent
        if cur is None:
            raise InvalidInput("load_back: last_device_node is not on the path of the node")
        slot = check_load_back_slot(self.config, args.get("mamba_slot"), args.get("rid"))
        req = self._requester(args, last)
        if slot is not None:
            req.mamba_pool_idx = self._request_slot(slot, "load_back")
        indices, last_node = self.cache.init_load_back(InitLoadBackParams(
            best_match_node=node, host_hit_length=0, mem_quota=mem_quota, req=req))
        self.cache.ready_to_load_host_cache()
        ret: dict = {"device_indices": [int(v) for v in indices.tolist()],
                     "last_node": self._depth(last_node),
                     f"{self._aux}_device_indices": list(self.controller.loaded_aux.get(self._aux, ()))}
        if self._aux == "mamba":
            idx = req.mamba_pool_idx
            ret["mamba_pool_idx"] = None if idx is None else int(idx.reshape(-1)[0])
        ret["freed"] = self.pool.take_freed()
        ret.update(self._effects())
        return ret

    def _requester(self, args: dict, last: Any) -> Any:
        refuse_requester(args)
        return _Req(last)  # (this module's: with the aux fields)

    def _op_check_hicache_events(self, step: dict, args: dict) -> dict:
        ret = super()._op_check_hicache_events(step, args)
        ret.update(self._effects())
        return ret

    def _op_host_lock(self, step: dict, args: dict) -> dict:
        node, handle, full_locked = self._host_lock_target(step, args)
        result = self.cache.inc_host_lock_ref(node)
        self._host_handles[handle] = (node, full_locked, result.to_dec_params())
        return {"handle": handle}

    def _op_host_unlock(self, step: dict, args: dict) -> dict:
        handle = args.get("handle")
        if handle not in self._host_handles or isinstance(handle, bool):
            raise HandleError(f"host handle {handle!r} is not held")
        node, full_locked, params = self._host_handles.pop(handle)
        full = self.up.ComponentType.FULL
        for comp in self.cache._components_tuple:  # dec_host_lock_ref, less an unlocked Full part
            if comp.component_type == full and not full_locked:
                continue
            comp.release_component_lock(node=node, params=params, lock_host=True)
        self.cache._update_evictable_leaf_sets(node)
        return {}

    def _op_reset(self, step: dict, args: dict) -> dict:
        out = super()._op_reset(step, args)
        self.host_aux_pool.reset()
        return out


def _allocating(pool: PagedPool, torch: Any, full_only: bool = False) -> Callable[[int], Any]:
    """``alloc(n)`` in SGLang's convention (a tensor, or None when too few are free) over one
    pool of the environment; ``full_only`` takes full slots only from a hybrid KV pool (its
    SWA slots are taken separately and paired by ``set_full_to_swa_mapping``)."""
    def take(n: int) -> list[int]:
        return PagedPool.alloc(pool, n) if full_only else pool.alloc(n)

    def alloc(n: int):
        try:
            slots = take(int(n))
        except AllocatorError:
            return None
        return torch.tensor(slots, dtype=torch.int64)
    return alloc


def _ints(t: Any) -> list[int] | None:
    return None if t is None else [int(v) for v in t.tolist()]


__all__ = ["HOST_AUX_CONFIGS", "AuxModelController", "HostAuxUpstreamAdapter", "host_aux_slots"]
