"""Cache configuration: the ``config`` object of a trace header (TRACE.md, version 1).

Missing keys take the defaults below; an unknown key, a value of the wrong type or an impossible
combination is a :class:`~uniradix.spec.errors.ConfigError`, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .errors import ConfigError, Unsupported

# the eviction policies (their orders: spec/policies.py, which checks it has one for each)
POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
COMPONENT_SETS = (("full",), ("full", "swa"), ("full", "mamba"), ("full", "swa", "mamba"),
                  ("full", "mamba", "swa"))


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = 1
    components: tuple[str, ...] = ("full",)
    kv_slots: int = 4096
    host_slots: int = 0
    write_policy: str = "write_through"
    write_through_threshold: int = 1
    load_back_threshold: int = 0
    sliding_window: int | None = None
    swa_slots: int = 0
    mamba_slots: int = 0
    host_swa_slots: int | None = None
    host_mamba_slots: int | None = None
    mamba_cache_chunk_size: int = 4
    eagle: bool = False
    disable: bool = False
    # eviction policy (spec/policies.py); a trace header without it means "lru"
    eviction_policy: str = "lru"
    # storage tier (spec/storage.py; docs/TRACE.md "The storage tier")
    storage: bool = False
    storage_key_mode: str = "namespaced"
    prefetch_stop_policy: str = "best_effort"
    prefetch_threshold: int = 256
    prefetch_timeout_base: int = 1
    prefetch_timeout_per_page: int = 0
    # the Mamba extra buffer (spec/requests.py, docs/SPEC.md "The Mamba extra buffer"): a
    # request tracks its state in ping-pong slots and caches the state of its last track point
    mamba_extra_buffer: bool = False
    mamba_track_interval: int = 256  # decode: a track point every this many tokens
    mamba_track_slots: int = 2  # the ping-pong slots (2: overlap schedule; 1: without)
    # the lazy variant (upstream's extra_buffer_lazy): a request holds one track slot, a decode
    # track point takes a fresh one for its state and frees the old (spec/requests.py)
    mamba_extra_buffer_lazy: bool = False

    @property
    def has_host_tier(self) -> bool:
        return self.host_slots > 0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> CacheConfig:
        """Build a config from a trace header's ``config`` object, checking every key."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config must be an object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
        values = dict(raw)
        if "components" in values:
            comps = values["components"]
            if not isinstance(comps, (list, tuple)) or not all(isinstance(c, str) for c in comps):
                raise ConfigError(f"components must be a list of names, got {comps!r}")
            values["components"] = tuple(comps)
        config = cls(**values)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["components"] = list(self.components)
        if self.eviction_policy == "lru":  # the default: headers stay as they were
            del out["eviction_policy"]
        if not self.storage:  # storage settings at their defaults: a version-1 header as before
            for f in STORAGE_FIELDS:
                if out[f.name] == f.default:
                    del out[f.name]
        if not self.mamba_extra_buffer:  # extra buffer off and at its defaults: as before
            for f in XBUF_FIELDS:
                if out[f.name] == f.default:
                    del out[f.name]
        if not self.mamba_extra_buffer_lazy:  # not lazy: the header stays as it was
            out.pop("mamba_extra_buffer_lazy", None)
        return out

    def validate(self) -> None:
        def need_int(name: str, minimum: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {v!r}")

        need_int("page_size", 1)
        for name in ("kv_slots", "host_slots", "swa_slots", "mamba_slots",
                     "write_through_threshold", "load_back_threshold"):
            need_int(name, 0)
        need_int("mamba_cache_chunk_size", 1)
        for name in ("host_swa_slots", "host_mamba_slots", "sliding_window"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ConfigError(f"{name} must be null or an integer >= 0, got {v!r}")
        for name in ("eagle", "disable"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.components not in COMPONENT_SETS:
            raise ConfigError(
                f"components must be one of {[list(c) for c in COMPONENT_SETS]}, "
                f"got {list(self.components)}")
        if not isinstance(self.eviction_policy, str):
            raise ConfigError(f"eviction_policy must be a string, got {self.eviction_policy!r}")
        check_policy(self.eviction_policy)  # an unknown policy is Unsupported, by name
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        for name in ("kv_slots", "host_slots", "swa_slots"):
            if getattr(self, name) % self.page_size:
                raise ConfigError(f"{name}={getattr(self, name)} is not a multiple of "
                                  f"page_size={self.page_size}")
        if self.host_swa_slots is not None and self.host_swa_slots % self.page_size:
            raise ConfigError(f"host_swa_slots={self.host_swa_slots} is not a multiple of "
                              f"page_size={self.page_size}")
        self.validate_storage()
        self.validate_extra_buffer()
        if "swa" in self.components and not self.sliding_window:
            raise ConfigError("components with 'swa' need a positive sliding_window")

    def validate_storage(self) -> None:
        """The storage tier's settings (spec/storage.py): each checked even with storage off."""
        if not isinstance(self.storage, bool):
            raise ConfigError(f"storage must be true or false, got {self.storage!r}")
        if self.storage_key_mode not in ("namespaced", "compat"):
            raise ConfigError("storage_key_mode must be 'namespaced' or 'compat', got "
                              f"{self.storage_key_mode!r}")
        if self.prefetch_stop_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ConfigError("prefetch_stop_policy must be one of best_effort, wait_complete, "
                              f"timeout, got {self.prefetch_stop_policy!r}")
        for name in ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_page"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {v!r}")
        if self.storage and (self.host_slots == 0 or self.components != ("full",)):
            raise ConfigError("storage needs a host tier (host_slots > 0) and components ['full']")


    def validate_extra_buffer(self) -> None:
        """The Mamba extra buffer's settings (spec/requests.py): each checked even when off.
        On, it needs the Mamba component; the request model covers it for Full + Mamba on the
        device alone (other combinations are ``Unsupported``, by name); its track points are
        page-aligned, so the chunk size and the decode interval are multiples of the page.
        Its lazy variant needs it on and two track slots (upstream: the overlap schedule)."""
        if not isinstance(self.mamba_extra_buffer, bool):
            raise ConfigError(f"mamba_extra_buffer must be true or false, got "
                              f"{self.mamba_extra_buffer!r}")
        v = self.mamba_track_interval
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"mamba_track_interval must be an integer >= 1, got {v!r}")
        if self.mamba_track_slots not in (1, 2) or isinstance(self.mamba_track_slots, bool):
            raise ConfigError(f"mamba_track_slots must be 1 or 2, got {self.mamba_track_slots!r}")
        if not isinstance(self.mamba_extra_buffer_lazy, bool):
            raise ConfigError(f"mamba_extra_buffer_lazy must be true or false, got "
                              f"{self.mamba_extra_buffer_lazy!r}")
        if self.mamba_extra_buffer_lazy and not self.mamba_extra_buffer:
            raise ConfigError("mamba_extra_buffer_lazy needs mamba_extra_buffer (it is a "
                              "variant of the extra buffer)")
        if self.mamba_extra_buffer_lazy and self.mamba_track_slots != 2:
            raise ConfigError("mamba_extra_buffer_lazy needs mamba_track_slots=2 (upstream's "
                              "lazy mode runs with the overlap schedule only), got "
                              f"{self.mamba_track_slots}")
        if not self.mamba_extra_buffer:
            return
        if "mamba" not in self.components:
            raise ConfigError("mamba_extra_buffer needs the 'mamba' component")
        if self.components != ("full", "mamba") or self.has_host_tier or self.eagle:
            raise Unsupported("mamba_extra_buffer is modelled for components ['full', 'mamba'] "
                              "on the device alone, without EAGLE keys")
        for name in ("mamba_cache_chunk_size", "mamba_track_interval"):
            if getattr(self, name) % self.page_size:
                raise ConfigError(f"mamba_extra_buffer: {name}={getattr(self, name)} is not a "
                                  f"multiple of page_size={self.page_size}")


def check_policy(name: object) -> str:
    """A policy name the spec knows, or Unsupported naming it (and the setting)."""
    if not isinstance(name, str) or name not in POLICIES:
        raise Unsupported(f"eviction_policy {name!r} is not supported; "
                          f"known: {', '.join(POLICIES)}")
    return name


STORAGE_FIELDS = tuple(f for f in dataclasses.fields(CacheConfig)
                       if f.name in ("storage", "storage_key_mode", "prefetch_stop_policy",
                                     "prefetch_threshold", "prefetch_timeout_base",
                                     "prefetch_timeout_per_page"))
XBUF_FIELDS = tuple(f for f in dataclasses.fields(CacheConfig)
                    if f.name in ("mamba_extra_buffer", "mamba_track_interval",
                                  "mamba_track_slots"))
