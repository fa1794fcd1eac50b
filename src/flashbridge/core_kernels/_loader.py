"""Resolve a kernel reference to a compiled Triton kernel or to its interpreted twin.

``@triton.jit`` decides at decoration time whether it makes a compiled ``JITFunction`` or an
``InterpretedFunction`` (it reads ``TRITON_INTERPRET`` when the decorator runs), so a process normally gets one
or the other. flashbridge serves CPU arrays through Triton's interpreter *and* GPU arrays through compiled
kernels in the same process, with no environment variable to set:

* GPU: the module's ``JITFunction`` is launched as usual.
* CPU: the launch goes through ``InterpretedFunction(jit_fn.fn)``. Inside it, calls to other ``@triton.jit``
  functions (our helpers, and triton.language's own ``tl.sum``, ``tl.rand``, ...) reach
  ``JITFunction.__call__``, which outside a compiled kernel only raises; while an interpreted launch is
  running on this thread, the wrapper installed below runs them interpreted instead.

The interpreter runs a kernel by patching ``triton.language`` (its builtins, ``tensor``'s operators, ...) with
interpreter versions. The launch itself restores what it patched, but every nested ``@triton.jit`` call
patches the namespaces of *its* module again and never restores them (Triton 3.4-3.9); ``tl.sum`` and
``tl.rand`` live in modules that import ``triton.language.core``, so after any interpreted launch that calls
them ``triton.language.core.mul`` & co. stayed interpreter versions, and every later *compile* in the process
failed inside code generation (``'ir.value' object has no attribute 'dtype'`` at the first arithmetic). Each
interpreted launch here therefore restores those namespaces to exactly what they were before it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
from typing import Any

import numpy as np
import triton.language as tl
from triton import knobs
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_PACKAGE = __name__.rsplit(".", 1)[0]  # flashbridge.core_kernels
_state = threading.local()
# The interpreter patches triton.language module-wide for the duration of a launch, so two interpreted
# launches on different threads (e.g. JAX callbacks of several host devices under shard_map) would undo
# each other's patches: interpreted launches run one at a time.
_interpreter_lock = threading.RLock()
# jit function -> its interpreter twin (see interpreter_twin)
_TWINS: dict = {}


def interpreter_twin(fn, twin) -> None:
    """Run ``twin`` (a ``@triton.jit`` function with the same arguments and results) instead of ``fn`` when
    ``fn`` is called inside an interpreted launch. For helpers whose compiled form costs nothing but whose
    direct interpretation would: the interpreter runs a ``tl.reduce`` with a combine function of our own one
    element at a time in Python, where the twin's whole-tile operations run as NumPy calls."""
    _TWINS[fn.fn] = twin.fn


