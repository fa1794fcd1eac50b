"""Fused cross-entropy for JAX: the logits-level ``cross_entropy`` and the chunked ``linear_cross_entropy``
that never holds the ``(N, V)`` logits, plus :func:`linear_cross_entropy_from_layer` for a Flax
``nnx.Linear`` head or a tied ``nnx.Embed``.

The same kernels and the same plan as ``flashbridge.torch_api.cross_entropy`` (whose docstring explains
the trade-off; ``core_kernels.cross_entropy.plan.LinearCEPlan`` holds the passes): token chunks walked by
``lax.scan`` for the loss, lse and ``dh``, then static vocabulary slices for ``dW`` / ``db`` written into
``dW`` by dynamic-update-slice; the logits from ``jnp`` matmuls (cuBLAS through XLA, input dtype, fp32
accumulation; ``Precision.HIGHEST`` for float32), lse / loss / dlogits from our kernels. XLA's matmul
cannot write into an output as the torch path's ``torch.mm(out=...)`` does, so pass 1's chunks of H
tokens get their logits from our own GEMM kernel, written into dW's storage (see :func:`_pass1`), and pass
2's slice logits are arrays of their own. ``jax.custom_vjp``: under
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

from ..core_kernels import INTERPRETER, Plan
from ..core_kernels.cross_entropy.plan import (
    CrossEntropyOutput, LinearCEPlan, bad_label_message, check_cross_entropy_args, check_linear_cross_entropy_args,
    plan_ce_fwd, plan_ce_grad, plan_ce_total, plan_class_weight_sum, plan_linear_cross_entropy,
    plan_linear_logits, plan_mean_scales)
from ._checks import check_arrays
from ._runtime import dtype_name, execute, gpu_target, jit_op, match_varying

Array = jax.Array
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Opts:
    ignore_index: int
    label_smoothing: float
    z_loss: float
    logit_softcap: float
    class_weight: bool = False  # the kernels take class weights (V,) and their sum (1,)
    predicted_dtype: Optional[str] = None  # the forward also writes the argmax, in this dtype

    def kwargs(self) -> dict:
        """The options of the gradient plans."""
        return dict(ignore_index=self.ignore_index, label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                    logit_softcap=self.logit_softcap, class_weight=self.class_weight)

    def fwd_kwargs(self) -> dict:
        return dict(self.kwargs(), predicted_dtype=self.predicted_dtype)


# ----------------------------------------------------------------------------------------------- kernels

def _broadcast_batched(axis_size, args, in_batched):
    return [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]


def _fold(axis_size, in_batched, *args):
    """custom_vmap puts the mapped axis first: broadcast the unbatched arguments and merge it into the rows."""
    args = _broadcast_batched(axis_size, args, [any(jax.tree_util.tree_leaves(b)) for b in in_batched])
    return [a.reshape(-1, *a.shape[2:]) for a in args]


def _fwd_call(logits, labels, *shared, opts: _Opts):
    """The forward plan's results; ``shared``: the class weights and their sum, with ``opts.class_weight``."""
    n_rows, vocab = logits.shape
    return execute(lambda target: plan_ce_fwd(n_rows, vocab, **opts.fwd_kwargs(), target=target),
                   dict(zip(("logits", "labels", "class_weight", "weight_sum"), (logits, labels, *shared))))


def _grad_call(logits, labels, lse, lse_lo, weight, *rest, opts: _Opts):
    """``rest``: with ``opts.class_weight``, the z-loss terms' upstream gradient (with a z-loss), the class
    weights and their sum."""
    n_rows, vocab = logits.shape
    names = ("z_weight",) * (len(rest) == 3) + ("class_weight", "weight_sum")
    (grad,) = execute(lambda target: plan_ce_grad(n_rows, vocab, grad_dtype=dtype_name(logits.dtype),
                                                  per_row_weight=True, **opts.kwargs(), target=target),
                      {"logits": logits, "labels": labels, "lse": lse, "lse_lo": lse_lo, "weight": weight,
                       **dict(zip(names, rest))})
    return grad


def _row_op(call, n_out: int, n_shared: int = 0):
    """A custom_vmap op over row-wise arrays (then ``n_shared`` arrays every row reads: class weights): the
    mapped axis is folded into the rows (one launch); shared arrays mapped too take one call per element."""
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        split = len(args) - n_shared
        batched = [any(jax.tree_util.tree_leaves(b)) for b in in_batched]
        if not any(batched):
            return op(*args), (False,) * n_out
        if any(batched[split:]):
            return jax.lax.map(lambda a: op(*a), tuple(_broadcast_batched(axis_size, args, batched))), \
                (True,) * n_out
        rows = _fold(axis_size, in_batched[:split], *args[:split])
        outs = op(*rows, *args[split:])  # op, not call: nested vmaps fold again
        outs = tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs)
        return outs, (True,) * n_out

    return op


