"""Shared benchmark helpers: timing (the same functions as ``flashbridge check``), versions, JSON, tables.

Every script measures ours and the baselines in the same process on the same inputs, prints a table, and
writes ``benchmarks/results/<name>.json`` (or ``$OUT/<name>.json`` when OUT is set, for the GPU runner).
"""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from flashbridge._timing import (jax_dispatch_ms, time_jax, time_jax_steady, time_torch,  # noqa: E402,F401
                                 time_torch_steady)

COPY_CEILING_TBS = 4.24  # device-to-device copy measured on the H200 (shared/GPU.md); re-measured per run


def results_dir() -> Path:
    out = os.environ.get("OUT")
    path = Path(out) if out else ROOT / "benchmarks" / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment() -> dict:
    """Versions and device. Versions come from package metadata: importing jax_triton here would set
    TRITON_CACHE_DIR="" for the process (see flashbridge.jax_api._runtime)."""
    from importlib import metadata

    info = {"python": platform.python_version()}
    for dist in ("torch", "triton", "jax", "jaxlib", "flax", "jax-triton", "liger-kernel", "numpy"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["device"] = p.name
            info["sms"] = p.multi_processor_count
    except ImportError:
        pass
    return info


def measure_copy_ceiling() -> float:
    """TB/s of a large device-to-device copy (bytes read + written), the memory-bound ceiling."""
    import torch
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_torch(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e12


def save(name: str, payload: dict) -> Path:
    path = results_dir() / f"{name}.json"
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=1)
    return path


def save_figure(fig, name: str) -> Path:
    """Write a matplotlib figure next to the JSON results as ``<name>.png``."""
    fig.tight_layout()
    path = results_dir() / f"{name}.png"
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r])
    Console(width=200).print(table)


_PTR_TYPES = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32", "int32": "*i32", "int64": "*i64",
              "float8_e4m3fn": "*fp8e4nv"}


def compile_launch_sm90(plan, launch, dtypes_of: dict) -> tuple[int, str]:
    """Compile one Launch for sm_90 on this machine (no GPU needed) the way Triton's launcher would
    specialise it: pointers 16-byte aligned, integers equal to 1 folded, other integers unspecialised (the
    kernels opt out of alignment specialisation). Returns (shared memory bytes, "REG:n STACK:n", followed by
    "wgmma:n waits:n" when the kernel has tensor-core MMAs and " SERIALIZED" when ptxas put a wait after
    every one of them: it does so, without failing, when it cannot keep the asynchronous MMAs' registers
    live, e.g. the D=128 one-launch backward with 32-row masked dK/dV steps, 18 -> 124 waits)."""
    import inspect
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flashbridge.core_kernels import get_kernel

    fn = get_kernel(launch.kernel, False)
    names = list(inspect.signature(fn.fn).parameters)
    args = [*launch.inputs, *(n for n, _ in launch.scalars), *launch.outputs]
    values = [None] * len(launch.inputs) + launch.scalar_values() + [None] * len(launch.outputs)
    sig, attrs, consts = {}, {}, dict(launch.constexpr_dict())
    for i, (pname, arg, value) in enumerate(zip(names, args, values)):
        if value is None:
            sig[pname] = _PTR_TYPES[dtypes_of.get(arg) or plan.spec(arg).dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[pname] = "fp32"
        elif value == 1:
            consts[pname] = 1
        else:
            sig[pname] = "i32" if -2**31 <= value < 2**31 else "i64"
    for c in consts:
        sig[c] = "constexpr"
    kernel = triton.compile(
        ASTSource(fn=fn, signature=sig, attrs=attrs, constexprs={(names.index(k),): v for k, v in consts.items()}),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    line = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), "?")
    summary = " ".join(line.split()[:2])
    mmas, waits = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR")
    if mmas:
        summary += f" wgmma:{mmas} waits:{waits}" + (" SERIALIZED" if waits >= mmas else "")
    return kernel.metadata.shared, summary


