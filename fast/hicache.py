"""HiCache for the fast path: ``HiCacheRadixCache``, the composed cache (fast/hybrid.py) with
its host tier plug-in (fast/tiers/host.py), under upstream SGLang's class name.

``uniradix.fast.UnifiedRadixCache(params)`` builds one when ``params.hicache`` is a
:class:`HiCacheConfig`, for the Full component alone or with aux components the host tier can
carry; ``UnifiedRadixCache.init_hicache`` turns a cache into one.  This module keeps the names
callers import from it: the configuration, the controller, the in-flight records and the lock
results live in fast/tiers/host.py.
"""

from __future__ import annotations

from typing import Any

from .errors import Unsupported
from .hybrid import HybridRadixCache
from .node import Node
from .tiers.host import (
    IO_MODES,
    WRITE_POLICIES,
    Ack,
    Copy,
    HiCacheConfig,
    HiCacheController,
    HostDecLockRefParams,
    HostIncLockRefResult,
    HostSlotAllocator,
    HostTier,
    InFlight,
    InitLoadBackParams,
    PendingLoad,
    hicache_config_from_server_args,
)

__all__ = ["IO_MODES", "WRITE_POLICIES", "Ack", "Copy", "HiCacheConfig", "HiCacheController",
           "HiCacheRadixCache", "HostDecLockRefParams", "HostIncLockRefResult", "HostNode",
           "HostSlotAllocator", "HostTier", "InFlight", "InitLoadBackParams", "PendingLoad",
           "hicache_config_from_server_args"]

HostNode = Node  # the one pure-Python node type (fast/node.py): its host fields


class HiCacheRadixCache(HybridRadixCache):
    """The composed cache with a host tier (``tier``, a :class:`HostTier`); no behaviour of
    its own (every method is the composed tree's, calling the tier's hooks)."""

    core_reason = "a host tier: the C core covers the device-only Full path"
    # SGLang's scheduler reads this before handing prefix keys to prefetch_from_storage; the
    # storage tier chains its own keys from the node (Node.get_last_hash_value gives the last)
    hicache_storage_pass_prefix_keys = False

    def __init__(self, params: Any, hicache: HiCacheConfig | None = None) -> None:
        super().__init__(params, hicache)
        if self.tier is None:
            raise Unsupported("HiCacheRadixCache needs a host tier: params.hicache or the "
                              "hicache argument")

    def check_hicache_events(self) -> None:
        """``HybridRadixCache.check_hicache_events`` with the tier known to be there: the
        finished writes, then the finished loads (each skipped when its ack queue is empty,
        where it would do nothing), then the storage tier's control queues, and the heaps'
        upkeep (an ack's unlock pushes the leaves it frees: without it the leaf heap could be
        left over its cap; tests/corpus/regressions/conform-hicache-wt-p1-s8108-*.jsonl)."""
        tier = self.tier
        assert tier is not None  # (set by __init__)
        controller = tier.controller
        if controller.ack_write_queue:
            tier.writing_check()
        if controller.ack_load_queue:
            tier.loading_check()
        if self.storage_tier is not None:
            self.storage_tier.drain()
        self._upkeep()

    # -- the storage tier (fast/tiers/storage.py), under upstream's method names --------------
    @property
    def enable_storage(self) -> bool:
        return self.storage_tier is not None

    def _storage(self) -> Any:
        if self.storage_tier is None:
            raise Unsupported("this cache has no storage tier (HiCacheConfig.storage)")
        return self.storage_tier

    def prefetch_from_storage(self, req_id: str, last_host_node: Node, new_input_tokens: Any,
                              last_hash: str | None = None, prefix_keys: Any = None) -> int:
        """Prefetch what follows ``last_host_node`` for ``req_id`` (its keys are the tier's own
        chain: ``last_hash`` / ``prefix_keys`` are accepted and not needed)."""
        tier = self._storage()
        started = int(tier.prefetch_from_storage(req_id, last_host_node, new_input_tokens,
                                                 last_host_node.extra_key))
        self._upkeep()
        return started

    # (each storage call that can change the tree, a finished prefetch inserting host nodes or
    # a release unlocking, ends with the heaps' upkeep, as every other public call does)
    def check_prefetch_progress(self, req_id: str) -> bool:
        done = bool(self._storage().check_prefetch_progress(req_id))
        self._upkeep()
        return done

    def terminate_prefetch(self, req_id: str) -> None:
        self._storage().terminate_prefetch(req_id)
        self._upkeep()

    def pop_prefetch_loaded_tokens(self, req_id: str) -> int:
        return int(self._storage().pop_prefetch_loaded_tokens(req_id))

    def release_aborted_request(self, rid: str) -> None:
        if self.storage_tier is not None:
            self.storage_tier.release_aborted_request(rid)
            self._upkeep()

    def clear_storage_backend(self) -> bool:
        return bool(self._storage().clear())
