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

from .._config import active_config
from .._plan import (Launch, Plan, Spec, Target, cdiv, check_float_dtype, check_int, check_real, fmt_shape,
                     next_power_of_2, pow2_divisor)
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
    """Tiles and launch settings of the forward, dK/dV and dQ kernels; ``None`` picks the target's default
    (the tables below, by padded head dim).

    * ``block_m`` / ``block_n`` / ``num_warps`` / ``num_stages``: the forward (one program per ``block_m``
      query rows, ``block_n`` keys per step); ``dkdv_*``: the dK/dV kernel (one program per ``dkdv_block_n``
      keys, ``dkdv_block_m`` queries per step); ``dq_*``: the dQ kernel (as the forward). Block sizes are
      powers of two >= 16 (``tl.dot``'s minimum).
    * ``masked_num_stages``, ``masked_block_n``: pipeline depth and key block width of the forward's masked
      segments (causal diagonal, window edges, ragged tails); a narrower block leaves the mask arithmetic room
      in registers.
    * ``head_group``: program order (``block_schedule`` in kernels_common): 1 = grid order, G > 1 = the longest
      causal blocks of G (head, sequence) pairs first. Default: :func:`_head_group`.
    * ``fused_backward``: the dK/dV and dQ grids in one launch (the dQ programs fill the SMs the dK/dV grid's
      last wave leaves idle), when both tiles have the same warp count and dK/dV is not column-split.
      Default on.
    * ``interleave_backward``: in the one-launch backward, each (kv head, sequence) starts its dK/dV programs
      and then its dQ programs before the next one's, instead of every dK/dV program first (the two kinds
      share the head's Q, K, V and dO in L2). Default: :func:`_interleave_backward`.
    * ``early_dp``: in the dK/dV loop's unmasked segment, issue ``dp^T = v dout^T`` before the exponentials
      so the tensor cores run it while the warps compute ``p^T``.
    * ``dkdv_col_split``: 1 or 2 dK/dV programs per key block; with 2 each accumulates half of dK's and dV's
      columns (half the registers, so larger tiles fit) and recomputes the scores (1.5x the products).

    Every setting gives the same results up to the products' summation order. The interpreter (CPU) pays per
    program and per operation, not per element: 64 x 64 tiles everywhere, no pipelining.
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
    interleave_backward: Optional[bool] = None
    early_dp: Optional[bool] = None
    dkdv_col_split: Optional[int] = None

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
        for flag in ("fused_backward", "interleave_backward", "early_dp"):
            value = getattr(self, flag)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"AttentionConfig.{flag}: must be None, True or False, got {value!r}")

    def tile(self, kernel: str, default) -> tuple[int, int, int, int]:
        """(block_m, block_n, num_warps, num_stages) of ``kernel`` ("fwd", "dkdv" or "dq"): the config's
        fields, the rest from ``default`` (a tuple, or a function returning one: called only when a field
        is unset)."""
        prefix = "" if kernel == "fwd" else kernel + "_"
        given = [getattr(self, prefix + f) for f in ("block_m", "block_n", "num_warps", "num_stages")]
        if all(g is not None for g in given):
            return tuple(given)
        default = default() if callable(default) else default
        return tuple(g if g is not None else d for g, d in zip(given, default))


# The tiles (block sizes, warps, stages) of a GPU come from the tuning cache (flashbridge.tiles.cache: the user's
# tuned entries, then the shipped ones in flashbridge/tiles/data/tiles.json, then the resource model's choice);
# the switches below stay in code. "H200" means: timed on an H200 with Triton 3.6 by
# benchmarks/bench_attention.py at S=4096, bf16; keyed by padded head dim (the larger of Dqk, Dv, rounded up
# to 64, 128 or 256) and kernel entry ("fwd", "fwd_masked": causal / windowed / block-sparse, "dkdv",
# "dkdv_masked").
INTERPRETER_TILE = (64, 64, 4, 1)
# A tile no cache entry or model choice gives (never expected): small enough for every supported GPU.
FALLBACK_TILE = (64, 32, 4, 2)
# The options below apply to bf16 / fp16 on a GPU only; absent = the option's neutral value.
# masked_num_stages: H200, --tune-only (D=128's full forward at 3 stages spills 16 bytes on sm_90, at 2 none)
GPU_MASKED_STAGES = {128: {"fwd": 2}}
# masked_block_n: H200, --ab 3 --ab-config '{"masked_block_n": 64}' (the full forward lost: its visible loop spilled)
GPU_MASKED_BLOCK_N = {128: {"fwd_masked": 64}}
# early_dp: H200, --ab 4 --ab-config '{"early_dp": true}' (D=64 and D=256 causal: no gain, kept off)
GPU_EARLY_DP = {64: {"dkdv": True}, 128: {"dkdv": True, "dkdv_masked": True}, 256: {"dkdv": True}}
# dkdv_col_split: H200, --ab 3 with the split (D=64 / 128 lost: their unsplit tiles already run on wgmma)
GPU_DKDV_COL_SPLIT = {256: {"dkdv": 2, "dkdv_masked": 2}}




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
    # Attention dropout on the probabilities (0 = none: the kernels compile without it); with p > 0 the
    # plans take an int32 (1,) "seed" input.
    dropout_p: float = 0.0

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
        # comparisons rather than math.isfinite: torch.compile traces a float argument symbolically
        if not -math.inf < scale < math.inf:
            raise ValueError(f"softmax_scale: must be finite, got {softmax_scale}")
    left, right = int_pair("window_size", window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window_size: each side must be >= -1 (-1 = unbounded), got {(left, right)}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a Python float, got {type(softcap).__name__}")
    if not 0 <= softcap < math.inf:
        raise ValueError(f"softcap: must be >= 0 (0 disables it), got {softcap}")
    return scale, (None if left < 0 else left), (0 if causal else (None if right < 0 else right)), float(softcap)


# The smallest dropout_p whose applied rate rounds to 1: round(256 * p) = 256 for p >= 511/512 after p's
# rounding to float32 (the kernels' ``byte_threshold``), i.e. for p >= 511/512 - 2**-25 (a tie: rounds up).
DROPOUT_P_ROUNDS_TO_ONE = 511 / 512 - 2 ** -25


def check_dropout(dropout_p, has_seed: bool) -> float:
    """Attention dropout's probability as a float in [0, 1); a seed is required with p > 0 (the mask is a
    function of it: no hidden global state). The kernels apply p rounded to a multiple of 1/256
    (``reference.attention.attention_dropout_rate``); a p that rounds to 1 (>= 511/512) is refused."""
    check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1), got {dropout_p}")
    if dropout_p >= DROPOUT_P_ROUNDS_TO_ONE:
        raise ValueError(f"dropout_p: must be below 511/512 (attention applies p rounded to a multiple of 1/256, "
                         f"and this one rounds to 1), got {dropout_p}")
    if dropout_p > 0 and not has_seed:
        raise ValueError("seed: required when dropout_p > 0 (a Python int or a one-element integer tensor)")
    return float(dropout_p)


def int_pair(name: str, value) -> tuple[int, int]:
    """A pair of ints ``(left, right)``: not a pair is a ``ValueError``, a side that is not an int (a float
    that ``int()`` would truncate, a string) a ``TypeError``, both naming the argument."""
    try:
        left, right = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair of ints (left, right), got {value!r}") from None
    what = "a pair of ints (left, right)"
    return check_int(name, left, what), check_int(name, right, what)


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
        check_seqlen_bound(f"max_seqlen_{name}: {{}}" if varlen else f"{name}: sequence length {{}}", length)
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


@dataclasses.dataclass(frozen=True)
class KVCache:
    """Where a flash_attention call's keys live when they are a cache rather than sequences in q's layout
    (forward only; see :func:`check_kv_cache_args`).

    * ``page_size > 0``: a paged cache ``(num_pages, page_size, Hkv, D)`` read through ``block_table``
      ``(B, max_pages)``; the keys' static bound (``AttnShape.seqlen_k``) is the table's capacity.
    * ``batched``: a padded ``(B, S_max, Hkv, D)`` cache beside packed queries.
    * ``seqused``: sequence b uses its first ``seqused_k[b]`` keys (any layout).
    """

    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    table_shape: tuple[int, ...] = (1, 1)
    page_size: int = 0
    batched: bool = False
    seqused: bool = False


def supported_page_size(page_size: int) -> bool:
    """Pages of a power of two (one table entry per key tile when the page holds whole tiles, one per key
    when a tile spans pages) or of a multiple of 128 (every key tile of the forward divides it)."""
    return page_size >= 1 and (page_size & (page_size - 1) == 0 or page_size % 128 == 0)


def check_kv_cache_args(*, q: TensorInfo, k: TensorInfo, v: TensorInfo, block_table: Optional[TensorInfo],
                        seqused_k: Optional[TensorInfo], cu_seqlens_q: Optional[TensorInfo] = None,
                        cu_seqlens_k: Optional[TensorInfo] = None, max_seqlen_q=None, max_seqlen_k=None,
                        **options) -> tuple[AttnShape, AttnOptions, KVCache]:
    """Validate a flash_attention call whose keys come from a cache (``block_table`` and / or ``seqused_k``,
    flash-attn's ``flash_attn_varlen_func(..., block_table=, seqused_k=)``); returns (shape, options, cache).

    * ``block_table`` int32 ``(B, max_pages)``: k ``(num_pages, page_size, Hkv, Dqk)``, v ``(num_pages,
      page_size, Hkv, Dv)``, ``seqused_k`` required, no ``cu_seqlens_k``; q packed (``cu_seqlens_q`` with B
      sequences) or ``(B, Sq, Hq, Dqk)``.
    * ``seqused_k`` int32 ``(B,)`` alone: k / v as flash_attention takes them (dense, or packed with
      ``cu_seqlens_k``), or ``(B, S_max, Hkv, D)`` beside packed q (no ``cu_seqlens_k``).

    ``max_seqlen_k`` is accepted (flash-attn passes it) and not needed: the cache's shape bounds the keys.
    ``options`` are flash_attention's score options (causal, softmax_scale, window_size, softcap, alibi_slopes,
    sinks). Values of ``block_table`` / ``seqused_k`` are clamped in the kernel (pages to the pool, counts
    to ``[0, capacity]``), so no value can address memory outside the cache.
    """
    if max_seqlen_k is not None and (isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int)
                                     or max_seqlen_k < 1):
        raise ValueError(f"max_seqlen_k: must be None or a Python int >= 1, got {max_seqlen_k!r}")
    if seqused_k is None:
        raise ValueError("seqused_k: required with block_table (int32 (batch,), the keys each sequence uses)")
    if seqused_k[1] != "int32":
        raise TypeError(f"seqused_k: must be int32, got {seqused_k[1]}")
    check_float_dtype("k", k[1])
    check_float_dtype("v", v[1])
    qs, ks, vs = tuple(q[0]), tuple(k[0]), tuple(v[0])
    packed_q = cu_seqlens_q is not None
    if packed_q and (len(cu_seqlens_q[0]) != 1 or cu_seqlens_q[0][0] < 2):
        raise ValueError(f"cu_seqlens_q: expected shape (n_seqs + 1,) with n_seqs >= 1, got "
                         f"{fmt_shape(cu_seqlens_q[0])}")
    if len(qs) != (3 if packed_q else 4):
        raise ValueError(f"q: expected {'(total_q, Hq, Dqk) with cu_seqlens_q' if packed_q else '(B, Sq, Hq, Dqk)'}"
                         f", got shape {fmt_shape(qs)}")
    batch = cu_seqlens_q[0][0] - 1 if packed_q else qs[0]
    if tuple(seqused_k[0]) != (batch,):
        raise ValueError(f"seqused_k: expected shape ({batch},) (one count per sequence), got "
                         f"{fmt_shape(seqused_k[0])}")
    page_size, batched = 0, False
    table_shape = (1, 1)
    if block_table is not None:
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k: not with block_table (the table and seqused_k place the keys)")
        if block_table[1] != "int32":
            raise TypeError(f"block_table: must be int32, got {block_table[1]}")
        table_shape = tuple(block_table[0])
        if len(table_shape) != 2 or table_shape[0] != batch or table_shape[1] < 1:
            raise ValueError(f"block_table: expected shape ({batch}, max_pages) (one row of page indices per "
                             f"sequence), got {fmt_shape(table_shape)}")
        for name, shp in (("k", ks), ("v", vs)):
            if len(shp) != 4 or min(shp) < 1:
                raise ValueError(f"{name}: a paged cache is (num_pages, page_size, Hkv, D), got {fmt_shape(shp)}")
        if ks[:3] != vs[:3]:
            raise ValueError(f"k, v: pages must agree in (num_pages, page_size, Hkv), got k {fmt_shape(ks)} and "
                             f"v {fmt_shape(vs)}")
        page_size = ks[1]
        if not supported_page_size(page_size):
            raise ValueError(f"k: page size {page_size} is not supported: pages of a power of two or a multiple "
                             "of 128 slots (whole key tiles per page, or whole pages per tile)")
        capacity = table_shape[1] * page_size
    elif cu_seqlens_k is None and packed_q:
        batched = True
        for name, shp in (("k", ks), ("v", vs)):
            if len(shp) != 4 or shp[0] != batch:
                raise ValueError(f"{name}: beside packed q without cu_seqlens_k, expected a padded cache "
                                 f"({batch}, S_max, Hkv, D), got {fmt_shape(shp)}")
        capacity = ks[1]
    else:
        shape, opts = check_attention_args(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                           max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **options)
        return shape, opts, KVCache(ks, vs, seqused=True)
    check_seqlen_bound("k: cache capacity {}", capacity)
    # keys as flash_attention would take them in q's layout, for the shared checks of dtypes, heads and options
    if packed_q:
        k_as, v_as = (batch * capacity, *ks[2:]), (batch * capacity, *vs[2:])
        cu_k, max_k = cu_seqlens_q, capacity
    else:
        k_as, v_as = (batch, capacity, *ks[2:]), (batch, capacity, *vs[2:])
        cu_k, max_k = None, None
    shape, opts = check_attention_args(q=q, k=(k_as, k[1]), v=(v_as, v[1]), cu_seqlens_q=cu_seqlens_q,
                                       cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_k, **options)
    return shape, opts, KVCache(ks, vs, table_shape, page_size, batched, True)


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


def check_cache_options(*, block_mask, dropout_p) -> None:
    """A flash_attention call with a key cache (``block_table`` / ``seqused_k``, forward-only) takes neither a
    block mask nor dropout; both front-ends call this before handing the call to the cache path."""
    if block_mask is not None:
        raise ValueError("block_mask: not with block_table / seqused_k (a key cache)")
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0:
        raise ValueError(f"dropout_p: not with block_table / seqused_k (a forward-only key cache), got {dropout_p!r}")


def check_cache_offsets(cu_seqlens_q, cu_seqlens_k, shape: AttnShape, cache: KVCache) -> None:
    """:func:`check_cu_seqlens_values` for a call with a key cache: the keys' offsets only where the keys are
    packed sequences (``cu_seqlens_k``); a paged or padded cache has none."""
    if cache.batched or cache.page_size:
        shape = dataclasses.replace(shape, total_k=shape.total_q, seqlen_k=shape.seqlen_q)
        cu_seqlens_k = cu_seqlens_q
    check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, shape)


CACHE_OP = "flash_attention with block_table / seqused_k"  # a forward-only op (flashbridge._forward_only)


# ------------------------------------------------------------------------------------------------- plans

def _pad(d: int) -> int:
    return max(16, next_power_of_2(d))


def _dim_key(shape: AttnShape) -> Optional[int]:
    """The key of the per-head-dim switch tables below: the padded head dim (the larger of Dqk, Dv) rounded
    up to 64, 128 or 256; None for float32 inputs (none of the switches was timed for them)."""
    if shape.dtype == "float32":
        return None
    d = max(_pad(shape.head_dim_qk), _pad(shape.head_dim_v))
    return 64 if d <= 64 else 128 if d <= 128 else 256


def _tile(kernel: str, shape: AttnShape, options: AttnOptions, target: Target, config: AttentionConfig, *,
          sparse: bool = False, split: int = 1):
    """(block_m, block_n, num_warps, num_stages) of ``kernel`` ("fwd", "dkdv" or "dq"): the config's fields,
    the rest from the tuning cache for the call's bucket (``tiles.cache.attention_class``: head dim, dtype,
    masking, MHA / GQA, the dK/dV column split; then the sequence length's bucket) on the target's GPU; the
    interpreter takes :data:`INTERPRETER_TILE`."""
    if target.interpret:
        return config.tile(kernel, INTERPRETER_TILE)

    def cached():
        from ...tiles import cache
        from ...tiles.model import AttnCase, Tile

        cls = cache.attention_class(max(shape.head_dim_qk, shape.head_dim_v), shape.dtype,
                                    cache.attention_kind(options, sparse), shape.group > 1, split)
        length = f"s{cache.length_bucket(max(shape.seqlen_q, shape.seqlen_k))}"
        tile = cache.plan_tile(f"attention_{kernel}", target, cls, length, lambda: AttnCase(shape, options),
                               Tile(*FALLBACK_TILE))
        return (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)

    return config.tile(kernel, cached)


def _head_group(config: AttentionConfig, options: AttnOptions, target: Target) -> int:
    """The main kernels' ``HEAD_GROUP`` constexpr (program order, see ``block_schedule``): 4 for causal
    attention on a GPU (H200, Triton 3.6, bench_attention.py --order-only: 8 and 16 within a few percent, 64
    slower), else 1: without the causal mask every block is as long as the next and grouping only spreads a
    head's K / V over more of L2. The interpreter keeps grid order."""
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
    """``per_dim``'s value for ``kernel`` ("fwd", "fwd_masked", ...; keyed by :func:`_dim_key`), or None:
    in the interpreter, for float32 inputs and where the table has none."""
    if target.interpret:
        return None
    key = _dim_key(shape)
    return per_dim.get(key, {}).get(kernel) if key is not None else None


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
    """Refuse a sequence (or cache) longer than MAX_SEQLEN tokens; ``what`` names the argument, with ``{}``
    where the value goes (formatted only on failure: under torch.compile the length may be symbolic)."""
    if length > MAX_SEQLEN:
        raise ValueError(f"{what.format(length)} is above {MAX_SEQLEN}: the kernels compare positions within a "
                         "sequence in int32, with an unbounded window side standing for 2**30")


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
    2 = any other window, and causal ones unless ``one_comparison``. The attention kernels take the one
    comparison (the smaller kernel on sm_90 at every head dim); decode keeps the general mask for its ragged
    tails."""
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


# The backward kernels' TAIL_BLOCKS bits (see _tail_blocks; kernels_bwd reads them from here)
TAIL_EDGE = 1
TAIL_RAGGED = 2


def _tail_blocks(shape: AttnShape, edge: bool, loop_len: int, block: int) -> int:
    """A backward kernel's ``TAIL_BLOCKS``: which masked blocks can follow its loop's fully visible ones.
    TAIL_EDGE: a window edge or causal diagonal there (``edge``: for dK/dV, which walks queries, a bounded
    left window side; for dQ, which walks keys, a bounded right side, causal included); TAIL_RAGGED: a block
    reaching past the sequence -- per-sequence lengths, or a loop axis of ``loop_len`` (queries for dK/dV,
    keys for dQ) that ``block`` does not divide -- whose loads alone need bounds checks. An empty segment
    still costs its pipelined loop's prologue and drain, and a runtime branch around it made ptxas serialize
    the causal kernels' wgmmas, so the plan decides at compile time. (The forward keeps all three segments:
    the same change there was slower on the H200.)"""
    return (TAIL_EDGE if edge else 0) | (TAIL_RAGGED if shape.varlen or loop_len % block else 0)


def _interleave_backward(config: AttentionConfig, options: AttnOptions,
                         sparse: Optional[bsp.SparseLayout]) -> bool:
    """The one-launch backward's ``INTERLEAVE`` constexpr: the config's, else on where every program is about
    as long as the next -- the dense kernels' iteration under a window with a bounded left side (bands
    included) -- and off elsewhere, where the longest programs (causal, block-sparse lists) start first.
    H200, B=1 H=16 D=128 S=16384, alternated in one process: window 1024 / 4096 backward 3% / 5% faster;
    causal within +-1% (also at S=4096; GQA causal once 6% slower), streaming and document lists 1-1.5%
    slower."""
    if config.interleave_backward is not None:
        return config.interleave_backward
    return sparse is None and options.window_left is not None


def _sparse_options(options: AttnOptions, sparse: Optional[bsp.SparseLayout]):
    """A block-sparse call's (options, layout): the mask's band is the window the kernels' element test uses
    (and a causal band orders programs longest first, as causal attention does); a mask that is exactly its
    band runs the dense kernels' window iteration instead of its lists (``block_sparse.plan.route_band``)."""
    options, sparse = bsp.route_band(options, sparse)
    if sparse is None:
        return options, None
    return dataclasses.replace(options, causal=sparse.causal, window_left=sparse.window_left,
                               window_right=sparse.window_right), sparse


