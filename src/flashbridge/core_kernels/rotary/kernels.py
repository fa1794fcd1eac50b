"""Rotary position embedding (RoPE) kernel, forward and backward (``@triton.jit`` only; launches in plan.py).

One kernel, ``rotary_kernel``, rotates the first ``2 * HALF`` dims of every head of a block of tokens::

    (y_a, y_b) = (x_a cos - x_b sin,  x_b cos + x_a sin)     cos / sin = row ``pos`` of the tables

with ``(a, b) = (i, i + HALF)`` (GPT-NeoX halves) or ``(2i, 2i + 1)`` (INTERLEAVED, GPT-J pairs); the other
``PASS`` dims of a head are copied (COPY_PASS; in place they are already there). CONJUGATE negates sin: the
inverse rotation, which is the backward (the rotation is orthogonal). HAS_K rotates a second tensor (k) of
the same tokens in the same program, so q and k share one launch and one load of each token's cos / sin row.

A program owns BLOCK_T tokens x BLOCK_H heads (x BLOCK_HK heads of k): the head dims are contiguous and
their halves are loaded as two [BLOCK_T, BLOCK_H, ROT_BLOCK] tiles (interleaved: one tile, split in
registers), so every access is a 16-byte vector. Positions are the token's index in its sequence
(POS_MODE 0), read from position ids (1), or, packed (2), the token's offset from the start of its sequence,
found by a binary search over ``cu_seqlens``: no max_seqlen, no programs for padding. Positions are clamped
to the table, so a bad position id reads a wrong row, never outside the table.
"""
import triton
import triton.language as tl

from ..flash_attn.kernels_common import aligned

# Runtime integers: no divisibility is inferred from their values (jax-triton would not infer it; the
# plan states the strides' through STRIDE_ALIGN), so that both front-ends compile the same kernel.
INT_SCALARS = ("n_tokens", "seqlen", "n_seqs", "search_steps", "rot_rows", "stride_xb", "stride_xs",
               "stride_xh", "stride_kb", "stride_ks", "stride_kh", "stride_pb", "stride_ps")


@triton.jit
def _positions(POS, CU, tok, tok_ok, b, s, n_seqs, search_steps, rot_rows, stride_pb, stride_ps,
               POS_MODE: tl.constexpr):
    """The table row of every token in ``tok`` [BLOCK_T], clamped to [0, rot_rows)."""
    if POS_MODE == 1:
        pos = tl.load(POS + b.to(tl.int64) * stride_pb + s.to(tl.int64) * stride_ps, mask=tok_ok,
                      other=0).to(tl.int32)
    elif POS_MODE == 2:
        # the last sequence i with cu[i] <= tok: invariant cu[lo] <= tok < cu[hi] (empty sequences skipped)
        lo = tl.zeros_like(tok)
        hi = lo + n_seqs
        for _ in range(search_steps):  # ceil(log2(n_seqs)) halvings
            mid = (lo + hi) // 2
            right = tl.load(CU + mid).to(tl.int32) <= tok
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        pos = tok - tl.load(CU + lo).to(tl.int32)
    else:
        pos = s
    return tl.minimum(tl.maximum(pos, 0), rot_rows - 1)


@triton.jit
def rotate_pair(xa, xb, c, s):
    """The rotation of one pair ``(x_a, x_b)`` by the angle whose cosine / sine are ``c`` / ``s``: the one
    formula of the family (float32 in, float32 out)."""
    return xa * c - xb * s, xb * c + xa * s


