"""flash_attention with keys from a cache (``block_table`` / ``seqused_k``) on the CPU (Triton interpreter),
both front-ends, against the float64 reference on the gathered keys.

Caches are small but adversarial: shuffled pages drawn from a pool with spare pages, tables wider than
needed (entries -1), odd lengths, used counts below the pages' capacity, and every slot that holds no used
key set to NaN, so that a read of one would show in the output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashbridge.reference.attention import flash_attention as ref_attention
from helpers import assert_close, make_paged_prefill_case, naive_torch, np64, torch_to_jax

torch_api = pytest.importorskip("flashbridge.torch_api.attention")


def _reference(case, **options):
    """(out, lse) float64 on the gathered keys, lse in q's layout ((Hq, total_q) packed, else (B, Hq, Sq))."""
    kw = dict(cu_seqlens_q=case["cu_seqlens_q_ref"].numpy(), cu_seqlens_k=case["cu_seqlens_k"].numpy(),
              max_seqlen_q=int(max(np.diff(case["cu_seqlens_q_ref"].numpy()))),
              max_seqlen_k=max(1, int(max(np.diff(case["cu_seqlens_k"].numpy())))))
    q = case["q"] if case["cu_seqlens_q"] is not None else case["q"].flatten(0, 1)
    out, lse = ref_attention(np64(q), np64(case["k"]), np64(case["v"]), **kw, **{
        n: (np64(v) if isinstance(v, torch.Tensor) else v) for n, v in options.items()})
    if case["cu_seqlens_q"] is None:
        b, sq = case["q"].shape[:2]
        out = out.reshape(b, sq, *out.shape[1:])
        lse = lse.reshape(lse.shape[0], b, sq).transpose(1, 0, 2)
    return out, lse


def _naive(case, **options):
    q = case["q"] if case["cu_seqlens_q"] is not None else case["q"].flatten(0, 1)
    out, _ = naive_torch(q, case["k"], case["v"], cu_seqlens_q=case["cu_seqlens_q_ref"],
                         cu_seqlens_k=case["cu_seqlens_k"], **options)
    return out.reshape(*case["q"].shape[:-1], out.shape[-1])


def _paged_kwargs(case):
    return dict(block_table=case["block_table"], seqused_k=case["seqused_k"], cu_seqlens_q=case["cu_seqlens_q"],
                max_seqlen_q=case["max_seqlen_q"])


def _check(case, out, lse, **options):
    ref_out, ref_lse = _reference(case, **options)
    assert_close(out, ref_out, _naive(case, **options), name="out")
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np64(lse)), finite)
    np.testing.assert_allclose(np64(lse)[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- torch

@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 384])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.thin(4)
def test_paged_matches_reference(page_size, causal):
    case = make_paged_prefill_case(100 + page_size, page_size=page_size, lens_q=(5, 17, 1, 9),
                                   used=(70, 17, 3, 130) if page_size >= 64 else (40, 17, 3, 30))
    out, lse = torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=causal,
                                         return_lse=True, **_paged_kwargs(case))
    assert not torch.isnan(out).any()  # no NaN slot (unused rows, spare pages) leaked
    _check(case, out, lse, causal=causal)


def test_paged_gqa_options_bf16():
    """GQA 6/2, Dqk != Dv, window + softcap + ALiBi + sinks, bfloat16, dense (B, Sq) queries."""
    case = make_paged_prefill_case(7, lens_q=(6, 6), used=(37, 6), hq=6, hkv=2, dqk=48, dv=32, page_size=16,
                                   dtype="bfloat16", packed_q=False)
    g = torch.Generator().manual_seed(1)
    options = dict(causal=True, window_size=(9, 0), softcap=3.0, alibi_slopes=torch.rand(6, generator=g) * 0.3,
                   sinks=torch.randn(6, generator=g))
    out, lse = torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], return_lse=True,
                                         block_table=case["block_table"], seqused_k=case["seqused_k"], **options)
    assert out.shape == (2, 6, 6, 32) and lse.shape == (2, 6, 6)
    _check(case, out.float(), lse, **options)


def test_rows_that_see_no_key():
    """Causal with fewer used keys than queries (and a sequence with none): rows before the first key
    output 0 and lse -inf, as flash_attention's."""
    case = make_paged_prefill_case(3, lens_q=(9, 4), used=(4, 0), page_size=8)
    out, lse = torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=True,
                                         return_lse=True, **_paged_kwargs(case))
    assert (out[:5] == 0).all() and torch.isneginf(lse[:, :5]).all() and (out[9:] == 0).all()
    _check(case, out, lse, causal=True)


