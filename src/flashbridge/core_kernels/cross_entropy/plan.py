"""Launch plans and argument rules for the cross-entropy family (pure Python: shapes and options in).

Logits are viewed as ``(n_rows, V)``, C-contiguous (the front-ends copy non-contiguous arrays); labels as
``(n_rows,)``. Kernel plans:

* :func:`plan_ce_fwd`: logits, labels -> per-row loss, lse and lse_lo (float32); one read of the logits.
* :func:`plan_ce_grad`: logits, labels, lse, lse_lo, weight -> the gradient of ``sum_i w_i * loss_i``
  with respect to the logits; one read of the logits, one write of the gradient.

Options of both: ``class_weight`` (class weights ``(V,)`` and their sum ``(1,)`` as inputs; the forward's
loss is then the class-weighted ce terms and its z-loss terms a result of their own, "zloss", whose upstream
gradient is the gradient plan's "z_weight": a mean divides the two by different sums) and, for the
forward, ``predicted_dtype`` (also the argmax of every row, "predicted", in that integer dtype). Without
them the plans launch the kernels that have neither.
* :func:`plan_ce_fwd_grad`: both launches back to back (the chunk step of the linear op, which computes
  its gradients during the forward).
* :func:`plan_linear_logits`: ``hidden @ W^T (+ b)`` into a buffer the caller owns (the JAX linear op).
* :func:`plan_class_weight_sum`: the sum of the class weights.
* :func:`plan_mean_scales`: the reciprocals of reduction "mean"'s divisors (IEEE division, in a kernel), by
  which both front-ends multiply.
* :func:`plan_ce_total`: a loss's reduction over its rows ("mean" with those reciprocals, "sum"), in a
  fixed order.

:func:`plan_linear_cross_entropy` orchestrates ``linear_cross_entropy``'s two passes for both front-ends;
:func:`check_cross_entropy_args` and :func:`check_linear_cross_entropy_args` are the argument rules both
front-ends share, so that they raise the same errors, before any launch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

from .._config import active_config
from .._plan import (DTYPE_BYTES, FLOAT_DTYPES, Launch, Plan, Spec, Target, cdiv, check_float_dtype, next_power_of_2,
                     pow2_divisor)

_KERNELS = "cross_entropy.kernels"
LABEL_DTYPES = ("int32", "int64")
REDUCTIONS = ("mean", "sum", "none")
CLASS_WEIGHT_DTYPES = FLOAT_DTYPES + ("float64",)


@dataclasses.dataclass(frozen=True)
class CEConfig:
    """Tiles of the cross-entropy kernels and the linear op's pass-2 slices; ``None`` picks the target's
    default. The GPU defaults were swept on an H200 with Triton 3.6 (bench_cross_entropy.py --tune).

    block_v: vocabulary columns per tile (a power of two). Default: 2048 (or the vocabulary rounded up to
        a power of two when smaller).
    block_n: rows per program. Default on a GPU: ``4096 // block_v`` rows (1 to 16), so a tile holds 4096
        elements, 8 per thread at 8 warps; with too few rows for two programs per SM, one row of 4096
        columns (when neither block_n nor block_v is given); in the interpreter, which pays per program,
        enough rows for ~16K elements per tile.
    num_warps: default 8 for tiles of 4096+ elements, else 4.
    num_stages: software-pipelining depth of the loop over the vocabulary. Default 1.
    slice_cols: vocabulary columns per slice of ``linear_cross_entropy``'s pass 2 (default:
        :func:`choose_slice_cols`).
    """

    block_v: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    slice_cols: int | None = None

    def __post_init__(self):
        for name in ("block_v", "block_n", "num_warps", "num_stages", "slice_cols"):
            value = getattr(self, name)
            positive = name in ("num_stages", "slice_cols")
            if value is not None and (value < 1 or (not positive and value & (value - 1))):
                kind = "a positive int" if positive else "a power of two"
                raise ValueError(f"CEConfig.{name}: must be None or {kind}, got {value}")


def _tile(n_rows: int, vocab: int, target: Target, config: CEConfig | None) -> tuple[int, int, int, int]:
    """(block_n, block_v, num_warps, num_stages): ``config``'s fields; on a GPU without ``block_n`` and
    ``block_v`` the tuning cache's tile for the padded vocabulary and "few" / "many" rows (under two
    programs per SM at 4096-element tiles, see :class:`CEConfig`) on the target's GPU
    (:mod:`flashbridge.tiles.cache`); with one of them given, the other makes a 4096-element tile."""
    config = config or active_config(CEConfig)
    if config.block_v is None and config.block_n is None and not target.interpret:
        from ...tiles import cache
        from ...tiles.model import RowsCase, Tile

        v = next_power_of_2(vocab)
        fallback = Tile(1, min(v, 2048), 4, 1)
        tile = cache.plan_tile("cross_entropy", target, cache.ce_class(n_rows, vocab, target.num_sms), "",
                               lambda: RowsCase(n_rows, vocab, "bfloat16"), fallback)
        return (tile.block_m, min(tile.block_n, v), config.num_warps or tile.num_warps,
                config.num_stages or tile.num_stages)
    if config.block_v is not None:
        block_v = min(config.block_v, next_power_of_2(vocab))
    else:
        block_v = min(next_power_of_2(vocab), 2048)
    if config.block_n is not None:
        block_n = config.block_n
    elif target.interpret:
        block_n = min(next_power_of_2(n_rows), max(1, 16384 // block_v))
    else:
        block_n = max(1, min(16, 4096 // block_v))
    num_warps = config.num_warps or (8 if block_n * block_v >= 4096 else 4)
    return block_n, block_v, num_warps, _stages(config)


# ------------------------------------------------------------------------------------------- arguments

def _check_options(ignore_index, label_smoothing, z_loss, logit_softcap, reduction) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index: expected a Python int, got {type(ignore_index).__name__}")
    if not -2**63 <= int(ignore_index) < 2**63:
        raise ValueError(f"ignore_index: must fit in int64, got {ignore_index}")
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss),
                        ("logit_softcap", logit_softcap)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1), got {label_smoothing}")
    # comparisons rather than math.isfinite: torch.compile traces a float argument symbolically
    if not 0.0 <= float(z_loss) < math.inf:
        raise ValueError(f"z_loss: must be a finite number >= 0 (0 turns it off), got {z_loss}")
    if not 0.0 <= float(logit_softcap) < math.inf:
        raise ValueError(f"logit_softcap: must be a finite number >= 0 (0 turns it off), got {logit_softcap}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")


def _check_labels(labels, lead: tuple[int, ...], what: str) -> None:
    shape, dtype = labels
    if dtype not in LABEL_DTYPES:
        raise TypeError(f"labels: dtype {dtype} is not supported; use int32 or int64 class indices")
    if tuple(shape) != tuple(lead):
        raise ValueError(f"labels: expected shape {tuple(lead)} (the leading dimensions of {what}), "
                         f"got {tuple(shape)}")


def check_cross_entropy_args(
    *, logits: tuple[tuple[int, ...], str], labels: tuple[tuple[int, ...], str], ignore_index=-100,
    label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean",
    weight: tuple[tuple[int, ...], str] | None = None,
) -> tuple[int, int]:
    """Validate a ``cross_entropy`` call from (shape, dtype-name) pairs (``weight``: the class weights);
    returns ``(n_rows, V)``."""
    shape, dtype = logits
    check_float_dtype("logits", dtype)
    if len(shape) < 1:
        raise ValueError("logits: expected (..., V), got a scalar")
    vocab = shape[-1]
    n_rows = math.prod(shape[:-1])
    if vocab < 1 or n_rows < 1:
        raise ValueError(f"logits: empty array of shape {tuple(shape)}; need at least one row and one class")
    _check_labels(labels, tuple(shape[:-1]), "logits")
    _check_class_weight(weight, vocab, "weight")
    _check_options(ignore_index, label_smoothing, z_loss, logit_softcap, reduction)
    return n_rows, vocab


def check_linear_cross_entropy_args(
    *, hidden: tuple[tuple[int, ...], str], weight: tuple[tuple[int, ...], str],
    labels: tuple[tuple[int, ...], str], bias: tuple[tuple[int, ...], str] | None = None,
    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean",
    chunk_size=None, weight_transposed: bool = False, class_weight: tuple[tuple[int, ...], str] | None = None,
) -> tuple[int, int, int]:
    """Validate a ``linear_cross_entropy`` call from (shape, dtype-name) pairs; returns ``(N, H, V)``.

    ``weight`` is ``(V, H)``, or ``(H, V)`` with ``weight_transposed`` (a Flax ``nnx.Linear`` kernel);
    ``class_weight`` the optional class weights ``(V,)``.
    """
    h_shape, h_dtype = hidden
    w_shape, w_dtype = weight
    check_float_dtype("hidden", h_dtype)
    if w_dtype != h_dtype:
        raise TypeError(f"weight: dtype {w_dtype} must match hidden's dtype {h_dtype}")
    if len(h_shape) < 1:
        raise ValueError("hidden: expected (..., H), got a scalar")
    if len(w_shape) != 2:
        raise ValueError(f"weight: expected a 2-D {'(H, V)' if weight_transposed else '(V, H)'} matrix, "
                         f"got shape {tuple(w_shape)}")
    vocab, h_w = (w_shape[1], w_shape[0]) if weight_transposed else (w_shape[0], w_shape[1])
    h = h_shape[-1]
    if h_w != h:
        raise ValueError(f"weight: hidden size {h_w} of weight {tuple(w_shape)} does not match the last "
                         f"dimension of hidden {tuple(h_shape)}")
    n_rows = math.prod(h_shape[:-1])
    if n_rows < 1 or h < 1 or vocab < 1:
        raise ValueError(f"hidden / weight: empty shapes {tuple(h_shape)} / {tuple(w_shape)}; need at least "
                         "one token, one hidden unit and one class")
    _check_labels(labels, tuple(h_shape[:-1]), "hidden")
    if bias is not None:
        if tuple(bias[0]) != (vocab,):
            raise ValueError(f"bias: expected shape ({vocab},), got {tuple(bias[0])}")
        if bias[1] != h_dtype:
            raise TypeError(f"bias: dtype {bias[1]} must match hidden's dtype {h_dtype}")
    _check_class_weight(class_weight, vocab, "class_weight")
    _check_options(ignore_index, label_smoothing, z_loss, logit_softcap, reduction)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size: expected None or a positive int, got {chunk_size!r}")
    return n_rows, h, vocab


class CrossEntropyOutput(NamedTuple):
    """What ``cross_entropy`` / ``linear_cross_entropy`` return (in both front-ends) when ``return_accuracy``
    or ``return_predicted`` is set; the fields not asked for are None.

    loss: float32, a scalar or ``(...)`` ("none").
    lse: float32 ``(...)``, the log-sum-exp of each row (``return_lse``; not differentiable).
    accuracy: bool ``(...)``, whether the row's argmax is its label (False for ignored rows).
    predicted: ``(...)`` in the labels' dtype, the argmax over the vocabulary of each row's logits (ties to
        the lowest index, as ``argmax``), for every row, ignored ones included.
    """

    loss: Any
    lse: Any = None
    accuracy: Any = None
    predicted: Any = None


def _check_class_weight(class_weight, vocab: int, name: str) -> None:
    """Class weights: ``(V,)`` of a float dtype (the kernels read them as float32). Any values (torch requires
    none either: negative weights are allowed, a NaN one makes the losses that read it NaN)."""
    if class_weight is None:
        return
    shape, dtype = class_weight
    if dtype not in CLASS_WEIGHT_DTYPES:
        raise TypeError(f"{name}: dtype {dtype} is not supported for class weights; use one of "
                        f"{', '.join(CLASS_WEIGHT_DTYPES)}")
    if tuple(shape) != (vocab,):
        raise ValueError(f"{name}: expected one weight per class, shape ({vocab},), got {tuple(shape)}")


def bad_label_message(bad_count: int, example: int, vocab: int, ignore_index: int) -> str:
    return (f"labels: {bad_count} label(s) outside [0, {vocab}) that are not ignore_index={ignore_index}, "
            f"e.g. {example}")


# ------------------------------------------------------------------------------------------------ plans

def _options(ignore_index, label_smoothing, z_loss, softcap):
    scalars = (("ignore_index", int(ignore_index)), ("label_smoothing", float(label_smoothing)),
               ("z_loss", float(z_loss)), ("softcap", float(softcap)))
    flags = (("HAS_SMOOTH", label_smoothing > 0), ("HAS_ZLOSS", z_loss > 0), ("HAS_SOFTCAP", softcap > 0))
    return scalars, flags


def _stages(config: CEConfig | None) -> int:
    return (config or active_config(CEConfig)).num_stages or 1


def _split_zloss(options, class_weight: bool) -> bool:
    """With class weights and a z-loss the forward writes the z-loss terms apart (see the module docstring)."""
    return class_weight and options[2] > 0


def _fwd_buffers(n_rows: int, options, class_weight: bool, predicted_dtype: str | None) -> tuple[Spec, ...]:
    """The forward's buffers; the ext kernel's outputs of an option that is off are one-element placeholders
    (never written, not results)."""
    buffers = (Spec("loss", (n_rows,), "float32"), Spec("lse", (n_rows,), "float32"),
               Spec("lse_lo", (n_rows,), "float32"))
    if class_weight or predicted_dtype:
        buffers += (Spec("zloss", (n_rows if _split_zloss(options, class_weight) else 1,), "float32"),
                    Spec("predicted", (n_rows,) if predicted_dtype else (1,), predicted_dtype or "int32"))
    return buffers


def _fwd_extras(options, class_weight: bool, predicted_dtype: str | None) -> tuple[str, ...]:
    """The forward's results after (loss, lse, lse_lo)."""
    return ("zloss",) * _split_zloss(options, class_weight) + ("predicted",) * bool(predicted_dtype)


