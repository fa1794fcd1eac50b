"""Launch plans and argument checks for MLA (absorbed DeepSeek latent attention): pure Python, shapes and
options in, a Plan out. Both front-ends validate through the ``check_*`` functions here.

Layouts: q ``(B, Sq, H, Dqk)``; prefill ``kv`` ``(B, Sk, Dqk)``; a decode cache ``(B, S_max, Dqk)`` or paged
``(num_pages, page_size, Dqk)`` with int32 ``block_table`` ``(B, max_pages)`` and ``cache_seqlens`` ``(B,)``;
top-k ``indices`` int32 ``(B, Sq, topk)``. Out ``(B, Sq, H, Dv)`` in q's dtype, lse float32 ``(B, H, Sq)``.
The values are ``kv[..., :Dv]``. A prefill ``kv`` is planned as a contiguous cache whose length is the key
length (one "page" per sequence), so prefill and decode share the forward kernel.

Plans:

* :func:`plan_mla_fwd`: one launch when ``num_splits == 1`` (the kernel writes out / lse), else float32
  split partials merged by the decode family's merge kernel.
* :func:`plan_mla_bwd`: the attention backward's preprocess (delta = rowsum(dout * out) - dlse, lse in log2
  units), dQ, (sparse: the index bitmap), dKV (and the sum of its parts when split).

Block masks (``sparse``: the :class:`~flashbridge.core_kernels.block_sparse.plan.SparseLayout` of a
flashbridge.masks.BlockMask, prefill only, checked by :func:`check_mla_block_mask`): the kernels walk the
mask's lists; the plans add its arrays (by their BlockMask names) to the inputs and pick tiles that divide
its blocks -- BLOCK_N divides ``kv_block`` and BLOCK_M divides ``q_block * H`` (a query block's rows).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .._config import active_config
from .._plan import (Launch, Plan, Spec, Target, cdiv, check_float_dtype, fmt_shape,
                     next_power_of_2, pow2_divisor)
from ..block_sparse import plan as bsp
from ..decode.plan import (FP8_DTYPE, MAX_PAGE_SIZE, DecodeConfig, _check_int32, _merge_launch, _partial_specs,
                           _partial_strides, check_num_splits)
from ..flash_attn.plan import check_seqlen_bound, local_mask_mode, window_scalars

_K = "mla.kernels"
MAX_HEAD_DIM_QK = 1024
MAX_HEADS = 128
MAX_AUTO_SPLITS = 64
TensorInfo = tuple[tuple[int, ...], str]
# the BlockMask arrays the dKV kernel reads (the transposed lists), in its argument order
DKV_MASK_ARRAYS = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "kv_order", "q_bits_index",
                   "bits", "tokens_q", "tokens_k")


# ------------------------------------------------------------------------------------------------ config

@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Tiles and launch parameters; ``None`` picks the default for the target (see :func:`fwd_tiles`). The
    plans take it as ``config=``, else from ``core_kernels.configure(MLAConfig(...))`` around the call (the
    one mechanism of every family, see ``core_kernels/_config.py``), else the defaults.

    * ``block_m``: (token, head) rows per program (at most 64 on a GPU: a 64 x 512 float32 accumulator
      already takes 128 registers per thread at 8 warps); ``block_n``: keys (or top-k entries) per step.
    * ``programs_per_sm``: what the automatic split count aims to fill (default: as many programs as the
      tile's shared memory lets one SM hold).
    * ``merge_block_elements`` / ``merge_block_states``: the split merge's tile (decode's merge kernel).
    * ``dq_*`` / ``dkv_*``: the backward kernels' tiles; ``dkv_splits``: programs sharing one key block's
      rows in the dKV kernel (their float32 partial sums are added in a fixed order).
    * ``fp8_pairs``: FP8 caches with 16-bit queries read the latent as 16-bit column pairs, once for both dots
      (``PAIRS`` in ``mla/kernels.py``; see :func:`column_pairs` for when the shapes allow it); False widens
      the tiles in registers instead (with ``separate_v``). None = where the shapes allow.
    * ``separate_v``: load the value tile a second time for ``p @ V`` (``SEPARATE_V`` in
      ``mla/kernels.py``); None = for FP8 caches read without column pairs.
    """

    block_m: Optional[int] = None
    block_n: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    programs_per_sm: Optional[int] = None
    merge_block_elements: Optional[int] = None
    merge_block_states: Optional[int] = None
    dq_block_m: Optional[int] = None
    dq_block_n: Optional[int] = None
    dq_num_warps: Optional[int] = None
    dq_num_stages: Optional[int] = None
    dkv_block_m: Optional[int] = None
    dkv_block_n: Optional[int] = None
    dkv_num_warps: Optional[int] = None
    dkv_num_stages: Optional[int] = None
    dkv_splits: Optional[int] = None
    separate_v: Optional[bool] = None
    fp8_pairs: Optional[bool] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in ("separate_v", "fp8_pairs"):
                if not isinstance(value, bool):
                    raise ValueError(f"MLAConfig.{f.name}: must be None, True or False, got {value!r}")
                continue
            if "block_m" in f.name or "block_n" in f.name:
                if value < 16 or value & (value - 1):
                    raise ValueError(f"MLAConfig.{f.name}: must be a power of two >= 16, got {value}")
            elif value < 1:
                raise ValueError(f"MLAConfig.{f.name}: must be >= 1, got {value}")

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(merge_block_elements=self.merge_block_elements,
                            merge_block_states=self.merge_block_states)



# ------------------------------------------------------------------------------------------------ shapes

