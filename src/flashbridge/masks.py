"""Block-sparse attention masks: framework-neutral (NumPy) builders of :class:`BlockMask`.

A BlockMask tells the attention kernels, for every block of ``q_block`` queries, which blocks of ``kv_block``
keys to visit: *full* blocks, where every query sees every key (the kernel applies no element mask there),
and *partial* ones, where an element mask decides. It also carries the transposed lists (per key block, the
query blocks that see it) for the backward's key-major dK/dV loop. Every list is built once, here, when the
mask is built (vectorised NumPy: milliseconds at S = 128k), never when attention is called.

The element mask of a partial block is the AND of the mask's *terms*, each in the form the kernels evaluate
cheapest (``diag = Sk - Sq``; query ``i``, key ``j``; always ``j < Sk``):

* band: ``i + diag - left <= j <= i + diag + right`` (causal: left unbounded, right 0; sliding windows);
* global tokens, OR-ed with the band: the first ``tokens_q >> 1`` keys (flagged in ``tokens_k``) bounded by
  the band's right edge (``global_tokens=1``: attention sinks), or queries and keys flagged in ``tokens_q``
  / ``tokens_k`` (``global_tokens=2``: Longformer);
* document: the same document, i.e. ``tokens_q[i] >> 1 <= j <= tokens_k[i] >> 1`` (the first and the last
  position of query i's document; queries and keys are the same positions);
* bits: one bit per (query, key) of each partial block, in int32 words (``from_dense``, ``a | b``).

Layout (FlexAttention's BlockMask, with full and partial lists padded to one common length)::

    kv_num_blocks, full_kv_num_blocks   int32 (B|1, H|1, nQ)          partial / full key blocks per query block
    kv_indices, full_kv_indices         int32 (B|1, H|1, nQ, max_kv)  their indices, ascending
    q_num_blocks, full_q_num_blocks     int32 (B|1, H|1, nK)          the transposed lists
    q_indices, full_q_indices           int32 (B|1, H|1, nK, max_q)
    q_order, kv_order                   int32 (B|1, H|1, nQ) / (B|1, H|1, nK): query (key) blocks by decreasing
                                        number of visited blocks, the order the kernels start them in
    bits                                int32 (n_bits, q_block * kv_block // 32) or None; element (r, c) of a
                                        block is bit (r * kv_block + c) % 32 of word (r * kv_block + c) // 32
    kv_bits_index, q_bits_index         int32, shaped as kv_indices / q_indices: each partial entry's row of bits
    tokens_q, tokens_k                  int32 (B|1, Sq) / (B|1, Sk) or None: bit 0 = global; bits 1.. = the
                                        sink count (tokens_q), or each token's document's first (tokens_q) /
                                        last (tokens_k) position: the kernels read them once per program,
                                        never per step

A block is full only if it lies wholly inside the sequences (a ragged last block is partial): the kernels
then load full blocks without bounds checks.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ._extras import require

__all__ = ["BlockMask", "MaskTerms", "bigbird", "causal", "document", "from_blocks", "from_dense", "longformer",
           "sliding_window", "streaming"]

NONE, PARTIAL, FULL = 0, 1, 2  # block status


@dataclasses.dataclass(frozen=True)
class MaskTerms:
    """The static (hashable) part of a mask's element test on partial blocks; see the module docstring.
    ``window_left`` / ``window_right``: the band's sides from the bottom-right diagonal (None: unbounded)."""

    window_left: Optional[int] = None
    window_right: Optional[int] = None
    global_tokens: int = 0
    document: bool = False
    bits: bool = False

    @property
    def has_band(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @property
    def has_tokens(self) -> bool:
        return bool(self.global_tokens or self.document)

    @property
    def block_granular(self) -> bool:
        """No term but the sequence bounds: partial blocks are only ragged edges."""
        return not (self.has_band or self.has_tokens or self.bits)

    def describe(self) -> str:
        parts = []
        if self.has_band:
            parts.append(f"band(left={self.window_left}, right={self.window_right})")
        if self.global_tokens:
            parts.append("sinks" if self.global_tokens == 1 else "global")
        if self.document:
            parts.append("document")
        if self.bits:
            parts.append("bits")
        return " & ".join(parts) or "blocks"


_ARRAYS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
           "full_q_num_blocks", "full_q_indices", "q_order", "kv_order", "kv_bits_index", "q_bits_index", "bits",
           "tokens_q", "tokens_k")


