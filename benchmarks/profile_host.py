"""Where the host time of eager calls goes (CUDA): cProfile of back-to-back calls of one op, the top
functions by own time, and whether the runtime's launches took the compiled-kernel fast path.

    python benchmarks/profile_host.py --op rms_norm --calls 300 --top 25
    python benchmarks/profile_host.py --floor     # the floor of a Python eager path, layer by layer

``--floor`` times rms_norm (64x1024 bf16) built up from the bottom: the compiled kernel's launch alone
(outputs preallocated), with its outputs allocated per call, inside a minimal ``torch.autograd.Function``
(inputs requiring grad), then the public op, beside ``F.rms_norm``: what any Python front-end pays at
least, and what flashbridge's layers add on top.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from flashbridge import torch_api as ft
from flashbridge.core_kernels import _loader


def cases():
    dev, dt = "cuda", torch.bfloat16
    x, w = torch.randn(64, 1024, device=dev, dtype=dt), torch.randn(1024, device=dev, dtype=dt)
    q = torch.randn(1, 128, 16, 64, device=dev, dtype=dt)
    qd = torch.randn(1, 1, 32, 128, device=dev, dtype=dt)
    kc = torch.randn(1, 4096, 8, 128, device=dev, dtype=dt)
    lens = torch.full((1,), 4096, device=dev, dtype=torch.int32)
    logits = torch.randn(256, 32000, device=dev, dtype=dt)
    labels = torch.randint(0, 32000, (256,), device=dev)
    return {
        "rms_norm": lambda: ft.rms_norm(x, w),
        "layer_norm": lambda: ft.layer_norm(x, w, w),
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (1024,), w),
        "flash_attention": lambda: ft.flash_attention(q, q, q, causal=True),
        "decode_attention": lambda: ft.decode_attention(qd, kc, kc, cache_seqlens=lens),
        "cross_entropy": lambda: ft.cross_entropy(logits, labels),
    }


def host_us(fn, calls: int = 100, batches: int = 7) -> float:
    """Median host time per call of ``calls`` back-to-back calls (fewer than the launch queue holds)."""
    import statistics

    for _ in range(20):
        fn()
    samples = []
    for _ in range(batches):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def floor_rows() -> list[tuple[str, float]]:
    """rms_norm's eager call built up layer by layer (see the module docstring)."""
    from flashbridge.core_kernels.norms.plan import plan_norm_fwd
    from flashbridge.torch_api._runtime import _program, target_for

    dev, dt = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    x = torch.randn(64, 1024, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(1024, device=dev, dtype=dt, requires_grad=True)
    xd, wd = x.detach(), w.detach()
    plan = plan_norm_fwd(64, 1024, x_dtype="bfloat16", residual_dtype=None, is_rms=True, has_weight=True,
                         has_bias=False, has_post_residual=False, dropout_p=0.0, eps=1e-6, target=target_for(dev))
    program = _program(plan, False)
    (ins, outs, _, _, _, bound), = program.launches
    specs = {spec.name: spec for spec in plan.buffers}
    fixed = {name: torch.empty(specs[name].shape, dtype=torch.float32 if specs[name].dtype == "float32" else dt,
                               device=dev) for name in outs}
    env = {"x": xd, "weight": wd, **fixed}

    def launch_only():
        bound([env[n] for n in ins], [env[n] for n in outs])

    def alloc_launch(xx, ww):
        made = {name: torch.empty(t.shape, dtype=t.dtype, device=dev) for name, t in fixed.items()}
        made.update(x=xx, weight=ww)
        bound([made[n] for n in ins], [made[n] for n in outs])
        return made["y"], made["rstd"]

    class Minimal(torch.autograd.Function):
        @staticmethod
        def forward(ctx, xx, ww):
            y, rstd = alloc_launch(xx, ww)
            ctx.save_for_backward(xx, ww, rstd)
            return y

        @staticmethod
        def backward(ctx, dy):
            raise NotImplementedError

    return [
        ("F.rms_norm, inputs requiring grad", host_us(lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6))),
        ("F.rms_norm, no grad", host_us(lambda: torch.nn.functional.rms_norm(xd, (1024,), wd, 1e-6))),
        ("compiled kernel launch alone", host_us(launch_only)),
        ("+ output allocation", host_us(lambda: alloc_launch(xd, wd))),
        ("+ minimal autograd.Function", host_us(lambda: Minimal.apply(x, w))),
        ("flashbridge rms_norm, no grad", host_us(lambda: ft.rms_norm(xd, wd))),
        ("flashbridge rms_norm, inputs requiring grad", host_us(lambda: ft.rms_norm(x, w))),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="rms_norm,F.rms_norm,decode_attention")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--floor", action="store_true", help="only the layer-by-layer floor of rms_norm")
    args = parser.parse_args()
    if args.floor:
        for name, us in floor_rows():
            print(f"{name:48s} {us:7.1f} us")
        return
    table = cases()
    for op in args.op.split(","):
        fn = table[op]
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            fn()
        plain = (time.perf_counter() - start) / args.calls * 1e6
        torch.cuda.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            fn()
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
        print(f"===== {op}: {plain:.1f} us per call without the profiler; fast_launch={_loader.fast_launch}")
        import gc
        bound = [o for o in gc.get_objects() if isinstance(o, _loader.BoundLaunch)]
        print(f"bound launches {len(bound)}: with a parameter tail {sum(b.tail is not None for b in bound)}, "
              f"with compiled kernels cached {sum(bool(b.kernels) for b in bound)}")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


if __name__ == "__main__":
    main()
