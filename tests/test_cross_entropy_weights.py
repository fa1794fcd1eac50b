"""Cross-entropy with class weights and the per-token extras (accuracy, predicted class) on the CPU (Triton
interpreter), both frameworks, against the float64 reference; the reference itself against torch's
``F.cross_entropy(weight=...)`` in float64 and finite differences."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from flashbridge.reference import cross_entropy as R

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


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
