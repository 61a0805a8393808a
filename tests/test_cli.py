"""Tests of the ``qkv`` command line: version, help, one-line errors with exit code 2, ``qkv plot``.

The demo itself is tested in ``tests/test_demo.py``; here ``qkv demo`` is only given bad
arguments, which must be refused before any work starts.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import qkv
from qkv.cli import main


def _fails(capsys, argv: list[str]) -> str:
    """Run ``qkv argv``, expect exit code 2 and exactly one line on stderr; return that line."""
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"qkv {qkv.__version__}"


@pytest.mark.parametrize("command", [[], ["demo"], ["plot"], ["bench"], ["inspect"]])
def test_help_on_each_command(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: qkv")
    if command == ["demo"]:
        for option in ("--out", "--seed", "--quick", "--steps", "--quiet"):
            assert option in out
    if command == ["inspect"]:
        for option in ("TEXT", "--model", "--layer", "--head", "--rows", "--heads", "--out"):
            assert option in out


def test_python_dash_m(tmp_path):
    # One subprocess (importing torch is slow): `python -m qkv` reaches the parser and
    # returns its exit code.
    done = subprocess.run([sys.executable, "-m", "qkv", "dmeo"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("qkv: error: argument command: invalid choice: 'dmeo'")


def test_unknown_command(capsys):
    # `qkv` with no command prints the help instead: tests/test_cli_rough_edges.py
    assert "invalid choice: 'dmeo'" in _fails(capsys, ["dmeo"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--steps", "-3"], "qkv demo: error: argument --steps: expected a positive integer, got -3"),
        (["demo", "--steps", "0"], "qkv demo: error: argument --steps: expected a positive integer, got 0"),
        (["demo", "--steps", "many"], "qkv demo: error: argument --steps: expected a positive integer, got 'many'"),
        (["demo", "--seed", "-1"], "qkv demo: error: argument --seed: expected a non-negative integer, got -1"),
        (["demo", "--fast"], "qkv: error: unrecognized arguments: --fast"),
    ],
)
def test_bad_demo_arguments(capsys, argv, message):
    assert _fails(capsys, argv) == message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--suite", "nope"], "qkv bench: error: argument --suite: expected one of ["),
        (["bench", "--suite", "engine", "--suite", "apporx"], "qkv bench: error: argument --suite: expected one of ["),
        (["bench", "--threads", "0"], "qkv bench: error: argument --threads: expected a positive integer, got 0"),
        (["bench", "--threads", "two"], "qkv bench: error: argument --threads: expected a positive integer, got 'two'"),
    ],
)
def test_bad_bench_arguments(capsys, argv, message):
    line = _fails(capsys, argv)
    assert line.startswith(message), line
    if "--suite" in message:
        assert "'engine'" in line and "or 'all', got " in line


def test_bench_run_refuses_an_unknown_suite_given_programmatically(capsys):
    # qkv.bench.run may be called with a namespace that bypassed the parser's check
    from argparse import Namespace

    from qkv import bench

    args = Namespace(suite=["nope"], quick=True, out=None, threads=None, case=None)
    assert bench.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkv bench: error: --suite: expected one of [")


def test_unwritable_out(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    line = _fails(capsys, ["demo", "--quick", "--out", str(tmp_path / "file" / "out")])
    # It exists, but as a file: say so, not only that there is no such folder.
    file = tmp_path / "file"
    assert line == f"qkv demo: error: --out: the parent folder {file} does not exist: {file} is a file, not a folder"
    line = _fails(capsys, ["demo", "--quick", "--out", str(file / "a" / "out")])
    assert line == f"qkv demo: error: --out: the parent folder {file / 'a'} does not exist: {file} is a file, not a folder"
    line = _fails(capsys, ["demo", "--quick", "--out", str(tmp_path / "none" / "out")])
    assert line == f"qkv demo: error: --out: the parent folder {tmp_path / 'none'} does not exist"
    line = _fails(capsys, ["demo", "--out", str(tmp_path / "file")])
    assert line == f"qkv demo: error: --out: {tmp_path / 'file'} exists and is not a folder"
    # Nothing was created next to the refused folders.
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_plot_2d_and_3d(capsys, tmp_path):
    generator = torch.Generator().manual_seed(0)
    weights = torch.softmax(torch.randn(2, 3, 5, 7, generator=generator), dim=-1)  # (b, h, i, j)
    torch.save({"weights": weights, "other": torch.zeros(2)}, tmp_path / "w.pt")
    assert main(["plot", str(tmp_path / "w.pt"), "--key", "weights", "--index", "1", "--out", str(tmp_path / "heads.png")]) == 0
    assert main(["plot", str(tmp_path / "w.pt"), "--key", "weights", "--index", "0", "--index", "2",
                 "--x-labels", "abcdefg", "--y-labels", "vwxyz", "--chars", "--title", "one head"]) == 0  # fmt: skip
    np.save(tmp_path / "w.npy", weights[0, 0].numpy())
    assert main(["plot", str(tmp_path / "w.npy")]) == 0
    for name in ("heads.png", "w.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert capsys.readouterr().out.count("wrote ") == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["missing.pt"], "qkv plot: error: file: {tmp}/missing.pt does not exist"),
        (["w.pt"], "qkv plot: error: --key: w.pt holds 2 tensors, name one of ['other', 'weights']"),
        (["w.pt", "--key", "nope"], "qkv plot: error: --key: expected one of ['other', 'weights'], got 'nope'"),
        (["w.pt", "--key", "weights"], "qkv plot: error: --index: the selected array has shape (2, 3, 5, 7); give one "
                                       "--index per leading dim until it is (i, j) or (h, i, j)"),  # fmt: skip
        (["w.pt", "--key", "weights", "--index", "9"], "qkv plot: error: --index: index 9 (--index number 1) is past the "
                                                       "array's end: it has a leading dim of size 2 at that point "
                                                       "(shape (2, 3, 5, 7))"),  # fmt: skip
        (["folder.pt"], "qkv plot: error: file: {tmp}/folder.pt is a folder, expected a file"),
        (["w.pt", "--key", "weights", "--index", "0", "--index", "0", "--x-labels", "a b"],
         "qkv plot: error: --x-labels: expected 7 labels (one per key, j), got 2"),  # fmt: skip
        (["notes.txt"], "qkv plot: error: file: expected a .pt, .pth, .npy, .npz or .safetensors file, got 'notes.txt'"),
        (["w.pt", "--index", "-1"], "qkv plot: error: argument --index: expected a non-negative integer, got -1"),
    ],
)
def test_plot_bad_arguments(capsys, tmp_path, args, message):
    torch.save({"weights": torch.rand(2, 3, 5, 7), "other": torch.zeros(2)}, tmp_path / "w.pt")
    (tmp_path / "notes.txt").write_text("not weights")
    (tmp_path / "folder.pt").mkdir()
    argv = ["plot", *[str(tmp_path / a) if a.endswith((".pt", ".txt")) else a for a in args]]
    assert _fails(capsys, argv) == message.format(tmp=tmp_path)
    assert not list(tmp_path.glob("*.png"))
