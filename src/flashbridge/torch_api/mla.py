"""MLA (DeepSeek latent attention, absorbed form) for PyTorch: ``torch.library`` custom ops with fake kernels;
``mla_attention`` is differentiable (q and kv), ``mla_decode`` forward only.

Ops: ``flashbridge::mla_fwd``, ``flashbridge::mla_bwd`` and ``flashbridge::mla_decode``, and for block
masks ``flashbridge::mla_block_mask_fwd`` / ``_bwd`` (the mask's arrays as tensors, its static description
as plain arguments, as ``flashbridge::flash_attn_sparse_fwd`` takes them). The public functions check
arguments (values of index tensors on the host) and normalise options; the ops rebuild the plan (cached)
and run it. On CUDA a cache is never copied: the kernels take its (page, slot) strides, so any
view whose last dimension is contiguous works.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch
from torch import Tensor

from ..core_kernels._config import active_config, configure
from ..core_kernels.decode.plan import check_scale_values
from ..core_kernels.mla.plan import (MLAConfig, check_decode_values, check_index_values, check_mla_args,
                                     check_mla_block_mask, check_mla_decode_args, plan_mla_bwd, plan_mla_fwd)
from ..masks import BlockMask
from ._checks import check_tensors
from .decode import _check_pairs_base
from .block_sparse import _layout as _mask_layout, mask_tensors
from ._ops import fused_op, register_forward_only, underlying
from ._runtime import dtype_name, execute, target_for


def _info(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), dtype_name(t.dtype))


def _prepare(t: Optional[Tensor]) -> Optional[Tensor]:
    """CUDA: keep any strides with a contiguous last dim; CPU (interpreter): plain contiguous buffers."""
    if t is None:
        return None
    if t.device.type != "cuda" or t.stride(-1) != 1:
        return t.contiguous()
    return t


def _q_strides(q: Tensor) -> tuple[int, int, int]:
    return (q.stride(0), q.stride(1), q.stride(2))


def _kv_strides(kv: Tensor) -> tuple[int, int]:
    return (kv.stride(0), kv.stride(1))


def _capturing() -> bool:
    """A CUDA graph is being captured on this thread's current stream (never on a CPU-only build)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _host(t: Optional[Tensor]):
    """A tensor's values when reading them is free, else None: a plain CPU tensor in eager mode. Device
    tensors are never read (a copy to the host waits for the GPU and breaks CUDA-graph capture), nor is
    anything while torch.compile traces, under a torch.func transform (wrapped tensors have no data of
    their own) or while a CUDA graph is captured on this thread; the kernels then clamp every access."""
    if t is None or t.device.type != "cpu" or torch.compiler.is_compiling() or underlying(t) is not t:
        return None
    return None if _capturing() else t.numpy()


# -------------------------------------------------------------------------------------------------- ops

@functools.lru_cache(maxsize=256)  # keyed on the config too: core_kernels.configure() changes it
def _fwd_plan(shape, options, target, q_strides, kv_strides, config):
    return plan_mla_fwd(shape, options, target=target, strides={"q": q_strides, "kv": kv_strides}, config=config)


@fused_op("mla_fwd")
def _mla_fwd(q: Tensor, kv: Tensor, indices: Optional[Tensor], head_dim_v: int, softmax_scale: float,
             causal: bool) -> tuple[Tensor, Tensor]:
    """Returns (out (B, Sq, H, Dv) in q's dtype, lse float32 (B, H, Sq))."""
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=head_dim_v, causal=causal,
                                    softmax_scale=softmax_scale, indices=_info(indices))
    q, kv = _prepare(q), _prepare(kv)
    plan = _fwd_plan(shape, options, target_for(q.device), _q_strides(q), _kv_strides(kv),
                     active_config(MLAConfig))
    given = {"q": q, "kv": kv, "indices": None if indices is None else indices.contiguous()}
    return execute(plan, {n: given[n] for n in plan.inputs})


