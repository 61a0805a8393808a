"""A small CPU inference server written on ``qkv.PagedKVCache`` and ``qkv.paged.serve``: the edges it hit.

Shape legend: ``T`` new tokens of a step (every request's, packed in one row), ``R`` requests of
a step, ``h`` query heads, ``g`` KV heads, ``d`` head size, ``V`` vocabulary.

Each test is a mistake or a question a server writer met going from the README to a working
loop: a docstring example that did not run, a mismatch between model and cache found only
deep inside the first step (or after other requests had run, losing their tokens), a batch of
two rows over a one-row step that gave the second row wrong logits silently, and errors that
did not say what to do. Oracle: ``model.generate`` on each request alone, and the errors'
messages (they name the argument and the fix).
"""

import importlib.util
import re

import pytest
import torch

import qkv
import qkv.paged.serve as serve_module
from qkv.models import CausalLM, LMConfig
from qkv.paged.serve import PagedStep, Request, serve

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _model(dtype=torch.float32, **overrides) -> CausalLM:
    torch.manual_seed(0)
    config = dict(vocab=40, dim=32, heads=4, kv_heads=2, layers=2, positional="rotary") | overrides
    return CausalLM(LMConfig(**config)).to(dtype).eval()


def _cache(num_pages=16, **kwargs) -> qkv.PagedKVCache:
    return qkv.PagedKVCache(num_pages, 4, 2, 8, layers=2, **kwargs)


def _counting(model: CausalLM) -> list:
    """The model's forward calls, as they happen: a check that belongs before the first step must need none."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def _examples(doc: str) -> list[str]:
    """The indented code blocks of a docstring, dedented."""
    blocks, current = [], []
    for line in doc.splitlines() + [""]:
        if line.startswith("    ") and line.strip():
            current.append(line[4:])
        elif current and line.strip():
            blocks.append("\n".join(current))
            current = []
    return blocks + (["\n".join(current)] if current else [])


def test_the_serve_module_docstring_examples_run():
    """``qkv.paged.serve(model, ...)`` named the module (not callable); a hand-written step had no example."""
    model, gen = _model(), torch.Generator().manual_seed(1)
    names = dict(torch=torch, model=model, cache=_cache(), prompt_a=torch.randint(40, (6,), generator=gen),
                 prompt_b=torch.randint(40, (3,), generator=gen), eos=None)  # fmt: skip
    examples = _examples(serve_module.__doc__)
    assert len(examples) == 3  # serve, a Server's loop, a step written by hand
    for code in examples:
        exec(code, names)
    assert torch.equal(names["done"]["b"], model.generate(names["prompt_b"][None], 5)[0])
    assert torch.equal(names["server"].done["a"], model.generate(names["prompt_a"][None], 20)[0])
    assert names["next_tokens"].shape == (2,)  # the hand-written step: one next token per request


def test_serve_docstring_says_admission_waits_for_the_whole_length():
    """It said a request waits for pages for its prompt; admission reserves prompt and every new token."""
    doc = " ".join(serve.__doc__.split())
    assert "lacks the pages for their prompt." not in doc
    assert "whole length" in doc
    model = _model()
    cache = _cache(num_pages=4)  # 16 tokens: a's 4 + 8, then b's 2 + 6 only after a leaves
    admitted, plan = [], cache.plan
    cache.plan = lambda new: admitted.append(sorted(n for n in new if cache.length(n) == 0)) or plan(new)
    serve(model, [Request("a", torch.arange(4), 8), Request("b", torch.arange(2), 6, arrival=1)], cache)
    assert admitted[0] == ["a"] and ["b"] in admitted[8:]  # b's prompt fit at step 1; its whole length did not


def test_serve_refuses_a_model_it_cannot_run_and_says_what_runs_it():
    with pytest.raises(TypeError, match=r"model: expected a qkv\.models\.CausalLM.*generate_batch.*got Linear"):
        serve(torch.nn.Linear(4, 4), [Request("a", torch.arange(3), 2)], _cache())


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the transformers extra)")
def test_serve_refuses_a_transformers_model_and_points_to_generate_batch():
    import transformers as hf

    config = hf.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=4)  # fmt: skip
    model = hf.AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(TypeError, match=r"for_continuous_batching.*generate_batch.*got LlamaForCausalLM"):
        serve(model, [Request("a", torch.arange(3), 2)], _cache())


@pytest.mark.parametrize(
    "model_dtype, cache_kwargs, fix",
    [
        (torch.float32, dict(dtype=torch.bfloat16), r"dtype=torch\.float32"),
        (torch.bfloat16, dict(), r"dtype=torch\.bfloat16"),
        (torch.bfloat16, dict(quantized=True), r"dtype=torch\.bfloat16, quantized=True"),
    ],
)
def test_serve_checks_the_cache_dtype_against_the_model_before_any_step(model_dtype, cache_kwargs, fix):
    """The error came from the first layer's attention: "give q the cache's dtype", which serve's caller cannot."""
    model = _model(model_dtype)
    calls = _counting(model)
    with pytest.raises(TypeError, match=rf"cache: computes in .* but the model in {model_dtype}.*{fix}"):
        serve(model, [Request("a", torch.arange(3), 2)], _cache(**cache_kwargs))
    assert not calls


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_float8_pages_serve_a_model_of_any_wider_dtype(model_dtype):
    model, gen = _model(model_dtype), torch.Generator().manual_seed(2)
    requests = [Request("a", torch.randint(40, (7,), generator=gen), 5),
                Request("b", torch.randint(40, (2,), generator=gen), 3, arrival=2)]  # fmt: skip
    cache = _cache(dtype=torch.float8_e4m3fn)
    done = serve(model, requests, cache)
    assert all(done[r.name].shape == (r.length,) for r in requests) and cache.used_pages == 0


