"""Plan helpers of the block-sparse attention family (pure Python).

The kernels are the FlashAttention kernels (``flash_attn/kernels_*.py``) with ``BLOCK_SPARSE`` set: they walk
a :class:`flashbridge.masks.BlockMask`'s lists instead of ranges of key (or query) blocks. This module turns
a mask's static description into what their launches need: the arrays to pass (by their BlockMask names),
the runtime scalars that address one (batch, head, block) row of them, the constexprs of the element test,
and tiles that divide the mask's blocks.

Program order: the kernels start query (key) blocks in the mask's ``q_order`` (``kv_order``), longest first,
each mask block's tile-sized parts in turn, so their grids span whole mask blocks (``sparse_blocks``).

Tiles and mask blocks: every kernel tile side must divide the mask block it walks (a listed block is then
an exact number of kernel steps, and a kernel query block lies in one mask query block), so the plan takes
the largest power of two <= the default tile that divides the mask's block: the defaults (128-token masks,
64 / 128-wide tiles) keep their tiles; a 16-token mask runs 16-wide tiles.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

# the BlockMask arrays each kernel reads, in the kernels' argument order
FWD_ARRAYS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_order", "kv_bits_index",
              "bits", "tokens_q", "tokens_k")
BWD_ARRAYS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_order", "kv_bits_index",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "kv_order", "q_bits_index", "bits",
              "tokens_q", "tokens_k")
_BITS_ARRAYS = ("kv_bits_index", "q_bits_index", "bits")
_TOKEN_ARRAYS = ("tokens_q", "tokens_k")
MASK_ARRAY_DTYPE = "int32"


@dataclasses.dataclass(frozen=True)
class SparseLayout:
    """The static description of a BlockMask that plans need (hashable; see flashbridge.masks)."""

    seq_len_q: int
    seq_len_k: int
    q_block: int
    kv_block: int
    batch: int  # the mask's batch extent (1 = shared)
    heads: int  # its head extent (1 = shared)
    max_kv: int  # width of the query-major lists
    max_q: int  # width of the key-major lists
    window_left: Optional[int]
    window_right: Optional[int]
    global_tokens: int
    document: bool
    bits: bool
    tokens_batch: int  # batch extent of tokens_q / tokens_k (0 without them)
    band: bool = False  # exactly the band of (window_left, window_right): see :func:`route_band`

    @property
    def n_q(self) -> int:
        return -(-self.seq_len_q // self.q_block)

    @property
    def n_k(self) -> int:
        return -(-self.seq_len_k // self.kv_block)

    @property
    def causal(self) -> bool:
        """Rows see more keys the later they are (a causal band): programs are then ordered longest first."""
        return self.window_left is None and self.window_right is not None and self.window_right <= 0

    def present(self, name: str) -> bool:
        if name in _BITS_ARRAYS:
            return self.bits
        if name in _TOKEN_ARRAYS:
            return self.tokens_batch > 0
        return True


def layout_of(mask) -> SparseLayout:
    """The SparseLayout of a BlockMask whose arrays may be NumPy, torch or JAX arrays (only shapes are read).
    A mask without arrays is a band whose arrays were left out (see :func:`band_arrays`)."""
    t = mask.terms
    common = dict(seq_len_q=mask.seq_len_q, seq_len_k=mask.seq_len_k, q_block=mask.q_block, kv_block=mask.kv_block,
                  window_left=t.window_left, window_right=t.window_right, global_tokens=t.global_tokens,
                  document=t.document, bits=t.bits)
    if mask.kv_num_blocks is None:
        if not t.has_band or t.has_tokens or t.bits:
            raise ValueError("block_mask: only a band's arrays may be left out (its terms are a window alone)")
        return SparseLayout(**common, batch=1, heads=1, max_kv=0, max_q=0, tokens_batch=0, band=True)
    b, h, _ = tuple(mask.kv_num_blocks.shape)
    return SparseLayout(**common, batch=int(b), heads=int(h), max_kv=int(mask.kv_indices.shape[-1]),
                        max_q=int(mask.q_indices.shape[-1]),
                        tokens_batch=int(mask.tokens_q.shape[0]) if mask.tokens_q is not None else 0,
                        band=bool(getattr(mask, "band", False)))


def route_band(options, sparse: Optional[SparseLayout]):
    """(options, sparse) for the attention plans: a mask that is exactly a band (``causal``,
    ``sliding_window``: a window alone, every block of the band listed and nothing else, shared by batch and
    heads) runs the dense kernels' causal / window iteration -- the same visible keys and element test,
    with block ranges computed instead of lists read (faster on the H200, docs/performance.md) -- so it
    becomes the window of ``options`` and no layout; any other mask is kept. ``options`` is an
    ``AttnOptions`` (window_left / window_right / causal)."""
    if sparse is None or not sparse.band:
        return options, sparse
    return dataclasses.replace(options, causal=sparse.causal, window_left=sparse.window_left,
                               window_right=sparse.window_right), None


def band_arrays(layout: SparseLayout, arrays) -> list:
    """The mask arrays (BlockMask.array_names order) a front-end passes to its op: all None for a band (see
    :func:`route_band`: the plans read none of them, so the mask is not even copied to the device), else
    ``arrays()``, called only then."""
    return [None] * len(BWD_ARRAYS) if layout.band else list(arrays())


def check_layout(layout: SparseLayout, *, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
                 varlen: bool) -> None:
    """A ValueError naming ``block_mask`` unless the mask fits the call."""
    if varlen:
        raise ValueError("block_mask: not supported with packed sequences (cu_seqlens); describe packed "
                         "documents with flashbridge.masks.document instead")
    if (layout.seq_len_q, layout.seq_len_k) != (seqlen_q, seqlen_k):
        raise ValueError(f"block_mask: built for (Sq, Sk) = {(layout.seq_len_q, layout.seq_len_k)}, but q and k "
                         f"have {(seqlen_q, seqlen_k)}")
    if layout.batch not in (1, batch) or layout.heads not in (1, heads_q):
        raise ValueError(f"block_mask: batch / head extents {(layout.batch, layout.heads)} must each be 1 or the "
                         f"call's ({batch}, {heads_q}) (query heads)")
    if layout.tokens_batch not in (0, 1, batch):
        raise ValueError(f"block_mask: token arrays for {layout.tokens_batch} sequences, the call has {batch}")


def check_block_mask(block_mask, shape, options) -> SparseLayout:
    """The layout of a ``flash_attention(..., block_mask=...)`` call's mask after checking it against the
    call's ``AttnShape`` / ``AttnOptions`` (a TypeError / ValueError naming ``block_mask``); both front-ends
    call it before any launch."""
    from ...masks import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a flashbridge.masks.BlockMask, got {type(block_mask).__name__}")
    if options.causal or options.has_local:
        raise ValueError("block_mask: causal / window_size do not combine with a block mask; build the mask you "
                         "mean with flashbridge.masks (e.g. masks.causal(...) & other)")
    layout = layout_of(block_mask)
    check_layout(layout, batch=shape.batch, heads_q=shape.heads_q, seqlen_q=shape.seqlen_q,
                 seqlen_k=shape.seqlen_k, varlen=shape.varlen)
    return layout


def sparse_tile(tile: int, block: int) -> int:
    """The largest power of two <= ``tile`` that divides ``block`` (a multiple of 16, so >= 16)."""
    while block % tile:
        tile //= 2
    return tile


def head_group(configured: Optional[int], layout: SparseLayout, interpret: bool, *, query_major: bool = False) -> int:
    """The kernels' HEAD_GROUP for a block-sparse mask (see ``block_schedule`` in kernels_common): the
    configured value, else 1 in the interpreter, 4 for a causal band (as the dense causal kernels, timed on
    the H200), and 16 otherwise: with ranks in the mask's longest-first order, rank 0 of 16 (head, sequence)
    pairs starts before rank 1 of any, so the longest programs of every head (a BigBird global row visits
    every key block) start first instead of running on alone at the end of the grid.

    ``query_major`` (the forward: one program per query block): when a window bounds every row on both
    sides and the only other term is sinks (StreamingLLM), the rows are all about as long, so there is no
    long program to start first and grouping only spreads each head's K / V over L2: 1 (H200, streaming
    4 + 1024 at S=16384: 1.5-2% faster; its key-major backward keeps 16, whose sink column is the longest)."""
    if configured is not None:
        return configured
    if interpret:
        return 1
    if (query_major and layout.window_left is not None and layout.window_right is not None
            and layout.global_tokens != 2 and not layout.document):
        return 1
    return 4 if layout.causal else 16


def sparse_blocks(seq_len: int, block: int, tile: int) -> int:
    """Programs along a grid axis that walks ``seq_len`` in ``tile`` steps inside mask blocks of ``block``:
    whole mask blocks (programs past the sequence return at once)."""
    return -(-seq_len // block) * (block // tile)


def mask_inputs(layout: Optional[SparseLayout], names: tuple[str, ...], placeholder: str = "q") -> tuple[str, ...]:
    """The plan's input names for the kernels' mask arguments (``names``): the BlockMask array names, or
    ``placeholder`` (a pointer never read) where the mask lacks the array or there is no mask."""
    return tuple(n if layout is not None and layout.present(n) else placeholder for n in names)


def present_arrays(layout: Optional[SparseLayout], names: tuple[str, ...]) -> dict[str, bool]:
    return {n: layout is not None and layout.present(n) for n in names}


def mask_scalars(layout: Optional[SparseLayout], *, backward: bool) -> tuple[tuple[str, int], ...]:
    """Runtime scalars addressing a (batch, head, block) row of the lists: element strides of the count
    arrays over batch and heads (0 where the mask is shared), the lists' widths, and the token arrays'
    batch stride. Zeros without a mask."""
    if layout is None:
        fwd = (("mask_stride_b", 0), ("mask_stride_h", 0), ("mask_max", 0))
        bwd = (("mask_t_stride_b", 0), ("mask_t_stride_h", 0), ("mask_t_max", 0))
        return (*fwd, *bwd, ("tok_stride_b", 0)) if backward else (*fwd, ("tok_stride_b", 0))
    hb = layout.heads if layout.heads > 1 else 0
    fwd = (("mask_stride_b", layout.heads * layout.n_q if layout.batch > 1 else 0),
           ("mask_stride_h", layout.n_q if hb else 0), ("mask_max", layout.max_kv))
    bwd = (("mask_t_stride_b", layout.heads * layout.n_k if layout.batch > 1 else 0),
           ("mask_t_stride_h", layout.n_k if hb else 0), ("mask_t_max", layout.max_q))
    tok = (("tok_stride_b", layout.seq_len_q if layout.tokens_batch > 1 else 0),)
    return (*fwd, *bwd, *tok) if backward else (*fwd, *tok)


def mask_constexprs(layout: Optional[SparseLayout], *, backward: bool,
                    group: int = 1) -> tuple[tuple[str, object], ...]:
    """BLOCK_SPARSE and the element test's constexprs (see ``block_mask_visible`` in kernels_common); the
    backward also gets MASK_PER_HEAD (the dK/dV loop walks each query head's lists), MASK_RAGGED_Q (the
    last query block reaches past the sequence: partial query blocks then load with row checks) and
    MASK_GROUP_P2 (the GQA ``group`` rounded up to a power of two: the per-head lists' running sums)."""
    if layout is None:
        out = (("BLOCK_SPARSE", False), ("MASK_QB", 16), ("MASK_KB", 16), ("MASK_GLOBAL", 0), ("MASK_DOC", False),
               ("MASK_BITS", False))
        return (*out, ("MASK_PER_HEAD", False), ("MASK_RAGGED_Q", False), ("MASK_GROUP_P2", 1)) if backward else out
    out = (("BLOCK_SPARSE", True), ("MASK_QB", layout.q_block), ("MASK_KB", layout.kv_block),
           ("MASK_GLOBAL", layout.global_tokens), ("MASK_DOC", layout.document), ("MASK_BITS", layout.bits))
    if backward:
        out += (("MASK_PER_HEAD", layout.heads > 1), ("MASK_RAGGED_Q", layout.seq_len_q % layout.q_block != 0),
                ("MASK_GROUP_P2", 1 << max(group - 1, 0).bit_length()))
    return out
