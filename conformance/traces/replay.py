"""Replay traces on an implementation and check every recorded ``ret`` field.

After each step the observation must hold the recorded value of every field the step's ``ret``
has (and only those are checked); a step recorded as rejected (``{"error": "T"}``) must be
rejected with the same exception type and leave the canonical snapshot unchanged; a step
recorded as accepted must not be rejected; and the implementation's own invariants must hold.
A step that carries ``events`` (KV events, docs/TRACE.md) must produce the same events, as a
multiset, when the implementation emits events; otherwise the summary says on how many steps
they were not compared.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

from uniradix.conformance.adapters.base import make_adapter
from uniradix.conformance.traces.events import event_source, events_differ
from uniradix.conformance.traces.trace import Trace, load_trace
from uniradix.spec.errors import CacheError

MISSING = object()


@dataclasses.dataclass
class Divergence:
    trace: str
    step: int
    op: str
    field: str
    expected: Any
    actual: Any

    def __str__(self) -> str:
        return (f"DIVERGENCE {self.trace} step {self.step} ({self.op}): field {self.field!r}: "
                f"expected {short(self.expected)}, actual {short(self.actual)}")


@dataclasses.dataclass
class ReplayResult:
    trace: str
    steps: int
    divergence: Divergence | None = None
    unsupported: str | None = None
    events_compared: int = 0       # steps whose recorded KV events were compared
    events_not_compared: int = 0   # steps with recorded events the implementation cannot emit


def short(x: Any, limit: int = 300) -> str:
    s = "<missing>" if x is MISSING else json.dumps(x, default=str)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


def compare(expected_ret: dict, obs: dict) -> tuple[str, Any, Any] | None:
    """The first field where ``obs`` disagrees with the recorded ``ret``, or None."""
    if "error" in expected_ret:
        if obs.get("error") != expected_ret["error"]:
            return ("error", expected_ret["error"], obs.get("error", MISSING))
        return None
    if "error" in obs:
        return ("error", None, f"{obs['error']}: {obs.get('message', '')}")
    for field, want in expected_ret.items():
        got = obs.get(field, MISSING)
        if got != want:
            return (field, want, got)
    return None


def replay_trace(trace: Trace, impl: str, check_invariants: bool = True,
                 on_step: Callable[[int], None] | None = None,
                 check_kv: bool = False) -> ReplayResult:
    """Replay one trace; stop at its first divergence.  ``check_kv``: keep a fingerprinted KV
    pool and check every slot the cache hands out (conformance/env/kvcheck.py); its findings come
    with the invariants."""
    try:
        adapter = make_adapter(impl, trace.config)
        if check_kv:
            from uniradix.conformance.env.kvcheck import KVChecked
            adapter = KVChecked(adapter, trace.config)
    except CacheError as e:
        if type(e).__name__ == "Unsupported":
            return ReplayResult(trace.name, 0, unsupported=str(e))
        raise
    # KV events (conformance/traces/events.py): compared on the steps that carry them, when the
    # implementation emits them (the spec renders its hashes in the trace's event_key_mode)
    with_events = any("events" in s for s in trace.steps)
    source = event_source(adapter, trace.header.get("event_key_mode"),
                          tuple(trace.header.get("event_differences", ()))) if with_events else None
    compared = not_compared = 0
    done = 0
    for idx, step in enumerate(trace.steps):
        i = step.get("i", idx)
        op = step["op"]
        expected = step.get("ret")
        before = adapter.snapshot() if expected is not None and "error" in expected else None
        try:
            obs = adapter.apply(step)
        except Exception as e:  # noqa: BLE001 - an untyped failure is a finding, not a crash
            return ReplayResult(trace.name, done + 1, Divergence(
                trace.name, i, op, "crash", None, f"{type(e).__name__}: {e}"),
                events_compared=compared, events_not_compared=not_compared)
        done += 1
        if on_step is not None:
            on_step(done)
        diff = compare(expected if expected is not None else {}, obs)
        if source is not None:
            actual = source.after_step(step, obs)
            if diff is None and "events" in step:
                compared += 1
                ev_diff = events_differ(step["events"], actual)
                if ev_diff is not None:
                    diff = ("events (only recorded / only replayed)", ev_diff[0], ev_diff[1])
        elif "events" in step:
            not_compared += 1
        if diff is not None:
            return ReplayResult(trace.name, done, Divergence(trace.name, i, op, *diff),
                                events_compared=compared, events_not_compared=not_compared)
        if before is not None:
            after = adapter.snapshot()
            if after != before:
                return ReplayResult(trace.name, done, Divergence(
                    trace.name, i, op, "state unchanged after rejected op", before, after),
                    events_compared=compared, events_not_compared=not_compared)
        if check_invariants:
            bad = adapter.violations()
            if bad:
                return ReplayResult(trace.name, done, Divergence(
                    trace.name, i, op, "invariants", [], bad),
                    events_compared=compared, events_not_compared=not_compared)
    return ReplayResult(trace.name, done, events_compared=compared,
                        events_not_compared=not_compared)


def replay_paths(paths: Iterable[str], impl: str, *, keep_going: bool = False,
                 skip_unsupported: bool = False, check_invariants: bool = True,
                 out: Callable[[str], None] = print, verbose: bool = False,
                 check_kv: bool = False) -> int:
    """Replay files; print divergences and the summary line; return the exit status."""
    steps = traces = divergences = failures = 0
    ev_compared = ev_not_compared = 0
    for path in paths:
        trace = load_trace(path)
        result = replay_trace(trace, impl, check_invariants, check_kv=check_kv)
        traces += 1
        steps += result.steps
        ev_compared += result.events_compared
        ev_not_compared += result.events_not_compared
        if result.unsupported is not None:
            out(f"UNSUPPORTED {trace.name}: {result.unsupported}")
            if not skip_unsupported:
                failures += 1
                if not keep_going:
                    break
            continue
        if result.divergence is not None:
            divergences += 1
            out(str(result.divergence))
            if not keep_going:
                break
        elif verbose:
            out(f"ok {trace.name}: {result.steps} steps")
    if ev_compared:
        out(f"KV events compared on {ev_compared} steps")
    if ev_not_compared:
        out(f"KV events NOT compared on {ev_not_compared} steps: {impl} does not emit KV events")
    out(f"replayed {steps} steps in {traces} traces: {divergences} divergences")
    return 1 if divergences or failures else 0


# ----------------------------------------------------------------------------------------------
# Where the spec departs from the recorded upstream traces on purpose
# ----------------------------------------------------------------------------------------------

# docs/SPEC.md, "An SWA insert over a tombstone another holder has locked" (issue 18): in these
# golden traces 0.5.13.post1 freed the full slots of an SWA tombstone a lock held, at an insert;
# the spec and fast keep them and free the caller's duplicates, so the replay diverges at that
# step (the first one; what follows is not compared).  Trace path under tests/corpus -> step.
KNOWN_DIVERGENCES: dict[str, int] = {
    "upstream-policies/swa-w8-p1-fifo-s001.jsonl": 165,
    "upstream-policies/swa-w8-p1-fifo-s003.jsonl": 110,
    "upstream-policies/swa-w8-p1-filo-s001.jsonl": 165,
    "upstream-policies/swa-w8-p1-filo-s003.jsonl": 110,
    "upstream-policies/swa-w8-p1-lfu-s003.jsonl": 110,
    "upstream-policies/swa-w8-p1-lfu-s004.jsonl": 286,
    "upstream-policies/swa-w8-p1-mru-s003.jsonl": 110,
    "upstream-policies/swa-w8-p1-priority-s001.jsonl": 244,
    "upstream-policies/swa-w8-p1-priority-s003.jsonl": 110,
    "upstream-policies/swa-w8-p1-slru-s003.jsonl": 110,
    "upstream-policies/swa-w8-p1-slru-s004.jsonl": 286,
    "upstream-swa/swa-w32-p1-s011.jsonl": 347,
    "upstream-swa/swa-w8-p1-s001.jsonl": 373,
    "upstream-swa/swa-w8-p1-s006.jsonl": 91,
    "upstream-swa/swa-w8-p1-s009.jsonl": 325,
    "upstream-swa/swa-w8-p1-s012.jsonl": 71,
    "upstream-swa/swa-w8-p4-s001.jsonl": 254,
    "upstream-swa/swa-w8-p4-s003.jsonl": 345,
    "upstream-swa/swa-w8-p4-s012.jsonl": 372,
    "upstream-swa/swa-w8-p4-s017.jsonl": 242,
    # the host tier with SWA: there the lock is often a write-through backup's, whose copy
    # reads the tombstone's full slots while upstream hands them out again
    "upstream-host-swa/host-swa-wb-p1-s002.jsonl": 169,
    "upstream-host-swa/host-swa-wb-p1-s003.jsonl": 264,
    "upstream-host-swa/host-swa-wb-p1-s014.jsonl": 224,
    "upstream-host-swa/host-swa-wb-p1-s015.jsonl": 270,
    "upstream-host-swa/host-swa-wb-p1-s017.jsonl": 231,
    "upstream-host-swa/host-swa-wb-p1-s022.jsonl": 95,
    "upstream-host-swa/host-swa-wb-p1-s024.jsonl": 156,
    "upstream-host-swa/host-swa-wb-p4-s011.jsonl": 288,
    "upstream-host-swa/host-swa-wb-p4-s015.jsonl": 177,
    "upstream-host-swa/host-swa-wb-p4-s024.jsonl": 176,
    "upstream-host-swa/host-swa-wt-p1-s002.jsonl": 154,
    "upstream-host-swa/host-swa-wt-p1-s003.jsonl": 106,
    "upstream-host-swa/host-swa-wt-p1-s005.jsonl": 264,
    "upstream-host-swa/host-swa-wt-p1-s007.jsonl": 202,
    "upstream-host-swa/host-swa-wt-p1-s008.jsonl": 65,
    "upstream-host-swa/host-swa-wt-p1-s009.jsonl": 177,
    "upstream-host-swa/host-swa-wt-p1-s010.jsonl": 127,
    "upstream-host-swa/host-swa-wt-p1-s011.jsonl": 215,
    "upstream-host-swa/host-swa-wt-p1-s012.jsonl": 79,
    "upstream-host-swa/host-swa-wt-p1-s013.jsonl": 131,
    "upstream-host-swa/host-swa-wt-p1-s014.jsonl": 227,
    "upstream-host-swa/host-swa-wt-p1-s015.jsonl": 122,
    "upstream-host-swa/host-swa-wt-p1-s016.jsonl": 67,
    "upstream-host-swa/host-swa-wt-p1-s017.jsonl": 177,
    "upstream-host-swa/host-swa-wt-p1-s018.jsonl": 269,
    "upstream-host-swa/host-swa-wt-p1-s019.jsonl": 176,
    "upstream-host-swa/host-swa-wt-p4-s002.jsonl": 189,
    "upstream-host-swa/host-swa-wt-p4-s003.jsonl": 135,
    "upstream-host-swa/host-swa-wt-p4-s004.jsonl": 132,
    "upstream-host-swa/host-swa-wt-p4-s007.jsonl": 274,
    "upstream-host-swa/host-swa-wt-p4-s008.jsonl": 291,
    "upstream-host-swa/host-swa-wt-p4-s013.jsonl": 228,
    "upstream-host-swa/host-swa-wt-p4-s015.jsonl": 162,
    "upstream-host-swa/host-swa-wt-p4-s016.jsonl": 278,
    "upstream-host-swa/host-swa-wt-p4-s017.jsonl": 157,
}


def expected_divergence(path: str) -> int | None:
    """The step where a corpus trace is known to diverge (:data:`KNOWN_DIVERGENCES`), or None."""
    parts = os.path.normpath(path).split(os.sep)
    for k in range(len(parts) - 1):
        if parts[k] == "corpus":
            return KNOWN_DIVERGENCES.get("/".join(parts[k + 1:]))
    return None


def _spec_adapter_before(trace: Trace, step_i: int,
                         after_each: Callable[[Any, int, dict], None] | None = None
                         ) -> tuple[Any, dict] | None:
    """A spec adapter that applied the steps of ``trace`` before step ``step_i``, and that
    step, or None when the trace has no such step.  ``after_each(adapter, i, step)`` runs after
    each step applied."""
    from uniradix.conformance.adapters.base import SpecAdapter
    adapter = SpecAdapter(trace.config)
    for idx, step in enumerate(trace.steps):
        i = step.get("i", idx)
        if i == step_i:
            return adapter, step
        adapter.apply(step)
        if after_each is not None:
            after_each(adapter, i, step)
    return None


def _spec_state_before(trace: Trace, step_i: int) -> tuple[Any, dict] | None:
    """The spec's state just before step ``step_i`` of ``trace`` and that step, or None when
    the trace has no such step."""
    found = _spec_adapter_before(trace, step_i)
    return None if found is None else (found[0].state, found[1])


def _spec_state_after(trace: Trace, step_i: int) -> Any:
    """The spec's state just after step ``step_i`` of ``trace``, or None without that step."""
    found = _spec_adapter_before(trace, step_i)
    if found is None:
        return None
    adapter, step = found
    adapter.apply(step)
    return adapter.state