def kernel_trace(fn, *, calls: int = 5, label: str = "", summary: dict | None = None) -> list[dict]:
    """The device activity of ``fn`` (kernels, memsets, copies), per call: name, launches, microseconds;
    and how busy the device was from each call's first kernel to its last (the rest is launch gaps), also
    written into ``summary`` (keys ``busy``, ``span_us`` per call) when given. Every call must run the same
    device activities (the spans are split into calls by count).

    Uses torch.profiler's CUPTI activity trace, which records every CUDA launch in the process, JAX's
    included, so the two frameworks' paths can be compared kernel by kernel. ``fn`` must synchronise."""
    from collections import defaultdict

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize()
    totals, counts, spans = defaultdict(float), defaultdict(int), []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.time_range.elapsed_us()
            counts[event.name] += 1
            spans.append((event.time_range.start, event.time_range.end))
    rows = [{"name": name[:90], "launches": counts[name] / calls, "us": totals[name] / calls}
            for name in sorted(totals, key=totals.get, reverse=True)]
    busy, span = _busy_fraction(sorted(spans), calls)
    if summary is not None:
        summary.update(busy=busy, span_us=span / calls)
    total = sum(r["us"] for r in rows)
    print_table(f"device activity per call {label} (total {total:.1f} us; device busy {busy:.1%} of the "
                f"time between a call's first and last kernel, {span / calls:.1f} us per call)",
                ["kernel", "launches", "us"], [[r["name"], r["launches"], r["us"]] for r in rows])
    return rows


def launch_trace(fn, *, calls: int = 3, path: str | None = None) -> dict:
    """When each kernel of ``fn`` was launched (the host's launch call, matched to its kernel by CUPTI's
    correlation id) against when it started and when the kernel before it in the same call ended: whether
    the device's idle time between kernels is the host launching late (host-bound) or the device starting
    late. ``fn`` must synchronise and launch the same kernels on every call. Writes the Chrome trace to ``path`` when given. Timings are under the profiler (its
    callbacks slow every launch call), so compare paths with each other, not with unprofiled timings."""
    import json as _json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
    if path is None:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = _json.load(f)["traceEvents"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X" and "correlation" in e.get("args", {})
                and e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e.get("name", "")}
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"), key=lambda e: e["ts"])
    rows, prev_end = [], None
    per_call = max(len(kernels) // calls, 1)  # every call launches the same kernels; calls synchronise
    for i, k in enumerate(kernels):
        launch = launches.get(k["args"].get("correlation"))
        row = {"kernel": k["name"][:60], "us": k["dur"], "launch_to_start_us": None, "idle_before_us": None,
               "launched_after_prev_end": None}
        if i % per_call:  # not the first kernel of a call
            row["idle_before_us"] = k["ts"] - prev_end
            if launch is not None:
                row["launched_after_prev_end"] = launch["ts"] + launch["dur"] > prev_end
        if launch is not None:
            row["launch_to_start_us"] = k["ts"] - (launch["ts"] + launch["dur"])
            row["launch_call_us"] = launch["dur"]
        rows.append(row)
        prev_end = k["ts"] + k["dur"]
    gaps = [r for r in rows if r["idle_before_us"] is not None]
    api = {}  # the host's CUDA API calls by total time: what the launching thread waited on
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            total, count = api.get(e["name"], (0.0, 0))
            api[e["name"]] = (total + e["dur"], count + 1)
    summary = {
        "api_calls": {k: {"us": round(v[0] / calls, 1), "count": v[1] / calls}
                      for k, v in sorted(api.items(), key=lambda kv: -kv[1][0])[:8]},
        "kernels": len(rows), "matched_launches": sum(r["launch_to_start_us"] is not None for r in rows),
        "mean_idle_before_us": sum(r["idle_before_us"] for r in gaps) / max(len(gaps), 1),
        "host_bound_gaps": sum(bool(r["launched_after_prev_end"]) for r in gaps), "gaps": len(gaps),
        "mean_launch_call_us": (sum(r.get("launch_call_us", 0) for r in rows)
                                / max(sum("launch_call_us" in r for r in rows), 1)),
        "rows": rows,
    }
    print({k: v for k, v in summary.items() if k != "rows"})
    return summary


def _busy_fraction(spans, calls: int):
    """Busy time / elapsed time of the device within each call, summed over the calls: the sorted activity
    spans are split into ``calls`` equal groups (every call runs the same activities), so the host's
    synchronisation between calls is never counted, however short it is."""
    per_call = max(len(spans) // max(calls, 1), 1)
    busy = elapsed = 0.0
    for i in range(0, len(spans), per_call):
        group = spans[i:i + per_call]
        elapsed += max(end for _, end in group) - group[0][0]
        busy += sum(end - start for start, end in group)
    return (busy / elapsed if elapsed else 1.0), elapsed
