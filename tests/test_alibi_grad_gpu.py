"""The ALiBi slopes' gradient on a CUDA GPU in bf16 at realistic sizes (skipped without a GPU).

Reference: the attention computed plainly in float64 on the GPU; the same plain computation in bf16 sets
the tolerance (error <= 2 x its error + a floor). Both frameworks must give the same bits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge import masks
from flashbridge.reference import attention as ref
from helpers import assert_close, naive_masked_attention, torch_to_jax

pytestmark = pytest.mark.gpu


def _naive_dslopes(q, k, v, slopes, dout, mask, dtype, seqs):
    s = slopes.detach().to(dtype).requires_grad_()
    loss = 0.0
    for rows, keys, b in seqs:
        qq, kk, vv = q[rows].to(dtype)[None], k[keys].to(dtype)[None], v[keys].to(dtype)[None]
        m = mask(qq.shape[1], kk.shape[1])
        o = naive_masked_attention(qq, kk, vv, m, alibi=s if s.dim() == 1 else s[b])
        loss = loss + (o.double() * dout[rows].double()[None]).sum()
    return torch.autograd.grad(loss, s)[0]


@pytest.mark.parametrize("case", [
    dict(b=2, sq=1024, hq=8, hkv=2, causal=True, batched=False),
    dict(b=2, sq=777, hq=4, hkv=4, causal=False, batched=True),
    dict(seqlens=[300, 1024, 17], hq=8, hkv=1, causal=True, batched=False),
], ids=["gqa-causal", "batched-slopes", "varlen"])
def test_slopes_gradient_bf16(case):
    from flashbridge.torch_api import flash_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = case["hq"], case["hkv"], 128
    kw = {}
    if "seqlens" in case:
        lens = case["seqlens"]
        total = sum(lens)
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        shapes = ((total, hq, d), (total, hkv, d))
        seqs = [(slice(int(cu[i]), int(cu[i + 1])), slice(int(cu[i]), int(cu[i + 1])), i) for i in range(len(lens))]
        n_seqs = len(lens)
    else:
        b, sq = case["b"], case["sq"]
        shapes = ((b, sq, hq, d), (b, sq, hkv, d))
        seqs = [((i,), (i,), i) for i in range(b)]
        n_seqs = b
    q = torch.randn(shapes[0], generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(shapes[1], generator=g, device="cuda").bfloat16() for _ in range(2))
    slopes = torch.rand((n_seqs, hq) if case["batched"] else (hq,), generator=g, device="cuda") * 0.1 + 0.01
    dout = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    group = hq // hkv
    kx, vx = (t.repeat_interleave(group, -2) for t in (k, v))

    def mask(sq, sk):
        return ref.visible_mask(sq, sk, causal=case["causal"])

    s = slopes.clone().requires_grad_()
    out = flash_attention(q, k, v, alibi_slopes=s, causal=case["causal"], **kw)
    (dslopes,) = torch.autograd.grad(out, s, dout)
    want = _naive_dslopes(q, kx, vx, slopes, dout, mask, torch.float64, seqs)
    naive = _naive_dslopes(q, kx, vx, slopes, dout, mask, torch.bfloat16, seqs)
    assert_close(dslopes, want, naive, name="dslopes", floor=1e-3)
    # deterministic: the same bits again
    s2 = slopes.clone().requires_grad_()
    (again,) = torch.autograd.grad(flash_attention(q, k, v, alibi_slopes=s2, causal=case["causal"], **kw), s2, dout)
    assert torch.equal(dslopes, again)
    # JAX: the same kernels, the same bits
    try:
        import jax
        import jax.numpy as jnp

        from flashbridge import jax_api
        from flashbridge.jax_api._runtime import _jax_triton
        _jax_triton()
    except ImportError:
        return
    jkw = {n: torch_to_jax(t) for n, t in kw.items()}
    jq, jk, jv, jdout = (torch_to_jax(t) for t in (q, k, v, dout))

    def loss(s_):
        o = jax_api.flash_attention(jq, jk, jv, alibi_slopes=s_, causal=case["causal"], **jkw)
        return jnp.sum(o.astype(jnp.float32) * jdout.astype(jnp.float32))

    got = jax.jit(jax.grad(loss))(torch_to_jax(slopes))
    assert np.array_equal(np.asarray(got), dslopes.cpu().numpy())


def test_slopes_gradient_with_a_block_mask_bf16():
    from flashbridge.torch_api import flash_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    m = masks.sliding_window(2048, 256, 0, block_size=128)
    q, k, v, dout = (torch.randn(1, 2048, 4, 64, generator=g, device="cuda").bfloat16() for _ in range(4))
    slopes = torch.rand(4, generator=g, device="cuda") * 0.05 + 0.01
    s = slopes.clone().requires_grad_()
    (dslopes,) = torch.autograd.grad(flash_attention(q, k, v, alibi_slopes=s, block_mask=m), s, dout)
    dense = torch.as_tensor(np.ascontiguousarray(m.to_dense()), device="cuda")
    seqs = [((0,), (0,), 0)]
    want = _naive_dslopes(q, k, v, slopes, dout, lambda *_: dense, torch.float64, seqs)
    naive = _naive_dslopes(q, k, v, slopes, dout, lambda *_: dense, torch.bfloat16, seqs)
    assert_close(dslopes, want, naive, name="dslopes", floor=1e-3)
