"""Context-parallel (ring) attention on the CPU: the sequence layouts, the ring schedule, torch over gloo
(2 and 4 processes, kernels through the interpreter) and JAX under shard_map on 4 host devices.

Every ring result (out, lse, dq, dk, dv) is compared with flash_attention on the gathered sequence and with
the float64 reference: its error must stay within 2 x that of single-device flash_attention (float32) or of
a naive same-dtype implementation (bfloat16), plus a small floor. The interpreter pays per kernel launch and
a ring makes n^2 of them, so shapes are tiny (S_local = 16) and the larger grids are marked slow.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from flashbridge import _sequence_layout as layout_mod
from flashbridge.reference import attention as ref
from helpers import RING_NAMES as NAMES, RingCase as Case
from helpers import assert_close, free_port, np64, run_jax_ring_case, run_torch_ring_case

torch_ring = pytest.importorskip("flashbridge.torch_api.ring")


# ------------------------------------------------------------------------------------------------ cases

def _naive(q, k, v, *, causal, window_size):
    """Attention in the inputs' dtype, plainly (the baseline of the accuracy rule for low precision)."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / q.shape[-1] ** 0.5
    mask = torch.from_numpy(ref.visible_mask(q.shape[1], k.shape[1], causal=causal, window_size=window_size))
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float(), -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vv), lse


def expected(case: Case):
    """(float64 reference, baseline) of [out, lse, dq, dk, dv] on the gathered sequence; the baseline is
    single-device flash_attention (float32) or the naive same-dtype computation (bfloat16 / float16)."""
    from flashbridge.torch_api import flash_attention

    q, k, v, dout, dlse = case.inputs()
    opts = case.options()
    ro, rl = ref.flash_attention(np64(q), np64(k), np64(v), **opts)
    rdq, rdk, rdv, _ = ref.flash_attention_bwd(np64(dout), np64(q), np64(k), np64(v), dlse=np64(dlse), **opts)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if case.dtype == "float32":
        out, lse = flash_attention(*leaves, **opts, return_lse=True)
    else:
        out, lse = _naive(*leaves, **opts)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    base = [out.detach(), lse.detach(), *(t.grad for t in leaves)]
    return [ro, rl, rdq, rdk, rdv], base


def check_results(case: Case, got, expect=None):
    """``got``: [out, lse, dq, dk, dv] of the ring in global order."""
    reference, base = expect or expected(case)
    floor = 1e-5 if case.dtype == "float32" else 2e-3
    for name, g, r, b in zip(NAMES, got, reference, base):
        assert tuple(g.shape) == r.shape, f"{name}: shape {tuple(g.shape)}, expected {r.shape}"
        assert_close(g, r, b, name=f"{name} ({case})", floor=floor)
        if case.dtype == "float32":  # equal to single-device flash_attention, to rounding
            diff = np.abs(np64(g) - np64(b)).max()
            assert diff <= 1e-5 * max(1.0, np.abs(r).max()), f"{name}: differs from flash_attention by {diff:.3g}"


# ----------------------------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("layout", layout_mod.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, 0, -1])
def test_shard_unshard_round_trip_torch(layout, world, dim):
    x = torch.randn(2 * world * 3, 2 * world * 2, 2 * world)
    shards = [torch_ring.sequence_shard(x, r, world, layout=layout, dim=dim) for r in range(world)]
    assert all(s.shape[dim] == x.shape[dim] // world for s in shards)
    back = torch_ring.sequence_unshard(torch.cat(shards, dim), world, layout=layout, dim=dim)
    assert torch.equal(back, x)


def test_shard_holds_the_documented_tokens():
    x = torch.arange(16)[None]
    assert torch_ring.sequence_shard(x, 1, 4, layout="zigzag").tolist() == [[2, 3, 12, 13]]
    assert torch_ring.sequence_shard(x, 1, 4, layout="contiguous").tolist() == [[4, 5, 6, 7]]
    assert torch_ring.sequence_shard(x, 3, 4, layout="zigzag").tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("layout", layout_mod.LAYOUTS)
@pytest.mark.parametrize("dim", [1, 2, -3])
def test_shard_unshard_round_trip_jax(layout, dim):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from flashbridge.jax_api import ring as jax_ring

    world = 4
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 24, 16, 3)), jnp.float32)
    shards = [jax_ring.sequence_shard(x, r, world, layout=layout, dim=dim) for r in range(world)]
    for r, s in enumerate(shards):  # torch and JAX agree
        t = torch_ring.sequence_shard(torch.from_numpy(np.array(x)), r, world, layout=layout, dim=dim)
        np.testing.assert_array_equal(np.asarray(s), t.numpy())
    back = jax_ring.sequence_unshard(jnp.concatenate(shards, axis=dim), world, layout=layout, dim=dim)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    # a traced rank (as from jax.lax.axis_index inside shard_map) gives the same shard
    traced = jax.jit(lambda x, r: jax_ring.sequence_shard(x, r, world, layout=layout, dim=dim))
    np.testing.assert_array_equal(np.asarray(traced(x, jnp.int32(2))), np.asarray(shards[2]))


