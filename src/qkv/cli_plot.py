"""``qkv plot``'s work: reading an array from a file (torch, numpy, safetensors) and drawing it.

Shape legend: ``h`` heads, ``i`` queries (rows), ``j`` keys (columns).

The command line (``qkv.cli``) checks the arguments and prints what goes wrong; this module
reads the file, says in words why one cannot be read (a damaged file, another format, an
empty or complex array), checks the output path before any work, and draws the selected
``(i, j)`` or ``(h, i, j)`` array with ``qkv.viz``.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path


#: How the files numpy writes begin: without it, np.load takes a file for a pickle and says
#: "contains pickled (object) data", which misleads about a file that is merely damaged.
_MAGIC = {".npy": (b"\x93NUMPY", "numpy.save's header"), ".npz": (b"PK", "a zip archive's header")}


def _reason(error: BaseException) -> str:
    """Why a loader failed, in a few words (its messages run to paragraphs of advice)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))  # torch colours part of its message
    # torch.load(weights_only=True) buries the cause after two paragraphs about trusting the file.
    cause = text.partition("WeightsUnpickler error:")[2].strip()
    if cause:
        return "torch.load: " + " ".join(cause.split("\n\n")[0].split()).partition(". Please use")[0].rstrip(".")
    if isinstance(error, EOFError):
        return "the file ends too early"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if len(first) > 120:  # a paragraph: keep its first sentences up to the one ending past 40 characters
        end = first.find(". ", 40)
        first = first[:end] if end > 0 else first
    return first if len(first) <= 200 else first[:197] + "..."


#: What ``qkv plot`` expects in a .pt/.pth file, said when it holds something else.
_TORCH_FILE = ("expected a file saved by torch.save holding a 2-D tensor (or a larger one, with --index) "
               "or a dict of them")


def _torch_format(path: Path) -> str | None:
    """Why ``path`` cannot be a torch.save file, judged by its first bytes; None if it may be one.

    torch.load's own message for such a file is a pickle opcode ("Unsupported operand 144",
    or just "101"), which says nothing to whoever gave the wrong file.
    """
    with path.open("rb") as file:
        head = file.read(2)
    if not head:
        return "the file is empty"
    # torch.save writes a zip archive ("PK"); before torch 1.6, or with
    # _use_new_zipfile_serialization=False, a pickle, whose first byte is the PROTO opcode 0x80.
    if head == b"PK" or head[0] == 0x80:
        return None
    return "it is neither the zip archive torch.save writes nor its older pickle format"


def _read(path: Path, suffix: str):
    """What ``path`` holds (an array, a tensor or a dict of them), or ValueError saying why not."""
    import numpy as np
    import torch

    if suffix == ".safetensors":
        from safetensors.torch import load_file  # outside the try: a missing package is not a bad file
    expected = f"{_TORCH_FILE}; " if suffix in (".pt", ".pth") else ""
    try:
        if suffix in _MAGIC:
            magic, what = _MAGIC[suffix]
            with path.open("rb") as file:
                if file.read(len(magic)) != magic:
                    raise ValueError(f"it does not start with {what}")
        if suffix == ".npy":
            return np.load(path, allow_pickle=False)
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return dict(archive)
        if suffix == ".safetensors":
            return load_file(str(path))
        problem = _torch_format(path)
        if problem:
            raise ValueError(problem)
        # weights_only: a weights file must not be able to run code when loaded.
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # whatever the loader raises (its own error types), the file cannot be plotted
        raise ValueError(f"file: could not read {path.name} ({expected}{_reason(error)})") from error


def _load(path: Path, key: str | None):
    """The array stored in ``path`` (a dict's ``key`` when it holds several) as a float numpy array."""
    import numpy as np
    import torch

    suffix = path.suffix.lower()
    if suffix not in (".npy", ".npz", ".safetensors", ".pt", ".pth"):
        raise ValueError(f"file: expected a .pt, .pth, .npy, .npz or .safetensors file, got {path.name!r}")
    data = _read(path, suffix)
    where = f"in {path.name}"  # how the messages below name the tensor
    if isinstance(data, dict):
        if not data:
            raise ValueError(f"file: {path.name} holds no tensors (an empty dict)")
        if key is None:
            if len(data) != 1:
                raise ValueError(f"--key: {path.name} holds {len(data)} tensors, name one of {sorted(data)}")
            key = next(iter(data))
        if key not in data:
            raise ValueError(f"--key: expected one of {sorted(data)}, got {key!r}")
        data = data[key]
        where = f"{key!r} in {path.name}"
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        # Refused before .float(), which would warn (a UserWarning naming qkv's file) and drop the
        # imaginary part without a word.
        if data.is_complex():
            raise ValueError(_complex(where, str(data.dtype).removeprefix("torch.")))
        data = data.float().numpy()
    if not isinstance(data, np.ndarray):
        raise ValueError(f"file: expected a tensor or array {where}, got {type(data).__name__}")
    if data.dtype.kind == "c":
        raise ValueError(_complex(where, str(data.dtype)))
    if data.dtype.kind not in "biuf":
        raise ValueError(f"file: the tensor {where} holds {data.dtype} values, expected numbers")
    if data.size == 0:
        raise ValueError(f"file: the tensor {where} is empty (shape {tuple(data.shape)}): nothing to plot")
    return data.astype(float, copy=False) if data.dtype.kind in "biu" else data


