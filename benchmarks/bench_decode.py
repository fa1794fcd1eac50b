"""Flash-Decoding benchmark on a CUDA GPU: ours (torch and JAX paths) beside SDPA (flash and cuDNN backends)
and FlashInfer (if installed) on the same contiguous cache, same run.

TB/s = bytes of K and V actually read / time (``B * L * Hkv * (Dqk + Dv) * itemsize``: every sequence full,
the queries, outputs and split partials are not counted). bf16 unless said; Hq=32, Hkv=8, D=128, Sq=1. The
``read-floor`` row times a bare Triton read of the same bytes (each program sums a contiguous chunk; the
best of a few grid / tile / warp settings): what any kernel that reads them reaches at that size.

Timing: decode steps last tens of microseconds, less than the host needs to issue them, so every torch
provider is timed inside a CUDA graph (``triton.testing.do_bench_cudagraph``) and the JAX path as a decode
loop in one jitted function (``jax.lax.fori_loop`` over 128 steps, each step's output the next step's
query), wall clock per step; each timed step reads one of several copies of the cache, rotated so that the
copies together exceed the L2 many times (every step reads HBM). A jitted call carries a fixed host cost
(dispatch, its outputs, the command buffer's update) of a few hundred microseconds, which 32 unrolled steps
at B=1 S=16k (~0.7 ms of kernels) did not hide: ``--jax-launch-trace`` shows the kernels back to back
inside a call either way.

    python benchmarks/bench_decode.py              # the table's rows (contiguous, paged, fp8, JAX), plot
    python benchmarks/bench_decode.py --splits     # also sweep num_splits / block_n for the plan defaults
    python benchmarks/bench_decode.py --cache-step # only plain vs RoPE-in-cache vs left-padded decode (torch)
    python benchmarks/bench_decode.py --ptxas      # no GPU needed: compile every kernel for sm_90 ahead of
                                                   # time, print registers / spills / shared memory
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import traceback

from _common import (compile_launch_sm90, environment, jax_dispatch_ms, kernel_trace, launch_trace, print_table,
                     save, save_figure, time_jax)

import numpy as np

HQ, HKV, D = 32, 8, 128
L2_BYTES = 60 * 2**20
JAX_STEPS = 32  # unrolled decode steps per jitted call (the diagnosis's unrolled form)
JAX_LOOP_STEPS = 128  # decode steps per jitted call in the JAX rows' loop: the call's fixed host cost amortised
ROWS = [  # (label, batch, kv length)
    ("B1 S16k", 1, 16384),
    ("B1 S128k", 1, 131072),
    ("B32 S8k", 32, 8192),
]
# the targets (TB/s; the B32 row is a ratio to cuDNN measured in the same run)
TARGETS = {"B1 S16k": 3.4, "B1 S128k": 3.9, "B32 S8k": ("cudnn", 0.95)}


def kv_bytes(b, s, itemsize):
    return b * s * HKV * 2 * D * itemsize


def n_copies(nbytes):
    return max(2, math.ceil(4 * L2_BYTES / nbytes))


def _graph_time(fn):
    import torch
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


# ------------------------------------------------------------------------------------------------ caches

def make_caches(b, s, *, layout="NHD", paged=False, page_size=64, fp8=False, copies=2, seed=0):
    """``copies`` independent caches (k, v, extra kwargs) of B sequences of length s, all full."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        if paged:
            max_pages = s // page_size
            n_pages = b * max_pages
            shape = (n_pages, page_size, HKV, D) if layout == "NHD" else (n_pages, HKV, page_size, D)
            table = torch.randperm(n_pages, device="cuda", generator=g).to(torch.int32).reshape(b, max_pages)
            extra = {"block_table": table}
        else:
            shape = (b, s, HKV, D) if layout == "NHD" else (b, HKV, s, D)
            extra = {}
        k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
        if fp8:
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            extra["k_scale"] = torch.ones((), device="cuda")
            extra["v_scale"] = torch.ones((), device="cuda")
        out.append((k, v, extra))
    return out


# ---------------------------------------------------------------------------------------------- providers

LEFTPAD_ROWS = 100  # the leftpad rows' padding per sequence (not a multiple of any tile: shifted tile starts)


