"""The Mamba component plug-in (spec/components.py's Mamba rules): a node may hold one Mamba
state (a one-slot int64 tensor of the Mamba allocator); a match must end at a node with one."""

from __future__ import annotations

from typing import Any

import torch

from ..cache import _core
from ..errors import InvalidInput, Unsupported
from ..frees import FreeBatch, host_alloc, release
from ..params import EvictParams, MatchPrefixParams, MatchResult
from ..tiers.host import Copy, HostSlotAllocator
from . import MAMBA_ID, AuxComponent, Validator

_INT64 = torch.int64
_CPU = torch.device("cpu")  # (a slot given as an int: a CPU tensor whatever the default device)
# the C core's copy of a plain CPU state (fast/_core.c state_copy: a one-slot view of a slab
# of its own, the state's value written into it, in place of a torch op per insert), or None
_state_copy = getattr(_core, "state_copy", None) if _core is not None else None


def mamba_state(mv: Any) -> torch.Tensor:
    """An insert's ``mamba_value`` checked (a one-slot int64 tensor) and copied: the tree holds
    its own tensor, which no later write to the caller's can change."""
    if mv is None:
        raise InvalidInput("insert: the Mamba component needs a mamba_value")
    if not isinstance(mv, torch.Tensor) or mv.dtype != _INT64 or mv.shape != (1,):
        raise InvalidInput("insert: mamba_value must be a one-slot int64 tensor")
    if _state_copy is not None:  # (the C core: a view of its slab, the value written in)
        own = _state_copy(mv)
        if own is not None:
            return own
    return mv.clone()


