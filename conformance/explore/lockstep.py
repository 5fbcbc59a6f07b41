"""The lockstep runner: one step at a time on two or more implementations, compared on every step.

For each step every adapter ``apply``s it, then the runner checks, in this order:

1. **rejection**: all adapters accepted the step, or all rejected it with the same error type
   (the ``message`` of a rejected step is never compared);
2. **observation**: the observations are equal (return values and effects such as ``freed``);
3. **rejected => unchanged**: a rejected step left each adapter's canonical snapshot as it was;
4. **snapshot**: the canonical snapshots are equal, except node fields an adapter declares
   ``uncompared_node_fields`` (a documented difference of that peer, left out of the
   comparisons that adapter is in; :func:`uncompared_node_fields`);
   **events**: the step's KV events are equal as multisets among the adapters that emit them
   (conformance/traces/events.py; ``events=False`` turns this off, ``events_note`` says which adapters
   do not emit them);
5. **violations**: every adapter's own ``violations()`` is ``[]``.

The first failed check is a :class:`Finding` (``kind`` ``divergence`` or ``violation``, the step
index and op, the path of the first difference and the value each implementation had there).
:meth:`Lockstep.apply` raises it as :class:`LockstepError`; :meth:`Lockstep.check` returns it.

Snapshots and violations are the cost of a lockstep step (the spec recomputes everything from
scratch).  ``snapshot_every=N`` / ``violations_every=N`` check them on every N-th step only; a
rejected step is always followed by a snapshot comparison.  The default checks every step.

The module also holds what turns a finding into a regression file: :func:`run_steps` (replay a
step list in lockstep from fresh adapters), :func:`shrink` (delta debugging over the step list)
and :func:`write_trace` (the steps with the first implementation's observations as ``ret``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from uniradix.conformance.adapters.base import CacheUnderTest, make_adapter
from uniradix.conformance.traces.events import event_differences, event_key_mode, event_source, events_differ
from uniradix.conformance.traces.trace import dump_trace, make_header
from uniradix.spec.config import CacheConfig

AdapterFactory = Callable[[CacheConfig], CacheUnderTest]
ImplSpec = str | AdapterFactory

MISSING = "<missing>"

DIVERGENCE = "divergence"
VIOLATION = "violation"


# ----------------------------------------------------------------------------------------------
# Findings
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Finding:
    """The first disagreement (or broken invariant) of a lockstep run.

    ``where`` says which check failed: ``crash`` (an adapter raised something other than a
    typed rejection; kind ``violation``), ``rejection`` (one side rejected the step, or the error
    types differ), ``observation``, ``unchanged`` (a rejected step changed the snapshot),
    ``snapshot``, ``events`` (the values: the events only each side emitted) or ``violations``.
    ``path`` is the first differing field inside it (e.g. ``freed[2]`` or
    ``nodes[extra_key=None tokens=[1, 2]].lock_ref``).  ``values`` holds the value each
    implementation had at that path (for ``unchanged``: ``before`` and ``after`` of
    the implementation that changed; for ``violations``: each implementation's messages).
    """

    kind: str                      # DIVERGENCE | VIOLATION
    step: int                      # index of the step in the run (its "i")
    op: str
    where: str                     # rejection | observation | unchanged | snapshot | events | violations
    path: str
    values: dict                   # impl label -> value at ``path``
    impls: tuple = ()              # the implementations the finding is about
    args: dict | None = None    # the step's args (for the report)

    @property
    def field(self) -> str:
        return f"{self.where}.{self.path}" if self.path else self.where

    def signature(self) -> tuple:
        """What makes two findings "the same" while shrinking: the kind (divergence or
        violation), the op, the check that failed, what failed in it (the differing field,
        ``path`` without its indices and node labels: ``nodes[...].lock_ref`` is
        ``nodes.lock_ref``; for a violation the invariant, its messages' tag such as ``lock``
        or ``kv``; for a crash the exception type) and the implementations it is about (not
        the exact values)."""
        return (self.kind, self.op, self.where, _field_name(self.path), self.impls)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "op": self.op, "field": self.field,
                "values": self.values, "impls": list(self.impls)}

    def __str__(self) -> str:
        vals = "; ".join(f"{k}: {_short(v)}" for k, v in self.values.items())
        return (f"{self.kind.upper()} at step {self.step} ({self.op}): {self.field}: {vals}")


class StepTimeout(Exception):
    """An implementation gave no answer to one step within the step timeout (a hang)."""


#: seconds one adapter may take for one step before it counts as hung (:func:`step_timeout`);
#: None: no limit
_STEP_TIMEOUT: list[float | None] = [None]


@contextlib.contextmanager
def step_timeout(seconds: float | None) -> Iterator[None]:
    """While inside: every :class:`Lockstep` step (shrink trials too) gives each adapter at most
    ``seconds`` for the step; one that takes longer is interrupted and reported as a crash
    (:class:`StepTimeout`) of that implementation.  Needs the main thread (SIGALRM); elsewhere
    no limit applies.  ``uniradix conform --step-timeout``."""
    if seconds is not None and seconds <= 0:
        raise ValueError("the step timeout must be positive")
    previous = _STEP_TIMEOUT[0]
    _STEP_TIMEOUT[0] = seconds
    try:
        yield
    finally:
        _STEP_TIMEOUT[0] = previous


@contextlib.contextmanager
def _deadline() -> Iterator[None]:
    seconds = _STEP_TIMEOUT[0]
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise StepTimeout(f"no answer within {seconds:g} s (a hang)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class LockstepError(AssertionError):
    """Raised by :meth:`Lockstep.apply`; carries the :class:`Finding`."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(str(finding))
        self.finding = finding


def _field_name(path: str) -> str:
    """``path`` without its bracketed parts (list indices, node labels)."""
    out, depth = [], 0
    for ch in path:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _short(x: Any, limit: int = 240) -> str:
    s = json.dumps(x, default=str, sort_keys=True)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


# ----------------------------------------------------------------------------------------------
# Structural diff (first difference, as a readable path)
# ----------------------------------------------------------------------------------------------


def _node_label(item: Any) -> str | None:
    """Snapshot list items that name a node are keyed by their path, not their position."""
    if isinstance(item, dict):
        p = item.get("path", item if "tokens" in item else None)
        if isinstance(p, dict) and "tokens" in p:
            return f"extra_key={p.get('extra_key')!r} tokens={p['tokens']}"
    return None


def _is_path(x: dict) -> bool:
    return set(x) == {"tokens", "extra_key"}


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first place where ``a`` and ``b`` differ, as ``(path, value_in_a, value_in_b)``;
    None when they are equal.  Dicts are walked key by key (in ``a``'s order), lists element by element,
    except lists of node entries, which are matched by node path (so one extra node is reported
    as that node, not as every later position shifting)."""
    if a == b:
        return None
    if isinstance(a, dict) and isinstance(b, dict) and not (_is_path(a) and _is_path(b)):
        for k in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in a:
                return (sub, MISSING, b[k])
            if k not in b:
                return (sub, a[k], MISSING)
            d = first_difference(a[k], b[k], sub)
            if d is not None:
                return d
        return (path, a, b)
    if isinstance(a, list) and isinstance(b, list):
        labels_a = [_node_label(x) for x in a]
        labels_b = [_node_label(x) for x in b]
        keyed = ((a or b) and all(labels_a) and all(labels_b)
                 and len(set(labels_a)) == len(a) and len(set(labels_b)) == len(b)
                 and all(isinstance(x, dict) and "path" in x for x in a + b))
        if keyed:  # node entries: compare by node path
            da = dict(zip(labels_a, a, strict=True))
            db = dict(zip(labels_b, b, strict=True))
            for lab in sorted(set(da) | set(db), key=lambda s: (labels_a + labels_b).index(s)):
                sub = f"{path}[{lab}]"
                if lab not in da:
                    return (sub, MISSING, db[lab])
                if lab not in db:
                    return (sub, da[lab], MISSING)
                d = first_difference(da[lab], db[lab], sub)
                if d is not None:
                    return d
            if labels_a != labels_b:
                return (f"{path}(order)", labels_a, labels_b)
            return (path, a, b)
        for k in range(min(len(a), len(b))):
            d = first_difference(a[k], b[k], f"{path}[{k}]")
            if d is not None:
                return d
        if len(a) != len(b):
            k = min(len(a), len(b))
            return (f"{path}[{k}]", a[k] if k < len(a) else MISSING, b[k] if k < len(b) else MISSING)
        return (path, a, b)
    return (path, a, b)


# ----------------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------------


def comparable(obs: dict) -> dict:
    """What is compared of an observation: a rejected step is its error type only."""
    if "error" in obs:
        return {"error": obs["error"]}
    if "message" in obs:
        return {k: v for k, v in obs.items() if k != "message"}
    return obs


def impl_labels(names: Sequence[str]) -> list[str]:
    """Unique labels for the implementations (``spec``, ``spec#2`` when a name repeats)."""
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def impl_name(impl: ImplSpec) -> str:
    if isinstance(impl, str):
        return impl
    return getattr(impl, "impl_name", None) or getattr(impl, "__name__", None) or repr(impl)


def build_adapters(impls: Sequence[ImplSpec], config: CacheConfig) -> list[CacheUnderTest]:
    return [make_adapter(i, config) if isinstance(i, str) else i(config) for i in impls]


# -- comparison rules an adapter declares (documented differences of a peer) -----------------


def adapter_trait(adapter: Any, name: str, default: Any) -> Any:
    """An adapter's declared trait ``name``, looking through wrappers that keep the wrapped
    adapter as ``inner`` (such as :class:`~uniradix.conformance.env.kvcheck.KVChecked`)."""
    seen = 0
    while adapter is not None and seen < 8:
        if hasattr(type(adapter), name) or name in getattr(adapter, "__dict__", {}):
            return getattr(adapter, name)
        adapter, seen = getattr(adapter, "inner", None), seen + 1
    return default


def uncompared_node_fields(adapter: Any) -> frozenset:
    """Node fields of the snapshot that are not compared between this adapter and any other:
    a documented difference of the peer (e.g. upstream 0.5.13.post1's hit counts without a host
    tier, docs/SPEC.md).  Declared by the adapter as ``uncompared_node_fields``."""
    return frozenset(adapter_trait(adapter, "uncompared_node_fields", ()) or ())


def tree_only(adapter: Any) -> bool:
    """The adapter has only the tree-level API (no ``req_*`` ops), declared as ``tree_only``."""
    return bool(adapter_trait(adapter, "tree_only", False))


def without_node_fields(snap: Any, fields: frozenset) -> Any:
    """A copy of a canonical snapshot without ``fields`` in its node entries."""
    if not isinstance(snap, dict) or not isinstance(snap.get("nodes"), list):
        return snap
    nodes = [{k: v for k, v in n.items() if k not in fields} if isinstance(n, dict) else n
             for n in snap["nodes"]]
    return dict(snap, nodes=nodes)


class Lockstep:
    """Apply steps to several adapters at once and compare them (see the module docstring).

    ``adapters`` are built ones; ``labels`` name them in findings (default ``impl0, impl1..``).
    The first adapter is the reference: its observation is what :meth:`apply` returns and what
    a written trace records as ``ret``.
    """

    def __init__(self, adapters: Sequence[CacheUnderTest], labels: Sequence[str] | None = None,
                 *, snapshot_every: int = 1, violations_every: int | None = None,
                 check_unchanged: bool = True, events: bool = True) -> None:
        if len(adapters) < 2:
            raise ValueError("lockstep needs at least two adapters")
        if snapshot_every < 1:
            raise ValueError("snapshot_every must be >= 1")
        self.adapters = list(adapters)
        self.labels = list(labels) if labels is not None else [f"impl{k}" for k in range(len(adapters))]
        if len(self.labels) != len(self.adapters) or len(set(self.labels)) != len(self.labels):
            raise ValueError("one unique label per adapter")
        self.snapshot_every = snapshot_every
        self.violations_every = snapshot_every if violations_every is None else violations_every
        self.check_unchanged = check_unchanged
        self.steps_done = 0
        # the snapshots taken after the previous step (None: not taken, or stale)
        self._last_snaps: list | None = None
        self.stats = {"snapshots": 0, "violations": 0, "rejected": 0, "event_steps": 0}
        # KV events (conformance/traces/events.py): the stream of every adapter that emits one, the
        # spec's rendered in the block-hash mode of a peer that declares one (upstream: compat)
        self.event_sources: list = [None] * len(self.adapters)
        if events:
            mode = next((m for m in map(event_key_mode, self.adapters) if m is not None), None)
            diffs = tuple(sorted({d for a in self.adapters for d in event_differences(a)}))
            self.event_sources = [event_source(a, mode, diffs) for a in self.adapters]
        emitting = [lb for lb, s in zip(self.labels, self.event_sources, strict=True) if s is not None]
        #: why events are not compared for some adapters (empty: compared for all, or off)
        self.events_note = "" if not events or len(emitting) == len(self.adapters) else (
            "KV events not compared for "
            + ", ".join(lb for lb in self.labels if lb not in emitting)
            + " (does not emit them)"
            + ("" if len(emitting) >= 2 else "; fewer than two implementations emit them"))
        if len(emitting) < 2:  # nothing to compare: emit nothing (the spec's costs a page map)
            self.event_sources = [None] * len(self.adapters)

    @classmethod
    def from_impls(cls, impls: Sequence[ImplSpec], config: CacheConfig, **kw: Any) -> Lockstep:
        """Build the adapters (names via ``make_adapter``, or factories ``config -> adapter``)."""
        return cls(build_adapters(impls, config), impl_labels([impl_name(i) for i in impls]), **kw)

    # -- snapshots -----------------------------------------------------------------------------
    def snapshots(self) -> list:
        self.stats["snapshots"] += 1
        return [a.snapshot() for a in self.adapters]

    def _compare_snapshots(self, snaps: list, i: int, op: str, args: Any) -> Finding | None:
        ref = snaps[0]
        ref_fields = uncompared_node_fields(self.adapters[0])
        for k in range(1, len(snaps)):
            if snaps[k] != ref:
                fields = ref_fields | uncompared_node_fields(self.adapters[k])
                a, b = (without_node_fields(ref, fields), without_node_fields(snaps[k], fields)) \
                    if fields else (ref, snaps[k])
                if a == b:
                    continue
                d = first_difference(a, b)
                assert d is not None
                path, va, vb = d
                return Finding(DIVERGENCE, i, op, "snapshot", path,
                               {self.labels[0]: va, self.labels[k]: vb},
                               (self.labels[0], self.labels[k]), args)
        return None

    def _compare_events(self, events: list, i: int, op: Any, args: Any) -> Finding | None:
        have = [(lb, ev) for lb, ev in zip(self.labels, events, strict=True) if ev is not None]
        if len(have) < 2:
            return None
        self.stats["event_steps"] += 1
        (ref_label, ref), rest = have[0], have[1:]
        for label, ev in rest:
            diff = events_differ(ref, ev)
            if diff is not None:
                return Finding(DIVERGENCE, i, op, "events", "", {
                    f"{ref_label} only": diff[0], f"{label} only": diff[1]},
                    (ref_label, label), args)
        return None

    # -- one step ------------------------------------------------------------------------------
    def check(self, step: dict, *, full: bool | None = None) -> tuple[dict, Finding | None]:
        """Apply ``step`` to every adapter; return (the reference observation, the finding or
        None).  ``full`` forces (True) or skips (False) the snapshot and violation checks of this
        step, overriding the ``*_every`` schedule (a rejection still compares snapshots)."""
        i = step.get("i", self.steps_done)
        op = str(step.get("op", ""))  # the name findings report (the adapters read the step)
        args = step.get("args")
        n = self.steps_done
        self.steps_done += 1
        want_snap = (n + 1) % self.snapshot_every == 0 if full is None else full
        want_viol = (n + 1) % self.violations_every == 0 if full is None else full

        before = self._last_snaps
        self._last_snaps = None
        obs = []
        crashed = {}
        for label, a in zip(self.labels, self.adapters, strict=True):
            try:
                with _deadline():
                    obs.append(a.apply(step))
            except Exception as e:  # not a typed rejection: the implementation broke (or hung)
                crashed[label] = f"{type(e).__name__}: {e}".strip()
                obs.append({"error": f"crash:{type(e).__name__}", "message": crashed[label]})
        if crashed:
            first = next(iter(crashed.values())).split(":")[0]
            return obs[0], Finding(VIOLATION, i, op, "crash", first, crashed, tuple(crashed), args)
        events = [None if src is None else src.after_step(step, o)
                  for src, o in zip(self.event_sources, obs, strict=True)]
        cmp = [comparable(o) for o in obs]
        ref = cmp[0]
        rejected = "error" in ref

        # 1. rejection and error type
        for k in range(1, len(cmp)):
            if ("error" in cmp[k]) != rejected or cmp[k].get("error") != ref.get("error"):
                vals = {self.labels[0]: _err_view(obs[0]), self.labels[k]: _err_view(obs[k])}
                return obs[0], Finding(DIVERGENCE, i, op, "rejection", "error", vals,
                                       (self.labels[0], self.labels[k]), args)
        # 2. observation (return value and effects)
        if not rejected:
            for k in range(1, len(cmp)):
                if cmp[k] != ref:
                    path, va, vb = first_difference(ref, cmp[k])  # type: ignore[misc]
                    return obs[0], Finding(DIVERGENCE, i, op, "observation", path,
                                           {self.labels[0]: va, self.labels[k]: vb},
                                           (self.labels[0], self.labels[k]), args)
        else:
            self.stats["rejected"] += 1
        # 3. a rejected step changes nothing; 4. snapshots agree
        if rejected or want_snap:
            snaps = self.snapshots()
            if rejected and self.check_unchanged and before is not None:
                for k, (b, s) in enumerate(zip(before, snaps, strict=True)):
                    if b != s:
                        path, vb, va = first_difference(b, s)  # type: ignore[misc]
                        return obs[0], Finding(
                            DIVERGENCE, i, op, "unchanged", path,
                            {f"{self.labels[k]} before": vb, f"{self.labels[k]} after": va},
                            (self.labels[k],), args)
            f = self._compare_snapshots(snaps, i, op, args)
            if f is not None:
                return obs[0], f
            self._last_snaps = snaps
        # 4b. the KV events of the step, as multisets, among the adapters that emit them
        f = self._compare_events(events, i, op, args)
        if f is not None:
            return obs[0], f
        # 5. each implementation's own invariants
        if want_viol:
            self.stats["violations"] += 1
            bad = {}
            for label, a in zip(self.labels, self.adapters, strict=True):
                v = a.violations()
                if v:
                    bad[label] = list(v)
            if bad:
                first = next(iter(bad.values()))[0]
                return obs[0], Finding(VIOLATION, i, op, "violations", _violation_tag(first), bad,
                                       tuple(bad), args)
        return obs[0], None

    def apply(self, step: dict, **kw: Any) -> dict:
        """Like :meth:`check`, but raise :class:`LockstepError` on a finding."""
        obs, finding = self.check(step, **kw)
        if finding is not None:
            raise LockstepError(finding)
        return obs

    def prime(self) -> None:
        """Take the snapshots a first-step rejection is compared against."""
        self._last_snaps = self.snapshots()


def _err_view(obs: dict) -> Any:
    if "error" in obs:
        return {"error": obs["error"], "message": obs.get("message", "")}
    return {"accepted": comparable(obs)}


def _violation_tag(message: str) -> str:
    """``[lock] ...`` -> ``lock`` (the spec tags its invariant messages by family)."""
    if message.startswith("[") and "]" in message:
        return message[1:message.index("]")]
    return ""


# ----------------------------------------------------------------------------------------------
# Step lists: replay in lockstep, renumber, shrink, write
# ----------------------------------------------------------------------------------------------


def renumber(steps: Sequence[dict]) -> list[dict]:
    """The steps with ``i`` = 0, 1, 2, ...; an ``unlock`` of a handle issued by a kept ``lock``
    step follows that step's new index; a handle naming a dropped step becomes one that can
    never be issued (negative), so that unlock is rejected on every implementation."""
    new_index = {s.get("i", k): k for k, s in enumerate(steps)}
    out = []
    for k, s in enumerate(steps):
        t = {"i": k, "op": s.get("op"), "args": s.get("args", {})}
        if t["op"] == "unlock" and isinstance(t["args"], dict):
            h = t["args"].get("handle")
            if isinstance(h, int) and not isinstance(h, bool) and h >= 0:
                if h in new_index:
                    h2 = new_index[h]
                else:
                    h2 = -(h + 1)
                if h2 != h:
                    t["args"] = dict(t["args"], handle=h2)
        out.append(t)
    return out


def run_steps(impls: Sequence[ImplSpec], config: CacheConfig, steps: Sequence[dict], *,
              full_ops: set | None = None, snapshot_every: int = 1,
              record: list | None = None, events: bool = True) -> Finding | None:
    """Replay ``steps`` (already numbered) in lockstep on fresh adapters; return the first
    finding or None.  ``full_ops``: check snapshots and violations only at steps with these
    ops (and at rejected steps) — cheap trial runs while shrinking.  ``record``: filled with
    each step plus the reference implementation's observation as ``ret``.  ``events``: compare
    KV events (:class:`Lockstep`)."""
    ls = Lockstep.from_impls(impls, config, snapshot_every=snapshot_every, events=events)
    ls.prime()
    for s in steps:
        full = None if full_ops is None else (s.get("op") in full_ops)
        if full and ls._last_snaps is None:
            ls.prime()  # the "rejected => unchanged" check needs the state before this step
        obs, finding = ls.check(s, full=full)
        if record is not None:
            record.append(dict(s, ret=comparable(obs)))
        if finding is not None:
            return finding
    return None


@dataclasses.dataclass
class ShrinkResult:
    steps: list          # renumbered, ending at the failing step
    finding: Finding     # the finding of a full-check run of ``steps``
    trials: int
    seconds: float
    original_len: int


def shrink(impls: Sequence[ImplSpec], config: CacheConfig, steps: Sequence[dict],
           finding: Finding, *, max_seconds: float = 120.0,
           on_progress: Callable[[int, int], None] | None = None,
           events: bool = True) -> ShrinkResult:
    """Delta debugging: drop chunks of steps (halves, quarters, ... single steps) while the
    same finding (:meth:`Finding.signature`: the same kind, op, check, field or invariant, and
    implementations) still reproduces; cut everything after the failing step.  Handle
    references are renumbered (:func:`renumber`); a step whose context was dropped simply
    becomes a rejected one on every side.  Every run compares KV events as the run that found
    it did (``events``).  Trial runs compare observations on every step and snapshots /
    violations only at steps with the finding's op; the result is confirmed with a full-check
    run.  When that run stops at another finding first, the steps are shrunk again, from the
    given ones, with every check on every step, so the result is always the finding given
    (the given steps, if nothing smaller reproduces it).  Stops improving after
    ``max_seconds``."""
    t0 = time.monotonic()
    target = finding.signature()
    trials = 0
    given = renumber(list(steps)[: _index_of(steps, finding.step) + 1])

    def trial(candidate: list, full_ops: set | None) -> tuple[list, Finding] | None:
        nonlocal trials
        trials += 1
        numbered = renumber(candidate)
        f = run_steps(impls, config, numbered, full_ops=full_ops, events=events)
        if f is None or f.signature() != target:
            return None
        return numbered[: f.step + 1], f

    def reduce(cur: list, cur_finding: Finding, full_ops: set | None) -> tuple[list, Finding]:
        # chunks of half the steps, then quarters, ... then single steps until none can go
        chunk = max(1, (len(cur) - 1) // 2)
        while len(cur) >= 2 and time.monotonic() - t0 < max_seconds:
            changed = False
            lo = 0
            while lo < len(cur) - 1 and time.monotonic() - t0 < max_seconds:
                body, last = cur[:-1], cur[-1]  # the failing step is never dropped by a trial
                r = trial(body[:lo] + body[lo + chunk:] + [last], full_ops)
                if r is not None:
                    cur, cur_finding = r
                    changed = True
                    if on_progress is not None:
                        on_progress(len(cur), trials)
                else:
                    lo += chunk
            if chunk == 1 and not changed:
                break
            chunk = max(1, chunk // 2)
        return cur, cur_finding

    cur, cur_finding = reduce(given, finding, {target[1]})
    # confirm with every check on every step
    full = run_steps(impls, config, cur, events=events)
    trials += 1
    if full is not None and full.signature() == target:
        cur, cur_finding = cur[: full.step + 1], full
    else:  # the cheap trials hid another finding: every trial runs every check now
        cur, cur_finding = reduce(given, finding, None)
    return ShrinkResult(cur, cur_finding, trials, time.monotonic() - t0, len(steps))


def _index_of(steps: Sequence[dict], i: int) -> int:
    for k, s in enumerate(steps):
        if s.get("i", k) == i:
            return k
    return len(steps) - 1


def write_trace(path: str, impls: Sequence[ImplSpec], config: CacheConfig, steps: Sequence[dict],
                source: str, seed: int | None = None, **header_extra: Any) -> list[dict]:
    """Write ``steps`` as a replayable trace with the reference implementation's (the first
    impl's) observations as ``ret``; return the recorded steps.  The lockstep run stops at the
    first finding, so later steps (none, for a shrunk list) are recorded from the reference
    alone."""
    recorded: list[dict] = []
    ref = build_adapters([impls[0]], config)[0]
    for s in steps:
        obs = ref.apply(s)
        recorded.append({"i": s["i"], "op": s["op"], "args": s.get("args", {}),
                         "ret": comparable(obs)})
    dump_trace(path, make_header(config, source, seed=seed, **header_extra), recorded)
    return recorded
