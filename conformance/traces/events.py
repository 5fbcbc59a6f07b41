"""KV events in the conformance harness: who emits them, how a step's events are compared, and
the router's invariant as a check.

An adapter *emits events* when :func:`event_source` finds a source for it:

* the spec (an adapter, or a wrapper's ``inner`` chain, holding a spec ``CacheState`` as
  ``state``): :class:`SpecEvents`, the stream of :mod:`uniradix.spec.events` (derived from the
  cached pages per medium after every step);
* an adapter with ``take_events()`` and a true ``emits_kv_events`` (the upstream adapters of
  the Full component drive sglang's own KV-event mixin):
  :class:`TakenEvents`. Such an adapter declares ``event_key_mode`` (``"compat"`` for
  0.5.13.post1, whose block hashes leave ``extra_key`` out) and the documented differences of
  its stream (``event_differences``, :data:`DIFFERENCES`), and the spec renders its stream the
  same way when it is compared with it;
  An adapter that can render either key mode (the fast path) declares no ``event_key_mode``
  and has ``start_kv_events(key_mode)``: :class:`TakenEvents` calls it, before any step, with
  the mode asked for (a trace's, or a peer's; None: the config's ``storage_key_mode``), and
  the adapter then emits in that mode;
* anything else does not emit: :func:`event_source` returns None and the
  callers say so (``replay`` and ``lockstep`` never skip a comparison silently).

Events travel as the wire's arrays (docs/EVENTS.md, JSON in traces). A step's events are
compared as a multiset (:func:`uniradix.spec.events.canonical`) after leaving out the pages a
step both stored and removed on one medium (:func:`net_events`): the order of the events of one
step, and a page that comes and goes within it, are an implementation's choice that a router's
fold does not see.
"""

from __future__ import annotations

from typing import Any, Protocol

from uniradix.conformance.traces.trace import EVENT_DIFFERENCES
from uniradix.fast.event_fold import RouterView
from uniradix.spec.events import CPU_PINNED, MEDIA, BlockStored, EventEmitter, canonical, from_wire, to_wire
from uniradix.spec.state import CacheState

__all__ = ["EventSource", "SpecEvents", "TakenEvents", "event_source", "spec_state",
           "event_key_mode", "event_differences", "DIFFERENCES", "RouterCheck", "events_differ",
           "net_events"]


class EventSource(Protocol):
    key_mode: str

    def after_step(self, step: dict, obs: dict) -> list[list]: ...


def _chain(adapter: Any):
    seen = 0
    while adapter is not None and seen < 8:
        yield adapter
        adapter, seen = getattr(adapter, "inner", None), seen + 1


def spec_state(adapter: Any) -> CacheState | None:
    """The spec state behind ``adapter`` (or a wrapper of it), or None."""
    for a in _chain(adapter):
        state = a.__dict__.get("state") if hasattr(a, "__dict__") else None
        if isinstance(state, CacheState):
            return state
    return None


#: The documented ways an implementation's stream differs from the spec's, by name; the spec
#: renders its stream with the differences of the peer it is compared with (docs/SPEC.md,
#: "KV events").  ``prefetch-inserts-unannounced``: no ``CPU_PINNED`` store for the host pages
#: a storage prefetch inserts (``check_prefetch_progress``).
DIFFERENCES = EVENT_DIFFERENCES


def event_differences(adapter: Any) -> tuple[str, ...]:
    """The documented stream differences an adapter declares (``event_differences``)."""
    for a in _chain(adapter):
        diffs = getattr(type(a), "event_differences", None)
        if diffs is not None:
            return tuple(diffs)
    return ()


def check_differences(diffs: Any) -> tuple[str, ...]:
    if not isinstance(diffs, (list, tuple)) or any(d not in DIFFERENCES for d in diffs):
        raise ValueError(f"event differences must be a list of {list(DIFFERENCES)}, got {diffs!r}")
    return tuple(diffs)


def event_key_mode(adapter: Any) -> str | None:
    """The key mode an emitting non-spec adapter hashes pages in (``event_key_mode``), or None."""
    for a in _chain(adapter):
        mode = getattr(type(a), "event_key_mode", None)
        if isinstance(mode, str):
            return mode
    return None


