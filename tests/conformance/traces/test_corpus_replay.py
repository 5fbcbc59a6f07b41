"""Every committed trace replays on the spec and on the fast path (with and without its slot
ledger) with 0 divergences and sound invariants after every step (the golden corpus recorded
from upstream, and the regression traces), except the known divergences at one listed step
each (issue 18, docs/SPEC.md)."""

import glob
import os

import pytest

from conftest import CORPUS
from corpus_checks import check_divergence
from uniradix.conformance.run import AWAITING_SPEC_REASON, is_awaiting_spec, is_spec_only
from uniradix.conformance.traces.replay import KNOWN_DIVERGENCES, replay_trace
from uniradix.conformance.traces.trace import load_trace

# Traces under other eviction policies than lru and of Mamba copy-on-write
# replay in tests/spec/test_spec_policies.py and tests/spec/test_spec_mamba_cow.py
# (the fast path refuses them until it models them; the one
# list of those folders is uniradix.conformance.run.SPEC_ONLY_CORPORA, which `uniradix run` reads too).
# These corpora replay on spec and fast in their own files, a seed subset in the default suite
# and every trace behind `slow`: tests/corpus/upstream-policies in tests/spec/test_spec_policies.py
# and tests/fast/test_fast_policies.py, the storage corpus in
# tests/conformance/traces/test_storage_corpus.py, tests/corpus/upstream-host-swa in
# tests/conformance/traces/test_host_swa_corpus.py, tests/corpus/upstream-mamba-requests (with
# the KV check) in tests/conformance/traces/test_mamba_requests_corpus.py.
OWN_FILES = ("upstream-policies", "upstream-storage", "upstream-host-swa",
             "upstream-mamba-requests")
ALL_TRACES = sorted(t for t in glob.glob(os.path.join(CORPUS, "**", "*.jsonl"), recursive=True)
                    if not is_spec_only(t)
                    and not any(os.sep + d + os.sep in t for d in OWN_FILES))
# tests/corpus/upstream-events-hybrid replays one seed per config in the default suite, the rest
# behind `slow` (its events are checked against upstream's in tests/conformance/traces/test_events_corpus.py)
SLOW_TRACES = [t for t in ALL_TRACES if os.sep + "upstream-events-hybrid" + os.sep in t
               and not t.endswith("-s002.jsonl")]
TRACES = [t for t in ALL_TRACES if t not in SLOW_TRACES]


def test_corpus_is_there():
    upstream = [t for t in TRACES if os.sep + "upstream" + os.sep in t]
    assert len(upstream) >= 40, f"expected >= 40 upstream traces, found {len(upstream)}"
    for t in upstream:
        assert len(load_trace(t).steps) >= 300, t


@pytest.mark.parametrize("folder, prefixes", [
    ("upstream-swa", ("swa-w8-p1-", "swa-w8-p4-", "swa-w32-p1-")),
    ("upstream-mamba", ("mamba-p1-",)),
])
def test_hybrid_corpora_are_there(folder, prefixes):
    """Golden traces of hybrid models: at least 20 per config, each of at least 300 steps."""
    names = [os.path.basename(t) for t in TRACES if os.sep + folder + os.sep in t]
    for prefix in prefixes:
        mine = [n for n in names if n.startswith(prefix)]
        assert len(mine) >= 20, f"{folder}: {len(mine)} traces {prefix}*"
    for t in TRACES:
        if os.sep + folder + os.sep in t:
            assert len(load_trace(t).steps) >= 300, t


def test_host_tier_corpus_is_there():
    """At least 20 upstream traces for each of write-through / write-back, pages 1 and 4."""
    base = os.path.join(CORPUS, "upstream-hicache")
    for cfg in ("hicache-wt-p1", "hicache-wt-p4", "hicache-wb-p1", "hicache-wb-p4"):
        found = glob.glob(os.path.join(base, f"{cfg}-s*.jsonl"))
        assert len(found) >= 20, f"{cfg}: {len(found)} traces"
        for t in found:
            trace = load_trace(t)
            assert trace.config.has_host_tier and len(trace.steps) >= 300, t


def test_sessions_corpus_is_there():
    """At least 10 upstream session traces per page size (1 and 4), each of at least 300
    steps, with session turns in them."""
    for cfg in ("sessions-p1", "sessions-p4"):
        found = glob.glob(os.path.join(CORPUS, "upstream-sessions", f"{cfg}-s*.jsonl"))
        assert len(found) >= 10, f"{cfg}: {len(found)} traces"
        for t in found:
            steps = load_trace(t).steps
            assert len(steps) >= 300, t
            assert any(s["op"] == "req_arrive" and s["args"].get("session") for s in steps), t


@pytest.mark.parametrize("impl", ["spec", "fast"])
@pytest.mark.parametrize("path", TRACES, ids=[os.path.relpath(t, CORPUS) for t in TRACES])
def test_replay(path, impl):
    if is_awaiting_spec(path):
        pytest.skip(AWAITING_SPEC_REASON)
    trace = load_trace(path)
    result = replay_trace(trace, impl)
    assert result.unsupported is None, result.unsupported
    check_divergence(path, trace, result)


