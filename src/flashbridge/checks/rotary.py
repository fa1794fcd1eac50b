"""Checks of rotary position embeddings for ``python -m flashbridge check``.

Rows: ``rotary_embedding_qk`` (q and k in one launch, Llama's GQA heads on a GPU), forward and backward, and
the packed ``rotary_embedding`` with ``cu_seqlens`` (interleaved pairs, partial rotary_dim) forward (TB/s:
every input element read once and every output element written once; the cos / sin tables are not
counted). The error is max|out - ref| over the bound (twice the error of the output rounded to the dtype + a
floor), the worst output reported.
"""
from __future__ import annotations

import numpy as np

from ..reference import rotary as R
from . import Check, Measurement, error_vs_reference, rounded, to_framework

# (batch, seqlen, q heads, k heads, head dim): small on the CPU, Llama-3-8B's heads on a GPU
SHAPES = {"cpu": (2, 64, 4, 2, 64), "cuda": (2, 4096, 32, 8, 128)}
DTYPES = {"cpu": "float32", "cuda": "bfloat16"}


def checks(framework: str, device: str) -> list[Check]:
    return [Check(op="rotary_embedding_qk fwd", framework=framework, run=_make_run(framework, device, "qk", False)),
            Check(op="rotary_embedding_qk bwd", framework=framework, run=_make_run(framework, device, "qk", True)),
            Check(op="rotary_embedding packed gptj fwd", framework=framework,
                  run=_make_run(framework, device, "packed", False))]


def _make_run(framework, device, kind, backward):
    def run() -> Measurement:
        b, s, hq, hk, d = SHAPES[device]
        dtype = DTYPES[device]
        rng = np.random.default_rng(31)
        packed = kind == "packed"
        rotary_dim = d // 2 if packed else d
        cos, sin = (rounded(t, "float32") for t in R.cos_sin_table(s, rotary_dim))
        tokens = (b * s,) if packed else (b, s)
        x = rounded(rng.standard_normal((*tokens, hq, d)), dtype)
        k = None if packed else rounded(rng.standard_normal((*tokens, hk, d)), dtype)
        cts = [rounded(rng.standard_normal(a.shape), dtype) for a in (x, k) if a is not None]
        cu = np.array([0, s // 3, s, b * s], dtype=np.int32) if packed else None
        kw = dict(interleaved=packed)
        ref_kw = dict(kw, cu_seqlens=cu)
        if backward:
            refs = [R.rotary_embedding_bwd(ct, cos, sin, **ref_kw) for ct in cts]
        else:
            refs = [R.rotary_embedding(a, cos, sin, **ref_kw) for a in (x, k) if a is not None]
        time_ms = None
        if framework == "torch":
            import torch
            from .. import torch_api as api
            ins = [to_framework("torch", a, dtype, device, requires_grad=backward) for a in (x, k) if a is not None]
            tcos, tsin = (to_framework("torch", t, "float32", device) for t in (cos, sin))
            tcts = [to_framework("torch", ct, dtype, device) for ct in cts]
            if packed:
                kw["cu_seqlens"] = torch.tensor(cu, device=device)
                fwd = lambda: (api.rotary_embedding(ins[0], tcos, tsin, **kw),)  # noqa: E731
            else:
                fwd = lambda: api.rotary_embedding_qk(*ins, tcos, tsin, **kw)  # noqa: E731
            outs = fwd()
            if backward:
                grads = torch.autograd.grad(outs, ins, tcts, retain_graph=True)
            if device == "cuda":
                from .._timing import time_torch
                if backward:
                    time_ms = time_torch(lambda: torch.autograd.grad(outs, ins, tcts, retain_graph=True))
                else:
                    with torch.no_grad():
                        time_ms = time_torch(fwd)
            if backward:
                outs = grads
        else:
            import jax
            import jax.numpy as jnp
            from .. import jax_api as api
            ins = [to_framework("jax", a, dtype, device) for a in (x, k) if a is not None]
            jcos, jsin = (to_framework("jax", t, "float32", device) for t in (cos, sin))
            if packed:
                kw["cu_seqlens"] = jax.device_put(jnp.asarray(cu), ins[0].devices().pop())
                fwd = lambda x: (api.rotary_embedding(x, jcos, jsin, **kw),)  # noqa: E731
            else:
                fwd = lambda q, k: api.rotary_embedding_qk(q, k, jcos, jsin, **kw)  # noqa: E731
            outs, vjp_fn = jax.vjp(fwd, *ins)
            jcts = tuple(to_framework("jax", ct, dtype, device) for ct in cts)
            apply_vjp = lambda f, ct: f(ct)  # noqa: E731 -- the backward alone, residuals saved
            if backward:
                outs = jax.jit(apply_vjp)(vjp_fn, jcts)
            if device == "cuda":
                from .._timing import time_jax
                time_ms = time_jax(apply_vjp, vjp_fn, jcts) if backward else time_jax(fwd, *ins)
        err = max(error_vs_reference(o, r, rounded(r, dtype)) for o, r in zip(outs, refs))
        elements = sum(a.size for a in (x, k) if a is not None)
        return Measurement(max_err=err, tol=1.0, time_ms=time_ms,
                           amount=2 * elements * (2 if dtype != "float32" else 4), unit="TB/s",
                           shape=f"{'x'.join(map(str, x.shape))}{'' if k is None else f' + {hk} k heads'} {dtype}")

    return run
