"""The elementwise ops of a transformer block on a CUDA GPU: RoPE of q and k and SwiGLU, forward and backward,
at Llama-3-8B's shapes (bf16): ours (torch and JAX paths) beside liger-kernel, torch.compile of the eager
expression and eager torch, same inputs, same run.

TB/s = (bytes of every tensor read + every tensor written) / time; RoPE's cos / sin tables (2 MB, read from
L2) are not counted. The comparison of record is the steady figure (every provider timed the same way: a
CUDA graph of several distinct input sets in torch, one jitted function over them in JAX; device time per
call, no host time, no L2 flush); ``do_bench`` figures of eager calls are printed beside it.

    python benchmarks/bench_fused_block.py           # Llama-3-8B shapes, plot
    python benchmarks/bench_fused_block.py --quick   # a quarter of the tokens, fewer input sets
    python benchmarks/bench_fused_block.py --tune    # also block-size candidates for the plan defaults
    python benchmarks/bench_fused_block.py --only rope   # the RoPE rows alone (fused_block_h200_rope.json)
"""
from __future__ import annotations

import argparse
import functools
import gc
import traceback

from _common import (environment, measure_copy_ceiling, print_table, save, save_figure, time_jax, time_jax_steady,
                     time_torch, time_torch_steady)

import torch
import torch.nn.functional as F

from flashbridge import torch_api as ft
from flashbridge.core_kernels.rotary.plan import RotaryConfig, check_rotary_args, plan_rotary
from flashbridge.core_kernels.swiglu.plan import SwigluConfig, plan_swiglu_bwd, plan_swiglu_fwd
from flashbridge.torch_api._runtime import execute, target_for

# Llama-3-8B: 32 query heads and 8 KV heads of 128, MLP 4096 -> 14336; 8 sequences of 4096 tokens
ROPE_SHAPE = dict(batch=8, seqlen=4096, q_heads=32, k_heads=8, head_dim=128)
SWIGLU_SHAPE = dict(rows=8 * 4096, width=14336)
QUICK_TOKENS = 2 * 4096
# distinct input sets per steady timing: each set is far beyond the 60 MB L2 (RoPE 335 MB of q + k, SwiGLU
# 1.9 GB of gate + up), so no set is served from the cache; more sets only cost memory
STEADY_SETS = {"rope": 8, "swiglu": 4}
DTYPE = torch.bfloat16
BAR = 0.9  # of the copy ceiling


@functools.lru_cache(maxsize=None)
def _liger():
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        return liger_rotary_pos_emb, LigerSiLUMulFunction
    except Exception as exc:  # not installed (it is carried as a wheel to the GPU machine)
        print(f"liger-kernel unavailable: {exc}")
        return None, None


# ------------------------------------------------------------------------------------------ expressions

