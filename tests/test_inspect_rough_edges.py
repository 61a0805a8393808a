"""``qkv inspect``'s messages about rows, as a newcomer read them.

* ``--rows 0-1000`` on a short text said ``got 13``, a number the user never typed: the
  message now names the range as given, and the valid range;
* a long text keeps a few query rows, and the summary read as if it were over all of them:
  it now names the rows it is over. The test makes a short sentence "long" with a small
  size budget, so it runs in seconds on the packaged MiniLM;
* ``--rows 0-1000000000`` hung: the range was expanded before it was checked against the text;
* ``--out DIR`` wrote into any folder, over an ``index.html`` there; it now refuses a non-empty
  folder it did not write, as ``qkv demo`` does, and replaces its own earlier output.
"""

from __future__ import annotations

import functools
import re

import pytest

from qkv.inspect.model import InspectError
from qkv.inspect.selection import SelectionError, choose, parse_indices
from qkv.inspect.summary import scope

SENTENCE = "The cat sat on the mat because it was tired."  # 13 tokens with [CLS] and [SEP]


@pytest.mark.parametrize(
    "option, text, given",
    [("--rows", "0-1000", "0-1000"), ("--rows", "0,99", "99"), ("--rows", "2,5-20,30", "5-20,30"),
     ("--heads", "10-20", "10-20")],
)  # fmt: skip
def test_out_of_range_names_what_was_given(option, text, given):
    chosen = parse_indices(option, text)
    kwargs = {"rows_option": chosen} if option == "--rows" else {"heads_option": chosen}
    size, what = (9, "tokens in the text") if option == "--rows" else (12, "heads per layer")
    with pytest.raises(SelectionError) as error:
        choose(layers=6, heads=12, tokens=9, **kwargs)
    assert str(error.value) == f"{option}: expected values in 0..{size - 1} ({size} {what}), got {given}"


def test_scope_names_the_rows_the_summary_is_over():
    assert scope(tuple(range(13)), 13, causal=False) == "all 13 query rows"
    assert scope(tuple(range(13)), 13, causal=True) == "every row but the first, which can only see itself"
    assert scope((1623, 3247, 4870), 4871, causal=True) == (
        "only the 3 rows computed, of 4871 query rows: 1623, 3247, 4870"
    )
    assert scope((0, 1, 3), 13, causal=True) == (
        "only the 3 rows computed, of 13 query rows: 0, 1, 3; row 0 left out: it can only see itself"
    )
    assert scope(tuple(range(62, 2002, 62)), 2002, causal=True) == (
        "only the 32 rows computed, of 2002 query rows: 62, 124, 186, ..., 1984"
    )


def test_out_refuses_a_non_empty_folder_it_did_not_write(tmp_path):
    import qkv.inspect

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "index.html").write_text("my own page")
    # Refused before any model is looked for (the model folder here does not exist).
    with pytest.raises(InspectError) as error:
        qkv.inspect.inspect(SENTENCE, model=tmp_path / "never-read", out=mine, echo=lambda line: None)
    assert str(error.value) == f"--out: {mine} is a non-empty folder not written by qkv inspect; choose another or empty it"
    assert (mine / "index.html").read_text() == "my own page"


def test_out_under_something_that_is_not_a_folder(tmp_path):
    import qkv.inspect

    (tmp_path / "f").write_text("")
    with pytest.raises(InspectError) as error:
        qkv.inspect.inspect(SENTENCE, model=tmp_path / "never-read", out=tmp_path / "f" / "page", echo=lambda line: None)
    assert str(error.value) == f"--out: cannot create {tmp_path / 'f' / 'page'}: {tmp_path / 'f'} is a file, not a folder"


def test_huge_heads_are_named_without_being_expanded(tmp_path):
    import qkv.inspect
    from qkv.inspect.selection import parse_ranges

    with pytest.raises(InspectError, match=r"^--head: 5 is not among --heads 0-3,7-1000000000$"):
        qkv.inspect.inspect(SENTENCE, head=5, heads=parse_ranges("--heads", "0-3,7-1000000000"),
                            model=tmp_path / "never-read", out=tmp_path, echo=lambda line: None)  # fmt: skip


pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from inspect_models import needs_minilm  # noqa: E402

import qkv.inspect  # noqa: E402
from qkv.cli import main  # noqa: E402


@needs_minilm
def test_rows_out_of_range_on_the_command_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["inspect", SENTENCE, "--rows", "0-1000", "--out", str(tmp_path)]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "qkv inspect: error: --rows: expected values in 0..12 (13 tokens in the text), got 0-1000\n"
    assert not (tmp_path / "index.html").exists()


@needs_minilm
def test_summary_of_a_long_text_says_which_rows_it_is_over(capsys, tmp_path, monkeypatch):
    # A budget of 3 rows' weights (6 layers x 12 heads x 3 rows x 13 keys): the rows are
    # chosen automatically, as for a text of thousands of tokens.
    monkeypatch.setattr(qkv.inspect, "choose", functools.partial(choose, budget=6 * 12 * 3 * 13))
    assert main(["inspect", SENTENCE, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("long text: weights for 3 of 13 query rows")
    assert out[3] == (
        "the head of each layer with the largest mean share of weight on ... "
        "(only the 3 rows computed, of 13 query rows: 3, 8, 12)"
    )
    assert out[4].split()[0] == "layer"
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    note = re.search(r'<p class="note">For each layer.*?</p>', page, re.S).group(0)
    assert "over the 3 rows computed, of 13 query rows (3, 8, 12)." in " ".join(note.split())


@needs_minilm
@pytest.mark.parametrize(
    "option, text, message",
    [("--rows", "0-1000000000", "--rows: expected values in 0..2 (3 tokens in the text), got 0-1000000000"),
     ("--heads", "0-1000000000", "--heads: expected values in 0..11 (12 heads per layer), got 0-1000000000"),
     ("--attribution-layers", "0-1000000000", "--attribution-layers: expected layers in 0..5 (6 layers), got 0-1000000000")],
)  # fmt: skip
def test_a_huge_range_on_the_command_line_is_refused_at_once(capsys, tmp_path, option, text, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["inspect", "hi", option, text, "--out", str(tmp_path)]))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"qkv inspect: error: {message}\n"
    assert list(tmp_path.iterdir()) == []


@needs_minilm
def test_out_may_be_its_own_earlier_output(capsys, tmp_path):
    assert main(["inspect", SENTENCE, "--layer", "1", "--out", str(tmp_path)]) == 0
    assert main(["inspect", SENTENCE, "--out", str(tmp_path)]) == 0  # replaces what it wrote before
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"wrote {tmp_path}/index.html, {tmp_path}/layer0_head0.png, {tmp_path}/layer0_heads.png"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [".qkv-inspect", "index.html", "layer0_head0.png",
                                                          "layer0_heads.png"]  # fmt: skip
