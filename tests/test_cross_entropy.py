"""Cross-entropy family on the CPU (Triton interpreter), both frameworks, against the float64 reference."""
from __future__ import annotations

import importlib
import os
import zlib

import numpy as np
import pytest

from flashbridge.core_kernels import configure
from flashbridge.core_kernels.cross_entropy import plan as P
from flashbridge.reference import cross_entropy as R
from helpers import assert_close, np64, rounded

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy
F = torch.nn.functional

# The modules, not the functions of the same name that the packages export.
fjc = importlib.import_module("flashbridge.jax_api.cross_entropy")
ftc = importlib.import_module("flashbridge.torch_api.cross_entropy")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Floors relative to max(1, |ref|): tight for the kernels' own outputs (loss, lse, dlogits); for the linear
# op's gradients the float32 GEMMs (dh = dlogits @ W, dW = dlogits.T @ h; ours chunked, the naive one not)
# add ~eps*sqrt(K) of rounding noise whose maxima differ run to run, so those get the helpers' default.
FLOOR = {"float32": 1e-7, "float16": 1e-4, "bfloat16": 1e-4}
GEMM_FLOOR = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-3}
ALL = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcap=4.0)


SEED = int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))


def _rng(*key):
    """A generator per test case, stable across processes (str hashes are salted per process)."""
    return np.random.default_rng([zlib.crc32(repr(key).encode()), SEED])


def _labels(rng, lead, vocab, ignore_frac=0.15):
    y = rng.integers(0, vocab, size=lead)
    y = np.where(rng.random(lead) < ignore_frac, -100, y)
    return y.astype(np.int64)


def _upstream(rng, reduction, lead):
    return rng.standard_normal(lead) if reduction == "none" else np.float64(1.3)


