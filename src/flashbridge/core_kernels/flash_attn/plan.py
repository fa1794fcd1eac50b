"""Launch plans and argument checks for the FlashAttention family (pure Python: shapes and options in, a
Plan out).

Layouts: dense q ``(B, Sq, Hq, Dqk)``, k ``(B, Sk, Hkv, Dqk)``, v ``(B, Sk, Hkv, Dv)``, out ``(B, Sq, Hq, Dv)``,
lse float32 ``(B, Hq, Sq)``; packed (variable length) q ``(total_q, Hq, Dqk)`` etc. with int32
``cu_seqlens_*`` ``(n_seqs + 1,)`` and static ``max_seqlen_*``, lse ``(Hq, total_q)``. Kernels address q, k,
v and dout through (batch, row, head) element strides, so a front-end may pass strided views as long as
the last dimension is contiguous; outputs are allocated contiguous.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .._plan import (Launch, Plan, Spec, Target, cdiv, check_float_dtype, fmt_shape, next_power_of_2,
                     pow2_divisor)
from ..block_sparse import plan as bsp

MAX_HEAD_DIM = 256
_FWD = "flash_attn.kernels_fwd"
_BWD = "flash_attn.kernels_bwd"
# An unbounded window side as the kernels see it (``visible`` adds it to positions): sequences and caches
# are refused above MAX_SEQLEN (check_seqlen_bound), so no such sum overflows int32.
_UNBOUNDED = 1 << 30
MAX_SEQLEN = _UNBOUNDED - 1

TensorInfo = tuple[tuple[int, ...], str]  # (shape, dtype name)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Block sizes and launch parameters of the three main kernels. ``None`` picks the default for the
    target and the (padded) head dim, from the table :data:`GPU_TILES`.

    * forward: one program per ``block_m`` query rows, looping over keys ``block_n`` at a time;
    * dK/dV: one program per ``dkdv_block_n`` keys, looping over queries ``dkdv_block_m`` at a time;
    * dQ: one program per ``dq_block_m`` query rows, looping over keys ``dq_block_n`` at a time.

    * ``masked_num_stages``: pipelining depth of the forward's masked segments (the causal diagonal, window
      edges, ragged tails), None = the default of :data:`GPU_MASKED_STAGES`, else the forward's
      ``num_stages``.
    * ``masked_block_n``: key block width of the forward's masked segments (a power of two; None or a
      value >= the forward's ``block_n`` = ``block_n``): the masked segments walk the same keys in narrower
      blocks, whose smaller score tile leaves the mask arithmetic room in registers. sm_90, Triton 3.6, causal
      D=128 forward (128 x 128 tiles) with 64: masked loop 1244 instructions per 128 keys with 7 local loads
      -> 2 x 611 with none, and the fully visible loop (the hot one) 600 -> 544 with 6 -> 3 local loads (stack
      32 -> 24 B). None = the default of :data:`GPU_MASKED_BLOCK_N` (64 for D=128's causal / windowed
      forward), else ``block_n``.
    * ``head_group``: the order in which the programs of the forward, dK/dV and dQ kernels start (see
      ``block_schedule`` in kernels_common.py): 1 = grid order, every block of a head before the next head;
      G > 1 = the longest causal blocks of G (head, sequence) pairs first, then the next-longest, ... None =
      4 for causal attention on a GPU, else 1 (see :func:`_head_group`).
    * ``fused_backward``: run the dK/dV and dQ grids in one launch (``attn_bwd_kernel``: the dQ programs
      fill the SMs the dK/dV grid's last wave leaves idle) at the dK/dV tile's ``num_stages``, when both
      tiles have the same ``num_warps`` (else the two launches); identical results. None = True: H200,
      bf16, S=4096: one ``--order-only`` run gave backward D=128 full 383 -> 395 TFLOP/s, causal 349 -> 354,
      D=64 causal 312 -> 328, GQA 32/8 causal 322 -> 331; alternating both four times in one process
      (``bench_attention.py --ab 4``) MHA differs by less than 1.5% either way and GQA causal gains 1.4%.
      D=256's default splits the dK/dV grid's columns (``dkdv_col_split``) and keeps two launches.
    * ``early_dp``: order of the products in the dK/dV loop's unmasked segment. False: ``p^T`` recomputed
      from ``k q^T``, then ``dv += p^T dout``, then ``dp^T = v dout^T``; True: ``dp^T`` issued right after
      ``k q^T``, before the exponentials, so the tensor cores compute it while the warps evaluate ``p^T``,
      and ``ds^T`` is formed while ``dv``'s product runs. sm_90, Triton 3.6, D=128 one-launch backward:
      the tensor cores' idle stretches in that loop shrink from ~80 + ~80 to ~40 + ~20 instructions (the
      ``MUFU.EX2`` run sits between the ``dp^T`` MMAs and their wait), same instruction count, stack 56 B
      (causal: 128 -> 152 B; applied to the masked segments too it was 208). The dQ loop is left as it is:
      ptxas already overlaps its exponentials with its ``dp`` MMAs. Identical results. None = the default
      of :data:`GPU_EARLY_DP` (on for D=128, and for D=64 and D=256 without a causal mask or window).
    * ``dkdv_col_split``: 1 or 2 dK/dV programs per key block. With 2 each program accumulates half of
      dK's and dV's columns (half the accumulator registers, so larger tiles fit) and recomputes the
      scores and dP^T over both halves (1.5x the dK/dV kernel's products); the backward then runs as two
      launches. Needs padded head dims >= 32. Identical results up to the products' summation order. None
      = the default of :data:`GPU_DKDV_COL_SPLIT`, else 1.
    * ``skip_empty_tail``: whether the backward's dK/dV and dQ kernels (and the one-launch backward's two
      halves) leave their trailing masked segment out when the plan proves it empty: no causal mask or
      window, fixed lengths, a loop axis the block divides. An empty segment still runs its pipelined loop's
      prologue and drain (the decode kernel lost ~2 us per call to them at B=1 S=16k), and a runtime branch
      around it makes ptxas serialize the causal kernels' wgmmas, so the choice is made at compile time.
      sm_90, Triton 3.6, B=4 S=4096 full attention: one-launch D=128 backward 4944 -> 3072 instructions
      (stack 56 -> 24 B, the dK/dV loop's spill reloads 12 -> 6), D=256 dK/dV 255 -> 239 registers; causal
      kernels unchanged. H200, B=4 S=4096 bf16, alternating four times with ``skip_empty_tail=False``
      (``attention_ab_skip_empty_tail-False*_h200.json``), median full-attention backward ms: D=128 3.447
      -> 3.439, D=64 1.941 -> 1.927, GQA 32/8 D=128 7.061 -> 6.720 (-5%), D=256 11.47 -> 11.05 (-4%, every
      sample). The forward keeps its three segments: the same change there measured ~6% slower on every
      full-attention row of the H200's D=128 table (``attention_h200_d128_tail_fwd.json``). None = True.

    The GPU defaults are the fastest of the candidates ``bench_attention.py --tune-only`` timed on an H200
    (the sweep is quoted above :data:`GPU_TILES`). The interpreter (CPU) pays per program and per
    operation, not per element: it takes 64 x 64 tiles everywhere and no pipelining. Block sizes must be
    powers of two >= 16 (``tl.dot``'s minimum).
    """

    block_m: Optional[int] = None
    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    dkdv_block_m: Optional[int] = None
    dkdv_block_n: Optional[int] = None
    dkdv_num_warps: Optional[int] = None
    dkdv_num_stages: Optional[int] = None
    dq_block_m: Optional[int] = None
    dq_block_n: Optional[int] = None
    dq_num_warps: Optional[int] = None
    dq_num_stages: Optional[int] = None
    masked_num_stages: Optional[int] = None
    masked_block_n: Optional[int] = None
    head_group: Optional[int] = None
    fused_backward: Optional[bool] = None
    early_dp: Optional[bool] = None
    dkdv_col_split: Optional[int] = None
    skip_empty_tail: Optional[bool] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "block" in f.name and value is not None:
                if value < 16 or value & (value - 1):
                    raise ValueError(f"AttentionConfig.{f.name}: must be a power of two >= 16, got {value}")
        if self.masked_num_stages is not None and self.masked_num_stages < 1:
            raise ValueError(f"AttentionConfig.masked_num_stages: must be None or >= 1, got {self.masked_num_stages}")
        if self.head_group is not None and self.head_group < 1:
            raise ValueError(f"AttentionConfig.head_group: must be None or >= 1, got {self.head_group}")
        if self.dkdv_col_split not in (None, 1, 2):
            raise ValueError(f"AttentionConfig.dkdv_col_split: must be None, 1 or 2, got {self.dkdv_col_split!r}")
        for flag in ("fused_backward", "early_dp", "skip_empty_tail"):
            value = getattr(self, flag)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"AttentionConfig.{flag}: must be None, True or False, got {value!r}")

    def tile(self, kernel: str, default: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        """(block_m, block_n, num_warps, num_stages) of ``kernel`` ("fwd", "dkdv" or "dq")."""
        prefix = "" if kernel == "fwd" else kernel + "_"
        given = [getattr(self, prefix + f) for f in ("block_m", "block_n", "num_warps", "num_stages")]
        return tuple(g if g is not None else d for g, d in zip(given, default))


# (block_m, block_n, num_warps, num_stages) per kernel, by padded head dim (the larger of Dqk, Dv), for
# Hopper. First chosen by ptxas (largest tiles without spills); where the H200 timed a tile faster, the timing
# wins. "fwd_masked": the forward of causal / windowed calls, whose diagonal blocks may favour other tiles.
# From the H200 sweep of 2026-11-30 (bench_attention.py --tune-only, S=4096, B*S=16384, H=16, bf16; TFLOP/s
# full / causal, the previous default in brackets; the backward figures time the whole backward with one
# kernel's tile changed):
#   D=64:  forward 128 x 64, 8 warps 440 (414) full, 64 x 64, 4 warps 357 (336) causal; dK/dV 64 x 64, 4 warps,
#          3 stages 349 / 225 (283 / 202); dQ 64 x 64, 4 warps, 3 stages 291 / 252 (285 / 202)
#   D=128: forward 128 x 128 causal too 407 (399); dK/dV 64 x 128, 8 warps, 3 stages 375 / 326 (365 / 324);
#          dQ 4 stages 375 / 330 (359 / 323)
#   D=256: forward 128 x 64, 8 warps, 2 stages 434 / 395 (169 / 153: the first table had it at 64 x 32);
#          dK/dV 32 x 32, 4 warps 141 / 131 (102 / 98); dQ 128 x 32 125 / 122 (102 / 98)
#          (the same dK/dV tile at 8 warps, spill-free where 4 warps spill 16 / 136 B full / causal: backward
#          13.96 -> 21.8 ms full, 7.42 -> 11.5 causal, B=4 S=4096, attention_ab_dkdv_num_warps-8_d256_h200.json)
# "dkdv_gqa_causal": the dK/dV tile of causal calls whose K / V heads serve several query heads (each dK/dV
# program walks group x Sq query rows): D=128, GQA 32/8, S=4096, alternating both four times in one process
# (bench_attention.py --ab 4 --ab-config '{"dkdv_block_m": 32}'), median backward 325.5 -> 339.3 TFLOP/s;
# the same tile costs MHA causal 3-4% (D=128 342.5 -> 332.6, D=64 305 -> 292) and GQA full 2% (375.5 -> 369).
GPU_TILES = {
    64: {"fwd": (128, 64, 8, 3), "fwd_masked": (64, 64, 4, 3), "dkdv": (64, 64, 4, 3), "dq": (64, 64, 4, 3)},
    128: {"fwd": (128, 128, 8, 3), "fwd_masked": (128, 128, 8, 3), "dkdv": (64, 128, 8, 3),
          "dkdv_gqa_causal": (32, 128, 8, 3), "dq": (128, 64, 8, 4)},
    256: {"fwd": (128, 64, 8, 2), "fwd_masked": (128, 64, 8, 2), "dkdv": (32, 32, 4, 2),
          "dkdv_split": (32, 128, 8, 2), "dq": (128, 32, 8, 2)},
}
# Pipelining depth of the masked segments per forward entry where the H200 timed it faster than the entry's
# num_stages (AttentionConfig.masked_num_stages overrides it): D=128's full forward 503 vs 475 TFLOP/s at
# S=4096 with 2 (491 with 1), although at that length no masked segment runs: with 3 the kernel as a whole
# spills 16 bytes (sm_90, Triton 3.6), with 2 it does not (same sweep as above).
GPU_MASKED_STAGES = {128: {"fwd": 2}}
# Key block width of the masked segments per forward entry where the H200 timed a narrower one faster
# (AttentionConfig.masked_block_n overrides it): D=128 causal, S=4096, alternating three times in one process
# (bench_attention.py --ab 3 --ab-config '{"masked_block_n": 64}', attention_ab_masked_block_n-64_h200.json),
# median forward MHA 419.6 -> 425.3 TFLOP/s, GQA 32/8 432.4 -> 443.5. Not for the full forward ("fwd": its
# masked segments are the ragged tails): there the narrower masked loop costs the visible loop 32 bytes of
# stack, and MHA 498.6 -> 475.8, GQA 503.5 -> 493.0.
GPU_MASKED_BLOCK_N = {128: {"fwd_masked": 64}}
# Whether the dK/dV loop issues dP^T before the exponentials (AttentionConfig.early_dp) by default, per padded
# head dim, for full attention ("dkdv") and causal / windowed calls ("dkdv_masked"); absent = off. H200, S=4096,
# B=4, bf16, alternating four times in one process (bench_attention.py --ab 4 --ab-config '{"early_dp": true}',
# attention_ab_early_dp-True_h200.json), median backward TFLOP/s: D=128 full 378.6 -> 395.3, causal 342.2 ->
# 349.0; GQA 32/8 full 377.1 -> 391.1, causal 336.8 -> 347.6; D=64 full 338.7 -> 353.6, causal 316.8 -> 312.4
# (kept off). D=256 (attention_ab_early_dp-True_d256_h200.json, B=4 H=16, S=4096), backward ms: full
# 14.31 -> 13.99 (2.3%, every alternation), causal 7.41 -> 7.40 (kept off).
GPU_EARLY_DP = {64: {"dkdv": True}, 128: {"dkdv": True, "dkdv_masked": True}, 256: {"dkdv": True}}
# dK/dV programs per key block (AttentionConfig.dkdv_col_split) per padded head dim where the H200 timed a
# split faster, for full attention ("dkdv") and causal / windowed calls ("dkdv_masked"); absent = 1. A split
# plan takes the table's "dkdv_split" tile where it has one. D=256: half of dK / dV's 256 columns per program
# leaves room for 128-key tiles with 8 warps on wgmma (sm_90, Triton 3.6: 255 registers, no stack, full and
# causal; the unsplit 32 x 32 tile: 16 / 136 B of stack). H200, B=4 H=16 S=4096, alternating three times in
# one process (attention_ab_dkdv_col_split-2_dkdv_block_m-32_dkdv_block_n-128_dkdv_num_warps-8_d256_h200.json),
# backward: full 14.06 -> 11.43 ms (195.5 -> 240.6 TFLOP/s), causal 7.43 -> 6.05 ms (184.9 -> 227.2); a split
# at 64 x 64 / 8 warps lost (16.2 / 9.3 ms), at 32 x 64 / 4 warps full +4%, causal -10%. D=128 and D=64 keep
# one program (attention_ab_dkdv_col_split-2_h200.json, three alternations, backward ms: D=128 full 3.52 -> 4.94,
# causal 1.92 -> 2.68, GQA 32/8 full 7.10 -> 9.92, D=64 full 1.96 -> 2.97): their unsplit tiles already run on
# wgmma, so a split only adds products and gives up the one-launch backward.
GPU_DKDV_COL_SPLIT = {256: {"dkdv": 2, "dkdv_masked": 2}}
# float32 inputs take IEEE dots (no tensor-core fp32 path), which keep their operands in registers: small tiles.
GPU_TILES_FP32 = {
    128: {"fwd": (32, 32, 8, 2), "fwd_masked": (32, 32, 8, 2), "dkdv": (16, 32, 4, 2), "dq": (32, 32, 8, 2)},
    256: {"fwd": (32, 32, 8, 2), "fwd_masked": (32, 32, 8, 2), "dkdv": (16, 16, 4, 2), "dq": (32, 32, 8, 2)},
}
INTERPRETER_TILE = (64, 64, 4, 1)


DEFAULT_CONFIG = AttentionConfig()


@dataclasses.dataclass(frozen=True)
class AttnShape:
    """What the kernels need to know about a validated call. Packed: ``batch`` is the number of sequences,
    ``seqlen_*`` the static maxima, ``total_*`` the packed row counts; dense: ``total = batch * seqlen``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    total_q: int
    total_k: int
    heads_q: int
    heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str
    varlen: bool

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def out_shape(self) -> tuple[int, ...]:
        if self.varlen:
            return (self.total_q, self.heads_q, self.head_dim_v)
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads_q, self.total_q) if self.varlen else (self.batch, self.heads_q, self.seqlen_q)

    def q_shape(self) -> tuple[int, ...]:
        return self._shape(self.total_q, self.seqlen_q, self.heads_q, self.head_dim_qk)

    def k_shape(self) -> tuple[int, ...]:
        return self._shape(self.total_k, self.seqlen_k, self.heads_kv, self.head_dim_qk)

    def v_shape(self) -> tuple[int, ...]:
        return self._shape(self.total_k, self.seqlen_k, self.heads_kv, self.head_dim_v)

    def _shape(self, total, seqlen, heads, dim):
        return (total, heads, dim) if self.varlen else (self.batch, seqlen, heads, dim)


@dataclasses.dataclass(frozen=True)
class AttnOptions:
    """Normalised scalar options (see :func:`check_attention_args`)."""

    softmax_scale: float
    causal: bool
    # Query i sees keys j with -window_left <= j - (i + Sk - Sq) <= window_right; None = unbounded.
    # Public calls give sides >= 0 (causal: right = 0); internal callers may shift the diagonal with any
    # int (SDPA's top-left causal is window_right = Sq - Sk).
    window_left: Optional[int]
    window_right: Optional[int]
    softcap: float
    has_alibi: bool
    alibi_batched: bool  # slopes (B, Hq) rather than (Hq,)
    has_sinks: bool

    @property
    def has_local(self) -> bool:
        return self.window_left is not None or self.window_right is not None


# ------------------------------------------------------------------------------------------------ checks

def check_score_options(*, head_dim_qk: int, causal, softmax_scale, window_size, softcap):
    """Validate the score options shared by attention and decode; returns (scale, window_left,
    window_right, softcap) with None for an unbounded side and causal folded into window_right = 0."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        scale = 1.0 / math.sqrt(head_dim_qk)
    else:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a Python float or None, got {type(softmax_scale).__name__}")
        scale = float(softmax_scale)
        if not math.isfinite(scale):
            raise ValueError(f"softmax_scale: must be finite, got {softmax_scale}")
    try:
        left, right = window_size
        left, right = int(left), int(right)
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair of ints (left, right), got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each side must be >= -1 (-1 = unbounded), got {(left, right)}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a Python float, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap: must be >= 0 (0 disables it), got {softcap}")
    return scale, (None if left < 0 else left), (0 if causal else (None if right < 0 else right)), float(softcap)


def check_attention_args(
    *, q: TensorInfo, k: TensorInfo, v: TensorInfo, alibi_slopes: Optional[TensorInfo] = None,
    sinks: Optional[TensorInfo] = None, cu_seqlens_q: Optional[TensorInfo] = None,
    cu_seqlens_k: Optional[TensorInfo] = None, max_seqlen_q=None, max_seqlen_k=None, causal=False,
    softmax_scale=None, window_size=(-1, -1), softcap=0.0,
) -> tuple[AttnShape, AttnOptions]:
    """Validate a flash_attention call from (shape, dtype-name) pairs, before any launch; shared by both
    front-ends so that both raise the same ``ValueError`` / ``TypeError`` naming the argument.

    Values inside ``cu_seqlens_*`` are checked separately by :func:`check_cu_seqlens_values` (the front-ends
    call it when the values are on the host and not traced).
    """
    for name, info in (("q", q), ("k", k), ("v", v)):
        check_float_dtype(name, info[1])
    if k[1] != q[1] or v[1] != q[1]:
        raise TypeError(f"q, k, v: must share one dtype, got q {q[1]}, k {k[1]}, v {v[1]}")
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim = 3 if varlen else 4
    layout = "(total, heads, head_dim) with cu_seqlens" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, info in (("q", q), ("k", k), ("v", v)):
        if len(info[0]) != ndim:
            raise ValueError(f"{name}: expected {ndim} dimensions {layout}, got shape {fmt_shape(info[0])}")
        if any(d < 1 for d in info[0]):
            raise ValueError(f"{name}: empty tensor of shape {fmt_shape(info[0])}; every dimension must be >= 1")
    qs, ks, vs = tuple(q[0]), tuple(k[0]), tuple(v[0])
    if not varlen:
        if not (qs[0] == ks[0] == vs[0]):
            raise ValueError(f"q, k, v: batch sizes differ: q {fmt_shape(qs)}, k {fmt_shape(ks)}, v {fmt_shape(vs)}")
    if ks[:-1] != vs[:-1]:
        raise ValueError(f"k, v: must agree in every dimension but the last (key length and heads), got "
                         f"k {fmt_shape(ks)} and v {fmt_shape(vs)}")
    if qs[-1] != ks[-1]:
        raise ValueError(f"q, k: head dims differ: q {fmt_shape(qs)} (Dqk={qs[-1]}), k {fmt_shape(ks)} (Dqk={ks[-1]})")
    hq, hkv = qs[-2], ks[-2]
    if hq % hkv:
        raise ValueError(f"q, k: the number of query heads ({hq}) must be a multiple of the number of "
                         f"key/value heads ({hkv}) for grouped-query attention")
    for name, dim in (("q", qs[-1]), ("v", vs[-1])):
        if dim > MAX_HEAD_DIM:
            raise ValueError(f"{name}: head dim {dim} is not supported; the kernels handle 1..{MAX_HEAD_DIM} "
                             "(a tile must fit in registers and shared memory)")

    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q, cu_seqlens_k: give both (packed variable length) or neither")
        for name, info in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if info[1] != "int32":
                raise TypeError(f"{name}: must be int32, got {info[1]}")
            if len(info[0]) != 1 or info[0][0] < 2:
                raise ValueError(f"{name}: expected shape (n_seqs + 1,) with n_seqs >= 1, got {fmt_shape(info[0])}")
        if cu_seqlens_q[0] != cu_seqlens_k[0]:
            raise ValueError(f"cu_seqlens_q, cu_seqlens_k: must have the same length (one entry per sequence "
                             f"+ 1), got {cu_seqlens_q[0][0]} and {cu_seqlens_k[0][0]}")
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is None:
                raise ValueError(f"{name}: required with cu_seqlens (a static bound on the sequence lengths)")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a Python int >= 1, got {value!r}")
        batch = cu_seqlens_q[0][0] - 1
        shape = AttnShape(batch, max_seqlen_q, max_seqlen_k, qs[0], ks[0], hq, hkv, qs[-1], vs[-1], q[1], True)
    else:
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                raise ValueError(f"{name}: only meaningful with cu_seqlens_q / cu_seqlens_k (packed inputs); "
                                 f"got {value!r} for dense inputs")
        shape = AttnShape(qs[0], qs[1], ks[1], qs[0] * qs[1], ks[0] * ks[1], hq, hkv, qs[-1], vs[-1], q[1],
                          False)

    for name, length in (("q", shape.seqlen_q), ("k", shape.seqlen_k)):
        check_seqlen_bound(f"max_seqlen_{name}: {length}" if varlen else f"{name}: sequence length {length}",
                           length)
    scale, window_left, window_right, softcap = check_score_options(
        head_dim_qk=qs[-1], causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)

    alibi_batched = False
    if alibi_slopes is not None:
        check_float_dtype("alibi_slopes", alibi_slopes[1])
        ashape = tuple(alibi_slopes[0])
        if ashape == (shape.batch, hq):
            alibi_batched = True
        elif ashape != (hq,):
            raise ValueError(f"alibi_slopes: expected shape ({hq},) or ({shape.batch}, {hq}) (heads, or batch x "
                             f"heads), got {fmt_shape(ashape)}")
    if sinks is not None:
        check_float_dtype("sinks", sinks[1])
        if tuple(sinks[0]) != (hq,):
            raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got {fmt_shape(sinks[0])}")

    options = AttnOptions(
        softmax_scale=scale, causal=causal, window_left=window_left, window_right=window_right,
        softcap=softcap, has_alibi=alibi_slopes is not None, alibi_batched=alibi_batched,
        has_sinks=sinks is not None)
    return shape, options


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, shape: AttnShape) -> None:
    """Values of packed-sequence offsets (host integer sequences): start at 0, non-decreasing, end at the
    packed length, no sequence longer than ``max_seqlen_*``."""
    for name, cu, total, max_len, mname in (
            ("cu_seqlens_q", cu_seqlens_q, shape.total_q, shape.seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, shape.total_k, shape.seqlen_k, "max_seqlen_k")):
        values = [int(x) for x in cu]
        if values[0] != 0:
            raise ValueError(f"{name}: must start at 0, got {values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if min(lengths) < 0:
            raise ValueError(f"{name}: must be non-decreasing, got {values}")
        if values[-1] != total:
            raise ValueError(f"{name}: the last offset ({values[-1]}) must equal the packed length ({total})")
        if max(lengths) > max_len:
            raise ValueError(f"{mname}: {max_len} is smaller than the longest sequence ({max(lengths)})")


# ------------------------------------------------------------------------------------------------- plans

def _pad(d: int) -> int:
    return max(16, next_power_of_2(d))


def _gpu_key(shape: AttnShape) -> tuple[dict, int]:
    """The GPU tile table for the call's dtype and its key: the padded head dim (the larger of Dqk, Dv)
    rounded up to a table entry."""
    d = max(_pad(shape.head_dim_qk), _pad(shape.head_dim_v))
    if shape.dtype == "float32":
        return GPU_TILES_FP32, 128 if d <= 128 else 256
    return GPU_TILES, 64 if d <= 64 else 128 if d <= 128 else 256


def _tile(kernel: str, shape: AttnShape, target: Target, config: AttentionConfig):
    """``kernel``: "fwd", "fwd_masked" (the forward of a causal / windowed call), "dkdv", "dkdv_gqa_causal"
    (the dK/dV kernel of a causal GQA call; "dkdv" where the table has no such entry) or "dq"; the config's
    fields for the kernel ("fwd" for both forward entries, "dkdv" for both dK/dV entries) override them."""
    given = kernel.split("_")[0]
    if target.interpret:
        return config.tile(given, INTERPRETER_TILE)
    table, key = _gpu_key(shape)
    return config.tile(given, table[key].get(kernel) or table[key][given])


def _head_group(config: AttentionConfig, options: AttnOptions, target: Target) -> int:
    """The main kernels' ``HEAD_GROUP`` constexpr (program order, see ``block_schedule``). Default: 4 for
    causal attention on a GPU -- H200, D=128, S=4096, bf16 (``attention_order_h200.json``): MHA 16 heads
    forward 401 -> 427 TFLOP/s, backward 323 -> 333; GQA 32/8 forward 428 -> 439, backward 273 -> 314 (8
    and 16 within 1-3% of 4, 64 slower) -- 1 otherwise: without the causal mask every block is as long as
    the next and grouping only spreads a head's K / V over more of L2 (full attention forward 528 -> 481 at
    4). The interpreter keeps grid order (its program order does not matter)."""
    if config.head_group is not None:
        return config.head_group
    return 4 if options.causal and not target.interpret else 1


def _early_dp(config: AttentionConfig, shape: AttnShape, options: AttnOptions, target: Target) -> bool:
    """The backward's ``EARLY_DP`` constexpr: the config's, else :data:`GPU_EARLY_DP`'s (off in the
    interpreter, where the order of the products does not matter, for float32 inputs and where untimed)."""
    if config.early_dp is not None:
        return config.early_dp
    entry = "dkdv_masked" if options.causal or options.has_local else "dkdv"
    return bool(_timed_default(GPU_EARLY_DP, entry, shape, target))


def _dkdv_entry(shape: AttnShape, options: AttnOptions, target: Target, col_split: int) -> str:
    """The tile table's entry for the dK/dV kernel: "dkdv_split" for a split plan where the table has one,
    else "dkdv_gqa_causal" for causal GQA (where present), else "dkdv"."""
    if col_split > 1 and not target.interpret:
        table, key = _gpu_key(shape)
        if "dkdv_split" in table[key]:
            return "dkdv_split"
    return "dkdv_gqa_causal" if shape.group > 1 and options.causal else "dkdv"


def _dkdv_col_split(config: AttentionConfig, shape: AttnShape, options: AttnOptions, target: Target) -> int:
    """The dK/dV kernel's ``COL_SPLIT`` constexpr: the config's, else :data:`GPU_DKDV_COL_SPLIT`'s, else 1."""
    split = config.dkdv_col_split
    if split is None:
        entry = "dkdv_masked" if options.causal or options.has_local else "dkdv"
        split = _timed_default(GPU_DKDV_COL_SPLIT, entry, shape, target) or 1
    if split > 1 and min(_pad(shape.head_dim_qk), _pad(shape.head_dim_v)) < 32:
        raise ValueError(f"AttentionConfig.dkdv_col_split: a split needs padded head dims >= 32 (halves of at "
                         f"least 16 columns), got Dqk={shape.head_dim_qk}, Dv={shape.head_dim_v}")
    return split


def _timed_default(per_dim: dict, kernel: str, shape: AttnShape, target: Target):
    """The value an H200 timing set for ``kernel`` ("fwd", "fwd_masked", ...) in ``per_dim`` (keyed like
    :data:`GPU_TILES`), or None: in the interpreter, for float32 inputs and where nothing was timed."""
    if target.interpret:
        return None
    table, key = _gpu_key(shape)
    return per_dim.get(key, {}).get(kernel) if table is GPU_TILES else None


def _masked_stages(kernel: str, shape: AttnShape, target: Target, config: AttentionConfig) -> int:
    """The forward's ``MASKED_STAGES`` constexpr: 0 = the forward's num_stages (and always in the interpreter)."""
    if target.interpret:
        return 0
    if config.masked_num_stages is not None:
        return config.masked_num_stages
    return _timed_default(GPU_MASKED_STAGES, kernel, shape, target) or 0


def _masked_block_n(kernel: str, shape: AttnShape, target: Target, config: AttentionConfig, block_n: int) -> int:
    """The forward's ``MASKED_BLOCK_N`` constexpr: a divisor of ``block_n`` (``block_n`` itself in the
    interpreter and wherever no narrower width was timed faster)."""
    width = config.masked_block_n or _timed_default(GPU_MASKED_BLOCK_N, kernel, shape, target)
    return min(width or block_n, block_n)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, row, head) element strides of a contiguous dense ``(B, S, H, D)`` or packed ``(T, H, D)``
    tensor; the batch stride of a packed tensor is 0 (rows are addressed through cu_seqlens)."""
    if len(shape) == 4:
        return (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3])
    return (0, shape[1] * shape[2], shape[2])


def _lse_strides(shape: AttnShape) -> tuple[int, int]:
    return (0, shape.total_q) if shape.varlen else (shape.heads_q * shape.seqlen_q, shape.seqlen_q)


def check_seqlen_bound(what: str, length: int) -> None:
    """Refuse a sequence (or cache) longer than MAX_SEQLEN tokens; ``what`` names the argument and value."""
    if length > MAX_SEQLEN:
        raise ValueError(f"{what} is above {MAX_SEQLEN}: the kernels compare positions within a sequence in "
                         f"int32, with an unbounded window side standing for 2**30")


def window_scalars(options) -> tuple[int, int]:
    """The kernels' (window_left, window_right) scalars from options with ``window_left`` / ``window_right``
    (None = unbounded -> 2**30), for the attention and decode plans alike."""
    def clamp(side):
        return _UNBOUNDED if side is None else max(-_UNBOUNDED, min(side, _UNBOUNDED))

    return clamp(options.window_left), clamp(options.window_right)


def _common_scalars(shape: AttnShape, options: AttnOptions):
    left, right = window_scalars(options)
    return (("seqlen_q", shape.seqlen_q), ("seqlen_k", shape.seqlen_k), ("total_q", shape.total_q),
            ("total_k", shape.total_k), ("sm_scale", float(options.softmax_scale)),
            ("softcap", float(options.softcap)), ("window_left", left), ("window_right", right))


def _strided(prefix: str, strides: tuple[int, int, int]):
    return tuple((f"stride_{prefix}{dim}", int(s)) for dim, s in zip("bsh", strides))


def local_mask_mode(window_left: Optional[int], window_right: Optional[int], *, one_comparison: bool) -> int:
    """The kernels' ``HAS_LOCAL`` constexpr (see ``visible`` in kernels_common): 0 = no window; 1 = a right
    edge at or left of the diagonal and no left edge (causal), where the mask is one comparison per score;
    2 = any other window, and causal ones unless ``one_comparison``.

    Every attention kernel takes the one-comparison mask for causal calls; decode keeps three (its masked
    segments are ragged tails, not timed). History: with the earlier form of the comparison (``k - (q +
    diag) <= right``, a subtraction per score) only the dQ loop gained from it (H200, causal, S=4096 /
    16384, ``attention_causalmask_h200_d128-64.json``: backward D=64 309 -> 325 / 333 -> 356 TFLOP/s, D=128
    339-350 -> 352 / 378-392 -> 393), while the forward lost at D=128 (425 -> 407 / 480 -> 463: spills in
    its unmasked loop) and the dK/dV loop spilled more (sm_90: main loop 421 -> 500 instructions). With the
    bound compared as ``k <= q + (diag + right)`` (a vector over the rows) the one comparison is the smaller
    kernel everywhere: sm_90, Triton 3.6, D=128 causal forward diagonal step 612 -> 472 instructions and
    unmasked step 544 -> 538, D=64 544 -> 399 / 299 -> 298, D=256 848 -> 664 / 522 -> 516."""
    if window_left is None and window_right is None:
        return 0
    if one_comparison and window_left is None and window_right <= 0:
        return 1
    return 2


def _flags(shape: AttnShape, options: AttnOptions):
    mask = local_mask_mode(options.window_left, options.window_right, one_comparison=True)
    return (("HAS_LOCAL", mask), ("HAS_SOFTCAP", options.softcap > 0),
            ("HAS_ALIBI", options.has_alibi), ("IS_VARLEN", shape.varlen),
            ("DOT_PRECISION", "ieee" if shape.dtype == "float32" else "tf32"))


def _align(scalars) -> tuple[tuple[str, int], tuple[str, int]]:
    """STRIDE_ALIGN / LSE_ALIGN: the power of two (<= 16) dividing every q/k/v/o-like stride, and every lse
    stride, among a launch's scalars; the kernels hand it to the compiler (see ``aligned`` in
    kernels_common), since neither launcher is asked to infer it (see core_kernels/_plan.py)."""
    lse = [v for n, v in scalars if n in ("stride_lb", "stride_lh")]
    tensors = [v for n, v in scalars if n.startswith("stride_") and n not in ("stride_lb", "stride_lh", "stride_ab")]
    return ("STRIDE_ALIGN", pow2_divisor(*tensors)), ("LSE_ALIGN", pow2_divisor(*lse))


def _alibi_stride(shape: AttnShape, options: AttnOptions) -> int:
    return shape.heads_q if options.alibi_batched else 0


def _tail_blocks(config: AttentionConfig, shape: AttnShape, options: AttnOptions, loop_len: int, block: int) -> bool:
    """Whether a backward kernel keeps its trailing masked segment (its ``TAIL_BLOCKS``): always with
    ``skip_empty_tail=False``, else when the segment can hold blocks: a causal mask or a window edge,
    per-sequence lengths, or a loop axis of ``loop_len`` (queries for dK/dV, keys for dQ) that ``block`` does
    not divide. Without any, every program walks whole visible blocks and the kernel leaves the segment out
    (see ``AttentionConfig.skip_empty_tail``)."""
    if config.skip_empty_tail is False:
        return True
    return bool(options.causal or options.has_local or shape.varlen or loop_len % block)


def _sparse_options(options: AttnOptions, sparse: Optional[bsp.SparseLayout]) -> AttnOptions:
    """A block-sparse call's options: the mask's band is the window the kernels' element test uses (and a
    causal band orders programs longest first, as causal attention does)."""
    if sparse is None:
        return options
    return dataclasses.replace(options, causal=sparse.causal, window_left=sparse.window_left,
                               window_right=sparse.window_right)


def plan_attention_fwd(shape: AttnShape, options: AttnOptions, *, target: Target,
                       strides: Optional[dict[str, tuple[int, int, int]]] = None,
                       config: AttentionConfig = DEFAULT_CONFIG, sparse: Optional[bsp.SparseLayout] = None) -> Plan:
    """Plan inputs: q, k, v, [alibi_slopes], [sinks], [cu_seqlens_q, cu_seqlens_k], then with ``sparse`` (a
    BlockMask's layout, ``core_kernels/block_sparse/plan.py``) its arrays by their BlockMask names.

    ``strides`` maps "q" / "k" / "v" to (batch, row, head) element strides (default: contiguous).
    Results: out (q's dtype, ``shape.out_shape``) and lse (float32, ``shape.lse_shape``).
    """
    options = _sparse_options(options, sparse)
    strides = strides or {}
    st = {n: strides.get(n) or contiguous_strides(s)
          for n, s in (("q", shape.q_shape()), ("k", shape.k_shape()), ("v", shape.v_shape()))}
    present = {"q": True, "k": True, "v": True, "alibi_slopes": options.has_alibi,
               "sinks": options.has_sinks, "cu_seqlens_q": shape.varlen, "cu_seqlens_k": shape.varlen,
               **bsp.present_arrays(sparse, bsp.FWD_ARRAYS)}
    fwd_entry = "fwd_masked" if options.causal or options.has_local or sparse else "fwd"
    bm, bn, warps, stages = _tile(fwd_entry, shape, target, config)
    masked_bn = _masked_block_n(fwd_entry, shape, target, config, bn)
    if sparse is not None:  # tiles that divide the mask's blocks
        bm, bn = bsp.sparse_tile(bm, sparse.q_block), bsp.sparse_tile(bn, sparse.kv_block)
        masked_bn = min(masked_bn, bn)
    q_programs = cdiv(shape.seqlen_q, bm) if sparse is None else bsp.sparse_blocks(shape.seqlen_q, sparse.q_block, bm)
    lse_b, lse_h = _lse_strides(shape)
    scalars = (*_common_scalars(shape, options), *_strided("q", st["q"]), *_strided("k", st["k"]),
               *_strided("v", st["v"]), *_strided("o", contiguous_strides(shape.out_shape)),
               ("stride_lb", lse_b), ("stride_lh", lse_h), ("stride_ab", _alibi_stride(shape, options)),
               *bsp.mask_scalars(sparse, backward=False))
    launch = Launch(
        kernel=f"{_FWD}:attn_fwd_kernel",
        grid=(q_programs, shape.heads_q, shape.batch),
        inputs=tuple(n if present[n] else "q" for n in ("q", "k", "v", "alibi_slopes", "sinks", "cu_seqlens_q",
                                                         "cu_seqlens_k", *bsp.FWD_ARRAYS)),
        scalars=scalars,
        outputs=("out", "lse"),
        constexprs=(("GROUP", shape.group), ("DQK", shape.head_dim_qk), ("DV", shape.head_dim_v),
                    ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_DQK", _pad(shape.head_dim_qk)),
                    ("BLOCK_DV", _pad(shape.head_dim_v)), ("HAS_SINKS", options.has_sinks),
                    *_flags(shape, options), *_align(scalars),
                    ("MASKED_STAGES", _masked_stages(fwd_entry, shape, target, config)),
                    ("POSITIVE_SCALE", options.softmax_scale > 0),
                    ("HEAD_GROUP", _head_group(config, options, target) if sparse is None
                     else bsp.head_group(config.head_group, sparse, target.interpret)),
                    ("MASKED_BLOCK_N", masked_bn), *bsp.mask_constexprs(sparse, backward=False)),
        num_warps=warps,
        num_stages=stages,
    )
    buffers = (Spec("out", shape.out_shape, shape.dtype), Spec("lse", shape.lse_shape, "float32"))
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=buffers,
                launches=(launch,), results=("out", "lse"))


def plan_attention_bwd(shape: AttnShape, options: AttnOptions, *, target: Target, has_dlse: bool = False,
                       sinks_dtype: Optional[str] = None,
                       strides: Optional[dict[str, tuple[int, int, int]]] = None,
                       config: AttentionConfig = DEFAULT_CONFIG, sparse: Optional[bsp.SparseLayout] = None) -> Plan:
    """Plan inputs: dout, q, k, v, out, lse, [dlse], [alibi_slopes], [sinks], [cu_seqlens_q, cu_seqlens_k],
    then with ``sparse`` (a BlockMask's layout) its arrays by their BlockMask names.

    ``out`` and ``lse`` are the forward's results (contiguous); ``dlse`` a gradient arriving at lse.
    ``strides`` maps "q" / "k" / "v" / "dout" to (batch, row, head) element strides (default: contiguous).
    Results: dq, dk, dv (contiguous, in the inputs' dtype), then with sinks dsinks (``sinks_dtype``,
    ``(Hq,)``) and dsinks_part (float32 ``(batch, Hq)``, the per-sequence terms of dsinks, for vmap rules).
    """
    options = _sparse_options(options, sparse)
    strides = strides or {}
    st = {n: strides.get(n) or contiguous_strides(s)
          for n, s in (("q", shape.q_shape()), ("k", shape.k_shape()), ("v", shape.v_shape()),
                       ("dout", shape.out_shape))}
    present = {"dout": True, "q": True, "k": True, "v": True, "out": True, "lse": True, "dlse": has_dlse,
               "alibi_slopes": options.has_alibi, "sinks": options.has_sinks,
               "cu_seqlens_q": shape.varlen, "cu_seqlens_k": shape.varlen,
               **bsp.present_arrays(sparse, bsp.BWD_ARRAYS)}

    def name(n):
        return n if present[n] else "q"  # placeholder pointer for an absent input

    col_split = _dkdv_col_split(config, shape, options, target)
    kv_m, kv_n, kv_warps, kv_stages = _tile(_dkdv_entry(shape, options, target, col_split), shape, target, config)
    q_m, q_n, q_warps, q_stages = _tile("dq", shape, target, config)
    if sparse is not None:  # tiles that divide the mask's blocks
        kv_m, q_m = bsp.sparse_tile(kv_m, sparse.q_block), bsp.sparse_tile(q_m, sparse.q_block)
        kv_n, q_n = bsp.sparse_tile(kv_n, sparse.kv_block), bsp.sparse_tile(q_n, sparse.kv_block)
    lse_b, lse_h = _lse_strides(shape)
    bdqk, bdv = _pad(shape.head_dim_qk), _pad(shape.head_dim_v)
    lse_scalars = (("stride_lb", lse_b), ("stride_lh", lse_h))
    flags = _flags(shape, options)
    head_group = (_head_group(config, options, target) if sparse is None
                  else bsp.head_group(config.head_group, sparse, target.interpret))
    early_dp = ("EARLY_DP", _early_dp(config, shape, options, target))
    kv_tail = _tail_blocks(config, shape, options, shape.seqlen_q, kv_m)  # dK/dV walks query blocks
    q_tail = _tail_blocks(config, shape, options, shape.seqlen_k, q_n)  # dQ walks key blocks
    main_scalars = (*_common_scalars(shape, options), *_strided("q", st["q"]), *_strided("k", st["k"]),
                    *_strided("v", st["v"]), *_strided("do", st["dout"]), *lse_scalars,
                    ("stride_ab", _alibi_stride(shape, options)), *bsp.mask_scalars(sparse, backward=True))
    dims = (("GROUP", shape.group), ("DQK", shape.head_dim_qk), ("DV", shape.head_dim_v))
    main_inputs = ("q", "k", "v", "dout", "lse2", "delta", name("alibi_slopes"), name("cu_seqlens_q"),
                   name("cu_seqlens_k"), *bsp.mask_inputs(sparse, bsp.BWD_ARRAYS))
    mask_flags = bsp.mask_constexprs(sparse, backward=True, group=shape.group)

    # delta reads two [pre_m, Dv] tiles: about 32 elements of each per thread on a GPU.
    pre_m = 64 if target.interpret else max(16, min(128, 8192 // bdv))
    pre_scalars = (("seqlen_q", shape.seqlen_q), ("total_q", shape.total_q),
                   *_strided("o", contiguous_strides(shape.out_shape)), *_strided("do", st["dout"]), *lse_scalars)
    dkdv_scalars = (*main_scalars, *_strided("dk", contiguous_strides(shape.k_shape())),
                    *_strided("dv", contiguous_strides(shape.v_shape())))
    preprocess = Launch(
        kernel=f"{_BWD}:attn_bwd_preprocess_kernel",
        grid=(cdiv(shape.seqlen_q, pre_m), shape.heads_q, shape.batch),
        inputs=("out", "dout", name("dlse"), "lse", name("cu_seqlens_q")),
        scalars=pre_scalars,
        outputs=("delta", "lse2"),
        constexprs=(("DV", shape.head_dim_v), ("BLOCK_M", pre_m), ("BLOCK_DV", bdv),
                    ("HAS_DLSE", has_dlse), ("IS_VARLEN", shape.varlen), *_align(pre_scalars)),
        num_warps=4 if target.interpret else 8, num_stages=1)
    if sparse is None:
        kv_programs, q_programs = cdiv(shape.seqlen_k, kv_n), cdiv(shape.seqlen_q, q_m)
    else:  # whole mask blocks (the kernels take them in the mask's order)
        kv_programs = bsp.sparse_blocks(shape.seqlen_k, sparse.kv_block, kv_n)
        q_programs = bsp.sparse_blocks(shape.seqlen_q, sparse.q_block, q_m)
    kv_grid = (kv_programs * col_split, shape.heads_kv, shape.batch)
    q_grid = (q_programs, shape.heads_q, shape.batch)
    # one launch needs one warp count: with different ones (D=256's unsplit tiles: 4 and 8) the dQ path
    # would run at the dK/dV count and spill (sm_90: 1.6 KB per thread); and it runs one dK/dV program per
    # key block (no column split)
    if config.fused_backward is not False and kv_warps == q_warps and col_split == 1:  # None = fused
        fused_scalars = (*dkdv_scalars, *_strided("dq", contiguous_strides(shape.q_shape())),
                         ("heads_kv", shape.heads_kv), ("n_seqs", shape.batch))
        main = [Launch(
            kernel=f"{_BWD}:attn_bwd_kernel",
            grid=(math.prod(kv_grid) + math.prod(q_grid),),
            inputs=main_inputs,
            scalars=fused_scalars,
            outputs=("dk", "dv", "dq"),
            constexprs=(*dims, ("KV_BLOCK_M", kv_m), ("KV_BLOCK_N", kv_n), ("Q_BLOCK_M", q_m), ("Q_BLOCK_N", q_n),
                        ("BLOCK_DQK", bdqk), ("BLOCK_DV", bdv), *flags, early_dp, *_align(fused_scalars),
                        ("HEAD_GROUP", head_group), ("KV_TAIL_BLOCKS", kv_tail), ("Q_TAIL_BLOCKS", q_tail),
                        *mask_flags),
            num_warps=kv_warps, num_stages=kv_stages)]
    else:
        dq_scalars = (*main_scalars, *_strided("dq", contiguous_strides(shape.q_shape())))
        main = [
            Launch(
                kernel=f"{_BWD}:attn_bwd_dkdv_kernel",
                grid=kv_grid,
                inputs=main_inputs,
                scalars=dkdv_scalars,
                outputs=("dk", "dv"),
                constexprs=(*dims, ("BLOCK_M", kv_m), ("BLOCK_N", kv_n), ("BLOCK_DQK", bdqk), ("BLOCK_DV", bdv),
                            *flags, early_dp, *_align(dkdv_scalars), ("HEAD_GROUP", head_group),
                            ("COL_SPLIT", col_split), ("TAIL_BLOCKS", kv_tail), *mask_flags),
                num_warps=kv_warps, num_stages=kv_stages),
            Launch(
                kernel=f"{_BWD}:attn_bwd_dq_kernel",
                grid=q_grid,
                inputs=main_inputs,
                scalars=dq_scalars,
                outputs=("dq",),
                constexprs=(*dims, ("BLOCK_M", q_m), ("BLOCK_N", q_n), ("BLOCK_DQK", bdqk), ("BLOCK_DV", bdv),
                            *flags, *_align(dq_scalars), ("HEAD_GROUP", head_group), ("TAIL_BLOCKS", q_tail),
                            *mask_flags),
                num_warps=q_warps, num_stages=q_stages),
        ]
    launches = [preprocess, *main]
    buffers = [Spec("delta", shape.lse_shape, "float32"), Spec("lse2", shape.lse_shape, "float32"),
               Spec("dq", shape.q_shape(), shape.dtype), Spec("dk", shape.k_shape(), shape.dtype),
               Spec("dv", shape.v_shape(), shape.dtype)]
    results = ["dq", "dk", "dv"]
    if options.has_sinks:
        buffers += [Spec("dsinks_part", (shape.batch, shape.heads_q), "float32"),
                    Spec("dsinks", (shape.heads_q,), sinks_dtype or "float32")]
        launches.append(Launch(
            kernel=f"{_BWD}:attn_bwd_sink_kernel",
            grid=(shape.heads_q,),
            inputs=("lse", "delta", "sinks", name("cu_seqlens_q")),
            scalars=(("n_seqs", shape.batch), ("seqlen_q", shape.seqlen_q), ("total_q", shape.total_q),
                     *lse_scalars),
            outputs=("dsinks_part", "dsinks"),
            constexprs=(("HQ", shape.heads_q), ("BLOCK", 64 if target.interpret else 1024),
                        ("IS_VARLEN", shape.varlen)),
            num_warps=4, num_stages=1))
        results += ["dsinks", "dsinks_part"]
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=tuple(buffers),
                launches=tuple(launches), results=tuple(results))
