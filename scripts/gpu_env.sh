# Sourced by the GPU scripts from the repository root: installs what .whl/ holds (jax-triton, liger-kernel:
# the H200 machine lacks them and reaches no registry) into /tmp/site and puts it, src and tests on the path.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
else
  export PYTHONPATH=$PWD/src:$PWD/tests
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
