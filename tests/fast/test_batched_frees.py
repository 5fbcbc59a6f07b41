"""Batched frees (fast/frees.py): what one cache call releases goes back in fewer allocator
calls, and every allocator ends with exactly the free list that one call per freed piece (the
reference, which is also what upstream does) leaves, on the Full path (C core and Python),
hybrid SWA and Mamba, and the host tier; with sglang's own allocators where sglang imports."""

import dataclasses
import random

import pytest

torch = pytest.importorskip("torch")

import uniradix.fast.cache as cache_mod  # noqa: E402
from uniradix.conformance.bench import host as bench_host  # noqa: E402
from uniradix.conformance.bench import hybrid as bench_hybrid  # noqa: E402
from uniradix.conformance.bench import loop as bench  # noqa: E402
from uniradix.conformance.env.workload import SharedPrefix  # noqa: E402
from uniradix.fast import frees  # noqa: E402

SMALL = SharedPrefix(requests=400, prompts=12, prompt_min=20, prompt_max=200, kv_slots=2048,
                     inflight=6)


def small(page_size: int) -> bench.BenchWorkload:
    return bench.shared_prefix_workload(page_size, base=SMALL)


@pytest.fixture
def per_piece(monkeypatch):
    """The reference: every allocator freed one piece per call, as before batching."""
    def use():
        monkeypatch.setattr(frees, "free_order", lambda alloc, method="free": frees.PER_CALL)
    return use


def free_list(alloc) -> list:
    """A FreeListAllocator's free slots in the order it hands them out."""
    return torch.cat([alloc._free] + alloc._released).tolist()