class BlockMask:
    """Which (query block, key block) pairs attention visits, and the element mask of partial ones.

    Build one with the functions of this module (``causal``, ``sliding_window``, ``streaming``, ``document``,
    ``longformer``, ``bigbird``, ``from_blocks``, ``from_dense``) and pass it to ``flash_attention(...,
    block_mask=...)`` of either front-end. ``a & b`` and ``a | b`` combine masks exactly.

    Attributes: the arrays listed in the module docstring (NumPy, or JAX arrays / tracers inside a JAX
    transformation: the JAX front-end registers BlockMask as a pytree of them), ``seq_len_q``, ``seq_len_k``,
    ``block_size`` ``(q_block, kv_block)``, ``terms`` (:class:`MaskTerms`) and ``band``: True when the mask is
    exactly the band of its terms (``causal``, ``sliding_window``, and ``&`` / ``|`` results equal to one),
    shared by batch and heads; flash_attention then runs the dense kernel's causal / window iteration, which
    walks no lists (the same results, faster).

    Example::

        >>> m = causal(1000, block_size=128) & sliding_window(1000, 256)
        >>> m.shape, round(m.density, 3)
        ((1, 1, 1000, 1000), 0.328)
    """

    __slots__ = (*_ARRAYS, "seq_len_q", "seq_len_k", "q_block", "kv_block", "terms", "band", "_cache")

    def __init__(self, *, seq_len_q: int, seq_len_k: int, q_block: int, kv_block: int, terms: MaskTerms,
                 band: bool = False, **arrays):
        self.seq_len_q, self.seq_len_k = seq_len_q, seq_len_k
        self.q_block, self.kv_block = q_block, kv_block
        self.terms = terms
        # static: the mask is exactly its band -- every block of the band listed, nothing else, shared by
        # batch and heads (set when built; the attention plans then run the dense kernel's window path)
        self.band = bool(band)
        for name in _ARRAYS:
            setattr(self, name, arrays.pop(name, None))
        if arrays:
            raise TypeError(f"BlockMask: unknown arrays {sorted(arrays)}")
        if terms.document and (seq_len_q != seq_len_k or terms.global_tokens == 1):
            raise ValueError("BlockMask: a document term needs seq_len_q == seq_len_k and no sinks (its token "
                             "words hold document bounds), combine such masks with & instead")
        if terms.global_tokens == 1 and type(self.tokens_q) is np.ndarray and type(self.tokens_k) is np.ndarray:
            # The query-major kernels test the sink count (tokens_q), the key-major ones each key's flag
            # (tokens_k): the two must say the same (arrays of a JAX or torch transformation are not read here).
            count = self.tokens_q >> 1
            flags = (self.tokens_k & 1) != 0
            if (count != count[:, :1]).any() or (flags != (np.arange(seq_len_k) < count[:, :1])).any():
                raise ValueError("BlockMask: sinks need one count in tokens_q (>> 1) and exactly the keys below it "
                                 "flagged in tokens_k (bit 0), as masks.streaming builds them")
        self._cache = {}  # per-framework device copies (front-ends), the block status grid

    # ---------------------------------------------------------------------------------------- properties

    arrays = property(lambda self: tuple(getattr(self, n) for n in _ARRAYS),
                      doc="The arrays in a fixed order (None where absent).")
    array_names = _ARRAYS

    @property
    def block_size(self) -> tuple[int, int]:
        return (self.q_block, self.kv_block)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B|1, H|1, Sq, Sk)``: the batch and head extents are 1 when the mask is shared."""
        b, h = self.kv_num_blocks.shape[:2]
        return (int(b), int(h), self.seq_len_q, self.seq_len_k)

    @property
    def num_blocks(self) -> tuple[int, int]:
        """(nQ, nK): query and key blocks."""
        return (_cdiv(self.seq_len_q, self.q_block), _cdiv(self.seq_len_k, self.kv_block))

    @property
    def density(self) -> float:
        """Visited (query block, key block) pairs / all pairs, averaged over batch and heads: the fraction of
        dense attention's block work the kernels do."""
        n_q, n_k = self.num_blocks
        visited = np.asarray(self.kv_num_blocks, np.int64) + np.asarray(self.full_kv_num_blocks, np.int64)
        return float(visited.sum()) / (visited.size * n_k) if visited.size else 0.0

    def __repr__(self) -> str:
        b, h, sq, sk = self.shape
        try:
            n_full = int(np.asarray(self.full_kv_num_blocks).sum())
            n_part = int(np.asarray(self.kv_num_blocks).sum())
            stats = f", density={self.density:.3f}, full={n_full}, partial={n_part}"
        except Exception:  # traced arrays
            stats = ""
        return (f"BlockMask(shape={(b, h, sq, sk)}, block_size={self.block_size}{stats}, "
                f"elements={self.terms.describe()})")

    def device_arrays(self, key, convert) -> tuple:
        """:attr:`arrays` converted by ``convert`` (None stays None) once per ``key`` -- a front-end and a
        device -- and kept on the mask: the host-to-device copy happens once per mask, not once per call."""
        got = self._cache.get(("arrays", key))
        if got is None:
            got = tuple(None if a is None else convert(a) for a in self.arrays)
            self._cache[("arrays", key)] = got
        return got

    # ------------------------------------------------------------------------------------------ views

    def status(self) -> np.ndarray:
        """int8 ``(B|1, H|1, nQ, nK)``: 0 not visited, 1 partial, 2 full (built from the lists, cached)."""
        if "status" not in self._cache:
            n_q, n_k = self.num_blocks
            b, h = self.shape[:2]
            grid = np.zeros((b, h, n_q, n_k), np.int8)
            for num, idx, value in ((self.kv_num_blocks, self.kv_indices, PARTIAL),
                                    (self.full_kv_num_blocks, self.full_kv_indices, FULL)):
                bi, hi, qi, slot = np.nonzero(np.arange(np.shape(idx)[-1]) < np.asarray(num)[..., None])
                grid[bi, hi, qi, np.asarray(idx)[bi, hi, qi, slot]] = value
            self._cache["status"] = grid
        return self._cache["status"]

    def _bit_ids(self) -> Optional[np.ndarray]:
        """int32 ``(B|1, H|1, nQ, nK)``: the row of ``bits`` of each partial block (-1 elsewhere)."""
        if not self.terms.bits:
            return None
        if "bit_ids" not in self._cache:
            grid = np.full(self.status().shape, -1, np.int32)
            num, idx = np.asarray(self.kv_num_blocks), np.asarray(self.kv_indices)
            bi, hi, qi, slot = np.nonzero(np.arange(idx.shape[-1]) < num[..., None])
            grid[bi, hi, qi, idx[bi, hi, qi, slot]] = np.asarray(self.kv_bits_index)[bi, hi, qi, slot]
            self._cache["bit_ids"] = grid
        return self._cache["bit_ids"]

    def block_values(self, b, h, qb, kb) -> np.ndarray:
        """Exact element values of blocks ``(b, h, qb, kb)`` (int arrays of one length n, in the mask's own
        batch / head extents): bool ``(n, q_block, kv_block)``, False outside the sequences."""
        status = self.status()[b, h, qb, kb]
        out = np.zeros((len(status), self.q_block, self.kv_block), bool)
        full, part = status == FULL, status == PARTIAL
        if full.any():
            out[full] = _bounds(self, qb[full], kb[full])
        if part.any():
            ids = None if not self.terms.bits else self._bit_ids()[b[part], h[part], qb[part], kb[part]]
            out[part] = _term_values(self, b[part], qb[part], kb[part], ids)
        return out

    def to_dense(self) -> np.ndarray:
        """bool ``(B|1, H|1, Sq, Sk)``: query i sees key j (the mask as attention applies it)."""
        status = self.status()
        b, h, n_q, n_k = status.shape
        qb_, kb_ = self.q_block, self.kv_block
        dense = np.zeros((b, h, n_q, qb_, n_k, kb_), bool)
        dense |= (status == FULL)[:, :, :, None, :, None]
        bi, hi, qi, ki = np.nonzero(status == PARTIAL)
        if len(bi):
            ids = None if not self.terms.bits else self._bit_ids()[bi, hi, qi, ki]
            dense[bi, hi, qi, :, ki, :] = _term_values(self, bi, qi, ki, ids)
        return dense.reshape(b, h, n_q * qb_, n_k * kb_)[:, :, :self.seq_len_q, :self.seq_len_k]

    # ------------------------------------------------------------------------------------ combinations

    def __and__(self, other: "BlockMask") -> "BlockMask":
        return _combine(self, other, union=False)

    def __or__(self, other: "BlockMask") -> "BlockMask":
        return _combine(self, other, union=True)

    # -------------------------------------------------------------------------------------- pictures

    def picture(self, b: int = 0, h: int = 0, max_cells: int = 64) -> str:
        """The block grid of (batch b, head h) as text: '█' full, '▒' partial, '·' not visited; grids wider
        than ``max_cells`` are shown coarser (a cell shows the most-visited block it covers)."""
        grid = self.status()[min(b, self.shape[0] - 1), min(h, self.shape[1] - 1)]
        step = max(1, _cdiv(max(grid.shape), max_cells))
        if step > 1:
            n_q, n_k = _cdiv(grid.shape[0], step), _cdiv(grid.shape[1], step)
            padded = np.zeros((n_q * step, n_k * step), np.int8)
            padded[:grid.shape[0], :grid.shape[1]] = grid
            grid = padded.reshape(n_q, step, n_k, step).max(axis=(1, 3))
        chars = np.array(["·", "▒", "█"])
        rows = ["".join(r) for r in chars[grid]]
        head = (f"{self!r}\nbatch {b}, head {h}: {grid.shape[0]} x {grid.shape[1]} cells of {step} x {step} "
                f"blocks ({self.q_block} x {self.kv_block} tokens each)")
        return head + "\n" + "\n".join(rows)

    def show(self, b: int = 0, h: int = 0, max_cells: int = 64) -> None:
        """Print :meth:`picture`."""
        print(self.picture(b, h, max_cells))

    def plot(self, b: int = 0, h: int = 0, ax=None):
        """Draw the block grid of (batch b, head h) with matplotlib (full, partial, not visited); returns the
        axes."""
        plt = require("matplotlib.pyplot", "bench", "BlockMask.plot")
        ListedColormap = require("matplotlib.colors", "bench", "BlockMask.plot").ListedColormap

        if ax is None:
            _, ax = plt.subplots(figsize=(5, 5))
        grid = self.status()[min(b, self.shape[0] - 1), min(h, self.shape[1] - 1)]
        ax.imshow(grid, cmap=ListedColormap(["white", "tab:orange", "tab:blue"]), vmin=0, vmax=2,
                  interpolation="nearest")
        ax.set_title(f"{self.terms.describe()}, density {self.density:.3f}", fontsize=9)
        ax.set_xlabel(f"key block ({self.kv_block} keys)")
        ax.set_ylabel(f"query block ({self.q_block} queries)")
        return ax


