"""Flash-Decoding for PyTorch: ``torch.library`` custom ops with fake kernels (forward only).

Ops: ``flashbridge::decode_attn``, ``flashbridge::merge_attn_states``, ``flashbridge::cascade_attn`` and
``flashbridge::append_kv_cache`` (mutates ``k_cache`` / ``v_cache`` in place and says so through
``mutates_args``, so torch.compile functionalises it correctly). The public functions check arguments and
normalise options; the ops rebuild the plan (cached) and run it.

On CUDA a cache is never copied: the kernels take its (page, slot, head) strides, so strided views work as
long as the head dim is contiguous. Values inside ``cache_seqlens`` / ``block_table`` are validated when the
tensors are on the CPU; on a GPU reading them would cost a device sync per decode step, so they are not read
there -- the kernels clamp lengths to the cache capacity and page ids to the page pool, so a bad value can
give wrong numbers but never an out-of-bounds access.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from .._forward_only import no_backward_message
from ..core_kernels._config import active_config
from ..core_kernels.decode.plan import (DecodeConfig, DecodeOptions, check_append_args, check_cache_values,
                                        check_cascade_args, check_decode_args, check_leftpad_values,
                                        check_merge_args, check_rotary, check_scale_values, check_scales,
                                        plan_append, plan_cascade, plan_decode, plan_merge)
from ._checks import check_tensors
from ._ops import fused_op, register_forward_only, underlying, vmapped_at
from ._runtime import dtype_name, execute, memoised, target_for

# validation and plans run once per distinct argument signature (see memoised)
(check_decode_args, check_cascade_args, check_append_args, check_merge_args, check_scales, plan_merge,
 plan_append) = map(memoised, (check_decode_args, check_cascade_args, check_append_args, check_merge_args,
                              check_scales, plan_merge, plan_append))


def _info(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), dtype_name(t.dtype))


def _prepare(t: Optional[Tensor]) -> Optional[Tensor]:
    """CUDA: keep any strides with a contiguous last dim (no copy of a large cache); CPU (interpreter, bf16
    widening): plain contiguous buffers."""
    if t is None:
        return None
    if t.device.type != "cuda" or t.stride(-1) != 1:
        return t.contiguous()
    return t


def _cache_strides(t: Tensor, kv_layout: str) -> tuple[int, int, int]:
    """(page, slot, head) element strides of a 4-D cache in ``kv_layout``."""
    if kv_layout == "NHD":
        return (t.stride(0), t.stride(1), t.stride(2))
    return (t.stride(0), t.stride(2), t.stride(1))


def _host_values(cache_seqlens: Tensor, block_table: Optional[Tensor]):
    """The index tensors' values when reading them is free (CPU, eager, one call's values), else None."""
    if (cache_seqlens.device.type != "cpu" or torch.compiler.is_compiling()
            or any(t is not None and underlying(t) is not t for t in (cache_seqlens, block_table))):
        return None
    return cache_seqlens.tolist(), None if block_table is None else block_table.tolist()


def _host_scales(**scales: Optional[Tensor]) -> dict:
    """The FP8 scales' values where reading them is free (CPU, eager), for :func:`check_scale_values`; a CUDA
    tensor is not read (that would synchronise with the GPU)."""
    if torch.compiler.is_compiling():
        return {}
    return {n: t.detach().reshape(-1).tolist() for n, t in scales.items()
            if t is not None and t.device.type == "cpu" and underlying(t) is t}


def _host_leftpad(cache_leftpad: Optional[Tensor], cache_seqlens: Tensor) -> None:
    """Check ``0 <= cache_leftpad <= cache_seqlens`` when both are readable for free (CPU, eager)."""
    if cache_leftpad is None:
        return
    values = _host_values(cache_seqlens, cache_leftpad)
    if values is not None:
        check_leftpad_values(values[1], values[0])


def _options(q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks, k_scale, v_scale, kv_layout,
             softmax_scale, causal, window_left, window_right, softcap, cache_leftpad=None, rotary_cos=None,
             rotary_sin=None, rotary_interleaved=False):
    """Rebuild the validated (shape, options) inside an op from its flat arguments."""
    shape, _, _ = check_decode_args(q=_info(q), k_cache=_info(k_cache), v_cache=_info(v_cache),
                                    cache_seqlens=_info(cache_seqlens), block_table=_info(block_table),
                                    kv_layout=kv_layout, alibi_slopes=_info(alibi_slopes), sinks=_info(sinks),
                                    k_scale=_info(k_scale), v_scale=_info(v_scale))
    options = DecodeOptions(
        softmax_scale=softmax_scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, has_alibi=alibi_slopes is not None,
        alibi_batched=alibi_slopes is not None and alibi_slopes.dim() == 2, has_sinks=sinks is not None,
        scale_mode=check_scales(_info(k_scale), _info(v_scale), shape.cache), has_leftpad=cache_leftpad is not None)
    half, rows = check_rotary(_info(rotary_cos), _info(rotary_sin), rotary_interleaved, shape.head_dim_qk)
    options = dataclasses.replace(options, rotary_half=half, rotary_interleaved=rotary_interleaved, rotary_rows=rows)
    return shape, options


@functools.lru_cache(maxsize=256)  # keyed on the config too: core_kernels.configure() changes it
def _decode_plan(shape, options, target, num_splits, q_strides, k_strides, v_strides, config):
    return plan_decode(shape, options, target=target, num_splits=num_splits,
                       strides={"q": q_strides, "k_cache": k_strides, "v_cache": v_strides}, config=config)


@functools.lru_cache(maxsize=256)
def _cascade_plan(shape, shared_len, options, target, num_splits, k_strides, v_strides, config):
    return plan_cascade(shape, shared_len, options, target=target, num_splits=num_splits,
                        strides={"k_cache": k_strides, "v_cache": v_strides}, config=config)


def _check_pairs_base(plan, *caches: dict[str, Tensor], flags: tuple[str, ...] = ("K_PAIRS", "V_PAIRS")) -> None:
    """Decode kernels read FP8 K and V caches as 16-bit pairs of columns (``K_PAIRS`` / ``V_PAIRS``, see
    ``core_kernels.decode.kernels.load_e4m3_pairs``; the MLA kernel's latent: ``PAIRS``): such a cache's
    first byte must sit on a 2-byte boundary. Plans see shapes and strides only, so the base addresses are
    checked here (JAX arrays are always aligned). ``caches[i]``: the named tensors that ``flags[i]`` covers."""
    for flag, tensors in zip(flags, caches):
        if not any(launch.constexpr_dict().get(flag) for launch in plan.launches):
            continue
        for name, t in tensors.items():
            if t.dtype == torch.float8_e4m3fn and t.data_ptr() % 2:
                raise ValueError(f"{name}: an FP8 cache must start on a 2-byte boundary; this view starts 1 "
                                 "byte past one (slice it at an even element offset, or pass a copy)")


# -------------------------------------------------------------------------------------------------- ops

@fused_op("decode_attn", replay=True)
def _decode_attn(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, block_table: Optional[Tensor],
    alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
    kv_layout: str, softmax_scale: float, causal: bool, window_left: Optional[int], window_right: Optional[int],
    softcap: float, num_splits: Optional[int], cache_leftpad: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = False,
) -> tuple[Tensor, Tensor]:
    """Returns (out (B, Sq, Hq, Dv) in q's dtype, lse float32 (B, Hq, Sq))."""
    shape, options = _options(q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks, k_scale,
                              v_scale, kv_layout, softmax_scale, causal, window_left, window_right, softcap,
                              cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved)
    q, k_cache, v_cache = _prepare(q), _prepare(k_cache), _prepare(v_cache)
    plan = _decode_plan(shape, options, target_for(q.device), num_splits, (q.stride(0), q.stride(1), q.stride(2)),
                        _cache_strides(k_cache, kv_layout), _cache_strides(v_cache, kv_layout),
                        active_config(DecodeConfig))
    _check_pairs_base(plan, {"k_cache": k_cache}, {"v_cache": v_cache})
    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
             "block_table": block_table, "alibi_slopes": alibi_slopes, "sinks": sinks, "k_scale": k_scale,
             "v_scale": v_scale, "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin}
    out, lse = execute(plan, {n: given[n] if n in ("q", "k_cache", "v_cache") else given[n].contiguous()
                              for n in plan.inputs})
    return out, lse


@_decode_attn.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks, k_scale, v_scale, kv_layout,
      softmax_scale, causal, window_left, window_right, softcap, num_splits, cache_leftpad=None, rotary_cos=None,
      rotary_sin=None, rotary_interleaved=False):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_cache.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


@fused_op("merge_attn_states")
def _merge_attn_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    n, rows_shape, dim, dtype = check_merge_args(_info(outs), _info(lses))
    rows = 1
    for d in rows_shape:
        rows *= d
    plan = plan_merge(n, rows, dim, dtype, target=target_for(outs.device))
    out, lse = execute(plan, {"outs": outs.reshape(n, rows, dim).contiguous(),
                              "lses": lses.reshape(n, rows).contiguous()})
    return out.reshape(*rows_shape, dim), lse.reshape(rows_shape)


@_merge_attn_states.register_fake
def _(outs, lses):
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


@_merge_attn_states.register_vmap
def _(batch, in_dims, outs, lses):
    # the vmapped dimension becomes the first row dimension, after the N states
    out, lse = _merge_attn_states.overload(vmapped_at(outs, in_dims[0], batch, 1),
                                           vmapped_at(lses, in_dims[1], batch, 1))
    return (out, lse), (0, 0)


@fused_op("cascade_attn")
def _cascade_attn(
    q: Tensor, shared_k: Tensor, shared_v: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
    block_table: Optional[Tensor], sinks: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor],
    kv_layout: str, softmax_scale: float, causal: bool, softcap: float, num_splits: Optional[int],
) -> tuple[Tensor, Tensor]:
    shape, shared_len, options, _ = check_cascade_args(
        q=_info(q), shared_k=_info(shared_k), shared_v=_info(shared_v), k_cache=_info(k_cache),
        v_cache=_info(v_cache), cache_seqlens=_info(cache_seqlens), block_table=_info(block_table),
        kv_layout=kv_layout, sinks=_info(sinks), k_scale=_info(k_scale), v_scale=_info(v_scale),
        softmax_scale=softmax_scale, causal=causal, softcap=softcap)
    k_cache, v_cache = _prepare(k_cache), _prepare(v_cache)
    plan = _cascade_plan(shape, shared_len, options, target_for(q.device), num_splits,
                         _cache_strides(k_cache, kv_layout), _cache_strides(v_cache, kv_layout),
                         active_config(DecodeConfig))
    shared_k, shared_v = shared_k.contiguous(), shared_v.contiguous()
    _check_pairs_base(plan, {"shared_k": shared_k, "k_cache": k_cache}, {"shared_v": shared_v, "v_cache": v_cache})
    given = {"q": q, "shared_k": shared_k, "shared_v": shared_v, "k_cache": k_cache, "v_cache": v_cache,
             "cache_seqlens": cache_seqlens, "block_table": block_table, "sinks": sinks, "k_scale": k_scale,
             "v_scale": v_scale}
    out, lse = execute(plan, {n: given[n] if n in ("k_cache", "v_cache") else given[n].contiguous()
                              for n in plan.inputs})
    return out, lse


