"""The embedded storage backend: one file per page in a directory of the local (or a shared)
file system.

What it adds over upstream's `HiCacheFile` (0.5.13.post1):

- **Atomic writes.**  A page is written to a temporary file in the same directory and renamed
  over its final name (`os.replace`), so a reader sees the old page or the new one, never half.
- **A checksum per page.**  Each file starts with a header (magic, CRC-32, the page's format
  tag, its key, the payload length); the CRC covers tag, key and payload.  A torn, truncated,
  foreign or corrupt file reads as a miss, is deleted, and nothing of it reaches the caller's
  memory: a page is read into a scratch buffer and checked before it is copied out.
- **`clear()` removes only its own files**: names it makes (`<32 hex>.urxp`, and its temporary
  files), never anything else in the directory.
- **A capacity bound** (`capacity_bytes`, counting whole files) with eviction of the least
  recently used page (a set or a successful get makes a page most recent).
- **Any str key.**  File names are a 128-bit BLAKE2b digest of the key and the key itself is
  kept in the header and compared on read, so keys may hold any character (a tenant or
  namespace prefix is part of the key) and a digest collision reads as a miss.
- **Thread-safe.**  Index updates, renames and evictions happen under one lock; file writes and
  reads run outside it, so background threads overlap their I/O.

State: `_index`, an OrderedDict key -> `_Entry(file bytes, tag)` in LRU order (oldest first),
is the directory's content as this process knows it; `_used` is the sum of its file sizes.  On
start the directory's page files are adopted (oldest modification time first).  A page written
by another process that shares the directory is adopted on first `exists` or `get`.

Costs: `exists` O(1) (a stat on an index miss); `set` one file write + rename, O(page bytes)
for the CRC; `get` one read into scratch + CRC + one copy; eviction O(1) per page evicted.
"""
from __future__ import annotations

import logging
import os
import re
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any

import numpy as np
import torch

from .base import StorageBackend, StorageInputError, chunks

__all__ = ["FileStore"]

logger = logging.getLogger(__name__)

_MAGIC = b"URXPAGE\x01"
_HEADER = struct.Struct("<8sIHIQ")          # magic, crc32, tag length, key length, payload length
_NAME_RE = re.compile(r"^[0-9a-f]{32}\.urxp$")
_TMP_RE = re.compile(r"^\.[0-9a-f]{32}\.urxp\.[0-9a-f]{32}\.tmp$")
_RAW_TAG = "raw"                             # a value that is not a page of the registered pool


@dataclass
class _Entry:
    file_bytes: int
    tag: str


