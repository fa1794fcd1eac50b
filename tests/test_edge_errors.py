"""Bad and edge arguments across the families, both frameworks, on the CPU: every one gets an error that
names the argument (checked by message) before any launch, or a defined result -- never a silent wrong
answer or a dropped gradient.

Gradients through forward-only ops (decode, caches, merges) fail naming the op; non-numeric scalars,
truncated window sizes, unchecked seeds, seeds that alias, memory-sharing caches and float64 norm parameters.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge import torch_api as T
from flashbridge._forward_only import FORWARD_ONLY_OPS
from helpers import torch_to_jax

jax = pytest.importorskip("jax")
jnp = jax.numpy
from flashbridge import jax_api as J  # noqa: E402

FRAMEWORKS = ["torch", "jax"]


def _arr(fw, t):
    return t if fw == "torch" else torch_to_jax(t)


def _api(fw):
    return T if fw == "torch" else J


# ------------------------------------------------------------------------------------ forward-only ops

def _decode_inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=g)
    cache = torch.randn(2, 32, 2, 16, generator=g)
    lens = torch.tensor([10, 32], dtype=torch.int32)
    return q, cache, lens


def _forward_only_calls(fw):
    """name -> (function of one differentiable float array, that array)."""
    api = _api(fw)
    q, cache, lens = _decode_inputs()
    q, cache, lens = (_arr(fw, t) for t in (q, cache, lens))
    shared = _arr(fw, torch.randn(8, 2, 16))
    outs, lses = _arr(fw, torch.randn(2, 3, 4, 16)), _arr(fw, torch.randn(2, 3, 4))
    latent = _arr(fw, torch.randn(2, 32, 24))
    mq = _arr(fw, torch.randn(2, 1, 4, 24))
    return {
        "decode_attention": (lambda x: api.decode_attention(x, cache, cache, cache_seqlens=lens), q),
        "cascade_attention": (lambda x: api.cascade_attention(x, shared, shared, cache, cache, cache_seqlens=lens),
                              q),
        "merge_attention_states": (lambda x: api.merge_attention_states(x, lses)[0], outs),
        "mla_decode": (lambda x: api.mla_decode(x, latent, cache_seqlens=lens, head_dim_v=16), mq),
        "flash_attention with block_table / seqused_k": (
            lambda x: api.flash_attention(x, cache, cache, seqused_k=lens), _arr(fw, torch.randn(2, 3, 4, 16))),
    }


def test_every_forward_only_op_is_covered():
    assert set(_forward_only_calls("torch")) | {"append_kv_cache"} == set(FORWARD_ONLY_OPS)


@pytest.mark.parametrize("name", ["decode_attention", "cascade_attention", "merge_attention_states", "mla_decode",
                                  "flash_attention with block_table / seqused_k"])
def test_torch_gradient_through_a_forward_only_op_fails_at_backward(name):
    fn, x = _forward_only_calls("torch")[name]
    x = x.clone().requires_grad_()
    out = fn(x)
    assert out.requires_grad  # the gradient is not silently dropped ...
    with pytest.raises(NotImplementedError, match=f"{name} has no backward.*flash_attention"):
        out.sum().backward()  # ... it fails, naming the op
    with torch.no_grad():  # inference as usual
        assert not fn(x).requires_grad


@pytest.mark.parametrize("name", ["decode_attention", "cascade_attention", "merge_attention_states", "mla_decode",
                                  "flash_attention with block_table / seqused_k"])
def test_jax_gradient_through_a_forward_only_op_fails_while_tracing(name):
    fn, x = _forward_only_calls("jax")[name]
    with pytest.raises(NotImplementedError, match=f"{name} has no backward.*flash_attention"):
        jax.grad(lambda a: jnp.sum(fn(a)))(x)
    with pytest.raises(NotImplementedError, match=name):
        jax.jit(jax.grad(lambda a: jnp.sum(fn(a))))(x)
    # forward under jit as before; an output that does not reach the loss costs nothing
    assert jax.jit(fn)(x).shape == fn(x).shape
    g = jax.grad(lambda a: jnp.sum(a) + 0.0 * jnp.sum(jax.lax.stop_gradient(fn(a))))(x)
    assert np.array_equal(np.asarray(g), np.ones(x.shape, np.float32))


def test_append_kv_cache_refuses_tokens_that_need_a_gradient_torch():
    _, cache, lens = _decode_inputs()
    new = torch.randn(2, 1, 2, 16, requires_grad=True)
    with pytest.raises(NotImplementedError, match="append_kv_cache has no backward"):
        T.append_kv_cache(cache.clone(), cache.clone(), new, new.detach(), cache_seqlens=lens - 1)
    with torch.no_grad():
        T.append_kv_cache(cache.clone(), cache.clone(), new, new, cache_seqlens=lens - 1)


def test_append_kv_cache_gradient_fails_while_tracing_jax():
    _, cache, lens = (torch_to_jax(t) for t in _decode_inputs())
    new = jnp.ones((2, 1, 2, 16))

    def loss(n):
        k, v = J.append_kv_cache(cache, cache, n, n, cache_seqlens=lens - 1)
        return jnp.sum(k)

    with pytest.raises(NotImplementedError, match="append_kv_cache has no backward"):
        jax.grad(loss)(new)


# ------------------------------------------------------------------------------- scalar arguments

def _norm_inputs(fw):
    g = torch.Generator().manual_seed(1)
    return _arr(fw, torch.randn(4, 32, generator=g)), _arr(fw, torch.randn(4, 32, generator=g))


BAD_NORM_CALLS = [
    ("eps str", lambda api, x, r: api.rms_norm(x, eps="a"), TypeError, "eps: expected a Python float, got str"),
    ("eps None", lambda api, x, r: api.layer_norm(x, eps=None), TypeError, "eps: expected a Python float"),
    ("eps inf", lambda api, x, r: api.rms_norm(x, eps=float("inf")), ValueError, "eps: must be > 0 and finite"),
    ("dropout_p str", lambda api, x, r: api.layer_norm_dropout_residual(x, None, None, r, dropout_p="0.1"),
     TypeError, "dropout_p: expected a Python float, got str"),
    ("dropout_p 1", lambda api, x, r: api.layer_norm_dropout_residual(x, None, None, r, dropout_p=1.0),
     ValueError, r"dropout_p: must be in \[0, 1\)"),
    ("seed str without dropout", lambda api, x, r: api.layer_norm_dropout_residual(x, None, None, r, seed="abc"),
     TypeError, "seed: expected a Python int"),
    ("seed too large", lambda api, x, r: api.layer_norm_dropout_residual(x, None, None, r, seed=2**40),
     ValueError, "seed: must fit in int32"),
    ("residual shape", lambda api, x, r: api.layer_norm_dropout_residual(x, None, None, r[:2]), ValueError,
     r"^residual: expected the shape of x"),
]


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("case", BAD_NORM_CALLS, ids=[c[0] for c in BAD_NORM_CALLS])
def test_norm_scalar_arguments(fw, case):
    _, call, error, match = case
    x, r = _norm_inputs(fw)
    with pytest.raises(error, match=match):
        call(_api(fw), x, r)


def test_torch_residual_of_the_wrong_type_is_named_residual():
    x, _ = _norm_inputs("torch")
    with pytest.raises(TypeError, match="^residual: expected a torch.Tensor"):
        T.layer_norm_dropout_residual(x, None, None, [1.0])


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("window,error", [((1.7, 0), TypeError), (("a", 0), TypeError), ((2, None), TypeError),
                                          ((True, 0), TypeError), (3, ValueError), ("ab", TypeError)])
def test_attention_window_size_must_be_a_pair_of_ints(fw, window, error):
    q = _arr(fw, torch.randn(1, 8, 2, 16))
    with pytest.raises(error, match="window_size: expected a pair of ints"):
        _api(fw).flash_attention(q, q, q, window_size=window)


def test_attention_window_size_takes_numpy_ints():
    q = torch.randn(1, 8, 2, 16)
    a = T.flash_attention(q, q, q, window_size=(np.int64(2), np.int32(0)))
    assert torch.equal(a, T.flash_attention(q, q, q, window_size=(2, 0)))


@pytest.mark.parametrize("size,error", [("ab", TypeError), ((1.5, 2), TypeError), (2.0, ValueError)])
def test_jax_local_window_size_must_be_ints(size, error):
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(error, match="local_window_size: expected a pair of ints"):
        J.dot_product_attention(q, q, q, local_window_size=size)


def test_decode_window_size_must_be_ints():
    q, cache, lens = _decode_inputs()
    for fw in FRAMEWORKS:
        with pytest.raises(TypeError, match="window_size"):
            _api(fw).decode_attention(_arr(fw, q), _arr(fw, cache), _arr(fw, cache), cache_seqlens=_arr(fw, lens),
                                      window_size=(4.5, 0))


# ------------------------------------------------------------------------------------------ seeds

def test_int64_seed_tensors_keep_int32_values_and_never_alias_seed_zero():
    x, r = _norm_inputs("torch")

    def run(seed):
        return T.layer_norm_dropout_residual(x, None, None, r, dropout_p=0.5, seed=seed)

    assert torch.equal(run(torch.tensor(5)), run(5))
    assert torch.equal(run(torch.tensor(-7)), run(-7))
    assert torch.equal(run(torch.tensor([-2**31])), run(-2**31))
    zero = run(0)
    for big in (2**40, 2**32, -2**31 - 1, 2**63 - 1):
        assert not torch.equal(run(torch.tensor(big)), zero), big


def test_seed_folding_is_the_same_in_both_frameworks():
    from flashbridge.jax_api._checks import as_seed
    from flashbridge.torch_api._checks import seed_tensor

    values = [0, 5, -7, 2**31 - 1, -2**31, 2**31, 2**40, -2**40 - 3, 2**63 - 1, -2**63]
    want = [int(seed_tensor(torch.tensor(v), torch.device("cpu"))[0]) for v in values]
    assert want[:5] == values[:5]
    with jax.enable_x64():
        got = [int(as_seed(jnp.asarray(v, jnp.int64))[0]) for v in values]
    assert got == want
    assert len(set(want)) == len(values)


def test_jax_seed_array_too_large_differs_from_seed_zero():
    x, r = _norm_inputs("jax")
    with jax.enable_x64():
        big = J.layer_norm_dropout_residual(x, None, None, r, dropout_p=0.5, seed=jnp.asarray(2**40, jnp.int64))
    zero = J.layer_norm_dropout_residual(x, None, None, r, dropout_p=0.5, seed=0)
    assert not np.array_equal(np.asarray(big), np.asarray(zero))


# ------------------------------------------------------------------------------------------ caches

def test_append_kv_cache_refuses_a_cache_whose_rows_share_memory():
    _, _, lens = _decode_inputs()
    new = torch.ones(2, 1, 2, 16)
    own = torch.zeros(2, 32, 2, 16)
    expanded = torch.zeros(1, 32, 2, 16).expand(2, 32, 2, 16)
    with pytest.raises(ValueError, match=r"k_cache: its elements share memory .*expand"):
        T.append_kv_cache(expanded, own, new, new, cache_seqlens=lens - 1)
    with pytest.raises(ValueError, match="v_cache: its elements share memory"):
        T.append_kv_cache(own, torch.zeros(2, 32, 1, 16).expand(2, 32, 2, 16), new, new, cache_seqlens=lens - 1)
    T.append_kv_cache(own, expanded.clone(), new, new, cache_seqlens=lens - 1)  # memory of its own: fine
    assert own[1, 31].eq(1).all() and own[0, 9].eq(1).all()


# ------------------------------------------------------------------------------- norm parameters

@pytest.mark.parametrize("which", ["rms", "layer"])
def test_torch_float64_norm_parameters_are_accepted(which):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 48, generator=g)
    w = torch.randn(48, generator=g, dtype=torch.float64).requires_grad_()
    b = torch.randn(48, generator=g, dtype=torch.float64).requires_grad_()
    if which == "rms":
        y, params = T.rms_norm(x, w), [w]
        want = T.rms_norm(x, w.detach().float())
    else:
        y, params = T.layer_norm(x, w, b), [w, b]
        want = T.layer_norm(x, w.detach().float(), b.detach().float())
    assert y.dtype == torch.float32 and torch.equal(y, want)
    grads = torch.autograd.grad(y.square().sum(), params)
    assert all(gr.dtype == torch.float64 and torch.isfinite(gr).all() for gr in grads)


def test_jax_float64_norm_parameters_are_accepted():
    g = torch.Generator().manual_seed(3)
    x = torch_to_jax(torch.randn(5, 48, generator=g))
    w32 = torch.randn(48, generator=g)
    with jax.enable_x64():
        w = jnp.asarray(w32.numpy(), jnp.float64)
        y = J.rms_norm(x, w)
        assert y.dtype == jnp.float32
        assert np.array_equal(np.asarray(y), np.asarray(J.rms_norm(x, w.astype(jnp.float32))))
        dw = jax.grad(lambda w_: jnp.sum(J.rms_norm(x, w_) ** 2))(w)
        assert dw.dtype == jnp.float64 and bool(jnp.all(jnp.isfinite(dw)))
