"""Tolerance helpers and converters shared by the test suites (the same rule ``flashbridge check`` applies).

The accuracy rule (the flash-attn rule): against the float64 reference, the kernel's error must be at
most ``factor`` x the error of a naive implementation in the same dtype, plus a small floor relative to
the reference's magnitude.
"""
from __future__ import annotations

from flashbridge.checks import error_and_bound, rounded  # noqa: F401  (rounded is re-exported for tests)
from flashbridge.checks import to_numpy64 as np64  # noqa: F401


def assert_close(out, ref, naive, *, name="output", factor=2.0, floor=1e-5):
    """err(out) <= factor * err(naive) + floor * max(1, max|ref|), all against the float64 ``ref``."""
    err, bound = error_and_bound(out, ref, naive, factor=factor, floor=floor)
    assert err <= bound, (f"{name}: max error {err:.3g} > bound {bound:.3g} ({factor} x the naive "
                          f"same-dtype error + {floor} x max(1, |ref|))")


def torch_to_jax(t):
    """A torch tensor as a JAX array with the same values and dtype (bf16 and fp8 included); anything else is
    returned as is. Imports torch and JAX lazily: suites that need neither still import this module."""
    import torch
    if not isinstance(t, torch.Tensor):
        return t
    import jax.numpy as jnp
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return jnp.asarray(t.view(torch.uint8).numpy()).view(jnp.float8_e4m3fn)
    return jnp.asarray(t.numpy())


def score_mod_inputs(g, b: int, hq: int, *, alibi=None, sinks=False, slope_range=0.5) -> dict:
    """Random optional score-modifier tensors of the attention and decode ops: ALiBi slopes per head
    ("heads", ``(Hq,)``) or per sequence and head ("batch", ``(B, Hq)``) in [0.05, 0.05 + slope_range),
    and attention sinks ``(Hq,)``; drawn from the torch generator ``g``."""
    import torch

    kw = {}
    if alibi == "heads":
        kw["alibi_slopes"] = torch.rand(hq, generator=g) * slope_range + 0.05
    elif alibi == "batch":
        kw["alibi_slopes"] = torch.rand(b, hq, generator=g) * slope_range + 0.05
    if sinks:
        kw["sinks"] = torch.randn(hq, generator=g)
    return kw
