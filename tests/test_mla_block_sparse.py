"""MLA with a block mask (``mla_attention(..., block_mask=...)``) on the CPU (Triton interpreter).

Every case runs forward and both gradients (q, kv) in torch against the float64 reference given the same mask
densely (``BlockMask.to_dense()``), under the flash-attn rule (error <= 2 x a naive same-dtype computation's
+ a floor); some also in JAX under jit, which must give the same bits. Masks: top-k key blocks per query
block (``from_blocks``, the MLA seed's pattern at a small size and a ragged per-sequence one), causal
(bottom-right, Sq below and above Sk), per-sequence documents, bits (``from_dense``), Longformer (a band
with both edges and global tokens). Query heads 1-4: a mask query block is ``q_block * H`` packed rows, so
H=3 runs 16-row tiles. Per-head masks, causal and indices with a mask are rejected.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge import masks
from flashbridge.reference import mla as ref
from helpers import assert_close, np64, torch_to_jax
from helpers import assert_lse_close as _check_lse, naive_mla as naive

tapi = pytest.importorskip("flashbridge.torch_api.mla")


def top_blocks(rng, n_q, n_k, k, batch=None):
    """bool (nQ, nK) (or (B, 1, nQ, nK)): k key blocks drawn per query block, as a top-k over random scores."""
    shape = (n_q, n_k) if batch is None else (batch, 1, n_q, n_k)
    top = rng.random(shape).argsort(-1)[..., :k]
    blocks = np.zeros(shape, bool)
    np.put_along_axis(blocks, top, True, -1)
    return blocks


def seed_mask(s=256, block=64, keep=2):
    """The seed's pattern at a small size: ``block``-token blocks, ``keep`` of ``s / block`` key blocks per
    query block (S=4096: 32 of 64)."""
    n = s // block
    return masks.from_blocks(top_blocks(np.random.default_rng(0), n, n, keep), seq_len_q=s, seq_len_k=s,
                             block_size=block)


# name: (mask builder, batch, heads, Dqk, Dv, dtype, softmax_scale, JAX parity)
CASES = {
    "seed-2-of-4-blocks-bf16": (seed_mask, 1, 1, 40, 32, torch.bfloat16, None, True),  # the seed: one head
    "top-blocks-per-seq-ragged-h3": (lambda: masks.from_blocks(top_blocks(np.random.default_rng(1), 3, 4, 2, 2),
                                                               seq_len_q=40, seq_len_k=50, block_size=16),
                                     2, 3, 24, 16, torch.float32, None, False),
    "causal-sq-below-sk": (lambda: masks.causal(24, 40, block_size=16), 1, 4, 24, 16, torch.float32, None, False),
    "causal-sq-above-sk-empty-rows": (lambda: masks.causal(40, 17, block_size=(16, 32)), 1, 2, 24, 16,
                                      torch.float32, 0.4, False),
    "document-per-seq": (lambda: masks.document([[10, 0, 20, 3], [17, 16]], block_size=16), 2, 2, 24, 16,
                         torch.float32, None, True),
    "from-dense-bits": (lambda: masks.from_dense(np.random.default_rng(2).random((33, 40)) < 0.4,
                                                 block_size=(16, 32)), 2, 1, 24, 24, torch.float32, None, True),
    "longformer-scale": (lambda: masks.longformer(40, 5, [0, 33], block_size=16), 1, 2, 24, 16, torch.float32,
                         -0.3, False),
}


def _inputs(name, b, sq, sk, h, dqk, dtype):
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    q = torch.randn(b, sq, h, dqk, generator=g).to(dtype)
    kv = torch.randn(b, sk, dqk, generator=g).to(dtype)
    dout = torch.randn(b, sq, h, dqk, generator=g)
    dlse = torch.randn(b, h, sq, generator=g)
    return q, kv, dout, dlse


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.thin(2)
def test_forward_and_gradients_match_the_reference(name):
    build, b, h, dqk, dv, dtype, scale, jax_parity = CASES[name]
    m = build()
    sq, sk = m.seq_len_q, m.seq_len_k
    dense = m.to_dense()[:, 0]  # (B|1, Sq, Sk)
    q, kv, dout, dlse = _inputs(name, b, sq, sk, h, dqk, dtype)
    dout = dout[..., :dv].to(dtype)
    tq, tkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = tapi.mla_attention(tq, tkv, head_dim_v=dv, softmax_scale=scale, block_mask=m, return_lse=True)
    finite_dlse = torch.where(torch.isfinite(lse), dlse, 0.0)
    dq, dkv = torch.autograd.grad((out, lse), (tq, tkv), (dout, finite_dlse))

    kw = dict(head_dim_v=dv, softmax_scale=scale, mask=dense)
    ro, rl = ref.mla_attention(np64(q), np64(kv), **kw)
    rdq, rdkv = ref.mla_attention_bwd(np64(dout), np64(q), np64(kv), dlse=np64(finite_dlse), **kw)
    nq, nkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    no, nl = naive(nq, nkv, **kw)
    ndq, ndkv = torch.autograd.grad((no, nl), (nq, nkv), (dout, torch.where(torch.isfinite(nl), dlse, 0.0)))
    floor = 1e-5 if dtype == torch.float32 else 1e-3
    assert out.dtype == dtype and tuple(out.shape) == ro.shape
    assert_close(out, ro, no, name="out", floor=floor)
    _check_lse(lse, rl, nl, floor=floor)
    empty = ~dense.any(-1)  # rows that see no key: out 0, lse -inf
    assert np.all(np64(out).transpose(0, 2, 1, 3)[np.broadcast_to(empty[:, None], lse.shape)] == 0)
    assert_close(dq, rdq, ndq, name="dq", floor=floor)
    assert_close(dkv, rdkv, ndkv, name="dkv", floor=floor)
    if jax_parity:
        _jax_parity(m, q, kv, dout, finite_dlse, dict(head_dim_v=dv, softmax_scale=scale), (out, lse, dq, dkv))


def _jax_parity(m, q, kv, dout, dlse, kw, want):
    """Under jit, the JAX front-end gives torch's bits: out, lse and both gradients (the mask a jit argument)."""
    jax = pytest.importorskip("jax")
    japi = pytest.importorskip("flashbridge.jax_api.mla")

    def f(q, kv, mask):
        return japi.mla_attention(q, kv, block_mask=mask, return_lse=True, **kw)

    (jo, jl), vjp = jax.vjp(jax.jit(f), torch_to_jax(q), torch_to_jax(kv), m)
    jdq, jdkv, _ = vjp((torch_to_jax(dout), torch_to_jax(dlse)))
    for got, expected in zip((jo, jl, jdq, jdkv), want):
        np.testing.assert_array_equal(np.asarray(got.astype("float32")), expected.detach().float().numpy())


