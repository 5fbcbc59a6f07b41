"""GPU benchmark of the HiCache copy kernels: GB/s per layout, direction and page size.

    python -m uniradix.kernels.bench [--quick] [--json FILE]     # needs a CUDA GPU
    python -m uniradix.kernels.bench --cpu-smoke                  # tiny sizes on the CPU, code paths only

What is measured (MHA pools, fp16, 4 layers, K and V):

- engines: `triton` (the kernels, launched after the input checks), `torch` (the reference:
  index gathers/scatters through a staging copy), `memcpy` (one cudaMemcpyAsync per page of one
  layer and plane, the way a "direct" backend copies; the host `page_first` layout has no
  contiguous per-layer page, so it has no such row);
- directions: `backup` (device -> host, all layers, one call), `load_all` (host -> device, all
  layers, one call), `load_layers` (host -> device, one call per layer, as a layer-by-layer load
  issues them);
- page sizes 1, 16, 64 tokens, with a page (one layer, one plane: what one memcpy moves) of 4,
  16 or 64 KiB, so a token row is `page_bytes / page_size` bytes;
- ceilings: device-to-device, host-to-device and device-to-host copies of one large contiguous
  pinned buffer (`copy_`, i.e. the copy engines).

GB/s counts payload bytes moved one way.  Each timing is the median of several runs between
CUDA events, after a warm-up run (which also compiles the kernels).  Each configuration's
Triton result is checked bit for bit against the torch reference, and the per-page copies'
pages against their source (column "ok?").

Targets (from the issue): Triton reaches at least 90% of the copy-engine ceiling of its
direction for 64 KiB pages, and at least 3x per-page memcpy for pages under 16 KiB.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from . import reference
from .layouts import DevicePool, HostPool, KVGeometry, Layout
from .triton_copy import INTERPRET, available_for, backup_all_layers_triton, load_layers_triton
from .validate import check_copy

KiB = 1024
MiB = 1024 * KiB
LAYERS = 4
DTYPE = torch.float16
DIRECTIONS = ("backup", "load_all", "load_layers")
ENGINES = ("triton", "torch", "memcpy")


class Clock:
    """Times a callable: CUDA events on the GPU, perf_counter on the CPU; median of `reps`."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def median_s(self, fn, reps: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def ceilings(clock: Clock, dev: torch.device, nbytes: int, reps: int) -> dict:
    """GB/s of large contiguous copies: device->device, host->device, device->host (pinned host)."""
    pin = dev.type == "cuda"
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    a.fill_(1)
    h.fill_(2)
    out = {
        "d2d": nbytes / clock.median_s(lambda: b.copy_(a), reps) / 1e9,
        "h2d": nbytes / clock.median_s(lambda: a.copy_(h, non_blocking=True), reps) / 1e9,
        "d2h": nbytes / clock.median_s(lambda: h.copy_(a, non_blocking=True), reps) / 1e9,
    }
    return out


