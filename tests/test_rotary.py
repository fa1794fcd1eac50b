"""Rotary position embeddings on the CPU (Triton interpreter), both frameworks, against the float64 reference."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from flashbridge.reference import rotary as R
from helpers import assert_close, np64, rounded

SEED_OFFSET = int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))


# ----------------------------------------------------------------------------------- the reference itself

def _fd_grad(loss, x, eps=1e-6):
    numeric = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric[idx] = (loss(plus) - loss(minus)) / (2 * eps)
    return numeric


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "position_ids", "packed"])
def test_reference_backward_matches_finite_differences(interleaved, layout):
    rng = np.random.default_rng(0)
    cos, sin = R.cos_sin_table(9, 4, base=3.0)  # rotary_dim 4 of head dim 6: two dims pass through
    kw = {}
    if layout == "packed":
        x = rng.standard_normal((7, 2, 6))
        kw["cu_seqlens"] = np.array([0, 3, 3, 7])
    else:
        x = rng.standard_normal((2, 3, 2, 6))
        if layout == "position_ids":
            kw["position_ids"] = rng.integers(0, 9, (2, 3))
    dy = rng.standard_normal(x.shape)

    def loss(x):
        return np.sum(R.rotary_embedding(x, cos, sin, interleaved=interleaved, **kw) * dy)

    np.testing.assert_allclose(R.rotary_embedding_bwd(dy, cos, sin, interleaved=interleaved, **kw),
                               _fd_grad(loss, x), rtol=1e-6, atol=1e-7)


def test_reference_is_a_complex_rotation():
    """NeoX RoPE multiplies (x_i + j x_{i+R/2}) by exp(j p theta_i); GPT-J does it to (x_2i + j x_2i+1)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 10))
    cos, sin = R.cos_sin_table(5, 8)
    angle = np.arctan2(sin, cos)[None, :, None, :]  # (1, S, 1, R/2)
    rot = np.exp(1j * angle)
    neox = R.rotary_embedding(x, cos, sin)
    z = (x[..., :4] + 1j * x[..., 4:8]) * rot
    np.testing.assert_allclose(neox[..., :4], z.real, atol=1e-12)
    np.testing.assert_allclose(neox[..., 4:8], z.imag, atol=1e-12)
    gptj = R.rotary_embedding(x, cos, sin, interleaved=True)
    z = (x[..., 0:8:2] + 1j * x[..., 1:8:2]) * rot
    np.testing.assert_allclose(gptj[..., 0:8:2], z.real, atol=1e-12)
    np.testing.assert_allclose(gptj[..., 1:8:2], z.imag, atol=1e-12)
    np.testing.assert_array_equal(neox[..., 8:], x[..., 8:])
    # packed positions restart per sequence
    np.testing.assert_array_equal(R.positions((6, 2, 4), cu_seqlens=[0, 2, 2, 6]), [0, 1, 0, 1, 2, 3])


# ---------------------------------------------------------------------------------------- both frameworks

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from flashbridge import jax_api as fj  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 2e-6, "float16": 1e-4, "bfloat16": 1e-3}

# tokens ((B, S) or (T,) packed), heads, k heads (0: no k), head dim, rotary dim, dtype, interleaved, positions
CASES = [
    ((2, 17), 3, 0, 16, 16, "float32", False, "sequence"),
    ((2, 17), 3, 1, 20, 12, "bfloat16", True, "position_ids"),
    ((1, 63), 4, 2, 64, 64, "float16", False, "position_ids_1"),
    ((45,), 2, 2, 10, 8, "float32", True, "cu_seqlens"),
    ((30,), 5, 0, 128, 64, "bfloat16", False, "packed_position_ids"),
    ((3, 5), 1, 7, 2, 2, "float32", False, "sequence"),
    ((1, 130), 2, 1, 96, 96, "bfloat16", True, "sequence"),
    ((2, 9), 32, 8, 128, 128, "bfloat16", False, "position_ids"),
]
CU_SEQLENS = {45: [0, 7, 7, 30, 45]}  # an empty sequence among them


