"""Tests of the encoder–decoder transformer (``qkv.models.transformer``).

Shape legend: ``b`` batch, ``s`` source length, ``i`` target length, ``h`` heads, ``V``
target vocabulary size.
"""

import pytest
import torch

from qkv.cache import DecoderCache
from qkv.models import Transformer, TransformerConfig

SRC, TGT = 11, 9


def _model(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    config = dict(src_vocab=SRC, tgt_vocab=TGT, dim=24, heads=4, max_len=12) | overrides
    return Transformer(TransformerConfig(**config)).to(dtype).eval()


def test_shapes_and_weights_of_every_layer():
    model = _model(torch.float32, encoder_layers=3)
    src, tgt = torch.randint(0, SRC, (2, 6)), torch.randint(0, TGT, (2, 4))
    logits, w = model(src, tgt, src_lengths=torch.tensor([6, 4]), return_weights=True)
    assert logits.shape == (2, 4, TGT)
    assert [x.shape for x in w["encoder"]] == [(2, 4, 6, 6)] * 3
    assert [x.shape for x in w["decoder_self"]] == [(2, 4, 4, 4)] * 2
    assert [x.shape for x in w["decoder_cross"]] == [(2, 4, 4, 6)] * 2
    assert torch.all(w["decoder_cross"][0][1, :, :, 4:] == 0)  # padded source tokens get no weight
    assert torch.all(w["encoder"][2][1, :, :, 4:] == 0)
    assert torch.all(w["decoder_self"][1].triu(1) == 0)


def test_padding_does_not_change_the_output():
    model = _model()
    src, tgt = torch.randint(0, SRC, (2, 6)), torch.randint(0, TGT, (2, 4))
    lengths = torch.tensor([6, 3])
    other = src.clone()
    other[1, 3:] = (other[1, 3:] + 1) % SRC
    torch.testing.assert_close(model(src, tgt, src_lengths=lengths), model(other, tgt, src_lengths=lengths),
                               rtol=0, atol=1e-12)  # fmt: skip
    assert not torch.allclose(model(src, tgt), model(other, tgt))


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rotary", "alibi", "relative"])
def test_cached_decoding_equals_the_full_decoder(positional):
    model = _model(positional=positional, kv_heads=2)
    src, tgt = torch.randint(0, SRC, (2, 7)), torch.randint(0, TGT, (2, 6))
    src_lengths = torch.tensor([7, 5])
    memory = model.encode(src, src_lengths=src_lengths)
    full = model.decode(tgt, memory, src_lengths=src_lengths)
    cache = DecoderCache(2)
    steps = [model.decode(tgt[:, :2], memory, src_lengths=src_lengths, cache=cache)]
    steps += [model.decode(tgt[:, t : t + 1], None, src_lengths=src_lengths, cache=cache) for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_generation_is_the_same_with_and_without_cache(dtype):
    model = _model(dtype)
    src = torch.randint(0, SRC, (3, 5))
    cached = model.generate(src, bos_id=0, max_new_tokens=8)
    assert cached.shape == (3, 9) and torch.all(cached[:, 0] == 0)
    assert torch.equal(cached, model.generate(src, bos_id=0, max_new_tokens=8, use_cache=False))
    assert torch.equal(model(src, cached[:, :-1]).argmax(-1), cached[:, 1:])  # each token is the argmax


def test_rows_stay_at_eos_and_generation_stops_when_all_rows_end():
    model = _model()
    src = torch.randint(0, SRC, (4, 5))
    free = model.generate(src, bos_id=0, max_new_tokens=6)
    eos = int(free[0, 2])  # a token row 0 emits at step 2
    out = model.generate(src, bos_id=0, max_new_tokens=6, eos_id=eos)
    for row in out:
        hits = (row[1:] == eos).nonzero()
        if len(hits):
            assert torch.all(row[1 + int(hits[0]) :] == eos)
    assert out.shape[1] <= 7 and torch.equal(out[0, :3], free[0, :3])


def test_overfits_a_tiny_reversal_task():
    # 6 source sequences of 5 tokens; the target is the reverse, after a BOS token (id 0).
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=SRC, tgt_vocab=SRC, dim=32, heads=4, max_len=8))
    src = torch.randint(1, SRC, (6, 5))
    tgt = torch.cat((torch.zeros(6, 1, dtype=torch.long), src.flip(1)), dim=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        opt.zero_grad()
        logits = model(src, tgt[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.05  # from ln 11 = 2.4
    model.eval()
    assert torch.equal(model.generate(src, bos_id=0, max_new_tokens=5), tgt)


def _filled_cache(model, src, n):
    cache = DecoderCache(model.config.decoder_layers)
    model.decode(torch.zeros(src.shape[0], n, dtype=torch.long), model.encode(src), cache=cache)
    return cache


def test_bad_inputs_raise_clear_errors():
    model = _model(torch.float32, positional="learned")
    src, tgt = torch.randint(0, SRC, (2, 6)), torch.randint(0, TGT, (2, 4))
    with pytest.raises(ValueError, match=r"batch: expected the same batch size for every input, got src 2, tgt 3"):
        model(src, torch.randint(0, TGT, (3, 4)))
    with pytest.raises(ValueError, match=r"tgt: expected token ids in \[0, 9\), got values in \[0, 9\]"):
        model(src, torch.tensor([[0, 9], [1, 2]]))
    with pytest.raises(ValueError, match=r"src: expected at most max_len=12 positions with learned position embeddings, got 13"):
        model(torch.zeros(2, 13, dtype=torch.long), tgt)
    with pytest.raises(ValueError, match=r"src_lengths: expected shape \(2,\) \(one length per batch row\)"):
        model(src, tgt, src_lengths=torch.tensor([3]))
    with pytest.raises(TypeError, match="src: expected a LongTensor of token ids"):
        model([[1, 2]], tgt)
    with pytest.raises(ValueError, match=r"bos_id: expected a token id in \[0, 9\), got 9"):
        model.generate(src, bos_id=9, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"max_new_tokens: BOS \+ 13 new tokens feeds the decoder 13 positions"):
        model.generate(src, bos_id=0, max_new_tokens=13)
    with pytest.raises(ValueError, match=r"tgt: expected at most max_len=12 positions .* got 13 \(length 1 after 12 cached\)"):
        model.decode(tgt[:, :1], model.encode(src), cache=_filled_cache(model, src, 12))
    with pytest.raises(ValueError, match="tgt_lengths: target padding is not supported with a cache"):
        model.decode(tgt, model.encode(src), tgt_lengths=torch.tensor([4, 2]), cache=DecoderCache(2))
    with pytest.raises(ValueError, match="encoder_layers: expected a positive int, got 0"):
        TransformerConfig(src_vocab=3, tgt_vocab=3, encoder_layers=0)
    with pytest.raises(ValueError, match="activation: expected one of"):
        TransformerConfig(src_vocab=3, tgt_vocab=3, activation="tanh")


def test_learned_positions_suffice_for_bos_and_every_token_but_the_last_generated():
    model = _model(positional="learned")
    src = torch.randint(1, 9, (2, 5), generator=torch.Generator().manual_seed(4))
    n = model.config.max_len  # BOS and n - 1 generated tokens are fed: n positions
    out = model.generate(src, bos_id=0, max_new_tokens=n)
    torch.testing.assert_close(out, model.generate(src, bos_id=0, max_new_tokens=n, use_cache=False))
