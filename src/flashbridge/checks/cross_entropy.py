"""Checks of the cross-entropy family for ``python -m flashbridge check``.

Rows: the logits-level ``cross_entropy`` forward and forward+backward (TB/s: logits read once forward;
read twice and the gradient written once for forward+backward), and ``linear_cross_entropy``
forward+backward (TFLOP/s of its three GEMMs, 6*N*H*V). The error is max|out - ref| over the bound
(twice the naive same-dtype error + a floor) for the loss and every gradient, the worst one reported.
"""
from __future__ import annotations

import numpy as np

from ..reference import cross_entropy as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework

# Shapes small enough for a float64 NumPy reference: (N, V) for the logits op, (N, H, V) for the linear op.
CE_SHAPES = {"cpu": (64, 1000), "cuda": (8192, 32000)}
LINEAR_SHAPES = {"cpu": (64, 32, 1000), "cuda": (2048, 1024, 32000)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
OPTIONS = dict(label_smoothing=0.1, z_loss=1e-4)


def _labels(rng, n, vocab):
    y = rng.integers(0, vocab, n)
    return np.where(rng.random(n) < 0.1, -100, y)


def _naive_ce(x, y, dtype):
    """Loss and dlogits rounded through the dtype: the yardstick (lse / softmax in float64, then rounded)."""
    loss = R.cross_entropy(rounded(x, dtype), y, **OPTIONS)
    dx = rounded(R.cross_entropy_bwd(1.0, x, y, **OPTIONS), dtype)
    return rounded(loss, dtype), dx


def checks(framework: str, device: str) -> list[Check]:
    return [
        Check(op="cross_entropy fwd", framework=framework, run=_ce_run(framework, device, backward=False)),
        Check(op="cross_entropy fwd+bwd", framework=framework, run=_ce_run(framework, device, backward=True)),
        Check(op="linear_cross_entropy fwd+bwd", framework=framework, run=_linear_run(framework, device)),
    ]


def _ce_run(framework, device, backward):
    def run() -> Measurement:
        n, vocab = CE_SHAPES[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(11)
        x = rounded(rng.standard_normal((n, vocab)) * 3, dtype)
        y = _labels(rng, n, vocab)
        ref, ref_dx = R.cross_entropy(x, y, **OPTIONS), R.cross_entropy_bwd(1.0, x, y, **OPTIONS)
        naive, naive_dx = _naive_ce(x, y, dtype)
        time_ms = None
        if framework == "torch":
            import torch
            from ..torch_api.cross_entropy import cross_entropy
            xt = to_framework("torch", x, dtype, device, requires_grad=True)
            yt = torch.tensor(y, device=device)
            loss = cross_entropy(xt, yt, **OPTIONS)
            loss.backward()
            out, dx = loss, xt.grad
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    time_ms = time_torch(lambda: torch.autograd.grad(cross_entropy(xt, yt, **OPTIONS), xt))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(lambda: cross_entropy(xt, yt, **OPTIONS))
        else:
            import jax
            import jax.numpy as jnp
            from ..jax_api.cross_entropy import cross_entropy
            xj = to_framework("jax", x, dtype, device)
            yj = jax.device_put(jnp.asarray(y), xj.devices().pop())
            fn = lambda a, b: cross_entropy(a, b, **OPTIONS)  # noqa: E731
            out, dx = jax.jit(jax.value_and_grad(fn))(xj, yj)
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(jax.value_and_grad(fn) if backward else fn, xj, yj)
        err = error_vs_reference(out, ref, naive, floor=1e-4)
        if backward:
            err = max(err, error_vs_reference(dx, ref_dx, naive_dx, floor=1e-4))
        itemsize = 4 if dtype == "float32" else 2
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms, amount=(3 if backward else 1) * n * vocab * itemsize,
                           unit="TB/s", shape=f"{n}x{vocab} {dtype}")

    return run


def _linear_run(framework, device):
    def run() -> Measurement:
        n, hidden, vocab = LINEAR_SHAPES[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(12)
        h = rounded(rng.standard_normal((n, hidden)), dtype)
        w = rounded(rng.standard_normal((vocab, hidden)) * (2 / np.sqrt(hidden)), dtype)
        y = _labels(rng, n, vocab)
        ref = R.linear_cross_entropy(h, w, y, **OPTIONS)
        ref_dh, ref_dw, _ = R.linear_cross_entropy_bwd(1.0, h, w, y, **OPTIONS)
        # Naive: the logits rounded to the dtype (as an eager GEMM gives them), gradients rounded too.
        x = rounded(h @ w.T, dtype)
        naive = rounded(R.cross_entropy(x, y, **OPTIONS), dtype)
        dx = rounded(R.cross_entropy_bwd(1.0, x, y, **OPTIONS), dtype)
        naive_dh, naive_dw = rounded(dx @ w, dtype), rounded(dx.T @ h, dtype)
        time_ms = None
        if framework == "torch":
            import torch
            from ..torch_api.cross_entropy import linear_cross_entropy
            ht = to_framework("torch", h, dtype, device, requires_grad=True)
            wt = to_framework("torch", w, dtype, device, requires_grad=True)
            yt = torch.tensor(y, device=device)
            loss = linear_cross_entropy(ht, wt, yt, **OPTIONS)
            loss.backward()
            out, dh, dw = loss, ht.grad, wt.grad
            if device == "cuda":
                from .._timing import time_torch
                time_ms = time_torch(lambda: torch.autograd.grad(linear_cross_entropy(ht, wt, yt, **OPTIONS),
                                                                 (ht, wt)))
        else:
            import jax
            import jax.numpy as jnp
            from ..jax_api.cross_entropy import linear_cross_entropy
            hj, wj = to_framework("jax", h, dtype, device), to_framework("jax", w, dtype, device)
            yj = jax.device_put(jnp.asarray(y), hj.devices().pop())
            fn = jax.value_and_grad(lambda a, b, c: linear_cross_entropy(a, b, c, **OPTIONS), argnums=(0, 1))
            out, (dh, dw) = jax.jit(fn)(hj, wj, yj)
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(fn, hj, wj, yj)
        err = max(error_vs_reference(out, ref, naive, floor=1e-4),
                  error_vs_reference(dh, ref_dh, naive_dh, floor=1e-4),
                  error_vs_reference(dw, ref_dw, naive_dw, floor=1e-4))
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms, amount=6.0 * n * hidden * vocab,
                           unit="TFLOP/s", shape=f"{n}x{hidden}x{vocab} {dtype}")

    return run
