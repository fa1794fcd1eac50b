"""Execute a core_kernels Plan with torch tensors.

CUDA tensors run the compiled kernels. CPU tensors run the same kernels through Triton's interpreter
(no environment variable needed: see core_kernels/_loader.py); because the interpreter computes bfloat16
arithmetic wrongly, bf16 tensors are widened to float32 for the launch and results narrowed back, which
rounds once, as the GPU kernels do.
"""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Mapping
from typing import Optional

import torch

from ..core_kernels._plan import memoised as _memoised
from ..core_kernels._poison import poison_value, poisoning
from ..core_kernels import INTERPRETER, Plan, Spec, Target, get_kernel

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
    """The device's SM count and its GPU profile (the tuning cache's key: plans read their tiles by it)."""
    from ..tiles.profiles import profile_of

    sms = torch.cuda.get_device_properties(index).multi_processor_count
    return Target(interpret=False, num_sms=sms, gpu=profile_of(index))


def target_for(device: torch.device) -> Target:
    """The Target a tensor on ``device`` runs on."""
    if device.type == "cpu":
        return INTERPRETER
    if device.type == "cuda":
        return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())
    raise ValueError(f"flashbridge kernels run on CUDA or CPU tensors, got a tensor on {device}")


def memoised(fn):
    """``core_kernels._plan.memoised`` for the torch front-end: cached in eager calls, traced as it is under
    ``torch.compile`` (dynamo cannot trace the cache; the compiled graph runs no checks anyway)."""
    return _memoised(fn, bypass=torch.compiler.is_compiling)


