"""Execute a core_kernels Plan with JAX arrays.

* CUDA: each launch is a ``jax_triton.triton_call`` (outputs appended after inputs and runtime scalars,
  constexprs as keyword metaparameters, zero-initialised outputs declared through ``zeroed_outputs``).
  When jaxlib registers its typed-FFI Triton target (``triton_kernel_call_ffi``), the calls are lowered to
  it rather than to jax-triton's legacy ``triton_kernel_call``: same kernel, same buffers, but the kernel
  is resolved once when the executable is initialised instead of on every launch, which saves host time per
  call (``FLASHBRIDGE_JAX_LAUNCH=legacy`` restores the legacy call).
* CPU: jax-triton cannot run there, so the whole plan runs in one ``jax.pure_callback`` through Triton's
  interpreter on host numpy buffers (bfloat16 widened to float32 for the launch, as in the torch runtime).

Plans depend on the target (block sizes, SM count), so callers pass a *plan factory* ``Target -> Plan``.
When a GPU backend exists the two paths are joined with ``jax.lax.platform_dependent``, which lowers only
the branch of the platform the computation is placed on; CPU arrays on a GPU machine work too.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._extras import require
from ..core_kernels._config import _active as _active_configs
from ..core_kernels._poison import poison_value, poisoning
from ..core_kernels import INTERPRETER, HostArray, Plan, Target, get_kernel

PlanFactory = Callable[[Target], Plan]


def jnp_dtype(name: str):
    return jnp.dtype(name)


def dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


@functools.lru_cache(maxsize=None)
def gpu_target() -> Target | None:
    """The CUDA target of the first local GPU, or None when JAX has no GPU backend."""
    try:
        devices = jax.local_devices(backend="gpu")
    except RuntimeError:
        return None
    if not devices:
        return None
    from ..tiles.profiles import profile_named

    sms = int(getattr(devices[0], "core_count", 0) or 132)
    return Target(interpret=False, num_sms=sms, gpu=profile_named(getattr(devices[0], "device_kind", ""), sms))


@functools.lru_cache(maxsize=None)
def _jax_triton():
    # Importing jax_triton 0.3.x sets TRITON_CACHE_DIR="" for the process, after which every Triton
    # compile (torch's too) fails to locate its cache: put the variable and the knob back.
    launch = launch_mode()  # a bad value fails before anything is imported
    saved = os.environ.get("TRITON_CACHE_DIR")
    jax_triton = require("jax_triton", "jax", "flashbridge.jax_api on a GPU")
    import triton

    cache = saved or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    os.environ["TRITON_CACHE_DIR"] = cache
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        knobs.cache.dir = cache
    if launch == "ffi":  # "legacy": jax-triton's own custom call
        _launch_through_ffi(jax_triton)
    return jax_triton


_LAUNCH_MODES = ("ffi", "legacy")


def launch_mode() -> str:
    """How JAX calls reach a Triton kernel on a GPU (``FLASHBRIDGE_JAX_LAUNCH``): ``ffi`` (default) jaxlib's
    typed-FFI Triton launcher where this jaxlib has one, ``legacy`` jax-triton's ``triton_kernel_call``."""
    launch = os.environ.get("FLASHBRIDGE_JAX_LAUNCH", "ffi")
    if launch not in _LAUNCH_MODES:
        raise ValueError(f"FLASHBRIDGE_JAX_LAUNCH: expected one of {', '.join(_LAUNCH_MODES)}, got {launch!r}")
    return launch


_FFI_TARGET = "triton_kernel_call_ffi"  # jaxlib 0.11: reads the serialised call from the "opaque" attribute


def _ffi_target() -> str | None:
    """jaxlib's typed-FFI Triton launcher (kernel resolved once at initialisation), when this jaxlib
    registers one."""
    try:
        from jax._src.lib import gpu_triton
        names = list(gpu_triton._cuda_triton.registrations())
    except Exception:
        return None
    return _FFI_TARGET if _FFI_TARGET in names else None


