"""``FastAdapter``: runs trace steps on ``uniradix.fast.UnifiedRadixCache`` through its public,
upstream-compatible API (tensors, RadixKey, params objects), over the same environment models
as the spec (a torch-facing wrapper of ``PagedPool``; a growable req_to_token table; the same
scheduler rules for requests as spec/requests.py)."""

from __future__ import annotations

from array import array
from typing import Any

import torch

from uniradix import fast
from uniradix.conformance.adapters.base import StepAdapter, args_of, check_cow_args, check_supported, path_arg
from uniradix.conformance.adapters.capabilities import CAPABILITIES
from uniradix.conformance.adapters.host_ops import FastHostOps
from uniradix.conformance.adapters.session_ops import FastSessionOps, SessionRef, check_session_arg
from uniradix.conformance.adapters.storage_ops import FastStorageOps
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import CacheError as SpecCacheError
from uniradix.spec.errors import HandleError
from uniradix.spec.errors import InvalidInput as SpecInvalidInput
from uniradix.spec.requests import output_token_id
from uniradix.spec.world import PagedPool

REJECTIONS = (SpecCacheError, fast.CacheError)
_CPU = torch.device("cpu")


class ReqToTokenPool:
    """SGLang's req_to_token table: one row of KV slots per running request (grows)."""

    def __init__(self, rows: int = 16, cols: int = 256, device: torch.device = _CPU) -> None:
        self.req_to_token = torch.zeros((rows, cols), dtype=torch.int64, device=device)
        self.free_rows = list(range(rows))

    def ensure(self, cols: int) -> None:
        r, c = self.req_to_token.shape
        if cols > c:
            grown = torch.zeros((r, max(cols, 2 * c)), dtype=torch.int64, device=self.req_to_token.device)
            grown[:, :c] = self.req_to_token
            self.req_to_token = grown

    @property
    def free_slots(self) -> list:
        """SGLang's name for the free rows (a released session row goes back here)."""
        return self.free_rows

    def take_row(self) -> int:
        if not self.free_rows:
            r, c = self.req_to_token.shape
            self.req_to_token = torch.cat([self.req_to_token, torch.zeros((r, c), dtype=torch.int64)])
            self.free_rows = list(range(r, 2 * r))
        return self.free_rows.pop(0)

    def write(self, where, values: torch.Tensor) -> None:
        self.req_to_token[where] = values


class Req:
    """The request fields the cache reads (SGLang's Req, reduced)."""

    def __init__(self, rid: str, tokens: list, extra_key: str | None, priority: int = 0,
                 session: str | None = None) -> None:
        self.rid = rid
        self.priority = priority  # given to its inserts (the policies' order, fast/policies.py)
        # streaming sessions (fast/sessions.py): SGLang's Session reference and the row lengths
        # the cache parks
        self.session_id = session
        self.session = SessionRef(session) if session is not None else None
        self.kv_committed_len = self.kv_allocated_len = 0
        self.origin_input_ids = tokens
        self.output_ids: list = []
        self.extra_key = extra_key
        self.req_pool_idx = -1
        self.committed = 0  # tokens whose KV is in the row
        self.row_len = 0  # slots reserved for the row (whole pages)
        # reserved slots not yet in the row (positions committed..row_len): as in SGLang, the
        # row holds only computed positions; past them a reused row keeps stale slots
        self.pending = torch.empty((0,), dtype=torch.int64)
        self.cache_protected_len = 0
        self.last_node = None
        self.dec_lock_params = None
        self.admitted = False
        self.prefix_indices = None
        self.mamba_branching_seqlen: int | None = None  # the admission match's (Mamba)

    @property
    def fill_ids(self) -> list:
        return (self.origin_input_ids + self.output_ids)[: self.committed]

    def pop_committed_kv_cache(self) -> int:
        return self.committed