def _alloc(spec, dtype: torch.dtype, device) -> torch.Tensor:
    if spec.zero:
        return torch.zeros(spec.shape, dtype=dtype, device=device)
    if poisoning():
        return torch.full(spec.shape, poison_value() if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(spec.shape, dtype=dtype, device=device)


def _launch_dtype(dtype: str, interpret: bool) -> torch.dtype:
    return torch.float32 if interpret and dtype == "bfloat16" else TORCH_DTYPES[dtype]


_SCRATCH_ALIGN = 256  # bytes; as torch's allocator aligns: a carved buffer specialises like a fresh one


class _Program:
    """What :func:`execute` derives from a plan once per target kind (compiled / interpreted): the buffers
    to allocate with their launch dtypes, the launches bound to their kernels, the results' dtypes.

    Scratch buffers (written and read by the launches, not returned, not zeroed) are carved from one byte
    buffer at 256-byte offsets: one allocation instead of one per buffer, with the alignment (hence the
    compiled kernel and the bits) of separate allocations. Results keep their own allocations, so a
    result never shares storage with another or keeps scratch alive."""

    def __init__(self, plan: Plan, interpret: bool):
        self.interpret = interpret
        self.inputs = plan.inputs
        results = set(plan.results)
        self.own: list[tuple] = []  # (spec, launch dtype): results and zeroed buffers
        self.scratch: list[tuple] = []  # (name, offset in bytes, numel, launch dtype, shape)
        offset = 0
        for spec in plan.buffers:
            dtype = _launch_dtype(spec.dtype, interpret)
            if spec.name in results or spec.zero or interpret:
                self.own.append((spec, dtype))
                continue
            numel = math.prod(spec.shape)
            self.scratch.append((spec.name, offset, numel, dtype, spec.shape))
            offset += -(-numel * dtype.itemsize // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
        self.scratch_bytes = offset
        self.launches = [(launch.inputs, launch.outputs,
                          get_kernel(launch.kernel, True)[launch.grid] if interpret else None,
                          launch.constexpr_dict(), launch.scalar_values(),
                          None if interpret else launch.bound) for launch in plan.launches]
        self.results = tuple(plan.results)
        self.casts = tuple((name, TORCH_DTYPES[plan.spec(name).dtype]) for name in plan.results
                           if _launch_dtype(plan.spec(name).dtype, interpret) != TORCH_DTYPES[plan.spec(name).dtype])

    def allocate(self, env: dict, device, skip) -> None:
        """Fresh buffers into ``env``, but for the names in ``skip`` (buffers the caller provides)."""
        for spec, dtype in self.own:
            if spec.name not in skip:
                env[spec.name] = _alloc(spec, dtype, device)
        if self.scratch and skip and any(item[0] in skip for item in self.scratch):
            for name, _, _, dtype, shape in self.scratch:
                if name not in skip:
                    env[name] = _alloc(Spec(name, shape, DTYPE_NAMES[dtype]), dtype, device)
        elif self.scratch:
            base = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device)
            for name, offset, numel, dtype, shape in self.scratch:
                t = base[offset:offset + numel * dtype.itemsize].view(dtype).view(shape)
                if poisoning():
                    t.fill_(float("nan") if dtype.is_floating_point else -1)
                env[name] = t

    def launch(self, env: dict) -> None:
        for ins, outs, interpreted, constexprs, scalars, bound in self.launches:
            if bound is not None:
                bound([env[n] for n in ins], [env[n] for n in outs])
            else:
                interpreted(*[env[n] for n in ins], *scalars, *[env[n] for n in outs], **constexprs)

    def launch_on(self, device, env: dict) -> None:
        """:meth:`launch` on ``device``: Triton launches on the current device, so switch only when the
        tensors live elsewhere (the switch itself costs host time on every call)."""
        if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                self.launch(env)
        else:
            self.launch(env)


def _program(plan: Plan, interpret: bool) -> _Program:
    state = plan.runtime_state
    program = state.get(("torch", interpret))
    if program is None:
        program = state[("torch", interpret)] = _Program(plan, interpret)
    return program


def execute(plan: Plan, inputs: Mapping[str, torch.Tensor],
            out: Mapping[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
    """Allocate the plan's buffers, run its launches in order and return its results.

    ``out`` names buffers the caller provides instead (the buffer's shape and dtype): the kernels update
    them in place and the result is that tensor -- e.g. logits overwritten by their gradient (each element
    read before it is written, by the same program) or a KV cache that receives new tokens. On a GPU the
    kernels write through the tensor itself, which must have the layout the plan was built for
    (contiguous unless the plan took its strides); on the CPU (interpreter) a tensor that is bfloat16 or
    not contiguous is staged as a contiguous launch-dtype copy of its contents and copied back.

    The plan's launches, buffers and result dtypes are prepared once per plan (:class:`_Program`); on a GPU
    each launch calls its compiled kernel directly once Triton has compiled it (``core_kernels._loader``'s
    ``BoundLaunch``).
    """
    device = inputs[plan.inputs[0]].device
    interpret = device.type == "cpu"
    program = _program(plan, interpret)
    recording = getattr(_recorder, "calls", None)
    if interpret:
        env = {name: (t.float() if t.dtype == torch.bfloat16 else t)
               for name, t in ((name, inputs[name]) for name in plan.inputs)}
    else:
        env = {name: inputs[name] for name in plan.inputs}
    program.allocate(env, device, out or ())
    if out:
        for name, given in out.items():
            spec = plan.spec(name)
            if tuple(given.shape) != spec.shape or given.dtype != TORCH_DTYPES[spec.dtype]:
                raise ValueError(f"out[{name!r}]: expected a {spec.dtype} tensor of shape {spec.shape}, "
                                 f"got {given.dtype} {tuple(given.shape)}")
            launch_dtype = _launch_dtype(spec.dtype, interpret)
            if not interpret or (given.dtype == launch_dtype and given.is_contiguous()):
                env[name] = given
            else:  # staged with its contents, copied back below
                env[name] = given.to(launch_dtype, memory_format=torch.contiguous_format, copy=True)
    program.launch_on(device, env)
    for name, want in program.casts:
        env[name] = env[name].to(want)
    if out:
        for name, given in out.items():
            if name in program.results and env[name] is not given:
                env[name] = given.copy_(env[name])
    results = tuple([env[name] for name in program.results])
    if recording is not None:
        recording.append((program, inputs, bool(out), device, results))
    return results


def signature(args, addresses: bool = False) -> tuple:
    """What a pure function of its arguments' metadata can depend on: each tensor's type, shape, strides,
    dtype and device (with ``addresses``, also its address modulo 16: the alignment kernels specialise on,
    and that implementations check, e.g. an FP8 cache's 2-byte start), the other arguments by type and value
    (an unhashable one raises TypeError only when the result is hashed); a list (of optional tensors, as
    ``list[Optional[Tensor]]`` arguments arrive) by the signature of its elements."""
    if addresses:
        return tuple([(type(a), a.shape, a.stride(), a.dtype, a.device, a.data_ptr() % 16)
                      if isinstance(a, torch.Tensor) else (list, signature(a, True)) if type(a) is list
                      else (type(a), a) for a in args])
    return tuple([(type(a), a.shape, a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor)
                  else (list, signature(a)) if type(a) is list else (type(a), a) for a in args])


# ------------------------------------------------------------------------------------------------ replay

_recorder = threading.local()


def record_executions(impl, args) -> tuple[object, list]:
    """``impl(*args)``, and the :func:`execute` calls it made: (program, inputs, out given, device, results)."""
    outer = getattr(_recorder, "calls", None)
    _recorder.calls = calls = []
    try:
        return impl(*args), calls
    finally:
        _recorder.calls = outer


class Replay:
    """An op implementation's one :func:`execute` call, redone from the op's arguments: the same program
    on the argument tensors it read (by position), its outputs made of the results as the implementation
    made them (a result, a contiguous view of one, or an empty tensor). No planning, no checks and none of
    the implementation's Python run again.

    :meth:`of` builds one from a recorded call and returns None unless the implementation was exactly that:
    one compiled (GPU) execution whose inputs are the op's own argument tensors (not copies, casts or
    views), nothing written in place, every output a result, a view of one or a fresh empty tensor."""

    __slots__ = ("program", "inputs", "outputs", "single", "device")

    @classmethod
    def of(cls, args, result, calls) -> Optional["Replay"]:
        if len(calls) != 1:
            return None
        program, inputs, had_out, device, results = calls[0]
        if had_out or program.interpret:  # the interpreter (CPU tensors) stages its inputs
            return None
        positions = {}  # id -> (argument, element of a list argument or None)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                positions[id(a)] = (i, None)
            elif type(a) is list:
                positions.update((id(x), (i, j)) for j, x in enumerate(a) if isinstance(x, torch.Tensor))
        named = tuple((name, positions.get(id(inputs[name]))) for name in program.inputs)
        if any(i is None for _, i in named):
            return None
        single = isinstance(result, torch.Tensor)
        outputs = tuple(cls._made_of(o, results) for o in ((result,) if single else result))
        if any(o is None for o in outputs):
            return None
        replay = cls()
        replay.program, replay.inputs, replay.outputs, replay.single = program, named, outputs, single
        replay.device = device
        return replay

    @staticmethod
    def _made_of(o, results):
        """(result index, view shape or None), or (None, (shape, dtype)) for an empty tensor."""
        if not isinstance(o, torch.Tensor):
            return None
        for j, r in enumerate(results):
            if o is r:
                return (j, None)
            if o._base is r and o.is_contiguous() and o.numel() == r.numel():
                return (j, tuple(o.shape))
        if o.numel() == 0 and o._base is None:
            return (None, (tuple(o.shape), o.dtype))
        return None

    def __call__(self, args):
        program, device = self.program, self.device
        env = {name: args[i] if j is None else args[i][j] for name, (i, j) in self.inputs}
        program.allocate(env, device, ())
        program.launch_on(device, env)
        outs = []
        for j, view in self.outputs:
            if j is None:
                outs.append(torch.empty(view[0], dtype=view[1], device=device))
            else:
                r = env[program.results[j]]
                outs.append(r if view is None else r.view(view))
        return outs[0] if self.single else tuple(outs)