def _case_id(c):
    tokens, h, hk, d, rd, dtype, inter, pos = c
    return f"{'x'.join(map(str, tokens))}-h{h}k{hk}-d{d}r{rd}-{dtype}-{'gptj' if inter else 'neox'}-{pos}"


def _inputs(case):
    """float64 values exactly representable in the case's dtype, and the index arrays, as numpy."""
    tokens, h, hk, d, rd, dtype, inter, pos = case
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()) + SEED_OFFSET)
    rows = 150
    cos, sin = R.cos_sin_table(rows, rd)
    # the tables in the inputs' dtype, as a model usually keeps them (the kernel widens them to float32)
    cos, sin = rounded(cos, dtype), rounded(sin, dtype)
    x = rounded(rng.standard_normal((*tokens, h, d)), dtype)
    k = rounded(rng.standard_normal((*tokens, hk, d)), dtype) if hk else None
    dy = rounded(rng.standard_normal(x.shape), dtype)
    dk = rounded(rng.standard_normal(k.shape), dtype) if hk else None
    idx = {}
    if pos == "position_ids":
        idx["position_ids"] = rng.integers(0, rows, tokens)
    elif pos == "position_ids_1":
        idx["position_ids"] = rng.integers(0, rows, (1, tokens[1])).astype(np.int32)
    elif pos == "packed_position_ids":
        idx["position_ids"] = rng.integers(0, rows, tokens).astype(np.int32)
    elif pos == "cu_seqlens":
        idx["cu_seqlens"] = np.array(CU_SEQLENS[tokens[0]], dtype=np.int32)
    return x, k, cos, sin, dy, dk, idx


def _naive(x, cos, sin, dtype, conjugate=False, **idx):
    """RoPE in the inputs' dtype with every product and sum rounded: the error a plain implementation makes."""
    pos = R.positions(x.shape, **idx)
    c, s = cos[pos][..., None, :], sin[pos][..., None, :]
    s = -s if conjugate else s
    half = c.shape[-1]
    if _naive.interleaved:
        a, b = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        a, b = slice(0, half), slice(half, 2 * half)
    out = x.copy()
    out[..., a] = rounded(rounded(x[..., a] * c, dtype) - rounded(x[..., b] * s, dtype), dtype)
    out[..., b] = rounded(rounded(x[..., b] * c, dtype) + rounded(x[..., a] * s, dtype), dtype)
    return out


def _expected(case):
    """Per output (x, and k when present): (reference, naive) forward and backward."""
    tokens, h, hk, d, rd, dtype, inter, pos = case
    x, k, cos, sin, dy, dk, idx = _inputs(case)
    _naive.interleaved = inter
    out = []
    for a, da in ((x, dy), (k, dk)):
        if a is None:
            continue
        out.append((R.rotary_embedding(a, cos, sin, interleaved=inter, **idx), _naive(a, cos, sin, dtype, **idx),
                    R.rotary_embedding_bwd(da, cos, sin, interleaved=inter, **idx),
                    _naive(da, cos, sin, dtype, conjugate=True, **idx)))
    return out


def _torch(a, dtype, grad=False):
    if a is None:
        return None
    if np.issubdtype(np.asarray(a).dtype, np.integer):
        return torch.tensor(a)
    return torch.tensor(a, dtype=TORCH_DTYPES[dtype], requires_grad=grad)


def _torch_run(case, inplace=False):
    """(outputs, input gradients) of the torch op on the case's inputs."""
    tokens, h, hk, d, rd, dtype, inter, pos = case
    x, k, cos, sin, dy, dk, idx = _inputs(case)
    tx, tk = _torch(x, dtype, True), _torch(k, dtype, True)
    kw = dict(interleaved=inter, inplace=inplace, **{n: _torch(v, dtype) for n, v in idx.items()})
    tcos, tsin = _torch(cos, dtype), _torch(sin, dtype)
    if inplace:  # a non-leaf, as the output of a projection would be (autograd forbids writing into leaves)
        src = (tx, tk)
        tx, tk = tx * 1, (tk * 1 if tk is not None else None)
    if tk is None:
        outs = (ft.rotary_embedding(tx, tcos, tsin, **kw),)
    else:
        outs = ft.rotary_embedding_qk(tx, tk, tcos, tsin, **kw)
    grads = torch.autograd.grad(outs, [t for t in (src if inplace else (tx, tk)) if t is not None],
                                [_torch(dy, dtype)] + ([_torch(dk, dtype)] if tk is not None else []))
    return outs, grads


