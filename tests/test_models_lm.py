"""Tests of the decoder-only language model (``qkv.models.lm``).

Shape legend: ``b`` batch, ``i`` length, ``h`` heads, ``V`` vocabulary size.
"""


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkv.cache import DecoderCache
from qkv.models import CausalLM, LMConfig, sample_next

V = 13


def _lm(dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    config = dict(vocab=V, dim=24, heads=4, layers=2, max_len=16) | overrides
    return CausalLM(LMConfig(**config)).to(dtype).eval()


def test_shapes_and_causal_weights():
    lm = _lm(torch.float32)
    ids = torch.randint(0, V, (3, 7))
    logits, weights = lm(ids, return_weights=True)
    assert logits.shape == (3, 7, V)
    assert len(weights) == 2 and all(w.shape == (3, 4, 7, 7) for w in weights)
    assert torch.all(weights[0].triu(1) == 0)  # no query sees a later token
    torch.testing.assert_close(weights[1].sum(-1), torch.ones(3, 4, 7))
    assert lm.out.weight is lm.embed.embedding.weight  # tied by default


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(positional="sinusoidal", kv_heads=2), dict(positional="rotary", kv_heads=1),
     dict(positional="alibi", norm_first=False), dict(positional="relative", activation="swiglu")],
)  # fmt: skip
def test_cached_step_by_step_logits_equal_the_full_pass(overrides):
    lm = _lm(**overrides)
    ids = torch.randint(0, V, (2, 9))
    full = lm(ids)
    for max_len in (None, 9):
        cache = lm.new_cache(max_len)
        steps = [lm(ids[:, :4], cache=cache)] + [lm(ids[:, t : t + 1], cache=cache) for t in range(4, 9)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_greedy_generation_is_the_same_with_and_without_cache(dtype):
    lm = _lm(dtype, positional="rotary")
    prompt = torch.randint(0, V, (3, 4))
    cached, recomputed = lm.generate(prompt, 10), lm.generate(prompt, 10, use_cache=False)
    assert cached.shape == (3, 14) and torch.equal(cached[:, :4], prompt)
    assert torch.equal(cached, recomputed)
    # greedy means each new token is the argmax of the model's logits on the prefix
    assert torch.equal(lm(cached[:, :-1])[:, 3:].argmax(-1), cached[:, 4:])


def test_sampling_with_and_without_cache_draws_the_same_tokens_from_the_same_generator():
    lm = _lm()
    prompt = torch.randint(0, V, (2, 3))
    a = lm.generate(prompt, 8, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(4))
    b = lm.generate(prompt, 8, temperature=0.8, top_k=5, use_cache=False, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b)


def test_sample_next_follows_temperature_and_top_k():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert sample_next(logits).tolist() == [3]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, temperature=1.0, generator=g) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=4) / 4000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.03, rtol=0)
    # temperature 0.5 squares the probabilities (then renormalises)
    draws = torch.stack([sample_next(logits, temperature=0.5, generator=g) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=4) / 4000
    torch.testing.assert_close(freq, torch.tensor([1.0, 4.0, 9.0, 16.0]) / 30, atol=0.03, rtol=0)
    # top-k keeps only the k most likely tokens, renormalised among themselves
    draws = torch.stack([sample_next(logits, temperature=1.0, top_k=2, generator=g) for _ in range(2000)])
    freq = torch.bincount(draws.flatten(), minlength=4) / 2000
    assert freq[:2].sum() == 0
    assert abs(float(freq[3]) - 4 / 7) < 0.04
    assert sample_next(logits, temperature=2.0, top_k=1, generator=g).tolist() == [3]


def test_overfits_a_tiny_batch():
    # 4 sequences of 10 tokens, 150 Adam steps: each next token is memorised (loss < 0.05 nats,
    # from ln 13 = 2.56 at the start)
    torch.manual_seed(0)
    lm = CausalLM(LMConfig(vocab=V, dim=32, heads=4, layers=2, max_len=16)).train()
    ids = torch.randint(0, V, (4, 10))
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    first = float(lm.loss(ids).detach())
    for _ in range(150):
        opt.zero_grad()
        loss = lm.loss(ids)
        loss.backward()
        opt.step()
    assert first > 2.0 and float(loss.detach()) < 0.05


def test_padding_is_ignored_by_the_loss():
    lm = _lm()
    ids = torch.randint(0, V, (2, 8))
    lengths = torch.tensor([8, 5])
    other = ids.clone()
    other[1, 5:] = (other[1, 5:] + 1) % V  # change only the padding
    with torch.no_grad():
        same = float(lm.loss(ids, lengths=lengths)), float(lm.loss(other, lengths=lengths))
        different = float(lm.loss(ids)), float(lm.loss(other))
    assert same[0] == pytest.approx(same[1], abs=1e-12)
    assert different[0] != pytest.approx(different[1], abs=1e-6)


def test_bad_inputs_raise_clear_errors():
    lm = _lm(torch.float32)
    with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 13\), got values in \[0, 13\]"):
        lm(torch.tensor([[0, 13]]))
    with pytest.raises(ValueError, match=r"ids: expected token ids in \[0, 13\), got values in \[-1, 2\]"):
        lm(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match="ids: expected an integer tensor of token ids, got torch.float32"):
        lm(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"ids: expected shape \(b, length\), got \(3,\)"):
        lm(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="ids: expected at most max_len=16 positions with learned position embeddings, got 17"):
        lm(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"max_new_tokens: prompt length 10 \+ 8 new tokens feeds the model 17 positions "
                                         r"\(every token but the last\), more than max_len=16"):  # fmt: skip
        lm.generate(torch.zeros(1, 10, dtype=torch.long), 8)
    with pytest.raises(ValueError, match=r"prompt: expected at least one token per row .* got shape \(1, 0\)"):
        lm.generate(torch.zeros(1, 0, dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2,\) \(one length per batch row\)"):
        lm(torch.zeros(2, 4, dtype=torch.long), lengths=torch.tensor([4, 4, 4]))
    with pytest.raises(ValueError, match=r"lengths: expected lengths in \[1, 4\] \(the padded length\), got \[4, 5\]"):
        lm(torch.zeros(2, 4, dtype=torch.long), lengths=torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="cache: expected one entry per layer"):
        lm(torch.zeros(2, 4, dtype=torch.long), cache=DecoderCache(5))
    with pytest.raises(ValueError, match="temperature: expected a number >= 0"):
        lm.generate(torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k: expected a positive int, got 0"):
        lm.generate(torch.zeros(1, 2, dtype=torch.long), 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="dim: expected a multiple of heads=4, got dim=30"):
        LMConfig(vocab=5, dim=30)
    with pytest.raises(ValueError, match="positional: expected one of"):
        LMConfig(vocab=5, positional="fourier")
    with pytest.raises(TypeError, match="config: expected an LMConfig, got dict"):
        CausalLM({"vocab": 5})


def test_generated_ids_are_ordinary_tensors_usable_in_training():
    # generate runs under inference mode; its output must still be trainable data
    lm = _lm(torch.float32)
    ids = lm.generate(torch.randint(0, V, (2, 3)), 4)
    assert not ids.is_inference()
    lm.train()
    lm.loss(ids).backward()
    assert lm.embed.embedding.weight.grad is not None


@st.composite
def lm_runs(draw):
    """A random language model and a random split of its input into cache chunks (prefill pieces and single steps)."""
    attention = draw(st.sampled_from(["multi_head", "multi_head", "latent"]))
    positional = draw(st.sampled_from(["none", "learned", "sinusoidal"] if attention == "latent"
                                      else ["none", "learned", "sinusoidal", "rotary", "alibi", "relative"]))  # fmt: skip
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = None if attention == "latent" else draw(st.sampled_from(sorted({1, heads})))
    n = draw(st.integers(1, 12))
    cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=4)))) if n > 1 else []
    config = dict(positional=positional, heads=heads, kv_heads=kv_heads, attention=attention, norm_first=draw(st.booleans()),
                  activation=draw(st.sampled_from(["gelu", "swiglu"])), layers=draw(st.integers(1, 2)))  # fmt: skip
    return config, draw(st.integers(1, 3)), n, cuts, draw(st.sampled_from([None, 12])), draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=lm_runs())