class FileStore(StorageBackend):
    """Pages as checksummed files in `directory`; see the module docstring.

    `capacity_bytes`: None for no bound; otherwise the most bytes of page files kept (the least
    recently used pages are deleted to make room; a page bigger than the bound is refused).
    `fsync`: flush each page to the device before it is renamed into place (survives power
    loss, costs a disk flush per page; without it a crash of the process still never leaves a
    torn page, because of the rename)."""

    def __init__(self, directory: str | os.PathLike, *, capacity_bytes: int | None = None,
                 fsync: bool = False) -> None:
        super().__init__()
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes <= 0):
            raise StorageInputError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
        if not isinstance(fsync, bool):
            raise StorageInputError(f"fsync must be a bool, got {fsync!r}")
        self.directory = os.fspath(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self._adopt_existing()

    # -- names and headers --------------------------------------------------------------------
    @staticmethod
    def _digest(key: str) -> str:
        return blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, self._digest(key) + ".urxp")

    @staticmethod
    def _header(key: str, tag: str, pieces: Sequence[memoryview]) -> bytes:
        """The header of a page file: the CRC runs over tag, key and payload, in file order."""
        kb, tb = key.encode("utf-8", "surrogatepass"), tag.encode()
        crc = zlib.crc32(kb, zlib.crc32(tb))
        for p in pieces:
            crc = zlib.crc32(p, crc)
        return _HEADER.pack(_MAGIC, crc, len(tb), len(kb), sum(p.nbytes for p in pieces)) + tb + kb

    def _read_header(self, path: str) -> tuple[str, str, int, int] | None:
        """(key, tag, payload length, file size) of a page file, or None if it is not one."""
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) != _HEADER.size:
                    return None
                magic, _crc, tlen, klen, plen = _HEADER.unpack(head)
                if magic != _MAGIC:
                    return None
                rest = f.read(tlen + klen)
                if len(rest) != tlen + klen:
                    return None
                size = os.fstat(f.fileno()).st_size
            return rest[tlen:].decode("utf-8", "surrogatepass"), rest[:tlen].decode(), plen, size
        except (OSError, UnicodeDecodeError):
            return None

    def _adopt_existing(self) -> None:
        found = []
        with os.scandir(self.directory) as it:
            for e in it:
                if _NAME_RE.match(e.name) and e.is_file():
                    found.append((e.stat().st_mtime_ns, e.name))
                elif _TMP_RE.match(e.name):      # left by a crashed writer: never a page
                    _unlink(e.path)
        for _, name in sorted(found):
            path = os.path.join(self.directory, name)
            head = self._read_header(path)
            if head is None or self._digest(head[0]) + ".urxp" != name:
                continue
            key, tag, _plen, size = head
            self._index[key] = _Entry(size, tag)
            self._used += size
        with self._lock:
            self._evict_locked()

    def _adopt(self, key: str) -> _Entry | None:
        """The index entry of `key`, adopting a file another process wrote; None when absent."""
        with self._lock:
            entry = self._index.get(key)
        if entry is not None:
            return entry
        head = self._read_header(self._path(key))
        if head is None or head[0] != key:
            return None
        entry = _Entry(head[3], head[1])
        with self._lock:
            if key not in self._index:
                self._index[key] = entry
                self._used += entry.file_bytes
                self._evict_locked()
            return self._index.get(key)

    # -- write --------------------------------------------------------------------------------
    def _write(self, key: str, tag: str, pieces: Sequence[memoryview]) -> bool:
        """Write one page atomically and account for it; False (and nothing changed) on failure."""
        payload_len = sum(p.nbytes for p in pieces)
        header = self._header(key, tag, pieces)
        size = len(header) + payload_len
        if self.capacity_bytes is not None and size > self.capacity_bytes:
            logger.warning("page %r (%d bytes) is larger than the store's capacity", key, size)
            self._count(failed_sets=1)
            return False
        digest = self._digest(key)
        final = os.path.join(self.directory, digest + ".urxp")
        tmp = os.path.join(self.directory, f".{digest}.urxp.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, [memoryview(header), *pieces], size)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(tmp, final)
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old.file_bytes
                self._index[key] = _Entry(size, tag)
                self._used += size
                self._evict_locked(keep=key)
        except OSError as e:
            logger.warning("file store: writing page %r failed: %s", key, e)
            _unlink(tmp)
            self._count(failed_sets=1)
            return False
        self._count(pages_set=1, bytes_set=payload_len)
        return True

    def _evict_locked(self, keep: str | None = None) -> None:
        """NOTE: caller holds `_lock`.  Deletes least recently used pages until within capacity."""
        if self.capacity_bytes is None:
            return
        while self._used > self.capacity_bytes and self._index:
            key, entry = next(iter(self._index.items()))
            if key == keep:
                break
            del self._index[key]
            self._used -= entry.file_bytes
            _unlink(self._path(key))
            self._count(evicted_pages=1)     # lock order: _lock, then the stats lock

    # -- read ---------------------------------------------------------------------------------
    def _read(self, key: str, tag: str, payload_len: int) -> memoryview | None:
        """The checked payload of `key` stored under `tag`, or None: a miss.

        A file that fails its check is deleted and dropped from the index."""
        entry = self._adopt(key)
        if entry is None:
            return None
        if entry.tag != tag:
            return None
        path = self._path(key)
        kb, tb = key.encode("utf-8", "surrogatepass"), entry.tag.encode()
        expect = _HEADER.size + len(tb) + len(kb) + payload_len
        buf = bytearray(expect + 1)                  # one spare byte: a longer file is corrupt too
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(buf)
                while 0 < n < len(buf):
                    m = f.readinto(memoryview(buf)[n:])
                    if not m:
                        break
                    n += m
        except FileNotFoundError:
            self._forget(key, entry)
            return None
        except OSError as e:
            logger.warning("file store: reading page %r failed: %s", key, e)
            return None
        ok = n == expect
        if ok:
            magic, crc, tlen, klen, plen = _HEADER.unpack_from(buf)
            body = memoryview(buf)[_HEADER.size:expect]
            ok = (magic == _MAGIC and tlen == len(tb) and klen == len(kb) and plen == payload_len
                  and bytes(body[:tlen]) == tb and bytes(body[tlen:tlen + klen]) == kb
                  and zlib.crc32(body) == crc)
        if not ok:
            # The file is not the page its header (or our index) promised: never load it.
            logger.warning("file store: page %r is torn or corrupt; dropped", key)
            self._count(corrupt_pages=1)
            with self._lock:
                if self._index.get(key) is entry:
                    del self._index[key]
                    self._used -= entry.file_bytes
                    _unlink(path)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return memoryview(buf)[_HEADER.size + len(tb) + len(kb):expect]

    def _forget(self, key: str, entry: _Entry) -> None:
        with self._lock:
            if self._index.get(key) is entry:
                del self._index[key]
                self._used -= entry.file_bytes

    # -- per key ------------------------------------------------------------------------------
    def _tag_for(self, nbytes: int) -> str:
        """The tag a tensor of `nbytes` is stored and read under: a page of the registered pool
        (SGLang's generic path moves whole flat pages, in the pool's byte order) carries the
        pool's tag, so a page from a pool of another layout is never read into this one."""
        layout = self._page_layout
        return layout.tag if layout is not None and nbytes == layout.page_bytes else _RAW_TAG

    def exists(self, key: str) -> bool:
        key = self._key(key)
        return self._adopt(key) is not None

    def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        key = self._key(key)
        if not isinstance(value, torch.Tensor):
            raise StorageInputError(f"set needs a tensor value, got {type(value).__name__}")
        if self._adopt(key) is not None:
            return True
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return self._write(key, self._tag_for(data.nbytes), [data.data])  # the array's memoryview

    def get(self, key: str, target_location: torch.Tensor | None = None,
            target_sizes: Any = None) -> torch.Tensor | None:
        key = self._key(key)
        if not isinstance(target_location, torch.Tensor) or not target_location.is_contiguous():
            raise StorageInputError("get needs a contiguous tensor target_location to read into")
        nbytes = target_location.numel() * target_location.element_size()
        payload = self._read(key, self._tag_for(nbytes), nbytes)
        if payload is None:
            self._count(pages_missed=1)
            return None
        target_location.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(payload, dtype=torch.uint8))
        self._count(pages_get=1, bytes_get=nbytes)
        return target_location

    # -- pages of the host pool ---------------------------------------------------------------
    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        keys, layout, pages = self._host_batch(keys, host_indices)
        out: list[bool] = []
        for part in chunks(len(keys)):
            for i in part:
                entry = self._adopt(keys[i])
                if entry is not None and entry.tag == layout.tag:
                    out.append(True)
                    continue
                out.append(self._write(keys[i], layout.tag, [memoryview(v) for v in layout.views(pages[i])]))
        return out

    def batch_get_v1(self, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> list[bool]:
        keys, layout, pages = self._host_batch(keys, host_indices)
        out: list[bool] = []
        for part in chunks(len(keys)):
            for i in part:
                payload = self._read(keys[i], layout.tag, layout.page_bytes)
                if payload is None:
                    self._count(pages_missed=1)
                    out.append(False)
                    continue
                src = np.frombuffer(payload, dtype=np.uint8)
                pos = 0
                for view in layout.views(pages[i]):
                    view[:] = src[pos:pos + view.nbytes]
                    pos += view.nbytes
                self._count(pages_get=1, bytes_get=layout.page_bytes)
                out.append(True)
        return out

    def batch_exists(self, keys: Sequence[str], extra_info: Any = None) -> int:
        keys = self._keys(keys)
        tag = self._page_layout.tag if self._page_layout is not None else None
        for i, k in enumerate(keys):
            entry = self._adopt(k)
            if entry is None or (tag is not None and entry.tag != tag):
                return i
        return len(keys)

    # -- whole store --------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete this store's page files and temporary files in its directory; nothing else."""
        with self._lock:
            with os.scandir(self.directory) as it:
                for e in it:
                    if _NAME_RE.match(e.name) or _TMP_RE.match(e.name):
                        _unlink(e.path)
            self._index.clear()
            self._used = 0

    @property
    def used_bytes(self) -> int:
        """Bytes of page files this process accounts for."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys_lru(self) -> list[str]:
        """Stored keys, least recently used first."""
        with self._lock:
            return list(self._index)


def _write_all(fd: int, bufs: list, size: int) -> None:
    """writev until every byte is written (a regular file may take fewer bytes per call)."""
    done = os.writev(fd, bufs)
    if done == size:
        return
    for b in bufs:                      # rare: finish the rest buffer by buffer
        b = b.cast("B") if b.format != "B" else b
        if done >= b.nbytes:
            done -= b.nbytes
            continue
        rest, done = b[done:], 0
        while rest.nbytes:
            n = os.write(fd, rest)
            if n <= 0:
                raise OSError("write made no progress")
            rest = rest[n:]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
