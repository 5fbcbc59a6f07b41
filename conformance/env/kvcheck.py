"""KV integrity: a real (small) KV pool whose contents say which token each slot holds.

The cache only moves slot numbers around; a slot mix-up (a split that hands the wrong half to a
node, a slot freed while the tree still holds it and then recomputed for another request, a
match that returns a stale slot) shows in slot numbers only when some later observation
happens to depend on it. This mode makes it show at once: :class:`KVChecked` wraps any adapter
(spec, fast, upstream) and keeps a KV pool of ``layers x slots x heads x dim`` floats, poisoned
(NaN) at the start. Whenever a token's KV is *computed* into a slot it writes that token's
**fingerprint** there, a function of the ``extra_key``, the whole token prefix and hence the
position; after every step it checks that

* every slot of every cached node holds the fingerprint of the node's path up to that slot,
* every slot of a running request's row (up to what it has computed) holds its token's, and
* every slot a ``match_prefix`` returned holds the fingerprint of the queried prefix.

When a step computes: the caller of ``insert`` computed the slots it hands over (those of its
``value`` the tree did not hold before the step, or freed during it); ``req_chunk`` and
``req_decode`` compute the row positions they add (again those whose slots the tree did not hold
through the step). A slot the tree already owned is never written, only checked: writing the right
fingerprint there would hide a mix-up. Everything is read from the adapter's canonical snapshot
and the step, so the wrapper works on every implementation. A problem is reported through
``violations()`` (tagged ``[kv]``), so lockstep runs, shrinking and ``uniradix replay`` treat it
as any broken invariant.
Under EAGLE slot ``p`` holds token ``p`` (the first token of bigram unit ``p``).

With a host tier the checker keeps a **host pool** too (:class:`HostKV`, in one of upstream's
host layouts, NaN at the start) and moves real data: after a step it runs the copies the
implementation asked its I/O environment for (``take_copies()`` on the adapter: backups
device -> host and loads host -> device, in the order they were issued) with the copy kernels
of ``uniradix.kernels`` (the torch reference by default; Triton under the interpreter with
``impl="triton"``), then checks that every node's host slots hold the fingerprints of its path
as well.  A host slot mix-up therefore shows when it happens, and a device slot mix-up is
carried to the host and back and shows when the data comes back.

With Mamba the checker keeps the **state pool** too (:class:`StatePool`: per state slot the
fingerprint of the sequence whose state it holds, unknown at the start).  An ``insert`` whose
state slot the tree takes (no ``mamba_exist``, a slot the tree did not hold before the step)
computes the state of its page-aligned tokens into that slot; after every step every node's
state slot must hold the state of the node's path.  With a host tier the state copies the
implementation asked for (``take_state_copies()`` on the adapter: ``("backup", device slots,
host slots)`` / ``("load", host slots, device slots)``) move the states between the device and
the host state pools, and every node's host state slot is checked the same way.

With SWA the checker keeps the **SWA pool** too (a :class:`StatePool` over SWA slots: per SWA
slot the fingerprint of the token whose sliding-window KV it holds).  When a token is computed
into a full slot, its SWA KV is computed into the SWA slot the implementation maps that full
slot to (``swa_slots_of(full slots)`` on the adapter; an adapter without it is not checked
here); after every step every node's SWA slots must hold the fingerprints of their positions.
With a host tier the SWA copies the implementation asked for (``take_swa_copies()``: backups
and loads, as for the states) move the SWA data between the device and the SWA host pool, and
every node's SWA host slots are checked the same way, so an SWA slot mix-up at a backup, a host
eviction or a load back shows when it happens.

With a storage tier the copies include the storage's: ``("store", host slots, page keys)`` (a
backup writes what those host slots hold under the keys, one page each) and ``("fetch", page
keys, host slots)`` (a prefetch reads what is stored under the keys into its host slots).  The
checker keeps its own store of host data by key, so a page that comes back from storage holds
exactly what was written under its key (nothing, NaN, if it never was), and the host check
after a prefetch inserts it shows a page read under the wrong key or into the wrong slots.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from uniradix.spec.config import CacheConfig
from uniradix.spec.requests import decode_track_lens, extend_track_len, next_track_after, output_token_id

LAYERS, HEADS, DIM = 2, 4, 8
_ELEMS = LAYERS * HEADS * DIM
_MOD = (1 << 61) - 1  # fingerprints are residues mod a Mersenne prime
_MUL = 0x5DEECE66D
# element e of a slot holds 16 bits of the fingerprint, salted per element (exact in float32)
_SHIFTS = np.array([16 * (e % 4) for e in range(_ELEMS)], dtype=np.int64)
_SALTS = np.array([(e * 40503 + 7) & 0xFFFF for e in range(_ELEMS)], dtype=np.int64)


def _seed(extra_key: str | None) -> int:
    if extra_key is None:
        return 0x2545F4914F6CDD1D % _MOD
    return (zlib.crc32(extra_key.encode("utf-8")) * 0x9E3779B1 + 1) % _MOD


def fingerprints(extra_key: str | None, tokens: Sequence[int]) -> list[int]:
    """``out[p]`` identifies (extra_key, tokens[:p + 1]): a rolling hash over the prefix."""
    h = _seed(extra_key)
    out = []
    for t in tokens:
        h = (h * _MUL + int(t) + 1) % _MOD
        out.append(h)
    return out


def slot_contents(fps: Sequence[int]) -> np.ndarray:
    """What slots holding these fingerprints contain: ``(layers, len(fps), heads, dim)``."""
    f = np.array(list(fps), dtype=np.int64).reshape(-1, 1)
    words = ((f >> _SHIFTS) & 0xFFFF) ^ _SALTS
    return words.astype(np.float32).reshape(-1, LAYERS, HEADS, DIM).transpose(1, 0, 2, 3)


class ReadMemo:
    """What the checks last read in each slot of a pool, to read only what may have changed.

    ``known[s] == f`` (``f >= 0``) says: slot ``s`` was read and found to hold fingerprint
    ``f``'s contents, and nothing has written it since; every write of the pool forgets the
    slots it writes (:meth:`forget`).  A check of ``(s, f)`` against a slot known to hold ``f``
    then has the result reading it would have, so :meth:`to_read` leaves it out; any other pair
    (an unknown slot, or one known to hold another fingerprint) is read.  The first wrong pair
    of a check is therefore the same pair, with the same message, as without the memo.
    ``writes`` counts the writes: while it stays the same, no slot's contents changed.
    With ``remember`` False (a class switch) every check reads every pair and is never skipped
    (the tests compare the findings both ways)."""

    remember = True

    def __init__(self, slots: int) -> None:
        self.known = np.full(slots, -1, dtype=np.int64)  # fingerprints are >= 0
        self.writes = 0

    def forget(self, slots: Any = None) -> None:
        """Slots written (every slot when ``slots`` is None: a write not known slot by slot)."""
        self.writes += 1
        if slots is None:
            self.known[:] = -1
        else:
            self.known[np.asarray(slots, dtype=np.int64)] = -1

    def to_read(self, idx: np.ndarray, fps: np.ndarray) -> np.ndarray:
        """The positions (ascending) of the pairs ``(idx[k], fps[k])`` a check must read."""
        if not self.remember:
            return np.arange(len(idx))
        return np.flatnonzero(self.known[idx] != fps)

    def learn(self, idx: np.ndarray, fps: np.ndarray) -> None:
        """These slots were just read and each held its fingerprint's contents."""
        self.known[idx] = fps


