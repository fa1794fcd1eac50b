"""float64 NumPy reference for the FlashAttention family, forward and backward, every option.

Same layouts and arguments as the public ops: q ``(B, Sq, Hq, Dqk)``, k ``(B, Sk, Hkv, Dqk)``, v
``(B, Sk, Hkv, Dv)``; packed variable length q ``(total_q, Hq, Dqk)`` with ``cu_seqlens_q`` etc. Scores are
built explicitly, in the order the kernels apply them::

    s = softmax_scale * q @ k^T                          scale
    s = softcap * tanh(s / softcap)                      softcap > 0
    s = s - slope * |i + Sk - Sq - j|                    ALiBi (bottom-right aligned, like causal)
    s = -inf where key j is not visible from query i     causal / window / bounds
    p = exp(s - lse), lse = log(sum_j exp(s_j) + exp(sink))
    out = (p * keep / (1 - p_q)) @ v                    dropout (keep: attention_dropout_mask, p_q:
                                                         attention_dropout_rate(dropout_p)); lse undropped

A row that sees no key has ``out = 0`` and ``lse = -inf`` (``lse = sink`` when the head has a sink).
Non-finite values follow IEEE arithmetic and define what the kernels return: a NaN in anything a row
sees (its query, a visible key or value, its ALiBi slope or sink) makes its ``out`` NaN and, unless it is
in a value, its ``lse`` NaN; a +inf score (or sink) gives ``lse = +inf`` and ``out = sum_j exp(s_j - inf)
v_j``: NaN from the +inf keys (``inf / inf``), 0 from the others. Keys a row does not see never reach it.
"""
from __future__ import annotations

import math

import numpy as np

from .random import philox_bytes


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def visible_mask(seqlen_q: int, seqlen_k: int, *, causal: bool = False, window_size=(-1, -1)) -> np.ndarray:
    """``(Sq, Sk)`` bool: query i sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``.

    ``left``/``right`` of -1 are unbounded; ``causal`` sets ``right = 0`` (bottom-right aligned).
    """
    left, right = window_size
    if causal:
        right = 0
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    ok = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _scores(q, k, *, scale, softcap, slopes, causal, window_size, extra_mask=None):
    """Scores of one sequence: q (Sq, Hq, D), k (Sk, Hq, D) -> s (Hq, Sq, Sk), tanh term (or None), mask;
    ``extra_mask`` (bool, broadcastable to (Hq, Sq, Sk)) hides more keys (a block-sparse mask, dense)."""
    sq, sk = q.shape[0], k.shape[0]
    s = scale * np.einsum("qhd,khd->hqk", q, k)
    t = None
    if softcap > 0:
        t = np.tanh(s / softcap)
        s = softcap * t
    if slopes is not None:
        dist = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :])
        s = s - slopes[:, None, None] * dist[None]
    mask = visible_mask(sq, sk, causal=causal, window_size=window_size)[None]
    if extra_mask is not None:
        mask = mask & extra_mask
    s = np.where(mask, s, -np.inf)
    return s, t, mask


