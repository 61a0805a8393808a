"""Tests of the KV caches (``qkv.cache``): incremental decoding equals the full pass.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` new positions, ``j``
keys (cached + new), ``s`` memory length, ``d``/``e`` per-head key/value sizes.
"""

import pytest
import torch

import qkv
from qkv.blocks import Decoder, Encoder
from qkv.cache import DecoderCache, KVCache, LatentCache, StreamingCache
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


# StreamingLLM's cache: the first k tokens and the last w, positions within the cache


def _kept(t: int, sinks: int, window: int) -> list[int]:
    """Tokens held after token ``t`` arrived: all while they fit, then the first ``sinks`` and the last ``window``."""
    if t + 1 <= sinks + window:
        return list(range(t + 1))
    return list(range(sinks)) + list(range(t - window + 1, t + 1))


def _stream(mha, x, cache, prompt):
    steps = [mha(x[:, :prompt], causal=True, cache=cache)]
    steps += [mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(prompt, x.shape[1])]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("sinks, window", [(2, 4), (0, 5), (4, 1)])
def test_streaming_without_positions_is_one_full_pass_with_the_sink_and_window_mask(sinks, window):
    mha = _mha("grouped")
    x = torch.randn(2, 14, mha.dim, dtype=torch.float64)
    got = _stream(mha, x, StreamingCache(sink_tokens=sinks, window=window), prompt=min(5, sinks + window))
    n = x.shape[1]
    # query r sees key c iff c <= r and (c < sinks or c > r - window): the first k keys + the last w
    mask = torch.tensor([[c <= r and (c < sinks or c > r - window or r < sinks + window) for c in range(n)]
                         for r in range(n)])  # fmt: skip
    torch.testing.assert_close(got, mha(x, mask=mask), **TOL)


@pytest.mark.parametrize("kind", ["rotary", "alibi"])
def test_streaming_steps_see_the_kept_tokens_at_their_ranks_in_the_cache(kind):
    # rotary and ALiBi read positions within the cache (the paper's convention): step t is
    # the last row of a full pass over exactly the kept tokens, numbered 0, 1, 2, ...
    mha = _mha(kind)
    x = torch.randn(2, 15, mha.dim, dtype=torch.float64)
    cache = StreamingCache(sink_tokens=2, window=4)
    got = _stream(mha, x, cache, prompt=5)
    for t in range(15):
        torch.testing.assert_close(got[:, t], mha(x[:, _kept(t, 2, 4)], causal=True)[:, -1], **TOL)
    assert cache.length == 6 and cache.seen == 15


def test_streaming_positions_differ_from_positions_in_the_text():
    # guard for the test above: with positions in the original text the sinks would be
    # farther away, and the outputs would differ once tokens are evicted
    mha = _mha("rotary")
    x = torch.randn(1, 9, mha.dim, dtype=torch.float64)
    got = _stream(mha, x, StreamingCache(sink_tokens=2, window=3), prompt=5)
    kept = torch.tensor([c in (0, 1, 6, 7, 8) for c in range(9)])
    text_positions = mha(x, mask=kept[None, :].expand(9, 9) & qkv.masks.causal().dense(9, 9))[:, -1]
    assert not torch.allclose(got[:, -1], text_positions)


def test_streaming_memory_is_bounded_and_chunks_must_fit():
    cache = StreamingCache(sink_tokens=3, window=5)
    k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 6)
    cache.update(k, v)
    full = cache.nbytes
    for _ in range(50):
        keys, values = cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 6))
    assert cache.length == 8 and cache.seen == 58 and cache.nbytes == full
    assert torch.equal(keys[:, :, :3], k[:, :, :3])  # the sinks stay
    with pytest.raises(ValueError, match=r"k: 2 new tokens after 8 cached exceed sink_tokens \+ window = 8"):
        cache.update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 6))
    with pytest.raises(ValueError, match="sink_tokens: expected a non-negative int, got -1"):
        StreamingCache(sink_tokens=-1, window=4)
    with pytest.raises(ValueError, match="window: expected a positive int, got 0"):
        StreamingCache(sink_tokens=4, window=0)
    cache.reset()
    assert cache.length == 0 and cache.seen == 0


