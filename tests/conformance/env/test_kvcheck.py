"""KV integrity mode (conformance/env/kvcheck.py): fingerprints, the checked lockstep run, and
planted slot mix-ups that lockstep alone cannot see (both sides share the bug)."""

import glob
import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import CORPUS  # noqa: E402
from uniradix.conformance.cli import main as cli_main  # noqa: E402
from uniradix.conformance.env.kvcheck import KVPool, fingerprints, kv_checked, slot_contents  # noqa: E402
from uniradix.conformance.explore.conform import run_conform  # noqa: E402
from uniradix.conformance.explore.lockstep import VIOLATION  # noqa: E402


def test_fingerprints_name_the_extra_key_and_the_whole_prefix():
    a = fingerprints(None, [5, 6, 7])
    assert len(a) == 3 and len(set(a)) == 3
    assert fingerprints(None, [5, 6, 7]) == a  # deterministic
    assert fingerprints(None, [5, 6]) == a[:2]  # a prefix's fingerprints are a prefix
    assert fingerprints("x", [5, 6, 7])[0] != a[0]  # the namespace counts
    assert fingerprints(None, [4, 6, 7])[2] != a[2]  # so does every earlier token
    assert fingerprints(None, [7])[0] != a[2]  # and the position


def test_pool_starts_poisoned_and_holds_exact_contents():
    pool = KVPool(8)
    fps = fingerprints("ns", [1, 2, 3])
    assert all(math.isnan(v) for v in pool.data.flatten().tolist())
    assert pool.first_wrong([3, 5], fps[:2]) == 0  # never written: NaN
    pool.write([3, 5, 6], fps)
    assert pool.first_wrong([3, 5, 6], fps) is None
    assert pool.first_wrong([3, 6, 5], fps) == 1  # two slots swapped
    assert (pool.data[:, [3, 5, 6]] == slot_contents(fps)).all()
    # every element of a slot is pinned down: one flipped element is seen (whatever writes
    # the pool tells its read memo, which otherwise knows slot 5 holds fps[1])
    pool.data[1, 5, 3, 7] += 1
    pool.memo.forget([5])
    assert pool.first_wrong([3, 5, 6], fps) == 1
    # the other slots stay poisoned
    untouched = [s for s in range(8) if s not in (3, 5, 6)]
    assert np.isnan(pool.data[:, untouched]).all()


def test_a_write_makes_the_check_read_the_slot_again():
    """The read memo skips only pairs it has found right since the slot's last write."""
    pool = KVPool(8)
    fps = fingerprints(None, [4, 5, 6])
    pool.write([2, 3, 4], fps)
    assert pool.first_wrong([2, 3, 4], fps) is None  # read, and learnt
    assert pool.first_wrong([2, 3, 4], fps) is None  # known
    assert pool.first_wrong([3, 2, 4], fps) == 0  # a known slot asked for another fingerprint
    pool.write([3], fps[:1])  # slot 3 now holds the first token's KV
    assert pool.first_wrong([2, 3, 4], fps) == 1
    assert pool.first_wrong([2, 3, 4], [fps[0], fps[0], fps[2]]) is None  # what it holds now


def test_spec_and_fast_keep_every_slot_right_across_configs():
    res = run_conform([kv_checked("spec"), kv_checked("fast")], steps=2000, seed=5, out=None,
                      progress=False, log=lambda m: None)
    assert res.finding is None, str(res.finding)
    assert res.steps == 2000


def _swap_first_two(monkeypatch):
    # on the C core's class and on the composed tree (where fast runs a Full config whose KV
    # events conform compares)
    import uniradix.fast.cache as fc
    import uniradix.fast.hybrid as fh
    for cls in (fc.UnifiedRadixCache, fh.HybridRadixCache):
        orig = cls.match_prefix

        def swapped(self, params, orig=orig):
            r = orig(self, params)
            idx = r.device_indices
            if len(idx) >= 2:
                idx = idx.clone()
                idx[[0, 1]] = idx[[1, 0]]
                r = r._replace(device_indices=idx)
            return r

        monkeypatch.setattr(cls, "match_prefix", swapped)


