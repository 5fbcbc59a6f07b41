"""The random scheduler-like driver (conformance/explore/driver.py) with the storage tier on.

Configs ``storage-{wt,wb}-p{1,4}-{be,wc,to}``: the host tier of ``hicache-{wt,wb}-p{1,4}`` plus
a storage backend with the prefetch stop policy ``best_effort``, ``wait_complete`` or
``timeout``.  On top of the host-tier workload the driver does what SGLang's scheduler does
with storage: when a request arrives it matches its prompt and prefetches what follows the
host match (``prefetch_from_storage``); before admitting it, ``check_prefetch_progress`` until
done (or ``terminate_prefetch``, or abort with ``release_aborted_request``), then
``pop_prefetch_loaded_tokens`` and the usual admission of the same prompt (whose match now
sees the prefetched host pages).  The environment completes storage work on command:
``storage_query``, ``storage_load``, ``storage_backup``, ``storage_tick``.

Requests use no ``extra_key`` here: 0.5.13.post1 files a prefetch under the root in the root's
namespace (None) whatever the request's, which the spec does not (docs/SPEC.md); tenant
isolation is covered by tests/spec/test_spec_storage.py.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from typing import Any

from uniradix.conformance.explore.driver import Driver, RecordingError, make_config
from uniradix.spec.config import CacheConfig

POLICIES = {"be": "best_effort", "wc": "wait_complete", "to": "timeout"}
STORAGE_CONFIG_NAMES = tuple(f"storage-{w}-p{p}-{s}" for w in ("wt", "wb") for p in (1, 4)
                             for s in POLICIES)


def make_storage_config(name: str, seed: int) -> CacheConfig:
    """A named storage recording config: the host config of the same write policy and page
    size, a host pool of 2 to 3 device pools (the prefetch capacity is 80% of the difference),
    a storage backend and the name's stop policy."""
    if name not in STORAGE_CONFIG_NAMES:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(STORAGE_CONFIG_NAMES)}")
    _, w, p, s = name.split("-")
    host = make_config(f"hicache-{w}-{p}", seed)
    rng = random.Random(f"storage-config:{name}:{seed}")
    page = host.page_size
    host_slots = host.kv_slots * rng.choice((2, 3))
    return CacheConfig(
        page_size=page, components=("full",), kv_slots=host.kv_slots, host_slots=host_slots,
        write_policy=host.write_policy, write_through_threshold=1,
        load_back_threshold=host.load_back_threshold, storage=True,
        prefetch_stop_policy=POLICIES[s],
        prefetch_threshold=rng.choice((page, 2 * page, 4 * page)),
        prefetch_timeout_base=rng.choice((0, 2, 5)),
        prefetch_timeout_per_page=rng.choice((0, 1)))