# ------------------------------------------------------------------------------------------ construction

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_sizes(block_size) -> tuple[int, int]:
    if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
        sizes = (int(block_size), int(block_size))
    else:
        try:
            sizes = tuple(int(s) for s in block_size)
        except TypeError:
            sizes = ()
        if len(sizes) != 2:
            raise ValueError(f"block_size: expected an int or a pair (q_block, kv_block), got {block_size!r}")
    for s in sizes:
        if s < 16 or s % 16:
            raise ValueError(f"block_size: each side must be a positive multiple of 16 (the smallest tile of "
                             f"the kernels), got {block_size!r}")
    return sizes


def _seq_len(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)


def _lists(grid: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR-like lists of a bool grid ``(..., n, m)``: counts ``(..., n)`` and ascending column indices
    ``(..., n, width)`` (zero-padded)."""
    lead, m = grid.shape[:-1], grid.shape[-1]
    flat = grid.reshape(-1, m)
    num = flat.sum(axis=1)
    idx = np.zeros((flat.shape[0], width), np.int32)
    rows, cols = np.nonzero(flat)  # row-major: each row's columns ascending
    starts = np.cumsum(num) - num
    idx[rows, np.arange(len(rows)) - starts[rows]] = cols
    return num.astype(np.int32).reshape(lead), idx.reshape(*lead, width)


def _longest_first(work: np.ndarray, *, later_first: bool) -> np.ndarray:
    """Block indices ``(..., n)`` by decreasing ``work`` (visited blocks), ties by decreasing (``later_first``)
    or increasing index: the order the kernels start their programs in, so that the longest ones do not run
    on alone at the end (a BigBird global row visits every block). Causal masks keep the dense kernels'
    order: the last query block and the first key block first."""
    n = work.shape[-1]
    index = np.arange(n) if later_first else n - 1 - np.arange(n)
    return np.argsort(-(work.astype(np.int64) * n + index), axis=-1, kind="stable").astype(np.int32)


def _build(status: np.ndarray, *, seq_len_q: int, seq_len_k: int, q_block: int, kv_block: int, terms: MaskTerms,
           bits: Optional[np.ndarray] = None, tokens_q=None, tokens_k=None, full_width: bool = False,
           band: Optional[bool] = None) -> BlockMask:
    """A BlockMask from its block status grid ``(B|1, H|1, nQ, nK)`` (0 / 1 partial / 2 full). ``bits``:
    bool ``(n, q_block, kv_block)``, the element values of the partial blocks in ``np.nonzero`` order.
    ``full_width``: lists as wide as the grid (nK / nQ), whatever the counts, so that every such mask of one
    size has the same array shapes. ``band``: whether the grid is exactly its band's (None: compared)."""
    status = np.ascontiguousarray(status, np.int8)
    if band is None:
        band = _is_band(status, terms, seq_len_q, seq_len_k, q_block, kv_block)
    partial, full = status == PARTIAL, status == FULL
    partial_t, full_t = partial.swapaxes(-1, -2), full.swapaxes(-1, -2)
    if full_width:
        width_q, width_kv = status.shape[-2:]
    else:
        width_kv = max(1, int((partial.sum(-1)).max(initial=0)), int(full.sum(-1).max(initial=0)))
        width_q = max(1, int(partial_t.sum(-1).max(initial=0)), int(full_t.sum(-1).max(initial=0)))
    arrays = {}
    arrays["kv_num_blocks"], arrays["kv_indices"] = _lists(partial, width_kv)
    arrays["full_kv_num_blocks"], arrays["full_kv_indices"] = _lists(full, width_kv)
    arrays["q_num_blocks"], arrays["q_indices"] = _lists(partial_t, width_q)
    arrays["full_q_num_blocks"], arrays["full_q_indices"] = _lists(full_t, width_q)
    arrays["q_order"] = _longest_first(arrays["kv_num_blocks"] + arrays["full_kv_num_blocks"], later_first=True)
    arrays["kv_order"] = _longest_first(arrays["q_num_blocks"] + arrays["full_q_num_blocks"], later_first=False)
    if terms.bits:
        ids = np.full(status.shape, -1, np.int32)
        ids[partial] = np.arange(int(partial.sum()), dtype=np.int32)
        b_, h_, q_ = np.indices(arrays["kv_indices"].shape[:-1])
        arrays["kv_bits_index"] = np.ascontiguousarray(
            ids[b_[..., None], h_[..., None], q_[..., None], arrays["kv_indices"]].clip(0))
        b_, h_, k_ = np.indices(arrays["q_indices"].shape[:-1])
        arrays["q_bits_index"] = np.ascontiguousarray(
            ids[b_[..., None], h_[..., None], arrays["q_indices"], k_[..., None]].clip(0))
        words = q_block * kv_block // 32
        if bits is None or not len(bits):
            arrays["bits"] = np.zeros((1, words), np.int32)  # no partial block: one row, never read
        else:
            packed = np.packbits(bits.reshape(len(bits), -1), axis=1, bitorder="little")
            arrays["bits"] = np.ascontiguousarray(packed).view("<u4").astype(np.int32).reshape(len(bits), words)
    if terms.has_tokens:
        arrays["tokens_q"] = np.ascontiguousarray(tokens_q, np.int32)
        arrays["tokens_k"] = np.ascontiguousarray(tokens_k, np.int32)
    mask = BlockMask(seq_len_q=seq_len_q, seq_len_k=seq_len_k, q_block=q_block, kv_block=kv_block, terms=terms,
                     band=band, **arrays)
    mask._cache["status"] = status
    return mask


def _is_band(status, terms: MaskTerms, seq_len_q, seq_len_k, q_block, kv_block) -> bool:
    """The grid (shared by batch and heads) is exactly the band of ``terms``, which hold a band alone."""
    if not terms.has_band or terms.has_tokens or terms.bits or status.shape[:2] != (1, 1):
        return False
    lo, hi = _band_bounds(seq_len_q, seq_len_k, terms.window_left, terms.window_right)
    return bool(np.array_equal(status[0, 0], _status_grid(*_interval_status(lo, hi, seq_len_q, seq_len_k, q_block,
                                                                             kv_block))))


def _block_edges(seq_len_q, seq_len_k, q_block, kv_block):
    """Per query block: first / last valid row and completeness; per key block the same for keys."""
    n_q, n_k = _cdiv(seq_len_q, q_block), _cdiv(seq_len_k, kv_block)
    r0 = np.arange(n_q, dtype=np.int64) * q_block
    c0 = np.arange(n_k, dtype=np.int64) * kv_block
    r1 = np.minimum(r0 + q_block, seq_len_q) - 1
    c1 = np.minimum(c0 + kv_block, seq_len_k) - 1
    return r0, r1, r0 + q_block <= seq_len_q, c0, c1, c0 + kv_block <= seq_len_k


def _interval_status(lo, hi, seq_len_q, seq_len_k, q_block, kv_block):
    """(any, full) bool ``(nQ, nK)`` for the mask "query i sees keys lo[i] <= j <= hi[i]" with ``lo`` and
    ``hi`` non-decreasing (clipped to [0, Sk] and [-1, Sk - 1]): bands, causal, documents. Exact: a block
    is visited iff one of its queries sees one of its keys, and full iff it is complete and all do."""
    r0, r1, rows_whole, c0, c1, cols_whole = _block_edges(seq_len_q, seq_len_k, q_block, kv_block)
    first = np.searchsorted(hi, c0, side="left")  # first query whose interval ends at or after the block start
    last = np.searchsorted(lo, c1, side="right") - 1  # last query whose interval starts at or before its end
    any_ = np.maximum(r0[:, None], first[None, :]) <= np.minimum(r1[:, None], last[None, :])
    full = ((lo[r1][:, None] <= c0[None, :]) & (hi[r0][:, None] >= c1[None, :])
            & rows_whole[:, None] & cols_whole[None, :])
    return any_, full & any_


def _band_bounds(seq_len_q, seq_len_k, left, right):
    """Per-query visible key interval [lo, hi] of a band (None = unbounded side), clipped."""
    i = np.arange(seq_len_q, dtype=np.int64) + (seq_len_k - seq_len_q)
    lo = np.zeros(seq_len_q, np.int64) if left is None else np.clip(i - left, 0, seq_len_k)
    hi = np.full(seq_len_q, seq_len_k - 1, np.int64) if right is None else np.clip(i + right, -1, seq_len_k - 1)
    return lo, hi


def _status_grid(any_, full):
    return np.where(full, FULL, np.where(any_, PARTIAL, NONE)).astype(np.int8)


def _band_mask(seq_len_q, seq_len_k, left, right, block_size):
    q_block, kv_block = _block_sizes(block_size)
    lo, hi = _band_bounds(seq_len_q, seq_len_k, left, right)
    any_, full = _interval_status(lo, hi, seq_len_q, seq_len_k, q_block, kv_block)
    return _build(_status_grid(any_, full)[None, None], seq_len_q=seq_len_q, seq_len_k=seq_len_k,
                  q_block=q_block, kv_block=kv_block, terms=MaskTerms(window_left=left, window_right=right), band=True)


# --------------------------------------------------------------------------------------------- builders

def causal(seq_len_q: int, seq_len_k: Optional[int] = None, *, block_size=128) -> BlockMask:
    """Query i sees keys ``j <= i + Sk - Sq`` (bottom-right aligned, as ``flash_attention(causal=True)``).

    Example::

        >>> causal(4096).density   # 32 query blocks: 528 of 1024 block pairs
        0.515625
    """
    seq_len_q = _seq_len("seq_len_q", seq_len_q)
    seq_len_k = seq_len_q if seq_len_k is None else _seq_len("seq_len_k", seq_len_k)
    return _band_mask(seq_len_q, seq_len_k, None, 0, block_size)


def sliding_window(seq_len: int, left: int, right: int = 0, *, block_size=128) -> BlockMask:
    """Query i sees keys ``i - left <= j <= i + right`` (``right = 0``: causal sliding window).

    Example::

        >>> sliding_window(16384, 1024).density < 0.1
        True
    """
    seq_len = _seq_len("seq_len", seq_len)
    for name, side in (("left", left), ("right", right)):
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"{name}: expected an int, got {type(side).__name__}")
    if left < 0 or right < -left:
        raise ValueError(f"left, right: need left >= 0 and left + right >= 0 (a non-empty window), got "
                         f"left={left}, right={right}")
    return _band_mask(seq_len, seq_len, int(left), int(right), block_size)


