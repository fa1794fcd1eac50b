"""MLA (DeepSeek latent attention, absorbed form) benchmark on a CUDA GPU, baselines in the same run.

Shapes: H=128 query heads (H=16: one tensor-parallel shard), one 576-dim latent head (512 + 64 RoPE), the
values its first 512 dims, bf16, paged caches of 64-row pages. Rows:

* decode B in {64, 128}, S in {4096, 32768}: ours (torch, CUDA graph; JAX, a decode loop in one jitted call,
  on the same cache through DLPack) against the generic decode kernel on the same cache
  (``flashbridge::decode_attn`` with ``v_cache = k_cache[..., :512]``, what ``decode_attention`` ran before
  the MLA path). TFLOP/s = 2 B H S (576 + 512) per step.
* H=16 (memory-bound): TB/s = latent bytes read (B S 576 x itemsize) per step, against the device-to-device
  copy measured in the same run; the FP8 cache's speed-up over bf16.
* sparse decode, top-k 2048 of S=32768: time per step against dense decode over S=2048 (the same work).
* prefill forward, B=1, S=4096, causal: dense and sparse (top-k 2048 of the visible keys); TFLOP/s = 2 H
  (visible pairs) (576 + 512); the backward is timed and reported (2.5x the forward's FLOPs). Baseline:
  ``flash_attention`` on the un-absorbed form (per-head keys of 192 dims, values of 128: the same attention
  output after W_UV), same run.
* prefill with a block mask, S=4096 (with --all): top-k key blocks per query block
  (``masks.from_blocks``, 64x64 blocks, 32 of 64 key blocks drawn per query block with a fixed seed: about
  the causal row's work), H=128 and the seed's one head (q ``[4096 x 576]``); TFLOP/s counted on the visited
  blocks, forward and backward, torch and JAX, beside the dense causal row.

Decode steps are timed from CUDA graphs of several calls (``time_torch_steady``: captured in thread_local
mode, so that JAX's runtime threads, alive once a JAX row ran, cannot invalidate the capture); prefill with
``do_bench``. A row that fails is recorded with its error and the run goes on; the JSON is written after
every row.

    python benchmarks/bench_mla.py            # the bars' rows, JSON (results/mla_h200.json) and plot (~3 min)
    python benchmarks/bench_mla.py --all      # also block masks, H=16 at every shape, JAX on every decode shape
    python benchmarks/bench_mla.py --only decode,sparse   # sections: decode h16 sparse prefill mask
    python benchmarks/bench_mla.py --sweep    # tile variants (MLAConfig through configure) on the key rows
    python benchmarks/bench_mla.py --ptxas    # no GPU needed: compile the default plans for sm_90
"""
from __future__ import annotations

import argparse
import json
import math
import time
import traceback

from _common import (compile_launch_sm90, environment, measure_copy_ceiling, print_table, save, save_figure,
                     time_jax, time_torch, time_torch_steady)

H, DQK, DV, PAGE = 128, 576, 512, 64
L2_BYTES = 60 * 2**20
JAX_STEPS = 64  # decode steps per jitted call of the JAX rows (a call's fixed host cost amortised)
GRAPH_CALLS = 16  # decode calls per captured CUDA graph (the graph's launch amortised)
DECODE_ROWS = [(64, 4096), (64, 32768), (128, 4096), (128, 32768)]
H16_QUICK_ROWS = [(64, 4096), (64, 32768)]  # H=16 without --all
JAX_DECODE_ROWS = [(64, 4096), (128, 32768)]  # the JAX decode rows without --all
SECTIONS = ("decode", "h16", "sparse", "prefill", "mask")
TARGETS = {"decode_tflops": 350.0, "h16_copy_fraction": 0.8, "fp8_speedup": 1.6, "sparse_ratio": 1.2,
           "prefill_tflops": 350.0, "jax_ratio": 0.95}
MASK_BLOCK, MASK_SEED = 64, 0  # the block-mask rows: 64-token blocks, half the key blocks of each query block


def decode_flops(b, s, heads=H):
    return 2 * b * heads * s * (DQK + DV)


