"""Rotary position embeddings on the CPU (Triton interpreter), both frameworks, against the float64 reference."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from flashbridge.reference import rotary as R
from helpers import assert_close, np64, rounded

SEED_OFFSET = int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))


# ----------------------------------------------------------------------------------- the reference itself

def _fd_grad(loss, x, eps=1e-6):
    numeric = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric[idx] = (loss(plus) - loss(minus)) / (2 * eps)
    return numeric


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("layout", ["bshd", "position_ids", "packed"])
def test_reference_backward_matches_finite_differences(interleaved, layout):
    rng = np.random.default_rng(0)
    cos, sin = R.cos_sin_table(9, 4, base=3.0)  # rotary_dim 4 of head dim 6: two dims pass through
    kw = {}
    if layout == "packed":
        x = rng.standard_normal((7, 2, 6))
        kw["cu_seqlens"] = np.array([0, 3, 3, 7])
    else:
        x = rng.standard_normal((2, 3, 2, 6))
        if layout == "position_ids":
            kw["position_ids"] = rng.integers(0, 9, (2, 3))
    dy = rng.standard_normal(x.shape)

    def loss(x):
        return np.sum(R.rotary_embedding(x, cos, sin, interleaved=interleaved, **kw) * dy)

    np.testing.assert_allclose(R.rotary_embedding_bwd(dy, cos, sin, interleaved=interleaved, **kw),
                               _fd_grad(loss, x), rtol=1e-6, atol=1e-7)


def test_reference_is_a_complex_rotation():
    """NeoX RoPE multiplies (x_i + j x_{i+R/2}) by exp(j p theta_i); GPT-J does it to (x_2i + j x_2i+1)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 5, 3, 10))
    cos, sin = R.cos_sin_table(5, 8)
    angle = np.arctan2(sin, cos)[None, :, None, :]  # (1, S, 1, R/2)
    rot = np.exp(1j * angle)
    neox = R.rotary_embedding(x, cos, sin)
    z = (x[..., :4] + 1j * x[..., 4:8]) * rot
    np.testing.assert_allclose(neox[..., :4], z.real, atol=1e-12)
    np.testing.assert_allclose(neox[..., 4:8], z.imag, atol=1e-12)
    gptj = R.rotary_embedding(x, cos, sin, interleaved=True)
    z = (x[..., 0:8:2] + 1j * x[..., 1:8:2]) * rot
    np.testing.assert_allclose(gptj[..., 0:8:2], z.real, atol=1e-12)
    np.testing.assert_allclose(gptj[..., 1:8:2], z.imag, atol=1e-12)
    np.testing.assert_array_equal(neox[..., 8:], x[..., 8:])
    # packed positions restart per sequence
    np.testing.assert_array_equal(R.positions((6, 2, 4), cu_seqlens=[0, 2, 2, 6]), [0, 1, 0, 1, 2, 3])
