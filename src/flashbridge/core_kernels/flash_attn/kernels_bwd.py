"""FlashAttention backward kernels (``@triton.jit`` only; launches in plan.py).

The forward saved ``out`` and ``lse`` only; the backward recomputes ``p = exp(s - lse)`` blockwise:

1. ``attn_bwd_preprocess_kernel``: ``delta = rowsum(dout * out) - dlse`` and ``lse2`` (lse in log2 units,
   +inf for rows that saw nothing), both in lse's layout.
2. ``attn_bwd_dkdv_kernel``: one program per (key block, kv head, sequence) loops over the query heads of
   its GQA group and over the query blocks that see its keys, accumulating dK and dV in registers:
   ``dv += p^T dout``, ``dk += ds^T q`` with ``ds = p * (dout v^T - delta)``. Each dK/dV element is written
   by exactly one program and summed in a fixed order: deterministic, no atomics, no GQA reduction pass.
3. ``attn_bwd_dq_kernel``: one program per (query block, query head, sequence) loops over key blocks:
   ``dq += ds k``.
   ``attn_bwd_kernel`` runs 2. and 3. in one launch (``AttentionConfig.fused_backward``): its first
   programs are the dK/dV grid, the rest the dQ grid, so the dQ programs fill the SMs that the dK/dV grid's
   last wave leaves idle (FlexAttention's backward is organised the same way). Same code, same results.
4. ``attn_bwd_sink_kernel`` (with sinks): ``dsink_h = -sum_i exp(sink_h - lse_i) * delta_i``, one program
   per head summing its rows in a fixed order; also writes the per-sequence partial sums.
5. ``attn_bwd_alibi_kernel`` (when the ALiBi slopes need a gradient): ``dslope_h = -sum_ij dS_ij |i + diag -
   j|``; the dQ programs, which own their rows' dS, each store their block's term, and one program per head
   sums them in a fixed order.

Both main kernels walk their loop axis in three segments as the forward does (masked, full, masked); in the
dK/dV kernel the first masked segment holds only query blocks inside the sequence, whose loads need no row
checks (the causal diagonal), and the last one any block that may reach past the sequence's end.
BLOCK_SPARSE (a flashbridge.masks.BlockMask): the dQ loop walks the mask's query-major lists as the forward
does, the dK/dV loop its transposed (key-major) lists; full blocks first, then partial ones through the
mask's element test.
"""
import triton
import triton.language as tl

from .kernels_common import (LOG2E, aligned, aligned_strides, alibi_slope2, block_mask_visible, block_schedule,
                             dropout_block, dropout_multiplier, dropout_state, fill_uncovered_rows, fixed_tokens,
                             grid_schedule, kv_block_range, kv_step_mask, load_rows, load_tile, lse_log2, mask_bits,
                             mask_tokens, q_block_range, query_block, query_block_at, recompute_p,
                             score_grad, score_params, seq_range, sparse_key_block, sparse_query_block_at, store_rows,
                             unravel_grid, list_block, list_length, list_start_ahead)
from .plan import TAIL_EDGE, TAIL_RAGGED

# TAIL_BLOCKS bits (the plan's _tail_blocks): constexprs, as a jit function reads globals
TAIL_EDGE_BIT = tl.constexpr(TAIL_EDGE)
TAIL_RAGGED_BIT = tl.constexpr(TAIL_RAGGED)

# Runtime integers of each kernel: no divisibility is inferred from their values (jax-triton would not infer
# it; the plan states it through STRIDE_ALIGN / LSE_ALIGN), so that both front-ends compile the same kernel.
_LSE_STRIDES = ("stride_lb", "stride_lh")
PREPROCESS_INT_SCALARS = ("seqlen_q", "total_q", "stride_ob", "stride_os", "stride_oh", "stride_dob", "stride_dos",
                          "stride_doh", *_LSE_STRIDES)
_MASK_SCALARS = ("mask_stride_b", "mask_stride_h", "mask_max", "mask_t_stride_b", "mask_t_stride_h", "mask_t_max",
                 "tok_stride_b")
_MAIN_INT_SCALARS = (
    "seqlen_q", "seqlen_k", "total_q", "total_k", "window_left", "window_right",
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
    "stride_vh", "stride_dob", "stride_dos", "stride_doh", *_LSE_STRIDES, "stride_ab", *_MASK_SCALARS)
DKDV_INT_SCALARS = (*_MAIN_INT_SCALARS, "stride_dkb", "stride_dks", "stride_dkh", "stride_dvb", "stride_dvs",
                    "stride_dvh")
DQ_INT_SCALARS = (*_MAIN_INT_SCALARS, "stride_dqb", "stride_dqs", "stride_dqh")
FUSED_INT_SCALARS = (*DKDV_INT_SCALARS, "stride_dqb", "stride_dqs", "stride_dqh", "heads_kv", "n_seqs")
SINK_INT_SCALARS = ("n_seqs", "seqlen_q", "total_q", *_LSE_STRIDES)
ALIBI_INT_SCALARS = ("n_seqs", "n_blocks")


