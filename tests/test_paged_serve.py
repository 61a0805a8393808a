"""Continuous batching of qkv's causal LM over a paged cache: each request gets the tokens it gets alone."""

import pytest
import torch

import qkv
from qkv.models.lm import CausalLM, LMConfig
from qkv.paged.serve import Request, serve


@pytest.mark.parametrize("positional", ["rotary", "learned", "sinusoidal"])
def test_requests_arriving_and_finishing_at_different_steps_get_their_own_greedy_tokens(positional):
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=50, dim=32, heads=4, kv_heads=2, layers=2, positional=positional, max_len=64)).double().eval()
    gen = torch.Generator().manual_seed(1)
    requests = [
        Request("a", torch.randint(50, (9,), generator=gen), 12),
        Request("b", torch.randint(50, (3,), generator=gen), 4, arrival=2),  # arrives later, finishes first
        Request("c", torch.randint(50, (17,), generator=gen), 7, arrival=2),
        Request("d", torch.randint(50, (1,), generator=gen), 9, arrival=6),
    ]
    cache = qkv.PagedKVCache(64, 4, 2, 8, layers=2, dtype=torch.float64)
    got = serve(model, requests, cache)
    for r in requests:
        want = model.generate(r.prompt[None], r.max_new_tokens)[0]
        assert torch.equal(got[r.name], want), r.name
    assert cache.used_pages == 0  # every request's pages went back


def test_a_small_pool_makes_requests_wait_not_fail():
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=30, dim=16, heads=2, layers=1, positional="rotary")).double().eval()
    prompts = [torch.randint(30, (6,)) for _ in range(4)]
    cache = qkv.PagedKVCache(6, 4, 2, 8, layers=1, dtype=torch.float64)  # room for about two requests at a time
    got = serve(model, [Request(n, p, 5) for n, p in enumerate(prompts)], cache)
    for n, p in enumerate(prompts):
        assert torch.equal(got[n], model.generate(p[None], 5)[0])
    with pytest.raises(ValueError, match="more than the cache"):
        serve(model, [Request("long", torch.randint(30, (40,)), 1)], cache)


@pytest.mark.parametrize("positional", ["none", "learned"])
def test_a_latent_attention_lm_serves_from_paged_latents(positional):
    """A causal LM of multi-head latent attention (DeepSeek-V2) over ``PagedKVCache(..., latent_dim=c)``: one
    latent per token and layer, and each request gets the greedy tokens it gets alone (through ``LatentCache``)."""
    torch.manual_seed(0)
    config = LMConfig(vocab=50, dim=32, heads=4, layers=2, attention="latent", kv_rank=12, rope_dim=4,
                      positional=positional, max_len=64)  # fmt: skip
    model = CausalLM(config).double().eval()
    gen = torch.Generator().manual_seed(1)
    requests = [Request("a", torch.randint(50, (9,), generator=gen), 10),
                Request("b", torch.randint(50, (3,), generator=gen), 4, arrival=2),
                Request("c", torch.randint(50, (14,), generator=gen), 6, arrival=3)]  # fmt: skip
    cache = qkv.PagedKVCache(64, 4, 1, 12 + 4, layers=2, latent_dim=12, dtype=torch.float64)
    got = serve(model, requests, cache)
    for r in requests:
        want = model.generate(r.prompt[None], r.max_new_tokens)[0]
        assert torch.equal(got[r.name], want), r.name
        assert torch.equal(want, model.generate(r.prompt[None], r.max_new_tokens, use_cache=False)[0])
    assert cache.used_pages == 0


def test_latent_attention_config_is_checked():
    with pytest.raises(ValueError, match="positional: latent attention rotates its own rotary part"):
        LMConfig(vocab=10, attention="latent", positional="rotary")
    with pytest.raises(ValueError, match="kv_heads: latent attention shares one latent"):
        LMConfig(vocab=10, attention="latent", positional="none", kv_heads=2)
    with pytest.raises(ValueError, match='kv_rank, rope_dim: they size latent attention; set attention="latent"'):
        LMConfig(vocab=10, kv_rank=8)
    with pytest.raises(ValueError, match=r"attention: expected one of \('multi_head', 'latent'\)"):
        LMConfig(vocab=10, attention="linear")
