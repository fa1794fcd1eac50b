"""Fused-norm benchmark on a CUDA GPU: ours (torch and JAX paths) beside torch eager, F.rms_norm /
F.layer_norm, torch.compile and liger-kernel, same inputs, same run.

TB/s = (bytes of every tensor read + every tensor written) / time; weights are counted too.

    python benchmarks/bench_norms.py            # main shapes + width sweep + plot
    python benchmarks/bench_norms.py --tune     # also time block-size candidates for the plan defaults
"""
from __future__ import annotations

import argparse

from _common import (environment, kernel_trace, measure_copy_ceiling, print_table, save, save_figure,
                     time_jax, time_jax_steady, time_torch, time_torch_steady)

import torch
import torch.nn.functional as F

from flashbridge import torch_api as ft
from flashbridge.core_kernels.norms.plan import NormConfig, plan_norm_bwd, plan_norm_fwd
from flashbridge.torch_api._runtime import execute, target_for

MAIN_SHAPES = [(16384, 8192), (65536, 2048)]
SWEEP_WIDTHS = [1024, 4096, 16384]
SWEEP_ELEMENTS = 2**27
EPS = 1e-6
# distinct input sets per steady-state timing (16 x 256 MiB, far beyond the L2). With 4, a fixed cost per
# jitted call (~20-30 us) put JAX's forward rows 3-8% behind torch on identical kernels; with 16, 2-4%.
STEADY_SETS = 16


def _eager_rms(x, w, r=None):
    h = x if r is None else x + r
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)
    return y if r is None else (y, h)


def _eager_ln(x, w, b, r=None):
    h = x if r is None else x + r
    y = F.layer_norm(h.float(), (h.shape[-1],), w.float(), b.float(), EPS).to(x.dtype)
    return y if r is None else (y, h)


def _liger():
    try:
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        return LigerRMSNorm, LigerLayerNorm
    except Exception as exc:  # not installed (it is carried as a wheel to the GPU machine)
        print(f"liger-kernel unavailable: {exc}")
        return None, None


