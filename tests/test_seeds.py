"""The worked examples of the seed texts (``/work/shared/seeds``), as tests.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` query/key
size, ``e`` value size; ``t`` a sequence length where queries and keys are the same tokens.
"""

import math

import numpy as np
import pytest
import torch

import qkv
from qkv import scores

# Seed 002 prints this for its four words (numpy random.seed(42), three randint(3, (3, 3)) draws).
SEED_002_PRINTED = [
    [0.98522025, 1.74174051, 0.75652026],
    [0.90965265, 1.40965265, 0.5],
    [0.99851226, 1.75849334, 0.75998108],
    [0.99560386, 1.90407309, 0.90846923],
]


def _seed_002_matrices():
    words = np.array([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]])
    rng = np.random.RandomState(42)  # the legacy global generator that numpy.random.seed(42) sets up
    w_q, w_k, w_v = (rng.randint(3, size=(3, 3)) for _ in range(3))
    return (torch.tensor(m, dtype=torch.float64) for m in (words, w_q, w_k, w_v))


def test_seed_002_worked_example_through_qkv_attention():
    words, w_q, w_k, w_v = _seed_002_matrices()
    out = qkv.attention(words @ w_q, words @ w_k, words @ w_v)  # scaled dot: softmax(QKᵀ/√3) V
    torch.testing.assert_close(out, torch.tensor(SEED_002_PRINTED, dtype=torch.float64), atol=1e-6, rtol=0)


def test_seed_002_worked_example_through_multi_head_attention():
    words, w_q, w_k, w_v = _seed_002_matrices()
    mha = qkv.MultiHeadAttention(3, 1, bias=False).double()
    with torch.no_grad():  # nn.Linear computes x Wᵀ, the seed computes x W
        mha.q_proj.weight.copy_(w_q.T)
        mha.k_proj.weight.copy_(w_k.T)
        mha.v_proj.weight.copy_(w_v.T)
        mha.out_proj.weight.copy_(torch.eye(3))
    out = mha(words[None])[0]
    torch.testing.assert_close(out, torch.tensor(SEED_002_PRINTED, dtype=torch.float64), atol=1e-6, rtol=0)


def test_seed_001_car_example_is_the_weighted_sum_of_values():
    # Similarities 70/15/10/3/2 % to five cars: the new car's value is Σ α_c V_c.
    alpha = torch.tensor([0.70, 0.15, 0.10, 0.03, 0.02], dtype=torch.float64)
    values = torch.randn(5, 3, dtype=torch.float64)  # (financial, social, resell) per car
    # With a 1-d query 1 and keys log α_c, the dot score's softmax is exactly α.
    q, k = torch.ones(1, 1, dtype=torch.float64), alpha.log()[:, None]
    out, w = qkv.attention(q, k, values, score="dot", return_weights=True)
    torch.testing.assert_close(w[0], alpha)
    expected = 0.70 * values[0] + 0.15 * values[1] + 0.10 * values[2] + 0.03 * values[3] + 0.02 * values[4]
    torch.testing.assert_close(out[0], expected)


def test_seed_004_basic_attention_is_softmax_x_xt_x():
    x = torch.randn(4, 2, dtype=torch.float64)
    expected = torch.stack(
        [sum(math.exp(x[r] @ x[c]) / sum(math.exp(x[r] @ x[n]) for n in range(4)) * x[c] for c in range(4))
         for r in range(4)]
    )  # fmt: skip
    torch.testing.assert_close(qkv.attention(x, x, x, score="dot"), expected)
    torch.testing.assert_close(qkv.Attention("dot")(x[None])[0], expected)  # key and value default to the query


SCORES = {
    "dot": lambda d: scores.Dot(),
    "scaled_dot": lambda d: scores.ScaledDot(),
    "bilinear": lambda d: scores.Bilinear(d),
    "additive": lambda d: scores.Additive(d, d, hidden=6),
}
PERM = torch.tensor([0, 1, 4, 2, 3, 5])


@pytest.mark.parametrize("name", SCORES)
def test_seed_004_self_attention_is_permutation_equivariant_for_every_content_score(name):
    att = qkv.Attention(SCORES[name](3)).double()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    torch.testing.assert_close(att(x[:, PERM]), att(x)[:, PERM])
    # The parts: permuting the queries permutes the output; permuting keys with their values changes nothing.
    q, kv = torch.randn(2, 4, 3, dtype=torch.float64), x
    torch.testing.assert_close(att(q, kv[:, PERM]), att(q, kv))
    torch.testing.assert_close(att(q[:, [2, 0, 3, 1]], kv), att(q, kv)[:, [2, 0, 3, 1]])


def test_location_score_is_positional_not_permutation_equivariant():
    # Luong's location score a = softmax(W_a q) never looks at the keys, only at their slots:
    # permuting the tokens does not permute the output...
    att = qkv.Attention(scores.Location(3, max_len=6)).double()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    assert not torch.allclose(att(x[:, PERM]), att(x)[:, PERM])
    # ...what holds is that the output is unchanged when keys/values and the rows of W_a move together,
    q = torch.randn(2, 4, 3, dtype=torch.float64)
    moved = qkv.Attention(scores.Location(3, max_len=6)).double()
    with torch.no_grad():
        moved.score.proj.weight.copy_(att.score.proj.weight[PERM])
        moved.score.proj.bias.copy_(att.score.proj.bias[PERM])
    torch.testing.assert_close(moved(q, x[:, PERM]), att(q, x))
    # ...and queries are still handled one by one (query permutation equivariance).
    torch.testing.assert_close(att(q[:, [2, 0, 3, 1]], x), att(q, x)[:, [2, 0, 3, 1]])


@pytest.mark.parametrize("name", SCORES)
def test_multi_head_attention_is_permutation_equivariant(name):
    mha = qkv.MultiHeadAttention(12, 3, kv_heads=1, score=SCORES[name](4)).double()
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    torch.testing.assert_close(mha(x[:, PERM]), mha(x)[:, PERM])
    memory = torch.randn(2, 6, 12, dtype=torch.float64)
    torch.testing.assert_close(mha(x, memory[:, PERM]), mha(x, memory))
