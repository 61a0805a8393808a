"""The ``qkv inspect`` page in a real headless Chromium: it loads with no console errors, its
lines are the captured weights, and its controls change what is shown.

Skipped, with the reason, where selenium, Chromium or chromedriver is missing
(``tests/headless.py``). Pages come from real runs: MiniLM on a sentence, and a tiny random
Llama on a 2002-token text (the long-text view: a few rows, the heaviest keys).
"""

from __future__ import annotations

import numpy as np
import pytest

import headless

pytestmark = pytest.mark.skipif(headless.missing() is not None, reason=f"no headless browser: {headless.missing()}")

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from inspect_models import needs_minilm, tiny_llama  # noqa: E402

from qkv.inspect import inspect  # noqa: E402
from qkv.inspect.model import load, resolve  # noqa: E402

SENTENCE = "The cat sat on the mat because it was tired."


@pytest.fixture(scope="module")
def browser():
    driver = headless.start()
    yield driver
    headless.stop(driver)


@pytest.fixture(scope="module")
def short_page(tmp_path_factory):
    out = tmp_path_factory.mktemp("minilm")
    report = inspect(SENTENCE, layer=2, head=5, out=out, echo=lambda line: None)
    return report, (out / "index.html").as_uri()


@pytest.fixture(scope="module")
def long_page(tmp_path_factory):
    folder = tiny_llama(tmp_path_factory.mktemp("tiny"))
    out = tmp_path_factory.mktemp("long")
    text = " ".join(f"w{k % 50}" for k in range(1000))
    report = inspect(text, loaded=load(resolve(folder)), out=out, echo=lambda line: None)
    return report, (out / "index.html").as_uri()


def _open(browser, uri: str) -> None:
    from selenium.webdriver.common.by import By

    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(uri)
    browser.find_element(By.ID, "status")  # the page has been parsed and its script has run


def _errors(browser) -> list[dict]:
    return [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def _by(browser, css: str):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def _lines(browser) -> list[tuple[int, int, float, bool]]:
    """Every line of the head view: (row index, key, opacity, shown)."""
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#lines line')].map(l => "
        "[Number(l.dataset.row), Number(l.dataset.key), Number(l.getAttribute('stroke-opacity')), "
        "l.style.display !== 'none'])"
    )
    return [tuple(row) for row in rows]


def _status(browser) -> str:
    return _by(browser, "#status")[0].text


def _check_lines_are_weights(browser, report, layer: int, head: int) -> None:
    """Each drawn line's opacity is the captured weight of its (row, key), to 3 decimals."""
    column = report.capture.selection.heads.index(head)
    weights = report.capture.weights[layer, column]
    lines = _lines(browser)
    assert lines, "no lines drawn"
    for row, key, opacity, _ in lines:
        assert opacity == pytest.approx(weights[row, key], abs=6e-4), (row, key)
    # and every weight above the drawing floor has its line (all keys are shown for a sentence)
    drawn = {(row, key) for row, key, _, _ in lines}
    assert drawn == {tuple(map(int, rk)) for rk in np.argwhere(weights >= 0.005)}


@needs_minilm
def test_page_loads_without_console_errors(browser, short_page):
    report, uri = short_page
    _open(browser, uri)
    assert _errors(browser) == []
    assert _status(browser) == "layer 2 \u00b7 head 5"
    assert len(_by(browser, "#grid canvas")) == 6 * 12
    assert [c.get_attribute("title") for c in _by(browser, "#grid canvas.current")] == ["layer 2, head 5"]
    assert len(_by(browser, "#lines text.query")) == len(_by(browser, "#lines text.key")) == 13
    _check_lines_are_weights(browser, report, 2, 5)


@needs_minilm
def test_layer_and_head_controls_redraw(browser, short_page):
    from selenium.webdriver.support.ui import Select

    report, uri = short_page
    _open(browser, uri)
    before = _lines(browser)
    Select(_by(browser, "#layer")[0]).select_by_visible_text("4")
    assert _status(browser) == "layer 4 \u00b7 head 5"
    assert _lines(browser) != before
    _check_lines_are_weights(browser, report, 4, 5)
    Select(_by(browser, "#head")[0]).select_by_visible_text("0")
    assert _status(browser) == "layer 4 \u00b7 head 0"
    _check_lines_are_weights(browser, report, 4, 0)
    assert [c.get_attribute("title") for c in _by(browser, "#grid canvas.current")] == ["layer 4, head 0"]
    assert _errors(browser) == []