def _naive_rows(z, y, ignore_index, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0):
    """torch eager in the input dtype: the yardstick of the error bound."""
    if logit_softcap:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    rows = F.cross_entropy(z, y, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(z, -1) ** 2 * (y != ignore_index)
    return rows


def _naive_reduce(rows, y, reduction, ignore_index=-100):
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (y != ignore_index).sum().clamp(min=1)


def _t(a, dtype, grad=False):
    return None if a is None else torch.tensor(a, dtype=TORCH_DTYPES[dtype], requires_grad=grad)


# ------------------------------------------------------------------------------------ logits-level op

CE_CASES = [  # lead, V, dtype, options, reduction
    ((1,), 1000, "float32", {}, "mean"),
    ((7,), 1000, "float32", ALL, "sum"),
    ((2, 65), 1000, "bfloat16", dict(label_smoothing=0.2), "none"),
    ((7,), 32003, "float32", dict(logit_softcap=3.0), "mean"),
    ((130,), 1000, "float32", ALL, "none"),
    ((5,), 1, "float32", dict(z_loss=1e-2), "mean"),
]


def _ce_id(c):
    return f"{'x'.join(map(str, c[0]))}xV{c[1]}-{c[2]}-{'-'.join(c[3]) or 'plain'}-{c[4]}"


@pytest.mark.parametrize("case", CE_CASES, ids=_ce_id)
def test_cross_entropy_both_frameworks(case):
    lead, vocab, dtype, opts, reduction = case
    rng = _rng("ce", _ce_id(case))
    x = rounded(rng.standard_normal((*lead, vocab)) * 3, dtype)
    y = _labels(rng, lead, vocab)
    g = _upstream(rng, reduction, lead)
    ref, ref_lse = R.cross_entropy(x, y, reduction=reduction, return_lse=True, **opts)
    ref_dx = R.cross_entropy_bwd(g, x, y, reduction=reduction, **opts)

    xt = _t(x, dtype, grad=True)
    naive = _naive_reduce(_naive_rows(xt.reshape(-1, vocab), torch.tensor(y).reshape(-1), -100, **opts),
                          torch.tensor(y).reshape(-1), reduction)
    naive = naive.reshape(lead) if reduction == "none" else naive
    (naive_dx,) = torch.autograd.grad(naive, xt, torch.tensor(g, dtype=naive.dtype))

    xt = _t(x, dtype, grad=True)
    loss, lse = ftc.cross_entropy(xt, torch.tensor(y), reduction=reduction, return_lse=True, **opts)
    assert loss.dtype == torch.float32 and lse.shape == lead
    loss.backward(torch.tensor(g, dtype=torch.float32))
    assert xt.grad.dtype == xt.dtype
    for name, out, r, nv in (("loss", loss, ref, naive), ("lse", lse, ref_lse, None),
                             ("dlogits", xt.grad, ref_dx, naive_dx)):
        assert_close(out, r, nv if nv is not None else rounded(r, "float32"), name=f"torch {name}",
                     floor=FLOOR[dtype])

    def f(xj):
        return fjc.cross_entropy(xj, jnp.asarray(y), reduction=reduction, return_lse=True, **opts)

    (jloss, jlse), vjp = jax.vjp(f, jnp.asarray(x, dtype=dtype))
    (jdx,) = vjp((jnp.asarray(g, jnp.float32), jnp.zeros(lead, jnp.float32)))
    assert jloss.dtype == jnp.float32 and jdx.dtype == jnp.dtype(dtype)
    assert_close(jloss, ref, naive, name="jax loss", floor=FLOOR[dtype])
    assert_close(jlse, ref_lse, rounded(ref_lse, "float32"), name="jax lse", floor=FLOOR[dtype])
    assert_close(jdx, ref_dx, naive_dx, name="jax dlogits", floor=FLOOR[dtype])
    # Parity: the same kernels on the same inputs give the same bits in both frameworks (a mean's or a
    # sum's reduction included: both run the same reduction kernel).
    np.testing.assert_array_equal(np64(jdx), np64(xt.grad))
    np.testing.assert_array_equal(np64(jlse), np64(lse))
    np.testing.assert_array_equal(np64(jloss), np64(loss))


@pytest.mark.parametrize("vocab", [1000, 1024, 128])
def test_multi_tile_rows_and_vocabulary(vocab):
    """Small tiles: several vocabulary blocks with a ragged last one (1000), whole tiles only (1024: the
    forward's prefetch of the next tile stops at the last one), exactly one tile (128); several rows per
    program, a ragged last row block (the online-softmax merge and every mask are exercised)."""
    with configure(P.CEConfig(block_v=128, block_n=4)):
        _check_small_tiles(vocab)


def _check_small_tiles(vocab):
    rng = _rng(f"tiles{vocab}")
    x = rng.standard_normal((13, vocab)) * 4
    y = _labels(rng, (13,), vocab)
    g = rng.standard_normal(13)
    ref = R.cross_entropy(x, y, reduction="none", **ALL)
    ref_dx = R.cross_entropy_bwd(g, x, y, reduction="none", **ALL)
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    loss = ftc.cross_entropy(xt, torch.tensor(y), reduction="none", **ALL)
    loss.backward(torch.tensor(g, dtype=torch.float32))
    xn = xt.detach().clone().requires_grad_()
    naive = _naive_rows(xn, torch.tensor(y), -100, **ALL)
    (naive_dx,) = torch.autograd.grad(naive, xn, torch.tensor(g, dtype=torch.float32))
    assert_close(loss, ref, naive, name="loss")
    assert_close(xt.grad, ref_dx, naive_dx, name="dlogits")
    jl = fjc.cross_entropy(jnp.asarray(x, jnp.float32), jnp.asarray(y), reduction="none", **ALL)
    np.testing.assert_array_equal(np64(jl), np64(loss))


# ----------------------------------------------------------------------------------------- linear op

LIN_CASES = [  # lead, H, V, dtype, chunk, bias, options, reduction
    ((1,), 16, 1000, "float32", None, False, {}, "mean"),
    ((7,), 32, 1000, "float32", 3, True, ALL, "sum"),
    ((130,), 32, 1000, "float32", 65, False, dict(label_smoothing=0.1), "mean"),
    ((130,), 32, 1000, "float32", 48, True, ALL, "none"),
    ((2, 65), 32, 1000, "bfloat16", 64, True, dict(z_loss=1e-3), "mean"),
    # a vocabulary of 32 times the others' (the V=1000 cases cross vocabulary tiles and end ragged too)
    pytest.param(((7,), 16, 32003, "float32", 4, False, dict(logit_softcap=5.0), "mean"), marks=pytest.mark.slow),
    ((7,), 16, 1000, "float16", 2, True, ALL, "none"),
    # default chunks with N >= H: the JAX op's pass 1 places chunks of H tokens in dW's storage (4 such
    # chunks + 2 tokens; exactly 4; 2 x 65 tokens, reduction "none" recomputing in the backward)
    ((130,), 32, 1000, "float32", None, True, ALL, "mean"),
    ((64,), 16, 1000, "float32", None, False, {}, "sum"),
    ((2, 65), 32, 1000, "bfloat16", None, True, dict(z_loss=1e-3), "none"),
]


def _lin_id(c):
    return (f"{'x'.join(map(str, c[0]))}xH{c[1]}xV{c[2]}-{c[3]}-c{c[4]}-b{int(c[5])}-"
            f"{'-'.join(c[6]) or 'plain'}-{c[7]}")


def _lin_inputs(rng, lead, hidden, vocab, dtype, bias):
    h = rounded(rng.standard_normal((*lead, hidden)), dtype)
    w = rounded(rng.standard_normal((vocab, hidden)) / np.sqrt(hidden) * 2, dtype)
    b = rounded(rng.standard_normal(vocab) * 0.5, dtype) if bias else None
    return h, w, b


def _naive_linear(h, w, y, b, dtype, reduction, g, opts):
    ht, wt, bt = _t(h, dtype, True), _t(w, dtype, True), _t(b, dtype, True)
    x = ht.reshape(-1, ht.shape[-1]) @ wt.T
    x = x if bt is None else x + bt
    yt = torch.tensor(y).reshape(-1)
    loss = _naive_reduce(_naive_rows(x, yt, -100, **opts), yt, reduction)
    loss = loss.reshape(y.shape) if reduction == "none" else loss
    grads = torch.autograd.grad(loss, [t for t in (ht, wt, bt) if t is not None], torch.tensor(g, dtype=loss.dtype))
    return loss, grads[0], grads[1], grads[2] if bt is not None else None


@pytest.mark.parametrize("case", LIN_CASES, ids=_lin_id)
@pytest.mark.thin(4)
def test_linear_cross_entropy_both_frameworks(case):
    lead, hidden, vocab, dtype, chunk, bias, opts, reduction = case
    rng = _rng("lin", _lin_id(case))
    h, w, b = _lin_inputs(rng, lead, hidden, vocab, dtype, bias)
    y = _labels(rng, lead, vocab)
    g = _upstream(rng, reduction, lead)
    kw = dict(reduction=reduction, **opts)
    ref, ref_lse = R.linear_cross_entropy(h, w, y, bias=b, return_lse=True, **kw)
    ref_grads = R.linear_cross_entropy_bwd(g, h, w, y, bias=b, **kw)
    naive = _naive_linear(h, w, y, b, dtype, reduction, g, opts)
    names = ("loss", "dhidden", "dweight", "dbias")

    ht, wt, bt = _t(h, dtype, True), _t(w, dtype, True), _t(b, dtype, True)
    loss, lse = ftc.linear_cross_entropy(ht, wt, torch.tensor(y), bias=bt, chunk_size=chunk, return_lse=True,
                                         **kw)
    loss.backward(torch.tensor(g, dtype=torch.float32))
    outs_t = (loss, ht.grad, wt.grad, None if bt is None else bt.grad)
    assert all(o is None or o.dtype == (torch.float32 if i == 0 else TORCH_DTYPES[dtype])
               for i, o in enumerate(outs_t))
    for name, out, r, nv in zip(names, outs_t, (ref, *ref_grads), naive):
        if r is not None:
            assert_close(out, r, nv, name=f"torch {name}", floor=(FLOOR if name == "loss" else GEMM_FLOOR)[dtype])
    assert_close(lse, ref_lse, rounded(ref_lse, dtype), name="torch lse", floor=FLOOR[dtype])

    args = [jnp.asarray(h, dtype), jnp.asarray(w, dtype)] + ([jnp.asarray(b, dtype)] if bias else [])

    def f(hj, wj, bj=None):
        return fjc.linear_cross_entropy(hj, wj, jnp.asarray(y), bias=bj, chunk_size=chunk, **kw)

    jloss, vjp = jax.vjp(f, *args)
    jgrads = vjp(jnp.asarray(g, jnp.float32))
    outs_j = (jloss, *jgrads) + ((None,) if not bias else ())
    for name, out, r, nv in zip(names, outs_j, (ref, *ref_grads), naive):
        if r is not None:
            assert_close(out, r, nv, name=f"jax {name}", floor=(FLOOR if name == "loss" else GEMM_FLOOR)[dtype])
    # Parity: the kernels are shared, the matmuls are each framework's own (torch's vs XLA's CPU GEMM),
    # so the two agree to rounding, not to the bit.
    tol = 1e-5 if dtype == "float32" else 2e-2
    for name, a, bb in zip(names, outs_t, outs_j):
        if a is not None:
            np.testing.assert_allclose(np64(bb), np64(a), rtol=tol, atol=tol * max(1.0, np.abs(np64(a)).max()),
                                       err_msg=f"parity {name}")


def test_linear_grads_only_where_required_and_weight_only():
    rng = _rng("frozen")
    h, w, _ = _lin_inputs(rng, (9,), 16, 1000, "float32", False)
    y = _labels(rng, (9,), 1000)
    ref_dh, ref_dw, _ = R.linear_cross_entropy_bwd(1.0, h, w, y)
    ht = torch.tensor(h, dtype=torch.float32)
    wt = torch.tensor(w, dtype=torch.float32, requires_grad=True)
    ftc.linear_cross_entropy(ht, wt, torch.tensor(y), chunk_size=4).backward()
    assert ht.grad is None
    assert_close(wt.grad, ref_dw, rounded(ref_dw, "float32"), name="dweight")
    with torch.no_grad():
        loss = ftc.linear_cross_entropy(ht, wt, torch.tensor(y))
    assert not loss.requires_grad
    assert_close(loss, R.linear_cross_entropy(h, w, y), rounded(R.linear_cross_entropy(h, w, y), "float32"),
                 name="no-grad loss")
    del ref_dh


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_tokens_ignored_gives_zero_loss_and_zero_grads(reduction):
    rng = _rng("ignored", reduction)
    h, w, b = _lin_inputs(rng, (7,), 16, 1000, "float32", True)
    y = np.full((7,), -100)
    ht, wt, bt = _t(h, "float32", True), _t(w, "float32", True), _t(b, "float32", True)
    loss = ftc.linear_cross_entropy(ht, wt, torch.tensor(y), bias=bt, reduction=reduction, chunk_size=3)
    loss.sum().backward()
    for t in (loss, ht.grad, wt.grad, bt.grad):
        assert torch.isfinite(t).all() and not t.any()
    jl, jg = jax.value_and_grad(lambda a, bb, c: fjc.linear_cross_entropy(
        a, bb, jnp.asarray(y), bias=c, reduction=reduction, chunk_size=3).sum(), argnums=(0, 1, 2))(
        jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(b, jnp.float32))
    for a in (jl, *jg):
        assert np.all(np.isfinite(a)) and not np.any(a)
    x = torch.tensor(h @ w.T, dtype=torch.float32, requires_grad=True)
    ftc.cross_entropy(x, torch.tensor(y), reduction=reduction).sum().backward()
    assert torch.isfinite(x.grad).all() and not x.grad.any()


def test_auto_chunk_and_ragged_chunks_agree():
    rng = _rng("chunks")
    h, w, b = _lin_inputs(rng, (130,), 16, 1000, "float32", True)
    y = _labels(rng, (130,), 1000)
    results = []
    for chunk in (None, 130, 64, 1, 129):
        ht, wt, bt = _t(h, "float32", True), _t(w, "float32", True), _t(b, "float32", True)
        loss = ftc.linear_cross_entropy(ht, wt, torch.tensor(y), bias=bt, chunk_size=chunk,
                                        label_smoothing=0.05)
        loss.backward()
        results.append([np64(t) for t in (loss, ht.grad, wt.grad, bt.grad)])
    ref = R.linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.05)
    for res in results:
        assert abs(res[0] - ref) < 1e-5 * max(1, abs(ref))
        for a, bb in zip(res[1:], results[0][1:]):
            np.testing.assert_allclose(a, bb, rtol=1e-5, atol=1e-6)