@functools.lru_cache(maxsize=None)
def _interpreted(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


def _install_call_hook() -> None:
    original = JITFunction.__call__
    if getattr(original, "_flashbridge_hook", False):
        return

    def __call__(self, *args, **kwargs):
        if getattr(_state, "interpreting", 0):
            return _interpreted(_TWINS.get(self.fn, self.fn))(*args, **kwargs)
        return original(self, *args, **kwargs)

    __call__._flashbridge_hook = True
    JITFunction.__call__ = __call__


_install_call_hook()


def _index_of_one_element_arrays() -> None:
    """Let a loop bound held in a one-element array reach ``range``, as Triton 3.7+ does.

    The interpreter holds scalars (kernel arguments, ``tl.program_id``) as one-element 1-d arrays; up to
    Triton 3.6 their ``__index__`` is ``int(array)``, which NumPy 2.5 refuses for 1-d arrays, so every
    ``for i in range(lo, hi)`` with tensor bounds failed. Later Triton squeezes the array first."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_flashbridge_index", False):
        return

    def patch(tensor, scope, *args, **kwargs):
        original(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch._flashbridge_index = True
    interpreter._patch_lang_tensor = patch


_index_of_one_element_arrays()


def _language_namespaces() -> list:
    """The objects the interpreter patches: triton.language, its core and math modules, and the tensor,
    dtype and tensor-descriptor classes (deduplicated: ``tl.tensor is tl.core.tensor``)."""
    import triton.language as tl

    objs = (tl, tl.core, getattr(tl, "math", None), tl.tensor, tl.dtype,
            getattr(tl.core, "tensor_descriptor_base", None))
    return list({id(o): o for o in objs if o is not None}.values())


@contextlib.contextmanager
def _restoring_language():
    """Put back every attribute of the patched namespaces as it was on entry (see the module docstring)."""
    saved = [(obj, dict(vars(obj))) for obj in _language_namespaces()]
    try:
        yield
    finally:
        for obj, before in saved:
            now = vars(obj)
            for name in [n for n in now if n not in before]:
                delattr(obj, name)
            for name, value in before.items():
                if now.get(name, _MISSING) is not value:
                    setattr(obj, name, value)


_MISSING = object()


class _InterpretedKernel:
    """``kernel[grid](*args, **kwargs)`` through the interpreter, nested jit calls interpreted too."""

    def __init__(self, fn):
        self._fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpreter_lock, _restoring_language():
                _state.interpreting = getattr(_state, "interpreting", 0) + 1
                try:
                    return _interpreted(self._fn)[grid](*args, **kwargs)
                finally:
                    _state.interpreting -= 1

        return launch


def _resolve(ref: str):
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"kernel reference {ref!r} is not of the form 'family.module:function'")
    return getattr(importlib.import_module(f"{_PACKAGE}.{module_name}"), attr)


def get_kernel(ref: str, interpret: bool) -> Any:
    """``"norms.kernels:norm_fwd_kernel"`` -> a launchable kernel, compiled or (``interpret``) interpreted."""
    kernel = _resolve(ref)
    if interpret and isinstance(kernel, JITFunction):
        return _InterpretedKernel(kernel.fn)
    return kernel  # compiled, or already interpreted because TRITON_INTERPRET=1 was set at import


fast_launch = True  # False: every compiled launch goes through JITFunction.run (tests compare the two)


class BoundLaunch:
    """A plan's :class:`~._plan.Launch` bound to its kernel, launched with the tensors of one call.

    ``JITFunction.run`` (what ``kernel[grid](...)`` calls) binds the arguments to the signature, specialises
    every one of them (dtype and 16-byte alignment of pointers, value classes of integers), hashes that
    into a cache key and looks the compiled kernel up, on every launch. A Launch fixes everything but the
    tensors: grid, runtime scalars, constexprs and options. So the first launch of each distinct (device,
    tensor dtypes, tensor alignments) goes through ``JITFunction.run``, which compiles if needed, launches and
    returns the ``CompiledKernel``; later launches with that key call the compiled kernel's launcher
    directly, with the same arguments in the same order as ``JITFunction.run`` passes them (every
    parameter, constexprs included) on the current device and stream. The key holds exactly what the
    launch's specialisation can vary by, so both ways run the same binary.

    Falls back to ``JITFunction.run`` for every launch when the kernel is not a ``JITFunction`` (interpreted
    at import), its constexprs are not its trailing parameters, a pre-run hook is installed, or
    ``fast_launch`` is False.
    """

    def __init__(self, launch):
        fn = _resolve(launch.kernel)
        self.jit_fn = fn if isinstance(fn, JITFunction) else None
        self.grid = tuple(launch.grid)
        self.grid3 = (*self.grid, 1, 1)[:3]
        self.scalars = tuple(launch.scalar_values())
        self.constexprs = launch.constexpr_dict()
        self.options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, "enable_fp_fusion": True}
        self.tail = None  # the constexpr values in the kernel's parameter order, when they end its signature
        if self.jit_fn is not None:
            params = self.jit_fn.params
            n_pos = len(params) - len(self.constexprs)
            names = [p.name for p in params[n_pos:]]
            if (n_pos >= 0 and all(p.is_constexpr for p in params[n_pos:])
                    and not any(p.is_constexpr for p in params[:n_pos]) and set(names) == set(self.constexprs)):
                self.tail = tuple(self.constexprs[n] for n in names)
        self.kernels: dict = {}  # (device, dtypes..., aligned...) -> CompiledKernel

    def run_jit(self, args):
        """Launch through ``JITFunction.run``; returns the compiled kernel it launched."""
        return self.jit_fn[self.grid](*args, **self.constexprs, **self.options)

    def __call__(self, inputs, outputs) -> None:
        """Launch with ``inputs`` and ``outputs`` (tensors in the launch's order) on the current device."""
        args = (*inputs, *self.scalars, *outputs)
        if self.tail is None or not fast_launch or self.jit_fn.pre_run_hooks:
            self.run_jit(args)
            return
        drv = driver.active
        device = drv.get_current_device()
        tensors = (*inputs, *outputs)
        key = (device, *[t.dtype for t in tensors], *[t.data_ptr() & 15 == 0 for t in tensors])
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.run_jit(args)
            if kernel is not None and hasattr(kernel, "packed_metadata"):
                self.kernels[key] = kernel
            return
        stream = drv.get_current_stream(device)
        args = (*args, *self.tail)
        runtime = knobs.runtime
        kernel.run(*self.grid3, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(self.grid, stream, *args), runtime.launch_enter_hook,
                   runtime.launch_exit_hook, *args)


@functools.lru_cache(maxsize=None)
def check_launch_signature(ref: str, n_inputs: int, scalars: tuple[str, ...], n_outputs: int,
                           constexprs: tuple[str, ...]) -> None:
    """Raise a ValueError unless the kernel ``ref`` takes ``n_inputs`` tensors, then the runtime scalars
    ``scalars`` by these names in this order, then ``n_outputs`` tensors, then exactly the constexprs
    ``constexprs`` (every one the kernel declares, none it does not). Cached: a plan family checks each
    launch layout once per process."""
    params = inspect.signature(getattr(_resolve(ref), "fn", _resolve(ref))).parameters.values()
    declared = {p.name for p in params if p.annotation is tl.constexpr or "constexpr" in str(p.annotation)}
    positional = [p.name for p in params if p.name not in declared]
    first, last = n_inputs, n_inputs + len(scalars)
    if len(positional) != last + n_outputs:
        raise ValueError(f"{ref}: the launch passes {n_inputs} inputs, {len(scalars)} scalars and {n_outputs} "
                         f"outputs ({last + n_outputs} positional arguments); the kernel takes {len(positional)}: "
                         f"{', '.join(positional)}")
    for i, (given, expected) in enumerate(zip(scalars, positional[first:last])):
        if given != expected:
            raise ValueError(f"{ref}: runtime scalar {i} of the launch is {given!r}, the kernel's parameter at "
                             f"that position is {expected!r}")
    missing, unknown = sorted(declared - set(constexprs)), sorted(set(constexprs) - declared)
    if missing or unknown:
        raise ValueError(f"{ref}: constexprs do not match the kernel's: missing {missing or 'none'}, "
                         f"unknown {unknown or 'none'}")


class _HostStorage:
    def __init__(self, array: np.ndarray):
        self._array = array

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def cpu(self) -> "_HostStorage":
        return self

    def copy_(self, other) -> None:  # the interpreter copies results back; host memory is already there
        pass


class HostArray:
    """A C-contiguous numpy array presented to Triton's interpreter the way a CPU torch tensor is.

    The interpreter only needs ``data_ptr`` and ``dtype`` to build pointers, plus the few storage methods it
    uses to stage device tensors on the host; for host memory those are identities.
    """

    def __init__(self, array: np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("HostArray needs a C-contiguous array")
        self.array = array
        self.dtype = array.dtype.name

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostStorage:
        return _HostStorage(self.array)

    def new_empty(self, *args, **kwargs) -> "HostArray":
        return self

    def set_(self, *args, **kwargs) -> "HostArray":
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)