def test_backward_is_deterministic():
    """Repeated backward passes give the same bits (the dKV parts are summed in a fixed order)."""
    m = seed_mask(64, 16)
    q, kv, dout, _ = _inputs("determinism", 1, 64, 64, 2, 24, torch.float32)
    grads = []
    for _ in range(2):
        tq, tkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = tapi.mla_attention(tq, tkv, head_dim_v=16, block_mask=m)
        grads.append(torch.autograd.grad(out, (tq, tkv), dout[..., :16]))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_jax_vmap_over_examples_with_their_own_masks():
    """vmap over (q, kv, mask): each example's mask (top-k blocks drawn per example, same shapes) folds into a
    per-sequence mask of one launch, and every example equals its own torch call."""
    jax = pytest.importorskip("jax")
    japi = pytest.importorskip("flashbridge.jax_api.mla")

    rng = np.random.default_rng(5)
    ms = [masks.from_blocks(top_blocks(rng, 2, 3, 1), seq_len_q=32, seq_len_k=48, block_size=16) for _ in range(2)]
    stacked = jax.tree_util.tree_map(lambda *a: jax.numpy.stack(a), *ms)
    q, kv, _, _ = _inputs("vmap", 2, 32, 48, 2, 24, torch.float32)
    out = jax.vmap(lambda q, kv, m: japi.mla_attention(q[None], kv[None], head_dim_v=16, block_mask=m)[0])(
        torch_to_jax(q), torch_to_jax(kv), stacked)
    for v in range(2):
        want = tapi.mla_attention(q[v:v + 1], kv[v:v + 1], head_dim_v=16, block_mask=ms[v])
        np.testing.assert_array_equal(np.asarray(out[v]), np64(want)[0])


