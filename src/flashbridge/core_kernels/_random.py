"""The counter-based random generator of the kernels (dropout in the norms and in attention): Triton's
Philox-4x32, a pure function of (seed, counter), so the backward regenerates a mask instead of storing it,
and torch, JAX, the interpreter and the GPU all draw the same bits. ``flashbridge.reference.random`` is the
same generator in NumPy (the float64 references take the exact keep-masks the kernels use from it).

* ``dropout_keep(seed, offsets, p)`` (the norms): one Philox call per element, counter (offset, 0, 0);
  kept when its first word as a ``tl.rand`` uniform is >= p.
* ``keep16(seed, a, b, c2, c3, threshold)`` (attention): one Philox-4x32-7 call per 16 elements of an
  (a, b) tile. Its 128 output bits are 16 bytes, an element kept when its byte is >= threshold (an integer
  in [0, 255]: keep probability ``(256 - threshold) / 256``).
  A Philox round costs 2 wide multiplies (4 instructions on sm_90) and 2 three-way XORs: 10 rounds per
  element cost ~60 integer instructions per element, several times the element's share of the two
  matrix products; 7 rounds per 16 elements (computed by 2 threads each) about 5.
"""
import triton
import triton.language as tl


# Philox rounds of keep16: 7, as flash-attn's dropout (Philox-4x32-7 passes BigCrush; 10 is the generator's
# safety margin, 43% more of the multiplies that dominate the draw's cost).
KEEP16_ROUNDS = tl.constexpr(7)


@triton.jit
def dropout_keep(seed, offs, dropout_p):
    """Bool, the shape of ``offs`` (int64 offsets, any shape): keep the element (seed: an int32 scalar). The
    probability is rounded to float32 first: jax-triton passes Python floats as float64, torch as float32."""
    return tl.rand(seed, offs) >= tl.cast(dropout_p, tl.float32)


@triton.jit
def byte_threshold(dropout_p):
    """The byte threshold of probability ``dropout_p`` (a float scalar): ``round(256 * p)`` (halves up) of p
    rounded to float32, i.e. ``(floor(512 * p) + 1) >> 1`` -- exact in float32 (a power-of-two scale), so
    the host (plan checks), the kernels and the NumPy reference agree on every p."""
    return (tl.cast(tl.cast(dropout_p, tl.float32) * 512.0, tl.int32) + 1) >> 1


