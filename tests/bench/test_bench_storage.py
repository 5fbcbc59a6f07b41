"""Prefetch and backup throughput of the storage backends, uniradix's and upstream 0.5.13.post1's
(the same passes as `uniradix bench-storage`, conformance/bench/storage.py, under
pytest-benchmark).

Skipped by default (``--benchmark-skip``); run with
``python -m pytest tests/bench/test_bench_storage.py --benchmark-enable --benchmark-only``.
The upstream backends need sglang (run it with the upstream venv's Python); the Mooncake ones
need the mooncake package (a ``mooncake_master`` is started on loopback).  One round = one pass
of ``PAGES`` pages in 128-page batches; ``extra_info`` carries pages/s and GB/s of the median.
"""

from __future__ import annotations

import argparse
import itertools
import os

import pytest

torch = pytest.importorskip("torch")

from uniradix.conformance.bench import storage as bs  # noqa: E402
from uniradix.fast.storage import MooncakeMaster  # noqa: E402
from uniradix.fast.storage.base import PageLayout  # noqa: E402
from uniradix.fast.storage.bench import _sglang, make_pool  # noqa: E402

PAGES = 128
SHAPE = argparse.Namespace(pages=PAGES, page_size=16, layers=4, heads=8, head_dim=128,
                           layout="page_first")
_serial = itertools.count()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    torch.set_num_threads(1)
    mph = _sglang()
    return {"mph": mph, "pool": make_pool(SHAPE, mph), "root": tmp_path_factory.mktemp("bench-storage")}


@pytest.fixture(scope="module")
def mooncake_master():
    if bs._why_not("mooncake", True) is not None:
        yield None
        return
    m = MooncakeMaster().start()
    yield m
    m.stop()


@pytest.mark.parametrize("direction", bs.DIRECTIONS)
@pytest.mark.parametrize("backend", bs.BACKENDS)
def test_bench_storage(benchmark, env, mooncake_master, backend, direction):
    why = bs._why_not(backend, env["mph"] is not None)
    if why is not None:
        pytest.skip(why)
    pool = env["pool"]
    pl = PageLayout.of(pool)
    d = os.path.join(env["root"], f"{backend}-{direction}")
    os.makedirs(d, exist_ok=True)
    segment = max(64 << 20, 2 * PAGES * pl.page_bytes + (32 << 20))
    run = bs._build(backend, pool, d, mooncake_master.address if mooncake_master else None,
                    segment, SHAPE.layout)
    src = torch.arange(PAGES * SHAPE.page_size)
    dst = torch.arange(PAGES * SHAPE.page_size, 2 * PAGES * SHAPE.page_size)
    try:
        if direction == "backup":
            def setup():
                run.clear()
                return ([f"b{next(_serial)}-{i}" for i in range(PAGES)], src), {}
            benchmark.pedantic(run.write, setup=setup, rounds=5, warmup_rounds=1)
        else:
            keys = [f"p{next(_serial)}-{i}" for i in range(PAGES)]
            assert run.write(keys, src)
            assert benchmark.pedantic(run.read, args=(keys, dst), rounds=5, warmup_rounds=1)
            for p in range(PAGES):
                assert b"".join(v.tobytes() for v in pl.views(PAGES + p)) == \
                    b"".join(v.tobytes() for v in pl.views(p))
    finally:
        run.clear()
        run.close()
    median = benchmark.stats.stats.median
    benchmark.extra_info.update({
        "backend": backend, "direction": direction, "pages": PAGES, "page_bytes": pl.page_bytes,
        "pages_per_s": PAGES / median, "GB_per_s": PAGES * pl.page_bytes / median / 1e9})
