"""MooncakeStore against a real `mooncake_master` on loopback, over TCP (skipped only where the
mooncake package does not import; `make test` installs it and the libibverbs1 it needs).

Stories: pages round-trip zero-copy in each host layout; the two traps upstream's Mooncake
backend falls into (a non-forced remove after reads removes nothing; `exists` asks about a name
no page is stored under); a master killed and restarted mid-run."""
from __future__ import annotations

import time

import pytest
import torch
from test_storage_backends import LAYOUTS, indices, make_pool, page_data

from uniradix.fast.storage import (
    Fault,
    FaultyBackend,
    MooncakeMaster,
    MooncakeStore,
    StorageInputError,
    mooncake_available,
)
from uniradix.kernels import Layout

_WHY = mooncake_available()
if _WHY is not None:
    pytest.skip(f"Mooncake is not usable here ({_WHY}); install the dev extra "
                "(mooncake-transfer-engine-non-cuda) and libibverbs1", allow_module_level=True)

SEGMENT = 64 << 20


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def client(master):
    store = MooncakeStore(master.address, global_segment_size=SEGMENT, namespace="t")
    yield store
    store.close()


@pytest.fixture
def store(client):
    client.clear()
    yield client
    client.clear()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_round_trip_zero_copy(store, layout, kind):
    src = make_pool(layout, kind, seed=1)
    store.register_mem_pool_host(src)
    keys = [f"{layout.value}-{kind}-{i}" for i in range(4)]
    assert store.batch_set_v1(keys, indices(src, [0, 5, 9, 15])) == [True] * 4
    assert store.batch_exists(keys + ["nope"] + keys) == 4
    want = {p: page_data(src, p).clone() for p in (0, 5, 9, 15)}
    # Read back into other pages of the same (registered) pool.
    assert store.batch_get_v1(keys[::-1], indices(src, [1, 2, 3, 4])) == [True] * 4
    for src_page, dst_page in zip([15, 9, 5, 0], [1, 2, 3, 4], strict=True):
        assert torch.equal(page_data(src, dst_page), want[src_page])
    assert store.batch_get_v1(["absent"], indices(src, [6])) == [False]


def test_tensor_get_and_set(store):
    pool = make_pool(Layout.PAGE_FIRST)
    store.register_mem_pool_host(pool)
    flat = pool.buffer[:, 4:8].flatten().clone()
    assert store.set("flat", flat) and store.exists("flat")
    out = torch.zeros_like(flat)
    assert store.get("flat", out) is out and torch.equal(out, flat)
    assert store.get("flat", torch.zeros(5, dtype=torch.float16)) is None
    assert store.get("missing", torch.zeros_like(flat)) is None
    # The generic path stores the page's bytes under the page's own name: a zero-copy read loads it.
    assert store.batch_get_v1(["flat"], indices(pool, [9])) == [True]
    assert torch.equal(pool.buffer[:, 36:40].flatten(), flat)


def test_trap_exists_checks_the_names_pages_are_stored_under(store):
    """Upstream's exists() asks about the bare key while pages live under suffixed names."""
    pool = make_pool(Layout.PAGE_FIRST_DIRECT)
    store.register_mem_pool_host(pool)
    assert store.batch_set_v1(["h1", "h2"], indices(pool, [0, 1])) == [True, True]
    assert store.exists("h1") and store.exists("h2") and not store.exists("h3")
    assert store.batch_exists(["h1", "h2", "h3"]) == 2


def test_trap_clear_right_after_reads_removes_everything(store):
    """Reads take a 10 s lease; a non-forced remove-all inside it removes nothing."""
    pool = make_pool(Layout.PAGE_FIRST)
    store.register_mem_pool_host(pool)
    keys = [f"c{i}" for i in range(6)]
    store.batch_set_v1(keys, indices(pool, range(6)))
    assert store.batch_get_v1(keys, indices(pool, range(6, 12))) == [True] * 6   # leases taken
    # What upstream's clear() does: remove_all() without force removes nothing now.
    raw = store._store
    assert raw.remove_all() == 0
    assert store.batch_exists(keys) == 6
    store.clear()
    assert store.batch_exists(keys) == 0 and not any(store.exists(k) for k in keys)
    assert store.batch_get_v1(keys[:1], indices(pool, [0])) == [False]


