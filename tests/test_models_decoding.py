"""Tests for qkv.models.decoding: greedy and beam search.

Shape legend: ``b`` batch, ``k`` beam size, ``t`` generated steps, ``j`` source length,
``c`` vocabulary size. A tiny Markov "model" with a fixed transition table gives answers
that can be found by exhaustive search; the real models check the bookkeeping
(weights and log-probabilities of the returned hypothesis).
"""

import itertools

import pytest
import torch

from qkv.models.decoding import beam_search, greedy
from qkv.models.seq2seq import Bahdanau, Luong, LuongConfig, Seq2SeqConfig

PAD, BOS, EOS = 0, 1, 2


class Markov:
    """p(next | previous token) from a fixed table; the "weights" are a one-hot on the previous token."""

    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def __init__(self, c=5, seed=0, eos_bias=0.0):
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(c, c, generator=g, dtype=torch.float64) * 2
        logits[:, EOS] += eos_bias
        logits[:, [PAD, BOS]] = float("-inf")  # never written, like the real models
        self.table = torch.log_softmax(logits, -1)
        self.c = c

    def start(self, src, src_lengths=None):
        return (src,), (torch.zeros(src.shape[0], dtype=torch.long),)

    def step(self, memory, state, token, position):
        weights = torch.nn.functional.one_hot(token, self.c).to(torch.float64)  # j = c "source positions"
        return self.table[token], (token,), weights

    def log_prob(self, tokens):
        previous = [BOS, *tokens[:-1]]
        return sum(self.table[a, b].item() for a, b in zip(previous, tokens))


def _exhaustive(model, max_len, alpha):
    """Best sequence by log p / length^α over every sequence: eos only at the end, or none at max_len."""
    live = [x for x in range(model.c) if x not in (PAD, BOS, EOS)]
    best, best_rank = None, float("-inf")
    for n in range(max_len + 1):
        for body in itertools.product(live, repeat=n):
            candidates = [list(body) + [EOS]] if n < max_len else [list(body)]
            for tokens in candidates:
                lp = model.log_prob(tokens)
                rank = lp / len(tokens) ** alpha
                if rank > best_rank:
                    best, best_rank = tokens, rank
    return best, model.log_prob(best)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_finds_the_exhaustive_optimum(seed, alpha):
    model = Markov(seed=seed)
    source = torch.zeros(1, 5, dtype=torch.long)
    # 3 live tokens, 4 steps: 81 hypotheses at most, so a beam of 81 keeps every one.
    out = beam_search(model, source, beam_size=81, max_len=4, length_penalty=alpha)
    tokens, log_prob = _exhaustive(model, 4, alpha)
    n = int(out.lengths[0])
    assert out.tokens[0, :n].tolist() == tokens
    assert torch.all(out.tokens[0, n:] == PAD)
    torch.testing.assert_close(out.log_prob[0].item(), log_prob)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_equals_beam_of_one_on_a_markov_model(seed):
    model = Markov(seed=seed)
    source = torch.zeros(3, 5, dtype=torch.long)
    a = greedy(model, src=source, max_len=6)  # src / src_lengths: the transformer's names
    b = beam_search(model, src=source, src_lengths=None, beam_size=1, max_len=6)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    torch.testing.assert_close(a.log_prob, b.log_prob)
    torch.testing.assert_close(a.weights, b.weights)
    # Greedy by hand: follow the argmax of the table.
    token, expected = BOS, []
    for _ in range(6):
        token = int(model.table[token].argmax())
        expected.append(token)
        if token == EOS:
            break
    assert a.tokens[0, : len(expected)].tolist() == expected


def test_eos_ends_a_hypothesis():
    model = Markov(seed=3, eos_bias=3.0)
    source = torch.zeros(2, 5, dtype=torch.long)
    fast = greedy(model, source, max_len=8)
    assert fast.tokens.shape[1] == int(fast.lengths.max()) < 8  # stops once every row has finished
    for out in (fast, beam_search(model, source, beam_size=3, max_len=8)):
        n = int(out.lengths[0])
        assert out.tokens[0, n - 1] == EOS and EOS not in out.tokens[0, : n - 1].tolist()
        assert torch.all(out.tokens[:, n:] == PAD) and torch.all(out.weights[:, n:] == 0)
        torch.testing.assert_close(out.log_prob[0].item(), model.log_prob(out.tokens[0, :n].tolist()))


def test_max_len_without_eos():
    model = Markov(seed=0, eos_bias=-50.0)
    out = beam_search(model, torch.zeros(1, 5, dtype=torch.long), beam_size=2, max_len=3)
    assert out.tokens.shape == (1, 3) and out.lengths.tolist() == [3] and EOS not in out.tokens[0].tolist()