@triton.jit
def round_to_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32, in integer arithmetic: the
    interpreter holds bfloat16 data as float32, so a cast to the data's dtype would not round there; this
    gives the CPU the GPU's bits. NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def rotate_tile(x, X_row, row_ok, offs_d, COS, SIN, pos, rot_rows, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
                ROUND_BF16: tl.constexpr):
    """RoPE of a tile already in registers, for kernels that rotate while they load or store (the KV-cache
    step: ``append_kv_kernel`` rotates new keys, ``decode_fwd_kernel`` its queries). ``x`` [N, BLOCK_D]
    (float32) holds columns ``offs_d`` of the rows ``X_row`` [N] (pointers to each row's first element,
    columns contiguous); ``pos`` [N] their table rows, clamped to [0, rot_rows). Each rotated column reloads
    its pair partner (``d ^ 1`` interleaved, ``d +- HALF`` in halves) -- the rows are a few KB, cache-resident
    -- so the tile keeps its layout; columns from ``2 * HALF`` on pass through. Returns float32, rounded to
    bfloat16 values with ROUND_BF16 (bf16 data: the values a separate rotation would have stored)."""
    if INTERLEAVED:
        first = offs_d % 2 == 0
        partner = offs_d ^ 1
        col = offs_d // 2
    else:
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        col = tl.where(first, offs_d, offs_d - HALF)
    rot = offs_d < 2 * HALF
    mask = row_ok[:, None] & rot[None, :]
    xp = tl.load(X_row[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    row = tl.minimum(tl.maximum(pos, 0), rot_rows - 1).to(tl.int64)
    table = row[:, None] * HALF + col[None, :]
    c = tl.load(COS + table, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + table, mask=mask, other=0.0).to(tl.float32)
    ya, _ = rotate_pair(x, xp, c, s)  # column d is the pair's a: (x, partner)
    _, yb = rotate_pair(xp, x, c, s)  # column d is the pair's b: (partner, x)
    y = tl.where(rot[None, :], tl.where(first[None, :], ya, yb), x)
    if ROUND_BF16:
        y = round_to_bf16(y)
    return y


@triton.jit
def _rotate_heads(X, OUT, x_tok, o_tok, tok_ok, heads, head_ok, stride_xh, stride_oh, cos, sin,
                  HALF: tl.constexpr, PASS: tl.constexpr, ROT_BLOCK: tl.constexpr, BLOCK_PASS: tl.constexpr,
                  INTERLEAVED: tl.constexpr, COPY_PASS: tl.constexpr):
    """Rotate heads ``heads`` [BLOCK_H] of the tokens whose rows start at ``x_tok`` (in X) / ``o_tok`` (in OUT)
    [BLOCK_T]; ``cos`` / ``sin`` are the tokens' rows [BLOCK_T, ROT_BLOCK] in float32."""
    BLOCK_T: tl.constexpr = x_tok.shape[0]
    BLOCK_H: tl.constexpr = heads.shape[0]
    row_ok = tok_ok[:, None, None] & head_ok[None, :, None]  # [BLOCK_T, BLOCK_H, 1]
    x_row = X + x_tok[:, None, None] + heads[None, :, None].to(tl.int64) * stride_xh
    o_row = OUT + o_tok[:, None, None] + heads[None, :, None].to(tl.int64) * stride_oh
    c = cos[:, None, :]  # the same angles for every head
    s = sin[:, None, :]
    if INTERLEAVED:
        d = tl.arange(0, 2 * ROT_BLOCK)[None, None, :]
        mask = row_ok & (d < 2 * HALF)
        x = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H, 2 * ROT_BLOCK]
        xa, xb = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, ROT_BLOCK, 2)))
        ya, yb = rotate_pair(xa, xb, c, s)
        y = tl.join(ya, yb)
        tl.store(o_row + d, tl.reshape(y, (BLOCK_T, BLOCK_H, 2 * ROT_BLOCK)).to(OUT.dtype.element_ty), mask=mask)
    else:
        i = tl.arange(0, ROT_BLOCK)[None, None, :]
        mask = row_ok & (i < HALF)
        xa = tl.load(x_row + i, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_T, BLOCK_H, ROT_BLOCK]
        xb = tl.load(x_row + HALF + i, mask=mask, other=0.0).to(tl.float32)
        ya, yb = rotate_pair(xa, xb, c, s)
        tl.store(o_row + i, ya.to(OUT.dtype.element_ty), mask=mask)
        tl.store(o_row + HALF + i, yb.to(OUT.dtype.element_ty), mask=mask)
    if COPY_PASS:  # the dims past the rotary ones, unchanged (in place they are already there)
        p = tl.arange(0, BLOCK_PASS)[None, None, :]
        mask = row_ok & (p < PASS)
        tl.store(o_row + 2 * HALF + p, tl.load(x_row + 2 * HALF + p, mask=mask, other=0.0), mask=mask)


