"""The ``qkv`` command line: ``qkv demo``, ``qkv bench``, ``qkv plot``, ``qkv inspect``, ``qkv --version``.

Shape legend (``qkv plot``): ``h`` heads, ``i`` queries (rows), ``j`` keys (columns).

Every bad argument ends the program with exit code 2 and one line on stderr,
``qkv <command>: error: <what is wrong>`` (argparse's default prints the usage first; one
line is easier to read and to test). So does a missing optional package (``needs
matplotlib, which is not installed: pip install ".[demo]" ...``), checked before the command
starts its work, and a file ``qkv plot`` cannot read. ``qkv`` with no command at all is
what a newcomer types first: it prints the help (the commands and examples) to stderr and
exits with 2. Heavy imports (torch models, matplotlib, the benchmarks) happen inside the
command that needs them, so ``qkv --help`` is quick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from . import __version__, cli_plot
from ._args import int_at_least
from ._extras import install

EXAMPLES = """examples:
  qkv demo                      the full tour (1-3 minutes), figures in ./qkv-demo/
  qkv demo --quick --out /tmp/d a one-minute check of the same steps
  qkv plot weights.pt --out w.png
  qkv inspect "The cat sat on the mat."   a real model's attention, page in ./qkv-inspect/
  qkv bench --help
"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``prog: error: message`` and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


#: The optional packages each command imports, and what installs each (pyproject.toml's
#: extras; quoted, since an unquoted [ ] is a glob in zsh). A command checks them before it
#: starts, so a missing one is one line, not a traceback after minutes of training.
NEEDS: dict[str, dict[str, str]] = {
    "demo": {"matplotlib": install("demo"), "babel": install("demo"), "tqdm": install("demo")},
    "plot": {"matplotlib": install("viz"), "safetensors": "pip install safetensors"},
    "inspect": {"transformers": install("transformers"), "tokenizers": install("transformers"),
                "safetensors": install("transformers"), "gguf": install("transformers"),
                "accelerate": install("transformers"), "matplotlib": install("viz")},
}  # fmt: skip


def _optional_missing(command: str, error: ImportError) -> int:
    """Exit status 2 with one line when ``error`` is an optional package's absence; re-raise anything else."""
    missing = _missing(command, error)
    if missing is None:
        raise error
    print(f"qkv {command}: error: {missing}", file=sys.stderr)
    return 2


def _missing(command: str, error: ImportError) -> str | None:
    """One line for an ImportError of an optional package, or None when it is not one (a bug in qkv)."""
    cause: BaseException | None = error
    while cause is not None:  # qkv.viz and qkv.tasks wrap the original error with their own message
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            package = cause.name.partition(".")[0]
            if package == "qkv":
                return None
            how = NEEDS.get(command, {}).get(package)
            # A module's name is not always its package's name on PyPI: say how only when known.
            return f"needs {package}, which is not installed" + (f": {how}" if how else "")
        cause = cause.__cause__
    return None


def _check_needs(command: str, packages: Sequence[str]) -> str | None:
    """The one-line error for the first of ``packages`` that cannot be imported, or None if all can."""
    for package in packages:
        try:
            importlib.import_module(package)
        except ImportError as error:
            if isinstance(error, ModuleNotFoundError) and (error.name or "").partition(".")[0] == package:
                return _missing(command, error)
            # Installed, but broken: a module of its own missing, a shared library, a version clash.
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"{package} is installed but cannot be imported ({first})"
    return None


_positive_int = int_at_least(1, "a positive integer")
_non_negative_int = int_at_least(0, "a non-negative integer")


