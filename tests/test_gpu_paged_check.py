"""``benchmarks/gpu_paged_check.py`` (the paged primitives' GPU check), run tiny on the CPU so that it keeps working."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_paged_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_paged_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_check_passes_on_the_cpu_and_prints_every_case(capsys):
    assert _script().main(["--device", "cpu", "--quick"]) == 0
    text = capsys.readouterr().out
    for case in ("decode", "decode, varlen_attn with a block table", "ragged", "latent"):
        assert f"| {case} | pass |" in text


def test_a_parity_failure_is_reported_and_fails_the_run(capsys, monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "BOUND", 0.0)  # no float32 answer equals float64 exactly
    assert script.main(["--device", "cpu", "--quick"]) == 1
    assert "| decode | FAIL |" in capsys.readouterr().out