def _jax_run(case, inplace=False):
    """(outputs, input gradients) of the JAX op on the case's inputs."""
    tokens, h, hk, d, rd, dtype, inter, pos = case
    x, k, cos, sin, dy, dk, idx = _inputs(case)
    kw = dict(interleaved=inter, inplace=inplace, **{n: jnp.asarray(v) for n, v in idx.items()})
    jcos, jsin = jnp.asarray(cos, dtype), jnp.asarray(sin, dtype)
    if k is None:
        out, vjp = jax.vjp(lambda x: (fj.rotary_embedding(x, jcos, jsin, **kw),), jnp.asarray(x, dtype))
        return out, vjp((jnp.asarray(dy, dtype),))
    out, vjp = jax.vjp(lambda q, k: fj.rotary_embedding_qk(q, k, jcos, jsin, **kw), jnp.asarray(x, dtype),
                       jnp.asarray(k, dtype))
    return out, vjp((jnp.asarray(dy, dtype), jnp.asarray(dk, dtype)))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward_both_frameworks(case):
    dtype = case[5]
    t_outs, t_grads = _torch_run(case)
    j_outs, j_grads = _jax_run(case)
    for (ref, naive, dref, dnaive), out, grad, jout, jgrad, name in zip(_expected(case), t_outs, t_grads, j_outs,
                                                                       j_grads, ("x", "k")):
        assert out.dtype == TORCH_DTYPES[dtype] and out.shape == ref.shape
        assert jout.dtype == jnp.dtype(dtype) and jout.shape == ref.shape
        for fw, o, g in (("torch", out, grad), ("jax", jout, jgrad)):
            assert_close(o, ref, naive, name=f"{fw} {name} out", floor=FLOOR[dtype])
            assert_close(g, dref, dnaive, name=f"{fw} d{name}", floor=FLOOR[dtype])
        # the same kernel on the same device: the same bits in both frameworks
        np.testing.assert_array_equal(np64(out), np64(jout))
        np.testing.assert_array_equal(np64(grad), np64(jgrad))


@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]], ids=_case_id)
def test_torch_inplace(case):
    """In place: through the kernel without autograd (x itself updated, version bumped), and through the
    out-of-place op plus a recorded copy with autograd; both equal the out-of-place result bit for bit."""
    tokens, h, hk, d, rd, dtype, inter, pos = case
    x, k, cos, sin, dy, dk, idx = _inputs(case)
    outs, grads = _torch_run(case)
    in_outs, in_grads = _torch_run(case, inplace=True)
    for a, b in zip((*outs, *grads), (*in_outs, *in_grads)):
        assert torch.equal(a, b)
    kw = dict(interleaved=inter, **{n: _torch(v, dtype) for n, v in idx.items()})
    tx, tk = _torch(x, dtype), _torch(k, dtype)
    ptr, version = tx.data_ptr(), tx._version
    with torch.no_grad():
        if tk is None:
            res = (ft.rotary_embedding(tx, _torch(cos, dtype), _torch(sin, dtype), inplace=True, **kw),)
        else:
            res = ft.rotary_embedding_qk(tx, tk, _torch(cos, dtype), _torch(sin, dtype), inplace=True, **kw)
    assert res[0] is tx and tx.data_ptr() == ptr and tx._version > version
    for a, b in zip(res, outs):
        assert torch.equal(a, b)


def test_torch_strided_views_of_a_packed_qkv():
    """q and k sliced out of one (B, S, 3, H, D) projection: read through their strides, rotated in place
    into the projection (v untouched), equal to the contiguous result."""
    rng = np.random.default_rng(7)
    qkv = torch.tensor(rng.standard_normal((2, 11, 3, 4, 32)), dtype=torch.float32)
    cos, sin = (torch.tensor(t, dtype=torch.float32) for t in R.cos_sin_table(16, 24))
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    ref_q, ref_k = ft.rotary_embedding_qk(q.contiguous(), k.contiguous(), cos, sin)
    got_q, got_k = ft.rotary_embedding_qk(q, k, cos, sin)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)
    v_before = v.clone()
    ft.rotary_embedding_qk(q, k, cos, sin, inplace=True)
    assert torch.equal(qkv[:, :, 0], ref_q) and torch.equal(qkv[:, :, 1], ref_k)
    assert torch.equal(qkv[:, :, 2], v_before)