class StorageDriver(Driver):
    """:class:`Driver` plus the scheduler's storage calls and the storage environment."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.namespaces = [None]
        self.ns_weights = [1]
        self.waiting: list[tuple[str, list[int]]] = []  # (rid, prompt) with a prefetch
        self.next_rid = 0
        self.next_prompt: list[int] | None = None

    def _new_prompt(self) -> list[int]:
        if self.next_prompt is not None:
            p, self.next_prompt = self.next_prompt, None
            return p
        return super()._new_prompt()

    def reset(self) -> None:
        super().reset()
        self.waiting.clear()

    def host_actions(self) -> tuple[list[str], list[float]]:
        names, weights = super().host_actions()
        w = bool(self.waiting)
        return (names + ["arrive", "progress", "terminate", "abort", "query", "load", "backup",
                         "tick", "clear", "attach", "flush_host", "settle"],
                weights + [5.0 if len(self.waiting) < 6 else 0, 3.0 if w else 0,
                           0.4 if w else 0, 0.3 if w else 0, 2.0, 2.5 if w else 0.3, 2.0,
                           0.8, 0.05, 0.05, 1.5, 1.5])

    # -- the scheduler ---------------------------------------------------------------------------
    def act_arrive(self) -> None:
        """A request arrives: match its prompt, prefetch what follows the host match."""
        if self.rng.random() < 0.5:  # a popular prompt: a template as it is
            prompt = list(self.rng.choice(self.templates))[: max(4, self.config.kv_slots // 2)]
        else:
            prompt = super()._new_prompt()
        ret = self._match(prompt, None)
        if self.done():
            return
        best = ret["best_match_node"]
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        got = self.emit("prefetch_from_storage", {"rid": rid,
                                                  "node": {"tokens": prompt[:best],
                                                           "extra_key": None},
                                                  "tokens": prompt[best:]})
        if got["tokens"] > 0:
            self.waiting.append((rid, prompt))

    def _pick(self) -> tuple[str, list[int]]:
        return self.waiting[self.rng.randrange(len(self.waiting))]

    def act_progress(self) -> None:
        rid, prompt = self._pick()
        if not self.emit("check_prefetch_progress", {"rid": rid})["done"] or self.done():
            return
        self.waiting.remove((rid, prompt))
        self.emit("pop_prefetch_loaded_tokens", {"rid": rid})
        if not self.done() and len(self.inflight) < self.max_inflight:
            self.next_prompt = prompt
            self.admit()
            self.next_prompt = None

    def act_terminate(self) -> None:
        rid, _ = self._pick()
        self.emit("terminate_prefetch", {"rid": rid})

    def act_abort(self) -> None:
        rid, prompt = self._pick()
        self.waiting.remove((rid, prompt))
        self.emit("release_aborted_request", {"rid": rid})

    # -- the storage environment -------------------------------------------------------------------
    def act_query(self) -> None:
        self.emit("storage_query", {"count": self.rng.choice((-1, 1, 1, 2))})

    def act_load(self) -> None:
        rid = self._pick()[0] if self.waiting else f"r{self.rng.randrange(max(1, self.next_rid))}"
        self.emit("storage_load", {"rid": rid, "pages": self.rng.choice((-1, 1, 1, 2, 3))})

    def act_backup(self) -> None:
        self.emit("storage_backup", {"count": self.rng.choice((-1, 1, 1, 2))})

    def act_tick(self) -> None:
        self.emit("storage_tick", {"ticks": self.rng.choice((1, 1, 2, 5))})

    def act_flush_host(self) -> None:
        """Device and host pressure: evict much from the device, then from the host, so that
        later requests find their prefixes only in storage."""
        big = self.rng.random() < 0.7
        self.emit("evict", {"num_tokens": self.config.kv_slots if big
                            else self.rng.randint(1, self.config.kv_slots)})
        if not self.done():
            self.emit("evict_host", {"num_tokens": self.config.host_slots if big
                                     else self.rng.randint(1, self.config.host_slots)})

    def act_settle(self) -> None:
        """Every host write completes and is processed; every storage backup is written."""
        for op, args in (("io_complete", {"writes": -1, "loads": -1}),
                         ("check_hicache_events", {}), ("storage_backup", {"count": -1}),
                         ("check_hicache_events", {})):
            if self.done():
                return
            self.emit(op, args)

    def act_clear(self) -> None:
        self.emit("clear_storage_backend", {})

    def act_attach(self) -> None:
        self.emit(self.rng.choice(("attach_storage_backend", "detach_storage_backend")), {})


def record_storage(adapter: Any, config: CacheConfig, seed: int, steps: int,
                   check_violations: bool = True) -> list[dict]:
    """Record ``steps`` steps of the seeded storage workload against ``adapter``."""
    return StorageDriver(adapter, config, seed, steps, check_violations=check_violations).run()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m uniradix.conformance.explore.storage_driver",
                                description="Record a random scheduler-like trace with storage.")
    p.add_argument("--impl", default="upstream", help="implementation: upstream or spec")
    p.add_argument("--config", required=True, choices=STORAGE_CONFIG_NAMES)
    p.add_argument("--seeds", required=True, help="seed range A:B (B excluded) or one seed")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out-dir", required=True, help="folder for <config>-s<seed>.jsonl files")
    args = p.parse_args(argv)

    import os

    from uniradix.conformance.adapters.base import make_adapter
    from uniradix.conformance.traces.trace import dump_trace, make_header

    a, _, b = args.seeds.partition(":")
    seeds = range(int(a), int(b)) if b else [int(a)]
    os.makedirs(args.out_dir, exist_ok=True)
    failed = 0
    for seed in seeds:
        config = make_storage_config(args.config, seed)
        adapter = make_adapter(args.impl, config)
        try:
            steps = record_storage(adapter, config, seed, args.steps)
        except RecordingError as e:
            print(f"seed {seed}: recording failed: {e}", file=sys.stderr)
            failed += 1
            continue
        impl = ("sglang 0.5.13.post1 UnifiedRadixCache on CPU" if args.impl == "upstream"
                else "uniradix " + args.impl)
        source = (f"{impl}"
                  f" (uniradix.conformance.explore.storage_driver, config {args.config}, seed {seed})")
        path = os.path.join(args.out_dir, f"{args.config}-s{seed}.jsonl")
        dump_trace(path, make_header(config, source, seed=seed), steps)
        print(f"{path}: {len(steps)} steps")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())


# --------------------------------------------------------------------------------------------
# ``uniradix conform --config storage`` segments: the driver against a lockstep runner
# --------------------------------------------------------------------------------------------


class _Found(Exception):
    def __init__(self, finding: Any) -> None:
        super().__init__(str(finding))
        self.finding = finding


class _LockstepAsAdapter:
    """What the driver needs of an adapter, over a Lockstep: every step is checked there."""

    def __init__(self, runner: Any, taken: list, on_step: Any) -> None:
        self.runner, self.taken, self.on_step = runner, taken, on_step

    def apply(self, step: dict) -> dict:
        self.taken.append(step)
        obs, finding = self.runner.check(step)
        if finding is not None:
            raise _Found(finding)
        if self.on_step is not None:
            self.on_step(len(self.taken))
        return obs

    def violations(self) -> list:
        return []  # the runner checked them

    def snapshot(self) -> dict:
        return self.runner.adapters[0].snapshot()


def storage_segment(runner: Any, config: CacheConfig, seed: Any, steps: int,
                    on_step: Any = None) -> tuple[list, Any]:
    """Drive a Lockstep ``runner`` through ``steps`` steps of the storage workload; return
    (the steps taken, the first finding or None).  A step an implementation rejects is a
    finding of the runner (every implementation must reject it alike) or ends the segment."""
    taken: list = []
    runner.prime()
    seed_int = int.from_bytes(str(seed).encode(), "little") % (2 ** 31)
    driver = StorageDriver(_LockstepAsAdapter(runner, taken, on_step), config, seed_int, steps,
                           check_violations=False)
    try:
        driver.run()
    except _Found as e:
        return taken, e.finding
    except RecordingError:
        pass  # every implementation rejected a step alike: the segment ends there
    return taken, None


def conform_config(name: str, seed: int, segment: int) -> tuple[str, CacheConfig]:
    """A segment's config name and config for ``conform --config storage[-...]``: the named
    storage config (``storage`` alone cycles through all of them), its pools drawn from seed
    and segment."""
    if name == "storage":
        name = STORAGE_CONFIG_NAMES[segment % len(STORAGE_CONFIG_NAMES)]
    return name, make_storage_config(name, seed * 100_003 + segment)
