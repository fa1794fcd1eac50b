"""Warm-up and the resource model on a CUDA GPU (skipped without one).

* After ``flashbridge.warmup(...)``, the first calls of the warmed ops compile nothing: Triton's
  ``jit_cache_hook`` (called before every compile of a kernel not in its in-process cache) counts zero.
* The live GPU's profile, and the estimates against the kernels' compiled metadata on this GPU: shared
  memory exactly, no spills for survivors away from the register cap.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import triton  # noqa: E402

import flashbridge  # noqa: E402
from flashbridge import tiles  # noqa: E402
from flashbridge import torch_api as ft  # noqa: E402


class _CompileCounter:
    """Counts Triton compiles (cache misses of a kernel's in-process cache) while installed."""

    def __init__(self):
        self.compiled: list[str] = []

    def __call__(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.compiled.append(getattr(getattr(fn, "jit_function", fn), "__name__", repr(fn)))
        return False  # go on compiling

    def __enter__(self):
        self.saved = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc):
        triton.knobs.runtime.jit_cache_hook = self.saved


def _calls():
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=g, device=dev).to(dt).requires_grad_(grad)

    # attention at another batch and length than the warm-up's (2 x 4096): the same compiled kernels
    q, k, v = (randn(4, 2048, 16, 128, grad=True) for _ in range(3))
    for causal in (False, True):
        out = ft.flash_attention(q, k, v, causal=causal)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    x, w = randn(3000, 4096, grad=True), randn(4096, grad=True)
    y = ft.rms_norm(x, w)
    torch.autograd.grad(y, (x, w), torch.randn_like(y))
    kc, vc = randn(1, 16384, 8, 128), randn(1, 16384, 8, 128)
    ft.decode_attention(randn(1, 1, 32, 128), kc, vc, cache_seqlens=torch.full((1,), 16384, device=dev,
                                                                                  dtype=torch.int32))
    logits = randn(8192, 32000, grad=True)
    labels = torch.randint(0, 32000, (8192,), device=dev, generator=g)
    loss = ft.cross_entropy(logits, labels)
    torch.autograd.grad(loss, logits)
    torch.cuda.synchronize()


def test_warmup_then_first_call_compiles_nothing():
    n = flashbridge.warmup(ops=("attention", "decode", "norms", "cross_entropy"), head_dims=(128,),
                           dtypes=("bfloat16",), hidden=(4096,), vocab=(32000,))
    assert n > 10
    with _CompileCounter() as counter:
        _calls()
    assert counter.compiled == [], f"compiled on the first call after warm-up: {counter.compiled}"


def test_without_warmup_the_counter_sees_compiles():
    """The counter works: a shape class nobody warmed (head dim 96, float16) compiles on its first call."""
    q = torch.randn(1, 256, 2, 96, device="cuda", dtype=torch.float16)
    with _CompileCounter() as counter:
        ft.flash_attention(q, q, q)
    assert counter.compiled


def test_live_profile_and_compiled_metadata():
    """The live profile matches the device, and the compiled kernels' metadata on it matches the estimates:
    shared memory exactly, no spills for survivors the model does not flag as near the register cap."""
    from triton.runtime.jit import MockTensor

    from flashbridge.core_kernels import Target, get_kernel
    from flashbridge.tiles.cache import case_for
    from flashbridge.tiles.model import MODELS

    gpu = tiles.profile_of()
    assert gpu is not None and gpu.sms == torch.cuda.get_device_properties(0).multi_processor_count
    dtypes = {**{n: "bfloat16" for n in ("q", "k", "v", "out", "dout", "dq", "x", "weight", "y", "h", "logits")},
              "labels": "int64"}

    def mock(name):
        return MockTensor(getattr(torch, dtypes.get(name, "float32")))

    for name in ("attention_fwd", "attention_dq", "norm_fwd", "cross_entropy"):
        model = MODELS[name]
        case = case_for(name)
        for row in tiles.build_report(model, case, gpu).survivors[:2]:
            launch = model.launch(case, Target(False, gpu.sms), model.config(row.tile))
            compiled = get_kernel(launch.kernel, False).warmup(
                *map(mock, launch.inputs), *launch.scalar_values(), *map(mock, launch.outputs), grid=launch.grid,
                **launch.constexpr_dict(), num_warps=launch.num_warps, num_stages=launch.num_stages,
                enable_fp_fusion=True)
            compiled._init_handles()
            assert compiled.metadata.shared == row.est.smem, (name, row.tile)
            if not row.note:
                assert compiled.n_spills == 0, (name, row.tile, compiled.n_spills)


def test_a_quick_tune_writes_an_entry_that_plans_use(tmp_path, monkeypatch):
    """``tune norms --quick`` times the steady candidates of one row per kernel, writes the fastest to the
    user cache; a plan built afterwards (no config) takes that tile, and ``--check`` reports it at 1.0x of the
    sweep's best within noise."""
    import json

    from flashbridge.__main__ import main
    from flashbridge.core_kernels.norms.plan import plan_norm_fwd
    from flashbridge.tiles import cache
    from flashbridge.torch_api._runtime import target_for

    monkeypatch.setenv("FLASHBRIDGE_CACHE", str(tmp_path))
    assert main(["tune", "norms", "--quick", "--json", str(tmp_path / "tune.json")]) == 0
    entries = cache.read_entries(tmp_path / "tiles.json")
    gpu = tiles.profile_of()
    case = cache.case_for("norm_fwd", rows=16384, cols=8192)
    key = cache.entry_key(gpu, "norm_fwd", case)
    assert key in entries, sorted(entries)
    stored = entries[key]["tile"]
    launch = plan_norm_fwd(16384, 8192, x_dtype="bfloat16", residual_dtype=None, is_rms=True, has_weight=True,
                           has_bias=False, has_post_residual=False, dropout_p=0.0, eps=1e-6,
                           target=target_for(torch.device("cuda"))).launches[0]
    assert [launch.constexpr_dict()["BLOCK_M"], launch.num_warps] == [stored[0], stored[2]]
    assert cache.lookup("norm_fwd", case, gpu)[1] == "user cache"
    assert main(["tune", "norms", "--quick", "--check", "--json", str(tmp_path / "check.json")]) == 0
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert rows and all(r["plan_ratio"] <= 1.10 for r in rows), [(r["kernel"], r["plan_ratio"]) for r in rows]