def test_linear_chunks_are_planned_once_for_both_frameworks():
    """plan_linear_cross_entropy's pass-1 chunks (the same plan both front-ends execute): chunk_size None
    takes chunks of H tokens in dW's storage when dW is computed, the rest (and every token without dW) in
    chunks of logits at most a sixteenth of the weight's size, at least 64 tokens; a given size its chunks."""
    from flashbridge.core_kernels import Target

    h200 = Target(interpret=False, num_sms=132)

    def chunks(n, chunk_size=None, forward=True, want_dw=True, **kw):
        plan = P.plan_linear_cross_entropy(
            n, 4096, 128256, dtype="bfloat16", forward=forward, want_dh=True, want_dw=want_dw, want_db=False,
            chunk_size=chunk_size, per_row_weight=True, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
            logit_softcap=0.0, target=h200, **{"logits_into_dw_rows": True, **kw})
        return [(r.start, r.rows, r.count, r.in_dw) for r in plan.chunks]

    assert chunks(8192) == [(0, 4096, 2, True)]  # the benchmark shape: no logits of their own
    assert chunks(8192 + 300) == [(0, 4096, 2, True), (8192, 256, 1, False), (8448, 44, 1, False)]
    assert chunks(8192, want_dw=False) == [(0, 256, 32, False)]
    assert chunks(100, want_dw=False) == [(0, 100, 1, False)]
    assert chunks(8192, chunk_size=3000) == [(0, 3000, 2, False), (6000, 2192, 1, False)]
    assert chunks(8192, forward=False, logits_into_dw_rows=False) == [(0, 4096, 2, True)]
    for n in (1, 100, 4096, 10000):
        plan = P.plan_linear_cross_entropy(n, 4096, 1000, dtype="float32", forward=True, want_dh=True,
                                           want_dw=True, want_db=True, chunk_size=None, logits_into_dw_rows=False,
                                           per_row_weight=True, ignore_index=-100, label_smoothing=0.0,
                                           z_loss=0.0, logit_softcap=0.0, target=h200)
        bounds = list(plan.chunk_bounds())
        assert bounds[0][0] == 0 and bounds[-1][1] == n and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert [(s.c0, s.c1) for s in plan.slices] == [(0, 1000)] and plan.slices[0].where == "own"