@functools.lru_cache(maxsize=None)
def _fwd_op(opts: _Opts):
    """(logits, labels[, class_weight, weight_sum]) -> the forward plan's results."""
    n_out = len(_fwd_results(opts))
    return _row_op(functools.partial(_fwd_call, opts=opts), n_out, 2 if opts.class_weight else 0)


def _fwd_results(opts: _Opts) -> tuple[str, ...]:
    return plan_ce_fwd(1, 1, **opts.fwd_kwargs(), target=INTERPRETER).results


@functools.lru_cache(maxsize=None)
def _grad_op(opts: _Opts):
    op = _row_op(lambda *a: (_grad_call(*a, opts=opts),), 1, 2 if opts.class_weight else 0)
    return lambda *a: op(*a)[0]


_SHARED = ("class_weight", "weight_sum")  # inputs every row reads (the class weights): never sliced by rows


@functools.lru_cache(maxsize=None)
def _weight_sum_op():
    """(class_weight,) -> (sum,): see :func:`_weight_sum`. Under vmap, one call per element."""
    def call(class_weight):
        vocab = class_weight.shape[0]
        return execute(lambda target: plan_class_weight_sum(vocab, target=target), {"class_weight": class_weight})

    return _row_op(call, 1, 1)


def _weight_sum(class_weight):
    """float32 (1,): the sum of the class weights (plan_class_weight_sum: the same bits as the torch
    front-end)."""
    return _weight_sum_op()(class_weight)[0]


@functools.lru_cache(maxsize=None)
def _mean_scales_op(ignore_index: int, class_weight: bool):
    """(labels[, class_weight]) -> (scales,): see :func:`_mean_scales`. Under vmap, one call per element."""
    def call(labels, *class_weights):
        vocab = class_weights[0].shape[0] if class_weight else 1
        return execute(lambda target: plan_mean_scales(labels.shape[0], vocab, class_weight=class_weight,
                                                       ignore_index=ignore_index, target=target),
                       dict(zip(("labels", "class_weight"), (labels, *class_weights))))

    return _row_op(call, 1, 1 + class_weight)


def _mean_scales(labels, class_weight, ignore_index: int):
    """float32 (2,): ``[1 / W, 1 / count]``, the reciprocals of a mean's divisors (plan_mean_scales). A mean
    multiplies by them: XLA's float32 division on NVIDIA GPUs is approximate (``div.full.f32``), the kernel's
    is IEEE, and a multiply (and so autograd's backward of one) rounds alike in both front-ends."""
    op = _mean_scales_op(int(ignore_index), class_weight is not None)
    return op(labels, *(() if class_weight is None else (class_weight,)))[0]


@functools.lru_cache(maxsize=None)
def _total_op(has_z: bool, has_scales: bool):
    """(loss[, zloss][, scales]) -> (total,): see :func:`_ce_total`. Under vmap, one call per element."""
    names = ("loss",) + ("zloss",) * has_z + ("scales",) * has_scales

    def call(*arrays):
        n = arrays[0].shape[0]
        return execute(lambda target: plan_ce_total(n, has_z=has_z, has_scales=has_scales, target=target),
                       dict(zip(names, arrays)))

    return _row_op(call, 1, len(names))


@jax.custom_vjp
def _ce_total(rows, scales):
    """float32 (1,): ``sum(rows[0]) * scales[0] + sum(rows[1]) * scales[1]`` (``rows``: the ce terms and, where
    they are apart, the z-loss terms; ``scales`` None: 1, a sum), summed in a fixed order by a kernel
    (plan_ce_total: the same bits as the torch front-end, whose own sum reduces in another order)."""
    return _total_op(len(rows) == 2, scales is not None)(*rows, *(() if scales is None else (scales,)))[0]


def _ce_total_fwd(rows, scales):
    return _ce_total(rows, scales), (rows, scales)


def _ce_total_bwd(saved, g):
    """Every row's cotangent is ``g * scales[i]``: a multiply, as the torch front-end's, so the same bits."""
    rows, scales = saved
    g = g[0]
    cot = tuple(jnp.broadcast_to(g if scales is None else g * scales[i], r.shape) for i, r in enumerate(rows))
    return cot, None if scales is None else jnp.zeros_like(scales)


_ce_total.defvjp(_ce_total_fwd, _ce_total_bwd)


def _row_names(plan: Plan) -> tuple[str, ...]:
    """A chunk / slice plan's inputs after the logits, the shared ones last (the plans put them there)."""
    names = plan.inputs[1:]
    assert all(n in _SHARED for n in names[len(names) - sum(n in _SHARED for n in names):]), names
    return names


