"""Launch plans and argument checks for the Flash-Decoding family (pure Python: shapes and options in, a
Plan out). Both front-ends validate through the ``check_*`` functions here, so they raise the same
``ValueError`` / ``TypeError`` naming the argument.

Layouts (``kv_layout``): q ``(B, Sq, Hq, Dqk)``; a contiguous cache ``(B, S_max, Hkv, D)`` ("NHD") or
``(B, Hkv, S_max, D)`` ("HND"); a paged cache ``(num_pages, page_size, Hkv, D)`` / ``(num_pages, Hkv,
page_size, D)`` with an int32 ``block_table`` ``(B, max_pages)``; ``cache_seqlens`` int32 ``(B,)``. Out
``(B, Sq, Hq, Dv)`` in q's dtype, lse float32 ``(B, Hq, Sq)`` (natural log). The kernels address a cache
through (page, slot, head) element strides, so a front-end may pass strided views of a cache as long as the
head dim is contiguous (no copy of a large cache is ever made on a GPU).

Plans:

* :func:`plan_decode`: one launch when ``num_splits == 1`` (the kernel writes out/lse), else the split
  kernel writes float32 partials ``(num_splits, B, Sq, Hq, Dv)`` / ``(num_splits, B, Sq, Hq)`` and the
  merge kernel combines them (sinks join there, once).
* :func:`plan_merge`: ``merge_attention_states``.
* :func:`plan_cascade`: the shared prefix for all ``B * Sq`` query tokens at once (its K/V read once per
  row block, not once per request), each request's own cache, then one merge.
* :func:`plan_append`: one launch; its outputs ``k_out`` / ``v_out`` are the caches themselves, so the
  front-ends execute it with the outputs bound to the cache buffers (torch: the same tensors; JAX:
  ``input_output_aliases``), never through a runtime that allocates them.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .._config import active_config
from .._plan import (FLOAT_DTYPES, Launch, Plan, Spec, Target, cdiv, check_float_dtype, fmt_shape,
                     next_power_of_2, pow2_divisor)
from ..flash_attn.plan import check_score_options, check_seqlen_bound, local_mask_mode, window_scalars

_K = "decode.kernels"
KV_LAYOUTS = ("NHD", "HND")
FP8_DTYPE = "float8_e4m3fn"
MAX_HEAD_DIM_QK = 1024  # above 256 the q.k dot runs in 64-wide column chunks (MLA: 576 = 9 x 64)
MAX_HEAD_DIM_V = 512
MAX_PAGE_SIZE = 1024
MAX_SPLITS = 1024
_CHUNK_DQK = 64
MERGE_STATES_PER_STEP = 16  # states the merge kernel folds per dependent round (DecodeConfig.merge_block_states)
MAX_AUTO_SPLITS = 64  # the most splits choose_num_splits picks
# keys per split (at one program per SM) from which contiguous FP8 caches take 256-key tiles (see decode_tiles)
FP8_WIDE_SPLIT_KEYS = 8192

TensorInfo = tuple[tuple[int, ...], str]  # (shape, dtype name)


# ------------------------------------------------------------------------------------------------ config

@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tile and launch settings of the decode family; ``None`` picks the target's default.

    * ``block_n``, ``num_warps``, ``num_stages``: the decode kernel's keys per step, warps and pipeline
      depth (defaults: the tuning cache's, see :func:`decode_tiles`). Setting ``block_n`` or ``num_stages``
      also drops the default tile's own split rule (``DecodeTile.programs_per_sm``).
    * ``block_m``: the most packed (query token x GQA head) rows per program; more rows mean more row
      blocks, each reading the cache again.
    * ``merge_block_elements``: flattened (row, d) outputs per program of the merge kernel, which folds
      ``merge_block_states`` states per dependent round.
    """

    block_n: Optional[int] = None
    block_m: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    merge_block_elements: Optional[int] = None
    merge_block_states: Optional[int] = None

    def __post_init__(self):
        for name in ("block_n", "block_m", "merge_block_elements", "merge_block_states"):
            value = getattr(self, name)
            minimum = 1 if name.startswith("merge") else 16
            if value is not None and (value < minimum or value & (value - 1)):
                raise ValueError(f"DecodeConfig.{name}: must be a power of two >= {minimum}, got {value}")

# ------------------------------------------------------------------------------------------------ shapes

