"""Flash-Decoding family on the CPU (Triton interpreter): reference, torch and JAX front-ends.

Every kernel result is compared with the float64 reference (flashbridge.reference.decode: a dense softmax
over the gathered cache) under the flash-attn rule: error <= 2 x the error of a naive implementation in the
same dtype + a small floor. Caches are small (the interpreter pays per program and per operation) but
ragged (lengths 0 and 1 always present), paged caches use shuffled page tables padded with -1.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from flashbridge.core_kernels._loader import _InterpretedKernel
from flashbridge.core_kernels.decode.kernels import f16_query
from flashbridge.reference import decode as ref
from helpers import (assert_close, assert_same_ptx, assert_wgmma_pipelined, naive_torch, np64, run_generation_loops,
                     torch_to_jax, vector_loads)
from helpers import make_decode_case as make_case

tapi = pytest.importorskip("flashbridge.torch_api.decode")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8_e4m3fn": torch.float8_e4m3fn}


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


# ------------------------------------------------------------------------------------------ case helpers

def to_np(kw):
    return {n: (v.view(torch.uint8).numpy().view(_ml_fp8()) if isinstance(v, torch.Tensor) and
                v.dtype == torch.float8_e4m3fn else v.numpy() if isinstance(v, torch.Tensor) else v)
            for n, v in kw.items()}


def _ml_fp8():
    import ml_dtypes
    return ml_dtypes.float8_e4m3fn


def cache_np(t):
    """A torch cache -> numpy (float8 through ml_dtypes, others float64-exact widening)."""
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(_ml_fp8())
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def reference(q, k, v, kw, options, *, kv_layout="NHD"):
    return ref.decode_attention(np64(q), cache_np(k), cache_np(v), kv_layout=kv_layout, **to_np(kw), **options)


def naive(q, k, v, kw, options, *, kv_layout="NHD"):
    """Decode computed plainly in q's dtype: the cache gathered and dequantised (float64 -> q's dtype), then
    helpers.naive_torch per sequence."""
    npkw = to_np(kw)
    outs, lses = [], []
    for i, length in enumerate(npkw["cache_seqlens"].tolist()):
        kk, vv = (torch.from_numpy(ref.gather_cache(cache_np(c), length, i, block_table=npkw.get("block_table"),
                                                    kv_layout=kv_layout, scale=npkw.get(sn))).to(q.dtype)
                  for c, sn in ((k, "k_scale"), (v, "v_scale")))
        extra = {}
        if "alibi_slopes" in kw:
            a = kw["alibi_slopes"]
            extra["alibi_slopes"] = a if a.dim() == 1 else a[i]
        if "sinks" in kw:
            extra["sinks"] = kw["sinks"]
        o, l_ = naive_torch(q[i:i + 1], kk[None], vv[None], **extra, **options)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs), torch.cat(lses)


def check_decode(q, k, v, kw, options, *, kv_layout="NHD", num_splits=None, floor=1e-5, api=None):
    out, lse = (api or tapi).decode_attention(q, k, v, kv_layout=kv_layout, num_splits=num_splits, **kw,
                                              **options, return_lse=True)
    ro, rl = reference(q, k, v, kw, options, kv_layout=kv_layout)
    n_out, n_lse = naive(q, k, v, kw, options, kv_layout=kv_layout)
    assert tuple(out.shape) == ro.shape and tuple(lse.shape) == rl.shape
    assert_close(out, ro, n_out, name="out", floor=floor)
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(np64(lse)), finite), "lse: -inf pattern differs from the reference"
    assert_close(np.where(finite, np64(lse), 0.0), np.where(finite, rl, 0.0), np.where(finite, np64(n_lse), 0.0),
                 name="lse", floor=floor)
    lens = kw["cache_seqlens"].tolist()
    for i, length in enumerate(lens):
        if length == 0:  # an empty sequence: out exactly 0, lse -inf (the sink's logit with sinks)
            assert np.all(np64(out)[i] == 0.0)
            if "sinks" not in kw:
                assert np.all(np.isneginf(np64(lse)[i]))
    return out, lse


# ----------------------------------------------------------------------------------------------- reference

def test_reference_paged_gather_equals_contiguous():
    # the same logical cache, contiguous NHD vs paged HND with a shuffled table: identical reference results
    args = dict(lens=(5, 0, 33), hq=4, hkv=2, dqk=8, sq=3, s_max=40)
    q, k, v, kw = make_case(1, **args)
    _, kp, vp, kwp = make_case(1, **args, page_size=16, layout="HND")
    options = dict(causal=True, softcap=1.5)
    a = reference(q, k, v, kw, options)
    # paged pools are filled from the same generator draws only for the logical part: compare gathered rows
    for i, length in enumerate(args["lens"]):
        g1 = ref.gather_cache(cache_np(k), length, i)
        g2 = ref.gather_cache(cache_np(kp), length, i, block_table=kwp["block_table"].numpy(), kv_layout="HND")
        np.testing.assert_array_equal(g1, g2)
    b = reference(q, kp, vp, kwp, options, kv_layout="HND")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_reference_merge_is_exact_and_cascade_is_decode_over_concatenation():
    rng = np.random.default_rng(0)
    b, sq, hq, hkv, d = 2, 3, 4, 2, 8
    q = rng.standard_normal((b, sq, hq, d))
    shared = rng.standard_normal((2, 11, hkv, d))
    own = rng.standard_normal((2, b, 20, hkv, d))
    lens = np.array([7, 20], np.int32)
    sinks = rng.standard_normal(hq)
    full = np.concatenate([np.broadcast_to(shared[:, None], (2, b, 11, hkv, d)), own], axis=2)  # (2, B, 31, ..)
    o_full, l_full = ref.decode_attention(q, full[0], full[1], cache_seqlens=lens + 11, causal=True, softcap=3.0,
                                          sinks=sinks)
    o_c, l_c = ref.cascade_attention(q, shared[0], shared[1], own[0], own[1], cache_seqlens=lens, causal=True,
                                     softcap=3.0, sinks=sinks)
    np.testing.assert_allclose(o_c, o_full, atol=1e-13)
    np.testing.assert_allclose(l_c, l_full, atol=1e-13)
    # merge of two disjoint key sets = attention over their union (no sinks, non-causal)
    o1, l1 = ref.decode_attention(q, shared[0][None].repeat(b, 0), shared[1][None].repeat(b, 0),
                                  cache_seqlens=np.full(b, 11, np.int32), causal=False)
    o2, l2 = ref.decode_attention(q, own[0], own[1], cache_seqlens=lens, causal=False)
    o12, l12 = ref.decode_attention(q, full[0], full[1], cache_seqlens=lens + 11, causal=False)
    om, lm = ref.merge_attention_states(np.stack([o1, o2]), np.stack([l1, l2]).transpose(0, 1, 3, 2))
    np.testing.assert_allclose(om, o12, atol=1e-13)
    np.testing.assert_allclose(lm.transpose(0, 2, 1), l12, atol=1e-13)
    # all-empty rows
    om, lm = ref.merge_attention_states(np.ones((2, 3, 4)), np.full((2, 3), -np.inf))
    assert np.all(om == 0) and np.all(np.isneginf(lm))


# ------------------------------------------------------------------------------------- torch: accuracy

CASES = {
    # layouts, paging, ragged lengths (0 and 1 in every case), Sq 1 / 3 / 8, GQA 1 / 4 / 8 and MQA
    "nhd-contig-mha-sq1": (dict(hq=2, hkv=2, lens=(0, 1, 77, 130)), dict(causal=True), 1),
    "hnd-contig-gqa4-sq3": (dict(sq=3, hq=8, hkv=2, lens=(1, 0, 70), layout="HND"), dict(causal=True), None),
    "nhd-paged16-gqa8-sq8": (dict(sq=8, hq=16, hkv=2, lens=(100, 1, 0, 9), page_size=16), dict(causal=True), 2),
    "hnd-paged64-mqa-d128": (dict(hq=4, hkv=1, dqk=128, lens=(0, 130, 1), page_size=64, layout="HND"),
                             dict(causal=True), None),
    "sq8-mqa16-two-row-blocks": (dict(sq=8, hq=16, hkv=1, lens=(0, 1, 100), page_size=16),
                                 dict(causal=True, window_size=(50, -1)), 3),  # 128 packed rows: 2 row blocks
    "paged16-hnd-sq3-noncausal": (dict(sq=3, hq=4, hkv=1, lens=(1, 0, 50), page_size=16, layout="HND"),
                                  dict(causal=False), 7),
    # score modifiers
    "softcap": (dict(hq=8, hkv=2, lens=(0, 1, 90)), dict(softcap=0.8, softmax_scale=1.3), None),
    "negative-scale": (dict(sq=3, hq=4, hkv=2, lens=(0, 1, 70)), dict(causal=True, softmax_scale=-0.3), 2),
    "sinks": (dict(sq=3, hq=8, hkv=2, lens=(0, 1, 60), sinks=True), dict(causal=True), 1),
    "sinks-split": (dict(sq=3, hq=8, hkv=2, lens=(0, 1, 60), sinks=True), dict(causal=True), 3),
    "alibi-heads": (dict(sq=3, hq=4, hkv=2, lens=(0, 1, 80), alibi="heads"), dict(causal=True), None),
    "alibi-batch-paged": (dict(hq=4, hkv=1, lens=(1, 0, 80), alibi="batch", page_size=16), dict(), None),
    "window": (dict(sq=3, hq=4, hkv=2, lens=(0, 1, 120)), dict(causal=True, window_size=(20, -1)), None),
    "window-both-sides": (dict(sq=8, hq=2, hkv=1, lens=(1, 0, 100), page_size=64),
                          dict(causal=False, window_size=(30, 2)), 2),
    # FP8 caches, per tensor and per kv head
    "fp8-tensor": (dict(hq=8, hkv=2, lens=(0, 1, 100), fp8="tensor"), dict(causal=True), None),
    "fp8-head-paged-hnd": (dict(sq=3, hq=8, hkv=2, lens=(1, 0, 70), fp8="head", page_size=16, layout="HND"),
                           dict(causal=True), 2),
    # head dims: Dqk != Dv, MLA-style 576 / 512 with one kv head
    "dqk-dv-differ": (dict(hq=4, hkv=2, dqk=72, dv=40, lens=(0, 1, 50)), dict(causal=True), None),
    "mla-576-512": (dict(hq=16, hkv=1, dqk=576, dv=512, lens=(0, 1, 40), page_size=16), dict(causal=True), 2),
    # everything at once
    "all": (dict(sq=3, hq=8, hkv=2, lens=(1, 0, 90), alibi="batch", sinks=True, page_size=16, fp8="head"),
            dict(causal=True, window_size=(40, -1), softcap=2.0), 3),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.thin(8)
def test_torch_decode(name):
    spec, options, splits = CASES[name]
    q, k, v, kw = make_case(_seed(name), **spec)
    check_decode(q, k, v, kw, options, kv_layout=spec.get("layout", "NHD"), num_splits=splits)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_low_precision(dtype):
    q, k, v, kw = make_case(_seed(dtype), sq=3, hq=8, hkv=2, lens=(0, 1, 100), dtype=dtype, page_size=16,
                            sinks=True)
    check_decode(q, k, v, kw, dict(causal=True, softcap=5.0), num_splits=3, floor=1e-3)


def test_torch_fp8_cache_with_bf16_queries():
    q, k, v, kw = make_case(5, sq=1, hq=8, hkv=2, lens=(0, 1, 100), dtype="bfloat16", fp8="head", page_size=64)
    check_decode(q, k, v, kw, dict(causal=True), floor=1e-3)


def test_torch_split_counts_agree_and_fixed_split_is_reproducible():
    spec = dict(sq=3, hq=8, hkv=2, lens=(0, 1, 33, 130), page_size=16, sinks=True, alibi="heads")
    options = dict(causal=True, window_size=(70, -1), softcap=3.0)
    q, k, v, kw = make_case(11, **spec)
    results = {}
    for splits in (1, 2, 7, None):
        results[splits] = check_decode(q, k, v, kw, options, num_splits=splits)
    for splits in (2, 7, None):  # agree to float32 rounding
        torch.testing.assert_close(results[splits][0], results[1][0], atol=2e-6, rtol=0)
        finite = torch.isfinite(results[1][1])
        torch.testing.assert_close(results[splits][1][finite], results[1][1][finite], atol=2e-6, rtol=0)
    # a fixed split count: the same bits on every run, and batch-invariant (each sequence alone == in batch)
    out7, lse7 = tapi.decode_attention(q, k, v, num_splits=7, **kw, **options, return_lse=True)
    assert torch.equal(out7, results[7][0]) and torch.equal(lse7, results[7][1])
    for i in (2, 3):
        alone = dict(kw, cache_seqlens=kw["cache_seqlens"][i:i + 1], block_table=kw["block_table"][i:i + 1])
        o, l_ = tapi.decode_attention(q[i:i + 1], k, v, num_splits=7, **alone, **options, return_lse=True)
        assert torch.equal(o[0], out7[i]) and torch.equal(l_[0], lse7[i])


def test_torch_strided_cache_views():
    # an MLA-style latent cache: v a view of the first dims of k takes the latent (MLA) kernel, a copy the
    # generic one; both agree to float32 rounding
    q, k, _, kw = make_case(3, hq=4, hkv=1, dqk=80, lens=(0, 1, 40), page_size=16)
    v = k[..., :48]
    out, lse = tapi.decode_attention(q, k, v, **kw, return_lse=True)
    expect, expect_lse = tapi.decode_attention(q, k, v.contiguous(), **kw, return_lse=True)
    torch.testing.assert_close(out, expect, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, expect_lse, atol=2e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------- merge / cascade

def test_torch_merge_attention_states():
    g = torch.Generator().manual_seed(2)
    outs = torch.randn(3, 2, 5, 4, 24, generator=g)
    lses = torch.randn(3, 2, 5, 4, generator=g) * 3
    lses[0, 0] = float("-inf")  # a state that saw nothing
    lses[:, 1, 0] = float("-inf")  # rows where no state saw anything
    outs[0, 0] = float("nan")  # never read where its lse is -inf
    out, lse = tapi.merge_attention_states(outs, lses)
    ro, rl = ref.merge_attention_states(outs.double().numpy(), lses.double().numpy())
    np.testing.assert_allclose(np64(out), np.nan_to_num(ro), atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.isneginf(np64(lse)), np.isneginf(rl))
    np.testing.assert_allclose(np.where(np.isfinite(rl), np64(lse), 0), np.where(np.isfinite(rl), rl, 0), atol=2e-6)
    assert torch.all(out[1, 0] == 0)
    # bf16 states, one state: the identity (0 where the state saw nothing)
    o1, l1 = tapi.merge_attention_states(outs[1:2].bfloat16(), lses[1:2])
    seen = torch.isfinite(lses[1])[..., None]
    assert o1.dtype == torch.bfloat16 and torch.equal(o1, torch.where(seen, outs[1], 0.0).bfloat16())
    torch.testing.assert_close(l1, lses[1], atol=1e-6, rtol=0)  # lse * log2(e) * ln(2): float32 rounding
    # 37 states (three blocks of 16 states, the last ragged), rows x D not a multiple of the element block
    outs = torch.randn(37, 3, 5, 7, 40, generator=g)
    lses = torch.randn(37, 3, 5, 7, generator=g) * 4
    lses[5:30, 2] = float("-inf")
    out, lse = tapi.merge_attention_states(outs, lses)
    ro, rl = ref.merge_attention_states(outs.double().numpy(), lses.double().numpy())
    np.testing.assert_allclose(np64(out), ro, atol=2e-6, rtol=0)
    np.testing.assert_allclose(np64(lse), rl, atol=4e-6, rtol=0)


def test_torch_merge_of_decode_halves_equals_full_decode():
    q, k, v, kw = make_case(4, sq=3, hq=8, hkv=2, lens=(0, 1, 64, 130), s_max=130)
    lens = kw["cache_seqlens"]
    cut = torch.minimum(lens, torch.tensor(40, dtype=torch.int32))
    first = tapi.decode_attention(q, k, v, cache_seqlens=cut, causal=False, return_lse=True)
    # second part: rows cut .. len - 1 of each sequence, moved to the front of a second cache
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    for i in range(len(lens)):
        n = int(lens[i] - cut[i])
        k2[i, :n], v2[i, :n] = k[i, cut[i]:lens[i]], v[i, cut[i]:lens[i]]
    second = tapi.decode_attention(q, k2, v2, cache_seqlens=lens - cut, causal=False, return_lse=True)
    out, lse = tapi.merge_attention_states(torch.stack([first[0], second[0]]),
                                           torch.stack([first[1], second[1]]).transpose(-1, -2))
    full_out, full_lse = tapi.decode_attention(q, k, v, cache_seqlens=lens, causal=False, return_lse=True)
    torch.testing.assert_close(out, full_out, atol=2e-6, rtol=0)
    torch.testing.assert_close(lse.transpose(-1, -2), full_lse, atol=2e-6, rtol=0)


CASCADE_CASES = {
    "contig-nhd": (dict(sq=1, hq=8, hkv=2, lens=(0, 1, 50)), 37, dict(causal=True)),
    "paged-hnd-sinks-softcap": (dict(sq=3, hq=8, hkv=2, lens=(3, 1, 60), page_size=16, layout="HND", sinks=True),
                                70, dict(causal=True, softcap=2.0)),
    "fp8-paged": (dict(sq=1, hq=4, hkv=1, lens=(9, 0, 40), page_size=16, fp8="head"), 45, dict(causal=True)),
    "many-rows": (dict(sq=3, hq=16, hkv=1, lens=(2, 5, 40)), 33, dict(causal=True)),  # 144 shared rows: 3 blocks
}


def _shared(seed, spec, shared_len):
    g = torch.Generator().manual_seed(seed)
    hkv, dqk = spec.get("hkv", 2), spec.get("dqk", 64)
    xs = [torch.randn(shared_len, hkv, dqk, generator=g) for _ in range(2)]
    if spec.get("fp8"):
        xs = [x.to(torch.float8_e4m3fn) for x in xs]
    if spec.get("layout") == "HND":
        xs = [x.transpose(0, 1).contiguous() for x in xs]
    return xs


@pytest.mark.parametrize("name", list(CASCADE_CASES))
def test_torch_cascade_attention(name):
    spec, shared_len, options = CASCADE_CASES[name]
    layout = spec.get("layout", "NHD")
    q, k, v, kw = make_case(_seed(name), **spec)
    sk, sv = _shared(_seed(name) + 1, spec, shared_len)
    out, lse = tapi.cascade_attention(q, sk, sv, k, v, kv_layout=layout, **kw, **options, return_lse=True)
    npkw = to_np(kw)
    ro, rl = ref.cascade_attention(np64(q), cache_np(sk), cache_np(sv), cache_np(k), cache_np(v), kv_layout=layout,
                                   **npkw, **options)
    np.testing.assert_allclose(np64(out), ro, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np64(lse), rl, atol=2e-5, rtol=0)
    # the same as one decode over the concatenated cache (rows of the shared prefix first) wherever every
    # query still sees the whole prefix under causal masking there (L >= Sq - 1)
    lens = kw["cache_seqlens"]
    if bool((lens >= q.shape[1] - 1).all()) and "block_table" not in kw and layout == "NHD":
        cat = [torch.cat([s[None].expand(len(lens), *s.shape), c], dim=1) for s, c in ((sk, k), (sv, v))]
        full = tapi.decode_attention(q, *cat, **dict(kw, cache_seqlens=lens + shared_len), **options)
        torch.testing.assert_close(out, full, atol=2e-6, rtol=0)


# ----------------------------------------------------------------------------------------------- append

APPEND_CASES = {
    "contig-nhd-f32": dict(layout="NHD", page_size=None, dtype="float32", fp8=None),
    "paged16-hnd-bf16": dict(layout="HND", page_size=16, dtype="bfloat16", fp8=None),
    "paged64-nhd-fp8-head": dict(layout="NHD", page_size=64, dtype="bfloat16", fp8="head"),
    "contig-hnd-fp8-tensor": dict(layout="HND", page_size=None, dtype="float32", fp8="tensor"),
}


def _append_inputs(name, case, framework_copy=False):
    """A cache holding the first L_b rows, k_new/v_new for the next n rows, and the full-cache equivalent."""
    n_new = 3
    lens = (0, 1, 61)
    q, k, v, kw = make_case(_seed(name), sq=n_new, hq=4, hkv=2, dqk=64, dv=48, lens=tuple(x + n_new for x in lens),
                            s_max=80, page_size=case["page_size"], layout=case["layout"], dtype=case["dtype"],
                            fp8=case["fp8"])
    g = torch.Generator().manual_seed(1)
    dt = TORCH_DTYPES[case["dtype"]]
    k_new = (torch.randn(len(lens), n_new, 2, 64, generator=g) * 3).to(dt)
    v_new = (torch.randn(len(lens), n_new, 2, 48, generator=g) * 3).to(dt)
    before = dict(kw, cache_seqlens=torch.tensor(lens, dtype=torch.int32))
    return q, k, v, k_new, v_new, kw, before


@pytest.mark.parametrize("name", list(APPEND_CASES))
def test_torch_append_then_decode(name):
    case = APPEND_CASES[name]
    layout = case["layout"]
    q, k, v, k_new, v_new, after, before = _append_inputs(name, case)
    scales = {n: before[n] for n in ("k_scale", "v_scale") if n in before}
    extra = {n: before[n] for n in ("block_table",) if n in before}
    rk, rv = ref.append_kv_cache(cache_np(k), cache_np(v), np64(k_new) if case["fp8"] else cache_np(k_new),
                                 np64(v_new) if case["fp8"] else cache_np(v_new),
                                 cache_seqlens=before["cache_seqlens"].numpy(), kv_layout=layout,
                                 **{n: t.numpy() for n, t in {**extra, **scales}.items()})
    kc, vc = k.clone(), v.clone()
    assert tapi.append_kv_cache(kc, vc, k_new, v_new, cache_seqlens=before["cache_seqlens"], kv_layout=layout,
                                **extra, **scales) is None
    # in place, bit-exact against the reference (fp8: the same e4m3 rounding as ml_dtypes / torch)
    for got, want in ((kc, rk), (vc, rv)):
        np.testing.assert_array_equal(cache_np(got).view(np.uint8) if got.dtype == torch.float8_e4m3fn
                                      else cache_np(got), want.view(np.uint8) if case["fp8"] else want)
    # decode after the append == decode over the full reference cache (same bits: same cache, same kernel)
    out = tapi.decode_attention(q, kc, vc, kv_layout=layout, **after, num_splits=2)
    full_k = torch.from_numpy(rk.view(np.uint8)).view(torch.float8_e4m3fn) if case["fp8"] else \
        torch.from_numpy(np.asarray(rk)).to(k.dtype)
    full_v = torch.from_numpy(rv.view(np.uint8)).view(torch.float8_e4m3fn) if case["fp8"] else \
        torch.from_numpy(np.asarray(rv)).to(v.dtype)
    expect = tapi.decode_attention(q, full_k, full_v, kv_layout=layout, **after, num_splits=2)
    assert torch.equal(out, expect)
    ro, _ = ref.decode_attention(np64(q), rk, rv, kv_layout=layout, **to_np(after))
    bf16 = case["dtype"] == "bfloat16"  # p rounds to 16 bits for p @ V: outputs near 0 keep an absolute error
    np.testing.assert_allclose(np64(out), ro, rtol=8e-3 if bf16 else 1e-5, atol=1e-3 if bf16 else 1e-5)


def test_fp8_quantisation_edge_values_match_ml_dtypes():
    # the kernel rounds to e4m3 with integer arithmetic (the interpreter's own float->fp8 cast is wrong on
    # exponent carries and negative subnormals): check carries, subnormals, signed zeros and saturation
    import ml_dtypes
    special = torch.tensor([0.0, -0.0, 2 ** -10, -2 ** -10, 3 * 2 ** -10, -5 * 2 ** -10, 0.0155, -0.0156,
                            31.13, -31.9, 7.87, 447.0, 449.0, 464.0, 465.0, -1000.0, 1e-9, 3.3, -0.0009])
    g = torch.Generator().manual_seed(0)
    rest = torch.randn(4 * 17 - special.numel(), generator=g) * torch.exp(torch.randn(4 * 17 - special.numel(),
                                                                                       generator=g) * 4)
    values = torch.cat([special, rest]).reshape(1, 4, 1, 17)
    kc = torch.zeros(1, 8, 1, 17, dtype=torch.float8_e4m3fn)
    vc = torch.zeros(1, 8, 1, 17, dtype=torch.float8_e4m3fn)
    tapi.append_kv_cache(kc, vc, values, values, cache_seqlens=torch.tensor([2], dtype=torch.int32))
    want = np.clip(values.numpy(), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(kc.view(torch.uint8).numpy()[:, 2:6], want)
    assert torch.all(kc.view(torch.uint8)[:, :2] == 0) and torch.all(kc.view(torch.uint8)[:, 6:] == 0)


@triton.jit
def _f16_query_kernel(Q, OUT, INV):
    offs = tl.arange(0, 16)[:, None] * 32 + tl.arange(0, 32)[None, :]
    q16, inv_scale = f16_query(tl.load(Q + offs))
    tl.store(OUT + offs, q16)
    tl.store(INV, inv_scale)


def test_f16_query_scaling_is_exact_and_never_overflows():
    """The bf16 query of an FP8-cache decode goes to float16 (one conversion per K pair in the dot): exact
    below 2^15, and larger tiles scaled by an exact power of two that the kernel folds back into the score
    scale. Run through the interpreter on float32 tiles of bf16 values (the GPU path feeds bf16)."""
    kernel = _InterpretedKernel(_f16_query_kernel.fn)
    g = torch.Generator().manual_seed(11)
    for top in (0.75, 3.0e4, 40000.0, 1.0e6, 3.0e38):
        q = (torch.randn(16, 32, generator=g) * 3).bfloat16().float()
        q[3, 5] = -top
        q = q.bfloat16().float()
        out, inv = torch.empty(16, 32, dtype=torch.float16), torch.empty(1)
        kernel[(1,)](q, out, inv)
        assert torch.isfinite(out).all() and out.abs().max() < 2 ** 15
        expected_inv = 1.0 if top < 2 ** 15 else 2.0 ** (int(np.floor(np.log2(top))) - 14)
        assert inv.item() == expected_inv
        back = out.double() * inv.item()
        normal = (q.double().abs() / inv.item()) >= 2 ** -14
        assert torch.equal(back[normal], q.double()[normal])
        assert (back - q.double()).abs().max() <= 2 ** -25 * inv.item()


# ------------------------------------------------------------------------------------ torch: integration

def test_torch_compile_fullgraph():
    q, k, v, kw = make_case(6, sq=1, hq=4, hkv=2, dqk=32, lens=(1, 2, 40), page_size=16, sinks=True)
    k_new, v_new = torch.randn(3, 1, 2, 32), torch.randn(3, 1, 2, 32)
    sk, sv = torch.randn(9, 2, 32), torch.randn(9, 2, 32)
    lens, table, sinks = kw["cache_seqlens"], kw["block_table"], kw["sinks"]

    def step(q, k, v, k_new, v_new, lens, table, sinks):
        tapi.append_kv_cache(k, v, k_new, v_new, cache_seqlens=lens, block_table=table)
        out, lse = tapi.decode_attention(q, k, v, cache_seqlens=lens + 1, block_table=table, sinks=sinks,
                                         num_splits=2, return_lse=True)
        c = tapi.cascade_attention(q, sk, sv, k, v, cache_seqlens=lens + 1, block_table=table)
        m, _ = tapi.merge_attention_states(torch.stack([out, c]), torch.stack([lse, lse]).transpose(-1, -2))
        return out, lse, m

    kc, vc = k.clone(), v.clone()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, kc, vc, k_new, v_new, lens, table, sinks)
    ke, ve = k.clone(), v.clone()
    want = step(q, ke, ve, k_new, v_new, lens, table, sinks)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(kc, ke) and torch.equal(vc, ve) and not torch.equal(kc, k)  # the mutation happened


def test_torch_opcheck():
    q, k, v, kw = make_case(8, sq=2, hq=2, hkv=1, dqk=16, lens=(1, 2, 20), page_size=16, sinks=True,
                            alibi="heads")
    args = (q, k, v, kw["cache_seqlens"], kw["block_table"], kw["alibi_slopes"], kw["sinks"], None, None, "NHD",
            0.25, True, 4, 0, 1.5, 2)
    torch.library.opcheck(torch.ops.flashbridge.decode_attn.default, args)
    out, lse = torch.ops.flashbridge.decode_attn(*args)
    torch.library.opcheck(torch.ops.flashbridge.merge_attn_states.default,
                          (torch.stack([out, out]), torch.stack([lse, lse]).transpose(-1, -2).contiguous()))
    sk = torch.randn(5, 1, 16)
    torch.library.opcheck(torch.ops.flashbridge.cascade_attn.default,
                          (q, sk, sk, k, v, kw["cache_seqlens"], kw["block_table"], kw["sinks"], None, None, "NHD",
                           0.25, True, 0.0, None))
    new = (torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16))
    torch.library.opcheck(torch.ops.flashbridge.append_kv_cache.default,
                          (k.clone(), v.clone(), *new, kw["cache_seqlens"], kw["block_table"], None, None, "NHD"))
    # FP8 caches: torch's schema check compares tensors with allclose, which has no float8 CPU kernel, so the
    # FP8 variants run the other checks (fake tensors, autograd registration, AOT dispatch)
    _, k8, v8, kw8 = make_case(8, sq=2, hq=2, hkv=1, dqk=16, lens=(1, 2, 20), page_size=16, fp8="head")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.flashbridge.decode_attn.default,
                          (q, k8, v8, kw8["cache_seqlens"], kw8["block_table"], None, None, kw8["k_scale"],
                           kw8["v_scale"], "NHD", 0.25, False, None, None, 0.0, None), test_utils=utils)
    torch.library.opcheck(torch.ops.flashbridge.append_kv_cache.default,
                          (k8.clone(), v8.clone(), *new, kw8["cache_seqlens"], kw8["block_table"], kw8["k_scale"],
                           kw8["v_scale"], "NHD"), test_utils=utils)


# ----------------------------------------------------------------------------------- torch: bad inputs

def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _i(*values):
    return torch.tensor(values, dtype=torch.int32)


def _fp8(*shape):
    return _t(*shape).to(torch.float8_e4m3fn)


def _base():
    return dict(q=_t(2, 1, 4, 8), k_cache=_t(2, 16, 2, 8), v_cache=_t(2, 16, 2, 8), cache_seqlens=_i(3, 16))


def _paged():
    return dict(q=_t(2, 1, 4, 8), k_cache=_t(5, 4, 2, 8), v_cache=_t(5, 4, 2, 8), cache_seqlens=_i(3, 8),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))


BAD_INPUTS = [
    ("q 3-D", dict(q=_t(2, 4, 8)), ValueError, "q: expected 4 dimensions"),
    ("q int", dict(q=torch.ones(2, 1, 4, 8, dtype=torch.int32)), TypeError, "q: dtype int32"),
    ("q empty", dict(q=_t(2, 0, 4, 8)), ValueError, "q: empty"),
    ("cache dtype", dict(k_cache=_t(2, 16, 2, 8, dtype=torch.float16), v_cache=_t(2, 16, 2, 8, dtype=torch.float16)),
     TypeError, "k_cache: dtype float16"),
    ("k/v dtype differ", dict(v_cache=_fp8(2, 16, 2, 8)), TypeError, "share one dtype"),
    ("cache 3-D", dict(k_cache=_t(16, 2, 8), v_cache=_t(16, 2, 8)), ValueError, "k_cache: expected 4 dimensions"),
    ("k/v rows differ", dict(v_cache=_t(2, 15, 2, 8)), ValueError, "k_cache, v_cache"),
    ("cache batch", dict(k_cache=_t(3, 16, 2, 8), v_cache=_t(3, 16, 2, 8)), ValueError, "one entry per sequence"),
    ("head dim", dict(k_cache=_t(2, 16, 2, 16), v_cache=_t(2, 16, 2, 16)), ValueError, "head dims differ"),
    ("gqa ratio", dict(q=_t(2, 1, 3, 8)), ValueError, "multiple"),
    ("dv > 512", dict(v_cache=_t(1, 1, 2, 513).expand(2, 16, 2, 513)), ValueError, "v_cache: head dim 513"),
    ("layout", dict(kv_layout="BSHD"), ValueError, "kv_layout"),
    ("seqlens dtype", dict(cache_seqlens=torch.tensor([3, 16])), TypeError, "cache_seqlens: must be int32"),
    ("seqlens shape", dict(cache_seqlens=_i(3, 16, 1)), ValueError, "cache_seqlens: expected shape"),
    ("seqlens missing", dict(cache_seqlens=None), TypeError, "cache_seqlens"),
    ("seqlens > capacity", dict(cache_seqlens=_i(3, 17)), ValueError, "holds 16"),
    ("seqlens negative", dict(cache_seqlens=_i(-1, 3)), ValueError, "negative"),
    ("scales without fp8", dict(k_scale=torch.ones(()), v_scale=torch.ones(())), ValueError, "float8"),
    ("one scale", dict(k_cache=_fp8(2, 16, 2, 8), v_cache=_fp8(2, 16, 2, 8), k_scale=torch.ones(())), ValueError,
     "give both"),
    ("scale shape", dict(k_cache=_fp8(2, 16, 2, 8), v_cache=_fp8(2, 16, 2, 8), k_scale=torch.ones(3),
                         v_scale=torch.ones(3)), ValueError, "k_scale: expected shape"),
    ("scale dtype", dict(k_cache=_fp8(2, 16, 2, 8), v_cache=_fp8(2, 16, 2, 8),
                         k_scale=torch.ones((), dtype=torch.float16), v_scale=torch.ones((), dtype=torch.float16)),
     TypeError, "k_scale: must be float32"),
    ("mixed scale modes", dict(k_cache=_fp8(2, 16, 2, 8), v_cache=_fp8(2, 16, 2, 8), k_scale=torch.ones(()),
                               v_scale=torch.ones(2)), ValueError, "must both be per tensor"),
    ("window", dict(window_size=(-3, 0)), ValueError, "window_size"),
    ("softcap", dict(softcap=-1.0), ValueError, "softcap"),
    ("scale nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("causal not bool", dict(causal=1), TypeError, "causal"),
    ("sinks shape", dict(sinks=_t(3)), ValueError, "sinks"),
    ("alibi shape", dict(alibi_slopes=_t(2, 3)), ValueError, "alibi_slopes"),
    ("cache empty", dict(k_cache=_t(2, 0, 2, 8), v_cache=_t(2, 0, 2, 8)), ValueError, "k_cache: empty cache"),
    ("dqk > 1024", dict(q=_t(2, 1, 4, 1025), k_cache=_t(1, 1, 2, 1025).expand(2, 16, 2, 1025)), ValueError,
     "k_cache: head dim 1025"),
    ("scale not a number", dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("window not a pair", dict(window_size=5), ValueError, "window_size"),
    ("softcap not a number", dict(softcap=None), TypeError, "softcap"),
    ("sinks dtype", dict(sinks=torch.ones(4, dtype=torch.int32)), TypeError, "sinks: dtype int32"),
    ("alibi dtype", dict(alibi_slopes=torch.ones(4, dtype=torch.int32)), TypeError, "alibi_slopes: dtype int32"),
    ("num_splits 0", dict(num_splits=0), ValueError, "num_splits"),
    ("num_splits float", dict(num_splits=2.0), TypeError, "num_splits"),
    ("not a tensor", dict(k_cache=np.ones((2, 16, 2, 8), np.float32)), TypeError, "k_cache: expected a torch.Tensor"),
]

BAD_PAGED = [
    ("table dtype", dict(block_table=torch.tensor([[0, 1], [2, 3]])), TypeError, "block_table: must be int32"),
    ("table rows", dict(block_table=torch.tensor([[0, 1]], dtype=torch.int32)), ValueError, "block_table: expected"),
    ("page size 3", dict(k_cache=_t(5, 3, 2, 8), v_cache=_t(5, 3, 2, 8)), ValueError, "page size 3"),
    ("page out of range", dict(block_table=torch.tensor([[0, 1], [2, 5]], dtype=torch.int32)), ValueError,
     r"block_table: entry \[1, 1\] = 5"),
    ("negative page in use", dict(block_table=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32)), ValueError,
     r"entry \[0, 0\] = -1"),
    ("length beyond table", dict(cache_seqlens=_i(3, 9)), ValueError, "holds 8"),
]


@pytest.mark.parametrize("name,override,error,match", BAD_INPUTS + BAD_PAGED,
                         ids=[c[0] for c in BAD_INPUTS + BAD_PAGED])
def test_torch_bad_inputs(name, override, error, match):
    args = _paged() if any(name == c[0] for c in BAD_PAGED) else _base()
    args.update(override)
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    with pytest.raises(error, match=match):
        tapi.decode_attention(q, k, v, **args)


def test_cache_capacity_bound():
    """Cache positions are compared in int32 with an unbounded window side standing for 2**30: a cache that
    could hold more tokens per sequence is refused from its shapes, before anything is allocated."""
    from flashbridge.core_kernels.decode.plan import check_decode_args
    from flashbridge.core_kernels.flash_attn.plan import MAX_SEQLEN
    q, lens = ((1, 1, 2, 8), "bfloat16"), ((1,), "int32")
    fine = ((1, MAX_SEQLEN, 1, 8), "bfloat16")
    shape, _, _ = check_decode_args(q=q, k_cache=fine, v_cache=fine, cache_seqlens=lens)
    assert shape.cache.capacity == MAX_SEQLEN
    long = ((1, MAX_SEQLEN + 1, 1, 8), "bfloat16")
    with pytest.raises(ValueError, match="k_cache: S_max = 1073741824 is above"):
        check_decode_args(q=q, k_cache=long, v_cache=long, cache_seqlens=lens)
    pages = ((4, 64, 1, 8), "bfloat16")
    with pytest.raises(ValueError, match="block_table: max_pages x page_size = 1073741824 is above"):
        check_decode_args(q=q, k_cache=pages, v_cache=pages, cache_seqlens=lens,
                          block_table=((1, 2**24), "int32"))


def _cascade_args():
    b = _base()
    return dict(q=b["q"], shared_k=_t(5, 2, 8), shared_v=_t(5, 2, 8), k_cache=b["k_cache"], v_cache=b["v_cache"],
                cache_seqlens=b["cache_seqlens"])


def _append_args():
    b = _base()
    return dict(k_cache=b["k_cache"], v_cache=b["v_cache"], k_new=_t(2, 1, 2, 8), v_new=_t(2, 1, 2, 8),
                cache_seqlens=_i(3, 4))


BAD_OTHER = [
    ("merge", dict(outs=torch.ones(2, 3, 8, dtype=torch.int32), lses=_t(2, 3)), TypeError, "outs: dtype int32"),
    ("merge", dict(outs=_t(2, 3, 4, 8), lses=_t(2, 4, 3)), ValueError, "lses: expected shape"),
    ("merge", dict(outs=_t(2, 3, 8), lses=_t(2, 3, dtype=torch.float16)), TypeError, "lses: must be float32"),
    ("merge", dict(outs=_t(8), lses=_t(1)), ValueError, "outs: expected"),
    ("merge", dict(outs=_t(2, 0, 8), lses=_t(2, 0)), ValueError, "outs: empty"),
    ("merge", dict(outs=_t(2, 3, 513), lses=_t(2, 3)), ValueError, "outs: head dim 513"),
    ("merge", dict(outs=None, lses=_t(2, 3)), TypeError, "outs: expected a torch.Tensor"),
    ("cascade", dict(shared_k=_t(5, 1, 8), shared_v=_t(5, 1, 8)), ValueError, "shared_k: expected 2 kv heads"),
    ("cascade", dict(shared_k=_t(5, 2, 8, dtype=torch.float16)), TypeError, "shared_k: must have the cache's dtype"),
    ("cascade", dict(shared_k=_t(1, 5, 2, 8)), ValueError, "shared_k: expected 3 non-empty dimensions"),
    ("cascade", dict(shared_v=_t(6, 2, 8)), ValueError, "shared_k, shared_v: must agree"),
    ("cascade", dict(shared_k=_t(5, 2, 4)), ValueError, "head dim 8"),
    ("cascade", dict(cache_seqlens=_i(3, 17)), ValueError, "holds 16"),
    ("cascade", dict(window_size=(4, 0)), TypeError, "window_size"),
    ("append", dict(cache_seqlens=_i(3, 16)), ValueError, r"cache_seqlens \+ 1 new tokens: sequence 1 needs 17 rows"),
    ("append", dict(k_new=_t(2, 1, 2, 8, dtype=torch.float16), v_new=_t(2, 1, 2, 8, dtype=torch.float16)), TypeError,
     "k_new: must have the cache's dtype"),
    ("append", dict(k_new=torch.ones(2, 1, 2, 8, dtype=torch.int32)), TypeError, "k_new: dtype int32"),
    ("append", dict(v_new=_t(2, 1, 2, 8, dtype=torch.float16)), TypeError, "k_new, v_new: must share one dtype"),
    ("append", dict(k_new=_t(2, 1, 8)), ValueError, "k_new: expected 4 non-empty dimensions"),
    ("append", dict(v_new=_t(2, 2, 2, 8)), ValueError, "k_new, v_new: must agree"),
    ("append", dict(k_new=_t(2, 1, 1, 8), v_new=_t(2, 1, 1, 8)), ValueError, "k_new, v_new: expected 2 kv heads"),
    ("append", dict(k_new=_t(3, 1, 2, 8), v_new=_t(3, 1, 2, 8)), ValueError, "one entry per sequence"),
    ("append", dict(k_scale=torch.ones(()), v_scale=torch.ones(())), ValueError, "float8"),
    ("append", dict(cache_seqlens=_i(-1, 3)), ValueError, "negative"),
]


@pytest.mark.parametrize("op,override,error,match", BAD_OTHER, ids=[f"{c[0]}-{c[3][:30]}" for c in BAD_OTHER])
def test_torch_bad_merge_cascade_append(op, override, error, match):
    args = {"merge": dict, "cascade": _cascade_args, "append": _append_args}[op]()
    args.update(override)
    fn = {"merge": tapi.merge_attention_states, "cascade": tapi.cascade_attention, "append": tapi.append_kv_cache}[op]
    positional = {"merge": ("outs", "lses"), "cascade": ("q", "shared_k", "shared_v", "k_cache", "v_cache"),
                  "append": ("k_cache", "v_cache", "k_new", "v_new")}[op]
    pos = [args.pop(n) for n in positional]
    with pytest.raises(error, match=match):
        fn(*pos, **args)


@pytest.fixture
def decode_config():
    """Plan both front-ends' decode calls with a DecodeConfig: ``decode_config(**fields)`` enters
    ``configure(DecodeConfig(**fields))`` until the test ends."""
    import contextlib

    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.decode.plan import DecodeConfig

    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(configure(DecodeConfig(**fields)))


def decode_plan(q, k, v, kw, options, *, kv_layout="NHD", num_splits=None):
    """The plan of a decode_attention call on CPU tensors (under the active configure())."""
    from flashbridge.core_kernels import INTERPRETER
    from flashbridge.core_kernels.decode import plan as P
    from flashbridge.torch_api._runtime import dtype_name

    info = lambda t: (tuple(t.shape), dtype_name(t.dtype))  # noqa: E731
    shape, opts, splits = P.check_decode_args(q=info(q), k_cache=info(k), v_cache=info(v), kv_layout=kv_layout,
                                              num_splits=num_splits, **{n: info(a) for n, a in kw.items()},
                                              **options)
    return P.plan_decode(shape, opts, target=INTERPRETER, num_splits=splits)


def decode_constexpr(plans, name: str) -> set:
    """The values of constexpr ``name`` over the decode kernel launches of ``plans``."""
    return {launch.constexpr_dict()[name] for plan in plans for launch in plan.launches
            if launch.kernel.endswith(":decode_fwd_kernel")}


def test_decode_config_rejects_bad_blocks():
    from flashbridge.core_kernels.decode.plan import DecodeConfig
    with pytest.raises(ValueError, match="DecodeConfig.block_n"):
        DecodeConfig(block_n=48)
    with pytest.raises(ValueError, match="DecodeConfig.block_m"):
        DecodeConfig(block_m=8)
    with pytest.raises(ValueError, match="DecodeConfig.merge_block_states"):
        DecodeConfig(merge_block_states=3)
    with pytest.raises(ValueError, match="DecodeConfig.merge_block_elements"):
        DecodeConfig(merge_block_elements=0)


# FP8 caches with 16-bit queries: V read as pairs of columns into two accumulators (kernels.load_e4m3_pairs)
# wherever Dv and the V strides are even and each half has >= 16 columns; the plain widening otherwise. K the
# same way (q's even and odd columns against K's) with one column chunk.
FP8_PAIR_CASES = {
    "nhd-contig-d128": (dict(hq=8, hkv=2, dqk=128, lens=(0, 1, 130), fp8="tensor"), dict(causal=True), None,
                        True),
    "hnd-paged16-dv40-sq3": (dict(sq=3, hq=8, hkv=2, dqk=64, dv=40, lens=(1, 0, 70), fp8="head", page_size=16,
                                  layout="HND", sinks=True), dict(causal=True, window_size=(40, -1)), 2, True),
    "softcap-alibi-split7": (dict(hq=4, hkv=1, dqk=64, lens=(0, 1, 90), fp8="head", alibi="heads"),
                             dict(softcap=3.0), 7, True),
    "odd-dv": (dict(hq=4, hkv=2, dqk=32, dv=17, lens=(0, 1, 50), fp8="tensor"), dict(causal=True), None, False),
    "dv16": (dict(hq=4, hkv=2, dqk=32, dv=16, lens=(0, 1, 50), fp8="tensor"), dict(causal=True), None, False),
    "mla-576-512": (dict(hq=16, hkv=1, dqk=576, dv=512, lens=(0, 1, 40), fp8="tensor", page_size=16),
                    dict(causal=True), 2, True),
    "odd-dqk": (dict(hq=4, hkv=2, dqk=33, dv=32, lens=(0, 1, 50), fp8="tensor"), dict(causal=True), 2, True),
}


@pytest.mark.parametrize("name", list(FP8_PAIR_CASES))
def test_torch_fp8_pairs(name, decode_config):
    """bf16 queries against FP8 caches: V's even and odd columns in two accumulators, interleaved once per
    split, K's against q's in two dots (ragged / empty sequences, paged HND, padded head dims, several
    splits), against the float64 reference; odd head dims and 16-column tiles take the plain widening of V,
    chunked (576-dim) and odd-width keys that of K."""
    spec, options, splits, pairs = FP8_PAIR_CASES[name]
    decode_config(block_n=64)
    q, k, v, kw = make_case(_seed(name), dtype="bfloat16", **spec)
    check_decode(q, k, v, kw, options, kv_layout=spec.get("layout", "NHD"), num_splits=splits, floor=1e-3)
    plan = decode_plan(q, k, v, kw, options, kv_layout=spec.get("layout", "NHD"), num_splits=splits)
    assert decode_constexpr([plan], "V_PAIRS") == {pairs}
    assert decode_constexpr([plan], "K_PAIRS") == {spec["dqk"] <= 256 and spec["dqk"] % 2 == 0}


@pytest.mark.parametrize("block_n", [128, 256])
def test_torch_fp8_wide_key_blocks(block_n, decode_config):
    """The GPU's FP8 tiles (128 keys; 256 at one program per SM on long spans) in the interpreter: ragged and
    empty sequences, lengths inside and past a block, several splits, against the float64 reference."""
    decode_config(block_n=block_n)
    q, k, v, kw = make_case(_seed(f"fp8-wide-{block_n}"), dtype="bfloat16", hq=8, hkv=2, dqk=128,
                            lens=(0, 1, 300, 700), fp8="tensor")
    for splits in (None, 3):
        check_decode(q, k, v, kw, dict(causal=True), num_splits=splits, floor=1e-3)
        plan = decode_plan(q, k, v, kw, dict(causal=True), num_splits=splits)
        assert decode_constexpr([plan], "BLOCK_N") == {block_n}
        assert decode_constexpr([plan], "V_PAIRS") == decode_constexpr([plan], "K_PAIRS") == {True}


def test_torch_fp8_pairs_float16_queries():
    """float16 queries take the column-pair path too (no bf16 -> f16 rescaling of q)."""
    spec, options, splits, _ = FP8_PAIR_CASES["hnd-paged16-dv40-sq3"]
    q, k, v, kw = make_case(_seed("pairs-f16"), dtype="float16", **spec)
    check_decode(q, k, v, kw, options, kv_layout="HND", num_splits=splits, floor=1e-3)


def test_jax_fp8_pairs_match_torch_bitwise():
    ja = _japi()
    spec, options, splits, _ = FP8_PAIR_CASES["hnd-paged16-dv40-sq3"]
    q, k, v, kw = make_case(_seed("v-pairs"), dtype="bfloat16", **spec)
    out, lse = tapi.decode_attention(q, k, v, kv_layout="HND", num_splits=splits, **kw, **options, return_lse=True)
    jkw = {n: torch_to_jax(a) for n, a in kw.items()}
    jout, jlse = jax.jit(lambda q, k, v, jkw: ja.decode_attention(q, k, v, kv_layout="HND", num_splits=splits,
                                                                  **jkw, **options, return_lse=True))(
        torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), jkw)
    np.testing.assert_array_equal(np64(jout), np64(out))
    np.testing.assert_array_equal(np64(jlse), np64(lse))


@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_torch_fp8_cache_must_start_on_a_pair(which):
    """CUDA kernels take cache views as they are: one whose first byte is off a 2-byte boundary (strides even)
    is refused, naming the cache (checked here on the plan; end to end in test_decode_gpu). On CPU views are
    copied into plain buffers first, so the same view works and gives the copy's result."""
    from flashbridge.core_kernels import INTERPRETER
    from flashbridge.core_kernels.decode.plan import check_decode_args, plan_decode
    from flashbridge.torch_api.decode import _check_pairs_base

    g = torch.Generator().manual_seed(12)
    base = torch.randn(1, 64, 2, 68, generator=g).to(torch.float8_e4m3fn)
    q = torch.randn(1, 1, 4, 64, generator=g).to(torch.bfloat16)
    lens = torch.tensor([50], dtype=torch.int32)
    aligned, odd = base[..., 4:68], base[..., 3:67]
    caches = {"k_cache": aligned, "v_cache": aligned, which: odd}
    out = tapi.decode_attention(q, caches["k_cache"], caches["v_cache"], cache_seqlens=lens)
    copies = {n: t.contiguous() for n, t in caches.items()}
    assert torch.equal(out, tapi.decode_attention(q, copies["k_cache"], copies["v_cache"], cache_seqlens=lens))
    shape, options, _ = check_decode_args(q=((1, 1, 4, 64), "bfloat16"), k_cache=((1, 64, 2, 64), "float8_e4m3fn"),
                                          v_cache=((1, 64, 2, 64), "float8_e4m3fn"), cache_seqlens=((1,), "int32"))
    plan = plan_decode(shape, options, target=INTERPRETER, strides={n: base.stride()[:3] for n in caches})
    assert decode_constexpr([plan], "K_PAIRS") == decode_constexpr([plan], "V_PAIRS") == {True}

    def check(k, v):
        _check_pairs_base(plan, {"k_cache": k}, {"v_cache": v})

    with pytest.raises(ValueError, match=f"{which}: an FP8 cache must start on a 2-byte boundary"):
        check(caches["k_cache"], caches["v_cache"])
    check(base[..., 2:66], base[..., 2:66])


