"""Tests of ``qkv inspect``'s attribution views (``qkv.inspect.attribution``, ``attribution_page``, ``attribution.js``).

Shape legend: ``l`` layers, ``h`` heads, ``n`` tokens.

Oracles: the rollout against products of 2x2 and 3x3 matrices written out by hand; head
importance against the same metric computed on a copy of the model whose ``W_O`` columns of
that head are zeroed by hand (no ``qkv.edit``), and a head whose ``W_O`` columns are already
zero, whose ablation must change nothing. The page's views in headless Chromium (skipped
where the browser is missing, as in ``test_inspect_page_browser.py``).
"""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest

from qkv.inspect.attribution import rollout
from qkv.inspect.attribution_page import rollout_layers


# ---- rollout by hand ------------------------------------------------------------------------------


def test_rollout_of_one_layer_is_half_attention_half_identity():
    a = np.array([[[1.0, 0.0], [0.25, 0.75]]])
    np.testing.assert_allclose(rollout(a)[0], [[1.0, 0.0], [0.125, 0.875]], atol=1e-15)


def test_rollout_multiplies_later_layers_on_the_left():
    a0 = np.array([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.2, 0.2, 0.6]])
    a1 = np.array([[1.0, 0.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 1.0]])
    r0 = np.array([[0.75, 0.25, 0.0], [0.0, 1.0, 0.0], [0.1, 0.1, 0.8]])  # 0.5 a0 + 0.5 I
    h1 = np.array([[1.0, 0.0, 0.0], [0.25, 0.5, 0.25], [0.0, 0.0, 1.0]])  # 0.5 a1 + 0.5 I
    r1 = np.array([[0.75, 0.25, 0.0],  # row 0 of h1 picks row 0 of r0
                   [0.25 * 0.75 + 0.25 * 0.1, 0.25 * 0.25 + 0.5 + 0.25 * 0.1, 0.25 * 0.8],
                   [0.1, 0.1, 0.8]])  # fmt: skip
    np.testing.assert_allclose(h1 @ r0, r1, atol=1e-15)
    out = rollout(np.stack([a0, a1]))
    np.testing.assert_allclose(out[0], r0, atol=1e-15)
    np.testing.assert_allclose(out[1], r1, atol=1e-15)
    np.testing.assert_allclose(out.sum(-1), 1.0, atol=1e-12)


def test_rollout_renormalises_rows_and_checks_its_shape():
    a = np.array([[[2.0, 2.0], [0.0, 4.0]]])  # rows summing to 4: 0.5 A + 0.5 I renormalised
    np.testing.assert_allclose(rollout(a)[0], [[0.6, 0.4], [0.0, 1.0]], atol=1e-15)
    with pytest.raises(ValueError, match="layers, n, n"):
        rollout(np.ones((2, 3)))


def test_rollout_layers_fit_the_budget_and_keep_the_last():
    assert rollout_layers(6, 13) == list(range(6))
    kept = rollout_layers(30, 512, budget=4 * 512 * 512)
    assert len(kept) == 4 and kept[-1] == 29
    assert rollout_layers(30, 4096, budget=10) == [29]


# ---- head importance on real models ----------------------------------------------------------------

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from inspect_models import minilm_folder, needs_minilm  # noqa: E402

from qkv.inspect.attribution import attribute, head_importance, layer_attention  # noqa: E402
from qkv.inspect.capture import run, tokenize  # noqa: E402
from qkv.inspect.model import Loaded, load, resolve  # noqa: E402
from qkv.inspect.selection import choose  # noqa: E402

SENTENCE = "The cat sat on the mat because it was tired."
E = 32  # MiniLM's head size
LAYER, HEAD = 2, 4


@pytest.fixture(scope="module")
def minilm():
    return load(resolve(None))


def _w_o(model, layer):
    return model.encoder.layer[layer].attention.output.dense.weight


def _pooled_metrics(hidden, clean):
    cos = torch.nn.functional.cosine_similarity(hidden.mean(0), clean.mean(0), dim=0)
    states = ((hidden - clean).norm(dim=-1) / clean.norm(dim=-1)).mean()
    return float(1 - cos), float(states)


@needs_minilm
def test_importance_matches_w_o_columns_zeroed_by_hand(minilm):
    text = tokenize(minilm, SENTENCE)
    importance = head_importance(minilm, text, layers=(LAYER, 5))
    assert [m.key for m in importance.metrics] == ["embedding", "states"]
    assert importance.values.shape == (2, 6, 12) and importance.layers == (LAYER, 5)
    assert np.isnan(importance.values[:, [0, 1, 3, 4]]).all()  # layers not asked for are not run
    assert np.isfinite(importance.values[:, [LAYER, 5]]).all()
    ids = torch.tensor([text.ids])
    hand = copy.deepcopy(minilm.model)
    with torch.no_grad():
        clean = hand(input_ids=ids).last_hidden_state[0].double()
        _w_o(hand, LAYER)[:, HEAD * E : (HEAD + 1) * E] = 0
        ablated = hand(input_ids=ids).last_hidden_state[0].double()
    expected = _pooled_metrics(ablated, clean)
    np.testing.assert_allclose(importance.values[:, LAYER, HEAD], expected, rtol=1e-4, atol=1e-6)
    assert (importance.values[:, [LAYER, 5]] > 0).all()  # every head of MiniLM moves its output a little


