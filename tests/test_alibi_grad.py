"""The ALiBi slopes' gradient of flash_attention, both frameworks, on the CPU (Triton interpreter).

``dslope_h = -sum_ij dS_ij |i + Sk - Sq - j|``: computed by the dQ programs and summed per head in a fixed
order. Checked against the float64 reference (itself checked by finite differences in test_attention.py)
with the accuracy rule: error <= 2 x a naive float32 implementation's error + a floor.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge import masks
from flashbridge.reference import attention as ref
from flashbridge.torch_api import flash_attention
from helpers import assert_close, naive_masked_attention, np64, torch_to_jax

# name: (b, sq, sk, hq, hkv, d, slopes "heads" (Hq,) | "batch" (B, Hq), options, seqlens for packed input)
CASES = {
    "dense": (2, 17, 33, 2, 2, 16, "heads", dict(), None),
    "gqa-causal": (1, 40, 40, 4, 2, 16, "heads", dict(causal=True), None),
    "batched-window-softcap": (2, 33, 17, 2, 1, 32, "batch", dict(window_size=(5, 3), softcap=2.0), None),
    "varlen-causal": (None, None, None, 4, 1, 16, "heads", dict(causal=True), [(17, 23), (1, 9), (30, 30)]),
    "varlen-batched": (None, None, None, 2, 2, 16, "batch", dict(), [(20, 5), (9, 40)]),
}


def _inputs(case, seed=0):
    b, sq, sk, hq, hkv, d, kind, options, seqlens = case
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if seqlens is None:
        shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
    else:
        b = len(seqlens)
        cq = torch.tensor([0, *np.cumsum([s[0] for s in seqlens])], dtype=torch.int32)
        ck = torch.tensor([0, *np.cumsum([s[1] for s in seqlens])], dtype=torch.int32)
        shapes = ((int(cq[-1]), hq, d), (int(ck[-1]), hkv, d), (int(ck[-1]), hkv, d))
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(s[0] for s in seqlens),
                  max_seqlen_k=max(s[1] for s in seqlens))
    q, k, v = (torch.randn(s, generator=g) for s in shapes)
    slopes = torch.rand(hq if kind == "heads" else (b, hq), generator=g) * 0.4 + 0.05
    return q, k, v, slopes, kw, dict(options)


def _naive_dslopes(q, k, v, slopes, kw, options, dout):
    """The slopes' gradient of a plain float32 implementation (one sequence at a time for packed input)."""
    slopes = slopes.detach().clone().requires_grad_()
    window = options.get("window_size", (-1, -1))
    if "cu_seqlens_q" not in kw:
        seqs = [((i,), (i,), slopes if slopes.dim() == 1 else slopes[i]) for i in range(q.shape[0])]
    else:
        cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
        seqs = [((slice(cq[i], cq[i + 1]),), (slice(ck[i], ck[i + 1]),), slopes if slopes.dim() == 1 else slopes[i])
                for i in range(len(cq) - 1)]
    loss = 0.0
    for qs, ks, s in seqs:
        qq, kk, vv, do = q[qs][None], k[ks][None], v[ks][None], dout[qs][None]
        mask = ref.visible_mask(qq.shape[1], kk.shape[1], causal=options.get("causal", False), window_size=window)
        o = naive_masked_attention(qq, kk, vv, mask, softcap=options.get("softcap", 0.0), alibi=s)
        loss = loss + (o * do).sum()
    return torch.autograd.grad(loss, slopes)[0]


def _reference(q, k, v, slopes, kw, options, dout):
    ref_kw = {n: (t.numpy() if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    return ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), alibi_slopes=np64(slopes),
                                   return_dalibi=True, **ref_kw, **options)


@pytest.mark.parametrize("name", list(CASES))
def test_torch_slopes_gradient_matches_reference(name):
    q, k, v, slopes, kw, options = _inputs(CASES[name])
    q.requires_grad_()
    slopes.requires_grad_()
    out = flash_attention(q, k, v, alibi_slopes=slopes, **kw, **options)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    dq, dslopes = torch.autograd.grad(out, (q, slopes), dout)
    rq, _, _, _, rslopes = _reference(q.detach(), k, v, slopes.detach(), kw, options, dout)
    assert dslopes.shape == slopes.shape and dslopes.dtype == slopes.dtype
    assert_close(dslopes, rslopes, _naive_dslopes(q.detach(), k, v, slopes, kw, options, dout), name="dslopes")
    assert np.abs(np64(dq) - rq).max() <= 1e-4 * max(1.0, np.abs(rq).max())


def test_torch_slopes_without_grad_get_none_and_the_same_other_gradients():
    q, k, v, slopes, kw, options = _inputs(CASES["gqa-causal"])
    grads = []
    for wanted in (False, True):
        qq = q.clone().requires_grad_()
        s = slopes.clone().requires_grad_(wanted)
        out = flash_attention(qq, k, v, alibi_slopes=s, **options)
        out.sum().backward()
        assert (s.grad is not None) == wanted
        grads.append(qq.grad)
    assert torch.equal(grads[0], grads[1])


