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
                "ce": (16, 256), "lce": (16, 32, 256), "rotary": (1, 16, 2, 32), "swiglu": (8, 64)}
    return {"norm": (64, 1024), "attn": (1, 128, 16, 64),
            "decode": [(1, 4096), (1, 32768), (8, 4096), (8, 32768)], "decode_heads": (32, 8, 128),
            "ce": (256, 32000), "lce": (256, 1024, 32000), "rotary": (1, 128, 16, 128), "swiglu": (64, 4096)}


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
    parser.add_argument("--only", default="", help="comma-separated substrings of op names to keep")
    parser.add_argument("--calls", type=int, default=0, help="calls per timed batch (default 100; CPU 5)")
    args = parser.parse_args()
    cpu = args.cpu
    calls = args.calls or (5 if cpu else 100)
    only = [s for s in args.only.split(",") if s]
    rows, records = [], []
    frameworks = ("torch", "jax") if args.framework == "both" else (args.framework,)

    def keep(op):
        return not only or any(s in op for s in only)

    def record(framework, op, mode, shape, base_name, ours_us, base_us, ours_ms, base_ms, error=None):
        ratio = ours_us / base_us if base_us and not cpu else math.nan
        ok = "" if cpu or error else ("yes" if ratio <= GOAL else "NO")
        rows.append([framework, op, mode, shape, base_name, ours_us, base_us,
                     "" if cpu else f"{ratio:.2f}", ok, ours_ms, base_ms, error or ""])
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
