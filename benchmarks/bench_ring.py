"""Context-parallel (ring) attention scaling: achieved TFLOP/s per GPU of ``ring_attention`` on n GPUs against
single-GPU ``flash_attention`` doing the same work per GPU, and how much of the communication the compute
hides. Causal, bf16, zigzag, forward and backward, both frameworks.

    torchrun --nproc-per-node N benchmarks/bench_ring.py --torch     # one process per GPU (NCCL)
    python benchmarks/bench_ring.py --jax [--worlds 2,4,8]           # one process, shard_map over the GPUs
    python benchmarks/bench_ring.py --combine A.json B.json ...      # merge runs into results/ring_h200.json

Per row (framework, n GPUs, S per GPU), every figure the slowest GPU's:

* ring: forward / backward ms and TFLOP/s per GPU (causal FLOPs of the whole sequence n*S divided by n:
  ``4 * B * H * D * pairs / n``, backward 2.5x);
* baseline: single-GPU flash_attention (causal) on one sequence of ``L = sqrt(n) * S`` tokens (rounded to 256),
  whose FLOPs equal the ring's per GPU, timed on every GPU at once; ``ratio`` = ring / baseline TFLOP/s;
* overlap: the same ring with every transfer replaced by a local no-op (``compute_ms``) and the transfers
  alone (``comm_ms``): ``exposed_ms = ring - compute``, ``hidden = 1 - exposed / comm`` (1: all hidden).

Timing: a fixed number of calls (chosen from the FLOPs, the same on every rank) after one warm-up call, one
synchronisation at the end; torch takes the maximum over ranks. The torch ring's per-call check that all
ranks agree on shapes (one small all_gather of host values over a gloo group) is part of its time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time

from _common import environment, print_table, results_dir

NAME = "ring_h200"
SEQLENS = (16384, 32768, 65536, 131072)
PEAK_GUESS = 400e12  # FLOP/s, only to pick iteration counts


def _flops(b, h, d, seqlen, causal=True):
    pairs = seqlen * (seqlen + 1) // 2 if causal else seqlen * seqlen
    return 4.0 * b * h * d * pairs


def _iters(flops: float, budget_ms: float = 1500.0) -> int:
    """Calls to time: about ``budget_ms`` of work, at least 2 and at most 20 (deterministic: the same on
    every rank, which must make the same collective calls)."""
    return max(2, min(20, int(budget_ms / (flops / PEAK_GUESS * 1e3))))


def _baseline_len(world: int, s_local: int) -> int:
    return max(256, round(math.sqrt(world) * s_local / 256) * 256)


def _row(framework, world, s_local, args, ring, compute, comm, base, base_len):
    """One result row from (fwd ms, bwd ms) pairs of ring, compute-only, comm-only and baseline."""
    b, h, d = args.batch, args.hq, args.dim
    per_gpu = _flops(b, h, d, world * s_local) / world
    base_flops = _flops(b, h, d, base_len)
    row = {"framework": framework, "world": world, "s_per_gpu": s_local, "baseline_len": base_len,
           "batch": b, "hq": h, "hkv": args.hkv, "dim": d, "layout": args.layout}
    for i, phase in enumerate(("fwd", "bwd")):
        scale = 1.0 if phase == "fwd" else 2.5
        ring_tf = per_gpu * scale / (ring[i] * 1e-3) / 1e12
        base_tf = base_flops * scale / (base[i] * 1e-3) / 1e12
        exposed = ring[i] - compute[i]
        row.update({
            f"{phase}_ms": ring[i], f"{phase}_tflops_per_gpu": ring_tf,
            f"{phase}_baseline_ms": base[i], f"{phase}_baseline_tflops": base_tf, f"{phase}_ratio": ring_tf / base_tf,
            f"{phase}_compute_ms": compute[i], f"{phase}_comm_ms": comm[i], f"{phase}_exposed_ms": exposed,
            f"{phase}_hidden": max(0.0, min(1.0, 1.0 - exposed / comm[i])) if comm[i] > 0 else 1.0,
        })
    return row


def _print(rows):
    cols = ["framework", "n", "S/GPU", "fwd TF/GPU", "base", "ratio", "bwd TF/GPU", "base", "ratio",
            "fwd comm ms", "exposed", "hidden", "bwd comm ms", "exposed", "hidden"]
    print_table("ring attention, causal, per GPU against single-GPU flash_attention at the same work", cols, [
        [r["framework"], r["world"], r["s_per_gpu"], r["fwd_tflops_per_gpu"], r["fwd_baseline_tflops"],
         r["fwd_ratio"], r["bwd_tflops_per_gpu"], r["bwd_baseline_tflops"], r["bwd_ratio"], r["fwd_comm_ms"],
         r["fwd_exposed_ms"], r["fwd_hidden"], r["bwd_comm_ms"], r["bwd_exposed_ms"], r["bwd_hidden"]]
        for r in sorted(rows, key=lambda r: (r["framework"], r["world"], r["s_per_gpu"]))])


def _key(row):
    return (row["framework"], row["world"], row["s_per_gpu"], row["hq"], row["hkv"], row["dim"], row["layout"])


def save_rows(rows, path=None):
    """Merge ``rows`` into the results file (rows with the same key are replaced) and print the table."""
    path = path or results_dir() / f"{NAME}.json"
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("rows", [])
    merged = {_key(r): r for r in old}
    merged.update({_key(r): r for r in rows})
    rows = sorted(merged.values(), key=_key)
    with open(path, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    _print(rows)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------------------ torch

def _torch_time(fn, iters: int) -> float:
    """Milliseconds per call of ``fn`` over ``iters`` calls after one warm-up, the maximum over ranks."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    fn()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ms = torch.tensor([(time.perf_counter() - start) / iters * 1e3], device="cuda" if cuda else "cpu")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms.item())


