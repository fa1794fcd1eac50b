"""FlashAttention benchmark on a CUDA GPU: ours (torch and JAX paths) beside SDPA (flash and cuDNN
backends), FlexAttention (compiled) and jax.nn.dot_product_attention (cuDNN), same inputs, same run.

TFLOP/s = 4 * B * H * Sq * Sk * D forward (halved when causal; for windows and packed batches the exact
count of visible (query, key) pairs replaces Sq * Sk), backward = 2.5 x forward. bf16 throughout.

    python benchmarks/bench_attention.py              # main grid, GQA / varlen / window rows, plot
    python benchmarks/bench_attention.py --quick      # D=128 only, S=4096 (the target rows' length)
    python benchmarks/bench_attention.py --tune       # also time block-size candidates for plan defaults
    python benchmarks/bench_attention.py --tune-only --dims 64,256   # only the candidates
    python benchmarks/bench_attention.py --order-only  # only head_group / fused_backward (AttentionConfig)
    python benchmarks/bench_attention.py --ab 4       # the defaults against fused_backward=False, alternating 4x
    python benchmarks/bench_attention.py --ab 4 --ab-config '{"dkdv_block_m": 32}'   # ... against another setting
    python benchmarks/bench_attention.py --bar-rows 5   # the target rows: ours, Flex and SDPA flash alternating 5x
    python benchmarks/bench_attention.py --dropout 5    # dropout_p=0.1 against 0 (forward, backward), alternating 5x
    python benchmarks/bench_attention.py --dims 64 --seqlens 1024 --no-extra \
        --only 'flashbridge-torch steady,flashbridge-jax steady' --tag cmdbuf   # some rows, a named file
    python benchmarks/bench_attention.py --steady-diagnosis 64,1024   # why the JAX steady forward trails there
    python benchmarks/bench_attention.py --ptxas      # no GPU needed: compile every kernel for sm_90 ahead
                                                      # of time, print registers / spills / shared memory
                                                      # and wgmma / wait counts (SERIALIZED: a wait after
                                                      # every tensor-core MMA)
"""
from __future__ import annotations

import argparse
import json
import functools
import os
import traceback

from _common import (compile_launch_sm90, environment, kernel_trace, launch_trace, print_table, save, save_figure,
                     time_jax, time_jax_steady, time_torch, time_torch_steady)

import numpy as np
import torch
import torch.nn.functional as F

from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                      plan_attention_fwd)
from flashbridge.torch_api._runtime import execute, target_for
from flashbridge.torch_api.attention import flash_attention

H = 16
TOKENS = 16384  # B * S
# Steady rows: this many distinct input sets back to back (one CUDA graph in torch, one jitted function in
# JAX; no host time, no L2 flush) — the like-for-like torch / JAX comparison (see bench_norms.py).
STEADY_SETS = 8
SEQLENS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128, 256)


# ------------------------------------------------------------------------------------------- flop counts

def visible_pairs(sq, sk, causal, window=(-1, -1)):
    """Number of (query, key) pairs a query sees, bottom-right aligned (exact, O(Sq))."""
    i = np.arange(sq) + (sk - sq)
    hi = np.minimum(i if causal else (i + window[1] if window[1] >= 0 else np.full(sq, sk - 1)), sk - 1)
    lo = np.maximum(i - window[0], 0) if window[0] >= 0 else np.zeros(sq, dtype=np.int64)
    return int(np.maximum(hi - lo + 1, 0).sum())


def tflops(pairs, b, h, d, ms, backward):
    flops = 4.0 * b * h * pairs * d * (2.5 if backward else 1.0)
    return flops / (ms * 1e-3) / 1e12


@functools.lru_cache(maxsize=None)
def _generator():
    """A CUDA generator of the benchmark's own: the throwaway capture of ``_timing`` leaves torch's default
    CUDA generator unusable (see ``_absorb_first_backward_capture``)."""
    return torch.Generator(device="cuda").manual_seed(0)


def randn(*shape, dtype=torch.bfloat16, requires_grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=_generator()).requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------- providers

def _time_fwd_bwd(fn, leaves):
    """(forward ms, backward ms) of ``fn()`` (a torch function of ``leaves``)."""
    with torch.no_grad():
        fwd_ms = time_torch(fn)
    out = fn()
    dout = randn(*out.shape, dtype=out.dtype)
    bwd_ms = time_torch(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True))
    return fwd_ms, bwd_ms


_FLEX = []


