"""The benchmark machinery on tiny sizes: it runs, writes tables, measures memory in a subprocess.

No timing is asserted (the figures belong in benchmarks/RESULTS.md, not in unit tests).
"""

import argparse

import pytest
import torch

from qkv import bench
from qkv.bench import measure, modules
from qkv.bench.report import Targets, table


def test_interleaved_calls_each_contender_warmup_plus_repeats_times():
    calls = {"a": 0, "b": 0}

    def make(name):
        def fn():
            calls[name] += 1

        return fn

    medians = measure.interleaved({"a": make("a"), "b": make("b")}, repeats=4, warmup=1)
    assert calls == {"a": 5, "b": 5}
    assert set(medians) == {"a", "b"} and all(t >= 0 for t in medians.values())


def test_interleaved_runs_before_untimed_ahead_of_every_timed_call():
    log = []
    measure.interleaved({"a": lambda: log.append("a"), "b": lambda: log.append("b")}, repeats=2, warmup=1,
                        before=lambda: log.append("before"))  # fmt: skip
    assert log == ["a", "b", "before", "a", "before", "b", "before", "b", "before", "a"]


def test_evict_writes_its_whole_buffer_each_call_and_is_larger_than_the_caches_met(monkeypatch):
    assert measure.Evict.BYTES >= 2 * 105 * 2**20  # twice the largest last-level cache met (Intel Xeon)
    monkeypatch.setattr(measure.Evict, "BYTES", 4096)
    evict = measure.Evict()
    evict()
    evict()
    assert evict._buffer.numel() == 1024 and bool((evict._buffer == 3).all())
    assert measure.evicting(False) is None and isinstance(measure.evicting(True), measure.Evict)


def test_peak_memory_is_measured_in_a_fresh_process():
    """The materialised additive score holds an (i, j, n) tensor: the child's extra peak shows it."""
    spec = {"case": "additive", "hidden": 128, "i": 512, "h": 1, "mode": "fwd", "impl": "materialised"}
    result = measure.peak_memory("engine", spec)
    one = 512 * 512 * 128 * 4  # bytes of one (i, j, n) float32 tensor
    assert result["inputs"] > 0 and result["peak"] >= result["inputs"]
    assert result["extra"] >= one


def test_an_unknown_case_is_an_error():
    with pytest.raises(ValueError, match="case: expected dot, bias, window, layout or additive, got 'nonsense'"):
        measure.run_case({"suite": "engine", "case": "nonsense", "i": 8, "h": 1, "mode": "fwd", "impl": "qkv"})


def test_machine_description_names_cpu_torch_and_threads():
    info = measure.machine()
    assert {"cpu", "cores", "torch", "torch threads"} <= set(info)


