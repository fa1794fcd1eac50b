"""Host cost of an eager call of every public op, both frameworks, beside the framework's own op.

Per row: the host time per call (wall time of N back-to-back calls issued without waiting, N kept below
the launch queue's depth, median of 5 batches), the device time of a call (torch: ``do_bench`` median;
JAX: the marginal cost of a call inside a jitted batch, ``time_jax``), and the ratio of our host time to
the framework op's, with whether it is within the 1.5x goal. Forward rows call the op; forward+backward
rows take gradients of every floating input with a random cotangent (torch: ``torch.autograd.grad``; JAX:
``jax.vjp``, eager). Small shapes, where the kernels take a few microseconds: the host is what is timed.

    python benchmarks/host_overhead.py              # CUDA; writes results/host_overhead_h200.json
    python benchmarks/host_overhead.py --only decode --framework torch
    python benchmarks/host_overhead.py --cpu        # the harness on a CPU: tiny shapes, host time only
    python benchmarks/host_overhead.py --cpu --framework jax --no-kernels   # JAX's host path alone

On a CPU the JAX ops run their kernels in Triton's interpreter, which swamps the host path: ``--no-kernels``
replaces each plan's execution by XLA zeros of its results' shapes (no callback, as on a GPU, where the
kernels are custom calls), so what is timed is the path of a call from the Python call to XLA's dispatch.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

from _common import print_table, save, time_jax, time_torch

GOAL = 1.5  # our host time per eager call / the framework op's


# ------------------------------------------------------------------------------------------------ shapes

def shapes(cpu: bool) -> dict:
    if cpu:
        return {"norm": (8, 64), "attn": (1, 16, 2, 16), "decode": [(1, 64), (2, 128)], "decode_heads": (4, 2, 32),
                "ce": (16, 256), "lce": (16, 32, 256), "rotary": (1, 16, 2, 32), "swiglu": (8, 64),
                "sparse": ((1, 32, 2, 16), [12, 20], 16), "mla": (1, 16, 2, 96, 64), "mla_decode": (1, 64, 4, 96, 64),
                "append": (2, 128, 2, 32), "merge": (2, 16, 2, 32)}
    return {"norm": (64, 1024), "attn": (1, 128, 16, 64),
            "decode": [(1, 4096), (1, 32768), (8, 4096), (8, 32768)], "decode_heads": (32, 8, 128),
            "ce": (256, 32000), "lce": (256, 1024, 32000), "rotary": (1, 128, 16, 128), "swiglu": (64, 4096),
            # block-sparse: (B, S, H, D), document lengths, block size; MLA (B, S, H, Dqk, Dv); append
            # (B, S_max, Hkv, D) one new token; merge (N states, S, H, D)
            "sparse": ((1, 128, 16, 64), [48, 80], 64), "mla": (1, 128, 16, 576, 512),
            "mla_decode": (4, 4096, 16, 576, 512), "append": (8, 4096, 8, 128), "merge": (2, 128, 16, 128)}


# ----------------------------------------------------------------------------------------------- torch

def torch_cases(cpu: bool):
    """(op, mode, shape, ours, theirs, baseline name): zero-argument callables."""
    import torch
    import torch.nn.functional as F

    from flashbridge import torch_api as ft

    dev = "cpu" if cpu else "cuda"
    dt = torch.float32 if cpu else torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    S = shapes(cpu)

    def rnd(*shape, grad=False, dtype=None):
        t = torch.randn(*shape, device=dev, dtype=dtype or dt, generator=gen)
        return t.requires_grad_() if grad else t

    def grads(fn, inputs, cot):
        return lambda: torch.autograd.grad(fn(), inputs, cot)

    rows, cols = S["norm"]
    x, w, b, dy = rnd(rows, cols, grad=True), rnd(cols, grad=True), rnd(cols, grad=True), rnd(rows, cols)
    shape = f"{rows}x{cols}"
    yield "rms_norm", "fwd", shape, lambda: ft.rms_norm(x, w), lambda: F.rms_norm(x, (cols,), w, 1e-6), "F.rms_norm"
    yield ("rms_norm", "fwd+bwd", shape, grads(lambda: ft.rms_norm(x, w), (x, w), dy),
           grads(lambda: F.rms_norm(x, (cols,), w, 1e-6), (x, w), dy), "F.rms_norm")
    yield ("layer_norm", "fwd", shape, lambda: ft.layer_norm(x, w, b), lambda: F.layer_norm(x, (cols,), w, b),
           "F.layer_norm")
    yield ("layer_norm", "fwd+bwd", shape, grads(lambda: ft.layer_norm(x, w, b), (x, w, b), dy),
           grads(lambda: F.layer_norm(x, (cols,), w, b), (x, w, b), dy), "F.layer_norm")

    B, Sq, H, D = S["attn"]
    q, k, v, do = (rnd(B, Sq, H, D, grad=i < 3) for i in range(4))
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dot = do.transpose(1, 2)
    shape = f"B{B} S{Sq} H{H} D{D} causal"

    def sdpa():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

    yield ("flash_attention", "fwd", shape, lambda: ft.flash_attention(q, k, v, causal=True), sdpa, "SDPA")
    yield ("flash_attention", "fwd+bwd", shape, grads(lambda: ft.flash_attention(q, k, v, causal=True), (q, k, v), do),
           grads(sdpa, (qt, kt, vt), dot), "SDPA")

    hq, hkv, d = S["decode_heads"]
    for b_, s_ in S["decode"]:
        qd = rnd(b_, 1, hq, d)
        kc, vc = rnd(b_, s_, hkv, d), rnd(b_, s_, hkv, d)
        lens = torch.full((b_,), s_, dtype=torch.int32, device=dev)
        qs, ks, vs = qd.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def ours(qd=qd, kc=kc, vc=vc, lens=lens):
            return ft.decode_attention(qd, kc, vc, cache_seqlens=lens)

        def theirs(qs=qs, ks=ks, vs=vs):
            return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True)

        yield "decode_attention", "fwd", f"B{b_} S{s_} Hq{hq} Hkv{hkv} D{d}", ours, theirs, "SDPA (GQA)"

    n, vocab = S["ce"]
    logits, labels = rnd(n, vocab, grad=True), torch.randint(0, vocab, (n,), device=dev, generator=gen)
    one = torch.ones((), device=dev, dtype=dt)
    shape = f"{n}x{vocab}"
    yield ("cross_entropy", "fwd", shape, lambda: ft.cross_entropy(logits, labels),
           lambda: F.cross_entropy(logits, labels), "F.cross_entropy")
    yield ("cross_entropy", "fwd+bwd", shape, grads(lambda: ft.cross_entropy(logits, labels), (logits,), one),
           grads(lambda: F.cross_entropy(logits, labels), (logits,), one), "F.cross_entropy")

    n, hidden, vocab = S["lce"]
    h, wv = rnd(n, hidden, grad=True), rnd(vocab, hidden, grad=True)
    lab = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    shape = f"{n}x{hidden} V{vocab}"
    yield ("linear_cross_entropy", "fwd", shape, lambda: ft.linear_cross_entropy(h, wv, lab),
           lambda: F.cross_entropy(h @ wv.T, lab), "F.cross_entropy(h @ W.T)")
    yield ("linear_cross_entropy", "fwd+bwd", shape, grads(lambda: ft.linear_cross_entropy(h, wv, lab), (h, wv), one),
           grads(lambda: F.cross_entropy(h @ wv.T, lab), (h, wv), one), "F.cross_entropy(h @ W.T)")

    B, Sq, H, D = S["rotary"]
    xr, dyr = rnd(B, Sq, H, D, grad=True), rnd(B, Sq, H, D)
    cos, sin = rnd(Sq, D // 2), rnd(Sq, D // 2)
    c2, s2 = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]

    def rope_eager():
        x1, x2 = xr[..., : D // 2], xr[..., D // 2:]
        return xr * c2 + torch.cat([-x2, x1], -1) * s2

    shape = f"B{B} S{Sq} H{H} D{D}"
    yield "rotary_embedding", "fwd", shape, lambda: ft.rotary_embedding(xr, cos, sin), rope_eager, "eager torch"
    yield ("rotary_embedding", "fwd+bwd", shape, grads(lambda: ft.rotary_embedding(xr, cos, sin), (xr,), dyr),
           grads(rope_eager, (xr,), dyr), "eager torch")

    rows, cols = S["swiglu"]
    g, u, dys = rnd(rows, cols, grad=True), rnd(rows, cols, grad=True), rnd(rows, cols)
    shape = f"{rows}x{cols}"
    yield "swiglu", "fwd", shape, lambda: ft.swiglu(g, u), lambda: F.silu(g) * u, "F.silu(g) * u"
    yield ("swiglu", "fwd+bwd", shape, grads(lambda: ft.swiglu(g, u), (g, u), dys),
           grads(lambda: F.silu(g) * u, (g, u), dys), "F.silu(g) * u")

    from flashbridge import masks

    (B, Sq, H, D), docs, block = S["sparse"]
    q, k, v, do = (rnd(B, Sq, H, D, grad=i < 3) for i in range(4))
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    mask = masks.document(docs, causal=True, block_size=block)
    dense = torch.as_tensor(mask.to_dense(), device=dev)
    shape = f"B{B} S{Sq} H{H} D{D} document"

    def sdpa_masked():
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense)

    yield ("block_sparse_attention", "fwd", shape, lambda: ft.flash_attention(q, k, v, block_mask=mask), sdpa_masked,
           "SDPA(attn_mask=)")
    yield ("block_sparse_attention", "fwd+bwd", shape,
           grads(lambda: ft.flash_attention(q, k, v, block_mask=mask), (q, k, v), do),
           grads(sdpa_masked, (qt, kt, vt), do.transpose(1, 2)), "SDPA(attn_mask=)")


def torch_host_us(fn, calls: int, cpu: bool) -> float:
    import torch

    sync = (lambda: None) if cpu else torch.cuda.synchronize
    for _ in range(5):
        fn()
    samples = []
    for _ in range(5):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------------- JAX

def jax_cases(cpu: bool):
    """(op, mode, shape, ours, theirs, baseline name, args): ``ours(*args)`` / ``theirs(*args)`` eager."""
    import jax
    import jax.numpy as jnp

    from flashbridge import jax_api as fj
    from flashbridge import masks

    dt = jnp.float32 if cpu else jnp.bfloat16
    key = iter(jax.random.split(jax.random.key(0), 64))
    S = shapes(cpu)

    def rnd(*shape, dtype=None):
        return jax.random.normal(next(key), shape, dtype or dt)

    def vjp(fn):
        """The op forward and its vjp with a cotangent (the last argument), eager."""
        def run(*args):
            out, pullback = jax.vjp(fn, *args[:-1])
            return pullback(args[-1])
        return run

    rows, cols = S["norm"]
    x, w, b, dy = rnd(rows, cols), rnd(cols), rnd(cols), rnd(rows, cols)

    def rms_ref(x, w):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)

    def ln_ref(x, w, b):
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, -1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), -1, keepdims=True)
        return ((xf - mu) * jax.lax.rsqrt(var + 1e-5) * w + b).astype(x.dtype)

    def ours_rms(x, w):
        return fj.rms_norm(x, w)

    def ours_ln(x, w, b):
        return fj.layer_norm(x, w, b)

    shape = f"{rows}x{cols}"
    yield "rms_norm", "fwd", shape, ours_rms, rms_ref, "jnp", (x, w)
    yield "rms_norm", "fwd+bwd", shape, vjp(ours_rms), vjp(rms_ref), "jnp", (x, w, dy)
    yield "layer_norm", "fwd", shape, ours_ln, ln_ref, "jnp", (x, w, b)
    yield "layer_norm", "fwd+bwd", shape, vjp(ours_ln), vjp(ln_ref), "jnp", (x, w, b, dy)

    B, Sq, H, D = S["attn"]
    q, k, v, do = (rnd(B, Sq, H, D) for _ in range(4))

    def ours_attn(q, k, v):
        return fj.flash_attention(q, k, v, causal=True)

    def ref_attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    shape = f"B{B} S{Sq} H{H} D{D} causal"
    yield "flash_attention", "fwd", shape, ours_attn, ref_attn, "jax.nn.dot_product_attention", (q, k, v)
    yield ("flash_attention", "fwd+bwd", shape, vjp(ours_attn), vjp(ref_attn), "jax.nn.dot_product_attention",
           (q, k, v, do))

    hq, hkv, d = S["decode_heads"]
    for b_, s_ in S["decode"]:
        qd, kc, vc = rnd(b_, 1, hq, d), rnd(b_, s_, hkv, d), rnd(b_, s_, hkv, d)
        lens = jnp.full((b_,), s_, jnp.int32)

        def ours_dec(qd, kc, vc, lens):
            return fj.decode_attention(qd, kc, vc, cache_seqlens=lens)

        def ref_dec(qd, kc, vc, lens):
            return jax.nn.dot_product_attention(qd, kc, vc)

        yield ("decode_attention", "fwd", f"B{b_} S{s_} Hq{hq} Hkv{hkv} D{d}", ours_dec, ref_dec,
               "jax.nn.dot_product_attention", (qd, kc, vc, lens))

    n, vocab = S["ce"]
    logits = rnd(n, vocab)
    labels = jax.random.randint(next(key), (n,), 0, vocab)
    one = jnp.ones((), jnp.float32)

    def ours_ce(logits, labels):
        return fj.cross_entropy(logits, labels)

    def ref_ce(logits, labels):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))

    def vjp_first(fn):
        def run(a, rest, cot):
            out, pullback = jax.vjp(lambda a: fn(a, *rest), a)
            return pullback(cot)
        return run

    shape = f"{n}x{vocab}"
    yield "cross_entropy", "fwd", shape, ours_ce, ref_ce, "jnp log_softmax", (logits, labels)
    yield ("cross_entropy", "fwd+bwd", shape, vjp_first(ours_ce), vjp_first(ref_ce), "jnp log_softmax",
           (logits, (labels,), one))

    n, hidden, vocab = S["lce"]
    h, wv = rnd(n, hidden), rnd(vocab, hidden)
    lab = jax.random.randint(next(key), (n,), 0, vocab)

    def ours_lce(h, wv, lab):
        return fj.linear_cross_entropy(h, wv, lab)

    def ref_lce(h, wv, lab):
        return ref_ce(h @ wv.T, lab)

    def vjp_two(fn):
        def run(h, wv, lab, cot):
            out, pullback = jax.vjp(lambda h, wv: fn(h, wv, lab), h, wv)
            return pullback(cot)
        return run

    shape = f"{n}x{hidden} V{vocab}"
    yield "linear_cross_entropy", "fwd", shape, ours_lce, ref_lce, "jnp (h @ W.T)", (h, wv, lab)
    yield ("linear_cross_entropy", "fwd+bwd", shape, vjp_two(ours_lce), vjp_two(ref_lce), "jnp (h @ W.T)",
           (h, wv, lab, one))

    B, Sq, H, D = S["rotary"]
    xr, dyr = rnd(B, Sq, H, D), rnd(B, Sq, H, D)
    cos, sin = rnd(Sq, D // 2), rnd(Sq, D // 2)

    def ours_rope(xr):
        return fj.rotary_embedding(xr, cos, sin)

    def ref_rope(xr):
        c2, s2 = jnp.concatenate([cos, cos], -1)[:, None], jnp.concatenate([sin, sin], -1)[:, None]
        x1, x2 = xr[..., : D // 2], xr[..., D // 2:]
        return xr * c2 + jnp.concatenate([-x2, x1], -1) * s2

    shape = f"B{B} S{Sq} H{H} D{D}"
    yield "rotary_embedding", "fwd", shape, ours_rope, ref_rope, "jnp", (xr,)
    yield "rotary_embedding", "fwd+bwd", shape, vjp(ours_rope), vjp(ref_rope), "jnp", (xr, dyr)

    rows, cols = S["swiglu"]
    g, u, dys = rnd(rows, cols), rnd(rows, cols), rnd(rows, cols)

    def ours_swiglu(g, u):
        return fj.swiglu(g, u)

    def ref_swiglu(g, u):
        return jax.nn.silu(g) * u

    shape = f"{rows}x{cols}"
    yield "swiglu", "fwd", shape, ours_swiglu, ref_swiglu, "jax.nn.silu(g) * u", (g, u)
    yield "swiglu", "fwd+bwd", shape, vjp(ours_swiglu), vjp(ref_swiglu), "jax.nn.silu(g) * u", (g, u, dys)

    rows, cols = S["norm"]
    res = rnd(rows, cols)

    def ours_ldr(x, w, b, res):
        return fj.layer_norm_dropout_residual(x, w, b, res, dropout_p=0.1, seed=1234)

    def ref_ldr(x, w, b, res):
        keep = jax.random.bernoulli(jax.random.key(1234), 0.9, x.shape)
        return (jnp.where(keep, ln_ref(x, w, b).astype(jnp.float32) / 0.9, 0.0) + res).astype(x.dtype)

    shape = f"{rows}x{cols} p0.1"
    yield "layer_norm_dropout_residual", "fwd", shape, ours_ldr, ref_ldr, "jnp + jax.random", (x, w, b, res)
    yield ("layer_norm_dropout_residual", "fwd+bwd", shape, vjp(ours_ldr), vjp(ref_ldr), "jnp + jax.random",
           (x, w, b, res, dy))

    (B, Sq, H, D), docs, block = S["sparse"]
    qs, ks, vs, dos = (rnd(B, Sq, H, D) for _ in range(4))
    mask = masks.document(docs, causal=True, block_size=block)
    dense = jnp.asarray(mask.to_dense())
    mask = fj.mask_to_device(mask)

    def ours_sparse(q, k, v):
        return fj.flash_attention(q, k, v, block_mask=mask)

    def ref_sparse(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense)

    shape = f"B{B} S{Sq} H{H} D{D} document"
    yield ("block_sparse_attention", "fwd", shape, ours_sparse, ref_sparse, "jax.nn.dot_product_attention(mask=)",
           (qs, ks, vs))
    yield ("block_sparse_attention", "fwd+bwd", shape, vjp(ours_sparse), vjp(ref_sparse),
           "jax.nn.dot_product_attention(mask=)", (qs, ks, vs, dos))

    def mla_ref(q, kv, dv, causal):
        s = jnp.einsum("bqhd,bkd->bhqk", q, kv, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
        if causal:
            sq, sk = q.shape[1], kv.shape[1]
            s = jnp.where(jnp.tril(jnp.ones((sq, sk), bool), sk - sq), s, -jnp.inf)
        p = jax.nn.softmax(s, -1).astype(q.dtype)
        return jnp.einsum("bhqk,bkd->bqhd", p, kv[..., :dv])

    B, Sq, H, Dqk, Dv = S["mla"]
    qm, kvm, dom = rnd(B, Sq, H, Dqk), rnd(B, Sq, Dqk), rnd(B, Sq, H, Dv)

    def ours_mla(q, kv):
        return fj.mla_attention(q, kv, head_dim_v=Dv, causal=True)

    def ref_mla(q, kv):
        return mla_ref(q, kv, Dv, True)

    shape = f"B{B} S{Sq} H{H} D{Dqk}/{Dv} causal"
    yield "mla_attention", "fwd", shape, ours_mla, ref_mla, "jnp einsum softmax", (qm, kvm)
    yield "mla_attention", "fwd+bwd", shape, vjp(ours_mla), vjp(ref_mla), "jnp einsum softmax", (qm, kvm, dom)

    B, Sk, H, Dqk, Dv = S["mla_decode"]
    qmd, cache = rnd(B, 1, H, Dqk), rnd(B, Sk, Dqk)
    lens = jnp.full((B,), Sk, jnp.int32)

    def ours_mla_dec(q, cache, lens):
        return fj.mla_decode(q, cache, cache_seqlens=lens, head_dim_v=Dv)

    def ref_mla_dec(q, cache, lens):
        return mla_ref(q, cache, Dv, False)

    yield ("mla_decode", "fwd", f"B{B} S{Sk} H{H} D{Dqk}/{Dv}", ours_mla_dec, ref_mla_dec, "jnp einsum softmax",
           (qmd, cache, lens))

    B, Sk, Hkv, D = S["append"]
    kc, vc, kn, vn = rnd(B, Sk, Hkv, D), rnd(B, Sk, Hkv, D), rnd(B, 1, Hkv, D), rnd(B, 1, Hkv, D)
    lens = jnp.full((B,), Sk // 2, jnp.int32)

    def ours_append(kc, vc, kn, vn, lens):
        return fj.append_kv_cache(kc, vc, kn, vn, cache_seqlens=lens)

    def ref_append(kc, vc, kn, vn, lens):
        b = jnp.arange(kc.shape[0])
        return kc.at[b, lens].set(kn[:, 0]), vc.at[b, lens].set(vn[:, 0])

    yield ("append_kv_cache", "fwd", f"B{B} S{Sk} Hkv{Hkv} D{D} +1", ours_append, ref_append, "jnp .at[].set",
           (kc, vc, kn, vn, lens))

    N, Sq, H, D = S["merge"]
    outs, lses = rnd(N, Sq, H, D), rnd(N, Sq, H, dtype=jnp.float32)

    def ours_merge(outs, lses):
        return fj.merge_attention_states(outs, lses)

    def ref_merge(outs, lses):
        lse = jax.nn.logsumexp(lses, axis=0)
        w = jnp.exp(lses - lse)[..., None]
        return jnp.sum(w * outs.astype(jnp.float32), axis=0).astype(outs.dtype), lse

    yield ("merge_attention_states", "fwd", f"N{N} S{Sq} H{H} D{D}", ours_merge, ref_merge, "jnp logsumexp",
           (outs, lses))


def skip_jax_kernels() -> None:
    """Every plan the JAX front-end runs on the CPU becomes XLA zeros of its results' shapes (``--no-kernels``)."""
    import jax.numpy as jnp

    from flashbridge.jax_api import _runtime

    def zeros(plan, names, aliases, *arrays):
        return tuple(jnp.zeros(s.shape, s.dtype) for s in _runtime._result_structs(plan))

    _runtime._execute_cpu = zeros


