"""The SWA component plug-in (spec/components.py's SWA rules): a node's SWA data is the SWA
slots its Full slots map to (one per key unit); a node without it is an SWA tombstone."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInput
from ..frees import FreeBatch
from . import SWA_ID, AuxComponent, Validator

_INT64 = torch.int64
_narrow, _narrow_copy = torch.narrow, torch.narrow_copy


class SwaComponent(AuxComponent):
    """Sliding-window attention: a match must end at a node with a full window of SWA data
    above it (a tombstone restarts the count); a lock holds one window; an insert restores
    tombstones it walks through inside the caller's window."""

    name = "swa"
    component_id = SWA_ID
    internal_priority = 1

    def __init__(self, cache: Any, i: int, window: int) -> None:
        self.window = window
        super().__init__(cache, i)

    def reset(self) -> None:
        super().reset()
        self._next_boundary = 1

    def units(self, node: Any) -> int:
        return len(node.key)

    def translate(self, full: torch.Tensor) -> torch.Tensor:
        """The SWA slots of the Full slots ``full`` (the allocator's map)."""
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
        up.boundary, rec.boundary = rec.boundary, None
        if rec.value is not None:
            aux = rec.value
            up.value = _narrow_copy(aux, 0, 0, k)
            rec.value = _narrow_copy(aux, 0, k, len(child.key))
            lru.push_front(up)
            lru.push_front(rec)

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
        root = self.cache.root_node
        size, cur, window, i = 0, node, self.window, self.i
        while cur is not root and size < window:
            rec = cur.aux[i]
            if rec.value is None:
                result.skip_lock_node_ids.setdefault(SWA_ID, set()).add(cur.id)
            else:
                k = len(cur.key)
                self._lock_rec(cur, rec, k)
                size += k
                if size >= window:
                    if rec.boundary is None:
                        rec.boundary = self._next_boundary
                        self._next_boundary += 1
                    result.swa_uuid_for_lock = rec.boundary
            cur = cur.parent

    def unlock(self, node: Any, params: Any, unlocked: list) -> None:
        root = self.cache.root_node
        skip = params.skip_lock_node_ids.get(SWA_ID, ()) if params is not None else ()
        boundary = params.swa_uuid_for_lock if params is not None else None
        cur, i = node, self.i
        while cur is not root:
            rec = cur.aux[i]
            if cur.id in skip or rec.lock == 0:
                cur = cur.parent
                continue
            self._unlock_rec(cur, rec, len(cur.key), unlocked)
            if boundary and rec.boundary == boundary:
                break
            cur = cur.parent

    # -- checks ----------------------------------------------------------------------------
    def value_violations(self, node: Any, value: torch.Tensor, errors: list) -> None:
        if value.tolist() != self.translate(node.value).tolist():
            errors.append(f"[aux] {node!r}: SWA slots are not the mapped ones")
