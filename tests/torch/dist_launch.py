"""Runs a worker module on N local processes (torch.distributed, gloo on 127.0.0.1) and collects their results.

Each rank runs ``python -m <module>`` with ``RANK``, ``WORLD_SIZE`` and ``MASTER_PORT`` set, and prints one
``RESULT <json>`` line. The launch is bounded in time: on a timeout or a failed rank every process still
running is killed, and the error carries the ranks' stderr.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from tests.helpers import ROOT


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(module: str, *args: str, world_size: int = 2, timeout: float = 240) -> list[Any]:
    """Runs ``python -m module *args`` on ``world_size`` ranks; returns each rank's RESULT payload."""
    port = str(free_port())
    procs = []
    try:
        for rank in range(world_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                PYTHONPATH=str(ROOT),
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        deadline = time.monotonic() + timeout
        outs = []
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise AssertionError(f"rank {rank} of {module} did not finish within {timeout} s") from e
            if p.returncode != 0:
                raise AssertionError(f"rank {rank} of {module} exited with {p.returncode}:\n{err.decode()[-4000:]}")
            lines = [x for x in out.decode().splitlines() if x.startswith("RESULT ")]
            if not lines:
                raise AssertionError(f"rank {rank} of {module} printed no RESULT line:\n{err.decode()[-4000:]}")
            outs.append(json.loads(lines[-1][len("RESULT ") :]))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