def _fwd_launch(n_rows, vocab, logits, options, target, config, class_weight=False, predicted_dtype=None) -> Launch:
    block_n, block_v, num_warps, num_stages = _tile(n_rows, vocab, target, config)
    scalars, flags = _options(*options)
    common = dict(grid=(cdiv(n_rows, block_n),), scalars=(("n_rows", n_rows),) + scalars,
                  num_warps=num_warps, num_stages=num_stages)
    constexprs = (("V", vocab), ("BLOCK_N", block_n), ("BLOCK_V", block_v)) + flags
    if not (class_weight or predicted_dtype):
        return Launch(kernel=f"{_KERNELS}:ce_fwd_kernel", inputs=(logits, "labels"),
                      outputs=("loss", "lse", "lse_lo"), constexprs=constexprs, **common)
    weights = ("class_weight", "weight_sum") if class_weight else (logits, logits)  # placeholders: never read
    return Launch(kernel=f"{_KERNELS}:ce_fwd_ext_kernel", inputs=(logits, "labels") + weights,
                  outputs=("loss", "lse", "lse_lo", "zloss", "predicted"),
                  constexprs=constexprs + (("HAS_CLASS_WEIGHT", class_weight),
                                           ("HAS_ARGMAX", bool(predicted_dtype))), **common)


