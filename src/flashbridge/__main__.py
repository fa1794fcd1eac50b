"""Command line: ``python -m flashbridge check | tiles | tune | warmup`` (also installed as the ``flashbridge``
script)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys

from . import __version__
from .checks import FAMILIES

_EXTRA = {"torch": "torch", "jax": "jax"}  # framework -> the pip extra that installs it


def plain(text: str) -> str:
    """Docstring markup as plain text for ``--help``: ``code`` and :role:`target` lose their markup."""
    text = re.sub(r":[\w:]+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashbridge", description=plain(__doc__))
    parser.add_argument("--version", action="version", version=f"flashbridge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check", help="run every op in every installed framework against the float64 references; time it "
                      "on a GPU; exit 1 on any failure",
        description="Run every op in every installed framework against the float64 references (on a GPU "
                    "also time it); print one row per op and framework; exit 1 on any failure.")
    check.add_argument("--framework", choices=("all", "torch", "jax"), default="all",
                       help="all (default): every installed one")
    check.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                       help="auto: a CUDA GPU when one is visible, else the CPU (Triton interpreter)")
    check.add_argument("--family", action="append", choices=FAMILIES, metavar="FAMILY",
                       help=f"only this op family (repeatable): {', '.join(FAMILIES)}")
    check.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    from .tiles import cli as tiles_cli

    tiles_cli.add_parsers(sub)
    args = parser.parse_args(argv)
    if args.command in tiles_cli.COMMANDS:
        return tiles_cli.run(args)

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
    from .checks.runner import default_device, installed_frameworks, run_checks

    if args.framework == "all":
        frameworks = installed_frameworks()
        if not frameworks:
            print('flashbridge check: neither torch nor jax is installed; pip install "flashbridge[torch]" '
                  'or "flashbridge[jax]"', file=sys.stderr)
            return 1
    else:
        if importlib.util.find_spec(args.framework) is None:
            parser.exit(2, f"flashbridge check: --framework {args.framework}: {args.framework} is not "
                           f'installed; pip install "flashbridge[{_EXTRA[args.framework]}]"\n')
        frameworks = [args.framework]
    device = default_device() if args.device == "auto" else args.device
    ok = run_checks(frameworks, device, args.family, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
