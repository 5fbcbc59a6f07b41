"""Two processes joined by torch.distributed over gloo on loopback, for the tensor-parallel
tests of the fast tiers (tests/fast/test_fast_storage_tp.py, tests/fast/test_host_tier_tp.py):
each runs a script with its rank and a free port, prints one ``RESULT <json>`` line, and is
stopped by the test whatever happens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence


def free_port() -> int:
    """A TCP port on loopback nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(script: str, extra: Sequence[Sequence[str]] = ((), ()),
              timeout: float = 120) -> list[dict]:
    """Run ``script`` (``python -c``) as ranks 0..n-1 (``n = len(extra)``) with the arguments
    ``rank port *extra[rank]``; returns each rank's ``RESULT`` object."""
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for rank, args in enumerate(extra)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:  # stopped by the test, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(next(line for line in o.splitlines() if line.startswith("RESULT "))[7:])
            for o in outs]
