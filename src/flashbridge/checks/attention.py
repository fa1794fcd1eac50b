"""Checks of the FlashAttention family for ``python -m flashbridge check``.

Rows: ``flash_attention`` forward and backward (all gradients) for a causal case and for a GQA +
sliding-window + sinks + softcap case. TFLOP/s = 2 * B * Hq * Sq * Sk * (Dqk + Dv) (halved when causal),
backward 2.5x the forward. The error is max|out - ref| over the bound (twice the naive same-dtype error +
a floor), the worst over the output and every gradient. The naive implementation is emulated in NumPy:
float64 math rounded through the dtype after every step a plain implementation would store (scores,
probabilities, products), the same yardstick on every device and in both frameworks.
"""
from __future__ import annotations

import math

import numpy as np

from ..reference import attention as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework

# (B, S, Hq, Hkv, D): small on the CPU interpreter; on a GPU large enough to time, small enough for a
# float64 NumPy reference.
SHAPES = {"cpu": (1, 130, 2, 1, 64), "cuda": (1, 2048, 16, 4, 128)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
CASES = {
    "causal": dict(causal=True),
    "gqa+window+sinks+softcap": dict(causal=True, window_size=(511, 0), softcap=30.0, sinks=True),
}


def _naive(q, k, v, dout, dtype, *, causal=False, window_size=(-1, -1), softcap=0.0, sinks=None):
    """Forward and backward of plain attention with every stored intermediate rounded to ``dtype``."""
    r = lambda a: rounded(a, dtype)  # noqa: E731
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    raw = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    t = np.tanh(raw / softcap) if softcap > 0 else None
    s = r(softcap * t if softcap > 0 else raw)
    mask = R.visible_mask(q.shape[1], k.shape[1], causal=causal, window_size=window_size)
    s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks[None, :, None, None])
    e = np.exp(s - m)
    denom = e.sum(-1, keepdims=True) + (np.exp(sinks[None, :, None, None] - m) if sinks is not None else 0.0)
    p = r(e / denom)
    out = r(np.einsum("bhqk,bkhd->bqhd", p, vv))
    dp = r(np.einsum("bqhd,bkhd->bhqk", dout, vv))
    delta = r(np.einsum("bqhd,bqhd->bhq", dout, out))[..., None]
    ds = r(p * (dp - delta))
    if t is not None:
        ds = r(ds * (1 - t * t))
    dq = r(np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    b, sk, hkv = k.shape[0], k.shape[1], k.shape[2]
    dk = r(dk.reshape(b, sk, hkv, group, -1).sum(3))
    dv = r(dv.reshape(b, sk, hkv, group, -1).sum(3))
    grads = [dq, dk, dv]
    if sinks is not None:
        p_sink = np.exp(sinks[None, :, None] - (m[..., 0] + np.log(denom[..., 0])))
        grads.append(-np.sum(p_sink * delta[..., 0], axis=(0, 2)))
    return out, grads


def _inputs(device, case, seed):
    b, s, hq, hkv, d = SHAPES[device]
    dtype = DTYPES[device]
    if case == "causal":
        hkv = hq
    rng = np.random.default_rng(seed)
    a = {"q": rounded(rng.standard_normal((b, s, hq, d)), dtype),
         "k": rounded(rng.standard_normal((b, s, hkv, d)), dtype),
         "v": rounded(rng.standard_normal((b, s, hkv, d)), dtype),
         "dout": rounded(rng.standard_normal((b, s, hq, d)), dtype)}
    if CASES[case].get("sinks"):
        a["sinks"] = rng.standard_normal(hq)
    return a, dtype


def _flops(a, causal, backward):
    b, sq, hq, dqk = a["q"].shape
    sk, dv = a["k"].shape[1], a["v"].shape[-1]
    f = 2.0 * b * hq * sq * sk * (dqk + dv) * (0.5 if causal else 1.0)
    return f * 2.5 if backward else f


def checks(framework: str, device: str) -> list[Check]:
    out = []
    for i, case in enumerate(CASES):
        for backward in (False, True):
            out.append(Check(op=f"flash_attention {case} {'bwd' if backward else 'fwd'}", framework=framework,
                             run=_make_run(framework, device, case, backward, seed=i)))
    return out


def _make_run(framework, device, case, backward, seed):
    def run() -> Measurement:
        a, dtype = _inputs(device, case, seed)
        options = {k: v for k, v in CASES[case].items() if k != "sinks"}
        sinks = a.get("sinks")
        ref_out, _ = R.flash_attention(a["q"], a["k"], a["v"], sinks=sinks, **options)
        ref_grads = [g for g in R.flash_attention_bwd(a["dout"], a["q"], a["k"], a["v"], sinks=sinks, **options)
                     if g is not None]
        naive_out, naive_grads = _naive(a["q"], a["k"], a["v"], a["dout"], dtype, sinks=sinks, **options)
        time_ms = None
        if framework == "torch":
            import torch
            from ..torch_api.attention import flash_attention
            t = {n: to_framework("torch", x, dtype if n != "sinks" else "float32", device,
                                 requires_grad=n != "dout") for n, x in a.items()}
            leaves = [t[n] for n in ("q", "k", "v", "sinks") if n in t]

            def fwd():
                return flash_attention(t["q"], t["k"], t["v"], sinks=t.get("sinks"), **options)

            y = fwd()
            grads = torch.autograd.grad(y, leaves, t["dout"], retain_graph=True)
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    time_ms = time_torch(lambda: torch.autograd.grad(y, leaves, t["dout"], retain_graph=True))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(fwd)
        else:
            import jax
            from ..jax_api.attention import flash_attention
            j = {n: to_framework("jax", x, dtype if n != "sinks" else "float32", device) for n, x in a.items()}
            names = [n for n in ("q", "k", "v", "sinks") if n in j]

            def fwd(*xs):
                kw = dict(zip(names, xs))
                return flash_attention(kw["q"], kw["k"], kw["v"], sinks=kw.get("sinks"), **options)

            y, vjp_fn = jax.vjp(fwd, *[j[n] for n in names])
            apply_vjp = lambda f, ct: f(ct)  # noqa: E731 -- the backward alone, residuals saved
            grads = jax.jit(apply_vjp)(vjp_fn, j["dout"])
            if device == "cuda":
                from .._timing import time_jax
                time_ms = (time_jax(apply_vjp, vjp_fn, j["dout"]) if backward
                           else time_jax(fwd, *[j[n] for n in names]))
        if backward:
            err = max(error_vs_reference(g, rg, ng) for g, rg, ng in zip(grads, ref_grads, naive_grads))
        else:
            err = error_vs_reference(y, ref_out, naive_out)
        b, s, hq, d = a["q"].shape
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms, amount=_flops(a, options["causal"], backward),
                           unit="TFLOP/s", shape=f"B{b} S{s} H{hq}/{a['k'].shape[2]} D{d} {dtype}")

    return run
