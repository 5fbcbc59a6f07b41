"""HiCache for the fast path: the radix cache with a host tier (Full component), upstream
SGLang's engine-facing API, and a controller that moves KV with ``uniradix.kernels``.

``uniradix.fast.UnifiedRadixCache(params)`` builds a :class:`HiCacheRadixCache` when
``params.hicache`` is a :class:`HiCacheConfig`; without one it builds the device-only cache of
``cache.py`` (the C core), which this module does not touch.  This one is pure Python: the host
tier's extra work per node (host copies, host leaves, in-flight transfers) is bookkeeping the C
core does not have.

What it keeps (each checked by ``violations()`` against a recomputation from the tree):

* **Nodes** (:class:`HostNode`, ``__slots__``): ``value`` (device slots, an int64 tensor, or
  None when evicted), ``host_value`` (host slots, or None), ``lock_ref`` / ``host_lock_ref``,
  ``last_access_time`` (an integer logical clock, ``STRIDE`` per touch, a match stamping its
  path ``T, T-1, ...``), ``hit_count``, ``dev_children`` (children holding device data).
* **Device eviction order**: a heap of ``(stamp, node)`` with lazy deletion, as in
  ``cache.py``: an entry counts only while its stamp is the node's and the node is an evictable
  device leaf (attached, device data, unlocked, no child with device data).
* **Host leaves**: the set ``host_leaves`` (evicted, backed up, not host-locked, childless) and
  a lazily deleted heap of ``(stamp, node)`` over them, so ``evict_host`` takes the oldest host
  leaf in O(log n).  A node's membership is recomputed (O(1)) wherever one of its inputs
  changes.
* **Counters**: ``_evictable`` / ``_protected`` (device tokens unlocked / locked), ``_host_tokens``.
* **In-flight transfers**: ``ongoing_write_through`` / ``ongoing_load_back`` (ack id ->
  ``InFlight(node, lock)``), released when the controller's ack queues (of ``Ack`` records)
  say done (``writing_check``, ``loading_check``, ``check_hicache_events``); loads taken but
  not yet queued are ``PendingLoad`` records, logged copies ``Copy`` records.

Behaviour is the executable spec's (spec/host.py; docs/SPEC.md lists where it differs from
upstream 0.5.13.post1), checked step by step by the lockstep runs.

Complexities (d = nodes on a path, k = nodes evicted): ``match_prefix``, ``insert``,
``inc_lock_ref``, ``dec_lock_ref`` O(n + d) as in ``cache.py``; ``evict`` and ``evict_host``
O(k log L); ``writing_check`` / ``loading_check`` O(acks processed x d).
"""

from __future__ import annotations

import dataclasses
import heapq
from array import array
from typing import Any, NamedTuple

import torch

from . import compat
from . import params as api  # the API types, named api.X
from .cache import UnifiedRadixCache
from .errors import HandleError, InvalidInput, Unsupported
from .frees import APPEND, release
from .keys import shared_len
from .node import Node
from .radix_key import RadixKey
from .structures import LazyHeap

STRIDE = 1 << 20
FULL = 0
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_MODES = ("sync", "manual", "cuda")


# ----------------------------------------------------------------------------------------------
# Configuration and the host slot allocator
# ----------------------------------------------------------------------------------------------