def test_targets_met_and_not_met():
    t = Targets()
    assert t.add("ratio", 0.9, 1.0)
    assert not t.add("speedup", 5.0, 10.0, higher=True)
    assert not t.add("missing", float("nan"), 1.0)
    lines = t.lines()
    assert lines[0] == "| target | measured | status |"
    assert lines[2:] == ["| ratio | 0.9 | met |", "| speedup | 5 | **not met** |", "| missing | nan | **not met** |"]
    assert table(["a", "b"], [[1, 2]]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_a_figure_just_past_its_bound_shows_the_digits_that_miss_it():
    t = Targets()
    t.add("slower", 1.0042, 1.0)
    t.add("not faster", 9.9996, 10.0, higher=True)
    t.add("exactly", 1.0, 1.0)
    t.add("far", 1.23456, 1.0)
    measured = [line.split(" | ")[1] for line in t.lines()[2:]]
    assert measured == ["1.004", "9.9996", "1", "1.23"]


def test_quick_modules_suite_writes_a_results_file(tmp_path, monkeypatch):
    monkeypatch.setattr(modules, "QUICK", dict(lengths=(16,), tokens=32, repeats=1))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "RESULTS.md"
    assert bench.run(parser.parse_args(["--suite", "modules", "--quick", "--out", str(out)])) == 0
    text = out.read_text()
    assert "### Machine" in text and "| torch |" in text and "| cpu capability |" in text and "_Started " in text
    assert "<!-- suite: modules -->" in text and "<!-- end: modules -->" in text
    assert "| 16 | 2 |" in text  # the row for i = 16, b = 32 / 16
    assert "qkv's four projections ran on BLAS (F.linear) in training and on BLAS (F.linear) in inference" in text  # 32 tokens: too few for oneDNN
    assert "### Targets" in text



def test_modules_contenders_compute_the_same_attention():
    # a fair race: the same input, the same weights, the same output from every contender
    outs = {}
    for impl in ("qkv", "torch_fast", "torch_default"):
        module, fn = modules.call({"i": 16, "tokens": 32, "impl": impl})
        if impl != "qkv":
            assert module.batch_first  # qkv modules are always batch-first
        with torch.no_grad():
            outs[impl] = fn()
    assert outs["qkv"].shape == (2, 16, modules.DIM)
    torch.testing.assert_close(outs["qkv"], outs["torch_fast"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["torch_default"], outs["torch_fast"], rtol=1e-5, atol=1e-5)

def test_sections_of_suites_not_run_are_kept(tmp_path):
    out = tmp_path / "RESULTS.md"
    info = {"cpu": "x"}
    bench.write(out, {"engine": "## Engine\nold engine\n"}, info)
    bench.write(out, {"modules": "## Modules\nnew modules\n"}, info)
    bench.write(out, {"engine": "## Engine\nnew engine\n"}, info)
    text = out.read_text()
    assert "new engine" in text and "new modules" in text and "old engine" not in text
    assert text.index("<!-- suite: engine -->") < text.index("<!-- suite: modules -->")


def test_unknown_suite_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"--suite: expected one of \[.*'engine'.*\] or 'all', got 'nope'"):
        bench.suite_module("nope")


def test_a_suite_run_part_by_part_replaces_the_whole(tmp_path):
    out = tmp_path / "RESULTS.md"
    bench.write(out, {"engine": "## Engine\nold\n"}, {})
    bench.write(out, {"engine-bias": "## Engine (bias)\nnew bias\n"}, {})
    assert "old" in out.read_text()  # other parts not rerun yet: the whole run is kept
    bench.write(out, {f"engine-{p}": f"## Engine ({p})\nnew {p}\n" for p in ("dot", "window", "additive", "bf16", "layouts")}, {})
    text = out.read_text()
    assert "old" not in text and "new bias" in text and "new additive" in text


def test_a_part_runs_only_its_cases():
    part = bench.suite_module("engine-window")
    assert part.NAME == "engine" and part.DESCRIPTION.endswith("[window only]")


_STEADY_HEAP_CHECK = """
import resource, torch
from qkv.bench.measure import _glibc, steady_heap

def faults():  # of a fresh 64 MiB tensor, written once, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

with steady_heap(enabled=False) as active:
    assert active is False
outside = faults()
with steady_heap() as active:
    faults()  # the first one still comes from the kernel
    # the fewest of three: now and then glibc places the block afresh all the same
    inside = min(faults() for _ in range(3))
print(_glibc() is not None, active, outside, inside, faults())
"""


def test_steady_heap_keeps_freed_memory_and_is_undone_on_exit():
    # In a child process: the thresholds are process-wide and this one runs the other tests.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _STEADY_HEAP_CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    glibc, active, outside, inside, after = done.stdout.split()
    if glibc != "True":
        assert active == "False"
        pytest.skip("steady_heap acts on glibc only")
    assert active == "True"
    pages = (64 << 20) // 4096
    if int(outside) < pages // 2:
        pytest.skip("fresh memory here is not faulted in 4 KiB pages (huge pages?): nothing to keep")
    assert int(inside) < pages // 10  # kept in the heap: reused without faults
    assert int(after) > pages // 2  # glibc's default again: fresh pages every time


def test_a_results_file_that_cannot_be_read_or_written_is_one_line_before_any_suite_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "_section", lambda *a: pytest.fail("a suite ran before --out was checked"))
    binary = tmp_path / "w.pt"
    binary.write_bytes(bytes(range(128, 256)))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    cases = [
        (["--quick", "--suite", "engine-dot", "--out", str(tmp_path)], f"--out: {tmp_path} is a folder; give a markdown file"),
        (["--quick", "--suite", "engine-dot", "--out", str(binary)], f"--out: {binary} is not a text file"),
        (["--quick", "--suite", "engine-dot", "--out", str(tmp_path / "no" / "x.md")], f"--out: {tmp_path / 'no'} is not a folder"),
        (["--summary", "--out", str(binary)], f"--summary: {binary} is not a text file"),
    ]
    for argv, message in cases:
        assert bench.run(parser.parse_args(argv)) == 2
        assert capsys.readouterr().err.startswith(f"qkv bench: error: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.pt"]
