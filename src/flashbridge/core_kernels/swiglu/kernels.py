"""SwiGLU kernels, forward and backward (``@triton.jit`` only; launches in plan.py).

    y = silu(g) * u,   silu(g) = g * s,   s = sigmoid(g)
    dg = dy * u * s * (1 + g * (1 - s)),   du = dy * silu(g)

The backward recomputes s from the saved inputs (no intermediate is stored). ``g`` and ``u`` are either two
arrays with a row stride each, or the two halves of one row ``[g | u]`` of a fused gate_up projection: the
plan passes that array as both inputs, ``UP_OFFSET = N_COLS`` columns apart; FUSED writes dg and du as the
two halves of one gradient row the same way. A program owns a [BLOCK_M, BLOCK_N] tile of the (rows, N_COLS)
view, so loads and stores are 16-byte vectors; elementwise work, in float32.
"""
import triton
import triton.language as tl

from ..flash_attn.kernels_common import aligned

# Runtime integers: no divisibility specialisation from their values (see core_kernels/_plan.py); the plan
# states the row strides' through STRIDE_ALIGN.
INT_SCALARS = ("n_rows", "stride_dy", "stride_g", "stride_u")


@triton.jit
def _tile(n_rows, N_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows [BLOCK_M, 1] int64, cols [1, BLOCK_N], mask) of this program; column blocks vary fastest, so
    neighbouring programs read neighbouring memory."""
    COL_BLOCKS: tl.constexpr = (N_COLS + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    rows = (pid // COL_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % COL_BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N_COLS)[None, :]
    return rows[:, None].to(tl.int64), cols[None, :], mask


@triton.jit(do_not_specialize_on_alignment=INT_SCALARS)
def swiglu_fwd_kernel(
    G, U,  # inputs (the same array when fused)
    n_rows, stride_g, stride_u,  # runtime scalars (row strides in elements)
    Y,  # output, contiguous (n_rows, N_COLS)
    N_COLS: tl.constexpr, UP_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STRIDE_ALIGN: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, N_COLS, BLOCK_M, BLOCK_N)
    g = tl.load(G + rows * aligned(stride_g, STRIDE_ALIGN) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + UP_OFFSET + rows * aligned(stride_u, STRIDE_ALIGN) + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + rows * N_COLS + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=INT_SCALARS)
def swiglu_bwd_kernel(
    DY, G, U,  # inputs: the output's gradient, then the forward's inputs (G is U when fused)
    n_rows, stride_dy, stride_g, stride_u,  # runtime scalars
    DG, DU,  # outputs, contiguous; FUSED: DG is the (n_rows, 2 * N_COLS) gradient, DU a placeholder
    N_COLS: tl.constexpr, UP_OFFSET: tl.constexpr, FUSED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, N_COLS, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + rows * aligned(stride_dy, STRIDE_ALIGN) + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows * aligned(stride_g, STRIDE_ALIGN) + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + UP_OFFSET + rows * aligned(stride_u, STRIDE_ALIGN) + cols, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    if FUSED:
        out = DG + rows * (2 * N_COLS) + cols
        tl.store(out, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(out + N_COLS, du.to(DG.dtype.element_ty), mask=mask)
    else:
        tl.store(DG + rows * N_COLS + cols, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + rows * N_COLS + cols, du.to(DU.dtype.element_ty), mask=mask)
