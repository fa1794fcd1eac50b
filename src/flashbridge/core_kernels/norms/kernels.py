"""Fused RMSNorm / LayerNorm kernels, forward and backward (``@triton.jit`` only; launches in plan.py).

One forward kernel covers the whole family through constexpr flags::

    h = x (+ residual)                      HAS_RES: h is also stored, the pre-norm transformer pattern
    z = norm(h) (* w) (+ b)                 IS_RMS: h * rstd, else (h - mean) * rstd; LayerNorm statistics
                                            by a parallel Welford merge across the row
    y = dropout(z) (+ post_residual)        HAS_DROPOUT: counter-based Philox keyed by (seed, element index),
                                            so the backward regenerates the mask instead of storing it

A forward program owns BLOCK_M whole rows (a [BLOCK_M, NCHUNK, CHUNK] tile, NCHUNK * CHUNK >= width), so each input is read
once and each output written once. The backward is persistent: each program walks row tiles with a fixed
stride and keeps its dweight / dbias partial sums in registers; ``sum_partials_kernel`` then reduces the
per-program partials in a fixed order, so dweight is deterministic without atomics.

Range: the forward's statistics are taken of the row scaled by a power of two near its largest magnitude
(and at least sqrt(eps)), so no sum of squares overflows (rows near 1e20) or loses its terms to underflow
(rows near 1e-20); a power of two scales exactly, so for every other row the bits are those of the
unscaled formula. rstd is stored unscaled: it, and so the backward, stays a normal float32 number while
the row's rms (RMSNorm) or standard deviation (LayerNorm) is below ~1e37.
"""
import triton
import triton.language as tl

from .._random import dropout_keep


@triton.jit
def _welford_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    # Chan et al.'s parallel merge of (count, mean, sum of squared deviations); empty parts have n = 0.
    n = n_a + n_b
    w_b = n_b / tl.maximum(n, 1.0)
    delta = mean_b - mean_a
    return n, mean_a + delta * w_b, m2_a + m2_b + delta * delta * n_a * w_b


