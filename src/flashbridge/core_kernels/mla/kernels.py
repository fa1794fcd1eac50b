"""MLA (DeepSeek latent attention, absorbed form) kernels (``@triton.jit`` only; launches in plan.py).

One latent KV head of ``DQK`` dims is shared by every query head, and the values are its first ``DV`` dims.
So a program's MMA rows are *query heads* (and query tokens): row ``r`` of the flattened (token, head) list
is token ``r // HEADS``, head ``r % HEADS`` -- for H=128 a token's heads fill two 64-row blocks -- and every
latent tile is loaded once for all of them. A key tile is read as its value part ``[N, DV]`` and the rest
``[N, DQK - DV]`` (DeepSeek: 512 + 64, the RoPE key): ``q k^T`` is a dot over the first plus a dot over the
second, and ``p @ v`` reuses the first tile as V. FP8 caches with 16-bit queries read the tile as 16-bit
column pairs once and widen it twice, as K and as V (``PAIRS``, the decode family's FP8 technique, see
:func:`pair_scores`); otherwise FP8 tiles are widened in registers (``SEPARATE_V``: V loaded a second time).

* :func:`mla_fwd_kernel`: decode (a latent cache, contiguous or paged, FP8 or not, split-KV with the decode
  family's merge kernel) and prefill (``kv`` as a contiguous cache whose length is the key length) are one
  kernel. The keys of a program come either as a range of key blocks (dense; causal clips it) or as a list of
  positions (``SPARSE``: top-k indices per query token, ``BLOCK_N`` of them per step, -1 skipped), and the
  loop body is the same: gather the rows (through the page table when paged), score, mask, fold. With
  ``TOKEN_ROWS`` a row block holds the heads of one token only (sparse: each token has its own key list).
  A third source, ``BLOCK_SPARSE`` (a flashbridge.masks.BlockMask, prefill): the key blocks listed for the
  row block's query block, full ones without mask arithmetic, then partial ones through the mask's element
  test (``kv_step_mask`` of the attention kernels).
* :func:`mla_bwd_dq_kernel`: dQ over the same key sources as the forward.
* :func:`mla_bwd_dkv_kernel`: dKV of one key block, looping over the (token, head) row blocks that see it;
  sparse calls read which (token, key) pairs are selected from a bitmap (:func:`mla_index_bitmap_kernel`)
  and skip the row blocks that select none of the block's keys; block-sparse calls walk the mask's
  transposed lists. Deterministic: every dKV element is summed by one program in a fixed order, or by a
  fixed number of programs whose partial sums :func:`mla_sum_parts_kernel` adds in order.

Block masks and the packed rows: a mask's query block of MASK_QB tokens is ``MASK_QB * HEADS`` consecutive
rows of the flattened (token, head) list, and the plans pick BLOCK_M dividing it, so a row block lies in one
query block and every head of a token sees the same keys -- which is why the masks must be shared by the
heads (per-head masks do not fit this layout; the plans reject them).
"""
import triton
import triton.language as tl

from ..decode.kernels import cache_slots, f16_query, load_column_pairs, widen_e4m3_pairs
from ..flash_attn.kernels_common import (aligned, aligned_strides, block_mask_visible, fixed_tokens, fold_values,
                                         kv_key_range, kv_step_mask, list_block, list_length, list_step, load_tile,
                                         mask_bits, mask_tokens, online_softmax_probs, score_grad, score_params,
                                         softmax_finalize, softmax_init, sparse_key_block)

# An unbounded left window for kv_key_range (causal masks have no left edge).
_NO_LEFT_EDGE = tl.constexpr(1 << 30)

# Runtime integers: no divisibility is inferred from their values (jax-triton would not infer it; the plans
# state it through the *_ALIGN constexprs instead, see core_kernels/_plan.py).
FWD_INT_SCALARS = (
    "seqlen_q", "fixed_len", "capacity", "num_pages", "topk", "stride_qb", "stride_qs", "stride_qh",
    "stride_kp", "stride_ks", "stride_tb", "stride_ib", "stride_is", "stride_on", "stride_ob", "stride_os",
    "stride_oh", "stride_ln", "stride_lb", "stride_ls", "stride_lh", "window_left", "window_right",
    "mask_stride_b", "mask_max", "tok_stride_b")


# ------------------------------------------------------------------------------------------ building blocks

@triton.jit
def row_block(pid_m, seqlen_q, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, TOKEN_ROWS: tl.constexpr):
    """The rows of row block ``pid_m``: (token [M], head [M], row_ok [M], first token, last token).

    Packed: rows ``pid_m * BLOCK_M ..`` of the flattened (token, head) list. TOKEN_ROWS: block ``pid_m``
    holds heads ``(pid_m % hb) * BLOCK_M ..`` of token ``pid_m // hb``, ``hb = cdiv(HEADS, BLOCK_M)``."""
    offs = tl.arange(0, BLOCK_M)
    if TOKEN_ROWS:
        HB: tl.constexpr = (HEADS + BLOCK_M - 1) // BLOCK_M
        t = pid_m // HB
        h = (pid_m % HB) * BLOCK_M + offs
        row_ok = h < HEADS
        tok = t + offs * 0
        tok_first = t
        tok_last = t
    else:
        r = pid_m * BLOCK_M + offs
        row_ok = r < seqlen_q * HEADS
        tok = r // HEADS
        h = r % HEADS
        tok_first = pid_m * BLOCK_M // HEADS
        tok_last = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, seqlen_q * HEADS) - 1) // HEADS
    return tok, h, row_ok, tok_first, tok_last


@triton.jit
def mask_row_block(rank, ORDER_ROW, seqlen_q, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, MASK_QB: tl.constexpr):
    """The row block that rank ``rank`` of a block-sparse grid takes: a mask query block is ``MASK_QB *
    HEADS`` consecutive rows of the flattened (token, head) list, so the attention kernels' key-major
    ordering helper applies to rows unchanged (the query blocks of the mask's longest-first order
    ``ORDER_ROW``, each block's BLOCK_M-row parts in turn)."""
    MASK_ROWS: tl.constexpr = MASK_QB * HEADS
    return sparse_key_block(rank, ORDER_ROW, seqlen_q * HEADS, BLOCK_M, MASK_ROWS)


