"""The storage tier (L3) as a tier plug-in of the composed cache (fast/hybrid.py), below the host
tier (fast/tiers/host.py): page keys, prefetch (storage -> host slots -> the tree as host-only
nodes), backup (a node's host copy -> storage once its host write is acked), the stop policies,
aborts and the three control queues the cache drains in ``check_hicache_events``.

Behaviour is the executable spec's (spec/storage.py; docs/SPEC.md "Storage tier" lists where
it differs from upstream 0.5.13.post1).  The host tier calls this plug-in at three hooks: a
split (the key list is cut; a pending write split in flight backs up every fragment), a
processed write ack (the node is backed up to storage) and ``check_hicache_events`` (the
control queues are drained); ``reset`` forgets what is in flight.

**Page keys** are computed lazily: a node's keys are a pure function of its path (the SHA-256
chain of spec/pagekeys.py), cached on the node (``Node.page_keys``, unset until first asked) and
cut by a split.

**Two I/O modes** (``StorageConfig.io``):

* ``"manual"`` (conformance runs): nothing completes by itself; the environment's steps
  ``query`` / ``load`` / ``backup`` / ``tick`` (the trace's ``storage_query`` ...) run the hit
  queries, page reads and backups, and the clock is logical.  Without a backend the store is an
  in-memory dict key -> the page's units (what the trace's snapshot lists).
* ``"threads"`` (production): a backup thread writes acked host copies with
  ``batch_set_v1`` and a prefetch thread runs hit queries (``batch_exists``) and page reads
  (``batch_get_v1``, in batches of ``STORAGE_BATCH_SIZE`` pages) straight into the prefetch's host
  slots; the clock is ``time.monotonic`` (seconds).  A backend that fails, times out or reads
  short ends the prefetch there (a miss: the pages not read are released) or leaves a backup
  unwritten; the tree only ever takes pages a read reported complete.

The host<->device copies stay the host tier's (``uniradix.kernels``).  Pages move between the
host pool and the backend through the backend's zero-copy ``*_v1`` calls against the host pool
given to ``register_mem_pool_host`` (the caller registers its ``uniradix.kernels.HostPool``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import InvalidInput, Unsupported
from ..frees import release
from ..node import Node
from ..radix_key import RadixKey, as_token_array

STOP_POLICIES = ("best_effort", "wait_complete", "timeout")
IO_MODES = ("manual", "threads")
KEY_MODES = ("namespaced", "compat")
NAMESPACE_TAG = b"uniradix/extra_key\x00"
STRIDE = 1 << 20  # the composed tree's clock step (fast/hybrid.py)
BATCH_PAGES = 128  # pages per backend call (upstream's controller issues 128-page batches)


# ----------------------------------------------------------------------------------------------
# Page keys (the same chain as spec/pagekeys.py)
# ----------------------------------------------------------------------------------------------


def _token_bytes(t: int) -> bytes:
    if not 0 <= t < 2 ** 32:
        raise InvalidInput(f"page key: token {t!r} is not an integer in [0, 2**32)")
    return int(t).to_bytes(4, "little")


def page_key(units: Sequence[Any], prior: str | None) -> str:
    """The key of one page of ``units`` after a page keyed ``prior`` (None: the first)."""
    h = hashlib.sha256()
    if prior:
        h.update(bytes.fromhex(prior))
    for u in units:
        if isinstance(u, tuple):
            for t in u:
                h.update(_token_bytes(t))
        else:
            h.update(_token_bytes(u))
    return h.hexdigest()


def namespace_prior(extra_key: str | None, key_mode: str) -> str | None:
    """What the first page of a chain absorbs: the namespace digest of ``extra_key``
    (namespaced mode), nothing without one or in compat mode."""
    if extra_key is None or key_mode == "compat":
        return None
    return hashlib.sha256(NAMESPACE_TAG + str(extra_key).encode("utf-8")).hexdigest()


class RootKeys(tuple):
    """The root's ``page_keys``: empty (the root has no pages), naming the storage tier, so
    that ``Node.get_last_hash_value`` (fast/node.py) finds the tier from any node's path."""

    tier: Any

    def __new__(cls, tier: Any) -> RootKeys:
        out = super().__new__(cls, ())
        out.tier = tier
        return out


