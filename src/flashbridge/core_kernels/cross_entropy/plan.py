"""Launch plans and argument rules for the cross-entropy family (pure Python: shapes and options in).

Logits are viewed as ``(n_rows, V)``, C-contiguous (the front-ends copy non-contiguous arrays); labels as
``(n_rows,)``. Kernel plans:

* :func:`plan_ce_fwd`: logits, labels -> per-row loss, lse and lse_lo (float32); one read of the logits.
* :func:`plan_ce_grad`: logits, labels, lse, lse_lo, weight -> the gradient of ``sum_i w_i * loss_i``
  with respect to the logits; one read of the logits, one write of the gradient.
* :func:`plan_ce_fwd_grad`: both launches back to back (the chunk step of the linear op, which computes
  its gradients during the forward).
* :func:`plan_linear_logits`: ``hidden @ W^T (+ b)`` into a buffer the caller owns (the JAX linear op).

:func:`plan_linear_cross_entropy` orchestrates ``linear_cross_entropy``'s two passes for both front-ends;
:func:`check_cross_entropy_args` and :func:`check_linear_cross_entropy_args` are the argument rules both
front-ends share, so that they raise the same errors, before any launch.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from .._config import active_config
from .._plan import DTYPE_BYTES, FLOAT_DTYPES, Launch, Plan, Spec, Target, cdiv, check_float_dtype, next_power_of_2

_KERNELS = "cross_entropy.kernels"
LABEL_DTYPES = ("int32", "int64")
REDUCTIONS = ("mean", "sum", "none")


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


def _tile(n_rows: int, vocab: int, target: Target, config: CEConfig | None) -> tuple[int, int, int]:
    config = config or active_config(CEConfig)
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
        if config.block_v is None and cdiv(n_rows, block_n) < 2 * target.num_sms:
            # Too few rows to give every SM two programs (e.g. the linear op's 256-token chunks): one row per
            # program, the tile kept at 4096 columns (as fast as 2 x 2048 where both fill the GPU).
            block_n, block_v = 1, min(next_power_of_2(vocab), 4096)
    num_warps = config.num_warps or (8 if block_n * block_v >= 4096 else 4)
    return block_n, block_v, num_warps


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
) -> tuple[int, int]:
    """Validate a ``cross_entropy`` call from (shape, dtype-name) pairs; returns ``(n_rows, V)``."""
    shape, dtype = logits
    check_float_dtype("logits", dtype)
    if len(shape) < 1:
        raise ValueError("logits: expected (..., V), got a scalar")
    vocab = shape[-1]
    n_rows = math.prod(shape[:-1])
    if vocab < 1 or n_rows < 1:
        raise ValueError(f"logits: empty array of shape {tuple(shape)}; need at least one row and one class")
    _check_labels(labels, tuple(shape[:-1]), "logits")
    _check_options(ignore_index, label_smoothing, z_loss, logit_softcap, reduction)
    return n_rows, vocab


def check_linear_cross_entropy_args(
    *, hidden: tuple[tuple[int, ...], str], weight: tuple[tuple[int, ...], str],
    labels: tuple[tuple[int, ...], str], bias: tuple[tuple[int, ...], str] | None = None,
    ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, reduction="mean",
    chunk_size=None, weight_transposed: bool = False,
) -> tuple[int, int, int]:
    """Validate a ``linear_cross_entropy`` call from (shape, dtype-name) pairs; returns ``(N, H, V)``.

    ``weight`` is ``(V, H)``, or ``(H, V)`` with ``weight_transposed`` (a Flax ``nnx.Linear`` kernel).
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
    _check_options(ignore_index, label_smoothing, z_loss, logit_softcap, reduction)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        raise ValueError(f"chunk_size: expected None or a positive int, got {chunk_size!r}")
    return n_rows, h, vocab


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


def _fwd_launch(n_rows, vocab, logits, options, target, config) -> Launch:
    block_n, block_v, num_warps = _tile(n_rows, vocab, target, config)
    scalars, flags = _options(*options)
    return Launch(
        kernel=f"{_KERNELS}:ce_fwd_kernel", grid=(cdiv(n_rows, block_n),), inputs=(logits, "labels"),
        scalars=(("n_rows", n_rows),) + scalars, outputs=("loss", "lse", "lse_lo"),
        constexprs=(("V", vocab), ("BLOCK_N", block_n), ("BLOCK_V", block_v)) + flags,
        num_warps=num_warps, num_stages=_stages(config))


def _grad_launch(n_rows, vocab, logits, per_row_weight, options, target, config, col0=0, vocab_all=None) -> Launch:
    block_n, block_v, num_warps = _tile(n_rows, vocab, target, config)
    scalars, flags = _options(*options)
    return Launch(
        kernel=f"{_KERNELS}:ce_grad_kernel", grid=(cdiv(n_rows, block_n),),
        inputs=(logits, "labels", "lse", "lse_lo", "weight"),
        scalars=(("n_rows", n_rows),) + scalars + (("col0", int(col0)),),
        outputs=("grad",),
        constexprs=(("V", vocab), ("V_ALL", vocab_all or vocab), ("BLOCK_N", block_n), ("BLOCK_V", block_v),
                    ("PER_ROW_WEIGHT", per_row_weight)) + flags,
        num_warps=num_warps, num_stages=_stages(config))


