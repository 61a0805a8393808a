"""Tests for qkv.models.recommend: target attention (candidate item over the user's history).

Shape legend: ``b`` batch (users), ``j`` history length, ``d`` item embedding size.
"""

import pytest
import torch

from qkv.models.recommend import TargetAttention

ITEMS, CATEGORIES = 21, 4  # id 0 is padding; item k belongs to category (k - 1) % 4


def _category(items):
    return (items - 1) % CATEGORIES


def _clicks(seed, b=64, j=8):
    """Users like two of the four categories; they click a candidate iff it is from one of them."""
    g = torch.Generator().manual_seed(seed)
    liked = torch.stack([torch.randperm(CATEGORIES, generator=g)[:2] for _ in range(b)])  # (b, 2)
    lengths = torch.randint(3, j + 1, (b,), generator=g)
    pick = liked.gather(1, torch.randint(0, 2, (b, j), generator=g))  # a liked category per slot
    history = 1 + pick + CATEGORIES * torch.randint(0, (ITEMS - 1) // CATEGORIES, (b, j), generator=g)
    history = history.masked_fill(torch.arange(j) >= lengths[:, None], 0)
    candidate = 1 + torch.randint(0, ITEMS - 1, (b,), generator=g)
    clicked = (_category(candidate)[:, None] == liked).any(1)
    return candidate, history, clicked


def test_shapes_and_padding_weights():
    model = TargetAttention(ITEMS, dim=6, attention_dim=5, hidden=7)
    candidate, history, _ = _clicks(0, b=5)
    logits, weights = model(candidate, history, return_weights=True)
    assert logits.shape == (5,) and weights.shape == (5, 8)
    assert torch.all(weights[history == 0] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    assert torch.equal(model(candidate, history), logits)


def test_weights_and_interest_by_hand():
    # α = softmax_j vᵀ tanh(W_q e_c + W_k e_j) over real items; u = Σ α e_j.
    model = TargetAttention(ITEMS, dim=6, attention_dim=5, hidden=7).double()
    candidate, history, _ = _clicks(1, b=4)
    logits, weights = model(candidate, history, return_weights=True)
    e_c, e = model.items(candidate), model.items(history)
    score = model.attention.score
    s = torch.tanh((e_c @ score.query_proj.weight.T)[:, None] + e @ score.key_proj.weight.T) @ score.v
    alpha = torch.softmax(s.masked_fill(history == 0, float("-inf")), -1)
    torch.testing.assert_close(weights, alpha)
    u = (alpha[..., None] * e).sum(1)
    torch.testing.assert_close(logits, model.scorer(torch.cat([u, e_c, u * e_c], -1)).squeeze(-1))


def test_padding_changes_nothing_and_empty_history_reads_nothing():
    model = TargetAttention(ITEMS, dim=6, score="dot")
    candidate, history, _ = _clicks(2, b=4)
    logits, weights = model(candidate, history, return_weights=True)
    longer = torch.cat([history, torch.zeros(4, 3, dtype=torch.long)], 1)
    logits2, weights2 = model(candidate, longer, return_weights=True)
    torch.testing.assert_close(logits2, logits)
    torch.testing.assert_close(weights2[:, :8], weights)
    # A user with no history: zero weights, zero interest, the same logit as any other empty user.
    empty = torch.zeros(2, 5, dtype=torch.long)
    logit, w = model(candidate[:2], empty, return_weights=True)
    assert torch.all(w == 0)
    e_c = model.items(candidate[:2])
    zero = torch.zeros_like(e_c)
    torch.testing.assert_close(logit, model.scorer(torch.cat([zero, e_c, zero], -1)).squeeze(-1))


def test_learns_clicks_and_attends_to_the_candidates_category():
    torch.manual_seed(0)
    model = TargetAttention(ITEMS, dim=16, attention_dim=16, hidden=32)
    candidate, history, clicked = _clicks(3, b=512)
    first = model.loss(candidate, history, clicked).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):  # about 1.5 s on one core
        loss = model.loss(candidate, history, clicked)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 0.6 and loss.item() < 0.1, f"loss {first:.3f} -> {loss.item():.3f}"
    # On held-out users, the weight on history items of the candidate's category beats
    # their share of the history (what uniform pooling would give).
    model.eval()
    candidate, history, clicked = _clicks(4, b=512)
    with torch.no_grad():
        logits, weights = model(candidate, history, return_weights=True)
    accuracy = ((logits > 0) == clicked).float().mean()
    same = (_category(history) == _category(candidate)[:, None]) & (history != 0)
    rows = clicked  # only clicked candidates have same-category items in the history
    attended = (weights * same)[rows].sum(-1).mean()
    share = (same.sum(-1) / (history != 0).sum(-1))[rows].mean()
    assert accuracy > 0.8, f"held-out accuracy {accuracy:.2f}"
    assert attended > share + 0.1, f"weight on the candidate's category {attended:.2f} vs share {share:.2f}"


def test_bad_inputs_name_the_argument():
    model = TargetAttention(ITEMS, dim=4)
    candidate, history, clicked = _clicks(5, b=3)
    with pytest.raises(ValueError, match=r"candidate: expected token ids in \[0, 21\), got values in \[21, 21\]"):
        model(torch.full((3,), ITEMS), history)
    with pytest.raises(ValueError, match=r"history: expected token ids in \[0, 21\), got values in \[-2, -2\]"):
        model(candidate, torch.full((3, 4), -2))
    with pytest.raises(ValueError, match=r"history: expected one row per candidate \(b=3\), got 2 \(shape \(2, 8\)\)"):
        model(candidate, history[:2])
    with pytest.raises(ValueError, match=r"candidate: expected shape \(b,\), got \(3, 1\)"):
        model(candidate[:, None], history)
    with pytest.raises(ValueError, match=r"clicked: expected shape \(3,\) like candidate, got \(2,\)"):
        model.loss(candidate, history, clicked[:2])
    with pytest.raises(ValueError, match=r"clicked: expected at least one batch row \(a loss is a mean over them\), got shape \(0,\)"):
        model.loss(candidate[:0], history[:0], clicked[:0])  # no row: the mean was NaN
    logits, weights = model(candidate[:0], history[:0], return_weights=True)  # a batch of 0 is still scored
    assert logits.shape == (0,) and weights.shape == (0, 8)
    with pytest.raises(ValueError, match=r"pad_id: expected an id in \[0, 21\), got 21"):
        TargetAttention(ITEMS, pad_id=ITEMS)
    with pytest.raises(ValueError, match="dim: expected a positive int, got 0"):
        TargetAttention(ITEMS, dim=0)
