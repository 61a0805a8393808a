"""``qkv.paged.serve.Server``: continuous batching a step at a time, as a server's own loop drives it.

Shape legend: ``i`` prompt length, ``n`` new tokens, ``V`` vocabulary. Oracle: ``model.generate``
on each request alone (greedy), and the cache's page counts.
"""

import pytest
import torch

import qkv
from qkv.models.lm import CausalLM, LMConfig
from qkv.paged.serve import Request, Server, serve


def _model(**overrides) -> CausalLM:
    torch.manual_seed(0)
    config = dict(vocab=50, dim=32, heads=4, kv_heads=2, layers=2, positional="rotary") | overrides
    return CausalLM(LMConfig(**config)).double().eval()


def _cache(num_pages=64) -> qkv.PagedKVCache:
    return qkv.PagedKVCache(num_pages, 4, 2, 8, layers=2, dtype=torch.float64)


def _prompts(*lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(50, (n,), generator=gen) for n in lengths]


def test_requests_added_between_steps_stream_the_tokens_each_gets_alone():
    """Requests join at different steps; each step's ``{name: token}`` is the stream, and ``done`` the whole."""
    model, cache = _model(), _cache()
    a, b, c = _prompts(9, 3, 14)
    server = Server(model, cache)
    server.add(Request("a", a, 10))
    streamed: dict = {}
    for clock in range(40):
        if clock == 2:
            server.add(Request("b", b, 4))
        if clock == 5:
            server.add(Request("c", c, 6))
        if not server.busy:
            break
        for name, token in server.step().items():
            streamed.setdefault(name, []).append(token)
    assert not server.busy and server.step() == {}
    for name, prompt, n in (("a", a, 10), ("b", b, 4), ("c", c, 6)):
        want = model.generate(prompt[None], n)[0]
        assert torch.equal(server.done[name], want), name
        assert streamed[name] == want[prompt.numel():].tolist()
    assert cache.used_pages == 0


def test_cancel_returns_a_running_request_s_tokens_and_its_pages_at_once():
    model, cache = _model(), _cache()
    a, b = _prompts(6, 5)
    server = Server(model, cache)
    server.add(Request("a", a, 30))
    server.add(Request("b", b, 8))
    for _ in range(3):
        server.step()
    held = cache.used_pages
    so_far = server.cancel("a")
    assert torch.equal(so_far, model.generate(a[None], 3)[0])  # prompt and the three tokens it had
    assert cache.used_pages < held and "a" not in cache.requests and server.running == ["b"]
    while server.busy:
        server.step()
    assert torch.equal(server.done["b"], model.generate(b[None], 8)[0]) and "a" not in server.done
    with pytest.raises(KeyError, match="request 'a' is neither waiting nor running"):
        server.cancel("a")


def test_a_waiting_request_can_be_cancelled_before_it_runs():
    model, cache = _model(), _cache(num_pages=6)  # room for one request of 6 + 14 tokens at a time
    a, b = _prompts(6, 6)
    server = Server(model, cache)
    server.add(Request("a", a, 14))
    server.add(Request("b", b, 14))
    server.step()
    assert server.running == ["a"] and [r.name for r in server.waiting] == ["b"]
    assert server.cancel("b") is None and server.waiting == []
    while server.busy:
        server.step()
    assert list(server.done) == ["a"]


def test_names_stay_taken_until_done_is_popped_and_bad_requests_are_refused_when_added():
    model, cache = _model(), _cache(num_pages=8)
    (a,) = _prompts(4)
    server = Server(model, cache)
    server.add(Request("a", a, 2))
    with pytest.raises(ValueError, match="request 'a': a request of this name is waiting, running or in server.done"):
        server.add(Request("a", a, 2))
    while server.busy:
        server.step()
    with pytest.raises(ValueError, match="in server.done"):
        server.add(Request("a", a, 2))
    server.done.pop("a")
    server.add(Request("a", a, 2))  # the name is free again
    with pytest.raises(ValueError, match=r"request 'x': prompt: expected token ids in \[0, 50\)"):
        server.add(Request("x", torch.tensor([1, 50]), 2))  # refused now, not in the middle of others' step
    with pytest.raises(ValueError, match="more than the cache's 8"):
        server.add(Request("long", torch.zeros(40, dtype=torch.long), 1))
    with pytest.raises(TypeError, match="request: expected a qkv.paged.serve.Request"):
        server.add(("a", a, 2))
    cache.add("elsewhere")
    with pytest.raises(ValueError, match="request 'elsewhere' is already in the cache"):
        server.add(Request("elsewhere", a, 2))


def test_a_request_that_cannot_be_admitted_while_nothing_runs_raises_and_stays_queued():
    model, cache = _model(), _cache(num_pages=4)
    cache.add("elsewhere")
    cache.reserve("elsewhere", 12)  # three of the four pages, held outside the server
    server = Server(model, cache)
    server.add(Request("y", torch.tensor([1, 2, 3]), 6))  # 9 tokens: 3 pages
    with pytest.raises(qkv.paged.OutOfPages, match="request 'y' needs 3 pages but only 1 of 4 are free") as e:
        server.step()
    assert (e.value.needed, e.value.free, e.value.num_pages) == (3, 1, 4)
    assert [r.name for r in server.waiting] == ["y"]
    cache.free("elsewhere")
    while server.busy:
        server.step()
    assert torch.equal(server.done["y"], model.generate(torch.tensor([[1, 2, 3]]), 6)[0])


def test_eos_ends_a_request_early_and_is_its_last_token():
    model, cache = _model(), _cache()
    (a,) = _prompts(5)
    alone = model.generate(a[None], 8)[0]
    eos = int(alone[5 + 2])  # the third new token
    first = (alone[5:] == eos).nonzero()[0].item()  # eos may come earlier
    server = Server(model, cache, eos_id=eos)
    server.add(Request("a", a, 8))
    while server.busy:
        server.step()
    assert torch.equal(server.done["a"], alone[: 5 + first + 1])
    assert torch.equal(serve(model, [Request("a", a, 8)], cache, eos_id=eos)["a"], server.done["a"])


def test_an_error_inside_a_step_cancels_the_running_requests(monkeypatch):
    """A step planned but never written cannot go on: its requests are cancelled and their pages freed."""
    model, cache = _model(), _cache()
    a, b = _prompts(4, 6)
    server = Server(model, cache)
    server.add(Request("a", a, 5))
    server.add(Request("b", b, 5))
    server.step()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # the server's process stopped mid-step

    monkeypatch.setattr(model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.step()
    assert server.running == [] and cache.requests == [] and cache.used_pages == 0
