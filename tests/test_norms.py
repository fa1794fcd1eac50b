"""Fused norms on the CPU (Triton interpreter), both frameworks, against the float64 references."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from flashbridge.reference import norms as R
from helpers import assert_close, assert_close_rowwise, np64, rounded

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from flashbridge import jax_api as fj  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Inputs are reproducible per case; FLASHBRIDGE_TEST_SEED draws another set (CI uses the default 0).
SEED_OFFSET = int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))
FLOOR = {"float32": 2e-6, "float16": 1e-4, "bfloat16": 1e-3}


def _rand(rng, shape, dtype, scale=1.0, shift=0.0):
    """Fresh random values, exactly representable in ``dtype`` (returned as float64 numpy)."""
    return rounded(rng.standard_normal(shape) * scale + shift, dtype)


def _to_torch(a, dtype, requires_grad=False):
    if a is None:
        return None
    return torch.tensor(a, dtype=TORCH_DTYPES[dtype], requires_grad=requires_grad)


def _to_jax(a, dtype):
    return None if a is None else jnp.asarray(a, dtype=dtype)


# op, rows (leading shape), width, dtype, with weight, with bias, with residual, weight dtype
CASES = [
    ("rms", (1,), 1, "float32", True, False, False, None),
    ("rms", (3,), 17, "float16", True, False, True, None),
    ("rms", (2, 65), 1000, "bfloat16", True, False, True, "float32"),
    ("rms", (3,), 4096, "float32", False, False, False, None),
    ("rms", (130,), 64, "bfloat16", True, False, False, None),
    ("ln", (1,), 1, "float32", True, True, False, None),
    ("ln", (3,), 17, "bfloat16", True, True, True, None),
    ("ln", (130,), 1000, "float16", True, True, False, None),
    ("ln", (2, 3), 4096, "bfloat16", True, False, True, "float32"),
    ("ln", (7,), 333, "float32", False, False, True, None),
    ("ln", (5,), 4096, "float32", True, True, False, None),
    ("rms", (2,), 65536, "bfloat16", True, False, True, None),
    ("ln", (3,), 65536, "float32", True, True, False, None),
]


def _case_id(c):
    return f"{c[0]}-{'x'.join(map(str, c[1]))}x{c[2]}-{c[3]}-w{int(c[4])}b{int(c[5])}r{int(c[6])}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.thin(7)
def test_forward_backward_both_frameworks(case):
    op, lead, n, dtype, has_w, has_b, has_res, w_dtype = case
    w_dtype = w_dtype or dtype
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()) + SEED_OFFSET)
    shape = (*lead, n)
    # A mean offset makes LayerNorm's variance computation meaningful (cancellation-prone inputs).
    x = _rand(rng, shape, dtype, scale=2.0, shift=3.0 if op == "ln" else 0.0)
    w = _rand(rng, (n,), w_dtype, shift=1.0) if has_w else None
    b = _rand(rng, (n,), w_dtype) if has_b else None
    res = _rand(rng, shape, dtype) if has_res else None
    dy = _rand(rng, shape, dtype)
    dh = _rand(rng, shape, dtype) if has_res else None
    eps = 1e-5

    # float64 reference and the naive same-dtype bound (each intermediate rounded to the dtype)
    h_naive = None if res is None else rounded(x + res, dtype)
    if op == "rms":
        ref_y = R.rms_norm(x, w, eps=eps, residual=res)
        naive_y = rounded(R.rms_norm(h_naive if has_res else x, w, eps=eps), dtype)
        ref_dx, ref_dw, _ = R.rms_norm_bwd(dy, x, w, eps=eps, residual=res, dh=dh)
        naive_dx, naive_dw, _ = R.rms_norm_bwd(dy, h_naive if has_res else x, w, eps=eps, dh=dh)
        ref_db = naive_db = None
    else:
        ref_y = R.layer_norm(x, w, b, eps=eps, residual=res)
        naive_y = rounded(R.layer_norm(h_naive if has_res else x, w, b, eps=eps), dtype)
        ref_dx, ref_dw, ref_db, _ = R.layer_norm_bwd(dy, x, w, b, eps=eps, residual=res, dh=dh)
        naive_dx, naive_dw, naive_db, _ = R.layer_norm_bwd(dy, h_naive if has_res else x, w, b, eps=eps, dh=dh)
    if has_res:
        ref_y, ref_h = ref_y
    naive_dx = rounded(naive_dx, dtype)
    naive_dw = None if naive_dw is None else rounded(naive_dw, w_dtype)
    naive_db = None if naive_db is None else rounded(naive_db, w_dtype)

    # torch
    tx, tres = _to_torch(x, dtype, True), _to_torch(res, dtype, True)
    tw, tb = _to_torch(w, w_dtype, True), _to_torch(b, w_dtype, True)
    if op == "rms":
        out = ft.rms_norm(tx, tw, eps=eps, residual=tres)
    else:
        out = ft.layer_norm(tx, tw, tb, eps=eps, residual=tres)
    ty, th = (out, None) if not has_res else out
    grads = [ty] if not has_res else [ty, th]
    cots = [_to_torch(dy, dtype)] if not has_res else [_to_torch(dy, dtype), _to_torch(dh, dtype)]
    torch.autograd.backward(grads, cots)
    assert ty.dtype == TORCH_DTYPES[dtype] and ty.shape == shape

    # jax
    jx, jres, jw, jb = _to_jax(x, dtype), _to_jax(res, dtype), _to_jax(w, w_dtype), _to_jax(b, w_dtype)

    def jfn(x, w, b, res):
        if op == "rms":
            return fj.rms_norm(x, w, eps=eps, residual=res)
        return fj.layer_norm(x, w, b, eps=eps, residual=res)

    jout, vjp = jax.vjp(jfn, jx, jw, jb, jres)
    jcot = _to_jax(dy, dtype) if not has_res else (_to_jax(dy, dtype), _to_jax(dh, dtype))
    jdx, jdw, jdb, jdres = vjp(jcot)
    jy = jout if not has_res else jout[0]

    floor = FLOOR[dtype]
    for fw, y, dx, dw, db in (("torch", ty, tx.grad, None if tw is None else tw.grad,
                               None if tb is None else tb.grad),
                              ("jax", jy, jdx, jdw, jdb)):
        assert_close(y, ref_y, naive_y, name=f"{fw} y", floor=floor)
        assert_close(dx, ref_dx, naive_dx, name=f"{fw} dx", floor=floor)
        if has_w:
            assert_close(dw, ref_dw, naive_dw, name=f"{fw} dweight", floor=floor * 10)
        if has_b:
            assert_close(db, ref_db, naive_db, name=f"{fw} dbias", floor=floor * 10)
    if has_res:
        assert_close(th, ref_h, h_naive, name="torch h", floor=floor)
        assert_close(jout[1], ref_h, h_naive, name="jax h", floor=floor)
        np.testing.assert_array_equal(np64(tres.grad), np64(tx.grad))
        np.testing.assert_array_equal(np64(jdres), np64(jdx))

    # cross-framework parity: the same kernels on the same device give the same bits
    np.testing.assert_array_equal(np64(ty), np64(jy))
    np.testing.assert_array_equal(np64(tx.grad), np64(jdx))
    if has_w:
        np.testing.assert_array_equal(np64(tw.grad), np64(jdw))


# ------------------------------------------------------------------- magnitudes far from 1 (range)

# row scales of each case: one magnitude for every row, or rows of very different magnitudes in one tile
RANGE_CASES = {
    "large": (np.full(4, 1e20), 1e-5),  # the sum of squares (1e40 * n) overflows float32 unscaled
    # squares (1e-40) underflow; eps the smallest normal float32 (subnormals may be flushed, as XLA's CPU
    # threads and GPUs do), about 100 x mean(h^2) here: a lost sum of squares shows up at the 1% level
    "small": (np.full(4, 1e-20), 2.0 ** -126),
    "mixed": (np.array([1e20, 1e-20, 1.0, 1e-30, 1e30, 3e-5]), 2.0 ** -126),
}


@pytest.mark.parametrize("has_res", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", sorted(RANGE_CASES))
@pytest.mark.parametrize("op", ["rms", "ln"])
def test_rows_of_extreme_magnitude_both_frameworks(op, case, has_res):
    """Any finite row whose result is representable is normalised right: rows near 1e20 (whose squares
    overflow float32), near 1e-20 with a tiny eps (whose squares underflow), and rows of magnitudes 1e-30
    to 1e30 side by side in one tile; forward and backward, both frameworks, against float64."""
    dtype = "float32"
    rng = np.random.default_rng(zlib.crc32(f"range-{op}-{case}-{has_res}".encode()) + SEED_OFFSET)
    row_scale, eps = RANGE_CASES[case]
    shape = (len(row_scale), 40)
    # within a row, magnitudes spread over three decades; LayerNorm rows get a mean offset
    spread = 10.0 ** rng.uniform(-1.5, 1.5, shape) * (3.0 if op == "ln" else 0.0)
    x = rounded((rng.standard_normal(shape) + spread) * row_scale[:, None], dtype)
    res = rounded(rng.standard_normal(shape) * row_scale[:, None], dtype) if has_res else None
    w, b = _rand(rng, (shape[1],), dtype, shift=1.0), _rand(rng, (shape[1],), dtype)
    b = b if op == "ln" else None
    dy = _rand(rng, shape, dtype)
    dh = rounded(rng.standard_normal(shape) * row_scale[:, None], dtype) if has_res else None

    h = x if res is None else rounded(x + res, dtype)  # the kernels normalise the rounded sum
    if op == "rms":
        ref_y = R.rms_norm(h, w, eps=eps)
        ref_dx, ref_dw, _ = R.rms_norm_bwd(dy, h, w, eps=eps, dh=dh)
        ref_db = None
    else:
        ref_y = R.layer_norm(h, w, b, eps=eps)
        ref_dx, ref_dw, ref_db, _ = R.layer_norm_bwd(dy, h, w, b, eps=eps, dh=dh)
    assert np.all(np.isfinite(ref_y)) and np.all(np.isfinite(ref_dx))

    tx, tres = _to_torch(x, dtype, True), _to_torch(res, dtype, True)
    tw, tb = _to_torch(w, dtype, True), _to_torch(b, dtype, True)
    tout = (ft.rms_norm(tx, tw, eps=eps, residual=tres) if op == "rms"
            else ft.layer_norm(tx, tw, tb, eps=eps, residual=tres))
    ty = tout[0] if has_res else tout
    torch.autograd.backward([ty, tout[1]] if has_res else [ty],
                            [_to_torch(dy, dtype), _to_torch(dh, dtype)] if has_res else [_to_torch(dy, dtype)])

    def jfn(x, w, b, res):
        if op == "rms":
            return fj.rms_norm(x, w, eps=eps, residual=res)
        return fj.layer_norm(x, w, b, eps=eps, residual=res)

    jout, vjp = jax.vjp(jfn, _to_jax(x, dtype), _to_jax(w, dtype), _to_jax(b, dtype), _to_jax(res, dtype))
    jdx, jdw, jdb, _ = vjp((_to_jax(dy, dtype), _to_jax(dh, dtype)) if has_res else _to_jax(dy, dtype))
    jy = jout[0] if has_res else jout

    floor = FLOOR[dtype]
    for fw, y, dx, dw, db in (("torch", ty, tx.grad, tw.grad, None if tb is None else tb.grad),
                              ("jax", jy, jdx, jdw, jdb)):
        assert_close_rowwise(y, ref_y, rounded(ref_y, dtype), name=f"{fw} y", floor=floor)
        assert_close_rowwise(dx, ref_dx, rounded(ref_dx, dtype), name=f"{fw} dx", floor=floor)
        assert_close(dw, ref_dw, rounded(ref_dw, dtype), name=f"{fw} dweight", floor=floor * 10)
        if op == "ln":
            assert_close(db, ref_db, rounded(ref_db, dtype), name=f"{fw} dbias", floor=floor * 10)
    if has_res:
        np.testing.assert_array_equal(np64(tout[1]), h)
        np.testing.assert_array_equal(np64(jout[1]), h)
    np.testing.assert_array_equal(np64(ty), np64(jy))
    np.testing.assert_array_equal(np64(tx.grad), np64(jdx))


@pytest.mark.parametrize("n", [1, 2, 40, 1000])
def test_layer_norm_of_constant_rows_far_above_sqrt_eps(n):
    """A row of equal values near 1e20 or 1e38 has variance 0 and rstd 1 / sqrt(eps) (eps vanishes against the
    row's scale): y = bias, dx = rstd * (g - mean(g)), in both frameworks. A value with a full mantissa
    (3.636029...) makes the float32 sums round: the mean still has to be the value itself."""
    eps = 1e-6
    x = np.repeat(np.array([[1e20], [-3e30], [3e38], [1.5], [3.636029]], np.float32), n, axis=1).astype(np.float64)
    rng = np.random.default_rng(n)
    w, b, dy = (rounded(rng.standard_normal(s), "float32") for s in ((n,), (n,), x.shape))
    ref_y = R.layer_norm(x, w, b, eps=eps)
    ref_dx, ref_dw, ref_db, _ = R.layer_norm_bwd(dy, x, w, b, eps=eps)
    tx, tw, tb = _to_torch(x, "float32", True), _to_torch(w, "float32", True), _to_torch(b, "float32", True)
    ty = ft.layer_norm(tx, tw, tb, eps=eps)
    ty.backward(_to_torch(dy, "float32"))
    jy, vjp = jax.vjp(lambda x, w, b: fj.layer_norm(x, w, b, eps=eps), *(_to_jax(a, "float32") for a in (x, w, b)))
    jdx, jdw, jdb = vjp(_to_jax(dy, "float32"))
    for fw, y, dx, dw, db in (("torch", ty, tx.grad, tw.grad, tb.grad), ("jax", jy, jdx, jdw, jdb)):
        assert_close(y, ref_y, rounded(ref_y, "float32"), name=f"{fw} y", floor=FLOOR["float32"])
        assert_close(dx, ref_dx, rounded(ref_dx, "float32"), name=f"{fw} dx", floor=FLOOR["float32"])
        assert_close(dw, ref_dw, rounded(ref_dw, "float32"), name=f"{fw} dweight", floor=FLOOR["float32"])
        assert_close(db, ref_db, rounded(ref_db, "float32"), name=f"{fw} dbias", floor=FLOOR["float32"])


@pytest.mark.parametrize("op", ["rms", "ln"])
def test_reference_backward_matches_finite_differences(op):
    rng = np.random.default_rng(0)
    x, w, b, r = (rng.standard_normal((3, 7)), rng.standard_normal(7), rng.standard_normal(7),
                  rng.standard_normal((3, 7)))
    dy, dh = rng.standard_normal((3, 7)), rng.standard_normal((3, 7))

    def loss(x, w, b, r):
        if op == "rms":
            y, h = R.rms_norm(x, w, eps=1e-3, residual=r)
        else:
            y, h = R.layer_norm(x, w, b, eps=1e-3, residual=r)
        return np.sum(y * dy) + np.sum(h * dh)

    if op == "rms":
        dx, dw, dres = R.rms_norm_bwd(dy, x, w, eps=1e-3, residual=r, dh=dh)
        analytic = {"x": dx, "w": dw, "r": dres}
    else:
        dx, dw, db, dres = R.layer_norm_bwd(dy, x, w, b, eps=1e-3, residual=r, dh=dh)
        analytic = {"x": dx, "w": dw, "b": db, "r": dres}
    args = {"x": x, "w": w, "b": b, "r": r}
    for name, grad in analytic.items():
        numeric = np.zeros_like(args[name])
        for idx in np.ndindex(*args[name].shape):
            plus = {k: v.copy() for k, v in args.items()}
            minus = {k: v.copy() for k, v in args.items()}
            plus[name][idx] += 1e-6
            minus[name][idx] -= 1e-6
            numeric[idx] = (loss(**plus) - loss(**minus)) / 2e-6
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6, err_msg=name)


def test_reference_dropout_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    x, w, b, r, dy = (rng.standard_normal((2, 5)), rng.standard_normal(5), rng.standard_normal(5),
                      rng.standard_normal((2, 5)), rng.standard_normal((2, 5)))
    keep = rng.random((2, 5)) > 0.3

    def loss(x, w, b, r):
        return np.sum(R.layer_norm_dropout_residual(x, w, b, r, keep_mask=keep, dropout_p=0.3) * dy)

    grads = R.layer_norm_dropout_residual_bwd(dy, x, w, b, r, keep_mask=keep, dropout_p=0.3)
    for i, (name, arg) in enumerate({"x": x, "w": w, "b": b, "r": r}.items()):
        numeric = np.zeros_like(arg)
        for idx in np.ndindex(*arg.shape):
            args_p = [a.copy() for a in (x, w, b, r)]
            args_m = [a.copy() for a in (x, w, b, r)]
            args_p[i][idx] += 1e-6
            args_m[i][idx] -= 1e-6
            numeric[idx] = (loss(*args_p) - loss(*args_m)) / 2e-6
        np.testing.assert_allclose(grads[i], numeric, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dropout_residual_same_mask_in_both_frameworks(dtype):
    rng = np.random.default_rng(2)
    shape, p, seed = (3, 50, 96), 0.25, 1234
    x, r = _rand(rng, shape, dtype), _rand(rng, shape, dtype)
    w, b = _rand(rng, (96,), dtype, shift=1.0), _rand(rng, (96,), dtype)
    dy = _rand(rng, shape, dtype)

    tx, tw, tb, tr = (_to_torch(a, dtype, True) for a in (x, w, b, r))
    ty = ft.layer_norm_dropout_residual(tx, tw, tb, tr, dropout_p=p, seed=seed)
    ty.backward(_to_torch(dy, dtype))

    f = lambda x, w, b, r: fj.layer_norm_dropout_residual(x, w, b, r, dropout_p=p, seed=seed)  # noqa: E731
    jy, vjp = jax.vjp(f, *(_to_jax(a, dtype) for a in (x, w, b, r)))
    jgrads = vjp(_to_jax(dy, dtype))

    np.testing.assert_array_equal(np64(ty), np64(jy))
    for tg, jg in zip((tx.grad, tw.grad, tb.grad, tr.grad), jgrads):
        np.testing.assert_array_equal(np64(tg), np64(jg))

    # The mask: about p of the elements dropped; recover it and check everything against the reference.
    z = R.layer_norm(x, w, b, eps=1e-5)
    # The mask does not depend on the dtype: read it off a float32 run with the same seed, where a kept
    # element (z / (1-p), never exactly 0 for these inputs) cannot vanish in the rounding of z + r.
    y32 = ft.layer_norm_dropout_residual(*(torch.tensor(a, dtype=torch.float32) for a in (x, w, b, r)),
                                         dropout_p=p, seed=seed)
    keep = np.abs(np64(y32) - r) > 0
    assert abs((1 - keep.mean()) - p) < 0.02
    ref_y = R.layer_norm_dropout_residual(x, w, b, r, keep_mask=keep, dropout_p=p)
    naive_y = rounded(rounded(np.where(keep, z / (1 - p), 0.0), dtype) + r, dtype)
    assert_close(ty, ref_y, naive_y, name="y", floor=FLOOR[dtype])
    ref_g = R.layer_norm_dropout_residual_bwd(dy, x, w, b, r, keep_mask=keep, dropout_p=p)
    for name, got, ref in zip(("dx", "dw", "db", "dres"), (tx.grad, tw.grad, tb.grad, tr.grad), ref_g):
        assert_close(got, ref, rounded(ref, dtype), name=name, floor=FLOOR[dtype] * 10)

    # Another seed, another mask; the same seed again, the same mask.
    other = ft.layer_norm_dropout_residual(tx, tw, tb, tr, dropout_p=p, seed=seed + 1)
    again = ft.layer_norm_dropout_residual(tx, tw, tb, tr, dropout_p=p, seed=torch.tensor(seed))
    assert not torch.equal(other, ty)
    assert torch.equal(again, ty)


def test_backward_is_deterministic():
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.standard_normal((257, 300)), dtype=torch.float32, requires_grad=True)
    w = torch.tensor(rng.standard_normal(300), dtype=torch.float32, requires_grad=True)
    b = torch.tensor(rng.standard_normal(300), dtype=torch.float32, requires_grad=True)
    dy = torch.tensor(rng.standard_normal((257, 300)), dtype=torch.float32)
    grads = []
    for _ in range(2):
        x.grad = w.grad = b.grad = None
        ft.layer_norm(x, w, b).backward(dy)
        grads.append((x.grad.clone(), w.grad.clone(), b.grad.clone()))
    for a, b_ in zip(*grads):
        assert torch.equal(a, b_)


def test_non_contiguous_inputs():
    rng = np.random.default_rng(4)
    base = torch.tensor(rng.standard_normal((40, 64)), dtype=torch.float32)
    x = base.t()  # (64, 40), not contiguous
    w = torch.tensor(rng.standard_normal(80), dtype=torch.float32)[::2]  # strided weight
    y = ft.rms_norm(x, w)
    ref = R.rms_norm(np64(x), np64(w))
    assert_close(y, ref, rounded(ref, "float32"), name="y")


def test_torch_compile_fullgraph_and_opcheck():
    rng = np.random.default_rng(5)
    x = torch.tensor(rng.standard_normal((4, 33)), dtype=torch.float32, requires_grad=True)
    r = torch.tensor(rng.standard_normal((4, 33)), dtype=torch.float32, requires_grad=True)
    w = torch.tensor(rng.standard_normal(33), dtype=torch.float32, requires_grad=True)
    b = torch.tensor(rng.standard_normal(33), dtype=torch.float32, requires_grad=True)

    def block(x, r, w, b):
        y, h = ft.layer_norm(x, w, b, residual=r)
        return (y * 2).sum() + ft.rms_norm(h, w).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, r, w, b)
    out.backward()
    got = [t.grad.clone() for t in (x, r, w, b)]
    for t in (x, r, w, b):
        t.grad = None
    block(x, r, w, b).backward()
    for g, t in zip(got, (x, r, w, b)):
        torch.testing.assert_close(g, t.grad)

    seed = torch.tensor([7], dtype=torch.int32)
    torch.library.opcheck(torch.ops.flashbridge.norm_fwd.default,
                          (x, w, b, r, None, None, 1e-5, False, 0.0))
    torch.library.opcheck(torch.ops.flashbridge.norm_fwd.default,
                          (x, w, None, None, r, seed, 1e-5, True, 0.3))
    torch.library.opcheck(torch.ops.flashbridge.norm_fwd.default,
                          (x, None, None, None, None, None, 1e-6, True, 0.0))


def test_jax_jit_grad_vmap():
    rng = np.random.default_rng(6)
    xs = jnp.asarray(rng.standard_normal((3, 5, 40)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(40), jnp.float32)
    b = jnp.asarray(rng.standard_normal(40), jnp.float32)

    def loss(x, w, b):
        return jnp.sum(fj.layer_norm(x, w, b) ** 2)

    # vmap of the forward folds the mapped axis into rows
    batched = jax.jit(jax.vmap(lambda x: fj.layer_norm(x, w, b)))(xs)
    np.testing.assert_array_equal(np.asarray(batched), np.asarray(fj.layer_norm(xs, w, b)))
    # per-example gradients: vmap of grad against a Python loop
    per_ex = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, None)))(xs, w, b)
    for i in range(3):
        one = jax.grad(loss, argnums=(0, 1, 2))(xs[i], w, b)
        for a, c in zip(per_ex, one):
            np.testing.assert_allclose(np.asarray(a[i]), np.asarray(c), rtol=1e-6, atol=1e-6)
    # vmap over a batch of weights (per-example parameters)
    ws = jnp.stack([w, w * 2, w - 1])
    out = jax.vmap(lambda x, w: fj.rms_norm(x, w))(xs, ws)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(fj.rms_norm(xs[i], ws[i])), rtol=1e-6)
    # grad against the reference
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xs, w, b)
    y = R.layer_norm(np.asarray(xs), np.asarray(w), np.asarray(b))
    ref = R.layer_norm_bwd(2 * y, np.asarray(xs), np.asarray(w), np.asarray(b))
    for a, r_ in zip(g, ref[:3]):
        np.testing.assert_allclose(np.asarray(a), r_, rtol=2e-4, atol=2e-4)


def test_jax_backward_skips_the_gradient_of_a_bias_that_is_not_differentiated(monkeypatch):
    """A frozen (closed-over) bias: no dbias reduction is planned, dx / dweight / dresidual are unchanged."""
    from flashbridge.jax_api import norms as jax_norms

    rng = np.random.default_rng(16)
    x, res = (jnp.asarray(rng.standard_normal((7, 48)), jnp.float32) for _ in range(2))
    w, b = (jnp.asarray(rng.standard_normal(48), jnp.float32) for _ in range(2))
    planned = []
    plan = jax_norms.plan_norm_bwd
    monkeypatch.setattr(jax_norms, "plan_norm_bwd", lambda *a, **k: planned.append(k["bias_dtype"]) or plan(*a, **k))

    def loss(x, w, b, res):
        y, h = fj.layer_norm(x, w, b, residual=res)
        return jnp.sum(y ** 2) + jnp.sum(jnp.sin(h))

    full = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, b, res)
    assert planned == ["float32"]
    frozen = jax.jit(jax.grad(lambda x, w, res: loss(x, w, b, res), argnums=(0, 1, 2)))(x, w, res)
    assert planned == ["float32", None]
    for a, c in zip(frozen, (full[0], full[1], full[3])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    # h unused: its cotangent is a symbolic zero, the result equals the reference with dh = 0
    gx = jax.grad(lambda x: jnp.sum(fj.layer_norm(x, w, b, residual=res)[0] ** 2))(x)
    xs = np.asarray(x, np.float64) + np.asarray(res, np.float64)
    y = R.layer_norm(xs, np.asarray(w, np.float64), np.asarray(b, np.float64))
    ref = R.layer_norm_bwd(2 * y, xs, np.asarray(w, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(np.asarray(gx), ref[0], rtol=2e-4, atol=2e-4)
    # y unused: only h = x + residual carries a gradient
    gx = jax.grad(lambda x: jnp.sum(jnp.sin(fj.layer_norm(x, w, b, residual=res)[1])))(x)
    np.testing.assert_allclose(np.asarray(gx), np.cos(np.asarray(x) + np.asarray(res)), rtol=1e-5, atol=1e-6)


def test_jax_shard_map_over_data_axis():
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:  # older JAX
        from jax.experimental.shard_map import shard_map
    devices = np.array(jax.devices()[:4])
    assert len(devices) == 4, "conftest sets four host devices"
    mesh = Mesh(devices, ("data",))
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((8, 6, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(48), jnp.float32)

    def local(x, w):
        return fj.rms_norm(x, w)

    sharded = shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    np.testing.assert_array_equal(np.asarray(jax.jit(sharded)(x, w)), np.asarray(fj.rms_norm(x, w)))

    def loss(x, w):
        return jnp.sum(sharded(x, w) ** 2)

    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    rx, rw = jax.grad(lambda x, w: jnp.sum(fj.rms_norm(x, w) ** 2), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_torch_modules_are_drop_ins(cls):
    rng = np.random.default_rng(8)
    ours = getattr(ft, cls)((6, 10), eps=1e-5)
    theirs = getattr(torch.nn, cls)((6, 10), eps=1e-5)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.tensor(rng.standard_normal(p.shape), dtype=p.dtype))
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.tensor(rng.standard_normal((3, 6, 10)), dtype=torch.float32)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
    theirs.load_state_dict(ours.state_dict())  # and back
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours(x1).square().sum().backward()
    theirs(x2).square().sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    # torch.nn.RMSNorm's eps=None default is finfo(dtype).eps: same here
    if cls == "RMSNorm":
        torch.testing.assert_close(ft.RMSNorm(10)(x[0]), torch.nn.RMSNorm(10)(x[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", ["RMSNorm", "LayerNorm"])
def test_flax_modules_are_drop_ins(cls):
    from flax import nnx
    rng = np.random.default_rng(9)
    ours = getattr(fj, cls)(24, rngs=nnx.Rngs(0))
    theirs = getattr(nnx, cls)(24, rngs=nnx.Rngs(0))
    state = nnx.state(theirs)
    state = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), state)
    nnx.update(theirs, state)
    nnx.update(ours, nnx.state(theirs))
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(theirs))
    x = jnp.asarray(rng.standard_normal((5, 24)) + 1.0, jnp.float32)
    np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(theirs(x)), rtol=2e-5, atol=2e-5)
    xb = x.astype(jnp.bfloat16)  # bf16 input, f32 params -> f32 output, as in flax
    assert ours(xb).dtype == theirs(xb).dtype == jnp.float32


# ------------------------------------------------------------------------------------------ bad input

def _bad_cases():
    f32 = torch.float32
    return [
        (lambda: ft.rms_norm(torch.randn(4, 8), torch.randn(7)), ValueError, "weight"),
        (lambda: ft.layer_norm(torch.randn(4, 8), torch.randn(8), torch.randn(9)), ValueError, "bias"),
        (lambda: ft.rms_norm(torch.randn(4, 8), residual=torch.randn(4, 9)), ValueError, "residual"),
        (lambda: ft.rms_norm(torch.randn(4, 8), residual=torch.randn(4, 8, dtype=torch.float16)), TypeError,
         "residual"),
        (lambda: ft.rms_norm(torch.randn(4, 8, dtype=torch.float64)), TypeError, "x"),
        (lambda: ft.rms_norm(torch.randint(0, 3, (4, 8))), TypeError, "x"),
        (lambda: ft.rms_norm(torch.randn(0, 8)), ValueError, "x"),
        (lambda: ft.rms_norm(torch.randn(4, 0)), ValueError, "x"),
        (lambda: ft.rms_norm(torch.randn(2, 65537)), ValueError, "x"),
        (lambda: ft.rms_norm(torch.randn(4, 8), eps=0.0), ValueError, "eps"),
        (lambda: ft.layer_norm(torch.randn(4, 8), eps=-1.0), ValueError, "eps"),
        (lambda: ft.layer_norm_dropout_residual(torch.randn(4, 8), None, None, torch.randn(4, 8), dropout_p=1.0),
         ValueError, "dropout_p"),
        (lambda: ft.layer_norm_dropout_residual(torch.randn(4, 8), None, None, None), ValueError, "residual"),
        (lambda: ft.layer_norm_dropout_residual(torch.randn(4, 8), None, None, torch.randn(4, 8), dropout_p=0.1,
                                                seed=1.5), TypeError, "seed"),
        (lambda: ft.layer_norm_dropout_residual(torch.randn(4, 8), None, None, torch.randn(4, 8), dropout_p=0.1,
                                                seed=2**40), ValueError, "seed"),
        (lambda: ft.rms_norm(torch.randn(4, 8), torch.randn(8).to("meta")), ValueError, "weight"),
        (lambda: ft.rms_norm(torch.randn(4, 8, dtype=f32).numpy()), TypeError, "x"),
        (lambda: fj.rms_norm(jnp.ones((4, 8)), jnp.ones(7)), ValueError, "weight"),
        (lambda: fj.layer_norm(jnp.ones((4, 8)), eps=0.0), ValueError, "eps"),
        (lambda: fj.rms_norm(jnp.ones((4, 8), jnp.int32)), TypeError, "x"),
        (lambda: fj.rms_norm(jnp.ones((0, 8))), ValueError, "x"),
        (lambda: fj.layer_norm(jnp.ones((4, 8)), residual=jnp.ones((4, 8), jnp.float16)), TypeError, "residual"),
        (lambda: fj.layer_norm_dropout_residual(jnp.ones((4, 8)), None, None, jnp.ones((4, 8)), dropout_p=0.5,
                                                seed=jnp.ones(2, jnp.int32)), TypeError, "seed"),
        (lambda: fj.rms_norm([1.0, 2.0]), TypeError, "x"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_input_is_rejected_with_a_clear_error(i):
    fn, exc, arg = _bad_cases()[i]
    with pytest.raises(exc, match=arg):
        fn()


def test_buffers_are_poisoned_in_tests():
    """The autouse fixture fills kernel outputs with NaN before launches (both runtimes)."""
    from flashbridge.core_kernels import Spec
    from flashbridge.jax_api._runtime import _host_alloc
    from flashbridge.torch_api._runtime import _alloc

    assert torch.isnan(_alloc(Spec("y", (3, 4), "float32"), torch.float32, torch.device("cpu"))).all()
    assert (_alloc(Spec("i", (5,), "int32"), torch.int32, torch.device("cpu")) == -1).all()
    assert np.isnan(_host_alloc(Spec("y", (3, 4), "bfloat16"))).all()
    assert (_alloc(Spec("z", (2,), "float32", zero=True), torch.float32, torch.device("cpu")) == 0).all()


def test_tolerance_rule_rejects_wrong_and_non_finite_outputs():
    ref = np.linspace(-2.0, 2.0, 50)
    naive = rounded(ref, "bfloat16")
    assert_close(naive, ref, naive, name="naive itself")
    with pytest.raises(AssertionError, match="bound"):
        assert_close(ref + 0.1, ref, naive)
    with pytest.raises(AssertionError, match="bound"):
        assert_close(np.where(ref > 0, np.nan, ref), ref, naive)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(ref[:-1], ref, naive)
