"""Tests of ``qkv.inspect.page``: a self-contained page whose embedded weights are the captured ones.

What the page's script does in a browser is tested in ``tests/test_inspect_page_browser.py``.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from qkv.inspect.capture import Capture, Text
from qkv.inspect.page import encode_weights, render, scope_text
from qkv.inspect.selection import Selection
from qkv.inspect.summary import anchor_label, summarize

TOKENS = ("[CLS]", "</script>", "a&b", "<b>", "[SEP]")


def _capture(heads=(0, 1, 2), rows=(0, 1, 2, 3, 4), automatic=False) -> Capture:
    rng = np.random.default_rng(1)
    weights = rng.random((2, len(heads), len(rows), 5)).astype(np.float32)
    weights /= weights.sum(-1, keepdims=True)
    text = Text(ids=(101, 7, 8, 9, 102), labels=TOKENS, special=(0, 4))
    return Capture(text, Selection(tuple(heads), tuple(rows), 3, 5, automatic), weights)


def _page(capture: Capture, text: str = "a </script> & <b> {{js}}", images=()) -> str:
    summaries = summarize(capture, causal=False)
    return render(capture, model="tiny <model>", text=text, layer=1, head=capture.selection.heads[-1],
                  summaries=summaries, anchor=anchor_label(capture), images=list(images))  # fmt: skip


def _data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert match, "no embedded data"
    return json.loads(match.group(1))


def test_encode_weights_is_16_bit_fixed_point_little_endian():
    weights = np.array([0.0, 1.0, 0.5, 1e-6, 1.2, -0.1], dtype=np.float32)
    raw = np.frombuffer(base64.b64decode(encode_weights(weights)), dtype="<u2")
    np.testing.assert_array_equal(raw, [0, 65535, 32768, 0, 65535, 0])  # clipped to 0..1


def test_embedded_data_round_trips():
    capture = _capture()
    data = _data(_page(capture))
    assert data["tokens"] == list(TOKENS)  # exact, though they hold </script> and &
    assert data["special"] == [0, 4]
    assert data["layers"] == 2 and data["heads"] == [0, 1, 2] and data["rows"] == [0, 1, 2, 3, 4]
    assert (data["layer"], data["head"]) == (1, 2)
    decoded = np.frombuffer(base64.b64decode(data["weights"]), dtype="<u2").astype(np.float64) / 65535
    np.testing.assert_allclose(decoded.reshape(capture.weights.shape), capture.weights, rtol=0, atol=0.5 / 65535 + 1e-9)


def test_page_is_self_contained():
    page = _page(_capture())
    assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page and "@import" not in page
    # The only URL is the SVG namespace name, which browsers never fetch.
    assert set(re.findall(r"https?://[^\s\"'`)]+", page)) == {"http://www.w3.org/2000/svg"}
    assert "{{" not in page.replace("{{js}}", "")  # every placeholder was filled
    assert page.count("</script>") == 2  # the data block and the script; the tokens are escaped


def test_user_text_is_escaped_and_never_expanded():
    page = _page(_capture())
    assert "a &lt;/script&gt; &amp; &lt;b&gt; {{js}}" in page
    assert "<title>Attention in tiny &lt;model&gt;</title>" in page


def test_images_are_embedded_as_data_uris(tmp_path):
    png = tmp_path / "x.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    page = _page(_capture(), images=[(png, "Layer 1, head 2")])
    uri = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    assert f'<img src="{uri}" alt="Layer 1, head 2">' in page


def test_scope_says_what_was_computed():
    assert scope_text(_capture(), 2) == "All weights: 2 layers \u00d7 3 heads \u00d7 5 queries \u00d7 5 keys."
    partial = _capture(heads=(0, 2), rows=(0, 1, 2, 4), automatic=True)
    text = scope_text(partial, 2)
    assert text.startswith("Only some weights were computed: query rows 4 of 5 (0-2, 4), chosen to fit")
    assert "heads 2 of 3 (0, 2)" in text and "never built" in text
    chosen = scope_text(_capture(rows=(3,)), 2)
    assert "rows 1 of 5 (3), chosen with --rows; heads all 3" in chosen


@pytest.mark.parametrize("complete", [True, False])
def test_summary_table_on_the_page(complete):
    capture = _capture() if complete else _capture(rows=(1, 3))
    page = _page(capture)
    assert "<th colspan=\"2\">[CLS]/[SEP]</th>" in page
    assert page.count("<tr><td>") == 2  # one row per layer
    assert ("over the 2 rows computed" in page) is not complete
