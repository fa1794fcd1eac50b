"""Flash-Decoding kernels (``@triton.jit`` only; launches in plan.py).

* :func:`decode_fwd_kernel`: a few query tokens against a (paged) KV cache. One program per
  (KV split, kv head x row block, sequence). Its rows pack every query head of one GQA group and every
  query token (row ``r`` = token ``r // GROUP``, head ``kh * GROUP + r % GROUP``), so each K/V byte of the
  cache is read once per row block (once in all for decode shapes: ``Sq * GROUP <= BLOCK_M``). The visible
  key blocks of a sequence are split evenly across the ``num_programs(0)`` splits; each split writes its
  normalised partial ``(out, lse)`` and :func:`merge_states_kernel` merges them. With one split the kernel
  writes the final output directly. Split boundaries depend only on the sequence's own length, the split
  count and the block size: a fixed split count gives bitwise batch-invariant results.
* The cache is addressed as pages: row ``j`` of sequence ``b`` lives in page ``block_table[b, j //
  PAGE_SIZE]`` at slot ``j % PAGE_SIZE``; a contiguous cache is the special case "one page per sequence"
  (page ``b``, slot ``j``). Page, slot and head strides make NHD and HND the same code.
* FP8 (e4m3) caches: with 16-bit queries K and V tiles are widened to float16 as their even and odd
  columns (see :func:`load_e4m3_pairs`; odd head dims or strides: K to q's dtype, V to float16), with
  float32 queries to float32; the per-tensor / per-kv-head scales fold into the score scale (K) and the
  output (V), so dequantisation costs no extra pass.
* :func:`merge_states_kernel`: the exact LSE-weighted merge of N partial states (split partials,
  ``merge_attention_states`` and the two halves of cascade attention); sinks join here when the states
  were computed without them.
* :func:`append_kv_kernel`: writes new K/V tokens into the cache in place (quantising for FP8 caches,
  rotating the keys with RoPE tables: flash-attn's rotary KV-cache step; the decode kernel then rotates its
  queries as it loads them). Both take the rotation from ``rotary/kernels.py`` (:func:`rotate_tile`).

All score modifiers, the online softmax and the merge step come from ``flash_attn/kernels_common.py``.
"""
import triton
import triton.language as tl

from ..rotary.kernels import rotate_tile
from ..flash_attn.kernels_common import (aligned, aligned_strides, alibi_slope2, block_probs, cache_slots,
                                         fold_values, kv_key_range, load_tile, merge_states_block, score_params,
                                         softmax_finalize, softmax_init, softmax_normaliser)

FP8_E4M3_MAX = tl.constexpr(448.0)

# Runtime integers: no divisibility is inferred from their values (jax-triton would not infer it; the plans
# state it through the *_ALIGN constexprs instead, see core_kernels/_plan.py), so that both front-ends
# compile the same kernel.
DECODE_INT_SCALARS = (
    "seqlen_q", "fixed_len", "capacity", "num_pages", "window_left", "window_right", "rot_rows",
    "stride_qb", "stride_qs", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
    "stride_vh", "stride_tb", "stride_ab", "stride_sc", "stride_on", "stride_ob", "stride_os", "stride_oh",
    "stride_ln", "stride_lb", "stride_ls", "stride_lh")
MERGE_INT_SCALARS = ("n_a", "n_b", "n_rows", "seqlen_q", "heads", "stride_oa", "stride_la", "stride_obn",
                     "stride_lbn", "stride_lse_b", "stride_lse_s", "stride_lse_h")
APPEND_INT_SCALARS = (
    "n_new", "capacity", "num_pages", "stride_knb", "stride_kns", "stride_knh", "stride_vnb", "stride_vns",
    "stride_vnh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs", "stride_vh", "stride_tb",
    "stride_sc", "rot_rows")


# ----------------------------------------------------------------------------------------------- caches

# Two 16-bit elements of one 32-bit register, each a pair of e4m3 bytes (an even column in its low byte,
# the next odd column in its high byte) -> the two elements' even columns as f16x2 ($0) and their odd
# columns as f16x2 ($1): one byte permute and two paired conversions (exact: every e4m3 value is an f16 value).
_E4M3_PAIRS_TO_F16 = tl.constexpr("{ .reg .b32 t; .reg .b16 even, odd; prmt.b32 t, $2, 0, 0x3120; "
                                  "mov.b32 {even, odd}, t; cvt.rn.f16x2.e4m3x2 $0, even; "
                                  "cvt.rn.f16x2.e4m3x2 $1, odd; }")


