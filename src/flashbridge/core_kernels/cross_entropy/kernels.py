"""Fused cross-entropy kernels over the vocabulary (``@triton.jit`` only; launches in plan.py).

Per row ``i`` with logits ``x`` (``V`` columns), label ``y``, smoothing ``eps``, z-loss ``lam``, cap ``c``::

    z    = c * tanh(x / c)                         (HAS_SOFTCAP; else z = x)
    lse  = log(sum_j exp(z_j))
    loss = (1 - eps) * (lse - z_y) + eps * (lse - mean_j z_j) + lam * lse**2     (0 for ignored rows)
    dz_j = w_i * (p_j * (1 + 2 * lam * lse) - (1 - eps) * [j == y] - eps / V),  p_j = exp(z_j - lse)
    dx_j = dz_j * (1 - (z_j / c)**2)               (HAS_SOFTCAP)

A program owns ``BLOCK_N`` rows and walks the vocabulary in ``[BLOCK_N, BLOCK_V]`` tiles, whole tiles without
masks and a masked last tile (rows past ``n_rows`` re-read the last row and store nothing). The forward is
one read of the logits: an online softmax whose running maximum and sum are kept *per lane* (one exp per
element, no cross-lane reduction inside the loop), merged across lanes once at the end; the label's logit
is one scalar load. The gradient kernel is one read of the logits and one write of the gradient, given
the forward's lse and a per-row (or single) weight ``w`` (the upstream gradient, already divided by the
token count for a mean). A label outside ``[0, V)`` that is not ``ignore_index`` is never dereferenced: its
row gets a NaN loss and NaN gradients (the front-ends raise a ValueError before launching when the labels
can be inspected, see plan.py).
"""
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-3.4028234663852886e38)  # most negative float32: a lane that has seen nothing yet


@triton.jit
def _tanh_sech2(u):
    """(tanh(u), 1 - tanh(u)**2) without libdevice (the interpreter has none) and without cancellation:
    an odd Taylor series below |u| = 0.25; above, with t = exp(-2|u|), tanh = (1 - t) / (1 + t) and
    1 - tanh**2 = 4t / (1 + t)**2 (accurate even where tanh saturates)."""
    a = tl.abs(u)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    a2 = tl.minimum(a * a, 0.0625)  # the series is only used below 0.25; keep it finite elsewhere
    small = a * (1.0 + a2 * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (
        -0.05396825396825397 + a2 * (0.021869488536155203 + a2 * -0.008863235529902197)))))
    is_small = a < 0.25
    r = tl.where(is_small, small, big)
    one_plus_t = 1.0 + t
    sech2 = tl.where(is_small, 1.0 - small * small, 4.0 * t / (one_plus_t * one_plus_t))
    return tl.where(u < 0, -r, r), sech2


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        th, _ = _tanh_sech2(x / softcap)
        x = softcap * th
    return x


@triton.jit
def _fold(m, s, z):
    """Fold scores ``z`` into the per-lane online softmax: running max ``m`` and ``s = sum exp(z - m)``,
    with one exp per element (``exp(-|z - m|)``); lanes at -inf add 0."""
    m_new = tl.maximum(m, z, propagate_nan=tl.PropagateNan.ALL)
    e = tl.exp(tl.minimum(m, z) - m_new)
    return m_new, tl.where(z > m, s * e + 1.0, s + e)


