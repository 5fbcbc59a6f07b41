"""The drop-in, checked against sglang 0.5.13.post1 itself (needs sglang importable).

Run inside the upstream venv (scripts/upstream-venv.sh): VENV/bin/python -m pytest
tests/fast/test_dropin_upstream.py.  Everywhere else the module is skipped.

Every config is built from sglang's own classes: ``CacheInitParams``, ``RadixKey``, the param
types, ``ReqToTokenPool`` / ``HybridReqToTokenPool`` (its Mamba pool), and the allocators
(``TokenToKVPoolAllocator``, ``PagedTokenToKVPoolAllocator``, ``SWATokenToKVPoolAllocator``).
Two caches, sglang's ``UnifiedRadixCache`` and ``uniradix.fast.UnifiedRadixCache``, each over
its own copy of those objects, run the same scheduler-style workload; their outcomes (hit
lengths and slots, evictions, sizes after every request, a per-request digest, the
allocators' final free lists) must be identical.  Full (pages 1 and 16) also runs the request
path with sglang's own ``Req``: ``init_next_round_input`` (which calls ``match_prefix``),
chunked prefill through ``cache_unfinished_req``, decode, ``cache_finished_req`` and aborts,
over reused request rows.  Every eviction policy runs the tree workload (Full, SWA, Mamba, host
tier), the request path and streaming sessions (Full); sessions also run with SWA and Mamba; the
Mamba extra buffer runs over sglang's own ``HybridReqToTokenPool`` with it on; the host tier
with Mamba runs the request path as the bench builds it (sglang's host pools), load backs
given the request.
"""

from __future__ import annotations

import hashlib
import random
import types
from array import array

import pytest

from uniradix.conformance.adapters import upstream as upstream_mod

pytestmark = pytest.mark.upstream

if not upstream_mod.upstream_available():
    pytest.skip("upstream sglang is not importable here (build the venv with "
                "scripts/upstream-venv.sh and run pytest with its python)",
                allow_module_level=True)

up = upstream_mod.load_upstream()
torch = up.torch

from sglang.srt import server_args as sglang_server_args  # noqa: E402
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape  # noqa: E402
from sglang.srt.environ import envs  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor,
)
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams  # noqa: E402
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool  # noqa: E402
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, ReqToTokenPool  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

import uniradix.fast as fast  # noqa: E402
from uniradix.conformance.adapters.upstream_host import ModelController  # noqa: E402
from uniradix.conformance.adapters.upstream_hybrid import load_hybrid  # noqa: E402

CT = up.ComponentType
MAMBA_CHUNK = 8
# Slot numbers (and the allocator's free-list order) compared at every page size: uniradix
# frees an insert's duplicates one range per node, as sglang does, and its batched frees over
# sglang's paged allocator leave exactly the free list of one call per piece (fast/frees.py).
# (Off would leave slots out at page > 1 and compare the free list by length only.)
STRICT_SLOTS = True


class SwaKVData(BaseSWAKVPool):
    """The KV data pool the SWA allocator registers its full->SWA slot map with (no KV data:
    the cache moves slots only); the allocator itself is sglang's."""

    def __init__(self) -> None:
        self.full_kv_pool = self.swa_kv_pool = self.full_to_swa_index_mapping = None

    def register_mapping(self, mapping) -> None:
        self.full_to_swa_index_mapping = mapping

    def translate_loc_from_full_to_swa(self, kv_indices):
        return self.full_to_swa_index_mapping[kv_indices]


SwaKVData.__abstractmethods__ = frozenset()


@pytest.fixture(autouse=True)
def global_server_args(monkeypatch):
    """What sglang's Req and Mamba component read from the global server arguments."""
    monkeypatch.setattr(sglang_server_args, "_global_server_args", types.SimpleNamespace(
        strip_thinking_cache=False, mamba_cache_chunk_size=MAMBA_CHUNK))


