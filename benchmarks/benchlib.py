"""What every benchmark shares: the length distributions and the versions line.

Scripts run as ``python benchmarks/bench_<thing>.py``, so this module is importable as ``benchlib``.
"""

from __future__ import annotations

import gc
import importlib.metadata
import os
import platform
import time

import numpy as np


def sft_like_lengths(n: int, *, seed: int = 0, median: int = 250, low: int = 8, high: int = 4096) -> np.ndarray:
    """(n,) int64 SFT-like lengths: lognormal with the given median, sigma 1, rounded, clipped to [low, high].

    The distribution every benchmark calls "SFT-like" (instruction data: many short examples and a
    long right tail; about 3.7% of tokens lie above 2,048 with the defaults).
    ``sft_like_lengths(3, seed=0)`` -> e.g. ``[285, 223, 476]``.
    """
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), 1.0, n)), low, high).astype(np.int64)


def uniform_lengths(n: int, *, seed: int = 0, low: int = 16, high: int = 512) -> np.ndarray:
    """(n,) int64 lengths uniform in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, n).astype(np.int64)


def versions(*packages: str) -> dict:
    """Machine and package versions, for the table header and the JSON line."""
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    for name in ("numpy", "torch", *packages):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def best_of(fn, repeat: int):
    """``(seconds, result)``: the fastest of ``repeat`` calls of ``fn()``, garbage collected before each."""
    times, out = [], None
    for _ in range(repeat):
        gc.collect()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out