def _ledger_only_refusal(trace) -> bool:
    """Whether the reference refused an insert: without a slot ledger such a step (slots the
    caller was never given, or outside the pool, in a shrunk trace) may be taken."""
    return any(s["op"] == "insert" and "error" in (s.get("ret") or {}) for s in trace.steps)


@pytest.mark.parametrize("path", TRACES, ids=[os.path.relpath(t, CORPUS) for t in TRACES])
def test_replay_without_slot_ledger(path):
    """The fast path without its slot ledger (``fast-noledger``: how it runs over sglang's
    allocators), where its C inserts and Mamba's direct frees run instead of declining."""
    if is_awaiting_spec(path):
        pytest.skip(AWAITING_SPEC_REASON)
    trace = load_trace(path)
    if _ledger_only_refusal(trace):
        pytest.skip("the reference refuses an insert (it may be a slot misuse only the ledger refuses)")
    result = replay_trace(trace, "fast-noledger")
    assert result.unsupported is None, result.unsupported
    check_divergence(path, trace, result)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["spec", "fast"])
@pytest.mark.parametrize("path", SLOW_TRACES, ids=[os.path.relpath(t, CORPUS) for t in SLOW_TRACES])
def test_replay_slow(path, impl):
    test_replay(path, impl)


def test_known_divergences_are_corpus_traces():
    for rel in KNOWN_DIVERGENCES:
        assert os.path.exists(os.path.join(CORPUS, *rel.split("/"))), rel


def test_spec_only_folders_are_the_ones_fast_refuses():
    """`uniradix run` and this file skip exactly these folders on fast: each exists, and each
    of its traces is refused by fast at some step (so the list cannot hide a supported one)."""
    from uniradix.conformance.run import SPEC_ONLY_CORPORA
    everything = glob.glob(os.path.join(CORPUS, "**", "*.jsonl"), recursive=True)
    for folder in SPEC_ONLY_CORPORA:
        traces = sorted(t for t in everything
                        if os.sep + folder + os.sep in t or os.path.basename(t) == folder)
        assert traces, f"no traces under tests/corpus/{folder}"
        assert all(is_spec_only(t) for t in traces)
        r = replay_trace(load_trace(traces[0]), "fast")
        refused = r.unsupported is not None or (
            r.divergence is not None and "Unsupported" in str(r.divergence))
        assert refused, f"fast replays {traces[0]}: take {folder} off SPEC_ONLY_CORPORA"
    assert not any(is_spec_only(t) for t in TRACES)


@pytest.mark.parametrize("folder, aux", [("upstream-host-swa", "swa"),
                                         ("upstream-host-mamba", "mamba")])
def test_host_aux_corpora_are_there(folder, aux):
    """Golden traces of the host tier with SWA / Mamba: at least 20 per config (write-through
    and write-back, pages 1 and 4), each of at least 300 steps. Both replay on the spec and on
    fast: the SWA ones in tests/conformance/traces/test_host_swa_corpus.py, the Mamba ones in
    test_replay here."""
    base = os.path.join(CORPUS, folder)
    for cfg in (f"host-{aux}-{wp}-p{ps}" for wp in ("wt", "wb") for ps in (1, 4)):
        found = glob.glob(os.path.join(base, f"{cfg}-s*.jsonl"))
        assert len(found) >= 20, f"{cfg}: {len(found)} traces"
        for t in found:
            trace = load_trace(t)
            assert trace.config.has_host_tier and aux in trace.config.components, t
            assert len(trace.steps) >= 300, t
            assert not is_spec_only(t) and not is_awaiting_spec(t), t


def test_full_swa_mamba_corpus_is_there():
    """Golden traces of Full+SWA+Mamba in one tree: at least 20 per page size (1, 4), each of
    at least 300 steps, replayed on the spec and on fast (test_replay here)."""
    base = os.path.join(CORPUS, "upstream-full-swa-mamba")
    for cfg in ("full-swa-mamba-p1", "full-swa-mamba-p4"):
        found = glob.glob(os.path.join(base, f"{cfg}-s*.jsonl"))
        assert len(found) >= 20, f"{cfg}: {len(found)} traces"
        for t in found:
            assert not is_spec_only(t) and not is_awaiting_spec(t), t
            with open(t, encoding="utf-8") as f:
                lines = [ln for ln in f if ln.strip()]
            assert '"components":["full","swa","mamba"]' in lines[0], t
            assert len(lines) - 1 >= 300, t


def test_awaiting_spec_entries_exist():
    """Every AWAITING_SPEC entry names a folder or trace that is there (a stale entry would
    hide nothing, but says something false)."""
    from uniradix.conformance.run import AWAITING_SPEC
    everything = glob.glob(os.path.join(CORPUS, "**", "*.jsonl"), recursive=True)
    for entry in AWAITING_SPEC:
        assert any(is_awaiting_spec(t) and (os.sep + entry + os.sep in t or t.endswith(os.sep + entry))
                   for t in everything), f"AWAITING_SPEC entry {entry!r} matches no trace"