def test_decoder_cache_builds_streaming_layers_and_a_language_model_decodes_with_them():
    from qkv.models import CausalLM, LMConfig

    torch.manual_seed(0)
    lm = CausalLM(LMConfig(vocab=11, dim=16, heads=4, layers=2, positional="rotary")).double().eval()
    ids = torch.randint(0, 11, (2, 12))
    # a stream that fits in the cache is decoded exactly like the plain cache
    wide = DecoderCache(2, layer_cache=lambda: StreamingCache(sink_tokens=4, window=8))
    steps = [lm(ids[:, :3], cache=wide)] + [lm(ids[:, t : t + 1], cache=wide) for t in range(3, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), lm(ids), **TOL)
    # a narrow one stays bounded
    narrow = DecoderCache(2, layer_cache=lambda: StreamingCache(sink_tokens=1, window=3))
    for t in range(12):
        lm(ids[:, t : t + 1], cache=narrow)
    assert [c.length for c in narrow.self_attn] == [4, 4]
    with pytest.raises(ValueError, match="max_len: give it to the caches layer_cache builds"):
        DecoderCache(2, max_len=4, layer_cache=KVCache)
    with pytest.raises(TypeError, match="layer_cache: expected a factory of qkv.cache.KVCache, got list"):
        DecoderCache(2, layer_cache=list)
    lm = CausalLM(LMConfig(vocab=20, dim=16, heads=4, layers=2, positional="learned", max_len=8)).eval()
    streaming = DecoderCache(2, layer_cache=lambda: StreamingCache(sink_tokens=2, window=6))
    with pytest.raises(ValueError, match=r"cache: a StreamingCache ranks its keys anew .* learned position embeddings"):
        lm(torch.randint(20, (1, 1)), cache=streaming)  # (each new token was placed one past its rank, then failed)
    shared = KVCache()  # every layer appending to one cache: 2 layers held 6 keys after 3 tokens, silently
    with pytest.raises(ValueError, match="layer_cache: expected a factory that builds a new cache on each call"):
        DecoderCache(2, layer_cache=lambda: shared)


def test_latent_cache_stores_both_parts_in_one_buffer():
    cache = LatentCache(max_len=6)
    c, r = torch.randn(2, 1, 4, 5), torch.randn(2, 1, 4, 2)
    latent, rope = cache.update(c, r)
    assert torch.equal(latent, c) and torch.equal(rope, r) and cache.combined.shape == (2, 1, 4, 7)
    assert cache.nbytes == 2 * 4 * 7 * 4
    with pytest.raises(ValueError, match=r"c_kv: expected latent size 5 like the cached one, got \(2, 1, 1, 6\)"):
        cache.update(torch.randn(2, 1, 1, 6), torch.randn(2, 1, 1, 1))
    with pytest.raises(ValueError, match=r"k_rope: expected \(b, 1, n, ·\), got \(2, 3, 1, 2\)"):
        cache.update(torch.randn(2, 1, 1, 5), torch.randn(2, 3, 1, 2))


@pytest.mark.parametrize("max_len", [None, 8], ids=["growing", "preallocated"])
def test_an_update_of_another_dtype_or_device_is_refused_not_cast(max_len):
    """A preallocated buffer cast float64 keys to float32 silently, where a growing cache promoted them."""
    cache = qkv.KVCache(max_len)
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    x = torch.ones(1, 1, 1, 2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"k: dtype torch.float64 but the cache holds torch.float32; reset\(\) it"):
        cache.update(x, x)
    meta = torch.ones(1, 1, 1, 2, device="meta")
    with pytest.raises(ValueError, match=r"k: on meta but the cache is on cpu; reset\(\) it to move"):
        cache.update(meta, meta)
    cache.reset()
    assert cache.update(x, x)[0].dtype == torch.float64


def test_a_decoder_cache_given_to_one_layer_names_what_to_pass():
    mha = qkv.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=r"cache: expected one layer's cache .* got DecoderCache; a DecoderCache holds one "
                                        r"per layer: pass its self_attn\[layer\]"):  # fmt: skip
        mha(torch.randn(1, 2, 8), cache=qkv.DecoderCache(1))


# Cross-attention: the cache is filled once from the memory and reused (EncoderDecoderCache, fairseq's static_kv)


@pytest.mark.parametrize("max_len", [None, 8], ids=["growing", "preallocated"])
def test_a_cross_attention_cache_is_filled_once_from_the_memory_and_reused(max_len):
    # mha(x, memory, cache=c) at each step appended the memory's K/V again: after 4 steps with a
    # 3-token memory the cache held 12 keys and the weights were (1, h, 1, 12)
    mha = qkv.MultiHeadAttention(16, 8, kv_heads=2).double().eval()
    x, memory = torch.randn(1, 4, 16, dtype=torch.float64), torch.randn(1, 3, 16, dtype=torch.float64)
    full, w_full = mha(x, memory, return_weights=True)
    projected = []  # rows the key projection sees
    mha.k_proj.register_forward_hook(lambda m, inp, out: projected.append(inp[0].shape[1]))
    cache = KVCache(max_len)
    for t in range(4):
        y, w = mha(x[:, t : t + 1], memory, cache=cache, return_weights=True)
        assert w.shape == (1, 8, 1, 3)
        torch.testing.assert_close(y, full[:, t : t + 1], **TOL)
        torch.testing.assert_close(w, w_full[:, :, t : t + 1], **TOL)
    assert cache.length == 3 and cache.from_memory and sum(projected) == 3
    torch.testing.assert_close(cache.keys, mha.k_proj(memory).unflatten(-1, (2, 2)).transpose(1, 2), **TOL)
    cache.reset()  # a new memory: filled again on the next call
    assert not cache.from_memory
    mha(x[:, :1], memory[:, :2], cache=cache)
    assert cache.length == 2


