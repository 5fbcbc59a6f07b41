"""Sample one function of the fast path in situ: ``perf record`` runs the whole ``uniradix``
command, but samples only while ``uniradix.fast.MODULE``'s ``NAME`` runs.

    rm -f ctl ack && mkfifo ctl ack
    PERF_CTL=ctl PERF_ACK=ack perf record -F 5000 --call-graph dwarf,8192 -D -1 \
        --control fifo:ctl,ack -o inside.data \
        VENV/bin/python scripts/perf-inside.py MODULE NAME bench --impl fast ...
    perf report -i inside.data --children --sort sym --stdio -g none --percent-limit 1.5

``NAME`` is a module global of ``uniradix.fast.MODULE`` (``cache _api_insert``: the Full
insert), or ``_core.ATTR`` for a C-core function that module calls through its ``_core``
(``hybrid _core.pair_insert_api``: the SWA+Mamba insert; the proxy must be in place before
the cache is built, which it is: the command runs after).  Everything after ``NAME`` is the
``uniradix`` command line.  The control pipe's own reads and writes (``anon_pipe_read``,
``finish_task_switch``, ``_raw_spin_unlock_irqrestore``) show up in the samples, about a
quarter of them: compare shares of the function's own frames (its ``--children`` line), not of
the whole.  perf must be installed (``apt-get install linux-perf`` or the distribution's
``perf``); used for docs/PERFORMANCE.md's in-situ profiles.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any


def _toggled(fn: Any, ctl: int, ack: int) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        os.write(ctl, b"enable\n")
        os.read(ack, 5)
        try:
            return fn(*args, **kwargs)
        finally:
            os.write(ctl, b"disable\n")
            os.read(ack, 5)
    return run


class _CoreProxy:
    """The C core with one of its functions sampled."""

    def __init__(self, core: Any, name: str, fn: Any) -> None:
        self._core, self._name, self._fn = core, name, fn

    def __getattr__(self, attr: str) -> Any:
        return self._fn if attr == self._name else getattr(self._core, attr)


def main() -> None:
    if len(sys.argv) < 4 or "PERF_CTL" not in os.environ:
        sys.exit(__doc__)
    module, name = sys.argv[1], sys.argv[2]
    ctl = os.open(os.environ["PERF_CTL"], os.O_WRONLY)
    ack = os.open(os.environ["PERF_ACK"], os.O_RDONLY)
    mod = importlib.import_module("uniradix.fast." + module)
    if name.startswith("_core."):
        attr = name.removeprefix("_core.")
        core = mod._core
        if core is None:
            sys.exit("the C core is not loaded (UNIRADIX_PURE_PYTHON?)")
        mod._core = _CoreProxy(core, attr, _toggled(getattr(core, attr), ctl, ack))
    else:
        setattr(mod, name, _toggled(getattr(mod, name), ctl, ack))
    from uniradix.conformance.cli import main as uniradix
    sys.argv = ["uniradix", *sys.argv[3:]]
    sys.exit(uniradix())


if __name__ == "__main__":
    main()