def streaming(seq_len: int, num_sink: int, window: int, *, block_size=128) -> BlockMask:
    """StreamingLLM: query i sees keys ``j <= i`` with ``j < num_sink`` (the attention sinks) or
    ``j >= i - window``.

    Example::

        >>> m = streaming(16384, 4, 1024)   # 4 sinks + the last 1024 keys
    """
    seq_len = _seq_len("seq_len", seq_len)
    for name, value in (("num_sink", num_sink), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    q_block, kv_block = _block_sizes(block_size)
    lo, hi = _band_bounds(seq_len, seq_len, int(window), 0)
    any_band, full_band = _interval_status(lo, hi, seq_len, seq_len, q_block, kv_block)
    sink_hi = np.minimum(hi, num_sink - 1)
    any_sink, _ = _interval_status(np.zeros_like(lo), sink_hi, seq_len, seq_len, q_block, kv_block)
    r0, r1, rows_whole, c0, c1, cols_whole = _block_edges(seq_len, seq_len, q_block, kv_block)
    # full: every key of the block at or before the block's first query, and each key a sink or inside the
    # window of the block's last query (the narrowest one)
    start = np.maximum(c0[None, :], num_sink)
    covered = (start >= lo[r1][:, None]) | (start > c1[None, :])
    full = ((hi[r0][:, None] >= c0[None, :] + kv_block - 1) & covered & rows_whole[:, None] & cols_whole[None, :])
    any_ = any_band | any_sink
    tokens_k = (np.arange(seq_len) < num_sink).astype(np.int32)[None]
    tokens_q = np.full_like(tokens_k, int(num_sink) << 1)  # the sink count, for the query-major kernels
    return _build(_status_grid(any_, full & any_)[None, None], seq_len_q=seq_len, seq_len_k=seq_len,
                  q_block=q_block, kv_block=kv_block,
                  terms=MaskTerms(window_left=int(window), window_right=0, global_tokens=1),
                  tokens_q=tokens_q, tokens_k=tokens_k)


def document(segment_lengths, *, causal: bool = True, block_size=128) -> BlockMask:
    """Packed documents: query i sees key j iff both lie in the same segment (and ``j <= i`` when causal).

    ``segment_lengths``: the lengths of the consecutive segments of one sequence, or one such list per batch
    entry (the same total each; the mask is then per batch).

    Example::

        >>> m = document([100, 3000, 900, 96])   # one sequence of 4096 tokens, 4 documents
        >>> m.shape
        (1, 1, 4096, 4096)
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")

    def ints(row):
        row = np.asarray(row)
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.integer) or (row < 0).any():
            raise ValueError("segment_lengths: expected a sequence of ints >= 0 (or one such sequence per batch "
                             f"entry), got {segment_lengths!r}")
        return row.astype(np.int64)

    try:
        nested = len(segment_lengths) > 0 and all(np.ndim(r) == 1 for r in segment_lengths)
        rows = [ints(r) for r in segment_lengths] if nested else [ints(segment_lengths)]
    except TypeError:
        raise ValueError(f"segment_lengths: expected a sequence of ints, got {segment_lengths!r}") from None
    totals = np.array([r.sum() for r in rows])
    if totals.min() < 1 or (totals != totals[0]).any():
        raise ValueError(f"segment_lengths: every batch entry must cover the same number (>= 1) of tokens, got "
                         f"totals {totals.tolist()}")
    seq_len = int(totals[0])
    q_block, kv_block = _block_sizes(block_size)
    grids, tokens_q, tokens_k = [], [], []
    for row in rows:
        ends = np.cumsum(row)
        doc = np.repeat(np.arange(len(row), dtype=np.int64), row)
        starts = ends - row
        lo = starts[doc]
        hi = np.arange(seq_len, dtype=np.int64) if causal else ends[doc] - 1
        grids.append(_status_grid(*_interval_status(lo, hi, seq_len, seq_len, q_block, kv_block)))
        tokens_q.append((starts[doc] << 1).astype(np.int32))  # each token's document: its first position
        tokens_k.append(((ends[doc] - 1) << 1).astype(np.int32))  # and its last
    return _build(np.stack(grids)[:, None], seq_len_q=seq_len, seq_len_k=seq_len, q_block=q_block,
                  kv_block=kv_block, terms=MaskTerms(window_right=0 if causal else None, document=True),
                  tokens_q=np.stack(tokens_q), tokens_k=np.stack(tokens_k))


def _blocks_any_all(flags: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block of ``block`` tokens: any flag set, and all set with the block complete."""
    n = _cdiv(len(flags), block)
    padded = np.zeros(n * block, bool)
    padded[:len(flags)] = flags
    padded = padded.reshape(n, block)
    return padded.any(axis=1), padded.all(axis=1)


def longformer(seq_len: int, window: int, global_tokens, *, block_size=128) -> BlockMask:
    """Longformer: query i sees key j iff ``|i - j| <= window``, or i or j is one of ``global_tokens``
    (positions; global tokens see and are seen by every token).

    Example::

        >>> m = longformer(4096, 256, [0, 1, 2, 3])
    """
    seq_len = _seq_len("seq_len", seq_len)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"window: expected an int >= 0, got {window!r}")
    positions = np.asarray(global_tokens, dtype=np.int64).reshape(-1)
    if ((positions < 0) | (positions >= seq_len)).any():
        raise ValueError(f"global_tokens: positions must lie in [0, {seq_len}), got {positions.tolist()}")
    q_block, kv_block = _block_sizes(block_size)
    flags = np.zeros(seq_len, bool)
    flags[positions] = True
    lo, hi = _band_bounds(seq_len, seq_len, int(window), int(window))
    any_, full = _interval_status(lo, hi, seq_len, seq_len, q_block, kv_block)
    rows_any, rows_all = _blocks_any_all(flags, q_block)
    cols_any, cols_all = _blocks_any_all(flags, kv_block)
    any_ = any_ | rows_any[:, None] | cols_any[None, :]
    # a block is also full when all its queries or all its keys are global (and it is complete)
    _, _, rows_whole, _, _, cols_whole = _block_edges(seq_len, seq_len, q_block, kv_block)
    whole = rows_whole[:, None] & cols_whole[None, :]
    full = full | ((rows_all[:, None] | cols_all[None, :]) & whole)
    tokens = flags.astype(np.int32)[None]
    return _build(_status_grid(any_, full)[None, None], seq_len_q=seq_len, seq_len_k=seq_len, q_block=q_block,
                  kv_block=kv_block, terms=MaskTerms(window_left=int(window), window_right=int(window),
                                                     global_tokens=2),
                  tokens_q=tokens, tokens_k=tokens)


