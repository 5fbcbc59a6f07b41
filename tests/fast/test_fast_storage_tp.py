"""Tensor-parallel decisions of the fast storage tier (fast/tiers/storage.py): two processes
joined by torch.distributed over gloo on loopback, each with its own file store that sees a
different storage progress (one store has only half of a prompt's pages; one rank's read
comes back short), end with identical trees, because hit counts and inserted tokens are reduced with MIN,
termination with MAX and the control queues drain the MIN of their lengths.  Once with the
tier's own groups, once with only the cache's ``tp_cache_group`` (the tier derives its groups
from it).  Then ``close()``: the derived I/O group is destroyed on both ranks, given groups
and the cache's group are kept (tests/fast/test_fast_storage_close.py has the rest of what close
releases).  The test starts both processes and stops them (killed if they outlive the timeout)."""

from __future__ import annotations

import pytest

from ranks import run_ranks

pytest.importorskip("torch")

RANK = r'''
import json, sys, threading, torch, torch.distributed as dist
from uniradix import fast, kernels
from uniradix.conformance.env.pools import PoolAllocator
from uniradix.fast.hicache import HiCacheConfig
from uniradix.fast.storage import Fault, FaultyBackend, FileStore
from uniradix.fast.tiers.storage import StorageConfig
from uniradix.spec.world import PagedPool

rank, port, directory, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
group, io_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
# "given": the storage tier's own groups; "derived": only the cache's tp_cache_group, from
# which the tier derives its groups (a collective when the cache is built)
groups = dict(tp_group=group, tp_io_group=io_group) if mode == "given" else {}
PS = 4
geo = kernels.KVGeometry.mha(2, 2, 4, PS, torch.float32)

def world(store, policy):
    dev = kernels.DevicePool.allocate(geo, 64 + PS)
    host = kernels.HostPool.allocate(geo, kernels.Layout.PAGE_FIRST, 160 + PS, pin_memory=False)
    alloc = PoolAllocator(PagedPool(64, PS, "kv"), torch, whole_pages=True)
    store.register_mem_pool_host(host)
    storage = StorageConfig(backend=store, io="threads", prefetch_threshold=PS,
                            prefetch_stop_policy=policy, **groups)
    cfg = HiCacheConfig(host_slots=160, io="sync", device_kv=dev, host_kv=host, copy_impl="torch",
                        load_back_threshold=0, storage=storage)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=PS,
        hicache=cfg, tp_cache_group=None if mode == "given" else group))
    tp = cache.storage_tier.config
    if mode == "derived":  # the scheduler's side is the cache's group, the I/O side a new one
        assert tp.tp_group is group and tp.tp_io_group not in (None, group, io_group)
        assert dist.get_process_group_ranks(tp.tp_io_group) == [0, 1]
    return cache, alloc

def tree(cache):
    out = []
    for n in cache.all_nodes():
        if n is cache.root_node:
            continue
        path, cur = [], n
        while cur is not cache.root_node:
            path = list(cur.key) + path
            cur = cur.parent
        out.append([path, n.host_value is not None and len(n.host_value), n.value is not None,
                    list(cache.storage_tier.keys_of(n))])
    return sorted(out)

A = list(range(100, 124))  # 6 pages
B = list(range(300, 324))
# the stores: rank 0 has all of A and B, rank 1 half of A (its backup of A stopped early)
writer, alloc = world(FileStore(directory), "best_effort")
for toks in (A, B):
    cut = toks if rank == 0 or toks is B else toks[:12]
    writer.insert(fast.InsertParams(key=fast.RadixKey(cut), value=alloc.alloc(len(cut))))
writer.check_hicache_events()
assert writer.storage_tier.wait_idle(30)
writer.check_hicache_events()
writer.storage_tier.close()
dist.barrier(group=group)

store = FileStore(directory)
# rank 1's first read comes back short (2 pages of 3): wait_complete ends when it stops
backend = FaultyBackend(store).inject(Fault("get", "short", keep=2)) if rank == 1 else store
cache, alloc = world(backend, "wait_complete")
tier = cache.storage_tier
results = {}
for rid, toks in (("a", A), ("b", B)):
    results[rid + "_requested"] = tier.prefetch_from_storage(rid, cache.root_node, toks)
    while not tier.check_prefetch_progress(rid):
        pass
    results[rid + "_loaded"] = tier.pop_prefetch_loaded_tokens(rid)
assert tier.wait_idle(30)
dist.barrier(group=group)
cache.check_hicache_events()
assert cache.violations() == [], cache.violations()
results["tree"] = tree(cache)
results["host_free"] = cache.cache_controller.mem_pool_host.available_size()
io = tier.config.tp_io_group
tier.close()
# close(): a derived I/O group is destroyed on every rank, a given one is the caller's (kept);
# the caller's groups still reduce; the storage thread is gone; a second close does nothing
try:
    dist.get_process_group_ranks(io)
    results["io_group_after_close"] = True
except (KeyError, ValueError, RuntimeError):
    results["io_group_after_close"] = False
ones = torch.ones(1)
dist.all_reduce(ones, group=group)
results["group_after_close"] = int(ones.item())
results["storage_threads_after_close"] = sum(
    t.name == "uniradix-storage" and t.is_alive() for t in threading.enumerate())
tier.close()
dist.barrier(group=group)
dist.destroy_process_group()
print("RESULT " + json.dumps(results))
'''


@pytest.mark.parametrize("mode", ["given", "derived"])
def test_two_ranks_with_different_storage_progress_end_with_identical_trees(tmp_path, mode):
    dirs = [tmp_path / f"rank{rank}" for rank in (0, 1)]
    for d in dirs:
        d.mkdir()
    res = run_ranks(RANK, [[str(d), mode] for d in dirs])
    assert res[0]["tree"] == res[1]["tree"]
    assert res[0] == res[1]
    # A: the hit is rank 1's 3 pages (MIN), not rank 0's 6; rank 1's read stops after 2 of
    # them, which terminates the prefetch on both ranks (MAX) with what both had read by then
    # (MIN): 2 pages, or none when rank 0 had not read yet.  B: both stores have it all.
    assert res[0]["a_requested"] == res[0]["b_requested"] == 24
    assert res[0]["a_loaded"] in (0, 8) and res[0]["b_loaded"] == 24
    # close() destroyed the I/O group the tier derived, kept the caller's groups
    assert res[0]["io_group_after_close"] is (mode == "given")
    assert res[0]["group_after_close"] == 2 and res[0]["storage_threads_after_close"] == 0