def test_backward_is_deterministic():
    rng = _rng("det")
    h, w, b = _lin_inputs(rng, (37,), 16, 1000, "float32", True)
    y = _labels(rng, (37,), 1000)
    runs = []
    for _ in range(2):
        ht, wt, bt = _t(h, "float32", True), _t(w, "float32", True), _t(b, "float32", True)
        ftc.linear_cross_entropy(ht, wt, torch.tensor(y), bias=bt, chunk_size=8, **ALL).backward()
        runs.append([ht.grad.clone(), wt.grad.clone(), bt.grad.clone()])
    for a, bb in zip(*runs):
        assert torch.equal(a, bb)


# --------------------------------------------------------------------------- transforms and compilers

def test_jax_jit_grad_vmap():
    rng = _rng("jax")
    h, w, b = _lin_inputs(rng, (3, 11), 16, 1000, "float32", True)
    y = _labels(rng, (3, 11), 1000)
    hj, wj, bj, yj = (*(jnp.asarray(a, jnp.float32) for a in (h, w, b)), jnp.asarray(y))

    def loss_fn(hh, ww, bb, yy):
        return fjc.linear_cross_entropy(hh, ww, yy, bias=bb, chunk_size=4, **ALL)

    val, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(hj, wj, bj, yj)
    ref = R.linear_cross_entropy(h, w, y, bias=b, **ALL)
    ref_grads = R.linear_cross_entropy_bwd(1.0, h, w, y, bias=b, **ALL)
    assert_close(val, ref, rounded(ref, "float32"), name="jit loss")
    for name, a, r in zip(("dh", "dw", "db"), grads, ref_grads):
        assert_close(a, r, rounded(r, "float32"), name=f"jit {name}", floor=1e-5)

    # vmap over sequences with a shared weight: per-example losses and gradients.
    per_ex = jax.vmap(jax.value_and_grad(loss_fn, argnums=(0, 1)), in_axes=(0, None, None, 0))(hj, wj, bj, yj)
    for i in range(3):
        ri = R.linear_cross_entropy(h[i], w, y[i], bias=b, **ALL)
        rdh, rdw, _ = R.linear_cross_entropy_bwd(1.0, h[i], w, y[i], bias=b, **ALL)
        assert_close(per_ex[0][i], ri, rounded(ri, "float32"), name="vmap loss")
        assert_close(per_ex[1][0][i], rdh, rounded(rdh, "float32"), name="vmap dh")
        assert_close(per_ex[1][1][i], rdw, rounded(rdw, "float32"), name="vmap dw")

    # vmap (nested) of the logits-level op with grad, jitted.
    x = rng.standard_normal((2, 3, 5, 100)) * 2
    yx = _labels(rng, (2, 3, 5), 100)
    ce = lambda xx, yy: fjc.cross_entropy(xx, yy, label_smoothing=0.1)  # noqa: E731
    vals, dx = jax.jit(jax.vmap(jax.vmap(jax.value_and_grad(ce))))(jnp.asarray(x, jnp.float32), jnp.asarray(yx))
    for i in range(2):
        for j in range(3):
            r = R.cross_entropy(x[i, j], yx[i, j], label_smoothing=0.1)
            rdx = R.cross_entropy_bwd(1.0, x[i, j], yx[i, j], label_smoothing=0.1)
            assert_close(vals[i, j], r, rounded(r, "float32"), name="vmap ce")
            assert_close(dx[i, j], rdx, rounded(rdx, "float32"), name="vmap dlogits")


def test_torch_compile_fullgraph():
    rng = _rng("compile")
    h, w, b = _lin_inputs(rng, (2, 9), 16, 1000, "float32", True)
    y = _labels(rng, (2, 9), 1000)

    def step(hh, ww, bb, yy):
        lin = ftc.linear_cross_entropy(hh, ww, yy, bias=bb, chunk_size=5, z_loss=1e-3)
        ce = ftc.cross_entropy(hh @ ww.T, yy, reduction="sum", logit_softcap=3.0)
        return lin + 0.01 * ce

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    ht, wt, bt = _t(h, "float32", True), _t(w, "float32", True), _t(b, "float32", True)
    compiled(ht, wt, bt, torch.tensor(y)).backward()
    eh, ew, eb = _t(h, "float32", True), _t(w, "float32", True), _t(b, "float32", True)
    step(eh, ew, eb, torch.tensor(y)).backward()
    for a, e in ((ht.grad, eh.grad), (wt.grad, ew.grad), (bt.grad, eb.grad)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)
    ref_dh = R.linear_cross_entropy_bwd(1.0, h, w, y, bias=b, z_loss=1e-3)[0]
    assert np.abs(np64(ht.grad) - ref_dh - 0.01 * (R.cross_entropy_bwd(
        1.0, h.reshape(-1, 16) @ w.T, y.reshape(-1), reduction="sum", logit_softcap=3.0) @ w).reshape(
        h.shape)).max() < 1e-5


