"""Native frees on every path (fast/frees.py ``release``, ``native_release``, ``swa_release``;
fast/_core.c "native frees" and ``swa_take``): over each of sglang's own allocators the bench
uses (``TokenToKVPoolAllocator``, ``SWATokenToKVPoolAllocator``, ``MambaSlotAllocator``, the
host pools ``MHATokenToKVPoolHost`` and ``MambaPoolHost``), fast's release of k pieces leaves
the allocator exactly as a twin freed one piece per call by sglang's own method: the same free
lists (and SWA mapping) after every step of random interleavings of alloc, release, sglang's
own free, backup_state / restore_state, free groups and need_sort; no slot handed out earlier
ever changes.  Where the list may not be written (a subclass, debug mode, an instance ``free``,
a piece that is not a CPU int64 tensor), sglang's own method runs."""

import random

import pytest

torch = pytest.importorskip("torch")

import uniradix.fast.cache as cache_mod  # noqa: E402
from uniradix.conformance.bench import configs as C  # noqa: E402
from uniradix.fast import frees  # noqa: E402

pytestmark = pytest.mark.upstream


def _sglang():
    """sglang's torch and allocator classes, or a skip where sglang does not import."""
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        torch_mod = load_upstream().torch
        from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    return torch_mod, TokenToKVPoolAllocator, SWATokenToKVPoolAllocator, MambaSlotAllocator, \
        SWAKVPool


def _token(slots: int, need_sort: bool):
    t, token, _, _, _ = _sglang()
    return token(slots, t.float16, "cpu", None, need_sort)


def _swa(slots: int, need_sort: bool, ps: int = 1):
    t, _, swa, _, pool = _sglang()
    kv = pool(size=slots, size_swa=slots // 2, page_size=ps, dtype=t.float16, head_num=1,
              head_dim=1, swa_attention_layer_ids=[1], full_attention_layer_ids=[0],
              enable_kvcache_transpose=False, device="cpu")
    return swa(slots, slots // 2, page_size=ps, dtype=t.float16, device="cpu", kvcache=kv,
               need_sort=need_sort)


