"""Argument checks shared by the JAX front-end's ops (shape / dtype rules live in the plans)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._forward_only import no_backward_message


def check_arrays(**arrays) -> None:
    """Every given argument is a JAX array (or None)."""
    for name, a in arrays.items():
        if a is None:
            continue
        if not isinstance(a, (jax.Array, np.ndarray)) or not hasattr(a, "dtype"):
            raise TypeError(f"{name}: expected a jax.Array or None, got {type(a).__name__}")


def check_seed(seed) -> None:
    """A dropout seed: a Python int in int32's range or an integer array of one element (checked even when
    dropout is off)."""
    if isinstance(seed, bool):
        raise TypeError("seed: expected a Python int or an integer array of one element, got bool")
    if isinstance(seed, int):
        if not -2**31 <= seed < 2**31:
            raise ValueError(f"seed: must fit in int32, got {seed}")
        return
    if not hasattr(seed, "dtype") or not jnp.issubdtype(seed.dtype, jnp.integer) or np.size(seed) != 1:
        raise TypeError(f"seed: expected a Python int or an integer array of one element, got {seed!r}")


def as_seed(seed) -> jax.Array | np.ndarray:
    """A dropout seed as the int32 ``(1,)`` array the kernels read (traced seeds allowed; a Python int gives a
    host array, a constant in any trace). A 64-bit seed inside int32's range keeps its value; others get
    their high word mixed into the low one (the torch front-end's ``fold_seed``, the same bits), so that 2**40
    is not seed 0."""
    check_seed(seed)
    if isinstance(seed, int):
        return np.array([seed], dtype=np.int32)
    seed = jnp.reshape(seed, (1,))
    if jnp.dtype(seed.dtype).itemsize <= 4:
        return seed.astype(jnp.int32)
    seed = seed.astype(jnp.int64)
    lo = seed.astype(jnp.int32)
    extra = (seed >> 32) - (lo >> 31).astype(jnp.int64)  # 0 exactly when the value fits in int32
    mix = extra * jnp.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15 as an int64
    mix = ((mix ^ (mix >> 32)) & 0xFFFFFFFF) | 1  # odd, so never 0 where extra is not
    return lo ^ jnp.where(extra == 0, 0, mix).astype(jnp.int32)


def seed_argument(seed):
    """A seed as an argument of a jitted op, which then applies :func:`as_seed`: a Python int becomes its
    host array here (as a dynamic argument it would be traced as a scalar, not as the constant it is), an
    array passes as it is (converting it here would dispatch its ops eagerly)."""
    return as_seed(seed) if isinstance(seed, int) else seed


def host_list(a):
    """The values of an index array as a flat list when reading them is free (a numpy array, or a concrete
    array on the CPU), else None: traced or device-resident arrays are not read (no device sync)."""
    if a is None or isinstance(a, jax.core.Tracer):
        return None
    if not isinstance(a, np.ndarray):
        try:
            if any(d.platform != "cpu" for d in a.devices()):
                return None
        except Exception:  # noqa: BLE001 -- anything unusual: do not read it
            return None
    return np.asarray(a).reshape(-1).tolist()


class _ForwardOnly:
    """A forward-only op's name and body: the static argument of :func:`_no_backward` (hashed by identity)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _no_backward(op, *args):
    return op.fn(*args)


def _no_backward_fwd(op, *args):
    values = jax.tree_util.tree_map(lambda a: a.value, args)
    return op.fn(*values), tuple(None for _ in args)  # residuals: only the number of arguments


def _no_backward_bwd(op, none_per_arg, cotangents):
    if all(isinstance(c, jax.custom_derivatives.SymbolicZero) for c in jax.tree_util.tree_leaves(cotangents)):
        return none_per_arg  # the outputs do not reach the loss: zero gradients, nothing lost
    raise NotImplementedError(no_backward_message(op.name))


_no_backward.defvjp(_no_backward_fwd, _no_backward_bwd, symbolic_zeros=True)


def forward_only(name: str, fn, *args):
    """``fn(*args)`` (arrays or None) for the forward-only op ``name``: ``jax.grad`` / ``jax.vjp`` through
    it fail while they trace, naming the op (forward-mode ``jax.jvp`` gets JAX's own custom_vjp error).
    Concrete arrays cannot be differentiated: they call ``fn`` directly, at no cost."""
    if not any(isinstance(a, jax.core.Tracer) for a in jax.tree_util.tree_leaves(args)):
        return fn(*args)
    return _no_backward(_ForwardOnly(name, fn), *args)