@dataclasses.dataclass(frozen=True)
class CacheShape:
    """A KV cache as pages: a contiguous cache is one page of ``S_max`` rows per sequence."""

    layout: str  # "NHD" or "HND"
    paged: bool
    num_pages: int  # contiguous: the batch size
    page_size: int  # contiguous: S_max
    max_pages: int  # block-table width (contiguous: 1)
    heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str

    @property
    def capacity(self) -> int:
        """The most tokens one sequence can hold."""
        return self.max_pages * self.page_size

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    def array_shape(self, dim: int) -> tuple[int, int, int, int]:
        if self.layout == "NHD":
            return (self.num_pages, self.page_size, self.heads, dim)
        return (self.num_pages, self.heads, self.page_size, dim)

    def strides(self, dim: int) -> tuple[int, int, int]:
        """(page, slot, head) element strides of a contiguous cache array."""
        if self.layout == "NHD":
            return (self.page_size * self.heads * dim, self.heads * dim, dim)
        return (self.heads * self.page_size * dim, dim, self.page_size * dim)


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    batch: int
    seqlen_q: int
    heads_q: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str  # q's (and the output's)
    cache: CacheShape

    @property
    def heads_kv(self) -> int:
        return self.cache.heads

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.seqlen_q, self.heads_q, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.batch, self.heads_q, self.seqlen_q)


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Normalised scalar options (see :func:`check_decode_args`)."""

    softmax_scale: float
    causal: bool
    window_left: Optional[int]  # query i sees keys j with -left <= j - (i + L - Sq) <= right; None = unbounded
    window_right: Optional[int]
    softcap: float
    has_alibi: bool
    alibi_batched: bool  # slopes (B, Hq) rather than (Hq,)
    has_sinks: bool
    scale_mode: str  # "none", "tensor" (one scale) or "head" (one per kv head)
    has_leftpad: bool = False  # cache_leftpad: sequence b's keys are rows [cache_leftpad[b], cache_seqlens[b])
    rotary_half: int = 0  # rotary_dim / 2 of the queries' RoPE (0: none)
    rotary_interleaved: bool = False
    rotary_rows: int = 0  # rows of the cos / sin tables

    @property
    def has_local(self) -> bool:
        return self.window_left is not None or self.window_right is not None


# ------------------------------------------------------------------------------------------------ checks

def _check_int32(name: str, info: TensorInfo) -> None:
    if info[1] != "int32":
        raise TypeError(f"{name}: must be int32, got {info[1]}")


def check_kv_layout(kv_layout) -> str:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' (tokens, heads, dim) or 'HND' (heads, tokens, dim), "
                         f"got {kv_layout!r}")
    return kv_layout


def check_cache(*, k_cache: TensorInfo, v_cache: TensorInfo, block_table: Optional[TensorInfo], batch: int,
                kv_layout: str, allowed_dtypes: tuple[str, ...], names=("k_cache", "v_cache")) -> CacheShape:
    """Shape and dtype of a (k, v) cache pair -> CacheShape; ``batch`` is the number of sequences."""
    kn, vn = names
    check_kv_layout(kv_layout)
    for name, info in ((kn, k_cache), (vn, v_cache)):
        if info[1] not in allowed_dtypes:
            raise TypeError(f"{name}: dtype {info[1]} is not supported here; expected one of "
                            f"{', '.join(allowed_dtypes)}")
    if k_cache[1] != v_cache[1]:
        raise TypeError(f"{kn}, {vn}: must share one dtype, got {k_cache[1]} and {v_cache[1]}")
    paged = block_table is not None
    what = "(num_pages, page_size, Hkv, D)" if paged else "(batch, S_max, Hkv, D)"
    if kv_layout == "HND":
        what = "(num_pages, Hkv, page_size, D)" if paged else "(batch, Hkv, S_max, D)"
    for name, info in ((kn, k_cache), (vn, v_cache)):
        if len(info[0]) != 4:
            raise ValueError(f"{name}: expected 4 dimensions {what} for kv_layout={kv_layout!r}"
                             f"{' with a block_table' if paged else ''}, got shape {fmt_shape(info[0])}")
        if any(d < 1 for d in info[0]):
            raise ValueError(f"{name}: empty cache of shape {fmt_shape(info[0])}; every dimension must be >= 1")
    ks, vs = tuple(k_cache[0]), tuple(v_cache[0])
    if ks[:-1] != vs[:-1]:
        raise ValueError(f"{kn}, {vn}: must agree in every dimension but the last, got {fmt_shape(ks)} and {fmt_shape(vs)}")
    if kv_layout == "NHD":
        n0, rows, heads = ks[0], ks[1], ks[2]
    else:
        n0, heads, rows = ks[0], ks[1], ks[2]
    if ks[-1] > MAX_HEAD_DIM_QK:
        raise ValueError(f"{kn}: head dim {ks[-1]} is not supported; the kernels handle 1..{MAX_HEAD_DIM_QK}")
    if vs[-1] > MAX_HEAD_DIM_V:
        raise ValueError(f"{vn}: head dim {vs[-1]} is not supported; the kernels handle 1..{MAX_HEAD_DIM_V}")
    if paged:
        _check_int32("block_table", block_table)
        if len(block_table[0]) != 2 or block_table[0][0] != batch or block_table[0][1] < 1:
            raise ValueError(f"block_table: expected shape ({batch}, max_pages) with max_pages >= 1 (one row per "
                             f"sequence), got {fmt_shape(block_table[0])}")
        if rows & (rows - 1) or rows > MAX_PAGE_SIZE:
            raise ValueError(f"{kn}: page size {rows} (from shape {fmt_shape(ks)}) is not supported; page sizes are "
                             f"powers of two from 1 to {MAX_PAGE_SIZE}")
        cache = CacheShape(kv_layout, True, n0, rows, int(block_table[0][1]), heads, ks[-1], vs[-1], k_cache[1])
    else:
        if n0 != batch:
            raise ValueError(f"{kn}: a contiguous cache needs one entry per sequence: batch {n0} in {fmt_shape(ks)}, "
                             f"but {batch} sequences (pass block_table for a paged cache)")
        cache = CacheShape(kv_layout, False, n0, rows, 1, heads, ks[-1], vs[-1], k_cache[1])
    what = "block_table: max_pages x page_size" if paged else f"{kn}: S_max"
    check_seqlen_bound(f"{what} = {{}}", cache.capacity)
    return cache


def check_scales(k_scale: Optional[TensorInfo], v_scale: Optional[TensorInfo], cache: CacheShape) -> str:
    """FP8 dequantisation scales: float32, one per tensor (shape () or (1,)) or one per kv head (Hkv,)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale, v_scale: give both (FP8 dequantisation scales) or neither")
    if k_scale is None:
        return "none"
    if not cache.fp8:
        raise ValueError(f"k_scale, v_scale: only meaningful for a float8_e4m3fn cache; the cache is {cache.dtype}")
    modes = set()
    for name, info in (("k_scale", k_scale), ("v_scale", v_scale)):
        if info[1] != "float32":
            raise TypeError(f"{name}: must be float32, got {info[1]}")
        shape = tuple(info[0])
        if shape in ((), (1,)):
            modes.add("tensor")
        elif shape == (cache.heads,):
            modes.add("head")
        else:
            raise ValueError(f"{name}: expected shape () or (1,) (per tensor) or ({cache.heads},) (per kv head), "
                             f"got {fmt_shape(shape)}")
    if len(modes) != 1:
        raise ValueError(f"k_scale, v_scale: must both be per tensor or both per kv head, got shapes "
                         f"{fmt_shape(k_scale[0])} and {fmt_shape(v_scale[0])}")
    return modes.pop()


def check_scale_values(**scales) -> None:
    """Host values of FP8 dequantisation scales (name -> flat list of floats, or None when not on the host):
    each must be finite and > 0. The cache holds ``value / scale``, so a zero, negative or non-finite scale
    has no meaning; the kernels would give NaN or finite garbage without an error."""
    for name, values in scales.items():
        for i, s in enumerate(values or ()):
            if not 0.0 < float(s) < float("inf"):
                where = f" (entry {i})" if len(values) > 1 else ""
                raise ValueError(f"{name}: FP8 scales must be finite and > 0, got {float(s)}{where}")


def _check_seqlens(cache_seqlens: TensorInfo, batch: int) -> None:
    if cache_seqlens is None:
        raise ValueError(f"cache_seqlens: required, an int32 ({batch},) tensor of per-sequence cache lengths")
    _check_int32("cache_seqlens", cache_seqlens)
    if tuple(cache_seqlens[0]) != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},) (one length per sequence), got "
                         f"{fmt_shape(cache_seqlens[0])}")


def check_leftpad(cache_leftpad: Optional[TensorInfo], block_table: Optional[TensorInfo], batch: int) -> bool:
    """``cache_leftpad``: int32 ``(B,)``, contiguous caches only (flash-attn refuses it with a block table
    too: a paged cache has no padding to skip)."""
    if cache_leftpad is None:
        return False
    _check_int32("cache_leftpad", cache_leftpad)
    if tuple(cache_leftpad[0]) != (batch,):
        raise ValueError(f"cache_leftpad: expected shape ({batch},) (one offset per sequence), got "
                         f"{fmt_shape(cache_leftpad[0])}")
    if block_table is not None:
        raise ValueError("cache_leftpad: not supported with a paged cache (block_table); left padding is for "
                         "contiguous caches (as in flash-attn)")
    return True


def check_leftpad_values(cache_leftpad, cache_seqlens) -> None:
    """Host values: ``0 <= cache_leftpad[b] <= cache_seqlens[b]``."""
    for b, (pad, length) in enumerate(zip(cache_leftpad, cache_seqlens)):
        if not 0 <= int(pad) <= int(length):
            raise ValueError(f"cache_leftpad: sequence {b} starts at row {int(pad)}, outside [0, cache_seqlens[b] "
                             f"= {int(length)}]")


def check_rotary(rotary_cos: Optional[TensorInfo], rotary_sin: Optional[TensorInfo], rotary_interleaved,
                 head_dim: int, what: str = "q") -> tuple[int, int]:
    """RoPE tables of the KV-cache step, as the rotary family takes them: ``rotary_cos`` / ``rotary_sin``
    ``(S_rot, rotary_dim / 2)`` in a float dtype, ``rotary_dim <= head_dim`` (the dims past it pass
    through). Returns ``(rotary_dim / 2, S_rot)``, ``(0, 0)`` without tables."""
    if not isinstance(rotary_interleaved, bool):
        raise TypeError(f"rotary_interleaved: expected a bool, got {type(rotary_interleaved).__name__}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos, rotary_sin: give both (RoPE tables) or neither")
    if rotary_cos is None:
        return 0, 0
    for name, info in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        check_float_dtype(name, info[1])
        if len(info[0]) != 2 or any(d < 1 for d in info[0]):
            raise ValueError(f"{name}: expected 2 non-empty dimensions (S_rot, rotary_dim / 2), got "
                             f"{fmt_shape(info[0])}")
    if tuple(rotary_cos[0]) != tuple(rotary_sin[0]):
        raise ValueError(f"rotary_cos, rotary_sin: must have one shape, got {fmt_shape(rotary_cos[0])} and "
                         f"{fmt_shape(rotary_sin[0])}")
    rows, half = rotary_cos[0]
    if 2 * half > head_dim:
        raise ValueError(f"rotary_cos: rotary_dim = 2 * {half} exceeds the head dim of {what} ({head_dim})")
    if head_dim > 256:
        raise ValueError(f"rotary_cos: RoPE inside the KV-cache step supports head dims up to 256, got {head_dim}")
    return half, rows