def _compiled_flex(flex_attention):
    """One compiled flex_attention for the whole run, specialised per shape (dynamic=False). A new
    torch.compile per row recompiles the same function each time until dynamo's recompile limit (8), after
    which it silently runs the unfused eager implementation (timed at 17 TFLOP/s on the H200); one shared
    compile without dynamic=False turns dynamic at the second shape and its generic kernels ran 10-20%
    slower. The backward is timed repeatedly on one graph (retain_graph=True), which compiled backward
    graphs refuse with donated buffers."""
    if not _FLEX:
        import torch._dynamo
        import torch._functorch.config

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        torch._functorch.config.donated_buffer = False
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def torch_providers(b, s, hq, hkv, d, causal, window=(-1, -1)):
    """name -> callable returning (fwd_ms, bwd_ms); every provider gets fresh bf16 inputs."""

    def bshd():
        q = randn(b, s, hq, d, requires_grad=True)
        k = randn(b, s, hkv, d, requires_grad=True)
        v = randn(b, s, hkv, d, requires_grad=True)
        return q, k, v

    def bhsd():
        q = randn(b, hq, s, d, requires_grad=True)
        k = randn(b, hkv, s, d, requires_grad=True)
        v = randn(b, hkv, s, d, requires_grad=True)
        return q, k, v

    def ours():
        q, k, v = bshd()
        return _time_fwd_bwd(lambda: flash_attention(q, k, v, causal=causal, window_size=window), (q, k, v))

    def ours_steady():
        sets = [bshd() for _ in range(STEADY_SETS)]
        call = functools.partial(flash_attention, causal=causal, window_size=window)
        with torch.no_grad():
            fwd_ms = time_torch_steady(call, sets)
        grads = []
        for q, k, v in sets:
            out = call(q, k, v)
            grads.append((out, (q, k, v), randn(*out.shape, dtype=out.dtype)))
        bwd_ms = time_torch_steady(lambda o, leaves, g: torch.autograd.grad(o, leaves, g, retain_graph=True), grads)
        return fwd_ms, bwd_ms

    def sdpa(backend):
        def run():
            from torch.nn.attention import sdpa_kernel
            q, k, v = bhsd()
            with sdpa_kernel(backend):
                return _time_fwd_bwd(lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, enable_gqa=hq != hkv), (q, k, v))
        return run

    def flex():
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        q, k, v = bhsd()
        left = window[0]

        def mask_mod(b_, h_, qi, ki):
            ok = ki <= qi if causal else qi >= 0
            if left >= 0:
                ok = ok & (qi - ki <= left)
            return ok

        block_mask = create_block_mask(mask_mod, None, None, s, s, device="cuda") if (causal or left >= 0) else None
        compiled = _compiled_flex(flex_attention)
        return _time_fwd_bwd(lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv), (q, k, v))

    from torch.nn.attention import SDPBackend
    out = {"flashbridge-torch": ours, "flashbridge-torch steady": ours_steady, "flex (compiled)": flex}
    if window == (-1, -1) or window[0] < 0:
        out["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
        out["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return out


def jax_providers(b, s, hq, hkv, d, causal, window=(-1, -1)):
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.attention import flash_attention as jfa

    # random cotangents as on the torch side: a constant dO (ones) made the JAX backward rows 2-8% faster than
    # the same kernels on the torch side (S=16384 causal 6.71 vs 7.30 ms; presumably constant operands draw less
    # power and the clocks stay higher)
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16)

    def timed(f):
        def run():
            fwd_ms = time_jax(f, q, k, v)
            out, vjp_fn = jax.vjp(f, q, k, v)
            dout = jax.random.normal(jax.random.key(2), out.shape, out.dtype)
            bwd_ms = time_jax(lambda fn, ct: fn(ct), vjp_fn, dout)
            return fwd_ms, bwd_ms
        return run

    def steady(f):
        def run():
            keys = jax.random.split(jax.random.key(1), STEADY_SETS)
            sets = [tuple(jax.random.normal(sub, a.shape, a.dtype)
                          for sub, a in zip(jax.random.split(key, 3), (q, k, v))) for key in keys]
            fwd_ms = time_jax_steady(f, sets)
            vjps = []
            for args, key in zip(sets, jax.random.split(jax.random.key(3), STEADY_SETS)):
                out, vjp_fn = jax.vjp(f, *args)
                vjps.append((vjp_fn, jax.random.normal(key, out.shape, out.dtype)))
            return fwd_ms, time_jax_steady(lambda fn, ct: fn(ct), vjps)
        return run

    ours = lambda q, k, v: jfa(q, k, v, causal=causal, window_size=window)  # noqa: E731
    out = {"flashbridge-jax": timed(ours), "flashbridge-jax steady": steady(ours)}
    if window == (-1, -1):
        out["jax.nn cudnn"] = timed(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"))
    return out


def bench(b, s, hq, hkv, d, causal, window=(-1, -1), with_jax=True, only=None):
    """Every provider's (forward, backward) times and TFLOP/s; ``only``: the provider names to run."""
    pairs = visible_pairs(s, s, causal, window)
    providers = torch_providers(b, s, hq, hkv, d, causal, window)
    if with_jax:
        try:
            providers.update(jax_providers(b, s, hq, hkv, d, causal, window))
        except ImportError as exc:
            print(f"JAX unavailable: {exc}")
    if only:
        providers = {name: run for name, run in providers.items() if name in only}
    res = {}
    for name, run in providers.items():
        try:
            fwd_ms, bwd_ms = run()
            res[name] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "fwd_tflops": tflops(pairs, b, hq, d, fwd_ms, False),
                         "bwd_tflops": tflops(pairs, b, hq, d, bwd_ms, True)}
        except Exception as exc:  # a baseline that does not support the shape: recorded, not fatal
            res[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            print(f"{name} failed on B={b} S={s} D={d} causal={causal}: {exc}")
        torch.cuda.empty_cache()
    return res


def bench_varlen(lengths, hq, hkv, d, causal):
    """Packed ragged batch: ours (torch) only; TFLOP/s from the exact visible pairs of every sequence."""
    total = sum(lengths)
    q = randn(total, hq, d, requires_grad=True)
    k = randn(total, hkv, d, requires_grad=True)
    v = randn(total, hkv, d, requires_grad=True)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), causal=causal)
    fwd_ms, bwd_ms = _time_fwd_bwd(lambda: flash_attention(q, k, v, **kw), (q, k, v))
    pairs = sum(visible_pairs(n, n, causal) for n in lengths)
    return {"flashbridge-torch": {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
                                  "fwd_tflops": tflops(pairs, 1, hq, d, fwd_ms, False),
                                  "bwd_tflops": tflops(pairs, 1, hq, d, bwd_ms, True)}}


