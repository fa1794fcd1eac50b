"""Context-parallel (ring) attention for JAX, inside ``shard_map``: the sequence is sharded over a mesh
axis, and K/V shards travel around the ring (``jax.lax.ppermute``) while each device computes its queries
against the shard in hand.

The same structure as the torch front-end (torch_api/ring.py): a ``jax.custom_vjp`` whose forward merges
each block's partial (out, lse) into a float32 accumulator with the merge kernel, and whose backward runs
the flash_attention backward kernels per block with the final out / lse, dK / dV accumulating in float32
and travelling with their K / V back to their owner. Each step's transfer does not depend on the step's
compute, so XLA runs the two side by side.

The device's position on the axis is a traced value (``axis_index``), while which blocks a step computes
depends on it: each step's distinct per-device plans become the branches of one ``lax.switch`` (one
branch for every step of a causal zigzag or contiguous ring: the plans differ only in whether the block
in hand lies before or after the device's own chunks).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from .. import _sequence_layout as layout_mod
from ..core_kernels.decode.plan import plan_merge_into
from ..core_kernels.flash_attn.plan import AttnOptions, check_attention_args
from ._checks import check_arrays
from ._runtime import dtype_name, execute, match_varying
from .attention import _bwd_op, _fwd_op, _Static

Array = jax.Array

__all__ = ["ring_attention", "sequence_shard", "sequence_unshard"]


# ----------------------------------------------------------------------------------------------- layouts

def _check_dim(x, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected a Python int, got {type(dim).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim: {dim} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.ndim


def _concat(pieces, dim):
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=dim)


def sequence_shard(x: Array, rank, world_size: int, *, layout: str = "zigzag", dim: int = 1) -> Array:
    """The part of the sequence (along ``dim``) that rank ``rank`` of ``world_size`` holds for
    :func:`ring_attention`: ``"contiguous"`` tokens ``[r S/n, (r+1) S/n)``; ``"zigzag"`` chunks r and
    2n-1-r of 2n (balanced causal work). ``rank`` is a Python int, or an integer scalar array (e.g.
    ``jax.lax.axis_index`` inside shard_map; a traced rank is not range-checked). ``x.shape[dim]`` must be a
    multiple of n (contiguous) or 2n (zigzag).

    A global array laid out for shard_map: ``jnp.concatenate([sequence_shard(x, r, n) for r in range(n)],
    axis=1)`` sharded with ``P(None, axis_name)`` puts shard r on device r.

    Example::

        >>> x = jnp.arange(8).reshape(1, 8)
        >>> sequence_shard(x, 0, 2)
        Array([[0, 1, 6, 7]], dtype=int32)
    """
    check_arrays(x=x)
    if x is None:
        raise TypeError("x: expected a jax.Array, got None")
    dim = _check_dim(x, dim)
    layout_mod.check_layout(layout)
    world_size = layout_mod.check_world_size(world_size)
    chunk = layout_mod.check_divisible("x", x.shape[dim], world_size, layout, f"the length along dim {dim}")
    if isinstance(rank, (jax.Array, np.ndarray)) and not isinstance(rank, jax.core.Tracer):
        if rank.shape != () or not jnp.issubdtype(rank.dtype, jnp.integer):
            raise TypeError(f"rank: expected a Python int or an integer scalar array, got {rank.dtype}{rank.shape}")
        rank = int(rank)
    if isinstance(rank, jax.core.Tracer):
        if rank.shape != () or not jnp.issubdtype(rank.dtype, jnp.integer):
            raise TypeError(f"rank: expected a Python int or an integer scalar array, got {rank.dtype}{rank.shape}")
        starts = [rank * chunk] if layout == "contiguous" else [rank * chunk, (2 * world_size - 1 - rank) * chunk]
        return _concat([jax.lax.dynamic_slice_in_dim(x, s, chunk, axis=dim) for s in starts], dim)
    rank = layout_mod.check_rank(rank, world_size)
    ranges = layout_mod.shard_ranges(x.shape[dim], rank, world_size, layout)
    return _concat([jax.lax.slice_in_dim(x, a, b, axis=dim) for a, b in ranges], dim)


def sequence_unshard(x: Array, world_size: int, *, layout: str = "zigzag", dim: int = 1) -> Array:
    """The sequence in global order from ``x``, the concatenation along ``dim`` of all ranks' shards (rank 0
    first; e.g. a shard_map output with ``P(None, axis_name)``): the inverse of :func:`sequence_shard`.

    Example::

        >>> x = jnp.arange(8).reshape(1, 8)
        >>> both = jnp.concatenate([sequence_shard(x, r, 2) for r in range(2)], axis=1)
        >>> bool((sequence_unshard(both, 2) == x).all())
        True
    """
    check_arrays(x=x)
    if x is None:
        raise TypeError("x: expected a jax.Array, got None")
    dim = _check_dim(x, dim)
    layout_mod.check_layout(layout)
    world_size = layout_mod.check_world_size(world_size)
    layout_mod.check_divisible("x", x.shape[dim], world_size, layout, f"the length along dim {dim}")
    ranges = layout_mod.unshard_ranges(x.shape[dim], world_size, layout)
    return _concat([jax.lax.slice_in_dim(x, a, b, axis=dim) for a, b in ranges], dim)


# ------------------------------------------------------------------------------------------------- ring

@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything static about a call (hashable: the custom_vjp's nondiff argument)."""

    axis_name: object
    world: int
    layout: str
    seqlen: int  # local
    window_left: Optional[int]
    window_right: Optional[int]
    softmax_scale: float

    @functools.cached_property
    def cases(self) -> tuple[tuple[tuple[layout_mod.RingSteps, ...], tuple[int, ...]], ...]:
        """Per step: (the distinct plans of that step over the devices, each device's plan index)."""
        schedule = layout_mod.ring_schedule(self.seqlen, self.world, self.layout, self.window_left,
                                            self.window_right)
        cases = []
        for i in range(len(schedule[0])):
            plans = []
            for steps in schedule:
                if steps[i] not in plans:
                    plans.append(steps[i])
            cases.append((tuple(plans), tuple(plans.index(steps[i]) for steps in schedule)))
        return tuple(cases)

    def static(self, call: layout_mod.BlockCall) -> _Static:
        options = AttnOptions(softmax_scale=self.softmax_scale, causal=call.causal, window_left=call.window_left,
                              window_right=call.window_right, softcap=0.0, has_alibi=False, alibi_batched=False,
                              has_sinks=False)
        return _Static(options, None, None)