def test_torch_inplace_bumps_the_version_autograd_checks():
    """A tensor saved for another op's backward, then rotated in place: autograd refuses the stale value."""
    w = torch.randn(4, 8, requires_grad=True)
    x = torch.randn(1, 3, 4, 8)
    y = (w * x).sum()  # saves x for w's gradient
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    ft.rotary_embedding(x, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_torch_cos_sin_get_no_gradient():
    x = torch.randn(1, 5, 2, 8, requires_grad=True)
    cos, sin = (torch.tensor(t, dtype=torch.float32, requires_grad=True) for t in R.cos_sin_table(5, 8))
    ft.rotary_embedding(x, cos, sin).sum().backward()
    assert x.grad is not None and cos.grad is None and sin.grad is None


def test_torch_compile_fullgraph_and_opcheck():
    rng = np.random.default_rng(5)
    q = torch.tensor(rng.standard_normal((2, 7, 4, 16)), dtype=torch.float32, requires_grad=True)
    k = torch.tensor(rng.standard_normal((2, 7, 2, 16)), dtype=torch.float32, requires_grad=True)
    cos, sin = (torch.tensor(t, dtype=torch.float32) for t in R.cos_sin_table(8, 12))
    pos = torch.tensor(rng.integers(0, 8, (2, 7)))

    def block(q, k):
        q2, k2 = ft.rotary_embedding_qk(q * 2, k, cos, sin, position_ids=pos)
        return (q2 * ft.rotary_embedding(q, cos, sin, interleaved=True)).sum() + k2.square().sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled(q, k).backward()
    got = [t.grad.clone() for t in (q, k)]
    q.grad = k.grad = None
    block(q, k).backward()
    for a, t in zip(got, (q, k)):
        torch.testing.assert_close(a, t.grad)

    def inplace(q, k):  # no autograd: the mutating op, functionalised by torch.compile
        q2 = q * 1
        ft.rotary_embedding_qk(q2, k, cos, sin, inplace=True)
        return q2

    qd, kd = q.detach(), k.detach()
    want_q, want_k = ft.rotary_embedding_qk(qd, kd, cos, sin)
    k_copy = kd.clone()
    with torch.no_grad():
        got_q = torch.compile(inplace, fullgraph=True, backend="aot_eager")(qd, k_copy)
    assert torch.equal(got_q, want_q) and torch.equal(k_copy, want_k)

    cu = torch.tensor([0, 3, 14], dtype=torch.int32)
    packed = qd.reshape(14, 4, 16)
    torch.library.opcheck(torch.ops.flashbridge.rotary.default, (q, k, cos, sin, pos, None, False, False))
    torch.library.opcheck(torch.ops.flashbridge.rotary.default, (packed, None, cos, sin, None, cu, True, False))
    torch.library.opcheck(torch.ops.flashbridge.rotary_.default, (qd.clone(), kd.clone(), cos, sin, None, None, False))


# -------------------------------------------------------------------------------------------------- JAX

@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]], ids=_case_id)
def test_jax_inplace_equals_out_of_place(case):
    """inplace=True aliases the outputs to x / k (and the backward's to the cotangents): the same bits,
    under jit with x donated too."""
    outs, grads = _jax_run(case)
    in_outs, in_grads = _jax_run(case, inplace=True)
    for a, b in zip((*outs, *grads), (*in_outs, *in_grads)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens, h, hk, d, rd, dtype, inter, pos = case
    x, k, cos, sin, dy, dk, idx = _inputs(case)
    idx = {n: jnp.asarray(v) for n, v in idx.items()}
    step = jax.jit(lambda x, c, s: fj.rotary_embedding(x, c, s, interleaved=inter, inplace=True, **idx),
                   donate_argnums=0)
    got = step(jnp.asarray(x, dtype), jnp.asarray(cos, dtype), jnp.asarray(sin, dtype))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(outs[0]))


