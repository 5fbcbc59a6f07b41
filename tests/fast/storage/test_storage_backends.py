"""Storage backends (uniradix.fast.storage): the page view of host pools, the file store, and
the fault-injecting wrapper.  Each story ends with the pool holding exactly what was stored, or
with a miss / a failed set: never wrong data."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from uniradix.fast.storage import (
    STORAGE_BATCH_SIZE,
    Fault,
    FaultyBackend,
    FileStore,
    InjectedStorageError,
    PageLayout,
    StorageInputError,
)
from uniradix.kernels import HostPool, KVGeometry, Layout

LAYOUTS = [Layout.LAYER_FIRST, Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT]


def make_pool(layout=Layout.PAGE_FIRST, kind="mha", page=4, pages=16, dtype=torch.float16, seed=0):
    g = (KVGeometry.mha(3, 2, 8, page, dtype) if kind == "mha" else KVGeometry.mla(3, 16, page, dtype))
    pool = HostPool.allocate(g, layout, pages * page, pin_memory=False)
    gen = torch.Generator().manual_seed(seed)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen).to(dtype))
    return pool


def page_slots(pool, page):
    P = pool.geometry.page_size
    return torch.arange(page * P, (page + 1) * P)


def page_data(pool, page):
    """Everything one page holds, gathered through the kernels' own addressing."""
    g = pool.geometry
    return torch.stack([pool.token_row(p, i, s) for p in range(g.planes) for i in range(g.layers)
                        for s in page_slots(pool, page).tolist()])


def indices(pool, pages):
    return torch.cat([page_slots(pool, p) for p in pages]) if pages else torch.empty(0, dtype=torch.int64)


# -- PageLayout --------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_page_regions_cover_exactly_the_pages_bytes(layout, kind):
    pool = make_pool(layout, kind)
    pl = PageLayout.of(pool)
    g = pool.geometry
    assert pl.page_bytes == g.token_bytes * g.page_size
    # Zero one page through its regions: exactly that page's rows become zero, no other byte moves.
    before = pool.buffer.clone()
    for v in pl.views(5):
        v[:] = 0
    assert bool((page_data(pool, 5) == 0).all())
    changed = (pool.buffer != before).reshape(-1).sum().item()
    assert changed <= g.token_bytes * g.page_size // g.dtype.itemsize
    for p in (4, 6):
        assert not bool((page_data(pool, p) == 0).all())


def test_page_layout_reads_an_upstream_style_host_pool():
    """Anything with kv_buffer, layout and page_size (upstream's MHATokenToKVPoolHost shape)."""
    class UpstreamLikePool:
        layout = "page_first_direct"
        page_size = 4
        kv_buffer = torch.zeros(2, 8, 3, 4, 2, 8, dtype=torch.bfloat16)
    pl = PageLayout.of(UpstreamLikePool())
    assert pl.pages == 8 and pl.page_bytes == 2 * 3 * 4 * 2 * 8 * 2
    assert pl.tag == "mha-page_first_direct-l3h2d8p4-bfloat16"


def test_page_layout_refuses_what_it_cannot_address():
    class PageHead:
        layout = "page_head"
        page_size = 4
        kv_buffer = torch.zeros(2, 8, 2, 4, 3, 8)
    with pytest.raises(StorageInputError, match="page_head"):
        PageLayout.of(PageHead())
    with pytest.raises(StorageInputError):
        PageLayout.of(object())
    pl = PageLayout.of(make_pool(page=4))
    with pytest.raises(StorageInputError, match="8 host indices"):
        pl.host_pages(torch.arange(4), 2)
    with pytest.raises(StorageInputError, match="whole pages"):
        pl.host_pages(torch.arange(2, 6), 1)
    with pytest.raises(StorageInputError, match="consecutive"):
        pl.host_pages(torch.tensor([0, 1, 3, 2]), 1)
    with pytest.raises(StorageInputError, match="whole pages"):
        pl.host_pages(torch.arange(64, 68), 1)          # past the pool's 16 pages
    assert pl.host_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 2) == [2, 0]
    with torch.device("meta"):  # a process-wide default device: host slots are CPU all the same
        assert pl.host_pages([8, 9, 10, 11, 0, 1, 2, 3], 2) == [2, 0]
        with pytest.raises(StorageInputError, match="consecutive"):
            pl.host_pages([0, 1, 3, 2], 1)


