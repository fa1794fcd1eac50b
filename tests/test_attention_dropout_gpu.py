"""Attention dropout on a CUDA GPU (skipped without one): the keep-mask the GPU kernels draw is the CPU
interpreter's and the NumPy generator's (``reference.attention.attention_dropout_mask``) in both frameworks,
and bf16 forward / gradients at realistic sizes match the attention computed plainly in float64 with that
mask (error <= 2 x the same computation's error in bf16 + a floor); torch and JAX give the same bits.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashbridge.reference import attention as ref
from helpers import assert_close, check_keep16, naive_torch, torch_to_jax

pytestmark = pytest.mark.gpu


def _jax_api():
    try:
        from flashbridge import jax_api
        from flashbridge.jax_api._runtime import _jax_triton
        _jax_triton()
    except ImportError:
        return None
    return jax_api


def _kernel_mask(device, seed, b, s, h, p, framework="torch", dtype=torch.float32, d=16):
    """The kernel's keep-mask (b, h, s, s), read back with values = identity (out[b, i, h, j] = p_ij * keep_ij /
    (1 - p_q): nonzero exactly where kept). bf16 inputs take the large GPU tiles, float32 the small ones."""
    from flashbridge.torch_api import flash_attention

    g = torch.Generator().manual_seed(3)
    q = (torch.randn(b, s, h, d, generator=g) * 0.1).to(device, dtype)
    k = (torch.randn(b, s, h, d, generator=g) * 0.1).to(device, dtype)
    v = torch.eye(s).expand(b, h, s, s).transpose(1, 2).contiguous().to(device, dtype)
    if framework == "jax":
        out = np.asarray(_jax_api().flash_attention(*map(torch_to_jax, (q, k, v)), dropout_p=p, seed=seed))
    else:
        out = flash_attention(q, k, v, dropout_p=p, seed=seed).float().cpu().numpy()
    return np.transpose(out != 0, (0, 2, 1, 3))


@pytest.mark.parametrize("seed", [0, 77, -5, 2**31 - 1])
def test_gpu_mask_is_the_cpu_interpreters_and_the_generators(seed):
    b, s, h, p = 2, 64, 3, 0.2
    expected = ref.attention_dropout_mask(seed, b, h, s, s, p)
    gpu = _kernel_mask("cuda", seed, b, s, h, p)
    assert np.array_equal(gpu, expected)
    assert np.array_equal(gpu, _kernel_mask("cpu", seed, b, s, h, p))
    if _jax_api() is not None:
        assert np.array_equal(_kernel_mask("cuda", seed, b, s, h, p, framework="jax"), expected)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_mask_with_the_bf16_tiles(d):
    """bf16 takes the large tiles (forward 128 x 128 at D=128, a 64-key masked block, ...), where the
    generator is laid out on the tensor cores' accumulator: the mask is still the generator's, in every
    orientation the forward and the backward use (the backward's gradients check the latter below)."""
    b, s, h, p, seed = 1, 240, 2, 0.3, 2024  # 240 keys: two query tiles and a ragged last key block (Dv = s)
    expected = ref.attention_dropout_mask(seed, b, h, s, s, p)
    assert np.array_equal(_kernel_mask("cuda", seed, b, s, h, p, dtype=torch.bfloat16, d=d), expected)
    if _jax_api() is not None:
        assert np.array_equal(_kernel_mask("cuda", seed, b, s, h, p, framework="jax", dtype=torch.bfloat16, d=d),
                              expected)


@pytest.mark.parametrize("case", [
    dict(b=2, s=1024, hq=8, hkv=2, causal=True),
    dict(b=1, s=777, hq=4, hkv=4, causal=False, window_size=(128, 64)),
    dict(seqlens=[300, 1024, 17], hq=8, hkv=1, causal=True),
], ids=["gqa-causal", "window-odd", "varlen"])
def test_dropout_bf16_forward_and_gradients(case):
    from flashbridge.torch_api import flash_attention

    p, seed, d = 0.1, 4321, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv = case["hq"], case["hkv"]
    kw = dict(causal=case["causal"])
    if "window_size" in case:
        kw["window_size"] = case["window_size"]
    if "seqlens" in case:
        lens = case["seqlens"]
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
        shapes = ((sum(lens), hq, d), (sum(lens), hkv, d))
        dims = (len(lens), max(lens), max(lens))
    else:
        shapes = ((case["b"], case["s"], hq, d), (case["b"], case["s"], hkv, d))
        dims = (case["b"], case["s"], case["s"])
    q = torch.randn(shapes[0], generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(shapes[1], generator=g, device="cuda").bfloat16() for _ in range(2))
    dout = torch.randn(q.shape, generator=g, device="cuda").bfloat16()
    mask = ref.attention_dropout_mask(seed, dims[0], hq, dims[1], dims[2], p)

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))

    ours = grads(lambda *a: flash_attention(*a, dropout_p=p, seed=seed, **kw), torch.bfloat16)
    want = grads(lambda *a: naive_torch(*a, dropout_mask=mask, dropout_p=p, **kw)[0], torch.float64)
    naive = grads(lambda *a: naive_torch(*a, dropout_mask=mask, dropout_p=p, **kw)[0], torch.bfloat16)
    for name, a, w, n in zip(("out", "dq", "dk", "dv"), ours, want, naive):
        assert_close(a, w, n, name=name, floor=1e-3)
    again = grads(lambda *a: flash_attention(*a, dropout_p=p, seed=seed, **kw), torch.bfloat16)
    for a, b in zip(ours, again):  # deterministic
        assert torch.equal(a, b)
    jax_api = _jax_api()
    if jax_api is None:
        return
    import jax
    import jax.numpy as jnp

    jkw = {n: torch_to_jax(t) for n, t in kw.items()}
    jq, jk, jv, jdout = map(torch_to_jax, (q, k, v, dout))

    def loss(q_, k_, v_):
        o = jax_api.flash_attention(q_, k_, v_, dropout_p=p, seed=seed, **jkw)
        return jnp.sum(o.astype(jnp.float32) * jdout.astype(jnp.float32)), o

    (_, j_out), j_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(jq, jk, jv)
    for a, b in zip(ours, (j_out, *j_grads)):
        assert np.array_equal(np.asarray(b.astype(jnp.float32)), a.detach().float().cpu().numpy())