def _launch_through_ffi(jax_triton) -> None:
    """Lower jax-triton's kernel calls to jaxlib's typed-FFI Triton target instead of the legacy
    ``triton_kernel_call`` custom call (which looks the kernel up by its serialised proto on every
    launch). The serialised call travels as the ``opaque`` attribute, which that target reads."""
    target = _ffi_target()
    if target is None:
        return
    from jax_triton import triton_lib

    class _Jax:  # stands in for the ``jax`` module inside triton_lib
        def __getattr__(self, name):
            return getattr(jax, name)

    class _Ffi:
        def __getattr__(self, name):
            return getattr(jax.ffi, name)

        @staticmethod
        def ffi_lowering(name, *, api_version=4, backend_config=None, **kwargs):
            if name != "triton_kernel_call" or api_version != 2 or not isinstance(backend_config, bytes):
                return jax.ffi.ffi_lowering(name, api_version=api_version, backend_config=backend_config, **kwargs)
            rule = jax.ffi.ffi_lowering(target, **kwargs)
            return lambda ctx, *args: rule(ctx, *args, opaque=backend_config)

    proxy = _Jax()
    proxy.ffi = _Ffi()
    triton_lib.jax = proxy


def _result_structs(plan: Plan):
    return tuple(jax.ShapeDtypeStruct(plan.spec(r).shape, jnp_dtype(plan.spec(r).dtype)) for r in plan.results)


def _execute_gpu(plan: Plan, names: tuple[str, ...], aliases: Mapping[str, str], *arrays):
    jt = _jax_triton()
    env = dict(zip(names, arrays))
    for launch in plan.launches:
        io_aliases = {launch.inputs.index(src): launch.outputs.index(dst) for dst, src in aliases.items()
                      if dst in launch.outputs and src in launch.inputs}
        specs = [plan.spec(n) for n in launch.outputs]
        # jax-triton types a Python float as fp64 where Triton's own launcher uses fp32: pass np.float32
        # so both front-ends compile the same kernel (and get the same bits).
        scalars = [np.float32(v) if isinstance(v, float) else v for v in launch.scalar_values()]
        outs = jt.triton_call(
            *[env[n] for n in launch.inputs], *scalars,
            kernel=get_kernel(launch.kernel, False),
            out_shape=[jax.ShapeDtypeStruct(s.shape, jnp_dtype(s.dtype)) for s in specs],
            grid=launch.grid, num_warps=launch.num_warps, num_stages=launch.num_stages, enable_fp_fusion=True,
            zeroed_outputs=tuple(i for i, s in enumerate(specs) if s.zero),
            input_output_aliases=io_aliases or None,
            **launch.constexpr_dict())
        env.update(zip(launch.outputs, outs))
    return tuple(env[r] for r in plan.results)


def _host_dtype(dtype: str):
    return np.float32 if dtype == "bfloat16" else np.dtype(dtype)


def _host_alloc(spec) -> np.ndarray:
    dtype = _host_dtype(spec.dtype)
    if spec.zero:
        return np.zeros(spec.shape, dtype=dtype)
    if poisoning():
        return np.full(spec.shape, poison_value() if np.issubdtype(dtype, np.floating) else -1, dtype=dtype)
    return np.empty(spec.shape, dtype=dtype)


def run_plan_on_host(plan: Plan, named: Mapping[str, np.ndarray],
                     aliases: Mapping[str, str] | None = None) -> tuple[np.ndarray, ...]:
    """Run a plan through Triton's interpreter on numpy arrays (the body of the CPU callback). An output
    in ``aliases`` starts as a private copy of its input (see :func:`execute`)."""
    aliases = aliases or {}
    env: dict[str, np.ndarray] = {}
    for name in plan.inputs:
        a = np.asarray(named[name])
        env[name] = np.ascontiguousarray(a.astype(np.float32) if a.dtype.name == "bfloat16" else a)
    for spec in plan.buffers:
        src = aliases.get(spec.name)
        env[spec.name] = np.array(env[src], copy=True) if src is not None else _host_alloc(spec)
    for launch in plan.launches:
        kernel = get_kernel(launch.kernel, True)
        args = ([HostArray(env[n]) for n in launch.inputs] + launch.scalar_values()
                + [HostArray(env[n]) for n in launch.outputs])
        kernel[launch.grid](*args, **launch.constexpr_dict())
    return tuple(env[r].astype(jnp_dtype(plan.spec(r).dtype), copy=False) for r in plan.results)


def _execute_cpu(plan: Plan, names: tuple[str, ...], aliases: Mapping[str, str], *arrays):
    def callback(*host_arrays):
        return run_plan_on_host(plan, dict(zip(names, host_arrays)), aliases)

    return jax.pure_callback(callback, _result_structs(plan), *arrays, vmap_method="sequential")


