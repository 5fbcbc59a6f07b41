"""Pool geometry: what the device KV pool and the host pool look like, and how a token slot of
either is addressed.

Both pools are described by one `KVGeometry` (attention kind, layers, heads, head dim, page
size, dtype).  A *plane* is K or V for MHA (two planes) and the latent buffer for MLA (one
plane).  A *row* is the `heads * head_dim` elements one token keeps for one plane of one layer;
rows are contiguous in every layout, which is what lets one kernel serve all of them.

Device pool (one allocation, per-layer views are what attention reads):

    MHA  buffer (2, layers, slots, heads, head_dim)   k_buffer[l] = buffer[0, l]   (slots, heads, head_dim)
    MLA  buffer (layers, slots, 1, dim)               kv_buffer[l] = buffer[l]      (slots, 1, dim)

Host pool, `tokens` a multiple of the page size, `pages = tokens // page_size`:

    layout              MHA                                        MLA
    layer_first         (2, layers, tokens, heads, head_dim)       (layers, tokens, 1, dim)
    page_first          (2, tokens, layers, heads, head_dim)       (tokens, layers, 1, dim)
    page_first_direct   (2, pages, layers, page, heads, head_dim)  (pages, layers, page, 1, dim)

Indices on both sides are token slots.  A token slot `i` of plane `p`, layer `l` starts at
element `p*plane + l*layer + (i // page)*page_stride + (i % page)*token` of its buffer, with the
four strides that `Addressing` holds (all in elements; `page_stride = page * token` for the
layouts that are not page-major).  That single formula is the whole difference between layouts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = [
    "Addressing",
    "AttentionKind",
    "DevicePool",
    "HostPool",
    "KVGeometry",
    "KernelIndexError",
    "KernelInputError",
    "Layout",
]


class KernelInputError(ValueError):
    """A copy was asked with inputs that do not fit the pools; nothing was launched or written."""


class KernelIndexError(KernelInputError, IndexError):
    """An index is outside its pool, or index lists do not pair up; nothing was written."""


class Layout(str, enum.Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"


class AttentionKind(str, enum.Enum):
    MHA = "mha"   # K and V per layer
    MLA = "mla"   # one latent buffer per layer (heads == 1)


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """What one token holds: `planes` x `layers` rows of `heads * head_dim` elements of `dtype`."""

    kind: AttentionKind
    layers: int
    heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self):
        object.__setattr__(self, "kind", AttentionKind(self.kind))
        for name in ("layers", "heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise KernelInputError(f"{name} must be a positive int, got {value!r}")
        if self.kind is AttentionKind.MLA and self.heads != 1:
            raise KernelInputError(f"MLA keeps one latent head, got heads={self.heads}")

    @classmethod
    def mha(cls, layers, heads, head_dim, page_size, dtype):
        return cls(AttentionKind.MHA, layers, heads, head_dim, page_size, dtype)

    @classmethod
    def mla(cls, layers, dim, page_size, dtype):
        return cls(AttentionKind.MLA, layers, 1, dim, page_size, dtype)

    @property
    def planes(self) -> int:
        return 2 if self.kind is AttentionKind.MHA else 1

    @property
    def row(self) -> int:
        """Elements of one token for one plane of one layer."""
        return self.heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        """Bytes one token holds across planes and layers (what a backup of one token moves)."""
        return self.planes * self.layers * self.row * self.dtype.itemsize

    def device_shape(self, slots: int) -> tuple[int, ...]:
        inner = (self.layers, slots, self.heads, self.head_dim)
        return (2, *inner) if self.planes == 2 else inner

    def host_shape(self, layout: Layout, tokens: int) -> tuple[int, ...]:
        layout = Layout(layout)
        if tokens % self.page_size:
            raise KernelInputError(
                f"host pool tokens ({tokens}) must be a multiple of the page size ({self.page_size})")
        L, P, H, D = self.layers, self.page_size, self.heads, self.head_dim
        inner: tuple[int, ...]
        if layout is Layout.LAYER_FIRST:
            inner = (L, tokens, H, D)
        elif layout is Layout.PAGE_FIRST:
            inner = (tokens, L, H, D)
        else:
            inner = (tokens // P, L, P, H, D)
        return (2, *inner) if self.planes == 2 else inner


@dataclass(frozen=True, slots=True)
class Addressing:
    """Element strides of a pool buffer: token slot i of plane p, layer l starts at
    `p*plane + l*layer + (i // page)*page_stride + (i % page)*token`."""

    plane: int
    layer: int
    page_stride: int
    token: int


def _check_buffer(buffer: torch.Tensor, shape, dtype, what: str) -> None:
    if not isinstance(buffer, torch.Tensor):
        raise KernelInputError(f"{what} buffer must be a torch.Tensor, got {type(buffer).__name__}")
    if tuple(buffer.shape) != tuple(shape):
        raise KernelInputError(f"{what} buffer has shape {tuple(buffer.shape)}, expected {tuple(shape)}")
    if buffer.dtype != dtype:
        raise KernelInputError(f"{what} buffer has dtype {buffer.dtype}, expected {dtype}")
    # A token's row (heads, head_dim) must be contiguous; the outer dims may be strided.
    if buffer.stride(-1) != 1 or buffer.stride(-2) != buffer.shape[-1]:
        raise KernelInputError(
            f"{what} buffer must keep (heads, head_dim) contiguous, strides {buffer.stride()}")


@dataclass(frozen=True, slots=True)
class DevicePool:
    """The device KV pool: one buffer of `geometry.device_shape(slots)` (see the module docstring)."""

    geometry: KVGeometry
    buffer: torch.Tensor

    def __post_init__(self):
        _check_buffer(self.buffer, self.geometry.device_shape(self.slots), self.geometry.dtype, "device pool")

    @classmethod
    def allocate(cls, geometry: KVGeometry, slots: int, device="cpu") -> DevicePool:
        return cls(geometry, torch.zeros(geometry.device_shape(slots), dtype=geometry.dtype, device=device))

    @property
    def slots(self) -> int:
        return self.buffer.shape[2] if self.geometry.planes == 2 else self.buffer.shape[1]

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def planes_view(self) -> torch.Tensor:
        """(planes, layers, slots, heads, head_dim), a view."""
        return self.buffer if self.geometry.planes == 2 else self.buffer.unsqueeze(0)

    def layer(self, layer: int, plane: int = 0) -> torch.Tensor:
        """The (slots, heads, head_dim) buffer attention reads for one layer (plane 0 = K or latent,
        1 = V)."""
        return self.planes_view()[plane, layer]

    @property
    def k_buffer(self) -> list[torch.Tensor]:
        return [self.layer(i, 0) for i in range(self.geometry.layers)]

    @property
    def v_buffer(self) -> list[torch.Tensor]:
        if self.geometry.planes != 2:
            raise AttributeError("an MLA pool has no V buffer (use kv_buffer)")
        return [self.layer(i, 1) for i in range(self.geometry.layers)]

    @property
    def kv_buffer(self) -> list[torch.Tensor]:
        if self.geometry.planes != 1:
            raise AttributeError("an MHA pool keeps K and V apart (use k_buffer and v_buffer)")
        return self.k_buffer

    def addressing(self) -> Addressing:
        v = self.planes_view()
        token = v.stride(2)
        return Addressing(plane=v.stride(0), layer=v.stride(1),
                          page_stride=self.geometry.page_size * token, token=token)


@dataclass(frozen=True, slots=True)
class HostPool:
    """The host pool in one of upstream's layouts: one buffer of `geometry.host_shape(layout, tokens)`."""

    geometry: KVGeometry
    layout: Layout
    buffer: torch.Tensor

    def __post_init__(self):
        object.__setattr__(self, "layout", Layout(self.layout))
        if self.buffer.device.type != "cpu":
            raise KernelInputError(f"host pool buffer must live in CPU memory, got {self.buffer.device}")
        _check_buffer(self.buffer, self.geometry.host_shape(self.layout, self.tokens),
                      self.geometry.dtype, f"host pool ({self.layout.value})")

    @classmethod
    def allocate(cls, geometry: KVGeometry, layout: Layout, tokens: int, pin_memory: bool | None = None
                 ) -> HostPool:
        """Zeroed host pool; pinned (page-locked, so kernels can address it directly) by default
        when CUDA is available."""
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        shape = geometry.host_shape(layout, tokens)
        buffer = torch.zeros(shape, dtype=geometry.dtype, pin_memory=pin_memory)
        return cls(geometry, Layout(layout), buffer)

    @property
    def tokens(self) -> int:
        planes_dims = 1 if self.geometry.planes == 2 else 0
        shape = self.buffer.shape
        if self.layout is Layout.LAYER_FIRST:
            return shape[planes_dims + 1]
        if self.layout is Layout.PAGE_FIRST:
            return shape[planes_dims]
        return shape[planes_dims] * self.geometry.page_size

    @property
    def pages(self) -> int:
        return self.tokens // self.geometry.page_size

    def planes_view(self) -> torch.Tensor:
        """The buffer with a leading planes dim (a view; MLA gains a dim of 1)."""
        return self.buffer if self.geometry.planes == 2 else self.buffer.unsqueeze(0)

    def addressing(self) -> Addressing:
        v = self.planes_view()
        P = self.geometry.page_size
        if self.layout is Layout.LAYER_FIRST:
            return Addressing(plane=v.stride(0), layer=v.stride(1), page_stride=P * v.stride(2),
                              token=v.stride(2))
        if self.layout is Layout.PAGE_FIRST:
            return Addressing(plane=v.stride(0), layer=v.stride(2), page_stride=P * v.stride(1),
                              token=v.stride(1))
        return Addressing(plane=v.stride(0), layer=v.stride(2), page_stride=v.stride(1), token=v.stride(3))

    def token_row(self, plane: int, layer: int, slot: int) -> torch.Tensor:
        """The (heads, head_dim) row of one token slot, indexed the way the layout reads."""
        v = self.planes_view()
        if self.layout is Layout.LAYER_FIRST:
            return v[plane, layer, slot]
        if self.layout is Layout.PAGE_FIRST:
            return v[plane, slot, layer]
        P = self.geometry.page_size
        return v[plane, slot // P, layer, slot % P]

    def paged_layer(self, plane: int, layer: int) -> torch.Tensor:
        """A (pages, page, heads, head_dim) view of one plane and layer: `[i // page, i % page]` is slot i."""
        v = self.planes_view()
        P, n = self.geometry.page_size, self.pages
        if self.layout is Layout.LAYER_FIRST:
            t = v[plane, layer]
        elif self.layout is Layout.PAGE_FIRST:
            t = v[plane, :, layer]
        else:
            return v[plane, :, layer]
        return t.unflatten(0, (n, P))
