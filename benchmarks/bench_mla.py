"""MLA (DeepSeek latent attention, absorbed form) benchmark on a CUDA GPU, baselines in the same run.

Shapes: H=128 query heads (H=16: one tensor-parallel shard), one 576-dim latent head (512 + 64 RoPE), the
values its first 512 dims, bf16, paged caches of 64-row pages. Rows:

* decode B in {64, 128}, S in {4096, 32768}: ours (torch, CUDA graph; JAX, a decode loop in one jitted call)
  against the generic decode kernel on the same cache (``flashbridge::decode_attn`` with ``v_cache =
  k_cache[..., :512]``, what ``decode_attention`` ran before the MLA path). TFLOP/s = 2 B H S (576 + 512)
  per step.
* H=16 (memory-bound): TB/s = latent bytes read (B S 576 x itemsize) per step, against the device-to-device
  copy measured in the same run; the FP8 cache's speed-up over bf16.
* sparse decode, top-k 2048 of S=32768: time per step against dense decode over S=2048 (the same work).
* prefill forward, B=1, S=4096, causal: dense and sparse (top-k 2048 of the visible keys); TFLOP/s = 2 H
  (visible pairs) (576 + 512); the backward is timed and reported (2.5x the forward's FLOPs). Baseline:
  ``flash_attention`` on the un-absorbed form (per-head keys of 192 dims, values of 128: the same attention
  output after W_UV), same run.
* prefill with a block mask, S=4096: top-k key blocks per query block (``masks.from_blocks``, 64x64 blocks, 32
  of 64 key blocks drawn per query block with a fixed seed: about the causal row's work), H=128 and the
  seed's one head (q ``[4096 x 576]``); TFLOP/s counted on the visited blocks, forward and backward, torch
  and JAX, beside the dense causal row.

    python benchmarks/bench_mla.py            # every row, JSON (results/mla_h200.json) and plot
    python benchmarks/bench_mla.py --quick    # one row of each kind
    python benchmarks/bench_mla.py --sweep    # tile variants (MLAConfig) on the key rows
    python benchmarks/bench_mla.py --ptxas    # no GPU needed: compile the default plans for sm_90
    python benchmarks/bench_mla.py --prefill-only   # the prefill rows alone
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import traceback

from _common import (compile_launch_sm90, environment, measure_copy_ceiling, print_table, save, save_figure,
                     time_jax, time_torch)

H, DQK, DV, PAGE = 128, 576, 512, 64
L2_BYTES = 60 * 2**20
JAX_STEPS = 64  # decode steps per jitted call of the JAX rows (a call's fixed host cost amortised)
DECODE_ROWS = [(64, 4096), (64, 32768), (128, 4096), (128, 32768)]
TARGETS = {"decode_tflops": 350.0, "h16_copy_fraction": 0.8, "fp8_speedup": 1.6, "sparse_ratio": 1.2,
           "prefill_tflops": 350.0, "jax_ratio": 0.95}
MASK_BLOCK, MASK_SEED = 64, 0  # the block-mask rows: 64-token blocks, half the key blocks of each query block


def decode_flops(b, s, heads=H):
    return 2 * b * heads * s * (DQK + DV)


def _graph_time(fn):
    import torch
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))


# ------------------------------------------------------------------------------------------------ inputs

def make_cache(b, s, *, fp8=False, copies=1, seed=0):
    """``copies`` paged latent caches of B full sequences (64-row pages in a shuffled pool)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        pages = b * s // PAGE
        cache = torch.randn(pages, PAGE, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        extra = {"block_table": torch.randperm(pages, device="cuda", generator=g).to(torch.int32).reshape(b, -1)}
        if fp8:
            cache = cache.to(torch.float8_e4m3fn)
            extra["kv_scale"] = torch.ones((), device="cuda")
        out.append((cache, extra))
    return out


def n_copies(nbytes):
    return max(1, math.ceil(4 * L2_BYTES / nbytes))


def topk_indices(b, sq, s, topk, *, causal, seed=0):
    """int32 (B, Sq, topk): distinct random positions per query among its visible keys (the last Sq of
    ``s``); -1 where fewer are visible."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = torch.empty(b, sq, topk, dtype=torch.int32, device="cuda")
    for i in range(b):
        for t0 in range(0, sq, 512):
            t = torch.arange(t0, min(t0 + 512, sq), device="cuda")
            scores = torch.rand(len(t), s, device="cuda", generator=g)
            if causal:
                scores = scores.masked_fill(torch.arange(s, device="cuda")[None, :] > (t + s - sq)[:, None], -1.0)
            val, idx = scores.topk(topk, dim=-1)
            out[i, t0:t0 + len(t)] = torch.where(val >= 0, idx, -1).to(torch.int32)
    return out


# ----------------------------------------------------------------------------------------------- decode

def torch_decode(b, s, *, heads=H, fp8=False, topk=0, generic=False, config=None):
    """ms per step of one decode provider on full paged caches (rotated when smaller than the L2 x 4)."""
    import torch

    from flashbridge.torch_api import decode as tdecode
    from flashbridge.torch_api.mla import mla_decode

    nbytes = b * s * DQK * (1 if fp8 else 2)
    caches = make_cache(b, s, fp8=fp8, copies=n_copies(nbytes))
    q = torch.randn(b, 1, heads, DQK, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
    idx = topk_indices(b, 1, s, topk, causal=True) if topk else None
    it = itertools.cycle(caches)
    if config is not None:
        return _planned_decode_ms(q, caches, lens, idx, config)

    def step():
        cache, extra = next(it)
        if generic:  # the generic kernel as decode_attention ran MLA shapes before (no routing)
            k = cache.unsqueeze(2)
            scale = extra.get("kv_scale")
            return tdecode._decode_attn(q, k, k[..., :DV], lens, extra["block_table"], None, None, scale, scale,
                                        "NHD", DQK ** -0.5, True, None, 0, 0.0, None)[0]
        return mla_decode(q, cache, cache_seqlens=lens, head_dim_v=DV, indices=idx, **extra)

    out = step()
    return _graph_time(step), out


def _planned_decode_ms(q, caches, lens, idx, config):
    """ms per step of the MLA decode plan with an explicit MLAConfig (the sweep), through the torch runtime."""
    from flashbridge.core_kernels.mla.plan import check_mla_decode_args, plan_mla_fwd
    from flashbridge.torch_api._runtime import dtype_name, execute, target_for

    cache0, extra0 = caches[0]
    info = lambda t: None if t is None else (tuple(t.shape), dtype_name(t.dtype))  # noqa: E731
    shape, options, _ = check_mla_decode_args(q=info(q), kv_cache=info(cache0), cache_seqlens=info(lens),
                                              block_table=info(extra0["block_table"]), head_dim_v=DV,
                                              indices=info(idx), kv_scale=info(extra0.get("kv_scale")))
    plan = plan_mla_fwd(shape, options, target=target_for(q.device), config=config)
    it = itertools.cycle(caches)

    def step():
        cache, extra = next(it)
        given = {"q": q, "kv": cache, "cache_seqlens": lens, "block_table": extra["block_table"], "indices": idx,
                 "kv_scale": extra.get("kv_scale")}
        return execute(plan, {n: given[n] for n in plan.inputs})[0]

    out = step()
    return _graph_time(step), out


def jax_decode(b, s, *, heads=H, fp8=False, steps=JAX_STEPS):
    """ms per step of the JAX decode: a loop of ``steps`` steps in one jitted call, each step waiting for
    the previous one (a dependency chain, as in generation)."""
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api.mla import mla_decode

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    pages = b * s // PAGE
    cache = jax.random.normal(k1, (pages, PAGE, DQK), jnp.bfloat16)
    extra = {"block_table": jax.random.permutation(k2, pages).astype(jnp.int32).reshape(b, -1)}
    if fp8:
        cache = cache.astype(jnp.float8_e4m3fn)
        extra["kv_scale"] = jnp.ones((), jnp.float32)
    q = jax.random.normal(k3, (b, 1, heads, DQK), jnp.bfloat16)
    lens = jnp.full((b,), s, jnp.int32)

    def many(q, cache, lens, extra):
        def one(_, lens):
            out = mla_decode(q, cache, cache_seqlens=lens, head_dim_v=DV, **extra)
            # the next step waits for this one through its lengths (unchanged: |out| is never 1e30), a
            # dependency that costs one tiny op instead of rewriting the (B, 1, H, 576) query
            return lens + (out[0, 0, 0, 0] > 1e30).astype(lens.dtype)
        return jax.lax.fori_loop(0, steps, one, lens)

    return time_jax(many, q, cache, lens, extra) / steps


def decode_rows(quick=False, with_jax=True):
    rows = []
    for b, s in (DECODE_ROWS[:1] if quick else DECODE_ROWS):
        case = f"decode H{H} B{b} S{s}"
        ms, out = torch_decode(b, s)
        g_ms, g_out = torch_decode(b, s, generic=True)
        err = float((out.float() - g_out.float()).abs().max())
        rows.append({"case": case, "provider": "ours torch", "ms": ms, "tflops": decode_flops(b, s) / ms / 1e9,
                     "max_diff_vs_generic": err})
        rows.append({"case": case, "provider": "generic decode", "ms": g_ms,
                     "tflops": decode_flops(b, s) / g_ms / 1e9})
        if with_jax:
            _try(rows, case, "ours jax", lambda: (lambda ms: {"ms": ms, "tflops": decode_flops(b, s) / ms / 1e9})(
                jax_decode(b, s)))
        print(rows[-3:])
    return rows


def h16_rows(copy_tbs, quick=False, with_jax=True):
    rows = []
    for b, s in (DECODE_ROWS[:1] if quick else DECODE_ROWS):
        case = f"decode H16 B{b} S{s}"
        for fp8 in (False, True):
            ms, _ = torch_decode(b, s, heads=16, fp8=fp8)
            tbs = b * s * DQK * (1 if fp8 else 2) / ms / 1e9
            rows.append({"case": case, "provider": "ours torch fp8" if fp8 else "ours torch", "ms": ms, "tbs": tbs,
                         "copy_fraction": tbs / copy_tbs})
        rows[-1]["fp8_speedup"] = rows[-2]["ms"] / rows[-1]["ms"]
        g_ms, _ = torch_decode(b, s, heads=16, generic=True)
        rows.append({"case": case, "provider": "generic decode", "ms": g_ms, "tbs": b * s * DQK * 2 / g_ms / 1e9})
        if with_jax:
            _try(rows, case, "ours jax", lambda: (lambda ms: {"ms": ms, "tbs": b * s * DQK * 2 / ms / 1e9})(
                jax_decode(b, s, heads=16)))
        print(rows[-4:])
    return rows


def sparse_rows():
    b, s, topk = 64, 32768, 2048
    ms, _ = torch_decode(b, s, topk=topk)
    dense_ms, _ = torch_decode(b, topk)
    case = f"sparse decode H{H} B{b} top-k {topk} of S{s}"
    return [{"case": case, "provider": "ours torch", "ms": ms, "tflops": decode_flops(b, topk) / ms / 1e9,
             "ratio_to_dense_2048": ms / dense_ms},
            {"case": f"decode H{H} B{b} S{topk}", "provider": "ours torch", "ms": dense_ms,
             "tflops": decode_flops(b, topk) / dense_ms / 1e9}]


# ---------------------------------------------------------------------------------------------- prefill

def visible_pairs(s, topk=0):
    if not topk:
        return s * (s + 1) // 2
    return sum(min(i + 1, topk) for i in range(s))


def topk_block_mask(s, *, block=MASK_BLOCK, keep=None, seed=MASK_SEED):
    """``masks.from_blocks``: ``keep`` (default half) of the ``s / block`` key blocks drawn per query block,
    a top-k over fixed-seed random scores (S=4096: 32 of 64, the seed's case)."""
    import numpy as np

    from flashbridge import masks

    n = s // block
    keep = n // 2 if keep is None else keep
    top = np.random.default_rng(seed).random((n, n)).argsort(1)[:, :keep]
    blocks = np.zeros((n, n), bool)
    np.put_along_axis(blocks, top, True, 1)
    return masks.from_blocks(blocks, seq_len_q=s, seq_len_k=s, block_size=block)


def mask_pairs(mask) -> int:
    """(query, key) pairs in the visited blocks (every block of a from_blocks mask inside S is full)."""
    import numpy as np

    return int(np.asarray(mask.to_dense(), np.int64).sum())


def prefill_rows(s=4096, with_jax=True):
    import torch

    from flashbridge.torch_api.attention import flash_attention
    from flashbridge.torch_api.mla import mla_attention

    b = 1
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(b, s, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = []
    for topk in (0, 2048):
        idx = topk_indices(b, s, s, topk, causal=True) if topk else None
        case = f"prefill H{H} S{s} causal" + (f" top-k {topk}" if topk else "")
        flops = 2 * H * visible_pairs(s, topk) * (DQK + DV) * b
        fwd = time_torch(lambda: mla_attention(q, kv, head_dim_v=DV, causal=True, indices=idx))
        qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = mla_attention(qg, kvg, head_dim_v=DV, causal=True, indices=idx)
        dout = torch.randn_like(out)
        bwd = time_torch(lambda: torch.autograd.grad(out, (qg, kvg), dout, retain_graph=True))
        rows.append({"case": case, "provider": "ours torch", "fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9,
                     "bwd_ms": bwd, "bwd_tflops": 2.5 * flops / bwd / 1e9})
        if with_jax:
            _try(rows, case, "ours jax", lambda: _jax_prefill(q, kv, idx, flops))
        print(rows[-2:])
    # baseline: the un-absorbed form (per-head keys of 192 dims, values of 128), dense causal
    qu = torch.randn(b, s, H, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    ku = torch.randn(b, s, H, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    vu = torch.randn(b, s, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    fwd = time_torch(lambda: flash_attention(qu, ku, vu, causal=True))
    qg, kg, vg = (t.clone().requires_grad_() for t in (qu, ku, vu))
    out = flash_attention(qg, kg, vg, causal=True)
    dout = torch.randn_like(out)
    bwd = time_torch(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))
    flops = 2 * H * visible_pairs(s) * (192 + 128) * b
    rows.append({"case": f"prefill H{H} S{s} causal", "provider": "flash_attention un-absorbed (192/128)",
                 "fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9, "bwd_ms": bwd, "bwd_tflops": 2.5 * flops / bwd / 1e9})
    del qu, ku, vu, qg, kg, vg, out, dout
    rows += block_mask_rows(s, with_jax=with_jax)
    return rows


def block_mask_rows(s=4096, with_jax=True):
    """Prefill over a top-k block mask (32 of 64 key blocks of 64 per query block at S=4096): H=128 and the
    seed's one head. FLOPs: 2 H (pairs in visited blocks) (576 + 512); backward 2.5x."""
    import torch

    from flashbridge.torch_api.mla import mla_attention

    mask = topk_block_mask(s)
    rows = []
    for heads in (H, 1):
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, s, heads, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(1, s, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        n_q, n_k = mask.num_blocks
        case = (f"prefill H{heads} S{s} block mask {n_k // 2} of {n_k} ({MASK_BLOCK}x{MASK_BLOCK})"
                + (" = the seed's Q [4096 x 576]" if heads == 1 and s == 4096 else ""))
        flops = 2 * heads * mask_pairs(mask) * (DQK + DV)
        fwd = time_torch(lambda: mla_attention(q, kv, head_dim_v=DV, block_mask=mask))
        qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = mla_attention(qg, kvg, head_dim_v=DV, block_mask=mask)
        dout = torch.randn_like(out)
        bwd = time_torch(lambda: torch.autograd.grad(out, (qg, kvg), dout, retain_graph=True))
        rows.append({"case": case, "provider": "ours torch", "fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9,
                     "bwd_ms": bwd, "bwd_tflops": 2.5 * flops / bwd / 1e9, "density": mask.density})
        if with_jax:
            _try(rows, case, "ours jax", lambda: _jax_prefill_masked(q, kv, mask, flops))
        print(rows[-2:])
    return rows


def _jax_prefill_masked(q, kv, mask, flops):
    import jax

    from flashbridge.jax_api.block_sparse import mask_to_device
    from flashbridge.jax_api.mla import mla_attention

    jq, jkv = jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(kv)
    ms = time_jax(lambda q, kv, m: mla_attention(q, kv, head_dim_v=DV, block_mask=m), jq, jkv, mask_to_device(mask))
    return {"fwd_ms": ms, "fwd_tflops": flops / ms / 1e9}


def _jax_prefill(q, kv, idx, flops):
    import jax

    from flashbridge.jax_api.mla import mla_attention

    jq, jkv = jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(kv)
    jidx = None if idx is None else jax.dlpack.from_dlpack(idx)
    ms = time_jax(lambda q, kv, i: mla_attention(q, kv, head_dim_v=DV, causal=True, indices=i), jq, jkv, jidx)
    return {"fwd_ms": ms, "fwd_tflops": flops / ms / 1e9}


def _try(rows, case, provider, fn):
    try:
        rows.append({"case": case, "provider": provider, **fn()})
    except Exception as exc:  # noqa: BLE001 -- a failing provider is reported, the run goes on
        traceback.print_exc()
        rows.append({"case": case, "provider": provider, "error": repr(exc)[:300]})


# ----------------------------------------------------------------------------------------------- verdicts

def verdicts(rows, copy_tbs):
    lines = []
    by = {(r["case"], r["provider"]): r for r in rows}
    for r in rows:
        if r["provider"] == "ours torch" and r["case"].startswith(f"decode H{H} ") and "tflops" in r:
            ok = r["tflops"] >= TARGETS["decode_tflops"]
            lines.append(f"{r['case']}: {r['tflops']:.0f} TFLOP/s (bar {TARGETS['decode_tflops']:.0f}) "
                         f"{'met' if ok else 'MISSED'}; generic {by.get((r['case'], 'generic decode'), {}).get('tflops', 0):.0f}")
            j = by.get((r["case"], "ours jax"))
            if j and "ms" in j:
                lines.append(f"  JAX / torch speed {r['ms'] / j['ms']:.3f} (bar {TARGETS['jax_ratio']})")
        if r["case"].startswith("decode H16") and "copy_fraction" in r:
            lines.append(f"{r['case']} {r['provider']}: {r['tbs']:.2f} TB/s = {r['copy_fraction']:.2f} of copy "
                         f"{copy_tbs:.2f}" + (f", FP8 speed-up {r['fp8_speedup']:.2f}x (bar {TARGETS['fp8_speedup']})"
                                              if "fp8_speedup" in r else ""))
        if "ratio_to_dense_2048" in r:
            lines.append(f"{r['case']}: {r['ratio_to_dense_2048']:.2f}x dense decode over 2048 keys "
                         f"(bar {TARGETS['sparse_ratio']})")
        if r["case"].startswith("prefill") and r["provider"] == "ours torch":
            lines.append(f"{r['case']}: forward {r['fwd_tflops']:.0f} TFLOP/s (bar {TARGETS['prefill_tflops']:.0f}), "
                         f"backward {r['bwd_tflops']:.0f}")
            dense = by.get((f"prefill H{H} S4096 causal", "ours torch"))
            if "block mask" in r["case"] and r["case"].startswith(f"prefill H{H} ") and dense:
                lines.append(f"  block mask / dense causal TFLOP/s: forward "
                             f"{r['fwd_tflops'] / dense['fwd_tflops']:.2f}, backward "
                             f"{r['bwd_tflops'] / dense['bwd_tflops']:.2f}")
    return lines


def plot(rows, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    dec = [r for r in rows if r["case"].startswith(f"decode H{H} ") and "tflops" in r]
    cases = list(dict.fromkeys(r["case"] for r in dec))
    providers = list(dict.fromkeys(r["provider"] for r in dec))
    for i, p in enumerate(providers):
        vals = [next((r["tflops"] for r in dec if r["case"] == c and r["provider"] == p), 0) for c in cases]
        axes[0].bar([j + i * 0.8 / len(providers) for j in range(len(cases))], vals, 0.8 / len(providers), label=p)
    axes[0].axhline(TARGETS["decode_tflops"], color="k", ls="--", lw=1)
    axes[0].set_xticks(range(len(cases)), [c.replace("decode ", "") for c in cases], rotation=15)
    axes[0].set_ylabel("TFLOP/s")
    axes[0].set_title("MLA decode, H=128, 576/512, bf16, paged 64")
    axes[0].legend()
    pre = [r for r in rows if r["case"].startswith("prefill") and "fwd_tflops" in r]
    labels = [f"{r['case'].replace('prefill ', '')}\n{r['provider']}" for r in pre]
    axes[1].bar(range(len(pre)), [r["fwd_tflops"] for r in pre], 0.4, label="forward")
    axes[1].bar([i + 0.4 for i in range(len(pre))], [r.get("bwd_tflops", 0) for r in pre], 0.4, label="backward")
    axes[1].axhline(TARGETS["prefill_tflops"], color="k", ls="--", lw=1)
    axes[1].set_xticks(range(len(pre)), labels, fontsize=7)
    axes[1].set_title("MLA prefill, S=4096: causal, top-k 2048, block mask (32 of 64 blocks)")
    axes[1].legend()
    save_figure(fig, name)


# -------------------------------------------------------------------------------------------------- sweep

SWEEP = {  # case -> (kwargs of torch_decode, MLAConfig field dicts)
    "H128 B64 S4096": (dict(b=64, s=4096), [{}, {"block_n": 32}, {"block_n": 32, "num_stages": 3},
                                            {"num_stages": 1}, {"block_m": 32}, {"block_m": 32, "block_n": 32}]),
    "H16 B64 S32768": (dict(b=64, s=32768, heads=16), [{}, {"num_stages": 3}, {"num_stages": 7}, {"block_n": 32},
                                                        {"num_warps": 4}, {"block_n": 128, "num_stages": 3}]),
    "H16 B64 S32768 fp8": (dict(b=64, s=32768, heads=16, fp8=True),
                           [{}, {"separate_v": False}, {"num_stages": 3}, {"block_n": 64}, {"num_warps": 4}]),
    "H128 B64 S4096 fp8": (dict(b=64, s=4096, fp8=True), [{}, {"separate_v": False}, {"block_m": 16},
                                                           {"block_m": 64, "block_n": 64, "num_stages": 2}]),
    "sparse H128 B64 top-k 2048 of S32768": (dict(b=64, s=32768, topk=2048), [{}, {"block_n": 32}]),
}


# block-mask backward (S=4096, 32 of 64 blocks of 64), heads -> MLAConfig field dicts: at H=1 the default dKV
# tile (64 rows, 2 stages) spills 104 B on sm_90, 32 rows or one stage none
MASK_BWD_SWEEP = {1: [{}, {"dkv_block_m": 32}, {"dkv_num_stages": 1}], H: [{}, {"dkv_block_m": 32}]}


def _planned_mask_bwd_ms(heads, config, s=4096):
    """ms of the block-mask backward plan with an explicit MLAConfig, through the torch runtime."""
    import torch

    from flashbridge.core_kernels.block_sparse.plan import layout_of
    from flashbridge.core_kernels.mla.plan import check_mla_args, plan_mla_bwd, plan_mla_fwd
    from flashbridge.masks import BlockMask
    from flashbridge.torch_api._runtime import execute, target_for
    from flashbridge.torch_api.block_sparse import mask_tensors

    mask = topk_block_mask(s)
    layout = layout_of(mask)
    q = torch.randn(1, s, heads, DQK, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, s, DQK, device="cuda", dtype=torch.bfloat16)
    shape, options = check_mla_args(q=(tuple(q.shape), "bfloat16"), kv=(tuple(kv.shape), "bfloat16"), head_dim_v=DV)
    target = target_for(q.device)
    given = {"q": q, "kv": kv, **dict(zip(BlockMask.array_names, mask_tensors(mask, q.device)))}
    fwd = plan_mla_fwd(shape, options, target=target, sparse=layout, config=config)
    out, lse = execute(fwd, {n: given[n] for n in fwd.inputs})
    given.update(out=out, lse=lse, dout=torch.randn_like(out))
    bwd = plan_mla_bwd(shape, options, target=target, sparse=layout, config=config)
    return time_torch(lambda: execute(bwd, {n: given[n] for n in bwd.inputs}))


def sweep():
    from flashbridge.core_kernels.mla.plan import MLAConfig

    results = []
    for case, (kwargs, configs) in SWEEP.items():
        for fields in configs:
            try:
                ms, _ = torch_decode(**kwargs, config=MLAConfig(**fields))
                results.append({"case": case, "config": fields, "ms": ms})
            except Exception as exc:  # noqa: BLE001
                results.append({"case": case, "config": fields, "error": repr(exc)[:300]})
            print(results[-1])
    for heads, configs in MASK_BWD_SWEEP.items():
        for fields in configs:
            case = f"block mask bwd H{heads} S4096"
            try:
                results.append({"case": case, "config": fields, "ms": _planned_mask_bwd_ms(heads, MLAConfig(**fields))})
            except Exception as exc:  # noqa: BLE001
                results.append({"case": case, "config": fields, "error": repr(exc)[:300]})
            print(results[-1])
    return results


# -------------------------------------------------------------------------------------------------- ptxas

def ptxas_report():
    """Compile the default plans for sm_90 without a GPU (Triton's bundled ptxas): shared memory, registers,
    stack (spills) and wgmma counts of every kernel."""
    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.block_sparse.plan import layout_of
    from flashbridge.core_kernels.mla.plan import check_mla_args, check_mla_decode_args, plan_mla_bwd, plan_mla_fwd
    from flashbridge.masks import BlockMask

    target = Target(interpret=False, num_sms=132)
    dtypes = {"q": "bfloat16", "kv": "bfloat16", "cache_seqlens": "int32", "block_table": "int32",
              "indices": "int32", "kv_scale": "float32", "dout": "bfloat16", "out": "bfloat16", "lse": "float32",
              "dlse": "float32"}
    cases = []
    for heads, fp8, topk in ((128, False, 0), (128, False, 2048), (16, False, 0), (16, True, 0), (128, True, 0)):
        b, s = 64, 32768
        cache = "float8_e4m3fn" if fp8 else "bfloat16"
        shape, options, _ = check_mla_decode_args(
            q=((b, 1, heads, DQK), "bfloat16"), kv_cache=((b * s // PAGE, PAGE, DQK), cache),
            cache_seqlens=((b,), "int32"), block_table=((b, s // PAGE), "int32"), head_dim_v=DV,
            indices=((b, 1, topk), "int32") if topk else None, kv_scale=((), "float32") if fp8 else None)
        cases.append((f"decode H{heads}{' fp8' if fp8 else ''}{f' top-k {topk}' if topk else ''}",
                      plan_mla_fwd(shape, options, target=target), {**dtypes, "kv": cache}))
    for topk in (0, 2048):
        shape, options = check_mla_args(q=((1, 4096, H, DQK), "bfloat16"), kv=((1, 4096, DQK), "bfloat16"),
                                        head_dim_v=DV, causal=True, indices=((1, 4096, topk), "int32") if topk else None)
        label = f"prefill causal{f' top-k {topk}' if topk else ''}"
        cases.append((label, plan_mla_fwd(shape, options, target=target), dtypes))
        cases.append((label + " bwd", plan_mla_bwd(shape, options, target=target), dtypes))
    layout = layout_of(topk_block_mask(4096))
    mask_dtypes = {**dtypes, **{n: "int32" for n in BlockMask.array_names}}
    for heads in (H, 1):
        shape, options = check_mla_args(q=((1, 4096, heads, DQK), "bfloat16"), kv=((1, 4096, DQK), "bfloat16"),
                                        head_dim_v=DV)
        label = f"prefill H{heads} block mask"
        cases.append((label, plan_mla_fwd(shape, options, target=target, sparse=layout), mask_dtypes))
        cases.append((label + " bwd", plan_mla_bwd(shape, options, target=target, sparse=layout), mask_dtypes))
    for label, plan, dt in cases:
        for launch in plan.launches:
            smem, usage = compile_launch_sm90(plan, launch, dt)
            print(f"{label:28s} {launch.kernel.split(':')[1]:30s} warps={launch.num_warps} "
                  f"stages={launch.num_stages} smem={smem} {usage}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one row of each kind")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="tile variants on the key rows")
    parser.add_argument("--ptxas", action="store_true", help="compile the default plans for sm_90 (no GPU)")
    parser.add_argument("--prefill-only", action="store_true", help="the prefill rows alone (dense, top-k, block mask)")
    args = parser.parse_args()
    if args.ptxas:
        ptxas_report()
        return
    if args.sweep:
        result = sweep()
        print(f"wrote {save('mla_sweep_h200', {'sweep': result})}")
        return
    print(json.dumps(environment()))
    copy_tbs = measure_copy_ceiling()
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s")
    with_jax = not args.no_jax
    rows = []
    if not args.prefill_only:
        rows += decode_rows(args.quick, with_jax)
        rows += h16_rows(copy_tbs, args.quick, with_jax)
        rows += sparse_rows()
    rows += prefill_rows(with_jax=with_jax)
    table = [[r["case"], r["provider"], r.get("ms", r.get("fwd_ms", "-")), r.get("tflops", r.get("fwd_tflops", "-")),
              r.get("tbs", "-"), r.get("bwd_ms", "-")] for r in rows]
    print_table("MLA, bf16 unless said, Dqk=576 Dv=512, paged 64", ["case", "provider", "ms", "TFLOP/s", "TB/s",
                                                                     "bwd ms"], table)
    lines = verdicts(rows, copy_tbs)
    print("\n".join(lines))
    name = "mla_h200_quick" if args.quick else "mla_prefill_h200" if args.prefill_only else "mla_h200"
    print(f"wrote {save(name, {'copy_tbs': copy_tbs, 'rows': rows, 'verdicts': lines, 'targets': TARGETS})}")
    plot(rows, name)


if __name__ == "__main__":
    main()
