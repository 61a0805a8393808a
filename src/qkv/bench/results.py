"""``benchmarks/RESULTS.md``: one section per CPU model, each holding the suites run on it.

The same code is fast or slow for different reasons on different CPUs (which BLAS is fast,
which kernels have an AVX-512 or AMX path), so a figure is only meaningful with the CPU it
was measured on. The file keeps one section per CPU; a run replaces, in its own CPU's
section, the suites it ran and keeps everything else, including every other CPU's section::

    # qkv benchmark results
    <!-- cpu: AMD EPYC -->
    ## AMD EPYC
    ### Machine (latest run on this CPU)        cpu model, capability, BLAS, oneDNN, ...
    <!-- suite: engine --> ... <!-- end: engine -->
    <!-- end cpu: AMD EPYC -->
    <!-- cpu: Intel(R) Xeon(R) Platinum 8480+ -->
    ...

A CPU is named by its model string, family and model numbers and torch's CPU capability
(``AMD EPYC (family 25, model 17), AVX512``); a run under environment variables that change the
kernels (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``,
``LD_PRELOAD``, ``QKV_ROUTE``: :data:`qkv.bench.measure.KERNEL_SETTINGS`, as used to emulate
another CPU) gets its own section named with them. A file in the layout of
earlier versions (one machine table, suites at the top level) is read as one CPU's section.

:func:`summary` lists every target with its figure on each CPU and the range across them,
the numbers a README table that covers all CPUs quotes (``qkv bench --summary``).
"""

from __future__ import annotations

import re
from pathlib import Path

#: Keys of :func:`qkv.bench.measure.machine` that tell CPUs apart (model, capability, emulation caps).
CPU_KEY = "cpu"
EMULATION_KEY = "kernels set by"
CAPABILITY_KEY = "cpu capability"
GENERATION_KEY = "cpu family, model"

_CPU = re.compile(r"<!-- cpu: (.+?) -->\n(.*?)<!-- end cpu: \1 -->\n?", re.S)
_SUITE = re.compile(r"<!-- suite: (\S+) -->\n(.*?)<!-- end: \1 -->", re.S)
_MACHINE = re.compile(r"^#+ Machine[^\n]*\n\n((?:\|[^\n]*\n)+)", re.M)
_TARGETS = re.compile(r"^\| target \| measured \| status \|\n\|---\|---\|---\|\n((?:\|[^\n]*\n?)+)", re.M)

HEADER = [
    "# qkv benchmark results",
    "",
    "Written by `qkv bench` (`python -m qkv.bench`). Times are ratios of medians measured side by side",
    "in one process, with the contenders interleaved round by round; memory is the peak resident set of",
    "a fresh subprocess per case, above the same process's peak after building the inputs.",
    "",
    "One section per CPU model: the same code meets or misses a target for different reasons on",
    "different CPUs (which BLAS is fast there, which kernels have an AVX-512 or AMX path). A run",
    "replaces the suites it ran in its own CPU's section and leaves every other section as it was.",
    "`qkv bench --summary` lists each target's figure on every CPU.",
    "",
]


def cpu_name(info: dict[str, str]) -> str:
    """The section a run belongs to: the CPU model and the kernels torch picked, plus any caps.

    The family and model numbers and the capability are part of the name because a virtual
    machine's model string can hide the generation: "AMD EPYC" is reported by Zen 3 hosts
    (AVX2), Zen 4 (family 25, model 17: AVX-512 on 256-bit units) and Zen 5 (family 26:
    512-bit units), whose figures differ as much as an Intel's. (Sections written before
    runs recorded the family are named without it.)
    """
    name = info.get(CPU_KEY, "unknown CPU").strip() or "unknown CPU"
    if generation := info.get(GENERATION_KEY):
        family, _, model = generation.partition(", ")
        name = f"{name} (family {family}, model {model})"
    if capability := info.get(CAPABILITY_KEY):
        name = f"{name}, {capability}"
    capped = info.get(EMULATION_KEY)
    return f"{name} ({capped})" if capped else name


def parse(text: str) -> dict[str, dict]:
    """``{cpu: {"machine": [table lines], "suites": {name: text}}}`` in file order.

    A file without CPU sections (the layout before them) is one section, named by the
    ``cpu`` row of its machine table.
    """
    cpus: dict[str, dict] = {}
    for name, body in _CPU.findall(text):
        cpus[name] = _section(body)
    if not cpus and _SUITE.search(text):
        old = _section(text)
        info = _table(old["machine"])
        cpus[cpu_name(info)] = old
    return cpus


def _section(body: str) -> dict:
    machine = _MACHINE.search(body)
    return {
        "machine": machine.group(1).strip().splitlines() if machine else [],
        "suites": {name: _nested(text) for name, text in _SUITE.findall(body)},
    }


