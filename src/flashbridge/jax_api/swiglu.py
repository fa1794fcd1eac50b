"""SwiGLU for JAX: a ``jax.custom_vjp`` op whose kernel calls carry ``custom_vmap`` rules.

The same two kernels as the torch front-end; jit, grad and vmap work (under vmap the mapped axis is one
more row dimension: one launch). The backward saves only the inputs and recomputes the sigmoid.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..core_kernels.swiglu.plan import check_swiglu_args, plan_swiglu_bwd, plan_swiglu_fwd
from ._checks import check_arrays
from ..core_kernels._plan import memoised
from ._runtime import dtype_name, execute, jit_op, match_varying

Array = jax.Array

# validation and plans run once per distinct argument signature (see memoised)
check_swiglu_args, plan_swiglu_fwd, plan_swiglu_bwd = map(
    memoised, (check_swiglu_args, plan_swiglu_fwd, plan_swiglu_bwd))


def _width(gate, up):
    return gate.shape[-1] // 2 if up is None else gate.shape[-1]


def _fwd_call(gate, up):
    n_cols = _width(gate, up)
    n_rows = gate.size // gate.shape[-1]
    fused = up is None

    def make_plan(target):
        return plan_swiglu_fwd(n_rows, n_cols, dtype=dtype_name(gate.dtype), fused=fused, target=target)

    (y,) = execute(make_plan, {"x": gate} if fused else {"gate": gate, "up": up})
    return y.reshape(*gate.shape[:-1], n_cols)


def _bwd_call(dy, gate, up):
    n_cols = _width(gate, up)
    n_rows = gate.size // gate.shape[-1]
    fused = up is None

    def make_plan(target):
        return plan_swiglu_bwd(n_rows, n_cols, dtype=dtype_name(gate.dtype), fused=fused, target=target)

    grads = execute(make_plan, {"dy": dy, "x": gate} if fused else {"dy": dy, "gate": gate, "up": up})
    return tuple(g.reshape(gate.shape) for g in grads)


def _elementwise_vmap(call):
    """``call`` with a custom_vmap rule: every row-local input gets the mapped axis in front (broadcast where
    it is not mapped), which the kernels treat as one more leading row dimension."""
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if a is None or b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        out = call(*args)
        return out, jax.tree.map(lambda _: True, out)

    return op


_fwd_op = _elementwise_vmap(_fwd_call)
_bwd_op = _elementwise_vmap(_bwd_call)


@jax.custom_vjp
def _swiglu(gate, up):
    return _fwd_op(gate, up)


def _swiglu_fwd(gate, up):
    return _fwd_op(gate, up), (gate, up)


def _swiglu_bwd(saved, dy):
    gate, up = saved
    grads = _bwd_op(dy.astype(gate.dtype), gate, up)
    return grads if up is not None else (grads[0], None)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def swiglu(gate: Array, up: Optional[Array] = None) -> Array:
    """SwiGLU: ``silu(gate) * up``, or of one fused projection ``x = [gate | up]`` when ``up`` is None.

    Computed in float32, returned in the inputs' dtype; the backward recomputes the activation from the
    saved inputs. See :func:`flashbridge.torch_api.swiglu`.

    Args:
        gate: ``(..., I)`` float32 / float16 / bfloat16; without ``up``, ``(..., 2I)`` whose first half is the
            gate and second half the up projection (a fused ``gate_up_proj``).
        up: ``(..., I)``, gate's shape and dtype, or None.

    Example::

        >>> gate, up = jnp.ones((4, 96)), jnp.full((4, 96), 2.0)
        >>> swiglu(gate, up).shape
        (4, 96)
        >>> bool(jnp.array_equal(swiglu(jnp.concatenate([gate, up], axis=-1)), swiglu(gate, up)))
        True
    """
    check_arrays(gate=gate, up=up)
    if gate is None:
        raise TypeError("gate: expected a jax.Array, got None")
    check_swiglu_args(gate=(tuple(gate.shape), dtype_name(gate.dtype)),
                      up=None if up is None else (tuple(up.shape), dtype_name(up.dtype)))
    return _swiglu_op(gate, up)


@jit_op()
def _swiglu_op(gate, up):
    return _swiglu(*match_varying(gate, up))
