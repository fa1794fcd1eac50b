"""``python -m flashbridge tiles | tune | warmup``: the resource model's table, the tuning sweep, the warm-up."""
from __future__ import annotations

import argparse
import collections
import sys
from typing import Optional

from .model import KB, MODELS, OPS, Report, Row, build_report
from .profiles import PROFILES, GPUProfile, profile, profile_of

COMMANDS = ("tiles", "tune", "warmup")


def add_parsers(sub) -> None:
    """Add the three subcommands to ``python -m flashbridge``'s subparsers."""
    tiles = sub.add_parser(
        "tiles", help="the candidate tiles of an op's kernels for a GPU: resources, verdicts, the model's choice",
        description="Print every kernel's candidate tiles of OP for a GPU (a named profile or the live one): "
                    "estimated shared memory, registers, occupancy and arithmetic intensity, a verdict per "
                    "candidate (kept, or pruned and why) and the model's choice; --explain says in sentences why "
                    "the default won. Needs no GPU.")
    tiles.add_argument("op", choices=sorted(OPS), help="the op whose kernels to show")
    tiles.add_argument("--gpu", default="auto",
                       help=f"a profile ({', '.join(PROFILES)}) or auto: the live GPU, else H200")
    tiles.add_argument("--explain", action="store_true", help="say why the default won, in sentences")
    tiles.add_argument("--all", action="store_true", help="list every pruned candidate too")
    _shape_args(tiles)
    tune = sub.add_parser(
        "tune", help="time the model's surviving tiles on this GPU and store the fastest in the tuning cache",
        description="For each op's benchmark shapes, time the survivors of the resource model, the model's "
                    "choice and the default on the GPU at hand and write the fastest to the user tuning cache "
                    "(FLASHBRIDGE_CACHE or ~/.cache/flashbridge). Needs a CUDA GPU and torch.")
    tune.add_argument("ops", nargs="*", help=f"ops to tune (default all: {', '.join(_tune_ops())})")
    tune.add_argument("--quick", action="store_true", help="one shape per op")
    tune.add_argument("--json", metavar="PATH", help="also write every timing to this JSON file")
    tune.add_argument("--check", action="store_true",
                      help="write nothing: report the model's choice and the tile the cache resolves against the "
                           "sweep's best, and how many rows are within 10%% and 2%%")
    tune.add_argument("--ship", action="store_true",
                      help="write the entries to the package's shipped file (flashbridge/tiles/data/tiles.json)")
    warm = sub.add_parser(
        "warmup", help="compile the kernels a model will use ahead of time",
        description="Compile the kernels of the given ops, head dims and dtypes for the GPU at hand, so that "
                    "the first steps of a server or a training job do not stall on Triton compiles. On a CPU "
                    "the interpreter needs no compile: it says so and exits 0.")
    warm.add_argument("--ops", default="attention,decode,norms,cross_entropy",
                      help="comma-separated: attention, decode, norms, cross_entropy")
    warm.add_argument("--head-dims", default="64,128", help="comma-separated attention / decode head dims")
    warm.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float16, float32")
    warm.add_argument("--hidden", default="4096", help="comma-separated norm widths")
    warm.add_argument("--vocab", default="128256", help="comma-separated cross-entropy vocabulary sizes")


def _shape_args(p) -> None:
    g = p.add_argument_group("shape (defaults: the benchmark rows)")
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--seqlen", type=int, default=4096, help="attention: query and key length")
    g.add_argument("--batch", type=int, help="attention: default 16384 // seqlen; decode: default 1")
    g.add_argument("--heads", type=int, help="query heads (attention 16, decode 32)")
    g.add_argument("--heads-kv", type=int, help="key / value heads (attention: as --heads, decode 8)")
    g.add_argument("--causal", action="store_true")
    g.add_argument("--cache-len", type=int, default=16384, help="decode: KV cache length")
    g.add_argument("--rows", type=int, help="norms: 16384; cross-entropy: 8192")
    g.add_argument("--cols", type=int, default=8192, help="norms: the row width")
    g.add_argument("--vocab", type=int, default=128256, help="cross-entropy: the vocabulary")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))


