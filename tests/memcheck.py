"""Ragged-size launches for ``compute-sanitizer --tool memcheck`` (run on a GPU machine):

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/memcheck.py norms

Each family runs its kernels forward and backward on sizes that are not multiples of any block.
"""
from __future__ import annotations

import sys

import torch


def norms():
    from flashbridge import torch_api as ft
    for rows, cols in [(1, 1), (3, 17), (130, 1000), (7, 4097), (2, 65536), (257, 333)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
            r = torch.randn(rows, cols, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
            b = torch.randn(cols, device="cuda", dtype=dtype, requires_grad=True)
            y, h = ft.layer_norm(x, w, b, residual=r)
            (y.float().sum() + h.float().sum()).backward()
            ft.rms_norm(x, w).float().sum().backward()
            ft.layer_norm_dropout_residual(x, w, b, r, dropout_p=0.3, seed=5).float().sum().backward()
            ft.rms_norm(x).float().sum().backward()
    torch.cuda.synchronize()
    print("norms: ok")


def decode():
    """Ragged cache lengths (0, 1, odd), paged caches with shuffled page tables (page sizes 16 / 32 / 64),
    contiguous NHD / HND, FP8, Dqk != Dv (576 / 512), every op (decode at several split counts, merge,
    cascade, append), torch and JAX: see tests/test_decode_gpu.py."""
    from test_decode_gpu import _memcheck_case
    _memcheck_case()
    print("decode: ok")


FAMILIES = {"norms": norms, "decode": decode}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(FAMILIES):
        FAMILIES[name]()