@_cascade_attn.register_fake
def _(q, shared_k, shared_v, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale, kv_layout,
      softmax_scale, causal, softcap, num_splits):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v_cache.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


register_forward_only(_decode_attn, "decode_attention")
register_forward_only(_merge_attn_states, "merge_attention_states")
register_forward_only(_cascade_attn, "cascade_attention")


@fused_op("append_kv_cache", mutates_args=("k_cache", "v_cache"))
def _append_kv_cache(
    k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, cache_seqlens: Tensor,
    block_table: Optional[Tensor], k_scale: Optional[Tensor], v_scale: Optional[Tensor], kv_layout: str,
    cache_leftpad: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
    rotary_interleaved: bool = False,
) -> None:
    shape = check_append_args(k_cache=_info(k_cache), v_cache=_info(v_cache), k_new=_info(k_new),
                              v_new=_info(v_new), cache_seqlens=_info(cache_seqlens), block_table=_info(block_table),
                              kv_layout=kv_layout, k_scale=_info(k_scale), v_scale=_info(v_scale),
                              cache_leftpad=_info(cache_leftpad), rotary_cos=_info(rotary_cos),
                              rotary_sin=_info(rotary_sin), rotary_interleaved=rotary_interleaved)
    interpret = k_cache.device.type == "cpu"
    # The kernel writes through the caches (execute's ``out``): on a GPU the caches themselves, any strides
    # with a contiguous head dim; on the CPU contiguous staging copies (the interpreter's float32 in place
    # of bfloat16), copied back.
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not interpret and cache.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous (stride 1), got strides {cache.stride()}")
    # the interpreter's float32 copies of bf16 tokens, made here so that their strides go into the plan
    k_new, v_new = (t.float() if interpret and t.dtype == torch.bfloat16 else t for t in (k_new, v_new))
    strides = {n: (t.stride(0), t.stride(1), t.stride(2)) for n, t in (("k_new", k_new), ("v_new", v_new))}
    if not interpret:
        strides.update(k_cache=_cache_strides(k_cache, kv_layout), v_cache=_cache_strides(v_cache, kv_layout))
    plan = plan_append(shape, target=target_for(k_cache.device), strides=strides)
    given = {"k_new": k_new, "v_new": v_new, "cache_seqlens": cache_seqlens, "block_table": block_table,
             "k_scale": k_scale, "v_scale": v_scale, "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos,
             "rotary_sin": rotary_sin, "k_cache": k_cache, "v_cache": v_cache}
    execute(plan, {n: given[n] if n in ("k_new", "v_new", "k_cache", "v_cache") else given[n].contiguous()
                   for n in plan.inputs}, out={"k_out": k_cache, "v_out": v_cache})