def _grad_inputs(options, class_weight: bool) -> tuple[str, ...]:
    """The gradient plan's inputs after (logits, labels, lse, lse_lo, weight)."""
    if not class_weight:
        return ()
    return ("z_weight",) * _split_zloss(options, class_weight) + ("class_weight", "weight_sum")


def _grad_launch(n_rows, vocab, logits, per_row_weight, options, target, config, col0=0, vocab_all=None,
                 class_weight=False) -> Launch:
    block_n, block_v, num_warps, num_stages = _tile(n_rows, vocab, target, config)
    scalars, flags = _options(*options)
    inputs = (logits, "labels", "lse", "lse_lo", "weight")
    if class_weight:  # without a z-loss the kernel never reads z_weight: the upstream stands in
        inputs += ("z_weight" if _split_zloss(options, class_weight) else "weight", "class_weight", "weight_sum")
    return Launch(
        kernel=f"{_KERNELS}:{'ce_grad_weighted_kernel' if class_weight else 'ce_grad_kernel'}",
        grid=(cdiv(n_rows, block_n),), inputs=inputs,
        scalars=(("n_rows", n_rows),) + scalars + (("col0", int(col0)),),
        outputs=("grad",),
        constexprs=(("V", vocab), ("V_ALL", vocab_all or vocab), ("BLOCK_N", block_n), ("BLOCK_V", block_v),
                    ("PER_ROW_WEIGHT", per_row_weight)) + flags
        + ((("COL0_ALIGN", pow2_divisor(int(col0))),) if class_weight else ()),
        num_warps=num_warps, num_stages=num_stages)