def plan_attention_fwd(shape: AttnShape, options: AttnOptions, *, target: Target,
                       strides: Optional[dict[str, tuple[int, int, int]]] = None,
                       config: Optional[AttentionConfig] = None, sparse: Optional[bsp.SparseLayout] = None,
                       cache: Optional[KVCache] = None) -> Plan:
    """Plan inputs: q, k, v, [alibi_slopes], [sinks], [cu_seqlens_q, cu_seqlens_k], then with ``sparse`` (a
    BlockMask's layout, ``core_kernels/block_sparse/plan.py``) its arrays by their BlockMask names, then with
    ``cache`` (keys from a cache, :func:`check_kv_cache_args`) [block_table] and seqused_k.

    ``strides`` maps "q" / "k" / "v" to (batch, row, head) element strides (default: contiguous).
    Results: out (q's dtype, ``shape.out_shape``) and lse (float32, ``shape.lse_shape``).
    """
    config = config or active_config(AttentionConfig)
    if cache is not None and sparse is not None:
        raise ValueError("block_mask: not with block_table / seqused_k (a key cache)")
    options, sparse = _sparse_options(options, sparse)
    strides = strides or {}
    k_shape, v_shape = (shape.k_shape(), shape.v_shape()) if cache is None else (cache.k_shape, cache.v_shape)
    st = {n: strides.get(n) or contiguous_strides(s)
          for n, s in (("q", shape.q_shape()), ("k", k_shape), ("v", v_shape))}
    own_cu_k = cache is None or not (cache.batched or cache.page_size)  # else the queries' offsets stand in
    present = {"q": True, "k": True, "v": True, "alibi_slopes": options.has_alibi,
               "sinks": options.has_sinks, "cu_seqlens_q": shape.varlen, "cu_seqlens_k": shape.varlen and own_cu_k,
               **bsp.present_arrays(sparse, bsp.FWD_ARRAYS), "seed": options.dropout_p > 0,
               "block_table": bool(cache and cache.page_size), "seqused_k": cache is not None}
    placeholder = {"cu_seqlens_k": "cu_seqlens_q" if shape.varlen else "q"}
    fwd_entry = "fwd_masked" if options.causal or options.has_local or sparse else "fwd"
    bm, bn, warps, stages = _tile("fwd", shape, options, target, config, sparse=sparse is not None)
    masked_bn = _masked_block_n(fwd_entry, shape, target, config, bn)
    if sparse is not None:  # tiles that divide the mask's blocks
        bm, bn = bsp.sparse_tile(bm, sparse.q_block), bsp.sparse_tile(bn, sparse.kv_block)
        masked_bn = min(masked_bn, bn)
    q_programs = cdiv(shape.seqlen_q, bm) if sparse is None else bsp.sparse_blocks(shape.seqlen_q, sparse.q_block, bm)
    lse_b, lse_h = _lse_strides(shape)
    scalars = (*_common_scalars(shape, options), *_strided("q", st["q"]), *_strided("k", st["k"]),
               *_strided("v", st["v"]), *_strided("o", contiguous_strides(shape.out_shape)),
               ("stride_lb", lse_b), ("stride_lh", lse_h), ("stride_ab", _alibi_stride(shape, options)),
               *bsp.mask_scalars(sparse, backward=False), ("dropout_p", float(options.dropout_p)))
    table = cache.table_shape if cache is not None else (1, 1)
    cache_scalars = (("table_stride", table[1]), ("num_pages", k_shape[0] if cache and cache.page_size else 1))
    launch = Launch(
        kernel=f"{_FWD}:attn_fwd_kernel",
        # packed sequences: one query block more, whose programs fill the rows no sequence covers (bad offsets)
        grid=(q_programs + shape.varlen, shape.heads_q, shape.batch),
        inputs=tuple(n if present[n] else placeholder.get(n, "q")
                     for n in ("q", "k", "v", "alibi_slopes", "sinks", "cu_seqlens_q", "cu_seqlens_k",
                               *bsp.FWD_ARRAYS, "seed", "block_table", "seqused_k")),
        scalars=(*scalars, *cache_scalars),
        outputs=("out", "lse"),
        constexprs=(("GROUP", shape.group), ("DQK", shape.head_dim_qk), ("DV", shape.head_dim_v),
                    ("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_DQK", _pad(shape.head_dim_qk)),
                    ("BLOCK_DV", _pad(shape.head_dim_v)), ("HAS_SINKS", options.has_sinks),
                    *_flags(shape, options), *_align(scalars),
                    ("MASKED_STAGES", _masked_stages(fwd_entry, shape, target, config)),
                    ("POSITIVE_SCALE", options.softmax_scale > 0),
                    ("HEAD_GROUP", _head_group(config, options, target) if sparse is None
                     else bsp.head_group(config.head_group, sparse, target.interpret, query_major=True)),
                    ("MASKED_BLOCK_N", masked_bn), *bsp.mask_constexprs(sparse, backward=False),
                    ("HAS_DROPOUT", options.dropout_p > 0), ("KV_BATCHED", bool(cache and cache.batched)),
                    ("PAGE_SIZE", cache.page_size if cache else 0), ("HAS_SEQUSED", cache is not None)),
        num_warps=warps,
        num_stages=stages,
    )
    buffers = (Spec("out", shape.out_shape, shape.dtype), Spec("lse", shape.lse_shape, "float32"))
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=buffers,
                launches=(launch,), results=("out", "lse"))