class PerPageCopier:
    """One memcpy per page of one layer and plane: cudaMemcpyAsync through cuda-python's runtime
    bindings when present (least per-call overhead), else a torch `copy_(non_blocking=True)` of
    each page (also one cudaMemcpyAsync, plus torch's dispatch)."""

    def __init__(self, cuda: bool):
        self.mode = "torch-copy_"
        self._rt = None
        if cuda:
            try:
                from cuda.bindings import runtime as rt
                self._rt = rt
                self.mode = "cudaMemcpyAsync"
            except Exception:  # noqa: BLE001 - any import problem means: use torch
                self._rt = None

    def plan(self, src_buf: torch.Tensor, src_a, dst_buf: torch.Tensor, dst_a, src_idx, dst_idx,
             geometry: KVGeometry, layers) -> list:
        P, item, chunk = geometry.page_size, geometry.dtype.itemsize, geometry.page_size * geometry.row
        pairs = []
        src_pages = (src_idx[::P] // P).tolist()
        dst_pages = (dst_idx[::P] // P).tolist()
        for layer in layers:
            for plane in range(geometry.planes):
                s0 = plane * src_a.plane + layer * src_a.layer
                d0 = plane * dst_a.plane + layer * dst_a.layer
                for sp, dp in zip(src_pages, dst_pages, strict=True):
                    pairs.append((s0 + sp * src_a.page_stride, d0 + dp * dst_a.page_stride))
        self._src, self._dst, self._chunk, self._item = src_buf, dst_buf, chunk, item
        self._pairs = pairs
        if self._rt is not None:
            sb, db = src_buf.data_ptr(), dst_buf.data_ptr()
            self._ptrs = [(db + d * item, sb + s * item) for s, d in pairs]
        else:
            sflat, dflat = src_buf.reshape(-1), dst_buf.reshape(-1)
            self._views = [(dflat[d:d + chunk], sflat[s:s + chunk]) for s, d in pairs]
        return pairs

    def run(self):
        if self._rt is not None:
            try:
                self._run_runtime()
                return
            except Exception as e:  # noqa: BLE001 - bindings of another shape: fall back, say so
                print(f"  cudaMemcpyAsync through cuda.bindings failed ({e!r}); using torch copy_",
                      file=sys.stderr)
                self._rt, self.mode = None, "torch-copy_ (cuda.bindings failed)"
                sflat, dflat, c = self._src.reshape(-1), self._dst.reshape(-1), self._chunk
                self._views = [(dflat[d:d + c], sflat[s:s + c]) for s, d in self._pairs]
        for dst, src in self._views:
            dst.copy_(src, non_blocking=True)

    def _run_runtime(self):
        rt = self._rt
        stream = torch.cuda.current_stream().cuda_stream
        kind = rt.cudaMemcpyKind.cudaMemcpyDefault
        nbytes = self._chunk * self._item
        ok = rt.cudaError_t.cudaSuccess
        for dst, src in self._ptrs:
            err, = rt.cudaMemcpyAsync(dst, src, nbytes, kind, stream)
            if err != ok:
                raise RuntimeError(f"cudaMemcpyAsync returned {err}")


def geometry_for(page_size: int, page_bytes: int) -> KVGeometry:
    row = page_bytes // (page_size * DTYPE.itemsize)
    head_dim = min(128, row)
    return KVGeometry.mha(LAYERS, row // head_dim, head_dim, page_size, DTYPE)


def page_slots(pages: torch.Tensor, P: int) -> torch.Tensor:
    return (pages[:, None] * P + torch.arange(P)).reshape(-1)


def bench_config(clock, dev, raw_dev, raw_host, layout, page_size, page_bytes, payload, reps, copier,
                 max_memcpy_calls):
    g = geometry_for(page_size, page_bytes)
    per_page_all = page_bytes * g.planes * g.layers       # bytes one page moves across layers and planes
    n_pages = max(1, payload // per_page_all)
    slots = 2 * n_pages * page_size                       # both pools hold twice what is copied
    dev_numel = slots * g.planes * g.layers * g.row
    host_numel = dev_numel
    device = DevicePool(g, raw_dev[:dev_numel * 2].view(DTYPE).view(g.device_shape(slots)))
    host = HostPool(g, layout, raw_host[:host_numel * 2].view(DTYPE).view(g.host_shape(layout, slots)))
    gen = torch.Generator().manual_seed(page_size * 1000 + page_bytes)
    d_idx = page_slots(torch.randperm(2 * n_pages, generator=gen)[:n_pages], page_size)
    h_idx = page_slots(torch.randperm(2 * n_pages, generator=gen)[:n_pages], page_size)
    d_idx_dev, h_idx_dev = d_idx.to(dev), h_idx.to(dev)
    check_copy(device, host, d_idx, h_idx, to_host=True, layers=range(LAYERS))
    check_copy(device, host, d_idx, h_idx, to_host=False, layers=range(LAYERS))
    rows = []
    for direction in DIRECTIONS:
        moved = n_pages * per_page_all
        row = {"layout": layout.value, "direction": direction, "page_size": page_size,
               "page_kib": page_bytes // KiB, "row_bytes": g.row * DTYPE.itemsize, "heads": g.heads,
               "head_dim": g.head_dim, "pages": n_pages, "bytes": moved}
        if direction == "backup":
            engines = {
                "triton": lambda: backup_all_layers_triton(device, host, d_idx_dev, h_idx_dev),
                "torch": lambda: reference.backup_all_layers_torch(device, host, d_idx_dev, h_idx),
            }
            dst_pool = host
        elif direction == "load_all":
            engines = {
                "triton": lambda: load_layers_triton(host, device, h_idx_dev, d_idx_dev, range(LAYERS)),
                "torch": lambda: reference.load_layers_torch(host, device, h_idx, d_idx_dev, range(LAYERS)),
            }
            dst_pool = device
        else:
            def triton_by_layer():
                for layer in range(LAYERS):
                    load_layers_triton(host, device, h_idx_dev, d_idx_dev, [layer])

            def torch_by_layer():
                for layer in range(LAYERS):
                    reference.load_layers_torch(host, device, h_idx, d_idx_dev, [layer])
            engines = {"triton": triton_by_layer, "torch": torch_by_layer}
            dst_pool = device

        # Correctness at this size: Triton's destination equals the reference's, bit for bit.
        dst_pool.buffer.fill_(float("nan"))
        engines["torch"]()
        clock.sync()
        expected = dst_pool.buffer.clone()
        dst_pool.buffer.fill_(float("nan"))
        engines["triton"]()
        clock.sync()
        row["verified"] = bool(torch.equal(dst_pool.buffer.view(torch.int16), expected.view(torch.int16)))
        del expected

        for name, fn in engines.items():
            row[f"{name}_gbps"] = moved / clock.median_s(fn, reps) / 1e9
        row["memcpy_gbps"] = None
        if layout is not Layout.PAGE_FIRST:
            # Per-page copies of a prefix of the pages (the rate is per call, so fewer calls suffice).
            calls_per_page = g.planes * g.layers
            k = max(1, min(n_pages, max_memcpy_calls // calls_per_page))
            sub_d, sub_h = d_idx[:k * page_size], h_idx[:k * page_size]
            if direction == "backup":
                copier.plan(device.buffer, device.addressing(), host.buffer, host.addressing(), sub_d, sub_h,
                            g,
                            range(LAYERS))
            else:
                copier.plan(host.buffer, host.addressing(), device.buffer, device.addressing(), sub_h, sub_d,
                            g,
                            range(LAYERS))
            dst_pool.buffer.fill_(float("nan"))      # so the check below sees the memcpys' own writes
            row["memcpy_gbps"] = k * per_page_all / clock.median_s(copier.run, reps) / 1e9
            row["memcpy_pages"] = k
            clock.sync()
            row["verified"] &= all(
                torch.equal(host.paged_layer(p, i)[sub_h // page_size, sub_h % page_size].view(torch.int16),
                            device.layer(i, p)[sub_d.to(dev)].cpu().view(torch.int16))
                for p in range(g.planes) for i in range(LAYERS))
        rows.append(row)
    return rows


def judge(rows: list, ceil: dict) -> None:
    """Add each row's ceiling, its fraction, and the targets it is held to (None when none applies)."""
    for r in rows:
        c = ceil["d2h"] if r["direction"] == "backup" else ceil["h2d"]
        r["ceiling_gbps"] = c
        r["triton_of_ceiling"] = r["triton_gbps"] / c
        r["triton_over_memcpy"] = (r["triton_gbps"] / r["memcpy_gbps"]) if r["memcpy_gbps"] else None
        r["target_ceiling_90"] = (r["triton_of_ceiling"] >= 0.9) if r["page_kib"] >= 64 else None
        r["target_3x_memcpy"] = (r["triton_over_memcpy"] >= 3.0
                                 if r["page_kib"] < 16 and r["triton_over_memcpy"] is not None else None)


def fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def verdict(v):
    return "" if v is None else ("ok" if v else "MISS")


def print_table(rows: list, ceil: dict, out=sys.stdout) -> None:
    print(f"ceilings GB/s: device->device {ceil['d2d']:.1f}  host->device {ceil['h2d']:.1f}  "
          f"device->host {ceil['d2h']:.1f}", file=out)
    head = (f"{'layout':<18}{'direction':<12}{'page':>5}{'KiB':>5}{'triton':>9}{'torch':>8}{'memcpy':>8}"
            f"{'%ceil':>7}{'x memcpy':>9}  {'ok?':<4} targets")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        ratio = r["triton_over_memcpy"]
        targets = " ".join(t for t in (
            f">=90%:{verdict(r['target_ceiling_90'])}" if r["target_ceiling_90"] is not None else "",
            f">=3x:{verdict(r['target_3x_memcpy'])}" if r["target_3x_memcpy"] is not None else "") if t)
        print(f"{r['layout']:<18}{r['direction']:<12}{r['page_size']:>5}{r['page_kib']:>5}"
              f"{fmt(r['triton_gbps']):>9}{fmt(r['torch_gbps']):>8}{fmt(r['memcpy_gbps']):>8}"
              f"{100 * r['triton_of_ceiling']:>6.0f}%{fmt(ratio, '.1f') + ('x' if ratio else ''):>9}  "
              f"{'yes' if r['verified'] else 'NO':<4} {targets}", file=out)
    misses = [r for r in rows if r["target_ceiling_90"] is False or r["target_3x_memcpy"] is False]
    wrong = [r for r in rows if not r["verified"]]
    print(f"targets: {len(misses)} missed; results equal (Triton vs the reference, memcpy vs its source) "
          f"in {len(rows) - len(wrong)}/{len(rows)} rows", file=out)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m uniradix.kernels.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (about a minute)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--budget", type=float, default=420.0, metavar="SECONDS",
                   help="start no new configuration after this many seconds (default 420: the whole "
                        "run fits a 10-minute GPU slot); skipped ones are listed")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run every code path at tiny sizes on the CPU (Triton under its interpreter); "
                        "the numbers mean nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print("uniradix.kernels.bench: no CUDA device here; the kernel benchmark needs a GPU "
              "(--cpu-smoke runs its code paths on the CPU at tiny sizes). Nothing measured.",
              file=sys.stderr)
        return 0
    if args.cpu_smoke and not cuda and not INTERPRET:
        # The interpreter must be chosen before triton is imported: run again with it set.
        os.execve(sys.executable,
                  [sys.executable, "-m", "uniradix.kernels.bench", *(argv or sys.argv[1:])],
                  dict(os.environ, TRITON_INTERPRET="1"))
    dev = torch.device("cuda" if cuda and not args.cpu_smoke else "cpu")
    if not available_for(dev):
        print(f"uniradix.kernels.bench: Triton cannot run on {dev} here (is triton installed?)",
              file=sys.stderr)
        return 1
    clock = Clock(dev.type == "cuda")
    page_kib: tuple[int, ...]
    if args.cpu_smoke:
        payload, reps, ceil_bytes = 128 * KiB, 1, 4 * MiB
        page_sizes, page_kib, max_calls = (1, 16, 64), (4,), 64
    elif args.quick:
        payload, reps, ceil_bytes = 64 * MiB, 3, 512 * MiB
        page_sizes, page_kib, max_calls = (1, 16, 64), (4, 64), 4096
    else:
        payload, reps, ceil_bytes, page_sizes, page_kib, max_calls = (
            128 * MiB, 5, 1024 * MiB, (1, 16, 64), (4, 16, 64), 16384)

    started = time.time()
    ceil = ceilings(clock, dev, ceil_bytes, reps)
    # Random bytes in both pools (some fp16 NaNs among them: results are compared bit for bit).
    raw_dev = torch.randint(0, 256, (2 * payload + 4 * MiB,), dtype=torch.uint8, device=dev)
    raw_host = torch.empty(raw_dev.shape, dtype=torch.uint8, pin_memory=dev.type == "cuda").copy_(raw_dev)
    copier = PerPageCopier(dev.type == "cuda")
    rows, skipped = [], []
    for layout in Layout:
        for P in page_sizes:
            for kib in page_kib:
                if time.time() - started > args.budget:
                    skipped.append(f"{layout.value}/page {P}/{kib} KiB")
                    continue
                rows += bench_config(clock, dev, raw_dev, raw_host, layout, P, kib * KiB, payload, reps,
                                     copier, max_calls)
                print(f"  {layout.value} page {P} {kib} KiB done ({time.time() - started:.0f} s)",
                      file=sys.stderr)
    judge(rows, ceil)
    print_table(rows, ceil)
    if skipped:
        print(f"over the {args.budget:.0f} s budget, not measured: {', '.join(skipped)}")
    env: dict[str, object] = {
        "device": (torch.cuda.get_device_name() if dev.type == "cuda"
                   else "cpu (smoke run: numbers mean nothing)"),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "memcpy_engine": copier.mode,
        "dtype": str(DTYPE), "layers": LAYERS, "payload_bytes": payload, "reps": reps,
        "seconds": round(time.time() - started, 1),
    }
    print(f"{env['device']}; torch {env['torch']}, triton {env['triton']}; memcpy via {copier.mode}; "
          f"{env['seconds']} s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"env": env, "ceilings_gbps": ceil, "rows": rows, "skipped": skipped}, f, indent=1)
    return 0 if all(r["verified"] for r in rows) else 1


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
