"""MLA on a CUDA GPU at the benchmark's shapes (H=128 query heads, one 576-dim latent head, values its
first 512 dims, bf16, paged 64), skipped without a GPU.

Reference: the absorbed attention computed plainly in float64 on the GPU over the gathered (dequantised)
cache (``helpers.naive_mla``, which computes what flashbridge.reference.mla does); the naive bf16 computation
sets the tolerance: error <= 2 x its error + a floor.

``python tests/test_mla_gpu.py`` runs ragged paged decode (dense, sparse, FP8), prefill forward and backward
(dense, sparse, block masks) in both frameworks, for ``compute-sanitizer --tool memcheck``.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from helpers import assert_close, np64, torch_to_jax
from helpers import mla_sparse_indices as _sparse_indices, naive_mla as naive

pytestmark = pytest.mark.gpu

H, DQK, DV = 128, 576, 512


def _rng(seed):
    return np.random.default_rng(seed)


def paged_case(seed, *, b, lens, heads=H, sq=1, page=64, fp8=False, topk=0, dtype=torch.bfloat16):
    """A paged latent cache on the GPU: shuffled pages, -1 in unused table entries; top-k indices of visible
    positions (-1 padded), an FP8 scale."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    s_max = max(lens)
    max_pages = -(-s_max // page)
    n_pages = b * max_pages + 5
    cache = torch.randn(n_pages, page, DQK, device="cuda", generator=g).to(dtype)
    kw = {"cache_seqlens": torch.tensor(lens, dtype=torch.int32, device="cuda"), "head_dim_v": DV}
    if fp8:
        kw["kv_scale"] = torch.tensor(0.75, device="cuda")
        cache = (cache.float() / 0.75).to(torch.float8_e4m3fn)
    perm = torch.randperm(n_pages, device="cuda", generator=g)
    table = torch.full((b, max_pages), -1, dtype=torch.int32, device="cuda")
    for i, length in enumerate(lens):
        used = -(-length // page)
        table[i, :used] = perm[i * max_pages:i * max_pages + used].to(torch.int32)
    kw["block_table"] = table
    if topk:
        idx = np.full((b, sq, topk), -1, np.int32)
        rng = _rng(seed)
        for i, length in enumerate(lens):
            for t in range(sq):
                visible = max(length - sq + t + 1, 0)
                chosen = rng.permutation(visible)[:topk]
                idx[i, t, :len(chosen)] = chosen
                idx[i, t] = rng.permutation(idx[i, t])
        kw["indices"] = torch.from_numpy(idx).cuda()
    q = torch.randn(b, sq, heads, DQK, device="cuda", generator=g).to(dtype)
    return q, cache, kw


def gathered(cache, kw, dtype):
    """The sequences' latent rows (B, S_max, Dqk) in ``dtype`` (dequantised), zero past each length."""
    lens = kw["cache_seqlens"].tolist()
    kv = torch.zeros(len(lens), max(lens), DQK, device="cuda", dtype=torch.float64)
    for b, length in enumerate(lens):
        j = torch.arange(length, device="cuda")
        rows = cache[kw["block_table"][b, j // cache.shape[1]].long(), j % cache.shape[1]].double()
        kv[b, :length] = rows * (kw["kv_scale"].double() if "kv_scale" in kw else 1.0)
    return kv.to(dtype)


def check_decode(q, cache, kw, *, api=None, floor=1e-3):
    from flashbridge.torch_api.mla import mla_decode

    out, lse = (api or mla_decode)(q, cache, **kw, return_lse=True)
    lens = kw["cache_seqlens"].tolist()
    idx = kw.get("indices")
    ro, rl = naive(q.double(), gathered(cache, kw, torch.float64), head_dim_v=DV, causal=True, indices=idx,
                   lengths=lens)
    no, _ = naive(q, gathered(cache, kw, q.dtype), head_dim_v=DV, causal=True, indices=idx, lengths=lens)
    assert_close(out, np64(ro), no, name="out", floor=floor)
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(torch.where(finite, lse.double(), 0.0), torch.where(finite, rl, 0.0), atol=2e-3,
                               rtol=1e-4)
    return out, lse


DECODE = {
    "h128-b8-ragged": dict(b=8, lens=(4096, 1, 4000, 65, 2048, 63, 3000, 4095)),
    "h128-sq2": dict(b=4, lens=(4096, 17, 3001, 64), sq=2),
    "h128-sparse-2048": dict(b=4, lens=(32768, 5000, 2047, 9000), topk=2048),
    "h128-fp8": dict(b=4, lens=(4096, 100, 3000, 2049), fp8=True),
    "h16-ragged": dict(b=8, lens=(32768, 1, 4000, 65, 20000, 63, 3000, 4095), heads=16),
    "h16-fp8": dict(b=8, lens=(32768, 1, 4000, 65, 20000, 63, 3000, 4095), heads=16, fp8=True),
    "h16-sparse": dict(b=4, lens=(32768, 5000, 2047, 9000), heads=16, topk=2048),
    "h16-fp8-sparse": dict(b=4, lens=(32768, 5000, 2047, 9000), heads=16, topk=2048, fp8=True),
    "h128-fp8-f16q-sq2": dict(b=4, lens=(4096, 100, 3000, 2049), sq=2, fp8=True, dtype=torch.float16),
}


@pytest.mark.parametrize("name", list(DECODE))
def test_gpu_mla_decode(name):
    q, cache, kw = paged_case(zlib.crc32(name.encode()), **DECODE[name])
    check_decode(q, cache, kw)


@pytest.mark.parametrize("name", ["h128-b8-ragged", "h128-sparse-2048", "h16-fp8", "h128-fp8-f16q-sq2"])
def test_gpu_jax_decode_matches_torch_bitwise(name):
    import jax

    from flashbridge.jax_api.mla import mla_decode as jax_decode
    from flashbridge.torch_api.mla import mla_decode

    q, cache, kw = paged_case(zlib.crc32(name.encode()), **DECODE[name])
    dv = kw.pop("head_dim_v")
    want = mla_decode(q, cache, **kw, head_dim_v=dv, return_lse=True)
    got = jax.jit(lambda q, c, kw: jax_decode(q, c, **kw, head_dim_v=dv, return_lse=True))(
        jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(cache), {n: jax.dlpack.from_dlpack(v) for n, v in kw.items()})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a).astype(np.float64), np64(b))


@pytest.mark.parametrize("name", ["h16-fp8", "h128-fp8", "h16-fp8-sparse"])
def test_gpu_fp8_column_pairs_agree_with_the_widened_tiles(name):
    """The default FP8 path (the latent read once as 16-bit column pairs, PAIRS) and the widened one
    (MLAConfig(fp8_pairs=False): tiles widened in registers, V read twice) give the same attention up to
    the order of the f16 dots' sums."""
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.mla.plan import MLAConfig
    from flashbridge.torch_api.mla import mla_decode

    q, cache, kw = paged_case(zlib.crc32(name.encode()) + 1, **DECODE[name])
    pairs = mla_decode(q, cache, **kw)
    with configure(MLAConfig(fp8_pairs=False)):
        widened = mla_decode(q, cache, **kw)
    torch.testing.assert_close(pairs.float(), widened.float(), atol=2e-3, rtol=2e-2)


def test_gpu_fp8_latent_off_a_pair_is_refused():
    """A CUDA FP8 latent view 1 byte past a 2-byte boundary is refused before any launch; a copy runs."""
    from flashbridge.torch_api.mla import mla_decode

    q, cache, kw = paged_case(9, b=2, lens=(300, 64), heads=16, fp8=True)
    flat = torch.empty(cache.numel() + 1, dtype=cache.dtype, device="cuda")
    odd = flat[1:].view(cache.shape)
    odd.copy_(cache)
    with pytest.raises(ValueError, match="kv_cache: an FP8 cache must start on a 2-byte boundary"):
        mla_decode(q, odd, **kw)
    assert torch.equal(mla_decode(q, odd.clone(), **kw), mla_decode(q, cache, **kw))


def test_gpu_decode_attention_routes_latent_views():
    """decode_attention with one KV head and v_cache = k_cache[..., :512] runs the MLA kernel: the same
    bits as mla_decode."""
    from flashbridge.torch_api.decode import decode_attention
    from flashbridge.torch_api.mla import mla_decode

    q, cache, kw = paged_case(7, b=4, lens=(4096, 9, 2000, 64))
    kw.pop("head_dim_v")
    k = cache.unsqueeze(2)
    got = decode_attention(q, k, k[..., :DV], **kw)
    assert torch.equal(got, mla_decode(q, cache, **kw, head_dim_v=DV))


def test_gpu_decode_cuda_graph_and_compile():
    from flashbridge.torch_api.mla import mla_decode

    q, cache, kw = paged_case(8, b=4, lens=(4096, 9, 2000, 64))
    eager = mla_decode(q, cache, **kw)
    compiled = torch.compile(lambda q: mla_decode(q, cache, **kw), fullgraph=True)
    torch.testing.assert_close(compiled(q), eager, atol=0, rtol=0)
    graph = torch.cuda.CUDAGraph()
    static_q = q.clone()
    mla_decode(static_q, cache, **kw)
    with torch.cuda.graph(graph):
        out = mla_decode(static_q, cache, **kw)
    static_q.copy_(q * 0.5)
    graph.replay()
    torch.testing.assert_close(out, mla_decode(q * 0.5, cache, **kw), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["h128-sparse-2048", "h128-fp8", "h16-sparse"])
@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_gpu_decode_captures_in_a_cuda_graph(name, mode):
    """Sparse / FP8 / paged decode captured in a CUDA graph (both capture modes: global refuses any host
    sync or pageable copy on any thread) replays the eager bits, with new queries and new lengths."""
    from flashbridge.torch_api.mla import mla_decode

    q, cache, kw = paged_case(zlib.crc32(name.encode()) + 1, **DECODE[name])
    static_q, lens = q.clone(), kw.pop("cache_seqlens")
    static_lens = lens.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) on a side stream, as capture requires
        mla_decode(static_q, cache, cache_seqlens=static_lens, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        out = mla_decode(static_q, cache, cache_seqlens=static_lens, **kw)
    shorter = torch.clamp(lens - 3, min=1)
    static_q.copy_(q * 0.5)
    static_lens.copy_(shorter)
    graph.replay()
    torch.testing.assert_close(out, mla_decode(q * 0.5, cache, cache_seqlens=shorter, **kw), atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ prefill

def prefill_case(seed, *, s=1024, heads=H, topk=0, causal=True, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, s, heads, DQK, device="cuda", generator=g).to(dtype)
    kv = torch.randn(1, s, DQK, device="cuda", generator=g).to(dtype)
    idx = None
    if topk:
        idx = torch.from_numpy(_sparse_indices(_rng(seed), 1, s, s, topk, causal=causal, pad=0.0)).cuda()
    return q, kv, dict(head_dim_v=DV, causal=causal, indices=idx)


@pytest.mark.parametrize("topk", [0, 256])
def test_gpu_mla_attention_forward_backward(topk):
    from flashbridge.torch_api.mla import mla_attention

    q, kv, kw = prefill_case(topk, topk=topk)
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out, lse = mla_attention(q, kv, **kw, return_lse=True)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    results = {}
    for dtype in (torch.float64, q.dtype):
        rq, rkv = q.detach().to(dtype).requires_grad_(), kv.detach().to(dtype).requires_grad_()
        ro, rl = naive(rq, rkv, **kw)
        results[dtype] = (ro, rl, *torch.autograd.grad(ro, (rq, rkv), dout.to(dtype)))
    ref, nai = results[torch.float64], results[q.dtype]
    assert_close(out, np64(ref[0]), nai[0], name="out", floor=1e-3)
    torch.testing.assert_close(lse.double(), ref[1], atol=2e-3, rtol=1e-4)
    assert_close(dq, np64(ref[2]), nai[2], name="dq", floor=1e-3)
    assert_close(dkv, np64(ref[3]), nai[3], name="dkv", floor=1e-3)
    dq2, dkv2 = torch.autograd.grad(mla_attention(q, kv, **kw), (q, kv), dout)
    assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2)  # deterministic


def test_gpu_jax_prefill_matches_torch_bitwise():
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.mla import mla_attention as jax_mla
    from flashbridge.torch_api.mla import mla_attention

    q, kv, kw = prefill_case(3, s=512, topk=128)
    idx = kw.pop("indices")
    tq, tkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    tout = mla_attention(tq, tkv, **kw, indices=idx)
    tout.float().sum().backward()

    def loss(q, kv, idx):
        out = jax_mla(q, kv, **kw, indices=idx)
        return jnp.sum(out.astype(jnp.float32)), out

    (dq, dkv), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        *(jax.dlpack.from_dlpack(t) for t in (q, kv, idx)))
    for a, b in ((out, tout), (dq, tq.grad), (dkv, tkv.grad)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), b.detach().float().cpu().numpy())


