"""float64 NumPy reference for SwiGLU, forward and backward.

``y = silu(gate) * up`` with ``silu(g) = g * sigmoid(g)``; the fused form takes one array ``x (..., 2I)`` whose
first half is the gate and second half the up projection (the layout of a fused gate_up projection)::

    dgate = dy * up * s * (1 + g * (1 - s)),  dup = dy * silu(g),  s = sigmoid(g)
"""
from __future__ import annotations

import numpy as np


def _sigmoid(g: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * g))  # no overflow for large |g|


def _split(gate, up):
    g = np.asarray(gate, dtype=np.float64)
    if up is not None:
        return g, np.asarray(up, dtype=np.float64)
    half = g.shape[-1] // 2
    return g[..., :half], g[..., half:]


def swiglu(gate, up=None):
    """``silu(gate) * up``; with ``up=None``, ``gate`` is ``x (..., 2I)`` = [gate | up]."""
    g, u = _split(gate, up)
    return g * _sigmoid(g) * u


def swiglu_bwd(dy, gate, up=None):
    """(dgate, dup); with ``up=None`` the gradient of x, ``[dgate | dup]``."""
    g, u = _split(gate, up)
    dy = np.asarray(dy, dtype=np.float64)
    s = _sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    return (dg, du) if up is not None else np.concatenate([dg, du], axis=-1)