def _spec_node(state: Any, ref: Any) -> Any:
    """The spec's node at path ``ref`` (``{"tokens", "extra_key"}``) in ``state``, or None."""
    from uniradix.spec import cache as rules
    from uniradix.spec.errors import CacheError
    if not isinstance(ref, dict):
        return None
    try:
        return rules.find_node(state, ref.get("tokens", []), ref.get("extra_key"))
    except CacheError:
        return None


def _load_back_before(trace: Trace, step_i: int) -> tuple[Any, dict, Any] | None:
    """For a ``load_back`` step ``step_i``: the spec adapter before it, the step and the node
    it loads (None where that is no node); None for any other step."""
    found = _spec_adapter_before(trace, step_i)
    if found is None or found[1]["op"] != "load_back":
        return None
    adapter, step = found
    return adapter, step, _spec_node(adapter.state, step.get("args", {}).get("node") or {})


def swa_skipped_leaf_keeps_state(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is an insert, with SWA and Mamba, whose new leaf
    SWA's skip rule does not create (the whole rest of the key lies before the caller's window,
    ``swa_evicted_seqlen``), on the spec's state before it: the tree takes no state, so the spec
    answers ``mamba_exist`` true (the caller keeps and frees its state); the seed answers false
    and leaks the state slot (docs/SPEC.md, "The request path for SWA and Mamba")."""
    from uniradix.spec import cache as rules
    comps = trace.config.components
    if "swa" not in comps or "mamba" not in comps:
        return False
    found = _spec_state_before(trace, step_i)
    if found is None or found[1]["op"] != "insert":
        return False
    state, step = found
    args = step.get("args", {})
    units = rules.aligned_units(state, rules.check_int_list("tokens", args["tokens"]))
    start = sum(shared for _, shared in rules.insert_plan(state, args.get("extra_key"), units))
    return start < len(units) and args.get("swa_evicted_seqlen", 0) >= len(units)


def host_lock_on_host_only_aux(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is a host lock that, on the spec, locks some aux
    component's data of a node where that data is on the host only (its device copy evicted):
    the locked node's own, or with SWA any node of the window of host copies the lock takes
    above it.  After such a lock 0.5.13.post1's own sanity check fails (its host LRU list of
    that component no longer holds the node; docs/SPEC.md, "Host locks"), while the spec's lock
    is sound."""
    if not trace.config.host_slots or len(trace.config.components) < 2:
        return False
    found = _spec_adapter_before(trace, step_i)
    if found is None or found[1]["op"] != "host_lock":
        return False
    adapter, step = found
    node = _spec_node(adapter.state, step.get("args", {}).get("node") or {})
    if node is None:
        return False
    path = list(node.ancestors_to_root())
    before = [{c: d.host_lock_ref for c, d in n.aux.items() if d is not None} for n in path]
    adapter.apply(step)
    return any(d is not None and d.host_lock_ref > was.get(c, 0) and d.value is None
               and d.host_value is not None
               for n, was in zip(path, before, strict=True) for c, d in n.aux.items())


