"""Ring attention over several CUDA GPUs (skipped with fewer than two): torch over NCCL (one process per
GPU, spawned by torch.multiprocessing) and JAX under shard_map over the local GPUs (one process), bf16 at
realistic sizes, for every world size in (2, 4, 8) the machine has GPUs for.

Reference: attention computed plainly in float64 on GPU 0 on the gathered sequence; the tolerance is the
project's rule (error <= 2 x a naive bf16 computation's + a small floor), and the single-GPU
flash_attention result must meet the same rule, so the ring is as accurate as flash_attention to rounding.
Run them alone, with a generous timeout (they use every GPU and spawn a process per GPU):
``pytest tests/test_ring_gpu.py -m gpu -p no:xdist``.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import RING_NAMES as NAMES, RingCase as Case
from helpers import assert_close, free_port, run_jax_ring_case, run_torch_ring_case

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORLDS = (2, 4, 8)


def _need(world: int):
    if GPUS < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {GPUS}")


def gpu_cases(world: int) -> list[Case]:
    """Global length 8192 (or 8000: chunks that no block size divides) whatever the world size, so the
    float64 reference stays a few GB."""
    s_local = 8192 // world
    common = dict(world=world, dim=128, dtype="bfloat16")
    return [
        Case(layout="zigzag", causal=True, hq=8, hkv=2, s_local=s_local, seed=20, **common),
        Case(layout="contiguous", causal=False, hq=4, hkv=4, s_local=s_local, seed=21, **common),
        Case(layout="zigzag", causal=True, window=(1500, -1), hq=4, hkv=1, s_local=8000 // world, seed=22, **common),
        Case(layout="contiguous", causal=True, window=(s_local // 2, -1), hq=4, hkv=2, s_local=s_local, seed=23,
             **common),  # the ring ends after two steps
        Case(layout="zigzag", causal=False, window=(700, 300), hq=4, hkv=2, s_local=8000 // world, seed=24, **common),
    ]


def _plain(q, k, v, dout, dlse, case: Case, dtype):
    """out, lse, dq, dk, dv of attention computed plainly in ``dtype`` on the GPU (float64: the reference)."""
    from flashbridge.reference.attention import visible_mask

    leaves = [t.detach().cuda().to(dtype).requires_grad_() for t in (q, k, v)]
    q_, k_, v_ = leaves
    group = q_.shape[2] // k_.shape[2]
    kk, vv = k_.repeat_interleave(group, 2), v_.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q_, kk) / q_.shape[-1] ** 0.5
    mask = torch.from_numpy(visible_mask(q_.shape[1], k_.shape[1], causal=case.causal,
                                         window_size=case.window)).cuda()
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv)
    del s
    grads = torch.autograd.grad((out * dout.cuda().to(dtype)).sum() + (lse * dlse.cuda().to(lse.dtype)).sum(),
                                leaves)
    return [t.detach() for t in (out, lse, *grads)]


def expected_gpu(case: Case):
    """(float64 reference, naive bf16 baseline, single-GPU flash_attention) on the gathered sequence."""
    from flashbridge.torch_api import flash_attention

    q, k, v, dout, dlse = case.inputs()
    reference = _plain(q, k, v, dout, dlse, case, torch.float64)
    naive = _plain(q, k, v, dout, dlse, case, getattr(torch, case.dtype))
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, **case.options(), return_lse=True)
    grads = torch.autograd.grad((out * dout.cuda()).sum() + (lse * dlse.cuda()).sum(), leaves)
    flash = [t.detach() for t in (out, lse, *grads)]
    return reference, naive, flash


def check_gpu(case: Case, got, expect, label: str):
    reference, naive, flash = expect
    finite = torch.isfinite(reference[1])
    for name, g, r, n, f in zip(NAMES, got, reference, naive, flash):
        g = g.cuda()
        assert tuple(g.shape) == tuple(r.shape), f"{label} {name}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        if name == "lse":
            assert torch.equal(torch.isfinite(g), finite)
            g, r, n, f = (torch.where(finite, t.double(), 0.0) for t in (g, r, n, f))
        assert_close(f, r, n, name=f"{label} {name} (single-GPU flash_attention)", floor=1e-3)
        assert_close(g, r, n, name=f"{label} {name} ({case})", floor=1e-3)


# --------------------------------------------------------------------------------------------- torch / NCCL

def _nccl_worker(rank, world, port, cases, tmpdir):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        for i, case in enumerate(cases):
            torch.save(run_torch_ring_case(case, rank, device), os.path.join(tmpdir, f"{i}_{rank}.pt"))
        # ranks that disagree on the shapes raise (all of them) before any transfer
        from flashbridge.torch_api import ring_attention

        x = torch.randn(1, 64 * (1 + rank), 2, 64, device=device, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="same shapes and options"):
            ring_attention(x, x, x, causal=True)
        with pytest.raises(ValueError, match="CUDA tensors"):
            ring_attention(x.cpu(), x.cpu(), x.cpu())
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", WORLDS)
def test_torch_ring_nccl(world, tmp_path):
    _need(world)
    import torch.multiprocessing as mp

    from flashbridge.torch_api import sequence_unshard

    cases = gpu_cases(world)
    ctx = mp.start_processes(_nccl_worker, args=(world, free_port(), cases, str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    while not ctx.join():
        pass
    for i, case in enumerate(cases):
        shards = [torch.load(os.path.join(tmp_path, f"{i}_{r}.pt")) for r in range(world)]
        got = [sequence_unshard(torch.cat([s[n] for s in shards], dim), world, layout=case.layout, dim=dim)
               for n, dim in zip(NAMES, (1, 2, 1, 1, 1))]
        check_gpu(case, got, expected_gpu(case), f"torch n={world}")
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- JAX shard_map

@pytest.mark.parametrize("world", WORLDS)
def test_jax_ring_shard_map_gpus(world):
    _need(world)
    jax = pytest.importorskip("jax")
    devices = jax.devices("gpu")
    if len(devices) < world:
        pytest.skip(f"JAX sees {len(devices)} GPUs")
    for case in gpu_cases(world):
        got = run_jax_ring_case(case, devices)
        check_gpu(case, got, expected_gpu(case), f"jax n={world}")


def test_torch_and_jax_rings_agree():
    """The same inputs through the torch ring (NCCL, 2 processes) and the JAX ring (shard_map over 2 GPUs)
    run the same kernels in the same order: the results agree to the last bit or close to it."""
    _need(2)
    jax = pytest.importorskip("jax")
    import torch.multiprocessing as mp

    from flashbridge.torch_api import sequence_unshard

    case = Case(world=2, layout="zigzag", causal=True, hq=8, hkv=2, s_local=2048, dim=128, dtype="bfloat16",
                seed=30)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_nccl_worker, args=(2, free_port(), [case], tmp), nprocs=2, join=False,
                                 start_method="spawn")
        while not ctx.join():
            pass
        shards = [torch.load(os.path.join(tmp, f"0_{r}.pt")) for r in range(2)]
    got_torch = [sequence_unshard(torch.cat([s[n] for s in shards], dim), 2, layout=case.layout, dim=dim)
                 for n, dim in zip(NAMES, (1, 2, 1, 1, 1))]
    got_jax = run_jax_ring_case(case, jax.devices("gpu"))
    for name, a, b in zip(NAMES, got_torch, got_jax):
        diff = (a.float() - b.float()).abs().max().item()
        scale = a.float().abs().max().item()
        print(f"{name}: torch vs JAX max |diff| {diff:.3g} (max |value| {scale:.3g})")
        assert diff <= 2 ** -7 * max(1.0, scale), f"{name}: torch and JAX rings differ by {diff}"