@triton.jit(do_not_specialize_on_alignment=INT_SCALARS)
def rotary_kernel(
    X, K, COS, SIN, POS, CU,  # inputs: K / POS / CU are placeholders unless HAS_K / POS_MODE say otherwise
    n_tokens, seqlen, n_seqs, search_steps, rot_rows,  # runtime scalars
    stride_xb, stride_xs, stride_xh, stride_kb, stride_ks, stride_kh, stride_pb, stride_ps,
    OUT, OUT_K,  # outputs: contiguous, or (INPLACE) the buffers of X / K themselves
    HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HK: tl.constexpr, ROT_BLOCK: tl.constexpr,
    BLOCK_PASS: tl.constexpr, INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, INPLACE: tl.constexpr,
    HAS_K: tl.constexpr, POS_MODE: tl.constexpr, COPY_PASS: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
):
    HEAD_DIM: tl.constexpr = 2 * HALF + PASS
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # token index in (B * S) or T
    tok_ok = tok < n_tokens
    b = tok // seqlen
    s = tok - b * seqlen
    pos = _positions(POS, CU, tok, tok_ok, b, s, n_seqs, search_steps, rot_rows, stride_pb, stride_ps,
                     POS_MODE)
    i = tl.arange(0, ROT_BLOCK)
    table = pos[:, None].to(tl.int64) * HALF + i[None, :]
    table_ok = tok_ok[:, None] & (i < HALF)[None, :]
    cos = tl.load(COS + table, mask=table_ok, other=0.0).to(tl.float32)  # [BLOCK_T, ROT_BLOCK]
    sin = tl.load(SIN + table, mask=table_ok, other=0.0).to(tl.float32)
    if CONJUGATE:
        sin = -sin

    head_block = tl.program_id(1)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    x_tok = b.to(tl.int64) * aligned(stride_xb, STRIDE_ALIGN) + s.to(tl.int64) * aligned(stride_xs, STRIDE_ALIGN)
    stride_xh = aligned(stride_xh, STRIDE_ALIGN)
    if INPLACE:
        _rotate_heads(X, OUT, x_tok, x_tok, tok_ok, heads, heads < HEADS, stride_xh, stride_xh, cos, sin,
                      HALF, PASS, ROT_BLOCK, BLOCK_PASS, INTERLEAVED, COPY_PASS)
    else:
        _rotate_heads(X, OUT, x_tok, tok.to(tl.int64) * (HEADS * HEAD_DIM), tok_ok, heads, heads < HEADS,
                      stride_xh, HEAD_DIM, cos, sin, HALF, PASS, ROT_BLOCK, BLOCK_PASS, INTERLEAVED, COPY_PASS)
    if HAS_K:
        k_heads = head_block * BLOCK_HK + tl.arange(0, BLOCK_HK)
        k_tok = b.to(tl.int64) * aligned(stride_kb, STRIDE_ALIGN) + s.to(tl.int64) * aligned(stride_ks, STRIDE_ALIGN)
        stride_kh = aligned(stride_kh, STRIDE_ALIGN)
        if INPLACE:
            _rotate_heads(K, OUT_K, k_tok, k_tok, tok_ok, k_heads, k_heads < K_HEADS, stride_kh, stride_kh, cos,
                          sin, HALF, PASS, ROT_BLOCK, BLOCK_PASS, INTERLEAVED, COPY_PASS)
        else:
            _rotate_heads(K, OUT_K, k_tok, tok.to(tl.int64) * (K_HEADS * HEAD_DIM), tok_ok, k_heads,
                          k_heads < K_HEADS, stride_kh, HEAD_DIM, cos, sin, HALF, PASS, ROT_BLOCK, BLOCK_PASS,
                          INTERLEAVED, COPY_PASS)