class Run:
    """The rows measured so far; each row is measured by a function that may fail: its error is recorded
    instead, and the JSON is written after every row."""

    def __init__(self, name: str, copy_tbs: float):
        self.name, self.copy_tbs, self.rows = name, copy_tbs, []

    def add(self, case: str, provider: str, measure) -> dict:
        start = time.perf_counter()
        try:
            row = {"case": case, "provider": provider, **measure()}
        except Exception as exc:  # noqa: BLE001 -- a failing row is recorded, the run goes on
            traceback.print_exc()
            row = {"case": case, "provider": provider, "error": f"{type(exc).__name__}: {exc}"[:500]}
        row["wall_s"] = round(time.perf_counter() - start, 1)
        self.rows.append(row)
        print(json.dumps(row))
        self.save()
        return row

    def get(self, case: str, provider: str) -> dict:
        return next((r for r in self.rows if r["case"] == case and r["provider"] == provider), {})

    def save(self):
        save(self.name, {"copy_tbs": self.copy_tbs, "rows": self.rows, "verdicts": verdicts(self.rows, self.copy_tbs),
                         "targets": TARGETS})


def _generator(seed):
    import torch

    # inputs come from generators of their own: a failed capture leaves torch's default CUDA generator
    # unusable for the rest of the process (see flashbridge._timing)
    return torch.Generator(device="cuda").manual_seed(seed)


def graph_ms(fn, arg_sets) -> float:
    """ms per call of ``fn(*args)``, the sets replayed back to back from one CUDA graph of at least
    GRAPH_CALLS calls."""
    arg_sets = list(arg_sets)
    return time_torch_steady(fn, arg_sets * max(1, math.ceil(GRAPH_CALLS / len(arg_sets))))


# ------------------------------------------------------------------------------------------------ inputs

def make_cache(b, s, *, fp8=False, copies=1, seed=0):
    """``copies`` paged latent caches of B full sequences (64-row pages in a shuffled pool)."""
    import torch

    g = _generator(seed)
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

    g = _generator(seed)
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


class DecodeInputs:
    """One decode shape's inputs, shared by its providers: full paged caches (rotated when smaller than
    4 x the L2), a query, the lengths, top-k indices."""

    def __init__(self, b, s, *, heads=H, fp8=False, topk=0):
        import torch

        self.b, self.s, self.heads, self.fp8 = b, s, heads, fp8
        self.caches = make_cache(b, s, fp8=fp8, copies=n_copies(b * s * DQK * (1 if fp8 else 2)))
        self.q = torch.randn(b, 1, heads, DQK, device="cuda", dtype=torch.bfloat16, generator=_generator(1))
        self.lens = torch.full((b,), s, dtype=torch.int32, device="cuda")
        self.idx = topk_indices(b, 1, s, topk, causal=True) if topk else None


# ----------------------------------------------------------------------------------------------- decode

def torch_decode_ms(inp: DecodeInputs, *, generic=False):
    """(ms per step, one step's output) of our MLA decode or of the generic decode kernel on ``inp``."""
    from flashbridge.torch_api import decode as tdecode
    from flashbridge.torch_api.mla import mla_decode

    def step(cache, extra):
        if generic:  # the generic kernel as decode_attention ran MLA shapes before (no routing)
            k = cache.unsqueeze(2)
            scale = extra.get("kv_scale")
            return tdecode._decode_attn(inp.q, k, k[..., :DV], inp.lens, extra["block_table"], None, None, scale,
                                        scale, "NHD", DQK ** -0.5, True, None, 0, 0.0, None)[0]
        return mla_decode(inp.q, cache, cache_seqlens=inp.lens, head_dim_v=DV, indices=inp.idx, **extra)

    out = step(*inp.caches[0])
    return graph_ms(step, inp.caches), out


