"""Checks of MLA (absorbed multi-head latent attention) for ``python -m flashbridge check``.

Rows: ``mla_attention`` forward and backward (dq, dkv), causal, and ``mla_decode`` over a paged latent cache
with ragged lengths. Every query head attends to one latent head whose first Dv dims are the values (on a
GPU DeepSeek's 576 = 512 + 64). TFLOP/s = 2 * B * H * Sq * Sk * (Dqk + Dv) (halved when causal), backward
2.5x; decode reports TB/s of the latent rows read. The error is max|out - ref| over the bound of the
attention checks (twice the error of plain attention emulated in the dtype + a floor), the worst over the
output and every gradient.
"""
from __future__ import annotations

import numpy as np

from ..reference import mla as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework
from .attention import _naive

# (B, Sq, Sk, H, Dqk, Dv): small on the CPU interpreter; on a GPU large enough to time
PREFILL = {"cpu": (1, 40, 40, 4, 48, 32), "cuda": (1, 1024, 1024, 16, 576, 512)}
# (B, Sq, H, Dqk, Dv, page size, lengths)
DECODE = {"cpu": (3, 1, 4, 48, 32, 16, (1, 37, 64)), "cuda": (8, 1, 128, 576, 512, 64, (4096, 1, 3000, 8192) * 2)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def checks(framework: str, device: str) -> list[Check]:
    rows = [Check(op=f"mla_attention causal {'bwd' if backward else 'fwd'}", framework=framework,
                  run=_make_prefill(framework, device, backward)) for backward in (False, True)]
    return rows + [Check(op="mla_decode paged", framework=framework, run=_make_decode(framework, device))]


def _naive_mla(q, kv, dout, dtype, head_dim_v, causal):
    """Plain attention emulated in ``dtype`` with the latent as one K / V head: (out, [dq, dkv])."""
    out, (dq, dk, dv) = _naive(q, kv[:, :, None], kv[:, :, None, :head_dim_v], dout, dtype, causal=causal)
    dkv = dk[:, :, 0].copy()
    dkv[..., :head_dim_v] = rounded(dkv[..., :head_dim_v] + dv[:, :, 0], dtype)
    return out, [dq, dkv]


def _make_prefill(framework, device, backward):
    def run() -> Measurement:
        b, sq, sk, h, dqk, dv = PREFILL[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(41)
        q, dout = (rounded(rng.standard_normal((b, sq, h, d)), dtype) for d in (dqk, dv))
        kv = rounded(rng.standard_normal((b, sk, dqk)), dtype)
        ref_out, _ = R.mla_attention(q, kv, head_dim_v=dv, causal=True)
        ref_grads = R.mla_attention_bwd(dout, q, kv, head_dim_v=dv, causal=True)
        naive_out, naive_grads = _naive_mla(q, kv, dout, dtype, dv, causal=True)
        time_ms = None
        if framework == "torch":
            import torch
            from ..torch_api import mla_attention
            tq, tkv = (to_framework("torch", x, dtype, device, requires_grad=True) for x in (q, kv))
            tdout = to_framework("torch", dout, dtype, device)
            y = mla_attention(tq, tkv, head_dim_v=dv, causal=True)
            grads = torch.autograd.grad(y, (tq, tkv), tdout, retain_graph=True)
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    time_ms = time_torch(lambda: torch.autograd.grad(y, (tq, tkv), tdout, retain_graph=True))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(lambda: mla_attention(tq, tkv, head_dim_v=dv, causal=True))
        else:
            import jax
            from ..jax_api import mla_attention
            jq, jkv, jdout = (to_framework("jax", x, dtype, device) for x in (q, kv, dout))
            fwd = lambda q, kv: mla_attention(q, kv, head_dim_v=dv, causal=True)  # noqa: E731
            y, vjp_fn = jax.vjp(fwd, jq, jkv)
            apply_vjp = lambda f, ct: f(ct)  # noqa: E731 -- the backward alone, residuals saved
            grads = jax.jit(apply_vjp)(vjp_fn, jdout)
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(apply_vjp, vjp_fn, jdout) if backward else time_jax(jax.jit(fwd), jq, jkv)
        if backward:
            err = max(error_vs_reference(g, r, n) for g, r, n in zip(grads, ref_grads, naive_grads))
        else:
            err = error_vs_reference(y, ref_out, naive_out)
        flops = 2.0 * b * h * sq * sk * (dqk + dv) * 0.5 * (2.5 if backward else 1.0)
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms, amount=flops, unit="TFLOP/s",
                           shape=f"B{b} S{sq} H{h} D{dqk}/{dv} {dtype}")

    return run


def _make_decode(framework, device):
    def run() -> Measurement:
        b, sq, h, dqk, dv, page, lengths = DECODE[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(43)
        max_pages = -(-max(lengths) // page)
        n_pages = b * max_pages
        table = rng.permutation(n_pages).astype(np.int32).reshape(b, max_pages)
        cache = rounded(rng.standard_normal((n_pages, page, dqk)), dtype)
        q = rounded(rng.standard_normal((b, sq, h, dqk)), dtype)
        lens = np.asarray(lengths, dtype=np.int32)
        ref_out, _ = R.mla_decode(q, cache, cache_seqlens=lens, block_table=table, head_dim_v=dv)
        naive_out = np.zeros_like(ref_out)
        for i, length in enumerate(lengths):  # the naive computation per sequence over its gathered rows
            kv = cache[table[i, np.arange(length) // page], np.arange(length) % page][None]
            naive_out[i:i + 1] = _naive_mla(q[i:i + 1], kv, np.zeros((1, sq, h, dv)), dtype, dv, causal=True)[0]
        time_ms = None
        if framework == "torch":
            from ..torch_api import mla_decode
            import torch
            args = [to_framework("torch", x, dtype, device) for x in (q, cache)]
            kw = dict(cache_seqlens=torch.tensor(lens, device=device), block_table=torch.tensor(table, device=device),
                      head_dim_v=dv)
            y = mla_decode(*args, **kw)
            if device == "cuda":
                from .._timing import time_torch
                time_ms = time_torch(lambda: mla_decode(*args, **kw))
        else:
            import jax
            import jax.numpy as jnp
            from ..jax_api import mla_decode
            args = [to_framework("jax", x, dtype, device) for x in (q, cache)]
            put = lambda x: jax.device_put(jnp.asarray(x), args[0].devices().pop())  # noqa: E731
            fwd = jax.jit(lambda q, c, lens, table: mla_decode(q, c, cache_seqlens=lens, block_table=table,
                                                               head_dim_v=dv))
            y = fwd(*args, put(lens), put(table))
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(fwd, *args, put(lens), put(table))
        itemsize = 2 if dtype != "float32" else 4
        return Measurement(max_err=error_vs_reference(y, ref_out, naive_out), tol=1.0, time_ms=time_ms,
                           amount=float(sum(lengths)) * dqk * itemsize, unit="TB/s",
                           shape=f"B{b} H{h} D{dqk}/{dv} paged {page} {dtype}")

    return run