class KVPool:
    """The KV data of every slot (index = slot id), NaN until a token is computed into it.
    A numpy array (single-threaded and cheap on tiny arrays; ``torch.from_numpy`` shares it
    with the copy kernels when the host tier needs them).  ``memo``: what the checks have read
    (:class:`ReadMemo`); whatever writes ``data`` forgets the slots it writes there."""

    def __init__(self, slots: int) -> None:
        self.data = np.full((LAYERS, slots, HEADS, DIM), np.nan, dtype=np.float32)
        self.memo = ReadMemo(slots)

    def write(self, slots: Sequence[int], fps: Sequence[int]) -> None:
        if slots:
            self.memo.forget(list(slots))
            self.data[:, list(slots)] = slot_contents(fps)

    def first_wrong(self, slots: Sequence[int], fps: Sequence[int]) -> int | None:
        """Index of the first slot whose contents are not its fingerprint's, or None."""
        if not slots:
            return None
        size = self.data.shape[1]
        if set(map(type, slots)) != {int} or min(slots) < 0 or max(slots) >= size:
            outside = [k for k, s in enumerate(slots) if not (type(s) is int and 0 <= s < size)]
            if outside:  # a slot outside the pool holds no KV at all
                return outside[0]
        idx = np.array(slots, dtype=np.int64)
        want = np.array(fps, dtype=np.int64)
        return _first_wrong(self.memo, idx, want, lambda k: self.data[:, idx[k]])