def host_locked_state_listed(trace: Trace, step_i: int, listed: Any,
                             component: str = "mamba") -> bool:
    """Whether ``listed`` (a node path, ``{"tokens", "extra_key"}``: what upstream's host LRU
    list of ``component``, ``"mamba"`` or ``"swa"``, holds where it differs from the spec's
    after step ``step_i`` of ``trace``) is, on the spec's state after that step, a node whose
    data of that component is on the host only and host-locked.  The spec keeps host-locked
    data out of the host LRU lists (upstream's own host lock takes it out); 0.5.13.post1's
    evict puts host-locked data that becomes host-only back in (docs/SPEC.md, "Host locks")."""
    if not isinstance(listed, dict) or component not in trace.config.components \
            or not trace.config.host_slots:
        return False
    state = _spec_state_after(trace, step_i)
    node = None if state is None else _spec_node(state, listed)
    if node is None:
        return False
    d = node.aux.get(component)
    return d is not None and d.value is None and d.host_value is not None \
        and d.host_lock_ref > 0


def host_locked_copy_freed(trace: Trace, step_i: int, slot: Any, component: str) -> bool:
    """Whether host slot ``slot`` of ``component`` (``"swa"`` or ``"mamba"``: what upstream's
    host frees of that component hold where they differ from the spec's at step ``step_i`` of
    ``trace``) belongs, on the spec's state after that step, to a node whose data of that
    component is on the host only and host-locked.  0.5.13.post1 lists such data in its host
    LRU list when an evict leaves it host-only (:func:`host_locked_state_listed`), so its next
    host eviction of that component can free it, lock and all; the spec keeps it (docs/SPEC.md,
    "Host locks")."""
    if isinstance(slot, bool) or not isinstance(slot, int) \
            or component not in trace.config.components or not trace.config.host_slots:
        return False
    state = _spec_state_after(trace, step_i)
    if state is None:
        return False
    stack = [state.root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        d = node.aux.get(component)
        if d is not None and d.value is None and d.host_value is not None \
                and d.host_lock_ref > 0 and slot in d.host_value:
            return True
    return False


def load_back_lost_its_host_state(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is a load back that the spec fails because its own
    room-making took what it was to load: the node had its KV data (and with Mamba its state)
    on the host before the step, and after it the spec loaded nothing and the node (or its host
    state) is gone from the host, taken by a write-back backup making host room.  0.5.13.post1
    reads the node's host copy anyway: with the node gone it fails on the missing copy (a
    ``TypeError``), with only a Mamba state gone it loads that state from a host slot another
    node holds by then (docs/SPEC.md, "HiCache", the shared defects, and "A Mamba load back with
    no device state to be had")."""
    if not trace.config.host_slots:
        return False
    mamba = "mamba" in trace.config.components

    def host_state(node: Any) -> bool:
        d = None if node is None else node.aux.get("mamba")
        return node is not None and node.host_value is not None \
            and (not mamba or (d is not None and d.host_value is not None))

    found = _load_back_before(trace, step_i)
    if found is None or not host_state(found[2]):
        return False
    adapter, step, _ = found
    obs = adapter.apply(step)
    ref = step.get("args", {}).get("node") or {}
    return obs.get("device_indices") == [] and not host_state(_spec_node(adapter.state, ref))


def load_back_without_a_state_slot(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is a Mamba load back that the spec fails for want
    of a device state slot: the node's state is on the host only before it, and after it the
    spec loaded nothing and its state pool has no free slot (every state locked, or held by
    the caller, with nothing evictable).  0.5.13.post1 asserts there (``Cannot alloc mamba
    for load_back``; docs/SPEC.md, "A Mamba load back with no device state to be had")."""
    if "mamba" not in trace.config.components or not trace.config.host_slots:
        return False
    found = _load_back_before(trace, step_i)
    if found is None or found[2] is None:
        return False
    adapter, step, node = found
    d = node.aux.get("mamba")
    if d is None or d.value is not None or d.host_value is None:
        return False
    obs = adapter.apply(step)
    state = adapter.state
    return obs.get("device_indices") == [] and obs.get("mamba_pool_idx") is None \
        and state.mamba is not None and state.mamba.available_size() < 1


def load_back_window_ends_at_a_tombstone(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is a load back, with SWA and a host tier, of an
    evicted node whose window (one window of SWA data, from the node up) reaches a node with
    SWA data on neither tier before it is full: the spec loads the window it has and ends
    there (spec/components.py ``swa_load_window``); 0.5.13.post1 asserts that every node of
    the window has SWA data somewhere (its SWA validator would not have answered such a best
    node: here it comes from an earlier match; docs/SPEC.md, "A load back whose window ends at
    an SWA tombstone")."""
    if "swa" not in trace.config.components or not trace.config.host_slots:
        return False
    found = _load_back_before(trace, step_i)
    if found is None or found[2] is None or not found[2].evicted:
        return False
    from uniradix.spec.components import window
    state, cur, size = found[0].state, found[2], 0
    while not cur.is_root and size < window(state):
        d = cur.aux.get("swa")
        data = None if d is None else d.value if d.value is not None else d.host_value
        if data is None:
            return True
        size += len(data)
        cur = cur.parent
    return False


def cow_match_without_a_state_slot(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is a copy-on-write match (``cow_mamba``) that
    finds a state to copy but no device state slot for the request, even after evicting one
    state (every other state locked or the caller's): the spec answers ``mamba_pool_idx``
    None; 0.5.13.post1 asserts (``Can not alloc mamba cache``; docs/SPEC.md, the
    ``finalize_match_result`` row)."""
    if "mamba" not in trace.config.components:
        return False
    found = _spec_adapter_before(trace, step_i)
    if found is None:
        return False
    adapter, step = found
    if step["op"] != "match_prefix" or not step.get("args", {}).get("cow_mamba"):
        return False
    obs = adapter.apply(step)
    return obs.get("mamba_cow_src") is not None and obs.get("mamba_pool_idx") is None


def releases_after_split_of_skipped_node(trace: Trace, upto: int) -> list[int]:
    """The steps of ``trace``, up to step ``upto``, that release a lock of any kind (an
    ``unlock``, a write-through's lock at its ack, a load back's at its ack, a request's) whose
    skipped nodes grew by a split since it was taken: the Full lock's evicted bottom segment,
    or with SWA the tombstones its window skipped.  The spec's split hooks add the new upper
    part to the lock's skipped nodes, so its release leaves that part alone; 0.5.13.post1 (and
    the seed) remember only the nodes skipped at lock time and take a count from the upper part
    they never locked, one another lock holds there (a load back's, a request's), whose own
    release may then fail (docs/SPEC.md: "SWA unlock skips the tombstones the lock skipped by
    node identity", and "HiCache", the shared defects)."""
    from uniradix.conformance.adapters.base import SpecAdapter
    adapter = SpecAdapter(trace.config)
    seen: dict[int, tuple[Any, int, int]] = {}  # serial -> (handle, Full skipped, SWA skipped)

    def skipped(handle: Any) -> tuple[int, int]:
        swa = handle.aux.get("swa")
        return len(handle.skipped), len(swa[0]) if swa is not None else 0

    found: list[int] = []
    for idx, step in enumerate(trace.steps):
        i = step.get("i", idx)
        if i > upto:
            break
        adapter.apply(step)
        live = adapter.state.handles
        if any(s not in live and (skipped(h)[0] > full or skipped(h)[1] > swa)
               for s, (h, full, swa) in seen.items()):
            found.append(i)
        seen = {s: v for s, v in seen.items() if s in live}
        for serial, handle in live.items():
            if serial not in seen:
                seen[serial] = (handle, *skipped(handle))
    return found


def split_of_a_host_locked_swa_copy(trace: Trace, upto: int) -> bool:
    """Whether a step of ``trace``, up to step ``upto``, split a node whose SWA host copy a
    host lock holds, so that the new upper part carries the lock's count on the spec (its split
    hook copies the SWA host lock count to both parts); 0.5.13.post1's SWA split copies the
    device lock count only, so its upper part is host-unlocked (listed in its SWA host LRU
    list, free for a host eviction to take) while the lock holds the node (docs/SPEC.md, "A
    split of a host-locked SWA copy")."""
    from uniradix.conformance.adapters.base import SpecAdapter
    from uniradix.spec.core import all_nodes
    if "swa" not in trace.config.components or not trace.config.host_slots:
        return False
    adapter = SpecAdapter(trace.config)

    def locked_paths() -> set:
        return {(n.path_units(), n.extra_key) for n in all_nodes(adapter.state)
                if not n.is_root and "swa" in n.aux and n.aux["swa"].host_lock_ref > 0}
    for idx, step in enumerate(trace.steps):
        i = step.get("i", idx)
        if i > upto:
            break
        before = {(n.path_units(), n.extra_key) for n in all_nodes(adapter.state)}
        adapter.apply(step)
        if step["op"] in ("insert", "match_prefix") and locked_paths() - before:
            return True
    return False


def split_hit_count_reaches_threshold(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` counts a write-through hit on a node a split made
    (in that step or before) that stays below ``write_through_threshold`` on the spec but would
    reach it had the split copied the lower part's hit count, as 0.5.13.post1's ``_split_node``
    does (the seed, and the spec under ``lru``, start the upper part at 0; docs/SPEC.md, "Where
    0.5.13.post1 differs from the seed", HiCache): upstream backs that node up one or more hits
    earlier.  Only under ``lru`` with a host tier whose write-through threshold is 2 or more
    (with 1 both back the node up at its first hit; under the other policies the spec copies
    the count too)."""
    from uniradix.conformance.adapters.base import SpecAdapter
    from uniradix.spec.core import all_nodes
    from uniradix.spec.policies import follows_upstream_hit_counts
    cfg = trace.config
    if not cfg.host_slots or cfg.write_policy == "write_back" or cfg.write_through_threshold < 2:
        return False
    adapter = SpecAdapter(cfg)
    if follows_upstream_hit_counts(adapter.state):
        return False
    lost: dict[int, int] = {}  # id(upper node a split made) -> the count its split did not copy
    for idx, step in enumerate(trace.steps):
        i = step.get("i", idx)
        if i > step_i:
            break
        held = list(all_nodes(adapter.state))  # (alive through the step: ids stay unique)
        before = {id(n): n.hit_count for n in held}
        adapter.apply(step)
        nodes = list(all_nodes(adapter.state))
        for n in nodes:  # this step's splits: a new node over a child that was there before
            if id(n) not in before and not n.is_root:
                for child in n.children.values():
                    if id(child) in before:
                        lost[id(n)] = before[id(child)] + lost.get(id(child), 0)
        lost = {k: v for k, v in lost.items() if k in {id(n) for n in nodes}}
        if i == step_i:
            threshold = cfg.write_through_threshold
            return any(lost.get(id(n), 0) > 0 and n.hit_count > before.get(id(n), 0)
                       and n.hit_count < threshold <= n.hit_count + lost[id(n)]
                       for n in nodes)
    return False


def unlock_left_a_device_leaf_out(trace: Trace, step_i: int, listed: Any) -> bool:
    """Whether ``listed`` (a node path the spec's device leaf order holds after step ``step_i``
    of ``trace`` where upstream's does not) is, with SWA and a host tier, a node that step
    took the last lock off, above an evicted node the lock was taken on (the lock skipped it).
    The step is an ``unlock`` of such a lock, or a ``load_back`` that loaded nothing: it locks
    the path of the evicted node it is to load while it makes room, and releases that lock when
    it gives up.  0.5.13.post1's Full release re-checks such a node's leaf status while the SWA
    component still holds its lock, so the node stays out of its evictable leaf set, and the
    final re-check covers only the evicted node; the spec lists the node as the device leaf it
    is (docs/SPEC.md, "HiCache", the shared defects)."""
    comps = trace.config.components
    if not isinstance(listed, dict) or "swa" not in comps or not trace.config.host_slots:
        return False
    found = _spec_adapter_before(trace, step_i)
    if found is None or found[1]["op"] not in ("unlock", "load_back"):
        return False
    adapter, step = found
    args = step.get("args", {})
    if step["op"] == "unlock":
        h = args.get("handle")
        handle = adapter.handles.get(h) if isinstance(h, int) and not isinstance(h, bool) \
            else None
        if handle is None:
            return False
        taken_on, locked = handle.node, handle.locked_nodes()
    else:
        taken_on = _spec_node(adapter.state, args.get("node") or {})
        if taken_on is None:
            return False
        path = list(taken_on.ancestors_to_root())  # what the load back's lock takes: all
        while path and path[0].value is None:  # but the evicted bottom segment
            path = path[1:]
        locked = path
    if taken_on.value is not None:
        return False
    adapter.apply(step)
    node = _spec_node(adapter.state, listed)
    if node is None:
        return False
    return node is not taken_on and any(n is node for n in locked) and node.lock_ref == 0


def aux_evict_passes_over_a_leaf(trace: Trace, step_i: int) -> bool:
    """Whether, at step ``step_i`` of ``trace`` under write-back with a host tier, the spec's
    SWA or Mamba eviction passed a device leaf over because its backup failed (the host pools
    could not make room: no host leaf to evict).  0.5.13.post1's SWA / Mamba eviction loop
    takes that same leaf again and again and never returns (docs/SPEC.md, "Write-back
    eviction that cannot back its victim up")."""
    from uniradix.spec import components
    from uniradix.spec.core import CacheState, Node
    cfg = trace.config
    if not cfg.host_slots or cfg.write_policy != "write_back" \
            or not ({"swa", "mamba"} & set(cfg.components)):
        return False
    found = _spec_adapter_before(trace, step_i)
    if found is None:
        return False
    adapter, step = found
    passed: list[bool] = []
    depth = [0]  # inside evict_aux
    evict_leaf, evict_aux = components.evict_leaf, components.evict_aux

    def leaf(state: CacheState, leaf: Node, tracker: dict[str, int]) -> bool:
        done = evict_leaf(state, leaf, tracker)
        if not done and depth[0]:
            passed.append(True)
        return done

    def aux(state: CacheState, comp: components.AuxComponent, request: int,
            tracker: dict[str, int]) -> None:
        depth[0] += 1
        try:
            evict_aux(state, comp, request, tracker)
        finally:
            depth[0] -= 1

    components.evict_leaf, components.evict_aux = leaf, aux
    try:
        adapter.apply(step)
    finally:
        components.evict_leaf, components.evict_aux = evict_leaf, evict_aux
    return bool(passed)


def held_swa_tombstone_takeover(trace: Trace, step_i: int) -> bool:
    """Whether step ``step_i`` of ``trace`` is an insert that, on the spec's state before it,
    walks over an SWA tombstone a lock holds, from ``prev_prefix_len`` on and inside the
    caller's window: where the seed frees the tombstone's full slots and the spec does not."""
    from uniradix.spec import cache as rules
    from uniradix.spec import components
    if "swa" not in trace.config.components:
        return False
    found = _spec_adapter_before(trace, step_i)
    if found is None:
        return False
    adapter, step = found
    if step["op"] != "insert":
        return False
    args = step.get("args", {})
    state = adapter.state
    units = rules.aligned_units(state, rules.check_int_list("tokens", args["tokens"]))
    prev, window_start = args.get("prev_prefix_len", 0), args.get("swa_evicted_seqlen", 0)
    start = 0
    for node, shared in rules.insert_plan(state, args.get("extra_key"), units):
        end = start + shared
        if prev < end and window_start < end and components.swa_tombstone_held(node):
            return True
        start = end
    return False