def check_num_splits(num_splits) -> Optional[int]:
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits: expected a Python int or None (automatic), got {type(num_splits).__name__}")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits: must be between 1 and {MAX_SPLITS}, got {num_splits}")
    return num_splits


def _check_q(q: TensorInfo) -> tuple[int, ...]:
    check_float_dtype("q", q[1])
    if len(q[0]) != 4:
        raise ValueError(f"q: expected 4 dimensions (batch, seqlen_q, heads, head_dim), got shape {fmt_shape(q[0])}")
    if any(d < 1 for d in q[0]):
        raise ValueError(f"q: empty tensor of shape {fmt_shape(q[0])}; every dimension must be >= 1")
    return tuple(q[0])


def _check_heads(qs, cache: CacheShape, kname="k_cache"):
    if qs[-1] != cache.head_dim_k:
        raise ValueError(f"q, {kname}: head dims differ: q {fmt_shape(qs)} (Dqk={qs[-1]}), {kname} Dqk={cache.head_dim_k}")
    if qs[2] % cache.heads:
        raise ValueError(f"q, {kname}: the number of query heads ({qs[2]}) must be a multiple of the number of "
                         f"key/value heads ({cache.heads}) for grouped-query attention")


def _check_sinks(sinks, hq):
    if sinks is not None:
        check_float_dtype("sinks", sinks[1])
        if tuple(sinks[0]) != (hq,):
            raise ValueError(f"sinks: expected shape ({hq},) (one logit per query head), got {fmt_shape(sinks[0])}")


def check_decode_args(
    *, q: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo, cache_seqlens: Optional[TensorInfo],
    block_table: Optional[TensorInfo] = None, kv_layout: str = "NHD", alibi_slopes: Optional[TensorInfo] = None,
    sinks: Optional[TensorInfo] = None, k_scale: Optional[TensorInfo] = None, v_scale: Optional[TensorInfo] = None,
    softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, num_splits=None,
    cache_leftpad: Optional[TensorInfo] = None, rotary_cos: Optional[TensorInfo] = None,
    rotary_sin: Optional[TensorInfo] = None, rotary_interleaved=False,
) -> tuple[DecodeShape, DecodeOptions, Optional[int]]:
    """Validate a decode_attention call from (shape, dtype-name) pairs, before any launch. Returns the shape,
    the options and ``num_splits`` (None = automatic, see :func:`choose_num_splits`). Values inside
    ``cache_seqlens`` / ``block_table`` are checked by :func:`check_cache_values` when they are on the host."""
    qs = _check_q(q)
    batch, sq, hq, dqk = qs
    cache = check_cache(k_cache=k_cache, v_cache=v_cache, block_table=block_table, batch=batch,
                        kv_layout=kv_layout, allowed_dtypes=(q[1], FP8_DTYPE))
    _check_heads(qs, cache)
    _check_seqlens(cache_seqlens, batch)
    scale_mode = check_scales(k_scale, v_scale, cache)
    scale, left, right, cap = check_score_options(head_dim_qk=dqk, causal=causal, softmax_scale=softmax_scale,
                                                    window_size=window_size, softcap=softcap)
    alibi_batched = False
    if alibi_slopes is not None:
        check_float_dtype("alibi_slopes", alibi_slopes[1])
        ashape = tuple(alibi_slopes[0])
        if ashape == (batch, hq):
            alibi_batched = True
        elif ashape != (hq,):
            raise ValueError(f"alibi_slopes: expected shape ({hq},) or ({batch}, {hq}) (heads, or batch x heads), "
                             f"got {fmt_shape(ashape)}")
    _check_sinks(sinks, hq)
    splits = check_num_splits(num_splits)
    has_leftpad = check_leftpad(cache_leftpad, block_table, batch)
    half, rot_rows = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, dqk)
    shape = DecodeShape(batch, sq, hq, dqk, cache.head_dim_v, q[1], cache)
    options = DecodeOptions(scale, causal, left, right, cap, alibi_slopes is not None, alibi_batched,
                            sinks is not None, scale_mode, has_leftpad, half, rotary_interleaved, rot_rows)
    return shape, options, splits


def check_cache_values(cache_seqlens, block_table, cache: CacheShape, *, new_tokens: int = 0) -> None:
    """Host values: every length in ``[0, capacity - new_tokens]`` and, for a paged cache, every block-table
    entry that a sequence uses (its first ``cdiv(length + new_tokens, page_size)`` pages) in ``[0, num_pages)``.
    Entries past a sequence's pages are never read and may hold anything (e.g. -1 padding)."""
    lengths = [int(x) for x in cache_seqlens]
    limit = cache.capacity - new_tokens
    for b, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"cache_seqlens: sequence {b} has a negative length ({length})")
        if length > limit:
            what = f"cache_seqlens + {new_tokens} new tokens" if new_tokens else "cache_seqlens"
            raise ValueError(f"{what}: sequence {b} needs {length + new_tokens} rows but the cache holds "
                             f"{cache.capacity} per sequence ({'max_pages x page_size' if cache.paged else 'S_max'})")
    if cache.paged:
        for b, (length, row) in enumerate(zip(lengths, block_table)):
            used = cdiv(length + new_tokens, cache.page_size)
            for j, page in enumerate(list(row)[:used]):
                if not 0 <= int(page) < cache.num_pages:
                    raise ValueError(f"block_table: entry [{b}, {j}] = {int(page)} is not a page of the cache "
                                     f"(0..{cache.num_pages - 1}); sequence {b} uses its first {used} entries")


def check_merge_args(outs: TensorInfo, lses: TensorInfo) -> tuple[int, tuple[int, ...], int, str]:
    """(n_states, row shape ``...``, head dim, dtype) of ``merge_attention_states(outs, lses)``."""
    check_float_dtype("outs", outs[1])
    if lses[1] != "float32":
        raise TypeError(f"lses: must be float32 (log-sum-exp values), got {lses[1]}")
    os_, ls = tuple(outs[0]), tuple(lses[0])
    if len(os_) < 2:
        raise ValueError(f"outs: expected (N, ..., D) with at least 2 dimensions, got shape {fmt_shape(os_)}")
    if any(d < 1 for d in os_):
        raise ValueError(f"outs: empty tensor of shape {fmt_shape(os_)}; every dimension must be >= 1")
    if ls != os_[:-1]:
        raise ValueError(f"lses: expected shape {fmt_shape(os_[:-1])} (outs without its last dimension), got {fmt_shape(ls)}; "
                         "a decode lse (B, Hq, Sq) must be transposed to (B, Sq, Hq) to merge with (B, Sq, Hq, D)")
    if os_[-1] > MAX_HEAD_DIM_V:
        raise ValueError(f"outs: head dim {os_[-1]} is not supported; the kernels handle 1..{MAX_HEAD_DIM_V}")
    return os_[0], os_[1:-1], os_[-1], outs[1]


