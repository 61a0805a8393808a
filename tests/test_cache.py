"""Tests of the KV caches (``qkv.cache``): incremental decoding equals the full pass.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` new positions, ``j``
keys (cached + new), ``s`` memory length, ``d``/``e`` per-head key/value sizes.
"""

import pytest
import torch

import qkv
from qkv.blocks import Decoder, Encoder
from qkv.cache import DecoderCache, KVCache
from qkv.positional import ALiBi, RelativePositionBias, Rotary

TOL = dict(rtol=0, atol=1e-10)


def test_update_appends_and_returns_everything_so_far():
    for max_len in (None, 6):
        cache = KVCache(max_len)
        k1, v1 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 7)
        k2, v2 = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 7)
        cache.update(k1, v1)
        k, v = cache.update(k2, v2)
        assert cache.length == 5
        assert torch.equal(k, torch.cat((k1, k2), 2)) and torch.equal(v, torch.cat((v1, v2), 2))
        cache.reorder(torch.tensor([1, 1]))
        assert torch.equal(cache.keys[0], cache.keys[1])
        cache.reset()
        assert cache.length == 0 and cache.keys is None


def test_preallocated_cache_holds_only_the_kv_heads_and_refuses_overflow():
    cache = KVCache(max_len=8)
    cache.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    assert cache._k.shape == (2, 2, 8, 4)  # g = 2 heads, preallocated to max_len
    with pytest.raises(ValueError, match="k: the cache holds at most max_len=8 positions, got 6 new after 3 cached"):
        cache.update(torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4))
    with pytest.raises(ValueError, match=r"k: expected \(b, g, ·, d\) = \(2, 2, 4\)"):
        cache.update(torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4))
    with pytest.raises(ValueError, match=r"v: expected \(b, g, n\) = \(2, 2, 1\) like k"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 2, 4))
    with pytest.raises(ValueError, match="max_len: expected a positive int, got 0"):
        KVCache(0)


def _mha(kind):
    torch.manual_seed(0)
    h, g, d = 6, 3, 4
    positional = {
        "plain": None,
        "grouped": None,
        "multi_query": None,
        "rotary": Rotary(d, rotary_dim=2),
        "alibi": ALiBi(h),
        "relative": RelativePositionBias(h, buckets=8, max_distance=8, bidirectional=False),
    }[kind]
    kv = {"plain": h, "multi_query": 1}.get(kind, g)
    return qkv.MultiHeadAttention(h * d, h, kv_heads=kv, positional=positional).double().eval()


@pytest.mark.parametrize("kind", ["plain", "grouped", "multi_query", "rotary", "alibi", "relative"])
@pytest.mark.parametrize("max_len", [None, 9])
@pytest.mark.parametrize("step", [1, 2])
def test_mha_cached_decoding_equals_the_full_pass(kind, max_len, step):
    mha = _mha(kind)
    x = torch.randn(2, 9, mha.dim, dtype=torch.float64)
    full = mha(x, causal=True)
    cache = KVCache(max_len)
    # a 3-token prompt, then `step` tokens per call: i < j after the first call
    parts = [mha(x[:, :3], causal=True, cache=cache)]
    parts += [mha(x[:, t : t + step], causal=True, cache=cache) for t in range(3, 9, step)]
    torch.testing.assert_close(torch.cat(parts, 1), full, **TOL)
    assert cache.length == 9 and cache.keys.shape[1] == mha.kv_heads


def test_cache_without_causal_mask_would_differ():
    # guard: the full pass is causal, so forgetting the mask on multi-token steps must show
    mha = _mha("plain")
    x = torch.randn(1, 4, mha.dim, dtype=torch.float64)
    cache = KVCache()
    mha(x[:, :1], cache=cache)
    assert not torch.allclose(mha(x[:, 1:], cache=cache), mha(x, causal=True)[:, 1:])


@pytest.mark.parametrize("positional", [None, "rotary", "alibi"])
def test_decoder_only_stack_cached_equals_full(positional):
    pos = {None: None, "rotary": Rotary(4), "alibi": ALiBi(4)}[positional]
    enc = Encoder(2, 16, 4, kv_heads=2, norm_first=True, positional=pos).double().eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    full = enc(x, causal=True)
    cache = DecoderCache(2, max_len=6)
    steps = [enc(x[:, :2], causal=True, cache=cache)] + [enc(x[:, t : t + 1], causal=True, cache=cache) for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert cache.length == 6


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_cached_equals_full_and_projects_memory_once(norm_first):
    dec = Decoder(2, 12, 3, norm_first=norm_first, positional=Rotary(4)).double().eval()
    x, memory = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(2, 7, 12, dtype=torch.float64)
    memory_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])[:, None, None, :]
    full, w_full = dec(x, memory, memory_mask=memory_mask, return_weights=True)
    projected = []  # rows the cross-attention key projections see
    for layer in dec.layers:
        layer.cross_attn.k_proj.register_forward_hook(lambda m, inp, out: projected.append(inp[0].shape[1]))
    cache = DecoderCache(2)
    steps = [dec(x[:, :1], memory, memory_mask=memory_mask, cache=cache)]
    for t in range(1, 5):
        y, w = dec(x[:, t : t + 1], None, memory_mask=memory_mask, cache=cache, return_weights=True)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    torch.testing.assert_close(w["cross"][1], w_full["cross"][1][:, :, -1:], **TOL)
    torch.testing.assert_close(w["self"][0], w_full["self"][0][:, :, -1:], **TOL)
    assert sum(projected) == 2 * 7  # the memory was projected once per layer, not once per step
    assert cache.has_memory and cache.cross[0].length == 7 and cache.length == 5


def test_growing_cache_works_under_autograd():
    # max_len=None concatenates instead of writing into a buffer, so gradients flow through
    # cached decoding and equal those of the full pass
    mha = _mha("rotary")
    x = torch.randn(2, 5, mha.dim, dtype=torch.float64)
    mha(x, causal=True).square().sum().backward()
    full_grad = mha.k_proj.weight.grad.clone()
    mha.zero_grad()
    cache = KVCache()
    steps = [mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(5)]
    torch.cat(steps, 1).square().sum().backward()
    torch.testing.assert_close(mha.k_proj.weight.grad, full_grad, rtol=0, atol=1e-10)
