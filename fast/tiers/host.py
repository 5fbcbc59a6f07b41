"""The host tier (HiCache) as a tier plug-in of the one composed tree (fast/hybrid.py): the host
value ledger, host leaves and their heap, backup and load-back bookkeeping, the controller that
moves KV with ``uniradix.kernels``, and the named in-flight records.

The tree calls the tier at its hooks (match: host hits; split: the host copy is cut; insert:
an evicted node takes fresh slots, hit counts and write-through backups; eviction: a device leaf
goes to the host, or is backed up first under write-back; locks: the evicted bottom segment is
skipped and remembered by an anchor).  Each aux component (fast/components/) builds and commits
its own host transfers through its hooks ``backup`` / ``drop_host`` / ``reserve_load_back`` /
``alloc_load_back`` / ``cancel_load_back`` / ``commit_load_back`` / ``host_lock`` /
``host_unlock``: the Full data is this module's, a component's data is the component's.

What it keeps (each checked by ``violations`` against a recomputation from the tree):

* **Node fields** (fast/node.py): ``host_value`` (host slots, or None) and ``host_lock_ref``.
* **Host leaves**: the set ``host_leaves`` (evicted, backed up, not host-locked, childless) and
  a lazily deleted heap of ``(stamp, node)`` over them, so ``evict_host`` takes the oldest host
  leaf in O(log n).  A node's membership is recomputed (O(1)) wherever one of its inputs changes.
* **Counter**: ``host_tokens``.
* **In-flight transfers**: ``ongoing_write_through`` / ``ongoing_load_back`` (ack id ->
  ``InFlight(node, lock)``), released when the controller's ack queues (of ``Ack`` records)
  say done (``writing_check``, ``loading_check``); loads taken but not yet queued are
  ``PendingLoad`` records, logged copies ``Copy`` records.

Behaviour is the executable spec's (spec/host.py; docs/SPEC.md lists where it differs from
upstream 0.5.13.post1).  Complexities: ``evict_host`` O(k log L) for k host leaves taken;
``writing_check`` / ``loading_check`` O(acks processed x d).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any, NamedTuple

import torch

from .. import compat
from .. import params as api  # the API types, named api.X
from ..cache import FULL, _core, lock_walk
from ..errors import HandleError, InvalidInput, Unsupported
from ..frees import APPEND, host_alloc, release
from ..structures import LazyHeap

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
IO_MODES = ("sync", "manual", "cuda")
# host slots are CPU indices whatever default device the process sets (torch.set_default_device)
_CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Configuration and the host slot allocator
# ----------------------------------------------------------------------------------------------


class HostSlotAllocator:
    """A page-granular, lowest-first allocator of host slots (page 0 reserved, as the device
    pools): ``alloc(n)`` -> int64 tensor or None, ``free``, ``available_size``, ``clear``.

    The free pages are kept as a heap of disjoint runs ``(first, end)`` (end exclusive): the
    run on top holds the lowest free page, so ``alloc`` takes the lowest pages run by run (the
    same pages a heap of single pages would give, ascending) and a freed range goes back as
    the runs it is made of.  Runs are never merged on free; ``alloc`` joins the adjacent runs
    it takes into one slice, so its cost is one heap step per run and one tensor per slice,
    not a heap step per page.  (``UNIRADIX_PURE_PYTHON`` needs no fallback: this is Python.)"""

    # a freed tensor of up to this many pages is split into runs in Python, longer ones in torch
    _SHORT = 64

    def __init__(self, slots: int, page_size: int = 1) -> None:
        if slots < 0 or slots % page_size:
            raise InvalidInput(f"host slots {slots} must be a multiple of page_size {page_size}")
        self.page_size = page_size
        self.num_pages = slots // page_size
        self.clear()

    def clear(self) -> None:
        self._runs: list[tuple[int, int]] = [(1, self.num_pages + 1)] if self.num_pages else []
        self._pages = self.num_pages  # free pages (the runs' total length)

    def available_size(self) -> int:
        return self._pages * self.page_size

    def alloc(self, n: int) -> torch.Tensor | None:
        ps = self.page_size
        need = n // ps
        if n % ps or need > self._pages:
            return None
        if need <= 0:
            return torch.empty(0, dtype=torch.int64, device=_CPU)
        self._pages -= need
        runs = self._runs
        spans: list[list[int]] = []  # [first, end) page slices taken, adjacent runs joined
        while need:
            first, end = runs[0]
            take = end - first
            if take <= need:
                heapq.heappop(runs)
            else:
                take = need
                heapq.heapreplace(runs, (first + take, end))
            if spans and spans[-1][1] == first:
                spans[-1][1] = first + take
            else:
                spans.append([first, first + take])
            need -= take
        if len(spans) == 1:
            return torch.arange(spans[0][0] * ps, spans[0][1] * ps, dtype=torch.int64,
                                device=_CPU)
        return torch.cat([torch.arange(a * ps, b * ps, dtype=torch.int64, device=_CPU)
                          for a, b in spans])

    # its state does not depend on the order of the pages freed (lowest first): batchable
    uniradix_free_order = APPEND

    def free(self, slots) -> None:
        ps = self.page_size
        if isinstance(slots, torch.Tensor):
            firsts = slots.reshape(-1)[::ps]  # one slot per page: its first
            if firsts.numel() > self._SHORT:
                self._free_runs(*_page_runs(firsts, ps))
                return
            pages = [s // ps for s in firsts.tolist()]
        else:
            pages = [s // ps for s in list(slots)[::ps]]
        if not pages:
            return
        pages.sort()
        firsts_l, ends_l = [pages[0]], []
        for a, b in zip(pages, pages[1:], strict=False):
            if b != a + 1:  # (a page freed twice: two runs, as the page twice on a heap)
                ends_l.append(a + 1)
                firsts_l.append(b)
        ends_l.append(pages[-1] + 1)
        self._free_runs(firsts_l, ends_l)

    def _free_runs(self, firsts: list[int], ends: list[int]) -> None:
        runs = self._runs
        for a, b in zip(firsts, ends, strict=True):
            heapq.heappush(runs, (a, b))
            self._pages += b - a


def _page_runs(firsts: torch.Tensor, ps: int) -> tuple[list[int], list[int]]:
    """The pages of the slots ``firsts`` (one per page) as runs of consecutive pages,
    ascending: (first pages, end pages)."""
    pages = torch.div(firsts, ps, rounding_mode="floor") if ps > 1 else firsts
    step = pages[1:] - pages[:-1]
    if bool((step == 1).all()):  # one ascending run (what ``alloc`` hands out)
        return [int(pages[0])], [int(pages[-1]) + 1]
    pages = torch.sort(pages).values
    breaks = torch.nonzero(pages[1:] - pages[:-1] != 1).flatten()
    starts = torch.cat([pages[:1], pages[breaks + 1]])
    ends = torch.cat([pages[breaks], pages[-1:]]) + 1
    return starts.tolist(), ends.tolist()


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
    elsewhere, ``copy_impl``).  ``log_copies``: keep a log of the copies (for checkers).
    With Mamba: the host state pool, ``host_mamba_allocator`` (default a
    :class:`HostSlotAllocator` of ``host_mamba_slots`` states, default twice the device
    Mamba pool's size).  With SWA: the SWA host pool, ``host_swa_allocator`` (default a
    :class:`HostSlotAllocator` of ``host_swa_slots`` SWA host slots, default as many as the
    KV host pool's, paged as the KV pool)."""

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
    host_mamba_allocator: Any = None
    host_mamba_slots: int | None = None
    host_swa_allocator: Any = None
    host_swa_slots: int | None = None
    storage: Any = None  # the storage tier below this one (fast/tiers/storage.py StorageConfig)
    # the tensor-parallel ranks that must keep identical trees (a torch.distributed group;
    # SGLang's ``tp_cache_group``): each rank processes the MIN over the ranks of its finished
    # write and load acks.  None: one rank.
    tp_group: Any = None