def trace_paths(b, s, h, d, causal):
    """Kernel-by-kernel device time of one forward and one backward call of both frameworks' paths
    (``kernel_trace``): whether the JAX path's difference is the kernels or what runs around them."""
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.attention import flash_attention as jfa

    q, k, v = (randn(b, s, h, d, requires_grad=True) for _ in range(3))
    out = flash_attention(q, k, v, causal=causal)
    dout = randn(*out.shape, dtype=out.dtype)
    jq, jk, jv, jdout = (jnp.asarray(t.detach().float().cpu().numpy(), jnp.bfloat16) for t in (q, k, v, dout))
    fwd = jax.jit(lambda q, k, v: jfa(q, k, v, causal=causal))
    _, vjp_fn = jax.vjp(lambda q, k, v: jfa(q, k, v, causal=causal), jq, jk, jv)
    bwd = jax.jit(lambda fn, ct: fn(ct))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    label = f"D{d} S{s} {'causal' if causal else 'full'}"
    return {
        "case": label,
        "torch_fwd": kernel_trace(lambda: (flash_attention(qd, kd, vd, causal=causal), torch.cuda.synchronize()),
                                  label=f"torch forward {label}"),
        "jax_fwd": kernel_trace(lambda: jax.block_until_ready(fwd(jq, jk, jv)), label=f"jax forward {label}"),
        "torch_bwd": kernel_trace(lambda: (torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                           torch.cuda.synchronize()), label=f"torch backward {label}"),
        "jax_bwd": kernel_trace(lambda: jax.block_until_ready(bwd(vjp_fn, jdout)), label=f"jax backward {label}"),
    }


def steady_diagnosis(b, s, h, d, causal):
    """Where the JAX steady forward loses to torch's at short lengths: both steady loops timed on the same
    bits (torch's input sets handed to JAX through dlpack, JAX's ``jax.random.normal`` sets to torch), and
    the device activity of each steady loop (per-kernel time, busy fraction between the loop's first and
    last kernel). Same kernel time + idle gaps: the launches; slower kernels on one set of data: the data."""
    import jax
    import jax.numpy as jnp

    from flashbridge._timing import _capture
    from flashbridge.jax_api.attention import flash_attention as jfa

    torch_sets = [tuple(randn(b, s, h, d) for _ in range(3)) for _ in range(STEADY_SETS)]
    jax_sets = [tuple(jax.random.normal(sub, (b, s, h, d), jnp.bfloat16) for sub in jax.random.split(key, 3))
                for key in jax.random.split(jax.random.key(1), STEADY_SETS)]
    torch.cuda.synchronize()
    torch_to_jax = [tuple(jax.dlpack.from_dlpack(t) for t in ts) for ts in torch_sets]
    jax_to_torch = [tuple(torch.from_dlpack(a) for a in js) for js in jax_sets]
    call = functools.partial(flash_attention, causal=causal)

    def jcall(q, k, v):
        return jfa(q, k, v, causal=causal)

    label = f"D{d} S{s} {'causal' if causal else 'full'}"
    times = {}
    with torch.no_grad():
        times["torch, torch data"] = time_torch_steady(call, torch_sets)
        times["torch, jax data"] = time_torch_steady(call, jax_to_torch)
        graph = _capture(call, torch_sets)
    times["jax, torch data"] = time_jax_steady(jcall, torch_to_jax)
    times["jax, jax data"] = time_jax_steady(jcall, jax_sets)
    print_table(f"steady forward ms per call, {label}", ["loop, inputs", "ms"], [[k, v] for k, v in times.items()])
    loop = jax.jit(lambda sets: [jcall(*a) for a in sets])
    torch_summary, jax_summary = {}, {}
    traces = {
        "torch_graph": kernel_trace(lambda: (graph.replay(), torch.cuda.synchronize()), summary=torch_summary,
                                    label=f"torch steady forward {label}, {STEADY_SETS} calls in one graph"),
        "jax_loop": kernel_trace(lambda: jax.block_until_ready(loop(torch_to_jax)), summary=jax_summary,
                                 label=f"jax steady forward {label}, {STEADY_SETS} calls in one jit"),
    }
    trace_dir = os.environ.get("OUT")
    chrome_trace = trace_dir and os.path.join(trace_dir, f"chrome_trace_jax_{label.replace(' ', '_')}.json")
    launches = {
        "torch_graph": launch_trace(lambda: (graph.replay(), torch.cuda.synchronize())),
        "jax_loop": launch_trace(lambda: jax.block_until_ready(loop(torch_to_jax)), path=chrome_trace),
    }

    def batch():  # the steady timing's own batch: executions back to back, one synchronisation (time_jax)
        for _ in range(6):
            out = loop(torch_to_jax)
        jax.block_until_ready(out)

    launches["jax_batch"] = launch_trace(batch, calls=1)
    return {"case": label, "steady_fwd_ms": times, "traces": traces, "launches": launches,
            "busy": {"torch_graph": torch_summary, "jax_loop": jax_summary}}


