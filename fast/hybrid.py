"""The composed cache: the one pure-Python tree with its Full component, composed with the aux
component plug-ins (SWA, Mamba; fast/components/) and the tier plug-in (the host tier,
fast/tiers/host.py) that its params ask for, with upstream SGLang's engine-facing API.
``UnifiedRadixCache(params)`` builds one (``HybridRadixCache``; with a host tier its subclass
``HiCacheRadixCache``, fast/hicache.py) unless the params ask for the device-only Full cache,
whose C core this module does not touch.  The behaviour is the spec's (spec/cache.py,
spec/components.py, spec/host.py) and the seed's, checked step by step by the lockstep runner.

Each plug-in is called through the seed's hooks in component order: match validator, split,
insert overlap, unevict recovery, commit insert, locks, eviction priority and drive, build /
commit host transfers.  What the tree keeps (every structure is incremental; ``violations()``
recomputes each one):

* **Tree.**  ``Node`` (fast/node.py, ``__slots__``): key (``array('q')``; EAGLE: pairs), Full
  slots (an int64 tensor; None only on a node evicted to the host tier), Full lock count,
  access stamp, ``dev_children`` (children holding Full data) so the leaf test is O(1),
  ``aux``: one ``AuxData`` record per aux component (its value, lock count, SWA boundary mark,
  LRU links), ``aux_lock`` (the sum of the aux lock counts, read by the leaf test), and the
  host tier's ``host_value`` / ``host_lock_ref``.
* **Full eviction order**: a lazily deleted heap of ``(stamp, node)`` (``LazyHeap``); an entry
  counts when its stamp is still the node's and the node is still an evictable leaf (unlocked
  in every component, Full data, no child with Full data).  Under an ``eviction_policy`` other
  than ``lru`` the entries are ``(key, node)`` with the policy's key (fast/policies.py), live
  while the key is still the node's; the host leaves' heap likewise.
* **Aux LRU lists**: one per component (``LruList`` of its records, fast/structures.py), a
  record is in it exactly when it holds device data.  A touch moves a node's records to the
  front; a match moves the matched path, node first; a split re-files the halves; new data
  enters at the front.  A component's eviction walks its list from the oldest end.
* **Eviction** (one driver, ``evict``): Full first (the heap; with a host tier a leaf goes to
  the host, ``HostTier.evict_leaf``), then each component's drive; every device free goes onto
  one ``FreeBatch`` (fast/frees.py) handed to the allocators at the end.  The seed's priorities
  decide the cascade on an internal node: Full 2 > SWA 1 > Mamba 0, so dropping SWA data drops
  the node's (unlocked) Mamba state too; on a leaf the node leaves the device with everything.
* **Sizes**: Full counters here, each component's in its plug-in, the host tier's in it.
* **Slot validation** (as ``cache.py``'s ``validate_slots``): the Full slots the tree holds
  here, the Mamba states in the Mamba plug-in.

Complexities: ``match_prefix`` / ``insert`` O(n + d) (n tokens, d nodes on the path), plus the
list moves, O(d) per component; ``inc_lock_ref`` / ``dec_lock_ref`` O(d) (SWA stops after one
window); ``evict`` O(k log L) for k Full victims, O(1) per list step; the host tier's
operations as fast/tiers/host.py says.
"""

from __future__ import annotations

import heapq
from array import array
from typing import Any

import torch

from . import compat, host_aux, host_full, keys, one_aux, pair_evict, policies
from . import params as api  # the API types, named api.X
from .cache import UnifiedRadixCache, _core, _match_result
from .components import AuxComponent, AuxData
from .components.mamba import MambaComponent, mamba_state
from .components.swa import SwaComponent
from .errors import InvalidInput, Unsupported
from .frees import FreeBatch, release
from .node import Node
from .radix_key import RadixKey
from .structures import LazyHeap
from .tiers.host import (
    HiCacheConfig,
    HostIncLockRefResult,
    HostTier,
    HostUnlockParams,
    InitLoadBackParams,
    count_arg,
)
from .token_range import check_token_range

STRIDE = 1 << 20  # clock step per touch (a match path of up to STRIDE nodes fits below it)
FULL = 0  # the Full component's id in skip_lock_node_ids (upstream's ComponentType)
_INT64 = torch.int64
_INF = float("inf")
_narrow_copy = torch.narrow_copy  # one torch call per copy (a slice is a view: plain indexing)


HybridNode = Node  # the one pure-Python node type (fast/node.py)

# the attributes naming the one-component fast paths a cache runs (fast/one_aux.py; None: the
# general path), which ``HybridRadixCache._pick_fast_paths`` sets
FAST_PATHS = ("_match_fast", "_insert_fast", "_inc_lock_fast", "_dec_lock_fast", "_evict_fast")

# the hooks fast/host_full.py's paths write out or call, as this class has them (a subclass that
# overrides one runs the general paths)
_HOST_FULL_HOOKS = ("_touch", "_stamp", "_push_if_leaf", "_split",
                    "_cut", "_unevict", "_new_node", "_stamp_tiered_path", "_indices", "_free",
                    "_units", "_insert", "match_prefix")

# the hooks fast/_core.c ``host_evict`` (``_evict_units`` of the Full component alone over the
# host tier) stands for, as this class has them (a subclass that overrides one runs the loop)
_HOST_EVICT_HOOKS = ("_evict_units", "_release", "_push_if_leaf", "_delete_leaf",
                     "_drop_device", "_detach_leaf", "_is_leaf")

# the hooks fast/_core.c ``host_aux_evict`` (``_evict_units`` of one stock SWA or Mamba plug-in
# over the host tier) stands for, as this class has them (a subclass that overrides one runs the
# Python path)
_HOST_AUX_EVICT_HOOKS = _HOST_EVICT_HOOKS + ("_cascade",)

# the hooks fast/host_aux.py's lock paths stand for (through fast/one_aux.py's), as this class
# has them (a subclass that overrides one runs the general paths)
_HOST_AUX_HOOKS = ("inc_lock_ref", "dec_lock_ref", "_inc_lock_py", "_dec_full_lock",
                   "_push_if_leaf", "_check_attached")

# the hooks fast/host_aux.py's insert (and its C twin ``host_aux_insert``) writes out, as this
# class has them (a subclass that overrides one runs ``_insert``)
_HOST_AUX_INSERT_HOOKS = ("_insert", "_touch", "_stamp", "_push_if_leaf", "_new_node", "_ck",
                          "_own", "_free", "_units", "_check_aux", "_unevict")

# the hooks fast/host_aux.py's match calls or writes out, as this class has them
_HOST_AUX_MATCH_HOOKS = ("match_prefix", "_split", "_indices", "_stamp_tiered_path", "_units")

# the hooks the general match's pair branch calls, as this class has them: where one is
# overridden the C core's twin of that branch (``pair_match``) is not used
_PAIR_MATCH_HOOKS = ("match_prefix", "_split", "_units", "_indices", "_stamp_path",
                     "_push_if_leaf")

# the hooks the general insert's pair path calls inline or not at all where the C core's twin
# of its walk, leaf and commits (``pair_insert``) runs: as this class has them, or that twin
# is not used (``_split``, ``_free`` and ``_stamp`` it calls as methods)
_PAIR_INSERT_HOOKS = ("_insert", "_plan", "_new_node", "_ck", "_own")

# the hooks ``_insert``'s prologue calls for the pair (key, checks, plan), as this class has
# them: where one is overridden (or any of _PAIR_INSERT_HOOKS) the C core's whole insert
# (``pair_insert_api``) is not used
_PAIR_INSERT_API_HOOKS = ("_units", "_check_aux")

# the hooks the general lock and unlock call (or are) for the pair, as this class has them:
# where one is overridden the C core's twins of those paths (``pair_inc``, ``pair_dec``) are
# not used
_PAIR_LOCK_HOOKS = ("inc_lock_ref", "dec_lock_ref", "_inc_lock_py", "_dec_full_lock",
                    "_push_if_leaf", "_check_attached")
_PLAN = UnifiedRadixCache._plan

# the hooks the general evict calls per node that fast/pair_evict.py writes out, as this class
# has them: where one is overridden the pair runs the general evict
_PAIR_EVICT_HOOKS = ("_evict_units", "_delete_leaf", "_drop_device", "_detach_leaf",
                     "_push_if_leaf", "_cascade", "_is_leaf")

# the aux components a host tier can carry (spec/host.py models them), alone or together
HOST_AUX: frozenset = frozenset({"mamba", "swa"})


