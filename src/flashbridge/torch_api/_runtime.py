"""Execute a core_kernels Plan with torch tensors.

CUDA tensors run the compiled kernels. CPU tensors run the same kernels through Triton's interpreter
(no environment variable needed: see core_kernels/_loader.py); because the interpreter computes bfloat16
arithmetic wrongly, bf16 tensors are widened to float32 for the launch and results narrowed back, which
rounds once, as the GPU kernels do.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import torch

from ..core_kernels._poison import poison_value, poisoning
from ..core_kernels import INTERPRETER, Plan, Target, get_kernel

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


@functools.lru_cache(maxsize=None)
def _cuda_target(index: int) -> Target:
    return Target(interpret=False, num_sms=torch.cuda.get_device_properties(index).multi_processor_count)


def target_for(device: torch.device) -> Target:
    """The Target a tensor on ``device`` runs on."""
    if device.type == "cpu":
        return INTERPRETER
    if device.type == "cuda":
        return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())
    raise ValueError(f"flashbridge kernels run on CUDA or CPU tensors, got a tensor on {device}")


def _compile_options(launch, interpret: bool) -> dict:
    """The same compile options as the JAX runtime passes to jax-triton (fp fusion stated explicitly:
    the two launchers' defaults need not agree, and the bits of the results depend on it)."""
    if interpret:
        return {}
    return {"num_warps": launch.num_warps, "num_stages": launch.num_stages, "enable_fp_fusion": True}


def _alloc(spec, dtype: torch.dtype, device) -> torch.Tensor:
    if spec.zero:
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    if poisoning():
        return torch.full(spec.shape, poison_value() if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(spec.shape, dtype=dtype, device=device)


def _launch_dtype(dtype: str, interpret: bool) -> torch.dtype:
    return torch.float32 if interpret and dtype == "bfloat16" else TORCH_DTYPES[dtype]


def execute(plan: Plan, inputs: Mapping[str, torch.Tensor],
            out: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Allocate the plan's buffers, run its launches in order and return its results.

    ``out`` names buffers the caller provides instead (the buffer's shape and dtype): the kernels update
    them in place and the result is that tensor -- e.g. logits overwritten by their gradient (each element
    read before it is written, by the same program) or a KV cache that receives new tokens. On a GPU the
    kernels write through the tensor itself, which must have the layout the plan was built for
    (contiguous unless the plan took its strides); on the CPU (interpreter) a tensor that is bfloat16 or
    not contiguous is staged as a contiguous launch-dtype copy of its contents and copied back.
    """
    device = inputs[plan.inputs[0]].device
    interpret = device.type == "cpu"
    out = out or {}
    env: dict[str, torch.Tensor] = {}
    for name in plan.inputs:
        t = inputs[name]
        env[name] = t.float() if interpret and t.dtype == torch.bfloat16 else t
    for spec in plan.buffers:
        given = out.get(spec.name)
        if given is not None:
            if tuple(given.shape) != spec.shape or given.dtype != TORCH_DTYPES[spec.dtype]:
                raise ValueError(f"out[{spec.name!r}]: expected a {spec.dtype} tensor of shape {spec.shape}, "
                                 f"got {given.dtype} {tuple(given.shape)}")
            launch_dtype = _launch_dtype(spec.dtype, interpret)
            if not interpret or (given.dtype == launch_dtype and given.is_contiguous()):
                env[spec.name] = given
            else:  # staged with its contents, copied back below
                env[spec.name] = given.to(launch_dtype, memory_format=torch.contiguous_format, copy=True)
            continue
        env[spec.name] = _alloc(spec, _launch_dtype(spec.dtype, interpret), device)
    # Triton launches on the current device: switch only when the tensors live elsewhere (the switch
    # itself costs host time on every call).
    switch = device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if switch else contextlib.nullcontext():
        for launch in plan.launches:
            kernel = get_kernel(launch.kernel, interpret)
            args = ([env[n] for n in launch.inputs] + launch.scalar_values()
                    + [env[n] for n in launch.outputs])
            kernel[launch.grid](*args, **launch.constexpr_dict(), **_compile_options(launch, interpret))
    results = []
    for name in plan.results:
        t, want = env[name], TORCH_DTYPES[plan.spec(name).dtype]
        t = t if t.dtype == want else t.to(want)
        if name in out and out[name] is not t:
            t = out[name].copy_(t)
        results.append(t)
    return tuple(results)
