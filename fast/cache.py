"""``UnifiedRadixCache``: the production radix prefix cache (device tier, Full component).

Same observable behaviour as ``uniradix.spec`` (checked step by step by the lockstep runner),
with upstream SGLang's public API.  What it keeps, and why it is fast:

* **Two implementations, one behaviour.**  The hot paths run in a C extension,
  ``uniradix.fast._core`` (``fast/_core.c``, plain CPython C API, built by ``setup.py`` when a
  compiler is there): the node type ``TreeNode`` (the attributes below, GC-aware) and the
  loops of ``match_prefix``, ``insert``, ``inc_lock_ref`` / ``dec_lock_ref`` and ``evict``,
  including their argument checks and result objects in the plain case.  Anything else (a bad
  argument, EAGLE keys, a disabled cache, slot validation, an unaligned key) is declined by the
  C side before it changes anything, and the Python methods of this module run; they are the
  reference and the whole implementation when the extension is missing or
  ``UNIRADIX_PURE_PYTHON=1`` is set at import.  ``NATIVE`` says which is in use.  The C code
  does the same steps in the same order (same stamps, heap entries, frees, node ids), keeps
  the scalar state (``_clock``, ``_evictable``, ``_protected``) in this object's attributes and
  the heap as the same Python list of ``(stamp, node)``, so every introspection method below
  works on either.  Why C: the remaining cost was interpreter work per node and per call
  (docs/PERFORMANCE.md); mypyc did not remove it.

* **Tree.**  ``TreeNode`` has ``__slots__`` (the C type: a struct).  A node's key is an
  ``array('q')`` of token ids (EAGLE: a list of token pairs), so a whole node is compared with
  one ``memcmp`` (C) or one C-level slice compare (Python); only a mismatching node is searched
  (a linear scan in C, bisection on slice compares in Python).  Children are found by their
  first page (namespaced by ``extra_key``) in a dict.
* **Values** are int64 tensors on the allocator's device, one per node (no host
  synchronisation, as upstream).  A one-node match returns the node's tensor itself, a longer
  one concatenates the path's tensors once; an insert copies the new leaf's slots once (a copy,
  not a view, so a leaf never keeps the caller's whole buffer alive).  (Measured: keeping numpy
  arrays on CPU instead costs more in ``Tensor.numpy`` / ``torch.from_numpy`` at the API
  boundary than it saves in copies.)
* **Access stamps** are integers from a logical clock that advances by ``STRIDE`` per touch; a
  match stamps its path ``T, T-1, T-2, ...`` from the matched node up, so ancestors are older
  than descendants and everything is newer than what came before (docs/DESIGN.md).
* **Eviction order** is a binary heap of ``(stamp, node)`` with lazy deletion: an entry is
  pushed whenever a node becomes an evictable leaf or is touched while it is one; a popped
  entry counts only if its stamp is still the node's and the node is still an evictable leaf.
  Evicting k nodes costs O(k log n) instead of upstream's heap rebuild over all leaves per call.
  The heap is compacted when stale entries outnumber live ones.
* **Evictable leaf** = attached, not the root, holds device data, unlocked, and no child holds
  device data; ``dev_children`` counts the children holding device data, so the test is O(1).
* **Sizes** ``_evictable`` / ``_protected`` are counters moved on lock transitions 0 <-> 1.
* **Slot validation** (``validate_slots``): a set of the slots the tree holds, so an insert that
  hands over slots the tree already owns, repeats a slot, or gives a partial page is rejected
  before anything changes.  On by default when the allocator can answer ``check_free`` /
  ``is_allocated`` (the environment models of the conformance runs); production allocators
  cannot, and then, as upstream, the caller is trusted.

Complexities (n = tokens in the key, d = nodes on the path, L = evictable leaves):
``match_prefix`` O(n + d) in C-level compares plus one concatenation; ``insert`` the same plus
one copy for the new leaf; ``inc_lock_ref`` / ``dec_lock_ref`` O(d); ``evict`` O(k log L) for
k evicted nodes (amortized over stale entries).
"""

from __future__ import annotations

import functools
import heapq
import importlib
import os
from array import array
from typing import Any

import torch

from . import compat, frees, keys, radix_key
from .errors import HandleError, InvalidInput, NodeNotFound, Unsupported
from .frees import native_alloc_ok, native_kind, release, release_ranges
from .keys import child_key, shared_len
from .node import Node
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
from .sessions import StreamingSessions
from .structures import LazyHeap

# MatchResult is a NamedTuple; building it through tuple.__new__ skips its Python-level
# __new__ (all nine fields are given).
_match_result = functools.partial(tuple.__new__, MatchResult)


def lock_walk(node: Any, root: Any) -> int:
    """One Full lock more on ``node`` and each ancestor below ``root`` (the Python paths' lock
    walk); returns the units of those that were unlocked (the caller moves them from
    evictable to protected).  O(depth)."""
    delta = 0
    while node is not root:
        if node.lock_ref == 0:
            delta += len(node.key)
        node.lock_ref += 1
        node = node.parent
    return delta

_INT64 = torch.int64
_narrow_copy = torch.narrow_copy
STRIDE = 1 << 20  # clock step per touch; a match path of up to STRIDE nodes fits below it
FULL = 0  # component id used in skip_lock_node_ids (upstream's ComponentType.FULL)


