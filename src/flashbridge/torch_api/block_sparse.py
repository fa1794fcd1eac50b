"""Block-sparse attention for PyTorch: ``flash_attention(q, k, v, block_mask=...)`` runs here, and
:func:`masks_from_flex` turns FlexAttention's BlockMask into ours.

Two custom ops, ``flashbridge::flash_attn_sparse_fwd`` / ``_bwd``, run the FlashAttention kernels with a
:class:`flashbridge.masks.BlockMask`'s lists (``core_kernels/block_sparse``). The mask's arrays enter them
as tensors, copied to the device once per mask (``BlockMask.device_arrays``) and its static description
(block sizes, the element test's kind) as plain arguments, so ``torch.compile`` and ``opcheck`` see an
ordinary op.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .. import masks as _masks
from ..core_kernels.block_sparse.plan import SparseLayout, band_arrays, check_block_mask, layout_of
from ..core_kernels.flash_attn.plan import AttnOptions
from ._ops import fused_op
from ._runtime import dtype_name, execute, target_for
# the dense ops' memoised validation and plans (once per argument signature) and their tensor helpers; eager
# calls of a signature seen before replay their launch (fused_op's replay)
from .attention import _info, _prepare, _strides, check_attention_args, plan_attention_bwd, plan_attention_fwd

_NAMES = _masks.BlockMask.array_names


def mask_tensors(block_mask: _masks.BlockMask, device) -> list[Optional[Tensor]]:
    """The mask's arrays as int32 tensors on ``device``, in ``BlockMask.array_names`` order (None where
    absent), converted once per mask and device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    def convert(a):
        if isinstance(a, Tensor):
            return a.to(device=device, dtype=torch.int32).contiguous()
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)

    return list(block_mask.device_arrays(("torch", str(device)), convert))


def _layout(q: Tensor, k: Tensor, arrays, q_block: int, kv_block: int, window_left: Optional[int],
            window_right: Optional[int], global_tokens: int, document: bool) -> SparseLayout:
    """The SparseLayout of an op call (arrays in ``array_names`` order)."""
    a = dict(zip(_NAMES, arrays))
    terms = _masks.MaskTerms(window_left=window_left, window_right=window_right, global_tokens=global_tokens,
                             document=document, bits=a["bits"] is not None)
    view = _masks.BlockMask(seq_len_q=q.shape[1], seq_len_k=k.shape[1], q_block=q_block, kv_block=kv_block,
                            terms=terms, **a)
    return layout_of(view)


def _problem(q, k, v, alibi_slopes, sinks, softmax_scale, softcap, dropout_p=0.0):
    shape, _ = check_attention_args(q=_info(q), k=_info(k), v=_info(v), alibi_slopes=_info(alibi_slopes),
                                    sinks=_info(sinks))
    options = AttnOptions(softmax_scale=softmax_scale, causal=False, window_left=None, window_right=None,
                          softcap=softcap, has_alibi=alibi_slopes is not None,
                          alibi_batched=alibi_slopes is not None and alibi_slopes.dim() == 2,
                          has_sinks=sinks is not None, dropout_p=dropout_p)
    return shape, options


# -------------------------------------------------------------------------------------------------- ops

