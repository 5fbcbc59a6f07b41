"""``uniradix bench-storage``: prefetch and backup throughput of the storage backends, uniradix's
against upstream 0.5.13.post1's own, side by side in one process (docs/CLI.md, docs/PERFORMANCE.md).

What is timed, per backend and round: a **backup** pass (``n`` pages of a host pool written under
fresh keys, in batches of 128 pages as upstream's controller issues them) and a **prefetch**
pass (the same keys read back into ``n`` other pages of the pool).  Each backend goes through
the path the storage tier takes with it:

* ``file`` (uniradix's FileStore) and ``mooncake`` (uniradix's MooncakeStore): the zero-copy
  ``batch_set_v1`` / ``batch_get_v1`` calls fast's storage tier makes (fast/tiers/storage.py);
* ``upstream-file`` (``HiCacheFile``): upstream's controller path for it, ``_generic_page_set``
  (``batch_set`` of ``get_data_page`` copies) and ``_generic_page_get`` (``batch_get`` into dummy
  pages, then ``set_from_flat_data_page``): HiCacheFile has no zero-copy calls;
* ``upstream-mooncake`` (its ``MooncakeStore``): the zero-copy ``batch_set_v1`` / ``batch_get_v1``
  its controller uses.

Every backend reads and writes the same host pool (upstream's ``MHATokenToKVPoolHost`` where
sglang is importable, else a ``uniradix.kernels.HostPool`` of the same shape), with the same
page size and page count.  Rounds alternate the backends (the order rotates each round) so that
load on the machine falls on all of them alike; torch runs on one thread.  After each pass the
pages read are compared byte for byte with the pages written (outside the timing): a backend
that loads wrong bytes fails the bench.  Each pass ends with the backend's store cleared (for
upstream's Mooncake store a forced remove: its own ``clear`` removes nothing under the read
leases a prefetch just took).

Both Mooncake backends talk to one ``mooncake_master`` this command starts on loopback, over TCP;
each client gives the pool a segment large enough for one pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from uniradix.conformance.bench.results import machine_info, ratio_stat, stat

BACKENDS = ("file", "upstream-file", "mooncake", "upstream-mooncake")
PEERS = {"file": "upstream-file", "mooncake": "upstream-mooncake"}
DIRECTIONS = ("backup", "prefetch")


class Runner:
    """One backend set up on the host pool: ``write(keys, slots)`` / ``read(keys, slots)`` return
    whether every page succeeded; ``clear()`` empties what it stored; ``close()`` lets go."""

    def __init__(self, name: str, version: str, write: Callable, read: Callable,
                 clear: Callable[[], Any], close: Callable[[], Any] = lambda: None) -> None:
        self.name, self.version = name, version
        self.write, self.read, self.clear, self.close = write, read, clear, close


def _upstream_version() -> str:
    try:
        from importlib.metadata import version
        return "sglang " + version("sglang")
    except Exception:  # noqa: BLE001 (only a label)
        return "sglang"


def _build(name: str, pool: Any, directory: str, address: str | None, segment: int,
           layout: str) -> Runner:
    from uniradix.fast.storage.bench import generic_runner, zero_copy_runner
    if name == "file":
        from uniradix.fast.storage import FileStore
        fs = FileStore(directory)
        fs.register_mem_pool_host(pool)
        w, r = zero_copy_runner(fs)
        return Runner(name, "uniradix", w, r, fs.clear, fs.close)
    if name == "mooncake":
        from uniradix.fast.storage import MooncakeStore
        assert address is not None
        ms = MooncakeStore(address, global_segment_size=segment, namespace="bench")
        ms.register_mem_pool_host(pool)
        w, r = zero_copy_runner(ms)
        return Runner(name, "uniradix", w, r, ms.clear, ms.close)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    zero_copy_layout = layout != "layer_first"
    if name == "upstream-file":
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile
        cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, zero_copy_layout, "bench")
        st = HiCacheFile(cfg, file_path=directory)
        w, r = generic_runner(st, pool)
        return Runner(name, _upstream_version(), w, r, st.clear)
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore as Up
    assert address is not None
    cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, zero_copy_layout, "bench",
                               extra_config={"master_server_address": address, "protocol": "tcp",
                                             "local_hostname": "127.0.0.1",
                                             "global_segment_size": segment})
    up = Up(cfg, pool)
    up.register_mem_pool_host(pool)
    w, r = zero_copy_runner(up)
    return Runner(name, _upstream_version(), w, r, lambda: up.store.remove_all(True),
                  up.close)


def _why_not(name: str, sglang: bool) -> str | None:
    if name.startswith("upstream") and not sglang:
        return "sglang is not importable (run with the upstream venv's Python)"
    if name.endswith("mooncake"):
        from uniradix.fast.storage import mooncake_available
        return mooncake_available()
    return None


def run_storage_bench(backends: list[str], *, pages: int = 128, page_size: int = 16,
                      layers: int = 4, heads: int = 8, head_dim: int = 128,
                      layout: str = "page_first", rounds: int = 5, warmup: int = 1,
                      directory: str | None = None, threads: int = 1) -> dict:
    """Run the bench; returns ``{"storage": [figure], "machine": ...}`` (docs/BENCH_JSON.md)."""
    import torch

    from uniradix.fast.storage import MooncakeMaster
    from uniradix.fast.storage.base import STORAGE_BATCH_SIZE, PageLayout
    from uniradix.fast.storage.bench import _sglang, make_pool

    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"unknown storage backend {b!r} (known: {', '.join(BACKENDS)})")
    for what, n in (("pages", pages), ("page_size", page_size), ("layers", layers),
                    ("heads", heads), ("head_dim", head_dim), ("rounds", rounds),
                    ("threads", threads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{what} must be an int >= 1, got {n!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    if layout not in ("layer_first", "page_first", "page_first_direct"):
        raise ValueError(f"layout must be layer_first, page_first or page_first_direct, got {layout!r}")
    torch.set_num_threads(threads)
    mph = _sglang()
    shape = argparse.Namespace(pages=pages, page_size=page_size, layers=layers, heads=heads,
                               head_dim=head_dim, layout=layout)
    pool = make_pool(shape, mph)
    pl = PageLayout.of(pool)
    page_bytes = pl.page_bytes
    segment = max(64 << 20, pages * page_bytes + (32 << 20))
    root = directory or tempfile.mkdtemp(prefix="uniradix-bench-storage-")
    src = torch.arange(pages * page_size)
    dst = torch.arange(pages * page_size, 2 * pages * page_size)
    src_bytes = [b"".join(v.tobytes() for v in pl.views(p)) for p in range(pages)]

    skipped: dict[str, str] = {}
    runners: list[Runner] = []
    master = None
    times: dict[str, dict[str, list[float]]] = {}
    try:
        for b in backends:
            why = _why_not(b, mph is not None)
            if why is not None:
                skipped[b] = why
                continue
            if b.endswith("mooncake") and master is None:
                master = MooncakeMaster().start()
            d = os.path.join(root, b)
            os.makedirs(d, exist_ok=True)
            runners.append(_build(b, pool, d, master.address if master else None, segment, layout))
            times[b] = {"backup": [], "prefetch": []}
        for r in range(-warmup, rounds):
            first = r % len(runners) if runners else 0
            for run in runners[first:] + runners[:first]:
                keys = [f"bench-{run.name}-{r}-{i:06d}" for i in range(pages)]
                t0 = time.perf_counter()
                ok_w = run.write(keys, src)
                t1 = time.perf_counter()
                ok_r = run.read(keys, dst)
                t2 = time.perf_counter()
                if not (ok_w and ok_r):
                    raise RuntimeError(f"{run.name}: a page failed (backup ok {ok_w}, "
                                       f"prefetch ok {ok_r})")
                for p in range(pages):
                    got = b"".join(v.tobytes() for v in pl.views(pages + p))
                    if got != src_bytes[p]:
                        raise RuntimeError(f"{run.name}: page {p} read back different bytes")
                    for view in pl.views(pages + p):   # wiped: the next pass must load again
                        view[:] = 0
                run.clear()
                if r >= 0:
                    times[run.name]["backup"].append(t1 - t0)
                    times[run.name]["prefetch"].append(t2 - t1)
    finally:
        for run in runners:
            try:
                run.close()
            except Exception:  # noqa: BLE001 (closing is best effort)
                pass
        if master is not None:
            master.stop()
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)

    total = pages * page_bytes
    impls: dict[str, dict] = {}
    for run in runners:
        row: dict[str, Any] = {"version": run.version}
        for d in DIRECTIONS:
            secs = times[run.name][d]
            row[d] = {"pages_per_s": stat([pages / s for s in secs], 1),
                      "GB_per_s": stat([total / s / 1e9 for s in secs], 6)}
        impls[run.name] = row
    ratios: dict[str, dict] = {}
    for ours, theirs in PEERS.items():
        if ours in impls and theirs in impls:
            ratios[f"{ours}/{theirs}"] = {
                d: ratio_stat(impls[ours][d]["pages_per_s"], impls[theirs][d]["pages_per_s"])
                for d in DIRECTIONS}
    figure = {"id": f"storage/{layout}/p{page_size}/{pages}pages",
              "layout": layout, "page_size": page_size, "pages": pages, "page_bytes": page_bytes,
              "geometry": {"kind": "mha", "layers": layers, "heads": heads, "head_dim": head_dim,
                           "dtype": "bfloat16"},
              "batch_pages": STORAGE_BATCH_SIZE, "rounds": rounds, "warmup": warmup,
              "torch_threads": threads,
              "pool": "sglang MHATokenToKVPoolHost" if mph is not None else "uniradix HostPool",
              "impls": impls, "ratios": ratios, "skipped": skipped}
    return {"storage": [figure], "machine": machine_info()}


def format_table(result: dict) -> str:
    lines = []
    for fig in result["storage"]:
        lines.append(f"{fig['pages']} pages of {fig['page_bytes'] / 2**20:.2f} MiB ({fig['layout']}, "
                     f"page {fig['page_size']}, {fig['geometry']['layers']} layers x "
                     f"{fig['geometry']['heads']} heads x {fig['geometry']['head_dim']}, bf16), "
                     f"batches of {fig['batch_pages']}, median of {fig['rounds']} alternating "
                     f"rounds after {fig['warmup']} warm-up; pool: {fig['pool']}")
        lines.append(f"{'backend':<19}{'backup pages/s':>15}{'GB/s':>8}{'prefetch pages/s':>18}"
                     f"{'GB/s':>8}   (min..max pages/s)")
        for name, row in fig["impls"].items():
            b, p = row["backup"], row["prefetch"]
            lines.append(f"{name:<19}{b['pages_per_s']['median']:>15,.0f}{b['GB_per_s']['median']:>8.3f}"
                         f"{p['pages_per_s']['median']:>18,.0f}{p['GB_per_s']['median']:>8.3f}"
                         f"   backup {b['pages_per_s']['min']:,.0f}..{b['pages_per_s']['max']:,.0f},"
                         f" prefetch {p['pages_per_s']['min']:,.0f}..{p['pages_per_s']['max']:,.0f}")
        for pair, r in fig["ratios"].items():
            parts = [f"{d} {r[d]['median']:.2f}x ({r[d]['min']:.2f}..{r[d]['max']:.2f})"
                     for d in DIRECTIONS if r.get(d)]
            lines.append(f"ratio {pair}: " + ", ".join(parts))
        for name, why in fig["skipped"].items():
            lines.append(f"{name:<19}skipped: {why}")
    return "\n".join(lines)


def _backends(text: str) -> list[str]:
    out = [b.strip() for b in text.split(",") if b.strip()]
    for b in out:
        if b not in BACKENDS:
            raise argparse.ArgumentTypeError(f"unknown backend {b!r} (known: {', '.join(BACKENDS)})")
    if not out:
        raise argparse.ArgumentTypeError("no backend given")
    return out


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``low``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {v}")
        return v
    return parse


_positive = _at_least(1)
_non_negative = _at_least(0)


def add_bench_storage_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench-storage`` to a ``uniradix`` subcommand parser set."""
    b = subparsers.add_parser(
        "bench-storage", help="storage backends' prefetch and backup throughput, beside upstream's",
        description="Prefetch and backup throughput (pages/s, GB/s) of uniradix's file and "
                    "Mooncake backends and upstream's HiCacheFile and Mooncake store, side by side "
                    "in one process with alternating rounds (conformance/bench/storage.py).")
    b.add_argument("--storage", "--backends", dest="backends", type=_backends,
                   default=None,
                   help="comma-separated subset of " + ",".join(BACKENDS) + " (default all; "
                        "those that cannot run here are reported and skipped; with --cache: "
                        "file and/or mooncake, default both)")
    b.add_argument("--pages", type=_positive, default=128, help="pages per pass (default 128)")
    b.add_argument("--page-size", type=_positive, default=16, help="tokens per page (default 16)")
    b.add_argument("--layers", type=_positive, default=4, help="layers (default 4)")
    b.add_argument("--heads", type=_positive, default=8, help="KV heads (default 8)")
    b.add_argument("--head-dim", type=_positive, default=128, help="head dim (default 128)")
    b.add_argument("--layout", default="page_first",
                   choices=["layer_first", "page_first", "page_first_direct"],
                   help="host pool layout (default page_first)")
    b.add_argument("--repeat", type=_positive, default=5,
                   help="timed rounds per backend, alternating (default 5; medians reported)")
    b.add_argument("--warmup", type=_non_negative, default=1,
                   help="untimed rounds first (default 1: first touch of the stores' memory)")
    b.add_argument("--threads", type=_positive, default=1, help="torch threads (default 1)")
    b.add_argument("--dir", default=None,
                   help="directory for the file stores (default: a new temporary one, removed after)")
    b.add_argument("--json", default=None,
                   help="also write the results here (read by `uniradix dashboard --add`)")
    b.add_argument("--cache", action="store_true",
                   help="instead: the cache's operations with the storage tier on, fast beside "
                        "upstream's cache and controller, per backend of --storage (file, "
                        "mooncake; conformance/bench/storage_cache.py)")
    b.add_argument("--requests", type=_positive, default=60,
                   help="with --cache: requests per round (default 60)")
    b.add_argument("--kv-slots", type=_positive, default=1024,
                   help="with --cache: device KV slots, whole pages (default 1024)")
    b.set_defaults(func=cmd_bench_storage)
    return b


