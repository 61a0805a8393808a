"""Tests of ``qkv.scores``: each score against its formula written out per element.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``dq``/``dk``
query/key sizes, ``n`` the additive score's hidden size.
"""

import math

import pytest
import reference as ref
import torch

from qkv import scores
from qkv.masks import Tile

I, J, DQ, DK = 3, 4, 5, 6


def _inputs(dq=DQ, dk=DK):
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, I, dq, generator=g, dtype=torch.float64), torch.randn(2, J, dk, generator=g, dtype=torch.float64)


def _literal_logits(fn, q, k, scale=1.0):
    return torch.tensor(
        [[[scale * fn(q[n, r].tolist(), k[n, c].tolist(), c) for c in range(k.shape[1])] for r in range(q.shape[1])]
         for n in range(q.shape[0])],
        dtype=torch.float64,
    )  # fmt: skip


def test_dot_and_scaled_dot():
    q, k = _inputs(DQ, DQ)
    assert torch.allclose(scores.Dot().logits(q, k), _literal_logits(ref.dot, q, k))
    assert torch.allclose(scores.ScaledDot().logits(q, k), _literal_logits(ref.dot, q, k, 1 / math.sqrt(DQ)))
    assert torch.allclose(scores.Dot().logits(q, k, scale=0.5), _literal_logits(ref.dot, q, k, 0.5))


def test_bilinear_is_q_w_k():
    q, k = _inputs()
    s = scores.Bilinear(DQ, DK).double()
    assert torch.allclose(s.logits(q, k), _literal_logits(ref.bilinear(s.weight.detach()), q, k))


@pytest.mark.parametrize("bias", [False, True])
def test_additive_is_v_tanh_wq_q_plus_wk_k(bias):
    q, k = _inputs()
    s = scores.Additive(DQ, DK, hidden=7, bias=bias).double()
    fn = ref.additive(
        s.query_proj.weight.detach(), s.key_proj.weight.detach(), s.v.detach(),
        s.query_proj.bias.detach() if bias else None,
    )  # fmt: skip
    assert torch.allclose(s.logits(q, k), _literal_logits(fn, q, k))


def test_additive_equals_concatenated_form():
    # vᵀ tanh(W [q; k]) with W = [W_q  W_k]: Bahdanau's MLP and Luong's concat are one score.
    q, k = _inputs()
    s = scores.Additive(DQ, DK, hidden=7).double()
    w = torch.cat([s.query_proj.weight, s.key_proj.weight], dim=1)  # (n, dq + dk)
    cat = torch.cat([q[:, :, None, :].expand(-1, -1, J, -1), k[:, None, :, :].expand(-1, I, -1, -1)], dim=-1)
    assert torch.allclose(s.logits(q, k), torch.tanh(cat @ w.T) @ s.v)


def test_location_reads_keys_positions_only():
    q, k = _inputs()
    s = scores.Location(DQ, max_len=6).double()
    fn = ref.location(s.proj.weight.detach(), s.proj.bias.detach())
    assert torch.allclose(s.logits(q, k), _literal_logits(fn, q, k))
    assert torch.equal(s.logits(q, k), s.logits(q, torch.randn_like(k)))  # key contents unused


@pytest.mark.parametrize(
    "make",
    [scores.Dot, scores.ScaledDot, lambda: scores.Bilinear(DQ, DQ), lambda: scores.Additive(DQ, DQ, 7),
     lambda: scores.Location(DQ, 8)],
)  # fmt: skip
def test_pairwise_on_a_tile_equals_slice_of_whole(make):
    s = make().double()
    q, k = _inputs(DQ, DQ)
    qp, kp = s.prepare(q, k)
    whole = s.pairwise(qp, kp, Tile.whole(I, J))
    t = Tile(1, 3, 2, 4, I, J)
    assert torch.allclose(s.pairwise(qp[:, 1:3], kp[:, 2:4], t), whole[:, 1:3, 2:4])
    if s.dot_form:
        assert torch.allclose(whole, qp @ kp.transpose(-1, -2))


def test_make_resolves_names_and_aliases():
    assert isinstance(scores.make("dot"), scores.Dot) and not isinstance(scores.make("dot"), scores.ScaledDot)
    assert isinstance(scores.make("scaled_dot"), scores.ScaledDot)
    for name in ("general", "bilinear"):
        assert isinstance(scores.make(name, 4, 6), scores.Bilinear)
    for name in ("concat", "additive", "mlp"):
        assert isinstance(scores.make(name, 4, hidden=3), scores.Additive)
    assert isinstance(scores.make("location", 4, max_len=9), scores.Location)
    s = scores.Dot()
    assert scores.make(s) is s
    assert scores.ScaledDot().default_scale(16) == 0.25 and scores.Dot().default_scale(16) == 1.0


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: scores.make("cosine"), ValueError, r"score: expected one of \[.*'dot'.*\] or a qkv.scores.Score, got 'cosine'"),
        (lambda: scores.make(3), TypeError, r"score: expected a name or a qkv.scores.Score, got int"),
        (lambda: scores.make("general"), ValueError, r"score: 'general' has learned parameters, so it needs the query size"),
        (lambda: scores.make("location", 4), ValueError, r"max_len: the location score needs the maximum number of keys, got None"),
        (lambda: scores.Bilinear(0), ValueError, r"query_dim: expected a positive int, got 0"),
        (lambda: scores.Additive(4, 4, hidden=-1), ValueError, r"hidden: expected a positive int, got -1"),
        (lambda: scores.Location(4, max_len=0), ValueError, r"max_len: expected a positive int, got 0"),
        (lambda: scores.Dot().logits(torch.ones(3, 4), torch.ones(5, 6)), ValueError,
         r"k: the dot score needs the same size for q and k, expected last dim 4, got 6"),
        (lambda: scores.Bilinear(4, 6).logits(torch.ones(3, 5), torch.ones(5, 6)), ValueError,
         r"q: expected last dim 4 for this score, got 5"),
        (lambda: scores.Additive(4, 6).logits(torch.ones(3, 4), torch.ones(5, 4)), ValueError,
         r"k: expected last dim 6 for this score, got 4"),
        (lambda: scores.Location(4, max_len=3).logits(torch.ones(2, 4), torch.ones(5, 4)), ValueError,
         r"k: the location score was built for at most max_len=3 keys, got j=5"),
    ],
)  # fmt: skip
def test_score_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