@triton.jit
def _philox_rounds(seed, c0, c1, c2, c3, N_ROUNDS: tl.constexpr):
    """``tl.philox(seed, c0, c1, c2, c3, N_ROUNDS)`` (uint32 counter words), bit for bit, with each round's
    two 32 x 32 -> 64-bit products as one widening multiply (``mul.wide.u32``: one IMAD.WIDE on sm_90,
    where tl.philox's separate high and low halves take two instructions each)."""
    seed = tl.cast(seed, tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(N_ROUNDS):
        prod_a = tl.cast(c0, tl.uint64) * 0xD2511F53
        prod_b = tl.cast(c2, tl.uint64) * 0xCD9E8D57
        c0, c1, c2, c3 = ((prod_b >> 32).to(tl.uint32) ^ c1 ^ k0, prod_b.to(tl.uint32),
                          (prod_a >> 32).to(tl.uint32) ^ c3 ^ k1, prod_a.to(tl.uint32))
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _ge_bytes(w, tt, tt_low):
    """Per byte of uint32 ``w``, ``byte >= t``: bit 8j + 7 set where byte j is, every other bit 0 (SWAR, from
    ``tt`` = t in every byte and ``tt_low`` = t & 127 in every byte; ``(w | 0x80..) - tt_low`` borrows
    nowhere across bytes and leaves ``low 7 bits >= t's`` in each byte's top bit)."""
    d = (w | 0x80808080) - tt_low
    return ((w & (tt ^ 0xFFFFFFFF)) | ((w ^ tt ^ 0xFFFFFFFF) & d)) & 0x80808080


@triton.jit
def _lattice(start, L: tl.constexpr):
    """Indices ``start + arange(L)`` (start a multiple of 16) as [L / 16, 2, 4, 2] (bits 4+, 3, 2-1, 0):
    (index & ~9 broadcast [L / 16, 1, 4, 1], bit 3 [1, 2, 1, 1], bit 0 [1, 1, 1, 2])."""
    base = start + 16 * tl.arange(0, L // 16)[:, None, None, None] + 2 * tl.arange(0, 4)[None, None, :, None]
    bit = tl.arange(0, 2)
    return tl.cast(base, tl.uint32), bit[None, :, None, None], bit[None, None, None, :]


@triton.jit
def _rows8(x):
    return x[:, :, :, :, None, None, None, None]


@triton.jit
def _cols8(x):
    return x[None, None, None, None, :, :, :, :]


@triton.jit
def keep16(seed, a_start, b_start, LA: tl.constexpr, LB: tl.constexpr, c2, c3, threshold,
           A_ROWS: tl.constexpr = True):
    """Bool ``[LA, LB]`` (``[LB, LA]`` without A_ROWS): the keep-mask of indices ``a = a_start + arange(LA)``
    by ``b = b_start + arange(LB)`` (starts and lengths multiples of 16), one Philox call per 16 elements.
    Element (a, b) is byte ``e = 8 * a3 + 4 * b3 + 2 * a0 + b0`` (x3, x0: bits 3 and 0 of x) of the call with
    counter ``(a & ~9, b & ~9, c2, c3)`` (uint32 scalars c2, c3) and key ``seed`` (int32, sign-extended as
    ``tl.philox`` does); byte e is byte ``e % 4`` of output word ``e // 4`` from the least significant end.
    Kept when the byte is >= ``threshold`` (:func:`byte_threshold`).

    Why that lattice (a call serves rows a, a+1, a+8, a+9 by columns b, b+1, b+8, b+9) rather than 16
    consecutive columns: in the tensor cores' accumulator layout (m16n8 fragments, sm_80 and sm_90) a thread
    holds rows r and r + 8 and column pairs 2c, 2c + 1 every 8 columns, so bit 3 of both indices and bit 0
    of the column index are in one thread's registers, in either orientation of the tile (S or S^T). The
    tile is computed as an 8-D view (the index bits as axes) that reshapes to the accumulator's layout
    without moving data: the counters broadcast along the bit axes, so each call runs once per thread that
    holds its elements (2 threads), and the word and byte of a register are picked at compile time.
    16 consecutive columns would span 4 threads (8 in S^T), or need a shuffle through shared memory."""
    ca, a3, a0 = _lattice(a_start, LA)
    cb, b3, b0 = _lattice(b_start, LB)
    if A_ROWS:
        ca, a3, a0 = _rows8(ca), _rows8(a3), _rows8(a0)
        cb, b3, b0 = _cols8(cb), _cols8(b3), _cols8(b0)
    else:
        ca, a3, a0 = _cols8(ca), _cols8(a3), _cols8(a0)
        cb, b3, b0 = _rows8(cb), _rows8(b3), _rows8(b0)
    w0, w1, w2, w3 = _philox_rounds(seed, ca, cb, c2, c3, KEEP16_ROUNDS)
    # the call's 16 keep bits in one word (word k's byte j at bit 8j + 7 - k), so that a single value
    # carries the call to the tile's layout
    t = tl.cast(threshold, tl.uint32)
    tt = t * 0x01010101
    tt_low = (t & 127) * 0x01010101
    bits = (_ge_bytes(w0, tt, tt_low) | (_ge_bytes(w1, tt, tt_low) >> 1) | (_ge_bytes(w2, tt, tt_low) >> 2)
            | (_ge_bytes(w3, tt, tt_low) >> 3))
    # element (a, b): bit 8 * (2 * a0 + b0) + 7 - (2 * a3 + b3) of its call's word (a mask per register)
    keep = (bits & (tl.full((), 1, tl.uint32) << tl.cast(16 * a0 + 8 * b0 + 7 - 2 * a3 - b3, tl.uint32))) != 0
    if A_ROWS:
        keep = tl.reshape(keep, (LA, LB))
    else:
        keep = tl.reshape(keep, (LB, LA))
    return keep