def chain_keys(units: Sequence[Any], page_size: int, prior: str | None) -> tuple[str, ...]:
    keys = []
    last = prior
    for start in range(0, len(units), page_size):
        last = page_key(units[start: start + page_size], last)
        keys.append(last)
    return tuple(keys)


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StorageConfig:
    """The storage tier of a cache with a host tier (``HiCacheConfig.storage``).

    ``backend``: a ``uniradix.fast.storage`` backend (or any object with upstream's
    ``HiCacheStorage`` methods ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1`` /
    ``clear``); None only with ``io="manual"`` (an in-memory store of units, for conformance).
    ``prefetch_threshold``: tokens (never below one page); ``prefetch_stop_policy``:
    ``best_effort`` / ``wait_complete`` / ``timeout``; ``prefetch_timeout_base`` /
    ``prefetch_timeout_per_page``: clock units (``manual``: ticks; ``threads``: seconds);
    ``key_mode``: ``namespaced`` (default) or ``compat`` (0.5.13.post1's keys, shared across
    extra keys); ``prefetch_capacity``: tokens that prefetches in flight may occupy (None: 80%
    of the host pool beyond the device pool, as upstream).  The storage copies are logged
    (``("store", host_slots, keys)`` / ``("fetch", keys, host_slots)``) with the host tier's
    copy log when it keeps one (``HiCacheConfig.log_copies``), for the KV checker.

    Tensor parallelism: ``tp_group`` (the scheduler's side) and ``tp_io_group`` (the storage
    thread's; a second group, since the two sides issue collectives concurrently), both
    ``torch.distributed`` process groups over the same ranks (gloo on CPU), make every rank
    decide alike as upstream does: the storage hit and the tokens a finished prefetch inserts
    are the MIN over ranks, a prefetch ends when it may end on every rank or was terminated
    on any (MAX), the control queues drain the MIN of their lengths, and an abort waits for
    every rank (a barrier).  None (the default): one rank, no collective; under a cache whose
    ``tp_cache_group`` spans several ranks they are derived from it when the cache is built
    (:func:`with_derived_groups`)."""

    backend: Any = None
    io: str = "manual"
    prefetch_threshold: int = 256
    prefetch_stop_policy: str = "best_effort"
    prefetch_timeout_base: float = 1
    prefetch_timeout_per_page: float = 0
    key_mode: str = "namespaced"
    prefetch_capacity: int | None = None
    clock: Callable[[], float] | None = None
    tp_group: Any = None
    tp_io_group: Any = None

    def validate(self) -> None:
        if self.io not in IO_MODES:
            raise InvalidInput(f"storage io must be one of {IO_MODES}, got {self.io!r}")
        if self.prefetch_stop_policy not in STOP_POLICIES:
            raise InvalidInput(f"prefetch_stop_policy must be one of {STOP_POLICIES}, got "
                               f"{self.prefetch_stop_policy!r}")
        if self.key_mode not in KEY_MODES:
            raise InvalidInput(f"storage key_mode must be one of {KEY_MODES}, got {self.key_mode!r}")
        for name in ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_page"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise InvalidInput(f"{name} must be a number >= 0, got {v!r}")
        if self.prefetch_capacity is not None and (
                type(self.prefetch_capacity) is not int or self.prefetch_capacity < 0):
            raise InvalidInput(f"prefetch_capacity must be an int >= 0, got {self.prefetch_capacity!r}")
        if self.backend is None and self.io != "manual":
            raise InvalidInput("storage io='threads' needs a backend")
        if (self.tp_group is None) != (self.tp_io_group is None):
            raise InvalidInput("tp_group and tp_io_group go together (one per side)")


# ----------------------------------------------------------------------------------------------
# In-flight records
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Backup:
    """One write of a node's host copy to storage; holds a host lock until its ack is drained."""

    serial: int
    node: Any
    keys: tuple[str, ...]
    units: tuple[Any, ...]
    host_indices: torch.Tensor
    done: bool = False
    written: int = 0  # tokens the store took (sglang:backuped_tokens_total, fast/metrics.py)


@dataclasses.dataclass(eq=False)
class Prefetch:
    """One prefetch (upstream's PrefetchOperation plus the cache's ongoing entry)."""

    serial: int
    rid: str
    anchor: Any
    anchor_locked: bool
    units: Any             # the page-aligned units to fetch
    extra_key: Any
    slots: torch.Tensor    # the host slots taken, one per unit
    last_key: str | None
    start: float           # the clock at submission
    queried: bool = False
    keys: tuple[str, ...] = ()   # the hit pages' keys (set by the hit query)
    completed: int = 0     # tokens loaded so far
    terminated: bool = False
    transfer_done: bool = False
    released_from: int | None = None  # slots[released_from:] went to the release queue
    taken: int = 0         # slots[:taken] were handed to the cache


def io_group_over(group: Any) -> Any:
    """A new gloo process group over ``group``'s ranks, for the storage thread's collectives
    (the scheduler's side keeps ``group``).  Collective over the whole world, as
    ``torch.distributed.new_group`` is: every rank states its own group's ranks
    (``all_gather_object``), then every rank creates every distinct rank set, in one order,
    and keeps the one it belongs to.  So every rank of the world must call it (each with its
    own tensor-parallel group), as SGLang builds every rank's cache."""
    import torch.distributed as dist
    mine = tuple(sorted(dist.get_process_group_ranks(group)))
    stated: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(stated, mine)
    out = None
    for ranks in sorted({tuple(r) for r in stated}):
        created = dist.new_group(ranks=list(ranks), backend="gloo")
        if ranks == mine:
            out = created
    assert out is not None  # (this rank stated ``mine``)
    _mark_created(out)
    return out


# Objects uniradix created for a storage config, not the caller: the I/O groups
# :func:`io_group_over` derives and the backends :func:`storage_config_from_server_args` builds.
# The tier built from the config claims them (``StorageTier.__init__``) and releases them in its
# ``close``; a group or backend the caller put in a config is never in here, so never released.
_created: dict[int, Any] = {}
_created_lock = threading.Lock()


def _mark_created(obj: Any) -> None:
    with _created_lock:
        _created[id(obj)] = obj


def _claim(obj: Any) -> Any:
    """``obj`` when uniradix created it and no tier has claimed it yet (now this one has);
    else None."""
    if obj is None:
        return None
    with _created_lock:
        if _created.get(id(obj)) is obj:
            del _created[id(obj)]
            return obj
    return None


