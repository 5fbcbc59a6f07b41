"""The HiCache copy kernels: Triton == torch reference == a plain Python loop, bit for bit.

Without a GPU the Triton kernels run on CPU pools under TRITON_INTERPRET=1 (set in conftest.py),
so the pools are tiny; with one, the device pool is on the GPU and the host pool pinned.  Every
destination starts poisoned (NaN); after a copy the whole buffer is compared across the three
engines, and exactly the copied rows may have lost their poison.
"""
import itertools
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import uniradix.kernels as K  # noqa: E402
from uniradix.kernels import triton_copy  # noqa: E402
from uniradix.kernels.layouts import AttentionKind, Layout  # noqa: E402

LAYERS = 3
DEVICE_PAGES = 5      # device slots = (DEVICE_PAGES + 1) * page: one spare page, like upstream's padding page
HOST_PAGES = 6
COPY_PAGES = 3
ENGINES = ("triton", "torch", "loop")
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
WORD = {2: torch.int16, 4: torch.int32, 8: torch.int64}

DTYPE_DIMS = list(itertools.product((torch.float16, torch.bfloat16, torch.float32), (3, 5)))  # odd head dims


def geometry(kind, page, dtype, dim):
    if kind is AttentionKind.MHA:
        return K.KVGeometry.mha(LAYERS, 2, dim, page, dtype)
    return K.KVGeometry.mla(LAYERS, dim, page, dtype)


def slots_of(pages, page):
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page + torch.arange(page)).flatten()


def random_pairs(rng, page):
    """COPY_PAGES distinct device pages paired with COPY_PAGES distinct host pages, as token slots."""
    d = rng.sample(range(DEVICE_PAGES + 1), COPY_PAGES)
    h = rng.sample(range(HOST_PAGES), COPY_PAGES)
    return slots_of(d, page), slots_of(h, page)


def bits(t):
    return t.view(WORD[t.dtype.itemsize])


def same_bits(a, b):
    return torch.equal(bits(a.cpu()), bits(b.cpu()))


def random_device(g):
    pool = K.DevicePool.allocate(g, (DEVICE_PAGES + 1) * g.page_size, device=DEV)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, dtype=torch.float32))
    return pool


def random_host(g, layout):
    pool = K.HostPool.allocate(g, layout, HOST_PAGES * g.page_size, pin_memory=CUDA)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, dtype=torch.float32))
    return pool


def poisoned(pool):
    b = pool.buffer
    if isinstance(pool, K.HostPool):
        fresh = torch.empty(b.shape, dtype=b.dtype, pin_memory=CUDA).fill_(float("nan"))
        return K.HostPool(pool.geometry, pool.layout, fresh)
    return K.DevicePool(pool.geometry, torch.full_like(b, float("nan")))


def run(direction, src, dst, src_idx, dst_idx, engine, layer):
    if direction == "backup":
        K.backup_all_layers(src, dst, device_indices=src_idx, host_indices=dst_idx, impl=engine)
    elif direction == "load_layer":
        K.load_layer(src, dst, layer, host_indices=src_idx, device_indices=dst_idx, impl=engine)
    else:
        K.load_all_layers(src, dst, host_indices=src_idx, device_indices=dst_idx, impl=engine)


CASES = [
    pytest.param(kind, layout, page, dtype, dim, direction,
                 id=f"{kind.value}-{layout.value}-p{page}-{str(dtype)[6:]}-d{dim}-{direction}")
    for kind, layout, page, (dtype, dim), direction in itertools.product(
        AttentionKind, Layout, (1, 16, 64), DTYPE_DIMS, ("backup", "load_layer", "load_all"))
]