def _reversed_row_write(monkeypatch):
    from uniradix.conformance.adapters import fast_adapter

    orig = fast_adapter.ReqToTokenPool.write

    def reversed_write(self, where, values):
        orig(self, where, values.flip(0))

    monkeypatch.setattr(fast_adapter.ReqToTokenPool, "write", reversed_write)


# (a planted bug, whether only tree-level ops run): a swapped match result matters only to
# requests, whose later steps then go wrong visibly, so it is planted in a tree-only run
@pytest.mark.parametrize("plant, tree_only", [(_swap_first_two, True),
                                              (_reversed_row_write, False)])
def test_a_shared_slot_mixup_is_found_only_by_the_kv_check(monkeypatch, tmp_path, plant,
                                                           tree_only):
    plant(monkeypatch)
    # both sides carry the bug: lockstep alone sees nothing
    plain = run_conform(["fast", "fast"], steps=1500, seed=1, out=None, progress=False,
                        log=lambda m: None, tree_only=tree_only)
    assert plain.finding is None
    res = run_conform([kv_checked("fast"), kv_checked("fast")], steps=1500, seed=1,
                      out=str(tmp_path), progress=False, log=lambda m: None,
                      tree_only=tree_only)
    assert res.finding is not None and res.finding.kind == VIOLATION
    assert (res.finding.where, res.finding.path) == ("violations", "kv")
    # the shrunk trace replays the problem under --check-kv, and not without it
    trace = res.trace_path
    assert trace is not None and os.path.exists(trace)
    assert cli_main(["replay", trace, "--impl", "fast", "--check-kv"]) == 1
    assert cli_main(["replay", trace, "--impl", "fast"]) == 0


def _overwrite_the_last_backup(monkeypatch, after=25):
    """A planted host-tier bug on the spec: from the ``after``-th backup on, a backup also copies
    its first page's KV over the first page of the backup before it, on the host and on the
    device, and a load back copies the page it loads over that host page too.  The slots it
    spoils belong to another node, whose slots did not change: only a check that reads what a
    copy wrote sees it."""
    from uniradix.conformance.adapters.host_ops import SpecHostOps

    orig = SpecHostOps.take_copies
    seen: dict = {}  # id(adapter) -> [backups so far, (src, dst) of the last one]

    def overwriting(self):
        ps = self.config.page_size
        mine = seen.setdefault(id(self), [0, None])
        out = []
        for kind, src, dst in orig(self):
            out.append((kind, src, dst))
            if not src:
                continue
            mine[0] += kind == "backup"
            if mine[0] >= after and mine[1] is not None:
                last_src, last_dst = mine[1]
                if kind == "backup":
                    out.append(("backup", src[:ps], last_dst[:ps]))
                    out.append(("load", dst[:ps], last_src[:ps]))
                else:
                    out.append(("backup", dst[:ps], last_dst[:ps]))
            if kind == "backup":
                mine[1] = (src, dst)
        return out

    monkeypatch.setattr(SpecHostOps, "take_copies", overwriting)


def test_the_read_memo_changes_no_finding(monkeypatch):
    """The checks read only slots that may have changed since they were found right
    (ReadMemo), and skip a check whose nodes and pool did not change: a bug that spoils slots
    of nodes that did not change gives the same first finding, step and message, as reading
    every slot on every step."""
    from uniradix.conformance.env.kvcheck import ReadMemo
    found = []
    for remember in (True, False):
        with monkeypatch.context() as m:
            _overwrite_the_last_backup(m)
            m.setattr(ReadMemo, "remember", remember)
            res = run_conform([kv_checked("spec"), kv_checked("spec")], config="hicache-wt-p4",
                              steps=800, seed=1, out=None, progress=False, log=lambda m: None,
                              shrink_seconds=0)
        assert res.finding is not None and res.finding.path == "kv", str(res.finding)
        found.append((res.steps, res.finding.to_dict()))
    assert found[0] == found[1]


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_upstream_corpus_keeps_every_slot_right(impl, capsys):
    traces = sorted(glob.glob(os.path.join(CORPUS, "upstream", "*.jsonl")))[:2]
    assert traces
    assert cli_main(["replay", *traces, "--impl", impl, "--check-kv"]) == 0
    assert "0 divergences" in capsys.readouterr().out


