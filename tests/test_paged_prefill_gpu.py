"""flash_attention with keys from a paged cache (``block_table`` / ``seqused_k``) on a CUDA GPU at serving
sizes (bf16 / fp16, Hq=32, Hkv=8), skipped without a GPU.

Reference: attention computed plainly in float64 on the GPU over the gathered keys (``helpers.naive_torch``);
the naive same-dtype implementation sets the tolerance (error <= 2 x its error + a floor). Every slot that
holds no used key is NaN, so a read of one shows in the output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_close, make_paged_prefill_case, naive_torch, torch_to_jax

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flashbridge.torch_api.attention import flash_attention  # noqa: E402

LENS_Q = (512, 1, 77, 300)
USED = (1536, 1000, 77, 3001)


def _case(page_size, dtype="bfloat16", d=128, packed_q=True):
    lens_q = LENS_Q if packed_q else (64,) * 4
    return make_paged_prefill_case(page_size * 7 + d, lens_q=lens_q, used=USED, hq=32, hkv=8, dqk=d,
                                   page_size=page_size, spare_pages=9, dtype=dtype, device="cuda",
                                   packed_q=packed_q)


def _kwargs(case):
    return dict(block_table=case["block_table"], seqused_k=case["seqused_k"], cu_seqlens_q=case["cu_seqlens_q"],
                max_seqlen_q=case["max_seqlen_q"])


def _plain(case, dtype, **options):
    q = case["q"] if case["cu_seqlens_q"] is not None else case["q"].flatten(0, 1)
    out, lse = naive_torch(q.to(dtype), case["k"].to(dtype), case["v"].to(dtype),
                           cu_seqlens_q=case["cu_seqlens_q_ref"], cu_seqlens_k=case["cu_seqlens_k"], **options)
    return out.reshape(*case["q"].shape[:-1], out.shape[-1]), lse


@pytest.mark.parametrize("page_size", [16, 64, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_paged_prefill_matches_reference(page_size, causal, dtype):
    case = _case(page_size, dtype)
    out, lse = flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=causal, return_lse=True,
                               **_kwargs(case))
    assert not torch.isnan(out).any()
    ref, ref_lse = _plain(case, torch.float64, causal=causal)
    naive, _ = _plain(case, case["q"].dtype, causal=causal)
    assert_close(out, ref, naive, floor=1e-3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], rtol=1e-4, atol=1e-4)


def test_paged_equals_contiguous_bits():
    """Pages of whole key tiles: the paged forward gives the contiguous forward's bits."""
    case = _case(256)
    paged = flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=True, **_kwargs(case))
    contiguous = flash_attention(case["q"], case["k"], case["v"], causal=True, cu_seqlens_q=case["cu_seqlens_q"],
                                 cu_seqlens_k=case["cu_seqlens_k"], max_seqlen_q=max(LENS_Q),
                                 max_seqlen_k=max(USED))
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=0)


def test_options_dense_queries_and_padded_cache():
    """Dense (B, Sq) queries, window + softcap + ALiBi + sinks; and seqused_k on a padded (B, S_max) cache."""
    case = _case(16, packed_q=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    options = dict(causal=True, window_size=(700, 0), softcap=20.0,
                   alibi_slopes=torch.rand(32, device="cuda", generator=g) * 0.01,
                   sinks=torch.randn(32, device="cuda", generator=g))
    out = flash_attention(case["q"], case["k_cache"], case["v_cache"], block_table=case["block_table"],
                          seqused_k=case["seqused_k"], **options)
    ref, _ = _plain(case, torch.float64, **options)
    naive, _ = _plain(case, torch.bfloat16, **options)
    assert_close(out, ref, naive, floor=1e-3)
    s_max = max(USED) + 5
    k_pad = case["k"].new_full((4, s_max, 8, 128), float("nan"))
    v_pad = k_pad.clone()
    cu = case["cu_seqlens_k"].tolist()
    for b in range(4):
        k_pad[b, :cu[b + 1] - cu[b]] = case["k"][cu[b]:cu[b + 1]]
        v_pad[b, :cu[b + 1] - cu[b]] = case["v"][cu[b]:cu[b + 1]]
    padded = flash_attention(case["q"], k_pad, v_pad, seqused_k=case["seqused_k"], **options)
    assert_close(padded, ref, naive, floor=1e-3)


def test_jax_matches_torch_bits():
    jax = pytest.importorskip("jax")
    from flashbridge.jax_api.attention import flash_attention as jfa
    case = _case(16)
    out, lse = flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=True, return_lse=True,
                               **_kwargs(case))
    j = {n: torch_to_jax(t) for n, t in _kwargs(case).items()}
    jout, jlse = jax.jit(lambda q, k, v, t, u, cu: jfa(q, k, v, causal=True, return_lse=True, block_table=t,
                                                       seqused_k=u, cu_seqlens_q=cu,
                                                       max_seqlen_q=j["max_seqlen_q"]))(
        torch_to_jax(case["q"]), torch_to_jax(case["k_cache"]), torch_to_jax(case["v_cache"]), j["block_table"],
        j["seqused_k"], j["cu_seqlens_q"])
    np.testing.assert_array_equal(np.asarray(jout.astype(jax.numpy.float32)), out.float().cpu().numpy())
    np.testing.assert_array_equal(np.asarray(jlse), lse.cpu().numpy())


def test_torch_compile_fullgraph():
    case = _case(64)
    fn = torch.compile(lambda q, k, v, t, u, cu: flash_attention(q, k, v, causal=True, block_table=t, seqused_k=u,
                                                                 cu_seqlens_q=cu, max_seqlen_q=max(LENS_Q)),
                       fullgraph=True)
    out = fn(case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["seqused_k"],
             case["cu_seqlens_q"])
    eager = flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=True, **_kwargs(case))
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