@needs_minilm
def test_clicking_a_model_view_cell_opens_it(browser, short_page):
    report, uri = short_page
    _open(browser, uri)
    cell = _by(browser, '#grid canvas[data-layer="1"][data-head="7"]')[0]
    browser.execute_script("arguments[0].scrollIntoView()", cell)
    cell.click()
    assert _status(browser) == "layer 1 \u00b7 head 7"
    assert _by(browser, "#layer")[0].get_attribute("value") == "1"
    assert _by(browser, "#head")[0].get_attribute("value") == "7"
    assert cell.get_attribute("class") == "current"
    _check_lines_are_weights(browser, report, 1, 7)
    assert _errors(browser) == []


@needs_minilm
def test_hovering_and_clicking_tokens_focus_their_lines(browser, short_page):
    from selenium.webdriver.common.action_chains import ActionChains

    report, uri = short_page
    _open(browser, uri)
    cat = _by(browser, '#lines text[data-row="2"]')[0]
    assert cat.text == "cat"
    ActionChains(browser).move_to_element(cat).perform()
    shown = [(row, key) for row, key, _, on in _lines(browser) if on]
    assert shown and {row for row, _ in shown} == {2}  # only the lines of "cat"
    focus = _by(browser, "#focus")[0].text
    assert focus.startswith("cat@2 attends to: ")
    top = int(np.argmax(report.capture.weights[2, 5, 2]))  # its heaviest key comes first
    assert focus.removeprefix("cat@2 attends to: ").startswith(f"{report.capture.text.labels[top]}@{top} ")
    # Away from the tokens, every line is back.
    ActionChains(browser).move_to_element(_by(browser, "h1")[0]).perform()
    assert all(on for *_, on in _lines(browser))
    # A key on the right: the lines into it.
    mat = _by(browser, '#lines text[data-key="6"]')[0]
    ActionChains(browser).move_to_element(mat).perform()
    assert {key for _, key, _, on in _lines(browser) if on} == {6}
    assert _by(browser, "#focus")[0].text.startswith("attending to mat@6: ")
    # A click keeps the focus while the pointer moves on; a second click lets it go.
    ActionChains(browser).move_to_element(cat).click().perform()
    ActionChains(browser).move_to_element(mat).perform()
    assert {row for row, _, _, on in _lines(browser) if on} == {2}
    ActionChains(browser).move_to_element(cat).click().perform()
    ActionChains(browser).move_to_element(_by(browser, "h1")[0]).perform()
    assert all(on for *_, on in _lines(browser))
    assert _errors(browser) == []


@needs_minilm
def test_long_text_page(browser, long_page):
    report, uri = long_page
    _open(browser, uri)
    assert _errors(browser) == []
    selection = report.capture.selection
    queries = _by(browser, "#lines text.query")
    assert len(queries) == len(selection.rows) == 32
    assert queries[-1].text.endswith(" 2001")  # positions are shown in a long text
    note = _by(browser, "#keys-note")[0]
    assert note.is_displayed() and note.text.startswith("2002 keys are too many to list")
    assert _by(browser, "#lines text.gap")  # the keys left out are marked
    shown = {int(k.get_attribute("data-key")) for k in _by(browser, "#lines text.key")}
    weights = report.capture.weights[0, 0]
    fixed = np.round(weights * 65535)  # the page's 16-bit weights, which its script ranks
    for row in fixed:  # each row's three heaviest keys are listed (any of them, on a tie)
        third = np.sort(row)[-3]
        assert set(np.flatnonzero(row > third).tolist()) <= shown
        if third > 0:  # keys a row gives no weight are never listed for it
            assert np.count_nonzero(row[sorted(shown)] >= third) >= 3
    for row, key, opacity, _ in _lines(browser):
        assert opacity == pytest.approx(weights[row, key], abs=6e-4)
    assert _by(browser, "#bins-note")[0].text.startswith("With 2002 keys, each pixel column")
    assert len(_by(browser, "#grid canvas")) == 2 * 6