@functools.lru_cache(maxsize=None)
def _chunk_op(plan: LinearCEPlan):
    """The kernels of one pass-1 chunk of ``plan`` (``LinearCEPlan.chunk_plan``) as a row op taking the logits,
    then the chunk plan's other inputs in its order; a gradient takes over the logits' buffer (they are dead
    after the call, so XLA holds one (C, V) buffer per chunk instead of two)."""
    kernels = plan.chunk_plan(1, INTERPRETER)

    def call(*arrays):
        rows = arrays[0].shape[0]
        return execute(lambda target: plan.chunk_plan(rows, target), dict(zip(kernels.inputs, arrays)),
                       aliases={"grad": "logits"} if "grad" in kernels.results else None)

    return _row_op(call, len(kernels.results), len(_SHARED) if plan.class_weight else 0)


@functools.lru_cache(maxsize=None)
def _slice_op(plan: LinearCEPlan, c0: int, c1: int):
    """The gradient kernel of pass 2's columns ``[c0, c1)`` (``LinearCEPlan.slice_plan``), over the logits'
    buffer: (logits, labels, lse, lse_lo, weight[, z_weight, class_weight, weight_sum]) -> grad."""
    names = plan.slice_plan(1, c0, c1, INTERPRETER).inputs

    def call(*arrays):
        rows = arrays[0].shape[0]
        return execute(lambda target: plan.slice_plan(rows, c0, c1, target), dict(zip(names, arrays)),
                       aliases={"grad": "logits"})

    op = _row_op(call, 1, len(_SHARED) if plan.class_weight else 0)
    return lambda *a: op(*a)[0]


def _label_cotangent(labels):
    return np.zeros(labels.shape, dtype=jax.dtypes.float0)


# ---------------------------------------------------------------------------------- logits-level vjp

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ce(logits, labels, class_weight, weight_sum, opts: _Opts):
    """(loss rows, z-loss rows or None, lse, predicted or None); the z-loss rows are apart with class
    weights and a z-loss (see core_kernels/cross_entropy/plan.py), otherwise in the loss rows."""
    return _ce_fwd(logits, labels, class_weight, weight_sum, opts)[0]


def _ce_fwd(logits, labels, class_weight, weight_sum, opts):
    shared = (class_weight, weight_sum) if opts.class_weight else ()
    out = dict(zip(_fwd_results(opts), _fwd_op(opts)(logits, labels, *shared)))
    return ((out["loss"], out.get("zloss"), out["lse"], out.get("predicted")),
            (logits, labels, class_weight, weight_sum, out["lse"], out["lse_lo"]))


def _ce_bwd(opts, saved, cotangents):
    logits, labels, class_weight, weight_sum, lse, lse_lo = saved
    dloss, dzloss = cotangents[0].astype(F32), cotangents[1]
    rest = ()
    if opts.class_weight:
        rest = ((dzloss.astype(F32),) if dzloss is not None else ()) + (class_weight, weight_sum)
    grad = _grad_op(opts)(logits, labels, lse, lse_lo, dloss, *rest)
    # the class weights are constants (stop_gradient'ed by the public functions)
    zeros = None if class_weight is None else (jnp.zeros_like(class_weight), jnp.zeros_like(weight_sum))
    return (grad, _label_cotangent(labels)) + (zeros or (None, None))


_ce.defvjp(_ce_fwd, _ce_bwd)


# ---------------------------------------------------------------------------------------- linear vjp

@dataclasses.dataclass(frozen=True)
class _LinearCfg:
    ignore_index: int
    reduction: str
    transposed: bool  # weight is (H, V) (a Flax nnx.Linear kernel) instead of (V, H)
    forward_only: LinearCEPlan  # loss and lse (the primal, and reduction "none"'s forward)
    with_grads: Optional[LinearCEPlan]  # "mean" / "sum" under differentiation: loss, lse and every gradient
    recompute: Optional[LinearCEPlan]  # "none": the backward's passes from the saved lse


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, contract_a: int, contract_b: int):
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), precision=_precision(a.dtype),
                               preferred_element_type=a.dtype)


def _chunk_logits(h_c, weight, bias, transposed):
    x = _dot(h_c, weight, 1, 0 if transposed else 1)  # (C, V)
    return x if bias is None else x + bias


def _reduce(loss_rows, labels, ignore_index, reduction, class_weight=None, z_rows=None, scales=None):
    """A mean multiplies the sum of the ce terms (``loss_rows``) by the reciprocal of the counted labels'
    number, or with class weights of their weights' sum (torch's rule), and that of the z-loss terms
    (``z_rows``, or None when they are in ``loss_rows``) by the reciprocal of their number: ``scales``
    (:func:`_mean_scales`, computed here when not given). The sums come from a kernel (:func:`_ce_total`)."""
    if reduction == "none":
        return loss_rows if z_rows is None else loss_rows + z_rows
    if reduction == "mean" and scales is None:
        scales = _mean_scales(labels, class_weight, ignore_index)
    rows = (loss_rows,) if z_rows is None else (loss_rows, z_rows)
    return _ce_total(rows, scales if reduction == "mean" else None)[0]


