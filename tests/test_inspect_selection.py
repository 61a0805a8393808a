"""Tests of ``qkv.inspect.selection``: parsing --rows/--heads and the size budget for long texts."""

from __future__ import annotations

import pytest

from qkv.inspect.selection import AUTO_ROWS, PAGE_ELEMENTS, Selection, SelectionError, choose, parse_indices, spread


def test_parse_indices_lists_and_inclusive_ranges():
    assert parse_indices("--rows", "0,3,5-8") == (0, 3, 5, 6, 7, 8)
    assert parse_indices("--rows", " 7 , 2,2 ") == (2, 7)  # sorted, no repeats, spaces allowed
    assert parse_indices("--heads", "4-4") == (4,)


@pytest.mark.parametrize(
    "text, message",
    [
        ("a", "--rows: expected integers and ranges such as 0,3,5-8, got 'a'"),
        ("1,", "--rows: expected integers and ranges such as 0,3,5-8, got '1,'"),
        ("5-2", "--rows: expected ranges low-high with 0 <= low <= high, got '5-2'"),
        ("1-x", "--rows: expected integers and ranges such as 0,3,5-8, got '1-x'"),
    ],
)
def test_parse_indices_errors(text, message):
    with pytest.raises(SelectionError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        parse_indices("--rows", text)


def test_spread_keeps_the_last_row_and_spaces_evenly():
    assert spread(3, 9) == (2, 5, 8)
    assert spread(1, 9) == (8,)
    assert spread(20, 5) == (0, 1, 2, 3, 4)
    rows = spread(32, 3001)
    assert len(set(rows)) == 32 and rows[-1] == 3000 and rows == tuple(sorted(rows))
    gaps = {b - a for a, b in zip((-1, *rows), rows)}  # the first part ends at rows[0]
    assert max(gaps) - min(gaps) <= 1


def test_short_text_keeps_everything():
    selection = choose(layers=6, heads=12, tokens=9)
    assert selection.complete and not selection.automatic
    assert selection.heads == tuple(range(12)) and selection.rows == tuple(range(9))
    assert selection.weights_for() is None  # nothing to leave out: qkv builds all weights


def test_long_text_thins_rows_to_the_budget():
    # 30 layers x 9 heads x 3000 keys: all weights would be 2.4e9 values.
    selection = choose(layers=30, heads=9, tokens=3000)
    assert selection.automatic and not selection.complete
    kept = 30 * 9 * len(selection.rows) * 3000
    assert kept <= PAGE_ELEMENTS < 30 * 9 * (len(selection.rows) + 1) * 3000
    assert selection.rows[-1] == 2999
    assert selection.weights_for() == {"rows": list(selection.rows)}


def test_automatic_rows_are_capped_for_a_readable_head_view():
    selection = choose(layers=2, heads=2, tokens=2000)
    assert len(selection.rows) == AUTO_ROWS


def test_heads_option_is_kept_and_counted_in_the_budget():
    few = choose(layers=30, heads=9, tokens=3000, heads_option=(1, 4))
    assert few.heads == (1, 4)
    assert len(few.rows) > len(choose(layers=30, heads=9, tokens=3000).rows)
    assert few.weights_for() == {"heads": [1, 4], "rows": list(few.rows)}


def test_rows_option_is_taken_as_given():
    selection = choose(layers=30, heads=9, tokens=3000, rows_option=(0, 10, 2999))
    assert selection.rows == (0, 10, 2999) and not selection.automatic
    assert selection.heads == tuple(range(9))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rows_option": (0, 9)}, r"--rows: expected values in 0..8 \(9 tokens in the text\), got 9"),
        ({"heads_option": (12,)}, r"--heads: expected values in 0..11 \(12 heads per layer\), got 12"),
    ],
)
def test_out_of_range_options(kwargs, message):
    with pytest.raises(SelectionError, match=message):
        choose(layers=6, heads=12, tokens=9, **kwargs)


def test_selection_is_frozen():
    selection = Selection((0,), (0,), 1, 1, False)
    with pytest.raises(AttributeError):
        selection.rows = (1,)  # type: ignore[misc]


# ---- ranges are checked before they are expanded -------------------------------------------------


def test_a_huge_range_is_checked_before_it_is_expanded():
    # "--rows 0-1000000000" was expanded into a billion ints (it hung; 0-10000000 took 960 MB)
    # before it was found to be past the 13 tokens of the text.
    import tracemalloc

    from qkv.inspect.selection import parse_ranges

    tracemalloc.start()
    try:
        rows = parse_ranges("--rows", "0-1000000000")
        heads = parse_ranges("--heads", "3,0-1000000000")
        assert len(rows) == 1_000_000_001 and 999_999_999 in rows and -1 not in rows
        with pytest.raises(SelectionError, match=r"^--rows: expected values in 0..12 \(13 tokens in the text\), got 0-1000000000$"):
            choose(layers=6, heads=12, tokens=13, rows_option=rows)
        with pytest.raises(SelectionError, match=r"^--heads: expected values in 0..11 \(12 heads per layer\), got 0-1000000000$"):
            choose(layers=6, heads=12, tokens=13, heads_option=heads)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak


def test_parsed_ranges_are_the_values_they_stand_for():
    from qkv.inspect.selection import format_indices, parse_ranges

    ranges = parse_ranges("--rows", " 7 , 2,2, 3-5,4-9 ")
    assert ranges == (2, 3, 4, 5, 6, 7, 8, 9) and list(ranges) == list(range(2, 10))  # merged, sorted
    assert ranges.runs == ((2, 9),) and ranges[0] == 2 and ranges[-1] == 9 and ranges[1:3] == (3, 4)
    assert parse_ranges("--rows", "0,5-6") != (0, 5)
    assert format_indices(parse_ranges("--rows", "0,5-6,2")) == "0, 2, 5-6"
    assert choose(layers=1, heads=2, tokens=9, rows_option=parse_ranges("--rows", "8,1-2")).rows == (1, 2, 8)
    with pytest.raises(SelectionError, match="^--rows: expected integers and ranges such as 0,3,5-8, got '1-x'$"):
        parse_ranges("--rows", "1-x")
