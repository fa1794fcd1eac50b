"""SwiGLU for PyTorch: ``torch.library`` custom ops with fake kernels and autograd.

Two ops, ``flashbridge::swiglu_fwd`` and ``flashbridge::swiglu_bwd``; the backward saves only the inputs
and recomputes the sigmoid. Inputs whose rows are strided (e.g. the halves of ``x.chunk(2, -1)``) are read
in place on a GPU; other layouts are copied.
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..core_kernels.swiglu.plan import check_swiglu_args, plan_swiglu_bwd, plan_swiglu_fwd
from ._checks import check_tensors
from ._ops import fused_op
from ._runtime import dtype_name, execute, memoised, target_for

# validation and plans run once per distinct argument signature (see memoised)
check_swiglu_args, plan_swiglu_fwd, plan_swiglu_bwd = map(
    memoised, (check_swiglu_args, plan_swiglu_fwd, plan_swiglu_bwd))


def _rows(t: Tensor, width: int) -> Tensor:
    """``t`` as a (rows, width) view with contiguous columns (a copy when no such view exists, and always
    contiguous for the interpreter, whose float32 staging of bf16 would not keep a view's strides)."""
    t = t.reshape(-1, width)
    if t.device.type == "cpu" or t.stride(-1) != 1 or t.stride(0) < width:
        t = t.contiguous()
    return t


@fused_op("swiglu_fwd")
def _swiglu_fwd(gate: Tensor, up: Optional[Tensor]) -> Tensor:
    fused = up is None
    n_cols = gate.shape[-1] // 2 if fused else gate.shape[-1]
    g = _rows(gate, gate.shape[-1])
    u = g if fused else _rows(up, n_cols)
    plan = plan_swiglu_fwd(g.shape[0], n_cols, dtype=dtype_name(gate.dtype), fused=fused,
                           target=target_for(gate.device), strides=(g.stride(0), u.stride(0)))
    (y,) = execute(plan, {"x": g} if fused else {"gate": g, "up": u})
    return y.view(*gate.shape[:-1], n_cols)


@_swiglu_fwd.register_fake
def _(gate, up):
    return gate.new_empty((*gate.shape[:-1], gate.shape[-1] // 2 if up is None else gate.shape[-1]))


@fused_op("swiglu_bwd")
def _swiglu_bwd(dy: Tensor, gate: Tensor, up: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Returns (dgate, dup), or (dx, an empty tensor) when fused."""
    fused = up is None
    n_cols = dy.shape[-1]
    g = _rows(gate, gate.shape[-1])
    u = g if fused else _rows(up, n_cols)
    d = _rows(dy.to(gate.dtype), n_cols)
    plan = plan_swiglu_bwd(g.shape[0], n_cols, dtype=dtype_name(gate.dtype), fused=fused,
                           target=target_for(gate.device), strides=(d.stride(0), g.stride(0), u.stride(0)))
    if fused:
        (dx,) = execute(plan, {"dy": d, "x": g})
        return dx.view(gate.shape), gate.new_empty((0,))
    dgate, dup = execute(plan, {"dy": d, "gate": g, "up": u})
    return dgate.view(gate.shape), dup.view(gate.shape)


@_swiglu_bwd.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty((0,) if up is None else gate.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    if dy is None:
        return None, None
    dgate, dup = _swiglu_bwd(dy, gate, up)
    return dgate, (dup if up is not None else None)


_swiglu_fwd.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Optional[Tensor] = None) -> Tensor:
    """SwiGLU: ``silu(gate) * up``, or of one fused projection ``x = [gate | up]`` when ``up`` is None.

    Computed in float32, returned in the inputs' dtype; the backward recomputes the activation from the
    saved inputs (no intermediate is kept).

    Args:
        gate: ``(..., I)`` float32 / float16 / bfloat16 on a CUDA device or the CPU (Triton interpreter);
            without ``up``, ``(..., 2I)`` whose first half is the gate and second half the up projection
            (the layout of a fused ``gate_up_proj``, e.g. Phi-3's).
        up: ``(..., I)``, gate's shape and dtype, or None.

    Returns:
        ``(..., I)`` in the inputs' dtype.

    Example::

        >>> import torch
        >>> gate, up = torch.randn(4, 96), torch.randn(4, 96)
        >>> swiglu(gate, up).shape
        torch.Size([4, 96])
        >>> swiglu(torch.cat([gate, up], dim=-1)).equal(swiglu(gate, up))
        True
    """
    check_tensors({"gate": gate, "up": up}, required=("gate",))
    check_swiglu_args(gate=(tuple(gate.shape), dtype_name(gate.dtype)),
                      up=None if up is None else (tuple(up.shape), dtype_name(up.dtype)))
    return _swiglu_fwd(gate, up)
