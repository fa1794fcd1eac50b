"""Spec / Launch / Plan: the framework-neutral description of what an op does on the device.

A plan function (``<family>/plan.py``) turns shapes, dtypes and options into a :class:`Plan`; each front-end
has one small runtime that executes a Plan with its own arrays. Nothing here imports torch or jax.

Kernel calling convention (shared by both runtimes, see DESIGN.md)::

    kernel[grid](*inputs, *runtime_scalars, *outputs, **constexprs, num_warps=..., num_stages=...)

Runtime scalars come *before* the outputs because jax-triton appends output pointers after all positional
arguments and turns every keyword argument into a constexpr; putting sizes that vary from call to call
(row counts, sequence lengths) there keeps one compiled kernel for many shapes in both frameworks. Values
that should be specialised (a row width that sets the block size, feature flags) go in ``constexprs``.
A Plan checks each launch against its kernel's signature when it is built (tensor counts, runtime scalars by
name and position, constexprs by name; see ``_loader.check_launch_signature``), so a plan and a kernel that
drift apart fail at once instead of passing arguments to the wrong parameters.

Specialisation of runtime integers: Triton's launcher (torch) would mark an integer argument divisible by 16
as such, jax-triton never does, and the two would compile different kernels (16-byte vector loads and
``cp.async`` in one, 2-byte loads in the other; different code, different speed, not always the same bits).
So kernels list their integer scalars in ``do_not_specialize_on_alignment`` (both launchers then fold only
integers equal to 1, identically), and a plan that wants the compiler to know that strides are multiples of
something states it as a constexpr computed from the very values it passes (:func:`pow2_divisor`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

# dtype names are numpy-style strings so that plans stay framework-neutral.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "bool": 1}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a plan will run: a CUDA GPU (compiled) or Triton's CPU interpreter."""

    interpret: bool
    num_sms: int = 1
    # the GPU's flashbridge.tiles.GPUProfile: plans read its tiles from the tuning cache
    # (flashbridge.tiles.cache); None resolves as the H200, the reference the shipped tiles were timed on
    gpu: Any = None

    @property
    def kind(self) -> str:
        return "interpreter" if self.interpret else "cuda"


INTERPRETER = Target(interpret=True, num_sms=4)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A buffer the runtime allocates: an output, or scratch passed from one launch to the next."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    zero: bool = False  # must be zero-filled before the launch that writes it

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch. Tensors are named: plan inputs or buffers written by an earlier launch."""

    kernel: str  # "<family>.<module>:<function>", resolved by core_kernels.get_kernel
    grid: tuple[int, ...]
    inputs: tuple[str, ...]  # read-only tensors, positional
    outputs: tuple[str, ...]  # buffers this launch writes; each buffer is written by exactly one launch
    scalars: tuple[tuple[str, int | float], ...] = ()  # runtime scalars, positional after the inputs
    constexprs: tuple[tuple[str, Any], ...] = ()
    num_warps: int = 4
    num_stages: int = 2

    def scalar_values(self) -> list[int | float]:
        return [v for _, v in self.scalars]

    @functools.cached_property
    def _constexpr_dict(self) -> dict[str, Any]:
        return dict(self.constexprs)

    def constexpr_dict(self) -> dict[str, Any]:
        """The constexprs as keyword arguments (built once per Launch: plans are cached)."""
        return self._constexpr_dict

    @functools.cached_property
    def bound(self):
        """This launch bound to its kernel (``_loader.BoundLaunch``): built once per Launch, it launches
        the compiled kernel directly once Triton has compiled it for the arguments' specialisation."""
        from ._loader import BoundLaunch

        return BoundLaunch(self)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to allocate, what to launch in which order, and which buffers the op returns. Building one
    checks the buffers' flow (each read after it is written, each written once) and every launch against its
    kernel's signature."""

    inputs: tuple[str, ...]
    buffers: tuple[Spec, ...]
    launches: tuple[Launch, ...]
    results: tuple[str, ...]

    def __post_init__(self):
        names = set(self.inputs)
        for spec in self.buffers:
            if spec.name in names:
                raise ValueError(f"plan buffer {spec.name!r} is declared twice")
            names.add(spec.name)
        written: set[str] = set()
        for launch in self.launches:
            for name in launch.inputs:
                if name not in names or (name not in self.inputs and name not in written):
                    raise ValueError(f"launch {launch.kernel} reads {name!r} before anything wrote it")
            for name in launch.outputs:
                if name in self.inputs or name in written or name not in names:
                    raise ValueError(f"launch {launch.kernel} writes {name!r}, which is not a fresh buffer")
                written.add(name)
        for name in self.results:
            if name not in written:
                raise ValueError(f"plan result {name!r} is never written")
        from ._loader import check_launch_signature  # imports the kernel modules, hence triton: not at import

        for launch in self.launches:  # (names via zip: this runs for every plan a front-end builds)
            check_launch_signature(launch.kernel, len(launch.inputs), next(zip(*launch.scalars), ()),
                                   len(launch.outputs), next(zip(*launch.constexprs), ()))

    def spec(self, name: str) -> Spec:
        spec = self._specs.get(name)
        if spec is None:
            raise KeyError(name)
        return spec

    @functools.cached_property
    def _specs(self) -> dict[str, Spec]:
        return {spec.name: spec for spec in self.buffers}

    @functools.cached_property
    def runtime_state(self) -> dict:
        """What a front-end's runtime derives from this plan once (its prepared program), keyed by the
        runtime: plans are cached per shape, so the hot path reads this instead of rebuilding it."""
        return {}


