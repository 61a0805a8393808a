"""Tests for qkv.models.luong: global, local-m and local-p alignment (Luong et al. 2015, section 3).

Shape legend: ``b`` batch, ``i`` decoder steps, ``j`` source length, ``dq`` query size,
``d`` annotation size. Expected values are computed here from the formulas and the
modules' raw parameters, not through the code under test.
"""

import math

import pytest
import torch

from qkv.models.luong import LuongAlignment, gaussian_window, monotonic_mask, padding_mask
from qkv.models.seq2seq import Luong, LuongConfig
from qkv.scores import Bilinear, Dot, Location

B, I, J, DQ, D = 3, 4, 9, 6, 5
LENGTHS = torch.tensor([9, 4, 6])


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(B, I, DQ, generator=g, dtype=torch.float64)
    keys = torch.randn(B, J, D, generator=g, dtype=torch.float64)
    return query, keys


def _global_by_hand(module, query, keys, lengths):
    """softmax over real positions of the literal Luong "general" score qᵀ W k."""
    logits = torch.einsum("bip,pq,bjq->bij", query, module.score.weight, keys)
    real = torch.arange(J)[None, None, :] < lengths[:, None, None]
    logits = logits.masked_fill(~real, float("-inf"))
    return torch.softmax(logits, dim=-1)


def test_global_is_softmax_over_real_positions():
    module = LuongAlignment(Bilinear(DQ, D), "global").double()
    query, keys = _inputs(0)
    context, weights = module(query, keys, LENGTHS)
    expected = _global_by_hand(module, query, keys, LENGTHS)
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(context, expected @ keys)
    assert torch.all(weights[1, :, 4:] == 0)


def test_local_p_is_global_times_gaussian_window():
    window = 2
    module = LuongAlignment(Bilinear(DQ, D), "local-p", window=window, query_dim=DQ, predictor_hidden=7).double()
    query, keys = _inputs(1)
    context, weights = module(query, keys, LENGTHS)
    # p_t = S · sigmoid(v_pᵀ tanh(W_p h_t)), S = each row's own source length.
    w_p, v_p = module.predictor.proj.weight, module.predictor.v.weight[0]
    p = LENGTHS[:, None].double() * torch.sigmoid(torch.tanh(query @ w_p.T) @ v_p)  # (b, i)
    s = torch.arange(J, dtype=torch.float64)
    sigma = window / 2
    gauss = torch.exp(-((s - p[..., None]) ** 2) / (2 * sigma**2))
    inside = (s - p[..., None]).abs() <= window
    expected = _global_by_hand(module, query, keys, LENGTHS) * gauss * inside
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(context, expected @ keys)
    assert torch.all(weights[~inside] == 0)
    # p_t lies in [0, S] and the weights sum to at most 1 (they are not renormalised).
    assert torch.all((p >= 0) & (p <= LENGTHS[:, None]))
    assert torch.all(weights.sum(-1) <= 1 + 1e-12)


def test_local_m_attends_only_inside_its_window():
    window = 1
    module = LuongAlignment(Bilinear(DQ, D), "local-m", window=window).double()
    query, keys = _inputs(2)
    first = 3  # the queries are decoder steps 3, 4, 5, 6
    context, weights = module(query, keys, LENGTHS, first_step=first)
    t = torch.arange(first, first + I)[:, None]
    s = torch.arange(J)[None, :]
    inside = ((s - t).abs() <= window)[None] & (s[None] < LENGTHS[:, None, None])  # (b, i, j)
    assert torch.all(weights[~inside] == 0)  # exactly zero, not just small
    # Inside the window: a softmax of the same score restricted to the window.
    logits = torch.einsum("bip,pq,bjq->bij", query, module.score.weight, keys).masked_fill(~inside, float("-inf"))
    expected = torch.nan_to_num(torch.softmax(logits, -1), nan=0.0)  # rows with no key: 0
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(context, expected @ keys)
    # Row 1 has 4 source tokens: step 6's window [5, 7] lies past its end, so nothing is read.
    assert torch.all(weights[1, 3] == 0) and torch.all(context[1, 3] == 0)


def test_window_helpers_closed_form():
    g = gaussian_window(torch.tensor([[2.5]]), 6, 2)[0, 0]
    expected = [0.0] + [math.exp(-(d**2) / 2) for d in (1.5, 0.5, 0.5, 1.5)] + [0.0]
    torch.testing.assert_close(g, torch.tensor(expected))
    assert monotonic_mask(torch.tensor([0, 4]), 6, 1).tolist() == [
        [True, True, False, False, False, False],
        [False, False, False, True, True, True],
    ]
    keep = padding_mask(src_lengths=torch.tensor([2, 3]), j=4)
    assert keep.tolist() == [[[True, True, False, False]], [[True, True, True, False]]]


