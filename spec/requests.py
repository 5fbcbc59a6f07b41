"""Requests: the request-to-token table, the scheduler's use of the cache, and the two caching
rules the seed defines over requests, ``cache_unfinished_req`` and ``cache_finished_req``.

A request's *row* (its line of SGLang's req_to_token table) holds one KV slot per token
position, in whole pages: ``row[:committed]`` are the tokens computed so far, the rest of the
last page is allocated but not yet used.  (In SGLang the table's row holds only the computed
positions, and a reused row keeps the previous request's stale slots past them; the cache's
rules therefore read ``row[:committed]`` only, and a free of a partial last page releases the
whole page, as SGLang's paged allocator does.  Here that page is ``row[:round_up(committed)]``.)
Ownership of the row is split at ``cache_protected_len``: positions before it are the tree's
slots (matched, and locked through ``lock``), positions from it on are the request's own and
must be freed or handed to the tree.

Hybrid models (spec/components.py; docs/SPEC.md, "The request path for SWA and Mamba"): with
SWA a request also holds ``swa_evicted_seqlen``, where its sliding window starts: before each
decode step the scheduler frees the SWA slots of its own positions that fell out of the window
(:func:`evict_swa_window`), and its finishing insert passes that length, so the part before it
is cached without SWA data.  With Mamba a request holds one state slot of its own from
admission (one state evicted when the pool is empty); a prefill chunk caches a copy of it (a
fresh slot, kept by the tree unless the node already had a state), and its finishing insert
hands the slot itself to the tree, which keeps it unless the node already had one
(``mamba_exist``): then, as on abort, it is freed.

The Mamba extra buffer (``mamba_extra_buffer``; docs/SPEC.md "The Mamba extra buffer"): a
request also holds ``mamba_track_slots`` track slots (ping-pong).  At a track point (a prefill
chunk of at least ``mamba_cache_chunk_size`` tokens, or a decode step reaching a multiple of
``mamba_track_interval``) the state at that length is written into the slot ``mamba_next_track``
names, which then moves to the other slot.  What the cache caches is that tracked state at its
length, never the running state: a chunk hands the tracked slot to the tree (a fresh slot takes
its place), the finish inserts only up to the last track length with the tracked slot.

Its lazy variant (``mamba_extra_buffer_lazy``; docs/SPEC.md "The lazy extra buffer"): a request
holds one track slot between steps (:func:`held_track_slots`), which a prefill chunk's track point
writes in place; a decode track point takes a fresh slot for its state (one state evicted when
the pool is empty) and frees the old one (:func:`lazy_track`).  With no fresh slot to be had the
state is written over the only one, and a request that finishes on that step caches nothing
(:func:`finish_inserts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from . import cache as rules
from . import components, host, sessions
from .errors import AllocatorError, InvalidInput, Unsupported
from .state import CacheState, LockHandle, Node, all_nodes


@dataclasses.dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    extra_key: str | None
    output_ids: list[int] = dataclasses.field(default_factory=list)
    row: list[int] = dataclasses.field(default_factory=list)
    committed: int = 0  # tokens whose KV is in the row (prefix included)
    cache_protected_len: int = 0
    lock: LockHandle | None = None
    admitted: bool = False
    priority: int = 0  # the request's priority, given to its inserts (spec/policies.py)
    session: str | None = None  # streaming sessions (spec/sessions.py)
    # hybrid models: where the request's own SWA data starts (page-aligned; its SWA slots before
    # it and from cache_protected_len on are freed), and its own Mamba state slot
    swa_evicted_seqlen: int = 0
    mamba_slot: int | None = None
    # the Mamba extra buffer: the track slots, which one the next track point writes, the
    # length of the last tracked state (None: none since the last cache), and the admission
    # match's branching length (a state worth tracking inside the next chunk)
    mamba_track: list[int] | None = None
    mamba_next_track: int = 0
    mamba_track_len: int | None = None
    mamba_branching: int | None = None
    # lazy extra buffer: the last decode step was a track point that found no fresh slot (its
    # state went over the only track slot); a finish now inserts nothing
    mamba_track_overwritten: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids


def round_up(n: int, page_size: int) -> int:
    """pre: n >= 0 and page_size >= 1
    post: __return__ % page_size == 0 and n <= __return__ < n + page_size"""
    return -(-n // page_size) * page_size


# ----------------------------------------------------------------------------------------------
# The scheduler's side (environment model)
# ----------------------------------------------------------------------------------------------


def arrive(state: CacheState, rid: str, tokens: Any, extra_key: str | None,
           priority: int = 0, session: str | None = None) -> Request:
    if not isinstance(rid, str) or rid in state.requests:
        raise InvalidInput(f"req_arrive: rid must be a new string, got {rid!r}")
    tokens = rules.check_int_list("tokens", tokens)
    extra_key = rules.check_extra_key(extra_key)
    if not tokens:
        raise InvalidInput("req_arrive: a request needs at least one token")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInput(f"req_arrive: priority must be an int, got {priority!r}")
    session = sessions.check_session_arg(session)
    check_hybrid_arrival(state, session)
    sessions.check_arrival(state, session, tokens, extra_key)
    req = Request(rid=rid, input_ids=tokens, extra_key=extra_key, priority=priority,
                  session=session)
    state.requests[rid] = req
    return req


def check_hybrid_arrival(state: CacheState, session: str | None) -> None:
    """What the request model does not cover with an aux component: EAGLE keys (its cuts are
    in tokens, not bigram units).  (Streaming sessions with SWA or Mamba: spec/sessions.py.)"""
    if components.aux_names(state) and state.config.eagle:
        raise Unsupported("req_arrive: the request model with SWA or Mamba takes no EAGLE keys")
    if session is not None and state.config.mamba_extra_buffer:
        raise Unsupported("req_arrive: streaming sessions with mamba_extra_buffer are not "
                          "modelled")


def get_request(state: CacheState, rid: object, admitted: bool | None = None) -> Request:
    req: Request | None = state.requests.get(rid) if isinstance(rid, str) else None
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
    req.lock = lock = rules.inc_lock_ref(state, m.last_device_node)
    if "mamba" in components.aux_names(state):  # the request's own state slot
        own = req.mamba_slot  # kept from a load back of its host hit (load_back_for)
        if state.config.mamba_extra_buffer:  # and its track slots
            fresh = new_state_slots(state, (own is None) + held_track_slots(state))
            slots = None if fresh is None else ([] if own is None else [own]) + fresh
        elif own is not None:
            slots = [own]
        else:
            one = new_state_slot(state)
            slots = None if one is None else [one]
        if slots is None:  # every state is locked: the request waits, holding nothing new
            rules.dec_lock_ref(state, lock)
            req.lock, req.row, req.committed, req.cache_protected_len = None, [], 0, 0
            return 0
        req.mamba_slot = slots[0]
        if state.config.mamba_extra_buffer:
            req.mamba_track, req.mamba_next_track = slots[1:], 0
            req.mamba_track_len, req.mamba_branching = None, m.mamba_branching_seqlen
    req.admitted = True
    return req.committed


def new_state_slot(state: CacheState) -> int | None:
    """A fresh Mamba state slot, evicting one state first when the pool is empty; None when
    nothing could be evicted (upstream's ``_alloc_mamba_slot`` asserts there)."""
    assert state.mamba is not None
    if state.mamba.available_size() == 0:
        components.evict(state, 0, mamba_num=1)
    if state.mamba.available_size() == 0:
        return None
    return state.mamba.alloc(1)[0]


def new_state_slots(state: CacheState, k: int) -> list[int] | None:
    """Extra buffer, admission: ``k`` state slots (the request's own, then its track slots),
    evicting the states the pool is short of in one call first (upstream's ``alloc_req_slots``);
    None, nothing taken, when still short."""
    assert state.mamba is not None
    short = k - state.mamba.available_size()
    if short > 0:
        components.evict(state, 0, mamba_num=short)
    if state.mamba.available_size() < k:
        return None
    return state.mamba.alloc(1) + state.mamba.alloc(k - 1) if k else []


# ----------------------------------------------------------------------------------------------
# The Mamba extra buffer's track points (the scheduler's side), one rule each
# ----------------------------------------------------------------------------------------------


def extend_track_len(prefix: int, n: int, chunk: int, branching: int | None) -> int | None:
    """The length whose state a prefill chunk of ``n`` tokens after ``prefix`` tracks: none
    for a chunk shorter than ``chunk``; else the branching length where it lies strictly inside
    the chunk at a whole number of chunks from its start; else the chunk's last whole chunk.
    pre: prefix >= 0 and n >= 0 and chunk >= 1
    post: __return__ is None or prefix < __return__ <= prefix + n"""
    if n < chunk:
        return None
    if branching is not None and prefix < branching < prefix + n \
            and (branching - prefix) % chunk == 0:
        return branching
    return prefix + n // chunk * chunk


def decode_track_lens(before: int, n: int, interval: int) -> list[int]:
    """The track points of ``n`` decode steps after ``before`` computed tokens: each computed
    length reached that is a multiple of ``interval``, in order.
    pre: before >= 0 and n >= 0 and interval >= 1
    post: all(before < x <= before + n and x % interval == 0 for x in __return__)"""
    first = before // interval * interval + interval
    return list(range(first, before + n + 1, interval))


def held_track_slots(state: CacheState) -> int:
    """The track slots a request holds from admission on: ``mamba_track_slots``; lazy, one
    (upstream's admission counts two states a request, its own and one track slot)."""
    return 1 if state.config.mamba_extra_buffer_lazy else state.config.mamba_track_slots


def lazy_track(state: CacheState, req: Request, length: int) -> bool:
    """Lazy extra buffer, a decode track point: a fresh state slot (one state evicted when the
    pool is empty, :func:`new_state_slot`) takes the state at ``length`` and the old track slot
    goes back to the pool (the request holds one again).  With none to be had the state goes
    over the only track slot.  Either way ``length`` is the last track length.  Returns whether
    a fresh slot was had."""
    assert state.mamba is not None and req.mamba_track is not None
    req.mamba_track_len = length
    fresh = new_state_slot(state)
    if fresh is None:
        return False
    old, req.mamba_track[req.mamba_next_track] = req.mamba_track[req.mamba_next_track], fresh
    state.mamba.free([old])
    return True


def finish_inserts(req: Request) -> bool:
    """Lazy extra buffer: whether a finish caches the request: not when its last decode step
    was a track point that found no fresh slot (upstream then releases it as an abort)."""
    return not req.mamba_track_overwritten


def next_track_after(next_track: int, slots: int) -> int:
    """The track slot the track point after this one writes: the other one of two, the same
    one of one."""
    return 1 - next_track if slots == 2 else next_track


def keep_track_index(req: Request) -> int:
    """The track slot holding the last tracked state (the one the last track point wrote)."""
    assert req.mamba_track is not None
    return next_track_after(req.mamba_next_track, len(req.mamba_track))


def track(req: Request, length: int) -> None:
    """A track point: the state at ``length`` goes into the next track slot, which moves on."""
    assert req.mamba_track is not None
    req.mamba_track_len = length
    req.mamba_next_track = next_track_after(req.mamba_next_track, len(req.mamba_track))


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
    if "swa" in components.aux_names(state):  # SWA slots come with the full ones
        swa_short = need - components.swa_pool(state).swa.available_size()
        evicted = components.evict(state, max(short, 0), max(swa_short, 0))["full"] \
            if short > 0 or swa_short > 0 else 0
    else:
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
        if req.mamba_track is not None:
            at = extend_track_len(req.committed, n, state.config.mamba_cache_chunk_size,
                                  req.mamba_branching)
            if at is not None:
                track(req, at)
        req.committed += n
    return r


def decode(state: CacheState, req: Request, n: int) -> Reservation:
    """Generate ``n`` output tokens (token ids drawn deterministically from the request)."""
    n = rules.check_count("n", n)
    if req.committed < len(req.input_ids):
        raise InvalidInput(f"req {req.rid!r}: decode before the prompt is computed")
    evict_swa_window(state, req)
    r = reserve(state, req, n)
    if r.ok:
        base = len(req.output_ids)
        req.output_ids.extend(output_token(req, base + j) for j in range(n))
        if req.mamba_track is not None:
            lazy = state.config.mamba_extra_buffer_lazy
            req.mamba_track_overwritten = False
            for at in decode_track_lens(req.committed, n, state.config.mamba_track_interval):
                if not lazy:
                    track(req, at)
                elif not lazy_track(state, req, at) and at == req.committed + n:
                    req.mamba_track_overwritten = True
        req.committed += n
    return r


def evict_swa_window(state: CacheState, req: Request) -> None:
    """SWA, before a decode step (schedule_batch's ``_evict_swa`` with the computed length):
    the request's own positions more than one window and one page behind the computed length
    drop their SWA slots (the full slots stay).  Its window start first moves up to the
    protected length (what lies before is the tree's), then to that bound, page-aligned."""
    if "swa" not in components.aux_names(state) or state.config.disable:
        return
    ps = state.config.page_size
    req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, req.cache_protected_len)
    new = max(req.swa_evicted_seqlen, req.committed - components.window(state) - ps) // ps * ps
    if new > req.swa_evicted_seqlen:
        components.swa_pool(state).free_swa(req.row[req.swa_evicted_seqlen: new])
        req.swa_evicted_seqlen = new


