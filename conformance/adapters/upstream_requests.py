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
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import InvalidInput, Unsupported
from uniradix.spec.requests import output_token_id

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
        self.rtt = ReqToTokenPool()
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
            self.cache.cache_unfinished_req(r.req, chunked=chunked)
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
