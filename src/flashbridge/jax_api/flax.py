"""Flax NNX modules over flashbridge's kernels: drop-ins with flax.nnx's constructor arguments and
parameter names, so their states load into each other."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from .norms import layer_norm, rms_norm


def _out_dtype(dtype, x, *params):
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(x.dtype, *[p.dtype for p in params])


def _check_axes(reduction_axes, feature_axes, axis_name) -> None:
    if reduction_axes not in (-1, (-1,)) or feature_axes not in (-1, (-1,)):
        raise ValueError(f"reduction_axes / feature_axes: only the last axis (-1) is supported, got "
                         f"{reduction_axes} / {feature_axes}")
    if axis_name is not None:
        raise ValueError("axis_name: statistics across devices are not supported; shard the batch instead")


class RMSNorm(nnx.Module):
    """Drop-in for :class:`flax.nnx.RMSNorm` (parameter ``scale``) running flashbridge's fused kernel.

    ``__call__(x, residual=None)``: with ``residual`` returns ``(y, x + residual)`` from one pass.
    As in flax, the output dtype is ``dtype`` or the promotion of x's and the parameter's dtypes.

    Example::

        >>> norm = RMSNorm(64, rngs=nnx.Rngs(0))
        >>> norm(jnp.ones((2, 64))).shape
        (2, 64)
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Optional[Any] = None,
                 param_dtype: Any = jnp.float32, use_scale: bool = True, scale_init=nnx.initializers.ones,
                 reduction_axes=-1, feature_axes=-1, axis_name=None, rngs: nnx.Rngs) -> None:
        _check_axes(reduction_axes, feature_axes, axis_name)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.use_scale = use_scale
        self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype)) if use_scale else None

    def __call__(self, x: jax.Array, residual: Optional[jax.Array] = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        params = [self.scale[...]] if self.scale is not None else []
        dtype = _out_dtype(self.dtype, x, *params)
        x = x.astype(dtype)
        residual = None if residual is None else residual.astype(dtype)
        return rms_norm(x, params[0] if params else None, eps=self.epsilon, residual=residual)


class LayerNorm(nnx.Module):
    """Drop-in for :class:`flax.nnx.LayerNorm` (parameters ``scale`` and ``bias``) on flashbridge's kernel.

    ``__call__(x, residual=None)``: with ``residual`` returns ``(y, x + residual)`` from one pass.

    Example::

        >>> norm = LayerNorm(64, rngs=nnx.Rngs(0))
        >>> nnx.update(norm, nnx.state(nnx.LayerNorm(64, rngs=nnx.Rngs(0))))  # flax's parameters load
        >>> norm(jnp.ones((2, 64))).shape
        (2, 64)
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Optional[Any] = None,
                 param_dtype: Any = jnp.float32, use_bias: bool = True, use_scale: bool = True,
                 bias_init=nnx.initializers.zeros, scale_init=nnx.initializers.ones, reduction_axes=-1,
                 feature_axes=-1, axis_name=None, rngs: nnx.Rngs) -> None:
        _check_axes(reduction_axes, feature_axes, axis_name)
        self.num_features = num_features
        self.epsilon = epsilon
        self.dtype = dtype
        self.scale = nnx.Param(scale_init(rngs.params(), (num_features,), param_dtype)) if use_scale else None
        self.bias = nnx.Param(bias_init(rngs.params(), (num_features,), param_dtype)) if use_bias else None

    def __call__(self, x: jax.Array, residual: Optional[jax.Array] = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        scale = None if self.scale is None else self.scale[...]
        bias = None if self.bias is None else self.bias[...]
        dtype = _out_dtype(self.dtype, x, *[p for p in (scale, bias) if p is not None])
        x = x.astype(dtype)
        residual = None if residual is None else residual.astype(dtype)
        return layer_norm(x, scale, bias, eps=self.epsilon, residual=residual)