@triton.jit
def load_e4m3_pairs(rows, key_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, APPLY_MASK: tl.constexpr,
                    WIDEN_ASM: tl.constexpr, TRANSPOSE: tl.constexpr):
    """An FP8 K or V tile [N, D] for 16-bit queries as two float16 tiles [N, D / 2], its even and its odd
    columns (TRANSPOSE: [D / 2, N] each, the layout of ``q @ K^T``'s K operand). ``p @ V`` then runs as
    two dots into two accumulators, interleaved once per split; ``q @ K^T`` as two dots over q's even and
    odd columns into one. Both run in f16: exact for e4m3 values, and p in [0, 1] keeps more mantissa bits
    in f16 than in bf16.

    Why: the MMAs' operands hold pairs of elements adjacent along the contraction, and Hopper's
    ``ldmatrix`` moves 16-bit elements only. Read as 16-bit elements (two adjacent columns of one key) a tile
    goes from the pipeline's shared-memory buffer straight into registers in the dot operand's layout
    (``ldmatrix.trans`` for V, plain ``ldmatrix`` for K^T); one byte permute and two conversions per register
    then give the even and the odd columns in f16. Widening V before the dot costs a trip back through
    shared memory, and K widened by Triton leaves ptxas rebuilding q's operand registers for every MMA.
    WIDEN_ASM (compiled kernels) widens in inline PTX, the interpreter with Triton's bit casts. Needs D even,
    even strides and a 2-byte aligned base (the plan's ``K_PAIRS`` / ``V_PAIRS``). A tile that serves as
    both K and V (MLA's latent) is loaded once by :func:`load_column_pairs` and widened twice by
    :func:`widen_e4m3_pairs`, with and without the transpose."""
    pairs = load_column_pairs(rows, key_ok, D, BLOCK_D, APPLY_MASK)
    if TRANSPOSE:
        pairs = tl.trans(pairs)
    return widen_e4m3_pairs(pairs, WIDEN_ASM)


