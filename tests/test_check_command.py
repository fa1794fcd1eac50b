"""``python -m flashbridge check``: passes on the CPU, reports every op, and exits 1 when a check fails."""
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from flashbridge.__main__ import main  # noqa: E402
from flashbridge import checks  # noqa: E402


def test_check_passes_on_cpu_and_writes_json(tmp_path):
    out = tmp_path / "check.json"
    assert main(["check", "--family", "norms", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ops = {(r["op"], r["framework"]) for r in rows}
    assert ("layer_norm_dropout_residual bwd", "jax") in ops and ("rms_norm fwd", "torch") in ops
    assert all(r["ok"] for r in rows)


def test_check_exits_1_on_a_failure(monkeypatch, tmp_path):
    from flashbridge.checks import norms

    real = norms.checks

    def broken(framework, device):
        rows = real(framework, device)[:1]
        rows.append(checks.Check("made-up op", framework, lambda: checks.Measurement(max_err=2.0, tol=1.0)))
        rows.append(checks.Check("crashing op", framework, lambda: 1 / 0))
        return rows

    monkeypatch.setattr(norms, "checks", broken)
    out = tmp_path / "check.json"
    assert main(["check", "--family", "norms", "--device", "cpu", "--framework", "torch", "--json", str(out)]) == 1
    rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["rms_norm fwd"]["ok"] and not rows["made-up op"]["ok"]
    assert "ZeroDivisionError" in rows["crashing op"]["error"]


def test_every_family_has_a_check_module():
    """FAMILIES lists every module under flashbridge.checks (the shared ones aside), each with checks()."""
    import importlib
    from pathlib import Path

    modules = {p.stem for p in Path(checks.__file__).parent.glob("*.py")} - {"__init__", "runner"}
    assert set(checks.FAMILIES) == modules and len(checks.FAMILIES) == len(modules)
    for family in checks.FAMILIES:
        for framework in ("torch", "jax"):
            assert importlib.import_module(f"flashbridge.checks.{family}").checks(framework, "cpu"), family


def test_check_of_the_newer_families_passes_on_cpu(tmp_path):
    """MLA (prefill forward / backward, paged decode) and block-sparse attention, in both frameworks."""
    out = tmp_path / "check.json"
    assert main(["check", "--family", "mla", "--family", "block_sparse", "--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ops = {(r["op"], r["framework"]) for r in rows}
    for framework in ("torch", "jax"):
        assert {("mla_attention causal bwd", framework), ("mla_decode paged", framework),
                ("flash_attention block_mask bwd", framework)} <= ops
    assert all(r["ok"] for r in rows)
