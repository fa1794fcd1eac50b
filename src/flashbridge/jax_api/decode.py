"""Flash-Decoding for JAX (forward only: ``jax.grad`` through these ops fails, naming the op): the same
kernels and plans as the torch front-end.

``decode_attention``, ``merge_attention_states`` and ``cascade_attention`` run their plans through the
shared runtime (jax-triton on a GPU, Triton's interpreter in a ``pure_callback`` on the CPU); all work
under ``jax.jit``. ``append_kv_cache`` returns the updated caches: its outputs alias the cache inputs
(the runtime's ``aliases``, jax-triton's ``input_output_aliases``), so on a GPU under
``jax.jit(..., donate_argnums=...)`` the cache is updated in place, no copy; on the CPU the callback
returns new arrays (a host callback cannot write into XLA's buffers).

Values inside ``cache_seqlens`` / ``block_table`` are validated when they are concrete host (CPU) arrays;
traced or device-resident ones are not read (no device sync), and the kernels clamp lengths and page ids
so that a bad value never addresses memory outside the cache.
"""
from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from ..core_kernels import INTERPRETER
from ..core_kernels.decode.plan import (check_append_args, check_cache_values, check_cascade_args,
                                        check_decode_args, check_leftpad_values, check_merge_args,
                                        check_scale_values, plan_append, plan_cascade, plan_decode, plan_merge)
from ._checks import check_arrays, forward_only, host_list
from ..core_kernels._plan import memoised
from ._runtime import dtype_name, execute, jit_op, match_varying

Array = jax.Array

# validation and plans run once per distinct argument signature (see memoised)
check_decode_args, check_merge_args, plan_decode, plan_merge = map(
    memoised, (check_decode_args, check_merge_args, plan_decode, plan_merge))