def test_torch_unused_table_entries_are_not_checked():
    args = _paged()
    args["block_table"] = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)  # seq 0 (3 rows) uses one page
    q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
    out = tapi.decode_attention(q, k, v, **args)
    assert torch.isfinite(out).all()


def test_torch_rejected_append_writes_nothing():
    b = _base()
    k, v = b["k_cache"].clone(), b["v_cache"].clone()
    with pytest.raises(ValueError, match="new tokens"):
        tapi.append_kv_cache(k, v, _t(2, 2, 2, 8), _t(2, 2, 2, 8), cache_seqlens=_i(3, 16))
    assert torch.equal(k, b["k_cache"]) and torch.equal(v, b["v_cache"])


# ------------------------------------------------------------------------------------------------- JAX

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _japi():
    from flashbridge.jax_api import decode as jdecode
    return jdecode


def _no_donation_warning():
    """Silences JAX's warning about donated buffers it could not reuse (the CPU backend reuses none)."""
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    return stack




@pytest.mark.parametrize("name", ["hnd-contig-gqa4-sq3", "all", "mla-576-512"])
def test_jax_decode_under_jit_matches_torch_bitwise(name):
    ja = _japi()
    spec, options, splits = CASES[name]
    layout = spec.get("layout", "NHD")
    q, k, v, kw = make_case(_seed(name), **spec)
    out, lse = tapi.decode_attention(q, k, v, kv_layout=layout, num_splits=splits, **kw, **options, return_lse=True)
    jkw = {n: torch_to_jax(a) for n, a in kw.items()}

    @jax.jit
    def f(q, k, v, jkw):
        return ja.decode_attention(q, k, v, kv_layout=layout, num_splits=splits, **jkw, **options, return_lse=True)

    jout, jlse = f(torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), jkw)
    np.testing.assert_array_equal(np64(jout), np64(out))
    np.testing.assert_array_equal(np64(jlse), np64(lse))


