"""Tensor-parallel acks of the fast host tier (fast/tiers/host.py): two processes joined by
torch.distributed over gloo on loopback build the same host-tier cache with
``tp_cache_group``; their write and load acks finish at different times (manual I/O: rank 0's
all, rank 1's only the first), and both ranks still end with identical trees, because each
processes the MIN over the ranks of its finished acks (as 0.5.13.post1's ``writing_check`` /
``loading_check``).  The same steps without the group end with different trees, which is what
the reduction prevents.  The test starts both processes and stops them."""

from __future__ import annotations

import pytest

from ranks import run_ranks

torch = pytest.importorskip("torch")

from uniradix import fast  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402

RANK = r'''
import json, sys, tempfile, torch, torch.distributed as dist
from uniradix import fast
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.hicache import HiCacheConfig, InitLoadBackParams
from uniradix.fast.storage import FileStore
from uniradix.fast.tiers.storage import StorageConfig
from uniradix.spec.world import PagedPool

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group = dist.new_group(backend="gloo")
SEQS = ([1, 2, 3], [4, 5, 6], [7, 8, 9])

def build(tp, storage=None):
    alloc = PoolAllocator(PagedPool(32, 1, "kv"), torch)
    cfg = HiCacheConfig(host_slots=64, io="manual", load_back_threshold=0, storage=storage)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        hicache=cfg, tp_cache_group=group if tp else None))
    return cache, alloc

def tree(cache):
    out = []
    for n in cache.all_nodes():
        if n is not cache.root_node:
            out.append([list(n.key), n.value is not None, n.host_value is not None, n.lock_ref])
    return sorted(out)

def run(tp):
    cache, alloc = build(tp)
    ctl = cache.cache_controller
    log = []
    for toks in SEQS:  # write-through: each insert backs its node up, locked until the ack
        cache.insert(fast.InsertParams(key=fast.RadixKey(toks), value=alloc.alloc(3)))
    ctl.complete(3 if rank == 0 else 1, 0)  # rank 1's writes finish later
    cache.check_hicache_events()
    log.append(["writes left", len(ctl.ack_write_queue)])
    log.append(["evicted", cache.evict(fast.EvictParams(num_tokens=9)).num_tokens_evicted])
    log.append(["tree after writes", tree(cache)])
    ctl.complete(-1, 0)  # now every write is done on both ranks
    cache.check_hicache_events()
    cache.evict(fast.EvictParams(num_tokens=9))
    for toks in SEQS[:2]:  # two loads back, one ack each
        m = cache.match_prefix(fast.MatchPrefixParams(key=fast.RadixKey(toks)))
        req = type("Req", (), {"last_node": m.last_device_node})()
        cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, None, req))
        cache.ready_to_load_host_cache()
    ctl.complete(0, 2 if rank == 0 else 1)  # rank 1's second load finishes later
    cache.check_hicache_events()
    log.append(["loads left", len(ctl.ack_load_queue)])
    log.append(["evicted", cache.evict(fast.EvictParams(num_tokens=6)).num_tokens_evicted])
    log.append(["tree after loads", tree(cache)])
    ctl.complete(-1, -1)
    cache.check_hicache_events()
    log.append(["violations", cache.violations()])
    log.append(["final tree", tree(cache)])
    return log

results = {"tp": run(True), "no_tp": run(False)}
# a storage tier without its own groups takes the cache's group for the scheduler's side and
# a new group over the same ranks for its I/O (else it would decide per rank)
tp = build(True, StorageConfig(backend=FileStore(tempfile.mkdtemp()), io="manual"))[0]
tp = tp.storage_tier.config
results["storage"] = [tp.tp_group is group, tp.tp_io_group not in (None, group),
                      dist.get_process_group_ranks(tp.tp_io_group)]
dist.barrier(group=group)
dist.destroy_process_group()
print("RESULT " + json.dumps(results))
'''


def test_two_ranks_whose_acks_finish_at_different_times_end_with_identical_trees():
    r0, r1 = run_ranks(RANK)
    assert r0["tp"] == r1["tp"]
    log = dict((k, v) for k, v in r0["tp"] if k != "evicted")
    # MIN: one write processed on both ranks (two stay queued), so only [1, 2, 3] is unlocked
    # and evictable; later one load processed, so [4, 5, 6] stays locked on the device
    assert log["writes left"] == 2 and log["loads left"] == 1
    assert [k for k, v in r0["tp"] if k == "evicted"] == ["evicted", "evicted"]
    assert [v for k, v in r0["tp"] if k == "evicted"] == [3, 3]
    assert log["violations"] == []
    # without the group each rank processes its own acks and the trees part
    assert r0["no_tp"] != r1["no_tp"]
    assert [v for k, v in r0["no_tp"] if k == "evicted"] == [9, 6]
    assert [v for k, v in r1["no_tp"] if k == "evicted"] == [3, 3]
    assert r0["storage"] == r1["storage"] == [True, True, [0, 1]]


def test_a_tp_cache_group_that_is_not_a_process_group_is_refused():
    alloc = PoolAllocator(PagedPool(8, 1, "kv"), torch)
    with pytest.raises(fast.Unsupported, match="tp_cache_group"):
        fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=1, hicache=HiCacheConfig(host_slots=8), tp_cache_group=object()))
