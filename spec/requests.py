"""Requests: the request-to-token table, the scheduler's use of the cache, and the two caching
rules the seed defines over requests, ``cache_unfinished_req`` and ``cache_finished_req``.

A request's *row* (its line of SGLang's req_to_token table) holds one KV slot per token
position, in whole pages: ``row[:committed]`` are the tokens computed so far, the rest of the
last page is allocated but not yet used.  (In SGLang the table's row holds only the computed
positions, and a reused row keeps the previous request's stale slots past them; the cache's
rules therefore read ``row[:committed]`` only, and a free of a partial last page releases the
whole page, as SGLang's paged allocator does.  Here that page is ``row[:round_up(committed)]``.)  Ownership of the row is split at
``cache_protected_len``: positions before it are the tree's slots (matched, and locked through
``lock``), positions from it on are the request's own and must be freed or handed to the tree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from . import cache as rules
from . import sessions
from .errors import AllocatorError, InvalidInput
from .state import CacheState, LockHandle


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    input_ids: list
    extra_key: Optional[str]
    output_ids: list = dataclasses.field(default_factory=list)
    row: list = dataclasses.field(default_factory=list)
    committed: int = 0  # tokens whose KV is in the row (prefix included)
    cache_protected_len: int = 0
    lock: Optional[LockHandle] = None
    admitted: bool = False
    priority: int = 0  # the request's priority, given to its inserts (spec/policies.py)
    session: Optional[str] = None  # streaming sessions (spec/sessions.py)

    @property
    def all_ids(self) -> list:
        return self.input_ids + self.output_ids


def round_up(n: int, page_size: int) -> int:
    """pre: n >= 0 and page_size >= 1
    post: __return__ % page_size == 0 and n <= __return__ < n + page_size"""
    return -(-n // page_size) * page_size


# ----------------------------------------------------------------------------------------------
# The scheduler's side (environment model)
# ----------------------------------------------------------------------------------------------


def arrive(state: CacheState, rid: str, tokens, extra_key: Optional[str],
           priority: int = 0, session: Optional[str] = None) -> Request:
    if not isinstance(rid, str) or rid in state.requests:
        raise InvalidInput(f"req_arrive: rid must be a new string, got {rid!r}")
    tokens = rules.check_int_list("tokens", tokens)
    extra_key = rules.check_extra_key(extra_key)
    if not tokens:
        raise InvalidInput("req_arrive: a request needs at least one token")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput(f"req_arrive: priority must be an int, got {priority!r}")
    session = sessions.check_session_arg(session)
    sessions.check_arrival(state, session, tokens, extra_key)
    req = Request(rid=rid, input_ids=tokens, extra_key=extra_key, priority=priority,
                  session=session)
    state.requests[rid] = req
    return req


def get_request(state: CacheState, rid, admitted: Optional[bool] = None) -> Request:
    req = state.requests.get(rid) if isinstance(rid, str) else None
    if req is None:
        raise InvalidInput(f"no request {rid!r}")
    if admitted is not None and req.admitted != admitted:
        raise InvalidInput(f"request {rid!r} is {'already' if req.admitted else 'not yet'} admitted")
    return req


def admit(state: CacheState, req: Request) -> int:
    """Admission: match the prompt, take the matched slots as the row's prefix and lock the
    matched node.  (Input tokens are then computed by :func:`extend`.)  Returns the prefix
    length."""
    restored = sessions.try_restore(state, req)  # a session's next turn: from its slot
    if restored is not None:
        return restored
    # The last token is always computed (its logits are needed), as in SGLang.
    m = rules.match_prefix(state, req.input_ids[:-1] if len(req.input_ids) > 1 else [],
                           req.extra_key)
    req.row = list(m.device_indices)
    req.committed = req.cache_protected_len = len(m.device_indices)
    req.lock = rules.inc_lock_ref(state, m.last_device_node)
    req.admitted = True
    return req.committed


@dataclasses.dataclass(frozen=True)
class Reservation:
    ok: bool  # False: even eviction could not make room; nothing was allocated
    evicted: int  # tokens evicted from the cache to make room


def reserve(state: CacheState, req: Request, new_tokens: int) -> Reservation:
    """Make room in the row for ``new_tokens`` more tokens: allocate whole pages, evicting
    from the cache first when the pool is short."""
    need = round_up(req.committed + new_tokens, state.config.page_size) - len(req.row)
    if need <= 0:
        return Reservation(True, 0)
    short = need - state.kv.available_size()
    evicted = rules.evict(state, short) if short > 0 else 0
    try:
        req.row.extend(state.kv.alloc(need))
    except AllocatorError:
        return Reservation(False, evicted)
    return Reservation(True, evicted)


def extend(state: CacheState, req: Request, n: int) -> Reservation:
    """Compute the next ``n`` prompt tokens (prefill, possibly one chunk of it); a chunk has at
    least one token (an empty one would cache fewer units than the request already protects
    under EAGLE)."""
    n = rules.check_count("n", n)
    if n == 0:
        raise InvalidInput(f"req {req.rid!r}: a prefill chunk needs at least one token")
    if req.committed + n > len(req.input_ids):
        raise InvalidInput(f"req {req.rid!r}: {n} more prompt tokens, only "
                           f"{len(req.input_ids) - req.committed} left")
    r = reserve(state, req, n)
    if r.ok:
        req.committed += n
    return r


def decode(state: CacheState, req: Request, n: int) -> Reservation:
    """Generate ``n`` output tokens (token ids drawn deterministically from the request)."""
    n = rules.check_count("n", n)
    if req.committed < len(req.input_ids):
        raise InvalidInput(f"req {req.rid!r}: decode before the prompt is computed")
    r = reserve(state, req, n)
    if r.ok:
        base = len(req.output_ids)
        req.output_ids.extend(output_token(req, base + j) for j in range(n))
        req.committed += n
    return r


def output_token(req: Request, k: int) -> int:
    """The k-th generated token: a fixed function of the prompt, so replays agree."""
    return output_token_id(req.input_ids, k)


def output_token_id(input_ids, k: int) -> int:
    return (input_ids[k % len(input_ids)] * 7 + k) % 50000


def release(state: CacheState, req: Request) -> None:
    del state.requests[req.rid]


# ----------------------------------------------------------------------------------------------
# The cache's rules over requests
# ----------------------------------------------------------------------------------------------


def cache_unfinished_req(state: CacheState, req: Request, chunked: bool = False) -> None:
    """Cache what a running request has computed so far (after a prefill chunk).

    Insert the page-aligned computed tokens (duplicates of what the tree holds are freed), then
    match them again: the row now points at the tree's slots up to the match, the request
    locks the new last node instead of the old one, and everything up to the match is
    protected.  The unaligned tail stays the request's own.
    """
    rules.check_flag("chunked", chunked)
    if sessions.skips_tree_on_unfinished(state, req, chunked):
        return
    if state.config.disable:
        return
    tokens = req.all_ids[: req.committed]
    kv = req.row[: req.committed]
    rules.insert(state, tokens, req.extra_key, kv, req.cache_protected_len, chunked,
                 priority=req.priority)
    m = rules.match_prefix(state, tokens, req.extra_key)
    new = list(m.device_indices)
    assert req.cache_protected_len <= len(new) + state.config.page_size - 1
    req.row[req.cache_protected_len: len(new)] = new[req.cache_protected_len:]
    rules.dec_lock_ref(state, req.lock)
    req.lock = rules.inc_lock_ref(state, m.last_device_node)
    req.cache_protected_len = len(new)


def cache_finished_req(state: CacheState, req: Request, is_insert: bool = True) -> None:
    """Cache a finished request and release it.

    The committed tokens, page-aligned, go into the tree (duplicates freed); the pages of the
    committed positions from there (the unaligned tail, its page whole) go back to the pool;
    the request's lock is released.  With ``is_insert`` false (an aborted request) the pages of
    every committed position the request owns are freed instead.  Nothing past the committed
    positions' pages is read (the seed frees from the committed length).
    """
    rules.check_flag("is_insert", is_insert)
    if req.session is not None:  # streaming sessions: park the row, or end the session
        if is_insert:
            sessions.park(state, req)
        else:
            sessions.abort_running(state, req)
        return
    end = round_up(req.committed, state.config.page_size)
    if state.config.disable:
        state.kv.free(req.row[:end])
        release(state, req)
        return
    tokens = req.all_ids[: req.committed]
    kv = req.row[: req.committed]
    free_from = req.cache_protected_len
    if is_insert:
        rules.insert(state, tokens, req.extra_key, kv, req.cache_protected_len, False,
                     priority=req.priority)
        aligned = len(rules.aligned_units(state, tokens))
        # NOTE: the seed frees from the aligned length; it is never below the protected length
        # for a request admitted through match_prefix, and freeing below it would free the
        # tree's own slots, so the spec states the intended bound.
        free_from = max(aligned, req.cache_protected_len)
    state.kv.free(req.row[free_from:end])
    rules.dec_lock_ref(state, req.lock)
    release(state, req)
