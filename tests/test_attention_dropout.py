"""Attention dropout (``flash_attention(..., dropout_p=, seed=)``), both frameworks, on the CPU (interpreter).

The keep-mask is a function of (seed, batch, head, query, key) through Philox-4x32-7, one call per 16
elements (a byte each, kept when >= round(256 p)); the float64 reference takes the exact mask from
``reference.attention.attention_dropout_mask`` (a NumPy Philox, bit for bit), so forward and gradients are
checked against it with the accuracy rule (error <= 2 x a naive float32 implementation's error + a floor).
The mask is also read back from the kernel itself (values = identity), with several tile sizes: the mask
must not depend on them (the forward and the backward kernels tile differently).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge.core_kernels.flash_attn.plan import (DROPOUT_P_ROUNDS_TO_ONE, AttentionConfig, AttnOptions, AttnShape,
                                                      check_dropout, plan_attention_bwd, plan_attention_fwd)
from flashbridge.core_kernels import INTERPRETER, configure
from flashbridge.reference import attention as ref
from flashbridge.reference.random import philox4x32, philox_uniform
from flashbridge.torch_api import flash_attention, scaled_dot_product_attention
from helpers import assert_close, check_keep16, naive_torch, np64, torch_to_jax

# name: (b, sq, sk, hq, hkv, d, options, seqlens for packed input)
CASES = {
    "dense": (2, 17, 33, 2, 2, 16, dict(), None),
    "gqa-causal": (1, 40, 40, 4, 2, 32, dict(causal=True), None),
    "window-softcap": (2, 33, 17, 2, 1, 16, dict(window_size=(5, 3), softcap=2.0), None),
    "varlen-causal": (None, None, None, 2, 1, 16, dict(causal=True), [(17, 23), (1, 9), (30, 30)]),
}


def _inputs(case, seed=0, dtype=torch.float32):
    b, sq, sk, hq, hkv, d, options, seqlens = case
    g = torch.Generator().manual_seed(seed)
    kw = dict(options)
    if seqlens is None:
        shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d))
        dims = (b, sq, sk)
    else:
        cq = torch.tensor([0, *np.cumsum([s[0] for s in seqlens])], dtype=torch.int32)
        ck = torch.tensor([0, *np.cumsum([s[1] for s in seqlens])], dtype=torch.int32)
        shapes = ((int(cq[-1]), hq, d), (int(ck[-1]), hkv, d), (int(ck[-1]), hkv, d))
        dims = (len(seqlens), max(s[0] for s in seqlens), max(s[1] for s in seqlens))
        kw.update(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=dims[1], max_seqlen_k=dims[2])
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in shapes)
    return q, k, v, kw, dims


def _grads(fn, q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_the_reference_with_the_kernels_mask(name):
    p, seed = 0.3, 1234
    q, k, v, kw, (b, sq, sk) = _inputs(CASES[name])
    mask = ref.attention_dropout_mask(seed, b, q.shape[-2], sq, sk, p)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(9))
    ours = _grads(lambda *a: flash_attention(*a, dropout_p=p, seed=seed, **kw), q, k, v, dout)
    naive = _grads(lambda *a: naive_torch(*a, dropout_mask=mask, dropout_p=p, **kw)[0], q, k, v, dout)
    ref_kw = {n: (a.numpy() if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    r_out, r_lse = ref.flash_attention(np64(q), np64(k), np64(v), dropout_mask=mask, dropout_p=p, **ref_kw)
    r_grads = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), dropout_mask=mask, dropout_p=p,
                                      **ref_kw)[:3]
    for what, a, r, n in zip(("out", "dq", "dk", "dv"), ours, (r_out, *r_grads), naive):
        assert_close(a, r, n, name=what)
    # lse is the undropped softmax's
    _, lse = flash_attention(q, k, v, dropout_p=p, seed=seed, return_lse=True, **kw)
    np.testing.assert_allclose(lse.numpy(), r_lse, rtol=1e-5, atol=1e-5)


def _kernel_mask(seed, b, s, h, p, *, framework="torch"):
    """The kernel's keep-mask (b, h, s, s), read back with values = identity (Dv = Sk): out[b, i, h, j] =
    p_ij * keep_ij / (1 - p), nonzero exactly where kept (no mask: every p_ij > 0)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, s, h, 16, generator=g) * 0.1
    k = torch.randn(b, s, h, 16, generator=g) * 0.1
    v = torch.eye(s).expand(b, h, s, s).transpose(1, 2).contiguous()  # v[b, j, h, :] = e_j
    if framework == "jax":
        from flashbridge import jax_api
        out = np.asarray(jax_api.flash_attention(*map(torch_to_jax, (q, k, v)), dropout_p=p, seed=seed))
    else:
        out = flash_attention(q, k, v, dropout_p=p, seed=seed).numpy()
    return np.transpose(out != 0, (0, 2, 1, 3))


