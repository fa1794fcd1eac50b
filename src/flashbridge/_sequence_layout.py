"""Sequence sharding for context-parallel (ring) attention, framework-neutral (pure Python): which tokens a
rank holds, how the ranks' shards go back into sequence order, and which (query rows, key rows) blocks each
ring step computes. Both front-ends (torch_api/ring.py, jax_api/ring.py) build on it.

Layouts of a sequence of S tokens over n ranks:

* ``"contiguous"``: rank r holds tokens ``[r S/n, (r+1) S/n)``.
* ``"zigzag"``: the sequence is cut in 2n chunks of ``S / 2n`` tokens and rank r holds chunk r followed by
  chunk ``2n-1-r``. Under a causal mask every rank then has the same work: each holds one early chunk (which
  sees few keys) and one late chunk (which sees many), where with contiguous shards the last rank would do
  n times the work of the first.

Ring steps: at step i, rank r holds the K/V shard of rank ``(r - i) mod n``. A shard is a list of segments
(contiguous runs of global positions). Each (query segment, key segment) pair is fully visible, fully
masked or partly masked under the causal mask / sliding window; masked pairs are skipped, and the others
are grouped into as few kernel calls as the mask allows, each a plain flash_attention call on contiguous
local rows whose window is shifted to the pair's global offset.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

LAYOUTS = ("contiguous", "zigzag")


# ------------------------------------------------------------------------------------------------ checks

def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a Python int >= 1, got {world_size!r}")
    return world_size


def check_rank(rank, world_size: int) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank: expected a Python int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: must be in [0, world_size) = [0, {world_size}), got {rank}")
    return rank


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def check_divisible(name: str, length: int, world_size: int, layout: str, what: str = "the sequence length") -> int:
    """The chunk length of a ``length``-token sequence split for ``world_size`` ranks in ``layout``;
    ``name`` / ``what`` name the argument and the dimension in the error."""
    parts = world_size * chunks_per_rank(check_layout(layout))
    if length % parts:
        how = " (2 chunks per rank)" if layout == "zigzag" else ""
        raise ValueError(f"{name}: {what} ({length}) must be a multiple of {parts} to split over {world_size} "
                         f"ranks in the {layout} layout{how}")
    return length // parts


def check_local_length(name: str, seqlen_local: int, layout: str) -> None:
    """A rank's shard length: zigzag shards are two chunks of equal length."""
    if layout == "zigzag" and seqlen_local % 2:
        raise ValueError(f"{name}: the local sequence length {seqlen_local} is odd; a zigzag shard holds two "
                         "chunks of equal length (shard with sequence_shard, or use layout='contiguous')")


# ------------------------------------------------------------------------------------------------ shards

def rank_chunks(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """Indices of the chunks rank ``rank`` holds, in local order (chunks of ``S / (n * chunks_per_rank)``)."""
    if layout == "zigzag":
        return (rank, 2 * world_size - 1 - rank)
    return (rank,)


def shard_ranges(seqlen: int, rank: int, world_size: int, layout: str) -> tuple[tuple[int, int], ...]:
    """Global token ranges ``(start, stop)`` of rank ``rank``'s shard, in local order (lengths checked by
    the caller with :func:`check_divisible`)."""
    chunk = seqlen // (world_size * chunks_per_rank(layout))
    return tuple((c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, world_size, layout))


def unshard_ranges(seqlen: int, world_size: int, layout: str) -> tuple[tuple[int, int], ...]:
    """Ranges ``(start, stop)`` of the concatenation of all ranks' shards (rank 0's first) that, taken in
    this order, give the sequence in global order."""
    per_rank = chunks_per_rank(layout)
    chunk = seqlen // (world_size * per_rank)
    where = {}  # global chunk index -> its position in the concatenation
    for r in range(world_size):
        for i, c in enumerate(rank_chunks(r, world_size, layout)):
            where[c] = r * per_rank + i
    return tuple((where[c] * chunk, (where[c] + 1) * chunk) for c in range(world_size * per_rank))


# ---------------------------------------------------------------------------------------------- ring plan

@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One flash_attention call of a ring step: local query rows ``[q_start, q_stop)`` against local rows
    ``[k_start, k_stop)`` of the K/V shard in hand.

    ``window_left`` / ``window_right`` are in the kernels' convention (query i sees key j when
    ``-left <= j - (i + Lk - Lq) <= right``, None = unbounded), already shifted by the two blocks' global
    offsets. ``causal``: the mask is the plain causal triangle of a square block (the kernels' plans pick
    their causal tiles for it). ``merge``: False when these rows receive their first partial state (it
    becomes the accumulator), True when it merges into the accumulated one.
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    window_left: Optional[int]
    window_right: Optional[int]
    causal: bool
    merge: bool


