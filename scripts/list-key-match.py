"""match_prefix of a key whose token ids are a Python list, fast against upstream.

sglang 0.5.13.post1's ``Req`` hands the cache ``array('q')`` token ids (what ``uniradix bench``
passes too); a caller with a list (uniradix's own ``RadixKey([...])``, an older scheduler) makes
the cache convert it.  Both caches are built from sglang's own ``CacheInitParams`` over sglang's
``TokenToKVPoolAllocator`` (Full, page 1); one N-token prompt is inserted, then the same prompt
plus 100 new tokens is matched 50 times as sglang's ``RadixKey`` over a list and over an array,
one torch thread, CPU clock.  Prints the median per round, rounds alternating the caches.

Run in the upstream venv: VENV/bin/python scripts/list-key-match.py [N] [ROUNDS]
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from array import array

from uniradix.conformance.adapters import upstream as upstream_mod

up = upstream_mod.load_upstream()
torch = up.torch
torch.set_num_threads(1)

from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402

import uniradix.fast as fast  # noqa: E402


def build(impl: str, slots: int):
    rtp = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(slots, torch.float16, "cpu", None, False)
    params = up.CacheInitParams(disable=False, req_to_token_pool=rtp,
                                token_to_kv_pool_allocator=alloc, page_size=1,
                                tree_components=(up.ComponentType.FULL,))
    cache = fast.UnifiedRadixCache(params) if impl == "fast" else up.UnifiedRadixCache(params)
    return cache, alloc


def median_match_us(impl: str, kind: str, toks: list) -> float:
    n = len(toks)
    cache, alloc = build(impl, 4 * n)
    conv = list if kind == "list" else (lambda t: array("q", t))
    cache.insert(up.InsertParams(key=up.RadixKey(conv(toks)), value=alloc.alloc(n)))
    query = toks + [1] * 100
    times = []
    for _ in range(50):
        key = up.RadixKey(conv(query))
        t0 = time.thread_time()
        m = cache.match_prefix(up.MatchPrefixParams(key=key))
        times.append(time.thread_time() - t0)
    assert len(m.device_indices) == n
    return statistics.median(times) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    rng = random.Random(1)
    toks = [rng.randrange(1, 30000) for _ in range(n)]
    out: dict = {}
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", file=sys.stderr)
        for impl in (("fast", "upstream") if r % 2 == 0 else ("upstream", "fast")):
            for kind in ("list", "array"):
                out.setdefault((impl, kind), []).append(median_match_us(impl, kind, toks))
    for (impl, kind), v in sorted(out.items()):
        print(f"{impl:9s} {kind:6s} match median us per round: "
              + ", ".join(f"{x:.1f}" for x in v))


if __name__ == "__main__":
    main()
