"""One decode step (ours, torch path) or one bare read of the same bytes inside a CUDA profiler range, for
Nsight Compute::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --csv --page details python3 benchmarks/profile_decode.py --case fp8-s128k > fp8.csv

``scripts/gpu_suite.sh profile-decode`` profiles the bf16 B=1 S=16k step, the bare read of its bytes
(``bench_decode.py``'s read floor, as many programs as our split kernel) and the FP8 B=1 S=128k step, and
writes a side-by-side summary of the longest kernel of each (``benchmarks/ncu_summary.py``).
"""
from __future__ import annotations

import argparse

import torch

from bench_decode import D, HQ, _stream_read_kernel, make_caches

CASES = {  # name: (batch, length, fp8)
    "bf16-s16k": (1, 16384, False),
    "floor-s16k": (1, 16384, False),
    "fp8-s128k": (1, 131072, True),
    "bf16-s128k": (1, 131072, False),
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=sorted(CASES), required=True)
    parser.add_argument("--programs", type=int, default=256,
                        help="read floor: programs (our split kernel: 256 at S=16k, 32 splits x 8 kv heads)")
    args = parser.parse_args()
    b, s, fp8 = CASES[args.case]
    k, v, extra = make_caches(b, s, fp8=fp8, copies=1)[0]
    if args.case.startswith("floor"):
        kernel, elements = _stream_read_kernel(), k.numel()
        out = torch.empty(args.programs, device="cuda", dtype=torch.float32)

        def step():
            kernel[(args.programs,)](k, v, out, elements // args.programs, TILE=4096, num_warps=4)
    else:
        from flashbridge.torch_api.decode import decode_attention

        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((b,), s, dtype=torch.int32, device="cuda")

        def step():
            decode_attention(q, k, v, cache_seqlens=lens, **extra)

    for _ in range(3):  # compile and warm up outside the profiled range
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
