"""Tests for qkv.models.seq2seq: the Bahdanau and Luong encoder–decoders.

Shape legend: ``b`` batch, ``j`` source length, ``i`` target steps, ``c`` target vocabulary.
"""

import pytest
import torch
import torch.nn.functional as F

from qkv.models.seq2seq import Bahdanau, Luong, LuongConfig, Seq2SeqConfig

SRC_VOCAB, TGT_VOCAB = 19, 13
SIZES = dict(src_vocab=SRC_VOCAB, tgt_vocab=TGT_VOCAB, embed_dim=6, hidden=10, attention_dim=7)
LUONG_VARIANTS = [
    (score, alignment, feeding)
    for score in ("dot", "general", "concat", "location")
    for alignment in ("global", "local-m", "local-p")
    for feeding in (True, False)
]


def _model(kind="bahdanau", score="general", alignment="global", feeding=True, **extra):
    if kind == "bahdanau":
        return Bahdanau(Seq2SeqConfig(**SIZES, **extra))
    config = LuongConfig(
        **SIZES, score=score, alignment=alignment, window=2, input_feeding=feeding, max_src_len=12, **extra
    )
    return Luong(config)


def _data(seed, b=3, j=8, u=6):
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(3, SRC_VOCAB, (b, j), generator=g)
    lengths = torch.tensor([j, 3, 5, 8, 1][:b])
    for n, length in enumerate(lengths.tolist()):
        source[n, length:] = 0
    target = torch.randint(3, TGT_VOCAB, (b, u), generator=g)
    target[:, 0] = 1
    target[:, -1] = 2
    return source, lengths, target


ALL = [("bahdanau", "-", "-", True)] + [("luong", *v) for v in LUONG_VARIANTS]


@pytest.mark.parametrize("kind, score, alignment, feeding", ALL)
def test_teacher_forcing_equals_step_by_step(kind, score, alignment, feeding):
    model = _model(kind, score, alignment, feeding).double()
    source, lengths, target = _data(0)
    logits, weights = model(source, target[:, :-1], lengths, return_weights=True)
    assert logits.shape == (3, 5, TGT_VOCAB) and weights.shape == (3, 5, 8)
    memory, state = model.start(source, lengths)
    for t in range(5):
        log_probs, state, w = model.step(memory, state, target[:, t], t)
        torch.testing.assert_close(log_probs, F.log_softmax(logits[:, t], -1))
        torch.testing.assert_close(w, weights[:, t])
    # Weights are zero on padding, and a global row sums to 1.
    assert torch.all(weights[1, :, 3:] == 0) and torch.all(weights[2, :, 5:] == 0)
    if alignment in ("global", "-"):
        torch.testing.assert_close(weights.sum(-1), torch.ones(3, 5, dtype=torch.float64))


@pytest.mark.parametrize("kind, alignment", [("bahdanau", "-"), ("luong", "global"), ("luong", "local-p")])
def test_extra_padding_changes_nothing(kind, alignment):
    model = _model(kind, alignment=alignment).double()
    source, lengths, target = _data(1)
    logits, weights = model(source, target, lengths, return_weights=True)
    padded = torch.cat([source, torch.zeros(3, 4, dtype=torch.long)], 1)
    logits2, weights2 = model(padded, target, lengths, return_weights=True)
    torch.testing.assert_close(logits2, logits)
    torch.testing.assert_close(weights2[..., :8], weights)
    assert torch.all(weights2[..., 8:] == 0)


def test_bahdanau_queries_with_the_previous_state_luong_with_the_current():
    # Changing the input token at step t moves Luong's weights at step t (h_t has read it)
    # but Bahdanau's only from step t + 1 (α_t is computed from s_{t-1}).
    source, lengths, target = _data(2)
    changed = target.clone()
    changed[:, 2] = torch.where(target[:, 2] == 3, 4, 3)
    for kind, moved_at in (("bahdanau", 3), ("luong", 2)):
        model = _model(kind).double()
        _, w = model(source, target, lengths, return_weights=True)
        _, w2 = model(source, changed, lengths, return_weights=True)
        torch.testing.assert_close(w2[:, :moved_at], w[:, :moved_at])
        assert (w2[:, moved_at] - w[:, moved_at]).abs().max() > 1e-6


def test_bahdanau_first_weights_by_hand():
    # α_1j = softmax_j vᵀ tanh(W_q s_0 + W_k h_j), s_0 = tanh(W_s ←h_1).
    model = _model("bahdanau").double()
    source, lengths, target = _data(3)
    _, weights = model(source, target, lengths, return_weights=True)
    annotations, _ = model.encoder(source, lengths)
    s0 = torch.tanh(model.init_state(annotations[:, 0, 5:]))
    score = model.attention.score
    e = torch.tanh((s0 @ score.query_proj.weight.T)[:, None] + annotations @ score.key_proj.weight.T) @ score.v
    e = e.masked_fill(torch.arange(8) >= lengths[:, None], float("-inf"))
    torch.testing.assert_close(weights[:, 0], torch.softmax(e, -1))


