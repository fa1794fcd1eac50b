"""float64 NumPy reference for MLA (DeepSeek multi-head latent attention), in both of its forms.

**Absorbed** (what the kernels compute): one latent KV head of ``Dqk`` dims shared by all ``H`` query heads,
the values its first ``Dv`` dims (DeepSeek-V3: a 512-dim compressed latent followed by a 64-dim RoPE key,
``Dqk = 576``, ``Dv = 512``)::

    s[b, h, i, j] = softmax_scale * q[b, i, h, :] . kv[b, j, :]
    s = -inf where key j is not visible from query i (causal, bounds, top-k indices)
    out[b, i, h, :] = sum_j softmax_j(s)[b, h, i, j] kv[b, j, :Dv],  lse = log sum_j exp(s)

Visibility: causal is aligned to the bottom-right corner (query i sits on key ``i + Sk - Sq``); with
``indices`` ``(B, Sq, topk)`` query i sees exactly the keys listed in ``indices[b, i]`` (entries -1 or past
the sequence are skipped), intersected with the causal rule when it applies; a dense ``mask`` ``(B|1, Sq,
Sk)`` (a block mask given densely, ``BlockMask.to_dense()[:, 0]``) intersects it too. A row that sees
nothing has ``out = 0`` and ``lse = -inf``.

**Un-absorbed** (what a training step computes): per head, keys ``[c_kv W_UK[h]^T, k_rope]`` and values
``c_kv W_UV[h]^T`` from the latent ``c_kv``; :func:`absorb_query` / :func:`latent_cache` /
:func:`unabsorb_output` turn it into the absorbed form (``q_nope W_UK`` folds the key up-projection into the
query, ``W_UV`` is applied after the attention), which is the same function (tested).
"""
from __future__ import annotations

import math

import numpy as np

from . import attention as attn
from .decode import gather_cache


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def visible(batch: int, seqlen_q: int, seqlen_k: int, *, causal: bool = False, indices=None, lengths=None,
            mask=None):
    """``(B, Sq, Sk)`` bool: query i of sequence b sees key j.

    ``lengths`` (B,): sequence b has that many keys (default ``Sk``), query i sits on key
    ``lengths[b] - Sq + i``. ``indices`` ``(B, Sq, topk)``: only the listed keys (-1 and out-of-range entries
    skipped). ``causal``: keys at or before the query's own position. ``mask`` bool ``(B|1, Sq, Sk)`` or
    ``(Sq, Sk)``: only the keys it marks."""
    lengths = [seqlen_k] * batch if lengths is None else [int(x) for x in lengths]
    ok = np.zeros((batch, seqlen_q, seqlen_k), dtype=bool)
    j = np.arange(seqlen_k)[None, :]
    for b, length in enumerate(lengths):
        row = np.broadcast_to(j < length, (seqlen_q, seqlen_k)).copy()
        if causal:
            row &= j <= np.arange(seqlen_q)[:, None] + (length - seqlen_q)
        if indices is not None:
            chosen = np.zeros((seqlen_q, seqlen_k), dtype=bool)
            idx = np.asarray(indices)[b].astype(np.int64)
            for i in range(seqlen_q):
                valid = idx[i][(idx[i] >= 0) & (idx[i] < seqlen_k)]
                chosen[i, valid] = True
            row &= chosen
        ok[b] = row
    if mask is not None:
        ok &= np.broadcast_to(np.asarray(mask, dtype=bool), ok.shape)
    return ok


def _scale(dqk: int, softmax_scale) -> float:
    return 1.0 / math.sqrt(dqk) if softmax_scale is None else float(softmax_scale)


def _attend(q, keys, values, mask, scale):
    """q (B, Sq, H, Dqk), keys (B, Sk, Dqk), values (B, Sk, Dv), mask (B, Sq, Sk) -> out, lse, p."""
    s = scale * np.einsum("bqhd,bkd->bhqk", q, keys)
    s = np.where(mask[:, None], s, -np.inf)
    lse = np.stack([attn._lse(s[b], None) for b in range(s.shape[0])])  # (B, H, Sq)
    p = attn._probs(s, lse)
    return np.einsum("bhqk,bkd->bqhd", p, values), lse, p


def mla_attention(q, kv, *, head_dim_v=512, causal=False, softmax_scale=None, indices=None, mask=None):
    """Absorbed MLA over a latent ``kv`` ``(B, Sk, Dqk)`` shared by the query heads of ``q`` ``(B, Sq, H,
    Dqk)``; ``mask`` a dense bool ``(B|1, Sq, Sk)`` (see :func:`visible`). Returns ``(out (B, Sq, H, Dv),
    lse (B, H, Sq))`` in float64."""
    q, kv = _f64(q), _f64(kv)
    batch, sq = q.shape[:2]
    mask = visible(batch, sq, kv.shape[1], causal=causal, indices=indices, mask=mask)
    out, lse, _ = _attend(q, kv, kv[..., :head_dim_v], mask, _scale(q.shape[-1], softmax_scale))
    return out, lse


