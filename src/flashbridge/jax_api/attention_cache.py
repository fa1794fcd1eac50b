"""flash_attention over a key cache (JAX): keys from a paged cache through ``block_table`` and / or bounded
per sequence by ``seqused_k`` (flash-attn's ``flash_attn_varlen_func(..., block_table=, seqused_k=)``,
chunked prefill in serving). Forward only: ``jax.grad`` through it fails while it traces, naming the call.
The same kernel and plan as the torch front-end (``core_kernels/flash_attn/kernels_fwd.py``)."""
from __future__ import annotations

from ..core_kernels import INTERPRETER
from ..core_kernels._plan import memoised
from ..core_kernels.flash_attn.plan import CACHE_OP, check_cache_offsets, check_kv_cache_args, plan_attention_fwd
from ._checks import forward_only, host_list
from ._runtime import dtype_name, execute, jit_op, match_varying

check_kv_cache_args, plan_attention_fwd = memoised(check_kv_cache_args), memoised(plan_attention_fwd)


def _info(a):
    return None if a is None else (tuple(a.shape), dtype_name(a.dtype))


def cache_attention(q, k, v, *, block_table, seqused_k, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q, max_seqlen_k, **score_options):
    """flash_attention's ``block_table`` / ``seqused_k`` forms (arguments as flash_attention's, already
    type-checked): validate, check host offsets, run the forward-only kernel. Returns (out, lse)."""
    given = {"q": q, "k": k, "v": v, "alibi_slopes": alibi_slopes, "sinks": sinks, "cu_seqlens_q": cu_seqlens_q,
             "cu_seqlens_k": cu_seqlens_k, "block_table": block_table, "seqused_k": seqused_k}
    shape, options, cache = check_kv_cache_args(
        **{n: _info(a) for n, a in given.items()}, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        **score_options)
    offsets_q, offsets_k = host_list(cu_seqlens_q), host_list(cu_seqlens_k)
    if shape.varlen and offsets_q is not None and (cu_seqlens_k is None or offsets_k is not None):
        check_cache_offsets(offsets_q, offsets_k, shape, cache)

    names = plan_attention_fwd(shape, options, target=INTERPRETER, cache=cache).inputs
    return _cache_op(tuple(given[n] for n in names), names=names, shape=shape, options=options, cache=cache)


@jit_op("names", "shape", "options", "cache")
def _cache_op(arrays, *, names, shape, options, cache):
    def make_plan(target):
        return plan_attention_fwd(shape, options, target=target, cache=cache)

    return forward_only(CACHE_OP, lambda *a: execute(make_plan, dict(zip(names, a))), *match_varying(*arrays))