def _swa16(slots: int, need_sort: bool):
    return _swa(slots // 16 * 16, need_sort, 16)


def _mamba(slots: int, need_sort: bool):
    return _sglang()[3](slots, "cpu")


def _host(which: str):
    def make(slots: int, need_sort: bool):
        _sglang()
        from uniradix.conformance.bench import sglang_alloc
        parts = sglang_alloc.sglang_parts(C.BenchConfig(("full", "mamba"), "write_through"),
                                          slots, 1)
        pool = parts.host if which == "kv" else parts.aux_host["mamba"]
        # the bench's observing wrapper (conformance/bench/alloc_time.py) taken off: these
        # tests drive sglang's pool as it is (a class swapped under it must see its own free)
        pool.__dict__.pop("free", None)
        return pool
    return make


# kind -> (builder, what it has: "group" free groups and backup_state, "swa" free_swa too)
KINDS = {
    "token": (_token, {"group"}),
    "swa": (_swa, {"group", "swa"}),
    "swa16": (_swa16, {"group", "swa"}),
    "mamba": (_mamba, set()),
    "host_kv": (_host("kv"), set()),
    "host_mamba": (_host("mamba"), set()),
}


def _subs(a) -> list:
    return [a.full_attn_allocator, a.swa_attn_allocator] if hasattr(a, "full_attn_allocator") \
        else [a]


def _state(a) -> list:
    """Everything a free may change: each (sub-)allocator's lists, the SWA mapping."""
    out = []
    for s in _subs(a):
        if hasattr(s, "free_pages"):
            out += [s.free_pages.tolist(), s.release_pages.tolist()]
        else:
            out.append(s.free_slots.tolist())
    if hasattr(a, "full_to_swa_index_mapping"):
        out.append(a.full_to_swa_index_mapping.tolist())
    return out


def _page(a) -> int:
    return a.page_size if hasattr(a, "full_attn_allocator") else 1


def _alloc(a, n: int):
    """``n`` units: slots, or at page > 1 whole pages (as the bench allocates from the SWA
    allocator there, conformance/bench/sglang_alloc.py PagedSwaAlloc)."""
    if _page(a) > 1:
        from uniradix.conformance.bench import sglang_alloc
        return sglang_alloc.PagedSwaAlloc(a).alloc(n * _page(a))
    return a.alloc(n)


def _units(t, ps: int) -> list:
    """What was allocated, as units the test frees whole: slots, or pages' slot tuples."""
    v = t.tolist()
    return v if ps == 1 else [tuple(v[i:i + ps]) for i in range(0, len(v), ps)]


def _flat(units: list, ps: int) -> list:
    return units if ps == 1 else [x for u in units for x in u]


def _alloc_both(got, ref, rng: random.Random, handed: list, held: list) -> None:
    """A random alloc from both twins, which must hand out the same slots: what ``got`` gave is
    remembered with its values (``handed``) and its units join ``held``, then shuffled."""
    ps = _page(got)
    n = rng.randint(1, 30 if ps == 1 else 3)
    a, b = _alloc(got, n), _alloc(ref, n)
    assert (a is None) == (b is None)
    if a is not None:
        assert a.tolist() == b.tolist()
        handed.append((a, a.tolist()))
        held += _units(a, ps)
    rng.shuffle(held)


def _release(got, pieces: list, method: str, via: str, in_group: bool) -> None:
    """Free ``pieces`` through fast/frees.py ``release`` (``via="release"``), or straight
    through the C core's one-call SWA release (``via="swa_free"``), which must take every
    batch but a ``free`` inside a free group (where ``free`` only queues)."""
    if via == "swa_free":
        core = cache_mod._core
        if core is not frees._SWA_READY[0]:
            frees._setup_swa(core)  # (release does this on its first call)
        done = core.swa_free(got, pieces, method == "free_swa")
        assert done is (bool(pieces) and (method == "free_swa" or not in_group))
        if done:
            return
    frees.release(got, pieces, method)


_CASES = [(k, False, "release") for k in sorted(KINDS)] \
    + [(k, True, "release") for k in sorted(KINDS) if "group" in KINDS[k][1]] \
    + [(k, ns, "swa_free") for k in ("swa", "swa16") for ns in (False, True)]


def _tensors(state) -> list:
    """The tensors of a ``backup_state`` (the SWA allocator's nests its sub-allocators')."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, (tuple, list)):
        return [t for x in state for t in _tensors(x)]
    return []


@pytest.mark.parametrize(("kind", "need_sort", "via"), _CASES)
@pytest.mark.parametrize("seed", range(6))
def test_release_equals_one_sglang_free_per_piece(kind, need_sort, via, seed):
    if via == "swa_free" and not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    build, has = KINDS[kind]
    rng = random.Random(seed * 31 + len(kind))
    slots = rng.choice([300, 12000]) if kind != "host_kv" else 6000
    got, ref = build(slots, need_sort), build(slots, need_sort)
    ps = _page(got)
    handed: list[tuple] = []  # (tensor alloc returned, its values then)
    held: list[int] = []
    backup = None
    in_group = False
    for _ in range(40):
        _alloc_both(got, ref, rng, handed, held)
        k = rng.randint(0, min(len(held), 60 // ps))
        freed = _flat(held[:k], ps)
        method = "free_swa" if "swa" in has and rng.random() < 0.25 else "free"
        if method == "free":
            held = held[k:]  # (free_swa keeps the full slots held: free them later)
        pieces, i = [], 0
        while i < len(freed):
            j = i + rng.randint(0, 9) * ps  # empty pieces too
            pieces.append(torch.tensor(freed[i:j], dtype=torch.int64))
            i = max(j, i + ps) if j == i and rng.random() < 0.5 else j
        if ps > 1:  # a piece's slots in any order (the pages sorted within each free)
            pieces = [p[torch.randperm(len(p))] if rng.random() < 0.5 else p for p in pieces]
        if "group" in has and not in_group and rng.random() < 0.1:
            got.free_group_begin()
            ref.free_group_begin()
            in_group = True
        _release(got, pieces, method, via, in_group)
        for p in pieces:
            getattr(ref, method)(p)
        roll = rng.random()
        if in_group and roll < 0.4:
            got.free_group_end()
            ref.free_group_end()
            in_group = False
        elif roll < 0.1 and held:  # sglang's own free: the list leaves the tail buffer
            extra = torch.tensor(_flat(held[:3], ps), dtype=torch.int64)
            held = held[3:]
            got.free(extra)
            ref.free(extra)
        elif "group" in has and not in_group and roll < 0.25:
            backup = (got.backup_state(), ref.backup_state())
            backed = [t.tolist() for t in _tensors(backup[0])]
        elif "group" in has and not in_group and roll < 0.35 and backup is not None:
            got.restore_state(backup[0])
            ref.restore_state(backup[1])
            held = []  # what the restored lists hold may be handed out again
        assert _state(got) == _state(ref)
        assert got.available_size() == ref.available_size()
        for t, values in handed:
            assert t.tolist() == values  # no slot handed out was ever overwritten
        if backup is not None:  # nor a list a backup_state holds
            assert [t.tolist() for t in _tensors(backup[0])] == backed
    if cache_mod.NATIVE and slots > 1000 and not need_sort and kind not in ("host_mamba",
                                                                             "swa16"):
        # the long lists went through the tail buffer, not sglang's copy of the list (the
        # host Mamba pool is always short: twice the device's 256 states)
        assert all(frees.tail_holder(s)._free_tail is not None for s in _subs(got))


def test_swa_take_repeats_as_free_swa_in_turn():
    """A slot repeated within one piece is taken each time (free_swa gathers before it zeroes),
    one repeated in a later piece is not (zeroed by then); slots that map to 0 are skipped.
    (The C core's ``swa_take``; without it one ``free_swa`` of the concatenation runs, which
    is the same only where no slot is in two pieces, as in every cache's frees: a slot in two
    pieces is a double free.)"""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    got, ref = _swa(64, False), _swa(64, False)
    a, b = got.alloc(10), ref.alloc(10)
    assert a.tolist() == b.tolist()
    got.full_to_swa_index_mapping[a[9]] = 0  # one slot without an SWA slot
    ref.full_to_swa_index_mapping[b[9]] = 0
    s = a.tolist()
    pieces = [torch.tensor([s[0], s[1], s[0]]), torch.tensor([s[1], s[2], s[9]]),
              torch.tensor([], dtype=torch.int64), torch.tensor([s[3]])]
    assert frees.release(got, pieces, "free_swa") == 1
    for p in pieces:
        ref.free_swa(p)
    assert _state(got) == _state(ref)


def test_swa_take_declines_slots_outside_the_mapping():
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    a = _swa(64, False)
    m = a.full_to_swa_index_mapping
    before = m.tolist()
    assert cache_mod._core.swa_take(m, [torch.tensor([1]), torch.tensor([-1])]) is None
    assert cache_mod._core.swa_take(m, [torch.tensor([len(before)])]) is None
    assert cache_mod._core.swa_take(m.to(torch.int32), [torch.tensor([1])]) is None
    assert m.tolist() == before  # nothing changed


def _pieces() -> list:
    return [torch.tensor([1, 2], dtype=torch.int64), torch.tensor([3], dtype=torch.int64)]


@pytest.mark.parametrize("kind", ["token", "swa", "mamba", "host_kv"])
def test_subclass_gets_its_own_free(kind):
    """A subclass may free differently: its own ``free`` runs, once per piece."""
    build = KINDS[kind][0]
    base = build(6000, False)
    calls = []

    class Sub(type(base)):
        def free(self, idx):
            calls.append(idx.tolist())
            return super().free(idx)
    got = base
    got.__class__ = Sub
    ref = build(6000, False)
    got.alloc(8)
    ref.alloc(8)
    frees.release(got, _pieces())
    for p in _pieces():
        ref.free(p)
    assert calls == [[1, 2], [3]]
    assert _state(got) == _state(ref)
    assert all(frees.tail_holder(s)._free_tail is None for s in _subs(got)
               if frees.native_kind(type(s)))


@pytest.mark.parametrize("kind", ["token", "swa"])
def test_debug_mode_runs_sglang_free(kind):
    got, ref = KINDS[kind][0](6000, False), KINDS[kind][0](6000, False)
    for a in (got, ref):
        a.alloc(8)
    for s in _subs(got):
        s.debug_mode = True
    frees.release(got, _pieces())
    for p in _pieces():
        ref.free(p)
    assert _state(got) == _state(ref)
    assert all(frees.tail_holder(s)._free_tail is None for s in _subs(got))


@pytest.mark.parametrize("kind", ["token", "swa", "mamba", "host_kv", "host_mamba"])
def test_instance_free_runs(kind):
    """A ``free`` set on the instance that does not say it only observes is called."""
    got, ref = KINDS[kind][0](6000, False), KINDS[kind][0](6000, False)
    got.alloc(8)
    ref.alloc(8)
    seen = []
    raw = got.free

    def free(idx):
        seen.append(idx.tolist())
        return raw(idx)
    got.free = free
    frees.release(got, _pieces())
    for p in _pieces():
        ref.free(p)
    assert seen and sum(seen, []) == [1, 2, 3]
    assert _state(got) == _state(ref)


def test_swa_instance_free_swa_runs():
    got, ref = _swa(6000, False), _swa(6000, False)
    got.alloc(8)
    ref.alloc(8)
    seen = []
    raw = got.free_swa
    got.free_swa = lambda idx: (seen.append(idx.tolist()), raw(idx))[1]
    frees.release(got, _pieces())
    for p in _pieces():
        ref.free(p)
    assert seen
    assert _state(got) == _state(ref)


@pytest.mark.parametrize("method", ["free", "free_swa"])
def test_swa_observing_instance_methods_keep_the_native_steps(method):
    """An instance ``free`` / ``free_swa`` that only observes (it carries ``uniradix_on_batch``,
    as the bench's counters do: conformance/bench/alloc_time.py) keeps the native steps: it is
    told once per batch and never called, and the lists end as the twin's."""
    if getattr(cache_mod, "_core", None) is None:
        pytest.skip("the C core is not built")
    got, ref = _swa(6000, False), _swa(6000, False)
    got.alloc(8)
    ref.alloc(8)
    called, told = [], []
    for name in ("free", "free_swa"):
        raw = getattr(got, name)

        def watch(idx, raw=raw, name=name):
            called.append(name)
            return raw(idx)
        watch.uniradix_on_batch = lambda n, name=name: told.append((name, n))
        setattr(got, name, watch)
    frees.release(got, _pieces(), method)
    for p in _pieces():
        getattr(ref, method)(p)
    assert called == [] and told == [(method, 2)]
    assert _state(got) == _state(ref)


@pytest.mark.parametrize("kind", ["token", "swa", "mamba", "host_kv", "host_mamba"])
def test_pieces_not_cpu_int64_run_sglang_free(kind):
    """int32 or non-contiguous pieces: sglang's own free (its dtype promotion); a piece on
    another device (``meta``, no CUDA needed): sglang's own free raises, as for the twin."""
    got, ref = KINDS[kind][0](6000, False), KINDS[kind][0](6000, False)
    got.alloc(8)
    ref.alloc(8)
    odd = [torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3, 0, 4, 0])[::2]]
    frees.release(got, odd)
    for p in odd:
        ref.free(p)
    assert _state(got) == _state(ref)
    meta = [torch.empty(n, dtype=torch.int64, device="meta") for n in (1, 2)]
    errors = []
    for run in (lambda: frees.release(got, meta), lambda: [ref.free(p) for p in meta]):
        try:
            run()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - compared below
            errors.append(type(e))
    assert errors[0] == errors[1]
    assert _state(got) == _state(ref)