# ------------------------------------------------------------------------------------------- rejections

def _bad(**override):
    g = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(2, 32, 2, 24, generator=g), kv=torch.randn(2, 48, 24, generator=g), head_dim_v=16,
                block_mask=masks.from_blocks(np.ones((2, 3), bool), seq_len_q=32, seq_len_k=48, block_size=16))
    args.update(override)
    return args


BAD = [
    ("per-head", _bad(block_mask=masks.from_blocks(np.ones((2, 2, 3), bool), seq_len_q=32, seq_len_k=48,
                                                    block_size=16)),
     ValueError, r"block_mask: a per-head mask \(head extent 2\) does not fit MLA: the query heads of a token"),
    ("per-head-across-batch", _bad(block_mask=masks.from_blocks(np.ones((2, 3, 2, 3), bool), seq_len_q=32,
                                                                seq_len_k=48, block_size=16)),
     ValueError, r"per-head mask \(head extent 3\)"),
    ("causal", _bad(causal=True), ValueError, "block_mask: causal does not combine with a block mask"),
    ("indices", _bad(indices=torch.zeros(2, 32, 4, dtype=torch.int32)), ValueError,
     "block_mask: one sparsity source at a time"),
    ("seq-lengths", _bad(block_mask=masks.causal(32, 40, block_size=16)), ValueError,
     r"block_mask: built for \(Sq, Sk\) = \(32, 40\)"),
    ("batch", _bad(block_mask=masks.from_blocks(np.ones((3, 1, 2, 3), bool), seq_len_q=32, seq_len_k=48,
                                                block_size=16)),
     ValueError, "block_mask: batch / head extents"),
    ("type", _bad(block_mask=np.ones((32, 48), bool)), TypeError,
     "block_mask: expected a flashbridge.masks.BlockMask, got ndarray"),
]


@pytest.mark.parametrize("name,args,error,match", BAD, ids=[c[0] for c in BAD])
def test_bad_masks_are_rejected_before_any_launch(name, args, error, match, monkeypatch):
    japi = pytest.importorskip("flashbridge.jax_api.mla")
    for api in (tapi, japi):
        monkeypatch.setattr(api, "execute", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(error, match=match):
        tapi.mla_attention(**args)
    jargs = {n: torch_to_jax(v) for n, v in args.items()}
    with pytest.raises(error, match=match):
        japi.mla_attention(**jargs)


# --------------------------------------------------------------------------------------- torch.library

def test_torch_ops_pass_opcheck_and_compile():
    """The block-mask ops pass torch.library's checks; torch.compile(fullgraph) gives the eager bits."""
    m = masks.causal(16, 32, block_size=16)
    q, kv, _, _ = _inputs("opcheck", 1, 16, 32, 1, 24, torch.float32)
    arrays = tapi.mask_tensors(m, "cpu")
    static = (16, 0.3, 16, 16, None, 0, 0, False)
    torch.library.opcheck(torch.ops.flashbridge.mla_block_mask_fwd.default, (q, kv, arrays, *static))
    out, lse = torch.ops.flashbridge.mla_block_mask_fwd(q, kv, arrays, *static)
    torch.library.opcheck(torch.ops.flashbridge.mla_block_mask_bwd.default,
                          (torch.randn_like(out), q, kv, out, lse, None, arrays, *static))

    def f(q, kv):
        return tapi.mla_attention(q, kv, head_dim_v=16, block_mask=m)

    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(q, kv), f(q, kv))
