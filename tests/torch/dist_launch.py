"""Runs a worker module on N local processes (torch.distributed, gloo on 127.0.0.1) and collects their results.

Each rank runs ``python -m <module>`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set,
and prints one ``RESULT <json>`` line. The launch is bounded in time: as soon as a rank fails, or at the
timeout, every process still running is killed, and the error carries the ranks' stderr.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from _helpers.common import ROOT


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _PortTaken(AssertionError):
    pass


def launch(module: str, *args: str, world_size: int = 2, timeout: float = 240) -> list[Any]:
    """Runs ``python -m module *args`` on ``world_size`` ranks; returns each rank's RESULT payload.

    If another process took the port between picking and binding it, tries once more with a new one.
    """
    try:
        return _launch(module, args, world_size, timeout)
    except _PortTaken:
        return _launch(module, args, world_size, timeout)


def _launch(module: str, args: tuple[str, ...], world_size: int, timeout: float) -> list[Any]:
    port = str(free_port())
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="fmp-dist-") as tmp:
        outs = [open(os.path.join(tmp, f"out{r}"), "w+b") for r in range(world_size)]
        errs = [open(os.path.join(tmp, f"err{r}"), "w+b") for r in range(world_size)]
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
                        [sys.executable, "-m", module, *args], env=env, cwd=ROOT, stdout=outs[rank], stderr=errs[rank]
                    )
                )
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            stderr = []
            for f in errs:
                f.seek(0)
                stderr.append(f.read())
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if any(b"address already in use" in stderr[r].lower() for r in failed):
                raise _PortTaken(f"port {port} was taken")
            if failed:  # reported before a timeout: the others may only be waiting for the failed rank
                raise AssertionError(
                    "\n".join(
                        f"rank {r} of {module} exited with {procs[r].returncode}:\n{_tail(stderr[r])}" for r in failed
                    )
                )
            results = []
            for rank, p in enumerate(procs):
                if p.returncode is None:
                    raise AssertionError(
                        f"rank {rank} of {module} did not finish within {timeout} s:\n{_tail(stderr[rank])}"
                    )
                outs[rank].seek(0)
                lines = [x for x in outs[rank].read().decode().splitlines() if x.startswith("RESULT ")]
                if not lines:
                    raise AssertionError(f"rank {rank} of {module} printed no RESULT line:\n{_tail(stderr[rank])}")
                results.append(json.loads(lines[-1][len("RESULT ") :]))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in outs + errs:
                f.close()


def _tail(err: bytes) -> str:
    return err.decode(errors="replace")[-4000:]
