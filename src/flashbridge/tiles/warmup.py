"""Compile the kernels a model will use before its first step: :func:`warmup` and ``python -m flashbridge warmup``.

A first call of a new shape class compiles its kernels (attention forward + backward at D=128: several
seconds). Warm-up builds the same plans the front-ends build for representative shapes and hands each
launch to Triton's ``JITFunction.warmup`` (compile only, no launch, no tensors): the compiled kernels land
in the kernels' in-process cache, keyed exactly as the torch front-end's launches are, and in Triton's
on-disk cache for later processes. Sizes are runtime arguments, so one warm-up covers every length whose
plan has the same constexprs (block sizes follow the head dim, dtype and masking; a length that is not a
multiple of the block compiles its own tail variant, a norm width or vocabulary size its own kernel).

On a CPU nothing is compiled: Triton's interpreter runs the kernels' Python directly.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional, Sequence

OPS = ("attention", "decode", "norms", "cross_entropy")
_TT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
       "float8_e4m3fn": "fp8e4nv"}


class _Mock:
    """A tensor as Triton's argument binder sees it: a 16-byte aligned address and a dtype. (torch dtypes
    go through Triton's own MockTensor; without torch, Triton's dtype names.)"""

    def __init__(self, dtype: str):
        try:
            import torch

            self.dtype = getattr(torch, dtype)
        except ImportError:
            self.dtype = _TT[dtype]

    @staticmethod
    def data_ptr() -> int:
        return 0

    @staticmethod
    def ptr_range() -> int:
        return 0


def gpu_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        pass
    try:
        from triton.runtime import driver

        driver.active.get_current_device()
        return True
    except Exception:  # noqa: BLE001 - no active GPU driver
        return False


def _num_sms() -> int:
    from triton.runtime import driver

    dev = driver.active.get_current_device()
    return driver.active.utils.get_device_properties(dev)["multiprocessor_count"]


def _gpu_profile(num_sms: int):
    """The live GPU's profile when there is one (the torch runtime's target carries the same, so warm-up
    builds the plans, and tiles, the first calls will), else None (the H200's tiles)."""
    from .profiles import profile_of

    try:
        gpu = profile_of()
    except Exception:  # noqa: BLE001 - no usable device: the reference tiles
        return None
    return gpu if gpu is not None and gpu.sms == num_sms else None


def plans(ops: Sequence[str], head_dims: Sequence[int], dtypes: Sequence[str], *, hidden: Sequence[int] = (4096,),
          vocab: Sequence[int] = (128256,), num_sms: int = 132):
    """Yield (what, plan, tensor dtypes) for every plan the given ops build for these head dims and dtypes:
    attention forward and backward (causal and not), decode (one long sequence, and a batch), RMSNorm /
    LayerNorm forward and backward, cross-entropy forward, gradient and its mean / sum reductions."""
    from ..core_kernels import Target
    from ..core_kernels.cross_entropy.plan import plan_ce_fwd, plan_ce_grad, plan_ce_total, plan_mean_scales
    from ..core_kernels.decode.plan import check_decode_args, plan_decode
    from ..core_kernels.flash_attn.plan import check_attention_args, plan_attention_bwd, plan_attention_fwd
    from ..core_kernels.norms.plan import plan_norm_bwd, plan_norm_fwd

    target = Target(interpret=False, num_sms=num_sms, gpu=_gpu_profile(num_sms))
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"ops: unknown {unknown}; expected some of {', '.join(OPS)}")
    for dtype in dtypes:
        f32 = {n: "float32" for n in ("lse", "lse2", "delta", "dlse", "mean", "rstd", "loss", "lse_lo", "weight_f32",
                                       "zloss", "scales")}
        if "attention" in ops:
            for d in head_dims:
                info = ((2, 4096, 16, d), dtype)
                for causal in (False, True):
                    shape, options = check_attention_args(q=info, k=info, v=info, causal=causal)
                    dt = {**{n: dtype for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}, **f32}
                    tag = f"attention D={d} {dtype}{' causal' if causal else ''}"
                    yield f"{tag} forward", plan_attention_fwd(shape, options, target=target), dt
                    yield f"{tag} backward", plan_attention_bwd(shape, options, target=target), dt
        if "decode" in ops:
            for d in head_dims:
                for batch, length in ((1, 16384), (32, 8192)):
                    cache = ((batch, length, 8, d), dtype)
                    shape, options, _ = check_decode_args(q=((batch, 1, 32, d), dtype), k_cache=cache,
                                                          v_cache=cache, cache_seqlens=((batch,), "int32"))
                    dt = {"q": dtype, "k_cache": dtype, "v_cache": dtype, "cache_seqlens": "int32", **f32}
                    yield f"decode D={d} {dtype} B={batch}", plan_decode(shape, options, target=target), dt
        if "norms" in ops:
            for n in hidden:
                for rms in (True, False):
                    kw = dict(is_rms=rms, target=target)
                    name = "rms_norm" if rms else "layer_norm"
                    dt = {"x": dtype, "weight": dtype, "bias": dtype, "dy": dtype, "h": dtype, **f32}
                    yield (f"{name} {n} {dtype} forward",
                           plan_norm_fwd(8192, n, x_dtype=dtype, residual_dtype=None, has_weight=True,
                                         has_bias=not rms, has_post_residual=False, dropout_p=0.0, eps=1e-6, **kw), dt)
                    yield (f"{name} {n} {dtype} backward",
                           plan_norm_bwd(8192, n, dx_dtype=dtype, weight_dtype=dtype, bias_dtype=None if rms else dtype,
                                         has_dh=False, dropout_p=0.0, **kw), dt)
        if "cross_entropy" in ops:
            for v in vocab:
                opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, target=target)
                dt = {"logits": dtype, "labels": "int64", "grad": dtype, "weight": "float32", **f32}
                yield f"cross_entropy V={v} {dtype} forward", plan_ce_fwd(8192, v, **opts), dt
                yield (f"cross_entropy V={v} {dtype} gradient",
                       plan_ce_grad(8192, v, grad_dtype=dtype, per_row_weight=True, **opts), dt)
                # reduction "mean": the divisor's reciprocal, then the rows' total (also "sum": no scales)
                yield (f"cross_entropy V={v} mean scales",
                       plan_mean_scales(8192, v, class_weight=False, ignore_index=-100, target=target), dt)
                for has_scales in (True, False):
                    yield (f"cross_entropy {'mean' if has_scales else 'sum'} total",
                           plan_ce_total(8192, has_z=False, has_scales=has_scales, target=target), dt)