def plan_ce_fwd(n_rows: int, vocab: int, *, ignore_index: int, label_smoothing: float, z_loss: float,
                logit_softcap: float, target: Target, config: CEConfig | None = None, class_weight: bool = False,
                predicted_dtype: str | None = None) -> Plan:
    """Plan inputs: logits ``(n_rows, V)``, labels ``(n_rows,)`` [, class_weight ``(V,)`` (any float dtype),
    weight_sum (float32 ``(1,)``, the sum of the class weights)]. Results: loss, lse, lse_lo (float32
    ``(n_rows,)``; ``lse + lse_lo`` is the log-sum-exp to about twice float32's precision, which the
    gradient kernel needs where one logit dominates) [, zloss (float32 ``(n_rows,)``, with class weights and
    a z-loss), predicted (``predicted_dtype``, ``(n_rows,)``)]: see the module docstring."""
    assert predicted_dtype in (None,) + LABEL_DTYPES
    options = (ignore_index, label_smoothing, z_loss, logit_softcap)
    inputs = ("logits", "labels") + (("class_weight", "weight_sum") if class_weight else ())
    return Plan(inputs=inputs, buffers=_fwd_buffers(n_rows, options, class_weight, predicted_dtype),
                launches=(_fwd_launch(n_rows, vocab, "logits", options, target, config, class_weight,
                                      predicted_dtype),),
                results=("loss", "lse", "lse_lo") + _fwd_extras(options, class_weight, predicted_dtype))