def bigbird(seq_len: int, *, window_blocks: int, num_global_blocks: int, num_random_blocks: int, seed: int,
            block_size=128) -> BlockMask:
    """BigBird, block-granular (square blocks): query block a sees key block b iff ``|a - b| <=
    window_blocks``, a or b is one of the first ``num_global_blocks`` blocks, or b is one of
    ``num_random_blocks`` blocks drawn for a (among the others, seeded by ``seed``).

    Example::

        >>> m = bigbird(16384, window_blocks=1, num_global_blocks=2, num_random_blocks=5, seed=0)
        >>> round(m.density, 2)
        0.09
    """
    seq_len = _seq_len("seq_len", seq_len)
    q_block, kv_block = _block_sizes(block_size)
    if q_block != kv_block:
        raise ValueError(f"block_size: BigBird's block pattern needs square blocks, got {(q_block, kv_block)}")
    for name, value in (("window_blocks", window_blocks), ("num_global_blocks", num_global_blocks),
                        ("num_random_blocks", num_random_blocks)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    n = _cdiv(seq_len, q_block)
    a = np.arange(n)
    grid = (np.abs(a[:, None] - a[None, :]) <= window_blocks) | (a[:, None] < num_global_blocks) \
        | (a[None, :] < num_global_blocks)
    if num_random_blocks:
        scores = np.random.default_rng(seed).random((n, n))
        scores[grid] = np.inf  # draw among the blocks not yet visited
        take = min(num_random_blocks, n)
        picked = np.argpartition(scores, take - 1, axis=1)[:, :take]
        rows = np.repeat(a, take)
        ok = np.isfinite(scores[rows, picked.reshape(-1)])
        grid[rows[ok], picked.reshape(-1)[ok]] = True
    return from_blocks(grid, seq_len_q=seq_len, seq_len_k=seq_len, block_size=block_size)


def from_blocks(blocks, *, seq_len_q: int, seq_len_k: int, block_size=128) -> BlockMask:
    """A block-granular mask (e.g. learned top-k blocks): ``blocks`` bool ``(nQ, nK)``, ``(H, nQ, nK)`` or
    ``(B, H, nQ, nK)`` with ``nQ = ceil(Sq / q_block)``, ``nK = ceil(Sk / kv_block)``; a visited block is
    seen whole (within the sequences). Its lists are as wide as the grid (nK per query block, nQ per key
    block), so every such mask of one size has the same shapes: one jitted JAX function serves them all.

    Example::

        >>> top = np.random.default_rng(0).random((64, 64)).argsort(1)[:, :32]   # 32 of 64 blocks per row
        >>> blocks = np.zeros((64, 64), bool); np.put_along_axis(blocks, top, True, 1)
        >>> m = from_blocks(blocks, seq_len_q=4096, seq_len_k=4096, block_size=64)
    """
    seq_len_q, seq_len_k = _seq_len("seq_len_q", seq_len_q), _seq_len("seq_len_k", seq_len_k)
    q_block, kv_block = _block_sizes(block_size)
    grid = np.asarray(blocks)
    n_q, n_k = _cdiv(seq_len_q, q_block), _cdiv(seq_len_k, kv_block)
    if grid.dtype != bool or grid.ndim not in (2, 3, 4) or grid.shape[-2:] != (n_q, n_k):
        raise ValueError(f"blocks: expected a bool array (..., {n_q}, {n_k}) (query blocks x key blocks for "
                         f"block_size {(q_block, kv_block)}), got {grid.dtype} {grid.shape}")
    grid = grid.reshape((1,) * (4 - grid.ndim) + grid.shape)
    _, _, rows_whole, _, _, cols_whole = _block_edges(seq_len_q, seq_len_k, q_block, kv_block)
    whole = rows_whole[:, None] & cols_whole[None, :]
    status = np.where(grid, np.where(whole, FULL, PARTIAL), NONE).astype(np.int8)
    return _build(status, seq_len_q=seq_len_q, seq_len_k=seq_len_k, q_block=q_block, kv_block=kv_block,
                  terms=MaskTerms(), full_width=True)


def _padded_blocks(dense: np.ndarray, q_block: int, kv_block: int) -> np.ndarray:
    """bool ``(B, H, Sq, Sk)`` -> ``(B, H, nQ, q_block, nK, kv_block)``, False past the sequences."""
    b, h, sq, sk = dense.shape
    n_q, n_k = _cdiv(sq, q_block), _cdiv(sk, kv_block)
    if (n_q * q_block, n_k * kv_block) != (sq, sk):
        padded = np.zeros((b, h, n_q * q_block, n_k * kv_block), bool)
        padded[:, :, :sq, :sk] = dense
        dense = padded
    return dense.reshape(b, h, n_q, q_block, n_k, kv_block)


def from_dense(mask, *, block_size=128) -> BlockMask:
    """An exact element mask: bool ``(Sq, Sk)``, ``(H, Sq, Sk)`` or ``(B, H, Sq, Sk)`` (True = query i sees
    key j). Blocks all True are full, blocks with some True partial (their bits are kept).

    Example::

        >>> m = from_dense(np.random.default_rng(0).random((300, 200)) < 0.3, block_size=64)
        >>> bool((m.to_dense()[0, 0] == (np.random.default_rng(0).random((300, 200)) < 0.3)).all())
        True
    """
    dense = np.asarray(mask)
    if dense.dtype != bool or dense.ndim not in (2, 3, 4) or min(dense.shape, default=0) < 1:
        raise ValueError(f"mask: expected a non-empty bool array (Sq, Sk), (H, Sq, Sk) or (B, H, Sq, Sk), got "
                         f"{dense.dtype} {dense.shape}")
    dense = dense.reshape((1,) * (4 - dense.ndim) + dense.shape)
    q_block, kv_block = _block_sizes(block_size)
    sq, sk = dense.shape[-2:]
    blocks = _padded_blocks(dense, q_block, kv_block)
    any_ = blocks.any(axis=(3, 5))
    full = blocks.all(axis=(3, 5))
    status = _status_grid(any_, full)
    bi, hi, qi, ki = np.nonzero(status == PARTIAL)
    return _build(status, seq_len_q=sq, seq_len_k=sk, q_block=q_block, kv_block=kv_block,
                  terms=MaskTerms(bits=True), bits=blocks[bi, hi, qi, :, ki, :])


# ------------------------------------------------------------------------------------ element values

def _bounds(mask: BlockMask, qb, kb) -> np.ndarray:
    """bool (n, q_block, kv_block): the element lies inside both sequences."""
    i = qb[:, None, None] * mask.q_block + np.arange(mask.q_block)[None, :, None]
    j = kb[:, None, None] * mask.kv_block + np.arange(mask.kv_block)[None, None, :]
    return (i < mask.seq_len_q) & (j < mask.seq_len_k)


def _term_values(mask: BlockMask, b, qb, kb, bit_ids) -> np.ndarray:
    """The AND of ``mask.terms`` (and the sequence bounds) on blocks (b, qb, kb): bool (n, qB, kB), as the
    kernels evaluate them on partial blocks."""
    t = mask.terms
    i = qb[:, None, None] * mask.q_block + np.arange(mask.q_block)[None, :, None]  # (n, qB, 1)
    j = kb[:, None, None] * mask.kv_block + np.arange(mask.kv_block)[None, None, :]  # (n, 1, kB)
    ok = _bounds(mask, qb, kb)
    diag = mask.seq_len_k - mask.seq_len_q
    left = True if t.window_left is None else j >= i + (diag - t.window_left)
    right = True if t.window_right is None else j <= i + (diag + t.window_right)
    if t.has_tokens:
        bt = b if np.shape(mask.tokens_q)[0] > 1 else np.zeros_like(b)
        tq = np.asarray(mask.tokens_q)[bt[:, None, None], np.minimum(i, mask.seq_len_q - 1)]
        tk = np.asarray(mask.tokens_k)[bt[:, None, None], np.minimum(j, mask.seq_len_k - 1)]
    if t.global_tokens == 1:
        ok = ok & right & (left | ((tk & 1) != 0))
    elif t.global_tokens == 2:
        ok = ok & ((left & right) | (((tq | tk) & 1) != 0))
    else:
        ok = ok & left & right
    if t.document:  # the key inside the query's document (its first position in tokens_q, its last in tokens_k)
        last = np.asarray(mask.tokens_k)[bt[:, None, None], np.minimum(i, mask.seq_len_k - 1)]
        ok = ok & (j >= tq >> 1) & (j <= last >> 1)
    if t.bits:
        words = np.asarray(mask.bits)[bit_ids]  # (n, words)
        unpacked = np.unpackbits(words.astype("<u4").view(np.uint8), axis=1, bitorder="little")
        ok = ok & unpacked.reshape(len(bit_ids), mask.q_block, mask.kv_block).astype(bool)
    return ok


# -------------------------------------------------------------------------------------- combinations

def _broadcast_status(a: BlockMask, b: BlockMask):
    sa, sb = a.status(), b.status()
    try:
        shape = np.broadcast_shapes(sa.shape[:2], sb.shape[:2])
    except ValueError:
        raise ValueError(f"block masks: batch / head extents {sa.shape[:2]} and {sb.shape[:2]} do not "
                         "broadcast (each must be 1 or the same)") from None
    return np.broadcast_to(sa, shape + sa.shape[2:]), np.broadcast_to(sb, shape + sb.shape[2:])


def _same_tokens(a: BlockMask, b: BlockMask) -> bool:
    if not (a.terms.has_tokens and b.terms.has_tokens):
        return a.terms.has_tokens == b.terms.has_tokens
    return all(np.shape(x) == np.shape(y) and np.array_equal(x, y)
               for x, y in ((a.tokens_q, b.tokens_q), (a.tokens_k, b.tokens_k)))


def _combine(a: BlockMask, b: BlockMask, *, union: bool) -> BlockMask:
    op = "|" if union else "&"
    if not isinstance(b, BlockMask):
        return NotImplemented
    if (a.seq_len_q, a.seq_len_k, a.block_size) != (b.seq_len_q, b.seq_len_k, b.block_size):
        raise ValueError(f"a {op} b: the masks must have the same sequence lengths and block sizes, got "
                         f"{(a.seq_len_q, a.seq_len_k)} / {a.block_size} and {(b.seq_len_q, b.seq_len_k)} / "
                         f"{b.block_size}")
    sa, sb = _broadcast_status(a, b)
    if union:
        visited = (sa > NONE) | (sb > NONE)
        full = (sa == FULL) | (sb == FULL)
    else:
        visited = (sa > NONE) & (sb > NONE)
        full = (sa == FULL) & (sb == FULL)
    status = np.where(full, FULL, np.where(visited, PARTIAL, NONE)).astype(np.int8)
    common = dict(seq_len_q=a.seq_len_q, seq_len_k=a.seq_len_k, q_block=a.q_block, kv_block=a.kv_block)
    ta, tb = a.terms, b.terms
    # Kept symbolic when the result's partial blocks obey one set of terms: identical terms (the AND or OR of
    # a test with itself), or an AND with a block-granular mask (whose partial blocks only add the bounds).
    # Bits are never shared: a partial block of the result may have been full in the mask owning them.
    keep = None
    if not ta.bits and not tb.bits:
        if ta == tb and _same_tokens(a, b):
            keep = a
        elif not union and tb.block_granular:
            keep = a
        elif not union and ta.block_granular:
            keep = b
    if keep is not None:
        return _build(status, terms=keep.terms, tokens_q=keep.tokens_q, tokens_k=keep.tokens_k, **common)
    bi, hi, qi, ki = np.nonzero(status == PARTIAL)

    def values(m):
        return m.block_values(np.minimum(bi, m.shape[0] - 1), np.minimum(hi, m.shape[1] - 1), qi, ki)

    bits = (values(a) | values(b)) if union else (values(a) & values(b))
    return _build(status, terms=MaskTerms(bits=True), bits=bits, **common)