@contextlib.contextmanager
def _torch_no_transfers():
    """The ring with every transfer replaced by a local no-op ("received" = what would be sent): the same
    kernel calls on the same shapes, no communication."""
    from flashbridge.torch_api import ring as ring_mod

    saved = ring_mod._start, ring_mod._finish
    ring_mod._start = lambda tensors, *args: (None, list(tensors))
    ring_mod._finish = lambda pending: pending[1]
    try:
        yield
    finally:
        ring_mod._start, ring_mod._finish = saved


def _torch_fwd_bwd(call, leaves, iters_fwd, iters_bwd):
    import torch

    with torch.no_grad():
        fwd = _torch_time(call, iters_fwd)
    out = call()
    dout = torch.randn_like(out)
    bwd = _torch_time(lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True), iters_bwd)
    return fwd, bwd


def _torch_comm_only(k, v, n_steps, iters):
    """The ring's transfers alone: forward n_steps - 1 K/V rotations; backward the same rotations with the
    float32 dK/dV beside them, then the return of dK/dV to their owner."""
    import torch
    import torch.distributed as dist

    from flashbridge.torch_api.ring import _finish, _start

    rank, world = dist.get_rank(), dist.get_world_size()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    back, ahead = (rank - (n_steps - 1)) % world, (rank + (n_steps - 1)) % world
    dk, dv = torch.zeros(k.shape, dtype=torch.float32, device=k.device), torch.zeros(v.shape, dtype=torch.float32,
                                                                                      device=v.device)

    def fwd():
        kv = (k, v)
        for _ in range(n_steps - 1):
            kv = _finish(_start(kv, nxt, prv, None, 0))

    def bwd():
        kv, dkv = (k, v), (dk, dv)
        for _ in range(n_steps - 1):
            a, b = _start(kv, nxt, prv, None, 0), _start(dkv, nxt, prv, None, 2)
            kv, dkv = _finish(a), _finish(b)
        if n_steps > 1:
            _finish(_start(dkv, back, ahead, None, 4))

    return _torch_time(fwd, iters), _torch_time(bwd, iters)


