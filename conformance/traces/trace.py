"""Reading and writing trace files (JSON Lines; docs/TRACE.md).

A trace is one header line ``{"format": "uniradix-trace", "version": 1, "config": {...}, ...}``
followed by one line per step ``{"i": n, "op": "...", "args": {...}, "ret": {...}}``, which
may carry the step's KV events as ``"events": [[...], ...]`` (wire arrays; the header's optional
``event_key_mode`` names the block-hash chain they use).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from typing import Any

from uniradix.spec.config import CacheConfig
from uniradix.spec.errors import ConfigError, InvalidInput
from uniradix.spec.events import from_wire
from uniradix.spec.pagekeys import KEY_MODES

# the documented differences of an implementation's KV-event stream a header may name
# (conformance/traces/events.py DIFFERENCES; kept here so reading a trace imports no adapter)
EVENT_DIFFERENCES = ("prefetch-inserts-unannounced",)

FORMAT = "uniradix-trace"
VERSION = 1

Step = dict  # {"i": int, "op": str, "args": dict, "ret": dict (optional)}


@dataclasses.dataclass
class Trace:
    header: dict[str, Any]
    config: CacheConfig
    steps: list[Step]
    path: str = "<memory>"

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def make_header(config: CacheConfig, source: str, seed: int | None = None,
                **extra: Any) -> dict[str, Any]:
    header: dict[str, Any] = {"format": FORMAT, "version": VERSION, "source": source,
                              "config": config.to_dict()}
    if seed is not None:
        header["seed"] = seed
    header.update(extra)
    return header


def parse_header(header: Any, where: str = "<trace>") -> CacheConfig:
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ConfigError(f"{where}: line 1 is not a uniradix-trace header")
    version = header.get("version")
    if version != VERSION:
        raise ConfigError(
            f"{where}: trace version {version!r} is not supported (this reader knows {VERSION})")
    mode = header.get("event_key_mode")
    if mode is not None and mode not in KEY_MODES:
        raise ConfigError(f"{where}: event_key_mode must be one of {KEY_MODES}, got {mode!r}")
    diffs = header.get("event_differences", [])
    if not isinstance(diffs, list) or any(d not in EVENT_DIFFERENCES for d in diffs):
        raise ConfigError(f"{where}: event_differences must be a list of {list(EVENT_DIFFERENCES)}, "
                          f"got {diffs!r}")
    return CacheConfig.from_dict(header.get("config", {}))


def check_step(step: Any, where: str) -> Step:
    if not isinstance(step, dict):
        raise InvalidInput(f"{where}: a step must be a JSON object")
    if not isinstance(step.get("op"), str):
        raise InvalidInput(f"{where}: a step needs an 'op' string")
    args = step.setdefault("args", {})
    if not isinstance(args, dict):
        raise InvalidInput(f"{where}: 'args' must be an object")
    if "ret" in step and not isinstance(step["ret"], dict):
        raise InvalidInput(f"{where}: 'ret' must be an object")
    if "events" in step:  # KV events (docs/TRACE.md): wire arrays, checked here once
        events = step["events"]
        if not isinstance(events, list):
            raise InvalidInput(f"{where}: 'events' must be a list of event arrays")
        for item in events:
            try:
                from_wire(item)
            except InvalidInput as e:
                raise InvalidInput(f"{where}: {e}") from None
    return step


def load_trace(path: str) -> Trace:
    """Parse a trace file; raises ConfigError / InvalidInput naming the file and line."""
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    if not lines:
        raise ConfigError(f"{path}: empty trace")
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:1: not JSON: {e}") from None
    config = parse_header(header, path)
    steps = []
    for lineno, line in enumerate(lines[1:], start=2):
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise InvalidInput(f"{path}:{lineno}: not JSON: {e}") from None
        steps.append(check_step(raw, f"{path}:{lineno}"))
    return Trace(header=header, config=config, steps=steps, path=path)


def dump_trace(path: str, header: dict[str, Any], steps: Iterable[Step]) -> None:
    """Write a trace: compact JSON, one object per line."""
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, separators=(",", ":")) + "\n")
        for step in steps:
            f.write(json.dumps(step, separators=(",", ":")) + "\n")