def plan_ce_grad(n_rows: int, vocab: int, *, grad_dtype: str, per_row_weight: bool, ignore_index: int,
                 label_smoothing: float, z_loss: float, logit_softcap: float, target: Target,
                 config: CEConfig | None = None, col0: int = 0, vocab_all: int | None = None,
                 class_weight: bool = False) -> Plan:
    """Plan inputs: logits, labels, lse, lse_lo (float32 ``(n_rows,)``, from the forward), weight
    (float32, ``(n_rows,)`` when ``per_row_weight`` else ``(1,)``) [, with ``class_weight``: z_weight (as
    weight, the upstream gradient of the z-loss terms; only with a z-loss), class_weight ``(vocab_all,)``,
    weight_sum (float32 ``(1,)``)]. Result: grad ``(n_rows, V)`` in ``grad_dtype``.

    ``logits`` may hold a slice of the vocabulary: columns ``col0 .. col0 + vocab`` of ``vocab_all`` (lse and
    labels of the whole rows)."""
    assert grad_dtype in FLOAT_DTYPES
    assert vocab_all is None or 0 <= col0 and col0 + vocab <= vocab_all
    options = (ignore_index, label_smoothing, z_loss, logit_softcap)
    return Plan(inputs=("logits", "labels", "lse", "lse_lo", "weight") + _grad_inputs(options, class_weight),
                buffers=(Spec("grad", (n_rows, vocab), grad_dtype),),
                launches=(_grad_launch(n_rows, vocab, "logits", per_row_weight, options, target, config, col0,
                                       vocab_all, class_weight),),
                results=("grad",))


def plan_ce_fwd_grad(n_rows: int, vocab: int, *, grad_dtype: str, per_row_weight: bool, ignore_index: int,
                     label_smoothing: float, z_loss: float, logit_softcap: float, target: Target,
                     config: CEConfig | None = None, class_weight: bool = False,
                     predicted_dtype: str | None = None) -> Plan:
    """Plan inputs: logits, labels, weight [, z_weight, class_weight, weight_sum] (see :func:`plan_ce_grad`).
    Results: loss, lse (float32 ``(n_rows,)``), grad ``(n_rows, V)`` and lse_lo (see :func:`plan_ce_fwd`)
    [, zloss, predicted]: the forward and the gradient in one plan (two launches, the logits read twice)."""
    assert grad_dtype in FLOAT_DTYPES
    assert predicted_dtype in (None,) + LABEL_DTYPES
    options = (ignore_index, label_smoothing, z_loss, logit_softcap)
    return Plan(inputs=("logits", "labels", "weight") + _grad_inputs(options, class_weight),
                buffers=_fwd_buffers(n_rows, options, class_weight, predicted_dtype)
                + (Spec("grad", (n_rows, vocab), grad_dtype),),
                launches=(_fwd_launch(n_rows, vocab, "logits", options, target, config, class_weight,
                                      predicted_dtype),
                          _grad_launch(n_rows, vocab, "logits", per_row_weight, options, target, config,
                                       class_weight=class_weight)),
                results=("loss", "lse", "grad", "lse_lo") + _fwd_extras(options, class_weight, predicted_dtype))


def plan_class_weight_sum(vocab: int, *, target: Target) -> Plan:
    """Plan input: class_weight ``(V,)``. Result: sum (float32 ``(1,)``), the sum of the class weights (the
    kernels' weight_sum input). One program, a fixed order: the front-ends use it rather than their own
    reductions so that they get the same bits."""
    del target  # one program of 1024 lanes on either target
    return Plan(inputs=("class_weight",), buffers=(Spec("sum", (1,), "float32"),),
                launches=(Launch(kernel=f"{_KERNELS}:ce_class_weight_sum_kernel", grid=(1,),
                                 inputs=("class_weight", "class_weight"),
                                 scalars=(("n", int(vocab)), ("ignore_index", 0)), outputs=("sum",),
                                 constexprs=(("V", vocab), ("BLOCK", 1024), ("OF_LABELS", False),
                                             ("HAS_CLASS_WEIGHT", True)),
                                 num_warps=4, num_stages=1),),
                results=("sum",))


def plan_mean_scales(n: int, vocab: int, *, class_weight: bool, ignore_index: int, target: Target) -> Plan:
    """Plan inputs: labels ``(n,)`` [, class_weight ``(V,)`` with ``class_weight``]. Result: scales (float32
    ``(2,)``): ``[1 / W, 1 / count]``, the reciprocals of reduction "mean"'s divisors (``count``: the labels
    not ignore_index; ``W``: the sum of their class weights, or ``count`` without class weights; 1 when no
    label counts). Both front-ends *multiply* by them -- the ce terms by ``1 / W``, the z-loss terms (apart
    with class weights) by ``1 / count`` -- so that no framework division decides the bits of a mean or of
    its gradient (XLA's float32 division on NVIDIA GPUs is approximate, torch's is IEEE; the kernel's is
    IEEE). Without class weights the vocabulary is not read (the kernel is compiled once for every V)."""
    del target  # one program of 1024 lanes on either target
    return Plan(inputs=("labels", "class_weight") if class_weight else ("labels",),
                buffers=(Spec("scales", (2,), "float32"),),
                launches=(Launch(kernel=f"{_KERNELS}:ce_class_weight_sum_kernel", grid=(1,),
                                 inputs=("class_weight" if class_weight else "labels", "labels"),
                                 scalars=(("n", int(n)), ("ignore_index", int(ignore_index))), outputs=("scales",),
                                 constexprs=(("V", vocab if class_weight else 1), ("BLOCK", 1024),
                                             ("OF_LABELS", True), ("HAS_CLASS_WEIGHT", class_weight)),
                                 num_warps=4, num_stages=1),),
                results=("scales",))


