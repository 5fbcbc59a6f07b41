"""Mooncake's distributed KV store as a storage backend (the scale-out path SGLang deployments
use), through the `mooncake.store` client of the PyPI package `mooncake-transfer-engine-non-cuda`
(or any mooncake wheel), over TCP or RDMA.

Pages move zero-copy: `register_mem_pool_host` registers the host pool's buffer with the
transfer engine, and `batch_set_v1` / `batch_get_v1` hand Mooncake the addresses of each page's
pieces (`batch_put_from` / `batch_get_into`, or their `_multi_buffers` forms when a page lies in
several pieces, as in `layer_first`).  A read counts only when Mooncake reports exactly the
page's bytes; anything else is a miss.

Object names.  A page of key K is stored as one object named `<namespace>/<K>@<tag>`: `tag` is
the registered pool's `PageLayout.tag` (geometry, layout, dtype), or "raw" before a pool is
registered.  One name per page means `exists` and `batch_exists` ask about the very name a page
is stored under (upstream's `MooncakeStore.exists` asks about the bare key while it stores
per-K/V suffixed names, so it answers False right after a write).  The tag keeps pages of
another geometry or layout from ever being read into this pool; the namespace lets `clear`
remove exactly this backend's objects.

Removal.  Mooncake gives each object a read lease (10 s by default) on every read; a non-forced
remove of a leased object silently removes nothing (upstream's `clear` calls `remove_all()`
without force and so clears nothing right after a prefetch).  `clear` removes this namespace's
objects with force.

Faults.  When the master is unreachable, calls return Mooncake's negative codes; they become
misses and failed sets here, never exceptions from the batch calls.  The client re-mounts its
segment once a master is back (a restarted master has lost every object: pages read as misses
until written again).
"""
from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import Any

import torch

from .base import StorageBackend, StorageInputError, chunks

__all__ = ["MooncakeMaster", "MooncakeStore", "mooncake_available"]

logger = logging.getLogger(__name__)

_DEFAULT_SEGMENT = 1 << 30          # bytes this client contributes to the distributed pool
_DEFAULT_LOCAL_BUFFER = 16 << 20    # Mooncake's staging buffer (the zero-copy calls bypass it)