@pytest.mark.parametrize("positional", ["rotary", "alibi"])
def test_a_cross_attention_cache_with_a_positional_answers_as_the_call_without_it(positional):
    """The memory's keys are cut to none once held: rotary then aligned the query to zero keys (position -1) from the
    second step on, 0.06-0.13 away from the same call without a cache."""
    pos = qkv.Rotary(2) if positional == "rotary" else qkv.ALiBi(8)
    mha = qkv.MultiHeadAttention(16, 8, kv_heads=2, positional=pos).double().eval()
    x, memory = torch.randn(2, 4, 16, dtype=torch.float64), torch.randn(2, 5, 16, dtype=torch.float64)
    cache = KVCache()
    for t in range(4):
        torch.testing.assert_close(mha(x[:, t : t + 1], memory, cache=cache), mha(x[:, t : t + 1], memory), **TOL)
    cache.reset()
    torch.testing.assert_close(mha(x[:, :3], memory, cache=cache), mha(x[:, :3], memory), **TOL)
    torch.testing.assert_close(mha(x[:, 1:3], memory, cache=cache), mha(x[:, 1:3], memory), **TOL)


def test_a_cross_attention_cache_refuses_self_attention_keys_and_a_different_memory():
    mha = qkv.MultiHeadAttention(8, 2).eval()
    x, memory = torch.randn(2, 1, 8), torch.randn(2, 3, 8)
    own = KVCache()
    mha(x, cache=own)  # self-attention keys
    with pytest.raises(ValueError, match=r"cache: holds 1 self-attention position; a cross-attention call \(key is not "
                                         r"query\) needs its own KVCache"):  # fmt: skip
        mha(x, memory, cache=own)
    cross = KVCache()
    mha(x, memory, cache=cross)
    with pytest.raises(ValueError, match=r"cache: holds the keys and values of a cross-attention memory \(3 positions\); "
                                         r"self-attention needs a KVCache of its own"):  # fmt: skip
        mha(x, cache=cross)
    with pytest.raises(ValueError, match=r"key: the cache holds the K/V of a memory of batch 2 and length 3, got key "
                                         r"\(2, 5, 8\); .*reset\(\) the cache"):  # fmt: skip
        mha(x, torch.randn(2, 5, 8), cache=cross)
    with pytest.raises(TypeError, match=r"cache: a StreamingCache evicts keys .* cross-attention .* a qkv.KVCache"):
        mha(x, memory, cache=StreamingCache(sink_tokens=1, window=2))
    with pytest.raises(TypeError, match=r"cache: expected one layer's cache .* got DecoderCache; a DecoderCache holds one "
                                        r"per layer: pass its cross\[layer\]"):  # fmt: skip
        mha(x, memory, cache=qkv.DecoderCache(1))


def test_a_latent_cache_given_to_multi_head_attention_names_its_module():
    # it was listed as valid, then failed inside with "c_kv: expected (b, 1, n, ·), got (1, 8, 2, 8)"
    mha = qkv.MultiHeadAttention(64, 8)
    with pytest.raises(TypeError, match=r"cache: a LatentCache holds the latent of qkv.MultiHeadLatentAttention"):
        mha(torch.randn(1, 2, 64), cache=LatentCache())
    with pytest.raises(TypeError, match=r"cache: expected one layer's cache \(qkv.KVCache or StreamingCache\), got list"):
        mha(torch.randn(1, 2, 64), cache=[])


def test_a_decoder_stack_given_the_memory_at_every_step_projects_it_once():
    dec = Decoder(2, 12, 3).double().eval()
    x, memory = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    projected = []
    for layer in dec.layers:
        layer.cross_attn.k_proj.register_forward_hook(lambda m, inp, out: projected.append(inp[0].shape[1]))
    cache = DecoderCache(2)
    steps = [dec(x[:, t : t + 1], memory, cache=cache) for t in range(4)]
    torch.testing.assert_close(torch.cat(steps, 1), dec(x, memory), **TOL)
    assert sum(projected) == 2 * 5 + 2 * 5  # the full pass's 2 layers, and the cached steps' first call only
    assert cache.has_memory and cache.cross[1].length == 5
