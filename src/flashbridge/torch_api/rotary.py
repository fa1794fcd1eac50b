"""Rotary position embeddings for PyTorch: ``torch.library`` custom ops with fake kernels and autograd.

``flashbridge::rotary`` is the functional op (its backward is the same op rotating the other way);
``flashbridge::rotary_`` writes through its inputs and declares them in ``mutates_args``, so torch.compile
functionalises it correctly. Inputs with strided tokens and heads (e.g. q and k sliced out of a packed qkv
projection) are read, and updated in place, without a copy on a GPU, as long as the head dim is contiguous.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..core_kernels.rotary.plan import check_rotary_args, check_rotary_values, plan_rotary
from ._checks import check_tensors
from ._ops import fused_op
from ._runtime import dtype_name, execute, memoised, target_for

# validation and plans run once per distinct argument signature (see memoised)
check_rotary_args, plan_rotary = memoised(check_rotary_args), memoised(plan_rotary)


def _info(t: Optional[Tensor]):
    return None if t is None else (tuple(t.shape), dtype_name(t.dtype))


# Shapes are checked by the public functions and looked up again by the ops' implementations: cached (the
# arguments are hashable), except while torch.compile traces, which would warn about the cache.
_cached_check = functools.lru_cache(maxsize=1024)(check_rotary_args)


def _shape(x, k, cos, sin, position_ids, cu_seqlens, x_name="x", check=_cached_check):
    return check(x=_info(x), k=_info(k), cos=_info(cos), sin=_info(sin), position_ids=_info(position_ids),
                 cu_seqlens=_info(cu_seqlens), x_name=x_name)


def _token_strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, sequence, head) strides; a packed (T, H, D) tensor has one "batch" (stride 0)."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, t.stride(0), t.stride(1))


def _readable(t: Optional[Tensor]) -> Optional[Tensor]:
    """As the kernel reads it: any strides with a contiguous head dim on a GPU; contiguous for the
    interpreter (whose float32 staging of bf16 would not keep a view's strides)."""
    if t is not None and (t.device.type == "cpu" or t.stride(-1) != 1):
        t = t.contiguous()
    return t


def _writable_in_place(t: Tensor) -> bool:
    """The kernel can write through ``t`` itself: contiguous head dim and no two elements sharing memory
    (dims sorted by stride, each step past the previous dim's extent; expanded tensors fail this)."""
    if t.device.type == "cpu":
        return True  # the CPU runtime stages a contiguous copy and copies it back
    if t.stride(-1) != 1:
        return False
    extent = 1
    for stride, size in sorted((t.stride(d), t.size(d)) for d in range(t.dim()) if t.size(d) > 1):
        if stride < extent:
            return False
        extent = stride * size
    return True


def _run(x, k, cos, sin, position_ids, cu_seqlens, interleaved, conjugate, inplace):
    shape = _shape(x, k, cos, sin, position_ids, cu_seqlens)
    # in place on a GPU the kernel reads and writes x / k themselves; on the CPU execute stages them as
    # contiguous outputs, as _readable makes the inputs
    x_in, k_in = (x, k) if inplace and x.device.type != "cpu" else (_readable(x), _readable(k))
    plan = plan_rotary(shape, dtype=dtype_name(x.dtype), interleaved=interleaved, conjugate=conjugate,
                       inplace=inplace, target=target_for(x.device),
                       strides=(_token_strides(x_in), None if k is None else _token_strides(k_in)))
    given = {"x": x_in, "k": k_in, "cos": cos.contiguous(), "sin": sin.contiguous(),
             "position_ids": None if position_ids is None else position_ids.contiguous(),
             "cu_seqlens": None if cu_seqlens is None else cu_seqlens.contiguous()}
    out = {"out": x, **({"out_k": k} if k is not None else {})} if inplace else None
    return execute(plan, {n: given[n] for n in plan.inputs}, out=out)


@fused_op("rotary", replay=True)
def _rotary(x: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
            cu_seqlens: Optional[Tensor], interleaved: bool, conjugate: bool) -> tuple[Tensor, Tensor]:
    """Returns (x rotated, k rotated); the second is empty without k."""
    results = _run(x, k, cos, sin, position_ids, cu_seqlens, interleaved, conjugate, inplace=False)
    return results[0], results[1] if k is not None else x.new_empty((0,))


@_rotary.register_fake
def _(x, k, cos, sin, position_ids, cu_seqlens, interleaved, conjugate):
    return x.new_empty(x.shape), (k.new_empty(k.shape) if k is not None else x.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    x, k, cos, sin, position_ids, cu_seqlens, interleaved, conjugate = inputs
    ctx.save_for_backward(cos, sin, position_ids, cu_seqlens)  # a rotation: x itself is not needed
    ctx.options = (interleaved, conjugate, x.shape, x.dtype, None if k is None else k.shape)


def _backward(ctx, dout, dout_k):
    cos, sin, position_ids, cu_seqlens = ctx.saved_tensors
    interleaved, conjugate, x_shape, dtype, k_shape = ctx.options
    if dout is None:
        dout = cos.new_zeros(x_shape, dtype=dtype)
    if k_shape is not None and dout_k is None:
        dout_k = cos.new_zeros(k_shape, dtype=dtype)
    dx, dk = _rotary(dout, dout_k if k_shape is not None else None, cos, sin, position_ids, cu_seqlens,
                     interleaved, not conjugate)
    return dx, (dk if k_shape is not None else None), None, None, None, None, None, None


_rotary.register_autograd(_backward, setup_context=_setup_context)


@fused_op("rotary_", mutates_args=("x", "k"))
def _rotary_inplace(x: Tensor, k: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Optional[Tensor],
                    cu_seqlens: Optional[Tensor], interleaved: bool) -> None:
    _run(x, k, cos, sin, position_ids, cu_seqlens, interleaved, False, inplace=True)
    # the kernel wrote through the tensors behind autograd's back (the eager fast path skips the
    # dispatcher, which bumps the versions of mutated arguments): a graph that saved them must notice
    for t in (x, k):
        if t is not None:
            torch.autograd.graph.increment_version(t)


@_rotary_inplace.register_fake
def _(x, k, cos, sin, position_ids, cu_seqlens, interleaved):
    return None


def _apply(x, k, cos, sin, *, interleaved, inplace, position_ids, cu_seqlens):
    x_name = "x" if k is None else "q"
    tensors = {x_name: x, "k": k, "cos": cos, "sin": sin, "position_ids": position_ids, "cu_seqlens": cu_seqlens}
    check_tensors(tensors, required=(x_name, "cos", "sin"))
    check = check_rotary_args if torch.compiler.is_compiling() else _cached_check
    shape = _shape(x, k, cos, sin, position_ids, cu_seqlens, x_name, check=check)
    if not torch.compiler.is_compiling():  # index values are checked where reading them is free: CPU tensors
        host = {n: t.reshape(-1).tolist() for n, t in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens))
                if t is not None and t.device.type == "cpu"}
        if host:
            check_rotary_values(shape, **host)
    interleaved = bool(interleaved)
    if not inplace:
        return _rotary(x, k, cos, sin, position_ids, cu_seqlens, interleaved, False)
    grad = torch.is_grad_enabled() and (x.requires_grad or (k is not None and k.requires_grad))
    if grad or not all(_writable_in_place(t) for t in (x, k) if t is not None):
        # Autograd cannot record a kernel that overwrites its input (a mutating op has no derivative
        # formula): rotate out of place, then copy into x / k, which autograd does record.
        out, out_k = _rotary(x, k, cos, sin, position_ids, cu_seqlens, interleaved, False)
        x.copy_(out)
        if k is not None:
            k.copy_(out_k)
    else:
        _rotary_inplace(x, k, cos, sin, position_ids, cu_seqlens, interleaved)
    return x, k


def rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False, inplace: bool = False,
                     position_ids: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Rotary position embedding (RoPE) of the first ``rotary_dim = 2 * cos.shape[1]`` dims of every head,
    as flash-attn's ``apply_rotary_emb``; the other dims pass through unchanged.

    For position p and pair i: ``(y_a, y_b) = (x_a cos[p, i] - x_b sin[p, i], x_b cos[p, i] + x_a sin[p, i])``,
    ``(a, b) = (i, i + rotary_dim / 2)`` (GPT-NeoX / Llama halves) or ``(2i, 2i + 1)`` with ``interleaved``
    (GPT-J pairs). Computed in float32, returned in x's dtype. The gradient of x is the inverse rotation;
    ``cos`` and ``sin`` get no gradient (as in flash-attn).

    Args:
        x: ``(B, S, H, D)`` or packed ``(T, H, D)``, float32 / float16 / bfloat16, CUDA or CPU (Triton
            interpreter). Any strides with a contiguous head dim are read without a copy on a GPU.
        cos, sin: ``(S_rot, rotary_dim / 2)`` float tables (any float dtype, the same for both),
            ``rotary_dim <= D``. (A Hugging Face table of shape ``(S, D)`` holds each half twice: pass
            ``cos[:, :D // 2]``.)
        interleaved: rotate pairs of neighbouring dims (GPT-J) instead of the two halves (GPT-NeoX).
        inplace: write the result into x and return x. The kernel writes through x itself where x's memory
            allows it (contiguous head dim, no overlap) and no gradient is being recorded; when x requires
            grad, the result is computed out of place and copied into x (autograd records the copy).
        position_ids: optional int32 / int64 positions indexing the table's rows: ``(B, S)`` or ``(1, S)``,
            ``(T,)`` for packed x. Default: ``0 .. S - 1`` in every sequence.
        cu_seqlens: int32 / int64 ``(N + 1,)`` sequence boundaries of a packed x; positions restart at 0 in
            every sequence (no ``max_seqlen`` needed). Either this or position_ids, not both.

    Positions are checked against the table on CPU tensors; on a GPU they are not read on the host (no
    sync): a position outside the table reads its nearest row, never memory outside it.

    Returns:
        The rotated tensor, x's shape and dtype (x itself with ``inplace``).

    Example::

        >>> from flashbridge.reference.rotary import cos_sin_table
        >>> cos, sin = (torch.tensor(t, dtype=torch.float32) for t in cos_sin_table(128, 64))
        >>> q = torch.randn(2, 100, 4, 64)
        >>> rotary_embedding(q, cos, sin).shape
        torch.Size([2, 100, 4, 64])
        >>> packed = q[0]  # one sequence of 100 tokens, packed
        >>> y = rotary_embedding(packed, cos, sin, cu_seqlens=torch.tensor([0, 100], dtype=torch.int32))
        >>> torch.equal(y, rotary_embedding(q, cos, sin)[0])
        True
    """
    out = _apply(x, None, cos, sin, interleaved=interleaved, inplace=inplace, position_ids=position_ids,
                 cu_seqlens=cu_seqlens)
    return out[0]


def rotary_embedding_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False,
                        inplace: bool = False, position_ids: Optional[Tensor] = None,
                        cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """:func:`rotary_embedding` of q and k in one launch (each token's cos / sin row loaded once for both).

    Args:
        q: ``(B, S, Hq, D)`` or packed ``(T, Hq, D)``.
        k: ``(B, S, Hk, D)`` or ``(T, Hk, D)``: q's tokens, head dim and dtype, any number of heads.
        cos, sin, interleaved, inplace, position_ids, cu_seqlens: as :func:`rotary_embedding`.

    Returns:
        ``(q rotated, k rotated)`` (q and k themselves with ``inplace``).

    Example::

        >>> from flashbridge.reference.rotary import cos_sin_table
        >>> cos, sin = (torch.tensor(t, dtype=torch.float32) for t in cos_sin_table(64, 32))
        >>> q, k = torch.randn(1, 64, 8, 32), torch.randn(1, 64, 2, 32)
        >>> q2, k2 = rotary_embedding_qk(q, k, cos, sin)
        >>> torch.equal(k2, rotary_embedding(k, cos, sin))
        True
    """
    if k is None:
        raise TypeError("k: expected a torch.Tensor, got None (use rotary_embedding for one tensor)")
    return _apply(q, k, cos, sin, interleaved=interleaved, inplace=inplace, position_ids=position_ids,
                  cu_seqlens=cu_seqlens)
