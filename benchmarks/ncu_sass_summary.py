"""Where a kernel's hot loop spends its cycles, from Nsight Compute's per-SASS-instruction source page
(``ncu --section SourceCounters --import-source yes --page source --print-source sass --csv``, as written by
``scripts/gpu_suite.sh profile-decode-sass``)::

    python benchmarks/ncu_sass_summary.py ncu_sass_fp8-s128k.csv [more.csv ...] [--top 30]

For each file: the instructions executed at least half as often as the most executed one (the hot loop),
their warp-stall samples per opcode with each opcode's largest stall reasons, the loop's stall mix, and the
instructions holding the most samples. Percentages are of the hot loop's samples.
"""
from __future__ import annotations

import argparse
import csv
from collections import Counter, defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str) -> tuple[str, list[dict[str, str]]]:
    """(kernel name, one dict per SASS instruction) of the first kernel in the file."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu prints its own log lines first
    name, header, rows = "?", None, []
    for row in csv.reader(lines):
        if row and row[0] == "Kernel Name":
            if header is not None:
                break  # a second kernel: this summary covers the first
            name = row[1]
        elif row and row[0] == "Address":
            header = row
        elif header is not None and len(row) == len(header):
            rows.append(dict(zip(header, row)))
    if header is None:
        raise SystemExit(f"{path}: no source-page table (was ncu run with --page source --csv?)")
    return name, rows


def opcode(source: str) -> str:
    words = source.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
    return op.split(".")[0]


def summarise(path: str, top: int) -> str:
    name, rows = read_source_page(path)
    stalls = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h] if rows else []
    most = max((_number(r[EXECUTED]) for r in rows), default=0.0)
    hot = [r for r in rows if most and _number(r[EXECUTED]) >= 0.5 * most]
    total = sum(_number(r[SAMPLES]) for r in rows)
    hot_samples = sum(_number(r[SAMPLES]) for r in hot) or 1.0
    out = [f"== {path}: {name}",
           f"hot loop: {len(hot)} instructions, each executed {most:.0f} times; {hot_samples:.0f} of {total:.0f} "
           f"warp-stall samples ({hot_samples / max(total, 1.0):.0%})"]
    per_op: dict[str, Counter] = defaultdict(Counter)
    mix: Counter = Counter()
    for r in hot:
        c = per_op[opcode(r["Source"])]
        c["count"] += 1
        c["samples"] += _number(r[SAMPLES])
        for s in stalls:
            c[s] += _number(r[s])
            mix[s] += _number(r[s])
    out.append("stall mix: " + "  ".join(f"{s[6:]} {v / hot_samples:.1%}" for s, v in mix.most_common(8) if v))
    out.append(f"{'opcode':10s} {'count':>5s} {'samples':>8s}  largest reasons")
    for op, c in sorted(per_op.items(), key=lambda kv: -kv[1]["samples"]):
        reasons = sorted(((c[s], s) for s in stalls), reverse=True)[:4]
        out.append(f"{op:10s} {c['count']:5d} {c['samples'] / hot_samples:8.1%}  "
                   + "  ".join(f"{s[6:]} {v / hot_samples:.1%}" for v, s in reasons if v))
    out.append(f"top {top} instructions by samples (address, share, SASS, largest reasons in samples):")
    for r in sorted(hot, key=lambda r: -_number(r[SAMPLES]))[:top]:
        reasons = sorted(((_number(r[s]), s) for s in stalls), reverse=True)[:3]
        out.append(f"  {r['Address']} {_number(r[SAMPLES]) / hot_samples:6.2%} {r['Source'].strip()[:72]:72s} "
                   + " ".join(f"{s[6:]}={v:.0f}" for v, s in reasons if v))
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=25, help="instructions listed by their samples")
    args = parser.parse_args()
    print("\n\n".join(summarise(path, args.top) for path in args.files))


if __name__ == "__main__":
    main()
