"""Fused RMSNorm / LayerNorm for PyTorch: ``torch.library`` custom ops with fake kernels and autograd.

Two ops carry the whole family, ``flashbridge::norm_fwd`` and ``flashbridge::norm_bwd``; the public
functions below only check arguments and pick the flags.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core_kernels._plan import check_real
from ..core_kernels.norms.plan import check_norm_args, plan_norm_bwd, plan_norm_fwd
from ._checks import check_seed, check_tensors, once_per_signature, seed_tensor
from ._ops import fused_op, vmapped_at
from ._runtime import dtype_name, execute, memoised, target_for

# validation and plans run once per distinct argument signature (see memoised)
check_norm_args, plan_norm_fwd, plan_norm_bwd = map(memoised, (check_norm_args, plan_norm_fwd, plan_norm_bwd))


@fused_op("norm_fwd", replay=True)
def _norm_fwd(
    x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
    post_residual: Optional[Tensor], seed: Optional[Tensor], eps: float, is_rms: bool, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols
    plan = plan_norm_fwd(
        n_rows, n_cols, x_dtype=dtype_name(x.dtype),
        residual_dtype=None if residual is None else dtype_name(residual.dtype), is_rms=is_rms,
        has_weight=weight is not None, has_bias=bias is not None,
        has_post_residual=post_residual is not None, dropout_p=dropout_p, eps=eps,
        target=target_for(x.device))
    rows = {"x": x, "weight": weight, "bias": bias, "residual": residual, "post_residual": post_residual,
            "seed": seed}
    y, h, mean, rstd = execute(plan, {k: v.contiguous() for k, v in rows.items() if v is not None})
    return y.view(x.shape), (h.view(x.shape) if residual is not None else h), mean, rstd


@_norm_fwd.register_fake
def _(x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p):
    n_rows = x.numel() // x.shape[-1]
    h = x.new_empty(x.shape, dtype=residual.dtype) if residual is not None else x.new_empty((0,))
    mean = x.new_empty((0,) if is_rms else (n_rows,), dtype=torch.float32)
    return x.new_empty(x.shape), h, mean, x.new_empty((n_rows,), dtype=torch.float32)


@_norm_fwd.register_vmap
def _(batch, in_dims, x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p):
    # The vmapped dimension becomes one more row dimension. Vmapped parameters, and dropout (whose mask
    # follows an element's flat index: folding would change the masks), run once per element instead.
    if any(d is not None for d in in_dims[1:3] + in_dims[5:]) or dropout_p > 0:
        return None
    x, residual, post_residual = (vmapped_at(t, d, batch) for t, d in zip(
        (x, residual, post_residual), (in_dims[0], in_dims[3], in_dims[4])))
    y, h, mean, rstd = _norm_fwd.overload(x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p)
    mean, mean_dim = (mean, None) if is_rms else (mean.view(batch, -1), 0)
    return (y, h, mean, rstd.view(batch, -1)), (0, 0 if residual is not None else None, mean_dim, 0)


@fused_op("norm_bwd", replay=True)
def _norm_bwd(
    dy: Tensor, h: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor, rstd: Tensor,
    seed: Optional[Tensor], dh: Optional[Tensor], is_rms: bool, dropout_p: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dh_total, dweight, dbias); dweight / dbias are empty when the parameter is absent."""
    n_cols = h.shape[-1]
    n_rows = h.numel() // n_cols
    plan = plan_norm_bwd(
        n_rows, n_cols, dx_dtype=dtype_name(dy.dtype),
        weight_dtype=None if weight is None else dtype_name(weight.dtype),
        bias_dtype=None if bias is None else dtype_name(bias.dtype), is_rms=is_rms,
        has_dh=dh is not None, dropout_p=dropout_p, target=target_for(h.device))
    given = {"dy": dy, "h": h, "weight": weight, "mean": mean, "rstd": rstd, "seed": seed, "dh": dh}
    results = list(execute(plan, {k: v.contiguous() for k, v in given.items() if v is not None}))
    dx = results.pop(0).view(h.shape)
    dweight = results.pop(0) if weight is not None else h.new_empty((0,))
    dbias = results.pop(0) if bias is not None else h.new_empty((0,))
    return dx, dweight, dbias


@_norm_bwd.register_fake
def _(dy, h, weight, bias, mean, rstd, seed, dh, is_rms, dropout_p):
    dweight = weight.new_empty(weight.shape) if weight is not None else h.new_empty((0,))
    dbias = bias.new_empty(bias.shape) if bias is not None else h.new_empty((0,))
    return dy.new_empty(h.shape), dweight, dbias


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, post_residual, seed, eps, is_rms, dropout_p = inputs
    y, h, mean, rstd = output
    ctx.save_for_backward(x if residual is None else h, weight, bias, mean, rstd, seed)
    ctx.flags = (is_rms, dropout_p, residual is not None, post_residual is not None)
    ctx.dtypes = (x.dtype, None if residual is None else residual.dtype,
                  None if post_residual is None else post_residual.dtype)