def case_kwargs(op: str, args) -> dict:
    """The case function's keyword arguments for ``op`` from the parsed shape arguments."""
    kernels, _ = OPS[op]
    kind = MODELS[kernels[0]].name
    if kind.startswith("attention"):
        kw = dict(head_dim=args.head_dim, seqlen=args.seqlen, batch=args.batch, heads=args.heads or 16,
                  heads_kv=args.heads_kv, causal=args.causal, dtype=args.dtype)
    elif kind == "decode":
        kw = dict(head_dim=args.head_dim, batch=args.batch or 1, cache_len=args.cache_len, heads=args.heads or 32,
                  heads_kv=args.heads_kv or 8, dtype=args.dtype)
    elif kind.startswith("norm"):
        kw = dict(rows=args.rows or 16384, cols=args.cols, dtype=args.dtype)
    else:
        kw = dict(rows=args.rows or 8192, vocab=args.vocab, dtype=args.dtype)
    return kw


def resolve_gpu(name: str) -> GPUProfile:
    if name == "auto":
        return profile_of() or PROFILES["H200"]
    return profile(name)


def reports(op: str, gpu: GPUProfile, **kw) -> list[Report]:
    kernels, make = OPS[op]
    case = make(**kw)
    return [build_report(MODELS[k], case, gpu) for k in kernels]


# ------------------------------------------------------------------------------------------------- tables

def _row_cells(r: Row, rep: Report) -> list[str]:
    e = r.est
    mark = ("*" if r.choice else "") + ("D" if r.default else "")
    return [mark, str(r.tile), f"{e.smem / KB:.1f}", str(e.regs), f"{e.blocks_per_sm} ({e.limiter})",
            f"{e.intensity:.0f}" if e.intensity else f"{e.inflight / KB:.0f} KB",
            (r.verdict if not r.reason else f"{r.verdict}: {r.reason}") + (f" ({r.note})" if r.note else "")]


