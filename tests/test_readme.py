"""The README's Python examples run as written, and every picture it shows is in the repository.

Each ```python block runs alone, in a fresh namespace (a reader copies one block, not the
ones above it), in a temporary working directory so files it saves land there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_has_python_examples():
    assert len(_blocks()) >= 3


def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for number, block in enumerate(_blocks(), start=1):
        torch.manual_seed(0)
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), {"__name__": "readme"})
        except Exception as error:  # pragma: no cover - the message says which block failed
            pytest.fail(f"README python block {number} failed: {type(error).__name__}: {error}")
    # The plotting example saves its figure where the README says.
    assert (tmp_path / "alignment.png").read_bytes()[:4] == b"\x89PNG"


def test_readme_images_exist_and_are_small():
    text = README.read_text(encoding="utf-8")
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images, "the README tour shows the demo's pictures"
    for image in images:
        path = README.parent / image
        assert path.is_file(), image
        assert path.read_bytes()[:4] == b"\x89PNG", image
        assert path.stat().st_size < 150_000, f"{image}: keep committed pictures small"


def test_readme_quick_start_commands_exist():
    text = README.read_text(encoding="utf-8")
    makefile = (README.parent / "Makefile").read_text(encoding="utf-8")
    for command in ("make demo", "make test"):
        assert command in text
        assert f"{command.split()[1]}:" in makefile