def providers(op: str, x, w, b, r):
    """name -> (forward closure returning y or (y, h), the weight tensor that gets a gradient)."""
    cols = x.shape[-1]
    rms = op.startswith("rms")
    res = r if op.endswith("+res") else None
    out = {}
    if rms:
        out["flashbridge-torch"] = (lambda: ft.rms_norm(x, w, eps=EPS, residual=res)), w
        out["torch-eager"] = (lambda: _eager_rms(x, w, res)), w
        out["torch.compile"] = (lambda: _compiled_rms(x, w, res)), w
        if res is None:
            out["F.rms_norm"] = (lambda: F.rms_norm(x, (cols,), w, EPS)), w
    else:
        out["flashbridge-torch"] = (lambda: ft.layer_norm(x, w, b, eps=EPS, residual=res)), w
        out["torch-eager"] = (lambda: _eager_ln(x, w, b, res)), w
        out["torch.compile"] = (lambda: _compiled_ln(x, w, b, res)), w
        if res is None:
            out["F.layer_norm"] = (lambda: F.layer_norm(x, (cols,), w, b, EPS)), w
    liger_rms, liger_ln = _liger()
    if res is None and liger_rms is not None:
        mod = (liger_rms(cols, eps=EPS) if rms else liger_ln(cols, eps=EPS)).to(device=x.device, dtype=x.dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            if not rms:
                mod.bias.copy_(b)
        out["liger-kernel"] = (lambda: mod(x)), mod.weight
    return out


torch._dynamo.config.recompile_limit = 256  # one compiled graph per shape and grad mode, as a user would get
_compiled_rms = torch.compile(_eager_rms, dynamic=False)
_compiled_ln = torch.compile(_eager_ln, dynamic=False)


def nbytes(op, rows, cols, itemsize, backward):
    big = rows * cols * itemsize
    params = cols * itemsize * (1 if op.startswith("rms") else 2)
    if backward:  # read dy, h (+ dh, the h output's gradient); write dx; read weight, write dweight (+ dbias)
        return (4 if op.endswith("+res") else 3) * big + 2 * params
    tensors = 2 + (2 if op.endswith("+res") else 0)
    return tensors * big + params


def to_jax(t):
    """A JAX copy of a CUDA tensor (through DLPack; numpy when that is unavailable)."""
    import jax
    import jax.numpy as jnp

    if t is None:
        return None
    try:
        return jnp.array(jax.dlpack.from_dlpack(t.detach().contiguous()), copy=True)
    except Exception:
        dtype = jnp.bfloat16 if t.dtype == torch.bfloat16 else t.dtype
        return jnp.asarray(t.detach().float().cpu().numpy()).astype(dtype)


def jax_forward(op, jb):
    from flashbridge import jax_api as fj

    if op.startswith("rms"):
        return lambda x, w, r: fj.rms_norm(x, w, eps=EPS, residual=r)
    return lambda x, w, r: fj.layer_norm(x, w, jb, eps=EPS, residual=r)


def jax_vjp_sets(op, sets, w, b):
    """Per input set (x, residual, cotangents): the backward closure and its cotangents, for timing."""
    import jax

    fwd = jax_forward(op, to_jax(b))
    jw = to_jax(w)
    out = []
    for x, r, grads in sets:
        jr = to_jax(r) if op.endswith("+res") else None
        _, vjp_fn = jax.vjp(lambda x, w: fwd(x, w, jr), to_jax(x), jw)
        cts = tuple(to_jax(g) for g in grads)
        out.append((vjp_fn, cts if len(cts) > 1 else cts[0]))
    return out


def jax_time(op, x, w, b, r, backward, grads):
    """The JAX path, timed as a one-op jitted function called back to back (``time_jax``)."""
    fwd = jax_forward(op, to_jax(b))
    jr = to_jax(r) if op.endswith("+res") else None
    if not backward:
        return time_jax(lambda x, w: fwd(x, w, jr), to_jax(x), to_jax(w))
    ((vjp_fn, cts),) = jax_vjp_sets(op, [(x, r, grads)], w, b)
    return time_jax(lambda f, ct: f(ct), vjp_fn, cts)


def torch_forward(op, w, b):
    if op.startswith("rms"):
        return lambda x, r: ft.rms_norm(x, w, eps=EPS, residual=r)
    return lambda x, r: ft.layer_norm(x, w, b, eps=EPS, residual=r)


def steady_times(op, x, w, b, r, backward, grads, g, with_jax, with_torch=True):
    """Every provider timed the same way: STEADY_SETS distinct input sets back to back (a CUDA graph in
    torch, one jitted function in JAX), no host time, no L2 flush; device time per call. This is the
    comparison of record: do_bench's per-call figure also counts whatever host time exceeds its ~60 us L2
    flush, which for eager calls of ~0.1-0.3 ms kernels varies with the host's load from run to run."""
    res_op = op.endswith("+res")

    def rand(t):  # from the benchmark's own generator: the default one is tied to graph captures
        return torch.randn(t.shape, device="cuda", dtype=t.dtype, generator=g)

    sets = [(x, r, grads)] + [(rand(x) * 2 + 1, rand(r), tuple(rand(gr) for gr in grads))
                              for _ in range(STEADY_SETS - 1)]
    per_set = [providers(op, xs, w, b, rs) for xs, rs, _ in sets] if with_torch else [{}]
    out = {}
    for name in per_set[0]:
        label = name + " steady"
        try:
            if not backward:
                with torch.no_grad():
                    out[label] = time_torch_steady(lambda fn: fn(), [(p[name][0],) for p in per_set])
                continue
            graphs = []
            for (xs, _, gs), p in zip(sets, per_set):
                fn, weight = p[name]
                xs.requires_grad_(True)
                weight.requires_grad_(True)
                outs = fn()
                graphs.append((outs if isinstance(outs, tuple) else (outs,), xs, weight, gs))
            out[label] = time_torch_steady(
                lambda o, xs, wt, gs: torch.autograd.grad(o, [xs, wt], gs, retain_graph=True), graphs)
        except Exception as exc:
            print(f"{label} {op}: {type(exc).__name__}: {exc}")
        finally:
            for xs, _, _ in sets:
                xs.requires_grad_(False)
            w.requires_grad_(False)
    if with_jax:
        try:
            if not backward:
                jfwd = jax_forward(op, to_jax(b))
                jw = to_jax(w)
                out["flashbridge-jax steady"] = time_jax_steady(
                    jfwd, [(to_jax(xs), jw, to_jax(rs) if res_op else None) for xs, rs, _ in sets])
            else:
                out["flashbridge-jax steady"] = time_jax_steady(lambda f, ct: f(ct), jax_vjp_sets(op, sets, w, b))
        except Exception as exc:
            print(f"jax steady {op}: {type(exc).__name__}: {exc}")
    return out


def trace_paths(op, x, w, b, r, backward, grads):
    """Kernel-by-kernel device time of the torch and the JAX path for one call (see kernel_trace)."""
    import jax

    res = r if op.endswith("+res") else None
    if backward:  # dx and dweight in both frameworks
        xs, ws = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        outs = torch_forward(op, ws, b)(xs, res)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch_call = lambda: (torch.autograd.grad(outs, [xs, ws], grads, retain_graph=True),  # noqa: E731
                              torch.cuda.synchronize())
        ((vjp_fn, cts),) = jax_vjp_sets(op, [(x, r, grads)], w, b)
        jitted = jax.jit(lambda f, ct: f(ct))
        jax_call = lambda: jax.block_until_ready(jitted(vjp_fn, cts))  # noqa: E731
        jfwd = jw = jr = None
    else:
        fwd = torch_forward(op, w, b)
        torch_call = lambda: (fwd(x, res), torch.cuda.synchronize())  # noqa: E731
        jfwd = jax_forward(op, to_jax(b))
        jx, jw, jr = to_jax(x), to_jax(w), to_jax(res)
        jitted = jax.jit(lambda x, w, r: jfwd(x, w, r))
        jax_call = lambda: jax.block_until_ready(jitted(jx, jw, jr))  # noqa: E731
    # STEADY_SETS calls in one jitted function (as time_jax_steady runs them): the busy fraction shows the
    # launch gaps XLA leaves between kernels; distinct inputs, or XLA would merge the calls
    if backward:
        sets = jax_vjp_sets(op, [(x * (1 + i / 8), r, grads) for i in range(STEADY_SETS)], w, b)
        jitted_sets = jax.jit(lambda sets: [f(ct) for f, ct in sets])
    else:
        sets = [(to_jax(x * (1 + i / 8)), jw, jr) for i in range(STEADY_SETS)]
        jitted_sets = jax.jit(lambda sets: [jfwd(*a) for a in sets])
    jax_call_sets = lambda: jax.block_until_ready(jitted_sets(sets))  # noqa: E731
    direction = "bwd" if backward else "fwd"
    with torch.no_grad() if not backward else torch.enable_grad():
        return {"torch": kernel_trace(torch_call, label=f"torch {op} {direction}"),
                "jax": kernel_trace(jax_call, label=f"jax {op} {direction}"),
                "jax_sets": kernel_trace(jax_call_sets, label=f"jax {op} {direction}, {STEADY_SETS} calls in one jit")}


def shape_inputs(op, rows, cols, dtype):
    """(generator, x, residual, weight, bias, output gradients) of one benchmark shape: the gradients of y,
    and with a residual also of h (the next block's residual stream), from the shape's own generator."""
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda", dtype=dtype, generator=g) * 2 + 1
    r = torch.randn(rows, cols, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(cols, device="cuda", dtype=dtype, generator=g) + 1
    b = torch.randn(cols, device="cuda", dtype=dtype, generator=g)
    n_grads = 2 if op.endswith("+res") else 1
    grads = tuple(torch.randn(rows, cols, device="cuda", dtype=dtype, generator=g) for _ in range(n_grads))
    return g, x, r, w, b, grads


def bench_shape(op, rows, cols, dtype, backward, ceiling, with_jax=True, steady=False, trace=None):
    """Every provider on one shape. ``steady``: also both of our paths timed the same way (steady_times);
    ``trace``: a list to append both paths' kernel-by-kernel device times to."""
    g, x, r, w, b, grads = shape_inputs(op, rows, cols, dtype)
    amount = nbytes(op, rows, cols, x.element_size(), backward)
    results = {}
    for name, (fn, weight) in providers(op, x, w, b, r).items():
        try:
            if backward:
                x.requires_grad_(True)
                weight.requires_grad_(True)
                # with a residual, both outputs carry a gradient (h is the next block's residual stream)
                outs = fn()
                outs = outs if isinstance(outs, tuple) else (outs,)
                ms = time_torch(lambda: torch.autograd.grad(outs, [x, weight], grads, retain_graph=True))
            else:
                with torch.no_grad():
                    ms = time_torch(fn)
        except Exception as exc:
            print(f"{name} {op} {rows}x{cols}: {type(exc).__name__}: {exc}")
            continue
        finally:
            x.requires_grad_(False)
            w.requires_grad_(False)
        results[name] = ms
    if with_jax:
        try:
            results["flashbridge-jax"] = jax_time(op, x.detach(), w, b, r, backward, grads)
        except Exception as exc:
            print(f"jax {op}: {type(exc).__name__}: {exc}")
    if steady:
        results.update(steady_times(op, x.detach(), w, b, r, backward, grads, g, with_jax))
    if trace is not None:
        try:
            trace.append({"op": op, "rows": rows, "cols": cols, "direction": "bwd" if backward else "fwd",
                          **trace_paths(op, x.detach(), w, b, r, backward, grads)})
        except Exception as exc:
            print(f"trace {op}: {type(exc).__name__}: {exc}")
    return {name: {"ms": ms, "tbps": amount / (ms * 1e-3) / 1e12, "of_ceiling": amount / (ms * 1e-3) / 1e12 / ceiling}
            for name, ms in results.items()}


FWD_CANDIDATES = [(bm, w) for bm in (1, 2, 4, 8) for w in (4, 8, 16)]
BWD_CANDIDATES = {8192: [(1, 8), (1, 16), (2, 16)], 2048: [(2, 8), (4, 8), (4, 16), (8, 16)]}


def tune(ceiling):
    """Time block-size candidates for the plan defaults at the main shapes (forward and backward)."""
    rows_out = []
    for rows, cols in MAIN_SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)  # not x: h and dy are distinct reads
        mean = torch.randn(rows, device="cuda")
        rstd = torch.rand(rows, device="cuda") + 0.5
        target = target_for(x.device)
        for is_rms in (True, False):
            name = "rms" if is_rms else "ln"
            for block_m, warps in FWD_CANDIDATES:
                if block_m * cols > 16384:
                    continue
                cfg = NormConfig(block_m=block_m, num_warps=warps)
                plan = plan_norm_fwd(rows, cols, x_dtype="bfloat16", residual_dtype=None, is_rms=is_rms,
                                     has_weight=True, has_bias=not is_rms, has_post_residual=False,
                                     dropout_p=0.0, eps=EPS, target=target, config=cfg)
                try:
                    ms = time_torch(lambda: execute(plan, {"x": x, "weight": w, "bias": b}))
                except Exception as exc:
                    print(f"fwd {cfg} failed: {exc}")
                    continue
                rows_out.append([name, f"{rows}x{cols}", "fwd", block_m, warps, "-", "-", ms,
                                 2 * x.numel() * 2 / (ms * 1e-3) / 1e12])
            for block_m, warps in BWD_CANDIDATES.get(cols, []):
                for ppsm in (2, 4, 8):
                    for stages in (1, 3):
                        cfg = NormConfig(block_m=block_m, num_warps=warps, bwd_programs_per_sm=ppsm,
                                         bwd_num_stages=stages)
                        plan = plan_norm_bwd(rows, cols, dx_dtype="bfloat16", weight_dtype="bfloat16",
                                             bias_dtype=None if is_rms else "bfloat16", is_rms=is_rms,
                                             has_dh=False, dropout_p=0.0, target=target, config=cfg)
                        inputs = {"dy": dy, "h": x, "weight": w, "mean": mean, "rstd": rstd}
                        try:
                            ms = time_torch(lambda: execute(plan, inputs))
                        except Exception as exc:
                            print(f"bwd {cfg} failed: {exc}")
                            continue
                        rows_out.append([name, f"{rows}x{cols}", "bwd", block_m, warps, ppsm, stages, ms,
                                         3 * x.numel() * 2 / (ms * 1e-3) / 1e12])
    print_table("block-size candidates (bf16)",
                ["op", "shape", "dir", "block_m", "warps", "progs/SM", "stages", "ms", "TB/s"], rows_out)
    return rows_out


def welford_parts(ceiling):
    """LayerNorm forward with 1, 2, 4, 8 Welford parts per row (log2_chunks 0..3): what the merge costs."""
    rows_out = []
    for rows, cols in MAIN_SHAPES:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) * 2 + 1
        w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        for log2_chunks in range(4):
            plan = plan_norm_fwd(rows, cols, x_dtype="bfloat16", residual_dtype=None, is_rms=False,
                                 has_weight=True, has_bias=True, has_post_residual=False, dropout_p=0.0,
                                 eps=EPS, target=target_for(x.device), config=NormConfig(log2_chunks=log2_chunks))
            ms = time_torch(lambda: execute(plan, {"x": x, "weight": w, "bias": b}))
            rows_out.append([f"{rows}x{cols}", 2**log2_chunks, ms, 2 * x.numel() * 2 / (ms * 1e-3) / 1e12])
    print_table("LayerNorm forward: Welford parts per row", ["shape", "parts", "ms", "TB/s"], rows_out)
    return rows_out