@triton.jit(do_not_specialize_on_alignment=PREPROCESS_INT_SCALARS)
def attn_bwd_preprocess_kernel(
    OUT, DO, DLSE, LSE, CU_Q,  # inputs
    seqlen_q, total_q, stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh,
    stride_lb, stride_lh,  # runtime scalars
    DELTA, LSE2,  # outputs, float32, lse layout
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
    IS_VARLEN: tl.constexpr, STRIDE_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr,
):
    stride_ob, stride_os, stride_oh = aligned_strides(stride_ob, stride_os, stride_oh, STRIDE_ALIGN)
    stride_dob, stride_dos, stride_doh = aligned_strides(stride_dob, stride_dos, stride_doh, STRIDE_ALIGN)
    stride_lb = aligned(stride_lb, LSE_ALIGN)
    stride_lh = aligned(stride_lh, LSE_ALIGN)
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, len_q = seq_range(CU_Q, b, seqlen_q, total_q, IS_VARLEN)
    m_start = pid_m * BLOCK_M
    if m_start >= len_q:
        return
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    row_ok = m_start + offs_r < len_q
    row0 = tl.cast(q_start + m_start, tl.int64)
    o = load_tile(OUT + tl.cast(b, tl.int64) * stride_ob + row0 * stride_os + h * stride_oh
                  + offs_r[:, None] * stride_os + offs_d[None, :], row_ok, offs_d < DV, True, BLOCK_DV != DV)
    do = load_tile(DO + tl.cast(b, tl.int64) * stride_dob + row0 * stride_dos + h * stride_doh
                   + offs_r[:, None] * stride_dos + offs_d[None, :], row_ok, offs_d < DV, True, BLOCK_DV != DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [M]
    l_ptrs = tl.cast(b, tl.int64) * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start + m_start + offs_r
    if HAS_DLSE:
        # d lse_i / d s_ij = p_ij: a gradient arriving at lse folds into delta.
        delta -= tl.load(DLSE + l_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(DELTA + l_ptrs, delta, mask=row_ok)
    # lse in log2 units once per row here, not once per (row, key block) in the dK/dV loop, where each
    # thread would convert every row its slice of the [N, M] tile touches
    tl.store(LSE2 + l_ptrs, lse_log2(tl.load(LSE + l_ptrs, mask=row_ok, other=float("-inf"))), mask=row_ok)


@triton.jit
def _column_parts(BLOCK_D: tl.constexpr, part, COL_SPLIT: tl.constexpr):
    """Column offsets of dK/dV part ``part`` of COL_SPLIT (all BLOCK_D columns without a split) and of the
    other half (the same offsets without a split, unused)."""
    offs = tl.arange(0, BLOCK_D // COL_SPLIT)
    offs_o = offs
    if COL_SPLIT > 1:
        offs_o = offs + (1 - part) * (BLOCK_D // COL_SPLIT)
        offs += part * (BLOCK_D // COL_SPLIT)
    return offs, offs_o


@triton.jit
def _load_parts(A, stride_a, offs_a, offs_a_o, DA: tl.constexpr, BLOCK_A: tl.constexpr,
                B, stride_b, offs_b, offs_b_o, DB: tl.constexpr, BLOCK_B: tl.constexpr,
                start, offs, rows_ok, CHECK_ROWS: tl.constexpr, COL_SPLIT: tl.constexpr):
    """Rows ``start + offs`` of two arrays (q and dO, or k and v) as :func:`load_rows` reads them: this
    program's columns (``offs_a`` / ``offs_b``) and, with a column split, the other half's (``offs_*_o``;
    without one the same tiles again, unused). Both arrays first, then both other halves. BLOCK_A / BLOCK_B
    (the padded widths) decide whether any column can lie past DA / DB, for halves too. Returns (a, b, a_o,
    b_o)."""
    a = load_rows(A, start, offs, stride_a, offs_a, rows_ok, DA, BLOCK_A, CHECK_ROWS)
    b = load_rows(B, start, offs, stride_b, offs_b, rows_ok, DB, BLOCK_B, CHECK_ROWS)
    a_o, b_o = a, b
    if COL_SPLIT > 1:
        a_o = load_rows(A, start, offs, stride_a, offs_a_o, rows_ok, DA, BLOCK_A, CHECK_ROWS)
        b_o = load_rows(B, start, offs, stride_b, offs_b_o, rows_ok, DB, BLOCK_B, CHECK_ROWS)
    return a, b, a_o, b_o


@triton.jit
def _dot_t_parts(a, b, a_o, b_o, DOT_PRECISION: tl.constexpr, COL_SPLIT: tl.constexpr):
    """``a b^T`` over the full contraction: this program's columns, plus the other half's with a split
    (S^T = k q^T and dP^T = v do^T)."""
    c = tl.dot(a, tl.trans(b), input_precision=DOT_PRECISION)
    if COL_SPLIT > 1:
        c = tl.dot(a_o, tl.trans(b_o), c, input_precision=DOT_PRECISION)
    return c


@triton.jit
def _dkdv_step(
    dk, dv, k, v, k_o, v_o, Q_head, DO_head, L2_head, D_head, blk, offs_n, offs_dqk, offs_dv, offs_dqk_o,
    offs_dv_o, stride_qs, stride_dos, qk_scale, cap2, slope2, diag, len_q, len_k, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr, APPLY_MASK: tl.constexpr, CHECK_ROWS: tl.constexpr, HAS_LOCAL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr,
    COL_SPLIT: tl.constexpr, elem_ok=None, drop=None, b=0, h=0,
):
    """dK, dV [N, D] of one key block plus the terms of query block ``blk`` of one head (bases of that
    head's rows), working on S^T [N, M] so that both products come out in key-major order without a
    transpose of p. APPLY_MASK: the scores take the mask (``elem_ok`` [N, M] for block-sparse masks, else
    :func:`visible`); CHECK_ROWS: the block may reach past the sequence's last query (its loads are masked;
    APPLY_MASK is then set too).

    COL_SPLIT = 2 (``AttentionConfig.dkdv_col_split``): ``dk`` / ``dv`` are this program's half of the
    columns (``offs_dqk`` / ``offs_dv``; ``k`` / ``v`` the same half of the key block), and the scores and
    dP^T take the other half too (``k_o`` / ``v_o``, ``offs_*_o``): each program recomputes both, half
    its accumulators' registers for 1.5x the products."""
    offs_r = tl.arange(0, BLOCK_M)
    m_start = blk * BLOCK_M
    offs_m = m_start + offs_r
    row_ok = offs_m < len_q
    # q [M, Dqk], do [M, Dv] (halves with a split)
    q, do, q_o, do_o = _load_parts(Q_head, stride_qs, offs_dqk, offs_dqk_o, DQK, BLOCK_DQK, DO_head, stride_dos,
                                   offs_dv, offs_dv_o, DV, BLOCK_DV, m_start, offs_r, row_ok, CHECK_ROWS, COL_SPLIT)
    if CHECK_ROWS:
        # Rows past the sequence read lse2 = +inf (-> p = 0) and delta = 0: they add nothing.
        lse2 = tl.load(L2_head + offs_m, mask=row_ok, other=float("inf"))
        delta = tl.load(D_head + offs_m, mask=row_ok, other=0.0)
    else:
        lse2 = tl.load(L2_head + offs_m)
        delta = tl.load(D_head + offs_m)
    # EARLY_DP (AttentionConfig.early_dp), in the unmasked segment only: dP^T is issued before the
    # exponentials, so the tensor cores compute it while the warps evaluate P^T (in the masked segments the
    # extra live tile made ptxas spill more).
    DP_FIRST: tl.constexpr = EARLY_DP and not APPLY_MASK
    qk_t = _dot_t_parts(k, q, k_o, q_o, DOT_PRECISION, COL_SPLIT)  # [N, M]
    if DP_FIRST:
        dp_t = _dot_t_parts(v, do, v_o, do_o, DOT_PRECISION, COL_SPLIT)  # [N, M]
    p_t, t_t = recompute_p(qk_t, lse2[None, :], offs_m[None, :], offs_n[:, None], qk_scale, cap2,
                           slope2, diag, len_k, window_left, window_right, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP,
                           HAS_ALIBI, elem_ok)  # [N, M]
    if drop is not None:  # dropout (head h): dV takes the dropped P, dS the dropped dP (as the forward's P @ V)
        z_t = dropout_multiplier(drop, m_start, BLOCK_M, offs_n.shape[0], b, h, True)  # [N, M]
        dv = tl.dot((p_t * z_t).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    if not DP_FIRST:
        dp_t = _dot_t_parts(v, do, v_o, do_o, DOT_PRECISION, COL_SPLIT)  # [N, M]
    if drop is not None:
        dp_t = dp_t * z_t
    ds_t = score_grad(p_t, dp_t, delta[None, :], t_t, HAS_SOFTCAP)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_q_range(
    dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, L2_seq, D_seq, SLOPES, kh, b, blk_lo, blk_hi, offs_n, offs_dqk, offs_dv,
    offs_dqk_o, offs_dv_o, stride_qs, stride_qh, stride_dos, stride_doh, stride_lh, stride_ab, qk_scale, cap2, diag,
    len_q, len_k, window_left, window_right, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, APPLY_MASK: tl.constexpr,
    CHECK_ROWS: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr, COL_SPLIT: tl.constexpr, drop=None,
):
    """Accumulate dK, dV of one key block over query blocks ``[blk_lo, blk_hi)`` of every query head of kv
    head ``kh``'s GQA group (``*_seq``: the sequence's rows of head 0). GROUP > 1 walks the (head, block)
    pairs in one flat loop, head-major: an outer loop over the heads around the pipelined block loop made
    ptxas spill heavily. GROUP == 1 keeps the plain block loop (the flat one would add a division per
    step)."""
    if GROUP == 1:
        slope2 = alibi_slope2(SLOPES, b, kh, stride_ab, HAS_ALIBI)
        Q_head = Q_seq + kh * stride_qh
        DO_head = DO_seq + kh * stride_doh
        l_off = tl.cast(kh, tl.int64) * stride_lh
        for blk in range(blk_lo, blk_hi):
            dk, dv = _dkdv_step(dk, dv, k, v, k_o, v_o, Q_head, DO_head, L2_seq + l_off, D_seq + l_off, blk,
                                offs_n, offs_dqk, offs_dv, offs_dqk_o, offs_dv_o, stride_qs, stride_dos, qk_scale,
                                cap2, slope2, diag, len_q, len_k, window_left, window_right, DQK, DV, BLOCK_M,
                                BLOCK_DQK, BLOCK_DV, APPLY_MASK, CHECK_ROWS, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI,
                                DOT_PRECISION, EARLY_DP, COL_SPLIT, None, drop, b, kh)
    else:
        n_blk = blk_hi - blk_lo
        for it in range(0, GROUP * n_blk):
            g = it // n_blk
            blk = blk_lo + it - g * n_blk
            h = kh * GROUP + g
            slope2 = alibi_slope2(SLOPES, b, h, stride_ab, HAS_ALIBI)
            l_off = tl.cast(h, tl.int64) * stride_lh
            dk, dv = _dkdv_step(dk, dv, k, v, k_o, v_o, Q_seq + h * stride_qh, DO_seq + h * stride_doh,
                                L2_seq + l_off, D_seq + l_off, blk, offs_n, offs_dqk, offs_dv, offs_dqk_o, offs_dv_o,
                                stride_qs, stride_dos, qk_scale, cap2, slope2, diag, len_q, len_k, window_left,
                                window_right, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV, APPLY_MASK, CHECK_ROWS,
                                HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, EARLY_DP, COL_SPLIT, None, drop, b, h)
    return dk, dv


@triton.jit
def _dkdv_list_coords(it, n_steps, ends, n_g, offs_g, row0, row_step, width, SPLIT: tl.constexpr,
                      HEADS: tl.constexpr, PER_HEAD: tl.constexpr):
    """Where step ``it`` of :func:`_dkdv_q_list`'s walk reads: (the group's head, the list's offset, the
    slot in it, the step within the slot's block)."""
    if PER_HEAD and HEADS > 1:
        g = tl.sum((ends <= it).to(tl.int32), 0)
        j = it - tl.sum(tl.where(offs_g == g, ends - n_g, 0), 0)
    elif HEADS > 1:
        g = it // n_steps
        j = it - g * n_steps
    else:
        g = 0
        j = it
    slot = j // SPLIT
    return g, (row0 + g * row_step) * width, slot, j - slot * SPLIT


@triton.jit
def _dkdv_q_list(
    dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, L2_seq, D_seq, SLOPES, b, h0, NUM, IDX, BIT_IDX, row0, row_step, width,
    BITS, TOK_Q, tk, offs_n, n_local, offs_dqk, offs_dv, offs_dqk_o, offs_dv_o, stride_qs, stride_qh, stride_dos,
    stride_doh, stride_lh, stride_ab, qk_scale, cap2, diag, len_q, len_k, window_left, window_right,
    HEADS: tl.constexpr, HEADS_P2: tl.constexpr, PER_HEAD: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, MASK_QB: tl.constexpr,
    MASK_KB: tl.constexpr, APPLY_MASK: tl.constexpr, CHECK_ROWS: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr, COL_SPLIT: tl.constexpr,
    drop=None,
):
    """The block-sparse counterpart of :func:`_dkdv_q_range`: accumulate dK, dV of one key block over the
    query blocks (of MASK_QB queries) listed in rows ``row0 + g * row_step`` of a BlockMask's transposed lists
    (``NUM`` / ``IDX`` / ``BIT_IDX``, ``width`` wide) for the HEADS query heads ``h0 + g`` of a GQA group, each
    block in MASK_QB // BLOCK_M steps: one flat loop over (head, step) pairs, head-major, as _dkdv_q_range
    walks its group (an outer loop over the heads made ptxas spill, or serialise the wgmmas of the one-launch
    backward: sm_90, D=128, GQA 8/2). A head-shared mask (row_step 0) gives every head the same list; a
    per-head one (PER_HEAD) lists of their own lengths, whose running sums [HEADS_P2] locate each step's head.
    APPLY_MASK (partial lists): the mask's element test on S^T [N, M] (``tk`` [N, 1] the keys' token words,
    ``n_local`` [N] the keys within their mask block)."""
    SPLIT: tl.constexpr = MASK_QB // BLOCK_M
    if PER_HEAD and HEADS > 1:
        offs_g = tl.arange(0, HEADS_P2)
        n_g = tl.load(NUM + row0 + offs_g * row_step, mask=offs_g < HEADS, other=0)
        n_g = tl.minimum(tl.maximum(n_g, 0), width) * SPLIT  # [HEADS_P2] steps per head
        ends = tl.cumsum(n_g, 0)
        total = tl.sum(n_g, 0)
        n_steps = total
    else:
        n_steps = list_length(NUM, row0, width) * SPLIT
        total = HEADS * n_steps
        offs_g = 0  # the per-head search's operands, unused here (a jit function's arguments must exist)
        ends = 0
        n_g = 0
    # The next step's list entries are read one iteration ahead and carried (see fwd_kv_list): the q / dO
    # tiles' addresses then wait on no load of the same iteration, and Triton's pipeliner stages them as deep
    # as the dense kernel's (sm_90, D=128: three stages, not two, and fewer spills).
    g, lists, slot, sub = _dkdv_list_coords(0, n_steps, ends, n_g, offs_g, row0, row_step, width, SPLIT, HEADS,
                                            PER_HEAD)
    entry = tl.load(IDX + lists + slot, mask=total > 0, other=0)
    for it in range(0, total):
        g, lists, slot, sub = _dkdv_list_coords(it, n_steps, ends, n_g, offs_g, row0, row_step, width, SPLIT, HEADS,
                                                PER_HEAD)
        blk = list_block(entry, len_q, MASK_QB) * SPLIT + sub  # query block, BLOCK_M units
        _, lists1, slot1, _ = _dkdv_list_coords(it + 1, n_steps, ends, n_g, offs_g, row0, row_step, width, SPLIT,
                                                HEADS, PER_HEAD)
        entry = tl.load(IDX + lists1 + slot1, mask=it + 1 < total, other=0)  # past the walk: not read
        h = h0 + g
        elem_ok = None
        if APPLY_MASK:
            offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
            tq = mask_tokens(TOK_Q, offs_m[None, :], (offs_m < len_q)[None, :], MASK_GLOBAL == 2)  # global queries
            bits_ok = None
            if MASK_BITS:
                words = BITS + tl.cast(tl.load(BIT_IDX + lists + slot), tl.int64) * (MASK_QB * MASK_KB // 32)
                bits_ok = mask_bits(words, (sub * BLOCK_M + tl.arange(0, BLOCK_M))[None, :], n_local[:, None],
                                    MASK_KB)
            elem_ok = block_mask_visible(offs_m[None, :], offs_n[:, None], len_k, diag, window_left, window_right,
                                         HAS_LOCAL, MASK_GLOBAL, MASK_DOC, tq, tk, bits_ok, True)  # [N, M]
        slope2 = alibi_slope2(SLOPES, b, h, stride_ab, HAS_ALIBI)
        l_off = tl.cast(h, tl.int64) * stride_lh
        dk, dv = _dkdv_step(dk, dv, k, v, k_o, v_o, Q_seq + h * stride_qh, DO_seq + h * stride_doh, L2_seq + l_off,
                            D_seq + l_off, blk, offs_n, offs_dqk, offs_dv, offs_dqk_o, offs_dv_o, stride_qs,
                            stride_dos, qk_scale, cap2, slope2, diag, len_q, len_k, window_left, window_right, DQK,
                            DV, BLOCK_M, BLOCK_DQK, BLOCK_DV, APPLY_MASK, CHECK_ROWS, HAS_LOCAL, HAS_SOFTCAP,
                            HAS_ALIBI, DOT_PRECISION, EARLY_DP, COL_SPLIT, elem_ok, drop, b, h)
    return dk, dv


@triton.jit
def _dkdv_sparse(
    dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, L2_seq, D_seq, SLOPES, kh, b, n_start, offs_n, key_ok, offs_dqk,
    offs_dv, offs_dqk_o, offs_dv_o, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, Q_BITS_IDX, BITS, TOK_Q, TOK_K,
    mask_t_stride_b, mask_t_stride_h, mask_t_max, tok_stride_b, stride_qs, stride_qh, stride_dos, stride_doh,
    stride_lh, stride_ab, qk_scale, cap2, diag, len_q, len_k, window_left, window_right, GROUP: tl.constexpr,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, HAS_LOCAL: tl.constexpr, MASK_GLOBAL: tl.constexpr,
    MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, MASK_PER_HEAD: tl.constexpr, MASK_RAGGED_Q: tl.constexpr,
    MASK_GROUP_P2: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
    EARLY_DP: tl.constexpr, COL_SPLIT: tl.constexpr, drop=None,
):
    """dK, dV of the key block at ``n_start`` (BLOCK_N divides MASK_KB) over the query blocks of the mask's
    transposed lists, for every query head of kv head ``kh``'s group: full blocks without mask arithmetic or
    row checks (full blocks lie inside both sequences), then partial ones (row checks only when the last
    query block is ragged)."""
    kb = n_start // MASK_KB
    n_local = offs_n - kb * MASK_KB
    tok = tl.cast(b, tl.int64) * tok_stride_b
    tk = fixed_tokens(TOK_K + tok, TOK_Q + tok, offs_n[:, None], key_ok[:, None], MASK_GLOBAL, MASK_DOC)  # [N, 1]
    h0 = kh * GROUP
    row0 = tl.cast(b * mask_t_stride_b + h0 * mask_t_stride_h + kb, tl.int64)  # head stride 0 when shared
    dk, dv = _dkdv_q_list(dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, L2_seq, D_seq, SLOPES, b, h0, FULL_Q_NUM,
                          FULL_Q_IDX, Q_BITS_IDX, row0, mask_t_stride_h, mask_t_max, BITS, TOK_Q + tok, tk, offs_n,
                          n_local, offs_dqk, offs_dv, offs_dqk_o, offs_dv_o, stride_qs, stride_qh, stride_dos,
                          stride_doh, stride_lh, stride_ab, qk_scale, cap2, diag, len_q, len_k, window_left,
                          window_right, GROUP, MASK_GROUP_P2, MASK_PER_HEAD, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV,
                          MASK_QB, MASK_KB, False, False, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP,
                          HAS_ALIBI, DOT_PRECISION, EARLY_DP, COL_SPLIT, drop)
    dk, dv = _dkdv_q_list(dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, L2_seq, D_seq, SLOPES, b, h0, Q_NUM, Q_IDX,
                          Q_BITS_IDX, row0, mask_t_stride_h, mask_t_max, BITS, TOK_Q + tok, tk, offs_n, n_local,
                          offs_dqk, offs_dv, offs_dqk_o, offs_dv_o, stride_qs, stride_qh, stride_dos, stride_doh,
                          stride_lh, stride_ab, qk_scale, cap2, diag, len_q, len_k, window_left, window_right, GROUP,
                          MASK_GROUP_P2, MASK_PER_HEAD, DQK, DV, BLOCK_M, BLOCK_DQK, BLOCK_DV, MASK_QB, MASK_KB, True,
                          MASK_RAGGED_Q, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP, HAS_ALIBI,
                          DOT_PRECISION, EARLY_DP, COL_SPLIT, drop)
    return dk, dv


@triton.jit
def _dkdv_program(
    kh, b, q_start, len_q, k_start, len_k, n_start, part, Q, K, V, DO, LSE2, DELTA, SLOPES,
    sm_scale, softcap, window_left, window_right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_ab,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, DK, DV_OUT,
    Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, Q_BITS_IDX, BITS, TOK_Q, TOK_K, mask_t_stride_b, mask_t_stride_h,
    mask_t_max, tok_stride_b,
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    LSE_ALIGN: tl.constexpr, COL_SPLIT: tl.constexpr, TAIL_BLOCKS: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr,
    MASK_BITS: tl.constexpr, MASK_PER_HEAD: tl.constexpr, MASK_RAGGED_Q: tl.constexpr, MASK_GROUP_P2: tl.constexpr,
    drop=None,
):
    """dK, dV of the key block at ``n_start`` (< len_k) of kv head ``kh`` of sequence ``b``: all their
    columns, or with COL_SPLIT = 2 the half ``part`` (0 or 1) of them (see :func:`_dkdv_step`)."""
    if drop is not None:
        drop = dropout_block(drop, n_start)
    # Strides are multiples of STRIDE_ALIGN (q, k, v, do, dk, dv) and LSE_ALIGN (lse, delta): see aligned().
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, STRIDE_ALIGN)
    stride_kb, stride_ks, stride_kh = aligned_strides(stride_kb, stride_ks, stride_kh, STRIDE_ALIGN)
    stride_vb, stride_vs, stride_vh = aligned_strides(stride_vb, stride_vs, stride_vh, STRIDE_ALIGN)
    stride_dob, stride_dos, stride_doh = aligned_strides(stride_dob, stride_dos, stride_doh, STRIDE_ALIGN)
    stride_dkb, stride_dks, stride_dkh = aligned_strides(stride_dkb, stride_dks, stride_dkh, STRIDE_ALIGN)
    stride_dvb, stride_dvs, stride_dvh = aligned_strides(stride_dvb, stride_dvs, stride_dvh, STRIDE_ALIGN)
    stride_lb = aligned(stride_lb, LSE_ALIGN)
    stride_lh = aligned(stride_lh, LSE_ALIGN)
    offs_c = tl.arange(0, BLOCK_N)
    offs_n = n_start + offs_c  # [N] key index within the sequence
    # this program's columns of dK / dV (all of them, or one half), and with a split the other half
    offs_dqk, offs_dqk_o = _column_parts(BLOCK_DQK, part, COL_SPLIT)
    offs_dv, offs_dv_o = _column_parts(BLOCK_DV, part, COL_SPLIT)
    key_ok = offs_n < len_k
    row0 = k_start + n_start
    K_head = K + tl.cast(b, tl.int64) * stride_kb + kh * stride_kh
    V_head = V + tl.cast(b, tl.int64) * stride_vb + kh * stride_vh
    # k [N, Dqk], v [N, Dv] (halves with a split)
    k, v, k_o, v_o = _load_parts(K_head, stride_ks, offs_dqk, offs_dqk_o, DQK, BLOCK_DQK, V_head, stride_vs, offs_dv,
                                 offs_dv_o, DV, BLOCK_DV, row0, offs_c, key_ok, True, COL_SPLIT)

    qk_scale, cap2 = score_params(sm_scale, softcap, HAS_SOFTCAP)
    diag = len_k - len_q
    lo, full_lo, full_hi, hi = q_block_range(n_start, len_q, len_k, window_left, window_right,
                                             BLOCK_M, BLOCK_N, HAS_LOCAL)  # dense: the query blocks to walk
    dk = tl.zeros([BLOCK_N, BLOCK_DQK // COL_SPLIT], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV // COL_SPLIT], dtype=tl.float32)
    # The query heads of this kv head's group, in a fixed order: the GQA sum happens in registers.
    Q_seq = Q + tl.cast(b, tl.int64) * stride_qb + tl.cast(q_start, tl.int64) * stride_qs
    DO_seq = DO + tl.cast(b, tl.int64) * stride_dob + tl.cast(q_start, tl.int64) * stride_dos
    l_seq = tl.cast(b, tl.int64) * stride_lb + q_start
    if BLOCK_SPARSE:
        dk, dv = _dkdv_sparse(dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, LSE2 + l_seq, DELTA + l_seq, SLOPES, kh, b,
                              n_start, offs_n, key_ok, offs_dqk, offs_dv, offs_dqk_o, offs_dv_o, Q_NUM, Q_IDX,
                              FULL_Q_NUM, FULL_Q_IDX, Q_BITS_IDX, BITS, TOK_Q, TOK_K, mask_t_stride_b, mask_t_stride_h,
                              mask_t_max, tok_stride_b, stride_qs, stride_qh, stride_dos, stride_doh, stride_lh,
                              stride_ab, qk_scale, cap2, diag, len_q, len_k, window_left, window_right, GROUP, DQK,
                              DV, BLOCK_M, BLOCK_DQK, BLOCK_DV, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL, MASK_DOC,
                              MASK_BITS, MASK_PER_HEAD, MASK_RAGGED_Q, MASK_GROUP_P2, HAS_SOFTCAP, HAS_ALIBI,
                              DOT_PRECISION, EARLY_DP, COL_SPLIT, drop)
    else:
        # Three segments: [lo, a_hi) masked scores whose rows all lie inside the sequence (the causal diagonal:
        # no row checks on the loads, a third fewer instructions per step), [a_hi, b_hi) fully visible,
        # [b_hi, hi) masked scores with row checks (window edges, the ragged last query block). A partly
        # visible block past the last whole one (full_lo > len_q // BLOCK_M) moves to the third segment.
        # Without a window no block precedes the visible ones (lo == full_lo), and the plain bounds keep the
        # unmasked step smaller.
        if HAS_LOCAL:
            a_hi = tl.minimum(full_lo, len_q // BLOCK_M)
            b_hi = tl.where(full_lo == a_hi, full_hi, a_hi)
        else:
            a_hi = full_lo
            b_hi = full_hi
        # The trailing masked blocks split in two: [b_hi, c_hi) the window's far edge, rows inside the sequence
        # (no row checks), and [c_hi, hi) a block reaching past the last query (row checks). The plan compiles
        # each only when it can hold blocks (TAIL_BLOCKS: TAIL_EDGE a bounded left window, TAIL_RAGGED rows).
        EDGE: tl.constexpr = (TAIL_EDGE_BIT & TAIL_BLOCKS) != 0
        RAGGED: tl.constexpr = (TAIL_RAGGED_BIT & TAIL_BLOCKS) != 0
        c_hi = b_hi
        if EDGE:
            c_hi = tl.maximum(b_hi, tl.minimum(hi, len_q // BLOCK_M))
        bounds = (lo, a_hi, b_hi, c_hi, hi)
        for seg in tl.static_range(4):
            if seg < 2 or (seg == 2 and EDGE) or (seg == 3 and RAGGED):
                dk, dv = _dkdv_q_range(dk, dv, k, v, k_o, v_o, Q_seq, DO_seq, LSE2 + l_seq, DELTA + l_seq, SLOPES,
                                       kh, b, bounds[seg], bounds[seg + 1], offs_n, offs_dqk, offs_dv, offs_dqk_o,
                                       offs_dv_o, stride_qs, stride_qh, stride_dos, stride_doh, stride_lh, stride_ab,
                                       qk_scale, cap2, diag, len_q, len_k, window_left, window_right, GROUP, DQK, DV,
                                       BLOCK_M, BLOCK_DQK, BLOCK_DV, seg != 1, seg == 3, HAS_LOCAL, HAS_SOFTCAP,
                                       HAS_ALIBI, DOT_PRECISION, EARLY_DP, COL_SPLIT, drop)
    dk = dk * tl.cast(sm_scale, tl.float32)

    store_rows(DK + tl.cast(b, tl.int64) * stride_dkb + kh * stride_dkh, row0, offs_c, stride_dks, offs_dqk, key_ok,
               DQK, dk)
    store_rows(DV_OUT + tl.cast(b, tl.int64) * stride_dvb + kh * stride_dvh, row0, offs_c, stride_dvs, offs_dv,
               key_ok, DV, dv)


@triton.jit
def _fill_dkdv(CU_K, n_seqs, seqlen_k, total_k, rank, n_ranks, DK, stride_dks, DV_OUT, stride_dvs, DQK: tl.constexpr,
               DV: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """NaN into the dk and dv rows (of one kv head) that no sequence covers: see fill_uncovered_rows."""
    fill_uncovered_rows(CU_K, n_seqs, seqlen_k, total_k, rank, n_ranks, DK, stride_dks, DK, 0, DQK, BLOCK_DQK,
                        False)
    fill_uncovered_rows(CU_K, n_seqs, seqlen_k, total_k, rank, n_ranks, DV_OUT, stride_dvs, DV_OUT, 0, DV, BLOCK_DV,
                        False)


@triton.jit(do_not_specialize_on_alignment=DKDV_INT_SCALARS)
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, SLOPES, CU_Q, CU_K,  # inputs
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_ORDER, KV_BITS_IDX, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, KV_ORDER,
    Q_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask arrays (BLOCK_SPARSE; placeholders otherwise)
    SEED,  # int32 (1,), HAS_DROPOUT
    seqlen_q, seqlen_k, total_q, total_k, sm_scale, softcap, window_left, window_right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_ab,
    mask_stride_b, mask_stride_h, mask_max, mask_t_stride_b, mask_t_stride_h, mask_t_max, tok_stride_b,
    dropout_p, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,  # runtime scalars
    DK, DV_OUT,  # outputs: dk in k's layout and dtype, dv in v's
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
    LSE_ALIGN: tl.constexpr, HEAD_GROUP: tl.constexpr, COL_SPLIT: tl.constexpr, TAIL_BLOCKS: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, MASK_GLOBAL: tl.constexpr,
    MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, MASK_PER_HEAD: tl.constexpr, MASK_RAGGED_Q: tl.constexpr,
    MASK_GROUP_P2: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    # grid axis 0: key blocks x COL_SPLIT column parts, a block's parts adjacent (they share its K / V and
    # every Q / dO tile in L2); key block 0 sees the most causal queries: it starts first
    pid_n, kh, b = block_schedule(HEAD_GROUP)
    part = 0
    if COL_SPLIT > 1:
        part = pid_n % COL_SPLIT
        pid_n = pid_n // COL_SPLIT
    if BLOCK_SPARSE:  # the mask's key blocks, longest first (the order of the group's first query head)
        pid_n = sparse_key_block(pid_n, KV_ORDER + b * mask_t_stride_b + kh * GROUP * mask_t_stride_h, seqlen_k,
                                 BLOCK_N, MASK_KB)
    q_start, len_q = seq_range(CU_Q, b, seqlen_q, total_q, IS_VARLEN)
    k_start, len_k = seq_range(CU_K, b, seqlen_k, total_k, IS_VARLEN)
    n_start = pid_n * BLOCK_N
    drop = None
    if HAS_DROPOUT:
        drop = dropout_state(SEED, dropout_p)
    if n_start >= len_k:
        if IS_VARLEN and not BLOCK_SPARSE:
            if (pid_n == tl.num_programs(0) // COL_SPLIT - 1) & (part == 0):  # the extra key block
                _fill_dkdv(CU_K, tl.num_programs(2), seqlen_k, total_k, b, tl.num_programs(2), DK + kh * stride_dkh,
                           stride_dks, DV_OUT + kh * stride_dvh, stride_dvs, DQK, DV, BLOCK_DQK, BLOCK_DV)
        return
    _dkdv_program(kh, b, q_start, len_q, k_start, len_k, n_start, part, Q, K, V, DO, LSE2, DELTA, SLOPES, sm_scale,
                  softcap, window_left, window_right, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
                  stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh, stride_lb,
                  stride_lh, stride_ab, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
                  DK, DV_OUT, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, Q_BITS_IDX, BITS, TOK_Q, TOK_K, mask_t_stride_b,
                  mask_t_stride_h, mask_t_max, tok_stride_b, GROUP, DQK, DV, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV,
                  HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, EARLY_DP, STRIDE_ALIGN, LSE_ALIGN, COL_SPLIT,
                  TAIL_BLOCKS, BLOCK_SPARSE, MASK_QB, MASK_KB, MASK_GLOBAL, MASK_DOC, MASK_BITS, MASK_PER_HEAD,
                  MASK_RAGGED_Q, MASK_GROUP_P2, drop)


@triton.jit
def _dq_step(
    dq, dslope, q, do, lse2, delta, K_base, V_base, n_start, offs_m, offs_dqk, offs_dv,
    stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr, APPLY_MASK: tl.constexpr, CHECK_KEYS: tl.constexpr, HAS_LOCAL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIBI_GRAD: tl.constexpr,
    elem_ok=None, drop=None, b=0, h=0,
):
    """dQ [M, Dqk] of one query block plus the terms of keys ``n_start + arange(BLOCK_N)`` (APPLY_MASK: the
    scores take the mask, ``elem_ok`` [M, N] for block-sparse masks; CHECK_KEYS: the block may reach past
    the sequence's last key, so its loads are masked).

    ALIBI_GRAD: ``dslope`` [M] also gathers ``sum_j dS_ij * |i + diag - j|`` per row, dS the gradient of the
    score after softcap (ALiBi is added after it); the slope's gradient is minus its sum over the rows.
    Returns (dq, dslope)."""
    offs_c = tl.arange(0, BLOCK_N)
    offs_n = n_start + offs_c
    key_ok = offs_n < len_k
    k = load_rows(K_base, n_start, offs_c, stride_ks, offs_dqk, key_ok, DQK, BLOCK_DQK, CHECK_KEYS)  # [N, Dqk]
    v = load_rows(V_base, n_start, offs_c, stride_vs, offs_dv, key_ok, DV, BLOCK_DV, CHECK_KEYS)  # [N, Dv]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N]
    p, t = recompute_p(qk, lse2[:, None], offs_m[:, None], offs_n[None, :], qk_scale, cap2, slope2, diag,
                       len_k, window_left, window_right, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, elem_ok)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # [M, N]
    if drop is not None:  # dropout (head h): the forward's P @ V used the dropped P, so dP is dropped too
        dp = dp * dropout_multiplier(drop, n_start, offs_m.shape[0], BLOCK_N, b, h)
    ds = score_grad(p, dp, delta[:, None], t, HAS_SOFTCAP)
    if ALIBI_GRAD:
        ds_bias = ds
        if HAS_SOFTCAP:
            ds_bias = p * (dp - delta[:, None])
        dist = tl.abs(offs_m[:, None] + diag - offs_n[None, :]).to(tl.float32)  # [M, N]
        dslope += tl.sum(ds_bias * dist, 1)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION), dslope


@triton.jit
def _dq_kv_range(
    dq, dslope, q, do, lse2, delta, K_base, V_base, blk_lo, blk_hi, offs_m, offs_dqk, offs_dv,
    stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DV: tl.constexpr, APPLY_MASK: tl.constexpr, CHECK_KEYS: tl.constexpr, HAS_LOCAL: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIBI_GRAD: tl.constexpr,
    drop=None, b=0, h=0,
):
    """Accumulate dQ [M, Dqk] (and ``dslope``, see :func:`_dq_step`) of one query block over key blocks
    ``[blk_lo, blk_hi)``."""
    for blk in range(blk_lo, blk_hi):
        dq, dslope = _dq_step(dq, dslope, q, do, lse2, delta, K_base, V_base, blk * BLOCK_N, offs_m, offs_dqk,
                              offs_dv, stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left,
                              window_right, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, APPLY_MASK, CHECK_KEYS, HAS_LOCAL,
                              HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ALIBI_GRAD, None, drop, b, h)
    return dq, dslope


@triton.jit
def _dq_kv_list(
    dq, dslope, q, do, lse2, delta, K_base, V_base, n_blocks, BLOCKS, BIT_ROWS, BITS, TOK_K, tq, offs_m, m_local,
    offs_dqk, offs_dv, stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIBI_GRAD: tl.constexpr, drop=None, b=0, h=0,
):
    """Accumulate dQ (and ``dslope``) over the key blocks of one row of a BlockMask's lists, as the forward's
    ``fwd_kv_list`` walks them (MASK_KB // BLOCK_N steps per block; APPLY_MASK: the mask's element test)."""
    # The next step's list entries are read one iteration ahead and carried (see fwd_kv_list), so no
    # step's K / V addresses wait on a load of the same iteration and Triton's pipeliner stages them as
    # deep as the dense kernel's.
    SPLIT: tl.constexpr = MASK_KB // BLOCK_N
    start = list_start_ahead(BLOCKS, 0, n_blocks, len_k, MASK_KB)
    for it in range(0, n_blocks * SPLIT):
        slot = it // SPLIT
        sub = (it - slot * SPLIT) * BLOCK_N
        n_start = start + sub
        start = list_start_ahead(BLOCKS, (it + 1) // SPLIT, n_blocks, len_k, MASK_KB)
        offs_c = sub + tl.arange(0, BLOCK_N)  # keys within the mask block
        elem_ok = None
        if APPLY_MASK:
            elem_ok = kv_step_mask(offs_m, m_local, tq, n_start, offs_c, slot, BIT_ROWS, BITS, TOK_K, len_k, diag,
                                   window_left, window_right, BLOCK_N, MASK_QB, MASK_KB, HAS_LOCAL, MASK_GLOBAL,
                                   MASK_DOC, MASK_BITS)
        dq, dslope = _dq_step(dq, dslope, q, do, lse2, delta, K_base, V_base, n_start, offs_m, offs_dqk, offs_dv,
                              stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right,
                              DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, APPLY_MASK, APPLY_MASK, HAS_LOCAL, HAS_SOFTCAP,
                              HAS_ALIBI, DOT_PRECISION, ALIBI_GRAD, elem_ok, drop, b, h)
    return dq, dslope


@triton.jit
def _dq_program(
    h, b, kh, q_start, len_q, k_start, len_k, m_start, Q, K, V, DO, LSE2, DELTA, SLOPES,
    sm_scale, softcap, window_left, window_right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_ab, stride_dqb, stride_dqs, stride_dqh, DQ,
    DSLOPE_BLOCKS, slope_block, KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, KV_BITS_IDX, BITS, TOK_Q, TOK_K,
    mask_stride_b, mask_stride_h, mask_max, tok_stride_b,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, STRIDE_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr,
    TAIL_BLOCKS: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, ALIBI_GRAD: tl.constexpr,
    drop=None,
):
    """dQ of the query block at ``m_start`` of head ``h`` of sequence ``b`` (coordinates from
    :func:`query_block`, ``m_start < len_q``). ALIBI_GRAD: also this block's term of the slope's gradient,
    stored at ``DSLOPE_BLOCKS[slope_block]`` (see :func:`_dq_step`)."""
    if drop is not None:
        drop = dropout_block(drop, m_start)
    # Strides are multiples of STRIDE_ALIGN (q, k, v, do, dq) and LSE_ALIGN (lse, delta): see aligned().
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, STRIDE_ALIGN)
    stride_kb, stride_ks, stride_kh = aligned_strides(stride_kb, stride_ks, stride_kh, STRIDE_ALIGN)
    stride_vb, stride_vs, stride_vh = aligned_strides(stride_vb, stride_vs, stride_vh, STRIDE_ALIGN)
    stride_dob, stride_dos, stride_doh = aligned_strides(stride_dob, stride_dos, stride_doh, STRIDE_ALIGN)
    stride_dqb, stride_dqs, stride_dqh = aligned_strides(stride_dqb, stride_dqs, stride_dqh, STRIDE_ALIGN)
    stride_lb = aligned(stride_lb, LSE_ALIGN)
    stride_lh = aligned(stride_lh, LSE_ALIGN)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m_start + offs_r
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q
    row0 = q_start + m_start
    q = load_rows(Q + tl.cast(b, tl.int64) * stride_qb + h * stride_qh, row0, offs_r, stride_qs, offs_dqk, row_ok,
                  DQK, BLOCK_DQK, True)
    do = load_rows(DO + tl.cast(b, tl.int64) * stride_dob + h * stride_doh, row0, offs_r, stride_dos, offs_dv,
                   row_ok, DV, BLOCK_DV, True)
    l_off = tl.cast(b, tl.int64) * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
    lse2 = tl.load(LSE2 + l_off + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + l_off + offs_m, mask=row_ok, other=0.0)
    K_base = K + tl.cast(b, tl.int64) * stride_kb + tl.cast(k_start, tl.int64) * stride_ks + kh * stride_kh
    V_base = V + tl.cast(b, tl.int64) * stride_vb + tl.cast(k_start, tl.int64) * stride_vs + kh * stride_vh

    qk_scale, cap2 = score_params(sm_scale, softcap, HAS_SOFTCAP)
    slope2 = alibi_slope2(SLOPES, b, h, stride_ab, HAS_ALIBI)
    diag = len_k - len_q
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    dslope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if BLOCK_SPARSE:  # the forward's lists (see attn_fwd_kernel): full blocks, then partial ones
        qb = m_start // MASK_QB
        row = tl.cast(b * mask_stride_b + h * mask_stride_h + qb, tl.int64)
        lists = row * mask_max
        tok = tl.cast(b, tl.int64) * tok_stride_b
        tq = fixed_tokens(TOK_Q + tok, TOK_K + tok, offs_m[:, None], row_ok[:, None], MASK_GLOBAL, MASK_DOC)  # [M, 1]
        m_local = offs_m - qb * MASK_QB
        dq, dslope = _dq_kv_list(
            dq, dslope, q, do, lse2, delta, K_base, V_base, list_length(FULL_KV_NUM, row, mask_max),
            FULL_KV_IDX + lists, KV_BITS_IDX + lists, BITS, TOK_K + tok, tq, offs_m, m_local, offs_dqk, offs_dv,
            stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right, DQK, DV, BLOCK_N,
            BLOCK_DQK, BLOCK_DV, MASK_QB, MASK_KB, False, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP,
            HAS_ALIBI, DOT_PRECISION, ALIBI_GRAD, drop, b, h)
        dq, dslope = _dq_kv_list(
            dq, dslope, q, do, lse2, delta, K_base, V_base, list_length(KV_NUM, row, mask_max), KV_IDX + lists,
            KV_BITS_IDX + lists, BITS, TOK_K + tok, tq, offs_m, m_local, offs_dqk, offs_dv, stride_ks, stride_vs,
            qk_scale, cap2, slope2, diag, len_k, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV,
            MASK_QB, MASK_KB, True, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
            ALIBI_GRAD, drop, b, h)
    else:
        lo, full_lo, full_hi, hi = kv_block_range(m_start, len_q, len_k, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LOCAL)
        # The masked segments check their keys only when a block can reach past the last one (TAIL_RAGGED);
        # the trailing one is compiled only when it can hold blocks (any TAIL_BLOCKS bit).
        CHECK_KEYS: tl.constexpr = (TAIL_RAGGED_BIT & TAIL_BLOCKS) != 0
        dq, dslope = _dq_kv_range(
            dq, dslope, q, do, lse2, delta, K_base, V_base, lo, full_lo, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DQK,
            BLOCK_DV, True, CHECK_KEYS, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ALIBI_GRAD, drop, b, h)
        dq, dslope = _dq_kv_range(
            dq, dslope, q, do, lse2, delta, K_base, V_base, full_lo, full_hi, offs_m, offs_dqk, offs_dv, stride_ks,
            stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DQK,
            BLOCK_DV, False, False, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ALIBI_GRAD, drop, b, h)
        if TAIL_BLOCKS != 0:
            dq, dslope = _dq_kv_range(
                dq, dslope, q, do, lse2, delta, K_base, V_base, full_hi, hi, offs_m, offs_dqk, offs_dv, stride_ks,
                stride_vs, qk_scale, cap2, slope2, diag, len_k, window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DQK,
                BLOCK_DV, True, CHECK_KEYS, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ALIBI_GRAD, drop, b, h)
    dq = dq * tl.cast(sm_scale, tl.float32)
    store_rows(DQ + tl.cast(b, tl.int64) * stride_dqb + h * stride_dqh, row0, offs_r, stride_dqs, offs_dqk, row_ok,
               DQK, dq)
    if ALIBI_GRAD:
        tl.store(DSLOPE_BLOCKS + slope_block, -tl.sum(dslope, 0))


@triton.jit(do_not_specialize_on_alignment=DQ_INT_SCALARS)
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE2, DELTA, SLOPES, CU_Q, CU_K,  # inputs
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_ORDER, KV_BITS_IDX, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, KV_ORDER,
    Q_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask arrays (BLOCK_SPARSE; placeholders otherwise)
    SEED,  # int32 (1,), HAS_DROPOUT
    seqlen_q, seqlen_k, total_q, total_k, sm_scale, softcap, window_left, window_right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_ab,
    mask_stride_b, mask_stride_h, mask_max, mask_t_stride_b, mask_t_stride_h, mask_t_max, tok_stride_b,
    dropout_p, stride_dqb, stride_dqs, stride_dqh,  # runtime scalars
    DQ, DSLOPE_BLOCKS,  # outputs: dq in q's layout and dtype; ALIBI_GRAD: float32 (batch, heads, query blocks)
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    LSE_ALIGN: tl.constexpr, HEAD_GROUP: tl.constexpr, TAIL_BLOCKS: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, MASK_GLOBAL: tl.constexpr,
    MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, MASK_PER_HEAD: tl.constexpr, MASK_RAGGED_Q: tl.constexpr,
    MASK_GROUP_P2: tl.constexpr, ALIBI_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
):
    if BLOCK_SPARSE:  # the mask's query blocks, longest first
        rank, h, b = block_schedule(HEAD_GROUP)
        h, b, kh, q_start, len_q, k_start, len_k, m_start = sparse_query_block_at(
            rank, h, b, tl.num_programs(0), Q_ORDER, mask_stride_b, mask_stride_h, CU_Q, CU_K, seqlen_q, seqlen_k,
            total_q, total_k, GROUP, BLOCK_M, MASK_QB, IS_VARLEN)
    else:
        h, b, kh, q_start, len_q, k_start, len_k, m_start = query_block(
            CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k, GROUP, BLOCK_M, IS_VARLEN, HEAD_GROUP)
    slope_block = (b * tl.num_programs(1) + h) * tl.num_programs(0) + m_start // BLOCK_M
    drop = None
    if HAS_DROPOUT:
        drop = dropout_state(SEED, dropout_p)
    if m_start >= len_q:
        if ALIBI_GRAD:  # every block of the slopes' partial sums is written
            tl.store(DSLOPE_BLOCKS + slope_block, 0.0)
        if IS_VARLEN and not BLOCK_SPARSE:
            if m_start == (tl.num_programs(0) - 1) * BLOCK_M:  # the extra query block: NaN into uncovered rows
                fill_uncovered_rows(CU_Q, tl.num_programs(2), seqlen_q, total_q, b, tl.num_programs(2),
                                    DQ + h * stride_dqh, stride_dqs, DQ, 0, DQK, BLOCK_DQK, False)
        return
    _dq_program(h, b, kh, q_start, len_q, k_start, len_k, m_start, Q, K, V, DO, LSE2, DELTA, SLOPES, sm_scale,
                softcap, window_left, window_right, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks,
                stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh, stride_lb,
                stride_lh, stride_ab, stride_dqb, stride_dqs, stride_dqh, DQ, DSLOPE_BLOCKS, slope_block, KV_NUM,
                KV_IDX, FULL_KV_NUM, FULL_KV_IDX, KV_BITS_IDX, BITS, TOK_Q, TOK_K, mask_stride_b, mask_stride_h,
                mask_max, tok_stride_b, DQK, DV, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, HAS_LOCAL, HAS_SOFTCAP,
                HAS_ALIBI, DOT_PRECISION, STRIDE_ALIGN, LSE_ALIGN, TAIL_BLOCKS, BLOCK_SPARSE, MASK_QB, MASK_KB,
                MASK_GLOBAL, MASK_DOC, MASK_BITS, ALIBI_GRAD, drop)


@triton.jit(do_not_specialize_on_alignment=FUSED_INT_SCALARS)
def attn_bwd_kernel(
    Q, K, V, DO, LSE2, DELTA, SLOPES, CU_Q, CU_K,  # inputs
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_ORDER, KV_BITS_IDX, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, KV_ORDER,
    Q_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask arrays (BLOCK_SPARSE; placeholders otherwise)
    SEED,  # int32 (1,), HAS_DROPOUT
    seqlen_q, seqlen_k, total_q, total_k, sm_scale, softcap, window_left, window_right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh, stride_lb, stride_lh, stride_ab,
    mask_stride_b, mask_stride_h, mask_max, mask_t_stride_b, mask_t_stride_h, mask_t_max, tok_stride_b,
    dropout_p, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_dqb, stride_dqs,
    stride_dqh, heads_kv, n_seqs,  # runtime scalars
    DK, DV_OUT, DQ, DSLOPE_BLOCKS,  # outputs, as in the two kernels
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, KV_BLOCK_M: tl.constexpr, KV_BLOCK_N: tl.constexpr,
    Q_BLOCK_M: tl.constexpr, Q_BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr, STRIDE_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr,
    HEAD_GROUP: tl.constexpr, KV_TAIL_BLOCKS: tl.constexpr, Q_TAIL_BLOCKS: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr, MASK_GLOBAL: tl.constexpr,
    MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, MASK_PER_HEAD: tl.constexpr, MASK_RAGGED_Q: tl.constexpr,
    MASK_GROUP_P2: tl.constexpr, ALIBI_GRAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, INTERLEAVE: tl.constexpr,
):
    """dK/dV and dQ in one launch on a 1-D grid: ``n_kv`` programs of the dK/dV kernel's grid
    ``(cdiv(seqlen_k, KV_BLOCK_N), heads_kv, n_seqs)`` and the rest the dQ kernel's ``(cdiv(seqlen_q,
    Q_BLOCK_M), heads_kv * GROUP, n_seqs)``, each in its own :func:`grid_schedule` order. By default the dK/dV
    programs (four products per step, and GROUP heads each) come first: the GPU starts programs in order, so
    the longest work starts earliest and the shorter dQ programs fill in behind it. INTERLEAVE: each (kv
    head, sequence) runs its dK/dV programs, then its query heads' dQ programs, before the next one's: the
    two kinds run side by side on the SMs while the head's Q, K, V and dO are still in L2. Packed sequences
    (IS_VARLEN): both grids have one block more, past every sequence, whose programs write NaN into the rows
    of dk, dv and dq that no sequence covers (invalid offsets; see fill_uncovered_rows), as in the two
    kernels."""
    if BLOCK_SPARSE:  # the grids span whole mask blocks (see sparse_query_block_at / sparse_key_block)
        kv_blocks = tl.cdiv(seqlen_k, MASK_KB) * (MASK_KB // KV_BLOCK_N)
    else:
        kv_blocks = tl.cdiv(seqlen_k, KV_BLOCK_N)
        if IS_VARLEN:
            kv_blocks += 1  # the extra key block (uncovered rows)
    n_kv = kv_blocks * heads_kv * n_seqs
    pid = tl.program_id(0)
    if BLOCK_SPARSE:
        q_blocks = tl.cdiv(seqlen_q, MASK_QB) * (MASK_QB // Q_BLOCK_M)
    else:
        q_blocks = tl.cdiv(seqlen_q, Q_BLOCK_M)
        if IS_VARLEN:
            q_blocks += 1  # the extra query block (uncovered rows)
    if INTERLEAVE:  # launch position -> the program id of the default order
        chunk = kv_blocks + GROUP * q_blocks  # programs of one (kv head, sequence)
        pair = pid // chunk
        r = pid - pair * chunk
        pid = tl.where(r < kv_blocks, pair * kv_blocks + r, n_kv + pair * GROUP * q_blocks + (r - kv_blocks))
    drop = None  # built here, outside the branches: a None cannot leave a runtime branch
    if HAS_DROPOUT:
        drop = dropout_state(SEED, dropout_p)
    if pid < n_kv:
        p0, p1, p2 = unravel_grid(pid, kv_blocks, heads_kv)
        pid_n, kh, b = grid_schedule(p0, p1, p2, kv_blocks, heads_kv, n_seqs, HEAD_GROUP)
        if BLOCK_SPARSE:
            pid_n = sparse_key_block(pid_n, KV_ORDER + b * mask_t_stride_b + kh * GROUP * mask_t_stride_h,
                                     seqlen_k, KV_BLOCK_N, MASK_KB)
        q_start, len_q = seq_range(CU_Q, b, seqlen_q, total_q, IS_VARLEN)
        k_start, len_k = seq_range(CU_K, b, seqlen_k, total_k, IS_VARLEN)
        n_start = pid_n * KV_BLOCK_N
        if n_start < len_k:
            _dkdv_program(kh, b, q_start, len_q, k_start, len_k, n_start, 0, Q, K, V, DO, LSE2, DELTA, SLOPES,
                          sm_scale, softcap, window_left, window_right, stride_qb, stride_qs, stride_qh, stride_kb,
                          stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos,
                          stride_doh, stride_lb, stride_lh, stride_ab, stride_dkb, stride_dks, stride_dkh,
                          stride_dvb, stride_dvs, stride_dvh, DK, DV_OUT, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX,
                          Q_BITS_IDX, BITS, TOK_Q, TOK_K, mask_t_stride_b, mask_t_stride_h, mask_t_max, tok_stride_b,
                          GROUP, DQK, DV, KV_BLOCK_M, KV_BLOCK_N, BLOCK_DQK, BLOCK_DV, HAS_LOCAL, HAS_SOFTCAP,
                          HAS_ALIBI, DOT_PRECISION, EARLY_DP, STRIDE_ALIGN, LSE_ALIGN, 1, KV_TAIL_BLOCKS, BLOCK_SPARSE,
                          MASK_QB, MASK_KB, MASK_GLOBAL, MASK_DOC, MASK_BITS, MASK_PER_HEAD, MASK_RAGGED_Q,
                          MASK_GROUP_P2, drop)
        else:
            if IS_VARLEN and not BLOCK_SPARSE:
                if pid_n == kv_blocks - 1:  # the extra key block: NaN into uncovered dk / dv rows
                    _fill_dkdv(CU_K, n_seqs, seqlen_k, total_k, b, n_seqs, DK + kh * stride_dkh, stride_dks,
                               DV_OUT + kh * stride_dvh, stride_dvs, DQK, DV, BLOCK_DQK, BLOCK_DV)
    else:
        heads_q = heads_kv * GROUP
        p0, p1, p2 = unravel_grid(pid - n_kv, q_blocks, heads_q)
        rank, h, b = grid_schedule(p0, p1, p2, q_blocks, heads_q, n_seqs, HEAD_GROUP)
        if BLOCK_SPARSE:
            h, b, kh, q_start, len_q, k_start, len_k, m_start = sparse_query_block_at(
                rank, h, b, q_blocks, Q_ORDER, mask_stride_b, mask_stride_h, CU_Q, CU_K, seqlen_q, seqlen_k,
                total_q, total_k, GROUP, Q_BLOCK_M, MASK_QB, IS_VARLEN)
        else:
            h, b, kh, q_start, len_q, k_start, len_k, m_start = query_block_at(
                rank, h, b, q_blocks, CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k, GROUP, Q_BLOCK_M, IS_VARLEN)
        slope_block = (b * heads_q + h) * q_blocks + m_start // Q_BLOCK_M
        if m_start < len_q:
            _dq_program(h, b, kh, q_start, len_q, k_start, len_k, m_start, Q, K, V, DO, LSE2, DELTA, SLOPES,
                        sm_scale, softcap, window_left, window_right, stride_qb, stride_qs, stride_qh, stride_kb,
                        stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
                        stride_lb, stride_lh, stride_ab, stride_dqb, stride_dqs, stride_dqh, DQ, DSLOPE_BLOCKS,
                        slope_block, KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, KV_BITS_IDX, BITS, TOK_Q, TOK_K,
                        mask_stride_b, mask_stride_h, mask_max, tok_stride_b, DQK, DV, Q_BLOCK_M, Q_BLOCK_N,
                        BLOCK_DQK, BLOCK_DV, HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, STRIDE_ALIGN,
                        LSE_ALIGN, Q_TAIL_BLOCKS, BLOCK_SPARSE, MASK_QB, MASK_KB, MASK_GLOBAL, MASK_DOC, MASK_BITS,
                        ALIBI_GRAD, drop)
        else:
            if ALIBI_GRAD:  # every block of the slopes' partial sums is written
                tl.store(DSLOPE_BLOCKS + slope_block, 0.0)
            if IS_VARLEN and not BLOCK_SPARSE:
                if m_start == (q_blocks - 1) * Q_BLOCK_M:  # the extra query block: NaN into uncovered dq rows
                    fill_uncovered_rows(CU_Q, n_seqs, seqlen_q, total_q, b, n_seqs, DQ + h * stride_dqh, stride_dqs,
                                        DQ, 0, DQK, BLOCK_DQK, False)


@triton.jit(do_not_specialize_on_alignment=SINK_INT_SCALARS)
def attn_bwd_sink_kernel(
    LSE, DELTA, SINKS, CU_Q,  # inputs
    n_seqs, seqlen_q, total_q, stride_lb, stride_lh,  # runtime scalars
    DSINK_PART, DSINK,  # outputs: per-sequence partials [n_seqs, HQ] float32, the total [HQ]
    HQ: tl.constexpr, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    h = tl.program_id(0)
    sink2 = tl.load(SINKS + h).to(tl.float32) * LOG2E
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(n_seqs):
        q_start, len_q = seq_range(CU_Q, b, seqlen_q, total_q, IS_VARLEN)
        l_off = tl.cast(b, tl.int64) * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, len_q, BLOCK):
            ok = start + offs < len_q
            # With a sink the lse is always finite; padding reads +inf -> weight 0.
            lse = tl.load(LSE + l_off + start + offs, mask=ok, other=float("inf"))
            delta = tl.load(DELTA + l_off + start + offs, mask=ok, other=0.0)
            acc += tl.exp2(sink2 - lse * LOG2E) * delta
        part = -tl.sum(acc, 0)
        tl.store(DSINK_PART + b * HQ + h, part)
        total += tl.where(offs == 0, part, 0.0)
    tl.store(DSINK + h, tl.sum(total, 0).to(DSINK.dtype.element_ty))


@triton.jit(do_not_specialize_on_alignment=ALIBI_INT_SCALARS)
def attn_bwd_alibi_kernel(
    DSLOPE_BLOCKS,  # input: float32 (n_seqs, HQ, n_blocks), the dQ programs' terms
    n_seqs, n_blocks,  # runtime scalars
    DSLOPE_PART, DSLOPE,  # outputs: per-sequence sums [n_seqs, HQ] float32; the slopes' gradient
    HQ: tl.constexpr, BLOCK: tl.constexpr, BATCHED: tl.constexpr,
):
    """The ALiBi slopes' gradient from the dQ programs' per-block terms, one program per head summing in a
    fixed order (deterministic, no atomics): per sequence (``DSLOPE_PART``; BATCHED slopes ``(B, HQ)``: also
    ``DSLOPE``), and over the sequences for slopes shared by the batch (``(HQ,)``)."""
    h = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for b in range(n_seqs):
        row = DSLOPE_BLOCKS + (tl.cast(b, tl.int64) * HQ + h) * n_blocks
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_blocks, BLOCK):
            acc += tl.load(row + start + offs, mask=start + offs < n_blocks, other=0.0)
        part = tl.sum(acc, 0)
        tl.store(DSLOPE_PART + b * HQ + h, part)
        if BATCHED:
            tl.store(DSLOPE + b * HQ + h, part.to(DSLOPE.dtype.element_ty))
        total += tl.where(offs == 0, part, 0.0)
    if not BATCHED:
        tl.store(DSLOPE + h, tl.sum(total, 0).to(DSLOPE.dtype.element_ty))
