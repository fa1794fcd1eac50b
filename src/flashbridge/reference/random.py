"""Triton's counter-based generator (``tl.philox``: Philox-4x32, 10 rounds unless told) in NumPy, bit for bit,
so that the float64 references take the exact dropout masks the kernels draw (``core_kernels/_random.py``)."""
from __future__ import annotations

import numpy as np

_ROUND_A, _ROUND_B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_KEY_A, _KEY_B = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(seed: int, c0, c1, c2, c3, rounds: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                      np.ndarray]:
    """``tl.philox(seed, c0, c1, c2, c3, rounds)`` in NumPy: the 4 output words (uint32, the broadcast shape
    of the counter words, any integers read as uint32). Philox-4x32 with ``rounds`` rounds, key (seed's low
    and high words, the int32 seed sign-extended to 64 bits as Triton does)."""
    c0, c1, c2, c3 = np.broadcast_arrays(*(np.asarray(c).astype(np.int64).astype(np.uint64) & _MASK32
                                           for c in (c0, c1, c2, c3)))
    s = np.uint64(np.int64(seed).astype(np.uint64))
    k0, k1 = np.uint32(s & _MASK32), np.uint32(s >> np.uint64(32))
    with np.errstate(over="ignore"):
        for _ in range(rounds):
            prod_b = _ROUND_B * c2  # < 2**64: both factors < 2**32
            prod_a = _ROUND_A * c0
            n0 = (prod_b >> np.uint64(32)) ^ c1 ^ np.uint64(k0)
            n2 = (prod_a >> np.uint64(32)) ^ c3 ^ np.uint64(k1)
            c1 = prod_b & _MASK32
            c3 = prod_a & _MASK32
            c0, c2 = n0, n2
            k0 = np.uint32(k0 + _KEY_A)
            k1 = np.uint32(k1 + _KEY_B)
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def philox_uniform(seed: int, offsets) -> np.ndarray:
    """``tl.rand(seed, offsets)`` in NumPy: float32 uniforms in [0, 1), the shape of ``offsets`` (int64).

    Counter (offset low word, offset high word, 0, 0); the first output word, read as int32 and folded to
    non-negative (``x < 0 -> ~x``), times 4.6566127342e-10 in float32."""
    off = np.asarray(offsets, dtype=np.int64).astype(np.uint64)
    x = philox4x32(seed, off & _MASK32, off >> np.uint64(32), 0, 0)[0].view(np.int32)
    x = np.where(x < 0, ~x, x)
    return x.astype(np.float32) * np.float32(4.6566127342e-10)


def philox_bytes(seed: int, c0, c1, c2, c3, rounds: int = 7) -> np.ndarray:
    """The 16 bytes of each Philox-4x32 call (7 rounds: ``keep16`` in core_kernels/_random.py), uint8 of
    the counters' broadcast shape + (16,): byte e is byte ``e % 4`` (from the least significant end) of
    output word ``e // 4``."""
    words = np.stack(philox4x32(seed, c0, c1, c2, c3, rounds), axis=-1).astype("<u4")
    return words.view(np.uint8)
