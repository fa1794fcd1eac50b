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


def cross_entropy(device: str = "cuda"):
    """The logits-level op on rows / vocabularies that are not multiples of any tile (with ignored rows),
    and the linear op in both frameworks with more tokens than the hidden size (whole pass-1 chunks of H
    tokens, and the rest) and vocabularies that are not multiples of the slice width."""
    import jax
    import jax.numpy as jnp

    from flashbridge import jax_api as fj
    from flashbridge import torch_api as ft

    g = torch.Generator(device=device).manual_seed(0)
    for n, v in [(1, 1000), (7, 32003), (130, 4097)]:
        x = torch.randn(n, v, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, v, (n,), device=device, generator=g)
        y[0] = -100
        ft.cross_entropy(x, y, label_smoothing=0.1, z_loss=1e-4).backward()
    for n, h, v, bias in [(70, 32, 1000, True), (130, 64, 4097, False)]:
        hh = torch.randn(n, h, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        w = (torch.randn(v, h, device=device, generator=g) * h**-0.5).to(torch.bfloat16).requires_grad_()
        b = torch.randn(v, device=device, generator=g).to(torch.bfloat16).requires_grad_() if bias else None
        y = torch.randint(0, v, (n,), device=device, generator=g)
        ft.linear_cross_entropy(hh, w, y, bias=b, z_loss=1e-4).backward()
        arrays = [jnp.asarray(t.detach().float().cpu().numpy()).astype(jnp.bfloat16) for t in (hh, w)]
        jb = None if b is None else jnp.asarray(b.detach().float().cpu().numpy()).astype(jnp.bfloat16)
        jy = jnp.asarray(y.cpu().numpy())
        grads = jax.grad(lambda a, c: fj.linear_cross_entropy(a, c, jy, bias=jb, z_loss=1e-4), argnums=(0, 1))(
            *arrays)
        jax.block_until_ready(grads)
    if device == "cuda":
        torch.cuda.synchronize()
    print("cross_entropy: ok")


def rotary():
    """Odd token / head counts, partial and odd rotary dims, both pair layouts, strided q / k of a qkv
    projection in place, packed sequences (one empty), and index values outside the table or the token
    range, which the kernel clamps (GPU tensors are not checked on the host)."""
    from flashbridge import torch_api as ft
    from flashbridge.reference.rotary import cos_sin_table

    for (b, s, hq, hk, d, rd) in [(1, 1, 1, 1, 2, 2), (3, 17, 5, 3, 20, 12), (2, 130, 32, 8, 128, 128),
                                  (1, 33, 7, 1, 96, 32)]:
        for dtype in (torch.bfloat16, torch.float32):
            cos, sin = (torch.tensor(t, dtype=torch.float32, device="cuda") for t in cos_sin_table(b * s, rd))
            for interleaved in (False, True):
                qkv = torch.randn(b, s, 3, max(hq, hk), d, device="cuda", dtype=dtype)
                q, k = qkv[:, :, 0, :hq], qkv[:, :, 1, :hk]
                ft.rotary_embedding_qk(q, k, cos, sin, interleaved=interleaved, inplace=True)
                x = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, requires_grad=True)
                ft.rotary_embedding(x, cos, sin, interleaved=interleaved).float().sum().backward()
                bad = torch.tensor([-5, b * s + 100] * s, device="cuda")[:s].expand(b, s)
                ft.rotary_embedding(x.detach(), cos, sin, position_ids=bad)
                packed = torch.randn(b * s, hq, d, device="cuda", dtype=dtype)
                for cu in ([0, b * s // 2, b * s // 2, b * s], [0, b * s + 7, 3, 2]):  # the second one is bad
                    cu = torch.tensor(cu, device="cuda", dtype=torch.int32)
                    ft.rotary_embedding(packed, cos, sin, cu_seqlens=cu, interleaved=interleaved)
    torch.cuda.synchronize()
    print("rotary: ok")


def swiglu():
    """Rows / widths that are not multiples of any tile, split (with strided chunk views) and fused."""
    from flashbridge import torch_api as ft

    for rows, cols in [(1, 1), (3, 17), (130, 1000), (7, 4097), (5, 14336)]:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(rows, 2 * cols, device="cuda", dtype=dtype, requires_grad=True)
            g, u = x.chunk(2, dim=-1)
            (ft.swiglu(x).float().sum() + ft.swiglu(g, u).float().sum()).backward()
    torch.cuda.synchronize()
    print("swiglu: ok")


FAMILIES = {"norms": norms, "decode": decode, "cross_entropy": cross_entropy, "rotary": rotary, "swiglu": swiglu}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(FAMILIES):
        FAMILIES[name]()