# -- FileStore: round trips ----------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_file_store_round_trips_pages_through_the_host_pool(tmp_path, layout, kind):
    src = make_pool(layout, kind, seed=1)
    store = FileStore(tmp_path / "pages")
    store.register_mem_pool_host(src)
    keys = [f"k{i}" for i in range(5)]
    assert store.batch_set_v1(keys, indices(src, [0, 3, 7, 8, 15])) == [True] * 5
    assert store.batch_exists(keys + ["absent", "k0"]) == 5

    dst = make_pool(layout, kind, seed=2)
    reader = FileStore(tmp_path / "pages")            # a fresh process: adopts the files
    reader.register_mem_pool_host(dst)
    assert reader.batch_get_v1(keys[::-1], indices(dst, [1, 2, 4, 5, 6])) == [True] * 5
    for src_page, dst_page in zip([15, 8, 7, 3, 0], [1, 2, 4, 5, 6], strict=True):
        assert torch.equal(page_data(dst, dst_page), page_data(src, src_page))
    untouched = make_pool(layout, kind, seed=2)
    assert torch.equal(page_data(dst, 9), page_data(untouched, 9))


def test_batches_longer_than_128_pages_go_through_in_chunks(tmp_path):
    pool = make_pool(page=1, pages=300, kind="mla")
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    keys = [f"p{i}" for i in range(STORAGE_BATCH_SIZE * 2 + 10)]
    assert all(store.batch_set_v1(keys, torch.arange(len(keys))))
    assert store.batch_exists(keys) == len(keys)


def test_tensor_get_and_set_serve_sglangs_generic_page_path(tmp_path):
    """SGLang's controller without interface_v1: set(key, flat page), get(key, dummy page)."""
    pool = make_pool(Layout.PAGE_FIRST)
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    flat = pool.buffer[:, 4:8].flatten()                # upstream's get_data_page(4) for page_first
    assert store.set("g", flat)
    out = torch.zeros_like(flat)
    assert store.get("g", out) is out and torch.equal(out, flat)
    # The same bytes are page 1 of the pool: a zero-copy read of the key fills a page with them.
    dst = make_pool(Layout.PAGE_FIRST, seed=9)
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(["g"], indices(dst, [2])) == [True]
    assert torch.equal(page_data(dst, 2), page_data(pool, 1))
    assert store.get("g", torch.zeros(3, dtype=torch.float16)) is None  # other size: a miss
    # A pool of another layout (same page size in bytes, other byte order) never reads it.
    other = make_pool(Layout.LAYER_FIRST)
    store.register_mem_pool_host(other)
    assert store.get("g", torch.zeros_like(flat)) is None and store.batch_exists(["g"]) == 0
    assert store.batch_get_v1(["g"], indices(other, [0])) == [False]
    store.register_mem_pool_host(dst)
    assert store.batch_get(["g", "nope"], [torch.zeros_like(flat), torch.zeros_like(flat)])[1] is None
    assert store.batch_set(["a", "b"], [flat, flat]) and store.exists("a")


def test_a_page_of_another_geometry_is_never_loaded(tmp_path):
    a = make_pool(Layout.PAGE_FIRST, "mha")
    b = make_pool(Layout.PAGE_FIRST_DIRECT, "mha", seed=5)   # same page size in bytes, other layout
    store = FileStore(tmp_path)
    store.register_mem_pool_host(a)
    assert store.batch_set_v1(["x"], indices(a, [0])) == [True]
    store.register_mem_pool_host(b)
    before = b.buffer.clone()
    assert store.batch_get_v1(["x"], indices(b, [0])) == [False]
    assert torch.equal(b.buffer, before)
    assert store.batch_exists(["x"]) == 0