def jax_steady_table():
    """Only the JAX path in the steady mode at the main shapes (e.g. to compare XLA_FLAGS settings)."""
    import os

    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for rows, cols in MAIN_SHAPES:
        for op in ("rms", "ln", "rms+res", "ln+res"):
            for backward in (False, True):
                g, x, r, w, b, grads = shape_inputs(op, rows, cols, torch.bfloat16)
                ms = steady_times(op, x, w, b, r, backward, grads, g, True, with_torch=False).get(
                    "flashbridge-jax steady")
                amount = nbytes(op, rows, cols, 2, backward)
                if ms is None:
                    print(f"{op} {rows}x{cols}: failed")
                    continue
                print(f"{op} {rows}x{cols} {'bwd' if backward else 'fwd'} jax steady: {ms:.4f} ms "
                      f"{amount / (ms * 1e-3) / 1e12:.3f} TB/s")


def main():
    global STEADY_SETS
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--jax-only", action="store_true", help="only the JAX path, steady mode, printed")
    parser.add_argument("--steady-sets", type=int, default=STEADY_SETS,
                        help="distinct input sets per steady timing (calls per CUDA graph / per jitted function)")
    args = parser.parse_args()
    STEADY_SETS = args.steady_sets
    if args.jax_only:
        jax_steady_table()
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    ceiling = measure_copy_ceiling()
    print(f"copy ceiling: {ceiling:.2f} TB/s; {environment()}")
    payload = {"copy_ceiling_tbps": ceiling, "main": [], "sweep": []}
    if args.tune:
        payload["tune"] = tune(ceiling)
    payload["welford_parts"] = welford_parts(ceiling)
    table = []
    payload["traces"] = []
    # A throwaway backward row first: in every H200 run the first backward row's CUDA-graph captures failed
    # for all providers (retries included) while every later row captured; this row absorbs that.
    bench_shape("rms", 1024, 1024, torch.bfloat16, True, ceiling, steady=True)
    for rows, cols in MAIN_SHAPES:
        for op in ("rms", "ln", "rms+res", "ln+res"):
            for backward in (False, True):
                trace = payload["traces"] if (rows, cols) == MAIN_SHAPES[0] and op in ("rms", "ln") else None
                res = bench_shape(op, rows, cols, torch.bfloat16, backward, ceiling, steady=True, trace=trace)
                payload["main"].append({"op": op, "rows": rows, "cols": cols, "dtype": "bfloat16",
                                        "direction": "bwd" if backward else "fwd", "results": res})
                for name, v in res.items():
                    table.append([op, f"{rows}x{cols}", "bwd" if backward else "fwd", name, v["ms"], v["tbps"],
                                  v["of_ceiling"]])
    print_table(f"norms, bf16, TB/s (copy ceiling {ceiling:.2f})",
                ["op", "shape", "dir", "provider", "ms", "TB/s", "of ceiling"], table)
    if not args.no_sweep:
        for op in ("rms", "ln"):
            for cols in SWEEP_WIDTHS:
                rows = SWEEP_ELEMENTS // cols
                res = bench_shape(op, rows, cols, torch.bfloat16, False, ceiling)
                payload["sweep"].append({"op": op, "rows": rows, "cols": cols, "results": res})
        plot(payload["sweep"], ceiling)
    path = save("norms_h200", payload)
    print(f"wrote {path}")
    plot_main(payload["main"], ceiling)


