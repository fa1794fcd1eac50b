"""MLA (DeepSeek latent attention) on the CPU (Triton interpreter): reference, torch and JAX front-ends.

Kernel results are compared with the float64 reference (flashbridge.reference.mla) under the flash-attn rule:
error <= 2 x the error of a naive implementation in the same dtype + a small floor. Latent dims are small
(``Dqk = Dv + rope`` like 40 = 32 + 8, one 576 = 512 + 64 case with tiny S and H to run the tuned shapes),
lengths odd (17, 63), top-k small, sparse indices padded with -1.
"""
from __future__ import annotations

import numpy as np
import pytest

from flashbridge.reference import mla as ref


def _rng(seed):
    return np.random.default_rng(seed)


def _sparse_indices(rng, batch, sq, sk, topk, *, causal=False, pad=0.25):
    """(B, Sq, topk) int32: distinct key positions per query (visible ones when causal), some entries -1
    (padding) and some past the sequence (skipped), in random order."""
    idx = np.full((batch, sq, topk), -1, dtype=np.int32)
    for b in range(batch):
        for i in range(sq):
            limit = i + sk - sq + 1 if causal else sk
            limit = max(limit, 0)
            n = min(topk, limit)
            chosen = rng.permutation(limit)[:n] if limit else np.zeros(0, dtype=np.int64)
            row = np.full(topk, -1, dtype=np.int64)
            row[:n] = chosen
            drop = rng.random(topk) < pad
            row[drop] = -1
            if topk > 2:
                row[-1] = sk + 3  # out of range: skipped
            idx[b, i] = rng.permutation(row)
    return idx


# ------------------------------------------------------------------------------------------- reference

def test_reference_absorbed_equals_unabsorbed():
    rng = _rng(0)
    b, sq, sk, h, dn, dr, r, dv = 2, 5, 9, 3, 6, 4, 8, 5
    q_nope, q_rope = rng.standard_normal((b, sq, h, dn)), rng.standard_normal((b, sq, h, dr))
    c_kv, k_rope = rng.standard_normal((b, sk, r)), rng.standard_normal((b, sk, dr))
    w_uk, w_uv = rng.standard_normal((h, dn, r)), rng.standard_normal((h, dv, r))
    scale = 1.0 / np.sqrt(dn + dr)
    for causal, indices in ((False, None), (True, None), (False, _sparse_indices(rng, b, sq, sk, 4))):
        want, want_lse = ref.mla_unabsorbed(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, causal=causal,
                                            softmax_scale=scale, indices=indices)
        out, lse = ref.mla_attention(ref.absorb_query(q_nope, q_rope, w_uk), ref.latent_cache(c_kv, k_rope),
                                     head_dim_v=r, causal=causal, softmax_scale=scale, indices=indices)
        np.testing.assert_allclose(ref.unabsorb_output(out, w_uv), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_reference_indices_semantics():
    """Indices listing every visible key give the dense (or causal) result; -1 and out-of-range entries are
    skipped; a query whose list is empty outputs 0 with lse -inf."""
    rng = _rng(1)
    b, sq, sk, h, d, dv = 2, 4, 7, 3, 12, 8
    q, kv = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, d))
    every = np.broadcast_to(np.arange(sk, dtype=np.int32), (b, sq, sk)).copy()
    for causal in (False, True):
        dense = ref.mla_attention(q, kv, head_dim_v=dv, causal=causal)
        padded = np.concatenate([every[..., ::-1], np.full((b, sq, 3), -1, np.int32), every[..., :2] + sk], -1)
        sparse = ref.mla_attention(q, kv, head_dim_v=dv, causal=causal, indices=padded)
        for x, y in zip(dense, sparse):
            np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-13)
    empty = np.full((b, sq, 4), -1, np.int32)
    out, lse = ref.mla_attention(q, kv, head_dim_v=dv, indices=empty)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_reference_backward_matches_finite_differences():
    rng = _rng(2)
    b, sq, sk, h, d, dv = 1, 3, 5, 2, 6, 4
    q, kv = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, d))
    dout, dlse = rng.standard_normal((b, sq, h, dv)), rng.standard_normal((b, h, sq))
    indices = _sparse_indices(rng, b, sq, sk, 3, causal=True, pad=0.0)
    for kw in (dict(causal=True), dict(indices=indices, causal=True), dict()):
        def loss(q_, kv_):
            out, lse = ref.mla_attention(q_, kv_, head_dim_v=dv, softmax_scale=0.7, **kw)
            return np.sum(out * dout) + np.sum(np.where(np.isfinite(lse), lse, 0.0) * dlse)

        dq, dkv = ref.mla_attention_bwd(dout, q, kv, head_dim_v=dv, softmax_scale=0.7, dlse=dlse, **kw)
        eps = 1e-6
        for x, grad in ((q, dq), (kv, dkv)):
            num = np.zeros_like(x)
            for pos in np.ndindex(x.shape):
                xp, xm = x.copy(), x.copy()
                xp[pos] += eps
                xm[pos] -= eps
                args_p = (xp, kv) if x is q else (q, xp)
                args_m = (xm, kv) if x is q else (q, xm)
                num[pos] = (loss(*args_p) - loss(*args_m)) / (2 * eps)
            np.testing.assert_allclose(grad, num, rtol=1e-6, atol=1e-7)


def test_reference_decode_paged_equals_contiguous_and_prefill():
    """Decode over a paged cache (shuffled pages) equals decode over the contiguous cache, and decode with
    full lengths equals the causal prefill form."""
    rng = _rng(3)
    b, sq, h, d, dv, page = 2, 3, 4, 10, 8, 4
    lens = [7, 13]
    s_max = 16
    q = rng.standard_normal((b, sq, h, d))
    kv = rng.standard_normal((b, s_max, d))
    pool = rng.standard_normal((b * s_max // page + 2, page, d))
    perm = rng.permutation(pool.shape[0])
    table = np.full((b, s_max // page), -1, np.int32)
    for i in range(b):
        for j in range(-(-lens[i] // page)):
            table[i, j] = perm[i * (s_max // page) + j]
            rows = kv[i, j * page:(j + 1) * page]
            pool[table[i, j], :rows.shape[0]] = rows
    indices = _sparse_indices(rng, b, sq, s_max, 5)
    for kw in (dict(), dict(indices=indices)):
        a = ref.mla_decode(q, kv, cache_seqlens=lens, head_dim_v=dv, **kw)
        p = ref.mla_decode(q, pool, cache_seqlens=lens, block_table=table, head_dim_v=dv, **kw)
        for x, y in zip(a, p):
            np.testing.assert_array_equal(x, y)
    full = ref.mla_decode(q, kv, cache_seqlens=[s_max, s_max], head_dim_v=dv)
    prefill = ref.mla_attention(q, kv, head_dim_v=dv, causal=True)
    for x, y in zip(full, prefill):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-13)
