"""The SWA component plug-in (spec/components.py's SWA rules): a node's SWA data is the SWA
slots its Full slots map to (one per key unit); a node without it is an SWA tombstone.

With a host tier (fast/tiers/host.py) a backup copies the node's SWA data to fresh SWA host
slots, a match counts SWA data on the host as part of a window, a load back brings the
host-only SWA data of the node's window back to fresh SWA slots mapped from the loaded full
slots, and a host lock holds one window of SWA host copies.  SWA host data that is on the host
only and not host-locked is on the component's host LRU list; ``evict_swa_host`` frees it
oldest first when the SWA host pool is short."""

from __future__ import annotations

from typing import Any

import torch

from ..cache import _core
from ..errors import InvalidInput, Unsupported
from ..frees import FreeBatch, host_alloc, release
from ..tiers.host import Copy, HostSlotAllocator
from . import SWA_ID, AuxComponent, Validator

# the key in ``skip_lock_node_ids`` under which a window lock that skipped nodes keeps the split
# count it saw, as {-1 - count} (never a node id, which is never negative)
SWA_SPLIT_EPOCH = -SWA_ID

_INT64 = torch.int64
_narrow, _narrow_copy = torch.narrow, torch.narrow_copy


class SwaComponent(AuxComponent):
    """Sliding-window attention: a match must end at a node with a full window of SWA data
    above it (a tombstone restarts the count); a lock holds one window; an insert restores
    tombstones it walks through inside the caller's window."""

    name = "swa"
    component_id = SWA_ID
    internal_priority = 1

    host_allocator: Any = None  # the SWA host pool, with a host tier
    controller: Any = None  # the host tier's controller (its copy logs)

    def __init__(self, cache: Any, i: int, window: int) -> None:
        self.window = window
        super().__init__(cache, i)
        self.map_pool = sglang_map_pool(cache.token_to_kv_pool_allocator)

    # where the C core may read the allocator's full-to-SWA map itself: the pool holding it
    # (``sglang_map_pool``), else None (the allocator's method runs)
    map_pool: Any = None

    def reset(self) -> None:
        super().reset()
        self._next_boundary = 1
        # splits so far: a window lock that skipped nodes remembers the count it saw, so that its
        # unlock also skips the upper parts split off those nodes after it (``split_from``)
        self._split_epoch = 0
        # a load back in progress: the window's host-only nodes (top-down), their SWA slots
        self._planned: list | None = None
        self._loading: torch.Tensor | None = None
        # the live host locks (id -> SwaHostLock): a split of a node one skipped extends it
        self.host_locks: dict[int, SwaHostLock] = {}
        if self.host_allocator is not None:  # the host tier's reset clears its pools
            self.host_allocator.clear()

    def units(self, node: Any) -> int:
        return len(node.key)

    def translate(self, full: torch.Tensor) -> torch.Tensor:
        """The SWA slots of the Full slots ``full`` (the allocator's map; over sglang's own
        allocator and pool, read by the C core: the same values, without two Python calls
        and torch's indexing)."""
        pool = self.map_pool
        if pool is not None:
            swa = _core.swa_gather(pool.full_to_swa_index_mapping, full)
            if swa is not None:
                return swa
        swa = self.cache.token_to_kv_pool_allocator.translate_loc_from_full_to_swa(full)
        return swa if swa.dtype is _INT64 else swa.to(_INT64)  # (.to: a torch call even as a no-op)

    def queue_free(self, node: Any, value: torch.Tensor, batch: FreeBatch, leaf: bool) -> None:
        if not leaf:  # a leaf's SWA slots go back with its Full slots, through the map
            batch.add("free_swa", node.value)

    # -- match -----------------------------------------------------------------------------
    def validator(self) -> Validator:
        i, window = self.i, self.window
        run = [float("inf")]  # contiguous SWA units ending at the current node

        def ok(node: Any, k: int) -> bool:
            if node.aux[i].value is None:
                run[0] = 0
                return False
            run[0] += k
            return run[0] >= window
        return ok

    def host_validator(self) -> Validator:
        """With a host tier: SWA data on the host only counts towards the window too."""
        i, window = self.i, self.window
        run = [float("inf")]

        def ok(node: Any, k: int) -> bool:
            rec = node.aux[i]
            if rec.value is None and rec.host_value is None:
                run[0] = 0
                return False
            run[0] += k
            return run[0] >= window
        return ok

    def load_window(self, node: Any) -> list:
        """The nodes of ``node``'s window (one window of SWA data on the device or the host,
        from the node up) whose SWA data is on the host only, top-down: what a load back of
        the node brings back.  The window ends early at a node with SWA data on neither."""
        out: list = []
        root, i, window = self.cache.root_node, self.i, self.window
        size, cur = 0, node
        while cur is not root and size < window:
            rec = cur.aux[i]
            if rec.value is not None:
                size += len(rec.value)
            elif rec.host_value is not None:
                out.append(cur)
                size += len(rec.host_value)
            else:
                break
            cur = cur.parent
        out.reverse()
        return out

    def host_hit(self, node: Any) -> int:
        """``swa_host_hit_length``: the SWA units of the window a load back of ``node``
        brings back."""
        i = self.i
        return sum(len(x.aux[i].host_value) for x in self.load_window(node))

    # -- split -----------------------------------------------------------------------------
    def split(self, upper: Any, child: Any, k: int) -> None:
        """SWA data, lock and boundary follow the cut: the upper part takes the first ``k``
        units of each, and both halves are re-filed at the front (the upper one first)."""
        i = self.i
        rec, up = child.aux[i], upper.aux[i]
        lru = self.lru
        if rec.value is not None:
            lru.remove(rec)
        up.lock = rec.lock
        upper.aux_lock += rec.lock
        self._split_epoch += 1
        up.split_from = ((self._split_epoch, child.id),) + rec.split_from
        up.boundary, rec.boundary = rec.boundary, None
        if rec.value is not None:
            aux = rec.value
            up.value = _narrow_copy(aux, 0, 0, k)
            rec.value = _narrow_copy(aux, 0, k, len(child.key))
            lru.push_front(up)
            lru.push_front(rec)
        # the host side (spec/components.py SWAComponent.split): host copy and host locks cut
        # as the device data; an upper part that is host-only joins the host list as newest
        up.host_lock = rec.host_lock
        up.host_boundary, rec.host_boundary = rec.host_boundary, None
        if rec.host_value is not None:
            hv = rec.host_value
            up.host_value = _narrow_copy(hv, 0, 0, k)
            rec.host_value = _narrow_copy(hv, 0, k, len(hv) - k)
            if up.value is None and up.host_lock == 0:
                self.host_lru[up] = None
        for lock in self.host_locks.values():
            if any(s is child for s in lock.skipped):
                lock.skipped.append(upper)

    # -- insert ----------------------------------------------------------------------------
    def check_insert(self, plan: list, prev: int, params: Any, e: int) -> Any:
        start, i = 0, self.i
        for node, shared in plan:
            if start < prev < start + shared and node.value is not None \
                    and node.aux[i].value is None and e < start + shared:
                raise InvalidInput("insert: prev_prefix_len falls inside an SWA tombstone "
                                   "that this insert would restore")
            start += shared
        return None

    def overlap(self, node: Any, pos: int, shared: int, value: torch.Tensor, prev: int,
                e: int) -> int:
        """Insert overlap on an SWA tombstone (spec/components.py insert_overlap): the part of
        the node inside the caller's window (from ``e``) takes the caller's slots over, with
        its SWA data, and the node's old slots there are freed.  Returns where in the node's
        part of ``value`` the caller's duplicates end (``shared``: nothing taken)."""
        cache = self.cache
        if prev >= pos + shared or node.aux[self.i].value is not None:
            return shared
        if e <= pos:
            cut = 0
        elif e < pos + shared:
            cut = e - pos
        else:
            return shared
        cache._free(_narrow(node.value, 0, cut, shared - cut))
        if cut:
            cache._split(node, cut)
        node.value = _narrow_copy(value, 0, pos + cut, shared - cut)
        cache._own(node.value)
        self.set(node, self.translate(node.value))
        return cut

    def recover(self, node: Any, pos: int, e: int) -> None:
        """An evicted node an insert gave device data back (its Full slots from ``pos``) gets
        SWA data from those slots too, for its part inside the window (from ``e``; split there
        when the window starts inside it)."""
        if node.aux[self.i].value is not None:
            return
        if e > pos:
            if e >= pos + len(node.key):
                return
            self.cache._split(node, e - pos)
        self.set(node, self.translate(node.value))

    def skips_leaf(self, pos: int, n: int, e: int) -> bool:
        return e >= n  # the remainder lies wholly outside the window

    def commit(self, target: Any, is_new: bool, pos: int, prepared: Any, e: int,
               result: dict) -> None:
        """A new leaf gets SWA data inside the window; the part before ``e`` (if any) is split
        off as a tombstone."""
        if is_new and e - pos < len(target.key):
            if e - pos > 0:
                self.cache._split(target, e - pos)
            self.set(target, self.translate(target.value))

    # -- requests --------------------------------------------------------------------------
    def prepare_caching_req(self, req: Any, params: Any, finished: bool) -> None:
        """A finished request's SWA slots before ``req.swa_evicted_seqlen`` are gone already
        (the scheduler frees them as the window slides): the insert is told so."""
        if finished:
            params.swa_evicted_seqlen = int(getattr(req, "swa_evicted_seqlen", 0) or 0)

    # -- locks -----------------------------------------------------------------------------
    def lock(self, node: Any, result: Any) -> None:
        """One window of SWA data above ``node`` (tombstones skipped and remembered), marking
        the node where the window filled up."""
        lock_window(self, node, result, self.cache.root_node, False)

    def unlock(self, node: Any, params: Any, unlocked: list) -> None:
        root = self.cache.root_node
        skip = params.skip_lock_node_ids.get(SWA_ID, ()) if params is not None else ()
        boundary = params.swa_uuid_for_lock if params is not None else None
        seen = -1 - min(params.skip_lock_node_ids.get(SWA_SPLIT_EPOCH, (0,))) if skip else 0
        cur, i = node, self.i
        while cur is not root:
            rec = cur.aux[i]
            if cur.id in skip or rec.lock == 0 or (skip and split_off_skipped(rec, skip, seen)):
                up = cur.parent  # (``_up`` only for a node out of the tree)
                cur = up if up is not None else self._up(cur, params)
                continue
            if rec.lock == 1:  # (``_unlock_rec``, inlined)
                k = len(cur.key)
                self.evictable += k
                self.protected -= k
                unlocked.append(cur)
            rec.lock -= 1
            cur.aux_lock -= 1
            if boundary and rec.boundary == boundary:
                break
            up = cur.parent
            cur = up if up is not None else self._up(cur, params)

    def _up(self, node: Any, params: Any) -> Any:
        """The next node of an unlock's walk: the parent; for a node the host tier took out of
        the tree meanwhile (a locked node's evicted bottom segment can leave through host
        eviction), the parent it had then (the spec's walk goes through the old parents),
        else the lock's anchor, else the root."""
        up = node.parent
        if up is None:  # the parent it had, as the spec's walk goes on through it
            up = node.aux[self.i].former_parent
        if up is not None:
            return up
        anchor = getattr(params, "anchor", None)
        return anchor if anchor is not None else self.cache.root_node

    # -- the host tier (fast/tiers/host.py) -------------------------------------------------
    def attach_host(self, tier: Any, config: Any) -> None:
        """The host tier is composed: its SWA host pool (``config.host_swa_allocator``, else
        ``host_swa_slots`` SWA host slots, default as many as the KV host pool's, paged as
        the KV pool); a
        load back takes full and SWA slots apart, so the allocator must offer them apart."""
        alloc = self.cache.token_to_kv_pool_allocator
        for m in ("full_attn_allocator", "swa_attn_allocator", "set_full_to_swa_mapping"):
            if not hasattr(alloc, m):
                raise InvalidInput(f"a host tier with SWA needs an allocator with {m} (SGLang's "
                                   "SWATokenToKVPoolAllocator): a load back pairs full and SWA "
                                   "slots itself")
        if tier.controller.device_kv is not None:
            raise Unsupported("a host tier that moves KV data (device_kv / host_kv) with SWA: "
                              "moving SWA KV to the host is not supported")
        pool = config.host_swa_allocator
        if pool is None:
            n = config.host_swa_slots
            if n is None:  # as many as the KV host pool holds (given, it is empty now)
                host = tier.controller.mem_pool_host
                size = getattr(host, "size", None)
                n = size if type(size) is int else host.available_size()
            pool = HostSlotAllocator(n, self.cache.page_size)
        self.host_allocator = pool
        self.controller = tier.controller
        tier.full_allocator = alloc.full_attn_allocator

    def _copy(self, kind: str, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Log one SWA copy (``log_copies``); the slot lists are made only then (a long node's
        ``tolist`` costs as much as the rest of its backup)."""
        copies = self.controller.swa_copies
        if copies is not None:
            copies.append(Copy(kind, src.tolist(), dst.tolist()))

    def backup(self, node: Any) -> bool:
        """The node's SWA data goes to fresh SWA host slots with the Full backup (SWA host
        data is evicted for room when the pool is short: as many units as the backup
        needs); without room the backup fails.  A tombstone backs up its Full data only."""
        rec = node.aux[self.i]
        if rec.value is None or rec.host_value is not None:
            return True
        pool, n = self.host_allocator, len(rec.value)
        avail = pool.available_size()
        if avail < n:
            self.evict_swa_host(n)
            avail = pool.available_size()  # (asked again only where room was made)
        slots = host_alloc(pool, n) if avail >= n else None
        if slots is None:
            return False
        # as the Full backup (fast/tiers/host.py): a view of the pool's free list (sglang's
        # host pools and the bench's hand those out) would keep that whole list alive for as
        # long as the node holds its SWA host copy, so such a view is copied
        if slots.dtype is not _INT64:
            slots = slots.to(_INT64)
        elif slots._base is not None:
            slots = slots.clone()
        rec.host_value = slots
        self._copy("backup", rec.value, rec.host_value)
        return True

    def drop_host(self, node: Any) -> int:
        """The node's SWA host data (if any) goes back to the SWA host pool; returns its
        units."""
        rec = node.aux[self.i]
        if rec.host_value is None:
            return 0
        self.host_lru.pop(rec, None)
        k = len(rec.host_value)
        release(self.host_allocator, [rec.host_value])  # (fast/frees.py)
        rec.host_value = None
        return k

    def evict_swa_host(self, num: int) -> int:
        """Free at least ``num`` SWA host units: the host list oldest first; a host leaf
        leaves the tree with all its host data, any other node loses its SWA host data and,
        by priority, the host data of the components below it (Mamba's).  Returns the SWA
        host units freed (``evict_host_oldest``: O(records taken))."""
        return self.evict_host_oldest(num)

    def _evict_host_rec(self, rec: Any) -> int:
        """Free one listed record's SWA host data (``evict_swa_host``); returns units freed."""
        cache = self.cache
        node = rec.node
        if cache.tier.is_host_leaf(node):  # it leaves the tree with all its host data
            pool = self.host_allocator
            before = pool.available_size()
            cache.tier.evict_host_leaf(node)
            return pool.available_size() - before
        freed = self.drop_host(node)
        for comp in cache.components:
            if comp is not self and comp.internal_priority <= self.internal_priority:
                comp.drop_host(node)
        return freed

    def wants_load_back(self, node: Any) -> bool:
        """Some SWA data of the node's window is on the host only."""
        return bool(self.load_window(node))

    def reserve_load_back(self, node: Any) -> bool:
        """The window's host-only SWA data is what this load back brings back: noted before
        the room-making, which may change it."""
        self._planned = self.load_window(node)
        self._loading = None
        return True

    def alloc_load_back(self, node: Any) -> bool:
        """Fresh SWA slots for the noted host-only SWA data (SWA data is evicted for room
        when the SWA pool is short: as many units as the load needs).  Fails when none can be
        had, or when the room-making took the node or changed what is to be loaded
        (write-back backups make host room; upstream loads the host slots it noted before,
        whoever holds them now: docs/SPEC.md)."""
        planned = self._planned
        assert planned is not None
        i = self.i
        n = sum(len(x.aux[i].host_value) for x in planned if x.aux[i].host_value is not None)
        swa_alloc = self.cache.token_to_kv_pool_allocator.swa_attn_allocator
        if swa_alloc.available_size() < n:
            wants = {c.name: 0 for c in self.cache.components}
            wants[self.name] = n
            self.cache._evict_units(0, wants)
        if swa_alloc.available_size() < n or node.parent is None or not self._still_planned(node):
            self._planned = None
            return False
        slots = swa_alloc.alloc(n)
        if slots is None:
            self._planned = None
            return False
        self._loading = slots if slots.dtype is _INT64 else slots.to(_INT64)
        return True

    def _still_planned(self, node: Any) -> bool:
        planned = self._planned
        assert planned is not None
        now = self.load_window(node)
        return len(now) == len(planned) and all(a is b for a, b in zip(now, planned, strict=True))

    def cancel_load_back(self, node: Any) -> None:
        """A later component's ``alloc_load_back`` failed: the SWA slots go back."""
        assert self._loading is not None
        self.cache.token_to_kv_pool_allocator.swa_attn_allocator.free(self._loading)
        self._loading = self._planned = None

    def commit_load_back(self, node: Any) -> None:
        """Each loaded node of the window takes its share of the SWA slots, mapped from its
        full slots (the allocator's map), top-down; each joins the SWA list as its newest,
        without a new access stamp (the Full eviction order does not move)."""
        planned, slots = self._planned, self._loading
        assert planned is not None and slots is not None
        self._planned = self._loading = None
        alloc = self.cache.token_to_kv_pool_allocator
        i, start = self.i, 0
        for x in planned:
            rec = x.aux[i]
            host = rec.host_value
            assert host is not None and x.value is not None
            k = len(host)
            chunk = _narrow_copy(slots, 0, start, k)
            start += k
            alloc.set_full_to_swa_mapping(x.value, chunk)
            self._copy("load", host, chunk)
            self.set(x, chunk)

    def host_lock(self, node: Any) -> Any:
        """One window of SWA host copies above the node (nodes without one are skipped), as a
        device lock holds device data; host-locked data leaves the host list."""
        cache = self.cache
        root = cache.root_node
        if node is root:
            return None
        tier = cache.tier
        size, boundary, skipped, cur = 0, None, [], node
        walked: list = []
        window, i = self.window, self.i
        while cur is not root and size < window:
            walked.append(cur)
            rec = cur.aux[i]
            if rec.host_value is None:
                skipped.append(cur)
            else:
                rec.host_lock += 1
                self.host_lru.pop(rec, None)
                size += len(rec.host_value)
                if cur is not node:
                    tier.update_host_leaf(cur)
                if size >= window:
                    if rec.host_boundary is None:
                        rec.host_boundary = self._next_boundary
                        self._next_boundary += 1
                    boundary = rec.host_boundary
            cur = cur.parent
        lock = SwaHostLock(skipped, boundary, walked)
        self.host_locks[id(lock)] = lock
        return lock

    def host_unlock(self, node: Any, token: Any) -> None:
        """Undo ``host_lock`` (``token``: its ``SwaHostLock``; None: walk up from the node,
        one lock off each host-locked node, to the end of one window): data host-only and
        unlocked again joins the host list as its newest."""
        cache = self.cache
        root, tier, i = cache.root_node, cache.tier, self.i
        if token is not None:
            self.host_locks.pop(id(token), None)
            skipped, boundary, walked = token.skipped, token.boundary, token.walked
        else:
            skipped, boundary, walked = [], None, []
        size, cur = 0, node
        while cur is not root:
            rec = cur.aux[i]
            if any(cur is s for s in skipped) or rec.host_lock == 0:
                cur = self._host_up(cur, walked)
                continue
            rec.host_lock -= 1
            if rec.host_lock == 0 and rec.value is None and rec.host_value is not None:
                self.host_lru[rec] = None
            if cur is not node:
                tier.update_host_leaf(cur)
            if boundary is not None and rec.host_boundary == boundary:
                return
            if token is None:
                size += len(cur.key)
                if size >= self.window:
                    return
            cur = self._host_up(cur, walked)

    def _host_up(self, node: Any, walked: list) -> Any:
        """The next node of a host unlock's walk: the parent; for a node that left the tree
        meanwhile (a host-locked node without a host copy can be deleted from the device),
        the parent it had then, else the first node the lock walked past it that is still in
        the tree, else the root."""
        up = node.parent
        if up is None:  # the parent it had, as the spec's walk goes on through it
            up = node.aux[self.i].former_parent
        if up is not None:
            return up
        root = self.cache.root_node
        seen = False
        for x in walked:
            if seen and (x.parent is not None or x is root):
                return x
            seen = seen or x is node
        return root

    # -- checks ----------------------------------------------------------------------------
    def value_violations(self, node: Any, value: torch.Tensor, errors: list) -> None:
        if value.tolist() != self.translate(node.value).tolist():
            errors.append(f"[aux] {node!r}: SWA slots are not the mapped ones")


_SGLANG_SWA = (("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator"),
               ("sglang.srt.mem_cache.swa_memory_pool", "SWAKVPool"))
_TRANSLATE = "translate_loc_from_full_to_swa"


def sglang_map_pool(alloc: Any) -> Any:
    """The pool whose ``full_to_swa_index_mapping`` the C core may read in place of
    ``alloc.translate_loc_from_full_to_swa`` (``swa_gather``): only where the C core is
    built, ``alloc`` is exactly sglang's ``SWATokenToKVPoolAllocator`` and its ``_kvcache``
    exactly sglang's ``SWAKVPool``, each with its own ``translate_loc_from_full_to_swa`` (that
    method is the map indexed by the slots, asserted present; a subclass or an instance method
    may do otherwise); else None.  Decided once per cache: the classes do not change."""
    if _core is None:
        return None
    pool = getattr(alloc, "_kvcache", None)
    for obj, (module, name) in zip((alloc, pool), _SGLANG_SWA, strict=True):
        cls = type(obj)
        if (cls.__module__, cls.__name__) != (module, name) \
                or _TRANSLATE in getattr(obj, "__dict__", ()):
            return None
        fn = cls.__dict__.get(_TRANSLATE)
        if getattr(fn, "__qualname__", None) != f"{name}.{_TRANSLATE}" \
                or getattr(fn, "__module__", None) != module:
            return None
    return pool


def split_off_skipped(rec: Any, skip: Any, seen: int) -> bool:
    """Whether a window lock that skipped the nodes ``skip`` after ``seen`` splits skips the
    node of ``rec`` too: a split since then cut it off a node it skipped (or off a node cut off
    one, and so on): it had no SWA data then, and any lock count it holds is another lock's."""
    return any(epoch > seen and origin in skip for epoch, origin in rec.split_from)


class SwaHostLock:
    """What an SWA host lock locked, for its unlock: the nodes of its window it skipped (no
    host copy; a split of one adds its new upper part) and the host-boundary mark of the node
    where the window filled up (None: it never did)."""

    __slots__ = ("skipped", "boundary", "walked")

    def __init__(self, skipped: list, boundary: int | None, walked: list) -> None:
        self.skipped = skipped
        self.boundary = boundary
        self.walked = walked  # the nodes the lock walked, node first (for nodes gone since)


def lock_window(comp: Any, node: Any, result: Any, root: Any, full: bool) -> int:
    """``comp``'s SWA lock: one window of SWA data above ``node`` (tombstones skipped and
    remembered in ``result``, the node where the window filled up marked).  With ``full``, the
    same walk also takes the Full lock on every node up to ``root`` (the one-component fast
    path, fast/one_aux.py) and returns how many tokens it newly locked; without, it stops
    where the window is full and returns 0."""
    size = delta = 0
    window = comp.window
    i = comp.i
    while node is not root:  # (``node`` walks up: one local less to set up per call)
        k = len(node.key)
        if full:
            if node.lock_ref == 0:
                delta += k
            node.lock_ref += 1
        if size < window:
            rec = node.aux[i]
            if rec.value is None:
                result.skip_lock_node_ids.setdefault(SWA_ID, set()).add(node.id)
                result.skip_lock_node_ids[SWA_SPLIT_EPOCH] = {-1 - comp._split_epoch}
            else:
                if rec.lock == 0:  # (``_lock_rec``, inlined: one call per node saved)
                    comp.evictable -= k
                    comp.protected += k
                rec.lock += 1
                node.aux_lock += 1
                size += k
                if size >= window:
                    if rec.boundary is None:
                        rec.boundary = comp._next_boundary
                        comp._next_boundary += 1
                    result.swa_uuid_for_lock = rec.boundary
        elif not full:
            break
        node = node.parent
    return delta
