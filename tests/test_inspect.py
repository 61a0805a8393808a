"""End-to-end tests of ``qkv inspect`` (``qkv.inspect.inspect`` and its command line).

A real pretrained model runs on a short sentence: the packaged MiniLM, and SmolLM2 from its
GGUF file. The page's script is tested in a browser in
``tests/test_inspect_page_browser.py``; the parts in their own test files.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from inspect_models import needs_minilm, needs_smollm2, smollm2_folder, tiny_llama  # noqa: E402

from cli_run import fails  # noqa: E402
from qkv.cli import main  # noqa: E402
from qkv.inspect import InspectError, inspect  # noqa: E402
from qkv.inspect.model import load, resolve  # noqa: E402

SENTENCE = "The cat sat on the mat because it was tired."


def _data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    return json.loads(match.group(1))


def _weights(data: dict) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(data["weights"]), dtype="<u2") / 65535
    return raw.reshape(data["layers"], len(data["heads"]), len(data["rows"]), len(data["tokens"]))


@needs_minilm
def test_minilm_sentence(tmp_path, capsys):
    assert main(["inspect", SENTENCE, "--layer", "2", "--head", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "loading all-MiniLM-L6-v2 ..."
    assert out[1] == "all-MiniLM-L6-v2: encoder, 6 layers x 12 heads; 13 tokens"
    table = out[out.index(next(line for line in out if line.lstrip().startswith("layer"))):][:7]
    assert table[0].split() == ["layer", "previous", "token", "[CLS]/[SEP]", "itself"]
    assert [line.split()[0] for line in table[1:]] == ["0", "1", "2", "3", "4", "5"]
    assert all(re.fullmatch(r"\s*\d+(\s+head \d+\s+\d+%){3}", line) for line in table[1:]), table
    assert out[-1] == f"wrote {tmp_path}/index.html, {tmp_path}/layer2_head5.png, {tmp_path}/layer2_heads.png"
    for name in ("layer2_head5.png", "layer2_heads.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    data = _data(page)
    assert (data["layer"], data["head"]) == (2, 5)
    assert data["tokens"][:3] == ["[CLS]", "the", "cat"] and len(data["tokens"]) == 13
    weights = _weights(data)
    assert weights.shape == (6, 12, 13, 13)
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=13 / 65535)
    assert "All weights: 6 layers" in page and "data:image/png;base64," in page


@needs_minilm
def test_rows_and_heads_options(tmp_path, capsys):
    report = inspect(SENTENCE, rows=(1, 3), heads=(0, 5), out=tmp_path, echo=lambda line: None)
    assert report.capture.weights.shape == (6, 2, 2, 13)
    assert (report.layer, report.head) == (0, 0)
    assert any("the 2 rows computed" in line for line in report.lines)
    data = _data((tmp_path / "index.html").read_text(encoding="utf-8"))
    assert data["rows"] == [1, 3] and data["heads"] == [0, 5]
    np.testing.assert_allclose(_weights(data), report.capture.weights, atol=0.5 / 65535 + 1e-9)


@needs_minilm
def test_head_outside_heads_option_is_refused_before_loading(tmp_path):
    with pytest.raises(InspectError, match="^--head: 3 is not among --heads 0,1,2$"):
        inspect(SENTENCE, head=3, heads=(0, 1, 2), model=tmp_path / "never-read", out=tmp_path)


@needs_minilm
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--layer", "6"], r"--layer: expected 0..5 \(6 layers\), got 6"),
        (["--head", "12"], r"--head: expected 0..11 \(12 heads per layer\), got 12"),
        (["--rows", "0,99"], r"--rows: expected values in 0..12 \(13 tokens in the text\), got 99"),
    ],
)
def test_out_of_range_for_the_model(tmp_path, capsys, extra, message):
    line = fails(capsys, ["inspect", SENTENCE, "--out", str(tmp_path), *extra])
    assert re.fullmatch("qkv inspect: error: " + message, line), line
    assert not (tmp_path / "index.html").exists()


def test_errors_found_before_loading_a_model(tmp_path, capsys):
    missing = tmp_path / "nothing-here"
    assert fails(capsys, ["inspect", SENTENCE, "--model", str(missing)]) == (
        f"qkv inspect: error: --model: {missing} does not exist"
    )
    assert fails(capsys, ["inspect", "  "]) == "qkv inspect: error: TEXT: expected some text, got an empty string"
    assert fails(capsys, ["inspect", SENTENCE, "--rows", "x"]) == (
        "qkv inspect: error: argument --rows: expected integers and ranges such as 0,3,5-8, got 'x'"
    )
    assert fails(capsys, ["inspect", SENTENCE, "--layer", "-1"]).startswith("qkv inspect: error: argument --layer")
    assert fails(capsys, ["inspect"]) == "qkv inspect: error: the following arguments are required: TEXT"
    taken = tmp_path / "a-file"
    taken.write_text("")
    assert fails(capsys, ["inspect", SENTENCE, "--out", str(taken)]) == (
        f"qkv inspect: error: --out: {taken} is a file, expected a folder"
    )


@needs_minilm
def test_long_text_on_a_decoder_keeps_a_few_rows(tmp_path):
    loaded = load(resolve(tiny_llama(tmp_path / "tiny")))
    text = " ".join(f"w{k % 50}" for k in range(1000))
    report = inspect(text, loaded=loaded, out=tmp_path / "out", echo=lambda line: None)
    selection = report.capture.selection
    assert selection.automatic and len(selection.rows) == 32 and selection.rows[-1] == 2001
    assert any(line.startswith("long text: weights for 32 of 2002 query rows") for line in report.lines)
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    assert "Only some weights were computed: query rows 32 of 2002" in page
    assert _weights(_data(page)).shape == (2, 6, 32, 2002)


@needs_smollm2
def test_smollm2_from_its_gguf_file(tmp_path, capsys):
    # One run (loading the GGUF file takes 10-20 s): the folder holding the file resolves to
    # the very same load (tests/test_inspect_model.py), so it is not loaded a second time.
    model = smollm2_folder() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve(smollm2_folder()) == resolve(model)
    assert main(["inspect", "The cat sat.", "--model", str(model), "--layer", "29", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "SmolLM2-135M-Instruct.Q4_1: decoder, 30 layers x 9 heads; 4 tokens"
    assert "previous token" in out[3] and "first token" in out[3]  # no BOS: the first token is the anchor
    weights = _weights(_data((tmp_path / "index.html").read_text(encoding="utf-8")))
    assert weights.shape == (30, 9, 4, 4)
    assert np.triu(weights, k=1).max() == 0.0  # causal
    assert (tmp_path / "layer29_head0.png").is_file()