def jax_host_us(fn, args, calls: int) -> float:
    import jax

    out = None
    for _ in range(5):
        out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        samples.append((time.perf_counter() - start) / calls * 1e6)
        jax.block_until_ready(out)
    return statistics.median(samples)


# ------------------------------------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run the harness on the CPU (host time only)")
    parser.add_argument("--framework", choices=("torch", "jax", "both"), default="both")
    parser.add_argument("--no-kernels", action="store_true",
                        help="with --cpu: JAX plans become XLA zeros, timing the host path alone")
    parser.add_argument("--only", default="", help="comma-separated substrings of op names to keep")
    parser.add_argument("--calls", type=int, default=0, help="calls per timed batch (default 100; CPU 5)")
    args = parser.parse_args()
    cpu = args.cpu
    calls = args.calls or (5 if cpu else 100)
    only = [s for s in args.only.split(",") if s]
    rows, records = [], []
    frameworks = ("torch", "jax") if args.framework == "both" else (args.framework,)
    if args.no_kernels:
        if not cpu or frameworks != ("jax",):
            parser.error("--no-kernels needs --cpu --framework jax")
        skip_jax_kernels()

    def keep(op):
        return not only or any(s in op for s in only)

    def record(framework, op, mode, shape, base_name, ours_us, base_us, ours_ms, base_ms, error=None):
        ratio = ours_us / base_us if base_us and (not cpu or args.no_kernels) else math.nan
        ok = "" if cpu or error else ("yes" if ratio <= GOAL else "NO")
        rows.append([framework, op, mode, shape, base_name, ours_us, base_us,
                     "" if math.isnan(ratio) else f"{ratio:.2f}", ok, ours_ms, base_ms, error or ""])
        records.append({"framework": framework, "op": op, "mode": mode, "shape": shape, "baseline": base_name,
                        "host_us": ours_us, "baseline_host_us": base_us,
                        "ratio": None if cpu else ratio, "within_goal": None if cpu or error else bool(ratio <= GOAL),
                        "device_ms": ours_ms, "baseline_device_ms": base_ms, "error": error})
        if not cpu:  # a run cut short keeps what it measured
            save("host_overhead_h200", {"goal_ratio": GOAL, "calls_per_batch": calls, "rows": records})

    if "torch" in frameworks:
        for op, mode, shape, ours, theirs, base_name in torch_cases(cpu):
            if not keep(op):
                continue
            n = max(1, calls // 2) if mode != "fwd" else calls
            try:
                ours_us, base_us = torch_host_us(ours, n, cpu), torch_host_us(theirs, n, cpu)
                ours_ms = math.nan if cpu else time_torch(ours)
                base_ms = math.nan if cpu else time_torch(theirs)
                record("torch", op, mode, shape, base_name, ours_us, base_us, ours_ms, base_ms)
            except Exception as exc:  # noqa: BLE001 -- one failing row must not lose the others
                record("torch", op, mode, shape, base_name, math.nan, math.nan, math.nan, math.nan, repr(exc)[:200])
    if "jax" in frameworks:
        for op, mode, shape, ours, theirs, base_name, fargs in jax_cases(cpu):
            if not keep(op):
                continue
            n = max(1, calls // 2) if mode != "fwd" else calls
            try:
                ours_us, base_us = jax_host_us(ours, fargs, n), jax_host_us(theirs, fargs, n)
                ours_ms = math.nan if cpu else time_jax(ours, *fargs)
                base_ms = math.nan if cpu else time_jax(theirs, *fargs)
                record("jax", op, mode, shape, base_name, ours_us, base_us, ours_ms, base_ms)
            except Exception as exc:  # noqa: BLE001
                record("jax", op, mode, shape, base_name, math.nan, math.nan, math.nan, math.nan, repr(exc)[:200])
    title = "Host time per eager call (us), ours vs the framework's op" + (" (CPU harness check)" if cpu else "")
    print_table(title, ["fw", "op", "mode", "shape", "baseline", "ours us", "theirs us", "ratio",
                        f"<= {GOAL}x", "ours dev ms", "theirs dev ms", "error"], rows)
    if not cpu:
        within = sum(bool(r["within_goal"]) for r in records)
        print(f"{within} of {len(records)} rows within {GOAL}x of the framework's own op")


if __name__ == "__main__":
    main()
