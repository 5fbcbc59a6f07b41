"""``HybridRadixCache``: the fast path for hybrid models, Full plus one aux component (SWA or
Mamba), with upstream SGLang's engine-facing API.  ``UnifiedRadixCache(params)`` builds one
when ``params.tree_components`` names SWA or Mamba (the Full-only path and its C core are
untouched).  Pure Python; the behaviour is the spec's (spec/components.py), checked step by
step by the lockstep runner.

What it keeps (every structure is incremental; ``violations()`` recomputes each one):

* **Tree.**  ``HybridNode`` (``__slots__``): key (``array('q')``), Full slots (an int64
  tensor; never None without a host tier), Full lock count, access stamp, the aux component's
  data (``aux``: SWA slots as a tensor, or the Mamba state slot as a one-element tensor; None
  on a tombstone), its lock count ``aux_lock``, the SWA lock-boundary mark ``boundary``, and
  ``dev_children`` (children holding Full data) so the leaf test is O(1).
* **Full eviction order**: a lazily deleted heap of ``(stamp, node)``, as in ``cache.py``; an
  entry counts when its stamp is still the node's and the node is still an evictable leaf
  (unlocked in every component, Full data, no child with Full data).
* **Aux LRU list**: a doubly linked list through ``lru_prev`` / ``lru_next`` between two
  sentinels (``LruList``, fast/structures.py), most recent next to its ``head``.  A node is
  in it exactly when it holds aux data.
  A touch moves the node to the front; a match moves the matched path, node first; a split
  re-files both halves (the upper one first); a new aux value enters at the front.  The
  aux eviction walks it from its ``tail`` (O(1) per step; locked nodes are skipped).
* **Sizes**: Full and aux evictable / protected counters, moved on lock transitions 0 <-> 1.
* **Slot validation** (as ``cache.py``'s ``validate_slots``): the set of Full slots the tree
  holds and the set of Mamba slots, so an insert handing over the tree's own slots is refused
  before anything changes.

Complexities: ``match_prefix`` / ``insert`` O(n + d) (n tokens, d nodes on the path), plus the
aux list moves, O(d); ``inc_lock_ref`` / ``dec_lock_ref`` O(d) (SWA stops after one window);
``evict`` O(k log L) for k Full victims, O(1) per aux list step.

With one aux component per cache, the cascade of the seed's eviction priorities does nothing
on an internal node (Full outranks the aux component there) and takes everything on a leaf
(the leaf leaves the tree), so it is not a separate step here.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from typing import Any, Optional

import torch

from .errors import HandleError, InvalidInput, NodeNotFound, Unsupported
from .frees import release
from .structures import LazyHeap, LruList
from .keys import step_len
from .params import (
    CacheInitParams,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from .radix_key import RadixKey
from .cache import UnifiedRadixCache
from . import compat

STRIDE = 1 << 20  # clock step per touch (a match path of up to STRIDE nodes fits below it)
FULL, SWA, MAMBA = 0, 1, 2  # component ids in skip_lock_node_ids (upstream's ComponentType)
_INT64 = torch.int64
_narrow, _narrow_copy = torch.narrow, torch.narrow_copy  # one torch call per slice / copy
_ids = itertools.count(1)


def component_names(tree_components) -> list:
    """``tree_components`` (upstream's enum members, their names or ints) as lower-case names."""
    out = []
    for c in tree_components:
        name = getattr(c, "name", c)
        if isinstance(name, int) and not isinstance(name, bool):
            name = {FULL: "full", SWA: "swa", MAMBA: "mamba"}.get(name, str(name))
        out.append(str(name).lower())
    return out



def _queue(runs: list, method: str, slots: torch.Tensor) -> None:
    """Add ``slots`` to the last run of ``runs`` when it frees by the same ``method``, else
    start a run (so the runs keep the order of the frees)."""
    if runs and runs[-1][0] == method:
        runs[-1][1].append(slots)
    else:
        runs.append((method, [slots]))

class HybridNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time",
                 "hit_count", "extra_key", "dev_children", "id", "ck", "aux", "aux_lock",
                 "boundary", "lru_prev", "lru_next")

    def __init__(self, key, value, parent, extra_key, stamp: int, ck=None) -> None:
        self.children: dict = {}
        self.parent: Optional[HybridNode] = parent
        self.key = key
        self.value: Optional[torch.Tensor] = value
        self.lock_ref = 0
        self.last_access_time = stamp
        self.hit_count = 0
        self.extra_key = extra_key
        self.dev_children = 0
        self.id = next(_ids)
        self.ck = ck
        self.aux: Optional[torch.Tensor] = None  # SWA slots, or (Mamba state slot,)
        self.aux_lock = 0
        self.boundary: Optional[int] = None
        self.lru_prev: Optional[HybridNode] = None
        self.lru_next: Optional[HybridNode] = None

    def __lt__(self, other: "HybridNode") -> bool:
        return self.id < other.id

    @property
    def evicted(self) -> bool:
        return self.parent is not None and self.value is None

    def __repr__(self) -> str:
        return (f"HybridNode(id={self.id}, key_len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"aux={'-' if self.aux is None else len(self.aux)}, aux_lock={self.aux_lock})")