# The C core (fast/_core.c), unless it is missing (no compiler at install time) or
# UNIRADIX_PURE_PYTHON=1 asks for the pure-Python code at import.
_core: Any = None
if os.environ.get("UNIRADIX_PURE_PYTHON", "") != "1":
    try:
        _core = importlib.import_module("._core", __package__)  # compiled: mypy sees no module
        CORE_REASON = "the C core (fast/_core.c) is built and UNIRADIX_PURE_PYTHON is not 1"
    except ImportError as e:
        _core = None
        CORE_REASON = f"the C core (fast/_core.c) is not built: {e}"
else:
    CORE_REASON = "UNIRADIX_PURE_PYTHON=1 asked for the pure-Python code at import"
NATIVE: bool = _core is not None
if _core is not None:  # a list of token ids converted in one C pass (fast/radix_key.py)
    radix_key.from_list = _core.token_array


TreeNode: Any = Node  # the pure-Python node (fast/node.py), unless the C core has its own
PyTreeNode = TreeNode  # the pure-Python node, whichever is in use

if NATIVE:
    # The C node type: the same attributes, property, ordering and repr as the class above,
    # which stays the pure-Python implementation.
    TreeNode = _core.TreeNode  # noqa: F811
    _core.setup(torch.narrow_copy, torch.cat, STRIDE)
    _core.setup_api(RadixKey, MatchResult, InsertResult, IncLockRefResult, DecLockRefResult,
                    EvictResult, torch.Tensor, torch.int64, array)
    _api_match, _api_insert, _api_inc = _core.api_match, _core.api_insert, _core.api_inc
    _api_dec, _api_evict = _core.api_dec, _core.api_evict
    # what evict and insert free goes straight into sglang's exact allocators on the CPU
    # (fast/_core.c "native frees"; fast/frees.py native_kind says which those are)
    _core.setup_frees(torch.empty, native_kind)
    _core.host_take_setup(native_alloc_ok)  # a backup's host pool alloc (frees.host_alloc)
    keys.bind_core(_core)  # the walks' per-node step in C (fast/keys.py match_step)


def _full_leaf(node: TreeNode) -> bool:
    """``UnifiedRadixCache._is_leaf`` as a plain function (compaction calls it per entry)."""
    return (node.lock_ref == 0 and node.dev_children == 0 and node.value is not None
            and node.parent is not None)


def _int_arg(name: str, x) -> int:
    if type(x) is not int or x < 0:
        raise InvalidInput(f"{name} must be a non-negative int, got {x!r}")
    return x


