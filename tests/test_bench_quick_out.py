"""``qkv bench --quick`` without ``--out`` writes outside the working tree.

It used to write ``benchmarks/RESULTS-quick.md`` relative to the working folder: run from
the repository, an untracked file in it (and quick figures are not to be quoted). The run
here is the modules suite at its smallest, from an empty working folder.
"""

import argparse
import tempfile

from qkv import bench
from qkv.bench import modules


def test_quick_run_without_out_leaves_the_working_folder_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(modules, "QUICK", dict(lengths=(16,), tokens=32, repeats=1))
    work, temporary = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    temporary.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))  # where tempfile makes its folders
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--suite", "modules", "--quick"])) == 0
    assert list(work.iterdir()) == []
    (written,) = temporary.glob("qkv-bench-quick-*/RESULTS.md")
    assert "<!-- suite: modules -->" in written.read_text()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {written}"


def test_full_run_still_defaults_to_the_results_file():
    assert bench.DEFAULT_OUT.as_posix() == "benchmarks/RESULTS.md"