@dataclasses.dataclass(frozen=True)
class LatentCache:
    """Latent rows as pages: a contiguous cache (or a prefill ``kv``) is one page of ``S`` rows per sequence."""

    paged: bool
    num_pages: int  # contiguous: the batch size
    page_size: int  # contiguous: S_max (prefill: Sk)
    max_pages: int  # block-table width (contiguous: 1)
    head_dim: int
    dtype: str

    @property
    def capacity(self) -> int:
        return self.max_pages * self.page_size

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def array_shape(self) -> tuple[int, int, int]:
        return (self.num_pages, self.page_size, self.head_dim)


@dataclasses.dataclass(frozen=True)
class MLAShape:
    batch: int
    seqlen_q: int
    heads: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str  # q's (and the output's)
    cache: LatentCache
    topk: int = 0  # 0: dense

    @property
    def sparse(self) -> bool:
        return self.topk > 0

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.batch, self.seqlen_q, self.heads, self.head_dim_v)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.batch, self.heads, self.seqlen_q)

    @property
    def q_shape(self) -> tuple[int, ...]:
        return (self.batch, self.seqlen_q, self.heads, self.head_dim_qk)


@dataclasses.dataclass(frozen=True)
class MLAOptions:
    softmax_scale: float
    causal: bool
    decode: bool  # per-sequence lengths from cache_seqlens (else every sequence has the cache's capacity)
    has_scale: bool = False  # an FP8 cache's dequantisation scale


# ------------------------------------------------------------------------------------------------ checks

def _check_head_dim_v(head_dim_v, dqk: int) -> int:
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, int):
        raise TypeError(f"head_dim_v: expected a Python int, got {type(head_dim_v).__name__}")
    if not 1 <= head_dim_v <= dqk:
        raise ValueError(f"head_dim_v: must be between 1 and the latent dim Dqk={dqk} (the values are the first "
                         f"head_dim_v dims of the latent), got {head_dim_v}")
    return head_dim_v


def _check_scale(softmax_scale, dqk: int) -> float:
    import math

    if softmax_scale is None:
        return 1.0 / math.sqrt(dqk)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a Python float or None, got {type(softmax_scale).__name__}")
    # comparisons rather than math.isfinite: torch.compile traces a float argument symbolically
    if not -math.inf < softmax_scale < math.inf:
        raise ValueError(f"softmax_scale: must be finite, got {softmax_scale}")
    return float(softmax_scale)


def _check_q(q: TensorInfo) -> tuple[int, ...]:
    check_float_dtype("q", q[1])
    qs = tuple(q[0])
    if len(qs) != 4:
        raise ValueError(f"q: expected 4 dimensions (batch, seqlen_q, heads, Dqk), got shape {fmt_shape(qs)}")
    if any(d < 1 for d in qs):
        raise ValueError(f"q: empty tensor of shape {fmt_shape(qs)}; every dimension must be >= 1")
    if qs[2] > MAX_HEADS:
        raise ValueError(f"q: {qs[2]} query heads are not supported; the kernels handle 1..{MAX_HEADS}")
    if qs[3] > MAX_HEAD_DIM_QK:
        raise ValueError(f"q: latent dim Dqk={qs[3]} is not supported; the kernels handle 1..{MAX_HEAD_DIM_QK}")
    return qs


def _check_indices(indices: Optional[TensorInfo], batch: int, seqlen_q: int) -> int:
    """The top-k width of ``indices`` (B, Sq, topk) int32, 0 without indices."""
    if indices is None:
        return 0
    _check_int32("indices", indices)
    shape = tuple(indices[0])
    if len(shape) != 3 or shape[:2] != (batch, seqlen_q) or shape[2] < 1:
        raise ValueError(f"indices: expected shape ({batch}, {seqlen_q}, topk) with topk >= 1 (key positions per "
                         f"query token), got {fmt_shape(shape)}")
    return shape[2]


