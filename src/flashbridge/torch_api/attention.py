"""FlashAttention for PyTorch: ``torch.library`` custom ops with fake kernels and autograd, an
SDPA-compatible function and a ``torch.nn.MultiheadAttention`` drop-in.

Two ops carry the family, ``flashbridge::flash_attn_fwd`` and ``flashbridge::flash_attn_bwd``; the public
functions only check arguments and normalise options. Both ops take q / k / v as strided views (last
dimension contiguous) on CUDA, so the BHSD -> BSHD transpose of the SDPA wrapper costs no copy.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core_kernels.flash_attn.plan import (AttnOptions, check_attention_args, check_cache_options,
                                            check_cu_seqlens_values, check_dropout, plan_attention_bwd,
                                            plan_attention_fwd)
from ._checks import check_seed, check_tensors, seed_tensor
from ._ops import fused_op, underlying, vmapped_at
from ._runtime import dtype_name, execute, memoised, target_for

# validation and plans run once per distinct argument signature (see memoised)
check_attention_args, plan_attention_fwd, plan_attention_bwd = map(
    memoised, (check_attention_args, plan_attention_fwd, plan_attention_bwd))


def _info(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), dtype_name(t.dtype))


def _prepare(t: Tensor) -> Tensor:
    # The interpreter (CPU) and the bf16 widening there want plain contiguous buffers; CUDA kernels take
    # any (batch, row, head) strides as long as the head dim is contiguous.
    if t.device.type != "cuda" or t.stride(-1) != 1:
        return t.contiguous()
    return t


def _strides(t: Tensor) -> tuple[int, int, int]:
    if t.dim() == 4:
        return (t.stride(0), t.stride(1), t.stride(2))
    return (0, t.stride(0), t.stride(1))


def _problem(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
             softmax_scale, causal, window_left, window_right, softcap, dropout_p=0.0):
    """Rebuild the validated (shape, options) inside an op from its flat arguments."""
    shape, _ = check_attention_args(
        q=_info(q), k=_info(k), v=_info(v), alibi_slopes=_info(alibi_slopes), sinks=_info(sinks),
        cu_seqlens_q=_info(cu_seqlens_q), cu_seqlens_k=_info(cu_seqlens_k), max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k)
    return shape, op_options(alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap,
                             dropout_p)


def op_options(alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap,
               dropout_p=0.0) -> AttnOptions:
    """The AttnOptions of an attention op's flat arguments."""
    return AttnOptions(
        softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, has_alibi=alibi_slopes is not None,
        alibi_batched=alibi_slopes is not None and alibi_slopes.dim() == 2, has_sinks=sinks is not None,
        dropout_p=dropout_p)


# -------------------------------------------------------------------------------------------------- ops

