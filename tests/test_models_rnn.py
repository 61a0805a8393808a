"""Tests for qkv.models.rnn: the bidirectional GRU encoder.

Shape legend: ``b`` batch, ``j`` source length, ``d`` annotation size.
"""

import pytest
import torch

from qkv.models.rnn import RNNEncoder

VOCAB, EMBED, HIDDEN = 23, 7, 5


def _batch(generator, b=3, j=6, lengths=(6, 2, 4)):
    source = torch.randint(1, VOCAB, (b, j), generator=generator)
    lengths = torch.tensor(lengths)
    for n, length in enumerate(lengths.tolist()):
        source[n, length:] = 0
    return source, lengths


def test_shapes_and_zero_padding():
    g = torch.Generator().manual_seed(1)
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN, layers=2)
    source, lengths = _batch(g)
    annotations, final = encoder(source, lengths)
    assert annotations.shape == (3, 6, 2 * HIDDEN) and encoder.out_dim == 2 * HIDDEN
    assert final.shape == (2 * 2, 3, HIDDEN)
    for n, length in enumerate(lengths.tolist()):
        assert torch.all(annotations[n, length:] == 0)
        assert torch.all(annotations[n, :length].abs().sum(-1) > 0)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_a_batch_of_0_is_encoded_to_empty_annotations(bidirectional):
    # pack_padded_sequence refuses an empty batch ("Cannot pack empty tensors").
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN, layers=2, bidirectional=bidirectional)
    source, lengths = _batch(torch.Generator().manual_seed(1))
    for given in (lengths[:0], None):
        annotations, final = encoder(source[:0], given)
        assert annotations.shape == (0, 6, encoder.out_dim) and final.shape == (2 * (1 + bidirectional), 0, HIDDEN)


def test_each_row_is_encoded_as_if_alone_and_unpadded():
    # Packing: the backward GRU of a short row starts at its own last token, not at padding.
    g = torch.Generator().manual_seed(2)
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN)
    source, lengths = _batch(g)
    annotations, final = encoder(source, lengths)
    for n, length in enumerate(lengths.tolist()):
        alone, alone_final = encoder(source[n : n + 1, :length])
        torch.testing.assert_close(annotations[n : n + 1, :length], alone)
        torch.testing.assert_close(final[:, n : n + 1], alone_final)
    # The inputs are named src / src_lengths, like the transformer's encoder.
    by_name, by_name_final = encoder(src=source, src_lengths=lengths)
    assert torch.equal(by_name, annotations) and torch.equal(by_name_final, final)


def test_annotation_halves_are_forward_and_backward_gru_runs():
    # h_j = [→h_j; ←h_j]: recompute both halves with the GRU's own weights, one direction at a time.
    g = torch.Generator().manual_seed(3)
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN)
    source = torch.randint(1, VOCAB, (2, 5), generator=g)
    annotations, _ = encoder(source)
    x = encoder.embed(source)
    rnn = encoder.rnn
    forward = torch.nn.GRU(EMBED, HIDDEN, batch_first=True)
    backward = torch.nn.GRU(EMBED, HIDDEN, batch_first=True)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(forward, f"{name}_l0").copy_(getattr(rnn, f"{name}_l0"))
            getattr(backward, f"{name}_l0").copy_(getattr(rnn, f"{name}_l0_reverse"))
    expected_forward, _ = forward(x)
    expected_backward, _ = backward(x.flip(1))
    torch.testing.assert_close(annotations[..., :HIDDEN], expected_forward)
    torch.testing.assert_close(annotations[..., HIDDEN:], expected_backward.flip(1))


def test_unidirectional():
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN, bidirectional=False)
    annotations, final = encoder(torch.ones(2, 4, dtype=torch.long))
    assert annotations.shape == (2, 4, HIDDEN) and final.shape == (1, 2, HIDDEN)


def test_bad_ids():
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN)
    with pytest.raises(ValueError, match=r"src: expected token ids in \[0, 23\), got values in \[0, 23\]"):
        encoder(torch.tensor([[0, 23]]))
    with pytest.raises(ValueError, match=r"src: expected token ids in \[0, 23\), got values in \[-1, 3\]"):
        encoder(torch.tensor([[-1, 3]]))
    with pytest.raises(TypeError, match="src: expected an integer tensor of token ids, got torch.float32"):
        encoder(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"src: expected shape \(b, length\), got \(3,\)"):
        encoder(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"src: expected at least one token per row, got shape \(2, 0\)"):
        encoder(torch.ones(2, 0, dtype=torch.long))


def test_bad_lengths():
    encoder = RNNEncoder(VOCAB, EMBED, HIDDEN)
    source = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"src_lengths: expected shape \(2,\) \(one length per batch row\), got \(3,\)"):
        encoder(source, torch.tensor([4, 4, 4]))
    with pytest.raises(ValueError, match=r"src_lengths: expected lengths in \[1, 4\] \(the padded length\), got \[5, 1\]"):
        encoder(source, torch.tensor([5, 1]))
    with pytest.raises(ValueError, match=r"src_lengths: expected lengths in \[1, 4\]"):
        encoder(source, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="src_lengths: expected an integer tensor, got torch.float32"):
        encoder(source, torch.tensor([4.0, 1.0]))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="hidden: expected a positive int, got 0"):
        RNNEncoder(VOCAB, EMBED, 0)
    with pytest.raises(ValueError, match=r"pad_id: expected an id in \[0, 23\), got 23"):
        RNNEncoder(VOCAB, EMBED, HIDDEN, pad_id=23)
    with pytest.raises(ValueError, match=r"dropout: expected a probability in \[0, 1\), got 1.5"):
        RNNEncoder(VOCAB, EMBED, HIDDEN, dropout=1.5)