def output_token(req: Request, k: int) -> int:
    """The k-th generated token: a fixed function of the prompt, so replays agree."""
    return output_token_id(req.input_ids, k)


def output_token_id(input_ids: Sequence[int], k: int) -> int:
    return (input_ids[k % len(input_ids)] * 7 + k) % 50000


def release(state: CacheState, req: Request) -> None:
    """A waiting request leaves (an abort): the state slot a load back gave it, if any, goes
    back to the pool (SGLang's ``release_kv_cache`` of a request without a row)."""
    if req.mamba_slot is not None:
        assert state.mamba is not None  # a state slot implies the Mamba component
        state.mamba.free([req.mamba_slot])
        req.mamba_slot = None
    del state.requests[req.rid]


def load_back_requester(state: CacheState, rid: object) -> Request:
    """``load_back {rid}``'s request: a waiting one (InvalidInput otherwise), and not one whose
    admission restores it from its session's slot (that one is not matched, so nothing is
    loaded back for it: InvalidInput)."""
    req = get_request(state, rid, admitted=False)
    if req.session is not None and sessions.slot_of(state, req.session) is not None:
        raise InvalidInput(f"load_back: request {req.rid!r} is restored from session "
                           f"{req.session!r}'s slot, not matched")
    return req


def load_back_for(state: CacheState, req: Request, node: Node, last_device_node: Node,
                  mem_quota: int | None) -> tuple[tuple[int, ...], Node]:
    """The scheduler's ``init_load_back`` for a waiting request (``req=req``) after its match
    found a host hit: as :func:`~uniradix.spec.host.init_load_back` with the request as the
    requester.  With Mamba, a load back of a host-only state copies it into the request's own
    state slot, taken fresh when it holds none; the request keeps that slot, and its admission
    uses it rather than taking another (upstream's ``req.mamba_pool_idx``).  ``req`` is
    :func:`load_back_requester`'s."""
    assert not req.admitted
    indices, last = host.init_load_back(state, node, last_device_node, mem_quota,
                                        req.mamba_slot)
    if state.mamba is not None:
        req.mamba_slot = state.host.request_state if state.host is not None else None
    return indices, last


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
    if components.aux_names(state):  # hybrid models: maybe a shorter length, a state copy
        cut = unfinished_cache_len(state, req, tokens)
        if cut is None:
            return
        tokens, kv = tokens[:cut[0]], kv[:cut[0]]
        out = rules.insert(state, tokens, req.extra_key, kv, req.cache_protected_len, chunked,
                           mamba_value=cut[1], priority=req.priority)
        if cut[1] is not None and out.mamba_exist:  # the node had a state: the copy goes
            assert state.mamba is not None  # a state copy implies the Mamba component
            state.mamba.free(list(cut[1]))
    else:
        rules.insert(state, tokens, req.extra_key, kv, req.cache_protected_len, chunked,
                     priority=req.priority)
    m = rules.match_prefix(state, tokens, req.extra_key)
    new = list(m.device_indices)
    assert not components.aux_names(state) or len(new) == len(tokens)
    assert req.cache_protected_len <= len(new) + state.config.page_size - 1
    req.row[req.cache_protected_len: len(new)] = new[req.cache_protected_len:]
    assert req.lock is not None, "an admitted request holds a lock"
    rules.dec_lock_ref(state, req.lock)
    req.lock = rules.inc_lock_ref(state, m.last_device_node)
    req.cache_protected_len = len(new)