def priority_arg(op: str, priority: Any) -> int:
    """A step's ``priority``: an int (bools are not), as the spec checks it."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise SpecInvalidInput(f"{op}: priority must be an int, got {priority!r}")
    return priority


def ints(name: str, xs) -> array:
    """A JSON list of ints as array('q'), with the spec's checks (bools are not ints)."""
    try:
        return fast.radix_key.as_token_array(xs)
    except fast.InvalidInput as e:
        raise fast.InvalidInput(f"{name}: {e}") from None


class FastAdapter(FastSessionOps, FastStorageOps, FastHostOps, StepAdapter):
    """Runs trace steps on the fast path."""

    rejections = REJECTIONS
    #: capability (conformance/traces/events.py): fast/ emits KV events (fast/events.py) once
    #: ``start_kv_events`` rebuilt the cache with them on, in the key mode asked for
    emits_kv_events = True
    capabilities = CAPABILITIES["fast"]

    #: whether the cache keeps its slot ledger (``validate_slots``, on by default over the
    #: conformance pools): without it (``fast-noledger``) the paths that decline under the
    #: ledger run, and an insert's slots outside the pool are not refused
    checks_slots = True

    def __init__(self, config: CacheConfig, slot_ledger: bool = True) -> None:
        check_supported(config, host_tier=True, storage=True)
        self._set_ledger(slot_ledger)
        self.config = config
        self.pool = PagedPool(config.kv_slots, config.page_size, "kv")
        self.alloc = PoolAllocator(self.pool, torch, whole_pages=True)
        self.rtt = ReqToTokenPool()
        hicache = None
        if config.has_host_tier:  # the host tier (conformance/adapters/host_ops.py)
            self.host_pool = PagedPool(config.host_slots, config.page_size, "host")
            hicache = self.hicache_config(config, PoolAllocator(self.host_pool, torch),
                                          log_copies=True)
            if config.storage:  # the storage tier (conformance/adapters/storage_ops.py)
                hicache.storage = self.storage_config(config)
        self.params = fast.CacheInitParams(
            disable=config.disable, req_to_token_pool=self.rtt,
            token_to_kv_pool_allocator=self.alloc, page_size=config.page_size,
            is_eagle=config.eagle, hicache=hicache, eviction_policy=config.eviction_policy,
            validate_slots=None if self.checks_slots else False)
        self.cache = fast.UnifiedRadixCache(self.params)
        self.handles: dict[int, tuple] = {}
        self.host_handles: dict[int, tuple] = {}
        self.requests: dict[str, Req] = {}

    def _set_ledger(self, slot_ledger: bool) -> None:
        """``fast-noledger``: the cache without its slot ledger, under that name."""
        if not slot_ledger:
            self.checks_slots = False
            self.capabilities = CAPABILITIES["fast-noledger"]

    def violations(self) -> list[str]:
        return self.cache.violations() + self.cache.sessions.violations()

    def start_kv_events(self, key_mode: str | None) -> str:
        """Rebuild the (still empty) cache with KV events on, hashing in ``key_mode`` (None:
        the config's ``storage_key_mode``); returns the mode.  Built without them otherwise, a
        Full-only cache keeps its C core (events move it to the composed tree)."""
        if self.cache.root_node.children or self.requests:
            raise RuntimeError("start_kv_events: the cache has already run steps")
        mode = key_mode if key_mode is not None else self.config.storage_key_mode
        self.params.enable_kv_cache_events = True
        self.params.kv_events_key_mode = mode
        self.cache = fast.UnifiedRadixCache(self.params)
        return mode

    def take_events(self) -> list:
        """The cache's KV events since the last call (``take_events``)."""
        return self.cache.take_events()

    def _tokens_of(self, node) -> list:
        parts = []
        while node is not None and node is not self.cache.root_node:
            parts.append(node.key)
            node = node.parent
        units = [u for part in reversed(parts) for u in part]
        if self.config.eagle:
            return [units[0][0]] + [u[1] for u in units] if units else []
        return units

    # while snapshot() runs: id(node) -> (node, its path), so that each path is walked once
    _paths: dict | None = None

    def _path(self, node) -> dict:
        if self._paths is None:
            return {"tokens": self._tokens_of(node), "extra_key": node.extra_key}
        hit = self._paths.get(id(node))
        if hit is None:
            hit = self._paths[id(node)] = (node, {"tokens": self._tokens_of(node),
                                                  "extra_key": node.extra_key})
        return hit[1]

    def _units_len(self, node) -> int:
        n = 0
        while node is not None and node is not self.cache.root_node:
            n += len(node.key)
            node = node.parent
        return n

    def snapshot(self) -> dict[str, Any]:
        self._paths = {}  # the tree does not change while it is read
        try:
            return self._snapshot()
        finally:
            self._paths = None

    def _snapshot(self) -> dict[str, Any]:
        nodes = []
        for node in self.cache.all_nodes():
            if node is self.cache.root_node:
                continue
            nodes.append({"path": self._path(node),
                          "value": None if node.value is None else node.value.tolist(),
                          "lock_ref": node.lock_ref, "hit_count": node.hit_count})
            if self.config.eviction_policy == "priority":  # as the spec's snapshot
                nodes[-1]["priority"] = node.priority
        nodes.sort(key=lambda n: (n["path"]["extra_key"] is not None, n["path"]["extra_key"] or "",
                                  n["path"]["tokens"]))
        return {"nodes": nodes,
                "device_leaf_order": [self._path(n) for n in self.cache.eviction_order()],
                "sizes": {"full_evictable": self.cache.evictable_size(),
                          "full_protected": self.cache.protected_size()},
                "pool": sorted(self.pool.allocated_pages()),
                "requests": [self._request_view(r) for _, r in sorted(self.requests.items())],
                **({"host": self.host_snapshot()}
                   if getattr(self, "host_pool", None) is not None else {}),
                **({"storage": self.storage_snapshot()} if self.config.storage else {}),
                **({"sessions": self.sessions_view()} if self.cache.sessions.slots else {})}

    def _request_view(self, req: Req) -> dict[str, Any]:
        row = (self.rtt.req_to_token[req.req_pool_idx, :req.committed].tolist()
               + req.pending.tolist()) if req.admitted else []
        return {"rid": req.rid, "admitted": req.admitted, "row": row,
                "committed": req.committed, "protected": req.cache_protected_len}

    # -- v1 ops --------------------------------------------------------------------------------
    def _key(self, tokens, extra_key) -> fast.RadixKey:
        return fast.RadixKey(tokens, extra_key, is_bigram=self.config.eagle)

    def op_alloc(self, step: dict) -> dict:
        (n,) = args_of(step, "n")
        return {"slots": self.pool.alloc(n)}

    def op_free(self, step: dict) -> dict:
        (slots,) = args_of(step, "slots")
        self.pool.free(list(ints("slots", slots)))
        return {}

    def op_insert(self, step: dict) -> dict:
        tokens, value, extra_key, prev, chunked, priority = args_of(
            step, "tokens", "value", extra_key=None, prev_prefix_len=0, chunked=False, priority=0)
        key = self._key(tokens, extra_key)
        v = torch.frombuffer(bytearray(ints("value", value)), dtype=torch.int64) if len(value) \
            else torch.empty((0,), dtype=torch.int64)
        res = self.cache.insert(fast.InsertParams(key=key, value=v, prev_prefix_len=prev,
                                                  chunked=chunked,
                                                  priority=priority_arg("insert", priority)))
        return {"prefix_len": res.prefix_len, "freed": self.pool.take_freed()}

    def op_match_prefix(self, step: dict) -> dict:
        tokens, extra_key, cow, mamba_slot = args_of(step, "tokens", extra_key=None,
                                                     cow_mamba=False, mamba_slot=None)
        check_cow_args(self.config, cow, mamba_slot)
        m = self.cache.match_prefix(fast.MatchPrefixParams(key=self._key(tokens, extra_key)))
        return {"device_indices": m.device_indices.tolist(),
                "host_hit_length": m.host_hit_length,
                "last_device_node": self._units_len(m.last_device_node),
                "last_host_node": self._units_len(m.last_host_node),
                "best_match_node": self._units_len(m.best_match_node)}

    def op_lock(self, step: dict) -> dict:
        (path,) = args_of(step, "node")
        tokens, extra_key = path_arg(path)
        node = self.cache.find_node(self._key(tokens, extra_key))
        i = step.get("i")
        if isinstance(i, bool) or not isinstance(i, int):  # as the upstream adapter
            raise SpecInvalidInput("a lock step needs an integer 'i' (the handle)")
        if i in self.handles:
            raise HandleError(f"lock: handle {i} is already in use")
        self.handles[i] = (node, self.cache.inc_lock_ref(node).to_dec_params())
        return {"handle": i}

    def op_unlock(self, step: dict) -> dict:
        (h,) = args_of(step, "handle")
        held = self.handles.get(h) if type(h) is int else None
        if held is None:
            raise HandleError(f"unlock: handle {h!r} was never issued or is already released")
        self.cache.dec_lock_ref(*held)
        del self.handles[h]
        return {}

    def op_evict(self, step: dict) -> dict:
        (n,) = args_of(step, "num_tokens")
        res = self.cache.evict(fast.EvictParams(num_tokens=n))
        return {"num_tokens_evicted": res.num_tokens_evicted, "freed": self.pool.take_freed()}

    def op_sizes(self, step: dict) -> dict:
        args_of(step)
        return {"full_evictable": self.cache.evictable_size(),
                "full_protected": self.cache.protected_size()}

    def op_reset(self, step: dict) -> dict:
        args_of(step)
        self.cache.reset()
        self.pool.reset()
        self.handles.clear()
        self.host_handles.clear()
        self.requests.clear()
        self.rtt = ReqToTokenPool()
        self.cache.req_to_token_pool = self.rtt
        return {}

    # -- request-level ops (docs/TRACE.md) -----------------------------------------------------
    def _get(self, rid, admitted: bool | None = None) -> Req:
        req = self.requests.get(rid) if isinstance(rid, str) else None
        if req is None:
            raise SpecInvalidInput(f"no request {rid!r}")
        if admitted is not None and req.admitted != admitted:
            raise SpecInvalidInput(f"request {rid!r} is {'already' if req.admitted else 'not yet'} admitted")
        return req

    def op_req_arrive(self, step: dict) -> dict:
        rid, tokens, extra_key, session, priority = args_of(step, "rid", "tokens", extra_key=None,
                                                            session=None, priority=0)
        priority = priority_arg("req_arrive", priority)
        if not isinstance(rid, str) or rid in self.requests:
            raise SpecInvalidInput(f"req_arrive: rid must be a new string, got {rid!r}")
        toks = list(ints("tokens", tokens))
        self._key(toks, extra_key)  # checks extra_key like every other op
        if not toks:
            raise SpecInvalidInput("req_arrive: a request needs at least one token")
        session = check_session_arg(session)
        self.check_session_arrival(session, toks, extra_key)
        self.requests[rid] = Req(rid, toks, extra_key, priority, session)
        return {}

    def op_req_admit(self, step: dict) -> dict:
        (rid,) = args_of(step, "rid")
        req = self._get(rid, admitted=False)
        ids = req.origin_input_ids
        m = self.cache.match_prefix(fast.MatchPrefixParams(
            key=self._key(ids[:-1] if len(ids) > 1 else [], req.extra_key),
            req=req if req.session is not None else None))
        if self.restored(req, m):  # a session's next turn, from its slot (session_ops.py)
            return {"prefix_len": req.committed}
        n = len(m.device_indices)
        req.req_pool_idx = self.rtt.take_row()
        self.rtt.ensure(n)
        self.rtt.req_to_token[req.req_pool_idx, :n] = m.device_indices
        req.committed = req.row_len = req.cache_protected_len = n
        req.last_node = m.last_device_node
        req.dec_lock_params = self.cache.inc_lock_ref(m.last_device_node).to_dec_params()
        req.mamba_branching_seqlen = getattr(m, "mamba_branching_seqlen", None)  # (as sglang's)
        req.admitted = True
        return {"prefix_len": n}

    def _reserve(self, req: Req, new_tokens: int) -> tuple[bool, int]:
        ps = self.config.page_size
        need = -(-(req.committed + new_tokens) // ps) * ps - req.row_len
        if need <= 0:
            return True, 0
        evicted = self._make_room(need)
        slots = self.alloc.alloc(need)
        if slots is None:
            return False, evicted
        req.pending = torch.cat([req.pending, slots])
        req.row_len += need
        return True, evicted

    def _make_room(self, need: int) -> int:
        """Evict what the allocator is short of for ``need`` slots; the tokens evicted."""
        short = need - self.alloc.available_size()
        return self.cache.evict(fast.EvictParams(num_tokens=short)).num_tokens_evicted \
            if short > 0 else 0

    def _commit(self, req: Req, n: int) -> None:
        """``n`` more tokens computed: their slots go into the row."""
        self.rtt.ensure(req.committed + n)
        self.rtt.req_to_token[req.req_pool_idx, req.committed: req.committed + n] = req.pending[:n]
        req.pending = req.pending[n:]
        req.committed += n

    def _count(self, n) -> int:
        if type(n) is not int or n < 0:
            raise SpecInvalidInput(f"n must be a non-negative int, got {n!r}")
        return n

    def op_req_chunk(self, step: dict) -> dict:
        rid, n, chunked = args_of(step, "rid", "n", chunked=True)
        if type(chunked) is not bool:
            raise SpecInvalidInput(f"chunked must be true or false, got {chunked!r}")
        req = self._get(rid, admitted=True)
        n = self._count(n)
        if n == 0:
            raise SpecInvalidInput(f"req {rid!r}: a prefill chunk needs at least one token")
        if req.committed + n > len(req.origin_input_ids):
            raise SpecInvalidInput(f"req {rid!r}: {n} more prompt tokens, only "
                                   f"{len(req.origin_input_ids) - req.committed} left")
        ok, evicted = self._reserve(req, n)
        if ok:
            self._commit(req, n)
            self.cache.cache_unfinished_req(req, chunked=chunked)
        return {"ok": ok, "evicted": evicted, "freed": self.pool.take_freed()}

    def op_req_decode(self, step: dict) -> dict:
        rid, n = args_of(step, "rid", "n")
        req = self._get(rid, admitted=True)
        n = self._count(n)
        if req.committed < len(req.origin_input_ids):
            raise SpecInvalidInput(f"req {rid!r}: decode before the prompt is computed")
        self._before_decode(req)
        ok, evicted = self._reserve(req, n)
        if ok:
            base = len(req.output_ids)
            req.output_ids.extend(output_token_id(req.origin_input_ids, base + j) for j in range(n))
            self._commit(req, n)
        return {"ok": ok, "evicted": evicted, "freed": self.pool.take_freed()}

    def _before_decode(self, req: Req) -> None:
        """What the scheduler does to a running request before its decode step reserves room
        (nothing with the Full component alone; SWA slides the window, fast_hybrid.py).  Its
        frees are the step's: ``op_req_decode`` takes the pool's freed log once, after it."""

    def _release(self, req: Req) -> None:
        del self.requests[req.rid]
        if req.req_pool_idx is not None and req.req_pool_idx >= 0:  # (None: a session's now)
            self.rtt.free_rows.append(req.req_pool_idx)
            self.rtt.free_rows.sort()

    def op_req_finish(self, step: dict) -> dict:
        (rid,) = args_of(step, "rid")
        req = self._get(rid, admitted=True)
        self.before_session_finish(req)
        self.cache.cache_finished_req(req)
        self._release(req)
        return {"freed": self.pool.take_freed()}

    def op_req_abort(self, step: dict) -> dict:
        (rid,) = args_of(step, "rid")
        req = self._get(rid)
        if req.admitted:
            self.before_session_finish(req)
            self.cache.cache_finished_req(req, is_insert=False)
        self._release(req)
        return {"freed": self.pool.take_freed()}

