"""float64 NumPy reference for rotary position embeddings (RoPE), forward and backward.

Per token at position ``p`` and rotary pair ``i`` (``R = 2 * cos.shape[-1]`` rotary dims, ``i < R / 2``)::

    (y_a, y_b) = (x_a cos[p, i] - x_b sin[p, i],  x_b cos[p, i] + x_a sin[p, i])

with ``(a, b) = (i, i + R/2)`` (GPT-NeoX halves) or ``(2i, 2i + 1)`` (``interleaved``, GPT-J pairs); dims from
R on pass through. ``x`` is ``(B, S, H, D)`` (positions ``0 .. S-1``, or ``position_ids``) or packed
``(T, H, D)`` with ``cu_seqlens`` (positions restart at 0 in every sequence) or with ``position_ids (T,)``.
The rotation is orthogonal, so the gradient of x is the inverse rotation of the output's gradient (``sin``
negated); ``cos`` and ``sin`` get no gradient (as in flash-attn).
"""
from __future__ import annotations

import numpy as np


def positions(x_shape, *, position_ids=None, cu_seqlens=None) -> np.ndarray:
    """The position of every token: an int array of shape ``x_shape[:-2]``."""
    lead = tuple(x_shape[:-2])
    if cu_seqlens is not None:
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        pos = np.zeros(lead, dtype=np.int64)
        for start, end in zip(cu[:-1], cu[1:]):
            pos[start:end] = np.arange(end - start)
        return pos
    if position_ids is not None:
        return np.broadcast_to(np.asarray(position_ids, dtype=np.int64), lead)
    if len(lead) != 2:
        raise ValueError("a packed (T, H, D) input needs cu_seqlens or position_ids")
    return np.broadcast_to(np.arange(lead[1]), lead)


def _halves(rotary_dim: int, interleaved: bool):
    if interleaved:
        return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    return slice(0, rotary_dim // 2), slice(rotary_dim // 2, rotary_dim)


def rotary_embedding(x, cos, sin, *, interleaved=False, position_ids=None, cu_seqlens=None, conjugate=False):
    """RoPE of ``x`` (see the module docstring); ``conjugate`` rotates the other way (the inverse)."""
    x = np.asarray(x, dtype=np.float64)
    pos = positions(x.shape, position_ids=position_ids, cu_seqlens=cu_seqlens)
    c = np.asarray(cos, dtype=np.float64)[pos][..., None, :]  # (..., 1, R/2): the same for every head
    s = np.asarray(sin, dtype=np.float64)[pos][..., None, :]
    if conjugate:
        s = -s
    a, b = _halves(2 * c.shape[-1], interleaved)
    out = x.copy()
    out[..., a] = x[..., a] * c - x[..., b] * s
    out[..., b] = x[..., b] * c + x[..., a] * s
    return out


def rotary_embedding_bwd(dy, cos, sin, *, interleaved=False, position_ids=None, cu_seqlens=None):
    """The gradient of x given the output's gradient ``dy``: the transposed (inverse) rotation."""
    return rotary_embedding(dy, cos, sin, interleaved=interleaved, position_ids=position_ids,
                            cu_seqlens=cu_seqlens, conjugate=True)


def cos_sin_table(seqlen: int, rotary_dim: int, base: float = 10000.0):
    """(cos, sin) of shape ``(seqlen, rotary_dim / 2)``: angle ``p * base ** (-2i / rotary_dim)``."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.outer(np.arange(seqlen, dtype=np.float64), inv_freq)
    return np.cos(angles), np.sin(angles)
