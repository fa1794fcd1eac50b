"""FlashAttention forward kernel (``@triton.jit`` only; launches in plan.py).

``out = softmax(mods(softmax_scale * q k^T)) v`` and ``lse = log(sum exp(...))`` for one block of
``BLOCK_M`` query rows of one (sequence, query head) per program. The KV axis is walked in three segments
(see :func:`kv_block_range`): masked blocks before the fully visible ones, the fully visible blocks
without any mask arithmetic, masked blocks after (the causal diagonal, a ragged tail). The masked segments
may walk their keys in narrower blocks of ``MASKED_BLOCK_N`` (a divisor of ``BLOCK_N``): the same keys, a
smaller score tile for the loop that also carries the mask arithmetic. Grid:
``(cdiv(max_seqlen_q, BLOCK_M), Hq, batch)``, its order set by ``HEAD_GROUP`` (see :func:`block_schedule`);
GQA maps query head h to kv head ``h // GROUP``. Packed sequences (IS_VARLEN) add one query block to the
grid, past every sequence, whose programs (one per head and sequence) write NaN into the rows no sequence
covers when the offsets are invalid (see :func:`fill_uncovered_rows`; they return at once for valid ones).

BLOCK_SPARSE (a flashbridge.masks.BlockMask): the same program walks the key blocks its query block lists
instead -- the full ones without mask arithmetic, then the partial ones through the mask's element test
(see :func:`fwd_kv_list`). The plan picks tiles that divide the mask's blocks.

Key caches (forward only): PAGE_SIZE > 0 reads K / V ``(num_pages, PAGE_SIZE, Hkv, D)`` through
``BLOCK_TABLE`` ``(B, max_pages)`` (``seqlen_k`` = the table's capacity, ``stride_k/vb`` the page strides);
KV_BATCHED reads a ``(B, S_max, Hkv, D)`` cache beside packed queries; HAS_SEQUSED bounds each sequence's keys
by ``SEQUSED_K[b]`` (clamped to ``[0, seqlen_k]``), so rows past it are never read. Causal and windows align
at the bottom-right of (the sequence's queries, its used keys).
"""
import triton
import triton.language as tl

from .kernels_common import (aligned, aligned_strides, alibi_slope2, block_schedule, dropout_block, dropout_state,
                             fill_uncovered_rows, fwd_kv_list, fwd_kv_range, kv_block_range, list_length, load_tile,
                             fixed_tokens, query_block, score_params, softmax_finalize, softmax_init,
                             sparse_query_block_at)

# Runtime integers: no divisibility is inferred from their values (jax-triton would not infer it; the plan
# states it through STRIDE_ALIGN / LSE_ALIGN instead), so that both front-ends compile the same kernel.
FWD_INT_SCALARS = (
    "seqlen_q", "seqlen_k", "total_q", "total_k", "window_left", "window_right",
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
    "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_lh", "stride_ab",
    "mask_stride_b", "mask_stride_h", "mask_max", "tok_stride_b", "table_stride", "num_pages")