@_mla_fwd.register_fake
def _(q, kv, indices, head_dim_v, softmax_scale, causal):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, head_dim_v)), q.new_empty((b, h, sq), dtype=torch.float32)


@fused_op("mla_bwd")
def _mla_bwd(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
             indices: Optional[Tensor], head_dim_v: int, softmax_scale: float,
             causal: bool) -> tuple[Tensor, Tensor]:
    """Returns (dq, dkv) in q's / kv's shapes and dtype."""
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=head_dim_v, causal=causal,
                                    softmax_scale=softmax_scale, indices=_info(indices))
    q, kv, dout = _prepare(q), _prepare(kv), _prepare(dout)
    plan = plan_mla_bwd(shape, options, target=target_for(q.device), has_dlse=dlse is not None,
                        strides={"q": _q_strides(q), "kv": _kv_strides(kv), "dout": _q_strides(dout)})
    given = {"dout": dout, "q": q, "kv": kv, "out": out.contiguous(), "lse": lse.contiguous(),
             "dlse": None if dlse is None else dlse.contiguous(),
             "indices": None if indices is None else indices.contiguous()}
    return execute(plan, {n: given[n] for n in plan.inputs})


@_mla_bwd.register_fake
def _(dout, q, kv, out, lse, dlse, indices, head_dim_v, softmax_scale, causal):
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


def _setup_context(ctx, inputs, output):
    q, kv, indices, head_dim_v, softmax_scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, out, lse, indices)
    ctx.options = (head_dim_v, softmax_scale, causal)
    ctx.config = active_config(MLAConfig)  # the backward may run on autograd's device thread, outside configure()


def _backward(ctx, dout, dlse):
    q, kv, out, lse, indices = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    with configure(ctx.config):
        dq, dkv = _mla_bwd(dout, q, kv, out, lse, dlse, indices, *ctx.options)
    return dq, dkv, None, None, None, None


_mla_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------- block masks

_MASK_NAMES = BlockMask.array_names


@functools.lru_cache(maxsize=256)
def _mask_fwd_plan(shape, options, layout, target, q_strides, kv_strides, config):
    return plan_mla_fwd(shape, options, target=target, sparse=layout, strides={"q": q_strides, "kv": kv_strides},
                        config=config)


@fused_op("mla_block_mask_fwd")
def _mla_mask_fwd(q: Tensor, kv: Tensor, mask_arrays: list[Optional[Tensor]], head_dim_v: int, softmax_scale: float,
                  q_block: int, kv_block: int, window_left: Optional[int], window_right: Optional[int],
                  global_tokens: int, document: bool) -> tuple[Tensor, Tensor]:
    """Returns (out, lse) as mla_fwd does; ``mask_arrays`` in BlockMask.array_names order."""
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=head_dim_v, softmax_scale=softmax_scale)
    layout = _mask_layout(q, kv, mask_arrays, q_block, kv_block, window_left, window_right, global_tokens, document)
    q, kv = _prepare(q), _prepare(kv)
    plan = _mask_fwd_plan(shape, options, layout, target_for(q.device), _q_strides(q), _kv_strides(kv),
                          active_config(MLAConfig))
    given = {"q": q, "kv": kv, **dict(zip(_MASK_NAMES, mask_arrays))}
    return execute(plan, {n: given[n] if n in ("q", "kv") else given[n].contiguous() for n in plan.inputs})


@_mla_mask_fwd.register_fake
def _(q, kv, mask_arrays, head_dim_v, softmax_scale, q_block, kv_block, window_left, window_right, global_tokens,
      document):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, head_dim_v)), q.new_empty((b, h, sq), dtype=torch.float32)


