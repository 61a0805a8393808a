"""What a newcomer hit first on the command line, each reproduced here.

* ``qkv`` alone said only "the following arguments are required: command";
* ``qkv demo``/``plot``/``inspect`` without an optional package ended in a traceback (then
  another, for the next missing package); now one line names the package and what installs it;
* ``qkv plot`` on a damaged file ended in a traceback; now one line, ``file: could not read``,
  saying what it expected and why the file is not that, in words (not "Unsupported operand 144");
* ``qkv plot`` of a (512, 512) tensor took 58 s and 16.7 GB for a 20358 x 20208 PNG; the
  figure is now capped (``qkv.viz.MAX_INCHES``), and its messages name the flags as typed
  (``--out``, ``--x-labels``), an empty tensor, an empty dict and a complex tensor;
* ``qkv demo --seed 99999999999999999999`` ended in torch's "Overflow when unpacking long long";
* ``qkv bench`` outside a clone said only "benchmarks is not a folder that exists", and
  ``qkv demo --out /dev/null/foo`` that the folder /dev/null "does not exist".

A missing package is simulated the way Python itself marks one: ``sys.modules[name] = None``
makes ``import name`` raise ``ModuleNotFoundError``. Its submodules are taken out of
``sys.modules`` too, or ``import name.sub`` would still find an earlier test's import.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_run import fails
from qkv.cli import _missing, main


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
        f'qkv demo: error: needs {package}, which is not installed: pip install ".[demo]" in qkv\'s folder'
    )
    assert list(tmp_path.iterdir()) == []  # not even the temporary folder


def test_plot_names_a_missing_matplotlib(monkeypatch, capsys, tmp_path):
    np.save(tmp_path / "w.npy", np.full((3, 4), 0.25))
    _uninstall(monkeypatch, "matplotlib")
    assert fails(capsys, ["plot", str(tmp_path / "w.npy")]) == (
        'qkv plot: error: needs matplotlib, which is not installed: pip install ".[viz]" in qkv\'s folder'
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
        f'qkv inspect: error: needs {package}, which is not installed: pip install ".[{install}]" in qkv\'s folder'
    )
    assert not (tmp_path / "page").exists()


@pytest.mark.parametrize("package", ["gguf", "accelerate"])
def test_inspect_names_the_extra_of_a_missing_gguf_reader(package):
    # transformers reads a GGUF --model with these two, which the transformers extra installs
    error = ModuleNotFoundError(f"No module named '{package}'", name=package)
    assert _missing("inspect", error) == (
        f'needs {package}, which is not installed: pip install ".[transformers]" in qkv\'s folder'
    )


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
        ("g.pt", _garbage_pt, "it is neither the zip archive torch.save writes nor its older pickle format"),
        ("e.pt", _empty_pt, "the file is empty"),
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
    if name.endswith(".pt"):  # what a .pt file was expected to be, before why it is not
        assert f"could not read {name} (expected a file saved by torch.save holding a 2-D tensor" in line, line
    assert len(line) < 300 and "\x1b" not in line, line  # no paragraphs of advice, no terminal colours
    assert not (tmp_path / name).with_suffix(".png").exists()


def test_plot_of_random_bytes_says_what_was_expected(capsys, tmp_path):
    # The new-user review's junk.pt said "could not read junk.pt (101)".
    (tmp_path / "junk.pt").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (tmp_path / "text.pt").write_text("hello world\n")
    for name in ("junk.pt", "text.pt"):
        assert fails(capsys, ["plot", str(tmp_path / name)]) == (
            f"qkv plot: error: file: could not read {name} (expected a file saved by torch.save holding a 2-D "
            "tensor (or a larger one, with --index) or a dict of them; it is neither the zip archive torch.save "
            "writes nor its older pickle format)"
        )


def _png_size(path):
    from matplotlib.image import imread

    return imread(path).shape[:2]


def test_plot_a_512_by_512_tensor_is_quick_and_capped(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from qkv import viz

    torch.save(torch.rand(512, 512), tmp_path / "big.pt")
    assert main(["plot", str(tmp_path / "big.pt")]) == 0  # it took 58 s and 16.7 GB for a 20358 x 20208 image
    assert max(_png_size(tmp_path / "big.png")) <= viz.MAX_INCHES * 150
    assert capsys.readouterr().out == f"wrote {tmp_path / 'big.png'}\n"


def test_plot_labels_too_many_to_read_are_left_out_and_said_so(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from qkv import viz

    count = viz.MAX_LABELS + 1
    torch.save(torch.rand(3, count), tmp_path / "w.pt")
    words = " ".join(f"w{k}" for k in range(count))
    assert main(["plot", str(tmp_path / "w.pt"), "--x-labels", words, "--y-labels", "a b c"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"note: --x-labels not drawn: {count} keys are more than {viz.MAX_LABELS} can be read; the axis counts positions",
        f"wrote {tmp_path / 'w.png'}",
    ]


def _dev_null_parent() -> str:
    if not Path("/dev/null").exists() or Path("/dev/null").is_dir():
        pytest.skip("no /dev/null here")
    return "/dev/null"


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda t: torch.save(torch.zeros(0, 3), t / "empty.pt"), ["empty.pt"],
         "qkv plot: error: file: the tensor in empty.pt is empty (shape (0, 3)): nothing to plot"),
        (lambda t: torch.save({"w": torch.zeros(2, 0)}, t / "empty.pt"), ["empty.pt"],
         "qkv plot: error: file: the tensor 'w' in empty.pt is empty (shape (2, 0)): nothing to plot"),
        (lambda t: torch.save({}, t / "none.pt"), ["none.pt"],
         "qkv plot: error: file: none.pt holds no tensors (an empty dict)"),
        (lambda t: torch.save(torch.ones(3, 3, dtype=torch.complex64), t / "c.pt"), ["c.pt"],
         "qkv plot: error: file: the tensor in c.pt is complex (complex64); qkv plot draws real numbers: save its "
         ".abs() (the magnitude) or .real instead"),
        (lambda t: np.save(t / "c.npy", np.ones((3, 3), dtype=np.complex128)), ["c.npy"],
         "qkv plot: error: file: the tensor in c.npy is complex (complex128); qkv plot draws real numbers: save its "
         ".abs() (the magnitude) or .real instead"),
        (lambda t: np.save(t / "s.npy", np.array([["a", "b"]])), ["s.npy"],
         "qkv plot: error: file: the tensor in s.npy holds <U1 values, expected numbers"),
        (lambda t: torch.save(torch.rand(2, 3), t / "w.pt"), ["w.pt", "--out", "w.jpg"],
         "qkv plot: error: --out: expected a .png, .svg or .pdf suffix, got '.jpg'"),
        (lambda t: torch.save(torch.rand(2, 3), t / "w.pt"), ["w.pt", "--out", "{tmp}"],
         "qkv plot: error: --out: {tmp} is a folder; give an image file such as {tmp}/w.png"),
        (lambda t: (torch.save(torch.rand(2, 3), t / "w.pt"), (t / "f").write_text("")), ["w.pt", "--out", "{tmp}/f/w.png"],
         "qkv plot: error: --out: cannot create {tmp}/f/w.png: {tmp}/f is a file, not a folder"),
        (lambda t: (torch.save(torch.rand(2, 3), t / "w.pt"), (t / "f").write_text("")), ["w.pt", "--out", "{tmp}/f/a/w.png"],
         "qkv plot: error: --out: cannot create {tmp}/f/a/w.png: {tmp}/f is a file, not a folder"),
        (lambda t: torch.save(torch.rand(2, 3), t / "w.pt"), ["w.pt", "--x-labels", "a b"],
         "qkv plot: error: --x-labels: expected 3 labels (one per key, j), got 2"),
        (lambda t: torch.save(torch.rand(4, 2, 3), t / "w.pt"), ["w.pt", "--y-labels", "abc", "--chars"],
         "qkv plot: error: --y-labels: expected 2 labels (one per query, i), got 3"),
    ],
)  # fmt: skip
def test_plot_messages_name_the_flag_and_the_problem(capsys, tmp_path, make, args, message):
    pytest.importorskip("matplotlib")
    make(tmp_path)
    argv = ["plot", *[str(tmp_path / a) if a.endswith((".pt", ".npy")) else a.format(tmp=tmp_path) for a in args]]
    assert fails(capsys, argv) == message.format(tmp=tmp_path)
    assert not list(tmp_path.rglob("*.png"))


def test_plot_out_in_a_folder_that_is_not_one_or_cannot_be_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    torch.save(torch.rand(2, 3), tmp_path / "w.pt")
    null = _dev_null_parent()
    assert fails(capsys, ["plot", str(tmp_path / "w.pt"), "--out", f"{null}/x.png"]) == (
        f"qkv plot: error: --out: cannot create {null}/x.png: {null} is a file, not a folder"
    )
    if Path("/proc/self").is_dir():  # a folder that refuses new files whatever its permission bits say
        assert fails(capsys, ["plot", str(tmp_path / "w.pt"), "--out", "/proc/x.png"]) == (
            "qkv plot: error: --out: cannot create /proc/x.png (No such file or directory)"
        )


def test_plot_complex_tensor_prints_no_warning(capsys, tmp_path):
    import warnings

    torch.save(torch.ones(3, 3, dtype=torch.complex64), tmp_path / "c.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning (with qkv's file path in it) fails the test
        line = fails(capsys, ["plot", str(tmp_path / "c.pt")])
    assert "complex" in line and "/" not in line


def test_plot_title_and_labels_are_drawn_as_typed(capsys, tmp_path):
    # matplotlib reads $...$ as mathematics: "$\foo$" ended in an empty "qkv plot: error: ".
    pytest.importorskip("matplotlib")
    torch.save(torch.rand(2, 3), tmp_path / "w.pt")
    assert main(["plot", str(tmp_path / "w.pt"), "--title", r"cost $\foo$", "--x-labels", r"$a$ $\b$ c"]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path / 'w.png'}\n"


def test_demo_seed_past_what_torch_accepts_is_an_argument_error(capsys, tmp_path):
    from qkv.cli import build_parser
    from qkv.demo import MAX_SEED

    line = fails(capsys, ["demo", "--quick", "--seed", "99999999999999999999", "--out", str(tmp_path / "d")])
    assert line == (
        f"qkv demo: error: argument --seed: expected at most {MAX_SEED} (each step seeds torch with seed x 1000 "
        "+ its number, which must fit in 64 bits), got 99999999999999999999"
    )
    assert list(tmp_path.iterdir()) == []
    assert build_parser().parse_args(["demo", "--seed", str(MAX_SEED)]).seed == MAX_SEED
    torch.Generator().manual_seed(MAX_SEED * 1000 + 999)  # the largest seed a step can derive
    assert "--seed" in fails(capsys, ["demo", "--seed", str(MAX_SEED + 1)])


def test_demo_out_under_something_that_is_not_a_folder(capsys):
    null = _dev_null_parent()
    assert fails(capsys, ["demo", "--quick", "--out", f"{null}/foo"]) == (
        f"qkv demo: error: --out: the parent folder {null} does not exist: {null} is a file, not a folder"
    )


def test_bench_outside_a_clone_says_where_it_writes_and_how_to_choose(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert fails(capsys, ["bench", "--suite", "engine-dot"]) == (
        f"qkv bench: error: --out: the default benchmarks/RESULTS.md is relative to the current folder ({tmp_path}), "
        "which has no benchmarks folder: run qkv bench in qkv's clone, or pass --out FILE.md (or --quick, which "
        "writes to a temporary folder)"
    )
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "relative to the current folder" in help_text and "--out FILE.md" in help_text


def test_plot_help_states_the_size_cap(capsys):
    pytest.importorskip("matplotlib")
    from qkv import viz

    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"at most {viz.MAX_INCHES:g} inches ({viz.MAX_INCHES * 150:.0f} pixels) a side" in help_text
    assert f"more than {viz.MAX_LABELS} rows or columns" in help_text
    assert viz.MAX_INCHES == 20.0 and f"{viz.MAX_INCHES:g} inches" in viz.heatmap.__doc__


def test_plot_too_many_heads_names_index(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from qkv import viz

    heads = viz.MAX_PANELS + 1
    torch.save(torch.rand(2, heads, 4, 4), tmp_path / "w.pt")
    assert fails(capsys, ["plot", str(tmp_path / "w.pt"), "--index", "1"]) == (
        f"qkv plot: error: --index: the selected array has {heads} heads (shape ({heads}, 4, 4)), more than the "
        f"{viz.MAX_PANELS} panels one figure holds; pick one with another --index"
    )


def test_demo_run_refuses_a_seed_past_the_limit_before_any_work(tmp_path):
    from qkv.demo import MAX_SEED, DemoError, run

    with pytest.raises(DemoError, match=rf"^--seed: expected at most {MAX_SEED} \(each step seeds torch"):
        run(tmp_path / "out", seed=MAX_SEED + 1)
    assert list(tmp_path.iterdir()) == []


def test_plot_of_an_array_with_too_few_dims_says_so_not_to_index_more(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    torch.save(torch.randn(5), tmp_path / "one.pt")
    assert fails(capsys, ["plot", str(tmp_path / "one.pt")]) == (
        "qkv plot: error: file: the array has shape (5,), 1-d; qkv plot draws an (i, j) matrix of weights or (h, i, j) heads"
    )
    torch.save(torch.randn(3, 4, 4), tmp_path / "w.pt")
    assert fails(capsys, ["plot", str(tmp_path / "w.pt"), "--index", "0", "--index", "0"]) == (
        "qkv plot: error: file: the array after 2 --index has shape (4,), 1-d; qkv plot draws an (i, j) matrix of "
        "weights or (h, i, j) heads; give fewer --index"
    )
