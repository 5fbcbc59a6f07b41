"""``UpstreamAdapter``: runs upstream SGLang's ``UnifiedRadixCache`` behind the trace interface.

Upstream is a conformance peer, never a dependency (UPSTREAM.md). This module imports without
sglang; building an adapter without it raises :class:`UpstreamMissing`, which says how to make
the throwaway virtualenv (``scripts/upstream-venv.sh``).

What is supported: the Full component on the device tier (no host tier, no SWA, no Mamba, no
EAGLE bigram keys, cache enabled). Other configs raise
:class:`~uniradix.spec.errors.Unsupported` from the constructor. The per-op handlers and the
config check are split so that those features can be added one at a time.

The world around the cache is the project's own environment model: the KV allocator upstream sees
is a thin torch-facing wrapper over :class:`uniradix.spec.world.PagedPool`, so slot numbers (and
the ``freed`` effects of a step) are the same as in every other implementation's replay.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from array import array
from collections.abc import Callable
from typing import Any

from uniradix.conformance.env.pools import PoolAllocator
from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import (
    CacheError,
    HandleError,
    InvalidInput,
    NodeNotFound,
    UnknownOp,
    Unsupported,
)
from uniradix.spec.world import PagedPool

UPSTREAM_VERSION = "0.5.13.post1"

_HOW_TO_BUILD = (
    "upstream sglang is not importable in this interpreter. Build the throwaway venv with "
    "`scripts/upstream-venv.sh [VENV]` (default .venv-upstream; sglang==" + UPSTREAM_VERSION +
    " on CPU torch) and run under VENV/bin/python.")


class UpstreamMissing(ImportError):
    """sglang (or torch) cannot be imported here."""


# --------------------------------------------------------------------------------------------
# Importing sglang on a CPU-only machine
# --------------------------------------------------------------------------------------------

class _PlaceholderMeta(type):
    """Metaclass of placeholder objects: every attribute is another placeholder class, so
    module-level code such as ``F.InterpolationMode.BILINEAR`` or subclassing still works."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{cls.__qualname__} is a placeholder: torchvision is not installed")

    def __iter__(cls):
        return iter(())


def _placeholder(name: str) -> type:
    return _PlaceholderMeta(name.rsplit(".", 1)[-1], (), {"__qualname__": name})


