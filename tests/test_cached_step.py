"""Tests of the one-token decoding step through a stack of plain layers (``qkv.cached_step``).

Shape legend: ``b`` batch, ``i`` prompt length, ``dim`` model size, ``h`` heads, ``g`` KV heads.

The step must give what the general path gives, to the bit, output and caches alike; take
every call it may and no other; and leave the caches untouched when it declines.
"""

import copy

import pytest
import torch

import qkv
from qkv import cached_step
from qkv.blocks import Encoder
from qkv.cache import DecoderCache, StreamingCache
from qkv.models import CausalLM, LMConfig
from qkv.positional import ALiBi, Rotary


@pytest.fixture
def taken(monkeypatch):
    """How many steps :func:`cached_step.stack` answered (it answers None when it declines)."""
    count = [0]
    real = cached_step.stack

    def counting(*args):
        out = real(*args)
        count[0] += out is not None
        return out

    monkeypatch.setattr(cached_step, "stack", counting)
    return count


def _stack(dtype=torch.float32, **options) -> Encoder:
    torch.manual_seed(0)
    stack = Encoder(2, 32, 4, **options)
    with torch.no_grad():  # every parameter its own (the norms start as ones and zeros: a swapped norm would pass)
        for p in stack.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return stack.to(dtype).eval()


def _prompted(stack: Encoder, b: int = 3, i: int = 5, max_len: int | None = 16, dtype=torch.float32):
    """``(cache, x)``: the stack's cache after a prompt of ``i`` tokens, and a next token ``(b, 1, dim)``."""
    torch.manual_seed(1)
    cache = DecoderCache(len(stack.layers), max_len=max_len)
    with torch.inference_mode():
        stack(torch.randn(b, i, 32, dtype=dtype), causal=True, cache=cache)
    return cache, torch.randn(b, 1, 32, dtype=dtype)


def _both_ways(stack: Encoder, cache: DecoderCache, x: torch.Tensor, monkeypatch, **call):
    """The step's output and caches, and the general path's on copies of the same caches."""
    general_cache = copy.deepcopy(cache)
    with torch.inference_mode():
        fast = stack(x, causal=True, cache=cache, **call)
        with monkeypatch.context() as m:
            m.setattr(cached_step, "stack", lambda *args: None)
            slow = stack(x, causal=True, cache=general_cache, **call)
    return (fast, cache), (slow, general_cache)


def _assert_same(a, b):
    (out_a, cache_a), (out_b, cache_b) = a, b
    assert torch.equal(out_a, out_b)
    for ca, cb in zip(cache_a.self_attn, cache_b.self_attn):
        assert ca.length == cb.length
        assert torch.equal(ca.keys, cb.keys) and torch.equal(ca.values, cb.values)


CONFIGS = {
    "pre-norm gelu": dict(norm_first=True, activation="gelu"),
    "post-norm relu": dict(norm_first=False, activation="relu"),
    "swiglu, grouped heads": dict(norm_first=True, activation="swiglu", kv_heads=2),
    "multi-query, rotary": dict(norm_first=True, kv_heads=1, positional=Rotary(8)),
    "dot score": dict(norm_first=True, attention=lambda: qkv.Attention("dot")),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("max_len", [16, None])
def test_a_step_equals_the_general_path_to_the_bit(name, max_len, taken, monkeypatch):
    stack = _stack(**CONFIGS[name])
    cache, x = _prompted(stack, max_len=max_len)
    fast, slow = _both_ways(stack, cache, x, monkeypatch)
    assert taken[0] == 1
    _assert_same(fast, slow)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes_step_as_the_general_path_does(dtype, taken, monkeypatch):
    stack = _stack(dtype, norm_first=True, kv_heads=2)
    cache, x = _prompted(stack, dtype=dtype)
    fast, slow = _both_ways(stack, cache, x, monkeypatch)
    assert taken[0] == 1
    _assert_same(fast, slow)


def test_qk_norm_and_gate_are_called_as_modules(taken, monkeypatch):
    stack = _stack(norm_first=True)
    seen = []
    for layer in stack.layers:
        layer.self_attn.qk_norm = qkv.QKNorm(8)
        layer.self_attn.gate = qkv.OutputGate(32, 4, 8)
        layer.self_attn.gate.register_forward_hook(lambda *_: seen.append(1))
    cache, x = _prompted(stack)
    seen.clear()
    fast, slow = _both_ways(stack, cache, x, monkeypatch)
    assert taken[0] == 1 and len(seen) == 4  # the gate's hook: once per layer in each run
    _assert_same(fast, slow)


def test_generation_of_the_lm_takes_the_step_and_gives_the_same_tokens(taken, monkeypatch):
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=50, dim=32, heads=4, layers=2, max_len=40)).eval()
    prompt = torch.randint(0, 50, (2, 6))
    fast = model.generate(prompt, 20)
    assert taken[0] == 19  # every step after the prompt's
    monkeypatch.setattr(cached_step, "stack", lambda *args: None)
    assert torch.equal(fast, model.generate(prompt, 20))
    assert torch.equal(fast, model.generate(prompt, 20, use_cache=False))


