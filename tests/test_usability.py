"""What a new user meets first: torch.func transforms of every op, torch.compile with dynamic shapes, what
each pip extra installs, the errors of a missing framework, the command line, scripts/dev.sh and the
package's metadata (version, __all__, py.typed, annotations). CPU only, small shapes."""
from __future__ import annotations

import ast
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import typing
from pathlib import Path

import pytest

import flashbridge

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "flashbridge"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run_python(code: str, *args: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with this checkout's sources first on the path; the top-level
    modules in ``blocked`` behave as if they were not installed."""
    # None in sys.modules: an import raises ModuleNotFoundError and importlib.util.find_spec returns None,
    # as for a module that is not installed
    blocker = f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", blocker + textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------------- command line

_RUN_CLI = "import runpy; sys.argv[0] = 'flashbridge'; runpy.run_module('flashbridge', run_name='__main__')"


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"]], ids=["top", "check"])
def test_help_is_plain_text(argv):
    result = _run_python(_RUN_CLI, *argv)
    assert result.returncode == 0, result.stderr
    assert "usage: flashbridge" in result.stdout
    assert "`" not in result.stdout, result.stdout  # no RST markup from the docstrings
    if argv[0] == "check":
        from flashbridge.checks import FAMILIES
        assert all(family in result.stdout for family in FAMILIES)


def test_unknown_family_lists_the_valid_ones():
    result = _run_python(_RUN_CLI, "check", "--family", "bogus")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "invalid choice: 'bogus'" in result.stderr
    from flashbridge.checks import FAMILIES
    assert all(repr(family) in result.stderr for family in FAMILIES)


def test_check_of_a_missing_framework_names_the_extra():
    result = _run_python(_RUN_CLI, "check", "--framework", "torch", blocked=("torch",))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert 'pip install "flashbridge[torch]"' in result.stderr


def test_version_flag():
    result = _run_python(_RUN_CLI, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"flashbridge {flashbridge.__version__}"


# ---------------------------------------------------------------------------- a framework not installed

def _installed(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_front_end_without_its_framework_names_the_extra(framework):
    if not _installed(framework):
        pytest.skip(f"{framework} is not installed")
    result = _run_python(f"""
        try:
            import flashbridge.{framework}_api
        except ImportError as exc:
            print(type(exc).__name__, exc)
    """, blocked=(framework,))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (f"ImportError flashbridge.{framework}_api needs {framework}, which is not "
                                     f'installed: pip install "flashbridge[{framework}]"')


def test_jax_api_without_flax_or_jax_triton():
    """The functional ops need neither (jax-triton runs the kernels on a GPU only); the Flax modules and a
    GPU launch say what is missing."""
    if not _installed("jax"):
        pytest.skip("jax is not installed")
    result = _run_python("""
        import flashbridge.jax_api as jax_api
        from flashbridge.jax_api._runtime import _jax_triton
        print(jax_api.rms_norm.__name__)
        for use in (lambda: jax_api.RMSNorm, _jax_triton):
            try:
                use()
            except ImportError as exc:
                print(exc)
    """, blocked=("flax", "jax_triton"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "rms_norm",
        'flashbridge.jax_api.RMSNorm needs flax, which is not installed: pip install "flashbridge[jax]"',
        'flashbridge.jax_api on a GPU needs jax_triton, which is not installed: pip install "flashbridge[jax]"']


# ----------------------------------------------------------------------------- what each extra installs

def _dist_names(requirements) -> set[str]:
    names = set()
    for req in requirements:
        match = re.match(r"[A-Za-z0-9_.\-]+", req)
        name = match.group(0).lower().replace("-", "_").replace(".", "_")
        extras = re.search(r"\[([^\]]+)\]", req)
        if name == "flashbridge" and extras:  # e.g. all = ["flashbridge[torch,jax,bench]"]
            for extra in extras.group(1).split(","):
                names |= _dist_names(PYPROJECT["project"]["optional-dependencies"][extra.strip()])
        else:
            names.add(name)
    return names


def _imported_modules(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names of the absolute imports of a source file: (at module level, inside functions)."""
    def names(nodes):
        found = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
        return found - set(sys.stdlib_module_names) - {"flashbridge"}

    tree = ast.parse(path.read_text())
    top = names(tree.body)
    return top, names(ast.walk(tree)) - top


@pytest.mark.parametrize("part", ["core", "torch_api", "jax_api"])
def test_every_import_is_installed_by_its_extra(part):
    """A plain install's dependencies cover everything outside the front-ends, the references and
    ``python -m flashbridge check`` included (e.g. ml_dtypes, which rounds to bfloat16 and float8 there);
    those modules import a framework only inside the functions that use it. Each front-end adds its
    extra."""
    optional = PYPROJECT["project"]["optional-dependencies"]
    core = _dist_names(PYPROJECT["project"]["dependencies"])
    if part == "core":
        files = [f for f in SRC.rglob("*.py") if f.parent.name not in ("torch_api", "jax_api")]
        module_level, lazy = core, core | _dist_names(optional["torch"]) | _dist_names(optional["jax"])
    else:
        files = list((SRC / part).rglob("*.py"))
        module_level = lazy = core | _dist_names(optional[part.removesuffix("_api")])
    for f in files:
        top, inner = _imported_modules(f)
        missing = (top - module_level) | (inner - lazy)
        assert not missing, f"{f.relative_to(ROOT)} imports {sorted(missing)}, which {part}'s install lacks"


# ------------------------------------------------------------------------------------ package metadata

def test_version_has_one_source():
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flashbridge.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*", flashbridge.__version__)
    assert "__version__" in flashbridge.__all__


def test_py_typed_is_shipped():
    assert (SRC / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["flashbridge"]


@pytest.mark.parametrize("front_end", ["torch_api", "jax_api"])
def test_public_api_is_listed_and_annotated(front_end):
    framework = {"torch_api": "torch", "jax_api": "jax"}[front_end]
    pytest.importorskip(framework)
    if framework == "jax":
        pytest.importorskip("flax")
    import importlib
    module = importlib.import_module(f"flashbridge.{front_end}")
    public = {n for n in vars(module) if not n.startswith("_")
              and getattr(getattr(module, n), "__module__", "").startswith(module.__name__)}
    assert public <= set(module.__all__), f"public but not in __all__: {sorted(public - set(module.__all__))}"
    for name in module.__all__:
        obj = getattr(module, name)
        functions = ([obj.__dict__[m] for m in ("__init__", "forward", "__call__") if m in obj.__dict__]
                     if inspect.isclass(obj) else [obj])
        for fn in functions:
            hints = typing.get_type_hints(fn)  # the annotations resolve
            assert "return" in hints, f"{front_end}.{name}: {fn.__name__} has no return annotation"


# ---------------------------------------------------------------------------------------- scripts/dev.sh

def _fake_checkout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """scripts/dev.sh and pyproject.toml in a scratch checkout, with an environment whose python only
    records how it was called (``import torch`` fails the first time, as in a new environment)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "dev.sh", tmp_path / "scripts" / "dev.sh")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    venv, log = tmp_path / "env", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$*" >> {log}
        if [ "$1" = "-c" ]; then [ -e {venv}/torch ]; exit; fi
        if [ "$*" = "-m pip install -q torch==2.13.0" ]; then touch {venv}/torch; fi
    """))
    python.chmod(0o755)
    return tmp_path, venv, log


