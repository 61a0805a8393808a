"""``qkv demo``: attention at work on data the demo makes itself, in a few minutes on a CPU.

The steps, in order (one file each in this package):

1. ``worked_example`` — four words, ``W^Q, W^K, W^V`` from numpy seed 42, ``softmax(QKᵀ/√3) V``;
2. ``order`` — a task whose two classes share the same bag of words: a bag-of-words
   baseline stays at chance, an attention classifier with positions solves it;
3. ``dates`` — dates in many formats and languages to ISO ``YYYY-MM-DD`` with Bahdanau and
   Luong RNN encoder–decoders, and their alignment heatmaps;
4. ``positions`` — the sinusoidal table and RoPE's relative-position property;
5. ``streaming`` — a language model decoding ten times past its training length (four in a
   quick run) with a full cache and with StreamingLLM's bounded caches (with and without
   attention sinks);
6. ``packing`` — documents packed into one row: the tiles the engines skip, each document
   equal to itself alone, and the time against a dense mask;

then a summary table, ``results.json`` and an offline ``index.html`` (``report``).

The output is written into a temporary folder next to ``out`` and renamed to ``out``
only when every step has succeeded, so a failed or interrupted run leaves nothing
half-written behind. Every number printed is measured in the run, and so is every number
and verdict in a figure's caption (a quick run's captions describe the quick run); the
same ``seed`` prints the same numbers (timings aside).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from .context import Context, StepResult

__all__ = ["DemoError", "MAX_SEED", "STEPS", "run"]

MARKER = ".qkv-demo"  # a file in every output folder: marks it as safe to replace

#: The largest ``seed``: each step seeds torch with ``seed * 1000 + its number`` (``Context.seed_for``,
#: numbers below 1000), and torch.manual_seed takes at most 2**64 - 1; a larger seed ended the
#: run with torch's "Overflow when unpacking long long".
MAX_SEED = (2**64 - 1000) // 1000


class DemoError(ValueError):
    """A problem with the demo's arguments (such as an unwritable ``out``); one line, for the CLI."""


def _steps() -> list[tuple[str, Callable[[Context], StepResult]]]:
    # Imported here so `import qkv.demo` stays light and a step's import error is reported
    # as that step failing.
    from . import dates, order, packing, positions, streaming, worked_example

    return [
        (STEPS[0], worked_example.run),
        (STEPS[1], order.run),
        (STEPS[2], dates.run),
        (STEPS[3], positions.run),
        (STEPS[4], streaming.run),
        (STEPS[5], packing.run),
    ]


STEPS = ("worked example: four words, numpy seed 42", "order matters", "translation with alignment", "positions",
         "decoding past the training length", "packed documents")  # fmt: skip


