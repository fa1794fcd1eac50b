"""The resource model: candidate tiles of each kernel, what each costs a GPU, which survive, which wins.

For one kernel, one call shape and one :class:`~flashbridge.tiles.profiles.GPUProfile`, every candidate
(block sizes, warps, pipeline stages) gets an :class:`Estimate`:

* shared memory: what Triton allocates for the pipelined ``tl.dot`` operands (``stages`` buffers of each
  operand streamed through the loop, one of each operand that stays resident) plus the scratch of
  cross-warp reductions; the forward's three key-block loops share one pool (the widest wins);
* registers per thread: float32 accumulators, score tiles and 16-bit operands held in registers, divided
  over the block's threads, plus a fixed share for addresses, indices and softmax statistics;
* occupancy: resident blocks per SM, limited by shared memory, registers, threads or the block limit;
* arithmetic intensity: FLOP per byte a program streams from L2 / HBM.

A candidate is pruned by a hard limit (shared memory above the per-block maximum, more registers than a
thread may hold: spills; a shape the MMA cannot fill), then by dominance (another candidate is at least as
good on every merit and better on one), then by rank: the survivors are the best 3-6 by the kernel's merit
order, and the first of them is the model's choice. The plan's own default (its in-source table, read by
building the plan) is marked, kept or pruned like any other candidate, so the table says whether the
default fits the GPU at hand.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from ..core_kernels._plan import DTYPE_BYTES, Target, cdiv, next_power_of_2
from .profiles import KB, GPUProfile

MAX_SURVIVORS = 5
MIN_SURVIVORS = 3  # dominated candidates fill up to this many survivors (the tuning sweep's candidates)
BASE_REGS = 40  # addresses, loop counters, masks, softmax statistics: the share of a thread no tile pays for
# Little's law for memory-bound kernels: bytes in flight per SM to cover this latency at full bandwidth
MEMORY_LATENCY_S = 1.0e-6


@dataclasses.dataclass(frozen=True)
class Tile:
    """One candidate: rows (or query / key block) ``block_m``, columns or key block ``block_n``, warps,
    pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"({self.block_m}, {self.block_n}, {self.num_warps}, {self.num_stages})"


@dataclasses.dataclass(frozen=True)
class Estimate:
    smem: int  # bytes per block
    regs: int  # per thread
    threads: int
    blocks_per_sm: int
    limiter: str  # what bounds blocks_per_sm
    intensity: float  # FLOP per streamed byte (0 for kernels without MMAs)
    inflight: int  # bytes one block has in flight from memory (memory-bound kernels)
    parts: tuple[tuple[str, int], ...] = ()  # smem terms, for --explain

    @property
    def warps_per_sm(self) -> int:
        return self.blocks_per_sm * self.threads // 32


@dataclasses.dataclass
class Row:
    tile: Tile
    est: Estimate
    verdict: str = "kept"  # "kept" or "pruned"
    reason: str = ""
    default: bool = False
    choice: bool = False
    merits: tuple = ()
    note: str = ""  # a caveat on a kept candidate (near the register cap)


NEAR_CAP = 0.75  # estimates above this share of the register cap: ptxas may spill a few bytes (or not)


@dataclasses.dataclass
class Report:
    """The candidate table of one kernel for one shape on one GPU."""

    kernel: str
    title: str
    shape: str
    gpu: GPUProfile
    rows: list[Row]
    merit_names: tuple[str, ...]
    rule: str  # the merit order in words
    notes: list[str] = dataclasses.field(default_factory=list)
    case: Any = None  # the call as the model saw it

    @property
    def survivors(self) -> list[Row]:
        return [r for r in self.rows if r.verdict == "kept"]

    @property
    def choice(self) -> Optional[Row]:
        return next((r for r in self.rows if r.choice), None)

    @property
    def default(self) -> Optional[Row]:
        return next((r for r in self.rows if r.default), None)

    def row(self, tile: Tile) -> Optional[Row]:
        return next((r for r in self.rows if r.tile == tile), None)


# ------------------------------------------------------------------------------------------ shared helpers

