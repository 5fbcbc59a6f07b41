"""The drop-in boundary: what ``uniradix.fast``'s caches accept from an engine that was written
for SGLang (0.5.13.post1), in one place for ``cache.py`` and ``hybrid.py`` (the composed cache).

* **Settings.**  Any ``CacheInitParams`` is accepted: uniradix's own (``uniradix.fast.params``)
  or SGLang's (``sglang.srt.mem_cache.cache_init_params``).  The uniradix-only settings
  (``validate_slots``, ``mamba_cache_chunk_size``, ``hicache``) are read with ``getattr`` and
  their defaults, so SGLang's object needs none of them; an engine that wants one sets it as
  an attribute of its params object (SGLang's dataclass takes new attributes) before building
  the cache.  Every upstream field is either honoured or refused by :func:`check_settings`
  with :class:`~uniradix.fast.errors.Unsupported` naming the field and its value (the table
  is :data:`REFUSED`); a field left at its default always passes.
* **Keys.**  Any object with SGLang's ``RadixKey`` shape (``token_ids``, ``extra_key``,
  ``is_bigram``) is a key: :func:`as_radix_key` converts it to uniradix's ``RadixKey`` (the C
  core reads SGLang's key directly when its ``token_ids`` is already an ``array('q')``).
* **Params and results** are read and built by attribute name only: SGLang's
  ``MatchPrefixParams``, ``InsertParams``, ``EvictParams``, ``DecLockRefParams``... work as
  they are, and uniradix's result types have SGLang's names, fields and field types.
"""

from __future__ import annotations

import dataclasses
import sys
from array import array
from typing import Any

import torch

from .errors import InvalidInput, Unsupported
from .frees import release
from .params import DecLockRefParams, InsertParams, MatchPrefixParams
from .policies import policy_name
from .radix_key import RadixKey


@dataclasses.dataclass(frozen=True)
class Settings:
    """The uniradix-only settings of one cache, with their defaults applied."""

    validate_slots: bool | None
    mamba_cache_chunk_size: int | None
    hicache: Any


def read_settings(params: Any) -> Settings:
    """The uniradix-only settings of ``params`` (missing attributes take their defaults)."""
    return Settings(validate_slots=getattr(params, "validate_slots", None),
                    mamba_cache_chunk_size=getattr(params, "mamba_cache_chunk_size", None),
                    hicache=getattr(params, "hicache", None))


def validate_slots_for(setting: bool | None, allocator: Any) -> bool:
    """``validate_slots``: None = check slot ownership when the allocator can answer
    (``check_free`` and ``is_allocated``, the conformance environment's models)."""
    if setting is None:
        return hasattr(allocator, "check_free") and hasattr(allocator, "is_allocated")
    return bool(setting)


def mamba_chunk_size(setting: int | None) -> int:
    """The chunk size behind ``mamba_branching_seqlen``: the uniradix setting; else, as
    upstream, the global server argument when an SGLang process has set one; else 64."""
    if setting is not None:
        return setting
    sa = sys.modules.get("sglang.srt.server_args")  # never imported here, only read
    g = getattr(sa, "_global_server_args", None) if sa is not None else None
    chunk = getattr(g, "mamba_cache_chunk_size", None)
    return chunk if type(chunk) is int and chunk > 0 else 64


# Upstream fields no uniradix cache implements: (field, default, what it would ask for).  A
# value other than the default is refused.
REFUSED = (
    ("cache_ttl_seconds", None, "time-to-live expiry of cache entries"),
)
# (``component_registry_override`` is honoured where it names a class uniradix can run and
# refused by name otherwise: :func:`component_overrides`; ``enable_mamba_extra_buffer_lazy``
# is honoured, its invalid combinations refused by name: :func:`check_extra_buffer_lazy`)


# Settings of a Full-only cache that the C core of the device-only Full path does not implement
# and the composed pure-Python tree (fast/hybrid.py) does: ``UnifiedRadixCache(params)`` builds
# a Full-only cache that asks for one on that tree (its ``core_reason`` names the setting).
# (field, default, what it asks for); a value other than the default moves the cache.
PYTHON_TREE: tuple[tuple[str, Any, str], ...] = (
    ("eviction_policy", "lru", "an eviction policy other than LRU"),
    ("enable_kv_cache_events", False, "KV cache events"),  # fast/events.py
)
# fields whose value upstream lower-cases before reading it ("LRU" is the default "lru")
_CASE_BLIND = frozenset({"eviction_policy"})


