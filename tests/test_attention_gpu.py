"""FlashAttention on a CUDA GPU in bf16 at realistic sizes (skipped without a GPU).

Reference: the same attention computed plainly in float64 on the GPU (``naive_torch`` of the CPU suite
in double precision, which is what flashbridge.reference computes, only faster at these sizes); the naive
bf16 implementation sets the tolerance: error <= 2 x its error + a small floor.

``python tests/test_attention_gpu.py`` runs one ragged packed-batch case forward and backward in both
frameworks, for ``compute-sanitizer --tool memcheck``.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import assert_close, backward_config_spy, forward_with_config, naive_torch, np64, torch_to_jax

pytestmark = pytest.mark.gpu

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _inputs(seed, *, b=2, sq=1024, sk=None, hq=8, hkv=None, dqk=128, dv=None, dtype="bfloat16", seqlens=None,
            alibi=False, sinks=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    sk, hkv, dv = sk or sq, hkv or hq, dv or dqk
    dt = DTYPES[dtype]
    kw = {}
    if seqlens is not None:
        lq = [a for a, _ in seqlens]
        lk = [c for _, c in seqlens]
        shapes = ((sum(lq), hq, dqk), (sum(lk), hkv, dqk), (sum(lk), hkv, dv))
        kw["cu_seqlens_q"] = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32, device="cuda")
        kw["cu_seqlens_k"] = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32, device="cuda")
        kw["max_seqlen_q"], kw["max_seqlen_k"] = max(lq), max(lk)
    else:
        shapes = ((b, sq, hq, dqk), (b, sk, hkv, dqk), (b, sk, hkv, dv))
    q, k, v = (torch.randn(s, generator=g, device="cuda").to(dt) for s in shapes)
    if alibi:
        kw["alibi_slopes"] = torch.rand(hq, generator=g, device="cuda") * 0.1
    if sinks:
        kw["sinks"] = torch.randn(hq, generator=g, device="cuda")
    return q, k, v, kw


def _run_naive(q, k, v, kw, options, dout, dtype):
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    nkw = dict(kw)
    if "sinks" in kw:
        leaves.append(kw["sinks"].detach().to(dtype if dtype == torch.float64 else torch.float32)
                      .requires_grad_(True))
        nkw["sinks"] = leaves[3]
    out, lse = naive_torch(*leaves[:3], **nkw, **options)
    grads = torch.autograd.grad((out * dout.to(dtype)).sum(), leaves)
    return out, lse, grads


def check(q, k, v, kw, options, *, floor=1e-3):
    from flashbridge.torch_api.attention import flash_attention
    leaves = [q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)]
    if "sinks" in kw:
        leaves.append(kw["sinks"].requires_grad_(True))
    out, lse = flash_attention(q, k, v, **kw, **options, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    r_out, r_lse, r_grads = _run_naive(q, k, v, kw, options, dout, torch.float64)
    n_out, _, n_grads = _run_naive(q, k, v, kw, options, dout, q.dtype)
    assert_close(out, r_out, n_out, name="out", floor=floor)
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(torch.where(finite, lse.double(), 0.0), torch.where(finite, r_lse, 0.0),
                               atol=1e-3, rtol=1e-4)
    for name, a, r, n in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads, n_grads):
        assert_close(a, r, n, name=name, floor=floor)
    return out, grads


CASES = {
    "d64": (dict(sq=2048, dqk=64), dict()),
    "d64-causal": (dict(sq=2048, dqk=64), dict(causal=True)),  # D=64's causal forward tile differs
    "d128-causal": (dict(sq=2048), dict(causal=True)),
    "d256": (dict(sq=1024, dqk=256), dict()),  # D=256's full backward issues dP^T early (GPU_EARLY_DP)
    "d256-causal": (dict(sq=1024, dqk=256), dict(causal=True)),
    # D=256's dK/dV kernel splits the columns (GPU_DKDV_COL_SPLIT): ragged tails, GQA, a window
    "d256-gqa-ragged": (dict(seqlens=[(1, 1), (17, 17), (700, 700), (300, 1000), (1000, 129)], hq=8, hkv=2,
                             dqk=256), dict(causal=True, window_size=(400, -1))),
    "d80-odd-lengths": (dict(sq=1000, sk=1537, dqk=80), dict(causal=True)),
    "mla-192-128": (dict(sq=1024, dqk=192, dv=128), dict(causal=True)),
    "gqa-32-8": (dict(sq=2048, hq=32, hkv=8), dict(causal=True)),
    "sliding-window": (dict(sq=4096, b=1), dict(causal=True, window_size=(511, 0))),
    "softcap-alibi-sinks": (dict(sq=1024, alibi=True, sinks=True), dict(causal=True, softcap=30.0)),
    "varlen-ragged": (dict(seqlens=[(1, 1), (17, 17), (1000, 1000), (513, 2048), (2048, 100)], hq=16, hkv=4),
                      dict(causal=True)),
    "fp16": (dict(sq=1024, dtype="float16"), dict()),
    "fp32": (dict(sq=512, dqk=64, dtype="float32"), dict(causal=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_torch(name):
    spec, options = CASES[name]
    q, k, v, kw = _inputs(hash(name) % 1000, **spec)
    check(q, k, v, kw, options, floor=1e-5 if spec.get("dtype") == "float32" else 1e-3)


@pytest.mark.parametrize("name", ["d128-causal", "sliding-window", "varlen-ragged", "softcap-alibi-sinks"])
def test_gpu_masked_block_n(name):
    """AttentionConfig.masked_block_n=64 (D=128's masked segments in 64-key blocks inside 128-key tiles):
    forward out and lse against float64 in both runtimes, on the diagonal, window edges and ragged tails."""
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig

    spec, options = CASES[name]
    q, k, v, kw = _inputs(hash(name) % 1000 + 1, **spec)
    plan, runs = forward_with_config(q, k, v, kw, options, AttentionConfig(masked_block_n=64))
    assert plan.launches[0].constexpr_dict()["MASKED_BLOCK_N"] == 64
    dout = torch.randn_like(q[..., :v.shape[-1]])
    r_out, r_lse, _ = _run_naive(q, k, v, kw, options, dout, torch.float64)
    n_out, _, _ = _run_naive(q, k, v, kw, options, dout, q.dtype)
    r_lse = np64(r_lse)
    finite = np.isfinite(r_lse)
    for framework, (out, lse) in runs.items():
        lse = np64(lse)
        assert_close(np64(out), np64(r_out), np64(n_out), name=f"{framework} out", floor=1e-3)
        assert np.array_equal(np.isfinite(lse), finite), f"{framework} lse: -inf pattern differs"
        np.testing.assert_allclose(np.where(finite, lse, 0.0), np.where(finite, r_lse, 0.0), atol=1e-3, rtol=1e-4)


def test_gpu_torch_deterministic():
    from flashbridge.torch_api.attention import flash_attention
    q, k, v, kw = _inputs(1, sq=2048, hq=16, hkv=4, sinks=True)
    leaves = [q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True), kw["sinks"].requires_grad_()]
    dout = torch.randn(2, 2048, 16, 128, device="cuda", dtype=torch.bfloat16)
    runs = [torch.autograd.grad(flash_attention(q, k, v, causal=True, **kw), leaves, dout) for _ in range(3)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("settings", [dict(), dict(head_group=8), dict(head_group=64), dict(fused_backward=False),
                                      dict(head_group=1), dict(early_dp=True), dict(early_dp=False)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_gpu_program_order_and_fused_backward_are_bitwise_identical(settings):
    """AttentionConfig.head_group (program order, block_schedule; default 4 when causal), fused_backward
    (dK/dV and dQ in one launch, the default) and early_dp (the dK/dV loop's product order) on the GPU:
    forward and backward bitwise equal to the grid order and the two backward kernels, GQA causal at a size
    where the order spans many waves of programs."""
    from flashbridge.core_kernels.flash_attn.plan import (AttentionConfig, check_attention_args, plan_attention_bwd,
                                                          plan_attention_fwd)
    from flashbridge.torch_api._runtime import execute, target_for

    q, k, v, _ = _inputs(4, b=2, sq=2048, hq=16, hkv=4)
    dout = torch.randn_like(q)
    shape, options = check_attention_args(q=(tuple(q.shape), "bfloat16"), k=(tuple(k.shape), "bfloat16"),
                                          v=(tuple(v.shape), "bfloat16"), causal=True)
    target = target_for(q.device)

    def run(config):
        out, lse = execute(plan_attention_fwd(shape, options, target=target, config=config), {"q": q, "k": k, "v": v})
        grads = execute(plan_attention_bwd(shape, options, target=target, config=config),
                        {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse})
        return (out, lse, *grads)

    for got, want in zip(run(AttentionConfig(**settings)), run(AttentionConfig(head_group=1, fused_backward=False))):
        assert torch.equal(got, want)


def test_gpu_torch_compile_inductor():
    from flashbridge.torch_api.attention import flash_attention
    q, k, v, _ = _inputs(2, sq=1024, hq=8)
    f = torch.compile(lambda q, k, v: flash_attention(q, k, v, causal=True).float().square().mean(),
                      fullgraph=True)
    for t in (q, k, v):
        t.requires_grad_(True)
    loss = f(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    eager = torch.autograd.grad(flash_attention(q, k, v, causal=True).float().square().mean(), (q, k, v))
    for a, b in zip(grads, eager):
        assert torch.equal(a, b)


def test_gpu_sdpa_drop_in():
    from flashbridge.torch_api.attention import scaled_dot_product_attention
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 16, 1024, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    ref64 = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    naive = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, ref64, naive, name="sdpa", floor=1e-3)


@pytest.mark.parametrize("name", ["d128-causal", "gqa-32-8", "varlen-ragged", "softcap-alibi-sinks", "d256-gqa-ragged"])
def test_gpu_jax_matches_torch_bitwise(name):
    jax = pytest.importorskip("jax")
    if not jax.devices("gpu"):
        pytest.skip("JAX has no GPU backend")
    from flashbridge.jax_api.attention import flash_attention as jfa
    from flashbridge.torch_api.attention import flash_attention as tfa
    spec, options = CASES[name]
    q, k, v, kw = _inputs(7, **spec)
    leaves = [t.requires_grad_(True) for t in (q, k, v)] + ([kw["sinks"].requires_grad_(True)] if "sinks" in kw
                                                             else [])
    out = tfa(q, k, v, **kw, **options)
    dout = torch.randn_like(out)
    tgrads = torch.autograd.grad(out, leaves, dout)

    jkw = {n: torch_to_jax(a) if isinstance(a, torch.Tensor) else a for n, a in kw.items()}
    sinks = jkw.pop("sinks", None)
    jout, vjp = jax.vjp(lambda q, k, v, s: jfa(q, k, v, sinks=s, **jkw, **options),
                        torch_to_jax(q), torch_to_jax(k), torch_to_jax(v), sinks)
    jgrads = vjp(torch_to_jax(dout))
    np.testing.assert_array_equal(np64(jout), np64(out))
    for a, b in zip(jgrads, tgrads):
        np.testing.assert_array_equal(np64(a), np64(b))


def _memcheck_case():
    """Ragged packed batches, forward and backward, torch and JAX (for compute-sanitizer): D=128, and D=256
    (its dK/dV kernel splits the columns) with a padded Dqk."""
    from flashbridge.torch_api.attention import flash_attention
    spec, options = CASES["varlen-ragged"]
    q, k, v, kw = _inputs(0, **spec, sinks=True, alibi=True)
    for t in (q, k, v, kw["alibi_slopes"]):  # the slopes too: the dQ kernel's slope term and its reduction
        t.requires_grad_(True)
    out = flash_attention(q, k, v, **kw, **options, window_size=(300, -1), softcap=20.0)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print("torch ragged varlen forward + backward: ok")
    kw["alibi_slopes"] = kw["alibi_slopes"].detach()
    for dqk in (256, 200):
        spec256, options256 = CASES["d256-gqa-ragged"]
        q2, k2, v2, kw2 = _inputs(1, **{**spec256, "dqk": dqk, "dv": 256}, sinks=True)
        for t in (q2, k2, v2):
            t.requires_grad_(True)
        out2 = flash_attention(q2, k2, v2, **kw2, **options256, softcap=20.0)
        out2.backward(torch.randn_like(out2))
        torch.cuda.synchronize()
        print(f"torch ragged varlen D={dqk}/256 forward + backward: ok")
    try:
        import jax
        from flashbridge.jax_api.attention import flash_attention as jfa
    except ImportError:
        return
    jkw = {n: (jax.numpy.asarray(a.cpu().numpy()) if isinstance(a, torch.Tensor) else a) for n, a in kw.items()}
    arrs = [jax.numpy.asarray(t.detach().float().cpu().numpy()).astype(jax.numpy.bfloat16) for t in (q, k, v)]
    slopes = jkw.pop("alibi_slopes")
    grads = jax.grad(lambda q, k, v, s: jfa(q, k, v, **jkw, alibi_slopes=s, **options).astype(jax.numpy.float32)
                     .sum(), argnums=(0, 1, 2, 3))(*arrs, slopes)
    jax.block_until_ready(grads)
    print("jax ragged varlen forward + backward: ok")


if __name__ == "__main__":
    _memcheck_case()


def test_backward_plans_under_the_configs_of_its_forward(monkeypatch):
    """A CUDA backward runs on torch's autograd worker thread, which sees no configure() block of the caller:
    its plan must still take the config the forward ran under (it took the defaults before)."""
    from flashbridge.core_kernels import configure
    from flashbridge.core_kernels.flash_attn.plan import AttentionConfig
    from flashbridge.torch_api.attention import flash_attention

    seen = backward_config_spy(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    config = AttentionConfig(fused_backward=False, dkdv_block_m=32)
    with configure(config):
        flash_attention(q, k, v, causal=True).float().square().sum().backward()
    assert seen == [config]
