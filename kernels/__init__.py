"""uniradix.kernels: gather/scatter of KV pages between the device pool and the host pool for
HiCache, in upstream SGLang's host layouts (`layer_first`, `page_first`, `page_first_direct`).

    backup_all_layers(device, host, device_indices=..., host_indices=...)   device -> host, all layers
    load_layer(host, device, layer, host_indices=..., device_indices=...)   host -> device, one layer
    load_all_layers(host, device, host_indices=..., device_indices=...)     host -> device, all layers

Indices are token slots (1-D int64), paired one to one; with a page size above 1 they come in
whole pages.  Every call checks its inputs first (`validate.check_copy`) and raises
`KernelInputError` / `KernelIndexError` without writing anything.  `impl` picks the engine:
"triton" (the kernels in triton_copy.py), "torch" (reference.py, index gathers and scatters),
"loop" (reference.py, a plain Python loop) or "auto": Triton where it can run on the pools'
device (CUDA, or the CPU under TRITON_INTERPRET=1), the torch reference elsewhere.

On CUDA, `TransferStream` runs the copies on a side stream: `backup_async` returns the event of
a backup, `load_layers_async` one event per layer, so attention for layer i waits only for layer
i (`torch.cuda.current_stream().wait_event(events[i])`).  Shapes and layouts: layouts.py and
docs/KERNELS.md.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from . import reference
from .layouts import (
    Addressing,
    AttentionKind,
    DevicePool,
    HostPool,
    KernelIndexError,
    KernelInputError,
    KVGeometry,
    Layout,
)
from .triton_copy import available_for, backup_all_layers_triton, load_layers_triton
from .validate import check_copy

__all__ = [
    "Addressing", "AttentionKind", "DevicePool", "HostPool", "KVGeometry", "KernelIndexError",
    "KernelInputError", "Layout", "TransferStream", "backup_all_layers", "load_all_layers",
    "load_layer", "load_layers", "resolve_impl",
]

IMPLS = ("auto", "triton", "torch", "loop")


def resolve_impl(impl: str, device: DevicePool, host: HostPool) -> str:
    """The engine a call with `impl` runs on these pools ("triton", "torch" or "loop")."""
    if impl not in IMPLS:
        raise KernelInputError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if available_for(device.device) else "torch"
    if impl == "triton":
        if not available_for(device.device):
            raise KernelInputError(
                f"Triton kernels cannot run on {device.device} here (no triton, or a CPU pool "
                "without TRITON_INTERPRET=1)")
        if device.device.type == "cuda" and not host.buffer.is_pinned():
            raise KernelInputError("the Triton path on CUDA addresses the host pool directly: "
                                   "it must be pinned "
                                   "(HostPool.allocate(..., pin_memory=True))")
    return impl


def _backup(device, host, device_indices, host_indices, impl) -> None:
    if impl == "triton":
        backup_all_layers_triton(device, host, device_indices, host_indices)
    elif impl == "torch":
        reference.backup_all_layers_torch(device, host, device_indices, host_indices)
    else:
        reference.backup_all_layers_loop(device, host, device_indices, host_indices)


def _load(host, device, host_indices, device_indices, layers, impl) -> None:
    if not layers:
        return
    if impl == "triton":
        load_layers_triton(host, device, host_indices, device_indices, layers)
    elif impl == "torch":
        reference.load_layers_torch(host, device, host_indices, device_indices, layers)
    else:
        reference.load_layers_loop(host, device, host_indices, device_indices, layers)


def backup_all_layers(device: DevicePool, host: HostPool, *, device_indices: torch.Tensor,
                      host_indices: torch.Tensor, impl: str = "auto") -> None:
    """Copy slots `device_indices` of every layer (K and V, or the latent) to host slots
    `host_indices`.  On CUDA the copy is queued on the current stream."""
    n = check_copy(device, host, device_indices, host_indices, to_host=True)
    impl = resolve_impl(impl, device, host)
    if n:
        _backup(device, host, device_indices, host_indices, impl)


def load_layers(host: HostPool, device: DevicePool, layers: Iterable[int], *, host_indices: torch.Tensor,
                device_indices: torch.Tensor, impl: str = "auto") -> None:
    """Copy host slots `host_indices` to device slots `device_indices` for each of `layers`
    (distinct; consecutive layers share one launch on the Triton path)."""
    layers = list(layers)
    n = check_copy(device, host, device_indices, host_indices, to_host=False, layers=layers)
    impl = resolve_impl(impl, device, host)
    if n:
        _load(host, device, host_indices, device_indices, layers, impl)


def load_layer(host: HostPool, device: DevicePool, layer: int, *, host_indices: torch.Tensor,
               device_indices: torch.Tensor, impl: str = "auto") -> None:
    """Host -> device for one layer (what a layer-by-layer load runs before layer `layer`'s attention)."""
    load_layers(host, device, [layer], host_indices=host_indices, device_indices=device_indices, impl=impl)


def load_all_layers(host: HostPool, device: DevicePool, *, host_indices: torch.Tensor,
                    device_indices: torch.Tensor, impl: str = "auto") -> None:
    """Host -> device for every layer, in one launch on the Triton path."""
    load_layers(host, device, range(device.geometry.layers), host_indices=host_indices,
                device_indices=device_indices, impl=impl)


class TransferStream:
    """Device <-> host copies on a CUDA side stream, each handing back the event that marks it done.

    Ordering: every call first makes the side stream wait for the caller's current stream, so a
    backup sees the KV the forward pass wrote and a load lands after earlier users of the slots.
    The caller orders its own work after a copy by waiting on the returned event.  Index tensors
    may be on the CPU (copied to the device on the side stream) or on the device (kept alive for
    the side stream with `record_stream`).  The host pool must be pinned.

    Index values are checked before anything is queued.  For CPU index tensors that is free;
    for device index tensors it is a host sync on the work that produced them, which would
    stall the caller: pass `check_values=False` there when the indices come from the
    allocators (the structure is still checked: dtype, shape, lengths, devices, layers).
    """

    def __init__(self, device: torch.device | str | int | None = None, impl: str = "auto"):
        if not torch.cuda.is_available():
            raise KernelInputError("TransferStream needs CUDA")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device if not isinstance(device, int) else f"cuda:{device}")
        self.stream = torch.cuda.Stream(device=self.device)
        self.impl = impl

    def _on_side(self, device_pool: DevicePool, *indices: torch.Tensor) -> list[torch.Tensor]:
        if device_pool.device != self.device:
            raise KernelInputError(f"device pool is on {device_pool.device}, this stream on {self.device}")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        moved = []
        for idx in indices:
            if idx.device.type == "cuda":
                idx.record_stream(self.stream)
                moved.append(idx)
            else:
                with torch.cuda.stream(self.stream):
                    moved.append(idx.to(self.device, non_blocking=True))
        return moved

    def backup_async(self, device: DevicePool, host: HostPool, *, device_indices: torch.Tensor,
                     host_indices: torch.Tensor, check_values: bool = True) -> torch.cuda.Event:
        """Queue a backup of all layers; the event completes when the host pool holds the slots."""
        n = check_copy(device, host, device_indices, host_indices, to_host=True, values=check_values)
        impl = resolve_impl(self.impl, device, host)
        di, hi = self._on_side(device, device_indices, host_indices)
        with torch.cuda.stream(self.stream):
            if n:
                _backup(device, host, di, hi, impl)
            return self.stream.record_event()

    def load_layers_async(self, host: HostPool, device: DevicePool, *, host_indices: torch.Tensor,
                          device_indices: torch.Tensor, layers: Sequence[int] | None = None,
                          check_values: bool = True) -> list[torch.cuda.Event]:
        """Queue a layer-by-layer load (all layers by default, in the order given); `events[k]`
        completes when `layers[k]` has arrived on the device."""
        layers = list(range(device.geometry.layers)) if layers is None else list(layers)
        n = check_copy(device, host, device_indices, host_indices, to_host=False, layers=layers,
                       values=check_values)
        impl = resolve_impl(self.impl, device, host)
        hi, di = self._on_side(device, host_indices, device_indices)
        events = []
        with torch.cuda.stream(self.stream):
            for layer in layers:
                if n:
                    _load(host, device, hi, di, [layer], impl)
                events.append(self.stream.record_event())
        return events
