"""Launch plans for SwiGLU (pure Python: shapes and options in, a Plan out).

Inputs are viewed as ``(n_rows, n_cols)`` with a row stride each and contiguous columns (every leading
dimension is a row); fused, ``x`` is ``(n_rows, 2 * n_cols)`` = [gate | up]. Outputs are contiguous.
"""
from __future__ import annotations

import dataclasses
import functools

from .._plan import (FLOAT_DTYPES, Launch, Plan, Spec, Target, cdiv, check_float_dtype, fmt_shape, next_power_of_2,
                     pow2_divisor)

_KERNELS = "swiglu.kernels"


@dataclasses.dataclass(frozen=True)
class SwigluConfig:
    """Block sizes. ``None`` picks the default for the target.

    block_n: columns per program (a power of two). Default on a GPU: the largest of 2048 .. 256 that divides
        the row (no masked tail), else 2048 (or the row, if narrower).
    block_m: rows per program. Default: ``elements // block_n`` (at least one, at most the rows).
    num_warps: warps per program. Default: 16 elements per thread (two 16-byte vectors per bf16 tensor),
        4 to 8 warps; at 32 per thread the backward took 128 registers a thread on sm_90, at 16 it takes 48.
    elements: the per-program element budget of the default block_m.
    """

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    elements: int = 4096


def check_swiglu_args(*, gate, up=None) -> tuple[int, int]:
    """Validate a SwiGLU call from (shape, dtype-name) pairs; returns (n_rows, n_cols) of the output. Shared
    by both front-ends so that both raise the same errors, before any launch."""
    shape, dtype = gate
    check_float_dtype("gate", dtype)
    if len(shape) < 1:
        raise ValueError("gate: expected at least one dimension, got a scalar")
    if any(d < 1 for d in shape):
        raise ValueError(f"gate: empty tensor of shape {fmt_shape(shape)}")
    n_cols = shape[-1]
    if up is None:
        if n_cols % 2:
            raise ValueError(f"gate: without up, the last dimension holds [gate | up] and must be even, got {n_cols}")
        n_cols //= 2
    else:
        check_float_dtype("up", up[1])
        if tuple(up[0]) != tuple(shape):
            raise ValueError(f"up: expected the shape of gate {fmt_shape(shape)}, got {fmt_shape(up[0])}")
        if up[1] != dtype:
            raise TypeError(f"up: dtype {up[1]} must match gate ({dtype})")
    n_rows = 1
    for d in shape[:-1]:
        n_rows *= d
    return n_rows, n_cols


def _tile(n_rows: int, n_cols: int, target: Target, config: SwigluConfig) -> tuple[int, int, int]:
    if config.block_n is not None:
        block_n = config.block_n
    elif target.interpret:  # the interpreter pays per program: whole rows
        block_n = next_power_of_2(n_cols)
    else:
        block_n = next((b for b in (2048, 1024, 512, 256) if n_cols % b == 0), min(2048, next_power_of_2(n_cols)))
    budget = 1 << 15 if target.interpret else config.elements
    block_m = config.block_m or max(1, min(next_power_of_2(n_rows), budget // block_n))
    return block_m, block_n, config.num_warps or max(4, min(8, block_m * block_n // (32 * 16)))


def _launch(kernel, n_rows, n_cols, inputs, scalars, outputs, constexprs, target, config) -> Launch:
    block_m, block_n, num_warps = _tile(n_rows, n_cols, target, config)
    strides = [v for name, v in scalars if name.startswith("stride")]
    return Launch(
        kernel=f"{_KERNELS}:{kernel}", grid=(cdiv(n_rows, block_m) * cdiv(n_cols, block_n),), inputs=inputs,
        scalars=(("n_rows", n_rows), *scalars), outputs=outputs,
        constexprs=(("N_COLS", n_cols), *constexprs, ("BLOCK_M", block_m), ("BLOCK_N", block_n),
                    ("STRIDE_ALIGN", pow2_divisor(*strides))),
        num_warps=num_warps, num_stages=1)


@functools.lru_cache(maxsize=1024)
def plan_swiglu_fwd(n_rows: int, n_cols: int, *, dtype: str, fused: bool, target: Target,
                    strides: tuple[int, int] | None = None, config: SwigluConfig = SwigluConfig()) -> Plan:
    """Plan inputs: gate, up (each ``(n_rows, n_cols)``) or, fused, x ``(n_rows, 2 * n_cols)``.

    ``strides``: the inputs' row strides in elements (gate's and up's; fused: x's twice); default
    contiguous. Result: y ``(n_rows, n_cols)`` in ``dtype``.
    """
    assert dtype in FLOAT_DTYPES
    width = 2 * n_cols if fused else n_cols
    stride_g, stride_u = strides or (width, width)
    inputs = ("x", "x") if fused else ("gate", "up")
    launch = _launch("swiglu_fwd_kernel", n_rows, n_cols, inputs, (("stride_g", stride_g), ("stride_u", stride_u)),
                     ("y",), (("UP_OFFSET", n_cols if fused else 0),), target, config)
    return Plan(inputs=tuple(dict.fromkeys(inputs)), buffers=(Spec("y", (n_rows, n_cols), dtype),),
                launches=(launch,), results=("y",))


@functools.lru_cache(maxsize=1024)
def plan_swiglu_bwd(n_rows: int, n_cols: int, *, dtype: str, fused: bool, target: Target,
                    strides: tuple[int, int, int] | None = None, config: SwigluConfig = SwigluConfig()) -> Plan:
    """Plan inputs: dy ``(n_rows, n_cols)``, then gate, up or, fused, x.

    ``strides``: row strides of dy, gate, up (fused: x's twice); default contiguous. Results: dgate, dup
    ``(n_rows, n_cols)`` or, fused, dx ``(n_rows, 2 * n_cols)``, in ``dtype``.
    """
    assert dtype in FLOAT_DTYPES
    width = 2 * n_cols if fused else n_cols
    stride_dy, stride_g, stride_u = strides or (n_cols, width, width)
    inputs = ("dy", "x", "x") if fused else ("dy", "gate", "up")
    if fused:
        buffers = (Spec("dx", (n_rows, 2 * n_cols), dtype), Spec("unused", (0,), dtype))
        outputs, results = ("dx", "unused"), ("dx",)
    else:
        buffers = (Spec("dgate", (n_rows, n_cols), dtype), Spec("dup", (n_rows, n_cols), dtype))
        outputs = results = ("dgate", "dup")
    launch = _launch("swiglu_bwd_kernel", n_rows, n_cols, inputs,
                     (("stride_dy", stride_dy), ("stride_g", stride_g), ("stride_u", stride_u)), outputs,
                     (("UP_OFFSET", n_cols if fused else 0), ("FUSED", fused)), target, config)
    return Plan(inputs=tuple(dict.fromkeys(inputs)), buffers=buffers, launches=(launch,), results=results)
