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

    def __init__(self, params: Any, hicache: HiCacheConfig | None = None) -> None:
        super().__init__(params, hicache)
        if self.tier is None:
            raise Unsupported("HiCacheRadixCache needs a host tier: params.hicache or the "
                              "hicache argument")