def _switch(spec: _Spec, step: int, branch, *operands):
    """Run ``branch(plan, *operands)`` with this device's plan for ``step``."""
    plans, which = spec.cases[step]
    if len(plans) == 1:
        return branch(plans[0], *operands)
    index = jnp.asarray(which, jnp.int32)[jax.lax.axis_index(spec.axis_name)]
    return jax.lax.switch(index, [functools.partial(branch, plan) for plan in plans], *operands)


def _shift(tree, spec: _Spec, by: int):
    """Send to the device ``by`` places further along the axis (receive from ``by`` places back)."""
    n = spec.world
    return jax.lax.ppermute(tree, spec.axis_name, [(j, (j + by) % n) for j in range(n)])


def _rows(a, start, stop, axis=1):
    return a if start == 0 and stop == a.shape[axis] else jax.lax.slice_in_dim(a, start, stop, axis=axis)


def _merge_rows(acc, acc_lse, part, part_lse):
    """(acc (B, L, H, Dv) f32, acc_lse (B, L, H)) merged with (part, part_lse (B, L, H)) by the merge kernel."""
    b, length, h, dv = part.shape
    rows = b * length * h

    def make_plan(target):
        return plan_merge_into(rows, dv, "float32", target=target)

    given = {"acc_out": acc.reshape(rows, dv), "acc_lse": acc_lse.reshape(rows),
             "part_out": part.reshape(rows, dv), "part_lse": part_lse.reshape(rows)}
    out, lse = execute(make_plan, dict(zip(given, match_varying(*given.values()))), aliases={"out": "acc_out"})
    return out.reshape(b, length, h, dv), lse.reshape(b, length, h)


