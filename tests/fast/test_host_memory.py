"""A host copy owns its slot tensor: a host allocator that hands out views of its free list
(sglang's ``HostKVCache.alloc`` does) must not have each node's host value keep that whole list
alive. Found by ``uniradix bench --memory``: fast held 32.7 bytes per cached token under
write-through against upstream's 24.2, the difference being the host allocator's free-list
storage reached through the nodes' host values (upstream copies them)."""

import pytest

torch = pytest.importorskip("torch")

from uniradix import fast  # noqa: E402
from uniradix.conformance.env.pools import PoolAllocator  # noqa: E402
from uniradix.fast.hicache import HiCacheConfig  # noqa: E402
from uniradix.spec.world import PagedPool  # noqa: E402


class ViewHostAllocator:
    """Host slots handed out as views of one free-list tensor, the way sglang's host pool does."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.slots + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int):
        if n > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots) -> None:
        self.free_slots = torch.cat([self.free_slots, slots])


def _owns(t) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_values_do_not_keep_the_host_free_list_alive(policy):
    alloc = PoolAllocator(PagedPool(64, 1, "kv"), torch)
    host = ViewHostAllocator(1024)
    cache = fast.UnifiedRadixCache(fast.CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        hicache=HiCacheConfig(host_allocator=host, write_policy=policy)))
    nodes = []
    for first in range(1, 5):
        tokens = [first, 7, 8, 9]
        cache.insert(fast.InsertParams(key=fast.RadixKey(tokens), value=alloc.alloc(4)))
        node = cache.find_node(fast.RadixKey(tokens))
        if policy == "write_back":
            assert cache.write_backup(node, write_back=True) == 4
        nodes.append(node)
    cache.check_hicache_events()
    assert all(n.host_value is not None and _owns(n.host_value) for n in nodes)
    assert cache.violations() == []


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_host_allocator_s_own_tensors_are_kept_and_views_copied(policy):
    """fast's own host allocator hands out tensors of their own: those are kept without a copy;
    views (ViewHostAllocator, as sglang's) are copied."""
    for host, copied in ((None, False), (ViewHostAllocator(1024), True)):
        alloc = PoolAllocator(PagedPool(64, 1, "kv"), torch)
        cache = fast.UnifiedRadixCache(fast.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
            page_size=1, hicache=HiCacheConfig(host_allocator=host, host_slots=256,
                                               write_policy=policy)))
        handed: list = []
        pool = cache.cache_controller.mem_pool_host
        real = pool.alloc

        def spy(n, real=real, handed=handed):
            out = real(n)
            handed.append(out)
            return out

        pool.alloc = spy
        cache.insert(fast.InsertParams(key=fast.RadixKey([1, 2, 3, 4]), value=alloc.alloc(4)))
        node = cache.find_node(fast.RadixKey([1, 2, 3, 4]))
        if policy == "write_back":
            assert cache.write_backup(node, write_back=True) == 4
        cache.check_hicache_events()
        assert len(handed) == 1 and node.host_value is not None and _owns(node.host_value)
        assert (node.host_value is not handed[0]) is copied
        assert node.host_value.tolist() == handed[0].tolist()
        assert cache.violations() == []


@pytest.mark.parametrize("comp", ["swa", "mamba"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_aux_host_values_do_not_keep_the_aux_host_free_list_alive(policy, comp):
    """The SWA and Mamba components' host copies, likewise: the bench's SWA host pool hands
    out views of its free list (as sglang's does; before the copy, ``bench --memory`` found
    fast holding 65.2 bytes per cached token under write-through with SWA against upstream's
    40.2), and so does its Mamba host state pool (a state slot is one int64 of its own)."""
    import dataclasses

    from uniradix.conformance.bench import loop as L
    from uniradix.conformance.bench.configs import BenchConfig, config_bundle
    w = L.shared_prefix_workload(page_size=1, requests=40)
    w = dataclasses.replace(w, kv_slots=4 * w.kv_slots)  # room: nothing evicted
    keep: list = []
    L.run_bench(config_bundle("fast", BenchConfig(("full", comp), policy), 1), w, keep=keep)
    cache = keep[0]
    if policy == "write_back":  # (write-back backs up on eviction: back every leaf up now)
        stack = list(cache.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node.host_value is None:
                cache.write_backup(node, write_back=True)
        cache.check_hicache_events()
    stack, held = list(cache.root_node.children.values()), []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        held += [r.host_value for r in node.aux if r.host_value is not None]
    assert held and all(_owns(t) for t in held)
    assert all(t.dtype is torch.int64 and t.shape == (len(t),) for t in held)
    assert cache.violations() == []