def test_torch_slopes_gradient_is_deterministic_and_the_same_with_two_launches():
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    q, k, v, slopes, kw, options = _inputs(CASES["batched-window-softcap"], seed=3)
    results = []
    for fused in (True, True, False):
        s = slopes.clone().requires_grad_()
        with configure(AttentionConfig(fused_backward=fused)):
            flash_attention(q, k, v, alibi_slopes=s, **options).square().sum().backward()
        results.append(s.grad)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_torch_slopes_gradient_with_a_block_mask():
    m = masks.longformer(63, 5, [0, 40], block_size=32)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 63, 2, 16, generator=g) for _ in range(3))
    slopes = (torch.rand(2, generator=g) * 0.3 + 0.05).requires_grad_()
    out = flash_attention(q, k, v, alibi_slopes=slopes, block_mask=m)
    dout = torch.randn(out.shape, generator=g)
    (dslopes,) = torch.autograd.grad(out, slopes, dout)
    dense = np.ascontiguousarray(m.to_dense())
    rslopes = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), alibi_slopes=np64(slopes), mask=dense,
                                      return_dalibi=True)[4]
    sn = slopes.detach().clone().requires_grad_()
    naive = torch.autograd.grad((naive_masked_attention(q, k, v, dense, alibi=sn) * dout).sum(), sn)[0]
    assert_close(dslopes, rslopes, naive, name="dslopes")


def test_torch_vmap_gives_each_example_its_slopes_gradient():
    q, k, v, slopes, kw, options = _inputs(CASES["gqa-causal"], seed=7)
    qs = torch.stack([q, 0.5 * q])

    def loss(q_, s_):
        return flash_attention(q_, k, v, alibi_slopes=s_, **options).sin().sum()

    batched = torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None))(qs, slopes)
    single = torch.stack([torch.func.grad(loss, argnums=1)(x, slopes) for x in qs])
    torch.testing.assert_close(batched, single, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------- JAX

def _jax():
    jax = pytest.importorskip("jax")
    from flashbridge import jax_api
    return jax, jax.numpy, jax_api


@pytest.mark.parametrize("name", ["gqa-causal", "batched-window-softcap", "varlen-causal"])
def test_jax_slopes_gradient_matches_reference_and_torch(name):
    jax, jnp, ja = _jax()
    q, k, v, slopes, kw, options = _inputs(CASES[name])
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(1))
    jkw = {n: torch_to_jax(t) for n, t in kw.items()}

    def loss(q_, s_):
        return jnp.sum(ja.flash_attention(q_, torch_to_jax(k), torch_to_jax(v), alibi_slopes=s_, **jkw, **options)
                       * torch_to_jax(dout))

    dq, dslopes = jax.jit(jax.grad(loss, argnums=(0, 1)))(torch_to_jax(q), torch_to_jax(slopes))
    rq, _, _, _, rslopes = _reference(q, k, v, slopes, kw, options, dout)
    assert_close(np.asarray(dslopes), rslopes, _naive_dslopes(q, k, v, slopes, kw, options, dout), name="dslopes")
    assert np.abs(np.asarray(dq) - rq).max() <= 1e-4 * max(1.0, np.abs(rq).max())
    # the same kernels through torch: the same bits
    s = slopes.clone().requires_grad_()
    (flash_attention(q, k, v, alibi_slopes=s, **kw, **options) * dout).sum().backward()
    assert np.array_equal(np.asarray(dslopes), s.grad.numpy())


def test_jax_slopes_gradient_with_a_block_mask_and_under_vmap():
    jax, jnp, ja = _jax()
    m = masks.causal(40, block_size=16)
    g = torch.Generator().manual_seed(9)
    q, k, v, dout = (torch.randn(1, 40, 2, 16, generator=g) for _ in range(4))
    slopes = torch.rand(2, generator=g) * 0.3 + 0.05
    jq, jk, jv, js, jdout = (torch_to_jax(t) for t in (q, k, v, slopes, dout))

    def loss(q_, s_):
        return jnp.sum(ja.flash_attention(q_, jk, jv, alibi_slopes=s_, block_mask=m) * jdout)

    got = jax.grad(loss, argnums=1)(jq, js)
    s = slopes.clone().requires_grad_()
    (flash_attention(q, k, v, alibi_slopes=s, block_mask=m) * dout).sum().backward()
    assert np.array_equal(np.asarray(got), s.grad.numpy())  # the same kernels: the same bits
    batched = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None))(jnp.stack([jq, 0.5 * jq]), js)
    single = np.stack([np.asarray(jax.grad(loss, argnums=1)(x, js)) for x in (jq, 0.5 * jq)])
    np.testing.assert_allclose(np.asarray(batched), single, rtol=1e-5, atol=1e-6)


def test_jax_slopes_not_differentiated_cost_no_slope_term():
    """Differentiating q alone plans a backward without the slopes' reduction (and without dlse when the
    lse is unused)."""
    jax, jnp, ja = _jax()
    from flashbridge.core_kernels.flash_attn import plan as plan_mod

    seen = []
    original = plan_mod.plan_attention_bwd

    def spy(*args, **kwargs):
        seen.append((kwargs.get("alibi_grad"), kwargs.get("has_dlse")))
        return original(*args, **kwargs)

    q, k, v, slopes, kw, options = _inputs(CASES["dense"])
    jq, jk, jv, js = (torch_to_jax(t) for t in (q, k, v, slopes))
    import flashbridge.jax_api.attention as jattn
    jattn.plan_attention_bwd, saved = spy, jattn.plan_attention_bwd
    try:
        jax.grad(lambda q_: jnp.sum(ja.flash_attention(q_, jk, jv, alibi_slopes=js)))(jq)
        jax.grad(lambda s_: jnp.sum(ja.flash_attention(jq, jk, jv, alibi_slopes=s_)))(js)
    finally:
        jattn.plan_attention_bwd = saved
    assert seen == [(None, False), ("float32", False)]