def build(kind: str, ps: int, impl: str, kv_slots: int, policy: str = "lru"):
    """(cache, allocator, req_to_token_pool) of ``kind`` built from sglang's classes, under
    eviction policy ``policy``."""
    dt = torch.float16
    if kind == "mamba":
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=4, n_groups=1,
                                        num_heads=1, head_dim=2, state_size=2, conv_kernel=2)
        rtp = HybridReqToTokenPool(size=8, mamba_size=8, mamba_spec_state_size=8,
                                   max_context_len=512, device="cpu", enable_memory_saver=False,
                                   cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                                   mamba_layer_ids=[0], enable_mamba_extra_buffer=False)
    else:
        rtp = ReqToTokenPool(size=8, max_context_len=512, device="cpu", enable_memory_saver=False)
    if kind == "swa":
        alloc = SWATokenToKVPoolAllocator(kv_slots, kv_slots * 3 // 4, ps, dt, "cpu", SwaKVData(),
                                          False)
    elif ps == 1:
        alloc = TokenToKVPoolAllocator(kv_slots, dt, "cpu", None, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(kv_slots, ps, dt, "cpu", None, False)
    comps = {"full": (CT.FULL,), "host": (CT.FULL,), "swa": (CT.FULL, CT.SWA),
             "mamba": (CT.FULL, CT.MAMBA)}[kind]
    params = up.CacheInitParams(disable=False, req_to_token_pool=rtp,
                                token_to_kv_pool_allocator=alloc, page_size=ps,
                                tree_components=comps,
                                sliding_window_size=16 if kind == "swa" else None,
                                eviction_policy=policy)
    if kind == "swa" and impl == "upstream":
        # 0.5.13.post1's SWA component with the seed's LRU refresh and no leaf cap, the
        # documented difference (conformance/adapters/upstream_hybrid.py; docs/COMPAT.md)
        params.component_registry_override = {CT.SWA: load_hybrid().SeedEraSWAComponent}
    if impl == "fast":
        cache = fast.UnifiedRadixCache(params)
        if kind == "host":  # as SGLang's cache registry attaches a host tier
            cache.init_hicache(types.SimpleNamespace(
                hicache_write_policy="write_through", hicache_ratio=2.0, hicache_size=0,
                hicache_storage_backend=None), params)
            assert isinstance(cache, fast.HiCacheRadixCache)
    else:
        cache = up.UnifiedRadixCache(params)
        if kind == "host":  # upstream's host tier over the project's controller model
            host = fast.hicache.HostSlotAllocator(2 * kv_slots, ps)
            cache.cache_controller = ModelController("write_through", host, alloc,
                                                     done_on_submit=True)
            cache.write_through_threshold = 1
            cache.load_back_threshold = 10
            cache.components[CT.FULL]._full_kv_pool_host = host
    return cache, alloc, rtp


def free_list(alloc) -> list:
    if isinstance(alloc, SWATokenToKVPoolAllocator):
        return [free_list(alloc.full_attn_allocator), free_list(alloc.swa_attn_allocator)]
    return torch.cat([alloc.free_pages, alloc.release_pages]).tolist()


def prompts(seed: int, n: int):
    """Requests over a few shared templates (frequent partial hits and splits)."""
    rng = random.Random(seed)
    templates = [[rng.randrange(1, 50) for _ in range(rng.randrange(20, 70))] for _ in range(6)]
    for _ in range(n):
        t = rng.choice(templates)
        body = t[: rng.randrange(1, len(t) + 1)] + [rng.randrange(1, 50)
                                                      for _ in range(rng.randrange(1, 30))]
        yield body, rng.randrange(1, 24), rng.random()


def tree_workload(kind: str, ps: int, impl: str, seed: int = 0, n: int = 400,
                  policy: str = "lru") -> dict:
    """The scheduler's tree calls: match, lock, evict when short, allocate, later insert the
    page-aligned tokens (duplicates freed by the cache), free the tail, unlock; up to 4
    requests in flight.  Mamba: one state per request, freed by the caller when the node
    already had one.  Under a ``policy`` other than lru each insert has a priority (drawn
    from the request's draw)."""
    kv_slots = 1024
    cache, alloc, rtp = build(kind, ps, impl, kv_slots, policy)
    swa = kind == "swa"
    mamba_alloc = rtp.mamba_allocator if kind == "mamba" else None
    log, running = [], []
    digest = hashlib.blake2b(digest_size=16)

    def sizes():
        out = [cache.evictable_size(), cache.protected_size()]
        if swa:
            out += [cache.swa_evictable_size(), cache.swa_protected_size()]
        if mamba_alloc is not None:
            out += [cache.mamba_evictable_size(), cache.mamba_protected_size()]
        return out

    def finish(r):
        tokens, value, hit, node, lock, mslot, priority = r
        aligned = len(tokens) // ps * ps
        res = cache.insert(up.InsertParams(
            key=up.RadixKey(array("q", tokens[:aligned])), value=value[:aligned].clone(),
            prev_prefix_len=hit, mamba_value=mslot, priority=priority))
        if aligned < len(value):
            alloc.free(value[aligned:])
        if mslot is not None and res.mamba_exist:
            mamba_alloc.free(mslot)
        cache.dec_lock_ref(node, lock.to_dec_params())
        # mamba_exist means something with Mamba only (upstream answers True for an empty
        # key whatever the components; uniradix's Full cache answers False)
        entry = ("done", int(res.prefix_len), bool(res.mamba_exist) if mslot is not None else None,
                 sizes())
        digest.update(repr(entry).encode())
        log.append(entry)

    history = []
    for prompt, out_len, u in prompts(seed, n):
        while len(running) >= 4:
            finish(running.pop(0))
        if u < 0.3 and history:  # a next turn: a whole earlier sequence plus new tokens
            prompt = history[int(u * 1000) % len(history)] + prompt[-4:]
        m = cache.match_prefix(up.MatchPrefixParams(key=up.RadixKey(array("q", prompt))))
        node, indices, loaded = m.last_device_node, m.device_indices, 0
        if m.host_hit_length > 0:  # the host part is loaded back, as the scheduler does
            new, node = cache.init_load_back(InitLoadBackParams(
                best_match_node=m.best_match_node, host_hit_length=m.host_hit_length,
                req=types.SimpleNamespace(last_node=node)))
            cache.ready_to_load_host_cache()
            loaded = len(new)
            indices = torch.cat([indices, new])
        hit = len(indices)
        lock = cache.inc_lock_ref(node)
        tokens = prompt + [(t * 7 + 3) % 50 + 1 for t in prompt[:out_len]]
        history = (history + [tokens])[-8:]
        need = -(-len(tokens) // ps) * ps - hit
        short = need - alloc.available_size()
        ev = cache.evict(up.EvictParams(num_tokens=max(short, 0),
                                        swa_num_tokens=max(short, 0) if swa else 0,
                                        mamba_num=1 if mamba_alloc is not None
                                        and mamba_alloc.available_size() == 0 else 0))
        evicted = (ev.num_tokens_evicted, ev.swa_num_tokens_evicted, ev.mamba_num_evicted)
        slots = alloc.alloc(need)
        mslot = mamba_alloc.alloc(1) if mamba_alloc is not None else None
        entry = ("admit", hit, loaded, indices.tolist() if STRICT_SLOTS or ps == 1 else None,
                 evicted, slots is None, sizes())
        digest.update(repr(entry).encode())
        log.append(entry)
        if slots is None or (mamba_alloc is not None and mslot is None):
            if slots is not None:
                alloc.free(slots)
            cache.dec_lock_ref(node, lock.to_dec_params())
            continue
        priority = 0 if policy == "lru" else int(u * 1000) % 5 - 1
        running.append((tokens, torch.cat([indices, slots]), hit, node, lock, mslot, priority))
        if hasattr(cache, "check_hicache_events"):
            cache.check_hicache_events()
    while running:
        finish(running.pop(0))
    if hasattr(cache, "check_hicache_events"):
        cache.check_hicache_events()
    return {"log": log, "digest": digest.hexdigest(), "sizes": sizes(),
            "free_list": free_list(alloc) if STRICT_SLOTS or ps == 1 else len(free_list(alloc))}


CONFIGS = [("full", 1), ("full", 16), ("swa", 1), ("mamba", 1), ("host", 1), ("host", 16)]


@pytest.mark.parametrize("kind, ps", CONFIGS, ids=[f"{k}-p{p}" for k, p in CONFIGS])
def test_tree_workload_same_outcomes(kind, ps):
    ours = tree_workload(kind, ps, "fast")
    theirs = tree_workload(kind, ps, "upstream")
    assert len(ours["log"]) == len(theirs["log"])
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"request event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    hits = sum(e[1] for e in ours["log"] if e[0] == "admit")
    evicted = sum(sum(e[4]) for e in ours["log"] if e[0] == "admit")
    assert hits > 0 and evicted > 0  # the workload exercises both
    if kind == "host":
        assert sum(e[2] for e in ours["log"] if e[0] == "admit") > 0  # and loads back


POLICIES = ("lfu", "fifo", "mru", "filo", "priority", "slru")
POLICY_CONFIGS = [(k, p) for k in ("full", "swa", "mamba", "host") for p in POLICIES]


@pytest.mark.parametrize("kind, policy", POLICY_CONFIGS,
                         ids=[f"{k}-p1-{p}" for k, p in POLICY_CONFIGS])
def test_tree_workload_same_outcomes_under_each_policy(kind, policy):
    """sglang's cache and uniradix's, both built with ``eviction_policy`` from sglang's
    ``CacheInitParams`` (fast: the composed tree, fast/policies.py), give the same outcomes;
    and the policy matters (the outcomes differ from the lru run's)."""
    ours = tree_workload(kind, 1, "fast", policy=policy, n=250)
    theirs = tree_workload(kind, 1, "upstream", policy=policy, n=250)
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"request event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    assert sum(sum(e[4]) for e in ours["log"] if e[0] == "admit") > 0  # it evicts
    assert ours["digest"] != tree_workload(kind, 1, "fast", n=250)["digest"]  # lru's differ


@pytest.mark.parametrize("policy", ["LFU", "Priority"])
def test_a_policy_name_in_any_case_is_read_as_upstream_reads_it(policy):
    cache, _, _ = build("full", 1, "fast", 64, policy)
    theirs, _, _ = build("full", 1, "upstream", 64, policy)
    assert cache.eviction_policy == theirs.eviction_policy == policy.lower()


# -- the request path with sglang's own Req ------------------------------------------------------


def arrivals(seed: int, n: int, running: list, limit: int, finish):
    """:func:`prompts` numbered, each once fewer than ``limit`` requests run: the oldest
    running ones finish first (``finish(req, aborted)``; requests r*3 are aborted)."""
    for k, (prompt, out_len, u) in enumerate(prompts(seed, n)):
        while len(running) >= limit:
            req = running.pop(0)
            finish(req, req.rid.endswith("3"))
        yield k, prompt, out_len, u


class Rows:
    """Request rows, lowest free first (a finished request's row is the next one's)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def take(self) -> int:
        self.free.sort()
        return self.free.pop(0)


def request_workload(kind: str, ps: int, impl: str, seed: int = 1, n: int = 250,
                     policy: str = "lru") -> dict:
    """sglang's Req through the scheduler's calls: admission (``init_next_round_input`` then
    a lock), prefill in one or two chunks (``cache_unfinished_req`` after a non-final chunk),
    decode one token at a time (a page allocated when the last one is full), then
    ``cache_finished_req`` or, for some, an abort (``is_insert=False``).  Under a ``policy``
    other than lru each request has a priority, which its inserts carry."""
    kv_slots = 1024
    cache, alloc, rtp = build(kind, ps, impl, kv_slots, policy)
    rows = Rows(rtp.size)
    log = []
    digest = hashlib.blake2b(digest_size=16)

    def record(entry):
        digest.update(repr(entry).encode())
        log.append(entry)

    def reserve(req, upto: int) -> bool:
        """Pages for positions up to ``upto`` (evicting when short); writes nothing."""
        have = -(-req.kv_committed_len // ps) * ps if req.spare is None else \
            req.kv_committed_len + len(req.spare)
        need = -(-upto // ps) * ps - have
        if need <= 0:
            return True
        short = need - alloc.available_size()
        if short > 0:
            record(("evict", cache.evict(up.EvictParams(num_tokens=short)).num_tokens_evicted))
        slots = alloc.alloc(need)
        if slots is None:
            return False
        req.spare = slots if req.spare is None else torch.cat([req.spare, slots])
        return True

    def compute(req, k: int) -> None:
        """``k`` more positions computed: their slots go into the row."""
        c = req.kv_committed_len
        rtp.write((req.req_pool_idx, slice(c, c + k)), req.spare[:k].to(torch.int32))
        req.spare = req.spare[k:]
        req.kv_committed_len = c + k
        req.kv_allocated_len = c + k

    running = []
    for k, (prompt, out_len, u) in enumerate(prompts(seed, n)):
        while len(running) >= 3:
            req, _ = running.pop(0)
            aborted = req.rid.endswith("3")
            cache.cache_finished_req(req, is_insert=not aborted)
            rows.free.append(req.req_pool_idx)
            record(("finish", req.rid, aborted, cache.evictable_size(), cache.protected_size(),
                    alloc.available_size()))
        req = Req(rid=f"r{k}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(max_new_tokens=out_len),
                  priority=None if policy == "lru" else int(u * 1000) % 5 - 1)
        req.init_next_round_input(tree_cache=cache)
        loaded = 0
        if req.needs_host_load_back():  # the host part comes back, as the scheduler does
            new, req.last_node = cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length,
                req=req))
            cache.ready_to_load_host_cache()
            req.prefix_indices = torch.cat([req.prefix_indices, new])
            loaded = len(new)
            req.cache_protected_len = len(req.prefix_indices)
        hit = len(req.prefix_indices)
        cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = rows.take()
        req.spare = None
        rtp.write((req.req_pool_idx, slice(0, hit)), req.prefix_indices.to(torch.int32))
        req.kv_committed_len = hit
        record(("admit", req.rid, hit, loaded,
                req.prefix_indices.tolist() if STRICT_SLOTS or ps == 1 else None))
        chunk = len(prompt) - hit
        if u < 0.4 and chunk > ps + 1:  # chunked prefill: the first part, cached unfinished
            first = chunk // 2
            if reserve(req, hit + first):
                compute(req, first)
                req.fill_len = hit + first
                cache.cache_unfinished_req(req, chunked=True)
                record(("chunk", req.rid, req.cache_protected_len, cache.protected_size()))
        if not reserve(req, len(prompt)):
            cache.cache_finished_req(req, is_insert=False)
            rows.free.append(req.req_pool_idx)
            record(("no-room", req.rid))
            continue
        compute(req, len(prompt) - req.kv_committed_len)
        req.fill_len = len(prompt)
        for j in range(out_len):  # decode
            if not reserve(req, req.kv_committed_len + 1):
                break
            req.output_ids.append((prompt[j % len(prompt)] * 7 + j) % 50 + 1)
            compute(req, 1)
        running.append((req, None))
        if kind == "host":
            cache.check_hicache_events()
    for req, _ in running:
        cache.cache_finished_req(req)
        rows.free.append(req.req_pool_idx)
    record(("end", cache.evictable_size(), cache.protected_size(), alloc.available_size()))
    return {"log": log, "digest": digest.hexdigest(),
            "free_list": free_list(alloc) if STRICT_SLOTS or ps == 1 else len(free_list(alloc))}


REQUEST_CONFIGS = [("full", 1), ("full", 16), ("host", 1), ("host", 16)]


@pytest.mark.parametrize("kind, ps", REQUEST_CONFIGS, ids=[f"{k}-p{p}" for k, p in REQUEST_CONFIGS])
def test_request_path_same_outcomes(kind, ps):
    ours = request_workload(kind, ps, "fast")
    theirs = request_workload(kind, ps, "upstream")
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"request event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    assert any(e[0] == "chunk" for e in ours["log"]) and any(e[0] == "evict" for e in ours["log"])
    assert any(e[0] == "admit" and e[2] > 0 for e in ours["log"])
    if kind == "host":
        assert any(e[0] == "admit" and e[3] > 0 for e in ours["log"])  # loads back


@pytest.mark.parametrize("policy", POLICIES)
def test_request_path_same_outcomes_under_each_policy(policy):
    """sglang's Req, with a priority, through both caches under each policy."""
    ours = request_workload("full", 1, "fast", policy=policy, n=150)
    theirs = request_workload("full", 1, "upstream", policy=policy, n=150)
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"request event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    assert any(e[0] == "evict" for e in ours["log"])


# -- the double free, with sglang's paged allocator ----------------------------------------------


@pytest.mark.parametrize("mode", ["insert", "no_insert", "disabled"])
def test_finished_req_with_a_reused_row_keeps_the_trees_pages(mode):
    """Page 4.  Request A's 8 tokens fill row 0 and are cached; request B reuses row 0 with 6
    committed tokens, so positions 6 and 7 of the row still name A's slots.  Finishing B may
    free B's pages only: freeing past its committed length hands a page the tree (or, with the
    cache disabled, another holder) owns back to sglang's allocator: two owners of one page.
    (On a fresh row the stale positions are 0: the padding page.)"""
    ps = 4
    rtp = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(64, ps, torch.float16, "cpu", None, False)
    cache = fast.UnifiedRadixCache(up.CacheInitParams(
        disable=mode == "disabled", req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc,
        page_size=ps, tree_components=(CT.FULL,)))

    def run(rid, tokens, committed):
        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.init_next_round_input(tree_cache=cache)
        cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = 0
        slots = alloc.alloc(-(-committed // ps) * ps)
        rtp.write((0, slice(0, committed)), slots[:committed].to(torch.int32))
        req.kv_committed_len = committed
        return req

    cache.cache_finished_req(run("a", [1, 2, 3, 4, 5, 6, 7, 8], 8))
    held_pages = {s // ps for n in cache.all_nodes() if n is not cache.root_node
                  for s in n.value.tolist()}
    # someone else's pages: with the cache disabled, A's pages were freed, and the other
    # holder now owns the page A's positions 4..7 were on
    other = {s // ps for s in alloc.alloc(2 * ps if mode == "disabled" else ps).tolist()}
    b = run("b", [9, 9, 9, 9, 7, 7], 6)
    b_pages = {s // ps for s in rtp.req_to_token[0, :6].tolist()}
    cache.cache_finished_req(b, is_insert=mode != "no_insert")
    free = alloc.free_pages.tolist()
    assert len(free) == len(set(free)), "a page is in the free list twice"
    assert not held_pages & set(free), "a page the tree holds was freed"
    assert not other & set(free), "a page another holder owns was freed"
    if mode == "insert":
        assert sorted(set(free) & b_pages) == [max(b_pages)]  # the partial page only
    else:
        assert b_pages <= set(free)
    cache.sanity_check()


def test_unfinished_req_reads_sglangs_req():
    """0.5.13.post1's Req has no ``fill_ids``; a chunked prefill caches ``get_fill_ids()``."""
    ps = 4
    rtp = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(64, ps, torch.float16, "cpu", None, False)
    cache = fast.UnifiedRadixCache(up.CacheInitParams(
        disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=(CT.FULL,)))
    req = Req(rid="a", origin_input_text="", origin_input_ids=array("q", range(1, 12)),
              sampling_params=SamplingParams(max_new_tokens=1))
    assert not hasattr(req, "fill_ids")
    req.init_next_round_input(tree_cache=cache)
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = 0
    rtp.write((0, slice(0, 8)), alloc.alloc(8).to(torch.int32))
    req.fill_len = req.kv_committed_len = 8
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 8 and cache.protected_size() == 8


def test_settings_from_sglangs_params_are_refused_by_name():
    rtp = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
    alloc = TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False)
    for field, value in [("eviction_policy", "random"), ("cache_ttl_seconds", 60.0)]:
        params = up.CacheInitParams(disable=False, req_to_token_pool=rtp,
                                    token_to_kv_pool_allocator=alloc, page_size=1,
                                    tree_components=(CT.FULL,), **{field: value})
        with pytest.raises(fast.Unsupported, match=field):
            fast.UnifiedRadixCache(params)


def test_events_and_metrics_asked_for_by_sglangs_params_are_honoured():
    """``enable_kv_cache_events`` / ``enable_metrics`` from sglang's own params: the same first
    events as sglang's cache gives for the same inserts (its hashes leave extra_key out, so the
    fast cache is asked for ``compat`` hashes), and the cache's metrics."""
    import importlib.util

    rtp = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
    metrics = importlib.util.find_spec("prometheus_client") is not None
    if not metrics:  # refused by name, with what to install
        with pytest.raises(fast.Unsupported, match="enable_metrics.*prometheus_client"):
            fast.UnifiedRadixCache(up.CacheInitParams(
                disable=False, req_to_token_pool=rtp, page_size=1, tree_components=(CT.FULL,),
                token_to_kv_pool_allocator=TokenToKVPoolAllocator(8, torch.float16, "cpu", None,
                                                                  False), enable_metrics=True))
    streams = []
    for impl in ("fast", "upstream"):
        alloc = TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False)
        params = up.CacheInitParams(disable=False, req_to_token_pool=rtp,
                                    token_to_kv_pool_allocator=alloc, page_size=1,
                                    tree_components=(CT.FULL,), enable_kv_cache_events=True,
                                    enable_metrics=metrics and impl == "fast")
        if impl == "fast":
            params.kv_events_key_mode = "compat"
            cache = fast.UnifiedRadixCache(params)
            assert (cache.metrics is not None) == metrics
        else:
            cache = up.UnifiedRadixCache(params)
        cache.take_events()
        for toks in ([1, 2, 3, 4], [1, 2, 9]):
            cache.insert(up.InsertParams(key=up.RadixKey(array("q", toks), "tenant"),
                                         value=alloc.alloc(len(toks)).to(torch.int64)))
        cache.evict(up.EvictParams(num_tokens=1))
        streams.append(sorted((type(e).__name__, list(e.block_hashes)) for e in cache.take_events()))
    assert streams[0] == streams[1] and streams[0]


def test_available_and_evictable_str_matches_upstream():
    for kind in ("full", "swa", "mamba"):
        texts = []
        for impl in ("fast", "upstream"):
            cache, alloc, rtp = build(kind, 1, impl, 64)
            texts.append(cache.available_and_evictable_str())
        assert texts[0] == texts[1], kind


# -- streaming sessions (fast/sessions.py against sglang's StreamingSession) ----------------------


def session_workload(impl: str, seed: int = 3, n: int = 150, kind: str = "full",
                     policy: str = "lru") -> dict:
    """Three streaming sessions taking turns with sglang's own Req (its ``session`` a streaming
    one): admission through ``init_next_round_input`` (a session's next turn restored from its
    slot), prefill (chunked, or through the tree), decode, then ``cache_finished_req`` (parks)
    or an abort (``FINISH_ABORT``: the session goes); ``release_session`` now and then.

    ``kind`` "swa": the lock's ``swa_uuid_for_lock`` kept on the Req as the scheduler's
    ``_req_inc_lock_ref`` keeps it, and before each decode step the scheduler's ``_evict_swa``
    (the request's own positions more than a window and a page behind drop their SWA slots).
    "mamba": at admission a request without a state slot takes one from the request pool's
    ``mamba_allocator`` (one state evicted first when it is empty), as
    ``HybridReqToTokenPool.alloc`` does; a restored turn has its session's.  ``policy``: the
    caches' eviction policy."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    cache, alloc, rtp = build(kind, 1, impl, 96, policy)
    rows = Rows(rtp.size)
    rng = random.Random(seed)
    log: list = []
    history: dict = {}  # session -> its parked tokens
    session_row: dict = {}  # session -> the row its slot holds
    window = 16  # build's sliding_window_size

    def held():
        out = (cache.session_held_tokens(), cache.session_held_req_count(),
               cache.evictable_size(), cache.protected_size(), alloc.available_size())
        if kind == "swa":
            out += (cache.session_held_swa_tokens(), cache.swa_evictable_size(),
                    alloc.swa_available_size())
        if kind == "mamba":
            out += (cache.session_held_mamba_slots(), rtp.mamba_allocator.available_size())
        return out

    def evict_swa(req):
        req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, req.cache_protected_len)
        new = max(req.swa_evicted_seqlen, req.kv_committed_len - window - 1)
        if new > req.swa_evicted_seqlen:
            alloc.free_swa(rtp.req_to_token[req.req_pool_idx, req.swa_evicted_seqlen:new]
                           .to(torch.int64))
            req.swa_evicted_seqlen = new

    def end_session(sid):
        history.pop(sid, None)
        if sid in session_row:
            rows.free.append(session_row.pop(sid))

    for k in range(n):
        sid = rng.choice(["s1", "s2", "s3"])
        if sid in history and rng.random() < 0.1:
            cache.release_session(sid)
            end_session(sid)
            log.append(("release", sid, held()))
            continue
        new = [rng.randint(1, 4) for _ in range(rng.randint(2, 6))]
        prompt = history.get(sid, []) + new
        req = Req(rid=f"r{k}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(max_new_tokens=4))
        req.session = types.SimpleNamespace(session_id=sid, streaming=True,
                                            finish_req=lambda r: None, abort_req=lambda: None)
        req.init_next_round_input(tree_cache=cache)
        hit = len(req.prefix_indices)
        lock = cache.inc_lock_ref(req.last_node)
        if kind == "swa":
            req.swa_uuid_for_lock = lock.swa_uuid_for_lock
        if kind == "mamba" and req.mamba_pool_idx is None:
            if rtp.mamba_allocator.available_size() == 0:
                log.append(("evict-state", cache.evict(up.EvictParams(mamba_num=1)).mamba_num_evicted))
            req.mamba_pool_idx = rtp.mamba_allocator.alloc(1)[0]
        if req.req_pool_idx is None:
            req.req_pool_idx = rows.take()
        rtp.write((req.req_pool_idx, slice(0, hit)), req.prefix_indices.to(torch.int32))
        req.kv_committed_len = req.kv_allocated_len = hit
        log.append(("admit", sid, hit, req.prefix_indices.tolist(), req.cache_protected_len))
        row = req.req_pool_idx
        need = len(prompt) + 4 - hit
        if need > alloc.available_size():
            log.append(("evict", cache.evict(up.EvictParams(
                num_tokens=need - alloc.available_size())).num_tokens_evicted))
        slots = alloc.alloc(need) if need <= alloc.available_size() else None
        aborted = slots is None or rng.random() < 0.1
        if slots is not None:
            c = hit
            first = (len(prompt) - hit) // 2
            if first and rng.random() < 0.5:  # a chunk, cached unfinished
                rtp.write((row, slice(c, c + first)), slots[:first].to(torch.int32))
                c = req.kv_committed_len = req.kv_allocated_len = c + first
                req.fill_len = c
                cache.cache_unfinished_req(req, chunked=True)
            rtp.write((row, slice(c, len(prompt))), slots[c - hit: len(prompt) - hit]
                      .to(torch.int32))
            req.kv_committed_len = req.kv_allocated_len = len(prompt)
            req.fill_len = len(prompt)
            if rng.random() < 0.5:  # the final prefill through cache_unfinished_req
                cache.cache_unfinished_req(req)
            for j in range(4):
                if kind == "swa":
                    evict_swa(req)
                req.output_ids.append((prompt[j % len(prompt)] * 7 + j) % 5 + 1)
                pos = len(prompt) + j
                rtp.write((row, slice(pos, pos + 1)),
                          slots[pos - hit: pos - hit + 1].to(torch.int32))
                req.kv_committed_len = req.kv_allocated_len = pos + 1
        if aborted:
            req.finished_reason = FINISH_ABORT()
        first_turn = sid not in session_row
        cache.cache_finished_req(req)
        if aborted:
            if first_turn:
                rows.free.append(row)
            end_session(sid)
        else:
            history[sid] = list(req.origin_input_ids) + list(req.output_ids)
            session_row[sid] = row
        log.append(("finish", sid, aborted, held()))
    return {"log": log, "free_list": free_list(alloc)}


@pytest.mark.parametrize("kind", ["full", "swa", "mamba"])
def test_streaming_sessions_same_outcomes(kind):
    ours = session_workload("fast", kind=kind)
    theirs = session_workload("upstream", kind=kind)
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"session event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    log = ours["log"]
    assert sum(1 for e in log if e[0] == "admit" and e[2] > 0 and e[4] < e[2]) >= 10  # restores
    assert any(e[0] == "release" for e in log) and any(e[0] == "finish" and e[2] for e in log)
    finishes = [e[3] for e in log if e[0] == "finish"]
    if kind == "swa":  # parked rows whose window start moved past their protected length
        assert any(h[5] < h[0] for h in finishes)
    if kind == "mamba":  # parked state slots
        assert max(h[5] for h in finishes) >= 2


@pytest.mark.parametrize("policy", POLICIES)
def test_streaming_sessions_same_outcomes_under_each_policy(policy):
    """Sessions under every eviction policy other than lru (lru: above): parked turns,
    restores and the evictions between them, identical to sglang's."""
    ours = session_workload("fast", policy=policy)
    theirs = session_workload("upstream", policy=policy)
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"session event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    assert any(e[0] == "evict" for e in ours["log"])


# -- the Mamba extra buffer, with sglang's own request pool ----------------------------------------


def xbuf_workload(ps: int, overlap: bool, impl: str, seed: int = 5, n: int = 160,
                  interval: int = 8, lazy: bool = False, mamba_size: int = 12) -> dict:
    """``enable_mamba_extra_buffer=True`` on sglang's ``HybridReqToTokenPool`` (two track slots
    with the overlap schedule, one without) and on ``CacheInitParams``.  sglang's own Req
    through the scheduler's calls: ``init_next_round_input`` (a Mamba cache's match copies the
    matched state into the request, ``cow_mamba``), a lock, sglang's ``alloc_req_slots`` (three
    states a request, the shortfall evicted; the pool's ``alloc`` takes the request's state and
    track slots), prefill in one or two page-aligned chunks with ``cache_unfinished_req``
    after each, decode one token at a time, then ``cache_finished_req`` or an abort.  The track
    points are the scheduler's (``_mamba_radix_cache_v2_req_prepare_for_extend``,
    ``_mamba_check_track_boundary``), by spec/requests.py's rules.  ``lazy``: the pool and
    the params built with ``enable_mamba_extra_buffer_lazy`` (two states a request at
    admission); a decode track point runs sglang's own scheduler steps, ``ScheduleBatch.
    mamba_lazy_prealloc_at_boundary`` before the forward and ``SchedulerBatchResultProcessor.
    mamba_lazy_post_decode_at_boundary`` after it (a request finishes on its last decode
    step), and the finish passes ``req.mamba_lazy_is_insert``; sglang's
    ``SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL`` fails the fresh slots of requests r*7."""
    from sglang.srt.mem_cache.common import alloc_req_slots

    from uniradix.spec.requests import decode_track_lens, extend_track_len
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=4, n_groups=1,
                                    num_heads=1, head_dim=2, state_size=2, conv_kernel=2)
    rtp = HybridReqToTokenPool(size=8, mamba_size=mamba_size, mamba_spec_state_size=mamba_size,
                               max_context_len=512, device="cpu", enable_memory_saver=False,
                               cache_params=Mamba2CacheParams(shape=shape, layers=[0]),
                               mamba_layer_ids=[0], enable_mamba_extra_buffer=True,
                               enable_mamba_extra_buffer_lazy=lazy,
                               enable_overlap_schedule=overlap)
    kv_slots = 256
    alloc = TokenToKVPoolAllocator(kv_slots, torch.float16, "cpu", None, False) if ps == 1 \
        else PagedTokenToKVPoolAllocator(kv_slots, ps, torch.float16, "cpu", None, False)
    params = up.CacheInitParams(disable=False, req_to_token_pool=rtp,
                                token_to_kv_pool_allocator=alloc, page_size=ps,
                                tree_components=(CT.FULL, CT.MAMBA),
                                enable_mamba_extra_buffer=True,
                                enable_mamba_extra_buffer_lazy=lazy)
    cache = fast.UnifiedRadixCache(params) if impl == "fast" else up.UnifiedRadixCache(params)
    log: list = []

    def states():
        return (rtp.mamba_allocator.available_size(), cache.mamba_evictable_size(),
                cache.mamba_protected_size(), cache.evictable_size(), cache.protected_size(),
                alloc.available_size())

    def track(req, at):
        req.mamba_last_track_seqlen = at
        if not lazy:  # (lazy: a chunk's track point writes the only track slot in place)
            req.mamba_next_track_idx = rtp.get_mamba_ping_pong_other_idx(
                req.mamba_next_track_idx)

    def lazy_decode_track(req, last):
        """sglang's lazy steps around the forward of one decode token (the request finishing
        on it when ``last``)."""
        batch = types.SimpleNamespace(reqs=[req], req_to_token_pool=rtp, tree_cache=cache,
                                      seq_lens_cpu=torch.tensor([req.kv_committed_len]))
        # requests r*7: sglang's own test switch fails the fresh slot (the state goes over
        # the only track slot; finishing on that step, the request caches nothing)
        with envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.override(req.rid.endswith("7")):
            ScheduleBatch.mamba_lazy_prealloc_at_boundary(batch, interval)
        if last:
            req.finished_reason = FINISH_LENGTH(length=req.kv_committed_len)
        if req.kv_committed_len % interval == 0:
            req.mamba_last_track_seqlen = req.kv_committed_len
            SchedulerBatchResultProcessor.mamba_lazy_post_decode_at_boundary(None, req, batch)
            log.append(("decode-track", req.rid, req.mamba_ping_pong_track_buffer.tolist(),
                        req.mamba_next_track_idx, req.mamba_lazy_is_insert, states()))

    def compute(req, k):
        c = req.kv_committed_len
        need = -(-(c + k) // ps) * ps - -(-c // ps) * ps
        if need > alloc.available_size():
            log.append(("evict", cache.evict(up.EvictParams(
                num_tokens=need - alloc.available_size())).num_tokens_evicted))
        if need > alloc.available_size():
            return False
        if need:
            req.spare = alloc.alloc(need) if req.spare is None \
                else torch.cat([req.spare, alloc.alloc(need)])
        rtp.write((req.req_pool_idx, slice(c, c + k)), req.spare[:k].to(torch.int32))
        req.spare = req.spare[k:]
        req.kv_committed_len = req.kv_allocated_len = c + k
        return True

    def finish(req, aborted):
        cache.cache_finished_req(req, is_insert=not aborted and req.mamba_lazy_is_insert)
        rtp.free(req)
        log.append(("finish", req.rid, aborted, states()))

    running: list = []
    for k, prompt, out_len, u in arrivals(seed, n, running, 2, finish):
        req = Req(rid=f"r{k}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(max_new_tokens=out_len))
        req.init_next_round_input(tree_cache=cache)
        hit = len(req.prefix_indices)
        cache.inc_lock_ref(req.last_node)
        alloc_req_slots(rtp, [req], cache)
        req.spare = None
        rtp.write((req.req_pool_idx, slice(0, hit)), req.prefix_indices.to(torch.int32))
        req.kv_committed_len = req.kv_allocated_len = hit
        buf = req.mamba_ping_pong_track_buffer.tolist()
        log.append(("admit", req.rid, hit, req.mamba_branching_seqlen, int(req.mamba_pool_idx),
                    buf, states()))
        left = len(prompt) - hit
        first = left // 2 // ps * ps if u < 0.5 else 0
        ok = True
        for part in ([first, left - first] if first else [left]):
            c = req.kv_committed_len
            if not compute(req, part):
                ok = False
                break
            at = extend_track_len(c, part, MAMBA_CHUNK, req.mamba_branching_seqlen)
            if at is not None:
                track(req, at)
            req.fill_len = req.kv_committed_len
            cache.cache_unfinished_req(req, chunked=part == first)
            log.append(("chunk", req.rid, req.cache_protected_len, len(req.prefix_indices),
                        req.mamba_last_track_seqlen,
                        req.mamba_ping_pong_track_buffer.tolist(), states()))
        if not ok:
            finish(req, True)
            continue
        for j in range(out_len):
            if not compute(req, 1):
                break
            req.output_ids.append((prompt[j % len(prompt)] * 7 + j) % 50 + 1)
            if lazy:
                lazy_decode_track(req, j == out_len - 1)
                continue
            for at in decode_track_lens(req.kv_committed_len - 1, 1, interval):
                track(req, at)
        running.append(req)
    for r in running:
        finish(r, False)
    return {"log": log, "free": free_list(alloc), "states": states(),
            "mamba_free": sorted(rtp.mamba_allocator.free_pages.tolist())
            if hasattr(rtp.mamba_allocator, "free_pages") else None}


XBUF_CONFIGS = [(1, True), (1, False), (4, True)]


@pytest.mark.parametrize("ps, overlap", XBUF_CONFIGS,
                         ids=[f"p{p}-{'two' if o else 'one'}-track" for p, o in XBUF_CONFIGS])
def test_mamba_extra_buffer_same_outcomes(ps, overlap):
    """fast and sglang, each over its own ``HybridReqToTokenPool`` with the extra buffer: the
    same hits, track slots, cached lengths, state and KV pools after every request."""
    ours = xbuf_workload(ps, overlap, "fast")
    theirs = xbuf_workload(ps, overlap, "upstream")
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    chunks = [e for e in ours["log"] if e[0] == "chunk"]
    assert any(e[2] > 0 for e in chunks)  # chunks cached tracked states
    assert any(e[0] == "admit" and e[2] > 0 for e in ours["log"])  # and later requests hit
    assert ours["states"][1] > 0  # the tree holds states at the end


@pytest.mark.parametrize("ps", [1, 4])
def test_mamba_extra_buffer_lazy_same_outcomes(ps):
    """The lazy extra buffer (``enable_mamba_extra_buffer_lazy`` on sglang's pool and on the
    params; sglang's own lazy scheduler steps at each decode track point): fast and sglang
    give the same hits, track slots, cached lengths, state and KV pools after every request
    and track point, including the requests that finish on a step whose fresh slot failed."""
    ours = xbuf_workload(ps, True, "fast", lazy=True, mamba_size=8)
    theirs = xbuf_workload(ps, True, "upstream", lazy=True, mamba_size=8)
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    tracks = [e for e in ours["log"] if e[0] == "decode-track"]
    assert all(e[2].count(-1) == 1 for e in tracks)  # one track slot held after each
    assert any(not e[4] for e in tracks)  # finishes on a failed track point: no insert
    assert any(e[0] == "admit" and e[2] > 0 for e in ours["log"])  # later requests hit
    assert any(e[0] == "chunk" and e[2] > 0 for e in ours["log"])


@pytest.mark.parametrize("ps", [1, 16])
def test_finished_req_frees_without_copying_the_free_list(ps):
    """The request path's frees (``cache_finished_req``, here an abort and a finish) go into
    sglang's allocator the way the tree's own frees do (fast/frees.py ``release``): at page 1
    appended into the list's tail buffer, so the list is not copied (its storage stays the
    same from one finish to the next, where sglang's own ``free`` makes a new tensor every
    time); at both page sizes the list ends exactly as sglang's ``free`` of the same slots
    leaves a twin allocator."""
    if fast.cache.NATIVE is False:
        pytest.skip("the C core is not built (UNIRADIX_PURE_PYTHON=1 or no compiler)")
    rtp = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)

    def allocator():
        return TokenToKVPoolAllocator(65536, torch.float16, "cpu", None, False) if ps == 1 \
            else PagedTokenToKVPoolAllocator(4096, ps, torch.float16, "cpu", None, False)

    alloc, twin = allocator(), allocator()
    cache = fast.UnifiedRadixCache(up.CacheInitParams(
        disable=False, req_to_token_pool=rtp, token_to_kv_pool_allocator=alloc, page_size=ps,
        tree_components=(CT.FULL,)))
    storages = []
    for k, insert in enumerate([False, True, False, True]):
        tokens = [k + 1] * 40
        req = Req(rid=f"r{k}", origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(max_new_tokens=1))
        req.init_next_round_input(tree_cache=cache)
        cache.inc_lock_ref(req.last_node)
        req.req_pool_idx = 0
        slots = alloc.alloc(-(-len(tokens) // ps) * ps)
        assert torch.equal(slots, twin.alloc(len(slots)))
        rtp.write((0, slice(0, len(tokens))), slots[:len(tokens)].to(torch.int32))
        req.kv_committed_len = len(tokens)
        cache.cache_finished_req(req, is_insert=insert)
        # the twin: what sglang's free leaves for the slots this finish gave back
        kept = (len(tokens) // ps) * ps if insert else 0
        twin.free(slots[kept:len(tokens)])
        assert alloc.free_pages.tolist() == twin.free_pages.tolist(), f"finish {k}"
        storages.append(alloc.free_pages.untyped_storage().data_ptr())
    if ps == 1:  # the first free made the tail buffer (a list of 65k slots gets one: fast/_core.c
        # "native frees"); every later finish appends in place
        assert len(set(storages)) == 1, storages


# -- the host tier with Mamba, the request path with sglang's own Req ------------------------------


def host_mamba_request_workload(impl: str, seed: int = 8, n: int = 300,
                                kv_slots: int = 512) -> dict:
    """write_through+mamba built as ``uniradix bench --allocator sglang`` builds it (sglang's
    allocators, ``HybridReqToTokenPool`` and host pools; conformance/bench/sglang_alloc.py),
    driven with sglang's own Req: ``init_next_round_input`` (a Mamba cache's match is a
    copy-on-write one, which may give the request its state slot), the host part loaded back
    with ``init_load_back(req=req)``, then the state slot taken at admission only when the
    request has none (as ``HybridReqToTokenPool.alloc`` does), prefill (some chunked, through
    ``cache_unfinished_req``), decode, ``cache_finished_req`` or an abort.  Some prompts
    continue an earlier request's whole sequence (a multi-turn chat), so they hit its state,
    on the device or, once the small KV pool evicted it, on the host.  The load back is given
    no host hit lengths (the bench's rule, conformance/bench/host.py): 0.5.13.post1 given them
    also loads aux host data under a device node, where the spec and fast keep the seed's
    guard (docs/SPEC.md)."""
    from uniradix.conformance.bench import configs as C
    from uniradix.spec.world import PagedPool
    cache, _, rtp = C.config_bundle(impl, C.BenchConfig.parse("write_through+mamba"), 1,
                                    "sglang").build(PagedPool(kv_slots, 1, "kv"))
    alloc, states = cache.token_to_kv_pool_allocator, rtp.mamba_allocator
    rows = Rows(rtp.size)
    rng = random.Random(seed)
    log: list = []
    done: list = []  # finished sequences, for follow-up turns

    def sizes():
        return (cache.evictable_size(), cache.protected_size(), alloc.available_size(),
                states.available_size(), cache.mamba_evictable_size(),
                cache.mamba_protected_size())

    def take(k: int):
        short = k - alloc.available_size()
        if short > 0:
            log.append(("evict", cache.evict(up.EvictParams(num_tokens=short)).num_tokens_evicted))
        return alloc.alloc(k)

    def finish(req, aborted: bool) -> None:
        cache.cache_finished_req(req, is_insert=not aborted)
        rows.free.append(req.req_pool_idx)
        if not aborted:
            done.append(list(req.origin_input_ids) + list(req.output_ids))
        log.append(("finish", req.rid, aborted, sizes()))

    running: list = []
    for k, body, out_len, u in arrivals(seed, n, running, 3, finish):
        # (the bench's request pool rows hold 64 tokens: sglang_alloc.py MAX_CONTEXT)
        turns = [d for d in done[-8:] if len(d) <= 44]
        prompt = (rng.choice(turns) + body[:4]) if turns and u < 0.5 else body[:40]
        out_len = min(out_len, 64 - len(prompt))
        req = Req(rid=f"r{k}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(max_new_tokens=out_len))
        req.init_next_round_input(tree_cache=cache)
        cow = req.mamba_pool_idx is not None  # the match gave it a state slot
        loaded = 0
        if req.needs_host_load_back():
            req.swa_host_hit_length = req.mamba_host_hit_length = 0  # (the bench's rule)
            new, req.last_node = cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=0, req=req))
            cache.ready_to_load_host_cache()
            req.prefix_indices = torch.cat([req.prefix_indices, new])
            loaded = len(new)
        slot_from_load = not cow and req.mamba_pool_idx is not None
        hit = len(req.prefix_indices)
        req.cache_protected_len = hit
        cache.inc_lock_ref(req.last_node)
        if req.mamba_pool_idx is None:  # admission's state slot (one state evicted for room)
            if states.available_size() == 0:
                log.append(("evict-state", cache.evict(
                    up.EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted))
            req.mamba_pool_idx = states.alloc(1)[0]
        req.req_pool_idx = rows.take()
        rtp.write((req.req_pool_idx, slice(0, hit)), req.prefix_indices.to(torch.int32))
        req.kv_committed_len = req.kv_allocated_len = hit
        log.append(("admit", req.rid, hit, loaded, cow, slot_from_load,
                    int(req.mamba_pool_idx), req.prefix_indices.tolist()))
        slots = take(len(prompt) + out_len - hit)
        if slots is None:
            finish(req, True)
            continue
        c = hit
        first = (len(prompt) - hit) // 2
        if u > 0.6 and first > 1:  # a chunk, cached unfinished
            rtp.write((req.req_pool_idx, slice(c, c + first)), slots[:first].to(torch.int32))
            c = req.kv_committed_len = req.kv_allocated_len = c + first
            req.fill_len = c
            cache.cache_unfinished_req(req, chunked=True)
            log.append(("chunk", req.rid, req.cache_protected_len, sizes()))
        rtp.write((req.req_pool_idx, slice(c, len(prompt))),
                  slots[c - hit: len(prompt) - hit].to(torch.int32))
        for j in range(out_len):  # decode
            req.output_ids.append((prompt[j % len(prompt)] * 7 + j) % 50 + 1)
            pos = len(prompt) + j
            rtp.write((req.req_pool_idx, slice(pos, pos + 1)),
                      slots[pos - hit: pos - hit + 1].to(torch.int32))
        req.kv_committed_len = req.kv_allocated_len = len(prompt) + out_len
        running.append(req)
        cache.check_hicache_events()
    for req in running:
        finish(req, False)
    log.append(("end", sizes()))
    return {"log": log, "free_list": free_list(alloc), "states": states.available_size()}


def test_host_mamba_request_path_same_outcomes():
    """fast's ``init_load_back`` took the requester's state slot but never set
    ``req.mamba_pool_idx``: the admission took a second slot and the first leaked (the
    bench's write_through+mamba outcome difference at 1,000 requests)."""
    ours = host_mamba_request_workload("fast")
    theirs = host_mamba_request_workload("upstream")
    for k, (a, b) in enumerate(zip(ours["log"], theirs["log"], strict=True)):
        assert a == b, f"request event {k}: fast {a} != sglang {b}"
    assert ours == theirs
    admits = [e for e in ours["log"] if e[0] == "admit"]
    assert any(e[3] > 0 for e in admits)  # load backs
    assert any(e[5] for e in admits)  # a load back gave the request its state slot
    assert any(e[4] for e in admits)  # a copy-on-write match gave one
    assert any(e[0] == "evict" for e in ours["log"]) and any(e[0] == "chunk" for e in ours["log"])
