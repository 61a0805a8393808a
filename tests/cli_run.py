"""Running the ``qkv`` command in a test: the one-line-error contract, checked once."""

from __future__ import annotations

import pytest

from qkv.cli import main


def fails(capsys, argv: list[str]) -> str:
    """Run ``qkv argv``, expect exit code 2 and exactly one line on stderr; return that line."""
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()
