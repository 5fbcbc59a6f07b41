"""The ``uniradix`` command line: exit codes and the summary line of ``replay``."""

import json
import os
import subprocess
import sys

from conftest import CORPUS

UPSTREAM = os.path.join(CORPUS, "upstream")
FIRST = os.path.join(UPSTREAM, sorted(f for f in os.listdir(UPSTREAM) if f.endswith(".jsonl"))[0])


def uniradix(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "uniradix.conformance.cli", *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_replay_clean_trace_exits_0():
    r = uniradix("replay", FIRST, "--impl", "spec")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("replayed ") and lines[-1].endswith(" in 1 traces: 0 divergences")


def test_replay_divergence_exits_1_and_names_everything(tmp_path):
    lines = open(FIRST).read().splitlines()
    header, steps = lines[0], [json.loads(x) for x in lines[1:]]
    # Corrupt the first recorded prefix_len of an insert.
    k = next(i for i, s in enumerate(steps) if s["op"] == "insert")
    steps[k]["ret"]["prefix_len"] += 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(header + "\n" + "\n".join(json.dumps(s) for s in steps) + "\n")
    r = uniradix("replay", str(bad), "--impl", "spec")
    assert r.returncode == 1
    out = r.stdout.strip().splitlines()
    assert "bad.jsonl" in out[0] and f"step {steps[k]['i']}" in out[0]
    assert "'prefix_len'" in out[0] and "expected" in out[0] and "actual" in out[0]
    assert out[-1] == f"replayed {k + 1} steps in 1 traces: 1 divergences"


def test_unsupported_config_is_reported(tmp_path):
    # the spec and fast model every config the trace format has; upstream's adapter refuses
    # Mamba at page 2 from its declared capabilities, before sglang is even imported
    t = tmp_path / "mamba-p2.jsonl"
    t.write_text(json.dumps({"format": "uniradix-trace", "version": 1, "source": "test",
                             "config": {"components": ["full", "mamba"], "mamba_slots": 4,
                                        "page_size": 2, "kv_slots": 16}})
                 + "\n" + json.dumps({"i": 0, "op": "sizes", "args": {}}) + "\n")
    r = uniradix("replay", str(t), "--impl", "upstream")
    assert r.returncode == 1 and "UNSUPPORTED" in r.stdout and "page_size 2" in r.stdout
    r = uniradix("replay", str(t), "--impl", "upstream", "--skip-unsupported")
    assert r.returncode == 0
    assert uniradix("replay", str(t), "--impl", "fast").returncode == 0


def test_unknown_config_key_is_a_clear_error(tmp_path):
    t = tmp_path / "bad.jsonl"
    t.write_text(json.dumps({"format": "uniradix-trace", "version": 1,
                             "config": {"page_sise": 4}}) + "\n")
    r = uniradix("replay", str(t))
    assert r.returncode == 2 and "ConfigError" in r.stderr and "page_sise" in r.stderr


def test_upstream_impl_without_sglang_says_so(tmp_path):
    import importlib.util

    import pytest
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is importable here, so the missing-sglang message cannot be shown")
    r = uniradix("replay", FIRST, "--impl", "upstream")
    assert r.returncode != 0 and "sglang" in (r.stdout + r.stderr)
