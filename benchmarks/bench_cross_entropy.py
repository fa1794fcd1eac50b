"""Benchmark of the cross-entropy family on a GPU (bf16), ours and the baselines in the same run.

1. ``linear_cross_entropy`` forward+backward at N=8192, H=4096, V=128256 (gradients for hidden and weight):
   time (median) and peak extra memory (everything allocated beyond the inputs, the returned gradients
   included) for flashbridge torch, flashbridge JAX (time of the jitted value_and_grad; memory from XLA's
   compiled memory analysis: temporaries + outputs), eager ``F.cross_entropy(h @ W.T)`` and liger-kernel's
   ``LigerFusedLinearCrossEntropyLoss`` when it is importable.
2. The logits-level ``cross_entropy`` at N=8192, V=128256: forward (logits read once) and forward+backward
   (read twice, gradient written once) in TB/s against the device-to-device copy ceiling measured in the
   same run; eager ``F.cross_entropy`` alongside.

3. Options against the plain op at the same shapes (:func:`bench_options`): class weights (with and
   without label smoothing), ``return_accuracy`` + ``return_predicted``, all together; logits-level device
   time (CUDA graph, forward and forward+backward) and the linear op's, torch and JAX. Class weights must
   stay within 5% of the unweighted op (the bar is printed).

Usage: ``PYTHONPATH=src python benchmarks/bench_cross_entropy.py [--quick] [--jax-sweep]``; writes
``results/cross_entropy.json`` and ``results/cross_entropy.png`` (or under $OUT). ``--jax-only --jax-hlo DIR``:
the torch default and the JAX rows only (``cross_entropy_jax.json``), with XLA's optimized HLO of each JAX row.
``--options``: part 3 alone (``cross_entropy_options.json``).
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import sys

import _common  # noqa: F401  (puts src/ on sys.path)
from _common import (kernel_trace, measure_copy_ceiling, print_table, save, save_figure, time_jax, time_torch,
                     time_torch_steady)

N, H, V = 8192, 4096, 128256
CHUNK_SWEEP = (256, 512, 1024)


def _peak_extra_torch(fn) -> float:
    """Peak bytes allocated by ``fn()`` beyond what was allocated before it (its outputs included)."""
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return float(peak)


# --jax-sweep: pass 1's tokens per chunk x pass 2's vocabulary columns per slice for the JAX path. Chunk None
# is the default (chunks of H tokens whose logits our kernel writes into dW's storage, as torch does); a
# number takes chunks with logits of their own (XLA's matmul), which count on top of the gradients
JAX_SWEEP = ((None, 2048), (256, 2048), (512, 2048))


def jax_linear_row(name: str, hj, wj, yj, chunk=None, slice_cols=None, hlo_dir=None) -> dict:
    """Time (jitted value_and_grad) and XLA's compiled memory (temporaries + outputs) of the JAX linear CE;
    ``slice_cols`` replaces the GPU default of pass 2's slice width for this row. With ``hlo_dir`` the
    optimized HLO (after XLA's copy insertion: every ``copy`` of a dW-sized array shows) is written there."""
    import importlib

    import jax

    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.cross_entropy.plan import CEConfig

    jce = importlib.import_module("flashbridge.jax_api.cross_entropy")
    try:
        with configure(CEConfig(slice_cols=slice_cols)):  # read while tracing
            fn = jax.value_and_grad(lambda a, b, c: jce.linear_cross_entropy(a, b, c, chunk_size=chunk),
                                    argnums=(0, 1))
            compiled = jax.jit(fn).lower(hj, wj, yj).compile()
            ma = compiled.memory_analysis()
            if hlo_dir:
                os.makedirs(hlo_dir, exist_ok=True)
                with open(os.path.join(hlo_dir, re.sub(r"[^\w=.-]+", "_", name) + ".hlo.txt"), "w") as f:
                    f.write(compiled.as_text())
            ms = time_jax(fn, hj, wj, yj)
    except Exception as exc:
        return {"impl": name, "error": f"{type(exc).__name__}: {exc}"}
    if ma is None:
        return {"impl": name, "time_ms": ms, "peak_extra_gb": float("nan")}
    return {"impl": name, "time_ms": ms, "peak_extra_gb": (ma.temp_size_in_bytes + ma.output_size_in_bytes) / 1e9,
            "temp_gb": ma.temp_size_in_bytes / 1e9}


def bench_linear(quick: bool, jax_sweep: bool = False, jax_only: bool = False, hlo_dir=None) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from flashbridge.torch_api.cross_entropy import linear_cross_entropy

    n = N // 4 if quick else N
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    w = (torch.randn(V, H, generator=g, device="cuda") * H**-0.5 * 2).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (n,), generator=g, device="cuda")
    rows = []

    def add(name, fn):
        try:
            fn()  # warm up / compile
            mem = _peak_extra_torch(fn)
            ms = time_torch(fn)
            rows.append({"impl": name, "time_ms": ms, "peak_extra_gb": mem / 1e9})
        except Exception as exc:  # a missing or broken baseline is recorded, the others still run
            rows.append({"impl": name, "error": f"{type(exc).__name__}: {exc}"})
        print(rows[-1], flush=True)

    add("flashbridge torch", lambda: torch.autograd.grad(linear_cross_entropy(h, w, y), (h, w)))
    # the chunk trade-off: fewer tokens per chunk hold less logits memory but add a dW read-modify-write
    # (and a bf16 rounding of dW) per chunk
    for chunk in () if jax_only else CHUNK_SWEEP:
        add(f"flashbridge torch chunk={chunk}", lambda: torch.autograd.grad(
            linear_cross_entropy(h, w, y, chunk_size=chunk), (h, w)))
    if not jax_only:
        add("eager F.cross_entropy(h @ W.T)", lambda: torch.autograd.grad(
            F.cross_entropy(h @ w.T, y), (h, w)))
        try:
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
            liger = LigerFusedLinearCrossEntropyLoss()
            add("liger-kernel fused linear CE", lambda: torch.autograd.grad(liger(w, h, y), (h, w)))
        except ImportError as exc:
            rows.append({"impl": "liger-kernel fused linear CE", "error": f"not importable: {exc}"})

    try:
        import jax
        import jax.numpy as jnp

        dev = jax.devices("gpu")[0]
        hj = jax.device_put(jnp.asarray(h.detach().float().cpu().numpy(), jnp.bfloat16), dev)
        wj = jax.device_put(jnp.asarray(w.detach().float().cpu().numpy(), jnp.bfloat16), dev)
        yj = jax.device_put(jnp.asarray(y.cpu().numpy()), dev)
    except Exception as exc:
        rows.append({"impl": "flashbridge jax", "error": f"{type(exc).__name__}: {exc}"})
    else:
        rows.append(jax_linear_row("flashbridge jax", hj, wj, yj, hlo_dir=hlo_dir))
        for chunk, slice_cols in JAX_SWEEP if jax_sweep else ():
            rows.append(jax_linear_row(f"flashbridge jax chunk={chunk or 'H (in dW)'} slice={slice_cols}", hj, wj,
                                       yj, chunk=chunk, slice_cols=slice_cols, hlo_dir=hlo_dir))
            print(rows[-1], flush=True)
    print(rows[-1], flush=True)
    for r in rows:
        r["shape"] = f"{n}x{H}x{V} bf16"
        if "time_ms" in r:
            r["tflops"] = 6.0 * n * H * V / (r["time_ms"] * 1e-3) / 1e12
    return rows


