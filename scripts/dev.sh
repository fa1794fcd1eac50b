#!/usr/bin/env bash
# The two everyday commands, each doing the set-up on first use (a virtual environment in .venv, or in
# $FLASHBRIDGE_VENV):
#   scripts/dev.sh check [args]   python -m flashbridge check: every op, every framework, against float64
#   scripts/dev.sh test  [args]   the test suite (GPU tests skip cleanly without a CUDA GPU) on
#                                 $PYTEST_WORKERS pytest-xdist workers (2), without the tests marked slow:
#                                 the default is -m "not slow"; an -m of your own replaces it
#                                 (scripts/dev.sh test -m slow runs only the slow ones, -m "" everything)
# The environment is installed once, and again only when pyproject.toml changes (a stamp in the
# environment holds the checksum of the pyproject.toml it was installed from); the package itself is an
# editable install, so edits to the sources need no reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
command=${1:-}
case "$command" in
  check|test) shift ;;
  *) echo "usage: scripts/dev.sh check|test [args]" >&2; exit 2 ;;
esac
venv=${FLASHBRIDGE_VENV:-.venv}
py="$venv/bin/python"
stamp="$venv/.flashbridge-installed"
step() { echo "scripts/dev.sh: $*" >&2; }

if [ ! -x "$py" ]; then
  step "creating $venv"
  python3 -m venv "$venv"
fi
want=$(cksum < pyproject.toml)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first, pinned: where the machine offers a local CPU wheel of that release pip takes it, instead
  # of downloading several GB of CUDA libraries for a CPU-only check.
  if ! "$py" -c "import torch" 2>/dev/null; then
    step "installing torch 2.13.0 (a local CPU wheel where there is one; this can take minutes)"
    "$py" -m pip install -q "torch==2.13.0" || "$py" -m pip install -q torch
  fi
  step "installing flashbridge[all,test] from this checkout (editable; this can take minutes)"
  "$py" -m pip install -q -e ".[all,test]"
  echo "$want" > "$stamp"
fi

case "$command" in
  check) exec "$py" -m flashbridge check "$@" ;;
  # pytest keeps the last -m it is given, so one among the arguments replaces the default
  test) exec "$py" -m pytest -n "${PYTEST_WORKERS:-2}" -m "not slow" "$@" ;;
esac