def _world_size(group: Any) -> int:
    import torch.distributed as dist
    try:
        return int(dist.get_world_size(group=group))
    except (RuntimeError, ValueError, AttributeError):  # not initialised, or not a group
        return -1


def with_tp_group(config: HiCacheConfig, params: Any) -> HiCacheConfig:
    """``config`` with the tensor-parallel group the host tier reduces its acks over:
    ``config.tp_group``, else ``params.tp_cache_group`` when it spans more than one rank.
    Refused by name: a group that is not an initialised torch.distributed group.  A storage
    tier without its own groups under more than one rank gets them derived from the group
    (fast/tiers/storage.py ``with_derived_groups``: a collective, as upstream creates its
    prefetch groups), else its hit counts and prefetches would differ between ranks."""
    group = config.tp_group if config.tp_group is not None \
        else getattr(params, "tp_cache_group", None)
    if group is None:
        return config
    size = _world_size(group)
    if size < 1:
        raise Unsupported(f"tp_cache_group={group!r}: not an initialised torch.distributed "
                          "group (the host tier reduces its acks over it)")
    if size == 1:
        return dataclasses.replace(config, tp_group=None)
    if config.storage is not None and getattr(config.storage, "tp_group", None) is None:
        from .storage import with_derived_groups
        config = dataclasses.replace(config, storage=with_derived_groups(config.storage, group))
    return dataclasses.replace(config, tp_group=group)


def _min_over(group: Any, count: int) -> int:
    """``count`` reduced with MIN over ``group`` (itself without one)."""
    if group is None:
        return count
    import torch.distributed as dist
    t = torch.tensor([count], dtype=torch.int64, device=_CPU)  # (the cache's CPU group)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def hicache_config_from_server_args(server_args: Any, params: Any) -> HiCacheConfig:
    """The host tier SGLang's ``server_args`` ask for (``UnifiedRadixCache.init_hicache``).

    Read: ``hicache_write_policy``; the host pool's size, ``hicache_ratio`` times the device
    allocator's ``size`` (whole pages); a storage backend (``hicache_storage_backend``) adds
    the storage tier (fast/tiers/storage.py ``storage_config_from_server_args`` says what it
    reads and refuses).  Refused (``Unsupported``, naming the argument): a size in GB
    (``hicache_size``: uniradix does not know the bytes per token of SGLang's KV pool), and a
    device allocator whose ``get_kvcache()`` holds KV data, unless ``params.hicache`` (uniradix's option, a
    :class:`HiCacheConfig`) gives the ``uniradix.kernels`` pools that move it
    (``device_kv`` / ``host_kv``): a host tier that kept slots without copying KV would hand
    out wrong KV.  With ``params.hicache`` set, it is the configuration (its write policy
    and sizes win), after the same refusals."""
    size_gb = getattr(server_args, "hicache_size", 0)
    if size_gb:
        raise Unsupported(f"hicache_size={size_gb!r}: give the host pool as hicache_ratio")
    given = compat.read_settings(params).hicache
    if getattr(server_args, "hicache_storage_backend", None) is not None:  # fast/tiers/storage.py
        from .storage import storage_config_from_server_args
        storage = storage_config_from_server_args(server_args, params.page_size,
                                                  given.host_kv if given is not None else None)
        assert given is not None  # (refused above without host_kv)
        given = dataclasses.replace(given, storage=storage)
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