class UnifiedRadixCache(compat.EngineDefaults):
    """Radix prefix cache over KV slots; see the module docstring for the structures.

    ``UnifiedRadixCache(params)`` picks the implementation once, at construction, from the
    params, and always returns an instance of this class: a hybrid model (Full + SWA or Mamba)
    is the composed cache ``HybridRadixCache`` (fast/hybrid.py: the tree with component and
    tier plug-ins), and with a host tier (``params.hicache``) its subclass
    ``HiCacheRadixCache`` (fast/hicache.py); the device-only Full path is this class itself.

    ``core`` says which code runs the hot methods, ``"c"`` (``fast/_core.c``) or ``"python"``,
    and ``core_reason`` why.  Only this class has a C core; the subclasses say ``"python"``.
    The C core, where it is used, declines calls it does not cover (a bad argument, EAGLE keys,
    slot validation, ...) before changing anything, and the Python method runs instead.
    """

    core: str = "c" if NATIVE else "python"
    core_reason: str = CORE_REASON
    metrics: Any = None  # its CacheMetrics with enable_metrics (fast/metrics.py)
    _node_type: Any = TreeNode  # this cache's node class (each subclass has its own)

    def __new__(cls, params: CacheInitParams | None = None, *args: Any, **kwargs: Any):
        # NOTE: the subclass instance is returned uninitialised: type.__call__ then runs the
        # subclass's __init__ (once), because the object is an instance of this class.
        if cls is UnifiedRadixCache and compat.read_settings(params).hicache is not None:
            from .hicache import HiCacheRadixCache
            return super().__new__(HiCacheRadixCache)
        comps = getattr(params, "tree_components", None)
        if cls is UnifiedRadixCache and ((comps is not None and len(comps) > 1)
                                         or compat.python_tree_reason(params) is not None):
            from .hybrid import HybridRadixCache
            return super().__new__(HybridRadixCache)
        return super().__new__(cls)

    def __init__(self, params: CacheInitParams) -> None:
        """``params``: uniradix's or SGLang's ``CacheInitParams`` (fast/compat.py says how
        the uniradix-only settings are read and which upstream settings are refused)."""
        if compat.component_names(params.tree_components) != ["full"]:
            raise Unsupported(f"tree_components {params.tree_components}: only the Full component "
                              "is supported so far")
        self._setup(params, multi_rank=True)
        self.reset()
        compat.wire_metrics(self, params)  # enable_metrics (fast/metrics.py)

    def _setup(self, params: Any, multi_rank: bool) -> None:
        """What every cache checks and reads from its params the same way: the page size, the
        refused settings (``compat.check_settings``), the allocators, flags, device, slot
        validation."""
        if params.page_size < 1:
            raise InvalidInput(f"page_size must be >= 1, got {params.page_size}")
        compat.check_settings(params, finished_insert=True, multi_rank=multi_rank)
        settings = compat.read_settings(params)
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        self.disable = params.disable
        self.is_eagle = params.is_eagle
        self.disable_finished_insert = bool(getattr(params, "disable_finished_insert", False))
        alloc = self.token_to_kv_pool_allocator
        self.device = getattr(alloc, "device", None) or torch.device("cpu")
        self.validate_slots = compat.validate_slots_for(settings.validate_slots, alloc)
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.sessions = StreamingSessions(self)  # streaming sessions (fast/sessions.py)
        # the C core's tail buffer under a page-1 sglang free list and the highest index ever
        # written into it (fast/_core.c "native frees"); None until its first free
        self._free_tail: torch.Tensor | None = None
        self._free_tail_hw = 0
        self._free_head: torch.Tensor | None = None  # (a paged list's: fast/frees.py TailHolder)

    # ------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the whole tree (the allocator is the caller's to clear, as upstream)."""
        self._clock = 0
        self.root_node = TreeNode(array("q"), self._empty, None, None, 0)
        self.root_node.lock_ref = 1
        # (stamp, node): evictable device leaves, lazily deleted (fast/structures.py); the C
        # core works on the same list through ``_heap``
        self._leaf_heap = LazyHeap()
        self._heap: list = self._leaf_heap.entries
        self._evictable = 0
        self._protected = 0
        self._owned: set = set()  # slots the tree holds (only with validate_slots)
        self.sessions.reset()

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def full_evictable_size(self) -> int:
        return self._evictable

    def full_protected_size(self) -> int:
        return self._protected

    def total_size(self) -> tuple[int, int]:
        """(device tokens in the tree, aux tokens) — upstream's shape; O(nodes)."""
        return self._evictable + self._protected, 0

    def supports_swa(self) -> bool:
        return False

    def supports_mamba(self) -> bool:
        return False

    # ------------------------------------------------------------------------------------------
    # Keys
    # ------------------------------------------------------------------------------------------

    def _ck(self, extra_key, units, pos: int):
        """Child key of the page starting at ``pos``."""
        return child_key(extra_key, units, pos, self.page_size)

    def _shared(self, ckey, units, pos: int, n: int) -> int:
        """Whole-page length of the common prefix of ``ckey`` and ``units[pos:n]``."""
        return shared_len(ckey, units, pos, n, self.page_size)

    # ------------------------------------------------------------------------------------------
    # Clock and eviction bookkeeping
    # ------------------------------------------------------------------------------------------

    def _is_leaf(self, node: TreeNode) -> bool:
        return (node.lock_ref == 0 and node.dev_children == 0 and node.value is not None
                and node.parent is not None)

    def _push_if_leaf(self, node: TreeNode) -> None:
        if self._is_leaf(node):  # the subclass's leaf test where it has one
            heapq.heappush(self._heap, (node.last_access_time, node))  # the LazyHeap's list

    def _touch(self, node: TreeNode) -> None:
        self._clock += STRIDE
        node.last_access_time = self._clock
        self._push_if_leaf(node)

    def _compact_heap(self) -> None:
        """Drop the stale heap entries (the C core's evict calls this for the Full cache)."""
        self._leaf_heap.compact(_full_leaf)

    def _upkeep(self) -> None:
        """The end of a public call that can push onto the leaf heap (match, insert, unlock):
        the heap compacted where it outgrew its cap (``LazyHeap.upkeep``), so a leaf touched
        again and again with no eviction between does not pile up stale entries.  The C
        core's calls end the same way (fast/_core.c ``heap_upkeep``)."""
        if len(self._heap) > self._leaf_heap.cap:
            self._compact_heap()

    # ------------------------------------------------------------------------------------------
    # Tree structure
    # ------------------------------------------------------------------------------------------

    def _new_node(self, key: Any, value: torch.Tensor | None, parent: Any, extra_key: Any,
                  stamp: int, ck: Any = None) -> Any:
        """A node of this cache's type (the C core's, or fast/node.py's)."""
        return TreeNode(key, value, parent, extra_key, stamp, ck)

    def _cut(self, child: Any, split_len: int) -> Any:
        """Cut ``child`` after ``split_len`` units: a new upper node (stamped now, with the
        child's Full lock count and the first part of its device slots) takes its place in the
        parent and has the child below it.  The plug-ins' data is the caller's to split."""
        parent = child.parent
        ek = child.extra_key
        ckey = child.key
        value = child.value
        self._clock += STRIDE
        # narrow_copy: one torch call per copy instead of a slice and a clone
        upper = self._new_node(ckey[:split_len],
                               None if value is None else _narrow_copy(value, 0, 0, split_len),
                               parent, ek, self._clock, child.ck)
        upper.lock_ref = child.lock_ref
        parent.children[child.ck] = upper
        child.key = ckey[split_len:]
        if value is not None:
            child.value = _narrow_copy(value, 0, split_len, len(ckey) - split_len)
            upper.dev_children = 1
        child.parent = upper
        child.ck = self._ck(ek, child.key, 0)
        upper.children[child.ck] = child
        return upper

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` units; the new upper node takes its place."""
        upper = self._cut(child, split_len)
        self._touch(child)
        return upper

    def _unevict(self, node: TreeNode, value: torch.Tensor, pos: int) -> None:
        """An evicted node met by an insert holds device data again: the fresh slots
        ``value[pos:pos + len(node.key)]`` (copied)."""
        node.value = _narrow_copy(value, 0, pos, len(node.key))
        node.parent.dev_children += 1
        if node.lock_ref == 0:
            self._evictable += len(node.key)
        else:
            self._protected += len(node.key)
        if self.validate_slots:
            self._owned.update(node.value.tolist())
        self._push_if_leaf(node)

    def find_node(self, key: RadixKey) -> TreeNode:
        """The node whose path is exactly ``key`` (the root for an empty key)."""
        toks = key.token_ids
        bigram = self.is_eagle or key.is_bigram
        if bigram and len(toks) == 1:
            raise NodeNotFound("under EAGLE a node path has no tokens (the root) or at least two")
        # EAGLE bigram units pair each token with the next: the shifted side is one shorter.
        units = list(zip(toks, toks[1:], strict=False)) if bigram else toks
        node, pos, n = self.root_node, 0, len(units)
        while pos < n:
            child = node.children.get(self._ck(key.extra_key, units, pos)) \
                if n - pos >= self.page_size else None
            if child is None or units[pos: pos + len(child.key)] != child.key:
                raise NodeNotFound(f"no node ends at this path ({n} units, "
                                   f"extra_key={key.extra_key!r})")
            node, pos = child, pos + len(child.key)
        return node

    # ------------------------------------------------------------------------------------------
    # match_prefix
    # ------------------------------------------------------------------------------------------

    def _match_prefix_py(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached device prefix of ``params.key`` in whole pages; a match ending inside
        a node splits it; the matched path becomes the most recent."""
        key = params.key
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        root = self.root_node
        toks = key.token_ids
        # EAGLE bigram units pair each token with the next: the shifted side is one shorter.
        units = list(zip(toks, toks[1:], strict=False)) if (self.is_eagle or key.is_bigram) else toks
        ps = self.page_size
        n = len(units)
        n -= n % ps
        if self.disable or n == 0:
            return _match_result((self._empty, root, root, root, 0, 0, 0, None, None))
        ek = key.extra_key
        if NATIVE and units is toks:  # array('q') units (not EAGLE): the C walk
            indices, node = _core.match(self, units, ek)
            self._upkeep()
            return _match_result((self._empty if indices is None else indices,
                                  node, node, node, 0, 0, 0, None, None))
        node, pos, chunks = root, 0, []
        step = keys.match_step
        while pos < n:
            child, k, split = step(node.children, units, pos, n, ps, ek)
            if child is None or child.value is None:
                break
            if not split:
                chunks.append(child.value)
                node, pos = child, pos + k
                continue
            node = self._split(child, k)
            chunks.append(node.value)
            break
        self._stamp_path(node)
        # NOTE: ancestors on a match path have a device child (the path), so only the matched
        # node itself can be an evictable leaf.
        if node.lock_ref == 0 and node.dev_children == 0 and node is not root:
            heapq.heappush(self._heap, (node.last_access_time, node))
        self._upkeep()
        # NOTE: a one-node match returns the node's own slots (no copy); values are never
        # modified in place by the cache, and callers must not modify device_indices either.
        return _match_result((self._indices(chunks), node, node, node, 0, 0, 0, None, None))

    def _stamp_path(self, node: TreeNode) -> None:
        """A match's stamps: the matched node newest, each ancestor one step older, up to and
        including the root.  O(depth)."""
        clock = self._clock + STRIDE
        self._clock = clock
        cur: TreeNode | None = node
        while cur is not None:
            cur.last_access_time = clock
            clock -= 1
            cur = cur.parent

    def _indices(self, chunks: list) -> torch.Tensor:
        """A match's device indices: its nodes' slot tensors in path order, as one tensor (a
        one-node match returns the node's own tensor, no copy)."""
        if not chunks:
            return self._empty
        if len(chunks) == 1:
            return chunks[0]
        return torch.cat(chunks)

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------

    def _walk(self, ek, units):
        """The nodes an insert walks through, as (node, shared units), yielded one by one;
        only the last can share less than the whole node.  Reads the tree only, but a caller
        may split the node it was just given (the walk then ends anyway)."""
        node, pos, n = self.root_node, 0, len(units)
        ps = self.page_size
        step = keys.match_step
        while pos < n:
            child, k, split = step(node.children, units, pos, n, ps, ek)
            if child is None:
                return
            yield child, k
            if split:
                return
            node, pos = child, pos + k

    def _plan(self, ek, units) -> list:
        """The whole walk of an insert, before anything changes, as a list of (node, shared
        units): ``_walk`` written as a loop (the hybrid cache's insert plans every time)."""
        node, pos, n = self.root_node, 0, len(units)
        ps = self.page_size
        plan = []
        step = keys.match_step
        while pos < n:
            child, k, split = step(node.children, units, pos, n, ps, ek)
            if child is None:
                break
            plan.append((child, k))
            if split:
                break
            node, pos = child, pos + k
        return plan

    def _check_value(self, key: RadixKey, value: object) -> torch.Tensor:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
            raise InvalidInput("value must be a 1-D int64 tensor")
        shape = value.shape
        if len(shape) != 1:
            raise InvalidInput("value must be a 1-D int64 tensor")
        if shape[0] != len(key.token_ids):
            raise InvalidInput(f"insert: value has {shape[0]} slots for {len(key.token_ids)} tokens")
        return value

    def _check_slots(self, plan: list, value: torch.Tensor, prev: int) -> None:
        """The spec's slot-ownership checks (spec/cache.py check_insert_slots)."""
        self._check_slot_list(plan, value.tolist(), prev)

    def _check_slot_list(self, plan: list, slots: list, prev: int) -> None:
        """``_check_slots`` on the slots as a list (every cache's checks of the device slots
        an insert hands over; ``plan``: (node, shared units) along the walk)."""
        if len(set(slots)) != len(slots):
            raise InvalidInput("insert: value holds the same slot twice")
        held = self._owned.intersection(slots[prev:])
        if held:
            raise InvalidInput(f"insert: slots {sorted(held)[:8]} from prev_prefix_len on are "
                               "already the tree's")
        dups, pos = [], 0
        for node, shared in plan:
            if node.value is not None:
                dups.extend(slots[max(pos, prev): pos + shared])
            pos += shared
        try:
            self.token_to_kv_pool_allocator.check_free(dups)
        except Exception as e:  # the environment's own error type
            raise InvalidInput(f"insert: duplicate slots cannot be freed: {e}") from None
        ps = self.page_size
        for k in range(pos, len(slots), ps):
            first = slots[k]
            if first % ps or slots[k: k + ps] != list(range(first, first + ps)):
                raise InvalidInput(f"insert: slots {slots[k: k + ps]} of the new leaf are not one whole page")
            if not self.token_to_kv_pool_allocator.is_allocated(first):
                raise InvalidInput(f"insert: slot {first} is not allocated")

    def _insert_py(self, params: InsertParams) -> InsertResult:
        """Cache ``key -> value``: touch the path, split at a partial match, restore evicted
        nodes from the fresh slots, free the caller's duplicates from ``prev_prefix_len`` on,
        add the remainder as a new leaf.  Returns the length that was already cached."""
        # NOTE: the hot path is written out inline (argument checks, key units, touches, the
        # new leaf): on CPython each helper call costs as much as the work it would hide.
        key, value = params.key, params.value
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        toks = key.token_ids
        if not isinstance(value, torch.Tensor) or value.dtype is not _INT64 \
                or value.shape != (len(toks),):
            value = self._check_value(key, value)
        prev = params.prev_prefix_len
        if type(prev) is not int or prev < 0:
            _int_arg("prev_prefix_len", prev)
        if params.chunked is not True and params.chunked is not False:
            raise InvalidInput(f"chunked must be a bool, got {params.chunked!r}")
        if self.disable:
            return InsertResult(prefix_len=0)
        # EAGLE bigram units pair each token with the next: the shifted side is one shorter.
        units = list(zip(toks, toks[1:], strict=False)) if (self.is_eagle or key.is_bigram) else toks
        n = len(units)
        cut = n % self.page_size
        if cut:
            n -= cut
            units = units[:n]
        ek = key.extra_key
        if self.validate_slots:
            plan = self._plan(ek, units)
            self._check_slots(plan, value[:n], prev)
        else:
            plan = self._walk(ek, units)
        if n < len(toks):
            value = value[:n]
        if NATIVE and type(units) is array:  # not EAGLE: the C walk (the same steps as below)
            pos = _core.insert(self, units, ek, value, prev)
            self._upkeep()
            return InsertResult(prefix_len=pos)

        heap = self._heap
        clock = self._clock + STRIDE
        node = self.root_node
        node.last_access_time = clock
        pos = 0
        dups: list[int] = []  # each node's duplicate range, lo, hi, ... (fast/frees.py)
        for child, shared in plan:
            clock += STRIDE
            child.last_access_time = clock
            if child.lock_ref == 0 and child.dev_children == 0 and child.value is not None:
                heapq.heappush(heap, (clock, child))
            if shared < len(child.key):
                self._clock = clock
                child = self._split(child, shared)
                clock = self._clock
            end = pos + shared
            if child.value is None:
                self._unevict(child, value, pos)
            elif prev < end:
                dups += (prev if prev > pos else pos, end)
            node, pos = child, end
        if dups:
            self._free_ranges(value, dups)
        if pos < n:
            clock += STRIDE
            rest = units[pos:]
            ck = (rest[0] if self.page_size == 1 else tuple(rest[: self.page_size])) \
                if ek is None else self._ck(ek, rest, 0)
            leaf = TreeNode(rest, _narrow_copy(value, 0, pos, n - pos), node, ek, clock, ck)
            node.children[ck] = leaf
            node.dev_children += 1
            self._evictable += n - pos
            if self.validate_slots:
                self._owned.update(leaf.value.tolist())
            heapq.heappush(heap, (clock, leaf))
        self._clock = clock
        self._upkeep()
        return InsertResult(prefix_len=pos)

    _deferred: list | None = None  # frees held back by the running call, batched at its end

    def _free(self, slots: torch.Tensor) -> None:
        """Slots the tree gives up go back to the allocator (queued on ``_deferred`` while a
        call batches its frees) and leave the owned-slot set."""
        if slots.shape[0]:
            if self._deferred is not None:
                self._deferred.append(slots)
            else:
                release(self.token_to_kv_pool_allocator, [slots], holder=self._tail())
            if self.validate_slots:
                self._owned.difference_update(slots.tolist())

    def _own(self, slots: torch.Tensor) -> None:
        """Slots the tree takes (the owned-slot set, with ``validate_slots``)."""
        if self.validate_slots:
            self._owned.update(slots.tolist())

    # ------------------------------------------------------------------------------------------
    # Locks
    # ------------------------------------------------------------------------------------------

    def _check_attached(self, node) -> None:
        if not isinstance(node, self._node_type) or (node is not self.root_node
                                                     and node.parent is None):
            raise NodeNotFound("the node is not in the tree")

    def _inc_lock_ref_py(self, node: TreeNode) -> IncLockRefResult:
        """Lock ``node``'s path up to the root (the evicted bottom segment is skipped and
        remembered in the result)."""
        self._check_attached(node)
        result = IncLockRefResult()
        if self.disable:
            return result
        root = self.root_node
        if NATIVE:
            delta, skipped = _core.inc_lock(root, node)
            if skipped:
                result.skip_lock_node_ids[FULL] = set(skipped)
        else:
            delta = self._inc_lock_py(root, node, result)
        self._evictable -= delta
        self._protected += delta
        result.delta = delta
        return result

    def _inc_lock_py(self, root, node, result: IncLockRefResult) -> int:
        cur = node
        while cur is not root and cur.value is None:
            result.skip_lock_node_ids.setdefault(FULL, set()).add(cur.id)
            cur = cur.parent
        return lock_walk(cur, root)

    def _dec_lock_ref_py(self, node: TreeNode, params: DecLockRefParams | None = None) -> DecLockRefResult:
        """Undo one ``inc_lock_ref`` of ``node`` (pass its result's ``to_dec_params()``)."""
        self._check_attached(node)
        if self.disable:
            return DecLockRefResult()
        root = self.root_node
        skip = params.skip_lock_node_ids.get(FULL, ()) if params is not None else ()
        if NATIVE:
            delta = _core.dec_lock(root, node, skip or None, self._heap)
            if delta < 0:
                raise HandleError("dec_lock_ref: this path is not locked (released twice?)")
            self._evictable += delta
            self._protected -= delta
            self._upkeep()
            return DecLockRefResult(delta=delta)
        delta, unlocked = self._dec_full_lock(node, skip)
        for n in unlocked:
            self._push_if_leaf(n)
        self._upkeep()
        return DecLockRefResult(delta=delta)

    def _dec_full_lock(self, node: TreeNode, skip: Any) -> tuple[int, list]:
        """Undo the Full lock of ``node``'s path (the ids in ``skip`` were not locked), after
        checking every count first (a refused unlock changes nothing).  Returns the units
        unlocked and the nodes whose count reached 0 (the caller pushes the new leaves)."""
        root = self.root_node
        cur = node
        while cur is not root:
            if cur.id not in skip and cur.lock_ref <= 0:
                raise HandleError("dec_lock_ref: this path is not locked (released twice?)")
            cur = cur.parent
        unlocked: list = []
        cur, delta = node, 0
        while cur is not root:
            if cur.id not in skip:
                cur.lock_ref -= 1
                if cur.lock_ref == 0:
                    delta += len(cur.key)
                    unlocked.append(cur)
            cur = cur.parent
        self._evictable += delta
        self._protected -= delta
        return delta, unlocked

    # ------------------------------------------------------------------------------------------
    # Eviction
    # ------------------------------------------------------------------------------------------

    def _evict_py_api(self, params: EvictParams) -> EvictResult:
        """Evict the oldest evictable device leaves, whole nodes, until ``num_tokens`` are
        freed or nothing is evictable.  Without a host tier an evicted leaf leaves the tree,
        and childless unlocked tombstone ancestors follow it."""
        want = _int_arg("num_tokens", params.num_tokens)
        if self.disable:
            return EvictResult()
        freed = _core.evict(self, want) if NATIVE else self._evict_py(want)
        if self._leaf_heap.needs_compaction(self._evictable // max(self.page_size, 1)):
            self._compact_heap()
        return EvictResult(num_tokens_evicted=freed)

    def _free_ranges(self, value: torch.Tensor, bounds: list) -> None:
        """Free the insert's duplicates, ``value[lo:hi]`` per node (the C core's insert calls
        this for two or more), in as few allocator calls as exactness
        allows (fast/frees.py)."""
        release_ranges(self.token_to_kv_pool_allocator, value, bounds, holder=self._tail())

    def _free_values(self, values: list) -> None:
        """Free the values one call released, in this order, in as few allocator calls as the
        allocator's semantics allow (fast/frees.py; the C core's evict calls this)."""
        release(self.token_to_kv_pool_allocator, values, holder=self._tail())

    def _tail(self) -> Any:
        """Whose tail buffer this cache's frees grow its KV allocator's list into
        (fast/_core.c "native frees"): its own where its C core frees too, so the two paths
        share one buffer; otherwise the allocator's (fast/frees.py ``tail_holder``)."""
        return self if self.core == "c" else None

    def _free_joined(self, joined: torch.Tensor, lengths: list) -> None:
        """Free two or more evicted values the C core's evict holds as C memory: ``joined`` is
        their concatenation in free order, ``lengths`` each one's length.  One free of
        ``joined`` where the allocator frees a concatenation exactly as it frees the pieces in
        turn (fast/frees.py ``free_order`` APPEND, and QUEUE, whose long pieces the C core
        does not join); otherwise the pieces, as views of it, through :meth:`_free_values`."""
        alloc = self.token_to_kv_pool_allocator
        if frees.free_order(alloc) in (frees.APPEND, frees.QUEUE):  # (looked up at each call)
            release(alloc, [joined], holder=self._tail())
        else:
            self._free_values(list(joined.split(lengths)))

    def _evict_py(self, want: int) -> int:
        heap = self._heap
        pop, push = heapq.heappop, heapq.heappush
        batch: list = []  # the evicted values, freed together at the end (fast/frees.py)
        owned = self._owned if self.validate_slots else None
        root = self.root_node
        try:
            freed = self._evict_loop(want, heap, pop, push, batch, owned, root)
        finally:
            self._free_values(batch)
        return freed

    @staticmethod
    def _detach_leaf(node: Any) -> Any:
        """An evicted device leaf leaves the tree (its device data dropped, its counters the
        caller's); returns its former parent.  O(1)."""
        node.value = None
        parent = node.parent
        del parent.children[node.ck]
        node.parent = None
        parent.dev_children -= 1
        return parent

    def _evict_loop(self, want, heap, pop, push, batch, owned, root) -> int:
        freed = 0
        # NOTE: the per-leaf work is inline (no Python call per evicted leaf).
        while freed < want and heap:
            stamp, node = pop(heap)
            if node.last_access_time != stamp or node.lock_ref or node.dev_children \
                    or node.value is None or node.parent is None:
                continue  # a stale entry
            value = node.value
            batch.append(value)
            if owned is not None:
                owned.difference_update(value.tolist())
            k = len(node.key)
            freed += k
            self._evictable -= k
            parent = self._detach_leaf(node)
            while parent is not root and not parent.children and parent.lock_ref == 0 \
                    and parent.value is None:
                up = parent.parent
                del up.children[parent.ck]
                parent.parent = None
                parent = up
            if parent.lock_ref == 0 and parent.dev_children == 0 and parent.value is not None \
                    and parent is not root:
                push(heap, (parent.last_access_time, parent))
        return freed

    # ------------------------------------------------------------------------------------------
    # The public hot methods: the C core takes the plain case whole (checks, walk, result) and
    # answers None for anything else (a bad argument, EAGLE, a disabled cache, slot validation,
    # an unaligned key), having changed nothing; the Python methods above run then, and raise
    # the same errors as always.  Without the C core the Python methods are the public ones.
    # ------------------------------------------------------------------------------------------

    if NATIVE:
        def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
            """Longest cached device prefix of ``params.key`` in whole pages; a match ending
            inside a node splits it; the matched path becomes the most recent."""
            r = _api_match(self, params)
            return self._match_prefix_py(params) if r is None else r

        def insert(self, params: InsertParams) -> InsertResult:
            """Cache ``key -> value``: touch the path, split at a partial match, restore
            evicted nodes from the fresh slots, free the caller's duplicates from
            ``prev_prefix_len`` on, add the remainder as a new leaf.  Returns the length that
            was already cached."""
            r = _api_insert(self, params)
            return self._insert_py(params) if r is None else r

        def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
            """Lock ``node``'s path up to the root (the evicted bottom segment is skipped and
            remembered in the result)."""
            r = _api_inc(self, node)
            return self._inc_lock_ref_py(node) if r is None else r

        def dec_lock_ref(self, node: TreeNode,
                         params: DecLockRefParams | None = None) -> DecLockRefResult:
            """Undo one ``inc_lock_ref`` of ``node`` (pass its result's ``to_dec_params()``)."""
            r = _api_dec(self, node, params)
            return self._dec_lock_ref_py(node, params) if r is None else r

        def evict(self, params: EvictParams) -> EvictResult:
            """Evict the oldest evictable device leaves, whole nodes, until ``num_tokens`` are
            freed or nothing is evictable."""
            r = _api_evict(self, params)
            return self._evict_py_api(params) if r is None else r
    else:
        match_prefix = _match_prefix_py
        insert = _insert_py
        inc_lock_ref = _inc_lock_ref_py
        dec_lock_ref = _dec_lock_ref_py
        evict = _evict_py_api

    # ------------------------------------------------------------------------------------------
    # Requests (upstream's cache_finished_req / cache_unfinished_req)
    # ------------------------------------------------------------------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """Cache a finished request's committed tokens (page-aligned) and release its lock;
        the rest of its committed slots, from there, go back to the allocator
        (``compat.cache_finished_req``)."""
        compat.cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """Cache what a running request has computed so far; its row then points at the
        tree's slots up to the new match, which it locks instead of the old last node
        (``compat.cache_unfinished_req``)."""
        compat.cache_unfinished_req(self, req, chunked)

    def _prepare_caching_req(self, req: Any, params: InsertParams, finished: bool) -> None:
        """The request path's hook before its insert: the aux components fill their insert
        data from the request (none here)."""

    def _cleanup_caching_req(self, req: Any, finished: bool, result: InsertResult | None,
                             params: InsertParams | None) -> None:
        """The request path's hook at its end: the aux components release what the request
        no longer needs (none here)."""

    def init_hicache(self, server_args: Any, params: Any) -> None:
        """Attach a host tier after construction, as SGLang's cache registry does: this cache
        becomes the :class:`~uniradix.fast.hicache.HiCacheRadixCache` that
        ``server_args`` describes (``uniradix.fast.hicache.hicache_config_from_server_args``
        says what is read and refused), with the components of ``params``.  Only before
        anything is cached."""
        from .hicache import HiCacheRadixCache, hicache_config_from_server_args
        if self.root_node.children:
            raise InvalidInput("init_hicache: the cache already holds data")
        config = hicache_config_from_server_args(server_args, params)
        before: Any = self.__class__
        self.__class__ = HiCacheRadixCache  # same instance, now the host-tier cache
        assert isinstance(self, HiCacheRadixCache)
        try:
            HiCacheRadixCache.__init__(self, params, config)
        except BaseException:  # refused: the cache it was, empty as it was
            self.__class__ = before
            before.__init__(self, params)
            raise

    def available_and_evictable_str(self) -> str:
        """Free plus evictable device tokens, in upstream's words (its out-of-memory
        messages)."""
        return compat.available_and_evictable_str(self)

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------

    def all_nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root_node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def eviction_order(self) -> list[TreeNode]:
        """The evictable device leaves in the order the heap would evict them."""
        return self._leaf_heap.ordered(self._is_leaf)

    def _child_violations(self, node: TreeNode, errors: list) -> None:
        """The tree around ``node``: each child's parent pointer and child key, and
        ``node.dev_children`` recounted.  O(children)."""
        dev = 0
        for ck, c in node.children.items():
            if c.parent is not node:
                errors.append(f"[tree] {c!r}: parent pointer is wrong")
            if ck != self._ck(c.extra_key, c.key, 0) or c.ck != ck:
                errors.append(f"[tree] {c!r}: filed under the wrong child key")
            if c.value is not None:
                dev += 1
        if node.dev_children != dev:
            errors.append(f"[tree] {node!r}: dev_children={node.dev_children}, counted {dev}")

    def _slot_and_leaf_violations(self, owned: list, leaves: set, errors: list) -> None:
        """``owned``: every device slot the tree holds (recounted); ``leaves``: the ids of the
        evictable device leaves (by ``_is_leaf``).  No slot twice, the owned-slot set (with
        ``validate_slots``) and the heap's live entries agree with them.  O(slots + heap)."""
        if len(set(owned)) != len(owned):
            errors.append("[size] a slot is held twice in the tree")
        if self.validate_slots and set(owned) != self._owned:
            errors.append("[size] the owned-slot set differs from the tree's slots")
        in_heap = self._leaf_heap.live_ids(self._is_leaf)
        if in_heap != leaves:
            errors.append(f"[leaf] heap holds {len(in_heap)} live leaves, the tree has {len(leaves)}")
        if len(self._heap) > self._leaf_heap.cap:
            errors.append(f"[leaf] the heap has {len(self._heap)} entries, over its cap "
                          f"{self._leaf_heap.cap} (a public call left it uncompacted)")

    def _device_violations(self, node: TreeNode, errors: list, acc: dict) -> None:
        """A node's device data (it has some): key/value lengths, the lock counts along the
        path, counted into ``acc`` (``ev``, ``pr``, ``owned``).  O(slots of the node)."""
        root = self.root_node
        if len(node.value) != len(node.key) or len(node.key) % self.page_size or not len(node.key):
            errors.append(f"[tree] {node!r}: key/value lengths {len(node.key)}/{len(node.value)}")
        if node.lock_ref < 0:
            errors.append(f"[lock] {node!r}: lock_ref < 0")
        if node.parent is not root and node.parent.lock_ref < node.lock_ref:
            errors.append(f"[lock] {node!r}: lock_ref exceeds its parent's")
        acc["pr" if node.lock_ref > 0 else "ev"] += len(node.value)
        acc["owned"].extend(node.value.tolist())

    def _node_violations(self, node: TreeNode, errors: list, acc: dict) -> None:
        """Everything checked on one node other than the root (each cache adds its own)."""
        if node.value is None:
            errors.append(f"[data] {node!r} holds no device data (no host tier)")
            return
        self._device_violations(node, errors, acc)
        if self._is_leaf(node):
            acc["leaves"].add(id(node))

    def _root_violations(self, errors: list) -> None:
        """What the root must not hold (each cache adds its own)."""

    def _total_violations(self, acc: dict, errors: list) -> None:
        """The counters and structures of the whole tree against the recounts in ``acc``
        (each cache adds its own)."""

    def violations(self) -> list[str]:
        """Every incremental structure checked against a recomputation from the tree: the
        tree around each node, each node (``_node_violations``), the counters and the leaf
        order, then what each cache adds (``_total_violations``)."""
        errors: list = []
        root = self.root_node
        acc: dict = {"ev": 0, "pr": 0, "owned": [], "leaves": set()}
        for node in self.all_nodes():
            self._child_violations(node, errors)
            if node is root:
                self._root_violations(errors)
            else:
                self._node_violations(node, errors, acc)
        if (acc["ev"], acc["pr"]) != (self._evictable, self._protected):
            errors.append(f"[size] counters evictable={self._evictable} protected={self._protected}, "
                          f"recomputed {acc['ev']}/{acc['pr']}")
        self._slot_and_leaf_violations(acc["owned"], acc["leaves"], errors)
        self._total_violations(acc, errors)
        return errors

    def sanity_check(self) -> None:
        """Raise AssertionError listing every violated invariant."""
        errors = self.violations()
        if errors:
            raise AssertionError(f"sanity check failed ({len(errors)} violations):\n  "
                                 + "\n  ".join(errors))

    def pretty_print(self) -> None:
        stack = [(self.root_node, 0)]
        while stack:
            node, indent = stack.pop()
            print(" " * indent, f"[{node.id}]", len(node.key), f"lock={node.lock_ref}",
                  f"stamp={node.last_access_time}")
            stack.extend((c, indent + 2) for c in node.children.values())
