"""Tests of ``qkv.inspect.summary`` on hand-made weights whose answers are known in closed form."""

from __future__ import annotations

import numpy as np
import pytest

from qkv.inspect.capture import Capture, Text
from qkv.inspect.selection import Selection
from qkv.inspect.summary import Pick, anchor_label, format_table, summarize

TOKENS = ("[CLS]", "a", "b", "[SEP]")


def _heads() -> np.ndarray:
    """Three pure heads on 4 tokens: previous token, itself, everything on [SEP]. Shape (h, i, j)."""
    previous = np.zeros((4, 4))
    previous[0, 0] = 1.0  # the first token has no previous one: it keeps to itself
    previous[np.arange(1, 4), np.arange(0, 3)] = 1.0
    return np.stack([previous, np.eye(4), np.tile([0.0, 0.0, 0.0, 1.0], (4, 1))]).astype(np.float32)


def _capture(weights: np.ndarray, heads=(0, 1, 2), rows=(0, 1, 2, 3), special=(0, 3), total_heads=3) -> Capture:
    text = Text(ids=(101, 1, 2, 102), labels=TOKENS, special=special)
    selection = Selection(tuple(heads), tuple(rows), total_heads, 4, False)
    return Capture(text=text, selection=selection, weights=weights)


def test_each_pattern_finds_its_head():
    capture = _capture(_heads()[None])  # one layer
    (layer,) = summarize(capture, causal=False)
    assert layer.previous == Pick(head=0, share=1.0)
    assert layer.itself == Pick(head=1, share=1.0)
    assert layer.anchor == Pick(head=2, share=1.0)


def test_shares_are_means_over_rows():
    weights = _heads()[None].copy()
    weights[0, 2] = 0.25  # head 2 now spreads evenly: [CLS] and [SEP] get half of every row
    (layer,) = summarize(_capture(weights), causal=False)
    # anchor: head 0 puts rows 0 and 1 on [CLS] (2 of 4 rows) = 0.5; head 1 rows 0 and 3 = 0.5;
    # head 2 = 0.5 in every row; argmax keeps the first.
    assert layer.anchor.share == pytest.approx(0.5)
    # itself: head 1 = 1, head 0 only row 0 = 0.25, head 2 = 0.25.
    assert layer.itself == Pick(head=1, share=1.0)


def test_decoders_leave_out_the_first_row():
    weights = _heads()[None]
    (encoder,) = summarize(_capture(weights), causal=False)
    (decoder,) = summarize(_capture(weights), causal=True)
    assert encoder.itself == decoder.itself == Pick(head=1, share=1.0)
    # Head 0 is on itself only in the first row: 1 of 4 rows for an encoder; a decoder's first
    # row has nothing else to see, so it is not counted.
    head0 = _capture(weights[:, :1], heads=(0,))
    assert summarize(head0, causal=False)[0].itself.share == pytest.approx(0.25)
    assert summarize(head0, causal=True)[0].itself.share == 0.0


def test_only_chosen_heads_and_rows_count_and_heads_keep_their_numbers():
    full = _heads()
    # Keep heads 1 and 2 (numbered as in the model) and rows 2 and 3.
    weights = full[[1, 2]][:, [2, 3]][None]
    capture = _capture(weights, heads=(1, 2), rows=(2, 3))
    (layer,) = summarize(capture, causal=False)
    assert layer.itself == Pick(head=1, share=1.0)
    assert layer.anchor == Pick(head=2, share=1.0)
    # previous: rows 2 and 3 look at keys 1 and 2; neither head does.
    assert layer.previous.share == 0.0


def test_no_previous_token_when_only_the_first_row_is_chosen():
    weights = _heads()[:, :1][None]
    (layer,) = summarize(_capture(weights, rows=(0,)), causal=False)
    assert layer.previous is None


def test_anchor_label_names_the_special_tokens_or_the_first_token():
    assert anchor_label(_capture(_heads()[None])) == "[CLS]/[SEP]"
    assert anchor_label(_capture(_heads()[None], special=())) == "first token"
    # With no special tokens the first token is the anchor (a decoder's attention sink).
    weights = _heads()[None]
    (layer,) = summarize(_capture(weights, special=()), causal=False)
    assert layer.anchor.share == pytest.approx(0.5)  # head 0: rows 0 and 1 on token 0


def test_format_table_lines():
    capture = _capture(np.stack([_heads(), _heads()[[1, 0, 2]]]))
    text = format_table(summarize(capture, causal=False), anchor_label(capture))
    lines = text.splitlines()
    assert lines[0].split() == ["layer", "previous", "token", "[CLS]/[SEP]", "itself"]
    assert lines[1].split() == ["0", "head", "0", "100%", "head", "2", "100%", "head", "1", "100%"]
    assert lines[2].split() == ["1", "head", "1", "100%", "head", "2", "100%", "head", "0", "100%"]
