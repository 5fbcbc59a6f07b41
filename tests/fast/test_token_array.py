"""A key whose token ids are a list (uniradix's ``RadixKey([...])``, or an object of sglang's
``RadixKey`` shape holding a list) is converted in one C pass (fast/_core.c ``token_array``):
the same ``array('q')`` as ``array('q', list)``, the same errors, and anything the C pass does
not take (a bool, an int subclass, an int outside int64, a tuple) answered by the Python
conversion (fast/radix_key.py ``as_token_array``), so the key is the same either way."""

from __future__ import annotations

import enum
import types
from array import array
from typing import Any

import pytest

from uniradix import fast
from uniradix.fast import cache as cache_mod
from uniradix.fast import radix_key
from uniradix.fast.errors import InvalidInput
from uniradix.fast.one_aux import _key_parts

core = cache_mod._core
needs_core = pytest.mark.skipif(core is None, reason="the C core is not built "
                                "(or UNIRADIX_PURE_PYTHON=1)")


class Colour(enum.IntEnum):
    RED = 7


@needs_core
@pytest.mark.parametrize("toks", [[], [0], [1, 2, 3], list(range(-5, 5000)),
                                  [2**63 - 1, -(2**63)]])
def test_token_array_is_array_q_of_the_list(toks: list) -> None:
    out = core.token_array(toks)
    assert type(out) is array and out.typecode == "q" and out == array("q", toks)
    assert out.tolist() == toks
    toks.append(9)  # the array is its own copy
    assert len(out) == len(toks) - 1


@needs_core
@pytest.mark.parametrize("toks", [[1, True], [False], [1, 2**63], [-(2**63) - 1, 1],
                                  [1, 2.0], [1, "2"], [1, None], [Colour.RED], (1, 2),
                                  array("q", [1]), "12"])
def test_token_array_declines_what_is_not_exactly_an_int64_list(toks) -> None:
    assert core.token_array(toks) is None


@pytest.mark.parametrize("toks, ok", [([3, 1, 2], True), ((3, 1, 2), True), ([Colour.RED], True),
                                      ([1, True], False), ([1, 2**63], False),
                                      ([1, 2.5], False), ([1, "x"], False)])
def test_keys_from_lists_are_what_array_q_makes_with_the_same_errors(toks, ok) -> None:
    """uniradix's RadixKey and an sglang-shaped key (what ``_key_parts`` reads), with the C
    pass and without it: the same tokens, or the same InvalidInput."""
    results = []
    for conv in (radix_key.from_list, None):
        saved = radix_key.from_list
        radix_key.from_list = conv
        try:
            got = []
            for make in (lambda: fast.RadixKey(toks).token_ids,
                         lambda: _key_parts(types.SimpleNamespace(
                             token_ids=toks, extra_key=None, is_bigram=False))[0]):
                try:
                    got.append(("ok", make().tolist()))
                except InvalidInput as e:
                    got.append(("error", str(e)))
            results.append(got)
        finally:
            radix_key.from_list = saved
    assert results[0] == results[1]
    assert all(kind == ("ok" if ok else "error") for kind, _ in results[0])
    if ok:
        assert results[0][0][1] == [int(t) for t in toks]


@needs_core
def test_the_core_converts_lists_where_it_is_built() -> None:
    assert radix_key.from_list is core.token_array


def test_a_cache_matches_a_list_key_as_its_array() -> None:
    """Full and SWA (fast/one_aux.py's key path) caches hit the same with list and array keys."""
    import torch

    from uniradix.conformance.adapters.fast_hybrid import SwaPoolAllocator
    from uniradix.conformance.env.pools import PoolAllocator
    from uniradix.spec.world import HybridKVPool, PagedPool
    for swa in (False, True):
        if swa:
            alloc: Any = SwaPoolAllocator(HybridKVPool(256, 256, 1), torch)
            kw: dict = {"tree_components": ("full", "swa"), "sliding_window_size": 4}
        else:
            alloc, kw = PoolAllocator(PagedPool(256, 1, "kv"), torch), {}
        cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=1, **kw))
        toks = [5, 6, 7, 8, 9, 10]
        cache.insert(fast.InsertParams(key=fast.RadixKey(array("q", toks)),
                                       value=torch.tensor(alloc.alloc(6).tolist())))
        sg = types.SimpleNamespace(token_ids=toks + [11], extra_key=None, is_bigram=False)
        for key in (fast.RadixKey(toks + [11]), sg):
            m = cache.match_prefix(fast.MatchPrefixParams(key=key))
            assert len(m.device_indices) == 6
        with pytest.raises(InvalidInput):
            cache.match_prefix(fast.MatchPrefixParams(key=types.SimpleNamespace(
                token_ids=[5, True], extra_key=None, is_bigram=False)))
