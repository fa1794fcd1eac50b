"""Context-parallel (ring) attention for PyTorch: the sequence is sharded over the ranks of a
``torch.distributed`` process group, and K/V shards travel around the ring while each rank computes its
queries against the shard in hand.

Forward: at each step the next K/V transfer (``batch_isend_irecv`` to rank r+1, from rank r-1) is posted
before the current block's kernels and waited after them, so that communication runs behind compute; the
block's partial (out, lse) merges into a float32 accumulator with the merge kernel of the decode family.
Blocks a causal mask or window leaves empty are skipped (see ``flashbridge._sequence_layout``).
Backward: the standard ring backward. Each step recomputes the block's probabilities from the *final* lse
and the final out (delta = rowsum(dO * O)), so the flash_attention backward kernels apply unchanged to
any block; dK / dV accumulate in float32 and travel with their K / V, arriving back at their owner.
Nothing gathers the whole sequence.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _sequence_layout as layout_mod
from ..core_kernels._config import active_configs, call_configured
from ..core_kernels.decode.plan import plan_merge_into
from ..core_kernels.flash_attn.plan import check_attention_args
from ._checks import check_tensors
from ._runtime import dtype_name, execute, target_for
from .attention import _flash_attn_bwd, _flash_attn_fwd

__all__ = ["ring_attention", "sequence_shard", "sequence_unshard"]


# ----------------------------------------------------------------------------------------------- layouts

def _check_dim(x: Tensor, dim) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected a Python int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: {dim} is out of range for x of shape {tuple(x.shape)}")
    return dim % x.dim()


def sequence_shard(x: Tensor, rank: int, world_size: int, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The part of the sequence (along ``dim``) that rank ``rank`` of ``world_size`` holds for
    :func:`ring_attention`.

    ``layout="contiguous"``: tokens ``[r S/n, (r+1) S/n)`` (a view); ``"zigzag"``: the sequence cut in 2n
    chunks, rank r holds chunks r and 2n-1-r (a new tensor), which balances causal work over the ranks.
    ``x.shape[dim]`` must be a multiple of n (contiguous) or 2n (zigzag).

    Example::

        >>> x = torch.arange(8).reshape(1, 8)
        >>> sequence_shard(x, 0, 2)
        tensor([[0, 1, 6, 7]])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(x, dim)
    layout_mod.check_layout(layout)
    world_size = layout_mod.check_world_size(world_size)
    rank = layout_mod.check_rank(rank, world_size)
    layout_mod.check_divisible("x", x.shape[dim], world_size, layout, f"the length along dim {dim}")
    pieces = [x.narrow(dim, a, b - a) for a, b in layout_mod.shard_ranges(x.shape[dim], rank, world_size, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def sequence_unshard(x: Tensor, world_size: int, *, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The sequence in global order from ``x``, the concatenation along ``dim`` of all ranks' shards (rank 0
    first, e.g. from ``torch.distributed.all_gather``): the inverse of :func:`sequence_shard`.

    Example::

        >>> x = torch.arange(8).reshape(1, 8)
        >>> shards = [sequence_shard(x, r, 2) for r in range(2)]
        >>> torch.equal(sequence_unshard(torch.cat(shards, 1), 2), x)
        True
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(x, dim)
    layout_mod.check_layout(layout)
    world_size = layout_mod.check_world_size(world_size)
    layout_mod.check_divisible("x", x.shape[dim], world_size, layout, f"the length along dim {dim}")
    pieces = [x.narrow(dim, a, b - a) for a, b in layout_mod.unshard_ranges(x.shape[dim], world_size, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


# ------------------------------------------------------------------------------------------ communication

@dataclasses.dataclass(frozen=True)
class _Ring:
    """What a rank needs to run its part of the ring (everything but the tensors)."""

    steps: layout_mod.RingSteps  # this rank's calls, step by step
    softmax_scale: float
    group: Optional[object]
    send_to: int  # global ranks of the ring neighbours
    recv_from: int
    return_to: int  # where the dK / dV accumulated after the last step belong (and where ours come from)
    return_from: int


def _start(tensors, send_to: int, recv_from: int, group, tag: int):
    """Post the sends of ``tensors`` to ``send_to`` and the receives of same-shaped ones from ``recv_from``
    (one ``batch_isend_irecv``); :func:`_finish` waits for them and returns what arrived."""
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group, tag + i) for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group, tag + i) for i, r in enumerate(received)]
    return dist.batch_isend_irecv(ops), received


def _finish(pending):
    requests, received = pending
    for request in requests:
        request.wait()
    return received


_KV_TAG, _DKV_TAG, _RETURN_TAG = 0, 2, 4


# ------------------------------------------------------------------------------------------------ blocks

def _block_fwd(q, k, v, call: layout_mod.BlockCall, scale: float):
    return _flash_attn_fwd(q[:, call.q_start:call.q_stop], k[:, call.k_start:call.k_stop],
                           v[:, call.k_start:call.k_stop], None, None, None, None, None, None, scale,
                           call.causal, call.window_left, call.window_right, 0.0)


def _block_bwd(dout, q, k, v, out, lse, dlse, call: layout_mod.BlockCall, scale: float):
    rows, keys = slice(call.q_start, call.q_stop), slice(call.k_start, call.k_stop)
    dq, dk, dv, *_ = _flash_attn_bwd(
        dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
        None if dlse is None else dlse[:, :, rows], None, None, None, None, None, None, scale, call.causal,
        call.window_left, call.window_right, 0.0, False)
    return dq, dk, dv


def _merge_rows(acc: Tensor, acc_lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """acc (B, L, H, Dv) float32 and acc_lse (B, L, H) += the partial state (part, part_lse (B, L, H)), in
    place, with the merge kernel (its out takes over acc's buffer when acc is contiguous)."""
    b, length, h, dv = part.shape
    rows = b * length * h
    plan = plan_merge_into(rows, dv, "float32", target=target_for(part.device))
    a_out = acc if acc.is_contiguous() else acc.contiguous()
    out, lse = execute(plan, {"acc_out": a_out.view(rows, dv), "acc_lse": acc_lse.reshape(rows),
                              "part_out": part.contiguous().view(rows, dv),
                              "part_lse": part_lse.reshape(rows)},
                       out={"out": a_out.view(rows, dv)})
    if a_out is not acc:
        acc.copy_(a_out)
    acc_lse.copy_(lse.view(b, length, h))


def _accumulate(state, part: Tensor, part_lse: Tensor, call: layout_mod.BlockCall, seqlen: int):
    """Fold one call's (part, part_lse (B, Hq, L)) into the (acc, acc_lse) state (None before the first)."""
    part_lse = part_lse.transpose(1, 2)  # (B, L, Hq): the merge kernel's row order, as out's
    if state is None:
        if not call.merge and call.q_start == 0 and call.q_stop == seqlen:
            return part.float(), part_lse.contiguous()
        b, _, h, dv = part.shape
        state = (part.new_zeros((b, seqlen, h, dv), dtype=torch.float32),
                 part.new_full((b, seqlen, h), float("-inf"), dtype=torch.float32))
    acc, acc_lse = state
    rows = slice(call.q_start, call.q_stop)
    if call.merge:
        _merge_rows(acc[:, rows], acc_lse[:, rows], part, part_lse)
    else:
        acc[:, rows] = part
        acc_lse[:, rows] = part_lse
    return state


def _add_grads(acc: Optional[Tensor], parts, like: Tensor) -> Tensor:
    """acc (float32, like ``like``; None = zeros) plus each (start, stop, part) along the sequence."""
    for start, stop, part in parts:
        if acc is None:
            if start == 0 and stop == like.shape[1]:
                acc = part.float()
                continue
            acc = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        acc[:, start:stop] += part
    return torch.zeros(like.shape, dtype=torch.float32, device=like.device) if acc is None else acc


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: _Ring):
    seqlen = q.shape[1]
    state = None
    kv = (k, v)
    n_steps = len(ring.steps)
    for i, calls in enumerate(ring.steps):
        pending = _start(kv, ring.send_to, ring.recv_from, ring.group, _KV_TAG) if i + 1 < n_steps else None
        for call in calls:
            part, part_lse = _block_fwd(q, *kv, call, ring.softmax_scale)
            state = _accumulate(state, part, part_lse, call, seqlen)
        if pending is not None:
            kv = tuple(_finish(pending))
    if state is None:  # no row sees any key (not reachable through the public options)
        b, _, h, _ = q.shape
        out = q.new_zeros((b, seqlen, h, v.shape[-1]))
        return out, q.new_full((b, h, seqlen), float("-inf"), dtype=torch.float32)
    acc, acc_lse = state
    return acc.to(q.dtype), acc_lse.transpose(1, 2).contiguous()