def check_mla_args(*, q: TensorInfo, kv: TensorInfo, head_dim_v=512, causal=False, softmax_scale=None,
                   indices: Optional[TensorInfo] = None) -> tuple[MLAShape, MLAOptions]:
    """Validate an ``mla_attention`` call from (shape, dtype-name) pairs, before any launch."""
    batch, sq, heads, dqk = _check_q(q)
    if kv[1] != q[1]:
        raise TypeError(f"kv: must have q's dtype ({q[1]}), got {kv[1]}")
    ks = tuple(kv[0])
    if len(ks) != 3 or any(d < 1 for d in ks):
        raise ValueError(f"kv: expected 3 non-empty dimensions (batch, seqlen_k, Dqk) -- one latent head shared "
                         f"by every query head --, got shape {fmt_shape(ks)}")
    if ks[0] != batch or ks[2] != dqk:
        raise ValueError(f"q, kv: expected kv of shape ({batch}, seqlen_k, {dqk}) for q of shape {fmt_shape(q[0])}, "
                         f"got {fmt_shape(ks)}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    dv = _check_head_dim_v(head_dim_v, dqk)
    scale = _check_scale(softmax_scale, dqk)
    for name, length in (("q", sq), ("kv", ks[1])):
        check_seqlen_bound(f"{name}: sequence length {length}", length)
    topk = _check_indices(indices, batch, sq)
    cache = LatentCache(False, batch, ks[1], 1, dqk, kv[1])
    return MLAShape(batch, sq, heads, dqk, dv, q[1], cache, topk), MLAOptions(scale, causal, decode=False)


def check_mla_block_mask(block_mask, shape: MLAShape, options: MLAOptions) -> bsp.SparseLayout:
    """The layout of an ``mla_attention(..., block_mask=...)`` call's mask after checking it against the
    call (a TypeError / ValueError naming ``block_mask``); both front-ends call it before any launch."""
    from ...masks import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a flashbridge.masks.BlockMask, got {type(block_mask).__name__}")
    if options.causal:
        raise ValueError("block_mask: causal does not combine with a block mask; build the mask you mean with "
                         "flashbridge.masks (e.g. masks.causal(Sq, Sk) & other)")
    if shape.sparse:
        raise ValueError("block_mask: one sparsity source at a time: pass top-k indices= or a block_mask, not both")
    layout = bsp.layout_of(block_mask)
    if layout.heads != 1:
        raise ValueError(f"block_mask: a per-head mask (head extent {layout.heads}) does not fit MLA: the query "
                         "heads of a token share the one latent KV head and sit together in one program's MMA "
                         "rows, so they must see the same keys; build the mask shared by the heads (head extent 1, "
                         "e.g. from_blocks with a (nQ, nK) or (B, 1, nQ, nK) grid)")
    bsp.check_layout(layout, batch=shape.batch, heads_q=1, seqlen_q=shape.seqlen_q, seqlen_k=shape.cache.capacity,
                     varlen=False)
    return layout


def check_mla_decode_args(*, q: TensorInfo, kv_cache: TensorInfo, cache_seqlens: Optional[TensorInfo],
                          block_table: Optional[TensorInfo] = None, head_dim_v=512, softmax_scale=None,
                          indices: Optional[TensorInfo] = None, kv_scale: Optional[TensorInfo] = None,
                          num_splits=None) -> tuple[MLAShape, MLAOptions, Optional[int]]:
    """Validate an ``mla_decode`` call; returns the shape, the options and ``num_splits`` (None = automatic).
    Values inside ``cache_seqlens`` / ``block_table`` / ``indices`` are checked by :func:`check_decode_values`
    / :func:`check_index_values` when they are on the host."""
    batch, sq, heads, dqk = _check_q(q)
    if kv_cache[1] not in (q[1], FP8_DTYPE):
        raise TypeError(f"kv_cache: dtype {kv_cache[1]} is not supported here; expected q's dtype ({q[1]}) or "
                        f"{FP8_DTYPE} (with kv_scale)")
    cs = tuple(kv_cache[0])
    paged = block_table is not None
    what = "(num_pages, page_size, Dqk) with a block_table" if paged else "(batch, S_max, Dqk)"
    if len(cs) != 3 or any(d < 1 for d in cs):
        raise ValueError(f"kv_cache: expected 3 non-empty dimensions {what}, got shape {fmt_shape(cs)}")
    if cs[2] != dqk:
        raise ValueError(f"q, kv_cache: latent dims differ: q {fmt_shape(q[0])} (Dqk={dqk}), kv_cache Dqk={cs[2]}")
    if paged:
        _check_int32("block_table", block_table)
        bt = tuple(block_table[0])
        if len(bt) != 2 or bt[0] != batch or bt[1] < 1:
            raise ValueError(f"block_table: expected shape ({batch}, max_pages) with max_pages >= 1, got {fmt_shape(bt)}")
        if cs[1] & (cs[1] - 1) or cs[1] > MAX_PAGE_SIZE:
            raise ValueError(f"kv_cache: page size {cs[1]} (from shape {fmt_shape(cs)}) is not supported; page sizes "
                             f"are powers of two from 1 to {MAX_PAGE_SIZE}")
        cache = LatentCache(True, cs[0], cs[1], bt[1], dqk, kv_cache[1])
    else:
        if cs[0] != batch:
            raise ValueError(f"kv_cache: a contiguous cache needs one entry per sequence: batch {cs[0]} in "
                             f"{fmt_shape(cs)}, but {batch} sequences (pass block_table for a paged cache)")
        cache = LatentCache(False, batch, cs[1], 1, dqk, kv_cache[1])
    check_seqlen_bound(f"{'block_table: max_pages x page_size' if paged else 'kv_cache: S_max'} = {cache.capacity}",
                       cache.capacity)
    if cache_seqlens is None:
        raise ValueError(f"cache_seqlens: required, an int32 ({batch},) tensor of per-sequence cache lengths")
    _check_int32("cache_seqlens", cache_seqlens)
    if tuple(cache_seqlens[0]) != (batch,):
        raise ValueError(f"cache_seqlens: expected shape ({batch},), got {fmt_shape(cache_seqlens[0])}")
    if kv_scale is not None:
        if not cache.fp8:
            raise ValueError(f"kv_scale: only meaningful for a {FP8_DTYPE} cache; the cache is {cache.dtype}")
        if kv_scale[1] != "float32":
            raise TypeError(f"kv_scale: must be float32, got {kv_scale[1]}")
        if tuple(kv_scale[0]) not in ((), (1,)):
            raise ValueError(f"kv_scale: expected shape () or (1,) (one latent head: one scale), got "
                             f"{fmt_shape(kv_scale[0])}")
    dv = _check_head_dim_v(head_dim_v, dqk)
    scale = _check_scale(softmax_scale, dqk)
    topk = _check_indices(indices, batch, sq)
    splits = check_num_splits(num_splits)
    shape = MLAShape(batch, sq, heads, dqk, dv, q[1], cache, topk)
    return shape, MLAOptions(scale, True, decode=True, has_scale=kv_scale is not None), splits


def check_index_values(indices, lengths, seqlen_k: Optional[int] = None) -> None:
    """Host values of top-k ``indices`` (B, Sq, topk) (a numpy-convertible array): every entry >= -1, and the
    entries a query visits (``0 <= index < length``) distinct. -1 and entries past the sequence are padding
    and may repeat. ``lengths``: per sequence (decode), or None with ``seqlen_k`` (prefill)."""
    import numpy as np

    idx = np.asarray(indices).astype(np.int64)
    if idx.size == 0:
        return
    if idx.min() < -1:
        pos = tuple(int(i) for i in np.argwhere(idx < -1)[0])
        raise ValueError(f"indices: entry {pos} = {int(idx[pos])}; entries must be key positions or -1 (skipped)")
    limit = np.full(idx.shape[0], seqlen_k) if lengths is None else np.asarray(lengths, dtype=np.int64)
    valid = (idx >= 0) & (idx < limit[:, None, None])
    s = np.sort(np.where(valid, idx, -1), axis=-1)
    dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    if dup.any():
        b, i, k = (int(x) for x in np.argwhere(dup)[0])
        raise ValueError(f"indices: query {i} of sequence {b} lists key {int(s[b, i, k + 1])} more than once; the "
                         "keys of a query must be distinct (-1 and out-of-range entries may repeat)")


def check_decode_values(cache_seqlens, block_table, cache: LatentCache) -> None:
    """Host values: lengths in ``[0, capacity]`` and the block-table entries they use in ``[0, num_pages)``."""
    from ..decode.plan import CacheShape, check_cache_values

    check_cache_values(cache_seqlens, block_table,
                       CacheShape("NHD", cache.paged, cache.num_pages, cache.page_size, cache.max_pages, 1,
                                  cache.head_dim, cache.head_dim, cache.dtype))


# ------------------------------------------------------------------------------------------------- tiles

def _pad(d: int) -> int:
    return max(16, next_power_of_2(d))


def _widths(shape: MLAShape) -> tuple[int, int]:
    """(BLOCK_DV, BLOCK_DR): padded widths of the value columns and of the rest (16 when there is none)."""
    return _pad(shape.head_dim_v), _pad(max(shape.head_dim_qk - shape.head_dim_v, 1))


def column_pairs(shape: MLAShape, config: Optional[MLAConfig] = None) -> bool:
    """Whether an FP8 latent is read as 16-bit column pairs (``PAIRS``, see ``pair_scores`` in
    mla/kernels.py), as far as the shape tells: 16-bit queries, even ``Dv`` and ``Dqk - Dv`` (a pair never
    straddles the value part's edge), and at least 16 pairs in each part's padded width (``tl.dot``'s
    smallest contraction). The plan adds even cache strides; the torch front-end checks the base's 2-byte
    alignment (JAX arrays are aligned)."""
    config = config or active_config(MLAConfig)
    bdv, bdr = _widths(shape)
    rest = shape.head_dim_qk - shape.head_dim_v
    return (config.fp8_pairs is not False and shape.cache.fp8 and shape.dtype != "float32"
            and shape.head_dim_v % 2 == 0 and rest % 2 == 0 and bdv >= 32 and (rest == 0 or bdr >= 32))


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 1


def _rows_per_block(shape: MLAShape) -> int:
    """Rows one row block could hold: a token's heads (sparse: each token has its own key list) or every
    (token, head) pair."""
    return shape.heads if shape.sparse else shape.seqlen_q * shape.heads


def fwd_tiles(shape: MLAShape, target: Target, config: Optional[MLAConfig] = None) -> Tiles:
    """The forward's tiles (``MLAConfig`` fields override them one by one).

    Interpreter: up to 64 rows, 16 keys per step (several steps and a ragged tail at the tests' lengths), no
    pipelining, 4 programs per "SM" (the tests' split counts).

    GPU, 16-bit queries, 64 rows (H >= 64, the heads of one token): 64 keys per step, 8 warps, 2 stages --
    each warp group holds half of the 64 x 512 float32 accumulator (128 registers per thread); Triton gives
    both warp groups the whole 64 x 64 score tile (a score dot feeding another dot keeps its rows within one
    warp group), so q k^T runs twice per CTA. sm_90 (Triton 3.9): 216 KB of shared memory (q 72 KB, two
    72 KB latent stages), 255 registers, 376 B of stack (the 36 loop-invariant descriptors of q's k-steps
    live through the loop; ~50 local reloads per 64-key step), 1008 instructions per step, 76 wgmma. 32 keys
    per step spills nothing in the loop but needs 1906 instructions per 64 keys (its score MMAs are n=16).
    Fewer rows (H=16, memory-bound): 8 warps (mma.sync: 133 registers, no spills), 64 keys, the pipeline
    depth that gives two latent buffers (168 KB): 3 stages for a contiguous cache, 5 when each step first
    reads a page id or top-k positions (the pipeliner gives that load a stage of its own).
    FP8 caches read as column pairs (:func:`column_pairs`; q in f16, the latent staged once as 16-bit pairs
    and widened into both dots' operands): 64 keys per step, 8 warps, at most 32 rows (mma.sync: a widened
    tile cannot be a wgmma operand without a trip through shared memory, and 64 rows spilled 1 KB), two
    stages more than 16-bit caches (each buffer holds half the bytes: about as many bytes in flight).
    sm_90 (Triton 3.9), paged: H=16 155-159 registers, no spills, 131 KB, 639 instructions per 64-key step
    (bf16: 549); H=128 (32 rows) 200 registers, no spills, 824 per step.
    FP8 caches otherwise (widened in registers; ``p @ V`` loads its value tile through a second pointer, so
    both tiles are staged through cp.async, see ``SEPARATE_V``): 32 keys per step, 8 warps, at most 32 rows,
    two buffers per tile (3 stages contiguous, 5 gathered) -- 64 rows on wgmma spilled 600-700 B and ptxas
    serialised every wgmma (a wait after each); 32 rows run mma.sync: 243 registers, no spills, 106 KB
    (16 rows: 179 registers, 87 KB, 728 instructions per 32-key step). One program per SM in every case
    (registers or shared memory).
    float32 queries (IEEE dots keep their operands in registers): 16 x 16 tiles, 8 warps, 2 stages."""
    config = config or active_config(MLAConfig)
    rows = _rows_per_block(shape)
    bm = min(64, max(16, next_power_of_2(rows)))
    gathered = shape.cache.paged or shape.sparse  # a page id or top-k positions read before each step's rows
    if target.interpret:
        tiles = Tiles(bm, 16, 4, 1, 4)
    elif shape.dtype == "float32":
        tiles = Tiles(16, 16, 8, 2)
    elif shape.cache.fp8 and column_pairs(shape, config):
        tiles = Tiles(min(bm, 32), 64, 8, 7 if gathered else 5)
    elif shape.cache.fp8:
        tiles = Tiles(min(bm, 32), 32, 8, 5 if gathered else 3)
    elif bm >= 64:
        tiles = Tiles(64, 64, 8, 2)
    else:
        tiles = Tiles(bm, 64, 8, 5 if gathered else 3)
    return Tiles(config.block_m or tiles.block_m, config.block_n or tiles.block_n,
                 config.num_warps or tiles.num_warps, config.num_stages or tiles.num_stages,
                 config.programs_per_sm or tiles.programs_per_sm)


def row_blocks(shape: MLAShape, block_m: int, sparse: Optional[bsp.SparseLayout] = None) -> int:
    """Row-block programs: one token's heads each (top-k lists), the packed (token, head) rows, or with a
    block mask the rows of whole mask query blocks (programs past the last row return at once)."""
    if shape.sparse:
        return shape.seqlen_q * cdiv(shape.heads, block_m)
    if sparse is not None:
        return bsp.sparse_blocks(shape.seqlen_q * shape.heads, sparse.q_block * shape.heads, block_m)
    return cdiv(shape.seqlen_q * shape.heads, block_m)


def choose_num_splits(shape: MLAShape, options: MLAOptions, tiles: Tiles, target: Target,
                      config: Optional[MLAConfig] = None) -> int:
    """The automatic split count of a decode call (prefill: 1). ``base = batch x row blocks`` programs
    exist without splits and ``slots = SMs x programs per SM`` run at once; the count is the smallest one
    whose last wave is at least 92% full among the counts that keep every split at least 4 steps long (one in
    the interpreter) and at most 64: B=64, H=128 (128 programs of 64 heads on 132 SMs, one per SM) takes 1;
    H=16 (64 programs) 2; B=1 (2 programs) 61. Static (shapes only), so it traces under jit."""
    if not options.decode:
        return 1
    config = config or active_config(MLAConfig)
    base = shape.batch * row_blocks(shape, tiles.block_m)
    slots = target.num_sms * tiles.programs_per_sm
    steps = cdiv(shape.topk, tiles.block_n) if shape.sparse else cdiv(shape.cache.capacity, tiles.block_n)
    limit = max(1, min(MAX_AUTO_SPLITS, steps // (1 if target.interpret else 4)))

    def fill(s):
        programs = base * s
        return programs / (cdiv(programs, slots) * slots)

    best = max(fill(s) for s in range(1, limit + 1))
    return next(s for s in range(1, limit + 1) if fill(s) >= min(best, 0.92))


# ------------------------------------------------------------------------------------------------- plans

def contiguous_q_strides(shape: tuple[int, ...]) -> tuple[int, int, int]:
    return (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3])


def _lse_strides(shape: MLAShape) -> tuple[int, int, int]:
    """(batch, token, head) strides of the (B, H, Sq) lse."""
    return (shape.heads * shape.seqlen_q, 1, shape.seqlen_q)


def _dot_precision(dtype: str) -> str:
    return "ieee" if dtype == "float32" else "tf32"


def cache_strides(cache: LatentCache) -> tuple[int, int]:
    """(page, slot) element strides of a contiguous cache array."""
    return (cache.page_size * cache.head_dim, cache.head_dim)


def _mask_tiles(tiles: Tiles, sparse: Optional[bsp.SparseLayout], heads: int) -> Tiles:
    """Tiles that divide a block mask's blocks: BLOCK_N its key block, BLOCK_M its query block's rows."""
    if sparse is None:
        return tiles
    return dataclasses.replace(tiles, block_m=bsp.sparse_tile(tiles.block_m, sparse.q_block * heads),
                               block_n=bsp.sparse_tile(tiles.block_n, sparse.kv_block))


def _mask_args(sparse: Optional[bsp.SparseLayout], *, transposed: bool = False):
    """(runtime scalars, constexprs) of a block mask's walk and element test, placeholders without a mask:
    the band's edges, the query-major lists' (``transposed``: key-major lists') batch stride and width, the
    token rows' batch stride. The masks are shared by the heads: no head strides."""
    left, right = window_scalars(sparse) if sparse is not None else (0, 0)
    named = dict(bsp.mask_scalars(sparse, backward=True))
    lists = ("mask_t_stride_b", "mask_t_max") if transposed else ("mask_stride_b", "mask_max")
    scalars = (("window_left", left), ("window_right", right), *((n, named[n]) for n in lists),
               ("tok_stride_b", named["tok_stride_b"]))
    mode = 0 if sparse is None else local_mask_mode(sparse.window_left, sparse.window_right, one_comparison=True)
    return scalars, (*bsp.mask_constexprs(sparse, backward=False), ("HAS_LOCAL", mode))


def _check_sparse(shape: MLAShape, options: MLAOptions, sparse: Optional[bsp.SparseLayout]) -> None:
    if sparse is not None and (options.decode or options.causal or shape.sparse or sparse.heads != 1):
        raise ValueError("block_mask: prefill only, without causal or indices, shared by the heads "
                         "(see check_mla_block_mask)")


def plan_mla_fwd(shape: MLAShape, options: MLAOptions, *, target: Target, num_splits: Optional[int] = None,
                 strides: Optional[dict] = None, config: Optional[MLAConfig] = None,
                 sparse: Optional[bsp.SparseLayout] = None) -> Plan:
    """Plan inputs: q, kv, [cache_seqlens], [block_table], [indices], [kv_scale], then with ``sparse`` (a
    BlockMask's layout) its arrays by their BlockMask names. ``strides``: "q" -> (batch, token, head), "kv"
    -> (page, slot) element strides (default: contiguous). Results: out (q's dtype), lse (float32, (B, H,
    Sq))."""
    config = config or active_config(MLAConfig)
    strides = strides or {}
    cache = shape.cache
    _check_sparse(shape, options, sparse)
    tiles = _mask_tiles(fwd_tiles(shape, target, config), sparse, shape.heads)
    splits = num_splits or choose_num_splits(shape, options, tiles, target, config)
    if not options.decode and splits != 1:
        raise ValueError("num_splits: prefill runs one split")
    bdv, bdr = _widths(shape)
    present = {"q": True, "kv": True, "cache_seqlens": options.decode, "block_table": cache.paged,
               "indices": shape.sparse, "kv_scale": options.has_scale}
    inputs = tuple(n for n, here in present.items() if here) + tuple(
        n for n, here in bsp.present_arrays(sparse, bsp.FWD_ARRAYS).items() if here)
    q_strides = strides.get("q") or contiguous_q_strides(shape.q_shape)
    kv_strides = strides.get("kv") or cache_strides(cache)
    idx_strides = (shape.seqlen_q * shape.topk, shape.topk) if shape.sparse else (0, 0)
    pairs = column_pairs(shape, config) and pow2_divisor(*kv_strides, cap=2) == 2
    if splits == 1:
        ob, os_, oh = contiguous_q_strides(shape.out_shape)
        out_strides, lse_strides, outputs = (0, ob, os_, oh), (0, *_lse_strides(shape)), ("out", "lse")
    else:
        out_strides, lse_strides = _partial_strides(shape.batch, shape.seqlen_q, shape.heads, shape.head_dim_v)
        outputs = ("part_out", "part_lse")
    scalars = (("seqlen_q", shape.seqlen_q), ("fixed_len", cache.capacity), ("capacity", cache.capacity),
               ("num_pages", cache.num_pages), ("topk", shape.topk), ("sm_scale", float(options.softmax_scale)),
               *((f"stride_q{d}", int(s)) for d, s in zip("bsh", q_strides)),
               ("stride_kp", int(kv_strides[0])), ("stride_ks", int(kv_strides[1])),
               ("stride_tb", cache.max_pages if cache.paged else 0),
               ("stride_ib", idx_strides[0]), ("stride_is", idx_strides[1]),
               *((f"stride_o{d}", int(s)) for d, s in zip("nbsh", out_strides)),
               *((f"stride_l{d}", int(s)) for d, s in zip("nbsh", lse_strides)))
    mask_scalars, mask_flags = _mask_args(sparse)
    launch = Launch(
        kernel=f"{_K}:mla_fwd_kernel",
        grid=(row_blocks(shape, tiles.block_m, sparse), splits, shape.batch),
        inputs=tuple(n if present[n] else "q" for n in present)[:2] + ("kv",)
        + tuple(n if present[n] else "q" for n in present)[2:] + bsp.mask_inputs(sparse, bsp.FWD_ARRAYS),
        scalars=scalars + mask_scalars,
        outputs=outputs,
        constexprs=(("HEADS", shape.heads), ("DQK", shape.head_dim_qk), ("DV", shape.head_dim_v),
                    ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("BLOCK_DV", bdv), ("BLOCK_DR", bdr),
                    ("TOKEN_ROWS", shape.sparse), ("PAGED", cache.paged),
                    ("PAGE_SIZE", cache.page_size if cache.paged else 1), ("HAS_SEQLENS", options.decode),
                    ("CAUSAL", options.causal), ("SPARSE", shape.sparse), ("HAS_SCALE", options.has_scale),
                    ("DOT_PRECISION", _dot_precision(shape.dtype)),
                    ("POSITIVE_SCALE", options.softmax_scale > 0),
                    ("QO_ALIGN", pow2_divisor(*q_strides, *out_strides)), ("KV_ALIGN", pow2_divisor(*kv_strides)),
                    ("LSE_ALIGN", pow2_divisor(*lse_strides)),
                    ("SEPARATE_V", (cache.fp8 and not pairs) if config.separate_v is None else config.separate_v),
                    *mask_flags, ("PAIRS", pairs), ("WIDEN_ASM", pairs and not target.interpret)),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    finals = (Spec("out", shape.out_shape, shape.dtype), Spec("lse", shape.lse_shape, "float32"))
    if splits == 1:
        return Plan(inputs=inputs, buffers=finals, launches=(launch,), results=("out", "lse"))
    merge = _merge_launch(a=("part_out", "part_lse"), b=None, sinks=None, n_a=splits, n_b=0,
                          n_rows=shape.batch * shape.seqlen_q * shape.heads, seqlen_q=shape.seqlen_q,
                          heads=shape.heads, head_dim_v=shape.head_dim_v, lse_strides=_lse_strides(shape),
                          target=target, config=config.decode_config())
    buffers = (*_partial_specs("part", splits, shape.batch, shape.seqlen_q, shape.heads, shape.head_dim_v), *finals)
    return Plan(inputs=inputs, buffers=buffers, launches=(launch, merge), results=("out", "lse"))


def bwd_tiles(shape: MLAShape, target: Target, config: Optional[MLAConfig] = None) -> tuple[Tiles, Tiles, int]:
    """(dQ tiles, dKV tiles, dKV parts). dQ: row blocks of a token's heads, keys in steps; dKV: ``block_n``
    keys per program, the packed (token, head) rows ``block_m`` at a time. Interpreter: 16-key steps and two
    dKV parts (the parts' sum runs in the tests). GPU (sm_90, Triton 3.9, H=128, 576 / 512): dQ 32 rows x 32
    keys at 8 warps (mma.sync; 220 registers, no spills, 106 KB; 64 rows on wgmma spilled 1.1 KB: the
    64 x 576 float32 dQ alone is 144 registers per thread), dKV 16 keys x 64 rows at 8 warps (175 registers,
    no spills, 157 KB; 32 keys spilled 650 B, and the sparse kernel's 64 x 32 tile needed 236 KB of shared
    memory, more than an SM has); enough dKV parts that ``batch x key blocks x parts`` fills the SMs once
    (at most 8)."""
    config = config or active_config(MLAConfig)
    rows = _rows_per_block(shape)
    bm = min(64, max(16, next_power_of_2(rows)))
    if target.interpret:
        dq = Tiles(bm, 16, 4, 1)
        dkv = Tiles(min(64, max(16, next_power_of_2(shape.seqlen_q * shape.heads))), 16, 4, 1)
        parts = 2
    else:
        fp32 = shape.dtype == "float32"
        dq = Tiles(16 if fp32 else min(bm, 32), 16 if fp32 else 32, 8, 2)
        dkv = Tiles(16 if fp32 else 64, 16, 8, 2)
        parts = None
    dq = Tiles(config.dq_block_m or dq.block_m, config.dq_block_n or dq.block_n, config.dq_num_warps or dq.num_warps,
               config.dq_num_stages or dq.num_stages)
    dkv = Tiles(config.dkv_block_m or dkv.block_m, config.dkv_block_n or dkv.block_n,
                config.dkv_num_warps or dkv.num_warps, config.dkv_num_stages or dkv.num_stages)
    blocks = shape.batch * cdiv(shape.cache.capacity, dkv.block_n)
    if config.dkv_splits:
        parts = config.dkv_splits
    elif parts is None:
        parts = max(1, min(8, target.num_sms // max(blocks, 1)))
    parts = max(1, min(parts, cdiv(shape.seqlen_q * shape.heads, dkv.block_m)))
    return dq, dkv, parts


def plan_mla_bwd(shape: MLAShape, options: MLAOptions, *, target: Target, has_dlse: bool = False,
                 strides: Optional[dict] = None, config: Optional[MLAConfig] = None,
                 sparse: Optional[bsp.SparseLayout] = None) -> Plan:
    """Plan inputs: dout, q, kv, out, lse, [dlse], [indices], then with ``sparse`` (a BlockMask's layout) its
    arrays by their BlockMask names. ``strides``: "q" / "dout" -> (batch, token, head), "kv" -> (batch, key)
    element strides (default: contiguous); out and lse are the forward's (contiguous). Results: dq (q's
    shape), dkv (kv's shape), both in q's dtype."""
    config = config or active_config(MLAConfig)
    strides = strides or {}
    b, sq, heads, dqk, dv = shape.batch, shape.seqlen_q, shape.heads, shape.head_dim_qk, shape.head_dim_v
    sk = shape.cache.capacity
    bdv, bdr = _widths(shape)
    _check_sparse(shape, options, sparse)
    dq_t, dkv_t, parts = bwd_tiles(shape, target, config)
    dq_t, dkv_t = _mask_tiles(dq_t, sparse, heads), _mask_tiles(dkv_t, sparse, heads)
    present = {"dout": True, "q": True, "kv": True, "out": True, "lse": True, "dlse": has_dlse,
               "indices": shape.sparse, **bsp.present_arrays(sparse, bsp.BWD_ARRAYS)}
    inputs = tuple(n for n, here in present.items() if here)
    q_st = strides.get("q") or contiguous_q_strides(shape.q_shape)
    do_st = strides.get("dout") or contiguous_q_strides(shape.out_shape)
    kv_st = strides.get("kv") or (sk * dqk, dqk)
    o_st = contiguous_q_strides(shape.out_shape)
    dq_st = contiguous_q_strides(shape.q_shape)
    lse_b, lse_h = heads * sq, sq
    idx_st = (sq * shape.topk, shape.topk) if shape.sparse else (0, 0)
    dot = _dot_precision(shape.dtype)
    lse_align = ("LSE_ALIGN", pow2_divisor(lse_b, lse_h))

    pre_m = 64 if target.interpret else max(16, min(128, 8192 // bdv))
    pre_scalars = (("seqlen_q", sq), ("total_q", b * sq), *((f"stride_o{d}", s) for d, s in zip("bsh", o_st)),
                   *((f"stride_do{d}", s) for d, s in zip("bsh", do_st)), ("stride_lb", lse_b), ("stride_lh", lse_h))
    preprocess = Launch(
        kernel="flash_attn.kernels_bwd:attn_bwd_preprocess_kernel",
        grid=(cdiv(sq, pre_m), heads, b),
        inputs=("out", "dout", "dlse" if has_dlse else "out", "lse", "lse"),
        scalars=pre_scalars,
        outputs=("delta", "lse2"),
        constexprs=(("DV", dv), ("BLOCK_M", pre_m), ("BLOCK_DV", bdv), ("HAS_DLSE", has_dlse), ("IS_VARLEN", False),
                    ("STRIDE_ALIGN", pow2_divisor(*o_st, *do_st)), lse_align),
        num_warps=4 if target.interpret else 8, num_stages=1)

    common = (("seqlen_q", sq), ("seqlen_k", sk))
    dq_scalars = (*common, ("topk", shape.topk), ("sm_scale", float(options.softmax_scale)),
                  *((f"stride_q{d}", s) for d, s in zip("bsh", q_st)), ("stride_kb", kv_st[0]), ("stride_ks", kv_st[1]),
                  ("stride_ib", idx_st[0]), ("stride_is", idx_st[1]),
                  *((f"stride_do{d}", s) for d, s in zip("bsh", do_st)), ("stride_lb", lse_b), ("stride_lh", lse_h),
                  *((f"stride_dq{d}", s) for d, s in zip("bsh", dq_st)))
    dims = (("HEADS", heads), ("DQK", dqk), ("DV", dv))
    mask_scalars, mask_flags = _mask_args(sparse)
    dq_launch = Launch(
        kernel=f"{_K}:mla_bwd_dq_kernel",
        grid=(row_blocks(shape, dq_t.block_m, sparse), 1, b),
        inputs=("q", "kv", "dout", "lse2", "delta", "indices" if shape.sparse else "q",
                *bsp.mask_inputs(sparse, bsp.FWD_ARRAYS)),
        scalars=dq_scalars + mask_scalars,
        outputs=("dq",),
        constexprs=(*dims, ("BLOCK_M", dq_t.block_m), ("BLOCK_N", dq_t.block_n), ("BLOCK_DV", bdv),
                    ("BLOCK_DR", bdr), ("TOKEN_ROWS", shape.sparse), ("CAUSAL", options.causal),
                    ("SPARSE", shape.sparse), ("DOT_PRECISION", dot),
                    ("QO_ALIGN", pow2_divisor(*q_st, *do_st, *dq_st)), ("KV_ALIGN", pow2_divisor(*kv_st)),
                    lse_align, *mask_flags),
        num_warps=dq_t.num_warps, num_stages=dq_t.num_stages)

    launches = [preprocess, dq_launch]
    buffers = [Spec("delta", shape.lse_shape, "float32"), Spec("lse2", shape.lse_shape, "float32"),
               Spec("dq", shape.q_shape, shape.dtype)]
    n_words = cdiv(sk, 32)
    if shape.sparse:
        buffers.append(Spec("bitmap", (b, sq, n_words), "int32", zero=True))
        launches.append(Launch(
            kernel=f"{_K}:mla_index_bitmap_kernel",
            grid=(sq, b),
            inputs=("indices",),
            scalars=(*common, ("topk", shape.topk), ("stride_ib", idx_st[0]), ("stride_is", idx_st[1]),
                     ("n_words", n_words)),
            outputs=("bitmap",),
            constexprs=(("CAUSAL", options.causal), ("BLOCK", min(1024, next_power_of_2(shape.topk)))),
            num_warps=4, num_stages=1))
    kv_shape = (b, sk, dqk)
    if parts == 1:
        dkv_out, dkv_strides = "dkv", (0, sk * dqk, dqk)
    else:
        dkv_out, dkv_strides = "dkv_parts", (b * sk * dqk, sk * dqk, dqk)
        buffers.append(Spec("dkv_parts", (parts, *kv_shape), "float32"))
    dkv_scalars = (*common, ("n_words", n_words), ("sm_scale", float(options.softmax_scale)),
                   *((f"stride_q{d}", s) for d, s in zip("bsh", q_st)), ("stride_kb", kv_st[0]),
                   ("stride_ks", kv_st[1]), *((f"stride_do{d}", s) for d, s in zip("bsh", do_st)),
                   ("stride_lb", lse_b), ("stride_lh", lse_h), ("stride_mb", sq * n_words), ("stride_ms", n_words),
                   *((f"stride_d{d}", s) for d, s in zip("pbs", dkv_strides)))
    dkv_mask_scalars, _ = _mask_args(sparse, transposed=True)
    launches.append(Launch(
        kernel=f"{_K}:mla_bwd_dkv_kernel",
        grid=(cdiv(sk, dkv_t.block_n) if sparse is None else bsp.sparse_blocks(sk, sparse.kv_block, dkv_t.block_n),
              parts, b),
        inputs=("q", "kv", "dout", "lse2", "delta", "bitmap" if shape.sparse else "q",
                *bsp.mask_inputs(sparse, DKV_MASK_ARRAYS)),
        scalars=dkv_scalars + dkv_mask_scalars,
        outputs=(dkv_out,),
        constexprs=(*dims, ("BLOCK_M", dkv_t.block_m), ("BLOCK_N", dkv_t.block_n), ("BLOCK_DV", bdv),
                    ("BLOCK_DR", bdr), ("CAUSAL", options.causal), ("SPARSE", shape.sparse), ("DOT_PRECISION", dot),
                    ("QO_ALIGN", pow2_divisor(*q_st, *do_st)), ("KV_ALIGN", pow2_divisor(*kv_st, *dkv_strides)),
                    ("LSE_ALIGN", pow2_divisor(lse_b, lse_h, sq * n_words, n_words)), *mask_flags),
        num_warps=dkv_t.num_warps, num_stages=dkv_t.num_stages))
    buffers.append(Spec("dkv", kv_shape, shape.dtype))
    if parts > 1:
        n = b * sk * dqk
        block = 1024
        launches.append(Launch(kernel=f"{_K}:mla_sum_parts_kernel", grid=(cdiv(n, block),), inputs=("dkv_parts",),
                               scalars=(("n_parts", parts), ("n_elements", n)), outputs=("dkv",),
                               constexprs=(("BLOCK", block),), num_warps=4, num_stages=1))
    return Plan(inputs=inputs, buffers=tuple(buffers), launches=tuple(launches), results=("dq", "dkv"))