def _swap_state_copies(monkeypatch):
    """A planted host-tier bug on the spec: every load of a Mamba state reads the host state
    slot after the right one (the tree's slot numbers all stay right)."""
    from uniradix.spec import components

    orig = components.MambaComponent.commit_load_back

    def shifted(self, state, node):
        before = len(state.host.mamba_copies)
        orig(self, state, node)
        for i in range(before, len(state.host.mamba_copies)):  # the node's and the requester's
            kind, src, dst = state.host.mamba_copies[i]
            state.host.mamba_copies[i] = (kind, [src[0] + 1], dst)

    monkeypatch.setattr(components.MambaComponent, "commit_load_back", shifted)


def test_host_mamba_states_keep_their_sequence_through_host_trips():
    res = run_conform([kv_checked("spec"), kv_checked("spec")], config="host-mamba-wb-p4",
                      steps=800, seed=4, out=None, progress=False, log=lambda m: None)
    assert res.finding is None, str(res.finding)


def test_a_state_mixup_on_the_host_trip_is_found_by_the_kv_check(monkeypatch):
    _swap_state_copies(monkeypatch)
    plain = run_conform(["spec", "spec"], config="host-mamba-wb-p4", steps=600, seed=4,
                        out=None, progress=False, log=lambda m: None)
    assert plain.finding is None
    res = run_conform([kv_checked("spec"), kv_checked("spec")], config="host-mamba-wb-p4",
                      steps=600, seed=4, out=None, progress=False, log=lambda m: None,
                      shrink_seconds=5)
    assert res.finding is not None and res.finding.kind == VIOLATION
    assert "state slot" in str(res.finding)


HOST_SWA_TRACE = os.path.join(CORPUS, "upstream-host-swa", "host-swa-wb-p1-s016.jsonl")


def _reverse_swa_loads(monkeypatch):
    """A planted host-tier bug on the spec: every load back of SWA data copies the window's
    SWA host slots in reverse order (the tree's slot numbers all stay right)."""
    from uniradix.spec import components

    orig = components.SWAComponent.commit_load_back

    def reversed_loads(self, state, node):
        before = len(state.host.swa_copies)
        orig(self, state, node)
        for i in range(before, len(state.host.swa_copies)):
            kind, src, dst = state.host.swa_copies[i]
            state.host.swa_copies[i] = (kind, src[::-1], dst)

    monkeypatch.setattr(components.SWAComponent, "commit_load_back", reversed_loads)


def test_host_swa_data_keeps_its_tokens_through_host_trips():
    """The SWA pool is checked (device and host) through backups, host eviction and load backs
    of the golden trace; a checked conform run of write-back pages 4 is clean too."""
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.env.kvcheck import KVChecked
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(HOST_SWA_TRACE)
    checked = KVChecked(make_adapter("spec", trace.config), trace.config)
    for step in trace.steps:
        checked.apply(step)
        assert checked.violations() == [], step["i"]
    assert checked.swa is not None and checked.swa.host and checked.swa.device
    res = run_conform([kv_checked("spec"), kv_checked("spec")], config="host-swa-wb-p4",
                      steps=300, seed=4, out=None, progress=False, log=lambda m: None)
    assert res.finding is None, str(res.finding)


def test_an_swa_mixup_on_the_host_trip_is_found_by_the_kv_check(monkeypatch, capsys):
    _reverse_swa_loads(monkeypatch)
    assert cli_main(["replay", HOST_SWA_TRACE, "--impl", "spec"]) == 0
    assert cli_main(["replay", HOST_SWA_TRACE, "--impl", "spec", "--check-kv"]) == 1
    assert "SWA slot" in capsys.readouterr().out


