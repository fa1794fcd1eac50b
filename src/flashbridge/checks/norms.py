"""Checks of the fused-norm family for ``python -m flashbridge check``."""
from __future__ import annotations

import numpy as np

from ..reference import norms as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework, to_numpy64

# (rows, cols): small on the CPU interpreter, benchmark-sized on a GPU
SHAPES = {"cpu": (64, 1000), "cuda": (4096, 8192)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
DROPOUT_P = 0.1


def _inputs(rows, cols, dtype, seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rounded(rng.standard_normal((rows, cols)) * 2 + 1, dtype),
        "r": rounded(rng.standard_normal((rows, cols)), dtype),
        "w": rounded(rng.standard_normal(cols) + 1, dtype),
        "b": rounded(rng.standard_normal(cols), dtype),
        "dy": rounded(rng.standard_normal((rows, cols)), dtype),
    }


def _op(api, name):
    """The forward closure of one check row, in terms of the framework's public functions."""
    return {
        "rms_norm": lambda a: api.rms_norm(a["x"], a["w"]),
        "rms_norm+residual": lambda a: api.rms_norm(a["x"], a["w"], residual=a["r"])[0],
        "layer_norm": lambda a: api.layer_norm(a["x"], a["w"], a["b"]),
        "layer_norm+residual": lambda a: api.layer_norm(a["x"], a["w"], a["b"], residual=a["r"])[0],
        "layer_norm_dropout_residual": lambda a: api.layer_norm_dropout_residual(
            a["x"], a["w"], a["b"], a["r"], dropout_p=DROPOUT_P, seed=1234),
    }[name]


def _reference(name, a, dtype, y=None):
    """(reference output, naive same-dtype output, (reference dx, reference dweight)). The dropout row reads
    its keep mask off the kernel's own output ``y`` (a kept element z / (1-p) is never 0 for these inputs),
    which is why that row runs in float32."""
    x, r, w, b, dy = a["x"], a["r"], a["w"], a["b"], a["dy"]
    h = rounded(x + r, dtype)
    if name == "layer_norm_dropout_residual":
        keep = np.abs(to_numpy64(y) - r) > 0
        ref = R.layer_norm_dropout_residual(x, w, b, r, keep_mask=keep, dropout_p=DROPOUT_P)
        dref = R.layer_norm_dropout_residual_bwd(dy, x, w, b, r, keep_mask=keep, dropout_p=DROPOUT_P)[:2]
        return ref, rounded(ref, dtype), dref
    if name.startswith("rms_norm"):
        res = r if name.endswith("residual") else None
        ref = R.rms_norm(x, w, residual=res)
        ref = ref[0] if res is not None else ref
        naive = rounded(R.rms_norm(h if res is not None else x, w), dtype)
        dref = R.rms_norm_bwd(dy, x, w, residual=res)[:2]
    else:
        res = r if name.endswith("residual") else None
        ref = R.layer_norm(x, w, b, residual=res)
        ref = ref[0] if res is not None else ref
        naive = rounded(R.layer_norm(h if res is not None else x, w, b), dtype)
        dref = R.layer_norm_bwd(dy, x, w, b, residual=res)[:2]
    return ref, naive, dref


def _bytes(name, rows, cols, itemsize, backward):
    if name == "layer_norm_dropout_residual":  # x, residual in, y out; backward dy, x in, dx out
        return 3 * rows * cols * itemsize
    tensors = 2 + (2 if name.endswith("residual") else 0)  # x, y (+ residual in, h out)
    if backward:
        tensors = 3 + (1 if name.endswith("residual") else 0)  # dy, h, dx (+ dresidual)
    return tensors * rows * cols * itemsize


def checks(framework: str, device: str) -> list[Check]:
    rows, cols = SHAPES[device]
    dtype = DTYPES[device]
    out = []
    names = ("rms_norm", "rms_norm+residual", "layer_norm", "layer_norm+residual", "layer_norm_dropout_residual")
    for i, name in enumerate(names):
        row_dtype = "float32" if name == "layer_norm_dropout_residual" else dtype
        for backward in (False, True):
            out.append(Check(
                op=f"{name} {'bwd' if backward else 'fwd'}", framework=framework,
                run=_make_run(framework, device, name, backward, rows, cols, row_dtype,
                              2 if row_dtype != "float32" else 4, seed=i)))
    return out


def _make_run(framework, device, name, backward, rows, cols, dtype, itemsize, seed):
    def run() -> Measurement:
        a = _inputs(rows, cols, dtype, seed)
        if framework == "torch":
            import torch
            from .. import torch_api as api
            t = {k: to_framework("torch", v, dtype, device, requires_grad=k in ("x", "w")) for k, v in a.items()}
            fwd = _op(api, name)
            y = fwd(t)
            ref, naive, (ref_dx, ref_dw) = _reference(name, a, dtype, y)
            if backward:
                y.backward(t["dy"])
                err = max(error_vs_reference(t["x"].grad, ref_dx, rounded(ref_dx, dtype)),
                          error_vs_reference(t["w"].grad, ref_dw, rounded(ref_dw, dtype), floor=1e-2))
            else:
                err = error_vs_reference(y, ref, naive)
            time_ms = None
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    y = fwd(t)
                    time_ms = time_torch(lambda: torch.autograd.grad(y, (t["x"], t["w"]), t["dy"],
                                                                     retain_graph=True))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(lambda: fwd(t))
        else:
            import jax
            from .. import jax_api as api
            j = {k: to_framework("jax", v, dtype, device) for k, v in a.items()}
            fwd = _op(api, name)

            rest = {k: v for k, v in j.items() if k not in ("x", "w")}
            y, vjp_fn = jax.vjp(lambda x, w: fwd({**rest, "x": x, "w": w}), j["x"], j["w"])
            ref, naive, (ref_dx, ref_dw) = _reference(name, a, dtype, y)
            apply_vjp = lambda f, ct: f(ct)  # noqa: E731 -- the backward alone, residuals saved
            if backward:
                dx, dw = jax.jit(apply_vjp)(vjp_fn, j["dy"])
                err = max(error_vs_reference(dx, ref_dx, rounded(ref_dx, dtype)),
                          error_vs_reference(dw, ref_dw, rounded(ref_dw, dtype), floor=1e-2))
            else:
                err = error_vs_reference(y, ref, naive)
            time_ms = None
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(apply_vjp, vjp_fn, j["dy"]) if backward else time_jax(fwd, j)
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms,
                           amount=_bytes(name, rows, cols, itemsize, backward), unit="TB/s",
                           shape=f"{rows}x{cols} {dtype}")

    return run
