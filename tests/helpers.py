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


def assert_close_rowwise(out, ref, naive, *, name="output", factor=2.0, floor=1e-5, unit=None):
    """:func:`assert_close` with every row (last dimension) measured in units of its own max|ref| (or of
    ``unit``, one positive value per row, e.g. the size of the terms a row's result cancels from): for rows
    of very different magnitudes, where one bound for the whole array would ignore the small rows."""
    import numpy as np

    out, ref, naive = (np64(a).reshape(-1, np.shape(ref)[-1]) for a in (out, ref, naive))
    if unit is None:
        unit = np.max(np.abs(ref), axis=1)
    unit = np.maximum(np.reshape(unit, (-1, 1)), np.finfo(np.float64).tiny)
    assert_close(out / unit, ref / unit, naive / unit, name=name, factor=factor, floor=floor)


def e4m3_bits_expected(values):
    """The e4m3fn bytes ``append_kv_cache`` stores for float values (already divided by the scale):
    ml_dtypes' cast of the value clamped to +-448 (nearest even), NaN as e4m3fn's NaN with the value's sign
    (0x7F / 0xFF)."""
    import ml_dtypes
    import numpy as np

    v = np.asarray(values, np.float32)
    nan = np.isnan(v)
    bits = np.clip(np.where(nan, 0.0, v), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(nan, np.where(np.signbit(v), 0xFF, 0x7F), bits).astype(np.uint8)


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


def naive_masked_attention(q, k, v, mask, *, scale=None, softcap=0.0, sinks=None, alibi=None):
    """Attention computed plainly in the inputs' dtype with a dense bool mask ``(B|1, H|1, Sq, Sk)``
    (differentiable; torch, any device): the block-sparse suites' yardstick (float64 on a GPU stands in for
    the NumPy reference at sizes where it would be slow). q ``(B, Sq, Hq, D)``, k / v ``(B, Sk, Hkv, D)``; rows
    that see nothing give 0."""
    import math

    import torch

    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        sq, sk = q.shape[1], k.shape[1]
        dist = (torch.arange(sq, device=q.device)[:, None] + sk - sq - torch.arange(sk, device=q.device)[None, :]).abs()
        s = s - (alibi.to(q.device)[:, None, None] * dist).to(s.dtype)
    s = s.masked_fill(~torch.as_tensor(mask, device=q.device), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[None, :, None, None].expand(*s.shape[:3], 1)], dim=-1)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    p = e / e.sum(-1, keepdim=True).clamp_min(torch.finfo(e.dtype).tiny)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)