def _prepare_class_weight(class_weight, ignore_index: int):
    """The class weights as constants and their float32 sum ``(1,)``: (None, None) without them."""
    if class_weight is None:
        return None, None
    class_weight = jax.lax.stop_gradient(class_weight)
    return class_weight, _weight_sum(class_weight)


def _extras_output(loss, lse, predicted, labels, ignore_index, lead, return_lse, return_accuracy, return_predicted):
    predicted = predicted.reshape(lead)
    y = labels.reshape(lead)
    accuracy = ((predicted == y) & (y != ignore_index)) if return_accuracy else None
    return CrossEntropyOutput(loss, jax.lax.stop_gradient(lse).reshape(lead) if return_lse else None, accuracy,
                              predicted if return_predicted else None)


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


def _pass1(hidden, weight, bias, rows: dict, plan: LinearCEPlan, transposed: bool):
    """Pass 1 of ``plan``: per chunk the logits, the chunk's kernels and (``plan.chunk_grads``)
    ``dh[chunk] = dlogits @ W``. ``rows``: the arrays the kernels read besides the logits, by name (per-row
    ones, sliced by chunk, and the class weights' ``_SHARED`` ones, whole). Returns the per-row results over
    all tokens by name -- loss, lse, lse_lo (and zloss, predicted) in the forward, dh -- and the dW-shaped
    buffer of the in-dW chunks (None without them).

    Runs of equal chunks are one ``lax.scan`` each. In-dW chunks (exactly H tokens) get their logits from our
    GEMM kernel, written into one dW-shaped buffer that each chunk takes over in turn and pass 2 then
    overwrites with dW (XLA's matmul cannot write into a given buffer; it would return a new array per chunk).

    The per-row operands and results of our kernels pass through optimization barriers, which XLA removes
    only after its fusion passes: its dynamic-slice fusion would otherwise wrap each kernel call with the
    chunk's slices of its operands and the scan's stacking of its results, cloning the forward kernel (a
    second read of the logits, so the in-place gradient had to work on a copy) and copying the whole
    dW-sized buffer before each in-dW logits kernel."""
    kernels = plan.chunk_plan(1, INTERPRETER)
    names = _row_names(kernels)
    per_row = tuple(n for n in names if n not in _SHARED)
    shared = tuple(rows[n] for n in names if n in _SHARED)
    stat_names = tuple(n for n in kernels.results if n != "grad")
    op = _chunk_op(plan)

    def chunk(logits, row_arrays):
        out = dict(zip(kernels.results, op(logits, *row_arrays, *shared)))
        stats = jax.lax.optimization_barrier(tuple(out[n] for n in stat_names)) if stat_names else ()
        if not plan.chunk_grads:
            return None, stats
        return out["grad"], (*stats, _dot(out["grad"], weight, 1, 1 if transposed else 0))

    def step(carry, xs):
        logits = _chunk_logits(xs[0], weight, bias, transposed)
        return carry, chunk(logits, jax.lax.optimization_barrier(xs[1:]))[1]

    bias_args = () if bias is None else (bias,)

    def in_dw_step(buffer, xs):
        xs = jax.lax.optimization_barrier(xs)  # the hidden chunk feeds our logits kernel too
        out = _logits_op(transposed, bias is not None)(xs[0], weight, buffer, *bias_args)
        grad, outs = chunk(out.reshape(xs[0].shape[0], -1), xs[1:])
        return grad.reshape(weight.shape), outs

    arrays = (hidden, *(rows[n] for n in per_row))
    parts, buffer = [], None
    for run in plan.chunks:
        xs = tuple(a[run.start:run.stop] for a in arrays)
        if run.count == 1 and not run.in_dw:
            parts.append(step(None, xs)[1])
            continue
        xs = tuple(a.reshape(run.count, run.rows, *a.shape[1:]) for a in xs)
        if run.in_dw:  # the buffer starts as zeros: one memset of dW's size
            buffer, ys = jax.lax.scan(in_dw_step, jnp.zeros_like(weight), xs)
        else:
            _, ys = jax.lax.scan(step, None, xs)
        parts.append(tuple(y.reshape(run.count * run.rows, *y.shape[2:]) for y in ys))
    outs = parts[0] if len(parts) == 1 else tuple(jnp.concatenate(p, axis=0) for p in zip(*parts))
    return dict(zip(stat_names + ("dh",) * plan.chunk_grads, outs)), buffer


