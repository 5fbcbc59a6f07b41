"""The bench's upstream peers on sglang releases that keep the matched slots on the nodes
(conformance/bench/peers_newer.py): how a match's slots are read, how the peer is pinned to its
tree core and checked, and that its outcomes equal fast's.

The first half runs everywhere, on stand-ins with the newer release's API shape. The tests
marked ``upstream`` need such a release with its Rust tree core (0.5.23 is the one measured:
``SGLANG_VERSION=0.5.23 scripts/upstream-venv.sh VENV``, then VENV/bin/python -m pytest on this
file); elsewhere they skip with the reason.
"""

from __future__ import annotations

import collections
import os
import types
from array import array

import pytest

from uniradix.conformance.bench import loop as bench
from uniradix.conformance.bench import peers_newer
from uniradix.conformance.env.workload import SharedPrefix

# a shared-prefix workload small enough to run in a second and tight enough to evict
TINY = SharedPrefix(requests=150, prompts=10, prompt_min=20, prompt_max=120, kv_slots=2048,
                    inflight=4)
NEW_FIELDS = "device_prefix_len last_device_node last_host_node best_match_node"


def _torch():
    return pytest.importorskip("torch")


class PathCache:
    """A stand-in for a newer release's cache: one stored path whose slots the match reports
    by length only, as 0.5.23's ``MatchResult`` does."""

    def __init__(self, torch, slots, reported: int, core: object = None) -> None:
        self.slots = torch.tensor(slots, dtype=torch.int64)
        self.reported = reported
        self.tree_core = core
        self.paths_read: list = []
        self.MatchResult = collections.namedtuple("MatchResult", NEW_FIELDS)

    def match_prefix(self, params):
        return self.MatchResult(self.reported, 7, 7, 7)

    def path_device_indices(self, node):
        self.paths_read.append(node)
        return self.slots

    def inc_lock_ref(self, node):
        return ("lock", node)

    def dec_lock_ref(self, node, params):
        return ("unlock", node)

    def insert(self, params):
        return ("insert", params)

    def evict(self, params):
        return ("evict", params)


def test_a_match_reads_the_slots_on_the_path_to_its_last_device_node():
    torch = _torch()
    cache = PathCache(torch, [5, 6, 7], reported=3)
    m = peers_newer.SlotsFromPath(cache).match_prefix("key")
    assert m.device_indices.tolist() == [5, 6, 7] and m.last_device_node == 7
    assert cache.paths_read == [7] and m.result.device_prefix_len == 3
    # the loop's reading of a match sees it as an old release's
    assert bench.match_result_problem(m) is None


@pytest.mark.parametrize("reported", [2, 4])
def test_a_path_that_disagrees_with_the_reported_length_is_an_error(reported):
    torch = _torch()
    wrapped = peers_newer.SlotsFromPath(PathCache(torch, [5, 6, 7], reported=reported))
    with pytest.raises(peers_newer.MatchReadError,
                       match=f"holds 3 device slots, the match reported device_prefix_len={reported}"):
        wrapped.match_prefix("key")


def test_the_other_four_calls_are_the_caches_own():
    torch = _torch()
    cache = PathCache(torch, [], reported=0)
    wrapped = peers_newer.SlotsFromPath(cache)
    for name in ("inc_lock_ref", "dec_lock_ref", "insert", "evict"):
        assert getattr(wrapped, name) == getattr(cache, name), name
    assert wrapped.cache is cache and wrapped.tree_core is cache.tree_core


def test_a_release_keeps_the_slots_on_the_nodes_by_its_api_shape():
    Old = collections.namedtuple("MatchResult", "device_indices last_device_node")
    New = collections.namedtuple("MatchResult", NEW_FIELDS)
    assert peers_newer.slots_on_nodes(New, PathCache)
    assert not peers_newer.slots_on_nodes(Old, PathCache)  # 0.5.13.post1 .. 0.5.19
    assert not peers_newer.slots_on_nodes(New, object)  # no way to read the slots
    assert not peers_newer.slots_on_nodes(None, object)


def _stand_in_release(monkeypatch, core_module: str, core_name: str) -> list:
    """sglang 0.5.23 as upstream_bundle sees it, with the tree core it builds fixed (whatever
    is asked for); returns the cores asked for, one per build."""
    torch = _torch()
    from uniradix.conformance.adapters import upstream
    Core = type(core_name, (), {})
    Core.__module__ = core_module
    asked: list = []

    class Cache(PathCache):
        def __init__(self, params) -> None:
            asked.append(os.environ.get(bench.TREE_CORE_ENV))
            super().__init__(torch, [], reported=0, core=Core())

    up = types.SimpleNamespace(
        torch=torch, version="0.5.99", RadixKey=lambda tokens: tokens,
        ComponentType=types.SimpleNamespace(FULL="full"), UnifiedRadixCache=Cache,
        CacheInitParams=lambda **kw: kw, MatchPrefixParams=lambda key: key,
        InsertParams=None, EvictParams=None,
        MatchResult=collections.namedtuple("MatchResult", NEW_FIELDS))
    monkeypatch.setattr(upstream, "load_upstream", lambda: up)
    monkeypatch.setattr(upstream, "rust_tree_core_available", lambda: True)
    return asked


def test_a_newer_release_is_adapted_and_its_version_says_how(monkeypatch):
    asked = _stand_in_release(monkeypatch, "sglang.srt.mem_cache.rust_tree_core.adapter",
                              "RustUnifiedTreeCore")
    b = bench.get_bundle("upstream-rust")
    assert b.version == f"sglang 0.5.99 (rust tree core; {peers_newer.SLOTS_RULE})"
    cache, _alloc = b.build(bench.PagedPool(16, 1, "kv"))
    assert isinstance(cache, peers_newer.SlotsFromPath)
    assert asked == ["rust", "rust"]  # the probe, then the build


