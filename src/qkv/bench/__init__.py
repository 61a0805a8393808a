"""Benchmarks: ``qkv bench`` / ``python -m qkv.bench``, writing ``benchmarks/RESULTS.md``.

Every figure is a ratio measured side by side in one process (medians over interleaved
repeats, see :mod:`qkv.bench.measure`) against what a user would run instead, plus peak
memory measured in a fresh subprocess per case. ``--quick`` runs tiny sizes in under a
minute (a smoke test of the machinery, not figures to quote); without ``--out`` it writes
into a new folder in the system's temporary folder, never next to the real results (a
``benchmarks/RESULTS-quick.md`` in the working tree was an untracked file in the repository).

Adding a suite
--------------
A suite is one module in this package plus one line in :data:`SUITES`::

    SUITES["mysuite"] = "qkv.bench.mysuite"

The module defines

* ``NAME`` and ``DESCRIPTION`` (strings);
* ``section(quick: bool, say: Callable[[str], None]) -> str``: run the suite and return its
  markdown section (tables, and a targets table with "met" / "not met" and the figure);
  ``say`` prints progress lines;
* optionally ``build(spec: dict) -> Callable[[], object]``: rebuild one case from a JSON-able
  ``spec`` (which carries ``"suite": NAME``) so that :func:`qkv.bench.measure.peak_memory`
  can run it in a fresh process.

A suite without ``section`` but with ``run(setup, progress=...)`` returning an object with
``.markdown()`` (and a ``QUICK`` setup for ``--quick``) is run through that instead.
``qkv bench --suite NAME`` (repeatable, or ``all``) runs only those suites. RESULTS.md has
one section per CPU model (:mod:`qkv.bench.results`); a run replaces the suites it ran in
its own CPU's section and keeps every other suite and every other CPU's section as they
were. ``qkv bench --summary`` runs nothing and prints each target's figure on every CPU and
the range across them.

Entry points for the command line: :func:`add_arguments` (fills an ``argparse`` parser)
and :func:`run` (takes the parsed namespace, returns the exit status).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from .._args import int_at_least
from . import results

#: Suites by name -> module. Register a new suite by adding it here.
SUITES: dict[str, str] = {
    "engine": "qkv.bench.engine",
    # the engine suite's parts alone ("module:part" runs ``module.section(..., parts=(part,))``)
    "engine-dot": "qkv.bench.engine:dot",
    "engine-bias": "qkv.bench.engine:bias",
    "engine-window": "qkv.bench.engine:window",
    "engine-additive": "qkv.bench.engine:additive",
    "engine-bf16": "qkv.bench.engine:bf16",
    "engine-layouts": "qkv.bench.engine:layouts",
    "modules": "qkv.bench.modules",
    "approx": "qkv.bench.approx",
    "learning": "qkv.bench.learning",
    "generation": "qkv.bench.generation",
    "transformers": "qkv.bench.transformers",
    "latent": "qkv.bench.latent",
    "distributed": "qkv.bench.distributed",
    "mechanisms": "qkv.bench.mechanisms",
    "packing": "qkv.bench.packing",
    "decoding": "qkv.bench.decoding",
    "serving": "qkv.bench.serving",
    "edits": "qkv.bench.edits",
    "sdpa": "qkv.bench.sdpa_dialect",
    "flash-attn": "qkv.bench.flash_dialect",
    "flashinfer": "qkv.bench.flashinfer_dialect",
    "varlen": "qkv.bench.varlen_dialect",
    "padded": "qkv.bench.padded",
}
#: Suites run when ``--suite`` is not given.
DEFAULT_SUITES: tuple[str, ...] = ("engine", "modules")
DEFAULT_OUT = Path("benchmarks/RESULTS.md")
#: Where a suite writes its figures: the folder of the results file being written (:func:`run` sets it), so a
#: figure sits beside the markdown that links it by name, and a run with ``--out`` elsewhere leaves
#: ``benchmarks/`` as it was.
figures = DEFAULT_OUT.parent


def suite_module(name: str) -> ModuleType | SimpleNamespace:
    """The suite's module, or for a ``"module:part"`` entry a view of it that runs that part only."""
    if name not in SUITES:
        raise ValueError(f"--suite: expected one of {sorted(SUITES)} or 'all', got {name!r}")
    path, _, part = SUITES[name].partition(":")
    module = importlib.import_module(path)
    if not part:
        return module
    return SimpleNamespace(
        NAME=module.NAME,
        DESCRIPTION=f"{module.DESCRIPTION} [{part} only]",
        section=lambda quick, say: module.section(quick, say, parts=(part,)),
        build=module.build,
    )


