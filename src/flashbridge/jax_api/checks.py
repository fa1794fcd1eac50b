"""Value checks of index arrays that ``jax.jit`` cannot run on the host, as ``jax.experimental.checkify``
checks.

The ops validate index arrays (packed offsets, cache lengths, page tables, labels) on the host whenever
their values are there to read. Under ``jax.jit`` they are tracers: the kernels then only guarantee a
defined result (every access clamped, rows no sequence covers written as NaN, out-of-range labels giving
NaN losses). These functions state the same rules as ``checkify.check`` calls, so a jitted step can carry
them on the device and report the first violation::

    from jax.experimental import checkify
    from flashbridge.jax_api import checks, flash_attention

    def step(q, k, v, cu):
        checks.cu_seqlens(cu, total=q.shape[0], max_seqlen=128, name="cu_seqlens_q")
        return flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=128, max_seqlen_k=128)

    err, out = checkify.checkify(jax.jit(step))(q, k, v, cu)
    err.throw()  # ValueError-like JaxRuntimeError naming the argument

Called on concrete arrays outside ``checkify`` the checks raise at once; under ``jit`` they must be inside a
function transformed by ``checkify.checkify`` (JAX refuses an undischarged check). Each costs a few small
XLA reductions over the index array, nothing over the activations.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import checkify

Array = jax.Array


def cu_seqlens(cu_seqlens: Array, *, total: int, max_seqlen: Optional[int] = None,
               name: str = "cu_seqlens") -> None:
    """Packed offsets ``(n_seqs + 1,)``: start at 0, never decrease, end at ``total`` (the packed length),
    and (with ``max_seqlen``) no sequence longer than ``max_seqlen``: the rules ``flash_attention`` checks on
    the host for concrete offsets.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from jax.experimental import checkify
        >>> f = checkify.checkify(jax.jit(lambda cu: cu_seqlens(cu, total=8, max_seqlen=8)))
        >>> f(jnp.array([0, 5, 3, 8], jnp.int32))[0].get()
        'cu_seqlens: must be non-decreasing; first decrease after entry 1 (`check` failed)'
    """
    cu = jnp.asarray(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    checkify.check(cu[0] == 0, f"{name}: must start at 0, got {{}}", cu[0])
    checkify.check(jnp.all(lengths >= 0), f"{name}: must be non-decreasing; first decrease after entry {{}}",
                   jnp.argmax(lengths < 0))
    checkify.check(cu[-1] == total, f"{name}: the last offset ({{}}) must equal the packed length ({total})", cu[-1])
    if max_seqlen is not None:
        checkify.check(jnp.max(lengths) <= max_seqlen,
                       f"max_seqlen for {name}: {max_seqlen} is smaller than the longest sequence ({{}})",
                       jnp.max(lengths))


def cache_seqlens(cache_seqlens: Array, *, capacity: int, n_new: int = 0, name: str = "cache_seqlens") -> None:
    """Cache lengths ``(B,)``: ``0 <= cache_seqlens[b]`` and ``cache_seqlens[b] + n_new <= capacity`` (the
    rows per sequence: ``S_max`` of a contiguous cache, ``max_pages * page_size`` of a paged one); ``n_new``
    the tokens an ``append_kv_cache`` adds."""
    lengths = jnp.asarray(cache_seqlens)
    checkify.check(jnp.all(lengths >= 0), f"{name}: must be >= 0, got {{}} for sequence {{}}",
                   jnp.min(lengths), jnp.argmin(lengths))
    checkify.check(jnp.all(lengths + n_new <= capacity),
                   f"{name}: {{}} (+ {n_new} new tokens) exceeds the cache capacity {capacity} for sequence {{}}",
                   jnp.max(lengths), jnp.argmax(lengths))


def block_table(block_table: Array, *, num_pages: int, cache_seqlens: Optional[Array] = None,
                page_size: Optional[int] = None, n_new: int = 0, name: str = "block_table") -> None:
    """Page ids ``(B, max_pages)`` in ``[0, num_pages)``. With ``cache_seqlens`` and ``page_size`` only the
    entries a sequence reaches (its first ``cdiv(cache_seqlens[b] + n_new, page_size)`` pages) are checked:
    entries past a sequence's pages are never read."""
    table = jnp.asarray(block_table)
    used = jnp.ones(table.shape, bool)
    if cache_seqlens is not None:
        if page_size is None:
            raise ValueError("page_size: required with cache_seqlens")
        pages = (jnp.asarray(cache_seqlens) + n_new + page_size - 1) // page_size
        used = jnp.arange(table.shape[1])[None, :] < pages[:, None]
    bad = used & ((table < 0) | (table >= num_pages))
    checkify.check(~jnp.any(bad), f"{name}: page ids must be in [0, {num_pages}); entry {{}} holds {{}}",
                   jnp.argmax(bad.reshape(-1)), table.reshape(-1)[jnp.argmax(bad.reshape(-1))])


def labels(labels: Array, *, vocab: int, ignore_index: int = -100, name: str = "labels") -> None:
    """Class labels in ``[0, vocab)`` or equal to ``ignore_index`` (the cross-entropy ops' rule)."""
    lab = jnp.asarray(labels).reshape(-1)
    bad = (lab != ignore_index) & ((lab < 0) | (lab >= vocab))
    checkify.check(~jnp.any(bad), f"{name}: must be in [0, {vocab}) or {ignore_index}; position {{}} holds {{}}",
                   jnp.argmax(bad), lab[jnp.argmax(bad)])