EAGLE_HOST_TRACE = os.path.join(CORPUS, "regressions",
                                "kvcheck-eagle-host-p2-host-copy-of-the-bigram-path.jsonl")


def _eagle_host_checked(impl: str):
    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.env.kvcheck import KVChecked
    from uniradix.conformance.traces.trace import load_trace
    trace = load_trace(EAGLE_HOST_TRACE)
    return trace, KVChecked(make_adapter(impl, trace.config), trace.config)


@pytest.mark.parametrize("impl", ["spec", "fast"])
def test_eagle_host_copies_are_checked_at_their_bigram_positions(impl):
    """Under EAGLE a node's host copy holds its bigram units' KV (its path minus the last
    token), as its device slots do: the backup at the insert is right."""
    trace, checked = _eagle_host_checked(impl)
    for step in trace.steps:
        checked.apply(step)
        assert checked.violations() == [], step["i"]
    assert checked.host is not None


def test_a_write_since_the_last_clean_check_is_read_whatever_the_nodes():
    """A check of the same nodes over a pool nothing wrote since is skipped; a write in
    between (a copy, or a token computed) makes the next check read again, on the host and on
    the device, though the nodes are the same."""
    trace, checked = _eagle_host_checked("spec")
    for step in trace.steps:
        checked.apply(step)
    assert checked.violations() == []
    snap = checked.snapshot()
    node = next(n for n in snap["host"]["nodes"] if n["host_value"])
    checked._check_host(100, snap)
    assert checked.violations() == []  # (skipped: nothing changed)
    assert checked.host is not None
    ps = trace.config.page_size
    checked.host.run([("fetch", ["never-stored"], node["host_value"][:ps])])  # NaN, no key
    checked._check_host(101, snap)
    assert any("step 101" in e and "holds host slot" in e for e in checked.violations())
    node = next(n for n in snap["nodes"] if n["value"])
    checked._check_state(102, snap)
    assert not any("step 102" in e for e in checked.violations())
    checked.kv.write(node["value"][:1], [12345])
    checked._check_state(103, snap)
    assert any("step 103" in e and "holds slot" in e for e in checked.violations())


def test_an_eagle_host_copy_mixup_is_found_by_the_kv_check():
    trace, checked = _eagle_host_checked("spec")
    take = checked.inner.take_copies

    ps = trace.config.page_size

    def reversed_backups():  # each backup writes its pages in reverse order
        def pages_reversed(slots):
            pages = [slots[k: k + ps] for k in range(0, len(slots), ps)]
            return [s for page in reversed(pages) for s in page]
        return [(kind, src, pages_reversed(dst) if kind == "backup" else dst)
                for kind, src, dst in take()]

    checked.inner.take_copies = reversed_backups
    for step in trace.steps:
        checked.apply(step)
    assert any("holds host slot" in e for e in checked.violations())


MAMBA_REQUEST_TRACES = [os.path.join(CORPUS, "regressions", name) for name in (
    "conform-mamba-request-chunk-state-copy-kv.jsonl",
    "conform-full-swa-mamba-p4-request-chunk-state-slot-reused-kv.jsonl")]


@pytest.mark.parametrize("impl", ["spec", "fast"])
@pytest.mark.parametrize("trace", MAMBA_REQUEST_TRACES, ids=os.path.basename)
def test_mamba_request_states_are_followed_by_the_kv_check(trace, impl, capsys):
    """The request path with Mamba: a prefill chunk caches a copy of the request's state (the
    state of its computed tokens) in a fresh slot; the check follows it (before, that slot was
    never computed and the check failed on spec and fast alike; the second trace: the copy's
    slot is a state the chunk's own room-making evicted)."""
    assert cli_main(["replay", trace, "--impl", impl, "--check-kv"]) == 0