BAR_PROVIDERS = ("flashbridge-torch", "flex (compiled)", "sdpa-flash")


def bar_rows(reps: int, d: int = 128, seqlens=(4096, 16384)) -> list[dict]:
    """The target rows (forward >= Flex and >= 1.4x SDPA flash, backward >= Flex), each provider timed per call
    ``reps`` times, the providers alternating within each round (fresh inputs every time), so that a
    comparison of two providers does not ride on one sample each or on the drift between runs (~3%)."""
    out = []
    for s in seqlens:
        for causal in (False, True):
            b = TOKENS // s
            providers = torch_providers(b, s, H, H, d, causal)
            pairs = visible_pairs(s, s, causal)
            samples = {name: [] for name in BAR_PROVIDERS}
            for _ in range(reps):
                for name in BAR_PROVIDERS:
                    fwd_ms, bwd_ms = providers[name]()
                    samples[name].append((tflops(pairs, b, H, d, fwd_ms, False), tflops(pairs, b, H, d, bwd_ms, True)))
                    torch.cuda.empty_cache()
            med = {name: (float(np.median([x[0] for x in v])), float(np.median([x[1] for x in v])))
                   for name, v in samples.items()}
            ours, flex, sdpa = (med[n] for n in BAR_PROVIDERS)

            def paired(i, base):  # median over rounds of ours / base within a round (seconds apart)
                return float(np.median([a[i] / c[i] for a, c in zip(samples[BAR_PROVIDERS[0]], samples[base])]))

            row = {"case": f"D{d} S{s} {'causal' if causal else 'full'}", "b": b, "s": s, "d": d, "causal": causal,
                   "samples": samples, "median": med, "fwd_vs_flex": ours[0] / flex[0],
                   "fwd_vs_sdpa_flash": ours[0] / sdpa[0], "bwd_vs_flex": ours[1] / flex[1],
                   "paired": {"fwd_vs_flex": paired(0, "flex (compiled)"), "fwd_vs_sdpa_flash": paired(0, "sdpa-flash"),
                              "bwd_vs_flex": paired(1, "flex (compiled)")}}
            out.append(row)
            print(f"{row['case']}: median TFLOP/s forward ours {ours[0]:.1f} / Flex {flex[0]:.1f} / SDPA flash "
                  f"{sdpa[0]:.1f} ({row['fwd_vs_flex']:.3f}x Flex, {row['fwd_vs_sdpa_flash']:.3f}x SDPA flash; bar "
                  f"1.0 / 1.4), backward ours {ours[1]:.1f} / Flex {flex[1]:.1f} ({row['bwd_vs_flex']:.3f}x; bar 1.0); "
                  f"per-round ratios' medians {row['paired']['fwd_vs_flex']:.3f} / "
                  f"{row['paired']['fwd_vs_sdpa_flash']:.3f} / {row['paired']['bwd_vs_flex']:.3f}")
    return out


def dropout_rows(reps: int, p: float = 0.1, d: int = 128, seqlens=(4096, 16384)) -> list[dict]:
    """Attention dropout's cost: ``flash_attention(..., dropout_p=p, seed=...)`` against ``dropout_p=0`` on the
    same inputs (torch path, MHA H=16, B * S = 16384, full and causal), forward and backward timed per call,
    the two alternating ``reps`` times in one process; the bar is p=0.1 within 15% of p=0 (ratio >= 0.87)."""
    out = []
    seed = torch.tensor([1234], dtype=torch.int32, device="cuda")
    for s in seqlens:
        for causal in (False, True):
            b = TOKENS // s
            q, k, v = (randn(b, s, H, d, requires_grad=True) for _ in range(3))
            pairs = visible_pairs(s, s, causal)
            runs = {0.0: lambda: flash_attention(q, k, v, causal=causal),
                    p: lambda: flash_attention(q, k, v, causal=causal, dropout_p=p, seed=seed)}
            samples = {0.0: [], p: []}
            for _ in range(reps):
                for key, fn in runs.items():
                    samples[key].append(_time_fwd_bwd(fn, (q, k, v)))
                    torch.cuda.empty_cache()
            med = {key: (float(np.median([x[0] for x in v])), float(np.median([x[1] for x in v])))
                   for key, v in samples.items()}
            row = {"case": f"D{d} S{s} {'causal' if causal else 'full'}", "b": b, "s": s, "d": d, "causal": causal,
                   "dropout_p": p, "samples_ms": {str(key): v for key, v in samples.items()},
                   "median_ms": {str(key): v for key, v in med.items()},
                   "tflops": {str(key): (tflops(pairs, b, H, d, v[0], False), tflops(pairs, b, H, d, v[1], True))
                              for key, v in med.items()},
                   "fwd_ratio": med[0.0][0] / med[p][0], "bwd_ratio": med[0.0][1] / med[p][1],
                   "fwd_bwd_ratio": sum(med[0.0]) / sum(med[p])}
            out.append(row)
            print(f"{row['case']}: p=0 {med[0.0][0]:.3f} / {med[0.0][1]:.3f} ms, p={p} {med[p][0]:.3f} / "
                  f"{med[p][1]:.3f} ms (forward / backward); speed ratio forward {row['fwd_ratio']:.3f}, backward "
                  f"{row['bwd_ratio']:.3f}, both {row['fwd_bwd_ratio']:.3f} (bar >= 0.87)", flush=True)
    return out


