"""The eager fast path of torch_api/_ops.py against the dispatcher path: same values, same gradients,
bit for bit, for one op of every family (CPU, interpreter); and a dispatch mode sees the dispatcher path."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashbridge import torch_api as ft  # noqa: E402
from flashbridge.torch_api import _ops  # noqa: E402


def _inputs(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float32) for s in shapes]


def _norm(requires_grad):
    x, w, r = _inputs(1, (5, 33), (33,), (5, 33))
    params = [t.requires_grad_(requires_grad) for t in (x, w, r)]
    y, h = ft.rms_norm(x, w, residual=r)
    return (y, h), params, (y.sum() + 0.5 * (h * h).sum()) if requires_grad else None


def _attention(requires_grad):
    q, k, v, sinks = _inputs(2, (1, 9, 4, 16), (1, 11, 2, 16), (1, 11, 2, 16), (4,))
    params = [t.requires_grad_(requires_grad) for t in (q, k, v, sinks)]
    out = ft.flash_attention(q, k, v, causal=True, sinks=sinks)
    return (out,), params, (out * out).sum() if requires_grad else None


def _linear_ce(requires_grad):
    h, w = _inputs(3, (7, 16), (37, 16))
    labels = torch.tensor([0, 5, -100, 36, 2, 2, 9])
    params = [t.requires_grad_(requires_grad) for t in (h, w)]
    loss = ft.linear_cross_entropy(h, w, labels, label_smoothing=0.1, chunk_size=3)
    return (loss,), params, loss if requires_grad else None


def _decode(requires_grad):
    q, k, v = _inputs(4, (2, 1, 4, 16), (2, 20, 2, 16), (2, 20, 2, 16))
    out = ft.decode_attention(q, k, v, cache_seqlens=torch.tensor([20, 7], dtype=torch.int32), num_splits=2)
    return (out,), [], None


def _rotary(requires_grad):
    q, k, cos, sin = _inputs(8, (2, 9, 4, 16), (2, 9, 2, 16), (12, 6), (12, 6))
    params = [t.requires_grad_(requires_grad) for t in (q, k)]
    q2, k2 = ft.rotary_embedding_qk(q, k, cos, sin, position_ids=torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5]]))
    if requires_grad:
        return (q2, k2), params, (q2 * q2.cos()).sum() + k2.sum()
    x = q.clone()  # no gradient: the in-place op, through the kernel
    ft.rotary_embedding(x, cos, sin, inplace=True, interleaved=True)
    return (q2, k2, x), params, None


def _swiglu(requires_grad):
    x, g, u = _inputs(9, (5, 2, 34), (3, 17), (3, 17))
    params = [t.requires_grad_(requires_grad) for t in (x, g, u)]
    y1, y2 = ft.swiglu(x), ft.swiglu(g, u)
    return (y1, y2), params, (y1 * y1).sum() + (y2 * y2.sin()).sum() if requires_grad else None


FAMILIES = {"norms": _norm, "attention": _attention, "cross_entropy": _linear_ce, "decode": _decode,
            "rotary": _rotary, "swiglu": _swiglu}


def _run(fn, fast, requires_grad):
    old = _ops.FusedOp.eager_fast_path
    _ops.FusedOp.eager_fast_path = fast
    try:
        outs, params, loss = fn(requires_grad)
        grads = torch.autograd.grad(loss, params) if loss is not None else ()
    finally:
        _ops.FusedOp.eager_fast_path = old
    return [t.detach().numpy() for t in (*outs, *grads)]


@pytest.mark.parametrize("requires_grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.thin(6)
def test_fast_path_matches_dispatcher(family, requires_grad):
    if family == "decode" and requires_grad:
        pytest.skip("decode is forward only")
    fast = _run(FAMILIES[family], True, requires_grad)
    slow = _run(FAMILIES[family], False, requires_grad)
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_retained_graph_runs_backward_twice(reduction):
    """A retained graph runs a node again: needs_input_grad is restored, and linear_cross_entropy (whose
    first backward hands over the gradients computed in the forward) recomputes them the second time."""
    h, w = _inputs(5, (4, 8), (11, 8))
    h.requires_grad_()
    w.requires_grad_()
    loss = ft.linear_cross_entropy(h, w, torch.tensor([1, -100, 3, 4]), reduction=reduction)
    up = torch.tensor([0.5, 2.0, -1.0, 3.0]) if reduction == "none" else torch.tensor(1.5)
    g1 = torch.autograd.grad(loss, (h, w), up, retain_graph=True)
    g2 = torch.autograd.grad(loss, (h, w), up)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_fast_path_only_in_plain_eager(monkeypatch):
    calls = []
    real = _ops._apply_eager_autograd
    monkeypatch.setattr(_ops, "_apply_eager_autograd", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(3, 8, requires_grad=True)
    ft.rms_norm(x)
    assert calls == [1]
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():  # a dispatch mode: the op must go through the dispatcher (fake kernel)
        y = ft.rms_norm(torch.empty(3, 8, requires_grad=True))
    assert calls == [1] and tuple(y.shape) == (3, 8)


def test_execute_into_caller_buffer():
    """execute(out=...): the result is the caller's tensor (here the logits, overwritten by their gradient,
    as linear_cross_entropy does); a buffer of the wrong shape or dtype is refused."""
    from flashbridge.core_kernels import INTERPRETER
    from flashbridge.core_kernels.cross_entropy.plan import plan_ce_fwd_grad
    from flashbridge.torch_api._runtime import execute

    logits, = _inputs(6, (5, 37))
    labels = torch.tensor([0, 36, -100, 3, 3])
    plan = plan_ce_fwd_grad(5, 37, grad_dtype="float32", per_row_weight=False, ignore_index=-100,
                            label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0, target=INTERPRETER)
    inputs = {"logits": logits, "labels": labels, "weight": torch.ones(1)}
    expected = execute(plan, {**inputs, "logits": logits.clone()})[2]
    buffer = logits.clone()
    grad = execute(plan, {**inputs, "logits": buffer}, out={"grad": buffer})[2]
    assert grad is buffer
    np.testing.assert_array_equal(grad.numpy(), expected.numpy())
    with pytest.raises(ValueError, match=r"out\['grad'\]"):
        execute(plan, inputs, out={"grad": torch.empty(5, 36)})


def test_jit_trace_records_the_custom_op():
    """torch.jit.trace sees the dispatcher path: the graph holds flashbridge::norm_fwd, not the kernel's
    allocations."""
    x, w = _inputs(7, (3, 16), (16,))
    traced = torch.jit.trace(lambda a, b: ft.rms_norm(a, b), (x, w))
    assert "flashbridge::norm_fwd" in str(traced.graph)
    np.testing.assert_array_equal(traced(x, w).numpy(), ft.rms_norm(x, w).numpy())


@pytest.mark.parametrize("fast_path", [True, False], ids=["eager", "dispatcher"])
def test_backward_plans_under_the_forward_configs(monkeypatch, fast_path):
    """torch runs a CUDA backward on an autograd worker thread, which sees none of the caller's configure()
    blocks: a backward plans under the configs its forward ran with (here it runs on a thread of its own,
    as the worker does), and configs active around the backward win over those, family by family."""
    import threading

    from helpers import backward_config_spy

    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    seen = backward_config_spy(monkeypatch)
    monkeypatch.setattr(_ops.FusedOp, "eager_fast_path", fast_path)
    q, k, v = (t.requires_grad_() for t in _inputs(4, (1, 40, 2, 16), (1, 40, 2, 16), (1, 40, 2, 16)))
    forward_config, backward_config = AttentionConfig(dkdv_block_m=16), AttentionConfig(dkdv_block_m=32)
    with configure(forward_config):
        out = ft.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    grads = []
    worker = threading.Thread(target=lambda: grads.append(torch.autograd.grad(out, (q, k, v), dout,
                                                                              retain_graph=True)))
    worker.start()
    worker.join()
    assert seen == [forward_config] and len(grads) == 1
    with configure(backward_config):
        again = torch.autograd.grad(out, (q, k, v), dout)
    assert seen == [forward_config, backward_config]
    for a, b in zip(grads[0], again):  # other tiles, the same gradients up to summation order
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)