def _complex(where: str, dtype: str) -> str:
    return (f"file: the tensor {where} is complex ({dtype}); qkv plot draws real numbers: save its .abs() "
            "(the magnitude) or .real instead")  # fmt: skip


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (for a relative path, at worst the current folder)."""
    while not (path.exists() or path.is_symlink()) and path.parent != path:
        path = path.parent
    return path


def out_problem(out: Path, file: Path) -> str | None:
    """Why ``qkv plot`` cannot write its image to ``out`` (missing folders are made), or None.

    Checked before the file is read and drawn; ``viz.save``'s own errors named its argument
    ``path:`` and an OSError's number ("[Errno 17] File exists: '/dev/null'").
    """
    if out.is_dir():
        return f"{out} is a folder; give an image file such as {out / file.with_suffix('.png').name}"
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        return f"expected a .png, .svg or .pdf suffix, got {out.suffix!r}"
    if out.exists():
        return None if os.access(out, os.W_OK) else f"cannot write {out} (permission denied)"
    where = _nearest_existing(out.parent)
    if not where.is_dir():
        return f"cannot create {out}: {where} is a file, not a folder"
    # Made and removed: a folder may refuse new entries whatever its permission bits say (/proc).
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".qkv-plot-check-", dir=where))
    except OSError as error:
        return f"cannot create {out} ({error.strerror})"
    return None


def _as_typed(text: str) -> str:
    """``text`` drawn as typed: matplotlib reads ``$...$`` as mathematics (``$\\foo$`` was an error)."""
    return text.replace("$", r"\$")


def draw(args, out: Path) -> list[str]:
    """Read ``args.file``'s array, select it with ``--index``, draw it and save it to ``out``; the notes to print.

    Raises ``ValueError`` / ``RuntimeError`` (a line for the user), ``OSError`` (writing ``out``)
    or ``ImportError`` (an optional package a file format needs).
    """
    from . import viz

    notes = []
    array = _load(args.file, args.key)
    for position, index in enumerate(args.index):
        if array.ndim == 0 or index >= array.shape[0]:
            size = "no leading dim left" if array.ndim == 0 else f"a leading dim of size {array.shape[0]}"
            raise ValueError(f"--index: index {index} (--index number {position + 1}) is past the array's end: it "
                             f"has {size} at that point (shape {tuple(array.shape)})")  # fmt: skip
        array = array[index]
    if array.ndim < 2:  # no --index can add a dim: say what is missing, not what to select
        given = f" after {len(args.index)} --index" if args.index else ""
        raise ValueError(f"file: the array{given} has shape {tuple(array.shape)}, {array.ndim}-d; qkv plot draws an "
                         "(i, j) matrix of weights or (h, i, j) heads" + ("; give fewer --index" if args.index else ""))  # fmt: skip
    if array.ndim > 3:
        raise ValueError(
            f"--index: the selected array has shape {array.shape}; give one --index per leading "
            "dim until it is (i, j) or (h, i, j)"
        )
    if array.ndim == 3 and array.shape[0] > viz.MAX_PANELS:
        raise ValueError(f"--index: the selected array has {array.shape[0]} heads (shape {array.shape}), more "
                         f"than the {viz.MAX_PANELS} panels one figure holds; pick one with another --index")  # fmt: skip
    labels = []
    # Checked here, not by viz (whose messages name its own arguments, x_labels and y_labels).
    axes = (("--x-labels", args.x_labels, array.shape[-1], ("key, j", "keys")),
            ("--y-labels", args.y_labels, array.shape[-2], ("query, i", "queries")))
    for flag, text, count, what in axes:
        if text is None:
            labels.append(None)
            continue
        split = list(text) if args.chars else text.split()
        if len(split) != count:
            raise ValueError(f"{flag}: expected {count} labels (one per {what[0]}), got {len(split)}")
        labels.append([_as_typed(label) for label in split])
        if count > viz.MAX_LABELS:
            notes.append(f"note: {flag} not drawn: {count} {what[1]} are more than {viz.MAX_LABELS} can be read; "
                         "the axis counts positions")  # fmt: skip
    title = None if args.title is None else _as_typed(args.title)
    if array.ndim == 2:
        scale = (0.0, 1.0) if array.min() >= 0 and array.max() <= 1 else (None, None)
        figure = viz.heatmap(array, labels[0], labels[1], title=title, vmin=scale[0], vmax=scale[1])
    else:
        figure = viz.head_grid(array, labels[0], labels[1], title=title)
    viz.save(figure, out)
    return notes