@fused_op("flash_attn_fwd", replay=True)
def _flash_attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int], softmax_scale: float, causal: bool, window_left: Optional[int],
    window_right: Optional[int], softcap: float, seed: Optional[Tensor] = None, dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Returns (out, lse): out in q's layout with v's head dim, lse float32 (B, Hq, Sq) or (Hq, total_q).
    ``seed``: int32 (1,), used when dropout_p > 0."""
    shape, options = _problem(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    plan = plan_attention_fwd(shape, options, target=target_for(q.device),
                              strides={"q": _strides(q), "k": _strides(k), "v": _strides(v)})
    given = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks,
             "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "seed": seed}
    out, lse = execute(plan, {n: given[n].contiguous() if n not in ("q", "k", "v") else given[n]
                              for n in plan.inputs})
    return out, lse


@_flash_attn_fwd.register_fake
def _(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
      causal, window_left, window_right, softcap, seed=None, dropout_p=0.0):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is not None:
        lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
    return out, lse


def _fold_batch(batch: int, args: dict) -> Optional[dict]:
    """Batching rule helper: ``args`` maps names to (tensor, vmapped dim); returns each batch-first tensor
    as ``(vmapped * B, ...)``, the vmapped dimension folded into the batch, or None where the op cannot
    fold: packed sequences, or vmapped sinks (one set per call; their gradient sums over the batch).
    ALiBi slopes of one element, ``(Hq,)``, become ``(B, Hq)`` rows; shared ones stay as they are."""
    if args["cu_seqlens_q"][0] is not None or args["sinks"][1] is not None:
        return None
    q, q_dim = args["q"]
    n_batch = q.shape[0] if q_dim is None else q.movedim(q_dim, 0).shape[1]
    folded = {}
    for name, (t, d) in args.items():
        if t is None or name in ("sinks", "cu_seqlens_q", "cu_seqlens_k") or (name == "alibi_slopes" and d is None
                                                                               and t.dim() == 1):
            folded[name] = t
            continue
        t = vmapped_at(t, d, batch)
        if name == "alibi_slopes" and t.dim() == 2:
            t = t.unsqueeze(1).expand(batch, n_batch, t.shape[-1])
        folded[name] = t.reshape(-1, *t.shape[2:])
    return folded


@_flash_attn_fwd.register_vmap
def _(batch, in_dims, q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, *options):
    names = ("q", "k", "v", "alibi_slopes", "sinks", "cu_seqlens_q")
    f = _fold_batch(batch, dict(zip(names, zip((q, k, v, alibi_slopes, sinks, cu_seqlens_q), in_dims))))
    if f is None or (len(options) > 7 and options[-1] > 0):  # dropout: the mask depends on the batch index
        return None
    out, lse = _flash_attn_fwd.overload(f["q"], f["k"], f["v"], f["alibi_slopes"], sinks, None, None, *options)
    return (out.unflatten(0, (batch, -1)), lse.unflatten(0, (batch, -1))), (0, 0)


@fused_op("flash_attn_bwd", replay=True)
def _flash_attn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
    softmax_scale: float, causal: bool, window_left: Optional[int], window_right: Optional[int], softcap: float,
    alibi_grad: bool, seed: Optional[Tensor] = None, dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dsinks, dalibi, dalibi_part); dsinks is empty ``(0,)`` without sinks, dalibi (the
    slopes' shape) and dalibi_part (float32 ``(batch, Hq)``, per sequence) without ``alibi_grad``."""
    shape, options = _problem(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, dropout_p)
    q, k, v, dout = _prepare(q), _prepare(k), _prepare(v), _prepare(dout)
    alibi_grad = alibi_grad and alibi_slopes is not None
    plan = plan_attention_bwd(
        shape, options, target=target_for(q.device), has_dlse=dlse is not None,
        sinks_dtype=None if sinks is None else dtype_name(sinks.dtype),
        alibi_grad=dtype_name(alibi_slopes.dtype) if alibi_grad else None,
        strides={"q": _strides(q), "k": _strides(k), "v": _strides(v), "dout": _strides(dout)})
    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dlse": dlse,
             "alibi_slopes": alibi_slopes, "sinks": sinks, "cu_seqlens_q": cu_seqlens_q,
             "cu_seqlens_k": cu_seqlens_k, "seed": seed}
    results = execute(plan, {n: given[n] if n in ("q", "k", "v", "dout") else given[n].contiguous()
                             for n in plan.inputs})
    dq, dk, dv = results[:3]
    rest = list(results[3:])
    dsinks = rest.pop(0) if sinks is not None else q.new_empty((0,))
    if sinks is not None:
        rest.pop(0)  # dsinks_part
    dalibi, dalibi_part = (rest[0], rest[1]) if alibi_grad else (q.new_empty((0,)), q.new_empty((0,)))
    return dq, dk, dv, dsinks, dalibi, dalibi_part


@_flash_attn_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap, alibi_grad, seed=None,
      dropout_p=0.0):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    if alibi_grad and alibi_slopes is not None:
        n_seqs = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        dalibi = alibi_slopes.new_empty(alibi_slopes.shape)
        dalibi_part = q.new_empty((n_seqs, q.shape[-2]), dtype=torch.float32)
    else:
        dalibi, dalibi_part = q.new_empty((0,)), q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks, dalibi, dalibi_part