def memoised(fn, maxsize: int = 1024, bypass=None):
    """``fn`` (a pure check or plan function of shapes, dtype names and options) cached on its arguments and
    on the configs active around the call (:func:`~._config.configure`): a front-end calls it once per
    distinct argument signature, and an eager call with a signature seen before skips validation and
    planning. Arguments are keyed by value and type (dict arguments, e.g. strides by name, by their items;
    values nested in tuples by equality alone); a call with an unhashable argument runs uncached. A call
    that raises is not cached (the next one raises the same error again). The wrapper counts the calls that ran ``fn`` in ``misses``; ``cache_clear()`` empties it. While ``bypass()``
    is true (torch: while ``torch.compile`` traces, which cannot trace the cache) every call runs ``fn``."""
    from ._config import _active

    cache: dict = {}
    sentinel = object()

    def key_of(args, kwargs):
        # values and their types: True == 1 == 1.0 as keys, but a check may accept one and reject another
        values = [tuple(a.items()) if type(a) is dict else a for a in (*args, *kwargs.values())]
        return (_active.get(), tuple(kwargs), *values, *map(type, values))

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if bypass is not None and bypass():
            return fn(*args, **kwargs)
        key = key_of(args, kwargs)
        try:
            result = cache.get(key, sentinel)
        except TypeError:  # an unhashable argument
            return fn(*args, **kwargs)
        if result is sentinel:
            wrapper.misses += 1
            result = fn(*args, **kwargs)
            if len(cache) >= maxsize:
                del cache[next(iter(cache))]
            cache[key] = result
        return result

    wrapper.misses = 0
    wrapper.cache_clear = cache.clear
    return wrapper


def check_float_dtype(name: str, dtype: str) -> None:
    """A TypeError naming the argument unless ``dtype`` is one the kernels take as floating input."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {dtype} is not supported; use one of {', '.join(FLOAT_DTYPES)}")


def check_real(name: str, value) -> None:
    """``value`` is a number, not None, a bool, a string or a container: a ``TypeError`` naming the argument
    before a comparison raises one that names nothing. (A denylist: torch.compile traces a float argument
    as a symbolic float, on which dynamo supports isinstance but not hasattr.)"""
    if value is None or isinstance(value, (bool, str, bytes, list, tuple, dict, set)):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__} {value!r}")


def check_int(name: str, value, what: str = "an int") -> int:
    """``value`` as an int: a Python int, a NumPy integer or a symbolic int; a float (``int()`` would
    truncate 1.7 to 1), a bool, a string or None get a ``TypeError`` naming the argument."""
    if value is None or isinstance(value, (bool, float, str, bytes)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}") from None


def fmt_shape(shape) -> str:
    return str(tuple(shape))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pow2_divisor(*values: int, cap: int = 16) -> int:
    """The largest power of two <= ``cap`` that divides every value (0 is divisible by anything; no values
    gives ``cap``). Plans pass it as a constexpr next to the runtime integers it describes."""
    div = cap
    for v in values:
        while div > 1 and v % div:
            div //= 2
    return div

