"""The conform shrinker (conformance/explore/lockstep.py ``shrink``): it keeps the finding it
was given (the same kind, op, check, field or invariant) and runs its trials with the KV-events
setting of the run that found it."""

from __future__ import annotations

import math

import pytest

from uniradix.conformance.adapters.base import SpecAdapter
from uniradix.conformance.explore import conform as conform_mod
from uniradix.conformance.explore.lockstep import Finding, run_steps, shrink
from uniradix.spec.config import CacheConfig


class TwoBugs(SpecAdapter):
    """Two broken invariants, both seen after a match: ``alpha`` after a match of three or more
    tokens, ``beta`` after a match of none."""

    last_match: int | None = None

    def op_match_prefix(self, step):
        obs = super().op_match_prefix(step)
        self.last_match = len(obs["device_indices"])
        return obs

    def violations(self):
        out = list(super().violations())
        if self.last_match == 0:
            out.append("[beta] a match of no token")
        if self.last_match is not None and self.last_match >= 3:
            out.append("[alpha] a match of three tokens or more")
        return out


def test_shrinking_keeps_the_invariant_it_was_given():
    """Dropping the insert turns the match's alpha into beta: another finding, which the shrinker
    must not take for the one it shrinks (it did: every violation at the op counted)."""
    config = CacheConfig(page_size=1, kv_slots=16)
    steps = [{"i": 0, "op": "alloc", "args": {"n": 3}},
             {"i": 1, "op": "insert", "args": {"tokens": [1, 2, 3], "value": [1, 2, 3]}},
             {"i": 2, "op": "match_prefix", "args": {"tokens": [1, 2, 3]}}]
    finding = run_steps(["spec", TwoBugs], config, steps)
    assert finding is not None and (finding.where, finding.path) == ("violations", "alpha")
    sr = shrink(["spec", TwoBugs], config, steps, finding, max_seconds=math.inf)
    assert sr.finding.signature() == finding.signature()
    assert [s["op"] for s in sr.steps][-2:] == ["insert", "match_prefix"]


def test_the_signature_names_the_field_and_the_invariant():
    def finding(where, path, kind="divergence"):
        return Finding(kind, 5, "evict", where, path, {}, ("spec", "fast"))
    lock = finding("snapshot", "nodes[extra_key=None tokens=[1, 2]].lock_ref")
    assert lock.signature() == finding("snapshot", "nodes[extra_key='a' tokens=[7]].lock_ref"
                                       ).signature()
    assert lock.signature() != finding("snapshot", "nodes[extra_key=None tokens=[1, 2]].hit_count"
                                       ).signature()
    assert finding("observation", "freed[1]").signature() == \
        finding("observation", "freed[3]").signature()
    assert finding("violations", "lock", "violation").signature() != \
        finding("violations", "size", "violation").signature()


def _drop_the_last_slot_of_long_matches_on_the_plain_tree(monkeypatch, tokens=8):
    """A bug in fast's Full-only tree (the C core) only, not in the composed tree its KV
    events run on: a match of ``tokens`` or more loses its last slot."""
    import uniradix.fast.cache as fc

    orig = fc.UnifiedRadixCache.match_prefix

    def dropped(self, params):
        r = orig(self, params)
        if len(r.device_indices) >= tokens:
            r = r._replace(device_indices=r.device_indices[:-1])
        return r

    monkeypatch.setattr(fc.UnifiedRadixCache, "match_prefix", dropped)


def test_trials_keep_the_segments_events_setting(monkeypatch, tmp_path):
    """A segment without KV events runs fast's Full-only cache on its C core; trials that turned
    events on ran it on the composed tree, where the bug is not, and shrank nothing."""
    pytest.importorskip("torch")
    _drop_the_last_slot_of_long_matches_on_the_plain_tree(monkeypatch)
    res = conform_mod.run_conform(["spec", "fast"], config="full-p1", steps=1500, seed=2,
                                  events="off", tree_only=True, out=str(tmp_path), progress=False,
                                  shrink_seconds=math.inf, log=lambda m: None)
    assert res.finding is not None and res.finding.where == "observation", str(res.finding)
    assert res.shrunk_steps is not None and res.shrunk_steps <= 12