@_flash_attn_bwd.register_vmap
def _(batch, in_dims, dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, *options):
    names = ("dout", "q", "k", "v", "out", "lse", "dlse", "alibi_slopes", "sinks", "cu_seqlens_q")
    f = _fold_batch(batch, dict(zip(names, zip((dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, cu_seqlens_q),
                                               in_dims))))
    if f is None or sinks is not None or (len(options) > 8 and options[-1] > 0):
        return None  # the sinks gradient of a vmapped call: one sum over the batch per element
    dq, dk, dv, dsinks, dalibi, part = _flash_attn_bwd.overload(
        f["dout"], f["q"], f["k"], f["v"], f["out"], f["lse"], f["dlse"], f["alibi_slopes"], sinks, None, None,
        *options)
    unfold = lambda t: t.unflatten(0, (batch, -1))  # noqa: E731
    alibi_dim = None
    if options[-1] and alibi_slopes is not None:  # alibi_grad: each element's slopes get their own gradient
        one_per_head = alibi_slopes.dim() - (in_dims[7] is not None) == 1
        # slopes (Hq,) of one element: the sum of its sequences' terms; (B, Hq): its sequences' rows
        dalibi = (unfold(part).sum(1) if one_per_head else unfold(dalibi)).to(alibi_slopes.dtype)
        part, alibi_dim = unfold(part), 0
    return (unfold(dq), unfold(dk), unfold(dv), dsinks, dalibi, part), (0, 0, 0, None, alibi_dim, alibi_dim)


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
     causal, window_left, window_right, softcap, *drop) = inputs
    seed, dropout_p = drop if drop else (None, 0.0)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seed)
    ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap)
    ctx.dropout_p = dropout_p


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seed = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    alibi_grad = alibi_slopes is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dsinks, dalibi, _ = _flash_attn_bwd(
        dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, *ctx.options, alibi_grad,
        seed, ctx.dropout_p)
    # one gradient per argument as given (seed and dropout_p are optional)
    return (dq, dk, dv, dalibi if alibi_grad else None, dsinks if sinks is not None else None,
            *([None] * (len(ctx.needs_input_grad) - 5)))


_flash_attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def _attention(q, k, v, options: AttnOptions, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
               max_seqlen_k, seed: Optional[Tensor] = None):
    # without dropout the optional (seed, dropout_p) stay off the call: the op's schema defaults
    dropout = (seed, float(options.dropout_p)) if options.dropout_p > 0 else ()
    return _flash_attn_fwd(
        q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        float(options.softmax_scale), bool(options.causal), options.window_left, options.window_right,
        float(options.softcap), *dropout)


# ----------------------------------------------------------------------------------------------- public