@triton.jit
def _lse_update(m, s, zsum, x, softcap, HAS_SMOOTH: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Fold a whole logits tile ``x`` (as loaded) into (m, s) and the running sum of z (label smoothing)."""
    z = _capped(x.to(tl.float32), softcap, HAS_SOFTCAP)
    if HAS_SMOOTH:
        zsum += z
    m, s = _fold(m, s, z)
    return m, s, zsum


@triton.jit
def _lse_tile(m, s, zsum, row_base, start, softcap, V: tl.constexpr, BLOCK_V: tl.constexpr,
              HAS_SMOOTH: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """Fold the last, partial logits tile (column ``start`` to V) into (m, s, zsum); its missing lanes
    count as -inf."""
    cols = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    col_ok = (cols < V)[None, :]
    z = _capped(tl.load(row_base[:, None] + cols[None, :], mask=col_ok, other=0.0).to(tl.float32), softcap,
                HAS_SOFTCAP)
    if HAS_SMOOTH:
        zsum += tl.where(col_ok, z, 0.0)
    m, s = _fold(m, s, tl.where(col_ok, z, float("-inf")))
    return m, s, zsum


@triton.jit
def _grad_tile(LOGITS, GRAD, offs, start, row_ok, label, lse, lse_lo, coef, on_label, off_label, softcap,
               V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """Write the gradient of the logits tile at column ``start`` (one read, one write; each element is read
    before it is written, by the same program, so GRAD may be LOGITS). MASKED: the tile runs past V."""
    cols = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    ptrs = offs[:, None] + cols[None, :]
    if MASKED:
        x = tl.load(LOGITS + ptrs, mask=(cols < V)[None, :], other=0.0).to(tl.float32)
    else:
        x = tl.load(LOGITS + ptrs).to(tl.float32)
    if HAS_SOFTCAP:
        th, sech2 = _tanh_sech2(x / softcap)
        z = softcap * th
    else:
        z = x
    p = tl.exp((z - lse[:, None]) - lse_lo[:, None])
    g = coef[:, None] * p - off_label[:, None]
    g = tl.where(cols[None, :] == label[:, None], g - on_label[:, None], g)
    if HAS_SOFTCAP:
        g = g * sech2
    if MASKED:
        tl.store(GRAD + ptrs, g.to(GRAD.dtype.element_ty), mask=row_ok[:, None] & (cols < V)[None, :])
    else:
        tl.store(GRAD + ptrs, g.to(GRAD.dtype.element_ty), mask=row_ok[:, None])


# Runtime integers get no divisibility specialisation from their values (jax-triton gives none), so that
# torch and JAX compile the same kernels: see core_kernels/_plan.py.
@triton.jit(do_not_specialize_on_alignment=("n_rows", "ignore_index"))
def ce_fwd_kernel(
    LOGITS, LABELS,  # inputs: [n_rows, V] any float dtype, [n_rows] int32/int64
    n_rows, ignore_index, label_smoothing, z_loss, softcap,  # runtime scalars
    LOSS, LSE, LSE_LO,  # outputs: float32 [n_rows] each; lse + lse_lo is the lse to ~2x float32 precision
    V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < n_rows
    # padding rows (past n_rows) re-read the last row: loads need no row mask; their results are not stored
    row_base = LOGITS + tl.minimum(rows, n_rows - 1).to(tl.int64) * V  # [BLOCK_N] pointers
    m = tl.full([BLOCK_N, BLOCK_V], _NEG_BIG, tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)  # per-lane sum of exp(z - m)
    zsum = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    V_FULL: tl.constexpr = V // BLOCK_V * BLOCK_V
    if V_FULL > 0:
        # whole tiles, no masks; each iteration issues the next tile's load before folding the current one,
        # so a tile's bytes are in flight while the previous one is computed (the loop is otherwise
        # latency-bound: one row pair per program, Triton does not pipeline plain loads). The last
        # iteration re-reads the last tile (an L2 hit) instead of branching.
        cols = tl.arange(0, BLOCK_V)[None, :]
        x_next = tl.load(row_base[:, None] + cols)
        for start in range(0, V_FULL, BLOCK_V):
            x = x_next
            x_next = tl.load(row_base[:, None] + (tl.minimum(start + BLOCK_V, V_FULL - BLOCK_V) + cols))
            m, s, zsum = _lse_update(m, s, zsum, x, softcap, HAS_SMOOTH, HAS_SOFTCAP)
    if V_FULL < V:
        m, s, zsum = _lse_tile(m, s, zsum, row_base, V_FULL, softcap, V, BLOCK_V, HAS_SMOOTH, HAS_SOFTCAP)
    m_row = tl.max(m, axis=1)  # [BLOCK_N]
    s_row = tl.sum(s * tl.exp(m - m_row[:, None]), axis=1)
    log_s = tl.log(tl.where(row_ok, s_row, 1.0))
    m_row = tl.where(row_ok, m_row, 0.0)  # rows past n_rows: 0
    # TwoSum: lse + lse_lo == m_row + log_s exactly. The gradient uses exp((z - lse) - lse_lo), accurate
    # where one logit dominates and |lse| is large (the rounding of lse alone would cost ulp(lse) there).
    lse = m_row + log_s
    bb = lse - m_row
    lse_lo = (m_row - (lse - bb)) + (log_s - bb)

    label = tl.load(LABELS + rows, mask=row_ok, other=ignore_index)
    active = label != ignore_index
    bad = active & ((label < 0) | (label >= V))
    x_y = tl.load(row_base + label, mask=row_ok & active & (label >= 0) & (label < V), other=0.0).to(tl.float32)
    loss = lse - _capped(x_y, softcap, HAS_SOFTCAP)
    if HAS_SMOOTH:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - tl.sum(zsum, axis=1) / V)
    if HAS_ZLOSS:
        loss += z_loss * lse * lse
    loss = tl.where(active, loss, 0.0)
    loss = tl.where(bad, float("nan"), loss)
    tl.store(LOSS + rows, loss, mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(LSE_LO + rows, lse_lo, mask=row_ok)


@triton.jit(do_not_specialize_on_alignment=("n_rows", "ignore_index"))
def ce_grad_kernel(
    LOGITS, LABELS, LSE, LSE_LO, WEIGHT,  # [n_rows, V], [n_rows], f32 [n_rows] x2, f32 [n_rows] or [1]
    n_rows, ignore_index, label_smoothing, z_loss, softcap,  # runtime scalars
    GRAD,  # output: [n_rows, V], the gradient of sum_i w_i * loss_i with respect to the logits
    V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PER_ROW_WEIGHT: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < n_rows
    # padding rows (past n_rows) read the last row and store nothing: tile loads need no row mask
    offs = tl.minimum(rows, n_rows - 1).to(tl.int64) * V  # [BLOCK_N]
    label = tl.load(LABELS + rows, mask=row_ok, other=ignore_index)
    active = label != ignore_index
    bad = active & ((label < 0) | (label >= V))
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    lse_lo = tl.load(LSE_LO + rows, mask=row_ok, other=0.0)
    if PER_ROW_WEIGHT:
        w = tl.load(WEIGHT + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_N], dtype=tl.float32) + tl.load(WEIGHT).to(tl.float32)
    w = tl.where(active, w, 0.0)
    w = tl.where(bad, float("nan"), w)
    coef = w
    if HAS_ZLOSS:
        coef = w * (1.0 + 2.0 * z_loss * lse)
    on_label = w
    off_label = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_SMOOTH:
        on_label = w * (1.0 - label_smoothing)
        off_label = w * (label_smoothing / V)
    V_FULL: tl.constexpr = V // BLOCK_V * BLOCK_V
    for start in range(0, V_FULL, BLOCK_V):  # whole tiles: only the (uniform) row predicate on the stores
        _grad_tile(LOGITS, GRAD, offs, start, row_ok, label, lse, lse_lo, coef, on_label, off_label, softcap,
                   V, BLOCK_V, HAS_SOFTCAP, False)
    if V_FULL < V:
        _grad_tile(LOGITS, GRAD, offs, V_FULL, row_ok, label, lse, lse_lo, coef, on_label, off_label, softcap,
                   V, BLOCK_V, HAS_SOFTCAP, True)