# --------------------------------------------------------------------------------------------------- tune

# program-level AttentionConfig settings --tune / --order-only time with the default tiles: the program
# orders (head_group; None = the default, 4 when causal) and the one-launch backward (fused_backward)
PROGRAM_CONFIGS = (dict(head_group=1), dict(head_group=4), dict(head_group=8), dict(head_group=16),
                   dict(head_group=64), dict(fused_backward=False), dict(fused_backward=False, head_group=1))
# --order-only: the defaults against grid order and the two-launch backward (head_group 8 / 16 / 64 were
# timed on 2026-11-30 and lost to 4; fewer settings compile fewer kernels)
ORDER_ONLY_CONFIGS = (dict(head_group=1), dict(), dict(fused_backward=False), dict(fused_backward=False, head_group=1))
def default_tiles(shape, options, target) -> dict:
    """The plan's (block_m, block_n, num_warps, num_stages) of the forward, dK/dV and dQ kernels: what the
    tuning cache resolves for this call on this GPU (flashbridge.tiles.cache)."""
    def tile(launch):
        c = launch.constexpr_dict()
        return (c["BLOCK_M"], c["BLOCK_N"], launch.num_warps, launch.num_stages)

    bwd = plan_attention_bwd(shape, options, target=target, config=AttentionConfig(fused_backward=False))
    return {"fwd": tile(plan_attention_fwd(shape, options, target=target).launches[0]),
            "dkdv": tile(next(l for l in bwd.launches if l.kernel.endswith("attn_bwd_dkdv_kernel"))),
            "dq": tile(next(l for l in bwd.launches if l.kernel.endswith("attn_bwd_dq_kernel")))}


# (block_m, block_n, num_warps, num_stages) tried by --tune beside the plan's defaults (the tuning cache's, which the
# sweep of 2026-11-30 chose from these lists): neighbours of the bests, smaller tiles for D=256, where a
# 128-wide K/V tile exceeds shared memory
TUNE_CANDIDATES = {
    64: {"fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3),
                 (64, 128, 4, 3), (128, 64, 4, 4)],
         "dkdv": [(32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (32, 128, 8, 3),
                  (64, 64, 8, 2)],
         "dq": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 8, 3)]},
    128: {"fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3),
                  (128, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 4),
                  (128, 64, 8, 4), (128, 128, 8, 4), (64, 128, 4, 3), (64, 128, 8, 3)],
          "dkdv": [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 8, 2), (32, 128, 8, 2),
                   (16, 128, 8, 3), (32, 32, 8, 2), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 4),
                   (64, 64, 4, 3), (32, 64, 8, 3), (16, 64, 4, 3), (32, 32, 4, 3)],
          "dq": [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 2), (128, 64, 8, 3), (64, 32, 8, 2),
                 (128, 32, 4, 3), (64, 64, 4, 3), (64, 16, 8, 2), (32, 32, 8, 2),
                 (128, 64, 8, 4), (128, 128, 8, 3), (64, 128, 8, 3), (128, 32, 8, 4)]},
    256: {"fwd": [(64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3),
                  (128, 64, 8, 3)],
          # run with the default column split (GPU_DKDV_COL_SPLIT) like the plan's own tile
          "dkdv": [(32, 64, 8, 2), (16, 64, 4, 2), (64, 32, 8, 2), (32, 32, 4, 2), (64, 64, 8, 2), (16, 128, 8, 2),
                   (64, 128, 8, 2), (32, 128, 4, 2)],
          "dq": [(64, 16, 8, 2), (32, 32, 8, 2), (64, 64, 8, 2), (128, 32, 8, 2), (32, 64, 4, 2)]},
}


def time_program_configs(b, s, hq, hkv, d, causal, configs=PROGRAM_CONFIGS):
    """Forward and whole-backward times of the default tiles for each program-level setting (``configs``:
    AttentionConfig keyword dicts): the program orders (head_group, see block_schedule: the longest causal
    blocks of G heads first) and the one-launch backward (fused_backward)."""
    q, dout = randn(b, s, hq, d), randn(b, s, hq, d)
    k, v = randn(b, s, hkv, d), randn(b, s, hkv, d)
    info_q, info_kv = ((b, s, hq, d), "bfloat16"), ((b, s, hkv, d), "bfloat16")
    shape, options = check_attention_args(q=info_q, k=info_kv, v=info_kv, causal=causal)
    target = target_for(q.device)
    pairs = visible_pairs(s, s, causal)
    rows = []
    for settings in configs:
        label = {"case": f"B{b} S{s} H{hq}/{hkv} D{d} {'causal' if causal else 'full'}", **settings}
        try:
            cfg = AttentionConfig(**settings)
            plan = plan_attention_fwd(shape, options, target=target, config=cfg)
            out, lse = execute(plan, {"q": q, "k": k, "v": v})
            fwd_ms = time_torch(lambda: execute(plan, {"q": q, "k": k, "v": v}))
            bplan = plan_attention_bwd(shape, options, target=target, config=cfg)
            inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
            bwd_ms = time_torch(lambda: execute(bplan, inputs))
            row = {"kernel": "order", **label, "ms": fwd_ms, "tflops": tflops(pairs, b, hq, d, fwd_ms, False),
                   "bwd_ms": bwd_ms, "bwd_tflops": tflops(pairs, b, hq, d, bwd_ms, True)}
        except Exception as exc:
            row = {"kernel": "order", **label, "error": str(exc)[:120]}
        print("order", row, flush=True)
        rows.append(row)
    return rows


