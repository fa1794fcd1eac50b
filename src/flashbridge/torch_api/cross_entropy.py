"""Fused cross-entropy for PyTorch: the logits-level ``cross_entropy`` and the chunked
``linear_cross_entropy`` that never holds the ``(N, V)`` logits. ``torch.library`` custom ops with fake
kernels and autograd; ``torch.compile(fullgraph=True)`` clean.

Design of ``linear_cross_entropy`` (the trade-off, time vs memory vs accuracy):

* Two passes, planned once for both front-ends (``core_kernels.cross_entropy.plan.LinearCEPlan``), each
  finishing a gradient in one GEMM. Pass 1, token chunks over the whole vocabulary: ``logits = h_c @ W.T
  (+ b)`` (torch's GEMM, input dtype, fp32 accumulation), then our kernels: the lse / loss pass (one read,
  online softmax, fp32) and the gradient pass (``dlogits`` written over the logits in place), then ``dh_c =
  dlogits @ W``. Pass 2, vocabulary slices over all tokens: the slice's logits again, their gradient from
  pass 1's lse (the kernel takes the slice's column offset), ``dW[slice] = dlogits.T @ h`` and
  ``db[slice] = colsum``.
* Gradients are computed during the forward (as liger-kernel does) when the reduction is "mean" or "sum"
  and something requires grad: the backward only multiplies them, in place, by the upstream scalar and
  hands them to autograd (no copy; see ``_lce_backward``). With reduction="none" the per-token upstream
  gradients are unknown in the forward, so the forward keeps only the fp32 lse and the backward runs the
  two passes. Four GEMMs in all (eager: three): the logits are computed twice.
* Memory: the returned gradients and one small buffer. Pass 1's chunk logits live in dW's storage (dW is
  only written in pass 2), pass 2's slice logits in dW's last rows until the slices reach them, then in a
  16 MiB buffer: about a third of eager's peak at the same time as liger-kernel's fused op (see
  ``benchmarks/bench_cross_entropy.py``).
* Accuracy: lse, loss and the reduction in fp32; the logits are rounded once to the input dtype (as in
  eager); dh and dW are each one GEMM with fp32 accumulation, rounded once to their dtype (as eager does).
  Deterministic: a fixed order, no atomics.
* Labels: a label outside ``[0, V)`` other than ``ignore_index`` raises a ValueError before any launch
  when checked (``validate_labels``: CPU labels by default, GPU labels with True -- one device-to-host sync
  of a boolean); unchecked (a GPU default, or under ``torch.compile``) such a row gets a NaN loss (and NaN
  gradients), never an out-of-bounds read.
* The returned lse is not differentiable (marked so: backward through it raises).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core_kernels.cross_entropy.plan import (
    CrossEntropyOutput, LinearCEPlan, bad_label_message, check_cross_entropy_args, check_linear_cross_entropy_args,
    plan_ce_fwd, plan_ce_grad, plan_ce_total, plan_class_weight_sum, plan_linear_cross_entropy, plan_mean_scales)
from ._checks import check_tensors
from ._ops import fused_op, plain_eager, underlying, vmapped_at
from ._runtime import dtype_name, execute, memoised, target_for

# validation and plans run once per distinct argument signature (see memoised)
(check_cross_entropy_args, check_linear_cross_entropy_args, plan_ce_fwd, plan_ce_grad, plan_class_weight_sum,
 plan_linear_cross_entropy, plan_mean_scales, plan_ce_total) = map(memoised, (
    check_cross_entropy_args, check_linear_cross_entropy_args, plan_ce_fwd, plan_ce_grad, plan_class_weight_sum,
    plan_linear_cross_entropy, plan_mean_scales, plan_ce_total))


def _opts(ignore_index, label_smoothing, z_loss, logit_softcap):
    return dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                logit_softcap=logit_softcap)


# ------------------------------------------------------------------------------- logits-level custom ops

@fused_op("cross_entropy_fwd", replay=True)
def _ce_fwd(logits: Tensor, labels: Tensor, ignore_index: int, label_smoothing: float, z_loss: float,
            logit_softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    """logits (n, V), labels (n,) -> per-row loss, lse, lse_lo (float32 (n,) each; see plan_ce_fwd)."""
    n_rows, vocab = logits.shape
    plan = plan_ce_fwd(n_rows, vocab, **_opts(ignore_index, label_smoothing, z_loss, logit_softcap),
                       target=target_for(logits.device))
    return execute(plan, {"logits": logits.contiguous(), "labels": labels.contiguous()})


@_ce_fwd.register_fake
def _(logits, labels, ignore_index, label_smoothing, z_loss, logit_softcap):
    n_rows = logits.shape[0]
    return tuple(logits.new_empty((n_rows,), dtype=torch.float32) for _ in range(3))


def _rows(batch: int, tensors, in_dims) -> list[Tensor]:
    """Batching rule helper: row-wise tensors with the vmapped dimension folded into the rows."""
    return [vmapped_at(t, d, batch).flatten(0, 1) for t, d in zip(tensors, in_dims)]


@_ce_fwd.register_vmap
def _(batch, in_dims, logits, labels, *options):
    rows = _ce_fwd.overload(*_rows(batch, (logits, labels), in_dims), *options)
    return tuple(t.unflatten(0, (batch, -1)) for t in rows), (0, 0, 0)


@fused_op("cross_entropy_bwd", replay=True)
def _ce_bwd(logits: Tensor, labels: Tensor, lse: Tensor, lse_lo: Tensor, dloss: Tensor, ignore_index: int,
            label_smoothing: float, z_loss: float, logit_softcap: float) -> Tensor:
    """Gradient of sum_i dloss_i * loss_i with respect to logits (n, V); dloss float32 (n,)."""
    n_rows, vocab = logits.shape
    plan = plan_ce_grad(n_rows, vocab, grad_dtype=dtype_name(logits.dtype), per_row_weight=True,
                        **_opts(ignore_index, label_smoothing, z_loss, logit_softcap),
                        target=target_for(logits.device))
    (grad,) = execute(plan, {"logits": logits.contiguous(), "labels": labels.contiguous(),
                             "lse": lse.contiguous(), "lse_lo": lse_lo.contiguous(), "weight": dloss.contiguous()})
    return grad


@_ce_bwd.register_fake
def _(logits, labels, lse, lse_lo, dloss, ignore_index, label_smoothing, z_loss, logit_softcap):
    return torch.empty_like(logits)


@_ce_bwd.register_vmap
def _(batch, in_dims, logits, labels, lse, lse_lo, dloss, *options):
    grad = _ce_bwd.overload(*_rows(batch, (logits, labels, lse, lse_lo, dloss), in_dims), *options)
    return grad.unflatten(0, (batch, -1)), 0


def _ce_setup_context(ctx, inputs, output):
    logits, labels, *options = inputs
    _, lse, lse_lo = output
    ctx.mark_non_differentiable(lse, lse_lo)
    ctx.save_for_backward(logits, labels, lse, lse_lo)
    ctx.options = options


def _ce_backward(ctx, dloss, *_):
    logits, labels, lse, lse_lo = ctx.saved_tensors
    if dloss is None or not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    grad = _ce_bwd(logits, labels, lse, lse_lo, dloss.float().contiguous(), *ctx.options)
    return grad, None, None, None, None, None


_ce_fwd.register_autograd(_ce_backward, setup_context=_ce_setup_context)


# With class weights and / or the argmax: ops of their own, so that the plain ones above keep their schema
# and their kernels (which take no class weights).

def _weight_sum(class_weight: Tensor) -> Tensor:
    """float32 (1,): the sum of the class weights (plan_class_weight_sum: the same bits as the JAX front-end)."""
    (total,) = execute(plan_class_weight_sum(class_weight.shape[0], target=target_for(class_weight.device)),
                       {"class_weight": class_weight.contiguous()})
    return total


@fused_op("cross_entropy_class_weight_sum", replay=True)
def _ce_weight_sum(class_weight: Tensor) -> Tensor:
    return _weight_sum(class_weight)


@_ce_weight_sum.register_fake
def _(class_weight):
    return class_weight.new_empty((1,), dtype=torch.float32)


def _mean_scales(labels: Tensor, class_weight: Optional[Tensor], ignore_index: int) -> Tensor:
    """float32 (2,): ``[1 / W, 1 / count]``, the reciprocals of a mean's divisors (plan_mean_scales: IEEE
    division in a kernel, the same bits as the JAX front-end, which multiplies by them too)."""
    vocab = 1 if class_weight is None else class_weight.shape[0]
    plan = plan_mean_scales(labels.shape[0], vocab, class_weight=class_weight is not None,
                            ignore_index=ignore_index, target=target_for(labels.device))
    named = {"labels": labels, "class_weight": class_weight}
    (scales,) = execute(plan, {n: named[n].contiguous() for n in plan.inputs})
    return scales


@fused_op("cross_entropy_mean_scales", replay=True)
def _ce_mean_scales(labels: Tensor, class_weight: Optional[Tensor], ignore_index: int) -> Tensor:
    return _mean_scales(labels, class_weight, ignore_index)


@_ce_mean_scales.register_fake
def _(labels, class_weight, ignore_index):
    return labels.new_empty((2,), dtype=torch.float32)


def _total(loss_rows: Tensor, z_rows: Optional[Tensor], scales: Optional[Tensor]) -> Tensor:
    """float32 (1,): ``sum(loss_rows) * scales[0] + sum(z_rows) * scales[1]`` (scales 1 when None: a sum),
    summed in a fixed order by a kernel (plan_ce_total: the same bits as the JAX front-end)."""
    plan = plan_ce_total(loss_rows.shape[0], has_z=z_rows is not None, has_scales=scales is not None,
                         target=target_for(loss_rows.device))
    named = {"loss": loss_rows, "zloss": z_rows, "scales": scales}
    (total,) = execute(plan, {n: named[n].contiguous() for n in plan.inputs})
    return total


@fused_op("cross_entropy_total", replay=True)
def _ce_total(loss_rows: Tensor, z_rows: Optional[Tensor], scales: Optional[Tensor]) -> Tensor:
    return _total(loss_rows, z_rows, scales)


@_ce_total.register_fake
def _(loss_rows, z_rows, scales):
    return loss_rows.new_empty((1,), dtype=torch.float32)


def _ce_total_setup_context(ctx, inputs, output):
    loss_rows, z_rows, scales = inputs
    ctx.n_rows, ctx.has_z = loss_rows.shape[0], z_rows is not None
    ctx.save_for_backward(scales)


def _ce_total_backward(ctx, g):
    """Every row's gradient is ``g * scales[0]`` (``g * scales[1]`` for the z-loss rows): a multiply, as
    the JAX front-end's, so the same bits."""
    if g is None:
        return None, None, None
    (scales,) = ctx.saved_tensors
    g = g.reshape(())
    grads = [(g if scales is None else g * scales[i]).expand(ctx.n_rows) for i in range(1 + ctx.has_z)]
    return grads[0], grads[1] if ctx.has_z else None, None