def test_set_of_a_stored_key_keeps_it(tmp_path):
    pool = make_pool()
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    store.batch_set_v1(["k"], indices(pool, [0]))
    mtime = os.stat(store._path("k")).st_mtime_ns
    assert store.batch_set_v1(["k"], indices(pool, [1])) == [True]      # content keys: no rewrite
    assert os.stat(store._path("k")).st_mtime_ns == mtime


def test_any_str_key_is_accepted_and_kept_apart(tmp_path):
    pool = make_pool(page=1, pages=8, kind="mla")
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    keys = ["tenant-a/" + "0" * 64, "tenant-b/" + "0" * 64, "../../etc/passwd", "é\x00\n", ""]
    assert store.batch_set_v1(keys, torch.arange(5)) == [True] * 5
    assert sorted(os.listdir(tmp_path)) == sorted(store._digest(k) + ".urxp" for k in keys)
    dst = make_pool(page=1, pages=8, kind="mla", seed=3)
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(keys, torch.arange(3, 8)) == [True] * 5
    for i in range(5):
        assert torch.equal(page_data(dst, 3 + i), page_data(pool, i))


def test_bad_input_changes_nothing(tmp_path):
    pool = make_pool()
    store = FileStore(tmp_path)
    with pytest.raises(StorageInputError, match="register_mem_pool_host"):
        store.batch_set_v1(["a"], indices(pool, [0]))
    store.register_mem_pool_host(pool)
    with pytest.raises(StorageInputError):
        store.batch_set_v1(["a", 7], indices(pool, [0, 1]))
    with pytest.raises(StorageInputError):
        store.batch_set_v1("ab", indices(pool, [0, 1]))
    with pytest.raises(StorageInputError):
        store.batch_set_v1(["a", "b"], indices(pool, [0]))
    with pytest.raises(StorageInputError):
        store.set("a", None)
    with pytest.raises(StorageInputError):
        FileStore(tmp_path, capacity_bytes=0)
    with pytest.raises(StorageInputError):
        FileStore(tmp_path, fsync="yes")
    assert os.listdir(tmp_path) == [] and len(store) == 0


# -- FileStore: what upstream's HiCacheFile lacks ---------------------------------------------------
def test_clear_removes_only_the_stores_own_files(tmp_path):
    pool = make_pool()
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "model.bin").write_bytes(b"\0" * 10)
    (tmp_path / "sub").mkdir()
    store.batch_set_v1(["a", "b"], indices(pool, [0, 1]))
    store.clear()
    assert sorted(os.listdir(tmp_path)) == ["model.bin", "notes.txt", "sub"]
    assert store.batch_exists(["a"]) == 0 and store.used_bytes == 0


def test_capacity_evicts_the_least_recently_used_pages(tmp_path):
    pool = make_pool(page=1, pages=16, kind="mla")
    probe = FileStore(tmp_path / "probe")
    probe.register_mem_pool_host(pool)
    probe.batch_set_v1(["p"], torch.arange(1))
    file_bytes = probe.used_bytes
    store = FileStore(tmp_path / "s", capacity_bytes=3 * file_bytes + file_bytes // 2)
    store.register_mem_pool_host(pool)
    store.batch_set_v1(["a", "b", "c"], torch.arange(3))
    assert store.batch_get_v1(["a"], torch.arange(5, 6)) == [True]        # a is now most recent
    store.batch_set_v1(["d"], torch.arange(3, 4))                          # evicts b, the oldest
    assert [store.exists(k) for k in "abcd"] == [True, False, True, True]
    assert store.keys_lru() == ["c", "a", "d"]
    assert store.used_bytes == 3 * file_bytes <= store.capacity_bytes
    assert len(os.listdir(tmp_path / "s")) == 3
    assert store.get_stats().evicted_pages == 1
    # A restarted store adopts the files and keeps the bound.
    again = FileStore(tmp_path / "s", capacity_bytes=2 * file_bytes)
    assert len(again) == 2 and again.used_bytes == 2 * file_bytes


def test_a_page_larger_than_the_capacity_is_a_failed_set(tmp_path):
    pool = make_pool()
    store = FileStore(tmp_path, capacity_bytes=100)
    store.register_mem_pool_host(pool)
    assert store.batch_set_v1(["big"], indices(pool, [0])) == [False]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "flip_header", "append", "empty", "swap"])
