"""FlashAttention for JAX: a ``jax.custom_vjp`` op whose kernel calls carry ``custom_vmap`` rules, and a
``jax.nn.dot_product_attention``-compatible function.

The same kernels as the torch front-end (``attn_fwd_kernel`` and the backward kernels); jit, grad, vmap
and shard_map all work. Under vmap, dense inputs fold the mapped axis into the batch (one launch);
packed inputs and per-example sinks map sequentially.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..core_kernels.flash_attn.plan import (AttnOptions, check_attention_args, check_cache_options,
                                            check_cu_seqlens_values, check_dropout, int_pair, plan_attention_bwd,
                                            plan_attention_fwd)
from ._checks import as_seed, check_arrays, check_seed, seed_argument
from ..core_kernels._plan import memoised
from ._runtime import dtype_name, execute, jit_op, match_varying

Array = jax.Array

# validation and plans run once per distinct argument signature (see memoised)
check_attention_args, plan_attention_fwd, plan_attention_bwd = map(
    memoised, (check_attention_args, plan_attention_fwd, plan_attention_bwd))


def _info(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything about a call that is not an array (hashable: a custom_vjp nondiff argument)."""

    options: AttnOptions
    max_seqlen_q: Optional[int]
    max_seqlen_k: Optional[int]
    alibi_grad: bool = False  # the backward also returns the ALiBi slopes' gradient


def _shape(static: _Static, q, k, v, alibi, sinks, cu_q, cu_k):
    shape, _ = check_attention_args(q=_info(q), k=_info(k), v=_info(v), alibi_slopes=_info(alibi),
                                    sinks=_info(sinks), cu_seqlens_q=_info(cu_q), cu_seqlens_k=_info(cu_k),
                                    max_seqlen_q=static.max_seqlen_q, max_seqlen_k=static.max_seqlen_k)
    return shape


def _with_alibi(options: AttnOptions, alibi) -> AttnOptions:
    return dataclasses.replace(options, has_alibi=alibi is not None,
                               alibi_batched=alibi is not None and alibi.ndim == 2)


# ----------------------------------------------------------------------------------------------- kernels

def _fwd_call(q, k, v, alibi, sinks, cu_q, cu_k, seed=None, *, static: _Static):
    shape = _shape(static, q, k, v, alibi, sinks, cu_q, cu_k)
    options = _with_alibi(static.options, alibi)

    def make_plan(target):
        return plan_attention_fwd(shape, options, target=target)

    given = {"q": q, "k": k, "v": v, "alibi_slopes": alibi, "sinks": sinks, "cu_seqlens_q": cu_q,
             "cu_seqlens_k": cu_k, "seed": seed}
    out, lse = execute(make_plan, {n: a for n, a in given.items() if a is not None})
    return out, lse


def _bwd_call(dout, q, k, v, out, lse, dlse, alibi, sinks, cu_q, cu_k, seed=None, *, static: _Static):
    shape = _shape(static, q, k, v, alibi, sinks, cu_q, cu_k)
    options = _with_alibi(static.options, alibi)
    alibi_grad = static.alibi_grad and alibi is not None

    def make_plan(target):
        return plan_attention_bwd(shape, options, target=target, has_dlse=dlse is not None,
                                  sinks_dtype=None if sinks is None else dtype_name(sinks.dtype),
                                  alibi_grad=dtype_name(alibi.dtype) if alibi_grad else None)

    given = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "dlse": dlse,
             "alibi_slopes": alibi, "sinks": sinks, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "seed": seed}
    results = execute(make_plan, {n: a for n, a in given.items() if a is not None})
    return split_bwd_results(results, sinks is not None, alibi_grad)


def split_bwd_results(results, has_sinks: bool, alibi_grad: bool):
    """(dq, dk, dv, dsinks, dsinks_part, dalibi, dalibi_part) from a backward plan's results (None where the
    plan has no such result)."""
    dq, dk, dv, *rest = results
    dsinks, dsinks_part = (rest.pop(0), rest.pop(0)) if has_sinks else (None, None)
    dalibi, dalibi_part = (rest[0], rest[1]) if alibi_grad else (None, None)
    return dq, dk, dv, dsinks, dsinks_part, dalibi, dalibi_part