def test_clear_removes_only_its_namespace(master, store):
    other = MooncakeStore(master.address, global_segment_size=SEGMENT, namespace="other")
    try:
        pool = make_pool(Layout.PAGE_FIRST, page=1, pages=8, kind="mla")
        for s in (store, other):
            s.register_mem_pool_host(pool)
            assert s.batch_set_v1(["same-key"], indices(pool, [0])) == [True]
        store.clear()
        assert not store.exists("same-key") and other.exists("same-key")
    finally:
        other.clear()
        other.close()


def test_a_page_of_another_layout_is_never_loaded(store):
    a = make_pool(Layout.PAGE_FIRST)
    b = make_pool(Layout.LAYER_FIRST, seed=3)
    store.register_mem_pool_host(a)
    store.batch_set_v1(["x"], indices(a, [0]))
    store.register_mem_pool_host(b)
    before = b.buffer.clone()
    assert store.batch_exists(["x"]) == 0
    assert store.batch_get_v1(["x"], indices(b, [0])) == [False]
    assert torch.equal(b.buffer, before)


def test_bad_settings_and_input_are_refused(master, store):
    with pytest.raises(StorageInputError, match="protocol"):
        MooncakeStore(master.address, protocol="udp")
    with pytest.raises(StorageInputError, match="namespace"):
        MooncakeStore(master.address, namespace="a/b")
    with pytest.raises(StorageInputError, match="global_segment_size"):
        MooncakeStore(master.address, global_segment_size=0)
    pool = make_pool()
    store.register_mem_pool_host(pool)
    with pytest.raises(StorageInputError):
        store.batch_set_v1(["a"], torch.arange(3))
    assert store.batch_exists(["a"]) == 0


def test_short_reads_through_the_fault_wrapper_load_only_leading_pages(store):
    pool = make_pool(Layout.PAGE_FIRST)
    store.register_mem_pool_host(pool)
    f = FaultyBackend(store)
    f.register_mem_pool_host(pool)
    f.batch_set_v1(["s0", "s1", "s2"], indices(pool, [0, 1, 2]))
    before = page_data(pool, 9).clone()
    f.inject(Fault("get", "short", keep=2))
    assert f.batch_get_v1(["s0", "s1", "s2"], indices(pool, [7, 8, 9])) == [True, True, False]
    assert torch.equal(page_data(pool, 8), page_data(pool, 1))
    assert torch.equal(page_data(pool, 9), before)


def test_a_restarted_master_turns_pages_into_misses_then_works_again():
    with MooncakeMaster() as m:
        store = MooncakeStore(m.address, global_segment_size=SEGMENT, namespace="r")
        try:
            pool = make_pool(Layout.PAGE_FIRST, page=2, pages=16)
            store.register_mem_pool_host(pool)
            assert store.batch_set_v1(["a", "b"], indices(pool, [0, 1])) == [True, True]
            m.stop()
            # Master gone: failed sets and misses, no exceptions, no data written into the pool.
            assert store.batch_set_v1(["c"], indices(pool, [2])) == [False]
            assert store.batch_exists(["a", "b"]) == 0 and not store.exists("a")
            m.start()
            # The new master knows no objects: the old pages read as misses, never as stale data.
            before = pool.buffer.clone()
            assert store.batch_get_v1(["a"], indices(pool, [5])) == [False]
            assert torch.equal(pool.buffer, before)
            deadline = time.monotonic() + 15
            while store.batch_set_v1(["d"], indices(pool, [3])) != [True]:
                assert time.monotonic() < deadline, "the client did not come back after the restart"
                time.sleep(0.2)
            assert store.batch_get_v1(["d"], indices(pool, [6])) == [True]
            assert torch.equal(page_data(pool, 6), page_data(pool, 3))
            assert store.get_stats().failed_sets >= 1
        finally:
            store.close()
