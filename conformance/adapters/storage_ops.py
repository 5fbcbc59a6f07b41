"""The storage-tier trace ops (docs/TRACE.md "The storage tier") on the executable spec.

:class:`SpecStorageOps` is mixed into the spec's adapter.  Cache ops, named after the seed's
methods: ``prefetch_from_storage``, ``check_prefetch_progress``, ``terminate_prefetch``,
``pop_prefetch_loaded_tokens``, ``release_aborted_request``, ``attach_storage_backend``,
``detach_storage_backend``, ``clear_storage_backend``.  Environment ops (the storage service
and its threads, completed on command): ``storage_query``, ``storage_load``, ``storage_backup``,
``storage_tick``.  ``check_hicache_events`` drains the storage control queues too.
"""

from __future__ import annotations

from typing import Any

from uniradix.spec import cache as rules
from uniradix.spec import storage
from uniradix.spec.errors import InvalidInput, Unsupported

STORAGE_CACHE_OPS = ("prefetch_from_storage", "check_prefetch_progress", "terminate_prefetch",
                     "pop_prefetch_loaded_tokens", "release_aborted_request",
                     "attach_storage_backend", "detach_storage_backend", "clear_storage_backend")
STORAGE_ENV_OPS = ("storage_query", "storage_load", "storage_backup", "storage_tick")
STORAGE_OPS = STORAGE_CACHE_OPS + STORAGE_ENV_OPS
# ops whose observation carries host_freed (they may free host slots directly)
STORAGE_HOST_EFFECT_OPS = ("prefetch_from_storage", "check_prefetch_progress")


def _args(step: dict, *names: str, **defaults: Any) -> list:
    # imported here: conformance/adapters/base.py imports this module's names
    from uniradix.conformance.adapters.base import args_of
    return args_of(step, *names, **defaults)


def _path(raw: Any) -> tuple:
    from uniradix.conformance.adapters.base import path_arg
    return path_arg(raw)


def rid_arg(raw: Any) -> str:
    if not isinstance(raw, str):
        raise InvalidInput(f"rid must be a string, got {raw!r}")
    return raw


class SpecStorageOps:
    """Storage-tier ops over ``self.state`` (a spec CacheState with a storage tier)."""

    state: Any

    def _storage(self) -> None:
        if self.state.storage is None:
            raise Unsupported("this op needs a storage tier (config storage: true)")

    def op_prefetch_from_storage(self, step: dict) -> dict:
        self._storage()
        rid, path, tokens = _args(step, "rid", "node", "tokens")
        anchor = rules.find_node(self.state, *_path(path))
        extra_key = _path(path)[1]
        n = storage.prefetch_from_storage(self.state, rid_arg(rid), anchor, tokens, extra_key)
        return {"tokens": n}

    def op_check_prefetch_progress(self, step: dict) -> dict:
        self._storage()
        (rid,) = _args(step, "rid")
        done = storage.check_prefetch_progress(self.state, rid_arg(rid))
        return {"done": done, "freed": self.state.kv.take_freed()}

    def op_terminate_prefetch(self, step: dict) -> dict:
        self._storage()
        (rid,) = _args(step, "rid")
        storage.terminate_prefetch(self.state, rid_arg(rid))
        return {}

    def op_pop_prefetch_loaded_tokens(self, step: dict) -> dict:
        self._storage()
        (rid,) = _args(step, "rid")
        return {"tokens": storage.pop_prefetch_loaded_tokens(self.state, rid_arg(rid))}

    def op_release_aborted_request(self, step: dict) -> dict:
        self._storage()
        (rid,) = _args(step, "rid")
        storage.release_aborted_request(self.state, rid_arg(rid))
        return {}

    def op_attach_storage_backend(self, step: dict) -> dict:
        self._storage()
        _args(step)
        return {"ok": storage.attach_storage_backend(self.state)[0]}

    def op_detach_storage_backend(self, step: dict) -> dict:
        self._storage()
        _args(step)
        return {"ok": storage.detach_storage_backend(self.state)[0]}

    def op_clear_storage_backend(self, step: dict) -> dict:
        self._storage()
        _args(step)
        return {"ok": storage.clear_storage(self.state)}

    def op_storage_query(self, step: dict) -> dict:
        self._storage()
        (count,) = _args(step, count=-1)
        return {"queried": storage.storage_query(self.state, count)}

    def op_storage_load(self, step: dict) -> dict:
        self._storage()
        rid, pages = _args(step, "rid", pages=-1)
        return {"pages": storage.storage_load(self.state, rid_arg(rid), pages)}

    def op_storage_backup(self, step: dict) -> dict:
        self._storage()
        (count,) = _args(step, count=-1)
        return {"written": storage.storage_backup(self.state, count)}

    def op_storage_tick(self, step: dict) -> dict:
        self._storage()
        (ticks,) = _args(step, ticks=1)
        storage.storage_tick(self.state, ticks)
        return {}
