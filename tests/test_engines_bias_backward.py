"""The backward of a biased call moved from the fused kernel's blocks to ``mod_tiles``' tiles (``engines.bias_backward``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` head size.

Which backward is faster is timed per CPU; here each choice is forced, and both give the
float64 reference's gradients, for ALiBi and a T5 bias that is not trained, causal or not,
with grouped heads.
"""

import pytest
import torch

import qkv
from qkv.backends.engines import alibi_column, bias_backward, fused_blocks, mod_tiles
from reference import random_qkv, run_with_grads

H, G, D = 4, 2, 8


def biases(i: int, j: int):
    t5 = qkv.RelativePositionBias(H, bidirectional=False).double().requires_grad_(False)
    return {"alibi": qkv.ALiBi(H), "t5, not trained": t5}


@pytest.fixture
def spy(monkeypatch):
    """Forces the timed choice and records which backward ran."""
    ran = []
    # ALiBi's column path is chosen by timing it once per process: held off, so the fused or tile engine runs
    monkeypatch.setattr(alibi_column, "preferred", lambda dtype, grad: False)
    tiles, fused = mod_tiles.backward, fused_blocks.fused_backward_of
    monkeypatch.setattr(mod_tiles, "backward", lambda *a, **k: ran.append("tiles") or tiles(*a, **k))
    monkeypatch.setattr(fused_blocks, "fused_backward_of", lambda *a: ran.append("fused") or fused(*a))

    def force(tiles_faster: bool):
        monkeypatch.setattr(bias_backward, "tiles_faster", lambda *timed: tiles_faster)
        ran.clear()
        return ran

    return force


@pytest.mark.parametrize("bias", ["alibi", "t5, not trained"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tiles_faster", [True, False])
def test_either_backward_gives_the_reference_gradients(spy, bias, causal, tiles_faster):
    i = j = 300  # more than one tile and one block
    q, k, v = random_qkv(2, H, G, i, j, D, D)
    b = biases(i, j)[bias]
    ran = spy(tiles_faster)
    got = run_with_grads(lambda: qkv.attention(q, k, v, bias=b, causal=causal), [q, k, v])
    assert ran == ["tiles" if tiles_faster else "fused"]
    want = run_with_grads(lambda: qkv.attention(q, k, v, bias=b, causal=causal, backend="reference"), [q, k, v])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)


def test_a_learned_bias_keeps_the_fused_backward(spy):
    """Its gradient is rebuilt from the fused forward's saved parts: never moved."""
    q, k, v = random_qkv(1, H, G, 64, 64, D, D)
    t5 = qkv.RelativePositionBias(H, bidirectional=False).double()
    ran = spy(True)
    out = qkv.attention(q, k, v, bias=t5, causal=True)
    out.sum().backward()
    assert ran == ["fused"]
    assert t5.embedding.weight.grad is not None


def test_explain_names_the_backward_engine_only_for_a_call_that_records_gradients(spy):
    q, k, v = random_qkv(1, H, G, 64, 64, D, D)
    spy(True)
    text = qkv.explain(q, k, v, bias=qkv.ALiBi(H), causal=True).splitlines()
    assert text[0] == "backend: chunked (fused_blocks)"
    assert text[-1] == "  backward: mod_tiles (timed faster than fused_blocks's own with this bias on this CPU)"
    with torch.no_grad():
        assert "backward:" not in qkv.explain(q, k, v, bias=qkv.ALiBi(H), causal=True)
    spy(False)
    assert "backward:" not in qkv.explain(q, k, v, bias=qkv.ALiBi(H), causal=True)


def test_the_choice_is_timed_once_per_dtype():
    fused = (fused_blocks.forward, fused_blocks.fused_backward_of)
    bias_backward.TIMED.pop(torch.float32, None)
    first = bias_backward.tiles_faster(torch.float32, *fused)
    assert isinstance(first, bool) and bias_backward.TIMED[torch.float32] is first
    timed = []
    assert bias_backward.tiles_faster(torch.float32, lambda *a: timed.append(1), None) is first and not timed


def test_the_choice_is_timed_in_the_forward_of_a_call_that_records_gradients(monkeypatch):
    """Timed before the call allocates, not in its backward on top of the saved state (peak memory)."""
    timed = []
    monkeypatch.setattr(bias_backward, "TIMED", {})
    monkeypatch.setattr(bias_backward, "_time", lambda dtype, *fused: timed.append(dtype) or True)
    monkeypatch.setattr(alibi_column, "preferred", lambda dtype, grad: False)  # the fused blocks run it, on any CPU
    q, k, v = (torch.randn(1, H, 600, D) for _ in range(3))
    qkv.attention(q, k, v, bias=qkv.ALiBi(H), causal=True)  # nothing to differentiate: not timed
    assert timed == []
    q.requires_grad_()
    out = qkv.attention(q, k, v, bias=qkv.ALiBi(H), causal=True)
    assert timed == [torch.float32]  # in the forward
    out.sum().backward()
    assert timed == [torch.float32]  # once


@pytest.mark.parametrize("tiles_faster", [True, False])
def test_the_log_sum_exp_and_sinks_differentiate_through_either_backward(spy, tiles_faster):
    """``return_lse`` (its gradient is a second backward, of values all ones) and sinks, ALiBi, causal."""
    q, k, v = random_qkv(1, H, G, 300, 300, D, D)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(5), dtype=torch.float64).requires_grad_()
    ran = spy(tiles_faster)
    kw = dict(bias=qkv.ALiBi(H), causal=True, sinks=sinks, return_lse=True)
    got = run_with_grads(lambda: qkv.attention(q, k, v, **kw), [q, k, v, sinks])
    assert set(ran) == {"tiles" if tiles_faster else "fused"}
    want = run_with_grads(lambda: qkv.attention(q, k, v, backend="reference", **kw), [q, k, v, sinks])
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)