def test_opcheck_custom_ops():
    rng = _rng("opcheck")
    x = torch.tensor(rng.standard_normal((5, 300)), dtype=torch.float32, requires_grad=True)
    y = torch.tensor(_labels(rng, (5,), 300))
    opts = (-100, 0.1, 1e-3, 4.0)
    torch.library.opcheck(torch.ops.flashbridge.cross_entropy_fwd.default, (x, y, *opts))
    _, lse, lse_lo = torch.ops.flashbridge.cross_entropy_fwd(x.detach(), y, *opts)
    torch.library.opcheck(torch.ops.flashbridge.cross_entropy_bwd.default,
                          (x.detach(), y, lse, lse_lo, torch.rand(5), *opts))
    h = torch.tensor(rng.standard_normal((5, 8)), dtype=torch.float32, requires_grad=True)
    w = torch.tensor(rng.standard_normal((300, 8)), dtype=torch.float32, requires_grad=True)
    b = torch.tensor(rng.standard_normal(300), dtype=torch.float32, requires_grad=True)
    for reduction in ("mean", "none"):
        torch.library.opcheck(torch.ops.flashbridge.linear_cross_entropy_fwd.default,
                              (h, w, y, b, *opts, reduction, 2, True, True, True))
    _, lse, lse_lo, *_ = torch.ops.flashbridge.linear_cross_entropy_fwd(h.detach(), w.detach(), y, b.detach(), *opts,
                                                                "none", 2, False, False, False)
    torch.library.opcheck(torch.ops.flashbridge.linear_cross_entropy_bwd.default,
                          (h.detach(), w.detach(), y, b.detach(), lse, lse_lo, torch.rand(5), *opts, 2, True, True,
                           True))


# -------------------------------------------------------------------------------------- modules, flax

def test_torch_module():
    rng = _rng("module")
    head = torch.nn.Linear(16, 1000, bias=True)
    h = rng.standard_normal((2, 5, 16))
    y = _labels(rng, (2, 5), 1000)
    loss_fn = ftc.LinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum")
    ht = torch.tensor(h, dtype=torch.float32, requires_grad=True)
    loss = loss_fn(ht, head.weight, torch.tensor(y), head.bias)
    loss.backward()
    w, b = np64(head.weight), np64(head.bias)
    ref = R.linear_cross_entropy(h, w, y, bias=b, label_smoothing=0.1, reduction="sum")
    rdh, rdw, rdb = R.linear_cross_entropy_bwd(1.0, h, w, y, bias=b, label_smoothing=0.1, reduction="sum")
    assert_close(loss, ref, rounded(ref, "float32"), name="module loss")
    for name, a, r in (("dh", ht.grad, rdh), ("dw", head.weight.grad, rdw), ("db", head.bias.grad, rdb)):
        assert_close(a, r, rounded(r, "float32"), name=name, floor=1e-5)
    assert "label_smoothing=0.1" in repr(loss_fn)


@pytest.mark.parametrize("n,vocab,hidden,transposed,bias", [(7, 1000, 40, False, True), (70, 300, 64, True, False),
                                                          (33, 129, 16, False, False)])
def test_linear_logits_kernel(n, vocab, hidden, transposed, bias):
    """plan_linear_logits: ``hidden @ W^T + b`` row-major at the start of a larger buffer (odd sizes, a hidden
    size that is not a multiple of the K tile, a (H, V) weight), against float64; the rest of the buffer is
    left alone when the output takes over the buffer."""
    from flashbridge.core_kernels.cross_entropy.plan import plan_linear_logits
    from flashbridge.jax_api._runtime import execute

    rng = _rng("logits", n, vocab, hidden)
    hh = rng.standard_normal((n, hidden)).astype(np.float32)
    w = rng.standard_normal((hidden, vocab) if transposed else (vocab, hidden)).astype(np.float32)
    b = rng.standard_normal(vocab).astype(np.float32)
    shape = (vocab, max(hidden, n) + 3)
    inputs = {"hidden": jnp.asarray(hh), "weight": jnp.asarray(w), "buffer": jnp.full(shape, 7.0, jnp.float32)}
    if bias:
        inputs["bias"] = jnp.asarray(b)
    (out,) = execute(lambda t: plan_linear_logits(n, vocab, hidden, dtype="float32", weight_transposed=transposed,
                                                  has_bias=bias, out_shape=shape, target=t),
                     inputs, aliases={"out": "buffer"})
    ref = np64(hh) @ (np64(w) if transposed else np64(w).T) + (np64(b) if bias else 0.0)
    flat = np.asarray(out).reshape(-1)
    assert_close(flat[:n * vocab].reshape(n, vocab), ref, rounded(ref, "float32"), name="logits")
    assert (flat[n * vocab:] == 7.0).all()


def test_jax_pass1_in_dw_storage_under_transforms():
    """The JAX op's default pass 1 (chunks of H tokens whose logits our kernel writes into dW's storage):
    under jit + grad, under vmap (the custom_vmap rule: XLA's matmul per example), and with a (H, V) Flax
    kernel (weight_transposed), against the float64 reference."""
    from flax import nnx

    rng = _rng("in_dw")
    h, w, b = _lin_inputs(rng, (2, 40), 16, 1000, "float32", True)
    y = _labels(rng, (2, 40), 1000)
    hj, wj, bj, yj = (*(jnp.asarray(a, jnp.float32) for a in (h, w, b)), jnp.asarray(y))

    def loss_fn(hh, ww, bb, yy):
        return fjc.linear_cross_entropy(hh, ww, yy, bias=bb, **ALL)

    val, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1, 2)))(hj, wj, bj, yj)  # 80 tokens: 5 x H
    ref = R.linear_cross_entropy(h, w, y, bias=b, **ALL)
    assert_close(val, ref, rounded(ref, "float32"), name="in-dW jit loss")
    for name, a, r in zip(("dh", "dw", "db"), grads, R.linear_cross_entropy_bwd(1.0, h, w, y, bias=b, **ALL)):
        assert_close(a, r, rounded(r, "float32"), name=f"in-dW jit {name}", floor=1e-5)

    per_ex = jax.vmap(jax.value_and_grad(loss_fn, argnums=(0, 1)), in_axes=(0, None, None, 0))(hj, wj, bj, yj)
    for i in range(2):  # 40 tokens each: 2 x H + 8
        ri = R.linear_cross_entropy(h[i], w, y[i], bias=b, **ALL)
        rdh, rdw, _ = R.linear_cross_entropy_bwd(1.0, h[i], w, y[i], bias=b, **ALL)
        assert_close(per_ex[0][i], ri, rounded(ri, "float32"), name="in-dW vmap loss")
        assert_close(per_ex[1][0][i], rdh, rounded(rdh, "float32"), name="in-dW vmap dh")
        assert_close(per_ex[1][1][i], rdw, rounded(rdw, "float32"), name="in-dW vmap dw")

    head = nnx.Linear(16, 1000, rngs=nnx.Rngs(0))
    h2 = h.reshape(80, 16)
    loss, g = nnx.value_and_grad(lambda layer: fjc.linear_cross_entropy_from_layer(
        layer, jnp.asarray(h2), jnp.asarray(y.reshape(80))))(head)
    k, kb = np64(head.kernel[...]), np64(head.bias[...])
    ref = R.linear_cross_entropy(h2, k.T, y.reshape(80), bias=kb)
    _, rdw, rdb = R.linear_cross_entropy_bwd(1.0, h2, k.T, y.reshape(80), bias=kb)
    assert_close(loss, ref, rounded(ref, "float32"), name="in-dW nnx.Linear loss")
    assert_close(g.kernel[...], rdw.T, rounded(rdw.T, "float32"), name="in-dW nnx.Linear dkernel")
    assert_close(g.bias[...], rdb, rounded(rdb, "float32"), name="in-dW nnx.Linear dbias")