def tune(d, causal, s=4096):
    """Time the three main kernels for block-size candidates (plan + runtime directly, no autograd)."""
    b = TOKENS // s
    q, k, v, dout = (randn(b, s, H, d) for _ in range(4))
    info = ((b, s, H, d), "bfloat16")
    shape, options = check_attention_args(q=info, k=info, v=info, causal=causal)
    target = target_for(q.device)
    pairs = visible_pairs(s, s, causal)
    rows = []

    def keep(row):  # printed as measured: a run cut short still shows what it timed
        rows.append(row)
        print(f"tune D={d} causal={causal}", row, flush=True)

    tiles = default_tiles(shape, options, target)
    cands = TUNE_CANDIDATES[d]
    # the plan's defaults first (full and masked forward), then the candidates around them
    fwd_cands = list(dict.fromkeys([tiles["fwd"], *cands["fwd"]]))
    out = lse = None
    for bm, bn, w, st in fwd_cands:
        cfg = AttentionConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
        try:
            plan = plan_attention_fwd(shape, options, target=target, config=cfg)
            out, lse = execute(plan, {"q": q, "k": k, "v": v})
            ms = time_torch(lambda: execute(plan, {"q": q, "k": k, "v": v}))
            keep({"kernel": "fwd", "tile": (bm, bn, w, st), "ms": ms,
                         "tflops": tflops(pairs, b, H, d, ms, False)})
        except Exception as exc:
            keep({"kernel": "fwd", "tile": (bm, bn, w, st), "error": str(exc)[:120]})
    if out is None:
        return rows
    for masked in (1, 2, 3):  # the default tile with other masked-segment depths (sm_90 spills differ: docs/performance.md)
        cfg = AttentionConfig(masked_num_stages=masked)
        try:
            plan = plan_attention_fwd(shape, options, target=target, config=cfg)
            ms = time_torch(lambda: execute(plan, {"q": q, "k": k, "v": v}))
            keep({"kernel": "fwd", "tile": f"default, masked_num_stages={masked}", "ms": ms,
                         "tflops": tflops(pairs, b, H, d, ms, False)})
        except Exception as exc:
            keep({"kernel": "fwd", "tile": f"default, masked_num_stages={masked}", "error": str(exc)[:120]})
    rows += time_program_configs(b, s, H, H, d, causal)
    # the plan's dK/dV default: the "dkdv_split" tile where the head dim splits dK/dV's columns (GPU_DKDV_COL_SPLIT;
    # the candidates then run split too)
    defaults = {"dkdv": tiles["dkdv"], "dq": tiles["dq"]}
    bwd_cands = {kernel: list(dict.fromkeys([defaults[kernel], *cands[kernel]])) for kernel in ("dkdv", "dq")}
    inputs = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}
    for kernel, cands in bwd_cands.items():
        for tile in cands:
            bm, bn, w, st = tile
            # two launches, so that each kernel runs at its own tile's warps and stages
            cfg = AttentionConfig(**{f"{kernel}_block_m": bm, f"{kernel}_block_n": bn,
                                     f"{kernel}_num_warps": w, f"{kernel}_num_stages": st}, fused_backward=False)
            try:
                plan = plan_attention_bwd(shape, options, target=target, config=cfg)
                execute(plan, inputs)
                ms = time_torch(lambda: execute(plan, inputs))
                # the whole backward (preprocess + dkdv + dq) is timed; only this kernel's tile changes
                keep({"kernel": kernel, "tile": tile, "bwd_ms": ms,
                             "bwd_tflops": tflops(pairs, b, H, d, ms, True)})
            except Exception as exc:
                keep({"kernel": kernel, "tile": tile, "error": str(exc)[:120]})
    return rows


# ------------------------------------------------------------------------------------------------ ptxas

def ptxas_report(dims=HEAD_DIMS, dtypes=("bfloat16",)):
    """Compile the default plans for sm_90 without a GPU (Triton's bundled ptxas) and print each kernel's
    registers, stack (spills) and wgmma / wait counts; see _common.compile_launch_sm90 for the
    specialisation and the serialization flag."""
    from flashbridge.core_kernels import Target

    target = Target(interpret=False, num_sms=132)
    for dtype in dtypes:
        for d in dims:
            for causal in (False, True):
                info = ((2, 1024, 16, d), dtype)
                shape, options = check_attention_args(q=info, k=info, v=info, causal=causal)
                dtypes_of = {"q": dtype, "k": dtype, "v": dtype, "dout": dtype, "out": dtype, "lse": "float32"}
                for plan in (plan_attention_fwd(shape, options, target=target),
                             plan_attention_bwd(shape, options, target=target)):
                    for launch in plan.launches:
                        smem, usage = compile_launch_sm90(plan, launch, dtypes_of)
                        print(f"{dtype} D={d} causal={causal} {launch.kernel.split(':')[1]:28s} "
                              f"warps={launch.num_warps} stages={launch.num_stages} smem={smem} {usage}")