def mooncake_available() -> str | None:
    """None when `mooncake.store` imports; otherwise why not (for skip reasons and errors)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as e:          # ImportError, or OSError from a missing libibverbs
        return f"mooncake.store does not import: {type(e).__name__}: {e}"
    return None


class MooncakeStore(StorageBackend):
    """A Mooncake distributed-store client; see the module docstring.

    `master_server_address` "host:port" of `mooncake_master`; `local_hostname` the address
    other clients reach this one at; `protocol` "tcp" or "rdma" (`device_name` the RDMA NICs);
    `metadata_server` "P2PHANDSHAKE" (no metadata service) or a URL; `global_segment_size`
    bytes of this process's memory given to the pool; `namespace` prefixes every object name.
    """

    def __init__(self, master_server_address: str, *, local_hostname: str = "127.0.0.1",
                 protocol: str = "tcp", device_name: str = "", metadata_server: str = "P2PHANDSHAKE",
                 global_segment_size: int = _DEFAULT_SEGMENT,
                 local_buffer_size: int = _DEFAULT_LOCAL_BUFFER, namespace: str = "uniradix") -> None:
        super().__init__()
        for name, value in (("master_server_address", master_server_address),
                            ("local_hostname", local_hostname), ("protocol", protocol),
                            ("device_name", device_name), ("metadata_server", metadata_server),
                            ("namespace", namespace)):
            if not isinstance(value, str):
                raise StorageInputError(f"{name} must be a str, got {value!r}")
        if protocol not in ("tcp", "rdma"):
            raise StorageInputError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if not namespace or "/" in namespace:
            raise StorageInputError(f"namespace must be a non-empty str without '/', got {namespace!r}")
        for name, size in (("global_segment_size", global_segment_size),
                           ("local_buffer_size", local_buffer_size)):
            if not isinstance(size, int) or size <= 0:
                raise StorageInputError(f"{name} must be a positive int, got {size!r}")
        why = mooncake_available()
        if why is not None:
            raise ImportError(why)
        from mooncake.store import MooncakeDistributedStore

        self.namespace = namespace
        self.master_server_address = master_server_address
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
                               protocol, device_name, master_server_address)
        if rc != 0:
            raise ConnectionError(f"Mooncake setup against master {master_server_address} failed (code {rc})")
        self._registered: tuple[int, int] | None = None
        self._tag = "raw"

    # -- names --------------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return f"{self.namespace}/{key}@{self._tag}"

    def _names(self, keys: Sequence[str]) -> list[str]:
        prefix, suffix = self.namespace + "/", "@" + self._tag
        return [prefix + k + suffix for k in keys]

    # -- host pool ----------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = self.page_layout
        region = (layout.base_ptr, layout.flat.nbytes)
        if self._registered != region:
            if self._registered is not None:
                self._store.unregister_buffer(self._registered[0])
            rc = self._store.register_buffer(*region)
            if rc != 0:
                raise ConnectionError(f"Mooncake could not register the host pool's buffer (code {rc})")
            self._registered = region
        self._tag = layout.tag

    # -- per key ------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        key = self._key(key)
        return self._exist_codes([self._name(key)]) == [1]

    def _exist_codes(self, names: list[str]) -> list[int]:
        try:
            return list(self._store.batch_is_exist(names))
        except Exception as e:       # a broken connection surfaces as an exception in some builds
            logger.warning("mooncake: batch_is_exist failed: %s", e)
            return [-1] * len(names)

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        key = self._key(key)
        if not isinstance(value, torch.Tensor):
            raise StorageInputError(f"set needs a tensor value, got {type(value).__name__}")
        name = self._name(key)
        if self._exist_codes([name]) == [1]:
            return True
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        try:
            rc = self._store.put(name, data)
        except Exception as e:
            logger.warning("mooncake: put %r failed: %s", key, e)
            rc = -1
        if rc != 0:
            self._count(failed_sets=1)
            return False
        self._count(pages_set=1, bytes_set=len(data))
        return True

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        key = self._key(key)
        if not isinstance(target_location, torch.Tensor) or not target_location.is_contiguous():
            raise StorageInputError("get needs a contiguous tensor target_location to read into")
        nbytes = target_location.numel() * target_location.element_size()
        try:
            data = self._store.get(self._name(key))
        except Exception as e:
            logger.warning("mooncake: get %r failed: %s", key, e)
            data = b""
        if len(data) != nbytes:
            self._count(pages_missed=1)
            return None
        target_location.reshape(-1).view(torch.uint8).copy_(
            torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._count(pages_get=1, bytes_get=nbytes)
        return target_location

    # -- pages of the host pool ---------------------------------------------------------------
    def _page_meta(self, pages: list[int]) -> tuple[list, list, bool]:
        layout = self.page_layout
        base = layout.base_ptr
        per_page = [layout.regions(p) for p in pages]
        multi = len(per_page[0]) > 1 if per_page else False
        if multi:
            return ([[base + o for o, _ in r] for r in per_page], [[n for _, n in r] for r in per_page], True)
        return ([base + r[0][0] for r in per_page], [r[0][1] for r in per_page], False)

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        keys, _, pages = self._host_batch(keys, host_indices)
        out: list[bool] = []
        for part in chunks(len(keys)):
            names = self._names([keys[i] for i in part])
            ptrs, sizes, multi = self._page_meta([pages[i] for i in part])
            present = self._exist_codes(names)
            todo = [j for j, c in enumerate(present) if c != 1]
            ok = [c == 1 for c in present]
            if todo:
                try:
                    put = self._store.batch_put_from_multi_buffers if multi else self._store.batch_put_from
                    codes = put([names[j] for j in todo], [ptrs[j] for j in todo], [sizes[j] for j in todo])
                except Exception as e:
                    logger.warning("mooncake: batch put failed: %s", e)
                    codes = [-1] * len(todo)
                for j, c in zip(todo, codes, strict=False):  # a short answer leaves the rest failed
                    ok[j] = c == 0
                done = sum(1 for c in codes if c == 0)
                self._count(pages_set=done, bytes_set=done * self.page_layout.page_bytes,
                            failed_sets=len(todo) - done)
            out.extend(ok)
        return out

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        keys, layout, pages = self._host_batch(keys, host_indices)
        out: list[bool] = []
        for part in chunks(len(keys)):
            names = self._names([keys[i] for i in part])
            ptrs, sizes, multi = self._page_meta([pages[i] for i in part])
            try:
                get = self._store.batch_get_into_multi_buffers if multi else self._store.batch_get_into
                codes = get(names, ptrs, sizes)
            except Exception as e:
                logger.warning("mooncake: batch get failed: %s", e)
                codes = [-1] * len(names)
            ok = [c == layout.page_bytes for c in codes]
            hits = sum(ok)
            self._count(pages_get=hits, bytes_get=hits * layout.page_bytes, pages_missed=len(ok) - hits)
            out.extend(ok)
        return out

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        keys = self._keys(keys)
        n = 0
        for part in chunks(len(keys)):
            codes = self._exist_codes(self._names([keys[i] for i in part]))
            for c in codes:
                if c != 1:
                    return n
                n += 1
        return n

    # -- whole store --------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove every object of this namespace (all tags), overriding read leases."""
        pattern = "^" + re.escape(self.namespace + "/") + ".*$"
        try:
            rc = self._store.remove_by_regex(pattern, True)
        except Exception as e:
            logger.warning("mooncake: clear failed: %s", e)
            return
        if rc < 0:
            logger.warning("mooncake: clear failed (code %d)", rc)

    def remove(self, keys: Sequence[str]) -> int:
        """Remove the pages of `keys` (read leases overridden); how many were removed."""
        names = self._names(self._keys(keys))
        try:
            codes = self._store.batch_remove(names, True)
        except Exception as e:
            logger.warning("mooncake: remove failed: %s", e)
            return 0
        return sum(1 for c in codes if c == 0)

    def close(self) -> None:
        if self._store is not None:
            try:
                if self._registered is not None:
                    self._store.unregister_buffer(self._registered[0])
                self._store.close()
            finally:
                self._registered = None
                self._store = None



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """A `mooncake_master` process on loopback, for tests and benchmarks.

    `start()` runs the binary shipped in the mooncake package on a free port (or `port`) and
    waits until it accepts connections; `stop()` kills it; `restart()` does both on the same
    port (a restarted master has no objects).  `address` is what `MooncakeStore` takes.  The
    master's log goes to `log_path` when given, else nowhere."""

    def __init__(self, port: int | None = None, *, log_path: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        why = mooncake_available()
        if why is not None:
            raise ImportError(why)
        import mooncake

        self.binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
        self.port = port or _free_port()
        self.metrics_port = _free_port()
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self._proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> MooncakeMaster:
        if self._proc is not None:
            raise RuntimeError("this mooncake_master is already running")
        log = open(self.log_path, "ab") if self.log_path else None
        try:
            self._proc = subprocess.Popen(
                [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                 f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
                 "--enable_metric_reporting=false", *self.extra_args],
                stdout=subprocess.DEVNULL if log is None else log, stderr=subprocess.STDOUT)
        finally:
            if log is not None:
                log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"mooncake_master exited at start (port {self.port} taken?)")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError as err:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"mooncake_master did not listen on {self.address} in {timeout_s} s") from err
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self) -> MooncakeMaster:
        self.stop()
        return self.start()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