def eager_rope(q, k, cos, sin):
    """flash-attn's / Llama's rotation of the two halves, in the inputs' dtype (tables cast to it, as Hugging
    Face does)."""
    c, s = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]  # (S, 1, D/2) against (B, S, H, D/2)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return rotate(q), rotate(k)


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def eager_swiglu_fused(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


torch._dynamo.config.recompile_limit = 64
_compiled = {f.__name__: torch.compile(f, dynamic=False) for f in (eager_rope, eager_swiglu, eager_swiglu_fused)}


# ------------------------------------------------------------------------------------------------ cases

class Case:
    """One row: an op, a direction, its input sets, the bytes it moves and every provider."""

    def __init__(self, op: str, backward: bool, quick: bool):
        self.op, self.backward = op, backward
        self.family = "rope" if op.startswith("rope") else "swiglu"
        self.sets = [self._inputs(i, quick) for i in range(STEADY_SETS[self.family] // (2 if quick else 1))]
        ins = self.sets[0]["grad_inputs"]
        # forward: inputs read, outputs (the inputs' sizes, or half of the fused input) written; backward: the
        # output gradients and (SwiGLU) the saved inputs read, the input gradients written
        elements = sum(t.numel() for t in ins)
        if self.family == "rope":
            self.amount = 2 * elements * 2
        else:
            self.amount = (5 if backward else 3) * (elements // 2) * 2

    def _inputs(self, i: int, quick: bool) -> dict:
        g = torch.Generator(device="cuda").manual_seed(1000 + i)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, device="cuda", generator=g) * scale).to(DTYPE)

        if self.family == "rope":
            s = ROPE_SHAPE
            batch = QUICK_TOKENS // s["seqlen"] if quick else s["batch"]
            q = rand(batch, s["seqlen"], s["q_heads"], s["head_dim"])
            k = rand(batch, s["seqlen"], s["k_heads"], s["head_dim"])
            angles = torch.outer(torch.arange(s["seqlen"], device="cuda", dtype=torch.float32),
                                 10000.0 ** (-torch.arange(0, s["head_dim"], 2, device="cuda") / s["head_dim"]))
            return {"q": q, "k": k, "cos": angles.cos(), "sin": angles.sin(), "grad_inputs": [q, k],
                    "grads": [rand(*q.shape), rand(*k.shape)]}
        rows = QUICK_TOKENS if quick else SWIGLU_SHAPE["rows"]
        width = SWIGLU_SHAPE["width"]
        if self.op == "swiglu fused":
            x = rand(rows, 2 * width, scale=3.0)
            return {"x": x, "grad_inputs": [x], "grads": [rand(rows, width)]}
        gate, up = rand(rows, width, scale=3.0), rand(rows, width)
        return {"gate": gate, "up": up, "grad_inputs": [gate, up], "grads": [rand(rows, width)]}

    @property
    def label(self) -> str:
        shape = "x".join(map(str, self.sets[0]["grad_inputs"][0].shape))
        return f"{self.op} {shape} {'bwd' if self.backward else 'fwd'}"

    def torch_providers(self, a: dict) -> dict:
        """name -> closure returning the outputs (a tuple) of input set ``a``."""
        liger_rope, liger_swiglu = _liger()
        out = {}
        if self.op == "rope":
            q, k, cos, sin = a["q"], a["k"], a["cos"], a["sin"]
            out["flashbridge-torch"] = lambda: ft.rotary_embedding_qk(q, k, cos, sin)
            if not self.backward:
                out["flashbridge-torch inplace"] = lambda: ft.rotary_embedding_qk(q, k, cos, sin, inplace=True)
            out["torch-eager"] = lambda: eager_rope(q, k, cos, sin)
            out["torch.compile"] = lambda: _compiled["eager_rope"](q, k, cos, sin)
            if liger_rope is not None:
                # Hugging Face's layout: (B, H, S, D) views of the same memory, tables (1, S, D) with each half
                # twice; liger rotates q and k in place
                cos_full = torch.cat([cos, cos], dim=-1)[None].to(DTYPE)
                sin_full = torch.cat([sin, sin], dim=-1)[None].to(DTYPE)

                def liger():
                    q2, k2 = liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos_full, sin_full)
                    return q2.transpose(1, 2), k2.transpose(1, 2)

                out["liger-kernel"] = liger
        elif self.op == "swiglu":
            gate, up = a["gate"], a["up"]
            out["flashbridge-torch"] = lambda: (ft.swiglu(gate, up),)
            out["torch-eager"] = lambda: (eager_swiglu(gate, up),)
            out["torch.compile"] = lambda: (_compiled["eager_swiglu"](gate, up),)
            if liger_swiglu is not None:  # last: its backward overwrites gate and up with their gradients
                out["liger-kernel"] = lambda: (liger_swiglu.apply(gate, up),)
        else:
            x = a["x"]
            out["flashbridge-torch"] = lambda: (ft.swiglu(x),)
            out["torch-eager"] = lambda: (eager_swiglu_fused(x),)
            out["torch.compile"] = lambda: (_compiled["eager_swiglu_fused"](x),)
            if liger_swiglu is not None:  # as LigerPhi3SwiGLUMLP: chunk, then the (contiguous) halves
                out["liger-kernel"] = lambda: (liger_swiglu.apply(*x.chunk(2, dim=-1)),)
        return out

    def jax_sets(self) -> list:
        """Per input set: (function, arguments) of the JAX path; backward: (vjp closure, cotangents)."""
        import jax

        from flashbridge import jax_api as fj

        out = []
        for a in self.sets:
            args = [to_jax(t) for t in a["grad_inputs"]]
            if self.op == "rope":
                tables = [to_jax(a["cos"]), to_jax(a["sin"])]
                fn = fj.rotary_embedding_qk  # (q, k, cos, sin): the tables are arguments, not constants
            else:
                tables, fn = [], fj.swiglu
            if not self.backward:
                out.append((fn, args + tables))
                continue
            _, vjp_fn = jax.vjp(lambda *xs: fn(*xs, *tables), *args)
            cts = [to_jax(t) for t in a["grads"]]
            out.append((lambda f, ct: f(ct), [vjp_fn, tuple(cts) if self.op == "rope" else cts[0]]))
        return out


def to_jax(t):
    """A JAX copy of a CUDA tensor (through DLPack)."""
    import jax
    import jax.numpy as jnp

    return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous()), copy=True)


