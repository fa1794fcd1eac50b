"""float64 NumPy references for the cross-entropy family, forward and backward, every option.

Per row with logits ``x`` (V classes), label ``y``, smoothing ``eps``, z-loss ``lam``, softcap ``c`` and
class weights ``w`` (``V`` of them; all 1 without ``weight=``)::

    z = c * tanh(x / c) (c > 0),  lse = log sum_j exp(z_j)
    ce   = (1 - eps) * w_y * (lse - z_y) + eps / V * sum_j w_j * (lse - z_j)     (torch's definition)
    loss = ce + lam * lse**2,  0 where y == ignore_index

``reduction="mean"`` divides the sum of ``ce`` by the sum of ``w_y`` over the rows whose label is not ignored
(torch's rule; the number of those rows without weights) and the sum of the z-loss terms by the number of
those rows (liger-kernel's rule: the z-loss is not class-weighted); 0 when no row counts. "sum" sums,
"none" keeps the leading shape. ``return_predicted``: the argmax of each row's logits (ties to the lowest
index, as ``np.argmax``), for every row; ``return_accuracy``: whether it equals the label (False for
ignored rows). The linear versions take ``hidden (..., H)``, ``weight (V, H)`` and an optional
``bias (V,)`` with ``x = hidden @ weight.T + bias``; their class weights are ``class_weight``.
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


def _class_weight(weight, vocab):
    w = np.ones(vocab) if weight is None else _f64(weight)
    if w.shape != (vocab,):
        raise ValueError(f"weight: expected shape ({vocab},), got {w.shape}")
    return w


def _forward_rows(x, y, vocab, ignore_index, label_smoothing, z_loss, logit_softcap, weight=None):
    """Per row: (ce, z-loss term, lse, z, active, w_y) -- ce and the z-loss term 0 for ignored rows."""
    _check_labels(y, vocab, ignore_index)
    w = _class_weight(weight, vocab)
    z = logit_softcap * np.tanh(x / logit_softcap) if logit_softcap > 0 else x
    m = np.max(z, axis=-1, keepdims=True)
    log_s = np.log(np.sum(np.exp(z - m), axis=-1))
    m = m[:, 0]
    lse = m + log_s
    active = y != ignore_index
    y_safe = np.where(active, y, 0)
    z_y = np.take_along_axis(z, y_safe[:, None], axis=-1)[:, 0]
    w_y = np.where(active, w[y_safe], 0.0)
    # (m - z_y) + log_s rather than lse - z_y: exact when the logits' magnitude dwarfs log V (e.g. rows
    # masked with float32's lowest value), as log_softmax computes it
    ce = (1 - label_smoothing) * w_y * ((m - z_y) + log_s)
    if label_smoothing > 0:
        ce = ce + label_smoothing / vocab * np.sum(w * ((m[:, None] - z) + log_s[:, None]), axis=-1)
    zl = z_loss * lse**2
    return np.where(active, ce, 0.0), np.where(active, zl, 0.0), lse, z, active, w_y


def _denominators(active, w_y):
    """(sum of w_y, number of rows) over the rows that count, each 1 when none does: a mean of nothing is 0."""
    n = int(active.sum())
    return (float(np.sum(w_y)) if n else 1.0), float(max(n, 1))


def _reduce(ce, zl, active, w_y, reduction, lead):
    if reduction == "none":
        return (ce + zl).reshape(lead)
    if reduction == "sum":
        return np.sum(ce) + np.sum(zl)
    w_sum, count = _denominators(active, w_y)
    return np.sum(ce) / w_sum + np.sum(zl) / count


def _extras(x, y, active, lead, return_accuracy, return_predicted):
    predicted = np.argmax(x, axis=-1)  # ties: the lowest index
    out = []
    if return_accuracy:
        out.append(((predicted == y) & active).reshape(lead))
    if return_predicted:
        out.append(predicted.reshape(lead))
    return out


def cross_entropy(logits, labels, *, weight=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                  logit_softcap=0.0, reduction="mean", return_lse=False, return_accuracy=False,
                  return_predicted=False):
    """Loss of ``logits (..., V)`` against integer ``labels (...)`` with optional class weights ``weight
    (V,)``. Returns the loss, followed by those asked for: lse ``(...)``, accuracy (bool ``(...)``),
    predicted (int ``(...)``)."""
    x, y, vocab = _rows(logits, labels)
    lead = np.shape(labels)
    ce, zl, lse, _, active, w_y = _forward_rows(x, y, vocab, ignore_index, label_smoothing, z_loss,
                                                logit_softcap, weight)
    loss = _reduce(ce, zl, active, w_y, reduction, lead)
    out = [loss] + ([lse.reshape(lead)] if return_lse else [])
    out += _extras(x, y, active, lead, return_accuracy, return_predicted)
    return tuple(out) if len(out) > 1 else loss


def cross_entropy_bwd(dloss, logits, labels, *, weight=None, ignore_index=-100, label_smoothing=0.0,
                      z_loss=0.0, logit_softcap=0.0, reduction="mean"):
    """Gradient of ``cross_entropy`` with respect to the logits, given ``dloss`` (a scalar, or ``(...)``
    for reduction="none"). The class weights are constants (no gradient, as in torch)."""
    x, y, vocab = _rows(logits, labels)
    _, _, lse, z, active, w_y = _forward_rows(x, y, vocab, ignore_index, label_smoothing, z_loss,
                                              logit_softcap, weight)
    w = _class_weight(weight, vocab)
    if reduction == "none":
        g_ce = g_z = _f64(dloss).reshape(-1)
    elif reduction == "sum":
        g_ce = g_z = np.full(y.shape, float(dloss))
    else:
        w_sum, count = _denominators(active, w_y)
        g_ce, g_z = np.full(y.shape, float(dloss) / w_sum), np.full(y.shape, float(dloss) / count)
    g_ce, g_z = np.where(active, g_ce, 0.0), np.where(active, g_z, 0.0)
    p = np.exp(z - lse[:, None])
    # d ce / dz_j = (1 - eps) w_y (p_j - [j == y]) + eps / V (sum_k w_k p_j - w_j); d lse**2 / dz_j = 2 lse p_j
    dz = g_ce[:, None] * ((1 - label_smoothing) * w_y[:, None] * p
                          + label_smoothing / vocab * (np.sum(w) * p - w[None, :]))
    dz[np.arange(len(y)), np.where(active, y, 0)] -= g_ce * (1 - label_smoothing) * w_y
    dz += (g_z * 2 * z_loss * lse)[:, None] * p
    if logit_softcap > 0:
        dz *= 1 - (z / logit_softcap) ** 2
    return dz.reshape(np.shape(logits))


def _logits(hidden, weight, bias):
    h = _f64(hidden)
    x = h.reshape(-1, h.shape[-1]) @ _f64(weight).T
    return x if bias is None else x + _f64(bias)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, class_weight=None, ignore_index=-100,
                         label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean", return_lse=False,
                         return_accuracy=False, return_predicted=False):
    """``cross_entropy(hidden @ weight.T + bias, labels, weight=class_weight)`` for ``hidden (..., H)``,
    ``weight (V, H)``."""
    x = _logits(hidden, weight, bias)
    return cross_entropy(x.reshape(*np.shape(labels), -1), labels, weight=class_weight, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap,
                         reduction=reduction, return_lse=return_lse, return_accuracy=return_accuracy,
                         return_predicted=return_predicted)


def linear_cross_entropy_bwd(dloss, hidden, weight, labels, *, bias=None, class_weight=None, ignore_index=-100,
                             label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean"):
    """Gradients of ``linear_cross_entropy``: returns ``(dhidden, dweight, dbias)`` (dbias None without
    a bias)."""
    h = _f64(hidden)
    x = _logits(hidden, weight, bias)
    dx = cross_entropy_bwd(dloss, x, np.asarray(labels).reshape(-1), weight=class_weight,
                           ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                           logit_softcap=logit_softcap, reduction=reduction)
    dh = (dx @ _f64(weight)).reshape(h.shape)
    dw = dx.T @ h.reshape(-1, h.shape[-1])
    db = None if bias is None else dx.sum(axis=0)
    return dh, dw, db