def torch_ours(b, s, *, layout="NHD", paged=False, fp8=False, num_splits=None, rotary=False, leftpad=False):
    """``rotary``: the queries rotated inside the kernel (full 128-dim RoPE tables); ``leftpad``: every
    sequence starts LEFTPAD_ROWS rows in (the bytes count the rows read)."""
    import torch

    from flashbridge.torch_api.decode import decode_attention

    pad = LEFTPAD_ROWS if leftpad else 0
    nbytes = kv_bytes(b, s - pad, 1 if fp8 else 2)
    caches = make_caches(b, s, layout=layout, paged=paged, fp8=fp8, copies=n_copies(nbytes))
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    step_kw = {}
    if rotary:
        theta = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * 10000.0 ** (
            -torch.arange(D // 2, device="cuda", dtype=torch.float32) / (D // 2))
        step_kw.update(rotary_cos=torch.cos(theta), rotary_sin=torch.sin(theta))
    if leftpad:
        step_kw["cache_leftpad"] = torch.full((b,), pad, dtype=torch.int32, device="cuda")
    it = itertools.cycle(caches)

    def step():
        k, v, extra = next(it)
        return decode_attention(q, k, v, cache_seqlens=lens, kv_layout=layout, num_splits=num_splits, **extra,
                                **step_kw)

    step()
    return _graph_time(step), nbytes


def torch_sdpa(b, s, backend):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    nbytes = kv_bytes(b, s, 2)
    caches = make_caches(b, s, layout="HND", copies=n_copies(nbytes))  # (B, Hkv, S, D): SDPA's own layout
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    it = itertools.cycle(caches)
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def step():
        k, v, _ = next(it)
        with sdpa_kernel(which):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    step()
    return _graph_time(step), nbytes


def torch_flashinfer(b, s):
    import torch
    import flashinfer  # noqa: F401 -- optional baseline

    nbytes = kv_bytes(b, s, 2)
    caches = make_caches(b, s, layout="NHD", copies=n_copies(nbytes))
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    it = itertools.cycle(caches)
    if b != 1:
        raise NotImplementedError("flashinfer baseline wired for the single-sequence API only")

    def step():
        k, v, _ = next(it)
        return flashinfer.single_decode_with_kv_cache(q[0], k[0], v[0])

    step()
    return _graph_time(step), nbytes


@functools.cache
def _stream_read_kernel():
    """A bare read: each program sums its contiguous chunk of K and of V (the sum is stored so the loads
    stay live). No page table, no strides, no dots: what a kernel that only reads these bytes reaches.
    Plain 16-byte loads (Triton pipelines through cp.async only loads that feed a dot, so a num_stages here
    would change nothing: sm_90 PTX identical): the loads in flight come from the programs."""
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(K, V, OUT, chunk, TILE: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * chunk
        offs = tl.arange(0, TILE)
        acc = tl.zeros([TILE], dtype=tl.float32)
        for i in range(0, chunk, TILE):
            acc += tl.load(K + start + i + offs).to(tl.float32) + tl.load(V + start + i + offs).to(tl.float32)
        tl.store(OUT + tl.program_id(0), tl.sum(acc, 0))

    return stream_read


# (programs, elements per tile, warps): the read floor is the best of these
STREAM_CONFIGS = tuple(itertools.product((256, 512, 1024), (4096, 8192), (4, 8)))


def stream_floor(b, s):
    """The fastest bare read of the K and V bytes of a decode step (contiguous bf16 caches, rotated copies,
    CUDA graph, as our rows): the floor the TB/s bars are read against. Returns the best config's time."""
    import torch

    kernel = _stream_read_kernel()
    nbytes = kv_bytes(b, s, 2)
    caches = make_caches(b, s, copies=n_copies(nbytes))
    elements = caches[0][0].numel()
    results = []
    for programs, tile, warps in STREAM_CONFIGS:
        if elements % (programs * tile):
            continue
        out = torch.empty(programs, device="cuda", dtype=torch.float32)
        it = itertools.cycle(caches)

        def step():
            k, v, _ = next(it)
            kernel[(programs,)](k, v, out, elements // programs, TILE=tile, num_warps=warps)

        step()
        results.append(((programs, tile, warps), _graph_time(step)))
    (config, ms) = min(results, key=lambda r: r[1])
    return ms, nbytes, {"config": {"programs": config[0], "tile": config[1], "warps": config[2]},
                        "all_ms": {"x".join(map(str, c)): t for c, t in results}}


def _jax_steps(b, s, *, paged=False, fp8=False, steps=None, loop=False):
    """The JAX rows' timed function: decode steps in one jitted call, each on one of several rotated cache
    copies. Unrolled (``loop=False``): ``steps`` independent steps. ``loop=True``: a decode loop, as a
    generation loop runs it: ``jax.lax.fori_loop`` over rounds of one step per copy, each step's output the
    next step's query (a chain, like torch's graph of steps on one stream). Returns (fn, args, bytes read
    per step, steps)."""
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.decode import decode_attention

    nbytes = kv_bytes(b, s, 1 if fp8 else 2)
    copies = n_copies(nbytes)
    if loop:
        rounds = max(1, math.ceil((steps or JAX_LOOP_STEPS) / copies))
        steps = rounds * copies
    else:
        steps = steps or max(copies, JAX_STEPS)
    key = jax.random.key(0)
    ks, vs, tables = [], [], []
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    for i in range(copies):
        k1, k2, k3, key = jax.random.split(key, 4)
        if paged:
            max_pages = s // 64
            shape = (b * max_pages, 64, HKV, D)
            tables.append(jax.random.permutation(k3, b * max_pages).astype(jnp.int32).reshape(b, max_pages))
        else:
            shape = (b, s, HKV, D)
        ks.append(jax.random.normal(k1, shape, jnp.bfloat16).astype(dtype))
        vs.append(jax.random.normal(k2, shape, jnp.bfloat16).astype(dtype))
    lens = jnp.full((b,), s, jnp.int32)
    scales = {"k_scale": jnp.ones((), jnp.float32), "v_scale": jnp.ones((), jnp.float32)} if fp8 else {}

    def step(q, c, ks, vs, tables, lens):
        extra = {"block_table": tables[c]} if paged else {}
        return decode_attention(q, ks[c], vs[c], cache_seqlens=lens, **extra, **scales)

    if loop:
        def many(q, ks, vs, tables, lens):
            def one_round(_, q):
                for c in range(copies):
                    q = step(q, c, ks, vs, tables, lens)  # out (B, 1, Hq, Dv) has the query's shape (Dv = Dqk)
                return q
            return jax.lax.fori_loop(0, rounds, one_round, q)

        return many, (jax.random.normal(key, (b, 1, HQ, D), jnp.bfloat16), ks, vs, tables, lens), nbytes, steps

    # a distinct query per step: XLA would merge two steps with the same operands into one
    qs = list(jax.random.normal(key, (steps, b, 1, HQ, D), jnp.bfloat16))

    def many(qs, ks, vs, tables, lens):
        return [step(q, i % copies, ks, vs, tables, lens) for i, q in enumerate(qs)]

    return many, (qs, ks, vs, tables, lens), nbytes, steps


def jax_ours(b, s, *, paged=False, fp8=False, steps=None, loop=True):
    many, args, nbytes, steps = _jax_steps(b, s, paged=paged, fp8=fp8, steps=steps, loop=loop)
    ms = time_jax(many, *args) / steps
    # host time to dispatch a step: the row measures the host, not the kernels, once it nears ``ms``
    host_ms = jax_dispatch_ms(many, *args) / steps
    return ms, nbytes, {"host_ms": host_ms, "steps_per_call": steps, "loop": loop}


def jax_launch_diagnosis(b=1, s=16384):
    """Why a JAX decode step at B=1 S=16k can be slower than torch's graph replay: both forms of the JAX
    rows' timed function (32 unrolled steps; the decode loop) under CUPTI (torch.profiler), every kernel
    matched to the host's launch call. Tells whether XLA launched each kernel itself (one ``cuLaunchKernel``
    per kernel) or from a captured graph, how long the device sat idle between kernels (within a call: the
    device time per step is what torch's graph rows measure), and the wall-clock time per step at 8 / 32 / 128
    steps per call (a fixed cost per call shrinks with more steps, a per-launch cost does not). Under
    ``XLA_FLAGS`` of the caller's choice (process-wide), so run it once per setting."""
    import os

    import jax
    import torch

    torch.zeros(1, device="cuda")  # a CUDA context for the profiler's CUPTI collection (it records JAX's work too)
    result = {"case": f"B{b} S{s}", "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for loop in (False, True):
        many, args, nbytes, steps = _jax_steps(b, s, loop=loop)
        jitted = jax.jit(many)
        trace = launch_trace(lambda: jax.block_until_ready(jitted(*args)), calls=3)
        idle = [r["idle_before_us"] for r in trace["rows"] if r["idle_before_us"] is not None]
        by_steps = {}
        for n in (8, 32, 128):
            fn, fn_args, _, n = _jax_steps(b, s, steps=n, loop=loop)
            by_steps[n] = time_jax(fn, *fn_args) / n
        calls = trace["api_calls"]
        form = {"steps": steps, "step_ms_by_steps": by_steps, "kernels_per_call": trace["kernels"] / 3,
                "api_calls": calls, "mean_idle_us": trace["mean_idle_before_us"], "max_idle_us": max(idle, default=0.0),
                "host_bound_gaps": trace["host_bound_gaps"], "gaps": trace["gaps"],
                "mean_launch_call_us": trace["mean_launch_call_us"],
                "device_us_per_step": sum(r["us"] for r in trace["rows"]) / 3 / steps,
                "host_ms_per_step": jax_dispatch_ms(many, *args) / steps}
        result["loop" if loop else "unrolled"] = form
        print("loop" if loop else "unrolled", {k: v for k, v in form.items() if k != "api_calls"})
    return result


def trace_paths(b=1, s=16384):
    """One decode step of each path, kernel by kernel (the same cache and query in both)."""
    import jax
    import torch

    from flashbridge.jax_api.decode import decode_attention as jax_decode
    from flashbridge.torch_api.decode import decode_attention

    ((k, v, _),) = make_caches(b, s, copies=1)
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    jq, jk, jv, jlens = (jax.dlpack.from_dlpack(t) for t in (q, k, v, lens))
    step = jax.jit(lambda q, k, v, lens: jax_decode(q, k, v, cache_seqlens=lens))
    # eight steps in one jitted function, distinct queries: the busy fraction shows XLA's launch gaps
    qs = [jq * (1 + i / 16) for i in range(8)]
    steps = jax.jit(lambda qs, k, v, lens: [jax_decode(q, k, v, cache_seqlens=lens) for q in qs])
    return {"case": f"B{b} S{s}",
            "jax_x8": kernel_trace(lambda: jax.block_until_ready(steps(qs, jk, jv, jlens)),
                                   label=f"jax decode B{b} S{s}, 8 steps in one jit"),
            "torch": kernel_trace(lambda: (decode_attention(q, k, v, cache_seqlens=lens), torch.cuda.synchronize()),
                                  label=f"torch decode B{b} S{s}"),
            "jax": kernel_trace(lambda: jax.block_until_ready(step(jq, jk, jv, jlens)),
                                label=f"jax decode B{b} S{s}")}


# --------------------------------------------------------------------------------------------------- main

def run_rows(with_jax=True, cache_step_only=False):
    rows = []

    def record(label, provider, fn):
        try:
            ms, nbytes, *extra = fn()
            entry = {"case": label, "provider": provider, "ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12,
                     **(extra[0] if extra else {})}
        except Exception as exc:  # a baseline that does not support the shape: recorded, not fatal
            traceback.print_exc()
            entry = {"case": label, "provider": provider, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        rows.append(entry)
        print(entry)
        import torch
        torch.cuda.empty_cache()

    for label, b, s in ROWS:
        record(label, "flashbridge-torch NHD", lambda: torch_ours(b, s))
        record(label, "flashbridge-torch rotary", lambda: torch_ours(b, s, rotary=True))
        record(label, "flashbridge-torch leftpad", lambda: torch_ours(b, s, leftpad=True))
        if cache_step_only:
            continue
        record(label, "flashbridge-torch HND", lambda: torch_ours(b, s, layout="HND"))
        record(label, "flashbridge-torch paged64", lambda: torch_ours(b, s, paged=True))
        record(label, "flashbridge-torch fp8", lambda: torch_ours(b, s, fp8=True))
        record(label, "read-floor", lambda: stream_floor(b, s))
        record(label, "sdpa-flash", lambda: torch_sdpa(b, s, "flash"))
        record(label, "sdpa-cudnn", lambda: torch_sdpa(b, s, "cudnn"))
        try:
            import flashinfer  # noqa: F401
            record(label, "flashinfer", lambda: torch_flashinfer(b, s))
        except ImportError:
            pass
    # the JAX rows after every torch row: JAX's runtime threads can still make CUDA calls (freeing a finished
    # row's buffers) while torch captures a graph, and in torch's global capture mode such a call invalidates
    # the capture. Most likely what happened when a table lost every row after the first capture that
    # followed the JAX rows of B=1 S=16k (``operation failed due to a previous error during capture``)
    for label, b, s in ROWS if with_jax else ():
        record(label, "flashbridge-jax NHD", lambda: jax_ours(b, s))
        record(label, "flashbridge-jax paged64", lambda: jax_ours(b, s, paged=True))
    return rows


SWEEP_TILES = ((64, 4, 3), (128, 4, 2), (128, 8, 3), (256, 8, 2))
# --splits-<name>: one case's sweep on its own, (variants, split counts, (block_n, warps, stages[,
# merge_block_states[, merge_block_elements]]) tiles, help)
FOCUSED_SWEEPS = {
    "b32": ([("B32 S8k", 32, 8192, False, False), ("B32 S8k paged64", 32, 8192, True, False)], (1, 2, 3, 4),
            (SWEEP_TILES[0],), "only the batch-32 split counts 1-4, contiguous and paged, default tile"),
    # 128-key tiles halve the iterations of each split's dependent chain (load, dot, softmax, dot)
    "s16k": ([("B1 S16k", 1, 16384, False, False)], (16, 24, 32, 48, 64),
             ((64, 4, 3), (64, 4, 4), (32, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3)),
             "only B=1 S=16k (the furthest from its target): split counts around the default and deeper "
             "pipelines / smaller key blocks"),
    # tiles around the FP8 default (128 keys, 4 warps, 3 stages; sm_90: all spill-free)
    "fp8tiles": ([("B1 S128k fp8", 1, 131072, False, True), ("B32 S8k fp8", 32, 8192, False, True)], (None,),
                 ((None, None, None), (128, 4, 2), (128, 4, 4), (128, 8, 2), (256, 8, 2)) * 2,
                 "only FP8 caches at B=1 S=128k and B=32 S=8k: pipeline depth, warps and 256-key steps, twice, "
                 "alternating, at the default split counts"),
    # FP8 V read as column pairs straight from the pipeline's buffer (no widened copy in shared memory: 64 KB
    # per program at 3 stages, 168 registers): depth and warps again
    "fp8pairs": ([("B1 S16k fp8", 1, 16384, False, True), ("B1 S128k fp8", 1, 131072, False, True),
                  ("B32 S8k fp8", 32, 8192, False, True)], (None,),
                 ((None, None, None), (128, 4, 2), (128, 4, 4), (64, 4, 3), (128, 8, 3)) * 2,
                 "only FP8 caches at B=1 S=16k / 128k and B=32 S=8k: depth and warps for the "
                 "column-pair V path, twice, alternating, at the default split counts"),
    # the same path: split counts against depth and key-block width
    # (168 registers per thread: up to 3 programs per SM by registers, 64 KB of shared memory at 3 stages)
    "fp8pairsplits": ([("B1 S16k fp8", 1, 16384, False, True), ("B1 S128k fp8", 1, 131072, False, True)],
                      (16, 32, 48, 64), ((None, None, None), (128, 4, 4), (128, 4, 2), (64, 4, 3), (64, 4, 4)),
                      "only FP8 caches at B=1 S=16k / 128k: split counts 16-64 x depth and key "
                      "block width"),
    # fewer warps per program, more programs per SM: 1-warp programs need no CTA barrier for the row max /
    # sum or the hand-over of p (sm_90, spill-free: 64 keys x 2 warps 246 registers, 32 x 1 180, 32 x 2 128)
    "fp8warps": ([("B1 S128k fp8", 1, 131072, False, True)], (32, 64, 128),
                 ((None, None, None), (64, 2, 3), (64, 2, 4), (32, 1, 3), (32, 1, 4), (32, 2, 4)),
                 "only FP8 at B=1 S=128k: 1- and 2-warp programs against split counts 32-128"),
    # the merge kernel's states per step and elements per program (B=1: 4096 elements, 32 per program, 32
    # split states in two steps of 16 by default)
    "merge": ([("B1 S16k", 1, 16384, False, False), ("B1 S128k", 1, 131072, False, False),
               ("B1 S128k fp8", 1, 131072, False, True)], (None,),
              tuple((None,) * 3 + m for m in ((None, None), (32, None), (32, 64), (16, 64), (32, 128), (16, 16),
                                               (16, 8), (8, 16), (32, 16))) * 2,
              "only the merge kernel's states per step (8-32) and elements per program (8-128) at the default "
              "split counts, twice, alternating"),
    # deeper pipelines: Triton keeps num_stages - 1 buffers and refills the one a step read only after that
    # step's compute, so during a step's compute just num_stages - 2 tiles are in flight (one at the default 3)
    "deep": ([("B1 S16k", 1, 16384, False, False), ("B1 S128k", 1, 131072, False, False),
              ("B32 S8k", 32, 8192, False, False)], (None,),
             ((None, None, None), (64, 4, 4), (32, 4, 5), (32, 4, 6), (64, 4, 5)) * 2,
             "only 16-bit caches: the default tile against deeper pipelines (3-4 buffers of 32-64 keys), twice"),
    "fp8deep": ([("B1 S16k fp8", 1, 16384, False, True), ("B1 S128k fp8", 1, 131072, False, True)], (32, 64),
                ((None, None, None), (128, 4, 4), (64, 4, 5), (64, 4, 6), (32, 4, 8)) * 2,
                "only FP8 caches: the default tile against deeper pipelines at 32 / 64 splits, twice"),
    # 32 splits against the automatic 33 (2 per SM); the hypothesis: the merge folds 16 states per step, so 33
    # states take a third dependent round trip for one state
    "split32": ([("B1 S16k", 1, 16384, False, False), ("B1 S128k", 1, 131072, False, False)], (32, None, 32, None),
                ((None, None, None),) * 2,
                "only 16-bit caches at B=1: 32 splits against the automatic count, alternating twice"),
    # the s16k sweep's best single readings beside the 32-split default: 16 splits at the default tile (24.3 us
    # against 25.1 at 32) and 2-warp programs of 32 keys (24.5), never alternated
    "s16kb": ([("B1 S16k", 1, 16384, False, False), ("B1 S128k", 1, 131072, False, False)], (16, 32),
              ((64, 4, 3), (32, 2, 4), (64, 4, 4)) * 2,
              "only 16-bit caches at B=1: 16 / 32 splits x the default tile, 2-warp 32-key and 4-stage tiles, twice"),
    "fp8": ([("B1 S128k fp8", 1, 131072, False, True), ("B32 S8k fp8", 32, 8192, False, True)], (1, 4, 32, 64),
            ((64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3)),
            "split counts x tiles (wider key tiles) for FP8 caches only"),
    # one program per SM (half the split count of the rule then: 16 at B=1, 8 at B=2, 5 at B=4) with deeper
    # pipelines against two per SM at the then default depth; the s16kb sweep had B=1 S=16k at 16 splits 24.1
    # us (64 keys, 3 stages) / 23.9 (4 stages) against 24.9 at 32, and S=128k 127.8 at 16 splits and 4 stages
    # against 129.0.
    # A variant's sixth field, its own split counts, replaces the sweep's.
    "onesm": ([("B1 S16k", 1, 16384, False, False, (16, 32)), ("B1 S32k", 1, 32768, False, False, (16, 32)),
               ("B1 S128k", 1, 131072, False, False, (16, 32)), ("B2 S16k", 2, 16384, False, False, (8, 16)),
               ("B4 S16k", 4, 16384, False, False, (5, 9))], (None,),
              ((64, 4, 3), (64, 4, 4), (64, 4, 5), (64, 4, 6), (128, 4, 3), (128, 8, 3)) * 2,
              "only 16-bit caches at B=1 / 2 / 4: one program per SM with 3-6 stages and 128-key tiles against "
              "two per SM, twice, alternating"),
    # the one-program-per-SM rule (128-key tiles) where it was not timed: B=4 (4 splits) and B=8 (2)
    "onesmb": ([("B4 S16k", 4, 16384, False, False, (4, 5, 9)), ("B8 S16k", 8, 16384, False, False, (2, 3, 5))],
               (None,), ((64, 4, 3), (128, 4, 3)) * 2,
               "only 16-bit caches at B=4 / 8: 64- and 128-key tiles at one and two programs per SM, twice"),
    # the same question for the other two B=1 paths: FP8 (128-key tiles at 2 per SM by default) and paged
    # caches (64-key tiles, one page per key block, 4 per SM): one program per SM with wider or deeper tiles
    "fp8onesm": ([("B1 S16k fp8", 1, 16384, False, True), ("B1 S128k fp8", 1, 131072, False, True)], (16, 32),
                 ((None, None, None), (256, 4, 3), (256, 8, 3), (128, 4, 5), (256, 4, 4)) * 2,
                 "only FP8 caches at B=1: 256-key and deeper tiles at 16 / 32 splits, twice"),
    "pagedonesm": ([("B1 S16k paged64", 1, 16384, True, False), ("B1 S128k paged64", 1, 131072, True, False)],
                   (16, 32, 64), ((64, 4, 3), (64, 4, 4), (64, 4, 5)),
                   "only paged (64-slot pages) 16-bit caches at B=1: 16-64 splits x pipeline depth"),
    # the two best single readings of fp8onesm / pagedonesm against the defaults, alternating three times
    "onesmab": ([("B1 S16k paged64", 1, 16384, True, False, (32, 64)),
                 ("B1 S128k paged64", 1, 131072, True, False, (32, 64)),
                 ("B1 S16k fp8", 1, 16384, False, True, (16, 32)), ("B1 S128k fp8", 1, 131072, False, True, (16, 32))],
                (None,), ((None, None, None), (64, 4, 5), (256, 4, 3)) * 3,
                "only B=1 paged and FP8: 64-key 5-stage and 256-key tiles against the default, 3 alternations"),
    # where 256-key FP8 tiles start to pay at one program per SM (B=1 S=16k: 1024 keys per split, lost;
    # S=128k: 8192, won), and the paged candidate (2 per SM, 5 stages) at B=2; None = the automatic count
    "onesmspan": ([("B1 S32k fp8", 1, 32768, False, True, (16, None)),
                   ("B1 S64k fp8", 1, 65536, False, True, (16, None)),
                   ("B2 S16k fp8", 2, 16384, False, True, (8, None)), ("B4 S16k fp8", 4, 16384, False, True, (4, None)),
                   ("B2 S16k paged64", 2, 16384, True, False, (16, None))],
                  (None,), ((None, None, None), (128, 4, 3), (256, 4, 3), (64, 4, 5)) * 2,
                  "only FP8 and paged caches at B=1-4: 128- / 256-key and 5-stage tiles at one or two programs "
                  "per SM against the defaults, twice"),
    # at the one-program-per-SM default (128 keys, 3 stages: 139 KB), a 4th stage (~205 KB) or 8 warps; the
    # split counts are given because an explicit tile keeps the old split rule
    "onesmdeep": ([("B1 S16k", 1, 16384, False, False, (16,)), ("B1 S128k", 1, 131072, False, False, (16,)),
                   ("B2 S16k", 2, 16384, False, False, (8,)), ("B4 S16k", 4, 16384, False, False, (4,))],
                  (None,), ((128, 4, 3), (128, 4, 4), (128, 8, 4), (128, 8, 3)) * 2,
                  "only 16-bit caches at B=1-4, one program per SM: 128-key tiles at 3 / 4 stages, 4 / 8 warps, "
                  "twice"),
    # FP8 at B=1 S=128k with two or three programs per SM instead of one 256-key program: a 2-stage pipeline
    # keeps one buffer per program (no overlap of a program's own load and compute), so the programs of an SM
    # take turns; the one-program default's step is its own compute chain (issue slots 31% busy) plus a
    # refill issued only after that compute
    "fp8twosm": ([("B1 S128k fp8", 1, 131072, False, True, (16, 32, 48))], (None,),
                 ((None, None, None), (256, 4, 2), (128, 4, 2), (128, 4, 3)) * 2,
                 "only FP8 at B=1 S=128k: 256- and 128-key tiles at 2 stages (one buffer, 2-3 programs per SM) "
                 "against the default, at 16 / 32 / 48 splits, twice"),
    # the 256-key FP8 tile at 8 warps (two per scheduler to cover the one-warp chain's fixed-latency waits,
    # 30% of its stall samples); with K pairs sm_90 gives 579 instructions per thread and step (631 with K
    # widened, which measured 72.2-73.1 us against 70.95 at 4 warps)
    "fp8warps8": ([("B1 S128k fp8", 1, 131072, False, True, (16,)), ("B1 S64k fp8", 1, 65536, False, True, (16,))],
                  (None,), ((256, 4, 3), (256, 8, 3)) * 3,
                  "only FP8 at B=1 S=64k / 128k, 16 splits: the 256-key tile at 4 and 8 warps, three times"),
    # the merge tile where the default spills on sm_90 (16 states x 512 elements: 544 B of stack at B=64 and
    # 16 splits) against a 16 x 256 cap and 8 x 512, three times each
    "mergetile": ([("B64 S4k", 64, 4096, False, False)], (16,),
                  ((None, None, None, 16, 512), (None, None, None, 16, 256),
                   (None, None, None, 8, 512)) * 3,
                  "only B=64 S=4096 at 16 splits: merge tiles 16 x 512 (the default, spills), 16 x 256 and 8 x 512"),
    # the FP8 target's two rows (B=1 S=128k, bf16 and FP8) at the defaults, back to back, three times each
    "ratio": ([("B1 S128k", 1, 131072, False, False), ("B1 S128k fp8", 1, 131072, False, True)], (None,),
              ((None, None, None),) * 3,
              "only B=1 S=128k, bf16 and FP8 caches, at the default tiles and split counts, three times each"),
}


def sweep_splits(variants=None, splits_list=(1, 4, 8, 16, 32, 64, 128), tiles=SWEEP_TILES):
    """Time num_splits and tile candidates around the defaults (for plan.py's heuristics); by default
    contiguous bf16 at every row, plus paged (page 64) and fp8 at B=1, S=128k."""
    import torch

    from flashbridge.core_kernels.decode.plan import DecodeConfig, check_decode_args, plan_decode
    from flashbridge.torch_api._runtime import dtype_name, execute, target_for

    if variants is None:
        variants = [(label, b, s, False, False) for label, b, s in ROWS]
        variants += [("B1 S128k paged64", 1, 131072, True, False), ("B1 S128k fp8", 1, 131072, False, True)]
    out = []
    for label, b, s, paged, fp8, *own_splits in variants:
        try:
            caches = make_caches(b, s, paged=paged, fp8=fp8, copies=n_copies(kv_bytes(b, s, 1 if fp8 else 2)))
        except Exception as exc:
            out.append({"case": label, "error": str(exc)[:120]})
            print(out[-1])
            continue
        # a CPU generator: a graph capture that failed earlier in the process can leave the default CUDA
        # generator unusable outside capture
        q = torch.randn(b, 1, HQ, D, generator=torch.Generator().manual_seed(b + s)).to("cuda", torch.bfloat16)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        info = lambda t: None if t is None else (tuple(t.shape), dtype_name(t.dtype))  # noqa: E731
        k0, v0, extra0 = caches[0]
        shape, options, _ = check_decode_args(q=info(q), k_cache=info(k0), v_cache=info(v0), cache_seqlens=info(lens),
                                              **{n: info(t) for n, t in extra0.items()})
        for splits in (own_splits[0] if own_splits else splits_list):
            for tile in tiles:  # see FOCUSED_SWEEPS for the tuple's fields; None = the plan's default
                block_n, warps, stages, merge_n, merge_e = (*tile, None, None)[:5]
                cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages, merge_block_states=merge_n,
                                   merge_block_elements=merge_e)
                try:
                    plan = plan_decode(shape, options, target=target_for(q.device), num_splits=splits, config=cfg)
                    it = itertools.cycle(caches)

                    def step():
                        k, v, extra = next(it)
                        return execute(plan, {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lens, **extra})

                    step()
                    ms = _graph_time(step)
                    out.append({"case": label, "splits": splits, "tile": tile, "ms": ms,
                                "tbs": kv_bytes(b, s, 1 if fp8 else 2) / (ms * 1e-3) / 1e12})
                except Exception as exc:
                    out.append({"case": label, "splits": splits, "tile": tile, "error": str(exc)[:120]})
                print(out[-1])
    return out


def verdicts(rows):
    """The targets, measured against this run's own baselines."""
    row_of = {(r["case"], r["provider"]): r for r in rows}
    by = {key: r.get("tbs") for key, r in row_of.items()}
    lines = []
    for label, target in TARGETS.items():
        ours = by.get((label, "flashbridge-torch NHD"))
        if ours is None:
            continue
        if isinstance(target, tuple):
            base = by.get((label, f"sdpa-{target[0]}"))
            if base:
                lines.append(f"{label}: {ours:.2f} TB/s = {ours / base:.2f}x {target[0]} (bar {target[1]}x)")
        else:
            lines.append(f"{label}: {ours:.2f} TB/s (bar {target})")
        floor = by.get((label, "read-floor"))
        if floor:
            lines.append(f"{label}: a bare read of the same bytes {floor:.2f} TB/s; ours {ours / floor:.2f} of it")
        rot = by.get((label, "flashbridge-torch rotary"))
        if rot:  # the same bytes: the ratio of TB/s is the ratio of times
            lines.append(f"{label}: rotary-in-cache/plain = {rot / ours:.3f} (bar >= 0.95)")
        pad = by.get((label, "flashbridge-torch leftpad"))
        if pad:
            lines.append(f"{label}: leftpad/plain TB/s = {pad / ours:.3f} ({LEFTPAD_ROWS} padding rows)")
        paged = by.get((label, "flashbridge-torch paged64"))
        if paged:
            lines.append(f"{label}: paged/contiguous = {paged / ours:.2f} (bar >= 0.90)")
        fp8 = by.get((label, "flashbridge-torch fp8"))
        if fp8 and label == "B1 S128k":
            # same TB/s definition: fp8 reads half the bytes, so speedup = 2 * fp8_tbs / bf16_tbs
            # three decimals: 1.7988 must not read as 1.80
            lines.append(f"{label}: fp8 speedup over bf16 = {2 * fp8 / ours:.3f}x (bar >= 1.8x)")
        jx = by.get((label, "flashbridge-jax NHD"))
        if jx:
            jr = row_of[(label, "flashbridge-jax NHD")]
            host = (f"; host {jr['host_ms'] * 1e3:.1f} us per step against {jr['ms'] * 1e3:.1f}"
                    if "host_ms" in jr else "")
            lines.append(f"{label}: jax/torch = {jx / ours:.2f} (bar >= 0.95){host}")
    return lines


def plot(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [label for label, _, _ in ROWS]
    providers = sorted({r["provider"] for r in rows if "tbs" in r})
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / max(1, len(providers))
    for i, p in enumerate(providers):
        ys = [next((r["tbs"] for r in rows if r["case"] == c and r["provider"] == p and "tbs" in r), 0.0)
              for c in cases]
        ax.bar(np.arange(len(cases)) + i * width, ys, width, label=p)
    ax.set_xticks(np.arange(len(cases)) + 0.4 - width / 2)
    ax.set_xticklabels(cases)
    ax.set_ylabel("TB/s (K + V bytes read / time)")
    ax.set_title(f"decode, Hq={HQ} Hkv={HKV} D={D} Sq=1")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    save_figure(fig, "decode_h200")


# ------------------------------------------------------------------------------------------------ ptxas

def ptxas_report():
    """Compile the default plans for sm_90 without a GPU (Triton's bundled ptxas) and print each kernel's
    registers and stack (spills). Specialisation mimics both launchers: pointers get divisibility 16, integer
    scalars none (the kernels declare them ``do_not_specialize_on_alignment``; the plans state alignment as
    constexprs), ints equal to 1 become constants."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.decode.plan import (check_append_args, check_cascade_args, check_decode_args,
                                                      plan_append, plan_cascade, plan_decode, plan_merge)

    target = Target(interpret=False, num_sms=132)

    def compile_plan(title, plan, dtypes_of):
        for launch in plan.launches:
            smem, usage = compile_launch_sm90(plan, launch, dtypes_of)
            print(f"{title:38s} {launch.kernel.split(':')[1]:22s} warps={launch.num_warps} "
                  f"stages={launch.num_stages} smem={smem} {usage}")

    for cache_dtype in ("bfloat16", "float8_e4m3fn"):
        for layout, paged in (("NHD", False), ("HND", False), ("NHD", True), ("HND", True)):
            for sq, hq, hkv, dqk, dv, splits in ((1, HQ, HKV, D, D, None), (1, HQ, HKV, D, D, 1),
                                                 (8, HQ, HKV, D, D, 4), (1, 128, 1, 576, 512, 8),
                                                 (1, 8, 8, 64, 64, 2), (1, 16, 2, 256, 256, 2)):
                b, s = 4, 4096
                if paged:
                    kshape = (b * s // 64, 64, hkv, dqk) if layout == "NHD" else (b * s // 64, hkv, 64, dqk)
                else:
                    kshape = (b, s, hkv, dqk) if layout == "NHD" else (b, hkv, s, dqk)
                vshape = kshape[:-1] + (dv,)
                fp8 = cache_dtype == "float8_e4m3fn"
                shape, options, _ = check_decode_args(
                    q=((b, sq, hq, dqk), "bfloat16"), k_cache=(kshape, cache_dtype), v_cache=(vshape, cache_dtype),
                    cache_seqlens=((b,), "int32"), block_table=((b, s // 64), "int32") if paged else None,
                    kv_layout=layout, k_scale=((hkv,), "float32") if fp8 else None,
                    v_scale=((hkv,), "float32") if fp8 else None, causal=True, sinks=((hq,), "float32"),
                    softcap=30.0 if dqk == 64 else 0.0, window_size=(1024, 0) if sq == 8 else (-1, -1))
                dtypes = {"q": "bfloat16", "k_cache": cache_dtype, "v_cache": cache_dtype, "cache_seqlens": "int32",
                          "block_table": "int32", "sinks": "float32", "k_scale": "float32", "v_scale": "float32",
                          "alibi_slopes": "float32"}
                title = f"{cache_dtype[:5]} {layout}{' paged' if paged else ''} Sq{sq} {hq}/{hkv} D{dqk}/{dv}"
                compile_plan(title, plan_decode(shape, options, target=target, num_splits=splits), dtypes)
            append = check_append_args(
                k_cache=(kshape, cache_dtype), v_cache=(vshape, cache_dtype), k_new=((b, 3, hkv, dqk), "bfloat16"),
                v_new=((b, 3, hkv, dv), "bfloat16"), cache_seqlens=((b,), "int32"),
                block_table=((b, s // 64), "int32") if paged else None, kv_layout=layout,
                k_scale=((), "float32") if fp8 else None, v_scale=((), "float32") if fp8 else None)
            compile_plan(f"append {cache_dtype[:5]} {layout}{' paged' if paged else ''}",
                         plan_append(append, target=target),
                         {"k_new": "bfloat16", "v_new": "bfloat16", "cache_seqlens": "int32", "block_table": "int32",
                          "k_scale": "float32", "v_scale": "float32", "k_cache": cache_dtype, "v_cache": cache_dtype})
    shape, shared_len, options, _ = check_cascade_args(
        q=((32, 1, HQ, D), "bfloat16"), shared_k=((4096, HKV, D), "bfloat16"), shared_v=((4096, HKV, D), "bfloat16"),
        k_cache=((32 * 16, 64, HKV, D), "bfloat16"), v_cache=((32 * 16, 64, HKV, D), "bfloat16"),
        cache_seqlens=((32,), "int32"), block_table=((32, 16), "int32"), sinks=((HQ,), "float32"))
    compile_plan("cascade bf16 paged", plan_cascade(shape, shared_len, options, target=target),
                 {"q": "bfloat16", "shared_k": "bfloat16", "shared_v": "bfloat16", "k_cache": "bfloat16",
                  "v_cache": "bfloat16", "cache_seqlens": "int32", "block_table": "int32", "sinks": "float32"})
    compile_plan("merge_attention_states bf16", plan_merge(3, 4096, 128, "bfloat16", target=target),
                 {"outs": "bfloat16", "lses": "float32"})
    # the benchmark's B=1 rows: the tiles for a batch that leaves SMs idle (FP8's 256-key tile from S=128k)
    for cache_dtype, s, paged in (("bfloat16", 16384, False), ("bfloat16", 16384, True),
                                  ("float8_e4m3fn", 131072, False)):
        fp8 = cache_dtype == "float8_e4m3fn"
        kshape = (s // 64, 64, HKV, D) if paged else (1, s, HKV, D)
        shape, options, _ = check_decode_args(
            q=((1, 1, HQ, D), "bfloat16"), k_cache=(kshape, cache_dtype), v_cache=(kshape, cache_dtype),
            cache_seqlens=((1,), "int32"), block_table=((1, s // 64), "int32") if paged else None,
            k_scale=((), "float32") if fp8 else None, v_scale=((), "float32") if fp8 else None)
        compile_plan(f"B1 S{s // 1024}k {cache_dtype[:5]}{' paged' if paged else ''}",
                     plan_decode(shape, options, target=target),
                     {"q": "bfloat16", "k_cache": cache_dtype, "v_cache": cache_dtype, "cache_seqlens": "int32",
                      "block_table": "int32", "k_scale": "float32", "v_scale": "float32"})


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--splits", action="store_true")
    for name, (_, _, _, help_text) in FOCUSED_SWEEPS.items():
        parser.add_argument(f"--splits-{name}", action="store_true", help=help_text)
    parser.add_argument("--table", action="store_true",
                        help="with --splits-<name>: the decode table too, after the sweeps (one process)")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--cache-step", action="store_true",
                        help="only the plain, rotary-in-cache and left-padded torch rows, printed, not saved")
    parser.add_argument("--ptxas", action="store_true")
    parser.add_argument("--jax-only", action="store_true",
                        help="only the JAX rows (e.g. to compare XLA_FLAGS settings), printed, not saved")
    parser.add_argument("--jax-launch-trace", metavar="TAG",
                        help="only the JAX B=1 S=16k row under CUPTI: kernel and graph launches, idle gaps "
                             "(saved as decode_jax_launch_TAG_h200; run once per XLA_FLAGS setting)")
    args = parser.parse_args()
    if args.jax_launch_trace:
        result = jax_launch_diagnosis()
        print(f"wrote {save(f'decode_jax_launch_{args.jax_launch_trace}_h200', {'environment': environment(), **result})}")
        return
    if args.ptxas:
        ptxas_report()
        return
    focused = [name for name in FOCUSED_SWEEPS if getattr(args, f"splits_{name}")]
    for name in focused:  # each selected sweep in turn, each saved on its own
        variants, splits_list, tiles, _ = FOCUSED_SWEEPS[name]
        sweep = sweep_splits(variants, splits_list, tiles)
        print(f"wrote {save(f'decode_splits_{name}_h200', {'environment': environment(), 'splits': sweep})}")
    if focused and not args.table:
        return
    if args.jax_only:
        import os
        print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
        for label, b, s in ROWS:
            for paged in (False, True):
                ms, nbytes, extra = jax_ours(b, s, paged=paged)
                print(f"{label} jax {'paged64' if paged else 'NHD'}: {ms:.4f} ms "
                      f"{nbytes / (ms * 1e-3) / 1e12:.3f} TB/s, host {extra['host_ms']:.4f} ms per step")
        return
    print(environment())
    if args.cache_step:
        rows = run_rows(with_jax=False, cache_step_only=True)
        print_table("decode: plain vs RoPE-in-cache vs left-padded (torch, bf16)", ["case", "provider", "ms", "TB/s"],
                    [[r["case"], r["provider"], r.get("ms", "-"), r.get("tbs", "-")] for r in rows])
        print("\n".join(verdicts(rows)))
        return
    rows = run_rows(with_jax=not args.no_jax)
    table = [[r["case"], r["provider"], r.get("ms", "-"), r.get("tbs", "-")] for r in rows]
    print_table(f"decode, bf16 cache unless said, Hq={HQ} Hkv={HKV} D={D} Sq=1 (TB/s = K+V bytes / time)",
                ["case", "provider", "ms", "TB/s"], table)
    lines = verdicts(rows)
    print("\n".join(lines))
    payload = {"environment": environment(), "rows": rows, "verdicts": lines,
               "shape": {"hq": HQ, "hkv": HKV, "d": D, "sq": 1}}
    if not args.no_jax:
        try:
            payload["traces"] = [trace_paths(1, 16384), trace_paths(1, 131072)]
        except Exception:
            traceback.print_exc()
    plot(rows)
    print(f"wrote {save('decode_h200', payload)}")
    if args.splits:  # saved on its own: a failure in the sweep must not lose the main table
        print(f"wrote {save('decode_splits_h200', {'environment': environment(), 'splits': sweep_splits()})}")


if __name__ == "__main__":
    main()
