"""float64 NumPy reference for the Flash-Decoding family: decode over a (paged) KV cache, merge of attention
states, cascade attention and appends to a cache (with FP8 quantisation).

Decode is a dense softmax over the *gathered* cache: sequence ``b``'s keys are rows ``0 .. L_b - 1``
(``L_b = cache_seqlens[b]``) read through the block table (page ``block_table[b, j // page_size]``, slot
``j % page_size``) or from the contiguous cache, dequantised (``k * k_scale``), and attended by its ``Sq``
query tokens with :func:`flashbridge.reference.attention.flash_attention` -- the same score modifiers in the
same order (scale, softcap, ALiBi, mask), bottom-right aligned: query ``i`` sits on key ``L_b - Sq + i``.
With ``cache_leftpad`` the keys are rows ``P_b .. L_b - 1`` (``P_b = cache_leftpad[b]``), counted from
``P_b``; with rotary tables q is rotated by :func:`flashbridge.reference.rotary.rotary_embedding` at positions
``L_b - P_b - Sq + i`` (all at ``L_b - P_b - Sq`` without causal or a window, as flash-attn), and appended keys
at ``row - P_b``.
"""
from __future__ import annotations

import math

import numpy as np

from . import attention as attn
from .rotary import rotary_embedding

FP8_MAX = 448.0


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def _scale_per_head(scale, heads):
    if scale is None:
        return np.ones(heads)
    s = np.asarray(scale, dtype=np.float64).reshape(-1)
    return np.broadcast_to(s, (heads,)) if s.size == 1 else s


