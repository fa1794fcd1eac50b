"""Block-sparse attention for JAX: ``flash_attention(q, k, v, block_mask=...)`` runs here.

:class:`flashbridge.masks.BlockMask` is registered as a pytree: its arrays are the leaves, its sequence
lengths, block sizes and element-test kind the static part. One jitted function therefore serves every mask
of the same shapes (e.g. learned top-k blocks that change every step), and masks travel through ``jit``,
``vmap`` (a batched mask becomes a per-example mask) and ``shard_map`` (give the mask's arrays their own
partition specs, e.g. heads split like q's) like any other argument. The op is a ``custom_vjp`` over the
same FlashAttention kernels as the dense path, with ``custom_vmap`` rules on the kernel calls.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import masks as _masks
from ..core_kernels.block_sparse.plan import SparseLayout, band_arrays, check_block_mask, layout_of
from ..core_kernels.flash_attn.plan import AttnOptions, check_attention_args, plan_attention_bwd, plan_attention_fwd
from ._checks import as_seed
from ._runtime import dtype_name, execute, jit_op, match_varying
from .attention import cotangent_values, perturbed, primal_values, split_bwd_results, vmap_bwd_results

_NAMES = _masks.BlockMask.array_names
_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
          "full_q_num_blocks", "full_q_indices", "q_order", "kv_order", "kv_bits_index",
          "q_bits_index")  # (B|1, H|1, ...)


def _flatten(mask: _masks.BlockMask):
    return mask.arrays, (mask.seq_len_q, mask.seq_len_k, mask.q_block, mask.kv_block, mask.terms, mask.band)


def _unflatten(aux, arrays):
    seq_len_q, seq_len_k, q_block, kv_block, terms, *band = aux
    return _masks.BlockMask(seq_len_q=seq_len_q, seq_len_k=seq_len_k, q_block=q_block, kv_block=kv_block,
                            terms=terms, band=bool(band and band[0]), **dict(zip(_NAMES, arrays)))


jax.tree_util.register_pytree_node(_masks.BlockMask, _flatten, _unflatten)


def _info(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


@dataclasses.dataclass(frozen=True)
class _Static:
    """What a call knows statically (hashable: a custom_vjp nondiff argument)."""

    options: AttnOptions
    seq_len_q: int
    seq_len_k: int
    q_block: int
    kv_block: int
    terms: _masks.MaskTerms
    alibi_grad: bool = False  # the backward also returns the ALiBi slopes' gradient


def _layout(static: _Static, arrays) -> SparseLayout:
    return layout_of(_unflatten((static.seq_len_q, static.seq_len_k, static.q_block, static.kv_block,
                                 static.terms), arrays))


def _shape(q, k, v, alibi, sinks):
    shape, _ = check_attention_args(q=_info(q), k=_info(k), v=_info(v), alibi_slopes=_info(alibi),
                                    sinks=_info(sinks))
    return shape


def _with_alibi(options: AttnOptions, alibi) -> AttnOptions:
    return dataclasses.replace(options, has_alibi=alibi is not None,
                               alibi_batched=alibi is not None and alibi.ndim == 2)


# ----------------------------------------------------------------------------------------------- kernels

def _fwd_call(q, k, v, alibi, sinks, mask_arrays, seed=None, *, static: _Static):
    shape = _shape(q, k, v, alibi, sinks)
    options = _with_alibi(static.options, alibi)
    layout = _layout(static, mask_arrays)

    def make_plan(target):
        return plan_attention_fwd(shape, options, target=target, sparse=layout)

    given = {"q": q, "k": k, "v": v, "alibi_slopes": alibi, "sinks": sinks, "seed": seed,
             **dict(zip(_NAMES, mask_arrays))}
    out, lse = execute(make_plan, {n: a for n, a in given.items() if a is not None})
    return out, lse


def _bwd_call(dout, q, k, v, out, lse, dlse, alibi, sinks, mask_arrays, seed=None, *, static: _Static):
    shape = _shape(q, k, v, alibi, sinks)
    options = _with_alibi(static.options, alibi)
    layout = _layout(static, mask_arrays)
    alibi_grad = static.alibi_grad and alibi is not None

    def make_plan(target):
        return plan_attention_bwd(shape, options, target=target, has_dlse=dlse is not None, sparse=layout,
                                  sinks_dtype=None if sinks is None else dtype_name(sinks.dtype),
                                  alibi_grad=dtype_name(alibi.dtype) if alibi_grad else None)

    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dlse": dlse, "alibi_slopes": alibi,
             "sinks": sinks, "seed": seed, **dict(zip(_NAMES, mask_arrays))}
    results = execute(make_plan, {n: a for n, a in given.items() if a is not None})
    return split_bwd_results(results, sinks is not None, alibi_grad)


# ------------------------------------------------------------------------------------------- vmap rules

def _any(flags) -> bool:
    return any(jax.tree_util.tree_leaves(flags))


def _batched(axis_size, args, in_batched):
    """Give every array in ``args`` a leading mapped axis (custom_vmap puts mapped axes first)."""
    return [a if a is None or _any(b) else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched)]


def _fold(a):
    return None if a is None else a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _fold_alibi(axis_size, batch, alibi, batched):
    """ALiBi slopes for ``axis_size * batch`` sequences: (Hq,) stays, else (V*B, Hq)."""
    if alibi is None or (not batched and alibi.ndim == 1):
        return alibi
    if not batched:
        alibi = jnp.broadcast_to(alibi, (axis_size, *alibi.shape))
    if alibi.ndim == 2:
        alibi = jnp.broadcast_to(alibi[:, None, :], (axis_size, batch, alibi.shape[-1]))
    return _fold(alibi)


def _fold_mask(axis_size: int, batch: int, arrays, batched: bool):
    """The mask of a batch of ``axis_size * batch`` sequences (the mapped axis folded into the batch): a mask
    shared by the examples repeats only its per-sequence rows; a batched one (every leaf with a leading
    mapped axis) becomes per-sequence, its rows of bits renumbered per example."""
    a = dict(zip(_NAMES, arrays))
    out = {}
    for name, x in a.items():
        if x is None:
            out[name] = None
        elif not batched:
            per_seq = name in _LISTS or name in ("tokens_q", "tokens_k")
            out[name] = jnp.tile(x, (axis_size,) + (1,) * (x.ndim - 1)) if per_seq and x.shape[0] > 1 else x
        elif name == "bits":
            out[name] = _fold(x)
        else:  # (V, B|1, ...): per sequence, each example's rows
            if x.shape[1] == 1 and batch > 1:
                x = jnp.broadcast_to(x, (axis_size, batch, *x.shape[2:]))
            if name in ("kv_bits_index", "q_bits_index"):
                offsets = jnp.arange(axis_size, dtype=x.dtype) * a["bits"].shape[1]
                x = x + offsets.reshape((axis_size,) + (1,) * (x.ndim - 1))
            out[name] = _fold(x)
    return tuple(out[n] for n in _NAMES)


def _must_map(in_batched_sinks, dropout: bool = False) -> bool:
    # the kernels read one sink per head, and the dropout mask depends on the sequence's index in its batch:
    # those examples map one at a time
    return _any(in_batched_sinks) or dropout


@functools.lru_cache(maxsize=None)
def _fwd_op(static: _Static):
    call = functools.partial(_fwd_call, static=static)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, q, k, v, alibi, sinks, mask_arrays, seed=None):
        args = [q, k, v, alibi, sinks, mask_arrays, seed]
        if _must_map(in_batched[4], seed is not None):
            outs = jax.lax.map(lambda a: call(*a), tuple(_batched(axis_size, args, in_batched)))
            return outs, (True, True)
        mask_batched = _any(in_batched[5])
        q, k, v = _batched(axis_size, [q, k, v], in_batched[:3])
        if mask_batched:
            mask_arrays = _batched(axis_size, list(mask_arrays), list(in_batched[5]))
        batch = q.shape[1]
        out, lse = call(_fold(q), _fold(k), _fold(v), _fold_alibi(axis_size, batch, alibi, _any(in_batched[3])),
                        sinks, _fold_mask(axis_size, batch, mask_arrays, mask_batched))
        return (out.reshape(axis_size, batch, *out.shape[1:]),
                lse.reshape(axis_size, batch, *lse.shape[1:])), (True, True)

    return op


@functools.lru_cache(maxsize=None)
def _bwd_op(static: _Static):
    call = functools.partial(_bwd_call, static=static)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, dout, q, k, v, out, lse, dlse, alibi, sinks, mask_arrays, seed=None):
        args = [dout, q, k, v, out, lse, dlse, alibi, sinks, mask_arrays, seed]
        if _must_map(in_batched[8], seed is not None):
            outs = jax.lax.map(lambda a: call(*a), tuple(_batched(axis_size, args, in_batched)))
            return outs, tuple(None if o is None else True for o in outs)
        mask_batched = _any(in_batched[9])
        dout, q, k, v, out, lse, dlse = _batched(axis_size, args[:7], in_batched[:7])
        if mask_batched:
            mask_arrays = _batched(axis_size, list(mask_arrays), list(in_batched[9]))
        batch = q.shape[1]
        results = call(_fold(dout), _fold(q), _fold(k), _fold(v), _fold(out), _fold(lse), _fold(dlse),
                       _fold_alibi(axis_size, batch, alibi, _any(in_batched[7])), sinks,
                       _fold_mask(axis_size, batch, mask_arrays, mask_batched))
        return vmap_bwd_results(axis_size, batch, results, sinks, alibi, _any(in_batched[7]))

    return op


# ------------------------------------------------------------------------------------ differentiable op

@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, alibi, sinks, mask_arrays, static, seed=None):
    return _fwd_op(static)(q, k, v, alibi, sinks, mask_arrays, seed)


def _attention_fwd(q, k, v, alibi, sinks, mask_arrays, static, seed=None):
    alibi_grad = perturbed(alibi)  # the slopes' gradient only when they are differentiated
    q, k, v, alibi, sinks, seed = primal_values(q, k, v, alibi, sinks, seed)
    mask_arrays = tuple(primal_values(*mask_arrays))
    out, lse = _fwd_op(static)(q, k, v, alibi, sinks, mask_arrays, seed)
    return (out, lse), (q, k, v, out, lse, alibi, sinks, mask_arrays, alibi if alibi_grad else None, seed)


def _attention_bwd(static, saved, cotangents):
    q, k, v, out, lse, alibi, sinks, mask_arrays, alibi_wanted, seed = saved
    dout, dlse = cotangent_values(*cotangents, out)
    static = dataclasses.replace(static, alibi_grad=alibi_wanted is not None)
    dq, dk, dv, dsinks, _, dalibi, _ = _bwd_op(static)(dout, q, k, v, out, lse, dlse, alibi, sinks, mask_arrays,
                                                       seed)
    return dq, dk, dv, dalibi, dsinks, tuple(None for _ in mask_arrays), None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def block_sparse_attention(q, k, v, block_mask, shape, options: AttnOptions, alibi_slopes, sinks, seed=None):
    """``flash_attention(..., block_mask=...)`` after its argument checks: (out, lse); ``seed`` (an integer
    array, see ``_checks.seed_argument``) with ``options.dropout_p > 0``."""
    layout = check_block_mask(block_mask, shape, options)
    static = _Static(options, block_mask.seq_len_q, block_mask.seq_len_k, block_mask.q_block, block_mask.kv_block,
                     block_mask.terms)
    host = all(a is None or isinstance(a, np.ndarray) for a in block_mask.arrays)  # a host mask: copied once
    arrays = band_arrays(layout, lambda: (mask_to_device(block_mask) if host else block_mask).arrays)  # band: none
    return _sparse_op(q, k, v, alibi_slopes, sinks, tuple(arrays), seed if options.dropout_p > 0 else None,
                      static=static)


@jit_op("static")
def _sparse_op(q, k, v, alibi, sinks, mask_arrays, seed, *, static: _Static):
    if seed is not None:
        q, k, v, alibi, sinks, seed, *arrays = match_varying(q, k, v, alibi, sinks, as_seed(seed), *mask_arrays)
        return _attention(q, k, v, alibi, sinks, tuple(arrays), static, seed)
    q, k, v, alibi, sinks, *arrays = match_varying(q, k, v, alibi, sinks, *mask_arrays)
    return _attention(q, k, v, alibi, sinks, tuple(arrays), static)


def mask_to_device(block_mask: _masks.BlockMask, device: Optional[jax.Device] = None) -> _masks.BlockMask:
    """The mask with its arrays on ``device`` (default: JAX's default device), copied once per mask and
    device: pass the result to jitted functions to keep the host-to-device copy out of every call."""
    key = ("jax", str(device))

    def convert(a):
        return jax.device_put(jnp.asarray(a, jnp.int32), device)

    return _unflatten(_flatten(block_mask)[1], block_mask.device_arrays(key, convert))
