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


def backup_host_slots(backup: Any) -> list:
    """The host slots holding a spec backup's units: the host copies of its node and, when the
    node was split while the backup waited, of the fragments above it (host-locked below,
    childless never, so still in the tree)."""
    need = len(backup.units)
    parts: list = []
    node = backup.node
    got = 0
    while got < need and node is not None and node.host_value is not None:
        parts.insert(0, list(node.host_value))
        got += len(node.host_value)
        node = node.parent
    slots = [s for part in parts for s in part]
    return slots[len(slots) - need:] if len(slots) >= need else slots


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
        tier = self.state.storage
        op = next((p for p in tier.prefetches if p.rid == rid and p.queried
                   and not p.transfer_done), None)
        before = op.completed if op is not None else 0
        read = storage.storage_load(self.state, rid_arg(rid), pages)
        if read and op is not None:  # the KV checker's log (conformance/env/kvcheck.py)
            ps = self.state.config.page_size
            self.state.host.copies.append(
                ("fetch", list(op.keys[before // ps: op.completed // ps]),
                 list(op.slots[before: op.completed])))
        return {"pages": read}

    def op_storage_backup(self, step: dict) -> dict:
        self._storage()
        (count,) = _args(step, count=-1)
        tier = self.state.storage
        storage.check_k("storage_backup: count", count)
        going = list(tier.backups if count == -1 else tier.backups[:count])
        written = storage.storage_backup(self.state, count)
        for b in going:  # the KV checker's log: the host slots of the backup's units
            self.state.host.copies.append(("store", backup_host_slots(b), list(b.keys)))
        return {"written": written}

    def op_storage_tick(self, step: dict) -> dict:
        self._storage()
        (ticks,) = _args(step, ticks=1)
        storage.storage_tick(self.state, ticks)
        return {}


class FastStorageOps:
    """Storage-tier ops over ``self.cache`` (a ``uniradix.fast`` cache whose host tier has a
    storage tier, fast/tiers/storage.py, in manual I/O mode): the same ops and observations."""

    cache: Any
    config: Any
    pool: Any
    _node: Any  # FastHostOps: a trace path -> the cache's node
    _path: Any  # the fast adapter: a node -> its trace path

    @staticmethod
    def storage_config(config: Any) -> Any:
        """The fast storage tier a trace config asks for (manual I/O, in-memory store)."""
        from uniradix.fast.tiers.storage import StorageConfig
        return StorageConfig(io="manual", prefetch_threshold=config.prefetch_threshold,
                             prefetch_stop_policy=config.prefetch_stop_policy,
                             prefetch_timeout_base=config.prefetch_timeout_base,
                             prefetch_timeout_per_page=config.prefetch_timeout_per_page,
                             key_mode=config.storage_key_mode,
                             prefetch_capacity=max(0, (4 * (config.host_slots - config.kv_slots)) // 5))

    def _tier(self) -> Any:
        tier = getattr(self.cache, "storage_tier", None)
        if tier is None:
            raise Unsupported("this op needs a storage tier (config storage: true)")
        return tier

    def op_prefetch_from_storage(self, step: dict) -> dict:
        tier = self._tier()
        rid, path, tokens = _args(step, "rid", "node", "tokens")
        anchor = self._node(path)
        extra_key = _path(path)[1]
        try:
            n = tier.prefetch_from_storage(rid_arg(rid), anchor, tokens, extra_key)
        except TypeError as e:  # tokens that are not a list of ints
            raise InvalidInput(str(e)) from None
        return {"tokens": n}

    def op_check_prefetch_progress(self, step: dict) -> dict:
        tier = self._tier()
        (rid,) = _args(step, "rid")
        done = tier.check_prefetch_progress(rid_arg(rid))
        return {"done": done, "freed": self.pool.take_freed()}

    def op_terminate_prefetch(self, step: dict) -> dict:
        tier = self._tier()
        (rid,) = _args(step, "rid")
        tier.terminate_prefetch(rid_arg(rid))
        return {}

    def op_pop_prefetch_loaded_tokens(self, step: dict) -> dict:
        tier = self._tier()
        (rid,) = _args(step, "rid")
        return {"tokens": tier.pop_prefetch_loaded_tokens(rid_arg(rid))}

    def op_release_aborted_request(self, step: dict) -> dict:
        tier = self._tier()
        (rid,) = _args(step, "rid")
        tier.release_aborted_request(rid_arg(rid))
        return {}

    def op_attach_storage_backend(self, step: dict) -> dict:
        self._tier()
        _args(step)
        return {"ok": False}  # configured at startup only, as the spec and upstream

    def op_detach_storage_backend(self, step: dict) -> dict:
        self._tier()
        _args(step)
        return {"ok": False}

    def op_clear_storage_backend(self, step: dict) -> dict:
        tier = self._tier()
        _args(step)
        return {"ok": tier.clear()}

    def op_storage_query(self, step: dict) -> dict:
        tier = self._tier()
        (count,) = _args(step, count=-1)
        return {"queried": tier.run_queries(count)}

    def op_storage_load(self, step: dict) -> dict:
        tier = self._tier()
        rid, pages = _args(step, "rid", pages=-1)
        return {"pages": tier.run_load(rid_arg(rid), pages)}

    def op_storage_backup(self, step: dict) -> dict:
        tier = self._tier()
        (count,) = _args(step, count=-1)
        return {"written": tier.run_backups(count)}

    def op_storage_tick(self, step: dict) -> dict:
        tier = self._tier()
        (ticks,) = _args(step, ticks=1)
        tier.tick(ticks)
        return {}

    def storage_snapshot(self) -> dict:
        """The storage tier as the spec's snapshot shows it (spec/snapshot.py storage_view)."""
        tier = self._tier()
        cache = self.cache
        keys = [{"path": self._path(n), "page_keys": list(tier.keys_of(n))}
                for n in cache.all_nodes() if n is not cache.root_node]
        keys.sort(key=lambda e: (e["path"]["extra_key"] is not None, e["path"]["extra_key"] or "",
                                 e["path"]["tokens"]))

        def prefetch(op: Any) -> dict:
            return {"rid": op.rid, "anchor": self._path(op.anchor), "tokens": len(op.units),
                    "host_slots": op.slots.tolist(), "hit_pages": len(op.keys),
                    "completed": op.completed, "terminated": op.terminated}
        return {
            "page_keys": keys,
            "stored": sorted(tier.store),
            "ongoing": [prefetch(tier.ongoing[r]) for r in sorted(tier.ongoing)],
            "ongoing_backups": len(tier.ongoing_backup),
            "revoke_queue": list(tier.revoke_queue),
            "release_queue": [p.tolist() for p in tier.release_queue],
            "loaded_tokens": dict(sorted(tier.loaded_tokens.items())),
            "occupied": tier.occupied,
            "clock": tier.clock,
        }