def plot(sweep, ceiling):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("rms", "ln")):
        entries = [e for e in sweep if e["op"] == op]
        names = sorted({n for e in entries for n in e["results"]})
        for name in names:
            xs = [e["cols"] for e in entries if name in e["results"]]
            ys = [e["results"][name]["tbps"] for e in entries if name in e["results"]]
            ax.plot(xs, ys, marker="o", label=name, linewidth=2.5 if name.startswith("flashbridge") else 1.2)
        ax.axhline(ceiling, color="gray", linestyle="--", label=f"copy ceiling {ceiling:.2f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row width (rows x width = 2^27, bf16)")
        ax.set_title({"rms": "RMSNorm forward", "ln": "LayerNorm forward"}[op])
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TB/s (read + write)")
    axes[1].legend(fontsize=8)
    save_figure(fig, "norms_sweep_h200")


MAIN_PROVIDERS = ("flashbridge-torch steady", "flashbridge-jax steady", "torch.compile steady", "liger-kernel steady")


def plot_main(main, ceiling):
    """The main shapes: device-time TB/s (steady mode) of ours and the baselines, forward and backward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 1, figsize=(13, 7), sharey=True)
    for ax, direction in zip(axes, ("fwd", "bwd")):
        entries = [e for e in main if e["direction"] == direction]
        xs = np.arange(len(entries))
        for i, name in enumerate(MAIN_PROVIDERS):
            ys = [e["results"].get(name, {}).get("tbps", np.nan) for e in entries]
            ax.bar(xs + (i - 1.5) * 0.2, ys, 0.2, label=name.replace(" steady", ""))
        ax.axhline(ceiling, color="gray", linestyle="--", label=f"copy ceiling {ceiling:.2f}")
        ax.axhline(3.9 if direction == "fwd" else 2.8, color="red", linestyle=":", label="bar")
        ax.set_xticks(xs, [f"{e['op']} {e['rows']}x{e['cols']}" for e in entries], fontsize=8)
        ax.set_ylabel(f"{direction} TB/s")
    axes[0].legend(fontsize=8, ncol=3)
    fig.suptitle("norms, bf16, H200: device time per call (CUDA graph / in-jit, distinct inputs, no L2 flush)")
    save_figure(fig, "norms_h200")


if __name__ == "__main__":
    main()
