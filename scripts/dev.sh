#!/usr/bin/env bash
# The two everyday commands, each doing the set-up on first use (a virtual environment in .venv):
#   scripts/dev.sh check [args]   python -m flashbridge check: every op, every framework, against float64
#   scripts/dev.sh test  [args]   the test suite (GPU tests skip cleanly without a CUDA GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FLASHBRIDGE_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
# torch first, pinned: where the machine offers a local CPU wheel of that release pip takes it, instead of
# downloading several GB of CUDA libraries for a CPU-only check.
"$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "torch==2.13.0" || "$py" -m pip install -q torch
"$py" -m pip install -q -e ".[all,test]"
command=${1:-}
[ $# -gt 0 ] && shift
case "$command" in
  check) exec "$py" -m flashbridge check "$@" ;;
  test) exec "$py" -m pytest -n "${PYTEST_WORKERS:-2}" "$@" ;;
  *) echo "usage: scripts/dev.sh check|test [args]" >&2; exit 2 ;;
esac
