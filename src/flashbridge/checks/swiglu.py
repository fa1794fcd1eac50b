"""Checks of SwiGLU for ``python -m flashbridge check``.

Rows: ``swiglu(gate, up)`` and the fused ``swiglu(x)``, forward and backward (TB/s: gate and up read, y
written; backward dy, gate, up read, dgate, dup written). The error is max|out - ref| over the bound (twice
the error of the output rounded to the dtype + a floor), the worst gradient reported for the backward.
"""
from __future__ import annotations

import numpy as np

from ..reference import swiglu as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework

SHAPES = {"cpu": (64, 1000), "cuda": (4096, 14336)}  # (rows, intermediate size): Llama-3-8B's MLP on a GPU
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def checks(framework: str, device: str) -> list[Check]:
    return [Check(op=f"swiglu{' fused' if fused else ''} {'bwd' if backward else 'fwd'}", framework=framework,
                  run=_make_run(framework, device, fused, backward))
            for fused in (False, True) for backward in (False, True)]


def _make_run(framework, device, fused, backward):
    def run() -> Measurement:
        rows, cols = SHAPES[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(21)
        g, u, dy = (rounded(rng.standard_normal((rows, cols)) * s, dtype) for s in (3.0, 1.0, 1.0))
        ref = R.swiglu(g, u)
        refs = R.swiglu_bwd(dy, g, u) if backward else (ref,)
        inputs = [np.concatenate([g, u], axis=-1)] if fused else [g, u]
        time_ms = None
        if framework == "torch":
            import torch
            from ..torch_api import swiglu
            args = [to_framework("torch", a, dtype, device, requires_grad=backward) for a in inputs]
            tdy = to_framework("torch", dy, dtype, device)
            y = swiglu(*args)
            outs = torch.autograd.grad(y, args, tdy, retain_graph=True) if backward else (y,)
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    time_ms = time_torch(lambda: torch.autograd.grad(y, args, tdy, retain_graph=True))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(lambda: swiglu(*args))
        else:
            import jax
            from ..jax_api import swiglu
            args = [to_framework("jax", a, dtype, device) for a in inputs]
            jdy = to_framework("jax", dy, dtype, device)
            y, vjp_fn = jax.vjp(swiglu, *args)
            apply_vjp = lambda f, ct: f(ct)  # noqa: E731 -- the backward alone, residuals saved
            outs = jax.jit(apply_vjp)(vjp_fn, jdy) if backward else (y,)
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(apply_vjp, vjp_fn, jdy) if backward else time_jax(swiglu, *args)
        if fused and backward:
            outs = (outs[0][..., :cols], outs[0][..., cols:])
        err = max(error_vs_reference(o, r, rounded(r, dtype)) for o, r in zip(outs, refs))
        tensors = 5 if backward else 3
        itemsize = 2 if dtype != "float32" else 4
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms, amount=tensors * rows * cols * itemsize,
                           unit="TB/s", shape=f"{rows}x{cols} {dtype}")

    return run
