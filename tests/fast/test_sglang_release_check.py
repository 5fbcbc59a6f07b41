"""The drop-in follows sglang 0.5.13.post1's cache API: params from a release whose
``InsertParams`` lacks the fields the cache reads (0.5.23 dropped ``chunked`` and
``swa_evicted_seqlen``) are refused at construction, by release and field, instead of failing
at the first insert with an ``AttributeError``.  Stand-in sglang modules here; the real 0.5.13.post1
objects pass in tests/fast/test_dropin_upstream.py."""

import dataclasses
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from uniradix import fast  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.errors import Unsupported  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

NAMES = ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.base_prefix_cache")


@pytest.fixture
def stand_in(monkeypatch):
    """A stand-in sglang of the given version whose base_prefix_cache.InsertParams has the
    given fields, and a CacheInitParams class that says it comes from sglang."""
    if "sglang" in sys.modules and not isinstance(sys.modules["sglang"], types.SimpleNamespace):
        pytest.skip("a real sglang is imported in this process")

    def make(version: str, insert_fields: tuple[str, ...]) -> type:
        ns = {n: types.SimpleNamespace() for n in NAMES}
        ns["sglang"].__version__ = version
        ns[NAMES[-1]].InsertParams = dataclasses.make_dataclass(
            "InsertParams", [(f, object, None) for f in ("key", "value", *insert_fields)])
        for n, m in ns.items():
            monkeypatch.setitem(sys.modules, n, m)

        class CacheInitParams(fast.CacheInitParams):  # (its fields and defaults)
            pass
        CacheInitParams.__module__ = "sglang.srt.mem_cache.cache_init_params"
        return CacheInitParams
    return make


def _build(cls: type) -> tuple:
    alloc = PoolAllocator(PagedPool(64, 1, "kv"), torch)
    return fast.UnifiedRadixCache(cls(disable=False, req_to_token_pool=None,
                                      token_to_kv_pool_allocator=alloc, page_size=1)), alloc


def test_a_release_without_the_insert_fields_is_refused_by_name(stand_in):
    cls = stand_in("0.5.23", ("mamba_value", "prev_prefix_len", "inserted_len", "priority"))
    with pytest.raises(Unsupported, match=r"sglang 0\.5\.23: its InsertParams has no chunked, "
                                          r"swa_evicted_seqlen.*0\.5\.13\.post1"):
        _build(cls)


def test_the_release_it_follows_passes(stand_in):
    cls = stand_in("0.5.13.post1", ("mamba_value", "prev_prefix_len", "swa_evicted_seqlen",
                                     "chunked", "priority"))
    cache, alloc = _build(cls)
    key, slots = fast.RadixKey([1, 2, 3]), alloc.alloc(3)
    cache.insert(fast.InsertParams(key=key, value=slots))
    got = cache.match_prefix(fast.MatchPrefixParams(key=key)).device_indices
    assert got.tolist() == slots.tolist()