def cmd_bench_storage(args: argparse.Namespace) -> int:
    # settings of the other mode are refused by name, not ignored
    other = ([("--pages", args.pages != 128), ("--layout", args.layout != "page_first"),
              ("--dir", args.dir is not None)] if args.cache else
             [("--requests", args.requests != 60), ("--kv-slots", args.kv_slots != 1024)])
    given = [name for name, set_ in other if set_]
    if given:
        print(f"bench-storage: {', '.join(given)} "
              f"{'does not apply with --cache' if args.cache else 'needs --cache'}",
              file=sys.stderr)
        return 2
    if args.cache:
        return _cmd_cache(args)
    args.backends = args.backends or list(BACKENDS)
    result = run_storage_bench(args.backends, pages=args.pages, page_size=args.page_size,
                               layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                               layout=args.layout, rounds=args.repeat, warmup=args.warmup,
                               directory=args.dir, threads=args.threads)
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if not result["storage"][0]["impls"]:
        print("no backend could run here", file=sys.stderr)
        return 2
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    """``bench-storage --cache``: one comparison per backend (file, mooncake) of --storage."""
    from uniradix.conformance.bench import storage_cache as sc
    given = args.backends or list(sc.BACKENDS)
    backends = [b for b in given if b in sc.BACKENDS]
    others = [b for b in given if b not in sc.BACKENDS]
    if others:
        print(f"bench-storage --cache: --storage {','.join(others)}: the cache bench runs "
              f"{' and '.join(sc.BACKENDS)} (each under both caches)", file=sys.stderr)
        return 2
    if args.kv_slots % args.page_size:
        print(f"bench-storage --cache: --kv-slots {args.kv_slots} is not whole pages of "
              f"{args.page_size}", file=sys.stderr)
        return 2
    out: dict = {"comparisons": []}
    failed = False
    for b in backends:
        try:
            r = sc.run_cache_bench(b, requests=args.requests, page_size=args.page_size,
                                   kv_slots=args.kv_slots, layers=args.layers, heads=args.heads,
                                   head_dim=args.head_dim, rounds=args.repeat, warmup=args.warmup,
                                   threads=args.threads)
        except sc.BenchFailure as e:
            print(f"bench-storage --cache --storage {b}: {e}", file=sys.stderr)
            failed = True
            continue
        out["comparisons"].extend(r["comparisons"])
        out["machine"] = r["machine"]
        print(sc.format_table(r))
        failed = failed or r["comparisons"][0]["identical_outcomes"] is False
    if args.json and out["comparisons"]:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 1 if failed else 0