def plan_ce_total(n: int, *, has_z: bool, has_scales: bool, target: Target) -> Plan:
    """Plan inputs: loss ``(n,)`` [, zloss ``(n,)`` with ``has_z``] [, scales ``(2,)`` with ``has_scales``]
    (float32 each). Result: total (float32 ``(1,)``), ``sum(loss) * scales[0] + sum(zloss) * scales[1]``
    (scales 1 without ``has_scales``): reductions "mean" (with :func:`plan_mean_scales`' reciprocals) and
    "sum", in one fixed order for both front-ends (their own sums reduce in different orders)."""
    del target  # one program of 1024 lanes on either target
    inputs = ("loss",) + ("zloss",) * has_z + ("scales",) * has_scales
    return Plan(inputs=inputs, buffers=(Spec("total", (1,), "float32"),),
                launches=(Launch(kernel=f"{_KERNELS}:ce_total_kernel", grid=(1,),
                                 inputs=("loss", "zloss" if has_z else "loss", "scales" if has_scales else "loss"),
                                 scalars=(("n", int(n)),), outputs=("total",),
                                 constexprs=(("BLOCK", 1024), ("HAS_Z", has_z), ("HAS_SCALES", has_scales)),
                                 num_warps=4, num_stages=1),),
                results=("total",))


# GPU tile of linear_logits_kernel (block_m, block_n, block_k, num_warps, num_stages): the usual Hopper GEMM
# tile for bf16 (two warpgroups, 128 x 256 outputs, 3 stages of 48 KB); the interpreter pays per program
_LOGITS_TILE_GPU = (128, 256, 64, 8, 3)
_LOGITS_TILE_FP32 = (64, 64, 32, 4, 2)  # IEEE dots keep their operands in registers
_LOGITS_TILE_INTERPRETER = (64, 256, 64, 4, 1)


def plan_linear_logits(n_rows: int, vocab: int, hidden: int, *, dtype: str, weight_transposed: bool,
                       has_bias: bool, out_shape: tuple[int, ...], target: Target) -> Plan:
    """Plan inputs: hidden ``(n_rows, H)`` (rows contiguous), weight ``(V, H)`` (or ``(H, V)`` when
    ``weight_transposed``), [bias ``(V,)``], buffer (``out_shape``, ``dtype``; never read). Result: out, of
    ``out_shape``, whose first ``n_rows * V`` elements are ``hidden @ W^T + bias`` row-major; a front-end
    aliases out to the buffer to place the logits in storage it owns (the JAX linear op: dW's).
    The rest of out is the buffer's (or undefined without the alias)."""
    assert n_rows * vocab <= math.prod(out_shape), "the buffer is smaller than the logits"
    check_float_dtype("hidden", dtype)
    if target.interpret:
        tile = _LOGITS_TILE_INTERPRETER
    else:
        tile = _LOGITS_TILE_FP32 if dtype == "float32" else _LOGITS_TILE_GPU
    block_m, block_n, block_k, warps, stages = tile
    block_k = min(block_k, max(16, next_power_of_2(hidden)))
    return Plan(
        inputs=("hidden", "weight", "bias", "buffer") if has_bias else ("hidden", "weight", "buffer"),
        buffers=(Spec("out", tuple(out_shape), dtype),),
        launches=(Launch(
            kernel=f"{_KERNELS}:linear_logits_kernel",
            grid=(cdiv(n_rows, block_m) * cdiv(vocab, block_n),),
            inputs=("hidden", "weight", "bias" if has_bias else "hidden", "buffer"),
            scalars=(("n_rows", n_rows),),
            outputs=("out",),
            constexprs=(("V", vocab), ("HD", hidden), ("W_TRANSPOSED", weight_transposed), ("BLOCK_M", block_m),
                        ("BLOCK_N", block_n), ("BLOCK_K", block_k), ("GROUP_M", 8), ("HAS_BIAS", has_bias),
                        ("DOT_PRECISION", "ieee" if dtype == "float32" else "tf32")),
            num_warps=warps, num_stages=stages),),
        results=("out",))


# ------------------------------------------------------------------------------------- linear: two passes

SMALL_SLICE_BYTES = 16 * 2**20  # pass 2's buffer for the slices whose logits dW's unwritten rows cannot hold