def _info(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


def _host_values(cache_seqlens, block_table):
    """The index arrays' values when reading them is free (concrete and on the CPU), else None."""
    def on_host(a):
        if a is None:
            return True
        if isinstance(a, np.ndarray):
            return True
        if isinstance(a, jax.core.Tracer):
            return False
        try:
            return all(d.platform == "cpu" for d in a.devices())
        except Exception:  # noqa: BLE001 -- anything unusual: do not read it
            return False

    if not (on_host(cache_seqlens) and on_host(block_table)):
        return None
    return np.asarray(cache_seqlens).tolist(), None if block_table is None else np.asarray(block_table).tolist()


def _host_leftpad(cache_leftpad, cache_seqlens) -> None:
    """Check ``0 <= cache_leftpad <= cache_seqlens`` when both are concrete host arrays."""
    if cache_leftpad is None:
        return
    values = _host_values(cache_seqlens, cache_leftpad)
    if values is not None:
        check_leftpad_values(values[1], values[0])


def _run(name: str, make_plan, given: dict, aliases=None):
    """Execute the forward-only op ``name``'s plan (differentiating through it fails, naming the op)."""
    names = make_plan(INTERPRETER).inputs
    arrays = match_varying(*[given[n] for n in names])
    return forward_only(name, lambda *a: execute(make_plan, dict(zip(names, a)), aliases=aliases), *arrays)


@jit_op("shape", "options", "splits", "return_lse")
def _decode_op(arrays: dict, *, shape, options, splits, return_lse):
    out, lse = _run("decode_attention", lambda target: plan_decode(shape, options, target=target, num_splits=splits),
                    arrays)
    return (out, lse) if return_lse else out


@jit_op("n", "rows", "dim", "dtype", "rows_shape")
def _merge_op(outs, lses, *, n, rows, dim, dtype, rows_shape):
    out, lse = _run("merge_attention_states", lambda target: plan_merge(n, rows, dim, dtype, target=target),
                    {"outs": outs.reshape(n, rows, dim), "lses": lses.reshape(n, rows)})
    return out.reshape(*rows_shape, dim), lse.reshape(rows_shape)


@jit_op("shape", "shared_len", "options", "splits", "return_lse")
def _cascade_op(arrays: dict, *, shape, shared_len, options, splits, return_lse):
    out, lse = _run("cascade_attention",
                    lambda target: plan_cascade(shape, shared_len, options, target=target, num_splits=splits), arrays)
    return (out, lse) if return_lse else out


@jit_op("shape")
def _append_op(arrays: dict, *, shape):
    # the kernel writes through its k_out / v_out outputs, which take over the caches' buffers
    return _run("append_kv_cache", lambda target: plan_append(shape, target=target), arrays,
                aliases={"k_out": "k_cache", "v_out": "v_cache"})


# ----------------------------------------------------------------------------------------------- public

def decode_attention(q: Array, k_cache: Array, v_cache: Array, *, cache_seqlens: Array,
                     block_table: Optional[Array] = None, kv_layout: str = "NHD",
                     softmax_scale: Optional[float] = None, causal: bool = True,
                     window_size: tuple[int, int] = (-1, -1), alibi_slopes: Optional[Array] = None,
                     softcap: float = 0.0, sinks: Optional[Array] = None, k_scale: Optional[Array] = None,
                     v_scale: Optional[Array] = None, num_splits: Optional[int] = None,
                     return_lse: bool = False, cache_leftpad: Optional[Array] = None,
                     rotary_cos: Optional[Array] = None, rotary_sin: Optional[Array] = None,
                     rotary_interleaved: bool = False) -> Array | tuple[Array, Array]:
    """Attention of a few query tokens per sequence over a (paged) KV cache, split-KV (Flash-Decoding).

    Same arguments, layouts and semantics as :func:`flashbridge.torch_api.decode_attention`: q
    ``(B, Sq, Hq, Dqk)``; caches ``(B, S_max, Hkv, D)`` / ``(B, Hkv, S_max, D)`` or paged ``(num_pages,
    page_size, Hkv, D)`` / ``(num_pages, Hkv, page_size, D)`` with int32 ``block_table`` ``(B, max_pages)``;
    int32 ``cache_seqlens`` ``(B,)``; FP8 (``jnp.float8_e4m3fn``) caches with float32 ``k_scale`` /
    ``v_scale`` (per tensor or per kv head), finite and > 0: concrete CPU / numpy scales are checked
    (ValueError), traced or GPU-resident ones are not read (a bad scale there gives a meaningless result).
    Query i of sequence b sits on key ``cache_seqlens[b] - Sq + i``. ``cache_leftpad`` int32 ``(B,)``
    (contiguous caches): sequence b's tokens are rows ``[cache_leftpad[b], cache_seqlens[b])``, positions
    counted from the first. ``rotary_cos`` / ``rotary_sin`` ``(S_rot, rotary_dim / 2)`` (and
    ``rotary_interleaved``): q is rotated as it is read, query i at position ``cache_seqlens[b] -
    cache_leftpad[b] - Sq + i`` (as flash-attn; without causal or a window all at ``... - Sq``).

    Non-finite values follow IEEE arithmetic, as the float64 reference (``flashbridge.reference``): a NaN in
    anything a row sees (its query, a visible cached key or value, its ALiBi slope or sink) makes the row's
    ``out`` NaN, and its ``lse`` NaN unless only values hold it, with any split count (a NaN partial is never
    merged away); a +inf score or sink gives lse +inf. Cache rows at or past ``cache_seqlens[b]`` are never
    read. Limit (as in every MMA-based attention): inside one key tile, a NaN *value* of a key that a row does
    not see (causal / window edges with several query tokens) reaches it through ``0 * NaN`` in ``p @ v``.

    Returns:
        ``out`` ``(B, Sq, Hq, Dv)`` in q's dtype, or ``(out, lse)`` with lse float32 ``(B, Hq, Sq)``.

    Performance: a small decode step takes less GPU time than the host needs to dispatch a jitted call.
    Put the generation loop inside one jitted function (``jax.lax.fori_loop`` / ``jax.lax.scan``
    over steps) so that cost is paid once per call, not once per step; XLA then runs the steps' kernels back
    to back (``benchmarks/bench_decode.py`` times the JAX rows that way).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> q = jnp.ones((2, 1, 8, 64), jnp.bfloat16)
        >>> k = v = jnp.ones((2, 256, 2, 64), jnp.bfloat16)
        >>> out = jax.jit(lambda q, k, v, n: decode_attention(q, k, v, cache_seqlens=n))(
        ...     q, k, v, jnp.array([100, 256], jnp.int32))
        >>> out.shape
        (2, 1, 8, 64)
    """
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens,
              "block_table": block_table, "alibi_slopes": alibi_slopes, "sinks": sinks, "k_scale": k_scale,
              "v_scale": v_scale, "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin}
    check_arrays(**arrays)
    shape, options, splits = check_decode_args(
        **{n: _info(a) for n, a in arrays.items()}, kv_layout=kv_layout, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, softcap=softcap, num_splits=num_splits,
        rotary_interleaved=rotary_interleaved)
    values = _host_values(cache_seqlens, block_table)
    if values is not None:
        check_cache_values(*values, shape.cache)
    _host_leftpad(cache_leftpad, cache_seqlens)
    check_scale_values(k_scale=host_list(k_scale), v_scale=host_list(v_scale))
    return _decode_op(arrays, shape=shape, options=options, splits=splits, return_lse=bool(return_lse))


def merge_attention_states(outs: Array, lses: Array) -> tuple[Array, Array]:
    """Exact merge of N attention states: ``lse = log sum_n exp(lses[n])``,
    ``out = sum_n exp(lses[n] - lse) outs[n]``. outs ``(N, ..., D)``, lses float32 ``(N, ...)``; returns
    ``(out (..., D), lse (...))``. A state with lse -inf contributes nothing; a NaN out or lse in any other
    state makes the row NaN. See :func:`flashbridge.torch_api.merge_attention_states`.

    Example::

        >>> import jax.numpy as jnp
        >>> out, lse = merge_attention_states(jnp.ones((2, 4, 8, 64)), jnp.zeros((2, 4, 8)))
        >>> out.shape, lse.shape
        ((4, 8, 64), (4, 8))
    """
    check_arrays(outs=outs, lses=lses)
    for name, a in (("outs", outs), ("lses", lses)):
        if a is None:
            raise TypeError(f"{name}: expected a jax.Array, got None")
    n, rows_shape, dim, dtype = check_merge_args(_info(outs), _info(lses))
    rows = int(np.prod(rows_shape, dtype=np.int64))
    return _merge_op(outs, lses, n=n, rows=rows, dim=dim, dtype=dtype, rows_shape=tuple(rows_shape))


def cascade_attention(q: Array, shared_k: Array, shared_v: Array, k_cache: Array, v_cache: Array, *,
                      cache_seqlens: Array, block_table: Optional[Array] = None, kv_layout: str = "NHD",
                      softmax_scale: Optional[float] = None, causal: bool = True, softcap: float = 0.0,
                      sinks: Optional[Array] = None, k_scale: Optional[Array] = None,
                      v_scale: Optional[Array] = None, num_splits: Optional[int] = None,
                      return_lse: bool = False) -> Array | tuple[Array, Array]:
    """Decode over ``concat(shared prefix, own cache)``, the shared prefix read once for the batch, merged
    exactly. ``shared_k`` / ``shared_v``: ``(S_shared, Hkv, D)`` (NHD) or ``(Hkv, S_shared, D)`` (HND) in the
    cache's dtype. See :func:`flashbridge.torch_api.cascade_attention`.

    Example::

        >>> import jax.numpy as jnp
        >>> q = jnp.ones((4, 1, 8, 64)); shared = jnp.ones((512, 2, 64)); cache = jnp.ones((4, 64, 2, 64))
        >>> out = cascade_attention(q, shared, shared, cache, cache, cache_seqlens=jnp.full((4,), 30, jnp.int32))
        >>> out.shape
        (4, 1, 8, 64)
    """
    arrays = {"q": q, "shared_k": shared_k, "shared_v": shared_v, "k_cache": k_cache, "v_cache": v_cache,
              "cache_seqlens": cache_seqlens, "block_table": block_table, "sinks": sinks, "k_scale": k_scale,
              "v_scale": v_scale}
    check_arrays(**arrays)
    shape, shared_len, options, splits = check_cascade_args(
        **{n: _info(a) for n, a in arrays.items()}, kv_layout=kv_layout, softmax_scale=softmax_scale,
        causal=causal, softcap=softcap, num_splits=num_splits)
    values = _host_values(cache_seqlens, block_table)
    if values is not None:
        check_cache_values(*values, shape.cache)
    check_scale_values(k_scale=host_list(k_scale), v_scale=host_list(v_scale))
    return _cascade_op(arrays, shape=shape, shared_len=shared_len, options=options, splits=splits,
                       return_lse=bool(return_lse))


# ----------------------------------------------------------------------------------------------- append

def append_kv_cache(k_cache: Array, v_cache: Array, k_new: Array, v_new: Array, *, cache_seqlens: Array,
                    block_table: Optional[Array] = None, kv_layout: str = "NHD", k_scale: Optional[Array] = None,
                    v_scale: Optional[Array] = None, cache_leftpad: Optional[Array] = None,
                    rotary_cos: Optional[Array] = None, rotary_sin: Optional[Array] = None,
                    rotary_interleaved: bool = False) -> tuple[Array, Array]:
    """Return ``(k_cache, v_cache)`` with token s of ``k_new[b]`` written at row ``cache_seqlens[b] + s`` of
    sequence b (lengths before the append). FP8 caches store ``clip(new / scale, -448, 448)`` rounded to
    e4m3 (NaN as e4m3's NaN); the scales must be finite and > 0 (checked when concrete on the CPU). On a GPU
    the outputs alias the inputs: donate the caches under jit to update them in place. ``rotary_cos`` /
    ``rotary_sin`` ``(S_rot, rotary_dim / 2)``: the new keys are rotated as they are written, token s at
    position ``cache_seqlens[b] - cache_leftpad[b] + s`` (``cache_leftpad`` int32 ``(B,)``, contiguous
    caches, default 0), rounded to k_new's dtype: as ``rotary_embedding`` then the append.
    See :func:`flashbridge.torch_api.append_kv_cache`.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> k, v = jnp.zeros((2, 64, 2, 32)), jnp.zeros((2, 64, 2, 32))
        >>> new = jnp.ones((2, 1, 2, 32))
        >>> step = jax.jit(append_kv_cache, donate_argnums=(0, 1))
        >>> k, v = step(k, v, new, new, cache_seqlens=jnp.array([5, 9], jnp.int32))
        >>> float(k[1, 9].sum()), float(k[1, 10].sum())
        (64.0, 0.0)
    """
    arrays = {"k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
              "cache_seqlens": cache_seqlens, "block_table": block_table, "k_scale": k_scale, "v_scale": v_scale,
              "cache_leftpad": cache_leftpad, "rotary_cos": rotary_cos, "rotary_sin": rotary_sin}
    check_arrays(**arrays)
    shape = check_append_args(**{n: _info(a) for n, a in arrays.items()}, kv_layout=kv_layout,
                              rotary_interleaved=rotary_interleaved)
    values = _host_values(cache_seqlens, block_table)
    if values is not None:
        check_cache_values(*values, shape.cache, new_tokens=shape.new_tokens)
    _host_leftpad(cache_leftpad, cache_seqlens)
    check_scale_values(k_scale=host_list(k_scale), v_scale=host_list(v_scale))
    return _append_op(arrays, shape=shape)
