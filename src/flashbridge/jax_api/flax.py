"""Flax NNX modules over flashbridge's kernels: drop-ins with flax.nnx's constructor arguments and
parameter names, so their states load into each other."""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.linear import default_kernel_init

from .norms import layer_norm, rms_norm
from .swiglu import swiglu


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


class SwiGLUMLP(nnx.Module):
    """The gated MLP of Llama-style blocks, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, on
    ``flax.nnx.Linear`` projections with flashbridge's SwiGLU kernel between them (the counterpart of
    :class:`flashbridge.torch_api.SwiGLUMLP`, same submodule names). ``fused=True``: one ``gate_up_proj`` of
    width 2 * intermediate_size, gate first. ``dtype`` / ``param_dtype`` / initialisers as nnx.Linear's.

    Example::

        >>> mlp = SwiGLUMLP(64, 176, rngs=nnx.Rngs(0))
        >>> mlp(jnp.ones((2, 5, 64))).shape
        (2, 5, 64)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias: bool = False, fused: bool = False,
                 dtype: Optional[Any] = None, param_dtype: Any = jnp.float32,
                 kernel_init=default_kernel_init, bias_init=nnx.initializers.zeros,
                 rngs: nnx.Rngs) -> None:
        self.fused = fused

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                              kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)

        if fused:
            self.gate_up_proj = linear(hidden_size, 2 * intermediate_size)
        else:
            self.gate_proj = linear(hidden_size, intermediate_size)
            self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fused:
            return self.down_proj(swiglu(self.gate_up_proj(x)))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