def _check_out(out: Path) -> None:
    """Raise DemoError unless ``out`` can be (re)placed: absent, empty, or a previous demo output."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise DemoError(f"--out: {out} exists and is not a folder")
        if any(out.iterdir()) and not (out / MARKER).exists():
            raise DemoError(f"--out: {out} is a non-empty folder not written by qkv demo; choose another or empty it")
    parent = out.parent
    if not parent.is_dir():
        # Name what is there: "/dev/null does not exist" read as wrong, since it does, as a file.
        where = parent
        while not (where.exists() or where.is_symlink()) and where.parent != where:
            where = where.parent
        found = f": {where} is a file, not a folder" if where.exists() and not where.is_dir() else ""
        raise DemoError(f"--out: the parent folder {parent} does not exist{found}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DemoError(f"--out: cannot write in {parent} (permission denied)")


def _make_temporary(out: Path) -> Path:
    """A fresh hidden folder beside ``out`` (same file system, so the final rename is atomic)."""
    try:
        temporary = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as error:
        raise DemoError(f"--out: cannot create a folder in {out.parent} ({error.strerror})") from None
    # mkdtemp makes the folder private (0700); the published output should get the usual
    # permissions, as if made by mkdir under the user's umask.
    umask = os.umask(0)
    os.umask(umask)
    temporary.chmod(0o777 & ~umask)
    return temporary


def _publish(temporary: Path, out: Path) -> None:
    """Move the finished ``temporary`` folder to ``out``, replacing a previous demo output."""
    old = None
    if out.exists():
        # Move the old output aside first: if the rename below fails, it can be restored.
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / "previous")
    try:
        os.replace(temporary, out)
    except OSError:
        if old is not None:
            os.replace(old / "previous", out)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def run(
    out: str | Path = "qkv-demo",
    seed: int = 0,
    quick: bool = False,
    steps: int | None = None,
    quiet: bool = False,
    *,
    echo: Callable[[str], None] = print,
) -> list[StepResult]:
    """Run every demo step and write the figures, ``results.json`` and ``index.html`` to ``out``.

    Args:
        out: the output folder; created, or replaced if it holds a previous demo's output.
        seed: seeds data, initial weights and batch order; same seed, same numbers.
        quick: small data and short training (under a minute): checks that everything
            runs, not that the targets are met.
        steps: optimizer steps for every trained model (default: each model's own).
        quiet: no progress bars.
        echo: receives every printed line (default ``print``).

    Returns:
        One :class:`StepResult` per step, with the metrics and figures it produced.

    Raises:
        DemoError: ``out`` cannot be written, or ``seed`` (0 to :data:`MAX_SEED`) or ``steps``
            is out of range.
    """
    from .. import __version__
    from . import report

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DemoError(f"--seed: expected a non-negative integer, got {seed!r}")
    if seed > MAX_SEED:
        raise DemoError(f"--seed: expected at most {MAX_SEED} (each step seeds torch with seed x 1000 + its "
                        f"number, which must fit in 64 bits), got {seed}")  # fmt: skip
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise DemoError(f"--steps: expected a positive integer, got {steps!r}")
    out = Path(out).expanduser().absolute()
    _check_out(out)
    temporary = _make_temporary(out)
    lines: list[str] = []

    def say(text: str = "") -> None:
        lines.append(text)
        echo(text)

    ctx = Context(out=temporary, seed=seed, quick=quick, steps=steps, quiet=quiet, echo=say)
    started = time.perf_counter()
    # One intra-op thread: the models are tiny (batches of 64 × 64-wide layers), so extra
    # threads only add synchronisation, and on a busy machine they made a run several
    # times slower. It also fixes the order of float sums, so a seed gives the same
    # numbers on any number of cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plan = _steps()
        say(f"qkv {__version__} demo: seed {seed}, {'quick' if quick else 'full'} run, "
            f"output in {out}")  # fmt: skip
        results = []
        for number, (title, step) in enumerate(plan, start=1):
            say("")
            say(f"[{number}/{len(plan)}] {title}")
            # Reseed the global generator per step: model initialisation and dropout then
            # depend on the seed and the step, not on what ran before.
            torch.manual_seed(ctx.seed_for(number))
            t0 = time.perf_counter()
            result = step(ctx)
            result.seconds = time.perf_counter() - t0
            say(f"    ({result.seconds:.1f} s)")
            results.append(result)
        seconds = time.perf_counter() - started
        met, total = report.targets(results)
        say("")
        say("summary")
        for line in report.table(results).splitlines():
            say("    " + line)
        say(f"{met} of {total} targets met" + (" (a quick run is too short to meet them)" if quick and met < total else ""))
        say(f"total {seconds:.1f} s; open {out / 'index.html'}")
        settings = {"version": __version__, "seed": seed, "quick": quick, "steps": steps, "seconds": seconds}
        report.write_json(temporary / "results.json", results, settings)
        report.write_html(temporary / "index.html", results, settings, "\n".join(lines))
        (temporary / "demo.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (temporary / MARKER).write_text("written by qkv demo; the folder is replaced by the next run\n")
        _publish(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return results
