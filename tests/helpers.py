"""Tolerance helpers and converters shared by the test suites.

The accuracy rule (the flash-attn rule): against the float64 reference, the kernel's error must be at
most ``factor`` x the error of a naive implementation in the same dtype, plus a small floor relative to
the reference's magnitude.
"""
from __future__ import annotations

import numpy as np

DTYPES = ("float32", "float16", "bfloat16")


def np64(a) -> np.ndarray:
    """torch tensor / jax array / numpy array -> float64 numpy."""
    if a is None:
        return None
    if hasattr(a, "detach"):  # torch
        return a.detach().to("cpu").double().numpy()
    return np.asarray(a).astype(np.float64)


def max_err(a, ref) -> float:
    a, ref = np64(a), np64(ref)
    assert a.shape == ref.shape, f"shape {a.shape} != reference shape {ref.shape}"
    if not np.all(np.isfinite(a)):
        return float("inf")
    return float(np.max(np.abs(a - ref), initial=0.0))


def assert_close(out, ref, naive, *, name="output", factor=2.0, floor=1e-5):
    """err(out) <= factor * err(naive) + floor * max(1, max|ref|), all against the float64 ``ref``."""
    ref = np64(ref)
    err = max_err(out, ref)
    naive_err = max_err(naive, ref)
    scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    bound = factor * naive_err + floor * scale
    assert err <= bound, (f"{name}: max error {err:.3g} > bound {bound:.3g} "
                          f"(naive same-dtype error {naive_err:.3g}, |ref| up to {scale:.3g})")


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values through ``dtype`` (bfloat16 via ml_dtypes) and back to float64."""
    if dtype == "bfloat16":
        import ml_dtypes
        return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)
    return np.asarray(a).astype(dtype).astype(np.float64)
