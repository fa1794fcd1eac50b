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


# ---------------------------------------------------------------------------------------- both frameworks

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from flashbridge import jax_api as fj  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FLOOR = {"float32": 2e-6, "float16": 1e-4, "bfloat16": 1e-3}

# leading shape, I (the output's width), dtype, fused
CASES = [
    ((1,), 1, "float32", False),
    ((1,), 1, "float32", True),
    ((3,), 17, "float16", False),
    ((2, 65), 130, "bfloat16", True),
    ((130,), 64, "float32", True),
    ((7,), 1000, "bfloat16", False),
    ((2, 3, 5), 63, "float16", True),
    ((5,), 4097, "float32", False),
]


def _case_id(c):
    return f"{'x'.join(map(str, c[0]))}x{c[1]}-{c[2]}-{'fused' if c[3] else 'split'}"


def _inputs(case):
    lead, width, dtype, fused = case
    rng = np.random.default_rng(zlib.crc32(_case_id(case).encode()) + SEED_OFFSET)
    # gates over a wide range: the sigmoid's saturated tails and its middle both get checked
    g = rounded(rng.standard_normal((*lead, width)) * 4, dtype)
    u = rounded(rng.standard_normal((*lead, width)), dtype)
    dy = rounded(rng.standard_normal((*lead, width)), dtype)
    return g, u, dy


def _naive(g, u, dy, dtype):
    """The same math in the inputs' dtype, every intermediate rounded: the error a plain implementation makes."""
    s = rounded(1.0 / (1.0 + np.exp(-g)), dtype)
    silu = rounded(g * s, dtype)
    y = rounded(silu * u, dtype)
    ds = rounded(1.0 + rounded(g * rounded(1.0 - s, dtype), dtype), dtype)  # d silu / dg = s * ds
    dg = rounded(rounded(rounded(dy * u, dtype) * s, dtype) * ds, dtype)
    du = rounded(dy * silu, dtype)
    return y, dg, du


def _torch_run(g, u, dy, dtype, fused):
    """(y, dgate, dup) through the torch op (fused: one [gate | up] input)."""
    tg = torch.tensor(g, dtype=TORCH_DTYPES[dtype])
    tu = torch.tensor(u, dtype=TORCH_DTYPES[dtype])
    if fused:
        x = torch.cat([tg, tu], dim=-1).requires_grad_()
        y = ft.swiglu(x)
        y.backward(torch.tensor(dy, dtype=TORCH_DTYPES[dtype]))
        dg, du = x.grad.chunk(2, dim=-1)
    else:
        tg.requires_grad_()
        tu.requires_grad_()
        y = ft.swiglu(tg, tu)
        y.backward(torch.tensor(dy, dtype=TORCH_DTYPES[dtype]))
        dg, du = tg.grad, tu.grad
    assert y.dtype == TORCH_DTYPES[dtype] and tuple(y.shape) == g.shape
    return y, dg, du


def _jax_run(g, u, dy, dtype, fused):
    """(y, dgate, dup) through the JAX op."""
    jg, ju, jdy = (jnp.asarray(a, dtype) for a in (g, u, dy))
    if fused:
        y, vjp = jax.vjp(fj.swiglu, jnp.concatenate([jg, ju], axis=-1))
        (dx,) = vjp(jdy)
        return y, dx[..., :g.shape[-1]], dx[..., g.shape[-1]:]
    y, vjp = jax.vjp(fj.swiglu, jg, ju)
    return (y, *vjp(jdy))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward_both_frameworks(case):
    lead, width, dtype, fused = case
    g, u, dy = _inputs(case)
    ref_dg, ref_du = R.swiglu_bwd(dy, g, u)
    naive_y, naive_dg, naive_du = _naive(g, u, dy, dtype)
    t = _torch_run(g, u, dy, dtype, fused)
    j = _jax_run(g, u, dy, dtype, fused)
    assert j[0].dtype == jnp.dtype(dtype) and j[0].shape == g.shape
    for fw, (y, dg, du) in (("torch", t), ("jax", j)):
        assert_close(y, R.swiglu(g, u), naive_y, name=f"{fw} y", floor=FLOOR[dtype])
        assert_close(dg, ref_dg, naive_dg, name=f"{fw} dgate", floor=FLOOR[dtype])
        assert_close(du, ref_du, naive_du, name=f"{fw} dup", floor=FLOOR[dtype])
    for a, b in zip(t, j):  # the same kernels on the same device: the same bits
        np.testing.assert_array_equal(np64(a), np64(b))


