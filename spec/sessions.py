"""Streaming sessions: a finished turn's KV parked in a per-session slot, restored on the
session's next turn instead of going through the tree (the seed's embedded
``StreamingSession``, from sglang 0.5.13.post1's ``srt/session/streaming_session.py``).

A request that names a session (``req_arrive {session}``) runs as any other on its first turn,
with one difference at the end: ``cache_finished_req`` inserts nothing, frees nothing but the
overshoot past its tokens, and keeps its tree lock; its row (the req_to_token line) goes into
the session's **slot** with the lock and the protected length of that first turn.  The
session's next request is *restored* from the slot at admission: its row is the slot's row, its
prefix the slot's committed tokens (at most its prompt minus the last token), its protected
length and lock the first turn's; the tree is not matched and nothing in it is touched.  While
a session has a slot, ``cache_unfinished_req`` of its requests skips the tree; a chunked one
always does.  ``release_session`` ends a session: the first turn's lock is released and the
row's own slots (from the protected length on) go back to the pool.

Locks and eviction: a parked slot keeps the first turn's path locked, so nothing of it can be
evicted, and the row's own slots are outside the tree (``session_held_tokens`` counts them; the
request that runs from a slot holds them meanwhile, so it does not).

Hybrid models (SWA, Mamba; the seed's slot fields ``swa_evicted_seqlen``, ``mamba_pool_idx``):
what a request holds of its own besides its row moves into the slot with it and back out at the
restore.  SWA: the row's SWA slots from ``max(protected, swa_evicted_seqlen)`` on (the window
start the request reached; its SWA slots before it are freed already), and the first turn's
lock, which holds the SWA window above the locked node as a running request's does
(``session_held_swa_tokens`` counts the parked SWA slots).  Mamba: the request's own state slot,
outside the tree, so neither evictable nor the tree's (``session_held_mamba_slots``); a restored
request computes on in it, and ``release_session`` frees it.  A restore that frees the row's tail
lowers the window start to the prefix at most.  Nothing of this touches the tree: SWA eviction
and Mamba eviction see a parked session only through its lock, as they see a running request.

What the spec checks that the seed trusts its caller with (each a rejected step, nothing
changed): one request per session at a time; a restored request's tokens start with the slot's
tokens and use the slot's ``extra_key``; a restore never shrinks the prefix below the
protected length (the seed asserts it); ``release_session`` while a request of the session
runs (the seed would free the running request's row).  An unknown session's release is a no-op,
as in the seed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from . import cache as rules
from . import components
from .core import CacheState, LockHandle, all_nodes
from .errors import InvalidInput
from .queries import tree_slots


@dataclasses.dataclass(eq=False)
class SessionSlot:
    """What a session keeps between turns."""

    session: str
    extra_key: str | None
    row: list[int]               # the parked row: the tree's prefix, then the session's own slots
    tokens: list[int]            # the token ids of row[:committed]
    committed: int
    lock: LockHandle | None   # the first turn's tree lock (None on a disabled cache)
    protected: int               # the first turn's protected length (the tree's slots)
    active: str | None = None  # the rid of the request restored from it, while it runs
    swa_evicted_seqlen: int = 0  # SWA: the row's window start (its SWA slots before it freed)
    mamba_slot: int | None = None  # Mamba: the request's own state slot, parked


class SessionRequest(Protocol):
    """What the session rules read and write of a request (spec/requests.py's ``Request``)."""

    rid: str
    input_ids: list[int]
    extra_key: str | None
    row: list[int]
    committed: int
    cache_protected_len: int
    lock: LockHandle | None
    admitted: bool
    session: str | None
    swa_evicted_seqlen: int
    mamba_slot: int | None

    @property
    def all_ids(self) -> list[int]: ...


def ceil_pages(n: int, page_size: int) -> int:
    """pre: n >= 0 and page_size >= 1
    post: __return__ % page_size == 0 and n <= __return__ < n + page_size"""
    return -(-n // page_size) * page_size


def slot_of(state: CacheState, session: str | None) -> SessionSlot | None:
    return None if session is None else state.sessions.get(session)


def check_session_arg(session: object) -> str | None:
    if session is not None and (not isinstance(session, str) or not session):
        raise InvalidInput(f"session must be null or a non-empty string, got {session!r}")
    return session


def check_arrival(state: CacheState, session: str | None, tokens: list[int],
                  extra_key: str | None) -> None:
    """A session runs one request at a time; a request restored from a slot continues the
    slot's tokens under the slot's extra_key."""
    if session is None:
        return
    busy = [r.rid for r in state.requests.values() if r.session == session]
    if busy:
        raise InvalidInput(f"session {session!r} already has request {busy[0]!r}")
    slot = slot_of(state, session)
    if slot is None:
        return
    if slot.extra_key != extra_key:
        raise InvalidInput(f"session {session!r} runs under extra_key {slot.extra_key!r}")
    if tokens[: slot.committed] != slot.tokens:
        raise InvalidInput(f"session {session!r}: the request does not continue the session's "
                           f"{slot.committed} tokens")


# ----------------------------------------------------------------------------------------------
# The request rules' session branches (spec/requests.py calls these first)
# ----------------------------------------------------------------------------------------------


def try_restore(state: CacheState, req: SessionRequest) -> int | None:
    """Admission from the session's slot (the seed's ``try_match_prefix``): the prefix is the
    slot's committed tokens, at most the prompt minus its last token; the row's pages past the
    prefix go back to the pool.  None when the request has no slot to restore from."""
    slot = slot_of(state, req.session)
    if slot is None:
        return None
    prefix = min(slot.committed, len(req.input_ids) - 1)
    if prefix < slot.protected:
        raise InvalidInput(f"req {req.rid!r}: a restore would shrink session {req.session!r} "
                           f"below its protected {slot.protected} tokens")
    keep = ceil_pages(prefix, state.config.page_size)
    state.kv.free(slot.row[keep:])
    del slot.row[keep:]
    slot.committed = prefix
    slot.tokens = slot.tokens[:prefix]
    slot.swa_evicted_seqlen = min(slot.swa_evicted_seqlen, prefix)
    slot.active = req.rid
    req.row = slot.row  # the same row, as upstream's req_pool_idx
    req.swa_evicted_seqlen = slot.swa_evicted_seqlen
    req.mamba_slot = slot.mamba_slot  # the slot keeps it too: an abort frees it through the slot
    req.committed = prefix
    req.cache_protected_len = slot.protected
    req.lock = slot.lock  # the slot's handle: only release_session releases it
    req.admitted = True
    return prefix


def skips_tree_on_unfinished(state: CacheState, req: SessionRequest, chunked: bool) -> bool:
    """``cache_unfinished_req`` of a session request skips the tree when the prefill is chunked
    or the session already has a slot; a first turn's final prefill goes through the tree (it
    sets up the lock the slot will keep)."""
    return req.session is not None and (chunked or slot_of(state, req.session) is not None)


def session_of(req: SessionRequest) -> str:
    """The session a request runs in; the session rules take only requests that name one."""
    if req.session is None:
        raise InvalidInput(f"req {req.rid!r} runs in no session")
    return req.session


def park(state: CacheState, req: SessionRequest) -> None:
    """A session request finishes: free the overshoot past its tokens (whole pages past them),
    then park its row in the slot (made on the first turn, with that turn's lock and protected
    length).  Nothing is inserted, the lock is kept."""
    session = session_of(req)
    target = ceil_pages(len(req.all_ids), state.config.page_size)
    state.kv.free(req.row[target:])
    del req.row[target:]
    committed = min(req.committed, len(req.all_ids))
    slot = slot_of(state, session)
    if slot is None:
        slot = SessionSlot(session=session, extra_key=req.extra_key, row=req.row, tokens=[],
                           committed=0, lock=req.lock, protected=req.cache_protected_len)
        state.sessions[session] = slot
    slot.row = req.row
    slot.committed = committed
    slot.tokens = req.all_ids[:committed]
    slot.active = None
    hand_over_aux(slot, req, len(req.all_ids))
    del state.requests[req.rid]


def hand_over_aux(slot: SessionSlot, req: SessionRequest, end: int) -> None:
    """SWA and Mamba: the request's window start (at most ``end``, its tokens) and its own
    state slot become the slot's; the request keeps no state slot."""
    slot.swa_evicted_seqlen = min(req.swa_evicted_seqlen, end)
    slot.mamba_slot = req.mamba_slot
    req.mamba_slot = None


def abort_running(state: CacheState, req: SessionRequest) -> None:
    """A session request aborted while running: the whole session goes (the seed's
    mid-processing abort): its lock is released, the row's own slots freed, the slot dropped;
    the session's next request starts from scratch."""
    session = session_of(req)
    slot = slot_of(state, session)
    if slot is None:  # first turn: the request's own lock and row
        slot = SessionSlot(session=session, extra_key=req.extra_key, row=req.row, tokens=[],
                           committed=req.committed, lock=req.lock,
                           protected=req.cache_protected_len)
        state.sessions[session] = slot
    slot.row = req.row
    slot.active = None
    hand_over_aux(slot, req, len(req.row))
    del state.requests[req.rid]
    release_session(state, session)


def release_session(state: CacheState, session: object) -> None:
    """End a session: release the first turn's lock and free the row's own slots."""
    session = check_session_arg(session)
    if session is None:
        raise InvalidInput("release_session needs a session id")
    running = [r.rid for r in state.requests.values() if r.session == session and r.admitted]
    if running:
        raise InvalidInput(f"session {session!r} has a running request {running[0]!r}")
    slot = state.sessions.pop(session, None)
    if slot is None:
        return
    if slot.lock is not None:
        rules.dec_lock_ref(state, slot.lock)
    state.kv.free(slot.row[slot.protected:])
    free_parked_state(state, slot)


def free_parked_state(state: CacheState, slot: SessionSlot) -> None:
    """Mamba: the slot's state goes back to the state pool."""
    if slot.mamba_slot is not None:
        assert state.mamba is not None  # a parked state slot implies the Mamba component
        state.mamba.free([slot.mamba_slot])
        slot.mamba_slot = None


# ----------------------------------------------------------------------------------------------
# Queries (the seed's session_held_*), invariants, snapshot view
# ----------------------------------------------------------------------------------------------


def parked(state: CacheState) -> list[SessionSlot]:
    """Slots whose row no running request holds."""
    return [s for s in state.sessions.values() if s.active is None]


def session_held_tokens(state: CacheState) -> int:
    """KV slots parked in session slots that the tree does not hold."""
    return sum(len(s.row) - s.protected for s in parked(state))


def session_held_swa_tokens(state: CacheState) -> int:
    """SWA slots parked in session slots that the tree does not hold: each row's own positions
    from its window start on (with the Full component alone, the same as
    ``session_held_tokens``)."""
    return sum(len(s.row) - max(s.protected, s.swa_evicted_seqlen) for s in parked(state))


def session_held_mamba_slots(state: CacheState) -> int:
    """Mamba state slots parked in session slots."""
    return sum(1 for s in parked(state) if s.mamba_slot is not None)


def session_held_req_count(state: CacheState) -> int:
    """req_to_token rows parked in session slots."""
    return len(parked(state))


def session_invariants(state: CacheState) -> list[str]:
    """A parked row starts with the tree's slots along its locked path, up to the protected
    length; its own slots are allocated, not the tree's, and held by no other row; a slot's
    lock is live; an active slot's request is running from it."""
    errors: list[str] = []
    tree = set(tree_slots(state))
    seen: dict[int, str] = {}
    for r in state.requests.values():
        if r.admitted:
            for s in r.row[r.cache_protected_len:]:
                seen[s] = r.rid
    for name, slot in state.sessions.items():
        if slot.active is not None:
            req = state.requests.get(slot.active)
            if req is None or req.row is not slot.row or not req.admitted:
                errors.append(f"[session] {name}: active request {slot.active!r} is not "
                              "running from the slot")
            continue
        lock = slot.lock
        if lock is not None:
            locked = lock.node
            if state.handles.get(lock.serial) is not lock:
                errors.append(f"[session] {name}: its lock is not live")
                continue
            path = [s for n in reversed(list(locked.ancestors_to_root()))
                    if n.value is not None for s in n.value]
            if slot.row[: slot.protected] != path[: slot.protected] or len(path) < slot.protected:
                errors.append(f"[session] {name}: protected prefix is not the tree's slots")
        own = slot.row[slot.protected:]
        if any(s in tree for s in own):
            errors.append(f"[session] {name}: parks slots the tree holds")
        if any(not state.kv.is_allocated(s) for s in own):
            errors.append(f"[session] {name}: parks slots the pool says are free")
        if any(s in seen for s in own):
            errors.append(f"[session] {name}: parks slots a running request owns")
        seen.update((s, name) for s in own)
        if len(slot.row) % state.config.page_size or slot.committed > len(slot.row):
            errors.append(f"[session] {name}: row of {len(slot.row)} slots for "
                          f"{slot.committed} committed tokens")
    return errors + aux_invariants(state)


def aux_invariants(state: CacheState) -> list[str]:
    """SWA: a parked row's own positions have SWA slots exactly from its window start on.
    Mamba: a parked state slot is allocated, not the tree's, and no request's or other
    slot's; with Mamba every parked slot has one."""
    errors: list[str] = []
    names = components.aux_names(state)
    if "swa" in names:
        pool = components.swa_pool(state)
        for name, slot in state.sessions.items():
            if slot.active is None:
                start = max(slot.protected, slot.swa_evicted_seqlen)
                mapped = pool.translate(slot.row[slot.protected:])
                want = [i + slot.protected >= start for i in range(len(mapped))]
                if [w > 0 for w in mapped] != want:
                    errors.append(f"[session] {name}: SWA slots not exactly from its window "
                                  f"start {start} on")
    if "mamba" in names:
        assert state.mamba is not None  # the Mamba component implies its pool
        held = {s for n in all_nodes(state) if components.has(n, "mamba")
                for s in (n.aux["mamba"].value or ())}
        held.update(r.mamba_slot for r in state.requests.values() if r.mamba_slot is not None)
        for name, slot in state.sessions.items():
            if slot.active is not None:
                continue
            m = slot.mamba_slot
            if m is None or not state.mamba.is_allocated(m) or m in held:
                errors.append(f"[session] {name}: parked state slot {m} is missing, free, or "
                              "held elsewhere")
            held.add(-1 if m is None else m)
    return errors


def sessions_view(state: CacheState) -> list[dict[str, Any]]:
    """Each slot's row and lengths; with SWA its window start, with Mamba its state slot."""
    names = components.aux_names(state)
    return [{"session": name, "row": list(s.row), "committed": s.committed,
             "protected": s.protected, "active": s.active,
             **({"swa_evicted_seqlen": s.swa_evicted_seqlen} if "swa" in names else {}),
             **({"mamba_slot": s.mamba_slot} if "mamba" in names else {})}
            for name, s in sorted(state.sessions.items())]