def test_kernel_mask_is_the_reference_generators_and_the_same_in_both_frameworks():
    b, s, h, p, seed = 2, 32, 2, 0.25, 77
    expected = ref.attention_dropout_mask(seed, b, h, s, s, p)
    assert np.array_equal(_kernel_mask(seed, b, s, h, p), expected)
    assert np.array_equal(_kernel_mask(seed, b, s, h, p, framework="jax"), expected)


# (block_m, block_n) of the forward, (dkdv_block_m, dkdv_block_n), (dq_block_m, dq_block_n): the mask and the
# gradients must not depend on them
TILES = [AttentionConfig(block_m=16, block_n=32, dkdv_block_m=32, dkdv_block_n=16, dq_block_m=16, dq_block_n=64,
                         masked_block_n=16),
         AttentionConfig(block_m=32, block_n=16, dkdv_block_m=16, dkdv_block_n=64, dq_block_m=64, dq_block_n=16,
                         fused_backward=False)]


@pytest.mark.parametrize("config", TILES, ids=["tiles-a", "tiles-b"])
def test_mask_and_gradients_do_not_depend_on_the_tiles(config):
    b, s, h, p, seed = 1, 48, 2, 0.4, 31
    with configure(config):
        assert np.array_equal(_kernel_mask(seed, b, s, h, p), ref.attention_dropout_mask(seed, b, h, s, s, p))
        q, k, v, kw, (b, sq, sk) = _inputs(CASES["gqa-causal"], seed=4)
        mask = ref.attention_dropout_mask(seed, b, q.shape[-2], sq, sk, p)
        dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(5))
        ours = _grads(lambda *a: flash_attention(*a, dropout_p=p, seed=seed, **kw), q, k, v, dout)
    naive = _grads(lambda *a: naive_torch(*a, dropout_mask=mask, dropout_p=p, **kw)[0], q, k, v, dout)
    r_out, _ = ref.flash_attention(np64(q), np64(k), np64(v), dropout_mask=mask, dropout_p=p, **kw)
    r_grads = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), dropout_mask=mask, dropout_p=p,
                                      **kw)[:3]
    for what, a, r, n in zip(("out", "dq", "dk", "dv"), ours, (r_out, *r_grads), naive):
        assert_close(a, r, n, name=what)