def test_cross_framework_parity_bf16_merge_cascade():
    ja = _japi()
    spec, shared_len, options = CASCADE_CASES["paged-hnd-sinks-softcap"]
    q, k, v, kw = make_case(9, **dict(spec, dtype="bfloat16"))
    sk, sv = (x.to(torch.bfloat16) for x in _shared(10, spec, shared_len))
    jkw = {n: torch_to_jax(a) for n, a in kw.items()}
    t = tapi.cascade_attention(q, sk, sv, k, v, kv_layout="HND", **kw, **options, return_lse=True)
    j = ja.cascade_attention(*(torch_to_jax(x) for x in (q, sk, sv, k, v)), kv_layout="HND", **jkw, **options,
                             return_lse=True)
    for a, b in zip(j, t):
        np.testing.assert_array_equal(np64(a), np64(b))
    d = tapi.decode_attention(q, k, v, kv_layout="HND", **kw, **options, num_splits=3, return_lse=True)
    jd = ja.decode_attention(torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), kv_layout="HND", **jkw, **options, num_splits=3,
                             return_lse=True)
    for a, b in zip(jd, d):
        np.testing.assert_array_equal(np64(a), np64(b))
    outs, lses = torch.stack([t[0], d[0]]), torch.stack([t[1], d[1]]).transpose(-1, -2).contiguous()
    tm = tapi.merge_attention_states(outs, lses)
    jm = ja.merge_attention_states(torch_to_jax(outs), torch_to_jax(lses))
    for a, b in zip(jm, tm):
        np.testing.assert_array_equal(np64(a), np64(b))


