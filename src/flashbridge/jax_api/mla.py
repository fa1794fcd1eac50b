"""MLA (DeepSeek latent attention, absorbed form) for JAX: the same kernels and plans as the torch front-end.

``mla_attention`` is a ``jax.custom_vjp`` op (gradients for q and kv) whose kernel calls carry
``custom_vmap`` rules (the mapped axis folds into the batch: one launch); with a ``block_mask`` a second
one whose mask arrays travel as pytree leaves (see jax_api/block_sparse.py); ``mla_decode`` runs its plan
directly (forward only). Both work under ``jax.jit``. Index values (``indices``, ``cache_seqlens``,
``block_table``) are validated when they are concrete host arrays; traced or device-resident ones are not
read, and the kernels clamp every access so that a bad value never leaves the arrays.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..core_kernels import INTERPRETER
from .. import masks as _masks
from ..core_kernels.block_sparse.plan import layout_of
from ..core_kernels.decode.plan import check_scale_values
from ..core_kernels.mla.plan import (check_decode_values, check_index_values, check_mla_args, check_mla_block_mask,
                                     check_mla_decode_args, plan_mla_bwd, plan_mla_fwd)
from . import block_sparse as _bs
from ._checks import check_arrays, forward_only
from ._runtime import dtype_name, execute, jit_op, match_varying

Array = jax.Array


def _info(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


def _host(a):
    """A concrete host array's values (numpy), else None (traced, or on a device: reading would sync)."""
    if a is None or isinstance(a, jax.core.Tracer):
        return None
    if isinstance(a, np.ndarray):
        return a
    try:
        if all(d.platform == "cpu" for d in a.devices()):
            return np.asarray(a)
    except Exception:  # noqa: BLE001 -- anything unusual: do not read it
        pass
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about an mla_attention call that is not an array (a custom_vjp nondiff argument)."""

    head_dim_v: int
    softmax_scale: float
    causal: bool


def _shape(static: _Static, q, kv, indices):
    return check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=static.head_dim_v, causal=static.causal,
                          softmax_scale=static.softmax_scale, indices=_info(indices))


def _fwd_call(q, kv, indices, *, static: _Static):
    shape, options = _shape(static, q, kv, indices)
    given = {"q": q, "kv": kv, "indices": indices}
    return execute(lambda target: plan_mla_fwd(shape, options, target=target),
                   {n: a for n, a in given.items() if a is not None})


def _bwd_call(dout, q, kv, out, lse, dlse, indices, *, static: _Static):
    shape, options = _shape(static, q, kv, indices)
    given = {"dout": dout, "q": q, "kv": kv, "out": out, "lse": lse, "dlse": dlse, "indices": indices}
    return execute(lambda target: plan_mla_bwd(shape, options, target=target, has_dlse=dlse is not None),
                   {n: a for n, a in given.items() if a is not None})


def _fold(a):
    return None if a is None else a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _batched(axis_size, args, in_batched):
    return [a if a is None or b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]


def _vmapped(call):
    """custom_vmap of a call whose array arguments and results all lead with the batch: the mapped axis
    folds into it (one launch)."""
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = _batched(axis_size, args, [f is True for f in in_batched])
        outs = call(*[_fold(a) for a in args])
        return tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs), \
            tuple(True for _ in outs)

    return op


@functools.lru_cache(maxsize=None)
def _fwd_op(static: _Static):
    return _vmapped(functools.partial(_fwd_call, static=static))


@functools.lru_cache(maxsize=None)
def _bwd_op(static: _Static):
    return _vmapped(functools.partial(_bwd_call, static=static))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mla(q, kv, indices, static):
    return _fwd_op(static)(q, kv, indices)


def _mla_fwd(q, kv, indices, static):
    out, lse = _fwd_op(static)(q, kv, indices)
    return (out, lse), (q, kv, out, lse, indices)


def _mla_bwd(static, saved, cotangents):
    q, kv, out, lse, indices = saved
    dout, dlse = cotangents
    dq, dkv = _bwd_op(static)(dout.astype(out.dtype), q, kv, out, lse, dlse, indices)
    return dq, dkv, None


_mla.defvjp(_mla_fwd, _mla_bwd)


# ---------------------------------------------------------------------------------------- block masks

@dataclasses.dataclass(frozen=True)
class _MaskStatic:
    """An mla_attention call with a block mask: what is not an array (a custom_vjp nondiff argument)."""

    head_dim_v: int
    softmax_scale: float
    seq_len_q: int
    seq_len_k: int
    q_block: int
    kv_block: int
    terms: _masks.MaskTerms


def _mask_problem(static: _MaskStatic, q, kv, mask_arrays):
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=static.head_dim_v,
                                    softmax_scale=static.softmax_scale)
    mask = _bs._unflatten((static.seq_len_q, static.seq_len_k, static.q_block, static.kv_block, static.terms),
                          mask_arrays)
    return shape, options, layout_of(mask)


def _mask_fwd_call(q, kv, mask_arrays, *, static: _MaskStatic):
    shape, options, layout = _mask_problem(static, q, kv, mask_arrays)
    given = {"q": q, "kv": kv, **dict(zip(_masks.BlockMask.array_names, mask_arrays))}
    return execute(lambda target: plan_mla_fwd(shape, options, target=target, sparse=layout),
                   {n: a for n, a in given.items() if a is not None})


def _mask_bwd_call(dout, q, kv, out, lse, dlse, mask_arrays, *, static: _MaskStatic):
    shape, options, layout = _mask_problem(static, q, kv, mask_arrays)
    given = {"dout": dout, "q": q, "kv": kv, "out": out, "lse": lse, "dlse": dlse,
             **dict(zip(_masks.BlockMask.array_names, mask_arrays))}
    return execute(lambda target: plan_mla_bwd(shape, options, target=target, has_dlse=dlse is not None,
                                               sparse=layout),
                   {n: a for n, a in given.items() if a is not None})


def _mask_vmapped(call, n_arrays: int):
    """custom_vmap of a call ``(*arrays, mask_arrays)`` whose ``n_arrays`` arrays and results lead with the
    batch: the mapped axis folds into it, and the mask becomes the mask of the folded batch (block_sparse's
    ``_fold_mask``: a shared mask stays shared, a batched one turns per sequence)."""
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        arrays, mask_arrays = list(args[:n_arrays]), args[n_arrays]
        arrays = _batched(axis_size, arrays, [f is True for f in in_batched[:n_arrays]])
        mask_batched = _bs._any(in_batched[n_arrays])
        if mask_batched:
            mask_arrays = _bs._batched(axis_size, list(mask_arrays), list(in_batched[n_arrays]))
        batch = arrays[0].shape[1]
        outs = call(*[_fold(a) for a in arrays], _bs._fold_mask(axis_size, batch, mask_arrays, mask_batched))
        return tuple(o.reshape(axis_size, batch, *o.shape[1:]) for o in outs), tuple(True for _ in outs)

    return op


@functools.lru_cache(maxsize=None)
def _mask_fwd_op(static: _MaskStatic):
    return _mask_vmapped(functools.partial(_mask_fwd_call, static=static), 2)


@functools.lru_cache(maxsize=None)
def _mask_bwd_op(static: _MaskStatic):
    return _mask_vmapped(functools.partial(_mask_bwd_call, static=static), 6)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mla_masked(q, kv, mask_arrays, static):
    return _mask_fwd_op(static)(q, kv, mask_arrays)


def _mla_masked_fwd(q, kv, mask_arrays, static):
    out, lse = _mask_fwd_op(static)(q, kv, mask_arrays)
    return (out, lse), (q, kv, out, lse, mask_arrays)


def _mla_masked_bwd(static, saved, cotangents):
    q, kv, out, lse, mask_arrays = saved
    dout, dlse = cotangents
    dq, dkv = _mask_bwd_op(static)(dout.astype(out.dtype), q, kv, out, lse, dlse, mask_arrays)
    return dq, dkv, tuple(None for _ in mask_arrays)


_mla_masked.defvjp(_mla_masked_fwd, _mla_masked_bwd)


def _block_mask_attention(q, kv, block_mask, shape, options):
    """``mla_attention(..., block_mask=...)`` after its argument checks: (out, lse)."""
    check_mla_block_mask(block_mask, shape, options)
    static = _MaskStatic(shape.head_dim_v, float(options.softmax_scale), block_mask.seq_len_q, block_mask.seq_len_k,
                         block_mask.q_block, block_mask.kv_block, block_mask.terms)
    if all(a is None or isinstance(a, np.ndarray) for a in block_mask.arrays):  # a host mask: copied once
        block_mask = _bs.mask_to_device(block_mask)
    return _mla_masked_op(q, kv, tuple(block_mask.arrays), static=static)


@jit_op("static")
def _mla_masked_op(q, kv, mask_arrays, *, static: _MaskStatic):
    q, kv, *arrays = match_varying(q, kv, *mask_arrays)
    return _mla_masked(q, kv, tuple(arrays), static)


@jit_op("static")
def _mla_op(q, kv, indices, *, static: _Static):
    return _mla(*match_varying(q, kv, indices), static)


@jit_op("names", "shape", "options", "splits")
def _mla_decode_op(arrays, *, names, shape, options, splits):
    def make_plan(target):
        return plan_mla_fwd(shape, options, target=target, num_splits=splits)

    return forward_only("mla_decode", lambda *a: execute(make_plan, dict(zip(names, a))), *match_varying(*arrays))


# ----------------------------------------------------------------------------------------------- public

def mla_attention(q: Array, kv: Array, *, head_dim_v: int = 512, causal: bool = False,
                  softmax_scale: Optional[float] = None, indices: Optional[Array] = None, block_mask=None,
                  return_lse: bool = False) -> Union[Array, tuple[Array, Array]]:
    """Multi-head latent attention (DeepSeek MLA, absorbed form): every query head attends to one shared
    latent KV head whose first ``head_dim_v`` dims are the values. Same arguments and semantics as
    :func:`flashbridge.torch_api.mla_attention`: q ``(B, Sq, H, Dqk)``, kv ``(B, Sk, Dqk)``; ``causal``
    bottom-right aligned; ``indices`` int32 ``(B, Sq, topk)`` top-k key positions per query (-1 / out of
    range skipped, the others distinct); ``block_mask`` a :class:`flashbridge.masks.BlockMask` shared by
    the heads (a pytree: it passes through jit / vmap as an argument; per-head masks, ``causal`` and
    ``indices`` with it are rejected). Differentiable in q and kv (and through lse).

    Returns:
        ``out`` ``(B, Sq, H, head_dim_v)`` in q's dtype, or ``(out, lse)`` with lse float32 ``(B, H, Sq)``.

    Example::

        >>> q = jnp.ones((2, 16, 8, 96), jnp.bfloat16)
        >>> kv = jnp.ones((2, 16, 96), jnp.bfloat16)
        >>> out = jax.jit(lambda q, kv: mla_attention(q, kv, head_dim_v=64, causal=True))(q, kv)
        >>> out.shape
        (2, 16, 8, 64)
        >>> from flashbridge import masks   # key blocks per query block (blocks of 32 tokens)
        >>> m = masks.from_blocks([[True, False], [False, True]], seq_len_q=64, seq_len_k=64, block_size=32)
        >>> mla_attention(jnp.ones((1, 64, 8, 96)), jnp.ones((1, 64, 96)), head_dim_v=64, block_mask=m).shape
        (1, 64, 8, 64)
    """
    check_arrays(q=q, kv=kv, indices=indices)
    for name, a in (("q", q), ("kv", kv)):
        if a is None:
            raise TypeError(f"{name}: expected a jax.Array, got None")
    shape, options = check_mla_args(q=_info(q), kv=_info(kv), head_dim_v=head_dim_v, causal=causal,
                                    softmax_scale=softmax_scale, indices=_info(indices))
    if block_mask is not None:
        out, lse = _block_mask_attention(q, kv, block_mask, shape, options)
        return (out, lse) if return_lse else out
    values = _host(indices)
    if values is not None:
        check_index_values(values, None, shape.cache.capacity)
    static = _Static(shape.head_dim_v, float(options.softmax_scale), bool(causal))
    out, lse = _mla_op(q, kv, indices, static=static)
    return (out, lse) if return_lse else out


def mla_decode(q: Array, kv_cache: Array, *, cache_seqlens: Array, block_table: Optional[Array] = None,
               head_dim_v: int = 512, softmax_scale: Optional[float] = None, indices: Optional[Array] = None,
               kv_scale: Optional[Array] = None, num_splits: Optional[int] = None,
               return_lse: bool = False) -> Union[Array, tuple[Array, Array]]:
    """MLA decode over a latent cache, the same arguments and semantics as
    :func:`flashbridge.torch_api.mla_decode`: q ``(B, Sq, H, Dqk)``; kv_cache ``(B, S_max, Dqk)`` or paged
    ``(num_pages, page_size, Dqk)`` with int32 ``block_table``; int32 ``cache_seqlens`` ``(B,)``; an FP8
    (``jnp.float8_e4m3fn``) cache with float32 ``kv_scale`` (finite and > 0; checked when concrete on the
    CPU); ``indices`` ``(B, Sq, topk)`` for sparse decode. Forward only.

    Returns:
        ``out`` ``(B, Sq, H, head_dim_v)`` in q's dtype, or ``(out, lse)``.

    Example::

        >>> q = jnp.ones((2, 1, 16, 96), jnp.bfloat16)
        >>> cache = jnp.ones((2, 256, 96), jnp.bfloat16)
        >>> mla_decode(q, cache, cache_seqlens=jnp.array([100, 256], jnp.int32), head_dim_v=64).shape
        (2, 1, 16, 64)
    """
    arrays = {"q": q, "kv_cache": kv_cache, "cache_seqlens": cache_seqlens, "block_table": block_table,
              "indices": indices, "kv_scale": kv_scale}
    check_arrays(**arrays)
    for name in ("q", "kv_cache"):
        if arrays[name] is None:
            raise TypeError(f"{name}: expected a jax.Array, got None")
    shape, options, splits = check_mla_decode_args(
        **{n: _info(a) for n, a in arrays.items()}, head_dim_v=head_dim_v, softmax_scale=softmax_scale,
        num_splits=num_splits)
    scale = _host(kv_scale)
    check_scale_values(kv_scale=None if scale is None else scale.reshape(-1).tolist())
    lengths = _host(cache_seqlens)
    table = _host(block_table)
    if lengths is not None and (block_table is None or table is not None):
        check_decode_values(lengths.tolist(), None if table is None else table.tolist(), shape.cache)
        values = _host(indices)
        if values is not None:
            check_index_values(values, lengths, None)

    given = {"q": q, "kv": kv_cache, "cache_seqlens": cache_seqlens, "block_table": block_table,
             "indices": indices, "kv_scale": kv_scale}
    names = plan_mla_fwd(shape, options, target=INTERPRETER, num_splits=splits).inputs
    out, lse = _mla_decode_op(tuple(given[n] for n in names), names=names, shape=shape, options=options,
                              splits=splits)
    return (out, lse) if return_lse else out