def _ring_backward(dout, dlse, q, k, v, out, lse, ring: _Ring):
    dq = None
    kv = (k, v)
    dkv_pending = None
    dk_acc = dv_acc = None
    n_steps = len(ring.steps)
    for i, calls in enumerate(ring.steps):
        kv_pending = _start(kv, ring.send_to, ring.recv_from, ring.group, _KV_TAG) if i + 1 < n_steps else None
        dq_parts, dk_parts, dv_parts = [], [], []
        for call in calls:
            dq_p, dk_p, dv_p = _block_bwd(dout, q, *kv, out, lse, dlse, call, ring.softmax_scale)
            dq_parts.append((call.q_start, call.q_stop, dq_p))
            dk_parts.append((call.k_start, call.k_stop, dk_p))
            dv_parts.append((call.k_start, call.k_stop, dv_p))
        if dq_parts:
            dq = _add_grads(dq, dq_parts, q)
        # the accumulated dK / dV of the block in hand arrive (sent after the previous step's compute)
        if dkv_pending is not None:
            dk_acc, dv_acc = _finish(dkv_pending)
        dk_acc = _add_grads(dk_acc, dk_parts, k)
        dv_acc = _add_grads(dv_acc, dv_parts, v)
        if i + 1 < n_steps:
            dkv_pending = _start((dk_acc, dv_acc), ring.send_to, ring.recv_from, ring.group, _DKV_TAG)
        if kv_pending is not None:
            kv = tuple(_finish(kv_pending))
    if n_steps > 1:  # the dK / dV in hand belong to the rank n_steps - 1 places back
        dk_acc, dv_acc = _finish(_start((dk_acc, dv_acc), ring.return_to, ring.return_from, ring.group,
                                        _RETURN_TAG))
    dq = _add_grads(dq, [], q)
    return dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        ctx.configs = active_configs()  # the backward plans under them (see call_configured)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        dq, dk, dv = call_configured(ctx.configs, _ring_backward, dout, None if dlse is None else dlse.contiguous(),
                                     q, k, v, out, lse, ctx.ring)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------------------------- checks