@pytest.mark.parametrize("name", ["paged16-hnd-bf16", "paged64-nhd-fp8-head"])
def test_jax_append_jit_donated_then_decode(name):
    ja = _japi()
    case = APPEND_CASES[name]
    layout = case["layout"]
    q, k, v, k_new, v_new, after, before = _append_inputs(name, case)
    extra = {n: torch_to_jax(before[n]) for n in ("block_table", "k_scale", "v_scale") if n in before}

    def step(kc, vc, kn, vn, lens):
        kc, vc = ja.append_kv_cache(kc, vc, kn, vn, cache_seqlens=lens, kv_layout=layout, **extra)
        out = ja.decode_attention(q_j, kc, vc, cache_seqlens=lens + kn.shape[1], kv_layout=layout, num_splits=2,
                                  **extra)
        return kc, vc, out

    q_j = torch_to_jax(q)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    with _no_donation_warning():
        jk, jv, jout = jitted(torch_to_jax(k), torch_to_jax(v), torch_to_jax(k_new), torch_to_jax(v_new), torch_to_jax(before["cache_seqlens"]))
    kc, vc = k.clone(), v.clone()
    tapi.append_kv_cache(kc, vc, k_new, v_new, cache_seqlens=before["cache_seqlens"], kv_layout=layout,
                         **{n: before[n] for n in ("block_table", "k_scale", "v_scale") if n in before})
    out = tapi.decode_attention(q, kc, vc, kv_layout=layout, **after, num_splits=2)
    np.testing.assert_array_equal(np64(jout), np64(out))
    for a, b in ((jk, kc), (jv, vc)):
        if b.dtype == torch.float8_e4m3fn:
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), b.view(torch.uint8).numpy())
        else:
            np.testing.assert_array_equal(np64(a), np64(b))