def _dev(checkout: Path, venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "dev.sh"), *args], capture_output=True, text=True,
                          env={**os.environ, "FLASHBRIDGE_VENV": str(venv)}, timeout=60)


def test_dev_sh_installs_once_and_again_when_pyproject_changes(tmp_path):
    checkout, venv, log = _fake_checkout(tmp_path)
    first = _dev(checkout, venv, "check", "--family", "norms")
    assert first.returncode == 0, first.stderr
    steps = first.stderr.splitlines()
    assert len(steps) == 2 and "installing torch" in steps[0] and "installing flashbridge[all,test]" in steps[1]
    calls = log.read_text().splitlines()
    assert "-m pip install -q -e .[all,test]" in calls and calls[-1] == "-m flashbridge check --family norms"

    log.write_text("")
    second = _dev(checkout, venv, "test", "-k", "norms")
    assert second.returncode == 0 and second.stderr == ""  # installed: no step, no pip
    assert log.read_text().splitlines() == ["-m pytest -n 2 -k norms"]

    (checkout / "pyproject.toml").write_text((checkout / "pyproject.toml").read_text() + "\n# changed\n")
    log.write_text("")
    third = _dev(checkout, venv, "check")
    assert third.returncode == 0 and third.stderr.splitlines() == [
        "scripts/dev.sh: installing flashbridge[all,test] from this checkout (editable; this can take minutes)"]
    assert "-m pip install -q -e .[all,test]" in log.read_text().splitlines()


def test_dev_sh_usage(tmp_path):
    checkout, venv, log = _fake_checkout(tmp_path)
    result = _dev(checkout, venv, "bogus")
    assert result.returncode == 2 and "usage: scripts/dev.sh check|test" in result.stderr
    assert not log.exists()  # nothing installed for a mistyped command