@pytest.mark.parametrize("kind, layout, page, dtype, dim, direction", CASES)
def test_engines_agree_on_every_element(kind, layout, page, dtype, dim, direction):
    rng = random.Random(f"{kind}{layout}{page}{dtype}{dim}{direction}")
    g = geometry(kind, page, dtype, dim)
    device_idx, host_idx = random_pairs(rng, page)
    layer = rng.randrange(LAYERS)
    if direction == "backup":
        src, template, src_idx, dst_idx = random_device(g), random_host(g, layout), device_idx, host_idx
    else:
        src, template, src_idx, dst_idx = random_host(g, layout), random_device(g), host_idx, device_idx
    source_before = src.buffer.clone()

    results = {}
    for engine in ENGINES:
        dst = poisoned(template)
        run(direction, src, dst, src_idx, dst_idx, engine, layer)
        results[engine] = dst.buffer
    assert same_bits(src.buffer, source_before), "a copy wrote to its source"
    assert same_bits(results["triton"], results["torch"]), "Triton differs from the torch reference"
    assert same_bits(results["torch"], results["loop"]), "torch reference differs from the Python loop"

    copied_layers = 1 if direction == "load_layer" else LAYERS
    written = (~torch.isnan(results["loop"])).sum().item()
    assert written == len(src_idx) * g.planes * copied_layers * g.row, "poison lost outside the copied rows"


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("kind", list(AttentionKind))
def test_backup_then_load_back_restores_the_pages(kind, layout):
    """A story: pages go to the host, the device slots are reused, the pages come back elsewhere."""
    g = geometry(kind, 16, torch.bfloat16, 5)
    device = random_device(g)
    host = poisoned(random_host(g, layout))
    out, back = slots_of([4, 0], 16), slots_of([2, 5], 16)
    before = device.planes_view().clone()
    K.backup_all_layers(device, host, device_indices=out, host_indices=slots_of([1, 3], 16), impl="triton")
    device.buffer.fill_(0)
    for layer in range(LAYERS):
        K.load_layer(host, device, layer, host_indices=slots_of([1, 3], 16), device_indices=back,
                     impl="triton")
    after = device.planes_view()
    for plane in range(g.planes):
        for layer in range(LAYERS):
            assert same_bits(after[plane, layer][back.to(DEV)], before[plane, layer][out.to(DEV)])


def test_host_shapes_follow_upstream():
    mha = K.KVGeometry.mha(layers=4, heads=8, head_dim=128, page_size=16, dtype=torch.float16)
    mla = K.KVGeometry.mla(layers=4, dim=576, page_size=16, dtype=torch.bfloat16)
    assert mha.host_shape("layer_first", 64) == (2, 4, 64, 8, 128)
    assert mha.host_shape("page_first", 64) == (2, 64, 4, 8, 128)
    assert mha.host_shape("page_first_direct", 64) == (2, 4, 4, 16, 8, 128)
    assert mla.host_shape("layer_first", 64) == (4, 64, 1, 576)
    assert mla.host_shape("page_first", 64) == (64, 4, 1, 576)
    assert mla.host_shape("page_first_direct", 64) == (4, 4, 16, 1, 576)
    assert mha.device_shape(80) == (2, 4, 80, 8, 128)
    assert mla.device_shape(80) == (4, 80, 1, 576)
    with pytest.raises(K.KernelInputError):
        mha.host_shape("page_first", 63)


def test_auto_picks_triton_under_the_interpreter_or_on_cuda():
    g = geometry(AttentionKind.MHA, 1, torch.float16, 3)
    device, host = random_device(g), random_host(g, Layout.LAYER_FIRST)
    expected = "triton" if triton_copy.INTERPRET or CUDA else "torch"
    assert K.resolve_impl("auto", device, host) == expected