def jax_decode_ms(inp: DecodeInputs, steps=JAX_STEPS):
    """ms per step of the JAX decode on ``inp``'s first cache (through DLPack, no copy): a loop of ``steps``
    steps in one jitted call, each step waiting for the previous one (a dependency chain, as in generation)."""
    import jax

    from flashbridge.jax_api.mla import mla_decode

    cache, extra = inp.caches[0]
    as_jax = jax.dlpack.from_dlpack
    args = (as_jax(inp.q), as_jax(cache), as_jax(inp.lens), {n: as_jax(v) for n, v in extra.items()},
            None if inp.idx is None else as_jax(inp.idx))

    def many(q, cache, lens, extra, idx):
        def one(_, lens):
            out = mla_decode(q, cache, cache_seqlens=lens, head_dim_v=DV, indices=idx, **extra)
            # the next step waits for this one through its lengths (unchanged: |out| is never 1e30), a
            # dependency that costs one tiny op instead of rewriting the (B, 1, H, 576) query
            return lens + (out[0, 0, 0, 0] > 1e30).astype(lens.dtype)
        return jax.lax.fori_loop(0, steps, one, lens)

    return time_jax(many, *args) / steps


def decode_rows(run: Run, quick=False, with_jax=True):
    for b, s in DECODE_ROWS:
        case = f"decode H{H} B{b} S{s}"
        inp = DecodeInputs(b, s)
        ours = {}

        def measure_ours():
            ms, ours["out"] = torch_decode_ms(inp)
            return {"ms": ms, "tflops": decode_flops(b, s) / ms / 1e9}

        def measure_generic():
            ms, out = torch_decode_ms(inp, generic=True)
            diff = float((out.float() - ours["out"].float()).abs().max()) if "out" in ours else None
            return {"ms": ms, "tflops": decode_flops(b, s) / ms / 1e9, "max_diff_vs_ours": diff}

        run.add(case, "ours torch", measure_ours)
        run.add(case, "generic decode", measure_generic)
        if with_jax and (not quick or (b, s) in JAX_DECODE_ROWS):
            run.add(case, "ours jax", lambda: (lambda ms: {"ms": ms, "tflops": decode_flops(b, s) / ms / 1e9})(
                jax_decode_ms(inp)))


def h16_rows(run: Run, quick=False, with_jax=True):
    for b, s in (H16_QUICK_ROWS if quick else DECODE_ROWS):
        case = f"decode H16 B{b} S{s}"
        nbytes = b * s * DQK * 2
        inp = DecodeInputs(b, s, heads=16)
        run.add(case, "ours torch", lambda: (lambda ms: {"ms": ms, "tbs": nbytes / ms / 1e9,
                                                         "copy_fraction": nbytes / ms / 1e9 / run.copy_tbs})(
            torch_decode_ms(inp)[0]))
        run.add(case, "generic decode", lambda: (lambda ms: {"ms": ms, "tbs": nbytes / ms / 1e9})(
            torch_decode_ms(inp, generic=True)[0]))
        if with_jax and (not quick or (b, s) == H16_QUICK_ROWS[-1]):
            run.add(case, "ours jax", lambda: (lambda ms: {"ms": ms, "tbs": nbytes / ms / 1e9})(jax_decode_ms(inp)))
        inp = DecodeInputs(b, s, heads=16, fp8=True)
        bf16 = run.get(case, "ours torch")

        def measure_fp8():
            ms = torch_decode_ms(inp)[0]
            return {"ms": ms, "tbs": nbytes / 2 / ms / 1e9, "copy_fraction": nbytes / 2 / ms / 1e9 / run.copy_tbs,
                    "fp8_speedup": bf16["ms"] / ms if "ms" in bf16 else None}

        run.add(case, "ours torch fp8", measure_fp8)
        # the same cache through the widened path (no column pairs, V read twice), for the comparison
        run.add(case, "ours torch fp8 widened", lambda: _with_config({"fp8_pairs": False}, measure_fp8))


def _with_config(fields, measure):
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.mla.plan import MLAConfig

    with configure(MLAConfig(**fields)):
        return measure()


