"""Benchmarks: one scheduler loop timing the cache calls of every implementation.

``loop``: ``uniradix bench`` and its loop; ``configs``: the configurations (components, host
tier) and how each implementation is built for one; ``host`` / ``hybrid``: the steps a host
tier or a hybrid model adds to the loop; ``results``: versioned bench records and their
history; ``dashboard``: the static page and the regression check (``uniradix dashboard``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def subcommand_main(name: str, add_parser: Callable[[Any], argparse.ArgumentParser],
                    argv: Sequence[str] | None = None) -> int:
    """``python -m`` entry of one ``uniradix`` subcommand: ``argv`` (default the process's)
    with or without the subcommand's name in front."""
    parser = argparse.ArgumentParser(prog="uniradix")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != name:
        args = [name] + args
    ns = parser.parse_args(args)
    return int(ns.func(ns))