def vmap_bwd_results(axis_size: int, batch: int, results, sinks, alibi, alibi_batched: bool):
    """A folded backward's results for ``axis_size`` examples of ``batch`` sequences each, per example: the
    sinks' gradient and that of slopes ``(Hq,)`` sum their sequences' terms (``*_part``); slopes ``(B, Hq)``
    get their own rows. Returns (results, out_batched)."""
    dq, dk, dv, _, dsinks_part, dalibi, dalibi_part = results
    unfold = lambda a: a.reshape(axis_size, batch, *a.shape[1:])  # noqa: E731
    dsinks = None
    if sinks is not None:
        dsinks_part = unfold(dsinks_part)
        dsinks = jnp.sum(dsinks_part, axis=1).astype(sinks.dtype)
    if dalibi is not None:
        dalibi_part = unfold(dalibi_part)
        one_per_head = alibi.ndim - alibi_batched == 1
        dalibi = (jnp.sum(dalibi_part, axis=1) if one_per_head else unfold(dalibi)).astype(alibi.dtype)
    outs = (unfold(dq), unfold(dk), unfold(dv), dsinks, dsinks_part, dalibi, dalibi_part)
    return outs, tuple(None if o is None else True for o in outs)


def _any(flags) -> bool:
    return any(jax.tree_util.tree_leaves(flags))


def _batched(axis_size, args, in_batched):
    """Give every array in ``args`` a leading mapped axis (custom_vmap puts mapped axes first)."""
    return [a if a is None or _any(b) else jnp.broadcast_to(a, (axis_size, *a.shape))
            for a, b in zip(args, in_batched)]


def _fold(a):
    return None if a is None else a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _fold_alibi(axis_size, batch, alibi, batched):
    """ALiBi slopes for a batch of ``axis_size * batch`` sequences: (Hq,) stays, else (V*B, Hq)."""
    if alibi is None or (not batched and alibi.ndim == 1):
        return alibi
    if not batched:
        alibi = jnp.broadcast_to(alibi, (axis_size, *alibi.shape))
    if alibi.ndim == 2:  # (V, Hq): per example, the same for each sequence
        alibi = jnp.broadcast_to(alibi[:, None, :], (axis_size, batch, alibi.shape[-1]))
    return _fold(alibi)


def _must_map(varlen: bool, in_batched_sinks, dropout: bool = False) -> bool:
    # Packed sequences cannot be folded into one batch without new offsets, the kernels read one sink per
    # head, and the dropout mask depends on the sequence's index in its batch: map those cases one example
    # at a time.
    return varlen or _any(in_batched_sinks) or dropout


@functools.lru_cache(maxsize=None)
def _fwd_op(static: _Static):
    call = functools.partial(_fwd_call, static=static)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, q, k, v, alibi, sinks, cu_q, cu_k, seed=None):
        args = [q, k, v, alibi, sinks, cu_q, cu_k, seed]
        if _must_map(cu_q is not None, in_batched[4], seed is not None):
            outs = jax.lax.map(lambda a: call(*a), tuple(_batched(axis_size, args, in_batched)))
            return outs, (True, True)
        q, k, v = _batched(axis_size, [q, k, v], in_batched[:3])
        batch = q.shape[1]
        out, lse = call(_fold(q), _fold(k), _fold(v), _fold_alibi(axis_size, batch, alibi, _any(in_batched[3])),
                        sinks, None, None)
        return (out.reshape(axis_size, batch, *out.shape[1:]),
                lse.reshape(axis_size, batch, *lse.shape[1:])), (True, True)

    return op


@functools.lru_cache(maxsize=None)
def _bwd_op(static: _Static):
    call = functools.partial(_bwd_call, static=static)
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size, in_batched, dout, q, k, v, out, lse, dlse, alibi, sinks, cu_q, cu_k, seed=None):
        args = [dout, q, k, v, out, lse, dlse, alibi, sinks, cu_q, cu_k, seed]
        if _must_map(cu_q is not None, in_batched[8], seed is not None):
            outs = jax.lax.map(lambda a: call(*a), tuple(_batched(axis_size, args, in_batched)))
            return outs, tuple(None if o is None else True for o in outs)
        dout, q, k, v, out, lse, dlse = _batched(axis_size, args[:7], in_batched[:7])
        batch = q.shape[1]
        results = call(_fold(dout), _fold(q), _fold(k), _fold(v), _fold(out), _fold(lse), _fold(dlse),
                       _fold_alibi(axis_size, batch, alibi, _any(in_batched[7])), sinks, None, None)
        return vmap_bwd_results(axis_size, batch, results, sinks, alibi, _any(in_batched[7]))

    return op


