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
