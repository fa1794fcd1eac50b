"""Fused RMSNorm / LayerNorm for JAX: ``jax.custom_vjp`` ops whose kernel calls carry ``custom_vmap`` rules.

The same two kernels as the torch front-end (``norm_fwd_kernel`` / ``norm_bwd_kernel``); jit, grad, vmap
and shard_map all work. Under vmap the forward folds the mapped axis into the rows (one launch); the
backward maps sequentially when it must return per-example weight gradients.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from ..core_kernels._plan import check_real
from ..core_kernels.norms.plan import check_norm_args, plan_norm_bwd, plan_norm_fwd
from ._checks import as_seed, check_arrays, check_seed, seed_argument
from ..core_kernels._plan import memoised
from ._runtime import dtype_name, execute, jit_op, match_varying

Array = jax.Array

# validation and plans run once per distinct argument signature (see memoised)
check_norm_args, plan_norm_fwd, plan_norm_bwd = map(memoised, (check_norm_args, plan_norm_fwd, plan_norm_bwd))


def _name(a) -> Optional[str]:
    return None if a is None else dtype_name(a.dtype)


# ----------------------------------------------------------------------------------------------- kernels

def _norm_fwd_call(x, weight, bias, residual, post_residual, seed, *, eps, is_rms, dropout_p):
    n_cols = x.shape[-1]
    n_rows = x.size // n_cols

    def make_plan(target):
        return plan_norm_fwd(
            n_rows, n_cols, x_dtype=_name(x), residual_dtype=_name(residual), is_rms=is_rms,
            has_weight=weight is not None, has_bias=bias is not None,
            has_post_residual=post_residual is not None, dropout_p=dropout_p, eps=eps, target=target)

    rows = {"x": x, "weight": weight, "bias": bias, "residual": residual, "post_residual": post_residual,
            "seed": seed}
    y, h, mean, rstd = execute(make_plan, {k: v for k, v in rows.items() if v is not None})
    return y.reshape(x.shape), (h.reshape(x.shape) if residual is not None else h), mean, rstd


def _norm_bwd_call(dy, h, weight, bias, mean, rstd, seed, dh, *, is_rms, dropout_p):
    n_cols = h.shape[-1]
    n_rows = h.size // n_cols

    def make_plan(target):
        return plan_norm_bwd(
            n_rows, n_cols, dx_dtype=_name(dy), weight_dtype=_name(weight), bias_dtype=_name(bias),
            is_rms=is_rms, has_dh=dh is not None, dropout_p=dropout_p, target=target)

    given = {"dy": dy, "h": h, "weight": weight, "mean": mean, "rstd": rstd, "seed": seed, "dh": dh}
    results = list(execute(make_plan, {k: v for k, v in given.items() if v is not None}))
    dx = results.pop(0).reshape(h.shape)
    dweight = results.pop(0) if weight is not None else None
    dbias = results.pop(0) if bias is not None else None
    return dx, dweight, dbias


def _is_batched(flag) -> bool:
    return any(jax.tree_util.tree_leaves(flag))


def _broadcast_batched(axis_size, args, in_batched):
    """Give every array in ``args`` a leading batch axis (custom_vmap puts mapped axes first)."""
    return [a if a is None or b else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched)]


@functools.lru_cache(maxsize=None)
def _fwd_op(eps: float, is_rms: bool, dropout_p: float):
    call = functools.partial(_norm_fwd_call, eps=eps, is_rms=is_rms, dropout_p=dropout_p)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, x, weight, bias, residual, post_residual, seed):
        if _is_batched(in_batched[1]) or _is_batched(in_batched[2]) or _is_batched(in_batched[5]):
            # Per-example parameters or seeds: one launch per example.
            outs = jax.lax.map(lambda a: call(*a), tuple(_broadcast_batched(
                axis_size, [x, weight, bias, residual, post_residual, seed], in_batched)))
            return outs, (True, residual is not None, not is_rms, True)
        x, residual, post_residual = _broadcast_batched(
            axis_size, [x, residual, post_residual], [in_batched[0], in_batched[3], in_batched[4]])
        y, h, mean, rstd = call(x, weight, bias, residual, post_residual, seed)
        mean = mean if is_rms else mean.reshape(axis_size, -1)
        return (y, h, mean, rstd.reshape(axis_size, -1)), (True, residual is not None, not is_rms, True)

    return op


@functools.lru_cache(maxsize=None)
def _bwd_op(is_rms: bool, dropout_p: float, has_weight: bool, has_bias: bool):
    call = functools.partial(_norm_bwd_call, is_rms=is_rms, dropout_p=dropout_p)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, dy, h, weight, bias, mean, rstd, seed, dh):
        args = _broadcast_batched(axis_size, [dy, h, weight, bias, mean, rstd, seed, dh], in_batched)
        if not (has_weight or has_bias) and not _is_batched(in_batched[6]):
            # Only dx is needed and it is row-local: fold the mapped axis into the rows.
            dy, h, _, _, mean, rstd, _, dh = args
            dx, _, _ = call(dy, h, weight, bias, mean.reshape(-1) if mean.size else mean, rstd.reshape(-1),
                            seed, dh)
            return (dx, None, None), (True, None, None)
        # Per-example dweight / dbias: one launch per example.
        outs = jax.lax.map(lambda a: call(*a), tuple(args))
        return outs, (True, True if has_weight else None, True if has_bias else None)

    return op


# ------------------------------------------------------------------------------------ differentiable op

@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fused_norm(x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p):
    return _fwd_op(eps, is_rms, dropout_p)(x, weight, bias, residual, post_residual, seed)


def _fused_norm_fwd(x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p):
    # symbolic_zeros: the array arguments arrive as CustomVJPPrimal(value, perturbed). A bias that is not
    # differentiated (a frozen or closed-over parameter) is not saved, so the backward skips its dbias
    # reduction, as the torch op does through ctx.needs_input_grad.
    bias_needed = bias is not None and bias.perturbed
    x, weight, bias, residual, post_residual, seed = (
        None if a is None else a.value for a in (x, weight, bias, residual, post_residual, seed))
    out = _fwd_op(eps, is_rms, dropout_p)(x, weight, bias, residual, post_residual, seed)
    _, h, mean, rstd = out
    # Zero-size arrays carry the residuals' dtypes (custom_vjp residuals must be arrays).
    dtypes = tuple(None if a is None else jnp.zeros((0,), a.dtype) for a in (residual, post_residual))
    return out, (x if residual is None else h, weight, bias if bias_needed else None, mean, rstd, seed, dtypes)


def _is_zero(cotangent) -> bool:
    """A symbolic-zero cotangent: the output is not used by the differentiated function."""
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _fused_norm_bwd(eps, is_rms, dropout_p, saved, cotangents):
    h, weight, bias, mean, rstd, seed, (res_tag, post_tag) = saved
    dy, dh, _, _ = cotangents
    has_res = res_tag is not None
    if _is_zero(dy):  # only h was used: the kernel needs a dy to read (the torch op does the same)
        dy = jnp.zeros(h.shape, dy.aval.dtype)
    # an unused h contributes nothing: no dh input, so the kernel does not read a tensor of zeros (as torch,
    # whose unused-output gradients arrive as None)
    dh = None if not has_res or _is_zero(dh) else dh
    dx, dweight, dbias = _bwd_op(is_rms, dropout_p, weight is not None, bias is not None)(
        dy, h, weight, bias, mean, rstd, seed, dh)
    return (dx, dweight, dbias, dx.astype(res_tag.dtype) if has_res else None,
            dy.astype(post_tag.dtype) if post_tag is not None else None, None)


_fused_norm.defvjp(_fused_norm_fwd, _fused_norm_bwd, symbolic_zeros=True)


def _norm(x, weight, bias, residual, post_residual, seed, *, eps, is_rms, dropout_p):
    # post_residual is layer_norm_dropout_residual's ``residual``: checks name it so
    check_arrays(x=x, weight=weight, bias=bias, residual=residual if post_residual is None else post_residual)
    # float64 parameters (with jax_enable_x64; any float dtype is accepted): computed in float32, the cast
    # returns their gradient in float64
    weight, bias = (a.astype(jnp.float32) if a is not None and a.dtype == jnp.float64 else a for a in (weight, bias))
    tensors = {"x": x, "weight": weight, "bias": bias, "residual": residual, "post_residual": post_residual}
    check_norm_args(**{k: None if a is None else (tuple(a.shape), dtype_name(a.dtype))
                       for k, a in tensors.items()}, eps=eps, dropout_p=dropout_p)
    return _norm_op(x, weight, bias, residual, post_residual, seed, eps=float(eps), is_rms=bool(is_rms),
                    dropout_p=float(dropout_p))


@jit_op("eps", "is_rms", "dropout_p")
def _norm_op(x, weight, bias, residual, post_residual, seed, *, eps, is_rms, dropout_p):
    """``seed``: None, or an integer array (made the kernels' int32 (1,) here: see seed_argument)."""
    seed = None if seed is None else as_seed(seed)
    x, weight, bias, residual, post_residual, seed = match_varying(x, weight, bias, residual, post_residual, seed)
    y, h, _, _ = _fused_norm(x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p)
    return y if residual is None else (y, h)


def rms_norm(x: Array, weight: Optional[Array] = None, *, eps: float = 1e-6,
             residual: Optional[Array] = None) -> Array | tuple[Array, Array]:
    """RMSNorm over the last axis: ``y = h / sqrt(mean(h**2) + eps) * weight`` with ``h = x (+ residual)``.

    Args:
        x: ``(..., N)`` float32 / float16 / bfloat16, ``1 <= N <= 65536``.
        weight: optional ``(N,)`` scale, any float dtype (float64 is applied in float32).
        eps: added to the mean square, > 0.
        residual: optional ``(..., N)`` (x's dtype or float32), added to x in the same pass.

    Returns:
        ``y`` in x's dtype; with ``residual`` the pair ``(y, h)``, ``h = x + residual`` in residual's dtype.

    Example::

        >>> y = rms_norm(jnp.ones((4, 64)), jnp.ones(64))
    """
    return _norm(x, weight, None, residual, None, None, eps=eps, is_rms=True, dropout_p=0.0)


def layer_norm(x: Array, weight: Optional[Array] = None, bias: Optional[Array] = None, *, eps: float = 1e-5,
               residual: Optional[Array] = None) -> Array | tuple[Array, Array]:
    """LayerNorm over the last axis: ``y = (h - mean) / sqrt(var + eps) * weight + bias``, ``h = x (+ residual)``.

    Statistics in float32, one pass over the row (parallel Welford merge).

    Example::

        >>> y = layer_norm(jnp.ones((2, 3, 32)), jnp.ones(32), jnp.zeros(32))
    """
    return _norm(x, weight, bias, residual, None, None, eps=eps, is_rms=False, dropout_p=0.0)


def layer_norm_dropout_residual(x: Array, weight: Optional[Array], bias: Optional[Array], residual: Array, *,
                                dropout_p: float = 0.0, seed: int | Array = 0, eps: float = 1e-5) -> Array:
    """``y = dropout(layer_norm(x) * weight + bias) + residual`` in one pass.

    The dropout mask is Philox keyed by ``seed`` (a Python int or an integer array of one element, which
    may be traced) and the element's flat index: the same seed gives the same mask as
    ``flashbridge.torch_api.layer_norm_dropout_residual``, and the backward regenerates it.

    Example::

        >>> y = layer_norm_dropout_residual(jnp.ones((8, 16)), None, None, jnp.ones((8, 16)),
        ...                                 dropout_p=0.1, seed=1234)
    """
    if residual is None:
        raise ValueError("residual: layer_norm_dropout_residual needs a residual array, got None")
    check_real("dropout_p", dropout_p)
    check_seed(seed)
    return _norm(x, weight, bias, None, residual, seed_argument(seed) if dropout_p > 0 else None, eps=eps,
                 is_rms=False, dropout_p=dropout_p)