def _hook_on(path: str):
    def add(stack):
        module = stack.get_submodule(path)
        module.register_forward_hook(lambda *_: None)
    return add


DECLINED = {
    "a hook on the layer": _hook_on("layers.1"),
    "a hook on the attention module": _hook_on("layers.1.self_attn"),
    "a hook on the mechanism": _hook_on("layers.1.self_attn.attention"),
    "a hook on a projection": _hook_on("layers.1.self_attn.k_proj"),
    "a hook on the output projection": _hook_on("layers.1.self_attn.out_proj"),
    "a hook on the feed-forward": _hook_on("layers.1.ff"),
    "a hook on its product": _hook_on("layers.1.ff.w_out"),
    "a hook on a norm": _hook_on("layers.1.norm2"),
    "edits": lambda s: setattr(s.layers[1].self_attn.attention, "edits", [qkv.edits.AblateHeads([1])]),
    "a score_mod": lambda s: setattr(s.layers[1].self_attn.attention, "score_mod", qkv.SoftCap(5.0)),
    "a named backend": lambda s: setattr(s.layers[1].self_attn.attention, "backend", "chunked"),
    "a layer in training": lambda s: s.layers[1].train(),
    "a mechanism in training with dropout": lambda s: (setattr(s.layers[1].self_attn.attention, "dropout", 0.5),
                                                        s.layers[1].self_attn.attention.train()),
    "a bias-adding positional module": lambda s: setattr(s.layers[1].self_attn, "positional", ALiBi(4)),
    "another norm": lambda s: setattr(s.layers[1], "norm2", torch.nn.RMSNorm(32)),
    "a forward set on the instance": lambda s: setattr(  # (as accelerate's hooks wrap a module)
        s.layers[1].ff.w_out, "forward", lambda x, m=s.layers[1].ff.w_out: torch.nn.functional.linear(x, m.weight) * 2),
}


@pytest.mark.parametrize("name", list(DECLINED))
def test_a_layer_that_is_not_plain_sends_the_whole_step_down_the_general_path(name, taken, monkeypatch):
    stack = _stack(norm_first=True)
    cache, x = _prompted(stack)
    DECLINED[name](stack)
    fast, slow = _both_ways(stack, cache, x, monkeypatch)
    assert taken[0] == 0
    if "training" not in name:  # (dropout draws differ between the runs)
        _assert_same(fast, slow)
    # declined before any cache was written: each layer appended exactly one position, on the general path
    assert [c.length for c in fast[1].self_attn] == [6, 6]


def _global_hook():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        with torch.inference_mode():
            yield
    finally:
        handle.remove()