def _first_wrong(memo: ReadMemo, idx: np.ndarray, fps: np.ndarray,
                 rows: Callable[[np.ndarray], np.ndarray]) -> int | None:
    """The first ``k`` whose slot ``idx[k]`` does not hold ``fps[k]``'s contents (``rows(ks)``:
    what the slots at positions ``ks`` hold, ``(layers, len(ks), heads, dim)``), reading only
    the pairs ``memo`` does not know to be right; None when every pair is right (then learnt)."""
    todo = memo.to_read(idx, fps)
    if not len(todo):
        return None
    bad = rows(todo) != slot_contents(fps[todo])  # NaN != anything
    per_slot = bad.reshape(LAYERS, len(todo), -1).any(axis=2).any(axis=0)
    if not per_slot.any():
        memo.learn(idx[todo], fps[todo])
        return None
    return int(todo[per_slot.argmax()])


class HostKV:
    """The host pool of the checked mode and the device pool's twin as ``uniradix.kernels``
    pools (an MLA-shaped geometry: one plane of ``HEADS * DIM`` elements per layer, the same
    bytes as :class:`KVPool`), so the copy kernels move the data."""

    def __init__(self, device: KVPool, host_slots: int, page_size: int, layout: str = "layer_first",
                 impl: str = "torch") -> None:
        import torch

        from uniradix import kernels
        self.kernels, self.torch, self.impl = kernels, torch, impl
        self.device_pool = device
        self.geometry = kernels.KVGeometry.mla(LAYERS, HEADS * DIM, page_size, torch.float32)
        slots = device.data.shape[1]
        self.device = kernels.DevicePool(self.geometry, torch.from_numpy(device.data).view(
            LAYERS, slots, 1, HEADS * DIM))
        tokens = host_slots + page_size
        shape = self.geometry.host_shape(layout, tokens)
        self.data = np.full(shape, np.nan, dtype=np.float32)  # shared with the kernels' view
        self.host = kernels.HostPool(self.geometry, kernels.Layout(layout),
                                     torch.from_numpy(self.data))
        self.layout = self.host.layout
        self.page_size = page_size
        self.stored: dict[str, np.ndarray] = {}  # the storage tier: page key -> its host data
        self.memo = ReadMemo(tokens)  # what the host checks have read (:class:`ReadMemo`)

    def _index(self, slots: Sequence[int]) -> tuple:
        """The index of ``slots`` in the host buffer, in its layout."""
        idx = np.array(list(slots), dtype=np.int64)
        name = self.layout.value
        if name == "layer_first":
            return (slice(None), idx)
        if name == "page_first":
            return (idx,)
        P = self.geometry.page_size
        return (idx // P, slice(None), idx % P)

    def _storage_copy(self, kind: str, src: list, dst: list) -> None:
        """A storage write (host slots -> keys) or read (keys -> host slots), page by page."""
        ps = self.page_size
        if kind == "store":
            for k, key in enumerate(dst):
                self.stored[key] = self.data[self._index(src[k * ps: (k + 1) * ps])].copy()
            return
        self.memo.forget(dst[: len(src) * ps])
        for k, key in enumerate(src):
            where = self._index(dst[k * ps: (k + 1) * ps])
            page = self.stored.get(key)
            if page is None:
                self.data[where] = np.nan
            else:
                self.data[where] = page

    def run(self, copies: list) -> None:
        """Run the logged copies in order.  The slots they write are forgotten by the read
        memos; a copy engine other than the torch reference (whose indexed copies write exactly
        the slots named) makes them forget every slot of the pool it writes."""
        t = self.torch
        exact = self.impl == "torch"
        for kind, src, dst in copies:
            if kind in ("store", "fetch"):
                self._storage_copy(kind, src, dst)
                continue
            (self.memo if kind == "backup" else self.device_pool.memo).forget(
                dst if exact else None)
            if kind == "backup":
                self.kernels.backup_all_layers(
                    self.device, self.host, device_indices=t.tensor(src, dtype=t.int64),
                    host_indices=t.tensor(dst, dtype=t.int64), impl=self.impl)
            else:
                self.kernels.load_all_layers(
                    self.host, self.device, host_indices=t.tensor(src, dtype=t.int64),
                    device_indices=t.tensor(dst, dtype=t.int64), impl=self.impl)

    def first_wrong(self, slots: Sequence[int], fps: Sequence[int]) -> int | None:
        """Index of the first host slot whose contents are not its fingerprint's, or None."""
        idx = np.array(slots, dtype=np.int64)
        return _first_wrong(self.memo, idx, np.array(fps, dtype=np.int64),
                            lambda k: self.rows(idx[k]))

    def rows(self, slots: Sequence[int]) -> np.ndarray:
        """What host slots hold: ``(layers, len(slots), heads, dim)``."""
        idx = np.array(list(slots), dtype=np.int64)
        buf = self.data
        name = self.layout.value
        if name == "layer_first":
            out = buf[:, idx]
        elif name == "page_first":
            out = buf[idx].transpose(1, 0, 2, 3)
        else:
            P = self.geometry.page_size
            out = buf[idx // P, :, idx % P].transpose(1, 0, 2, 3)
        return out.reshape(LAYERS, len(slots), HEADS, DIM)


class StatePool:
    """The Mamba state of every state slot, as the fingerprint of the sequence it was computed
    for (None: never computed, or copied from a slot that held none)."""

    def __init__(self) -> None:
        self.device: dict[int, int | None] = {}
        self.host: dict[int, int | None] = {}

    def run(self, copies: list) -> None:
        for kind, src, dst in copies:
            a, b = (self.device, self.host) if kind == "backup" else (self.host, self.device)
            for s, d in zip(src, dst, strict=True):
                b[d] = a.get(s)


class KVChecked:
    """An adapter with a KV pool that fingerprints computed tokens and checks every slot the
    cache hands out; see the module docstring.  ``host_layout`` / ``copy_impl``: the host
    pool's layout and the copy engine, with a host tier."""

    def __init__(self, inner: Any, config: CacheConfig, host_layout: str = "layer_first",
                 copy_impl: str = "torch") -> None:
        self.inner = inner
        self.config = config
        self.eagle = config.eagle
        self.kv = KVPool(config.kv_slots + config.page_size)
        self.host = HostKV(self.kv, config.host_slots, config.page_size, host_layout, copy_impl) \
            if config.has_host_tier else None
        self.states = StatePool() if "mamba" in config.components else None
        # the SWA pool, where the implementation says which SWA slot a full slot maps to
        self.swa = StatePool() if "swa" in config.components and hasattr(inner, "swa_slots_of") \
            else None
        self.tokens: dict[str, tuple] = {}  # rid -> (prompt tokens, extra_key)
        self.errors: list[str] = []
        self._fp_cache: dict = {}
        # the inner adapter's snapshot after the last step it accepted (None: none taken since
        # the last step); it is what snapshot() returns until the next step
        self._snap: dict | None = None
        self._arrivals = 0  # req_arrive steps so far (what ``tokens`` says changes only then)
        # what the last clean device / host check read: a check of the same nodes (and
        # requests) over the same, unwritten pool finds nothing again (_check_state)
        self._clean_state: tuple | None = None
        self._clean_host: tuple | None = None

    # the adapter protocol ------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The inner adapter's snapshot.  Taken once per step: the state changes only in
        :meth:`apply` (a caller must not change the dict).  After a rejected step it is taken
        anew, so a rejection that changed the state still shows."""
        if self._snap is None:
            self._snap = self.inner.snapshot()
        return self._snap

    def violations(self) -> list[str]:
        return list(self.inner.violations()) + self.errors

    def apply(self, step: dict) -> dict:
        op = step.get("op")
        args = step.get("args") or {}
        n = args.get("n")
        self._last_n = n if isinstance(n, int) else 0
        before = self.snapshot() if op in ("insert", "req_chunk", "req_decode") or (
            self.states is not None and op in REQUEST_STATE_OPS) else None
        self._snap = None
        if self.host is not None:
            self.inner.take_copies()
            if self.states is not None:
                self.inner.take_state_copies()
            if self.swa is not None:
                self.inner.take_swa_copies()
        obs = self.inner.apply(step)
        if "error" in obs:
            return obs
        i = step.get("i")
        after = self.snapshot()
        # a request step evicts for room before it computes and caches after: under write-back
        # its trips (the backups of what it evicts) come before what it computes, under
        # write-through (its insert's backups) after
        trips_first = self.host is not None and op in REQUEST_STATE_OPS \
            and self.config.write_policy == "write_back"
        if trips_first:
            self._run_trips(i, after)
        if op == "req_arrive":
            self.tokens[args["rid"]] = (list(args["tokens"]), args.get("extra_key"))
            self._arrivals += 1
        elif op == "insert":
            self._compute(i, args.get("extra_key"), list(args["tokens"]), list(args["value"]),
                          0, _owned(before, obs))
            if self.states is not None:
                self._compute_state(args, before, obs)
        elif op in ("req_chunk", "req_decode") and obs.get("ok", True):
            assert before is not None  # taken for every req_chunk / req_decode above
            self._compute_row(i, args["rid"], before, obs, after)
        elif op == "match_prefix":
            got = list(obs.get("device_indices", []))
            self._expect(i, f"match_prefix result for {len(args['tokens'])} tokens",
                         args.get("extra_key"), list(args["tokens"]), got)
        if self.states is not None and op in REQUEST_STATE_OPS:
            assert before is not None  # taken for every request step with Mamba above
            self._request_states(op, args.get("rid"), before, obs, after)
        if not trips_first:
            self._run_trips(i, after)
        self._check_state(i, after)
        if self.states is not None:
            self._check_states(i, after)
        if self.swa is not None:
            self._check_swa(i, after)
        return obs

    def _run_trips(self, i: Any, after: dict) -> None:
        """The step's trips between the tiers, in order (none without a host tier)."""
        if self.host is None:
            return
        self.host.run(self.inner.take_copies())
        self._check_host(i, after)
        if self.states is not None:
            self.states.run(self.inner.take_state_copies())
        if self.swa is not None:
            self.swa.run(self.inner.take_swa_copies())

    # computing tokens ----------------------------------------------------------------------
    def _fps(self, extra_key: str | None, tokens: Sequence[int]) -> list[int]:
        key = (extra_key, tuple(tokens))
        fps = self._fp_cache.get(key)
        if fps is None:
            if len(self._fp_cache) > 4096:
                self._fp_cache.clear()
            fps = self._fp_cache[key] = fingerprints(extra_key, tokens)
        return fps

    def _compute(self, i: Any, extra_key: str | None, tokens: list, slots: list, start: int,
                 owned: set) -> None:
        """Positions ``start + k`` of ``tokens`` live in ``slots[k]``: write the fingerprints of
        those the tree did not own before this step, check the others."""
        fps = self._fps(extra_key, tokens)[start: start + len(slots)]
        size = self.kv.data.shape[1]
        # a slot outside the pool holds no KV (a bad caller's value the cache ignored)
        # a bad caller's value may be longer than its tokens: the slots past them hold nothing
        new = [(s, f) for s, f in zip(slots, fps, strict=False)
               if s not in owned and type(s) is int and 0 <= s < size]
        old = [(s, f) for s, f in zip(slots, fps, strict=False) if s in owned]
        if old:
            self._expect_pairs(i, "slots the tree already held", old)
        if new:
            self.kv.write([s for s, _ in new], [f for _, f in new])
            if self.swa is not None:  # the SWA layers' KV, into the mapped SWA slots
                swa = self.inner.swa_slots_of([s for s, _ in new])
                self.swa.device.update((w, f) for w, (_, f) in zip(swa, new, strict=True) if w)

    def _compute_state(self, args: dict, before: dict | None, obs: dict) -> None:
        """An insert whose state slot the tree took: the caller computed the state of its
        page-aligned tokens there (a slot the tree held before the step is never written)."""
        value = args.get("mamba_value")
        if obs.get("mamba_exist") or not isinstance(value, list) or len(value) != 1:
            return
        assert self.states is not None  # called only with the Mamba state pool
        held = {s for node in (before or {}).get("nodes", [])
                for s in ((node.get("mamba") or {}).get("value") or ())}
        if value[0] in held:
            return
        tokens = list(args["tokens"])
        ps = self.config.page_size
        if self.eagle:  # the node's path: its page-aligned bigram units, one token more
            n = max(0, len(tokens) - 1) // ps * ps
            n = n + 1 if n else 0
        else:
            n = len(tokens) // ps * ps
        if n:
            self.states.device[value[0]] = self._fps(args.get("extra_key"), tokens[:n])[-1]

    def _request_states(self, op: str, rid: Any, before: dict, obs: dict, after: dict) -> None:
        """Mamba, the request path: a running request's own state slot holds the state of its
        computed tokens (computed at admission from its prefix and at each chunk and decode
        step); a state slot the tree took in the step holds the request's state as it was
        cached (a chunk's copy, or at the finish the request's slot itself).  A tree slot for
        a cached length that is not the computed length (a chunk not page-aligned: the state
        is the whole computed length's, as upstream caches it) is taken as the node's path."""
        assert self.states is not None  # called only with the Mamba state pool
        was = {r["rid"]: r for r in before.get("requests", [])}
        now = {r["rid"]: r for r in after.get("requests", [])}
        req = now.get(rid) or was.get(rid)
        if req is None or rid not in self.tokens:
            return
        committed = req["committed"]
        tokens, ek = self._request_tokens(rid, committed)
        state = self._fps(ek, tokens[:committed])[-1] if committed else None
        own = now.get(rid, {}).get("mamba_slot")
        if op in ("req_admit", "req_chunk", "req_decode") and own is not None:
            self.states.device[own] = state
        held = {s for node in before.get("nodes", [])
                for s in ((node.get("mamba") or {}).get("value") or ())}
        if self.config.mamba_extra_buffer:  # the tracked states: written, never assumed
            held.update(self._track_states(op, was.get(rid), obs, now.get(rid)))
        held.difference_update(obs.get("mamba_freed", ()))  # (freed and taken again: new)
        for node in after.get("nodes", []):
            slots: list[int] = list((node.get("mamba") or {}).get("value") or ())
            if len(slots) != 1 or slots[0] in held:
                continue
            path = node["path"]
            if len(path["tokens"]) == committed and path["extra_key"] == ek:
                self.states.device[slots[0]] = state
            elif path["tokens"]:
                self.states.device[slots[0]] = self._fps(path["extra_key"], path["tokens"])[-1]

    def _track_states(self, op: str, was: dict | None, obs: dict,
                      now: dict | None = None) -> list[int]:
        """The Mamba extra buffer: a step's track points write the state at each track length
        into the track slot they name (spec/requests.py).  Returns the request's track slots
        before the step: a node that takes one of them (a chunk's hand-over, the finish) must
        hold what a track point wrote there, so it is checked, not computed.  Lazy, a decode
        step's track points each take a fresh slot (or, with none to be had, write the only
        one): the slot the request holds after the step holds the last one's state."""
        assert self.states is not None  # called only with the Mamba state pool
        slots = list((was or {}).get("mamba_track") or ())
        if not slots or op not in ("req_chunk", "req_decode") or not obs.get("ok", True):
            return slots
        assert was is not None
        c, n = was["committed"], self._last_n
        if op == "req_chunk":
            at = extend_track_len(c, n, self.config.mamba_cache_chunk_size,
                                  was.get("mamba_branching"))
            lengths = [] if at is None else [at]
        else:
            lengths = decode_track_lens(c, n, self.config.mamba_track_interval)
        tokens, ek = self._request_tokens(was["rid"], c + n)
        if self.config.mamba_extra_buffer_lazy and op == "req_decode":
            after = list((now or {}).get("mamba_track") or ())
            if lengths and after:
                self.states.device[after[0]] = self._fps(ek, tokens[:lengths[-1]])[-1]
            return slots + after
        k = was.get("mamba_next_track") or 0
        for at in lengths:
            self.states.device[slots[k]] = self._fps(ek, tokens[:at])[-1]
            k = next_track_after(k, len(slots))
        return slots

    _last_n = 0  # the step's ``n`` (req_chunk / req_decode), for _track_states

    def _compute_row(self, i: Any, rid: str, before: dict, obs: dict, after: dict) -> None:
        was = {r["rid"]: r for r in before.get("requests", [])}
        now = {r["rid"]: r for r in after.get("requests", [])}
        if rid not in now or rid not in self.tokens:
            return
        lo = was[rid]["committed"] if rid in was else 0
        hi = now[rid]["committed"]
        row = now[rid]["row"]
        tokens, ek = self._request_tokens(rid, hi)
        self._compute(i, ek, tokens[:hi], row[lo:hi], lo, _owned(before, obs))

    def _request_tokens(self, rid: str, n: int) -> tuple[list, str | None]:
        prompt, ek = self.tokens[rid]
        out = list(prompt)
        k = 0
        while len(out) < n:
            out.append(output_token_id(prompt, k))
            k += 1
        return out, ek

    # checking --------------------------------------------------------------------------------
    def _expect(self, i: Any, what: str, extra_key: str | None, tokens: list,
                slots: list) -> None:
        fps = self._fps(extra_key, tokens)[: len(slots)]
        bad = self.kv.first_wrong(slots, fps)
        if bad is not None:
            self.errors.append(f"[kv] step {i}: {what} (extra_key={extra_key!r}): slot "
                               f"{slots[bad]} at position {bad} does not hold that token's KV")

    def _expect_pairs(self, i: Any, what: str, pairs: list) -> None:
        slots = [s for s, _ in pairs]
        bad = self.kv.first_wrong(slots, [f for _, f in pairs])
        if bad is not None:
            self.errors.append(f"[kv] step {i}: {what}: slot {slots[bad]} does not hold the KV "
                               "of the token it was handed over for")

    def _check_state(self, i: Any, snap: dict) -> None:
        """Every cached node's slots and every running request's computed row (as ``snap``,
        the adapter's snapshot after the step, shows them), in one batch.  Skipped when the
        last check found all of them right and neither they nor the pool changed since."""
        seen = (snap.get("nodes"), snap.get("requests"), self._arrivals, self.kv.memo.writes)
        if seen == self._clean_state and ReadMemo.remember:
            return
        self._clean_state = None
        slots: list = []
        fps: list = []
        owners: list = []  # (first index in slots, description)
        for node in snap.get("nodes", []):
            value = node.get("value")
            if not value:
                continue
            path = node["path"]
            tokens = path["tokens"]
            units = len(tokens) - 1 if self.eagle and tokens else len(tokens)
            start = units - len(value)
            owners.append((len(slots), start, path))  # (described only on a finding)
            slots.extend(value)
            fps.extend(self._fps(path["extra_key"], tokens)[start: units])
        for req in snap.get("requests", []):
            rid = req["rid"]
            n = req["committed"]
            if rid not in self.tokens or not n:
                continue
            tokens, ek = self._request_tokens(rid, n)
            owners.append((len(slots), 0, rid))
            slots.extend(req["row"][:n])
            fps.extend(self._fps(ek, tokens)[:n])
        bad = self.kv.first_wrong(slots, fps)
        if bad is not None:
            at, start, who = max((o for o in owners if o[0] <= bad), key=lambda o: o[0])
            what = f"request {who!r} row" if isinstance(who, str) else f"node {_short_path(who)}"
            self.errors.append(f"[kv] step {i}: {what} holds slot {slots[bad]} at position "
                               f"{start + bad - at}, which does not hold that token's KV")
        else:
            self._clean_state = seen


    def _check_states(self, i: Any, snap: dict) -> None:
        """Every node's state slot (and host state slot) holds the state of the node's path."""
        assert self.states is not None  # called only with the Mamba state pool
        for node, where, pool in _aux_parts(snap, "mamba", self.states):
            data = node.get("mamba") or {}
            path = node["path"]
            want = self._fps(path["extra_key"], path["tokens"])[-1] if path["tokens"] else None
            slots: list[int] = list(data.get(where) or ())
            if len(slots) == 1 and pool.get(slots[0]) != want:
                self.errors.append(f"[kv] step {i}: node {_short_path(path)} holds "
                                   f"{'host ' if where == 'host_value' else ''}state slot "
                                   f"{slots[0]}, which does not hold the state of its path")

    def _check_swa(self, i: Any, snap: dict) -> None:
        """Every node's SWA slots (and SWA host slots) hold the fingerprints of their
        positions."""
        assert self.swa is not None  # called only with the SWA pool
        for node, where, pool in _aux_parts(snap, "swa", self.swa):
            data = node.get("swa") or {}
            path = node["path"]
            tokens = path["tokens"]
            units = len(tokens) - 1 if self.eagle and tokens else len(tokens)
            slots: list[int] = list(data.get(where) or ())
            fps = self._fps(path["extra_key"], tokens)[units - len(slots): units]
            bad = next((k for k, (w, f) in enumerate(zip(slots, fps, strict=True))
                        if pool.get(w) != f), None)
            if bad is not None:
                self.errors.append(
                    f"[kv] step {i}: node {_short_path(path)} holds "
                    f"{'host ' if where == 'host_value' else ''}SWA slot {slots[bad]} at "
                    f"position {units - len(slots) + bad}, which does not hold that "
                    "token's SWA KV")
                return

    def _check_host(self, i: Any, snap: dict) -> None:
        """Every node's host copy holds the fingerprints of its path (skipped as
        :meth:`_check_state` is)."""
        assert self.host is not None  # called only with a host tier
        seen = (snap.get("host", {}).get("nodes"), self.host.memo.writes)
        if seen == self._clean_host and ReadMemo.remember:
            return
        self._clean_host = None
        slots: list = []
        fps: list = []
        owners: list = []
        for node in snap.get("host", {}).get("nodes", []):
            host_value = node.get("host_value")
            if not host_value:
                continue
            path = node["path"]
            tokens = path["tokens"]
            # under EAGLE the path is the node's bigram units plus one token (as on the device)
            units = len(tokens) - 1 if self.eagle and tokens else len(tokens)
            start = units - len(host_value)
            owners.append((len(slots), start, path))
            slots.extend(host_value)
            fps.extend(self._fps(path["extra_key"], tokens)[start: units])
        k = self.host.first_wrong(slots, fps) if slots else None
        if k is not None:
            at, start, path = max((o for o in owners if o[0] <= k), key=lambda o: o[0])
            self.errors.append(f"[kv] step {i}: node {_short_path(path)} holds host slot "
                               f"{slots[k]} at position {start + k - at}, which does not hold "
                               "that token's KV")
        else:
            self._clean_host = seen


def _aux_parts(snap: dict, name: str, pools: StatePool) -> list[tuple[dict, str, dict]]:
    """``(node entry, field, pool)`` for every node's device data of the aux component ``name``
    (the snapshot's nodes, ``value``) and its host copy (the host view's nodes,
    ``host_value``)."""
    out = [(node, "value", pools.device) for node in snap.get("nodes", [])]
    out += [(node, "host_value", pools.host) for node in snap.get("host", {}).get("nodes", [])]
    return out


# the request steps that move Mamba states (KVChecked._request_states)
REQUEST_STATE_OPS = ("req_admit", "req_chunk", "req_decode", "req_finish")


def _owned(snap: dict | None, obs: dict) -> set:
    """Slots the tree held before the step and kept through it: a slot it freed during the
    step (an eviction to make room) may come back as a fresh slot, computed anew."""
    if snap is None:
        return set()
    held = {s for node in snap.get("nodes", []) for s in (node.get("value") or ())}
    return held.difference(obs.get("freed", ()))


def _short_path(path: dict) -> str:
    t = path["tokens"]
    shown = t if len(t) <= 8 else t[:8] + ["..."]
    return f"{{tokens={shown} ({len(t)}), extra_key={path['extra_key']!r}}}"


def kv_checked(impl: Any) -> Callable[[CacheConfig], KVChecked]:
    """An implementation factory (``config -> adapter``) for lockstep runs and replays: ``impl``
    (a name for ``make_adapter`` or a factory) wrapped in :class:`KVChecked`."""
    from uniradix.conformance.adapters.base import make_adapter

    def build(config: CacheConfig) -> KVChecked:
        inner = make_adapter(impl, config) if isinstance(impl, str) else impl(config)
        return KVChecked(inner, config)

    name = impl if isinstance(impl, str) else getattr(impl, "impl_name", "impl")
    build.impl_name = name  # type: ignore[attr-defined]
    build.kv_wrapped = impl  # type: ignore[attr-defined]  # conform --slot-ledger rewraps it
    return build
