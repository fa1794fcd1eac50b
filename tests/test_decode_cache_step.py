"""Left-padded caches (``cache_leftpad``) and RoPE inside the KV-cache step (``rotary_cos`` / ``rotary_sin``
of ``append_kv_cache`` and ``decode_attention``) on the CPU (Triton interpreter), both front-ends.

The float64 reference (flashbridge.reference.decode) reads rows ``[cache_leftpad, cache_seqlens)`` and
rotates with flashbridge.reference.rotary. Two exact properties besides: decode over a left-padded cache is
bitwise decode over the same tokens moved to row 0 (the kernel counts keys from the first real row, so every
tile and split boundary is the same), and append + decode with the tables equals rotary_embedding, then the
plain append and decode, to rounding.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashbridge.reference import decode as ref
from flashbridge.reference import rotary as rref
from helpers import assert_close, naive_torch, np64, torch_to_jax

tapi = pytest.importorskip("flashbridge.torch_api")


def _tables(g, rows, half):
    """cos / sin of real angles (the kernels do not assume it; the reference is exact either way)."""
    theta = torch.rand(rows, half, generator=g, dtype=torch.float64) * 6.3
    return torch.cos(theta).float(), torch.sin(theta).float()


def _case(seed, *, b=3, sq=1, hq=4, hkv=2, d=32, s_max=80, dtype=torch.float32, lens=(9, 80, 47), pads=(3, 21, 0)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, s_max, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, s_max, hkv, d, generator=g).to(dtype)
    return (q, k, v, torch.tensor(lens[:b], dtype=torch.int32), torch.tensor(pads[:b], dtype=torch.int32), g)


def _shift_left(cache, lens, pads):
    """The same tokens moved to row 0 (the rest poisoned): the unpadded cache of a left-padded one."""
    out = torch.full_like(cache, float("nan"))
    for b, (n, p) in enumerate(zip(lens.tolist(), pads.tolist())):
        out[b, :n - p] = cache[b, p:n]
    return out


def _f(t):
    return np64(t)


# ------------------------------------------------------------------------------------------- reference

def test_reference_leftpad_reads_only_the_real_rows():
    q, k, v, lens, pads, _ = _case(1, sq=3)
    k[0, :3] = float("nan")  # padding rows are never read
    out, lse = ref.decode_attention(_f(q), _f(k), _f(v), cache_seqlens=lens, cache_leftpad=pads)
    out2, lse2 = ref.decode_attention(_f(q), _f(_shift_left(k, lens, pads)), _f(_shift_left(v, lens, pads)),
                                      cache_seqlens=lens - pads)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


# ------------------------------------------------------------------------------------------------ leftpad

LEFTPAD_CASES = {
    "causal-gqa2-sq3-splits3": (dict(sq=3), dict(causal=True), 3),
    "causal-gqa4-sq2-alibi": (dict(sq=2, hq=8), dict(causal=True, alibi=True), 1),
    "window-sq3-splits2": (dict(sq=3), dict(causal=True, window_size=(9, 0)), 2),
    "noncausal-sq1-auto": (dict(), dict(causal=False), None),
}


@pytest.mark.parametrize("name", list(LEFTPAD_CASES))
def test_torch_leftpad_matches_reference_and_the_unpadded_cache_bitwise(name):
    spec, options, splits = LEFTPAD_CASES[name]
    q, k, v, lens, pads, g = _case(zlib.crc32(name.encode()), **spec)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(q.shape[2], generator=g) * 0.3
    k[0, :3] = float("nan")  # padding rows are never read
    v[1, :21] = float("nan")
    out, lse = tapi.decode_attention(q, k, v, cache_seqlens=lens, cache_leftpad=pads, num_splits=splits,
                                     return_lse=True, **options)
    npo = {n: (o.numpy() if isinstance(o, torch.Tensor) else o) for n, o in options.items()}
    r_out, r_lse = ref.decode_attention(_f(q), _f(k), _f(v), cache_seqlens=lens, cache_leftpad=pads, **npo)
    assert np.abs(_f(out) - r_out).max() <= 2e-6 * max(1.0, np.abs(r_out).max())
    assert np.abs(_f(lse) - r_lse).max() <= 2e-6 * max(1.0, np.abs(r_lse).max())
    out2, lse2 = tapi.decode_attention(q, _shift_left(k, lens, pads), _shift_left(v, lens, pads),
                                       cache_seqlens=lens - pads, num_splits=splits, return_lse=True, **options)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=0)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_property_leftpad_is_the_unpadded_cache(data):
    """Any lengths and paddings (0 <= pad <= length, empty sequences included), any split count: bitwise the
    decode of the same tokens moved to row 0."""
    lens = data.draw(st.lists(st.integers(0, 48), min_size=2, max_size=2))
    pads = [data.draw(st.integers(0, n)) for n in lens]
    sq = data.draw(st.integers(1, 3))
    splits = data.draw(st.sampled_from([1, 2, None]))
    q, k, v, lens_t, pads_t, _ = _case(data.draw(st.integers(0, 99)), b=2, sq=sq, hq=4, hkv=1, d=16, s_max=48,
                                        lens=tuple(lens), pads=tuple(pads))
    out, lse = tapi.decode_attention(q, k, v, cache_seqlens=lens_t, cache_leftpad=pads_t, num_splits=splits,
                                     return_lse=True)
    out2, lse2 = tapi.decode_attention(q, _shift_left(k, lens_t, pads_t), _shift_left(v, lens_t, pads_t),
                                       cache_seqlens=lens_t - pads_t, num_splits=splits, return_lse=True)
    torch.testing.assert_close(out, out2, rtol=0, atol=0)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=0)


def test_torch_leftpad_bf16_hnd():
    q, k, v, lens, pads, _ = _case(7, sq=2, dtype=torch.bfloat16)
    kh, vh = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    out = tapi.decode_attention(q, kh, vh, cache_seqlens=lens, cache_leftpad=pads, kv_layout="HND", num_splits=2)
    r_out, _ = ref.decode_attention(_f(q), _f(k), _f(v), cache_seqlens=lens, cache_leftpad=pads)
    naive = torch.cat([naive_torch(q[b:b + 1], k[b:b + 1, p:n], v[b:b + 1, p:n], causal=True)[0]
                       for b, (n, p) in enumerate(zip(lens.tolist(), pads.tolist()))])
    assert_close(out, r_out, naive)


# ------------------------------------------------------------------------------------------------ rotary

ROTARY_CASES = {
    "halves-full-causal-sq3-splits3": dict(sq=3, rot=16, interleaved=False, causal=True, splits=3, leftpad=False),
    "interleaved-partial-leftpad-sq2": dict(sq=2, rot=8, interleaved=True, causal=True, splits=2, leftpad=True),
    "halves-partial-leftpad-noncausal": dict(sq=2, rot=12, interleaved=False, causal=False, splits=1, leftpad=True),
}


def _append_decode(api, k, v, q, k_new, v_new, lens, pads, cos, sin, c):
    """append (rotating the keys) then decode (rotating the queries), in one front-end."""
    kw = dict(cache_leftpad=pads) if c["leftpad"] else {}
    rot = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=c["interleaved"])
    if api is tapi:
        api.append_kv_cache(k, v, k_new, v_new, cache_seqlens=lens, **kw, **rot)
    else:
        k, v = api.append_kv_cache(k, v, k_new, v_new, cache_seqlens=lens, **kw, **rot)
    out = api.decode_attention(q, k, v, cache_seqlens=lens + k_new.shape[1], causal=c["causal"],
                               num_splits=c["splits"], **kw, **rot)
    return k, v, out


@pytest.mark.parametrize("name", list(ROTARY_CASES))
def test_torch_rotary_append_and_decode(name):
    c = ROTARY_CASES[name]
    sq = c["sq"]
    q, k, v, lens, pads, g = _case(zlib.crc32(name.encode()) + 5, sq=sq, lens=(9, 60, 40), pads=(3, 21, 0))
    if not c["leftpad"]:
        pads = torch.zeros_like(pads)
    k_new = torch.randn(3, sq, 2, 32, generator=g)
    v_new = torch.randn(3, sq, 2, 32, generator=g)
    cos, sin = _tables(g, 96, c["rot"] // 2)
    k0, v0 = k.clone(), v.clone()
    k1, v1, out = _append_decode(tapi, k.clone(), v.clone(), q, k_new, v_new, lens, pads, cos, sin, c)

    # float64 reference: keys rotated at row - pad, queries at n - pad - Sq + i (all at n - pad - Sq if not causal)
    rk, rv = ref.append_kv_cache(_f(k0), _f(v0), _f(k_new), _f(v_new), cache_seqlens=lens, cache_leftpad=pads,
                                 rotary_cos=_f(cos), rotary_sin=_f(sin), rotary_interleaved=c["interleaved"])
    np.testing.assert_allclose(_f(k1), rk, rtol=0, atol=3e-6)
    np.testing.assert_array_equal(_f(v1), rv)
    r_out, _ = ref.decode_attention(_f(q), rk, rv, cache_seqlens=lens + sq, causal=c["causal"],
                                    cache_leftpad=pads, rotary_cos=_f(cos), rotary_sin=_f(sin),
                                    rotary_interleaved=c["interleaved"])
    assert np.abs(_f(out) - r_out).max() <= 2e-6 * max(1.0, np.abs(r_out).max())

    # = rotary_embedding of q and k_new at the same positions, then the plain append and decode
    n = (lens - pads).long()
    step = 1 if c["causal"] else 0
    k_pos = n[:, None] + torch.arange(sq)[None, :]
    q_pos = n[:, None] + step * torch.arange(sq)[None, :]
    k_rot = tapi.rotary_embedding(k_new, cos, sin, interleaved=c["interleaved"], position_ids=k_pos)
    q_rot = tapi.rotary_embedding(q, cos, sin, interleaved=c["interleaved"], position_ids=q_pos)
    k2, v2 = k0.clone(), v0.clone()
    kw = dict(cache_leftpad=pads) if c["leftpad"] else {}
    tapi.append_kv_cache(k2, v2, k_rot, v_new, cache_seqlens=lens, **kw)
    out2 = tapi.decode_attention(q_rot, k2, v2, cache_seqlens=lens + sq, causal=c["causal"], num_splits=c["splits"],
                                 **kw)
    torch.testing.assert_close(k1, k2, rtol=0, atol=0)  # the same float32 rotation formula
    torch.testing.assert_close(out, out2, rtol=0, atol=0)


def test_reference_rotary_positions_are_rotary_embeddings():
    """The reference's rotated decode is the plain reference over rotary.rotary_embedding's q."""
    q, k, v, lens, pads, g = _case(11, sq=3)
    cos, sin = _tables(g, 96, 8)
    out, _ = ref.decode_attention(_f(q), _f(k), _f(v), cache_seqlens=lens, cache_leftpad=pads, rotary_cos=_f(cos),
                                  rotary_sin=_f(sin))
    pos = (lens - pads).numpy()[:, None] - 3 + np.arange(3)[None, :]
    q_rot = rref.rotary_embedding(_f(q), _f(cos), _f(sin), position_ids=pos)
    out2, _ = ref.decode_attention(q_rot, _f(k), _f(v), cache_seqlens=lens, cache_leftpad=pads)
    np.testing.assert_array_equal(out, out2)


def test_torch_rotary_bf16_fp8_cache():
    """bf16 tokens into an FP8 cache: rotated, rounded to bf16, then quantised (as rotate-then-append)."""
    g = torch.Generator().manual_seed(3)
    k = torch.zeros(2, 48, 2, 32).to(torch.float8_e4m3fn)
    v = torch.zeros(2, 48, 2, 32).to(torch.float8_e4m3fn)
    lens = torch.tensor([5, 30], dtype=torch.int32)
    k_new = torch.randn(2, 2, 2, 32, generator=g).to(torch.bfloat16)
    v_new = torch.randn(2, 2, 2, 32, generator=g).to(torch.bfloat16)
    cos, sin = _tables(g, 64, 16)
    scale = torch.tensor(0.5)
    k1, v1 = k.clone(), v.clone()
    tapi.append_kv_cache(k1, v1, k_new, v_new, cache_seqlens=lens, k_scale=scale, v_scale=scale, rotary_cos=cos,
                         rotary_sin=sin)
    k_rot = tapi.rotary_embedding(k_new, cos, sin, position_ids=lens.long()[:, None] + torch.arange(2))
    k2, v2 = k.clone(), v.clone()
    tapi.append_kv_cache(k2, v2, k_rot, v_new, cache_seqlens=lens, k_scale=scale, v_scale=scale)
    np.testing.assert_array_equal(k1.view(torch.uint8).numpy(), k2.view(torch.uint8).numpy())
    np.testing.assert_array_equal(v1.view(torch.uint8).numpy(), v2.view(torch.uint8).numpy())


# --------------------------------------------------------------------------------------------------- JAX

def test_jax_leftpad_and_rotary_match_torch_bitwise():
    jax = pytest.importorskip("jax")
    from flashbridge import jax_api as ja

    c = dict(ROTARY_CASES["interleaved-partial-leftpad-sq2"])
    q, k, v, lens, pads, g = _case(21, sq=2, dtype=torch.bfloat16, lens=(9, 60, 40))
    k_new = torch.randn(3, 2, 2, 32, generator=g).to(torch.bfloat16)
    v_new = torch.randn(3, 2, 2, 32, generator=g).to(torch.bfloat16)
    cos, sin = _tables(g, 96, 4)
    tk, tv, tout = _append_decode(tapi, k.clone(), v.clone(), q, k_new, v_new, lens, pads, cos, sin, c)
    J = torch_to_jax
    step = jax.jit(lambda *a: _append_decode(ja, *a, c))
    jk, jv, jout = step(J(k), J(v), J(q), J(k_new), J(v_new), J(lens), J(pads), J(cos), J(sin))
    np.testing.assert_array_equal(np64(jk), np64(tk))
    np.testing.assert_array_equal(np64(jv), np64(tv))
    np.testing.assert_array_equal(np64(jout), np64(tout))


def test_jax_leftpad_matches_reference():
    pytest.importorskip("jax")
    from flashbridge import jax_api as ja

    q, k, v, lens, pads, _ = _case(23, sq=3)
    out = ja.decode_attention(torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), cache_seqlens=torch_to_jax(lens),
                              cache_leftpad=torch_to_jax(pads), num_splits=2)
    r_out, _ = ref.decode_attention(_f(q), _f(k), _f(v), cache_seqlens=lens, cache_leftpad=pads)
    assert np.abs(np64(out) - r_out).max() <= 2e-6 * max(1.0, np.abs(r_out).max())


# ------------------------------------------------------------------------------------------------ errors

def _bad_calls():
    q, k, v, lens, pads, g = _case(31, b=2, lens=(9, 60), pads=(3, 21))
    cos, sin = _tables(g, 16, 8)
    table = torch.zeros(2, 5, dtype=torch.int32)
    pk = torch.randn(8, 16, 2, 32)
    new = torch.randn(2, 1, 2, 32)
    d = tapi.decode_attention
    a = tapi.append_kv_cache
    return [
        (lambda: d(q, pk, pk, cache_seqlens=lens, block_table=table, cache_leftpad=pads), ValueError,
         "cache_leftpad: not supported with a paged cache"),
        (lambda: a(pk, pk, new, new, cache_seqlens=lens, block_table=table, cache_leftpad=pads), ValueError,
         "cache_leftpad: not supported with a paged cache"),
        (lambda: d(q, k, v, cache_seqlens=lens, cache_leftpad=pads.long()), TypeError, "cache_leftpad: must be int32"),
        (lambda: d(q, k, v, cache_seqlens=lens, cache_leftpad=pads[:1]), ValueError, "cache_leftpad: expected shape"),
        (lambda: d(q, k, v, cache_seqlens=lens, cache_leftpad=torch.tensor([3, 61], dtype=torch.int32)), ValueError,
         "cache_leftpad: sequence 1 starts at row 61"),
        (lambda: d(q, k, v, cache_seqlens=lens, rotary_cos=cos), ValueError, "rotary_cos, rotary_sin: give both"),
        (lambda: d(q, k, v, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin[:, :4]), ValueError,
         "rotary_cos, rotary_sin: must have one shape"),
        (lambda: d(q, k, v, cache_seqlens=lens, rotary_cos=torch.ones(16, 17), rotary_sin=torch.ones(16, 17)),
         ValueError, "rotary_dim = 2 \\* 17 exceeds"),
        (lambda: a(k, v, new, new, cache_seqlens=lens, rotary_cos=cos[0], rotary_sin=sin[0]), ValueError,
         "rotary_cos: expected 2 non-empty dimensions"),
        (lambda: a(k, v, new, new, cache_seqlens=lens, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1),
         TypeError, "rotary_interleaved: expected a bool"),
    ]


@pytest.mark.parametrize("index", range(10))
def test_torch_bad_inputs_name_the_argument(index):
    call, error, match = _bad_calls()[index]
    with pytest.raises(error, match=match):
        call()


def test_jax_bad_inputs_name_the_argument():
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from flashbridge import jax_api as ja

    q, k = jnp.ones((2, 1, 4, 32)), jnp.ones((2, 16, 2, 32))
    lens = jnp.array([3, 16], jnp.int32)
    with pytest.raises(ValueError, match="cache_leftpad: not supported with a paged cache"):
        ja.decode_attention(q, k, k, cache_seqlens=lens, block_table=jnp.zeros((2, 1), jnp.int32),
                            cache_leftpad=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="cache_leftpad: sequence 0 starts at row 4"):
        ja.decode_attention(q, k, k, cache_seqlens=lens, cache_leftpad=jnp.array([4, 0], jnp.int32))
    with pytest.raises(ValueError, match="rotary_cos, rotary_sin: give both"):
        ja.append_kv_cache(k, k, jnp.ones((2, 1, 2, 32)), jnp.ones((2, 1, 2, 32)), cache_seqlens=lens,
                           rotary_sin=jnp.ones((16, 8)))


def test_torch_opcheck_and_compile_with_leftpad_and_rotary():
    q, k, v, lens, pads, g = _case(41, b=2, sq=2, hq=2, hkv=1, d=16, s_max=24, lens=(9, 20), pads=(2, 5))
    cos, sin = _tables(g, 32, 4)
    args = (q, k, v, lens, None, None, None, None, None, "NHD", 0.25, True, None, None, 0.0, 2, pads, cos, sin, True)
    torch.library.opcheck(torch.ops.flashbridge.decode_attn.default, args)
    new = (torch.randn(2, 2, 1, 16, generator=g), torch.randn(2, 2, 1, 16, generator=g))
    torch.library.opcheck(torch.ops.flashbridge.append_kv_cache.default,
                          (k.clone(), v.clone(), *new, lens - 2, None, None, None, "NHD", pads, cos, sin, False))
    kw = dict(cache_seqlens=lens, cache_leftpad=pads, rotary_cos=cos, rotary_sin=sin, num_splits=2)
    eager = tapi.decode_attention(q, k, v, **kw)
    compiled = torch.compile(lambda q: tapi.decode_attention(q, k, v, **kw), fullgraph=True, backend="eager")(q)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# ------------------------------------------------------------------------- compile parity (sm_90 on CPU)

def _cache_step_plans():
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.decode import plan as P
    h200 = Target(interpret=False, num_sms=132)
    rot = dict(rotary_cos=((8192, 64), "float32"), rotary_sin=((8192, 64), "float32"))
    plans = []
    for cache_dtype, interleaved in (("bfloat16", False), ("float8_e4m3fn", True)):
        kshape = (4, 8192, 8, 128)
        scales = (dict(k_scale=((8,), "float32"), v_scale=((8,), "float32")) if cache_dtype == "float8_e4m3fn"
                  else {})
        shape, options, _ = P.check_decode_args(
            q=((4, 1, 32, 128), "bfloat16"), k_cache=(kshape, cache_dtype), v_cache=(kshape, cache_dtype),
            cache_seqlens=((4,), "int32"), cache_leftpad=((4,), "int32"), rotary_interleaved=interleaved,
            **rot, **scales)
        plans.append((f"decode {cache_dtype}", P.plan_decode(shape, options, target=h200, num_splits=4),
                      cache_dtype))
        append = P.check_append_args(k_cache=(kshape, cache_dtype), v_cache=(kshape, cache_dtype),
                                     k_new=((4, 3, 8, 128), "bfloat16"), v_new=((4, 3, 8, 128), "bfloat16"),
                                     cache_seqlens=((4,), "int32"), cache_leftpad=((4,), "int32"),
                                     rotary_interleaved=interleaved, **rot, **scales)
        plans.append((f"append {cache_dtype}", P.plan_append(append, target=h200), cache_dtype))
    return plans


@pytest.mark.parametrize("index", range(4))
def test_cache_step_kernels_compile_identically_for_sm90(index):
    """torch (Triton's launcher) and JAX (jax-triton) compile the same PTX with leftpad and rotary tables, and
    the cache is still read with 16-byte loads."""
    from helpers import assert_same_ptx, vector_loads

    name, plan, cache_dtype = _cache_step_plans()[index]
    dtypes = {"q": "bfloat16", "k_cache": cache_dtype, "v_cache": cache_dtype, "cache_seqlens": "int32",
              "cache_leftpad": "int32", "rotary_cos": "float32", "rotary_sin": "float32", "k_scale": "float32",
              "v_scale": "float32", "k_new": "bfloat16", "v_new": "bfloat16"}
    dtypes.update({s.name: s.dtype for s in plan.buffers})
    for launch in plan.launches:
        ptx = assert_same_ptx(launch, dtypes)
        if launch.kernel.endswith("decode_fwd_kernel"):
            assert launch.constexpr_dict()["ROT_HALF"] == 64 and launch.constexpr_dict()["HAS_LEFTPAD"]
            assert vector_loads(ptx) > 0, f"{name}: no 16-byte loads of the cache"
