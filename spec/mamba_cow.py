"""Mamba copy-on-write: a match made for a request copies the matched node's state into the
request's own state slot (0.5.13.post1 ``MambaComponent.finalize_match_result`` with
``MatchPrefixParams.cow_mamba``, which the seed's ``match_prefix`` calls).

The match itself is the ordinary one (spec/cache.py ``match_prefix``).  Then, when the best
match node holds a Mamba state, that state is the request's copy source, and the request needs
a state slot of its own: the one it already has, else a fresh one from the Mamba pool.  When
the pool is empty, the matched node is locked for a moment (so the state about to be copied
cannot go), one state is evicted (``evict`` with ``mamba_num`` 1, which may take a whole device
leaf), the lock is released, and the slot is taken.

Where 0.5.13.post1 asserts (no state could be evicted: every state is locked), the spec answers
with no slot (``dst`` None) and leaves the request to the caller (a scheduler would retract
it).  The request's slot, when it has one, must be an allocated state slot the tree does not
hold (``InvalidInput`` otherwise, nothing changed); ``cow_mamba`` needs the Mamba component.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from . import cache as rules
from . import components
from .core import CacheState, MatchOutcome, Node, all_nodes
from .errors import InvalidInput
from .world import PagedPool


@dataclasses.dataclass(frozen=True)
class CowOutcome:
    match: MatchOutcome
    src: int | None  # the state slot to copy from: the best match node's; None: no state
    dst: int | None  # the request's own state slot; None: none could be had


def mamba_pool(state: CacheState) -> PagedPool:
    """The Mamba state pool; a state without the Mamba component has none."""
    if state.mamba is None:
        raise InvalidInput("match_prefix: cow_mamba needs the Mamba component")
    return state.mamba


def check_request_slot(state: CacheState, slot: object) -> int | None:
    """The request's current state slot (None: it has none) must be the request's own."""
    if slot is None:
        return None
    if isinstance(slot, bool) or not isinstance(slot, int):
        raise InvalidInput(f"match_prefix: mamba_slot must be null or an int, got {slot!r}")
    if not mamba_pool(state).is_allocated(slot):
        raise InvalidInput(f"match_prefix: mamba_slot {slot} is not allocated")
    if any(components.has(n, "mamba") and n.aux["mamba"].value[0] == slot
           for n in all_nodes(state)):
        raise InvalidInput(f"match_prefix: mamba_slot {slot} is the tree's")
    return slot


def match_prefix_cow(state: CacheState, tokens: Sequence[int], extra_key: str | None,
                     request_slot: int | None = None) -> CowOutcome:
    """``match_prefix`` for a request with ``cow_mamba``: the match, its copy source and the
    request's state slot."""
    if "mamba" not in state.config.components:
        raise InvalidInput("match_prefix: cow_mamba needs the Mamba component")
    slot = check_request_slot(state, request_slot)
    m = rules.match_prefix(state, tokens, extra_key)
    best = m.best_match_node
    if best.is_root or not components.has(best, "mamba"):
        return CowOutcome(m, None, slot)
    src = best.aux["mamba"].value[0]
    if slot is None:
        slot = take_state_slot(state, best)
    return CowOutcome(m, src, slot)


def take_state_slot(state: CacheState, keep: Node) -> int | None:
    """A fresh Mamba state slot, evicting one state (never ``keep``'s) when the pool is empty;
    None when nothing could be evicted."""
    pool = mamba_pool(state)
    if pool.available_size() == 0:
        handle = rules.inc_lock_ref(state, keep)
        components.evict(state, 0, mamba_num=1)
        rules.dec_lock_ref(state, handle)
    if pool.available_size() == 0:
        return None
    return pool.alloc(1)[0]