class SortedPagesAllocator:
    """A paged allocator with the semantics of sglang's ``PagedTokenToKVPoolAllocator`` (one
    free puts the sorted distinct pages of what it is given in front of the free list), so a
    batch would reorder it: it declares nothing and gets one call per piece."""

    def __init__(self, usable_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.device = torch.device("cpu")
        self.pages = torch.arange(1, usable_slots // page_size + 1, dtype=torch.int64)
        self.calls = 0

    def available_size(self) -> int:
        return len(self.pages) * self.page_size

    def alloc(self, need_size: int):
        n = need_size // self.page_size
        if n > len(self.pages):
            return None
        taken, self.pages = self.pages[:n], self.pages[n:]
        return (taken[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, free_index) -> None:
        if free_index.numel():
            self.calls += 1
            self.pages = torch.cat((torch.unique(free_index // self.page_size), self.pages))


class AppendAllocator(SortedPagesAllocator):
    """sglang's page-1 semantics: freed slots appended in order."""

    uniradix_free_order = frees.APPEND

    def __init__(self, usable_slots: int) -> None:
        super().__init__(usable_slots, 1)

    def free(self, free_index) -> None:
        if free_index.numel():
            self.calls += 1
            self.pages = torch.cat((self.pages, free_index))


# ----------------------------------------------------------------------------------------------
# fast/frees.py on its own
# ----------------------------------------------------------------------------------------------


def test_free_order_of_allocators():
    class Unknown:
        def free(self, x):
            pass

    assert frees.free_order(Unknown()) == frees.PER_CALL
    assert frees.free_order(AppendAllocator(8)) == frees.APPEND
    assert frees.free_order(SortedPagesAllocator(64, 4)) == frees.PER_CALL
    grouped = Unknown()
    grouped.is_not_in_free_group = False  # inside free_group_begin .. free_group_end
    assert frees.free_order(grouped) == frees.APPEND
    assert frees.free_order(bench.FreeListAllocator(64, 4, torch)) == frees.QUEUE
    # (its SWA twin reads and writes the map each call: one call of a concatenation)
    swa = bench_hybrid.SwaFreeListAllocator(64, 32, 4, torch)
    assert frees.free_order(swa) == frees.APPEND


def test_one_piece_is_one_free_call_without_asking_the_order(monkeypatch):
    """One piece: one ``free`` call, whatever the order; ``free_order`` is not consulted."""
    def no_order(alloc, method="free"):
        raise AssertionError("free_order asked for one piece")

    monkeypatch.setattr(frees, "free_order", no_order)
    for alloc, ref in ((AppendAllocator(8), AppendAllocator(8)),
                       (SortedPagesAllocator(64, 4), SortedPagesAllocator(64, 4))):
        piece = alloc.alloc(8)[[4, 5, 6, 7, 0, 1, 2, 3]]
        ref.free(ref.alloc(8)[[4, 5, 6, 7, 0, 1, 2, 3]])
        assert frees.release(alloc, [piece]) == 1
        assert alloc.calls == 1 and torch.equal(alloc.pages, ref.pages)
        # one range of a value: the same
        value = torch.cat([torch.tensor([99, 98]), alloc.alloc(8)[[4, 5, 6, 7, 0, 1, 2, 3]]])
        ref.free(ref.alloc(8)[[4, 5, 6, 7, 0, 1, 2, 3]])
        assert frees.release_ranges(alloc, value, [2, 10]) == 1
        assert alloc.calls == 2 and torch.equal(alloc.pages, ref.pages)
    with pytest.raises(AssertionError):
        frees.release(AppendAllocator(8), [torch.tensor([1]), torch.tensor([2])])


@pytest.mark.parametrize("seed", range(20))
def test_release_leaves_the_free_list_of_one_call_per_piece(seed):
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    pages = list(range(1, 41))
    rng.shuffle(pages)
    pieces, i = [], 0
    while i < len(pages):
        k = rng.randint(1, 4)
        slots = [p * ps + j for p in pages[i: i + k] for j in range(ps)]
        pieces.append(torch.tensor(slots, dtype=torch.int64))
        i += k
    for make in (lambda: SortedPagesAllocator(64 * ps, ps), lambda: AppendAllocator(64 * ps)):
        batched, ref = make(), make()
        batched.pages = ref.pages = torch.tensor([], dtype=torch.int64)
        calls = frees.release(batched, pieces)
        for p in pieces:
            ref.free(p)
        assert batched.pages.tolist() == ref.pages.tolist()
        assert calls == batched.calls <= ref.calls == len(pieces)
        if isinstance(batched, AppendAllocator) and len(pieces) > 1:
            assert batched.calls == 1


class QueueAllocator(AppendAllocator):
    """QUEUE: APPEND's semantics, and each call keeps the tensor it is given (a queue merged
    later), so copying long pieces into one would cost more than a call each."""

    uniradix_free_order = frees.QUEUE

    def __init__(self, usable_slots: int) -> None:
        super().__init__(usable_slots)
        self.given: list = []

    def free(self, free_index) -> None:
        if free_index.numel():
            self.given.append(free_index)
        super().free(free_index)


@pytest.mark.parametrize("length", [frees.QUEUE_JOIN_MAX // 4, frees.QUEUE_JOIN_MAX + 8])
def test_queue_frees_long_pieces_each_and_joins_short_ones(length):
    """Under QUEUE the free list ends as one call per piece leaves it either way; pieces over
    QUEUE_JOIN_MAX slots on average go each with a call of its own, as they are (no copy),
    shorter ones as one concatenation; release_ranges still frees adjacent ranges as one."""
    pieces = [torch.arange(i * length, (i + 1) * length, dtype=torch.int64) for i in range(4)]
    batched, ref = QueueAllocator(8), QueueAllocator(8)
    calls = frees.release(batched, pieces)
    for p in pieces:
        ref.free(p)
    assert batched.pages.tolist() == ref.pages.tolist()
    long = length > frees.QUEUE_JOIN_MAX
    assert calls == batched.calls == (4 if long else 1)
    if long:
        assert all(g is p for g, p in zip(batched.given, pieces, strict=True))
    value = torch.arange(4 * length, dtype=torch.int64)
    ranges = QueueAllocator(8)
    bounds = [0, length, length, 2 * length, 3 * length, 4 * length]
    assert frees.release_ranges(ranges, value, bounds) == (2 if long else 1)
    assert ranges.pages.tolist()[-3 * length:] == (value[:2 * length].tolist()
                                                   + value[3 * length:].tolist())


@pytest.mark.parametrize("native", [True, False], ids=["c-core", "python"])
@pytest.mark.parametrize("leaf", [8, frees.QUEUE_JOIN_MAX + 16])
def test_full_evict_over_a_queue_frees_long_leaves_without_a_copy(leaf, native, monkeypatch):
    """The Full cache's evict over a QUEUE allocator: long leaves go back one call each, as
    views of the leaves' slots (the C core does not join them into one new tensor), short
    leaves in one call; the free list is the one a call per leaf leaves."""
    import uniradix.fast as fast
    if native and not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    if not native:
        monkeypatch.setattr(cache_mod, "NATIVE", False)
    alloc = QueueAllocator(16 * leaf)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1))
    if not native:
        cache.evict = cache._evict_py_api  # the Python reference path (as _full_run)
    leaves = []
    for r in range(5):
        slots = alloc.alloc(leaf)
        leaves.append(slots.tolist())
        key = fast.RadixKey([1000 * (r + 1) + t for t in range(leaf)])
        cache.insert(fast.InsertParams(key=key, value=slots))
    before = alloc.pages.tolist()
    alloc.calls, alloc.given = 0, []
    cache.evict(fast.EvictParams(num_tokens=3 * leaf))
    freed = [t for g in alloc.given for t in g.tolist()]
    assert freed == [t for lv in leaves[:3] for t in lv]  # oldest first, in order
    assert alloc.pages.tolist() == before + freed
    long = leaf > frees.QUEUE_JOIN_MAX
    assert alloc.calls == (3 if long else 1)
    if long and native:  # views of the leaves' own memory, not one joined copy
        ptrs = {g.untyped_storage().data_ptr() for g in alloc.given}
        assert len(ptrs) == 3


class PagedState:
    """The state fast/frees.py's PAGED batch writes: sglang's paged allocator's two lists."""

    def __init__(self, page_size: int, need_sort: bool, free_pages, release_pages) -> None:
        self.page_size, self.need_sort = page_size, need_sort
        self.free_pages = torch.tensor(free_pages, dtype=torch.int64)
        self.release_pages = torch.tensor(release_pages, dtype=torch.int64)

    def lists(self) -> tuple[list, list]:
        return self.free_pages.tolist(), self.release_pages.tolist()


def sorted_prepend_reference(state: PagedState, pieces) -> tuple[list, list]:
    """One sorted-prepend free per piece, in plain Python (the semantics of sglang 0.5.13.post1's
    PagedTokenToKVPoolAllocator.free outside a free group)."""
    free, rel = state.lists()
    for p in pieces:
        if p.numel():
            front = sorted({s // state.page_size for s in p.tolist()})
            if state.need_sort:
                rel = front + rel
            else:
                free = front + free
    return free, rel


def random_pieces(rng: random.Random, ps: int) -> list:
    """Pieces as caches free them (whole pages, shuffled, in any order) and as they should
    never arrive but must still be exact (partial pages, a page in two pieces, repeats,
    empties, slot 0's page)."""
    pieces = []
    for _ in range(rng.randint(1, 7)):
        kind = rng.random()
        if kind < 0.1:
            slots = []
        elif kind < 0.6:
            pages = rng.sample(range(0, 60), rng.randint(1, 6))
            slots = [pg * ps + j for pg in pages for j in range(ps)]
        else:
            slots = [rng.randrange(0, 60 * ps) for _ in range(rng.randint(1, 3 * ps))]
        pieces.append(torch.tensor(slots, dtype=torch.int64))
    return pieces


@pytest.mark.parametrize("path", ["c-core", "torch"])
@pytest.mark.parametrize("seed", range(30))
def test_paged_release_equals_one_sorted_prepend_per_piece(seed, path, monkeypatch):
    if path == "c-core" and frees._native_core() is None:
        pytest.skip("the C core is not built")
    if path == "torch":
        monkeypatch.setattr(frees, "_native_core", lambda: None)
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 16])
    state = PagedState(ps, rng.random() < 0.5, rng.sample(range(60, 90), 5),
                       rng.sample(range(90, 99), 3))
    pieces = random_pieces(rng, ps)
    if rng.random() < 0.3:  # a non-contiguous piece: the C core is skipped, still exact
        pieces.append(torch.arange(0, 8 * ps, dtype=torch.int64)[::2])
    want = sorted_prepend_reference(state, pieces)
    assert frees.paged_release(state, pieces) is True
    assert state.lists() == want


def test_paged_release_refuses_what_it_cannot_write_exactly():
    state = PagedState(4, False, [9], [])
    for pieces in ([torch.tensor([4, 5], dtype=torch.int32)],  # not int64
                   [torch.tensor([[4, 5]], dtype=torch.int64)]):  # not 1-D
        assert frees.paged_release(state, pieces) is False
        assert state.lists() == ([9], [])


def test_paged_front_native_rejects_bad_input():
    core = frees._native_core()
    if core is None:
        pytest.skip("the C core is not built")
    with pytest.raises(ValueError):
        core.paged_front([torch.tensor([1], dtype=torch.int64)], 0)
    with pytest.raises(TypeError):
        core.paged_front((torch.tensor([1], dtype=torch.int64),), 4)
    assert bytes(core.paged_front([torch.tensor([], dtype=torch.int64)], 4)) == b""


def _odd_pieces(rng: random.Random, ps: int, count: int, min_mixed: int) -> list:
    """Pieces whose slots leave a page and come back to it, run backwards, go below 0, or sit
    at the top of int64 (where a page's slot range would overflow), or are whole pages in
    order (a tree node's slots)."""
    top = 2 ** 63 - 1
    pieces = []
    for _ in range(count):
        kind = rng.choice(["run", "mixed", "negative", "top"])
        if kind == "run":
            start = rng.randrange(0, 50) * ps
            vals = list(range(start, start + ps * rng.randint(1, 4)))
        elif kind == "mixed":
            vals = [rng.randrange(0, 8 * ps) for _ in range(rng.randint(min_mixed, 20))]
        elif kind == "negative":
            vals = [rng.randrange(-5 * ps, 5 * ps) for _ in range(rng.randint(1, 12))]
        else:
            vals = [top - rng.randrange(0, 3 * ps) for _ in range(rng.randint(1, 8))]
        pieces.append(torch.tensor(vals, dtype=torch.int64))
    return pieces


def _front_reference(pieces: list, ps: int) -> list:
    """What one free() per piece puts in front of a paged list: the last piece's pages first,
    each piece's sorted and once."""
    want: list = []
    for piece in reversed(pieces):
        want += sorted({v // ps for v in piece.tolist()})
    return want


@pytest.mark.parametrize("seed", range(12))
def test_paged_front_native_takes_each_pieces_pages_once_in_order(seed):
    """``paged_front`` (the paged frees' page ids: the pieces last first, each piece's pages
    sorted and once) against the floor divisions it stands for, on pieces whose slots leave a
    page and come back to it, run backwards, go below 0, or sit at the top of int64 (where a
    page's slot range would overflow)."""
    core = frees._native_core()
    if core is None:
        pytest.skip("the C core is not built")
    rng = random.Random(seed)
    ps = rng.choice([1, 3, 4, 16])
    pieces = _odd_pieces(rng, ps, rng.randint(1, 5), min_mixed=0)
    want = _front_reference(pieces, ps)
    got = torch.frombuffer(bytearray(core.paged_front(pieces, ps)), dtype=torch.int64).tolist()
    assert got == want, (ps, [p.tolist() for p in pieces])


def _blocky_piece(rng: random.Random, ps: int) -> list:
    """One piece of a node-like shape with the cases a whole-page block test must not get
    wrong: whole pages in order (in any page order, pages repeated), one slot of such a block
    moved to another page or swapped within it, partial pages, and runs that start mid-page
    (so a block check lands on slots that are not a page's first)."""
    vals: list = []
    for _ in range(rng.randint(1, 8)):
        page = rng.randrange(0, 12)
        block = list(range(page * ps, page * ps + ps))
        kind = rng.choice(["page", "page", "page", "moved", "swapped", "partial", "shifted"])
        if kind == "moved":
            block[rng.randrange(ps)] = rng.randrange(0, 12 * ps)
        elif kind == "swapped" and ps > 1:
            a, b = rng.sample(range(ps), 2)
            block[a], block[b] = block[b], block[a]
        elif kind == "partial":
            block = block[:rng.randint(1, ps)]
        elif kind == "shifted":
            start = page * ps + rng.randrange(1, ps) if ps > 1 else page
            block = list(range(start, start + ps * rng.randint(1, 2)))
        vals += block
    return vals


@pytest.mark.parametrize("seed", range(40))
def test_paged_front_native_whole_page_blocks(seed):
    """``paged_front`` takes a block that is exactly one page in order in one step; pieces
    made of such blocks mixed with near misses give the same pages as a floor division per
    slot."""
    core = frees._native_core()
    if core is None:
        pytest.skip("the C core is not built")
    rng = random.Random(seed)
    ps = rng.choice([2, 4, 16])
    pieces = [torch.tensor(_blocky_piece(rng, ps), dtype=torch.int64)
              for _ in range(rng.randint(1, 4))]
    want = _front_reference(pieces, ps)
    got = torch.frombuffer(bytearray(core.paged_front(pieces, ps)), dtype=torch.int64).tolist()
    assert got == want, (ps, [p.tolist() for p in pieces])


@pytest.mark.parametrize("shape", ["random", "few", "equal", "descending", "ascending",
                                   "organ", "two"])
def test_paged_front_native_sorts_long_unsorted_pieces(shape):
    """A piece's pages are sorted and made distinct: long pieces in the orders
    that trouble a quicksort (equal, few distinct, descending, organ pipe, two values) give
    the sorted distinct pages of a floor division per slot."""
    core = frees._native_core()
    if core is None:
        pytest.skip("the C core is not built")
    rng = random.Random(shape)
    for n in (17, 33, 1000, 5000):
        pages = {"random": [rng.randrange(0, 10 ** 6) for _ in range(n)],
                 "few": [rng.randrange(0, 7) for _ in range(n)],
                 "equal": [42] * n,
                 "descending": list(range(n, 0, -1)),
                 "ascending": list(range(n)),
                 "organ": list(range(n // 2)) + list(range(n // 2, 0, -1)),
                 "two": [rng.choice([3, 9]) for _ in range(n)]}[shape]
        for ps in (1, 16):
            slots = [pg * ps + rng.randrange(ps) for pg in pages]
            pieces = [torch.tensor(slots, dtype=torch.int64), torch.tensor([5, 1], dtype=torch.int64)]
            got = torch.frombuffer(bytearray(core.paged_front(pieces, ps)),
                                   dtype=torch.int64).tolist()
            assert got == _front_reference(pieces, ps), (shape, n, ps)


@pytest.mark.parametrize("seed", range(10))
def test_release_ranges_frees_one_range_per_node(seed):
    """The insert's duplicates: under APPEND one call (adjacent ranges joined as one slice);
    under per-call semantics each node's range is its own call, as upstream frees them."""
    rng = random.Random(seed)
    ps = rng.choice([1, 4])
    value = torch.arange(100 * ps, dtype=torch.int64) + ps
    bounds, pos = [], 0
    for _ in range(rng.randint(1, 6)):
        lo = pos + rng.choice([0, 0, ps])
        hi = lo + ps * rng.randint(1, 3)
        bounds += [lo, hi]
        pos = hi
    ranges = [(bounds[i], bounds[i + 1]) for i in range(0, len(bounds), 2)]
    for make in (lambda: SortedPagesAllocator(512 * ps, ps), lambda: AppendAllocator(512)):
        got, ref = make(), make()
        calls = frees.release_ranges(got, value, bounds)
        for lo, hi in ranges:
            ref.free(value[lo:hi])
        assert got.pages.tolist() == ref.pages.tolist()
        if isinstance(got, AppendAllocator):
            assert calls == got.calls == 1
        else:
            assert calls == got.calls == len(ranges)


# ----------------------------------------------------------------------------------------------
# The caches: batched run against the per-piece reference, same workload
# ----------------------------------------------------------------------------------------------


def _full_run(page_size: int, native: bool, monkeypatch, make_alloc=None):
    b = bench.get_bundle("fast")
    if make_alloc is not None:
        import uniradix.fast as fast

        def build(pool):
            alloc = make_alloc(pool.num_pages * pool.page_size, pool.page_size)
            bench.count_frees(alloc)
            params = fast.CacheInitParams(disable=False, req_to_token_pool=None,
                                          token_to_kv_pool_allocator=alloc,
                                          page_size=pool.page_size)
            return fast.UnifiedRadixCache(params), alloc
        b = dataclasses.replace(b, build=build)
    if not native:
        monkeypatch.setattr(cache_mod, "NATIVE", False)
        inner = b.build

        def build_py(pool):
            cache, alloc = inner(pool)
            cache.evict = cache._evict_py_api  # the Python reference path
            return cache, alloc
        b = dataclasses.replace(b, build=build_py)
    keep = []
    stats = bench.run_bench(b, small(page_size), keep=keep)
    return stats, keep[1]


@pytest.mark.parametrize("native", [True, False], ids=["c-core", "python"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_full_evict_batched_same_free_list(page_size, native, monkeypatch, per_piece):
    if native and not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    s1, a1 = _full_run(page_size, native, monkeypatch)
    per_piece()
    s2, a2 = _full_run(page_size, native, monkeypatch)
    assert s1.outcome() == s2.outcome()
    assert free_list(a1) == free_list(a2)
    assert s1.free_calls < s2.free_calls


@pytest.mark.parametrize("native", [True, False], ids=["c-core", "python"])
def test_full_evict_sorted_pages_same_free_list(native, monkeypatch, per_piece):
    if native and not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    s1, a1 = _full_run(4, native, monkeypatch, SortedPagesAllocator)
    per_piece()
    s2, a2 = _full_run(4, native, monkeypatch, SortedPagesAllocator)
    assert s1.outcome() == s2.outcome()
    assert a1.pages.tolist() == a2.pages.tolist()
    assert s1.free_calls == s2.free_calls


def _hybrid_run(kind: str, page_size: int):
    b = bench_hybrid.hybrid_bundle("fast", kind)
    got = []
    inner = b.build

    def build(kv_slots, ps):
        out = inner(kv_slots, ps)
        got.append(out)
        return out
    b = dataclasses.replace(b, build=build)
    base = SharedPrefix(requests=300, prompts=10, prompt_min=100, prompt_max=900,
                        kv_slots=4096, inflight=4)
    stats = bench_hybrid.run_hybrid_bench(b, bench.shared_prefix_workload(page_size, base=base),
                                          kind)
    _cache, alloc, req_pool = got[0]
    return stats, alloc, req_pool


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_hybrid_evict_and_insert_batched_same_free_lists(kind, per_piece):
    s1, a1, r1 = _hybrid_run(kind, 1)
    per_piece()
    s2, a2, r2 = _hybrid_run(kind, 1)
    assert s1.outcome() == s2.outcome()
    assert s1.evicted_tokens > 0
    assert free_list(a1) == free_list(a2)
    if kind == "swa":
        assert free_list(a1.swa) == free_list(a2.swa)
        assert a1.full_to_swa.tolist() == a2.full_to_swa.tolist()
    else:
        assert free_list(r1.mamba_allocator) == free_list(r2.mamba_allocator)


def _host_run(monkeypatch):
    got = []
    inner = bench_host.BUILDERS["fast"]

    def build(kv_slots, ps, policy):
        out = inner(kv_slots, ps, policy)
        got.append(out)
        return out
    monkeypatch.setitem(bench_host.BUILDERS, "fast", build)
    stats = bench_host.run_bench_host("fast", small(1), "write_through")
    cache, alloc = got[0][0], got[0][1]
    return stats, alloc, cache.cache_controller.mem_pool_host


def test_host_tier_batched_same_free_lists(monkeypatch, per_piece):
    s1, a1, h1 = _host_run(monkeypatch)
    per_piece()
    s2, a2, h2 = _host_run(monkeypatch)
    assert s1.outcome() == s2.outcome()
    assert free_list(a1) == free_list(a2)
    assert free_list(h1) == free_list(h2)


# ----------------------------------------------------------------------------------------------
# sglang's own allocators (upstream venv): fast's batched frees leave the allocator exactly as
# upstream's cache, which frees once per node, leaves it
# ----------------------------------------------------------------------------------------------


def _sglang_bundle_or_skip(impl: str) -> bench.ApiBundle:
    try:
        return bench.get_bundle(impl, "sglang")
    except bench.ImplMissing as e:
        pytest.skip(str(e))


def _fast_and_upstream(w) -> tuple:
    """``(stats, allocator)`` of fast's run of ``w`` and of upstream's, each over sglang's own
    allocators."""
    runs = []
    for impl in ("fast", "upstream"):
        keep: list = []
        s = bench.run_bench(_sglang_bundle_or_skip(impl), w, keep=keep)
        runs.append((s, keep[1]))
    return tuple(runs)


@pytest.mark.upstream
@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_allocators_end_as_upstream_leaves_them(page_size):
    w = small(page_size)
    (sf, af), (su, au) = _fast_and_upstream(w)
    assert sf.outcome() == su.outcome()
    assert sf.evicted_tokens > 0
    assert af.free_pages.tolist() == au.free_pages.tolist()
    assert af.release_pages.tolist() == au.release_pages.tolist()
    # page 1: append semantics, one call per evict; page 16: the paged allocator's sorted
    # prepend, written for all of an evict's nodes at once (counted as one call)
    assert sf.free_calls < su.free_calls


def _sglang_paged(ps: int, need_sort: bool, pages: int = 64):
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        torch_mod = load_upstream().torch
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return PagedTokenToKVPoolAllocator(pages * ps, ps, torch_mod.float16, "cpu", None, need_sort)


def _paged_state(a) -> tuple[list, list]:
    return a.free_pages.tolist(), a.release_pages.tolist()


@pytest.mark.upstream
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_sglang_paged_allocator_batched_equals_one_free_per_piece(seed, need_sort):
    """Over sglang's own PagedTokenToKVPoolAllocator: allocations, then pieces of what they
    gave freed as one batch (fast/frees.py) and one ``free`` per piece; the allocator's full
    state is the same after each round, and so is every later allocation."""
    rng = random.Random(seed)
    ps = rng.choice([2, 16])
    got, ref = _sglang_paged(ps, need_sort), _sglang_paged(ps, need_sort)
    assert frees.free_order(got) == frees.PAGED
    held: list[int] = []
    for _ in range(8):
        n = rng.randint(1, 6) * ps
        a, b = got.alloc(n), ref.alloc(n)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tolist() == b.tolist()
            held += a.tolist()
        rng.shuffle(held)
        k = rng.randint(0, len(held))
        freed, held = held[:k], held[k:]
        pieces, i = [], 0
        while i < len(freed):  # page-aligned pieces as evict frees them, or ragged ones
            j = i + (rng.randint(1, 3) * ps if rng.random() < 0.7 else rng.randint(1, ps))
            pieces.append(torch.tensor(freed[i:j], dtype=torch.int64))
            i = j
        pieces = [torch.tensor(sorted(p.tolist()), dtype=torch.int64) if rng.random() < 0.5
                  else p for p in pieces]
        assert frees.release(got, pieces) == (1 if pieces else 0)
        for p in pieces:
            ref.free(p)
        assert _paged_state(got) == _paged_state(ref)
        assert got.available_size() == ref.available_size()


@pytest.mark.upstream
def test_sglang_paged_allocator_batch_only_where_exact(monkeypatch):
    """The PAGED batch is taken for the exact sglang class only, outside a free group, not in
    sglang's debug mode, and not past a ``free`` wrapper that does not say it only observes."""
    a = _sglang_paged(4, False)
    assert frees.free_order(a) == frees.PAGED

    class Sub(type(a)):
        pass
    sub = Sub(64 * 4, 4, a.dtype, "cpu", None, False)
    assert frees.free_order(sub) == frees.PER_CALL
    a.free_group_begin()
    assert frees.free_order(a) == frees.APPEND  # queued, one free at free_group_end
    a.free_group_end()
    a.debug_mode = True
    assert frees.free_order(a) == frees.PER_CALL
    a.debug_mode = False
    seen = []
    a.free = lambda x: seen.append(x)  # intercepts: must see every piece
    assert frees.free_order(a) == frees.PER_CALL
    assert frees.release(a, [torch.tensor([4, 5]), torch.tensor([8])]) == 2 and len(seen) == 2
    del a.free
    bench.count_frees(a)  # an observer: the batch is written and counted once
    assert frees.free_order(a) == frees.PAGED
    assert frees.release(a, [torch.tensor([4, 5]), torch.tensor([8])]) == 1
    assert a._bench_free_calls == [1]
    assert a.free_pages.tolist()[:2] == [2, 1]


@pytest.mark.upstream
def test_sglang_paged_insert_duplicates_freed_as_upstream():
    """Many requests in flight over few prompts at page 16: inserts free duplicates spanning
    several nodes; fast and upstream leave sglang's paged allocator in the same state."""
    base = SharedPrefix(requests=300, prompts=4, prompt_min=40, prompt_max=400, kv_slots=4096,
                        inflight=24)
    w = bench.shared_prefix_workload(16, base=base)
    (sf, af), (su, au) = _fast_and_upstream(w)
    assert sf.outcome() == su.outcome()
    assert _paged_state(af) == _paged_state(au)


def test_hybrid_runs_keep_the_order_of_the_frees():
    from uniradix.fast.frees import FreeBatch
    a, b, c, d = (torch.tensor([i]) for i in range(4))
    batch = FreeBatch()
    for method, t in (("free", a), ("free", b), ("free_swa", c), ("free", d)):
        batch.add(method, t)
    assert [(m, [int(x) for x in ts]) for m, ts in batch.runs] == [
        ("free", [0, 1]), ("free_swa", [2]), ("free", [3])]


@pytest.mark.upstream
@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_hybrid_free_lists_end_as_upstream_leaves_them(kind):
    """Upstream frees once per node, in eviction order: the true per-node reference."""
    got = {}
    for impl in ("fast", "upstream"):
        try:
            b = bench_hybrid.hybrid_bundle(impl, kind)
        except bench.ImplMissing as e:
            pytest.skip(str(e))
        captured = []
        inner = b.build

        def build(kv_slots, ps, inner=inner, captured=captured):
            out = inner(kv_slots, ps)
            captured.append(out)
            return out
        b = dataclasses.replace(b, build=build)
        base = SharedPrefix(requests=300, prompts=10, prompt_min=100, prompt_max=900,
                            kv_slots=4096, inflight=4)
        s = bench_hybrid.run_hybrid_bench(b, bench.shared_prefix_workload(1, base=base), kind)
        got[impl] = (s, captured[0][1], captured[0][2])
    (sf, af, rf), (su, au, ru) = got["fast"], got["upstream"]
    assert sf.outcome() == su.outcome() and sf.evicted_tokens > 0
    assert free_list(af) == free_list(au)
    if kind == "swa":
        assert free_list(af.swa) == free_list(au.swa)
        assert af.full_to_swa.tolist() == au.full_to_swa.tolist()
    else:
        assert free_list(rf.mamba_allocator) == free_list(ru.mamba_allocator)


def test_bench_cli_allocator_and_threads(tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = bench.main(["bench", "--impl", "fast", "--requests", "200", "--repeat", "1",
                     "--page-size", "4", "--json", str(out)])
    assert rc == 0
    import json
    res = json.loads(out.read_text())
    assert res["torch_threads"] == 1 and res["allocator"] == "freelist"
    fast_row = res["comparisons"][0]["impls"]["fast"]
    assert fast_row["free_calls"] > 0
    assert "free() calls per run" in capsys.readouterr().out
    assert bench.main(["bench", "--impl", "fast", "--torch-threads", "0"]) == 2


def _sglang_token(need_sort: bool, slots: int = 512):
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        torch_mod = load_upstream().torch
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return TokenToKVPoolAllocator(slots, torch_mod.float16, "cpu", None, need_sort)


class _Holder:
    """What the C core keeps its page-1 tail buffer on (the cache, in production)."""

    def __init__(self) -> None:
        self._free_tail = None
        self._free_tail_hw = 0


def _native_core():
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    return cache_mod._core


@pytest.mark.upstream
@pytest.mark.parametrize("slots", [512, 20000])  # the C core: a short list copied, a long one tailed
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("path", ["python", "native"])
@pytest.mark.parametrize("seed", range(10))
def test_sglang_token_allocator_batched_equals_one_free_per_piece(seed, path, need_sort, slots):
    """Over sglang's own TokenToKVPoolAllocator (page 1): pieces written straight into its list
    (fast/frees.py append_release; the C core's native frees: a list short beside the pieces
    copied with them into a new tensor, a long one through the tail buffer) leave the
    allocator's state, and every later allocation, exactly as one ``free`` per piece does;
    the slots handed out earlier never change, also across sglang's own frees and a
    backup_state / restore_state that move the list off the tail buffer."""
    rng = random.Random(seed)
    got, ref = _sglang_token(need_sort, slots), _sglang_token(need_sort, slots)
    holder = _Holder()
    handed: list[tuple] = []  # (tensor alloc returned, its values then)
    held: list[int] = []
    backup = None
    for _ in range(14):
        n = rng.randint(1, 40)
        a, b = got.alloc(n), ref.alloc(n)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tolist() == b.tolist()
            handed.append((a, a.tolist()))
            held += a.tolist()
        rng.shuffle(held)
        k = rng.randint(0, len(held))
        freed, held = held[:k], held[k:]
        pieces, i = [], 0
        while i < len(freed):
            j = i + rng.randint(0, 9)  # empty pieces too
            pieces.append(torch.tensor(freed[i:j], dtype=torch.int64))
            i = max(j, i + 1) if j == i and rng.random() < 0.5 else j
        if path == "python":
            if len(pieces) > 1:
                assert frees.append_release(got, pieces)
            else:
                frees.release(got, pieces)
        else:
            assert _native_core().native_release(holder, got, pieces) or not pieces
        for p in pieces:
            ref.free(p)
        roll = rng.random()
        if roll < 0.15:  # sglang's own free: the list leaves the tail buffer
            extra = torch.tensor(held[:3], dtype=torch.int64)
            held = held[3:]
            got.free(extra)
            ref.free(extra)
        elif roll < 0.3:
            backup = (got.backup_state(), ref.backup_state())
        elif roll < 0.45 and backup is not None:
            got.restore_state(backup[0])
            ref.restore_state(backup[1])
            held = []  # what the restored lists hold may be handed out again
        assert got.free_pages.tolist() == ref.free_pages.tolist()
        assert got.release_pages.tolist() == ref.release_pages.tolist()
        assert got.available_size() == ref.available_size()
        for t, values in handed:
            assert t.tolist() == values  # no slot handed out was ever overwritten


def _buffer_span(holder) -> tuple[int, int] | None:
    """The memory range [start, end) of a holder's tail buffer, None without one."""
    t = holder._free_tail
    return None if t is None else (t.data_ptr(), t.data_ptr() + t.numel() * 8)


@pytest.mark.upstream
def test_tail_buffer_memory_reused_only_when_nobody_holds_it():
    """A tail buffer's memory (fast/_core.c "tail buffer memory") goes back to the spare blocks
    only once no tensor over it lives (the list, a slice alloc handed out, a backup_state, the
    holder's buffer), and a later buffer takes it instead of fresh memory; two allocators
    re-making their buffers in turn never share a block; every list stays exactly as sglang's
    own frees leave it and no slot handed out ever changes."""
    core = _native_core()
    rng = random.Random(11)
    pairs = [(_sglang_token(False, 20000), _sglang_token(False, 20000)) for _ in range(2)]
    holders = [_Holder(), _Holder()]
    held: list[list[int]] = [[], []]
    handed: list[tuple] = []  # (tensor alloc returned, its values then)
    spans_seen: set[int] = set()  # the start of every buffer made so far
    reused = 0
    for _ in range(300):
        i = rng.randrange(2)
        got, ref = pairs[i]
        n = rng.randint(1, 40)
        a, b = got.alloc(n), ref.alloc(n)
        assert a.tolist() == b.tolist()
        handed.append((a, a.tolist()))
        held[i] += a.tolist()
        rng.shuffle(held[i])
        k = rng.randint(1, len(held[i]))
        pieces = [torch.tensor(held[i][:k], dtype=torch.int64)]
        held[i] = held[i][k:]
        before = _buffer_span(holders[i])
        assert core.native_release(holders[i], got, pieces)
        ref.free(pieces[0])
        after = _buffer_span(holders[i])
        if after != before and after is not None:  # a new buffer: fresh or a spare block
            reused += after[0] in spans_seen
            spans_seen.add(after[0])
        other = _buffer_span(holders[1 - i])
        if after is not None and other is not None:
            assert after[1] <= other[0] or other[1] <= after[0]  # never one block twice
        roll = rng.random()
        if roll < 0.3 and held[i]:  # sglang's own free: the next release makes a new buffer
            extra = torch.tensor(held[i][:2], dtype=torch.int64)
            held[i] = held[i][2:]
            got.free(extra)
            ref.free(extra)
        elif roll < 0.5:  # slices handed out die: their buffers may become spare blocks
            rng.shuffle(handed)
            del handed[: len(handed) // 2]
        for g, r in pairs:
            assert g.free_pages.tolist() == r.free_pages.tolist()
            assert g.available_size() == r.available_size()
        for t, values in handed:
            assert t.tolist() == values  # no slot handed out was ever overwritten
    assert reused > 0  # the spare blocks were taken, not only fresh memory


TAIL_SPARE_MAX, TAIL_SPARE_CAP = 4, 256 << 20  # fast/_core.c: blocks and bytes kept


def _spares_after_put(spares: list[int], cap: int) -> list[int]:
    """fast/_core.c ``tail_spare_put``'s rule on block lengths (int64 items): a retired block
    is kept if it is among the TAIL_SPARE_MAX largest within TAIL_SPARE_CAP bytes."""
    spares = list(spares)
    while True:
        if cap * 8 > TAIL_SPARE_CAP:
            return spares
        if len(spares) < TAIL_SPARE_MAX and (sum(spares) + cap) * 8 <= TAIL_SPARE_CAP:
            return spares + [cap]
        if not spares or min(spares) >= cap:
            return spares
        spares.remove(min(spares))


@pytest.mark.upstream
def test_tail_spares_keep_the_largest_blocks_within_bounds():
    """Retired tail blocks are kept for reuse four at most, the largest ones within 256 MiB, and
    a buffer takes the smallest spare that fits (fast/_core.c ``tail_spare_put`` /
    ``tail_spare_take``): the memory the spares hold is bounded."""
    core = _native_core()
    base = max(core.tail_spares(), default=0)
    made = []
    for size in (base + 70000, base + 90000, base + 80000):  # three buffers over fresh memory
        a = _sglang_token(False, size)
        h = _Holder()
        a.alloc(1)
        assert core.native_release(h, a, [torch.tensor([1], dtype=torch.int64)])
        made.append((a, h, h._free_tail.numel()))
    caps = [c for _, _, c in made]
    assert len(set(caps)) == 3 and min(caps) > base
    del a, h
    expect = sorted(core.tail_spares())
    while made:  # the allocators and holders die, the last made first: their blocks retire
        expect = _spares_after_put(expect, made.pop()[2])
        assert sorted(core.tail_spares()) == sorted(expect)
    assert len(expect) <= TAIL_SPARE_MAX and sum(expect) * 8 <= TAIL_SPARE_CAP
    want = 2 * (base + 70000)  # what a list of base + 70000 slots asks for
    fits = [c for c in expect if c >= want]
    b = _sglang_token(False, base + 70000)
    b.alloc(1)
    h = _Holder()
    assert core.native_release(h, b, [torch.tensor([1], dtype=torch.int64)])
    if fits:  # the smallest spare that fits is taken
        assert h._free_tail.numel() == min(fits)
        expect.remove(min(fits))
    else:
        assert h._free_tail.numel() == want
    assert sorted(core.tail_spares()) == sorted(expect)


@pytest.mark.upstream
@pytest.mark.parametrize("need_sort", [False, True])
def test_paged_list_written_over_recycled_memory(need_sort):
    """A paged free's new list (free's torch.cat writes the whole list each time) is written
    into a block of recycled memory (fast/_core.c ``list_int64``): once the list before it is
    dropped, that list's block is spare, and the next free but one writes it again, so two
    blocks take turns instead of fresh memory every time (page faults).  The list's values are
    sglang's own, free by free."""
    core = _native_core()
    ps = 16
    pages = max(core.tail_spares(), default=0) + 100000  # larger than any spare block now
    got, ref = _sglang_paged(ps, need_sort, pages), _sglang_paged(ps, need_sort, pages)
    name = "release_pages" if need_sort else "free_pages"
    h = _Holder()
    rng = random.Random(7)
    blocks = []  # (data pointer, capacity in items) of each free's list
    for k in range(4):
        for a in (got, ref):
            a.alloc(ps * 200)
        piece = torch.tensor([(rng.randrange(1, pages) * ps) + j for j in range(ps)],
                             dtype=torch.int64)
        spares = core.tail_spares()
        assert core.native_release(h, got, [piece])
        ref.free(piece)
        assert _paged_state(got) == _paged_state(ref)
        storage = getattr(got, name).untyped_storage()
        blocks.append((storage.data_ptr(), storage.nbytes() // 8))
        del storage
        if k >= 2:  # the block of the list two frees back was spare, and is taken again
            assert blocks[k] == blocks[k - 2]
            assert blocks[k][1] in spares
            assert sorted(core.tail_spares() + [blocks[k][1]]) == sorted(
                spares + [blocks[k - 1][1]])  # (and the list just replaced retired its own)
    assert blocks[0] != blocks[1]


@pytest.mark.upstream
def test_native_frees_only_where_exact():
    """The C core writes sglang's list only for the exact class, outside a free group, not in
    debug mode, and not past a ``free`` wrapper that does not say it only observes; an
    observer is told once per batch."""
    core = _native_core()
    a = _sglang_token(False)
    pieces = [torch.tensor([1, 2]), torch.tensor([3])]
    a.alloc(8)

    class Sub(type(a)):
        pass
    sub = Sub(64, a.dtype, "cpu", None, False)
    sub.alloc(8)
    assert not core.native_release(_Holder(), sub, pieces)
    a.free_group_begin()
    assert not core.native_release(_Holder(), a, pieces)
    a.free_group_end()
    a.debug_mode = True
    assert not core.native_release(_Holder(), a, pieces)
    del a.debug_mode
    seen = []
    a.free = lambda x: seen.append(x)
    assert not core.native_release(_Holder(), a, pieces) and not seen
    del a.free
    assert not core.native_release(_Holder(), a, [torch.tensor([1, 2], dtype=torch.int32)])
    bench.count_frees(a)
    before = a.free_pages.tolist()
    assert core.native_release(_Holder(), a, pieces)
    assert a._bench_free_calls == [1]
    assert a.free_pages.tolist() == before + [1, 2, 3]
    p = _sglang_paged(4, False)
    p.alloc(8)
    assert core.native_release(_Holder(), p, [torch.tensor([4, 5]), torch.tensor([0])])
    assert p.free_pages.tolist()[:2] == [0, 1]
    p.debug_mode = True
    assert not core.native_release(_Holder(), p, [torch.tensor([4])])


@pytest.mark.parametrize("seed", range(12))
def test_front_by_torch_takes_each_pieces_pages_once_in_order(seed):
    """The torch front (any device: what a GPU allocator's batched paged free writes) against
    the floor divisions it stands for; None only where its keys would overflow int64."""
    rng = random.Random(seed)
    ps = rng.choice([1, 3, 4, 16])
    pieces = _odd_pieces(rng, ps, rng.randint(1, 6), min_mixed=1)
    want = _front_reference(pieces, ps)
    got = frees._front_by_torch(pieces, ps)
    if got is None:
        assert any(p.max() > 2 ** 62 for p in pieces) and len(pieces) > 1
        return
    assert got.tolist() == want, (ps, [p.tolist() for p in pieces])
