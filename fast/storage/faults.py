"""A fault-injecting wrapper around any storage backend, for tests of whatever drives one.

`FaultyBackend(inner)` forwards every call to `inner` until a `Fault` is injected; a fault then
applies to the next `times` calls of its operation family:

    op      "get"    get, batch_get, batch_get_v1
            "set"    set, batch_set, batch_set_v1
            "exists" exists, batch_exists
            "any"    all of them
    kind    "fail"     the call reports failure without touching the store (None / False /
                       all-False / a hit count of 0)
            "raise"    the call raises `InjectedStorageError`
            "timeout"  the call waits `delay_s`, then reports failure (a caller's deadline ran out)
            "slow"     the call waits `delay_s`, then goes through
            "short"    only the first `keep` keys of a batch go through; the rest report failure
                       (a read or write cut short); `batch_exists` answers at most `keep`

A failed read never writes into the caller's memory: the wrapper does not call `inner` for the
keys it fails.  Every call is recorded in `calls` (operation name, number of keys, faulted).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import StorageBackend, StorageInputError, check_keys

__all__ = ["Fault", "FaultyBackend", "InjectedStorageError"]

_OPS = ("get", "set", "exists", "any")
_KINDS = ("fail", "raise", "timeout", "slow", "short")


class InjectedStorageError(RuntimeError):
    """Raised by a `FaultyBackend` call under a fault of kind "raise"."""


@dataclass
class Fault:
    op: str
    kind: str
    times: int = 1          # calls it applies to; -1: until cleared
    delay_s: float = 0.0    # for "timeout" and "slow"
    keep: int = 0           # for "short": keys of a batch that go through

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise StorageInputError(f"fault op must be one of {_OPS}, got {self.op!r}")
        if self.kind not in _KINDS:
            raise StorageInputError(f"fault kind must be one of {_KINDS}, got {self.kind!r}")
        if not isinstance(self.times, int) or (self.times < 1 and self.times != -1):
            raise StorageInputError(f"fault times must be a positive int or -1, got {self.times!r}")
        if self.delay_s < 0 or self.keep < 0:
            raise StorageInputError("fault delay_s and keep must not be negative")


class FaultyBackend(StorageBackend):
    """`inner` with injectable faults; see the module docstring."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__()
        self.inner = inner
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.calls: list[tuple[str, int, str | None]] = []

    def inject(self, fault: Fault) -> FaultyBackend:
        with self._lock:
            self._faults.append(fault)
        return self

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take(self, family: str, name: str, n: int) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if f.op in (family, "any"):
                    if f.times > 0:
                        f.times -= 1
                        if f.times == 0:
                            self._faults.remove(f)
                    self.calls.append((name, n, f.kind))
                    break
            else:
                self.calls.append((name, n, None))
                return None
        if f.kind in ("timeout", "slow") and f.delay_s:
            time.sleep(f.delay_s)
        if f.kind == "raise":
            raise InjectedStorageError(f"injected failure of {name}")
        return f

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.inner.register_mem_pool_host(mem_pool_host)
        super().register_mem_pool_host(mem_pool_host)

    # -- per key ------------------------------------------------------------------------------
    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        f = self._take("get", "get", 1)
        if f is not None and f.kind != "slow" and not (f.kind == "short" and f.keep >= 1):
            return None
        return self.inner.get(key, target_location, target_sizes)

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        f = self._take("set", "set", 1)
        if f is not None and f.kind != "slow" and not (f.kind == "short" and f.keep >= 1):
            return False
        return self.inner.set(key, value, target_location, target_sizes)

    def exists(self, key: str) -> bool:
        f = self._take("exists", "exists", 1)
        if f is not None and f.kind != "slow" and not (f.kind == "short" and f.keep >= 1):
            return False
        return self.inner.exists(key)

    # -- batches ------------------------------------------------------------------------------
    @staticmethod
    def _through(f: Fault | None, n: int) -> int:
        """How many keys of a batch of `n` go through under fault `f`."""
        if f is None or f.kind == "slow":
            return n
        if f.kind == "short":
            return min(f.keep, n)
        return 0

    def batch_get(self, keys: Sequence[str], target_locations=None, target_sizes=None):
        keys = check_keys(keys)
        k = self._through(self._take("get", "batch_get", len(keys)), len(keys))
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        return self.inner.batch_get(keys[:k], targets[:k]) + [None] * (len(keys) - k)

    def batch_set(self, keys: Sequence[str], values=None, target_locations=None, target_sizes=None) -> bool:
        keys = check_keys(keys)
        k = self._through(self._take("set", "batch_set", len(keys)), len(keys))
        ok = self.inner.batch_set(keys[:k], list(values or [])[:k]) if k else True
        return ok and k == len(keys)

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        keys = check_keys(keys)
        k = self._through(self._take("exists", "batch_exists", len(keys)), len(keys))
        return self.inner.batch_exists(keys[:k], extra_info) if k else 0

    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor,
               k: int) -> tuple[Sequence[str], torch.Tensor]:
        P = self.page_layout.page_size
        return keys[:k], torch.as_tensor(host_indices, device="cpu").reshape(-1)[:k * P]

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        keys = check_keys(keys)
        self.page_layout.host_pages(host_indices, len(keys))       # refuse bad input first
        k = self._through(self._take("get", "batch_get_v1", len(keys)), len(keys))
        head = self.inner.batch_get_v1(*self._pages(keys, host_indices, k), extra_info) if k else []
        return list(head) + [False] * (len(keys) - k)

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        keys = check_keys(keys)
        self.page_layout.host_pages(host_indices, len(keys))
        k = self._through(self._take("set", "batch_set_v1", len(keys)), len(keys))
        head = self.inner.batch_set_v1(*self._pages(keys, host_indices, k), extra_info) if k else []
        return list(head) + [False] * (len(keys) - k)

    def clear(self) -> None:
        self.inner.clear()

    def get_stats(self):
        return self.inner.get_stats()

    def close(self) -> None:
        self.inner.close()