def run_torch(args):
    import torch
    import torch.distributed as dist

    from flashbridge.torch_api import flash_attention, ring_attention
    from flashbridge._sequence_layout import ring_schedule

    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.smoke:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device=device).manual_seed(rank)
    b, hq, hkv, d = args.batch, args.hq, args.hkv, args.dim
    rows = []
    for s_local in args.seqlens:
        def randn(*shape):
            return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()

        q, k, v = randn(b, s_local, hq, d), randn(b, s_local, hkv, d), randn(b, s_local, hkv, d)
        per_gpu = _flops(b, hq, d, world * s_local) / world
        it_f, it_b = (1, 1) if args.smoke else (_iters(per_gpu), _iters(2.5 * per_gpu))
        call = lambda: ring_attention(q, k, v, causal=True, layout=args.layout)  # noqa: E731
        ring = _torch_fwd_bwd(call, (q, k, v), it_f, it_b)
        with _torch_no_transfers():
            compute = _torch_fwd_bwd(call, (q, k, v), it_f, it_b)
        n_steps = len(ring_schedule(s_local, world, args.layout, None, 0)[0])
        comm = _torch_comm_only(torch.randn_like(k), torch.randn_like(v), n_steps, max(it_f, 5))
        del q, k, v
        base_len = _baseline_len(world, s_local)
        bq, bk, bv = randn(b, base_len, hq, d), randn(b, base_len, hkv, d), randn(b, base_len, hkv, d)
        base = _torch_fwd_bwd(lambda: flash_attention(bq, bk, bv, causal=True), (bq, bk, bv), it_f, it_b)
        del bq, bk, bv
        torch.cuda.empty_cache()
        row = _row("torch", world, s_local, args, ring, compute, comm, base, base_len)
        if rank == 0:
            print({k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
            rows.append(row)
            save_rows(rows, args.out)  # after every row: a run cut short keeps what it measured
    dist.destroy_process_group()


# -------------------------------------------------------------------------------------------------- JAX

def _jax_time(jitted, args, iters: int) -> float:
    import jax

    jax.block_until_ready(jitted(*args))  # compile and warm up
    start = time.perf_counter()
    out = None
    for _ in range(iters):
        out = jitted(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e3


def _jax_fwd_bwd(f, args, iters_fwd, iters_bwd):
    import jax

    fwd = _jax_time(jax.jit(f), args, iters_fwd)
    out, vjp_fn = jax.vjp(f, *args)
    dout = jax.random.normal(jax.random.key(7), out.shape, out.dtype)
    dout = jax.device_put(dout, out.sharding)
    bwd = _jax_time(jax.jit(lambda fn, ct: fn(ct)), (vjp_fn, dout), iters_bwd)
    return fwd, bwd


@contextlib.contextmanager
def _jax_no_transfers():
    """The ring with each ppermute replaced by a local roll of the same arrays (a different array every step,
    so XLA cannot merge the steps' identical kernel calls): the same kernel calls, no communication."""
    import jax
    import jax.numpy as jnp

    from flashbridge.jax_api import ring as ring_mod

    saved = ring_mod._shift
    ring_mod._shift = lambda tree, spec, by: jax.tree_util.tree_map(lambda x: jnp.roll(x, 1, axis=1), tree)
    try:
        yield
    finally:
        ring_mod._shift = saved


def run_jax(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from flashbridge.jax_api import flash_attention, ring_attention
    from flashbridge._sequence_layout import ring_schedule

    devices = jax.devices("cpu" if args.smoke else "gpu")
    worlds = [n for n in args.worlds if n <= len(devices)]
    b, hq, hkv, d = args.batch, args.hq, args.hkv, args.dim
    rows = []
    key = jax.random.key(0)
    for world in worlds:
        mesh = Mesh(np.array(devices[:world]), ("sp",))
        seq = NamedSharding(mesh, P(None, "sp"))
        spec = P(None, "sp")
        for s_local in args.seqlens:
            kq, kk, kv = jax.random.split(jax.random.fold_in(key, s_local), 3)
            s = world * s_local
            q = jax.device_put(jax.random.normal(kq, (b, s, hq, d), jnp.bfloat16), seq)
            k = jax.device_put(jax.random.normal(kk, (b, s, hkv, d), jnp.bfloat16), seq)
            v = jax.device_put(jax.random.normal(kv, (b, s, hkv, d), jnp.bfloat16), seq)

            def ring_fn(scale=1.0):
                # the compute-only ring gets a softmax scale 1 ulp away, so that no trace of the real ring is
                # reused for it (the same work)
                return jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis_name="sp", causal=True,
                                                                    layout=args.layout,
                                                                    softmax_scale=scale / math.sqrt(d)),
                                     mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

            per_gpu = _flops(b, hq, d, s) / world
            it_f, it_b = (1, 1) if args.smoke else (_iters(per_gpu), _iters(2.5 * per_gpu))
            ring = _jax_fwd_bwd(ring_fn(), (q, k, v), it_f, it_b)
            with _jax_no_transfers():
                compute = _jax_fwd_bwd(ring_fn(float(np.nextafter(np.float32(1), np.float32(2)))), (q, k, v),
                                       it_f, it_b)
            n_steps = len(ring_schedule(s_local, world, args.layout, None, 0)[0])
            comm = _jax_comm_only(mesh, k, v, n_steps, max(it_f, 5))
            del q, k, v
            base_len = _baseline_len(world, s_local)
            dev0 = devices[0]
            bq, bk, bv = (jax.device_put(jax.random.normal(kx, (b, base_len, h, d), jnp.bfloat16), dev0)
                          for kx, h in zip(jax.random.split(kq, 3), (hq, hkv, hkv)))
            base = _jax_fwd_bwd(lambda q, k, v: flash_attention(q, k, v, causal=True), (bq, bk, bv), it_f, it_b)
            del bq, bk, bv
            row = _row("jax", world, s_local, args, ring, compute, comm, base, base_len)
            print({k: (round(x, 3) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
            rows.append(row)
            save_rows(rows, args.out)


def _jax_comm_only(mesh, k, v, n_steps, iters):
    """The ring's ppermutes alone (see :func:`_torch_comm_only`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = mesh.devices.size
    ring = [(j, (j + 1) % n) for j in range(n)]
    back = [(j, (j - (n_steps - 1)) % n) for j in range(n)]
    spec = P(None, "sp")

    def fwd(k, v):
        kv = (k, v)
        for _ in range(n_steps - 1):
            kv = jax.lax.ppermute(kv, "sp", ring)
        return kv

    def bwd(k, v):
        kv, dkv = (k, v), (k.astype(jnp.float32), v.astype(jnp.float32))
        for _ in range(n_steps - 1):
            kv, dkv = jax.lax.ppermute((kv, dkv), "sp", ring)
        if n_steps > 1:
            dkv = jax.lax.ppermute(dkv, "sp", back)
        return kv, dkv

    times = []
    for body, out_specs in ((fwd, (spec, spec)), (bwd, ((spec, spec), (spec, spec)))):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=out_specs))
        times.append(_jax_time(f, (k, v), iters))
    return tuple(times)


# ----------------------------------------------------------------------------------------------- main

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--torch", action="store_true", help="torch over NCCL (launch with torchrun)")
    what.add_argument("--jax", action="store_true", help="JAX shard_map over the local GPUs (one process)")
    what.add_argument("--combine", nargs="+", metavar="JSON", help="merge result files into the results file")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)), help="tokens per GPU, comma-separated")
    parser.add_argument("--worlds", default="2,4,8", help="JAX: GPU counts to run, comma-separated")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hq", type=int, default=32)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"))
    parser.add_argument("--out", help=f"results file (default: results/{NAME}.json, or $OUT/{NAME}.json)")
    parser.add_argument("--smoke", action="store_true", help="run the code path on the CPU (gloo / host devices, "
                        "interpreter) at the sizes given; for checking the script, not for timing")
    args = parser.parse_args()
    args.seqlens = [int(s) for s in args.seqlens.split(",")]
    args.worlds = [int(s) for s in args.worlds.split(",")]
    if args.combine:
        rows = []
        for path in args.combine:
            with open(path) as f:
                rows += json.load(f)["rows"]
        save_rows(rows, args.out)
    elif args.torch:
        run_torch(args)
    else:
        if args.smoke:  # host devices stand in for the GPUs; must be set before JAX starts
            os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={max(args.worlds)}")
        run_jax(args)


if __name__ == "__main__":
    main()