_ce_total.register_autograd(_ce_total_backward, setup_context=_ce_total_setup_context)


@fused_op("cross_entropy_fwd_ext")
def _ce_fwd_ext(logits: Tensor, labels: Tensor, class_weight: Optional[Tensor], weight_sum: Optional[Tensor],
                ignore_index: int, label_smoothing: float, z_loss: float, logit_softcap: float,
                predicted: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """As cross_entropy_fwd, with class weights ``(V,)`` and their float32 sum ``(1,)`` (or None) and the
    argmax: (loss, lse, lse_lo, zloss, predicted). With class weights loss holds the weighted ce terms and
    zloss the z-loss terms (empty without a z-loss, or without class weights, where loss has them);
    predicted is in the labels' dtype (empty unless asked for)."""
    n_rows, vocab = logits.shape
    plan = plan_ce_fwd(n_rows, vocab, **_opts(ignore_index, label_smoothing, z_loss, logit_softcap),
                       target=target_for(logits.device), class_weight=class_weight is not None,
                       predicted_dtype=dtype_name(labels.dtype) if predicted else None)
    named = {"logits": logits.contiguous(), "labels": labels.contiguous()}
    if class_weight is not None:
        named.update(class_weight=class_weight.contiguous(), weight_sum=weight_sum.reshape(1).float())
    out = dict(zip(plan.results, execute(plan, named)))
    empty = logits.new_empty((0,), dtype=torch.float32)
    return (out["loss"], out["lse"], out["lse_lo"], out.get("zloss", empty),
            out.get("predicted", labels.new_empty((0,))))


@_ce_fwd_ext.register_fake
def _(logits, labels, class_weight, weight_sum, ignore_index, label_smoothing, z_loss, logit_softcap, predicted):
    n_rows = logits.shape[0]
    rows = [logits.new_empty((n_rows,), dtype=torch.float32) for _ in range(3)]
    zloss = logits.new_empty((n_rows if class_weight is not None and z_loss > 0 else 0,), dtype=torch.float32)
    return (*rows, zloss, labels.new_empty((n_rows if predicted else 0,)))


@_ce_fwd_ext.register_vmap
def _(batch, in_dims, logits, labels, class_weight, weight_sum, *options):
    if in_dims[2] is not None or in_dims[3] is not None:
        return None  # class weights per vmapped element: one call each
    outs = _ce_fwd_ext.overload(*_rows(batch, (logits, labels), in_dims), class_weight, weight_sum, *options)
    return tuple(t.unflatten(0, (batch, -1)) if t.numel() else t.new_empty((batch, 0)) for t in outs), (0,) * 5


@fused_op("cross_entropy_bwd_weighted")
def _ce_bwd_weighted(logits: Tensor, labels: Tensor, lse: Tensor, lse_lo: Tensor, dloss: Tensor, dzloss: Tensor,
                     class_weight: Tensor, weight_sum: Tensor, ignore_index: int, label_smoothing: float,
                     z_loss: float, logit_softcap: float) -> Tensor:
    """Gradient of sum_i (dloss_i * ce_i + dzloss_i * zloss_i) with respect to logits (n, V), with class
    weights; dloss, dzloss float32 (n,) (dzloss is not read without a z-loss)."""
    n_rows, vocab = logits.shape
    plan = plan_ce_grad(n_rows, vocab, grad_dtype=dtype_name(logits.dtype), per_row_weight=True,
                        **_opts(ignore_index, label_smoothing, z_loss, logit_softcap),
                        target=target_for(logits.device), class_weight=True)
    named = {"logits": logits.contiguous(), "labels": labels.contiguous(), "lse": lse.contiguous(),
             "lse_lo": lse_lo.contiguous(), "weight": dloss.contiguous(), "z_weight": dzloss.contiguous(),
             "class_weight": class_weight.contiguous(), "weight_sum": weight_sum.reshape(1).float()}
    (grad,) = execute(plan, {n: named[n] for n in plan.inputs})
    return grad


@_ce_bwd_weighted.register_fake
def _(logits, labels, lse, lse_lo, dloss, dzloss, class_weight, weight_sum, *options):
    return torch.empty_like(logits)


@_ce_bwd_weighted.register_vmap
def _(batch, in_dims, logits, labels, lse, lse_lo, dloss, dzloss, class_weight, weight_sum, *options):
    if in_dims[6] is not None or in_dims[7] is not None:
        return None
    rows = _rows(batch, (logits, labels, lse, lse_lo, dloss, dzloss), in_dims)
    return _ce_bwd_weighted.overload(*rows, class_weight, weight_sum, *options).unflatten(0, (batch, -1)), 0


def _ce_ext_setup_context(ctx, inputs, output):
    logits, labels, class_weight, weight_sum, *options = inputs
    _, lse, lse_lo, _, predicted = output
    ctx.mark_non_differentiable(lse, lse_lo, predicted)
    ctx.save_for_backward(logits, labels, lse, lse_lo, class_weight, weight_sum)
    ctx.options = options[:4]


def _ce_ext_backward(ctx, dloss, _lse, _lse_lo, dzloss, _predicted):
    logits, labels, lse, lse_lo, class_weight, weight_sum = ctx.saved_tensors
    none = (None,) * 9
    if (dloss is None and dzloss is None) or not ctx.needs_input_grad[0]:
        return none
    dloss = torch.zeros_like(lse) if dloss is None else dloss.float().contiguous()
    if class_weight is None:
        return (_ce_bwd(logits, labels, lse, lse_lo, dloss, *ctx.options),) + none[1:]
    if ctx.options[2] <= 0:  # no z-loss: the kernel does not read dzloss
        dzloss = dloss
    else:
        dzloss = torch.zeros_like(lse) if dzloss is None else dzloss.float().contiguous()
    return (_ce_bwd_weighted(logits, labels, lse, lse_lo, dloss, dzloss, class_weight, weight_sum, *ctx.options),
            ) + none[1:]


_ce_fwd_ext.register_autograd(_ce_ext_backward, setup_context=_ce_ext_setup_context)


# ------------------------------------------------------------------------------------ linear custom ops

def _logits_into(h: Tensor, weight: Tensor, bias: Optional[Tensor], buf: Optional[Tensor]) -> Tensor:
    """``h @ weight.T (+ bias)`` into ``buf`` (a flat buffer of at least that many elements) or a new tensor."""
    out = None if buf is None else buf[:h.shape[0] * weight.shape[0]].view(h.shape[0], weight.shape[0])
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def _run_passes(plan: LinearCEPlan, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                weights: Tensor, dh: Tensor, dw: Tensor, db: Optional[Tensor], lse: Optional[Tensor] = None,
                lse_lo: Optional[Tensor] = None, shared: Optional[dict] = None, z_weights: Optional[Tensor] = None):
    """Execute ``plan`` (see ``LinearCEPlan``): the gradients of ``sum_i w_i * loss_i`` (``weights``: float32
    (N,) or (1,), as the plan's ``per_row_weight``; with class weights ``sum_i w_i * ce_i + z_i * zloss_i``,
    ``z_weights`` alike, when the plan has a z-loss) into the given buffers (empty = not wanted). ``shared``:
    the class weights and their sum, by name, with the plan's ``class_weight``. A chunk's logits go into
    dW's storage whenever dW is computed and they fit (dW is written only in pass 2): torch's GEMMs write into
    any storage, so chunks with logits "of their own" cost nothing here either. Returns the forward's
    per-row results by name (loss, lse, lse_lo[, zloss, predicted]), else None."""
    n_rows, vocab = plan.n_rows, plan.vocab
    target = target_for(hidden.device)
    per_row = {"labels": labels}
    if plan.per_row_weight:
        per_row.update(weight=weights, z_weight=z_weights)
    whole = {**(shared or {}), **({} if plan.per_row_weight else {"weight": weights, "z_weight": z_weights})}
    if plan.forward:
        rows_out = {name: hidden.new_empty((n_rows,), dtype=torch.float32) for name in ("loss", "lse", "lse_lo")}
        if plan.split_zloss:
            rows_out["zloss"] = hidden.new_empty((n_rows,), dtype=torch.float32)
        if plan.predicted_dtype:
            rows_out["predicted"] = labels.new_empty((n_rows,))
    else:
        per_row.update(lse=lse, lse_lo=lse_lo)
    flat_dw = dw.view(-1) if dw.numel() else None
    for start, stop, _ in plan.chunk_bounds():  # pass 1
        rows = stop - start
        logits = _logits_into(hidden[start:stop], weight, bias,
                              flat_dw if flat_dw is not None and rows * vocab <= flat_dw.numel() else None)
        kernels = plan.chunk_plan(rows, target)
        named = {"logits": logits, **{n: t[start:stop] for n, t in per_row.items() if t is not None}, **whole}
        out = dict(zip(kernels.results, execute(kernels, {n: named[n] for n in kernels.inputs},
                                                out={"grad": logits} if "grad" in kernels.results else None)))
        if plan.forward:
            for name, t in rows_out.items():
                t[start:stop] = out[name]
        if plan.chunk_grads:
            torch.mm(out["grad"], weight, out=dh[start:stop])
        del logits, named, out
    if plan.forward:
        lse, lse_lo = rows_out["lse"], rows_out["lse_lo"]
        per_row.update(lse=lse, lse_lo=lse_lo)
    buffer = hidden.new_empty((plan.buffer_elements,)) if plan.buffer_elements else None
    for s in plan.slices:  # pass 2
        buf = flat_dw[plan.dw_tail_offset(s):] if s.where == "dw_tail" else buffer if s.where == "buffer" else None
        logits = _logits_into(hidden, weight[s.c0:s.c1], None if bias is None else bias[s.c0:s.c1], buf)
        kernels = plan.slice_plan(n_rows, s.c0, s.c1, target)
        named = {"logits": logits, **{n: t for n, t in per_row.items() if t is not None}, **whole}
        (grad,) = execute(kernels, {n: named[n] for n in kernels.inputs}, out={"grad": logits})
        if dw.numel():
            torch.mm(grad.t(), hidden, out=dw[s.c0:s.c1])
        if db is not None:
            db[s.c0:s.c1] = grad.sum(dim=0, dtype=torch.float32)
        del logits, grad, named
    return rows_out if plan.forward else None


def _plan(hidden: Tensor, weight: Tensor, dh: Tensor, dw: Tensor, db: Optional[Tensor], options: dict, *,
          forward: bool, chunk_size: int, class_weight: bool = False,
          predicted_dtype: Optional[str] = None) -> LinearCEPlan:
    return plan_linear_cross_entropy(
        hidden.shape[0], hidden.shape[1], weight.shape[0], dtype=dtype_name(hidden.dtype), forward=forward,
        want_dh=dh.numel() > 0, want_dw=dw.numel() > 0, want_db=db is not None, chunk_size=chunk_size or None,
        logits_into_dw_rows=True, per_row_weight=not forward, **options, target=target_for(hidden.device),
        class_weight=class_weight, predicted_dtype=predicted_dtype)


def _grad_buffers(hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
    dh = torch.empty_like(hidden) if grad_hidden else hidden.new_empty((0,))
    dw = torch.empty_like(weight) if grad_weight else weight.new_empty((0,))
    db = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device) if grad_bias else None
    return dh, dw, db


def _shared(class_weight: Optional[Tensor], weight_sum: Optional[Tensor]) -> Optional[dict]:
    if class_weight is None:
        return None
    return {"class_weight": class_weight.contiguous(), "weight_sum": weight_sum.reshape(1).float()}


@fused_op("linear_cross_entropy_fwd")
def _lce_fwd(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
             label_smoothing: float, z_loss: float, logit_softcap: float, reduction: str, chunk_size: int,
             grad_hidden: bool, grad_weight: bool, grad_bias: bool, class_weight: Optional[Tensor] = None,
             weight_sum: Optional[Tensor] = None, predicted: bool = False,
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """hidden (N, H), weight (V, H), labels (N,) -> (loss, lse, lse_lo, dh, dw, db, predicted).

    loss: float32 scalar ("mean" / "sum") or (N,) ("none"); lse, lse_lo float32 (N,) (plan_ce_fwd). With reduction "mean" /
    "sum", dh / dw / db are the gradients for an upstream gradient of 1, computed during the forward
    (:func:`_run_passes`), for the grad_* flags that are set; the others (and all three for "none") are empty.
    class_weight (V,) and its float32 sum (1,): class weights (or None); predicted: each row's argmax in the
    labels' dtype (empty unless asked for).
    """
    n_rows, _ = hidden.shape
    options = _opts(ignore_index, label_smoothing, z_loss, logit_softcap)
    fused = reduction != "none" and (grad_hidden or grad_weight or grad_bias)
    dh, dw, db = _grad_buffers(hidden, weight, bias, fused and grad_hidden, fused and grad_weight,
                               fused and grad_bias)
    # a mean multiplies by the reciprocals of its divisors, from a kernel (the JAX front-end's bits)
    scales = _mean_scales(labels, class_weight, ignore_index) if reduction == "mean" else None
    one = torch.ones(1, dtype=torch.float32, device=hidden.device)
    scale, z_scale = (scales[:1], scales[1:]) if scales is not None else (one, one)
    plan = _plan(hidden, weight, dh, dw, db, options, forward=True, chunk_size=chunk_size,
                 class_weight=class_weight is not None, predicted_dtype=dtype_name(labels.dtype) if predicted else None)
    out = _run_passes(plan, hidden, weight, bias, labels, scale, dh, dw, db, shared=_shared(class_weight, weight_sum),
                      z_weights=z_scale if plan.split_zloss else None)
    loss = _reduce(out["loss"], out.get("zloss"), reduction, (n_rows,), scales, total=_total)
    db_out = db.to(bias.dtype) if db is not None else hidden.new_empty((0,))
    return loss, out["lse"], out["lse_lo"], dh, dw, db_out, out.get("predicted", labels.new_empty((0,)))


@_lce_fwd.register_fake
def _(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, logit_softcap, reduction,
      chunk_size, grad_hidden, grad_weight, grad_bias, class_weight=None, weight_sum=None, predicted=False):
    n_rows = hidden.shape[0]
    f32 = torch.float32
    loss = hidden.new_empty((n_rows,) if reduction == "none" else (), dtype=f32)
    fused = reduction != "none"
    dh = hidden.new_empty(hidden.shape) if fused and grad_hidden else hidden.new_empty((0,))
    dw = weight.new_empty(weight.shape) if fused and grad_weight else weight.new_empty((0,))
    db = hidden.new_empty((weight.shape[0],)) if fused and grad_bias else hidden.new_empty((0,))
    return (loss, hidden.new_empty((n_rows,), dtype=f32), hidden.new_empty((n_rows,), dtype=f32), dh, dw, db,
            labels.new_empty((n_rows if predicted else 0,)))


@fused_op("linear_cross_entropy_bwd")
def _lce_bwd(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], lse: Tensor,
             lse_lo: Tensor, dloss: Tensor, ignore_index: int, label_smoothing: float, z_loss: float, logit_softcap: float,
             chunk_size: int, grad_hidden: bool, grad_weight: bool, grad_bias: bool,
             class_weight: Optional[Tensor] = None, weight_sum: Optional[Tensor] = None,
             dzloss: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of sum_i dloss_i * loss_i (dloss float32 (N,); with class weights sum_i (dloss_i * ce_i +
    dzloss_i * zloss_i), dzloss given with a z-loss) by recomputing the logits from the forward's lse
    (:func:`_run_passes`): returns (dh, dw, db), empty where the flag is not set."""
    options = _opts(ignore_index, label_smoothing, z_loss, logit_softcap)
    dh, dw, db = _grad_buffers(hidden, weight, bias, grad_hidden, grad_weight, grad_bias)
    plan = _plan(hidden, weight, dh, dw, db, options, forward=False, chunk_size=chunk_size,
                 class_weight=class_weight is not None)
    _run_passes(plan, hidden, weight, bias, labels, dloss, dh, dw, db, lse, lse_lo,
                shared=_shared(class_weight, weight_sum), z_weights=dzloss if plan.split_zloss else None)
    return dh, dw, db.to(bias.dtype) if db is not None else hidden.new_empty((0,))


@_lce_bwd.register_fake
def _(hidden, weight, labels, bias, lse, lse_lo, dloss, ignore_index, label_smoothing, z_loss, logit_softcap,
      chunk_size, grad_hidden, grad_weight, grad_bias, class_weight=None, weight_sum=None, dzloss=None):
    dh = hidden.new_empty(hidden.shape) if grad_hidden else hidden.new_empty((0,))
    dw = weight.new_empty(weight.shape) if grad_weight else weight.new_empty((0,))
    db = hidden.new_empty((weight.shape[0],)) if grad_bias else hidden.new_empty((0,))
    return dh, dw, db


def _lce_setup_context(ctx, inputs, output):
    (hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, logit_softcap, reduction, chunk_size,
     grad_hidden, grad_weight, grad_bias, *extra) = inputs
    class_weight, weight_sum = (tuple(extra[:2]) + (None, None))[:2]
    _, lse, lse_lo, dh, dw, db, predicted = output
    ctx.mark_non_differentiable(lse, lse_lo, dh, dw, db, predicted)
    ctx.reduction = reduction
    ctx.flags = (grad_hidden, grad_weight, grad_bias and bias is not None)
    ctx.options = (ignore_index, label_smoothing, z_loss, logit_softcap, chunk_size)
    ctx.n_inputs = len(inputs)
    saved = (hidden, weight, labels, bias, lse, lse_lo, class_weight, weight_sum)  # references: no memory
    ctx.handover = None
    if reduction != "none":
        if plain_eager((dh, dw, db)):
            ctx.handover = [dh, dw, db]
        else:  # traced (compile, AOT, fake tensors): tensors must pass through save_for_backward
            saved += (dh, dw, db)
    ctx.save_for_backward(*saved)


def _lce_backward(ctx, dloss, *_):
    """With reduction "mean" / "sum" the forward computed the gradients for an upstream gradient of 1.

    Eager: the first backward *hands them over*, scaled in place, and drops its own references, so no copy
    is made (a copy of dW alone is 1 GB at V=128256, H=4096) and autograd can move them into ``.grad``
    without cloning. Traced (torch.compile): they come from saved tensors and are scaled out of place. A
    retained graph that runs this node again after the hand-over, and reduction "none", recompute the
    gradients from the saved lse, chunk by chunk (four GEMMs)."""
    gh, gw, gb = ctx.flags
    gh, gw, gb = gh and ctx.needs_input_grad[0], gw and ctx.needs_input_grad[1], gb and ctx.needs_input_grad[3]
    nothing = (None,) * ctx.n_inputs
    if dloss is None or not (gh or gw or gb):
        return nothing
    hidden, weight, labels, bias, lse, lse_lo, class_weight, weight_sum, *fwd_grads = ctx.saved_tensors
    ii, ls, zl, cap, chunk = ctx.options
    g = dloss.float()
    if ctx.handover is not None:
        grads, ctx.handover = ctx.handover, None
        dh, dw, db = (t.mul_(g) if need else None for t, need in zip(grads, (gh, gw, gb)))
    elif fwd_grads:
        dh, dw, db = (t * g if need else None for t, need in zip(fwd_grads, (gh, gw, gb)))
    else:
        if ctx.reduction == "none":
            row_weights = z_weights = g.contiguous()
        else:  # the upstream gradient of the sum / mean, spread over the rows (ignored rows get 0 anyway)
            if ctx.reduction == "mean":  # the forward's multiplies (see _mean_scales)
                scales = _ce_mean_scales(labels, class_weight, ii)
                row_weights, z_weights = (g * scales[0]).reshape(1), (g * scales[1]).reshape(1)
            else:
                row_weights = z_weights = g.reshape(1)
            row_weights = row_weights.expand(labels.shape[0]).contiguous()
            z_weights = z_weights.expand(labels.shape[0]).contiguous()
        dh, dw, db = _lce_bwd(hidden, weight, labels, bias, lse, lse_lo, row_weights, ii, ls, zl, cap, chunk,
                              gh, gw, gb, class_weight, weight_sum,
                              z_weights if class_weight is not None and zl > 0 else None)
    return (dh if gh else None, dw if gw else None, None, db if gb else None) + nothing[4:]


_lce_fwd.register_autograd(_lce_backward, setup_context=_lce_setup_context)


# ---------------------------------------------------------------------------------------- public API

def _shape_dtype(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), dtype_name(t.dtype))


def _validate_label_values(labels: Tensor, vocab: int, ignore_index: int, validate: Optional[bool]) -> None:
    """Raise on labels outside [0, V) that are not ignore_index. ``validate`` None checks CPU labels only:
    on a GPU the check reads a boolean back (a host sync per call, no CUDA-graph capture), so there it runs
    only when asked; unchecked rows get a NaN loss from the kernels. Never under torch.compile."""
    if validate is False or (validate is None and labels.device.type != "cpu") or torch.compiler.is_compiling():
        return
    labels = underlying(labels)  # under vmap: every element's labels
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(bad_label_message(int(bad.sum()), int(labels[bad][0]), vocab, ignore_index))


def _reduce(loss_rows: Tensor, z_rows: Optional[Tensor], reduction: str, lead, scales: Optional[Tensor],
            total=None) -> Tensor:
    """The loss of ``reduction`` from the rows' ce terms and, where they are apart (class weights and a
    z-loss), their z-loss terms. "mean" multiplies their sums by ``scales`` (:func:`_mean_scales`: 1 / W and
    1 / count), "sum" adds them; the sums come from a kernel in a fixed order (:func:`_ce_total`, or
    ``total`` inside another op's implementation), so that loss and gradient have the JAX front-end's bits."""
    if reduction == "none":
        return (loss_rows if z_rows is None else loss_rows + z_rows).view(lead)
    return (total or _ce_total)(loss_rows, z_rows, scales if reduction == "mean" else None).reshape(())


def _check_class_weight_grad(name: str, class_weight: Optional[Tensor]) -> None:
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: class weights are constants (no gradient, as in "
                         f"torch.nn.functional.cross_entropy, which refuses them too); pass {name}.detach()")


def _extras_output(loss: Tensor, lse: Tensor, predicted: Tensor, labels: Tensor, ignore_index: int, lead,
                   return_lse: bool, return_accuracy: bool, return_predicted: bool):
    predicted = predicted.view(lead)
    accuracy = (predicted == labels.view(lead)) & (labels.view(lead) != ignore_index) if return_accuracy else None
    return CrossEntropyOutput(loss, lse.view(lead) if return_lse else None, accuracy,
                              predicted if return_predicted else None)


def cross_entropy(logits: Tensor, labels: Tensor, *, weight: Optional[Tensor] = None, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, logit_softcap: float = 0.0,
                  reduction: str = "mean", return_lse: bool = False, return_accuracy: bool = False,
                  return_predicted: bool = False, validate_labels: Optional[bool] = None
                  ) -> Tensor | tuple[Tensor, Tensor] | CrossEntropyOutput:
    """Fused softmax cross-entropy: ``loss_i = (1-s) w_y (lse_i - z_iy) + s/V sum_j w_j (lse_i - z_ij) + z_loss*lse_i^2``, ``z = cap*tanh(x/cap)``.

    One read of the logits forward (online softmax over the vocabulary, in fp32), one read and one write
    of the gradient backward. Runs on CUDA tensors or on the CPU (Triton interpreter).

    Args:
        logits: ``(..., V)`` float32 / float16 / bfloat16.
        labels: ``(...)`` int32 / int64 class indices in ``[0, V)``, or ``ignore_index``.
        weight: optional class weights ``w``, ``(V,)`` of a float dtype, as in
            ``torch.nn.functional.cross_entropy``: the label's term is scaled by ``w_y``, the smoothing term
            weighs class ``j`` by ``w_j``, and "mean" divides by the sum of ``w_y`` over the rows not ignored.
            Any values (negative ones too; a NaN makes the losses that read it NaN). The z-loss is not
            class-weighted (as in liger-kernel): each row adds ``z_loss * lse^2`` and "mean" divides their
            sum by the number of rows not ignored. Constants for autograd: a weight that requires grad is
            refused (as torch does).
        ignore_index: label of rows that contribute nothing (no loss, zero gradient).
        label_smoothing: ``s`` in [0, 1): mixes the one-hot target with the uniform distribution (as
            ``torch.nn.functional.cross_entropy``).
        z_loss: coefficient of the PaLM auxiliary loss ``lse^2`` (0 = off).
        logit_softcap: ``cap > 0`` applies ``cap * tanh(x / cap)`` before the softmax (0 = off).
        reduction: "mean" (over rows whose label is not ignored; 0 with zero gradients when all are),
            "sum" or "none".
        return_lse: also return the float32 ``(...)`` log-sum-exp (not differentiable).
        return_accuracy, return_predicted: also return, per row, whether the argmax of its logits is its
            label (bool; False for ignored rows) and that argmax (the labels' dtype; ties to the lowest
            index, as ``torch.argmax``; every row, ignored ones too), found in the forward's pass over the
            vocabulary. A row with a NaN logit has a NaN loss and an unspecified argmax.
        validate_labels: True raises a ValueError naming ``labels`` when a label is outside ``[0, V)``
            and not ``ignore_index``; False never checks, and such a row gets a NaN loss and NaN gradients
            instead (as under torch.compile, where the check never runs). None (default): check labels on
            the CPU; on a GPU the check would wait for the device every call (a host sync, which also rules
            out CUDA-graph capture), so there it runs only with True.

    Returns:
        The float32 loss (a scalar, or ``(...)`` for "none"), and the lse with ``return_lse``; with
        ``return_accuracy`` or ``return_predicted`` a :class:`CrossEntropyOutput` ``(loss, lse, accuracy,
        predicted)`` whose fields not asked for are None.

    Example::

        >>> logits = torch.randn(4, 10, requires_grad=True)
        >>> loss = cross_entropy(logits, torch.tensor([1, 2, -100, 9]))
        >>> loss.backward()
        >>> out = cross_entropy(logits, torch.tensor([1, 2, -100, 9]), weight=torch.rand(10), return_accuracy=True)
        >>> out.loss.backward()
        >>> accuracy = out.accuracy.sum() / 3  # of the 3 labels not ignored
    """
    device = check_tensors({"logits": logits, "labels": labels, "weight": weight}, required=("logits", "labels"))
    n_rows, vocab = check_cross_entropy_args(
        logits=_shape_dtype(logits), labels=_shape_dtype(labels), ignore_index=ignore_index,
        label_smoothing=label_smoothing, z_loss=z_loss, logit_softcap=logit_softcap, reduction=reduction,
        weight=_shape_dtype(weight))
    del device
    _check_class_weight_grad("weight", weight)
    lead = tuple(labels.shape)
    x = logits.reshape(n_rows, vocab).contiguous()
    y = labels.reshape(n_rows).contiguous()
    _validate_label_values(y, vocab, ignore_index, validate_labels)
    options = (int(ignore_index), float(label_smoothing), float(z_loss), float(logit_softcap))
    scales = _ce_mean_scales(y, weight, int(ignore_index)) if reduction == "mean" else None
    if weight is None and not (return_accuracy or return_predicted):
        loss_rows, lse, _ = _ce_fwd(x, y, *options)
        loss = _reduce(loss_rows, None, reduction, lead, scales)
        return (loss, lse.view(lead)) if return_lse else loss
    weight_sum = None if weight is None else _ce_weight_sum(weight)
    loss_rows, lse, _, z_rows, predicted = _ce_fwd_ext(x, y, weight, weight_sum, *options,
                                                       return_accuracy or return_predicted)
    loss = _reduce(loss_rows, z_rows if z_rows.numel() else None, reduction, lead, scales)
    if not (return_accuracy or return_predicted):
        return (loss, lse.view(lead)) if return_lse else loss
    return _extras_output(loss, lse, predicted, y, ignore_index, lead, return_lse, return_accuracy,
                          return_predicted)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Optional[Tensor] = None,
                         class_weight: Optional[Tensor] = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, logit_softcap: float = 0.0,
                         reduction: str = "mean", chunk_size: Optional[int] = None, return_lse: bool = False,
                         return_accuracy: bool = False, return_predicted: bool = False,
                         validate_labels: Optional[bool] = None
                         ) -> Tensor | tuple[Tensor, Tensor] | CrossEntropyOutput:
    """Cross-entropy of a vocabulary projection without the ``(N, V)`` logits: ``cross_entropy(hidden @ weight.T + bias, labels)``.

    The tokens are processed in chunks (see the module docstring for the design): the peak extra memory
    is the gradients plus one chunk's logits and their gradient. Gradients flow to hidden, weight and
    bias (only to those that require grad).

    Args:
        hidden: ``(..., H)`` float32 / float16 / bfloat16; every leading dimension is a token.
        weight: ``(V, H)`` in hidden's dtype (the ``nn.Linear`` / tied-embedding layout).
        labels: ``(...)`` int32 / int64, hidden's leading shape.
        bias: optional ``(V,)`` in hidden's dtype.
        class_weight: optional class weights ``(V,)``: :func:`cross_entropy`'s ``weight`` (named apart from
            the projection's weight).
        ignore_index, label_smoothing, z_loss, logit_softcap, reduction, return_lse, return_accuracy,
            return_predicted, validate_labels: as in :func:`cross_entropy` (the argmax is that of the
            logits ``hidden @ weight.T + bias`` as computed, in hidden's dtype).
        chunk_size: tokens per chunk. None (as in JAX): when the weight's gradient is computed, chunks of H
            tokens whose logits live in its storage, the rest in chunks of ``max(64, H // 16)`` tokens
            (``core_kernels.cross_entropy.plan.plan_linear_cross_entropy``).

    Returns:
        The float32 loss (a scalar, or ``(...)`` for "none"), and the float32 lse ``(...)`` with
        ``return_lse``; with ``return_accuracy`` or ``return_predicted`` a :class:`CrossEntropyOutput`.

    Example::

        >>> h = torch.randn(6, 32, requires_grad=True)
        >>> w = torch.randn(1000, 32, requires_grad=True)
        >>> loss = linear_cross_entropy(h, w, torch.randint(0, 1000, (6,)), chunk_size=4)
        >>> loss.backward()
    """
    check_tensors({"hidden": hidden, "weight": weight, "labels": labels, "bias": bias,
                   "class_weight": class_weight}, required=("hidden", "weight", "labels"))
    n_rows, h, vocab = check_linear_cross_entropy_args(
        hidden=_shape_dtype(hidden), weight=_shape_dtype(weight), labels=_shape_dtype(labels),
        bias=_shape_dtype(bias), ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
        logit_softcap=logit_softcap, reduction=reduction, chunk_size=chunk_size,
        class_weight=_shape_dtype(class_weight))
    _check_class_weight_grad("class_weight", class_weight)
    lead = tuple(labels.shape)
    h2 = hidden.reshape(n_rows, h).contiguous()
    w = weight.contiguous()
    y = labels.reshape(n_rows).contiguous()
    b = None if bias is None else bias.contiguous()
    _validate_label_values(y, vocab, ignore_index, validate_labels)
    cw = None if class_weight is None else class_weight.contiguous()
    weight_sum = None if cw is None else _ce_weight_sum(cw)
    extras = return_accuracy or return_predicted
    grad_on = torch.is_grad_enabled()
    loss, lse, _, _, _, _, predicted = _lce_fwd(
        h2, w, y, b, int(ignore_index), float(label_smoothing), float(z_loss), float(logit_softcap), reduction,
        int(chunk_size or 0), grad_on and h2.requires_grad, grad_on and w.requires_grad,
        grad_on and b is not None and b.requires_grad, cw, weight_sum, extras)
    if reduction == "none":
        loss = loss.view(lead)
    if extras:
        return _extras_output(loss, lse, predicted, y, ignore_index, lead, return_lse, return_accuracy,
                              return_predicted)
    return (loss, lse.view(lead)) if return_lse else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """``nn.Module`` form of :func:`linear_cross_entropy`, called as ``loss_fn(hidden, weight, labels)``.
    ``class_weight`` (optional, ``(V,)``) is registered as a buffer: it follows ``.to()`` and is saved in
    the state dict, as ``nn.CrossEntropyLoss``'s ``weight``.

    Example::

        >>> head = torch.nn.Linear(32, 1000, bias=False)
        >>> loss_fn = LinearCrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
        >>> loss = loss_fn(torch.randn(6, 32), head.weight, torch.randint(0, 1000, (6,)))
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                 logit_softcap: float = 0.0, reduction: str = "mean", chunk_size: Optional[int] = None,
                 return_lse: bool = False, validate_labels: Optional[bool] = None,
                 class_weight: Optional[Tensor] = None, return_accuracy: bool = False,
                 return_predicted: bool = False) -> None:
        super().__init__()
        self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
        self.logit_softcap, self.reduction, self.chunk_size, self.return_lse = (
            logit_softcap, reduction, chunk_size, return_lse)
        self.validate_labels = validate_labels
        self.return_accuracy, self.return_predicted = return_accuracy, return_predicted
        self.register_buffer("class_weight", class_weight)

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None
                ) -> Tensor | tuple[Tensor, Tensor] | CrossEntropyOutput:
        return linear_cross_entropy(
            hidden, weight, labels, bias=bias, class_weight=self.class_weight, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, logit_softcap=self.logit_softcap,
            reduction=self.reduction, chunk_size=self.chunk_size, return_lse=self.return_lse,
            return_accuracy=self.return_accuracy, return_predicted=self.return_predicted,
            validate_labels=self.validate_labels)

    def extra_repr(self) -> str:
        extras = "".join(f", {name}=True" for name in ("return_accuracy", "return_predicted") if getattr(self, name))
        return (f"ignore_index={self.ignore_index}, label_smoothing={self.label_smoothing}, "
                f"z_loss={self.z_loss}, logit_softcap={self.logit_softcap}, reduction={self.reduction!r}, "
                f"chunk_size={self.chunk_size}" + (", class_weight=(...)" if self.class_weight is not None else "")
                + extras)