def unfinished_cache_len(state: CacheState, req: Request, tokens: list[int]
                         ) -> tuple[int, tuple[int, ...] | None] | None:
    """Hybrid models, ``cache_unfinished_req``: how many of the computed tokens go into the tree
    and the Mamba state copy that goes with them; None: nothing is cached this time.

    SWA: up to the first SWA tombstone past the protected length that a lock holds (another
    request's matched prefix runs through it): the insert would not give it the request's
    slots (``components.insert_overlap``), the re-match would stop above it, and the request
    keeps its own slots from there on.  With the extra buffer: :func:`unfinished_track_cache`.
    Mamba: the copy is a fresh state slot (one state
    evicted when the pool is empty); with none to be had, or with a cut below the page-aligned
    length (the state is the whole computed length's), the chunk is not cached."""
    if state.config.mamba_extra_buffer:
        return unfinished_track_cache(state, req, tokens)
    n = len(rules.aligned_units(state, tokens))
    names = components.aux_names(state)
    slot: tuple[int, ...] | None = None
    if "mamba" in names:
        got = new_state_slot(state)
        if got is None:
            return None
        slot = (got,)
    cut = n
    if "swa" in names:
        start = 0
        for node, shared in rules.insert_plan(state, req.extra_key, tuple(tokens[:n])):
            if start >= req.cache_protected_len and components.swa_tombstone_held(node):
                cut = start
                break
            start += shared
    if slot is not None and cut < n:
        assert state.mamba is not None  # a state slot implies the Mamba component
        state.mamba.free(list(slot))
        return None
    return cut, slot