def _seed(text: str) -> int:
    """``qkv demo --seed``: a non-negative integer that every step's derived seed can take."""
    value = _non_negative_int(text)
    from .demo import MAX_SEED  # only when --seed is given: qkv.demo imports torch

    if value > MAX_SEED:
        # torch.manual_seed said only "Overflow when unpacking long long", in a traceback.
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SEED} (each step seeds torch with seed x 1000 + "
                                         f"its number, which must fit in 64 bits), got {value}")  # fmt: skip
    return value


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo",
        help="attention at work: a worked example, order matters, date translation, positions, decoding past the "
             "training length, packed documents",
        description="Trains small attention models on data made on the spot (no downloads) and "
        "writes figures, results.json and index.html to --out. A full run takes one to three minutes on 2 cores.",
    )
    demo.add_argument("--out", type=Path, default=Path("qkv-demo"), help="output folder (default: ./qkv-demo/)")
    demo.add_argument("--seed", type=_seed, default=0, help="seed for data and weights, 0 or more (default: 0)")
    demo.add_argument("--quick", action="store_true", help="small data and short training: runs in under a minute")
    demo.add_argument("--steps", type=_positive_int, default=None, help="training steps per model (default: each model's own)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_plot(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser(
        "plot",
        help="heatmap of saved attention weights (.pt, .npy or .safetensors)",
        description="Draws a 2-D (i, j) array as a heatmap and a 3-D (h, i, j) array as one panel "
        "per head. Pick from larger arrays with --index, one integer per leading dim to drop. The "
        "image is at most 20 inches (3000 pixels) a side: a large array gets smaller cells, and an "
        "axis of more than 80 rows or columns gets position ticks instead of --x-labels/--y-labels. "
        "Every value is drawn.",
    )
    plot.add_argument("file", type=Path, help="a tensor saved with torch.save, numpy.save or safetensors "
                      "(a 2-D or larger tensor, or a dict of them)")  # fmt: skip
    plot.add_argument("--out", type=Path, default=None,
                      help="image to write (.png, .svg, .pdf; default: FILE with .png); missing folders are "
                      "made")  # fmt: skip
    plot.add_argument("--key", default=None, help="which tensor, when the file holds several (a dict)")
    plot.add_argument("--index", type=_non_negative_int, action="append", default=[],
                      help="select along the first remaining dim; repeat for more dims")  # fmt: skip
    plot.add_argument("--x-labels", default=None, help="key labels, separated by spaces (or one per character with "
                      "--chars); drawn up to 80 keys")  # fmt: skip
    plot.add_argument("--y-labels", default=None, help="query labels, separated by spaces (or one per character with "
                      "--chars); drawn up to 80 queries")  # fmt: skip
    plot.add_argument("--chars", action="store_true", help="split the labels into characters")
    plot.add_argument("--title", default=None, help="title of the figure")


