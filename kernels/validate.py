"""Checks every copy runs before anything is launched or written.

A copy pairs `device_indices[k]` with `host_indices[k]` (token slots).  It is accepted when:

- the pools are a `DevicePool` and a `HostPool` of the same geometry (kind, layers, heads,
  head dim, page size, dtype), the host pool in CPU memory;
- each index list is a 1-D int64 tensor on the CPU or on the device pool's device, both of the
  same length;
- every index is inside its pool (`0 <= i < slots` on the device, `0 <= i < tokens` on the host);
- with a page size `P > 1`, the lists are whole pages: the length is a multiple of `P` and each
  group of `P` consecutive indices is `s, s+1, ..., s+P-1` with `s % P == 0` (the way the paged
  allocators hand slots out); the kernels move one page per program on that promise;
- the destination pages are distinct (two writers to one slot would race).

On a CUDA index tensor the checks of values cost one device sync (all statistics come back in
one copy); `values=False` skips them, for indices from a trusted allocator.
"""
from __future__ import annotations

import torch

from .layouts import DevicePool, HostPool, KernelIndexError, KernelInputError

__all__ = ["check_copy"]


def _check_pools(device: DevicePool, host: HostPool) -> None:
    if not isinstance(device, DevicePool):
        raise KernelInputError(f"device pool must be a DevicePool, got {type(device).__name__}")
    if not isinstance(host, HostPool):
        raise KernelInputError(f"host pool must be a HostPool, got {type(host).__name__}")
    if device.geometry != host.geometry:
        diffs = [f"{name}: device {getattr(device.geometry, name)} vs host {getattr(host.geometry, name)}"
                 for name in ("kind", "layers", "heads", "head_dim", "page_size", "dtype")
                 if getattr(device.geometry, name) != getattr(host.geometry, name)]
        raise KernelInputError("device and host pools differ: " + "; ".join(diffs))


def _check_index_tensor(idx, name: str, pool_device: torch.device) -> None:
    if not isinstance(idx, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype != torch.int64:
        raise KernelInputError(f"{name} must be int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise KernelInputError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
    if idx.device.type != "cpu" and idx.device != pool_device:
        raise KernelInputError(f"{name} is on {idx.device}; expected the CPU or {pool_device}")


def _stats(idx: torch.Tensor, page: int) -> torch.Tensor:
    """[min, max, whole pages (0/1), distinct pages (0/1)] of a non-empty index list, as int64."""
    if page > 1:
        grid = idx.reshape(-1, page)
        starts = grid[:, 0]
        step = torch.arange(page, device=idx.device, dtype=torch.int64)
        runs = ((grid - starts[:, None]) == step).all() & (starts % page == 0).all()
    else:
        starts = idx
        runs = torch.ones((), dtype=torch.bool, device=idx.device)
    ordered = torch.sort(starts).values
    distinct = (ordered[1:] != ordered[:-1]).all()
    return torch.stack([idx.min(), idx.max(), runs.to(torch.int64), distinct.to(torch.int64)])


def _first_bad(idx: torch.Tensor, bound: int) -> int:
    bad = ((idx < 0) | (idx >= bound)).nonzero()
    return int(bad[0, 0])


def check_copy(device: DevicePool, host: HostPool, device_indices, host_indices, *,
               to_host: bool, layers=(), values: bool = True) -> int:
    """Raise KernelInputError / KernelIndexError unless the copy is well formed; return its
    length in tokens.  `to_host` says which side is the destination (for the distinct-pages
    check); each of `layers` must name a layer of the pools, at most once.  `values=False`
    skips the checks that read the indices (range, whole pages, distinct destinations): only
    for indices a trusted allocator produced, where a device sync would cost too much."""
    _check_pools(device, host)
    g = device.geometry
    layers = list(layers)
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise KernelInputError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < g.layers:
            raise KernelIndexError(f"layer {layer} is outside the pools' {g.layers} layers")
    if len(set(layers)) != len(layers):
        raise KernelInputError(f"layers {layers} name a layer twice")
    _check_index_tensor(device_indices, "device_indices", device.device)
    _check_index_tensor(host_indices, "host_indices", device.device)
    n = device_indices.numel()
    if host_indices.numel() != n:
        raise KernelIndexError(
            f"device_indices has {n} slots but host_indices has {host_indices.numel()}; they pair one to one")
    if n % g.page_size:
        raise KernelIndexError(f"{n} slots is not a whole number of pages of {g.page_size}")
    if n == 0 or not values:
        return n
    sides = [("device_indices", device_indices, device.slots, not to_host),
             ("host_indices", host_indices, host.tokens, to_host)]
    stats = [_stats(idx, g.page_size) for _, idx, _, _ in sides]
    if stats[0].device == stats[1].device:
        found = torch.stack(stats).tolist()
    else:
        found = [s.tolist() for s in stats]
    for (name, idx, bound, is_dst), (lo, hi, runs, distinct) in zip(sides, found, strict=True):
        if lo < 0 or hi >= bound:
            k = _first_bad(idx, bound)
            raise KernelIndexError(f"{name}[{k}] = {int(idx[k])} is outside the pool's slots [0, {bound})")
        if not runs:
            raise KernelIndexError(
                f"{name} is not made of whole pages: with page size {g.page_size} each group of "
                f"{g.page_size} indices must be s..s+{g.page_size - 1} with s a multiple of {g.page_size}")
        if is_dst and not distinct:
            what = "pages" if g.page_size > 1 else "slots"
            raise KernelIndexError(f"{name} names some destination {what} twice; the copies would race")
    return n