def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                    alibi_slopes: Optional[Tensor] = None, softcap: float = 0.0, sinks: Optional[Tensor] = None,
                    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                    deterministic: bool = True, return_lse: bool = False, block_mask=None, dropout_p: float = 0.0,
                    seed: Optional[int | Tensor] = None, block_table: Optional[Tensor] = None,
                    seqused_k: Optional[Tensor] = None) -> Tensor | tuple[Tensor, Tensor]:
    """``out = softmax(mods(softmax_scale * q @ k^T)) @ v`` without materialising the scores.

    Args:
        q: ``(B, Sq, Hq, Dqk)``, or packed ``(total_q, Hq, Dqk)`` with ``cu_seqlens_q``; float16, bfloat16 or
            float32 (accumulation is float32); CUDA or CPU (Triton interpreter). ``1 <= Dqk <= 256``.
        k: ``(B, Sk, Hkv, Dqk)`` or ``(total_k, Hkv, Dqk)``, q's dtype; ``Hq`` a multiple of ``Hkv`` (GQA/MQA).
        v: ``(B, Sk, Hkv, Dv)`` or ``(total_k, Hkv, Dv)``; ``Dv`` may differ from ``Dqk`` (``1 <= Dv <= 256``).
        causal: query i sees keys ``j <= i + Sk - Sq`` (aligned to the bottom-right corner, flash-attn 2.1+).
            Rows that see no key output 0 and lse -inf.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.
        window_size: ``(left, right)``: query i sees keys ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``;
            -1 leaves a side unbounded. Combines with causal (which sets right to 0).
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)`` float: adds ``-slope * |i + Sk - Sq - j|`` to the scores,
            computed in the kernel. Differentiable: with ``requires_grad`` the backward also returns their
            gradient (computed by the dQ kernel, deterministic; no cost when they need none).
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (applied before ALiBi).
        sinks: ``(Hq,)`` float: a learnable per-head logit that joins the softmax denominator and attends to
            nothing (gpt-oss / StreamingLLM); its gradient is returned.
        cu_seqlens_q, cu_seqlens_k: int32 ``(n_seqs + 1,)`` offsets of packed sequences (start 0, end at
            the packed length); then ``max_seqlen_q`` / ``max_seqlen_k`` (Python ints) bound the lengths.
        deterministic: the backward is always deterministic (no atomics; bitwise identical across runs);
            the flag is accepted for flash-attn compatibility.
        return_lse: also return the float32 log-sum-exp ``(B, Hq, Sq)`` (packed: ``(Hq, total_q)``),
            natural log; gradients flowing into it are supported.
        block_mask: a :class:`flashbridge.masks.BlockMask` for ``(Sq, Sk)`` (per batch / query head or shared):
            only the key blocks it lists are visited (block-sparse attention); rows that see nothing output 0
            and lse -inf. Combines with softcap, ALiBi, sinks, GQA; not with causal / window_size (build that
            into the mask) or packed inputs.
        dropout_p: attention dropout on the probabilities (after the softmax, before ``@ v``) at the rate
            ``p_q = round(256 * dropout_p) / 256`` (p rounded to a multiple of 1/256, halves up; 0.1 ->
            0.1015625; p >= 511/512 is refused): each is kept with probability ``1 - p_q`` and scaled by
            ``1 / (1 - p_q)``, so the expectation is exact; lse stays the undropped softmax's (as flash-attn).
            The mask is a function of ``(seed, batch, head, query, key)`` (Philox, one draw per 16 elements,
            ``flashbridge.reference.attention.attention_dropout_mask``): the same seed gives the same mask
            here, in ``flashbridge.jax_api``, on CPU and GPU, and the backward regenerates it. 0 costs
            nothing.
        seed: a Python int (int32 range) or a one-element integer tensor; required when ``dropout_p > 0``.
        block_table: int32 ``(B, max_pages)``: k / v are a paged cache ``(num_pages, page_size, Hkv, D)``;
            key ``j`` of sequence ``b`` is slot ``j % page_size`` of page ``block_table[b, j // page_size]``
            (flash-attn's ``flash_attn_varlen_func(..., block_table=)``: chunked prefill). Needs
            ``seqused_k``, no ``cu_seqlens_k``; q packed or ``(B, Sq, Hq, Dqk)``. Page sizes: powers of two
            or multiples of 128. Page indices are clamped to the pool.
        seqused_k: int32 ``(B,)``: sequence ``b`` uses its first ``seqused_k[b]`` keys (clamped to the
            cache's capacity); causal and windows align at the bottom-right of (its queries, its used keys).
            Without ``block_table``: k / v dense ``(B, S_max, Hkv, D)`` (q dense or packed) or packed with
            ``cu_seqlens_k``. With either argument the call is forward-only (inference): a gradient reaching
            it raises; ``block_mask`` is not supported.

    Non-finite values follow IEEE arithmetic, as the float64 reference (``flashbridge.reference``): a NaN in
    anything a row sees (its query, a visible key or value, its ALiBi slope or sink) makes the row's ``out``
    NaN, and its ``lse`` NaN unless only values hold it, so that a later merge of partial states never takes
    it for a row that saw nothing; a +inf score or sink gives lse +inf. Keys a row does not see (masked,
    past its sequence, in other packed sequences) never reach it, with one limit shared by every MMA-based
    attention: inside one key tile, a NaN *value* of a key that the row does not see (the causal diagonal's
    tile, a window edge, a partial block) reaches it through ``0 * NaN`` in ``p @ v``.

    Returns:
        ``out`` ``(B, Sq, Hq, Dv)`` (packed ``(total_q, Hq, Dv)``) in q's dtype, or ``(out, lse)``.

    Example::

        >>> q, k, v = (torch.randn(2, 128, 8, 64) for _ in range(3))
        >>> out = flash_attention(q, k, v, causal=True)
        >>> out.shape
        torch.Size([2, 128, 8, 64])
    """
    tensors = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks,
               "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    check_tensors({**tensors, "block_table": block_table, "seqused_k": seqused_k}, required=("q", "k", "v"))
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if block_table is not None or seqused_k is not None:
        check_cache_options(block_mask=block_mask, dropout_p=dropout_p)
        from .attention_cache import cache_attention
        out, lse = cache_attention(q, k, v, block_table=block_table, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                                   sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
        return (out, lse) if return_lse else out
    shape, options = check_attention_args(
        **{n: _info(t) for n, t in tensors.items()}, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    if seed is not None:
        check_seed(seed)
    dropout_p = check_dropout(dropout_p, seed is not None)
    seed_t = None
    if dropout_p > 0:
        options = dataclasses.replace(options, dropout_p=dropout_p)
        seed_t = seed_tensor(seed, q.device)
    if (shape.varlen and not torch.compiler.is_compiling()
            and underlying(cu_seqlens_q) is cu_seqlens_q and underlying(cu_seqlens_k) is cu_seqlens_k):
        # Reading the offsets costs a device sync on CUDA (one for both: they usually are one tensor); under
        # torch.compile (or vmapped: no values of their own) they stay on the device and the kernels clamp
        # every access to the packed tensors.
        if cu_seqlens_k is cu_seqlens_q:
            offsets_q = offsets_k = cu_seqlens_q.tolist()
        else:
            both = torch.cat([cu_seqlens_q, cu_seqlens_k]).tolist()
            offsets_q, offsets_k = both[:cu_seqlens_q.numel()], both[cu_seqlens_q.numel():]
        check_cu_seqlens_values(offsets_q, offsets_k, shape)
    if block_mask is not None:
        from .block_sparse import block_sparse_attention
        out, lse = block_sparse_attention(q, k, v, block_mask, shape, options, alibi_slopes, sinks, seed_t)
    else:
        out, lse = _attention(q, k, v, options, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                              max_seqlen_q, max_seqlen_k, seed_t)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: Optional[float] = None, enable_gqa: bool = False) -> Tensor:
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention`: ``softmax(q k^T * scale) v``.

    Same layout (``(..., H, L, E)`` query, ``(..., H_kv, S, E)`` key, ``(..., H_kv, S, Ev)`` value, at least
    3 dims; a 3-D input has one head) and the same causal convention as SDPA (``is_causal`` masks keys
    ``j > i``, aligned to the top-left corner). ``attn_mask`` must be None: flash kernels never materialise a
    mask or the weights; use :func:`flash_attention` for sliding windows, ALiBi, softcap and sinks.
    ``dropout_p > 0`` draws the dropout seed from torch's default generator (as SDPA draws its mask), then
    runs :func:`flash_attention`'s dropout.

    Example::

        >>> q = k = v = torch.randn(2, 8, 128, 64)
        >>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
    """
    if attn_mask is not None:
        raise ValueError("attn_mask: only None is supported (use is_causal=True for causal masking, or "
                         "flashbridge.torch_api.flash_attention for windows / ALiBi / varlen)")
    dropout_p = check_dropout(dropout_p, True)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(f"{name}: expected at least 3 dimensions (..., L, E), got shape {tuple(t.shape)}")
    if not (query.dim() == key.dim() == value.dim()):
        raise ValueError(f"query, key, value: must have the same number of dimensions, got "
                         f"{query.dim()}, {key.dim()}, {value.dim()}")
    if query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(f"query, key: head counts differ ({query.shape[-3]} vs {key.shape[-3]}); pass "
                         "enable_gqa=True for grouped-query attention")

    def to_bshd(t):
        if t.dim() == 3:
            t = t.unsqueeze(1)  # (N, L, E): one head
        if t.dim() != 4:
            t = t.reshape(-1, *t.shape[-3:])  # fold extra leading dims into the batch
        return t.transpose(1, 2)  # (B, L, H, E), a view

    q, k, v = to_bshd(query), to_bshd(key), to_bshd(value)
    check_tensors({"query": query, "key": key, "value": value}, required=("query", "key", "value"))
    shape, options = check_attention_args(q=_info(q), k=_info(k), v=_info(v), softmax_scale=scale)
    if is_causal:
        # SDPA's causal mask is aligned to the top-left corner: j <= i, i.e. the bottom-right diagonal
        # shifted by Sq - Sk.
        options = AttnOptions(**{**options.__dict__, "window_right": shape.seqlen_q - shape.seqlen_k})
    seed = None
    if dropout_p > 0:
        options = dataclasses.replace(options, dropout_p=dropout_p)
        seed = torch.randint(-2**31, 2**31 - 1, (1,), dtype=torch.int32, device=q.device)
    out, _ = _attention(q, k, v, options, None, None, None, None, None, None, seed)
    out = out.transpose(1, 2)  # (B, H, L, Ev)
    if query.dim() == 3:
        return out.squeeze(1)
    return out.reshape(*query.shape[:-2], out.shape[-2], out.shape[-1])


def _causal_mask_like(mask: Tensor, size_q: int, size_k: int) -> bool:
    """True iff ``mask`` is the (top-left) causal mask torch builds for MultiheadAttention."""
    if mask.dim() != 2 or tuple(mask.shape) != (size_q, size_k):
        return False
    above = torch.ones(size_q, size_k, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    expected = torch.zeros(size_q, size_k, dtype=mask.dtype, device=mask.device).masked_fill(above, float("-inf"))
    return bool(torch.equal(mask, expected))


class MultiheadAttention(nn.Module):
    """Drop-in for :class:`torch.nn.MultiheadAttention` running flashbridge's kernels.

    Same constructor arguments, parameters and ``state_dict`` keys (``in_proj_weight``, ``in_proj_bias``,
    or ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` when ``kdim`` / ``vdim`` differ, and
    ``out_proj.weight`` / ``out_proj.bias``), so ``load_state_dict`` moves weights either way.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` returns ``(attn_output, attn_weights)`` like torch.
    Supported masks: none, or causal (``is_causal=True``, or ``attn_mask`` equal to the causal mask from
    ``nn.Transformer.generate_square_subsequent_mask``); anything else raises ``ValueError``. The flash
    kernels never build the weights: with ``need_weights=True`` (torch's default) they are computed
    separately by an explicit softmax (before dropout), so pass ``need_weights=False`` for speed. In training
    mode ``dropout`` is attention dropout (:func:`flash_attention`'s, its seed drawn from torch's default
    generator). ``add_bias_kv`` and ``add_zero_attn`` are not supported.

    Example::

        >>> mha = MultiheadAttention(64, 4, batch_first=True)
        >>> x = torch.randn(2, 10, 64)
        >>> y, _ = mha(x, x, x, need_weights=False, is_causal=True)
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv / add_zero_attn: not supported by flashbridge's MultiheadAttention")
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias,
                                                                          **factory)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()

    def _reset_parameters(self):
        # Same initialisation as torch.nn.MultiheadAttention.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def _project(self, query, key, value):
        e = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else (b[:e], b[e:2 * e], b[2 * e:])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            wq, wk, wv = w[:e], w[e:2 * e], w[2 * e:]
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        if key_padding_mask is not None:
            raise ValueError("key_padding_mask: not supported; pack the sequences and call "
                             "flashbridge.torch_api.flash_attention with cu_seqlens instead")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)  # (L, 1, E)
            batch_first = False
        else:
            batch_first = self.batch_first
        if not batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, lq, _ = query.shape
        lk = key.shape[1]
        causal = bool(is_causal)
        if attn_mask is not None and not causal:
            if not _causal_mask_like(attn_mask, lq, lk):
                raise ValueError("attn_mask: only the causal mask (or None) is supported by flashbridge's "
                                 "MultiheadAttention; got a mask that is not causal")
            causal = True
        q, k, v = self._project(query, key, value)
        h, d = self.num_heads, self.head_dim
        q, k, v = q.reshape(n, lq, h, d), k.reshape(n, lk, h, d), v.reshape(n, lk, h, d)
        _, options = check_attention_args(q=_info(q), k=_info(k), v=_info(v))
        if causal:  # torch's causal mask is top-left aligned
            options = AttnOptions(**{**options.__dict__, "window_right": lq - lk})
        seed = None
        if self.training and self.dropout > 0.0:
            options = dataclasses.replace(options, dropout_p=check_dropout(self.dropout, True))
            seed = torch.randint(-2**31, 2**31 - 1, (1,), dtype=torch.int32, device=q.device)
        out, _ = _attention(q, k, v, options, None, None, None, None, None, None, seed)
        out = self.out_proj(out.reshape(n, lq, h * d))
        weights = None
        if need_weights:
            scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * (1.0 / math.sqrt(d))
            if causal:
                keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~keep, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        if not batch_first:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
        return out, weights
