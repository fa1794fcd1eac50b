"""FP8 (e4m3fn) edges on the CPU (Triton interpreter), both frameworks: non-finite values stored by
``append_kv_cache``, and dequantisation scales that are zero, negative or non-finite (rejected on the host)."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import e4m3_bits_expected, torch_to_jax

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from flashbridge import jax_api as fj  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402

NAN, INF = float("nan"), float("inf")
E4M3 = torch.float8_e4m3fn


def _new_values(scale_mode: str):
    """k_new / v_new (1, 2, 2, 16) float32 holding NaN, -NaN, +-inf, values past +-448 and ordinary ones,
    with the scales (per tensor or per kv head) they are divided by."""
    g = torch.Generator().manual_seed(1)
    special = torch.tensor([NAN, -NAN, INF, -INF, 1e30, -1e30, 449.0, -465.0, 0.0, -0.0, 3.3, 2 ** -10])
    rest = torch.randn(64 - special.numel(), generator=g) * 20
    vals = torch.cat([special, rest])
    k_new = vals.reshape(1, 2, 2, 16)
    v_new = vals.flip(0).reshape(1, 2, 2, 16)
    scale = torch.tensor([0.5, 2.0]) if scale_mode == "head" else torch.tensor(0.75)
    return k_new, v_new, scale


@pytest.mark.parametrize("scale_mode", ["none", "tensor", "head"])
def test_append_stores_nan_as_nan_and_saturates_inf_both_frameworks(scale_mode):
    k_new, v_new, scale = _new_values(scale_mode)
    scales = {} if scale_mode == "none" else {"k_scale": scale, "v_scale": scale}
    lens = torch.tensor([3], dtype=torch.int32)
    kc = torch.zeros(1, 8, 2, 16, dtype=E4M3)
    vc = torch.zeros(1, 8, 2, 16, dtype=E4M3)
    ft.append_kv_cache(kc, vc, k_new, v_new, cache_seqlens=lens, **scales)
    jk, jv = fj.append_kv_cache(torch_to_jax(torch.zeros(1, 8, 2, 16, dtype=E4M3)),
                                torch_to_jax(torch.zeros(1, 8, 2, 16, dtype=E4M3)), torch_to_jax(k_new),
                                torch_to_jax(v_new), cache_seqlens=torch_to_jax(lens),
                                **{n: torch_to_jax(s) for n, s in scales.items()})
    div = 1.0 if scale_mode == "none" else (scale.numpy()[None, None, :, None] if scale_mode == "head"
                                            else float(scale))
    for name, cache, jcache, new in (("k", kc, jk, k_new), ("v", vc, jv, v_new)):
        with np.errstate(invalid="ignore"):
            want = e4m3_bits_expected(new.numpy() / np.float32(div) if scale_mode != "none" else new.numpy())
        got = cache.view(torch.uint8).numpy()
        np.testing.assert_array_equal(got[:, 3:5], want, err_msg=f"torch {name}")
        assert not got[:, :3].any() and not got[:, 5:].any(), f"torch {name}: rows outside the append written"
        np.testing.assert_array_equal(np.asarray(jcache).view(np.uint8), got, err_msg=f"jax {name}")
    # the NaN encodings and the saturation, spelled out
    first = kc.view(torch.uint8)[0, 3, 0, :4].tolist()
    assert first[:2] == [0x7F, 0x7F] and first[2:] == [0x7E, 0xFE]  # NaN and -NaN, +inf and -inf
    assert torch.isnan(kc[0, 3, 0, :2].float()).all()


# --------------------------------------------------------------------------------------- bad scales

BAD_SCALES = {"zero": 0.0, "negative": -1.0, "nan": NAN, "inf": INF}


def _fp8_case():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 16, generator=g)
    k = torch.randn(2, 16, 2, 16, generator=g).to(E4M3)
    v = torch.randn(2, 16, 2, 16, generator=g).to(E4M3)
    shared = torch.randn(5, 2, 16, generator=g).to(E4M3)
    return q, k, v, shared, torch.tensor([3, 9], dtype=torch.int32)


def _call(op: str, api, conv, k_scale, v_scale):
    q, k, v, shared, lens = (conv(t) for t in _fp8_case())
    scales = {"k_scale": conv(k_scale), "v_scale": conv(v_scale)}
    if op == "decode":
        return api.decode_attention(q, k, v, cache_seqlens=lens, **scales)
    if op == "cascade":
        return api.cascade_attention(q, shared, shared, k, v, cache_seqlens=lens, **scales)
    if op == "append":
        new = conv(torch.randn(2, 1, 2, 16, generator=torch.Generator().manual_seed(4)))
        return api.append_kv_cache(k, v, new, new, cache_seqlens=lens, **scales)
    g = torch.Generator().manual_seed(3)
    q_latent, latent = torch.randn(2, 1, 4, 24, generator=g), torch.randn(2, 16, 24, generator=g).to(E4M3)
    return api.mla_decode(conv(q_latent), conv(latent), cache_seqlens=lens, head_dim_v=16,
                          kv_scale=scales["k_scale"])


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("bad", sorted(BAD_SCALES))
@pytest.mark.parametrize("op,which", [(op, w) for op in ("decode", "cascade", "append") for w in ("k", "v", "per-head")]
                         + [("mla", "k")])  # mla_decode has one scale, kv_scale
def test_bad_scales_are_rejected_on_the_host(op, which, bad, framework):
    value = BAD_SCALES[bad]
    good = torch.tensor([1.0, 0.5]) if which == "per-head" else torch.tensor(0.5)
    if which == "per-head":
        k_scale, v_scale = torch.tensor([0.5, value]), good
    elif which == "k":
        k_scale, v_scale = torch.tensor(value), good
    else:
        k_scale, v_scale = good, torch.tensor(value)
    api, conv = (ft, lambda t: t) if framework == "torch" else (fj, torch_to_jax)
    name = "kv_scale" if op == "mla" else ("v_scale" if which == "v" else "k_scale")
    with pytest.raises(ValueError, match=rf"{name}: FP8 scales must be finite and > 0"):
        _call(op, api, conv, k_scale, v_scale)


@pytest.mark.parametrize("op", ["decode", "cascade", "append", "mla"])
def test_good_scales_pass_and_traced_scales_are_not_read(op):
    """Positive finite scales run in both frameworks; under jax.jit the scales are tracers and the host check
    steps aside (a device-side value cannot be read without a synchronisation)."""
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(0.25)
    out_t = _call(op, ft, lambda t: t, k_scale, v_scale)
    out_j = _call(op, fj, torch_to_jax, k_scale, v_scale)
    if op == "append":
        return  # torch appends in place; the bits are compared in the test above
    np.testing.assert_array_equal(np.asarray(out_t), np.asarray(out_j))
    q, k, v, shared, lens = (torch_to_jax(t) for t in _fp8_case())
    if op == "decode":
        fn = jax.jit(lambda ks, vs: fj.decode_attention(q, k, v, cache_seqlens=lens, k_scale=ks, v_scale=vs))
        np.testing.assert_array_equal(np.asarray(fn(torch_to_jax(k_scale), torch_to_jax(v_scale))),
                                      np.asarray(out_j))
