"""Edge inputs of the decode family, both frameworks, CPU (Triton's interpreter).

* decode_attention (contiguous and paged, one and several KV splits): non-finite values follow IEEE arithmetic
  exactly as the float64 reference does; cache rows past ``cache_seqlens`` (NaN-filled in every case here)
  and unused pages never reach a row.
* merge_attention_states / cascade_attention: a NaN partial is never dropped as "saw nothing".
* Out-of-range ``cache_seqlens`` and page ids under ``jax.jit`` / ``torch.compile`` (not checked on the host):
  the kernels clamp them, so decode returns the clamped reference and append writes only inside the cache.
"""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from flashbridge.core_kernels._poison import poison_buffers
from flashbridge.reference import decode as ref
import flashbridge.jax_api as fj
import flashbridge.torch_api as ft
from helpers import assert_same_values

NAN, INF = float("nan"), float("inf")
B, SQ, HQ, HKV, D, CAP, PAGE = 2, 2, 4, 2, 16, 96, 16
LENGTHS = np.array([50, 90], np.int32)




def _call(framework, fn_name, *arrays, **kw):
    """Call ``fn_name`` of a front-end with NumPy inputs; results as float64 NumPy arrays."""
    if framework == "torch":
        conv = lambda a: torch.from_numpy(a) if isinstance(a, np.ndarray) else a  # noqa: E731
        res = getattr(ft, fn_name)(*map(conv, arrays), **{n: conv(a) for n, a in kw.items()})
        return tuple(r.double().numpy() for r in res)
    conv = lambda a: jnp.asarray(a) if isinstance(a, np.ndarray) else a  # noqa: E731
    res = getattr(fj, fn_name)(*map(conv, arrays), **{n: conv(a) for n, a in kw.items()})
    return tuple(np.asarray(r, np.float64) for r in res)


def _cache(rng):
    """q, contiguous caches (rows past LENGTHS NaN), and their paged copies (shuffled pages, unused ones NaN)."""
    q = rng.standard_normal((B, SQ, HQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, CAP, HKV, D)).astype(np.float32) for _ in range(2))
    for a in (k, v):
        for b, n in enumerate(LENGTHS):
            a[b, n:] = NAN
    return q, k, v


def _paged(k, v, rng):
    n_per = CAP // PAGE
    num_pages = B * n_per + 3
    perm = rng.permutation(num_pages)[:B * n_per].reshape(B, n_per).astype(np.int32)
    kp, vp = (np.full((num_pages, PAGE, HKV, D), NAN, np.float32) for _ in range(2))
    for b in range(B):
        for j in range(n_per):
            kp[perm[b, j]] = k[b, j * PAGE:(j + 1) * PAGE]
            vp[perm[b, j]] = v[b, j * PAGE:(j + 1) * PAGE]
    return kp, vp, perm


