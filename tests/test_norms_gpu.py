"""Fused norms on a CUDA GPU at realistic sizes, both frameworks (skipped without a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from flashbridge.reference import norms as R
from helpers import assert_close, assert_close_rowwise, np64, rounded

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from flashbridge import jax_api as fj  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402


def _cuda(a, dtype, grad=False):
    return torch.tensor(a, dtype=getattr(torch, dtype), device="cuda", requires_grad=grad)


def _jgpu(a, dtype):
    return jax.device_put(jnp.asarray(a, dtype=dtype), jax.devices("gpu")[0])


@pytest.mark.parametrize("op", ["rms", "ln"])
@pytest.mark.parametrize("rows,cols", [(4096, 8192), (8192, 2048), (3, 65536), (1000, 1), (130, 17), (1024, 1000)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_matches_reference_and_jax(op, rows, cols, dtype, with_residual):
    if dtype != "bfloat16" and rows * cols > 4096 * 2048:
        pytest.skip("fp16/fp32 covered at the smaller sizes")
    rng = np.random.default_rng(rows * 7 + cols)
    x = rounded(rng.standard_normal((rows, cols)) * 2 + (1.0 if op == "ln" else 0.0), dtype)
    r = rounded(rng.standard_normal((rows, cols)), dtype) if with_residual else None
    w = rounded(rng.standard_normal(cols) + 1, dtype)
    b = rounded(rng.standard_normal(cols), dtype)
    dy = rounded(rng.standard_normal((rows, cols)), dtype)
    h = rounded(x + r, dtype) if with_residual else x
    if op == "rms":
        ref = R.rms_norm(x, w, residual=r)
        naive = rounded(R.rms_norm(h, w), dtype)
        ref_dx, ref_dw, _ = R.rms_norm_bwd(dy, x, w, residual=r)
        nv_dx, nv_dw, _ = R.rms_norm_bwd(dy, h, w)
    else:
        ref = R.layer_norm(x, w, b, residual=r)
        naive = rounded(R.layer_norm(h, w, b), dtype)
        ref_dx, ref_dw, _, _ = R.layer_norm_bwd(dy, x, w, b, residual=r)
        nv_dx, nv_dw, _, _ = R.layer_norm_bwd(dy, h, w, b)
    ref = ref[0] if with_residual else ref

    tx, tw, tb = _cuda(x, dtype, True), _cuda(w, dtype, True), _cuda(b, dtype)
    tr = None if r is None else _cuda(r, dtype)
    out = ft.rms_norm(tx, tw, residual=tr) if op == "rms" else ft.layer_norm(tx, tw, tb, residual=tr)
    ty = out[0] if with_residual else out
    ty.backward(_cuda(dy, dtype))
    floor = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 4e-3}[dtype]
    assert_close(ty, ref, naive, name="torch y", floor=floor)
    assert_close(tx.grad, ref_dx, rounded(nv_dx, dtype), name="torch dx", floor=floor)
    assert_close(tw.grad, ref_dw, rounded(nv_dw, dtype), name="torch dweight", floor=floor)

    jx, jw, jb = _jgpu(x, dtype), _jgpu(w, dtype), _jgpu(b, dtype)
    jr = None if r is None else _jgpu(r, dtype)

    def f(x, w):
        o = fj.rms_norm(x, w, residual=jr) if op == "rms" else fj.layer_norm(x, w, jb, residual=jr)
        return o[0] if with_residual else o

    jy, vjp = jax.vjp(jax.jit(f), jx, jw)
    jdx, jdw = vjp(_jgpu(dy, dtype))
    # the same compiled kernels: the same bits in both frameworks
    np.testing.assert_array_equal(np64(ty), np64(jy))
    np.testing.assert_array_equal(np64(tx.grad), np64(jdx))
    np.testing.assert_array_equal(np64(tw.grad), np64(jdw))


@pytest.mark.parametrize("op", ["rms", "ln"])
@pytest.mark.parametrize("rows,cols", [(1536, 8192), (6000, 2048), (130, 17)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_rows_of_extreme_magnitude(op, rows, cols, dtype):
    """Rows near 1e20 (squares overflow float32), near 1e-20 with eps = 2**-126 (squares underflow or are
    flushed), magnitudes 1e-30 ... 1e30 side by side and rows of equal values: forward and backward against
    float64, row by row, and the same bits from JAX."""
    rng = np.random.default_rng(rows + cols)
    eps = 2.0 ** -126
    scale = np.resize([1e20, 1e-20, 1.0, 1e-30, 1e30, 3e-5], rows)[:, None]
    x = rounded((rng.standard_normal((rows, cols)) + (3.0 if op == "ln" else 0.0)) * scale, dtype)
    x[::7] = x[::7, :1]  # rows of equal values (LayerNorm: variance 0, rstd 1 / sqrt(eps))
    w, b = rounded(rng.standard_normal(cols) + 1, dtype), rounded(rng.standard_normal(cols), dtype)
    dy = rounded(rng.standard_normal((rows, cols)), dtype)
    if op == "rms":
        ref, (ref_dx, ref_dw, _) = R.rms_norm(x, w, eps=eps), R.rms_norm_bwd(dy, x, w, eps=eps)
    else:
        ref, (ref_dx, ref_dw, _, _) = R.layer_norm(x, w, b, eps=eps), R.layer_norm_bwd(dy, x, w, b, eps=eps)
    tx, tw, tb = _cuda(x, dtype, True), _cuda(w, dtype, True), _cuda(b, dtype)
    ty = ft.rms_norm(tx, tw, eps=eps) if op == "rms" else ft.layer_norm(tx, tw, tb, eps=eps)
    ty.backward(_cuda(dy, dtype))
    floor = {"float32": 1e-5, "bfloat16": 4e-3}[dtype]
    assert_close_rowwise(ty, ref, rounded(ref, dtype), name="torch y", floor=floor)
    hc = x - (0.0 if op == "rms" else x.mean(-1, keepdims=True))
    unit = np.max(np.abs(dy * w), axis=-1) / np.sqrt(np.mean(hc * hc, axis=-1) + eps)  # rstd * max|g| per row
    assert_close_rowwise(tx.grad, ref_dx, rounded(ref_dx, dtype), name="torch dx", floor=floor, unit=unit)
    assert_close(tw.grad, ref_dw, rounded(ref_dw, dtype), name="torch dweight", floor=floor)

    jb = _jgpu(b, dtype)

    def f(x, w):
        return fj.rms_norm(x, w, eps=eps) if op == "rms" else fj.layer_norm(x, w, jb, eps=eps)

    jy, vjp = jax.vjp(jax.jit(f), _jgpu(x, dtype), _jgpu(w, dtype))
    jdx, _ = vjp(_jgpu(dy, dtype))
    np.testing.assert_array_equal(np64(ty), np64(jy))
    np.testing.assert_array_equal(np64(tx.grad), np64(jdx))


def test_gpu_dropout_mask_matches_across_frameworks_and_cpu():
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal((512, 768)), rng.standard_normal((512, 768))
    w, b = rng.standard_normal(768), rng.standard_normal(768)
    args = [_cuda(a, "float32") for a in (x, w, b, r)]
    y_gpu = ft.layer_norm_dropout_residual(*args, dropout_p=0.2, seed=99)
    y_cpu = ft.layer_norm_dropout_residual(*[a.cpu() for a in args], dropout_p=0.2, seed=99)
    y_jax = fj.layer_norm_dropout_residual(*[_jgpu(a, "float32") for a in (x, w, b, r)], dropout_p=0.2, seed=99)
    keep_gpu = (y_gpu - args[3]).abs().cpu().numpy() > 0
    keep_cpu = (y_cpu - args[3].cpu()).abs().numpy() > 0
    np.testing.assert_array_equal(keep_gpu, keep_cpu)
    np.testing.assert_array_equal(np64(y_gpu), np64(y_jax))


def test_gpu_backward_deterministic_and_compiles():
    rng = np.random.default_rng(1)
    x = _cuda(rng.standard_normal((8192, 1024)), "bfloat16", True)
    w = _cuda(rng.standard_normal(1024), "float32", True)
    dy = _cuda(rng.standard_normal((8192, 1024)), "bfloat16")
    grads = []
    for _ in range(3):
        x.grad = w.grad = None
        ft.rms_norm(x, w).backward(dy)
        grads.append((x.grad.clone(), w.grad.clone()))
    for g in grads[1:]:
        assert torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1])
    compiled = torch.compile(lambda x, w: ft.rms_norm(x, w) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), ft.rms_norm(x, w) * 2)