def _pass2(hidden, weight, bias, rows: dict, plan: LinearCEPlan, transposed: bool, buffer=None):
    """Pass 2 of ``plan``: per vocabulary slice the logits again, their gradient from pass 1's lse and
    ``dW[slice] = dlogits.T @ h`` (one GEMM: dW is rounded once), ``db[slice] = colsum(dlogits)``, written
    into dW in place (a chain of dynamic-update-slices XLA keeps in one buffer): pass 1's ``buffer`` when
    it has one (every element is overwritten). ``rows``: labels, lse, lse_lo, weight (and with class
    weights z_weight, class_weight, weight_sum), by name.

    One slice at a time: an optimization barrier ties the next slice's input to dW as updated by this
    slice, so XLA cannot schedule the logits GEMMs of later slices before this slice's dW block is written
    (each slice in flight holds N x slice logits and a slice x H block beyond the returned gradients)."""
    dw = jnp.zeros_like(weight) if buffer is None else buffer
    db = None if bias is None else jnp.zeros(bias.shape, F32)
    for s in plan.slices:  # static slices: the kernel takes the column offset as a scalar
        assert s.where == "own", s  # planned with logits_into_dw_rows=False
        hidden, dw = jax.lax.optimization_barrier((hidden, dw))
        w_s = weight[:, s.c0:s.c1] if transposed else weight[s.c0:s.c1]
        logits = _chunk_logits(hidden, w_s, None if bias is None else bias[s.c0:s.c1], transposed)
        names = _row_names(plan.slice_plan(1, s.c0, s.c1, INTERPRETER))
        grad = _slice_op(plan, s.c0, s.c1)(logits, *(rows[n] for n in names))
        if transposed:
            dw = jax.lax.dynamic_update_slice(dw, _dot(hidden, grad, 0, 0), (0, s.c0))  # (H, slice)
        else:
            dw = jax.lax.dynamic_update_slice(dw, _dot(grad, hidden, 0, 0), (s.c0, 0))  # (slice, H)
        if db is not None:
            db = jax.lax.dynamic_update_slice(db, jnp.sum(grad, axis=0, dtype=F32), (s.c0,))
    return dw, db


def _lce_rows(labels, shared: dict, **rows):
    """The kernels' named inputs besides the logits: per-row arrays, then the class weights'."""
    return {"labels": labels, **{n: a for n, a in rows.items() if a is not None}, **shared}


def _lce_loss(out: dict, labels, shared: dict, cfg: "_LinearCfg"):
    return _reduce(out["loss"], labels, cfg.ignore_index, cfg.reduction, shared.get("class_weight"),
                   out.get("zloss"), out.get("scales"))


def _lce_forward(hidden, weight, labels, bias, shared: dict, cfg: "_LinearCfg"):
    out, _ = _pass1(hidden, weight, bias, _lce_rows(labels, shared), cfg.forward_only, cfg.transposed)
    return out


def _lce_forward_with_grads(hidden, weight, labels, bias, shared: dict, cfg: "_LinearCfg"):
    """Loss and the gradients for an upstream gradient of 1 ("mean" / "sum")."""
    scales = None
    if cfg.reduction == "mean":  # the reciprocals of the mean's divisors (see _mean_scales)
        scales = _mean_scales(labels, shared.get("class_weight"), cfg.ignore_index)
        scale, z_scale = scales[0], scales[1]
    else:
        scale = z_scale = jnp.ones((), F32)
    plan = cfg.with_grads
    w = jnp.broadcast_to(scale, labels.shape)
    z_w = jnp.broadcast_to(z_scale, labels.shape) if plan.split_zloss else None
    out, buffer = _pass1(hidden, weight, bias, _lce_rows(labels, shared, weight=w, z_weight=z_w), plan,
                         cfg.transposed)
    dw, db = _pass2(hidden, weight, bias, _lce_rows(labels, shared, lse=out["lse"], lse_lo=out["lse_lo"], weight=w,
                                                    z_weight=z_w), plan, cfg.transposed, buffer)
    return dict(out, scales=scales), out["dh"], dw, db


def _lce_recompute_grads(hidden, weight, labels, bias, shared, lse, lse_lo, dloss, cfg: "_LinearCfg"):
    plan = cfg.recompute
    rows = _lce_rows(labels, shared, lse=lse, lse_lo=lse_lo, weight=dloss,
                     z_weight=dloss if plan.split_zloss else None)
    out, buffer = _pass1(hidden, weight, bias, rows, plan, cfg.transposed)
    dw, db = _pass2(hidden, weight, bias, rows, plan, cfg.transposed, buffer)
    return out["dh"], dw, db


