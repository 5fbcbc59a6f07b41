"""Throughput of storage backends: pages/s and GB/s of batched page writes (backup) and reads
(prefetch) between a host pool and the store, in 128-page batches as SGLang's controller issues
them.  Independent of `uniradix bench`.

    python -m uniradix.fast.storage.bench [--backends file,mooncake] [--pages 512] [--page-size 16]
        [--layers 8] [--heads 8] [--head-dim 128] [--layout page_first] [--repeat 3] [--warmup 1] [--dir DIR]
        [--json OUT]

Backends: `file` (FileStore), `mooncake` (MooncakeStore against a mooncake_master this script
starts on loopback), and, where sglang is importable (the upstream venv with this tree on
PYTHONPATH), `upstream-file` (0.5.13.post1's HiCacheFile, through the controller's generic
per-page path: `batch_set` of `get_data_page` tensors, `batch_get` into dummy pages and
`set_from_flat_data_page`, since HiCacheFile has no zero-copy calls) and `upstream-mooncake`
(its MooncakeStore, zero-copy `batch_set_v1` / `batch_get_v1`).  With sglang present every
backend reads and writes the same upstream `MHATokenToKVPoolHost`; without it ours use a
`uniradix.kernels.HostPool` of the same shape.  Each pass writes fresh keys, reads them all
into other pages and clears the store; `--warmup` untimed passes come first (the first pass
over a Mooncake client's segment pays for first-touch page faults), then the best of
`--repeat` timed passes is reported (GB = 1e9 bytes of page payload).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from .base import STORAGE_BATCH_SIZE, PageLayout
from .file_store import FileStore
from .mooncake_store import MooncakeMaster, MooncakeStore, mooncake_available

ALL = ("file", "mooncake", "upstream-file", "upstream-mooncake")


def _sglang():
    try:
        from uniradix.conformance.adapters import upstream as up
        up.load_upstream()
        import sglang.srt.mem_cache.memory_pool_host as mph
        return mph
    except Exception:
        return None


def make_pool(args, mph) -> Any:
    tokens = 2 * args.pages * args.page_size            # room to read every page into a second copy
    if mph is not None:
        dev = types.SimpleNamespace(store_dtype=torch.bfloat16, size=tokens - args.page_size, start_layer=0,
                                    end_layer=args.layers, head_num=args.heads, head_dim=args.head_dim,
                                    layer_num=args.layers, device="cpu")
        pool = mph.MHATokenToKVPoolHost(dev, 1.0, 0, args.page_size, args.layout, pin_memory=False,
                                        device="cpu")
        buf = pool.kv_buffer
    else:
        from uniradix.kernels import HostPool, KVGeometry
        g = KVGeometry.mha(args.layers, args.heads, args.head_dim, args.page_size, torch.bfloat16)
        pool = HostPool.allocate(g, args.layout, tokens, pin_memory=False)
        buf = pool.buffer
    buf.view(torch.int16).random_(-20000, 20000, generator=torch.Generator().manual_seed(0))
    return pool


def _batches(n):
    for s in range(0, n, STORAGE_BATCH_SIZE):
        yield s, min(n, s + STORAGE_BATCH_SIZE)


def zero_copy_runner(backend) -> tuple[Callable, Callable]:
    def write(keys, idx):
        ok = True
        for s, e in _batches(len(keys)):
            ok &= all(backend.batch_set_v1(keys[s:e], idx[s * P:e * P]))
        return ok

    def read(keys, idx):
        ok = True
        for s, e in _batches(len(keys)):
            ok &= all(backend.batch_get_v1(keys[s:e], idx[s * P:e * P]))
        return ok
    P = PageLayout.of(backend.mem_pool_host).page_size
    return write, read


def generic_runner(backend, pool) -> tuple[Callable, Callable]:
    """SGLang's controller path for backends without zero-copy calls (cache_controller's
    _generic_page_set / _generic_page_get)."""
    P = pool.page_size

    def write(keys, idx):
        ok = True
        for s, e in _batches(len(keys)):
            data = [pool.get_data_page(idx[i * P]) for i in range(s, e)]
            ok &= bool(backend.batch_set(keys[s:e], data))
        return ok

    def read(keys, idx):
        ok = True
        for s, e in _batches(len(keys)):
            dummies = [pool.get_dummy_flat_data_page() for _ in range(s, e)]
            pages = backend.batch_get(keys[s:e], dummies)
            for j, i in enumerate(range(s, e)):
                if pages[j] is None:
                    ok = False
                    continue
                pool.set_from_flat_data_page(idx[i * P], pages[j])
        return ok
    return write, read


def measure(name, write, read, clear, args, page_bytes) -> dict:
    P, n = args.page_size, args.pages
    src = torch.arange(n * P, device="cpu")  # host slots
    dst = torch.arange(n * P, 2 * n * P, device="cpu")
    best = {"set_s": float("inf"), "get_s": float("inf")}
    for r in range(-args.warmup, args.repeat):          # r < 0: untimed warm-up passes
        keys = [f"bench-{r}-{i:06d}" for i in range(n)]
        t = time.perf_counter()
        ok_w = write(keys, src)
        t_set = time.perf_counter() - t
        t = time.perf_counter()
        ok_r = read(keys, dst)
        t_get = time.perf_counter() - t
        if not (ok_w and ok_r):
            raise RuntimeError(f"{name}: a page failed (write ok {ok_w}, read ok {ok_r})")
        clear()
        if r >= 0:
            best["set_s"] = min(best["set_s"], t_set)
            best["get_s"] = min(best["get_s"], t_get)
    total = n * page_bytes
    return {"backend": name, "pages": n, "page_bytes": page_bytes,
            "set_pages_per_s": n / best["set_s"], "set_GB_per_s": total / best["set_s"] / 1e9,
            "get_pages_per_s": n / best["get_s"], "get_GB_per_s": total / best["get_s"] / 1e9}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m uniradix.fast.storage.bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default=",".join(ALL),
                    help="comma-separated subset of " + ",".join(ALL)
                    + " (unavailable ones are reported and skipped)")
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first",
                    choices=["layer_first", "page_first", "page_first_direct"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed passes first (first-touch of store memory)")
    ap.add_argument("--dir", default=None,
                    help="directory for the file stores (default: a new temporary one)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in wanted:
        if b not in ALL:
            ap.error(f"unknown backend {b!r} (known: {', '.join(ALL)})")
    for name in ("pages", "page_size", "layers", "heads", "head_dim", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        ap.error("--warmup must not be negative")

    mph = _sglang()
    pool = make_pool(args, mph)
    page_bytes = PageLayout.of(pool).page_bytes
    seg = max(256 << 20, 2 * args.pages * page_bytes + (64 << 20))
    root = args.dir or tempfile.mkdtemp(prefix="uniradix-storage-bench-")
    results, skipped = [], []
    master = None
    try:
        for b in wanted:
            if b.startswith("upstream") and mph is None:
                skipped.append((b, "sglang is not importable"))
                continue
            if b.endswith("mooncake"):
                why = mooncake_available()
                if why:
                    skipped.append((b, why))
                    continue
                if master is None:
                    master = MooncakeMaster().start()
            d = os.path.join(root, b)
            if b == "file":
                fs = FileStore(d)
                fs.register_mem_pool_host(pool)
                w, r = zero_copy_runner(fs)
                results.append(measure(b, w, r, fs.clear, args, page_bytes))
            elif b == "mooncake":
                assert master is not None  # started above for each Mooncake backend
                ms = MooncakeStore(master.address, global_segment_size=seg, namespace="bench")
                ms.register_mem_pool_host(pool)
                w, r = zero_copy_runner(ms)
                results.append(measure(b, w, r, ms.clear, args, page_bytes))
                ms.close()
            elif b == "upstream-file":
                from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
                cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, args.layout != "layer_first",
                                           "bench")
                st = HiCacheFile(cfg, file_path=d)
                w, r = generic_runner(st, pool)
                results.append(measure(b, w, r, st.clear, args, page_bytes))
            else:
                from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
                from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore as Up
                assert master is not None  # started above for each Mooncake backend
                cfg = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, args.layout != "layer_first",
                                           "bench",
                                           extra_config={"master_server_address": master.address,
                                                         "protocol": "tcp", "local_hostname": "127.0.0.1",
                                                         "global_segment_size": seg})
                st = Up(cfg, pool)
                st.register_mem_pool_host(pool)
                w, r = zero_copy_runner(st)
                results.append(measure(b, w, r, lambda st=st: st.store.remove_all(True), args, page_bytes))
    finally:
        if master is not None:
            master.stop()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)

    print(f"{args.pages} pages of {page_bytes / 2**20:.2f} MiB ({args.layout}, page {args.page_size}, "
          f"{args.layers} layers x {args.heads} heads x {args.head_dim}, bf16), "
          f"batches of {STORAGE_BATCH_SIZE}, "
          f"best of {args.repeat} after {args.warmup} warm-up; "
          f"pool: {'sglang MHATokenToKVPoolHost' if mph else 'uniradix HostPool'}")
    print(f"{'backend':<18}{'set pages/s':>13}{'set GB/s':>10}{'get pages/s':>13}{'get GB/s':>10}")
    for res in results:
        print(f"{res['backend']:<18}{res['set_pages_per_s']:>13,.0f}{res['set_GB_per_s']:>10.2f}"
              f"{res['get_pages_per_s']:>13,.0f}{res['get_GB_per_s']:>10.2f}")
    for b, why in skipped:
        print(f"{b:<18}skipped: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "skipped": skipped}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
