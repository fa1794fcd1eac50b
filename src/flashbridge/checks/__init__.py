"""``python -m flashbridge check``: every op, every installed framework, on the available device.

Each op family contributes a module ``flashbridge.checks.<family>`` with a function
``checks(framework: str, device: str) -> list[Check]`` (framework "torch" or "jax", device "cuda" or
"cpu"). A Check runs its op on fresh random inputs, compares with the float64 reference in
``flashbridge.reference`` and, on a GPU, times it; the runner prints one table row per Check.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

# modules under flashbridge.checks, in the order they are reported
FAMILIES = ["norms", "attention", "block_sparse", "mla", "cross_entropy", "decode", "rotary", "swiglu"]


@dataclasses.dataclass
class Measurement:
    """What one check found. ``amount`` is the work done per call in ``unit`` (bytes for TB/s, flops for
    TFLOP/s); with ``time_ms`` it gives the achieved rate."""

    max_err: float  # the figure compared with ``tol`` (e.g. max abs error / naive-dtype error bound)
    tol: float
    time_ms: Optional[float] = None
    amount: Optional[float] = None
    unit: Optional[str] = None  # "TB/s" or "TFLOP/s"
    shape: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.max_err <= self.tol)  # NaN fails

    @property
    def rate(self) -> Optional[float]:
        if self.time_ms is None or self.amount is None:
            return None
        return self.amount / (self.time_ms * 1e-3) / 1e12


@dataclasses.dataclass
class Check:
    op: str
    framework: str
    run: Callable[[], Measurement]


def rounded(a, dtype: str):
    """Round float64 values through ``dtype`` (bfloat16 via ml_dtypes) and back to float64."""
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes
        return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(a).astype(dtype).astype(np.float64)


def to_numpy64(a):
    """torch tensor / jax array / numpy array -> float64 numpy (None stays None)."""
    import numpy as np

    if a is None:
        return None
    if hasattr(a, "detach"):
        return a.detach().float().cpu().double().numpy()
    return np.asarray(a).astype(np.float64)


def error_and_bound(out, ref, naive, *, factor: float = 2.0, floor: float = 1e-3) -> tuple[float, float]:
    """(max|out - ref|, factor * max|naive - ref| + floor * max(1, max|ref|)) against the float64 ``ref``:
    the flash-attn rule passes when the first is at most the second. Non-finite outputs give an infinite
    error; shapes must match."""
    import numpy as np

    out, ref, naive = to_numpy64(out), to_numpy64(ref), to_numpy64(naive)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {out.shape} != reference shape {ref.shape}")
    scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    bound = factor * float(np.max(np.abs(naive - ref), initial=0.0)) + floor * scale
    if not np.all(np.isfinite(out)):
        return float("inf"), bound
    return float(np.max(np.abs(out - ref), initial=0.0)), bound


def error_vs_reference(out, ref, naive, *, factor: float = 2.0, floor: float = 1e-3) -> float:
    """error / bound of :func:`error_and_bound`: <= 1 passes."""
    err, bound = error_and_bound(out, ref, naive, factor=factor, floor=floor)
    return err / bound


def to_framework(framework: str, a, dtype: str, device: str, requires_grad: bool = False):
    """float64 numpy -> a torch tensor or jax array of ``dtype`` on ``device``."""
    if framework == "torch":
        import torch
        t = torch.tensor(a, dtype=getattr(torch, dtype), device=device)
        return t.requires_grad_(requires_grad)
    import jax
    import jax.numpy as jnp
    backend = "gpu" if device == "cuda" else "cpu"
    return jax.device_put(jnp.asarray(a, dtype=dtype), jax.devices(backend)[0])