def plan_attention_bwd(shape: AttnShape, options: AttnOptions, *, target: Target, has_dlse: bool = False,
                       sinks_dtype: Optional[str] = None, alibi_grad: Optional[str] = None,
                       strides: Optional[dict[str, tuple[int, int, int]]] = None,
                       config: Optional[AttentionConfig] = None, sparse: Optional[bsp.SparseLayout] = None) -> Plan:
    """Plan inputs: dout, q, k, v, out, lse, [dlse], [alibi_slopes], [sinks], [cu_seqlens_q, cu_seqlens_k],
    then with ``sparse`` (a BlockMask's layout) its arrays by their BlockMask names.

    ``out`` and ``lse`` are the forward's results (contiguous); ``dlse`` a gradient arriving at lse.
    ``strides`` maps "q" / "k" / "v" / "dout" to (batch, row, head) element strides (default: contiguous).
    Results: dq, dk, dv (contiguous, in the inputs' dtype), then with sinks dsinks (``sinks_dtype``,
    ``(Hq,)``) and dsinks_part (float32 ``(batch, Hq)``, the per-sequence terms of dsinks, for vmap rules),
    then with ``alibi_grad`` (the slopes' dtype: their gradient is wanted) dalibi (the slopes' shape) and
    dalibi_part (float32 ``(batch, Hq)``, per sequence). Without it the dQ kernel compiles no slope term.
    """
    if alibi_grad is not None and not options.has_alibi:
        raise ValueError("alibi_grad: the call has no alibi_slopes")
    config = config or active_config(AttentionConfig)
    options, sparse = _sparse_options(options, sparse)
    strides = strides or {}
    st = {n: strides.get(n) or contiguous_strides(s)
          for n, s in (("q", shape.q_shape()), ("k", shape.k_shape()), ("v", shape.v_shape()),
                       ("dout", shape.out_shape))}
    present = {"dout": True, "q": True, "k": True, "v": True, "out": True, "lse": True, "dlse": has_dlse,
               "alibi_slopes": options.has_alibi, "sinks": options.has_sinks,
               "cu_seqlens_q": shape.varlen, "cu_seqlens_k": shape.varlen,
               **bsp.present_arrays(sparse, bsp.BWD_ARRAYS), "seed": options.dropout_p > 0}

    def name(n):
        return n if present[n] else "q"  # placeholder pointer for an absent input

    col_split = _dkdv_col_split(config, shape, options, target)
    kv_m, kv_n, kv_warps, kv_stages = _tile("dkdv", shape, options, target, config, sparse=sparse is not None,
                                            split=col_split)
    q_m, q_n, q_warps, q_stages = _tile("dq", shape, options, target, config, sparse=sparse is not None)
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
    kv_tail = _tail_blocks(shape, options.window_left is not None, shape.seqlen_q, kv_m)  # dK/dV walks queries
    q_tail = _tail_blocks(shape, options.window_right is not None, shape.seqlen_k, q_n)  # dQ walks keys
    main_scalars = (*_common_scalars(shape, options), *_strided("q", st["q"]), *_strided("k", st["k"]),
                    *_strided("v", st["v"]), *_strided("do", st["dout"]), *lse_scalars,
                    ("stride_ab", _alibi_stride(shape, options)), *bsp.mask_scalars(sparse, backward=True),
                    ("dropout_p", float(options.dropout_p)))
    dims = (("GROUP", shape.group), ("DQK", shape.head_dim_qk), ("DV", shape.head_dim_v))
    main_inputs = ("q", "k", "v", "dout", "lse2", "delta", name("alibi_slopes"), name("cu_seqlens_q"),
                   name("cu_seqlens_k"), *bsp.mask_inputs(sparse, bsp.BWD_ARRAYS), name("seed"))
    mask_flags = bsp.mask_constexprs(sparse, backward=True, group=shape.group)
    alibi_flag = ("ALIBI_GRAD", alibi_grad is not None)
    drop_flag = ("HAS_DROPOUT", options.dropout_p > 0)

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
    # packed sequences: one key / query block more, whose programs fill the rows no sequence covers (bad offsets)
    kv_programs, q_programs = kv_programs + shape.varlen, q_programs + shape.varlen
    kv_grid = (kv_programs * col_split, shape.heads_kv, shape.batch)
    q_grid = (q_programs, shape.heads_q, shape.batch)
    # one launch needs one warp count: with different ones (D=256's unsplit tiles: 4 and 8) the dQ path
    # would run at the dK/dV count and spill; and it runs one dK/dV program per key block (no column split)
    if config.fused_backward is not False and kv_warps == q_warps and col_split == 1:  # None = fused
        fused_scalars = (*dkdv_scalars, *_strided("dq", contiguous_strides(shape.q_shape())),
                         ("heads_kv", shape.heads_kv), ("n_seqs", shape.batch))
        main = [Launch(
            kernel=f"{_BWD}:attn_bwd_kernel",
            grid=(math.prod(kv_grid) + math.prod(q_grid),),
            inputs=main_inputs,
            scalars=fused_scalars,
            outputs=("dk", "dv", "dq", "dalibi_blocks"),
            constexprs=(*dims, ("KV_BLOCK_M", kv_m), ("KV_BLOCK_N", kv_n), ("Q_BLOCK_M", q_m), ("Q_BLOCK_N", q_n),
                        ("BLOCK_DQK", bdqk), ("BLOCK_DV", bdv), *flags, early_dp, *_align(fused_scalars),
                        ("HEAD_GROUP", head_group), ("KV_TAIL_BLOCKS", kv_tail), ("Q_TAIL_BLOCKS", q_tail),
                        *mask_flags, alibi_flag, drop_flag,
                        ("INTERLEAVE", _interleave_backward(config, options, sparse))),
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
                            ("COL_SPLIT", col_split), ("TAIL_BLOCKS", kv_tail), *mask_flags, drop_flag),
                num_warps=kv_warps, num_stages=kv_stages),
            Launch(
                kernel=f"{_BWD}:attn_bwd_dq_kernel",
                grid=q_grid,
                inputs=main_inputs,
                scalars=dq_scalars,
                outputs=("dq", "dalibi_blocks"),
                constexprs=(*dims, ("BLOCK_M", q_m), ("BLOCK_N", q_n), ("BLOCK_DQK", bdqk), ("BLOCK_DV", bdv),
                            *flags, *_align(dq_scalars), ("HEAD_GROUP", head_group), ("TAIL_BLOCKS", q_tail),
                            *mask_flags, alibi_flag, drop_flag),
                num_warps=q_warps, num_stages=q_stages),
        ]
    launches = [preprocess, *main]
    buffers = [Spec("delta", shape.lse_shape, "float32"), Spec("lse2", shape.lse_shape, "float32"),
               Spec("dq", shape.q_shape(), shape.dtype), Spec("dk", shape.k_shape(), shape.dtype),
               Spec("dv", shape.v_shape(), shape.dtype),
               # one term per dQ program (a one-element placeholder that nothing writes without alibi_grad)
               Spec("dalibi_blocks", (shape.batch, shape.heads_q, q_programs) if alibi_grad else (1,), "float32")]
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
    if alibi_grad is not None:
        slopes_shape = (shape.batch, shape.heads_q) if options.alibi_batched else (shape.heads_q,)
        buffers += [Spec("dalibi_part", (shape.batch, shape.heads_q), "float32"),
                    Spec("dalibi", slopes_shape, alibi_grad)]
        launches.append(Launch(
            kernel=f"{_BWD}:attn_bwd_alibi_kernel",
            grid=(shape.heads_q,),
            inputs=("dalibi_blocks",),
            scalars=(("n_seqs", shape.batch), ("n_blocks", q_programs)),
            outputs=("dalibi_part", "dalibi"),
            constexprs=(("HQ", shape.heads_q), ("BLOCK", min(1024, max(16, next_power_of_2(q_programs)))),
                        ("BATCHED", options.alibi_batched)),
            num_warps=4, num_stages=1))
        results += ["dalibi", "dalibi_part"]
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=tuple(buffers),
                launches=tuple(launches), results=tuple(results))