def test_observer_told_once_per_batch():
    """The bench's counting wrapper (it only observes) keeps the native path and is told once
    per batch, for the KV allocator and for the SWA allocator."""
    from uniradix.conformance.bench import loop as bench
    for kind in ("token", "swa"):
        got, ref = KINDS[kind][0](6000, False), KINDS[kind][0](6000, False)
        got.alloc(8)
        ref.alloc(8)
        bench.count_frees(got)
        assert frees.release(got, _pieces()) == 1
        for p in _pieces():
            ref.free(p)
        assert _state(got) == _state(ref)
        assert got._bench_free_calls == [1]


def test_free_timer_counts_the_native_frees_of_every_allocator():
    """``--alloc-time``'s C timer (fast/_core.c ``free_timer``) sums the native frees of the
    SWA allocator's steps and of the Mamba allocator, not only the Full cache's."""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    core = cache_mod._core
    for kind in ("swa", "mamba"):
        a = KINDS[kind][0](6000, False)
        a.alloc(8)
        core.free_timer(1)  # reset, and on (wall clock)
        try:
            assert frees.release(a, _pieces()) == 1
            assert core.free_timer(1) > 0.0
            assert core.free_timer(1) == 0.0  # nothing freed since
        finally:
            core.free_timer(0)


def test_swa_free_takes_the_whole_batch_in_one_call():
    """``release`` of an SWA batch is one C call (fast/_core.c ``swa_free``): the Python steps
    (``swa_release``) do not run, for ``free`` and ``free_swa``."""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    got, ref = _swa(6000, False), _swa(6000, False)
    got.alloc(8)
    ref.alloc(8)
    steps = []
    real = frees.swa_release
    frees.swa_release = lambda *a, **k: steps.append(a) or real(*a, **k)  # type: ignore
    try:
        for method in ("free_swa", "free"):
            assert frees.release(got, _pieces(), method) == 1
            for p in _pieces():
                getattr(ref, method)(p)
            assert _state(got) == _state(ref)
    finally:
        frees.swa_release = real
    assert steps == []