@triton.jit
def load_column_pairs(rows, key_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, APPLY_MASK: tl.constexpr):
    """Rows ``rows`` [N] (pointers to each row's first byte) of an FP8 tile [N, D] as uint16 [N, BLOCK_D / 2]:
    element j holds columns 2j (low byte) and 2j + 1 (high byte). D even, 2-byte aligned rows."""
    offs_p = tl.arange(0, BLOCK_D // 2)
    pairs_row = rows.to(tl.pointer_type(tl.uint16), bitcast=True)
    return load_tile(pairs_row[:, None] + offs_p[None, :], key_ok, offs_p * 2 < D, APPLY_MASK, BLOCK_D != D)


@triton.jit
def widen_e4m3_pairs(pairs, WIDEN_ASM: tl.constexpr):
    """uint16 column pairs (:func:`load_column_pairs`, any shape) -> (even, odd) float16 tiles of that shape:
    the low and the high byte of each element as e4m3 values (see :func:`load_e4m3_pairs`)."""
    if WIDEN_ASM:
        even, odd = tl.inline_asm_elementwise(_E4M3_PAIRS_TO_F16, "=r,=r,r", [pairs],
                                              dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    else:
        even = (pairs & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = (pairs >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def f16_query(q):
    """A bf16 query tile as float16 for ``q @ K^T`` against an FP8 cache, and the power of two that undoes
    its scaling: (q16, inv_scale). e4m3 widens to f16 in one instruction per pair (``F2FP.F16.E4M3``) but
    to bf16 only through a second per-element conversion (``F2F.BF16.F16``). bf16 -> f16 is exact over f16's
    normal range; a tile whose largest |q| reaches 2^15 is first scaled by an exact power of two (folded
    back into the score scale), so no element can overflow f16. Elements below 2^-14 keep f16's subnormal
    precision (absolute error < 2^-25). The largest |q| is taken over finite elements: a +inf or NaN in one
    row (one head of a packed GQA group) must not scale the other rows' queries to 0."""
    qf = q.to(tl.float32)
    q_abs = tl.abs(qf)
    q_max = tl.max(tl.max(tl.where(q_abs < float("inf"), q_abs, 0.0), axis=1), axis=0)
    exponent = ((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(max |q|))
    shift = tl.maximum(exponent - 14, 0)  # max |q| * 2^-shift < 2^15
    scale = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2^-shift
    inv_scale = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return (qf * scale).to(tl.float16), inv_scale


@triton.jit
def block_qk(q, q_odd, Q_row, K_row, row_ok, key_ok, offs_dqk, DQK: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, DQK_CHUNKS: tl.constexpr,
             CHECK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr, K_PAIRS: tl.constexpr,
             WIDEN_ASM: tl.constexpr):
    """Raw scores q k^T [M, N] (float32). ``Q_row`` [M] / ``K_row`` [N] point at each row's first element.

    One chunk: q [M, BLOCK_DQK] is already in registers. Several (head dims above 256, e.g. a 576-dim
    latent + rope key): the dot is summed over ``DQK_CHUNKS`` column chunks of q and K, q reloaded (it is a
    few KB, L1-resident) so that no register tile is padded to the next power of two.
    K_PAIRS (an FP8 cache, one chunk): q and ``q_odd`` are q's even and odd columns in f16
    [M, Dqk / 2], K is read as column pairs (:func:`load_e4m3_pairs`) and the scores are the sum of the two
    halves' dots. Otherwise ``q_odd`` is unused.
    """
    if K_PAIRS:
        k_even, k_odd = load_e4m3_pairs(K_row, key_ok, DQK, BLOCK_DQK, CHECK_KEYS, WIDEN_ASM, True)  # [Dqk / 2, N]
        # (q is f16 in compiled kernels; the interpreter runs 16-bit queries as float32: exact widening)
        qk = tl.dot(q, k_even.to(q.dtype), input_precision=DOT_PRECISION)
        qk = tl.dot(q_odd, k_odd.to(q.dtype), qk, input_precision=DOT_PRECISION)
    elif DQK_CHUNKS == 1:
        k = load_tile(K_row[:, None] + offs_dqk[None, :], key_ok, offs_dqk < DQK, CHECK_KEYS,
                      BLOCK_DQK != DQK).to(q.dtype)  # [N, Dqk]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        qk = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c in tl.static_range(DQK_CHUNKS):
            offs = c * BLOCK_DQK + offs_dqk
            qc = load_tile(Q_row[:, None] + offs[None, :], row_ok, offs < DQK, True, DQK % BLOCK_DQK != 0)
            kc = load_tile(K_row[:, None] + offs[None, :], key_ok, offs < DQK, CHECK_KEYS, DQK % BLOCK_DQK != 0)
            qk = tl.dot(qc, tl.trans(kc.to(qc.dtype)), qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def decode_kv_range(
    acc, acc_odd, m_i, l_i, q, q_odd, Q, Q_row, K, V, BLOCK_TABLE, b, kh, blk_lo, blk_hi, tok, row_ok, offs_dqk,
    offs_dv, start, length, num_pages, qk_scale, cap2, slope2, diag, window_left, window_right, stride_tb,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, DQK_CHUNKS: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr, V_PAIRS: tl.constexpr, WIDEN_ASM: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr, K_PAIRS: tl.constexpr,
):
    """Key blocks ``[blk_lo, blk_hi)`` of one (sequence, kv head): gather K/V rows through the page table,
    score (shared modifiers) and fold into the running softmax. Key ``j`` is cache row ``start + j`` (a
    left-padded contiguous cache; 0 otherwise). Without APPLY_MASK every key of every
    block is inside the sequence and visible from every row. V_PAIRS:
    ``acc`` / ``acc_odd`` accumulate V's even / odd columns (:func:`load_e4m3_pairs`); otherwise ``acc_odd``
    is unused. K_PAIRS: q / ``q_odd`` are q's even / odd columns (see :func:`block_qk`)."""
    offs_n = tl.arange(0, BLOCK_N)
    kh64 = tl.cast(kh, tl.int64)
    for blk in range(blk_lo, blk_hi):
        n_start = blk * BLOCK_N
        offs_k = n_start + offs_n  # [N]
        key_ok = offs_k < length
        page, slot = cache_slots(BLOCK_TABLE, b, n_start + start, offs_k + start, key_ok, stride_tb, num_pages,
                                 PAGED, PAGE_SIZE, PAGE_SIZE % BLOCK_N == 0, APPLY_MASK)
        K_row = K + (page * stride_kp + slot * stride_ks + kh64 * stride_kh)  # [N]
        V_row = V + (page * stride_vp + slot * stride_vs + kh64 * stride_vh)
        qk = block_qk(q, q_odd, Q_row, K_row, row_ok, key_ok, offs_dqk, DQK, BLOCK_M, BLOCK_N, BLOCK_DQK,
                      DQK_CHUNKS, APPLY_MASK, DOT_PRECISION, K_PAIRS, WIDEN_ASM)
        if V_PAIRS:
            v, v_odd = load_e4m3_pairs(V_row, key_ok, DV, BLOCK_DV, APPLY_MASK, WIDEN_ASM, False)  # even, odd
        else:
            v = load_tile(V_row[:, None] + offs_dv[None, :], key_ok, offs_dv < DV, APPLY_MASK, BLOCK_DV != DV)
            if V.dtype.element_ty.is_fp8() and Q.dtype.element_ty != tl.float32:
                v = v.to(tl.float16)  # odd head dims or strides (see load_e4m3_pairs)
            else:
                v = v.to(Q.dtype.element_ty)
        p, alpha, m_i, l_i = block_probs(m_i, l_i, qk, tok[:, None], offs_k[None, :], qk_scale, cap2,
                                         slope2, diag, length, window_left, window_right, APPLY_MASK, HAS_LOCAL,
                                         HAS_SOFTCAP, HAS_ALIBI, POSITIVE_SCALE)
        acc = fold_values(acc, p, alpha, v, DOT_PRECISION)
        if V_PAIRS:
            acc_odd = fold_values(acc_odd, p, alpha, v_odd, DOT_PRECISION)
    return acc, acc_odd, m_i, l_i


# ----------------------------------------------------------------------------------------------- decode

@triton.jit(do_not_specialize_on_alignment=DECODE_INT_SCALARS)
def decode_fwd_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, SLOPES, SINKS, K_SCALE, V_SCALE, LEFTPAD, COS, SIN,  # absent: placeholders
    seqlen_q, fixed_len, capacity, num_pages, sm_scale, softcap, window_left, window_right, rot_rows,
    stride_qb, stride_qs, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_tb, stride_ab, stride_sc,
    stride_on, stride_ob, stride_os, stride_oh, stride_ln, stride_lb, stride_ls, stride_lh,  # runtime scalars
    O, LSE,  # outputs: final (out in q's dtype, lse) or float32 split partials, by their strides
    GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, DQK_CHUNKS: tl.constexpr, BLOCK_DV: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HAS_SEQLENS: tl.constexpr, HAS_LOCAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SCALES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    QO_ALIGN: tl.constexpr, KV_ALIGN: tl.constexpr, LSE_ALIGN: tl.constexpr, V_PAIRS: tl.constexpr,
    WIDEN_ASM: tl.constexpr, POSITIVE_SCALE: tl.constexpr, K_PAIRS: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
    ROT_HALF: tl.constexpr, ROT_INTERLEAVED: tl.constexpr, ROT_STEP: tl.constexpr, ROT_BF16: tl.constexpr,
):
    """Grid ``(num_splits, Hkv * cdiv(seqlen_q * GROUP, BLOCK_M), batch)``.

    Sequence ``b`` has ``SEQLENS[b]`` keys (clamped to ``[0, capacity]``), or ``fixed_len`` without
    SEQLENS; query token ``i`` sits on key ``i + length - seqlen_q`` (causal / window as in
    kernels_common). HAS_LEFTPAD (contiguous caches): the keys are rows ``[LEFTPAD[b], SEQLENS[b])``, counted
    from the first of them, so masks, ALiBi and split boundaries see only the real tokens (flash-attn's
    ``cache_leftpad``). ROT_HALF > 0: q is rotated as it is loaded (RoPE over its first ``2 * ROT_HALF``
    dims, tables COS / SIN ``(rot_rows, ROT_HALF)``), query token ``i`` at position
    ``length - seqlen_q + ROT_STEP * i`` (ROT_STEP 0: every query at the first new token's position, as
    flash-attn does without causal / window), then rounded to q's dtype as a separate rotation would
    (ROT_BF16: bfloat16 queries, which the interpreter holds as float32). Writes ``O[split, b, i, h, :]``
    and ``LSE[split, b, i, h]`` through the given strides (split strides 0 when the kernel writes the final
    result). Strides are multiples of QO_ALIGN (q, out),
    KV_ALIGN (caches) and LSE_ALIGN (lse) elements: see ``aligned`` in kernels_common.
    """
    stride_qb, stride_qs, stride_qh = aligned_strides(stride_qb, stride_qs, stride_qh, QO_ALIGN)
    stride_kp, stride_ks, stride_kh = aligned_strides(stride_kp, stride_ks, stride_kh, KV_ALIGN)
    stride_vp, stride_vs, stride_vh = aligned_strides(stride_vp, stride_vs, stride_vh, KV_ALIGN)
    stride_ob, stride_os, stride_oh = aligned_strides(stride_ob, stride_os, stride_oh, QO_ALIGN)
    stride_on = aligned(stride_on, QO_ALIGN)
    stride_lb, stride_ls, stride_lh = aligned_strides(stride_lb, stride_ls, stride_lh, LSE_ALIGN)
    stride_ln = aligned(stride_ln, LSE_ALIGN)
    split = tl.program_id(0)
    n_splits = tl.num_programs(0)
    b = tl.program_id(2)
    n_rows = seqlen_q * GROUP
    m_blocks = tl.cdiv(n_rows, BLOCK_M)
    kh = tl.program_id(1) // m_blocks
    m_start = (tl.program_id(1) % m_blocks) * BLOCK_M
    offs_r = m_start + tl.arange(0, BLOCK_M)  # [M] packed rows
    row_ok = offs_r < n_rows
    tok = offs_r // GROUP  # query token of each row
    h = kh * GROUP + offs_r % GROUP  # query head of each row
    if HAS_SEQLENS:
        length = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)
    else:
        length = fixed_len + b * 0
    if HAS_LEFTPAD:
        start = tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), length)
        length = length - start
    else:
        start = 0
    diag = length - seqlen_q

    # Visible key blocks of this row block, split evenly (sizes differ by at most one block).
    tok_last = (tl.minimum(m_start + BLOCK_M, n_rows) - 1) // GROUP
    lo, full_lo, full_hi, hi = kv_key_range(m_start // GROUP, tok_last, diag, length, window_left, window_right,
                                            BLOCK_N, HAS_LOCAL)
    n_blk = hi - lo
    s_lo = lo + (split * n_blk) // n_splits
    s_hi = lo + ((split + 1) * n_blk) // n_splits

    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    Q_row = Q + (tl.cast(b, tl.int64) * stride_qb + tl.cast(tok, tl.int64) * stride_qs + h * stride_qh)  # [M]
    if DQK_CHUNKS == 1:
        q = load_tile(Q_row[:, None] + offs_dqk[None, :], row_ok, offs_dqk < DQK, True, BLOCK_DQK != DQK)
        if ROT_HALF > 0:
            q = rotate_tile(q.to(tl.float32), Q_row, row_ok, offs_dqk, COS, SIN, diag + ROT_STEP * tok, rot_rows,
                            ROT_HALF, ROT_INTERLEAVED, ROT_BF16).to(Q.dtype.element_ty)
    else:
        q = Q  # unused: block_qk reloads q chunk by chunk

    qk_scale, cap2 = score_params(sm_scale, softcap, HAS_SOFTCAP)
    if HAS_SCALES:
        qk_scale = qk_scale * tl.load(K_SCALE + kh * stride_sc).to(tl.float32)
    if K.dtype.element_ty.is_fp8() and Q.dtype.element_ty == tl.bfloat16 and DQK_CHUNKS == 1:
        q, q_inv_scale = f16_query(q)  # the dot's K operand then widens once (see f16_query)
        qk_scale = qk_scale * q_inv_scale
    if K_PAIRS:  # q's even and odd columns, against K's (see block_qk)
        q, q_odd = tl.split(tl.reshape(q, [BLOCK_M, BLOCK_DQK // 2, 2]))
    else:
        q_odd = q
    if HAS_ALIBI:
        slope2 = alibi_slope2(SLOPES, b, h, stride_ab, HAS_ALIBI)[:, None]  # [M, 1]
    else:
        slope2 = 0.0
    m_i, l_i = softmax_init(SINKS, h, BLOCK_M, HAS_SINKS)
    ACC_D: tl.constexpr = BLOCK_DV // 2 if V_PAIRS else BLOCK_DV  # V_PAIRS: even / odd columns apart
    acc = tl.zeros([BLOCK_M, ACC_D], dtype=tl.float32)
    acc_odd = acc

    # Three segments, as the FlashAttention forward: masked blocks, fully visible blocks (no mask
    # arithmetic), masked blocks; each clamped to this split's blocks [s_lo, s_hi). The masked ones are empty
    # for most splits (only a window's edge or a sequence's ragged tail has blocks there), and a branch around
    # them also skips their pipelined loops' prologue and drain, which cost short splits a visible share of
    # their time. (The same branch in the attention forward made ptxas serialize the causal kernels' wgmmas;
    # the decode kernels compile without that: bench_decode.py --ptxas.)
    bounds = (lo, full_lo, full_hi, hi)
    for seg in tl.static_range(3):
        seg_lo = tl.maximum(bounds[seg], s_lo)
        seg_hi = tl.minimum(bounds[seg + 1], s_hi)
        if seg == 1 or seg_lo < seg_hi:  # `seg == 1` is a constexpr: the middle segment has no branch
            acc, acc_odd, m_i, l_i = decode_kv_range(
                acc, acc_odd, m_i, l_i, q, q_odd, Q, Q_row, K, V, BLOCK_TABLE, b, kh, seg_lo, seg_hi, tok, row_ok,
                offs_dqk, offs_dv, start, length, num_pages, qk_scale, cap2, slope2, diag, window_left, window_right,
                stride_tb, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, DQK, DV, BLOCK_M,
                BLOCK_N, BLOCK_DQK, DQK_CHUNKS, BLOCK_DV, PAGED, PAGE_SIZE, seg != 1, HAS_LOCAL, HAS_SOFTCAP,
                HAS_ALIBI, DOT_PRECISION, V_PAIRS, WIDEN_ASM, POSITIVE_SCALE, K_PAIRS)
    if V_PAIRS:  # columns 2j and 2j + 1 side by side again
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, BLOCK_DV])
    out, lse = softmax_finalize(acc, m_i, l_i)
    if HAS_SCALES:
        out = out * tl.load(V_SCALE + kh * stride_sc).to(tl.float32)

    o_row = (tl.cast(split, tl.int64) * stride_on + tl.cast(b, tl.int64) * stride_ob
             + tl.cast(tok, tl.int64) * stride_os + h * stride_oh)  # [M]
    o_ptrs = O + o_row[:, None] + offs_dv[None, :]
    if BLOCK_DV != DV:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < DV)[None, :])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    l_row = (tl.cast(split, tl.int64) * stride_ln + tl.cast(b, tl.int64) * stride_lb
             + tl.cast(tok, tl.int64) * stride_ls + h * stride_lh)
    tl.store(LSE + l_row, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------------ merge

@triton.jit
def merge_stack(acc, m_i, l_i, O, L, n_states, stride_o, stride_l, offs_e, r, e_ok, BLOCK_N: tl.constexpr):
    """Fold states ``0..n_states-1`` of one stack (``O[n * stride_o + e]``, ``L[n * stride_l + r]``) into the
    running merge, BLOCK_N states per step: the loads of a step are independent, so a merge of many
    splits costs a few memory round trips, not one per split."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, n_states, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < n_states
        n64 = tl.cast(n, tl.int64)[:, None]
        ok = n_ok[:, None] & e_ok[None, :]
        lse = tl.load(L + n64 * stride_l + r[None, :], mask=ok, other=float("-inf"))  # [N, E]
        o = tl.load(O + n64 * stride_o + offs_e[None, :], mask=ok, other=0.0).to(tl.float32)
        acc, m_i, l_i = merge_states_block(acc, m_i, l_i, lse, o)
    return acc, m_i, l_i


@triton.jit(do_not_specialize_on_alignment=MERGE_INT_SCALARS)
def merge_states_kernel(
    O_A, L_A, O_B, L_B, SINKS,  # inputs: two stacks of states (B optional), sinks optional
    n_a, n_b, n_rows, seqlen_q, heads, stride_oa, stride_la, stride_obn, stride_lbn,
    stride_lse_b, stride_lse_s, stride_lse_h,  # runtime scalars
    O, LSE,  # outputs: out (rows, DV) contiguous, lse through its (batch, token, head) strides
    DV: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, HAS_B: tl.constexpr,
    HAS_SINKS: tl.constexpr, O_ALIGN: tl.constexpr, L_ALIGN: tl.constexpr,
):
    """``out = sum_n exp(lse_n - lse) o_n``, ``lse = log(sum_n exp(lse_n) [+ exp(sink_h)])`` over the
    ``n_a`` states of A then the ``n_b`` states of B, in that fixed order (deterministic).

    State ``n`` of A is ``O_A[n * stride_oa + r * DV + d]`` / ``L_A[n * stride_la + r]`` for rows
    ``r < n_rows``; row ``r`` is (batch, token, head) = ``(r // (seqlen_q * heads), r // heads % seqlen_q,
    r % heads)``, which places the lse and picks the sink. The merge runs element by element over the
    flattened ``(row, d)`` outputs, BLOCK_E of them per program (grid ``(cdiv(n_rows * DV, BLOCK_E),)``),
    each element recomputing its row's weights from the (cached) lse: a few extra exp2s buy tiles that do
    not depend on DV and programs for every SM even when there are few rows. The lanes with ``d == 0``
    store the row's lse. State strides are multiples of O_ALIGN (outs) and L_ALIGN (lses) elements.
    """
    stride_oa = aligned(stride_oa, O_ALIGN)
    stride_obn = aligned(stride_obn, O_ALIGN)
    stride_la = aligned(stride_la, L_ALIGN)
    stride_lbn = aligned(stride_lbn, L_ALIGN)
    offs_e = tl.cast(tl.program_id(0), tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < tl.cast(n_rows, tl.int64) * DV
    r = tl.cast(offs_e // DV, tl.int32)
    h = r % heads
    m_i, l_i = softmax_init(SINKS, tl.where(e_ok, h, 0), BLOCK_E, HAS_SINKS)
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    acc, m_i, l_i = merge_stack(acc, m_i, l_i, O_A, L_A, n_a, stride_oa, stride_la, offs_e, r, e_ok, BLOCK_N)
    if HAS_B:
        acc, m_i, l_i = merge_stack(acc, m_i, l_i, O_B, L_B, n_b, stride_obn, stride_lbn, offs_e, r, e_ok,
                                    BLOCK_N)
    inv_l, lse = softmax_normaliser(m_i, l_i)  # element-wise: elements whose row saw nothing give 0, -inf
    tl.store(O + offs_e, (acc * inv_l).to(O.dtype.element_ty), mask=e_ok)
    b = r // (seqlen_q * heads)
    s = (r // heads) % seqlen_q
    l_off = tl.cast(b, tl.int64) * stride_lse_b + tl.cast(s, tl.int64) * stride_lse_s + h * stride_lse_h
    tl.store(LSE + l_off, lse, mask=e_ok & (offs_e % DV == 0))


# ----------------------------------------------------------------------------------------------- append

@triton.jit
def e4m3_bits(x):
    """float32 -> the e4m3fn bit pattern (uint8) of ``x``, rounded to nearest even and saturated at +-448;
    NaN stays NaN, stored as 0x7F whatever its sign (a GPU's conversions and multiplies do not keep a NaN's
    sign bit, so keeping it would make the CPU and GPU bytes differ).

    Computed with integer arithmetic rather than ``x.to(tl.float8e4nv)`` because Triton's interpreter
    converts wrongly (a rounding carry into the exponent halves the value; negative subnormals lose bits);
    on a GPU the result is the same as the hardware's ``cvt.rn.satfinite``, so both paths store the same
    bits, which are also those of ``torch``/``ml_dtypes`` casts of the clamped value. NaN is picked out
    before the clamp (a GPU's max/min return the non-NaN operand, which would store -448).
    """
    nan = x != x
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    x = tl.where(nan, 0.0, tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX))
    a = tl.abs(x)
    ia = a.to(tl.int32, bitcast=True)
    # normal range (|x| >= 2^-6): round the float32 mantissa to 3 bits (the carry may bump the exponent)
    ia = (ia + 0x7FFFF + ((ia >> 20) & 1)) & -1048576
    normal = (((ia >> 23) - 120) << 3) | ((ia >> 20) & 7)
    # subnormal range: multiples of 2^-9; adding 2^14 rounds to them (nearest even) in float32
    sub = (((a + 16384.0) - 16384.0) * 512.0).to(tl.int32)
    bits = tl.where(nan, 0x7F, tl.where(a < 0.015625, sub, normal) | sign)
    return bits.to(tl.uint8)


@triton.jit
def append_tile(NEW_row, OUT_row, SCALE, kh, ok, stride_sc, COS, SIN, rot_pos, rot_rows, D: tl.constexpr,
                BLOCK_D: tl.constexpr, FP8: tl.constexpr, HAS_SCALES: tl.constexpr, ROT_HALF: tl.constexpr,
                ROT_INTERLEAVED: tl.constexpr, ROT_BF16: tl.constexpr):
    """Copy one [S, D] tile of new tokens into the cache rows ``OUT_row`` [S] (quantised for FP8).
    ROT_HALF > 0: rotated first (RoPE at positions ``rot_pos`` [S]), rounded to the new tokens' dtype as a
    separate rotation would have stored them (ROT_BF16: bfloat16 tokens, float32 in the interpreter)."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (offs_d < D)[None, :]
    x = tl.load(NEW_row[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROT_HALF > 0:
        x = rotate_tile(x, NEW_row, ok, offs_d, COS, SIN, rot_pos, rot_rows, ROT_HALF, ROT_INTERLEAVED, ROT_BF16)
        if not ROT_BF16:
            x = x.to(NEW_row.dtype.element_ty).to(tl.float32)
    if FP8:
        if HAS_SCALES:
            # IEEE division (Triton's plain fp32 '/' is approximate on NVIDIA): the same bits as torch / numpy
            x = tl.div_rn(x, tl.load(SCALE + kh * stride_sc).to(tl.float32))
        y = e4m3_bits(x).to(OUT_row.dtype.element_ty, bitcast=True)
    else:
        y = x.to(OUT_row.dtype.element_ty)
    tl.store(OUT_row[:, None] + offs_d[None, :], y, mask=mask)


@triton.jit(do_not_specialize_on_alignment=APPEND_INT_SCALARS)
def append_kv_kernel(
    K_NEW, V_NEW, SEQLENS, BLOCK_TABLE, K_SCALE, V_SCALE, LEFTPAD, COS, SIN, K_IN, V_IN,  # K_IN/V_IN: caches
    n_new, capacity, num_pages, stride_knb, stride_kns, stride_knh, stride_vnb, stride_vns, stride_vnh,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_tb, stride_sc, rot_rows,  # scalars
    K_OUT, V_OUT,  # the caches again (torch: the same tensors; jax-triton: outputs aliased to K_IN / V_IN)
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8: tl.constexpr, HAS_SCALES: tl.constexpr,
    NEW_ALIGN: tl.constexpr, KV_ALIGN: tl.constexpr, HAS_LEFTPAD: tl.constexpr, ROT_HALF: tl.constexpr,
    ROT_INTERLEAVED: tl.constexpr, ROT_BF16: tl.constexpr,
):
    """Token ``s`` of ``k_new[b]`` goes to cache row ``SEQLENS[b] + s`` of sequence ``b`` (through the page
    table when paged). ROT_HALF > 0: the keys are rotated as they are written (flash-attn's rotary KV-cache
    step), each at its row's position counted from the first real token (``row - LEFTPAD[b]``). Rows at or
    past ``capacity`` are dropped (the front-ends reject such calls; this is the second line). Grid
    ``(cdiv(n_new, BLOCK_S), Hkv, batch)``; only new rows are touched. Strides are multiples of NEW_ALIGN
    (k_new, v_new) and KV_ALIGN (caches) elements."""
    stride_knb, stride_kns, stride_knh = aligned_strides(stride_knb, stride_kns, stride_knh, NEW_ALIGN)
    stride_vnb, stride_vns, stride_vnh = aligned_strides(stride_vnb, stride_vns, stride_vnh, NEW_ALIGN)
    stride_kp, stride_ks, stride_kh = aligned_strides(stride_kp, stride_ks, stride_kh, KV_ALIGN)
    stride_vp, stride_vs, stride_vh = aligned_strides(stride_vp, stride_vs, stride_vh, KV_ALIGN)
    kh = tl.program_id(1)
    b = tl.program_id(2)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    start = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)
    pos = start + offs_s
    ok = (offs_s < n_new) & (pos < capacity)
    page, slot = cache_slots(BLOCK_TABLE, b, 0, pos, ok, stride_tb, num_pages, PAGED, PAGE_SIZE, False, True)
    if HAS_LEFTPAD:
        rot_pos = pos - tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), start)
    else:
        rot_pos = pos
    b64 = tl.cast(b, tl.int64)
    kh64 = tl.cast(kh, tl.int64)
    s64 = tl.cast(offs_s, tl.int64)
    append_tile(K_NEW + (b64 * stride_knb + s64 * stride_kns + kh64 * stride_knh),
                K_OUT + (page * stride_kp + slot * stride_ks + kh64 * stride_kh), K_SCALE, kh, ok, stride_sc, COS, SIN,
                rot_pos, rot_rows, DQK, BLOCK_DQK, FP8, HAS_SCALES, ROT_HALF, ROT_INTERLEAVED, ROT_BF16)
    append_tile(V_NEW + (b64 * stride_vnb + s64 * stride_vns + kh64 * stride_vnh),
                V_OUT + (page * stride_vp + slot * stride_vs + kh64 * stride_vh), V_SCALE, kh, ok, stride_sc, COS, SIN,
                rot_pos, rot_rows, DV, BLOCK_DV, FP8, HAS_SCALES, 0, False, False)