def python_tree_reason(params: Any) -> str | None:
    """Why a Full-only cache built from ``params`` runs on the composed pure-Python tree
    instead of the C core (a setting of :data:`PYTHON_TREE` away from its default), or None."""
    for field, default, why in PYTHON_TREE:
        value = getattr(params, field, default)
        if (value.lower() if field in _CASE_BLIND and isinstance(value, str) else value) \
                != default:
            return f"{why} ({field}={value!r}): the C core covers the device-only Full path without it"
    return None


def kv_events_for(params: Any) -> Any:
    """The KV event queue ``enable_kv_cache_events`` asks for (fast/events.py), or None;
    ``Unsupported`` when the events extra is not installed."""
    if not getattr(params, "enable_kv_cache_events", False):
        return None
    try:
        from .events import events_for
    except ImportError as e:
        raise Unsupported("enable_kv_cache_events=True needs msgspec and pyzmq (the events "
                          f"extra): {e}") from None
    return events_for(params)


def wire_metrics(cache: Any, params: Any) -> None:
    """Report ``cache``'s metrics when ``enable_metrics`` asks for them (fast/metrics.py);
    ``Unsupported`` when the metrics extra is not installed."""
    if not getattr(params, "enable_metrics", False):
        return
    try:
        from .metrics import wire_cache_metrics
    except ImportError as e:
        raise Unsupported("enable_metrics=True needs prometheus_client (the metrics extra): "
                          f"{e}") from None
    wire_cache_metrics(cache, params)


def _refuse(field: str, value: Any, why: str) -> None:
    raise Unsupported(f"CacheInitParams.{field}={value!r}: {why} is not supported by "
                      "uniradix.fast (leave it at its default)")


# The cache API the drop-in follows (sglang 0.5.13.post1's): fields of sglang's InsertParams it
# reads.  Later releases dropped them (0.5.23: ``component_evicted_seqlens`` and
# ``inserted_len`` instead; docs/COMPAT.md "Newer releases").
SGLANG_INSERT_FIELDS = ("chunked", "swa_evicted_seqlen")


def check_sglang_api(params: Any) -> None:
    """Refuse, by release and field, ``params`` from an sglang release whose cache API the
    drop-in does not follow: its ``InsertParams`` (in the module beside its
    ``CacheInitParams``'s, ``base_prefix_cache``) lacks a field the cache reads.  Such a
    release's scheduler would hand every call objects the cache cannot read; without this it
    would fail at the first insert with an ``AttributeError``.  Params not from sglang (or an
    sglang whose module cannot be read) pass."""
    module = type(params).__module__ or ""
    if not module.startswith("sglang."):
        return
    base = sys.modules.get("sglang.srt.mem_cache.base_prefix_cache")
    cls = getattr(base, "InsertParams", None)
    fields = getattr(cls, "__dataclass_fields__", None)
    if not fields:
        return
    missing = [f for f in SGLANG_INSERT_FIELDS if f not in fields]
    if missing:
        version = getattr(sys.modules.get("sglang"), "__version__", "unknown")
        raise Unsupported(
            f"sglang {version}: its InsertParams has no {', '.join(missing)}; uniradix.fast is a "
            "drop-in for sglang 0.5.13.post1's cache API (docs/COMPAT.md lists what a newer "
            "release changed)")


def check_settings(params: Any, *, finished_insert: bool, multi_rank: bool) -> None:
    """Refuse every setting the cache would not honour.

    ``finished_insert``: the cache has ``cache_finished_req`` (and so honours
    ``disable_finished_insert``).  ``multi_rank``: the cache keeps no state that must agree
    across ranks, so the process groups and ``pp_size`` / ``attn_cp_size`` need nothing from
    it (true of the device tier, where upstream uses them for nothing either).  A host tier
    reduces its transfer acks over ``tp_cache_group`` (fast/tiers/host.py ``with_tp_group``);
    the other groups and sizes must then span one rank.
    ``chunked_prefill_size`` and, for a Full-only cache, ``sliding_window_size`` change nothing
    in upstream's unified cache either, so any value passes.
    """
    check_sglang_api(params)
    # an unknown eviction policy is refused by name (the known ones other than lru run on
    # the composed tree, PYTHON_TREE; the C core orders by LRU only)
    policy_name(getattr(params, "eviction_policy", "lru"))
    for field, default, why in REFUSED:
        value = getattr(params, field, default)
        if value != default:
            _refuse(field, value, why)
    component_overrides(params)
    check_extra_buffer_lazy(params)
    if not finished_insert and getattr(params, "disable_finished_insert", False):
        _refuse("disable_finished_insert", True, "skipping the insert of finished requests "
                "(this cache has no cache_finished_req)")
    if not multi_rank:
        for field in ("pp_size", "attn_cp_size"):
            value = getattr(params, field, 1)
            if value != 1:
                _refuse(field, value, "a host tier shared across ranks")
        for field in ("attn_cp_cache_group", "attn_tp_cache_group", "pp_cache_group"):
            group = getattr(params, field, None)
            if group is not None and _world_size(group) != 1:
                _refuse(field, group, "a host tier shared across ranks")