def test_pools_that_start_off_word_alignment_are_copied_word_by_smaller_word():
    """Rows of 16 bytes move as int64 words, unless a buffer starts 2 bytes into its storage."""
    g = K.KVGeometry.mha(2, 2, 4, 1, torch.float16)
    storage = torch.randn(1 + 2 * 2 * 8 * 2 * 4).half().to(DEV)
    device = K.DevicePool(g, storage[1:].view(g.device_shape(8)))
    made = {}
    for engine in ("triton", "loop"):
        host = poisoned(K.HostPool.allocate(g, Layout.PAGE_FIRST, 8, pin_memory=CUDA))
        K.backup_all_layers(device, host, device_indices=torch.tensor([3, 0, 7]),
                            host_indices=torch.tensor([1, 6, 2]), impl=engine)
        made[engine] = host.buffer
    assert same_bits(made["triton"], made["loop"])


# --- bad inputs: a clear error, nothing launched, nothing written ---------------------------

def _bad_inputs():
    P = 16
    g = geometry(AttentionKind.MHA, P, torch.float16, 3)
    ok_d, ok_h = slots_of([0, 2], P), slots_of([1, 3], P)
    dev_slots, host_slots = (DEVICE_PAGES + 1) * P, HOST_PAGES * P
    other = K.KVGeometry.mha(LAYERS, 2, 3, P, torch.float32)
    return g, [
        ("int32 indices", dict(device_indices=ok_d.to(torch.int32)), K.KernelInputError, "int64"),
        ("2-D indices", dict(host_indices=ok_h.view(2, P)), K.KernelInputError, "1-D"),
        ("float indices", dict(host_indices=ok_h.float()), K.KernelInputError, "int64"),
        ("list indices", dict(host_indices=ok_h.tolist()), K.KernelInputError, "torch.Tensor"),
        ("lengths differ", dict(host_indices=slots_of([1, 3, 4], P)), K.KernelIndexError, "pair"),
        ("device slot past the end", dict(device_indices=slots_of([0, DEVICE_PAGES + 1], P)),
         K.KernelIndexError, f"[0, {dev_slots})"),
        ("host slot past the end", dict(host_indices=slots_of([1, HOST_PAGES], P)),
         K.KernelIndexError, f"[0, {host_slots})"),
        ("negative host slot", dict(host_indices=slots_of([1, 3], P) - 32), K.KernelIndexError, "outside"),
        ("page not aligned", dict(device_indices=slots_of([0, 2], P) + 1), K.KernelIndexError, "whole pages"),
        ("page not a run", dict(host_indices=slots_of([1, 3], P).flip(0)), K.KernelIndexError, "whole pages"),
        ("partial page", dict(device_indices=ok_d[:-1], host_indices=ok_h[:-1]), K.KernelIndexError,
         "whole number"),
        ("dtype mismatch", dict(_host_geometry=other), K.KernelInputError, "dtype"),
        ("impl unknown", dict(impl="cuda-magic"), K.KernelInputError, "impl"),
    ], ok_d, ok_h


BAD_NAMES = [case[0] for case in _bad_inputs()[1]]


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test: bad input must be refused before the launcher runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched on bad input")
    monkeypatch.setattr(triton_copy, "_launch", refuse)


