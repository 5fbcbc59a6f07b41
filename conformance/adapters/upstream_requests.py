"""``UpstreamRequestAdapter``: sglang 0.5.13.post1's ``UnifiedRadixCache`` driven through its
request path, streaming sessions included (docs/TRACE.md request-level ops, "Streaming
sessions").

The tree-level adapter (conformance/adapters/upstream.py) drives ``insert`` / ``match_prefix``
directly.  This one adds the request-level ops the way SGLang's scheduler runs a request, with
sglang's own ``Req`` (``schedule_batch.Req``) and the ``StreamingSession`` embedded in the
cache: admission through ``Req.init_next_round_input`` (a session's next turn is restored from
its slot there) and a lock on the match; prefill chunks and decode steps reserving whole pages
(evicting first when the pool is short) and writing the computed positions into the request's
req_to_token row; ``cache_unfinished_req`` after a prefill chunk, ``cache_finished_req`` at the
end (an abort: with ``FINISH_ABORT`` for a session request, as the scheduler marks one, which
ends the session; ``is_insert=False`` otherwise); ``release_session`` and the
``session_held_*`` counters.

The scheduler's own rules the spec checks at a session request's arrival (one request per
session at a time; the slot's ``extra_key``; the tokens continue the parked ones) live in
SGLang's session controller, not in the cache; this adapter checks them before the cache sees
anything, as fast's adapter does (conformance/adapters/session_ops.py).  Full component, device
tier, page sizes of the request model; EAGLE and the disabled cache are not driven.
"""

from __future__ import annotations

import types
from array import array
from typing import Any

from uniradix.conformance.adapters.fast_adapter import ReqToTokenPool
from uniradix.conformance.adapters.session_ops import check_session_arg
from uniradix.conformance.adapters.upstream import UpstreamAdapter
from uniradix.conformance.adapters.upstream_host import UpstreamHostAdapter
from uniradix.conformance.adapters.upstream_host_aux import HostAuxUpstreamAdapter
from uniradix.conformance.adapters.upstream_hybrid import HybridUpstreamAdapter
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import InvalidInput, Unsupported
from uniradix.spec.requests import decode_track_lens, extend_track_len, output_token_id

# a request's output is produced by ``req_decode`` steps; sglang's Req only needs a bound
_MAX_NEW_TOKENS = 1 << 20


class _Running:
    """One request as the scheduler holds it: sglang's ``Req`` and the row bookkeeping."""

    def __init__(self, req: Any, session: str | None) -> None:
        self.req = req
        self.session = session
        self.admitted = False
        self.committed = 0     # positions computed (in the row)
        self.row_len = 0       # slots reserved for the row (whole pages)
        self.pending: list[int] = []  # reserved slots past the computed positions
        self.dec_params: Any = None