def check_extra_buffer_lazy(params: Any) -> None:
    """``enable_mamba_extra_buffer_lazy`` (the lazy Mamba extra buffer, fast/components/
    mamba.py): a bool; on, it needs ``enable_mamba_extra_buffer`` (it is a variant of it) and,
    where the request pool says, a pool built lazy with two ping-pong positions (upstream's
    lazy mode runs with the overlap schedule only); a pool built lazy needs it on.  Anything
    else is refused by name: the cache and the pool would disagree on the tracked slot."""
    lazy = getattr(params, "enable_mamba_extra_buffer_lazy", False)
    if lazy is not True and lazy is not False:
        raise InvalidInput(f"enable_mamba_extra_buffer_lazy must be a bool, got {lazy!r}")
    if lazy and not getattr(params, "enable_mamba_extra_buffer", False):
        raise Unsupported("CacheInitParams.enable_mamba_extra_buffer_lazy=True without "
                          "enable_mamba_extra_buffer: the lazy mode is a variant of the extra "
                          "buffer (set both)")
    pool = getattr(params, "req_to_token_pool", None)
    pool_lazy = getattr(pool, "enable_mamba_extra_buffer_lazy", None)
    if pool_lazy is not None and bool(pool_lazy) != lazy:
        raise Unsupported(f"CacheInitParams.enable_mamba_extra_buffer_lazy={lazy!r} but the "
                          f"req_to_token_pool's enable_mamba_extra_buffer_lazy={pool_lazy!r}: "
                          "the cache and the pool would disagree on the tracked slot")
    size = getattr(pool, "mamba_ping_pong_track_buffer_size", 2)
    if lazy and size != 2:
        raise Unsupported("CacheInitParams.enable_mamba_extra_buffer_lazy=True with a pool of "
                          f"{size} ping-pong position(s): the lazy mode needs two (the overlap "
                          "schedule)")


def _world_size(group: Any) -> int:
    import torch.distributed as dist
    try:
        return dist.get_world_size(group=group)
    except (RuntimeError, ValueError):  # not initialised, or not a group
        return -1


def as_radix_key(key: Any) -> RadixKey:
    """``key`` as uniradix's ``RadixKey``: itself, or a new one built from an object of
    SGLang's ``RadixKey`` shape (its token ids checked as always)."""
    if type(key) is RadixKey:
        return key
    try:
        toks, ek, bigram = key.token_ids, key.extra_key, key.is_bigram
    except AttributeError:
        raise InvalidInput(f"key must be a RadixKey, got {type(key).__name__}") from None
    if bigram is not True and bigram is not False:
        raise InvalidInput(f"is_bigram must be a bool, got {bigram!r}")
    return RadixKey(toks, ek, is_bigram=bigram)


_COMPONENT_IDS = {0: "full", 1: "swa", 2: "mamba"}  # upstream's ComponentType values


def component_names(tree_components: Any) -> list[str]:
    """``tree_components`` (upstream's enum members, their names, or their int values) as
    lower-case names; None (upstream's default) is Full only."""
    if tree_components is None:
        return ["full"]
    out = []
    for c in tree_components:
        name = getattr(c, "name", c)
        if isinstance(name, int) and not isinstance(name, bool):
            name = _COMPONENT_IDS.get(name, str(name))
        elif isinstance(name, str) and name.isdigit():
            name = _COMPONENT_IDS.get(int(name), name)
        out.append(str(name).lower())
    return out


# upstream's own component classes by component (what its registry holds by default)
_UPSTREAM_DEFAULTS = {"full": "FullComponent", "swa": "SWAComponent", "mamba": "MambaComponent"}
_UPSTREAM_COMPONENTS = "sglang.srt.mem_cache.unified_cache_components"