def test_jax_jit_grad_vmap():
    rng = np.random.default_rng(6)
    cos, sin = (jnp.asarray(t, jnp.float32) for t in R.cos_sin_table(40, 12))
    xs = jnp.asarray(rng.standard_normal((3, 2, 9, 3, 16)), jnp.float32)
    ks = jnp.asarray(rng.standard_normal((3, 2, 9, 1, 16)), jnp.float32)
    pid = jnp.asarray(rng.integers(0, 40, (2, 9)), jnp.int32)

    def loss(q, k, pos):
        q2, k2 = fj.rotary_embedding_qk(q, k, cos, sin, position_ids=pos)
        return jnp.sum(q2 * jnp.sin(q2)) + jnp.sum(k2 ** 2)

    def fwd_and_grad(q, k, pos):
        return (*fj.rotary_embedding_qk(q, k, cos, sin, position_ids=pos), *jax.grad(loss, argnums=(0, 1))(q, k, pos))

    # the mapped axis folded into the batch: (B, S) position ids tiled, batched ones reshaped. Both sides
    # jitted: XLA's own sin in the loss rounds differently in and out of jit
    for pos_axis, positions in ((None, pid), (0, jnp.stack([pid, pid[::-1], pid[:, ::-1]]))):
        got = jax.jit(jax.vmap(fwd_and_grad, in_axes=(0, 0, pos_axis)))(xs, ks, positions)
        for i in range(3):
            want = jax.jit(fwd_and_grad)(xs[i], ks[i], positions if pos_axis is None else positions[i])
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))
    # (1, S) position ids broadcast over the folded batch; reference check of a gradient
    p1 = pid[:1]
    got = jax.vmap(lambda x: fj.rotary_embedding(x, cos, sin, position_ids=p1))(xs)
    np.testing.assert_allclose(np.asarray(got[2]), R.rotary_embedding(np.asarray(xs[2]), cos, sin, position_ids=p1),
                               rtol=1e-6, atol=1e-6)
    g = jax.jit(jax.grad(lambda x: jnp.sum(fj.rotary_embedding(x, cos, sin) ** 3)))(xs[0])
    y = R.rotary_embedding(np.asarray(xs[0]), cos, sin)
    np.testing.assert_allclose(np.asarray(g), R.rotary_embedding_bwd(3 * y ** 2, cos, sin), rtol=2e-5, atol=2e-5)
    # packed tokens and per-example tables: one launch per example
    packed = xs.reshape(3, 18, 3, 16)
    cu = jnp.array([0, 5, 18], jnp.int32)
    got = jax.vmap(lambda x: fj.rotary_embedding(x, cos, sin, cu_seqlens=cu, interleaved=True))(packed)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(
            fj.rotary_embedding(packed[i], cos, sin, cu_seqlens=cu, interleaved=True)))
    tables = jnp.stack([cos, cos * 0.5, -cos])
    got = jax.vmap(lambda x, c: fj.rotary_embedding(x, c, sin))(xs, tables)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(fj.rotary_embedding(xs[1], tables[1], sin)))


def test_jax_cos_sin_get_zero_gradient():
    x = jnp.ones((1, 5, 2, 8))
    cos, sin = (jnp.asarray(t, jnp.float32) for t in R.cos_sin_table(5, 8))
    gx, gc, gs = jax.grad(lambda x, c, s: jnp.sum(fj.rotary_embedding(x, c, s)), argnums=(0, 1, 2))(x, cos, sin)
    assert float(jnp.abs(gx).sum()) > 0 and not np.any(np.asarray(gc)) and not np.any(np.asarray(gs))


# ------------------------------------------------------------------------------------------ bad input