class MambaComponent(AuxComponent):
    """Mamba (linear attention) states: one per node at most, on the last node of an insert;
    a lock holds the node's own state; a split leaves it on the lower part."""

    name = "mamba"
    component_id = MAMBA_ID
    internal_priority = 0
    host_allocator: Any = None  # the host state pool, with a host tier
    controller: Any = None  # the host tier's controller (its copy logs)
    request_state: int | None = None  # the requester's state slot of the last load back
    request_slot: Any = None  # the same as a 0-d tensor when the load back took it
    requester = True  # False while a load back without a requester runs: no slot for one
    extra_buffer = False  # enable_mamba_extra_buffer: requests cache their tracked states
    extra_buffer_lazy = False  # enable_mamba_extra_buffer_lazy: one track slot a request
    _loading: torch.Tensor | None = None  # the state slot a load back in progress took

    def reset(self) -> None:
        super().reset()
        self.allocator = self.cache.mamba_allocator
        self.owned: set = set()  # state slots the tree holds (validate_slots)
        self.tracks_slots = self.cache.validate_slots
        self.request_state = self.request_slot = None
        self._loading = None
        if self.host_allocator is not None:  # the host tier's reset clears its pools
            self.host_allocator.clear()

    def units(self, node: Any) -> int:
        return 1

    def on_set(self, value: torch.Tensor) -> None:
        self.owned.add(int(value[0]))

    def queue_free(self, node: Any, value: torch.Tensor, batch: FreeBatch, leaf: bool) -> None:
        batch.states.append(value)

    def released(self, states: list) -> None:
        """Slot bookkeeping after the batch's states went back."""
        if self.cache.validate_slots:
            for p in states:
                self.owned.difference_update(p.tolist())

    # -- match -----------------------------------------------------------------------------
    def validator(self) -> Validator:
        i = self.i

        def ok(node: Any, k: int) -> bool:
            return node.aux[i].value is not None
        return ok

    def host_validator(self) -> Validator:
        i = self.i

        def ok(node: Any, k: int) -> bool:
            rec = node.aux[i]
            return rec.value is not None or rec.host_value is not None
        return ok

    # -- split -----------------------------------------------------------------------------
    def split(self, upper: Any, child: Any, k: int) -> None:
        """The state stays on the lower part, which moves to the front of the list."""
        rec = child.aux[self.i]
        if rec.value is not None:
            self.lru.move_to_front(rec)

    # -- insert ----------------------------------------------------------------------------
    def check_insert(self, plan: list, prev: int, params: Any, e: int) -> Any:
        mv = params.mamba_value
        state = mamba_state(mv)
        if self.cache.validate_slots:
            slot = int(mv[0])
            is_alloc = getattr(self.allocator, "is_allocated", None)
            if is_alloc is not None and not is_alloc(slot):
                raise InvalidInput(f"insert: mamba slot {slot} is not allocated")
            if slot in self.owned:
                raise InvalidInput(f"insert: mamba slot {slot} is already the tree's")
        return state

    def commit(self, target: Any, is_new: bool, pos: int, prepared: Any, e: int,
               result: dict) -> None:
        """The last node takes the state unless it has one (``mamba_exist``)."""
        rec = target.aux[self.i]
        if is_new or rec.value is None:
            self.set(target, prepared)
            if not is_new:
                self.cache._stamp(target)
        else:
            self.lru.move_to_front(rec)
            self.cache._stamp(target)
            result["mamba_exist"] = True

    # -- requests --------------------------------------------------------------------------
    def _request_state(self, req: Any) -> torch.Tensor:
        idx = getattr(req, "mamba_pool_idx", None)
        if idx is None:
            raise InvalidInput("the request holds no Mamba state (req.mamba_pool_idx is None)")
        t = idx if isinstance(idx, torch.Tensor) else torch.tensor(int(idx), device=_CPU)
        return t.reshape(1).to(_INT64)

    def try_alloc_slot(self) -> torch.Tensor | None:
        """One free Mamba slot, evicting one state when there is none; None when still none
        (every state in the tree is locked)."""
        slot = self.allocator.alloc(1)
        if slot is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
            slot = self.allocator.alloc(1)
        return None if slot is None else slot.reshape(1).to(_INT64)

    def _alloc_slot(self) -> torch.Tensor:
        """One free Mamba slot, evicting one state when there is none."""
        slot = self.try_alloc_slot()
        if slot is None:
            raise InvalidInput("no Mamba slot for the request's state copy: every state "
                               "in the tree is locked and the pool is full")
        return slot

    # -- the extra buffer (spec/requests.py: track slots, the tracked state cached) ----------
    def keep_index(self, req: Any) -> int:
        """The track slot holding the last tracked state: the one the last track point wrote
        (the other of two, the same of one); lazy, the one ``mamba_next_track_idx`` names (a
        track point moves it to the slot it takes).  sglang's pool answers where it can."""
        buf, nxt = req.mamba_ping_pong_track_buffer, req.mamba_next_track_idx
        if buf is None or nxt is None:
            raise InvalidInput("the extra buffer needs the request's "
                               "mamba_ping_pong_track_buffer and mamba_next_track_idx")
        ask = getattr(self.cache.req_to_token_pool, "get_mamba_ping_pong_keep_idx", None)
        if ask is not None:
            return int(ask(req))
        if self.extra_buffer_lazy:
            return int(nxt)
        return 1 - int(nxt) if len(buf) == 2 else int(nxt)

    def finished_cache_len(self, req: Any, n: int) -> int:
        """How many of a finished request's ``n`` committed tokens are cached: all, or with
        the extra buffer those up to its last track length (none without one)."""
        if not self.extra_buffer:
            return n
        return min(n, self._cached_len(getattr(req, "mamba_last_track_seqlen", None)))

    def _cached_len(self, length: Any) -> int:
        """The length a tracked state is cached at: its own when whole pages, else 0 (none:
        a node holds whole pages, a state belongs at its own length; spec/requests.py
        ``cached_track_len``)."""
        if length is None or int(length) % self.cache.page_size:
            return 0
        return int(length)

    def donate_tracked(self, req: Any) -> tuple[int, Any] | None:
        """Extra buffer, ``cache_unfinished_req``: the last track length and the tracked
        state's slot, handed to the tree (a fresh slot, one state evicted when the pool is
        empty, takes its place); the track length is used up.  None, nothing cached: no track
        point since the last cache at a whole number of pages, or no fresh slot."""
        length = self._cached_len(req.mamba_last_track_seqlen)
        req.mamba_last_track_seqlen = None
        if length == 0:
            return None
        fresh = self.try_alloc_slot()
        if fresh is None:
            return None
        donate = getattr(self.cache.req_to_token_pool, "donate_mamba_ping_pong_slot", None)
        if donate is not None:  # sglang's pool: keeps its request-to-slot table in step
            return length, donate(req, fresh).reshape(1).to(_INT64)
        k = self.keep_index(req)
        buf = req.mamba_ping_pong_track_buffer
        donated = buf[k].reshape(1).to(_INT64).clone()
        buf[k] = fresh[0]
        return length, donated

    def lazy_track_point(self, req: Any, length: int) -> bool:
        """Lazy extra buffer, a decode step reaching a track point (spec/requests.py
        ``lazy_track``; upstream's scheduler does it in two halves, before and after the
        forward): a fresh slot (one state evicted when the pool is empty) goes into the empty
        track position and ``mamba_next_track_idx`` moves there, the state at ``length`` is
        written into it, and the old slot goes back.  With no fresh slot the state goes over
        the only one.  ``mamba_last_track_seqlen`` becomes ``length``; returns whether a fresh
        slot was had (a request finishing on a step without one caches nothing)."""
        buf = req.mamba_ping_pong_track_buffer
        if buf is None or req.mamba_next_track_idx is None or len(buf) != 2:
            raise InvalidInput("the lazy extra buffer needs the request's two-position "
                               "mamba_ping_pong_track_buffer and mamba_next_track_idx")
        req.mamba_last_track_seqlen = length
        other = 1 - int(req.mamba_next_track_idx)
        if int(buf[other]) != -1:
            raise InvalidInput("lazy extra buffer: both track positions hold a slot at a "
                               "track point")
        fresh = self.try_alloc_slot()
        if fresh is None:
            return False
        pool = self.cache.req_to_token_pool
        put = getattr(pool, "set_mamba_ping_pong_slot", None)
        if put is None:  # a pool without sglang's request-to-slot table
            def put(r: Any, k: int, v: Any) -> None:
                r.mamba_ping_pong_track_buffer[k] = v
        put(req, other, fresh[0])
        req.mamba_next_track_idx = other
        # the old slot as upstream frees it: read from the request's buffer, on its device
        # (a CUDA pool's free list takes only CUDA slots), before that position is emptied
        release(self.allocator, [buf[1 - other].reshape(1).to(_INT64).clone()])
        put(req, 1 - other, -1)
        return True

    def _free_request_states(self, req: Any, kept: bool) -> None:
        """Extra buffer, a request's end: its own state slot goes back, then its track slots
        but the one the tree took (``kept``); lazy, an empty track position (-1) frees
        nothing."""
        keep = self.keep_index(req) if kept else None
        free = getattr(self.cache.req_to_token_pool, "free_mamba_cache", None)
        if free is not None:  # sglang's pool
            free(req, mamba_ping_pong_track_buffer_to_keep=keep)
            return
        pieces = []  # in free order: the request's own state, then its track slots
        if getattr(req, "mamba_pool_idx", None) is not None:
            pieces.append(self._request_state(req))
        buf = req.mamba_ping_pong_track_buffer
        rest = [int(s) for k, s in enumerate(buf.reshape(-1).tolist()) if k != keep and s != -1]
        if rest:
            pieces.append(torch.tensor(rest, dtype=_INT64, device=buf.device))
        release(self.allocator, pieces)  # (fast/frees.py: one write where the pool allows)
        req.mamba_pool_idx = req.mamba_ping_pong_track_buffer = req.mamba_next_track_idx = None

    def prepare_caching_req(self, req: Any, params: Any, finished: bool) -> None:
        """Finished: the request's own state goes to the tree.  Unfinished: the request keeps
        computing in its state, so a copy in a fresh slot goes to the tree (the pool's
        ``copy_from`` copies the data where the pool has any).  With the extra buffer the
        tracked state goes instead: finished, its track slot; unfinished, the slot
        ``donate_tracked`` handed over (no copy)."""
        if self.extra_buffer:
            if finished:
                buf = req.mamba_ping_pong_track_buffer
                params.mamba_value = buf[self.keep_index(req)].reshape(1).to(_INT64).clone()
            return
        src = self._request_state(req)
        if finished:
            params.mamba_value = src.clone()
            return
        # (the request path took the copy's slot already: compat._unfinished_cache_len)
        dst = params.mamba_value if params.mamba_value is not None else self._alloc_slot()
        pool = getattr(self.cache.req_to_token_pool, "mamba_pool", None)
        copy_from = getattr(pool, "copy_from", None)
        if copy_from is not None:
            copy_from(src, dst)
        params.mamba_value = dst

    def cleanup_caching_req(self, req: Any, finished: bool, result: Any, params: Any) -> None:
        """A state the tree did not take goes back: finished, the request's own (through the
        request pool's ``free_mamba_cache`` where it has one); unfinished, the copy."""
        exist = result.mamba_exist if result is not None else True
        if finished and self.extra_buffer:
            if getattr(req, "mamba_ping_pong_track_buffer", None) is not None:
                self._free_request_states(req, not exist)
            return
        if finished:
            if not exist:
                return  # the tree holds the request's state now
            free = getattr(self.cache.req_to_token_pool, "free_mamba_cache", None)
            if free is not None:
                free(req)
            elif getattr(req, "mamba_pool_idx", None) is not None:
                release(self.allocator, [self._request_state(req)])  # (fast/frees.py)
                req.mamba_pool_idx = None
        else:
            value = params.mamba_value if params is not None else None
            if value is not None and exist:
                release(self.allocator, [value])
            req.mamba_last_track_seqlen = None

    # -- copy-on-write (match_prefix with cow_mamba) -----------------------------------------
    def check_cow_request(self, req: Any) -> int | None:
        """The request of a ``cow_mamba`` match and its state slot (None: it has none), which
        must be an allocated state slot the tree does not hold (checked where the cache tracks
        slots, ``validate_slots``)."""
        if req is None:
            raise InvalidInput("match_prefix: cow_mamba needs the request (MatchPrefixParams.req)")
        idx = getattr(req, "mamba_pool_idx", None)
        if idx is None:
            return None
        if isinstance(idx, torch.Tensor):
            if idx.numel() != 1 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
                raise InvalidInput(f"match_prefix: req.mamba_pool_idx must be one integer slot, "
                                   f"got {idx!r}")
            slot = int(idx.item())  # (one element: what indexing it gives, without 2 torch calls)
        elif isinstance(idx, bool) or not isinstance(idx, int):
            raise InvalidInput(f"match_prefix: req.mamba_pool_idx must be null or an int, "
                               f"got {idx!r}")
        else:
            slot = idx
        if self.cache.validate_slots:
            is_alloc = getattr(self.allocator, "is_allocated", None)
            if is_alloc is not None and not is_alloc(slot):
                raise InvalidInput(f"match_prefix: mamba_slot {slot} is not allocated")
            if slot in self.owned:
                raise InvalidInput(f"match_prefix: mamba_slot {slot} is the tree's")
        return slot

    def match_prefix_cow(self, params: Any) -> MatchResult:
        """``match_prefix`` for a request with ``cow_mamba`` (spec/mamba_cow.py): the plain
        match; then, when the best match node holds a state on the device, the request copies
        it (``req.mamba_cow_src_index``, ``req.mamba_needs_clear`` False) into its own state
        slot: the one it has, else a fresh one (``req.mamba_pool_idx``); when the pool is
        empty, one state is evicted while the matched node is locked.  Where no slot can be
        had (every other state locked) upstream asserts; here the request keeps no slot
        (``mamba_pool_idx`` None) and the caller decides (a scheduler would retract it)."""
        req = params.req
        has_slot = self.check_cow_request(req) is not None
        cache = self.cache
        result = cache.match_prefix(MatchPrefixParams(key=params.key))
        best = result.best_match_node
        if best is cache.root_node:
            return result
        src = best.aux[self.i].value
        if src is None:
            return result
        if not has_slot:
            slot = self._take_state_slot(best)
            if slot is not None:
                req.mamba_pool_idx = slot
        req.mamba_cow_src_index = src
        req.mamba_needs_clear = False
        return result

    def _take_state_slot(self, keep: Any) -> torch.Tensor | None:
        """A fresh state slot (a 0-d int64 tensor), evicting one state (never ``keep``'s: it is
        locked meanwhile) when the pool is empty; None when none could be had."""
        cache = self.cache
        slot = self.allocator.alloc(1)
        if slot is None:
            lock = cache.inc_lock_ref(keep)
            try:
                cache.evict(EvictParams(num_tokens=0, mamba_num=1))
            finally:
                cache.dec_lock_ref(keep, lock.to_dec_params())
            slot = self.allocator.alloc(1)
        if slot is None:
            return None
        return slot.reshape(-1)[0].to(_INT64)

    # -- locks -----------------------------------------------------------------------------
    def lock(self, node: Any, result: Any) -> None:
        if node is self.cache.root_node:
            return
        rec = node.aux[self.i]
        if rec.value is None:
            result.skip_lock_node_ids.setdefault(MAMBA_ID, set()).add(node.id)
        else:
            self._lock_rec(node, rec, 1)

    def unlock(self, node: Any, params: Any, unlocked: list) -> None:
        if node is self.cache.root_node:
            return
        skip = params.skip_lock_node_ids.get(MAMBA_ID, ()) if params is not None else ()
        rec = node.aux[self.i]
        if node.id not in skip and rec.lock > 0:
            self._unlock_rec(node, rec, 1, unlocked)

    # -- the host tier (fast/tiers/host.py) -------------------------------------------------
    def attach_host(self, tier: Any, config: Any) -> None:
        """The host tier is composed: its host state pool (``config.host_mamba_allocator``,
        else ``host_mamba_slots`` host states, default twice the device pool's size)."""
        if tier.controller.device_kv is not None:
            raise Unsupported("a host tier that moves KV data (device_kv / host_kv) with Mamba: "
                              "moving Mamba states to the host is not supported")
        pool = config.host_mamba_allocator
        if pool is None:
            n = config.host_mamba_slots
            if n is None:
                size = getattr(self.allocator, "size", None)
                if type(size) is not int:
                    raise InvalidInput("a host tier with Mamba needs host_mamba_slots (the "
                                       "Mamba allocator has no size)")
                n = 2 * size
            pool = HostSlotAllocator(n, 1)
        self.host_allocator = pool
        self.controller = tier.controller
        self.request_state = self.request_slot = None

    def _copy(self, kind: str, src: torch.Tensor, dst: list) -> None:
        copies = self.controller.state_copies
        if copies is not None:
            copies.append(Copy(kind, src.tolist(), dst))

    def backup(self, node: Any) -> bool:
        """The node's state goes to a fresh host state slot with the Full backup (the oldest
        host-only states are evicted for room); without one the backup fails."""
        rec = node.aux[self.i]
        if rec.value is None or rec.host_value is not None:
            return True
        pool = self.host_allocator
        if pool.available_size() < 1:
            self.evict_host_states(1)
        slot = host_alloc(pool, 1) if pool.available_size() >= 1 else None
        if slot is None:
            return False
        # not a view of the pool's list (sglang's host pool hands out slices of it: such a
        # view would keep the whole list alive), as one int64 slot; a tensor of its own as it is
        if slot.dtype is not _INT64 or slot.shape != (1,):
            slot = slot.reshape(1).to(_INT64, copy=True)
        elif slot._base is not None:
            slot = slot.clone()
        rec.host_value = slot
        self._copy("backup", rec.value, rec.host_value.tolist())
        return True

    def drop_host(self, node: Any) -> int:
        """The node's host state (if any) goes back to the host state pool; returns 1 when
        there was one."""
        rec = node.aux[self.i]
        if rec.host_value is None:
            return 0
        self.host_lru.pop(rec, None)
        release(self.host_allocator, [rec.host_value])  # (fast/frees.py)
        rec.host_value = None
        return 1

    def evict_host_states(self, num: int) -> int:
        """Free at least ``num`` host states: the host list oldest first; a host leaf leaves
        the tree with all its host data, any other node only loses its host state
        (``evict_host_oldest``: O(records taken), not a copy of the list per call)."""
        return self.evict_host_oldest(num)

    def _host_rec_live(self, rec: Any) -> bool:
        """A listed record ``evict_host_states`` takes: its node is in the tree and the
        record still on the host list."""
        return rec.node.parent is not None and rec in self.host_lru

    def _evict_host_rec(self, rec: Any) -> int:
        """Free one listed record's host state (``evict_host_states``); returns the states
        freed."""
        node = rec.node
        tier = self.cache.tier
        if tier.is_host_leaf(node):  # it leaves the tree with all its host data
            before = self.host_allocator.available_size()
            tier.evict_host_leaf(node)
            return self.host_allocator.available_size() - before
        return self.drop_host(node)

    def wants_load_back(self, node: Any) -> bool:
        """The node's state is on the host only."""
        rec = node.aux[self.i]
        return rec.value is None and rec.host_value is not None

    def _room(self) -> bool:
        """Whether a device state slot is free, evicting one state when there is none."""
        if self.allocator.available_size() < 1:
            self.cache._evict_units(0, {"swa": 0, "mamba": 1})
        return self.allocator.available_size() >= 1

    def reserve_load_back(self, node: Any) -> bool:
        """The requester's own state slot (``request_state``), taken before the load back
        weighs its size; none to be had: the load back fails (upstream asserts instead,
        docs/SPEC.md).  A requester that holds a slot already (``init_load_back`` set
        ``request_state`` to it) keeps it, and a load back without a requester takes none."""
        if self.request_state is not None or not self.requester:
            return True
        if not self._room():
            return False
        slot = self.allocator.alloc(1).reshape(-1)
        self.request_state = int(slot[0])
        self.request_slot = slot[0]  # the allocator's own element, for req.mamba_pool_idx
        return True

    def alloc_load_back(self, node: Any) -> bool:
        """After the Full data took its device slots (the seed's controller allocates the KV
        pool before the others): a fresh device state slot for the node's state (one state is
        evicted for room when the pool is empty).  When none can be had (every device state
        locked, for example by pending write-through acks), or the room-making took the node
        or its host state, the load back fails (upstream asserts instead, docs/SPEC.md)."""
        # (under write-back that eviction's backups may have evicted host states, this one too)
        if not self._room() or node.parent is None or not self.wants_load_back(node):
            return False
        self._loading = self.allocator.alloc(1).reshape(1).to(_INT64)
        return True

    def cancel_load_back(self, node: Any) -> None:
        """A later component's ``alloc_load_back`` failed: the state slot goes back."""
        assert self._loading is not None
        release(self.allocator, [self._loading])  # (fast/frees.py)
        self._loading = None

    def commit_load_back(self, node: Any) -> None:
        """The node takes its state slot and the host state is copied there (and into the
        requester's own slot); the state joins the Mamba list as its newest, without a new
        access stamp (the Full eviction order does not move, as upstream's)."""
        rec = node.aux[self.i]
        host, value = rec.host_value, self._loading
        assert host is not None and value is not None
        self._loading = None
        self._copy("load", host, value.tolist())
        if self.request_state is not None:
            self._copy("load", host, [self.request_state])
        self.set(node, value)

    def host_lock(self, node: Any) -> Any:
        rec = node.aux[self.i]
        if node is not self.cache.root_node and rec.host_value is not None:
            rec.host_lock += 1
            self.host_lru.pop(rec, None)
            return True
        return None

    def host_unlock(self, node: Any, token: Any) -> None:
        rec = node.aux[self.i]
        if rec.host_lock > 0:
            rec.host_lock -= 1
            if rec.host_lock == 0 and rec.value is None and rec.host_value is not None:
                self.host_lru[rec] = None  # host-only and unlocked again: the newest

    # -- checks ----------------------------------------------------------------------------
    def value_violations(self, node: Any, value: torch.Tensor, errors: list) -> None:
        if len(value) != 1:
            errors.append(f"[aux] {node!r}: a Mamba state is one slot")

    def tree_violations(self, acc: dict, errors: list) -> None:
        super().tree_violations(acc, errors)
        states = [s for v in acc["values"] for s in v.tolist()]
        if len(set(states)) != len(states):
            errors.append("[aux] a Mamba slot is held twice in the tree")
        if self.cache.validate_slots and set(states) != self.owned:
            errors.append("[aux] the owned Mamba slots differ from the tree's")