# the records of a backup built through tuple.__new__ with all their fields given: NamedTuple's
# Python-level __new__ skipped (one backup makes one of each)
_ack = functools.partial(tuple.__new__, Ack)
_narrow_copy = torch.narrow_copy
_in_flight = functools.partial(tuple.__new__, InFlight)


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
        # the aux components' copies (Mamba states; SWA data), as ``copies``
        self.state_copies: list | None = [] if config.log_copies else None
        self.swa_copies: list | None = [] if config.log_copies else None
        self.stream = None
        if self.io == "cuda":
            if not torch.cuda.is_available() or self.device_kv is None:
                raise Unsupported("io='cuda' needs CUDA and a device KV pool")
            from uniradix.kernels import TransferStream
            self.stream = TransferStream(self.device_kv.device, impl=config.copy_impl)
        self.ack_write_queue: list[Ack] = []
        self.ack_load_queue: list[Ack] = []
        self._pending_loads: list[PendingLoad] = []
        # a backup is only its ack (no copy logged, none to run, no stream), decided once:
        # ``HostTier.write_backup`` then queues the ack itself, ``submit_write`` written out
        self.ack_only = self.copies is None and self.stream is None and not self._moves_data()
        self.sync = self.io == "sync"

    def _moves_data(self) -> bool:
        return self.device_kv is not None and self.host_kv is not None

    def write(self, device_indices, priority=None, node_id: int = -1, extra_pools=None):
        """Back ``device_indices`` up into fresh host slots; None when the host pool is short."""
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.submit_write(device_indices, host_indices, node_id)
        return host_indices

    def submit_write(self, device_indices: torch.Tensor, host_indices: torch.Tensor,
                     node_id: int) -> None:
        """Copy ``device_indices`` into the host slots ``host_indices`` (taken already) and
        queue the write's ack."""
        if self.copies is not None:
            self.copies.append(Copy("backup", device_indices.tolist(), host_indices.tolist()))
        finish: Any
        if self.stream is not None:  # CUDA: the copy runs on the side stream
            finish = self.stream.backup_async(self.device_kv, self.host_kv,
                                              device_indices=device_indices,
                                              host_indices=host_indices, check_values=False)
        else:
            if self.device_kv is not None and self.host_kv is not None:  # (_moves_data)
                from uniradix.kernels import backup_all_layers
                backup_all_layers(self.device_kv, self.host_kv, device_indices=device_indices,
                                  host_indices=host_indices, impl=self.copy_impl)
            finish = _Event(self.sync)
        self.ack_write_queue.append(_ack((None, finish, [node_id])))

    def load(self, host_indices, priority=None, node_id: int = -1, extra_pools=None):
        """Take device slots for ``host_indices``; the copy is queued by ``start_loading``."""
        device_indices = self.device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_into(host_indices, device_indices, node_id)
        return device_indices

    def load_into(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
                  node_id: int = -1) -> None:
        """``load`` to device slots already taken (``device_indices``)."""
        if self.copies is not None:
            self.copies.append(Copy("load", host_indices.tolist(), device_indices.tolist()))
        if self.stream is None and self._moves_data():  # CPU: copy now (complete on submit)
            from uniradix.kernels import load_all_layers
            load_all_layers(self.host_kv, self.device_kv, host_indices=host_indices,
                            device_indices=device_indices, impl=self.copy_impl)
        self._pending_loads.append(PendingLoad(host_indices, device_indices, node_id))

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

    def take_state_copies(self) -> list:
        out = list(self.state_copies or ())
        if self.state_copies is not None:
            self.state_copies.clear()
        return out

    def take_swa_copies(self) -> list:
        out = list(self.swa_copies or ())
        if self.swa_copies is not None:
            self.swa_copies.clear()
        return out

    def append_host_mem_release(self, host_indices) -> None:
        release(self.mem_pool_host, [host_indices])  # (fast/frees.py: without a list copy)

    def reset(self) -> None:
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self._pending_loads.clear()
        if self.state_copies is not None:
            self.state_copies.clear()
        if self.swa_copies is not None:
            self.swa_copies.clear()


# ----------------------------------------------------------------------------------------------
# Lock results and load-back parameters
# ----------------------------------------------------------------------------------------------


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
            swa_uuid_for_lock=self.swa_uuid_for_lock,
            swa_uuid_for_host_lock=self.swa_uuid_for_host_lock,
            skip_lock_node_ids={k: set(v) for k, v in self.skip_lock_node_ids.items()}
            if self.skip_lock_node_ids else {},  # (no copy to make: no comprehension call)
            anchor=self.anchor)


@dataclasses.dataclass(slots=True)
class HostUnlockParams(api.DecLockRefParams):
    """What ``dec_host_lock_ref`` undoes: whether the lock counted on the node's Full host
    copy (``full``) and what each aux component locked (``tokens``: (component, token) pairs;
    SWA: the window of host copies it locked)."""

    full: bool = False
    tokens: tuple = ()


@dataclasses.dataclass(slots=True)
class HostLockResult(api.IncLockRefResult):
    """``inc_host_lock_ref``'s result: pass ``to_dec_params()`` to ``dec_host_lock_ref`` so
    that it undoes exactly this lock."""

    full: bool = False
    tokens: tuple = ()

    def to_dec_params(self) -> HostUnlockParams:
        return HostUnlockParams(swa_uuid_for_host_lock=self.swa_uuid_for_host_lock,
                                full=self.full, tokens=self.tokens)


@dataclasses.dataclass(slots=True)
class InitLoadBackParams:
    best_match_node: Any
    host_hit_length: int = 0
    mem_quota: int | None = None
    req: Any = None



def count_arg(name: str, x: Any) -> int:
    if type(x) is not int or x < 0:
        raise InvalidInput(f"{name} must be a non-negative int, got {x!r}")
    return x


# ----------------------------------------------------------------------------------------------
# The plug-in
# ----------------------------------------------------------------------------------------------


