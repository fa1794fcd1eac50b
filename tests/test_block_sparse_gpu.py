"""Block-sparse attention on a CUDA GPU in bf16 at moderate sizes (skipped without a GPU).

Reference: attention with the mask's dense form computed plainly in float64 on the GPU; the same in bf16
sets the tolerance (error <= 2 x its error + a small floor). torch and JAX must give the same bits.

``python tests/test_block_sparse_gpu.py`` runs ragged cases (lengths and masks not multiples of any block,
bits, tokens, per-head GQA lists, D=256's split dK/dV) forward and backward in both frameworks, for
``compute-sanitizer --tool memcheck``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge import masks
from helpers import assert_close, naive_masked_attention, np64, torch_to_jax

pytestmark = pytest.mark.gpu


def _doc_lengths(total, n, seed):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, total), n - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()


CASES = {
    # name: (mask builder, dict(b, hq, hkv, d, dv, sinks, softcap, alibi))
    "causal-d128": (lambda: masks.causal(2048), dict()),
    "causal-sq-ne-sk": (lambda: masks.causal(1000, 1537), dict(d=80)),
    "window-511": (lambda: masks.sliding_window(2048, 511), dict(hq=8, hkv=2)),
    "streaming": (lambda: masks.streaming(2000, 4, 300), dict(sinks=True, softcap=30.0)),
    "document": (lambda: masks.document(_doc_lengths(2048, 7, 0)), dict(b=2, alibi=True)),
    "document-per-batch": (lambda: masks.document([_doc_lengths(1500, 5, 1), _doc_lengths(1500, 3, 2)],
                                                  causal=False, block_size=64), dict(b=2, d=64)),
    "longformer": (lambda: masks.longformer(1900, 200, [0, 1, 2, 1000]), dict()),
    "bigbird": (lambda: masks.bigbird(2048, window_blocks=1, num_global_blocks=1, num_random_blocks=2, seed=0),
                dict(d=64)),
    "from-dense-per-head-gqa": (lambda: masks.from_dense(
        np.random.default_rng(3).random((4, 700, 900)) < 0.05, block_size=(64, 128)), dict(hq=4, hkv=2)),
    "top-k-blocks-64": (lambda: masks.from_blocks(np.random.default_rng(4).random((32, 32)) < 0.5,
                                                  seq_len_q=2048, seq_len_k=2048, block_size=64), dict()),
    "and-or-d256": (lambda: (masks.causal(1024) & masks.sliding_window(1024, 100, 0))
                    | masks.from_blocks(np.eye(8, dtype=bool), seq_len_q=1024, seq_len_k=1024),
                    dict(d=256, hq=4, hkv=1)),
}


def _inputs(seed, mask, *, b=1, hq=4, hkv=None, d=128, dv=None, sinks=False, softcap=0.0, alibi=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hkv, dv = hkv or hq, dv or d
    sq, sk = mask.seq_len_q, mask.seq_len_k
    q = torch.randn(b, sq, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, sk, hkv, dv, generator=g, device="cuda").to(torch.bfloat16)
    kw = {"softcap": softcap}
    if sinks:
        kw["sinks"] = torch.randn(hq, generator=g, device="cuda")
    if alibi:
        kw["alibi_slopes"] = torch.rand(hq, generator=g, device="cuda") * 0.05
    return q, k, v, kw


def _naive(q, k, v, kw, dense, dout, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    sinks = kw.get("sinks")
    if sinks is not None:
        leaves.append(sinks.detach().to(dtype if dtype == torch.float64 else torch.float32).requires_grad_(True))
    out = naive_masked_attention(*leaves[:3], dense, softcap=kw["softcap"], sinks=leaves[3] if sinks is not None
                                 else None, alibi=kw.get("alibi_slopes"))
    return out, torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves)


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_block_sparse_matches_reference(name):
    from flashbridge.torch_api import flash_attention

    build, spec = CASES[name]
    mask = build()
    q, k, v, kw = _inputs(0, mask, **spec)
    leaves = [t.requires_grad_(True) for t in (q, k, v)] + ([kw["sinks"].requires_grad_(True)] if "sinks" in kw
                                                             else [])
    out, lse = flash_attention(q, k, v, block_mask=mask, return_lse=True, **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    dense = torch.as_tensor(mask.to_dense(), device="cuda")
    r_out, r_grads = _naive(q, k, v, kw, dense, dout, torch.float64)
    n_out, n_grads = _naive(q, k, v, kw, dense, dout, torch.bfloat16)
    assert_close(out, r_out, n_out, name="out", floor=1e-3)
    for label, a, r, n in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads, n_grads):
        assert_close(a, r, n, name=label, floor=1e-3)
    sees_nothing = ~dense.expand(q.shape[0], q.shape[2], -1, -1).any(-1)  # (B, H, Sq)
    if "sinks" not in kw:
        assert torch.equal(torch.isinf(lse), sees_nothing) and (out.transpose(1, 2)[sees_nothing] == 0).all()


def test_gpu_block_sparse_deterministic_and_compiled():
    from flashbridge.torch_api import flash_attention

    mask = masks.streaming(2048, 4, 256) & masks.document(_doc_lengths(2048, 5, 3))
    q, k, v, _ = _inputs(1, mask, hq=8, hkv=2)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = flash_attention(q, k, v, block_mask=mask)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, leaves, dout)
    second = torch.autograd.grad(flash_attention(q, k, v, block_mask=mask), leaves, dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    compiled = torch.compile(lambda q, k, v, m: flash_attention(q, k, v, block_mask=m), fullgraph=True)
    c_out = compiled(q, k, v, mask)
    assert torch.equal(c_out, out)
    for a, b in zip(torch.autograd.grad(c_out, leaves, dout), first):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["causal-d128", "streaming", "document", "from-dense-per-head-gqa", "and-or-d256"])
def test_gpu_jax_matches_torch_bitwise(name):
    jax = pytest.importorskip("jax")
    if not jax.devices("gpu"):
        pytest.skip("JAX has no GPU backend")
    from flashbridge import jax_api
    from flashbridge.torch_api import flash_attention

    build, spec = CASES[name]
    mask = build()
    q, k, v, kw = _inputs(7, mask, **spec)
    leaves = [t.requires_grad_(True) for t in (q, k, v)] + ([kw["sinks"].requires_grad_(True)] if "sinks" in kw
                                                             else [])
    out = flash_attention(q, k, v, block_mask=mask, **kw)
    dout = torch.randn_like(out)
    tgrads = torch.autograd.grad(out, leaves, dout)
    jkw = {n: torch_to_jax(a) if isinstance(a, torch.Tensor) else a for n, a in kw.items()}
    sinks = jkw.pop("sinks", None)
    device_mask = jax_api.mask_to_device(mask)
    jout, vjp = jax.vjp(jax.jit(lambda q, k, v, s, m: jax_api.flash_attention(q, k, v, sinks=s, block_mask=m,
                                                                              **jkw)),
                        torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), sinks, device_mask)
    jgrads = vjp(torch_to_jax(dout))
    np.testing.assert_array_equal(np64(jout), np64(out))
    for a, b in zip(jgrads, tgrads):
        np.testing.assert_array_equal(np64(a), np64(b))


def _memcheck_case():
    """Ragged lengths and masks, bits, tokens, per-head GQA lists, D=256's split dK/dV: forward and backward
    in both frameworks (for compute-sanitizer)."""
    from flashbridge.torch_api import flash_attention

    for name in ("causal-sq-ne-sk", "streaming", "document-per-batch", "longformer", "from-dense-per-head-gqa",
                 "and-or-d256"):
        build, spec = CASES[name]
        mask = build()
        q, k, v, kw = _inputs(2, mask, **spec)
        for t in (q, k, v):
            t.requires_grad_(True)
        out = flash_attention(q, k, v, block_mask=mask, **kw)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(f"torch {name} forward + backward: ok")
    try:
        import jax
        from flashbridge import jax_api
    except ImportError:
        return
    build, spec = CASES["from-dense-per-head-gqa"]
    mask = build()
    q, k, v, _ = _inputs(3, mask, **spec)
    arrays = [torch_to_jax(t) for t in (q, k, v)]
    grads = jax.grad(lambda q, k, v: jax_api.flash_attention(q, k, v, block_mask=mask).astype(
        jax.numpy.float32).sum(), argnums=(0, 1, 2))(*arrays)
    jax.block_until_ready(grads)
    print("jax from-dense-per-head-gqa forward + backward: ok")


if __name__ == "__main__":
    _memcheck_case()
