"""Triton gather/scatter of KV pages between the device pool and the host pool.

One kernel serves every layout and direction.  A program copies one page (`page` token slots)
of one plane of one layer: it reads the page's first slot on each side from the index lists,
turns it into an element offset with the side's `Addressing` (layouts.py), and copies a
`(page, row)` tile, row by row, in `(BLOCK_T, BLOCK_E)` chunks whose inner axis is contiguous on
both sides.  The grid is `(pages copied, planes * layers copied)`; a per-layer load is the same
launch with one layer.

Data are moved as raw words: each buffer is reinterpreted as the widest integer type (8, 4, 2 or
1 bytes) that divides a row and every stride, so fp16/bf16/fp32/fp8 all take the same path, NaN
payloads survive bit for bit, and a row of 128 fp16 values is 32 int64 words.

Address arithmetic is int64 throughout: program ids and loaded indices are widened before any
multiply, so buffers past 2**31 elements (host pools are hundreds of GB) address correctly.

On CUDA the host pool must be pinned: the kernel then reads or writes host memory directly over
the bus (unified addressing; no staging copy).  On the CPU the kernels run under
`TRITON_INTERPRET=1` (set before triton is imported); `available_for(device)` says whether this
process can launch them on a given device.
"""
from __future__ import annotations

import os

import torch

from .layouts import Addressing, DevicePool, HostPool

try:  # triton is optional: without it the public API falls back to the torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

__all__ = ["INTERPRET", "available_for", "backup_all_layers_triton", "load_layers_triton"]

# Elements (words) per chunk a program moves at once; a power of two.
TILE = 2048


def available_for(device: torch.device) -> bool:
    """Can this process run the Triton kernels on pools living on `device`?"""
    if triton is None:
        return False
    if INTERPRET:
        return True
    return device.type == "cuda"


if triton is not None:

    @triton.jit
    def _copy_pages_kernel(
        src, dst, src_idx, dst_idx,
        layer0, n_layers,
        s_plane, s_layer, s_page, s_tok,
        d_plane, d_layer, d_page, d_tok,
        PAGE: tl.constexpr, ROW: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    ):
        unit = tl.program_id(0).to(tl.int64)           # which page of the index lists
        pl = tl.program_id(1).to(tl.int64)             # plane * n_layers + layer - layer0
        plane = pl // n_layers
        layer = layer0 + pl % n_layers
        first = unit * PAGE
        si = tl.load(src_idx + first).to(tl.int64)     # first slot of the page on each side
        di = tl.load(dst_idx + first).to(tl.int64)
        src_base = plane * s_plane + layer * s_layer + (si // PAGE) * s_page
        dst_base = plane * d_plane + layer * d_layer + (di // PAGE) * d_page
        for t0 in range(0, PAGE, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            src_rows = src_base + t * s_tok
            dst_rows = dst_base + t * d_tok
            for e0 in range(0, ROW, BLOCK_E):
                e = e0 + tl.arange(0, BLOCK_E).to(tl.int64)
                mask = (t[:, None] < PAGE) & (e[None, :] < ROW)
                words = tl.load(src + (src_rows[:, None] + e[None, :]), mask=mask)
                tl.store(dst + (dst_rows[:, None] + e[None, :]), words, mask=mask)


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_bytes(dtype: torch.dtype, row: int, buffers, addressings) -> int:
    """The widest word that divides a row, every stride and every buffer's start address."""
    item = dtype.itemsize
    for w in (8, 4, 2, 1):
        if w < item:
            break
        ok = (row * item) % w == 0 and all(b.data_ptr() % w == 0 for b in buffers) and all(
            (s * item) % w == 0 for a in addressings for s in (a.plane, a.layer, a.page_stride, a.token))
        if ok:
            return w
    return item


def _as_words(buffer: torch.Tensor, word: int) -> torch.Tensor:
    # (heads, head_dim) is contiguous (checked by the pools), so it flattens to one row
    # without a copy; the row is then read as words.
    return buffer.flatten(-2).view(_WORDS[word])


def _scaled(a: Addressing, factor_num: int, factor_den: int) -> Addressing:
    f = lambda s: s * factor_num // factor_den  # noqa: E731 - exact: checked divisible above
    return Addressing(f(a.plane), f(a.layer), f(a.page_stride), f(a.token))


def _launch(src: torch.Tensor, src_a: Addressing, dst: torch.Tensor, dst_a: Addressing,
            src_idx: torch.Tensor, dst_idx: torch.Tensor, *, geometry, layer0: int, n_layers: int,
            launch_device: torch.device) -> None:
    n = src_idx.numel()
    if n == 0:
        return
    page, planes = geometry.page_size, geometry.planes
    item = geometry.dtype.itemsize
    word = _word_bytes(geometry.dtype, geometry.row, (src, dst), (src_a, dst_a))
    row = geometry.row * item // word
    src_a, dst_a = _scaled(src_a, item, word), _scaled(dst_a, item, word)
    src_w, dst_w = _as_words(src, word), _as_words(dst, word)
    src_idx = src_idx.to(launch_device).contiguous()
    dst_idx = dst_idx.to(launch_device).contiguous()
    block_e = min(triton.next_power_of_2(row), TILE)
    block_t = max(1, min(triton.next_power_of_2(page), TILE // block_e))
    grid = (n // page, planes * n_layers)
    _copy_pages_kernel[grid](
        src_w, dst_w, src_idx, dst_idx,
        layer0, n_layers,
        src_a.plane, src_a.layer, src_a.page_stride, src_a.token,
        dst_a.plane, dst_a.layer, dst_a.page_stride, dst_a.token,
        PAGE=page, ROW=row, BLOCK_T=block_t, BLOCK_E=block_e,
    )


def _pool_views(device: DevicePool, host: HostPool):
    # The kernel takes the base pointer of a buffer plus element strides: the planes view
    # (an unsqueeze for MLA) has the same storage offset as the buffer itself.
    return device.planes_view(), device.addressing(), host.planes_view(), host.addressing()


def backup_all_layers_triton(device: DevicePool, host: HostPool, device_indices, host_indices) -> None:
    """Device -> host, every plane of every layer, one launch."""
    dv, da, hv, ha = _pool_views(device, host)
    _launch(dv, da, hv, ha, device_indices, host_indices, geometry=device.geometry,
            layer0=0, n_layers=device.geometry.layers, launch_device=device.device)


def load_layers_triton(host: HostPool, device: DevicePool, host_indices, device_indices, layers) -> None:
    """Host -> device for the given layers: one launch per maximal run of consecutive layers,
    so `range(layers)` is one launch and a single layer is one launch."""
    dv, da, hv, ha = _pool_views(device, host)
    layers = list(layers)
    start = 0
    while start < len(layers):
        end = start + 1
        while end < len(layers) and layers[end] == layers[end - 1] + 1:
            end += 1
        _launch(hv, ha, dv, da, host_indices, device_indices, geometry=device.geometry,
                layer0=layers[start], n_layers=end - start, launch_device=device.device)
        start = end
