"""Checks of the Flash-Decoding family for ``python -m flashbridge check``.

Rows: ``decode_attention`` over a paged cache with ragged lengths (bf16 on a GPU), the same with an FP8
cache (per-kv-head scales), and ``cascade_attention`` (a shared prefix + paged caches). TB/s = bytes of K
and V actually read / time (the sum of the lengths, the shared prefix once). The error is max|out - ref|
over the bound (twice the naive same-dtype error + a floor); the naive implementation is emulated in
NumPy: float64 math over the gathered, dequantised cache, rounded through the dtype after every step a
plain implementation would store (the cache in q's dtype, scores, probabilities, output).
"""
from __future__ import annotations

import math

import numpy as np

from ..reference import attention as RA
from ..reference import decode as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework

# (lengths, Hq, Hkv, D, page size, shared prefix): small on the CPU interpreter; on a GPU large enough to
# time, small enough for a float64 NumPy reference.
SHAPES = {"cpu": ((0, 1, 77, 130), 4, 2, 64, 16, 45),
          "cuda": ((8192, 1, 0, 4000, 8191, 6000, 7777, 8192), 32, 8, 128, 64, 4096)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}
CASES = ("decode paged", "decode fp8 paged", "cascade paged")


def _naive(q, ks, vs, dtype, *, sinks=None, shared=None):
    """Per sequence: the dequantised cache rounded to ``dtype`` (shared prefix first, fully visible), causal
    scores, probabilities and output each rounded to ``dtype``."""
    r = lambda a: rounded(a, dtype)  # noqa: E731
    b, sq, hq, d = q.shape
    out = np.zeros((b, sq, hq, vs[0].shape[-1]))
    for i in range(b):
        k, v = r(ks[i]), r(vs[i])
        n_shared = 0
        if shared is not None:
            n_shared = shared[0].shape[0]
            k, v = np.concatenate([r(shared[0]), k]), np.concatenate([r(shared[1]), v])
        group = hq // k.shape[1]
        kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = r(np.einsum("qhd,khd->hqk", q[i], kk) / math.sqrt(d))
        own = k.shape[0] - n_shared
        mask = np.concatenate([np.ones((sq, n_shared), bool), RA.visible_mask(sq, own, causal=True)], axis=1)
        s = np.where(mask[None], s, -np.inf)
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        if sinks is not None:
            m = np.maximum(m, sinks[:, None, None])
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m)
        denom = e.sum(-1, keepdims=True) + (np.exp(sinks[:, None, None] - m) if sinks is not None else 0.0)
        p = r(e / np.where(denom > 0, denom, 1.0))
        out[i] = r(np.einsum("hqk,khd->qhd", p, vv))
    return out