def own_chunk_rows(n_rows: int, hidden: int) -> int:
    """Tokens per pass-1 chunk whose logits are an array of their own (see :func:`plan_linear_cross_entropy`):
    at most a sixteenth of the weight's size (rows x V <= V x H / 16), at least 64 tokens."""
    return max(1, min(n_rows, max(64, hidden // 16 // 64 * 64)))


def choose_slice_cols(target: Target, *, logits_in_dw: bool) -> int:
    """Vocabulary columns per slice of pass 2 (the logits of all N tokens for the slice, then ``dW[slice]`` in
    one GEMM). On a GPU: 4096 where the slice's logits live in dW's rows not yet written (they cost no
    memory and N x 4096 GEMMs run at full speed), 2048 where they are arrays of their own (H200, Triton 3.6,
    N=8192, H=4096, V=128256: the same time as 4096 in less memory; bench_cross_entropy.py --jax-sweep).
    The interpreter takes 256 columns, so that tests cross several slices."""
    if target.interpret:
        return 256
    return 4096 if logits_in_dw else 2048


@dataclasses.dataclass(frozen=True)
class ChunkRun:
    """``count`` consecutive pass-1 chunks of ``rows`` tokens from token ``start``. ``in_dw``: each chunk is
    exactly H tokens and its H x V logits are written into dW's storage (dW is written only in pass 2), so
    they cost no memory; otherwise the logits are an array of their own."""

    start: int
    rows: int
    count: int
    in_dw: bool

    @property
    def stop(self) -> int:
        return self.start + self.rows * self.count


@dataclasses.dataclass(frozen=True)
class VocabSlice:
    """Pass 2's columns ``[c0, c1)``; ``where`` their N x (c1 - c0) logits live: "dw_tail" (dW's last rows,
    not written before this slice), "buffer" (one buffer of ``LinearCEPlan.buffer_elements``) or "own"."""

    c0: int
    c1: int
    where: str


@dataclasses.dataclass(frozen=True)
class LinearCEPlan:
    """The two passes of ``linear_cross_entropy``, executed alike by both front-ends. Each pass finishes a
    gradient in one GEMM (fp32 accumulation, one rounding), at the cost of the logits GEMM twice.

    1. ``chunks`` (token chunks over the whole vocabulary; empty when pass 1 has nothing to compute): the
       logits ``h_c @ W^T (+ b)``, the chunk's kernels (:meth:`chunk_plan`: loss, lse and lse_lo when
       ``forward``, the logits' gradient over the logits when ``chunk_grads``) and ``dh[chunk] = dlogits @ W``.
    2. ``slices`` (vocabulary slices over all tokens; empty unless dW or db is wanted): the slice's logits
       again, their gradient from pass 1's lse (:meth:`slice_plan`), ``dW[slice] = dlogits^T h`` and
       ``db[slice] = colsum(dlogits)``.

    ``class_weight``: every kernel takes the class weights (``(V,)``, all of them: a slice's kernel offsets
    them by its first column) and their sum, and the z-loss terms are a result of the forward and have an
    upstream gradient of their own ("z_weight", per row like "weight") when there is a z-loss.
    ``predicted_dtype``: pass 1's forward also writes each row's argmax ("predicted").
    """

    n_rows: int
    hidden: int
    vocab: int
    dtype: str
    forward: bool
    chunk_grads: bool
    per_row_weight: bool
    options: tuple[int, float, float, float]  # ignore_index, label_smoothing, z_loss, logit_softcap
    config: CEConfig
    chunks: tuple[ChunkRun, ...]
    slices: tuple[VocabSlice, ...]
    buffer_elements: int = 0
    class_weight: bool = False
    predicted_dtype: str | None = None

    def chunk_bounds(self):
        """(start, stop, in_dw) of every pass-1 chunk, in order."""
        for run in self.chunks:
            for i in range(run.count):
                yield run.start + i * run.rows, run.start + (i + 1) * run.rows, run.in_dw

    def _kw(self, target: Target) -> dict:
        ignore_index, label_smoothing, z_loss, logit_softcap = self.options
        return dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                    logit_softcap=logit_softcap, target=target, config=self.config, class_weight=self.class_weight)

    @property
    def split_zloss(self) -> bool:
        """The z-loss terms are a result (and have an upstream gradient) of their own."""
        return _split_zloss(self.options, self.class_weight)

    def chunk_plan(self, rows: int, target: Target) -> Plan:
        """The kernels of one pass-1 chunk: :func:`plan_ce_fwd_grad` (inputs logits, labels, weight),
        :func:`plan_ce_fwd` (logits, labels) or, in the backward, :func:`plan_ce_grad` (the class weights'
        inputs after these)."""
        if self.forward and self.chunk_grads:
            return plan_ce_fwd_grad(rows, self.vocab, grad_dtype=self.dtype, per_row_weight=self.per_row_weight,
                                    predicted_dtype=self.predicted_dtype, **self._kw(target))
        if self.forward:
            return plan_ce_fwd(rows, self.vocab, predicted_dtype=self.predicted_dtype, **self._kw(target))
        return plan_ce_grad(rows, self.vocab, grad_dtype=self.dtype, per_row_weight=self.per_row_weight,
                            **self._kw(target))

    def slice_plan(self, rows: int, c0: int, c1: int, target: Target) -> Plan:
        """The gradient kernel of pass 2's columns ``[c0, c1)`` for ``rows`` tokens (:func:`plan_ce_grad`
        with the column offset; inputs logits, labels, lse, lse_lo, weight)."""
        return plan_ce_grad(rows, c1 - c0, grad_dtype=self.dtype, per_row_weight=self.per_row_weight, col0=c0,
                            vocab_all=self.vocab, **self._kw(target))

    def dw_tail_offset(self, s: VocabSlice) -> int:
        """Where a "dw_tail" slice's logits start in dW's flat storage: the first of dW's last
        ``cdiv(N x width, H)`` rows, which no earlier slice writes."""
        return (self.vocab - cdiv(self.n_rows * (s.c1 - s.c0), self.hidden)) * self.hidden


def plan_linear_cross_entropy(n_rows: int, hidden: int, vocab: int, *, dtype: str, forward: bool, want_dh: bool,
                              want_dw: bool, want_db: bool, chunk_size: int | None, logits_into_dw_rows: bool,
                              per_row_weight: bool, ignore_index: int, label_smoothing: float, z_loss: float,
                              logit_softcap: float, target: Target, config: CEConfig | None = None,
                              class_weight: bool = False, predicted_dtype: str | None = None) -> LinearCEPlan:
    """The passes of a linear cross-entropy call: the forward (``forward``: loss and lse, and the gradients
    wanted, computed there when the reduction allows) or the backward's recomputation from the saved lse.

    Pass 1 runs when ``forward`` or ``want_dh``. ``chunk_size`` None: when dW is computed, chunks of exactly H
    tokens whose logits live in dW's storage, then the remaining tokens; otherwise every token, in chunks of
    :func:`own_chunk_rows`. A given ``chunk_size``: chunks of that many tokens with logits of their own.

    Pass 2 runs when ``want_dw`` or ``want_db``. ``logits_into_dw_rows``: the runtime can write a GEMM's output
    into dW's storage (torch); the slices then live in dW's rows not yet written while they fit, the rest in
    one small buffer. Otherwise (JAX) each slice's logits are an array of their own.

    ``class_weight`` / ``predicted_dtype``: see :class:`LinearCEPlan` (the argmax only in the forward).
    """
    config = config or active_config(CEConfig)
    chunks: list[ChunkRun] = []
    if forward or want_dh:
        start = 0
        if chunk_size is None and want_dw and n_rows >= hidden:
            chunks.append(ChunkRun(0, hidden, n_rows // hidden, True))
            start = chunks[-1].stop
        rows = min(chunk_size, n_rows) if chunk_size else own_chunk_rows(n_rows - start, hidden)
        if n_rows - start >= rows:
            chunks.append(ChunkRun(start, rows, (n_rows - start) // rows, False))
            start = chunks[-1].stop
        if start < n_rows:
            chunks.append(ChunkRun(start, n_rows - start, 1, False))
    slices: list[VocabSlice] = []
    buffer_elements = 0
    if want_dw or want_db:
        width = config.slice_cols or choose_slice_cols(target, logits_in_dw=logits_into_dw_rows)
        c0 = 0
        if not logits_into_dw_rows:
            slices = [VocabSlice(c, min(c + width, vocab), "own") for c in range(0, vocab, width)]
            c0 = vocab
        elif want_dw:
            tail_rows = cdiv(n_rows * width, hidden)  # dW rows that hold one slice's logits
            while c0 + width <= vocab - tail_rows:
                slices.append(VocabSlice(c0, c0 + width, "dw_tail"))
                c0 += width
            width = max(1, min(width, SMALL_SLICE_BYTES // (n_rows * DTYPE_BYTES[dtype])))
        if c0 < vocab:  # without dW (only db wanted) nothing else is held: full-width slices
            buffer_elements = n_rows * width
            slices += [VocabSlice(c, min(c + width, vocab), "buffer") for c in range(c0, vocab, width)]
    return LinearCEPlan(n_rows, hidden, vocab, dtype, forward, want_dh, per_row_weight,
                        (int(ignore_index), float(label_smoothing), float(z_loss), float(logit_softcap)), config,
                        tuple(chunks), tuple(slices), buffer_elements, bool(class_weight),
                        predicted_dtype if forward else None)
