"""The documentation runs: every Python block of the README and every docstring example of the public
modules (on the CPU, through the interpreter); the README and docs/ link only to files and headings that
exist; every benchmark and helper script at least compiles (they run only on the GPU machine, so CI would
not see a syntax error in them otherwise)."""
import doctest
import importlib
import pathlib
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("flax")

MODULES = [
    "flashbridge.torch_api.norms", "flashbridge.torch_api.modules", "flashbridge.torch_api.attention",
    "flashbridge.torch_api.cross_entropy", "flashbridge.jax_api.norms", "flashbridge.jax_api.flax",
    "flashbridge.jax_api.attention", "flashbridge.jax_api.attention_flax", "flashbridge.jax_api.cross_entropy",
    "flashbridge.torch_api.decode", "flashbridge.jax_api.decode", "flashbridge.torch_api.rotary",
    "flashbridge.jax_api.rotary", "flashbridge.torch_api.swiglu", "flashbridge.jax_api.swiglu",
    "flashbridge.torch_api.ring", "flashbridge.jax_api.ring", "flashbridge.tiles", "flashbridge.jax_api.checks",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples failed in {name}"


ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "CHANGELOG.md"]


def _python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """(first line number, source) of every fenced ```python block."""
    blocks, start, body = [], None, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if start is None and line.strip() == "```python":
            start, body = number + 1, []
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(body) + "\n"))
            start = None
        elif start is not None:
            body.append(line)
    assert start is None, f"{path.name}: a ```python block opened at line {start - 1} is never closed"
    return blocks


README_BLOCKS = _python_blocks(README)


def test_readme_has_a_tour():
    """The tour shows both front-ends, each on the families a newcomer meets first."""
    sources = [source for _, source in README_BLOCKS]
    for front_end, ops in (("flashbridge.torch_api", ("rms_norm", "flash_attention", "decode_attention",
                                                      "linear_cross_entropy")),
                           ("flashbridge.jax_api", ("rms_norm", "flash_attention", "decode_attention",
                                                    "linear_cross_entropy"))):
        shown = "\n".join(s for s in sources if front_end in s)
        assert shown, f"the README's tour lost its {front_end} block"
        missing = [op for op in ops if not re.search(rf"\.{op}\b", shown)]
        assert not missing, f"the README's {front_end} tour lost {missing}"


@pytest.mark.parametrize("start, source", README_BLOCKS, ids=[f"README.md:{n}" for n, _ in README_BLOCKS])
def test_readme_block_runs(start, source):
    """Each block runs on its own, in a fresh namespace, exactly as a reader would paste it: a traceback
    names README.md and the line. On a machine without a GPU the kernels run through the interpreter."""
    code = compile("\n" * (start - 1) + source, str(README), "exec")
    exec(code, {"__name__": "__readme__"})


def test_readme_stays_user_documentation():
    """Development notes and measurement history belong in docs/ and git, not in the README."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250 and len(text.encode()) <= 20_000, "README.md: at most 250 lines / 20 KB"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    """Every relative link of the README, docs/ and the changelog names a file (or folder) in the tree, and
    a #heading in a Markdown file that has it."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # links inside code blocks are code
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to {target!r}, which does not exist"
        if anchor and dest.suffix == ".md":
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), flags=re.M)}
            assert anchor in headings, f"{path.name}: link to {target!r}, but {dest.name} has no such heading"


SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for d in ("benchmarks", "scripts") for p in (ROOT / d).glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS)
def test_scripts_compile(path):
    source = (ROOT / path).read_text()
    compile(source, path, "exec")  # a SyntaxError names the file and line


def test_ncu_sass_summary(tmp_path):
    """The per-opcode summary of Nsight Compute's SASS source page: ncu's log lines skipped, the hot loop
    picked by execution count, samples attributed to opcodes (predicates stripped) and stall reasons."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import ncu_sass_summary
    finally:
        sys.path.pop(0)
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_wait", "stall_long_sb", "stall_selected", "stall_wait (Not Issued)"]
    body = [["0x10", "MOV R1, R2", "5", "1", "4", "0", "1", "4"],  # prologue: executed once, not in the loop
            ["0x20", "HMMA.16816.F32 R4, R8, R12, R4", "30", "1,000", "20", "0", "10", "20"],
            ["0x30", "@!P0 BRA 0x20", "60", "1,000", "0", "58", "2", "0"],
            ["0x40", "F2FP.F16.E4M3.UNPACK_B R5, R6", "10", "600", "6", "0", "4", "6"]]
    lines = ["==PROF== Connected to process 1", '"Kernel Name","decode_fwd_kernel"']
    lines += [",".join(f'"{cell}"' for cell in row) for row in [header] + body]
    path = tmp_path / "sass.csv"
    path.write_text("\n".join(lines) + "\n")
    text = ncu_sass_summary.summarise(str(path), top=2)
    assert "decode_fwd_kernel" in text
    assert "hot loop: 3 instructions, each executed 1000 times; 100 of 105 warp-stall samples" in text
    assert "stall mix: long_sb 58.0%  wait 26.0%  selected 16.0%" in text
    rows = {line.split()[0]: line.split()[1:3] for line in text.splitlines() if line[:1].isupper()}
    assert rows["BRA"] == ["1", "60.0%"] and rows["HMMA"] == ["1", "30.0%"] and rows["F2FP"] == ["1", "10.0%"]
    assert "MOV" not in rows


@pytest.mark.parametrize("front_end", ["torch_api", "jax_api"])
def test_readme_op_table_lists_every_public_name(front_end):
    """Every name a front-end exports (``__all__``: ops, modules, mask helpers) appears in the README's op
    table, so the table is the whole public surface."""
    module = pytest.importorskip(f"flashbridge.{front_end}")
    text = README.read_text()
    table = text[text.index("## Ops"):text.index("## Performance")]
    named = set(re.findall(r"`([A-Za-z_]\w*)", table))
    missing = sorted(set(module.__all__) - named)
    assert not missing, f"README.md's op table does not name {missing} of flashbridge.{front_end}"
