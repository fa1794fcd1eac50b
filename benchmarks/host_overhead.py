"""Where the host time of one norm call goes (CUDA only): the public torch op, the plan runtime, the bare
Triton launch, and liger-kernel for comparison.

``do_bench`` flushes L2 with a ~60 us memset before every call and starts its timer after it; host work
beyond that shows up as idle GPU time in the measurement. This script prints, per layer, the device time
(do_bench median) and the host time per call (wall time of N back-to-back calls issued without waiting;
N is kept below the launch-queue depth).

    python benchmarks/host_overhead.py
"""
from __future__ import annotations

import time

from _common import print_table, time_torch

import torch

from flashbridge import torch_api as ft
from flashbridge.core_kernels import get_kernel
from flashbridge.core_kernels.norms.plan import plan_norm_bwd, plan_norm_fwd
from flashbridge.torch_api._runtime import execute, target_for

CALLS = 200


def host_us(fn) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def main():
    rows_out = []
    for rows, cols in ((65536, 2048), (16384, 8192)):
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        plan = plan_norm_fwd(rows, cols, x_dtype="bfloat16", residual_dtype=None, is_rms=True, has_weight=True,
                             has_bias=False, has_post_residual=False, dropout_p=0.0, eps=1e-6,
                             target=target_for(x.device))
        launch = plan.launches[0]
        kernel = get_kernel(launch.kernel, False)
        named = {"x": x, "weight": w}
        named.update({s.name: torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="cuda") for s in plan.buffers})
        args = [*(named[n] for n in launch.inputs), *launch.scalar_values(), *(named[n] for n in launch.outputs)]
        consts = launch.constexpr_dict()

        def bare():
            kernel[launch.grid](*args, **consts, num_warps=launch.num_warps, num_stages=launch.num_stages,
                                enable_fp_fusion=True)

        layers = {
            "bare Triton launch": bare,
            "plan runtime (execute)": lambda: execute(plan, {"x": x, "weight": w}),
            "public op, no grad": lambda: ft.rms_norm(x, w),
        }
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        layers["public op, inputs need grad"] = lambda: ft.rms_norm(xg, wg)
        try:
            from liger_kernel.transformers.rms_norm import LigerRMSNorm
            mod = LigerRMSNorm(cols, eps=1e-6).to(device="cuda", dtype=torch.bfloat16)
            layers["liger-kernel module"] = lambda: mod(x)
        except Exception as exc:  # not installed: the row is simply missing
            print(f"liger-kernel unavailable: {exc}")
        # backward: the plan runtime alone, then autograd through the public op (what bench_norms times)
        bplan = plan_norm_bwd(rows, cols, dx_dtype="bfloat16", weight_dtype="bfloat16", bias_dtype=None,
                              is_rms=True, has_dh=False, dropout_p=0.0, target=target_for(x.device))
        dy = torch.randn_like(x)
        rstd = torch.rand(rows, device="cuda") + 0.5
        layers["bwd: plan runtime (execute)"] = lambda: execute(bplan, {"dy": dy, "h": x, "weight": w, "rstd": rstd})
        y = ft.rms_norm(xg, wg)
        layers["bwd: autograd.grad through the op"] = lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True)
        b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
        layers["LayerNorm public op, no grad"] = lambda: ft.layer_norm(x, w, b)
        bg = b.detach().requires_grad_()
        y_ln = ft.layer_norm(xg, wg, bg)
        layers["bwd: LayerNorm autograd.grad"] = lambda: torch.autograd.grad(y_ln, (xg, wg, bg), dy, retain_graph=True)
        for name, fn in layers.items():
            with torch.no_grad() if "grad" not in name else torch.enable_grad():
                device_ms = time_torch(fn)
                tensors = 3 if name.startswith("bwd") else 2
                rows_out.append([f"{rows}x{cols}", name, device_ms, host_us(fn),
                                 tensors * x.numel() * 2 / (device_ms * 1e-3) / 1e12])
    print_table("RMSNorm forward: device time (do_bench) and host time per call",
                ["shape", "layer", "do_bench ms", "host us/call", "TB/s"], rows_out)
    profile_host()
    profile_training_step()


def profile_host(rows=16384, cols=8192, calls=300):
    """cProfile of the public LayerNorm and RMSNorm calls (no grad): where the host time goes, by function."""
    import cProfile
    import pstats

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(cols, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("layer_norm", lambda: ft.layer_norm(x, w, b)), ("rms_norm", lambda: ft.rms_norm(x, w))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"cProfile: {calls} calls of {name} {rows}x{cols} bf16 (no grad)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def profile_training_step(rows=16384, cols=8192, steps=10):
    """torch.profiler over forward + backward of the public op: which kernels and host calls a training
    step costs (the backward's host time above is the question this answers)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        torch.autograd.grad(ft.rms_norm(x, w), (x, w), dy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    print(f"RMSNorm {rows}x{cols} bf16 forward + backward, {steps} steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))


if __name__ == "__main__":
    main()