def _suite_name(text: str) -> str:
    """``--suite``'s type: a registered suite or ``all``; argparse turns the error into one line."""
    if text != "all" and text not in SUITES:
        raise argparse.ArgumentTypeError(f"expected one of {sorted(SUITES)} or 'all', got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``qkv bench`` (also used by ``python -m qkv.bench``)."""
    parser.add_argument(
        "--suite", action="append", default=None, metavar="NAME", type=_suite_name,
        help=f"suite to run (repeatable; 'all' for every one): {', '.join(SUITES)}; default {', '.join(DEFAULT_SUITES)}",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats: checks the machinery in < 1 min")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"markdown file to write (default {DEFAULT_OUT}; with --quick, a new "
                        "folder in the system's temporary folder)")  # fmt: skip
    parser.add_argument("--threads", type=int_at_least(1, "a positive integer"), default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--summary", action="store_true",
        help="run nothing: print each target's figure on every CPU in the results file, and the range",
    )  # fmt: skip
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: one memory case, JSON


def run(args: argparse.Namespace) -> int:
    """Run the chosen suites and write the results file; returns the exit status."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    if args.case is not None:
        from .measure import run_case

        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    if getattr(args, "summary", False):
        path = args.out if args.out is not None else DEFAULT_OUT
        if not path.is_file():
            print(f"qkv bench: error: --summary: no results file at {path} (run qkv bench first, or give --out)", file=sys.stderr)
            return 2
        problem = out_problem(path)
        if problem is not None:
            print(f"qkv bench: error: --summary: {problem}", file=sys.stderr)
            return 2
        print(results.summary(path.read_text(encoding="utf-8")), end="")
        return 0
    names = list(DEFAULT_SUITES) if not args.suite else args.suite
    if "all" in names:
        names = [n for n in SUITES if ":" not in SUITES[n]]  # parts are inside their suite
    try:
        for name in names:
            suite_module(name)  # fail fast on a wrong name (the parser checks it too; callers may not)
    except ValueError as error:
        print(f"qkv bench: error: {error}", file=sys.stderr)
        return 2
    out = args.out if args.out is not None else (quick_out() if args.quick else DEFAULT_OUT)
    problem = out_problem(out)  # before the suites run, not after minutes of them
    if problem is not None:
        print(f"qkv bench: error: --out: {problem}", file=sys.stderr)
        return 2
    from .measure import machine

    global figures
    figures, before = out.parent, figures
    sections, infos = {}, {}
    try:
        for name in names:
            module = suite_module(name)
            print(f"== suite {name}: {module.DESCRIPTION}", flush=True)
            infos[name] = machine()  # the conditions at the start of this suite
            sections[name] = _section(module, args.quick)
            write(out, sections, machine(), quick=args.quick, infos=infos)  # after each suite: a long run keeps what it has
    finally:
        figures = before  # a later section() of this process writes beside its own results, not this run's
    print(f"wrote {out}")
    return 0


def out_problem(path: Path) -> str | None:
    """Why the results file ``path`` cannot be read and written (it is merged into, suite by suite), or None."""
    if path.is_dir():
        return f"{path} is a folder; give a markdown file, e.g. {path / 'RESULTS.md'}"
    if not path.parent.is_dir():
        where = "" if path.is_absolute() else f" (a relative path is read from the current folder, {Path.cwd()})"
        return f"{path.parent} is not a folder that exists{where}; pass --out FILE.md in a folder that does"
    if path.exists():
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            return f"{path} is not a text file (a results file is markdown)"
        except OSError as error:
            return f"{path} cannot be read ({error.strerror})"
        if not os.access(path, os.W_OK):
            return f"{path} cannot be written"
    else:  # made and removed: a folder may refuse new files whatever its permission bits say (/proc)
        try:
            path.open("x").close()
            path.unlink()
        except OSError as error:
            return f"{path} cannot be created ({error.strerror})"
    return None


def quick_out() -> Path:
    """Where a ``--quick`` run without ``--out`` writes: a fresh folder under the system's temp folder.

    Not the working tree: quick figures are not to be quoted, and a file there is an untracked
    file in the repository. A fresh folder per run, so no other run's (or user's) file is merged.
    """
    return Path(tempfile.mkdtemp(prefix="qkv-bench-quick-")) / "RESULTS.md"


def _say(line: str) -> None:
    print(line, flush=True)


def _section(module: ModuleType, quick: bool) -> str:
    if hasattr(module, "section"):
        return module.section(quick, _say)
    setup = getattr(module, "QUICK", None) if quick else None
    return module.run(setup, progress=_say).markdown()


def write(
    path: Path, sections: dict[str, str], info: dict[str, str], *, quick: bool = False, infos: dict | None = None
) -> None:
    """Put this run's suite ``sections`` into its CPU's section of RESULTS.md (:mod:`qkv.bench.results`).

    ``info`` is :func:`qkv.bench.measure.machine` (its CPU names the section); ``infos`` the
    conditions at the start of each suite, stamped under its heading.
    """

    def stamp(at: dict[str, str]) -> str:
        load = at.get("load average at start (1, 5, 15 min)", "?")
        return f"_Started {at.get('date', '?')}, torch threads {at.get('torch threads', '?')}, load average {load}._"

    stamped = {name: _stamped(text, stamp((infos or {}).get(name, info))) for name, text in sections.items()}
    results.write(path, stamped, info, SUITES, quick=quick)


def _stamped(text: str, stamp: str) -> str:
    head, _, rest = text.strip().partition("\n")
    return f"{head}\n\n{stamp}\n{rest}\n" if head.startswith("#") else f"{stamp}\n\n{text.strip()}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qkv.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


__all__ = ["DEFAULT_SUITES", "SUITES", "add_arguments", "main", "quick_out", "run", "suite_module", "write"]
if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
