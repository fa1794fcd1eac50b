"""``python -m flashbridge tune [ops]``: time the resource model's survivors on the GPU at hand, keep the best.

For every benchmark shape of an op (the rows of benchmarks/bench_*.py), each kernel's candidates -- the
survivors, the model's choice and the tile the plan resolves from the tuning cache ("plan": built with no
config at all, so decode keeps its split rule) -- run through the public torch ops, all in one process.
Timing is steady state (``flashbridge._timing``): each candidate's calls over several distinct input sets
are captured in one CUDA graph (thread-local capture; inputs from a private ``torch.Generator``; one
throwaway backward capture first), then every graph is replayed in rounds, the candidates' order rotated
from round to round, and a candidate's time is the median of its rounds' medians: a 2% decision is not
host time or clock drift. Forward kernels are timed on forward calls; dK/dV and dQ candidates on
``torch.autograd.grad`` of a saved forward (the backward alone), falling back to forward + backward when
a backward capture fails.

``tune`` writes the fastest tile of each row to the user cache (``--ship``: to the shipped file, for the
developer); ``--check`` writes nothing and reports, per row, the model's choice and the cache's tile
against the sweep's best (``model/best``, ``plan/best``) with a summary: how many rows are within 10% and
within 2%.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Callable

from .cache import case_for, entry_key, make_entry, shipped_file, store, user_cache_file
from .model import MODELS, build_report

# op -> (kernel, case keyword arguments) rows: the benchmark tables' shapes
_ATTN = [dict(head_dim=d, seqlen=s, causal=c) for d in (128, 64) for s in (1024, 4096, 16384) for c in (False, True)]
TUNE_OPS: dict[str, list[tuple[str, dict]]] = {
    "attention": [(k, kw) for kw in _ATTN for k in ("attention_fwd", "attention_dkdv", "attention_dq")],
    "decode": [("decode", dict(batch=b, cache_len=s)) for b, s in ((1, 16384), (1, 131072), (32, 8192))],
    "norms": [(k, dict(rows=r, cols=c)) for r, c in ((16384, 8192), (65536, 2048)) for k in ("norm_fwd", "norm_bwd")],
    "cross_entropy": [("cross_entropy", dict(rows=8192, vocab=128256))],
}
SETS = 4  # distinct input sets per graph: together they exceed the L2, as a model's layers do
ROUNDS = 3
REPS = 10
PLAN = "plan"  # the candidate built without a config: the tile the tuning cache resolves


def _inputs(kernel: str, kw: dict, sets: int = SETS) -> Callable[[], tuple[Callable, list]]:
    """A function that, called under the candidate's ``configure``, returns ``(fn, arg_sets)``: the timed
    call and its distinct input sets (torch, on the current GPU)."""
    import torch

    from .. import torch_api as fb

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, requires_grad=False):
        return torch.randn(*shape, generator=g, device=dev).to(dt).requires_grad_(requires_grad)

    def backward_of(forward, grads_of: int):
        """Sets (out, inputs, dout) of a forward run under the active config; the timed call is the backward."""
        def make():
            arg_sets = []
            for args, dout in data:
                out = forward(*args)
                arg_sets.append((out, args[:grads_of], dout))
            return (lambda out, inputs, dout: torch.autograd.grad(out, inputs, dout, retain_graph=True)), arg_sets
        return make

    if kernel.startswith("attention"):
        s, d, causal = kw["seqlen"], kw["head_dim"], kw["causal"]
        b = 16384 // s
        data = [(tuple(randn(b, s, 16, d, requires_grad=True) for _ in range(3)), randn(b, s, 16, d))
                for _ in range(sets)]
        attn = lambda q, k, v: fb.flash_attention(q, k, v, causal=causal)  # noqa: E731
        if kernel == "attention_fwd":
            return lambda: (attn, [args for args, _ in data])
        return backward_of(attn, 3)
    if kernel == "decode":
        b, s = kw["batch"], kw["cache_len"]
        lengths = torch.full((b,), s, dtype=torch.int32, device=dev)
        data = [(randn(b, 1, 32, 128), randn(b, s, 8, 128), randn(b, s, 8, 128), lengths) for _ in range(sets)]
        return lambda: ((lambda q, kc, vc, n: fb.decode_attention(q, kc, vc, cache_seqlens=n)), data)
    if kernel.startswith("norm"):
        w = randn(kw["cols"], requires_grad=True)
        data = [((randn(kw["rows"], kw["cols"], requires_grad=True), w), randn(kw["rows"], kw["cols"]))
                for _ in range(sets)]
        if kernel == "norm_fwd":
            return lambda: (fb.rms_norm, [args for args, _ in data])
        return backward_of(fb.rms_norm, 2)
    data = [(randn(kw["rows"], kw["vocab"]) * 3,
             torch.randint(0, kw["vocab"], (kw["rows"],), generator=g, device=dev)) for _ in range(sets)]
    return lambda: ((lambda x, y: fb.cross_entropy(x, y, validate_labels=False)), data)


def time_candidates(make, configs: dict, *, rounds: int = ROUNDS, reps: int = REPS, log=print) -> dict:
    """Steady milliseconds per call of each candidate (``configs``: name or tile -> the family config to
    run under): one CUDA graph per candidate over the input sets, replayed ``reps`` times per round in a
    rotating order; the median of the rounds' medians."""
    import torch

    from .._timing import _absorb_first_backward_capture, replay_ms, steady_graph
    from ..core_kernels import configure

    _absorb_first_backward_capture()
    graphs = {}
    for key, config in configs.items():
        try:
            with configure(config):
                fn, arg_sets = make()
                try:
                    graphs[key] = (steady_graph(fn, arg_sets), len(arg_sets))
                except RuntimeError:  # a backward capture that failed: spend it and capture again
                    torch.cuda.synchronize()
                    graphs[key] = (steady_graph(fn, arg_sets), len(arg_sets))
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile or capture is reported
            log(f"  {key}: failed: {e!r}"[:300])
    torch.cuda.synchronize()
    order = list(graphs)
    rounds_ms = {k: [] for k in order}
    for r in range(rounds):
        for key in order[r % len(order):] + order[:r % len(order)] if order else []:
            graph, n = graphs[key]
            graph.replay()  # one untimed replay: the clocks and caches of this candidate, not the last one's
            rounds_ms[key].append(statistics.median(replay_ms(graph, n, reps)))
    del graphs
    torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in rounds_ms.items()}


