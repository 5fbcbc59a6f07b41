"""Parameter and result types with upstream SGLang's names and fields, so an engine can swap
``uniradix.fast.UnifiedRadixCache`` in for ``sglang``'s own cache without touching call sites."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch


@dataclasses.dataclass(slots=True)
class CacheInitParams:
    """What the cache is built from.  Only the fields the device tier uses are read; the rest
    are accepted so that an engine's existing params object can be passed as is."""

    disable: bool
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int

    is_eagle: bool = False
    tp_cache_group: Any = None
    attn_cp_cache_group: Any = None
    attn_tp_cache_group: Any = None
    pp_cache_group: Any = None
    eviction_policy: str = "lru"
    disable_finished_insert: bool = False
    enable_metrics: bool = False
    enable_kv_cache_events: bool = False
    enable_mamba_extra_buffer: bool = False
    enable_mamba_extra_buffer_lazy: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    chunked_prefill_size: int | None = None
    sliding_window_size: int | None = None
    cache_ttl_seconds: float | None = None
    tree_components: tuple | None = None
    component_registry_override: dict | None = None
    # uniradix: check slot ownership on insert (see UnifiedRadixCache).  None = check when the
    # allocator can answer (it has ``check_free`` and ``is_allocated``).
    validate_slots: bool | None = None
    # uniradix: the chunk size of Mamba's branching seqlen (upstream reads it from the global
    # server args; None = 64)
    mamba_cache_chunk_size: int | None = None
    # uniradix: a host tier (HiCache): a ``uniradix.fast.hicache.HiCacheConfig``; the cache is
    # then a ``HiCacheRadixCache`` (fast/hicache.py)
    hicache: Any = None
    # uniradix: the block-hash chain of KV events (fast/events.py): "namespaced" (default) or
    # "compat" (0.5.13.post1's hashes, without extra_key)
    kv_events_key_mode: str = "namespaced"
    # uniradix: the prometheus_client CollectorRegistry enable_metrics registers on (None: a
    # new one, the cache's ``metrics.registry``; fast/metrics.py)
    metrics_registry: Any = None


@dataclasses.dataclass(slots=True)
class MatchPrefixParams:
    key: Any
    cow_mamba: bool = False
    req: Any = None


@dataclasses.dataclass(slots=True)
class InsertParams:
    key: Any = None
    value: torch.Tensor | None = None
    mamba_value: torch.Tensor | None = None
    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0


@dataclasses.dataclass(slots=True)
class InsertResult:
    prefix_len: int
    total_len: int = 0
    mamba_exist: bool = False
    inserted_host_node: Any = None


@dataclasses.dataclass(slots=True)
class EvictParams:
    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass(slots=True)
class EvictResult:
    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


@dataclasses.dataclass(slots=True)
class DecLockRefParams:
    swa_uuid_for_lock: int | None = None
    swa_uuid_for_host_lock: int | None = None
    skip_lock_node_ids: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(slots=True)
class IncLockRefResult:
    delta: int | None = None
    swa_uuid_for_lock: int | None = None
    swa_uuid_for_host_lock: int | None = None
    skip_lock_node_ids: dict = dataclasses.field(default_factory=dict)

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(
            swa_uuid_for_lock=self.swa_uuid_for_lock,
            swa_uuid_for_host_lock=self.swa_uuid_for_host_lock,
            skip_lock_node_ids={k: set(v) for k, v in self.skip_lock_node_ids.items()},
        )


@dataclasses.dataclass(slots=True)
class DecLockRefResult:
    delta: int | None = None


class MatchResult(NamedTuple):
    device_indices: torch.Tensor
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: int | None = None
    cache_protected_len: int | None = None
