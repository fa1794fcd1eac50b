"""Non-finite values and invalid metadata on a CUDA GPU (compiled kernels, bf16), both frameworks; skipped
without a GPU.

The compiled kernels take other paths than the interpreter (tensor-core MMAs, ``max.NaN`` reductions, the
f16 query of FP8 decode, jax-triton launches): here NaN and +inf inputs must give exactly the float64
reference's NaN / +inf / -inf elements in ``out`` and ``lse`` (finite elements within bf16 rounding), NaN
partials must survive split-KV and explicit merges, and invalid packed offsets under ``jax.jit`` /
``torch.compile`` must leave no unwritten row.
"""
from __future__ import annotations

import zlib

import functools

import numpy as np
import pytest
import torch

from flashbridge.core_kernels._config import configure
from flashbridge.core_kernels._poison import poison_buffers
from flashbridge.core_kernels.flash_attn.plan import AttentionConfig
from flashbridge.reference import attention as ref_attn
from flashbridge.reference import decode as ref_dec
import flashbridge.torch_api as ft
from helpers import assert_same_values

pytestmark = pytest.mark.gpu
NAN, INF = float("nan"), float("inf")


def _jax():
    jax = pytest.importorskip("jax")
    try:
        if not jax.devices("gpu"):
            pytest.skip("JAX has no GPU backend")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    import flashbridge.jax_api as fj
    return jax, fj


# bf16 outputs: finite values within 3e-2
assert_same_values = functools.partial(assert_same_values, tol=3e-2)


def _bf16(a):
    """NumPy float32 -> the same values rounded to bf16 (as float32), so the reference sees the kernel's input."""
    return torch.from_numpy(a).to(torch.bfloat16).float().numpy()


def _call(framework, fn, *arrays, **kw):
    """``fn`` of a front-end on CUDA arrays made from NumPy inputs: positional float arrays in bf16, keyword
    arrays as they are (lengths, tables, slopes, sinks, lses); float64 NumPy results."""
    if framework == "torch":
        def conv(a, low):
            if not isinstance(a, np.ndarray):
                return a
            t = torch.from_numpy(a).cuda()
            return t.bfloat16() if low and t.is_floating_point() else t
        res = getattr(ft, fn)(*(conv(a, True) for a in arrays), **{n: conv(a, False) for n, a in kw.items()})
        return tuple(r.double().cpu().numpy() for r in res)
    jax, fj = _jax()
    import jax.numpy as jnp

    def jconv(a, low):
        if not isinstance(a, np.ndarray):
            return a
        x = jnp.asarray(a)
        return x.astype(jnp.bfloat16) if low and np.issubdtype(a.dtype, np.floating) else x
    res = getattr(fj, fn)(*(jconv(a, True) for a in arrays), **{n: jconv(a, False) for n, a in kw.items()})
    return tuple(np.asarray(jnp.asarray(r, jnp.float32), np.float64) for r in res)


# ---------------------------------------------------------------------------------------- attention

