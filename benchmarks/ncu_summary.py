"""Side-by-side Nsight Compute metrics of the longest kernel in each of several ``ncu --csv --page details``
files (e.g. our attention backward against FlexAttention's, from ``profile_attention_bwd.py``)::

    python benchmarks/ncu_summary.py ours.csv flex.csv
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def longest_kernel(path: str) -> tuple[str, dict[tuple[str, str], str]]:
    """(kernel name, {(section, metric [unit]): value}) of the kernel with the longest duration."""
    kernels: dict[str, dict] = defaultdict(dict)
    names: dict[str, str] = {}
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints its own log lines first
    for row in csv.DictReader(lines):
        key = row["ID"]
        names[key] = row["Kernel Name"]
        unit = f" [{row['Metric Unit']}]" if row.get("Metric Unit") else ""
        kernels[key][(row["Section Name"], row["Metric Name"] + unit)] = row["Metric Value"]

    def duration(key):
        for (section, metric), value in kernels[key].items():
            if metric.startswith("Duration"):
                scale = {"[ms]": 1e3, "[us]": 1.0, "[ns]": 1e-3, "[s]": 1e6}.get(metric.split()[-1], 1.0)
                return (_number(value) or 0.0) * scale
        return 0.0

    key = max(kernels, key=duration)
    return names[key], kernels[key]


def main(paths: list[str]) -> None:
    picked = [longest_kernel(p) for p in paths]
    for path, (name, _) in zip(paths, picked):
        print(f"{path}: {name[:100]}")
    metrics = []
    for _, values in picked:
        metrics += [m for m in values if m not in metrics]
    width = max(len(f"{s} / {m}") for s, m in metrics)
    for section, metric in metrics:
        cells = [values.get((section, metric), "-") for _, values in picked]
        print(f"{section + ' / ' + metric:<{width}}  " + "  ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main(sys.argv[1:])
