"""Streaming sessions on the fast path: a finished turn's KV parked in a per-session slot and
restored on the session's next turn instead of going through the tree (the seed's embedded
``StreamingSession`` of sglang 0.5.13.post1; the rules are spec/sessions.py's).

Every cache has one :class:`StreamingSessions` (``cache.sessions``), reached from the request
path (fast/compat.py ``cache_finished_req`` / ``cache_unfinished_req``) and from the session
API the cache exposes (``release_session``, ``session_held_*``, ``supports_streaming_session``).
A request is a streaming one when ``req.session`` is set and ``req.session.streaming`` is true
(SGLang's ``Session``; its ``session_id`` names the slot).

* **Park** (``cache_finished_req`` of a streaming request): nothing is inserted and the
  request's tree lock is kept; the slots past its tokens (whole pages past
  ``len(origin_input_ids) + finished_len``) go back, and its req_to_token row
  (``req_pool_idx``, ``kv_committed_len``, ``kv_allocated_len``) moves into the session's slot,
  made on the session's first turn with that turn's lock (``last_node``, ``dec_lock_params``)
  and protected length (``cache_protected_len``).  ``req.req_pool_idx`` becomes None: the row
  is the slot's.
* **Restore** (``match_prefix`` with a request of a session that has a slot): the request
  takes the slot's row; its prefix is the slot's committed tokens, at most the key's length;
  the row's slots from the page after the prefix on go back.  The result's nodes are the
  slot's ``VirtualNode``, which ``inc_lock_ref`` / ``dec_lock_ref`` take as a no-op, and its
  ``cache_protected_len`` the first turn's.  The tree is not walked.
* **Unfinished**: ``cache_unfinished_req`` of a streaming request skips the tree when the
  prefill is chunked (``req.prefix_indices`` is the computed row) or the session has a slot; a
  first turn's final prefill goes through the tree (it sets up the lock the slot keeps).
* **Abort** (``cache_finished_req`` with ``is_insert`` false, or a ``FINISH_ABORT`` finish
  reason): the whole session goes, as ``release_session`` (a first turn's request state is
  released the same way).
* **release_session(id)**: the first turn's lock is released, the row's slots from the
  protected length on go back, the row returns to the request pool (``free_slots``).  An
  unknown id is a no-op, as upstream.
* **session_held_tokens** and the other counts: what parked slots hold outside the tree
  (``active_pool_idxs``: rows a running request holds, not counted).

* **SWA and Mamba** (spec/sessions.py, "Hybrid models"): the request's window start
  (``swa_evicted_seqlen``; lowered to the prefix at a restore, to its tokens at a park) and its
  Mamba refs (``mamba_pool_idx``, the extra buffer's ``mamba_ping_pong_track_buffer`` and its
  track fields) move into the slot at the park, the request's refs cleared, and back at the
  restore; the first turn's ``swa_uuid_for_lock`` goes with its lock.  ``release_session``
  releases that lock with it and frees the parked state slots through the request pool's
  ``mamba_allocator`` (the Mamba component's allocator where the pool has none).
  ``session_held_swa_tokens`` / ``session_held_mamba_slots`` count them.

What uniradix checks that upstream trusts its caller with (each an ``InvalidInput``, nothing
changed): a restore for a second request while one runs from the slot; a restore under
another ``extra_key`` or with tokens that do not continue the slot's; a restore below the
protected length (upstream asserts); ``release_session`` while a request runs from the slot.

Cost: nothing on the tree's hot paths while no session has a slot.  The first slot installs
session-aware ``match_prefix`` / ``inc_lock_ref`` / ``dec_lock_ref`` on the cache instance (one
check of the request or node each, then the class's method); the last slot to go removes them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import params as api
from .errors import InvalidInput
from .frees import release

_INSTALLED = ("match_prefix", "inc_lock_ref", "dec_lock_ref")


class VirtualNode:
    """The node a restored request's match answers with: locking it is a no-op (the slot holds
    the first turn's lock on the tree)."""

    __slots__ = ("session",)

    def __init__(self, session: str) -> None:
        self.session = session

    def __repr__(self) -> str:
        return f"VirtualNode(session={self.session!r})"