def _bad_cases():
    t = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt)  # noqa: E731
    j = lambda *s, dt=jnp.float32: jnp.ones(s, dt)  # noqa: E731
    cs = (t(16, 4), t(16, 4))
    jcs = (j(16, 4), j(16, 4))
    i32 = torch.int32
    return [
        (lambda: ft.rotary_embedding(t(16, 3, 8), *cs), ValueError, "cu_seqlens"),  # packed, no positions
        (lambda: ft.rotary_embedding(t(8, 3, 8, 1, 1), *cs), ValueError, "x"),
        (lambda: ft.rotary_embedding(t(2, 0, 3, 8), *cs), ValueError, "x"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8, dt=torch.float64), *cs), TypeError, "x"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 6), *cs), ValueError, "rotary_dim"),
        (lambda: ft.rotary_embedding(t(2, 20, 3, 8), *cs), ValueError, "cos"),  # seqlen > table rows
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), t(16, 4), t(16, 3)), ValueError, "sin"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), t(16), t(16)), ValueError, "cos"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), t(16, 4).int(), t(16, 4).int()), TypeError, "cos"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), *cs, position_ids=torch.zeros(2, 7, dtype=i32)), ValueError,
         "position_ids"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), *cs, position_ids=torch.zeros(2, 8)), TypeError, "position_ids"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), *cs, position_ids=torch.full((2, 8), 16)), ValueError,
         "position_ids"),
        (lambda: ft.rotary_embedding(t(10, 3, 8), *cs, cu_seqlens=torch.tensor([0, 4, 9], dtype=i32)), ValueError,
         "cu_seqlens"),  # does not end at the token count
        (lambda: ft.rotary_embedding(t(10, 3, 8), *cs, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=i32)),
         ValueError, "cu_seqlens"),
        (lambda: ft.rotary_embedding(t(40, 3, 8), *cs, cu_seqlens=torch.tensor([0, 20, 40], dtype=i32)), ValueError,
         "cu_seqlens"),  # a sequence longer than the table
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), *cs, cu_seqlens=torch.tensor([0, 16], dtype=i32)), ValueError,
         "cu_seqlens"),
        (lambda: ft.rotary_embedding(t(10, 3, 8), *cs, cu_seqlens=torch.tensor([0, 10], dtype=i32),
                                     position_ids=torch.zeros(10, dtype=i32)), ValueError, "position_ids"),
        (lambda: ft.rotary_embedding_qk(t(2, 8, 3, 8), t(2, 8, 1, 6), *cs), ValueError, "k"),
        (lambda: ft.rotary_embedding_qk(t(2, 8, 3, 8), t(2, 8, 1, 8, dt=torch.float16), *cs), TypeError, "k"),
        (lambda: ft.rotary_embedding_qk(t(2, 8, 3, 8, dt=torch.float64), t(2, 8, 1, 8), *cs), TypeError, "q"),
        (lambda: ft.rotary_embedding_qk(t(2, 8, 3, 8), None, *cs), TypeError, "k"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8).numpy(), *cs), TypeError, "x"),
        (lambda: ft.rotary_embedding(t(2, 8, 3, 8), t(16, 4).to("meta"), t(16, 4)), ValueError, "cos"),
        (lambda: fj.rotary_embedding(j(16, 3, 8), *jcs), ValueError, "cu_seqlens"),
        (lambda: fj.rotary_embedding(j(2, 8, 3, 6), *jcs), ValueError, "rotary_dim"),
        (lambda: fj.rotary_embedding(j(2, 8, 3, 8, dt=jnp.int32), *jcs), TypeError, "x"),
        (lambda: fj.rotary_embedding(j(2, 8, 3, 8), *jcs, position_ids=jnp.full((2, 8), 99, jnp.int32)), ValueError,
         "position_ids"),
        (lambda: fj.rotary_embedding(j(10, 3, 8), *jcs, cu_seqlens=jnp.array([0, 4, 9], jnp.int32)), ValueError,
         "cu_seqlens"),
        (lambda: fj.rotary_embedding_qk(j(2, 8, 3, 8), j(2, 7, 1, 8), *jcs), ValueError, "k"),
        (lambda: fj.rotary_embedding([1.0], *jcs), TypeError, "x"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_input_is_rejected_with_a_clear_error(i):
    fn, exc, arg = _bad_cases()[i]
    with pytest.raises(exc, match=arg):
        fn()