def _models():
    sizes = dict(src_vocab=15, tgt_vocab=9, embed_dim=8, hidden=16, attention_dim=8)
    yield Bahdanau(Seq2SeqConfig(**sizes))
    yield Luong(LuongConfig(**sizes, alignment="local-m", window=2))  # uses the step position
    yield Luong(LuongConfig(**sizes, score="concat", alignment="local-p", input_feeding=False))


def _source(seed, b=4, j=7):
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(3, 15, (b, j), generator=g)
    lengths = torch.tensor([7, 2, 5, 4][:b])
    for n, length in enumerate(lengths.tolist()):
        source[n, length:] = 0
    return source, lengths


@pytest.mark.parametrize("index", range(3))
def test_real_models_greedy_equals_beam_of_one(index):
    torch.manual_seed(index)
    model = list(_models())[index].eval()
    source, lengths = _source(index)
    a = model.greedy(source, lengths, max_len=6)
    b = model.beam_search(source, lengths, beam_size=1, max_len=6)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.log_prob, b.log_prob)
    torch.testing.assert_close(a.weights, b.weights)


@pytest.mark.parametrize("index", range(3))
def test_returned_hypothesis_matches_teacher_forcing(index):
    # The log-probability and weights returned by beam search are those the model gives
    # its own tokens when they are fed back with teacher forcing.
    torch.manual_seed(index)
    model = list(_models())[index].double().eval()
    source, lengths = _source(10 + index)
    out = model.beam_search(source, lengths, beam_size=3, max_len=6, length_penalty=0.5)
    target = torch.cat([torch.full((4, 1), BOS), out.tokens], 1)
    with torch.no_grad():
        torch.testing.assert_close(out.log_prob, model.score_sequences(source, target, lengths))
        _, weights = model(source, target[:, :-1], lengths, return_weights=True)
    for n, length in enumerate(out.lengths.tolist()):
        torch.testing.assert_close(out.weights[n, :length], weights[n, :length])


@pytest.mark.parametrize("index", range(3))
def test_a_batch_of_0_decodes_to_empty_results(index):
    # As the transformers' generate: no row, so every row has finished after the first step. The
    # encoder's packing refused an empty batch, Bahdanau's maxout and the beam's view read -1 of 0.
    model = list(_models())[index].eval()
    source, lengths = _source(index)
    a = model.greedy(source[:0], lengths[:0], max_len=6)
    for b in (model.beam_search(source[:0], lengths[:0], beam_size=3, max_len=6),
              model.beam_search(source[:0], beam_size=2, max_len=6, length_penalty=1.0)):  # fmt: skip
        for field in ("tokens", "weights", "log_prob", "lengths"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.shape == y.shape and x.dtype == y.dtype, field
        assert b.tokens.shape == (0, 1) and b.weights.shape == (0, 1, 7) and b.lengths.shape == b.log_prob.shape == (0,)
    logits, weights = model(source[:0], torch.ones(0, 3, dtype=torch.long), lengths[:0], return_weights=True)
    assert logits.shape == (0, 3, 9) and weights.shape == (0, 3, 7)


def test_beam_is_at_least_as_likely_as_greedy_on_a_trained_model():
    torch.manual_seed(0)
    model = Bahdanau(Seq2SeqConfig(src_vocab=12, tgt_vocab=12, embed_dim=12, hidden=24, attention_dim=12))
    g = torch.Generator().manual_seed(0)
    # Reverse sequences of 3-5 symbols. 20 steps (loss ~2.4 -> ~0.8) leave the model unsure
    # enough that search matters: the beam wins on about half of the rows.
    lengths = torch.randint(3, 6, (32,), generator=g)
    source = torch.zeros(32, 5, dtype=torch.long)
    target = torch.zeros(32, 7, dtype=torch.long)
    for n, length in enumerate(lengths.tolist()):
        symbols = torch.randint(3, 12, (length,), generator=g)
        source[n, :length] = symbols
        target[n, 0], target[n, 1 : length + 1], target[n, length + 1] = BOS, symbols.flip(0), EOS
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        loss = model.loss(source, target, lengths)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    a = model.greedy(source, lengths, max_len=7)
    b = model.beam_search(source, lengths, beam_size=4, max_len=7)
    assert torch.all(b.log_prob >= a.log_prob - 1e-5)
    assert bool((b.log_prob > a.log_prob + 1e-3).any()), "the beam should beat greedy on some row"


def test_bad_arguments():
    model = Markov()
    source = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="beam_size: expected a positive int, got 0"):
        beam_search(model, source, beam_size=0)
    with pytest.raises(ValueError, match="max_len: expected a positive int, got 0"):
        greedy(model, source, max_len=0)
    with pytest.raises(ValueError, match="length_penalty: expected a non-negative number, got -1"):
        beam_search(model, source, length_penalty=-1)