def test_location_score_in_local_p():
    # The location score looks at the query only; local-p still multiplies in the Gaussian.
    module = LuongAlignment(Location(DQ, max_len=12), "local-p", window=3, query_dim=DQ).double()
    query, keys = _inputs(3)
    _, weights = module(query, keys, src_lengths=LENGTHS)
    logits = (query @ module.score.proj.weight.T + module.score.proj.bias)[..., :J]
    logits = logits.masked_fill(torch.arange(J) >= LENGTHS[:, None, None], float("-inf"))
    p = module.predictor(query, src_lengths=LENGTHS)
    torch.testing.assert_close(weights, torch.softmax(logits, -1) * gaussian_window(p, J, 3))


def test_local_p_position_predictor_learns():
    module = LuongAlignment(Dot(), "local-p", window=2, query_dim=D)
    query, keys = (x.float() for x in _inputs(4))
    query = query[..., :D].detach()
    _, weights = module(query, keys, LENGTHS)
    weights.sum().backward()
    assert module.predictor.proj.weight.grad.abs().sum() > 0
    assert module.predictor.v.weight.grad.abs().sum() > 0


def _model(alignment, window, input_feeding):
    config = LuongConfig(
        src_vocab=17, tgt_vocab=11, embed_dim=6, hidden=8, attention_dim=5,
        score="general", alignment=alignment, window=window, input_feeding=input_feeding,
    )  # fmt: skip
    return Luong(config).double()


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(3, 17, (3, 10), generator=g)
    lengths = torch.tensor([10, 3, 7])
    for n, length in enumerate(lengths.tolist()):
        source[n, length:] = 0
    target = torch.randint(3, 11, (3, 7), generator=g)
    target[:, 0] = 1
    return source, lengths, target


def test_model_local_p_weights_from_the_models_parts():
    model = _model("local-p", 2, input_feeding=False)
    source, lengths, target = _data(5)
    _, weights = model(source, target, lengths, return_weights=True)
    # Recompute by hand: encoder -> h_0 = [→h_S; ←h_1] -> decoder GRU -> formula.
    annotations, final = model.encoder(source, lengths)
    h, _ = model.rnn(model.target_embed(target), torch.cat([final[-2], final[-1]], -1)[None])
    logits = torch.einsum("bip,pq,bjq->bij", h, model.alignment.score.weight, annotations)
    j = source.shape[1]
    logits = logits.masked_fill(torch.arange(j) >= lengths[:, None, None], float("-inf"))
    predictor = model.alignment.predictor
    p = lengths[:, None] * torch.sigmoid(torch.tanh(h @ predictor.proj.weight.T) @ predictor.v.weight[0])
    s = torch.arange(j, dtype=torch.float64)
    window = torch.exp(-((s - p[..., None]) ** 2) / (2 * 1.0**2)) * ((s - p[..., None]).abs() <= 2)
    torch.testing.assert_close(weights, torch.softmax(logits, -1) * window)


def test_model_local_m_weights_outside_window_are_exactly_zero():
    model = _model("local-m", 1, input_feeding=True)
    source, lengths, target = _data(6)
    _, weights = model(source, target, lengths, return_weights=True)
    t = torch.arange(target.shape[1])[:, None]
    s = torch.arange(source.shape[1])[None, :]
    outside = (s < t - 1) | (s > t + 1)
    assert torch.all(weights[:, outside] == 0)
    assert torch.all(weights[:, ~outside].sum(0) > 0)  # and something inside is read
    # Decoding sees the same windows.
    decoded = model.greedy(source, lengths, max_len=6)
    assert torch.all(decoded.weights[:, outside[: decoded.weights.shape[1]]] == 0)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"alignment: expected one of \('global', 'local-m', 'local-p'\), got 'local'"):
        LuongAlignment(Dot(), "local")
    with pytest.raises(ValueError, match="window: expected a positive int, got 0"):
        LuongAlignment(Dot(), "local-m", window=0)
    with pytest.raises(ValueError, match="query_dim: local-p predicts positions from the decoder state"):
        LuongAlignment(Dot(), "local-p")
    with pytest.raises(TypeError, match="score: expected a qkv.scores.Score, got str"):
        LuongAlignment("dot")
