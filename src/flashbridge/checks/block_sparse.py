"""Checks of block-sparse attention (``flash_attention(..., block_mask=...)``) for ``python -m flashbridge check``.

Rows: forward and backward (dq, dk, dv) with a causal sliding-window :class:`flashbridge.masks.BlockMask`
(GQA), whose dense form is the reference's ``window_size``. TFLOP/s counts the visible (query, key) pairs
only: 2 * B * Hq * pairs * (Dqk + Dv), backward 2.5x. The error is max|out - ref| over the bound of the
attention checks (twice the error of plain attention emulated in the dtype + a floor), the worst over the
output and every gradient.
"""
from __future__ import annotations

import numpy as np

from ..reference import attention as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework
from .attention import _naive

# (B, S, Hq, Hkv, D, window, block): small on the CPU interpreter; on a GPU large enough to time
SHAPES = {"cpu": (1, 160, 2, 1, 32, 40, 32), "cuda": (1, 4096, 16, 4, 128, 1024, 128)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def checks(framework: str, device: str) -> list[Check]:
    return [Check(op=f"flash_attention block_mask {'bwd' if backward else 'fwd'}", framework=framework,
                  run=_make_run(framework, device, backward)) for backward in (False, True)]


def _make_run(framework, device, backward):
    def run() -> Measurement:
        from .. import masks

        b, s, hq, hkv, d, window, block = SHAPES[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(31)
        a = {n: rounded(rng.standard_normal((b, s, h, d)), dtype)
             for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("dout", hq))}
        options = dict(window_size=(window, 0))
        mask = masks.sliding_window(s, window, 0, block_size=block)
        ref_out, _ = R.flash_attention(a["q"], a["k"], a["v"], **options)
        ref_grads = R.flash_attention_bwd(a["dout"], a["q"], a["k"], a["v"], **options)[:3]
        naive_out, naive_grads = _naive(a["q"], a["k"], a["v"], a["dout"], dtype, **options)
        time_ms = None
        if framework == "torch":
            import torch
            from ..torch_api import flash_attention
            t = {n: to_framework("torch", x, dtype, device, requires_grad=n != "dout") for n, x in a.items()}
            leaves = [t["q"], t["k"], t["v"]]
            y = flash_attention(*leaves, block_mask=mask)
            grads = torch.autograd.grad(y, leaves, t["dout"], retain_graph=True)
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    time_ms = time_torch(lambda: torch.autograd.grad(y, leaves, t["dout"], retain_graph=True))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(lambda: flash_attention(*leaves, block_mask=mask))
        else:
            import jax
            from ..jax_api import flash_attention
            j = {n: to_framework("jax", x, dtype, device) for n, x in a.items()}
            fwd = lambda q, k, v: flash_attention(q, k, v, block_mask=mask)  # noqa: E731
            y, vjp_fn = jax.vjp(fwd, j["q"], j["k"], j["v"])
            apply_vjp = lambda f, ct: f(ct)  # noqa: E731 -- the backward alone, residuals saved
            grads = jax.jit(apply_vjp)(vjp_fn, j["dout"])
            if device == "cuda":
                from .._timing import time_jax
                time_ms = (time_jax(apply_vjp, vjp_fn, j["dout"]) if backward
                           else time_jax(jax.jit(fwd), j["q"], j["k"], j["v"]))
        if backward:
            err = max(error_vs_reference(g, r, n) for g, r, n in zip(grads, ref_grads, naive_grads))
        else:
            err = error_vs_reference(y, ref_out, naive_out)
        pairs = float(R.visible_mask(s, s, window_size=(window, 0)).sum())
        flops = 2.0 * b * hq * pairs * 2 * d * (2.5 if backward else 1.0)
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms, amount=flops, unit="TFLOP/s",
                           shape=f"B{b} S{s} H{hq}/{hkv} D{d} window {window} block {block} {dtype}")

    return run