def tune_rows(ops, *, quick: bool = False, log=None):
    """Sweep; yields one dict per (kernel, shape) with every candidate's time."""
    from .profiles import profile_of

    log = log or (lambda m: print(m, file=sys.stderr))
    gpu = profile_of()
    for op in ops:
        rows = TUNE_OPS[op]
        if quick:
            rows = [r for r in rows if r[1] == rows[0][1]]
        for kernel, kw in rows:
            model = MODELS[kernel]
            case = case_for(kernel, **kw)
            rep = build_report(model, case, gpu)
            cands = [r for r in rep.rows if r.verdict == "kept" or r.default]
            empty = type(model.config(rep.rows[0].tile))()  # no tile fields: the plan resolves its own
            configs = {PLAN: empty, **{r.tile: model.config(r.tile) for r in cands}}
            times = time_candidates(_inputs(kernel, kw), configs, log=log)
            plan_ms = times.pop(PLAN, None)
            if not times:
                continue
            best = min(times, key=times.get)
            choice = rep.choice.tile if rep.choice else None
            best_ms = min(times[best], plan_ms or float("inf"))
            yield dict(op=op, kernel=kernel, shape=rep.shape, case=kw, key=entry_key(gpu, kernel, case),
                       best=best, best_ms=best_ms, sweep_best_ms=times[best], default=rep.default.tile,
                       default_ms=times.get(rep.default.tile), plan_ms=plan_ms, choice=choice,
                       choice_ms=times.get(choice), times=times)


def tune_command(ops, *, quick: bool = False, json_path=None, check: bool = False, ship: bool = False) -> int:
    """The sweep with a table. ``check``: write no entry, report model/best and plan/best per row and how
    many rows are within 10% and 2%; ``ship``: write the entries to the package's shipped file."""
    from rich.console import Console
    from rich.table import Table

    try:
        import torch
    except ImportError:
        print("flashbridge tune: needs torch and a CUDA GPU; torch is not installed", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("flashbridge tune: no CUDA GPU is visible: nothing to time. The resource model's choices need no "
              "GPU: see `python -m flashbridge tiles OP --gpu NAME`.", file=sys.stderr)
        return 1
    unknown = [op for op in ops if op not in TUNE_OPS]
    if unknown:
        print(f"flashbridge tune: unknown ops {unknown}; known: {', '.join(TUNE_OPS)}", file=sys.stderr)
        return 2
    if check and ship:
        print("flashbridge tune: --check writes nothing; drop --ship", file=sys.stderr)
        return 2
    console = Console(width=170)
    table = Table(title=f"tuning sweep ({torch.cuda.get_device_name()}), steady state; times relative to the best")
    for col in ("kernel", "shape", "best", "best ms", "model choice", "model/best", "plan (cache)", "plan/best",
                "candidates"):
        table.add_column(col)
    records, entries = [], {}
    target = shipped_file() if ship else user_cache_file()
    for rec in tune_rows(ops or list(TUNE_OPS), quick=quick):
        ratio = (lambda ms: f"{ms / rec['best_ms']:.3f}" if ms else "-")
        table.add_row(rec["kernel"], rec["shape"], str(rec["best"]), f"{rec['best_ms']:.4f}", str(rec["choice"]),
                      ratio(rec["choice_ms"]), str(rec["default"]), ratio(rec["plan_ms"]), str(len(rec["times"])))
        console.print(f"{rec['kernel']} {rec['shape']}: best {rec['best']} {rec['best_ms']:.4f} ms, model "
                      f"{rec['choice']} {ratio(rec['choice_ms'])}, plan {rec['default']} {ratio(rec['plan_ms'])}")
        rec["model_ratio"] = rec["choice_ms"] and rec["choice_ms"] / rec["best_ms"]
        rec["plan_ratio"] = rec["plan_ms"] and rec["plan_ms"] / rec["best_ms"]
        records.append({**rec, "best": str(rec["best"]), "default": str(rec["default"]), "choice": str(rec["choice"]),
                        "times": {str(t): ms for t, ms in rec["times"].items()}})
        if not check:
            entries[rec["key"]] = make_entry(rec["best"], rec["sweep_best_ms"], shape=rec["shape"],
                                             model_choice=str(rec["choice"]), model_ratio=rec["model_ratio"] and
                                             round(rec["model_ratio"], 4))
            store(entries, target)  # after every row: a run cut short keeps what it measured
    console.print(table)
    if check:
        n = len(records)
        for name, field in (("model's choice", "model_ratio"), ("plan (tuning cache)", "plan_ratio")):
            r = [x[field] for x in records if x[field]]
            console.print(f"{name}: within 10% of the sweep's best in {sum(v <= 1.10 for v in r)} of {n} rows, "
                          f"within 2% in {sum(v <= 1.02 for v in r)}; worst {max(r, default=0):.3f}")
    else:
        console.print(f"wrote {len(entries)} entries to {target}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "check": check, "rows": records}, f, indent=1,
                      default=str)
    return 0
