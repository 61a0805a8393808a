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


def test_bad_requests_raise_before_anything_runs():
    prompt = torch.tensor([3, 4])
    with pytest.raises(ValueError, match=r"request 'a': prompt: expected shape \(i,\) with at least one token"):
        Request("a", torch.zeros(0, dtype=torch.long), 1)
    with pytest.raises(TypeError, match="request 'a': prompt: expected an integer tensor of token ids, got torch.float32"):
        Request("a", torch.tensor([]), 1)
    with pytest.raises(ValueError, match=r"request 'a': prompt: expected shape \(i,\)"):
        Request("a", prompt[None], 1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="request 'a': max_new_tokens: expected an int >= 1"):
            Request("a", prompt, bad)
    with pytest.raises(ValueError, match="request 'a': arrival: expected an int >= 0, got -1"):
        Request("a", prompt, 1, arrival=-1)


def test_an_error_mid_run_leaves_no_request_holding_pages_and_a_pool_held_by_others_is_an_error_not_a_wait():
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=20, dim=8, heads=2, layers=1, positional="rotary")).double().eval()
    cache = qkv.PagedKVCache(4, 4, 2, 4, layers=1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"request 'x': prompt: expected token ids in \[0, 20\)"):  # before any step
        serve(model, [Request("ok", torch.tensor([1, 2]), 2), Request("x", torch.tensor([1, 2, 99]), 5)], cache)
    assert cache.requests == [] and cache.used_pages == 0
    cache.add("elsewhere")
    cache.reserve("elsewhere", 8)  # two of the four pages, held by a request serve does not run
    with pytest.raises(RuntimeError, match="request 'y' needs 3 pages but only 2 of 4 are free, and no request of this "
                                           r"server is running to free more; the cache's other requests \(\['elsewhere'\]\)"):  # fmt: skip
        serve(model, [Request("y", torch.tensor([1, 2, 3]), 9, arrival=5)], cache)
    assert cache.requests == ["elsewhere"]
    with pytest.raises(ValueError, match=r"requests: \['elsewhere'\] are already in the cache"):
        serve(model, [Request("elsewhere", torch.tensor([1]), 1)], cache)
    cache.free("elsewhere")
    got = serve(model, [Request("y", torch.tensor([1, 2, 3]), 9, arrival=5)], cache)
    assert torch.equal(got["y"], model.generate(torch.tensor([[1, 2, 3]]), 9)[0])
