"""Date translation: human-readable dates in many formats and languages -> ISO ``YYYY-MM-DD``.

Shape legend: ``n`` examples, ``s`` padded source length in characters, ``u`` target
length in characters (12: bos, ten characters, eos).

The character-level toy task used to show attention as alignment, in the spirit of the
figures of Bahdanau et al. 2015, "Neural Machine Translation by Jointly Learning to Align
and Translate": each output character should attend to the source characters it copies or
translates (the year digits to the year, the month number to the month name, ...).

Month and weekday names come from CLDR through ``babel`` (shipped with the package, no
download). Spans are exact by construction: a pattern such as ``"EEEE d 'de' MMMM 'de' y"``
is split into fields with ``babel.dates.tokenize_pattern``, each field is rendered on its
own with ``babel.dates.format_date`` and the pieces are concatenated, so the offset of
every field is known. Checked against ``format_date`` on the whole pattern in the tests.

Every source string names one date only: numeric formats are day-first with a four-digit
year, and two-digit years are allowed only because the year range spans at most a
century (``yy`` = 17 means 2017 for the default range 1950-2049).
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from .vocab import Vocabulary, _check_int
from .._extras import install

__all__ = ["DateTask", "make_date_task", "LANGUAGES", "patterns", "render"]

# Formats every language gets: day-first numeric forms and a few spelled-out ones.
_COMMON = (
    "d MMMM y",
    "d MMM y",
    "EEEE d MMMM y",
    "EEEE d MMM yy",
    "EEE d MMM y",
    "dd/MM/y",
    "d.M.y",
    "dd-MM-y",
    "y-MM-dd",
)
# Formats a language is known for beyond CLDR's own full/long/medium patterns.
_EXTRA = {
    "en": ("MMMM d, y", "EEE, MMM d, y", "MMM d, yy", "d MMM yy"),
    "de": ("d. MMMM y", "EEEE, d. MMM y", "d. MMM yy", "dd.MM.y"),
    "fr": ("'le' d MMMM y", "EEEE d MMM y", "dd/MM/y"),
    "es": ("d 'de' MMMM 'de' y", "EEEE d 'de' MMM 'de' y", "d-MMM-y"),
    "it": ("d MMMM y", "EEEE d MMM yy", "d MMM yy"),
    "nl": ("d MMMM y", "EEEE d MMM y", "d-M-y"),
    "pt": ("d 'de' MMMM 'de' y", "EEEE, d 'de' MMM 'de' y"),
    "sv": ("'den' d MMMM y", "EEEE d MMM y"),
    "da": ("'den' d. MMMM y", "d. MMM yy"),
}
LANGUAGES = tuple(_EXTRA)
_FIELDS = {"y": 0, "M": 1, "L": 1, "d": 2}  # pattern letter -> span row (year, month, day)


def _babel_dates():
    """``babel.dates``, imported on first use so ``import qkv.tasks`` works without babel."""
    try:
        import babel.dates as dates
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"the date task needs babel for month names: {install('demo')}"
        ) from error
    return dates


@lru_cache(maxsize=None)
def patterns(language: str) -> tuple[str, ...]:
    """The CLDR date patterns used for ``language`` (no duplicates, stable order)."""
    if language not in _EXTRA:
        raise ValueError(f"language: expected one of {LANGUAGES}, got {language!r}")
    get_date_format = _babel_dates().get_date_format
    # CLDR's "short" formats are left out: English writes them month-first ("3/4/17"),
    # which would make "03/04" mean two different dates depending on the language.
    own = tuple(get_date_format(width, locale=language).pattern for width in ("full", "long", "medium"))
    return tuple(dict.fromkeys(own + _COMMON + _EXTRA[language]))


@lru_cache(maxsize=None)
def _tokens(pattern: str) -> tuple[tuple[str, object], ...]:
    return tuple(_babel_dates().tokenize_pattern(pattern))


@lru_cache(maxsize=65536)
def _field(language: str, letter: str, width: int, ymd: tuple[int, int, int]) -> str:
    """One field of a date rendered by babel (cached: there are few distinct values)."""
    return _babel_dates().format_date(datetime.date(*ymd), letter * width, locale=language)


def render(date: datetime.date, pattern: str, language: str) -> tuple[str, list[tuple[int, int]]]:
    """Format ``date`` with a CLDR ``pattern`` and return ``(text, spans)``.

    ``spans`` holds ``(start, end)`` character offsets (end exclusive) of the year, month
    and day fields, in that order; ``(-1, -1)`` for a field the pattern does not contain.
    """
    pieces: list[str] = []
    spans = [(-1, -1)] * 3
    offset = 0
    for kind, value in _tokens(pattern):
        if kind == "chars":
            piece = value
        else:
            letter, width = value
            # Key the cache on only the part of the date the field shows (the weekday
            # needs all of it), so a few hundred babel calls serve any number of dates.
            if letter == "y":
                ymd = (date.year, 1, 1)
            elif letter in "ML":
                ymd = (2001, date.month, 1)
            elif letter == "d":
                ymd = (2001, 1, date.day)
            else:
                ymd = (date.year, date.month, date.day)
            piece = _field(language, letter, width, ymd)
            if letter in _FIELDS:
                spans[_FIELDS[letter]] = (offset, offset + len(piece))
        pieces.append(piece)
        offset += len(piece)
    return "".join(pieces), spans


@dataclass(frozen=True)
class DateTask:
    """Train/test splits of the date task; no calendar date occurs in both."""

    train_source: Tensor  # (n, s) long: source character ids, right-padded, no bos/eos
    train_source_lengths: Tensor  # (n,) long: characters in each source string
    train_target: Tensor  # (n, u) long: bos, the ten characters of YYYY-MM-DD, eos
    train_spans: Tensor  # (n, 3, 2) long: (start, end) of year, month, day in the source
    train_sources: list[str]  # e.g. "vendredi 3 mars 2017"
    train_targets: list[str]  # e.g. "2017-03-03"
    train_languages: list[str]  # locale code of each example
    train_patterns: list[str]  # CLDR pattern of each example
    test_source: Tensor  # (n, s) long
    test_source_lengths: Tensor  # (n,) long
    test_target: Tensor  # (n, u) long
    test_spans: Tensor  # (n, 3, 2) long
    test_sources: list[str]
    test_targets: list[str]
    test_languages: list[str]
    test_patterns: list[str]
    source_vocab: Vocabulary  # every character any supported language can produce
    target_vocab: Vocabulary  # the digits and "-"
    languages: tuple[str, ...]  # the languages sampled from


def _source_vocabulary(languages: tuple[str, ...]) -> Vocabulary:
    """All characters any pattern can produce, independent of which dates were sampled."""
    chars: set[str] = set("0123456789")
    # 1 Jan 2001 was a Monday: days 1-7 of January cover every weekday name.
    samples = [datetime.date(2001, month, 1) for month in range(1, 13)]
    samples += [datetime.date(2001, 1, day) for day in range(1, 8)]
    for language in languages:
        for pattern in patterns(language):
            for date in samples:
                chars.update(render(date, pattern, language)[0])
    return Vocabulary(sorted(chars))


def _split(rows: list[tuple], source_vocab: Vocabulary, target_vocab: Vocabulary) -> dict:
    sources = [row[0] for row in rows]
    source, lengths = source_vocab.encode_batch(sources)
    target, _ = target_vocab.encode_batch([row[1] for row in rows], bos=True, eos=True)
    return {
        "source": source,
        "source_lengths": lengths,
        "target": target,
        "spans": torch.tensor([row[2] for row in rows], dtype=torch.long).reshape(-1, 3, 2),
        "sources": sources,
        "targets": [row[1] for row in rows],
        "languages": [row[3] for row in rows],
        "patterns": [row[4] for row in rows],
    }


def make_date_task(
    n_train: int = 10000,
    n_test: int = 1000,
    *,
    seed: int = 0,
    languages: tuple[str, ...] | list[str] = LANGUAGES,
    years: tuple[int, int] = (1950, 2049),
) -> DateTask:
    """Generate the date translation task.

    Args:
        n_train: number of training examples.
        n_test: number of test examples.
        seed: seed of the ``random.Random`` that picks dates, languages and patterns.
        languages: locale codes to sample from, a subset of :data:`LANGUAGES`.
        years: first and last year (inclusive), at most 100 years apart so a two-digit
            year names one year.

    Returns:
        A :class:`DateTask`. Test dates are calendar days that never occur in training;
        when ``n_train + n_test`` exceeds the number of days in ``years``, training repeats
        its own days in other formats (test days are still held out).
    """
    _check_int("n_train", n_train, minimum=1)
    _check_int("n_test", n_test, minimum=1)
    if isinstance(languages, str):
        languages = (languages,)
    languages = tuple(languages)
    if not languages:
        raise ValueError(f"languages: expected at least one of {LANGUAGES}, got ()")
    for language in languages:
        if language not in LANGUAGES:
            raise ValueError(f"languages: expected codes from {LANGUAGES}, got {language!r}")
    try:
        first, last = (int(y) for y in years)
    except (TypeError, ValueError):
        raise ValueError(f"years: expected a pair (first, last) of years, got {years!r}") from None
    if not (1 <= first <= last <= 9999 and last - first < 100):
        raise ValueError(
            f"years: expected (first, last) with first <= last < first + 100, got {years!r}"
        )

    rng = random.Random(seed)
    start = datetime.date(first, 1, 1).toordinal()
    n_days = datetime.date(last, 12, 31).toordinal() - start + 1
    # Split the calendar days first, so held-out days are unseen in any format. With
    # fewer days than examples, each split cycles through its own days in new formats.
    days = list(range(n_days))
    rng.shuffle(days)
    if n_train + n_test <= n_days:
        n_test_days = n_test
    else:
        n_test_days = min(n_days - 1, max(1, round(n_days * n_test / (n_train + n_test))))
    test_days, train_days = days[:n_test_days], days[n_test_days:]

    def examples(pool: list[int], count: int) -> list[tuple]:
        rows = []
        for k in range(count):
            # Cycle through a pool smaller than count: each day is used before any repeats.
            date = datetime.date.fromordinal(start + pool[k % len(pool)])
            language = rng.choice(languages)
            pattern = rng.choice(patterns(language))
            text, spans = render(date, pattern, language)
            rows.append((text, date.isoformat(), spans, language, pattern))
        return rows

    source_vocab, target_vocab = _vocabularies()
    train = _split(examples(train_days, n_train), source_vocab, target_vocab)
    test = _split(examples(test_days, n_test), source_vocab, target_vocab)
    return DateTask(
        **{f"train_{key}": value for key, value in train.items()},
        **{f"test_{key}": value for key, value in test.items()},
        source_vocab=source_vocab,
        target_vocab=target_vocab,
        languages=languages,
    )


@lru_cache(maxsize=1)
def _vocabularies() -> tuple[Vocabulary, Vocabulary]:
    # The source vocabulary covers every supported language, so a model trained on one
    # subset of languages can be fed another without a new embedding table.
    return _source_vocabulary(LANGUAGES), Vocabulary("0123456789-")
