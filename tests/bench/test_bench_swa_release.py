"""pytest-benchmark of one SWA batch handed back (fast/frees.py ``release``: the C core's
``swa_free`` where it is built) against sglang's own frees of the same pieces, one call per
piece, over sglang's ``SWATokenToKVPoolAllocator`` of 67,072 slots as the bench builds it
(conformance/bench/sglang_alloc.py): three pieces of 40 slots at page 1, of 48 (three pages)
at page 16, ``free`` and ``free_swa``.  Skipped by default (``--benchmark-skip``); run in the
upstream venv with ``--benchmark-only``.  Compare the medians of one run only (the machines are
shared)."""

import pytest

torch = pytest.importorskip("torch")

from uniradix.fast import frees  # noqa: E402

pytestmark = pytest.mark.upstream


def _allocator(ps: int):
    try:
        from uniradix.conformance.adapters.upstream import load_upstream
        load_upstream()
        from uniradix.conformance.bench import configs as C
        from uniradix.conformance.bench import sglang_alloc
        parts = sglang_alloc.sglang_parts(C.BenchConfig(("full", "swa"), None), 67072, ps)
    except Exception as e:  # noqa: BLE001 - absent, or an install that fails at import
        pytest.skip(f"sglang's allocators do not import here ({type(e).__name__}: {e})")
    alloc = parts.alloc
    for name in ("free", "free_swa"):  # the bench's observing wrappers off: sglang as it is
        alloc.__dict__.pop(name, None)
    return alloc, parts.loop


@pytest.mark.parametrize("impl", ["fast", "sglang"])
@pytest.mark.parametrize("method", ["free", "free_swa"])
@pytest.mark.parametrize("ps", [1, 16])
def test_bench_swa_release(benchmark, impl, method, ps):
    alloc, loop = _allocator(ps)
    width = 40 if ps == 1 else 48
    held: list = []

    def setup():
        if held:  # free_swa left the full slots held: give them back, untimed
            alloc.full_attn_allocator.free(held.pop())
        v = loop.alloc(3 * width)
        if method == "free_swa":
            held.append(v)
        return ([v[:width], v[width:2 * width], v[2 * width:]],), {}

    if impl == "fast":
        def run(pieces):
            frees.release(alloc, pieces, method)
    else:
        fn = getattr(alloc, method)

        def run(pieces):
            for p in pieces:
                fn(p)
    benchmark.pedantic(run, setup=setup, rounds=2000, iterations=1)
