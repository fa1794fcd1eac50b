"""Command line: ``python -m flashbridge check`` (also installed as the ``flashbridge`` script)."""
from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashbridge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run every op in every installed framework against the float64 "
                                         "references; time it on a GPU; exit 1 on any failure")
    check.add_argument("--framework", choices=("all", "torch", "jax"), default="all")
    check.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto: a CUDA GPU when one is visible, else the CPU (Triton interpreter)")
    check.add_argument("--family", action="append", help="only these op families (repeatable)")
    check.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args(argv)

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    from .checks.runner import default_device, installed_frameworks, run_checks

    frameworks = installed_frameworks() if args.framework == "all" else [args.framework]
    if not frameworks:
        print("flashbridge check: neither torch nor jax is installed; install flashbridge[torch] or [jax]")
        return 1
    device = default_device() if args.device == "auto" else args.device
    ok = run_checks(frameworks, device, args.family, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
