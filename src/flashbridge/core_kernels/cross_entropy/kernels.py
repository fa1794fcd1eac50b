"""Fused cross-entropy kernels over the vocabulary (``@triton.jit`` only; launches in plan.py).

Per row ``i`` with logits ``x`` (``V`` columns), label ``y``, smoothing ``eps``, z-loss ``lam``, cap ``c`` and
class weights ``cw`` (all 1 unless HAS_CLASS_WEIGHT; ``W = sum_j cw_j``)::

    z    = c * tanh(x / c)                         (HAS_SOFTCAP; else z = x)
    lse  = log(sum_j exp(z_j))
    ce   = (1 - eps) * cw_y * (lse - z_y) + eps / V * sum_j cw_j * (lse - z_j)      (0 for ignored rows)
    loss = ce + lam * lse**2             (the z-loss term is a separate output with class weights)
    dz_j = g_i * (((1 - eps) * cw_y + eps * W / V) * p_j - (1 - eps) * cw_y * [j == y] - eps / V * cw_j)
           + h_i * 2 * lam * lse * p_j,  p_j = exp(z_j - lse)
    dx_j = dz_j * (1 - (z_j / c)**2)               (HAS_SOFTCAP)

``g`` and ``h`` are the upstream gradients of the ce and z-loss terms (the same array without class weights,
where a mean divides both by the token count; with them a mean divides ce by the sum of ``cw_y``, the
z-loss by the token count). HAS_ARGMAX: the forward also writes each row's argmax of ``x`` (ties to the
lowest index).

A program owns ``BLOCK_N`` rows and walks the vocabulary in ``[BLOCK_N, BLOCK_V]`` tiles, whole tiles without
masks and a masked last tile (rows past ``n_rows`` re-read the last row and store nothing). The forward is
one read of the logits: an online softmax whose running maximum and sum are kept *per lane*, a lane being
the 16 bytes one thread loads at once (tiles are ``[BLOCK_N, lanes, CHUNK]``: a tile's max and sum per lane
are in-thread reductions, one exp per element, no cross-thread reduction inside the loop), merged across
lanes once at the end; the loss is ``(m - z_y) + log s`` (no cancellation against lse); the label's logit
is one scalar load. The gradient kernel is one read of the logits and one write of the gradient, given
the forward's lse and a per-row (or single) weight ``w`` (the upstream gradient, already divided by the
token count for a mean). A label outside ``[0, V)`` that is not ``ignore_index`` is never dereferenced: its
row gets a NaN loss and NaN gradients (the front-ends raise a ValueError before launching when the labels
can be inspected, see plan.py).

Class weights and the argmax are compile-time options of the same bodies (``_ce_fwd_rows``,
``_ce_grad_rows``); the kernels without them (``ce_fwd_kernel``, ``ce_grad_kernel``) take no extra
arguments, so they compile to the code they had before the options existed. With class weights the
vocabulary loop reads the weights' tile beside the logits' only for label smoothing (``sum_j cw_j z_j``);
otherwise they cost one gather per row (``cw_y``).
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
def _exp(x):
    """exp(x) as ``exp2(x * log2 e)``: Triton lowers ``tl.exp2`` to one ``ex2.approx.ftz`` per element, but
    ``tl.exp`` to ``ex2.approx`` without ftz, which ptxas expands to five instructions (a range test, a
    scale before and a squaring after, for results below 2^-126); flushing those to 0 cannot change a
    softmax sum whose largest term is 1."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def _fold(m, s, z):
    """Fold a tile of scores ``z`` [N, C, CHUNK] into the online softmax of each chunk lane: running max
    ``m`` and ``s = sum exp(z - m)``, both [N, C]. The CHUNK elements of a lane are the ones a thread loads
    with one vector load, so the tile's max and sum per lane are in-thread reductions (no shuffles), and
    each element costs a max, a subtraction, an exp and an add (half of what a state per element costs);
    the rescale is per lane. A NaN score makes its row's sum NaN (the exp
    of NaN); lanes that have only seen -inf stay at (_NEG_BIG, 0); scores at float32's lowest (a common
    mask value) count as exp(0) against a lane still at _NEG_BIG, as they must when the whole row is masked."""
    m_new = tl.maximum(m, tl.max(z, axis=2))
    # the rescale's argument clamped: a lane still at _NEG_BIG would overflow x * log2 e to -inf (the
    # same 0, but the interpreter warns on every launch); exp(-200) is 0 in float32 either way
    return m_new, s * _exp(tl.maximum(m - m_new, -200.0)) + tl.sum(_exp(z - m_new[:, :, None]), axis=2)