def test_flax_linear_head_and_tied_embedding():
    from flax import nnx

    rng = _rng("flax")
    h = rng.standard_normal((7, 16)).astype(np.float32)
    y = _labels(rng, (7,), 1000)
    head = nnx.Linear(16, 1000, rngs=nnx.Rngs(0))
    head.bias[...] = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    emb = nnx.Embed(1000, 16, rngs=nnx.Rngs(1))

    def loss_fn(layer):
        return fjc.linear_cross_entropy_from_layer(layer, jnp.asarray(h), jnp.asarray(y), chunk_size=3,
                                                   z_loss=1e-3)

    loss, grads = nnx.value_and_grad(loss_fn)(head)
    k, b = np64(head.kernel[...]), np64(head.bias[...])
    ref = R.linear_cross_entropy(h, k.T, y, bias=b, z_loss=1e-3)
    _, rdw, rdb = R.linear_cross_entropy_bwd(1.0, h, k.T, y, bias=b, z_loss=1e-3)
    assert_close(loss, ref, rounded(ref, "float32"), name="nnx.Linear loss")
    assert_close(grads.kernel[...], rdw.T, rounded(rdw.T, "float32"), name="nnx.Linear dkernel")
    assert_close(grads.bias[...], rdb, rounded(rdb, "float32"), name="nnx.Linear dbias")

    loss, grads = nnx.value_and_grad(loss_fn)(emb)
    e = np64(emb.embedding[...])
    ref = R.linear_cross_entropy(h, e, y, z_loss=1e-3)
    _, rdw, _ = R.linear_cross_entropy_bwd(1.0, h, e, y, z_loss=1e-3)
    assert_close(loss, ref, rounded(ref, "float32"), name="nnx.Embed loss")
    assert_close(grads.embedding[...], rdw, rounded(rdw, "float32"), name="nnx.Embed dembedding")
    with pytest.raises(TypeError, match="layer"):
        fjc.linear_cross_entropy_from_layer(nnx.Conv(2, 2, (1,), rngs=nnx.Rngs(0)), jnp.asarray(h), jnp.asarray(y))


# ------------------------------------------------------------------------------------------ reference

def test_reference_backward_matches_finite_differences():
    rng = _rng("fd")
    h = rng.standard_normal((4, 3))
    w = rng.standard_normal((7, 3))
    b = rng.standard_normal(7)
    y = np.array([1, -100, 6, 0])
    g = rng.standard_normal(4)
    kw = dict(reduction="none", **ALL)
    grads = R.linear_cross_entropy_bwd(g, h, w, y, bias=b, **kw)
    for idx, arr in enumerate((h, w, b)):
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            args = [h.copy(), w.copy(), b.copy()]
            args[idx][i] += 1e-6
            up = np.dot(g, R.linear_cross_entropy(*args[:2], y, bias=args[2], **kw))
            args[idx][i] -= 2e-6
            down = np.dot(g, R.linear_cross_entropy(*args[:2], y, bias=args[2], **kw))
            num[i] = (up - down) / 2e-6
        np.testing.assert_allclose(grads[idx], num, rtol=1e-6, atol=1e-8)
    # Mean over non-ignored rows matches torch's definition.
    x = h @ w.T
    t = F.cross_entropy(torch.tensor(x), torch.tensor(y), label_smoothing=0.1)
    assert abs(R.cross_entropy(x, y, label_smoothing=0.1) - t.item()) < 1e-12


# ------------------------------------------------------------------------------------------ bad input

def _bad_cases():
    h, w, y = np.ones((4, 8)), np.ones((50, 8)), np.array([0, 1, 2, 3])
    f32 = "float32"
    lin = [  # (kwargs overrides, exception, message fragment)
        (dict(labels=np.array([0, 1, 50, 3])), ValueError, "outside \\[0, 50\\)"),
        (dict(labels=np.array([0, -1, 2, 3])), ValueError, "labels: 1 label"),
        (dict(labels=np.array([0, 1, 2])), ValueError, "labels: expected shape"),
        (dict(labels=np.array([0.0, 1, 2, 3])), TypeError, "labels: dtype"),
        (dict(weight=np.ones((50, 9))), ValueError, "weight: hidden size 9"),
        (dict(weight=np.ones((50, 8, 1))), ValueError, "weight: expected a 2-D"),
        (dict(weight_dtype="float16"), TypeError, "weight: dtype float16"),
        (dict(dtype="int32"), TypeError, "hidden: dtype int32"),
        (dict(bias=np.ones(49)), ValueError, "bias: expected shape"),
        (dict(hidden=np.ones((0, 8)), labels=np.zeros((0,), np.int64)), ValueError, "at least"),
        (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(z_loss=-1.0), ValueError, "z_loss"),
        (dict(logit_softcap=float("nan")), ValueError, "logit_softcap"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(ignore_index=1.5), TypeError, "ignore_index"),
    ]
    return [(h, w, y, f32, *c) for c in lin]