def occupancy(smem: int, regs: int, warps: int, gpu: GPUProfile) -> tuple[int, str]:
    """Resident blocks per SM and the resource that limits them."""
    threads = warps * gpu.warp_size
    regs_alloc = min(gpu.max_regs_per_thread, -(-max(regs, 1) // gpu.reg_alloc_unit) * gpu.reg_alloc_unit)
    limits = {
        "shared memory": gpu.smem_per_sm // (smem + gpu.smem_reserved_per_block) if smem else gpu.max_blocks_per_sm,
        "registers": gpu.regs_per_sm // (regs_alloc * threads),
        "threads": min(gpu.max_threads_per_sm // threads, gpu.max_warps_per_sm // warps),
        "blocks": gpu.max_blocks_per_sm,
    }
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


def _kb(n: int) -> str:
    return f"{n / KB:.0f} KB" if n >= KB else f"{n} B"


def _pad(d: int) -> int:
    return max(16, next_power_of_2(d))


def reg_cap(warps: int, gpu: GPUProfile) -> int:
    """The most registers a thread of a ``warps``-warp block may use (255 on NVIDIA, less for big blocks)."""
    per_thread = gpu.regs_per_sm // (warps * gpu.warp_size)
    return min(gpu.max_regs_per_thread, per_thread - per_thread % gpu.reg_alloc_unit)


# ------------------------------------------------------------------------------------------ kernel models

@dataclasses.dataclass(frozen=True)
class KernelModel:
    """How one kernel's candidates are generated, estimated, judged, and turned into a plan config."""

    name: str
    title: str
    op: str  # the tuning cache's op name
    space: Callable[[Any, GPUProfile], list[Tile]]
    estimate: Callable[[Tile, Any, GPUProfile], Estimate]
    hard: Callable[[Tile, Estimate, Any, GPUProfile], str]  # "" = passes
    merits: Callable[[Tile, Estimate, Any, GPUProfile], tuple]  # larger is better, in priority order
    merit_names: tuple[str, ...]
    rule: str
    config: Callable[[Tile], Any]  # the family's Config that makes the plan use this tile
    launch: Callable[[Any, Target, Any], Any]  # (shape, target, config) -> the kernel's Launch
    tile_of: Callable[[Any], Tile]  # a Launch -> its tile
    describe: Callable[[Any], str]


def build_report(model: KernelModel, shape, gpu: GPUProfile, *, keep: int = MAX_SURVIVORS,
                 with_default: bool = True) -> Report:
    """Estimate every candidate, prune, rank and choose (see the module docstring). ``with_default``: also
    build the plan's own tile (what the tuning cache resolves), which plans asking for the model's choice
    skip."""
    target = Target(interpret=False, num_sms=gpu.sms, gpu=gpu)
    default = model.tile_of(model.launch(shape, target, None)) if with_default else None
    tiles = list(dict.fromkeys([*model.space(shape, gpu), *([default] if with_default else [])]))
    rows = []
    for tile in tiles:
        est = model.estimate(tile, shape, gpu)
        reason = model.hard(tile, est, shape, gpu)
        if not reason and est.blocks_per_sm < 1:
            reason = f"does not fit an SM ({est.limiter})"
        row = Row(tile, est, "pruned" if reason else "kept", reason, default=tile == default)
        row.merits = model.merits(tile, est, shape, gpu)
        cap = reg_cap(tile.num_warps, gpu)
        if not reason and est.regs >= NEAR_CAP * cap:
            row.note = f"near the register cap (~{est.regs} of {cap}): ptxas may spill a few bytes"
        rows.append(row)
    passed = sorted((r for r in rows if r.verdict == "kept"), key=lambda r: r.merits, reverse=True)
    front = []
    for r in passed:  # dominance: another candidate at least as good on every merit, better on one
        better = [o for o in passed if o is not r and all(a >= b for a, b in zip(o.merits, r.merits))
                  and o.merits != r.merits]
        if better:
            best = max(better, key=lambda o: o.merits)
            r.reason = f"dominated by {best.tile}: {_why_better(model, best, r)}"
        else:
            front.append(r)
    alive = front[:keep] + [r for r in passed if r not in front][:max(0, MIN_SURVIVORS - len(front))]
    alive.sort(key=lambda r: r.merits, reverse=True)
    for i, r in enumerate(passed):
        if r in alive:
            r.reason = "kept to time: " + r.reason if r.reason else ""
        else:
            r.verdict = "pruned"
            r.reason = r.reason or f"ranked {i + 1}: below the {keep} kept ({model.rule})"
    if alive:
        alive[0].choice = True
    order = {id(r): i for i, r in enumerate(alive)}
    rows.sort(key=lambda r: (r.verdict != "kept", order.get(id(r), 0), not r.default))
    return Report(model.name, model.title, model.describe(shape), gpu, rows, model.merit_names, model.rule,
                  case=shape)


def _why_better(model: KernelModel, a: Row, b: Row) -> str:
    parts = [f"{name} {_fmt(x)} vs {_fmt(y)}" for name, x, y in zip(model.merit_names, a.merits, b.merits) if x > y]
    return ", ".join(parts) + ", nothing worse"


def _fmt(x) -> str:
    return f"{x:.0f}" if isinstance(x, float) and x >= 10 else f"{x:g}" if isinstance(x, float) else str(x)


# ------------------------------------------------------------------------------------------------ attention

@dataclasses.dataclass(frozen=True)
class AttnCase:
    """An attention call as the model sees it: the plan's shape and options."""

    shape: Any  # flash_attn.plan.AttnShape
    options: Any  # flash_attn.plan.AttnOptions


def attention_case(*, head_dim: int = 128, seqlen: int = 4096, batch: Optional[int] = None, heads: int = 16,
                   heads_kv: Optional[int] = None, causal: bool = False, dtype: str = "bfloat16",
                   head_dim_v: Optional[int] = None) -> AttnCase:
    """The attention benchmark's shape by default: batch x seqlen = 16384 tokens, 16 heads."""
    from ..core_kernels.flash_attn.plan import check_attention_args

    batch = batch or max(1, 16384 // seqlen)
    q = ((batch, seqlen, heads, head_dim), dtype)
    k = ((batch, seqlen, heads_kv or heads, head_dim), dtype)
    v = ((batch, seqlen, heads_kv or heads, head_dim_v or head_dim), dtype)
    shape, options = check_attention_args(q=q, k=k, v=v, causal=causal)
    return AttnCase(shape, options)


def _attn_describe(case: AttnCase) -> str:
    s, o = case.shape, case.options
    heads = f"H={s.heads_q}" + (f"/{s.heads_kv}" if s.heads_kv != s.heads_q else "")
    return (f"B={s.batch} S={s.seqlen_q} {heads} D={s.head_dim_qk}"
            + (f" Dv={s.head_dim_v}" if s.head_dim_v != s.head_dim_qk else "")
            + f" {s.dtype}{' causal' if o.causal else ''}")


def _attn_dims(case: AttnCase) -> tuple[int, int, int]:
    s = case.shape
    return _pad(s.head_dim_qk), _pad(s.head_dim_v), DTYPE_BYTES[s.dtype]


def _attn_mma_rule(rows: int, warps: int, what: str) -> str:
    if rows < 16 * warps:
        return (f"{rows} {what} over {warps} warps: under 16 rows a warp (64 a warpgroup), the MMAs run "
                "partly empty")
    return ""


def _attn_plan_launch(kind: str):
    def launch(case: AttnCase, target: Target, config):
        from ..core_kernels.flash_attn.plan import AttentionConfig, plan_attention_bwd, plan_attention_fwd

        if kind == "fwd":
            return plan_attention_fwd(case.shape, case.options, target=target, config=config).launches[0]
        config = dataclasses.replace(config or AttentionConfig(), fused_backward=False)
        plan = plan_attention_bwd(case.shape, case.options, target=target, config=config)
        suffix = "attn_bwd_dkdv_kernel" if kind == "dkdv" else "attn_bwd_dq_kernel"
        return next(l for l in plan.launches if l.kernel.endswith(suffix))
    return launch


def _tile_from(launch, m="BLOCK_M", n="BLOCK_N") -> Tile:
    c = launch.constexpr_dict()
    return Tile(c[m], c[n], launch.num_warps, launch.num_stages)


def _attn_config(prefix: str):
    def config(tile: Tile):
        from ..core_kernels.flash_attn.plan import AttentionConfig

        return AttentionConfig(**{f"{prefix}block_m": tile.block_m, f"{prefix}block_n": tile.block_n,
                                  f"{prefix}num_warps": tile.num_warps, f"{prefix}num_stages": tile.num_stages})
    return config


def _attn_space(kind: str):
    def space(case: AttnCase, gpu: GPUProfile) -> list[Tile]:
        ms = (16, 32, 64, 128) if kind == "dkdv" else (32, 64, 128)
        ns = (32, 64, 128)
        return [Tile(m, n, w, s) for m in ms for n in ns for w in (4, 8) for s in (1, 2, 3, 4)]
    return space


def _fwd_loops(tile: Tile, case: AttnCase, gpu: GPUProfile) -> list[tuple[int, int]]:
    """(key block width, stages) of the forward's loops: the visible segment and the masked ones (their
    width and depth from the plan's MASKED_BLOCK_N / MASKED_STAGES for this tile)."""
    launch = _attn_plan_launch("fwd")(case, Target(False, gpu.sms, gpu), _attn_config("")(tile))
    c = launch.constexpr_dict()
    return [(tile.block_n, tile.num_stages), (c["MASKED_BLOCK_N"], c["MASKED_STAGES"] or tile.num_stages)]


def _fwd_estimate(tile: Tile, case: AttnCase, gpu: GPUProfile) -> Estimate:
    dqk, dv, b = _attn_dims(case)
    q = tile.block_m * dqk * b  # q: the first dot's A operand, resident in shared memory
    loops = [(stages * n * (dqk + dv) * b, n, stages) for n, stages in _fwd_loops(tile, case, gpu)]
    kv, n_w, s_w = max(loops)
    smem = q + kv
    threads = tile.num_warps * gpu.warp_size
    acc = tile.block_m * dv  # float32 output accumulator
    scores = tile.block_m * tile.block_n  # float32 scores, then 16-bit probabilities (the second dot's A)
    q_regs = 0 if gpu.wgmma else tile.block_m * dqk * b // 4  # mma.sync keeps its A operand in registers
    # causal / windowed calls: the masked segments' positions and boolean mask, 1.5 registers per score
    masked = _fwd_loops(tile, case, gpu)[1][0] * tile.block_m * 3 // 2 if case.options.has_local else 0
    regs = BASE_REGS + (acc + scores + scores * b // 4 + masked) // threads + q_regs // threads
    blocks, limiter = occupancy(smem, regs, tile.num_warps, gpu)
    intensity = 2 * tile.block_m / b  # FLOP per byte of K and V streamed: each key serves block_m rows
    parts = (("q", q), (f"k+v x {s_w} stages of {n_w} keys", kv))
    return Estimate(smem, regs, threads, blocks, limiter, intensity, 0, parts)


def _dkdv_estimate(tile: Tile, case: AttnCase, gpu: GPUProfile) -> Estimate:
    dqk, dv, b = _attn_dims(case)
    split = _col_split(case, gpu)
    kv = tile.block_n * (dqk + dv) * b  # k and v stay resident (the A operands of the score dots)
    stream = tile.num_stages * tile.block_m * (dqk + dv) * b  # q and dout, pipelined (dot operands)
    rows = (tile.num_stages - 1) * tile.block_m * 8  # lse and delta (float32): plain loads keep stages - 1 buffers
    smem = kv + stream + rows
    threads = tile.num_warps * gpu.warp_size
    acc = tile.block_n * (dqk + dv) // split  # float32 dK and dV accumulators
    scores = 2 * tile.block_m * tile.block_n  # p^T and dp^T in float32, then 16-bit p^T, ds^T
    regs = BASE_REGS + (acc + scores + scores * b // 4) // threads
    blocks, limiter = occupancy(smem, regs, tile.num_warps, gpu)
    intensity = 2 * tile.block_n * 4 / (4 * b)  # each streamed query row meets block_n keys in 4 products
    parts = (("k+v resident", kv), (f"q+dout x {tile.num_stages} stages", stream), ("lse+delta", rows))
    return Estimate(smem, regs, threads, blocks, limiter, intensity, 0, parts)


def _dq_estimate(tile: Tile, case: AttnCase, gpu: GPUProfile) -> Estimate:
    dqk, dv, b = _attn_dims(case)
    qdo = tile.block_m * (dqk + dv) * b  # q and dout resident
    stream = tile.num_stages * tile.block_n * (dqk + dv) * b  # k and v, pipelined
    smem = qdo + stream
    threads = tile.num_warps * gpu.warp_size
    acc = tile.block_m * dqk
    scores = 2 * tile.block_m * tile.block_n
    regs = BASE_REGS + (acc + scores + scores * b // 4) // threads
    blocks, limiter = occupancy(smem, regs, tile.num_warps, gpu)
    intensity = 2 * tile.block_m * 3 / (2 * b)  # three products per streamed key and value row pair
    parts = (("q+dout resident", qdo), (f"k+v x {tile.num_stages} stages", stream))
    return Estimate(smem, regs, threads, blocks, limiter, intensity, 0, parts)


def _col_split(case: AttnCase, gpu: GPUProfile) -> int:
    from ..core_kernels.flash_attn.plan import AttentionConfig, _dkdv_col_split

    return _dkdv_col_split(AttentionConfig(), case.shape, case.options, Target(False, gpu.sms, gpu))


def _attn_hard(kind: str):
    def hard(tile: Tile, est: Estimate, case: AttnCase, gpu: GPUProfile) -> str:
        if est.smem > gpu.smem_per_block:
            return f"shared memory {_kb(est.smem)} over the {_kb(gpu.smem_per_block)} a block may use"
        cap = reg_cap(tile.num_warps, gpu)
        if est.regs > cap:
            return f"spills expected: ~{est.regs} registers a thread needed, {cap} available"
        if tile.num_stages < 2:
            return "one stage: the next block's loads wait for this block's MMAs (no overlap)"
        rows = tile.block_n if kind == "dkdv" else tile.block_m
        what = "keys" if kind == "dkdv" else "query rows"
        return _attn_mma_rule(rows, tile.num_warps, what)
    return hard


def _attn_merits(kind: str):
    def merits(tile: Tile, est: Estimate, case: AttnCase, gpu: GPUProfile) -> tuple:
        # reuse first (bytes per FLOP), then the pipeline up to 3 stages, then the step width up to the head
        # dim (fewer, larger MMAs per loaded block; a step wider than the head dim makes the softmax's work
        # per step outgrow the MMAs'), then resident warps (latency hiding), then deeper pipelines
        reuse = tile.block_n if kind == "dkdv" else tile.block_m
        step = tile.block_m if kind == "dkdv" else tile.block_n
        d = max(_attn_dims(case)[:2])
        if kind == "fwd" and (case.options.causal or case.options.has_local):
            # a masked forward's diagonal blocks compute ~block_m^2 / 2 scores that are thrown away; past the
            # head dim more rows waste more than they save in bytes (H200, D=64 causal: 64 rows 1.22-1.36x
            # faster than 128)
            reuse = min(reuse, d)
        return (reuse, min(tile.num_stages, 3), min(step, d), min(est.warps_per_sm, 16), tile.num_stages)
    return merits


_ATTN_MERITS = ("reuse", "stages(<=3)", "step(<=D)", "warps/SM(<=16)", "stages")
_ATTN_RULE = ("most rows sharing each streamed block (causal / windowed forwards: up to the head dim), then "
              "pipeline depth up to 3, then the widest step up to the head dim, then resident warps")


def _attn_model(kind: str, title: str, estimate, prefix: str) -> KernelModel:
    return KernelModel(
        name=f"attention_{kind}", title=title, op=f"attention_{kind}", space=_attn_space(kind), estimate=estimate,
        hard=_attn_hard(kind), merits=_attn_merits(kind), merit_names=_ATTN_MERITS, rule=_ATTN_RULE,
        config=_attn_config(prefix), launch=_attn_plan_launch(kind), tile_of=_tile_from, describe=_attn_describe)


ATTENTION_FWD = _attn_model("fwd", "attention forward (attn_fwd_kernel): block_m query rows, block_n keys a step",
                            _fwd_estimate, "")
ATTENTION_DKDV = _attn_model("dkdv", "attention backward dK/dV (attn_bwd_dkdv_kernel): block_n keys a program, "
                             "block_m query rows a step", _dkdv_estimate, "dkdv_")
ATTENTION_DQ = _attn_model("dq", "attention backward dQ (attn_bwd_dq_kernel): block_m query rows a program, "
                           "block_n keys a step", _dq_estimate, "dq_")


# --------------------------------------------------------------------------------------------------- decode

@dataclasses.dataclass(frozen=True)
class DecodeCase:
    shape: Any  # decode.plan.DecodeShape
    options: Any


def decode_case(*, head_dim: int = 128, batch: int = 1, cache_len: int = 16384, heads: int = 32, heads_kv: int = 8,
                dtype: str = "bfloat16") -> DecodeCase:
    """The decode benchmark's shape by default: one query token, Hq=32, Hkv=8, a contiguous 16-bit cache."""
    from ..core_kernels.decode.plan import check_decode_args

    q = ((batch, 1, heads, head_dim), dtype)
    cache = ((batch, cache_len, heads_kv, head_dim), dtype)
    shape, options, _ = check_decode_args(q=q, k_cache=cache, v_cache=cache, cache_seqlens=((batch,), "int32"))
    return DecodeCase(shape, options)


def _decode_launch(case: DecodeCase, target: Target, config):
    from ..core_kernels.decode.plan import plan_decode

    plan = plan_decode(case.shape, case.options, target=target, config=config)
    return next(l for l in plan.launches if l.kernel.endswith("decode_fwd_kernel"))


def _decode_config(tile: Tile):
    from ..core_kernels.decode.plan import DecodeConfig

    return DecodeConfig(block_n=tile.block_n, block_m=tile.block_m, num_warps=tile.num_warps,
                        num_stages=tile.num_stages)


def _decode_rows(case: DecodeCase) -> int:
    return max(16, next_power_of_2(case.shape.seqlen_q * case.shape.group))


def _decode_space(case: DecodeCase, gpu: GPUProfile) -> list[Tile]:
    m = min(64, _decode_rows(case))
    return [Tile(m, n, w, s) for n in (32, 64, 128, 256) for w in (4, 8) for s in (2, 3, 4, 5)]


def _decode_estimate(tile: Tile, case: DecodeCase, gpu: GPUProfile) -> Estimate:
    """A decode program has at most a few dozen rows: its dots run on mma.sync (wgmma needs 64 rows a
    warpgroup), whose pipelined loads keep ``stages - 1`` buffers of k and v; q stays in shared memory and
    the probabilities pass through it on their way to the second dot's operand layout."""
    s = case.shape
    dqk, dv = _pad(s.head_dim_qk), _pad(s.head_dim_v)
    b, cb = DTYPE_BYTES[s.dtype], DTYPE_BYTES[s.cache.dtype]
    q = tile.block_m * dqk * b
    p = tile.block_m * tile.block_n * b
    kv = (tile.num_stages - 1) * tile.block_n * (dqk + dv) * cb
    smem = q + p + kv
    threads = tile.num_warps * gpu.warp_size
    fragments = min(tile.block_n, 64) * (dqk + dv) * cb // 4  # k / v operand fragments, up to 64 keys at a time
    regs = BASE_REGS + (tile.block_m * dv + tile.block_m * tile.block_n * (4 + b) // 4 + fragments) // threads
    blocks, limiter = occupancy(smem, regs, tile.num_warps, gpu)
    # memory-bound (2 x group / bytes FLOP per cache byte): the bytes in flight are the figure that matters
    return Estimate(smem, regs, threads, blocks, limiter, 0.0, kv,
                    (("q", q), ("p", p), (f"k+v x {tile.num_stages - 1} buffers", kv)))


def _programs(case: DecodeCase, tile: Tile, gpu: GPUProfile) -> int:
    launch = _decode_launch(case, Target(False, gpu.sms, gpu), _decode_config(tile))
    return math.prod(launch.grid)


def _needed_inflight(gpu: GPUProfile) -> int:
    return int(gpu.hbm_tb_s * 1e12 * MEMORY_LATENCY_S / gpu.sms)


def _decode_hard(tile: Tile, est: Estimate, case: DecodeCase, gpu: GPUProfile) -> str:
    if est.smem > gpu.smem_per_block:
        return f"shared memory {_kb(est.smem)} over the {_kb(gpu.smem_per_block)} a block may use"
    cap = reg_cap(tile.num_warps, gpu)
    if est.regs > cap:
        return f"spills expected: ~{est.regs} registers a thread needed, {cap} available"
    per_sm = min(est.blocks_per_sm, max(1, _programs(case, tile, gpu) // gpu.sms))
    need = _needed_inflight(gpu)
    if per_sm * est.inflight < need:
        return (f"{_kb(per_sm * est.inflight)} in flight per SM, under the {_kb(need)} that "
                f"{gpu.hbm_tb_s:g} TB/s x {MEMORY_LATENCY_S * 1e9:.0f} ns needs")
    return ""


def _decode_merits(tile: Tile, est: Estimate, case: DecodeCase, gpu: GPUProfile) -> tuple:
    # memory-bound: enough bytes in flight passed the hard rule; then every program resident at once (no
    # second wave), then wide key steps (each step is a dependent chain: load, dot, softmax, dot), then up to
    # 3 stages, fewer warps, the smaller footprint
    one_wave = est.blocks_per_sm * gpu.sms >= _programs(case, tile, gpu)
    return (int(one_wave), min(tile.block_n, 128), min(tile.num_stages, 3), -tile.num_warps, -est.smem)


DECODE = KernelModel(
    name="decode", title="decode (decode_fwd_kernel): block_m packed (token x GQA head) rows, block_n keys a step",
    op="decode", space=_decode_space, estimate=_decode_estimate, hard=_decode_hard, merits=_decode_merits,
    merit_names=("one wave", "step(<=128)", "stages(<=3)", "-warps", "-smem"),
    rule="enough bytes in flight to cover memory latency, then one wave of programs, then the widest key "
         "step, then up to 3 stages",
    config=_decode_config, launch=_decode_launch, tile_of=_tile_from,
    describe=lambda c: (f"B={c.shape.batch} cache={c.shape.cache.capacity} Hq={c.shape.heads_q} "
                        f"Hkv={c.shape.heads_kv} D={c.shape.head_dim_qk} {c.shape.dtype}"))


# ---------------------------------------------------------------------------------------------------- norms

@dataclasses.dataclass(frozen=True)
class RowsCase:
    """A row-wise kernel's call: ``rows`` x ``cols`` in ``dtype`` (norms: hidden size; cross-entropy: vocab)."""

    rows: int
    cols: int
    dtype: str
    backward: bool = False


def norm_case(*, rows: int = 16384, cols: int = 8192, dtype: str = "bfloat16", backward: bool = False) -> RowsCase:
    return RowsCase(rows, cols, dtype, backward)


def _norm_launch(case: RowsCase, target: Target, config):
    from ..core_kernels.norms.plan import plan_norm_bwd, plan_norm_fwd

    if case.backward:
        return plan_norm_bwd(case.rows, case.cols, dx_dtype=case.dtype, weight_dtype=case.dtype, bias_dtype=None,
                             is_rms=True, has_dh=False, dropout_p=0.0, target=target, config=config).launches[0]
    return plan_norm_fwd(case.rows, case.cols, x_dtype=case.dtype, residual_dtype=None, is_rms=True,
                         has_weight=True, has_bias=False, has_post_residual=False, dropout_p=0.0, eps=1e-6,
                         target=target, config=config).launches[0]


def _norm_tile(launch) -> Tile:
    c = launch.constexpr_dict()
    return Tile(c["BLOCK_M"], next_power_of_2(c["N_COLS"]), launch.num_warps, launch.num_stages)


def _norm_config(tile: Tile):
    from ..core_kernels.norms.plan import NormConfig

    return NormConfig(block_m=tile.block_m, num_warps=tile.num_warps)


def _norm_space(case: RowsCase, gpu: GPUProfile) -> list[Tile]:
    n = next_power_of_2(case.cols)
    return [Tile(m, n, w, 1) for m in (1, 2, 4, 8, 16) for w in (2, 4, 8, 16)]


def _rowwise_estimate(tile: Tile, case: RowsCase, gpu: GPUProfile, *, regs: Callable[[int, int], int],
                      convert_bytes: int = 0) -> Estimate:
    """Row tiles held in registers. Shared memory: a row reduction crosses the warps that split a row, one
    float32 slot per (row, warp); ``convert_bytes`` per thread of layout-conversion scratch (the norm
    backward's) shares the pool. ``regs(elements a thread holds, row-vector elements a thread holds)``."""
    threads = tile.num_warps * gpu.warp_size
    elems = tile.block_m * tile.block_n
    vec = 16 // DTYPE_BYTES[case.dtype]  # a thread's 16-byte vector
    warps_per_row = max(1, min(tile.num_warps, tile.block_n // (vec * gpu.warp_size)))
    reduction = tile.block_m * warps_per_row * 4 if tile.num_warps > 1 else 0
    smem = max(reduction, convert_bytes * threads)
    est_regs = regs(max(1, elems // threads), max(1, tile.block_n // threads))
    blocks, limiter = occupancy(smem, est_regs, tile.num_warps, gpu)
    inflight = elems * DTYPE_BYTES[case.dtype]
    parts = (("row reduction", reduction),)
    if convert_bytes:
        parts += (("layout conversion", convert_bytes * threads),)
    return Estimate(smem, est_regs, threads, blocks, limiter, 0.0, inflight, parts)


def _norm_estimate(tile: Tile, case: RowsCase, gpu: GPUProfile) -> Estimate:
    if case.backward:  # dy, h and the products in float32, plus the persistent dweight partial row
        return _rowwise_estimate(tile, case, gpu, regs=lambda e, row: 3 * e + 2 * row, convert_bytes=32)
    return _rowwise_estimate(tile, case, gpu, regs=lambda e, row: 16 + 5 * e // 4)


def _rowwise_hard(tile: Tile, est: Estimate, case: RowsCase, gpu: GPUProfile) -> str:
    if est.smem > gpu.smem_per_block:
        return f"shared memory {_kb(est.smem)} over the {_kb(gpu.smem_per_block)} a block may use"
    cap = reg_cap(tile.num_warps, gpu)
    if est.regs > cap:
        return f"spills expected: ~{est.regs} registers a thread needed, {cap} available"
    per_thread = tile.block_m * tile.block_n // est.threads
    vector = 16 // DTYPE_BYTES[case.dtype]
    if per_thread < vector:
        return f"{per_thread} elements a thread: loads narrower than 16 bytes"
    if tile.block_m > next_power_of_2(case.rows):
        return "more rows a program than the call has"
    return ""


def _rowwise_merits(per_thread_target: int, program_elems: int):
    def merits(tile: Tile, est: Estimate, case: RowsCase, gpu: GPUProfile) -> tuple:
        programs = cdiv(case.rows, tile.block_m)
        waves_ok = programs >= 2 * gpu.sms  # every SM gets two programs: no idle SMs in the last wave
        per_thread = tile.block_m * tile.block_n // est.threads
        enough = min(est.blocks_per_sm, max(1, programs // gpu.sms)) * est.inflight >= _needed_inflight(gpu)
        # bytes in flight first, then every SM busy, then the elements a thread holds (its 16-byte loads in
        # flight), then the work of a program up to program_elems (fewer programs), fewer warps, fewer stages
        return (int(enough), int(waves_ok), -abs(math.log2(max(per_thread, 1)) - math.log2(per_thread_target)),
                min(tile.block_m * tile.block_n, program_elems), -tile.num_warps, -tile.num_stages)
    return merits


_ROW_MERITS = ("inflight", "2 programs/SM", "elements/thread", "elements/program", "-warps", "-stages")


NORM_FWD = KernelModel(
    name="norm_fwd", title="RMSNorm / LayerNorm forward (norm_fwd_kernel): block_m whole rows a program",
    op="norm_fwd", space=_norm_space, estimate=_norm_estimate, hard=_rowwise_hard,
    merits=_rowwise_merits(32, 8192), merit_names=_ROW_MERITS,
    rule="enough bytes in flight, then two programs per SM, then about 32 elements per thread, then up to 8K "
         "elements per program",
    config=_norm_config, launch=_norm_launch, tile_of=_norm_tile,
    describe=lambda c: f"{c.rows} x {c.cols} {c.dtype}{' backward' if c.backward else ''}")
NORM_BWD = dataclasses.replace(
    NORM_FWD, name="norm_bwd", title="RMSNorm / LayerNorm backward (norm_bwd_kernel): persistent, block_m rows a "
                                     "step", op="norm_bwd",
    space=lambda c, g: _norm_space(dataclasses.replace(c, backward=True), g),
    estimate=lambda t, c, g: _norm_estimate(t, dataclasses.replace(c, backward=True), g),
    launch=lambda c, t, cfg: _norm_launch(dataclasses.replace(c, backward=True), t, cfg),
    merits=_rowwise_merits(32, 16384),
    rule="enough bytes in flight, then two programs per SM, then about 32 elements per thread, then up to 16K "
         "elements a step")


# -------------------------------------------------------------------------------------------- cross-entropy

def ce_case(*, rows: int = 8192, vocab: int = 128256, dtype: str = "bfloat16") -> RowsCase:
    return RowsCase(rows, vocab, dtype)


def _ce_launch(case: RowsCase, target: Target, config):
    from ..core_kernels.cross_entropy.plan import plan_ce_fwd

    return plan_ce_fwd(case.rows, case.cols, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, logit_softcap=0.0,
                       target=target, config=config).launches[0]


def _ce_tile(launch) -> Tile:
    c = launch.constexpr_dict()
    return Tile(c["BLOCK_N"], c["BLOCK_V"], launch.num_warps, launch.num_stages)


def _ce_config(tile: Tile):
    from ..core_kernels.cross_entropy.plan import CEConfig

    return CEConfig(block_n=tile.block_m, block_v=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages)


def _ce_space(case: RowsCase, gpu: GPUProfile) -> list[Tile]:
    vs = [v for v in (512, 1024, 2048, 4096, 8192) if v <= next_power_of_2(case.cols)]
    return [Tile(m, v, w, s) for m in (1, 2, 4, 8) for v in vs for w in (4, 8, 16) for s in (1, 2)]


def _ce_estimate(tile: Tile, case: RowsCase, gpu: GPUProfile) -> Estimate:
    est = _rowwise_estimate(tile, case, gpu, regs=lambda e, row: 4 + 2 * e)
    return dataclasses.replace(est, inflight=est.inflight * tile.num_stages)


CROSS_ENTROPY = dataclasses.replace(
    NORM_FWD, name="cross_entropy", title="cross-entropy forward (ce_fwd_kernel): block_m rows a program, "
                                          "block_n vocabulary columns a step",
    op="cross_entropy", space=_ce_space, estimate=_ce_estimate, config=_ce_config, launch=_ce_launch,
    merits=_rowwise_merits(16, 4096),
    rule="enough bytes in flight, then two programs per SM, then about 16 elements per thread, then up to 4K "
         "elements a tile",
    tile_of=_ce_tile, describe=lambda c: f"{c.rows} rows x vocab {c.cols} {c.dtype}")


# ------------------------------------------------------------------------------------------------- registry

MODELS: dict[str, KernelModel] = {m.name: m for m in (ATTENTION_FWD, ATTENTION_DKDV, ATTENTION_DQ, DECODE,
                                                       NORM_FWD, NORM_BWD, CROSS_ENTROPY)}
# an op name of the command line -> its kernels and the function that builds its case
OPS: dict[str, tuple[tuple[str, ...], Callable[..., Any]]] = {
    "flash_attention": (("attention_fwd", "attention_dkdv", "attention_dq"), attention_case),
    "attention_fwd": (("attention_fwd",), attention_case),
    "attention_bwd": (("attention_dkdv", "attention_dq"), attention_case),
    "decode_attention": (("decode",), decode_case),
    "rms_norm": (("norm_fwd", "norm_bwd"), norm_case),
    "cross_entropy": (("cross_entropy",), ce_case),
}
