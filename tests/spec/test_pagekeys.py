"""Page keys (spec/pagekeys.py) against fixed vectors produced by sglang 0.5.13.post1's own
``get_hash_str`` / ``RadixKey.hash_page`` / ``hash_str_to_int64`` (tests/spec/test_pagekeys_upstream.py
re-derives them from upstream on random inputs when sglang is importable)."""

from __future__ import annotations

import hashlib

import pytest

from uniradix.spec.errors import InvalidInput
from uniradix.spec.pagekeys import (
    block_hash,
    chain_keys,
    is_page_key,
    namespace_prior,
    page_key,
    path_keys,
    split_keys,
)

K_1234 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
K_5678 = "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
K_9_12 = "eddb4ab93695109cc0853fa0167c53aa0dc373ece757e530a734981168bdeebc"
K_EMPTY = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

# (units, prior, key) produced by 0.5.13.post1's get_hash_str (tuples: EAGLE bigram units)
VECTORS = [
    ([], None, K_EMPTY),
    ([0], None, "df3f619804a92fdb4057192dc43dd748ea778adc52bc498ce80524c014b81119"),
    ([1, 2, 3, 4], None, K_1234),
    ([4294967295, 0, 7], None, "ef6bd321ac3b09a02f38cf9b78c0da6727cc3e4f4ed7d539de2ab8d49eb9eb7c"),
    ([5] * 16, None, "99bb3dae1174215e2adeb125bbc5fd9026f25a42105b961f5e798b073d68a273"),
    ([5, 6, 7, 8], K_1234, K_5678),
    ([9, 10, 11, 12], K_5678, K_9_12),
    ([3822511289, 2800360461, 2861245199],
     "b01099398ce27bbcb7ed256854acc338ba75af739e9d73d741dcb13dc4cbfb56",
     "92fdba46f5315146b97955cdd20016a1b0f3655e1fa699d483872925782d9a17"),
    ([559260700, 1265541136],
     "e2733b3db9d93b0ac4e656aa12b839b92d1b7e1a4c5d97c74cb05c700672cc87",
     "57eda4a72edfc8454fa4d5fc27c8fc443bf0a46f7ae2784e403f2ff0296e567c"),
    ([630116043, 3461944806],
     "e3f69f6c094ffb4e3b3a0ba41d7996137e03ebdf85952d227d04b9e161a06c5b",
     "21b01d41b4b034201e1e6e5cf9e8ac033f2b1635be08fe0abc8e32b3a82600a5"),
    ([(1, 2), (2, 3), (3, 4)], None,
     "928a7f8cab7207fc7ba8ba57c48d7e2b6cb8e80a3f6e6b64b775ef1687c77767"),
    # RadixKey([1, 2, 3, 4, 5], is_bigram=True).hash_page(0, 2) and (2, 4) chained
    ([(1, 2), (2, 3)], None, "ede8ef26a097f0fd889f9f39f6f5af921370630b164c4a4fa28eb716b2df9269"),
    ([(3, 4), (4, 5)], "ede8ef26a097f0fd889f9f39f6f5af921370630b164c4a4fa28eb716b2df9269",
     "678c5307f2a02a2aaf8edbeb80ebac13663f70e14a4fc8d5d62b77e702841e4b"),
]

# (key, hash_str_to_int64(key)) from 0.5.13.post1
BLOCK_HASHES = [
    ("df3f619804a92fdb4057192dc43dd748ea778adc52bc498ce80524c014b81119", -2360060374177730597),
    (K_1234, -3488128144981237669),
    (K_5678, 5674439469042975057),
    (K_EMPTY, -2039914840885289964),
]


@pytest.mark.parametrize("units,prior,expected", VECTORS)
def test_page_key_matches_upstream_vectors(units, prior, expected):
    assert page_key(units, prior) == expected


@pytest.mark.parametrize("key,expected", BLOCK_HASHES)
def test_block_hash_matches_upstream(key, expected):
    assert block_hash(key) == expected


def test_chain_keys_chains_pages_and_keys_a_short_last_page():
    assert chain_keys(list(range(1, 13)), 4) == (K_1234, K_5678, K_9_12)
    assert chain_keys([1, 2, 3, 4, 5, 6], 4) == (K_1234, page_key([5, 6], K_1234))
    assert chain_keys([], 4) == ()
    assert chain_keys([1, 2, 3, 4], 1)[3] == page_key([4], page_key([3], page_key([2], page_key([1]))))


def test_bigram_chain_matches_upstream_hash_page():
    units = [(1, 2), (2, 3), (3, 4), (4, 5)]
    assert chain_keys(units, 2) == (VECTORS[11][2], VECTORS[12][2])


def test_namespace_prior_isolates_tenants_and_compat_mode_does_not():
    units = [1, 2, 3, 4]
    assert path_keys(units, 4, None) == (K_1234,)
    assert path_keys(units, 4, None, "compat") == (K_1234,)
    assert path_keys(units, 4, "lora-a", "compat") == (K_1234,)
    a = path_keys(units, 4, "lora-a")
    b = path_keys(units, 4, "lora-b")
    assert a != b and K_1234 not in a + b
    tag = hashlib.sha256(b"uniradix/extra_key\x00lora-a").hexdigest()
    assert namespace_prior("lora-a") == tag
    assert a == (page_key(units, tag),)
    assert namespace_prior("", "namespaced") is not None  # an empty extra_key is still a tenant


def test_split_keys_cuts_the_list_and_keys_stay_valid():
    keys = chain_keys(list(range(1, 13)), 4)
    upper, lower = split_keys(keys, 8, 4)
    assert upper == (K_1234, K_5678) and lower == (K_9_12,)
    assert split_keys(keys, 3, 1) == (keys[:3], keys[3:])


@pytest.mark.parametrize("bad", [-1, 2 ** 32, 1.5, True, "1"])
def test_bad_tokens_are_refused(bad):
    with pytest.raises(InvalidInput):
        page_key([1, bad])


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidInput):
        page_key([1], prior="abc")
    with pytest.raises(InvalidInput):
        namespace_prior("x", "legacy")
    with pytest.raises(InvalidInput):
        block_hash("xyz")
    with pytest.raises(InvalidInput):
        chain_keys([1], 0)
    assert is_page_key(K_1234) and not is_page_key(K_1234.upper())
