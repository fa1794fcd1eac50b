"""One attention backward (ours or FlexAttention's) inside a CUDA profiler range, for Nsight Compute.

Run under ncu so that only the backward's kernels are profiled (compilation and warm-up stay outside the
range)::

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \\
        --csv --page details python3 benchmarks/profile_attention_bwd.py --which ours > ours.csv

``scripts/gpu_suite.sh profile-attention`` runs both at D=128, S=4096 and writes the CSVs beside a
side-by-side summary (``benchmarks/ncu_summary.py``).
"""
from __future__ import annotations

import argparse

import torch

from flashbridge.torch_api.attention import flash_attention


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--which", choices=("ours", "flex"), required=True)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--s", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384, help="batch * sequence length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    b, s, h, d = args.tokens // args.s, args.s, args.heads, args.d
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.which == "ours":
        q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        out = flash_attention(q, k, v, causal=args.causal)
    else:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        mask = (create_block_mask(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device="cuda")
                if args.causal else None)
        out = torch.compile(flex_attention, dynamic=False)(q, k, v, block_mask=mask)
    dout = torch.randn(out.shape, generator=g, device="cuda", dtype=out.dtype)
    for _ in range(2):  # compile and warm up outside the profiled range
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
