"""`uniradix bench-storage --cache` (conformance/bench/storage_cache.py) on a tiny shape: fast's
cache with the file store runs the loop with its KV checked and storage hits taken, upstream is
reported as not measured without sglang (and, in the upstream venv, runs beside fast on CPU with
identical outcomes), wrong KV fails the bench, the JSON is a throughput figure the dashboard
files, and bad settings are refused by name."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from uniradix.conformance.adapters import upstream as upstream_mod  # noqa: E402
from uniradix.conformance.bench import results as R  # noqa: E402
from uniradix.conformance.bench import storage_cache as sc  # noqa: E402
from uniradix.conformance.cli import main  # noqa: E402

TINY = dict(requests=16, page_size=4, kv_slots=64, groups=10, prefix_pages=4, suffix_pages=1,
            output_pages=1, layers=2, heads=1, head_dim=8, rounds=1, warmup=0)


def test_fast_runs_the_loop_with_storage_hits_and_upstream_is_named_when_missing():
    out = sc.run_cache_bench("file", **TINY)
    [c] = out["comparisons"]
    fast = c["impls"]["fast"]
    assert fast["requests_per_s_median"] > 0 and fast["aborted"] == 0
    # the shared prefixes outgrow the host pool: some come back from the file store
    assert fast["storage_loaded_tokens"] > 0 and fast["host_loaded_tokens"] > 0
    assert set(fast["runs"][0]["op_median_us"]) == set(sc.OPS)
    if upstream_mod.upstream_available():
        assert c["identical_outcomes"] is True and set(c["impls"]) == {"fast", "upstream"}
    else:
        assert "sglang" in c["missing"]["upstream"] and c["identical_outcomes"] is None
    assert "fast" in sc.format_table(out)


def test_wrong_kv_fails_the_bench(monkeypatch):
    real = sc.build_fast

    def off_by_one(*args):
        side = real(*args)
        write = side.write_kv
        side.write_kv = lambda slots, values: write(slots, values + 1)
        return side
    monkeypatch.setattr(sc, "build_fast", off_by_one)
    with pytest.raises(sc.BenchFailure, match="wrong KV"):
        sc.run_cache_bench("file", **{**TINY, "requests": 6}, impls=("fast",))


def test_the_json_is_a_throughput_figure(tmp_path):
    path = tmp_path / "cache.json"
    rc = main(["bench-storage", "--cache", "--storage", "file", "--requests", "6",
               "--page-size", "4", "--kv-slots", "64", "--layers", "1", "--heads", "1",
               "--head-dim", "8", "--repeat", "1", "--warmup", "0", "--json", str(path)])
    assert rc == 0
    rec = R.normalize(json.loads(path.read_text()), commit={"sha": "b" * 40, "date": None,
                                                            "subject": None, "dirty": False})
    [fig] = rec["figures"]["throughput"]
    assert fig["config"] == "write_through+storage-file" and fig["page_size"] == 4
    assert fig["impls"]["fast"]["requests_per_s"]["median"] > 0


@pytest.mark.parametrize("args,match", [
    (["--storage", "upstream-file"], "the cache bench runs file and mooncake"),
    (["--kv-slots", "10", "--page-size", "4"], "not whole pages"),
    (["--pages", "8"], "--pages does not apply with --cache"),
    (["--layout", "layer_first", "--dir", "x"], "--layout, --dir does not apply with --cache"),
])
def test_bad_settings_are_refused_by_name(capsys, args, match):
    assert main(["bench-storage", "--cache", *args]) == 2
    assert match in capsys.readouterr().err


def test_cache_settings_without_cache_are_refused_by_name(capsys):
    assert main(["bench-storage", "--requests", "5", "--storage", "file"]) == 2
    assert "--requests needs --cache" in capsys.readouterr().err


def test_bad_settings_through_the_api_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown storage backend 'nfs'"):
        sc.run_cache_bench("nfs")
    with pytest.raises(ValueError, match="requests must be an int >= 1"):
        sc.run_cache_bench("file", requests=0)
    with pytest.raises(ValueError, match="unknown implementation 'spec'"):
        sc.run_cache_bench("file", impls=("spec",))


def test_a_prefetch_ending_before_its_host_slots_are_back_is_waited_for_and_counted(monkeypatch):
    """The loop waits (untimed) until a prefetch's host slots are back before the step goes on,
    and counts the requests that needed it; the outcomes do not move."""
    plain = sc.run_cache_bench("file", **TINY, impls=("fast",))
    real = sc.build_fast

    def late(*args):  # every prefetch's slots come back one poll late
        side = real(*args)
        back, seen = side.slots_back, set()

        def slots_back(slots):
            key = tuple(slots.tolist())
            if key not in seen:
                seen.add(key)
                return False
            return back(slots)
        side.slots_back = slots_back
        return side
    monkeypatch.setattr(sc, "build_fast", late)
    out = sc.run_cache_bench("file", **TINY, impls=("fast",))
    [run] = out["comparisons"][0]["impls"]["fast"]["runs"]
    [ref] = plain["comparisons"][0]["impls"]["fast"]["runs"]
    assert ref["release_waits"] == 0 and run["release_waits"] > 0
    assert run["digest"] == ref["digest"]
    assert "fast [" in sc.format_table(out)


def test_a_mismatch_names_the_first_request_that_differs(monkeypatch):
    real = sc.build_fast
    built = []

    def second_round_differs(*args):
        side = real(*args)
        built.append(side)
        if len(built) == 2:  # round 2: request 3 reports one more token prefetched
            pop = side.cache.pop_prefetch_loaded_tokens
            side.cache.pop_prefetch_loaded_tokens = (
                lambda rid: pop(rid) + (1 if rid.endswith("-3") else 0))
        return side
    monkeypatch.setattr(sc, "build_fast", second_round_differs)
    out = sc.run_cache_bench("file", **{**TINY, "rounds": 2}, impls=("fast",))
    [m] = out["comparisons"][0]["mismatches"]
    assert "fast round 1" in m and "first at request 3" in m


@pytest.mark.upstream
def test_upstream_can_end_a_revoked_prefetch_before_its_host_slots_are_back(tmp_path):
    """Why upstream's outcomes moved between runs (docs/STORAGE.md "Upstream's outcomes with
    Mooncake"): its prefetch thread queues a revoke, then the release of the revoked host
    slots.  Held between the two, a scheduler step drains the revoke, the prefetch is over,
    and its slots are not back: a write-through in that step would evict host nodes for
    them.  Fast queues both under one lock."""
    import threading
    if not upstream_mod.upstream_available():
        pytest.skip("upstream sglang is not importable here")
    shape = sc.Shape(4, 64, 1, 1, 8)
    side = sc.build_upstream(shape, "file", str(tmp_path), None)
    gate, entered = threading.Event(), threading.Event()
    try:
        cache, ctl = side.cache, side.cache.cache_controller
        release = ctl.append_host_mem_release

        def held(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                entered.set()  # the prefetch thread: the revoke is queued, the release not yet
                gate.wait(10)
            return release(*args, **kwargs)
        ctl.append_host_mem_release = held
        free = ctl.mem_pool_host.available_size()
        cache.prefetch_from_storage("r", cache.root_node, list(range(100, 116)))  # not stored
        slots = side.prefetch_slots("r")
        assert slots is not None and len(slots) == 16
        assert entered.wait(10)
        cache.check_hicache_events()
        assert cache.check_prefetch_progress("r") is True  # the prefetch is over ...
        assert not side.slots_back(slots)  # ... and its slots are not back
        assert ctl.mem_pool_host.available_size() == free - 16
        gate.set()

        def back():
            cache.check_hicache_events()
            return side.slots_back(slots)
        sc._wait(back, "the release", "upstream")
        assert ctl.mem_pool_host.available_size() == free
    finally:
        gate.set()
        side.close()