class _PlaceholderModule(types.ModuleType):
    """Stands in for ``torchvision`` (or ``sgl_kernel``) and its submodules: sglang and
    transformers import names from them at module level, but the radix cache never uses them."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__}.{name}")


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path hook answering ``import ROOT[.x]`` with :class:`_PlaceholderModule`."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib protocol
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []  # a package, so submodule imports go through this finder too
        return module

    def exec_module(self, module) -> None:
        return None


_IMPORTED: types.SimpleNamespace | None = None


def _stub_torchvision() -> None:
    """Let ``import torchvision[.x]`` succeed with placeholder modules.

    PyPI's torchvision builds do not load against CPU torch, and sglang imports it at module
    level (``sglang.srt.utils.common``). The hook must be in place *before* transformers is
    imported: transformers 5.8.1 files ``AutoImageProcessor`` under the torchvision backend, and
    sglang registers image processors on it while importing, which fails if transformers has
    already decided torchvision is absent. (``transformers`` then sees the placeholder as an
    installed torchvision; nothing the radix cache runs touches it.)
    """
    _stub("torchvision")


def _stub(root: str) -> None:
    if any(isinstance(f, _PlaceholderFinder) and f.root == root for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PlaceholderFinder(root))


def unmodelled_settings(config: CacheConfig, storage: bool = True) -> list[str]:
    """The settings no upstream adapter drives, by name (each adapter adds its own): EAGLE keys,
    a disabled cache and, unless the adapter drives it, the storage tier."""
    out = []
    if config.eagle:
        out.append("eagle bigram keys")
    if config.disable:
        out.append("a disabled cache")
    if storage and config.storage:
        out.append("a storage tier")
    return out


def load_upstream() -> types.SimpleNamespace:
    """Import the upstream names the adapter needs, once. Raises :class:`UpstreamMissing`."""
    global _IMPORTED
    if _IMPORTED is not None:
        return _IMPORTED
    if importlib.util.find_spec("sglang") is None:  # before any side effect on the importer
        raise UpstreamMissing(_HOW_TO_BUILD)
    try:
        import torch  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the interpreter
        raise UpstreamMissing(f"{_HOW_TO_BUILD} (torch import failed: {e})") from e
    if "torchvision" not in sys.modules:
        _stub_torchvision()
    # sglang's quantization layers import sgl_kernel (its CUDA kernels) at module level once
    # torch sees a GPU; the radix cache and the allocators the bench drives never call it, and
    # its CUDA wheels are not installed where only the cache is measured (scripts/gpu-bench.sh)
    if torch.cuda.is_available() and importlib.util.find_spec("sgl_kernel") is None:
        _stub("sgl_kernel")
    try:
        with warnings.catch_warnings():  # CPU-platform notices from sglang's layer modules
            warnings.simplefilter("ignore")
            import sglang  # noqa: F401
            from sglang.srt.mem_cache import base_prefix_cache as bpc
            from sglang.srt.mem_cache.cache_init_params import CacheInitParams
            from sglang.srt.mem_cache.radix_cache import RadixKey
            try:  # 0.5.13.post1 (the release the adapter follows)
                from sglang.srt.mem_cache.unified_cache_components import ComponentType
            except ImportError:  # 0.5.17+, for `uniradix bench` only (upstream-rust)
                from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
            from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    except ImportError as e:
        raise UpstreamMissing(f"{_HOW_TO_BUILD} ({type(e).__name__}: {e})") from e
    version = getattr(sys.modules["sglang"], "__version__", "unknown")
    _IMPORTED = types.SimpleNamespace(
        torch=torch, version=version, RadixKey=RadixKey, ComponentType=ComponentType,
        UnifiedRadixCache=UnifiedRadixCache, CacheInitParams=CacheInitParams,
        MatchPrefixParams=bpc.MatchPrefixParams, InsertParams=bpc.InsertParams,
        EvictParams=bpc.EvictParams, DecLockRefParams=bpc.DecLockRefParams,
        MatchResult=bpc.MatchResult)
    return _IMPORTED


def load_upstream_cpp() -> Any:
    """Upstream's C++ radix tree cache (``RadixCacheCpp``, Full component, device tier only), a
    speed peer for ``uniradix bench --impl upstream-cpp``.  Importing it compiles the C++ tree
    with torch's extension builder on first use (about a minute; cached afterwards under
    torch's extension folder), which needs a C++20 compiler and ninja.  Raises
    :class:`UpstreamMissing` when sglang is absent or the tree cannot be built."""
    load_upstream()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.mem_cache.radix_cache_cpp import RadixCacheCpp
    except Exception as e:  # ImportError, or the compiler failing inside torch's loader
        raise UpstreamMissing(f"upstream's C++ radix tree cannot be built here "
                              f"({type(e).__name__}: {e})") from e
    return RadixCacheCpp


def rust_tree_core_available() -> bool:
    """Whether the installed sglang has the Rust tree core of its ``UnifiedRadixCache``
    (0.5.17 and later; selected by ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=rust``)."""
    load_upstream()
    return importlib.util.find_spec("sglang.srt.mem_cache.rust_tree_core") is not None


def upstream_available() -> bool:
    try:
        load_upstream()
    except UpstreamMissing:
        return False
    return True


# --------------------------------------------------------------------------------------------
# Argument checking (before anything reaches upstream, which would just crash on bad input)
# --------------------------------------------------------------------------------------------

def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise InvalidInput(f"{what} must be a list of ints")
    return list(value)


def _extra_key(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidInput("extra_key must be null or a string")
    return value


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"{what} must be a non-negative int")
    return value


def _path(node: Any) -> tuple[list[int], str | None]:
    if not isinstance(node, dict) or set(node) - {"tokens", "extra_key"} or "tokens" not in node:
        raise InvalidInput("a node path must be an object {tokens, extra_key}")
    return _int_list(node.get("tokens", []), "node.tokens"), _extra_key(node.get("extra_key"))


# --------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------

# the args of each op (TRACE.md): required, optional. A missing or unknown arg is InvalidInput,
# as in the spec, before anything reaches upstream (which would ignore an unknown one)
_ARGS: dict[str, tuple[frozenset, frozenset]] = {
    "alloc": (frozenset({"n"}), frozenset()),
    "free": (frozenset({"slots"}), frozenset()),
    "insert": (frozenset({"tokens", "value"}),
               frozenset({"extra_key", "prev_prefix_len", "chunked", "mamba_value",
                          "swa_evicted_seqlen", "priority"})),
    "match_prefix": (frozenset({"tokens"}), frozenset({"extra_key", "cow_mamba", "mamba_slot"})),
    "lock": (frozenset({"node"}), frozenset()),
    "unlock": (frozenset({"handle"}), frozenset()),
    "evict": (frozenset({"num_tokens"}), frozenset()),
    "sizes": (frozenset(), frozenset()),
    "reset": (frozenset(), frozenset()),
    "mamba_alloc": (frozenset({"n"}), frozenset()),
    "mamba_free": (frozenset({"slots"}), frozenset()),
    # the host tier (conformance/adapters/upstream_host.py), as conformance/adapters/host_ops.py reads them
    "evict_host": (frozenset({"num_tokens"}), frozenset()),
    "load_back": (frozenset({"node", "last_device_node"}), frozenset({"mem_quota", "mamba_slot", "rid"})),
    "io_complete": (frozenset(), frozenset({"writes", "loads"})),
    "check_hicache_events": (frozenset(), frozenset()),
    "host_lock": (frozenset({"node"}), frozenset()),
    "host_unlock": (frozenset({"handle"}), frozenset()),
    # the request path (conformance/adapters/upstream_requests.py)
    "req_arrive": (frozenset({"rid", "tokens"}), frozenset({"extra_key", "priority", "session"})),
    "req_admit": (frozenset({"rid"}), frozenset()),
    "req_chunk": (frozenset({"rid", "n"}), frozenset({"chunked"})),
    "req_decode": (frozenset({"rid", "n"}), frozenset()),
    "req_finish": (frozenset({"rid"}), frozenset()),
    "req_abort": (frozenset({"rid"}), frozenset()),
    "release_session": (frozenset({"session"}), frozenset()),
    "session_held": (frozenset(), frozenset()),
}
_HYBRID_EVICT_ARGS = frozenset({"swa_num_tokens", "mamba_num"})


def _check_args(config: CacheConfig, op: str, args: Any) -> None:
    if not isinstance(args, dict):
        raise InvalidInput(f"{op}: args must be an object")
    required, optional = _ARGS.get(op, (frozenset(), frozenset()))
    if op == "evict" and config.components != ("full",):
        optional = _HYBRID_EVICT_ARGS
    extra = sorted(set(args) - required - optional)
    if extra:
        raise InvalidInput(f"{op}: unknown argument(s) {extra}")
    missing = sorted(required - set(args))
    if missing:
        raise InvalidInput(f"{op}: missing argument(s) {missing}")


# ops of TRACE.md that need a tier or component the adapter does not drive (host tier, Mamba
# pool without Mamba): rejected as Unsupported, as the spec does; other unknown ops: UnknownOp
_NOT_DRIVEN_OPS = ("evict_host", "load_back", "io_complete", "check_hicache_events",
                   "mamba_alloc", "mamba_free")


class UpstreamAdapter:
    """Drives sglang's ``UnifiedRadixCache`` one trace step at a time.

    ``apply`` returns the step's observation (a full ``ret`` dict, TRACE.md), an
    ``{"error": "<type>"}`` observation for a rejected step, or ``{}`` for ops without a ret.
    """

    # -- comparison rules (read by the lockstep runner, conformance/explore/lockstep.py) ---------------
    #: upstream has only the tree-level API: no request-level (req_*) ops
    tree_only = True

    @property
    def uncompared_node_fields(self) -> tuple:
        """Hit counts differ by two documented 0.5.13.post1 differences (docs/SPEC.md): it counts
        hits without a host tier too (the seed and the spec only with one), and it copies a
        node's count to the new upper node on a split (the seed starts that at 0). Not compared;
        with a host tier what the counts cause, write-through backups, still is (host copies,
        host pool, acks)."""
        return ("hit_count",)

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self._check_supported(config)
        self.up = load_upstream()
        self.pool = PagedPool(config.kv_slots, config.page_size, name="kv")
        self.allocator = PoolAllocator(self.pool, self.up.torch)
        self.cache = self._build_cache()
        self._handles: dict[int, tuple[Any, Any]] = {}  # handle -> (node, DecLockRefParams)
        self._ops: dict[str, Callable[[dict, dict], dict]] = {
            "alloc": self._op_alloc,
            "free": self._op_free,
            "insert": self._op_insert,
            "match_prefix": self._op_match_prefix,
            "lock": self._op_lock,
            "unlock": self._op_unlock,
            "evict": self._op_evict,
            "sizes": self._op_sizes,
            "reset": self._op_reset,
        }

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def _check_supported(config: CacheConfig) -> None:
        reasons = []
        if config.components != ("full",):
            reasons.append(f"components {list(config.components)}")
        if config.has_host_tier:
            reasons.append("a host tier (host_slots > 0)")
        reasons += unmodelled_settings(config)
        if reasons:
            raise Unsupported("UpstreamAdapter supports the Full device tier only, not "
                              + ", ".join(reasons))

    def _tree_components(self) -> tuple:
        return (self.up.ComponentType.FULL,)

    def _build_cache(self):
        params = self.up.CacheInitParams(
            disable=False,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            page_size=self.config.page_size,
            is_eagle=False,
            tree_components=self._tree_components(),
            eviction_policy=self.config.eviction_policy,
            enable_kv_cache_events=True,  # its KV-event mixin (conformance/traces/events.py)
        )
        return self.up.UnifiedRadixCache(params)

    # -- KV events (conformance/traces/events.py) ---------------------------------------------------
    #: 0.5.13.post1 hashes pages without the request's extra_key (spec/pagekeys.py "compat")
    event_key_mode = "compat"

    @property
    def emits_kv_events(self) -> bool:
        """Whether the cache has the mixin on (every upstream adapter's cache does: Full,
        host, SWA, Mamba and the host tier with an aux component)."""
        return bool(getattr(self.cache, "enable_kv_cache_events", False))

    def take_events(self) -> list:
        """sglang's own events since the last call (its ``take_events``), in its order."""
        return list(self.cache.take_events())

    # -- helpers -----------------------------------------------------------------------------
    @property
    def root(self):
        return self.cache.root_node

    def _key(self, tokens: list[int], extra_key: str | None):
        return self.up.RadixKey(array("q", tokens), extra_key)

    def _tensor(self, values: list[int]):
        torch = self.up.torch
        return torch.tensor(values, dtype=torch.int64)

    def _depth(self, node) -> int:
        """Path length (tokens from the root to the node's end)."""
        n = 0
        while node is not None and node is not self.root:
            n += len(node.key)
            node = node.parent
        return n

    def _path_of(self, node) -> tuple[str | None, list[int]]:
        parts = []
        extra = None
        while node is not None and node is not self.root:
            parts.append(list(node.key.token_ids))
            extra = node.key.extra_key
            node = node.parent
        tokens: list[int] = []
        for p in reversed(parts):
            tokens.extend(p)
        return extra, tokens

    def _find_node(self, tokens: list[int], extra_key: str | None):
        """The node whose path is exactly (extra_key, tokens); NodeNotFound otherwise."""
        node = self.root
        rest = tokens
        ps = self.config.page_size
        while rest:
            if len(rest) < ps:
                raise NodeNotFound(f"path of {len(tokens)} tokens does not end at a node")
            ck = self._key(rest, extra_key).child_key(ps)
            child = node.children.get(ck)  # .get: children is a defaultdict
            if child is None:
                raise NodeNotFound(f"no node on path at depth {len(tokens) - len(rest)}")
            k = list(child.key.token_ids)
            if child.key.extra_key != extra_key or rest[:len(k)] != k:
                raise NodeNotFound(f"path of {len(tokens)} tokens does not end at a node")
            rest = rest[len(k):]
            node = child
        return node

    def _walk_nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- the interface -----------------------------------------------------------------------
    def apply(self, step: dict) -> dict:
        op = step.get("op")
        args = step.get("args") or {}
        handler = self._ops.get(op) if isinstance(op, str) else None
        self.pool.take_freed()  # effects are per step
        try:
            if handler is None or not isinstance(op, str):
                # an op of a tier or component this adapter does not drive: the spec's name
                if op in _NOT_DRIVEN_OPS:
                    if op in ("mamba_alloc", "mamba_free"):  # the spec checks their args first
                        _check_args(self.config, op, args)
                    raise Unsupported(f"op {op!r} needs a tier or component not driven here")
                raise UnknownOp(f"unknown op {op!r}")
            _check_args(self.config, op, args)
            if op == "insert":
                self._check_insert(args)
            return handler(step, args)
        except CacheError as e:
            self.pool.take_freed()
            return {"error": type(e).__name__}

    def snapshot(self) -> dict:
        """Canonical state (docs/DESIGN.md): nodes sorted by path with device value, lock_ref and
        hit_count; the evictable device leaves, oldest access first; the Full sizes."""
        nodes: list[dict[str, Any]] = []
        for node in self._walk_nodes():
            if node is self.root:
                continue
            extra, tokens = self._path_of(node)
            cd = node.component_data[self.up.ComponentType.FULL]
            nodes.append({
                "path": {"tokens": tokens, "extra_key": extra},
                "value": None if cd.value is None else [int(v) for v in cd.value.tolist()],
                "lock_ref": int(cd.lock_ref),
                "hit_count": int(node.hit_count),
            })
            if self.config.eviction_policy == "priority":  # as the spec's snapshot
                nodes[-1]["priority"] = int(node.priority)
        nodes.sort(key=lambda n: (n["path"]["extra_key"] is not None,
                                  n["path"]["extra_key"] or "", n["path"]["tokens"]))
        strategy = self.cache.eviction_strategy
        leaves = sorted(self.cache.evictable_device_leaves, key=strategy.get_priority)
        order = []
        for leaf in leaves:
            extra, tokens = self._path_of(leaf)
            order.append({"tokens": tokens, "extra_key": extra})
        return {
            "nodes": nodes,
            "device_leaf_order": order,
            "sizes": self._sizes(),
            "pool": sorted(self.pool.allocated_pages()),
            "requests": [],  # request-level ops are not driven on upstream
        }

    def violations(self) -> list[str]:
        import logging

        logger = logging.getLogger("sglang.srt.mem_cache.unified_radix_cache")
        saved_level = logger.level
        saved_print = self.cache.pretty_print
        logger.setLevel(logging.CRITICAL)  # sanity_check logs and prints the tree on failure
        self.cache.pretty_print = lambda: None
        try:
            self.cache.sanity_check()
        except AssertionError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            return lines or ["sanity_check failed"]
        finally:
            logger.setLevel(saved_level)
            self.cache.pretty_print = saved_print
        return []

    def _check_insert(self, args: dict) -> None:
        """What the spec rejects of an insert and upstream would take on trust (it would store
        the slot in the tree, or fail freeing it): a slot of the aligned key from
        ``prev_prefix_len`` on that the pool has not handed out; a Mamba state slot without the
        Mamba component; an SWA window start without SWA or not on a page boundary.
        InvalidInput, as in the spec."""
        if args.get("mamba_value") is not None and "mamba" not in self.config.components:
            raise InvalidInput("insert: mamba_value needs the Mamba component")
        seqlen = args.get("swa_evicted_seqlen", 0)
        if isinstance(seqlen, int) and not isinstance(seqlen, bool) and seqlen > 0:
            if "swa" not in self.config.components:
                raise InvalidInput("insert: swa_evicted_seqlen needs the SWA component")
            if seqlen % self.config.page_size:
                raise InvalidInput(f"insert: swa_evicted_seqlen={seqlen} is not whole pages")
        tokens, value, prev = args.get("tokens"), args.get("value"), args.get("prev_prefix_len", 0)
        if not (isinstance(tokens, list) and isinstance(value, list) and isinstance(prev, int)):
            return  # the handler's type checks reject it
        aligned = len(tokens) // self.config.page_size * self.config.page_size
        for slot in value[max(prev, 0): aligned]:
            if isinstance(slot, int) and not isinstance(slot, bool) \
                    and not self.pool.is_allocated(slot):
                raise InvalidInput(f"insert: slot {slot} is not allocated")

    # -- ops ---------------------------------------------------------------------------------
    def _op_alloc(self, step: dict, args: dict) -> dict:
        return {"slots": self.pool.alloc(_count(args.get("n"), "n"))}

    def _op_free(self, step: dict, args: dict) -> dict:
        self.pool.free(_int_list(args.get("slots"), "slots"))
        self.pool.take_freed()  # the driver's own free is not a cache effect
        return {}

    def _op_insert(self, step: dict, args: dict) -> dict:
        result = self.cache.insert(self._insert_params(args))
        return {"prefix_len": int(result.prefix_len), "freed": self.pool.take_freed()}

    def _insert_params(self, args: dict) -> Any:
        """An insert step's arguments, checked, as upstream's ``InsertParams`` (the Full part;
        an adapter with aux components adds theirs)."""
        tokens = _int_list(args.get("tokens"), "tokens")
        value = _int_list(args.get("value"), "value")
        extra = _extra_key(args.get("extra_key"))
        prev = _count(args.get("prev_prefix_len", 0), "prev_prefix_len")
        chunked = args.get("chunked", False)
        if not isinstance(chunked, bool):
            raise InvalidInput("chunked must be true or false")
        if len(value) != len(tokens):
            raise InvalidInput(f"value has {len(value)} slots for {len(tokens)} tokens")
        priority = args.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidInput(f"insert: priority must be an int, got {priority!r}")
        return self.up.InsertParams(key=self._key(tokens, extra), value=self._tensor(value),
                                    prev_prefix_len=prev, chunked=chunked, priority=priority)

    def _op_match_prefix(self, step: dict, args: dict) -> dict:
        tokens = _int_list(args.get("tokens"), "tokens")
        extra = _extra_key(args.get("extra_key"))
        result = self.cache.match_prefix(self.up.MatchPrefixParams(key=self._key(tokens, extra)))
        return {
            "device_indices": [int(v) for v in result.device_indices.tolist()],
            "host_hit_length": int(result.host_hit_length),
            "last_device_node": self._depth(result.last_device_node),
            "last_host_node": self._depth(result.last_host_node),
            "best_match_node": self._depth(result.best_match_node),
        }

    def _op_lock(self, step: dict, args: dict) -> dict:
        tokens, extra = _path(args.get("node"))
        node = self._find_node(tokens, extra)
        handle = step.get("i")
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise InvalidInput("a lock step needs an integer 'i' (the handle)")
        if handle in self._handles:
            raise HandleError(f"handle {handle} is already held")
        result = self.cache.inc_lock_ref(node)
        dec = self.up.DecLockRefParams(
            swa_uuid_for_lock=result.swa_uuid_for_lock,
            skip_lock_node_ids={k: set(v) for k, v in result.skip_lock_node_ids.items()},
        )
        self._handles[handle] = (node, dec)
        return {"handle": handle}

    def _op_unlock(self, step: dict, args: dict) -> dict:
        handle = args.get("handle")
        if handle not in self._handles or isinstance(handle, bool):
            raise HandleError(f"handle {handle!r} is not held")
        node, dec = self._handles.pop(handle)
        self.cache.dec_lock_ref(node, dec)
        return {}

    def _op_evict(self, step: dict, args: dict) -> dict:
        n = _count(args.get("num_tokens", 0), "num_tokens")
        result = self.cache.evict(self.up.EvictParams(num_tokens=n))
        return {"num_tokens_evicted": int(result.num_tokens_evicted),
                "freed": self.pool.take_freed()}

    def _sizes(self) -> dict:
        return {"full_evictable": int(self.cache.full_evictable_size()),
                "full_protected": int(self.cache.full_protected_size())}

    def _op_sizes(self, step: dict, args: dict) -> dict:
        return self._sizes()

    def _op_reset(self, step: dict, args: dict) -> dict:
        self.cache.reset()
        self.pool.reset()
        self._handles.clear()
        return {}