def test_mask_is_one_philox_call_per_16_elements_and_depends_on_no_length():
    """Element (b, h, i, j) is byte 8 i3 + 4 j3 + 2 i0 + j0 (bits 3 and 0) of Philox-4x32-7 with counter
    (i & ~9, j & ~9, h, b), byte k of a call being byte k % 4 of word k // 4, least significant first."""
    seed, p = -9, 0.3
    t = ref.attention_dropout_threshold(p)
    full = ref.attention_dropout_mask(seed, 2, 3, 48, 40, p)
    assert np.array_equal(ref.attention_dropout_mask(seed, 2, 3, 20, 17, p), full[:, :, :20, :17])
    for b, h, i, j in [(0, 0, 0, 0), (1, 2, 9, 25), (1, 1, 47, 39), (0, 2, 18, 3), (1, 0, 7, 8)]:
        byte = 8 * (i >> 3 & 1) + 4 * (j >> 3 & 1) + 2 * (i & 1) + (j & 1)
        word = int(philox4x32(seed, i & ~9, j & ~9, h, b, rounds=7)[byte // 4])
        assert full[b, h, i, j] == ((word >> 8 * (byte % 4) & 255) >= t)


def test_applied_rate_is_p_rounded_to_a_256th():
    assert ref.attention_dropout_threshold(0.1) == 26 and ref.attention_dropout_rate(0.1) == 26 / 256
    assert ref.attention_dropout_threshold(1 / 512) == 1  # halves up
    assert ref.attention_dropout_threshold(np.nextafter(np.float32(1 / 512), np.float32(0))) == 0  # p in float32
    assert ref.attention_dropout_threshold(0.0) == 0 and ref.attention_dropout_threshold(0.99) == 253
    # the largest accepted p rounds to 255/256; the plan check refuses exactly the ones that round to 1
    assert ref.attention_dropout_threshold(np.nextafter(DROPOUT_P_ROUNDS_TO_ONE, 0)) == 255
    assert ref.attention_dropout_threshold(DROPOUT_P_ROUNDS_TO_ONE) == 256
    check_dropout(float(np.nextafter(DROPOUT_P_ROUNDS_TO_ONE, 0)), True)
    with pytest.raises(ValueError, match="dropout_p: must be below 511/512"):
        check_dropout(DROPOUT_P_ROUNDS_TO_ONE, True)
    # the kernels: p and its rounded value draw the same mask and the same scale 1 / (1 - p_q)
    q, k, v, kw, _ = _inputs(CASES["dense"])
    assert torch.equal(flash_attention(q, k, v, dropout_p=0.1, seed=3), flash_attention(q, k, v, dropout_p=26 / 256,
                                                                                           seed=3))
    out = flash_attention(q, k, v, dropout_p=0.995, seed=3)  # 255 / 256: 1 in 256 kept, scaled by 256
    r_out, _ = ref.flash_attention(np64(q), np64(k), np64(v), dropout_p=0.995,
                                   dropout_mask=ref.attention_dropout_mask(3, 2, 2, 17, 33, 0.995))
    np.testing.assert_allclose(out.numpy(), r_out, rtol=1e-4, atol=1e-4)


def test_keep_rate_and_seeds():
    p = 0.2
    kept = 1 - ref.attention_dropout_rate(p)  # 205 / 256
    big = ref.attention_dropout_mask(5, 4, 8, 128, 256, p)  # 1M draws
    assert abs(big.mean() - kept) < 2e-3
    kernel = _kernel_mask(5, 2, 64, 2, p)
    assert abs(kernel.mean() - kept) < 0.02
    assert np.array_equal(kernel, ref.attention_dropout_mask(5, 2, 2, 64, 64, p))
    # the same seed, the same mask (an int or a tensor); another seed, another mask
    q, k, v, kw, _ = _inputs(CASES["dense"])
    a = flash_attention(q, k, v, dropout_p=p, seed=11)
    assert torch.equal(a, flash_attention(q, k, v, dropout_p=p, seed=torch.tensor([11], dtype=torch.int32)))
    assert torch.equal(a, flash_attention(q, k, v, dropout_p=p, seed=torch.tensor(11)))
    assert not torch.equal(a, flash_attention(q, k, v, dropout_p=p, seed=12))
    assert not np.array_equal(ref.attention_dropout_mask(11, 2, 2, 17, 33, p),
                              ref.attention_dropout_mask(12, 2, 2, 17, 33, p))


@pytest.mark.parametrize("a_rows", [True, False])
def test_keep16_is_the_documented_lattice_and_its_philox_is_tl_philox(a_rows):
    """The generator helper itself, through the interpreter, at counters near 2**31 (the GPU suite runs the
    same probe compiled)."""
    check_keep16("cpu", a_rows)


def test_numpy_philox_is_tl_rand():
    # a few known words of Triton's tl.rand (checked against the interpreter when this generator was written)
    u = philox_uniform(0, np.arange(4, dtype=np.int64))
    assert u.dtype == np.float32 and np.all((u >= 0) & (u < 1))
    assert np.array_equal(philox_uniform(0, np.arange(4)), u)  # deterministic
    assert not np.array_equal(philox_uniform(1, np.arange(4)), u)
    hi = philox_uniform(3, np.array([5_000_000_000, 5_000_000_000 + 2**32]))
    assert hi[0] != hi[1]  # the offset's high word reaches the counter


def test_torch_and_jax_give_the_same_bits_forward_and_backward():
    import jax
    import jax.numpy as jnp

    from flashbridge import jax_api

    q, k, v, kw, _ = _inputs(CASES["gqa-causal"])
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(2))
    t = _grads(lambda *a: flash_attention(*a, dropout_p=0.1, seed=99, **kw), q, k, v, dout)
    jdout = torch_to_jax(dout)

    def loss(q, k, v):
        return jnp.vdot(jax_api.flash_attention(q, k, v, dropout_p=0.1, seed=jnp.int32(99), **kw), jdout)

    jq, jk, jv = map(torch_to_jax, (q, k, v))
    j_out = jax_api.flash_attention(jq, jk, jv, dropout_p=0.1, seed=99, **kw)
    j_grads = jax.grad(loss, argnums=(0, 1, 2))(jq, jk, jv)
    for a, b in zip(t, (j_out, *j_grads)):
        assert np.array_equal(a.detach().numpy(), np.asarray(b))


def test_jax_vmap_maps_dropout_one_example_at_a_time():
    import jax

    from flashbridge import jax_api

    q, k, v, _, _ = _inputs(CASES["dense"])
    jq, jk, jv = map(torch_to_jax, (q, k, v))
    mapped = jax.vmap(lambda q, k, v: jax_api.flash_attention(q[None], k[None], v[None], dropout_p=0.5,
                                                              seed=4)[0])(jq, jk, jv)
    for i in range(q.shape[0]):
        one = jax_api.flash_attention(jq[i:i + 1], jk[i:i + 1], jv[i:i + 1], dropout_p=0.5, seed=4)[0]
        assert np.array_equal(np.asarray(mapped[i]), np.asarray(one))


def test_dropout_zero_is_the_kernel_without_dropout():
    q, k, v, kw, _ = _inputs(CASES["gqa-causal"])
    dout = torch.randn(*q.shape[:-1], v.shape[-1], generator=torch.Generator().manual_seed(2))
    plain = _grads(lambda *a: flash_attention(*a, **kw), q, k, v, dout)
    zero = _grads(lambda *a: flash_attention(*a, dropout_p=0.0, seed=3, **kw), q, k, v, dout)
    for a, b in zip(plain, zero):
        assert torch.equal(a, b)
    shape = AttnShape(1, 40, 40, 40, 40, 4, 2, 32, 32, "float32", False)
    options = AttnOptions(softmax_scale=0.2, causal=True, window_left=None, window_right=0, softcap=0.0,
                          has_alibi=False, alibi_batched=False, has_sinks=False)
    for plan in (plan_attention_fwd(shape, options, target=INTERPRETER),
                 plan_attention_bwd(shape, options, target=INTERPRETER)):
        assert "seed" not in plan.inputs
        for launch in plan.launches:
            assert dict(launch.constexprs).get("HAS_DROPOUT", False) is False


def test_sdpa_drop_in_draws_its_seed_from_torchs_generator():
    q, k, v = (torch.randn(1, 2, 24, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch.manual_seed(123)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.4, is_causal=True)
    torch.manual_seed(123)
    seed = torch.randint(-2**31, 2**31 - 1, (1,), dtype=torch.int32)
    # top-left causal == bottom-right for square inputs
    expected = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                               dropout_p=0.4, seed=seed).transpose(1, 2)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_dropout_argument_errors(framework):
    if framework == "jax":
        from flashbridge import jax_api as api
        q = torch_to_jax(torch.randn(1, 8, 2, 16))
    else:
        import flashbridge.torch_api as api
        q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="seed: required"):
        api.flash_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p: must be in \[0, 1\)"):
        api.flash_attention(q, q, q, dropout_p=1.0, seed=1)
    with pytest.raises(ValueError, match="dropout_p: must be below 511/512"):
        api.flash_attention(q, q, q, dropout_p=0.999, seed=1)
    with pytest.raises(TypeError, match="dropout_p"):
        api.flash_attention(q, q, q, dropout_p="0.1", seed=1)
    with pytest.raises(TypeError, match="seed"):
        api.flash_attention(q, q, q, dropout_p=0.1, seed=1.5)
    with pytest.raises(ValueError, match="seed"):
        api.flash_attention(q, q, q, dropout_p=0.1, seed=2**40)