def _set_rows(a, start, stop, value):
    if start == 0 and stop == a.shape[1]:
        return value
    return jax.lax.dynamic_update_slice_in_dim(a, value, start, axis=1)


def _empty_state(q, dv):
    b, s, h, _ = q.shape
    acc = match_varying(jnp.zeros((b, s, h, dv), jnp.float32), q)[0]
    return acc, match_varying(jnp.full((b, s, h), -jnp.inf, jnp.float32), q)[0]


def _fwd_step(spec: _Spec, calls, state, q, k, v):
    """Fold this step's calls into the (acc, acc_lse) state (None before the first step)."""
    for c in calls:
        part, part_lse = _fwd_op(spec.static(c))(_rows(q, c.q_start, c.q_stop), _rows(k, c.k_start, c.k_stop),
                                                 _rows(v, c.k_start, c.k_stop), None, None, None, None)
        part_lse = jnp.swapaxes(part_lse, 1, 2)  # (B, L, Hq): the merge kernel's row order, as out's
        if state is None:
            if not c.merge and c.q_start == 0 and c.q_stop == spec.seqlen:
                state = (part.astype(jnp.float32), part_lse)
                continue
            state = _empty_state(q, v.shape[-1])
        acc, acc_lse = state
        if c.merge:
            part, part_lse = _merge_rows(_rows(acc, c.q_start, c.q_stop), _rows(acc_lse, c.q_start, c.q_stop),
                                         part, part_lse)
        state = (_set_rows(acc, c.q_start, c.q_stop, part.astype(jnp.float32)),
                 _set_rows(acc_lse, c.q_start, c.q_stop, part_lse))
    return state if state is not None else _empty_state(q, v.shape[-1])


def _ring_forward(q, k, v, spec: _Spec):
    state = None
    kv = (k, v)
    n_steps = len(spec.cases)
    for i in range(n_steps):
        # the next shard's transfer depends only on the one in hand: XLA overlaps it with this step
        next_kv = _shift(kv, spec, 1) if i + 1 < n_steps else None
        state = _switch(spec, i, functools.partial(_fwd_step, spec), state, q, *kv)
        kv = next_kv
    acc, acc_lse = state
    return acc.astype(q.dtype), jnp.swapaxes(acc_lse, 1, 2)


def _bwd_step(spec: _Spec, calls, dq, dout, q, k, v, out, lse, dlse):
    """dq (float32) updated with this step's blocks, and the blocks' dK / dV (float32, k / v shaped)."""
    dk = match_varying(jnp.zeros(k.shape, jnp.float32), q)[0]
    dv = match_varying(jnp.zeros(v.shape, jnp.float32), q)[0]
    for c in calls:
        rows, keys = (c.q_start, c.q_stop), (c.k_start, c.k_stop)
        dq_p, dk_p, dv_p, *_ = _bwd_op(spec.static(c))(
            _rows(dout, *rows), _rows(q, *rows), _rows(k, *keys), _rows(v, *keys), _rows(out, *rows),
            _rows(lse, *rows, axis=2), _rows(dlse, *rows, axis=2), None, None, None, None)
        dq = _add_rows(dq, *rows, dq_p)
        dk = _add_rows(dk, *keys, dk_p)
        dv = _add_rows(dv, *keys, dv_p)
    return dq, dk, dv


def _add_rows(acc, start, stop, part):
    if start == 0 and stop == acc.shape[1]:
        return acc + part.astype(jnp.float32)
    return acc.at[:, start:stop].add(part.astype(jnp.float32))