def test_seqused_k_on_padded_cache():
    """seqused_k without block_table: a padded (B, S_max, Hkv, D) cache beside packed queries, beside dense
    queries, and packed keys with cu_seqlens_k; keys past the used count are NaN and never read."""
    case = make_paged_prefill_case(11, lens_q=(3, 3, 3), used=(21, 3, 50), page_size=64, extra_capacity=0)
    b, s_max = 3, 64
    k_pad = torch.full((b, s_max, 2, 32), float("nan"))
    v_pad = torch.full((b, s_max, 2, 32), float("nan"))
    cu_k = case["cu_seqlens_k"].tolist()
    for i in range(b):
        k_pad[i, :cu_k[i + 1] - cu_k[i]] = case["k"][cu_k[i]:cu_k[i + 1]]
        v_pad[i, :cu_k[i + 1] - cu_k[i]] = case["v"][cu_k[i]:cu_k[i + 1]]
    out, lse = torch_api.flash_attention(case["q"], k_pad, v_pad, causal=True, return_lse=True,
                                         seqused_k=case["seqused_k"], cu_seqlens_q=case["cu_seqlens_q"],
                                         max_seqlen_q=3)
    _check(case, out, lse, causal=True)
    dense = dict(case, q=case["q"].reshape(b, 3, 4, 32), cu_seqlens_q=None)
    out_d, lse_d = torch_api.flash_attention(dense["q"], k_pad, v_pad, causal=True, return_lse=True,
                                             seqused_k=case["seqused_k"])
    torch.testing.assert_close(out_d.flatten(0, 1), out, rtol=0, atol=0)
    _check(dense, out_d, lse_d, causal=True)
    # packed keys with cu_seqlens_k, each sequence using fewer keys than it holds (the rest NaN)
    k_packed, v_packed = k_pad.flatten(0, 1), v_pad.flatten(0, 1)
    cu_full = torch.arange(0, (b + 1) * s_max, s_max, dtype=torch.int32)
    out_p = torch_api.flash_attention(case["q"], k_packed, v_packed, causal=True, seqused_k=case["seqused_k"],
                                      cu_seqlens_q=case["cu_seqlens_q"], cu_seqlens_k=cu_full, max_seqlen_q=3,
                                      max_seqlen_k=s_max)
    torch.testing.assert_close(out_p, out, rtol=0, atol=0)


def test_paged_equals_contiguous_bits():
    """The same keys paged (one tile per page) and contiguous give the same bits."""
    case = make_paged_prefill_case(5, lens_q=(7, 2), used=(70, 64), page_size=64, extra_capacity=0)
    paged = torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=True,
                                      **_paged_kwargs(case))
    contiguous = torch_api.flash_attention(case["q"], case["k"], case["v"], causal=True,
                                           cu_seqlens_q=case["cu_seqlens_q"], cu_seqlens_k=case["cu_seqlens_k"],
                                           max_seqlen_q=7, max_seqlen_k=70)
    torch.testing.assert_close(paged, contiguous, rtol=0, atol=0)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), page_size=st.sampled_from([4, 16, 32, 64]),
       lens=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 80)), min_size=1, max_size=3),
       causal=st.booleans())
def test_paged_property(seed, page_size, lens, causal):
    case = make_paged_prefill_case(seed, page_size=page_size, lens_q=tuple(a for a, _ in lens),
                                   used=tuple(u for _, u in lens), hq=2, hkv=1, dqk=16)
    out, lse = torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=causal,
                                         return_lse=True, **_paged_kwargs(case))
    _check(case, out, lse, causal=causal)


def test_torch_compile_fullgraph_and_opcheck():
    case = make_paged_prefill_case(8, lens_q=(3, 6), used=(19, 6), page_size=8)

    def f(q, k, v, table, used, cu):
        return torch_api.flash_attention(q, k, v, causal=True, block_table=table, seqused_k=used, cu_seqlens_q=cu,
                                         max_seqlen_q=6)

    args = (case["q"], case["k_cache"], case["v_cache"], case["block_table"], case["seqused_k"],
            case["cu_seqlens_q"])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), f(*args), rtol=0, atol=0)
    op_args = (*args[:5], None, None, args[5], None, 6, None, 0.25, True, None, 0, 0.0)
    torch.library.opcheck(torch.ops.flashbridge.flash_attn_cache_fwd.default, op_args)


# ---------------------------------------------------------------------------------------------- errors

def _errors_case():
    return make_paged_prefill_case(1, lens_q=(2, 3), used=(5, 9), page_size=8)


@pytest.mark.parametrize("change, error, match", [
    (lambda c: c.update(block_table=c["block_table"].long()), TypeError, "block_table: must be int32"),
    (lambda c: c.update(seqused_k=None), ValueError, "seqused_k: required with block_table"),
    (lambda c: c.update(seqused_k=c["seqused_k"][:1]), ValueError, "seqused_k: expected shape"),
    (lambda c: c.update(block_table=c["block_table"][:1]), ValueError, "block_table: expected shape"),
    (lambda c: c.update(k_cache=c["k_cache"][:, :6], v_cache=c["v_cache"][:, :6]), ValueError, "page size 6"),
    (lambda c: c.update(v_cache=c["v_cache"][:-1]), ValueError, "k, v: pages must agree"),
    (lambda c: c.update(cu_seqlens_k=c["cu_seqlens_q"]), ValueError, "cu_seqlens_k: not with block_table"),
])
def test_errors_name_the_argument(change, error, match):
    case = _errors_case()
    case["cu_seqlens_k"] = None
    change(case)
    with pytest.raises(error, match=match):
        torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], block_table=case["block_table"],
                                  seqused_k=case["seqused_k"], cu_seqlens_q=case["cu_seqlens_q"],
                                  cu_seqlens_k=case["cu_seqlens_k"], max_seqlen_q=3)