def test_a_newer_release_that_falls_back_to_another_core_is_refused(monkeypatch):
    _stand_in_release(monkeypatch, "sglang.srt.mem_cache.unified_cache.unified_tree_core",
                      "UnifiedTreeCore")
    with pytest.raises(bench.ImplMissing, match="asked sglang 0.5.99 for its rust tree core and "
                                                "it built the python one"):
        bench.get_bundle("upstream-rust")
    # the adapter itself checks every cache it is given, not only the probe
    from uniradix.conformance.adapters import upstream
    adapt, note = peers_newer.adapter_for("upstream-rust", "rust", upstream.load_upstream())
    assert note == "; " + peers_newer.SLOTS_RULE
    with pytest.raises(bench.ImplMissing, match="built the python one"):
        adapt(upstream.load_upstream().UnifiedRadixCache(None))


# --------------------------------------------------------------------------------------------
# Against the release itself
# --------------------------------------------------------------------------------------------


@pytest.fixture
def newer():
    """The installed sglang, where it keeps the slots on the nodes and has its Rust core."""
    from uniradix.conformance.adapters.upstream import (
        UpstreamMissing,
        load_upstream,
        rust_tree_core_available,
    )
    try:
        up = load_upstream()
    except UpstreamMissing as e:
        pytest.skip(str(e))
    if not peers_newer.slots_on_nodes(up.MatchResult, up.UnifiedRadixCache):
        pytest.skip(f"sglang {up.version} returns device_indices (the loop reads it directly)")
    if not rust_tree_core_available():
        pytest.skip(f"sglang {up.version} has no Rust tree core")
    return up


@pytest.mark.upstream
def test_the_rust_peer_is_pinned_whatever_the_environment_asks(newer, monkeypatch):
    monkeypatch.setenv(bench.TREE_CORE_ENV, "python")
    b = bench.get_bundle("upstream-rust")
    assert b.version == f"sglang {newer.version} (rust tree core; {peers_newer.SLOTS_RULE})"
    cache, _alloc = b.build(bench.PagedPool(64, 1, "kv"))
    assert isinstance(cache, peers_newer.SlotsFromPath)
    assert bench.tree_core_in_use(cache) == bench.tree_core_in_use(cache.cache) == "rust"
    assert os.environ[bench.TREE_CORE_ENV] == "python"  # restored after the build
    python_peer, _ = bench.get_bundle("upstream").build(bench.PagedPool(64, 1, "kv"))
    assert bench.tree_core_in_use(python_peer) == "python"


@pytest.mark.upstream
@pytest.mark.parametrize("peer", ["upstream-rust", "upstream"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_a_match_reads_the_inserted_slots_of_its_prefix(newer, peer, page_size):
    b = bench.get_bundle(peer)
    cache, alloc = b.build(bench.PagedPool(64, page_size, "kv"))
    torch = newer.torch
    tokens = array("q", range(1, 17))
    value = alloc.alloc(16)
    cache.insert(b.InsertParams(key=b.RadixKey(tokens), value=value))
    probe = array("q", list(range(1, 10)) + [99] * 7)  # splits the stored path at 8 (or 9)
    m = cache.match_prefix(b.MatchPrefixParams(key=b.RadixKey(probe)))
    hit = 9 // page_size * page_size
    assert torch.equal(m.device_indices, value[:hit])
    assert m.result.device_prefix_len == hit
    whole = cache.match_prefix(b.MatchPrefixParams(key=b.RadixKey(tokens)))
    assert torch.equal(whole.device_indices, value)
    miss = cache.match_prefix(b.MatchPrefixParams(key=b.RadixKey(array("q", [77] * 8))))
    assert miss.device_indices.numel() == 0
    assert miss.last_device_node == cache.cache.root_node_handle()
    # a lock on the split node holds the prefix: an evict of everything leaves it
    lock = cache.inc_lock_ref(m.last_device_node)
    got = cache.evict(b.EvictParams(num_tokens=16))
    assert got.num_tokens_evicted == 16 - hit
    cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
    assert cache.evict(b.EvictParams(num_tokens=16)).num_tokens_evicted == hit
    assert alloc.available_size() == 64


@pytest.mark.upstream
@pytest.mark.parametrize("page_size", [1, 4])
def test_outcomes_equal_fasts_on_a_workload_that_evicts(newer, page_size):
    w = bench.shared_prefix_workload(page_size, base=TINY)
    cmp = bench.compare(["fast", "upstream-rust", "upstream"], w, repeats=1)  # strict
    assert cmp.identical and not cmp.missing, cmp.missing
    runs = {impl: runs[0] for impl, runs in cmp.runs.items()}
    assert runs["fast"].evicted_tokens > 0 and 0.2 < runs["fast"].hit_rate < 1.0
    assert len({s.digest for s in runs.values()}) == 1


@pytest.mark.upstream
def test_outcomes_equal_fasts_on_mooncake_token_ids(newer):
    """Mooncake's ids pass 2^40 (the C++ tree cannot take them); a small pool makes it evict."""
    w = bench.mooncake_workload(16, requests=60, kv_slots=262144)
    cmp = bench.compare(["fast", "upstream-rust"], w, repeats=1)
    assert cmp.identical and not cmp.missing, cmp.missing
    fast, rust = cmp.runs["fast"][0], cmp.runs["upstream-rust"][0]
    assert fast.evicted_tokens > 0 and fast.outcome() == rust.outcome()
