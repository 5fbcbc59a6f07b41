"""uniradix's storage backends as SGLang storage backends (`--hicache-storage-backend dynamic`).

Importing this module needs sglang (it subclasses sglang's own `HiCacheStorage`, which SGLang's
backend factory checks).  Start SGLang with, for the file store:

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "uniradix_file",
        "module_path": "uniradix.fast.storage.sglang_backend", "class_name": "UniradixFileStorage",
        "interface_v1": 1, "file_dir": "DIR", "capacity_bytes": 100000000000}'

and for Mooncake `"class_name": "UniradixMooncakeStorage"` with `"master_server_address":
"HOST:PORT"` (optional: `local_hostname`, `protocol`, `device_name`, `metadata_server`,
`global_segment_size`, `namespace`).  `interface_v1: 1` makes SGLang's controller call the
zero-copy `batch_get_v1` / `batch_set_v1`; without it the controller uses `get` / `set` with
one flat page tensor, which both backends also serve.

Keys get a rank namespace as upstream's backends do: `<model>/tp<rank>of<size>/` (and
`pp<rank>of<size>/` with pipeline parallelism) for MHA, where each rank holds its own heads;
MLA ranks share pages, so only the model (and pipeline stage) names them.  Every key of
`extra_config` is honoured or refused by name.
"""
from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .base import StorageInputError
from .file_store import FileStore
from .mooncake_store import MooncakeStore

__all__ = ["UniradixFileStorage", "UniradixMooncakeStorage", "rank_namespace"]

# Keys SGLang's dynamic factory and controller read from extra_config themselves.
_FACTORY_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}


def rank_namespace(storage_config: Any) -> str:
    """The key prefix of one rank (see the module docstring)."""
    model = (getattr(storage_config, "model_name", None) or "").replace("/", "-")
    parts = [model or "model"]
    if not getattr(storage_config, "is_mla_model", False):
        parts.append(f"tp{storage_config.tp_rank}of{storage_config.tp_size}")
    if getattr(storage_config, "pp_size", 1) > 1:
        parts.append(f"pp{storage_config.pp_rank}of{storage_config.pp_size}")
    return "/".join(parts) + "/"


def _settings(storage_config: Any, allowed: dict[str, type]) -> dict[str, Any]:
    extra = dict(getattr(storage_config, "extra_config", None) or {})
    out = {}
    for name, value in extra.items():
        if name in _FACTORY_KEYS:
            continue
        if name not in allowed:
            raise StorageInputError(
                f"extra_config key {name!r} is not a setting of this backend (settings: {sorted(allowed)})")
        if not isinstance(value, allowed[name]) or isinstance(value, bool) != (allowed[name] is bool):
            raise StorageInputError(f"extra_config {name!r} must be {allowed[name].__name__}, got {value!r}")
        out[name] = value
    return out


class _ForSGLang:
    def get_stats(self) -> None:
        """None, as upstream's HiCacheFile answers: SGLang's metrics collector accepts only its
        own StorageMetrics type here.  Our counters stay readable as `stats`."""
        return None


class UniradixFileStorage(_ForSGLang, FileStore, HiCacheStorage):  # type: ignore[misc]  # get_stats: None
    """`FileStore` built the way SGLang's dynamic factory builds a backend: (storage_config, kwargs)."""

    def __init__(self, storage_config: Any, kwargs: dict | None = None) -> None:
        s = _settings(storage_config, {"file_dir": str, "capacity_bytes": int, "fsync": bool})
        if "file_dir" not in s:
            raise StorageInputError("extra_config needs 'file_dir', the directory of the page files")
        FileStore.__init__(self, s["file_dir"], capacity_bytes=s.get("capacity_bytes"),
                           fsync=s.get("fsync", False))
        self.key_prefix = rank_namespace(storage_config)


class UniradixMooncakeStorage(_ForSGLang, MooncakeStore, HiCacheStorage):  # type: ignore[misc]  # as above
    """`MooncakeStore` built the way SGLang's dynamic factory builds a backend."""

    def __init__(self, storage_config: Any, kwargs: dict | None = None) -> None:
        s = _settings(storage_config, {
            "master_server_address": str, "local_hostname": str, "protocol": str, "device_name": str,
            "metadata_server": str, "global_segment_size": int, "namespace": str})
        if "master_server_address" not in s:
            raise StorageInputError(
                "extra_config needs 'master_server_address' (host:port of mooncake_master)")
        MooncakeStore.__init__(self, s.pop("master_server_address"), **s)
        self.key_prefix = rank_namespace(storage_config)
