"""The Mamba component plug-in (spec/components.py's Mamba rules): a node may hold one Mamba
state (a one-slot int64 tensor of the Mamba allocator); a match must end at a node with one."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInput
from ..frees import FreeBatch
from ..params import EvictParams
from . import MAMBA_ID, AuxComponent, Validator

_INT64 = torch.int64


class MambaComponent(AuxComponent):
    """Mamba (linear attention) states: one per node at most, on the last node of an insert;
    a lock holds the node's own state; a split leaves it on the lower part."""

    name = "mamba"
    component_id = MAMBA_ID
    internal_priority = 0

    def reset(self) -> None:
        super().reset()
        self.allocator = self.cache.mamba_allocator
        self.owned: set = set()  # state slots the tree holds (validate_slots)
        self.tracks_slots = self.cache.validate_slots

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

    # -- split -----------------------------------------------------------------------------
    def split(self, upper: Any, child: Any, k: int) -> None:
        """The state stays on the lower part, which moves to the front of the list."""
        rec = child.aux[self.i]
        if rec.value is not None:
            self.lru.move_to_front(rec)

    # -- insert ----------------------------------------------------------------------------
    def check_insert(self, plan: list, prev: int, params: Any, e: int) -> Any:
        mv = params.mamba_value
        if mv is None:
            raise InvalidInput("insert: the Mamba component needs a mamba_value")
        if not isinstance(mv, torch.Tensor) or mv.dtype != _INT64 or tuple(mv.shape) != (1,):
            raise InvalidInput("insert: mamba_value must be a one-slot int64 tensor")
        if self.cache.validate_slots:
            slot = int(mv[0])
            is_alloc = getattr(self.allocator, "is_allocated", None)
            if is_alloc is not None and not is_alloc(slot):
                raise InvalidInput(f"insert: mamba slot {slot} is not allocated")
            if slot in self.owned:
                raise InvalidInput(f"insert: mamba slot {slot} is already the tree's")
        return mv.clone()

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
        t = idx if isinstance(idx, torch.Tensor) else torch.tensor(int(idx))
        return t.reshape(1).to(_INT64)

    def _alloc_slot(self) -> torch.Tensor:
        """One free Mamba slot, evicting one state when there is none."""
        slot = self.allocator.alloc(1)
        if slot is None:
            self.cache.evict(EvictParams(num_tokens=0, mamba_num=1))
            slot = self.allocator.alloc(1)
            if slot is None:
                raise InvalidInput("no Mamba slot for the request's state copy: every state "
                                   "in the tree is locked and the pool is full")
        return slot.reshape(1).to(_INT64)

    def prepare_caching_req(self, req: Any, params: Any, finished: bool) -> None:
        """Finished: the request's own state goes to the tree.  Unfinished: the request keeps
        computing in its state, so a copy in a fresh slot goes to the tree (the pool's
        ``copy_from`` copies the data where the pool has any)."""
        src = self._request_state(req)
        if finished:
            params.mamba_value = src.clone()
            return
        dst = self._alloc_slot()
        pool = getattr(self.cache.req_to_token_pool, "mamba_pool", None)
        copy_from = getattr(pool, "copy_from", None)
        if copy_from is not None:
            copy_from(src, dst)
        params.mamba_value = dst

    def cleanup_caching_req(self, req: Any, finished: bool, result: Any, params: Any) -> None:
        """A state the tree did not take goes back: finished, the request's own (through the
        request pool's ``free_mamba_cache`` where it has one); unfinished, the copy."""
        exist = result.mamba_exist if result is not None else True
        if finished:
            if not exist:
                return  # the tree holds the request's state now
            free = getattr(self.cache.req_to_token_pool, "free_mamba_cache", None)
            if free is not None:
                free(req)
            elif getattr(req, "mamba_pool_idx", None) is not None:
                self.allocator.free(self._request_state(req))
                req.mamba_pool_idx = None
        else:
            value = params.mamba_value if params is not None else None
            if value is not None and exist:
                self.allocator.free(value)
            req.mamba_last_track_seqlen = None

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
