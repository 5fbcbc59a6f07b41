"""Bench peers on sglang releases whose match result no longer carries the matched slots.

The bench loop (:mod:`uniradix.conformance.bench.loop`) reads a match the way 0.5.13.post1
returns it: ``m.device_indices`` (the matched device slots, one tensor) and
``m.last_device_node`` (what the request locks).  Later releases (0.5.23 is the one measured)
changed that boundary: ``MatchResult`` reports ``device_prefix_len`` and integer node handles,
and the slots are collected separately from the tree, by ``path_device_indices(node_id)``
(what ``prefix_device_indices(req)`` does for a scheduler's request).  The other four calls the
loop makes are the same there: ``inc_lock_ref(node)`` returns a receipt with
``to_dec_params()``, ``dec_lock_ref(node, params)``, ``insert(InsertParams)`` frees the
duplicates of ``value[prev_prefix_len:prefix_len]`` itself and returns ``prefix_len``, and
``evict(EvictParams)`` returns ``num_tokens_evicted`` (it frees through the allocator's
``free_segment``).

:class:`SlotsFromPath` is the whole adaptation: its ``match_prefix`` is the release's
``match_prefix`` followed by ``path_device_indices`` of the match's last device node, both
inside the one timed call (a scheduler needs the slots before it can use a match, and every
other implementation's match returns them), checked to hold exactly ``device_prefix_len``
slots.  The four other calls are the cache's own bound methods, not wrapped.  A cache is
wrapped only after its tree core was checked to be the one its peer name pins
(:func:`adapter_for`), at every build, not only on a probe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from uniradix.conformance.bench.loop import ImplMissing, tree_core_in_use

# how the matched slots are read on such a release, for the docs and the version string
SLOTS_RULE = "slots read by path_device_indices(last_device_node) inside the timed match"


class SlotMatch(NamedTuple):
    """A newer release's match, in the fields the bench loop reads."""

    device_indices: Any  # the matched device slots, collected from the path to the node
    last_device_node: Any  # the node handle (an int on these releases) the request locks
    result: Any  # the release's own ``MatchResult``


class MatchReadError(RuntimeError):
    """The slots on the path to a match's last device node are not ``device_prefix_len``."""


class SlotsFromPath:
    """An upstream ``UnifiedRadixCache`` of a newer release behind the bench loop's five calls
    (see the module docstring).  ``cache`` stays reachable for checks; ``tree_core`` is the
    cache's own, so :func:`~uniradix.conformance.bench.loop.tree_core_in_use` reads this object
    as it reads the cache.  Cost per match: one Python call around the release's two calls and
    one length check."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.tree_core = cache.tree_core
        self._match = cache.match_prefix
        self._path = cache.path_device_indices
        self.inc_lock_ref = cache.inc_lock_ref
        self.dec_lock_ref = cache.dec_lock_ref
        self.insert = cache.insert
        self.evict = cache.evict

    def match_prefix(self, params: Any) -> SlotMatch:
        result = self._match(params)
        node = result.last_device_node
        slots = self._path(node)
        if slots.shape[0] != result.device_prefix_len:
            raise MatchReadError(
                f"the path to node {node!r} holds {slots.shape[0]} device slots, the match "
                f"reported device_prefix_len={result.device_prefix_len}")
        return SlotMatch(slots, node, result)


def slots_on_nodes(match_result_type: Any, cache_type: Any) -> bool:
    """Whether a release keeps the matched slots on the nodes: its ``MatchResult`` has no
    ``device_indices`` field and its cache has ``path_device_indices``."""
    fields = getattr(match_result_type, "_fields", None) or ()
    return "device_indices" not in fields and hasattr(cache_type, "path_device_indices")


def adapter_for(name: str, want: str, up: Any) -> tuple[Callable[[Any], Any], str]:
    """What ``upstream_bundle`` applies to each cache it builds for the peer ``name``, pinned to
    the tree core ``want`` (``python`` or ``rust``), on the sglang that ``up`` (the namespace of
    :func:`~uniradix.conformance.adapters.upstream.load_upstream`) names, and the note its
    version string carries: on a release with the slots on the nodes, a check that the built
    cache runs on ``want`` (:class:`ImplMissing` if sglang fell back to another core) and
    :class:`SlotsFromPath` around it, noted ``"; " + SLOTS_RULE``; on an older release the
    cache unchanged (the loop reads its match as it is) and no note."""
    if not slots_on_nodes(getattr(up, "MatchResult", None), up.UnifiedRadixCache):
        return _unchanged, ""

    def adapt(cache: Any) -> SlotsFromPath:
        got = tree_core_in_use(cache)
        if got != want:
            raise ImplMissing(f"{name}: asked sglang {up.version} for its {want} tree core and it "
                              f"built the {got} one")
        return SlotsFromPath(cache)

    return adapt, "; " + SLOTS_RULE


def _unchanged(cache: Any) -> Any:
    return cache
