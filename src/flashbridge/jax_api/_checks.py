"""Argument checks shared by the JAX front-end's ops (shape / dtype rules live in the plans)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def check_arrays(**arrays) -> None:
    """Every given argument is a JAX array (or None)."""
    for name, a in arrays.items():
        if a is None:
            continue
        if not isinstance(a, (jax.Array, np.ndarray)) or not hasattr(a, "dtype"):
            raise TypeError(f"{name}: expected a jax.Array or None, got {type(a).__name__}")


def as_seed(seed) -> jax.Array:
    """A dropout seed as the int32 ``(1,)`` array the kernels read (traced seeds allowed)."""
    if isinstance(seed, bool):
        raise TypeError("seed: expected a Python int or an integer array of one element, got bool")
    if isinstance(seed, int):
        if not -2**31 <= seed < 2**31:
            raise ValueError(f"seed: must fit in int32, got {seed}")
        return jnp.array([seed], dtype=jnp.int32)
    if not hasattr(seed, "dtype") or not jnp.issubdtype(seed.dtype, jnp.integer) or np.size(seed) != 1:
        raise TypeError(f"seed: expected a Python int or an integer array of one element, got {seed!r}")
    return jnp.reshape(seed, (1,)).astype(jnp.int32)


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