def test_a_torn_or_corrupt_file_reads_as_a_miss_and_is_never_loaded(tmp_path, damage):
    pool = make_pool(Layout.LAYER_FIRST)
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    store.batch_set_v1(["a", "b"], indices(pool, [0, 1]))
    path = store._path("a")
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip_payload":
        data[-7] ^= 0x10
    elif damage == "flip_header":
        data[9] ^= 0x01
    elif damage == "append":
        data += b"\0"
    elif damage == "empty":
        data = bytearray()
    else:                                   # another key's valid file under this key's name
        data = bytearray(open(store._path("b"), "rb").read())
    open(path, "wb").write(bytes(data))
    dst = make_pool(Layout.LAYER_FIRST, seed=4)
    before = dst.buffer.clone()
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(["a"], indices(dst, [3])) == [False]
    assert torch.equal(dst.buffer, before)
    assert not os.path.exists(path) and not store.exists("a")
    assert store.get_stats().corrupt_pages == 1
    assert store.batch_get_v1(["b"], indices(dst, [3])) == [True]      # the neighbour is intact


def test_a_crashed_writers_temporary_file_is_never_a_page(tmp_path):
    pool = make_pool()
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    tmp = tmp_path / f".{store._digest('a')}.urxp.{'0' * 32}.tmp"
    tmp.write_bytes(b"URXPAGE\x01 half a page")
    assert not store.exists("a")
    FileStore(tmp_path)                      # a restart sweeps it
    assert not tmp.exists()


def test_concurrent_writers_and_readers_never_see_half_a_page(tmp_path):
    pool = make_pool(Layout.PAGE_FIRST, page=2, pages=64)
    store = FileStore(tmp_path, capacity_bytes=40 * PageLayout.of(pool).page_bytes)
    store.register_mem_pool_host(pool)
    expect = {f"k{i}": page_data(pool, i).clone() for i in range(32)}
    errors: list[str] = []

    def writer(offset):
        for _r in range(3):
            for i in range(offset, 32, 4):
                store.batch_set_v1([f"k{i}"], indices(pool, [i]))

    def reader(slot):
        for _r in range(30):
            for i in range(32):
                if store.batch_get_v1([f"k{i}"], indices(pool, [32 + slot])) == [True]:
                    if not torch.equal(page_data(pool, 32 + slot), expect[f"k{i}"]):
                        errors.append(f"k{i} read wrong data")

    threads = [threading.Thread(target=writer, args=(o,)) for o in range(4)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.used_bytes == sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path))
    assert store.used_bytes <= store.capacity_bytes


# -- FaultyBackend ---------------------------------------------------------------------------------
@pytest.fixture
def faulty(tmp_path):
    pool = make_pool(Layout.PAGE_FIRST)
    f = FaultyBackend(FileStore(tmp_path))
    f.register_mem_pool_host(pool)
    assert f.batch_set_v1(["a", "b", "c"], indices(pool, [0, 1, 2])) == [True] * 3
    return f, pool