def test_swa_free_runs_a_patched_available_size():
    """free's size checks: where sglang's class resolves ``available_size`` to another function
    (patched), the C call runs it, as free would; with sglang's own it computes the same sum
    itself.  A double free past the pool's size fails free's check, as in sglang."""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    got, ref = _swa(64, False), _swa(64, False)
    cls = type(got.full_attn_allocator)
    real = cls.available_size
    calls = []

    def counted(self):
        calls.append(self)
        return real(self)
    cls.available_size = counted
    try:
        a = got.alloc(4)
        ref.alloc(4)
        calls.clear()  # (alloc asks too)
        assert frees.release(got, [a[:2], a[2:]]) == 1
        ref.free(a[:2])
        ref.free(a[2:])
        assert _state(got) == _state(ref)
        assert got.full_attn_allocator in calls and got.swa_attn_allocator in calls
    finally:
        cls.available_size = real
    errors = []
    for alloc in (got, ref):  # never allocated: the full list would outgrow the pool
        try:
            frees.release(alloc, [torch.tensor([1, 2], dtype=torch.int64)])
            errors.append(None)
        except AssertionError:
            errors.append(AssertionError)
    assert errors == [AssertionError, AssertionError]


def test_tail_buffer_set_by_someone_else_is_read_in_full():
    """The capacity the C core keeps with a tail buffer it made (``_free_tail_at``) serves only
    that buffer: a buffer set on the holder another way (here a view of a larger tensor, the
    list a view of it ending at ``_free_tail_hw``) is read again, so nothing is written past its
    end, and the list still ends as sglang's free leaves it."""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    got, ref = _token(12000, False), _token(12000, False)
    a, b = got.alloc(6000), ref.alloc(6000)
    assert a.tolist() == b.tolist()
    frees.release(got, [a[:100]])  # the C core makes the holder's buffer (and its capacity)
    ref.free(b[:100])
    holder = frees.tail_holder(got)
    assert holder._free_tail_at is not None
    n = len(got.free_pages)
    big = torch.full((n + 1000,), -7, dtype=torch.int64)
    big[:n] = got.free_pages
    holder._free_tail = big[:n]  # a buffer exactly as long as the list: no room after it
    holder._free_tail_hw = n
    got.free_pages = holder._free_tail[:n]
    frees.release(got, [a[100:150], a[150:200]])
    ref.free(b[100:150])
    ref.free(b[150:200])
    assert _state(got) == _state(ref)
    assert (big[n:] == -7).all()  # nothing written past the foreign buffer's end