def _varying_axes(arrays) -> frozenset:
    """Mesh axes along which any of ``arrays`` varies inside shard_map (empty outside it)."""
    axes: set = set()
    for a in arrays:
        aval = jax.typeof(a) if hasattr(jax, "typeof") else getattr(a, "aval", None)
        vma = getattr(aval, "vma", None)
        if vma is None:
            vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
        axes |= set(vma or ())
    return frozenset(axes)


def _mark_varying(outs, axes: frozenset):
    """Kernel calls and callbacks are opaque to shard_map's varying-axes typing: give the results the
    varying axes of the inputs, which is what they depend on (custom_vjp checks that types match). Only
    the axes an array does not vary over yet are cast."""
    out = []
    for o in outs:
        missing = tuple(sorted(axes - _varying_axes([o])))
        if missing:
            o = jax.lax.pcast(o, missing, to="varying") if hasattr(jax.lax, "pcast") else jax.lax.pvary(o, missing)
        out.append(o)
    return tuple(out)


def match_varying(*arrays):
    """Inside shard_map, give every array the varying axes of all of them (None passes through).

    Call this on an op's inputs *outside* its custom_vjp: a replicated parameter then enters as varying,
    its gradient comes out varying, and JAX's transpose of the cast sums it over the mesh axes.
    """
    axes = _varying_axes([a for a in arrays if a is not None])
    if not axes:
        return arrays
    return tuple(None if a is None else _mark_varying((a,), axes)[0] for a in arrays)


def execute(make_plan: PlanFactory, inputs: Mapping[str, jax.Array], *,
            aliases: Mapping[str, str] | None = None) -> tuple[jax.Array, ...]:
    """Run the plan ``make_plan(target)`` on ``inputs`` (name -> array) and return its results.

    ``aliases`` maps an output to an input of the same shape and dtype: the output starts with the input's
    contents and the kernels update it (the kernel must read an element before it writes it, if it reads
    it at all) -- logits overwritten by their gradient, a KV cache receiving new tokens. On a GPU it takes
    over the input's buffer: when the input is not needed afterwards (or is donated) XLA updates it in
    place, otherwise it copies the input first. On the CPU it is a copy. The torch runtime's ``out=`` is
    the explicit counterpart.
    """
    cpu_plan = make_plan(INTERPRETER)
    names = cpu_plan.inputs
    arrays = [inputs[n] for n in names]
    aliases = dict(aliases or {})
    for dst, src in aliases.items():
        if src not in names:
            raise ValueError(f"aliases: {src!r} is not an input of the plan (inputs: {names})")
        spec, arr = cpu_plan.spec(dst), inputs[src]
        if tuple(spec.shape) != tuple(arr.shape) or jnp_dtype(spec.dtype) != arr.dtype:
            raise ValueError(f"aliases: output {dst!r} {spec.dtype}{tuple(spec.shape)} cannot take over input "
                             f"{src!r} {arr.dtype}{tuple(arr.shape)}")
    target = gpu_target()
    if target is None:
        outs = _execute_cpu(cpu_plan, names, aliases, *arrays)
    else:
        gpu_plan = make_plan(target)
        assert gpu_plan.inputs == names and gpu_plan.results == cpu_plan.results
        outs = jax.lax.platform_dependent(
            *arrays,
            cpu=functools.partial(_execute_cpu, cpu_plan, names, aliases),
            cuda=functools.partial(_execute_gpu, gpu_plan, names, aliases))
    return _mark_varying(tuple(outs), _varying_axes(arrays))


def jit_op(*static: str):
    """Decorator of the array part of a public op: ``jax.jit`` with the keyword arguments named in ``static``
    (hashable options: shapes, flags, plans) and the configs of the :func:`~flashbridge.core_kernels.configure`
    blocks around the call as static arguments, so it is traced and compiled once per configuration.

    Rule: a public op checks its arguments on the host (types, shapes, options, the values of concrete index
    arrays), then calls one such function with its arrays (None allowed) and options; nothing inside reads an
    array's value. Reason: an eager call then reaches a compiled executable through jit's C++ dispatch instead
    of tracing the custom_vjp / custom_vmap / kernel-call graph anew every time. Under an outer jit, grad,
    vmap, shard_map or checkify the function is inlined into the caller's jaxpr (``inline=True``): the same
    program, and the same bits, as before.
    """
    def wrap(fn):
        def body(*args, _configs, **kwargs):
            return fn(*args, **kwargs)

        jitted = jax.jit(body, static_argnames=(*static, "_configs"), inline=True)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return jitted(*args, _configs=_active_configs.get(), **kwargs)

        return call

    return wrap
