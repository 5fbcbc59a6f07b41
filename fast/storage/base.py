"""The storage backend interface (upstream SGLang's `HiCacheStorage`, 0.5.13.post1) and the view
of a host pool's pages that zero-copy backends read and write.

A backend stores *pages* under string keys.  Two families of calls, as upstream has them:

    get / set / batch_get / batch_set   one flat tensor per key (the caller owns the memory)
    batch_get_v1 / batch_set_v1         pages of the registered host pool, by host indices

plus `exists`, `batch_exists` (how many keys, counted from the start, are all stored: the
storage hit of a prefetch), `clear` and `register_mem_pool_host`.  Upstream's controller calls
the batch methods with at most `STORAGE_BATCH_SIZE` (128) pages at a time; ours accept any
length and work through it in 128-page chunks.

`PageLayout` says where one page of a host pool lies in memory: a list of contiguous byte
regions of the pool's one buffer (one per plane for the page-major layouts, one per plane and
layer for `layer_first`).  It accepts a `uniradix.kernels.HostPool` or an upstream host pool
(`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`: anything with `kv_buffer`, `layout` and
`page_size`), in the three layouts `uniradix.kernels` knows.  Its `tag` names the geometry,
layout and dtype; backends store it beside each page so that a page written by a pool of another
shape is never loaded into this one (it reads as a miss).

Errors: bad input (an unknown layout, host indices that are not whole pages of the pool, a key
that is not a str) raises `StorageInputError` before anything is read or written.  A backend
that cannot reach its store answers a miss (get) or a failed set, never an exception from the
batch calls the controller makes.
"""
from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...kernels.layouts import HostPool, KVGeometry, Layout

__all__ = [
    "STORAGE_BATCH_SIZE", "PageLayout", "StorageBackend", "StorageInputError", "StorageStats",
    "check_keys", "chunks",
]

STORAGE_BATCH_SIZE = 128
"""Pages per batched storage call, as upstream's controller issues them."""


class StorageInputError(ValueError):
    """A storage call was given inputs it cannot accept; nothing was read or written."""


def check_keys(keys: Sequence[str], what: str = "keys") -> list[str]:
    """`keys` as a list, each a str (any str: tenant and namespace live inside the key)."""
    if isinstance(keys, (str, bytes)):
        raise StorageInputError(f"{what} must be a sequence of str, got a single {type(keys).__name__}")
    out = list(keys)
    for k in out:
        if not isinstance(k, str):
            raise StorageInputError(f"{what} must be str, got {type(k).__name__}: {k!r}")
    return out


def chunks(n: int, size: int = STORAGE_BATCH_SIZE) -> Iterator[range]:
    """Consecutive ranges of at most `size` covering range(n)."""
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _as_host_pool(pool: Any) -> HostPool:
    if isinstance(pool, HostPool):
        return pool
    buffer = getattr(pool, "kv_buffer", None)
    layout = getattr(pool, "layout", None)
    page_size = getattr(pool, "page_size", None)
    if not isinstance(buffer, torch.Tensor) or layout is None or not isinstance(page_size, int):
        raise StorageInputError(
            f"host pool {type(pool).__name__} is neither a uniradix.kernels.HostPool nor a host pool "
            "with kv_buffer, layout and page_size")
    try:
        layout = Layout(str(layout))
    except ValueError:
        raise StorageInputError(
            f"host pool layout {layout!r} is not supported (supported: "
            f"{', '.join(m.value for m in Layout)})") from None
    # MHA buffers carry a leading K/V dim of 2: one more dim than MLA in the same layout.
    mha_dims = 6 if layout is Layout.PAGE_FIRST_DIRECT else 5
    dtype = buffer.dtype
    if buffer.dim() == mha_dims:
        heads, head_dim = buffer.shape[-2], buffer.shape[-1]
        layers = buffer.shape[1] if layout is Layout.LAYER_FIRST else buffer.shape[2]
        geometry = KVGeometry.mha(int(layers), int(heads), int(head_dim), page_size, dtype)
    elif buffer.dim() == mha_dims - 1:
        dim = buffer.shape[-1]
        layers = buffer.shape[0] if layout is Layout.LAYER_FIRST else buffer.shape[1]
        geometry = KVGeometry.mla(int(layers), int(dim), page_size, dtype)
    else:
        raise StorageInputError(
            f"host pool kv_buffer of shape {tuple(buffer.shape)} fits no {layout.value} layout")
    try:
        return HostPool(geometry, layout, buffer)
    except ValueError as e:
        raise StorageInputError(f"host pool does not fit its layout: {e}") from None