@triton.jit
def _lse_update(m, s, zsum, x, cw, softcap, HAS_SMOOTH: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_CLASS_WEIGHT: tl.constexpr):
    """Fold a whole logits tile ``x`` [N, C, CHUNK] (as loaded) into (m, s) and the per-lane sum of z
    (label smoothing), weighted by the class weights' tile ``cw`` [1, C, CHUNK] with HAS_CLASS_WEIGHT."""
    z = _capped(x.to(tl.float32), softcap, HAS_SOFTCAP)
    if HAS_SMOOTH:
        if HAS_CLASS_WEIGHT:
            zsum += tl.sum(z * cw, axis=2)
        else:
            zsum += tl.sum(z, axis=2)
    m, s = _fold(m, s, z)
    return m, s, zsum


@triton.jit
def _lse_tile(m, s, zsum, row_base, start, softcap, CLASS_WEIGHT, V: tl.constexpr, C: tl.constexpr,
              CHUNK: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
              HAS_CLASS_WEIGHT: tl.constexpr):
    """Fold the last, partial logits tile (column ``start`` to V) into (m, s, zsum); its missing lanes
    count as -inf."""
    cols = start + _tile_cols(C, CHUNK)  # [1, C, CHUNK]
    col_ok = cols < V
    z = _capped(tl.load(row_base[:, None, None] + cols, mask=col_ok, other=0.0).to(tl.float32), softcap,
                HAS_SOFTCAP)
    if HAS_SMOOTH:
        if HAS_CLASS_WEIGHT:
            z_w = z * tl.load(CLASS_WEIGHT + cols, mask=col_ok, other=0.0).to(tl.float32)
        else:
            z_w = z
        zsum += tl.sum(tl.where(col_ok, z_w, 0.0), axis=2)
    m, s = _fold(m, s, tl.where(col_ok, z, float("-inf")))
    return m, s, zsum


@triton.jit
def _argmax_fold(am, ai, x, start, C: tl.constexpr, CHUNK: tl.constexpr):
    """Fold a logits tile ``x`` [N, C, CHUNK] (float32; -inf past V) into each lane's running maximum ``am``
    and its column ``ai`` [N, C]. Lanes see their columns in increasing order and only a strictly larger
    value moves ``ai``, and the tile's argmax takes the lowest index of a tie: each lane keeps the first
    column of its maximum."""
    tile_max, tile_arg = tl.max(x, axis=2, return_indices=True, return_indices_tie_break_left=True)
    better = tile_max > am
    lane_col = start + tl.arange(0, C)[None, :] * CHUNK  # [1, C]: a lane's first column in this tile
    return tl.where(better, tile_max, am), tl.where(better, lane_col + tile_arg, ai)


@triton.jit
def _tile_cols(C: tl.constexpr, CHUNK: tl.constexpr):
    """Column offsets [1, C, CHUNK] of a BLOCK_V = C * CHUNK tile: lane c holds columns c*CHUNK .. +CHUNK-1."""
    return (tl.arange(0, C)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :])[None, :, :]