def plan_ce_fwd(n_rows: int, vocab: int, *, ignore_index: int, label_smoothing: float, z_loss: float,
                logit_softcap: float, target: Target, config: CEConfig | None = None) -> Plan:
    """Plan inputs: logits ``(n_rows, V)``, labels ``(n_rows,)``. Results: loss, lse, lse_lo (float32
    ``(n_rows,)``; ``lse + lse_lo`` is the log-sum-exp to about twice float32's precision, which the
    gradient kernel needs where one logit dominates)."""
    options = (ignore_index, label_smoothing, z_loss, logit_softcap)
    return Plan(inputs=("logits", "labels"),
                buffers=(Spec("loss", (n_rows,), "float32"), Spec("lse", (n_rows,), "float32"),
                         Spec("lse_lo", (n_rows,), "float32")),
                launches=(_fwd_launch(n_rows, vocab, "logits", options, target, config),),
                results=("loss", "lse", "lse_lo"))


def plan_ce_grad(n_rows: int, vocab: int, *, grad_dtype: str, per_row_weight: bool, ignore_index: int,
                 label_smoothing: float, z_loss: float, logit_softcap: float, target: Target,
                 config: CEConfig | None = None, col0: int = 0, vocab_all: int | None = None) -> Plan:
    """Plan inputs: logits, labels, lse, lse_lo (float32 ``(n_rows,)``, from the forward), weight
    (float32, ``(n_rows,)`` when ``per_row_weight`` else ``(1,)``). Result: grad ``(n_rows, V)`` in ``grad_dtype``.

    ``logits`` may hold a slice of the vocabulary: columns ``col0 .. col0 + vocab`` of ``vocab_all`` (lse and
    labels of the whole rows)."""
    assert grad_dtype in FLOAT_DTYPES
    assert vocab_all is None or 0 <= col0 and col0 + vocab <= vocab_all
    options = (ignore_index, label_smoothing, z_loss, logit_softcap)
    return Plan(inputs=("logits", "labels", "lse", "lse_lo", "weight"),
                buffers=(Spec("grad", (n_rows, vocab), grad_dtype),),
                launches=(_grad_launch(n_rows, vocab, "logits", per_row_weight, options, target, config, col0,
                                       vocab_all),),
                results=("grad",))


def plan_ce_fwd_grad(n_rows: int, vocab: int, *, grad_dtype: str, per_row_weight: bool, ignore_index: int,
                     label_smoothing: float, z_loss: float, logit_softcap: float, target: Target,
                     config: CEConfig | None = None) -> Plan:
    """Plan inputs: logits, labels, weight. Results: loss, lse (float32 ``(n_rows,)``), grad ``(n_rows, V)``
    and lse_lo (see :func:`plan_ce_fwd`): the forward and the gradient in one plan (two launches, the logits
    read twice)."""
    assert grad_dtype in FLOAT_DTYPES
    options = (ignore_index, label_smoothing, z_loss, logit_softcap)
    return Plan(inputs=("logits", "labels", "weight"),
                buffers=(Spec("loss", (n_rows,), "float32"), Spec("lse", (n_rows,), "float32"),
                         Spec("lse_lo", (n_rows,), "float32"), Spec("grad", (n_rows, vocab), grad_dtype)),
                launches=(_fwd_launch(n_rows, vocab, "logits", options, target, config),
                          _grad_launch(n_rows, vocab, "logits", per_row_weight, options, target, config)),
                results=("loss", "lse", "grad", "lse_lo"))


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

    def chunk_bounds(self):
        """(start, stop, in_dw) of every pass-1 chunk, in order."""
        for run in self.chunks:
            for i in range(run.count):
                yield run.start + i * run.rows, run.start + (i + 1) * run.rows, run.in_dw

    def _kw(self, target: Target) -> dict:
        ignore_index, label_smoothing, z_loss, logit_softcap = self.options
        return dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
                    logit_softcap=logit_softcap, target=target, config=self.config)

    def chunk_plan(self, rows: int, target: Target) -> Plan:
        """The kernels of one pass-1 chunk: :func:`plan_ce_fwd_grad` (inputs logits, labels, weight),
        :func:`plan_ce_fwd` (logits, labels) or, in the backward, :func:`plan_ce_grad`."""
        if self.forward and self.chunk_grads:
            return plan_ce_fwd_grad(rows, self.vocab, grad_dtype=self.dtype, per_row_weight=self.per_row_weight,
                                    **self._kw(target))
        if self.forward:
            return plan_ce_fwd(rows, self.vocab, **self._kw(target))
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
                              logit_softcap: float, target: Target, config: CEConfig | None = None) -> LinearCEPlan:
    """The passes of a linear cross-entropy call: the forward (``forward``: loss and lse, and the gradients
    wanted, computed there when the reduction allows) or the backward's recomputation from the saved lse.

    Pass 1 runs when ``forward`` or ``want_dh``. ``chunk_size`` None: when dW is computed, chunks of exactly H
    tokens whose logits live in dW's storage, then the remaining tokens; otherwise every token, in chunks of
    :func:`own_chunk_rows`. A given ``chunk_size``: chunks of that many tokens with logits of their own.

    Pass 2 runs when ``want_dw`` or ``want_db``. ``logits_into_dw_rows``: the runtime can write a GEMM's output
    into dW's storage (torch); the slices then live in dW's rows not yet written while they fit, the rest in
    one small buffer. Otherwise (JAX) each slice's logits are an array of their own.
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
                        tuple(chunks), tuple(slices), buffer_elements)
