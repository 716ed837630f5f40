"""Helpers shared by tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