def test_jax_generation_loop_in_scan_matches_torch_bitwise():
    """The JAX generation loop in one jitted call (:func:`run_generation_loops`) equals, bit for bit, the same
    steps run one by one in torch: outputs, lengths and the cache."""
    g = torch.Generator().manual_seed(_seed("scan-loop"))
    steps, b, s_max, hkv, hq, d = 3, 2, 64, 2, 4, 16
    k, v = (torch.randn(b, s_max, hkv, d, generator=g) for _ in range(2))
    qs = torch.randn(steps, b, 1, hq, d, generator=g)
    k_new, v_new = (torch.randn(steps, b, 1, hkv, d, generator=g) for _ in range(2))
    lens = torch.tensor([5, 20], dtype=torch.int32)
    (jk, jv, jlens, jouts), (kc, vc, tlens, outs) = run_generation_loops(k, v, lens, qs, k_new, v_new, num_splits=2)
    np.testing.assert_array_equal(np.asarray(jlens), tlens.numpy())
    np.testing.assert_array_equal(np64(jouts), np64(outs))
    np.testing.assert_array_equal(np64(jk), np64(kc))
    np.testing.assert_array_equal(np64(jv), np64(vc))
    # the steps saw their own tokens: the last step's output differs from a decode without the appends
    stale = tapi.decode_attention(qs[-1], k, v, cache_seqlens=lens + steps, num_splits=2)
    assert not torch.equal(stale, outs[-1])