def _add_bench(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    help_text = "benchmarks of the attention backends (writes benchmarks/RESULTS.md)"
    if "bench" not in argv:
        # Only `qkv bench ...` pays for importing the benchmark framework.
        sub.add_parser("bench", help=help_text, add_help=False)
        return
    description = ("Benchmarks of the attention backends. A run writes benchmarks/RESULTS.md relative to "
                   "the current folder, which is qkv's clone when run from there; elsewhere, pass --out "
                   "FILE.md (merged into if it exists), or use --quick, which writes to a temporary "
                   "folder.")  # fmt: skip
    bench = sub.add_parser("bench", help=help_text, description=description)
    try:
        from . import bench as bench_module
    except ImportError as error:
        bench.set_defaults(bench_missing=f"the benchmark framework could not be imported ({error})")
        return
    if not hasattr(bench_module, "add_arguments") or not hasattr(bench_module, "run"):
        bench.set_defaults(bench_missing="qkv.bench has no add_arguments/run in this build")
        return
    bench_module.add_arguments(bench)


def _indices(text: str):
    """``--rows``/``--heads``/``--attribution-layers``: checked for form here, for range once the text is read.

    Kept as runs (``qkv.inspect.selection.Indices``): ``0-1000000000`` was expanded into a billion
    ints (and hung) before it could be found past the end of a three-token text.
    """
    from .inspect.selection import SelectionError, parse_ranges

    try:
        return parse_ranges("value", text)
    except SelectionError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("value: ")) from None


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    inspect = sub.add_parser(
        "inspect",
        help="the attention of a pretrained model on your text: an offline page, heatmaps, a summary",
        description="Runs a pretrained transformers model on TEXT with qkv as its attention and writes "
        "an offline page (head view, model view), PNG heatmaps of one head and of its layer, and "
        "prints which head of each layer attends most to the previous token, the special tokens and "
        "itself. Long texts keep only some query rows (--rows, or chosen automatically), so the "
        "weights of every layer, head, row and key are never held at once.",
    )
    inspect.add_argument("text", metavar="TEXT", help="the sentence or text to run the model on")
    inspect.add_argument("--model", default=None,
                         help="a model folder (config.json, weights, tokenizer) or a .gguf file; "
                         "default: the packaged all-MiniLM-L6-v2")  # fmt: skip
    inspect.add_argument("--layer", type=_non_negative_int, default=None, help="layer shown first and drawn as PNGs (default: 0)")
    inspect.add_argument("--head", type=_non_negative_int, default=None, help="head shown first and drawn (default: the first chosen)")
    inspect.add_argument("--rows", type=_indices, default=None,
                         help="query rows (token positions) to keep, e.g. 0,5,10-20 (default: all, or "
                         "a few spread over a long text)")  # fmt: skip
    inspect.add_argument("--heads", type=_indices, default=None, help="heads to keep, e.g. 0-3,7 (default: all)")
    inspect.add_argument("--out", type=Path, default=Path("qkv-inspect"), help="output folder (default: ./qkv-inspect/)")
    inspect.add_argument("--attribution", action="store_true",
                         help="add head importance (each head zeroed in turn with qkv.edits.AblateHeads: one more "
                         "forward per layer x head; the change in the next-token loss of a decoder, in the "
                         "mean-pooled embedding of an encoder) and attention rollout (texts up to 512 tokens) "
                         "to the page; off by default, as it costs layers x heads forwards")  # fmt: skip
    inspect.add_argument("--attribution-layers", type=_indices, default=None, metavar="LAYERS",
                         help="the layers whose heads --attribution ablates, e.g. 0-3 (default: all); "
                         "given alone, it turns --attribution on")  # fmt: skip


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The ``qkv`` parser; ``argv`` tells whether the (slow to import) bench options are needed."""
    parser = _Parser(
        prog="qkv",
        description="qkv: attention mechanisms for PyTorch.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    # Not required: without a command, main() prints the help (argparse would print only
    # "the following arguments are required: command", which names no command).
    sub = parser.add_subparsers(dest="command", metavar="command", parser_class=_Parser)
    _add_demo(sub)
    _add_bench(sub, argv)
    _add_plot(sub)
    _add_inspect(sub)
    return parser


def _demo(args: argparse.Namespace) -> int:
    # tqdm draws the progress bars, which appear only on a terminal and not with --quiet
    # (qkv.demo.context.Context.progress): without them the demo runs without tqdm.
    needed = [name for name in NEEDS["demo"] if name != "tqdm" or (not args.quiet and sys.stderr.isatty())]
    missing = _check_needs("demo", needed)
    if missing:
        print(f"qkv demo: error: {missing}", file=sys.stderr)
        return 2
    from .demo import DemoError, run

    try:
        run(args.out, seed=args.seed, quick=args.quick, steps=args.steps, quiet=args.quiet)
    except DemoError as error:
        print(f"qkv demo: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:  # a package the check above did not know of
        return _optional_missing("demo", error)
    except KeyboardInterrupt:
        print("qkv demo: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


def _plot(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        what = "is a folder, expected a file" if args.file.is_dir() else "does not exist"
        print(f"qkv plot: error: file: {args.file} {what}", file=sys.stderr)
        return 2
    missing = _check_needs("plot", ["matplotlib"])  # safetensors only for a .safetensors file, when it is read
    if missing:
        print(f"qkv plot: error: {missing}", file=sys.stderr)
        return 2
    out = args.out or args.file.with_suffix(".png")
    problem = cli_plot.out_problem(out, args.file)
    if problem:
        print(f"qkv plot: error: --out: {problem}", file=sys.stderr)
        return 2
    try:
        notes = cli_plot.draw(args, out)
    except OSError as error:  # the folder was checked above; the disk may still be full
        print(f"qkv plot: error: --out: cannot write {out} ({error.strerror or error})", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as error:
        lines = [line for line in str(error).splitlines() if line.strip()]
        print(f"qkv plot: error: {lines[0].strip() if lines else type(error).__name__}", file=sys.stderr)
        return 2
    except ImportError as error:
        return _optional_missing("plot", error)
    for note in notes:
        print(note)
    print(f"wrote {out}")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    # Before the model is loaded: matplotlib, for one, is imported only after the model ran.
    missing = _check_needs("inspect", list(NEEDS["inspect"]))
    if missing:
        print(f"qkv inspect: error: {missing}", file=sys.stderr)
        return 2
    from .inspect import InspectError, inspect

    try:
        inspect(args.text, model=args.model, layer=args.layer, head=args.head, rows=args.rows,
                heads=args.heads, out=args.out, attribution=args.attribution or args.attribution_layers is not None,
                attribution_layers=args.attribution_layers)  # fmt: skip
    except InspectError as error:
        print(f"qkv inspect: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        return _optional_missing("inspect", error)
    except OSError as error:  # --out was checked before the model ran; the disk may still be full
        where = error.filename or args.out
        print(f"qkv inspect: error: --out: cannot write {where} ({error.strerror or error})", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    missing = getattr(args, "bench_missing", None)
    if missing:
        print(f"qkv bench: error: {missing}", file=sys.stderr)
        return 2
    from . import bench

    default = args.out is None and not args.quick and not getattr(args, "summary", False)
    if default and getattr(args, "case", None) is None and not bench.DEFAULT_OUT.parent.is_dir():
        # Outside a clone, qkv.bench said only "benchmarks is not a folder that exists".
        folder, default_out = bench.DEFAULT_OUT.parent.as_posix(), bench.DEFAULT_OUT.as_posix()
        print(f"qkv bench: error: --out: the default {default_out} is relative to the current folder ({Path.cwd()}), "
              f"which has no {folder} folder: run qkv bench in qkv's clone, or pass --out FILE.md (or --quick, "
              "which writes to a temporary folder)", file=sys.stderr)  # fmt: skip
        return 2
    return int(bench.run(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qkv`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return {"demo": _demo, "plot": _plot, "bench": _bench, "inspect": _inspect}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
