"""Every docstring example of the public modules runs (on the CPU, through the interpreter), and every
benchmark and helper script at least compiles (they run only on the GPU machine, so CI would not see a
syntax error in them otherwise)."""
import doctest
import importlib
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("flax")

MODULES = [
    "flashbridge.torch_api.norms", "flashbridge.torch_api.modules", "flashbridge.torch_api.attention",
    "flashbridge.torch_api.cross_entropy", "flashbridge.jax_api.norms", "flashbridge.jax_api.flax",
    "flashbridge.jax_api.attention", "flashbridge.jax_api.attention_flax", "flashbridge.jax_api.cross_entropy",
    "flashbridge.torch_api.decode", "flashbridge.jax_api.decode",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"


ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for d in ("benchmarks", "scripts") for p in (ROOT / d).glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS)
def test_scripts_compile(path):
    source = (ROOT / path).read_text()
    compile(source, path, "exec")  # a SyntaxError names the file and line