ATTN_CASES = {
    "q_nan": lambda q, k, v, kw: q.__setitem__((0, 300, 3, 5), NAN),
    "k_nan": lambda q, k, v, kw: k.__setitem__((1, 200, 1, 7), NAN),
    "v_nan_seen_by_every_row": lambda q, k, v, kw: v.__setitem__((0, 0, 2, 9), NAN),
    "alibi_slope_nan": lambda q, k, v, kw: kw.update(alibi_slopes=np.r_[np.full(7, 0.1), NAN].astype(np.float32)),
    "sink_nan": lambda q, k, v, kw: kw.update(sinks=np.r_[NAN, np.zeros(7)].astype(np.float32)),
    "sink_pos_inf": lambda q, k, v, kw: kw.update(sinks=np.r_[np.zeros(5), INF, 0, 0].astype(np.float32)),
    "sink_neg_inf": lambda q, k, v, kw: kw.update(sinks=np.r_[np.zeros(5), -INF, 0, 0].astype(np.float32)),
    "q_pos_inf": lambda q, k, v, kw: q.__setitem__((1, 17, 6, 0), INF),
    "q_pos_inf_and_k_nan": lambda q, k, v, kw: (q.__setitem__((1, 400, 6, 0), INF),
                                                 k.__setitem__((1, 30, 3, 2), NAN)),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", sorted(ATTN_CASES))
def test_gpu_attention_nonfinite_follows_reference(framework, head_dim, causal, case):
    rng = np.random.default_rng(zlib.crc32(f"{case}{head_dim}".encode()))
    b, s, hq, hkv = 2, 777, 8, 4
    q = _bf16(rng.standard_normal((b, s, hq, head_dim)).astype(np.float32))
    k, v = (_bf16(rng.standard_normal((b, s, hkv, head_dim)).astype(np.float32)) for _ in range(2))
    kw = {}
    ATTN_CASES[case](q, k, v, kw)
    out, lse = _call(framework, "flash_attention", q, k, v, causal=causal, return_lse=True, **kw)
    want_out, want_lse = ref_attn.flash_attention(q, k, v, causal=causal, **kw)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_gpu_packed_nan_sequence_does_not_contaminate(framework):
    rng = np.random.default_rng(1)
    cu = np.array([0, 300, 517, 1000], np.int32)
    q, k, v = (_bf16(rng.standard_normal((1000, 8, 128)).astype(np.float32)) for _ in range(3))
    for a in (q, k, v):
        a[300:517] = NAN
    out, lse = _call(framework, "flash_attention", q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                     max_seqlen_q=483, max_seqlen_k=483, return_lse=True)
    want_out, want_lse = ref_attn.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert_same_values(out, want_out, "out")
    assert_same_values(lse, want_lse, "lse")


def _uncovered(cu, max_len, total):
    covered = np.zeros(total, bool)
    for i in range(len(cu) - 1):
        start = min(max(int(cu[i]), 0), total)
        end = min(max(int(cu[i + 1]), start), total)
        covered[start:start + min(end - start, max_len)] = True
    return ~covered


@pytest.mark.parametrize("cu", [[0, 300, 100, 1000], [0, 300, 600, 900], [0, 200, 1000, 1000]])
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_jax_invalid_offsets_write_every_row(cu, fused):
    """Under jit the offsets are not checked: rows no sequence covers come back NaN in out, lse, dq, dk, dv
    (buffers start at 7 here, so an unwritten element would show), the others finite."""
    jax, fj = _jax()
    import jax.numpy as jnp
    rng = np.random.default_rng(2)
    max_len, total = 256, 1000
    q, k, v, dout = (jnp.asarray(rng.standard_normal((total, 8, 128)), jnp.bfloat16) for _ in range(4))
    cu = jnp.asarray(np.array(cu, np.int32))
    lost = _uncovered(np.asarray(cu), max_len, total)

    def loss(q, k, v, cu):
        out, lse = fj.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                      max_seqlen_k=max_len, return_lse=True)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), (out, lse)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    with configure(AttentionConfig(fused_backward=fused)), poison_buffers(7.0):
        (_, (out, lse)), grads = step(q, k, v, cu)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.isnan(out[lost]).all() and np.isnan(lse[:, lost]).all()
    assert np.isfinite(out[~lost]).all() and np.isfinite(lse[:, ~lost]).all()
    for name, g in zip(("dq", "dk", "dv"), grads):
        g = np.asarray(g, np.float32)
        assert np.isnan(g[lost]).all() and np.isfinite(g[~lost]).all(), name


def test_gpu_torch_compile_invalid_offsets_write_every_row():
    rng = np.random.default_rng(3)
    max_len, total = 256, 1000
    q, k, v = (torch.from_numpy(rng.standard_normal((total, 8, 128)).astype(np.float32)).cuda().bfloat16()
               for _ in range(3))
    cu = torch.tensor([0, 300, 100, 1000], dtype=torch.int32, device="cuda")
    lost = torch.from_numpy(_uncovered(cu.cpu().numpy(), max_len, total)).cuda()
    f = torch.compile(lambda q, k, v, cu: ft.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                             max_seqlen_q=max_len, max_seqlen_k=max_len,
                                                             return_lse=True), fullgraph=True)
    with poison_buffers(7.0):
        out, lse = f(q, k, v, cu)
    assert out[lost].isnan().all() and lse[:, lost].isnan().all()
    assert out[~lost].isfinite().all() and lse[:, ~lost].isfinite().all()


# ------------------------------------------------------------------------------------------- decode