def with_derived_groups(config: StorageConfig, group: Any) -> StorageConfig:
    """``config`` with its tensor-parallel groups derived from the cache's multi-rank
    ``group`` (SGLang's ``tp_cache_group``) where it has none: ``tp_group`` is ``group``
    itself, ``tp_io_group`` a new gloo group over the same ranks (:func:`io_group_over`,
    collective).  Groups given in ``config`` are kept as they are."""
    config.validate()  # (bad settings are refused before any collective)
    if config.tp_group is not None:
        return config
    return dataclasses.replace(config, tp_group=group, tp_io_group=io_group_over(group))


def _reduce(group: Any, values: list[int], op: str) -> list[int]:
    """``values`` reduced element-wise over ``group`` (``"min"`` / ``"max"``); as they are
    without a group."""
    if group is None:
        return values
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.int64, device="cpu")  # (the cache's CPU group)
    dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]


def _count(name: str, k: object) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise InvalidInput(f"{name} must be an int >= -1, got {k!r}")
    return k


# ----------------------------------------------------------------------------------------------
# The plug-in
# ----------------------------------------------------------------------------------------------


class StorageTier:
    """The storage tier of one composed cache with a host tier (``cache.tier``)."""

    metrics: Any = None  # its StorageTierMetrics with enable_metrics (fast/metrics.py)

    def __init__(self, cache: Any, config: StorageConfig) -> None:
        config.validate()
        # what uniradix created for this config; released by close()
        self._own_io_group: Any = _claim(config.tp_io_group)
        self._own_backend: Any = _claim(config.backend)
        self.closed = False
        try:
            self._build(cache, config)
        except BaseException:
            self._release_owned(barrier=False)  # (no collective ran on the group yet)
            raise

    def _build(self, cache: Any, config: StorageConfig) -> None:
        host = cache.tier
        if host is None:
            raise Unsupported("the storage tier needs a host tier")
        if cache.components:
            raise Unsupported("the storage tier with SWA or Mamba is not supported yet")
        self.cache = cache
        self.host = host
        self.config = config
        self.page_size = cache.page_size
        self.backend = config.backend
        self.threads = config.io == "threads"
        self.store: dict[str, tuple] = {}  # manual mode without a backend: key -> units
        self.clock: float = 0
        self._clock_fn = config.clock if config.clock is not None else time.monotonic
        self.threshold = max(config.prefetch_threshold, self.page_size)
        capacity = config.prefetch_capacity
        if capacity is None:
            host_size = _size_of(host.controller.mem_pool_host)
            dev_size = _size_of(cache.token_to_kv_pool_allocator)
            capacity = max(0, (4 * (host_size - dev_size)) // 5)
        self.capacity: int = capacity
        self._lock = threading.RLock()
        self._fresh()
        self.copies: list | None = host.controller.copies  # the host tier's copy log, or None
        self._jobs: queue.Queue | None = None
        self._workers: list[threading.Thread] = []
        if self.threads:
            self._start_workers()
        root = getattr(cache, "root_node", None)
        if isinstance(root, Node):  # else (not built yet) the cache's reset marks its root
            root.page_keys = RootKeys(self)

    def _fresh(self) -> None:
        self.backups: list[Backup] = []        # pending (not yet written), submission order
        self.prefetches: list[Prefetch] = []   # the environment's
        self.ongoing: dict[str, Prefetch] = {}  # rid -> the cache's
        self.ongoing_backup: dict[int, Backup] = {}
        self.revoke_queue: list[str] = []
        self.ack_backup_queue: list[Backup] = []
        self.release_queue: list[torch.Tensor] = []
        self.loaded_tokens: dict[str, int] = {}
        self.occupied = 0
        self.next_serial = 1
        self.fragments: dict[int, list] = {}  # write ack id -> its fragments, top-down

    # -- the clock ---------------------------------------------------------------------------
    def now(self) -> float:
        return self._clock_fn() if self.threads else self.clock

    # -- page keys ---------------------------------------------------------------------------
    def keys_of(self, node: Any) -> tuple[str, ...]:
        """``node``'s page keys (computed once, from the nearest ancestor that has them)."""
        keys = getattr(node, "page_keys", None)
        if keys is not None:
            return keys
        root = self.cache.root_node
        chain = []
        cur = node
        while cur is not root and getattr(cur, "page_keys", None) is None:
            chain.append(cur)
            cur = cur.parent
        for n in reversed(chain):
            n.page_keys = chain_keys(n.key, self.page_size, self.prior_of(n.parent, n.extra_key))
        return node.page_keys

    def prior_of(self, parent: Any, extra_key: Any) -> str | None:
        """The key a child of ``parent`` chains from (under the root: the namespace)."""
        if parent is self.cache.root_node:
            return namespace_prior(extra_key, self.config.key_mode)
        keys = self.keys_of(parent)
        return keys[-1] if keys else namespace_prior(extra_key, self.config.key_mode)

    # -- hooks from the host tier ------------------------------------------------------------
    def split(self, upper: Any, child: Any, k: int) -> None:
        """The key list is cut; a pending write of ``child`` now covers both parts."""
        keys = getattr(child, "page_keys", None)
        if keys is not None:
            cut = k // self.page_size
            upper.page_keys, child.page_keys = keys[:cut], keys[cut:]
        for ack_id, entry in self.host.ongoing_write_through.items():
            frags = self.fragments.get(ack_id, [entry.node])
            if any(f is child for f in frags):
                out: list = []
                for f in frags:
                    out.extend([upper, child] if f is child else [f])
                self.fragments[ack_id] = out

    def after_write_ack(self, ack_id: int, node: Any) -> None:
        """A processed host write backs its node (every fragment, if split) up to storage."""
        for n in self.fragments.pop(ack_id, [node]):
            self.write_backup_storage(n)

    def check_events(self) -> None:
        self.drain()

    def reset(self) -> None:
        """Flush: forget prefetches and backups in flight (the host pool is cleared with the host
        tier); the store and the clock stay.  Threads finish their current job first."""
        if self.threads:
            self._quiesce()
        with self._lock:
            self._fresh()
        self.cache.root_node.page_keys = RootKeys(self)  # the cache's new root

    # -- backup --------------------------------------------------------------------------------
    def write_backup_storage(self, node: Any) -> None:
        if node.host_value is None or node.parent is None or self.cache.disable or self.closed:
            return
        cache = self.cache
        cache.inc_host_lock_ref(node)
        b = Backup(self.next_serial, node, self.keys_of(node), tuple(node.key),
                   node.host_value.clone())
        self.next_serial += 1
        with self._lock:
            self.backups.append(b)
            self.ongoing_backup[b.serial] = b
        if self.threads:
            assert self._jobs is not None
            self._jobs.put(("backup", b))

    # -- prefetch --------------------------------------------------------------------------------
    def prefetch_from_storage(self, rid: str, anchor: Any, tokens: Sequence[int],
                              extra_key: Any = None) -> int:
        """Start prefetching ``tokens`` (what follows ``anchor``'s path) for request ``rid``;
        returns the tokens requested (0: nothing started).  As spec/storage.py says."""
        cache = self.cache
        if not isinstance(rid, str):
            raise InvalidInput(f"prefetch: rid must be a string, got {rid!r}")
        if rid in self.ongoing:
            raise InvalidInput(f"prefetch: request {rid!r} already has a prefetch in flight")
        toks = as_token_array(tokens)
        if cache.disable or self.closed or (
                anchor is not cache.root_node and anchor.host_value is None):
            return 0
        ps = self.page_size
        units = cache._units(RadixKey(toks, None, is_bigram=cache.is_eagle))
        units = units[: len(units) - len(units) % ps]
        if anchor is not cache.root_node:
            extra_key = anchor.extra_key
        if len(units) < self.config.prefetch_threshold or self.occupied >= self.capacity:
            return 0
        locked = anchor.host_value is not None
        cache.inc_host_lock_ref(anchor)
        pool = self.host.controller.mem_pool_host
        n = len(units)
        if pool.available_size() < n:
            self.host.evict_host(n)
        if pool.available_size() < n:
            avail = pool.available_size()
            n = avail - avail % ps
            if n < self.config.prefetch_threshold:
                if locked:
                    cache.dec_host_lock_ref(anchor)
                return 0
            units = units[:n]
        slots = pool.alloc(n)
        assert slots is not None  # n is free
        op = Prefetch(self.next_serial, rid, anchor, locked, units, extra_key, slots,
                      self.prior_of(anchor, extra_key), self.now())
        self.next_serial += 1
        with self._lock:
            self.prefetches.append(op)
            self.ongoing[rid] = op
            self.occupied += n
        if self.threads:
            assert self._jobs is not None
            self._jobs.put(("prefetch", op))
        return n

    def _completed_all(self, op: Prefetch) -> bool:
        return len(op.keys) > 0 and op.completed == len(op.keys) * self.page_size

    def _timed_out(self, op: Prefetch) -> bool:
        c = self.config
        return self.now() - op.start > c.prefetch_timeout_base + len(op.keys) * c.prefetch_timeout_per_page

    def can_terminate_prefetch(self, op: Prefetch) -> bool:
        policy = self.config.prefetch_stop_policy
        if policy == "best_effort":
            return True
        done = self._completed_all(op)
        can = done if policy == "wait_complete" else (done or self._timed_out(op))
        cannot, terminated = _reduce(self.config.tp_group, [int(not can), int(op.terminated)], "max")
        return cannot == 0 or terminated == 1

    def check_prefetch_progress(self, rid: str) -> bool:
        """True when ``rid`` has no prefetch in flight (any more); a prefetch the stop policy
        lets end is terminated and the pages read so far go into the tree below its anchor as
        host-only nodes (pages the tree holds already are freed)."""
        with self._lock:
            op = self.ongoing.get(rid)
            if op is None:
                return True
            if not self.can_terminate_prefetch(op):
                return False
            op.terminated = True
            read = op.completed
        done = _reduce(self.config.tp_group, [read], "min")[0]  # what every rank has read
        ps = self.page_size
        prefix_len, inserted = self._insert_host(op.anchor, op.extra_key, op.units[:done],
                                                 op.slots[:done], op.keys[: done // ps])
        back = []  # freed in this order, in one batch (fast/frees.py)
        if prefix_len:
            back.append(op.slots[:prefix_len])
        if prefix_len + inserted < done:  # pages no node may take (spec: may_take_host_child)
            back.append(op.slots[prefix_len + inserted:done])
        release(self.host.controller.mem_pool_host, back)
        with self._lock:
            self._release(op.slots[done:read])  # read here, not on every rank
            op.taken = read
            if op.anchor_locked:
                self.cache.dec_host_lock_ref(op.anchor)
            del self.ongoing[rid]
            self.occupied -= len(op.units)
            self.loaded_tokens[rid] = inserted
            self._forget_if_finished(op)
        if self.metrics is not None:
            self.metrics.prefetched(done - prefix_len)
        return True

    def _insert_host(self, node: Any, extra_key: Any, units: Any, slots: torch.Tensor,
                     keys: tuple[str, ...]) -> tuple[int, int]:
        """Insert host-only pages below ``node``; returns the length the tree already had and
        the length inserted.  Under write-through the rest goes in only below the root or a
        backed-up node (spec/storage.py ``may_take_host_child``)."""
        cache = self.cache
        cache._stamp(node)
        matched = 0
        n = len(units)
        pos = 0
        while pos < n:
            child = node.children.get(cache._ck(extra_key, units, pos))
            if child is None:
                break
            cache._stamp(child)
            shared = cache._shared(child.key, units, pos, n)
            pos += shared
            matched += shared
            if shared < len(child.key):
                child = cache._split(child, shared)
            node = child
        if pos < n and not (self.host.write_back or node is cache.root_node
                            or node.host_value is not None):
            return matched, 0
        if pos < n:
            ps = self.page_size
            cache._clock += STRIDE
            rest = units[pos:]
            ck = cache._ck(extra_key, rest, 0)
            leaf = cache._new_node(rest, None, node, extra_key, cache._clock, ck)
            leaf.host_value = slots[pos:].clone()
            leaf.page_keys = tuple(keys[pos // ps:])
            node.children[ck] = leaf
            self.host.host_tokens += n - pos
            self.host.update_host_leaf(leaf)
            self.host.update_host_leaf(node)
            if cache._events is not None:  # cached on the host at once (fast/events.py)
                cache._events.host_stored(leaf)
        return matched, n - pos

    def terminate_prefetch(self, rid: str) -> None:
        with self._lock:
            op = self.ongoing.get(rid)
            if op is not None:
                op.terminated = True

    def pop_prefetch_loaded_tokens(self, rid: str) -> int:
        with self._lock:
            return self.loaded_tokens.pop(rid, 0)

    def release_aborted_request(self, rid: str) -> None:
        """An aborted request's prefetch is dropped: the anchor is unlocked, the slots read so
        far are released (the transfer releases the rest when it ends)."""
        with self._lock:
            self.loaded_tokens.pop(rid, None)
            if rid not in self.ongoing:
                return
            self.ongoing[rid].terminated = True
        if self.config.tp_group is not None:  # every rank stops this prefetch before it goes
            import torch.distributed as dist
            dist.barrier(group=self.config.tp_group)
        with self._lock:
            op = self.ongoing.pop(rid)
            op.terminated = True
            done = op.completed
            if op.anchor_locked:
                self.cache.dec_host_lock_ref(op.anchor)
            self._release(op.slots[:done])
            op.taken = done
            self.occupied -= len(op.units)
            self._forget_if_finished(op)

    def _release(self, slots: torch.Tensor) -> None:
        ps = self.page_size
        for k in range(0, len(slots), ps):
            self.release_queue.append(slots[k: k + ps])

    def _forget_if_finished(self, op: Prefetch) -> None:
        if op.transfer_done and op.rid not in self.ongoing and any(p is op for p in self.prefetches):
            self.prefetches.remove(op)

    # -- the control queues --------------------------------------------------------------------
    def drain(self) -> None:
        """Revoked prefetches leave (anchor unlocked), acked backups release their host locks,
        released host slots go back to the host pool."""
        cache = self.cache
        with self._lock:
            sizes = [len(self.revoke_queue), len(self.ack_backup_queue), len(self.release_queue)]
        n_revoke, n_ack, n_release = _reduce(self.config.tp_group, sizes, "min")
        with self._lock:
            for _ in range(n_revoke):
                rid = self.revoke_queue.pop(0)
                op = self.ongoing.pop(rid, None)
                if op is None:
                    continue
                if op.anchor_locked:
                    cache.dec_host_lock_ref(op.anchor)
                self.occupied = max(0, self.occupied - len(op.units))
                self._forget_if_finished(op)
            acked = self.ack_backup_queue[:n_ack]
            del self.ack_backup_queue[:n_ack]
            for b in acked:
                if self.ongoing_backup.pop(b.serial, None) is not None:
                    cache.dec_host_lock_ref(b.node)
            pages = self.release_queue[:n_release]
            del self.release_queue[:n_release]
        if self.metrics is not None:
            for b in acked:
                self.metrics.backuped(b.written)
        if pages:
            release(self.host.controller.mem_pool_host, pages)  # in order, one batch

    # -- the environment (manual mode: the trace's steps) --------------------------------------
    def _check_manual(self, what: str) -> None:
        if self.threads:
            raise Unsupported(f"{what}: the storage threads run the I/O (io='threads')")
        if self.closed:
            raise InvalidInput(f"{what}: the storage tier is closed")

    def run_backups(self, count: int) -> int:
        """Write the ``count`` oldest pending backups (-1: all) and ack them."""
        _count("storage_backup: count", count)
        self._check_manual("storage_backup")
        done = 0
        while self.backups and count != 0:
            b = self.backups.pop(0)
            self._write(b)
            done += 1
            count -= 1
        return done

    def _write(self, b: Backup) -> None:
        ps = self.page_size
        written = 0
        if self.backend is None:
            for i, key in enumerate(b.keys):
                self.store[key] = tuple(b.units[i * ps: (i + 1) * ps])
            written = len(b.units)
        else:
            for lo in range(0, len(b.keys), BATCH_PAGES):
                keys = list(b.keys[lo: lo + BATCH_PAGES])
                t0 = time.perf_counter()
                try:
                    ok = self.backend.batch_set_v1(keys, b.host_indices[lo * ps: (lo + len(keys)) * ps])
                except Exception:  # noqa: BLE001 (a failed backup leaves pages unstored)
                    break
                if self.metrics is not None:
                    self.metrics.batch(True, len(keys), time.perf_counter() - t0)
                written += ps * (len(keys) if ok is True else sum(1 for x in ok or () if x is True))
        if self.copies is not None:
            self.copies.append(("store", b.host_indices.tolist(), list(b.keys)))
        with self._lock:
            b.done = True
            b.written = written
            self.ack_backup_queue.append(b)

    def run_queries(self, count: int) -> int:
        """Run the hit query of the ``count`` oldest prefetches not yet queried (-1: all)."""
        _count("storage_query: count", count)
        self._check_manual("storage_query")
        ran = 0
        for op in list(self.prefetches):
            if count == 0:
                break
            if op.queried:
                continue
            self._hit_query(op)
            ran += 1
            count -= 1
        return ran

    def _stored_run(self, keys: Sequence[str]) -> int:
        if self.backend is None:
            hit = 0
            while hit < len(keys) and keys[hit] in self.store:
                hit += 1
            return hit
        hit = 0
        for lo in range(0, len(keys), BATCH_PAGES):
            batch = list(keys[lo: lo + BATCH_PAGES])
            try:
                k = int(self.backend.batch_exists(batch))
            except Exception:  # noqa: BLE001 (an unreachable store: a miss from here)
                k = 0
            hit += max(0, min(k, len(batch)))
            if k < len(batch):
                break
        return hit

    def _hit_query(self, op: Prefetch) -> None:
        ps = self.page_size
        keys = chain_keys(op.units, ps, op.last_key)
        hit = _reduce(self.config.tp_io_group, [self._stored_run(keys)], "min")[0]
        with self._lock:
            op.queried = True
            if hit * ps < self.threshold:
                self.revoke_queue.append(op.rid)
                self._release(op.slots)
                op.released_from = 0
                op.transfer_done = True
                self.prefetches.remove(op)
                return
            op.keys = keys[:hit]
            self._release(op.slots[hit * ps:])
            op.released_from = hit * ps

    def run_load(self, rid: str, pages: int) -> int:
        """Read the next ``pages`` pages (-1: all) of ``rid``'s oldest prefetch in flight."""
        _count("storage_load: pages", pages)
        self._check_manual("storage_load")
        op = next((p for p in self.prefetches
                   if p.rid == rid and p.queried and not p.transfer_done), None)
        if op is None:
            return 0
        ps = self.page_size
        read = 0
        while pages != 0 and not op.terminated and op.completed < len(op.keys) * ps:
            got = self._read(op, 1)
            if got == 0:
                op.terminated = True
                break
            read += 1
            pages -= 1
        if op.terminated or op.completed == len(op.keys) * ps:
            self._end_transfer(op)
        return read

    def _read(self, op: Prefetch, pages: int) -> int:
        """Read up to ``pages`` next pages of ``op`` into its slots; returns the pages read
        (a miss or a failure stops there)."""
        ps = self.page_size
        first = op.completed // ps
        keys = list(op.keys[first: first + pages])
        slots = op.slots[first * ps: (first + len(keys)) * ps]
        if self.backend is None:
            n = 0
            while n < len(keys) and keys[n] in self.store:
                n += 1
        else:
            t0 = time.perf_counter()
            try:
                ok = list(self.backend.batch_get_v1(keys, slots))
            except Exception:  # noqa: BLE001 (a failed read: a miss from here)
                ok = []
            else:
                if self.metrics is not None:
                    self.metrics.batch(False, len(keys), time.perf_counter() - t0)
            n = 0
            while n < len(keys) and n < len(ok) and ok[n] is True:
                n += 1
        if n and self.copies is not None:
            self.copies.append(("fetch", keys[:n], slots[: n * ps].tolist()))
        with self._lock:
            if op.terminated:  # terminated meanwhile: what was read is not handed over
                return 0
            op.completed += n * ps
        return n

    def _end_transfer(self, op: Prefetch) -> None:
        with self._lock:
            self._release(op.slots[op.completed: op.released_from])
            op.released_from = op.completed
            op.transfer_done = True
            self._forget_if_finished(op)

    def tick(self, ticks: int) -> None:
        if isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 0:
            raise InvalidInput(f"storage_tick: ticks must be an int >= 0, got {ticks!r}")
        self._check_manual("storage_tick")
        self.clock += ticks

    def clear(self) -> bool:
        """Clear the store (operations in flight carry on; a page read after this is a miss)."""
        if self.backend is None:
            self.store.clear()
            return True
        self.backend.clear()
        return True

    # -- threads (production) --------------------------------------------------------------------
    def _start_workers(self) -> None:
        self._jobs = queue.Queue()
        self._stopping = False
        t = threading.Thread(target=self._worker, name="uniradix-storage", daemon=True)
        t.start()
        self._workers.append(t)

    def _worker(self) -> None:
        assert self._jobs is not None
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                kind, item = job
                try:
                    if kind == "backup":
                        with self._lock:
                            pending = any(b is item for b in self.backups)
                            if pending:
                                self.backups.remove(item)
                        if pending:
                            self._write(item)
                    else:
                        self._run_prefetch(item)
                except Exception:  # noqa: BLE001 (a job that fails ends as a miss; the thread lives on)
                    self._failed(kind, item)
            finally:
                self._jobs.task_done()

    def _failed(self, kind: str, item: Any) -> None:
        """A job raised: a backup is acked unwritten; a prefetch not yet queried is revoked, one
        loading ends where it is."""
        with self._lock:
            if kind == "backup":
                if not item.done:
                    item.done = True
                    self.ack_backup_queue.append(item)
                return
            op = item
            if op.transfer_done or not any(p is op for p in self.prefetches):
                return
            if not op.queried:
                op.queried = True
                self.revoke_queue.append(op.rid)
                self._release(op.slots[op.taken:])
                op.released_from = op.taken
                op.transfer_done = True
                self.prefetches.remove(op)
                return
            op.terminated = True
        self._end_transfer(op)

    def _run_prefetch(self, op: Prefetch) -> None:
        with self._lock:
            if not any(p is op for p in self.prefetches):
                return  # forgotten (reset)
        self._hit_query(op)
        if op.transfer_done:
            return
        ps = self.page_size
        while not op.terminated and op.completed < len(op.keys) * ps:
            want = min(BATCH_PAGES, len(op.keys) - op.completed // ps)
            got = self._read(op, want)
            if got < want:
                with self._lock:
                    op.terminated = True
                break
        self._end_transfer(op)

    def _quiesce(self) -> None:
        if self._jobs is not None:
            self._jobs.join()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Threads: wait until every queued backup and prefetch has run (True), or ``timeout``
        seconds passed (False).  Manual mode: True."""
        if self._jobs is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._jobs.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self, barrier_timeout_s: float = 300.0) -> None:
        """Release what the tier holds; a second call does nothing.

        The storage thread stops after its queued jobs.  Then what uniradix created for this
        tier, and only that, is released: an I/O gloo group derived from the cache's
        ``tp_cache_group`` (:func:`with_derived_groups`) is destroyed after a barrier over it,
        so no rank tears it down while another still uses it (so with a derived group close
        is collective: every rank closes its cache, as every rank built one; a rank that has
        not arrived within ``barrier_timeout_s`` seconds raises, the group destroyed all the
        same), and a backend built from SGLang's server arguments
        (:func:`storage_config_from_server_args`) is closed (Mooncake unregisters the host
        pool and closes its client).  Groups and backends given in the config are the
        caller's and stay open.  A closed tier starts no backup and no prefetch (as upstream
        with its backend detached), and refuses the manual I/O steps."""
        if self.closed:
            return
        self.closed = True
        if self._jobs is not None and self._workers:
            self._jobs.put(None)
            for t in self._workers:
                t.join()
            self._workers.clear()
        self._release_owned(barrier=True, timeout_s=barrier_timeout_s)

    def _release_owned(self, barrier: bool, timeout_s: float = 300.0) -> None:
        group, backend = self._own_io_group, self._own_backend
        self._own_io_group = self._own_backend = None
        try:
            if group is not None:
                import torch.distributed as dist
                try:
                    if barrier:
                        dist.monitored_barrier(group=group,
                                               timeout=datetime.timedelta(seconds=timeout_s))
                finally:
                    dist.destroy_process_group(group)
        finally:
            if backend is not None:
                backend.close()

    # -- checks ----------------------------------------------------------------------------------
    def held_host_slots(self) -> list[int]:
        """Host slots the tier holds outside the tree."""
        with self._lock:
            out = [s for page in self.release_queue for s in page.tolist()]
            seen: set = set()
            for op in list(self.ongoing.values()) + self.prefetches:
                if id(op) in seen:
                    continue
                seen.add(id(op))
                end = len(op.slots) if op.released_from is None else op.released_from
                out.extend(op.slots[op.taken: end].tolist())
        return out

    def violations(self, errors: list) -> None:
        cache = self.cache
        ps = self.page_size
        tree: set = set()
        for node in cache.all_nodes():
            if node is cache.root_node:
                continue
            if node.host_value is not None:
                tree.update(node.host_value.tolist())
            keys = getattr(node, "page_keys", None)
            if keys is not None and len(keys) != -(-len(node.key) // ps):
                errors.append(f"[storage-keys] {node!r}: {len(keys)} page keys")
        with self._lock:
            occupied = sum(len(op.units) for op in self.ongoing.values())
            if occupied != self.occupied:
                errors.append(f"[storage] prefetch tokens occupied {self.occupied}, in flight {occupied}")
            for serial, b in self.ongoing_backup.items():
                if b.node.host_lock_ref <= 0:
                    errors.append(f"[storage] backup {serial} of {b.node!r} holds no host lock")
            for rid, op in self.ongoing.items():
                if op.anchor is not cache.root_node and op.anchor.parent is None:
                    errors.append(f"[storage] prefetch of {rid!r}: its anchor is not in the tree")
        held = self.held_host_slots()
        if len(set(held)) != len(held):
            errors.append("[storage] host slots held twice by prefetches / the release queue")
        both = sorted(set(held) & tree)
        if both:
            errors.append(f"[storage] host slots held by both the tree and a prefetch: {both[:8]}")


def _size_of(allocator: Any) -> int:
    """A pool's size in tokens: its ``size``, else its pages times the page size (the pool
    behind the conformance environment's allocator too), else what it has free now."""
    size = getattr(allocator, "size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    for obj in (allocator, getattr(allocator, "pool", None)):
        pages = getattr(obj, "num_pages", None)
        if obj is not None and isinstance(pages, int):
            return pages * int(obj.page_size)
    return int(allocator.available_size())


# ----------------------------------------------------------------------------------------------
# From SGLang's server arguments (``UnifiedRadixCache.init_hicache``)
# ----------------------------------------------------------------------------------------------

# extra-config keys read here (upstream's names); any other key is refused by name
_TIER_KEYS = ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token")
_FILE_KEYS = ("file_path", "capacity_bytes", "fsync")
_MOONCAKE_KEYS = ("master_server_address", "local_hostname", "protocol", "device_name",
                  "metadata_server", "global_segment_size", "local_buffer_size", "namespace")


def parse_extra_config(raw: Any) -> dict:
    """``hicache_storage_backend_extra_config``: a JSON object, or ``@file.json``."""
    import json
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    if not isinstance(raw, str):
        raise InvalidInput(f"hicache_storage_backend_extra_config must be JSON text, got {raw!r}")
    try:
        if raw.startswith("@"):
            with open(raw[1:], encoding="utf-8") as f:
                out = json.load(f)
        else:
            out = json.loads(raw)
    except (OSError, ValueError) as e:
        raise InvalidInput(f"hicache_storage_backend_extra_config: {e}") from None
    if not isinstance(out, dict):
        raise InvalidInput("hicache_storage_backend_extra_config must be a JSON object")
    return out


def storage_config_from_server_args(server_args: Any, page_size: int, host_kv: Any) -> StorageConfig:
    """The storage tier SGLang's ``server_args`` ask for: ``hicache_storage_backend`` ``file``
    (uniradix's FileStore; ``file_path`` in the extra config, else
    ``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR``, else a ``uniradix-hicache`` folder in the
    temporary directory) or ``mooncake`` (MooncakeStore; its settings in the extra config);
    ``hicache_storage_prefetch_policy``; from the extra config ``prefetch_threshold``,
    ``prefetch_timeout_base`` (seconds) and ``prefetch_timeout_per_ki_token`` (seconds per
    1024 tokens).  Refused by name: another backend, an unknown extra-config key, and no
    host KV pool to move pages through (``params.hicache.host_kv``)."""
    import os
    import tempfile
    name = server_args.hicache_storage_backend
    extra = parse_extra_config(getattr(server_args, "hicache_storage_backend_extra_config", None))
    own = {"file": _FILE_KEYS, "mooncake": _MOONCAKE_KEYS}.get(name)
    if own is None:
        raise Unsupported(f"hicache_storage_backend={name!r}: uniradix runs 'file' and 'mooncake' "
                          "(SGLang can load uniradix's backends: docs/STORAGE.md)")
    unknown = sorted(set(extra) - set(_TIER_KEYS) - set(own))
    if unknown:
        raise Unsupported(f"hicache_storage_backend_extra_config: {unknown} not supported for {name!r}")
    if host_kv is None:
        raise Unsupported("hicache_storage_backend: the storage tier moves pages through the host "
                          "KV pool; set params.hicache = HiCacheConfig(device_kv=..., host_kv=...)")
    settings = {k: extra[k] for k in own if k in extra}
    backend: Any
    if name == "file":
        from ..storage import FileStore
        directory = settings.pop("file_path", None) or os.environ.get(
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or os.path.join(tempfile.gettempdir(),
                                                                       "uniradix-hicache")
        os.makedirs(directory, exist_ok=True)
        backend = FileStore(directory, **settings)
    else:
        from ..storage import MooncakeStore
        if "master_server_address" not in settings:
            raise InvalidInput("hicache_storage_backend='mooncake' needs master_server_address "
                               "in hicache_storage_backend_extra_config")
        backend = MooncakeStore(settings.pop("master_server_address"), **settings)
    try:
        backend.register_mem_pool_host(host_kv)
        per_ki = extra.get("prefetch_timeout_per_ki_token", 0)
        config = StorageConfig(
            backend=backend, io="threads",
            prefetch_threshold=extra.get("prefetch_threshold", 256),
            prefetch_stop_policy=getattr(server_args, "hicache_storage_prefetch_policy", "timeout"),
            prefetch_timeout_base=extra.get("prefetch_timeout_base", 1),
            prefetch_timeout_per_page=per_ki * page_size / 1024 if per_ki else 0)
        config.validate()
    except BaseException:
        backend.close()  # (refused: nobody else holds it)
        raise
    _mark_created(backend)  # the tier built from this config closes it
    return config