def test_torch_compile_fullgraph_with_a_seed_tensor():
    q, k, v, kw, _ = _inputs(CASES["dense"])
    seed = torch.tensor([21], dtype=torch.int32)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]

    def f(q, k, v, seed):
        return flash_attention(q, k, v, dropout_p=0.25, seed=seed).square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(*leaves, seed)
    grads = torch.autograd.grad(loss, leaves)
    eager_loss = f(*leaves, seed)
    eager = torch.autograd.grad(eager_loss, leaves)
    assert torch.equal(loss, eager_loss)
    for a, b in zip(grads, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["streaming", pytest.param("bits", marks=pytest.mark.slow)])
def test_block_mask_walks_draw_the_same_mask(kind):
    """The block-sparse list walks (forward and both backward loops) apply the dense kernels' mask; JAX gives
    torch's bits."""
    from flashbridge import masks

    s, h, d, p, seed = 80, 2, 16, 0.3, 5
    if kind == "streaming":
        m = masks.streaming(s, 4, 24, block_size=16)
    else:
        rng = np.random.default_rng(0)
        m = masks.from_dense(rng.random((s, s)) < 0.6, block_size=16)
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, s, h, d, generator=g) for _ in range(4))
    keep = ref.attention_dropout_mask(seed, 1, h, s, s, p)
    dense = np.asarray(m.to_dense())
    ours = _grads(lambda *a: flash_attention(*a, block_mask=m, dropout_p=p, seed=seed), q, k, v, dout)
    r_out, _ = ref.flash_attention(np64(q), np64(k), np64(v), mask=dense, dropout_mask=keep, dropout_p=p)
    r_grads = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), mask=dense, dropout_mask=keep,
                                      dropout_p=p)[:3]
    for what, a, r in zip(("out", "dq", "dk", "dv"), ours, (r_out, *r_grads)):
        np.testing.assert_allclose(a.detach().numpy(), r, rtol=1e-4, atol=2e-5, err_msg=what)
    if kind == "streaming":
        import jax
        import jax.numpy as jnp

        from flashbridge import jax_api

        jdout = torch_to_jax(dout)

        def loss(*a):
            o = jax_api.flash_attention(*a, block_mask=m, dropout_p=p, seed=seed)
            return jnp.vdot(o, jdout), o

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        (_, j_out), j_grads = grad_fn(*map(torch_to_jax, (q, k, v)))
        for a, b in zip(ours, (j_out, *j_grads)):
            assert np.array_equal(a.detach().numpy(), np.asarray(b))


