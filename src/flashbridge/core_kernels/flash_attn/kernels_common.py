"""Shared ``@triton.jit`` building blocks of the attention kernels (one definition each).

The forward, the backward and the kernels still to come (decode, block-sparse, MLA) are assembled from
these pieces, so a new iteration strategy (a list of KV blocks instead of a range, a split KV axis) reuses
the score modifiers and the online-softmax step instead of copying them.

Units: scores are kept in log2 units (``s2 = s * log2(e)``) so the softmax uses ``exp2``; the LSE is stored
in natural log. Index conventions (bottom-right alignment, as flash-attn 2.1+): with
``diag = seqlen_k - seqlen_q``, query ``i`` sits on key ``i + diag``; it sees key ``j`` iff
``-window_left <= j - (i + diag) <= window_right`` (causal: ``window_right = 0``; an unbounded side is
passed as a huge number by the plan) and ``j < seqlen_k``.

Every score helper is elementwise on 2-D index tensors that are already broadcast (``q_idx`` ``[M, 1]`` and
``k_idx`` ``[1, N]``, or transposed ``[1, M]`` / ``[N, 1]``), so the dK/dV kernel can work on S^T with the
same code.
"""
import triton
import triton.language as tl

from .._loader import interpreter_twin
from .._random import byte_threshold, keep16

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


# ------------------------------------------------------------------------------------- sequences, blocks

@triton.jit
def seq_range(CU, b, max_len, total, IS_VARLEN: tl.constexpr):
    """Row ``start`` and ``length`` of sequence ``b``: dense sequences start at row 0 of their batch entry
    (the batch stride does the rest); packed ones at ``CU[b]``. Packed bounds are clamped to
    ``[0, total]`` and the length to ``max_len`` so that malformed ``cu_seqlens`` never address memory
    outside the tensors (the front-ends reject them before launch; this is the second line)."""
    if IS_VARLEN:
        start = tl.load(CU + b)
        end = tl.load(CU + b + 1)
        start = tl.minimum(tl.maximum(start, 0), total)
        end = tl.minimum(tl.maximum(end, start), total)
        length = tl.minimum(end - start, max_len)
    else:
        start = b * 0
        length = max_len + b * 0
    return start, length


@triton.jit
def packed_offsets_valid(CU, n_seqs, max_len, total, BLOCK: tl.constexpr = 256):
    """True when packed offsets ``CU`` (``n_seqs + 1`` entries) start at 0, never decrease, end at ``total`` and
    hold no sequence longer than ``max_len``: then the sequences' programs cover every row exactly once."""
    ok = (tl.load(CU) == 0) & (tl.load(CU + n_seqs) == total)
    for i0 in range(0, n_seqs, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        here = i < n_seqs
        start = tl.load(CU + i, mask=here, other=0)
        end = tl.load(CU + i + 1, mask=here, other=0)
        bad = here & ((end < start) | (end - start > max_len))
        ok = ok & (tl.max(bad.to(tl.int32), 0) == 0)
    return ok


@triton.jit
def fill_uncovered_rows(CU, n_seqs, max_len, total, rank, n_ranks, O, stride_os, LSE, stride_lse,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LSE: tl.constexpr, ROWS: tl.constexpr = 16):
    """Write NaN into the packed rows that no sequence's program covers, so that invalid offsets never leave
    uninitialised memory (offsets traced under jit or torch.compile are not checked on the host). Rows
    ``r`` of ``O[r * stride_os + d]`` (``d < D``) and, with HAS_LSE, ``LSE[r * stride_lse]``; this program
    takes the blocks of ROWS rows ``rank, rank + n_ranks, ...``.

    Valid offsets (:func:`packed_offsets_valid`, one vectorised pass) leave no such row and the program
    returns; otherwise each row is tested against every sequence's clamped range (:func:`seq_range`, the
    ranges the other programs write): slow, but only for offsets that are wrong anyway. Small tiles: this
    code shares its kernel with the attention loops."""
    if not packed_offsets_valid(CU, n_seqs, max_len, total):
        offs_d = tl.arange(0, BLOCK_D)
        for r0 in range(rank * ROWS, total, n_ranks * ROWS):
            rows = r0 + tl.arange(0, ROWS)
            covered = rows >= total
            for b in range(n_seqs):
                start, length = seq_range(CU, b, max_len, total, True)
                covered = covered | ((rows >= start) & (rows < start + length))
            rows64 = tl.cast(rows, tl.int64)
            nan = tl.full([ROWS, BLOCK_D], float("nan"), tl.float32).to(O.dtype.element_ty)
            tl.store(O + rows64[:, None] * stride_os + offs_d[None, :], nan,
                     mask=(~covered)[:, None] & (offs_d < D)[None, :])
            if HAS_LSE:
                tl.store(LSE + rows64 * stride_lse, tl.full([ROWS], float("nan"), tl.float32), mask=~covered)


@triton.jit
def block_schedule(HEAD_GROUP: tl.constexpr):
    """(rank, head, batch) of this program on a (blocks, heads, batch) grid; rank 0 is the block that
    runs first. The GPU starts programs in grid order (axis 0 fastest). HEAD_GROUP = 1: that order, all
    blocks of one head before the next head. HEAD_GROUP = G > 1: (head, batch) pairs are taken G at a time
    and within a group rank 0 of every pair starts first, then rank 1, ...: when rank 0 is the longest
    program (causal), the long programs of the last heads no longer start at the very end of the grid and
    run on alone (longest-first scheduling), while a group's G heads still share their K / V in L2."""
    return grid_schedule(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0),
                         tl.num_programs(1), tl.num_programs(2), HEAD_GROUP)


@triton.jit
def grid_schedule(pid0, pid1, pid2, n_ranks, n_heads, n_seqs, HEAD_GROUP: tl.constexpr):
    """:func:`block_schedule` for the program ``(pid0, pid1, pid2)`` of an ``(n_ranks, n_heads, n_seqs)``
    grid given explicitly (a kernel that runs several grids in one launch decodes its own ids)."""
    if HEAD_GROUP <= 1:
        return pid0, pid1, pid2
    n_pairs = n_heads * n_seqs
    linear = (pid2 * n_heads + pid1) * n_ranks + pid0
    first = linear // (HEAD_GROUP * n_ranks) * HEAD_GROUP
    size = tl.minimum(n_pairs - first, HEAD_GROUP)
    r = linear - first * n_ranks
    pair = first + r % size
    return r // size, pair % n_heads, pair // n_heads


@triton.jit
def unravel_grid(linear, n_ranks, n_heads):
    """``(pid0, pid1, pid2)`` of the ``linear``-th program of a ``(n_ranks, n_heads, *)`` grid in launch
    order (axis 0 fastest)."""
    rest = linear // n_ranks
    return linear - rest * n_ranks, rest % n_heads, rest // n_heads