DECODE_CASES = {
    "q_nan": lambda q, k, v, kw: q.__setitem__((3, 0, 17, 4), NAN),
    "k_nan_visible": lambda q, k, v, kw: k.__setitem__((3, 1000, 5, 3), NAN),
    "v_nan": lambda q, k, v, kw: v.__setitem__((2, 0, 0, 100), NAN),
    "sink_nan": lambda q, k, v, kw: kw.update(sinks=np.r_[np.zeros(9), NAN, np.zeros(22)].astype(np.float32)),
    "sink_pos_inf": lambda q, k, v, kw: kw.update(sinks=np.r_[INF, np.zeros(31)].astype(np.float32)),
    "q_pos_inf": lambda q, k, v, kw: q.__setitem__((0, 0, 30, 7), INF),
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_gpu_decode_nonfinite_follows_reference(framework, num_splits, case):
    """Paged bf16 cache (Hq=32, Hkv=8, D=128, pages of 64), NaN in every cache row past each length."""
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    b, hq, hkv, d, page, cap = 4, 32, 8, 128, 64, 2048
    lengths = np.array([1, 700, 2048, 1500], np.int32)
    q = _bf16(rng.standard_normal((b, 1, hq, d)).astype(np.float32))
    k, v = (_bf16(rng.standard_normal((b, cap, hkv, d)).astype(np.float32)) for _ in range(2))
    for a in (k, v):
        for i, n in enumerate(lengths):
            a[i, n:] = NAN
    kw = {}
    DECODE_CASES[case](q, k, v, kw)
    n_per = cap // page
    table = rng.permutation(b * n_per).reshape(b, n_per).astype(np.int32)
    kp, vp = (np.empty((b * n_per, page, hkv, d), np.float32) for _ in range(2))
    for i in range(b):
        for j in range(n_per):
            kp[table[i, j]], vp[table[i, j]] = k[i, j * page:(j + 1) * page], v[i, j * page:(j + 1) * page]
    out, lse = _call(framework, "decode_attention", q, kp, vp, cache_seqlens=lengths, block_table=table,
                     num_splits=num_splits, return_lse=True, **kw)
    want_out, want_lse = ref_dec.decode_attention(q, k, v, cache_seqlens=lengths, **kw)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")


def test_gpu_fp8_decode_inf_query_head_leaves_other_heads_exact():
    """bf16 queries against an FP8 cache run the score product in f16 after scaling q by a power of two
    chosen from the tile's largest |q|: a +inf in one head must not scale the other heads' queries to 0."""
    rng = np.random.default_rng(4)
    b, hq, hkv, d, cap = 2, 32, 8, 128, 512
    lengths = np.array([300, 512], np.int32)
    q = _bf16(rng.standard_normal((b, 1, hq, d)).astype(np.float32))
    q[1, 0, 3, 0] = INF  # head 3 shares its kv head (and its row block) with heads 0..3
    kf, vf = (rng.standard_normal((b, cap, hkv, d)).astype(np.float32) for _ in range(2))
    scale = torch.tensor([0.02], dtype=torch.float32)
    k8, v8 = ((torch.from_numpy(a) / scale).clamp(-448, 448).to(torch.float8_e4m3fn) for a in (kf, vf))
    out, lse = ft.decode_attention(torch.from_numpy(q).cuda().bfloat16(), k8.cuda(), v8.cuda(),
                                   cache_seqlens=torch.from_numpy(lengths).cuda(), k_scale=scale.cuda(),
                                   v_scale=scale.cuda(), return_lse=True)
    want_out, want_lse = ref_dec.decode_attention(q, k8.float().numpy(), v8.float().numpy(), cache_seqlens=lengths,
                                                  k_scale=scale.numpy(), v_scale=scale.numpy())
    assert_same_values(lse.double().cpu().numpy(), want_lse, "lse")
    assert_same_values(out.double().cpu().numpy(), want_out, "out")


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_gpu_merge_never_drops_a_nan_partial(framework):
    rng = np.random.default_rng(5)
    outs = _bf16(rng.standard_normal((5, 64, 32, 128)).astype(np.float32))
    lses = rng.standard_normal((5, 64, 32)).astype(np.float32)
    outs[1, 0, 0, 2] = NAN
    lses[2, 1, 1] = NAN
    lses[0, 2, 2], outs[0, 2, 2] = INF, NAN
    lses[:, 3, 3], outs[:, 3, 3] = -INF, NAN
    lses[1, 4, 0], outs[1, 4, 0, 0] = -200.0, NAN
    out, lse = _call(framework, "merge_attention_states", outs, lses=lses)
    want_out, want_lse = ref_dec.merge_attention_states(outs, lses)
    assert_same_values(lse, want_lse, "lse")
    assert_same_values(out, want_out, "out")