RingSteps = tuple[tuple[BlockCall, ...], ...]  # the calls of each step, for the steps every rank runs

_EMPTY, _FULL, _PARTIAL = 0, 1, 2


def _relation(q_seg, k_seg, left, right):
    """(kind, kernel window left, kernel window right) of global query positions ``q_seg`` = (start,
    length) against keys ``k_seg``, under the global window ``-left <= j - i <= right`` (None =
    unbounded)."""
    (qs, lq), (ks, lk) = q_seg, k_seg
    d_min, d_max = ks - (qs + lq - 1), (ks + lk - 1) - qs  # the extremes of j - i over the block
    if (left is not None and d_max < -left) or (right is not None and d_min > right):
        return _EMPTY, None, None
    left_free = left is None or d_min >= -left  # no pair of the block is cut by the left edge
    right_free = right is None or d_max <= right
    if left_free and right_free:
        return _FULL, None, None
    # j - i = (j' - (i' + lk - lq)) + (ks - qs) + (lk - lq) in local coordinates i', j'
    shift = (ks - qs) + (lk - lq)
    return _PARTIAL, (None if left_free else left + shift), (None if right_free else right - shift)


def _runs(indices):
    """Maximal runs of consecutive integers in sorted ``indices``, as (first, last)."""
    runs = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [tuple(r) for r in runs]


def _step_blocks(q_segs, k_segs, left, right, self_block):
    """Blocks (q seg first, q seg last, k seg first, k seg last, kernel left, kernel right, causal) of one
    step; a segment is (global start, length) and segments are contiguous in local order."""
    if self_block and left is None and right == 0:
        # Segments sorted by global position and the same on both sides: the causal mask on local rows is
        # the global one, one call.
        return [(0, len(q_segs) - 1, 0, len(k_segs) - 1, None, 0, True)]
    blocks = []
    full = []  # per query segment, the key segments it sees entirely
    for a, qseg in enumerate(q_segs):
        seen = []
        for b, kseg in enumerate(k_segs):
            kind, kl, kr = _relation(qseg, kseg, left, right)
            if kind == _FULL:
                seen.append(b)
            elif kind == _PARTIAL:
                square = qseg[1] == kseg[1]
                blocks.append((a, a, b, b, kl, kr, square and kl is None and kr == 0))
        full.append(tuple(seen))
    # fully visible pairs: consecutive query segments seeing the same key segments share a call, and
    # consecutive key segments join one call
    a = 0
    while a < len(q_segs):
        last = a
        while last + 1 < len(q_segs) and full[last + 1] == full[a]:
            last += 1
        for b0, b1 in _runs(full[a]):
            blocks.append((a, last, b0, b1, None, None, False))
        a = last + 1
    return blocks


def _segments(seqlen_local: int, rank: int, world_size: int, layout: str):
    """(global start, length) of each segment of rank ``rank``'s shard, in local order."""
    return [(a, b - a) for a, b in shard_ranges(seqlen_local * world_size, rank, world_size, layout)]


@functools.lru_cache(maxsize=256)
def ring_schedule(seqlen_local: int, world_size: int, layout: str, window_left: Optional[int],
                  window_right: Optional[int]) -> tuple[RingSteps, ...]:
    """For every rank, the calls of each ring step (:class:`BlockCall`), over the number of steps all ranks
    run: one more than the last step at which any rank has work (a sliding window can end the ring early).

    ``window_left`` / ``window_right``: the global mask ``-left <= j - i <= right`` over global positions
    (None = unbounded; causal is right = 0). Step 0 (each rank's own shard) always covers every local row
    when both sides are >= 0 or unbounded (each token sees itself).
    """
    seg_len = seqlen_local // chunks_per_rank(layout)
    per_rank_blocks = []
    for r in range(world_size):
        q_segs = _segments(seqlen_local, r, world_size, layout)
        steps = []
        for i in range(world_size):
            k_segs = _segments(seqlen_local, (r - i) % world_size, world_size, layout)
            steps.append(_step_blocks(q_segs, k_segs, window_left, window_right, i == 0))
        per_rank_blocks.append(steps)
    n_steps = 1 + max((i for steps in per_rank_blocks for i, blocks in enumerate(steps) if blocks), default=0)

    schedule = []
    for steps in per_rank_blocks:
        seen = set()  # query segments that hold a partial state
        ring = []
        for blocks in steps[:n_steps]:
            calls = []
            for a0, a1, b0, b1, kl, kr, causal in blocks:
                segs = set(range(a0, a1 + 1))
                calls.append(BlockCall(a0 * seg_len, (a1 + 1) * seg_len, b0 * seg_len, (b1 + 1) * seg_len,
                                       kl, kr, causal, merge=bool(segs & seen)))
                seen |= segs
            ring.append(tuple(calls))
        schedule.append(tuple(ring))
    return tuple(schedule)

