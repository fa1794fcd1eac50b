"""Where the host time of eager calls goes (CUDA): cProfile of back-to-back calls of one op, the top
functions by own time, and whether the runtime's launches took the compiled-kernel fast path.

    python benchmarks/profile_host.py --op rms_norm --calls 300 --top 25
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
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (1024,), w),
        "flash_attention": lambda: ft.flash_attention(q, q, q, causal=True),
        "decode_attention": lambda: ft.decode_attention(qd, kc, kc, cache_seqlens=lens),
        "cross_entropy": lambda: ft.cross_entropy(logits, labels),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="rms_norm,F.rms_norm,decode_attention")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
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