@pytest.mark.parametrize("kind", ["bahdanau", "luong"])
def test_never_writes_padding_or_bos(kind):
    model = _model(kind)
    source, lengths, target = _data(4)
    logits = model(source, target, lengths)
    assert torch.all(logits[..., 0] == float("-inf")) and torch.all(logits[..., 1] == float("-inf"))
    assert torch.isfinite(model.loss(source, target, lengths))


def test_score_sequences_is_the_sum_of_token_log_probs():
    model = _model("luong").double()
    source, lengths, target = _data(5)
    target[0, 3:] = torch.tensor([2, 0, 0])  # row 0 ends early: padding must count 0
    log_probs = F.log_softmax(model(source, target[:, :-1], lengths), -1)
    expected = torch.stack(
        [sum(log_probs[n, t, target[n, t + 1]] for t in range(5) if target[n, t + 1] != 0) for n in range(3)]
    )
    torch.testing.assert_close(model.score_sequences(source, target, lengths), expected)


@pytest.mark.parametrize("kind", ["bahdanau", "luong"])
def test_inputs_take_the_transformer_names(kind):
    # src / tgt / src_lengths as in torch.nn.Transformer and qkv.models.transformer; by keyword
    # they must give exactly what the positional calls give.
    model = _model(kind).double().eval()
    source, lengths, target = _data(8)
    torch.testing.assert_close(
        model(src=source, tgt=target[:, :-1], src_lengths=lengths), model(source, target[:, :-1], lengths)
    )
    for method in (model.loss, model.score_sequences):
        torch.testing.assert_close(method(src=source, tgt=target, src_lengths=lengths), method(source, target, lengths))
    (annotations, kept), _ = model.start(src=source, src_lengths=lengths)
    assert torch.equal(kept, lengths) and annotations.shape[:2] == source.shape
    a, b = model.greedy(src=source, src_lengths=lengths, max_len=4), model.greedy(source, lengths, max_len=4)
    assert torch.equal(a.tokens, b.tokens)
    a = model.beam_search(src=source, src_lengths=lengths, beam_size=2, max_len=4)
    assert torch.equal(a.tokens, model.beam_search(source, lengths, beam_size=2, max_len=4).tokens)


