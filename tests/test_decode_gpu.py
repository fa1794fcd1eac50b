"""Flash-Decoding on a CUDA GPU at the benchmark sizes (bf16 cache, Hq=32, Hkv=8, D=128), skipped without a GPU.

Reference: the decode computed plainly in float64 on the GPU over the gathered (dequantised) cache
(``helpers.naive_torch`` per sequence, which is what flashbridge.reference.decode computes,
only faster at these sizes); the naive bf16 implementation sets the tolerance: error <= 2 x its error + a floor.

``python tests/test_decode_gpu.py`` runs ragged paged cases of every op in both frameworks, for
``compute-sanitizer --tool memcheck`` (tests/memcheck.py ``decode`` runs the same).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_close, naive_torch, np64, run_generation_loops
from helpers import make_decode_case as make_case

pytestmark = pytest.mark.gpu


def _cuda(q, k, v, kw):
    return q.cuda(), k.cuda(), v.cuda(), {n: t.cuda() for n, t in kw.items()}


def gather(cache, length, b, *, block_table=None, kv_layout="NHD", scale=None, dtype=torch.float64):
    """Rows 0 .. length - 1 of sequence b as (length, Hkv, D) in ``dtype``, dequantised."""
    if kv_layout == "HND":
        cache = cache.transpose(1, 2)
    if block_table is None:
        rows = cache[b, :length]
    else:
        j = torch.arange(length, device=cache.device)
        rows = cache[block_table[b, j // cache.shape[1]].long(), j % cache.shape[1]]
    rows = rows.to(torch.float64)
    if scale is not None:
        rows = rows * scale.to(torch.float64).reshape(-1)[None, :, None]
    return rows.to(dtype)


def run_reference(q, k, v, kw, options, *, kv_layout="NHD", dtype=torch.float64):
    outs, lses = [], []
    for i, length in enumerate(kw["cache_seqlens"].tolist()):
        kk = gather(k, length, i, block_table=kw.get("block_table"), kv_layout=kv_layout, scale=kw.get("k_scale"),
                    dtype=dtype)
        vv = gather(v, length, i, block_table=kw.get("block_table"), kv_layout=kv_layout, scale=kw.get("v_scale"),
                    dtype=dtype)
        extra = {}
        if "alibi_slopes" in kw:
            a = kw["alibi_slopes"]
            extra["alibi_slopes"] = a if a.dim() == 1 else a[i]
        if "sinks" in kw:
            extra["sinks"] = kw["sinks"].to(dtype if dtype == torch.float64 else torch.float32)
        o, l_ = naive_torch(q[i:i + 1].to(dtype), kk[None], vv[None], **extra, **options)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs), torch.cat(lses)


def check(q, k, v, kw, options, *, kv_layout="NHD", num_splits=None, floor=1e-3):
    from flashbridge.torch_api.decode import decode_attention
    out, lse = decode_attention(q, k, v, kv_layout=kv_layout, num_splits=num_splits, **kw, **options, return_lse=True)
    r_out, r_lse = run_reference(q, k, v, kw, options, kv_layout=kv_layout)
    n_out, _ = run_reference(q, k, v, kw, options, kv_layout=kv_layout, dtype=q.dtype)
    assert_close(out, r_out, n_out, name="out", floor=floor)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(torch.where(finite, lse.double(), 0.0), torch.where(finite, r_lse, 0.0),
                               atol=1e-3, rtol=1e-4)
    return out, lse


BENCH = dict(hq=32, hkv=8, dqk=128, dtype="bfloat16")
CASES = {
    "b1-s16k": (dict(BENCH, lens=(16384,)), dict(causal=True), None),
    "b1-s128k": (dict(BENCH, lens=(131072,)), dict(causal=True), None),
    "b32-s8k-ragged-paged64": (dict(BENCH, lens=(8192, 0, 1, 7000, *range(100, 8192, 290)), page_size=64),
                               dict(causal=True), None),
    "b4-paged16-hnd-sq3": (dict(BENCH, sq=3, lens=(4096, 1, 0, 3000), page_size=16, layout="HND"),
                           dict(causal=True), 7),
    "fp8-head-b1-s128k": (dict(BENCH, lens=(131072,), fp8="head", page_size=64), dict(causal=True), None),
    # the benchmark's FP8 path: contiguous, 128-key steps in 4 key groups, V as column pairs
    "fp8-tensor-b1-s128k-contig": (dict(BENCH, lens=(131072,), fp8="tensor"), dict(causal=True), None),
    "fp8-dv40-b4-paged16-hnd-sq3": (dict(hq=32, hkv=8, dqk=64, dv=40, dtype="bfloat16", sq=3, fp8="head",
                                         lens=(4096, 1, 0, 3000), page_size=16, layout="HND"), dict(causal=True), 7),
    "sq8-all-options": (dict(BENCH, sq=8, lens=(4096, 33, 0, 2500), page_size=16, sinks=True, alibi="batch"),
                        dict(causal=True, window_size=(1000, -1), softcap=30.0), None),
    "mla-576-512": (dict(hq=16, hkv=1, dqk=576, dv=512, dtype="bfloat16", lens=(4096, 1, 2000), page_size=64),
                    dict(causal=True), None),
    "d64-mha": (dict(hq=8, hkv=8, dqk=64, dtype="bfloat16", lens=(8192, 5, 4000)), dict(causal=True), 1),
    "fp16": (dict(hq=32, hkv=8, dqk=128, dtype="float16", lens=(8192, 100)), dict(causal=True), None),
    "fp32": (dict(hq=8, hkv=2, dqk=64, dtype="float32", lens=(2048, 1)), dict(causal=True), 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_decode(name):
    spec, options, splits = CASES[name]
    q, k, v, kw = _cuda(*make_case(hash(name) % 1000, **spec))
    check(q, k, v, kw, options, kv_layout=spec.get("layout", "NHD"), num_splits=splits,
          floor=1e-5 if spec["dtype"] == "float32" else 1e-3)


def test_gpu_fixed_splits_bitwise_reproducible_and_batch_invariant():
    from flashbridge.torch_api.decode import decode_attention
    q, k, v, kw = _cuda(*make_case(1, **BENCH, lens=(8192, 100, 0, 5000), page_size=64, sinks=True))
    runs = [decode_attention(q, k, v, num_splits=16, **kw, return_lse=True) for _ in range(3)]
    for other in runs[1:]:
        assert torch.equal(runs[0][0], other[0]) and torch.equal(runs[0][1], other[1])
    for i in (0, 3):
        alone = dict(kw, cache_seqlens=kw["cache_seqlens"][i:i + 1], block_table=kw["block_table"][i:i + 1])
        o, l_ = decode_attention(q[i:i + 1], k, v, num_splits=16, **alone, return_lse=True)
        assert torch.equal(o[0], runs[0][0][i]) and torch.equal(l_[0], runs[0][1][i])
    auto = decode_attention(q, k, v, **kw)
    torch.testing.assert_close(auto, runs[0][0], atol=2e-2, rtol=0)


def test_gpu_append_then_decode_and_cascade():
    from flashbridge.torch_api.decode import append_kv_cache, cascade_attention, decode_attention
    lens = (0, 1, 3000, 8000)
    for fp8 in (None, "head"):
        q, k, v, kw = _cuda(*make_case(2, **BENCH, lens=tuple(x + 4 for x in lens), page_size=16, fp8=fp8))
        before = torch.tensor(lens, dtype=torch.int32, device="cuda")
        k_new = torch.randn(4, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_new = torch.randn(4, 4, 8, 128, device="cuda", dtype=torch.bfloat16)
        extra = {n: kw[n] for n in ("block_table", "k_scale", "v_scale") if n in kw}
        kc, vc = k.clone(), v.clone()
        append_kv_cache(kc, vc, k_new, v_new, cache_seqlens=before, **extra)
        for cache, new, scale in ((kc, k_new, kw.get("k_scale")), (vc, v_new, kw.get("v_scale"))):
            for i, length in enumerate(lens):
                got = gather(cache, length + 4, i, block_table=kw["block_table"], dtype=torch.float32)[length:]
                want = new[i].float()
                if fp8:
                    want = (want / scale[None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).float()
                assert torch.equal(got, want)  # exact: IEEE division, the same e4m3 rounding as torch
        check(q, kc, vc, kw, dict(causal=True))
    # cascade: a 4096-token shared prefix + the paged caches, vs the float64 reference over the concatenation
    q, k, v, kw = _cuda(*make_case(3, **BENCH, lens=(0, 1, 3000, 8000), page_size=64, sinks=True))
    sk = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    sv = torch.randn(4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = cascade_attention(q, sk, sv, k, v, **kw)
    full_k = torch.cat([sk[None].expand(4, -1, -1, -1), torch.stack([_padded(k, kw, i, 8000) for i in range(4)])], 1)
    full_v = torch.cat([sv[None].expand(4, -1, -1, -1), torch.stack([_padded(v, kw, i, 8000) for i in range(4)])], 1)
    ref_kw = {"cache_seqlens": kw["cache_seqlens"] + 4096, "sinks": kw["sinks"]}
    r_out, _ = run_reference(q, full_k.contiguous(), full_v.contiguous(), ref_kw, dict(causal=True))
    n_out, _ = run_reference(q, full_k.contiguous(), full_v.contiguous(), ref_kw, dict(causal=True),
                             dtype=torch.bfloat16)
    assert_close(out, r_out, n_out, name="cascade", floor=1e-3)
    d = decode_attention(q, full_k.contiguous(), full_v.contiguous(), **ref_kw)
    torch.testing.assert_close(out, d, atol=2e-2, rtol=0)


def _padded(cache, kw, i, rows):
    length = int(kw["cache_seqlens"][i])
    g = gather(cache, length, i, block_table=kw["block_table"], dtype=cache.dtype)
    return torch.cat([g, torch.zeros(rows - length, *g.shape[1:], dtype=g.dtype, device=g.device)])


@pytest.mark.parametrize("name", ["b32-s8k-ragged-paged64", "fp8-head-b1-s128k", "sq8-all-options"])
def test_gpu_jax_matches_torch_bitwise(name):
    jax = pytest.importorskip("jax")
    if not jax.devices("gpu"):
        pytest.skip("JAX has no GPU backend")
    from flashbridge.jax_api.decode import decode_attention as jdecode
    from flashbridge.torch_api.decode import decode_attention as tdecode
    from helpers import torch_to_jax
    spec, options, splits = CASES[name]
    q, k, v, kw = make_case(7, **spec)
    out, lse = tdecode(*(t.cuda() for t in (q, k, v)), num_splits=splits, **{n: t.cuda() for n, t in kw.items()},
                       **options, return_lse=True)
    jkw = {n: jax.device_put(torch_to_jax(t), jax.devices("gpu")[0]) for n, t in kw.items()}
    jq, jk, jv = (jax.device_put(torch_to_jax(t), jax.devices("gpu")[0]) for t in (q, k, v))
    jout, jlse = jax.jit(lambda q, k, v, kw: jdecode(q, k, v, num_splits=splits, **kw, **options,
                                                     return_lse=True))(jq, jk, jv, jkw)
    np.testing.assert_array_equal(np64(jout), np64(out))
    np.testing.assert_array_equal(np64(jlse), np64(lse))


def test_gpu_jax_append_donated_in_place():
    jax = pytest.importorskip("jax")
    if not jax.devices("gpu"):
        pytest.skip("JAX has no GPU backend")
    jnp = jax.numpy
    from flashbridge.jax_api.decode import append_kv_cache
    dev = jax.devices("gpu")[0]
    k = jax.device_put(jnp.zeros((64, 16, 8, 128), jnp.bfloat16), dev)
    v = jax.device_put(jnp.zeros((64, 16, 8, 128), jnp.bfloat16), dev)
    table = jax.device_put(jnp.arange(64, dtype=jnp.int32)[::-1].reshape(4, 16), dev)
    new = jax.device_put(jnp.ones((4, 2, 8, 128), jnp.bfloat16), dev)
    lens = jax.device_put(jnp.array([0, 1, 100, 254], jnp.int32), dev)
    step = jax.jit(lambda k, v, n, lens: append_kv_cache(k, v, n, n, cache_seqlens=lens, block_table=table),
                   donate_argnums=(0, 1))
    hlo = step.lower(k, v, new, lens).compile().as_text()
    assert "alias" in hlo  # the kernel's outputs alias the cache operands
    k2, v2 = step(k, v, new, lens)
    assert k.is_deleted()  # donated: the update reused the cache buffer
    assert float(jnp.sum(k2.astype(jnp.float32))) == 4 * 2 * 8 * 128


def test_gpu_jax_generation_loop_in_scan_matches_torch_bitwise():
    """The JAX generation loop in one jitted call (``run_generation_loops``: scan, donated cache, append then
    decode per step), as the JAX decode docstring recommends and the benchmark's JAX rows time, at the
    benchmark's head shape: bit for bit the same steps run one by one in torch, cache included."""
    jax = pytest.importorskip("jax")
    if not jax.devices("gpu"):
        pytest.skip("JAX has no GPU backend")
    steps = 4
    q, k, v, kw = _cuda(*make_case(11, **BENCH, lens=(4000, 1, 2000), s_max=4096))
    g = torch.Generator(device="cuda").manual_seed(12)
    qs = torch.randn((steps, *q.shape), device="cuda", generator=g).to(torch.bfloat16)
    k_new, v_new = (torch.randn(steps, 3, 1, 8, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    (jk, jv, _, jouts), (kc, vc, _, outs) = run_generation_loops(k, v, kw["cache_seqlens"], qs, k_new, v_new,
                                                                device=jax.devices("gpu")[0])
    np.testing.assert_array_equal(np64(jouts), np64(outs))
    np.testing.assert_array_equal(np64(jk), np64(kc))
    np.testing.assert_array_equal(np64(jv), np64(vc))


def test_gpu_torch_compile_and_cuda_graph():
    from flashbridge.torch_api.decode import append_kv_cache, decode_attention
    q, k, v, kw = _cuda(*make_case(4, **BENCH, lens=(4096, 1, 2000), page_size=64))
    lens, table = kw["cache_seqlens"], kw["block_table"]
    new = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)

    def step(q, k, v, new, lens):
        append_kv_cache(k, v, new, new, cache_seqlens=lens - 1, block_table=table)
        return decode_attention(q, k, v, cache_seqlens=lens, block_table=table)

    eager = step(q, k.clone(), v.clone(), new, lens)
    compiled = torch.compile(step, fullgraph=True)(q, k.clone(), v.clone(), new, lens)
    assert torch.equal(eager, compiled)
    kc, vc = k.clone(), v.clone()
    step(q, kc, vc, new, lens)  # warm up (compiles the kernels)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, kc, vc, new, lens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def _memcheck_case():
    """Ragged lengths, paged caches with shuffled tables, contiguous FP8 (128-key tiles), every op, torch and
    JAX (for compute-sanitizer); the decode kernel also with FP8 256-key tiles."""
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.decode.plan import DecodeConfig
    from flashbridge.torch_api import decode as tapi
    # FP8 256-key tiles (the default only on long spans at B=1)
    q, k, v, kw = _cuda(*make_case(3, hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(1, 0, 130, 1000), fp8="tensor"))
    with configure(DecodeConfig(block_n=256)):
        for splits in (None, 1, 3):
            tapi.decode_attention(q, k, v, num_splits=splits, **kw, softcap=10.0, window_size=(100, -1))
    for spec in (dict(hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(0, 1, 17, 1000, 4097), page_size=16),
                 # 10 (batch x kv head) programs: contiguous 16-bit takes 128-key tiles at one program per SM,
                 # paged (whole key blocks per page) 5 stages at two
                 dict(hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(0, 1, 17, 1000, 4097)),
                 dict(hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(0, 1, 17, 1000, 4097), page_size=64),
                 dict(hq=8, hkv=2, dqk=64, dtype="bfloat16", lens=(1, 0, 63, 130), page_size=64, layout="HND",
                      fp8="head"),
                 dict(hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(1, 0, 130, 1000), fp8="tensor"),
                 dict(hq=8, hkv=2, dqk=64, dv=40, dtype="bfloat16", lens=(1, 0, 130, 1000), fp8="tensor",
                      page_size=16),
                 dict(hq=16, hkv=1, dqk=576, dv=512, dtype="bfloat16", lens=(5, 0, 333)),
                 dict(sq=5, hq=4, hkv=4, dqk=72, dv=40, dtype="float16", lens=(3, 1, 0, 200), page_size=32,
                      sinks=True, alibi="batch")):
        layout = spec.get("layout", "NHD")
        q, k, v, kw = _cuda(*make_case(0, **spec))
        for splits in (None, 1, 3):
            out, lse = tapi.decode_attention(q, k, v, kv_layout=layout, num_splits=splits, **kw, softcap=10.0,
                                             window_size=(100, -1), return_lse=True)
        tapi.merge_attention_states(torch.stack([out, out]), torch.stack([lse, lse]).transpose(-1, -2))
        shared = (torch.randn(77, k.shape[2 if layout == "NHD" else 1], k.shape[-1], device="cuda").to(k.dtype),
                  torch.randn(77, v.shape[2 if layout == "NHD" else 1], v.shape[-1], device="cuda").to(v.dtype))
        if layout == "HND":
            shared = tuple(s.transpose(0, 1).contiguous() for s in shared)
        cascade_kw = {n: t for n, t in kw.items() if n != "alibi_slopes"}
        tapi.cascade_attention(q, *shared, k, v, kv_layout=layout, **cascade_kw)
    # appends at ragged offsets, paged and contiguous, bf16 and fp8
    for fp8, page_size in ((None, 16), ("tensor", 64), (None, None)):
        q, k, v, kw = _cuda(*make_case(1, hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(3, 4, 20, 700),
                                       page_size=page_size, fp8=fp8))
        extra = {n: kw[n] for n in ("block_table", "k_scale", "v_scale") if n in kw}
        new = torch.randn(4, 3, 2, 128, device="cuda", dtype=torch.bfloat16)
        tapi.append_kv_cache(k, v, new, new, cache_seqlens=kw["cache_seqlens"] - 3, **extra)
    torch.cuda.synchronize()
    print("torch decode / merge / cascade / append, ragged + paged: ok")
    try:
        import jax
        from flashbridge.jax_api import decode as japi
        from helpers import torch_to_jax
    except ImportError:
        return
    q, k, v, kw = make_case(2, hq=8, hkv=2, dqk=128, dtype="bfloat16", lens=(0, 1, 17, 1000), page_size=16)
    jkw = {n: torch_to_jax(t) for n, t in kw.items()}
    out = jax.jit(lambda q, k, v, kw: japi.decode_attention(q, k, v, **kw))(torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), jkw)
    new = torch_to_jax(torch.randn(4, 1, 2, 128).to(torch.bfloat16))
    k2, v2 = jax.jit(lambda k, v, n, kw: japi.append_kv_cache(k, v, n, n, cache_seqlens=kw["cache_seqlens"],
                                                              block_table=kw["block_table"]),
                     donate_argnums=(0, 1))(torch_to_jax(k), torch_to_jax(v), new, jkw)
    jax.block_until_ready((out, k2, v2))
    print("jax decode / append, ragged + paged: ok")



def test_fp8_v_cache_views():
    """Compiled kernels read an FP8 V cache as 16-bit pairs of columns: a view whose first byte is off a
    2-byte boundary (strides still even) is refused with a message naming v_cache; pair-aligned views of the
    same storage give the plain decode's result."""
    from flashbridge.torch_api.decode import decode_attention

    g = torch.Generator(device="cuda").manual_seed(11)
    base = torch.randn(1, 256, 2, 68, device="cuda", generator=g).to(torch.float8_e4m3fn)
    q = torch.randn(1, 1, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([200], device="cuda", dtype=torch.int32)
    k = base[..., 4:68]
    with pytest.raises(ValueError, match="v_cache: an FP8 cache"):
        decode_attention(q, k, base[..., 1:65], cache_seqlens=lens)
    for start in (2, 4):
        out = decode_attention(q, k, base[..., start:start + 64], cache_seqlens=lens)
        want = decode_attention(q, k.contiguous(), base[..., start:start + 64].contiguous(), cache_seqlens=lens)
        assert torch.equal(out, want)


if __name__ == "__main__":
    _memcheck_case()