BAD = _bad_cases()


@pytest.mark.parametrize("i", range(len(BAD)), ids=[c[6] for c in BAD])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_bad_input_is_rejected_with_a_clear_error(framework, i):
    h, w, y, dtype, over, exc, match = BAD[i]
    over = dict(over)
    h, w, y = over.pop("hidden", h), over.pop("weight", w), over.pop("labels", y)
    dtype = over.pop("dtype", dtype)
    w_dtype = over.pop("weight_dtype", dtype)
    b = over.pop("bias", None)
    if framework == "torch":
        td = {"float32": torch.float32, "float16": torch.float16, "int32": torch.int32}
        args = (torch.tensor(h, dtype=td[dtype]), torch.tensor(w, dtype=td[w_dtype]), torch.tensor(y))
        bb = None if b is None else torch.tensor(b, dtype=td[dtype])
        fn, ce = ftc.linear_cross_entropy, ftc.cross_entropy
    else:
        args = (jnp.asarray(h, dtype), jnp.asarray(w, w_dtype), jnp.asarray(y))
        bb = None if b is None else jnp.asarray(b, dtype)
        fn, ce = fjc.linear_cross_entropy, fjc.cross_entropy
    with pytest.raises(exc, match=match):
        fn(*args, bias=bb, **over)
    if "weight" not in match and "bias" not in match and "chunk" not in match and "hidden" not in match:
        # The logits-level op applies the same rules to (logits, labels).
        logits = args[0] @ args[1].T if args[0].shape[-1] == args[1].shape[-1] else None
        if logits is not None:
            with pytest.raises(exc, match=match.replace("hidden", "logits")):
                ce(logits, args[2], **over)


def test_invalid_labels_under_tracing_give_nan_not_garbage():
    """Labels that cannot be inspected (traced by jit, or a direct custom-op call) reach the kernels:
    the documented result is a NaN loss and NaN gradients for that row, never an out-of-bounds read."""
    rng = _rng("nan")
    x = rng.standard_normal((4, 50)).astype(np.float32)
    y = np.array([0, 77, -100, 3])
    loss = jax.jit(lambda a, b: fjc.cross_entropy(a, b, reduction="none"))(jnp.asarray(x), jnp.asarray(y))
    assert np.isnan(loss[1]) and np.all(np.isfinite(np.asarray(loss)[[0, 2, 3]]))
    rows, _, _ = torch.ops.flashbridge.cross_entropy_fwd(torch.tensor(x), torch.tensor(y), -100, 0.0, 0.0, 0.0)
    assert torch.isnan(rows[1]) and torch.isfinite(rows[[0, 2, 3]]).all()
    g = jax.jit(jax.grad(lambda a, b: fjc.cross_entropy(a, b)))(jnp.asarray(x), jnp.asarray(y))
    assert np.all(np.isnan(g[1])) and np.all(np.isfinite(np.asarray(g)[[0, 2, 3]]))


def test_masked_and_non_finite_logits():
    """Rows masked with -inf columns, a row of float32's lowest value everywhere (a fully masked row: loss
    log V, as the float64 reference), a NaN logit (NaN loss for that row only); both frameworks, with and
    without tiles that split the row."""
    rng = _rng("masked")
    vocab = 1000
    x = rng.standard_normal((4, vocab)).astype(np.float32)
    x[1, 500:] = -np.inf
    x[2, :] = np.finfo(np.float32).min
    x[3, 17] = np.nan
    y = np.array([3, 499, 998, 5])
    want = R.cross_entropy(x[:3].astype(np.float64), y[:3], reduction="none")
    assert np.isclose(want[2], np.log(vocab))
    for config in (P.CEConfig(), P.CEConfig(block_v=64, block_n=2)):
        with configure(config):
            rows_t = ftc.cross_entropy(torch.tensor(x), torch.tensor(y), reduction="none").numpy()
            rows_j = np.asarray(fjc.cross_entropy(jnp.asarray(x), jnp.asarray(y), reduction="none"))
        for rows in (rows_t, rows_j):
            np.testing.assert_allclose(rows[:3], want, rtol=1e-5)
            assert np.isnan(rows[3])


def test_validate_labels_false_skips_the_check():
    """validate_labels=False (no host sync, CUDA-graph capturable): a bad label is not refused, its row gets a
    NaN loss and NaN gradients, the other rows are unchanged; both frameworks, logits and linear ops."""
    rng = _rng("novalidate")
    x = rng.standard_normal((4, 50)).astype(np.float32)
    y = np.array([0, 77, -100, 3])
    good = np.array([0, 1, -100, 3])
    xt = torch.tensor(x, requires_grad=True)
    rows = ftc.cross_entropy(xt, torch.tensor(y), reduction="none", validate_labels=False)
    rows.sum().backward()
    want = ftc.cross_entropy(torch.tensor(x), torch.tensor(good), reduction="none")
    assert torch.isnan(rows[1]) and torch.equal(rows[[0, 2, 3]], want[[0, 2, 3]])
    assert torch.isnan(xt.grad[1]).all() and torch.isfinite(xt.grad[[0, 2, 3]]).all()
    jrows = fjc.cross_entropy(jnp.asarray(x), jnp.asarray(y), reduction="none", validate_labels=False)
    np.testing.assert_array_equal(np.asarray(jrows), rows.detach().numpy())
    h, w = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((50, 8)).astype(np.float32)
    lin = ftc.linear_cross_entropy(torch.tensor(h), torch.tensor(w), torch.tensor(y), reduction="none",
                                   validate_labels=False)
    jlin = fjc.linear_cross_entropy(jnp.asarray(h), jnp.asarray(w), jnp.asarray(y), reduction="none",
                                    validate_labels=False)
    assert torch.isnan(lin[1]) and np.isnan(np.asarray(jlin)[1])
    loss_fn = ftc.LinearCrossEntropyLoss(reduction="none", validate_labels=False)
    assert torch.isnan(loss_fn(torch.tensor(h), torch.tensor(w), torch.tensor(y))[1])
    # the default (None) checks CPU labels, as True does everywhere
    for validate in (None, True):
        with pytest.raises(ValueError, match="labels: 1 label"):
            ftc.cross_entropy(torch.tensor(x), torch.tensor(y), validate_labels=validate)
        with pytest.raises(ValueError, match="labels: 1 label"):
            fjc.cross_entropy(jnp.asarray(x), jnp.asarray(y), validate_labels=validate)
        with pytest.raises(ValueError, match="labels: 1 label"):
            fjc.cross_entropy(jnp.asarray(x), y, validate_labels=validate)