def _shared_dict(class_weight, weight_sum) -> dict:
    return {} if class_weight is None else {"class_weight": class_weight, "weight_sum": weight_sum}


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _lce(hidden, weight, labels, bias, class_weight, weight_sum, cfg: "_LinearCfg"):
    """(loss, lse, predicted or None)."""
    shared = _shared_dict(class_weight, weight_sum)
    out = _lce_forward(hidden, weight, labels, bias, shared, cfg)
    return _lce_loss(out, labels, shared, cfg), out["lse"], out.get("predicted")


def _lce_fwd(hidden, weight, labels, bias, class_weight, weight_sum, cfg):
    shared = _shared_dict(class_weight, weight_sum)
    if cfg.reduction == "none":
        out = _lce_forward(hidden, weight, labels, bias, shared, cfg)
        return ((_lce_loss(out, labels, shared, cfg), out["lse"], out.get("predicted")),
                (hidden, weight, labels, bias, class_weight, weight_sum, out["lse"], out["lse_lo"]))
    out, dh, dw, db = _lce_forward_with_grads(hidden, weight, labels, bias, shared, cfg)
    loss = _lce_loss(out, labels, shared, cfg)
    return (loss, out["lse"], out.get("predicted")), (dh, dw, db, labels, class_weight, weight_sum)


def _lce_bwd(cfg, saved, cotangents):
    dloss = cotangents[0]
    if cfg.reduction == "none":
        hidden, weight, labels, bias, class_weight, weight_sum, lse, lse_lo = saved
        dh, dw, db = _lce_recompute_grads(hidden, weight, labels, bias, _shared_dict(class_weight, weight_sum),
                                          lse, lse_lo, dloss.astype(F32), cfg)
    else:
        dh, dw, db, labels, class_weight, weight_sum = saved
        g = dloss.astype(F32)
        dh = (dh.astype(F32) * g).astype(dh.dtype)
        dw = (dw.astype(F32) * g).astype(dw.dtype)
        db = None if db is None else db * g
    # the class weights are constants (stop_gradient'ed by the public functions)
    zeros = (None, None) if class_weight is None else (jnp.zeros_like(class_weight), jnp.zeros_like(weight_sum))
    return (dh, dw, _label_cotangent(labels), db) + zeros


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


def cross_entropy(logits: Array, labels: Array, *, weight: Optional[Array] = None, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, logit_softcap: float = 0.0,
                  reduction: str = "mean", return_lse: bool = False, return_accuracy: bool = False,
                  return_predicted: bool = False, validate_labels: Optional[bool] = None
                  ) -> Array | tuple[Array, Array] | CrossEntropyOutput:
    """Fused softmax cross-entropy: ``loss_i = (1-s) w_y (lse_i - z_iy) + s/V sum_j w_j (lse_i - z_ij) + z_loss*lse_i^2``, ``z = cap*tanh(x/cap)``.

    Args:
        logits: ``(..., V)`` float32 / float16 / bfloat16.
        labels: ``(...)`` int32 / int64 in ``[0, V)`` or ``ignore_index``.
        weight: optional class weights ``w``, ``(V,)`` of a float dtype, as in
            ``torch.nn.functional.cross_entropy``: the label's term is scaled by ``w_y``, the smoothing term
            weighs class ``j`` by ``w_j``, and "mean" divides by the sum of ``w_y`` over the rows not ignored.
            Any values (negative ones too; a NaN makes the losses that read it NaN). The z-loss is not
            class-weighted (as in liger-kernel): each row adds ``z_loss * lse^2`` and "mean" divides their
            sum by the number of rows not ignored. Constants for autodiff (``stop_gradient``: a gradient with
            respect to them is zero; torch refuses a weight that requires grad).
        ignore_index: label of rows that contribute nothing (no loss, zero gradient).
        label_smoothing: ``s`` in [0, 1) (as ``torch.nn.functional.cross_entropy``).
        z_loss: coefficient of the PaLM auxiliary loss ``lse^2`` (0 = off).
        logit_softcap: ``cap > 0`` applies ``cap * tanh(x / cap)`` before the softmax (0 = off).
        reduction: "mean" (over non-ignored rows; 0 with zero gradients when all are ignored), "sum",
            "none".
        return_lse: also return the float32 ``(...)`` log-sum-exp (a constant for autodiff).
        return_accuracy, return_predicted: also return, per row, whether the argmax of its logits is its
            label (bool; False for ignored rows) and that argmax (the labels' dtype; ties to the lowest
            index, as ``jnp.argmax``; every row, ignored ones too), found in the forward's pass over the
            vocabulary. A row with a NaN logit has a NaN loss and an unspecified argmax.
        validate_labels: True raises a ValueError naming ``labels`` when concrete labels (outside
            ``jit``) hold a value outside ``[0, V)`` other than ``ignore_index`` (reading them from a GPU
            waits for it); None (default) checks NumPy / CPU labels only; False never checks. Unchecked
            and traced labels are never refused: such a row gets a NaN loss and NaN gradients.

    Returns:
        The float32 loss (scalar, or ``(...)`` for "none"), and the lse with ``return_lse``; with
        ``return_accuracy`` or ``return_predicted`` a ``CrossEntropyOutput`` ``(loss, lse, accuracy,
        predicted)`` whose fields not asked for are None.

    Example::

        >>> logits = jax.random.normal(jax.random.key(0), (4, 10))
        >>> loss, dlogits = jax.value_and_grad(cross_entropy)(logits, jnp.array([1, 2, -100, 9]))
        >>> out = cross_entropy(logits, jnp.array([1, 2, -100, 9]), weight=jnp.ones(10), return_predicted=True)
    """
    check_arrays(logits=logits, labels=labels, weight=weight)
    n_rows, vocab = check_cross_entropy_args(
        logits=_shape_dtype(logits), labels=_shape_dtype(labels), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap, reduction=reduction,
        weight=_shape_dtype(weight))
    _validate_label_values(labels, vocab, ignore_index, validate_labels)
    extras = return_accuracy or return_predicted
    opts = _Opts(int(ignore_index), float(label_smoothing), float(z_loss), float(logit_softcap),
                 weight is not None, dtype_name(labels.dtype) if extras else None)
    return _ce_op(logits, labels, weight, opts=opts, n_rows=n_rows, vocab=vocab, reduction=reduction,
                  returns=(bool(return_lse), bool(return_accuracy), bool(return_predicted)))