_DTYPES = ("float32", "float16", "bfloat16")


_HOST_GROUPS: dict = {}


def _host_group(group):
    """A gloo group over the same ranks as ``group`` (``group`` itself when it is gloo): metadata exchanged
    there stays on the host, so reading it does not wait for the device's queue (an NCCL all_gather read
    on the host would stall the host until every kernel queued before it had run)."""
    if str(dist.get_backend(group)) == "gloo":
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    if ranks not in _HOST_GROUPS:  # created on the group's first call, by all its ranks in the same order
        _HOST_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[ranks]


def _check_ranks_agree(q: Tensor, k: Tensor, v: Tensor, fields: dict, group) -> None:
    """All ranks of the group call with the same shapes and options (a mismatch would make the transfers
    hang or read garbage): one small all_gather of host values."""
    names = ["q", "k", "v", *fields]
    values = [*q.shape, *k.shape, *v.shape, *fields.values()]
    host = _host_group(group)
    mine = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(host))]
    dist.all_gather(gathered, mine, group=host)
    rows = [[float(x) for x in t.tolist()] for t in gathered]
    if all(r == rows[0] for r in rows):
        return

    def describe(r):
        shapes = ", ".join(f"{n} {tuple(int(x) for x in r[4 * i:4 * i + 4])}" for i, n in enumerate("qkv"))
        opts = ", ".join(f"{n}={r[12 + i]:g}" for i, n in enumerate(names[3:]))
        return f"{shapes}, {opts}"

    seen = "; ".join(f"rank {i}: {describe(r)}" for i, r in enumerate(rows))
    raise ValueError(f"q, k, v: every rank of the group must call ring_attention with the same shapes and "
                     f"options, got {seen}")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, window_size: tuple[int, int] = (-1, -1),
                   layout: str = "zigzag", return_lse: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention over a sequence sharded across the ranks of ``group``: equal to :func:`flash_attention` on
    the gathered sequence (to rounding), forward and backward, without gathering it.

    Args:
        q: this rank's queries ``(B, S_local, Hq, Dqk)``, the shard :func:`sequence_shard` gives (``layout``);
            float16, bfloat16 or float32; CUDA (NCCL) or CPU (gloo; kernels through Triton's interpreter).
        k, v: this rank's keys / values ``(B, S_local, Hkv, Dqk)`` / ``(B, S_local, Hkv, Dv)``; ``Hq`` a
            multiple of ``Hkv`` (GQA / MQA). Every rank passes the same shapes.
        group: the ``torch.distributed`` process group over which the sequence is sharded (None = the
            default group); rank r of the group holds shard r.
        causal, softmax_scale, window_size: as :func:`flash_attention`, over global positions.
        layout: ``"zigzag"`` (rank r holds chunks r and 2n-1-r of 2n: balanced causal work; S_local even)
            or ``"contiguous"``.
        return_lse: also return the float32 lse ``(B, Hq, S_local)`` of the local queries (differentiable).

    Each rank sends its K / V (and, in the backward, float32 dK / dV) to rank r+1 and receives from rank
    r-1, n-1 times (fewer when a sliding window ends the ring early), overlapped with the kernels. Each call
    first checks that all ranks passed the same shapes and options, with one small all_gather of host
    values (over a gloo group on the same ranks, created at the first call, when the group is NCCL).

    Returns:
        ``out`` ``(B, S_local, Hq, Dv)`` in q's dtype, or ``(out, lse)``.

    Example (in each of n processes, after ``torch.distributed.init_process_group``; q, k, v global)::

        rank, n = dist.get_rank(), dist.get_world_size()
        q_r, k_r, v_r = (sequence_shard(t, rank, n) for t in (q, k, v))
        out_r = ring_attention(q_r, k_r, v_r, causal=True)  # this rank's shard of flash_attention(q, k, v)
    """
    check_tensors({"q": q, "k": k, "v": v}, required=("q", "k", "v"))
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    layout_mod.check_layout(layout)
    shape, options = check_attention_args(
        q=(tuple(q.shape), dtype_name(q.dtype)), k=(tuple(k.shape), dtype_name(k.dtype)),
        v=(tuple(v.shape), dtype_name(v.dtype)), causal=causal, softmax_scale=softmax_scale,
        window_size=window_size)
    if shape.seqlen_k != shape.seqlen_q:
        raise ValueError(f"q, k: the local shards must have the same length, got q {tuple(q.shape)} and k "
                         f"{tuple(k.shape)}")
    layout_mod.check_local_length("q", shape.seqlen_q, layout)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialized; call torch.distributed.init_process_group "
                         "before ring_attention")
    group = group if group is not None else dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the group")
    backend = str(dist.get_backend(group))
    if backend == "nccl" and q.device.type != "cuda":
        raise ValueError(f"q: the group's backend is NCCL, which needs CUDA tensors; got tensors on {q.device}")
    if backend == "gloo" and q.device.type != "cpu":
        raise ValueError(f"q: the group's backend is gloo, which sends CPU tensors; got tensors on {q.device} "
                         "(use an NCCL group for CUDA tensors)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    left, right = options.window_left, options.window_right
    if world > 1:
        _check_ranks_agree(q, k, v, {
            "dtype": _DTYPES.index(shape.dtype), "causal": float(causal), "window_left": -1 if left is None else left,
            "window_right": -1 if right is None else right, "layout": layout_mod.LAYOUTS.index(layout),
            "softmax_scale": options.softmax_scale}, group)
    steps = layout_mod.ring_schedule(shape.seqlen_q, world, layout, left, right)[rank]
    n_steps = len(steps)
    peer = lambda r: dist.get_global_rank(group, r % world)  # noqa: E731
    ring = _Ring(steps=steps, softmax_scale=float(options.softmax_scale), group=group,
                 send_to=peer(rank + 1), recv_from=peer(rank - 1),
                 return_to=peer(rank - (n_steps - 1)), return_from=peer(rank + (n_steps - 1)))
    k, v = k.contiguous(), v.contiguous()  # sent as they are
    out, lse = _RingAttention.apply(q, k, v, ring)
    return (out, lse) if return_lse else out

