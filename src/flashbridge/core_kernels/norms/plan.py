"""Launch plans for the fused-norm family (pure Python: shapes and options in, a Plan out).

Inputs are viewed as ``(n_rows, n_cols)``: every leading dimension is a row. The front-ends pass
C-contiguous arrays (they copy non-contiguous ones), so the row stride is ``n_cols``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from .._config import active_config
from .._plan import (FLOAT_DTYPES, Launch, Plan, Spec, Target, cdiv, check_float_dtype, check_real,
                     next_power_of_2)

MAX_COLS = 65536  # one row lives in one program's registers; wider rows would spill to local memory
_KERNELS = "norms.kernels"


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Tiles of the norm kernels; ``None`` picks the target's default. The GPU defaults were swept on an
    H200 with Triton 3.6 (bf16, widths 2048 and 8192, benchmarks/bench_norms.py --tune).

    block_m: rows per program (a power of two). Default on a GPU: about 8K elements per program in the
        forward (narrow rows still keep enough bytes in flight; one row from 8K columns up), 8-16K and at
        most 4 rows in the backward.
    num_warps: warps per program. Default: about 16 elements per thread, 4 to 16 warps.
    bwd_programs_per_sm: persistent backward programs per SM (each keeps one partial dweight row).
    bwd_num_stages: software-pipelining depth of the backward's row-tile loop.
    log2_chunks: LayerNorm statistics merge 2**log2_chunks exact per-chunk (count, mean, M2) triples
        with Welford/Chan's parallel formula (capped by the block width; RMSNorm needs no chunks). Two
        parts: the Welford/Chan merge at the smallest cost (more parts were slower on the H200).
    """

    block_m: int | None = None
    num_warps: int | None = None
    bwd_programs_per_sm: int = 2
    bwd_num_stages: int = 1
    log2_chunks: int = 1


