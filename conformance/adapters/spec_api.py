"""The executable spec behind upstream SGLang's tree-level cache API, for the benchmark harness.

:class:`UnifiedRadixCache` here is a thin wrapper over the rule functions of
:mod:`uniradix.spec.cache` (and the queries of :mod:`uniradix.spec.queries`) with the method names,
parameter objects and result objects of upstream's ``UnifiedRadixCache``, so that
:mod:`uniradix.conformance.bench.loop` drives the spec, ``uniradix.fast`` and upstream with the very
same code and the fast/spec ratio is measured in one harness.

At the boundary values are int64 torch tensors when torch imports, and ``array('q')`` otherwise
(the project's own venv need not have torch; the harness uses the same choice for its allocator).
Keys are :class:`RadixKey` objects holding ``array('q')`` token ids, as upstream's are. The
wrapper converts both to the plain lists the spec takes, and converts the spec's slot tuples back;
that conversion is part of what the benchmark times for the spec.

The KV pool is the environment's :class:`~uniradix.spec.world.PagedPool`: the allocator passed as
``CacheInitParams.token_to_kv_pool_allocator`` must expose it as ``.pool`` (as the harness's
allocators do), and the spec frees into it directly.
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any, NamedTuple

from uniradix.spec import cache as rules
from uniradix.spec import queries
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import HandleError, InvalidInput
from uniradix.spec.state import CacheState, LockHandle, Node, new_root

# --------------------------------------------------------------------------------------------
# Values at the boundary
# --------------------------------------------------------------------------------------------


class TorchValues:
    """int64 CPU tensors."""

    name = "torch"

    def __init__(self, torch_module: Any) -> None:
        self.torch = torch_module
        self._empty = torch_module.empty((0,), dtype=torch_module.int64)

    def from_list(self, xs) -> Any:
        if not xs:
            return self._empty
        return self.torch.tensor(xs, dtype=self.torch.int64)

    def cat(self, a: Any, b: Any) -> Any:
        if len(a) == 0:
            return b
        if len(b) == 0:
            return a
        return self.torch.cat((a, b))


class ArrayValues:
    """``array('q')``: the stand-in when torch is not installed."""

    name = "array"

    def from_list(self, xs) -> array:
        return array("q", xs)

    def cat(self, a: array, b: array) -> array:
        return a + b


def default_values() -> TorchValues | ArrayValues:
    """Torch tensors where torch imports, ``array('q')`` otherwise."""
    try:
        import torch
    except (ImportError, OSError):  # absent, or a broken install
        return ArrayValues()
    return TorchValues(torch)


# --------------------------------------------------------------------------------------------
# Upstream-shaped keys, parameters and results
# --------------------------------------------------------------------------------------------


class RadixKey:
    """Token ids (``array('q')``) and an optional namespace, as upstream's RadixKey."""

    __slots__ = ("token_ids", "extra_key", "is_bigram")

    def __init__(self, token_ids, extra_key: str | None = None, is_bigram: bool = False) -> None:
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.is_bigram = is_bigram

    def __len__(self) -> int:
        n = len(self.token_ids)
        return max(0, n - 1) if self.is_bigram else n


@dataclasses.dataclass
class MatchPrefixParams:
    key: RadixKey


@dataclasses.dataclass
class InsertParams:
    key: RadixKey | None = None
    value: Any = None
    prev_prefix_len: int = 0
    chunked: bool = False
    priority: int = 0


@dataclasses.dataclass
class EvictParams:
    num_tokens: int = 0


class MatchResult(NamedTuple):
    device_indices: Any
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0


@dataclasses.dataclass
class InsertResult:
    prefix_len: int
    total_len: int = 0


@dataclasses.dataclass
class EvictResult:
    num_tokens_evicted: int = 0


@dataclasses.dataclass
class DecLockRefParams:
    handle: LockHandle | None = None


@dataclasses.dataclass
class IncLockRefResult:
    handle: LockHandle | None = None

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(handle=self.handle)


@dataclasses.dataclass
class DecLockRefResult:
    pass


@dataclasses.dataclass
class CacheInitParams:
    disable: bool
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int
    is_eagle: bool = False


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------


class UnifiedRadixCache:
    """The spec's device tier (Full component) with upstream's tree-level API."""

    def __init__(self, params: CacheInitParams, values: TorchValues | ArrayValues | None = None
                 ) -> None:
        allocator = params.token_to_kv_pool_allocator
        pool = getattr(allocator, "pool", None)
        if pool is None:
            raise InvalidInput("the spec needs an allocator over a PagedPool, exposed as .pool")
        if pool.page_size != params.page_size:
            raise InvalidInput(f"pool page size {pool.page_size} != page_size {params.page_size}")
        self.page_size = params.page_size
        self.disable = params.disable
        self.token_to_kv_pool_allocator = allocator
        self.values = values if values is not None else default_values()
        config = CacheConfig(page_size=params.page_size, kv_slots=pool.num_pages * pool.page_size,
                             eagle=params.is_eagle, disable=params.disable)
        self.state = CacheState(config=config, kv=pool, root=new_root())
        self._open: dict[int, list[LockHandle]] = {}  # id(node) -> handles, for dec without params

    @property
    def root_node(self) -> Node:
        return self.state.root

    # -- the API -------------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        m = rules.match_prefix(self.state, list(key.token_ids), key.extra_key)
        return MatchResult(self.values.from_list(m.device_indices), m.last_device_node,
                           m.last_host_node, m.best_match_node, m.host_hit_length)

    def insert(self, params: InsertParams) -> InsertResult:
        key = params.key
        if key is None or params.value is None:
            raise InvalidInput("insert needs a key and a value")
        tokens = list(key.token_ids)
        value = params.value.tolist()
        r = rules.insert(self.state, tokens, key.extra_key, value,
                         prev_prefix_len=params.prev_prefix_len, chunked=params.chunked)
        return InsertResult(prefix_len=r.prefix_len, total_len=len(tokens))

    def evict(self, params: EvictParams) -> EvictResult:
        return EvictResult(num_tokens_evicted=rules.evict(self.state, params.num_tokens))

    def inc_lock_ref(self, node: Node) -> IncLockRefResult:
        handle = rules.inc_lock_ref(self.state, node)
        self._open.setdefault(id(node), []).append(handle)
        return IncLockRefResult(handle=handle)

    def dec_lock_ref(self, node: Node, params: DecLockRefParams | None = None
                     ) -> DecLockRefResult:
        """Release a lock on ``node``: the one ``params`` names, else the latest one taken."""
        held = self._open.get(id(node))
        if not held:
            raise HandleError("dec_lock_ref: no lock is held on this node")
        handle = params.handle if params is not None and params.handle is not None else held[-1]
        rules.dec_lock_ref(self.state, handle)
        held.remove(handle)
        if not held:
            del self._open[id(node)]
        return DecLockRefResult()

    def evictable_size(self) -> int:
        return queries.evictable_size(self.state)

    def protected_size(self) -> int:
        return queries.protected_size(self.state)

    def full_evictable_size(self) -> int:
        return self.evictable_size()

    def full_protected_size(self) -> int:
        return self.protected_size()

    def total_size(self) -> int:
        return queries.total_size(self.state)

    def reset(self) -> None:
        rules.reset(self.state)
        self._open.clear()
