"""Timing helpers shared by ``python -m flashbridge check`` and benchmarks/ (GPU only).

torch: ``triton.testing.do_bench`` (CUDA events, median). JAX: a jitted function dispatched back to back
``inner`` times and synchronised once with ``block_until_ready``, so dispatch overlaps device work as it
does in a real training step; the median over ``reps`` such batches, divided by ``inner``. ``inner``
(default: automatic) makes a batch last about 10 ms, so that the fixed cost of starting and synchronising
a batch (tens of microseconds) is not charged to short calls.
"""
from __future__ import annotations

import statistics
import time


def time_torch(fn, *, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds per call of ``fn`` (which launches CUDA work)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_jax(fn, *args, inner: int | None = None, reps: int = 15) -> float:
    """Median milliseconds per call of ``jax.jit(fn)(*args)``."""
    import jax

    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))  # compile
    start = time.perf_counter()
    for _ in range(3):
        jax.block_until_ready(jitted(*args))
    if inner is None:
        per_call = (time.perf_counter() - start) / 3
        inner = max(10, min(500, int(0.010 / max(per_call, 1e-6))))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = jitted(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner * 1e3)
    return statistics.median(samples)
