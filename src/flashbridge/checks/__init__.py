"""``python -m flashbridge check``: every op, every installed framework, on the available device.

Each op family contributes a module ``flashbridge.checks.<family>`` with a function
``checks(framework: str, device: str) -> list[Check]`` (framework "torch" or "jax", device "cuda" or
"cpu"). A Check runs its op on fresh random inputs, compares with the float64 reference in
``flashbridge.reference`` and, on a GPU, times it; the runner prints one table row per Check.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

FAMILIES = ["norms"]  # modules under flashbridge.checks, in the order they are reported


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
