"""Tests for qkv.tasks.dates: targets parse back, spans, held-out days, babel agreement."""

import datetime

import pytest
import torch
from babel.dates import format_date, get_day_names, get_month_names

from qkv.tasks.dates import LANGUAGES, make_date_task, patterns, render


@pytest.fixture(scope="module")
def task():
    return make_date_task(n_train=3000, n_test=500, seed=5)


def _month_number(text: str, language: str) -> int:
    if text.isdigit():
        return int(text)
    for width in ("wide", "abbreviated"):
        for context in ("format", "stand-alone"):
            names = get_month_names(width, context, locale=language)
            matches = [month for month, name in names.items() if name == text]
            if matches:
                return matches[0]
    raise AssertionError(f"{text!r} is not a month name in {language}")


def _parse(source: str, spans: list[list[int]], language: str, first_year: int) -> datetime.date:
    """Read the date back from the source through its spans, independently of the generator."""
    (y0, y1), (m0, m1), (d0, d1) = spans
    year_text = source[y0:y1]
    year = int(year_text)
    if len(year_text) == 2:  # two-digit year inside a window of 100 years
        year = first_year + (year - first_year) % 100
    return datetime.date(year, _month_number(source[m0:m1], language), int(source[d0:d1]))


def test_shapes_and_dtypes(task):
    assert task.train_source.shape[0] == 3000 and task.test_source.shape[0] == 500
    assert task.train_target.shape == (3000, 12) and task.test_target.shape == (500, 12)
    assert task.train_spans.shape == (3000, 3, 2) and task.train_spans.dtype == torch.long
    assert task.train_source_lengths.tolist() == [len(s) for s in task.train_sources]
    assert set(task.train_languages) == set(LANGUAGES)


def test_targets_are_iso_dates_and_parse_back_from_the_source(task):
    for split in ("train", "test"):
        sources, targets = getattr(task, f"{split}_sources"), getattr(task, f"{split}_targets")
        spans, languages = getattr(task, f"{split}_spans").tolist(), getattr(task, f"{split}_languages")
        for source, target, span, language in zip(sources, targets, spans, languages):
            expected = datetime.date.fromisoformat(target)
            assert target == expected.strftime("%Y-%m-%d")
            assert _parse(source, span, language, 1950) == expected, source


def test_weekday_names_agree_with_the_calendar(task):
    checked = 0
    for source, target, language, pattern in zip(
        task.train_sources, task.train_targets, task.train_languages, task.train_patterns
    ):
        if "EEEE" in pattern:
            date = datetime.date.fromisoformat(target)
            assert source.startswith(get_day_names("wide", locale=language)[date.weekday()])
            checked += 1
    assert checked > 100


def test_target_ids_are_bos_iso_eos(task):
    for ids, target in zip(task.test_target, task.test_targets):
        assert ids[0] == task.target_vocab.bos_id and ids[-1] == task.target_vocab.eos_id
        assert "".join(task.target_vocab.decode(ids)) == target


def test_source_ids_decode_to_the_source_and_spans_index_ids(task):
    vocab = task.source_vocab
    for ids, source, span in zip(task.test_source, task.test_sources, task.test_spans.tolist()):
        assert "".join(vocab.decode(ids)) == source
        assert vocab.unk_id not in ids.tolist()
        y0, y1 = span[0]
        # No bos in the source: span offsets are token positions too.
        assert "".join(vocab.decode(ids[y0:y1])) == source[y0:y1]


def test_render_agrees_with_babel_on_whole_patterns():
    dates = [datetime.date(1950, 1, 1), datetime.date(2017, 3, 3), datetime.date(2049, 12, 31),
             datetime.date(1996, 2, 29)]
    for language in LANGUAGES:
        for pattern in patterns(language):
            for date in dates:
                text, spans = render(date, pattern, language)
                assert text == format_date(date, pattern, locale=language)
                assert all(0 <= start < end <= len(text) for start, end in spans)


def test_test_days_are_held_out(task):
    assert not set(task.train_targets) & set(task.test_targets)
    # Fewer days than examples: splits repeat their own days but still never share one.
    small = make_date_task(500, 100, seed=1, years=(2000, 2000))
    assert not set(small.train_targets) & set(small.test_targets)
    assert len(set(small.train_targets) | set(small.test_targets)) == 366


def test_every_source_string_names_one_date():
    # Exhaustive over the confusable part of the calendar: days that could be months,
    # every month, and years whose digits could be read as a day or month.
    meaning = {}
    for year in (1950, 2001, 2012):
        for month in range(1, 13):
            for day in range(1, 14):
                date = datetime.date(year, month, day)
                for language in LANGUAGES:
                    for pattern in patterns(language):
                        source = render(date, pattern, language)[0]
                        assert meaning.setdefault(source, date) == date, (source, language, pattern)


def test_same_seed_same_data_and_other_seed_other_data():
    a, b = make_date_task(200, 50, seed=9), make_date_task(200, 50, seed=9)
    assert a.train_sources == b.train_sources and a.test_targets == b.test_targets
    assert torch.equal(a.train_source, b.train_source) and torch.equal(a.test_spans, b.test_spans)
    c = make_date_task(200, 50, seed=10)
    assert c.train_sources != a.train_sources
    assert c.source_vocab == a.source_vocab


def test_languages_restrict_the_sample():
    german = make_date_task(300, 50, seed=0, languages=["de"])
    assert set(german.train_languages) == {"de"} and german.languages == ("de",)
    assert make_date_task(10, 5, languages="fr").languages == ("fr",)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"n_train: expected an integer >= 1, got 0"):
        make_date_task(0, 10)
    with pytest.raises(ValueError, match=r"n_test: expected an integer >= 1, got 0"):
        make_date_task(10, 0)
    with pytest.raises(ValueError, match=r"languages: expected codes from \('en'.*got 'xx'"):
        make_date_task(10, 10, languages=("en", "xx"))
    with pytest.raises(ValueError, match=r"languages: expected at least one of"):
        make_date_task(10, 10, languages=[])
    with pytest.raises(ValueError, match=r"years: expected \(first, last\) .* got \(1900, 2020\)"):
        make_date_task(10, 10, years=(1900, 2020))
    with pytest.raises(ValueError, match=r"years: expected a pair \(first, last\) of years, got 2000"):
        make_date_task(10, 10, years=2000)
    with pytest.raises(ValueError, match=r"language: expected one of \('en'.*got 'tlh'"):
        patterns("tlh")


def test_missing_babel_says_how_to_install(monkeypatch):
    import sys

    from qkv.tasks import dates

    dates.patterns.cache_clear()
    monkeypatch.setitem(sys.modules, "babel.dates", None)
    with pytest.raises(ImportError, match=r'needs babel for month names: pip install "\.\[demo\]" in qkv\'s folder'):
        dates.patterns("en")
    monkeypatch.undo()
    dates.patterns.cache_clear()