def check_cascade_args(
    *, q: TensorInfo, shared_k: TensorInfo, shared_v: TensorInfo, k_cache: TensorInfo, v_cache: TensorInfo,
    cache_seqlens: Optional[TensorInfo], block_table: Optional[TensorInfo] = None, kv_layout: str = "NHD",
    sinks: Optional[TensorInfo] = None, k_scale: Optional[TensorInfo] = None, v_scale: Optional[TensorInfo] = None,
    softmax_scale=None, causal=True, softcap=0.0, num_splits=None,
) -> tuple[DecodeShape, int, DecodeOptions, Optional[int]]:
    """Validate cascade_attention: the decode checks for (q, k_cache, v_cache), plus the shared prefix
    ``shared_k`` ``(S_shared, Hkv, Dqk)`` (NHD) / ``(Hkv, S_shared, Dqk)`` (HND), in the cache's dtype.
    Returns (shape, S_shared, options, num_splits)."""
    shape, options, splits = check_decode_args(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
        kv_layout=kv_layout, sinks=sinks, k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale,
        causal=causal, softcap=softcap, num_splits=num_splits)
    cache = shape.cache
    what = "(S_shared, Hkv, D)" if kv_layout == "NHD" else "(Hkv, S_shared, D)"
    for name, info, dim in (("shared_k", shared_k, cache.head_dim_k), ("shared_v", shared_v, cache.head_dim_v)):
        if info[1] != cache.dtype:
            raise TypeError(f"{name}: must have the cache's dtype ({cache.dtype}), got {info[1]}")
        s = tuple(info[0])
        if len(s) != 3 or any(d < 1 for d in s):
            raise ValueError(f"{name}: expected 3 non-empty dimensions {what} for kv_layout={kv_layout!r}, "
                             f"got {fmt_shape(s)}")
        heads = s[1] if kv_layout == "NHD" else s[0]
        if heads != cache.heads or s[-1] != dim:
            raise ValueError(f"{name}: expected {cache.heads} kv heads and head dim {dim} (like the cache), got "
                             f"{fmt_shape(s)}")
    ks, vs = tuple(shared_k[0]), tuple(shared_v[0])
    if ks[:-1] != vs[:-1]:
        raise ValueError(f"shared_k, shared_v: must agree in every dimension but the last, got {fmt_shape(ks)} and "
                         f"{fmt_shape(vs)}")
    shared_len = ks[0] if kv_layout == "NHD" else ks[1]
    return shape, shared_len, options, splits


@dataclasses.dataclass(frozen=True)
class AppendShape:
    batch: int
    new_tokens: int
    cache: CacheShape
    new_dtype: str
    scale_mode: str
    has_leftpad: bool = False
    rotary_half: int = 0  # rotary_dim / 2 of the new keys' RoPE (0: none)
    rotary_interleaved: bool = False
    rotary_rows: int = 0


def check_append_args(*, k_cache: TensorInfo, v_cache: TensorInfo, k_new: TensorInfo, v_new: TensorInfo,
                      cache_seqlens: Optional[TensorInfo], block_table: Optional[TensorInfo] = None,
                      kv_layout: str = "NHD", k_scale: Optional[TensorInfo] = None,
                      v_scale: Optional[TensorInfo] = None, cache_leftpad: Optional[TensorInfo] = None,
                      rotary_cos: Optional[TensorInfo] = None, rotary_sin: Optional[TensorInfo] = None,
                      rotary_interleaved=False) -> AppendShape:
    """Validate append_kv_cache: ``k_new`` ``(B, S_new, Hkv, Dqk)``, ``v_new`` ``(B, S_new, Hkv, Dv)`` in a
    float dtype (the cache's, or any float dtype for an FP8 cache, which quantises)."""
    for name, info in (("k_new", k_new), ("v_new", v_new)):
        check_float_dtype(name, info[1])
        if len(info[0]) != 4 or any(d < 1 for d in info[0]):
            raise ValueError(f"{name}: expected 4 non-empty dimensions (batch, new_tokens, Hkv, D), got "
                             f"{fmt_shape(info[0])}")
    if k_new[1] != v_new[1]:
        raise TypeError(f"k_new, v_new: must share one dtype, got {k_new[1]} and {v_new[1]}")
    kn, vn = tuple(k_new[0]), tuple(v_new[0])
    if kn[:-1] != vn[:-1]:
        raise ValueError(f"k_new, v_new: must agree in every dimension but the last, got {fmt_shape(kn)} and {fmt_shape(vn)}")
    batch = kn[0]
    cache = check_cache(k_cache=k_cache, v_cache=v_cache, block_table=block_table, batch=batch,
                        kv_layout=kv_layout, allowed_dtypes=(*FLOAT_DTYPES, FP8_DTYPE))
    if not cache.fp8 and k_new[1] != cache.dtype:
        raise TypeError(f"k_new: must have the cache's dtype ({cache.dtype}), got {k_new[1]}")
    if kn[2] != cache.heads or kn[3] != cache.head_dim_k or vn[3] != cache.head_dim_v:
        raise ValueError(f"k_new, v_new: expected {cache.heads} kv heads and head dims {cache.head_dim_k} / "
                         f"{cache.head_dim_v} (like the cache), got {fmt_shape(kn)} and {fmt_shape(vn)}")
    _check_seqlens(cache_seqlens, batch)
    scale_mode = check_scales(k_scale, v_scale, cache)
    has_leftpad = check_leftpad(cache_leftpad, block_table, batch)
    half, rot_rows = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, cache.head_dim_k, "k_new")
    return AppendShape(batch, kn[1], cache, k_new[1], scale_mode, has_leftpad, half, rotary_interleaved, rot_rows)


# ------------------------------------------------------------------------------------------------- tiles

def _pad(d: int) -> int:
    return max(16, next_power_of_2(d))