@triton.jit
def _row_mean_m2(h, mask, N_COLS: tl.constexpr, LOG2_CHUNKS: tl.constexpr):
    """Mean and sum of squared deviations of each row of h [BLOCK_M, NCHUNK, CHUNK], one pass over registers.

    Each of the NCHUNK parts of a row gets an exact (count, mean, M2) from two passes over registers; the
    parts are then merged pairwise by Welford/Chan in a tree, so no long sum of squares ever cancels
    catastrophically. Only the small [BLOCK_M, NCHUNK] statistics are reshaped, never the tile.
    """
    BLOCK_M: tl.constexpr = h.shape[0]
    NCHUNK: tl.constexpr = h.shape[1]
    CHUNK: tl.constexpr = h.shape[2]
    # Part sizes follow from N_COLS alone: no reduction (each costs shuffles and a barrier). A padding row
    # past n_rows is all zeros and its statistics are never stored.
    if N_COLS == NCHUNK * CHUNK:  # every part full; CHUNK is a power of two, so 1 / CHUNK is exact
        n = tl.full([BLOCK_M, NCHUNK], CHUNK, tl.float32)
        mean = tl.sum(h, axis=2) * (1.0 / CHUNK)
    else:
        part_cols = tl.minimum(tl.maximum(N_COLS - tl.arange(0, NCHUNK) * CHUNK, 0), CHUNK)
        n = tl.broadcast_to(part_cols.to(tl.float32)[None, :], (BLOCK_M, NCHUNK))
        # Triton's default division (div.full, 2 ulp), not IEEE div_rn: div_rn here made the forward ~10%
        # slower on the H200
        mean = tl.sum(h, axis=2) / tl.maximum(n, 1.0)
    dev = tl.where(mask, h - mean[:, :, None], 0.0)
    m2 = tl.sum(dev * dev, axis=2)
    for _ in tl.static_range(LOG2_CHUNKS):  # halve the number of parts each level
        n_a, n_b = tl.split(tl.reshape(n, (n.shape[0], n.shape[1] // 2, 2)))
        mean_a, mean_b = tl.split(tl.reshape(mean, (mean.shape[0], mean.shape[1] // 2, 2)))
        m2_a, m2_b = tl.split(tl.reshape(m2, (m2.shape[0], m2.shape[1] // 2, 2)))
        n, mean, m2 = _welford_merge(n_a, mean_a, m2_a, n_b, mean_b, m2_b)
    return tl.reshape(mean, (mean.shape[0],)), tl.reshape(m2, (m2.shape[0],))


@triton.jit
def _row_pow2_scale(amax, eps):
    """Per row, from its largest magnitude ``amax`` [BLOCK_M]: (s, 1 / s), s the power of two at or below
    max(amax, sqrt(eps)), so the scaled row has magnitudes below 2 and eps / s**2 is in [1 ... 4) or
    below. Built from the exponent bits, clamped to [2**-126, 2**126] so that both s and 1 / s are normal
    (a NaN or inf row gets 2**126 and stays non-finite)."""
    m = tl.maximum(amax, tl.sqrt(tl.zeros_like(amax) + eps))
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent, m >= 0
    e = tl.minimum(tl.maximum(e, 1), 253)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


# Runtime integers get no divisibility specialisation from their values (jax-triton gives none), so that
# torch and JAX compile the same kernels: see core_kernels/_plan.py.
@triton.jit(do_not_specialize_on_alignment=("n_rows",))
def norm_fwd_kernel(
    X, W, B, RES, POST_RES, SEED,  # inputs (unused ones are placeholders, see the HAS_* flags)
    n_rows, eps, dropout_p,  # runtime scalars
    Y, H, MEAN, RSTD,  # outputs (H / MEAN are placeholders when not HAS_RES / IS_RMS)
    N_COLS: tl.constexpr, BLOCK_M: tl.constexpr, LOG2_CHUNKS: tl.constexpr, CHUNK: tl.constexpr,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_POST_RES: tl.constexpr,
):
    # The tile is [BLOCK_M, NCHUNK, CHUNK]: rows, then each row cut into the NCHUNK parts whose statistics
    # LayerNorm merges. Loading it 3-D (instead of reshaping a 2-D tile) keeps the registers' layout.
    NCHUNK: tl.constexpr = 1 << LOG2_CHUNKS
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.arange(0, NCHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [NCHUNK, CHUNK]
    col_ok = cols < N_COLS
    mask = (rows < n_rows)[:, None, None] & col_ok[None, :, :]  # [BLOCK_M, NCHUNK, CHUNK]
    offs = rows[:, None, None].to(tl.int64) * N_COLS + cols[None, :, :]

    h = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
        # Normalise the rounded sum: it is what the backward reads back from H.
        h_out = h.to(H.dtype.element_ty)
        tl.store(H + offs, h_out, mask=mask)
        h = h_out.to(tl.float32)

    # Statistics of the row scaled by a power of two (exact): no overflow or underflow of the squares.
    if IS_RMS:
        amax = tl.max(tl.max(tl.abs(h), axis=2), axis=1)  # [BLOCK_M]
    else:
        # LayerNorm also needs to know a row of equal values: its variance is 0 exactly, but its float32
        # sums round (the mean misses the value by an ulp, which rstd = 1 / sqrt(eps) would amplify)
        hmax = tl.max(tl.max(tl.where(mask, h, -float("inf")), axis=2), axis=1)
        hmin = tl.min(tl.min(tl.where(mask, h, float("inf")), axis=2), axis=1)
        amax = tl.maximum(hmax, -hmin)
    scale, inv_scale = _row_pow2_scale(amax, eps)  # [BLOCK_M] each
    h = h * inv_scale[:, None, None]
    eps_scaled = eps * inv_scale * inv_scale  # eps * inv_scale first: inv_scale**2 alone may overflow
    if IS_RMS:
        # mean(h^2) of the scaled row is at least 1 / N_COLS: never 0
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(h * h, axis=2), axis=1) / N_COLS + eps_scaled)  # [BLOCK_M]
        z = h * rstd[:, None, None]
        rstd_out = rstd * inv_scale
    else:
        mean, m2 = _row_mean_m2(h, mask, N_COLS, LOG2_CHUNKS)  # [BLOCK_M] each
        constant = hmax == hmin
        mean = tl.where(constant, hmax * inv_scale, mean)
        var_eps = tl.where(constant, 0.0, m2 / N_COLS) + eps_scaled
        # Below 2**-126 only for a row of equal values far above sqrt(eps) (a non-constant scaled row has
        # variance >= 2**-64; eps_scaled underflowed): there every h - mean is 0 and rstd is 1 / sqrt(eps).
        ok = var_eps >= 1.1754943508222875e-38
        rstd = 1.0 / tl.sqrt(tl.maximum(var_eps, 1.1754943508222875e-38))
        z = (h - mean[:, None, None]) * tl.where(ok, rstd, 0.0)[:, None, None]
        tl.store(MEAN + rows, mean * scale, mask=rows < n_rows)
        rstd_out = tl.where(ok, rstd * inv_scale, 1.0 / tl.sqrt(tl.zeros_like(rstd) + eps))
    tl.store(RSTD + rows, rstd_out, mask=rows < n_rows)

    if HAS_W:
        z *= tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :, :]
    if HAS_B:
        z += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :, :]
    if HAS_DROPOUT:
        z = tl.where(dropout_keep(tl.load(SEED), offs, dropout_p), z / (1.0 - dropout_p), 0.0)
    if HAS_POST_RES:
        z += tl.load(POST_RES + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, z.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=("n_rows",))
def norm_bwd_kernel(
    DY, H, W, MEAN, RSTD, SEED, DH,  # inputs: DY = grad of y, H = the normalised input, DH = grad of h
    n_rows, dropout_p,  # runtime scalars
    DX, DW_PART, DB_PART,  # outputs: grad of h (= dx = dresidual), per-program partial sums
    N_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DH: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N_COLS
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    num_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None].to(tl.int64) * N_COLS + cols[None, :]

        h = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)  # grad of z
        if HAS_DROPOUT:
            g = tl.where(dropout_keep(tl.load(SEED), offs, dropout_p), g / (1.0 - dropout_p), 0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = h * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_B:
            db_acc += tl.sum(g, axis=0)
        if HAS_W:
            dw_acc += tl.sum(g * xhat, axis=0)
            g = g * w[None, :]  # grad of xhat
        # dh = rstd * (g - mean(g) - xhat * mean(g * xhat)), without the mean(g) term for RMSNorm
        if IS_RMS:
            c1 = tl.sum(g * xhat, axis=1) / N_COLS
            dh = (g - xhat * c1[:, None]) * rstd[:, None]
        elif N_COLS == 1:
            # LayerNorm of one element is the constant bias: dh is exactly 0. (The general formula cancels
            # g - mean(g) to 0 only if g is rounded first; fp fusion contracts g = dy * w into that
            # subtraction and leaves half an ulp, times rstd = 1/sqrt(eps) ~ 316.)
            dh = tl.zeros_like(g)
        else:
            # both row sums in one reduction: one exchange between warps instead of two
            s1, s2 = tl.split(tl.sum(tl.join(g * xhat, g), axis=1))
            c1 = s1 / N_COLS
            c2 = s2 / N_COLS
            dh = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DH:
            dh += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dh.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DW_PART + pid * N_COLS + cols, dw_acc, mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + pid * N_COLS + cols, db_acc, mask=col_ok)


@triton.jit
def sum_partials_kernel(
    PART,  # input: [n_parts, N_COLS] float32
    OUT,  # output: [N_COLS], summed over parts in a fixed order
    N_PARTS: tl.constexpr, N_COLS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_COLS
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N_PARTS, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < N_PARTS) & col_ok[None, :]
        acc += tl.sum(tl.load(PART + parts[:, None] * N_COLS + cols[None, :], mask=mask, other=0.0), axis=0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=col_ok)
