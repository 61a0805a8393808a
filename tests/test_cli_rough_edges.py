"""What a newcomer hit first on the command line, each reproduced here.

* ``qkv`` alone said only "the following arguments are required: command";
* ``qkv demo``/``plot``/``inspect`` without an optional package ended in a traceback (then
  another, for the next missing package); now one line names the package and what installs it;
* ``qkv plot`` on a damaged file ended in a traceback; now one line, ``file: could not read``.

A missing package is simulated the way Python itself marks one: ``sys.modules[name] = None``
makes ``import name`` raise ``ModuleNotFoundError``. Its submodules are taken out of
``sys.modules`` too, or ``import name.sub`` would still find an earlier test's import.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from cli_run import fails
from qkv.cli import main


def _uninstall(monkeypatch, *packages: str) -> None:
    """Make ``import package`` (and its submodules) fail as if it were not installed."""
    for package in packages:
        for name in [name for name in sys.modules if name.startswith(package + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, package, None)


def test_no_command_prints_the_commands_and_examples(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("usage: qkv")
    for command in ("demo", "bench", "plot", "inspect"):
        assert f"\n    {command} " in captured.err, command
    assert "examples:" in captured.err and "qkv demo --quick" in captured.err
    assert "required" not in captured.err


@pytest.mark.parametrize(
    "package, argv",
    [
        ("matplotlib", ["demo", "--quick", "--quiet"]),
        ("babel", ["demo", "--quick", "--quiet"]),
    ],
)
def test_demo_names_a_missing_package_before_any_work(monkeypatch, capsys, tmp_path, package, argv):
    _uninstall(monkeypatch, package)
    out = tmp_path / "demo"
    assert fails(capsys, [*argv, "--out", str(out)]) == (
        f'qkv demo: error: needs {package}, which is not installed: pip install ".[demo]" in qkv\'s folder '
        '(or "qkv[demo]" from a package index)'
    )
    assert list(tmp_path.iterdir()) == []  # not even the temporary folder


def test_plot_names_a_missing_matplotlib(monkeypatch, capsys, tmp_path):
    np.save(tmp_path / "w.npy", np.full((3, 4), 0.25))
    _uninstall(monkeypatch, "matplotlib")
    assert fails(capsys, ["plot", str(tmp_path / "w.npy")]) == (
        'qkv plot: error: needs matplotlib, which is not installed: pip install ".[viz]" in qkv\'s folder '
        '(or "qkv[viz]" from a package index)'
    )
    assert not (tmp_path / "w.png").exists()


def test_plot_names_a_missing_safetensors_only_for_a_safetensors_file(monkeypatch, capsys, tmp_path):
    (tmp_path / "w.safetensors").write_bytes(b"anything")
    _uninstall(monkeypatch, "safetensors")
    assert fails(capsys, ["plot", str(tmp_path / "w.safetensors")]) == (
        "qkv plot: error: needs safetensors, which is not installed: pip install safetensors"
    )


@pytest.mark.parametrize(
    "package, install",
    [("transformers", "transformers"), ("matplotlib", "viz")],
)
def test_inspect_names_a_missing_package_before_loading(monkeypatch, capsys, tmp_path, package, install):
    # matplotlib draws the heatmaps after the model ran: it is checked before the model loads.
    _uninstall(monkeypatch, package)
    assert fails(capsys, ["inspect", "The cat sat.", "--out", str(tmp_path / "page")]) == (
        f'qkv inspect: error: needs {package}, which is not installed: pip install ".[{install}]" in qkv\'s folder '
        f'(or "qkv[{install}]" from a package index)'
    )
    assert not (tmp_path / "page").exists()


def _garbage_pt(path):
    path.write_bytes(b"garbage bytes, not a torch file\x00\x01")


def _empty_pt(path):
    path.write_bytes(b"")


def _truncated_pt(path):
    torch.save(torch.ones(3, 3), path)
    path.write_bytes(path.read_bytes()[:300])


def _truncated_npy(path):
    np.save(path, np.ones((10, 10)))
    path.write_bytes(path.read_bytes()[:200])


def _not_npy(path):
    path.write_bytes(b"nonsense")


def _garbage_safetensors(path):
    path.write_bytes(b"garbage bytes here\x00\x01" * 3)


def _truncated_safetensors(path):
    from safetensors.torch import save_file

    save_file({"w": torch.ones(8, 8)}, str(path))
    path.write_bytes(path.read_bytes()[:-40])


@pytest.mark.parametrize(
    "name, make, reason",
    [
        ("g.pt", _garbage_pt, "torch.load: Unsupported operand"),
        ("e.pt", _empty_pt, "the file ends too early"),
        ("z.pt", _truncated_pt, "failed finding central directory"),
        ("t.npy", _truncated_npy, "Failed to read all data"),
        ("n.npy", _not_npy, "it does not start with numpy.save's header"),
        ("g.safetensors", _garbage_safetensors, ""),
        ("t.safetensors", _truncated_safetensors, ""),
    ],
)
def test_plot_a_damaged_file_is_one_line(capsys, tmp_path, name, make, reason):
    if name.endswith(".safetensors"):
        pytest.importorskip("safetensors")
    make(tmp_path / name)
    line = fails(capsys, ["plot", str(tmp_path / name)])
    assert line.startswith(f"qkv plot: error: file: could not read {name} (") and line.endswith(")"), line
    assert reason in line
    assert len(line) < 300 and "\x1b" not in line, line  # no paragraphs of advice, no terminal colours
    assert not (tmp_path / name).with_suffix(".png").exists()