def test_jax_bad_inputs():
    ja = _japi()
    q, k = jnp.ones((2, 1, 4, 8)), jnp.ones((2, 16, 2, 8))
    lens = jnp.array([3, 16], jnp.int32)
    with pytest.raises(ValueError, match="multiple"):
        ja.decode_attention(jnp.ones((2, 1, 3, 8)), k, k, cache_seqlens=lens)
    with pytest.raises(TypeError, match="cache_seqlens: must be int32"):
        ja.decode_attention(q, k, k, cache_seqlens=lens.astype(jnp.float32))
    with pytest.raises(ValueError, match="cache_seqlens: required"):
        ja.decode_attention(q, k, k, cache_seqlens=None)
    with pytest.raises(ValueError, match="holds 16"):
        ja.decode_attention(q, k, k, cache_seqlens=jnp.array([3, 17], jnp.int32))
    with pytest.raises(ValueError, match="kv_layout"):
        ja.decode_attention(q, k, k, cache_seqlens=lens, kv_layout="nhd")
    with pytest.raises(ValueError, match=r"block_table: entry \[0, 0\] = 9"):
        ja.decode_attention(q, jnp.ones((4, 8, 2, 8)), jnp.ones((4, 8, 2, 8)), cache_seqlens=lens,
                            block_table=jnp.array([[9, 0], [1, 2]], jnp.int32))
    with pytest.raises(ValueError, match="lses: expected shape"):
        ja.merge_attention_states(jnp.ones((2, 3, 8)), jnp.ones((2, 4)))
    with pytest.raises(ValueError, match="new tokens"):
        ja.append_kv_cache(k, k, jnp.ones((2, 2, 2, 8)), jnp.ones((2, 2, 2, 8)), cache_seqlens=lens)
    with pytest.raises(TypeError, match="k_cache: expected a jax.Array"):
        ja.decode_attention(q, [1], k, cache_seqlens=lens)


