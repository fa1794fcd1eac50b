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