@fused_op("flash_attn_sparse_fwd", replay=True)
def _sparse_fwd(
    q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
    mask_arrays: list[Optional[Tensor]], q_block: int, kv_block: int, window_left: Optional[int],
    window_right: Optional[int], global_tokens: int, document: bool, softmax_scale: float, softcap: float,
    seed: Optional[Tensor] = None, dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Returns (out, lse) as flash_attn_fwd does; ``mask_arrays`` in BlockMask.array_names order; ``seed``
    int32 (1,), used when dropout_p > 0."""
    shape, options = _problem(q, k, v, alibi_slopes, sinks, softmax_scale, softcap, dropout_p)
    layout = _layout(q, k, mask_arrays, q_block, kv_block, window_left, window_right, global_tokens, document)
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    plan = plan_attention_fwd(shape, options, target=target_for(q.device), sparse=layout,
                              strides={"q": _strides(q), "k": _strides(k), "v": _strides(v)})
    given = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks, "seed": seed,
             **dict(zip(_NAMES, mask_arrays))}
    return execute(plan, {n: given[n] if n in ("q", "k", "v") else given[n].contiguous() for n in plan.inputs})


@_sparse_fwd.register_fake
def _(q, k, v, alibi_slopes, sinks, mask_arrays, q_block, kv_block, window_left, window_right, global_tokens,
      document, softmax_scale, softcap, seed=None, dropout_p=0.0):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                                                   dtype=torch.float32)


@fused_op("flash_attn_sparse_bwd", replay=True)
def _sparse_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], mask_arrays: list[Optional[Tensor]], q_block: int,
    kv_block: int, window_left: Optional[int], window_right: Optional[int], global_tokens: int, document: bool,
    softmax_scale: float, softcap: float, alibi_grad: bool, seed: Optional[Tensor] = None, dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dsinks, dalibi); dsinks is empty ``(0,)`` without sinks, dalibi (the slopes'
    gradient) without ``alibi_grad``."""
    shape, options = _problem(q, k, v, alibi_slopes, sinks, softmax_scale, softcap, dropout_p)
    layout = _layout(q, k, mask_arrays, q_block, kv_block, window_left, window_right, global_tokens, document)
    q, k, v, dout = _prepare(q), _prepare(k), _prepare(v), _prepare(dout)
    alibi_grad = alibi_grad and alibi_slopes is not None
    plan = plan_attention_bwd(
        shape, options, target=target_for(q.device), has_dlse=dlse is not None, sparse=layout,
        sinks_dtype=None if sinks is None else dtype_name(sinks.dtype),
        alibi_grad=dtype_name(alibi_slopes.dtype) if alibi_grad else None,
        strides={"q": _strides(q), "k": _strides(k), "v": _strides(v), "dout": _strides(dout)})
    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dlse": dlse,
             "alibi_slopes": alibi_slopes, "sinks": sinks, "seed": seed, **dict(zip(_NAMES, mask_arrays))}
    results = execute(plan, {n: given[n] if n in ("q", "k", "v", "dout") else given[n].contiguous()
                             for n in plan.inputs})
    dq, dk, dv = results[:3]
    dsinks = results[3] if sinks is not None else q.new_empty((0,))
    dalibi = results[-2] if alibi_grad else q.new_empty((0,))
    return dq, dk, dv, dsinks, dalibi


@_sparse_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, mask_arrays, q_block, kv_block, window_left,
      window_right, global_tokens, document, softmax_scale, softcap, alibi_grad, seed=None, dropout_p=0.0):
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    dalibi = (alibi_slopes.new_empty(alibi_slopes.shape) if alibi_grad and alibi_slopes is not None
              else q.new_empty((0,)))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dsinks, dalibi


_N_STATIC = 8  # q_block ... softcap; then the optional seed, dropout_p


def _setup_context(ctx, inputs, output):
    (q, k, v, alibi_slopes, sinks, mask_arrays, *static) = inputs
    seed, dropout_p = static[_N_STATIC:] if len(static) > _N_STATIC else (None, 0.0)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, seed, *mask_arrays)
    ctx.static = tuple(static[:_N_STATIC])
    ctx.dropout_p = dropout_p


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, alibi_slopes, sinks, seed, *mask_arrays = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    alibi_grad = alibi_slopes is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dsinks, dalibi = _sparse_bwd(dout, q, k, v, out, lse, dlse, alibi_slopes, sinks, list(mask_arrays),
                                             *ctx.static, alibi_grad, seed, ctx.dropout_p)
    return (dq, dk, dv, dalibi if alibi_grad else None, dsinks if sinks is not None else None, None,
            *([None] * (len(ctx.needs_input_grad) - 6)))  # one per argument as given (seed, dropout_p optional)


_sparse_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------- public

def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, block_mask, shape, options: AttnOptions,
                           alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                           seed: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """``flash_attention(..., block_mask=...)`` after its argument checks: (out, lse); ``seed`` with
    ``options.dropout_p > 0``."""
    layout = check_block_mask(block_mask, shape, options)
    t = block_mask.terms
    arrays = band_arrays(layout, lambda: mask_tensors(block_mask, q.device))  # none for a band: run dense
    drop = (seed, float(options.dropout_p)) if options.dropout_p > 0 else ()
    return _sparse_fwd(q, k, v, alibi_slopes, sinks, arrays, layout.q_block,
                       layout.kv_block, t.window_left, t.window_right, t.global_tokens, t.document,
                       float(options.softmax_scale), float(options.softcap), *drop)


