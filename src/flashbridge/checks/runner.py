"""Runs every family's checks and prints one row per op and framework (rich table, live progress)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import traceback

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import FAMILIES, Measurement


def installed_frameworks() -> list[str]:
    return [name for name in ("torch", "jax") if importlib.util.find_spec(name) is not None]


def default_device() -> str:
    if importlib.util.find_spec("torch") is not None:
        import torch
        if torch.cuda.is_available():
            return "cuda"
    if importlib.util.find_spec("jax") is not None:
        import jax
        try:
            if jax.devices("gpu"):
                return "cuda"
        except RuntimeError:
            pass
    return "cpu"


def run_checks(frameworks: list[str], device: str, families: list[str] | None = None,
               json_path: str | None = None, console: Console | None = None) -> bool:
    """Run the checks; print the table; return True when every row passed."""
    console = console or Console(width=None if Console().is_terminal else 140)
    checks = []
    for family in families or FAMILIES:
        module = importlib.import_module(f"{__package__}.{family}")
        for framework in frameworks:
            checks.extend(module.checks(framework, device))
    rows = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("checking", total=len(checks))
        for check in checks:
            progress.update(task, description=f"{check.op} [{check.framework}]")
            try:
                m: Measurement | None = check.run()
                error = None
            except Exception as exc:  # a crash is a failed row, and the others still run
                m, error = None, f"{type(exc).__name__}: {exc}"
                console.print(f"[red]{check.op} [{check.framework}] raised:[/red]\n{traceback.format_exc()}")
            rows.append((check, m, error))
            progress.advance(task)

    table = Table(title=f"flashbridge check on {device}")
    for col in ("op", "framework", "shape", "error / bound", "result", "time (ms)", "rate"):
        table.add_column(col, justify="right" if col in ("error / bound", "time (ms)", "rate") else "left")
    ok_all = True
    records = []
    for check, m, error in rows:
        ok = m is not None and m.ok
        ok_all &= ok
        result = "[green]pass[/green]" if ok else f"[red]FAIL[/red] {error or ''}"
        rate = f"{m.rate:.2f} {m.unit}" if m is not None and m.rate is not None else "-"
        time_ms = f"{m.time_ms:.3f}" if m is not None and m.time_ms is not None else "-"
        table.add_row(check.op, check.framework, m.shape if m else "-",
                      f"{m.max_err:.3g}" if m else "-", result, time_ms, rate)
        records.append({"op": check.op, "framework": check.framework, "ok": ok, "error": error,
                        **({} if m is None else {"shape": m.shape, "max_err": m.max_err, "tol": m.tol,
                                                 "time_ms": m.time_ms, "rate": m.rate, "unit": m.unit})})
    console.print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": device, "rows": records}, f, indent=1)
    console.print("[green]all checks passed[/green]" if ok_all else "[red]some checks failed[/red]")
    return ok_all