@fused_op("mla_block_mask_bwd")
def _mla_mask_bwd(dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                  mask_arrays: list[Optional[Tensor]], head_dim_v: int, softmax_scale: float, q_block: int,
                  kv_block: int, window_left: Optional[int], window_right: Optional[int], global_tokens: int,
                  document: bool) -> tuple[Tensor, Tensor]:
    """Returns (dq, dkv) in q's / kv's shapes and dtype."""
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=head_dim_v, softmax_scale=softmax_scale)
    layout = _mask_layout(q, kv, mask_arrays, q_block, kv_block, window_left, window_right, global_tokens, document)
    q, kv, dout = _prepare(q), _prepare(kv), _prepare(dout)
    plan = plan_mla_bwd(shape, options, target=target_for(q.device), has_dlse=dlse is not None, sparse=layout,
                        strides={"q": _q_strides(q), "kv": _kv_strides(kv), "dout": _q_strides(dout)})
    given = {"dout": dout, "q": q, "kv": kv, "out": out, "lse": lse, "dlse": dlse,
             **dict(zip(_MASK_NAMES, mask_arrays))}
    return execute(plan, {n: given[n] if n in ("dout", "q", "kv") else given[n].contiguous() for n in plan.inputs})


@_mla_mask_bwd.register_fake
def _(dout, q, kv, out, lse, dlse, mask_arrays, head_dim_v, softmax_scale, q_block, kv_block, window_left,
      window_right, global_tokens, document):
    return q.new_empty(q.shape), kv.new_empty(kv.shape)


def _mask_setup_context(ctx, inputs, output):
    q, kv, mask_arrays, *static = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, out, lse, *mask_arrays)
    ctx.static = tuple(static)
    ctx.config = active_config(MLAConfig)


def _mask_backward(ctx, dout, dlse):
    q, kv, out, lse, *mask_arrays = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    with configure(ctx.config):
        dq, dkv = _mla_mask_bwd(dout, q, kv, out, lse, dlse, list(mask_arrays), *ctx.static)
    return (dq, dkv, None, *([None] * len(ctx.static)))


_mla_mask_fwd.register_autograd(_mask_backward, setup_context=_mask_setup_context)


def _block_mask_attention(q: Tensor, kv: Tensor, block_mask, shape, options) -> tuple[Tensor, Tensor]:
    """``mla_attention(..., block_mask=...)`` after its argument checks: (out, lse)."""
    layout = check_mla_block_mask(block_mask, shape, options)
    t = block_mask.terms
    return _mla_mask_fwd(q, kv, mask_tensors(block_mask, q.device), shape.head_dim_v, float(options.softmax_scale),
                         layout.q_block, layout.kv_block, t.window_left, t.window_right, t.global_tokens, t.document)


@functools.lru_cache(maxsize=256)
def _decode_plan(shape, options, target, num_splits, q_strides, kv_strides, config):
    return plan_mla_fwd(shape, options, target=target, num_splits=num_splits,
                        strides={"q": q_strides, "kv": kv_strides}, config=config)


@fused_op("mla_decode")
def _mla_decode(q: Tensor, kv_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor],
                indices: Optional[Tensor], kv_scale: Optional[Tensor], head_dim_v: int, softmax_scale: float,
                num_splits: Optional[int]) -> tuple[Tensor, Tensor]:
    shape, options, _ = check_mla_decode_args(
        q=_info(q), kv_cache=_info(kv_cache), cache_seqlens=_info(cache_seqlens), block_table=_info(block_table),
        head_dim_v=head_dim_v, softmax_scale=softmax_scale, indices=_info(indices), kv_scale=_info(kv_scale))
    q, kv_cache = _prepare(q), _prepare(kv_cache)
    plan = _decode_plan(shape, options, target_for(q.device), num_splits, _q_strides(q), _kv_strides(kv_cache),
                        active_config(MLAConfig))
    _check_pairs_base(plan, {"kv_cache": kv_cache}, flags=("PAIRS",))
    given = {"q": q, "kv": kv_cache, "cache_seqlens": cache_seqlens, "block_table": block_table,
             "indices": indices, "kv_scale": kv_scale}
    return execute(plan, {n: given[n] if n in ("q", "kv") else given[n].contiguous() for n in plan.inputs})


