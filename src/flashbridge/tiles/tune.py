"""``python -m flashbridge tune [ops]``: time the resource model's survivors on the GPU at hand, keep the best.

For every benchmark shape of an op (the rows of benchmarks/bench_*.py), each kernel's candidates -- the
survivors, the model's choice and the plan's default -- run through the public torch op inside
``configure(<the candidate's config>)`` and are timed with ``triton.testing.do_bench`` (median), all in
the same process on the same inputs. The fastest is written to the user tuning cache; the printed table
gives each candidate's time relative to the best, so the model's choice alone and the tuned choice can be
compared with the sweep's best in one run.
"""
from __future__ import annotations

import json
import sys
from typing import Callable

from .cache import case_for, entry_key, make_entry, store, user_cache_file
from .model import MODELS, build_report

# op -> (kernel, case keyword arguments) rows: the benchmark tables' shapes
_ATTN = [dict(head_dim=d, seqlen=s, causal=c) for d in (128, 64) for s in (1024, 4096, 16384) for c in (False, True)]
TUNE_OPS: dict[str, list[tuple[str, dict]]] = {
    "attention": [(k, kw) for kw in _ATTN for k in ("attention_fwd", "attention_dkdv", "attention_dq")],
    "decode": [("decode", dict(batch=b, cache_len=s)) for b, s in ((1, 16384), (1, 131072), (32, 8192))],
    "norms": [(k, dict(rows=r, cols=c)) for r, c in ((16384, 8192), (65536, 2048)) for k in ("norm_fwd", "norm_bwd")],
    "cross_entropy": [("cross_entropy", dict(rows=8192, vocab=128256))],
}


def _inputs(kernel: str, kw: dict) -> Callable[[], Callable[[], object]]:
    """A function that allocates the inputs and returns the timed call (torch, on the current GPU)."""
    import torch

    from .. import torch_api as fb

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, requires_grad=False):
        return torch.randn(*shape, generator=g, device=dev).to(dt).requires_grad_(requires_grad)

    if kernel.startswith("attention"):
        s, d = kw["seqlen"], kw["head_dim"]
        b = 16384 // s
        q, k, v = (randn(b, s, 16, d, requires_grad=True) for _ in range(3))
        if kernel == "attention_fwd":
            return lambda: fb.flash_attention(q, k, v, causal=kw["causal"])
        out = fb.flash_attention(q, k, v, causal=kw["causal"])
        dout = randn(*out.shape)
        return lambda: torch.autograd.grad(fb.flash_attention(q, k, v, causal=kw["causal"]), (q, k, v), dout)
    if kernel == "decode":
        b, s = kw["batch"], kw["cache_len"]
        q, kc, vc = randn(b, 1, 32, 128), randn(b, s, 8, 128), randn(b, s, 8, 128)
        lengths = torch.full((b,), s, dtype=torch.int32, device=dev)
        return lambda: fb.decode_attention(q, kc, vc, cache_seqlens=lengths)
    if kernel.startswith("norm"):
        x = randn(kw["rows"], kw["cols"], requires_grad=True)
        w = randn(kw["cols"], requires_grad=True)
        if kernel == "norm_fwd":
            return lambda: fb.rms_norm(x, w)
        dy = randn(kw["rows"], kw["cols"])
        return lambda: torch.autograd.grad(fb.rms_norm(x, w), (x, w), dy)
    logits = randn(kw["rows"], kw["vocab"]) * 3
    labels = torch.randint(0, kw["vocab"], (kw["rows"],), generator=g, device=dev)
    return lambda: fb.cross_entropy(logits, labels, validate_labels=False)


def tune_rows(ops, *, quick: bool = False):
    """Sweep; yields one dict per (kernel, shape) with every candidate's time."""
    import torch
    import triton.testing

    from ..core_kernels import configure
    from .profiles import profile_of

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
            call = _inputs(kernel, kw)
            times = {}
            for r in cands:
                with configure(model.config(r.tile)):
                    try:
                        with torch.no_grad() if kernel in ("attention_fwd", "decode", "norm_fwd",
                                                           "cross_entropy") else torch.enable_grad():
                            times[r.tile] = triton.testing.do_bench(call, warmup=25, rep=100)
                    except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is reported
                        print(f"  {kernel} {rep.shape} {r.tile}: failed: {e!r}"[:300], file=sys.stderr)
            if not times:
                continue
            best = min(times, key=times.get)
            choice = rep.choice.tile if rep.choice else None
            yield dict(op=op, kernel=kernel, shape=rep.shape, case=kw, key=entry_key(gpu, kernel, case),
                       best=best, best_ms=times[best], default=rep.default.tile, default_ms=times.get(rep.default.tile),
                       choice=choice, choice_ms=times.get(choice), times=times)


def tune_command(ops, *, quick: bool = False, json_path=None) -> int:
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
    console = Console(width=160)
    table = Table(title=f"tuning sweep ({torch.cuda.get_device_name()}); times relative to the best of the sweep")
    for col in ("kernel", "shape", "best", "best ms", "model choice", "choice/best", "default", "default/best",
                "candidates"):
        table.add_column(col)
    records, entries = [], {}
    for rec in tune_rows(ops or list(TUNE_OPS), quick=quick):
        ratio = (lambda ms: f"{ms / rec['best_ms']:.3f}" if ms else "-")
        table.add_row(rec["kernel"], rec["shape"], str(rec["best"]), f"{rec['best_ms']:.4f}", str(rec["choice"]),
                      ratio(rec["choice_ms"]), str(rec["default"]), ratio(rec["default_ms"]), str(len(rec["times"])))
        console.print(f"{rec['kernel']} {rec['shape']}: best {rec['best']} {rec['best_ms']:.4f} ms, model "
                      f"{rec['choice']} {ratio(rec['choice_ms'])}, default {rec['default']} {ratio(rec['default_ms'])}")
        entries[rec["key"]] = make_entry(rec["best"], rec["best_ms"], shape=rec["shape"],
                                         model_choice=str(rec["choice"]), model_ratio=rec["choice_ms"] and
                                         round(rec["choice_ms"] / rec["best_ms"], 4))
        records.append({**rec, "best": str(rec["best"]), "default": str(rec["default"]), "choice": str(rec["choice"]),
                        "times": {str(t): ms for t, ms in rec["times"].items()}})
        store(entries)  # after every row: a run cut short keeps what it measured
    console.print(table)
    console.print(f"wrote {len(entries)} entries to {user_cache_file()}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": records}, f, indent=1, default=str)
    return 0