def _lse(s, sinks):
    """Row log-sum-exp over keys (and the sink): s (H, Sq, Sk) -> (H, Sq); -inf for empty rows.

    Non-finite scores follow IEEE arithmetic: a NaN score (or sink) gives NaN, a +inf one +inf (the sum of
    the exponentials overflows to +inf), -inf ones weigh 0."""
    m = np.max(s, axis=-1, initial=-np.inf)  # NaN where the row holds one
    if sinks is not None:
        m = np.maximum(m, sinks[:, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.sum(np.exp(s - m_safe[..., None]), axis=-1)
        if sinks is not None:
            total = total + np.exp(sinks[:, None] - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(total == 0, -np.inf, m_safe + np.log(total))


def _probs(s, lse):
    """``exp(s - lse)``: 0 in empty rows (lse -inf); in a row with lse +inf, 0 for finite scores and NaN for
    +inf ones (``exp(s) / sum = inf / inf``); NaN everywhere in a NaN row."""
    lse_safe = np.where(lse == -np.inf, np.inf, lse)  # empty rows: p = 0
    with np.errstate(invalid="ignore"):
        return np.exp(s - lse_safe[..., None])


def _attend(p, values, mask):
    """``out[q, h] = sum_k p[h, q, k] values[k, h]`` over the keys each row sees: p (H, Sq, Sk), values
    (Sk, H, D), mask (H|1, Sq, Sk). A key a row does not see never reaches it, even when its value is NaN
    or infinite (a plain product would give ``0 * NaN``); a visible one reaches it even when its weight is 0."""
    finite = np.isfinite(values)
    out = np.einsum("hqk,khd->qhd", p, np.where(finite, values, 0.0))
    keys = np.flatnonzero(~finite.all(axis=(1, 2)))  # the keys holding a non-finite value
    if keys.size:
        bad = np.swapaxes(np.where(finite, 0.0, values)[keys], 0, 1)  # (H, n_keys, D): the non-finite values
        seen = np.broadcast_to(mask, p.shape)[..., keys]  # (H, Sq, n_keys)
        with np.errstate(invalid="ignore"):
            terms = np.where(seen[..., None], p[..., keys, None] * bad[:, None], 0.0)  # (H, Sq, n_keys, D)
        out = out + np.swapaxes(terms.sum(axis=2), 0, 1)
    return out


def _expand_kv(a, group):
    return np.repeat(a, group, axis=1)  # (S, Hkv, D) -> (S, Hq, D), head h uses kv head h // group


def _sequences(q, cu_seqlens_q, cu_seqlens_k, k):
    """Yield (batch index, q slice, k slice) over the sequences of a dense or packed batch."""
    if cu_seqlens_q is None:
        for b in range(q.shape[0]):
            yield b, (b, slice(None)), (b, slice(None))
    else:
        cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
        for b in range(len(cq) - 1):
            yield b, (slice(int(cq[b]), int(cq[b + 1])),), (slice(int(ck[b]), int(ck[b + 1])),)


def _slopes_for(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    a = _f64(alibi_slopes)
    return a if a.ndim == 1 else a[b]


def _dropout_for(dropout_mask, dropout_p, b, sq, sk):
    """Sequence b's dropout factors ``keep / (1 - p_q)`` (H, Sq, Sk), or None without dropout."""
    if dropout_mask is None:
        return None
    return np.asarray(dropout_mask, dtype=bool)[b, :, :sq, :sk] / (1.0 - attention_dropout_rate(dropout_p))


def _mask_for(mask, b):
    """The dense extra mask of sequence b: ``mask`` (B|1, Hq|1, Sq, Sk) (or fewer leading dims) ->
    (Hq|1, Sq, Sk), or None."""
    if mask is None:
        return None
    mask = np.asarray(mask, dtype=bool)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    return mask[min(b, mask.shape[0] - 1)]


def _lse_index(b, sl, varlen):
    # lse is (B, Hq, Sq) dense, (Hq, total_q) packed
    return (slice(None), sl[0]) if varlen else (b, slice(None), slice(None))


def flash_attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), alibi_slopes=None,
                    softcap=0.0, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                    max_seqlen_k=None, mask=None, dropout_mask=None, dropout_p=0.0):
    """out = softmax(mods(softmax_scale * q k^T)) v in float64. Returns ``(out, lse)``.

    Shapes as the public op: out ``(B, Sq, Hq, Dv)`` and lse ``(B, Hq, Sq)``, or packed ``(total_q, Hq, Dv)``
    and ``(Hq, total_q)``. ``max_seqlen_*`` are accepted for signature parity and ignored. ``mask``: bool
    ``(B|1, Hq|1, Sq, Sk)``, query i sees key j only where True (dense inputs; a BlockMask's ``to_dense()``).
    ``dropout_mask``: bool ``(B, Hq, Sq, Sk)`` (max lengths when packed), the kept probabilities
    (:func:`attention_dropout_mask`), scaled by ``1 / (1 - p_q)`` with ``p_q`` the applied rate
    (:func:`attention_dropout_rate`); lse is the undropped softmax's.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    varlen = cu_seqlens_q is not None
    hq, hkv = q.shape[-2], k.shape[-2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    sinks = _f64(sinks)
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.zeros((hq, q.shape[0]) if varlen else (q.shape[0], hq, q.shape[1]))
    for b, qs, ks in _sequences(q, cu_seqlens_q, cu_seqlens_k, k):
        qq, kk, vv = q[qs], _expand_kv(k[ks], group), _expand_kv(v[ks], group)
        s, _, seen = _scores(qq, kk, scale=scale, softcap=softcap, slopes=_slopes_for(alibi_slopes, b),
                             causal=causal, window_size=window_size, extra_mask=_mask_for(mask, b))
        row_lse = _lse(s, sinks)  # (H, Sq)
        p = _probs(s, row_lse)
        z = _dropout_for(dropout_mask, dropout_p, b, qq.shape[0], kk.shape[0])
        out[qs] = _attend(p if z is None else p * z, vv, seen)
        lse[_lse_index(b, qs, varlen)] = row_lse
    return out, lse


def flash_attention_bwd(dout, q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                        alibi_slopes=None, softcap=0.0, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, dlse=None, mask=None, return_dalibi=False,
                        dropout_mask=None, dropout_p=0.0):
    """Gradients of :func:`flash_attention` given ``dout`` (shape of out) and optionally ``dlse`` (shape of
    lse). Returns ``(dq, dk, dv, dsinks)``; dsinks is None without sinks. GQA gradients are summed over each
    group of query heads sharing a kv head. ``return_dalibi``: a fifth result, the gradient of
    ``alibi_slopes`` (their shape).

    With ``delta_i = sum_d dout_i * out_i - dlse_i``: ``ds = p * (dout v^T - delta)`` (times ``1 - tanh^2``
    with softcap), ``dq = scale * ds k``, ``dk = scale * ds^T q``, ``dv = p^T dout``,
    ``dsink = -sum_i exp(sink - lse_i) * delta_i`` and ``dslope_h = -sum_ij p (dout v^T - delta)_ij
    |i + Sk - Sq - j|`` (ALiBi is added after softcap: no tanh factor). Dropout (``dropout_mask`` as in
    :func:`flash_attention`, factors z): ``out = (p z) v``, ``dv = (p z)^T dout``, ``dp = (dout v^T) z``.
    """
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    varlen = cu_seqlens_q is not None
    hq, hkv = q.shape[-2], k.shape[-2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    sinks = _f64(sinks)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = None if sinks is None else np.zeros_like(sinks)
    dalibi = None if alibi_slopes is None else np.zeros_like(_f64(alibi_slopes))
    for b, qs, ks in _sequences(q, cu_seqlens_q, cu_seqlens_k, k):
        qq, kk, vv, do = q[qs], _expand_kv(k[ks], group), _expand_kv(v[ks], group), dout[qs]
        s, t, _ = _scores(qq, kk, scale=scale, softcap=softcap, slopes=_slopes_for(alibi_slopes, b),
                          causal=causal, window_size=window_size, extra_mask=_mask_for(mask, b))
        row_lse = _lse(s, sinks)
        p = _probs(s, row_lse)  # (H, Sq, Sk)
        z = _dropout_for(dropout_mask, dropout_p, b, qq.shape[0], kk.shape[0])
        pz = p if z is None else p * z
        o = np.einsum("hqk,khd->hqd", pz, vv)
        delta = np.einsum("hqd,qhd->hq", o, do)
        if dlse is not None:
            delta = delta - np.where(np.isfinite(row_lse), _f64(dlse)[_lse_index(b, qs, varlen)], 0.0)
        dp = np.einsum("qhd,khd->hqk", do, vv)
        if z is not None:
            dp = dp * z
        ds = p * (dp - delta[..., None])
        if dalibi is not None:
            sq, sk = ds.shape[1], ds.shape[2]
            dist = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :])
            term = -np.einsum("hqk,qk->h", ds, dist)
            if dalibi.ndim == 1:
                dalibi += term
            else:
                dalibi[b] += term
        if t is not None:
            ds = ds * (1.0 - t * t)
        ds = ds * scale
        dq[qs] = np.einsum("hqk,khd->qhd", ds, kk)
        dkk = np.einsum("hqk,qhd->khd", ds, qq)
        dvv = np.einsum("hqk,qhd->khd", pz, do)
        sk = dkk.shape[0]
        dk[ks] = dkk.reshape(sk, hkv, group, dkk.shape[-1]).sum(axis=2)
        dv[ks] = dvv.reshape(sk, hkv, group, dvv.shape[-1]).sum(axis=2)
        if sinks is not None:
            p_sink = np.exp(sinks[:, None] - np.where(np.isfinite(row_lse), row_lse, np.inf))  # (H, Sq)
            dsinks -= np.sum(p_sink * delta, axis=1)
    if return_dalibi:
        return dq, dk, dv, dsinks, dalibi
    return dq, dk, dv, dsinks


def attention_dropout_threshold(dropout_p: float) -> int:
    """The byte threshold t of attention dropout: ``round(256 * p)`` (halves up) of p rounded to float32,
    computed as ``(floor(512 * p) + 1) >> 1`` (exact: a power-of-two scale). A byte (uniform in 0..255) is
    kept when it is >= t, so t / 256 is the rate applied (:func:`attention_dropout_rate`)."""
    return (int(np.float32(dropout_p) * np.float32(512)) + 1) >> 1


def attention_dropout_rate(dropout_p: float) -> float:
    """The dropout rate attention applies for ``dropout_p``: p rounded to the nearest multiple of 1/256
    (``attention_dropout_threshold(p) / 256``); kept probabilities are scaled by ``1 / (1 - rate)``, so the
    expectation is exact. 0.1 -> 26/256 = 0.1015625."""
    return attention_dropout_threshold(dropout_p) / 256.0


def attention_dropout_mask(seed: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
                           dropout_p: float) -> np.ndarray:
    """The keep-mask attention dropout draws, bool ``(batch, heads, seqlen_q, seqlen_k)``: one Philox-4x32-7
    call per 16 elements (:func:`flashbridge.reference.random.philox_bytes`). Element (b, h, i, j) is byte
    ``8 * i3 + 4 * j3 + 2 * i0 + j0`` (x3, x0: bits 3 and 0 of x) of the call with counter ``(i & ~9, j & ~9,
    h, b)`` and key ``seed`` -- a call serves queries i, i+1, i+8, i+9 by keys j, j+1, j+8, j+9 --, kept
    when that byte is >= :func:`attention_dropout_threshold`: the kernels' rule (``dropout_multiplier`` in
    core_kernels/flash_attn/kernels_common.py). The mask depends on no length: packed sequence b takes
    ``[b, :, :len_q, :len_k]``."""
    b, h, i, j = np.ogrid[:batch, :heads, :seqlen_q, :seqlen_k]
    byte = 8 * ((i >> 3) & 1) + 4 * ((j >> 3) & 1) + 2 * (i & 1) + (j & 1)
    draws = philox_bytes(int(seed), i & ~9, j & ~9, h, b)  # (B, H, Sq, Sk, 16)
    keep = np.take_along_axis(draws, np.broadcast_to(byte, draws.shape[:-1])[..., None], axis=-1)[..., 0]
    return keep >= attention_dropout_threshold(dropout_p)