def test_gpu_generator_matches_numpy_past_32_bit_offsets():
    """Large batches reach offsets past 2**32 (B * H * Sq * Sk): the Triton build on the GPU must put the
    offset's high word into the counter as ``reference.random.philox_uniform`` does."""
    import triton
    import triton.language as tl

    from flashbridge.core_kernels._random import dropout_keep
    from flashbridge.reference.random import philox_uniform

    @triton.jit
    def keep_kernel(SEED, OUT, base, N: tl.constexpr):
        offs = base + tl.arange(0, N).to(tl.int64)
        tl.store(OUT + tl.arange(0, N), dropout_keep(tl.load(SEED), offs, 0.5).to(tl.int8))

    for seed, base in ((7, 0), (7, 5_000_000_000), (-3, 2**40 + 123)):
        out = torch.empty(256, dtype=torch.int8, device="cuda")
        keep_kernel[(1,)](torch.tensor([seed], dtype=torch.int32, device="cuda"), out, base, 256)
        expected = philox_uniform(seed, base + np.arange(256, dtype=np.int64)) >= np.float32(0.5)
        assert np.array_equal(out.cpu().numpy().astype(bool), expected)


@pytest.mark.parametrize("a_rows", [True, False])
def test_gpu_keep16_is_the_documented_lattice_and_its_philox_is_tl_philox(a_rows):
    """keep16 compiled (the CPU suite runs the same probe interpreted): the documented byte of Philox-4x32-7
    in both orientations at counters near 2**31, and its widening-multiply rounds equal tl.philox's."""
    check_keep16("cuda", a_rows)