def test_serve_checks_the_cache_heads_against_the_model_before_any_step():
    model = _model()
    calls = _counting(model)
    with pytest.raises(ValueError, match=r"cache: expected kv_heads=2, head_dim=8 \(the model's\), got kv_heads=4, head_dim=8"):
        serve(model, [Request("a", torch.arange(3), 2)], qkv.PagedKVCache(16, 4, 4, 8, layers=2))
    assert not calls


def test_serve_checks_every_request_before_running_any():
    """A request that can never run was found when it reached the queue's head: the others' tokens were lost."""
    model = _model()
    calls = _counting(model)
    early = Request("early", torch.arange(5), 20)
    late = Request("late", torch.arange(70) % 40, 3, arrival=10)  # 73 tokens: 19 pages of 4, the cache has 16
    with pytest.raises(ValueError, match=r"request 'late': 73 tokens .* 19 pages of 4, more than the cache's 16: make "
                                         r"num_pages larger"):  # fmt: skip
        serve(model, [early, late], _cache())
    assert not calls
    learned = _model(positional="learned", max_len=16)
    calls = _counting(learned)
    with pytest.raises(ValueError, match=r"request 'late': .* 17 positions .* max_len=16"):
        serve(learned, [Request("early", torch.arange(5), 4), Request("late", torch.arange(12), 6, arrival=3)], _cache())
    assert not calls


def test_a_step_of_more_than_one_row_is_refused():
    """A batch ``(2, T)`` over a step of ``T`` tokens ran: row 1's logits were row 0's attention, silently."""
    model, cache = _model(), _cache()
    cache.add("a")
    step = cache.plan({"a": 3})
    with pytest.raises(ValueError, match=r"a paged step runs one packed row \(1, T\).*got 2 rows"):
        model(torch.randint(40, (2, 3)), cache=PagedStep(cache, step))


def test_a_hand_written_loop_with_fork_cancel_and_late_arrivals_matches_each_request_alone():
    """What worked as written: admit while others decode, fork a system prompt, cancel, free, all over one cache."""
    model, cache, gen = _model(), _cache(), torch.Generator().manual_seed(3)
    system = torch.randint(40, (6,), generator=gen)
    users = {u: torch.randint(40, (n,), generator=gen) for u, n in (("u", 3), ("v", 1))}

    def step(new: dict) -> dict:
        s = cache.plan({r: len(t) for r, t in new.items()})
        with torch.no_grad():
            logits = model(torch.cat([new[r] for r in s.requests])[None], cache=PagedStep(cache, s))[0]  # (T, V)
        return dict(zip(s.requests, logits[s.qo_indptr[1:] - 1].argmax(-1).tolist()))

    cache.add("system")
    step({"system": system})
    for u in users:
        cache.fork("system", u)
    cache.free("system")
    assert cache.used_pages == 2  # the prompt's pages, held by the forks
    tokens = {u: [t] for u, t in step(users).items()}
    cache.add("late")
    late = torch.randint(40, (5,), generator=gen)
    for r, t in step({"late": late, **{u: torch.tensor(tokens[u][-1:]) for u in users}}).items():
        tokens.setdefault(r, []).append(t)  # late's prefill beside the users' decoding
    cache.free("v")  # cancelled mid-way
    for _ in range(3):
        for r, t in step({r: torch.tensor(tokens[r][-1:]) for r in ("u", "late")}).items():
            tokens[r].append(t)
    assert tokens["u"] == model.generate(torch.cat([system, users["u"]])[None], 5)[0, -5:].tolist()
    assert tokens["late"] == model.generate(late[None], 4)[0, -4:].tolist()
    for r in ("u", "late"):
        cache.free(r)
    assert cache.used_pages == 0


def test_freeing_a_request_twice_says_it_was_freed():
    cache = _cache()
    cache.add("a")
    cache.free("a")
    with pytest.raises(KeyError, match=re.escape("request 'a' is not in the cache (never added, or freed already)")):
        cache.free("a")


def test_an_integer_cache_dtype_points_to_quantized():
    with pytest.raises(TypeError, match=r"dtype: expected a floating-point dtype .* quantized=True .* got torch\.int8"):
        _cache(dtype=torch.int8)


def test_a_request_longer_than_the_whole_cache_is_told_it_never_fits():
    """The error said "free finished requests", which cannot help a request longer than the whole pool."""
    cache = _cache(num_pages=4)
    cache.add("a")
    with pytest.raises(RuntimeError, match=r"needs 5 more pages but 4 are free.*'a' would hold 5 pages, more than the "
                                           r"whole cache: make num_pages larger or the request shorter"):  # fmt: skip
        cache.plan({"a": 17})
    assert cache.length("a") == 0 and cache.free_pages == 4