class HostSlotAllocator:
    """A page-granular, lowest-first allocator of host slots (page 0 reserved, as the device
    pools): ``alloc(n)`` -> int64 tensor or None, ``free``, ``available_size``, ``clear``."""

    def __init__(self, slots: int, page_size: int = 1) -> None:
        if slots < 0 or slots % page_size:
            raise InvalidInput(f"host slots {slots} must be a multiple of page_size {page_size}")
        self.page_size = page_size
        self.num_pages = slots // page_size
        self.clear()

    def clear(self) -> None:
        self._free = list(range(1, self.num_pages + 1))

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        ps = self.page_size
        if n % ps or n // ps > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n // ps)]
        return torch.tensor([p * ps + j for p in pages for j in range(ps)], dtype=torch.int64)

    # its state does not depend on the order of the pages freed (lowest first): batchable
    uniradix_free_order = APPEND

    def free(self, slots) -> None:
        ps = self.page_size
        for s in slots.tolist()[::ps] if hasattr(slots, "tolist") else list(slots)[::ps]:
            heapq.heappush(self._free, s // ps)


@dataclasses.dataclass
class HiCacheConfig:
    """The host tier of a :class:`HiCacheRadixCache`.

    ``host_allocator``: the host slot pool (anything with ``alloc`` / ``free`` /
    ``available_size`` / ``clear``; default a :class:`HostSlotAllocator` of ``host_slots``).
    ``write_through_threshold``: None = upstream's default (1 for ``write_through``, 2
    otherwise).  ``io``: ``"sync"`` (a transfer completes when submitted), ``"manual"`` (acks
    complete only through :meth:`HiCacheController.complete`, the trace's ``io_complete``) or
    ``"cuda"`` (copies on a side stream, acks complete with their CUDA events).
    ``device_kv`` / ``host_kv``: ``uniradix.kernels`` DevicePool / HostPool; when both are given
    every backup and load copies the KV data (Triton where it runs, the torch reference
    elsewhere, ``copy_impl``).  ``log_copies``: keep a log of the copies (for checkers)."""

    host_slots: int = 0
    host_allocator: Any = None
    write_policy: str = "write_through"
    write_through_threshold: int | None = None
    load_back_threshold: int = 10
    io: str = "sync"
    device_kv: Any = None
    host_kv: Any = None
    copy_impl: str = "auto"
    log_copies: bool = False


def hicache_config_from_server_args(server_args: Any, params: Any) -> HiCacheConfig:
    """The host tier SGLang's ``server_args`` ask for (``UnifiedRadixCache.init_hicache``).

    Read: ``hicache_write_policy``; the host pool's size, ``hicache_ratio`` times the device
    allocator's ``size`` (whole pages).  Refused (``Unsupported``, naming the argument): a
    storage backend (``hicache_storage_backend``), a size in GB (``hicache_size``: uniradix
    does not know the bytes per token of SGLang's KV pool), and a device allocator whose
    ``get_kvcache()`` holds KV data, unless ``params.hicache`` (uniradix's option, a
    :class:`HiCacheConfig`) gives the ``uniradix.kernels`` pools that move it
    (``device_kv`` / ``host_kv``): a host tier that kept slots without copying KV would hand
    out wrong KV.  With ``params.hicache`` set, it is the configuration (its write policy
    and sizes win), after the same refusals."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend is not None:
        raise Unsupported(f"hicache_storage_backend={backend!r}: storage backends are not supported")
    size_gb = getattr(server_args, "hicache_size", 0)
    if size_gb:
        raise Unsupported(f"hicache_size={size_gb!r}: give the host pool as hicache_ratio")
    given = compat.read_settings(params).hicache
    if given is not None:
        return given
    policy = getattr(server_args, "hicache_write_policy", "write_through")
    if policy not in WRITE_POLICIES:
        raise Unsupported(f"hicache_write_policy={policy!r}: not one of {WRITE_POLICIES}")
    alloc = params.token_to_kv_pool_allocator
    get_kv = getattr(alloc, "get_kvcache", None)
    if get_kv is not None and get_kv() is not None:
        raise Unsupported("init_hicache: moving KV between SGLang's own KV pool and the host "
                          "needs uniradix.kernels pools; set params.hicache = "
                          "HiCacheConfig(device_kv=..., host_kv=..., ...)")
    ratio = getattr(server_args, "hicache_ratio", 2.0)
    ps = params.page_size
    slots = int(alloc.size * ratio)
    return HiCacheConfig(host_slots=slots - slots % ps, write_policy=policy)


# ----------------------------------------------------------------------------------------------
# The controller: host pool, transfers and their acks
# ----------------------------------------------------------------------------------------------


class _Event:
    """An ack's completion flag, with the CUDA event interface the cache polls."""

    __slots__ = ("done",)

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


class Ack(NamedTuple):
    """One queued transfer acknowledgement, upstream's ``(start_event, finish_event, node_ids)``
    (a tuple, so code that unpacks upstream's acks reads these the same way)."""

    start_event: Any  # None here: the caches poll only the finish event
    finish_event: Any  # has query() / synchronize(): an _Event, or a CUDA event
    node_ids: list  # the ack ids (node ids) the transfer covers


class PendingLoad(NamedTuple):
    """A load taken by ``HiCacheController.load`` and not yet queued by ``start_loading``."""

    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_id: int


class Copy(NamedTuple):
    """One logged copy (``log_copies``): ``("backup", device, host)`` or ``("load", host,
    device)``, slot lists in copy order."""

    kind: str
    src: list
    dst: list


class InFlight(NamedTuple):
    """A transfer the cache waits for: the node it is for and the lock it holds until the ack
    (``dec_lock_ref`` params; None for a write-through backup that took no lock)."""

    node: Any  # a HostNode
    lock: Any  # Optional[api.DecLockRefParams]


class HiCacheController:
    """Moves KV between the device pool and the host pool and queues one ack per backup and
    one per ``start_loading`` (acks are ``Ack(start_event, finish_event, node_ids)``, oldest
    first, as upstream's controller queues them)."""

    def __init__(self, config: HiCacheConfig, device_allocator: Any, page_size: int) -> None:
        if config.write_policy not in WRITE_POLICIES:
            raise InvalidInput(f"write_policy must be one of {WRITE_POLICIES}")
        if config.io not in IO_MODES:
            raise InvalidInput(f"io must be one of {IO_MODES}")
        self.write_policy = config.write_policy
        self.enable_storage = False
        self.io = config.io
        self.mem_pool_host = config.host_allocator if config.host_allocator is not None \
            else HostSlotAllocator(config.host_slots, page_size)
        self.device_allocator = device_allocator
        self.device_kv, self.host_kv = config.device_kv, config.host_kv
        self.copy_impl = config.copy_impl
        self.copies: list | None = [] if config.log_copies else None
        self.stream = None
        if self.io == "cuda":
            if not torch.cuda.is_available() or self.device_kv is None:
                raise Unsupported("io='cuda' needs CUDA and a device KV pool")
            from uniradix.kernels import TransferStream
            self.stream = TransferStream(self.device_kv.device, impl=config.copy_impl)
        self.ack_write_queue: list[Ack] = []
        self.ack_load_queue: list[Ack] = []
        self._pending_loads: list[PendingLoad] = []

    def _moves_data(self) -> bool:
        return self.device_kv is not None and self.host_kv is not None

    def write(self, device_indices, priority=None, node_id: int = -1, extra_pools=None):
        """Back ``device_indices`` up into fresh host slots; None when the host pool is short."""
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        if self.copies is not None:
            self.copies.append(Copy("backup", device_indices.tolist(), host_indices.tolist()))
        finish: Any
        if self.stream is not None:  # CUDA: the copy runs on the side stream
            finish = self.stream.backup_async(self.device_kv, self.host_kv,
                                              device_indices=device_indices,
                                              host_indices=host_indices, check_values=False)
        else:
            if self._moves_data():
                from uniradix.kernels import backup_all_layers
                backup_all_layers(self.device_kv, self.host_kv, device_indices=device_indices,
                                  host_indices=host_indices, impl=self.copy_impl)
            finish = _Event(self.io == "sync")
        self.ack_write_queue.append(Ack(None, finish, [node_id]))
        return host_indices

    def load(self, host_indices, priority=None, node_id: int = -1, extra_pools=None):
        """Take device slots for ``host_indices``; the copy is queued by ``start_loading``."""
        device_indices = self.device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        if self.copies is not None:
            self.copies.append(Copy("load", host_indices.tolist(), device_indices.tolist()))
        if self.stream is None and self._moves_data():  # CPU: copy now (complete on submit)
            from uniradix.kernels import load_all_layers
            load_all_layers(self.host_kv, self.device_kv, host_indices=host_indices,
                            device_indices=device_indices, impl=self.copy_impl)
        self._pending_loads.append(PendingLoad(host_indices, device_indices, node_id))
        return device_indices

    def start_loading(self) -> int:
        """Queue the loads since the last call as one ack (CUDA: layer by layer on the side
        stream; the ack completes with the last layer)."""
        if not self._pending_loads:
            return -1
        ids = [p.node_id for p in self._pending_loads]
        finish: Any
        if self.stream is not None:
            hi = torch.cat([p.host_indices for p in self._pending_loads])
            di = torch.cat([p.device_indices for p in self._pending_loads])
            finish = self.stream.load_layers_async(self.host_kv, self.device_kv, host_indices=hi,
                                                   device_indices=di, check_values=False)[-1]
        else:
            finish = _Event(self.io == "sync")
        self._pending_loads.clear()
        self.ack_load_queue.append(Ack(None, finish, ids))
        return 0

    def complete(self, writes: int, loads: int) -> None:
        """The environment finishes transfers (``io="manual"``): the ``writes`` / ``loads``
        oldest not-done acks are done (-1: all)."""
        for queue, k in ((self.ack_write_queue, writes), (self.ack_load_queue, loads)):
            for ack in queue:
                finish = ack.finish_event
                if k == 0:
                    break
                if not finish.query():
                    finish.synchronize()
                    k -= 1

    def take_copies(self) -> list:
        out = list(self.copies or ())
        if self.copies is not None:
            self.copies.clear()
        return out

    def append_host_mem_release(self, host_indices) -> None:
        self.mem_pool_host.free(host_indices)

    def reset(self) -> None:
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self._pending_loads.clear()


# ----------------------------------------------------------------------------------------------
# Nodes and lock results
# ----------------------------------------------------------------------------------------------


HostNode = Node  # the one pure-Python node type (fast/node.py): its host fields


@dataclasses.dataclass(slots=True)
class HostDecLockRefParams(api.DecLockRefParams):
    """Upstream's unlock parameters plus ``anchor``: the first node the lock counted (the one
    above the evicted bottom segment it skipped).  Everything below the anchor is skipped at
    unlock, which stays right when a skipped node is split or loaded back meanwhile."""

    anchor: Any = None


@dataclasses.dataclass(slots=True)
class HostIncLockRefResult(api.IncLockRefResult):
    anchor: Any = None

    def to_dec_params(self) -> HostDecLockRefParams:
        return HostDecLockRefParams(
            skip_lock_node_ids={k: set(v) for k, v in self.skip_lock_node_ids.items()},
            anchor=self.anchor)


@dataclasses.dataclass(slots=True)
class InitLoadBackParams:
    best_match_node: Any
    host_hit_length: int = 0
    mem_quota: int | None = None
    req: Any = None


# ----------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------


def _count_arg(name: str, x) -> int:
    if type(x) is not int or x < 0:
        raise InvalidInput(f"{name} must be a non-negative int, got {x!r}")
    return x


class HiCacheRadixCache(UnifiedRadixCache):
    """Radix prefix cache over device KV slots with a host tier; see the module docstring.

    What ``UnifiedRadixCache(params)`` returns for params with a host tier: a subclass for the
    type, every cache method its own (pure Python)."""

    core = "python"
    core_reason = "a host tier: the C core covers the device-only Full path"
    _node_type = HostNode

    def __init__(self, params: Any, hicache: HiCacheConfig | None = None) -> None:
        settings = compat.read_settings(params)
        hicache = hicache if hicache is not None else settings.hicache
        if compat.component_names(params.tree_components) != ["full"]:
            raise Unsupported(f"tree_components {params.tree_components}: the host tier supports "
                              "the Full component only")
        self._setup(params, multi_rank=False)
        alloc = self.token_to_kv_pool_allocator
        self.cache_controller = HiCacheController(hicache, alloc, self.page_size)
        self.write_policy = hicache.write_policy
        self.write_through_threshold = hicache.write_through_threshold \
            if hicache.write_through_threshold is not None \
            else (1 if hicache.write_policy == "write_through" else 2)
        self.load_back_threshold = hicache.load_back_threshold
        self.reset()

    # ------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the tree, the host copies and the in-flight transfers (the host pool is
        cleared with them, as upstream; the device allocator is the caller's)."""
        self._clock = 0
        self.root_node = HostNode(array("q"), self._empty, None, None, 0)
        self.root_node.lock_ref = 1
        # (stamp, node), lazily deleted (fast/structures.py): evictable device leaves; host leaves
        self._leaf_heap = LazyHeap()
        self._heap: list = self._leaf_heap.entries
        self._host_leaf_heap = LazyHeap()
        self._host_heap: list = self._host_leaf_heap.entries
        self.host_leaves: set = set()
        self._evictable = 0
        self._protected = 0
        self._host_tokens = 0
        self._owned: set = set()
        self.ongoing_write_through: dict[int, InFlight] = {}  # node id -> node, lock or None
        self.ongoing_load_back: dict[int, InFlight] = {}      # node id -> node, lock
        self.cache_controller.reset()
        self.cache_controller.mem_pool_host.clear()

    def total_size(self) -> tuple[int, int]:
        return self._evictable + self._protected, 0

    def host_size(self) -> int:
        return self._host_tokens

    def init_hicache(self, server_args: Any, params: Any) -> None:
        """Refused: this cache has its host tier already."""
        raise Unsupported("init_hicache: this cache already has a host tier")

    # ------------------------------------------------------------------------------------------
    # Keys, clock, leaf bookkeeping
    # ------------------------------------------------------------------------------------------

    def _units(self, key: RadixKey):
        toks = key.token_ids
        # EAGLE bigram units pair each token with the next: the shifted side is one shorter.
        return list(zip(toks, toks[1:], strict=False)) if (self.is_eagle or key.is_bigram) else toks

    def _is_leaf(self, node: HostNode) -> bool:
        return (node.lock_ref == 0 and node.dev_children == 0 and node.value is not None
                and node.parent is not None)

    @staticmethod
    def _is_host_leaf(node: HostNode) -> bool:
        return (node.parent is not None and node.value is None and node.host_value is not None
                and node.host_lock_ref == 0 and not node.children)

    def _update_host_leaf(self, node: HostNode) -> None:
        """Recompute ``node``'s host-leaf membership (after any of its inputs changed)."""
        if self._is_host_leaf(node):
            self.host_leaves.add(node)
            self._host_leaf_heap.push(node.last_access_time, node)
        else:
            self.host_leaves.discard(node)

    def _stamp(self, node: HostNode, stamp: int) -> None:
        node.last_access_time = stamp
        if node.value is not None:
            self._push_if_leaf(node)
        elif node in self.host_leaves:
            self._host_leaf_heap.push(stamp, node)

    def _touch(self, node: HostNode) -> None:
        self._clock += STRIDE
        self._stamp(node, self._clock)

    # ------------------------------------------------------------------------------------------
    # Tree structure
    # ------------------------------------------------------------------------------------------

    def _new_node(self, key: Any, value: torch.Tensor | None, parent: Any, extra_key: Any,
                  stamp: int, ck: Any = None) -> HostNode:
        return Node(key, value, parent, extra_key, stamp, ck)

    def _split(self, child: HostNode, split_len: int) -> HostNode:
        """Cut ``child`` after ``split_len`` units (device and host copies alike); the new upper
        node takes its place and inherits its lock count (not its host lock)."""
        upper = self._cut(child, split_len)
        host = child.host_value
        if host is not None:
            upper.host_value = host[:split_len].clone()
            child.host_value = host[split_len:].clone()
        self._touch(child)
        return upper

    def _detach(self, node: HostNode) -> None:
        parent = node.parent
        assert parent is not None, "detach of a detached node"
        del parent.children[node.ck]
        node.parent = None
        self.host_leaves.discard(node)

    def _delete_tombstones(self, node: HostNode) -> HostNode:
        """Delete childless ancestors with nothing on either tier and no locks; returns the
        first node that stays (its leaf status is refreshed)."""
        root = self.root_node
        while (node is not root and not node.children and node.lock_ref == 0
               and node.value is None and node.host_value is None and node.host_lock_ref == 0):
            up = node.parent
            assert up is not None  # attached: only the root has no parent
            self._detach(node)
            node = up
        if node is not root:
            self._push_if_leaf(node)
            self._update_host_leaf(node)
        return node

    # ------------------------------------------------------------------------------------------
    # match_prefix
    # ------------------------------------------------------------------------------------------

    def match_prefix(self, params: api.MatchPrefixParams) -> api.MatchResult:
        """Longest cached prefix of ``params.key`` in whole pages, on the device or the host:
        the walk goes through evicted nodes with a host copy; a match ending inside a node
        splits it; the path becomes the most recent.  ``device_indices`` are the device part,
        ``host_hit_length`` the host tokens below it."""
        key = params.key
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        root = self.root_node
        units = self._units(key)
        ps = self.page_size
        n = len(units)
        n -= n % ps
        if self.disable or n == 0:
            return api.MatchResult(self._empty, root, root, root, 0)
        ek = key.extra_key
        node, pos, chunks = root, 0, []
        while pos < n:
            ck = units[pos] if ps == 1 else tuple(units[pos: pos + ps])
            child = node.children.get(ck if ek is None else (ek, ck))
            if child is None or (child.value is None and child.host_value is None):
                break
            ckey = child.key
            end = pos + len(ckey)
            if end <= n and units[pos:end] == ckey:
                if child.value is not None:
                    chunks.append(child.value)
                node, pos = child, end
                continue
            node = self._split(child, shared_len(ckey, units, pos, n, ps))
            if node.value is not None:
                chunks.append(node.value)
            break
        clock = self._clock + STRIDE
        self._clock = clock
        cur = node
        while cur is not root:
            # NOTE: with a host tier an ancestor whose path child is evicted can be a device
            # leaf, so every stamped node may need a fresh heap entry
            self._stamp(cur, clock)
            clock -= 1
            cur = cur.parent
        root.last_access_time = clock
        last_device = node
        host_hit = 0
        while last_device is not root and last_device.value is None:
            host_hit += len(last_device.host_value)
            last_device = last_device.parent
        return api.MatchResult(self._indices(chunks), last_device, node, node, host_hit)

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------

    def _check_slots(self, plan: list, value: torch.Tensor, prev: int) -> None:
        """The base's checks, and the slots for evicted nodes on the way."""
        slots = value.tolist()
        self._check_slot_list(plan, slots, prev)
        ps = self.page_size
        start = 0  # evicted nodes on the way take their slots back: the same checks
        for node, shared in plan:
            if node.value is None:
                for k in range(start, start + shared, ps):
                    page = slots[k: k + ps]
                    first = page[0]
                    if first % ps or page != list(range(first, first + ps)):
                        raise InvalidInput(f"insert: slots {page} for an evicted node are not "
                                           "one whole page")
                    if not self.token_to_kv_pool_allocator.is_allocated(first) or \
                            self._owned.intersection(page):
                        raise InvalidInput(f"insert: slots {page} for an evicted node are not "
                                           "the caller's allocated slots")
            start += shared

    def insert(self, params: api.InsertParams) -> api.InsertResult:
        """Cache ``key -> value``: touch the path, split at a partial match, restore evicted
        nodes from the fresh slots (their host copies stay), free the caller's duplicates from
        ``prev_prefix_len`` on, add the remainder as a new leaf; count hits (write-through
        backs a node up once its count reaches the threshold)."""
        key, value = params.key, params.value
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        toks = key.token_ids
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 \
                or value.dim() != 1 or value.shape[0] != len(toks):
            raise InvalidInput("value must be a 1-D int64 tensor with one slot per token")
        prev = _count_arg("prev_prefix_len", params.prev_prefix_len)
        chunked = params.chunked
        if chunked is not True and chunked is not False:
            raise InvalidInput(f"chunked must be a bool, got {chunked!r}")
        if self.disable:
            return api.InsertResult(prefix_len=0)
        units = self._units(key)
        n = len(units)
        n -= n % self.page_size
        units = units[:n]
        value = value[:n]
        ek = key.extra_key
        plan = self._plan(ek, units)
        if self.validate_slots:
            self._check_slots(plan, value, prev)
        dups = []  # the caller's duplicates, freed together after the walk (fast/frees.py)
        self._touch(self.root_node)
        node, pos = self.root_node, 0
        for child, shared in plan:
            self._touch(child)
            if shared < len(child.key):
                child = self._split(child, shared)
            if child.value is None:
                self._unevict(child, value, pos)
            else:
                lo = max(pos, prev)
                if lo < pos + shared:
                    dups.append(value[lo: pos + shared])
            self._count_hit(child, chunked)
            node, pos = child, pos + shared
        release(self.token_to_kv_pool_allocator, dups)
        if pos < n:
            self._clock += STRIDE
            leaf = HostNode(units[pos:], value[pos:].clone(), node, ek, self._clock,
                            self._ck(ek, units, pos))
            node.children[leaf.ck] = leaf
            node.dev_children += 1
            self._evictable += n - pos
            if self.validate_slots:
                self._owned.update(leaf.value.tolist())
            self._push_if_leaf(leaf)
            self._update_host_leaf(node)
            self._count_hit(leaf, chunked)
        return api.InsertResult(prefix_len=pos, total_len=len(toks))

    def _unevict(self, node: HostNode, value: torch.Tensor, pos: int) -> None:
        """The base's (device data again from the fresh slots); the node holds device data, so
        it is no host leaf."""
        self.host_leaves.discard(node)
        super()._unevict(node, value, pos)

    def _count_hit(self, node: HostNode, chunked: bool) -> None:
        if chunked or node.value is None or self.write_policy == "write_back":
            return
        node.hit_count += 1
        if node.host_value is None and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    # ------------------------------------------------------------------------------------------
    # Locks
    # ------------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: HostNode) -> HostIncLockRefResult:
        """Lock ``node``'s path up to the root; the evicted bottom segment is skipped (and
        remembered: ``anchor`` is the first node locked)."""
        self._check_attached(node)
        result = HostIncLockRefResult()
        if self.disable:
            return result
        root = self.root_node
        delta = self._inc_lock_py(root, node, result)
        anchor = node
        while anchor is not root and anchor.value is None:
            up = anchor.parent
            assert up is not None  # the path ends at the root
            anchor = up
        result.anchor = anchor
        self._evictable -= delta
        self._protected += delta
        result.delta = delta
        return result

    def _locked_path(self, node: HostNode, params: api.DecLockRefParams | None) -> list:
        root = self.root_node
        anchor = getattr(params, "anchor", None) if params is not None else None
        cur = node
        if anchor is not None:  # everything below the anchor was skipped
            cur = anchor
            skip = ()
        else:
            skip = params.skip_lock_node_ids.get(FULL, ()) if params is not None else ()
        out = []
        while cur is not root:
            if cur.id not in skip:
                out.append(cur)
            up = cur.parent
            assert up is not None  # the path ends at the root
            cur = up
        return out

    def dec_lock_ref(self, node: HostNode, params: api.DecLockRefParams | None = None
                     ) -> api.DecLockRefResult:
        """Undo one ``inc_lock_ref`` of ``node`` (pass its result's ``to_dec_params()``)."""
        if getattr(params, "anchor", None) is None:
            self._check_attached(node)
        if self.disable:
            return api.DecLockRefResult()
        path = self._locked_path(node, params)
        if any(n.lock_ref <= 0 for n in path):
            raise HandleError("dec_lock_ref: this path is not locked (released twice?)")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                delta += len(n.key)
                self._push_if_leaf(n)
        self._evictable += delta
        self._protected -= delta
        return api.DecLockRefResult(delta=delta)

    def inc_host_lock_ref(self, node: HostNode) -> api.IncLockRefResult:
        """Protect ``node``'s host copy from host eviction (a node without one is left as it
        is)."""
        self._check_attached(node)
        if not self.disable and node.host_value is not None:
            node.host_lock_ref += 1
            self._update_host_leaf(node)
        return api.IncLockRefResult()

    def dec_host_lock_ref(self, node: HostNode, params: api.DecLockRefParams | None = None
                          ) -> api.DecLockRefResult:
        self._check_attached(node)
        if not self.disable and node.host_value is not None and node.host_lock_ref > 0:
            node.host_lock_ref -= 1
            self._update_host_leaf(node)
        return api.DecLockRefResult()

    # ------------------------------------------------------------------------------------------
    # Backup (device -> host)
    # ------------------------------------------------------------------------------------------

    def write_backup(self, node: HostNode, write_back: bool = False) -> int:
        """Copy ``node``'s device data to fresh host slots (the parent first under
        write-through), evicting host leaves for room; returns the slots written (0: none).
        A write-through write keeps the node locked until its ack is processed."""
        parent = node.parent
        assert parent is not None, "write_backup of the root or a detached node"
        if not write_back and parent is not self.root_node and parent.host_value is None:
            if self.write_backup(parent) <= 0:
                return 0
        cc = self.cache_controller
        n = len(node.value)
        avail = cc.mem_pool_host.available_size()
        if avail < n:
            needed = n - avail
            if self.evict_host(needed) < needed:
                return 0
        host_indices = cc.write(node.value, node_id=node.id)
        if host_indices is None:
            return 0
        node.host_value = host_indices
        self._host_tokens += n
        lock = None if write_back else self.inc_lock_ref(node).to_dec_params()
        self.ongoing_write_through[node.id] = InFlight(node, lock)
        return n

    # ------------------------------------------------------------------------------------------
    # Eviction
    # ------------------------------------------------------------------------------------------

    def evict(self, params: api.EvictParams) -> api.EvictResult:
        """Free at least ``num_tokens`` device tokens, oldest device leaf first: a backed-up
        leaf goes to the host (it stays in the tree); under write-back one without a copy is
        backed up first (a failed backup passes it over); otherwise it is deleted.  Write-back
        ends by waiting for every pending write."""
        want = _count_arg("num_tokens", params.num_tokens)
        if self.disable:
            return api.EvictResult()
        return api.EvictResult(num_tokens_evicted=self._evict(want))


    def _evict(self, want: int) -> int:
        outer, self._deferred = self._deferred, []
        try:
            return self._evict_tiered(want)
        finally:
            pieces, self._deferred = self._deferred, outer
            release(self.token_to_kv_pool_allocator, pieces)

    def _evict_tiered(self, want: int) -> int:
        heap = self._heap
        write_back = self.write_policy == "write_back"
        passed_over = []
        freed = 0
        while freed < want and heap:
            stamp, node = heapq.heappop(heap)
            if node.last_access_time != stamp or not self._is_leaf(node):
                continue
            if node.host_value is not None:
                freed += self._evict_to_host(node)
            elif write_back:
                if self.write_backup(node, write_back=True) == 0:
                    passed_over.append(node)
                    continue
                self.writing_check(write_back=True)
                freed += self._evict_to_host(node)
            else:
                freed += self._delete_device_leaf(node)
        for node in passed_over:
            self._push_if_leaf(node)
        if write_back:
            self.writing_check(write_back=True)
        if self._leaf_heap.needs_compaction(self._evictable // self.page_size):
            self._leaf_heap.compact(self._is_leaf)
        return freed

    def _release_device(self, node: HostNode) -> int:
        self._free(node.value)
        k = len(node.key)
        self._evictable -= k
        node.value = None
        parent = node.parent
        assert parent is not None  # a cached node is attached
        parent.dev_children -= 1
        return k

    def _evict_to_host(self, node: HostNode) -> int:
        k = self._release_device(node)
        self._update_host_leaf(node)
        self._push_if_leaf(node.parent)
        return k

    def _delete_device_leaf(self, node: HostNode) -> int:
        k = self._release_device(node)
        parent = node.parent
        assert parent is not None  # a cached node is attached
        self._detach(node)
        self._delete_tombstones(parent)
        return k

    def evict_host(self, num_tokens: int, component_type: Any = None) -> int:
        """Free at least ``num_tokens`` host tokens: the oldest host leaf, again and again;
        each leaves the tree with its childless tombstone ancestors.  Returns tokens freed."""
        _count_arg("num_tokens", num_tokens)
        heap = self._host_heap
        leaves = self.host_leaves
        pool = self.cache_controller.mem_pool_host
        pieces = []  # freed together at the end (fast/frees.py)
        freed = 0
        while freed < num_tokens and heap:
            stamp, node = heapq.heappop(heap)
            if node.last_access_time != stamp or node not in leaves:
                continue
            host = node.host_value
            pieces.append(host)
            k = len(host)
            freed += k
            self._host_tokens -= k
            node.host_value = None
            parent = node.parent
            self._detach(node)
            self._delete_tombstones(parent)
        release(pool, pieces)
        if self._host_leaf_heap.needs_compaction(len(leaves)):
            self._host_leaf_heap.compact(leaves.__contains__)
        return freed

    # ------------------------------------------------------------------------------------------
    # Load back (host -> device)
    # ------------------------------------------------------------------------------------------

    def load_back(self, node: HostNode, mem_quota: int | None = None, req: Any = None) -> bool:
        """Copy the evicted segment ending at ``node`` back to fresh device slots (evicting
        device leaves for room); the node's path stays locked until the load's ack.  False
        when nothing is loaded (below ``load_back_threshold``, over ``mem_quota``, or no
        room)."""
        segment = []
        cur = node
        while cur.evicted:
            segment.append(cur)
            up = cur.parent
            assert up is not None  # evicted: attached
            cur = up
        if not segment:
            return False
        segment.reverse()
        n_tokens = sum(len(s.host_value) for s in segment)
        guard = self.inc_lock_ref(node)
        assert guard.delta is not None  # set unless the cache is disabled (then nothing is evicted)
        if n_tokens < self.load_back_threshold or (
                mem_quota is not None and n_tokens > mem_quota + guard.delta):
            self.dec_lock_ref(node, guard.to_dec_params())
            return False
        alloc = self.token_to_kv_pool_allocator
        avail = alloc.available_size()
        if avail < n_tokens:
            needed = n_tokens - avail
            if self._evict(needed) < needed or node.parent is None:
                # (write-back backups made host room by evicting host leaves, this one too)
                self.dec_lock_ref(node, guard.to_dec_params())
                return False
        host_indices = torch.cat([s.host_value for s in segment])
        device_indices = self.cache_controller.load(host_indices, node_id=node.id)
        self.dec_lock_ref(node, guard.to_dec_params())
        if device_indices is None:
            return False
        pos = 0
        for s in segment:
            k = len(s.host_value)
            s.value = device_indices[pos: pos + k].clone()
            pos += k
            assert s.parent is not None  # evicted: attached
            s.parent.dev_children += 1
            self._evictable += k
            if self.validate_slots:
                self._owned.update(s.value.tolist())
            self.host_leaves.discard(s)
            self._push_if_leaf(s)
        self.ongoing_load_back[node.id] = InFlight(node, self.inc_lock_ref(node).to_dec_params())
        return True

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, HostNode]:
        """The scheduler's entry: load the host part of a match (``best_match_node``) and
        return the device slots now between the request's last device node and it, with the
        new last node; ``(empty, last device node)`` when nothing was loaded.  Without ``req``
        the last device node is the nearest ancestor of ``best_match_node`` not evicted."""
        node = params.best_match_node
        self._check_attached(node)
        if params.req is not None:
            last = params.req.last_node
            self._check_attached(last)
        else:  # no request: the match's last device node, the nearest ancestor not evicted
            last = node
            while last.evicted:
                last = last.parent
        cur = node
        while cur is not None and cur is not last:
            cur = cur.parent
        if cur is None:
            raise InvalidInput("init_load_back: the request's last node is not on the path")
        if params.mem_quota is not None:
            _count_arg("mem_quota", params.mem_quota)
        # (with the Full component only, a host hit means the best match is evicted)
        if node.evicted and self.load_back(node, params.mem_quota, params.req):
            chunks, cur = [], node
            while cur is not last:
                chunks.append(cur.value)
                cur = cur.parent
            if chunks:
                chunks.reverse()
                return torch.cat(chunks), node
        return self._empty, last

    def ready_to_load_host_cache(self) -> int:
        return self.cache_controller.start_loading()

    # ------------------------------------------------------------------------------------------
    # Acks
    # ------------------------------------------------------------------------------------------

    def writing_check(self, write_back: bool = False) -> None:
        """Process finished backups (the done prefix of the write-ack queue), unlocking their
        nodes; ``write_back``: wait for all of them first."""
        queue = self.cache_controller.ack_write_queue
        if write_back:
            for ack in queue:
                ack.finish_event.synchronize()
        while queue and queue[0].finish_event.query():
            for ack_id in queue.pop(0).node_ids:
                entry = self.ongoing_write_through.pop(ack_id, None)
                if entry is not None and entry.lock is not None:
                    self.dec_lock_ref(entry.node, entry.lock)

    def loading_check(self) -> None:
        """Process finished loads (the done prefix of the load-ack queue), unlocking them."""
        queue = self.cache_controller.ack_load_queue
        while queue and queue[0].finish_event.query():
            for ack_id in queue.pop(0).node_ids:
                entry = self.ongoing_load_back.pop(ack_id)
                self.dec_lock_ref(entry.node, entry.lock)

    def check_hicache_events(self) -> None:
        self.writing_check()
        self.loading_check()

    def flush_write_through_acks(self) -> None:
        self.writing_check()

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------

    def host_eviction_order(self) -> list[HostNode]:
        """The host leaves in the order ``evict_host`` would take them."""
        return self._host_leaf_heap.ordered(self.host_leaves.__contains__)

    def _node_violations(self, node: HostNode, errors: list, acc: dict) -> None:
        """One node on both tiers: data somewhere, backups above backups (write-through),
        lock counts, the host copy, the device data (``_device_violations``), the leaf sets."""
        root = self.root_node
        parent = node.parent
        assert parent is not None  # the walk visits attached non-root nodes
        if node.value is None and node.host_value is None:
            errors.append(f"[data] {node!r} holds no data on either tier")
        if node.value is not None and parent is not root and parent.value is None:
            errors.append(f"[data] {node!r} holds device data below an evicted parent")
        if (node.host_value is not None and self.write_policy != "write_back"
                and parent is not root and parent.host_value is None):
            errors.append(f"[host] {node!r} is backed up but its parent is not")
        if node.host_lock_ref < 0:
            errors.append(f"[lock] {node!r}: negative host lock count")
        if node.value is None:
            if node.lock_ref != 0:
                errors.append(f"[lock] {node!r}: evicted but lock_ref={node.lock_ref}")
        else:
            self._device_violations(node, errors, acc)
        if node.host_value is not None:
            acc["host"] = acc.get("host", 0) + len(node.host_value)
            if len(node.host_value) != len(node.key):
                errors.append(f"[host] {node!r}: host copy length")
        if self._is_leaf(node):
            acc["leaves"].add(id(node))
        if self._is_host_leaf(node):
            acc.setdefault("host_leaves", set()).add(id(node))

    def _total_violations(self, acc: dict, errors: list) -> None:
        """The host counter, the host leaf set and heap, the in-flight records' nodes."""
        root = self.root_node
        host, host_leaves = acc.get("host", 0), acc.get("host_leaves", set())
        if host != self._host_tokens:
            errors.append(f"[host-size] counter {self._host_tokens}, recomputed {host}")
        if {id(n) for n in self.host_leaves} != host_leaves:
            errors.append("[host-leaf] the host leaf set differs from the tree's host leaves")
        in_host_heap = self._host_leaf_heap.live_ids(self.host_leaves.__contains__)
        if in_host_heap != host_leaves:
            errors.append("[host-leaf] the host heap does not hold every host leaf")
        for kind, ongoing in (("write", self.ongoing_write_through), ("load", self.ongoing_load_back)):
            for node, lock in ongoing.values():
                if node is not root and node.parent is None:
                    errors.append(f"[in-flight] {kind} of a node not in the tree")
                elif lock is not None and node.lock_ref <= 0:
                    errors.append(f"[in-flight] {kind} of {node!r} without its lock")
