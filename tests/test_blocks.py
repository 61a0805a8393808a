"""Tests of the transformer blocks (``qkv.blocks``) and of positions plumbed through them.

Shape legend: ``b`` batch, ``h`` heads, ``i`` target length, ``j`` key length, ``s`` memory
length, ``dim`` model size.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv
from qkv.blocks import Decoder, Encoder, TransformerDecoderLayer, TransformerEncoderLayer
from qkv.feed_forward import FeedForward
from qkv.cache import DecoderCache
from qkv.positional import ALiBi, RelativePositionBias, alibi_slopes, relative_buckets

DIM, HEADS = 12, 3


def _copy_torch_layer(ours, theirs):
    """Load a torch.nn.Transformer{Encoder,Decoder}Layer's weights into ours."""
    with torch.no_grad():
        ours.self_attn.load_state_dict(qkv.MultiHeadAttention.from_torch(theirs.self_attn).state_dict())
        if hasattr(theirs, "multihead_attn"):
            ours.cross_attn.load_state_dict(qkv.MultiHeadAttention.from_torch(theirs.multihead_attn).state_dict())
            ours.norm3.load_state_dict(theirs.norm3.state_dict())
        ours.ff.w_in.load_state_dict(theirs.linear1.state_dict())
        ours.ff.w_out.load_state_dict(theirs.linear2.state_dict())
        ours.norm1.load_state_dict(theirs.norm1.state_dict())
        ours.norm2.load_state_dict(theirs.norm2.state_dict())


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_is_w2_act_w1(activation):
    ff = FeedForward(6, 10, activation=activation).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    act = F.relu if activation == "relu" else F.gelu
    expected = act(x @ ff.w_in.weight.T + ff.w_in.bias) @ ff.w_out.weight.T + ff.w_out.bias
    torch.testing.assert_close(ff(x), expected)


@pytest.mark.parametrize("shape", [(1, 1, 1024), (1, 1, 7), (2, 3, 10), (4, 4096)])
def test_gelu_is_torchs_and_small_inputs_take_torchs_own_kernel(shape, monkeypatch):
    """Small float32 inputs reach F.gelu as a non-contiguous view: PyTorch's own kernel, not oneDNN's."""
    from qkv import feed_forward

    x = torch.randn(*shape, requires_grad=True)
    n = x.numel()
    small = n <= feed_forward.SMALL_GELU and n % 2 == 0
    with torch.backends.mkldnn.flags(enabled=False):
        own = F.gelu(x)  # PyTorch's own kernel
    want = own if small else F.gelu(x)  # oneDNN's and PyTorch's may differ in the last bit
    got = feed_forward.gelu(x)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got, own, rtol=0, atol=2e-6)  # oneDNN approximates erf to about 1e-6
    torch.testing.assert_close(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    seen = []
    monkeypatch.setattr(feed_forward.F, "gelu", lambda a: seen.append(a.is_contiguous()) or torch.zeros_like(a))
    feed_forward.gelu(x)
    assert seen == [not small]


def test_swiglu_is_swish_gate_times_value():
    ff = FeedForward(6, 5, activation="swiglu", bias=False).double()
    x = torch.randn(2, 3, 6, dtype=torch.float64)
    w, v = ff.w_in.weight[:5], ff.w_in.weight[5:]  # gate rows, then value rows
    gate = x @ w.T
    expected = (gate * torch.sigmoid(gate) * (x @ v.T)) @ ff.w_out.weight.T  # Swish_1(z) = z·σ(z)
    torch.testing.assert_close(ff(x), expected)
    assert ff.w_in.weight.shape == (10, 6)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(norm_first, activation):
    theirs = nn.TransformerEncoderLayer(DIM, HEADS, 20, dropout=0.0, activation=activation, batch_first=True,
                                        norm_first=norm_first, dtype=torch.float64).eval()  # fmt: skip
    ours = TransformerEncoderLayer(DIM, HEADS, hidden=20, activation=activation, norm_first=norm_first).double().eval()
    _copy_torch_layer(ours, theirs)
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # torch: True = padding
    expected = theirs(x, src_key_padding_mask=pad)
    got = ours(x, mask=~pad[:, None, None, :])
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1, :3], expected[1, :3])  # torch's fast path zeroes padded rows


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    theirs = nn.TransformerDecoderLayer(DIM, HEADS, 20, dropout=0.0, batch_first=True, norm_first=norm_first,
                                        dtype=torch.float64).eval()  # fmt: skip
    ours = TransformerDecoderLayer(DIM, HEADS, hidden=20, norm_first=norm_first).double().eval()
    _copy_torch_layer(ours, theirs)
    x, memory = torch.randn(2, 4, DIM, dtype=torch.float64), torch.randn(2, 6, DIM, dtype=torch.float64)
    mem_pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(4, dtype=torch.float64)
    expected = theirs(x, memory, tgt_mask=causal, memory_key_padding_mask=mem_pad)
    got, (w_self, w_cross) = ours(x, memory, memory_mask=~mem_pad[:, None, None, :], return_weights=True)
    torch.testing.assert_close(got, expected)
    assert w_self.shape == (2, HEADS, 4, 4) and w_cross.shape == (2, HEADS, 4, 6)
    assert torch.all(w_self.triu(1) == 0)  # causal
    assert torch.all(w_cross[1, :, :, 4:] == 0)  # padding