@triton.jit
def query_block(CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                IS_VARLEN: tl.constexpr, HEAD_GROUP: tl.constexpr):
    """Coordinates of a query-block program on a (query blocks, heads, batch) grid: the heaviest causal
    blocks (the last rows) run first (see :func:`block_schedule`), so the tail of the grid is made of short
    programs.

    Returns (h, b, kh, q_start, len_q, k_start, len_k, m_start); the caller returns when m_start >= len_q."""
    rank, h, b = block_schedule(HEAD_GROUP)
    return query_block_at(rank, h, b, tl.num_programs(0), CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k, GROUP,
                          BLOCK_M, IS_VARLEN)


@triton.jit
def query_block_at(rank, h, b, n_ranks, CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr):
    """:func:`query_block` for a scheduled ``(rank, h, b)`` of a grid with ``n_ranks`` query blocks."""
    pid_m = n_ranks - 1 - rank
    q_start, len_q = seq_range(CU_Q, b, seqlen_q, total_q, IS_VARLEN)
    k_start, len_k = seq_range(CU_K, b, seqlen_k, total_k, IS_VARLEN)
    return h, b, h // GROUP, q_start, len_q, k_start, len_k, pid_m * BLOCK_M


@triton.jit
def sparse_query_block_at(rank, h, b, n_ranks, ORDER, mask_stride_b, mask_stride_h, CU_Q, CU_K, seqlen_q, seqlen_k,
                          total_q, total_k, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, MASK_QB: tl.constexpr,
                          IS_VARLEN: tl.constexpr):
    """:func:`query_block_at` for a block-sparse mask: rank r takes the ``r // SPLIT``-th query block of the
    mask's longest-first order ``ORDER`` (flashbridge.masks ``q_order``) and its ``r % SPLIT``-th part of
    BLOCK_M rows (SPLIT = MASK_QB // BLOCK_M; the grid spans whole mask blocks)."""
    SPLIT: tl.constexpr = MASK_QB // BLOCK_M
    qb = list_block(tl.load(ORDER + b * mask_stride_b + h * mask_stride_h + rank // SPLIT), seqlen_q, MASK_QB)
    pid_m = qb * SPLIT + rank % SPLIT
    return query_block_at(n_ranks - 1 - pid_m, h, b, n_ranks, CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k,
                          GROUP, BLOCK_M, IS_VARLEN)


@triton.jit
def sparse_key_block(rank, ORDER_ROW, seqlen_k, BLOCK_N: tl.constexpr, MASK_KB: tl.constexpr):
    """The key block (BLOCK_N units) that rank ``rank`` of a key-major grid takes under a block-sparse mask:
    the mask's longest-first ``kv_order`` row ``ORDER_ROW``, each mask block's BLOCK_N-key parts in turn."""
    SPLIT: tl.constexpr = MASK_KB // BLOCK_N
    return list_block(tl.load(ORDER_ROW + rank // SPLIT), seqlen_k, MASK_KB) * SPLIT + rank % SPLIT


@triton.jit
def list_block(index, seq_len, BLOCK: tl.constexpr):
    """A block index read from a mask's arrays, clamped to the sequence's blocks: the builders write valid
    indices; the clamp keeps any other arrays from addressing memory outside q / k / v."""
    return tl.minimum(tl.maximum(index, 0), tl.cdiv(seq_len, BLOCK) - 1)


@triton.jit
def list_length(NUM, row, width):
    """The length of list ``row`` (``NUM[row]``), clamped to the lists' width (see :func:`list_block`)."""
    return tl.minimum(tl.maximum(tl.load(NUM + row), 0), width)


@triton.jit
def list_start(BLOCKS, slot, seq_len, MASK_B: tl.constexpr):
    """The first index of the mask block listed at ``BLOCKS[slot]`` (see :func:`list_block`)."""
    return list_block(tl.load(BLOCKS + slot), seq_len, MASK_B) * MASK_B


@triton.jit
def list_start_ahead(BLOCKS, slot, n_slots, seq_len, MASK_B: tl.constexpr):
    """:func:`list_start` for a walk reading one entry ahead: a slot past the list's ``n_slots`` entries is
    not read (0 stands in), so the walk may ask for the entry after its last."""
    return list_block(tl.load(BLOCKS + slot, mask=slot < n_slots, other=0), seq_len, MASK_B) * MASK_B


@triton.jit
def list_step(BLOCKS, it, seq_len, BLOCK: tl.constexpr, MASK_B: tl.constexpr):
    """Step ``it`` of a walk over the mask blocks (of MASK_B indices) listed at ``BLOCKS``, each in MASK_B //
    BLOCK steps of BLOCK (BLOCK divides MASK_B): (the list slot, the step's offset within its mask block,
    its first index in the sequence)."""
    SPLIT: tl.constexpr = MASK_B // BLOCK
    slot = it // SPLIT
    sub = (it - slot * SPLIT) * BLOCK
    return slot, sub, list_start(BLOCKS, slot, seq_len, MASK_B) + sub


@triton.jit
def kv_key_range(q_first, q_last, diag, seqlen_k, window_left, window_right,
                 BLOCK_N: tl.constexpr, HAS_LOCAL: tl.constexpr):
    """Key blocks (in units of BLOCK_N) seen by the query indices ``q_first..q_last`` (inclusive; query
    ``i`` sits on key ``i + diag``).

    Returns ``lo <= full_lo <= full_hi <= hi``: blocks ``[lo, hi)`` hold every visible key, and blocks
    ``[full_lo, full_hi)`` are visible from every query of the range and inside ``seqlen_k``, so they need
    no mask. Blocks entirely masked (above the causal diagonal, outside the window) are never visited.
    Query-major kernels call it through :func:`kv_block_range`; the decode kernel, whose rows pack several
    query heads per query token, passes the token range of its rows; :func:`q_block_range` calls it with
    queries and keys swapped.
    """
    if HAS_LOCAL:
        first_key = tl.maximum(q_first + diag - window_left, 0)
        end_key = tl.minimum(q_last + diag + window_right + 1, seqlen_k)
        lo = first_key // BLOCK_N
        hi = tl.maximum(tl.cdiv(tl.maximum(end_key, 0), BLOCK_N), lo)
        # Full: the last row's left edge is at or before the block start, the first row's right edge at or
        # after the block end. Numerators are clamped at 0 because integer division truncates.
        full_lo = tl.cdiv(tl.maximum(q_last + diag - window_left, 0), BLOCK_N)
        full_hi = tl.maximum(tl.minimum(q_first + diag + window_right + 1, seqlen_k), 0) // BLOCK_N
    else:
        lo = q_first * 0
        hi = tl.cdiv(seqlen_k, BLOCK_N) + q_first * 0
        full_lo = lo
        full_hi = seqlen_k // BLOCK_N + q_first * 0
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def kv_block_range(m_start, seqlen_q, seqlen_k, window_left, window_right,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LOCAL: tl.constexpr):
    """Key blocks (in units of BLOCK_N) seen by the query rows ``[m_start, m_start + BLOCK_M)``: see
    :func:`kv_key_range` for the meaning of ``lo <= full_lo <= full_hi <= hi``."""
    m_last = tl.minimum(m_start + BLOCK_M, seqlen_q) - 1
    return kv_key_range(m_start, m_last, seqlen_k - seqlen_q, seqlen_k, window_left, window_right,
                        BLOCK_N, HAS_LOCAL)


@triton.jit
def q_block_range(n_start, seqlen_q, seqlen_k, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LOCAL: tl.constexpr):
    """Query blocks (in units of BLOCK_M) that see some key of ``[n_start, n_start + BLOCK_N)``: the dual of
    :func:`kv_block_range` for kernels that loop over queries. ``[full_lo, full_hi)`` are blocks inside
    ``seqlen_q`` whose rows all see every key of the block (keys past ``seqlen_k`` are not checked: they only
    feed rows of dK/dV that are never stored)."""
    # Query i sees key j when j - window_right <= i + diag <= j + window_left: the same relation as
    # kv_key_range's with queries and keys swapped, the diagonal negated and the window sides exchanged.
    return kv_key_range(n_start, n_start + BLOCK_N - 1, seqlen_q - seqlen_k, seqlen_q, window_right, window_left,
                        BLOCK_M, HAS_LOCAL)


@triton.jit
def cache_slots(BLOCK_TABLE, b, n_start, offs_k, key_ok, stride_tb, num_pages, PAGED: tl.constexpr,
                PAGE_SIZE: tl.constexpr, ONE_PAGE: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """(page, slot) int64 of the keys ``offs_k`` [N] (``n_start`` = offs_k[0]) of sequence ``b``.

    Paged: pages come from the block table, clamped to ``[0, num_pages)`` so that a bad table can never
    address memory outside the cache. When a page holds whole blocks one entry serves the block (a scalar
    load; ONE_PAGE: the keys are one aligned block inside a page); otherwise each key looks up its own page
    (table reads masked past the sequence's length).
    Contiguous: page = sequence, slot = key index. Shared by the decode kernel and the attention forward's
    paged caches (:func:`fwd_kv_block`).
    """
    if PAGED:
        # ONE_PAGE: the block's first key is always in the table (an unmasked scalar load)
        page = tl.cast(table_pages(BLOCK_TABLE, b, n_start, offs_k, key_ok, stride_tb, num_pages, PAGE_SIZE,
                                   ONE_PAGE, CHECK_KEYS and not ONE_PAGE), tl.int64)
        slot = tl.cast(offs_k % PAGE_SIZE, tl.int64)
    else:
        page = tl.cast(b, tl.int64)
        slot = tl.cast(offs_k, tl.int64)
    return page, slot


@triton.jit
def table_pages(BLOCK_TABLE, b, n_start, offs_k, key_ok, stride_tb, num_pages, PAGE_SIZE: tl.constexpr,
                ONE_PAGE: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """The pages (int32, clamped to ``[0, num_pages)``) of sequence ``b``'s keys: with ONE_PAGE a scalar, the
    page of key ``n_start`` (read only where the scalar ``key_ok`` holds, with CHECK_KEYS), else the page of
    each key of ``offs_k`` (read where ``key_ok``, of offs_k's shape, holds, with CHECK_KEYS); an entry not
    read stands for page 0."""
    row = BLOCK_TABLE + tl.cast(b, tl.int64) * stride_tb
    if ONE_PAGE:
        if CHECK_KEYS:
            page = tl.load(row + n_start // PAGE_SIZE, mask=key_ok, other=0)
        else:
            page = tl.load(row + n_start // PAGE_SIZE)
    elif CHECK_KEYS:
        page = tl.load(row + offs_k // PAGE_SIZE, mask=key_ok, other=0)
    else:
        page = tl.load(row + offs_k // PAGE_SIZE)
    return tl.minimum(tl.maximum(page, 0), num_pages - 1)


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a [R, C] tile, masking rows and/or columns only when the caller cannot rule them out (masks cost
    instructions in the inner loop). ``rows_ok`` [R], ``cols_ok`` [C]; masked elements read 0."""
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    elif CHECK_COLS:
        x = tl.load(ptrs, mask=cols_ok, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def load_rows(BASE, start, offs, stride, offs_d, rows_ok, D: tl.constexpr, BLOCK_D: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """The [R, BLOCK_D] tile of rows ``start + offs`` (``stride`` elements apart) of the array at ``BASE``,
    its first ``D`` columns read (masks as in :func:`load_tile`: rows only when ``CHECK_ROWS``)."""
    return load_tile(BASE + tl.cast(start, tl.int64) * stride + offs[:, None] * stride + offs_d[None, :], rows_ok,
                     offs_d < D, CHECK_ROWS, BLOCK_D != D)


@triton.jit
def store_rows(BASE, start, offs, stride, offs_d, rows_ok, D: tl.constexpr, x):
    """Store ``x`` [R, BLOCK_D] (converted to the array's dtype) into the rows ``start + offs`` of the array at
    ``BASE`` as :func:`load_rows` reads them: rows ``rows_ok`` and the first ``D`` columns."""
    tl.store(BASE + tl.cast(start, tl.int64) * stride + offs[:, None] * stride + offs_d[None, :],
             x.to(BASE.dtype.element_ty), mask=rows_ok[:, None] & (offs_d < D)[None, :])


# ---------------------------------------------------------------------------------------- score modifiers

@triton.jit
def tanh_f32(x):
    """tanh through exp2 (the interpreter has no libdevice): 1 - 2 / (exp(2x) + 1), absolute error ~1e-7.
    |x| is clamped at 15, where tanh is 1 to float32 precision, so exp2 never overflows."""
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def score_scale_softcap(qk, qk_scale, cap2, HAS_SOFTCAP: tl.constexpr):
    """Raw dot products -> scores in log2 units; also returns the tanh term (the softcap gradient needs it).

    No softcap: ``s2 = qk * qk_scale`` with ``qk_scale = softmax_scale * log2(e)``.
    Softcap: ``s2 = cap2 * tanh(qk * qk_scale)`` with ``qk_scale = softmax_scale / softcap`` and
    ``cap2 = softcap * log2(e)`` (see :func:`score_params`)."""
    if HAS_SOFTCAP:
        t = tanh_f32(qk * qk_scale)
        s2 = t * cap2
    else:
        t = qk
        s2 = qk * qk_scale
    return s2, t


@triton.jit
def score_params(sm_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """(qk_scale, cap2) for :func:`score_scale_softcap` from the runtime softmax scale and softcap. The
    scalars are rounded to float32 first: jax-triton passes Python floats as float64, torch as float32."""
    sm_scale = tl.cast(sm_scale, tl.float32)
    if HAS_SOFTCAP:
        softcap = tl.cast(softcap, tl.float32)
        qk_scale = sm_scale / softcap
        cap2 = softcap * LOG2E
    else:
        qk_scale = sm_scale * LOG2E
        cap2 = sm_scale * 0.0
    return qk_scale, cap2


@triton.jit
def alibi_slope2(SLOPES, b, h, stride_ab, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (batch b, head h) in log2 units (0.0 without ALiBi); ``h`` may be a tensor of
    heads (rows that pack several query heads), giving one slope per element."""
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + tl.cast(b, tl.int64) * stride_ab + h).to(tl.float32) * LOG2E
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def alibi_bias(s2, q_idx, k_idx, diag, slope2, HAS_ALIBI: tl.constexpr):
    """``s2 - slope * |i + diag - j|`` (log2 units), computed from indices, never materialised."""
    if HAS_ALIBI:
        dist = tl.abs(q_idx + diag - k_idx).to(tl.float32)
        s2 = s2 - slope2 * dist
    return s2


@triton.jit
def visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL: tl.constexpr):
    """Bool: query ``q_idx`` sees key ``k_idx`` (bounds, causal, sliding window).

    HAS_LOCAL (see ``local_mask_mode`` in plan.py): 0 = no window, only the sequence bound; 1 = only a right
    edge at or left of the diagonal (``window_right <= 0``, left unbounded: causal), which by itself keeps
    every key of a real row inside the sequence (``k <= q + diag + right <= seqlen_k - 1`` for ``q <
    seqlen_q``; padding rows are never stored), so one comparison per score instead of three; 2 = any
    window.

    Each window edge is compared as ``k_idx <= q_idx + (diag + right)``: the bound is a vector over the
    rows (one add per row), and every score costs one comparison against it (the equivalent ``k_idx -
    (q_idx + diag) <= right`` costs a subtraction per score and made ptxas keep more integers live in the
    masked loops). The unbounded side is 2**30 (plan.py), so no sum overflows int32 for sequences shorter
    than 2**30."""
    if HAS_LOCAL == 1:
        ok = k_idx <= q_idx + (diag + window_right)
    else:
        ok = k_idx < seqlen_k
        if HAS_LOCAL:
            ok = ok & (k_idx <= q_idx + (diag + window_right)) & (k_idx >= q_idx + (diag - window_left))
    return ok


@triton.jit
def mask_or_visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL: tl.constexpr,
                    elem_ok=None):
    """The element mask of a masked block: ``elem_ok`` when the caller computed one (the block-sparse
    kernels' :func:`block_mask_visible`, which includes the bounds), else :func:`visible`."""
    if elem_ok is not None:
        ok = elem_ok
    else:
        ok = visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL)
    return ok


@triton.jit
def block_mask_visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL: tl.constexpr,
                       MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, tq=None, tk=None, bits_ok=None,
                       KEY_MAJOR: tl.constexpr = False):
    """Bool: query ``q_idx`` sees key ``k_idx`` in a partial block of a block-sparse mask (flashbridge.masks:
    the AND of the mask's terms, and ``k_idx < seqlen_k``). ``tq`` / ``tk``: the token words of the rows and
    columns, given with MASK_GLOBAL or MASK_DOC; the program's own side (rows of a query-major kernel, keys of
    a key-major one, KEY_MAJOR) from :func:`fixed_tokens`, the other side's only for Longformer's global
    queries / keys (MASK_GLOBAL 2); ``bits_ok``: the block's bits (:func:`mask_bits`), given for bit-packed
    masks. Index tensors broadcast as in :func:`visible` (transposed in the dK/dV kernel).

    MASK_GLOBAL: 0 = the band alone (:func:`visible` with HAS_LOCAL); 1 = attention sinks: keys below the
    sink count (``tokens_q >> 1``; flagged in bit 0 of ``tokens_k``) join the band, still bounded by its right
    edge (``j <= i`` and ``j`` a sink or inside the window); 2 = flagged queries and keys see / are seen by
    everything (Longformer). MASK_DOC: the other side's index lies in the own side's document (its first and
    last index, see :func:`fixed_tokens`). Neither reads a token word per step: that load's latency showed in
    every step of the partial blocks' loop (H200, S=16384: document x16 backward 1.28 -> 1.15 ms, streaming
    forward 0.52 -> 0.49 ms without it)."""
    if MASK_GLOBAL == 1:
        if KEY_MAJOR:
            sink = (tk & 1) != 0
        else:
            sink = k_idx < (tq >> 1)
        ok = ((k_idx <= q_idx + (diag + window_right)) & (k_idx < seqlen_k)
              & ((k_idx >= q_idx + (diag - window_left)) | sink))
    elif MASK_GLOBAL == 2:
        ok = (visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL)
              | (((tq | tk) & 1) != 0)) & (k_idx < seqlen_k)
    else:
        ok = visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL)
    if MASK_DOC:
        # Causal (HAS_LOCAL 1: j <= i, documents have Sq == Sk) already keeps a row's keys at or before its
        # last position and a key's rows at or after its first: one comparison per score is left.
        if KEY_MAJOR:  # the key's document: tokens_q's word (its first index) packed above tokens_k's (last)
            ok = ok & (q_idx <= (tk.to(tl.int32) >> 1))
            if HAS_LOCAL != 1:
                ok = ok & (q_idx >= ((tk >> 32).to(tl.int32) >> 1))
        else:  # the row's document: tokens_k's word (its last index) packed above tokens_q's (first)
            ok = ok & (k_idx >= (tq.to(tl.int32) >> 1))
            if HAS_LOCAL != 1:
                ok = ok & (k_idx <= ((tq >> 32).to(tl.int32) >> 1))
    if bits_ok is not None:
        ok = ok & bits_ok
    return ok


@triton.jit
def mask_bits(WORDS, r, c, MASK_KB: tl.constexpr):
    """Bool tile: bit ``r * MASK_KB + c`` of the block's int32 words at ``WORDS`` (``r`` / ``c`` the rows and
    columns within the mask block, broadcast to the tile). Neighbouring keys share a word: the gathered
    loads hit the same few cache lines."""
    e = r * MASK_KB + c
    w = tl.load(WORDS + (e >> 5))
    return ((w >> (e & 31)) & 1) != 0


@triton.jit
def score_mods(qk, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
               APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
               HAS_ALIBI: tl.constexpr, elem_ok=None):
    """Every score modifier in order: scale, softcap, ALiBi, mask (-inf). Returns (s2, tanh term)."""
    s2, t = score_scale_softcap(qk, qk_scale, cap2, HAS_SOFTCAP)
    s2 = alibi_bias(s2, q_idx, k_idx, diag, slope2, HAS_ALIBI)
    if APPLY_MASK:
        s2 = tl.where(mask_or_visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL,
                                      elem_ok), s2, float("-inf"))
    return s2, t


@triton.jit
def recompute_p(qk, lse2, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, elem_ok=None):
    """The backward's probabilities ``p = exp2(mods(qk) - lse2)`` (lse2 broadcast to qk, +inf for rows that
    saw nothing) and the softcap's tanh term. Plain scores (no softcap, no ALiBi): the scale goes into the
    exponent's fused multiply-add and the mask zeroes p, one instruction per score less than scaling first
    (valid for any sign of the scale: no row max is involved)."""
    if HAS_SOFTCAP or HAS_ALIBI:
        s2, t = score_mods(qk, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                           APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, elem_ok)
        return tl.exp2(s2 - lse2), t
    p = tl.exp2(qk * qk_scale - lse2)
    if APPLY_MASK:
        p = tl.where(mask_or_visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL, elem_ok),
                     p, 0.0)
    return p, qk


# ---------------------------------------------------------------------------------------- online softmax

@triton.jit
def softmax_init(SINKS, h, BLOCK_M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Running (max, sum) in log2 units. A sink starts the row with its own logit: max = sink, sum = 1,
    so it joins the denominator and attends to nothing. ``h`` is a head index, or a [BLOCK_M] tensor of
    heads when the rows pack several query heads (decode, merges).

    Non-finite sinks follow IEEE arithmetic (the float64 reference's ``exp(sink)``): -inf adds 0, NaN makes
    the sum NaN, and +inf starts at (max, sum) = (FLT_MAX, +inf) -- a finite max, so that the rescaling
    factors ``exp2(m_old - m_new)`` stay 0 or 1 instead of ``exp2(inf - inf)``: every key then weighs 0
    (the output is 0, or NaN where a value is) and the lse is +inf, unless a score is +inf too (NaN)."""
    if HAS_SINKS:
        sink2 = tl.load(SINKS + h).to(tl.float32) * LOG2E
        sink2 = tl.zeros([BLOCK_M], dtype=tl.float32) + sink2
        pos_inf = sink2 == float("inf")
        m_i = tl.where(pos_inf, 3.4028234663852886e38, sink2)
        l_i = tl.where(pos_inf, float("inf"), tl.where(sink2 == sink2, 1.0, sink2))
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def max_nan(x, axis):
    """``tl.max`` that returns NaN where the reduced values hold one (``tl.max`` drops NaNs: PTX ``max``),
    at the same cost (PTX ``max.NaN``). A running softmax max built from it is NaN as soon as a score is,
    which is what tells a NaN row from a row with a +inf score (see :func:`softmax_normaliser`)."""
    return tl.reduce(x, axis, _max_nan)


@triton.jit
def _max_nan_interpreted(x, axis):
    """:func:`max_nan` in whole-tile operations (its interpreter twin): NaN where any element is NaN."""
    return tl.max(x, axis) + tl.sum(tl.where(x == x, 0.0, x), axis)


interpreter_twin(max_nan, _max_nan_interpreted)


@triton.jit
def online_softmax_probs(m_i, l_i, s, scale):
    """One KV block's softmax weights against the running state: scores ``s * scale`` [M, N] (log2 units,
    -inf = masked; ``scale`` > 0, or the literal 1.0 for scores already scaled, which the compiler folds
    away) -> (p [M, N], alpha [M], m_new, l_new), where alpha rescales everything accumulated so far.
    The row max is taken on ``s`` and scaled once per row; ``s * scale - max`` is one fused multiply-add.

    A row that has seen nothing yet keeps max = -inf; subtracting 0 instead keeps exp2 at 0, never NaN.
    Non-finite scores follow IEEE arithmetic: the max propagates NaN (:func:`max_nan`), so a NaN score
    makes the row's max, sum and output NaN; a +inf score makes the max +inf and ``exp2(inf - inf)`` NaN
    (the reference's ``exp(s) / sum = inf / inf``). Both at the cost of the plain max.
    """
    m_new = _max_nan(m_i, max_nan(s, 1) * scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * scale - m_use[:, None])  # [M, N]
    alpha = tl.exp2(m_i - m_use)  # [M]
    l_i = l_i * alpha + tl.sum(p, -1)
    return p, alpha, m_new, l_i


@triton.jit
def fold_values(acc, p, alpha, v, DOT_PRECISION: tl.constexpr):
    """``acc * alpha + p @ v``: acc [M, Dv], p [M, N] from :func:`online_softmax_probs`, v [N, Dv]. Callers
    holding V in column slices fold each slice into its own accumulator with the same p and alpha (decode's
    FP8 V, see decode/kernels.py)."""
    acc = acc * alpha[:, None]
    return tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)


# ---------------------------------------------------------------------------------------------- dropout

@triton.jit
def dropout_state(SEED, dropout_p):
    """A kernel's attention-dropout state: (seed, byte threshold t, scale ``256 / (256 - t)``); a program
    adds its fixed block's start with :func:`dropout_block`. Kernels build it once, before any branch, only
    with HAS_DROPOUT, and pass ``None`` otherwise, so that dropout_p = 0 compiles the kernels without
    dropout."""
    threshold = byte_threshold(dropout_p)
    return tl.load(SEED), threshold, tl.div_rn(256.0, tl.cast(256 - threshold, tl.float32))


@triton.jit
def dropout_block(drop, start):
    """:func:`dropout_state` of a program whose fixed block starts at ``start``: its query rows in the
    forward and dQ, its key rows in dK/dV (a multiple of 16, as every block start)."""
    seed, threshold, scale = drop
    return seed, threshold, scale, start


@triton.jit
def dropout_keep_tile(drop, start, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, b, h,
                      KEYS_FIRST: tl.constexpr = False):
    """Attention dropout's keep-mask of a [BLOCK_Q, BLOCK_K] tile of sequence b, query head h (bool; [BLOCK_K,
    BLOCK_Q] with KEYS_FIRST: the dK/dV kernel's S^T); kept values are scaled by ``drop[2]``. ``drop``:
    :func:`dropout_block`, whose start is the queries' (the keys' with KEYS_FIRST); ``start``: the other
    index's block start (multiples of 16).

    Element (i, j) is byte ``8 * i3 + 4 * j3 + 2 * i0 + j0`` (bits 3 and 0) of the Philox call with counter
    ``(i & ~9, j & ~9, h, b)`` (``keep16``: one call per 16 elements), kept when the byte is >= t: a
    function of (seed, b, h, i, j) only, so the forward's P @ V, the backward's dV and dP, torch and JAX, CPU
    and GPU draw one mask (``reference.attention.attention_dropout_mask``)."""
    seed, threshold, scale, fixed = drop
    if KEYS_FIRST:
        keep = keep16(seed, start, fixed, BLOCK_Q, BLOCK_K, tl.cast(h, tl.uint32), tl.cast(b, tl.uint32),
                      threshold, False)
    else:
        keep = keep16(seed, fixed, start, BLOCK_Q, BLOCK_K, tl.cast(h, tl.uint32), tl.cast(b, tl.uint32),
                      threshold, True)
    return keep


@triton.jit
def dropout_multiplier(drop, start, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, b, h,
                       KEYS_FIRST: tl.constexpr = False):
    """:func:`dropout_keep_tile` as factors: ``256 / (256 - t)`` where kept, 0 where dropped (float32)."""
    return tl.where(dropout_keep_tile(drop, start, BLOCK_Q, BLOCK_K, b, h, KEYS_FIRST), drop[2], 0.0)


@triton.jit
def merge_states_block(acc, m_i, l_i, lse, o):
    """Fold a block of normalised partial states into a running merge, element by element: ``lse`` [N, E]
    (natural log, -inf = the part saw nothing or is padding), ``o`` [N, E] the parts' outputs, axis 0 the
    parts; acc, m_i (log2 units), l_i are [E]. The same algebra as :func:`online_softmax_probs` with each
    part standing for one key of weight ``exp(lse)`` and value ``o``: after every block,
    ``acc / l_i`` is the exact merge ``sum_n exp(lse_n - lse) o_n`` and ``m_i + log2(l_i)`` its lse
    (log2 units). Parts with lse = -inf contribute exactly 0 (even if their o is NaN); every other part
    contributes ``w * o`` even where its weight underflows to 0, so a NaN output is never dropped, and a
    NaN lse makes the merged state NaN (never "saw nothing")."""
    lse2 = lse * LOG2E
    m_new = _max_nan(m_i, max_nan(lse2, 0))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    w = tl.exp2(lse2 - m_use[None, :])  # [N, E]
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(w, 0)
    acc = acc * alpha + tl.sum(w * tl.where(lse2 == float("-inf"), 0.0, o), 0)
    return acc, m_new, l_i


@triton.jit
def softmax_normaliser(m_i, l_i):
    """(1 / sum, lse in natural log) of running (max, sum) states of any shape; states that saw nothing
    (sum 0) give 0 and -inf (their output is 0). Non-finite states follow IEEE arithmetic, as the float64
    reference: a NaN sum gives NaN for both (a NaN row never passes for one that saw nothing: a later
    merge would drop it), a +inf max (a +inf score) gives lse +inf. Costs a few instructions per row, once."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)  # no 1/0 or log(0), even in lanes that are discarded
    lse = tl.where(m_i == float("inf"), float("inf"), (m_i + tl.log2(l_safe)) * LN2)
    return tl.where(empty, 0.0, 1.0 / l_safe), tl.where(empty, float("-inf"), lse)


@triton.jit
def softmax_finalize(acc, m_i, l_i):
    """(out [M, Dv] float32, lse [M] natural log); rows that saw nothing give 0 and -inf, NaN rows NaN and
    NaN (see :func:`softmax_normaliser`)."""
    inv_l, lse = softmax_normaliser(m_i, l_i)
    return acc * inv_l[:, None], lse


@triton.jit
def block_probs(m_i, l_i, qk, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, POSITIVE_SCALE: tl.constexpr, elem_ok=None):
    """Raw dot products ``qk`` [M, N] of a loaded KV block -> score modifiers -> the block's softmax weights
    and the updated running state: (p, alpha, m_i, l_i), see :func:`online_softmax_probs`.

    POSITIVE_SCALE (softmax_scale > 0, known when planning) without softcap or ALiBi: the scores stay raw,
    masked as they are (a positive scale commutes with the mask and the row max), and the scale is applied
    inside the exponent, ``exp2(qk * scale - max)``: one fused multiply-add per score instead of a multiply
    and a subtraction."""
    if POSITIVE_SCALE and not (HAS_SOFTCAP or HAS_ALIBI):
        if APPLY_MASK:
            qk = tl.where(mask_or_visible(q_idx, k_idx, seqlen_k, diag, window_left, window_right, HAS_LOCAL,
                                          elem_ok), qk, float("-inf"))
        return online_softmax_probs(m_i, l_i, qk, qk_scale)
    s2, _ = score_mods(qk, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                       APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, elem_ok)
    return online_softmax_probs(m_i, l_i, s2, 1.0)


@triton.jit
def attend_block(acc, m_i, l_i, qk, v, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k, window_left,
                 window_right, APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, POSITIVE_SCALE: tl.constexpr, elem_ok=None,
                 drop=None, b=0, h=0, k_start=0):
    """Raw dot products ``qk`` [M, N] of a loaded KV block -> score modifiers (:func:`block_probs`) -> fold
    ``v`` [N, Dv] into the running (acc, m_i, l_i). Shared by every forward iteration strategy (dense
    ranges, paged decode). ``drop`` (:func:`dropout_block` of the query block; sequence ``b``, head ``h``,
    keys from ``k_start``): dropout on the folded weights only; the running sum, and so the lse, is the
    undropped softmax's (as flash-attn)."""
    p, alpha, m_i, l_i = block_probs(m_i, l_i, qk, q_idx, k_idx, qk_scale, cap2, slope2, diag, seqlen_k,
                                     window_left, window_right, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI,
                                     POSITIVE_SCALE, elem_ok)
    if drop is not None:
        # the scale 1 / (1 - p_q) is applied to the output once (attn_fwd_kernel), not per element
        p = tl.where(dropout_keep_tile(drop, k_start, p.shape[0], p.shape[1], b, h), p, 0.0)
    return fold_values(acc, p, alpha, v, DOT_PRECISION), m_i, l_i


@triton.jit
def fwd_kv_block(acc, m_i, l_i, q, K_base, V_base, n_start, offs_m, offs_n, offs_dqk, offs_dv,
                 stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                 DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, POSITIVE_SCALE: tl.constexpr, elem_ok=None,
                 drop=None, b=0, h=0, pages=None, PAGE_SIZE: tl.constexpr = 0, ONE_PAGE: tl.constexpr = False,
                 page=0):
    """One KV block of the forward: load K, V rows ``n_start + offs_n``, score, fold into (acc, m_i, l_i).

    ``K_base`` / ``V_base`` point at key row 0 of this (sequence, kv head); ``offs_n`` is ``arange(BLOCK_N)``.
    Without APPLY_MASK the caller guarantees every key of the block is visible from every row; with it,
    ``elem_ok`` [M, N] (block-sparse masks) replaces :func:`visible`.

    PAGE_SIZE > 0 (a paged cache): ``K_base`` / ``V_base`` point at the kv head of page 0 and ``pages`` is
    (BLOCK_TABLE, b, stride_tb, num_pages, stride_kp, stride_vp); key ``j`` lives at slot ``j % PAGE_SIZE`` of
    page ``BLOCK_TABLE[b, j // PAGE_SIZE]``. ``page`` (:func:`block_pages`, read by the caller): the block's
    page with ONE_PAGE (a page holds the whole block), else ``[BLOCK_N // PAGE_SIZE]`` pages, spread over the
    keys here.
    """
    offs_k = n_start + offs_n  # [N]
    if PAGE_SIZE > 0:
        BLOCK_TABLE, b, stride_tb, num_pages, stride_kp, stride_vp = pages
        slot = tl.cast(offs_k % PAGE_SIZE, tl.int64)
        if not ONE_PAGE:  # the block's pages -> each key's
            page = tl.gather(page, offs_n // PAGE_SIZE, 0)
        page = tl.cast(page, tl.int64)
        k_ptrs = K_base + (page * stride_kp + slot * stride_ks)[:, None] + offs_dqk[None, :]
        v_ptrs = V_base + (page * stride_vp + slot * stride_vs)[:, None] + offs_dv[None, :]
    else:
        k_ptrs = K_base + tl.cast(n_start, tl.int64) * stride_ks + offs_n[:, None] * stride_ks + offs_dqk[None, :]
        v_ptrs = V_base + tl.cast(n_start, tl.int64) * stride_vs + offs_n[:, None] * stride_vs + offs_dv[None, :]
    k = load_tile(k_ptrs, offs_k < seqlen_k, offs_dqk < DQK, APPLY_MASK, BLOCK_DQK != DQK)  # [N, Dqk]
    v = load_tile(v_ptrs, offs_k < seqlen_k, offs_dv < DV, APPLY_MASK, BLOCK_DV != DV)  # [N, Dv]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N] float32
    return attend_block(acc, m_i, l_i, qk, v, offs_m[:, None], offs_k[None, :], qk_scale, cap2, slope2, diag,
                        seqlen_k, window_left, window_right, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI,
                        DOT_PRECISION, POSITIVE_SCALE, elem_ok, drop, b, h, n_start)


@triton.jit
def block_pages(pages, n_start, offs_n, seqlen_k, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The pages of the key block ``n_start + offs_n`` of a paged cache (``pages``: see :func:`fwd_kv_block`):
    one table entry when a page holds the whole block, else one per page of the block (``[BLOCK_N //
    PAGE_SIZE]``, not per key: a per-key vector as loop state made ptxas serialise the loop's wgmma at pages
    of 64). Pages from ``seqlen_k`` on are not read (page 0 stands in), so the block after the last may be
    asked for. 0 without a paged cache (a compiled jit function cannot return None)."""
    page = 0
    if PAGE_SIZE > 0:
        BLOCK_TABLE, b, stride_tb, num_pages, _, _ = pages
        ONE_PAGE: tl.constexpr = PAGE_SIZE % BLOCK_N == 0
        if ONE_PAGE:
            page = table_pages(BLOCK_TABLE, b, n_start, n_start, n_start < seqlen_k,
                               stride_tb, num_pages, PAGE_SIZE, True, True)
        else:
            offs_p = n_start + tl.arange(0, BLOCK_N // PAGE_SIZE) * PAGE_SIZE
            page = table_pages(BLOCK_TABLE, b, n_start, offs_p, offs_p < seqlen_k,
                               stride_tb, num_pages, PAGE_SIZE, False, True)
    return page


@triton.jit
def fwd_kv_range(acc, m_i, l_i, q, K_base, V_base, blk_lo, blk_hi, offs_m, offs_dqk, offs_dv,
                 stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                 DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
                 BLOCK_DV: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 MASKED_STAGES: tl.constexpr, POSITIVE_SCALE: tl.constexpr, drop=None, b=0, h=0, pages=None,
                 PAGE_SIZE: tl.constexpr = 0):
    """The dense iteration strategy: KV blocks ``[blk_lo, blk_hi)`` in order (a paged cache: see
    :func:`fwd_kv_block`'s ``pages`` / PAGE_SIZE).

    MASKED_STAGES > 0: a masked segment (the causal diagonal, window edges, a ragged tail: a few blocks)
    runs with that pipelining depth instead of the kernel's: its staged buffers otherwise add registers to
    the loop that also carries the mask arithmetic (the causal forward spilled with all three segments
    pipelined).

    A paged cache's table entries are read one iteration ahead and carried as loop state: the K / V
    addresses of a block then depend on no load of the same iteration, and Triton's pipeliner stages the
    K / V gathers as deep as the contiguous loads (sm_90, 128 x 128 tiles: three K / V stages, as
    contiguous; read in the iteration that uses them, the table load held them to two)."""
    offs_n = tl.arange(0, BLOCK_N)
    page = block_pages(pages, blk_lo * BLOCK_N, offs_n, seqlen_k, BLOCK_N, PAGE_SIZE)
    # a masked segment at its own pipelining depth, any other at the kernel's
    for blk in tl.range(blk_lo, blk_hi, num_stages=MASKED_STAGES if APPLY_MASK and MASKED_STAGES > 0 else None):
        acc, m_i, l_i = fwd_kv_block(
            acc, m_i, l_i, q, K_base, V_base, blk * BLOCK_N, offs_m, offs_n, offs_dqk, offs_dv,
            stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
            DQK, DV, BLOCK_DQK, BLOCK_DV, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
            POSITIVE_SCALE, None, drop, b, h, pages, PAGE_SIZE, PAGE_SIZE % BLOCK_N == 0, page)
        page = block_pages(pages, (blk + 1) * BLOCK_N, offs_n, seqlen_k, BLOCK_N, PAGE_SIZE)
    return acc, m_i, l_i


# ------------------------------------------------------------------------------------------ block-sparse

@triton.jit
def mask_tokens(TOK, idx, ok, NEEDED: tl.constexpr):
    """The token words (flashbridge.masks: bit 0 global, bits 1.. the sink count or a document bound) at
    positions ``idx`` of the sequence's row ``TOK`` (``ok``: the valid positions; others read 0). Without
    a token term (not NEEDED) zeros that nothing reads: a compiled jit function cannot return None."""
    if NEEDED:
        return tl.load(TOK + idx, mask=ok, other=0)
    return idx * 0


@triton.jit
def fixed_tokens(TOK, TOK_OTHER, idx, ok, MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr):
    """The token words of a program's own indices, read once per program: its rows' from ``TOK`` =
    tokens_q in a query-major kernel, its keys' from ``TOK`` = tokens_k in the key-major dK/dV kernel. With
    documents the other array's words at the same positions (``TOK_OTHER``; queries and keys are the same
    positions there) are packed above them (int64): tokens_q holds each token's document's first index,
    tokens_k its last, and the two bound the other side's indices in :func:`block_mask_visible`."""
    t = mask_tokens(TOK, idx, ok, MASK_GLOBAL > 0 or MASK_DOC)
    if MASK_DOC:
        other = tl.load(TOK_OTHER + idx, mask=ok, other=0)
        t = t.to(tl.int64) | (other.to(tl.int64) << 32)
    return t


@triton.jit
def kv_step_mask(offs_m, m_local, tq, n_start, offs_c, slot, BIT_ROWS, BITS, TOK_K, seqlen_k, diag, window_left,
                 window_right, BLOCK_N: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
                 HAS_LOCAL: tl.constexpr, MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr,
                 MASK_BITS: tl.constexpr):
    """The element test [M, N] of a query-major kernel's step over keys ``n_start + arange(BLOCK_N)`` of a
    partial block (``slot`` its place in the list, ``offs_c`` [N] the keys within the mask block; rows
    ``offs_m`` [M], within their mask block ``m_local``, token words ``tq`` [M, 1] from
    :func:`fixed_tokens`)."""
    offs_k = n_start + tl.arange(0, BLOCK_N)
    tk = mask_tokens(TOK_K, offs_k[None, :], (offs_k < seqlen_k)[None, :], MASK_GLOBAL == 2)  # global keys
    bits_ok = None
    if MASK_BITS:
        words = BITS + tl.cast(tl.load(BIT_ROWS + slot), tl.int64) * (MASK_QB * MASK_KB // 32)
        bits_ok = mask_bits(words, m_local[:, None], offs_c[None, :], MASK_KB)
    return block_mask_visible(offs_m[:, None], offs_k[None, :], seqlen_k, diag, window_left, window_right,
                              HAS_LOCAL, MASK_GLOBAL, MASK_DOC, tq, tk, bits_ok)


@triton.jit
def _fwd_list_step(
    acc, m_i, l_i, it, start, q, K_base, V_base, BIT_ROWS, BITS, TOK_K, tq, offs_m, m_local, offs_dqk, offs_dv,
    stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right, DQK: tl.constexpr,
    DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, POSITIVE_SCALE: tl.constexpr, drop=None, b=0, h=0,
):
    """Step ``it`` of :func:`fwd_kv_list`: the ``it % SPLIT``-th slice of the listed key block that starts at
    key ``start`` (list slot ``it // SPLIT``)."""
    SPLIT: tl.constexpr = MASK_KB // BLOCK_N
    slot = it // SPLIT
    sub = (it - slot * SPLIT) * BLOCK_N
    n_start = start + sub
    offs_c = sub + tl.arange(0, BLOCK_N)  # [N] key index within the mask block
    elem_ok = None
    if APPLY_MASK:
        elem_ok = kv_step_mask(offs_m, m_local, tq, n_start, offs_c, slot, BIT_ROWS, BITS, TOK_K, seqlen_k, diag,
                               window_left, window_right, BLOCK_N, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL, MASK_DOC,
                               MASK_BITS)
    return fwd_kv_block(acc, m_i, l_i, q, K_base, V_base, n_start, offs_m, tl.arange(0, BLOCK_N), offs_dqk, offs_dv,
                        stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                        DQK, DV, BLOCK_DQK, BLOCK_DV, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                        POSITIVE_SCALE, elem_ok, drop, b, h)


@triton.jit
def fwd_kv_list(
    acc, m_i, l_i, q, K_base, V_base, n_blocks, BLOCKS, BIT_ROWS, BITS, TOK_K, tq, offs_m, m_local, offs_dqk,
    offs_dv, stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED_STAGES: tl.constexpr = 0,
    POSITIVE_SCALE: tl.constexpr = False, drop=None, b=0, h=0,
):
    """The block-sparse iteration strategy: the ``n_blocks`` key blocks (of MASK_KB keys) listed at
    ``BLOCKS`` -- one row of a BlockMask's full or partial lists -- each in MASK_KB // BLOCK_N steps of
    BLOCK_N keys, one flat loop (one pair of products per iteration, as in :func:`fwd_kv_range`).

    Full lists (no APPLY_MASK) run exactly the dense kernel's unmasked step. Partial ones (APPLY_MASK)
    evaluate the mask's element test (:func:`block_mask_visible`): ``tq`` [M, 1] the rows' token words,
    ``TOK_K`` the sequence's key token row, ``m_local`` [M] the rows within their mask block and, for
    bit-packed masks, ``BIT_ROWS`` the list's rows of ``BITS``."""
    SPLIT: tl.constexpr = MASK_KB // BLOCK_N
    n_steps = n_blocks * SPLIT
    # The next step's list entry is read one iteration ahead and carried, so a step's K / V addresses depend
    # on no load of the same iteration and Triton's pipeliner stages them as deep as the dense kernel's
    # (sm_90, D=128: three K / V stages, not two; H200: BigBird forward 0.62 -> 0.55 ms, streaming 0.53 ->
    # 0.51, the causal band as lists 2.55 -> 2.28). Documents and bit-packed element masks read each entry in
    # the step that uses it: their deeper full-block loop spilled (document: 8 -> 64 B a thread, sm_90; the
    # document x16 forward went 0.47 -> 0.77 ms when its token words were still read per step).
    READ_AHEAD: tl.constexpr = not (MASK_DOC or MASK_BITS)
    # a masked segment at its own pipelining depth (see fwd_kv_range), a full one at the kernel's
    if READ_AHEAD:
        start = list_start_ahead(BLOCKS, 0, n_blocks, seqlen_k, MASK_KB)
        for it in tl.range(0, n_steps, num_stages=MASKED_STAGES if APPLY_MASK and MASKED_STAGES > 0 else None):
            nxt = list_start_ahead(BLOCKS, (it + 1) // SPLIT, n_blocks, seqlen_k, MASK_KB)
            acc, m_i, l_i = _fwd_list_step(
                acc, m_i, l_i, it, start, q, K_base, V_base, BIT_ROWS, BITS, TOK_K, tq, offs_m, m_local, offs_dqk,
                offs_dv, stride_ks, stride_vs, qk_scale, cap2, slope2, diag, seqlen_k, window_left, window_right,
                DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, MASK_QB, MASK_KB, APPLY_MASK, HAS_LOCAL, MASK_GLOBAL,
                MASK_DOC, MASK_BITS, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, POSITIVE_SCALE, drop, b, h)
            start = nxt
    else:
        for it in tl.range(0, n_steps, num_stages=MASKED_STAGES if APPLY_MASK and MASKED_STAGES > 0 else None):
            acc, m_i, l_i = _fwd_list_step(
                acc, m_i, l_i, it, list_start(BLOCKS, it // SPLIT, seqlen_k, MASK_KB), q, K_base, V_base,
                BIT_ROWS, BITS, TOK_K, tq, offs_m, m_local, offs_dqk, offs_dv, stride_ks, stride_vs, qk_scale,
                cap2, slope2, diag, seqlen_k, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
                MASK_QB, MASK_KB, APPLY_MASK, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP, HAS_ALIBI,
                DOT_PRECISION, POSITIVE_SCALE, drop, b, h)
    return acc, m_i, l_i


# -------------------------------------------------------------------------------------------- backward

@triton.jit
def lse_log2(lse):
    """Stored LSE (natural log) -> log2 units for ``p = exp2(s2 - lse2)``; rows that saw nothing (-inf)
    become +inf so that their p is exactly 0 (and never -inf - -inf = NaN)."""
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def score_grad(p, dp, delta, t, HAS_SOFTCAP: tl.constexpr):
    """dL/d(q.k) up to the softmax scale: ``p * (dp - delta)``, times ``1 - tanh^2`` with softcap. Shapes
    broadcast: p, dp, t [M, N] (or transposed) and delta [M, 1] (or [1, M])."""
    ds = p * (dp - delta)
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


# ------------------------------------------------------------------------------------ stride divisibility

@triton.jit
def aligned(x, ALIGN: tl.constexpr):
    """``x`` (a runtime integer that the plan states is a multiple of ALIGN) in a form whose divisibility the
    compiler can see, so that pointer arithmetic with it keeps 16-byte vector loads and ``cp.async``.

    Triton's launcher infers "multiple of 16" for integer arguments but jax-triton does not, so the kernels
    ask both not to (``do_not_specialize_on_alignment``) and take the fact from the plan instead: both
    front-ends then compile the same code. ``tl.multiple_of`` cannot be used here: on a kernel argument
    (which has no defining op) it is silently dropped."""
    if ALIGN > 1:
        x = (x // ALIGN) * ALIGN
    return x


@triton.jit
def aligned_strides(stride_b, stride_s, stride_h, ALIGN: tl.constexpr):
    """:func:`aligned` for the (batch, row, head) strides of one tensor."""
    return aligned(stride_b, ALIGN), aligned(stride_s, ALIGN), aligned(stride_h, ALIGN)
