"""What the compiler says about a launch: shared memory, registers and spills, for a GPU we need not have.

``triton.compile`` targets any architecture its backend knows, without a device (the same path
``tests/test_compile_parity.py`` takes), so the resource model's estimates can be checked against the real
allocation: ``metadata.shared`` is the shared memory Triton allocates, and the cubin's resource usage (from
the bundled ``cuobjdump``) gives the registers per thread and the local memory per thread that ptxas
spilled to (Triton's ``n_spills`` is that size in 4-byte words).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import tempfile

_TT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
       "float8_e4m3fn": "fp8e4nv"}


@dataclasses.dataclass(frozen=True)
class Compiled:
    shared: int  # bytes of shared memory per block
    n_regs: int  # registers per thread
    n_spills: int  # 4-byte words of local memory per thread (spills and stack)


class _FakeTensor:
    """What Triton's argument binder needs from a tensor: an aligned address and a dtype."""

    def __init__(self, dtype: str):
        self.dtype = _TT[dtype]

    @staticmethod
    def data_ptr() -> int:
        return 1 << 20


def available(capability: int = 90) -> str:
    """"" when this machine can compile for ``capability`` (Triton's NVIDIA backend and ptxas), else why not."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
        from triton.compiler import make_backend

        make_backend(GPUTarget("cuda", capability, 32))
        get_ptxas(capability)
    except Exception as e:  # noqa: BLE001 - any missing piece means: cannot compile here
        return f"no Triton NVIDIA backend / ptxas for sm_{capability}: {e!r}"
    return ""


def compile_launch(launch, dtypes: dict, capability: int = 90) -> Compiled:
    """Compile one Launch for ``sm_<capability>`` as Triton's launcher would specialise it (pointers 16-byte
    aligned, integers equal to 1 folded) and read its resources. ``dtypes`` maps the launch's tensor names to
    dtype names; a name it lacks is float32 (the plans' scratch: partial results, statistics). Triton's
    on-disk cache makes a repeated compile cheap."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from ..core_kernels import get_kernel

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    fn = get_kernel(launch.kernel, False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    args = ([_FakeTensor(dtypes.get(n, "float32")) for n in launch.inputs] + launch.scalar_values()
            + [_FakeTensor(dtypes.get(n, "float32")) for n in launch.outputs])
    kwargs = {**launch.constexpr_dict(), "num_warps": launch.num_warps, "num_stages": launch.num_stages,
              "enable_fp_fusion": True, "debug": False}
    if hasattr(triton.knobs.compilation, "instrumentation_mode"):
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    regs, local = _resource_usage(kernel.asm["cubin"])
    return Compiled(kernel.metadata.shared, regs, local // 4)


@functools.lru_cache(maxsize=None)
def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers per thread, local memory bytes per thread) of the cubin's kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    line = next(ln for ln in text.splitlines() if "REG:" in ln)
    fields = dict(re.findall(r"(\w+):(\d+)", line))
    return int(fields["REG"]), max(int(fields.get("STACK", 0)), int(fields.get("LOCAL", 0)))