# -------------------------------------------------------------------------------------------- block masks

def _top_blocks(seed, n, keep, batch=None):
    """bool (n, n) (or (B, 1, n, n)): ``keep`` key blocks drawn per query block (a fixed seed)."""
    shape = (n, n) if batch is None else (batch, 1, n, n)
    top = _rng(seed).random(shape).argsort(-1)[..., :keep]
    blocks = np.zeros(shape, bool)
    np.put_along_axis(blocks, top, True, -1)
    return blocks


BLOCK_MASKS = {  # name: (mask builder, heads): the seed's pattern (64-token blocks, half the key blocks)
    "seed-s4096-h1": (lambda: _masks().from_blocks(_top_blocks(0, 64, 32), seq_len_q=4096, seq_len_k=4096,
                                                   block_size=64), 1),
    "top-blocks-s1024-h128": (lambda: _masks().from_blocks(_top_blocks(1, 16, 8), seq_len_q=1024, seq_len_k=1024,
                                                           block_size=64), H),
    "causal-s1000-h128": (lambda: _masks().causal(1000, block_size=128), H),
    "document-s1024-h64": (lambda: _masks().document([300, 500, 224], block_size=64), 64),
}


def _masks():
    from flashbridge import masks
    return masks


@pytest.mark.parametrize("name", list(BLOCK_MASKS))
def test_gpu_mla_block_mask_forward_backward(name):
    """bf16 against float64 with the mask given densely (forward, dq, dkv), and a deterministic backward."""
    from flashbridge.torch_api.mla import mla_attention

    build, heads = BLOCK_MASKS[name]
    m = build()
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(name.encode()))
    s = m.seq_len_q
    q = torch.randn(1, s, heads, DQK, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    kv = torch.randn(1, s, DQK, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    out, lse = mla_attention(q, kv, head_dim_v=DV, block_mask=m, return_lse=True)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    kw = dict(head_dim_v=DV, mask=m.to_dense()[:, 0])
    results = {}
    for dtype in (torch.float64, q.dtype):
        rq, rkv = q.detach().to(dtype).requires_grad_(), kv.detach().to(dtype).requires_grad_()
        ro, rl = naive(rq, rkv, **kw)
        results[dtype] = (ro, rl, *torch.autograd.grad(ro, (rq, rkv), dout.to(dtype)))
    ref, nai = results[torch.float64], results[q.dtype]
    assert_close(out, np64(ref[0]), nai[0], name="out", floor=1e-3)
    finite = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(torch.where(finite, lse.double(), 0.0), torch.where(finite, ref[1], 0.0), atol=2e-3,
                               rtol=1e-4)
    assert_close(dq, np64(ref[2]), nai[2], name="dq", floor=1e-3)
    assert_close(dkv, np64(ref[3]), nai[3], name="dkv", floor=1e-3)
    dq2, dkv2 = torch.autograd.grad(mla_attention(q, kv, head_dim_v=DV, block_mask=m), (q, kv), dout)
    assert torch.equal(dq, dq2) and torch.equal(dkv, dkv2)  # deterministic


def test_gpu_jax_block_mask_matches_torch_bitwise():
    """Per-sequence top-k blocks, B=2: forward and gradients under jit give torch's bits."""
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.mla import mla_attention as jax_mla
    from flashbridge.torch_api.mla import mla_attention

    m = _masks().from_blocks(_top_blocks(4, 8, 3, batch=2), seq_len_q=512, seq_len_k=512, block_size=64)
    g = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(2, 512, H, DQK, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(2, 512, DQK, device="cuda", generator=g).to(torch.bfloat16)
    tq, tkv = q.clone().requires_grad_(), kv.clone().requires_grad_()
    tout = mla_attention(tq, tkv, head_dim_v=DV, block_mask=m)
    tout.float().sum().backward()

    def loss(q, kv, m):
        out = jax_mla(q, kv, head_dim_v=DV, block_mask=m)
        return jnp.sum(out.astype(jnp.float32)), out

    (dq, dkv), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(kv), m)
    for a, b in ((out, tout), (dq, tq.grad), (dkv, tkv.grad)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), b.detach().float().cpu().numpy())


def test_gpu_modules_paths_agree():
    from flashbridge.torch_api.mla import MultiHeadLatentAttention

    torch.manual_seed(0)
    m = MultiHeadLatentAttention(1024, 16, 384, 512, 128, 64, 128).cuda()
    x = torch.randn(2, 64, 1024, device="cuda")
    want = m(x)
    cache = torch.zeros(2, 128, 576, device="cuda")
    got = m.decode(x, cache, torch.zeros(2, dtype=torch.int32, device="cuda"))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-3)


if __name__ == "__main__":  # one pass over each kernel for compute-sanitizer
    test_gpu_mla_decode("h128-sparse-2048")
    test_gpu_mla_decode("h16-fp8")
    test_gpu_mla_decode("h128-fp8")
    test_gpu_mla_attention_forward_backward(256)
    test_gpu_mla_attention_forward_backward(0)
    test_gpu_mla_block_mask_forward_backward("top-blocks-s1024-h128")
    test_gpu_mla_block_mask_forward_backward("document-s1024-h64")
    print("ok")
