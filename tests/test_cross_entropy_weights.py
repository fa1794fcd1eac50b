"""Cross-entropy with class weights and the per-token extras (accuracy, predicted class) on the CPU (Triton
interpreter), both frameworks, against the float64 reference; the reference itself against torch's
``F.cross_entropy(weight=...)`` in float64 and finite differences."""
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

fjc = importlib.import_module("flashbridge.jax_api.cross_entropy")
ftc = importlib.import_module("flashbridge.torch_api.cross_entropy")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 1e-7, "float16": 1e-4, "bfloat16": 1e-4}
GEMM_FLOOR = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-3}
ALL = dict(label_smoothing=0.1, z_loss=1e-2, logit_softcap=4.0)
SMALL_TILES = P.CEConfig(block_v=128, block_n=4)  # several vocabulary tiles and row blocks per call
SEED = int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))


def _rng(*key):
    return np.random.default_rng([zlib.crc32(repr(key).encode()), SEED])


def _labels(rng, lead, vocab, ignore_frac=0.2):
    y = rng.integers(0, vocab, size=lead)
    return np.where(rng.random(lead) < ignore_frac, -100, y).astype(np.int64)


def _class_weights(rng, vocab):
    return rng.random(vocab) * 2 + 0.1


# ------------------------------------------------------------------------------------------ reference

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_reference_matches_torch_float64(reduction, label_smoothing):
    """torch's definition (weighted label smoothing, "mean" over the weights of the counted targets), float64."""
    rng = _rng("torch", reduction, label_smoothing)
    x = rng.standard_normal((11, 13)) * 2
    y = _labels(rng, (11,), 13)
    w = _class_weights(rng, 13)
    g = rng.standard_normal(11) if reduction == "none" else np.float64(1.3)
    xt = torch.tensor(x, requires_grad=True)
    loss = F.cross_entropy(xt, torch.tensor(y), weight=torch.tensor(w), label_smoothing=label_smoothing,
                           reduction=reduction)
    loss.backward(torch.tensor(g, dtype=torch.float64))
    kw = dict(weight=w, label_smoothing=label_smoothing, reduction=reduction)
    np.testing.assert_allclose(R.cross_entropy(x, y, **kw), loss.detach().numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(R.cross_entropy_bwd(g, x, y, **kw), xt.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_reference_weights_of_one_and_extras():
    """All-ones weights give the unweighted loss whatever the z-loss (its mean is over tokens either way);
    accuracy and predicted are np.argmax's (ties to the lowest index)."""
    rng = _rng("ones")
    x = np.round(rng.standard_normal((6, 9)))  # integer logits: ties
    y = _labels(rng, (6,), 9)
    kw = dict(label_smoothing=0.1, z_loss=0.01, logit_softcap=3.0)
    for reduction in ("mean", "sum", "none"):
        np.testing.assert_allclose(R.cross_entropy(x, y, weight=np.ones(9), reduction=reduction, **kw),
                                   R.cross_entropy(x, y, reduction=reduction, **kw), rtol=1e-14)
    loss, acc, pred = R.cross_entropy(x, y, return_accuracy=True, return_predicted=True)
    assert np.array_equal(pred, torch.argmax(torch.tensor(x), -1).numpy())
    assert np.array_equal(acc, (pred == y) & (y != -100)) and acc.dtype == bool
    del loss


def test_reference_backward_matches_finite_differences():
    """Class weights x smoothing x z-loss x softcap x ignored rows, every reduction, against central
    differences of the float64 forward (the mean's two denominators included)."""
    rng = _rng("fd")
    x = rng.standard_normal((5, 7)) * 2
    y = np.array([1, -100, 6, 0, 6])
    w = _class_weights(rng, 7)
    for reduction in ("mean", "sum", "none"):
        g = rng.standard_normal(5) if reduction == "none" else np.float64(0.7)
        kw = dict(weight=w, label_smoothing=0.15, z_loss=0.02, logit_softcap=3.0, reduction=reduction)
        grad = R.cross_entropy_bwd(g, x, y, **kw)
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[i] += 1e-6
            xm[i] -= 1e-6
            num[i] = np.sum(g * (R.cross_entropy(xp, y, **kw) - R.cross_entropy(xm, y, **kw))) / 2e-6
        np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-8, err_msg=reduction)


# ----------------------------------------------------------------------------------- logits-level op

def _naive(x, y, w, reduction, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0):
    """torch eager in the input dtype (weights in that dtype too): the yardstick of the error bound."""
    z = logit_softcap * torch.tanh(x / logit_softcap) if logit_softcap else x
    ce = F.cross_entropy(z, y, weight=w, ignore_index=ignore_index, reduction="none",
                         label_smoothing=label_smoothing)
    active = y != ignore_index
    zl = z_loss * torch.logsumexp(z, -1) ** 2 * active
    if reduction == "none":
        return ce + zl
    if reduction == "sum":
        return ce.sum() + zl.sum()
    w_y = torch.where(active, w[y.clamp(min=0)], 0)
    return ce.sum() / w_y.sum() + zl.sum() / active.sum().clamp(min=1)


CE_CASES = [  # lead, V, dtype, options, reduction, small tiles
    ((7,), 1000, "float32", {}, "mean", False),
    ((9,), 700, "float32", ALL, "mean", True),
    ((9,), 700, "float32", dict(label_smoothing=0.2), "sum", True),
    ((2, 3), 1000, "float32", dict(z_loss=1e-2), "none", False),
    ((5,), 333, "bfloat16", ALL, "none", False),
    ((4,), 3001, "float32", dict(label_smoothing=0.1, logit_softcap=3.0), "mean", False),
    ((4,), 1, "float32", dict(z_loss=1e-2, label_smoothing=0.1), "sum", False),
]


def _ce_id(c):
    return f"{'x'.join(map(str, c[0]))}xV{c[1]}-{c[2]}-{'-'.join(c[3]) or 'plain'}-{c[4]}{'-tiles' * c[5]}"


def _inputs(rng, lead, vocab, dtype):
    x = rounded(rng.standard_normal((*lead, vocab)) * 3, dtype)
    y = _labels(rng, lead, vocab)
    w = rounded(_class_weights(rng, vocab), dtype)  # exact in the input dtype: the naive one reads them so
    return x, y, w


@pytest.mark.parametrize("case", CE_CASES, ids=_ce_id)
def test_cross_entropy_weighted_both_frameworks(case):
    """Class weights x smoothing x z-loss x softcap x ignored rows x reduction, odd vocabularies, one and
    several vocabulary tiles: loss, lse and dlogits against float64 (within twice torch eager's error in
    the input dtype), accuracy / predicted against argmax, and torch and JAX bit for bit."""
    lead, vocab, dtype, opts, reduction, small = case
    rng = _rng("ce", _ce_id(case))
    x, y, w = _inputs(rng, lead, vocab, dtype)
    g = rng.standard_normal(lead) if reduction == "none" else np.float64(1.3)
    kw = dict(reduction=reduction, **opts)
    ref, ref_lse = R.cross_entropy(x, y, weight=w, return_lse=True, **kw)
    ref_dx = R.cross_entropy_bwd(g, x, y, weight=w, **kw)

    xn = torch.tensor(x, dtype=TORCH_DTYPES[dtype], requires_grad=True)
    naive = _naive(xn.reshape(-1, vocab), torch.tensor(y).reshape(-1), torch.tensor(w, dtype=xn.dtype), **kw)
    naive = naive.reshape(lead) if reduction == "none" else naive
    (naive_dx,) = torch.autograd.grad(naive, xn, torch.tensor(g, dtype=naive.dtype))

    with configure(SMALL_TILES if small else P.CEConfig()):
        xt = torch.tensor(x, dtype=TORCH_DTYPES[dtype], requires_grad=True)
        out = ftc.cross_entropy(xt, torch.tensor(y), weight=torch.tensor(w, dtype=torch.float32), return_lse=True,
                                return_accuracy=True, return_predicted=True, **kw)
        out.loss.backward(torch.tensor(g, dtype=torch.float32))

        def f(xj):
            o = fjc.cross_entropy(xj, jnp.asarray(y), weight=jnp.asarray(w, jnp.float32), return_lse=True,
                                  return_accuracy=True, return_predicted=True, **kw)
            return o.loss, o

        _, vjp, jout = jax.vjp(f, jnp.asarray(x, dtype), has_aux=True)
        (jdx,) = vjp(jnp.asarray(g, jnp.float32))
    assert isinstance(out, P.CrossEntropyOutput) and isinstance(jout, P.CrossEntropyOutput)
    assert out.loss.dtype == torch.float32 and xt.grad.dtype == xt.dtype and jdx.dtype == jnp.dtype(dtype)
    for name, t, j, r, nv in (("loss", out.loss, jout.loss, ref, naive), ("dlogits", xt.grad, jdx, ref_dx, naive_dx),
                              ("lse", out.lse, jout.lse, ref_lse, rounded(ref_lse, "float32"))):
        assert_close(t, r, nv, name=f"torch {name}", floor=FLOOR[dtype])
        assert_close(j, r, nv, name=f"jax {name}", floor=FLOOR[dtype])
    predicted = np.argmax(x, axis=-1)
    for o, label_dtype in ((out, torch.int64), (jout, jnp.asarray(y).dtype)):
        assert o.predicted.dtype == label_dtype and o.accuracy.dtype in (torch.bool, jnp.bool_)
        np.testing.assert_array_equal(np.asarray(o.predicted), predicted)
        np.testing.assert_array_equal(np.asarray(o.accuracy), (predicted == y) & (y != -100))
    # Parity: the same kernels on the same inputs, the weight sums, a mean's reciprocals and the reductions
    # from the same kernels: the same bits, scalar losses included.
    np.testing.assert_array_equal(np64(jdx), np64(xt.grad))
    np.testing.assert_array_equal(np64(jout.lse), np64(out.lse))
    np.testing.assert_array_equal(np64(jout.loss), np64(out.loss))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_all_ones_weights_match_the_unweighted_op(framework):
    """The weighted kernels with weights of one agree with the unweighted ones (to rounding: W = V is summed,
    the smoothing term weighted), z-loss included (its mean is over tokens either way)."""
    rng = _rng("ones", framework)
    x, y, _ = _inputs(rng, (13,), 1000, "float32")
    for reduction in ("mean", "none"):
        if framework == "torch":
            xs = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for _ in range(2)]
            losses = [ftc.cross_entropy(xs[0], torch.tensor(y), reduction=reduction, **ALL),
                      ftc.cross_entropy(xs[1], torch.tensor(y), weight=torch.ones(1000), reduction=reduction, **ALL)]
            for loss, xx in zip(losses, xs):
                loss.sum().backward()
            grads = [xx.grad for xx in xs]
        else:
            def f(a, wgt):
                return fjc.cross_entropy(a, jnp.asarray(y), weight=wgt, reduction=reduction, **ALL).sum()
            pairs = [jax.value_and_grad(f)(jnp.asarray(x, jnp.float32), wgt) for wgt in (None, jnp.ones(1000))]
            losses, grads = zip(*pairs)
        np.testing.assert_allclose(np64(losses[1]), np64(losses[0]), rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(np64(grads[1]), np64(grads[0]), rtol=1e-5, atol=1e-8)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's log(0) of the row of -inf
def test_predicted_ties_and_masked_rows():
    """Ties go to the lowest index, as torch.argmax: within a lane, across the lanes of a tile, across tiles
    and in the masked last tile; a row of -inf but one column, a row of -inf everywhere (index 0; its loss is
    NaN, as torch's), -3e38 everywhere; bf16 logits. Unweighted: the argmax alone."""
    rng = _rng("ties")
    vocab = 1000
    x = np.round(rng.standard_normal((8, vocab)) * 1.5)  # integers: many ties
    x[0, [5, 6, 700]] = 9.0  # one lane, then a later tile
    x[1, [130, 3, 999]] = 9.0  # lanes of different tiles, the lowest in the first
    x[2, [999, 998]] = 9.0  # the masked last tile
    x[3, :] = -np.inf
    x[3, 517] = 0.0
    x[4, :] = -np.inf
    x[5, :] = -3e38  # near float32's lowest (bfloat16 has it too)
    x[6, :] = 4.0  # all tied: 0
    y = np.array([5, 3, 998, 517, 1, 2, 0, -100])
    want = torch.argmax(torch.tensor(x, dtype=torch.float32), -1).numpy()
    assert want[4] == 0 and want[6] == 0 and want[2] == 998
    for config, dtype in ((P.CEConfig(), "bfloat16"), (SMALL_TILES, "float32"), (P.CEConfig(block_v=256), "float32")):
        with configure(config):
            out = ftc.cross_entropy(torch.tensor(x, dtype=TORCH_DTYPES[dtype]), torch.tensor(y), reduction="none",
                                    return_predicted=True, return_accuracy=True)
            jout = fjc.cross_entropy(jnp.asarray(x, dtype), jnp.asarray(y), reduction="none", return_predicted=True,
                                     return_accuracy=True)
        for o in (out, jout):
            np.testing.assert_array_equal(np.asarray(o.predicted), want, err_msg=f"{config} {dtype}")
            np.testing.assert_array_equal(np.asarray(o.accuracy), (want == y) & (y != -100))
            loss = np64(o.loss)
            assert o.lse is None and np.isnan(loss[4]) and np.isfinite(loss[[0, 1, 2, 3, 5, 6]]).all()
    only_predicted = ftc.cross_entropy(torch.tensor(x, dtype=torch.float32), torch.tensor(y), return_predicted=True)
    assert only_predicted.accuracy is None and only_predicted.predicted.shape == (8,)


# ----------------------------------------------------------------------------------------- linear op

LIN_CASES = [  # lead, H, V, dtype, chunk, bias, options, reduction (interpreter: 256-column slices in pass 2)
    ((11,), 16, 300, "float32", 6, True, ALL, "mean"),
    ((2, 9), 8, 300, "float32", None, False, dict(label_smoothing=0.1), "sum"),  # 2 chunks in dW's storage
    ((5,), 16, 333, "bfloat16", 3, True, dict(z_loss=1e-2), "none"),
]


def _lin_id(c):
    return (f"{'x'.join(map(str, c[0]))}xH{c[1]}xV{c[2]}-{c[3]}-c{c[4]}-b{int(c[5])}-"
            f"{'-'.join(c[6]) or 'plain'}-{c[7]}")


def _t(a, dtype, grad=False):
    return None if a is None else torch.tensor(a, dtype=TORCH_DTYPES[dtype], requires_grad=grad)


@pytest.mark.parametrize("case", LIN_CASES, ids=_lin_id)
def test_linear_cross_entropy_weighted_both_frameworks(case):
    """linear_cross_entropy(class_weight=...) with accuracy and predicted, both passes (chunks of their own,
    chunks in dW's storage), against float64 (within twice torch eager's error in the input dtype)."""
    lead, hidden, vocab, dtype, chunk, bias, opts, reduction = case
    rng = _rng("lin", _lin_id(case))
    h = rounded(rng.standard_normal((*lead, hidden)), dtype)
    w = rounded(rng.standard_normal((vocab, hidden)) / np.sqrt(hidden) * 2, dtype)
    b = rounded(rng.standard_normal(vocab) * 0.5, dtype) if bias else None
    y = _labels(rng, lead, vocab)
    cw = rounded(_class_weights(rng, vocab), dtype)
    g = rng.standard_normal(lead) if reduction == "none" else np.float64(1.3)
    kw = dict(reduction=reduction, **opts)
    ref = R.linear_cross_entropy(h, w, y, bias=b, class_weight=cw, **kw)
    ref_grads = R.linear_cross_entropy_bwd(g, h, w, y, bias=b, class_weight=cw, **kw)
    ref_logits = h.reshape(-1, hidden) @ w.T + (0.0 if b is None else b)

    ht, wt, bt = _t(h, dtype, True), _t(w, dtype, True), _t(b, dtype, True)
    x = ht.reshape(-1, hidden) @ wt.T + (0 if bt is None else bt)
    naive = _naive(x, torch.tensor(y).reshape(-1), _t(cw, dtype), **kw)
    naive = naive.reshape(lead) if reduction == "none" else naive
    naive = (naive, *torch.autograd.grad(naive, [t for t in (ht, wt, bt) if t is not None],
                                         torch.tensor(g, dtype=naive.dtype)))

    ht, wt, bt = _t(h, dtype, True), _t(w, dtype, True), _t(b, dtype, True)
    out = ftc.linear_cross_entropy(ht, wt, torch.tensor(y), bias=bt, class_weight=torch.tensor(cw), chunk_size=chunk,
                                   return_accuracy=True, return_predicted=True, **kw)
    out.loss.backward(torch.tensor(g, dtype=torch.float32))
    outs_t = (out.loss, ht.grad, wt.grad) + ((bt.grad,) if bias else ())

    def f(*args):
        o = fjc.linear_cross_entropy(args[0], args[1], jnp.asarray(y), bias=args[2] if bias else None,
                                     class_weight=jnp.asarray(cw, jnp.float32), chunk_size=chunk,
                                     return_accuracy=True, return_predicted=True, **kw)
        return o.loss, o

    args = [jnp.asarray(a, dtype) for a in (h, w, b) if a is not None]
    jloss, vjp, jout = jax.vjp(f, *args, has_aux=True)
    outs_j = (jloss, *vjp(jnp.asarray(g, jnp.float32)))
    names = ("loss", "dhidden", "dweight", "dbias")
    for fw, outs in (("torch", outs_t), ("jax", outs_j)):
        for name, o, r, nv in zip(names, outs, (ref, *ref_grads), naive):
            assert_close(o, r, nv, name=f"{fw} {name}", floor=(FLOOR if name == "loss" else GEMM_FLOOR)[dtype])
    for o in (out, jout):
        predicted = np.asarray(o.predicted).reshape(-1)
        if dtype == "float32":
            np.testing.assert_array_equal(predicted, np.argmax(ref_logits, -1))
        else:  # the argmax of logits rounded to bf16 (each framework's GEMM): within their rounding of the max
            picked = ref_logits[np.arange(len(predicted)), predicted]
            assert np.all(picked >= ref_logits.max(-1) - 2 ** -6 * np.abs(ref_logits).max(-1))
        np.testing.assert_array_equal(np.asarray(o.accuracy), (np.asarray(o.predicted) == y) & (y != -100))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_mean_multiplies_by_ieee_reciprocals(weighted, z_loss):
    """Reduction "mean" multiplies by the reciprocals of its divisors, IEEE-rounded in a kernel
    (``plan_mean_scales``), in both frameworks: the scales are ``fp32(1 / W)`` and ``fp32(1 / count)``
    (class weights in 1/8 steps: the kernel's float32 sum is exact), the mean's gradient is bit for bit
    reduction "none"'s for an upstream gradient of those reciprocals, and the loss is the rows' sum (in the
    reduction kernel's order) times them, in both frameworks. No framework division or reduction is left to
    decide the bits (on NVIDIA GPUs XLA's float32 division is approximate and torch's is not:
    tests/test_cross_entropy_gpu.py checks the parity there)."""
    rng = _rng("scales", weighted, z_loss)
    vocab, n = 300, 23
    x = rng.standard_normal((n, vocab)).astype(np.float32) * 3
    y = _labels(rng, (n,), vocab, ignore_frac=0.3)
    cw = (rng.integers(1, 24, vocab) / 8).astype(np.float32) if weighted else None
    counted = y != -100
    count, w_total = np.float32(counted.sum()), np.float32(cw[y[counted]].sum() if weighted else counted.sum())
    want = np.array([np.float32(1) / w_total, np.float32(1) / count], np.float32)
    opts = dict(label_smoothing=0.1, z_loss=z_loss)

    yt, cwt = torch.tensor(y), None if cw is None else torch.tensor(cw)
    scales = torch.ops.flashbridge.cross_entropy_mean_scales(yt, cwt, -100).numpy()
    jscales = fjc._mean_scales(jnp.asarray(y), None if cw is None else jnp.asarray(cw), -100)
    np.testing.assert_array_equal(scales, want)
    np.testing.assert_array_equal(np.asarray(jscales), want)

    xt = torch.tensor(x, requires_grad=True)
    loss = ftc.cross_entropy(xt, yt, weight=cwt, **opts)
    loss.backward()
    jw = {} if cw is None else dict(weight=jnp.asarray(cw))
    jloss, jdx = jax.value_and_grad(lambda a: fjc.cross_entropy(a, jnp.asarray(y), **jw, **opts))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(jdx), xt.grad.numpy())
    if weighted and z_loss:  # two scales (the ce terms' 1 / W, the z-loss terms' 1 / count): no single row op
        return
    xn = torch.tensor(x, requires_grad=True)
    rows = ftc.cross_entropy(xn, yt, weight=cwt, reduction="none", **opts)
    rows.backward(torch.full((n,), want[0]))
    np.testing.assert_array_equal(xt.grad.numpy(), xn.grad.numpy())
    # the rows summed in the kernel's fixed order (torch's and XLA's own sums reduce in other orders), times 1 / W
    total = torch.ops.flashbridge.cross_entropy_total(rows.detach(), None, torch.tensor(want))
    assert loss.item() == total.item() == float(jloss)
    np.testing.assert_allclose(loss.item(), rows.detach().double().sum().item() * want[0], rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean"])
def test_weighted_corner_cases(reduction):
    """Every label ignored: 0 with zero gradients (a mean of nothing), both ops and frameworks. Negative
    weights are allowed (as in torch); a NaN weight makes the losses that read it NaN."""
    rng = _rng("corner", reduction)
    h = rng.standard_normal((5, 8)).astype(np.float32)
    w = (rng.standard_normal((50, 8)) / 2).astype(np.float32)
    cw = _class_weights(rng, 50).astype(np.float32)
    ignored = np.full(5, -100)
    x = h @ w.T
    xt = torch.tensor(x, requires_grad=True)
    ht, wt = torch.tensor(h, requires_grad=True), torch.tensor(w, requires_grad=True)
    losses = [ftc.cross_entropy(xt, torch.tensor(ignored), weight=torch.tensor(cw), reduction=reduction, **ALL),
              ftc.linear_cross_entropy(ht, wt, torch.tensor(ignored), class_weight=torch.tensor(cw),
                                       reduction=reduction, chunk_size=2, **ALL)]
    sum(loss.sum() for loss in losses).backward()
    jl, jg = jax.value_and_grad(lambda a, b, c: fjc.cross_entropy(
        a, jnp.asarray(ignored), weight=jnp.asarray(cw), reduction=reduction, **ALL).sum() + fjc.linear_cross_entropy(
        b, c, jnp.asarray(ignored), class_weight=jnp.asarray(cw), reduction=reduction, chunk_size=2, **ALL).sum(),
        argnums=(0, 1, 2))(jnp.asarray(x), jnp.asarray(h), jnp.asarray(w))
    for a in (*losses, xt.grad, ht.grad, wt.grad, jl, *jg):
        assert np.all(np.isfinite(np64(a))) and not np.any(np64(a))

    y = np.array([3, 7, -100, 7, 49])
    signed = cw * np.where(np.arange(50) % 3 == 0, -1.0, 1.0).astype(np.float32)
    nan_w = cw.copy()
    nan_w[7] = np.nan
    for weights, smoothing in ((signed, 0.1), (nan_w, 0.0)):
        ref = R.cross_entropy(x, y, weight=weights, reduction=reduction, label_smoothing=smoothing)
        for loss in (ftc.cross_entropy(torch.tensor(x), torch.tensor(y), weight=torch.tensor(weights),
                                       reduction=reduction, label_smoothing=smoothing),
                     fjc.cross_entropy(jnp.asarray(x), jnp.asarray(y), weight=jnp.asarray(weights), reduction=reduction,
                                       label_smoothing=smoothing)):
            np.testing.assert_allclose(np64(loss), ref, rtol=1e-5, atol=1e-6)  # NaN where ref is NaN
        rows = ftc.cross_entropy(torch.tensor(x), torch.tensor(y), weight=torch.tensor(weights), reduction="none",
                                 label_smoothing=smoothing).numpy()
        np.testing.assert_allclose(rows, R.cross_entropy(x, y, weight=weights, reduction="none",
                                                         label_smoothing=smoothing), rtol=1e-5, atol=1e-6)
    assert np.isnan(rows[[1, 3]]).all() and np.isfinite(rows[[0, 2, 4]]).all()  # the NaN class' rows only


# --------------------------------------------------------------------------- transforms and compilers

def test_jax_jit_grad_vmap_weighted():
    """jit(grad) with class weights and the extras; vmap over sequences with shared class weights (rows
    folded into one launch) and with per-sequence class weights (one call each); the linear op under vmap."""
    rng = _rng("jax")
    x = rng.standard_normal((3, 7, 300)) * 2
    y = _labels(rng, (3, 7), 300)
    cw = _class_weights(rng, 300)
    cws = np.stack([_class_weights(rng, 300) for _ in range(3)])
    xj, yj = jnp.asarray(x, jnp.float32), jnp.asarray(y)

    def loss_fn(a, labels, weight):
        out = fjc.cross_entropy(a, labels, weight=weight, return_accuracy=True, **ALL)
        return out.loss, out.accuracy

    (val, acc), dx = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(xj, yj, jnp.asarray(cw, jnp.float32))
    ref, ref_acc = R.cross_entropy(x, y, weight=cw, return_accuracy=True, **ALL)
    assert_close(val, ref, rounded(ref, "float32"), name="jit loss")
    assert_close(dx, R.cross_entropy_bwd(1.0, x, y, weight=cw, **ALL), rounded(ref, "float32") * 0, name="jit dx",
                 floor=1e-6)
    np.testing.assert_array_equal(np.asarray(acc), ref_acc)
    for weights, axes in ((cw, (0, 0, None)), (cws, (0, 0, 0))):
        vals, dxs = jax.jit(jax.vmap(jax.value_and_grad(lambda *a: loss_fn(*a)[0]), in_axes=axes))(
            xj, yj, jnp.asarray(weights, jnp.float32))
        for i in range(3):
            wi = weights if weights.ndim == 1 else weights[i]
            ri = R.cross_entropy(x[i], y[i], weight=wi, **ALL)
            assert_close(vals[i], ri, rounded(ri, "float32"), name="vmap loss")
            rdx = R.cross_entropy_bwd(1.0, x[i], y[i], weight=wi, **ALL)
            assert_close(dxs[i], rdx, rounded(rdx, "float32"), name="vmap dx", floor=1e-6)

    h = rng.standard_normal((2, 9, 16))
    w = rng.standard_normal((300, 16)) / 4
    yl = _labels(rng, (2, 9), 300)
    lin = jax.vmap(jax.grad(lambda hh, ww, yy: fjc.linear_cross_entropy(
        hh, ww, yy, class_weight=jnp.asarray(cw, jnp.float32), **ALL), argnums=(0, 1)),
        in_axes=(0, None, 0))(jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(yl))
    for i in range(2):
        rdh, rdw, _ = R.linear_cross_entropy_bwd(1.0, h[i], w, yl[i], class_weight=cw, **ALL)
        assert_close(lin[0][i], rdh, rounded(rdh, "float32"), name="vmap linear dh", floor=1e-5)
        assert_close(lin[1][i], rdw, rounded(rdw, "float32"), name="vmap linear dw", floor=1e-5)
    # the class weights are constants: their gradient is zero
    dcw = jax.grad(lambda c: loss_fn(xj, yj, c)[0])(jnp.asarray(cw, jnp.float32))
    assert not np.any(np.asarray(dcw))


def test_torch_compile_and_vmap_weighted():
    """torch.compile(fullgraph=True) with class weights and the extras (eager's results), and
    torch.func.vmap over sequences with shared class weights."""
    rng = _rng("compile")
    h = rng.standard_normal((2, 9, 16))
    w = rng.standard_normal((300, 16)) / 4
    y = _labels(rng, (2, 9), 300)
    cw = torch.tensor(_class_weights(rng, 300), dtype=torch.float32)

    def step(hh, ww, yy):
        out = ftc.cross_entropy(hh @ ww.T, yy, weight=cw, label_smoothing=0.1, z_loss=1e-3, return_accuracy=True,
                                return_predicted=True)
        return out.loss, out.accuracy, out.predicted

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, step):
        ht, wt = _t(h, "float32", True), _t(w, "float32", True)
        loss, acc, pred = fn(ht, wt, torch.tensor(y))
        loss.backward()
        results.append((loss, acc, pred, ht.grad, wt.grad))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)
    ref = R.cross_entropy(h @ w.T, y, weight=cw.numpy(), label_smoothing=0.1, z_loss=1e-3)
    assert abs(results[0][0].item() - ref) < 1e-5 * max(1, abs(ref))

    x = torch.tensor(rng.standard_normal((3, 5, 300)), dtype=torch.float32)
    yx = torch.tensor(_labels(rng, (3, 5), 300))
    vals = torch.func.vmap(lambda a, b: ftc.cross_entropy(a, b, weight=cw, label_smoothing=0.1))(x, yx)
    grads = torch.func.vmap(torch.func.grad(lambda a, b: ftc.cross_entropy(a, b, weight=cw, z_loss=1e-2)))(x, yx)
    for i in range(3):
        ri = R.cross_entropy(x[i].numpy(), yx[i].numpy(), weight=cw.numpy(), label_smoothing=0.1)
        assert abs(vals[i].item() - ri) < 1e-5 * max(1, abs(ri))
        rdx = R.cross_entropy_bwd(1.0, x[i].numpy(), yx[i].numpy(), weight=cw.numpy(), z_loss=1e-2)
        np.testing.assert_allclose(grads[i].numpy(), rdx, rtol=1e-4, atol=1e-7)