@pytest.mark.parametrize("name", BAD_NAMES)
@pytest.mark.parametrize("direction", ["backup", "load_layer"])
def test_bad_input_raises_before_any_launch(name, direction, no_launch):
    g, cases, ok_d, ok_h = _bad_inputs()
    _, change, error, message = next(c for c in cases if c[0] == name)
    change = dict(change)
    host_g = change.pop("_host_geometry", g)
    impl = change.pop("impl", "triton")
    device = poisoned(random_device(g))
    host = poisoned(random_host(host_g, Layout.PAGE_FIRST_DIRECT))
    d_idx = change.get("device_indices", ok_d)
    h_idx = change.get("host_indices", ok_h)
    dst = host if direction == "backup" else device
    before = dst.buffer.clone()
    with pytest.raises(error, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        if direction == "backup":
            K.backup_all_layers(device, host, device_indices=d_idx, host_indices=h_idx, impl=impl)
        else:
            K.load_layer(host, device, 1, host_indices=h_idx, device_indices=d_idx, impl=impl)
    assert same_bits(dst.buffer, before), "a refused copy changed its destination"


@pytest.mark.parametrize("direction", ["backup", "load_all"])
def test_a_destination_page_named_twice_is_refused(direction, no_launch):
    g = geometry(AttentionKind.MLA, 16, torch.float16, 5)
    device, host = random_device(g), random_host(g, Layout.PAGE_FIRST)
    twice, once = slots_of([2, 2], 16), slots_of([0, 1], 16)
    with pytest.raises(K.KernelIndexError, match="twice"):
        if direction == "backup":
            K.backup_all_layers(device, host, device_indices=once, host_indices=twice)
        else:
            K.load_all_layers(host, device, host_indices=once, device_indices=twice)
    # Reading one source page twice is fine: two destinations get the same page.
    if direction == "backup":
        K.backup_all_layers(device, host, device_indices=twice, host_indices=once, impl="torch")
    else:
        K.load_all_layers(host, device, host_indices=twice, device_indices=once, impl="torch")


@pytest.mark.parametrize("layer", [-1, LAYERS, 1.0, True])
def test_a_layer_outside_the_pools_is_refused(layer, no_launch):
    g = geometry(AttentionKind.MHA, 1, torch.float32, 3)
    device, host = random_device(g), random_host(g, Layout.LAYER_FIRST)
    idx = torch.tensor([0, 1])
    with pytest.raises(K.KernelInputError, match="layer"):
        K.load_layer(host, device, layer, host_indices=idx, device_indices=idx)


def test_checks_of_index_values_can_be_skipped_but_not_checks_of_structure():
    from uniradix.kernels.validate import check_copy
    g = geometry(AttentionKind.MHA, 1, torch.float16, 3)
    device, host = random_device(g), random_host(g, Layout.LAYER_FIRST)
    far = torch.tensor([10**9])
    assert check_copy(device, host, far, far, to_host=True, values=False) == 1
    with pytest.raises(K.KernelIndexError):
        check_copy(device, host, far, far, to_host=True)
    with pytest.raises(K.KernelInputError, match="int64"):
        check_copy(device, host, far.int(), far, to_host=True, values=False)


def test_an_empty_copy_is_a_no_op(no_launch):
    g = geometry(AttentionKind.MHA, 16, torch.float16, 3)
    device, host = random_device(g), poisoned(random_host(g, Layout.LAYER_FIRST))
    empty = torch.empty(0, dtype=torch.int64)
    K.backup_all_layers(device, host, device_indices=empty, host_indices=empty)
    assert torch.isnan(host.buffer).all()


def test_pools_refuse_buffers_that_do_not_fit():
    g = geometry(AttentionKind.MHA, 16, torch.float16, 3)
    with pytest.raises(K.KernelInputError, match="shape"):
        K.DevicePool(g, torch.zeros(2, LAYERS, 32, 2, 4, dtype=torch.float16))
    with pytest.raises(K.KernelInputError, match="contiguous"):
        K.HostPool(g, "layer_first", torch.zeros(2, LAYERS, 32, 3, 2, dtype=torch.float16).transpose(-1, -2))
    with pytest.raises(K.KernelInputError, match="one latent head"):
        K.KVGeometry(AttentionKind.MLA, 2, 4, 8, 1, torch.float16)


# --- CUDA: pinned host pool, side stream, events per layer ---------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("layout", list(Layout))
def test_cuda_side_stream_events_per_layer(layout):
    P = 16
    g = K.KVGeometry.mha(4, 8, 128, P, torch.bfloat16)
    device = K.DevicePool.allocate(g, 64 * P, device="cuda")
    device.buffer.normal_()
    host = K.HostPool.allocate(g, layout, 96 * P)
    assert host.buffer.is_pinned()
    assert K.resolve_impl("auto", device, host) == "triton"
    gen = torch.Generator().manual_seed(7)
    d_idx = slots_of(torch.randperm(64, generator=gen)[:20].tolist(), P).cuda()
    h_idx = slots_of(torch.randperm(96, generator=gen)[:20].tolist(), P)          # CPU: moved by the stream
    io = K.TransferStream()

    backed = io.backup_async(device, host, device_indices=d_idx, host_indices=h_idx)
    assert isinstance(backed, torch.cuda.Event)
    backed.synchronize()
    for plane in range(2):
        for layer in range(g.layers):
            assert same_bits(host.paged_layer(plane, layer)[h_idx // P, h_idx % P],
                             device.layer(layer, plane)[d_idx].cpu())

    target = slots_of(list(range(40, 60)), P).cuda()
    device.planes_view()[:, :, target] = float("nan")
    events = io.load_layers_async(host, device, host_indices=h_idx, device_indices=target, check_values=False)
    assert len(events) == g.layers
    main = torch.cuda.current_stream()
    for layer, event in enumerate(events):
        main.wait_event(event)   # what attention for this layer would do
        for plane in range(2):
            got = device.layer(layer, plane)[target]
            assert same_bits(got.cpu(), host.paged_layer(plane, layer)[h_idx // P, h_idx % P])
    torch.cuda.synchronize()
    assert all(e.query() for e in events)


# --- int64 addressing ----------------------------------------------------------------------

@pytest.mark.slow
def test_slots_past_two_to_the_31_elements_are_addressed_exactly():
    """A host pool of 2.5 GB of one-byte rows: layer 7 starts past element 2**31, so any int32
    product or sum in the kernel's address arithmetic would land the copy in the wrong place."""
    tokens = 310_000_000
    g = K.KVGeometry.mla(layers=8, dim=1, page_size=1, dtype=torch.uint8)
    assert 7 * tokens > 2**31
    shape = g.host_shape(Layout.LAYER_FIRST, tokens)
    host = K.HostPool(g, Layout.LAYER_FIRST, torch.empty(shape, dtype=torch.uint8, pin_memory=CUDA))
    device = K.DevicePool(g, torch.randint(1, 255, g.device_shape(8), dtype=torch.uint8, device=DEV))
    d_idx, h_idx = torch.tensor([0, 3, 7]), torch.tensor([tokens - 1, 5, tokens - 2])
    K.backup_all_layers(device, host, device_indices=d_idx, host_indices=h_idx, impl="triton")
    want = device.buffer[:, d_idx.to(DEV), 0, 0].cpu()
    assert torch.equal(host.buffer[:, h_idx, 0, 0], want)
    device.buffer.zero_()
    K.load_all_layers(host, device, host_indices=h_idx, device_indices=d_idx, impl="triton")
    assert torch.equal(device.buffer[:, d_idx.to(DEV), 0, 0].cpu(), want)


# --- the GPU benchmark's code paths, at toy sizes on this machine ----------------------------

def test_bench_measures_and_checks_every_engine_on_a_toy_config(capsys):
    from uniradix.kernels import bench
    raw_dev = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=DEV)
    raw_host = torch.empty(raw_dev.shape, dtype=torch.uint8, pin_memory=CUDA).copy_(raw_dev)
    clock = bench.Clock(DEV.type == "cuda")
    rows = bench.bench_config(clock, DEV, raw_dev, raw_host, Layout.PAGE_FIRST_DIRECT, 16, 4 * 1024,
                              64 * 1024, 1, bench.PerPageCopier(DEV.type == "cuda"), 16)
    assert [r["direction"] for r in rows] == list(bench.DIRECTIONS)
    assert all(r["verified"] and r["memcpy_gbps"] > 0 and r["triton_gbps"] > 0 for r in rows)
    ceil = bench.ceilings(clock, DEV, 1 << 20, 1)
    bench.judge(rows, ceil)
    bench.print_table(rows, ceil)
    assert "page_first_direct" in capsys.readouterr().out