def _ring_backward(spec: _Spec, dout, dlse, q, k, v, out, lse):
    dq = match_varying(jnp.zeros(q.shape, jnp.float32), q)[0]
    kv = (k, v)
    dkv = None  # the accumulated dK / dV of the shard in hand
    n_steps = len(spec.cases)
    for i in range(n_steps):
        next_kv = _shift(kv, spec, 1) if i + 1 < n_steps else None
        dq, dk, dv = _switch(spec, i, functools.partial(_bwd_step, spec), dq, dout, q, *kv, out, lse, dlse)
        dkv = (dk, dv) if dkv is None else (dkv[0] + dk, dkv[1] + dv)
        if i + 1 < n_steps:
            dkv = _shift(dkv, spec, 1)
        kv = next_kv
    if n_steps > 1:  # the dK / dV in hand belong to the device n_steps - 1 places back
        dkv = _shift(dkv, spec, -(n_steps - 1))
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, spec):
    return _ring_forward(q, k, v, spec)


def _ring_fwd(q, k, v, spec):
    out, lse = _ring_forward(q, k, v, spec)
    return (out, lse), (q, k, v, out, lse)


def _ring_bwd(spec, saved, cotangents):
    q, k, v, out, lse = saved
    dout, dlse = cotangents
    return _ring_backward(spec, dout.astype(out.dtype), dlse, q, k, v, out, lse)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _info(a):
    return (tuple(a.shape), dtype_name(a.dtype))


def ring_attention(q: Array, k: Array, v: Array, *, axis_name, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                   layout: str = "zigzag", return_lse: bool = False) -> Union[Array, tuple[Array, Array]]:
    """Attention over a sequence sharded along the mesh axis ``axis_name`` of an enclosing ``shard_map``:
    equal to :func:`flash_attention` on the gathered sequence (to rounding), forward and backward, without
    gathering it. Call it inside the shard_map'd function, on the local shards.

    Args:
        q: the local queries ``(B, S_local, Hq, Dqk)``, the shard :func:`sequence_shard` gives for this
            device's index along ``axis_name`` (``layout``); float16, bfloat16 or float32.
        k, v: local keys / values ``(B, S_local, Hkv, Dqk)`` / ``(B, S_local, Hkv, Dv)``, ``Hq`` a multiple
            of ``Hkv`` (GQA / MQA).
        axis_name: the shard_map mesh axis over which the sequence is sharded.
        causal, softmax_scale, window_size: as :func:`flash_attention`, over global positions.
        layout: ``"zigzag"`` (balanced causal work; S_local even) or ``"contiguous"``.
        return_lse: also return the float32 lse ``(B, Hq, S_local)`` of the local queries (differentiable).

    K / V (and in the backward float32 dK / dV) move one device along the axis per step with
    ``jax.lax.ppermute``, n - 1 times (fewer when a sliding window ends the ring early).

    Returns:
        ``out`` ``(B, S_local, Hq, Dv)`` in q's dtype, or ``(out, lse)``.

    Example (q, k, v global ``(B, S, H, D)`` arrays, n devices)::

        mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("sp",))
        spec = jax.sharding.PartitionSpec(None, "sp")
        ring = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", causal=True),
                             mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        zigzag = lambda x: jnp.concatenate([sequence_shard(x, r, n) for r in range(n)], axis=1)
        out = sequence_unshard(jax.jit(ring)(zigzag(q), zigzag(k), zigzag(v)), n)  # == flash_attention
    """
    check_arrays(q=q, k=k, v=v)
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a is None:
            raise TypeError(f"{name}: expected a jax.Array, got None")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    layout_mod.check_layout(layout)
    shape, options = check_attention_args(q=_info(q), k=_info(k), v=_info(v), causal=causal,
                                          softmax_scale=softmax_scale, window_size=window_size)
    if shape.seqlen_k != shape.seqlen_q:
        raise ValueError(f"q, k: the local shards must have the same length, got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    layout_mod.check_local_length("q", shape.seqlen_q, layout)
    try:
        world = int(jax.lax.axis_size(axis_name))
    except (NameError, KeyError, ValueError) as e:
        raise ValueError(f"axis_name: {axis_name!r} is not a mesh axis of an enclosing shard_map "
                         f"(ring_attention runs inside shard_map): {e}") from None
    spec = _Spec(axis_name, world, layout, shape.seqlen_q, options.window_left, options.window_right,
                 float(options.softmax_scale))
    out, lse = _ring(*match_varying(q, k, v), spec)
    return (out, lse) if return_lse else out