@triton.jit
def load_latent(row, key_ok, offs_dv, offs_dr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                BLOCK_DR: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """Latent rows ``row`` [N] (pointers to each row's first element) as the value part [N, BLOCK_DV]
    (columns ``< DV``) and the rest [N, BLOCK_DR] (columns ``DV .. DQK``; none when ``DQK == DV``: the first
    tile is returned twice)."""
    kv_v = load_tile(row[:, None] + offs_dv[None, :], key_ok, offs_dv < DV, CHECK_KEYS, BLOCK_DV != DV)
    kv_r = kv_v
    if DQK > DV:
        kv_r = load_tile(row[:, None] + DV + offs_dr[None, :], key_ok, offs_dr < DQK - DV, CHECK_KEYS,
                         BLOCK_DR != DQK - DV)
    return kv_v, kv_r


@triton.jit
def latent_scores(q_v, q_r, kv_v, kv_r, rope_ratio, HAS_ROPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores ``q . kv`` [M, N] (float32): a dot over the value columns plus one over the rest. The
    rest's dot is accumulated onto the first one's result times ``rope_ratio`` (a power of two: the two
    query tiles' f16 scalings differ when the cache is FP8, see :func:`f16_query`; else the literal 1.0)."""
    qk = tl.dot(q_v, tl.trans(kv_v), input_precision=DOT_PRECISION)
    if HAS_ROPE:
        qk = tl.dot(q_r, tl.trans(kv_r), qk * rope_ratio, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def pair_scores(q_v, q_vo, q_r, q_ro, pairs_v, row, key_ok, rope_ratio, DQK: tl.constexpr, DV: tl.constexpr,
                BLOCK_DR: tl.constexpr, CHECK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                WIDEN_ASM: tl.constexpr):
    """Raw scores [M, N] (float32) against an FP8 latent read as column pairs (``PAIRS``): ``pairs_v``
    [N, BLOCK_DV / 2] (uint16, :func:`load_column_pairs`) is the value part, and the rest is read the same way
    from ``row + DV``. Both are widened transposed into their even and odd columns in f16 ([D / 2, N] each,
    :func:`widen_e4m3_pairs`) and dotted with q's even (``q_v`` / ``q_r``) and odd (``q_vo`` / ``q_ro``)
    columns; the rest's two dots add onto the value part's scores times ``rope_ratio`` (as
    :func:`latent_scores`). The value tile stays in the pipeline's buffer for ``p @ V``, which widens it
    again without the transpose: the latent is read once per step, and no widened tile goes back through
    shared memory (the decode family's ``K_PAIRS`` / ``V_PAIRS``)."""
    k_e, k_o = widen_e4m3_pairs(tl.trans(pairs_v), WIDEN_ASM)  # [DV / 2, N]
    # (q is f16 in compiled kernels; the interpreter runs 16-bit queries as float32: exact widening)
    qk = tl.dot(q_v, k_e.to(q_v.dtype), input_precision=DOT_PRECISION)
    qk = tl.dot(q_vo, k_o.to(q_v.dtype), qk, input_precision=DOT_PRECISION)
    if DQK > DV:
        pairs_r = load_column_pairs(row + DV, key_ok, DQK - DV, BLOCK_DR, CHECK_KEYS)
        r_e, r_o = widen_e4m3_pairs(tl.trans(pairs_r), WIDEN_ASM)  # [(DQK - DV) / 2, N]
        qk = tl.dot(q_r, r_e.to(q_r.dtype), qk * rope_ratio, input_precision=DOT_PRECISION)
        qk = tl.dot(q_ro, r_o.to(q_r.dtype), qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def key_mask(tok, offs_k, key_ok, diag, CAUSAL: tl.constexpr, elem_ok=None):
    """Bool [M, N]: row (token ``tok``) sees key ``offs_k``: the key is valid (``key_ok``: inside the
    sequence, a listed index) and, when causal, at or before the token's position ``tok + diag``. A block
    mask's element test ``elem_ok`` [M, N] (which holds the bounds) replaces both."""
    if elem_ok is not None:
        ok = elem_ok
    else:
        ok = key_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_k[None, :] <= (tok + diag)[:, None])
    return ok


@triton.jit
def sparse_keys(IDX_ROW, step, topk, length, BLOCK_N: tl.constexpr):
    """Positions [N] of step ``step`` of a top-k list (``IDX_ROW`` points at its first entry) and whether each
    is a key of the sequence (-1 padding, entries past ``length`` and slots past ``topk`` are not)."""
    slot = step * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.load(IDX_ROW + slot, mask=slot < topk, other=-1)
    return offs_k, (offs_k >= 0) & (offs_k < length)


@triton.jit
def latent_rows(BLOCK_TABLE, b, n_start, offs_n, offs_k, key_ok, stride_tb, num_pages, stride_kp, stride_ks,
                PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, GATHER: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """Where the latent rows of keys ``offs_k`` of sequence ``b`` start: ``(base, rows)``, a scalar and an
    [N] offset in elements (row n at ``base + rows[n]``).

    GATHER (top-k positions, or pages smaller than a block): each key through ``cache_slots`` (its own page,
    64-bit offsets; base 0). Otherwise the keys ``n_start + offs_n`` are consecutive rows of one page (or of
    the contiguous cache): a 64-bit base and 32-bit row offsets that do not change from block to block, so
    the loop keeps 16 offsets per thread instead of 16 64-bit addresses (sm_90, H=128, 576 / 512, 8 warps:
    stack 416 -> 376 B)."""
    if GATHER:
        page, slot = cache_slots(BLOCK_TABLE, b, n_start, offs_k, key_ok, stride_tb, num_pages, PAGED, PAGE_SIZE,
                                 False, CHECK_KEYS)
        base = tl.cast(b * 0, tl.int64)
        rows = page * stride_kp + slot * stride_ks
    else:
        page, slot = cache_slots(BLOCK_TABLE, b, n_start, n_start, True, stride_tb, num_pages, PAGED, PAGE_SIZE,
                                 True, False)
        base = page * stride_kp + slot * stride_ks
        rows = offs_n * stride_ks
    return base, rows


# ------------------------------------------------------------------------------------------------ forward

@triton.jit
def mla_fwd_steps(
    acc, acc_odd, m_i, l_i, q_v, q_vo, q_r, q_ro, KV, KV_V, BLOCK_TABLE, IDX_ROW, b, step_lo, step_hi, tok, diag,
    length, num_pages, topk, qk_scale, rope_ratio, stride_tb, stride_kp, stride_ks, BIT_ROWS, BITS, TOK_K, tq,
    m_local, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, APPLY_MASK: tl.constexpr, CAUSAL: tl.constexpr,
    SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr, POSITIVE_SCALE: tl.constexpr, SEPARATE_V: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, PAIRS: tl.constexpr,
    WIDEN_ASM: tl.constexpr,
):
    """Fold steps ``[step_lo, step_hi)`` into the running softmax. Dense: step = key block ``step``;
    without APPLY_MASK every key of every block is inside the sequence and visible from every row. SPARSE:
    step = ``BLOCK_N`` entries of the row's top-k list at ``IDX_ROW`` (always masked). SEPARATE_V: the value
    tile is loaded again through ``KV_V`` (the same cache) for ``p @ V`` (see mla_fwd_kernel). PAIRS (an FP8
    cache, 16-bit queries): the latent is read as column pairs (:func:`pair_scores`), ``q_vo`` / ``q_ro`` are
    q's odd columns (``q_v`` / ``q_r`` its even ones) and ``acc`` / ``acc_odd`` accumulate V's even / odd
    columns; otherwise ``q_vo``, ``q_ro`` and ``acc_odd`` are unused.

    BLOCK_SPARSE: ``IDX_ROW`` is one row of a block mask's full or partial key-block lists, step s the
    ``s % (MASK_KB // BLOCK_N)``-th ``BLOCK_N`` keys of entry ``s // (MASK_KB // BLOCK_N)`` (``list_step``);
    partial lists (APPLY_MASK) take the mask's element test (``kv_step_mask``: ``tq`` [M, 1] the rows' token
    words, ``m_local`` [M] their tokens within the query block, ``BIT_ROWS`` the list's rows of ``BITS``)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    for step in range(step_lo, step_hi):
        if SPARSE:
            offs_k, key_ok = sparse_keys(IDX_ROW, step, topk, length, BLOCK_N)
            n_start = 0
        else:
            if BLOCK_SPARSE:
                slot, sub, n_start = list_step(IDX_ROW, step, length, BLOCK_N, MASK_KB)
            else:
                n_start = step * BLOCK_N
            offs_k = n_start + offs_n
            key_ok = offs_k < length
        elem_ok = None
        if BLOCK_SPARSE and APPLY_MASK:
            elem_ok = kv_step_mask(tok, m_local, tq, n_start, sub + offs_n, slot, BIT_ROWS, BITS, TOK_K, length, diag,
                                   window_left, window_right, BLOCK_N, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL,
                                   MASK_DOC, MASK_BITS)
        base, rows = latent_rows(BLOCK_TABLE, b, n_start, offs_n, offs_k, key_ok, stride_tb, num_pages, stride_kp,
                                 stride_ks, PAGED, PAGE_SIZE, SPARSE or (PAGED and PAGE_SIZE % BLOCK_N != 0),
                                 APPLY_MASK)
        row = (KV + base) + rows
        if PAIRS:
            pairs_v = load_column_pairs(row, key_ok, DV, BLOCK_DV, APPLY_MASK)  # [N, DV / 2]: K and V
            qk = pair_scores(q_v, q_vo, q_r, q_ro, pairs_v, row, key_ok, rope_ratio, DQK, DV, BLOCK_DR, APPLY_MASK,
                             DOT_PRECISION, WIDEN_ASM)
        else:
            kv_v, kv_r = load_latent(row, key_ok, offs_dv, offs_dr, DQK, DV, BLOCK_DV, BLOCK_DR, APPLY_MASK)
            kv_v = kv_v.to(q_v.dtype)  # the compute dtype (FP8 caches widen here; SEPARATE_V: for the scores only)
            qk = latent_scores(q_v, q_r, kv_v, kv_r.to(q_r.dtype), rope_ratio, DQK > DV, DOT_PRECISION)
        if POSITIVE_SCALE:  # the scale goes into the exponent (see block_probs in kernels_common)
            if APPLY_MASK:
                qk = tl.where(key_mask(tok, offs_k, key_ok, diag, CAUSAL, elem_ok), qk, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_probs(m_i, l_i, qk, qk_scale)
        else:
            s2 = qk * qk_scale
            if APPLY_MASK:
                s2 = tl.where(key_mask(tok, offs_k, key_ok, diag, CAUSAL, elem_ok), s2, float("-inf"))
            p, alpha, m_i, l_i = online_softmax_probs(m_i, l_i, s2, 1.0)
        if PAIRS:  # the same tile as V: even and odd columns into their own accumulators
            v_e, v_o = widen_e4m3_pairs(pairs_v, WIDEN_ASM)  # [N, DV / 2]
            acc = fold_values(acc, p, alpha, v_e, DOT_PRECISION)
            acc_odd = fold_values(acc_odd, p, alpha, v_o, DOT_PRECISION)
        else:
            if SEPARATE_V:
                v = load_tile(((KV_V + base) + rows)[:, None] + offs_dv[None, :], key_ok, offs_dv < DV, APPLY_MASK,
                              BLOCK_DV != DV)
                kv_v = v.to(q_v.dtype)
            acc = fold_values(acc, p, alpha, kv_v, DOT_PRECISION)
    return acc, acc_odd, m_i, l_i


@triton.jit
def load_query(Q_row, row_ok, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr):
    """The rows' query as its value-column part [M, BLOCK_DV] and the rest [M, BLOCK_DR] (as load_latent)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    return load_latent(Q_row, row_ok, offs_dv, offs_dr, DQK, DV, BLOCK_DV, BLOCK_DR, True)


@triton.jit(do_not_specialize_on_alignment=FWD_INT_SCALARS)
def mla_fwd_kernel(
    Q, KV, KV_V, SEQLENS, BLOCK_TABLE, INDICES, KV_SCALE,  # inputs (absent ones: placeholders; KV_V is KV)
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_ORDER, KV_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask (BLOCK_SPARSE)
    seqlen_q, fixed_len, capacity, num_pages, topk, sm_scale,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_ks, stride_tb, stride_ib, stride_is,
    stride_on, stride_ob, stride_os, stride_oh, stride_ln, stride_lb, stride_ls, stride_lh,
    window_left, window_right, mask_stride_b, mask_max, tok_stride_b,  # runtime scalars
    O, LSE,  # outputs: final (out in q's dtype, lse) or float32 split partials, by their strides
    HEADS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, TOKEN_ROWS: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr, CAUSAL: tl.constexpr, SPARSE: tl.constexpr,
    HAS_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, POSITIVE_SCALE: tl.constexpr, QO_ALIGN: tl.constexpr,
    KV_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr, SEPARATE_V: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, HAS_LOCAL: tl.constexpr, MASK_GLOBAL: tl.constexpr,
    MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, PAIRS: tl.constexpr, WIDEN_ASM: tl.constexpr,
):
    """Grid ``(row blocks, num_splits, batch)``; the row blocks of one (sequence, split) are adjacent in launch
    order, so the programs reading the same latent tiles run together (L2). Causal grids start with the last
    row block (the longest).

    Sequence ``b`` has ``SEQLENS[b]`` keys (clamped to ``[0, capacity]``), or ``fixed_len``; query token i
    sits on key ``i + length - seqlen_q``. Key row j of sequence b is ``KV[page * stride_kp + slot *
    stride_ks]`` (``cache_slots``: paged through ``BLOCK_TABLE``, else page b, slot j). SPARSE: token i's
    keys are ``INDICES[b * stride_ib + i * stride_is + 0 .. topk - 1]``. Writes ``O[split, b, i, h, :]`` and
    ``LSE[split, b, i, h]`` through their strides (split strides 0 when the result is final). BLOCK_DV and
    BLOCK_DR (>= 16, unused when ``DQK == DV``) are the padded widths of the value columns and of the rest.
    Strides are multiples of QO_ALIGN (q, out), KV_ALIGN (cache) and LSE_ALIGN (lse) elements.

    PAIRS (FP8 caches, 16-bit queries, even dims and strides, a 2-byte aligned cache): the latent is read as
    16-bit column pairs, staged once by the pipeline and widened into both dots' operands as they are loaded
    from shared memory (:func:`pair_scores`); q k^T and p @ V run in f16 on q's and V's even and odd columns
    (two accumulators, joined at the end). WIDEN_ASM: widen in inline PTX (compiled kernels).
    SEPARATE_V (FP8 caches without PAIRS): ``KV_V`` is the cache again, and ``p @ V`` reads its value tile
    through it. A tile that feeds both dots (q k^T through a transpose, and p @ V) after widening is loaded
    into registers, not staged through shared memory by cp.async; loaded through a second pointer the value
    tile is a load of its own with one dot after it, which Triton's pipeliner stages (sm_90, H=16, 32 keys:
    its rows go through a shared-memory buffer, 189 -> 165 registers). Its second read of the rows comes
    from L2. With 16-bit caches the one tile serves both dots from shared memory, and KV_V is unused.

    BLOCK_SPARSE (prefill, one split): the grid spans whole mask query blocks (``MASK_QB * HEADS`` rows each,
    a multiple of BLOCK_M) and takes them in the mask's longest-first ``Q_ORDER``; a program walks the full
    key blocks of its query block (``FULL_KV_*``, batch stride ``mask_stride_b``, lists ``mask_max`` wide),
    then the partial ones (``KV_*``) through the element test (band ``window_left`` / ``window_right`` and
    HAS_LOCAL as in the attention kernels, token words ``TOK_Q`` / ``TOK_K`` of batch stride
    ``tok_stride_b``, bits). The plan picks BLOCK_N dividing MASK_KB."""
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, QO_ALIGN)
    stride_ob, stride_os, stride_oh = aligned_strides(stride_ob, stride_os, stride_oh, QO_ALIGN)
    stride_on = aligned(stride_on, QO_ALIGN)
    stride_kp = aligned(stride_kp, KV_ALIGN)
    stride_ks = aligned(stride_ks, KV_ALIGN)
    stride_lb, stride_ls, stride_lh = aligned_strides(stride_lb, stride_ls, stride_lh, LSE_ALIGN)
    stride_ln = aligned(stride_ln, LSE_ALIGN)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b = tl.program_id(2)
    if BLOCK_SPARSE:
        pid_m = mask_row_block(pid_m, Q_ORDER + b * mask_stride_b, seqlen_q, HEADS, BLOCK_M, MASK_QB)
        if pid_m * BLOCK_M >= seqlen_q * HEADS:  # past the rows of a ragged last query block
            return
    elif CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    tok, h, row_ok, tok_first, tok_last = row_block(pid_m, seqlen_q, HEADS, BLOCK_M, TOKEN_ROWS)
    if HAS_SEQLENS:
        length = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)
    else:
        length = fixed_len + b * 0
    diag = length - seqlen_q

    Q_row = Q + (tl.cast(b, tl.int64) * stride_qb + tl.cast(tok, tl.int64) * stride_qs + h * stride_qh)  # [M]
    q_v, q_r = load_query(Q_row, row_ok, DQK, DV, BLOCK_DV, BLOCK_DR)
    qk_scale, _ = score_params(sm_scale, 0.0, False)
    if HAS_SCALE:
        qk_scale = qk_scale * tl.load(KV_SCALE).to(tl.float32)
    rope_ratio = 1.0
    if KV.dtype.element_ty.is_fp8() and Q.dtype.element_ty == tl.bfloat16:
        # FP8 widens to f16 in one instruction per pair, to bf16 in two: score against f16 queries
        q_v, inv_v = f16_query(q_v)
        if DQK > DV:
            q_r, inv_r = f16_query(q_r)
            rope_ratio = inv_v / inv_r
            qk_scale = qk_scale * inv_r
        else:
            qk_scale = qk_scale * inv_v
    if PAIRS:  # q's even and odd columns, against the latent's (see pair_scores)
        q_v, q_vo = tl.split(tl.reshape(q_v, [BLOCK_M, BLOCK_DV // 2, 2]))
        if DQK > DV:
            q_r, q_ro = tl.split(tl.reshape(q_r, [BLOCK_M, BLOCK_DR // 2, 2]))
        else:
            q_ro = q_r
    else:
        q_vo = q_v
        q_ro = q_r
    m_i, l_i = softmax_init(Q, h, BLOCK_M, False)
    ACC_D: tl.constexpr = BLOCK_DV // 2 if PAIRS else BLOCK_DV  # PAIRS: V's even / odd columns apart
    acc = tl.zeros([BLOCK_M, ACC_D], dtype=tl.float32)
    acc_odd = acc

    if SPARSE:  # one token per row block (TOKEN_ROWS): its list, split evenly
        IDX_ROW = INDICES + (tl.cast(b, tl.int64) * stride_ib + tl.cast(tok_first, tl.int64) * stride_is)
        n_steps = tl.cdiv(topk, BLOCK_N)
        s_lo = (split * n_steps) // n_splits
        s_hi = ((split + 1) * n_steps) // n_splits
        acc, acc_odd, m_i, l_i = mla_fwd_steps(
            acc, acc_odd, m_i, l_i, q_v, q_vo, q_r, q_ro, KV, KV_V, BLOCK_TABLE, IDX_ROW, b, s_lo, s_hi, tok, diag,
            length, num_pages, topk, qk_scale, rope_ratio, stride_tb, stride_kp, stride_ks, Q, Q, Q, tok, tok,
            window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DV, BLOCK_DR, PAGED, PAGE_SIZE, True, CAUSAL, True,
            DOT_PRECISION, POSITIVE_SCALE, SEPARATE_V, False, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL, MASK_DOC,
            MASK_BITS, PAIRS, WIDEN_ASM)
    elif BLOCK_SPARSE:  # this query block's row of the mask's lists: full key blocks, then partial ones
        qb = tok_first // MASK_QB
        row = tl.cast(b * mask_stride_b + qb, tl.int64)
        lists = row * mask_max
        tok_b = tl.cast(b, tl.int64) * tok_stride_b
        tq = fixed_tokens(TOK_Q + tok_b, TOK_K + tok_b, tok[:, None], row_ok[:, None], MASK_GLOBAL, MASK_DOC)
        m_local = tok - qb * MASK_QB
        for part in tl.static_range(2):
            NUM = FULL_KV_NUM if part == 0 else KV_NUM
            IDX = FULL_KV_IDX if part == 0 else KV_IDX
            acc, acc_odd, m_i, l_i = mla_fwd_steps(
                acc, acc_odd, m_i, l_i, q_v, q_vo, q_r, q_ro, KV, KV_V, BLOCK_TABLE, IDX + lists, b, 0,
                list_length(NUM, row, mask_max) * (MASK_KB // BLOCK_N), tok, diag, length, num_pages, topk,
                qk_scale, rope_ratio, stride_tb, stride_kp, stride_ks, KV_BITS_IDX + lists, BITS, TOK_K + tok_b, tq,
                m_local, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DV, BLOCK_DR, PAGED, PAGE_SIZE,
                part == 1, False, False, DOT_PRECISION, POSITIVE_SCALE, SEPARATE_V, True, MASK_QB, MASK_KB,
                HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, PAIRS, WIDEN_ASM)
    else:
        # key blocks visible from the rows' tokens, split evenly; [full_lo, full_hi) need no mask
        lo, full_lo, full_hi, hi = kv_key_range(tok_first, tok_last, diag, length, _NO_LEFT_EDGE, 0, BLOCK_N, CAUSAL)
        n_blk = hi - lo
        s_lo = lo + (split * n_blk) // n_splits
        s_hi = lo + ((split + 1) * n_blk) // n_splits
        # two segments: fully visible blocks, then the masked tail (causal diagonal, ragged end); the tail is
        # empty for most splits and a branch skips its loop's prologue (see decode_fwd_kernel)
        bounds = (full_lo, full_hi, hi)
        for seg in tl.static_range(2):
            seg_lo = tl.maximum(bounds[seg], s_lo)
            seg_hi = tl.minimum(bounds[seg + 1], s_hi)
            if seg == 0 or seg_lo < seg_hi:
                acc, acc_odd, m_i, l_i = mla_fwd_steps(
                    acc, acc_odd, m_i, l_i, q_v, q_vo, q_r, q_ro, KV, KV_V, BLOCK_TABLE, Q, b, seg_lo, seg_hi, tok,
                    diag, length, num_pages, topk, qk_scale, rope_ratio, stride_tb, stride_kp, stride_ks, Q, Q, Q,
                    tok, tok, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DV, BLOCK_DR, PAGED, PAGE_SIZE,
                    seg == 1, CAUSAL, False, DOT_PRECISION, POSITIVE_SCALE, SEPARATE_V, False, MASK_QB, MASK_KB,
                    HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, PAIRS, WIDEN_ASM)
    if PAIRS:  # columns 2j and 2j + 1 side by side again
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, BLOCK_DV])
    out, lse = softmax_finalize(acc, m_i, l_i)
    if HAS_SCALE:
        out = out * tl.load(KV_SCALE).to(tl.float32)

    o_row = (tl.cast(split, tl.int64) * stride_on + tl.cast(b, tl.int64) * stride_ob
             + tl.cast(tok, tl.int64) * stride_os + h * stride_oh)  # [M]
    offs_dv = tl.arange(0, BLOCK_DV)
    tl.store(O + o_row[:, None] + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv < DV)[None, :])
    l_row = (tl.cast(split, tl.int64) * stride_ln + tl.cast(b, tl.int64) * stride_lb
             + tl.cast(tok, tl.int64) * stride_ls + h * stride_lh)
    tl.store(LSE + l_row, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------- backward

DQ_INT_SCALARS = (
    "seqlen_q", "seqlen_k", "topk", "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_ib",
    "stride_is", "stride_dob", "stride_dos", "stride_doh", "stride_lb", "stride_lh", "stride_dqb", "stride_dqs",
    "stride_dqh", "window_left", "window_right", "mask_stride_b", "mask_max", "tok_stride_b")
DKV_INT_SCALARS = (
    "seqlen_q", "seqlen_k", "n_words", "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks",
    "stride_dob", "stride_dos", "stride_doh", "stride_lb", "stride_lh", "stride_mb", "stride_ms", "stride_dp",
    "stride_db", "stride_ds", "window_left", "window_right", "mask_t_stride_b", "mask_t_max", "tok_stride_b")
BITMAP_INT_SCALARS = ("seqlen_q", "seqlen_k", "topk", "stride_ib", "stride_is", "n_words")
SUM_INT_SCALARS = ("n_parts", "n_elements")


@triton.jit
def row_stats(LSE2, DELTA, b, tok, h, row_ok, seqlen_q, stride_lb, stride_lh):
    """The forward's lse (log2 units, +inf for rows that saw nothing or padding rows: p = 0) and the
    backward's delta of the rows (both in lse's (B, H, Sq) layout)."""
    off = tl.cast(b, tl.int64) * stride_lb + tl.cast(h, tl.int64) * stride_lh + tok
    lse2 = tl.load(LSE2 + off, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + off, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def mla_dq_steps(
    dq_v, dq_r, q_v, q_r, do, lse2, delta, KV, IDX_ROW, b, step_lo, step_hi, tok, diag, length, topk, qk_scale,
    stride_kb, stride_ks, BIT_ROWS, BITS, TOK_K, tq, m_local, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    APPLY_MASK: tl.constexpr, CAUSAL: tl.constexpr, SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr,
):
    """Accumulate dQ [M, DQK] (value columns and rest apart, unscaled) over the forward's steps
    ``[step_lo, step_hi)`` (key sources as :func:`mla_fwd_steps`): ``ds = p * (dout kv[:, :DV]^T - delta)``,
    ``dq += ds kv``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    for step in range(step_lo, step_hi):
        if SPARSE:
            offs_k, key_ok = sparse_keys(IDX_ROW, step, topk, length, BLOCK_N)
        else:
            if BLOCK_SPARSE:
                slot, sub, n_start = list_step(IDX_ROW, step, length, BLOCK_N, MASK_KB)
            else:
                n_start = step * BLOCK_N
            offs_k = n_start + offs_n
            key_ok = offs_k < length
        elem_ok = None
        if BLOCK_SPARSE and APPLY_MASK:
            elem_ok = kv_step_mask(tok, m_local, tq, n_start, sub + offs_n, slot, BIT_ROWS, BITS, TOK_K, length, diag,
                                   window_left, window_right, BLOCK_N, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL,
                                   MASK_DOC, MASK_BITS)
        row = KV + tl.cast(b, tl.int64) * stride_kb + tl.cast(offs_k, tl.int64) * stride_ks
        kv_v, kv_r = load_latent(row, key_ok, offs_dv, offs_dr, DQK, DV, BLOCK_DV, BLOCK_DR, APPLY_MASK)
        qk = latent_scores(q_v, q_r, kv_v, kv_r, 1.0, DQK > DV, DOT_PRECISION)
        p = tl.exp2(qk * qk_scale - lse2[:, None])
        if APPLY_MASK:
            p = tl.where(key_mask(tok, offs_k, key_ok, diag, CAUSAL, elem_ok), p, 0.0)
        dp = tl.dot(do, tl.trans(kv_v), input_precision=DOT_PRECISION)
        ds = score_grad(p, dp, delta[:, None], p, False).to(kv_v.dtype)
        dq_v = tl.dot(ds, kv_v, dq_v, input_precision=DOT_PRECISION)
        if DQK > DV:
            dq_r = tl.dot(ds, kv_r, dq_r, input_precision=DOT_PRECISION)
    return dq_v, dq_r


@triton.jit(do_not_specialize_on_alignment=DQ_INT_SCALARS)
def mla_bwd_dq_kernel(
    Q, KV, DO, LSE2, DELTA, INDICES,  # inputs
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_ORDER, KV_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask (BLOCK_SPARSE)
    seqlen_q, seqlen_k, topk, sm_scale, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_ib,
    stride_is, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_dqb, stride_dqs,
    stride_dqh, window_left, window_right, mask_stride_b, mask_max, tok_stride_b,  # runtime scalars
    DQ,  # output: dq in q's layout and dtype
    HEADS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, TOKEN_ROWS: tl.constexpr, CAUSAL: tl.constexpr,
    SPARSE: tl.constexpr, DOT_PRECISION: tl.constexpr, QO_ALIGN: tl.constexpr, KV_ALIGN: tl.constexpr,
    LSE_ALIGN: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_LOCAL: tl.constexpr, MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr,
):
    """dQ of one row block (grid and key sources as :func:`mla_fwd_kernel`, one split): the forward's steps
    again, with the forward's lse. Strides are multiples of QO_ALIGN (q, dout, dq), KV_ALIGN (kv) and
    LSE_ALIGN (lse, delta) elements."""
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, QO_ALIGN)
    stride_dob, stride_dos, stride_doh = aligned_strides(stride_dob, stride_dos, stride_doh, QO_ALIGN)
    stride_dqb, stride_dqs, stride_dqh = aligned_strides(stride_dqb, stride_dqs, stride_dqh, QO_ALIGN)
    stride_kb = aligned(stride_kb, KV_ALIGN)
    stride_ks = aligned(stride_ks, KV_ALIGN)
    stride_lb = aligned(stride_lb, LSE_ALIGN)
    stride_lh = aligned(stride_lh, LSE_ALIGN)
    pid_m = tl.program_id(0)
    b = tl.program_id(2)
    if BLOCK_SPARSE:
        pid_m = mask_row_block(pid_m, Q_ORDER + b * mask_stride_b, seqlen_q, HEADS, BLOCK_M, MASK_QB)
        if pid_m * BLOCK_M >= seqlen_q * HEADS:
            return
    elif CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    tok, h, row_ok, tok_first, tok_last = row_block(pid_m, seqlen_q, HEADS, BLOCK_M, TOKEN_ROWS)
    length = seqlen_k + b * 0
    diag = length - seqlen_q
    b64 = tl.cast(b, tl.int64)
    tok64 = tl.cast(tok, tl.int64)
    q_v, q_r = load_query(Q + (b64 * stride_qb + tok64 * stride_qs + h * stride_qh), row_ok, DQK, DV, BLOCK_DV,
                          BLOCK_DR)
    offs_dv = tl.arange(0, BLOCK_DV)
    DO_row = DO + (b64 * stride_dob + tok64 * stride_dos + h * stride_doh)
    do = load_tile(DO_row[:, None] + offs_dv[None, :], row_ok, offs_dv < DV, True, BLOCK_DV != DV)
    lse2, delta = row_stats(LSE2, DELTA, b, tok, h, row_ok, seqlen_q, stride_lb, stride_lh)
    qk_scale, _ = score_params(sm_scale, 0.0, False)
    dq_v = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    dq_r = tl.zeros([BLOCK_M, BLOCK_DR], dtype=tl.float32)
    if SPARSE:
        IDX_ROW = INDICES + (b64 * stride_ib + tl.cast(tok_first, tl.int64) * stride_is)
        dq_v, dq_r = mla_dq_steps(dq_v, dq_r, q_v, q_r, do, lse2, delta, KV, IDX_ROW, b, 0, tl.cdiv(topk, BLOCK_N),
                                  tok, diag, length, topk, qk_scale, stride_kb, stride_ks, Q, Q, Q, tok, tok,
                                  window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DV, BLOCK_DR, True, CAUSAL, True,
                                  DOT_PRECISION, False, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS)
    elif BLOCK_SPARSE:  # the forward's lists (see mla_fwd_kernel)
        qb = tok_first // MASK_QB
        row = tl.cast(b * mask_stride_b + qb, tl.int64)
        lists = row * mask_max
        tok_b = b64 * tok_stride_b
        tq = fixed_tokens(TOK_Q + tok_b, TOK_K + tok_b, tok[:, None], row_ok[:, None], MASK_GLOBAL, MASK_DOC)
        m_local = tok - qb * MASK_QB
        for part in tl.static_range(2):
            NUM = FULL_KV_NUM if part == 0 else KV_NUM
            IDX = FULL_KV_IDX if part == 0 else KV_IDX
            dq_v, dq_r = mla_dq_steps(dq_v, dq_r, q_v, q_r, do, lse2, delta, KV, IDX + lists, b, 0,
                                      list_length(NUM, row, mask_max) * (MASK_KB // BLOCK_N), tok, diag, length, topk,
                                      qk_scale, stride_kb, stride_ks, KV_BITS_IDX + lists, BITS, TOK_K + tok_b, tq,
                                      m_local, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DV, BLOCK_DR,
                                      part == 1, False, False, DOT_PRECISION, True, MASK_QB, MASK_KB, HAS_LOCAL,
                                      MASK_GLOBAL, MASK_DOC, MASK_BITS)
    else:
        lo, full_lo, full_hi, hi = kv_key_range(tok_first, tok_last, diag, length, _NO_LEFT_EDGE, 0, BLOCK_N, CAUSAL)
        bounds = (full_lo, full_hi, hi)
        for seg in tl.static_range(2):
            dq_v, dq_r = mla_dq_steps(dq_v, dq_r, q_v, q_r, do, lse2, delta, KV, Q, b, bounds[seg], bounds[seg + 1],
                                      tok, diag, length, topk, qk_scale, stride_kb, stride_ks, Q, Q, Q, tok, tok,
                                      window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DV, BLOCK_DR, seg == 1,
                                      CAUSAL, False, DOT_PRECISION, False, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL,
                                      MASK_DOC, MASK_BITS)
    scale = tl.cast(sm_scale, tl.float32)
    DQ_row = DQ + (b64 * stride_dqb + tok64 * stride_dqs + h * stride_dqh)
    tl.store(DQ_row[:, None] + offs_dv[None, :], (dq_v * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv < DV)[None, :])
    if DQK > DV:
        offs_dr = tl.arange(0, BLOCK_DR)
        tl.store(DQ_row[:, None] + DV + offs_dr[None, :], (dq_r * scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dr < DQK - DV)[None, :])


@triton.jit
def selected_keys(BITMAP, b, tok, offs_k, row_ok, stride_mb, stride_ms):
    """Bool [N, M]: key ``offs_k[n]`` is in the top-k list of row m's token (bit ``k % 32`` of word
    ``k // 32`` of the token's bitmap row)."""
    words = tl.load(BITMAP + (tl.cast(b, tl.int64) * stride_mb + tl.cast(tok, tl.int64)[None, :] * stride_ms
                              + (offs_k // 32)[:, None]), mask=row_ok[None, :], other=0)
    return ((words >> (offs_k % 32)[:, None]) & 1) != 0


@triton.jit
def mla_dkv_step(
    dkv_v, dkv_r, kv_v, kv_r, Q, DO, LSE2, DELTA, sel, b, tok, h, row_ok, offs_k, diag, seqlen_q, qk_scale, sm_scale,
    stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, APPLY_MASK: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One row block's terms of a key block's dKV, on S^T [N, M] so that both products come out key-major:
    ``dkv += scale * ds^T [q_v, q_r] + [p^T dout, 0]``. ``sel`` [N, M] (or broadcastable): the pairs the mask
    keeps besides the causal rule (APPLY_MASK)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = tl.cast(b, tl.int64)
    tok64 = tl.cast(tok, tl.int64)
    q_v, q_r = load_query(Q + (b64 * stride_qb + tok64 * stride_qs + h * stride_qh), row_ok, DQK, DV, BLOCK_DV,
                          BLOCK_DR)
    DO_row = DO + (b64 * stride_dob + tok64 * stride_dos + h * stride_doh)
    do = load_tile(DO_row[:, None] + offs_dv[None, :], row_ok, offs_dv < DV, True, BLOCK_DV != DV)
    lse2, delta = row_stats(LSE2, DELTA, b, tok, h, row_ok, seqlen_q, stride_lb, stride_lh)
    st = latent_scores(kv_v, kv_r, q_v, q_r, 1.0, DQK > DV, DOT_PRECISION)  # [N, M]
    pt = tl.exp2(st * qk_scale - lse2[None, :])  # padding rows: lse2 = +inf, p = 0
    if APPLY_MASK:
        ok = sel
        if CAUSAL:
            ok = ok & (offs_k[:, None] <= (tok + diag)[None, :])
        pt = tl.where(ok, pt, 0.0)
    dpt = tl.dot(kv_v, tl.trans(do), input_precision=DOT_PRECISION)  # [N, M]
    dst = (score_grad(pt, dpt, delta[None, :], pt, False) * sm_scale).to(q_v.dtype)
    dkv_v = tl.dot(dst, q_v, dkv_v, input_precision=DOT_PRECISION)
    dkv_v = tl.dot(pt.to(do.dtype), do, dkv_v, input_precision=DOT_PRECISION)
    if DQK > DV:
        dkv_r = tl.dot(dst, q_r, dkv_r, input_precision=DOT_PRECISION)
    return dkv_v, dkv_r


@triton.jit
def mla_dkv_rows(
    dkv_v, dkv_r, kv_v, kv_r, Q, DO, LSE2, DELTA, BITMAP, b, rb_lo, rb_hi, offs_k, diag, seqlen_q, qk_scale,
    sm_scale, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh,
    stride_mb, stride_ms, IDX, BIT_ROWS, BITS, TOK_Q, tk, n_local, seqlen_k, window_left, window_right,
    HEADS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr, APPLY_MASK: tl.constexpr, CAUSAL: tl.constexpr, SPARSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    HAS_LOCAL: tl.constexpr, MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr,
):
    """Accumulate dKV [N, DQK] of one key block (value columns and rest apart) over the packed (token, head)
    row blocks ``[rb_lo, rb_hi)``. SPARSE: the mask is the top-k bitmap, and a row block whose tokens select
    none of the block's keys is skipped (its loads too).

    BLOCK_SPARSE: ``[rb_lo, rb_hi)`` are steps of a walk over the query blocks listed at ``IDX`` (one row of
    a block mask's transposed lists), ``MASK_QB * HEADS // BLOCK_M`` row blocks each; partial lists
    (APPLY_MASK) take the mask's element test on S^T [N, M] (``tk`` [N, 1] the keys' token words, ``n_local``
    [N] the keys within their mask block, ``BIT_ROWS`` the list's rows of ``BITS``)."""
    MASK_ROWS: tl.constexpr = MASK_QB * HEADS
    for it in range(rb_lo, rb_hi):
        if BLOCK_SPARSE:
            slot, sub, r_start = list_step(IDX, it, seqlen_q * HEADS, BLOCK_M, MASK_ROWS)
            rb = r_start // BLOCK_M
        else:
            rb = it
        tok, h, row_ok, tok_first, tok_last = row_block(rb, seqlen_q, HEADS, BLOCK_M, False)
        if SPARSE:
            sel = selected_keys(BITMAP, b, tok, offs_k, row_ok, stride_mb, stride_ms)
            if tl.max(sel.to(tl.int32)) > 0:
                dkv_v, dkv_r = mla_dkv_step(
                    dkv_v, dkv_r, kv_v, kv_r, Q, DO, LSE2, DELTA, sel, b, tok, h, row_ok, offs_k, diag, seqlen_q,
                    qk_scale, sm_scale, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh,
                    stride_lb, stride_lh, DQK, DV, BLOCK_DV, BLOCK_DR, True, CAUSAL, DOT_PRECISION)
        else:
            sel = row_ok[None, :]
            if BLOCK_SPARSE and APPLY_MASK:
                tq = mask_tokens(TOK_Q, tok[None, :], row_ok[None, :], MASK_GLOBAL == 2)  # [1, M] global queries
                bits_ok = None
                if MASK_BITS:
                    words = BITS + tl.cast(tl.load(BIT_ROWS + slot), tl.int64) * (MASK_QB * MASK_KB // 32)
                    bits_ok = mask_bits(words, (tok - (r_start // MASK_ROWS) * MASK_QB)[None, :], n_local[:, None],
                                        MASK_KB)
                sel = block_mask_visible(tok[None, :], offs_k[:, None], seqlen_k, diag, window_left, window_right,
                                         HAS_LOCAL, MASK_GLOBAL, MASK_DOC, tq, tk, bits_ok, True)  # [N, M]
            dkv_v, dkv_r = mla_dkv_step(
                dkv_v, dkv_r, kv_v, kv_r, Q, DO, LSE2, DELTA, sel, b, tok, h, row_ok, offs_k, diag,
                seqlen_q, qk_scale, sm_scale, stride_qb, stride_qs, stride_qh, stride_dob, stride_dos, stride_doh,
                stride_lb, stride_lh, DQK, DV, BLOCK_DV, BLOCK_DR, APPLY_MASK, CAUSAL, DOT_PRECISION)
    return dkv_v, dkv_r


@triton.jit
def row_list_steps(NUM, IDX, row, width, seqlen_q, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                   MASK_QB: tl.constexpr):
    """Steps of :func:`mla_dkv_rows` over row ``row`` of a block mask's transposed lists (``width`` wide):
    ``MASK_QB * HEADS // BLOCK_M`` row blocks per listed query block, fewer for the last query block when
    it reaches past the sequence (its row blocks past the last row are left out; the lists ascend, so it can
    only be the last entry)."""
    SPLIT: tl.constexpr = MASK_QB * HEADS // BLOCK_M
    n = list_length(NUM, row, width)
    last = list_block(tl.load(IDX + row * width + tl.maximum(n - 1, 0)), seqlen_q, MASK_QB)
    n_q = tl.cdiv(seqlen_q, MASK_QB)
    past = n_q * SPLIT - tl.cdiv(seqlen_q * HEADS, BLOCK_M)
    return n * SPLIT - tl.where((n > 0) & (last == n_q - 1), past, 0)


@triton.jit(do_not_specialize_on_alignment=DKV_INT_SCALARS)
def mla_bwd_dkv_kernel(
    Q, KV, DO, LSE2, DELTA, BITMAP,  # inputs
    Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, KV_ORDER, Q_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask (BLOCK_SPARSE)
    seqlen_q, seqlen_k, n_words, sm_scale, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_dob,
    stride_dos, stride_doh, stride_lb, stride_lh, stride_mb, stride_ms, stride_dp, stride_db,
    stride_ds, window_left, window_right, mask_t_stride_b, mask_t_max, tok_stride_b,  # runtime scalars
    DKV,  # output: dkv (kv's dtype, parts 1) or float32 partial sums (parts, B, Sk, DQK), by their strides
    HEADS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, CAUSAL: tl.constexpr, SPARSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, QO_ALIGN: tl.constexpr, KV_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr,
):
    """Grid ``(cdiv(seqlen_k, BLOCK_N), parts, batch)``: part p of key block n sums the row blocks of its
    share (rows of the flattened (token, head) list, BLOCK_M at a time) that can see the block (causal:
    tokens at or after ``n_start - diag``), masked ones first (the causal diagonal; SPARSE: all of them,
    through the top-k bitmap), then the fully visible ones. Keys past ``seqlen_k`` are computed and never
    stored. Strides are multiples of QO_ALIGN (q, dout), KV_ALIGN (kv, dkv) and LSE_ALIGN (lse, delta,
    bitmap) elements.

    BLOCK_SPARSE: the grid spans whole mask key blocks, taken in the mask's longest-first ``KV_ORDER``; part p
    sums its share of the steps over the query blocks of the block's transposed lists (``FULL_Q_*`` without
    mask arithmetic, then ``Q_*`` through the element test; batch stride ``mask_t_stride_b``, lists
    ``mask_t_max`` wide)."""
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, QO_ALIGN)
    stride_dob, stride_dos, stride_doh = aligned_strides(stride_dob, stride_dos, stride_doh, QO_ALIGN)
    stride_kb = aligned(stride_kb, KV_ALIGN)
    stride_ks = aligned(stride_ks, KV_ALIGN)
    stride_dp, stride_db, stride_ds = aligned_strides(stride_dp, stride_db, stride_ds, KV_ALIGN)
    stride_lb = aligned(stride_lb, LSE_ALIGN)
    stride_lh = aligned(stride_lh, LSE_ALIGN)
    stride_mb = aligned(stride_mb, LSE_ALIGN)
    stride_ms = aligned(stride_ms, LSE_ALIGN)
    pid_n = tl.program_id(0)
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    b = tl.program_id(2)
    if BLOCK_SPARSE:
        pid_n = sparse_key_block(pid_n, KV_ORDER + b * mask_t_stride_b, seqlen_k, BLOCK_N, MASK_KB)
        if pid_n * BLOCK_N >= seqlen_k:  # past the keys of a ragged last key block
            return
    n_start = pid_n * BLOCK_N
    offs_k = n_start + tl.arange(0, BLOCK_N)
    key_ok = offs_k < seqlen_k
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_dr = tl.arange(0, BLOCK_DR)
    row = KV + tl.cast(b, tl.int64) * stride_kb + tl.cast(offs_k, tl.int64) * stride_ks
    kv_v, kv_r = load_latent(row, key_ok, offs_dv, offs_dr, DQK, DV, BLOCK_DV, BLOCK_DR, True)
    diag = seqlen_k - seqlen_q
    qk_scale, _ = score_params(sm_scale, 0.0, False)
    scale = tl.cast(sm_scale, tl.float32)
    dkv_v = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    dkv_r = tl.zeros([BLOCK_N, BLOCK_DR], dtype=tl.float32)
    if BLOCK_SPARSE:
        kb = n_start // MASK_KB
        lrow = tl.cast(b * mask_t_stride_b + kb, tl.int64)
        lists = lrow * mask_t_max
        tok_b = tl.cast(b, tl.int64) * tok_stride_b
        tk = fixed_tokens(TOK_K + tok_b, TOK_Q + tok_b, offs_k[:, None], key_ok[:, None], MASK_GLOBAL, MASK_DOC)
        n_local = offs_k - kb * MASK_KB
        for lst in tl.static_range(2):  # full query blocks, then partial ones; each split evenly among the parts
            NUM = FULL_Q_NUM if lst == 0 else Q_NUM
            IDX = FULL_Q_IDX if lst == 0 else Q_IDX
            steps = row_list_steps(NUM, IDX, lrow, mask_t_max, seqlen_q, HEADS, BLOCK_M, MASK_QB)
            dkv_v, dkv_r = mla_dkv_rows(
                dkv_v, dkv_r, kv_v, kv_r, Q, DO, LSE2, DELTA, BITMAP, b, (part * steps) // n_parts,
                ((part + 1) * steps) // n_parts, offs_k, diag, seqlen_q, qk_scale, scale, stride_qb, stride_qs,
                stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_mb, stride_ms, IDX + lists,
                Q_BITS_IDX + lists, BITS, TOK_Q + tok_b, tk, n_local, seqlen_k, window_left, window_right, HEADS, DQK,
                DV, BLOCK_M, BLOCK_DV, BLOCK_DR, lst == 1, False, False, DOT_PRECISION, True, MASK_QB, MASK_KB,
                HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS)
    else:
        n_rows = seqlen_q * HEADS
        rb_all = tl.cdiv(n_rows, BLOCK_M)
        if CAUSAL:  # rows of tokens >= n_start - diag see the block; >= n_start + BLOCK_N - 1 - diag all of it
            rb_lo = (tl.minimum(tl.maximum(n_start - diag, 0), seqlen_q) * HEADS) // BLOCK_M
            rb_full = tl.cdiv(tl.minimum(tl.maximum(n_start + BLOCK_N - 1 - diag, 0), seqlen_q) * HEADS, BLOCK_M)
        else:
            rb_lo = n_start * 0
            rb_full = rb_lo
        if SPARSE:
            rb_full = rb_all
        rb_full = tl.maximum(rb_full, rb_lo)
        # this part's share of [rb_lo, rb_all)
        share = rb_all - rb_lo
        p_lo = rb_lo + (part * share) // n_parts
        p_hi = rb_lo + ((part + 1) * share) // n_parts
        bounds = (rb_lo, rb_full, rb_all)
        for seg in tl.static_range(2):
            dkv_v, dkv_r = mla_dkv_rows(
                dkv_v, dkv_r, kv_v, kv_r, Q, DO, LSE2, DELTA, BITMAP, b, tl.maximum(bounds[seg], p_lo),
                tl.minimum(bounds[seg + 1], p_hi), offs_k, diag, seqlen_q, qk_scale, scale, stride_qb, stride_qs,
                stride_qh, stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_mb, stride_ms, Q, Q, Q, Q,
                offs_k, offs_k, seqlen_k, window_left, window_right, HEADS, DQK, DV, BLOCK_M, BLOCK_DV, BLOCK_DR,
                seg == 0, CAUSAL, SPARSE, DOT_PRECISION, False, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL, MASK_DOC,
                MASK_BITS)
    D_row = DKV + (tl.cast(part, tl.int64) * stride_dp + tl.cast(b, tl.int64) * stride_db
                   + tl.cast(offs_k, tl.int64) * stride_ds)
    tl.store(D_row[:, None] + offs_dv[None, :], dkv_v.to(DKV.dtype.element_ty),
             mask=key_ok[:, None] & (offs_dv < DV)[None, :])
    if DQK > DV:
        tl.store(D_row[:, None] + DV + offs_dr[None, :], dkv_r.to(DKV.dtype.element_ty),
                 mask=key_ok[:, None] & (offs_dr < DQK - DV)[None, :])


@triton.jit(do_not_specialize_on_alignment=BITMAP_INT_SCALARS)
def mla_index_bitmap_kernel(
    INDICES,  # input
    seqlen_q, seqlen_k, topk, stride_ib, stride_is, n_words,  # runtime scalars
    BITMAP,  # output (zero-filled): int32 (B, Sq, n_words), bit k % 32 of word k // 32 = key k selected
    CAUSAL: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid ``(seqlen_q, batch)``: the top-k list of one query token as a bitmap over the keys, for the dKV
    kernel's masks. Entries that the forward skips (-1, past the sequence, after the token when causal) set
    nothing. Integer OR commutes exactly: the result does not depend on the order of the atomics."""
    t = tl.program_id(0)
    b = tl.program_id(1)
    diag = seqlen_k - seqlen_q
    IDX_ROW = INDICES + (tl.cast(b, tl.int64) * stride_ib + tl.cast(t, tl.int64) * stride_is)
    ROW = BITMAP + (tl.cast(b, tl.int64) * seqlen_q + t) * n_words
    offs = tl.arange(0, BLOCK)
    for start in range(0, topk, BLOCK):
        slot = start + offs
        idx = tl.load(IDX_ROW + slot, mask=slot < topk, other=-1)
        ok = (idx >= 0) & (idx < seqlen_k)
        if CAUSAL:
            ok = ok & (idx <= t + diag)
        bit = tl.full([BLOCK], 1, tl.int32) << (idx % 32)
        tl.atomic_or(ROW + idx // 32, bit, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize_on_alignment=SUM_INT_SCALARS)
def mla_sum_parts_kernel(
    PARTS,  # input: float32 (n_parts, n_elements)
    n_parts, n_elements,  # runtime scalars
    OUT,  # output: (n_elements,) in its dtype
    BLOCK: tl.constexpr,
):
    """``OUT = sum_p PARTS[p]``, parts added in order (deterministic)."""
    offs = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_elements
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in range(n_parts):
        acc += tl.load(PARTS + tl.cast(p, tl.int64) * n_elements + offs, mask=ok, other=0.0)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=ok)