def test_lse_is_not_differentiable():
    x = torch.randn(3, 20, requires_grad=True)
    _, lse = ftc.cross_entropy(x, torch.tensor([1, 2, 3]), return_lse=True)
    assert not lse.requires_grad
    h = torch.randn(3, 8, requires_grad=True)
    _, lse = ftc.linear_cross_entropy(h, torch.randn(20, 8), torch.tensor([1, 2, 3]), return_lse=True)
    assert not lse.requires_grad
    g = jax.grad(lambda a: fjc.cross_entropy(a, jnp.array([1, 2, 3]), return_lse=True)[1].sum())(
        jnp.asarray(np.random.default_rng(0).standard_normal((3, 20)), jnp.float32))
    assert not np.any(g)


def test_jax_execute_aliases():
    """execute(aliases=...) (the linear op's chunk gradient taking over the logits' buffer on the GPU): the
    same results as without; an alias to a missing input or to one of another shape/dtype is refused."""
    import jax.numpy as jnp

    from flashbridge.jax_api._runtime import execute

    logits = jnp.asarray(np.random.default_rng(3).standard_normal((5, 37)), jnp.float32)
    inputs = {"logits": logits, "labels": jnp.asarray([0, 36, -100, 3, 3]), "weight": jnp.ones(1, jnp.float32)}

    def make(target):
        return P.plan_ce_fwd_grad(5, 37, grad_dtype="float32", per_row_weight=False, ignore_index=-100,
                                  label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, target=target)

    plain = execute(make, inputs)
    aliased = execute(make, inputs, aliases={"grad": "logits"})
    for a, b in zip(plain, aliased):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="aliases: 'nope'"):
        execute(make, inputs, aliases={"grad": "nope"})
    with pytest.raises(ValueError, match="aliases: output 'grad'"):
        execute(make, inputs, aliases={"grad": "labels"})


def test_ce_config_rejects_bad_values():
    for kwargs, name in ((dict(block_v=3000), "block_v"), (dict(block_n=0), "block_n"),
                         (dict(num_warps=6), "num_warps"), (dict(num_stages=0), "num_stages")):
        with pytest.raises(ValueError, match=f"CEConfig.{name}"):
            P.CEConfig(**kwargs)
    assert P.CEConfig(block_v=2048, block_n=2, num_warps=8, num_stages=3).num_stages == 3


def test_gpu_tiles_keep_every_sm_busy():
    """GPU plans (built on the CPU): 2 x 2048 tiles when there are rows for two programs per SM, else one
    4096-column row per program; given tiles are kept. 8192 x 128256 has the H200 sweep's entry (1 x 4096,
    4% faster than 2 x 2048: docs/tiles.md)."""
    from flashbridge.core_kernels import Target

    gpu = Target(interpret=False, num_sms=132)
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, target=gpu)

    def tile(n, v, config=None):
        (launch,) = P.plan_ce_fwd(n, v, **opts, config=config).launches
        c = launch.constexpr_dict()
        return c["BLOCK_N"], c["BLOCK_V"], launch.num_warps, launch.grid

    assert tile(8192, 128256) == (1, 4096, 8, (8192,))
    assert tile(8192, 50257) == (2, 2048, 8, (4096,))
    assert tile(256, 128256) == (1, 4096, 8, (256,))
    assert tile(256, 1000) == (1, 1024, 4, (256,))
    assert tile(256, 128256, P.CEConfig(block_n=2)) == (2, 2048, 8, (128,))


@pytest.mark.parametrize("n_rows,hidden,vocab,width", [(8192, 4096, 128256, 4096), (7, 8, 1000, 256),
                                                       (130, 32, 1000, 256), (5, 64, 300, 512)])
def test_vocab_slices_cover_the_vocabulary_without_overwriting_dw(n_rows, hidden, vocab, width):
    """Pass 2's slices where the runtime writes logits into dW's storage (torch): every column once, in
    order; a slice's logits never overlap a dW row written so far or by that slice, whether they live in
    dW's last rows or in the small buffer."""
    from flashbridge.core_kernels import INTERPRETER

    plan = P.plan_linear_cross_entropy(
        n_rows, hidden, vocab, dtype="bfloat16", forward=False, want_dh=False, want_dw=True, want_db=False,
        chunk_size=None, logits_into_dw_rows=True, per_row_weight=True, ignore_index=-100, label_smoothing=0.0,
        z_loss=0.0, logit_softcap=0.0, target=INTERPRETER, config=P.CEConfig(slice_cols=width))
    expect = in_dw = 0
    for s in plan.slices:
        assert s.c0 == expect and s.c0 < s.c1 <= vocab and s.c1 - s.c0 <= width
        if s.where == "dw_tail":
            start = plan.dw_tail_offset(s)
            assert start // hidden >= s.c1 and start + n_rows * (s.c1 - s.c0) <= vocab * hidden, (s, start)
            in_dw += 1
        else:
            assert s.where == "buffer" and plan.buffer_elements >= n_rows * (s.c1 - s.c0)
            assert plan.buffer_elements * 2 <= max(P.SMALL_SLICE_BYTES, n_rows * width * 2)
        expect = s.c1
    assert expect == vocab and not plan.chunks
    if vocab == 128256:  # the benchmark shape: 29 slices of 4096 in dW's last 8192 rows, the rest in 16 MiB
        assert in_dw == 29