NOT_TAKEN = {
    "a mask": (dict(mask=torch.ones(3, 1, 1, 6, dtype=torch.bool)), torch.inference_mode),
    "weights": (dict(return_weights=True), torch.inference_mode),
    "two tokens": (dict(tokens=2), torch.inference_mode),
    "autocast": ({}, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    "gradients recorded": ({}, torch.enable_grad),
    "a global hook": ({}, __import__("contextlib").contextmanager(_global_hook)),
}


@pytest.mark.parametrize("name", list(NOT_TAKEN))
def test_calls_it_does_not_take(name, taken):
    stack = _stack(norm_first=True)
    call, context = NOT_TAKEN[name]
    with context() if name == "autocast" else torch.inference_mode():  # (under autocast the cache holds bfloat16)
        cache, x = _prompted(stack)
    call = dict(call)
    x = x.repeat(1, call.pop("tokens", 1), 1)
    with context():
        stack(x, causal=True, cache=cache, **call)
    assert taken[0] == 0


def test_a_streaming_cache_takes_the_general_path_and_a_plain_one_the_step(taken):
    stack = _stack(norm_first=True)
    streaming = DecoderCache(2, layer_cache=lambda: StreamingCache(sink_tokens=2, window=8))
    x = torch.randn(3, 1, 32)
    with torch.inference_mode():
        stack(torch.randn(3, 4, 32), causal=True, cache=streaming)
        stack(x, causal=True, cache=streaming)
    assert taken[0] == 0
    cache, x = _prompted(stack)
    with torch.inference_mode():
        stack(x, causal=True, cache=cache)
    assert taken[0] == 1


def test_a_full_cache_gets_the_general_path_and_its_message(taken):
    stack = _stack(norm_first=True)
    cache, x = _prompted(stack, i=5, max_len=5)
    with torch.inference_mode(), pytest.raises(ValueError, match="at most max_len=5 positions"):
        stack(x, causal=True, cache=cache)
    assert taken[0] == 0


def test_a_wrong_input_gets_the_general_path_and_its_message(taken):
    stack = _stack(norm_first=True)
    cache, _ = _prompted(stack)
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"x: expected shape \(b, i, 32\)"):
            stack(torch.randn(3, 1, 16), causal=True, cache=cache)
        with pytest.raises(ValueError, match="k: expected"):
            stack(torch.randn(2, 1, 32), causal=True, cache=cache)  # another batch than the cache's
        with pytest.raises(TypeError, match="x: dtype torch.float64 differs"):
            stack(torch.randn(3, 1, 32, dtype=torch.float64), causal=True, cache=cache)
    assert taken[0] == 0


def test_a_compiled_layer_is_declined():
    """``module.compile()`` keeps the type and adds no hook: its compiled call is what the general path runs."""
    stack = _stack(norm_first=True)
    cache, x = _prompted(stack)
    stack.layers[1].compile()  # (compiles on its first call, which this test never makes)
    with torch.inference_mode():
        assert cached_step.stack(stack.layers, x, cache.self_attn, type(stack.layers[0])) is None
    assert [c.length for c in cache.self_attn] == [5, 5]


def test_a_torch_function_mode_is_declined(taken):
    """A mode sees the functions the modules call (``F.layer_norm``), which the step would not call."""
    seen = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    stack = _stack(norm_first=True)
    cache, x = _prompted(stack)
    with torch.inference_mode(), Watch():
        stack(x, causal=True, cache=cache)
    assert taken[0] == 0 and torch.nn.functional.layer_norm in seen


MALFORMED = {
    "a causal that is not a bool": (lambda s: None, dict(causal="yes"), TypeError, "causal: expected a bool"),
    "a feed-forward in another dtype": (lambda s: s.layers[0].ff.double(), {}, TypeError,
                                        r"x: dtype torch.float32 differs from the module's parameters \(torch.float64\)"),
    "a norm of another size": (lambda s: setattr(s.layers[0], "norm1", torch.nn.LayerNorm(16)), {}, ValueError,
                               r"x: expected shape \(b, i, 16\)"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_step_gets_the_general_paths_message_and_no_cache_written(name, taken):
    change, call, error, message = MALFORMED[name]
    stack = _stack(norm_first=True)
    cache, x = _prompted(stack)
    change(stack)
    with torch.inference_mode(), pytest.raises(error, match=message):
        stack(x, cache=cache, **{"causal": True, **call})
    assert taken[0] == 0 and [c.length for c in cache.self_attn] == [5, 5]


def test_a_projection_of_another_input_size_gets_the_general_paths_message(taken):
    """Checked before any layer runs: the general path's own error, after its first layer's step, as without the step."""
    stack = _stack(norm_first=True)
    cache, x = _prompted(stack)
    stack.layers[1].self_attn.q_proj = torch.nn.Linear(16, 32)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"query: expected shape \(b, length, 16\)"):
        stack(x, causal=True, cache=cache)
    assert taken[0] == 0 and [c.length for c in cache.self_attn] == [6, 5]