@jit_op("opts", "n_rows", "vocab", "reduction", "returns")
def _ce_op(logits, labels, weight, *, opts: _Opts, n_rows, vocab, reduction, returns):
    """``returns``: (return_lse, return_accuracy, return_predicted)."""
    return_lse, return_accuracy, return_predicted = returns
    lead = tuple(labels.shape)
    extras = return_accuracy or return_predicted
    class_weight, weight_sum = _prepare_class_weight(weight, opts.ignore_index)
    x, y, class_weight, weight_sum = match_varying(logits.reshape(n_rows, vocab), labels.reshape(n_rows),
                                                   class_weight, weight_sum)
    loss_rows, z_rows, lse, predicted = _ce(x, y, class_weight, weight_sum, opts)
    loss = _reduce(loss_rows, y, opts.ignore_index, reduction, class_weight, z_rows)
    loss = loss.reshape(lead) if reduction == "none" else loss
    if extras:
        return _extras_output(loss, lse, predicted, y, opts.ignore_index, lead, return_lse, return_accuracy,
                              return_predicted)
    return (loss, jax.lax.stop_gradient(lse).reshape(lead)) if return_lse else loss


def _linear_ce(hidden, weight, labels, bias, *, transposed, ignore_index, label_smoothing, z_loss,
               logit_softcap, reduction, chunk_size, return_lse, validate_labels=None, class_weight=None,
               return_accuracy=False, return_predicted=False):
    check_arrays(hidden=hidden, weight=weight, labels=labels, bias=bias, class_weight=class_weight)
    n_rows, h, vocab = check_linear_cross_entropy_args(
        hidden=_shape_dtype(hidden), weight=_shape_dtype(weight), labels=_shape_dtype(labels),
        bias=_shape_dtype(bias), ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        logit_softcap=logit_softcap, reduction=reduction, chunk_size=chunk_size, weight_transposed=transposed,
        class_weight=_shape_dtype(class_weight))
    _validate_label_values(labels, vocab, ignore_index, validate_labels)
    return _linear_ce_op(hidden, weight, labels, bias, class_weight, n_rows=n_rows, h=h, vocab=vocab,
                         transposed=bool(transposed), ignore_index=int(ignore_index),
                         label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                         logit_softcap=float(logit_softcap), reduction=reduction,
                         chunk_size=int(chunk_size) if chunk_size else None,
                         returns=(bool(return_lse), bool(return_accuracy), bool(return_predicted)))


@jit_op("n_rows", "h", "vocab", "transposed", "ignore_index", "label_smoothing", "z_loss", "logit_softcap",
        "reduction", "chunk_size", "returns")