def component_overrides(params: Any) -> dict[str, type]:
    """``component_registry_override`` (upstream: component type -> the class the cache builds
    for it instead of its own) as uniradix can honour it: the replacement plug-in class by
    component name.  A uniradix plug-in of the component (a subclass of
    ``fast.components.swa.SwaComponent`` / ``fast.components.mamba.MambaComponent``, built with
    the same arguments and called through the same hooks) replaces the built-in one;
    upstream's own class for the component (what its registry holds anyway) changes nothing.
    Anything else, or any replacement of the Full component (the tree itself here), is
    refused by name (``Unsupported``); entries for components the cache does not have are
    ignored, as upstream ignores them."""
    raw = getattr(params, "component_registry_override", None)
    if not raw:
        return {}
    if not isinstance(raw, dict):
        _refuse("component_registry_override", raw, "a registry override that is not a dict")
    from .components.mamba import MambaComponent
    from .components.swa import SwaComponent
    plugins: dict[str, type] = {"swa": SwaComponent, "mamba": MambaComponent}
    present = set(component_names(getattr(params, "tree_components", None)))
    out: dict[str, type] = {}
    for key, cls in raw.items():
        (name,) = component_names((key,))
        if name not in _UPSTREAM_DEFAULTS:
            raise InvalidInput(f"component_registry_override: unknown component {key!r}")
        if name not in present:
            continue
        if (isinstance(cls, type) and cls.__name__ == _UPSTREAM_DEFAULTS[name]
                and cls.__module__.startswith(_UPSTREAM_COMPONENTS)):
            continue  # upstream's own class: the default
        base = plugins.get(name)
        if base is None or not (isinstance(cls, type) and issubclass(cls, base)):
            what = getattr(cls, "__qualname__", repr(cls))
            _refuse("component_registry_override", {name: what},
                    f"replacing the {name} component with {what} (uniradix runs its own "
                    + (f"plug-ins: a subclass of {base.__module__}.{base.__qualname__} for {name})"
                       if base is not None else "tree for the Full component)"))
        out[name] = cls
    return out


def available_and_evictable_str(cache: Any) -> str:
    """Free plus evictable tokens per component, one line each, in upstream's wording (what
    SGLang prints on its out-of-memory paths)."""
    alloc = cache.token_to_kv_pool_allocator
    if cache.supports_swa() and hasattr(alloc, "full_available_size"):
        avail = alloc.full_available_size()
    else:
        avail = alloc.available_size()
    ev = cache.full_evictable_size()
    lines = [f"Available full tokens: {avail + ev} "
             f"(full_available_size={avail} + full_evictable_size_={ev})"]
    aux = []
    if cache.supports_swa():
        aux.append(("swa", alloc.swa_available_size(), cache.swa_evictable_size()))
    if cache.supports_mamba():
        aux.append(("mamba", cache.req_to_token_pool.mamba_allocator.available_size(),
                    cache.mamba_evictable_size()))
    for name, avail, ev in aux:
        lines.append(f"Available {name}: {avail + ev} "
                     f"(available_size={avail} + component_evictable_size_={ev})")
    return "\n".join(lines) + "\n"


class EngineDefaults:
    """The parts of SGLang's prefix-cache interface (0.5.13.post1's ``BasePrefixCache``) that
    a scheduler may call and that these caches answer the same way as upstream's radix cache:
    no chunk cache; no events (the composed tree, which emits them when asked, has its own
    ``take_events``); streaming sessions through ``self.sessions`` (fast/sessions.py)."""

    sessions: Any  # fast/sessions.py StreamingSessions, made by the cache's _setup

    def is_chunk_cache(self) -> bool:
        return False

    def is_tree_cache(self) -> bool:
        return True

    def supports_fast_match_prefix(self) -> bool:
        return False

    def supports_streaming_session(self) -> bool:
        return True

    def release_session(self, session_id: str) -> None:
        """End a streaming session: its first turn's lock is released, its parked slots go
        back (fast/sessions.py)."""
        self.sessions.release_session(session_id)

    def take_events(self) -> list:
        return []

    def session_held_tokens(self, active_pool_idxs: set | None = None) -> int:
        """KV slots parked in session slots, outside the tree (rows in ``active_pool_idxs``,
        held by running requests, not counted)."""
        return self.sessions.held_tokens(active_pool_idxs)

    def session_held_full_tokens(self, active_pool_idxs: set | None = None) -> int:
        return self.sessions.held_tokens(active_pool_idxs)

    def session_held_swa_tokens(self, active_pool_idxs: set | None = None) -> int:
        return self.sessions.held_swa_tokens(active_pool_idxs)

    def session_held_req_count(self, active_pool_idxs: set | None = None) -> int:
        return self.sessions.held_req_count(active_pool_idxs)

    def session_held_mamba_slots(self, active_pool_idxs: set | None = None) -> int:
        return self.sessions.held_mamba_slots(active_pool_idxs)


