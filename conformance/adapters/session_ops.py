"""Streaming sessions on the fast adapter (docs/TRACE.md ``req_arrive {session}``,
``release_session``, ``session_held``): the scheduler's side of fast/sessions.py, as
spec/sessions.py models it.

The adapter plays SGLang's scheduler: a session request carries a ``Session`` reference
(``session_id``, ``streaming``), its admission passes the request to ``match_prefix`` (which
restores it from the session's slot when there is one), and before its finish the row holds
every slot the request has reserved (``kv_allocated_len``), so a parked row is whole pages as
the spec's is.  What the spec checks at a session request's arrival (one request per session at
a time, the slot's extra_key and tokens continued) and at ``release_session`` (no request of the
session running) are the scheduler's rules: checked here, before the cache sees anything.

With SWA or Mamba (fast/sessions.py over fast's plug-ins) ``session_held`` answers
``swa_tokens`` / ``mamba_slots`` too, ``release_session`` the aux pools' effects, and the
sessions view each slot's ``swa_evicted_seqlen`` / ``mamba_slot``, as the spec's adapter does.
The hybrid adapter drives them through fast's own request path
(conformance/adapters/fast_hybrid.py), so lockstep and ``conform`` compare them with the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from uniradix.fast.sessions import VirtualNode
from uniradix.spec.errors import InvalidInput


class SessionRef:
    """SGLang's ``Session`` as the cache reads it."""

    streaming = True

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id


def check_session_arg(session: Any) -> str | None:
    if session is not None and (not isinstance(session, str) or not session):
        raise InvalidInput(f"session must be null or a non-empty string, got {session!r}")
    return session


class FastSessionOps:
    """Mixed into FastAdapter; uses its ``cache``, ``rtt``, ``pool``, ``requests``."""

    cache: Any
    rtt: Any
    pool: Any
    requests: dict
    config: Any
    _effects: Callable[[], dict]  # the aux pools' effects (HybridFastAdapter's)

    def check_session_arrival(self, session: str | None, tokens: list,
                              extra_key: str | None) -> None:
        if session is None:
            return
        busy = [r.rid for r in self.requests.values() if r.session_id == session]
        if busy:
            raise InvalidInput(f"session {session!r} already has request {busy[0]!r}")
        slot = self.cache.sessions.slots.get(session)
        if slot is None:
            return
        if slot.extra_key != extra_key:
            raise InvalidInput(f"session {session!r} runs under extra_key {slot.extra_key!r}")
        if tokens[: slot.kv_committed_len] != slot.tokens:
            raise InvalidInput(f"session {session!r}: the request does not continue the "
                               f"session's {slot.kv_committed_len} tokens")

    def restored(self, req: Any, m: Any) -> bool:
        """After an admission match: a request restored from its session's slot takes the
        slot's row (its partial last page is reserved already)."""
        if m.last_device_node.__class__ is not VirtualNode:
            return False
        n = len(m.device_indices)
        ps = self.config.page_size
        req.committed = n
        req.row_len = -(-n // ps) * ps
        # the rest of the last page: parked in the row with it (before_session_finish)
        req.pending = self.rtt.req_to_token[req.req_pool_idx, n: req.row_len].clone()
        req.cache_protected_len = m.cache_protected_len
        req.last_node = m.last_device_node
        req.dec_lock_params = self.cache.inc_lock_ref(m.last_device_node).to_dec_params()
        req.admitted = True
        return True

    def before_session_finish(self, req: Any) -> None:
        """A session request's row holds every slot it reserved (the cache parks or frees the
        row up to ``kv_allocated_len``)."""
        if req.session is None:
            return
        self.rtt.ensure(req.row_len)
        if len(req.pending):
            self.rtt.req_to_token[req.req_pool_idx, req.committed: req.row_len] = req.pending
        req.kv_committed_len = req.committed
        req.kv_allocated_len = req.row_len

    def _active_rows(self) -> set:
        return {r.req_pool_idx for r in self.requests.values() if r.admitted}

    def op_release_session(self, step: dict) -> dict:
        from uniradix.conformance.adapters.base import args_of
        (session,) = args_of(step, "session")
        session = check_session_arg(session)
        if session is None:
            raise InvalidInput("release_session needs a session id")
        running = [r.rid for r in self.requests.values() if r.session_id == session and r.admitted]
        if running:
            raise InvalidInput(f"session {session!r} has a running request {running[0]!r}")
        self.cache.release_session(session)
        self.rtt.free_rows.sort()
        obs = {"freed": self.pool.take_freed()}
        if self.config.components != ("full",):  # the aux pools' effects (TRACE.md)
            obs.update(self._effects())
        return obs

    def op_session_held(self, step: dict) -> dict:
        from uniradix.conformance.adapters.base import args_of
        args_of(step)
        active = self._active_rows()
        obs = {"tokens": self.cache.session_held_tokens(active),
               "full_tokens": self.cache.session_held_full_tokens(active),
               "req_count": self.cache.session_held_req_count(active)}
        if "swa" in self.config.components:
            obs["swa_tokens"] = self.cache.session_held_swa_tokens(active)
        if "mamba" in self.config.components:
            obs["mamba_slots"] = self.cache.session_held_mamba_slots(active)
        return obs

    def sessions_view(self) -> list[dict]:
        """The spec's view of the session slots (spec/sessions.py ``sessions_view``)."""
        out = []
        ps = self.config.page_size
        for name, slot in sorted(self.cache.sessions.slots.items()):
            if slot.active is not None:
                row = self._request_view(slot.active)["row"]
                active = slot.active.rid
            else:
                end = -(-slot.kv_allocated_len // ps) * ps
                row = self.rtt.req_to_token[slot.req_pool_idx, :end].tolist()
                active = None
            entry = {"session": name, "row": row, "committed": slot.kv_committed_len,
                     "protected": slot.cache_protected_len, "active": active}
            if "swa" in self.config.components:
                entry["swa_evicted_seqlen"] = slot.swa_evicted_seqlen
            if "mamba" in self.config.components:
                m = slot.mamba_pool_idx
                entry["mamba_slot"] = None if m is None else int(m)
            out.append(entry)
        return out

    def _request_view(self, req: Any) -> dict:  # FastAdapter's
        raise NotImplementedError