@_append_kv_cache.register_fake
def _(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, k_scale, v_scale, kv_layout, cache_leftpad=None,
      rotary_cos=None, rotary_sin=None, rotary_interleaved=False):
    return None


# ----------------------------------------------------------------------------------------------- public

def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Tensor,
                     block_table: Optional[Tensor] = None, kv_layout: str = "NHD",
                     softmax_scale: Optional[float] = None, causal: bool = True,
                     window_size: tuple[int, int] = (-1, -1), alibi_slopes: Optional[Tensor] = None,
                     softcap: float = 0.0, sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                     v_scale: Optional[Tensor] = None, num_splits: Optional[int] = None,
                     return_lse: bool = False, cache_leftpad: Optional[Tensor] = None,
                     rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
                     rotary_interleaved: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of a few query tokens per sequence over a KV cache (Flash-Decoding, split-KV):
    ``out[b, i] = softmax(mods(softmax_scale * q[b, i] K_b^T)) V_b`` over the first ``cache_seqlens[b]``
    rows of sequence b's cache.

    Args:
        q: ``(B, Sq, Hq, Dqk)``, float16 / bfloat16 / float32; Sq small (1 for decode, up to ~16 for
            speculative decoding or chunked prefill). CUDA, or CPU (Triton interpreter).
        k_cache, v_cache: contiguous ``(B, S_max, Hkv, D)`` (``kv_layout="NHD"``) or ``(B, Hkv, S_max, D)``
            ("HND"); paged (with ``block_table``) ``(num_pages, page_size, Hkv, D)`` or ``(num_pages, Hkv,
            page_size, D)``, page size a power of two. q's dtype, or ``torch.float8_e4m3fn`` with
            ``k_scale`` / ``v_scale``. ``Dqk`` up to 1024 (chunked above 256), ``Dv`` up to 512, Dqk != Dv
            allowed (MLA: pass ``v_cache = k_cache[..., :512]``, a strided view, no copy on CUDA).
        cache_seqlens: int32 ``(B,)``: keys of sequence b are its rows ``0 .. cache_seqlens[b] - 1``
            (0 allowed: out 0, lse -inf).
        block_table: int32 ``(B, max_pages)``: row j of sequence b is slot ``j % page_size`` of page
            ``block_table[b, j // page_size]``. Entries past a sequence's pages are never read.
        causal: query i sees keys ``j <= cache_seqlens[b] - Sq + i`` (the queries are the last Sq tokens).
        window_size: ``(left, right)`` around that diagonal; -1 = unbounded. Combines with causal.
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)``: adds ``-slope * |cache_seqlens[b] - Sq + i - j|``.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        sinks: ``(Hq,)``: a per-head logit joining the softmax denominator (attends to nothing).
        k_scale, v_scale: float32 ``()``/``(1,)`` (per tensor) or ``(Hkv,)`` (per kv head) dequantisation
            scales of an FP8 cache: the cache holds ``k / k_scale``. Each must be finite and > 0: CPU tensors
            are checked (ValueError); a CUDA tensor is not read on the host (that would synchronise), and a
            zero, negative or non-finite scale there gives a meaningless result without an error (NaN, or
            finite but wrong: ``k_scale = 0`` weights every visible key alike).
        num_splits: how many programs share one sequence's keys; None picks it from the SM count, B * Hkv
            and the cache capacity (1 when the batch fills the GPU). A fixed value gives bitwise
            reproducible, batch-invariant results; different values agree to rounding.
        return_lse: also return the float32 log-sum-exp ``(B, Hq, Sq)``.
        cache_leftpad: int32 ``(B,)``, contiguous caches only: sequence b's tokens are rows
            ``[cache_leftpad[b], cache_seqlens[b])`` (a left-padded cache, as flash-attn's); causal, window
            and ALiBi positions count from its first real token.
        rotary_cos, rotary_sin: ``(S_rot, rotary_dim / 2)`` RoPE tables (as ``rotary_embedding``): q is
            rotated as the kernel reads it, query i of sequence b at position ``n_b - Sq + i`` with ``n_b =
            cache_seqlens[b] - cache_leftpad[b]`` (as flash-attn; without causal or a window every query at
            ``n_b - Sq``). Pair with ``append_kv_cache(..., rotary_cos=, rotary_sin=)``. Head dims <= 256.
        rotary_interleaved: GPT-J pairs ``(2i, 2i + 1)`` instead of GPT-NeoX halves.

    Non-finite values follow IEEE arithmetic, as the float64 reference (``flashbridge.reference``): a NaN in
    anything a row sees (its query, a visible cached key or value, its ALiBi slope or sink) makes the row's
    ``out`` NaN, and its ``lse`` NaN unless only values hold it, with any split count (a NaN partial is never
    merged away); a +inf score or sink gives lse +inf. Cache rows at or past ``cache_seqlens[b]`` are never
    read. Limit (as in every MMA-based attention): inside one key tile, a NaN *value* of a key that a row does
    not see (causal / window edges with several query tokens) reaches it through ``0 * NaN`` in ``p @ v``.

    Returns:
        ``out`` ``(B, Sq, Hq, Dv)`` in q's dtype, or ``(out, lse)``.

    Performance: a small decode step takes less GPU time than the host needs to launch it. The op can be
    captured in a CUDA graph (``torch.cuda.graph``) and
    compiles with ``torch.compile(fullgraph=True)`` (both covered by the GPU tests); replaying a graph of the
    model's step removes the launch cost (``benchmarks/bench_decode.py`` times every torch row that way).

    Example::

        >>> q = torch.randn(2, 1, 8, 64)
        >>> k = v = torch.randn(2, 256, 2, 64)
        >>> out = decode_attention(q, k, v, cache_seqlens=torch.tensor([100, 256], dtype=torch.int32))
        >>> out.shape
        torch.Size([2, 1, 8, 64])
    """
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
               "block_table": block_table, "alibi_slopes": alibi_slopes, "sinks": sinks, "k_scale": k_scale,
               "v_scale": v_scale, "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin}
    check_tensors(tensors, ("q", "k_cache", "v_cache", "cache_seqlens"))
    shape, options, splits = check_decode_args(
        **{n: _info(t) for n, t in tensors.items()}, kv_layout=kv_layout, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits,
        rotary_interleaved=rotary_interleaved)
    values = _host_values(cache_seqlens, block_table)
    if values is not None:
        check_cache_values(*values, shape.cache)
    _host_leftpad(cache_leftpad, cache_seqlens)
    check_scale_values(**_host_scales(k_scale=k_scale, v_scale=v_scale))
    latent = _latent_view(shape, options, q, k_cache, v_cache, k_scale, v_scale, kv_layout)
    if latent is not None:  # MLA: one latent head, the values its first Dv dims
        from .mla import _mla_decode

        out, lse = _mla_decode(q, latent, cache_seqlens, block_table, None, k_scale, shape.head_dim_v,
                               float(options.softmax_scale), splits)
    else:
        out, lse = _decode_attn(
            q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks, k_scale, v_scale, kv_layout,
            float(options.softmax_scale), bool(options.causal), options.window_left, options.window_right,
            float(options.softcap), splits, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved)
    return (out, lse) if return_lse else out


def _latent_view(shape, options, q, k_cache, v_cache, k_scale, v_scale, kv_layout) -> Optional[Tensor]:
    """The ``(pages, rows, Dqk)`` view of ``k_cache`` when a decode call is MLA's absorbed form -- one KV
    head, ``v_cache`` a prefix view of ``k_cache`` (the same memory, its first Dv dims), causal, no
    window / ALiBi / softcap / sinks, one FP8 scale for both -- so that it runs on the MLA kernel (query
    heads as MMA rows, each latent tile loaded once for all of them); else None. Eager calls only: a view's
    memory cannot be compared while tracing."""
    if (shape.heads_kv != 1 or shape.heads_q > 128 or not options.causal or options.window_left is not None
            or options.softcap or options.has_alibi or options.has_sinks or k_scale is not v_scale
            or options.has_leftpad or options.rotary_half
            or torch.compiler.is_compiling()):
        return None
    if (v_cache.dtype != k_cache.dtype or v_cache.data_ptr() != k_cache.data_ptr() or k_cache.stride(-1) != 1
            or v_cache.stride()[:-1] != k_cache.stride()[:-1] or v_cache.shape[-1] > k_cache.shape[-1]):
        return None
    return k_cache[:, :, 0] if kv_layout == "NHD" else k_cache[:, 0]


def merge_attention_states(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Exact merge of N attention states over disjoint key sets:
    ``lse = log sum_n exp(lses[n])``, ``out = sum_n exp(lses[n] - lse) outs[n]``.

    Args:
        outs: ``(N, ..., D)`` float (each state normalised over its own keys).
        lses: float32 ``(N, ...)`` (natural log; -inf for a state that saw no key). A decode lse
            ``(B, Hq, Sq)`` pairs with an out ``(B, Sq, Hq, D)`` after ``lse.transpose(-1, -2)``.

    Returns:
        ``(out (..., D) in outs' dtype, lse float32 (...))``; rows where every state is empty give 0, -inf.
        A state with lse -inf contributes nothing (whatever its out holds); any other state's out counts
        even where its weight underflows, so a NaN out or lse always makes the row NaN (IEEE arithmetic,
        as the float64 reference); a +inf lse gives lse +inf.

    Example::

        >>> o1, o2 = torch.randn(2, 4, 8, 64).unbind(0)
        >>> l1, l2 = torch.randn(2, 4, 8).unbind(0)
        >>> out, lse = merge_attention_states(torch.stack([o1, o2]), torch.stack([l1, l2]))
    """
    check_tensors({"outs": outs, "lses": lses}, ("outs", "lses"))
    check_merge_args(_info(outs), _info(lses))
    return _merge_attn_states(outs, lses)


def cascade_attention(q: Tensor, shared_k: Tensor, shared_v: Tensor, k_cache: Tensor, v_cache: Tensor, *,
                      cache_seqlens: Tensor, block_table: Optional[Tensor] = None, kv_layout: str = "NHD",
                      softmax_scale: Optional[float] = None, causal: bool = True, softcap: float = 0.0,
                      sinks: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
                      v_scale: Optional[Tensor] = None, num_splits: Optional[int] = None,
                      return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Decode over ``concat(shared prefix, own cache)`` with the shared prefix read once for the batch
    (FlashInfer-style cascade): the prefix's (out, lse) for all ``B * Sq`` query tokens at once, each
    request's own cache as in :func:`decode_attention`, then an exact LSE merge (sinks added once).

    Args:
        q, k_cache, v_cache, cache_seqlens, block_table, kv_layout, softmax_scale, softcap, sinks, k_scale,
            v_scale, num_splits, return_lse: as :func:`decode_attention`.
        shared_k, shared_v: the prefix every request shares, ``(S_shared, Hkv, D)`` (NHD) or
            ``(Hkv, S_shared, D)`` (HND), in the cache's dtype (same scales for FP8).
        causal: within each request's own cache (the shared prefix precedes all queries: fully visible).
            Windows and ALiBi are not supported here (they need absolute positions across both parts).

    Example::

        >>> q = torch.randn(4, 1, 8, 64); shared = torch.randn(512, 2, 64)
        >>> cache = torch.randn(4, 64, 2, 64); lens = torch.full((4,), 30, dtype=torch.int32)
        >>> out = cascade_attention(q, shared, shared, cache, cache, cache_seqlens=lens)
    """
    tensors = {"q": q, "shared_k": shared_k, "shared_v": shared_v, "k_cache": k_cache, "v_cache": v_cache,
               "cache_seqlens": cache_seqlens, "block_table": block_table, "sinks": sinks, "k_scale": k_scale,
               "v_scale": v_scale}
    check_tensors(tensors, ("q", "shared_k", "shared_v", "k_cache", "v_cache", "cache_seqlens"))
    shape, _, options, splits = check_cascade_args(
        **{n: _info(t) for n, t in tensors.items()}, kv_layout=kv_layout, softmax_scale=softmax_scale,
        causal=causal, softcap=softcap, num_splits=num_splits)
    values = _host_values(cache_seqlens, block_table)
    if values is not None:
        check_cache_values(*values, shape.cache)
    check_scale_values(**_host_scales(k_scale=k_scale, v_scale=v_scale))
    out, lse = _cascade_attn(
        q, shared_k, shared_v, k_cache, v_cache, cache_seqlens, block_table, sinks, k_scale, v_scale, kv_layout,
        float(options.softmax_scale), bool(options.causal), float(options.softcap), splits)
    return (out, lse) if return_lse else out


def append_kv_cache(k_cache: Tensor, v_cache: Tensor, k_new: Tensor, v_new: Tensor, *, cache_seqlens: Tensor,
                    block_table: Optional[Tensor] = None, kv_layout: str = "NHD", k_scale: Optional[Tensor] = None,
                    v_scale: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                    rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
                    rotary_interleaved: bool = False) -> None:
    """Write new tokens into the cache **in place**: token s of ``k_new[b]`` goes to row
    ``cache_seqlens[b] + s`` of sequence b (through ``block_table`` when paged). ``cache_seqlens`` holds the
    lengths *before* the append; decode afterwards with ``cache_seqlens + S_new``.

    Args:
        k_cache, v_cache: the caches, as :func:`decode_attention` (mutated; declared to torch.library).
        k_new, v_new: ``(B, S_new, Hkv, Dqk)`` / ``(B, S_new, Hkv, Dv)`` in the cache's dtype, or any float
            dtype for an FP8 cache, which stores ``clip(new / scale, -448, 448)`` rounded to e4m3 (nearest even).
        k_scale, v_scale: FP8 only: float32 per tensor ``()``/``(1,)`` or per kv head ``(Hkv,)``, finite and
            > 0 (checked on CPU tensors; on a CUDA device a zero scale stores +-448 or NaN, a negative one
            flips signs). NaN in ``k_new`` / ``v_new`` is stored as e4m3's NaN, +-inf saturates to +-448.
        rotary_cos, rotary_sin, rotary_interleaved: RoPE tables ``(S_rot, rotary_dim / 2)``: the new keys are
            rotated as they are written (flash-attn's ``flash_attn_with_kvcache`` rotary step), token s at
            position ``cache_seqlens[b] - cache_leftpad[b] + s``, rounded to ``k_new``'s dtype first: the same
            as ``rotary_embedding`` then ``append_kv_cache``. ``v_new`` is not rotated.
        cache_leftpad: int32 ``(B,)`` (contiguous caches): the first real row of each sequence, for the
            rotary positions (as in :func:`decode_attention`).

    Example::

        >>> k, v = torch.zeros(2, 64, 2, 32), torch.zeros(2, 64, 2, 32)
        >>> append_kv_cache(k, v, torch.ones(2, 1, 2, 32), torch.ones(2, 1, 2, 32),
        ...                 cache_seqlens=torch.tensor([5, 9], dtype=torch.int32))
        >>> float(k[1, 9].sum()), float(k[1, 10].sum())
        (64.0, 0.0)
    """
    tensors = {"k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
               "cache_seqlens": cache_seqlens, "block_table": block_table, "k_scale": k_scale, "v_scale": v_scale,
               "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin}
    check_tensors(tensors, ("k_cache", "v_cache", "k_new", "v_new", "cache_seqlens"))
    if torch.is_grad_enabled() and (k_new.requires_grad or v_new.requires_grad):
        # a write into a cache records nothing for autograd: the gradient of k_new / v_new would be lost
        raise NotImplementedError(no_backward_message("append_kv_cache") + " (k_new / v_new require grad)")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # an expanded view (stride 0): rows share memory, writes would land on each other (and the CPU's
        # copy back fails after the launch)
        if any(st == 0 and n > 1 for st, n in zip(cache.stride(), cache.shape)):
            raise ValueError(f"{name}: its elements share memory (strides {cache.stride()} for shape "
                             f"{tuple(cache.shape)}, e.g. an expand()ed view); append_kv_cache writes into the "
                             "cache, which needs memory of its own (allocate it, or .clone() the view)")
    shape = check_append_args(**{n: _info(t) for n, t in tensors.items()}, kv_layout=kv_layout,
                              rotary_interleaved=rotary_interleaved)
    values = _host_values(cache_seqlens, block_table)
    if values is not None:
        check_cache_values(*values, shape.cache, new_tokens=shape.new_tokens)
    _host_leftpad(cache_leftpad, cache_seqlens)
    check_scale_values(**_host_scales(k_scale=k_scale, v_scale=v_scale))
    _append_kv_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, k_scale, v_scale, kv_layout,
                     cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved)