# ----------------------------------------------------------------------------------------------
# The request path (upstream's cache_finished_req / cache_unfinished_req), for the device-tier,
# host-tier and hybrid caches alike: it uses their public calls and two hooks,
# ``_prepare_caching_req`` (fill the components' insert data) and ``_cleanup_caching_req``
# (release what the request no longer needs), no-ops without aux components.
# ----------------------------------------------------------------------------------------------


def _key_for(cache: Any, tokens, extra_key) -> RadixKey:
    return RadixKey(tokens if type(tokens) is array else array("q", tokens), extra_key,
                    is_bigram=cache.is_eagle)


def _aligned_len(cache: Any, n_tokens: int) -> int:
    n = max(0, n_tokens - 1) if cache.is_eagle else n_tokens
    return n - n % cache.page_size


def _free(cache: Any, slots: torch.Tensor) -> None:
    """A request's own slots back to the KV allocator, as its ``free`` would take them, through
    fast/frees.py's ``release``: into sglang's exact allocators on the CPU without copying their
    free list, grown into the same tail buffer as the tree's own frees (``cache._tail()``).
    The row's slots are int32 in SGLang's ``req_to_token``; ``free`` leaves the same int64 list
    whichever it is given."""
    if len(slots):
        release(cache.token_to_kv_pool_allocator, [slots.to(torch.int64)], holder=cache._tail())


def _swa_dec_params(req: Any) -> Any:
    """The release of the lock of a request that keeps no ``dec_lock_params`` (sglang's
    ``Req``): its SWA lock boundary ``swa_uuid_for_lock``, where it has one."""
    boundary = getattr(req, "swa_uuid_for_lock", None)
    return None if boundary is None else DecLockRefParams(swa_uuid_for_lock=boundary)


def cache_finished_req(cache: Any, req: Any, is_insert: bool = True) -> None:
    """Cache a finished request's committed tokens (page-aligned), free its committed slots
    from there, release its lock.

    Only the committed positions of the request's row are read (``pop_committed_kv_cache()``,
    or ``kv_committed_len``): past them a reused row holds an earlier request's stale slots,
    which may be the tree's.  A partial last page goes back whole through SGLang's paged
    allocator, which frees the page of every slot it is given.  With ``is_insert`` false (an
    abort), or ``disable_finished_insert``, nothing is inserted and everything the request
    owns from ``cache_protected_len`` on is freed; a disabled cache frees the whole committed
    row."""
    if cache.sessions.try_cache_finished_req(req, is_insert):  # streaming sessions
        return
    committed = req.pop_committed_kv_cache() if hasattr(req, "pop_committed_kv_cache") \
        else req.kv_committed_len
    kv = cache.req_to_token_pool.req_to_token[req.req_pool_idx, :committed]
    if cache.disable:
        _free(cache, kv)
        cache._cleanup_caching_req(req, True, None, None)
        return
    if cache.disable_finished_insert:
        is_insert = False
    protected = req.cache_protected_len
    free_from = protected
    params = result = None
    if is_insert:
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:committed]
        mamba = getattr(cache, "mamba", None)
        if mamba is not None:  # the extra buffer caches up to the last track length
            tokens = tokens[:mamba.finished_cache_len(req, len(tokens))]
            if len(tokens) < committed:  # the slots past it go first, as upstream frees them
                _free(cache, kv[max(len(tokens), protected):])
                kv = kv[:len(tokens)]
        params = InsertParams(key=_key_for(cache, tokens, req.extra_key),
                              value=kv.to(torch.int64), prev_prefix_len=protected,
                              priority=getattr(req, "priority", 0) or 0)
        cache._prepare_caching_req(req, params, True)  # the components' insert data
        result = cache.insert(params)
        free_from = max(_aligned_len(cache, len(tokens)), protected)
    _free(cache, kv[free_from:])
    dec = getattr(req, "dec_lock_params", None)
    cache.dec_lock_ref(req.last_node, dec if dec is not None else _swa_dec_params(req))
    cache._cleanup_caching_req(req, True, result, params)