class UpstreamRequestAdapter(UpstreamAdapter):
    """The tree-level upstream adapter plus the request path and streaming sessions."""

    tree_only = False

    def __init__(self, config: CacheConfig) -> None:
        if config.eagle or config.disable:
            raise Unsupported("UpstreamRequestAdapter drives neither EAGLE keys nor a "
                              "disabled cache")
        # the rows (fast_adapter's ReqToTokenPool; with Mamba sglang's pool behind _Rows)
        self.rtt: Any = ReqToTokenPool()
        super().__init__(config)
        self.requests: dict[str, _Running] = {}
        # what SGLang's session controller keeps of a parked session: its tokens, extra_key
        self.parked: dict[str, tuple[list[int], str | None]] = {}
        from sglang.srt import server_args
        from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req
        from sglang.srt.sampling.sampling_params import SamplingParams
        if getattr(server_args, "_global_server_args", None) is None:
            # what sglang's Req reads of the server's arguments when a request is cached
            server_args._global_server_args = types.SimpleNamespace(strip_thinking_cache=False)
        self._Req, self._SamplingParams, self._ABORT = Req, SamplingParams, FINISH_ABORT
        self._ops.update({
            "req_arrive": self._op_req_arrive, "req_admit": self._op_req_admit,
            "req_chunk": self._op_req_chunk, "req_decode": self._op_req_decode,
            "req_finish": self._op_req_finish, "req_abort": self._op_req_abort,
            "release_session": self._op_release_session, "session_held": self._op_session_held,
        })

    def _build_cache(self):
        # a request's partial last page is freed whole, as sglang's paged allocator frees it
        self.allocator = PoolAllocator(self.pool, self.up.torch, whole_pages=True)
        cache = super()._build_cache()
        cache.req_to_token_pool = self.rtt
        return cache

    # -- helpers ---------------------------------------------------------------------------
    def _get(self, rid: Any, admitted: bool | None = None) -> _Running:
        r = self.requests.get(rid) if isinstance(rid, str) else None
        if r is None:
            raise InvalidInput(f"no request {rid!r}")
        if admitted is not None and r.admitted != admitted:
            raise InvalidInput(f"request {rid!r} is "
                               f"{'already' if r.admitted else 'not yet'} admitted")
        return r

    @staticmethod
    def _count(n: Any) -> int:
        if type(n) is not int or n < 0:
            raise InvalidInput(f"n must be a non-negative int, got {n!r}")
        return n

    def _row(self, r: _Running, start: int, end: int) -> list[int]:
        return [int(v) for v in self.rtt.req_to_token[r.req.req_pool_idx, start:end].tolist()]

    def _write(self, r: _Running, start: int, values: list[int]) -> None:
        if values:
            self.rtt.ensure(start + len(values))
            self.rtt.req_to_token[r.req.req_pool_idx, start: start + len(values)] = \
                self._tensor(values)

    def _sync(self, r: _Running) -> None:
        """sglang's Req lengths from the bookkeeping (what the scheduler keeps up to date)."""
        r.req.kv_committed_len = r.committed
        r.req.kv_allocated_len = r.row_len
        r.req.fill_len = r.committed

    def _reserve(self, r: _Running, new_tokens: int) -> tuple[bool, int]:
        """Whole pages for ``new_tokens`` more positions, evicting first when the pool is
        short (the scheduler's ``alloc_for_extend`` / ``alloc_for_decode``)."""
        ps = self.config.page_size
        need = -(-(r.committed + new_tokens) // ps) * ps - r.row_len
        if need <= 0:
            return True, 0
        short = need - self.pool.available_size()
        evicted = 0
        if short > 0:
            evicted = int(self.cache.evict(self.up.EvictParams(num_tokens=short))
                          .num_tokens_evicted)
        if need > self.pool.available_size():
            return False, evicted
        r.pending += self.pool.alloc(need)
        r.row_len += need
        return True, evicted

    def _cache_unfinished(self, r: _Running, chunked: bool) -> None:
        self.cache.cache_unfinished_req(r.req, chunked=chunked)

    def _commit(self, r: _Running, n: int) -> None:
        self._write(r, r.committed, r.pending[:n])
        r.pending = r.pending[n:]
        r.committed += n
        self._sync(r)

    def _release_row(self, r: _Running) -> None:
        del self.requests[r.req.rid]
        idx = r.req.req_pool_idx
        if idx is not None and idx >= 0:
            self.rtt.free_rows.append(idx)
        self.rtt.free_rows.sort()

    def _before_finish(self, r: _Running) -> None:
        """The row holds every slot the request reserved (a parked row is whole pages)."""
        self._write(r, r.committed, r.pending)
        self._sync(r)

    # -- request-level ops -------------------------------------------------------------------
    def _op_req_arrive(self, step: dict, args: dict) -> dict:
        rid = args.get("rid")
        tokens = args.get("tokens")
        extra_key = args.get("extra_key")
        priority = args.get("priority", 0)
        session = check_session_arg(args.get("session"))
        if not isinstance(rid, str) or rid in self.requests:
            raise InvalidInput(f"req_arrive: rid must be a new string, got {rid!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidInput(f"req_arrive: priority must be an int, got {priority!r}")
        if not isinstance(tokens, list) or not tokens or any(
                isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise InvalidInput("req_arrive: tokens must be a non-empty list of ints")
        if extra_key is not None and not isinstance(extra_key, str):
            raise InvalidInput(f"extra_key must be null or a string, got {extra_key!r}")
        if session is not None:
            busy = [x for x, r in self.requests.items() if r.session == session]
            if busy:
                raise InvalidInput(f"session {session!r} already has request {busy[0]!r}")
            if session in self.parked:
                base, ek = self.parked[session]
                if ek != extra_key:
                    raise InvalidInput(f"session {session!r} runs under extra_key {ek!r}")
                if tokens[: len(base)] != base:
                    raise InvalidInput(f"session {session!r}: the request does not continue "
                                       f"the session's {len(base)} tokens")
        req = self._Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
                        sampling_params=self._SamplingParams(max_new_tokens=_MAX_NEW_TOKENS),
                        priority=priority, extra_key=extra_key)
        if session is not None:
            req.session = types.SimpleNamespace(session_id=session, streaming=True,
                                                finish_req=lambda _r: None,
                                                abort_req=lambda: None)
        self.requests[rid] = _Running(req, session)
        return {}

    def _op_req_admit(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"), admitted=False)
        req = r.req
        req.init_next_round_input(tree_cache=self.cache)
        n = len(req.prefix_indices)
        restored = req.req_pool_idx is not None  # from the session's slot
        if not restored:
            req.req_pool_idx = self.rtt.take_row()
            self.rtt.free_rows.sort()
            self._write(r, 0, [int(v) for v in req.prefix_indices.tolist()])
            r.row_len = n
        else:  # the slot's row: the rest of its last page stays reserved with it
            ps = self.config.page_size
            r.row_len = -(-n // ps) * ps
            r.pending = self._row(r, n, r.row_len)
        r.committed = n
        self._sync(r)
        r.dec_params = self.cache.inc_lock_ref(req.last_node)
        r.admitted = True
        return {"prefix_len": n}

    def _op_req_chunk(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"), admitted=True)
        n = self._count(args.get("n"))
        chunked = args.get("chunked", True)
        if type(chunked) is not bool:
            raise InvalidInput(f"chunked must be true or false, got {chunked!r}")
        if n == 0:
            raise InvalidInput(f"req {r.req.rid!r}: a prefill chunk needs at least one token")
        if r.committed + n > len(r.req.origin_input_ids):
            raise InvalidInput(f"req {r.req.rid!r}: {n} more prompt tokens, only "
                               f"{len(r.req.origin_input_ids) - r.committed} left")
        ok, evicted = self._reserve(r, n)
        if ok:
            self._commit(r, n)
            self._cache_unfinished(r, chunked)
        return {"ok": ok, "evicted": evicted, "freed": self.pool.take_freed()}

    def _op_req_decode(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"), admitted=True)
        n = self._count(args.get("n"))
        if r.committed < len(r.req.origin_input_ids):
            raise InvalidInput(f"req {r.req.rid!r}: decode before the prompt is computed")
        ok, evicted = self._reserve(r, n)
        if ok:
            prompt = list(r.req.origin_input_ids)
            base = len(r.req.output_ids)
            r.req.output_ids.extend(output_token_id(prompt, base + j) for j in range(n))
            self._commit(r, n)
        return {"ok": ok, "evicted": evicted, "freed": self.pool.take_freed()}

    def _op_req_finish(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"), admitted=True)
        self._before_finish(r)
        self.cache.cache_finished_req(r.req)
        if r.session is not None:
            # the tokens of the parked row's computed positions (the next turn continues them)
            ids = list(r.req.origin_input_ids) + list(r.req.output_ids)
            self.parked[r.session] = (ids[: r.committed], r.req.extra_key)
        self._release_row(r)
        return {"freed": self.pool.take_freed()}

    def _op_req_abort(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"))
        if r.admitted:
            self._before_finish(r)
            if r.session is not None:  # the scheduler marks it; the session ends
                r.req.finished_reason = self._ABORT()
                self.cache.cache_finished_req(r.req)
                self.parked.pop(r.session, None)
            else:
                self.cache.cache_finished_req(r.req, is_insert=False)
        self._release_row(r)
        return {"freed": self.pool.take_freed()}

    def _op_release_session(self, step: dict, args: dict) -> dict:
        session = check_session_arg(args.get("session"))
        if session is None:
            raise InvalidInput("release_session needs a session id")
        running = [x for x, r in self.requests.items() if r.session == session and r.admitted]
        if running:
            raise InvalidInput(f"session {session!r} has a running request {running[0]!r}")
        self.cache.release_session(session)
        self.parked.pop(session, None)
        self.rtt.free_rows.sort()
        return {"freed": self.pool.take_freed()}

    def _active_rows(self) -> set:
        return {r.req.req_pool_idx for r in self.requests.values() if r.admitted}

    def _op_session_held(self, step: dict, args: dict) -> dict:
        active = self._active_rows()
        return {"tokens": int(self.cache.session_held_tokens(active)),
                "full_tokens": int(self.cache.session_held_full_tokens(active)),
                "req_count": int(self.cache.session_held_req_count(active))}

    def _op_reset(self, step: dict, args: dict) -> dict:
        out = super()._op_reset(step, args)
        self.requests.clear()
        self.parked.clear()
        self.rtt = ReqToTokenPool()
        self.cache.req_to_token_pool = self.rtt
        return out

    # -- the state -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        snap = super().snapshot()
        snap["requests"] = [self._request_view(r) for _, r in sorted(self.requests.items())]
        slots = self.cache.session.slots
        if slots:
            snap["sessions"] = self._sessions_view()
        return snap

    def _request_view(self, r: _Running) -> dict:
        row = (self._row(r, 0, r.committed) + list(r.pending)) if r.admitted else []
        return {"rid": r.req.rid, "admitted": r.admitted, "row": row,
                "committed": r.committed, "protected": int(r.req.cache_protected_len or 0)
                if r.admitted else 0}

    def _sessions_view(self) -> list[dict]:
        out = []
        ps = self.config.page_size
        running = {r.session: r for r in self.requests.values()
                   if r.session is not None and r.admitted}
        for name, slot in sorted(self.cache.session.slots.items()):
            active = running.get(name)
            if active is not None and active.req.req_pool_idx == slot.req_pool_idx:
                row = self._request_view(active)["row"]
                rid = active.req.rid
            else:
                end = -(-int(slot.kv_allocated_len) // ps) * ps
                row = [int(v) for v in
                       self.rtt.req_to_token[slot.req_pool_idx, :end].tolist()]
                rid = None
            out.append({"session": name, "row": row, "committed": int(slot.kv_committed_len),
                        "protected": int(slot.cache_protected_len), "active": rid})
        return out


class MambaUpstreamRequestAdapter(UpstreamRequestAdapter, HybridUpstreamAdapter):
    """The request path of a Full + Mamba cache, with or without the Mamba extra buffer
    (docs/SPEC.md "The Mamba extra buffer"), over sglang's own ``HybridReqToTokenPool`` (the
    extra buffer on when the config has it; two track slots with the overlap schedule, one
    without) whose ``mamba_allocator`` is the environment's state pool (lowest-first, as the
    spec's), and the tree-level ops of :class:`HybridUpstreamAdapter`.

    The scheduler's side, as spec/requests.py models it: admission matches without
    copy-on-write, locks the match, evicts the states the pool is short of in one call
    (``new_state_slots``; without the extra buffer one state when the pool is empty) and then
    takes the row, the running state slot and the track slots with sglang's
    ``HybridReqToTokenPool.alloc``; it waits, holding nothing, when still short.  Track points
    (``extend_track_len``, ``decode_track_lens``) move ``mamba_last_track_seqlen`` and
    ``mamba_next_track_idx`` with sglang's ``get_mamba_ping_pong_other_idx``.  The cache's own
    ``cache_unfinished_req`` / ``cache_finished_req`` do the rest (the donation of the tracked
    slot, ``free_mamba_cache``).

    Two places where the spec departs from upstream on purpose, both states SGLang's scheduler
    never reaches; the adapter applies the spec's rule there and records it in
    :attr:`departures` (a recording with one is not upstream's own behaviour;
    ``spec_rules=False`` leaves upstream alone there too, and admits with sglang's own
    ``alloc_req_slots``, which evicts against a fixed count of states per request):

    * a track length that is not whole pages (a chunk that started inside a page) is cached
      nowhere (``cached_track_len``): the adapter hands the cache no track length then;
    * no fresh state slot for the cache of a chunk even after evicting one state
      (upstream's ``_alloc_mamba_slot`` asserts): the chunk is not cached.  The adapter makes
      the eviction upstream would make first, and skips the cache call only when it frees
      nothing."""

    def __init__(self, config: CacheConfig, spec_rules: bool = True) -> None:
        self.spec_rules = spec_rules  # False: upstream's own behaviour there too (tests)
        self.departures: list[str] = []
        if config.components != ("full", "mamba"):
            raise Unsupported(f"MambaUpstreamRequestAdapter drives components ['full', 'mamba'] "
                              f"only, not {list(config.components)}")
        super().__init__(config)
        self._tracking: str | None = None  # "chunk" / "decode": the step's track points

    def _build_cache(self):
        return HybridUpstreamAdapter._build_cache(self)  # with _mamba_req_pool's pool

    whole_pages = True

    def _mamba_req_pool(self):
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
        cfg = self.config
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=4, n_groups=1,
                                        num_heads=1, head_dim=2, state_size=2, conv_kernel=2)
        rtp = HybridReqToTokenPool(
            size=_ROWS, mamba_size=cfg.mamba_slots, mamba_spec_state_size=cfg.mamba_slots,
            max_context_len=_MAX_CONTEXT, device="cpu", enable_memory_saver=False,
            cache_params=Mamba2CacheParams(shape=shape, layers=[0]), mamba_layer_ids=[0],
            enable_mamba_extra_buffer=cfg.mamba_extra_buffer,
            enable_overlap_schedule=cfg.mamba_track_slots == 2)
        rtp.mamba_allocator = PoolAllocator(self.mamba, self.up.torch)
        self.rtt = _Rows(rtp)
        return rtp

    # -- the scheduler's side ----------------------------------------------------------------
    def _op_req_arrive(self, step: dict, args: dict) -> dict:
        if args.get("session") is not None:
            raise Unsupported("req_arrive: streaming sessions with Mamba are not driven on "
                              "upstream's request path")
        return super()._op_req_arrive(step, args)

    def _state_effects(self, obs: dict) -> dict:
        """A request step's pool effects with Mamba (TRACE.md): ``freed``, ``mamba_freed``."""
        if "freed" not in obs:
            obs["freed"] = self.pool.take_freed()
        obs.update(self._effects())
        return obs

    def _op_req_admit(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"), admitted=False)
        req = r.req
        req.init_next_round_input(tree_cache=self.cache, cow_mamba=False)
        n = len(req.prefix_indices)
        r.dec_params = self.cache.inc_lock_ref(req.last_node)
        mamba = self.rtt.pool.mamba_allocator
        k = 1 + self.config.mamba_track_slots if self.config.mamba_extra_buffer else 1
        if req.mamba_pool_idx is not None:  # a load back gave it its slot: sglang's alloc keeps it
            k -= 1
        if not self.spec_rules and self.config.mamba_extra_buffer:
            # upstream's own admission: sglang's alloc_req_slots evicts against its fixed
            # states-per-request count (docs/SPEC.md), then takes the row and the slots
            from sglang.srt.mem_cache.common import alloc_req_slots
            alloc_req_slots(self.rtt.pool, [req], self.cache)
        else:
            short = k - mamba.available_size() if self.config.mamba_extra_buffer \
                else int(k > 0 and mamba.available_size() == 0)
            if short > 0:
                self.cache.evict(self.up.EvictParams(num_tokens=0, mamba_num=short))
            if mamba.available_size() < k:  # every state locked: it waits, holding nothing
                self.cache.dec_lock_ref(req.last_node, r.dec_params)
                r.dec_params = None
                return self._state_effects({"prefix_len": 0, "mamba_pool_idx": None})
            self.rtt.pool.alloc([req])  # sglang's: the row, the running slot, the track slots
        self._write(r, 0, [int(v) for v in req.prefix_indices.tolist()])
        r.row_len = r.committed = n
        self._sync(r)
        r.admitted = True
        return self._state_effects({"prefix_len": n,
                                    "mamba_pool_idx": int(req.mamba_pool_idx.reshape(-1)[0])})

    def _track(self, req: Any, lengths: list[int]) -> None:
        for at in lengths:
            req.mamba_last_track_seqlen = at
            req.mamba_next_track_idx = self.rtt.pool.get_mamba_ping_pong_other_idx(
                req.mamba_next_track_idx)

    def _commit(self, r: _Running, n: int) -> None:
        req = r.req
        if self.config.mamba_extra_buffer and self._tracking == "chunk":
            at = extend_track_len(r.committed, n, self.config.mamba_cache_chunk_size,
                                  req.mamba_branching_seqlen)
            self._track(req, [] if at is None else [at])
        elif self.config.mamba_extra_buffer and self._tracking == "decode":
            self._track(req, decode_track_lens(r.committed, n,
                                               self.config.mamba_track_interval))
        super()._commit(r, n)

    def _cacheable_track(self, r: _Running) -> None:
        """The spec's rule for a track length inside a page (the class docstring): the cache
        gets none."""
        at = r.req.mamba_last_track_seqlen
        if self.spec_rules and self.config.mamba_extra_buffer and at is not None \
                and at % self.config.page_size:
            self.departures.append(f"req {r.req.rid}: track length {at} inside a page")
            r.req.mamba_last_track_seqlen = None

    def _tracked(self, tracking: str, op: Any, step: dict, args: dict) -> dict:
        """``op`` (a base class step) with the step's track points marked as ``tracking``
        while it runs, and its state effects added."""
        self._tracking = tracking
        try:
            return self._state_effects(op(step, args))
        finally:
            self._tracking = None

    def _op_req_chunk(self, step: dict, args: dict) -> dict:
        return self._tracked("chunk", super()._op_req_chunk, step, args)

    def _cache_unfinished(self, r: _Running, chunked: bool) -> None:
        self._cacheable_track(r)
        req = r.req
        needs_slot = not self.config.mamba_extra_buffer or req.mamba_last_track_seqlen is not None
        mamba = self.rtt.pool.mamba_allocator
        if self.spec_rules and needs_slot and mamba.available_size() == 0:
            # the eviction upstream's _alloc_mamba_slot makes first
            self.cache.evict(self.up.EvictParams(num_tokens=0, mamba_num=1))
            if mamba.available_size() == 0:  # upstream would assert: nothing cached
                self.departures.append(f"req {req.rid}: no state slot to cache a chunk")
                req.mamba_last_track_seqlen = None
                return
        self.cache.cache_unfinished_req(req, chunked=chunked)

    def _op_req_decode(self, step: dict, args: dict) -> dict:
        return self._tracked("decode", super()._op_req_decode, step, args)

    def _before_finish(self, r: _Running) -> None:
        super()._before_finish(r)
        self._cacheable_track(r)

    def _op_req_finish(self, step: dict, args: dict) -> dict:
        return self._state_effects(super()._op_req_finish(step, args))

    def _op_req_abort(self, step: dict, args: dict) -> dict:
        r = self._get(args.get("rid"))
        if not r.admitted and r.req.mamba_pool_idx is not None:  # a load back's slot, waiting
            from sglang.srt.mem_cache.common import release_kv_cache
            release_kv_cache(r.req, self.cache)  # (the scheduler's: frees it, no row yet)
        return self._state_effects(super()._op_req_abort(step, args))

    def _release_row(self, r: _Running) -> None:
        del self.requests[r.req.rid]
        if r.admitted:
            self.rtt.pool.free(r.req)  # sglang's: the row only (the state slots: the cache)

    def _op_reset(self, step: dict, args: dict) -> dict:
        out = HybridUpstreamAdapter._op_reset(self, step, args)
        self.requests.clear()
        self.rtt.pool.clear()
        return out

    # -- the state -----------------------------------------------------------------------------
    def _request_view(self, r: _Running) -> dict:
        out = super()._request_view(r)
        req = r.req
        idx = req.mamba_pool_idx  # (a waiting request's: what a load back gave it)
        out["mamba_slot"] = None if idx is None else int(idx.reshape(-1)[0])
        if self.config.mamba_extra_buffer:  # (spec/snapshot.py request_view)
            buf = req.mamba_ping_pong_track_buffer if r.admitted else None
            out["mamba_track"] = None if buf is None else [int(s) for s in buf.tolist()]
            out["mamba_next_track"] = (req.mamba_next_track_idx or 0) if r.admitted else 0
            out["mamba_track_len"] = req.mamba_last_track_seqlen if r.admitted else None
            out["mamba_branching"] = req.mamba_branching_seqlen if r.admitted else None
        return out


class HostUpstreamRequestAdapter(UpstreamRequestAdapter, UpstreamHostAdapter):
    """The request path of a Full cache with a host tier (HiCache): :class:`UpstreamRequestAdapter`
    over :class:`~uniradix.conformance.adapters.upstream_host.UpstreamHostAdapter`'s cache (the
    project's model of sglang's cache controller, transfers acked by ``io_complete``).  The
    request path's inserts back up and evict as the tree-level ones do.  ``load_back {rid}``
    (docs/TRACE.md) is SGLang's ``init_load_back(req=req)`` with sglang's own ``Req`` of that
    waiting request, its ``last_node`` the step's ``last_device_node`` (what its match in
    ``init_next_round_input`` sets) and its aux host hit lengths 0 (the trace's rule); a
    request whose session has a slot is refused, as the spec refuses it."""

    def __init__(self, config: CacheConfig) -> None:
        if config.components != ("full",):
            raise Unsupported(f"HostUpstreamRequestAdapter drives components ['full'] only, "
                              f"not {list(config.components)}")
        super().__init__(config)

    def _requester(self, args: dict, last: Any) -> Any:
        return named_requester(self, args, last, super()._requester)


def named_requester(adapter: Any, args: dict, last: Any, driver: Any) -> Any:
    """``load_back``'s request on a request path with a host tier: ``rid``'s sglang ``Req``
    (waiting; not one its session's slot restores: InvalidInput, as the spec), its
    ``last_node`` the step's last device node (what its match in ``init_next_round_input``
    sets) and its aux host hit lengths 0 (the trace's rule); without ``rid`` the driver's
    (``driver(args, last)``)."""
    rid = args.get("rid")
    if rid is None:
        return driver(args, last)
    r = adapter._get(rid, admitted=False)
    if r.session is not None and r.session in adapter.cache.session.slots:
        raise InvalidInput(f"load_back: request {rid!r} is restored from session "
                           f"{r.session!r}'s slot, not matched")
    req = r.req
    req.last_node = last
    req.swa_host_hit_length = req.mamba_host_hit_length = 0
    return req


class HostMambaUpstreamRequestAdapter(MambaUpstreamRequestAdapter, HostAuxUpstreamAdapter):
    """The request path of a Full + Mamba cache with a host tier at page 1 (no extra buffer):
    :class:`MambaUpstreamRequestAdapter`'s scheduler over
    :class:`~uniradix.conformance.adapters.upstream_host_aux.HostAuxUpstreamAdapter`'s cache
    (past page 1 that adapter turns upstream's extra buffer on, which the spec's config then
    does not have: refused).  ``load_back {rid}`` hands the cache that request's sglang
    ``Req``: a loaded host-only state goes into its ``mamba_pool_idx``, which its admission
    (sglang's ``HybridReqToTokenPool.alloc``) keeps and its abort while waiting frees
    (sglang's ``release_kv_cache``)."""

    def __init__(self, config: CacheConfig) -> None:
        if config.page_size != 1 or config.mamba_extra_buffer:
            raise Unsupported("HostMambaUpstreamRequestAdapter drives the host tier with Mamba "
                              "at page 1 without the extra buffer only")
        super().__init__(config)

    def _build_cache(self):
        return HostAuxUpstreamAdapter._build_cache(self)  # (its Mamba pool: _mamba_req_pool's)

    def _requester(self, args: dict, last: Any) -> Any:
        return named_requester(self, args, last, super()._requester)


class _Rows:
    """sglang's ``HybridReqToTokenPool`` (``pool``) seen through the row interface
    :class:`UpstreamRequestAdapter` writes rows with."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @property
    def req_to_token(self) -> Any:
        return self.pool.req_to_token

    def ensure(self, cols: int) -> None:
        if cols > self.pool.max_context_len:
            raise InvalidInput(f"a request longer than {self.pool.max_context_len} tokens")


# sglang's HybridReqToTokenPool for the Mamba request path: rows, and columns a row holds
_ROWS = 64
_MAX_CONTEXT = 1 << 14


# -- recording the sessions corpus (tests/corpus/upstream-sessions) -----------------------------

SESSION_CONFIGS = ("sessions-p1", "sessions-p4")


def record_sessions(config_name: str, seed: int, steps: int, path: str) -> list[dict]:
    """Record one trace of ``conform``'s session workload (conformance/explore/machine.py with
    streaming sessions: tree-level steps, request-level steps, session turns, releases and
    ``session_held``) from this adapter, writing it to ``path``.  The config is ``conform``'s
    ``config_name`` with the pool size drawn from ``seed``.  The spec runs in lockstep while
    the steps are drawn, every snapshot compared and upstream's ``sanity_check`` after every
    step; a finding raises ``RuntimeError`` (nothing written).  Returns the recorded steps."""
    from uniradix.conformance.adapters.base import SpecAdapter
    from uniradix.conformance.explore.conform import segment_config
    from uniradix.conformance.explore.lockstep import Lockstep, write_trace
    from uniradix.conformance.explore.machine import random_segment

    if config_name not in SESSION_CONFIGS:
        raise ValueError(f"unknown sessions config {config_name!r}; known: {SESSION_CONFIGS}")
    _, config = segment_config(config_name, seed, 0)
    ls = Lockstep([UpstreamRequestAdapter(config), SpecAdapter(config)], ["upstream", "spec"])
    taken, finding = random_segment(ls, config, f"upstream-sessions:{seed}", steps,
                                    sessions=True)
    if finding is not None:
        raise RuntimeError(f"{config_name} seed {seed}: {finding}")
    version = load_version()
    source = (f"sglang {version} UnifiedRadixCache on CPU, request path with sglang's Req and "
              f"its StreamingSession (uniradix.conformance.adapters.upstream_requests, config "
              f"{config_name}, seed {seed})")
    return write_trace(path, [UpstreamRequestAdapter], config, taken, source, seed=seed)


def load_version() -> str:
    from uniradix.conformance.adapters.upstream import load_upstream
    return str(load_upstream().version)


# -- recording the Mamba request-path corpus (tests/corpus/upstream-mamba-requests) --------------

MAMBA_CONFIGS = ("mamba-xbuf-p1", "mamba-xbuf-p4", "mamba")


# the recorder's weights of the request-level actions (conformance/explore/machine.py
# Scenario.WEIGHTS; conform's are 1.5-2.5, which leave about one step in seven on the request
# path): most steps are requests, so the track points, the donated slots and the cut finishes
# come often
REQUEST_WEIGHTS = {"req_arrive": 5.0, "req_admit": 6.0, "req_chunk": 8.0, "req_decode": 7.0,
                   "req_finish": 4.0, "req_abort": 0.6}


def page_aligned_chunks(spec: Any, step: dict) -> bool:
    """Whether ``step`` keeps chunked prefill page-aligned, as SGLang's scheduler does: a
    ``req_chunk`` that is not a prompt's last one ends on a page boundary (``spec`` is the
    spec's adapter, whose requests say how far each one has come).  A chunk that ends inside a
    page starts the next one there, and its track length is one of the spec's departures."""
    if step.get("op") != "req_chunk":
        return True
    args = step.get("args") or {}
    req = spec.state.requests.get(args.get("rid")) if isinstance(args.get("rid"), str) else None
    n = args.get("n")
    if req is None or not req.admitted or type(n) is not int:
        return True  # the spec refuses it; nothing to keep aligned
    end = req.committed + n
    return end % spec.config.page_size == 0 or end >= len(req.input_ids)


def state_slot_to_be_had(spec: Any, step: dict) -> bool:
    """Whether a ``req_chunk`` finds a state slot for what it caches: a free one, or an
    evictable state (``spec`` is the spec's adapter).  Upstream's ``_alloc_mamba_slot`` asserts
    when it finds neither, where the spec caches nothing (docs/SPEC.md "The Mamba extra
    buffer"); the recorder draws such a step again (more often than needed: the chunk's own
    room-making can free states too)."""
    from uniradix.spec import components
    state = spec.state
    if step.get("op") != "req_chunk" or state.mamba is None:
        return True
    return state.mamba.available_size() > 0 or components.sizes(state)["mamba_evictable"] > 0


def record_mamba(config_name: str, seed: int, steps: int, path: str) -> list[dict]:
    """Record one trace of ``conform``'s workload for ``config_name`` (one of
    :data:`MAMBA_CONFIGS`: tree-level steps, requests, the Mamba pool ops) from
    :class:`MambaUpstreamRequestAdapter`, writing it to ``path``; the config is ``conform``'s
    with the pool sizes drawn from ``seed``.  Chunked prefill is kept page-aligned
    (:func:`page_aligned_chunks`) and a chunk runs only when a state slot is to be had for its
    cache (:func:`state_slot_to_be_had`): a proposal that is not is drawn again.  The spec runs in
    lockstep while the steps are drawn (the request actions weighted up,
    :data:`REQUEST_WEIGHTS`), every snapshot compared and upstream's
    ``sanity_check`` after every step; a finding, or a step where the adapter applied one of
    the spec's departures (``departures``: the trace would not be upstream's own behaviour),
    raises ``RuntimeError`` (nothing written).  Returns the recorded steps."""
    import random

    from uniradix.conformance.adapters.base import SpecAdapter
    from uniradix.conformance.explore.conform import segment_config
    from uniradix.conformance.explore.lockstep import Lockstep, write_trace
    from uniradix.conformance.explore.machine import RandomChooser, Scenario, runner_actions

    if config_name not in MAMBA_CONFIGS:
        raise ValueError(f"unknown Mamba config {config_name!r}; known: {MAMBA_CONFIGS}")
    _, config = segment_config(config_name, seed, 0)
    up, spec = MambaUpstreamRequestAdapter(config), SpecAdapter(config)
    ls = Lockstep([up, spec], ["upstream", "spec"])
    rng = random.Random(f"upstream-mamba-requests:{config_name}:{seed}")
    ch = RandomChooser(rng)
    sc = Scenario(config, ch, actions=runner_actions(ls, None))
    sc.WEIGHTS = dict(sc.WEIGHTS, **REQUEST_WEIGHTS)
    taken: list[dict] = []
    ls.prime()
    while len(taken) < steps:
        step = sc.propose(sc.next_action(rng), ch)
        if step is None or not (page_aligned_chunks(spec, step)
                                and state_slot_to_be_had(spec, step)):
            continue
        step = {"i": len(taken), **step}
        taken.append(step)
        obs, finding = ls.check(step)
        if finding is not None:
            raise RuntimeError(f"{config_name} seed {seed} step {step['i']}: {finding}")
        if up.departures:
            raise RuntimeError(f"{config_name} seed {seed} step {step['i']}: the spec's rule "
                               f"applied, not upstream's: {up.departures[0]}")
        sc.observe(step, obs)
    source = (f"sglang {load_version()} UnifiedRadixCache on CPU, request path with sglang's "
              f"Req and HybridReqToTokenPool (uniradix.conformance.adapters.upstream_requests."
              f"MambaUpstreamRequestAdapter, config {config_name}, seed {seed}, chunked prefill "
              f"page-aligned)")
    return write_trace(path, [MambaUpstreamRequestAdapter], config, taken, source, seed=seed)