def test_opcheck_weighted_ops():
    rng = _rng("opcheck")
    x = torch.tensor(rng.standard_normal((5, 300)), dtype=torch.float32, requires_grad=True)
    y = torch.tensor(_labels(rng, (5,), 300))
    cw = torch.tensor(_class_weights(rng, 300), dtype=torch.float32)
    opts = (-100, 0.1, 1e-3, 4.0)
    total = torch.ops.flashbridge.cross_entropy_class_weight_sum(cw)
    torch.library.opcheck(torch.ops.flashbridge.cross_entropy_class_weight_sum.default, (cw,))
    for class_weight in (cw, None):
        torch.library.opcheck(torch.ops.flashbridge.cross_entropy_mean_scales.default, (y, class_weight, -100))
    rows = torch.rand(5, requires_grad=True)
    scales = torch.ops.flashbridge.cross_entropy_mean_scales(y, cw, -100)
    for z_rows, s in ((torch.rand(5, requires_grad=True), scales), (None, None)):
        torch.library.opcheck(torch.ops.flashbridge.cross_entropy_total.default, (rows, z_rows, s))
    torch.library.opcheck(torch.ops.flashbridge.cross_entropy_fwd_ext.default, (x, y, cw, total, *opts, True))
    torch.library.opcheck(torch.ops.flashbridge.cross_entropy_fwd_ext.default, (x, y, None, None, *opts, True))
    _, lse, lse_lo, _, _ = torch.ops.flashbridge.cross_entropy_fwd_ext(x.detach(), y, cw, total, *opts, False)
    torch.library.opcheck(torch.ops.flashbridge.cross_entropy_bwd_weighted.default,
                          (x.detach(), y, lse, lse_lo, torch.rand(5), torch.rand(5), cw, total, *opts))


