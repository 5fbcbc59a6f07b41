"""Upstream SGLang's cache with the SWA or Mamba component, driven one trace step at a time.

:class:`HybridUpstreamAdapter` extends :class:`~uniradix.conformance.adapters.upstream.UpstreamAdapter`
(the Full device tier) with what a hybrid model needs (../shared UPSTREAM.md, "Driving it
without a GPU server"):

* SWA: the cache insists on an ``SWATokenToKVPoolAllocator``; :class:`SwaPoolAllocator` is one
  (a subclass whose state is the environment's :class:`~uniradix.spec.world.HybridKVPool`: full
  slots, SWA slots and the map between them, lowest-first).  The SWA component is the
  *seed-era* one: 0.5.13.post1's ``SWAComponent`` with the base class's LRU refresh (every
  touched node moves to most-recent, the matched path at the end of a match) and without the
  cap of a fresh SWA leaf at one window, plugged in through
  ``CacheInitParams.component_registry_override``.
* Mamba: the cache insists on a ``HybridReqToTokenPool``; :class:`MambaReqPool` is one, whose
  ``mamba_allocator`` is the environment's Mamba pool (page size 1, lowest-first).  The chunk
  size behind ``mamba_branching_seqlen`` is the global server argument
  ``mamba_cache_chunk_size``; the adapter sets it from the trace header.

Observations and snapshots add the aux parts the spec's have (TRACE.md; spec/snapshot.py):
per-component effects, ``mamba_exist``, ``mamba_branching_seqlen``, sizes, per-node aux data
and each aux component's LRU list, oldest first.
"""

from __future__ import annotations

import types
from typing import Any

from uniradix.conformance.adapters.upstream import (
    UpstreamAdapter,
    _count,
    _int_list,
    load_upstream,
    unmodelled_settings,
)
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import AllocatorError, InvalidInput, Unsupported
from uniradix.spec.world import HybridKVPool, hybrid_pools

_HYBRID: types.SimpleNamespace | None = None


def load_hybrid() -> types.SimpleNamespace:
    """The upstream names the hybrid adapter needs, and the classes built on them, once."""
    global _HYBRID
    if _HYBRID is not None:
        return _HYBRID
    up = load_upstream()
    from sglang.srt import server_args
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache_components import SWAComponent, TreeComponent
    torch = up.torch

    class SeedEraSWAComponent(SWAComponent):
        """0.5.13.post1's SWA component with the seed's LRU refresh and no leaf cap."""

        def refresh_lru(self, phase, node, root_node) -> None:
            TreeComponent.refresh_lru(self, phase, node, root_node)

        def _maybe_split_leaf_for_swa_lock(self, leaf) -> None:
            return None

    class HeldTombstoneSWAComponent(SeedEraSWAComponent):
        """The seed-era component with the spec's rule for an SWA tombstone a lock holds
        (issue 18, docs/SPEC.md): the insert leaves it and its slots alone."""

        def update_component_on_insert_overlap(self, node, prefix_len, total_prefix_len,
                                               value_slice, params):
            full = node.component_data[up.ComponentType.FULL]
            if full.lock_ref > 0 and node.component_data[self.component_type].value is None:
                return prefix_len
            return super().update_component_on_insert_overlap(
                node, prefix_len, total_prefix_len, value_slice, params)

    class SwaPoolAllocator(SWATokenToKVPoolAllocator):
        """The hybrid KV pool model behind upstream's SWA allocator interface."""

        def __init__(self, pool) -> None:  # no super().__init__: the state is ``pool``
            self.pool = pool
            self.page_size = pool.page_size
            self.device = torch.device("cpu")
            self.is_not_in_free_group = True
            self.free_group: list[Any] = []
            self.full_attn_allocator = types.SimpleNamespace(
                free=self.free, available_size=pool.available_size)

        @staticmethod
        def _slots(idx) -> list:
            return idx.tolist() if hasattr(idx, "tolist") else list(idx)

        def alloc(self, need_size: int):
            try:
                slots = self.pool.alloc(int(need_size))
            except AllocatorError:
                return None
            return torch.tensor(slots, dtype=torch.int64)

        def available_size(self) -> int:
            return min(self.pool.available_size(), self.pool.swa.available_size())

        def free(self, free_index) -> None:
            slots = self._slots(free_index)
            if slots:
                self.pool.free(slots)

        def free_swa(self, free_index) -> None:
            self.pool.free_swa(self._slots(free_index))

        def translate_loc_from_full_to_swa(self, kv_indices):
            return torch.tensor(self.pool.translate(self._slots(kv_indices)), dtype=torch.int64)

        def clear(self) -> None:
            self.pool.reset()

        def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
            # a load back pairs the full slots it took with the SWA slots it took
            full, swa = self._slots(full_indices), self._slots(swa_indices)
            self.pool.full_to_swa.update(zip(full, swa, strict=True))

    class MambaReqPool(HybridReqToTokenPool):
        """The Mamba pool model behind upstream's hybrid request pool interface."""

        def __init__(self, pool) -> None:  # no super().__init__: the state is ``pool``
            self.mamba_allocator = PoolAllocator(pool, up.torch)
            self.mamba_pool = self.mamba_allocator
            self.enable_mamba_extra_buffer = False

    _HYBRID = types.SimpleNamespace(
        up=up, server_args=server_args, SeedEraSWAComponent=SeedEraSWAComponent,
        HeldTombstoneSWAComponent=HeldTombstoneSWAComponent,
        SwaPoolAllocator=SwaPoolAllocator, MambaReqPool=MambaReqPool)
    return _HYBRID


