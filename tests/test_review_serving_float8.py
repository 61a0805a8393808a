"""Review of today's float8 pages and ``qkv.paged.serve.Server``: the bugs found, each pinned.

Shape legend: ``i`` prompt length, ``n`` new tokens, ``g`` KV heads, ``d`` head size, ``P`` page
size.

Oracles: ``model.generate`` on each request alone (greedy), the cache's page counts, and the
float8 numbers themselves (a token already in the pages' float8 is stored as it is, as
FlashInfer's ``append_paged_kv_cache`` copies keys of the cache's dtype).
"""

import pytest
import torch

import qkv
from qkv.models.lm import CausalLM, LMConfig
from qkv.paged.pages import FloatPages
from qkv.paged.serve import Request, Server

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _model() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(LMConfig(vocab=50, dim=32, heads=4, kv_heads=2, layers=2, positional="rotary")).double().eval()


def _prompts(*lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(50, (n,), generator=gen) for n in lengths]


def test_a_request_whose_name_the_cache_took_after_add_stays_queued_and_the_others_get_their_whole_prompt():
    """``add`` checks the cache for the name, but another user of the cache may take it before the step that
    admits the request. The step raised with the request popped from the queue and half admitted (a running
    request with nothing left to generate: the next step raised KeyError and lost every request), and the
    request admitted before it in the same step was later fed its last prompt token alone."""
    model = _model()
    cache = qkv.PagedKVCache(64, 4, 2, 8, layers=2, dtype=torch.float64)
    a, b = _prompts(9, 3)
    server = Server(model, cache)
    server.add(Request("a", a, 4))
    server.add(Request("b", b, 3))
    cache.add("b")  # the cache's other user, after server.add checked the name
    with pytest.raises(ValueError, match="request 'b' is already in the cache"):
        server.step()
    assert [r.name for r in server.waiting] == ["b"] and server.running == ["a"]
    cache.free("b")
    while server.busy:
        server.step()
    for name, prompt, n in (("a", a, 4), ("b", b, 3)):
        assert torch.equal(server.done[name], model.generate(prompt[None], n)[0]), name
    assert cache.requests == [] and cache.used_pages == 0


def test_a_request_still_queued_after_a_failed_admission_can_be_cancelled():
    model = _model()
    cache = qkv.PagedKVCache(64, 4, 2, 8, layers=2, dtype=torch.float64)
    (a,) = _prompts(5)
    server = Server(model, cache)
    server.add(Request("a", a, 2))
    cache.add("a")
    with pytest.raises(ValueError, match="already in the cache"):
        server.step()
    assert server.cancel("a") is None  # it was queued: KeyError on the half-admitted request's _left before
    assert not server.busy and server.step() == {} and cache.requests == ["a"]


@pytest.mark.parametrize("stored", FP8)
@pytest.mark.parametrize("given", FP8)
def test_float8_tokens_are_written_into_float8_pages(stored, given):
    """FlashInfer's ``append_paged_kv_cache`` takes keys and values in the cache's dtype (float8 tokens into
    float8 pages); the write's saturation clamped them first, which PyTorch has no float8 kernel for:
    NotImplementedError ("clamp_scalar_cpu" not implemented for 'Float8_e4m3fn'). Another float8 converts
    as PyTorch converts it (float8_e5m2's beyond float8_e4m3fn's range saturate)."""
    pages = FloatPages(torch.zeros(3, 2, 4, 2, 8, dtype=stored))
    gen = torch.Generator().manual_seed(0)
    k = (100 * torch.randn(2, 2, 8, generator=gen)).to(given)
    v = torch.randn(2, 2, 8, generator=gen).to(given)
    pages.write(torch.tensor([0, 2]), torch.tensor([1, 3]), k, v)
    want_k, want_v = k.to(stored).float(), v.to(stored).float()
    assert torch.equal(pages.keys[[0, 2], [1, 3]].float(), want_k)
    assert torch.equal(pages.values[[0, 2], [1, 3]].float(), want_v)
    assert torch.isfinite(pages.keys.float()).all()


def test_a_paged_kv_cache_of_float8_pages_takes_float8_tokens():
    """``PagedKVCache.write`` of float8 keys and values (quantised by the caller) reads back as those numbers."""
    cache = qkv.PagedKVCache(8, 4, 2, 8, dtype=torch.float8_e4m3fn)
    cache.add("a")
    step = cache.plan({"a": 5})
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(5, 2, 8, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    cache.write(0, step, k, v)
    q = torch.randn(5, 4, 8, generator=gen, dtype=torch.float64)
    out = cache.attend(0, step, q)
    s = torch.einsum("thd,nhd->htn", q, k.double().repeat_interleave(2, 1)) / 8**0.5
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v.double().repeat_interleave(2, 1))
    assert torch.allclose(out, want, atol=1e-12, rtol=0)
