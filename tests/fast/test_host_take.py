"""A backup's host pool alloc in C (fast/_core.c ``host_take``, fast/frees.py ``host_alloc``):
for sglang 0.5.13.post1's host pools it leaves the pool exactly as their ``alloc`` does (the
rest of the list, a view of the same memory from the same offset) and answers the slots as a
tensor of its own, the copy the backup makes of ``alloc``'s view; everything else is declined
with nothing done.  Over sglang's own pools: the upstream venv."""

from __future__ import annotations

import random
import sys
import threading

import pytest

torch = pytest.importorskip("torch")

from uniradix.fast import frees  # noqa: E402
from uniradix.fast.cache import _core  # noqa: E402

needs_core = pytest.mark.skipif(_core is None, reason="the C core is not built or not in use")


def _pools(ps: int = 1) -> dict:
    """sglang's host pools as the bench builds them: the KV host pool, the SWA one, the
    Mamba state one."""
    try:
        from uniradix.conformance.bench import configs, sglang_alloc
        parts = sglang_alloc.sglang_parts(
            configs.BenchConfig(components=("full", "swa", "mamba"), hicache="write_through"),
            1 << 12, ps)
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return {"kv": parts.host, "swa": parts.aux_host["swa"], "mamba": parts.aux_host["mamba"]}


def _twin(pool, cls=None):
    """Another pool over the same list (the bench's wrapper of ``free``, bound to ``pool``,
    left out: the twin frees with its class's own)."""
    cls = cls or type(pool)
    twin = cls.__new__(cls)
    twin.__dict__.update({k: v for k, v in pool.__dict__.items() if k != "free"})
    twin.lock = threading.RLock()
    return twin


def _unheld(lock) -> bool:
    """Whether another thread can take ``lock`` now (an RLock is re-entrant for its owner)."""
    got = []

    def take():
        ok = lock.acquire(False)
        got.append(ok)
        if ok:
            lock.release()
    t = threading.Thread(target=take)
    t.start()
    t.join()
    return got == [True]


def _state(pool) -> tuple:
    fs = pool.free_slots
    return (fs.tolist(), fs.storage_offset(), fs.untyped_storage().data_ptr(), fs.dtype)


def _by_python(pool, n):
    """The backup's way without the core: the pool's alloc, then a copy of a view."""
    got = pool.alloc(n)
    if got is not None and got._base is not None:
        got = got.clone()
    return got


@needs_core
@pytest.mark.parametrize("ps", [1, 16])
def test_host_take_leaves_each_pool_as_its_alloc_does(ps):
    rng = random.Random(ps)
    for name, pool in _pools(ps).items():
        step = pool.page_size
        assert frees.native_alloc_ok(type(pool)), name
        twin = _twin(pool)  # the same pool's list, to run the Python way
        for _ in range(60):
            n = step * rng.randrange(1, 9)
            if rng.random() < 0.3:  # a free between allocs: the list a fresh tensor
                back = torch.arange(10**6, 10**6 + step, dtype=torch.int64)
                pool.free(back)
                twin.free(back.clone())
            fs_before = pool.free_slots
            got = _core.host_take(pool, n)
            want = _by_python(twin, n)
            if want is None:
                assert got is None
                assert pool.free_slots is fs_before  # nothing taken
                continue
            assert got.tolist() == want.tolist() and got.dtype == torch.int64
            assert got._base is None  # a tensor of its own, not a view of the list
            assert got.untyped_storage().data_ptr() != fs_before.untyped_storage().data_ptr()
            # the rest of the list: as the Python slice leaves it, over the list's own memory
            assert pool.free_slots.tolist() == twin.free_slots.tolist()
            assert pool.free_slots.untyped_storage().data_ptr() == \
                fs_before.untyped_storage().data_ptr()
            assert pool.free_slots.storage_offset() == fs_before.storage_offset() + n
            assert _unheld(pool.lock)  # released


@needs_core
def test_host_take_declines_what_it_does_not_write_out():
    pools = _pools(16)
    pool = pools["kv"]
    before = _state(pool)
    # a size that is not a multiple of the page (alloc raises), not an int, not positive
    for n in (1, 17, True, 16.0, 0, -16, None):
        assert _core.host_take(pool, n) is NotImplemented, n
    assert _state(pool) == before
    with pytest.raises(AssertionError):
        frees.host_alloc(pool, 17)  # the pool's own call, its own error
    assert _state(pool) == before
    # the lock held by another thread: the pool's alloc would wait, this declines
    held, go = threading.Event(), threading.Event()

    def hold():
        with pool.lock:
            held.set()
            go.wait(5)
    t = threading.Thread(target=hold)
    t.start()
    held.wait(5)
    try:
        assert _core.host_take(pool, 16) is NotImplemented
        assert _state(pool) == before
    finally:
        go.set()
        t.join()
    # alloc set on the instance, a subclass, a list that is not a plain int64 tensor
    pool.alloc = lambda n: None
    try:
        assert _core.host_take(pool, 16) is NotImplemented
    finally:
        del pool.alloc
    sub = type("Sub", (type(pool),), {})
    assert not frees.native_alloc_ok(sub)
    twin = _twin(pool, sub)
    assert _core.host_take(twin, 16) is NotImplemented
    for odd in (pool.free_slots.to(torch.int32), pool.free_slots[::2], pool.free_slots.tolist()):
        twin = _twin(pool)
        twin.free_slots = odd
        assert _core.host_take(twin, 16) is NotImplemented
    assert _state(pool) == before
    assert _unheld(pool.lock)


@needs_core
def test_host_take_releases_the_lock_on_error_and_keeps_no_reference():
    pool = _pools(1)["kv"]
    twin = _twin(pool)
    del twin.free_slots
    with pytest.raises(AttributeError):
        _core.host_take(twin, 4)
    assert _unheld(twin.lock)  # released
    def run(k):
        for _ in range(k):
            got = _core.host_take(pool, 8)
            assert sys.getrefcount(got) == 2  # only this name (and getrefcount's argument)
            pool.free(got)
        return sys.getrefcount(pool.lock), sys.getrefcount(pool.free_slots), \
            sys.getrefcount(pool), sys.getrefcount(type(pool))
    run(50)  # warm (the frees' caches)
    assert run(200) == run(400)  # nothing grows with the calls


def test_native_alloc_ok_names_only_sglangs_host_pools():
    class Pool:
        def alloc(self, n):
            return None
    assert not frees.native_alloc_ok(Pool)
    assert not frees.native_alloc_ok(object)
    for pool in _pools(1).values():
        assert frees.native_alloc_ok(type(pool))


@needs_core
def test_host_take_at_the_edge_of_the_list():
    pool = _twin(_pools(16)["kv"])
    pool.free_slots = torch.arange(100, 132, dtype=torch.int64)  # two pages of 16
    assert _core.host_take(pool, 48) is None  # one page short: nothing taken
    assert pool.free_slots.tolist() == list(range(100, 132))
    assert _core.host_take(pool, 32).tolist() == list(range(100, 132))  # all of it
    assert pool.free_slots.tolist() == []
    assert _core.host_take(pool, 16) is None
    assert pool.alloc(16) is None  # as the pool's own
