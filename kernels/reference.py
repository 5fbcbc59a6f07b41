"""Reference copies: what the Triton kernels must do, said twice.

- `*_torch`: per plane and layer, one gather by advanced indexing and one scatter by
  `index_put_` (index_select / index_copy_ in spirit) through the host pool's
  `(pages, page, heads, head_dim)` view.  Works on any device pair; this is also the fallback
  when Triton is not available.
- `*_loop`: a plain Python loop over planes, layers and token pairs that copies one row at a
  time, reading the host buffer with the layout's own indexing (`HostPool.token_row`).  Slow
  and obviously right; the tests hold both other versions to it.

Callers are expected to have run `validate.check_copy` (the public API does).
"""
from __future__ import annotations

import torch

from .layouts import DevicePool, HostPool

__all__ = [
    "backup_all_layers_loop", "backup_all_layers_torch",
    "load_layers_loop", "load_layers_torch",
]


def _host_coords(host: HostPool, host_indices: torch.Tensor):
    hi = host_indices.to("cpu")
    P = host.geometry.page_size
    return hi // P, hi % P


def backup_all_layers_torch(device: DevicePool, host: HostPool, device_indices, host_indices) -> None:
    g = device.geometry
    di = device_indices.to(device.device)
    page, offset = _host_coords(host, host_indices)
    for plane in range(g.planes):
        for layer in range(g.layers):
            rows = device.layer(layer, plane).index_select(0, di)
            host.paged_layer(plane, layer).index_put_((page, offset), rows.to("cpu"))


def load_layers_torch(host: HostPool, device: DevicePool, host_indices, device_indices, layers) -> None:
    g = device.geometry
    di = device_indices.to(device.device)
    page, offset = _host_coords(host, host_indices)
    for layer in layers:
        for plane in range(g.planes):
            rows = host.paged_layer(plane, layer)[page, offset]
            device.layer(layer, plane).index_copy_(0, di, rows.to(device.device))


def backup_all_layers_loop(device: DevicePool, host: HostPool, device_indices, host_indices) -> None:
    g = device.geometry
    pairs = list(zip(device_indices.tolist(), host_indices.tolist(), strict=True))
    for plane in range(g.planes):
        for layer in range(g.layers):
            src = device.layer(layer, plane)
            for d, h in pairs:
                host.token_row(plane, layer, h).copy_(src[d])


def load_layers_loop(host: HostPool, device: DevicePool, host_indices, device_indices, layers) -> None:
    g = device.geometry
    pairs = list(zip(host_indices.tolist(), device_indices.tolist(), strict=True))
    for layer in layers:
        for plane in range(g.planes):
            dst = device.layer(layer, plane)
            for h, d in pairs:
                dst[d].copy_(host.token_row(plane, layer, h))