@triton.jit
def _grad_tile(LOGITS, GRAD, offs, start, row_ok, label, lse, lse_lo, coef, on_label, off_label, softcap, CW,
               V: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, MASKED: tl.constexpr,
               WEIGHTED_SMOOTH: tl.constexpr):
    """Write the gradient of the logits tile at column ``start`` (one read, one write; each element is read
    before it is written, by the same program, so GRAD may be LOGITS). MASKED: the tile runs past V.
    WEIGHTED_SMOOTH: the smoothing term is ``off_label * cw_j``, ``CW`` the class weights of these columns."""
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
    p = _exp((z - lse[:, None]) - lse_lo[:, None])  # exp2 with ftz: see _exp
    if WEIGHTED_SMOOTH:
        if MASKED:
            cw = tl.load(CW + cols, mask=cols < V, other=0.0).to(tl.float32)
        else:
            cw = tl.load(CW + cols).to(tl.float32)
        g = coef[:, None] * p - off_label[:, None] * cw[None, :]
    else:
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
@triton.jit
def _ce_fwd_rows(
    LOGITS, LABELS, CLASS_WEIGHT, WEIGHT_SUM, n_rows, ignore_index, label_smoothing, z_loss, softcap,
    LOSS, LSE, LSE_LO, ZLOSS, PREDICTED, V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr, HAS_ARGMAX: tl.constexpr,
):
    """The forward of one row block (the kernels' arguments are documented at :func:`ce_fwd_ext_kernel`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < n_rows
    # padding rows (past n_rows) re-read the last row: loads need no row mask; their results are not stored
    row_base = LOGITS + tl.minimum(rows, n_rows - 1).to(tl.int64) * V  # [BLOCK_N] pointers
    # A tile is [BLOCK_N, C, CHUNK]: CHUNK = one 16-byte vector of the logits' dtype (a thread's load), so
    # the per-lane softmax state is [BLOCK_N, C] and its per-tile updates need no cross-thread reduction.
    CHUNK: tl.constexpr = min(BLOCK_V, 128 // LOGITS.dtype.element_ty.primitive_bitwidth)
    C: tl.constexpr = BLOCK_V // CHUNK
    # the class weights' tile is needed in the loop only for the smoothing term sum_j cw_j z_j
    SMOOTH_CW: tl.constexpr = HAS_SMOOTH and HAS_CLASS_WEIGHT
    m = tl.full([BLOCK_N, C], _NEG_BIG, tl.float32)  # per-lane running max
    s = tl.zeros([BLOCK_N, C], dtype=tl.float32)  # per-lane sum of exp(z - m)
    zsum = tl.zeros([BLOCK_N, C], dtype=tl.float32)  # per-lane sum of z (of cw * z with class weights)
    if HAS_ARGMAX:
        am = tl.full([BLOCK_N, C], float("-inf"), tl.float32)  # per-lane max of x and its column
        ai = tl.zeros([BLOCK_N, C], dtype=tl.int32)
    V_FULL: tl.constexpr = V // BLOCK_V * BLOCK_V
    if V_FULL > 0:
        # whole tiles, no masks; each iteration issues the next tile's load before folding the current one,
        # so a tile's bytes are in flight while the previous one is computed (Triton does not pipeline
        # plain loads). The last iteration re-reads the last tile (an L2 hit) instead of branching.
        tile = row_base[:, None, None] + _tile_cols(C, CHUNK)  # [BLOCK_N, C, CHUNK] pointers
        x_next = tl.load(tile)
        if SMOOTH_CW:  # the class weights' tile travels one step ahead too (an L2 read)
            cw_tile = CLASS_WEIGHT + _tile_cols(C, CHUNK)  # [1, C, CHUNK] pointers
            cw_next = tl.load(cw_tile)
        for start in range(0, V_FULL, BLOCK_V):
            x = x_next
            x_next = tl.load(tile + tl.minimum(start + BLOCK_V, V_FULL - BLOCK_V))
            if SMOOTH_CW:
                cw = cw_next.to(tl.float32)
                cw_next = tl.load(cw_tile + tl.minimum(start + BLOCK_V, V_FULL - BLOCK_V))
            else:
                cw = x  # never read
            m, s, zsum = _lse_update(m, s, zsum, x, cw, softcap, HAS_SMOOTH, HAS_SOFTCAP, SMOOTH_CW)
            if HAS_ARGMAX:
                am, ai = _argmax_fold(am, ai, x.to(tl.float32), start, C, CHUNK)
    if V_FULL < V:
        m, s, zsum = _lse_tile(m, s, zsum, row_base, V_FULL, softcap, CLASS_WEIGHT, V, C, CHUNK, HAS_SMOOTH,
                               HAS_SOFTCAP, SMOOTH_CW)
        if HAS_ARGMAX:
            cols = V_FULL + _tile_cols(C, CHUNK)
            x = tl.load(row_base[:, None, None] + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            am, ai = _argmax_fold(am, ai, x, V_FULL, C, CHUNK)
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
    # (m - z_y) + log s rather than lse - z_y: no cancellation when the logits' magnitude dwarfs log V (a row
    # masked with float32's lowest value has loss log V, as log_softmax gives)
    loss = (m_row - _capped(x_y, softcap, HAS_SOFTCAP)) + log_s
    if HAS_CLASS_WEIGHT:
        cw_y = tl.load(CLASS_WEIGHT + label, mask=row_ok & active & (label >= 0) & (label < V), other=0.0)
        loss = loss * cw_y.to(tl.float32)
    if HAS_SMOOTH:
        if HAS_CLASS_WEIGHT:  # eps / V * sum_j cw_j * (lse - z_j)
            w_sum = tl.load(WEIGHT_SUM).to(tl.float32)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (
                ((w_sum * m_row - tl.sum(zsum, axis=1)) + w_sum * log_s) / V)
        else:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * ((m_row - tl.sum(zsum, axis=1) / V) + log_s)
    if HAS_ZLOSS:
        if HAS_CLASS_WEIGHT:  # a separate output: a mean divides it by the token count, not the weights
            z_term = tl.where(active, z_loss * lse * lse, 0.0)
            tl.store(ZLOSS + rows, tl.where(bad, float("nan"), z_term), mask=row_ok)
        else:
            loss += z_loss * lse * lse
    loss = tl.where(active, loss, 0.0)
    loss = tl.where(bad, float("nan"), loss)
    tl.store(LOSS + rows, loss, mask=row_ok)
    tl.store(LSE + rows, lse, mask=row_ok)
    tl.store(LSE_LO + rows, lse_lo, mask=row_ok)
    if HAS_ARGMAX:
        am_row = tl.max(am, axis=1)
        # the lowest column among the lanes that hold the row's maximum (V when none does: a NaN row)
        pred = tl.min(tl.where(am == am_row[:, None], ai, V), axis=1)
        tl.store(PREDICTED + rows, pred.to(PREDICTED.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize_on_alignment=("n_rows", "ignore_index"))
def ce_fwd_kernel(
    LOGITS, LABELS,  # inputs: [n_rows, V] any float dtype, [n_rows] int32/int64
    n_rows, ignore_index, label_smoothing, z_loss, softcap,  # runtime scalars
    LOSS, LSE, LSE_LO,  # outputs: float32 [n_rows] each; lse + lse_lo is the lse to ~2x float32 precision
    V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    _ce_fwd_rows(LOGITS, LABELS, LOGITS, LOGITS, n_rows, ignore_index, label_smoothing, z_loss, softcap,
                 LOSS, LSE, LSE_LO, LOSS, LOSS, V, BLOCK_N, BLOCK_V, HAS_SMOOTH, HAS_ZLOSS, HAS_SOFTCAP,
                 False, False)


@triton.jit(do_not_specialize_on_alignment=("n_rows", "ignore_index"))
def ce_fwd_ext_kernel(
    LOGITS, LABELS, CLASS_WEIGHT, WEIGHT_SUM,  # inputs: as ce_fwd_kernel; class weights [V], their sum [1]
    n_rows, ignore_index, label_smoothing, z_loss, softcap,  # runtime scalars
    LOSS, LSE, LSE_LO, ZLOSS, PREDICTED,  # outputs: as ce_fwd_kernel; z-loss terms, argmax [n_rows]
    V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr, HAS_ARGMAX: tl.constexpr,
):
    """``ce_fwd_kernel`` with class weights and / or the argmax. HAS_CLASS_WEIGHT: LOSS holds the
    class-weighted ce terms and ZLOSS the z-loss terms (HAS_ZLOSS). HAS_ARGMAX: PREDICTED holds each row's
    argmax of the logits (every row, ignored ones too). Tensors of an option that is off are never
    touched (the plan passes placeholders)."""
    _ce_fwd_rows(LOGITS, LABELS, CLASS_WEIGHT, WEIGHT_SUM, n_rows, ignore_index, label_smoothing, z_loss, softcap,
                 LOSS, LSE, LSE_LO, ZLOSS, PREDICTED, V, BLOCK_N, BLOCK_V, HAS_SMOOTH, HAS_ZLOSS, HAS_SOFTCAP,
                 HAS_CLASS_WEIGHT, HAS_ARGMAX)


@triton.jit
def _ce_grad_rows(
    LOGITS, LABELS, LSE, LSE_LO, WEIGHT, Z_WEIGHT, CLASS_WEIGHT, WEIGHT_SUM,
    n_rows, ignore_index, label_smoothing, z_loss, softcap, col0, GRAD,
    V: tl.constexpr, V_ALL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    PER_ROW_WEIGHT: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_CLASS_WEIGHT: tl.constexpr, COL0_ALIGN: tl.constexpr,
):
    """The gradient of one row block (the kernels' arguments are documented at :func:`ce_grad_kernel` and
    :func:`ce_grad_weighted_kernel`)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < n_rows
    # padding rows (past n_rows) read the last row and store nothing: tile loads need no row mask
    offs = tl.minimum(rows, n_rows - 1).to(tl.int64) * V  # [BLOCK_N]
    label = tl.load(LABELS + rows, mask=row_ok, other=ignore_index)
    active = label != ignore_index
    bad = active & ((label < 0) | (label >= V_ALL))
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0)
    lse_lo = tl.load(LSE_LO + rows, mask=row_ok, other=0.0)
    if PER_ROW_WEIGHT:
        w = tl.load(WEIGHT + rows, mask=row_ok, other=0.0).to(tl.float32)
    else:
        w = tl.zeros([BLOCK_N], dtype=tl.float32) + tl.load(WEIGHT).to(tl.float32)
    w = tl.where(active, w, 0.0)
    w = tl.where(bad, float("nan"), w)
    if HAS_CLASS_WEIGHT:
        # coef = g * ((1 - eps) cw_y + eps W / V) + h * 2 lam lse; on_label = g (1 - eps) cw_y; off_label * cw_j
        cw_y = tl.load(CLASS_WEIGHT + label, mask=row_ok & active & (label >= 0) & (label < V_ALL), other=0.0)
        on_label = w * cw_y.to(tl.float32)
        coef = on_label
        off_label = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_SMOOTH:
            on_label = on_label * (1.0 - label_smoothing)
            off_label = w * (label_smoothing / V_ALL)
            coef = on_label + off_label * tl.load(WEIGHT_SUM).to(tl.float32)
        if HAS_ZLOSS:
            if PER_ROW_WEIGHT:
                h = tl.load(Z_WEIGHT + rows, mask=row_ok, other=0.0).to(tl.float32)
            else:
                h = tl.zeros([BLOCK_N], dtype=tl.float32) + tl.load(Z_WEIGHT).to(tl.float32)
            h = tl.where(active, h, 0.0)
            coef += tl.where(bad, float("nan"), h) * (2.0 * z_loss * lse)
        # the class weights of this slice's columns. A runtime integer carries no divisibility, and without
        # it their loads are 4 bytes wide; the plan states col0's (tl.multiple_of on a scalar did not reach
        # the loads on Triton 3.9), the arithmetic hands it to the compiler and changes no value.
        cw_slice = CLASS_WEIGHT + col0 // COL0_ALIGN * COL0_ALIGN
    else:
        coef = w
        if HAS_ZLOSS:
            coef = w * (1.0 + 2.0 * z_loss * lse)
        on_label = w
        off_label = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_SMOOTH:
            on_label = w * (1.0 - label_smoothing)
            off_label = w * (label_smoothing / V_ALL)
        cw_slice = LOGITS  # never read
    WEIGHTED_SMOOTH: tl.constexpr = HAS_CLASS_WEIGHT and HAS_SMOOTH
    label = label - col0  # the label's column in this slice (outside [0, V): not in the slice)
    V_FULL: tl.constexpr = V // BLOCK_V * BLOCK_V
    for start in range(0, V_FULL, BLOCK_V):  # whole tiles: only the (uniform) row predicate on the stores
        _grad_tile(LOGITS, GRAD, offs, start, row_ok, label, lse, lse_lo, coef, on_label, off_label, softcap,
                   cw_slice, V, BLOCK_V, HAS_SOFTCAP, False, WEIGHTED_SMOOTH)
    if V_FULL < V:
        _grad_tile(LOGITS, GRAD, offs, V_FULL, row_ok, label, lse, lse_lo, coef, on_label, off_label, softcap,
                   cw_slice, V, BLOCK_V, HAS_SOFTCAP, True, WEIGHTED_SMOOTH)