# ------------------------------------------------------------------------------------ differentiable op

@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, alibi, sinks, cu_q, cu_k, static, seed=None):
    return _fwd_op(static)(q, k, v, alibi, sinks, cu_q, cu_k, seed)


def primal_values(*args):
    """The values of custom_vjp primals (``symbolic_zeros=True`` wraps each one with its ``perturbed`` flag)."""
    return tuple(None if a is None else a.value for a in args)


def perturbed(a) -> bool:
    """Whether a wrapped primal needs a gradient (None: absent)."""
    return a is not None and a.perturbed


def cotangent_values(dout, dlse, out):
    """(dout in out's dtype, dlse or None) from symbolic-zero cotangents: an unused lse costs nothing."""
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):
        dout = jnp.zeros(out.shape, out.dtype)
    if isinstance(dlse, jax.custom_derivatives.SymbolicZero):
        dlse = None
    return dout.astype(out.dtype), dlse


def _attention_fwd(q, k, v, alibi, sinks, cu_q, cu_k, static, seed=None):
    # The slopes' gradient is computed only when they are differentiated (known here, at trace time).
    alibi_grad = perturbed(alibi)
    q, k, v, alibi, sinks, cu_q, cu_k, seed = primal_values(q, k, v, alibi, sinks, cu_q, cu_k, seed)
    out, lse = _fwd_op(static)(q, k, v, alibi, sinks, cu_q, cu_k, seed)
    return (out, lse), (q, k, v, out, lse, alibi, sinks, cu_q, cu_k, alibi if alibi_grad else None, seed)


def _attention_bwd(static, saved, cotangents):
    q, k, v, out, lse, alibi, sinks, cu_q, cu_k, alibi_wanted, seed = saved
    dout, dlse = cotangent_values(*cotangents, out)
    static = dataclasses.replace(static, alibi_grad=alibi_wanted is not None)
    dq, dk, dv, dsinks, _, dalibi, _ = _bwd_op(static)(dout, q, k, v, out, lse, dlse, alibi, sinks, cu_q, cu_k,
                                                       seed)
    return dq, dk, dv, dalibi, dsinks, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _is_concrete(a) -> bool:
    return not isinstance(a, jax.core.Tracer)


# ----------------------------------------------------------------------------------------------- public