def masks_from_flex(flex_block_mask, *, chunk: int = 512) -> _masks.BlockMask:
    """FlexAttention's BlockMask (``torch.nn.attention.flex_attention.create_block_mask``) as a
    :class:`flashbridge.masks.BlockMask`: the same full and partial blocks, and the element masks of the
    partial ones from its ``mask_mod``, evaluated once here (``chunk`` blocks at a time, on the mask's
    device) and kept as bits.

    Example::

        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> flex = create_block_mask(lambda b, h, q, k: q >= k, None, None, 300, 300, device="cpu")
        >>> m = masks_from_flex(flex)
        >>> bool((m.to_dense()[0, 0] == np.tril(np.ones((300, 300), bool))).all())
        True
    """
    fb = flex_block_mask
    for attr in ("seq_lengths", "BLOCK_SIZE", "kv_num_blocks", "kv_indices", "mask_mod"):
        if not hasattr(fb, attr):
            raise TypeError(f"flex_block_mask: expected torch.nn.attention.flex_attention.BlockMask, got "
                            f"{type(fb).__name__}")
    seq_q, seq_k = (int(s) for s in fb.seq_lengths)
    q_block, kv_block = _masks._block_sizes(tuple(int(s) for s in fb.BLOCK_SIZE))
    n_q, n_k = -(-seq_q // q_block), -(-seq_k // kv_block)
    num, idx = fb.kv_num_blocks.cpu().numpy(), fb.kv_indices.cpu().numpy()
    status = np.zeros((*num.shape[:2], n_q, n_k), np.int8)
    lists = [(num, idx, _masks.PARTIAL)]
    if fb.full_kv_num_blocks is not None:
        lists.append((fb.full_kv_num_blocks.cpu().numpy(), fb.full_kv_indices.cpu().numpy(), _masks.FULL))
    for n, ix, value in lists:
        n, ix = n[..., :n_q], ix[..., :n_q, :]
        bi, hi, qi, slot = np.nonzero(np.arange(ix.shape[-1]) < n[..., None])
        status[bi, hi, qi, ix[bi, hi, qi, slot]] = value
    whole = ((np.arange(n_q) + 1) * q_block <= seq_q)[:, None] & ((np.arange(n_k) + 1) * kv_block <= seq_k)[None, :]
    status[(status == _masks.FULL) & ~whole] = _masks.PARTIAL  # ragged edges are partial here
    bi, hi, qi, ki = np.nonzero(status == _masks.PARTIAL)
    device = fb.kv_num_blocks.device
    mod = torch.vmap(torch.vmap(torch.vmap(fb.mask_mod, in_dims=(None, None, None, 0)),
                                in_dims=(None, None, 0, None)), in_dims=(0, 0, 0, 0))
    rows = torch.arange(q_block, device=device)
    cols = torch.arange(kv_block, device=device)
    bits = []
    for start in range(0, len(bi), chunk):
        sl = slice(start, start + chunk)
        b_ = torch.as_tensor(bi[sl], device=device)
        h_ = torch.as_tensor(hi[sl], device=device)
        q_ = torch.as_tensor(qi[sl], device=device)[:, None] * q_block + rows
        k_ = torch.as_tensor(ki[sl], device=device)[:, None] * kv_block + cols
        # indices clamped into the sequences (a mask_mod may index tensors of that length), bounds applied after
        vals = mod(b_, h_, q_.clamp(max=seq_q - 1), k_.clamp(max=seq_k - 1)).bool()
        vals = vals & (q_ < seq_q)[:, :, None] & (k_ < seq_k)[:, None, :]
        bits.append(vals.cpu().numpy())
    bits = np.concatenate(bits) if bits else np.zeros((0, q_block, kv_block), bool)
    return _masks._build(status, seq_len_q=seq_q, seq_len_k=seq_k, q_block=q_block, kv_block=kv_block,
                         terms=_masks.MaskTerms(bits=True), bits=bits)