def test_shard_bad_inputs():
    x = torch.zeros(1, 12, 2)
    with pytest.raises(ValueError, match="multiple of 8"):
        torch_ring.sequence_shard(x, 0, 4, layout="zigzag")
    with pytest.raises(ValueError, match="multiple of 5"):
        torch_ring.sequence_unshard(x, 5, layout="contiguous")
    with pytest.raises(ValueError, match="rank"):
        torch_ring.sequence_shard(x, 3, 3, layout="contiguous")
    with pytest.raises(ValueError, match="world_size"):
        torch_ring.sequence_shard(x, 0, 0)
    with pytest.raises(ValueError, match="layout"):
        torch_ring.sequence_shard(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="dim"):
        torch_ring.sequence_shard(x, 0, 2, dim=3)
    with pytest.raises(TypeError, match="rank"):
        torch_ring.sequence_shard(x, 0.0, 2)


def test_shard_bad_inputs_jax():
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from flashbridge.jax_api import ring as jax_ring

    x = jnp.zeros((1, 12, 2))
    with pytest.raises(ValueError, match="multiple of 8"):
        jax_ring.sequence_shard(x, 0, 4, layout="zigzag")
    with pytest.raises(ValueError, match="multiple of 5"):
        jax_ring.sequence_unshard(x, 5, layout="contiguous")
    with pytest.raises(ValueError, match="rank"):
        jax_ring.sequence_shard(x, -1, 3, layout="contiguous")
    with pytest.raises(TypeError, match="rank"):
        jax_ring.sequence_shard(x, jnp.ones(2, jnp.int32), 2)
    with pytest.raises(ValueError, match="dim"):
        jax_ring.sequence_shard(x, 0, 2, dim=-4)


# ------------------------------------------------------------------------------------------ ring schedule

WINDOWS = [(None, None), (None, 0), (5, 0), (3, 2), (None, 4), (0, None), (17, None), (40, 0), (100, 100)]


def _positions(seqlen_local, rank, world, layout):
    ranges = layout_mod.shard_ranges(seqlen_local * world, rank, world, layout)
    return np.concatenate([np.arange(a, b) for a, b in ranges])


