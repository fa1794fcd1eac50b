"""Shared pytest set-up: several host devices for JAX's shard_map tests, the gpu marker, poisoned buffers."""
import os

# Must happen before JAX initialises its CPU backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
# GPU plans read tiles from the user's tuning cache: the tests see the shipped entries only
os.environ["FLASHBRIDGE_CACHE"] = os.path.join(__import__("tempfile").mkdtemp(prefix="flashbridge-test-"), "cache")

import pytest  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_CUDA = _has_cuda()

if HAS_CUDA:
    # Importing jax_triton sets TRITON_CACHE_DIR="" for the whole process, after which every Triton compile
    # fails; import it once, here, through the runtime helper that repairs the variable.
    try:
        from flashbridge.jax_api._runtime import _jax_triton
        _jax_triton()
    except ImportError:
        pass


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marks added here
def pytest_collection_modifyitems(config, items):
    _thin_grids(items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _thin_grids(items) -> None:
    """``@pytest.mark.thin(keep)`` on a parametrized test: ``keep`` of its cases, spread evenly over its
    parameter grid (the first and the last among them), stay in the default run; the others are marked
    ``slow`` (CI runs them after the default run)."""
    grids: dict = {}
    for item in items:
        marker = item.get_closest_marker("thin")
        if marker is not None and getattr(item, "callspec", None) is not None:
            grids.setdefault((item.path, item.originalname), (marker.args[0], []))[1].append(item)
    for keep, cases in grids.values():
        if len(cases) <= keep:
            continue
        kept = {round(i * (len(cases) - 1) / (keep - 1)) for i in range(keep)} if keep > 1 else {0}
        for i, item in enumerate(cases):
            if i not in kept:
                item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Tests that draw from torch's global generator get the same inputs whatever order (or xdist worker)
    they run in: the seed comes from the test's id (and FLASHBRIDGE_TEST_SEED)."""
    import zlib

    seed = zlib.crc32(request.node.nodeid.encode()) + int(os.environ.get("FLASHBRIDGE_TEST_SEED", "0"))
    try:
        import torch
        torch.manual_seed(seed)
    except ImportError:
        pass
    yield


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every kernel output starts as NaN in tests, so an element the kernels never write shows up."""
    from flashbridge.core_kernels._poison import poison_buffers

    with poison_buffers():
        yield
