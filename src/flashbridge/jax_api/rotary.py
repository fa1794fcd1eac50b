"""Rotary position embeddings for JAX: a ``jax.custom_vjp`` op whose kernel calls carry ``custom_vmap`` rules.

The same kernel as the torch front-end; jit, grad and vmap work. The backward is the same kernel rotating
the other way (``sin`` negated); ``cos`` / ``sin`` get no gradient (zero), as in flash-attn. Under vmap the
mapped axis is folded into the batch (one launch) unless the tables or the sequence boundaries are mapped
too, or x is packed: then one launch per example.

``inplace=True``: the outputs take over the buffers of x (and k) through jax-triton's
``input_output_aliases``, so under ``jax.jit(..., donate_argnums=...)`` a GPU rotates x where it lies and
no output is allocated (without donation XLA copies x first); the pass-through dims are then not rewritten.
On the CPU the result is a new array. The backward then updates the output's cotangent in place the same
way.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from ..core_kernels.rotary.plan import check_rotary_args, check_rotary_values, plan_rotary
from ._checks import check_arrays, host_list
from ..core_kernels._plan import memoised
from ._runtime import dtype_name, execute, jit_op, match_varying

Array = jax.Array

# validation and plans run once per distinct argument signature (see memoised)
check_rotary_args, plan_rotary = memoised(check_rotary_args), memoised(plan_rotary)


def _info(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


def _call(x, k, cos, sin, position_ids, cu_seqlens, *, interleaved, conjugate, inplace):
    shape = check_rotary_args(x=_info(x), k=_info(k), cos=_info(cos), sin=_info(sin),
                              position_ids=_info(position_ids), cu_seqlens=_info(cu_seqlens))

    def make_plan(target):
        return plan_rotary(shape, dtype=dtype_name(x.dtype), interleaved=interleaved, conjugate=conjugate,
                           inplace=inplace, target=target)

    given = {"x": x, "k": k, "cos": cos, "sin": sin, "position_ids": position_ids, "cu_seqlens": cu_seqlens}
    aliases = ({"out": "x", **({"out_k": "k"} if k is not None else {})}) if inplace else None
    return execute(make_plan, {n: a for n, a in given.items() if a is not None}, aliases=aliases)


def _is_batched(flag) -> bool:
    return any(jax.tree_util.tree_leaves(flag))


@functools.lru_cache(maxsize=None)
def _op(interleaved: bool, conjugate: bool, inplace: bool):
    call = functools.partial(_call, interleaved=interleaved, conjugate=conjugate, inplace=inplace)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, x, k, cos, sin, position_ids, cu_seqlens):
        args = (x, k, cos, sin, position_ids, cu_seqlens)
        mapped = [_is_batched(b) for b in in_batched]
        out_batched = (True,) * (1 if k is None else 2)

        def expand(a, m):
            return a if a is None or m else jnp.broadcast_to(a, (axis_size, *a.shape))

        packed = (x.ndim - mapped[0]) == 3
        if packed or mapped[2] or mapped[3] or mapped[5]:
            # per-example tables or sequence boundaries, or packed tokens: one launch per example
            outs = jax.lax.map(lambda a: call(*a), tuple(expand(a, m) for a, m in zip(args, mapped)))
            return outs, out_batched
        # (N, B, S, H, D) -> (N * B, S, H, D): the mapped axis becomes more sequences
        x, k = expand(x, mapped[0]), expand(k, mapped[1])
        batch = x.shape[1]
        fold = lambda a: None if a is None else a.reshape(axis_size * batch, *a.shape[2:])  # noqa: E731
        if position_ids is not None:
            if mapped[4]:  # (N, B or 1, S)
                position_ids = jnp.broadcast_to(position_ids, (axis_size, batch, position_ids.shape[-1]))
                position_ids = fold(position_ids)
            elif position_ids.shape[0] != 1:  # (B, S) for every example; (1, S) broadcasts as it is
                position_ids = jnp.tile(position_ids, (axis_size, 1))
        outs = call(fold(x), fold(k), cos, sin, position_ids, None)
        return tuple(o.reshape(axis_size, batch, *o.shape[1:]) for o in outs), out_batched

    return op


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _rotary(x, k, cos, sin, position_ids, cu_seqlens, interleaved, inplace):
    return _op(interleaved, False, inplace)(x, k, cos, sin, position_ids, cu_seqlens)


def _rotary_fwd(x, k, cos, sin, position_ids, cu_seqlens, interleaved, inplace):
    out = _op(interleaved, False, inplace)(x, k, cos, sin, position_ids, cu_seqlens)
    return out, (cos, sin, position_ids, cu_seqlens)  # a rotation: x itself is not needed


def _rotary_bwd(interleaved, inplace, saved, cotangents):
    cos, sin, position_ids, cu_seqlens = saved
    dk_out = cotangents[1] if len(cotangents) > 1 else None
    grads = _op(interleaved, True, inplace)(cotangents[0], dk_out, cos, sin, position_ids, cu_seqlens)
    return grads[0], (grads[1] if dk_out is not None else None), None, None, None, None


_rotary.defvjp(_rotary_fwd, _rotary_bwd)


def _apply(x, k, cos, sin, *, interleaved, inplace, position_ids, cu_seqlens):
    x_name = "x" if k is None else "q"
    check_arrays(**{x_name: x}, k=k, cos=cos, sin=sin, position_ids=position_ids, cu_seqlens=cu_seqlens)
    for name, a in ((x_name, x), ("cos", cos), ("sin", sin)):
        if a is None:
            raise TypeError(f"{name}: expected a jax.Array, got None")
    shape = check_rotary_args(x=_info(x), k=_info(k), cos=_info(cos), sin=_info(sin), position_ids=_info(position_ids),
                              cu_seqlens=_info(cu_seqlens), x_name=x_name)
    host = {n: host_list(a) for n, a in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens))}
    if any(v is not None for v in host.values()):
        check_rotary_values(shape, **host)
    return _rotary_op(x, k, cos, sin, position_ids, cu_seqlens, interleaved=bool(interleaved), inplace=bool(inplace))


@jit_op("interleaved", "inplace")
def _rotary_op(x, k, cos, sin, position_ids, cu_seqlens, *, interleaved, inplace):
    x, k, cos, sin, position_ids, cu_seqlens = match_varying(x, k, cos, sin, position_ids, cu_seqlens)
    outs = _rotary(x, k, cos, sin, position_ids, cu_seqlens, interleaved, inplace)
    return outs[0] if k is None else outs


def rotary_embedding(x: Array, cos: Array, sin: Array, *, interleaved: bool = False, inplace: bool = False,
                     position_ids: Optional[Array] = None, cu_seqlens: Optional[Array] = None) -> Array:
    """Rotary position embedding (RoPE) of the first ``rotary_dim = 2 * cos.shape[1]`` dims of every head,
    as flash-attn's ``apply_rotary_emb``; the other dims pass through unchanged.

    For position p and pair i: ``(y_a, y_b) = (x_a cos[p, i] - x_b sin[p, i], x_b cos[p, i] + x_a sin[p, i])``,
    ``(a, b) = (i, i + rotary_dim / 2)`` (GPT-NeoX / Llama halves) or ``(2i, 2i + 1)`` with ``interleaved``
    (GPT-J pairs). Computed in float32, returned in x's dtype. See
    :func:`flashbridge.torch_api.rotary_embedding` for every argument.

    Args:
        x: ``(B, S, H, D)`` or packed ``(T, H, D)``.
        cos, sin: ``(S_rot, rotary_dim / 2)``; no gradient.
        inplace: the result takes over x's buffer (see the module docstring): donate x under jit to rotate it
            without a new buffer on a GPU.
        position_ids: ``(B, S)`` / ``(1, S)`` (``(T,)`` packed) integer positions, or None.
        cu_seqlens: int32 ``(N + 1,)`` boundaries of a packed x: positions restart in every sequence. No
            ``max_seqlen`` is needed (nothing about the grid depends on the values).

    Example::

        >>> from flashbridge.reference.rotary import cos_sin_table
        >>> cos, sin = (jnp.asarray(t, jnp.float32) for t in cos_sin_table(128, 64))
        >>> q = jnp.ones((2, 100, 4, 64))
        >>> rotary_embedding(q, cos, sin).shape
        (2, 100, 4, 64)
        >>> y = rotary_embedding(q[0], cos, sin, cu_seqlens=jnp.array([0, 100], jnp.int32))
        >>> bool(jnp.array_equal(y, rotary_embedding(q, cos, sin)[0]))
        True
    """
    return _apply(x, None, cos, sin, interleaved=interleaved, inplace=inplace, position_ids=position_ids,
                  cu_seqlens=cu_seqlens)


def rotary_embedding_qk(q: Array, k: Array, cos: Array, sin: Array, *, interleaved: bool = False,
                        inplace: bool = False, position_ids: Optional[Array] = None,
                        cu_seqlens: Optional[Array] = None) -> tuple[Array, Array]:
    """:func:`rotary_embedding` of q ``(..., Hq, D)`` and k ``(..., Hk, D)`` (the same tokens) in one launch.

    Example::

        >>> from flashbridge.reference.rotary import cos_sin_table
        >>> cos, sin = (jnp.asarray(t, jnp.float32) for t in cos_sin_table(64, 32))
        >>> q, k = jnp.ones((1, 64, 8, 32)), jnp.ones((1, 64, 2, 32))
        >>> q2, k2 = rotary_embedding_qk(q, k, cos, sin)
        >>> bool(jnp.array_equal(k2, rotary_embedding(k, cos, sin)))
        True
    """
    if k is None:
        raise TypeError("k: expected a jax.Array, got None (use rotary_embedding for one array)")
    return _apply(q, k, cos, sin, interleaved=interleaved, inplace=inplace, position_ids=position_ids,
                  cu_seqlens=cu_seqlens)