@pytest.mark.parametrize("layout", layout_mod.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_schedule_covers_exactly_the_visible_pairs(layout, world):
    """Over all ranks and steps, the calls (with their shifted windows) see every visible (query, key) pair
    of the global mask exactly once and nothing else; a call's rows are merged iff they already hold a
    state."""
    s_local = 16
    s = s_local * world
    for left, right in WINDOWS:
        i, j = np.arange(s)[:, None], np.arange(s)[None, :]
        visible = np.ones((s, s), bool)
        if left is not None:
            visible &= j - i >= -left
        if right is not None:
            visible &= j - i <= right
        seen = np.zeros((s, s), int)
        schedule = layout_mod.ring_schedule(s_local, world, layout, left, right)
        assert len({len(steps) for steps in schedule}) == 1, "every rank must run the same number of steps"
        for r, steps in enumerate(schedule):
            q_pos = _positions(s_local, r, world, layout)
            has_state = np.zeros(s_local, bool)
            for step, calls in enumerate(steps):
                k_pos = _positions(s_local, (r - step) % world, world, layout)
                for c in calls:
                    lq, lk = c.q_stop - c.q_start, c.k_stop - c.k_start
                    d = np.arange(lk)[None, :] - (np.arange(lq)[:, None] + lk - lq)
                    m = np.ones((lq, lk), bool)
                    if c.window_left is not None:
                        m &= d >= -c.window_left
                    if c.window_right is not None:
                        m &= d <= c.window_right
                    assert m.any(), f"a call with nothing visible: {c}"
                    gq, gk = np.broadcast_arrays(q_pos[c.q_start:c.q_stop, None], k_pos[None, c.k_start:c.k_stop])
                    np.add.at(seen, (gq[m], gk[m]), 1)
                    assert c.merge == bool(has_state[c.q_start:c.q_stop].any())
                    has_state[c.q_start:c.q_stop] = True
            assert has_state.all()
        np.testing.assert_array_equal(seen, visible.astype(int), err_msg=f"window ({left}, {right})")


def test_schedule_zigzag_causal_is_balanced_and_skips_masked_blocks():
    """Causal zigzag: step 0 is one causal call; every later step is one unmasked call of half the block
    (all queries x the first key chunk, or the second query chunk x all keys), the same work on every rank;
    contiguous shards leave rank 0 idle after step 0 while the last rank works at every step."""
    world, s_local = 4, 16
    zig = layout_mod.ring_schedule(s_local, world, "zigzag", None, 0)
    for r, steps in enumerate(zig):
        assert steps[0] == (layout_mod.BlockCall(0, 16, 0, 16, None, 0, True, False),)
        for i, calls in enumerate(steps[1:], 1):
            (c,) = calls
            assert (c.window_left, c.window_right, c.merge) == (None, None, True)
            assert (c.q_stop - c.q_start) * (c.k_stop - c.k_start) == s_local * s_local // 2
            if (r - i) % world < r:
                assert (c.q_start, c.q_stop, c.k_start, c.k_stop) == (0, 16, 0, 8)
            else:
                assert (c.q_start, c.q_stop, c.k_start, c.k_stop) == (8, 16, 0, 16)
    contiguous = layout_mod.ring_schedule(s_local, world, "contiguous", None, 0)
    assert [len(c) for c in contiguous[0]] == [1, 0, 0, 0]
    assert [len(c) for c in contiguous[world - 1]] == [1, 1, 1, 1]


def test_schedule_window_ends_the_ring_early():
    # a left window of 20 tokens over shards of 16 reaches two shards back: 3 of 4 steps
    assert len(layout_mod.ring_schedule(16, 4, "contiguous", 20, 0)[0]) == 3
    assert len(layout_mod.ring_schedule(16, 4, "contiguous", 5, 0)[0]) == 2


# ----------------------------------------------------------------------------------- torch over gloo

def _gloo_worker(rank, world, port, cases, tmpdir, bad_inputs):
    import torch.distributed as dist

    from flashbridge.core_kernels._poison import poison_buffers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with poison_buffers():
            for i, case in enumerate(cases):
                torch.save(run_torch_ring_case(case, rank, torch.device("cpu")), os.path.join(tmpdir, f"{i}_{rank}.pt"))
            if bad_inputs:
                _bad_inputs_in_group(rank)
    finally:
        dist.destroy_process_group()


def _bad_inputs_in_group(rank):
    from flashbridge.torch_api import ring_attention

    x = torch.randn(1, 15, 2, 16)
    with pytest.raises(ValueError, match="odd"):
        ring_attention(x, x, x, layout="zigzag")
    y = torch.randn(1, 16, 2, 16)
    with pytest.raises(ValueError, match="same length"):
        ring_attention(y, y[:, :8], y[:, :8], layout="contiguous")
    # shapes (or options) that differ between ranks: every rank raises, before any transfer
    z = torch.randn(1, 16 + 16 * rank, 2, 16)
    with pytest.raises(ValueError, match="same shapes and options"):
        ring_attention(z, z, z, causal=True)
    with pytest.raises(ValueError, match="same shapes and options"):
        ring_attention(y, y, y, causal=rank == 0)
    # a group this process is not a member of
    import torch.distributed as dist

    solo = dist.new_group([0])
    if rank == 0:  # a ring of one: plain flash_attention
        from flashbridge.torch_api import flash_attention
        torch.testing.assert_close(ring_attention(y, y, y, group=solo, layout="contiguous"),
                                   flash_attention(y, y, y), rtol=0, atol=0)
    else:
        with pytest.raises(ValueError, match="not a member"):
            ring_attention(y, y, y, group=solo)


def run_gloo(cases, world, tmp_path, *, bad_inputs=False):
    """Run ``cases`` in ``world`` gloo processes; returns each case's results [out, lse, dq, dk, dv] in
    global order (the ranks' shards put back together by sequence_unshard)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_gloo_worker, args=(world, free_port(), cases, str(tmp_path), bad_inputs),
                             nprocs=world, join=False, start_method="spawn")
    expects = [expected(c) for c in cases]  # while the workers run
    while not ctx.join():
        pass
    results = []
    for i, case in enumerate(cases):
        shards = [torch.load(os.path.join(tmp_path, f"{i}_{r}.pt")) for r in range(world)]
        results.append([torch_ring.sequence_unshard(torch.cat([s[n] for s in shards], dim), world,
                                                    layout=case.layout, dim=dim)
                        for n, dim in zip(NAMES, (1, 2, 1, 1, 1))])
    return results, expects


TORCH_2 = [
    Case(2, "zigzag", causal=True, hq=4, hkv=2),
    Case(2, "contiguous", causal=False, seed=1),
    Case(2, "zigzag", causal=True, window=(5, -1), hq=2, hkv=1, dtype="bfloat16", seed=2),
    Case(2, "contiguous", causal=False, window=(3, 2), seed=3),
]
TORCH_4 = [
    Case(4, "zigzag", causal=True, hq=4, hkv=2, seed=4),
    Case(4, "contiguous", causal=True, window=(20, -1), seed=5),  # the ring ends after 3 of 4 steps
]
TORCH_4_SLOW = [
    Case(4, "zigzag", causal=False, seed=6),
    Case(4, "contiguous", causal=True, seed=7),
    Case(4, "zigzag", causal=False, window=(7, 3), hq=4, hkv=1, seed=8),
    Case(4, "zigzag", causal=True, s_local=32, batch=2, dtype="float16", seed=9),
]


@pytest.mark.parametrize("world, cases", [(2, TORCH_2), pytest.param(4, TORCH_4, marks=pytest.mark.slow),
                                          pytest.param(4, TORCH_4_SLOW, marks=pytest.mark.slow)],
                         ids=["2-ranks", "4-ranks", "4-ranks-more"])
def test_torch_ring_gloo(world, cases, tmp_path):
    results, expects = run_gloo(cases, world, tmp_path, bad_inputs=world == 2)
    for case, got, expect in zip(cases, results, expects):
        check_results(case, got, expect)


def test_torch_ring_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    x = torch.randn(1, 16, 2, 16)
    with pytest.raises(ValueError, match="init_process_group"):
        torch_ring.ring_attention(x, x, x)
    with pytest.raises(ValueError, match="layout"):
        torch_ring.ring_attention(x, x, x, layout="striped")
    with pytest.raises(ValueError, match="window_size"):
        torch_ring.ring_attention(x, x, x, window_size=(-2, 0))


# ------------------------------------------------------------------------------------- JAX under shard_map

JAX_CASES = [
    Case(4, "contiguous", causal=True, window=(5, -1), seed=11),  # 2 of 4 steps
    Case(2, "zigzag", causal=True, seed=15),
]
JAX_CASES_SLOW = [
    Case(4, "zigzag", causal=True, hq=4, hkv=2, seed=10),
    Case(4, "zigzag", causal=False, window=(7, 3), seed=12),
    Case(4, "contiguous", causal=False, hq=4, hkv=1, seed=13),
    Case(4, "zigzag", causal=True, dtype="bfloat16", seed=14),
]


def _jax_devices(n):
    jax = pytest.importorskip("jax")
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} host devices (XLA_FLAGS=--xla_force_host_platform_device_count, set in conftest)")
    return devices


@pytest.mark.parametrize("case", [*JAX_CASES, *(pytest.param(c, marks=pytest.mark.slow) for c in JAX_CASES_SLOW)],
                         ids=lambda c: f"{c.world}-{c.layout}-{'causal' if c.causal else 'full'}-w{c.window}-{c.dtype}")
def test_jax_ring_shard_map(case):
    devices = _jax_devices(case.world)
    got = run_jax_ring_case(case, devices)
    check_results(case, got)


def test_jax_ring_bad_inputs():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from flashbridge.jax_api import ring_attention

    x = jnp.ones((1, 16, 2, 16))
    with pytest.raises(ValueError, match="axis_name"):
        ring_attention(x, x, x, axis_name="sp")
    with pytest.raises(ValueError, match="odd"):
        ring_attention(jnp.ones((1, 15, 2, 16)), x[:, :15], x[:, :15], axis_name="sp")
    with pytest.raises(ValueError, match="same length"):
        ring_attention(x, x[:, :8], x[:, :8], axis_name="sp", layout="contiguous")
    devices = _jax_devices(2)
    mesh = Mesh(np.array(devices[:2]), ("sp",))
    f = jax.shard_map(lambda q: ring_attention(q, q, q, axis_name="model"), mesh=mesh, in_specs=P(None, "sp"),
                      out_specs=P(None, "sp"))
    with pytest.raises((ValueError, NameError), match="model"):
        f(jnp.ones((1, 32, 2, 16)))