@dataclasses.dataclass(frozen=True)
class DecodeTile:
    """One entry of the decode kernel's tile table: the most packed rows per program, keys per step, warps,
    pipeline stages, and the programs per SM the split count then aims at (0: the cache kind's own rule,
    see :func:`choose_num_splits`)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 0


# A GPU's tiles (block sizes, warps, stages) come from the tuning cache (flashbridge.tiles.cache: the user's tuned
# entries, then the shipped ones, then the resource model's choice), keyed by the call's class (_gpu_case:
# "narrow", "wide", "wide_v", "float32", "fp8", "fp8_one_per_sm", "idle_contiguous", "idle_paged"). The split
# rule of a class stays here: programs per SM that choose_num_splits fills once (H200, Triton 3.6,
# bench_decode.py --splits-onesm*, --splits-onesmab, --splits-onesmspan).
PROGRAMS_PER_SM = {"fp8_one_per_sm": 1, "idle_contiguous": 1, "idle_paged": 2}
# "idle_paged" needs pages of whole 64-key blocks (a page-table lookup per block)
IDLE_PAGED_BLOCK_N = 64
# A tile no cache entry or model choice gives (never expected): small enough for every supported GPU.
FALLBACK_DECODE_TILE = DecodeTile(16, 32, 4, 2)
# The interpreter pays per program and per operation, not per element.
INTERPRETER_DECODE_TILE = DecodeTile(64, 32, 4, 1)


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """The tiles of one decode launch (see :func:`decode_tiles`)."""

    block_m: int
    block_n: int
    block_dqk: int
    dqk_chunks: int
    block_dv: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 0  # > 0: choose_num_splits fills the SMs once at this many programs each


def _one_wave_splits(target: Target, programs_per_sm: int, base: int) -> int:
    """Splits that fill every SM once with ``programs_per_sm`` programs when ``base`` programs exist without
    splits (at most MAX_AUTO_SPLITS): no second wave starts."""
    return min(target.num_sms * programs_per_sm // base, MAX_AUTO_SPLITS)


def _gpu_case(rows: int, widest: int, block_dv: int, dtype: str, cache: Optional[CacheShape],
              batch_heads: Optional[int], span: Optional[int], target: Target) -> str:
    """The tile class of a call (the tuning cache's decode bucket). A batch "leaves SMs idle" when its (batch x kv head)
    programs are fewer than the SMs (one row block each: at most 16 rows, padded head dim 128): tiles made
    for a fixed number of programs per SM then win, which the split count fills once."""
    if dtype == "float32":
        return "float32"
    if widest > 128:
        return "wide" if block_dv <= 256 else "wide_v"
    idle = batch_heads is not None and batch_heads < target.num_sms and rows <= 16 and widest == 128
    if cache is not None and cache.fp8:
        if cache.paged and cache.page_size % 128:
            return "narrow"  # a page-table lookup per 64-key block
        # 256-key tiles only pay with long splits: 4096 keys per split or fewer measured slower
        if (idle and not cache.paged and span is not None
                and span // _one_wave_splits(target, 1, batch_heads) >= FP8_WIDE_SPLIT_KEYS):
            return "fp8_one_per_sm"
        return "fp8"  # a wider tile runs each split's dependent chain (load, convert, dot, softmax, dot) less often
    if idle and (cache is None or not cache.paged):
        return "idle_contiguous"
    if idle and cache.page_size % IDLE_PAGED_BLOCK_N == 0:
        return "idle_paged"
    return "narrow"


def _block_dims(head_dim_qk: int, head_dim_v: int) -> tuple[int, int, int]:
    """(block_dqk, dqk_chunks, block_dv): head dims up to 256 are one power-of-two tile; above, q.k runs in
    64-wide chunks."""
    if head_dim_qk <= 256:
        return _pad(head_dim_qk), 1, _pad(head_dim_v)
    return _CHUNK_DQK, cdiv(head_dim_qk, _CHUNK_DQK), _pad(head_dim_v)


def decode_class(rows: int, head_dim_qk: int, head_dim_v: int, dtype: str, cache: Optional[CacheShape],
                 batch_heads: Optional[int], span: Optional[int], target: Target) -> str:
    """The call's tile class (:func:`_gpu_case`) from its head dims."""
    block_dqk, chunks, block_dv = _block_dims(head_dim_qk, head_dim_v)
    return _gpu_case(rows, max(block_dqk * chunks, block_dv), block_dv, dtype, cache, batch_heads, span, target)


def _cached_tile(rows: int, head_dim_qk: int, head_dim_v: int, target: Target, dtype: str,
                 cache: Optional[CacheShape], batch_heads: Optional[int], span: Optional[int]) -> DecodeTile:
    """The tuning cache's tile for the call's class and the span's length bucket (the model's choice for
    a stand-in call of the same rows, head dims, dtype, programs and span where nothing is cached)."""
    from ...tiles import cache as tiles_cache
    from ...tiles.model import Tile, decode_case

    cls = decode_class(rows, head_dim_qk, head_dim_v, dtype, cache, batch_heads, span, target)
    length = f"L{tiles_cache.length_bucket(span or (cache.capacity if cache is not None else 4096))}"

    def case():  # the model's view: one query token a row, a 16-bit contiguous cache of the span's length
        return decode_case(head_dim=head_dim_qk, batch=max(1, batch_heads or target.num_sms), heads=rows,
                           heads_kv=1, cache_len=span or 4096, dtype=dtype)

    fallback = FALLBACK_DECODE_TILE
    tile = tiles_cache.plan_tile("decode", target, cls, length, case,
                                 Tile(fallback.block_m, fallback.block_n, fallback.num_warps, fallback.num_stages))
    return DecodeTile(tile.block_m, tile.block_n, tile.num_warps, tile.num_stages, PROGRAMS_PER_SM.get(cls, 0))


def decode_tiles(rows: int, head_dim_qk: int, head_dim_v: int, target: Target,
                 config: Optional[DecodeConfig] = None, dtype: str = "bfloat16", *,
                 cache: Optional[CacheShape] = None, batch_heads: Optional[int] = None,
                 span: Optional[int] = None) -> DecodeTiles:
    """Tiles for ``rows`` packed (token x head) rows of q in ``dtype``: the tuning cache's tile for the
    call's class (:func:`_gpu_case`; the interpreter: :data:`INTERPRETER_DECODE_TILE`), with ``config``'s
    fields on top. Head dims up to 256 are one power-of-two tile; above, q.k runs in 64-wide chunks.
    ``cache`` None = a 16-bit cache; ``batch_heads``: batch x kv heads (None = unknown); ``span``: the
    longest span a split count is made for."""
    config = config or active_config(DecodeConfig)
    block_dqk, chunks, block_dv = _block_dims(head_dim_qk, head_dim_v)
    if target.interpret:
        tile = INTERPRETER_DECODE_TILE
    elif None not in (config.block_m, config.block_n, config.num_warps, config.num_stages):
        tile = DecodeTile(config.block_m, config.block_n, config.num_warps, config.num_stages)
    else:
        tile = _cached_tile(rows, head_dim_qk, head_dim_v, target, dtype, cache, batch_heads, span)
    per_sm = 0 if config.block_n or config.num_stages else tile.programs_per_sm
    return DecodeTiles(min(config.block_m or tile.block_m, max(16, next_power_of_2(rows))),
                       config.block_n or tile.block_n, block_dqk, chunks, block_dv,
                       config.num_warps or tile.num_warps, config.num_stages or tile.num_stages, per_sm)


def choose_num_splits(*, batch: int, heads_kv: int, rows: int, span: int, head_dim_qk: int, head_dim_v: int,
                      target: Target, config: Optional[DecodeConfig] = None, dtype: str = "bfloat16",
                      cache: Optional[CacheShape] = None) -> int:
    """The automatic split count, from shapes only (no device sync; traces under jit / torch.compile).
    ``base = batch * heads_kv * row_blocks`` programs exist without splits. The first rule that applies:

    * tiles made for a fixed number of programs per SM (``DecodeTiles.programs_per_sm``): that many per SM,
      rounded down so that no second wave starts;
    * contiguous 16-bit caches: 1 split once ``base`` reaches one program per SM, else 2 programs per SM;
    * paged caches, and FP8 caches on 64-key tiles (a page-table lookup or FP8 conversions every step): 4
      programs per SM rounded up to a power of two, 1 split only once ``base`` reaches that;
    * FP8 caches on wider tiles: the contiguous rule rounded down to a power of two.

    Contiguous 16-bit counts (and the first rule's) above the merge's states per round are rounded down to
    whole rounds (a 33rd state costs the merge a third dependent round). Each split keeps at least 4 key
    blocks of the longest possible span (the cache capacity, or the window), and there are at most
    MAX_AUTO_SPLITS. The rules were timed on an H200, Triton 3.6 (bench_decode.py --splits and its
    --splits-* sweeps). The interpreter keeps the 4-per-SM rule and 1 block per split."""
    config = config or active_config(DecodeConfig)
    tiles = decode_tiles(rows, head_dim_qk, head_dim_v, target, config, dtype, cache=cache,
                         batch_heads=batch * heads_kv, span=span)
    base = batch * heads_kv * cdiv(rows, tiles.block_m)
    fp8 = cache is not None and cache.fp8
    wide_fp8 = fp8 and tiles.block_n >= 128
    gathered = (cache is not None and cache.paged) or (fp8 and not wide_fp8)
    dense = not (gathered or target.interpret)
    one_wave = tiles.programs_per_sm > 0
    slots = target.num_sms * (tiles.programs_per_sm or (2 if dense else 4))
    if base >= (target.num_sms if dense else slots):
        return 1
    by_length = max(1, cdiv(span, tiles.block_n) // (1 if target.interpret else 4))
    if one_wave:
        wanted = _one_wave_splits(target, tiles.programs_per_sm, base)
    else:
        wanted = cdiv(slots, base)
        if gathered and not target.interpret:
            wanted = next_power_of_2(wanted)
        elif wide_fp8 and not target.interpret:
            wanted = next_power_of_2(wanted + 1) // 2  # the power of two at or below
    count = max(1, min(wanted, by_length, MAX_AUTO_SPLITS))
    step = config.merge_block_states or MERGE_STATES_PER_STEP
    if (dense or one_wave) and count > step:
        count -= count % step  # whole merge rounds (powers of two are already)
    return count


def _span(shape: DecodeShape, options: DecodeOptions) -> int:
    span = shape.cache.capacity
    if options.window_left is not None and options.window_right is not None:
        span = min(span, options.window_left + options.window_right + shape.seqlen_q)
    return span


def resolve_num_splits(shape: DecodeShape, options: DecodeOptions, num_splits: Optional[int], target: Target,
                       config: Optional[DecodeConfig] = None) -> int:
    if num_splits is not None:
        return num_splits
    return choose_num_splits(batch=shape.batch, heads_kv=shape.heads_kv, rows=shape.seqlen_q * shape.group,
                             span=_span(shape, options), head_dim_qk=shape.head_dim_qk,
                             head_dim_v=shape.head_dim_v, target=target, config=config, dtype=shape.dtype,
                             cache=shape.cache)

# ------------------------------------------------------------------------------------------------- plans

def contiguous_q_strides(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(batch, token, head) element strides of a contiguous ``(B, S, H, D)`` array."""
    return (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3])


def _dot_precision(dtype: str) -> str:
    return "ieee" if dtype == "float32" else "tf32"


def _decode_launch(*, inputs, outputs, grid, seqlen_q, fixed_len, cache: CacheShape, options: DecodeOptions,
                   q_strides, k_strides, v_strides, out_strides, lse_strides, group, head_dim_qk, head_dim_v,
                   dtype, tiles: DecodeTiles, has_seqlens: bool, has_sinks: bool, alibi_stride: int,
                   target: Target) -> Launch:
    left, right = window_scalars(options)
    # FP8 V read as pairs of columns (see load_e4m3_pairs) for 16-bit queries: even head dims and strides (two
    # accumulators of >= 16 columns each, tl.dot's minimum); the base must be 2-byte aligned (JAX arrays
    # are; torch_api.decode._check_pairs_base refuses a misaligned view)
    v_pairs = (cache.fp8 and dtype != "float32" and head_dim_v % 2 == 0 and tiles.block_dv >= 32
               and pow2_divisor(*v_strides, cap=2) == 2)
    # K too (q's even and odd columns against K's, see block_qk), with one column chunk
    k_pairs = (cache.fp8 and dtype != "float32" and head_dim_qk % 2 == 0
               and tiles.block_dqk >= 32 and tiles.dqk_chunks == 1
               and pow2_divisor(*k_strides, cap=2) == 2)
    qo = (*q_strides, *out_strides)
    kv = (*k_strides, *v_strides)
    return Launch(
        kernel=f"{_K}:decode_fwd_kernel",
        grid=grid,
        inputs=inputs,
        scalars=(("seqlen_q", seqlen_q), ("fixed_len", fixed_len), ("capacity", cache.capacity),
                 ("num_pages", cache.num_pages), ("sm_scale", float(options.softmax_scale)),
                 ("softcap", float(options.softcap)), ("window_left", left), ("window_right", right),
                 ("rot_rows", max(options.rotary_rows, 1)),
                 *((f"stride_q{d}", int(s)) for d, s in zip("bsh", q_strides)),
                 *((f"stride_k{d}", int(s)) for d, s in zip("psh", k_strides)),
                 *((f"stride_v{d}", int(s)) for d, s in zip("psh", v_strides)),
                 ("stride_tb", cache.max_pages if cache.paged else 0), ("stride_ab", alibi_stride),
                 ("stride_sc", 1 if options.scale_mode == "head" else 0),
                 *((f"stride_o{d}", int(s)) for d, s in zip("nbsh", out_strides)),
                 *((f"stride_l{d}", int(s)) for d, s in zip("nbsh", lse_strides))),
        outputs=outputs,
        constexprs=(("GROUP", group), ("DQK", head_dim_qk), ("DV", head_dim_v), ("BLOCK_M", tiles.block_m),
                    ("BLOCK_N", tiles.block_n), ("BLOCK_DQK", tiles.block_dqk), ("DQK_CHUNKS", tiles.dqk_chunks),
                    ("BLOCK_DV", tiles.block_dv), ("PAGED", cache.paged),
                    ("PAGE_SIZE", cache.page_size if cache.paged else 1), ("HAS_SEQLENS", has_seqlens),
                    ("HAS_LOCAL", local_mask_mode(options.window_left, options.window_right, one_comparison=False)),
                    ("HAS_SOFTCAP", options.softcap > 0),
                    ("HAS_ALIBI", options.has_alibi), ("HAS_SINKS", has_sinks),
                    ("HAS_SCALES", options.scale_mode != "none"), ("DOT_PRECISION", _dot_precision(dtype)),
                    ("QO_ALIGN", pow2_divisor(*qo)), ("KV_ALIGN", pow2_divisor(*kv)),
                    ("LSE_ALIGN", pow2_divisor(*lse_strides)), ("V_PAIRS", v_pairs),
                    ("WIDEN_ASM", (v_pairs or k_pairs) and not target.interpret),
                    ("POSITIVE_SCALE", options.softmax_scale > 0), ("K_PAIRS", k_pairs),
                    ("HAS_LEFTPAD", options.has_leftpad), ("ROT_HALF", options.rotary_half),
                    ("ROT_INTERLEAVED", options.rotary_interleaved),
                    # flash-attn: without causal or a window every query sits at the first new token's position
                    ("ROT_STEP", int(options.causal or options.has_local)),
                    ("ROT_BF16", options.rotary_half > 0 and dtype == "bfloat16")),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _merge_launch(*, a: tuple[str, str], b: Optional[tuple[str, str]], sinks: Optional[str], n_a: int, n_b: int,
                  n_rows: int, seqlen_q: int, heads: int, head_dim_v: int, lse_strides: tuple[int, int, int],
                  target: Target, config: Optional[DecodeConfig]) -> Launch:
    # Elements per program: two programs per SM when the merge is small (decode of one sequence merges only
    # Hq * Dv elements per split), 16 to 512 (16 states x 512 fp32 per round in registers); 16 states per
    # dependent round. Swept on H200, Triton 3.6 (bench_decode.py --splits-merge).
    config = config or active_config(DecodeConfig)
    elements = n_rows * head_dim_v
    block_e = config.merge_block_elements or (
        256 if target.interpret else max(16, min(512, next_power_of_2(cdiv(elements, 2 * target.num_sms)))))
    block_n = config.merge_block_states or min(MERGE_STATES_PER_STEP, next_power_of_2(max(n_a, n_b, 1)))
    state_stride = elements  # states are contiguous (rows, Dv) slabs
    return Launch(
        kernel=f"{_K}:merge_states_kernel",
        grid=(cdiv(elements, block_e),),
        inputs=(a[0], a[1], (b or a)[0], (b or a)[1], sinks or a[1]),
        scalars=(("n_a", n_a), ("n_b", n_b), ("n_rows", n_rows), ("seqlen_q", seqlen_q), ("heads", heads),
                 ("stride_oa", state_stride), ("stride_la", n_rows), ("stride_obn", state_stride),
                 ("stride_lbn", n_rows), ("stride_lse_b", lse_strides[0]), ("stride_lse_s", lse_strides[1]),
                 ("stride_lse_h", lse_strides[2])),
        outputs=("out", "lse"),
        constexprs=(("DV", head_dim_v), ("BLOCK_E", block_e), ("BLOCK_N", block_n), ("HAS_B", b is not None),
                    ("HAS_SINKS", sinks is not None), ("O_ALIGN", pow2_divisor(state_stride)),
                    ("L_ALIGN", pow2_divisor(n_rows))),
        num_warps=4,
        num_stages=1,
    )


def _final_lse_strides(shape: DecodeShape) -> tuple[int, int, int]:
    """(batch, token, head) strides of the (B, Hq, Sq) lse."""
    return (shape.heads_q * shape.seqlen_q, 1, shape.seqlen_q)


def _partial_specs(prefix: str, splits: int, batch: int, seqlen_q: int, heads: int, dv: int):
    return (Spec(f"{prefix}_out", (splits, batch, seqlen_q, heads, dv), "float32"),
            Spec(f"{prefix}_lse", (splits, batch, seqlen_q, heads), "float32"))


def _partial_strides(batch: int, seqlen_q: int, heads: int, dv: int):
    rows = batch * seqlen_q * heads
    return ((rows * dv, seqlen_q * heads * dv, heads * dv, dv), (rows, seqlen_q * heads, heads, 1))


def plan_decode(shape: DecodeShape, options: DecodeOptions, *, target: Target, num_splits: Optional[int] = None,
                strides: Optional[dict[str, tuple[int, int, int]]] = None,
                config: Optional[DecodeConfig] = None) -> Plan:
    """Plan inputs: q, k_cache, v_cache, cache_seqlens, [block_table], [alibi_slopes], [sinks], [k_scale,
    v_scale], [cache_leftpad], [rotary_cos, rotary_sin].
    ``strides``: "q" -> (batch, token, head), "k_cache" / "v_cache" -> (page, slot, head) element
    strides (default: contiguous). Results: out (q's dtype, ``shape.out_shape``), lse (float32, (B, Hq, Sq))."""
    strides = strides or {}
    config = config or active_config(DecodeConfig)
    cache = shape.cache
    splits = resolve_num_splits(shape, options, num_splits, target, config)
    rows = shape.seqlen_q * shape.group
    tiles = decode_tiles(rows, shape.head_dim_qk, shape.head_dim_v, target, config, shape.dtype, cache=cache,
                         batch_heads=shape.batch * shape.heads_kv, span=_span(shape, options))
    present = {"q": True, "k_cache": True, "v_cache": True, "cache_seqlens": True, "block_table": cache.paged,
               "alibi_slopes": options.has_alibi, "sinks": options.has_sinks,
               "k_scale": options.scale_mode != "none", "v_scale": options.scale_mode != "none",
               "cache_leftpad": options.has_leftpad, "rotary_cos": options.rotary_half > 0,
               "rotary_sin": options.rotary_half > 0}
    kernel_inputs = tuple(n if present[n] else "q" for n in present)
    common = dict(grid=(splits, shape.heads_kv * cdiv(rows, tiles.block_m), shape.batch), seqlen_q=shape.seqlen_q,
                  fixed_len=0, cache=cache, options=options, target=target,
                  q_strides=strides.get("q") or contiguous_q_strides((shape.batch, shape.seqlen_q, shape.heads_q,
                                                                      shape.head_dim_qk)),
                  k_strides=strides.get("k_cache") or cache.strides(cache.head_dim_k),
                  v_strides=strides.get("v_cache") or cache.strides(cache.head_dim_v), group=shape.group,
                  head_dim_qk=shape.head_dim_qk, head_dim_v=shape.head_dim_v, dtype=shape.dtype, tiles=tiles,
                  has_seqlens=True, alibi_stride=shape.heads_q if options.alibi_batched else 0)
    finals = (Spec("out", shape.out_shape, shape.dtype), Spec("lse", shape.lse_shape, "float32"))
    inputs = tuple(n for n, here in present.items() if here)
    if splits == 1:
        ob, os_, oh = contiguous_q_strides(shape.out_shape)
        lb, ls, lh = _final_lse_strides(shape)
        launch = _decode_launch(inputs=kernel_inputs, outputs=("out", "lse"), out_strides=(0, ob, os_, oh),
                                lse_strides=(0, lb, ls, lh), has_sinks=options.has_sinks, **common)
        return Plan(inputs=inputs, buffers=finals, launches=(launch,), results=("out", "lse"))
    o_strides, l_strides = _partial_strides(shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim_v)
    decode = _decode_launch(inputs=kernel_inputs, outputs=("part_out", "part_lse"), out_strides=o_strides,
                            lse_strides=l_strides, has_sinks=False, **common)
    merge = _merge_launch(a=("part_out", "part_lse"), b=None, sinks="sinks" if options.has_sinks else None,
                          n_a=splits, n_b=0, n_rows=shape.batch * shape.seqlen_q * shape.heads_q,
                          seqlen_q=shape.seqlen_q, heads=shape.heads_q, head_dim_v=shape.head_dim_v,
                          lse_strides=_final_lse_strides(shape), target=target, config=config)
    buffers = (*_partial_specs("part", splits, shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim_v),
               *finals)
    return Plan(inputs=inputs, buffers=buffers, launches=(decode, merge), results=("out", "lse"))


def plan_merge(n_states: int, rows: int, head_dim: int, dtype: str, *, target: Target,
               config: Optional[DecodeConfig] = None) -> Plan:
    """Plan inputs: outs ``(N, rows, D)``, lses ``(N, rows)`` (contiguous). Results: out ``(rows, D)`` in
    ``dtype``, lse float32 ``(rows,)``."""
    launch = _merge_launch(a=("outs", "lses"), b=None, sinks=None, n_a=n_states, n_b=0, n_rows=rows, seqlen_q=1,
                           heads=1, head_dim_v=head_dim, lse_strides=(1, 0, 0), target=target, config=config)
    return Plan(inputs=("outs", "lses"),
                buffers=(Spec("out", (rows, head_dim), dtype), Spec("lse", (rows,), "float32")),
                launches=(launch,), results=("out", "lse"))


def plan_merge_into(rows: int, head_dim: int, acc_dtype: str, *, target: Target,
                    config: Optional[DecodeConfig] = None) -> Plan:
    """Merge one partial state into an accumulated one (ring attention's per-step update). Plan inputs:
    acc_out ``(rows, D)`` (``acc_dtype``), acc_lse ``(rows,)``, part_out ``(rows, D)`` (any float dtype),
    part_lse ``(rows,)``, all contiguous. Results: out ``(rows, D)`` in ``acc_dtype`` and lse ``(rows,)``.

    ``out`` may take over acc_out's buffer (each element is read before it is written, by the same
    program); ``lse`` may not (a row's lse is read by every program that holds part of the row)."""
    launch = _merge_launch(a=("acc_out", "acc_lse"), b=("part_out", "part_lse"), sinks=None, n_a=1, n_b=1,
                           n_rows=rows, seqlen_q=1, heads=1, head_dim_v=head_dim, lse_strides=(1, 0, 0),
                           target=target, config=config)
    return Plan(inputs=("acc_out", "acc_lse", "part_out", "part_lse"),
                buffers=(Spec("out", (rows, head_dim), acc_dtype), Spec("lse", (rows,), "float32")),
                launches=(launch,), results=("out", "lse"))


def plan_cascade(shape: DecodeShape, shared_len: int, options: DecodeOptions, *, target: Target,
                 num_splits: Optional[int] = None, strides: Optional[dict[str, tuple[int, int, int]]] = None,
                 config: Optional[DecodeConfig] = None) -> Plan:
    """Plan inputs: q (contiguous), shared_k, shared_v (contiguous), k_cache, v_cache, cache_seqlens,
    [block_table], [sinks], [k_scale, v_scale]. Results: out, lse as :func:`plan_decode`.

    The shared prefix is attended by all ``B * Sq`` query tokens as one sequence (no causal mask: the prefix
    precedes every request's own tokens), the requests' caches as in decode (causal within each), and one
    merge kernel combines both sets of partial states and adds the sinks."""
    strides = strides or {}
    config = config or active_config(DecodeConfig)
    cache = shape.cache
    b, sq, hq, dv = shape.batch, shape.seqlen_q, shape.heads_q, shape.head_dim_v
    shared = dataclasses.replace(cache, paged=False, num_pages=1, page_size=shared_len, max_pages=1)
    present = {"q": True, "shared_k": True, "shared_v": True, "k_cache": True, "v_cache": True,
               "cache_seqlens": True, "block_table": cache.paged, "sinks": options.has_sinks,
               "k_scale": options.scale_mode != "none", "v_scale": options.scale_mode != "none"}

    def name(n):
        return n if present[n] else "q"

    plain = dataclasses.replace(options, causal=False, window_left=None, window_right=None, has_alibi=False,
                                alibi_batched=False)
    q_strides = contiguous_q_strides((b, sq, hq, shape.head_dim_qk))
    common = dict(cache=None, target=target, group=shape.group, head_dim_qk=shape.head_dim_qk, head_dim_v=dv,
                  dtype=shape.dtype, has_sinks=False, alibi_stride=0)

    # 1. shared prefix: one "sequence" of B * Sq query tokens
    rows_a = b * sq * shape.group
    tiles_a = decode_tiles(rows_a, shape.head_dim_qk, dv, target, config, shape.dtype, cache=shared,
                           batch_heads=shape.heads_kv, span=shared_len)
    splits_a = num_splits or choose_num_splits(batch=1, heads_kv=shape.heads_kv, rows=rows_a, span=shared_len,
                                               head_dim_qk=shape.head_dim_qk, head_dim_v=dv, target=target,
                                               config=config, dtype=shape.dtype, cache=shared)
    oa, la = _partial_strides(1, b * sq, hq, dv)
    shared_launch = _decode_launch(
        **{**common, "cache": shared}, inputs=("q", "shared_k", "shared_v", "q", "q", "q", "q", name("k_scale"),
                                                name("v_scale"), "q", "q", "q"),
        outputs=("shared_out", "shared_lse"), grid=(splits_a, shape.heads_kv * cdiv(rows_a, tiles_a.block_m), 1),
        seqlen_q=b * sq, fixed_len=shared_len, options=plain, q_strides=(0, q_strides[1], q_strides[2]),
        k_strides=shared.strides(shape.head_dim_qk), v_strides=shared.strides(dv), out_strides=oa,
        lse_strides=la, tiles=tiles_a, has_seqlens=False)

    # 2. each request's own cache
    rows_b = sq * shape.group
    splits_b = resolve_num_splits(shape, options, num_splits, target, config)
    tiles_b = decode_tiles(rows_b, shape.head_dim_qk, dv, target, config, shape.dtype, cache=cache,
                           batch_heads=b * shape.heads_kv, span=_span(shape, options))
    ob, lb = _partial_strides(b, sq, hq, dv)
    own_launch = _decode_launch(
        **{**common, "cache": cache}, inputs=("q", "k_cache", "v_cache", "cache_seqlens", name("block_table"),
                                               "q", "q", name("k_scale"), name("v_scale"), "q", "q", "q"),
        outputs=("own_out", "own_lse"), grid=(splits_b, shape.heads_kv * cdiv(rows_b, tiles_b.block_m), b),
        seqlen_q=sq, fixed_len=0, options=dataclasses.replace(plain, causal=options.causal,
                                                              window_right=0 if options.causal else None),
        q_strides=q_strides, k_strides=strides.get("k_cache") or cache.strides(cache.head_dim_k),
        v_strides=strides.get("v_cache") or cache.strides(cache.head_dim_v), out_strides=ob, lse_strides=lb,
        tiles=tiles_b, has_seqlens=True)

    # 3. merge both sets of states (+ sinks)
    merge = _merge_launch(a=("shared_out", "shared_lse"), b=("own_out", "own_lse"),
                          sinks="sinks" if options.has_sinks else None, n_a=splits_a, n_b=splits_b,
                          n_rows=b * sq * hq, seqlen_q=sq, heads=hq, head_dim_v=dv,
                          lse_strides=_final_lse_strides(shape), target=target, config=config)
    buffers = (*_partial_specs("shared", splits_a, 1, b * sq, hq, dv), *_partial_specs("own", splits_b, b, sq, hq, dv),
               Spec("out", shape.out_shape, shape.dtype), Spec("lse", shape.lse_shape, "float32"))
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=buffers,
                launches=(shared_launch, own_launch, merge), results=("out", "lse"))


def plan_append(shape: AppendShape, *, target: Target,
                strides: Optional[dict[str, tuple[int, int, int]]] = None) -> Plan:
    """Plan inputs: k_new, v_new, cache_seqlens, [block_table], [k_scale, v_scale], [cache_leftpad],
    [rotary_cos, rotary_sin], k_cache, v_cache.
    Results: k_out, v_out -- the caches themselves, updated: run it with ``k_out`` / ``v_out`` bound to the
    cache buffers (see the module docstring). ``strides``: "k_new"/"v_new" -> (batch, token, head),
    "k_cache"/"v_cache" -> (page, slot, head)."""
    strides = strides or {}
    cache = shape.cache
    present = {"k_new": True, "v_new": True, "cache_seqlens": True, "block_table": cache.paged,
               "k_scale": shape.scale_mode != "none", "v_scale": shape.scale_mode != "none",
               "cache_leftpad": shape.has_leftpad, "rotary_cos": shape.rotary_half > 0,
               "rotary_sin": shape.rotary_half > 0, "k_cache": True, "v_cache": True}
    kn = strides.get("k_new") or contiguous_q_strides((shape.batch, shape.new_tokens, cache.heads, cache.head_dim_k))
    vn = strides.get("v_new") or contiguous_q_strides((shape.batch, shape.new_tokens, cache.heads, cache.head_dim_v))
    ks = strides.get("k_cache") or cache.strides(cache.head_dim_k)
    vs = strides.get("v_cache") or cache.strides(cache.head_dim_v)
    block_s = 16 if target.interpret else max(1, min(64, 8192 // max(_pad(cache.head_dim_k), _pad(cache.head_dim_v))))
    block_s = min(block_s, next_power_of_2(shape.new_tokens))
    launch = Launch(
        kernel=f"{_K}:append_kv_kernel",
        grid=(cdiv(shape.new_tokens, block_s), cache.heads, shape.batch),
        inputs=tuple(n if present[n] else "k_new" for n in present),
        scalars=(("n_new", shape.new_tokens), ("capacity", cache.capacity), ("num_pages", cache.num_pages),
                 *((f"stride_kn{d}", int(s)) for d, s in zip("bsh", kn)),
                 *((f"stride_vn{d}", int(s)) for d, s in zip("bsh", vn)),
                 *((f"stride_k{d}", int(s)) for d, s in zip("psh", ks)),
                 *((f"stride_v{d}", int(s)) for d, s in zip("psh", vs)),
                 ("stride_tb", cache.max_pages if cache.paged else 0),
                 ("stride_sc", 1 if shape.scale_mode == "head" else 0), ("rot_rows", max(shape.rotary_rows, 1))),
        outputs=("k_out", "v_out"),
        constexprs=(("DQK", cache.head_dim_k), ("DV", cache.head_dim_v), ("BLOCK_S", block_s),
                    ("BLOCK_DQK", _pad(cache.head_dim_k)), ("BLOCK_DV", _pad(cache.head_dim_v)),
                    ("PAGED", cache.paged), ("PAGE_SIZE", cache.page_size if cache.paged else 1),
                    ("FP8", cache.fp8), ("HAS_SCALES", shape.scale_mode != "none"),
                    ("NEW_ALIGN", pow2_divisor(*kn, *vn)), ("KV_ALIGN", pow2_divisor(*ks, *vs)),
                    ("HAS_LEFTPAD", shape.has_leftpad), ("ROT_HALF", shape.rotary_half),
                    ("ROT_INTERLEAVED", shape.rotary_interleaved),
                    ("ROT_BF16", shape.rotary_half > 0 and shape.new_dtype == "bfloat16")),
        num_warps=4,
        num_stages=1,
    )
    buffers = (Spec("k_out", cache.array_shape(cache.head_dim_k), cache.dtype),
               Spec("v_out", cache.array_shape(cache.head_dim_v), cache.dtype))
    return Plan(inputs=tuple(n for n, here in present.items() if here), buffers=buffers, launches=(launch,),
                results=("k_out", "v_out"))
