"""float64 NumPy references for the fused-norm family, forward and backward.

They mirror the public ops: rows are the last dimension, every leading dimension is a batch dimension.
Backward functions take the upstream gradients and return the gradient of every tensor input.
"""
from __future__ import annotations

import numpy as np


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _normalize(h: np.ndarray, eps: float, is_rms: bool) -> np.ndarray:
    if is_rms:
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    mean = np.mean(h, axis=-1, keepdims=True)
    var = np.mean((h - mean) ** 2, axis=-1, keepdims=True)
    return (h - mean) / np.sqrt(var + eps)


def _affine(xhat, weight, bias):
    z = xhat if weight is None else xhat * weight
    return z if bias is None else z + bias


def rms_norm(x, weight=None, *, eps=1e-6, residual=None):
    """y = h / sqrt(mean(h^2) + eps) * weight, h = x (+ residual). Returns y, or (y, h) with residual."""
    h = _f64(x) if residual is None else _f64(x) + _f64(residual)
    y = _affine(_normalize(h, eps, True), _f64(weight), None)
    return y if residual is None else (y, h)


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, residual=None):
    """y = (h - mean) / sqrt(var + eps) * weight + bias, h = x (+ residual)."""
    h = _f64(x) if residual is None else _f64(x) + _f64(residual)
    y = _affine(_normalize(h, eps, False), _f64(weight), _f64(bias))
    return y if residual is None else (y, h)


def layer_norm_dropout_residual(x, weight, bias, residual, *, keep_mask, dropout_p, eps=1e-5):
    """y = dropout(layer_norm(x)) + residual, with the dropout ``keep_mask`` given explicitly."""
    z = _affine(_normalize(_f64(x), eps, False), _f64(weight), _f64(bias))
    scale = 1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0
    return np.where(keep_mask, z * scale, 0.0) + _f64(residual)


def _norm_bwd(dz, h, weight, eps, is_rms):
    """Gradients of z = norm(h) * weight + bias given dz: returns (dh, dweight, dbias)."""
    n = h.shape[-1]
    xhat = _normalize(h, eps, is_rms)
    if is_rms:
        rstd = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    else:
        mean = np.mean(h, axis=-1, keepdims=True)
        rstd = 1.0 / np.sqrt(np.mean((h - mean) ** 2, axis=-1, keepdims=True) + eps)
    lead = tuple(range(dz.ndim - 1))
    dweight = np.sum(dz * xhat, axis=lead)
    dbias = np.sum(dz, axis=lead)
    g = dz if weight is None else dz * weight
    c1 = np.sum(g * xhat, axis=-1, keepdims=True) / n
    if is_rms:
        dh = (g - xhat * c1) * rstd
    else:
        dh = (g - np.sum(g, axis=-1, keepdims=True) / n - xhat * c1) * rstd
    return dh, dweight, dbias


def rms_norm_bwd(dy, x, weight=None, *, eps=1e-6, residual=None, dh=None):
    """Returns (dx, dweight, dresidual); dweight / dresidual are None when absent. ``dh`` is the gradient
    arriving at the h output (with residual)."""
    h = _f64(x) if residual is None else _f64(x) + _f64(residual)
    dhh, dweight, _ = _norm_bwd(_f64(dy), h, _f64(weight), eps, True)
    if dh is not None:
        dhh = dhh + _f64(dh)
    return dhh, (None if weight is None else dweight), (None if residual is None else dhh)


def layer_norm_bwd(dy, x, weight=None, bias=None, *, eps=1e-5, residual=None, dh=None):
    """Returns (dx, dweight, dbias, dresidual); None for inputs that are absent."""
    h = _f64(x) if residual is None else _f64(x) + _f64(residual)
    dhh, dweight, dbias = _norm_bwd(_f64(dy), h, _f64(weight), eps, False)
    if dh is not None:
        dhh = dhh + _f64(dh)
    return (dhh, None if weight is None else dweight, None if bias is None else dbias,
            None if residual is None else dhh)


def layer_norm_dropout_residual_bwd(dy, x, weight, bias, residual, *, keep_mask, dropout_p, eps=1e-5):
    """Returns (dx, dweight, dbias, dresidual)."""
    scale = 1.0 / (1.0 - dropout_p) if dropout_p > 0 else 1.0
    dz = np.where(keep_mask, _f64(dy) * scale, 0.0)
    dx, dweight, dbias = _norm_bwd(dz, _f64(x), _f64(weight), eps, False)
    return (dx, None if weight is None else dweight, None if bias is None else dbias,
            None if residual is None else _f64(dy))