def flash_attention(q: Array, k: Array, v: Array, *, causal: bool = False, softmax_scale: Optional[float] = None,
                    window_size: tuple[int, int] = (-1, -1), alibi_slopes: Optional[Array] = None,
                    softcap: float = 0.0, sinks: Optional[Array] = None, cu_seqlens_q: Optional[Array] = None,
                    cu_seqlens_k: Optional[Array] = None, max_seqlen_q: Optional[int] = None,
                    max_seqlen_k: Optional[int] = None, deterministic: bool = True, return_lse: bool = False,
                    block_mask=None, dropout_p: float = 0.0, seed: Optional[int | Array] = None,
                    block_table: Optional[Array] = None, seqused_k: Optional[Array] = None,
                    ) -> Array | tuple[Array, Array]:
    """``out = softmax(mods(softmax_scale * q @ k^T)) @ v`` without materialising the scores.

    Args:
        q: ``(B, Sq, Hq, Dqk)``, or packed ``(total_q, Hq, Dqk)`` with ``cu_seqlens_q``; float16, bfloat16 or
            float32 (float32 accumulation). ``1 <= Dqk <= 256``.
        k: ``(B, Sk, Hkv, Dqk)`` or ``(total_k, Hkv, Dqk)``, q's dtype; ``Hq`` a multiple of ``Hkv`` (GQA/MQA).
        v: ``(B, Sk, Hkv, Dv)`` or ``(total_k, Hkv, Dv)``; ``Dv`` may differ from ``Dqk``.
        causal: query i sees keys ``j <= i + Sk - Sq`` (bottom-right aligned, as flash-attn 2.1+); rows that
            see no key output 0 and lse -inf.
        softmax_scale: defaults to ``1 / sqrt(Dqk)``.
        window_size: ``(left, right)``: query i sees keys ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``;
            -1 leaves a side unbounded. Combines with causal.
        alibi_slopes: ``(Hq,)`` or ``(B, Hq)``: adds ``-slope * |i + Sk - Sq - j|``; differentiable (the
            backward computes their gradient only when they are differentiated).
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        sinks: ``(Hq,)``: a per-head logit in the softmax denominator that attends to nothing; differentiable.
        cu_seqlens_q, cu_seqlens_k: int32 ``(n_seqs + 1,)`` packed offsets; ``max_seqlen_q`` /
            ``max_seqlen_k`` (Python ints) are static bounds. Concrete offsets are validated; traced ones
            (under jit) cannot be, and the kernels then only guarantee in-bounds memory accesses.
        deterministic: accepted for compatibility; the backward is always deterministic.
        return_lse: also return the float32 LSE ``(B, Hq, Sq)`` (packed ``(Hq, total_q)``), differentiable.
        block_mask: a :class:`flashbridge.masks.BlockMask` (a pytree: pass it through jit / vmap / shard_map
            like an array argument): only the key blocks it lists are visited; rows that see nothing output 0
            and lse -inf. Not with causal / window_size (build them into the mask) or packed inputs.
        dropout_p: attention dropout on the probabilities (after the softmax, before ``@ v``) at the rate
            ``p_q = round(256 * dropout_p) / 256`` (p rounded to a multiple of 1/256, halves up; 0.1 ->
            0.1015625; p >= 511/512 is refused): each is kept with probability ``1 - p_q`` and scaled by
            ``1 / (1 - p_q)``, so the expectation is exact; lse stays the undropped softmax's (as flash-attn).
            The mask is a function of ``(seed, batch, head, query, key)`` (Philox, one draw per 16 elements,
            ``flashbridge.reference.attention.attention_dropout_mask``): the same seed gives the same mask
            here, in ``flashbridge.torch_api``, on CPU and GPU, and the backward regenerates it. 0 costs
            nothing.
        seed: a Python int (int32 range) or an integer array of one element (may be traced); required when
            ``dropout_p > 0``. Under vmap, dropout maps one example at a time.
        block_table: int32 ``(B, max_pages)``: k / v are a paged cache ``(num_pages, page_size, Hkv, D)``;
            key ``j`` of sequence ``b`` is slot ``j % page_size`` of page ``block_table[b, j // page_size]``
            (flash-attn's ``flash_attn_varlen_func(..., block_table=)``). Needs ``seqused_k``, no
            ``cu_seqlens_k``; q packed or ``(B, Sq, Hq, Dqk)``; page sizes: powers of two or multiples of 128.
        seqused_k: int32 ``(B,)``: sequence ``b`` uses its first ``seqused_k[b]`` keys (clamped to the cache);
            causal / windows align at the bottom-right of (its queries, its used keys). Without
            ``block_table``: k / v dense ``(B, S_max, Hkv, D)`` (q dense or packed) or packed with
            ``cu_seqlens_k``. With either argument the call is forward-only: ``jax.grad`` through it raises.

    Non-finite values follow IEEE arithmetic, as the float64 reference (``flashbridge.reference``): a NaN in
    anything a row sees (its query, a visible key or value, its ALiBi slope or sink) makes the row's ``out``
    NaN, and its ``lse`` NaN unless only values hold it, so that a later merge of partial states never takes
    it for a row that saw nothing; a +inf score or sink gives lse +inf. Keys a row does not see (masked,
    past its sequence, in other packed sequences) never reach it, with one limit shared by every MMA-based
    attention: inside one key tile, a NaN *value* of a key that the row does not see (the causal diagonal's
    tile, a window edge, a partial block) reaches it through ``0 * NaN`` in ``p @ v``.

    Returns:
        ``out`` in q's dtype, shaped like q with v's head dim; or ``(out, lse)``.

    Example::

        >>> q = k = v = jnp.ones((2, 128, 8, 64), jnp.bfloat16)
        >>> out = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True))(q, k, v)
    """
    arrays = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks,
              "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    check_arrays(**arrays, block_table=block_table, seqused_k=seqused_k)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")
    if block_table is not None or seqused_k is not None:
        check_cache_options(block_mask=block_mask, dropout_p=dropout_p)
        from .attention_cache import cache_attention
        out, lse = cache_attention(q, k, v, block_table=block_table, seqused_k=seqused_k, alibi_slopes=alibi_slopes,
                                   sinks=sinks, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
        return (out, lse) if return_lse else out
    shape, options = check_attention_args(
        **{n: _info(a) for n, a in arrays.items()}, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    if seed is not None:
        check_seed(seed)
    dropout_p = check_dropout(dropout_p, seed is not None)
    if shape.varlen and _is_concrete(cu_seqlens_q) and _is_concrete(cu_seqlens_k):
        offsets_q, offsets_k = jax.device_get((cu_seqlens_q, cu_seqlens_k))  # one transfer for both
        check_cu_seqlens_values(np.asarray(offsets_q).tolist(), np.asarray(offsets_k).tolist(), shape)
    if dropout_p > 0:
        options = dataclasses.replace(options, dropout_p=dropout_p)
    seed = seed_argument(seed) if dropout_p > 0 else None
    if block_mask is not None:
        from .block_sparse import block_sparse_attention
        out, lse = block_sparse_attention(q, k, v, block_mask, shape, options, alibi_slopes, sinks, seed)
        return (out, lse) if return_lse else out
    out, lse = _attention_op(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, seed,
                             static=_Static(options, max_seqlen_q, max_seqlen_k))
    return (out, lse) if return_lse else out


@jit_op("static")
def _attention_op(q, k, v, alibi, sinks, cu_q, cu_k, seed, *, static: _Static):
    """(out, lse) of checked arguments; ``seed`` None (no dropout) or an integer array (see seed_argument)."""
    *arrays, seed = match_varying(q, k, v, alibi, sinks, cu_q, cu_k, None if seed is None else as_seed(seed))
    return _attention(*arrays, static, seed)


def dot_product_attention(query: Array, key: Array, value: Array, bias: Optional[Array] = None,
                          mask: Optional[Array] = None, *, scale: Optional[float] = None, is_causal: bool = False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None, implementation=None,
                          return_residual: bool = False) -> Array | tuple[Array, Array]:
    """Drop-in for :func:`jax.nn.dot_product_attention`: ``softmax(q k^T * scale) v`` in BTNH layout.

    Same conventions as jax.nn: query ``(B, T, N, H)`` (or unbatched ``(T, N, H)``), key/value
    ``(B, S, K, H)`` with N a multiple of K; ``is_causal`` and ``local_window_size`` (an int or
    ``(left, right)``) are aligned to the top-left corner (query t sees keys ``t - left .. t + right``);
    ``return_residual`` also returns the log-sum-exp ``(B, T, N)`` in the output dtype. ``bias``,
    ``mask`` and the sequence-length arguments must be None (the kernels never build a mask: use
    :func:`flash_attention` with ``cu_seqlens`` for ragged batches); ``implementation`` is ignored.

    Example::

        >>> q = k = v = jnp.ones((2, 128, 8, 64), jnp.float16)
        >>> out = dot_product_attention(q, k, v, is_causal=True)
    """
    for name, arg in (("bias", bias), ("mask", mask), ("query_seq_lengths", query_seq_lengths),
                      ("key_value_seq_lengths", key_value_seq_lengths)):
        if arg is not None:
            raise ValueError(f"{name}: not supported by flashbridge's dot_product_attention (only None); use "
                             "is_causal / local_window_size, or flash_attention with cu_seqlens")
    check_arrays(query=query, key=key, value=value)
    unbatched = query.ndim == 3
    lead = (lambda a: (1, *a.shape)) if unbatched else (lambda a: tuple(a.shape))
    shape, options = check_attention_args(q=(lead(query), dtype_name(query.dtype)),
                                          k=(lead(key), dtype_name(key.dtype)),
                                          v=(lead(value), dtype_name(value.dtype)), softmax_scale=scale)
    diag = shape.seqlen_k - shape.seqlen_q
    left = right = None
    if local_window_size is not None:
        if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
            local_window_size = (local_window_size, local_window_size)
        left, right = int_pair("local_window_size", local_window_size)
        if left < 0 or right < 0:
            raise ValueError(f"local_window_size: sides must be >= 0, got {local_window_size}")
    if is_causal:
        right = 0 if right is None else min(right, 0)
    # jax.nn aligns masks to the top-left corner (t sees s with -left <= s - t <= right); the kernels measure
    # from the bottom-right diagonal t + S - T: shift both sides by that offset.
    options = dataclasses.replace(options, window_left=None if left is None else left + diag,
                                  window_right=None if right is None else right - diag)
    return _dot_product_attention_op(query, key, value, static=_Static(options, None, None), unbatched=unbatched,
                                     return_residual=return_residual)


@jit_op("static", "unbatched", "return_residual")
def _dot_product_attention_op(query, key, value, *, static: _Static, unbatched: bool, return_residual: bool):
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    out, lse = _attention(*match_varying(query, key, value), None, None, None, None, static)
    if unbatched:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, jnp.swapaxes(lse, -1, -2).astype(out.dtype)
    return out
