"""SwiGLU on the CPU (Triton interpreter), both frameworks, against the float64 reference."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from flashbridge.reference import swiglu as R
from helpers import assert_close, np64, rounded

SEED_OFFSET = int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))


# ----------------------------------------------------------------------------------- the reference itself

def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    g, u, dy = rng.standard_normal((3, 5)) * 3, rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    dg, du = R.swiglu_bwd(dy, g, u)
    for arg, analytic in ((0, dg), (1, du)):
        numeric = np.zeros((3, 5))
        for idx in np.ndindex(3, 5):
            args_p, args_m = [g.copy(), u.copy()], [g.copy(), u.copy()]
            args_p[arg][idx] += 1e-6
            args_m[arg][idx] -= 1e-6
            numeric[idx] = (np.sum(R.swiglu(*args_p) * dy) - np.sum(R.swiglu(*args_m) * dy)) / 2e-6
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    # the fused form is the two halves of one array, gate first
    x = np.concatenate([g, u], axis=-1)
    np.testing.assert_array_equal(R.swiglu(x), R.swiglu(g, u))
    np.testing.assert_array_equal(R.swiglu_bwd(dy, x), np.concatenate([dg, du], axis=-1))
    # silu at the extremes: no overflow, silu(-inf-ish) = 0, silu(large) = x
    big = np.array([-1000.0, 1000.0])
    np.testing.assert_array_equal(R.swiglu(big, np.ones(2)), [0.0, 1000.0])