def test_random_models_decode_in_random_chunks_like_the_full_pass(run):
    """Every positional scheme, grouped or latent attention, pre- or post-norm: the cache fed in chunks of any size."""
    config, b, n, cuts, max_len, seed = run
    torch.manual_seed(seed)
    lm = CausalLM(LMConfig(vocab=V, dim=16, max_len=16, **config)).double().eval()
    ids = torch.randint(0, V, (b, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full = lm(ids)
        cache = lm.new_cache(max_len)
        bounds = [0, *cuts, n]
        steps = [lm(ids[:, a:z], cache=cache) for a, z in zip(bounds, bounds[1:])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


def test_learned_positions_suffice_for_every_token_but_the_last_generated():
    """The last generated token is never fed: a prompt of 10 and 7 new tokens reads 16 positions, max_len."""
    lm = _lm(positional="learned")  # max_len 16
    prompt = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(3))
    out = lm.generate(prompt, 7)
    assert out.shape == (2, 17)
    torch.testing.assert_close(out, lm.generate(prompt, 7, use_cache=False))
    by_hand = prompt
    for _ in range(7):
        by_hand = torch.cat((by_hand, lm(by_hand)[:, -1].argmax(-1, keepdim=True)), 1)
    torch.testing.assert_close(out, by_hand)


def test_a_loss_with_no_next_token_to_predict_is_an_error_not_nan():
    lm = _lm()
    with pytest.raises(ValueError, match=r"ids: expected at least 2 tokens per row .* got shape \(2, 1\)"):
        lm.loss(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"lengths: every row holds one token, .* got \[1, 1\]"):
        lm.loss(torch.zeros(2, 4, dtype=torch.long), lengths=torch.tensor([1, 1]))
    assert torch.isfinite(lm.loss(torch.zeros(2, 4, dtype=torch.long), lengths=torch.tensor([1, 3])))
    with pytest.raises(ValueError, match=r"ids: expected at least one batch row \(a loss is a mean over them\), got shape \(0, 4\)"):
        lm.loss(torch.zeros(0, 4, dtype=torch.long))  # no row: the mean was NaN


def test_a_tiny_temperature_samples_the_argmax_and_a_huge_one_stays_finite():
    from qkv.models.sampling import sample_next

    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 4.5]])
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, temperature=1e-300, generator=gen).tolist() == [1, 0]
    assert sample_next(logits, temperature=1e300, generator=gen).shape == (2,)


def test_sample_next_on_a_size_0_dim():
    from qkv.models.sampling import sample_next

    for temperature, top_k in ((0.0, None), (1.0, None), (1.0, 2)):  # no row: no token, as generate gives for b = 0
        assert sample_next(torch.randn(0, 5), temperature=temperature, top_k=top_k).shape == (0,)
        with pytest.raises(ValueError, match=r"logits: expected at least one token per row \(b, V\), got shape \(2, 0\)"):
            sample_next(torch.randn(2, 0), temperature=temperature, top_k=top_k)  # was argmax's IndexError
