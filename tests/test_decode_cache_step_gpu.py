"""Left-padded caches and RoPE inside the KV-cache step on a CUDA GPU (bf16, Hq=32, Hkv=8, D=128), both
front-ends; skipped without a GPU.

Reference: float64 on the GPU over the real rows ``[cache_leftpad, cache_seqlens)`` (``helpers.naive_torch``
per sequence) with q rotated in float64; the naive bf16 implementation sets the tolerance. Exact properties:
leftpad decode is bitwise decode over the tokens moved to row 0; append + decode with the tables is bitwise
rotary_embedding, then the plain append and decode, for the keys, and agrees to rounding for the output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge.reference import rotary as rref
from helpers import assert_close, naive_torch, np64, torch_to_jax

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128


def _case(seed, *, b=4, sq=1, s_max=4096, lens=(4096, 3000, 1, 2500), pads=(100, 2999, 0, 1024)):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, HQ, D, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, s_max, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, s_max, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    return (q, k, v, torch.tensor(lens[:b], dtype=torch.int32, device="cuda"),
            torch.tensor(pads[:b], dtype=torch.int32, device="cuda"), g)


def _tables(rows, half):
    inv = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    theta = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(theta).float().cuda(), torch.sin(theta).float().cuda()


def _reference(q, k, v, lens, pads, *, causal=True, dtype=torch.float64, q_pos=None, cos=None, sin=None,
               interleaved=False):
    outs = []
    for b, (n, p) in enumerate(zip(lens.tolist(), pads.tolist())):
        qb = q[b:b + 1]
        if cos is not None:
            qb = torch.from_numpy(rref.rotary_embedding(np64(qb), np64(cos), np64(sin), interleaved=interleaved,
                                                        position_ids=q_pos[b:b + 1].cpu().numpy())).cuda()
        outs.append(naive_torch(qb.to(dtype), k[b:b + 1, p:n].to(dtype), v[b:b + 1, p:n].to(dtype),
                                causal=causal)[0])
    return torch.cat(outs)


def _shift_left(cache, lens, pads):
    out = torch.full_like(cache, float("nan"))
    for b, (n, p) in enumerate(zip(lens.tolist(), pads.tolist())):
        out[b, :n - p] = cache[b, p:n]
    return out


@pytest.mark.parametrize("sq,splits", [(1, None), (4, None), (1, 7)])
def test_gpu_leftpad(sq, splits):
    from flashbridge.torch_api import decode_attention

    q, k, v, lens, pads, _ = _case(sq * 10 + (splits or 0), sq=sq)
    out = decode_attention(q, k, v, cache_seqlens=lens, cache_leftpad=pads, num_splits=splits)
    assert_close(out, _reference(q, k, v, lens, pads), _reference(q, k, v, lens, pads, dtype=torch.bfloat16),
                 floor=1e-3)
    out2 = decode_attention(q, _shift_left(k, lens, pads), _shift_left(v, lens, pads), cache_seqlens=lens - pads,
                            num_splits=splits)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved,rot", [(False, 128), (True, 64)])
def test_gpu_rotary_append_then_decode(interleaved, rot):
    from flashbridge.torch_api import append_kv_cache, decode_attention, rotary_embedding

    sq = 2
    q, k, v, lens, pads, g = _case(7 + rot, sq=sq, lens=(4000, 2990, 1, 2500), pads=(100, 2000, 0, 1024))
    k_new = torch.randn(4, sq, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(4, sq, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    cos, sin = _tables(8192, rot // 2)
    rot_kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    k1, v1 = k.clone(), v.clone()
    append_kv_cache(k1, v1, k_new, v_new, cache_seqlens=lens, cache_leftpad=pads, **rot_kw)
    out = decode_attention(q, k1, v1, cache_seqlens=lens + sq, cache_leftpad=pads, **rot_kw)

    pos = (lens - pads).long()[:, None] + torch.arange(sq, device="cuda")[None, :]
    k_rot = rotary_embedding(k_new, cos, sin, interleaved=interleaved, position_ids=pos)
    k2, v2 = k.clone(), v.clone()
    append_kv_cache(k2, v2, k_rot, v_new, cache_seqlens=lens, cache_leftpad=pads)
    # the same rotation in two kernels: the compiler may contract x*cos - y*sin into an FMA in one and not
    # the other, which moves a rare element by one bf16 ulp
    torch.testing.assert_close(k1, k2, rtol=2**-7, atol=0)
    torch.testing.assert_close(v1, v2, rtol=0, atol=0)
    ref = _reference(q, k1, v1, lens + sq, pads, q_pos=pos, cos=cos, sin=sin, interleaved=interleaved)
    q_rot = rotary_embedding(q, cos, sin, interleaved=interleaved, position_ids=pos)
    naive = _reference(q_rot, k1, v1, lens + sq, pads, dtype=torch.bfloat16)
    assert_close(out, ref, naive, floor=1e-3)
    out2 = decode_attention(q_rot, k1, v1, cache_seqlens=lens + sq, cache_leftpad=pads)
    torch.testing.assert_close(out.float(), out2.float(), rtol=0, atol=2e-2)


def test_gpu_jax_matches_torch_bitwise():
    import jax

    from flashbridge import jax_api as ja
    from flashbridge import torch_api as ta

    sq = 2
    q, k, v, lens, pads, g = _case(5, sq=sq, lens=(4000, 2990, 1, 2500), pads=(100, 2000, 0, 1024))
    k_new = torch.randn(4, sq, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    v_new = torch.randn(4, sq, HKV, D, generator=g, device="cuda").to(torch.bfloat16)
    cos, sin = _tables(8192, 64)
    k1, v1 = k.clone(), v.clone()
    ta.append_kv_cache(k1, v1, k_new, v_new, cache_seqlens=lens, cache_leftpad=pads, rotary_cos=cos, rotary_sin=sin)
    out = ta.decode_attention(q, k1, v1, cache_seqlens=lens + sq, cache_leftpad=pads, rotary_cos=cos,
                              rotary_sin=sin, num_splits=5)

    @jax.jit
    def step(k, v, q, k_new, v_new, lens, pads, cos, sin):
        k, v = ja.append_kv_cache(k, v, k_new, v_new, cache_seqlens=lens, cache_leftpad=pads, rotary_cos=cos,
                                  rotary_sin=sin)
        return k, v, ja.decode_attention(q, k, v, cache_seqlens=lens + sq, cache_leftpad=pads, rotary_cos=cos,
                                         rotary_sin=sin, num_splits=5)

    J = torch_to_jax
    jk, jv, jout = step(J(k), J(v), J(q), J(k_new), J(v_new), J(lens), J(pads), J(cos), J(sin))
    np.testing.assert_array_equal(np64(jk), np64(k1))
    np.testing.assert_array_equal(np64(jout), np64(out))


def test_gpu_torch_compile_and_cuda_graph():
    from flashbridge.torch_api import decode_attention

    q, k, v, lens, pads, _ = _case(9)
    cos, sin = _tables(8192, 64)
    kw = dict(cache_seqlens=lens, cache_leftpad=pads, rotary_cos=cos, rotary_sin=sin, num_splits=4)
    eager = decode_attention(q, k, v, **kw)
    compiled = torch.compile(lambda q: decode_attention(q, k, v, **kw), fullgraph=True)(q)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    static_q = q.clone()
    decode_attention(static_q, k, v, **kw)  # warm-up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(static_q, k, v, **kw)
    graph.replay()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