def _components_of(params: Any) -> list[str]:
    """The component names of ``params`` (Full first), refusing a set the tree cannot
    compose."""
    names = compat.component_names(params.tree_components)
    if names[:1] != ["full"] or any(n not in ("swa", "mamba") for n in names[1:]) \
            or len(set(names)) != len(names):
        raise Unsupported(f"tree_components {names}: the cache composes Full plus SWA and/or "
                          "Mamba, each once, Full first")
    return names


def check_host_components(names: list[str]) -> None:
    """Refuse a host tier with an aux component the host tier cannot carry yet."""
    missing = [n for n in names[1:] if n not in HOST_AUX]
    if missing:
        raise Unsupported(f"a host tier with SWA or Mamba is not supported yet for {missing}")


class HybridRadixCache(UnifiedRadixCache):
    """The composed radix prefix cache; see the module docstring for the structures.

    What ``UnifiedRadixCache(params)`` returns for Full + SWA, Full + Mamba or
    Full + SWA + Mamba params (``tier`` None), and, as its subclass ``HiCacheRadixCache``, for
    params with a host tier (``tier``: the ``HostTier``): the tree and the Full component,
    composed with one plug-in per aux component and the tier plug-in (pure Python)."""

    core = "python"
    core_reason = "a hybrid cache (SWA or Mamba): the C core covers the device-only Full path"
    _node_type = HybridNode
    tier: HostTier | None = None
    storage_tier: Any = None  # the storage tier (fast/tiers/storage.py), below the host tier
    _events: Any = None  # the KV event queue (fast/events.py) when events are on

    def __init__(self, params: api.CacheInitParams, hicache: HiCacheConfig | None = None) -> None:
        names = _components_of(params)
        settings = compat.read_settings(params)
        hicache = hicache if hicache is not None else settings.hicache
        if hicache is None and len(names) < 2:
            # Full only, on this tree: a setting only it honours (compat.PYTHON_TREE), or a
            # caller that built this class by name
            self.core_reason = (compat.python_tree_reason(params)
                                or "HybridRadixCache built by name: the composed Python tree")
        if hicache is not None:
            check_host_components(names)
        self._setup(params, multi_rank=hicache is None)
        # the eviction policy (fast/policies.py): its key, None for lru (the stamp order)
        self.eviction_policy = policies.policy_name(getattr(params, "eviction_policy", "lru"))
        self._policy_key = policies.KEYS.get(self.eviction_policy)
        self.component_names = names
        alloc = self.token_to_kv_pool_allocator
        self.swa: SwaComponent | None = None
        self.mamba: MambaComponent | None = None
        comps: list[AuxComponent] = []
        plugin = compat.component_overrides(params)  # component_registry_override
        self.sliding_window_size = None
        for name in names[1:]:
            if name == "swa":
                window = params.sliding_window_size
                if type(window) is not int or window < 1:
                    raise InvalidInput(f"SWA needs a positive sliding_window_size, got {window!r}")
                for m in ("translate_loc_from_full_to_swa", "free_swa", "free"):
                    if not hasattr(alloc, m):
                        raise InvalidInput(f"SWA needs an allocator with {m}() (an SWA allocator)")
                self.sliding_window_size = window
                self.swa = plugin.get("swa", SwaComponent)(self, len(comps), window)
                comps.append(self.swa)
            else:
                mamba_alloc = getattr(params.req_to_token_pool, "mamba_allocator", None)
                if mamba_alloc is None:
                    raise InvalidInput("Mamba needs a req_to_token_pool with a mamba_allocator")
                self.mamba_allocator = mamba_alloc
                self.mamba = plugin.get("mamba", MambaComponent)(self, len(comps))
                self.mamba.extra_buffer = bool(getattr(params, "enable_mamba_extra_buffer", False))
                self.mamba.extra_buffer_lazy = bool(  # (compat.check_extra_buffer_lazy)
                    getattr(params, "enable_mamba_extra_buffer_lazy", False))
                comps.append(self.mamba)
        self.components: tuple[AuxComponent, ...] = tuple(comps)
        self._has_mamba = any(c.name == "mamba" for c in self.components)
        self._n_aux = len(comps)  # 0, 1 or 2
        if not comps and type(self)._new_node is HybridRadixCache._new_node:
            # no aux record to add: a new node is a plain ``Node`` (``_new_node`` with n == 0)
            self._new_node = Node  # type: ignore[method-assign]
        else:  # (init_hicache builds again on the same instance)
            self.__dict__.pop("_new_node", None)
        if not comps and type(self)._touch is HybridRadixCache._touch:
            # no aux record to move: a touch is the stamp (``_touch`` with n == 0)
            self._touch = self._stamp  # type: ignore[method-assign]
        else:
            self.__dict__.pop("_touch", None)
        # one component with its own validator: a match without a host tier applies the rule
        # inline, without a call per node (SWA: a window of contiguous data up to the node;
        # Mamba: data on the node, the same rule with a window of 0); -1: the validators
        self._inline_window = -1
        if len(comps) == 1:
            one = comps[0]
            if isinstance(one, SwaComponent) and type(one).validator is SwaComponent.validator:
                self._inline_window = one.window
            elif isinstance(one, MambaComponent) \
                    and type(one).validator is MambaComponent.validator:
                self._inline_window = 0
        self.mamba_cache_chunk_size = compat.mamba_chunk_size(settings.mamba_cache_chunk_size)
        self._events = compat.kv_events_for(params)  # KV events (fast/events.py), or None
        if hicache is not None:
            from .tiers.host import with_tp_group  # tp_cache_group: the acks' MIN over ranks
            self._attach_tier(with_tp_group(hicache, params))
        else:
            self.tier = None
            self._evict_leaf = self._delete_leaf
        if self._policy_key is not None:
            policies.attach(self)
        self._pick_fast_paths()
        self.reset()
        compat.wire_metrics(self, params)  # enable_metrics (fast/metrics.py)

    # the one-component fast paths (fast/one_aux.py) this cache runs, or None: the general path
    _one_aux: Any = None  # with them: (the one component, whether it is SWA, its id)
    _match_fast: Any = None
    _insert_fast: Any = None
    _inc_lock_fast: Any = None
    _dec_lock_fast: Any = None
    _evict_fast: Any = None
    _host_evict = False  # ``_evict_units`` calls fast/_core.c ``host_evict`` first
    _host_aux_evict = False  # ``_evict_units`` calls fast/_core.c ``host_aux_evict`` first
    _dec_lock_host: Any = None  # fast/host_full.py's or host_aux.py's unlock
    # fast/host_aux.py's write-through lock (``HostTier.write_backup``; None: inc_lock_ref's)
    _write_lock: Any = None
    _inline_touch = False  # see ``_pick_fast_paths``
    _pair: tuple[int, int, int] | None = None  # see ``_pick_fast_paths``
    _pair_insert = False  # see ``_pick_fast_paths``
    _one_insert = False  # see ``_pick_fast_paths``
    _insert_next: Any = None  # what ``insert`` runs where ``_insert_fast`` declines, first

    def _pick_fast_paths(self) -> None:
        """Choose once which paths run: fast/one_aux.py's when the cache has exactly one aux
        component, the stock SWA or Mamba plug-in with its hooks as they are, no host tier
        and the ``lru`` order (what those paths assume); with a host tier, fast/host_full.py's
        for the Full component alone and fast/host_aux.py's (match and locks) for one stock
        aux component, each under the same conditions on the hooks and the order; else the
        general ones."""
        self._match_fast = self._insert_fast = self._inc_lock_fast = self._dec_lock_fast = None
        self._evict_fast = self._dec_lock_host = self._one_aux = self._write_lock = None
        self._host_evict = self._host_aux_evict = False
        cls_ = type(self)
        # the general insert's walk touches each node inline (``_touch``, ``_stamp`` and
        # ``_push_if_leaf`` as this class has them: a policy pushes its own key, a subclass
        # may stamp otherwise)
        self._inline_touch = (self._policy_key is None and bool(self.components)
                              and cls_._touch is HybridRadixCache._touch
                              and cls_._stamp is HybridRadixCache._stamp
                              and cls_._push_if_leaf is HybridRadixCache._push_if_leaf)
        # the stock SWA and Mamba plug-ins together without a host tier: the general match
        # applies both validators' rules inline and moves both lists in one walk up the path;
        # (SWA's index, its window, Mamba's index), else None
        self._pair = None
        self._pair_insert = self._one_insert = False
        self._insert_next = None
        if self.tier is None and len(self.components) == 2 and self.swa is not None \
                and self.mamba is not None and type(self.swa) is SwaComponent \
                and type(self.mamba) is MambaComponent:
            self._pair = (self.swa.i, self.swa.window, self.mamba.i)
            if _core is not None and self._policy_key is None and not self.is_eagle and all(
                    getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _PAIR_MATCH_HOOKS):
                # the general match's pair branch in C (fast/_core.c "cmatch": the same
                # steps; None, nothing changed, where it declines: the general path runs)
                self._match_fast = _core.pair_match
            # the general insert's walk, leaf and commits in C (fast/_core.c "cinsert",
            # ``pair_insert``: the same steps; None, nothing changed, where it declines)
            self._pair_insert = _core is not None and self._inline_touch \
                and not self.is_eagle and all(getattr(cls_, m) is getattr(HybridRadixCache, m)
                                              for m in _PAIR_INSERT_HOOKS)
            if self._pair_insert and keys.match_step is getattr(_core, "match_step", None) \
                    and all(getattr(cls_, m) is getattr(HybridRadixCache, m)
                            for m in _PAIR_INSERT_API_HOOKS):
                # ``_insert`` whole in C, checks to commits (fast/_core.c "cinsert",
                # ``pair_insert_api``: the same steps; None, nothing changed, where it
                # declines: ``_insert`` runs from its start, with its own errors)
                self._insert_fast = _core.pair_insert_api
            if _core is not None and self._policy_key is None and not self.is_eagle and all(
                    getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _PAIR_LOCK_HOOKS):
                # the general lock and unlock in C (fast/_core.c "pair locks": the same steps;
                # None, nothing changed, where they decline: the general path runs)
                self._inc_lock_fast, self._dec_lock_fast = _core.pair_inc, _core.pair_dec
            if self._policy_key is None and not self.is_eagle and all(
                    getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _PAIR_EVICT_HOOKS):
                # the general evict written out (fast/pair_evict.py, its loops in C)
                self._evict_fast = pair_evict.evict_pair
        if self.tier is not None and not self.components and self._policy_key is None \
                and not self.is_eagle and all(
                    getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _HOST_FULL_HOOKS):
            # the Full component alone over the host tier (fast/host_full.py)
            self._match_fast = host_full.match_host
            self._insert_fast = host_full.insert_host
            self._inc_lock_fast = host_full.inc_lock_host
            self._dec_lock_host = host_full.dec_lock_host
            # ``_evict_units`` in C where the eviction hooks are this class's (fast/_core.c
            # "host tier: Full device evict": the same steps; None, nothing changed, where it
            # declines: the loop below runs)
            self._host_evict = _core is not None and all(
                getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _HOST_EVICT_HOOKS)
            return
        if self.tier is not None and len(self.components) == 1 and self._policy_key is None \
                and type(self.components[0]) in (SwaComponent, MambaComponent) and all(
                    getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _HOST_AUX_HOOKS):
            # one stock aux component over the host tier: its locks where the host tier makes
            # no difference (fast/host_aux.py, through fast/one_aux.py's lock paths)
            one = self.components[0]
            self._one_aux = (one, type(one) is SwaComponent, one.component_id)
            self._inc_lock_fast = host_aux.inc_lock_host_aux
            self._dec_lock_host = host_aux.dec_lock_host_aux
            self._write_lock = host_aux.write_lock
            # ``_evict_units`` in C where the eviction hooks are this class's (fast/_core.c
            # "host tier: one aux component's device evict": the same steps; None, nothing
            # changed, where it declines: the Python path runs)
            self._host_aux_evict = _core is not None and all(
                getattr(cls_, m) is getattr(HybridRadixCache, m) for m in _HOST_AUX_EVICT_HOOKS)
            if not self.is_eagle and all(getattr(cls_, m) is getattr(HybridRadixCache, m)
                                         for m in _HOST_AUX_MATCH_HOOKS):
                self._match_fast = host_aux.match_host_aux
            if _core is not None and hasattr(_core, "host_aux_insert") and not self.is_eagle \
                    and self._inline_touch and keys.match_step is getattr(_core, "match_step", None) \
                    and cls_._plan is _PLAN and all(
                        getattr(cls_, m) is getattr(HybridRadixCache, m)
                        for m in _HOST_AUX_INSERT_HOOKS):
                # ``_insert`` from its checks on, its walk, leaf and commit in C
                # (fast/host_aux.py ``insert_host_aux``, fast/_core.c "host tier: one aux
                # component's insert": the same steps; None, nothing changed, where it
                # declines: ``_insert`` runs from its start, with its own errors)
                self._insert_fast = host_aux.insert_host_aux
            return
        if self.tier is not None or self._policy_key is not None or len(self.components) != 1:
            return
        one = self.components[0]
        cls = type(one)
        if cls in (SwaComponent, MambaComponent) and not self.is_eagle and self._inline_window >= 0:
            self._one_aux = (one, cls is SwaComponent, one.component_id)
            self._match_fast = one_aux.match_one  # (``_inline_window``: the validator's rule)
            self._insert_fast = one_aux.insert_one
            if _core is not None and hasattr(_core, "one_insert_api") \
                    and keys.match_step is getattr(_core, "match_step", None) \
                    and cls_._plan is _PLAN:
                # ``insert_one`` whole in C, checks to commit (fast/_core.c "one_insert_api":
                # the same steps; None, nothing changed, where it declines: ``insert_one``
                # runs from its start, with its own errors, then ``_insert`` if it declines)
                self._one_insert = True
                self._insert_fast, self._insert_next = _core.one_insert_api, one_aux.insert_one
            self._inc_lock_fast, self._dec_lock_fast = one_aux.inc_lock_one, one_aux.dec_lock_one
            self._evict_fast = one_aux.evict_swa if cls is SwaComponent else one_aux.evict_one

    def _attach_tier(self, hicache: HiCacheConfig) -> None:
        """Compose the host tier (its state and the names upstream's HiCache cache has)."""
        tier = self.tier = HostTier(self, hicache)
        self.core_reason = "a host tier: the C core covers the device-only Full path"
        self.cache_controller = tier.controller
        self.write_policy = tier.write_policy
        self.write_through_threshold = tier.write_through_threshold
        self.load_back_threshold = tier.load_back_threshold
        self.host_leaves = tier.host_leaves
        self.ongoing_write_through = tier.ongoing_write_through
        self.ongoing_load_back = tier.ongoing_load_back
        self._evict_leaf = tier.evict_leaf
        self.storage_tier = None  # the storage tier below the host tier (fast/tiers/storage.py)
        if hicache.storage is not None:
            from .tiers.storage import StorageTier
            tier.storage = self.storage_tier = StorageTier(self, hicache.storage)
        for comp in self.components:
            comp.attach_host(tier, hicache)

    # ------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------

    def _new_node(self, key, value, parent, extra_key, stamp: int, ck=None) -> Node:
        node = Node(key, value, parent, extra_key, stamp, ck)
        # one record per component (written out: this runs for every new node)
        n = self._n_aux
        if n:
            node.aux = (AuxData(node),) if n == 1 else (AuxData(node), AuxData(node))
        return node

    def reset(self) -> None:
        """Forget the whole tree (the device allocators are the caller's to clear, as
        upstream; a host tier clears its host pool and forgets its transfers)."""
        self._clock = 0
        self.root_node = self._new_node(array("q"), self._empty, None, None, 0)
        self.root_node.lock_ref = 1
        # (stamp, node) or, under a policy, (key, node): evictable device leaves, lazily deleted
        self._leaf_heap: LazyHeap = policies.heap_for(self.eviction_policy)
        self._heap: list = self._leaf_heap.entries
        self._evictable = self._protected = 0
        self._owned: set = set()  # Full slots the tree holds (validate_slots)
        for comp in self.components:
            comp.reset()
        if self.tier is not None:
            self.tier.reset()
        if self._events is not None:
            self._events.cleared()
        self.sessions.reset()

    def take_events(self) -> list:
        """The KV events queued since the last call, oldest first (``enable_kv_cache_events``;
        fast/events.py); always empty with events off."""
        ev = self._events
        return ev.take() if ev is not None else []

    def _sizes(self, comp: AuxComponent | None) -> tuple[int, int]:
        return (0, 0) if comp is None else (comp.evictable, comp.protected)

    def swa_evictable_size(self) -> int:
        return self._sizes(self.swa)[0]

    def swa_protected_size(self) -> int:
        return self._sizes(self.swa)[1]

    def mamba_evictable_size(self) -> int:
        return self._sizes(self.mamba)[0]

    def mamba_protected_size(self) -> int:
        return self._sizes(self.mamba)[1]

    def total_size(self) -> tuple[int, int]:
        """(Full units, aux units of every component) held on the device."""
        return (self._evictable + self._protected,
                sum(c.evictable + c.protected for c in self.components))

    def host_size(self) -> int:
        """Host tokens held (0 without a host tier)."""
        return self.tier.host_tokens if self.tier is not None else 0

    def supports_swa(self) -> bool:
        return self.swa is not None

    def supports_mamba(self) -> bool:
        return self.mamba is not None

    # ------------------------------------------------------------------------------------------
    # Leaves, clock, aux LRU lists
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _is_leaf(node: HybridNode) -> bool:
        return (node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0
                and node.value is not None and node.parent is not None)

    def _push_if_leaf(self, node: HybridNode) -> None:
        # (``_is_leaf`` and the base's push, inlined: this runs for every stamped node; a
        # policy sets its own push on the instance, fast/policies.py)
        if (node.lock_ref == 0 and node.aux_lock == 0 and node.dev_children == 0
                and node.value is not None and node.parent is not None):
            heapq.heappush(self._heap, (node.last_access_time, node))

    def _stamp(self, node: HybridNode) -> None:
        self._clock += STRIDE
        node.last_access_time = self._clock
        if node.value is not None:
            self._push_if_leaf(node)
        elif self.tier is not None:
            self.tier.restamped(node)

    def _touch(self, node: HybridNode) -> None:
        """A node on an insert's walk: newest stamp, front of the aux lists."""
        self._stamp(node)
        n = self._n_aux
        if n and node is not self.root_node:
            if n == 1:  # (one component: no zip)
                rec = node.aux[0]
                if rec.value is not None:
                    self.components[0].lru.move_to_front(rec)
                return
            for comp, rec in zip(self.components, node.aux, strict=True):
                if rec.value is not None:
                    comp.lru.move_to_front(rec)

    def lru_order(self, name: str | None = None) -> list[HybridNode]:
        """Component ``name``'s LRU list (the only one when None), oldest first."""
        comp = self._component(name)
        return [rec.node for rec in comp.lru.oldest_first()]

    def _component(self, name: str | None) -> AuxComponent:
        for comp in self.components:
            if name is None or comp.name == name:
                return comp
        raise InvalidInput(f"no aux component {name!r} in {self.component_names}")

    # ------------------------------------------------------------------------------------------
    # Tree structure
    # ------------------------------------------------------------------------------------------

    def _split(self, child: HybridNode, k: int) -> HybridNode:
        """Cut ``child`` after ``k`` units; the new upper node takes its place (each component
        then splits its own data, ``AuxComponent.split``, and the tier its copy)."""
        upper = self._cut(child, k)
        if self._policy_key is not None:
            policies.inherit_on_split(upper, child)
        for comp in self.components:
            comp.split(upper, child, k)
        if self.tier is not None:
            self.tier.split(upper, child, k)
        self._stamp(child)
        return upper

    def _units(self, key) -> Any:
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        toks = key.token_ids
        if self.is_eagle or key.is_bigram:
            # EAGLE bigram units pair each token with the next: the shifted side is one shorter
            return list(zip(toks, toks[1:], strict=False))
        return toks if type(toks) is array else array("q", toks)

    def _unevict(self, node: HybridNode, value: torch.Tensor, pos: int) -> None:
        """An evicted node met by an insert holds device data again (the base's), so it is no
        host leaf."""
        assert self.tier is not None  # only a host tier leaves evicted nodes in the tree
        self.tier.host_leaves.discard(node)
        super()._unevict(node, value, pos)
        if self._events is not None:
            self._events.stored(node)

    # ------------------------------------------------------------------------------------------
    # match_prefix
    # ------------------------------------------------------------------------------------------

    def match_prefix(self, params: api.MatchPrefixParams) -> api.MatchResult:
        """Longest cached prefix of ``params.key`` (whole pages) that ends at a node every aux
        component's validator accepts: SWA, a contiguous run of SWA data of one window up to
        it (unbounded from the root, restarted at a tombstone); Mamba, a state on the node.
        With a host tier the walk goes through evicted nodes with a host copy: the device
        indices are the device part, ``host_hit_length`` the host tokens below it.  The walk
        goes on past rejected nodes (splitting at a partial match); the accepted path becomes
        the most recent.  Mamba answers ``mamba_branching_seqlen`` when the walk went
        further."""
        fast = self._match_fast  # (one component: fast/one_aux.py; SWA and Mamba: C, cmatch)
        if fast is not None:
            result = fast(self, params)
            if result is not None:
                self._upkeep()
                return result
        key = params.key
        if key.__class__ is not RadixKey:  # (once: ``_units`` and the extra key read it)
            key = compat.as_radix_key(key)
        units = self._units(key)
        if self.mamba is not None and getattr(params, "cow_mamba", False):
            # Mamba copy-on-write: the plain match, then the request's state (the plug-in)
            return self.mamba.match_prefix_cow(params)
        root = self.root_node
        ps = self.page_size
        n = len(units) - len(units) % ps
        if self.disable or n == 0:
            return api.MatchResult(self._empty, root, root, root, 0, 0, 0, None, None)
        ek = key.extra_key
        node, pos, chunks = root, 0, []
        best, best_chunks = root, 0
        tier = self.tier
        last_device = root  # the deepest node of the walk holding device data
        best_device = root  # with a host tier: the deepest device node valid on the device
        plain = not self.components  # no validators: the walk's end is the match
        inline_i, window, run = -1, 0, _INF
        pair = self._pair
        mamba_i = -1
        validators: list
        device_validators: list
        if pair is not None:  # (both validators, inlined below)
            inline_i, window, mamba_i = pair
            validators = device_validators = []
        elif plain:
            validators = []
            device_validators = []
        elif self._inline_window >= 0 and tier is None:  # (the validator, inlined below)
            inline_i, window = self.components[0].i, self._inline_window
            validators = device_validators = []
        elif tier is None:
            validators = [comp.validator() for comp in self.components]
            device_validators = []
        else:
            validators = [comp.host_validator() for comp in self.components]
            device_validators = [comp.validator() for comp in self.components]
        one = validators[0] if len(validators) == 1 else None
        step = keys.match_step
        while pos < n:
            child, k, split = step(node.children, units, pos, n, ps, ek)
            if child is None or (child.value is None and child.host_value is None):
                break
            if split:
                child = self._split(child, k)
            value = child.value
            if value is not None:
                chunks.append(value)
                last_device = child
            node, pos = child, pos + k
            if plain:
                if split:
                    break
                continue
            if inline_i >= 0:  # contiguous units with data ending here; a tombstone restarts
                if child.aux[inline_i].value is None:
                    run = 0
                    ok = False
                else:
                    run += k
                    ok = run >= window
                    if mamba_i >= 0 and child.aux[mamba_i].value is None:
                        ok = False  # (SWA's run counts on: every validator sees every node)
            elif one is not None:
                ok = one(child, k)
            else:
                ok = True
                for v in validators:  # every validator sees every node (SWA counts its run)
                    if not v(child, k):
                        ok = False
            if tier is None:
                if ok:
                    best, best_chunks = child, len(chunks)
            else:
                if ok:
                    best = child
                dev_ok = value is not None
                for v in device_validators:
                    if not v(child, k):
                        dev_ok = False
                if dev_ok:
                    best_device, best_chunks = child, len(chunks)
            if split:  # the match ends inside the old node
                break
        if plain:  # (device nodes are a prefix of the walk)
            best, best_device, best_chunks = node, last_device, len(chunks)
        if pair is None:
            for comp in self.components:
                comp.path_to_front(best)
        else:  # (each plug-in's ``path_to_front``, both lists in one walk: the same moves)
            comps = self.components
            l0, l1 = comps[0].lru, comps[1].lru
            p0, p1 = l0.head, l1.head
            cur = best
            while cur is not root:
                r0, r1 = cur.aux
                if r0.value is not None:
                    l0.move_after(p0, r0)
                    p0 = r0
                if r1.value is not None:
                    l1.move_after(p1, r1)
                    p1 = r1
                cur = cur.parent
        indices = self._indices(chunks if best_chunks == len(chunks) else chunks[:best_chunks])
        if tier is not None:
            self._stamp_tiered_path(best)
            mamba_hit = swa_hit = 0
            if self.mamba is not None and best is not root:
                mamba_hit = 1 if self.mamba.wants_load_back(best) else 0
            if self.swa is not None and best is not root:
                swa_hit = self.swa.host_hit(best)
            # (no host tokens between a node and itself: host_hit's 0 without the call)
            host_hit = tier.host_hit(best, best_device) if best is not best_device else 0
            # (all nine fields given: NamedTuple's Python-level __new__ skipped, as cache.py's)
            self._upkeep()
            return _match_result((indices, best_device, best, best, host_hit, swa_hit,
                                  mamba_hit, None, None))
        self._stamp_path(best)
        if best is not root:
            self._push_if_leaf(best)
        branching = None
        if self.mamba is not None and len(chunks) > best_chunks:
            c = self.mamba_cache_chunk_size
            aligned = pos // c * c
            branching = aligned if aligned > 0 else None
        # (all nine fields given: NamedTuple's Python-level __new__ skipped, as cache.py's)
        self._upkeep()
        return _match_result((indices, best, best, best, 0, 0, 0, branching, None))

    def _stamp_tiered_path(self, node: HybridNode) -> None:
        """A match's stamps with a host tier (``_stamp_path``'s order): an ancestor whose path
        child is evicted can be a device leaf, so every stamped node may need a fresh heap
        entry, on the device heap or the host leaves'."""
        root = self.root_node
        tier = self.tier
        assert tier is not None
        clock = self._clock + STRIDE
        self._clock = clock
        cur: Any = node
        push = self._push_if_leaf
        while cur is not root:
            cur.last_access_time = clock
            if cur.value is None:
                tier.restamped(cur)
            elif cur.dev_children == 0:  # (the leaf test's part most path nodes fail)
                push(cur)
            clock -= 1
            cur = cur.parent
        root.last_access_time = clock

    # ------------------------------------------------------------------------------------------
    # insert
    # ------------------------------------------------------------------------------------------

    def _check_aux(self, plan: list, prev: int, params: api.InsertParams) -> tuple:
        """The spec's aux checks (spec/components.py check_insert_aux): the settings that need
        a component, then each component's own (``check_insert``)."""
        e = params.swa_evicted_seqlen
        if type(e) is not int or e < 0:
            raise InvalidInput(f"swa_evicted_seqlen must be a non-negative int, got {e!r}")
        if e and self.swa is None:
            raise InvalidInput("insert: swa_evicted_seqlen needs the SWA component")
        if e % self.page_size:
            raise InvalidInput(f"insert: swa_evicted_seqlen={e} is not whole pages")
        if self.mamba is None and params.mamba_value is not None:
            raise InvalidInput("insert: mamba_value needs the Mamba component")
        if self.disable:  # a disabled cache checks only the above (spec check_insert_args)
            return [], e
        return [comp.check_insert(plan, prev, params, e) for comp in self.components], e

    def insert(self, params: api.InsertParams) -> api.InsertResult:
        """See :meth:`_insert`; the slots it frees (the caller's duplicates, a tombstone's
        slots taken over, a remainder outside the window) go back in the order it frees them,
        in as few allocator calls as the allocator allows (fast/frees.py)."""
        self._deferred = []
        try:
            fast = self._insert_fast  # (one component, no host tier: C, one_insert_api, then
            if fast is not None:  # fast/one_aux.py; the pair: C, pair_insert_api; Full over a host tier:
                # fast/host_full.py; here, not in ``_insert``: one Python frame less per insert)
                result = fast(self, params)
                if result is not None:
                    return result
                fast = self._insert_next  # (one component: insert_one where C declined)
                if fast is not None:
                    result = fast(self, params)
                    if result is not None:
                        return result
            return self._insert(params)
        finally:
            pieces, self._deferred = self._deferred, None
            if pieces:  # (release() of nothing does nothing)
                release(self.token_to_kv_pool_allocator, pieces)
            self._upkeep()

    def _insert(self, params: api.InsertParams) -> api.InsertResult:
        """Cache ``key -> value``: touch the path, split at a partial match, restore evicted
        nodes from the fresh slots (their host copies stay), free the caller's duplicates from
        ``prev_prefix_len`` on (an SWA tombstone inside the caller's window takes its slots
        instead), add the remainder as a new leaf, then each component commits its data on
        the last node (SWA inside the window; the Mamba state); with a host tier, count hits
        (write-through backs a node up once its count reaches the threshold).  Returns the
        length already cached and, for Mamba, whether the node had a state already.  (The
        one-component fast path, where it answers, ran in :meth:`insert`.)"""
        key, value = params.key, params.value
        if type(key) is not RadixKey:
            key = compat.as_radix_key(key)
        units = self._units(key)
        toks = key.token_ids
        value, prev, chunked, priority = host_full.insert_args(params, value, len(toks))
        keyed = self._policy_key is not None
        n = len(units)
        if n % self.page_size:
            n -= n % self.page_size
            units = units[:n]
        if n < len(toks):
            value = value[:n]  # (a view, as ``torch.narrow``'s, one torch call cheaper)
        ek = key.extra_key
        if self._pair_insert:  # (the same walk in one C call: fast/_core.c one_plan)
            plan = _core.one_plan(self.root_node, units, ek, self.page_size, keys.match_step)
        else:
            plan = self._plan(ek, units)  # (units cut to whole pages)
        tier = self.tier
        if self.validate_slots and not self.disable:
            slots = value.tolist()
            self._check_slot_list(plan, slots, prev)
            if tier is not None:
                tier.check_unevict_slots(plan, slots)
        if self._pair is not None and not self.validate_slots and not self.disable:
            # ``_check_aux`` for the stock SWA and Mamba plug-ins, written out, in its order:
            # the settings, then each plug-in's ``check_insert`` (SWA's loop can only raise
            # with a ``prev_prefix_len``; Mamba's without a slot ledger is ``mamba_state``)
            e = params.swa_evicted_seqlen
            if e.__class__ is not int or e < 0 or e % self.page_size:
                self._check_aux(plan, prev, params)  # (raises: its checks, its message)
            swa_i, _, mamba_i = self._pair
            prepared: Any = [None, None]
            if prev and swa_i == 0:
                self.swa.check_insert(plan, prev, params, e)  # type: ignore[union-attr]
            prepared[mamba_i] = mamba_state(params.mamba_value)
            if prev and swa_i == 1:
                self.swa.check_insert(plan, prev, params, e)  # type: ignore[union-attr]
        elif self.components:
            prepared, e = self._check_aux(plan, prev, params)
        else:  # (no aux component: only the settings that would need one are checked)
            prepared, e = (), 0
            if params.swa_evicted_seqlen != 0 or params.mamba_value is not None:
                self._check_aux(plan, prev, params)
        if self.disable:  # (after the checks: a disabled cache refuses bad input as the spec does)
            return api.InsertResult(prefix_len=0)
        if self._events is not None or self.storage_tier is not None:
            check_token_range(units, self.is_eagle)  # page keys take [0, 2**32) (fast/token_range.py)

        # (``_stamp`` of the root, written out: it is locked, so never a leaf to push)
        root = self.root_node
        self._clock += STRIDE
        root.last_access_time = self._clock
        if n == 0:
            return api.InsertResult(prefix_len=0, total_len=len(toks),
                                    mamba_exist=bool(self.components))
        if self._pair_insert and prepared:
            # the rest (walk, new leaf, both commits) in C, the same steps (fast/_core.c
            # "cinsert"); None where it declines, nothing changed: the loop below runs
            mamba = self.mamba
            done = _core.pair_insert(self, self.swa, mamba, plan, value, units, ek, prev, e, n,
                                     len(toks), prepared[mamba.i], self.page_size)  # type: ignore[union-attr]
            if done is not None:
                return done
        node, pos = root, 0
        swa = self.swa
        swa_i = swa.i if swa is not None else -1
        # write-through counts hits on the nodes of an insert that is not chunked
        hits = tier is not None and not tier.write_back and not chunked
        threshold = tier.write_through_threshold if hits else 0  # type: ignore[union-attr]
        inline_touch = self._inline_touch
        comps = self.components
        heap = self._heap
        for child, shared in plan:
            if inline_touch:  # ``_touch`` (``_stamp``, ``_push_if_leaf``), written out
                clock = self._clock + STRIDE
                self._clock = clock
                child.last_access_time = clock
                if child.value is not None:
                    if child.lock_ref == 0 and child.aux_lock == 0 and child.dev_children == 0:
                        heapq.heappush(heap, (clock, child))  # (attached: a plan node)
                elif tier is not None:
                    tier.restamped(child)
                for comp, rec in zip(comps, child.aux, strict=True):
                    if rec.value is not None:
                        comp.lru.move_to_front(rec)
            else:
                self._touch(child)
            if shared < len(child.key):
                child = self._split(child, shared)
            end = pos + shared
            if child.value is None:  # evicted to the host: the fresh slots are its own again
                self._unevict(child, value, pos)
                if swa is not None:  # with its SWA data inside the window
                    swa.recover(child, pos, e)
                taken = 0
            # a locked SWA tombstone keeps its slots (another holder reads them; docs/SPEC.md)
            elif swa is not None and prev < end and child.aux[swa_i].value is None \
                    and child.lock_ref == 0:
                taken = swa.overlap(child, pos, shared, value, prev, e)
            else:
                taken = shared
            lo = prev if prev > pos else pos
            hi = pos + taken
            if lo < hi:  # this node's duplicates: one piece per node, as upstream frees them
                self._free(value[lo:hi])  # (a view; release() joins what it may)
            if hits:  # (``tier.count_hit``, written out: ``child`` holds device data here)
                child.hit_count += 1
                if child.host_value is None and child.hit_count >= threshold:
                    tier.write_backup(child)  # type: ignore[union-attr]
            if keyed:
                policies.walked(self, child, priority, chunked)
            node, pos = child, end
        target, is_new = node, False
        if pos < n:
            if self.components and any([comp.skips_leaf(pos, n, e) for comp in self.components]):
                self._free(value[pos:n])  # no leaf: the slots go back
                # the tree took no state either: a Mamba caller keeps (frees) its slot, as the
                # spec says (the seed leaks it here; docs/SPEC.md)
                return api.InsertResult(prefix_len=pos, mamba_exist=self._has_mamba)
            self._clock += STRIDE
            rest = units[pos:]
            ck = self._ck(ek, rest, 0)
            leaf = self._new_node(rest, _narrow_copy(value, 0, pos, n - pos), node, ek, self._clock, ck)
            if keyed:  # before the components' commit, whose split hands it to the upper part
                leaf.priority = priority
            node.children[ck] = leaf
            node.dev_children += 1
            self._evictable += n - pos
            if self.validate_slots:
                self._own(leaf.value)
            self._push_if_leaf(leaf)
            if self._events is not None:
                self._events.stored(leaf)
            target, is_new = leaf, True
        mamba_exist = False
        if self._pair is not None and prepared:
            # each stock plug-in's ``commit``, written out, in component order
            swa_c = self.swa
            for comp in comps:
                if comp is swa_c:  # SWA data inside the window; a tombstone split off before
                    if is_new and e - pos < len(target.key):
                        if e - pos > 0:
                            self._split(target, e - pos)
                        swa_c.set(target, swa_c.translate(target.value))
                else:  # the Mamba state, unless the node has one
                    rec = target.aux[comp.i]
                    if is_new or rec.value is None:
                        comp.set(target, prepared[comp.i])
                        if not is_new:
                            self._stamp(target)
                    else:
                        comp.lru.move_to_front(rec)
                        self._stamp(target)
                        mamba_exist = True
        elif prepared:
            result = {"mamba_exist": False}
            for comp, prep in zip(self.components, prepared, strict=True):
                comp.commit(target, is_new, pos, prep, e, result)
            mamba_exist = result["mamba_exist"]
        if is_new and tier is not None:
            # (``update_host_leaf(node)``: it has a child now, so it is no host leaf)
            tier.host_leaves.discard(node)
            if hits:  # (``count_hit`` of the new leaf, written out: it has no host copy)
                target.hit_count += 1
                if target.hit_count >= threshold:
                    tier.write_backup(target)
        if is_new and keyed:
            policies.new_leaf(self, target, priority, chunked)
        return api.InsertResult(pos, len(toks), mamba_exist)

    # ------------------------------------------------------------------------------------------
    # Locks
    # ------------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: HybridNode) -> api.IncLockRefResult:
        """Lock ``node``'s Full path up to the root (the evicted bottom segment is skipped and
        remembered: with a host tier ``anchor`` is the first node locked), then each component
        its own part (SWA: one window of SWA data above the node, tombstones skipped, marking
        where the window filled up; Mamba: the node's state).  Skipped nodes are remembered in
        the result (pass ``to_dec_params()`` back)."""
        fast = self._inc_lock_fast  # (a specialised path: fast/one_aux.py, host_full.py,
        if fast is not None:        # host_aux.py; None from it: the general path answers)
            done = fast(self, node)
            if done is not None:
                return done
        self._check_attached(node)
        tier = self.tier
        result = api.IncLockRefResult() if tier is None else HostIncLockRefResult()
        if self.disable:
            return result
        root = self.root_node
        delta = self._inc_lock_py(root, node, result)
        if tier is not None:
            anchor: Any = node
            while anchor is not root and anchor.value is None:
                anchor = anchor.parent
            result.anchor = anchor  # type: ignore[attr-defined]
        self._evictable -= delta
        self._protected += delta
        result.delta = delta
        for comp in self.components:
            comp.lock(node, result)
        return result

    def dec_lock_ref(self, node: HybridNode,
                     params: api.DecLockRefParams | None = None) -> api.DecLockRefResult:
        """Undo one ``inc_lock_ref`` of ``node`` (pass its result's ``to_dec_params()``).  With
        a host tier everything below the lock's anchor was skipped, which stays right when a
        skipped node is split or loaded back meanwhile.  While host transfers hold locks, an
        unlock that would take one of theirs is refused (``HostTier.check_caller_unlock``)."""
        tier = self.tier
        if tier is not None:
            k = len(tier.ongoing_write_through) + len(tier.ongoing_load_back)
            if k and not self.disable:  # (the check's O(1) exit first, without the call)
                anchor = getattr(params, "anchor", None)
                if anchor is None or getattr(anchor, "lock_ref", 0) <= k:
                    tier.check_caller_unlock(node, params)
        fast = self._dec_lock_fast  # (no host tier: fast/one_aux.py's, or the pair's in C;
        if fast is not None and (  # None from it: the general path answers)
                params is None or params.__class__ is api.DecLockRefParams):
            done = fast(self, node, params)
            if done is not None:
                self._upkeep()
                return done
        host = self._dec_lock_host  # (a host tier: fast/host_full.py, fast/host_aux.py)
        if host is not None:
            done = host(self, node, params)
            if done is not None:
                self._upkeep()
                return done
        anchor = getattr(params, "anchor", None) if params is not None else None
        if anchor is None:
            self._check_attached(node)
        if self.disable:
            return api.DecLockRefResult()
        if anchor is not None:
            delta, unlocked = self._dec_full_lock(anchor, ())
        else:
            skip = params.skip_lock_node_ids.get(FULL, ()) if params is not None else ()
            delta, unlocked = self._dec_full_lock(node, skip)
        for comp in self.components:
            comp.unlock(node, params, unlocked)
        for n in unlocked:
            self._push_if_leaf(n)
        self._upkeep()
        return api.DecLockRefResult(delta=delta)

    def inc_host_lock_ref(self, node: HybridNode) -> api.IncLockRefResult:
        """Protect ``node``'s host copies from host eviction (a node without one is left as
        it is; SWA: one window of SWA host copies above it).  Pass the result's
        ``to_dec_params()`` to ``dec_host_lock_ref`` to undo exactly this lock."""
        self._check_attached(node)
        if self.disable:
            return api.IncLockRefResult()
        return self._host_tier().host_lock(node)

    def dec_host_lock_ref(self, node: HybridNode, params: api.DecLockRefParams | None = None
                          ) -> api.DecLockRefResult:
        """Undo one ``inc_host_lock_ref`` of ``node`` (``params``: its result's
        ``to_dec_params()``; without them one host lock of the node's copies there)."""
        # a lock that held no Full host copy on the node itself (with SWA: only a window of host
        # copies above it) is undone even after the node left the tree, as the spec's handles
        # are: nothing kept the node there
        if not (isinstance(params, HostUnlockParams) and not params.full
                and isinstance(node, self._node_type)):
            self._check_attached(node)
        if not self.disable:
            self._host_tier().host_unlock(node, params)
            self._upkeep()
        return api.DecLockRefResult()

    # ------------------------------------------------------------------------------------------
    # Eviction: one driver, one batch of frees
    # ------------------------------------------------------------------------------------------

    def _drop_device(self, node: HybridNode, tracker: list, batch: FreeBatch) -> None:
        """A device leaf's device data goes: each component's first (a Mamba state onto
        ``batch.states``; SWA slots go back with the Full slots through the allocator's map),
        then its Full slots (a ``"free"`` run), counted in ``tracker``."""
        if self._pair is not None:  # the stock plug-ins' ``drop`` on a leaf, written out
            mamba = self.mamba
            for comp, rec in zip(self.components, node.aux, strict=True):
                value = rec.value
                if value is not None:
                    if comp is mamba:  # one state, onto the batch
                        k = 1
                        batch.states.append(value)
                    else:  # SWA: its slots go back with the Full slots, through the map
                        k = len(node.key)
                    tracker[comp.i + 1] += k
                    comp.evictable -= k
                    comp.lru.remove(rec)
                    rec.value = None
                    if rec.host_value is not None and rec.host_lock == 0:
                        comp.host_lru[rec] = None
        else:
            for comp in self.components:
                if node.aux[comp.i].value is not None:
                    comp.drop(node, tracker, batch, True)
        batch.add("free", node.value)
        k = len(node.key)
        tracker[0] += k
        self._evictable -= k

    def _delete_leaf(self, node: HybridNode, tracker: list, batch: FreeBatch) -> Any:
        """A device leaf leaves the tree with all its data (``_drop_device``).  Returns its
        former parent."""
        if self._events is not None:
            self._events.removed(node)
        self._drop_device(node, tracker, batch)
        parent = self._detach_leaf(node)
        if parent is not self.root_node and parent.dev_children == 0:
            self._push_if_leaf(parent)
        return parent

    # the eviction of one device leaf: ``_delete_leaf`` without a tier, ``HostTier.evict_leaf``
    # with one (False: passed over, nothing changed); set at construction
    _evict_leaf: Any

    def _cascade(self, node: HybridNode, trigger: AuxComponent, tracker: list,
                 batch: FreeBatch) -> None:
        """``trigger`` dropped its data from internal ``node``: the components of lower or
        equal priority there drop theirs too (the seed's cascade; a component that has the
        node locked keeps its data, where the seed would assert)."""
        for comp in self.components:
            if comp is not trigger and comp.internal_priority <= trigger.internal_priority:
                rec = node.aux[comp.i]
                if rec.value is not None and rec.lock == 0:
                    comp.drop(node, tracker, batch, False)

    def _release(self, batch: FreeBatch) -> None:
        """Hand back what one ``evict`` took in (``FreeBatch.release``: as few allocator calls
        as each allocator's semantics allow, fast/frees.py), then the slot bookkeeping."""
        mamba = self.mamba
        batch.release(self.token_to_kv_pool_allocator,
                      mamba.allocator if mamba is not None else None)
        if self.validate_slots:
            for method, pieces in batch.runs:
                if method == "free":
                    for p in pieces:
                        self._owned.difference_update(p.tolist())
            if mamba is not None:
                mamba.released(batch.states)

    def evict(self, params: api.EvictParams) -> api.EvictResult:
        """Full first: the oldest evictable device leaves, whole, until ``num_tokens`` Full
        units are freed (with a host tier a leaf goes to the host; under write-back one
        without a copy is backed up first, and passed over when that fails).  Then each
        component in order (``AuxComponent.drive``) until ``swa_num_tokens`` / ``mamba_num``
        of its units are freed (by any driver).  Write-back ends by waiting for every pending
        write.  The slots go back to the allocators at the end, as one ``FreeBatch``."""
        fast = self._evict_fast  # (no host tier: one component, fast/one_aux.py; the pair,
        if fast is not None:     # fast/pair_evict.py)
            result = fast(self, params)
            if result is not None:
                self._upkeep()  # (an aux eviction can push a new leaf without popping one)
                return result
        want = count_arg("num_tokens", params.num_tokens)
        swa_want, mamba_want = params.swa_num_tokens, params.mamba_num
        if swa_want.__class__ is not int or mamba_want.__class__ is not int \
                or swa_want < 0 or mamba_want < 0:
            count_arg("swa_num_tokens", swa_want)
            count_arg("mamba_num", mamba_want)
        if self.disable:
            return api.EvictResult()
        if not self.components:
            freed = self._evict_units(want)[0]
            self._upkeep()
            return api.EvictResult(freed)
        tracker = self._evict_units(want, {"swa": swa_want, "mamba": mamba_want})
        self._upkeep()
        swa, mamba = self.swa, self.mamba  # (the components named swa and mamba, if any)
        return api.EvictResult(num_tokens_evicted=tracker[0],
                               swa_num_tokens_evicted=0 if swa is None else tracker[swa.i + 1],
                               mamba_num_evicted=0 if mamba is None else tracker[mamba.i + 1])

    def _evict_units(self, want: int, wants: dict | None = None) -> list:
        """``evict``'s work; returns the units freed: Full, then each component's."""
        if wants is None and self._host_evict:  # (Full alone over the host tier: one C call,
            core = host_full._core               # the same steps, fast/_core.c host_evict)
            if core is not None:
                done = core.host_evict(self, want)
                if done is not None:
                    return done
        elif wants is not None and self._host_aux_evict:  # (one stock SWA or Mamba plug-in
            core = host_full._core  # over the host tier: fast/_core.c host_aux_evict)
            if core is not None:
                done = core.host_aux_evict(self, want, wants[self.components[0].name])
                if done is not None:
                    return done
        tracker = [0] * (1 + len(self.components))  # Full units, then each component's
        batch = FreeBatch()
        heap = self._heap
        evict_leaf = self._evict_leaf
        heappop = heapq.heappop
        key_of = self._policy_key  # None: entries keyed by the stamp (lru)
        # leaves whose write-back backup failed: not tried again in this call (their ids: the
        # lazy heap may hold a leaf more than once); made at the first such leaf
        passed_over: list | None = None
        passed_ids: set[int] | None = None
        try:
            while tracker[0] < want and heap:
                stamp, node = heappop(heap)
                # (the entry is live: its stamp or key is the node's and ``_is_leaf``, written
                # out; a leaf passed over in this call is not tried again)
                if (node.last_access_time != stamp if key_of is None else key_of(node) != stamp) \
                        or node.lock_ref or node.aux_lock or node.dev_children \
                        or node.value is None or node.parent is None \
                        or (passed_ids and id(node) in passed_ids):
                    continue
                if evict_leaf(node, tracker, batch) is False:
                    if passed_over is None:
                        passed_over, passed_ids = [], set()
                    passed_over.append(node)
                    passed_ids.add(id(node))  # type: ignore[union-attr]
            if wants:
                for comp in self.components:
                    comp.drive(wants[comp.name], tracker, batch)
            if passed_over is not None:
                for node in passed_over:
                    self._push_if_leaf(node)
            if self.tier is not None and self.tier.write_back:
                self.tier.writing_check(write_back=True)
        finally:
            self._release(batch)
        if self._leaf_heap.needs_compaction(self._evictable // self.page_size):
            self._leaf_heap.compact(self._is_leaf)
        return tracker

    # ------------------------------------------------------------------------------------------
    # The host tier (fast/tiers/host.py): upstream's HiCache methods
    # ------------------------------------------------------------------------------------------

    def _host_tier(self) -> HostTier:
        if self.tier is None:
            raise Unsupported("this cache has no host tier")
        return self.tier

    def _upkeep(self) -> None:
        """The end of a public call that can push onto a heap: the leaf heap, and the host
        tier's host-leaf heap, each compacted where it outgrew its cap (``LazyHeap.upkeep``):
        a node touched again and again with no eviction between does not pile up stale
        entries.  O(1), amortized O(1) a push.  Every ``evict`` ends with it too: Full's
        eviction pops a device heap entry for each one it pushes (the parent of a leaf it
        took), but an aux component's (an SWA window or a Mamba state dropped, a leaf deleted
        with them) can push a parent that became a leaf and pop nothing
        (tests/corpus/regressions/conform-full-swa-mamba-p1-s9001-*.jsonl), and with a host
        tier a leaf moved to the host is pushed onto the host heap."""
        heap = self._leaf_heap
        if len(heap.entries) > heap.cap:
            heap.compact(self._is_leaf)
        tier = self.tier
        if tier is not None:
            heap = tier.host_leaf_heap
            if len(heap.entries) > heap.cap:
                heap.compact(tier.host_leaves.__contains__)

    def write_backup(self, node: HybridNode, write_back: bool = False) -> int:
        """Back ``node`` up to the host (``HostTier.write_backup``); returns the slots
        written (0: none)."""
        written = self._host_tier().write_backup(node, write_back)
        self._upkeep()
        return written

    def evict_host(self, num_tokens: int, component_type: Any = None) -> int:
        """Free at least ``num_tokens`` host tokens, oldest host leaf first (each leaves the
        tree with its aux host data).  Returns tokens freed."""
        freed = self._host_tier().evict_host(num_tokens)
        self._upkeep()
        return freed

    def load_back(self, node: HybridNode, mem_quota: int | None = None, req: Any = None) -> bool:
        """Copy the evicted segment ending at ``node`` back to the device
        (``HostTier.load_back``); False when nothing is loaded.  Mamba: ``req`` is the
        requester, which gets a copy of the loaded state in its own slot
        (``req.mamba_pool_idx``: the one it holds, else a fresh one, the request's from then
        on whether or not the load went ahead, as upstream's); without a requester no slot is
        taken for one (upstream takes none either)."""
        tier = self._host_tier()
        mamba = self.mamba
        if mamba is None:
            loaded = tier.load_back(node, mem_quota)
            self._upkeep()
            return loaded
        own = self._request_slot_of(req) if req is not None else None
        # (set for every load back: HostTier.load_back is reached only from here)
        mamba.request_state, mamba.request_slot = own, None
        mamba.requester = req is not None
        loaded = tier.load_back(node, mem_quota)
        if mamba.request_slot is not None and req is not None:
            # the state slot the load back took for the requester: its ``mamba_pool_idx``,
            # which the scheduler frees with the request
            req.mamba_pool_idx = mamba.request_slot
        self._upkeep()
        return loaded

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, HybridNode]:
        """The scheduler's entry: load the host part of a match (``best_match_node``) and
        return the device slots now between the request's last device node and it, with the
        new last node; ``(empty, last device node)`` when nothing was loaded.  Without ``req``
        the last device node is the nearest ancestor of ``best_match_node`` not evicted."""
        self._host_tier()  # (refused without one)
        node = params.best_match_node
        self._check_attached(node)
        last: Any
        if params.req is not None:
            last = params.req.last_node
            self._check_attached(last)
        else:  # no request: the match's last device node, the nearest ancestor not evicted
            last = node
            while last.evicted:
                last = last.parent
        cur = node
        while cur is not None and cur is not last:
            cur = cur.parent
        if cur is None:
            raise InvalidInput("init_load_back: the request's last node is not on the path")
        if params.mem_quota is not None:
            count_arg("mem_quota", params.mem_quota)
        if self.mamba is not None:
            self._request_slot_of(params.req)  # (checked before anything changes)
            self.mamba.request_state = None
        # the seed's guard: only an evicted node is loaded back
        if node.evicted and self.load_back(node, params.mem_quota, params.req):
            chunks, cur = [], node
            while cur is not last:
                chunks.append(cur.value)
                cur = cur.parent
            if chunks:
                chunks.reverse()
                return torch.cat(chunks), node
        return self._empty, last

    def _request_slot_of(self, req: Any) -> int | None:  # (req None: none)
        """The requester's own Mamba state slot (``req.mamba_pool_idx``: a one-element tensor
        or an int), checked to be one the tree does not hold; None when it has none."""
        idx = getattr(req, "mamba_pool_idx", None)
        if idx is None:
            return None
        if isinstance(idx, torch.Tensor):
            if idx.numel() != 1 or idx.is_floating_point():
                raise InvalidInput(f"init_load_back: req.mamba_pool_idx must be one integer "
                                   f"slot, got a tensor of shape {tuple(idx.shape)}")
            slot = int(idx.reshape(-1)[0])
        elif isinstance(idx, int) and not isinstance(idx, bool):
            slot = idx
        else:
            raise InvalidInput(f"init_load_back: req.mamba_pool_idx must be null, an int or a "
                               f"one-element tensor, got {type(idx).__name__}")
        mamba = self.mamba
        assert mamba is not None  # (called only with a Mamba component)
        if self.validate_slots and slot in mamba.owned:
            raise InvalidInput(f"init_load_back: req.mamba_pool_idx {slot} is a state the "
                               "tree holds")
        return slot

    # (without a host tier, as upstream's cache without a controller: no-ops)
    def ready_to_load_host_cache(self) -> int:
        return self.tier.controller.start_loading() if self.tier is not None else 0

    def writing_check(self, write_back: bool = False) -> None:
        """Process finished backups, unlocking their nodes (``write_back``: wait for all)."""
        if self.tier is not None:
            self.tier.writing_check(write_back)
            self._upkeep()

    def loading_check(self) -> None:
        """Process finished loads, unlocking their paths."""
        if self.tier is not None:
            self.tier.loading_check()
            self._upkeep()

    def check_hicache_events(self) -> None:
        self.writing_check()
        self.loading_check()
        if self.storage_tier is not None:  # the storage tier's control queues
            self.storage_tier.drain()
            self._upkeep()

    def flush_write_through_acks(self) -> None:
        self.writing_check()

    def host_eviction_order(self) -> list[HybridNode]:
        """The host leaves in the order ``evict_host`` would take them."""
        return self._host_tier().eviction_order()

    # ------------------------------------------------------------------------------------------
    # Requests: fast/compat.py's shared path, with each component's hooks
    # ------------------------------------------------------------------------------------------

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """Cache a finished request's committed tokens (page-aligned) with its SWA window
        (``req.swa_evicted_seqlen``) and its Mamba state (``req.mamba_pool_idx``, given to the
        tree unless the node has one, then freed), release its lock; the rest of its
        committed slots go back (``compat.cache_finished_req``)."""
        compat.cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """Cache what a running request has computed so far; Mamba: a copy of its state in a
        fresh slot goes to the tree (freed again when the node has one); its row then points
        at the tree's slots up to the new match, which it locks instead of the old last node
        (``compat.cache_unfinished_req``)."""
        compat.cache_unfinished_req(self, req, chunked)

    def _prepare_caching_req(self, req: Any, params: api.InsertParams, finished: bool) -> None:
        for comp in self.components:
            comp.prepare_caching_req(req, params, finished)

    def _cleanup_caching_req(self, req: Any, finished: bool, result: api.InsertResult | None,
                             params: api.InsertParams | None) -> None:
        for comp in self.components:
            comp.cleanup_caching_req(req, finished, result, params)

    def init_hicache(self, server_args: Any, params: Any) -> None:
        """Attach a host tier after construction, as SGLang's cache registry does (the
        components of ``params`` stay): ``UnifiedRadixCache.init_hicache``.  Refused when this
        cache has one already."""
        if self.tier is not None:
            raise Unsupported("init_hicache: this cache already has a host tier")
        check_host_components(_components_of(params))
        super().init_hicache(server_args, params)

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------

    def _root_violations(self, errors: list) -> None:
        root = self.root_node
        if any(r.value is not None or r.lock for r in root.aux) or root.aux_lock:
            errors.append("[aux] the root holds aux data or an aux lock")
        if root.host_value is not None or root.host_lock_ref:
            errors.append("[host] the root holds host data or a host lock")

    def _node_violations(self, node: HybridNode, errors: list, acc: dict) -> None:
        """The Full checks (the tier's with a host tier, else
        ``UnifiedRadixCache._node_violations``), then each component's record
        (``AuxComponent.violations``, recounted into ``acc["aux"]``)."""
        if self.tier is not None:
            self.tier.node_violations(node, errors, acc)
            host_accs = acc.setdefault("aux_host", [{"host_values": [], "host_members": set()}
                                                    for _ in self.components])
            for comp, comp_acc in zip(self.components, host_accs, strict=True):
                comp.host_violations(node, errors, comp_acc)
        else:
            super()._node_violations(node, errors, acc)
        if node.value is None or not self.components:
            return
        if node.aux_lock != sum(r.lock for r in node.aux):
            errors.append(f"[lock] {node!r}: aux_lock is not the sum of the aux locks")
        accs = acc.setdefault("aux", [{"ev": 0, "pr": 0, "members": set(), "values": []}
                                      for _ in self.components])
        for comp, comp_acc in zip(self.components, accs, strict=True):
            comp.violations(node, errors, comp_acc)

    def _total_violations(self, acc: dict, errors: list) -> None:
        accs = acc.get("aux") or [{"ev": 0, "pr": 0, "members": set(), "values": []}
                                  for _ in self.components]
        for comp, comp_acc in zip(self.components, accs, strict=True):
            comp.tree_violations(comp_acc, errors)
        if self.tier is not None:
            self.tier.total_violations(acc, errors)
            if self.storage_tier is not None:
                self.storage_tier.violations(errors)
            host_accs = acc.get("aux_host") or [{"host_values": [], "host_members": set()}
                                                for _ in self.components]
            for comp, comp_acc in zip(self.components, host_accs, strict=True):
                comp.host_tree_violations(comp_acc, errors)