class SpecEvents:
    """The spec's stream for the spec cache behind ``adapter`` (its hashes in ``key_mode``,
    default the config's ``storage_key_mode``). ``after_step`` must see every step."""

    def __init__(self, adapter: Any, key_mode: str | None = None,
                 differences: tuple[str, ...] = ()) -> None:
        self.adapter = adapter
        state = spec_state(adapter)
        if state is None:
            raise TypeError("SpecEvents needs an adapter holding a spec CacheState")
        self.emitter = EventEmitter(state, key_mode)
        self.key_mode = self.emitter.key_mode
        self.differences = check_differences(differences)

    def after_step(self, step: dict, obs: dict) -> list[list]:
        state = spec_state(self.adapter)
        assert state is not None
        cleared = step.get("op") == "reset" and "error" not in obs
        events = self.emitter.step(state, cleared)
        if "prefetch-inserts-unannounced" in self.differences \
                and step.get("op") == "check_prefetch_progress":
            events = [e for e in events
                      if not (isinstance(e, BlockStored) and e.medium == CPU_PINNED)]
        return [to_wire(e) for e in events]

    def hashes(self) -> dict[str, frozenset[int]]:
        return self.emitter.hashes()


class TakenEvents:
    """The events an adapter's ``take_events()`` hands over after each step."""

    def __init__(self, adapter: Any, key_mode: str | None = None) -> None:
        self.adapter = adapter
        start = next((a.start_kv_events for a in _chain(adapter)
                      if callable(getattr(a, "start_kv_events", None))), None)
        if start is not None:  # the adapter renders the mode asked for
            self.key_mode = start(key_mode)
        else:
            self.key_mode = event_key_mode(adapter) or "namespaced"
        self._take = next(a for a in _chain(adapter) if callable(getattr(a, "take_events", None))).take_events
        self._take()  # anything emitted while the adapter was built belongs to no step

    def after_step(self, step: dict, obs: dict) -> list[list]:
        return [to_wire(e) for e in self._take()]


def event_source(adapter: Any, key_mode: str | None = None,
                 differences: tuple[str, ...] = ()) -> EventSource | None:
    """The adapter's event stream, or None when it does not emit events. ``key_mode`` renders
    the spec's hashes (a trace's ``event_key_mode``, or the peer's in a lockstep);
    ``differences`` (:data:`DIFFERENCES`) renders the spec's stream as that peer's."""
    for a in _chain(adapter):
        declared = getattr(a, "emits_kv_events", None)
        if declared is False:  # a declared capability: this implementation emits none
            return None
        if declared and callable(getattr(a, "take_events", None)):
            return TakenEvents(adapter, key_mode)
    if spec_state(adapter) is not None:
        return SpecEvents(adapter, key_mode, differences)
    return None


def net_events(events: list) -> list:
    """A step's events without its transient pages: a one-page ``BlockStored`` and a one-page
    ``BlockRemoved`` of the same hash on the same medium within the step, in either order,
    cancel out (a router's fold ends the step the same).  0.5.13.post1 makes such pairs, e.g. a
    write-back eviction that backs a leaf up to the host and then evicts that copy from the host
    in the same step; the spec's stream, a difference of states, never has them."""
    out: list = []
    for e in events:
        w = e if isinstance(e, list) else to_wire(e)
        if w[0] in ("BlockStored", "BlockRemoved") and len(w[1]) == 1:
            other = "BlockRemoved" if w[0] == "BlockStored" else "BlockStored"
            medium = w[-1] or "GPU"
            k = next((j for j, x in enumerate(out) if x[0] == other and x[1] == w[1]
                      and (x[-1] or "GPU") == medium), None)
            if k is not None:
                del out[k]
                continue
        out.append(w)
    return out


def events_differ(expected: list, actual: list) -> tuple[list, list] | None:
    """None when two steps' events are equal as multisets once each side's transient pages are
    left out (:func:`net_events`); else what only each side has."""
    a, b = canonical(net_events(expected)), canonical(net_events(actual))
    if a == b:
        return None
    only_a, only_b = list(a), list(b)
    for x in b:
        if x in only_a:
            only_a.remove(x)
            only_b.remove(x)
    return only_a, only_b


class RouterCheck:
    """The router's invariant as a check: fold every step's events (wire arrays) into a
    :class:`RouterView` and compare its blocks per medium with the pages the cache holds."""

    def __init__(self) -> None:
        self.view = RouterView()
        self.seq = 0

    def fold(self, events: list) -> list[str]:
        """Apply one step's events; the anomalies they caused, as messages."""
        before = len(self.view.anomalies)
        self.view.apply_batch(self.seq, [from_wire(e) for e in events])
        self.seq += 1
        return [f"{a.kind} medium {a.medium} hash {a.block_hash} {a.detail}".strip()
                for a in self.view.anomalies[before:]]

    def compare(self, cached: dict[str, frozenset[int]]) -> list[str]:
        """Where the fold disagrees with ``cached`` (block hashes per medium), as messages."""
        out = []
        for m in MEDIA:
            have, want = self.view.cached(m), cached.get(m, frozenset())
            if have != want:
                out.append(f"router view of {m}: {len(want - have)} cached block(s) missing "
                           f"{sorted(want - have)[:4]}, {len(have - want)} not cached "
                           f"{sorted(have - want)[:4]}")
        return out