def print_report(rep: Report, *, show_all: bool = False, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    memory_bound = not any(r.est.intensity for r in rep.rows)
    table = Table(title=f"{rep.title}\n{rep.shape} on {rep.gpu.name}", title_justify="left")
    for col in ("", "tile (m, n, warps, stages)", "smem KB", "regs", "blocks/SM",
                "in flight" if memory_bound else "FLOP/B", "verdict"):
        table.add_column(col, overflow="fold")
    shown = [r for r in rep.rows if show_all or r.verdict == "kept" or r.default]
    for r in shown:
        table.add_row(*_row_cells(r, rep), style="bold" if r.choice else None)
    console.print(table)
    hidden = [r for r in rep.rows if r not in shown]
    if hidden:
        console.print(f"  {len(hidden)} more pruned ({_reason_counts(hidden)}); --all lists them")
    console.print("  * the model's choice   D the plan's default\n")


def _category(reason: str) -> str:
    for key, name in (("shared memory", "shared memory"), ("spills", "spills"), ("dominated", "dominated"),
                      ("ranked", "ranked out"), ("stage", "no pipelining"), ("MMA", "under-filled MMA"),
                      ("in flight", "too few bytes in flight"), ("16 bytes", "narrow loads")):
        if key in reason:
            return name
    return "other"


def _reason_counts(rows: list[Row]) -> str:
    counts = collections.Counter(_category(r.reason) for r in rows)
    return ", ".join(f"{name}: {n}" for name, n in counts.most_common())


def explain(rep: Report) -> str:
    """Why the default won (or lost), in sentences."""
    g = rep.gpu
    lines = [f"{rep.title}, {rep.shape}, on the {g.summary()}."]
    d, c = rep.default, rep.choice
    if d is not None:
        e = d.est
        parts = " + ".join(f"{name} {v / KB:.0f} KB" for name, v in e.parts if v)
        fit = (f"needs {e.smem / KB:.1f} KB of shared memory ({parts}) of the {g.smem_per_block / KB:.0f} KB a "
               f"block may use, about {e.regs} registers a thread, and {e.blocks_per_sm} block(s) of "
               f"{e.threads // g.warp_size} warps fit an SM (limited by {e.limiter})")
        if e.intensity:
            fit += (f"; it does {e.intensity:.0f} FLOP per byte it streams (the GPU's HBM ridge is "
                    f"{g.ridge:.0f}; re-reads are mostly served by L2)")
        else:
            fit += f"; a block keeps {e.inflight / KB:.0f} KB of loads in flight"
        lines.append(f"The plan's default {d.tile} ({_source(rep)}) {fit}.")
        if d.verdict == "pruned":
            lines.append(f"On this GPU the model prunes it: {d.reason}.")
        ref = _reference_tile(rep)
        if ref is not None and ref.tile != d.tile and ref.verdict == "pruned":
            lines.append(f"The H200's shipped tile {ref.tile} is pruned on this GPU: {ref.reason}.")
    if c is None:
        lines.append("No candidate survives on this GPU.")
        return "\n".join(lines)
    lines.append(f"The model ranks the survivors by: {rep.rule}.")
    if d is not None and c.tile == d.tile:
        lines.append(f"The default is the model's choice: it leads on that order.")
        runner = next((r for r in rep.survivors if not r.choice), None)
        if runner is not None:
            lines.append(f"The runner-up {runner.tile} loses on {_first_difference(rep, c, runner)}.")
    else:
        lines.append(f"The model's choice is {c.tile}, not the default: {_first_difference(rep, c, d)}"
                     + (" (`python -m flashbridge tune` measures both on the GPU at hand)." if d is not None else "."))
    pruned = [r for r in rep.rows if r.verdict == "pruned"]
    if pruned:
        examples = {}
        for r in pruned:
            examples.setdefault(_category(r.reason), r)
        lines.append(f"{len(pruned)} of {len(rep.rows)} candidates were pruned ({_reason_counts(pruned)}); e.g. "
                     + "; ".join(f"{r.tile}: {r.reason}" for r in list(examples.values())[:4]) + ".")
    return "\n".join(lines)


def _source(rep: Report) -> str:
    """Where the plan's default comes from: the tuning cache's lookup order (flashbridge.tiles.cache)."""
    from . import cache

    if rep.case is None:
        return "the plan's"
    try:
        _, source = cache.lookup(rep.kernel, rep.case, rep.gpu)
    except Exception:  # noqa: BLE001 - an explanation never fails on its footnote
        return "the plan's"
    return {"user cache": "from the user tuning cache", "model": "the model's choice: no tuned entry for this GPU",
            "default": "the plan's fallback"}.get(source, f"from the {source} entries")


def _reference_tile(rep: Report) -> Optional[Row]:
    """The H200's tile for the same call, as a row of this GPU's table (None on the H200 itself)."""
    from . import cache
    from .profiles import PROFILES

    if rep.case is None or rep.gpu.name == "H200":
        return None
    tile, source = cache.lookup(rep.kernel, rep.case, PROFILES["H200"])
    return rep.row(tile) if source.startswith("shipped") or source == "user cache" else None


def _first_difference(rep: Report, a: Row, b: Row) -> str:
    for name, x, y in zip(rep.merit_names, a.merits, b.merits):
        if x != y:
            if b.verdict == "pruned" and b.default:
                return f"{name} {x} against {y}, and the default is pruned here"
            return f"{name} {_plain(x)} against {_plain(y)}"
    return "nothing (a tie broken by the candidate order)"


def _plain(x) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


# ------------------------------------------------------------------------------------------------ commands

def _tune_ops() -> tuple[str, ...]:
    from .tune import TUNE_OPS

    return tuple(TUNE_OPS)


def run(args) -> int:
    if args.command == "tiles":
        try:
            gpu = resolve_gpu(args.gpu)
        except ValueError as e:
            print(f"flashbridge tiles: {e}", file=sys.stderr)
            return 2
        from rich.console import Console

        console = Console(width=160)
        for rep in reports(args.op, gpu, **case_kwargs(args.op, args)):
            print_report(rep, show_all=args.all, console=console)
            if args.explain:
                console.print(explain(rep), highlight=False, soft_wrap=False)
                console.print()
        return 0
    if args.command == "tune":
        from .tune import tune_command

        return tune_command(args.ops, quick=args.quick, json_path=args.json, check=args.check, ship=args.ship)
    from .warmup import warmup_command

    return warmup_command(args)


def main(argv=None) -> int:  # pragma: no cover - `python -m flashbridge` is the entry point
    parser = argparse.ArgumentParser(prog="flashbridge")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
