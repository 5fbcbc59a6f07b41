"""uniradix.fast: the production radix prefix cache, with upstream SGLang's public API.

    from uniradix.fast import UnifiedRadixCache, CacheInitParams, RadixKey, MatchPrefixParams
"""

from .cache import TreeNode, UnifiedRadixCache
from .errors import CacheError, HandleError, InvalidInput, NodeNotFound, Unsupported
from .hicache import HiCacheConfig, HiCacheRadixCache, InitLoadBackParams
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

__all__ = [
    "UnifiedRadixCache", "TreeNode", "RadixKey", "CacheInitParams", "MatchPrefixParams",
    "MatchResult", "InsertParams", "InsertResult", "EvictParams", "EvictResult",
    "IncLockRefResult", "DecLockRefParams", "DecLockRefResult", "CacheError", "InvalidInput",
    "NodeNotFound", "HandleError", "Unsupported", "HiCacheConfig", "HiCacheRadixCache",
    "InitLoadBackParams",
]