CASES = {
    "none": lambda q, k, v, kw: None,
    "q_nan": lambda q, k, v, kw: q.__setitem__((1, 0, 2, 3), NAN),
    "k_nan_visible": lambda q, k, v, kw: k.__setitem__((1, 10, 1, 3), NAN),
    "v_nan_seen_by_every_row": lambda q, k, v, kw: v.__setitem__((0, 0, 0, 5), NAN),
    "alibi_slope_nan": lambda q, k, v, kw: kw.update(alibi_slopes=np.array([0.2, NAN, 0.3, 0.1], np.float32)),
    "sink_nan": lambda q, k, v, kw: kw.update(sinks=np.array([0.5, NAN, 0.0, 1.0], np.float32)),
    "sink_pos_inf": lambda q, k, v, kw: kw.update(sinks=np.array([INF, 0.5, 0.0, 1.0], np.float32)),
    "q_pos_inf": lambda q, k, v, kw: q.__setitem__((1, 1, 3, 0), INF),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("layout", ["contiguous-1split", "paged-3splits"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.thin(12)
def test_decode_nonfinite_values_follow_the_reference(framework, layout, case):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    q, k, v = _cache(rng)
    kw = {}
    CASES[case](q, k, v, kw)
    want_out, want_lse = ref.decode_attention(q, k, v, cache_seqlens=LENGTHS, **kw)
    if layout.startswith("paged"):
        kp, vp, table = _paged(k, v, rng)
        out, lse = _call(framework, "decode_attention", q, kp, vp, cache_seqlens=LENGTHS, block_table=table,
                         num_splits=3, return_lse=True, **kw)
    else:
        out, lse = _call(framework, "decode_attention", q, k, v, cache_seqlens=LENGTHS, num_splits=1,
                         return_lse=True, **kw)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")
    if case == "none":  # NaN rows past each length and in unused pages never reached a row
        assert np.isfinite(out).all()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_merge_never_drops_a_nan_partial(framework):
    rng = np.random.default_rng(11)
    outs = rng.standard_normal((3, 6, 4, 16)).astype(np.float32)
    lses = rng.standard_normal((3, 6, 4)).astype(np.float32)
    outs[1, 0, 0, 2] = NAN  # a NaN output with an ordinary weight
    lses[2, 1, 1] = NAN  # a NaN lse
    lses[0, 2, 2], outs[0, 2, 2] = INF, NAN  # a +inf lse (its out NaN, as the kernels give)
    lses[:, 3, 3], outs[:, 3, 3] = -INF, NAN  # every state empty: their outs are ignored
    lses[1, 4, 0], outs[1, 4, 0, 0] = -200.0, NAN  # a weight that underflows float32: still counts
    lses[2, 5, 1], outs[2, 5, 1] = -INF, NAN  # one empty state among others: ignored
    out, lse = _call(framework, "merge_attention_states", outs, lses)
    want_out, want_lse = ref.merge_attention_states(outs, lses)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")
    assert np.isnan(out[4, 0, 0]) and np.isfinite(lse[4, 0]) and np.isnan(lse[1, 1])
    assert (out[3, 3] == 0).all() and lse[3, 3] == -INF and np.isfinite(out[5, 1]).all()


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("where", ["shared_v", "own_k", "none"])
def test_cascade_propagates_nan(framework, where):
    rng = np.random.default_rng(12)
    q, k, v = _cache(rng)  # own caches NaN past LENGTHS
    shared_k, shared_v = (rng.standard_normal((40, HKV, D)).astype(np.float32) for _ in range(2))
    if where == "shared_v":
        shared_v[7, 1, 3] = NAN  # every query sees the whole prefix
    elif where == "own_k":
        k[0, 3, 0, 1] = NAN
    out, lse = _call(framework, "cascade_attention", q, shared_k, shared_v, k, v, cache_seqlens=LENGTHS,
                     num_splits=2, return_lse=True)
    want_out, want_lse = ref.cascade_attention(q, shared_k, shared_v, k, v, cache_seqlens=LENGTHS)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")
    assert np.isnan(out).any() == (where != "none")


# ------------------------------------------------------------- out-of-range metadata under jit / compile

BAD_LENGTHS = np.array([-3, 500], np.int32)  # clamped to [0, capacity]


def _bad_table(table):
    bad = table.copy()
    bad[0, 0], bad[1, 2] = -5, 99  # clamped to [0, num_pages)
    return bad


def _decode_jitted(framework, q, k, v, lengths, table):
    if framework == "jax":
        f = jax.jit(lambda q, k, v, n, t: fj.decode_attention(q, k, v, cache_seqlens=n, block_table=t, num_splits=2,
                                                               return_lse=True))
        out, lse = f(*(jnp.asarray(a) for a in (q, k, v, lengths, table)))
        return np.asarray(out, np.float64), np.asarray(lse, np.float64)
    f = torch.compile(lambda q, k, v, n, t: ft.decode_attention(q, k, v, cache_seqlens=n, block_table=t,
                                                                  num_splits=2, return_lse=True),
                      fullgraph=True, backend="aot_eager")
    out, lse = f(*(torch.from_numpy(a) for a in (q, k, v, lengths, table)))
    return out.double().numpy(), lse.double().numpy()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_out_of_range_lengths_and_pages_are_clamped_under_jit(framework):
    rng = np.random.default_rng(13)
    q, k, v = _cache(rng)
    k[np.isnan(k)], v[np.isnan(v)] = 0.5, -0.25  # finite everywhere: the clamped lengths read these rows
    kp, vp, table = _paged(k, v, rng)
    kp[np.isnan(kp)], vp[np.isnan(vp)] = 1.0, 2.0
    bad = _bad_table(table)
    with poison_buffers(7.0):  # unwritten elements would read 7
        out, lse = _decode_jitted(framework, q, kp, vp, BAD_LENGTHS, bad)
        again = _decode_jitted(framework, q, kp, vp, BAD_LENGTHS, bad)
    num_pages = kp.shape[0]
    lengths = np.clip(BAD_LENGTHS, 0, CAP)
    want_out, want_lse = ref.decode_attention(q, kp, vp, cache_seqlens=lengths,
                                              block_table=np.clip(bad, 0, num_pages - 1))
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")
    assert (out[0] == 0).all() and (lse[0] == -INF).all()  # length 0: nothing seen
    np.testing.assert_array_equal(out, again[0])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_append_with_out_of_range_lengths_writes_only_inside_the_cache(framework):
    rng = np.random.default_rng(14)
    n_new = 3
    lengths = np.array([-2, CAP - 1], np.int32)  # clamped start 0; only the first new token of sequence 1 fits
    k, v = (rng.standard_normal((B, CAP, HKV, D)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((B, n_new, HKV, D)).astype(np.float32) for _ in range(2))
    if framework == "jax":
        f = jax.jit(lambda *a: fj.append_kv_cache(*a[:4], cache_seqlens=a[4]))
        got_k, got_v = (np.asarray(x) for x in f(*(jnp.asarray(a) for a in (k, v, k_new, v_new, lengths))))
    else:
        tk, tv = torch.from_numpy(k.copy()), torch.from_numpy(v.copy())
        f = torch.compile(lambda *a: ft.append_kv_cache(*a[:4], cache_seqlens=a[4]), fullgraph=True,
                          backend="aot_eager")
        f(tk, tv, *(torch.from_numpy(a) for a in (k_new, v_new, lengths)))
        got_k, got_v = tk.numpy(), tv.numpy()
    for got, cache, new in ((got_k, k, k_new), (got_v, v, v_new)):
        want = cache.copy()
        want[0, :n_new] = new[0]
        want[1, CAP - 1] = new[1, 0]
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_nan_rows_have_nan_lse(framework, num_splits):
    """MLA decode runs the same online softmax: NaN in one head's query or in a visible latent row gives NaN
    out and lse (the reference's), latent rows past the lengths (NaN) reach nothing."""
    from flashbridge.reference import mla as ref_mla

    rng = np.random.default_rng(15)
    q = rng.standard_normal((B, 1, 4, 80)).astype(np.float32)
    kv = rng.standard_normal((B, CAP, 80)).astype(np.float32)
    for b, n in enumerate(LENGTHS):
        kv[b, n:] = NAN
    q[0, 0, 2, 7] = NAN
    kv[1, 33, 70] = NAN  # a rope column of a visible row: every head of sequence 1
    out, lse = _call(framework, "mla_decode", q, kv, cache_seqlens=LENGTHS, head_dim_v=64, num_splits=num_splits,
                     return_lse=True)
    want_out, want_lse = ref_mla.mla_decode(q, kv, cache_seqlens=LENGTHS, head_dim_v=64)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")
    assert np.isnan(lse[1]).all() and np.isnan(lse[0, 2]).all() and np.isfinite(lse[0, :2]).all()