def test_torch_fused_equals_split_bitwise():
    g, u, dy = _inputs(((4,), 48, "bfloat16", False))
    split = _torch_run(g, u, dy, "bfloat16", False)
    fused = _torch_run(g, u, dy, "bfloat16", True)
    for a, b in zip(split, fused):
        assert torch.equal(a, b)


def test_torch_non_contiguous_inputs():
    """Chunk views (strided rows), a transposed gate and a broadcast up all give the contiguous answer."""
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.standard_normal((6, 2 * 40)), dtype=torch.float32)
    gate, up = x.chunk(2, dim=-1)
    assert gate.stride() == (80, 1)
    torch.testing.assert_close(ft.swiglu(gate, up), ft.swiglu(x), rtol=0, atol=0)
    gt = torch.tensor(rng.standard_normal((40, 6)), dtype=torch.float32).t()
    ub = torch.tensor(rng.standard_normal(40), dtype=torch.float32).expand(6, 40)
    ref = R.swiglu(np64(gt), np64(ub))
    assert_close(ft.swiglu(gt, ub), ref, rounded(ref, "float32"), name="y")


def test_torch_unused_output_and_no_grad():
    g = torch.randn(3, 8, requires_grad=True)
    u = torch.randn(3, 8)
    with torch.no_grad():
        y = ft.swiglu(g, u)
    assert not y.requires_grad
    (gg,) = torch.autograd.grad(ft.swiglu(g, u).sum(), [g])  # up needs no gradient
    ref_dg, _ = R.swiglu_bwd(np.ones((3, 8)), np64(g), np64(u))
    assert_close(gg, ref_dg, rounded(ref_dg, "float32"), name="dgate")


def test_torch_compile_fullgraph_and_opcheck():
    rng = np.random.default_rng(5)
    x = torch.tensor(rng.standard_normal((4, 2 * 33)), dtype=torch.float32, requires_grad=True)
    g = torch.tensor(rng.standard_normal((4, 33)), dtype=torch.float32, requires_grad=True)

    def block(x, g):
        return (ft.swiglu(x) * 2 + ft.swiglu(g, g.sin())).square().sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled(x, g).backward()
    got = [t.grad.clone() for t in (x, g)]
    x.grad = g.grad = None
    block(x, g).backward()
    for a, t in zip(got, (x, g)):
        torch.testing.assert_close(a, t.grad)
    dy = torch.randn(4, 33)
    torch.library.opcheck(torch.ops.flashbridge.swiglu_fwd.default, (x, None))
    torch.library.opcheck(torch.ops.flashbridge.swiglu_fwd.default, (g, g.detach().cos().requires_grad_()))
    torch.library.opcheck(torch.ops.flashbridge.swiglu_bwd.default, (dy, x.detach(), None))
    torch.library.opcheck(torch.ops.flashbridge.swiglu_bwd.default, (dy, g.detach(), g.detach().cos()))


# -------------------------------------------------------------------------------------------------- JAX

