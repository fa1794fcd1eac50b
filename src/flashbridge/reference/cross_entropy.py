"""float64 NumPy references for the cross-entropy family, forward and backward, every option.

Per row with logits ``x`` (V classes), label ``y``, smoothing ``eps``, z-loss ``lam``, softcap ``c``::

    z = c * tanh(x / c) (c > 0),  lse = log sum_j exp(z_j)
    loss = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + lam * lse**2,  0 where y == ignore_index

``reduction="mean"`` divides the sum by the number of rows whose label is not ignored (0 when there is
none), "sum" sums, "none" keeps the leading shape. The linear versions take ``hidden (..., H)``,
``weight (V, H)`` and an optional ``bias (V,)`` with ``x = hidden @ weight.T + bias``.
"""
from __future__ import annotations

import numpy as np


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _check_labels(labels: np.ndarray, vocab: int, ignore_index: int) -> None:
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if np.any(bad):
        raise ValueError(f"labels: {int(bad.sum())} label(s) outside [0, {vocab}) that are not "
                         f"ignore_index={ignore_index}")


def _rows(logits, labels):
    x = _f64(logits)
    vocab = x.shape[-1]
    return x.reshape(-1, vocab), np.asarray(labels).reshape(-1).astype(np.int64), vocab


def _forward_rows(x, y, vocab, ignore_index, label_smoothing, z_loss, logit_softcap):
    _check_labels(y, vocab, ignore_index)
    z = logit_softcap * np.tanh(x / logit_softcap) if logit_softcap > 0 else x
    m = np.max(z, axis=-1, keepdims=True)
    log_s = np.log(np.sum(np.exp(z - m), axis=-1))
    m = m[:, 0]
    lse = m + log_s
    active = y != ignore_index
    z_y = np.take_along_axis(z, np.where(active, y, 0)[:, None], axis=-1)[:, 0]
    # (m - z_y) + log_s rather than lse - z_y: exact when the logits' magnitude dwarfs log V (e.g. rows
    # masked with float32's lowest value), as log_softmax computes it
    loss = (1 - label_smoothing) * ((m - z_y) + log_s) + z_loss * lse**2
    if label_smoothing > 0:
        loss = loss + label_smoothing * ((m - z.mean(axis=-1)) + log_s)
    return np.where(active, loss, 0.0), lse, z, active


def _reduce(loss_rows, active, reduction, lead):
    if reduction == "none":
        return loss_rows.reshape(lead)
    if reduction == "sum":
        return np.sum(loss_rows)
    return np.sum(loss_rows) / max(int(active.sum()), 1)


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0,
                  reduction="mean", return_lse=False):
    """Loss of ``logits (..., V)`` against integer ``labels (...)``; with return_lse also lse ``(...)``."""
    x, y, vocab = _rows(logits, labels)
    lead = np.shape(labels)
    loss_rows, lse, _, active = _forward_rows(x, y, vocab, ignore_index, label_smoothing, z_loss, logit_softcap)
    loss = _reduce(loss_rows, active, reduction, lead)
    return (loss, lse.reshape(lead)) if return_lse else loss


def cross_entropy_bwd(dloss, logits, labels, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                      logit_softcap=0.0, reduction="mean"):
    """Gradient of ``cross_entropy`` with respect to the logits, given ``dloss`` (a scalar, or ``(...)``
    for reduction="none")."""
    x, y, vocab = _rows(logits, labels)
    _, lse, z, active = _forward_rows(x, y, vocab, ignore_index, label_smoothing, z_loss, logit_softcap)
    if reduction == "none":
        w = _f64(dloss).reshape(-1)
    elif reduction == "sum":
        w = np.full(y.shape, float(dloss))
    else:
        w = np.full(y.shape, float(dloss) / max(int(active.sum()), 1))
    w = np.where(active, w, 0.0)
    p = np.exp(z - lse[:, None])
    dz = p * (1 + 2 * z_loss * lse[:, None]) - label_smoothing / vocab
    dz[np.arange(len(y)), np.where(active, y, 0)] -= (1 - label_smoothing) * active
    dz *= w[:, None]
    if logit_softcap > 0:
        dz *= 1 - (z / logit_softcap) ** 2
    return dz.reshape(np.shape(logits))


def _logits(hidden, weight, bias):
    h = _f64(hidden)
    x = h.reshape(-1, h.shape[-1]) @ _f64(weight).T
    return x if bias is None else x + _f64(bias)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, label_smoothing=0.0,
                         z_loss=0.0, logit_softcap=0.0, reduction="mean", return_lse=False):
    """``cross_entropy(hidden @ weight.T + bias, labels)`` for ``hidden (..., H)``, ``weight (V, H)``."""
    x = _logits(hidden, weight, bias)
    return cross_entropy(x.reshape(*np.shape(labels), -1), labels, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap,
                         reduction=reduction, return_lse=return_lse)


def linear_cross_entropy_bwd(dloss, hidden, weight, labels, *, bias=None, ignore_index=-100,
                             label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean"):
    """Gradients of ``linear_cross_entropy``: returns ``(dhidden, dweight, dbias)`` (dbias None without
    a bias)."""
    h = _f64(hidden)
    x = _logits(hidden, weight, bias)
    dx = cross_entropy_bwd(dloss, x, np.asarray(labels).reshape(-1), ignore_index=ignore_index,
                           label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap,
                           reduction=reduction)
    dh = (dx @ _f64(weight)).reshape(h.shape)
    dw = dx.T @ h.reshape(-1, h.shape[-1])
    db = None if bias is None else dx.sum(axis=0)
    return dh, dw, db