@_mla_decode.register_fake
def _(q, kv_cache, cache_seqlens, block_table, indices, kv_scale, head_dim_v, softmax_scale, num_splits):
    b, sq, h, _ = q.shape
    return q.new_empty((b, sq, h, head_dim_v)), q.new_empty((b, h, sq), dtype=torch.float32)


register_forward_only(_mla_decode, "mla_decode")


# ----------------------------------------------------------------------------------------------- public

def mla_attention(q: Tensor, kv: Tensor, *, head_dim_v: int = 512, causal: bool = False,
                  softmax_scale: Optional[float] = None, indices: Optional[Tensor] = None, block_mask=None,
                  return_lse: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Multi-head latent attention (DeepSeek MLA, absorbed form): every query head attends to one shared
    latent KV head, whose first ``head_dim_v`` dims are the values:
    ``out[b, i, h] = softmax_j(softmax_scale * q[b, i, h] . kv[b, j]) kv[b, j, :head_dim_v]``.

    Args:
        q: ``(B, Sq, H, Dqk)``, float16 / bfloat16 / float32; ``1 <= H <= 128``, ``Dqk <= 1024`` (tuned for
            DeepSeek's 576 = 512 latent + 64 RoPE dims). CUDA, or CPU (Triton interpreter).
        kv: ``(B, Sk, Dqk)`` in q's dtype: the latent (``[c_kv, k_rope]``), keys and values at once.
        head_dim_v: the values are ``kv[..., :head_dim_v]`` (``head_dim_v <= Dqk``).
        causal: query i sees keys ``j <= i + Sk - Sq`` (bottom-right aligned, as flash_attention). Rows that
            see no key output 0 and lse -inf.
        softmax_scale: defaults to ``1 / sqrt(Dqk)`` (DeepSeek's un-absorbed scale is ``1 / sqrt(qk_nope +
            qk_rope)``: pass it).
        indices: int32 ``(B, Sq, topk)``: DeepSeek sparse attention -- query i sees exactly the listed key
            positions (and, with ``causal``, only those at or before its own). Entries -1 or ``>= Sk`` are
            skipped; the others must be distinct (checked when the tensor is on the CPU; on a GPU a repeated
            key would count twice in the forward and once in the gradient).
        block_mask: a :class:`flashbridge.masks.BlockMask` for ``(Sq, Sk)``, shared by the query heads and by
            the batch or per sequence (``(1|B, 1, Sq, Sk)``): only the key blocks it lists are visited, e.g.
            the top-k key blocks of each query block (``masks.from_blocks``). Per-head masks are rejected (the
            heads of a token share one program's rows); so are ``causal`` (build it into the mask:
            ``masks.causal(Sq, Sk) & ...``) and ``indices`` (one sparsity source at a time).
        return_lse: also return the float32 log-sum-exp ``(B, H, Sq)`` (differentiable).

    Returns:
        ``out`` ``(B, Sq, H, head_dim_v)`` in q's dtype, or ``(out, lse)``. Gradients flow to q and kv.

    Example::

        >>> q = torch.randn(2, 16, 8, 96)
        >>> kv = torch.randn(2, 16, 96)
        >>> out = mla_attention(q, kv, head_dim_v=64, causal=True)
        >>> out.shape
        torch.Size([2, 16, 8, 64])
        >>> from flashbridge import masks   # key blocks per query block (blocks of 32 tokens)
        >>> m = masks.from_blocks([[True, False], [False, True]], seq_len_q=64, seq_len_k=64, block_size=32)
        >>> mla_attention(torch.randn(1, 64, 8, 96), torch.randn(1, 64, 96), head_dim_v=64, block_mask=m).shape
        torch.Size([1, 64, 8, 64])
    """
    check_tensors({"q": q, "kv": kv, "indices": indices}, ("q", "kv"))
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=head_dim_v, causal=causal,
                                    softmax_scale=softmax_scale, indices=_info(indices))
    if block_mask is not None:
        out, lse = _block_mask_attention(q, kv, block_mask, shape, options)
        return (out, lse) if return_lse else out
    values = _host(indices)
    if values is not None:
        check_index_values(values, None, shape.cache.capacity)
    out, lse = _mla_fwd(q, kv, indices, shape.head_dim_v, float(options.softmax_scale), bool(causal))
    return (out, lse) if return_lse else out


def mla_decode(q: Tensor, kv_cache: Tensor, *, cache_seqlens: Tensor, block_table: Optional[Tensor] = None,
               head_dim_v: int = 512, softmax_scale: Optional[float] = None, indices: Optional[Tensor] = None,
               kv_scale: Optional[Tensor] = None, num_splits: Optional[int] = None,
               return_lse: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """MLA decode (absorbed form) over a latent cache: a few query tokens per sequence, every query head
    against the one latent head, causal over the first ``cache_seqlens[b]`` rows (query i sits on row
    ``cache_seqlens[b] - Sq + i``, as :func:`decode_attention`).

    Args:
        q: ``(B, Sq, H, Dqk)``, float16 / bfloat16 / float32; Sq small (1, or a few for speculative decoding).
        kv_cache: contiguous ``(B, S_max, Dqk)`` or paged ``(num_pages, page_size, Dqk)`` (page size a power of
            two) with ``block_table``; q's dtype, or ``torch.float8_e4m3fn`` holding ``latent / kv_scale``.
        cache_seqlens: int32 ``(B,)``.
        block_table: int32 ``(B, max_pages)``: row j of sequence b is slot ``j % page_size`` of page
            ``block_table[b, j // page_size]``.
        head_dim_v: the values are the first ``head_dim_v`` dims of the latent (512 for DeepSeek).
        indices: int32 ``(B, Sq, topk)``: sparse decode, query i sees only these positions of its sequence
            (entries -1 or ``>= cache_seqlens[b]`` skipped; the others distinct, checked on the CPU).
        kv_scale: float32 ``()`` or ``(1,)``: the FP8 cache's dequantisation scale, finite and > 0 (checked on a
            CPU tensor; on a CUDA device, as :func:`decode_attention`'s ``k_scale``, not read on the host).
        num_splits: programs sharing one sequence's keys (None: from the SM count and the batch); a fixed
            value gives bitwise reproducible, batch-invariant results.
        return_lse: also return the float32 log-sum-exp ``(B, H, Sq)``.

    Returns:
        ``out`` ``(B, Sq, H, head_dim_v)`` in q's dtype, or ``(out, lse)``.

    Example::

        >>> q = torch.randn(2, 1, 16, 96)
        >>> cache = torch.randn(2, 256, 96)
        >>> lens = torch.tensor([100, 256], dtype=torch.int32)
        >>> mla_decode(q, cache, cache_seqlens=lens, head_dim_v=64).shape
        torch.Size([2, 1, 16, 64])
    """
    tensors = {"q": q, "kv_cache": kv_cache, "cache_seqlens": cache_seqlens, "block_table": block_table,
               "indices": indices, "kv_scale": kv_scale}
    check_tensors(tensors, ("q", "kv_cache", "cache_seqlens"))
    shape, options, splits = check_mla_decode_args(
        **{n: _info(t) for n, t in tensors.items()}, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
        num_splits=num_splits)
    scale = _host(None if kv_scale is None else kv_scale.detach())
    check_scale_values(kv_scale=None if scale is None else scale.reshape(-1).tolist())
    lengths = _host(cache_seqlens)
    if lengths is not None:
        table = _host(block_table)
        check_decode_values(lengths.tolist(), None if table is None else table.tolist(), shape.cache)
        values = _host(indices)
        if values is not None:
            check_index_values(values, lengths, None)
    out, lse = _mla_decode(q, kv_cache, cache_seqlens, block_table, indices, kv_scale, shape.head_dim_v,
                           float(options.softmax_scale), splits)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------- module

def rotary(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary position embedding (rotate-half form) of ``x`` ``(B, S, ..., D)`` at integer ``positions``
    ``(B, S)``, computed in float32: the pairs ``(x[i], x[i + D/2])`` turn by ``position * theta^(-2i/D)``."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float32) * 2.0 / d)
    angles = positions.to(torch.float32)[..., None] * freqs  # (B, S, D/2)
    angles = angles.reshape(*angles.shape[:2], *([1] * (x.dim() - 3)), d // 2)
    cos, sin = torch.cos(angles), torch.sin(angles)
    x1, x2 = x.float()[..., :d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class MultiHeadLatentAttention(torch.nn.Module):
    """DeepSeek-V3 multi-head latent attention, with DeepSeek-V3's configuration and parameter names
    (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` -- or ``q_proj`` without ``q_lora_rank`` --,
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) and two paths over the same
    weights:

    * ``forward(hidden_states, positions=None)``: training / prefill, un-absorbed. Per head, keys
      ``[c_kv W_UK^T, k_rope]`` (``qk_nope_head_dim + qk_rope_head_dim``, 192 for DeepSeek-V3) and values
      ``c_kv W_UV^T`` (``v_head_dim``, 128) from the normalised latent ``c_kv``; causal
      :func:`flash_attention`.
    * ``decode(hidden_states, kv_cache, cache_seqlens, ...)``: absorbed. The cache holds one latent row per
      token, ``[c_kv, k_rope]`` (``kv_lora_rank + qk_rope_head_dim``, 576); the new tokens' rows are written
      at ``cache_seqlens[b] + i`` (in place), the query absorbs ``W_UK`` (``q_nope W_UK``), :func:`mla_decode`
      attends over the cache once for all heads, and ``W_UV`` maps its ``kv_lora_rank``-dim output back.

    ``W_UK`` / ``W_UV`` are the two halves of ``kv_b_proj.weight`` viewed as ``(H, nope + v, kv_lora_rank)``.
    RoPE: rotate-half form with ``rope_theta``; positions default to ``0 .. S - 1`` (forward) and
    ``cache_seqlens[b] + i`` (decode). The default scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``
    in both paths.

    Example::

        >>> mla = MultiHeadLatentAttention(64, 4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        ...                                qk_rope_head_dim=8, v_head_dim=16)
        >>> x = torch.randn(2, 10, 64)
        >>> y = mla(x)                                           # prefill / training
        >>> cache = torch.zeros(2, 16, 32 + 8)
        >>> lens = torch.zeros(2, dtype=torch.int32)
        >>> y_step = mla.decode(x[:, :1], cache, lens)           # first token into an empty cache
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, *, rope_theta: float = 10000.0,
                 rms_norm_eps: float = 1e-6, attention_bias: bool = False, softmax_scale: Optional[float] = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        from .modules import RMSNorm

        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: must be even (RoPE turns pairs of dims), got {qk_rope_head_dim}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_theta = rope_theta
        self.softmax_scale = self.qk_head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
        lin = torch.nn.Linear
        if q_lora_rank is None:
            self.q_proj = lin(hidden_size, num_heads * self.qk_head_dim, bias=False, **factory)
        else:
            self.q_a_proj = lin(hidden_size, q_lora_rank, bias=attention_bias, **factory)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=rms_norm_eps, **factory)
            self.q_b_proj = lin(q_lora_rank, num_heads * self.qk_head_dim, bias=False, **factory)
        self.kv_a_proj_with_mqa = lin(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias, **factory)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=rms_norm_eps, **factory)
        self.kv_b_proj = lin(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False, **factory)
        self.o_proj = lin(num_heads * v_head_dim, hidden_size, bias=attention_bias, **factory)

    @property
    def latent_dim(self) -> int:
        """Width of one cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def _query(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(q_nope (B, S, H, nope), q_rope (B, S, H, rope) with RoPE applied)."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:2], self.num_heads, self.qk_head_dim)
        return q[..., :self.qk_nope_head_dim], rotary(q[..., self.qk_nope_head_dim:], positions, self.rope_theta)

    def latent(self, x: Tensor, positions: Tensor) -> Tensor:
        """The cache rows of tokens ``x`` ``(B, S, hidden)`` at ``positions``: ``[c_kv, k_rope]``
        ``(B, S, kv_lora_rank + qk_rope_head_dim)``."""
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[..., :self.kv_lora_rank])
        return torch.cat([c_kv, rotary(kv[..., self.kv_lora_rank:], positions, self.rope_theta)], -1)

    def _up_projections(self) -> tuple[Tensor, Tensor]:
        w = self.kv_b_proj.weight.reshape(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]  # W_UK (H, nope, r), W_UV (H, v, r)

    def forward(self, hidden_states: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        from .attention import flash_attention

        b, s, _ = hidden_states.shape
        if positions is None:
            positions = torch.arange(s, device=hidden_states.device).expand(b, s)
        q_nope, q_rope = self._query(hidden_states, positions)
        latent = self.latent(hidden_states, positions)
        kv = self.kv_b_proj(latent[..., :self.kv_lora_rank]).reshape(b, s, self.num_heads, -1)
        k_rope = latent[..., self.kv_lora_rank:, ].unsqueeze(2).expand(b, s, self.num_heads, self.qk_rope_head_dim)
        k = torch.cat([kv[..., :self.qk_nope_head_dim], k_rope], -1)
        q = torch.cat([q_nope, q_rope], -1)
        out = flash_attention(q, k, kv[..., self.qk_nope_head_dim:], causal=True, softmax_scale=self.softmax_scale)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.v_head_dim))

    def decode(self, hidden_states: Tensor, kv_cache: Tensor, cache_seqlens: Tensor, *,
               block_table: Optional[Tensor] = None, positions: Optional[Tensor] = None,
               num_splits: Optional[int] = None) -> Tensor:
        """The new tokens ``hidden_states`` ``(B, Sq, hidden)`` of sequences whose caches hold
        ``cache_seqlens`` tokens (int32 ``(B,)``, before this call): writes their latent rows into
        ``kv_cache`` (contiguous ``(B, S_max, latent_dim)`` or paged ``(num_pages, page_size, latent_dim)``
        with ``block_table``; in place) and returns their outputs ``(B, Sq, hidden)``; the caller advances
        ``cache_seqlens`` by Sq."""
        b, sq, _ = hidden_states.shape
        steps = torch.arange(sq, device=hidden_states.device)
        if positions is None:
            positions = cache_seqlens.long()[:, None] + steps
        q_nope, q_rope = self._query(hidden_states, positions)
        rows = cache_seqlens.long()[:, None] + steps  # (B, Sq) cache rows of the new tokens
        latent = self.latent(hidden_states, positions).to(kv_cache.dtype)
        with torch.no_grad():
            if block_table is None:
                kv_cache[torch.arange(b, device=rows.device)[:, None], rows] = latent
            else:
                page_size = kv_cache.shape[1]
                pages = torch.gather(block_table.long(), 1, rows // page_size)
                kv_cache[pages, rows % page_size] = latent
        w_uk, w_uv = self._up_projections()
        q = torch.cat([torch.einsum("bshn,hnr->bshr", q_nope, w_uk), q_rope], -1)
        out = mla_decode(q, kv_cache, cache_seqlens=cache_seqlens + sq, block_table=block_table,
                         head_dim_v=self.kv_lora_rank, softmax_scale=self.softmax_scale, num_splits=num_splits)
        out = torch.einsum("bshr,hvr->bshv", out, w_uv)
        return self.o_proj(out.reshape(b, sq, self.num_heads * self.v_head_dim))
