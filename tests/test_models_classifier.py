"""Tests of the classifiers (``qkv.models.classifier``): encoder + pooling, bag of words.

Shape legend: ``b`` batch, ``i`` length, ``h`` heads, ``C`` classes.
"""

import pytest
import torch

from qkv.models import AttentionPooling, BagOfWords, BagOfWordsConfig, ClassifierConfig, EncoderClassifier

V, C = 10, 3


def _clf(pooling, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    config = dict(vocab=V, classes=C, dim=16, heads=2, layers=2, max_len=9, pooling=pooling) | overrides
    return EncoderClassifier(ClassifierConfig(**config)).to(dtype).eval()


@pytest.mark.parametrize("pooling", ["mean", "cls", "attention"])
def test_shapes_weights_and_padding(pooling):
    model = _clf(pooling, pool_heads=2)
    ids = torch.randint(0, V, (2, 6))
    lengths = torch.tensor([6, 4])
    logits, w = model(ids, lengths=lengths, return_weights=True)
    n = 7 if pooling == "cls" else 6
    assert logits.shape == (2, C)
    assert [x.shape for x in w["layers"]] == [(2, 2, n, n)] * 2
    if pooling == "cls":
        assert w["pooling"] is None
    else:
        heads = 2 if pooling == "attention" else 1
        assert w["pooling"].shape == (2, heads, 6)
        torch.testing.assert_close(w["pooling"].sum(-1), torch.ones(2, heads, dtype=torch.float64))
        assert torch.all(w["pooling"][1, :, 4:] == 0)
    other = ids.clone()
    other[1, 4:] = (other[1, 4:] + 1) % V  # padding content must not matter
    torch.testing.assert_close(model(other, lengths=lengths), logits, rtol=0, atol=1e-12)


def test_attention_pooling_is_a_softmax_over_the_learned_query_scores():
    pool = AttentionPooling(8).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    pooled, w = pool(x, return_weights=True)
    q = pool.attn.q_proj(pool.query)[0]  # (1, 8)
    k = pool.attn.k_proj(x)  # (b, i, 8)
    expected = torch.softmax((k @ q.T).squeeze(-1) / 8**0.5, dim=-1)
    torch.testing.assert_close(w[:, 0], expected)
    torch.testing.assert_close(pooled, pool.attn.out_proj(torch.einsum("bi,bie->be", expected, pool.attn.v_proj(x))))


def test_bag_of_words_is_order_blind_and_its_weights_are_uniform():
    torch.manual_seed(0)
    bow = BagOfWords(BagOfWordsConfig(vocab=V, classes=C, dim=8, hidden=8))
    ids = torch.randint(0, V, (3, 6))
    perm = torch.randperm(6)
    torch.testing.assert_close(bow(ids[:, perm]), bow(ids))
    logits, w = bow(ids, lengths=torch.tensor([6, 2, 3]), return_weights=True)
    torch.testing.assert_close(w["pooling"][1, 0], torch.tensor([0.5, 0.5, 0, 0, 0, 0]))
    emb = bow.embedding(ids[1, :2]).mean(0)
    torch.testing.assert_close(logits[1], bow.mlp(emb))
    # the transformer with positions is not order blind
    clf = _clf("mean", torch.float32)
    assert not torch.allclose(clf(ids[:, perm]), clf(ids))


def _order_task():
    """Token 1 before token 2 -> class 1, after -> class 0; the rest is the same bag of filler."""
    ids = torch.tensor([[1, 3, 2, 4], [2, 3, 1, 4], [3, 1, 4, 2], [3, 2, 4, 1], [1, 2, 5, 6], [2, 1, 5, 6]])
    return ids, torch.tensor([1, 0, 1, 0, 1, 0])


@pytest.mark.parametrize("pooling", ["mean", "cls", "attention"])
def test_encoder_classifier_overfits_an_order_task_that_bag_of_words_cannot(pooling):
    torch.manual_seed(0)
    ids, labels = _order_task()
    model = EncoderClassifier(ClassifierConfig(vocab=V, classes=2, dim=32, heads=4, layers=2, pooling=pooling))
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(80):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05  # from ln 2 = 0.69
    # each pair of rows is the same bag with opposite labels: bag of words scores them alike,
    # so its best loss is ln 2
    bow = BagOfWords(BagOfWordsConfig(vocab=V, classes=2, dim=16, hidden=16))
    torch.testing.assert_close(bow(ids[0::2]), bow(ids[1::2]))


def test_bag_of_words_overfits_a_bag_task():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (8, 5))
    labels = torch.randint(0, C, (8,))
    bow = BagOfWords(BagOfWordsConfig(vocab=V, classes=C, dim=16, hidden=32))
    opt = torch.optim.Adam(bow.parameters(), lr=2e-2)
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(bow(ids), labels)
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05