@dataclasses.dataclass(eq=False)
class SessionSlot:
    """What a session keeps between turns."""

    session: str
    extra_key: str | None
    virtual_node: VirtualNode
    req_pool_idx: int | None = None  # the parked row (None: none held)
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    tokens: list = dataclasses.field(default_factory=list)  # the ids of row[:kv_committed_len]
    last_node: Any = None  # the first turn's locked node, released by release_session
    dec_lock_params: Any = None  # the first turn's lock result, for that release
    cache_protected_len: int = 0  # the first turn's protected length (the tree's slots)
    active: Any = None  # the request restored from the slot, while it runs
    swa_uuid_for_lock: Any = None  # SWA: the first turn's lock boundary
    swa_evicted_seqlen: int = 0  # SWA: the row's window start
    # Mamba: the request's own state slot, the extra buffer's slots and their track fields
    mamba_pool_idx: Any = None
    mamba_ping_pong_track_buffer: Any = None
    mamba_next_track_idx: Any = None
    mamba_last_track_seqlen: Any = None
    mamba_branching_seqlen: Any = None


_MAMBA_FIELDS = ("mamba_pool_idx", "mamba_ping_pong_track_buffer", "mamba_next_track_idx",
                 "mamba_last_track_seqlen", "mamba_branching_seqlen")


def _save_aux(slot: SessionSlot, req: Any) -> None:
    """The request's window start and Mamba refs become the slot's; the request's refs are
    cleared (the slot owns the state now)."""
    slot.swa_evicted_seqlen = int(getattr(req, "swa_evicted_seqlen", 0) or 0)
    for name in _MAMBA_FIELDS:
        if hasattr(req, name):
            setattr(slot, name, getattr(req, name))
            setattr(req, name, None)


def _restore_aux(slot: SessionSlot, req: Any) -> None:
    """The slot's window start, lock boundary and Mamba refs go to the restored request (the
    slot keeps them too: a retried admission restores again)."""
    req.swa_evicted_seqlen = slot.swa_evicted_seqlen
    req.swa_uuid_for_lock = slot.swa_uuid_for_lock
    for name in _MAMBA_FIELDS:
        setattr(req, name, getattr(slot, name))


def _session_id(req: Any) -> str | None:
    """The session of a streaming request, None for any other request."""
    session = getattr(req, "session", None)
    if session is None or not getattr(session, "streaming", False):
        return None
    sid = getattr(session, "session_id", None)
    if not isinstance(sid, str) or not sid:
        raise InvalidInput(f"a streaming request's session_id must be a non-empty string, "
                           f"got {sid!r}")
    return sid