def bench_logits(quick: bool, ceiling: float) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from flashbridge.torch_api.cross_entropy import cross_entropy

    n = N // 4 if quick else N
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(n, V, generator=g, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, V, (n,), generator=g, device="cuda")
    nbytes = n * V * 2
    rows = []
    for name, fwd in (("flashbridge torch", lambda: cross_entropy(x, y)),
                      ("eager F.cross_entropy", lambda: F.cross_entropy(x, y))):
        with torch.no_grad():
            ms_f = time_torch(fwd)
        ms_fb = time_torch(lambda: torch.autograd.grad(fwd(), x))
        rows.append({"impl": name, "fwd_ms": ms_f, "fwd_tbs": nbytes / (ms_f * 1e-3) / 1e12,
                     "fwd_bwd_ms": ms_fb, "fwd_bwd_tbs": 3 * nbytes / (ms_fb * 1e-3) / 1e12})
    # device time of the op without the eager label check (its host sync would also forbid graph capture):
    # 4 distinct logits sets back to back in a CUDA graph (time_torch_steady), as the other benchmarks
    sets = [(x,)] + [((torch.randn(n, V, generator=g, device="cuda") * 3).to(torch.bfloat16).requires_grad_(),)
                     for _ in range(3)]
    for name, fn in (("flashbridge torch, validate_labels=False, steady",
                      lambda a: cross_entropy(a, y, validate_labels=False)),
                     ("eager F.cross_entropy, steady", lambda a: F.cross_entropy(a, y))):
        try:
            with torch.no_grad():
                ms_f = time_torch_steady(fn, sets)
            ms_fb = time_torch_steady(lambda a: torch.autograd.grad(fn(a), a), sets)
            rows.append({"impl": name, "fwd_ms": ms_f, "fwd_tbs": nbytes / (ms_f * 1e-3) / 1e12,
                         "fwd_bwd_ms": ms_fb, "fwd_bwd_tbs": 3 * nbytes / (ms_fb * 1e-3) / 1e12})
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {exc}")
    del sets
    # kernel by kernel: the forward kernel's own device time against the call's (what the call adds around it)
    try:
        xd = x.detach()
        rows[0]["trace_forward"] = kernel_trace(
            lambda: (cross_entropy(xd, y, validate_labels=False), torch.cuda.synchronize()),
            label="cross_entropy forward, validate_labels=False")
        rows[0]["trace_forward_backward"] = kernel_trace(
            lambda: (torch.autograd.grad(cross_entropy(x, y, validate_labels=False), x), torch.cuda.synchronize()),
            label="cross_entropy forward + backward, validate_labels=False")
    except Exception as exc:
        print(f"trace: {type(exc).__name__}: {exc}")
    for r in rows:
        r["fwd_of_ceiling"] = r["fwd_tbs"] / ceiling
        r["fwd_bwd_of_ceiling"] = r["fwd_bwd_tbs"] / ceiling
        r["shape"] = f"{n}x{V} bf16"
        print(r, flush=True)
    return rows