# ---------------------------------------------------------------------------- modules, flax, bad input

def test_module_and_flax_helper():
    from flax import nnx

    rng = _rng("modules")
    h = rng.standard_normal((7, 16)).astype(np.float32)
    y = _labels(rng, (7,), 300)
    cw = _class_weights(rng, 300).astype(np.float32)
    head = torch.nn.Linear(16, 300, bias=True)
    loss_fn = ftc.LinearCrossEntropyLoss(class_weight=torch.tensor(cw), label_smoothing=0.1, return_accuracy=True)
    assert "class_weight" in dict(loss_fn.named_buffers()) and "class_weight" in repr(loss_fn)
    out = loss_fn(torch.tensor(h), head.weight, torch.tensor(y), head.bias)
    out.loss.backward()
    wn, bn = np64(head.weight), np64(head.bias)
    ref, ref_acc = R.linear_cross_entropy(h, wn, y, bias=bn, class_weight=cw, label_smoothing=0.1,
                                          return_accuracy=True)
    assert_close(out.loss, ref, rounded(ref, "float32"), name="module loss")
    np.testing.assert_array_equal(out.accuracy.numpy(), ref_acc)
    rdw = R.linear_cross_entropy_bwd(1.0, h, wn, y, bias=bn, class_weight=cw, label_smoothing=0.1)[1]
    assert_close(head.weight.grad, rdw, rounded(rdw, "float32"), name="module dw", floor=1e-5)

    layer = nnx.Linear(16, 300, rngs=nnx.Rngs(0))
    loss, grads = nnx.value_and_grad(lambda m: fjc.linear_cross_entropy_from_layer(
        m, jnp.asarray(h), jnp.asarray(y), class_weight=jnp.asarray(cw), return_predicted=True).loss)(layer)
    k, kb = np64(layer.kernel[...]), np64(layer.bias[...])
    ref = R.linear_cross_entropy(h, k.T, y, bias=kb, class_weight=cw)
    _, rdw, rdb = R.linear_cross_entropy_bwd(1.0, h, k.T, y, bias=kb, class_weight=cw)
    assert_close(loss, ref, rounded(ref, "float32"), name="nnx loss")
    assert_close(grads.kernel[...], rdw.T, rounded(rdw.T, "float32"), name="nnx dkernel", floor=1e-5)
    assert_close(grads.bias[...], rdb, rounded(rdb, "float32"), name="nnx dbias", floor=1e-5)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_bad_class_weights_are_rejected(framework):
    x = np.ones((4, 50), np.float32)
    h, w, y = np.ones((4, 8), np.float32), np.ones((50, 8), np.float32), np.array([0, 1, 2, 3])
    cases = [(np.ones(49, np.float32), ValueError, "shape \\(50,\\), got \\(49,\\)"),
             (np.ones((1, 50), np.float32), ValueError, "one weight per class"),
             (np.ones(50, np.int32), TypeError, "dtype int32 is not supported for class weights")]
    as_array = torch.tensor if framework == "torch" else jnp.asarray
    ce, lce = (ftc.cross_entropy, ftc.linear_cross_entropy) if framework == "torch" else (
        fjc.cross_entropy, fjc.linear_cross_entropy)
    for bad, exc, match in cases:
        with pytest.raises(exc, match=f"weight: .*{match}"):
            ce(as_array(x), as_array(y), weight=as_array(bad))
        with pytest.raises(exc, match=f"class_weight: .*{match}"):
            lce(as_array(h), as_array(w), as_array(y), class_weight=as_array(bad))
    if framework == "torch":  # torch refuses a weight that requires grad; so do we, naming it
        with pytest.raises(ValueError, match="weight: class weights are constants"):
            ce(torch.tensor(x, requires_grad=True), torch.tensor(y), weight=torch.ones(50, requires_grad=True))
        with pytest.raises(TypeError, match="weight: expected a torch.Tensor or None"):
            ce(torch.tensor(x), torch.tensor(y), weight=np.ones(50))