@dataclass(frozen=True)
class PageLayout:
    """Where each page of a host pool lies: `regions(page)` gives (byte offset, byte count) pairs
    into the pool's single contiguous buffer, in the order a page is stored.

    Costs: `regions` is O(regions per page) arithmetic (planes, or planes x layers for
    layer_first); `host_pages` checks the indices with a few vector ops, O(len(indices))."""

    pool: HostPool
    flat: np.ndarray = field(repr=False)   # the whole buffer as uint8, sharing its memory
    base_ptr: int
    page_size: int
    pages: int
    page_bytes: int
    tag: str
    _starts: tuple = field(repr=False)      # (plane, layer) region offsets of page 0, in bytes
    _region_bytes: int = 0
    _page_stride_bytes: int = 0

    @classmethod
    def of(cls, pool: Any) -> PageLayout:
        hp = _as_host_pool(pool)
        buf = hp.buffer
        if not buf.is_contiguous():
            raise StorageInputError("host pool buffer must be contiguous")
        g = hp.geometry
        item = g.dtype.itemsize
        a = hp.addressing()
        P = g.page_size
        if hp.layout is Layout.LAYER_FIRST:
            starts = tuple((p * a.plane + layer * a.layer) * item
                           for p in range(g.planes) for layer in range(g.layers))
            region = P * g.row * item
        else:
            starts = tuple(p * a.plane * item for p in range(g.planes))
            region = g.layers * P * g.row * item
        flat = buf.reshape(-1).view(torch.uint8).numpy()
        tag = (f"{g.kind.value}-{hp.layout.value}-l{g.layers}h{g.heads}d{g.head_dim}"
               f"p{P}-{str(g.dtype).removeprefix('torch.')}")
        return cls(pool=hp, flat=flat, base_ptr=buf.data_ptr(), page_size=P, pages=hp.pages,
                   page_bytes=region * len(starts), tag=tag, _starts=starts, _region_bytes=region,
                   _page_stride_bytes=a.page_stride * item)

    def regions(self, page: int) -> list[tuple[int, int]]:
        """(offset, nbytes) of each contiguous piece of `page`, in storage order."""
        base = page * self._page_stride_bytes
        n = self._region_bytes
        return [(base + s, n) for s in self._starts]

    def views(self, page: int) -> list[np.ndarray]:
        """The pieces of `page` as uint8 numpy views into the pool (writable, no copy)."""
        f = self.flat
        return [f[o:o + n] for o, n in self.regions(page)]

    def host_pages(self, host_indices: Any, n_keys: int) -> list[int]:
        """Page numbers for `n_keys` keys from token-slot `host_indices` (whole pages, in order).

        Raises StorageInputError unless there are exactly `n_keys * page_size` indices, each
        page's block is page-aligned, consecutive and inside the pool."""
        idx = torch.as_tensor(host_indices, device="cpu").reshape(-1)  # (host memory's slots)
        if idx.dtype.is_floating_point or idx.dtype == torch.bool:
            raise StorageInputError(f"host indices must be integers, got {idx.dtype}")
        P = self.page_size
        if idx.numel() != n_keys * P:
            raise StorageInputError(
                f"{n_keys} keys need {n_keys * P} host indices (page size {P}), got {idx.numel()}")
        if n_keys == 0:
            return []
        blocks = idx.to(torch.int64).view(n_keys, P)
        first = blocks[:, 0]
        if (bool((first % P != 0).any()) or bool((first < 0).any())
            or bool((first + P > self.pages * P).any())):
            raise StorageInputError(
                f"host indices must start whole pages inside the pool of {self.pages} pages")
        if P > 1 and not bool((blocks - first[:, None] == torch.arange(P, device="cpu")).all()):
            raise StorageInputError("each page's host indices must be consecutive")
        return (first // P).tolist()


@dataclass
class StorageStats:
    """Counters a backend keeps (pages; bytes moved; failed operations)."""

    pages_set: int = 0
    pages_get: int = 0
    pages_missed: int = 0
    bytes_set: int = 0
    bytes_get: int = 0
    failed_sets: int = 0
    corrupt_pages: int = 0
    evicted_pages: int = 0


class StorageBackend(abc.ABC):
    """Upstream's `HiCacheStorage` interface, backend-neutral and without sglang.

    Subclasses implement the tensor calls (`get`, `set`, `exists`) and the zero-copy page calls
    (`batch_get_v1`, `batch_set_v1`) and `clear`; the rest has defaults here.  Every method is
    safe to call from several threads at once."""

    key_prefix: str = ""
    """Prepended to every key (a rank or model namespace, set by whoever builds the backend)."""

    def __init__(self) -> None:
        self.mem_pool_host: Any = None
        self._page_layout: PageLayout | None = None
        self.stats = StorageStats()
        self._stats_lock = threading.Lock()

    # -- host pool ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Bind the host pool that `batch_get_v1` / `batch_set_v1` address by host indices."""
        self._page_layout = PageLayout.of(mem_pool_host)
        self.mem_pool_host = mem_pool_host

    @property
    def page_layout(self) -> PageLayout:
        if self._page_layout is None:
            raise StorageInputError("no host pool registered: call register_mem_pool_host first")
        return self._page_layout

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                setattr(self.stats, k, getattr(self.stats, k) + v)

    def _key(self, key: str) -> str:
        return self.key_prefix + check_keys([key])[0]

    def _keys(self, keys: Sequence[str]) -> list[str]:
        p = self.key_prefix
        return [p + k for k in check_keys(keys)] if p else check_keys(keys)

    def _host_batch(self, keys: Sequence[str], host_indices: torch.Tensor) -> tuple:
        """The checked, prefixed keys of a zero-copy batch, the pool's page layout, and the host
        page each key reads into or writes from (bad input refused before anything moves)."""
        keys = self._keys(keys)
        layout = self.page_layout
        return keys, layout, layout.host_pages(host_indices, len(keys))

    # -- per key ------------------------------------------------------------------------------
    @abc.abstractmethod
    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        """Read the value of `key` into `target_location` (a contiguous tensor of the stored
        size) and return it; None on a miss (absent, corrupt, of another size)."""

    @abc.abstractmethod
    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Store the bytes of `value` under `key`; True once stored (or already present)."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether `key` is stored (by `set`); O(1) for the file store, one round trip for Mooncake."""

    def batch_get(self, keys: Sequence[str],
                  target_locations: Sequence[torch.Tensor | None] | None = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        keys = check_keys(keys)         # get() adds the key prefix
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            raise StorageInputError(f"{len(keys)} keys but {len(targets)} target locations")
        return [self.get(k, t) for k, t in zip(keys, targets, strict=True)]

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor] | None = None,
                  target_locations: Any = None, target_sizes: Any = None) -> bool:
        """True when every key is stored; stops at the first failure, as upstream's does."""
        keys = check_keys(keys)
        vals = list(values) if values is not None else []
        if len(vals) != len(keys):
            raise StorageInputError(f"{len(keys)} keys but {len(vals)} values")
        return all(self.set(k, v) for k, v in zip(keys, vals, strict=True))

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        """How many keys from the start are all stored (the storage hit, in pages)."""
        keys = check_keys(keys)
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    # -- pages of the host pool (zero copy) ---------------------------------------------------
    @abc.abstractmethod
    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Load page i of `keys` into the host pool at the page `host_indices[i*P:(i+1)*P]`;
        one bool per key (False: a miss, and that page of the pool holds nothing to use)."""

    @abc.abstractmethod
    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages under `keys`; one bool per key."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every page this backend stored (and nothing else)."""

    def get_stats(self) -> StorageStats:
        with self._stats_lock:
            return StorageStats(**vars(self.stats))

    def close(self) -> None:  # noqa: B027 (an optional hook: most backends hold nothing to release)
        """Release connections and files; the default has nothing to release."""