def mla_attention_bwd(dout, q, kv, *, head_dim_v=512, causal=False, softmax_scale=None, indices=None, mask=None,
                      dlse=None):
    """Gradients of :func:`mla_attention`: ``(dq, dkv)``. ``kv`` is both the keys and (its first Dv dims)
    the values, so its gradient is the sum of both roles over every head:

    ``delta = rowsum(dout * out) - dlse``, ``ds = p * (dout kv[:, :Dv]^T - delta)``,
    ``dq = scale * ds kv``, ``dkv = scale * sum_h ds^T q + [sum_h p^T dout, 0]``."""
    q, kv, dout = _f64(q), _f64(kv), _f64(dout)
    batch, sq = q.shape[:2]
    scale = _scale(q.shape[-1], softmax_scale)
    mask = visible(batch, sq, kv.shape[1], causal=causal, indices=indices, mask=mask)
    values = kv[..., :head_dim_v]
    out, lse, p = _attend(q, kv, values, mask, scale)
    delta = np.einsum("bqhd,bqhd->bhq", out, dout)
    if dlse is not None:
        delta = delta - np.where(np.isfinite(lse), _f64(dlse), 0.0)
    dp = np.einsum("bqhd,bkd->bhqk", dout, values)
    ds = p * (dp - delta[..., None]) * scale
    dq = np.einsum("bhqk,bkd->bqhd", ds, kv)
    dkv = np.einsum("bhqk,bqhd->bkd", ds, q)
    dkv[..., :head_dim_v] += np.einsum("bhqk,bqhd->bkd", p, dout)
    return dq, dkv


def mla_decode(q, kv_cache, *, cache_seqlens, block_table=None, head_dim_v=512, softmax_scale=None, indices=None,
               kv_scale=None, num_splits=None):
    """Absorbed MLA of ``Sq`` query tokens per sequence over a latent cache: contiguous ``(B, S_max, Dqk)``
    or paged ``(num_pages, page_size, Dqk)`` with ``block_table``, dequantised by ``kv_scale`` (FP8).
    Causal over the first ``cache_seqlens[b]`` rows (query i sits on row ``cache_seqlens[b] - Sq + i``);
    ``indices`` ``(B, Sq, topk)`` are positions in the sequence. Returns ``(out, lse)``; ``num_splits`` is
    accepted and ignored."""
    q = _f64(q)
    batch, sq, heads, dqk = q.shape
    lengths = [int(x) for x in np.asarray(cache_seqlens)]
    cache = np.asarray(kv_cache)[:, :, None, :]  # one latent head: (pages or batch, rows, 1, Dqk)
    s_max = max(max(lengths), 1)
    kv = np.zeros((batch, s_max, dqk))
    for b, length in enumerate(lengths):
        kv[b, :length] = gather_cache(cache, length, b, block_table=block_table, scale=kv_scale)[:, 0]
    mask = visible(batch, sq, s_max, causal=True, indices=indices, lengths=lengths)
    out, lse, _ = _attend(q, kv, kv[..., :head_dim_v], mask, _scale(dqk, softmax_scale))
    return out, lse


# ------------------------------------------------------------------------------------------ un-absorbed

def mla_unabsorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, *, causal=False, softmax_scale=None, indices=None):
    """MLA as trained: per head h, ``k = [c_kv W_UK[h]^T, k_rope]``, ``v = c_kv W_UV[h]^T``, ordinary
    attention with queries ``[q_nope, q_rope]``.

    q_nope ``(B, Sq, H, Dn)``, q_rope ``(B, Sq, H, Dr)``, c_kv ``(B, Sk, R)``, k_rope ``(B, Sk, Dr)`` (shared
    by the heads), w_uk ``(H, Dn, R)``, w_uv ``(H, Dv, R)``; default scale ``1 / sqrt(Dn + Dr)``. Returns
    ``(out (B, Sq, H, Dv), lse (B, H, Sq))``."""
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv = (_f64(a) for a in (q_nope, q_rope, c_kv, k_rope, w_uk, w_uv))
    batch, sq, heads, dn = q_nope.shape
    sk = c_kv.shape[1]
    k_nope = np.einsum("bkr,hnr->bkhn", c_kv, w_uk)
    values = np.einsum("bkr,hvr->bkhv", c_kv, w_uv)
    keys = np.concatenate([k_nope, np.broadcast_to(k_rope[:, :, None, :], (batch, sk, heads, k_rope.shape[-1]))], -1)
    q = np.concatenate([q_nope, q_rope], -1)
    scale = _scale(q.shape[-1], softmax_scale)
    mask = visible(batch, sq, sk, causal=causal, indices=indices)
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, keys)
    s = np.where(mask[:, None], s, -np.inf)
    lse = np.stack([attn._lse(s[b], None) for b in range(batch)])
    p = attn._probs(s, lse)
    return np.einsum("bhqk,bkhv->bqhv", p, values), lse


def absorb_query(q_nope, q_rope, w_uk):
    """The absorbed query ``[q_nope W_UK[h], q_rope]`` ``(B, Sq, H, R + Dr)``: ``q_nope . (c W_UK^T) =
    (q_nope W_UK) . c``."""
    return np.concatenate([np.einsum("bqhn,hnr->bqhr", _f64(q_nope), _f64(w_uk)), _f64(q_rope)], -1)


def latent_cache(c_kv, k_rope):
    """The latent KV ``[c_kv, k_rope]`` ``(B, Sk, R + Dr)`` that the absorbed form attends to."""
    return np.concatenate([_f64(c_kv), _f64(k_rope)], -1)


def unabsorb_output(out_latent, w_uv):
    """Per-head values from the absorbed output ``(B, Sq, H, R)``: ``out_latent[h] W_UV[h]^T``."""
    return np.einsum("bqhr,hvr->bqhv", _f64(out_latent), _f64(w_uv))