# ---------------------------------------------------------------------------------------------- timing

def time_case(case: Case, with_jax: bool) -> dict:
    """Every provider on one row: {name: {"ms", "steady_ms"}} (ms: do_bench of one eager call); a provider
    that raises gets {"error"} (with the traceback printed) and is tried once more after the others."""
    results = {}
    jax_sets = None
    if with_jax:  # copied first: liger-kernel's backward overwrites its torch inputs
        try:
            jax_sets = case.jax_sets()
            # JAX runs asynchronously: its copies and the vjp's forward (whose first call compiles and loads
            # kernels on JAX's threads) finish before any torch provider warms up and captures a graph
            import jax
            jax.block_until_ready([args for _, args in jax_sets])
        except Exception as exc:
            traceback.print_exc()
            results["flashbridge-jax"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    torch.cuda.synchronize()
    per_set = [case.torch_providers(a) for a in case.sets]
    names = list(per_set[0])
    for name in names:
        results[name] = _time_provider(case, per_set, name)
    for name in [n for n in names if "error" in results[n]]:  # once more, after every other provider ran
        results[name] = {"first_error": results[name]["error"], **_time_provider(case, per_set, name)}
    if jax_sets is not None:
        try:
            fn, args = jax_sets[0]
            results["flashbridge-jax"] = {"ms": time_jax(fn, *args),
                                          "steady_ms": time_jax_steady(fn, [args for _, args in jax_sets])}
        except Exception as exc:
            traceback.print_exc()
            results["flashbridge-jax"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    for r in results.values():
        for key in ("ms", "steady_ms"):
            if key in r:
                r[key.replace("ms", "tbps")] = case.amount / (r[key] * 1e-3) / 1e12
    return results


def _time_provider(case: Case, per_set: list, name: str) -> dict:
    """{"ms", "steady_ms"} of one torch provider on every input set of ``case``, or {"error"}."""
    try:
        if not case.backward:
            with torch.no_grad():
                steady = time_torch_steady(lambda fn: fn(), [(p[name],) for p in per_set])
                single = time_torch(per_set[0][name])
        else:
            graphs = []
            for a, p in zip(case.sets, per_set):
                for t in a["grad_inputs"]:
                    t.requires_grad_(True)
                graphs.append((p[name](), a["grad_inputs"], a["grads"]))
            step = lambda o, i, g: torch.autograd.grad(o, i, g, retain_graph=True)  # noqa: E731
            steady = time_torch_steady(step, graphs)
            single = time_torch(lambda: step(*graphs[0]))
            del graphs
        return {"ms": single, "steady_ms": steady}
    except Exception as exc:
        traceback.print_exc()
        print(f"{name} {case.label}: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        for a in case.sets:
            for t in a["grad_inputs"]:
                t.requires_grad_(False)
        gc.collect()
        torch.cuda.empty_cache()


def tune(quick: bool) -> list:
    """Block-size candidates of our kernels alone (the plan run directly, steady timing), forward and backward."""
    rows_out = []
    rope = Case("rope", False, quick)
    a0 = rope.sets[0]
    shape = check_rotary_args(**{n: (tuple(a0[n].shape), "bfloat16" if n in ("q", "k") else "float32")
                                 for n in ("cos", "sin")}, x=(tuple(a0["q"].shape), "bfloat16"),
                              k=(tuple(a0["k"].shape), "bfloat16"))
    target = target_for(a0["q"].device)
    for conjugate in (False, True):
        for block_t in (1, 2, 4, 8):
            for warps in (4, 8):
                cfg = RotaryConfig(block_t=block_t, num_warps=warps)
                plan = plan_rotary(shape, dtype="bfloat16", interleaved=False, conjugate=conjugate, inplace=False,
                                   target=target, config=cfg)
                sets = [({"x": a["q"], "k": a["k"], "cos": a["cos"], "sin": a["sin"]},) for a in rope.sets]
                ms = time_torch_steady(lambda inputs: execute(plan, inputs), sets)
                rows_out.append(["rope", "bwd" if conjugate else "fwd", f"block_t={block_t} warps={warps}", ms,
                                 rope.amount / (ms * 1e-3) / 1e12])
    del rope, sets
    torch.cuda.empty_cache()
    sw = Case("swiglu", True, quick)
    a0 = sw.sets[0]
    rows, width = a0["gate"].shape
    for backward in (False, True):
        for block_n in (512, 1024, 2048, 4096):
            for elements in (2048, 4096, 8192):
                for warps in (4, 8):
                    if elements < block_n:
                        continue
                    cfg = SwigluConfig(block_n=block_n, elements=elements, num_warps=warps)
                    make = plan_swiglu_bwd if backward else plan_swiglu_fwd
                    plan = make(rows, width, dtype="bfloat16", fused=False, target=target, config=cfg)
                    sets = [({"dy": a["grads"][0], "gate": a["gate"], "up": a["up"]},) for a in sw.sets]
                    ms = time_torch_steady(lambda inputs: execute(plan, {n: inputs[n] for n in plan.inputs}), sets)
                    amount = (5 if backward else 3) * rows * width * 2
                    rows_out.append(["swiglu", "bwd" if backward else "fwd",
                                     f"block_n={block_n} elements={elements} warps={warps}", ms,
                                     amount / (ms * 1e-3) / 1e12])
    print_table("block-size candidates (bf16, kernel alone, steady)", ["op", "dir", "config", "ms", "TB/s"], rows_out)
    return rows_out


# ------------------------------------------------------------------------------------------------ main

ROWS = [("rope", False), ("rope", True), ("swiglu", False), ("swiglu", True), ("swiglu fused", False),
        ("swiglu fused", True)]
MAIN_PROVIDERS = ("flashbridge-torch", "flashbridge-jax", "liger-kernel", "torch.compile", "torch-eager")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a quarter of the tokens, half the input sets")
    parser.add_argument("--tune", action="store_true", help="also time block-size candidates of our kernels")
    parser.add_argument("--no-jax", action="store_true")
    parser.add_argument("--only", choices=("rope", "swiglu"), help="the rows of one op (swiglu: split and fused)")
    args = parser.parse_args()
    ceiling = measure_copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s; {environment()}")
    payload = {"copy_ceiling_tbps": ceiling, "bar_of_ceiling": BAR, "quick": args.quick, "rows": []}
    name = "fused_block_h200" + ("_quick" if args.quick else "") + (f"_{args.only}" if args.only else "")
    if args.tune:
        payload["tune"] = tune(args.quick)
        save(name, payload)
    table = []
    for op, backward in ROWS:
        if args.only and not op.startswith(args.only):
            continue
        case = Case(op, backward, args.quick)
        res = time_case(case, with_jax=not args.no_jax)
        payload["rows"].append({"op": op, "direction": "bwd" if backward else "fwd", "label": case.label,
                                "bytes": case.amount, "sets": len(case.sets), "results": res})
        save(name, payload)  # after every row: a run cut short keeps what it measured
        for provider, r in res.items():
            if "error" in r:
                table.append([case.label, provider, r["error"][:60], "-", "-", "-", "-"])
                continue
            table.append([case.label, provider, r["steady_ms"], r["steady_tbps"], r["steady_tbps"] / ceiling,
                          r["ms"], r["tbps"]])
        del case
        gc.collect()
        torch.cuda.empty_cache()
    print_table(f"RoPE / SwiGLU, bf16 (copy ceiling {ceiling:.2f} TB/s, bar {BAR:.0%} of it)",
                ["row", "provider", "steady ms", "steady TB/s", "of ceiling", "do_bench ms", "do_bench TB/s"], table)
    path = save(name, payload)
    print(f"wrote {path}")
    plot(payload, name)


def plot(payload, name):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows, ceiling = payload["rows"], payload["copy_ceiling_tbps"]
    fig, ax = plt.subplots(figsize=(13, 5))
    xs = np.arange(len(rows))
    width = 0.8 / len(MAIN_PROVIDERS)
    for i, provider in enumerate(MAIN_PROVIDERS):
        ys = [r["results"].get(provider, {}).get("steady_tbps", np.nan) for r in rows]
        ax.bar(xs + (i - (len(MAIN_PROVIDERS) - 1) / 2) * width, ys, width, label=provider)
    ax.axhline(ceiling, color="gray", linestyle="--", label=f"copy ceiling {ceiling:.2f}")
    ax.axhline(BAR * ceiling, color="red", linestyle=":", label=f"bar ({BAR:.0%} of copy)")
    ax.set_xticks(xs, [f"{r['op']} {r['direction']}" for r in rows])
    ax.set_ylabel("TB/s (read + written)")
    ax.legend(fontsize=8, ncol=3)
    ax.set_title("RoPE (q 32 + k 8 heads of 128) and SwiGLU (14336) at Llama-3-8B shapes, bf16, H200: device time "
                 "per call (steady)", fontsize=10)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