@pytest.mark.parametrize("kind", ["swa", "swa16"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_runs_equal_the_runs_in_turn(kind, need_sort, seed):
    """An SWA evict's batch holds runs of ``free`` (leaves) and ``free_swa`` (tombstones) in free
    order; ``FreeBatch.release`` hands them to the C core in one call (fast/frees.py
    ``_swa_runs``).  After every batch both lists and the map equal a twin freed one piece per
    call by sglang's own methods in the same order, and no slot handed out changes; outside a
    free group no run goes through ``release`` one by one."""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    build = KINDS[kind][0]
    rng = random.Random(seed * 7 + len(kind) + need_sort)
    got, ref = build(12000, need_sort), build(12000, need_sort)
    ps = _page(got)
    handed: list[tuple] = []
    held: list = []  # units whose full slots are held
    swa_done: set = set()  # units whose SWA slots went back already (a tombstone's)
    in_group = False
    per_run = []
    real = frees.release
    frees.release = lambda *a, **k: per_run.append(a[2] if len(a) > 2 else "free") \
        or real(*a, **k)  # type: ignore[assignment]
    try:
        for _ in range(30):
            _alloc_both(got, ref, rng, handed, held)
            batch, calls = frees.FreeBatch(), []
            for _ in range(rng.randint(2, 8)):
                k = rng.randint(0, min(len(held), 4))
                units, held = held[:k], held[k:]
                tomb = [u for u in units if u not in swa_done and rng.random() < 0.4]
                for u in units:
                    if u in tomb:  # a tombstone now, its full slots freed later
                        held.append(u)
                        swa_done.add(u)
                    else:
                        swa_done.discard(u)
                for method, part in (("free_swa", tomb),
                                     ("free", [u for u in units if u not in tomb])):
                    if part:
                        t = torch.tensor(_flat(part, ps), dtype=torch.int64)
                        batch.add(method, t)
                        calls.append((method, t))
            if rng.random() < 0.1 and not in_group:
                got.free_group_begin()
                ref.free_group_begin()
                in_group = True
            per_run.clear()
            batch.release(got)
            for method, t in calls:
                getattr(ref, method)(t)
            if len(batch.runs) > 1 and not in_group:
                assert per_run == [], "the runs went one by one"
            if in_group and rng.random() < 0.5:
                got.free_group_end()
                ref.free_group_end()
                in_group = False
            assert _state(got) == _state(ref)
            assert got.available_size() == ref.available_size()
            for t, values in handed:
                assert t.tolist() == values
    finally:
        frees.release = real



def _paged16(slots: int, need_sort: bool):
    _sglang()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    t = _sglang()[0]
    return PagedTokenToKVPoolAllocator(slots, 16, t.float16, "cpu", None, need_sort)


def _lists(a) -> list:
    """The list a paged free writes of each (sub-)allocator (``release_pages`` under need_sort)."""
    return [s.release_pages if s.need_sort else s.free_pages for s in _subs(a)]


def _moved_in_front(before: list, got) -> int:
    """How many of ``got``'s long lists now start right before where they started (``before``:
    their data pointers and lengths), as long as they grew: written in place.  (A function, so
    that no list stays referenced by a loop variable: a held list forces a copy.)"""
    n = 0
    for (ptr, length), t in zip(before, _lists(got), strict=True):
        grew = len(t) - length
        n += grew > 0 and length > 8192 and t.data_ptr() == ptr - grew * 8
    return n


def _heads(a) -> list:
    """Each (sub-)allocator's head buffer (fast/_core.c): its data pointer and length, or None."""
    out = []
    for s in _subs(a):
        h = getattr(frees.tail_holder(s), "_free_head", None) if frees.native_kind(type(s)) \
            else None
        out.append(None if h is None else (h.data_ptr(), len(h)))
    return out


def _copied_into_head(before: list, heads: list, got) -> int:
    """How many of ``got``'s lists were outside their head buffer (``heads``, as it was) and
    are now inside that same buffer: a list made elsewhere copied into the buffer it had."""
    n = 0
    for (ptr, _length), head, t in zip(before, heads, _lists(got), strict=True):
        if head is None:
            continue
        lo, hi = head[0], head[0] + head[1] * 8
        n += not lo <= ptr < hi and lo <= t.data_ptr() < hi
    return n


@pytest.mark.parametrize("kind", ["paged16", "swa16"])
@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_long_paged_lists_take_frees_in_place(kind, need_sort, seed):
    """Lists of over 8k pages (fast/_core.c "a paged list's head buffer"): the pages a release
    frees are written into the room before the list, which stays a view of one buffer, and
    the allocator still ends exactly as a twin freed one piece per call by sglang's own free,
    through allocs, sglang's own frees, backup_state / restore_state and lists held by the
    test (those held must keep their values: while one is held, the list is copied).  A list
    sglang's own free made (a new tensor) is copied back into the buffer the list had, where
    nothing else holds that buffer."""
    if not cache_mod.NATIVE:
        pytest.skip("the C core is not built")
    rng = random.Random(seed * 7 + len(kind) + need_sort)
    build = _paged16 if kind == "paged16" else (lambda s, ns: _swa(s, ns, 16))
    slots = 16 * 40000
    got, ref = build(slots, need_sort), build(slots, need_sort)
    held: list[list[int]] = []  # pages, as their slots
    kept: list[tuple] = []  # (a list the test holds, its values then)
    backup = None
    in_place = reused = 0
    for step in range(160):
        n = rng.randint(1, 400)
        a = got.alloc(n * 16) if kind == "paged16" else _alloc(got, n)
        b = ref.alloc(n * 16) if kind == "paged16" else _alloc(ref, n)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tolist() == b.tolist()
            v = a.tolist()
            held += [v[i:i + 16] for i in range(0, len(v), 16)]
        rng.shuffle(held)
        k = rng.randint(0, min(len(held), 600))
        freed, held = held[:k], held[k:]
        pieces, i = [], 0
        while i < len(freed):
            j = i + rng.randint(1, 40)
            pieces.append(torch.tensor([x for p in freed[i:j] for x in p], dtype=torch.int64))
            i = j
        before = [(t.data_ptr(), len(t)) for t in _lists(got)]
        heads = _heads(got)
        if kind == "paged16":
            frees.release(got, pieces, "free")
        else:
            _release(got, pieces, "free", "swa_free", False)
        for p in pieces:
            ref.free(p)
        in_place += _moved_in_front(before, got)
        reused += _copied_into_head(before, heads, got)
        roll = rng.random()
        if roll < 0.05 and held:  # sglang's own free
            extra = torch.tensor([x for p in held[:3] for x in p], dtype=torch.int64)
            held = held[3:]
            got.free(extra)
            ref.free(extra)
        elif roll < 0.12:
            backup = (got.backup_state(), ref.backup_state())
            backed = [t.tolist() for t in _tensors(backup[0])]
        elif roll < 0.16 and backup is not None:
            got.restore_state(backup[0])
            ref.restore_state(backup[1])
            held = []
        elif roll < 0.22:
            kept.append((list(_lists(got)), [t.tolist() for t in _lists(got)]))
        elif roll < 0.3 and kept:
            kept.pop(rng.randrange(len(kept)))
        if need_sort and rng.random() < 0.02:
            for s, r in zip(_subs(got), _subs(ref), strict=True):
                s.merge_and_sort_free()
                r.merge_and_sort_free()
        assert _state(got) == _state(ref), step
        assert got.available_size() == ref.available_size()
        for lists, values in kept:
            assert [t.tolist() for t in lists] == values, step
        if backup is not None:
            assert [t.tolist() for t in _tensors(backup[0])] == backed, step
    if not need_sort:  # (under need_sort the written list, release_pages, is long only
        assert in_place > 20, in_place  # between merges: the twins' equality is the check)
        assert reused > 5, reused  # after sglang's own frees, into the buffer the list had