def _warps(block_m: int, block_n: int) -> int:
    """Warps for a tile of ``block_m`` x ``block_n`` elements: about 16 a thread, 4 to 16 warps (the rule
    for a ``block_m`` given without ``num_warps``, and for the interpreter)."""
    return max(4, min(16, block_m * block_n // 1024))


def _tile(n_rows: int, n_cols: int, target: Target, config: NormConfig, backward: bool, dtype: str = "bfloat16"
          ) -> tuple[int, int, int]:
    """(rows per program, padded width, warps): ``config``'s, else the tuning cache's for the padded width,
    dtype and row count on the target's GPU (:mod:`flashbridge.tiles.cache`); see :class:`NormConfig`."""
    block_n = next_power_of_2(n_cols)
    if config.block_m is not None:
        block_m = config.block_m
    elif target.interpret:
        # The interpreter pays per program, not per element: take big tiles.
        block_m = min(next_power_of_2(n_rows), max(1, 16384 // block_n))
    else:
        from ...tiles import cache
        from ...tiles.model import RowsCase, Tile

        kernel = "norm_bwd" if backward else "norm_fwd"
        fallback = Tile(1, block_n, _warps(1, block_n), 1)
        tile = cache.plan_tile(kernel, target, f"n{block_n}-{dtype}", f"r{cache.length_bucket(n_rows)}",
                               lambda: RowsCase(n_rows, n_cols, dtype, backward), fallback)
        return tile.block_m, block_n, config.num_warps or tile.num_warps
    return block_m, block_n, config.num_warps or _warps(block_m, block_n)


def check_norm_args(
    *, x: tuple[tuple[int, ...], str], weight: tuple[tuple[int, ...], str] | None = None,
    bias: tuple[tuple[int, ...], str] | None = None, residual: tuple[tuple[int, ...], str] | None = None,
    post_residual: tuple[tuple[int, ...], str] | None = None, eps: float, dropout_p: float = 0.0,
) -> tuple[int, int]:
    """Validate a norm call from (shape, dtype-name) pairs; returns (n_rows, n_cols). Shared by both
    front-ends so that both raise the same errors, before any launch."""
    shape, dtype = x
    check_float_dtype("x", dtype)
    if len(shape) < 1:
        raise ValueError("x: expected at least one dimension (the normalised one), got a scalar")
    n_cols = shape[-1]
    n_rows = 1
    for d in shape[:-1]:
        n_rows *= d
    if n_cols < 1 or n_rows < 1:
        raise ValueError(f"x: empty tensor of shape {tuple(shape)}; the norms need at least one element")
    if n_cols > MAX_COLS:
        raise ValueError(f"x: the last dimension is {n_cols}, but the norm kernels support at most "
                         f"{MAX_COLS} columns (a row must fit in one program's registers)")
    for name, arg in (("weight", weight), ("bias", bias)):
        if arg is None:
            continue
        if tuple(arg[0]) != (n_cols,):
            raise ValueError(f"{name}: expected shape ({n_cols},) to match the last dimension of x, "
                             f"got {tuple(arg[0])}")
        check_float_dtype(name, arg[1])
    # post_residual is layer_norm_dropout_residual's ``residual`` (added after the norm): errors use that name
    for name, arg in (("residual", residual), ("residual", post_residual)):
        if arg is None:
            continue
        if tuple(arg[0]) != tuple(shape):
            raise ValueError(f"{name}: expected the shape of x {tuple(shape)}, got {tuple(arg[0])}")
        if arg[1] not in (dtype, "float32"):
            raise TypeError(f"{name}: dtype {arg[1]} must match x ({dtype}) or be float32")
    check_real("eps", eps)
    if not 0 < eps < math.inf:
        raise ValueError(f"eps: must be > 0 and finite, got {eps}")
    check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1), got {dropout_p}")
    return n_rows, n_cols


def plan_norm_fwd(
    n_rows: int, n_cols: int, *, x_dtype: str, residual_dtype: str | None, is_rms: bool,
    has_weight: bool, has_bias: bool, has_post_residual: bool, dropout_p: float, eps: float,
    target: Target, config: NormConfig | None = None,
) -> Plan:
    """Plan inputs: x, [weight], [bias], [residual], [post_residual], [seed] (int32 (1,), with dropout).

    Results: y (x_dtype, ``(n_rows, n_cols)``), h (residual_dtype; a ``(0,)`` placeholder without a
    residual), mean (float32 ``(n_rows,)``; ``(0,)`` for RMSNorm), rstd (float32 ``(n_rows,)``).
    """
    return _plan_norm_fwd(n_rows, n_cols, x_dtype, residual_dtype, is_rms, has_weight, has_bias,
                          has_post_residual, dropout_p, eps, target, config or active_config(NormConfig))


@functools.lru_cache(maxsize=1024)  # plans are pure functions of hashable arguments: build each once
def _plan_norm_fwd(n_rows, n_cols, x_dtype, residual_dtype, is_rms, has_weight, has_bias, has_post_residual,
                   dropout_p, eps, target, config) -> Plan:
    assert x_dtype in FLOAT_DTYPES
    has_res = residual_dtype is not None
    has_dropout = dropout_p > 0.0
    present = {"x": True, "weight": has_weight, "bias": has_bias, "residual": has_res,
               "post_residual": has_post_residual, "seed": has_dropout}
    inputs = tuple(name for name, here in present.items() if here)
    block_m, block_n, num_warps = _tile(n_rows, n_cols, target, config, backward=False, dtype=x_dtype)
    log2_chunks = 0 if is_rms else min(config.log2_chunks, block_n.bit_length() - 1)
    buffers = (
        Spec("y", (n_rows, n_cols), x_dtype),
        Spec("h", (n_rows, n_cols) if has_res else (0,), residual_dtype or x_dtype),
        Spec("mean", (0,) if is_rms else (n_rows,), "float32"),
        Spec("rstd", (n_rows,), "float32"),
    )
    launch = Launch(
        kernel=f"{_KERNELS}:norm_fwd_kernel",
        grid=(cdiv(n_rows, block_m),),
        inputs=tuple(name if present[name] else "x" for name in present),
        scalars=(("n_rows", n_rows), ("eps", float(eps)), ("dropout_p", float(dropout_p))),
        outputs=("y", "h", "mean", "rstd"),
        constexprs=(("N_COLS", n_cols), ("BLOCK_M", block_m), ("LOG2_CHUNKS", log2_chunks),
                    ("CHUNK", block_n >> log2_chunks), ("IS_RMS", is_rms),
                    ("HAS_W", has_weight), ("HAS_B", has_bias), ("HAS_RES", has_res),
                    ("HAS_DROPOUT", has_dropout), ("HAS_POST_RES", has_post_residual)),
        num_warps=num_warps,
        num_stages=1,
    )
    return Plan(inputs=inputs, buffers=buffers, launches=(launch,), results=("y", "h", "mean", "rstd"))


def plan_norm_bwd(
    n_rows: int, n_cols: int, *, dx_dtype: str, weight_dtype: str | None, bias_dtype: str | None,
    is_rms: bool, has_dh: bool, dropout_p: float, target: Target, config: NormConfig | None = None,
) -> Plan:
    """Plan inputs: dy, h, [weight], [mean] (LayerNorm), rstd, [seed] (with dropout), [dh].

    ``h`` is the tensor that was normalised (x, or x + residual); ``dh`` the gradient arriving at the
    stored h output. Results: dx (dx_dtype; also the gradient of the residual), then dweight and dbias
    (in their parameters' dtypes) for the parameters that exist.
    """
    return _plan_norm_bwd(n_rows, n_cols, dx_dtype, weight_dtype, bias_dtype, is_rms, has_dh, dropout_p, target,
                          config or active_config(NormConfig))


@functools.lru_cache(maxsize=1024)
def _plan_norm_bwd(n_rows, n_cols, dx_dtype, weight_dtype, bias_dtype, is_rms, has_dh, dropout_p, target,
                   config) -> Plan:
    has_w, has_b = weight_dtype is not None, bias_dtype is not None
    has_dropout = dropout_p > 0.0
    present = {"dy": True, "h": True, "weight": has_w, "mean": not is_rms, "rstd": True,
               "seed": has_dropout, "dh": has_dh}
    block_m, block_n, num_warps = _tile(n_rows, n_cols, target, config, backward=True, dtype=dx_dtype)
    num_tiles = max(1, cdiv(n_rows, block_m))
    num_programs = min(num_tiles, max(1, target.num_sms * config.bwd_programs_per_sm))
    buffers = [
        Spec("dx", (n_rows, n_cols), dx_dtype),
        Spec("dw_part", (num_programs, n_cols) if has_w else (0,), "float32"),
        Spec("db_part", (num_programs, n_cols) if has_b else (0,), "float32"),
    ]
    launches = [Launch(
        kernel=f"{_KERNELS}:norm_bwd_kernel",
        grid=(num_programs,),
        inputs=tuple(name if present[name] else "dy" for name in present),
        scalars=(("n_rows", n_rows), ("dropout_p", float(dropout_p))),
        outputs=("dx", "dw_part", "db_part"),
        constexprs=(("N_COLS", n_cols), ("BLOCK_M", block_m), ("BLOCK_N", block_n),
                    ("NUM_PROGRAMS", num_programs), ("IS_RMS", is_rms), ("HAS_W", has_w),
                    ("HAS_B", has_b), ("HAS_DH", has_dh), ("HAS_DROPOUT", has_dropout)),
        num_warps=num_warps,
        num_stages=config.bwd_num_stages,
    )]
    results = ["dx"]
    for name, dtype in (("dweight", weight_dtype), ("dbias", bias_dtype)):
        if dtype is not None:
            buffers.append(Spec(name, (n_cols,), dtype))
            launches.append(sum_partials_launch(f"d{name[1]}_part", name, num_programs, n_cols, target))
            results.append(name)
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=tuple(buffers),
                launches=tuple(launches), results=tuple(results))


def sum_partials_launch(part: str, out: str, n_parts: int, n_cols: int, target: Target) -> Launch:
    """Sum a ``(n_parts, n_cols)`` float32 buffer over its rows, in a fixed order.

    Column blocks are narrow enough that the grid covers every SM (the partials are a few MB, read by
    latency-bound programs otherwise)."""
    if target.interpret:
        block_n = min(next_power_of_2(n_cols), 4096)
    else:
        block_n = max(16, min(256, next_power_of_2(cdiv(n_cols, target.num_sms))))
    return Launch(
        kernel=f"{_KERNELS}:sum_partials_kernel",
        grid=(cdiv(n_cols, block_n),),
        inputs=(part,),
        outputs=(out,),
        constexprs=(("N_PARTS", n_parts), ("N_COLS", n_cols),
                    ("BLOCK_P", min(next_power_of_2(n_parts), 128 if target.interpret else 64)),
                    ("BLOCK_N", block_n)),
        num_warps=4,
        num_stages=1,
    )
