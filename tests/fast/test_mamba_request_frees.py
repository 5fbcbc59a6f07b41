"""The Mamba plug-in's request-path frees (fast/components/mamba.py: an unfinished request's
state copy the tree did not take, a finished request's own state the tree did not take, the
lazy extra buffer's old track slot, the extra buffer's slots at a request's end) go through
fast/frees.py's ``release``: over sglang's own ``MambaSlotAllocator`` each is one native write
(an observing instance ``free`` is told once per batch and never called; without the C core,
one call of sglang's ``free`` per batch), and the free list ends exactly as sglang's own
``free`` of each piece in turn leaves a twin allocator.  Under a process-wide default device
(``with torch.device("meta")``) the slots freed are still the request's, on its buffer's
device: a slot read into a tensor of the default device would not reach a CPU (or, in
production, a CUDA) pool's free list."""

from __future__ import annotations

import contextlib
import types

import pytest

torch = pytest.importorskip("torch")

import uniradix.fast as fast  # noqa: E402
import uniradix.fast.cache as cache_mod  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

pytestmark = pytest.mark.upstream


def _slot_allocator_class():
    """sglang's ``MambaSlotAllocator``, or a skip where sglang does not import."""
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        load_upstream()
        from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return MambaSlotAllocator


def _observed(alloc):
    """An observing instance ``free`` on ``alloc`` (fast/frees.py: it keeps the native path):
    returns the slots it was called with and the piece counts of the batches it was told of."""
    calls: list = []
    batches: list = []
    own = type(alloc).free

    def free(index):
        calls.append(index.tolist())
        own(alloc, index)

    free.uniradix_on_batch = batches.append  # type: ignore[attr-defined]
    alloc.free = free
    return calls, batches


def _setup(**kw):
    """A Full + Mamba cache over sglang's ``MambaSlotAllocator`` (a request pool without
    sglang's ``free_mamba_cache``: the plug-in frees itself), and a twin allocator."""
    cls = _slot_allocator_class()
    states, twin = cls(16, "cpu"), cls(16, "cpu")
    pool = types.SimpleNamespace(mamba_allocator=states, mamba_pool=None)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=pool,
        token_to_kv_pool_allocator=PoolAllocator(PagedPool(64, 1), torch),
        page_size=1, tree_components=("full", "mamba"), **kw))
    return cache, states, twin


def _check(states, twin, calls, batches, pieces_per_batch):
    if cache_mod.NATIVE:
        assert calls == []  # sglang's free never ran: every free was a native write
        assert batches == pieces_per_batch
    else:  # UNIRADIX_PURE_PYTHON=1: the Python path, sglang's free once per batch
        assert len(calls) == len(pieces_per_batch) and batches == []
    assert states.free_slots.tolist() == twin.free_slots.tolist()


def test_unfinished_copy_and_finished_state_not_taken():
    cache, states, twin = _setup()
    calls, batches = _observed(states)
    copy, own = states.alloc(1), states.alloc(1)
    t_copy, t_own = twin.alloc(1), twin.alloc(1)
    # unfinished: the tree had a state there (mamba_exist), the copy goes back
    req = types.SimpleNamespace(mamba_pool_idx=own, mamba_last_track_seqlen=8)
    params = types.SimpleNamespace(mamba_value=copy.reshape(1).clone())
    cache.mamba.cleanup_caching_req(req, False, types.SimpleNamespace(mamba_exist=True), params)
    twin.free(t_copy.reshape(1))
    assert req.mamba_last_track_seqlen is None
    # finished: the tree had a state there, the request's own goes back
    cache.mamba.cleanup_caching_req(req, True, types.SimpleNamespace(mamba_exist=True), None)
    twin.free(t_own.reshape(1))
    assert req.mamba_pool_idx is None
    _check(states, twin, calls, batches, [1, 1])


def _device(meta: bool):
    """The calls under test inside ``torch.device("meta")`` (``meta``), or as they are."""
    return torch.device("meta") if meta else contextlib.nullcontext()


@pytest.mark.parametrize("meta", [False, True])
def test_extra_buffer_request_end_frees_in_one_batch(meta):
    cache, states, twin = _setup(enable_mamba_extra_buffer=True)
    calls, batches = _observed(states)
    own, a, b = (states.alloc(1) for _ in range(3))
    t_own, t_a, t_b = (twin.alloc(1) for _ in range(3))
    req = types.SimpleNamespace(mamba_pool_idx=own,
                                mamba_ping_pong_track_buffer=torch.tensor([int(a), int(b)]),
                                mamba_next_track_idx=0)
    # finished, the tree took no tracked state (mamba_exist): nothing kept, all three go back
    with _device(meta):
        cache.mamba.cleanup_caching_req(req, True, types.SimpleNamespace(mamba_exist=True), None)
    twin.free(t_own.reshape(1))
    twin.free(torch.cat([t_a, t_b]))
    assert req.mamba_pool_idx is None and req.mamba_ping_pong_track_buffer is None
    _check(states, twin, calls, batches, [2])


@pytest.mark.parametrize("meta", [False, True])
def test_lazy_track_point_frees_the_old_slot(meta):
    cache, states, twin = _setup(enable_mamba_extra_buffer=True,
                                 enable_mamba_extra_buffer_lazy=True)
    calls, batches = _observed(states)
    own, track = states.alloc(1), states.alloc(1)
    twin.alloc(1)
    t_track = twin.alloc(1)
    req = types.SimpleNamespace(mamba_pool_idx=own,
                                mamba_ping_pong_track_buffer=torch.tensor([int(track), -1]),
                                mamba_next_track_idx=0, mamba_last_track_seqlen=None)
    with _device(meta):
        assert cache.mamba.lazy_track_point(req, 8) is True
    fresh = twin.alloc(1)
    twin.free(t_track.reshape(1))
    assert req.mamba_ping_pong_track_buffer.tolist() == [-1, int(fresh)]
    _check(states, twin, calls, batches, [1])