def _linear_ce_op(hidden, weight, labels, bias, class_weight, *, n_rows, h, vocab, transposed, ignore_index,
                  label_smoothing, z_loss, logit_softcap, reduction, chunk_size, returns):
    """Checked arguments; ``returns``: (return_lse, return_accuracy, return_predicted). The passes are
    planned here, once per configuration."""
    return_lse, return_accuracy, return_predicted = returns
    lead = tuple(labels.shape)
    extras = return_accuracy or return_predicted
    common = dict(dtype=dtype_name(hidden.dtype), chunk_size=chunk_size,
                  logits_into_dw_rows=False, per_row_weight=True, ignore_index=ignore_index,
                  label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap,
                  target=gpu_target() or INTERPRETER,  # the passes are static: planned once for both platforms
                  class_weight=class_weight is not None)
    grads = dict(want_dh=True, want_dw=True, want_db=bias is not None)
    nothing = dict(want_dh=False, want_dw=False, want_db=False)
    predicted = dict(predicted_dtype=dtype_name(labels.dtype) if extras else None)
    plan = functools.partial(plan_linear_cross_entropy, n_rows, h, vocab, **common)
    cfg = _LinearCfg(int(ignore_index), reduction, bool(transposed), plan(forward=True, **nothing, **predicted),
                     None if reduction == "none" else plan(forward=True, **grads, **predicted),
                     plan(forward=False, **grads) if reduction == "none" else None)
    cw, weight_sum = _prepare_class_weight(class_weight, int(ignore_index))
    h2, w, y, b, cw, weight_sum = match_varying(hidden.reshape(n_rows, h), weight, labels.reshape(n_rows), bias,
                                                cw, weight_sum)
    loss, lse, pred = _lce(h2, w, y, b, cw, weight_sum, cfg)
    loss = loss.reshape(lead) if reduction == "none" else loss
    if extras:
        return _extras_output(loss, lse, pred, y, int(ignore_index), lead, return_lse, return_accuracy,
                              return_predicted)
    return (loss, jax.lax.stop_gradient(lse).reshape(lead)) if return_lse else loss


def linear_cross_entropy(hidden: Array, weight: Array, labels: Array, *, bias: Optional[Array] = None,
                         class_weight: Optional[Array] = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, logit_softcap: float = 0.0,
                         reduction: str = "mean", chunk_size: Optional[int] = None, return_lse: bool = False,
                         return_accuracy: bool = False, return_predicted: bool = False,
                         validate_labels: Optional[bool] = None
                         ) -> Array | tuple[Array, Array] | CrossEntropyOutput:
    """Cross-entropy of a vocabulary projection without the ``(N, V)`` logits: ``cross_entropy(hidden @ weight.T + bias, labels)``.

    Args:
        hidden: ``(..., H)`` float32 / float16 / bfloat16; every leading axis is a token axis.
        weight: ``(V, H)`` in hidden's dtype (the ``nnx.Embed`` / torch ``nn.Linear`` layout; for an
            ``nnx.Linear`` kernel ``(H, V)`` use :func:`linear_cross_entropy_from_layer`).
        labels: ``(...)`` int32 / int64, hidden's leading shape.
        bias: optional ``(V,)`` in hidden's dtype.
        class_weight: optional class weights ``(V,)``: :func:`cross_entropy`'s ``weight`` (named apart from
            the projection's weight).
        ignore_index, label_smoothing, z_loss, logit_softcap, reduction, return_lse, return_accuracy,
            return_predicted, validate_labels: as in :func:`cross_entropy` (the argmax is that of the
            logits ``hidden @ weight.T + bias`` as computed, in hidden's dtype).
        chunk_size: tokens per chunk (static; their logits are arrays of their own). None (as in torch): when
            the weight's gradient is computed, chunks of H tokens whose logits are written into its storage
            (no memory of their own), the rest in chunks of ``max(64, H // 16)`` tokens.

    Returns:
        The float32 loss (scalar, or ``(...)`` for "none"), and the float32 lse with ``return_lse``; with
        ``return_accuracy`` or ``return_predicted`` a ``CrossEntropyOutput``.

    Example::

        >>> k = jax.random.split(jax.random.key(0), 2)
        >>> h, w = jax.random.normal(k[0], (6, 32)), jax.random.normal(k[1], (1000, 32))
        >>> loss, (dh, dw) = jax.value_and_grad(linear_cross_entropy, argnums=(0, 1))(
        ...     h, w, jnp.arange(6), chunk_size=4)
    """
    return _linear_ce(hidden, weight, labels, bias, transposed=False, ignore_index=ignore_index,
                      label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap,
                      reduction=reduction, chunk_size=chunk_size, return_lse=return_lse,
                      validate_labels=validate_labels, class_weight=class_weight, return_accuracy=return_accuracy,
                      return_predicted=return_predicted)


def linear_cross_entropy_from_layer(layer, hidden: Array, labels: Array, **options
                                    ) -> Array | tuple[Array, Array] | CrossEntropyOutput:
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
                    chunk_size=None, return_lse=False, validate_labels=None, class_weight=None,
                    return_accuracy=False, return_predicted=False)
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