def _count_arg(name: str, x) -> int:
    if type(x) is not int or x < 0:
        raise InvalidInput(f"{name} must be a non-negative int, got {x!r}")
    return x


class HybridRadixCache(UnifiedRadixCache):
    """Radix prefix cache of a hybrid model; see the module docstring for the structures.

    What ``UnifiedRadixCache(params)`` returns for Full + SWA or Full + Mamba params: a
    subclass for the type, every cache method its own (pure Python)."""

    core = "python"
    core_reason = "a hybrid cache (SWA or Mamba): the C core covers the device-only Full path"
    _node_type = HybridNode

    def __init__(self, params: CacheInitParams) -> None:
        names = component_names(params.tree_components)
        if names not in (["full", "swa"], ["full", "mamba"]):
            raise Unsupported(f"tree_components {names}: a hybrid cache is Full plus SWA or Mamba")
        if params.page_size < 1:
            raise InvalidInput(f"page_size must be >= 1, got {params.page_size}")
        if params.is_eagle:
            raise Unsupported("EAGLE bigram keys with SWA or Mamba are not supported")
        compat.check_settings(params, finished_insert=False, multi_rank=True)
        settings = compat.read_settings(params)
        self.kind = names[1]
        self.is_swa = self.kind == "swa"
        self.is_mamba = self.kind == "mamba"
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = params.disable
        self.is_eagle = False
        alloc = self.token_to_kv_pool_allocator
        if self.is_swa:
            window = params.sliding_window_size
            if type(window) is not int or window < 1:
                raise InvalidInput(f"SWA needs a positive sliding_window_size, got {window!r}")
            for m in ("translate_loc_from_full_to_swa", "free_swa", "free"):
                if not hasattr(alloc, m):
                    raise InvalidInput(f"SWA needs an allocator with {m}() (an SWA allocator)")
            self.sliding_window_size = window
        else:
            self.sliding_window_size = None
            if getattr(params.req_to_token_pool, "mamba_allocator", None) is None:
                raise InvalidInput("Mamba needs a req_to_token_pool with a mamba_allocator")
            self.mamba_allocator = params.req_to_token_pool.mamba_allocator
        self.mamba_cache_chunk_size = compat.mamba_chunk_size(settings.mamba_cache_chunk_size)
        self.device = getattr(alloc, "device", None) or torch.device("cpu")
        self.validate_slots = compat.validate_slots_for(settings.validate_slots, alloc)
        self._empty = torch.empty((0,), dtype=_INT64, device=self.device)
        self.reset()

    # ------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the whole tree (the allocators are the caller's to clear, as upstream)."""
        self._clock = 0
        self.root_node = HybridNode(array("q"), self._empty, None, None, 0)
        self.root_node.lock_ref = 1
        self._leaf_heap = LazyHeap()  # (stamp, node): evictable device leaves, lazily deleted
        self._heap: list = self._leaf_heap.entries
        self._evictable = self._protected = 0
        self._aux_evictable = self._aux_protected = 0
        self._owned: set = set()  # Full slots the tree holds (validate_slots)
        self._mamba_owned: set = set()  # Mamba slots the tree holds (validate_slots)
        self._lru = LruList()  # the nodes holding aux data, newest first
        self._next_boundary = 1

    def swa_evictable_size(self) -> int:
        return self._aux_evictable if self.is_swa else 0

    def swa_protected_size(self) -> int:
        return self._aux_protected if self.is_swa else 0

    def mamba_evictable_size(self) -> int:
        return self._aux_evictable if self.is_mamba else 0

    def mamba_protected_size(self) -> int:
        return self._aux_protected if self.is_mamba else 0

    def total_size(self) -> tuple[int, int]:
        return (self._evictable + self._protected, self._aux_evictable + self._aux_protected)

    def supports_swa(self) -> bool:
        return self.is_swa

    def supports_mamba(self) -> bool:
        return self.is_mamba

    # ------------------------------------------------------------------------------------------
    # Leaves, clock, aux LRU list
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _is_leaf(node: HybridNode) -> bool:
        return (node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0
                and node.value is not None and node.parent is not None)

    def _stamp(self, node: HybridNode) -> None:
        self._clock += STRIDE
        node.last_access_time = self._clock
        self._push_if_leaf(node)

    def _touch(self, node: HybridNode) -> None:
        """A node on an insert's walk: newest stamp, front of the aux list."""
        self._stamp(node)
        if node.aux is not None and node is not self.root_node:
            self._lru.move_to_front(node)

    def _lru_path_to_front(self, node: HybridNode) -> None:
        """The matched node and its ancestors holding aux data to the front, node first."""
        lru = self._lru
        prev = lru.head
        root = self.root_node
        while node is not root:
            if node.aux is not None:
                lru.move_after(prev, node)
                prev = node
            node = node.parent

    def lru_order(self) -> list[HybridNode]:
        """The aux LRU list, oldest first."""
        return self._lru.oldest_first()

    def _aux_len(self, node: HybridNode) -> int:
        """Units of aux data on a node that has some: one SWA slot per key unit, or one Mamba
        state (cheaper than ``len`` of the tensor, a Python-level torch call)."""
        return len(node.key) if self.is_swa else 1

    def _set_aux(self, node: HybridNode, aux: torch.Tensor) -> None:
        """A node takes aux data (it had none): front of the list, counted as evictable
        (a node without aux data has no aux lock)."""
        node.aux = aux
        self._lru.push_front(node)
        if node.aux_lock:
            self._aux_protected += self._aux_len(node)
        else:
            self._aux_evictable += self._aux_len(node)
        if self.is_mamba and self.validate_slots:
            self._mamba_owned.add(int(aux[0]))

    def _translate(self, full: torch.Tensor) -> torch.Tensor:
        swa = self.token_to_kv_pool_allocator.translate_loc_from_full_to_swa(full)
        return swa if swa.dtype is _INT64 else swa.to(_INT64)  # (.to: a torch call even as a no-op)

    # ------------------------------------------------------------------------------------------
    # Tree structure
    # ------------------------------------------------------------------------------------------

    def _split(self, child: HybridNode, k: int) -> HybridNode:
        """Cut ``child`` after ``k`` units; the new upper node takes its place.  SWA data and
        the lock boundary follow the cut; a Mamba state stays on the child."""
        parent = child.parent
        self._clock += STRIDE
        value = child.value
        upper = HybridNode(child.key[:k], _narrow_copy(value, 0, 0, k), parent, child.extra_key,
                           self._clock, child.ck)
        upper.lock_ref = child.lock_ref
        parent.children[child.ck] = upper
        child.key = child.key[k:]
        child.value = _narrow_copy(value, 0, k, len(child.key))
        upper.dev_children = 1
        child.parent = upper
        child.ck = self._ck(child.extra_key, child.key, 0)
        upper.children[child.ck] = child
        if child.aux is not None:
            self._lru.remove(child)
        if self.is_swa:
            upper.aux_lock = child.aux_lock
            upper.boundary, child.boundary = child.boundary, None
            if child.aux is not None:
                aux = child.aux
                upper.aux = _narrow_copy(aux, 0, 0, k)
                child.aux = _narrow_copy(aux, 0, k, len(child.key))
                self._lru.push_front(upper)
        if child.aux is not None:
            self._lru.push_front(child)
        self._stamp(child)
        return upper

    def find_node(self, key: RadixKey) -> HybridNode:
        """The node whose path is exactly ``key`` (the root for an empty key)."""
        units = key.token_ids
        node, pos, n = self.root_node, 0, len(units)
        while pos < n:
            child = node.children.get(self._ck(key.extra_key, units, pos)) \
                if n - pos >= self.page_size else None
            if child is None or units[pos: pos + len(child.key)] != child.key:
                raise NodeNotFound(f"no node ends at this path ({n} units, "
                                   f"extra_key={key.extra_key!r})")
            node, pos = child, pos + len(child.key)
        return node

    def _units(self, key) -> Any:
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        if key.is_bigram:
            raise Unsupported("EAGLE bigram keys with SWA or Mamba are not supported")
        toks = key.token_ids
        return toks if type(toks) is array else array("q", toks)

    # ------------------------------------------------------------------------------------------
    # match_prefix
    # ------------------------------------------------------------------------------------------

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` (whole pages) that ends at a node the aux
        component accepts: SWA, a contiguous run of SWA data of one window up to it (unbounded
        from the root, restarted at a tombstone); Mamba, a state on the node.  The walk goes on
        past rejected nodes (splitting at a partial match); the accepted path becomes the most
        recent.  Mamba answers ``mamba_branching_seqlen`` when the walk went further."""
        key = params.key
        units = self._units(key)
        if self.is_mamba and getattr(params, "cow_mamba", False):
            # upstream then hands the request a copy of the matched state (req.mamba_pool_idx,
            # mamba_cow_src_index): the Mamba request path, not here yet
            raise Unsupported("match_prefix with cow_mamba=True (copying the matched Mamba "
                              "state to the request) is not supported yet")
        root = self.root_node
        ps = self.page_size
        n = len(units) - len(units) % ps
        if self.disable or n == 0:
            return MatchResult(self._empty, root, root, root, 0, 0, 0, None, None)
        ek = key.extra_key
        node, pos, chunks = root, 0, []
        best, best_chunks = root, 0
        run = float("inf")  # SWA: contiguous SWA units ending at the current node
        window = self.sliding_window_size
        while pos < n:
            child = node.children.get(self._ck(ek, units, pos))
            if child is None or child.value is None:
                break
            k = step_len(child.key, units, pos, n, ps)
            split = k < len(child.key)
            if split:
                child = self._split(child, k)
            chunks.append(child.value)
            node, pos = child, pos + k
            if self.is_swa:
                if child.aux is None:
                    run = 0
                else:
                    run += k
                    if run >= window:
                        best, best_chunks = child, len(chunks)
            elif child.aux is not None:
                best, best_chunks = child, len(chunks)
            if split:  # the match ends inside the old node
                break
        self._lru_path_to_front(best)
        clock = self._clock + STRIDE
        self._clock = clock
        cur = best
        while cur is not None:
            cur.last_access_time = clock
            clock -= 1
            cur = cur.parent
        if best is not root:
            self._push_if_leaf(best)
        if best_chunks == 0:
            indices = self._empty
        elif best_chunks == 1:
            indices = chunks[0]
        else:
            indices = torch.cat(chunks[:best_chunks])
        branching = None
        if self.is_mamba and len(chunks) > best_chunks:
            c = self.mamba_cache_chunk_size
            aligned = pos // c * c
            branching = aligned if aligned > 0 else None
        return MatchResult(indices, best, best, best, 0, 0, 0, branching, None)

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------

    def _plan(self, ek, units, n: int) -> list:
        node, pos, plan = self.root_node, 0, []
        while pos < n:
            child = node.children.get(self._ck(ek, units, pos))
            if child is None:
                break
            k = step_len(child.key, units, pos, n, self.page_size)
            plan.append((child, k))
            if k < len(child.key):
                break
            node, pos = child, pos + k
        return plan

    def _check_aux(self, plan: list, prev: int, params: InsertParams) -> tuple:
        """The spec's aux checks (spec/components.py check_insert_aux)."""
        e = params.swa_evicted_seqlen
        if type(e) is not int or e < 0:
            raise InvalidInput(f"swa_evicted_seqlen must be a non-negative int, got {e!r}")
        if e and not self.is_swa:
            raise InvalidInput("insert: swa_evicted_seqlen needs the SWA component")
        if e % self.page_size:
            raise InvalidInput(f"insert: swa_evicted_seqlen={e} is not whole pages")
        if self.is_swa:
            start = 0
            for node, shared in plan:
                if start < prev < start + shared and node.value is not None \
                        and node.aux is None and e < start + shared:
                    raise InvalidInput("insert: prev_prefix_len falls inside an SWA tombstone "
                                       "that this insert would restore")
                start += shared
        mv = params.mamba_value
        if not self.is_mamba:
            if mv is not None:
                raise InvalidInput("insert: mamba_value needs the Mamba component")
            return None, e
        if mv is None:
            raise InvalidInput("insert: the Mamba component needs a mamba_value")
        if not isinstance(mv, torch.Tensor) or mv.dtype != _INT64 or tuple(mv.shape) != (1,):
            raise InvalidInput("insert: mamba_value must be a one-slot int64 tensor")
        if self.validate_slots:
            slot = int(mv[0])
            is_alloc = getattr(self.mamba_allocator, "is_allocated", None)
            if is_alloc is not None and not is_alloc(slot):
                raise InvalidInput(f"insert: mamba slot {slot} is not allocated")
            if slot in self._mamba_owned:
                raise InvalidInput(f"insert: mamba slot {slot} is already the tree's")
        return mv.clone(), e

    _deferred: Optional[list] = None  # an insert's frees, handed back together at its end

    def _free(self, slots: torch.Tensor) -> None:
        if slots.shape[0]:
            if self._deferred is not None:
                self._deferred.append(slots)
            else:
                self.token_to_kv_pool_allocator.free(slots)
            if self.validate_slots:
                self._owned.difference_update(slots.tolist())

    def _own(self, slots: torch.Tensor) -> None:
        if self.validate_slots:
            self._owned.update(slots.tolist())

    def insert(self, params: InsertParams) -> InsertResult:
        """See :meth:`_insert`; the slots it frees (the caller's duplicates, a tombstone's
        slots taken over, a remainder outside the window) go back in the order it frees them,
        in as few allocator calls as the allocator allows (fast/frees.py)."""
        self._deferred = []
        try:
            return self._insert(params)
        finally:
            pieces, self._deferred = self._deferred, None
            release(self.token_to_kv_pool_allocator, pieces)

    def _insert(self, params: InsertParams) -> InsertResult:
        """Cache ``key -> value``: touch the path, split at a partial match, free the caller's
        duplicates from ``prev_prefix_len`` on (an SWA tombstone inside the caller's window
        takes its slots instead), add the remainder as a new leaf (with SWA data inside the
        window; with the Mamba state), or give the last node the Mamba state.  Returns the
        length already cached and, for Mamba, whether the node had a state already."""
        key, value = params.key, params.value
        units = self._units(key)
        if not isinstance(value, torch.Tensor) or value.dtype != _INT64 or \
                tuple(value.shape) != (len(units),):
            raise InvalidInput("value must be a 1-D int64 tensor with one slot per token")
        prev = _count_arg("prev_prefix_len", params.prev_prefix_len)
        if params.chunked is not True and params.chunked is not False:
            raise InvalidInput(f"chunked must be a bool, got {params.chunked!r}")
        if self.disable:
            return InsertResult(prefix_len=0)
        n = len(units) - len(units) % self.page_size
        if n < len(units):
            units, value = units[:n], _narrow(value, 0, 0, n)
        ek = key.extra_key
        plan = self._plan(ek, units, n)
        if self.validate_slots:
            self._check_slot_list(plan, value.tolist(), prev)
        mamba_value, e = self._check_aux(plan, prev, params)

        self._stamp(self.root_node)
        if n == 0:
            return InsertResult(prefix_len=0, mamba_exist=True)
        node, pos = self.root_node, 0
        is_swa = self.is_swa
        dup_lo = dup_hi = 0  # the caller's duplicates not yet freed: value[dup_lo:dup_hi]
        for child, shared in plan:
            self._touch(child)
            if shared < len(child.key):
                child = self._split(child, shared)
            end = pos + shared
            # a locked SWA tombstone keeps its slots (another holder reads them; docs/SPEC.md)
            if is_swa and prev < end and child.aux is None and child.lock_ref == 0:
                if dup_lo < dup_hi:  # (the frees keep their order)
                    self._free(_narrow(value, 0, dup_lo, dup_hi - dup_lo))
                    dup_lo = dup_hi = 0
                taken = self._overlap(child, pos, shared, value, prev, e)
            else:
                taken = shared
            lo = max(prev, pos)
            hi = pos + taken
            if lo < hi:  # one free for a run of adjacent duplicates
                if dup_lo < dup_hi and dup_hi != lo:
                    self._free(_narrow(value, 0, dup_lo, dup_hi - dup_lo))
                    dup_lo = dup_hi = 0
                if dup_lo == dup_hi:
                    dup_lo = lo
                dup_hi = hi
            node, pos = child, end
        if dup_lo < dup_hi:
            self._free(_narrow(value, 0, dup_lo, dup_hi - dup_lo))
        target, is_new = node, False
        if pos < n:
            if self.is_swa and e >= n:
                self._free(_narrow(value, 0, pos, n - pos))  # wholly outside the window: no leaf
                return InsertResult(prefix_len=pos)
            self._clock += STRIDE
            rest = units[pos:]
            ck = self._ck(ek, rest, 0)
            leaf = HybridNode(rest, _narrow_copy(value, 0, pos, n - pos), node, ek, self._clock, ck)
            node.children[ck] = leaf
            node.dev_children += 1
            self._evictable += n - pos
            self._own(leaf.value)
            self._push_if_leaf(leaf)
            target, is_new = leaf, True
        exist = False
        if self.is_swa:
            if is_new and e - pos < len(target.key):
                if e - pos > 0:
                    self._split(target, e - pos)
                self._set_aux(target, self._translate(target.value))
        elif is_new or target.aux is None:
            self._set_aux(target, mamba_value)
            if not is_new:
                self._stamp(target)
        else:
            self._lru.move_to_front(target)
            self._stamp(target)
            exist = True
        return InsertResult(prefix_len=pos, total_len=len(key.token_ids), mamba_exist=exist)

    def _overlap(self, node: HybridNode, pos: int, shared: int, value: torch.Tensor,
                 prev: int, e: int) -> int:
        """SWA overlap ownership (spec/components.py insert_overlap): where in this node's
        part of ``value`` the node took the caller's slots over (``shared``: nowhere)."""
        if not self.is_swa or prev >= pos + shared or node.aux is not None:
            return shared
        if e <= pos:
            cut = 0
        elif e < pos + shared:
            cut = e - pos
        else:
            return shared
        self._free(_narrow(node.value, 0, cut, shared - cut))
        if cut:
            self._split(node, cut)
        node.value = _narrow_copy(value, 0, pos + cut, shared - cut)
        self._own(node.value)
        self._set_aux(node, self._translate(node.value))
        return cut

    # ------------------------------------------------------------------------------------------
    # Locks
    # ------------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: HybridNode) -> IncLockRefResult:
        """Lock ``node``'s Full path up to the root; SWA: one window of SWA data above the
        node (tombstones skipped), marking where the window filled up; Mamba: the node's
        state.  Skipped nodes are remembered in the result (pass ``to_dec_params()`` back)."""
        self._check_attached(node)
        result = IncLockRefResult()
        if self.disable:
            return result
        root = self.root_node
        cur = node
        while cur is not root and cur.value is None:
            result.skip_lock_node_ids.setdefault(FULL, set()).add(cur.id)
            cur = cur.parent
        delta = 0
        while cur is not root:
            if cur.lock_ref == 0:
                delta += len(cur.key)
            cur.lock_ref += 1
            cur = cur.parent
        self._evictable -= delta
        self._protected += delta
        result.delta = delta
        if self.is_swa:
            size, cur, window = 0, node, self.sliding_window_size
            while cur is not root and size < window:
                if cur.aux is None:
                    result.skip_lock_node_ids.setdefault(SWA, set()).add(cur.id)
                else:
                    if cur.aux_lock == 0:
                        self._aux_evictable -= len(cur.key)
                        self._aux_protected += len(cur.key)
                    cur.aux_lock += 1
                    size += len(cur.key)
                    if size >= window:
                        if cur.boundary is None:
                            cur.boundary = self._next_boundary
                            self._next_boundary += 1
                        result.swa_uuid_for_lock = cur.boundary
                cur = cur.parent
        elif node is not root:
            if node.aux is None:
                result.skip_lock_node_ids.setdefault(MAMBA, set()).add(node.id)
            else:
                if node.aux_lock == 0:
                    self._aux_evictable -= 1
                    self._aux_protected += 1
                node.aux_lock += 1
        return result

    def dec_lock_ref(self, node: HybridNode,
                     params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        """Undo one ``inc_lock_ref`` of ``node`` (pass its result's ``to_dec_params()``)."""
        self._check_attached(node)
        if self.disable:
            return DecLockRefResult()
        root = self.root_node
        skips = params.skip_lock_node_ids if params is not None else {}
        skip = skips.get(FULL, ())
        cur = node
        while cur is not root:  # check first: a refused unlock changes nothing
            if cur.id not in skip and cur.lock_ref <= 0:
                raise HandleError("dec_lock_ref: this path is not locked (released twice?)")
            cur = cur.parent
        freed_nodes = []
        cur, delta = node, 0
        while cur is not root:
            if cur.id not in skip:
                cur.lock_ref -= 1
                if cur.lock_ref == 0:
                    delta += len(cur.key)
                    freed_nodes.append(cur)
            cur = cur.parent
        self._evictable += delta
        self._protected -= delta
        if self.is_swa:
            skip = skips.get(SWA, ())
            boundary = params.swa_uuid_for_lock if params is not None else None
            cur = node
            while cur is not root:
                if cur.id in skip or cur.aux_lock == 0:
                    cur = cur.parent
                    continue
                if cur.aux_lock == 1:
                    self._aux_evictable += len(cur.key)
                    self._aux_protected -= len(cur.key)
                    freed_nodes.append(cur)
                cur.aux_lock -= 1
                if boundary and cur.boundary == boundary:
                    break
                cur = cur.parent
        elif node is not root and node.id not in skips.get(MAMBA, ()) and node.aux_lock > 0:
            if node.aux_lock == 1:
                self._aux_evictable += 1
                self._aux_protected -= 1
                freed_nodes.append(node)
            node.aux_lock -= 1
        for n in freed_nodes:
            self._push_if_leaf(n)
        return DecLockRefResult(delta=delta)

    # ------------------------------------------------------------------------------------------
    # Eviction
    # ------------------------------------------------------------------------------------------

    def _evict_leaf(self, node: HybridNode, tracker: list, freed: list) -> None:
        """A device leaf leaves the tree with all its data (the SWA slots go back with the
        Full slots through the allocator's map).  Its slots are handed back by ``evict`` in
        few batched calls: the Full slots onto the runs in ``freed[0]``, a Mamba state onto
        ``freed[1]``."""
        aux = node.aux
        if aux is not None:
            k = len(node.key) if self.is_swa else 1
            tracker[1] += k
            self._aux_evictable -= k
            self._lru.remove(node)
            if self.is_mamba:
                freed[1].append(aux)
            node.aux = None
        _queue(freed[0], "free", node.value)
        k = len(node.key)
        tracker[0] += k
        self._evictable -= k
        node.value = None
        parent = node.parent
        del parent.children[node.ck]
        node.parent = None
        parent.dev_children -= 1
        if parent is not self.root_node and parent.dev_children == 0:
            self._push_if_leaf(parent)

    def _drop_aux(self, node: HybridNode, tracker: list, freed: list) -> None:
        """The node keeps its Full data and becomes a tombstone for the aux component (its SWA
        slots, through the map of its Full slots, onto the runs in ``freed[0]``; its Mamba
        state onto ``freed[1]``)."""
        k = len(node.key) if self.is_swa else 1
        tracker[1] += k
        self._aux_evictable -= k
        self._lru.remove(node)
        if self.is_swa:
            _queue(freed[0], "free_swa", node.value)
        else:
            freed[1].append(node.aux)
        node.aux = None

    def _free_batched(self, freed: list) -> None:
        """Hand back what one ``evict`` took in as few allocator calls as each allocator's
        semantics allow (fast/frees.py), leaving its free lists as one call per node would:
        each run of consecutive frees of one kind (Full slots with their SWA slots; SWA-only
        slots of tombstones) is one batch, the runs in the order they were taken; the Mamba
        states are one batch (their own allocator)."""
        runs, states = freed
        alloc = self.token_to_kv_pool_allocator
        for method, pieces in runs:
            release(alloc, pieces, method)
            if method == "free" and self.validate_slots:
                for p in pieces:
                    self._owned.difference_update(p.tolist())
        if states:
            release(self.mamba_allocator, states)
            if self.validate_slots:
                for p in states:
                    self._mamba_owned.difference_update(p.tolist())

    def evict(self, params: EvictParams) -> EvictResult:
        """Full first: the oldest evictable device leaves, whole, until ``num_tokens`` Full
        units are freed.  Then the aux component: its list from the oldest end, skipping nodes
        it has locked; a device leaf leaves the tree, any other node becomes a tombstone;
        until ``swa_num_tokens`` / ``mamba_num`` aux units are freed (by either driver).
        The slots go back to the allocators at the end, batched (``_free_batched``)."""
        want = _count_arg("num_tokens", params.num_tokens)
        swa_want = _count_arg("swa_num_tokens", params.swa_num_tokens)
        mamba_want = _count_arg("mamba_num", params.mamba_num)
        if self.disable:
            return EvictResult()
        tracker = [0, 0]  # Full units, aux units
        freed: list = [[], []]  # runs of (allocator method, slots) in free order; Mamba states
        heap = self._heap
        is_leaf = self._is_leaf
        evict_leaf = self._evict_leaf
        heappop = heapq.heappop
        while tracker[0] < want and heap:
            stamp, node = heappop(heap)
            if node.last_access_time != stamp or not is_leaf(node):
                continue
            evict_leaf(node, tracker, freed)
        aux_want = swa_want if self.is_swa else mamba_want
        x = self._lru.tail.lru_prev
        head = self._lru.head
        while tracker[1] < aux_want and x is not head:
            nxt = x.lru_prev  # NOTE: x's eviction never removes another list member
            if x.aux_lock == 0:
                if is_leaf(x):
                    evict_leaf(x, tracker, freed)
                else:
                    self._drop_aux(x, tracker, freed)
            x = nxt
        self._free_batched(freed)
        if self._leaf_heap.needs_compaction(self._evictable // self.page_size):
            self._leaf_heap.compact(self._is_leaf)
        if self.is_swa:
            return EvictResult(num_tokens_evicted=tracker[0], swa_num_tokens_evicted=tracker[1])
        return EvictResult(num_tokens_evicted=tracker[0], mamba_num_evicted=tracker[1])

    # ------------------------------------------------------------------------------------------
    # Requests: the request model of the conformance runs has no Mamba states or SWA windows
    # ------------------------------------------------------------------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        raise Unsupported("cache_finished_req with SWA or Mamba is not implemented; "
                          "drive insert / dec_lock_ref directly")

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        raise Unsupported("cache_unfinished_req with SWA or Mamba is not implemented; "
                          "drive insert / match_prefix / locks directly")

    def init_hicache(self, server_args: Any, params: Any) -> None:
        """Refused: a host tier with SWA or Mamba is not supported (yet)."""
        raise Unsupported("init_hicache: a host tier with SWA or Mamba is not supported")

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------

    def violations(self) -> list[str]:
        """Every incremental structure checked against a recomputation from the tree."""
        errors = []
        root = self.root_node
        ev = pr = aev = apr = 0
        owned: list = []
        mamba: list = []
        leaves, members = set(), set()
        for node in self.all_nodes():
            self._child_violations(node, errors)
            if node is root:
                if node.aux is not None or node.aux_lock:
                    errors.append("[aux] the root holds aux data or an aux lock")
                continue
            if node.value is None:
                errors.append(f"[data] {node!r} holds no device data (no host tier)")
                continue
            if len(node.value) != len(node.key) or len(node.key) % self.page_size or not len(node.key):
                errors.append(f"[tree] {node!r}: key/value lengths {len(node.key)}/{len(node.value)}")
            if node.lock_ref < 0 or node.aux_lock < 0:
                errors.append(f"[lock] {node!r}: a lock count < 0")
            if node.parent is not root and node.parent.lock_ref < node.lock_ref:
                errors.append(f"[lock] {node!r}: lock_ref exceeds its parent's")
            if node.aux_lock > node.lock_ref:
                errors.append(f"[lock] {node!r}: aux lock exceeds the Full lock")
            if node.lock_ref > 0:
                pr += len(node.value)
            else:
                ev += len(node.value)
            owned.extend(node.value.tolist())
            if node.aux is None:
                if node.aux_lock:
                    errors.append(f"[aux] {node!r}: a tombstone is locked")
            else:
                members.add(id(node))
                if node.aux_lock:
                    apr += len(node.aux)
                else:
                    aev += len(node.aux)
                if self.is_swa and node.aux.tolist() != self._translate(node.value).tolist():
                    errors.append(f"[aux] {node!r}: SWA slots are not the mapped ones")
                if self.is_mamba:
                    if len(node.aux) != 1:
                        errors.append(f"[aux] {node!r}: a Mamba state is one slot")
                    mamba.extend(node.aux.tolist())
            if self._is_leaf(node):
                leaves.add(id(node))
        if (ev, pr) != (self._evictable, self._protected):
            errors.append(f"[size] Full counters {self._evictable}/{self._protected}, "
                          f"recomputed {ev}/{pr}")
        if (aev, apr) != (self._aux_evictable, self._aux_protected):
            errors.append(f"[size] {self.kind} counters {self._aux_evictable}/"
                          f"{self._aux_protected}, recomputed {aev}/{apr}")
        self._slot_and_leaf_violations(owned, leaves, errors)
        if len(set(mamba)) != len(mamba):
            errors.append("[aux] a Mamba slot is held twice in the tree")
        if self.validate_slots and self.is_mamba and set(mamba) != self._mamba_owned:
            errors.append("[aux] the owned Mamba slots differ from the tree's")
        errors.extend(self._lru.violations(members))  # linked both ways, exactly the aux holders
        return errors