@needs_minilm
def test_a_head_with_no_output_has_no_importance(minilm):
    model = copy.deepcopy(minilm.model)
    with torch.no_grad():
        _w_o(model, LAYER)[:, HEAD * E : (HEAD + 1) * E] = 0  # the head already contributes nothing
    loaded = Loaded(**{**vars(minilm), "model": model})
    importance = head_importance(loaded, tokenize(loaded, SENTENCE), layers=(LAYER,))
    np.testing.assert_allclose(importance.values[:, LAYER, HEAD], 0.0, atol=1e-6)
    others = np.delete(importance.values[0, LAYER], HEAD)
    assert others.min() > 1e-5  # and zeroing any other head of that layer does change something


def _tiny_tied_llama(folder):
    """A random 2-layer Llama whose LM head is its input embeddings, with MiniLM's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_minilm
def test_decoder_importance_is_the_change_of_the_next_token_loss(tmp_path):
    from transformers import LlamaForCausalLM

    folder = _tiny_tied_llama(tmp_path)
    loaded = load(resolve(folder))
    assert loaded.causal
    text = tokenize(loaded, SENTENCE)
    importance = head_importance(loaded, text)
    assert [m.key for m in importance.metrics] == ["loss", "last", "states"]
    reference = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").double().eval()
    ids = torch.tensor([text.ids])

    def losses(model):
        logits = model(input_ids=ids).logits[0]
        return torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")

    with torch.no_grad():
        clean = losses(reference)
        assert importance.clean["loss"] == pytest.approx(float(clean.mean()), rel=1e-5)
        reference.model.layers[1].self_attn.o_proj.weight[:, 3 * 8 : 4 * 8] = 0  # head 3 of layer 1
        ablated = losses(reference)
    assert importance.values[0, 1, 3] == pytest.approx(float(ablated.mean() - clean.mean()), abs=1e-5)
    assert importance.values[1, 1, 3] == pytest.approx(float(ablated[-1] - clean[-1]), abs=1e-5)


@needs_minilm
def test_rollout_weights_come_from_qkv_whether_or_not_the_capture_has_them(minilm):
    text = tokenize(minilm, SENTENCE)
    selection = choose(layers=minilm.layers, heads=minilm.heads, tokens=len(text.ids))
    capture = run(minilm, text, selection)
    assert capture.selection.complete
    from_capture = layer_attention(minilm, text, capture)
    recorded = layer_attention(minilm, text)  # qkv.record's hook_pattern
    assert from_capture.shape == (6, 13, 13)
    np.testing.assert_allclose(recorded, from_capture, atol=1e-6)


@needs_minilm
def test_long_texts_get_no_rollout(minilm, monkeypatch):
    from qkv.inspect import attribution

    monkeypatch.setattr(attribution, "ROLLOUT_TOKENS", 8)  # MiniLM's own limit is 512 tokens
    result = attribute(minilm, tokenize(minilm, SENTENCE), layers=(5,))
    assert result.rollout.matrices is None
    assert result.rollout.note.startswith("no attention rollout: the text has 13 tokens") and "up to 8 " in result.rollout.note


# ---- the page --------------------------------------------------------------------------------------

pytest.importorskip("matplotlib")

import headless  # noqa: E402

from qkv.inspect import inspect  # noqa: E402


@pytest.fixture(scope="module")
def page(minilm, tmp_path_factory):
    out = tmp_path_factory.mktemp("attribution")
    report = inspect(SENTENCE, loaded=minilm, layer=2, head=5, out=out, attribution=True, echo=lambda line: None)
    return report, out / "index.html"


@needs_minilm
def test_page_embeds_the_attribution(page):
    report, path = page
    html = path.read_text(encoding="utf-8")
    match = re.search(r'<script type="application/json" id="qkv-attribution">(.*?)</script>', html, re.S)
    data = json.loads(match.group(1))
    values = np.array(data["importance"]["values"], dtype=float)
    np.testing.assert_allclose(values, report.attribution.importance.values, rtol=1e-5)
    assert data["rollout"]["layers"] == list(range(6))
    assert any(line.startswith("most important heads by ") for line in report.lines)


@needs_minilm
def test_page_without_attribution_has_no_such_sections(minilm, tmp_path):
    inspect(SENTENCE, loaded=minilm, out=tmp_path, echo=lambda line: None)
    html = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "importance-view" not in html and "{{" not in html


def test_cli_has_the_attribution_flags(capsys):
    from qkv.cli import build_parser, main

    args = build_parser(["inspect"]).parse_args(["inspect", "x", "--attribution-layers", "0-2"])
    assert args.attribution_layers == (0, 1, 2) and not args.attribution
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    out = capsys.readouterr().out
    assert "--attribution " in out and "--attribution-layers" in out


browser_missing = pytest.mark.skipif(headless.missing() is not None, reason=f"no headless browser: {headless.missing()}")


@pytest.fixture(scope="module")
def browser():
    driver = headless.start()
    yield driver
    headless.stop(driver)


def _open(browser, path):
    browser.get_log("browser")
    browser.get(path.as_uri())
    browser.find_element("id", "importance-status")


def _errors(browser):
    return [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def _text(browser, css):
    return browser.find_element("css selector", css).text


def _cells(browser):
    return browser.execute_script(
        "return [...document.querySelectorAll('#importance td')].map(c => [Number(c.dataset.layer), "
        "Number(c.dataset.head), c.dataset.value === '' ? null : Number(c.dataset.value)])"
    )


@browser_missing
@needs_minilm
def test_importance_view_and_its_controls(browser, page):
    from selenium.webdriver.support.ui import Select

    report, path = page
    _open(browser, path)
    assert _errors(browser) == []
    values = report.attribution.importance.values
    cells = _cells(browser)
    assert len(cells) == 6 * 12
    for layer, head, value in cells:
        assert value == pytest.approx(values[0, layer, head], rel=1e-5)
    best = np.unravel_index(np.argmax(values[0]), values[0].shape)
    assert _text(browser, "#importance-status").endswith(f"largest: layer {best[0]} head {best[1]} ({values[0][best]:.3g})")
    Select(browser.find_element("id", "importance-metric")).select_by_index(1)  # the relative change of the states
    assert _text(browser, "#importance-status").startswith("relative change of the final states")
    for layer, head, value in _cells(browser):
        assert value == pytest.approx(values[1, layer, head], rel=1e-5)
    Select(browser.find_element("id", "importance-from")).select_by_visible_text("3")
    Select(browser.find_element("id", "importance-to")).select_by_visible_text("4")
    assert {layer for layer, _, _ in _cells(browser)} == {3, 4}
    assert "layers 3\u20134" in _text(browser, "#importance-status")
    cell = browser.find_element("css selector", '#importance td[data-layer="4"][data-head="7"]')
    browser.execute_script("arguments[0].scrollIntoView()", cell)
    cell.click()  # opens that head in the head view
    assert _text(browser, "#status") == "layer 4 \u00b7 head 7"
    assert _errors(browser) == []


def _strip(browser):
    return browser.execute_script(
        "return [...document.querySelectorAll('#rollout-strip span.token')].map(s => Number(s.dataset.value))"
    )


@browser_missing
@needs_minilm
def test_rollout_view_and_its_controls(browser, page):
    from selenium.webdriver.support.ui import Select

    report, path = page
    _open(browser, path)
    matrices = report.attribution.rollout.matrices
    n = matrices.shape[-1]
    np.testing.assert_allclose(_strip(browser), matrices[5, n - 1], atol=2e-4)  # last token, last layer
    assert _text(browser, "#rollout-status").startswith("[SEP]@12 after layer 5: ")
    Select(browser.find_element("id", "rollout-token")).select_by_visible_text("cat@2")
    np.testing.assert_allclose(_strip(browser), matrices[5, 2], atol=2e-4)
    assert _text(browser, "#rollout-status").startswith("cat@2 after layer 5: ")
    Select(browser.find_element("id", "rollout-layer")).select_by_visible_text("0")
    np.testing.assert_allclose(_strip(browser), matrices[0, 2], atol=2e-4)
    top = int(np.argmax(matrices[0, 2]))
    assert _text(browser, "#rollout-status").startswith(f"cat@2 after layer 0: {report.capture.text.labels[top]}@{top} ")
    browser.find_element("css selector", '#rollout-strip span[data-index="6"]').click()  # a token chooses itself
    assert _text(browser, "#rollout-status").startswith("mat@6 after layer 0: ")
    assert browser.find_element("id", "rollout-token").get_attribute("value") == "6"
    assert _errors(browser) == []


def test_attribution_layers_out_of_range_are_named_as_given(minilm, tmp_path):
    from qkv.inspect import InspectError

    with pytest.raises(InspectError, match=r"^--attribution-layers: expected layers in 0\.\.5 \(6 layers\), got 0-9$"):
        inspect(SENTENCE, loaded=minilm, out=tmp_path, attribution=True, attribution_layers=tuple(range(10)),
                echo=lambda line: None)  # fmt: skip
