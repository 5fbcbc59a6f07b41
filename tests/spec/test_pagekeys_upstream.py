"""Page keys against sglang 0.5.13.post1's own functions on random inputs (needs sglang
importable: run with the upstream venv's python; skipped everywhere else)."""

from __future__ import annotations

import random
from array import array

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod
from uniradix.spec.pagekeys import block_hash, chain_keys, page_key

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (run with the upstream venv's python)",
                allow_module_level=True)


def _upstream():
    upstream_mod.load_upstream()
    from sglang.srt.mem_cache import utils
    from sglang.srt.mem_cache.radix_cache import RadixKey
    return utils, RadixKey


@pytest.mark.parametrize("seed", range(5))
def test_page_key_equals_get_hash_str_on_random_inputs(seed):
    utils, _ = _upstream()
    rng = random.Random(seed)
    for _ in range(200):
        tokens = [rng.choice((0, 1, 2 ** 32 - 1, rng.randrange(2 ** 32))) for _ in range(rng.randrange(0, 9))]
        prior = None if rng.random() < 0.3 else page_key([rng.randrange(50)])
        assert page_key(tokens, prior) == utils.get_hash_str(tokens, prior)
        bigrams = [(rng.randrange(2 ** 32), rng.randrange(2 ** 32)) for _ in range(rng.randrange(0, 5))]
        assert page_key(bigrams, prior) == utils.get_hash_str(bigrams, prior)
        key = page_key(tokens, prior)
        assert block_hash(key) == utils.hash_str_to_int64(key)


@pytest.mark.parametrize("page_size", [1, 2, 4])
@pytest.mark.parametrize("bigram", [False, True])
def test_chain_keys_equal_hash_page_chains(page_size, bigram):
    _, RadixKey = _upstream()
    rng = random.Random(page_size * 10 + bigram)
    for _ in range(50):
        n = rng.randrange(1, 6) * page_size
        raw = [rng.randrange(1000) for _ in range(n + (1 if bigram else 0))]
        key = RadixKey(array("q", raw), is_bigram=bigram)
        expected, prior = [], None
        for start in range(0, n, page_size):
            prior = key.hash_page(start, start + page_size, prior)
            expected.append(prior)
        units = [(raw[i], raw[i + 1]) for i in range(n)] if bigram else raw
        assert list(chain_keys(units, page_size)) == expected