def _inputs(device, case, seed):
    lens, hq, hkv, d, page_size, n_shared = SHAPES[device]
    dtype = DTYPES[device]
    rng = np.random.default_rng(seed)
    b = len(lens)
    max_pages = -(-max(lens) // page_size)
    n_pages = b * max_pages + 3
    fp8 = case == "decode fp8 paged"
    table = rng.permutation(n_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    a = {"q": rounded(rng.standard_normal((b, 1, hq, d)), dtype), "cache_seqlens": np.asarray(lens, np.int32),
         "block_table": table}
    for name in ("k_cache", "v_cache"):
        pages = rng.standard_normal((n_pages, page_size, hkv, d))
        if fp8:
            scale = rng.random(hkv) * 0.5 + 0.25
            a[name[0] + "_scale"] = scale.astype(np.float32)
            a[name] = R.quantize_fp8(pages, scale.astype(np.float32))
        else:
            a[name] = rounded(pages, dtype)
    if case == "cascade paged":
        a["shared_k"] = rounded(rng.standard_normal((n_shared, hkv, d)), dtype)
        a["shared_v"] = rounded(rng.standard_normal((n_shared, hkv, d)), dtype)
        a["sinks"] = rng.standard_normal(hq)
    return a, dtype


def _bytes(a):
    item = a["k_cache"].dtype.itemsize
    hkv, d = a["k_cache"].shape[2], a["k_cache"].shape[3]
    rows = int(np.sum(a["cache_seqlens"])) + (a["shared_k"].shape[0] if "shared_k" in a else 0)
    return rows * hkv * 2 * d * item


def checks(framework: str, device: str) -> list[Check]:
    return [Check(op=f"{case}", framework=framework, run=_make_run(framework, device, case, seed=i))
            for i, case in enumerate(CASES)]


def _convert(framework, name, x, dtype, device):
    """One numpy input -> the framework's array: int32 indices, float32 scales / sinks, FP8 caches as they
    are, everything else in the check's dtype."""
    if name in ("cache_seqlens", "block_table"):
        return _ints(framework, x, device)
    if x.dtype.name == "float8_e4m3fn":
        if framework == "torch":
            import torch
            return torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn).to(device)
        import jax
        import jax.numpy as jnp
        return jax.device_put(jnp.asarray(x), jax.devices("gpu" if device == "cuda" else "cpu")[0])
    dt = "float32" if name in ("k_scale", "v_scale", "sinks") else dtype
    return to_framework(framework, np.asarray(x, dtype=np.float64), dt, device)


def _ints(framework, x, device):
    if framework == "torch":
        import torch
        return torch.tensor(x, dtype=torch.int32, device=device)
    import jax
    import jax.numpy as jnp
    return jax.device_put(jnp.asarray(x, jnp.int32), jax.devices("gpu" if device == "cuda" else "cpu")[0])


def _make_run(framework, device, case, seed):
    def run() -> Measurement:
        a, dtype = _inputs(device, case, seed)
        lens, table = a["cache_seqlens"], a["block_table"]
        gathered = {n: [R.gather_cache(a[n], int(length), i, block_table=table, scale=a.get(n[0] + "_scale"))
                        for i, length in enumerate(lens)] for n in ("k_cache", "v_cache")}
        opts = {n: a[n] for n in ("block_table", "k_scale", "v_scale", "sinks") if n in a}
        if case == "cascade paged":
            ref, _ = R.cascade_attention(a["q"], a["shared_k"], a["shared_v"], a["k_cache"], a["v_cache"],
                                         cache_seqlens=lens, **opts)
            naive = _naive(a["q"], gathered["k_cache"], gathered["v_cache"], dtype, sinks=a["sinks"],
                           shared=(a["shared_k"], a["shared_v"]))
        else:
            ref, _ = R.decode_attention(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=lens, **opts)
            naive = _naive(a["q"], gathered["k_cache"], gathered["v_cache"], dtype)
        t = {n: _convert(framework, n, x, dtype, device) for n, x in a.items()}
        if framework == "torch":
            from ..torch_api import decode as api
        else:
            from ..jax_api import decode as api
        kw = {n: t[n] for n in ("cache_seqlens", "block_table", "k_scale", "v_scale", "sinks") if n in t}
        if case == "cascade paged":
            def fwd(t=t):
                return api.cascade_attention(t["q"], t["shared_k"], t["shared_v"], t["k_cache"], t["v_cache"], **kw)
        else:
            def fwd(t=t):
                return api.decode_attention(t["q"], t["k_cache"], t["v_cache"], **kw)
        y = fwd()
        time_ms = None
        if device == "cuda":
            if framework == "torch":
                from .._timing import time_torch
                time_ms = time_torch(fwd)
            else:
                from .._timing import time_jax
                time_ms = time_jax(lambda t: fwd(t), t)
        lens_, hq, hkv, d = SHAPES[device][0], SHAPES[device][1], SHAPES[device][2], SHAPES[device][3]
        return Measurement(max_err=error_vs_reference(y, ref, naive), tol=1.0, time_ms=time_ms, amount=_bytes(a),
                           unit="TB/s", shape=f"B{len(lens_)} L<={max(lens_)} H{hq}/{hkv} D{d} "
                                              f"{'fp8' if 'fp8' in case else dtype}")

    return run