def test_a_failing_backend_reports_misses_and_failed_sets(faulty):
    f, pool = faulty
    f.inject(Fault("get", "fail"))
    before = pool.buffer.clone()
    assert f.batch_get_v1(["a", "b"], indices(pool, [5, 6])) == [False, False]
    assert torch.equal(pool.buffer, before)
    assert f.batch_get_v1(["a"], indices(pool, [5])) == [True]           # the fault was used up
    f.inject(Fault("set", "fail", times=2))
    assert f.batch_set_v1(["d"], indices(pool, [3])) == [False]
    assert not f.set("e", pool.buffer[:, :4].flatten())
    assert f.batch_set_v1(["d"], indices(pool, [3])) == [True]
    f.inject(Fault("exists", "fail", times=-1))
    assert f.batch_exists(["a", "b"]) == 0 and not f.exists("a")
    f.clear_faults()
    assert f.batch_exists(["a", "b", "d"]) == 3


def test_a_raising_backend_raises_the_injected_error(faulty):
    f, pool = faulty
    f.inject(Fault("any", "raise"))
    with pytest.raises(InjectedStorageError):
        f.batch_exists(["a"])
    assert f.batch_exists(["a"]) == 1


def test_a_backend_that_times_out_reports_failure_after_the_delay(faulty):
    import time
    f, pool = faulty
    f.inject(Fault("get", "timeout", delay_s=0.05))
    t = time.perf_counter()
    assert f.batch_get_v1(["a"], indices(pool, [5])) == [False]
    assert time.perf_counter() - t >= 0.05
    f.inject(Fault("get", "slow", delay_s=0.01))
    assert f.batch_get_v1(["a"], indices(pool, [5])) == [True]


def test_a_short_read_loads_only_the_leading_pages(faulty):
    f, pool = faulty
    want = [page_data(pool, p).clone() for p in (0, 1, 2)]
    before_7 = page_data(pool, 7).clone()
    f.inject(Fault("get", "short", keep=2))
    assert f.batch_get_v1(["a", "b", "c"], indices(pool, [5, 6, 7])) == [True, True, False]
    assert torch.equal(page_data(pool, 5), want[0]) and torch.equal(page_data(pool, 6), want[1])
    assert torch.equal(page_data(pool, 7), before_7)
    f.inject(Fault("exists", "short", keep=1))
    assert f.batch_exists(["a", "b", "c"]) == 1
    f.inject(Fault("set", "short", keep=1))
    assert f.batch_set_v1(["x", "y"], indices(pool, [8, 9])) == [True, False]
    assert f.batch_exists(["x", "y"]) == 1
    assert [c[2] for c in f.calls[-4:]] == ["short", "short", "short", None]


def test_fault_settings_are_checked():
    with pytest.raises(StorageInputError, match="op"):
        Fault("read", "fail")
    with pytest.raises(StorageInputError, match="kind"):
        Fault("get", "explode")
    with pytest.raises(StorageInputError, match="times"):
        Fault("get", "fail", times=0)


# -- the throughput script ---------------------------------------------------------------------------
def test_bench_script_measures_the_file_store(tmp_path, capsys):
    from uniradix.fast.storage import bench
    out = tmp_path / "b.json"
    assert bench.main(["--backends", "file", "--pages", "6", "--page-size", "2", "--layers", "1",
                       "--heads", "1", "--head-dim", "8", "--repeat", "1", "--warmup", "0",
                       "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    import json
    res = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in res] == ["file"] and res[0]["get_pages_per_s"] > 0
    assert "set pages/s" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--backends", "tape"])


def test_a_write_the_os_takes_in_parts_still_stores_the_whole_page(tmp_path, monkeypatch):
    from uniradix.fast.storage import file_store
    pool = make_pool(Layout.LAYER_FIRST)
    store = FileStore(tmp_path)
    store.register_mem_pool_host(pool)
    monkeypatch.setattr(file_store.os, "writev", lambda fd, bufs: os.write(fd, bytes(bufs[0][:10])))
    assert store.batch_set_v1(["p"], indices(pool, [2])) == [True]
    monkeypatch.undo()
    dst = make_pool(Layout.LAYER_FIRST, seed=8)
    store.register_mem_pool_host(dst)
    assert store.batch_get_v1(["p"], indices(dst, [0])) == [True]
    assert torch.equal(page_data(dst, 0), page_data(pool, 2))