def test_jax_jit_grad_vmap():
    rng = np.random.default_rng(6)
    xs = jnp.asarray(rng.standard_normal((3, 5, 2 * 40)) * 3, jnp.float32)
    up = jnp.asarray(rng.standard_normal((5, 40)), jnp.float32)

    def loss(x):
        return jnp.sum(fj.swiglu(x) ** 2)

    # vmap folds the mapped axis into the rows; vmap of grad against a loop; both sides jitted
    got = jax.jit(jax.vmap(jax.value_and_grad(loss)))(xs)
    for i in range(3):
        want = jax.jit(jax.value_and_grad(loss))(xs[i])
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b))
    # an unmapped up is broadcast
    gates = xs[..., :40]
    got = jax.vmap(fj.swiglu, in_axes=(0, None))(gates, up)
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(fj.swiglu(gates[2], up)))
    # grad against the reference
    g = jax.grad(loss)(xs[0])
    y = R.swiglu(np.asarray(xs[0]))
    np.testing.assert_allclose(np.asarray(g), R.swiglu_bwd(2 * y, np.asarray(xs[0])), rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------------------------------ bad input

def _bad_cases():
    t = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt)  # noqa: E731
    j = lambda *s, dt=jnp.float32: jnp.ones(s, dt)  # noqa: E731
    return [
        (lambda: ft.swiglu(t(4, 7)), ValueError, "gate"),  # odd fused width
        (lambda: ft.swiglu(t(4, 8), t(4, 9)), ValueError, "up"),
        (lambda: ft.swiglu(t(4, 8), t(4, 8, dt=torch.float16)), TypeError, "up"),
        (lambda: ft.swiglu(t(4, 8, dt=torch.float64)), TypeError, "gate"),
        (lambda: ft.swiglu(torch.randint(0, 3, (4, 8))), TypeError, "gate"),
        (lambda: ft.swiglu(t(0, 8)), ValueError, "gate"),
        (lambda: ft.swiglu(torch.tensor(1.0)), ValueError, "gate"),
        (lambda: ft.swiglu(t(4, 8).numpy()), TypeError, "gate"),
        (lambda: ft.swiglu(None), TypeError, "gate"),
        (lambda: ft.swiglu(t(4, 8), t(4, 8).to("meta")), ValueError, "up"),
        (lambda: fj.swiglu(j(4, 7)), ValueError, "gate"),
        (lambda: fj.swiglu(j(4, 8), j(8, 4)), ValueError, "up"),
        (lambda: fj.swiglu(j(4, 8, dt=jnp.int32)), TypeError, "gate"),
        (lambda: fj.swiglu(j(4, 8), j(4, 8, dt=jnp.bfloat16)), TypeError, "up"),
        (lambda: fj.swiglu([1.0, 2.0]), TypeError, "gate"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_input_is_rejected_with_a_clear_error(i):
    fn, exc, arg = _bad_cases()[i]
    with pytest.raises(exc, match=arg):
        fn()


# ---------------------------------------------------------------------------------------------- modules

class _Config:  # the fields of a Hugging Face Llama config that the MLP reads
    hidden_size, intermediate_size, hidden_act, mlp_bias = 24, 40, "silu", False


def test_torch_swiglu_mlp_is_a_llama_mlp():
    """Same submodules and state dict as LlamaMLP / LigerSwiGLUMLP; equals the eager expression; the fused
    form with gate_up_proj = [gate; up] gives the same bits."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    mlp = ft.SwiGLUMLP.from_config(_Config())
    assert sorted(mlp.state_dict()) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    x = torch.randn(2, 7, 24, requires_grad=True)
    y = mlp(x)
    eager = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(y, eager, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(y.square().sum(), [x, *mlp.parameters()])
    want = torch.autograd.grad(eager.square().sum(), [x, *mlp.parameters()])
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)

    fused = ft.SwiGLUMLP(24, 40, fused=True)
    assert sorted(fused.state_dict()) == ["down_proj.weight", "gate_up_proj.weight"]
    with torch.no_grad():
        fused.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        fused.down_proj.weight.copy_(mlp.down_proj.weight)
    torch.testing.assert_close(fused(x), y, rtol=1e-6, atol=1e-6)
    cfg = _Config()
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        ft.SwiGLUMLP.from_config(cfg)


@pytest.mark.parametrize("fused", [False, True])
def test_flax_swiglu_mlp(fused):
    from flax import nnx

    mlp = fj.SwiGLUMLP(24, 40, fused=fused, use_bias=True, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 24)), jnp.float32)
    if fused:
        h = mlp.gate_up_proj(x)
        gate, up = h[:, :40], h[:, 40:]
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    want = mlp.down_proj(jax.nn.silu(gate) * up)
    np.testing.assert_allclose(np.asarray(mlp(x)), np.asarray(want), rtol=1e-5, atol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(mlp)
    assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(mlp, nnx.Param))
