"""``HybridFastAdapter``: trace steps on ``uniradix.fast.UnifiedRadixCache`` built for a hybrid
model (Full plus SWA and/or Mamba; fast/hybrid.py), over the spec's environment models
(spec/world.py: the SWA allocator's ``HybridKVPool`` and the Mamba pool) behind SGLang's
allocator interfaces.  Observations and snapshots have the spec's shape (spec/snapshot.py), the
aux LRU order being the fast path's real list.

The request path (``req_*`` ops) is the scheduler of spec/requests.py around fast's own
``cache_unfinished_req`` / ``cache_finished_req``: with SWA a room shortfall evicts the Full and
the SWA shortfall in one call, and before each decode step the request's own positions more
than a window and a page behind drop their SWA slots (``req.swa_evicted_seqlen``, which the
finishing insert reads); with Mamba a request takes a state slot at admission
(``req.mamba_pool_idx``; one state evicted when the pool is empty, and it waits holding nothing
when still none), which the cache hands to the tree or frees.  A streaming session's request
(conformance/adapters/session_ops.py) goes through the same calls: its finish parks its row,
window start and state slot in the session's slot (fast/sessions.py) and the next turn's
admission restores them, taking no new state slot."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from uniradix import fast
from uniradix.conformance.adapters.base import args_of, aux_effects, check_cow_args, check_supported
from uniradix.conformance.adapters.fast_adapter import FastAdapter, ReqToTokenPool, ints, priority_arg
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.sessions import VirtualNode
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import AllocatorError, InvalidInput, Unsupported
from uniradix.spec.requests import decode_track_lens, extend_track_len, next_track_after
from uniradix.spec.world import HybridKVPool, PagedPool, hybrid_pools


class SwaPoolAllocator(PoolAllocator):
    """SGLang's SWA allocator interface over a ``HybridKVPool``: ``free`` releases full and
    mapped SWA slots, ``free_swa`` only the SWA ones, ``translate_loc_from_full_to_swa`` maps."""

    def _kv(self) -> HybridKVPool:
        if not isinstance(self.pool, HybridKVPool):
            raise TypeError("SwaPoolAllocator needs a HybridKVPool (spec/world.py)")
        return self.pool

    def free_swa(self, free_index) -> None:
        self._kv().free_swa(free_index.tolist())

    def translate_loc_from_full_to_swa(self, kv_indices) -> torch.Tensor:
        return torch.tensor(self._kv().translate(kv_indices.tolist()), dtype=torch.int64,
                            device="cpu")

    # the sides apart, as SGLang's SWATokenToKVPoolAllocator has them (a host tier's load back
    # takes full and SWA slots apart and pairs them itself)
    @property
    def full_attn_allocator(self) -> PoolAllocator:
        return FullSideAllocator(self._kv(), torch)

    @property
    def swa_attn_allocator(self) -> PoolAllocator:
        return PoolAllocator(self._kv().swa, torch)

    def set_full_to_swa_mapping(self, full_indices, swa_indices) -> None:
        self._kv().full_to_swa.update(zip(full_indices.tolist(), swa_indices.tolist(),
                                          strict=True))


class FullSideAllocator(PoolAllocator):
    """The full side of a ``HybridKVPool`` alone: ``alloc`` takes full slots without SWA
    slots (a load back maps them itself); ``free`` releases them (and any mapped SWA slot)."""

    def alloc(self, need_size: int):
        try:
            slots = PagedPool.alloc(self.pool, int(need_size))
        except AllocatorError:
            return None
        return torch.tensor(slots, dtype=torch.int64, device="cpu")


class MambaReqPool(ReqToTokenPool):
    def __init__(self, mamba_pool) -> None:
        super().__init__()
        # the state pool behind SGLang's ``mamba_allocator`` interface
        self.mamba_allocator = PoolAllocator(mamba_pool, torch)
        self.mamba_pool = self.mamba_allocator


class HybridFastAdapter(FastAdapter):
    """Runs trace steps on the fast path's hybrid cache."""

    hybrid_requests = True  # the request path with SWA and Mamba (module docstring)

    def __init__(self, config: CacheConfig,  # no super().__init__: other pools
                 slot_ledger: bool = True) -> None:
        check_supported(config, hybrid=True, host_tier=True, host_aux=True)
        self._set_ledger(slot_ledger)
        self.config = config
        self.pool, self.mamba = hybrid_pools(config)
        self.aux_pools = tuple(p for p in (getattr(self.pool, "swa", None), self.mamba)
                               if p is not None)
        swa = "swa" in config.components
        # (whole pages: a request's partial last page goes back whole, as SGLang's paged
        # allocator frees it; FastAdapter's allocator does the same)
        self.alloc = (SwaPoolAllocator if swa else PoolAllocator)(self.pool, torch,
                                                                  whole_pages=True)
        self.rtt = ReqToTokenPool() if self.mamba is None else MambaReqPool(self.mamba)
        comps = tuple(config.components)  # the fast cache refuses a set it does not model
        hicache = None
        if config.has_host_tier:  # the host tier (conformance/adapters/host_ops.py)
            self.host_pool = PagedPool(config.host_slots, config.page_size, "host")
            hicache = self.hicache_config(config, PoolAllocator(self.host_pool, torch),
                                          log_copies=True)
            if self.mamba is not None:  # the host state pool (the spec's default size)
                n = config.host_mamba_slots if config.host_mamba_slots is not None \
                    else 2 * config.mamba_slots
                self.host_mamba_pool = PagedPool(n, 1, "host_mamba")
                hicache.host_mamba_allocator = PoolAllocator(self.host_mamba_pool, torch)
            if swa:  # the SWA host pool (the spec's default size: host_slots)
                n = config.host_swa_slots if config.host_swa_slots is not None \
                    else config.host_slots
                self.host_swa_pool = PagedPool(n, config.page_size, "host_swa")
                hicache.host_swa_allocator = PoolAllocator(self.host_swa_pool, torch)
        self.params = fast.CacheInitParams(
            disable=config.disable, req_to_token_pool=self.rtt,
            token_to_kv_pool_allocator=self.alloc, page_size=config.page_size,
            is_eagle=config.eagle, tree_components=comps,
            sliding_window_size=config.sliding_window,
            mamba_cache_chunk_size=config.mamba_cache_chunk_size,
            eviction_policy=config.eviction_policy, hicache=hicache,
            enable_mamba_extra_buffer=config.mamba_extra_buffer,
            enable_mamba_extra_buffer_lazy=config.mamba_extra_buffer_lazy,
            validate_slots=None if self.checks_slots else False)
        self.cache = fast.UnifiedRadixCache(self.params)
        self.handles: dict[int, tuple] = {}
        self.host_handles: dict[int, tuple] = {}
        self.requests: dict = {}

    def _effects(self) -> dict:
        return aux_effects(self.config, self.pool, self.mamba)

    def snapshot(self) -> dict[str, Any]:
        snap = FastAdapter.snapshot(self)
        paths = {}
        for node in self.cache.all_nodes():
            if node is self.cache.root_node:
                continue
            p = self._path(node)
            paths[(p["extra_key"], tuple(p["tokens"]))] = node
        for n in snap["nodes"]:
            node = paths[(n["path"]["extra_key"], tuple(n["path"]["tokens"]))]
            for comp in self.cache.components:
                rec = node.aux[comp.i]
                n[comp.name] = {"value": None if rec.value is None else rec.value.tolist(),
                                "lock_ref": rec.lock}
        snap["sizes"] = self.op_sizes({"op": "sizes", "args": {}})
        for comp in self.cache.components:
            snap[f"{comp.name}_lru_order"] = [self._path(n) for n in self.cache.lru_order(comp.name)]
        if self.cache.swa is not None:
            snap["swa_pool"] = sorted(self.pool.swa.allocated_pages())
        if self.cache.mamba is not None:
            snap["mamba_pool"] = sorted(self._mamba_pool().allocated_pages())
        if self.config.has_host_tier:
            self._aux_host_view(snap["host"])
        return snap

    def _aux_host_view(self, host: dict) -> None:
        """The aux components' host parts go into the host view, as the spec's host_view
        puts them: each node's aux host copies and host locks (a node with only those is
        listed too), and per component its host pool and host LRU order."""
        cache = self.cache
        nodes = []
        for node in cache.all_nodes():
            if node is cache.root_node or not (
                    node.host_value is not None or node.host_lock_ref
                    or any(r.host_value is not None or r.host_lock for r in node.aux)):
                continue
            entry = {"path": self._path(node), "host_value": None if node.host_value is None
                     else node.host_value.tolist(), "host_lock_ref": node.host_lock_ref}
            for comp in cache.components:
                rec = node.aux[comp.i]
                entry[comp.name] = {"host_value": None if rec.host_value is None
                                    else rec.host_value.tolist(), "host_lock_ref": rec.host_lock}
            nodes.append(entry)
        nodes.sort(key=lambda n: (n["path"]["extra_key"] is not None,
                                  n["path"]["extra_key"] or "", n["path"]["tokens"]))
        host["nodes"] = nodes
        for comp in cache.components:
            pool = self.host_swa_pool if comp.name == "swa" else self.host_mamba_pool
            assert pool is not None
            host[f"{comp.name}_pool"] = sorted(pool.allocated_pages())
            host[f"{comp.name}_host_lru_order"] = [self._path(rec.node) for rec in comp.host_lru]

    def take_state_copies(self) -> list:
        """The Mamba state copies of the last step, in order (for the KV-integrity check)."""
        if not self.config.has_host_tier:
            return []
        return self.cache.cache_controller.take_state_copies()

    def take_swa_copies(self) -> list:
        """The SWA data copies of the last step, in order (for the KV-integrity check)."""
        if not self.config.has_host_tier:
            return []
        return self.cache.cache_controller.take_swa_copies()

    # -- host ops with SWA or Mamba ---------------------------------------------------------------
    def op_load_back(self, step: dict) -> dict:
        cc = self.cache.cache_controller if self.config.has_host_tier else None
        copies = len(cc.state_copies or ()) if cc is not None else 0
        swa_copies = len(cc.swa_copies or ()) if cc is not None else 0
        obs = super().op_load_back(step)
        if self.cache.swa is not None:  # the SWA slots it gave (TRACE.md)
            obs["swa_device_indices"] = [
                s for kind, _, dst in self.cache.cache_controller.swa_copies[swa_copies:]
                if kind == "load" for s in dst]
            if self.cache.mamba is None:
                obs.update(self._effects())
        if self.cache.mamba is not None:  # the state slots it took (TRACE.md)
            # the request's slot as SGLang's scheduler reads it: ``req.mamba_pool_idx``
            idx = self.load_req.mamba_pool_idx
            req_slot = None if idx is None else int(idx)
            obs["mamba_device_indices"] = [
                s for kind, _, dst in self.cache.cache_controller.state_copies[copies:]
                if kind == "load" and dst != [req_slot] for s in dst]
            obs["mamba_pool_idx"] = req_slot
            obs.update(self._effects())
        return obs

    def op_check_hicache_events(self, step: dict) -> dict:
        obs = super().op_check_hicache_events(step)
        if self.cache.components:
            obs.update(self._effects())
        return obs

    # -- the request path with SWA / Mamba (spec/requests.py's scheduler) ------------------------
    def op_req_arrive(self, step: dict) -> dict:
        if self.config.eagle and self.config.components != ("full",):
            raise Unsupported("req_arrive: the request model with SWA or Mamba takes no EAGLE "
                              "keys")
        out = super().op_req_arrive(step)
        rid = step["args"]["rid"]
        req = self.requests[rid]
        req.swa_evicted_seqlen = 0  # where its own SWA data starts (page-aligned)
        req.mamba_pool_idx = None  # its own Mamba state slot, from admission
        # the extra buffer (spec/requests.py): track slots, next one, last track length
        req.mamba_ping_pong_track_buffer = req.mamba_next_track_idx = None
        req.mamba_last_track_seqlen = req.mamba_branching_seqlen = None
        req.mamba_lazy_is_insert = True  # lazy: false once a track point finds no fresh slot
        return out

    def _request_view(self, req: Any) -> dict[str, Any]:
        out = super()._request_view(req)
        if "swa" in self.config.components:
            out["swa_evicted_seqlen"] = req.swa_evicted_seqlen
        if "mamba" in self.config.components:
            idx = req.mamba_pool_idx
            out["mamba_slot"] = None if idx is None else int(idx.reshape(-1)[0])
        if self.config.mamba_extra_buffer:  # (spec/snapshot.py request_view)
            buf = req.mamba_ping_pong_track_buffer
            out["mamba_track"] = None if buf is None else [int(s) for s in buf.tolist()]
            out["mamba_next_track"] = req.mamba_next_track_idx or 0
            if self.config.mamba_extra_buffer_lazy:  # the held slot only (the spec's list)
                out["mamba_track"] = None if buf is None else \
                    [s for s in out["mamba_track"] if s != -1]
                out["mamba_next_track"] = 0
            out["mamba_track_len"] = req.mamba_last_track_seqlen
            out["mamba_branching"] = req.mamba_branching_seqlen if req.admitted else None
        if self.config.mamba_extra_buffer_lazy:
            out["mamba_track_overwritten"] = not req.mamba_lazy_is_insert
        return out

    def _req_effects(self, obs: dict) -> dict:
        """A request step's pool effects with an aux component (TRACE.md): ``freed`` and
        ``swa_freed`` / ``mamba_freed``."""
        if "freed" not in obs:
            obs["freed"] = self.pool.take_freed()
        obs.update(self._effects())
        return obs

    def op_req_admit(self, step: dict) -> dict:
        obs = super().op_req_admit(step)
        if self.mamba is None:
            return self._req_effects(obs)
        req = self.requests[step["args"]["rid"]]
        restored = req.admitted and req.last_node.__class__ is VirtualNode
        if req.admitted and not restored and self.config.mamba_extra_buffer:
            self._admit_states(req, obs)
        elif req.admitted and not restored and req.mamba_pool_idx is None:  # the request's
            # own state slot (one a load back gave it is kept, as sglang's alloc keeps it; a
            # restored one: the session's, from its slot, fast/sessions.py)
            if self.mamba.available_size() == 0:
                self.cache.evict(fast.EvictParams(num_tokens=0, mamba_num=1))
            if self.mamba.available_size() == 0:  # every state is locked: it waits
                self.cache.dec_lock_ref(req.last_node, req.dec_lock_params)
                self._release_row(req)
                obs["prefix_len"] = 0
            else:
                req.mamba_pool_idx = torch.tensor(self.mamba.alloc(1), dtype=torch.int64)
        obs["mamba_pool_idx"] = (None if req.mamba_pool_idx is None
                                 else int(req.mamba_pool_idx.reshape(-1)[0]))
        return self._req_effects(obs)

    def _admit_states(self, req: Any, obs: dict) -> None:
        """Extra buffer, admission: the request's own state slot and its track slots, the
        states the pool is short of evicted in one call first; it waits holding nothing when
        still short (spec/requests.py ``new_state_slots``)."""
        assert self.mamba is not None
        lazy = self.config.mamba_extra_buffer_lazy  # one track slot (upstream's two positions,
        k = 2 if lazy else 1 + self.config.mamba_track_slots  # the second empty: -1)
        own = req.mamba_pool_idx  # kept from a load back of its host hit (sglang's alloc keeps it)
        if own is not None:
            k -= 1
        short = k - self.mamba.available_size()
        if short > 0:
            self.cache.evict(fast.EvictParams(num_tokens=0, mamba_num=short))
        if self.mamba.available_size() < k:
            self.cache.dec_lock_ref(req.last_node, req.dec_lock_params)
            self._release_row(req)
            req.mamba_branching_seqlen = None
            obs["prefix_len"] = 0
            return
        if own is None:
            req.mamba_pool_idx = torch.tensor(self.mamba.alloc(1), dtype=torch.int64)
            k -= 1
        req.mamba_ping_pong_track_buffer = torch.tensor(
            self.mamba.alloc(k) + ([-1] if lazy else []), dtype=torch.int64)
        req.mamba_next_track_idx = 0

    def _track(self, req: Any, lengths: list[int]) -> None:
        """Extra buffer: the request's track points in this step, in order."""
        if req.mamba_ping_pong_track_buffer is None:
            return
        if self.config.mamba_extra_buffer_lazy:
            self._lazy_track(req, lengths)
            return
        for at in lengths:
            req.mamba_last_track_seqlen = at
            req.mamba_next_track_idx = next_track_after(
                req.mamba_next_track_idx, len(req.mamba_ping_pong_track_buffer))

    def _lazy_track(self, req: Any, lengths: list[int]) -> None:
        """Lazy extra buffer: a prefill chunk's track point writes the only track slot in
        place; each decode track point takes a fresh slot (fast/components/mamba.py
        ``lazy_track_point``).  The request finishes without caching when its last decode step
        was a track point that found none (upstream's ``mamba_lazy_is_insert``)."""
        if self._chunk_track is not None:
            for at in lengths:
                req.mamba_last_track_seqlen = at
            return
        assert self.cache.mamba is not None
        req.mamba_lazy_is_insert = True
        end = req.committed + self._decode_n
        for at in lengths:
            if not self.cache.mamba.lazy_track_point(req, at) and at == end:
                req.mamba_lazy_is_insert = False

    _decode_n = 0  # the decode step's n (for _lazy_track)

    def _release_row(self, req: Any) -> None:
        """Undo an admission that cannot take a state slot: the request holds nothing."""
        self.rtt.free_rows.append(req.req_pool_idx)
        self.rtt.free_rows.sort()
        req.req_pool_idx = -1
        req.committed = req.row_len = req.cache_protected_len = 0
        req.last_node = req.dec_lock_params = None
        req.admitted = False

    def _make_room(self, need: int) -> int:
        if "swa" not in self.config.components:
            return super()._make_room(need)
        # SWA slots come with the full ones: evict both shortfalls in one call
        short = need - self.pool.available_size()
        swa_short = need - self.pool.swa.available_size()
        if short <= 0 and swa_short <= 0:
            return 0
        return self.cache.evict(fast.EvictParams(
            num_tokens=max(short, 0), swa_num_tokens=max(swa_short, 0))).num_tokens_evicted

    def _slide_window(self, req: Any) -> None:
        """SWA, before a decode step: the request's own positions more than one window and one
        page behind its computed length drop their SWA slots (spec/requests.py
        ``evict_swa_window``)."""
        if "swa" not in self.config.components or self.config.disable:
            return
        ps = self.config.page_size
        window = self.config.sliding_window
        assert window is not None  # CacheConfig.validate: SWA needs one
        req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, req.cache_protected_len)
        new = max(req.swa_evicted_seqlen, req.committed - window - ps) // ps * ps
        if new > req.swa_evicted_seqlen:
            row = self.rtt.req_to_token[req.req_pool_idx, req.swa_evicted_seqlen: new]
            self.pool.free_swa(row.tolist())
            req.swa_evicted_seqlen = new

    def op_req_chunk(self, step: dict) -> dict:
        if self.config.mamba_extra_buffer:  # the track point comes before the cache
            self._chunk_track = step
        try:
            return self._req_effects(super().op_req_chunk(step))
        finally:
            self._chunk_track = None

    _chunk_track: dict | None = None
    _decode_track = False

    def _commit(self, req: Any, n: int) -> None:
        """``n`` more tokens computed; with the extra buffer a prefill chunk's track point
        first (a decode step's: op_req_decode)."""
        if self._chunk_track is not None:
            at = extend_track_len(req.committed, n, self.config.mamba_cache_chunk_size,
                                  req.mamba_branching_seqlen)
            self._track(req, [] if at is None else [at])
        elif self._decode_track:
            self._decode_n = n
            self._track(req, decode_track_lens(req.committed, n,
                                               self.config.mamba_track_interval))
        super()._commit(req, n)

    def _before_decode(self, req: Any) -> None:
        self._slide_window(req)

    def op_req_decode(self, step: dict) -> dict:
        # the Full adapter's decode, the window slid first (_before_decode); its obs already
        # has ``freed`` (the window's full slots stay, so only the SWA log holds the slide's
        # frees), which _req_effects keeps, adding swa_freed / mamba_freed; with the extra
        # buffer a decode step's track points come before its commit (_commit)
        self._decode_track = bool(self.config.mamba_extra_buffer)
        try:
            return self._req_effects(super().op_req_decode(step))
        finally:
            self._decode_track = False

    def op_req_finish(self, step: dict) -> dict:
        args = step.get("args")
        rid = args.get("rid") if isinstance(args, dict) else None
        req = self.requests.get(rid) if isinstance(rid, str) else None
        if req is not None and req.admitted and not getattr(req, "mamba_lazy_is_insert", True):
            # lazy: its last decode step's state went over the only track slot; upstream
            # releases it with is_insert=False (spec/requests.py finish_inserts)
            return self._req_effects(super().op_req_abort(step))
        return self._req_effects(super().op_req_finish(step))

    def op_req_abort(self, step: dict) -> dict:
        rid = (step.get("args") or {}).get("rid")
        req = self.requests.get(rid) if isinstance(rid, str) else None
        obs = super().op_req_abort(step)
        if req is not None and not req.admitted and req.mamba_pool_idx is not None:
            # a waiting request's state slot from a load back: sglang's release_kv_cache of a
            # request without a row frees it
            assert self.mamba is not None
            self.mamba.free([int(req.mamba_pool_idx.reshape(-1)[0])])
            req.mamba_pool_idx = None
        return self._req_effects(obs)

    # -- ops -------------------------------------------------------------------------------------
    def op_alloc(self, step: dict) -> dict:
        (n,) = args_of(step, "n")
        slots = self.pool.alloc(n)
        if "swa" in self.config.components:
            return {"slots": slots, "swa_slots": list(self.pool.translate(slots))}
        return {"slots": slots}

    def swa_slots_of(self, slots: list[int]) -> list[int]:
        """The SWA slot each full slot maps to now (0: none), for the KV check
        (conformance/env/kvcheck.py)."""
        if not isinstance(self.pool, HybridKVPool):
            raise Unsupported("SWA slots need the SWA component")
        return list(self.pool.translate(slots))

    def _mamba_pool(self) -> PagedPool:
        if self.mamba is None:
            raise Unsupported("Mamba pool ops need the Mamba component")
        return self.mamba

    def op_mamba_alloc(self, step: dict) -> dict:
        pool = self._mamba_pool()
        (n,) = args_of(step, "n")
        return {"slots": pool.alloc(n)}

    def op_mamba_free(self, step: dict) -> dict:
        pool = self._mamba_pool()
        (slots,) = args_of(step, "slots")
        slots = list(ints("slots", slots))
        i = self.cache.mamba.i
        held = {int(n.aux[i].value[0]) for n in self.cache.all_nodes() if n.aux[i].value is not None}
        if held.intersection(slots):
            raise InvalidInput(f"mamba_free: slots {sorted(held.intersection(slots))} are the tree's")
        pool.free(slots)
        return {}

    def op_insert(self, step: dict) -> dict:
        tokens, value, extra_key, prev, chunked, mamba_value, swa_evicted_seqlen, priority = \
            args_of(step, "tokens", "value", extra_key=None, prev_prefix_len=0, chunked=False,
                    mamba_value=None, swa_evicted_seqlen=0, priority=0)
        key = self._key(tokens, extra_key)
        v = torch.frombuffer(bytearray(ints("value", value)), dtype=torch.int64) if len(value) \
            else torch.empty((0,), dtype=torch.int64)
        mv = None
        if mamba_value is not None:
            mv = torch.tensor(list(ints("mamba_value", mamba_value)), dtype=torch.int64)
        res = self.cache.insert(fast.InsertParams(
            key=key, value=v, prev_prefix_len=prev, chunked=chunked, mamba_value=mv,
            swa_evicted_seqlen=swa_evicted_seqlen, priority=priority_arg("insert", priority)))
        ret = {"prefix_len": res.prefix_len, "freed": self.pool.take_freed()}
        if "mamba" in self.config.components:
            ret["mamba_exist"] = res.mamba_exist
        ret.update(self._effects())
        return ret

    def op_match_prefix(self, step: dict) -> dict:
        tokens, extra_key, cow, mamba_slot = args_of(step, "tokens", extra_key=None,
                                                     cow_mamba=False, mamba_slot=None)
        req = None
        if check_cow_args(self.config, cow, mamba_slot, modelled=True):
            req = self._cow_request(mamba_slot)
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=self._key(tokens, extra_key),
                                                           cow_mamba=cow, req=req))
        ret = {"device_indices": m.device_indices.tolist(),
               "host_hit_length": m.host_hit_length,
               "last_device_node": self._units_len(m.last_device_node),
               "last_host_node": self._units_len(m.last_host_node),
               "best_match_node": self._units_len(m.best_match_node)}
        if "swa" in self.config.components and self.config.has_host_tier:
            ret["swa_host_hit_length"] = m.swa_host_hit_length
        if "mamba" in self.config.components:
            ret["mamba_branching_seqlen"] = m.mamba_branching_seqlen
            if self.config.has_host_tier:
                ret["mamba_host_hit_length"] = m.mamba_host_hit_length
        if req is not None:  # Mamba copy-on-write (TRACE.md): what the request got, the effects
            src, dst = req.mamba_cow_src_index, req.mamba_pool_idx
            ret["mamba_cow_src"] = None if src is None else int(src.reshape(-1)[0])
            ret["mamba_pool_idx"] = None if dst is None else int(dst)
            ret["freed"] = self.pool.take_freed()
            ret.update(self._effects())
        return ret

    @staticmethod
    def _cow_request(mamba_slot: Any) -> SimpleNamespace:
        """The request of a ``cow_mamba`` match, as the scheduler hands it over: its state slot
        (``mamba_slot``; None: it has none), filled in by the match."""
        if mamba_slot is not None and (isinstance(mamba_slot, bool)
                                       or not isinstance(mamba_slot, int)):
            raise InvalidInput(f"match_prefix: mamba_slot must be null or an int, got {mamba_slot!r}")
        idx = None if mamba_slot is None else torch.tensor(mamba_slot, dtype=torch.int64)
        return SimpleNamespace(mamba_pool_idx=idx, mamba_cow_src_index=None,
                               mamba_needs_clear=True)

    def op_evict(self, step: dict) -> dict:
        n, swa_n, mamba_n = args_of(step, "num_tokens", swa_num_tokens=0, mamba_num=0)
        res = self.cache.evict(fast.EvictParams(num_tokens=n, swa_num_tokens=swa_n,
                                                mamba_num=mamba_n))
        ret = {"num_tokens_evicted": res.num_tokens_evicted}
        if "swa" in self.config.components:
            ret["swa_num_tokens_evicted"] = res.swa_num_tokens_evicted
        if "mamba" in self.config.components:
            ret["mamba_num_evicted"] = res.mamba_num_evicted
        ret["freed"] = self.pool.take_freed()
        ret.update(self._effects())
        return ret

    def op_sizes(self, step: dict) -> dict:
        args_of(step)
        c = self.cache
        out = {"full_evictable": c.full_evictable_size(), "full_protected": c.full_protected_size()}
        if "swa" in self.config.components:
            out.update(swa_evictable=c.swa_evictable_size(), swa_protected=c.swa_protected_size())
        if "mamba" in self.config.components:
            out.update(mamba_evictable=c.mamba_evictable_size(),
                       mamba_protected=c.mamba_protected_size())
        return out

    def op_reset(self, step: dict) -> dict:
        args_of(step)
        self.cache.reset()
        self.pool.reset()
        if self.mamba is not None:
            self.mamba.reset()
        self.handles.clear()
        self.host_handles.clear()
        self.requests.clear()  # (the reset drops every request, as the spec's does)
        ReqToTokenPool.__init__(self.rtt)  # fresh rows; a Mamba pool keeps its allocator
        return {}