def _ceil(n: int, page_size: int) -> int:
    return -(-n // page_size) * page_size


def _is_abort(req: Any, is_insert: bool) -> bool:
    reason = getattr(req, "finished_reason", None)
    return not is_insert or (reason is not None and type(reason).__name__ == "FINISH_ABORT")


class StreamingSessions:
    """The session slots of one cache; see the module docstring."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.slots: dict[str, SessionSlot] = {}

    # -- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every slot (the cache's ``reset``: the pools are the caller's to clear)."""
        self.slots.clear()
        self._uninstall()

    def any_holding_kv(self) -> bool:
        return any(s.req_pool_idx is not None for s in self.slots.values())

    def _install(self) -> None:
        cache = self.cache
        if "match_prefix" not in cache.__dict__:
            cache.match_prefix = self.match_prefix
            cache.inc_lock_ref = self.inc_lock_ref
            cache.dec_lock_ref = self.dec_lock_ref

    def _uninstall(self) -> None:
        if not self.slots:
            for name in _INSTALLED:
                self.cache.__dict__.pop(name, None)

    def _row(self, idx: int) -> torch.Tensor:
        return self.cache.req_to_token_pool.req_to_token[idx]

    def _free_kv(self, slots: torch.Tensor) -> None:
        """A slot's KV slots back to the allocator as its ``free`` takes them, without copying
        sglang's free list where fast/frees.py can write it (the cache's own tail buffer)."""
        release(self.cache.token_to_kv_pool_allocator, [slots.to(torch.int64)],
                holder=self.cache._tail())

    def _free_from(self, idx: int, start: int, end: int) -> None:
        """Free row ``idx``'s slots ``[start rounded up to a page, end)`` (the paged allocator
        frees the page of every slot it is given, so a partial page stays whole)."""
        start = _ceil(start, self.cache.page_size)
        if start < end:
            self._free_kv(self._row(idx)[start:end])

    # -- the session-aware entries (installed on the cache while a slot exists) ----------------
    def match_prefix(self, params: Any) -> api.MatchResult:
        req = getattr(params, "req", None)
        if req is not None:
            result = self.try_match_prefix(params)
            if result is not None:
                return result
        return type(self.cache).match_prefix(self.cache, params)

    def inc_lock_ref(self, node: Any) -> api.IncLockRefResult:
        if node.__class__ is VirtualNode:
            return api.IncLockRefResult()
        return type(self.cache).inc_lock_ref(self.cache, node)

    def dec_lock_ref(self, node: Any, params: Any = None) -> api.DecLockRefResult:
        if node.__class__ is VirtualNode:
            return api.DecLockRefResult()
        return type(self.cache).dec_lock_ref(self.cache, node, params)

    # -- restore ------------------------------------------------------------------------------
    def try_match_prefix(self, params: Any) -> api.MatchResult | None:
        """A request's match from its session's slot; None when it has none to restore from
        (the tree's match runs then)."""
        req = params.req
        sid = _session_id(req)
        slot = self.slots.get(sid) if sid is not None else None
        if slot is None or slot.req_pool_idx is None:
            return None
        if getattr(req, "to_finish", None) is not None:  # aborted before it ran: no session
            abort = getattr(req.session, "abort_req", None)
            if abort is not None:
                abort()
            req.session = None
            return None
        if slot.active is not None and slot.active is not req:
            raise InvalidInput(f"session {sid!r} already has a request running from its slot")
        key = params.key
        ids = list(getattr(key, "token_ids", key))
        extra_key = getattr(key, "extra_key", None)
        if extra_key != slot.extra_key:
            raise InvalidInput(f"session {sid!r} runs under extra_key {slot.extra_key!r}")
        prefix = min(slot.kv_committed_len, len(ids))
        if ids[:prefix] != slot.tokens[:prefix]:
            raise InvalidInput(f"session {sid!r}: the request does not continue the session's "
                               "tokens")
        if prefix < slot.cache_protected_len:
            raise InvalidInput(f"session {sid!r}: a restore would shrink it below its protected "
                               f"{slot.cache_protected_len} tokens")
        idx = slot.req_pool_idx
        self._free_from(idx, prefix, slot.kv_allocated_len)
        slot.kv_allocated_len = prefix
        slot.kv_committed_len = prefix
        slot.swa_evicted_seqlen = min(slot.swa_evicted_seqlen, prefix)
        del slot.tokens[prefix:]
        slot.active = req
        _restore_aux(slot, req)
        req.req_pool_idx = idx
        req.kv_committed_len = req.kv_allocated_len = prefix
        node = slot.virtual_node
        indices = self._row(idx)[:prefix].to(torch.int64)
        return api.MatchResult(indices, node, node, node, cache_protected_len=slot.cache_protected_len)

    # -- the request path ----------------------------------------------------------------------
    def try_cache_unfinished_req(self, req: Any, chunked: bool) -> bool:
        """True when the request's prefill skips the tree (chunked, or its session has a slot)."""
        sid = _session_id(req)
        if sid is None:
            return False
        if chunked:
            n = getattr(req, "fill_len", None)
            if n is None:
                get_fill_ids = getattr(req, "get_fill_ids", None)
                n = len(get_fill_ids() if get_fill_ids is not None else req.fill_ids)
            req.prefix_indices = self._row(req.req_pool_idx)[:n].to(torch.int64).clone()
            return True
        return sid in self.slots

    def try_cache_finished_req(self, req: Any, is_insert: bool) -> bool:
        """Park a finished streaming request in its session's slot, or end the session on an
        abort; False for any other request."""
        sid = _session_id(req)
        if sid is None:
            return False
        slot = self.slots.get(sid)
        if _is_abort(req, is_insert):
            if slot is None:  # a first turn: its own lock, row and state go as a slot's would
                slot = self._new_slot(sid, req)
                slot.req_pool_idx = req.req_pool_idx
                slot.kv_allocated_len = req.kv_allocated_len
                _save_aux(slot, req)
                self.slots[sid] = slot
            slot.active = None
            slot.kv_allocated_len = max(slot.kv_allocated_len, req.kv_allocated_len)
            self.release_session(sid)
            req.req_pool_idx = None
            abort = getattr(req.session, "abort_req", None)
            if abort is not None:
                abort()
            self._mark_kv_freed(req)
            return True
        if slot is None:
            slot = self._new_slot(sid, req)
        finished = getattr(req, "finished_len", None)
        if finished is None:
            finished = len(req.output_ids)
        target = len(req.origin_input_ids) + finished
        self._free_from(req.req_pool_idx, target, req.kv_allocated_len)
        req.kv_allocated_len = min(req.kv_allocated_len, target)
        req.kv_committed_len = min(req.kv_committed_len, target)
        if hasattr(req, "swa_evicted_seqlen"):
            req.swa_evicted_seqlen = min(req.swa_evicted_seqlen, target)
        req.output_ids = req.output_ids[:finished]
        slot.req_pool_idx = req.req_pool_idx
        slot.kv_committed_len = req.kv_committed_len
        slot.kv_allocated_len = req.kv_allocated_len
        slot.tokens = (list(req.origin_input_ids) + list(req.output_ids))[:slot.kv_committed_len]
        slot.active = None
        _save_aux(slot, req)
        self.slots[sid] = slot
        req.req_pool_idx = None
        finish = getattr(req.session, "finish_req", None)
        if finish is not None:
            finish(req)
        self._mark_kv_freed(req)
        self._install()
        return True

    def _new_slot(self, sid: str, req: Any) -> SessionSlot:
        """A session's slot from its first turn: that turn's lock and protected length."""
        return SessionSlot(session=sid, extra_key=getattr(req, "extra_key", None),
                           virtual_node=VirtualNode(sid), last_node=req.last_node,
                           dec_lock_params=getattr(req, "dec_lock_params", None),
                           cache_protected_len=req.cache_protected_len,
                           swa_uuid_for_lock=getattr(req, "swa_uuid_for_lock", None))

    @staticmethod
    def _mark_kv_freed(req: Any) -> None:
        """The scheduler's bookkeeping: the request's committed and over-allocated KV are no
        longer its (where its request object keeps that account)."""
        for flag, pop in (("kv_committed_freed", "pop_committed_kv_cache"),
                          ("kv_overallocated_freed", "pop_overallocated_kv_cache")):
            method = getattr(req, pop, None)
            if method is not None and getattr(req, flag, None) is False:
                method()

    # -- the session API -----------------------------------------------------------------------
    def release_session(self, session_id: Any) -> None:
        """End a session: release the first turn's lock, free the row's slots from the
        protected length on and return the row; an unknown session is a no-op."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidInput(f"release_session needs a session id, got {session_id!r}")
        slot = self.slots.get(session_id)
        if slot is None:
            return
        if slot.active is not None:
            raise InvalidInput(f"session {session_id!r} has a request running from its slot")
        del self.slots[session_id]
        cache = self.cache
        if slot.last_node is not None:
            params = slot.dec_lock_params
            if params is None and slot.swa_uuid_for_lock is not None:
                params = api.DecLockRefParams(swa_uuid_for_lock=slot.swa_uuid_for_lock)
            type(cache).dec_lock_ref(cache, slot.last_node, params)
        idx = slot.req_pool_idx
        if idx is not None:
            start = slot.cache_protected_len
            if start < slot.kv_allocated_len:
                self._free_kv(self._row(idx)[start:slot.kv_allocated_len])
            free_slots = getattr(cache.req_to_token_pool, "free_slots", None)
            if free_slots is not None:
                free_slots.append(idx)
        self._free_mamba(slot)
        self._uninstall()

    def _free_mamba(self, slot: SessionSlot) -> None:
        """The slot's Mamba state slots go back (the request pool's ``mamba_allocator``, else
        the Mamba component's)."""
        if slot.mamba_pool_idx is None and slot.mamba_ping_pong_track_buffer is None:
            return
        allocator = getattr(self.cache.req_to_token_pool, "mamba_allocator", None)
        if allocator is None and getattr(self.cache, "mamba", None) is not None:
            allocator = self.cache.mamba.allocator
        if allocator is None:
            return
        if slot.mamba_pool_idx is not None:
            idx = slot.mamba_pool_idx
            t = idx if isinstance(idx, torch.Tensor) else torch.tensor(int(idx), device="cpu")
            release(allocator, [t.reshape(1).to(torch.int64)])
            slot.mamba_pool_idx = None
        if slot.mamba_ping_pong_track_buffer is not None:
            release(allocator, [slot.mamba_ping_pong_track_buffer])
            slot.mamba_ping_pong_track_buffer = None

    def _held(self, active_pool_idxs: set | None) -> list[SessionSlot]:
        return [s for s in self.slots.values() if s.req_pool_idx is not None
                and not (active_pool_idxs is not None and s.req_pool_idx in active_pool_idxs)]

    def held_tokens(self, active_pool_idxs: set | None = None) -> int:
        """KV slots parked in session slots that the tree does not hold (rows in
        ``active_pool_idxs`` not counted: a running request holds them)."""
        ps = self.cache.page_size
        return sum(_ceil(s.kv_allocated_len, ps) - s.cache_protected_len
                   for s in self._held(active_pool_idxs))

    def held_swa_tokens(self, active_pool_idxs: set | None = None) -> int:
        """SWA slots parked in session slots: each row's own positions from its window start
        on."""
        ps = self.cache.page_size
        return sum(_ceil(s.kv_allocated_len, ps) - max(s.cache_protected_len,
                                                       s.swa_evicted_seqlen)
                   for s in self._held(active_pool_idxs))

    def held_mamba_slots(self, active_pool_idxs: set | None = None) -> int:
        """Mamba state slots parked in session slots (the state and the extra buffer's)."""
        total = 0
        for s in self.slots.values():
            if active_pool_idxs is not None and s.req_pool_idx in active_pool_idxs:
                continue
            for t in (s.mamba_pool_idx, s.mamba_ping_pong_track_buffer):
                if t is not None:
                    total += t.numel() if isinstance(t, torch.Tensor) else 1
        return total

    def held_req_count(self, active_pool_idxs: set | None = None) -> int:
        """Request rows parked in session slots."""
        return len(self._held(active_pool_idxs))

    # -- checks --------------------------------------------------------------------------------
    def violations(self) -> list[str]:
        """A parked slot's lock is live (its node attached and locked), its protected length
        is within its row, its own slots are not the tree's (where the cache tracks slots)."""
        errors = []
        owned: set = getattr(self.cache, "_owned", set()) if self.cache.validate_slots else set()
        for name, slot in self.slots.items():
            node = slot.last_node
            if node is not None and node is not self.cache.root_node and (
                    node.parent is None or node.lock_ref < 1):
                errors.append(f"[session] {name}: its lock is not live")
            if slot.req_pool_idx is None or slot.active is not None:
                continue
            if slot.cache_protected_len > _ceil(slot.kv_allocated_len, self.cache.page_size):
                errors.append(f"[session] {name}: protected past its row")
            own = self._row(slot.req_pool_idx)[slot.cache_protected_len:
                                               slot.kv_allocated_len].tolist()
            if owned and any(s in owned for s in own):
                errors.append(f"[session] {name}: parks slots the tree holds")
        return errors
