"""Where the C core writes a page-1 free list (fast/_core.c ``append_tail``): a short list is
appended in place to the tail buffer only over memory written before, and copied into a new
tensor where the buffer's room is fresh pages; either way the list is exactly what sglang's own
frees leave, and no slot handed out changes."""

import pytest

torch = pytest.importorskip("torch")

import uniradix.fast.cache as cache_mod  # noqa: E402


def _sglang_token(slots: int):
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        torch_mod = load_upstream().torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return TokenToKVPoolAllocator(slots, torch_mod.float16, "cpu", None, False)


class _Holder:
    """What the C core keeps its page-1 tail buffer on (the cache, in production)."""

    def __init__(self) -> None:
        self._free_tail = None
        self._free_tail_hw = 0


def _core():
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    return cache_mod._core


def _in_buffer(holder: _Holder, t) -> bool:
    """Whether tensor t's memory lies inside the holder's tail buffer."""
    b = holder._free_tail
    if b is None:
        return False
    lo, hi = b.data_ptr(), b.data_ptr() + b.numel() * 8
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * 8 <= hi


def _span(holder: _Holder) -> tuple[int, int]:
    b = holder._free_tail
    return b.data_ptr(), b.data_ptr() + b.numel() * 8


def _release(core, holder, got, ref, values: list[int]) -> None:
    piece = torch.tensor(values, dtype=torch.int64)
    assert core.native_release(holder, got, [piece])
    ref.free(piece)
    assert got.free_pages.tolist() == ref.free_pages.tolist()
    assert got.available_size() == ref.available_size()


@pytest.mark.upstream
def test_short_list_copied_over_fresh_memory_in_place_over_written_memory():
    core = _core()
    # a pool larger than any spare block, so the first buffer is fresh memory
    n = max(core.tail_spares(), default=0) + 70000
    got, ref, holder = _sglang_token(n), _sglang_token(n), _Holder()
    a, b = got.alloc(1), ref.alloc(1)
    _release(core, holder, got, ref, a.tolist())  # a long list: a new buffer, fresh memory
    assert _in_buffer(holder, got.free_pages)
    taken = got.alloc(n - 100)
    assert taken.tolist() == ref.alloc(n - 100).tolist()
    kept = taken.tolist()
    assert _in_buffer(holder, got.free_pages)  # the short list: still the buffer's view
    first = _span(holder)
    _release(core, holder, got, ref, kept[:50])  # past the high-water mark: fresh pages
    # so not written there: copied (or, where an earlier test left one, in a written spare)
    p = got.free_pages.data_ptr()
    assert not first[0] <= p < first[1]
    assert taken.tolist() == kept  # nothing handed out changed
    # that buffer's block, written up to n slots, retires to the spares with the allocator
    del got, ref, holder, a, b, taken
    got, ref, holder = _sglang_token(n), _sglang_token(n), _Holder()
    taken = got.alloc(n - 100)
    assert taken.tolist() == ref.alloc(n - 100).tolist()
    kept = taken.tolist()
    # short, but a written spare block takes it: every block is written at least as far as
    # the long list it was made for (over 4096 slots) before it retires, so these short
    # releases (up to 410 slots) stay within written memory whichever spare is taken
    _release(core, holder, got, ref, kept[:50])
    assert _in_buffer(holder, got.free_pages)
    start, buf = got.free_pages.data_ptr(), holder._free_tail.data_ptr()
    for i in range(1, 4):  # then each short release is written in place, nothing copied
        _release(core, holder, got, ref, kept[50 * i:50 * (i + 1)])
        assert got.free_pages.data_ptr() == start and holder._free_tail.data_ptr() == buf
    got.alloc(120)
    ref.alloc(120)
    _release(core, holder, got, ref, kept[200:260])
    assert _in_buffer(holder, got.free_pages) and holder._free_tail.data_ptr() == buf
    assert taken.tolist() == kept