class HostTier:
    """The host tier of one composed cache (``cache``: fast/hybrid.py's tree, which calls these
    hooks and keeps the device side).  Public state: ``controller`` (the
    :class:`HiCacheController`), ``write_policy``, ``write_through_threshold``,
    ``load_back_threshold``, ``host_leaves``, ``host_tokens`` and the in-flight maps."""

    def __init__(self, cache: Any, config: HiCacheConfig) -> None:
        self.cache = cache
        self.controller = HiCacheController(config, cache.token_to_kv_pool_allocator,
                                            cache.page_size)
        self.write_policy = config.write_policy
        self.write_back = config.write_policy == "write_back"
        self.write_through_threshold = config.write_through_threshold \
            if config.write_through_threshold is not None \
            else (1 if config.write_policy == "write_through" else 2)
        self.load_back_threshold = config.load_back_threshold
        self.tp_group = config.tp_group  # ranks that agree on the acks processed (MIN)
        # (stamp, node) over the host leaves, lazily deleted (fast/structures.py)
        self.host_leaf_heap = LazyHeap()
        self.host_leaves: set = set()
        self.host_tokens = 0
        self.ongoing_write_through: dict[int, InFlight] = {}  # ack id -> node, lock or None
        self.ongoing_load_back: dict[int, InFlight] = {}      # ack id -> node, lock
        self.storage: Any = None  # the storage tier below (fast/tiers/storage.py), if any
        # where a load back takes its full slots: with SWA the allocator's full side alone
        # (SGLang's ``full_attn_allocator``; the SWA component pairs SWA slots itself)
        alloc = cache.token_to_kv_pool_allocator
        self.full_allocator = alloc if getattr(cache, "swa", None) is None \
            else getattr(alloc, "full_attn_allocator", alloc)
        if not cache.components and type(self).write_backup is HostTier.write_backup:
            # the Full component alone: its backups written out (``_write_backup_full``)
            self.write_backup = self._write_backup_full  # type: ignore[method-assign]

    def reset(self) -> None:
        """Forget the host copies and the in-flight transfers (in place: the cache hands the
        same objects out); the host pool is cleared with them, as upstream."""
        self.host_leaf_heap.clear()
        self.host_leaves.clear()
        self.host_tokens = 0
        self.ongoing_write_through.clear()
        self.ongoing_load_back.clear()
        self.controller.reset()
        self.controller.mem_pool_host.clear()
        if self.storage is not None:
            self.storage.reset()

    # -- host leaves -------------------------------------------------------------------------
    @staticmethod
    def is_host_leaf(node: Any) -> bool:
        """Evicted, backed up, childless, host-locked by no component (an SWA window host lock
        can hold a node whose Full host copy is not host-locked)."""
        return (node.parent is not None and node.value is None and node.host_value is not None
                and node.host_lock_ref == 0 and not node.children
                and (not node.aux or not any(r.host_lock for r in node.aux)))

    def update_host_leaf(self, node: Any) -> None:
        """Recompute ``node``'s host-leaf membership (after any of its inputs changed)."""
        if self.is_host_leaf(node):
            self.host_leaves.add(node)
            self.host_leaf_heap.push(node.last_access_time, node)
        else:
            self.host_leaves.discard(node)

    def restamped(self, node: Any) -> None:
        """An evicted ``node`` got a new stamp: a fresh heap entry where it is a host leaf."""
        if node in self.host_leaves:
            self.host_leaf_heap.push(node.last_access_time, node)

    def eviction_order(self) -> list:
        """The host leaves in the order ``evict_host`` would take them."""
        return self.host_leaf_heap.ordered(self.host_leaves.__contains__)

    # -- tree hooks --------------------------------------------------------------------------
    def split(self, upper: Any, child: Any, k: int) -> None:
        """The host copy is cut where the key is (the host lock stays with the lower part)."""
        host = child.host_value
        if host is not None:
            upper.host_value = host[:k].clone()
            child.host_value = host[k:].clone()
        if self.storage is not None:  # the page keys are cut too
            self.storage.split(upper, child, k)

    def detach(self, node: Any) -> None:
        """``node`` leaves the tree (it holds no device data)."""
        parent = node.parent
        assert parent is not None, "detach of a detached node"
        del parent.children[node.ck]
        node.parent = None
        for rec in node.aux:  # a live lock's walk goes on through the parent it had (SWA)
            rec.former_parent = parent
        self.host_leaves.discard(node)

    def delete_tombstones(self, node: Any) -> Any:
        """Delete childless ancestors with nothing on either tier and no locks; returns the
        first node that stays (its leaf status is refreshed)."""
        cache = self.cache
        root = cache.root_node
        while (node is not root and not node.children and node.lock_ref == 0
               and node.value is None and node.host_value is None and node.host_lock_ref == 0):
            up = node.parent
            assert up is not None  # attached: only the root has no parent
            self.detach(node)
            node = up
        if node is not root:
            cache._push_if_leaf(node)
            self.update_host_leaf(node)
        return node

    def count_hit(self, node: Any, chunked: bool) -> None:
        """An insert walked through (or made) ``node``: write-through backs it up once its hit
        count reaches the threshold."""
        if chunked or node.value is None or self.write_back:
            return
        node.hit_count += 1
        if node.host_value is None and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    def host_hit(self, best: Any, last_device: Any) -> int:
        """The host tokens of the host copies from ``best`` up to (not including)
        ``last_device``."""
        root = self.cache.root_node
        n, cur = 0, best
        while cur is not last_device and cur is not root:
            if cur.host_value is not None:
                n += cur.host_value.shape[0]  # (len() of a tensor: a Python-level wrapper)
            cur = cur.parent
        return n

    def check_unevict_slots(self, plan: list, slots: list) -> None:
        """Evicted nodes on an insert's way take the caller's slots back: each page one whole,
        allocated page the tree does not hold (``validate_slots``)."""
        cache = self.cache
        ps = cache.page_size
        start = 0
        for node, shared in plan:
            if node.value is None:
                for k in range(start, start + shared, ps):
                    page = slots[k: k + ps]
                    first = page[0]
                    if first % ps or page != list(range(first, first + ps)):
                        raise InvalidInput(f"insert: slots {page} for an evicted node are not "
                                           "one whole page")
                    if not cache.token_to_kv_pool_allocator.is_allocated(first) or \
                            cache._owned.intersection(page):
                        raise InvalidInput(f"insert: slots {page} for an evicted node are not "
                                           "the caller's allocated slots")
            start += shared

    # -- backup (device -> host) ---------------------------------------------------------------
    def write_backup(self, node: Any, write_back: bool = False) -> int:
        """Copy ``node``'s device data to fresh host slots (the parent first under
        write-through), evicting host leaves for room, then each aux component its own data
        (``AuxComponent.backup``; a failure undoes the backup); returns the slots written (0:
        none).  A write-through write keeps the node locked until its ack is processed."""
        cache = self.cache
        parent = node.parent
        assert parent is not None, "write_backup of the root or a detached node"
        if not write_back and parent is not cache.root_node and parent.host_value is None:
            if self.write_backup(parent) <= 0:
                return 0
        host_indices = self._take_host(node)
        if host_indices is None:
            return 0
        cc = self.controller
        value = node.value
        n = value.shape[0]  # (len() of a tensor is a Python-level wrapper)
        if cc.ack_only:  # (``submit_write`` written out: the ack is all it does)
            cc.ack_write_queue.append(_ack((None, _Event(cc.sync), [node.id])))
        else:
            cc.submit_write(value, host_indices, node.id)
        # a view of a host allocator's free list (sglang's hands those out) would keep that
        # whole list alive for as long as the node holds its host copy: such a view is copied;
        # a tensor of its own (HostSlotAllocator's) is kept as it is
        node.host_value = host_indices if host_indices._base is None else host_indices.clone()
        self.host_tokens += n
        if cache._events is not None:  # announced at the ack (fast/events.py)
            cache._events.host_written(node.id, node)
        if write_back:
            lock = None
        elif cache.components or cache.disable:
            # (one aux component: the lock's params made at once, fast/host_aux.py)
            write_lock = cache._write_lock
            lock = write_lock(cache, node) if write_lock is not None else None
            if lock is None:
                lock = cache.inc_lock_ref(node).to_dec_params()
        else:
            lock = self._full_write_lock(node)
        self.ongoing_write_through[node.id] = _in_flight((node, lock))
        return n

    def _write_backup_full(self, node: Any, write_back: bool = False) -> int:
        """``write_backup`` for a cache with no aux component (what ``write_backup`` is on such
        a tier), written out where a backup is only its ack (``controller.ack_only``) and no
        KV event is announced: ``_take_host`` (with no component to back up) inline, the
        same steps in the same order.  A write-back backup,
        a disabled cache, KV events or a controller that copies run ``write_backup`` itself
        (tests/fast/test_host_fast_paths.py compares the two step by step)."""
        cache = self.cache
        cc = self.controller
        if write_back or not cc.ack_only or cache._events is not None or cache.disable \
                or cache.components:
            return HostTier.write_backup(self, node, write_back)
        parent = node.parent
        assert parent is not None, "write_backup of the root or a detached node"
        root = cache.root_node
        if parent is not root and parent.host_value is None:  # write-through: the parent first
            if self.write_backup(parent) <= 0:
                return 0
        n = node.value.shape[0]  # (len() of a tensor is a Python-level wrapper)
        pool = cc.mem_pool_host
        host = pool.alloc(n)
        if host is None:  # (``_take_host``: room made only when the pool is short)
            avail = pool.available_size()
            if avail >= n:
                return 0
            needed = n - avail
            if self.evict_host(needed) < needed:
                return 0
            host = pool.alloc(n)
            if host is None:
                return 0
        cc.ack_write_queue.append(_ack((None, _Event(cc.sync), [node.id])))
        # (a view of the pool's free list is copied: see ``write_backup``)
        node.host_value = host if host._base is None else host.clone()
        self.host_tokens += n
        self.ongoing_write_through[node.id] = _in_flight((node, self._full_write_lock(node)))
        return n

    def _take_host(self, node: Any) -> torch.Tensor | None:
        """A backup's host slots for ``node``'s device data (making room by evicting host
        leaves), then each aux component's backup of its own data (``AuxComponent.backup``; a
        failure undoes them and frees the slots); None, with nothing taken, when some pool is
        short.  The pool checks its room itself: it is asked first (an alloc that finds the
        pool short takes nothing), and only when it is short is room made and it is asked
        again -- the calls ``available_size()``, ``evict_host``, ``alloc`` would make, without
        the room check on every backup."""
        pool = self.controller.mem_pool_host
        n = node.value.shape[0]  # (len() of a tensor is a Python-level wrapper)
        host_indices = host_alloc(pool, n)
        if host_indices is None:
            avail = pool.available_size()
            if avail >= n:
                return None
            needed = n - avail
            if self.evict_host(needed) < needed:
                return None
            host_indices = host_alloc(pool, n)
            if host_indices is None:
                return None
        components = self.cache.components
        if components:
            done: list = []
            for comp in components:  # each component backs its own data up (Mamba: the state)
                if not comp.backup(node):
                    for c in done:
                        c.drop_host(node)
                    release(pool, [host_indices])
                    return None
                done.append(comp)
        return host_indices

    def check_caller_unlock(self, node: Any, params: Any) -> None:
        """Before a caller's ``dec_lock_ref`` of ``node`` while host transfers hold locks: the
        lock's anchor (the first node it counted: ``params.anchor``, else the first node from
        ``node`` up that its Full skip set leaves out) must hold a lock besides those of the
        in-flight writes and loads at or below it (each counts one on every node from its own
        anchor up to the root).  Where it holds none, the caller's lock was released already,
        and this unlock would take a transfer's lock, leaving a node evictable while its copy is
        in flight: ``HandleError``, nothing changed (the spec refuses it through its handles;
        without a transfer in flight the lock counts alone refuse it).  The anchor's count
        decides first: above the number of transfers in flight nothing is walked (O(1));
        otherwise O(transfers x depth)."""
        writes, loads = self.ongoing_write_through, self.ongoing_load_back
        root = self.cache.root_node
        anchor = getattr(params, "anchor", None) if params is not None else None
        if anchor is None:
            skips = getattr(params, "skip_lock_node_ids", None) if params is not None else None
            skip = skips.get(FULL, ()) if isinstance(skips, dict) else ()
            anchor = node
            while anchor is not None and anchor is not root and anchor.id in skip:
                anchor = anchor.parent
        if anchor is None or anchor is root:
            return
        held = getattr(anchor, "lock_ref", None)
        if held.__class__ is not int or held > len(writes) + len(loads):
            return
        io = 0
        for ongoing in (writes, loads):
            for entry_node, lock in ongoing.values():
                if lock is None:  # (a write-back backup holds no lock)
                    continue
                cur = getattr(lock, "anchor", None) or entry_node
                while cur is not None and cur is not root:
                    if cur is anchor:
                        io += 1
                        break
                    cur = cur.parent
        if held - io < 1:
            if getattr(params, "anchor", None) is None:  # (a node not in the tree: that error
                self.cache._check_attached(node)        # first, as the unlock gives it)
            raise HandleError("dec_lock_ref: this path holds no lock but in-flight host "
                              "transfers' (released twice?)")

    def _full_write_lock(self, node: Any) -> HostDecLockRefParams:
        """``cache.inc_lock_ref(node).to_dec_params()`` for a cache with no aux component (not
        disabled), written out: the lock a write-through backup (and a load back) holds until
        its ack.  ``node``
        is attached and holds device data (it is being backed up), so the lock skips no node
        and its anchor is ``node``; every node from it up to the root counts one more lock
        (tests/fast/test_host_fast_paths.py checks both ways give the same tree and params)."""
        cache = self.cache
        delta = lock_walk(node, cache.root_node)
        cache._evictable -= delta
        cache._protected += delta
        return HostDecLockRefParams(anchor=node)

    def _full_write_unlock(self, anchor: Any) -> int:
        """``cache.dec_lock_ref(node, params)`` of a write-through lock on a cache with no aux
        component (not disabled), written out: ``params.anchor`` is ``anchor`` and nothing is
        skipped, so every node from ``anchor`` up to the root counts one lock less (all checked
        first: a refused unlock changes nothing), and each one whose count reaches 0 may be an
        evictable leaf now (pushed in the walk's order, as the general path pushes them).
        Returns the units unlocked (fast/host_full.py ``dec_lock_host`` answers with them)."""
        cache = self.cache
        if _core is not None and cache._dec_lock_host is not None:
            # (fast/host_full.py's paths are the cache's: the stock hooks; one C call, the
            # same steps, fast/_core.c host_unlock)
            delta = _core.host_unlock(cache, anchor)
            if delta is not None:
                return delta
        root = cache.root_node
        cur = anchor
        while cur is not root:
            if cur.lock_ref <= 0:
                raise HandleError("dec_lock_ref: this path is not locked (released twice?)")
            cur = cur.parent
        delta, cur = 0, anchor
        push = cache._push_if_leaf
        while cur is not root:
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                delta += len(cur.key)
                push(cur)
            cur = cur.parent
        cache._evictable += delta
        cache._protected -= delta
        return delta

    # -- device eviction with a host tier ----------------------------------------------------
    def evict_leaf(self, node: Any, tracker: list, batch: Any) -> bool:
        """Evict one device leaf the host tier's way: a backed-up leaf goes to the host (it
        stays in the tree); under write-back one without a copy is backed up first (False: the
        backup failed, nothing changed, the caller passes it over); otherwise it is deleted."""
        cache = self.cache
        if node.host_value is None:
            if not self.write_back:
                parent = cache._delete_leaf(node, tracker, batch)
                self.delete_tombstones(parent)
                return True
            cc = self.controller
            if cc.ack_only and not cc.ack_write_queue and self.tp_group is None \
                    and self.storage is None and cache._events is None \
                    and node.id not in self.ongoing_write_through:
                # (``write_backup(node, write_back=True)`` then ``writing_check(write_back=
                # True)``, written out for an empty ack queue and an ack nobody observes: the
                # ack and its in-flight record would be made and processed at once, changing
                # nothing else, so neither is made)
                host = self._take_host(node)
                if host is None:
                    return False
                node.host_value = host if host._base is None else host.clone()
                self.host_tokens += node.value.shape[0]
            else:
                if self.write_backup(node, write_back=True) == 0:
                    return False
                self.writing_check(write_back=True)
        if cache._events is not None:
            cache._events.removed(node)
        if cache.components:
            cache._drop_device(node, tracker, batch)  # with the aux components' device data
        else:  # (the Full-only host path, written out)
            batch.add("free", node.value)
            k = len(node.key)
            tracker[0] += k
            cache._evictable -= k
        node.value = None
        parent = node.parent
        parent.dev_children -= 1
        # (``update_host_leaf``, written out: the node is attached, evicted now, backed up)
        if node.host_lock_ref == 0 and not node.children \
                and (not node.aux or not any(r.host_lock for r in node.aux)):
            self.host_leaves.add(node)
            self.host_leaf_heap.push(node.last_access_time, node)
        else:
            self.host_leaves.discard(node)
        cache._push_if_leaf(parent)
        return True

    # -- host eviction -----------------------------------------------------------------------
    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens: the oldest host leaf, again and again;
        each leaves the tree with its aux host data and its childless tombstone ancestors.
        Returns tokens freed."""
        count_arg("num_tokens", num_tokens)
        heap = self.host_leaf_heap.entries
        leaves = self.host_leaves
        key_of = self.host_leaf_heap.key_of  # an eviction policy's key (None: the stamp)
        pieces: list = []  # freed together at the end (fast/frees.py)
        freed = 0
        while freed < num_tokens and heap:
            stamp, node = heapq.heappop(heap)
            if (node.last_access_time != stamp if key_of is None else key_of(node) != stamp) \
                    or node not in leaves:
                continue
            freed += self.evict_host_leaf(node, pieces)
        release(self.controller.mem_pool_host, pieces)
        if self.host_leaf_heap.needs_compaction(len(leaves)):
            self.host_leaf_heap.compact(leaves.__contains__)
        return freed

    def evict_host_leaf(self, node: Any, pieces: list | None = None) -> int:
        """A host leaf's host data goes (each component's first, then the Full host slots:
        onto ``pieces`` to be freed by the caller, else now) and it leaves the tree with its
        childless tombstone ancestors.  Returns the Full host tokens freed."""
        if self.cache._events is not None:
            self.cache._events.host_removed(node)
        for comp in self.cache.components:
            comp.drop_host(node)
        host = node.host_value
        k = host.shape[0]
        self.host_tokens -= k
        node.host_value = None
        if pieces is None:
            release(self.controller.mem_pool_host, [host])
        else:
            pieces.append(host)
        parent = node.parent
        self.detach(node)
        self.delete_tombstones(parent)
        return k

    # -- load back (host -> device) ------------------------------------------------------------
    def load_back(self, node: Any, mem_quota: int | None = None) -> bool:
        """Copy the evicted segment ending at ``node`` back to fresh device slots (evicting
        device leaves for room), each aux component its own data after the full slots
        (``AuxComponent.alloc_load_back`` / ``commit_load_back``);
        the node's path stays locked until the load's ack.  False when nothing is loaded
        (below ``load_back_threshold``, over ``mem_quota``, or no room on some pool)."""
        cache = self.cache
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
        n_tokens = 0
        for s in segment:  # (a tensor's shape[0]: len() is a Python-level wrapper)
            n_tokens += s.host_value.shape[0]
        aux = [c for c in cache.components if c.wants_load_back(node)]
        guard = cache.inc_lock_ref(node)
        params = guard.to_dec_params()
        assert guard.delta is not None  # set unless the cache is disabled (then nothing is evicted)
        for comp in aux:  # what the requester takes first (Mamba: its own state slot)
            if not comp.reserve_load_back(node):
                cache.dec_lock_ref(node, params)
                return False
        if (n_tokens < self.load_back_threshold and not aux) or (
                mem_quota is not None and n_tokens > mem_quota + guard.delta):
            cache.dec_lock_ref(node, params)
            return False
        full_alloc = self.full_allocator
        avail = full_alloc.available_size()
        if avail < n_tokens:
            needed = n_tokens - avail
            if cache._evict_units(needed)[0] < needed or node.parent is None:
                # (write-back backups made host room by evicting host leaves, this one too)
                cache.dec_lock_ref(node, params)
                return False
        # the full slots first (the seed's controller allocates the KV pool before the others),
        # then each component's, all or nothing (Mamba: a state slot, its room-making may evict)
        controller = self.controller
        # (with SWA full slots only: the SWA component takes the SWA slots of the window it
        # loads and maps them, the rest of the segment stays SWA tombstones)
        device_indices = full_alloc.alloc(n_tokens)
        if device_indices is None:
            cache.dec_lock_ref(node, params)
            return False
        for k, comp in enumerate(aux):
            if not comp.alloc_load_back(node):
                for taken in reversed(aux[:k]):
                    taken.cancel_load_back(node)
                full_alloc.free(device_indices)
                cache.dec_lock_ref(node, params)
                return False
        host_indices = torch.cat([s.host_value for s in segment])
        controller.load_into(host_indices, device_indices, node_id=node.id)
        cache.dec_lock_ref(node, params)
        pos = 0
        for s in segment:
            k = s.host_value.shape[0]
            # (a copy of its own, not a view of the allocator's list: ``clone`` of the slice
            # in one op)
            s.value = _narrow_copy(device_indices, 0, pos, k)
            pos += k
            assert s.parent is not None  # evicted: attached
            s.parent.dev_children += 1
            cache._evictable += k
            cache._own(s.value)
            self.host_leaves.discard(s)
            cache._push_if_leaf(s)
            if cache._events is not None:
                cache._events.stored(s)
        for comp in aux:
            comp.commit_load_back(node)
        # the lock held until the ack: ``node`` holds device data now, so with no aux component
        # it is the write-through lock written out (``_full_write_lock``)
        lock = cache.inc_lock_ref(node).to_dec_params() if cache.components or cache.disable \
            else self._full_write_lock(node)
        self.ongoing_load_back[node.id] = _in_flight((node, lock))
        return True

    # -- acks ----------------------------------------------------------------------------------
    def writing_check(self, write_back: bool = False) -> None:
        """Process finished backups (the done prefix of the write-ack queue), unlocking their
        nodes; ``write_back``: wait for all of them first.  With a ``tp_group`` every rank
        processes the MIN over the ranks of its done prefix (as 0.5.13.post1), so all ranks
        unlock, back up to storage and publish the same writes."""
        queue = self.controller.ack_write_queue
        if not queue:  # (nothing queued: nothing to wait for, no rank asked; _finished's 0)
            return
        if not write_back and _core is not None and self.cache._dec_lock_host is not None \
                and _core.host_writing(self) is not None:
            return  # (fast/host_full.py's paths: the stock hooks; the common case in one C
            # call, the same steps: fast/_core.c host_writing)
        first = queue[0].finish_event
        if first.__class__ is _Event and len(queue) == 1 and self.tp_group is None:
            # (one _Event ack, no tp group: its wait and ``_finished``'s count, written out)
            if write_back:
                first.done = True
            done = 1 if first.done else 0
        else:
            if write_back:
                for ack in queue:
                    ack.finish_event.synchronize()
            done = self._finished(queue)
        if not done:
            return
        cache = self.cache
        for ack in queue[:done]:
            del queue[0]
            finish = ack.finish_event
            if finish.__class__ is not _Event:  # (an _Event is done once its query said so)
                finish.synchronize()  # (done here: the MIN is at most this rank's count)
            for ack_id in ack.node_ids:
                if cache._events is not None:
                    cache._events.host_acked(ack_id)
                entry = self.ongoing_write_through.pop(ack_id, None)
                if entry is not None:
                    if entry.lock is not None:
                        if not cache.components and not cache.disable:  # (``_full_write_lock``'s)
                            self._full_write_unlock(entry.lock.anchor)
                        else:
                            cache.dec_lock_ref(entry.node, entry.lock)
                    if self.storage is not None:  # backed up to storage
                        self.storage.after_write_ack(ack_id, entry.node)

    def loading_check(self) -> None:
        """Process finished loads (the done prefix of the load-ack queue), unlocking them;
        with a ``tp_group`` the MIN over the ranks of the done prefix."""
        queue = self.controller.ack_load_queue
        if not queue:  # (_finished's 0, no rank asked)
            return
        done = self._finished(queue)
        if not done:
            return
        ongoing = self.ongoing_load_back
        cache = self.cache
        dec_lock_ref = cache.dec_lock_ref
        plain = not cache.components and not cache.disable  # (``load_back``'s written-out lock)
        for ack in queue[:done]:
            del queue[0]
            finish = ack.finish_event
            if finish.__class__ is not _Event:  # (an _Event is done once its query said so)
                finish.synchronize()
            for ack_id in ack.node_ids:
                entry = ongoing.pop(ack_id)
                if plain:
                    self._full_write_unlock(entry.lock.anchor)
                else:
                    dec_lock_ref(entry.node, entry.lock)

    def _finished(self, queue: list) -> int:
        """How many acks at the front of ``queue`` to process: the done prefix, reduced with
        MIN over ``tp_group``.  An empty queue asks no rank (every rank queues the same acks)."""
        if not queue:
            return 0
        done = 0
        for ack in queue:
            finish = ack.finish_event
            # (an _Event's query, read directly: one call less per ack)
            if not (finish.done if finish.__class__ is _Event else finish.query()):
                break
            done += 1
        return done if self.tp_group is None else _min_over(self.tp_group, done)

    # -- host locks ----------------------------------------------------------------------------
    def host_lock(self, node: Any) -> HostLockResult:
        """Lock ``node``'s Full host copy (if any) and let each component lock its host data
        (SWA: one window of host copies above the node)."""
        full = node.host_value is not None
        if full:
            node.host_lock_ref += 1
        tokens = tuple((comp, token) for comp in self.cache.components
                       for token in [comp.host_lock(node)] if token is not None)
        self.update_host_leaf(node)
        return HostLockResult(full=full, tokens=tokens)

    def host_unlock(self, node: Any, params: Any = None) -> None:
        """Undo a ``host_lock`` (``params``: its result's ``to_dec_params()``; without them,
        one lock of the node's Full host copy and of each component's host data there)."""
        if isinstance(params, HostUnlockParams):
            if params.full and node.host_lock_ref > 0:
                node.host_lock_ref -= 1
            for comp, token in params.tokens:
                comp.host_unlock(node, token)
        else:
            if node.host_value is not None and node.host_lock_ref > 0:
                node.host_lock_ref -= 1
            for comp in self.cache.components:
                comp.host_unlock(node, None)
        if node.parent is not None:  # (a node that left the tree is no host leaf)
            self.update_host_leaf(node)

    # -- checks --------------------------------------------------------------------------------
    def node_violations(self, node: Any, errors: list, acc: dict) -> None:
        """One node on both tiers: data somewhere, backups above backups (write-through),
        lock counts, the host copy, the device data (the tree's ``_device_violations``), the
        leaf sets."""
        cache = self.cache
        root = cache.root_node
        parent = node.parent
        assert parent is not None  # the walk visits attached non-root nodes
        if node.value is None and node.host_value is None:
            errors.append(f"[data] {node!r} holds no data on either tier")
        if node.value is not None and parent is not root and parent.value is None:
            errors.append(f"[data] {node!r} holds device data below an evicted parent")
        if (node.host_value is not None and not self.write_back
                and parent is not root and parent.host_value is None):
            errors.append(f"[host] {node!r} is backed up but its parent is not")
        if node.host_lock_ref < 0:
            errors.append(f"[lock] {node!r}: negative host lock count")
        if node.value is None:
            if node.lock_ref != 0:
                errors.append(f"[lock] {node!r}: evicted but lock_ref={node.lock_ref}")
        else:
            cache._device_violations(node, errors, acc)
        if node.host_value is not None:
            acc["host"] = acc.get("host", 0) + len(node.host_value)
            if len(node.host_value) != len(node.key):
                errors.append(f"[host] {node!r}: host copy length")
        if cache._is_leaf(node):
            acc["leaves"].add(id(node))
        if self.is_host_leaf(node):
            acc.setdefault("host_leaves", set()).add(id(node))

    def total_violations(self, acc: dict, errors: list) -> None:
        """The host counter, the host leaf set and heap, the in-flight records' nodes."""
        root = self.cache.root_node
        host, host_leaves = acc.get("host", 0), acc.get("host_leaves", set())
        if host != self.host_tokens:
            errors.append(f"[host-size] counter {self.host_tokens}, recomputed {host}")
        if {id(n) for n in self.host_leaves} != host_leaves:
            errors.append("[host-leaf] the host leaf set differs from the tree's host leaves")
        in_host_heap = self.host_leaf_heap.live_ids(self.host_leaves.__contains__)
        if in_host_heap != host_leaves:
            errors.append("[host-leaf] the host heap does not hold every host leaf")
        if len(self.host_leaf_heap) > self.host_leaf_heap.cap:
            errors.append(f"[host-leaf] the host heap has {len(self.host_leaf_heap)} entries, "
                          f"over its cap {self.host_leaf_heap.cap} (a public call left it "
                          "uncompacted)")
        for kind, ongoing in (("write", self.ongoing_write_through),
                              ("load", self.ongoing_load_back)):
            for node, lock in ongoing.values():
                if node is not root and node.parent is None:
                    errors.append(f"[in-flight] {kind} of a node not in the tree")
                elif lock is not None and node.lock_ref <= 0:
                    errors.append(f"[in-flight] {kind} of {node!r} without its lock")