def _warm_launch(launch, plan, dtypes: dict) -> None:
    from ..core_kernels import get_kernel

    def mock(name):
        try:
            return _Mock(plan.spec(name).dtype)
        except KeyError:
            return _Mock(dtypes[name])

    kernel = get_kernel(launch.kernel, False)
    args = [mock(n) for n in launch.inputs] + launch.scalar_values() + [mock(n) for n in launch.outputs]
    kernel.warmup(*args, grid=launch.grid, **launch.constexpr_dict(), num_warps=launch.num_warps,
                  num_stages=launch.num_stages, enable_fp_fusion=True)


def warmup(ops: Iterable[str] = OPS, head_dims: Iterable[int] = (64, 128), dtypes: Iterable[str] = ("bfloat16",), *,
           hidden: Iterable[int] = (4096,), vocab: Iterable[int] = (128256,), progress: bool = True) -> int:
    """Compile the kernels of ``ops`` ("attention", "decode", "norms", "cross_entropy") for ``head_dims``
    (attention, decode), ``hidden`` (norm widths), ``vocab`` (cross-entropy) and ``dtypes`` on the current
    GPU; returns the number of launches warmed (0 on a CPU, where the interpreter needs no compile).

    Example (no GPU here: nothing to compile)::

        >>> import flashbridge
        >>> flashbridge.warmup(ops=["norms"], hidden=[1024], progress=False) >= 0
        True
    """
    ops, head_dims, dtypes = tuple(ops), tuple(head_dims), tuple(dtypes)
    hidden, vocab = tuple(hidden), tuple(vocab)
    for d in dtypes:
        if d not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtypes: {d!r} is not supported; use bfloat16, float16 or float32")
    if not gpu_visible():
        if progress:
            print("flashbridge warmup: no GPU visible; on a CPU the kernels run in Triton's interpreter, which "
                  "needs no compile", file=sys.stderr)
        return 0
    todo = [(what, plan, dt, launch) for what, plan, dt in plans(ops, head_dims, dtypes, hidden=hidden, vocab=vocab,
                                                                num_sms=_num_sms())
            for launch in plan.launches]
    if not progress:
        for _, plan, dt, launch in todo:
            _warm_launch(launch, plan, dt)
        return len(todo)
    from rich.progress import Progress

    with Progress(transient=False) as bar:
        task = bar.add_task("compiling", total=len(todo))
        for what, plan, dt, launch in todo:
            bar.update(task, description=f"{what}: {launch.kernel.split(':')[1]}")
            _warm_launch(launch, plan, dt)
            bar.advance(task)
    return len(todo)


def warmup_command(args) -> int:
    def ints(text: Optional[str]):
        return tuple(int(x) for x in text.split(",") if x)

    n = warmup(ops=[o.strip() for o in args.ops.split(",") if o.strip()], head_dims=ints(args.head_dims),
               dtypes=[d.strip() for d in args.dtypes.split(",") if d.strip()], hidden=ints(args.hidden),
               vocab=ints(args.vocab))
    if n:
        print(f"flashbridge warmup: {n} launches compiled (or found in Triton's cache)")
    return 0
