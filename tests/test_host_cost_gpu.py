"""The direct compiled-kernel launch and the replayed eager calls on a CUDA GPU: the same bits as
JITFunction.run and as the implementation run in full for an op of every family, under CUDA-graph capture
too, and a misaligned view gets a kernel of its own; JAX eager calls give the bits of the call inside
jax.jit (skipped without a GPU)."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from flashbridge import masks  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402
from flashbridge.core_kernels import _loader  # noqa: E402
from helpers import JAX_HOST_FAMILIES, assert_jax_eager_matches_jit, jax_host_cases  # noqa: E402


def _rand(seed, *shape, dtype=torch.bfloat16, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    return t.requires_grad_() if grad else t


def _cases():
    x, w = _rand(1, 64, 1024, grad=True), _rand(2, 1024, grad=True)
    q, k, v = (_rand(3 + i, 1, 128, 16, 64, grad=True) for i in range(3))
    qd, kc, vc = _rand(6, 4, 1, 32, 128), _rand(7, 4, 4096, 8, 128), _rand(8, 4, 4096, 8, 128)
    lens = torch.tensor([4096, 17, 1000, 3000], dtype=torch.int32, device="cuda")
    logits = _rand(9, 256, 32000, grad=True)
    labels = torch.randint(0, 32000, (256,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    g, u = _rand(10, 64, 4096, grad=True), _rand(11, 64, 4096, grad=True)
    xr, cos, sin = _rand(12, 1, 128, 16, 128, grad=True), _rand(13, 128, 64), _rand(14, 128, 64)

    def norm():
        y = ft.rms_norm(x, w)
        return (y, *torch.autograd.grad(y, (x, w), y.detach()))

    def attention():
        o = ft.flash_attention(q, k, v, causal=True)
        return (o, *torch.autograd.grad(o, (q, k, v), o.detach()))

    sparse_mask = (masks.document([50, 78], block_size=64)
                   & masks.from_dense(np.random.default_rng(0).random((128, 128)) < 0.8, block_size=64))

    def block_sparse():
        o = ft.flash_attention(q, k, v, block_mask=sparse_mask)
        return (o, *torch.autograd.grad(o, (q, k, v), o.detach()))

    def dec():
        return (ft.decode_attention(qd, kc, vc, cache_seqlens=lens),)

    def ce():
        loss = ft.cross_entropy(logits, labels)
        return (loss, *torch.autograd.grad(loss, (logits,)))

    def swiglu():
        y = ft.swiglu(g, u)
        return (y, *torch.autograd.grad(y, (g, u), y.detach()))

    def rotary():
        y = ft.rotary_embedding(xr, cos, sin)
        return (y, *torch.autograd.grad(y, (xr,), y.detach()))

    return {"norms": norm, "attention": attention, "block_sparse": block_sparse, "decode": dec, "cross_entropy": ce, "swiglu": swiglu,
            "rotary": rotary}


@pytest.fixture
def run_path(monkeypatch):
    """Every compiled launch through JITFunction.run while it is active."""
    def use(flag: bool):
        monkeypatch.setattr(_loader, "fast_launch", flag)
    return use


@pytest.mark.parametrize("family", ["norms", "attention", "block_sparse", "decode", "cross_entropy", "swiglu",
                                    "rotary"])
def test_direct_launch_gives_the_bits_of_jitfunction_run(family, run_path):
    call = _cases()[family]
    run_path(False)
    by_run = call()
    run_path(True)
    call()  # binds the compiled kernels
    direct = call()
    torch.cuda.synchronize()
    for a, b in zip(direct, by_run):
        assert torch.equal(a, b), family


@pytest.mark.parametrize("family", ["norms", "attention", "block_sparse", "decode", "cross_entropy", "swiglu",
                                    "rotary"])
def test_replayed_calls_give_the_bits_of_the_full_implementation(family, monkeypatch):
    from flashbridge.torch_api._ops import FusedOp

    call = _cases()[family]
    monkeypatch.setattr(FusedOp, "replay", False)
    full = call()
    monkeypatch.setattr(FusedOp, "replay", True)
    call()  # records
    replayed = call()
    monkeypatch.setattr(FusedOp, "eager_fast_path", False)
    dispatched = call()
    torch.cuda.synchronize()
    for a, b, c in zip(replayed, full, dispatched):
        assert torch.equal(a, b) and torch.equal(a, c), family


def test_a_replayed_call_still_refuses_an_fp8_cache_off_a_2_byte_boundary():
    """The implementation checks the FP8 cache's start address; a view of the same shape and strides one
    byte off is another signature, so the check runs again instead of a replay."""
    g = torch.Generator(device="cuda").manual_seed(11)
    base = torch.randn(1, 256, 2, 68, device="cuda", generator=g).to(torch.float8_e4m3fn)
    q = torch.randn(1, 1, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([200], device="cuda", dtype=torch.int32)
    k = base[..., 4:68]
    for _ in range(2):  # records, then replays
        ft.decode_attention(q, k, base[..., 2:66], cache_seqlens=lens)
    with pytest.raises(ValueError, match="v_cache: an FP8 cache"):
        ft.decode_attention(q, k, base[..., 1:65], cache_seqlens=lens)


def test_replays_are_recorded_for_the_hot_ops():
    import importlib

    attention, block_sparse, cross_entropy, decode, norms = (
        importlib.import_module(f"flashbridge.torch_api.{m}")
        for m in ("attention", "block_sparse", "cross_entropy", "decode", "norms"))
    for family in ("norms", "attention", "block_sparse", "decode", "cross_entropy"):
        _cases()[family]()
    for op in (norms._norm_fwd, norms._norm_bwd, attention._flash_attn_fwd, attention._flash_attn_bwd,
               block_sparse._sparse_fwd, block_sparse._sparse_bwd, decode._decode_attn, cross_entropy._ce_fwd, cross_entropy._ce_bwd, cross_entropy._ce_mean_scales,
               cross_entropy._ce_total):
        assert any(r is not None for r in op.replays.values()), op.name


def test_direct_launch_is_taken_and_captured_in_a_cuda_graph():
    x, w = _rand(1, 64, 1024), _rand(2, 1024)
    expected = ft.rms_norm(x, w)
    ft.rms_norm(x, w)
    launches = [p for p in _bound_launches() if p.kernels]
    assert launches, "no launch went through the compiled kernel directly"
    out = torch.empty_like(expected)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ft.rms_norm(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out.copy_(ft.rms_norm(x, w))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


def _bound_launches():
    import gc

    from flashbridge.core_kernels._loader import BoundLaunch

    return [o for o in gc.get_objects() if isinstance(o, BoundLaunch)]


def test_misaligned_view_gets_its_own_kernel_and_the_right_values():
    x = _rand(1, 64 * 1024 + 1)
    w = _rand(2, 1024)
    aligned, shifted = x[:64 * 1024].view(64, 1024), x[1:].view(64, 1024)  # 2 bytes past 16-byte alignment
    for t in (aligned, shifted, aligned, shifted):
        y = ft.rms_norm(t, w)
        ref = torch.nn.functional.rms_norm(t.float(), (1024,), w.float(), 1e-6)
        torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", JAX_HOST_FAMILIES)
def test_jax_eager_call_gives_the_bits_of_the_call_inside_jit_on_the_gpu(family, dtype):
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    with jax.default_device(gpu):
        op, arrays, cotangent = jax_host_cases(dtype)[family]
        assert all(a.devices() == {gpu} for a in arrays)
        assert_jax_eager_matches_jit(op, arrays, cotangent, name=family)