def test_bad_inputs_raise_clear_errors():
    model = _clf("cls", torch.float32, positional="learned")
    with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 10\), got values in \[0, 12\]"):
        model(torch.tensor([[0, 12]]))
    with pytest.raises(ValueError, match=r"ids: expected at most max_len - 1 = 8 tokens \(CLS takes a position\), got 9"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2,\) \(one length per batch row\), got \(1,\)"):
        model(torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([3]))
    with pytest.raises(TypeError, match="lengths: expected an integer tensor, got torch.float32"):
        model(torch.zeros(2, 3, dtype=torch.long), lengths=torch.tensor([3.0, 1.0]))
    with pytest.raises(ValueError, match="pooling: expected one of"):
        ClassifierConfig(vocab=3, classes=2, pooling="max")
    with pytest.raises(ValueError, match="pool_heads: expected a divisor of dim=64, got 5"):
        ClassifierConfig(vocab=3, classes=2, pooling="attention", pool_heads=5)
    with pytest.raises(ValueError, match="classes: expected a positive int, got 0"):
        BagOfWordsConfig(vocab=3, classes=0)
    with pytest.raises(TypeError, match="ids: expected an integer tensor of token ids, got torch.float32"):
        BagOfWords(BagOfWordsConfig(vocab=3, classes=2))(torch.zeros(1, 2))


@pytest.mark.parametrize("model", ["mean", "cls", "attention", "bag"])
def test_empty_rows_are_refused_as_ids_and_a_batch_of_0_is_empty(model):
    # (b, 0) ids gave logits from nothing (the head's bias), where lengths of 0 are refused; with
    # lengths, the message named their range [1, 0] instead of the ids.
    torch.manual_seed(0)
    clf = BagOfWords(BagOfWordsConfig(vocab=V, classes=C)) if model == "bag" else _clf(model, torch.float32)
    message = r"ids: expected at least one token per row \(a class is read from its tokens\), got shape \(2, 0\)"
    for lengths in (None, torch.zeros(2, dtype=torch.long)):
        with pytest.raises(ValueError, match=message):
            clf(torch.zeros(2, 0, dtype=torch.long), lengths=lengths)
    logits, weights = clf(torch.zeros(0, 4, dtype=torch.long), return_weights=True)  # no row: no logits
    assert logits.shape == (0, C) and (weights["pooling"] is None or weights["pooling"].shape[0] == 0)


def test_reach_limits_self_attention_to_the_given_offsets():
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([6, 4])
    for lo, hi in [(1, 2), (0, None), (-1, 1)]:
        model = _clf("mean", reach=(lo, hi), layers=1, positional="relative")
        _, w = model(ids, lengths=lengths, return_weights=True)
        w = w["layers"][0]  # (b, h, i, j)
        offset = torch.arange(6)[None, :] - torch.arange(6)[:, None]  # key - query
        outside = (offset < lo) | (offset > (6 if hi is None else hi))
        assert torch.all(w[:, :, outside] == 0), (lo, hi)
        assert torch.all(w[1, :, :, 4:] == 0)  # padding is still masked
        # a row with at least one key in reach sums to 1; a row with none is all zeros
        sees = (~outside)[None, :, :] & (torch.arange(6) < lengths[:, None, None])  # (b, i, j)
        expected = sees.any(-1).to(w.dtype)[:, None, :].expand(-1, 2, -1)
        torch.testing.assert_close(w.sum(-1)[:, :, :4], expected[:, :, :4])


def test_reach_rightward_rows_ignore_earlier_tokens_and_none_is_all_to_all():
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    other = ids.clone()
    other[:, :2] = (other[:, :2] + 1) % V
    model = _clf("mean", reach=(0, None), layers=1, positional="relative")
    _, w = model(ids, return_weights=True)
    _, w_other = model(other, return_weights=True)
    # one layer: rows 2.. see only tokens 2.., so changing tokens 0 and 1 leaves them alone
    torch.testing.assert_close(w["layers"][0][:, :, 2:], w_other["layers"][0][:, :, 2:], rtol=0, atol=0)
    assert not torch.allclose(w["layers"][0][:, :, :2], w_other["layers"][0][:, :, :2])
    # no limit on either side is the plain encoder
    plain, unbounded = _clf("mean"), _clf("mean", reach=(None, None))
    torch.testing.assert_close(plain(ids), unbounded(ids), rtol=0, atol=0)


@pytest.mark.parametrize("reach", [(2, 1), (0.5, 1), (1,), [0, 1], (True, 2)])
def test_bad_reach_is_refused(reach):
    with pytest.raises(ValueError, match=r"reach: expected None or a pair \(lo, hi\) of ints or None with lo <= hi"):
        ClassifierConfig(vocab=3, classes=2, reach=reach)
