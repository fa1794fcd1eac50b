"""flash_attention over a key cache (torch): keys from a paged cache through ``block_table`` and / or bounded
per sequence by ``seqused_k`` (flash-attn's ``flash_attn_varlen_func(..., block_table=, seqused_k=)``,
chunked prefill in serving). One forward-only op, ``flashbridge::flash_attn_cache_fwd``, running the
attention forward kernel with its cache addressing (see ``core_kernels/flash_attn/kernels_fwd.py``)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..core_kernels.flash_attn.plan import CACHE_OP, check_cache_offsets, check_kv_cache_args
from ._ops import fused_op, register_forward_only, underlying
from ._runtime import execute, memoised, target_for
from .attention import _info, _prepare, _strides, op_options, plan_attention_fwd

check_kv_cache_args = memoised(check_kv_cache_args)


def _problem(q, k, v, block_table, seqused_k, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k):
    """Rebuild the validated (shape, cache) inside the op from its flat arguments."""
    shape, _, cache = check_kv_cache_args(
        q=_info(q), k=_info(k), v=_info(v), block_table=_info(block_table), seqused_k=_info(seqused_k),
        alibi_slopes=_info(alibi_slopes), sinks=_info(sinks), cu_seqlens_q=_info(cu_seqlens_q),
        cu_seqlens_k=_info(cu_seqlens_k), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    return shape, cache


@fused_op("flash_attn_cache_fwd")
def _flash_attn_cache_fwd(
    q: Tensor, k: Tensor, v: Tensor, block_table: Optional[Tensor], seqused_k: Tensor,
    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], softmax_scale: float,
    causal: bool,
    window_left: Optional[int], window_right: Optional[int], softcap: float,
) -> tuple[Tensor, Tensor]:
    """Returns (out, lse) as ``flash_attn_fwd``: out in q's layout with v's head dim, lse float32."""
    shape, cache = _problem(q, k, v, block_table, seqused_k, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                            max_seqlen_q, max_seqlen_k)
    options = op_options(alibi_slopes, sinks, softmax_scale, causal, window_left, window_right, softcap)
    q, k, v = _prepare(q), _prepare(k), _prepare(v)
    plan = plan_attention_fwd(shape, options, target=target_for(q.device),
                              strides={"q": _strides(q), "k": _strides(k), "v": _strides(v)}, cache=cache)
    given = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks, "cu_seqlens_q": cu_seqlens_q,
             "cu_seqlens_k": cu_seqlens_k, "block_table": block_table, "seqused_k": seqused_k}
    out, lse = execute(plan, {n: given[n] if n in ("q", "k", "v") else given[n].contiguous() for n in plan.inputs})
    return out, lse


@_flash_attn_cache_fwd.register_fake
def _(q, k, v, block_table, seqused_k, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left, window_right, softcap):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    if cu_seqlens_q is not None:
        return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


register_forward_only(_flash_attn_cache_fwd, CACHE_OP)


def cache_attention(q, k, v, *, block_table, seqused_k, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q, max_seqlen_k, **score_options) -> tuple[Tensor, Tensor]:
    """flash_attention's ``block_table`` / ``seqused_k`` forms (arguments as flash_attention's, already
    type-checked): validate, check host offsets, run the forward-only op."""
    shape, options, cache = check_kv_cache_args(
        q=_info(q), k=_info(k), v=_info(v), block_table=_info(block_table), seqused_k=_info(seqused_k),
        alibi_slopes=_info(alibi_slopes), sinks=_info(sinks), cu_seqlens_q=_info(cu_seqlens_q),
        cu_seqlens_k=_info(cu_seqlens_k), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **score_options)
    if (shape.varlen and not torch.compiler.is_compiling() and underlying(cu_seqlens_q) is cu_seqlens_q
            and (cu_seqlens_k is None or underlying(cu_seqlens_k) is cu_seqlens_k)):
        offsets_k = None if cu_seqlens_k is None else cu_seqlens_k.tolist()
        check_cache_offsets(cu_seqlens_q.tolist(), offsets_k, shape, cache)
    return _flash_attn_cache_fwd(
        q, k, v, block_table, seqused_k, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        float(options.softmax_scale), bool(options.causal), options.window_left, options.window_right,
        float(options.softcap))