WEIGHTED_BAR = 1.05  # class weights: at most 5% slower than the unweighted op


def bench_options(quick: bool) -> dict:
    """Class weights and the per-token extras against the plain op (see the module docstring). Logits-level
    rows are device times (two logits sets replayed from one CUDA graph, ``validate_labels=False``); the
    linear rows are eager forward+backward calls (do_bench), as part 1; JAX rows are jitted."""
    import torch

    from flashbridge.torch_api.cross_entropy import cross_entropy, linear_cross_entropy

    n = N // 4 if quick else N
    g = torch.Generator(device="cuda").manual_seed(5)
    sets = [((torch.randn(n, V, generator=g, device="cuda") * 3).to(torch.bfloat16).requires_grad_(),)
            for _ in range(2)]
    y = torch.randint(0, V, (n,), generator=g, device="cuda")
    y[::10] = -100
    w = torch.rand(V, generator=g, device="cuda") + 0.5
    variants = [  # name, options, the variant it is compared with (None: itself the reference)
        ("plain", {}, None),
        ("weight", dict(weight=w), "plain"),
        ("label_smoothing=0.1", dict(label_smoothing=0.1), None),
        ("weight, label_smoothing=0.1", dict(weight=w, label_smoothing=0.1), "label_smoothing=0.1"),
        ("return_accuracy + return_predicted", dict(return_accuracy=True, return_predicted=True), "plain"),
        ("weight, smoothing, z-loss, accuracy, predicted", dict(weight=w, label_smoothing=0.1, z_loss=1e-4,
                                                               return_accuracy=True, return_predicted=True),
         "label_smoothing=0.1"),
    ]

    def loss_of(out):
        return out if isinstance(out, torch.Tensor) else out.loss

    rows, by_name = [], {}
    for name, opts, base in variants:
        fn = lambda a, opts=opts: cross_entropy(a, y, validate_labels=False, **opts)  # noqa: E731
        entry = {"impl": f"flashbridge torch, {name}", "variant": name, "base": base}
        try:
            with torch.no_grad():
                entry["fwd_ms"] = time_torch_steady(fn, sets)
            entry["fwd_bwd_ms"] = time_torch_steady(lambda a, fn=fn: torch.autograd.grad(loss_of(fn(a)), a), sets)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(entry)
        by_name[name] = entry
        print(entry, flush=True)
    for entry in rows:
        base = by_name.get(entry["base"]) if entry["base"] else None
        if base and "fwd_ms" in entry and "fwd_ms" in base:
            entry["fwd_ratio"] = entry["fwd_ms"] / base["fwd_ms"]
            entry["fwd_bwd_ratio"] = entry["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    try:
        import torch.nn.functional as F
        fn = lambda a: F.cross_entropy(a, y, weight=w.to(a.dtype))  # noqa: E731
        with torch.no_grad():
            ms_f = time_torch_steady(fn, sets)
        rows.append({"impl": "eager F.cross_entropy(weight=)", "variant": "eager weight", "base": None,
                     "fwd_ms": ms_f, "fwd_bwd_ms": time_torch_steady(lambda a: torch.autograd.grad(fn(a), a), sets)})
    except Exception as exc:
        rows.append({"impl": "eager F.cross_entropy(weight=)", "error": f"{type(exc).__name__}: {exc}"})
    del sets

    # the linear op at part 1's shape: plain against class weights, torch then JAX
    h = torch.randn(n, H, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    wl = (torch.randn(V, H, generator=g, device="cuda") * H**-0.5 * 2).to(torch.bfloat16).requires_grad_()
    linear = []
    for name, opts in (("plain", {}), ("class_weight", dict(class_weight=w)),
                       ("class_weight, label_smoothing=0.1", dict(class_weight=w, label_smoothing=0.1))):
        try:
            ms = time_torch(lambda opts=opts: torch.autograd.grad(
                linear_cross_entropy(h, wl, y, validate_labels=False, **opts), (h, wl)))
            linear.append({"impl": f"flashbridge torch linear, {name}", "time_ms": ms})
        except Exception as exc:
            linear.append({"impl": f"flashbridge torch linear, {name}", "error": f"{type(exc).__name__}: {exc}"})
        print(linear[-1], flush=True)
    try:
        import importlib

        import jax
        import jax.numpy as jnp

        jce = importlib.import_module("flashbridge.jax_api.cross_entropy")
        dev = jax.devices("gpu")[0]
        to_jax = lambda t: jax.device_put(jnp.asarray(t.detach().float().cpu().numpy()).astype(  # noqa: E731
            jnp.bfloat16 if t.dtype == torch.bfloat16 else jnp.float32), dev)
        hj, wj, cwj = to_jax(h), to_jax(wl), to_jax(w)
        yj = jax.device_put(jnp.asarray(y.cpu().numpy()), dev)
        for name, opts in (("plain", {}), ("class_weight", dict(class_weight=cwj))):
            fn = jax.value_and_grad(lambda a, b, opts=opts: jce.linear_cross_entropy(a, b, yj, **opts), argnums=(0, 1))
            linear.append({"impl": f"flashbridge jax linear, {name}", "time_ms": time_jax(fn, hj, wj)})
            print(linear[-1], flush=True)
        xj = jax.device_put((jax.random.normal(jax.random.key(5), (n, V)) * 3).astype(jnp.bfloat16), dev)
        for name, opts in (("plain", {}), ("weight", dict(weight=cwj))):
            fn = jax.value_and_grad(lambda a, opts=opts: jce.cross_entropy(a, yj, **opts))
            rows.append({"impl": f"flashbridge jax, {name}", "variant": f"jax {name}", "base": None,
                         "fwd_bwd_ms": time_jax(fn, xj)})
            print(rows[-1], flush=True)
    except Exception as exc:
        linear.append({"impl": "flashbridge jax", "error": f"{type(exc).__name__}: {exc}"})
    plain = {r["impl"].rsplit(", ", 1)[0]: r.get("time_ms") for r in linear if r["impl"].endswith(", plain")}
    for r in linear:
        base = plain.get(r["impl"].split(", ", 1)[0])
        if "time_ms" in r and base and not r["impl"].endswith(", plain"):
            r["ratio"] = r["time_ms"] / base
    jax_rows = {r["variant"]: r for r in rows if r.get("variant", "").startswith("jax")}
    if "fwd_bwd_ms" in jax_rows.get("jax weight", {}) and "fwd_bwd_ms" in jax_rows.get("jax plain", {}):
        jax_rows["jax weight"]["fwd_bwd_ratio"] = jax_rows["jax weight"]["fwd_bwd_ms"] / jax_rows["jax plain"]["fwd_bwd_ms"]

    def ratio(r, key):
        return f"{r[key]:.3f}" if key in r else "-"

    print_table(f"cross_entropy options, {n}x{V} bf16 (device time; ratio to the variant named)",
                ["impl", "fwd ms", "fwd+bwd ms", "compared with", "fwd ratio", "fwd+bwd ratio"],
                [[r["impl"], r.get("fwd_ms", r.get("error", "-")), r.get("fwd_bwd_ms", "-"), r.get("base") or "-",
                  ratio(r, "fwd_ratio"), ratio(r, "fwd_bwd_ratio")] for r in rows])
    print_table(f"linear_cross_entropy options, {n}x{H}x{V} bf16 (forward+backward)",
                ["impl", "time (ms)", "ratio to plain"],
                [[r["impl"], r.get("time_ms", r.get("error", "-")), ratio(r, "ratio")] for r in linear])
    weighted = ([(r["impl"], r[k]) for r in rows if "weight" in r.get("variant", "") and "accuracy" not in r["variant"]
                 for k in ("fwd_ratio", "fwd_bwd_ratio") if k in r]
                + [(r["impl"], r["ratio"]) for r in linear if "class_weight" in r["impl"] and "ratio" in r])
    worst = max(weighted, key=lambda t: t[1], default=(None, float("nan")))
    ok = bool(weighted) and worst[1] <= WEIGHTED_BAR
    print(f"class weights within {WEIGHTED_BAR - 1:.0%} of the unweighted op: {'PASS' if ok else 'FAIL'} "
          f"(worst: {worst[0]} at {worst[1]:.3f}x)")
    return {"logits": rows, "linear": linear, "weighted_bar": WEIGHTED_BAR, "weighted_worst_ratio": worst[1],
            "weighted_within_bar": ok, "shape": f"{n}x{V} bf16, linear {n}x{H}x{V}"}


def tune(ceiling: float) -> list[dict]:
    """The logits-level kernels (forward; gradient) over tile width, warps and pipelining depth."""
    import torch

    from flashbridge.core_kernels.cross_entropy.plan import CEConfig, plan_ce_fwd, plan_ce_grad
    from flashbridge.torch_api._runtime import execute, target_for

    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(N, V, generator=g, device="cuda") * 3).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), generator=g, device="cuda")
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, target=target_for(x.device))
    lse = torch.logsumexp(x.float(), -1)
    rows = []
    for block_v in (2048, 4096, 8192):
        for warps in (4, 8, 16):
            for stages in (1, 2, 3):
                cfg = CEConfig(block_v=block_v, num_warps=warps, num_stages=stages)
                fwd = plan_ce_fwd(N, V, config=cfg, **opts)
                grad = plan_ce_grad(N, V, grad_dtype="bfloat16", per_row_weight=False, config=cfg, **opts)
                entry = {"block_v": block_v, "num_warps": warps, "num_stages": stages}
                try:
                    entry["fwd_ms"] = time_torch(lambda: execute(fwd, {"logits": x, "labels": y}))
                    entry["grad_ms"] = time_torch(lambda: execute(grad, {"logits": x, "labels": y, "lse": lse,
                                                                         "lse_lo": torch.zeros_like(lse),
                                                                         "weight": torch.ones(1, device="cuda")}))
                    entry["fwd_of_ceiling"] = N * V * 2 / (entry["fwd_ms"] * 1e-3) / 1e12 / ceiling
                    entry["grad_of_ceiling"] = 2 * N * V * 2 / (entry["grad_ms"] * 1e-3) / 1e12 / ceiling
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
                rows.append(entry)
    print_table("cross_entropy kernels by tile (N=8192, V=128256, bf16)",
                ["block_v", "warps", "stages", "fwd ms", "fwd / ceiling", "grad ms", "grad / ceiling"],
                [[r["block_v"], r["num_warps"], r["num_stages"], r.get("fwd_ms", r.get("error", "-")),
                  r.get("fwd_of_ceiling", "-"), r.get("grad_ms", "-"), r.get("grad_of_ceiling", "-")] for r in rows])
    return rows