def unfinished_track_cache(state: CacheState, req: Request, tokens: list[int]
                           ) -> tuple[int, tuple[int, ...]] | None:
    """Extra buffer, ``cache_unfinished_req``: the tokens up to the last track length go into
    the tree with the tracked state's slot, handed over (a fresh slot, one state evicted when
    the pool is empty, takes its place among the track slots); the track length is used up.
    None, nothing cached: no cacheable track length since the last cache
    (:func:`cached_track_len`), or no fresh slot to be had."""
    length = cached_track_len(state, req.mamba_track_len)
    req.mamba_track_len = None
    if length == 0:
        return None
    fresh = new_state_slot(state)
    if fresh is None:
        return None
    assert req.mamba_track is not None
    k = keep_track_index(req)
    donated, req.mamba_track[k] = req.mamba_track[k], fresh
    return length, (donated,)


def cache_finished_req(state: CacheState, req: Request, is_insert: bool = True) -> None:
    """Cache a finished request and release it.

    The committed tokens, page-aligned, go into the tree (duplicates freed); the pages of the
    committed positions from there (the unaligned tail, its page whole) go back to the pool;
    the request's lock is released.  With ``is_insert`` false (an aborted request) the pages of
    every committed position the request owns are freed instead.  Nothing past the committed
    positions' pages is read (the seed frees from the committed length).
    """
    rules.check_flag("is_insert", is_insert)
    is_insert = is_insert and finish_inserts(req)
    if req.session is not None:  # streaming sessions: park the row, or end the session
        if is_insert:
            sessions.park(state, req)
        else:
            sessions.abort_running(state, req)
        return
    end = round_up(req.committed, state.config.page_size)
    state_kept = False  # Mamba: the tree took the request's state slot
    if state.config.disable:
        state.kv.free(req.row[:end])
        free_state_slot(state, req, state_kept)
        release(state, req)
        return
    tokens = req.all_ids[: req.committed]
    kv = req.row[: req.committed]
    free_from = req.cache_protected_len
    if is_insert:
        mamba_value = None if req.mamba_slot is None else [req.mamba_slot]
        if req.mamba_track is not None:  # extra buffer: the tracked state, at its length
            tokens, kv = finished_track_cut(state, req, tokens, kv)
            mamba_value = [req.mamba_track[keep_track_index(req)]]
        out = rules.insert(state, tokens, req.extra_key, kv, req.cache_protected_len, False,
                           mamba_value=mamba_value, swa_evicted_seqlen=req.swa_evicted_seqlen,
                           priority=req.priority)
        state_kept = mamba_value is not None and not out.mamba_exist
        aligned = len(rules.aligned_units(state, tokens))
        # NOTE: the seed frees from the aligned length; it is never below the protected length
        # for a request admitted through match_prefix, and freeing below it would free the
        # tree's own slots, so the spec states the intended bound.
        free_from = max(aligned, req.cache_protected_len)
    state.kv.free(req.row[free_from:end])
    free_state_slot(state, req, state_kept)
    assert req.lock is not None, "an admitted request holds a lock"
    rules.dec_lock_ref(state, req.lock)
    release(state, req)


