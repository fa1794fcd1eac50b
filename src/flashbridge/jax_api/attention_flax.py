"""Flax NNX drop-in for ``flax.nnx.MultiHeadAttention`` running flashbridge's attention kernels."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from .attention import dot_product_attention


def _is_causal_mask(mask) -> bool:
    """True iff a concrete boolean mask is (broadcastable to) the top-left causal mask."""
    if isinstance(mask, jax.core.Tracer):
        return False
    m = np.asarray(mask)
    if m.ndim < 2 or m.shape[-1] < 1:
        return False
    t, s = m.shape[-2:]
    causal = np.tril(np.ones((t, s), dtype=bool))
    return bool(np.all(m.astype(bool) == causal))


def flash_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
                       dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
                       is_causal=False, **unused) -> jax.Array:
    """An ``attention_fn`` for Flax attention modules: ``flax.nnx.dot_product_attention``'s signature over
    flashbridge's :func:`dot_product_attention` (layout ``(batch, length, heads, head_dim)``).

    Supported: no mask, or a concrete causal mask (e.g. ``nnx.make_causal_mask``), or ``is_causal=True``;
    no bias, no dropout, no sown weights.
    """
    if bias is not None:
        raise ValueError("bias: attention bias is not supported by flashbridge's attention_fn")
    if dropout_rate > 0.0 and not deterministic:
        raise ValueError(f"dropout_rate: attention dropout is not supported (got {dropout_rate} with "
                         "deterministic=False)")
    if module is not None:
        raise ValueError("sow_weights: flash attention never materialises the attention weights")
    if mask is not None:
        if not _is_causal_mask(mask):
            raise ValueError("mask: only None or a (concrete) causal mask is supported; under jit pass "
                             "mask=None and is_causal=True instead")
        is_causal = True
    if dtype is not None:
        query, key, value = query.astype(dtype), key.astype(dtype), value.astype(dtype)
    return dot_product_attention(query, key, value, is_causal=is_causal)


class MultiHeadAttention(nnx.MultiHeadAttention):
    """Drop-in for :class:`flax.nnx.MultiHeadAttention` (same constructor, parameters and parameter names:
    ``query`` / ``key`` / ``value`` / ``out`` ``LinearGeneral`` kernels and biases), with the attention
    itself computed by flashbridge's kernels (:func:`flash_attention_fn`).

    Masks: None, ``is_causal=True`` or a concrete causal mask; no attention dropout, no autoregressive
    ``decode`` cache (use flashbridge's decode kernels for that).

    Example::

        >>> import jax.numpy as jnp
        >>> mha = MultiHeadAttention(num_heads=4, in_features=64, decode=False, rngs=nnx.Rngs(0))
        >>> y = mha(jnp.ones((2, 16, 64)), is_causal=True)
    """

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("attention_fn") not in (None, flash_attention_fn):
            raise ValueError("attention_fn: flashbridge's MultiHeadAttention always uses flash_attention_fn")
        kwargs["attention_fn"] = flash_attention_fn
        kwargs.setdefault("decode", False)
        super().__init__(*args, **kwargs)

    def __call__(self, inputs_q: jax.Array, inputs_k: jax.Array | None = None, inputs_v: jax.Array | None = None, *,
                 decode: bool | None = None, **kwargs) -> jax.Array:
        if decode or (decode is None and self.decode):
            raise ValueError("decode: the autoregressive cache is not supported by flashbridge's "
                             "MultiHeadAttention")
        return super().__call__(inputs_q, inputs_k, inputs_v, decode=False, **kwargs)