class HybridUpstreamAdapter(UpstreamAdapter):
    """:class:`UpstreamAdapter` for ``components: ["full", "swa"]``, ``["full", "mamba"]`` and
    ``["full", "swa", "mamba"]``."""

    def __init__(self, config: CacheConfig, keep_held_tombstones: bool = False) -> None:
        self.hy = load_hybrid()
        self.keep_held_tombstones = keep_held_tombstones
        super().__init__(config)
        self._ops.update({"mamba_alloc": self._op_mamba_alloc, "mamba_free": self._op_mamba_free})

    @staticmethod
    def _check_supported(config: CacheConfig) -> None:
        reasons = []
        if config.components == ("full",):
            reasons.append("no aux component (use UpstreamAdapter)")
        if config.has_host_tier:
            reasons.append("a host tier (host_slots > 0)")
        reasons += unmodelled_settings(config, storage=False)
        if config.components == ("full", "mamba") and config.page_size != 1 \
                and not config.mamba_extra_buffer:
            reasons.append("Mamba with page_size > 1 (upstream needs the extra buffer for it)")
        if reasons:
            raise Unsupported("HybridUpstreamAdapter supports SWA or Mamba on the device tier "
                              "only, not " + ", ".join(reasons))

    def _tree_components(self) -> tuple:
        ct = self.up.ComponentType
        named = {"full": ct.FULL, "swa": ct.SWA, "mamba": ct.MAMBA}
        return tuple(named[c] for c in self.config.components)

    def _build_cache(self):
        self.pool, self.mamba = hybrid_pools(self.config)
        hy = self.hy
        ct = self.up.ComponentType
        req_pool = None
        override = None
        if "swa" in self.config.components:
            self.allocator = hy.SwaPoolAllocator(self.pool)
            override = {ct.SWA: hy.HeldTombstoneSWAComponent if self.keep_held_tombstones
                        else hy.SeedEraSWAComponent}
        else:
            self.allocator = PoolAllocator(self.pool, self.up.torch, whole_pages=self.whole_pages)
        if "mamba" in self.config.components:  # Full + Mamba, or Full + SWA + Mamba
            req_pool = self._mamba_req_pool()
            hy.server_args._global_server_args = types.SimpleNamespace(
                mamba_cache_chunk_size=self.config.mamba_cache_chunk_size,
                strip_thinking_cache=False)  # (what sglang's Req reads when it is cached)
        params = self.up.CacheInitParams(
            disable=False, req_to_token_pool=req_pool,
            token_to_kv_pool_allocator=self.allocator, page_size=self.config.page_size,
            is_eagle=False, tree_components=self._tree_components(),
            sliding_window_size=self.config.sliding_window,
            component_registry_override=override,
            eviction_policy=self.config.eviction_policy,
            enable_mamba_extra_buffer=self._mamba_extra_buffer(),
            enable_kv_cache_events=True)  # its KV-event mixin, as the Full adapter's
        return self.up.UnifiedRadixCache(params)

    #: frees of some slots of a page release the whole page (a request's partial last page, as
    #: sglang's paged allocator frees it); the tree-level API frees whole values only
    whole_pages = False

    def _mamba_req_pool(self):
        """The ``HybridReqToTokenPool`` the cache reads its Mamba allocator from (the request
        path's adapter, conformance/adapters/upstream_requests.py, builds sglang's own)."""
        return self.hy.MambaReqPool(self.mamba)

    def _mamba_extra_buffer(self) -> bool:
        """Whether to tell upstream the Mamba extra buffer is on: the config's
        ``mamba_extra_buffer``, or to lift the page-size-1 check.  The flag only changes its
        request path, which this adapter does not drive; in the tree it lifts the check
        (Full+SWA+Mamba and the host tier adapter, conformance/adapters/upstream_host_aux.py,
        drive Mamba at page 4 with it)."""
        return (len(self.config.components) == 3 and self.config.page_size > 1) \
            or self.config.mamba_extra_buffer

    # -- effects -------------------------------------------------------------------------------
    def _swa_kv(self) -> HybridKVPool:
        """The KV pool of an SWA config: hybrid_pools (spec/world.py) builds a HybridKVPool."""
        if not isinstance(self.pool, HybridKVPool):
            raise TypeError(f"components {self.config.components} have no SWA pool")
        return self.pool

    def _aux_pools(self) -> list:
        out = []
        if "swa" in self.config.components:
            out.append(("swa_freed", self._swa_kv().swa))
        if "mamba" in self.config.components:
            out.append(("mamba_freed", self.mamba))
        return out

    def apply(self, step: dict) -> dict:
        for _, p in self._aux_pools():
            p.take_freed()
        obs = super().apply(step)
        if "error" in obs:
            for _, p in self._aux_pools():
                p.take_freed()
        return obs

    def _effects(self) -> dict:
        return {name: p.take_freed() for name, p in self._aux_pools()}

    def _cd(self, node, name: str):
        ct = self.up.ComponentType
        return node.component_data[ct.SWA if name == "swa" else ct.MAMBA]

    @property
    def _aux_names(self) -> tuple:
        return tuple(c for c in self.config.components if c != "full")

    @property
    def _aux(self) -> str:
        """The one aux component of a host-tier config (conformance/adapters/upstream_host_aux.py)."""
        return "swa" if "swa" in self.config.components else "mamba"

    # -- ops -----------------------------------------------------------------------------------
    def _op_alloc(self, step: dict, args: dict) -> dict:
        slots = self.pool.alloc(_count(args.get("n"), "n"))
        if "swa" in self.config.components:
            return {"slots": slots, "swa_slots": list(self._swa_kv().translate(slots))}
        return {"slots": slots}

    def _op_free(self, step: dict, args: dict) -> dict:
        out = super()._op_free(step, args)
        self._effects()  # the driver's own free is not a cache effect
        return out

    def _mamba_pool(self):
        if self.mamba is None:
            raise Unsupported("Mamba pool ops need the Mamba component")
        return self.mamba

    def _op_mamba_alloc(self, step: dict, args: dict) -> dict:
        pool = self._mamba_pool()
        return {"slots": pool.alloc(_count(args.get("n"), "n"))}

    def _op_mamba_free(self, step: dict, args: dict) -> dict:
        pool = self._mamba_pool()
        pool.free(_int_list(args.get("slots"), "slots"))
        pool.take_freed()
        return {}

    def _op_insert(self, step: dict, args: dict) -> dict:
        params = self._insert_params(args)
        if "mamba" in self.config.components:
            mv = _int_list(args.get("mamba_value"), "mamba_value")
            if len(mv) != 1:
                raise InvalidInput("mamba_value must be one slot")
            params.mamba_value = self._tensor(mv)
        if "swa" in self.config.components:
            params.swa_evicted_seqlen = _count(args.get("swa_evicted_seqlen", 0),
                                               "swa_evicted_seqlen")
        result = self.cache.insert(params)
        ret: dict[str, Any] = {"prefix_len": int(result.prefix_len)}
        if "mamba" in self.config.components:
            ret["mamba_exist"] = bool(result.mamba_exist)
        ret["freed"] = self.pool.take_freed()
        ret.update(self._effects())
        return ret

    def _op_match_prefix(self, step: dict, args: dict) -> dict:
        tokens = _int_list(args.get("tokens"), "tokens")
        extra = args.get("extra_key")
        if extra is not None and not isinstance(extra, str):
            raise InvalidInput("extra_key must be null or a string")
        cow, req = self._cow_request(args)
        result = self.cache.match_prefix(self.up.MatchPrefixParams(
            key=self._key(tokens, extra), cow_mamba=cow, req=req))
        ret: dict[str, Any] = {
            "device_indices": [int(v) for v in result.device_indices.tolist()],
            "host_hit_length": int(result.host_hit_length),
            "last_device_node": self._depth(result.last_device_node),
            "last_host_node": self._depth(result.last_host_node),
            "best_match_node": self._depth(result.best_match_node),
        }
        if "mamba" in self.config.components:
            b = result.mamba_branching_seqlen
            ret["mamba_branching_seqlen"] = None if b is None else int(b)
        if self.config.has_host_tier:  # the aux part of the host hit (TRACE.md)
            for aux in self._aux_names:
                name = f"{aux}_host_hit_length"
                ret[name] = int(getattr(result, name))
        if cow:  # Mamba copy-on-write (docs/TRACE.md): what the request got, and the effects
            src, dst = req.mamba_cow_src_index, req.mamba_pool_idx
            ret["mamba_cow_src"] = None if src is None else int(src.reshape(-1)[0])
            ret["mamba_pool_idx"] = None if dst is None else int(dst)
            ret["freed"] = self.pool.take_freed()
            ret.update(self._effects())
        return ret

    def _cow_request(self, args: dict) -> tuple:
        """``cow_mamba`` / ``mamba_slot`` of a match, checked as the spec checks them
        (spec/mamba_cow.py), and the request object upstream fills in."""
        cow, slot = args.get("cow_mamba", False), args.get("mamba_slot")
        if not isinstance(cow, bool):
            raise InvalidInput(f"cow_mamba must be true or false, got {cow!r}")
        if not cow:
            if slot is not None:
                raise InvalidInput("match_prefix: mamba_slot goes with cow_mamba")
            return False, None
        if "mamba" not in self.config.components:
            raise InvalidInput("match_prefix: cow_mamba needs the Mamba component")
        req = types.SimpleNamespace(
            mamba_pool_idx=None if slot is None else self._request_slot(slot, "match_prefix"),
            mamba_cow_src_index=None, mamba_needs_clear=True, session=None)
        return True, req

    def _request_slot(self, slot: Any, op: str) -> Any:
        """A step's ``mamba_slot`` (the requester's own state slot) as the request's
        ``mamba_pool_idx``, checked as the spec checks it: an allocated slot, not the tree's."""
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise InvalidInput(f"{op}: mamba_slot must be null or an int, got {slot!r}")
        if not self.mamba.is_allocated(slot):
            raise InvalidInput(f"{op}: mamba_slot {slot} is not allocated")
        held = {int(v) for n in self._walk_nodes() if n is not self.root
                for v in ([] if self._cd(n, "mamba").value is None
                          else self._cd(n, "mamba").value.tolist())}
        if slot in held:
            raise InvalidInput(f"{op}: mamba_slot {slot} is the tree's")
        torch = self.up.torch
        return torch.tensor(slot, dtype=torch.int64)

    def _op_evict(self, step: dict, args: dict) -> dict:
        n = _count(args.get("num_tokens", 0), "num_tokens")
        kw = {"num_tokens": n}
        if "swa" in self.config.components:
            kw["swa_num_tokens"] = _count(args.get("swa_num_tokens", 0), "swa_num_tokens")
        if "mamba" in self.config.components:
            kw["mamba_num"] = _count(args.get("mamba_num", 0), "mamba_num")
        result = self.cache.evict(self.up.EvictParams(**kw))
        ret: dict[str, Any] = {"num_tokens_evicted": int(result.num_tokens_evicted)}
        if "swa" in self.config.components:
            ret["swa_num_tokens_evicted"] = int(result.swa_num_tokens_evicted)
        if "mamba" in self.config.components:
            ret["mamba_num_evicted"] = int(result.mamba_num_evicted)
        ret["freed"] = self.pool.take_freed()
        ret.update(self._effects())
        return ret

    def _sizes(self) -> dict:
        out = super()._sizes()
        if "swa" in self.config.components:
            out["swa_evictable"] = int(self.cache.swa_evictable_size())
            out["swa_protected"] = int(self.cache.swa_protected_size())
        if "mamba" in self.config.components:
            out["mamba_evictable"] = int(self.cache.mamba_evictable_size())
            out["mamba_protected"] = int(self.cache.mamba_protected_size())
        return out

    def _op_reset(self, step: dict, args: dict) -> dict:
        out = super()._op_reset(step, args)
        if self.mamba is not None:
            self.mamba.reset()
        return out

    # -- snapshot ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        snap = super().snapshot()
        for name in self._aux_names:
            self._aux_snapshot(snap, name)
        return snap

    def _aux_snapshot(self, snap: dict, name: str) -> None:
        by_path = {}
        for node in self._walk_nodes():
            if node is self.root:
                continue
            extra, tokens = self._path_of(node)
            cd = self._cd(node, name)
            by_path[(extra, tuple(tokens))] = {
                "value": None if cd.value is None else [int(v) for v in cd.value.tolist()],
                "lock_ref": int(cd.lock_ref)}
        for n in snap["nodes"]:
            n[name] = by_path[(n["path"]["extra_key"], tuple(n["path"]["tokens"]))]
        ct = self.up.ComponentType
        lru = self.cache.lru_lists[ct.SWA if name == "swa" else ct.MAMBA]
        order = []
        x = lru.tail.lru_prev[lru._pt]
        while x is not lru.head:
            extra, tokens = self._path_of(x)
            order.append({"tokens": tokens, "extra_key": extra})
            x = x.lru_prev[lru._pt]
        snap[f"{name}_lru_order"] = order
        if name == "swa":
            snap["swa_pool"] = sorted(self._swa_kv().swa.allocated_pages())
        else:
            snap["mamba_pool"] = sorted(self.mamba.allocated_pages())


def upstream_keeping_held_tombstones(config: CacheConfig) -> HybridUpstreamAdapter:
    """Upstream with the spec's rule for an SWA tombstone a lock holds (issue 18), for lockstep
    runs that compare everything else: the plain ``upstream`` adapter reaches that known
    difference within a few thousand SWA steps."""
    return HybridUpstreamAdapter(config, keep_held_tombstones=True)


upstream_keeping_held_tombstones.impl_name = "upstream"  # type: ignore[attr-defined]