def gather_cache(cache, length: int, b: int, *, block_table=None, kv_layout="NHD", scale=None,
                 start: int = 0) -> np.ndarray:
    """Rows ``start .. length - 1`` of sequence ``b`` as float64 ``(length - start, Hkv, D)``, dequantised."""
    cache = np.asarray(cache)
    if kv_layout == "HND":
        cache = np.swapaxes(cache, 1, 2)  # -> (pages or batch, rows, heads, D)
    if block_table is None:
        rows = cache[b, start:length]
    else:
        page_size = cache.shape[1]
        j = np.arange(start, length)
        pages = np.asarray(block_table)[b, j // page_size]
        rows = cache[pages, j % page_size]
    rows = rows.astype(np.float64)
    return rows * _scale_per_head(scale, cache.shape[2])[None, :, None]


def decode_attention(q, k_cache, v_cache, *, cache_seqlens, block_table=None, kv_layout="NHD", softmax_scale=None,
                     causal=True, window_size=(-1, -1), alibi_slopes=None, softcap=0.0, sinks=None, k_scale=None,
                     v_scale=None, num_splits=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                     rotary_interleaved=False):
    """``(out (B, Sq, Hq, Dv), lse (B, Hq, Sq))`` in float64; ``num_splits`` is accepted and ignored."""
    q = _f64(q)
    batch, sq = q.shape[:2]
    lengths = [int(x) for x in np.asarray(cache_seqlens)]
    starts = [0] * batch if cache_leftpad is None else [int(x) for x in np.asarray(cache_leftpad)]
    if rotary_cos is not None:
        step = 1 if causal or tuple(window_size) != (-1, -1) else 0
        pos = np.array([[n - p - sq + step * i for i in range(sq)] for n, p in zip(lengths, starts)])
        q = rotary_embedding(q, rotary_cos, rotary_sin, interleaved=rotary_interleaved, position_ids=pos)
    slopes = None if alibi_slopes is None else _f64(alibi_slopes)
    dv = np.asarray(v_cache).shape[-1]
    out = np.zeros(q.shape[:-1] + (dv,))
    lse = np.zeros((batch, q.shape[2], q.shape[1]))
    for b in range(batch):
        k = gather_cache(k_cache, lengths[b], b, block_table=block_table, kv_layout=kv_layout, scale=k_scale,
                         start=starts[b])
        v = gather_cache(v_cache, lengths[b], b, block_table=block_table, kv_layout=kv_layout, scale=v_scale,
                         start=starts[b])
        a = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        o, l_ = attn.flash_attention(q[b:b + 1], k[None], v[None], causal=causal, softmax_scale=softmax_scale,
                                     window_size=window_size, alibi_slopes=a, softcap=softcap, sinks=sinks)
        out[b], lse[b] = o[0], l_[0]
    return out, lse


def merge_attention_states(outs, lses):
    """Exact merge of N states: ``lse = log sum_n exp(lse_n)``, ``out = sum_n exp(lse_n - lse) out_n``.
    outs ``(N, ..., D)``, lses ``(N, ...)``; rows where every lse is -inf give out 0, lse -inf. A state with
    lse -inf saw nothing and contributes 0 whatever its out holds; every other state contributes its
    weighted out even where the weight underflows, so a NaN out always reaches the result, and a NaN lse
    makes the row NaN (IEEE arithmetic, as :func:`flashbridge.reference.attention.flash_attention`)."""
    outs, lses = _f64(outs), _f64(lses)
    m = np.max(lses, axis=0)  # NaN where a state's lse is
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.exp(lses - m_safe)  # (N, ...)
        total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(total == 0, -np.inf, m_safe + np.log(total))
        weights = np.where(total == 0, 0.0, w / np.where(total == 0, 1.0, total))
        out = np.einsum("n...,n...d->...d", weights, np.where(lses[..., None] == -np.inf, 0.0, outs))
    return out, lse


def cascade_attention(q, shared_k, shared_v, k_cache, v_cache, *, cache_seqlens, block_table=None,
                      kv_layout="NHD", softmax_scale=None, causal=True, softcap=0.0, sinks=None, k_scale=None,
                      v_scale=None, num_splits=None):
    """Attention of each request's queries over ``concat(shared prefix, own cache[:L_b])``: every query sees
    the whole shared prefix; within the own cache, causal (bottom-right aligned) as in decode. One dense
    softmax over both parts (sinks in the denominator once). Returns ``(out, lse)`` as decode."""
    q = _f64(q)
    batch, sq, hq, dqk = q.shape
    scale = 1.0 / math.sqrt(dqk) if softmax_scale is None else float(softmax_scale)
    lengths = [int(x) for x in np.asarray(cache_seqlens)]
    shared_k, shared_v = np.asarray(shared_k), np.asarray(shared_v)
    if kv_layout == "HND":
        shared_k, shared_v = np.swapaxes(shared_k, 0, 1), np.swapaxes(shared_v, 0, 1)
    hkv = shared_k.shape[1]
    sk = shared_k.astype(np.float64) * _scale_per_head(k_scale, hkv)[None, :, None]
    sv = shared_v.astype(np.float64) * _scale_per_head(v_scale, hkv)[None, :, None]
    sinks = _f64(sinks)
    group = hq // hkv
    dv = sv.shape[-1]
    out = np.zeros((batch, sq, hq, dv))
    lse = np.zeros((batch, hq, sq))
    for b in range(batch):
        k = gather_cache(k_cache, lengths[b], b, block_table=block_table, kv_layout=kv_layout, scale=k_scale)
        v = gather_cache(v_cache, lengths[b], b, block_table=block_table, kv_layout=kv_layout, scale=v_scale)
        s_shared, _, seen_shared = attn._scores(q[b], np.repeat(sk, group, axis=1), scale=scale, softcap=softcap,
                                                slopes=None, causal=False, window_size=(-1, -1))
        s_own, _, seen_own = attn._scores(q[b], np.repeat(k, group, axis=1), scale=scale, softcap=softcap,
                                          slopes=None, causal=causal, window_size=(-1, -1))
        s = np.concatenate([s_shared, s_own], axis=-1)  # (Hq, Sq, S_shared + L_b)
        row_lse = attn._lse(s, sinks)
        p = attn._probs(s, row_lse)
        values = np.concatenate([np.repeat(sv, group, axis=1), np.repeat(v, group, axis=1)], axis=0)
        out[b] = attn._attend(p, values, np.concatenate([seen_shared, seen_own], axis=-1))
        lse[b] = row_lse
    return out, lse


def quantize_fp8(x, scale=None, heads_axis=-2):
    """``clip(x / scale, -448, 448)`` rounded to float8_e4m3fn (nearest even), as ml_dtypes array. The
    division is done in float32 (as the kernel does), the rounding once."""
    import ml_dtypes

    x = np.asarray(x, dtype=np.float32)
    if scale is not None:
        s = np.asarray(scale, dtype=np.float32).reshape(-1)
        shape = [1] * x.ndim
        if s.size > 1:
            shape[heads_axis] = s.size
        x = x / s.reshape(shape)
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def append_kv_cache(k_cache, v_cache, k_new, v_new, *, cache_seqlens, block_table=None, kv_layout="NHD",
                    k_scale=None, v_scale=None, cache_leftpad=None, rotary_cos=None, rotary_sin=None,
                    rotary_interleaved=False):
    """New caches (copies) with token ``s`` of ``k_new[b]`` written to row ``cache_seqlens[b] + s`` of
    sequence ``b``; FP8 caches get ``quantize_fp8(new / scale)``, others ``new`` cast to the cache dtype.
    With rotary tables ``k_new`` is first rotated (float64) at positions ``cache_seqlens[b] - cache_leftpad[b]
    + s`` and rounded to its own dtype, as a separate rotation would store it."""
    lengths = [int(x) for x in np.asarray(cache_seqlens)]
    if rotary_cos is not None:
        k_arr = np.asarray(k_new)
        starts = [0] * len(lengths) if cache_leftpad is None else [int(x) for x in np.asarray(cache_leftpad)]
        pos = np.array([[n - p + s for s in range(k_arr.shape[1])] for n, p in zip(lengths, starts)])
        k_new = rotary_embedding(k_arr, rotary_cos, rotary_sin, interleaved=rotary_interleaved,
                                 position_ids=pos).astype(k_arr.dtype)
    result = []
    for cache, new, scale in ((k_cache, k_new, k_scale), (v_cache, v_new, v_scale)):
        cache = np.array(cache, copy=True)
        new = np.asarray(new)
        if cache.dtype.name == "float8_e4m3fn":
            values = quantize_fp8(new, scale)
        else:
            values = new.astype(cache.dtype)
        view = np.swapaxes(cache, 1, 2) if kv_layout == "HND" else cache  # (pages/batch, rows, heads, D) view
        n_new = new.shape[1]
        for b, length in enumerate(lengths):
            j = length + np.arange(n_new)
            if block_table is None:
                view[b, j] = values[b]
            else:
                page_size = view.shape[1]
                view[np.asarray(block_table)[b, j // page_size], j % page_size] = values[b]
        result.append(cache)
    return tuple(result)