def _unfinished_cache_len(cache: Any, req: Any, tokens: Any) -> tuple[int, Any] | None:
    """Hybrid models, ``cache_unfinished_req`` (spec/requests.py ``unfinished_cache_len``): how
    many computed tokens go into the tree, and the fresh Mamba slot of the state copy (None
    without Mamba); None: nothing is cached this time.  Mamba takes its slot first (one state
    evicted when the pool is empty; with none to be had the chunk is not cached).  SWA cuts at
    the first SWA tombstone from the protected length on that a lock holds (another holder's
    prefix runs through it: the insert would not give it the request's slots, the match would
    stop above it).  A state copy with a cut below the page-aligned length is not cached (the
    state is the whole computed length's)."""
    if cache.mamba is not None and cache.mamba.extra_buffer:  # the tracked state, handed over
        got = cache.mamba.donate_tracked(req)
        return None if got is None else (_aligned_len(cache, min(got[0], len(tokens))), got[1])
    n = _aligned_len(cache, len(tokens))
    copy = None
    if cache.mamba is not None:
        copy = cache.mamba.try_alloc_slot()
        if copy is None:
            return None
    cut = n
    swa = cache.swa
    if swa is not None:
        key = _key_for(cache, tokens, req.extra_key)
        units = cache._units(key)[:n]
        start, protected = 0, req.cache_protected_len
        for node, shared in cache._plan(key.extra_key, units):
            if (start >= protected and node.value is not None
                    and node.aux[swa.i].value is None and node.lock_ref > 0):
                cut = start
                break
            start += shared
    if copy is not None and cut < n:
        release(cache.mamba.allocator, [copy])  # (fast/frees.py: natively where it can)
        return None
    return cut, copy


def cache_unfinished_req(cache: Any, req: Any, chunked: bool = False) -> None:
    """Cache what a running request has computed so far; its row then points at the tree's
    slots up to the new match, which it locks instead of the old last node.

    The computed tokens are ``req.get_fill_ids()`` (SGLang 0.5.13.post1's ``Req``), or
    ``req.fill_ids`` on a request object without that method (the seed's).  A disabled cache
    only sets ``prefix_indices`` to the computed row."""
    if cache.sessions.try_cache_unfinished_req(req, chunked):  # streaming sessions
        return
    get_fill_ids = getattr(req, "get_fill_ids", None)
    tokens = get_fill_ids() if get_fill_ids is not None else req.fill_ids
    kv = cache.req_to_token_pool.req_to_token[req.req_pool_idx, : len(tokens)]
    if cache.disable:
        req.prefix_indices = kv
        return
    copy = None  # Mamba: the fresh slot of the state copy
    computed = kv  # the request's row of computed tokens (its prefix_indices at the end)
    if getattr(cache, "components", None):  # hybrid models: maybe a shorter length, or none
        cut = _unfinished_cache_len(cache, req, tokens)
        if cut is None:  # nothing cached: the request's prefix is its computed row
            req.prefix_indices = computed.to(torch.int64)
            return
        n, copy = cut
        n = n + 1 if cache.is_eagle and n else n  # (EAGLE: units are bigrams, one token more)
        tokens, kv = tokens[:n], kv[:n]
    key = _key_for(cache, tokens, req.extra_key)
    params = InsertParams(key=key, value=kv.to(torch.int64),
                          prev_prefix_len=req.cache_protected_len, chunked=chunked,
                          priority=getattr(req, "priority", 0) or 0, mamba_value=copy)
    cache._prepare_caching_req(req, params, False)  # the components' insert data
    try:
        result = cache.insert(params)
    except BaseException:
        cache._cleanup_caching_req(req, False, None, params)  # what prepare took goes back
        raise
    m = cache.match_prefix(MatchPrefixParams(key=key))
    new = m.device_indices
    p = req.cache_protected_len
    if len(new) > p:
        cache.req_to_token_pool.write((req.req_pool_idx, slice(p, len(new))), new[p:])
    dec = getattr(req, "dec_lock_params", None)
    cache.dec_lock_ref(req.last_node, dec if dec is not None else _swa_dec_params(req))
    lock = cache.inc_lock_ref(m.last_device_node)
    req.dec_lock_params = lock.to_dec_params()
    req.swa_uuid_for_lock = lock.swa_uuid_for_lock
    req.prefix_indices = torch.cat([new, computed[len(new):]]) if len(new) < len(computed) \
        else new
    req.cache_protected_len = len(new)
    req.last_node = m.last_device_node
    cache._cleanup_caching_req(req, False, result, params)