# --------------------------------------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--ptxas", action="store_true")
    parser.add_argument("--dims", help="comma-separated head dims (default: all); the results file is then "
                                       "named after them, so a long matrix can be split across runs")
    parser.add_argument("--no-extra", action="store_true", help="skip the GQA / varlen / window rows")
    parser.add_argument("--tune-only", action="store_true", help="only the --tune rows (no main grid)")
    parser.add_argument("--order-only", action="store_true",
                        help="only the program-level rows (AttentionConfig.head_group, fused_backward) at S=4096: "
                             "MHA D=128 / D=64 full and causal, GQA 32/8 D=128 full and causal")
    parser.add_argument("--ab", type=int, metavar="N",
                        help="only the defaults against --ab-config, alternating N times in one process at S=4096 "
                             "(MHA D=128 / D=64 full and causal, GQA 32/8 D=128 full and causal): for differences "
                             "smaller than the drift between separate runs (~3%%)")
    parser.add_argument("--bar-rows", type=int, metavar="N",
                        help="only the target rows (D=128, S=4096 / 16384, full and causal): ours, "
                             "FlexAttention and SDPA flash per call, alternating N times in one process, medians")
    parser.add_argument("--dropout", type=int, metavar="N",
                        help="only dropout_p=0.1 against 0 (D=128, S=4096 / 16384, full and causal), forward and "
                             "backward, alternating N times in one process, medians")
    parser.add_argument("--ab-config", default='{"fused_backward": false}', metavar="JSON",
                        help="the AttentionConfig keywords --ab compares the defaults with")
    parser.add_argument("--ab-dims", default="128,64", metavar="D,...",
                        help="head dims of --ab's MHA cases, full and causal (GQA 32/8 joins when 128 is among "
                             "them); other than the default, the results file is named after them")
    parser.add_argument("--seqlens", help="comma-separated sequence lengths of the main grid (default: all)")
    parser.add_argument("--only", help="comma-separated provider names to run (default: all), e.g. "
                                       "'flashbridge-torch steady,flashbridge-jax steady'")
    parser.add_argument("--tag", help="appended to the results file's name (runs under other settings)")
    parser.add_argument("--steady-diagnosis", metavar="D,S",
                        help="only the steady forward of both paths on swapped inputs, with device traces of the "
                             "steady loops (where the JAX path trails at short lengths), e.g. 64,1024")
    parser.add_argument("--trace", metavar="D,S", help="trace one call of each path (kernels and device times) "
                                                       "at this head dim and length (default: 128,4096, when run)")
    args = parser.parse_args()
    if args.ptxas:
        ptxas_report()
        return
    print(environment())
    payload = {"environment": environment(), "main": [], "extra": [], "tune": []}
    seqlens = (4096,) if args.quick else SEQLENS
    dims = (128,) if args.quick else HEAD_DIMS
    out_name = "attention_h200"
    if args.dims:
        dims = tuple(int(d) for d in args.dims.split(","))
        out_name += "_d" + "-".join(map(str, dims))
    if args.seqlens:
        seqlens = tuple(int(x) for x in args.seqlens.split(","))
        out_name += "_s" + "-".join(map(str, seqlens))
    if args.tag:
        out_name += "_" + args.tag
    only = set(args.only.split(",")) if args.only else None
    table = []

    def record(label, entry_list, meta, res):
        entry_list.append({**meta, "results": res})
        save(out_name, payload)  # after every row: a run cut short keeps what it measured
        for name, r in res.items():
            if "error" in r:
                table.append([label, name, "-", "-", "-", "-"])
            else:
                table.append([label, name, r["fwd_ms"], r["fwd_tflops"], r["bwd_ms"], r["bwd_tflops"]])

    if args.steady_diagnosis:
        d, s = (int(x) for x in args.steady_diagnosis.split(","))
        rows = [steady_diagnosis(TOKENS // s, s, H, d, causal) for causal in (False, True)]
        name = f"attention_steady_diagnosis_d{d}_s{s}_h200" + (f"_{args.tag}" if args.tag else "")
        print(f"wrote {save(name, {'environment': environment(), 'rows': rows})}")
        return
    if args.order_only:
        rows = [r for d in (128, 64) for causal in (False, True)
                for r in time_program_configs(TOKENS // 4096, 4096, H, H, d, causal, ORDER_ONLY_CONFIGS)]
        rows += [r for causal in (False, True)
                 for r in time_program_configs(4, 4096, 32, 8, 128, causal, ORDER_ONLY_CONFIGS)]
        print(f"wrote {save('attention_order_h200', {'environment': environment(), 'rows': rows})}")
        return
    if args.ab:
        other = json.loads(args.ab_config)
        configs = (dict(), other) * args.ab
        ab_dims = [int(x) for x in args.ab_dims.split(",")]
        cases = [(H, H, d, causal) for d in ab_dims for causal in (False, True)]
        if 128 in ab_dims:
            cases += [(32, 8, 128, False), (32, 8, 128, True)]
        rows = [r for hq, hkv, d, causal in cases
                for r in time_program_configs(TOKENS // 4096, 4096, hq, hkv, d, causal, configs)]
        name = "attention_ab_" + "_".join(f"{k}-{v}" for k, v in other.items())
        if args.ab_dims != parser.get_default("ab_dims"):
            name += "_d" + "-".join(map(str, ab_dims))
        name += "_h200"
        print(f"wrote {save(name, {'environment': environment(), 'against': other, 'rows': rows})}")
        return
    if args.dropout:
        rows = dropout_rows(args.dropout)
        print(f"wrote {save('attention_dropout_h200', {'environment': environment(), 'rows': rows})}")
        return
    if args.bar_rows:
        rows = bar_rows(args.bar_rows)
        print(f"wrote {save('attention_bar_rows_h200', {'environment': environment(), 'rows': rows})}")
        return
    if args.tune_only:
        args.tune, seqlens, args.no_extra, args.no_jax = True, (), True, True
        out_name = out_name.replace("attention_", "attention_tune_")
    else:  # the first backward CUDA-graph captures of a process fail on the H200 (see _timing.py)
        try:
            torch_providers(1, 256, 2, 2, 64, False)["flashbridge-torch steady"]()
        except Exception as exc:
            print(f"throwaway steady row: {type(exc).__name__}")
    for d in dims:
        for s in seqlens:
            for causal in (False, True):
                b = TOKENS // s
                res = bench(b, s, H, H, d, causal, with_jax=not args.no_jax, only=only)
                record(f"D{d} S{s} {'causal' if causal else 'full'}", payload["main"],
                       {"b": b, "s": s, "h": H, "d": d, "causal": causal}, res)
    if not (args.quick or args.no_extra):
        for causal in (False, True):
            res = bench(4, 4096, 32, 8, 128, causal, with_jax=not args.no_jax, only=only)
            record(f"GQA 32/8 D128 S4096 {'causal' if causal else 'full'}", payload["extra"],
                   {"kind": "gqa", "b": 4, "s": 4096, "hq": 32, "hkv": 8, "d": 128, "causal": causal}, res)
        rng = np.random.default_rng(0)
        lengths = []
        while sum(lengths) < TOKENS:
            lengths.append(int(min(rng.integers(128, 4096), TOKENS - sum(lengths))))
        for causal in (False, True):
            try:
                res = bench_varlen(lengths, H, H, 128, causal)
            except Exception:
                traceback.print_exc()
                res = {"flashbridge-torch": {"error": "failed"}}
            record(f"varlen {len(lengths)} seqs D128 {'causal' if causal else 'full'}", payload["extra"],
                   {"kind": "varlen", "lengths": lengths, "h": H, "d": 128, "causal": causal}, res)
        for left in (4096, 1024):
            res = bench(1, 16384, H, H, 128, True, window=(left, 0), with_jax=not args.no_jax, only=only)
            record(f"window {left} causal D128 S16384", payload["extra"],
                   {"kind": "window", "b": 1, "s": 16384, "h": H, "d": 128, "window": [left, 0]}, res)
    trace_d, trace_s = (int(x) for x in (args.trace or "128,4096").split(","))
    if not args.no_jax and (args.trace or (trace_d in dims and trace_s in seqlens)):
        try:
            payload["traces"] = [trace_paths(TOKENS // trace_s, trace_s, H, trace_d, causal)
                                 for causal in (False, True)]
            save(out_name, payload)
        except Exception:
            traceback.print_exc()
    if args.tune:
        for d in dims:
            for causal in (False, True):
                payload["tune"].append({"d": d, "causal": causal, "rows": tune(d, causal)})
                save(out_name, payload)
        if 128 in dims:  # GQA's dK/dV programs loop over the group: the longest causal ones are GROUP x longer
            payload["tune"].append({"d": 128, "causal": True, "gqa": [32, 8],
                                    "rows": time_program_configs(4, 4096, 32, 8, 128, True)})
            save(out_name, payload)
    print_table("attention, bf16, TFLOP/s (4*B*H*pairs*D fwd, 2.5x bwd)",
                ["case", "provider", "fwd ms", "fwd TFLOP/s", "bwd ms", "bwd TFLOP/s"], table)
    if payload["main"]:
        plot(payload["main"], out_name)
    print(f"wrote {save(out_name, payload)}")


def plot(main_rows, name="attention_h200"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["d"] for r in main_rows})
    fig, axes = plt.subplots(2, len(dims), figsize=(5 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        for row, direction in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            entries = [r for r in main_rows if r["d"] == d]
            names = sorted({n for e in entries for n in e["results"]})
            for provider in names:
                for causal, style in ((False, "-"), (True, "--")):
                    pts = [(e["s"], e["results"][provider].get(f"{direction}_tflops")) for e in entries
                           if e["causal"] == causal and provider in e["results"]]
                    pts = [(x, y) for x, y in pts if y is not None]
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", label=f"{provider}{' causal' if causal else ''}",
                                linewidth=2.5 if provider.startswith("flashbridge") else 1.2)
            ax.set_xscale("log", base=2)
            ax.set_title(f"D={d} {direction}")
            ax.set_xlabel("sequence length (B*S = 16384, H = 16)")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
