"""Tests of ``qkv.bench.results``: RESULTS.md keeps one section per CPU, a run touches only its own."""

from __future__ import annotations

import argparse

from qkv import bench
from qkv.bench import measure, results

AMD = {"cpu": "AMD EPYC", "cpu capability": "AVX2", "BLAS": "MKL 2024.2", "oneDNN": "3.12.0", "date": "d1"}
INTEL = {"cpu": "Intel(R) Xeon(R) Platinum 8480+", "cpu capability": "AVX512", "BLAS": "MKL 2024.2", "date": "d2"}


def _targets(*rows: tuple[str, str, str]) -> str:
    lines = ["### Targets", "", "| target | measured | status |", "|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows]) + "\n"


def _approx(speedup: str, status: str = "met") -> str:
    return "### Approximate attention\n\nsome table\n\n" + _targets(("Linformer: × faster than exact at i = 16K", speedup, status))


def test_a_run_on_another_cpu_adds_its_section_and_keeps_the_first(tmp_path):
    out = tmp_path / "RESULTS.md"
    bench.write(out, {"approx": _approx("28.8×")}, AMD)
    bench.write(out, {"approx": _approx("3.4×", "**not met**")}, INTEL)
    sections = results.parse(out.read_text())
    assert list(sections) == ["AMD EPYC, AVX2", "Intel(R) Xeon(R) Platinum 8480+, AVX512"]
    assert "28.8×" in sections["AMD EPYC, AVX2"]["suites"]["approx"]
    assert "3.4×" in sections["Intel(R) Xeon(R) Platinum 8480+, AVX512"]["suites"]["approx"]
    assert "| cpu capability | AVX512 |" in sections["Intel(R) Xeon(R) Platinum 8480+, AVX512"]["machine"]


def test_a_rerun_replaces_only_its_own_cpu_and_its_own_suites(tmp_path):
    out = tmp_path / "RESULTS.md"
    bench.write(out, {"approx": _approx("28.8×"), "generation": "## Generation\n\nold amd generation\n"}, AMD)
    bench.write(out, {"approx": _approx("3.4×", "**not met**")}, INTEL)
    bench.write(out, {"approx": _approx("24.0×")}, {**INTEL, "date": "d3"})  # Intel again
    text = out.read_text()
    sections = results.parse(text)
    intel = sections["Intel(R) Xeon(R) Platinum 8480+, AVX512"]
    assert "24.0×" in intel["suites"]["approx"] and "3.4×" not in text
    assert "| date | d3 |" in intel["machine"]
    amd = sections["AMD EPYC, AVX2"]
    assert "28.8×" in amd["suites"]["approx"] and "old amd generation" in amd["suites"]["generation"]
    assert "| date | d1 |" in amd["machine"]
    # The AMD section still comes first and each section is written once.
    assert text.count("<!-- cpu: AMD EPYC, AVX2 -->") == 1 and text.index("## AMD EPYC, AVX2") < text.index("## Intel")


def test_suites_not_rerun_on_a_cpu_are_kept_and_parts_replace_the_whole(tmp_path):
    out = tmp_path / "RESULTS.md"
    bench.write(out, {"engine": "## Engine\nold engine\n", "modules": "## Modules\nmodules\n"}, AMD)
    bench.write(out, {f"engine-{p}": f"## Engine ({p})\nnew {p}\n" for p in ("dot", "bias", "window", "additive", "bf16", "layouts")}, AMD)
    suites = results.parse(out.read_text())["AMD EPYC, AVX2"]["suites"]
    assert "engine" not in suites and "modules" in suites and "new bias" in suites["engine-bias"]


def test_an_emulated_cpu_is_filed_apart_from_the_real_one(tmp_path, monkeypatch):
    for name in measure.KERNEL_SETTINGS:  # the suite itself may run under some (QKV_ROUTE=blas)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = measure.machine()
    assert info["kernels set by"] == "ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2"
    named = info["cpu"] + (" (family {}, model {})".format(*info["cpu family, model"].split(", "))
                           if "cpu family, model" in info else "")  # fmt: skip
    assert results.cpu_name(info) == f"{named}, {info['cpu capability']} (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2)"
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert results.cpu_name(measure.machine()) == f"{named}, {info['cpu capability']}"


def test_a_generic_model_string_is_told_apart_by_its_family_and_model():
    """A virtual machine's "AMD EPYC" is a Zen 3, 4 or 5: each gets its own section; a record without them keeps its name."""
    zen4 = {"cpu": "AMD EPYC", "cpu family, model": "25, 17", "cpu capability": "AVX512"}
    zen5 = {**zen4, "cpu family, model": "26, 2"}
    assert results.cpu_name(zen4) == "AMD EPYC (family 25, model 17), AVX512"
    assert results.cpu_name(zen4) != results.cpu_name(zen5)
    assert results.cpu_name({"cpu": "AMD EPYC", "cpu capability": "AVX512"}) == "AMD EPYC, AVX512"


def test_machine_names_the_kernels_and_the_blas():
    info = measure.machine()
    assert info["cpu capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "VSX", "NO AVX", "SVE256")  # torch's names
    assert info["BLAS"] and info["oneDNN"]


def test_the_layout_before_cpu_sections_is_read_as_one_cpu(tmp_path):
    old = "\n".join([
        "# qkv benchmark results", "", "## Machine (of the latest run)", "", "| | |", "|---|---|",
        "| cpu | AMD EPYC |", "| cores | 2 |", "",
        "<!-- suite: engine-dot -->", "## Engine: dot", "", "### Dot-family scores", "rows", "<!-- end: engine-dot -->", "",
        "<!-- suite: approx -->", "### Approximate", "", "rows", "<!-- end: approx -->", "",
    ])  # fmt: skip
    out = tmp_path / "RESULTS.md"
    out.write_text(old)
    bench.write(out, {"approx": _approx("3.4×", "**not met**")}, INTEL)
    text = out.read_text()
    amd = results.parse(text)["AMD EPYC"]
    assert "| cores | 2 |" in amd["machine"] and list(amd["suites"]) == ["engine-dot", "approx"]
    # headings nest under the CPU's "##": each suite's top heading is "###"
    assert "### Engine: dot\n" in amd["suites"]["engine-dot"] and "#### Dot-family scores" in amd["suites"]["engine-dot"]
    assert amd["suites"]["approx"].startswith("### Approximate")
    # rewriting an untouched section changes nothing
    assert results.render(results.parse(text)) == text


def test_summary_lists_each_target_on_every_cpu_with_the_range(tmp_path):
    out = tmp_path / "RESULTS.md"
    bench.write(out, {"approx": _approx("28.8×")}, AMD)
    bench.write(out, {"approx": _approx("3.4×", "**not met**")}, INTEL)
    lines = results.summary(out.read_text()).splitlines()
    assert lines[0] == "| target | AMD EPYC, AVX2 | Intel(R) Xeon(R) Platinum 8480+, AVX512 | range | met on |"
    assert lines[2] == "| Linformer: × faster than exact at i = 16K | 28.8× | 3.4× (not met) | 3.4–28.8× | 1 of 2 |"


def test_qkv_bench_summary_prints_it(tmp_path, capsys):
    out = tmp_path / "RESULTS.md"
    bench.write(out, {"approx": _approx("28.8×")}, AMD)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--summary", "--out", str(out)])) == 0
    assert "| Linformer: × faster than exact at i = 16K | 28.8× | 28.8× | 1 of 1 |" in capsys.readouterr().out
    assert bench.run(parser.parse_args(["--summary", "--out", str(tmp_path / "none.md")])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qkv bench: error: --summary: no results file at ")