def plot(linear: list[dict]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in linear if "time_ms" in r]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["impl"] for r in ok]
    axes[0].barh(names, [r["time_ms"] for r in ok])
    axes[0].set_xlabel("forward+backward (ms)")
    axes[1].barh(names, [r["peak_extra_gb"] for r in ok])
    axes[1].set_xlabel("peak extra memory (GB)")
    fig.suptitle(f"linear cross-entropy, {ok[0]['shape'] if ok else ''}, H200")
    save_figure(fig, "cross_entropy")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the tokens")
    parser.add_argument("--tune", action="store_true", help="only time the logits-level kernels' tile options")
    parser.add_argument("--jax-sweep", action="store_true",
                        help="also the JAX linear CE at the chunk x slice settings of JAX_SWEEP")
    parser.add_argument("--jax-only", action="store_true",
                        help="of the linear CE only the default torch row (the reference) and the JAX rows; no "
                             "logits-level rows")
    parser.add_argument("--jax-hlo", metavar="DIR",
                        help="write each JAX row's optimized HLO (XLA's copies, buffer sizes) into DIR")
    parser.add_argument("--options", action="store_true",
                        help="only the class weights / accuracy / predicted rows against the plain op")
    args = parser.parse_args(argv)
    ceiling = measure_copy_ceiling()
    if args.tune:
        save("cross_entropy_tune", {"copy_ceiling_tbs": ceiling, "tune": tune(ceiling)})
        return 0
    if args.options:
        path = save("cross_entropy_options", {"options": bench_options(args.quick), "quick": args.quick})
        print(f"wrote {path}")
        return 0
    linear = bench_linear(args.quick, args.jax_sweep, args.jax_only, args.jax_hlo)
    logits = [] if args.jax_only else bench_logits(args.quick, ceiling)
    options = None if args.jax_only else bench_options(args.quick)
    print_table("linear cross-entropy forward+backward", ["impl", "time (ms)", "peak extra (GB)", "TFLOP/s"],
                [[r["impl"], r.get("time_ms", r.get("error", "-")), r.get("peak_extra_gb", "-"),
                  r.get("tflops", "-")] for r in linear])
    print_table(f"cross_entropy on logits (copy ceiling {ceiling:.2f} TB/s)",
                ["impl", "fwd ms", "fwd TB/s", "fwd / ceiling", "fwd+bwd ms", "fwd+bwd TB/s", "fwd+bwd / ceiling"],
                [[r["impl"], r["fwd_ms"], r["fwd_tbs"], r["fwd_of_ceiling"], r["fwd_bwd_ms"], r["fwd_bwd_tbs"],
                  r["fwd_bwd_of_ceiling"]] for r in logits])
    # a --jax-only run does not replace the full run's results
    path = save("cross_entropy_jax" if args.jax_only else "cross_entropy",
                {"copy_ceiling_tbs": ceiling, "linear": linear, "logits": logits, "options": options,
                 "quick": args.quick})
    if not args.jax_only:
        plot(linear)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
