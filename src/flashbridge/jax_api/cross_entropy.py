"""Fused cross-entropy for JAX: the logits-level ``cross_entropy`` and the chunked ``linear_cross_entropy``
that never holds the ``(N, V)`` logits, plus :func:`linear_cross_entropy_from_layer` for a Flax
``nnx.Linear`` head or a tied ``nnx.Embed``.

The same kernels and the same design as ``flashbridge.torch_api.cross_entropy`` (whose docstring explains
the trade-off): two passes, token chunks walked by ``lax.scan`` (plus one tail chunk) for the loss, lse
and ``dh``, then static vocabulary slices for ``dW`` / ``db`` written into ``dW`` by dynamic-update-slice;
the logits from ``jnp`` matmuls (cuBLAS through XLA, input dtype, fp32 accumulation; ``Precision.HIGHEST``
for float32), lse / loss / dlogits from our kernels. XLA's matmul cannot write into an output as the torch
path's ``torch.mm(out=...)`` does, so pass 1's chunks of H tokens get their logits from our own GEMM kernel,
written into dW's storage (see :func:`_pass1`); leftover tokens take small chunks. ``jax.custom_vjp``: under
``jax.grad`` with reduction "mean" / "sum" the gradients are computed in the forward pass and scaled by the
cotangent in the backward; with "none" the backward recomputes the logits from the saved fp32 lse. Every
kernel call is a ``jax.custom_batching.custom_vmap`` function whose rule folds the mapped axis into the
rows, so ``jax.vmap`` works (and nests). Labels outside ``[0, V)`` other than ``ignore_index`` raise a
ValueError when the labels are concrete (outside ``jit``); traced labels cannot be inspected, so such a row
gets a NaN loss and NaN gradients instead. The lse returned with ``return_lse`` is a constant (``stop_gradient``).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..core_kernels import INTERPRETER
from ..core_kernels.cross_entropy.plan import (
    bad_label_message, check_cross_entropy_args, check_linear_cross_entropy_args, choose_slice_cols,
    plan_ce_fwd, plan_ce_fwd_grad, plan_ce_grad, plan_linear_logits)
from ._checks import check_arrays
from ._runtime import dtype_name, execute, gpu_target, match_varying

Array = jax.Array
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Opts:
    ignore_index: int
    label_smoothing: float
    z_loss: float
    logit_softcap: float

    def kwargs(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------- kernels

def _broadcast_batched(axis_size, args, in_batched):
    return [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]


def _fold(axis_size, in_batched, *args):
    """custom_vmap puts the mapped axis first: broadcast the unbatched arguments and merge it into the rows."""
    args = _broadcast_batched(axis_size, args, [any(jax.tree_util.tree_leaves(b)) for b in in_batched])
    return [a.reshape(-1, *a.shape[2:]) for a in args]


def _fwd_call(logits, labels, *, opts: _Opts):
    n_rows, vocab = logits.shape
    return execute(lambda target: plan_ce_fwd(n_rows, vocab, **opts.kwargs(), target=target),
                   {"logits": logits, "labels": labels})


def _grad_call(logits, labels, lse, lse_lo, weight, *, opts: _Opts, col0: int = 0, vocab_all=None,
               in_place: bool = False):
    """The logits' gradient; ``logits`` may be columns ``col0 ..`` of a ``vocab_all``-wide vocabulary (lse and
    labels of the whole rows). ``in_place``: the gradient takes over the logits' buffer, as in
    :func:`_fwd_grad_call` (for logits that are dead after the call; XLA would copy live ones first)."""
    n_rows, vocab = logits.shape
    (grad,) = execute(lambda target: plan_ce_grad(n_rows, vocab, grad_dtype=dtype_name(logits.dtype),
                                                  per_row_weight=True, **opts.kwargs(), target=target,
                                                  col0=col0, vocab_all=vocab_all),
                      {"logits": logits, "labels": labels, "lse": lse, "lse_lo": lse_lo, "weight": weight},
                      aliases={"grad": "logits"} if in_place else None)
    return grad


def _fwd_grad_call(logits, labels, weight, *, opts: _Opts):
    n_rows, vocab = logits.shape
    # the gradient takes over the logits' buffer (as in the torch path): the linear op's chunk logits are
    # dead after this call, so XLA holds one (C, V) buffer per chunk instead of two
    return execute(lambda target: plan_ce_fwd_grad(n_rows, vocab, grad_dtype=dtype_name(logits.dtype),
                                                   per_row_weight=True, **opts.kwargs(), target=target),
                   {"logits": logits, "labels": labels, "weight": weight}, aliases={"grad": "logits"})


def _row_op(call, n_out: int):
    """A custom_vmap op over row-wise arrays: the mapped axis is folded into the rows (one launch)."""
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        outs = op(*_fold(axis_size, in_batched, *args))  # op, not call: nested vmaps fold again
        outs = tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs)
        return outs, (True,) * n_out

    return op


@functools.lru_cache(maxsize=None)
def _fwd_op(opts: _Opts):
    return _row_op(functools.partial(_fwd_call, opts=opts), 3)


@functools.lru_cache(maxsize=None)
def _grad_op(opts: _Opts, col0: int = 0, vocab_all=None, in_place: bool = False):
    op = _row_op(lambda *a: (_grad_call(*a, opts=opts, col0=col0, vocab_all=vocab_all, in_place=in_place),), 1)
    return lambda *a: op(*a)[0]


@functools.lru_cache(maxsize=None)
def _fwd_grad_op(opts: _Opts):
    return _row_op(functools.partial(_fwd_grad_call, opts=opts), 4)


def _label_cotangent(labels):
    return np.zeros(labels.shape, dtype=jax.dtypes.float0)


# ---------------------------------------------------------------------------------- logits-level vjp

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _ce(logits, labels, opts: _Opts):
    loss, lse, _ = _fwd_op(opts)(logits, labels)
    return loss, lse


def _ce_fwd(logits, labels, opts):
    loss, lse, lse_lo = _fwd_op(opts)(logits, labels)
    return (loss, lse), (logits, labels, lse, lse_lo)


def _ce_bwd(opts, saved, cotangents):
    logits, labels, lse, lse_lo = saved
    dloss, _ = cotangents
    grad = _grad_op(opts)(logits, labels, lse, lse_lo, dloss.astype(F32))
    return grad, _label_cotangent(labels)


_ce.defvjp(_ce_fwd, _ce_bwd)


# ---------------------------------------------------------------------------------------- linear vjp

@dataclasses.dataclass(frozen=True)
class _LinearCfg:
    opts: _Opts
    reduction: str
    chunk: int  # pass 1's tokens per chunk with logits of their own (and the forward-only pass's)
    slice_cols: int  # pass 2's vocabulary columns per slice
    transposed: bool  # weight is (H, V) (a Flax nnx.Linear kernel) instead of (V, H)
    in_dw: bool  # pass 1 takes chunks of H tokens whose logits live in dW's storage (see _pass1)


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, contract_a: int, contract_b: int):
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), precision=_precision(a.dtype),
                               preferred_element_type=a.dtype)


def _chunk_logits(h_c, weight, bias, transposed):
    x = _dot(h_c, weight, 1, 0 if transposed else 1)  # (C, V)
    return x if bias is None else x + bias


def _scan_chunks(step, carry, row_arrays, chunk: int):
    """Run ``step(carry, rows) -> (carry, outs)`` over chunks of ``chunk`` rows: ``lax.scan`` over the
    full chunks, one more call for the tail; the per-row outputs are concatenated back."""
    n_rows = row_arrays[0].shape[0]
    n_full, tail = divmod(n_rows, chunk)
    parts = []
    if n_full:
        xs = tuple(a[:n_full * chunk].reshape(n_full, chunk, *a.shape[1:]) for a in row_arrays)
        carry, ys = jax.lax.scan(step, carry, xs)
        parts.append(tuple(y.reshape(n_full * chunk, *y.shape[2:]) for y in ys))
    if tail:
        carry, ys = step(carry, tuple(a[n_full * chunk:] for a in row_arrays))
        parts.append(ys)
    outs = parts[0] if len(parts) == 1 else tuple(jnp.concatenate(p, axis=0) for p in zip(*parts))
    return carry, outs


def _reduce(loss_rows, labels, ignore_index, reduction):
    if reduction == "none":
        return loss_rows
    total = jnp.sum(loss_rows)
    if reduction == "sum":
        return total
    return total / jnp.maximum(jnp.sum(labels != ignore_index), 1).astype(F32)


def _lce_forward(hidden, weight, labels, bias, cfg: _LinearCfg):
    def step(carry, rows):
        h_c, y_c = rows
        return carry, _fwd_op(cfg.opts)(_chunk_logits(h_c, weight, bias, cfg.transposed), y_c)

    _, (loss_rows, lse, lse_lo) = _scan_chunks(step, None, (hidden, labels), cfg.chunk)
    return loss_rows, lse, lse_lo


@functools.lru_cache(maxsize=None)
def _logits_op(transposed: bool, has_bias: bool):
    """``hidden (H, Hd) @ W^T (+ bias)`` written by our kernel into ``buffer``'s storage, shaped like W (H x V
    elements: a chunk of exactly H tokens fills it), which the result takes over. custom_vmap: under jax.vmap
    the XLA matmul per example, reshaped alike (one buffer per example either way)."""
    def call(hidden, weight, buffer, *bias):
        n_rows, hd = hidden.shape
        vocab = weight.shape[1] if transposed else weight.shape[0]
        inputs = {"hidden": hidden, "weight": weight, "buffer": buffer, **({"bias": bias[0]} if has_bias else {})}
        (out,) = execute(lambda target: plan_linear_logits(
            n_rows, vocab, hd, dtype=dtype_name(hidden.dtype), weight_transposed=transposed, has_bias=has_bias,
            out_shape=tuple(buffer.shape), target=target), inputs, aliases={"out": "buffer"})
        return out

    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, hidden, weight, buffer, *bias):
        hidden, weight, buffer, *bias = _broadcast_batched(axis_size, [hidden, weight, buffer, *bias],
                                                           [bool(b) for b in in_batched])
        logits = jax.vmap(lambda h, w, *b: _chunk_logits(h, w, b[0] if b else None, transposed))(hidden, weight,
                                                                                               *bias)
        return logits.reshape(buffer.shape).astype(buffer.dtype), True

    return op


def _pass1(hidden, weight, labels, bias, row_weights, cfg: _LinearCfg, lse=None, lse_lo=None):
    """Token chunks over the whole vocabulary: the logits, (forward, when ``lse`` is None) the loss, lse and
    lse_lo, their gradient (over the logits' buffer) and ``dh[chunk] = dlogits @ W`` in one GEMM.

    With ``cfg.in_dw``, chunks of exactly H tokens (H x V logits: dW's size) have their logits written by
    our kernel into one dW-shaped buffer that each chunk takes over in turn and pass 2 then overwrites with
    dW, as the torch op uses dW's storage: no logits of their own, so chunks as large as torch's at no
    memory (XLA's matmul would return a new array per chunk); the remaining tokens take ``cfg.chunk``-token
    chunks with logits of their own. Returns ((loss_rows, lse, lse_lo, dh) in the forward, else (dh,)) and
    the buffer (None when no chunk used it).

    The per-row operands and results of our kernels pass through optimization barriers, which XLA removes
    only after its fusion passes: its dynamic-slice fusion would otherwise wrap each kernel call with the
    chunk's slices of its operands and the scan's stacking of its results. In the H200's HLO that cloned
    the forward kernel into such a fusion (a second read of the logits per chunk, scheduled after the
    gradient, so the in-place gradient had to work on a copy: 63 MiB per 256-token chunk), and copied the
    whole dW-sized buffer before each in-dW logits kernel (1 GB)."""
    forward = lse is None
    hd = hidden.shape[1]

    def chunk_grads(logits, y_c, w_c, *saved):
        if forward:
            loss_c, lse_c, grad, lo_c = _fwd_grad_op(cfg.opts)(logits, y_c, w_c)
            outs = jax.lax.optimization_barrier((loss_c, lse_c, lo_c))
        else:
            grad, outs = _grad_op(cfg.opts, in_place=True)(logits, y_c, *saved, w_c), ()
        return grad, (*outs, _dot(grad, weight, 1, 1 if cfg.transposed else 0))

    def step(carry, rows):
        logits = _chunk_logits(rows[0], weight, bias, cfg.transposed)
        return carry, chunk_grads(logits, *jax.lax.optimization_barrier(rows[1:]))[1]

    rows = (hidden, labels, row_weights) + (() if forward else (lse, lse_lo))
    n_big = hidden.shape[0] // hd if cfg.in_dw else 0
    if n_big == 0:
        return _scan_chunks(step, None, rows, cfg.chunk)[1], None
    bias_args = () if bias is None else (bias,)

    def big_step(buffer, rows_c):
        rows_c = jax.lax.optimization_barrier(rows_c)  # the hidden chunk feeds our logits kernel too
        out = _logits_op(cfg.transposed, bias is not None)(rows_c[0], weight, buffer, *bias_args)
        grad, outs = chunk_grads(out.reshape(hd, -1), *rows_c[1:])
        return grad.reshape(weight.shape), outs

    # the buffer starts as zeros (one memset of dW's size, ~0.3 ms at H200 bandwidth): every chunk then
    # takes it over inside one scan, whose stacked outputs need no concatenation when H divides N
    xs = tuple(a[:n_big * hd].reshape(n_big, hd, *a.shape[1:]) for a in rows)
    buffer, ys = jax.lax.scan(big_step, jnp.zeros_like(weight), xs)
    outs = tuple(y.reshape(n_big * hd, *y.shape[2:]) for y in ys)
    if n_big * hd < hidden.shape[0]:
        tail = _scan_chunks(step, None, tuple(a[n_big * hd:] for a in rows), cfg.chunk)[1]
        outs = tuple(jnp.concatenate(p, axis=0) for p in zip(outs, tail))
    return outs, buffer


def _pass2(hidden, weight, labels, bias, row_weights, lse, lse_lo, cfg: _LinearCfg, buffer=None):
    """Vocabulary slices over all tokens: the slice's logits again, their gradient from pass 1's lse and
    ``dW[slice] = dlogits.T @ h`` (one GEMM: dW is rounded once), ``db[slice] = colsum(dlogits)``; the
    slices are written into dW in place (a chain of dynamic-update-slices XLA keeps in one buffer): into
    pass 1's ``buffer`` when it has one (every element is overwritten).

    One slice at a time: an optimization barrier ties the next slice's input to dW as updated by this
    slice, so XLA cannot schedule the logits GEMMs of later slices before this slice's dW block is written
    (each slice in flight holds N x slice logits and a slice x H block beyond the returned gradients)."""
    vocab = weight.shape[1] if cfg.transposed else weight.shape[0]
    dw = jnp.zeros_like(weight) if buffer is None else buffer
    db = None if bias is None else jnp.zeros(bias.shape, F32)
    for c0 in range(0, vocab, cfg.slice_cols):  # static slices: the kernel takes the column offset as a scalar
        c1 = min(c0 + cfg.slice_cols, vocab)
        hidden, dw = jax.lax.optimization_barrier((hidden, dw))
        w_s = weight[:, c0:c1] if cfg.transposed else weight[c0:c1]
        logits = _chunk_logits(hidden, w_s, None if bias is None else bias[c0:c1], cfg.transposed)
        grad = _grad_op(cfg.opts, c0, vocab, True)(logits, labels, lse, lse_lo, row_weights)
        if cfg.transposed:
            dw = jax.lax.dynamic_update_slice(dw, _dot(hidden, grad, 0, 0), (0, c0))  # (H, slice)
        else:
            dw = jax.lax.dynamic_update_slice(dw, _dot(grad, hidden, 0, 0), (c0, 0))  # (slice, H)
        if db is not None:
            db = jax.lax.dynamic_update_slice(db, jnp.sum(grad, axis=0, dtype=F32), (c0,))
    return dw, db


def _lce_forward_with_grads(hidden, weight, labels, bias, cfg: _LinearCfg):
    """Loss and the gradients for an upstream gradient of 1 ("mean" / "sum"), in two passes that each finish
    a gradient in one GEMM (see the torch path's ``_two_pass_grads``)."""
    n_active = jnp.sum(labels != cfg.opts.ignore_index)
    scale = (1.0 / jnp.maximum(n_active, 1).astype(F32)) if cfg.reduction == "mean" else jnp.ones((), F32)
    w = jnp.broadcast_to(scale, labels.shape)
    (loss_rows, lse, lse_lo, dh), buffer = _pass1(hidden, weight, labels, bias, w, cfg)
    dw, db = _pass2(hidden, weight, labels, bias, w, lse, lse_lo, cfg, buffer)
    return loss_rows, lse, dh, dw, db


def _lce_recompute_grads(hidden, weight, labels, bias, lse, lse_lo, dloss, cfg: _LinearCfg):
    (dh,), buffer = _pass1(hidden, weight, labels, bias, dloss, cfg, lse, lse_lo)
    dw, db = _pass2(hidden, weight, labels, bias, dloss, lse, lse_lo, cfg, buffer)
    return dh, dw, db


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _lce(hidden, weight, labels, bias, cfg: _LinearCfg):
    loss_rows, lse, _ = _lce_forward(hidden, weight, labels, bias, cfg)
    return _reduce(loss_rows, labels, cfg.opts.ignore_index, cfg.reduction), lse


def _lce_fwd(hidden, weight, labels, bias, cfg):
    if cfg.reduction == "none":
        loss_rows, lse, lse_lo = _lce_forward(hidden, weight, labels, bias, cfg)
        return (loss_rows, lse), (hidden, weight, labels, bias, lse, lse_lo)
    loss_rows, lse, dh, dw, db = _lce_forward_with_grads(hidden, weight, labels, bias, cfg)
    loss = _reduce(loss_rows, labels, cfg.opts.ignore_index, cfg.reduction)
    return (loss, lse), (dh, dw, db, labels)


def _lce_bwd(cfg, saved, cotangents):
    dloss, _ = cotangents
    if cfg.reduction == "none":
        hidden, weight, labels, bias, lse, lse_lo = saved
        dh, dw, db = _lce_recompute_grads(hidden, weight, labels, bias, lse, lse_lo, dloss.astype(F32), cfg)
    else:
        dh, dw, db, labels = saved
        g = dloss.astype(F32)
        dh = (dh.astype(F32) * g).astype(dh.dtype)
        dw = (dw.astype(F32) * g).astype(dw.dtype)
        db = None if db is None else db * g
    return dh, dw, _label_cotangent(labels), db


_lce.defvjp(_lce_fwd, _lce_bwd)


# ---------------------------------------------------------------------------------------- public API

def _shape_dtype(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


def _validate_label_values(labels, vocab: int, ignore_index: int, validate: Optional[bool]) -> None:
    """Raise on labels outside [0, V) other than ignore_index when the labels are concrete (not traced).
    ``validate`` None checks host / CPU labels only: reading a GPU array back waits for the device."""
    if validate is False or isinstance(labels, jax.core.Tracer):
        return
    if validate is None and isinstance(labels, jax.Array) and any(d.platform != "cpu" for d in labels.devices()):
        return
    y = np.asarray(labels)
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab))
    if bad.any():
        raise ValueError(bad_label_message(int(bad.sum()), int(y[bad][0]), vocab, ignore_index))


def _pass1_chunk(n_rows: int, hidden_dim: int) -> int:
    """Tokens per chunk with logits of their own when not given: the forward-only pass (reduction "none")
    and pass 1's tokens past the last whole chunk of H (see :func:`_pass1`). Their logits take at most a
    sixteenth of the weight's size, at least 64 tokens (256 at H=4096, V=128256: 64 MB)."""
    return min(n_rows, max(64, hidden_dim // 16 // 64 * 64))  # rows * V <= V * H / 16


def _slice_cols() -> int:
    """Pass 2's vocabulary columns per slice (its logits are arrays of their own here, see
    ``choose_slice_cols``)."""
    return choose_slice_cols(gpu_target() or INTERPRETER, logits_in_dw=False)


def cross_entropy(logits: Array, labels: Array, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, logit_softcap: float = 0.0, reduction: str = "mean",
                  return_lse: bool = False, validate_labels: Optional[bool] = None) -> Array | tuple[Array, Array]:
    """Fused softmax cross-entropy: ``loss_i = (1-s)(lse_i - z_iy) + s(lse_i - mean_j z_ij) + z_loss*lse_i^2``, ``z = cap*tanh(x/cap)``.

    Args:
        logits: ``(..., V)`` float32 / float16 / bfloat16.
        labels: ``(...)`` int32 / int64 in ``[0, V)`` or ``ignore_index``.
        ignore_index: label of rows that contribute nothing (no loss, zero gradient).
        label_smoothing: ``s`` in [0, 1) (as ``torch.nn.functional.cross_entropy``).
        z_loss: coefficient of the PaLM auxiliary loss ``lse^2`` (0 = off).
        logit_softcap: ``cap > 0`` applies ``cap * tanh(x / cap)`` before the softmax (0 = off).
        reduction: "mean" (over non-ignored rows; 0 with zero gradients when all are ignored), "sum",
            "none".
        return_lse: also return the float32 ``(...)`` log-sum-exp (a constant for autodiff).
        validate_labels: True raises a ValueError naming ``labels`` when concrete labels (outside
            ``jit``) hold a value outside ``[0, V)`` other than ``ignore_index`` (reading them from a GPU
            waits for it); None (default) checks NumPy / CPU labels only; False never checks. Unchecked
            and traced labels are never refused: such a row gets a NaN loss and NaN gradients.

    Returns:
        The float32 loss (scalar, or ``(...)`` for "none"), and the lse with ``return_lse``.

    Example::

        >>> logits = jax.random.normal(jax.random.key(0), (4, 10))
        >>> loss, dlogits = jax.value_and_grad(cross_entropy)(logits, jnp.array([1, 2, -100, 9]))
    """
    check_arrays(logits=logits, labels=labels)
    n_rows, vocab = check_cross_entropy_args(
        logits=_shape_dtype(logits), labels=_shape_dtype(labels), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap, reduction=reduction)
    _validate_label_values(labels, vocab, ignore_index, validate_labels)
    lead = tuple(labels.shape)
    opts = _Opts(int(ignore_index), float(label_smoothing), float(z_loss), float(logit_softcap))
    x, y = match_varying(logits.reshape(n_rows, vocab), labels.reshape(n_rows))
    loss_rows, lse = _ce(x, y, opts)
    loss = _reduce(loss_rows, y, opts.ignore_index, reduction)
    loss = loss.reshape(lead) if reduction == "none" else loss
    return (loss, jax.lax.stop_gradient(lse).reshape(lead)) if return_lse else loss


def _linear_ce(hidden, weight, labels, bias, *, transposed, ignore_index, label_smoothing, z_loss,
               logit_softcap, reduction, chunk_size, return_lse, validate_labels=None):
    check_arrays(hidden=hidden, weight=weight, labels=labels, bias=bias)
    n_rows, h, vocab = check_linear_cross_entropy_args(
        hidden=_shape_dtype(hidden), weight=_shape_dtype(weight), labels=_shape_dtype(labels),
        bias=_shape_dtype(bias), ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        logit_softcap=logit_softcap, reduction=reduction, chunk_size=chunk_size, weight_transposed=transposed)
    _validate_label_values(labels, vocab, ignore_index, validate_labels)
    lead = tuple(labels.shape)
    chunk = min(int(chunk_size), n_rows) if chunk_size else _pass1_chunk(n_rows, h)
    cfg = _LinearCfg(_Opts(int(ignore_index), float(label_smoothing), float(z_loss), float(logit_softcap)),
                     reduction, chunk, _slice_cols(), bool(transposed), in_dw=not chunk_size)
    h2, w, y, b = match_varying(hidden.reshape(n_rows, h), weight, labels.reshape(n_rows), bias)
    loss, lse = _lce(h2, w, y, b, cfg)
    loss = loss.reshape(lead) if reduction == "none" else loss
    return (loss, jax.lax.stop_gradient(lse).reshape(lead)) if return_lse else loss


def linear_cross_entropy(hidden: Array, weight: Array, labels: Array, *, bias: Optional[Array] = None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                         logit_softcap: float = 0.0, reduction: str = "mean", chunk_size: Optional[int] = None,
                         return_lse: bool = False, validate_labels: Optional[bool] = None
                         ) -> Array | tuple[Array, Array]:
    """Cross-entropy of a vocabulary projection without the ``(N, V)`` logits: ``cross_entropy(hidden @ weight.T + bias, labels)``.

    Args:
        hidden: ``(..., H)`` float32 / float16 / bfloat16; every leading axis is a token axis.
        weight: ``(V, H)`` in hidden's dtype (the ``nnx.Embed`` / torch ``nn.Linear`` layout; for an
            ``nnx.Linear`` kernel ``(H, V)`` use :func:`linear_cross_entropy_from_layer`).
        labels: ``(...)`` int32 / int64, hidden's leading shape.
        bias: optional ``(V,)`` in hidden's dtype.
        ignore_index, label_smoothing, z_loss, logit_softcap, reduction, return_lse, validate_labels: as in
            :func:`cross_entropy`.
        chunk_size: tokens per chunk (static; their logits are arrays of their own). None: chunks of H tokens
            whose logits are written into the weight gradient's storage (no memory of their own), the
            remaining tokens in chunks of ``max(64, H // 16)``.

    Returns:
        The float32 loss (scalar, or ``(...)`` for "none"), and the float32 lse with ``return_lse``.

    Example::

        >>> k = jax.random.split(jax.random.key(0), 2)
        >>> h, w = jax.random.normal(k[0], (6, 32)), jax.random.normal(k[1], (1000, 32))
        >>> loss, (dh, dw) = jax.value_and_grad(linear_cross_entropy, argnums=(0, 1))(
        ...     h, w, jnp.arange(6), chunk_size=4)
    """
    return _linear_ce(hidden, weight, labels, bias, transposed=False, ignore_index=ignore_index,
                      label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap,
                      reduction=reduction, chunk_size=chunk_size, return_lse=return_lse,
                      validate_labels=validate_labels)


def linear_cross_entropy_from_layer(layer, hidden: Array, labels: Array, **options) -> Array | tuple[Array, Array]:
    """:func:`linear_cross_entropy` with the weights of a Flax NNX output layer: an ``nnx.Linear`` head
    (kernel ``(H, V)`` used as is, no transposed copy, and its bias) or a tied ``nnx.Embed``
    (embedding ``(V, H)``). Differentiable with ``nnx.grad`` / ``nnx.value_and_grad``.

    Args:
        layer: ``nnx.Linear(H, V)`` or ``nnx.Embed(V, H)``.
        hidden: ``(..., H)``; labels ``(...)``; options: the keyword arguments of
            :func:`linear_cross_entropy` other than ``bias``.

    Example::

        >>> from flax import nnx
        >>> head = nnx.Linear(32, 1000, use_bias=False, rngs=nnx.Rngs(0))
        >>> loss = linear_cross_entropy_from_layer(head, jnp.ones((6, 32)), jnp.arange(6))
    """
    from flax import nnx

    if "bias" in options:
        raise TypeError("bias: linear_cross_entropy_from_layer takes the bias from the layer")
    defaults = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean",
                    chunk_size=None, return_lse=False, validate_labels=None)
    unknown = set(options) - set(defaults)
    if unknown:
        raise TypeError(f"{sorted(unknown)[0]}: not an option of linear_cross_entropy")
    kw = {**defaults, **options}
    if isinstance(layer, nnx.Embed):
        return _linear_ce(hidden, layer.embedding[...], labels, None, transposed=False, **kw)
    if isinstance(layer, nnx.Linear):
        bias = None if layer.bias is None else layer.bias[...]
        return _linear_ce(hidden, layer.kernel[...], labels, bias, transposed=True, **kw)
    raise TypeError(f"layer: expected a flax.nnx.Linear or flax.nnx.Embed, got {type(layer).__name__}")