def _table(lines: list[str]) -> dict[str, str]:
    """``| key | value |`` rows (after the two header lines) as a dict."""
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows


def _nested(text: str) -> str:
    """Headings moved so the section's top heading is ``###`` (inside a ``##`` CPU section).

    Suites write their own top heading at level 2 or 3; idempotent, so kept sections pass
    through unchanged. Lines inside fenced code are left alone.
    """
    lines, fenced, levels = text.strip("\n").split("\n"), False, []
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"(#+) ", line)):
            levels.append(len(m.group(1)))
    if not levels:
        return text.strip("\n") + "\n"
    shift = 3 - min(levels)
    out, fenced = [], False
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#+ ", line):
            line = "#" * max(1, line.index(" ") + shift) + line[line.index(" "):]
        out.append(line)
    return "\n".join(out) + "\n"


def merge(old: str, sections: dict[str, str], info: dict[str, str], suites: dict[str, str]) -> dict[str, dict]:
    """The CPU sections of ``old`` with this run's ``sections`` put into its CPU's section.

    ``suites`` is the registry (name -> module path, ``"module:part"`` for a part of a
    suite): a whole suite's old text is dropped once each of its parts has been rerun.
    """
    cpus = parse(old)
    name = cpu_name(info)
    mine = cpus.setdefault(name, {"machine": [], "suites": {}})
    mine["machine"] = ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info.items())]
    kept = mine["suites"]
    kept.update({suite: _nested(text) for suite, text in sections.items()})
    for whole in [n for n in kept if ":" not in suites.get(n, ":")]:
        parts = [n for n, path in suites.items() if path.startswith(suites[whole] + ":")]
        if parts and whole not in sections and all(p in kept for p in parts):
            del kept[whole]  # superseded by a run of each of its parts
    order = [n for n in suites if n in kept] + [n for n in kept if n not in suites]
    mine["suites"] = {n: kept[n] for n in order}
    return cpus


def render(cpus: dict[str, dict], *, quick: bool = False) -> str:
    lines = list(HEADER)
    if quick:
        lines += ["**Quick run: tiny sizes, a smoke test of the machinery. These are not the figures to quote.**", ""]
    for name, section in cpus.items():
        lines += [f"<!-- cpu: {name} -->", f"## {name}", ""]
        if section["machine"]:
            lines += ["### Machine (latest run on this CPU)", "", *section["machine"], ""]
        for suite, text in section["suites"].items():
            lines += [f"<!-- suite: {suite} -->", text.rstrip(), f"<!-- end: {suite} -->", ""]
        lines += [f"<!-- end cpu: {name} -->", ""]
    return "\n".join(lines)


def targets(text: str) -> dict[str, dict[str, tuple[str, str]]]:
    """``{target: {cpu: (measured, status)}}`` from every targets table of every CPU section."""
    found: dict[str, dict[str, tuple[str, str]]] = {}
    for cpu, section in parse(text).items():
        for body in section["suites"].values():
            for block in _TARGETS.findall(body):
                for row in block.strip().splitlines():
                    cells = [c.strip() for c in row.strip().strip("|").split("|")]
                    if len(cells) == 3:
                        found.setdefault(cells[0], {})[cpu] = (cells[1], cells[2].strip("*"))
    return found


def _number(measured: str) -> float | None:
    match = re.match(r"-?\d+(\.\d+)?(e[-+]?\d+)?", measured)
    return float(match.group(0)) if match else None


def summary(text: str) -> str:
    """Markdown: one row per target, its figure on each CPU, and the range across CPUs."""
    cpus = list(parse(text))
    rows = targets(text)
    if not rows:
        return "no targets found (run `qkv bench` first)\n"
    lines = ["| target | " + " | ".join(cpus) + " | range | met on |", "|---|" + "---|" * (len(cpus) + 2)]
    for target, per_cpu in rows.items():
        cells, numbers, unit = [], [], ""
        for cpu in cpus:
            measured, status = per_cpu.get(cpu, ("—", ""))
            cells.append(measured if status in ("met", "") else f"{measured} (not met)")
            if (x := _number(measured)) is not None:
                numbers.append(x)
                unit = measured[len(re.match(r"[-\d.e+]*", measured).group(0)):]
        span = "—" if not numbers else (
            f"{min(numbers):.3g}{unit}" if min(numbers) == max(numbers) else f"{min(numbers):.3g}–{max(numbers):.3g}{unit}"
        )
        met = sum(status == "met" for _, status in per_cpu.values())
        lines.append(f"| {target} | " + " | ".join(cells) + f" | {span} | {met} of {len(per_cpu)} |")
    return "\n".join(lines) + "\n"


def write(path: Path, sections: dict[str, str], info: dict[str, str], suites: dict[str, str], *, quick: bool = False) -> None:
    old = path.read_text() if path.exists() else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(merge(old, sections, info, suites), quick=quick))