def cached_track_len(state: CacheState, length: int | None) -> int:
    """Extra buffer: the length a tracked state is cached at: its own, when whole pages; 0
    (not cached) without one, or when its length is not page-aligned (a chunk that started
    inside a page: a node holds whole pages, and a state belongs at its own length only)."""
    if length is None or length % state.config.page_size:
        return 0
    return length


def finished_track_cut(state: CacheState, req: Request, tokens: list[int], kv: list[int]
                       ) -> tuple[list[int], list[int]]:
    """Extra buffer, ``cache_finished_req``: only the tokens up to the last track length are
    cached (none without a cacheable one, :func:`cached_track_len`); the committed slots past
    it are freed with the unaligned tail."""
    n = min(len(tokens), cached_track_len(state, req.mamba_track_len))
    return tokens[:n], kv[:n]


def request_state_slots(state: CacheState) -> list[str]:
    """Mamba: the state slots running requests hold (their own and, with the extra buffer,
    their track slots) are allocated, each held once, and none of them is the tree's; an
    admitted request holds as many track slots as :func:`held_track_slots` says (lazy: one
    between steps)."""
    if state.mamba is None:
        return []
    tree = {s for n in all_nodes(state) if components.has(n, "mamba")
            for s in (n.aux["mamba"].value or ())}
    seen: set[int] = set()
    errors = []
    for rid, req in state.requests.items():
        slots = ([] if req.mamba_slot is None else [req.mamba_slot]) + (req.mamba_track or [])
        if any(s in seen for s in slots) or len(set(slots)) != len(slots):
            errors.append(f"[request] {rid}: a state slot held twice")
        if any(s in tree for s in slots):
            errors.append(f"[request] {rid}: holds a state slot the tree holds")
        if any(not state.mamba.is_allocated(s) for s in slots):
            errors.append(f"[request] {rid}: holds a state slot the pool says is free")
        if req.mamba_track is not None and len(req.mamba_track) != held_track_slots(state):
            errors.append(f"[request] {rid}: holds {len(req.mamba_track)} track slots, not "
                          f"{held_track_slots(state)}")
        seen.update(slots)
    return errors


def free_state_slot(state: CacheState, req: Request, kept: bool) -> None:
    """Mamba: the request's state slot goes back to the pool unless the tree took it.  With
    the extra buffer the tree takes a track slot, never the request's own: that one goes back,
    then the track slots but the kept one."""
    if req.mamba_track is not None:
        assert state.mamba is not None  # track slots imply the Mamba component
        keep = keep_track_index(req) if kept else None
        state.mamba.free([req.mamba_slot] if req.mamba_slot is not None else [])
        state.mamba.free([s for k, s in enumerate(req.mamba_track) if k != keep])
        req.mamba_slot, req.mamba_track, req.mamba_track_len = None, None, None
        return
    if req.mamba_slot is not None and not kept:
        assert state.mamba is not None  # a state slot implies the Mamba component
        state.mamba.free([req.mamba_slot])
    req.mamba_slot = None