# ------------------------------------------------------------------------- compile parity (sm_90 on CPU)

def _decode_plans():
    """Representative plans: contiguous / paged, bf16 / fp8 caches, split and single, cascade, merge, append."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.decode import plan as P
    h200 = Target(interpret=False, num_sms=132)
    plans = []
    for cache_dtype, paged, layout, splits in (
            ("bfloat16", False, "NHD", None), ("bfloat16", True, "HND", 1), ("float8_e4m3fn", True, "NHD", 4)):
        kshape = (512, 64, 8, 128) if paged else (4, 8192, 8, 128)
        if layout == "HND":
            kshape = (kshape[0], kshape[2], kshape[1], kshape[3])
        fp8 = cache_dtype == "float8_e4m3fn"
        scales = dict(k_scale=((8,), "float32"), v_scale=((8,), "float32")) if fp8 else {}
        shape, options, _ = P.check_decode_args(
            q=((4, 1, 32, 128), "bfloat16"), k_cache=(kshape, cache_dtype), v_cache=(kshape, cache_dtype),
            cache_seqlens=((4,), "int32"), block_table=((4, 128), "int32") if paged else None, kv_layout=layout,
            sinks=((32,), "float32"), **scales)
        plans.append((f"decode {cache_dtype} {layout} paged={paged}",
                      P.plan_decode(shape, options, target=h200, num_splits=splits), cache_dtype))
        append = P.check_append_args(k_cache=(kshape, cache_dtype), v_cache=(kshape, cache_dtype),
                                     k_new=((4, 3, 8, 128), "bfloat16"), v_new=((4, 3, 8, 128), "bfloat16"),
                                     cache_seqlens=((4,), "int32"), block_table=((4, 128), "int32") if paged else None,
                                     kv_layout=layout, **scales)
        plans.append((f"append {cache_dtype} {layout} paged={paged}", P.plan_append(append, target=h200), cache_dtype))
    shape, shared_len, options, _ = P.check_cascade_args(
        q=((32, 1, 32, 128), "bfloat16"), shared_k=((4096, 8, 128), "bfloat16"), shared_v=((4096, 8, 128), "bfloat16"),
        k_cache=((512, 64, 8, 128), "bfloat16"), v_cache=((512, 64, 8, 128), "bfloat16"), cache_seqlens=((32,), "int32"),
        block_table=((32, 16), "int32"))
    plans.append(("cascade", P.plan_cascade(shape, shared_len, options, target=h200), "bfloat16"))
    plans.append(("merge", P.plan_merge(3, 4096, 128, "bfloat16", target=h200), "bfloat16"))
    return plans


# 6: the cascade plan, whose kernels (decode over the shared prefix and the paged rest, the merge) the other
# plans compile too; the slowest compile of the list
@pytest.mark.parametrize("index", [*range(6), pytest.param(6, marks=pytest.mark.slow), 7])
def test_decode_kernels_compile_identically_and_vectorised(index):
    # torch (Triton's launcher) and JAX (jax-triton) must compile the same PTX, with 16-byte loads of the cache
    name, plan, cache_dtype = _decode_plans()[index]
    dtypes = {"q": "bfloat16", "k_cache": cache_dtype, "v_cache": cache_dtype, "shared_k": "bfloat16",
              "shared_v": "bfloat16", "cache_seqlens": "int32", "block_table": "int32", "sinks": "float32",
              "k_scale": "float32", "v_scale": "float32", "k_new": "bfloat16", "v_new": "bfloat16",
              "outs": "bfloat16", "lses": "float32", "out": "bfloat16", "lse": "float32"}
    dtypes.update({s.name: s.dtype for s in plan.buffers})
    for launch in plan.launches:
        ptx = assert_same_ptx(launch, dtypes)
        if launch.kernel.endswith("decode_fwd_kernel"):
            assert vector_loads(ptx) > 0, f"{name}: no 16-byte loads of the cache"
            if cache_dtype == "float8_e4m3fn":
                # the FP8 V tile reaches p @ V as column pairs through ldmatrix.trans, widened in registers
                # (load_e4m3_pairs), not byte by byte from shared memory (that halved FP8 decode's rate per byte)
                assert "ld.shared.b8" not in ptx and "ld.shared.u8" not in ptx, f"{name}: byte reads of V"
                assert "ldmatrix.sync.aligned.m8n8.x4.trans" in ptx, f"{name}: V not read with ldmatrix.trans"
                assert "cvt.rn.f16x2.e4m3x2" in ptx and "prmt.b32" in ptx, f"{name}: V not widened as pairs"
                # and K as column pairs against q's even / odd columns (Triton's own widening of K left ptxas
                # rebuilding q's operand registers for every MMA)
                assert launch.constexpr_dict()["K_PAIRS"], f"{name}: K not read as column pairs"
            assert_wgmma_pipelined(ptx, name)  # no wgmma here (16-row tiles): a cheap guard all the same


# cache kinds of the split-count properties: (FP8, page size or None for a contiguous cache)
_SPLIT_KINDS = {"bf16": (False, None), "fp8": (True, None), "bf16-paged16": (False, 16), "bf16-paged64": (False, 64),
                "bf16-paged256": (False, 256), "fp8-paged64": (True, 64), "fp8-paged128": (True, 128)}


@pytest.mark.parametrize("kind", list(_SPLIT_KINDS))
def test_automatic_split_count_on_the_h200(kind):
    """choose_num_splits on a 132-SM GPU over batches (1 to 600), kv heads (1, 8), rows (1 to 32), cache spans
    (64 to 128K keys) and head dims (64 to 256), as properties rather than a table of chosen counts:

    * 1 <= count <= MAX_AUTO_SPLITS, and each split gets at least 4 key tiles of the longest span;
    * the SMs are busy: without a fixed number of programs per SM, (programs without splits) x count reaches
      one program per SM unless the span or MAX_AUTO_SPLITS caps the count; with a fixed number (tiles made
      for a batch that leaves SMs idle) no second wave starts, and below a merge round one more split would
      start one;
    * no splits once the batch alone gives every SM four programs;
    * counts above a merge round are whole rounds (16 states) or, on paged / narrow FP8 tiles, powers of two;
    * 256-key FP8 tiles only where every split gets FP8_WIDE_SPLIT_KEYS keys; tiles for a fixed number of
      programs per SM only where batch x kv heads leaves SMs idle, never for a tile the caller chose."""
    import itertools

    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.decode import plan as P

    sms = 132
    h200 = Target(interpret=False, num_sms=sms)
    fp8, page_size = _SPLIT_KINDS[kind]
    step = P.MERGE_STATES_PER_STEP
    for batch, heads_kv, rows, span, head_dim in itertools.product(
            (1, 2, 3, 5, 8, 16, 17, 32, 64, 132, 600), (1, 8), (1, 4, 16, 32),
            (64, 512, 1000, 4096, 16384, 65536, 131072), (64, 128, 256)):
        cache = P.CacheShape(layout="NHD", paged=page_size is not None, num_pages=1, page_size=page_size or span,
                             max_pages=-(-span // page_size) if page_size else 1, heads=heads_kv,
                             head_dim_k=head_dim, head_dim_v=head_dim, dtype=P.FP8_DTYPE if fp8 else "bfloat16")
        case = f"{kind} B={batch} Hkv={heads_kv} rows={rows} span={span} D={head_dim}"
        count = P.choose_num_splits(batch=batch, heads_kv=heads_kv, rows=rows, span=span, head_dim_qk=head_dim,
                                    head_dim_v=head_dim, target=h200, cache=cache)
        tiles = P.decode_tiles(rows, head_dim, head_dim, h200, None, cache=cache, batch_heads=batch * heads_kv,
                               span=span)
        base = batch * heads_kv * triton.cdiv(rows, tiles.block_m)  # programs without splits
        by_length = max(1, triton.cdiv(span, tiles.block_n) // 4)
        capped = count in (by_length, P.MAX_AUTO_SPLITS)
        gathered = page_size is not None or (fp8 and tiles.block_n < 128)
        per_sm = tiles.programs_per_sm
        assert 1 <= count <= min(by_length, P.MAX_AUTO_SPLITS), f"{case}: {count} splits"
        assert tiles.block_n in (16, 32, 64, 128, 256), f"{case}: {tiles.block_n}-key tiles"
        if base >= 4 * sms:
            assert count == 1, f"{case}: {count} splits of {base} programs"
        if per_sm:
            assert batch * heads_kv < sms, f"{case}: one-wave tiles for a batch that fills the SMs"
            assert count == 1 or base * count <= sms * per_sm, f"{case}: a second wave ({base} x {count})"
            if count < step and not capped:
                assert base * (count + 1) > sms * per_sm, f"{case}: {count} splits leave SMs idle"
        elif count > 1 and not capped:
            assert base * count >= sms, f"{case}: {base} x {count} programs leave SMs idle"
        if count > step and not gathered:
            assert count % step == 0, f"{case}: {count} splits are not whole merge rounds"
        if count > 1 and gathered and not per_sm:
            assert count & (count - 1) == 0, f"{case}: {count} splits"
        if tiles.block_n == 256:
            assert fp8 and span // count >= P.FP8_WIDE_SPLIT_KEYS, f"{case}: 256-key tiles, {count} splits"
    chosen = P.decode_tiles(4, 128, 128, h200, P.DecodeConfig(block_n=64), batch_heads=8)
    assert chosen.block_n == 64 and chosen.programs_per_sm == 0