def _backward(ctx, dy, dh, dmean, drstd):
    h, weight, bias, mean, rstd, seed = ctx.saved_tensors
    is_rms, dropout_p, has_res, has_post_res = ctx.flags
    x_dtype, res_dtype, post_dtype = ctx.dtypes
    if dy is None:
        dy = torch.zeros(h.shape, dtype=x_dtype, device=h.device)
    # dx does not depend on the bias: without a bias gradient wanted, its column sums are skipped
    bias_grad = bias if ctx.needs_input_grad[2] else None
    dx, dweight, dbias = _norm_bwd(dy.to(x_dtype), h, weight, bias_grad, mean, rstd, seed,
                                   dh if has_res else None, is_rms, dropout_p)
    return (dx, dweight if weight is not None else None, dbias if bias_grad is not None else None,
            dx.to(res_dtype) if has_res else None, dy.to(post_dtype) if has_post_res else None,
            None, None, None, None)


_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


@once_per_signature
def _check_norm_call(x, weight, bias, residual, post_residual, eps, dropout_p) -> None:
    # post_residual is layer_norm_dropout_residual's ``residual``: checks name it so
    check_tensors({"x": x, "weight": weight, "bias": bias, "residual": residual if post_residual is None
                   else post_residual}, required=("x",))
    tensors = {"x": x, "weight": weight, "bias": bias, "residual": residual, "post_residual": post_residual}
    check_norm_args(**{k: None if t is None else (tuple(t.shape), dtype_name(t.dtype))
                       for k, t in tensors.items()}, eps=eps, dropout_p=dropout_p)


def _fused_norm(x, weight, bias, residual, post_residual, seed, *, eps, is_rms, dropout_p):
    # float64 parameters (any float dtype is accepted): the kernels compute in float32 anyway; autograd
    # returns their gradient in float64 through the cast
    if isinstance(weight, Tensor) and weight.dtype == torch.float64:
        weight = weight.float()
    if isinstance(bias, Tensor) and bias.dtype == torch.float64:
        bias = bias.float()
    _check_norm_call(x, weight, bias, residual, post_residual, eps, dropout_p)
    y, h, _, _ = _norm_fwd(x, weight, bias, residual, post_residual, seed, float(eps), is_rms, float(dropout_p))
    return y if residual is None else (y, h)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, *, eps: float = 1e-6,
             residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dimension: ``y = h / sqrt(mean(h**2) + eps) * weight`` with ``h = x (+ residual)``.

    Args:
        x: ``(..., N)`` float32 / float16 / bfloat16, on a CUDA device or on the CPU (Triton interpreter);
            ``1 <= N <= 65536``.
        weight: optional ``(N,)`` scale, any float dtype (float64 is applied in float32).
        eps: added to the mean square, > 0.
        residual: optional ``(..., N)`` tensor (x's dtype or float32) added to x in the same pass.

    Returns:
        ``y`` ``(..., N)`` in x's dtype; with ``residual``, the pair ``(y, h)`` where ``h = x + residual``
        (in residual's dtype) is the new residual stream of a pre-norm transformer block.

    Example::

        >>> x = torch.randn(4, 64)
        >>> y = rms_norm(x, torch.ones(64))
        >>> y.shape
        torch.Size([4, 64])
    """
    return _fused_norm(x, weight, None, residual, None, None, eps=eps, is_rms=True, dropout_p=0.0)


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
               eps: float = 1e-5, residual: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm over the last dimension: ``y = (h - mean) / sqrt(var + eps) * weight + bias``, ``h = x (+ residual)``.

    Statistics are computed in float32 in one pass over the row (parallel Welford merge).

    Args:
        x: ``(..., N)`` float32 / float16 / bfloat16, ``1 <= N <= 65536``.
        weight, bias: optional ``(N,)`` affine parameters.
        eps: added to the variance, > 0.
        residual: optional ``(..., N)``; returns ``(y, h)`` with ``h = x + residual`` when given.

    Example::

        >>> x = torch.randn(2, 3, 32)
        >>> layer_norm(x, torch.ones(32), torch.zeros(32)).shape
        torch.Size([2, 3, 32])
    """
    return _fused_norm(x, weight, bias, residual, None, None, eps=eps, is_rms=False, dropout_p=0.0)


def layer_norm_dropout_residual(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                                residual: Tensor, *, dropout_p: float = 0.0, seed: int | Tensor = 0,
                                eps: float = 1e-5) -> Tensor:
    """``y = dropout(layer_norm(x) * weight + bias) + residual`` in one pass.

    The dropout mask comes from a counter-based RNG (Philox) keyed by ``seed`` and the element's flat
    index, so the same seed gives the same mask here, in ``flashbridge.jax_api`` and in the backward,
    which regenerates the mask instead of storing it.

    Args:
        x, residual: ``(..., N)``; residual in x's dtype or float32.
        weight, bias: optional ``(N,)``.
        dropout_p: probability of dropping an element, in [0, 1); kept elements are scaled by 1/(1-p).
        seed: a Python int or an int32 tensor of one element (a tensor avoids recompiles under
            torch.compile when the seed changes every step).
        eps: added to the variance, > 0.

    Example::

        >>> x, r = torch.randn(8, 16), torch.randn(8, 16)
        >>> y = layer_norm_dropout_residual(x, None, None, r, dropout_p=0.1, seed=1234)
    """
    if residual is None:
        raise ValueError("residual: layer_norm_dropout_residual needs a residual tensor, got None")
    check_real("dropout_p", dropout_p)
    check_seed(seed)
    seed_t = seed_tensor(seed, x.device) if isinstance(x, Tensor) and dropout_p > 0 else None
    return _fused_norm(x, weight, bias, None, residual, seed_t, eps=eps, is_rms=False, dropout_p=dropout_p)