def sparse_rows(run: Run, with_jax=True):
    b, s, topk = 64, 32768, 2048
    dense_case = f"decode H{H} B{b} S{topk}"
    inp = DecodeInputs(b, topk)
    run.add(dense_case, "ours torch", lambda: (lambda ms: {"ms": ms, "tflops": decode_flops(b, topk) / ms / 1e9})(
        torch_decode_ms(inp)[0]))
    dense = run.get(dense_case, "ours torch")
    case = f"sparse decode H{H} B{b} top-k {topk} of S{s}"
    inp = DecodeInputs(b, s, topk=topk)

    def measure(ms):
        return {"ms": ms, "tflops": decode_flops(b, topk) / ms / 1e9,
                "ratio_to_dense_2048": ms / dense["ms"] if "ms" in dense else None}

    run.add(case, "ours torch", lambda: measure(torch_decode_ms(inp)[0]))
    if with_jax:
        run.add(case, "ours jax", lambda: measure(jax_decode_ms(inp)))


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


def prefill_rows(run: Run, s=4096, with_jax=True):
    import torch

    from flashbridge.torch_api.attention import flash_attention
    from flashbridge.torch_api.mla import mla_attention

    b = 1
    g = _generator(2)
    q = torch.randn(b, s, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(b, s, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    for topk in (0, 2048):
        idx = topk_indices(b, s, s, topk, causal=True) if topk else None
        case = f"prefill H{H} S{s} causal" + (f" top-k {topk}" if topk else "")
        flops = 2 * H * visible_pairs(s, topk) * (DQK + DV) * b

        def measure():
            fwd = time_torch(lambda: mla_attention(q, kv, head_dim_v=DV, causal=True, indices=idx))
            qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
            out = mla_attention(qg, kvg, head_dim_v=DV, causal=True, indices=idx)
            dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=_generator(3))
            bwd = time_torch(lambda: torch.autograd.grad(out, (qg, kvg), dout, retain_graph=True))
            return {"fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9, "bwd_ms": bwd,
                    "bwd_tflops": 2.5 * flops / bwd / 1e9}

        run.add(case, "ours torch", measure)
        if with_jax:
            run.add(case, "ours jax", lambda: _jax_prefill(q, kv, idx, flops))

    def unabsorbed():  # the un-absorbed form (per-head keys of 192 dims, values of 128), dense causal
        qu = torch.randn(b, s, H, 192, device="cuda", dtype=torch.bfloat16, generator=g)
        ku = torch.randn(b, s, H, 192, device="cuda", dtype=torch.bfloat16, generator=g)
        vu = torch.randn(b, s, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        fwd = time_torch(lambda: flash_attention(qu, ku, vu, causal=True))
        qg, kg, vg = (t.clone().requires_grad_() for t in (qu, ku, vu))
        out = flash_attention(qg, kg, vg, causal=True)
        dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
        bwd = time_torch(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True))
        flops = 2 * H * visible_pairs(s) * (192 + 128) * b
        return {"fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9, "bwd_ms": bwd, "bwd_tflops": 2.5 * flops / bwd / 1e9}

    run.add(f"prefill H{H} S{s} causal", "flash_attention un-absorbed (192/128)", unabsorbed)


def block_mask_rows(run: Run, s=4096, with_jax=True):
    """Prefill over a top-k block mask (32 of 64 key blocks of 64 per query block at S=4096): H=128 and the
    seed's one head. FLOPs: 2 H (pairs in visited blocks) (576 + 512); backward 2.5x."""
    import torch

    from flashbridge.torch_api.mla import mla_attention

    mask = topk_block_mask(s)
    for heads in (H, 1):
        g = _generator(4)
        q = torch.randn(1, s, heads, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(1, s, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
        n_q, n_k = mask.num_blocks
        case = (f"prefill H{heads} S{s} block mask {n_k // 2} of {n_k} ({MASK_BLOCK}x{MASK_BLOCK})"
                + (" = the seed's Q [4096 x 576]" if heads == 1 and s == 4096 else ""))
        flops = 2 * heads * mask_pairs(mask) * (DQK + DV)

        def measure():
            fwd = time_torch(lambda: mla_attention(q, kv, head_dim_v=DV, block_mask=mask))
            qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
            out = mla_attention(qg, kvg, head_dim_v=DV, block_mask=mask)
            dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
            bwd = time_torch(lambda: torch.autograd.grad(out, (qg, kvg), dout, retain_graph=True))
            return {"fwd_ms": fwd, "fwd_tflops": flops / fwd / 1e9, "bwd_ms": bwd,
                    "bwd_tflops": 2.5 * flops / bwd / 1e9, "density": mask.density}

        run.add(case, "ours torch", measure)
        if with_jax:
            run.add(case, "ours jax", lambda: _jax_prefill_masked(q, kv, mask, flops))


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


# ----------------------------------------------------------------------------------------------- verdicts

def verdicts(rows, copy_tbs):
    """One line per bar of the MLA issue, from the rows measured (failed rows skipped)."""
    lines = []
    by = {(r["case"], r["provider"]): r for r in rows if "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']} {r['provider']}: FAILED ({r['error'][:120]})")
            continue
        if r["provider"] == "ours torch" and r["case"].startswith(f"decode H{H} ") and "tflops" in r:
            ok = r["tflops"] >= TARGETS["decode_tflops"]
            generic = by.get((r["case"], "generic decode"), {}).get("tflops", 0)
            lines.append(f"{r['case']}: {r['tflops']:.0f} TFLOP/s (bar {TARGETS['decode_tflops']:.0f}) "
                         f"{'met' if ok else 'MISSED'}; generic {generic:.0f}")
        if r["provider"] == "ours jax" and "ms" in r and (r["case"], "ours torch") in by:
            lines.append(f"{r['case']}: JAX / torch speed {by[(r['case'], 'ours torch')]['ms'] / r['ms']:.3f} "
                         f"(bar {TARGETS['jax_ratio']})")
        if r["provider"] == "ours jax" and "fwd_ms" in r and "fwd_ms" in by.get((r["case"], "ours torch"), {}):
            lines.append(f"{r['case']}: JAX / torch forward speed "
                         f"{by[(r['case'], 'ours torch')]['fwd_ms'] / r['fwd_ms']:.3f} (bar {TARGETS['jax_ratio']})")
        if r["case"].startswith("decode H16") and "copy_fraction" in r:
            speedup = r.get("fp8_speedup")
            lines.append(f"{r['case']} {r['provider']}: {r['tbs']:.2f} TB/s = {r['copy_fraction']:.2f} of copy "
                         f"{copy_tbs:.2f} (bar {TARGETS['h16_copy_fraction']})"
                         + (f", FP8 speed-up {speedup:.2f}x (bar {TARGETS['fp8_speedup']})" if speedup else ""))
        if r.get("ratio_to_dense_2048"):
            lines.append(f"{r['case']} {r['provider']}: {r['ratio_to_dense_2048']:.2f}x dense decode over 2048 keys "
                         f"(bar {TARGETS['sparse_ratio']})")
        if r["case"].startswith("prefill") and r["provider"] == "ours torch" and "fwd_tflops" in r:
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

SWEEP = {  # case -> (kwargs of DecodeInputs, MLAConfig field dicts)
    "H128 B64 S4096": (dict(b=64, s=4096), [{}, {"block_n": 32}, {"block_n": 32, "num_stages": 3},
                                            {"num_stages": 1}, {"block_m": 32}, {"block_m": 32, "block_n": 32}]),
    "H16 B64 S32768": (dict(b=64, s=32768, heads=16), [{}, {"num_stages": 3}, {"num_stages": 7}, {"block_n": 32},
                                                        {"num_warps": 4}, {"block_n": 128, "num_stages": 3}]),
    "H16 B64 S32768 fp8": (dict(b=64, s=32768, heads=16, fp8=True),
                           [{}, {"fp8_pairs": False}, {"num_stages": 5}, {"num_stages": 9}, {"block_n": 32},
                            {"block_n": 128, "num_stages": 5}, {"num_warps": 4}]),
    "H128 B64 S4096 fp8": (dict(b=64, s=4096, fp8=True), [{}, {"fp8_pairs": False}, {"block_m": 16},
                                                           {"num_stages": 5}, {"block_n": 32}]),
    "sparse H128 B64 top-k 2048 of S32768": (dict(b=64, s=32768, topk=2048), [{}, {"block_n": 32}]),
}


# block-mask backward (S=4096, 32 of 64 blocks of 64), heads -> MLAConfig field dicts: at H=1 the default dKV
# tile (64 rows, 2 stages) spills 104 B on sm_90, 32 rows or one stage none
MASK_BWD_SWEEP = {1: [{}, {"dkv_block_m": 32}, {"dkv_num_stages": 1}], H: [{}, {"dkv_block_m": 32}]}


def _mask_bwd_ms(heads, s=4096):
    """ms of the block-mask backward (S=4096, 32 of 64 blocks of 64) through the public op."""
    import torch

    from flashbridge.torch_api.mla import mla_attention

    mask = topk_block_mask(s)
    g = _generator(5)
    q = torch.randn(1, s, heads, DQK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kv = torch.randn(1, s, DQK, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    out = mla_attention(q, kv, head_dim_v=DV, block_mask=mask)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    return time_torch(lambda: torch.autograd.grad(out, (q, kv), dout, retain_graph=True))


def sweep():
    """Tile variants on the key rows, each through the public ops inside ``configure(MLAConfig(...))``."""
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.mla.plan import MLAConfig

    results = []

    def one(case, fields, measure):
        try:
            with configure(MLAConfig(**fields)):  # the forward and its backward planned with it
                results.append({"case": case, "config": fields, "ms": measure()})
        except Exception as exc:  # noqa: BLE001
            results.append({"case": case, "config": fields, "error": repr(exc)[:300]})
        print(results[-1])

    for case, (kwargs, configs) in SWEEP.items():
        inp = DecodeInputs(**kwargs)
        for fields in configs:
            one(case, fields, lambda: torch_decode_ms(inp)[0])
    for heads, configs in MASK_BWD_SWEEP.items():
        for fields in configs:
            one(f"block mask bwd H{heads} S4096", fields, lambda: _mask_bwd_ms(heads))
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
    parser.add_argument("--all", action="store_true",
                        help="also the block-mask rows, H=16 at every shape, JAX on every decode shape")
    parser.add_argument("--quick", action="store_true", help="the default rows (kept for scripts)")
    parser.add_argument("--only", default=None, help=f"comma-separated sections of {SECTIONS}")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="tile variants on the key rows")
    parser.add_argument("--ptxas", action="store_true", help="compile the default plans for sm_90 (no GPU)")
    args = parser.parse_args()
    if args.ptxas:
        ptxas_report()
        return
    if args.sweep:
        result = sweep()
        print(f"wrote {save('mla_sweep_h200', {'sweep': result})}")
        return
    if args.only:
        sections = [x for x in args.only.split(",") if x]
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            parser.error(f"--only: unknown sections {unknown}; choose from {SECTIONS}")
    else:
        sections = list(SECTIONS if args.all else SECTIONS[:-1])
    quick = not args.all
    print(json.dumps(environment()))
    copy_tbs = measure_copy_ceiling()
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s")
    name = "mla_h200_partial" if args.only else "mla_h200_all" if args.all else "mla_h200"
    run = Run(name, copy_tbs)
    with_jax = not args.no_jax
    start = time.perf_counter()
    for section in sections:
        if section == "decode":
            decode_rows(run, quick, with_jax)
        elif section == "h16":
            h16_rows(run, quick, with_jax)
        elif section == "sparse":
            sparse_rows(run, with_jax)
        elif section == "prefill":
            prefill_rows(run, with_jax=with_jax)
        else:
            block_mask_rows(run, with_jax=with_jax)
        print(f"{section}: done after {time.perf_counter() - start:.0f} s")
    rows = run.rows
    table = [[r["case"], r["provider"], r.get("ms", r.get("fwd_ms", "-")), r.get("tflops", r.get("fwd_tflops", "-")),
              r.get("tbs", "-"), r.get("bwd_ms", "-"), r.get("error", "")[:60]] for r in rows]
    print_table("MLA, bf16 unless said, Dqk=576 Dv=512, paged 64", ["case", "provider", "ms", "TFLOP/s", "TB/s",
                                                                     "bwd ms", "error"], table)
    print("\n".join(verdicts(rows, copy_tbs)))
    run.save()
    print(f"wrote {name}.json after {time.perf_counter() - start:.0f} s")
    plot(rows, name)


if __name__ == "__main__":
    main()