@triton.jit(do_not_specialize_on_alignment=FWD_INT_SCALARS)
def attn_fwd_kernel(
    Q, K, V, SLOPES, SINKS, CU_Q, CU_K,  # inputs (unused ones are placeholders, see the HAS_* flags)
    KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_ORDER, KV_BITS_IDX, BITS, TOK_Q, TOK_K,  # BlockMask (BLOCK_SPARSE)
    SEED,  # int32 (1,), HAS_DROPOUT
    BLOCK_TABLE, SEQUSED_K,  # a paged cache's table (PAGE_SIZE > 0), the keys used per sequence (HAS_SEQUSED)
    seqlen_q, seqlen_k, total_q, total_k, sm_scale, softcap, window_left, window_right,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_lh, stride_ab,
    mask_stride_b, mask_stride_h, mask_max, tok_stride_b, dropout_p, table_stride, num_pages,  # runtime scalars
    O, LSE,  # outputs: out [.., Hq, DV] in q's dtype, lse float32
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STRIDE_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr,
    MASKED_STAGES: tl.constexpr, POSITIVE_SCALE: tl.constexpr, HEAD_GROUP: tl.constexpr,
    MASKED_BLOCK_N: tl.constexpr, BLOCK_SPARSE: tl.constexpr, MASK_QB: tl.constexpr, MASK_KB: tl.constexpr,
    MASK_GLOBAL: tl.constexpr, MASK_DOC: tl.constexpr, MASK_BITS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    KV_BATCHED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 0, HAS_SEQUSED: tl.constexpr = False,
):
    # Strides are multiples of STRIDE_ALIGN (q, k, v, o) and LSE_ALIGN (lse) elements: see aligned().
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, STRIDE_ALIGN)
    stride_kb, stride_ks, stride_kh = aligned_strides(stride_kb, stride_ks, stride_kh, STRIDE_ALIGN)
    stride_vb, stride_vs, stride_vh = aligned_strides(stride_vb, stride_vs, stride_vh, STRIDE_ALIGN)
    stride_ob, stride_os, stride_oh = aligned_strides(stride_ob, stride_os, stride_oh, STRIDE_ALIGN)
    stride_lb = aligned(stride_lb, LSE_ALIGN)
    stride_lh = aligned(stride_lh, LSE_ALIGN)
    if BLOCK_SPARSE:  # the mask's query blocks, longest first
        rank, h, b = block_schedule(HEAD_GROUP)
        h, b, kh, q_start, len_q, k_start, len_k, m_start = sparse_query_block_at(
            rank, h, b, tl.num_programs(0), Q_ORDER, mask_stride_b, mask_stride_h, CU_Q, CU_K, seqlen_q, seqlen_k,
            total_q, total_k, GROUP, BLOCK_M, MASK_QB, IS_VARLEN)
    else:
        h, b, kh, q_start, len_q, k_start, len_k, m_start = query_block(
            CU_Q, CU_K, seqlen_q, seqlen_k, total_q, total_k, GROUP, BLOCK_M, IS_VARLEN, HEAD_GROUP)
    if KV_BATCHED or PAGE_SIZE > 0:  # keys in a (B, S_max, ..) or paged cache beside packed queries
        k_start = 0
        len_k = seqlen_k
    if HAS_SEQUSED:
        len_k = tl.minimum(tl.maximum(tl.load(SEQUSED_K + b), 0), len_k)
    if m_start >= len_q:
        if IS_VARLEN and not BLOCK_SPARSE:
            if m_start == (tl.num_programs(0) - 1) * BLOCK_M:  # the extra query block: NaN into uncovered rows
                fill_uncovered_rows(CU_Q, tl.num_programs(2), seqlen_q, total_q, b, tl.num_programs(2),
                                    O + h * stride_oh, stride_os, LSE + tl.cast(h, tl.int64) * stride_lh, 1, DV,
                                    BLOCK_DV, True)
        return

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [M] query index within the sequence
    offs_r = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < len_q

    # 64-bit bases: batch * stride and row * stride overflow int32 on long packed batches.
    q_base = tl.cast(b, tl.int64) * stride_qb + tl.cast(q_start + m_start, tl.int64) * stride_qs + h * stride_qh
    q = load_tile(Q + q_base + offs_r[:, None] * stride_qs + offs_dqk[None, :], row_ok, offs_dqk < DQK,
                  True, BLOCK_DQK != DQK)  # [M, Dqk]
    if PAGE_SIZE > 0:  # the kv head of page 0; the batch strides are the page strides
        K_base = K + kh * stride_kh
        V_base = V + kh * stride_vh
    else:
        K_base = K + tl.cast(b, tl.int64) * stride_kb + tl.cast(k_start, tl.int64) * stride_ks + kh * stride_kh
        V_base = V + tl.cast(b, tl.int64) * stride_vb + tl.cast(k_start, tl.int64) * stride_vs + kh * stride_vh

    qk_scale, cap2 = score_params(sm_scale, softcap, HAS_SOFTCAP)
    slope2 = alibi_slope2(SLOPES, b, h, stride_ab, HAS_ALIBI)
    diag = len_k - len_q
    m_i, l_i = softmax_init(SINKS, h, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    drop = None
    if HAS_DROPOUT:
        drop = dropout_block(dropout_state(SEED, dropout_p), m_start)

    if BLOCK_SPARSE:
        # This query block's row of the mask's lists (BLOCK_M divides MASK_QB); batch / head strides are 0
        # where the mask is shared. Full blocks first (no mask arithmetic, BLOCK_N keys a step), then the
        # partial ones (MASKED_BLOCK_N keys a step, the mask's element test).
        qb = m_start // MASK_QB
        row = tl.cast(b * mask_stride_b + h * mask_stride_h + qb, tl.int64)
        lists = row * mask_max
        tok = tl.cast(b, tl.int64) * tok_stride_b
        tq = fixed_tokens(TOK_Q + tok, TOK_K + tok, offs_m[:, None], row_ok[:, None], MASK_GLOBAL, MASK_DOC)  # [M, 1]
        m_local = offs_m - qb * MASK_QB
        acc, m_i, l_i = fwd_kv_list(acc, m_i, l_i, q, K_base, V_base, list_length(FULL_KV_NUM, row, mask_max),
                                    FULL_KV_IDX + lists, KV_BITS_IDX + lists, BITS, TOK_K + tok, tq, offs_m, m_local,
                                    offs_dqk, offs_dv, stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k,
                                    window_left, window_right, DQK, DV, BLOCK_N, BLOCK_DQK, BLOCK_DV, MASK_QB,
                                    MASK_KB, False, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP,
                                    HAS_ALIBI, DOT_PRECISION, 0, POSITIVE_SCALE, drop, b, h)
        acc, m_i, l_i = fwd_kv_list(acc, m_i, l_i, q, K_base, V_base, list_length(KV_NUM, row, mask_max),
                                    KV_IDX + lists, KV_BITS_IDX + lists, BITS, TOK_K + tok, tq, offs_m, m_local,
                                    offs_dqk, offs_dv, stride_ks, stride_vs, qk_scale, cap2, slope2, diag, len_k,
                                    window_left, window_right, DQK, DV, MASKED_BLOCK_N, BLOCK_DQK, BLOCK_DV, MASK_QB,
                                    MASK_KB, True, HAS_LOCAL, MASK_GLOBAL, MASK_DOC, MASK_BITS, HAS_SOFTCAP, HAS_ALIBI,
                                    DOT_PRECISION, MASKED_STAGES, POSITIVE_SCALE, drop, b, h)
    else:
        lo, full_lo, full_hi, hi = kv_block_range(m_start, len_q, len_k, window_left, window_right,
                                                  BLOCK_M, BLOCK_N, HAS_LOCAL)
        bounds = (lo, full_lo, full_hi, hi)  # masked, fully visible (no mask arithmetic), masked (BLOCK_N units)
        for seg in tl.static_range(3):
            # key blocks of this segment's width: BLOCK_N for the visible one, MASKED_BLOCK_N for the masked ones
            split = 1 if seg == 1 else BLOCK_N // MASKED_BLOCK_N
            acc, m_i, l_i = fwd_kv_range(acc, m_i, l_i, q, K_base, V_base, bounds[seg] * split,
                                         bounds[seg + 1] * split, offs_m, offs_dqk, offs_dv, stride_ks, stride_vs,
                                         qk_scale, cap2, slope2, diag, len_k, window_left, window_right, DQK, DV,
                                         BLOCK_N if seg == 1 else MASKED_BLOCK_N, BLOCK_DQK, BLOCK_DV, seg != 1,
                                         HAS_LOCAL, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, MASKED_STAGES,
                                         POSITIVE_SCALE, drop, b, h, (BLOCK_TABLE, b, table_stride, num_pages,
                                                                   stride_kb, stride_vb), PAGE_SIZE)
    out, lse = softmax_finalize(acc, m_i, l_i)
    if HAS_DROPOUT:  # the kept weights' scale 1 / (1 - p_q) (attend_block drops without scaling)
        out = out * drop[2]

    o_base = tl.cast(b, tl.int64) * stride_ob + tl.cast(q_start + m_start, tl.int64) * stride_os + h * stride_oh
    o_ptrs = O + o_base + offs_r[:, None] * stride_os + offs_dv[None, :]
    if BLOCK_DV != DV:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < DV)[None, :])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    l_base = tl.cast(b, tl.int64) * stride_lb + tl.cast(h, tl.int64) * stride_lh + q_start
    tl.store(LSE + l_base + offs_m, lse, mask=row_ok)