def test_torch_opcheck_with_dropout():
    from flashbridge.torch_api.attention import _flash_attn_bwd, _flash_attn_fwd

    q, k, v, _, _ = _inputs(CASES["dense"])
    seed = torch.tensor([3], dtype=torch.int32)
    args = (q.requires_grad_(), k, v, None, None, None, None, None, None, 0.25, False, None, None, 0.0, seed, 0.2)
    torch.library.opcheck(_flash_attn_fwd.custom_op, args)
    out, lse = _flash_attn_fwd(*args)
    bwd_args = (torch.randn_like(out), q.detach(), k, v, out.detach(), lse.detach(), None, None, None, None, None,
                None, None, 0.25, False, None, None, 0.0, False, seed, 0.2)
    torch.library.opcheck(_flash_attn_bwd.custom_op, bwd_args)


def test_multihead_attention_dropout_in_training_mode():
    import flashbridge.torch_api as ft

    mha = ft.MultiheadAttention(32, 2, dropout=0.3, batch_first=True)
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    a, _ = mha.train()(x, x, x, need_weights=False)
    torch.manual_seed(5)
    b, _ = mha(x, x, x, need_weights=False)
    c, _ = mha(x, x, x, need_weights=False)
    plain, _ = mha.eval()(x, x, x, need_weights=False)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, plain)


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_kernels_keep_the_mask_out_of_shared_memory(causal):
    """Compiled for sm_90 without a GPU (the resource model's machinery, tests/test_tiles.py): with dropout the
    D=128 bf16 forward and backward allocate exactly the shared memory they do without it. The generator is
    laid out on the accumulator's registers; had Triton instead drawn it in another layout and moved the
    words through shared memory, the forward (224 of 227 KB without dropout) would no longer launch."""
    import dataclasses

    from flashbridge.core_kernels import Target
    from flashbridge.core_kernels.flash_attn.plan import check_attention_args
    from flashbridge.tiles import compiled

    why = compiled.available(90)
    if why:
        pytest.skip(why)
    info = ((2, 4096, 16, 128), "bfloat16")
    shape, options = check_attention_args(q=info, k=info, v=info, causal=causal)
    dtypes = {n: "bfloat16" for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv")}
    dtypes["seed"] = "int32"
    target = Target(False, 132)
    for plan_fn in (plan_attention_fwd, plan_attention_bwd):
        plain = plan_fn(shape, options, target=target).launches
        drop = plan_fn(shape, dataclasses.replace(options, dropout_p=0.1), target=target).launches
        for a, b in zip(plain, drop):
            if "dropout_p" not in dict(b.scalars):
                continue
            assert compiled.compile_launch(b, dtypes).shared == compiled.compile_launch(a, dtypes).shared, b.kernel
