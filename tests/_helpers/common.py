"""Helpers shared by tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(source: str, *, devices: int | None = None, timeout: float = 300) -> str:
    """Runs ``source`` in a fresh Python process and returns its stdout.

    With ``devices=N`` the process sees N fake CPU devices
    (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` is set before JAX
    is imported). The child uses strict dtype promotion like the suite.
    Raises AssertionError with the child's output if it fails.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    if devices is not None:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def run_with_devices(source: str, n: int = 8, *, timeout: float = 300) -> str:
    """Runs ``source`` in a subprocess with ``n`` fake CPU devices; returns stdout."""
    return run_python(source, devices=n, timeout=timeout)


def tree_bits(tree) -> list[bytes]:
    """The raw bytes of every leaf of ``tree``: equal lists mean bit-identical trees."""
    import jax
    import numpy as np

    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def optax_not_strict(test):
    """Runs ``test`` under standard dtype promotion.

    optax 0.2.8's adam (bias correction), MultiSteps and reduce_on_plateau mix int32 and float32, which strict
    promotion rejects; fmp's own code is strict-clean (see the sgd-based tests).
    """
    import functools

    import jax

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return test(*args, **kwargs)

    return wrapper


def load_bench(name: str):
    """Imports ``bench/<name>.py`` (the benchmarks are scripts, not a package) and returns the module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"fmp_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (for a coordinator or a gloo rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(argv_of, n: int, *, env: dict[str, str], timeout: float) -> list[str]:
    """Starts ``n`` processes ``argv_of(i)`` at once and returns their stdouts, in process order.

    Every process is killed when the ``timeout`` (seconds, for all of them together) runs out or as soon as one
    exits non-zero: its peers would otherwise wait for it until their collectives' own timeouts. Raises
    AssertionError with every process's exit status and the tail of its output on any failure.
    """
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as tmp:
        logs = [(open(f"{tmp}/out{i}", "w+"), open(f"{tmp}/err{i}", "w+")) for i in range(n)]  # noqa: SIM115
        procs = [
            subprocess.Popen(argv_of(i), stdout=o, stderr=e, env=env, cwd=ROOT, text=True)
            for i, (o, e) in enumerate(logs)
        ]
        deadline, failed = time.monotonic() + timeout, None
        try:
            while None in (codes := [p.poll() for p in procs]):  # poll every process, every time
                if any(c not in (None, 0) for c in codes):
                    failed = "a process failed"
                    break
                if time.monotonic() > deadline:
                    failed = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = []
        for o, e in logs:
            o.seek(0), e.seek(0)
            texts.append((o.read(), e.read()))
            o.close(), e.close()
    if failed is None and all(p.returncode == 0 for p in procs):
        return [t[0] for t in texts]
    report = "\n".join(
        f"--- process {i}: exit {p.returncode}\n{out[-3000:]}\n{err[-6000:]}"
        for i, (p, (out, err)) in enumerate(zip(procs, texts, strict=True))
    )
    raise AssertionError(f"{failed or 'a process failed'}:\n{report}")


def near_tied_router() -> tuple:
    """``(route, x, w)``: a top-2 router over 8 near-tied experts, its logits a matmul in a "router" scope;
    in bfloat16 many tokens pick other experts."""
    import jax

    k = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(k[0], (256, 32))
    w = jax.random.normal(k[1], (32, 1)) + 1e-3 * jax.random.normal(k[2], (32, 8))

    def route(x, w):
        with jax.named_scope("router"):
            logits = x @ w
        return jax.lax.top_k(logits, 2)[1]

    return route, x, w