def _copy_task(seed, b=8):
    """Reverse a short sequence of symbols: learnable only by attending to the right source position."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 7, (b,), generator=g)
    source = torch.zeros(b, 6, dtype=torch.long)
    target = torch.zeros(b, 8, dtype=torch.long)
    for n, length in enumerate(lengths.tolist()):
        symbols = torch.randint(3, TGT_VOCAB, (length,), generator=g)
        source[n, :length] = symbols
        target[n, 0], target[n, 1 : length + 1], target[n, length + 1] = 1, symbols.flip(0), 2
    return source, lengths, target


@pytest.mark.parametrize("kind, alignment", [("bahdanau", "-"), ("luong", "global"), ("luong", "local-p")])
def test_overfits_a_tiny_batch(kind, alignment):
    # 80 Adam steps on 16 reversal examples: about 3 s on one CPU core (loss reaches ~0.005).
    torch.manual_seed(0)
    sizes = {**SIZES, "embed_dim": 16, "hidden": 32, "attention_dim": 16}
    if kind == "bahdanau":
        model = Bahdanau(Seq2SeqConfig(**sizes))
    else:
        model = Luong(LuongConfig(**sizes, alignment=alignment, window=3))
    source, lengths, target = _copy_task(0, b=16)
    first = model.loss(source, target, lengths).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss = model.loss(source, target, lengths)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 2.0 and loss.item() < 0.05, f"loss {first:.3f} -> {loss.item():.3f} after 80 steps"
    decoded = model.eval().greedy(source, lengths, max_len=8)
    assert torch.equal(decoded.tokens[:, : target.shape[1] - 1], target[:, 1:])


def test_bad_inputs_name_the_argument():
    model = _model("bahdanau")
    source, lengths, target = _data(6)
    with pytest.raises(ValueError, match=r"src: expected token ids in \[0, 19\), got values in \[0, 19\]"):
        bad = source.clone()
        bad[0, 0] = SRC_VOCAB
        model(bad, target, lengths)
    with pytest.raises(ValueError, match=r"tgt: expected token ids in \[0, 13\), got values in \[-1, 12\]"):
        model.loss(source, target.masked_fill(target == 4, -1), lengths)
    with pytest.raises(ValueError, match=r"tgt: expected token ids in \[0, 13\), got values in \[13, 13\]"):
        model(source, torch.full((3, 2), 13), lengths)
    with pytest.raises(ValueError, match=r"tgt: expected the batch size of src \(3\), got 2 \(shape \(2, 6\)\)"):
        model.loss(source, target[:2], lengths)
    with pytest.raises(ValueError, match=r"tgt: expected the batch size of src \(3\), got 4"):
        model(source, torch.ones(4, 2, dtype=torch.long), lengths)
    with pytest.raises(ValueError, match=r"src_lengths: expected shape \(3,\)"):
        model(source, target, lengths[:2])
    with pytest.raises(ValueError, match=r"tgt: expected at least bos and one token per row, got shape \(3, 1\)"):
        model.loss(source, target[:, :1], lengths)
    with pytest.raises(ValueError, match=r"tgt: expected at least one batch row \(a loss is a mean over them\), got shape \(0, 6\)"):
        model.loss(source[:0], target[:0], lengths[:0])  # no row: the mean was NaN


@pytest.mark.parametrize("kind, score, alignment, feeding", ALL)
def test_an_empty_target_gives_empty_logits_and_weights(kind, score, alignment, feeding):
    # No decoder step: torch.stack got an empty list (nn.GRU a length of 0 without input feeding).
    model = _model(kind, score, alignment, feeding)
    source, lengths, target = _data(9)
    logits, weights = model(source, target[:, :0], lengths, return_weights=True)
    assert logits.shape == (3, 0, TGT_VOCAB) and weights.shape == (3, 0, 8)
    logits.sum().backward()  # still in the graph, as a step's logits are
    # a target of bos alone has no token to score: each row's log-probability is the empty sum
    assert torch.equal(model.score_sequences(source, target[:, :1], lengths), torch.zeros(3))


@pytest.mark.parametrize("kind", ["bahdanau", "luong"])
def test_an_empty_source_is_refused_as_src(kind):
    # It was refused as src_lengths' "[1, 0]", a range nobody passed (the lengths default to j = 0).
    model = _model(kind)
    empty = torch.ones(2, 0, dtype=torch.long)
    message = r"src: expected at least one token per row \(the decoder starts from its encoding\), got shape \(2, 0\)"
    for call in (lambda: model(empty, torch.ones(2, 3, dtype=torch.long)), lambda: model.greedy(empty),
                 lambda: model.beam_search(empty, torch.zeros(2, dtype=torch.long))):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()


def test_location_score_rejects_a_source_over_its_maximum():
    model = _model("luong", score="location")  # max_src_len=12
    source = torch.ones(2, 13, dtype=torch.long)
    with pytest.raises(ValueError, match="src: the location score was built for max_src_len=12, got a source of length 13"):
        model(source, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="src: the location score was built for max_src_len=12"):
        model.greedy(source)
    assert model(source[:, :12], torch.ones(2, 3, dtype=torch.long)).shape == (2, 3, TGT_VOCAB)


def test_bad_configs():
    with pytest.raises(ValueError, match="hidden: expected an even size"):
        Seq2SeqConfig(5, 5, hidden=9)
    with pytest.raises(ValueError, match="tgt_vocab: expected a positive int, got 0"):
        Seq2SeqConfig(5, 0)
    with pytest.raises(ValueError, match=r"eos_id: expected an id in \[0, 5\), got 7"):
        Seq2SeqConfig(5, 5, eos_id=7)
    with pytest.raises(ValueError, match=r"score: expected one of \('dot', 'scaled_dot', 'general', .*'location'\) \(Luong's four .*got 'cosine'"):
        LuongConfig(5, 5, score="cosine")
    with pytest.raises(ValueError, match="alignment: expected one of"):
        LuongConfig(5, 5, alignment="local")
    with pytest.raises(ValueError, match="max_src_len: expected a positive int, got None"):
        LuongConfig(5, 5, score="location")
    with pytest.raises(TypeError, match="config: expected a LuongConfig, got Seq2SeqConfig"):
        Luong(Seq2SeqConfig(5, 5))
    with pytest.raises(TypeError, match="config: expected a Seq2SeqConfig, got dict"):
        Bahdanau({"src_vocab": 5})


@pytest.mark.parametrize("kind", ["bahdanau", "luong"])
def test_dropout_only_in_training_and_stacked_encoder(kind):
    model = _model(kind, dropout=0.3, encoder_layers=2)
    source, lengths, target = _data(7)
    a, b = model(source, target, lengths), model(source, target, lengths)
    assert not torch.equal(a, b)  # training mode: dropout draws differ
    model.eval()
    a, b = model(source, target, lengths), model(source, target, lengths)
    assert torch.equal(a, b) and a.shape == (3, 6, TGT_VOCAB)