@triton.jit(do_not_specialize_on_alignment=("n_rows", "ignore_index", "col0"))
def ce_grad_kernel(
    LOGITS, LABELS, LSE, LSE_LO, WEIGHT,  # [n_rows, V], [n_rows], f32 [n_rows] x2, f32 [n_rows] or [1]
    n_rows, ignore_index, label_smoothing, z_loss, softcap, col0,  # runtime scalars
    GRAD,  # output: [n_rows, V], the gradient of sum_i w_i * loss_i with respect to the logits
    V: tl.constexpr, V_ALL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    PER_ROW_WEIGHT: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """LOGITS may be a slice of the vocabulary: columns ``col0 .. col0 + V`` of ``V_ALL`` (the lse and the
    labels are the whole rows'; a label outside the slice adds no one-hot term here)."""
    _ce_grad_rows(LOGITS, LABELS, LSE, LSE_LO, WEIGHT, WEIGHT, LOGITS, LOGITS, n_rows, ignore_index,
                  label_smoothing, z_loss, softcap, col0, GRAD, V, V_ALL, BLOCK_N, BLOCK_V, PER_ROW_WEIGHT,
                  HAS_SMOOTH, HAS_ZLOSS, HAS_SOFTCAP, False, 1)


@triton.jit(do_not_specialize_on_alignment=("n_rows", "ignore_index", "col0"))
def ce_grad_weighted_kernel(
    LOGITS, LABELS, LSE, LSE_LO, WEIGHT, Z_WEIGHT, CLASS_WEIGHT, WEIGHT_SUM,  # as ce_grad_kernel, then: f32
    # [n_rows] or [1] (as WEIGHT) upstream of the z-loss terms; class weights [V_ALL] and their sum [1]
    n_rows, ignore_index, label_smoothing, z_loss, softcap, col0,  # runtime scalars
    GRAD,  # output: the gradient of sum_i (w_i * ce_i + z_weight_i * lam * lse_i**2)
    V: tl.constexpr, V_ALL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    PER_ROW_WEIGHT: tl.constexpr, HAS_SMOOTH: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    COL0_ALIGN: tl.constexpr,
):
    """``ce_grad_kernel`` with class weights: the ce and z-loss terms have upstream gradients of their own
    (a mean divides them by different sums). Z_WEIGHT is never read without HAS_ZLOSS. COL0_ALIGN: a power
    of two dividing col0."""
    _ce_grad_rows(LOGITS, LABELS, LSE, LSE_LO, WEIGHT, Z_WEIGHT, CLASS_WEIGHT, WEIGHT_SUM, n_rows, ignore_index,
                  label_smoothing, z_loss, softcap, col0, GRAD, V, V_ALL, BLOCK_N, BLOCK_V, PER_ROW_WEIGHT,
                  HAS_SMOOTH, HAS_ZLOSS, HAS_SOFTCAP, True, COL0_ALIGN)


@triton.jit(do_not_specialize_on_alignment=("n", "ignore_index"))
def ce_class_weight_sum_kernel(
    CLASS_WEIGHT, LABELS,  # inputs: class weights [V] (any float dtype; HAS_CLASS_WEIGHT); [n] int32/int64 (OF_LABELS)
    n, ignore_index,  # runtime scalars: the number of weights (V) or of labels
    OUT,  # output: float32 [1] (the sum of the class weights) or, OF_LABELS, [2] (a mean's two scales)
    V: tl.constexpr, BLOCK: tl.constexpr, OF_LABELS: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr,
):
    """One program, a fixed order (a [BLOCK] float32 accumulator, then one tree sum), so that both
    front-ends get the same bits. Without OF_LABELS: the sum of the class weights. OF_LABELS: the
    reciprocals of a mean's divisors, ``OUT = [1 / W, 1 / count]``: ``count`` the labels that are not
    ignore_index, ``W`` the sum of their class weights (those in ``[0, V)``; ``count`` without
    HAS_CLASS_WEIGHT), each divisor 1 when no label counts. The division is IEEE (``div_rn``): the
    front-ends multiply by these (XLA's float32 division on NVIDIA GPUs is approximate, torch's is not, and
    a multiply is exact-rounded in both, in the forward and in autograd's backward)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        if OF_LABELS:
            label = tl.load(LABELS + idx, mask=idx < n, other=ignore_index)
            counted = label != ignore_index
            count += counted.to(tl.int32)
            if HAS_CLASS_WEIGHT:
                ok = counted & (label >= 0) & (label < V)
                acc += tl.load(CLASS_WEIGHT + label, mask=ok, other=0.0).to(tl.float32)
        else:
            acc += tl.load(CLASS_WEIGHT + idx, mask=idx < n, other=0.0).to(tl.float32)
    if OF_LABELS:
        n_counted = tl.sum(count, axis=0)
        n_f = tl.where(n_counted > 0, n_counted.to(tl.float32), 1.0)
        w_total = n_f
        if HAS_CLASS_WEIGHT:
            w_total = tl.where(n_counted > 0, tl.sum(acc, axis=0), 1.0)
        tl.store(OUT, tl.div_rn(1.0, w_total))
        tl.store(OUT + 1, tl.div_rn(1.0, n_f))
    else:
        tl.store(OUT, tl.sum(acc, axis=0))


@triton.jit(do_not_specialize_on_alignment=("n",))
def ce_total_kernel(
    LOSS, ZLOSS, SCALES,  # inputs: float32 [n] each (ZLOSS: HAS_Z), float32 [2] (HAS_SCALES)
    n,  # runtime scalar: the number of rows
    TOTAL,  # output: float32 [1]
    BLOCK: tl.constexpr, HAS_Z: tl.constexpr, HAS_SCALES: tl.constexpr,
):
    """One program: a loss's reduction over its rows, ``sum(LOSS) * SCALES[0] + sum(ZLOSS) * SCALES[1]``
    (a mean's reciprocals, see :func:`ce_class_weight_sum_kernel`; 1 without HAS_SCALES: a sum). A fixed
    order ([BLOCK] float32 lanes, then one tree sum), so that both front-ends get the same bits: their own
    reductions sum in different orders. The gradient needs no kernel: ``g * SCALES[0]`` for every row."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    z_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        idx = start + offs
        acc += tl.load(LOSS + idx, mask=idx < n, other=0.0)
        if HAS_Z:
            z_acc += tl.load(ZLOSS + idx, mask=idx < n, other=0.0)
    total = tl.sum(acc, axis=0)
    if HAS_SCALES:
        total = total * tl.load(SCALES)
    if HAS_Z:
        z_total = tl.sum(z_acc, axis=0)
        if HAS_SCALES:
            z_total = z_total * tl.load(SCALES + 1)
        total = total + z_total
    tl.store(TOTAL, total)


# ------------------------------------------------------------------------------------------------ logits

@triton.jit(do_not_specialize_on_alignment=("n_rows",))
def linear_logits_kernel(
    HIDDEN, WEIGHT, BIAS, BUFFER,  # inputs (BUFFER: the storage OUT takes over; never read)
    n_rows,  # runtime scalar
    OUT,  # output: logits (n_rows, V) row-major at the start of the buffer, in the hidden dtype
    V: tl.constexpr, HD: tl.constexpr, W_TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``logits = hidden @ W^T (+ bias)`` written into storage the caller owns: the JAX linear op places a
    chunk's logits in dW's not yet written storage, as the torch op does with ``torch.mm(out=...)``, which
    XLA's own matmul cannot do (its result is a buffer of its own). W is ``(V, HD)`` or, W_TRANSPOSED, a
    ``(HD, V)`` kernel; hidden is ``(n_rows, HD)``, both contiguous. The sizes are compile-time constants
    (a model's), so the compiler sees every row's alignment: 16-byte loads into the pipelined shared-memory
    stages of the K loop. fp32 accumulation, one rounding to the output dtype. Programs walk ``GROUP_M``
    row blocks per column block, so a column block of W is read from L2 by several programs in a row."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(n_rows, BLOCK_M)
    blocks_n: tl.constexpr = (V + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * blocks_n
    first_m = pid // per_group * GROUP_M
    size_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past the end read row 0 (always there) and are never stored; columns past V are masked (a
    # clamp would hide their contiguity from the compiler where they are W's contiguous axis)
    rows = tl.where(offs_m < n_rows, offs_m, 0).to(tl.int64)
    col_ok = offs_n < V
    a_ptrs = HIDDEN + rows[:, None] * HD + offs_k[None, :]  # [M, K]
    if W_TRANSPOSED:
        b_ptrs = WEIGHT + offs_k[:, None].to(tl.int64) * V + offs_n[None, :]  # [K, N]
    else:
        b_ptrs = WEIGHT + offs_n[None, :].to(tl.int64) * HD + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HD, BLOCK_K):
        if HD % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = k0 + offs_k < HD
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * V if W_TRANSPOSED else BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = OUT + offs_m.to(tl.int64)[:, None] * V + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=(offs_m < n_rows)[:, None] & col_ok[None, :])