def test_gradient_raises_torch():
    case = _errors_case()
    q = case["q"].clone().requires_grad_()
    out = torch_api.flash_attention(q, case["k_cache"], case["v_cache"], **_paged_kwargs(case))
    with pytest.raises(NotImplementedError, match="block_table / seqused_k has no backward"):
        out.sum().backward()



@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("extra, match", [({"dropout_p": 0.1, "seed": 1}, "dropout_p: not with block_table"),
                                          ({"dropout_p": "0.1"}, "dropout_p: not with block_table")])
def test_cache_refuses_dropout_in_both_frameworks(framework, extra, match):
    case = _errors_case()
    if framework == "torch":
        fa, conv = torch_api.flash_attention, (lambda t: t)
    else:
        from flashbridge.jax_api import flash_attention as fa
        conv = torch_to_jax
    with pytest.raises(ValueError, match=match):
        fa(conv(case["q"]), conv(case["k_cache"]), conv(case["v_cache"]),
           **{n: conv(t) for n, t in _paged_kwargs(case).items()}, **extra)


# ------------------------------------------------------------------------------------------------- JAX

jax = pytest.importorskip("jax")


def _jax_kwargs(case):
    return {n: torch_to_jax(t) for n, t in _paged_kwargs(case).items()}


@pytest.mark.parametrize("page_size, causal", [(16, True), (64, False)])
def test_jax_matches_torch_bits(page_size, causal):
    from flashbridge.jax_api import attention as ja
    case = make_paged_prefill_case(20 + page_size, page_size=page_size, lens_q=(5, 17, 1),
                                   used=(70, 17, 3) if page_size == 64 else (40, 17, 3))
    out, lse = torch_api.flash_attention(case["q"], case["k_cache"], case["v_cache"], causal=causal,
                                         return_lse=True, **_paged_kwargs(case))
    jk = _jax_kwargs(case)
    fn = jax.jit(lambda q, k, v, table, used, cu: ja.flash_attention(
        q, k, v, causal=causal, return_lse=True, block_table=table, seqused_k=used, cu_seqlens_q=cu,
        max_seqlen_q=jk["max_seqlen_q"]))
    jout, jlse = fn(torch_to_jax(case["q"]), torch_to_jax(case["k_cache"]), torch_to_jax(case["v_cache"]),
                    jk["block_table"], jk["seqused_k"], jk["cu_seqlens_q"])
    np.testing.assert_array_equal(np.asarray(jout), out.numpy())
    np.testing.assert_array_equal(np.asarray(jlse), lse.numpy())
    _check(case, np.asarray(jout), np.asarray(jlse), causal=causal)


def test_jax_seqused_k_padded_cache():
    from flashbridge.jax_api import attention as ja
    case = make_paged_prefill_case(12, lens_q=(4, 2), used=(13, 2), page_size=32, extra_capacity=0)
    k_pad = case["k_cache"].new_full((2, 32, 2, 32), float("nan"))
    v_pad = k_pad.clone()
    k_pad[0, :13], v_pad[0, :13] = case["k"][:13], case["v"][:13]
    k_pad[1, :2], v_pad[1, :2] = case["k"][13:], case["v"][13:]
    kw = dict(causal=True, seqused_k=case["seqused_k"], cu_seqlens_q=case["cu_seqlens_q"], max_seqlen_q=4)
    out = torch_api.flash_attention(case["q"], k_pad, v_pad, **kw)
    jout = ja.flash_attention(torch_to_jax(case["q"]), torch_to_jax(k_pad), torch_to_jax(v_pad),
                              **{n: torch_to_jax(t) for n, t in kw.items()})
    np.testing.assert_array_equal(np.asarray(jout), out.numpy())
    _check(case, out, torch_api.flash_attention(case["q"], k_pad, v_pad, return_lse=True, **kw)[1], causal=True)


def test_gradient_raises_jax():
    from flashbridge.jax_api import attention as ja
    case = _errors_case()
    jk = _jax_kwargs(case)
    k, v = torch_to_jax(case["k_cache"]), torch_to_jax(case["v_cache"])
    with pytest.raises(NotImplementedError, match="block_table / seqused_k has no backward"):
        jax.grad(lambda q: ja.flash_attention(q, k, v, **jk).sum())(torch_to_jax(case["q"]))
    with pytest.raises(ValueError, match="page size 6"):
        ja.flash_attention(torch_to_jax(case["q"]), k[:, :6], v[:, :6], **jk)