def test_stacks_return_one_weight_tensor_per_layer_and_prenorm_has_a_final_norm():
    enc = Encoder(3, DIM, HEADS, norm_first=True)
    x = torch.randn(2, 5, DIM)
    y, weights = enc(x, return_weights=True)
    assert len(weights) == 3 and all(w.shape == (2, HEADS, 5, 5) for w in weights)
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(2, HEADS, 5))
    assert isinstance(enc.norm, nn.LayerNorm)
    torch.testing.assert_close(y.mean(-1), torch.zeros(2, 5), atol=1e-5, rtol=0)  # the final norm's output
    assert isinstance(Encoder(1, DIM, HEADS).norm, nn.Identity)
    dec = Decoder(2, DIM, HEADS)
    y, weights = dec(x, torch.randn(2, 7, DIM), return_weights=True)
    assert y.shape == (2, 5, DIM)
    assert [w.shape for w in weights["cross"]] == [(2, HEADS, 5, 7)] * 2 and len(weights["self"]) == 2
    torch.testing.assert_close(enc(x), enc(x, return_weights=True)[0])


class _CountingMechanism(nn.Module):
    """Exact scaled dot-product attention that counts its calls (a stand-in for qkv.approx)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, q, k, v, *, mask=None, causal=False, return_weights=False, bias=None):
        self.calls += 1
        return qkv.attention(q, k, v, mask=mask, causal=causal, bias=bias, return_weights=return_weights)


def test_mechanism_module_is_copied_per_layer_and_factory_called_per_layer():
    torch.manual_seed(3)
    enc = Encoder(2, DIM, HEADS, attention=_CountingMechanism())
    mechs = [layer.self_attn.attention for layer in enc.layers]
    assert mechs[0] is not mechs[1] and all(isinstance(m, _CountingMechanism) for m in mechs)
    x = torch.randn(2, 5, DIM)
    out = enc(x)
    assert [m.calls for m in mechs] == [1, 1]
    # the same mechanism as the default one gives the same output
    torch.manual_seed(3)
    default = Encoder(2, DIM, HEADS)
    torch.testing.assert_close(out, default(x))
    dec = Decoder(2, DIM, HEADS, attention=_CountingMechanism, cross_attention=lambda: qkv.Attention("scaled_dot"))
    assert dec.layers[0].self_attn.attention is not dec.layers[1].self_attn.attention
    assert isinstance(dec.layers[1].cross_attn.attention, qkv.Attention)


def test_an_approximate_mechanism_plugs_into_the_stacks():
    # qkv.approx classes share the mechanism call; a factory gives each layer its own
    from qkv.approx import LinearAttention

    enc = Encoder(2, DIM, HEADS, attention=LinearAttention)
    assert all(isinstance(layer.self_attn.attention, LinearAttention) for layer in enc.layers)
    x = torch.randn(2, 5, DIM, requires_grad=True)
    y, weights = enc(x, causal=True, return_weights=True)
    y.sum().backward()
    assert y.shape == (2, 5, DIM) and torch.isfinite(x.grad).all()
    assert torch.all(weights[0].triu(1) == 0)  # the causal flag reached the mechanism
    exact = Encoder(2, DIM, HEADS)
    exact.load_state_dict(enc.state_dict())
    assert not torch.allclose(exact(x, causal=True), y)  # a different mechanism, a different output


def test_dropout_is_active_in_training_only():
    layer = TransformerEncoderLayer(DIM, HEADS, dropout=0.5)
    x = torch.randn(2, 5, DIM)
    layer.train()
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))


def _heads(mha, x, proj):
    return proj(x).unflatten(-1, (-1, mha.dim_head)).transpose(1, 2)  # (b, i, (h d)) -> (b, h, i, d)


def _attend_with_bias(mha, x, bias, causal):
    """softmax(q kᵀ/√d + bias, causal) v then W^O, written out with a materialised (h, i, j) bias."""
    q, k, v = _heads(mha, x, mha.q_proj), _heads(mha, x, mha.k_proj), _heads(mha, x, mha.v_proj)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    if causal:
        i = x.shape[1]
        logits = logits.masked_fill(~torch.ones(i, i, dtype=torch.bool).tril(), float("-inf"))
    out = torch.softmax(logits, -1) @ v
    return mha.out_proj(out.transpose(1, 2).flatten(-2))


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_through_mha_is_the_papers_linear_penalty(causal):
    # Press et al. 2022: logits q_r·k_c/√d - m_h·|r - c| with m_h = 2^(-8h/H) for H a power of two
    heads, i = 4, 5
    mha = qkv.MultiHeadAttention(16, heads, positional=ALiBi(heads)).double()
    x = torch.randn(2, i, 16, dtype=torch.float64)
    slopes = [2.0 ** (-8.0 * (n + 1) / heads) for n in range(heads)]
    bias = torch.tensor([[[-slopes[n] * abs(r - c) for c in range(i)] for r in range(i)] for n in range(heads)],
                        dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(mha(x, causal=causal), _attend_with_bias(mha, x, bias, causal))
    assert torch.allclose(alibi_slopes(heads).double(), torch.tensor(slopes, dtype=torch.float64))


def test_relative_bias_through_mha_is_the_learned_bucket_table():
    heads, i = 3, 6
    rel = RelativePositionBias(heads, buckets=8, max_distance=16)
    mha = qkv.MultiHeadAttention(12, heads, positional=rel).double()
    x = torch.randn(2, i, 12, dtype=torch.float64)
    relative = torch.arange(i)[None, :] - torch.arange(i)[:, None]  # key - query
    table = rel.embedding.weight.double()  # (buckets, h)
    bias = table[relative_buckets(relative, 8, 16, True)].permute(2, 0, 1)
    torch.testing.assert_close(mha(x), _attend_with_bias(mha, x, bias, False))
    # one bucket per small distance: 0, then +1 and -1 differ and use the upper / lower halves
    assert relative_buckets(torch.tensor([0, 1, -1]), 8, 16, True).tolist() == [0, 5, 1]


@pytest.mark.parametrize("positional", ["alibi", "relative"])
def test_lazy_bias_equals_materialised_bias_in_mha(positional):
    heads = 6
    pos = ALiBi(heads) if positional == "alibi" else RelativePositionBias(heads, bidirectional=False)
    mha = qkv.MultiHeadAttention(18, heads, kv_heads=3, positional=pos).double()
    x = torch.randn(2, 7, 18, dtype=torch.float64)
    lazy = mha(x, causal=True)
    q, k, v = _heads(mha, x, mha.q_proj), _heads(mha, x, mha.k_proj), _heads(mha, x, mha.v_proj)
    dense = qkv.attention(q, k, v, bias=pos.dense(7, 7), causal=True, backend="reference")
    torch.testing.assert_close(lazy, mha.out_proj(dense.transpose(1, 2).flatten(-2)), rtol=0, atol=1e-12)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"activation: expected one of \('relu', 'gelu', 'swiglu'\), got 'tanh'"):
        FeedForward(8, activation="tanh")
    with pytest.raises(TypeError, match="attention: expected a mechanism module or a zero-argument factory, got int"):
        TransformerEncoderLayer(DIM, HEADS, attention=3)
    with pytest.raises(TypeError, match="attention: a callable that is not an nn.Module is taken as a zero-argument factory"):
        TransformerEncoderLayer(DIM, HEADS, attention=lambda q, k, v: q)
    layer = TransformerEncoderLayer(DIM, HEADS)
    with pytest.raises(ValueError, match=r"x: expected shape \(b, i, 12\) \(batch first\), got \(5, 12\)"):
        layer(torch.randn(5, DIM))
    with pytest.raises(TypeError, match="causal: expected a bool, got str"):
        layer(torch.randn(1, 5, DIM), causal="yes")
    dec = Decoder(2, DIM, HEADS)
    with pytest.raises(ValueError, match=r"memory: expected batch size 2 like x, got memory \(3, 4, 12\)"):
        dec(torch.randn(2, 5, DIM), torch.randn(3, 4, DIM))
    with pytest.raises(ValueError, match="memory: expected the encoder output"):
        dec(torch.randn(2, 5, DIM), None)
    with pytest.raises(ValueError, match=r"cache: expected one entry per layer \(2\), got a DecoderCache of 3"):
        dec(torch.randn(2, 5, DIM), torch.randn(2, 4, DIM), cache=DecoderCache(3))
    with pytest.raises(TypeError, match="cache: expected a qkv.cache.DecoderCache, got list"):
        Encoder(2, DIM, HEADS)(torch.randn(2, 5, DIM), cache=[])
    with pytest.raises(ValueError, match="depth: expected a positive int, got 0"):
        Encoder(0, DIM, HEADS)


def test_feed_forward_on_the_onednn_route_matches_float64():
    # 1024 float32 tokens take qkv.projection's convolution route; the float64 twin does not.
    from qkv.projection import uses_convolution

    torch.manual_seed(0)
    ff = FeedForward(16, 24, activation="swiglu")
    x = torch.randn(8, 128, 16)
    assert uses_convolution(x, ff.w_in.weight)
    expected = copy.deepcopy(ff).double()(x.double())
    torch.testing.assert_close(ff(x).double(), expected, atol=1e-5, rtol=1e-4)
    assert set(ff.state_dict()) == {"w_in.weight", "w_in.bias", "w_out.weight", "w_out.bias"}


def test_an_encoder_layer_takes_a_whole_self_attention_module_and_refuses_mha_settings_with_it():
    mla = qkv.MultiHeadLatentAttention(16, 2)
    layer = TransformerEncoderLayer(16, 2, self_attention=mla)
    assert layer.self_attn is mla and layer(torch.randn(2, 5, 16), causal=True).shape == (2, 5, 16)
    with pytest.raises(ValueError, match="self_attention: expected an nn.Module that replaces MultiHeadAttention whole"):
        TransformerEncoderLayer(16, 2, self_attention=mla, kv_heads=1)
    with pytest.raises(ValueError, match="self_attention: expected an nn.Module"):
        TransformerEncoderLayer(16, 2, self_attention=lambda x: x)


def test_feed_forward_names_an_input_of_the_wrong_size_or_dtype():
    # was "mat1 and mat2 shapes cannot be multiplied (6x16 and 32x128)"
    with pytest.raises(ValueError, match=r"x: last dim 16 differs from the layer's dim=32; expected shape \(\.\.\., 32\), "
                                         r"got \(2, 3, 16\)"):  # fmt: skip
        FeedForward(32)(torch.randn(2, 3, 16))
    with pytest.raises(TypeError, match=r"x: dtype torch.float64 differs from the module's parameters \(torch.float32\)"):
        FeedForward(8)(torch.randn(2, 3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x: dtype torch.float64 differs from the module's parameters \(torch.float32\)"):
        TransformerEncoderLayer(8, 2)(torch.randn(2, 3, 8, dtype=torch.float64))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: TransformerEncoderLayer(DIM, HEADS)(x, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         r"TransformerEncoderLayer: src_key_padding_mask= is nn.TransformerEncoderLayer's keyword; qkv's layer takes "
         r"mask=~src_key_padding_mask\[:, None, None, :\] \(qkv: True = may attend; PyTorch's key padding mask: True = ignore\)"),
        (lambda x: TransformerEncoderLayer(DIM, HEADS)(x, src_mask=torch.zeros(5, 5, dtype=torch.bool)),
         r"TransformerEncoderLayer: src_mask= is nn.TransformerEncoderLayer's keyword; qkv's layer takes mask=~src_mask"),
        (lambda x: TransformerEncoderLayer(DIM, HEADS)(x, is_causal=True),
         r"TransformerEncoderLayer: is_causal= is nn.TransformerEncoderLayer's keyword; qkv's layer takes causal="),
        (lambda x: TransformerDecoderLayer(DIM, HEADS)(x, x, tgt_mask=torch.zeros(5, 5, dtype=torch.bool)),
         r"TransformerDecoderLayer: tgt_mask= is nn.TransformerDecoderLayer's keyword; qkv's layer takes mask=~tgt_mask .*"
         r"causal=True by default"),
        (lambda x: TransformerDecoderLayer(DIM, HEADS)(x, x, tgt_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         r"TransformerDecoderLayer: tgt_key_padding_mask= is nn.TransformerDecoderLayer's keyword; qkv's layer takes "
         r"mask=~tgt_key_padding_mask\[:, None, None, :\] \(qkv: True = may attend; PyTorch's key padding mask: True = ignore\)"),
        (lambda x: TransformerDecoderLayer(DIM, HEADS)(x, x, memory_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         r"TransformerDecoderLayer: memory_key_padding_mask= is nn.TransformerDecoderLayer's keyword; qkv's layer takes "
         r"memory_mask=~memory_key_padding_mask\[:, None, None, :\] \(qkv: True = may attend"),
        (lambda x: TransformerDecoderLayer(DIM, HEADS)(x, x, tgt_is_causal=True),
         r"TransformerDecoderLayer: tgt_is_causal= is nn.TransformerDecoderLayer's keyword; qkv's layer takes causal="),
        (lambda x: Encoder(1, DIM, HEADS)(x, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         r"Encoder: src_key_padding_mask= is nn.TransformerEncoder's keyword; qkv's stack takes mask=~src_key_padding_mask"),
        (lambda x: Decoder(1, DIM, HEADS)(x, x, memory_key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
         r"Decoder: memory_key_padding_mask= is nn.TransformerDecoder's keyword; qkv's stack takes memory_mask="),
        (lambda x: TransformerEncoderLayer(DIM, HEADS)(x, masks=None), r"TransformerEncoderLayer\(\) got an unexpected keyword argument 'masks'"),
    ],
)  # fmt: skip
def test_torchs_transformer_keywords_name_qkvs(call, match):
    # nn.TransformerEncoderLayer's src_key_padding_mask= etc. gave a plain "unexpected keyword argument"
    with pytest.raises(TypeError, match=match):
        call(torch.randn(2, 5, DIM))
