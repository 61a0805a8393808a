"""Tests of ``qkv.edits.hook_points``: one attention call run with hook functions at its points.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

Oracle: with hooks that change nothing, the call composed for scores and pattern hooks
(softmax of the masked logits, ``pattern @ v``) equals ``qkv.attention`` on its engines, over
masks, biases, sinks, a score_mod, grouped heads and returned weights, in float64.
"""

import pytest
import torch

import qkv
from qkv.edits import Call, Knockout, ScaleHeads
from qkv.edits.hook_points import HookPoint, Hooked, attention

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 8, 4
TOL = dict(atol=1e-12, rtol=0)


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, I, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, G, J, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, G, J, E, generator=gen, dtype=torch.float64)
    return q, k, v


def hooked(*points, fn=lambda t, hook: None, direction="fwd"):
    found = Hooked()
    for point in points:
        found.add(direction, point, HookPoint(f"blocks.0.attn.hook_{point}"), fn, lambda: True)
    return found


OPTIONS = {
    "causal": dict(mask=qkv.masks.causal()),
    "padding": dict(mask=torch.tensor([[True] * 5 + [False] * 2, [True] * 7])[:, None, None, :]),
    "bias": dict(bias=torch.randn(1, H, I, J, generator=torch.Generator().manual_seed(3), dtype=torch.float64)),
    "sinks": dict(sinks=torch.linspace(-1.0, 2.0, H, dtype=torch.float64), mask=qkv.masks.causal()),
    "softcap": dict(score_mod=qkv.SoftCap(2.0), scale=0.7),
    "weights": dict(mask=qkv.masks.causal(), return_weights=True, weights_for={"heads": [1, 4], "rows": [0, 3]}),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_composed_call_with_idle_hooks_equals_the_engines(name):
    q, k, v = tensors()
    options = OPTIONS[name]
    want = qkv.attention(q, k, v, **options)
    got, call, seen = attention(Call(q, k, v, dict(options)), (), hooked("attn_scores", "pattern", "z", "v"))
    if isinstance(want, tuple):
        torch.testing.assert_close(got[0], want[0], **TOL)
        torch.testing.assert_close(got[1], want[1], **TOL)
    else:
        torch.testing.assert_close(got, want, **TOL)
    assert seen["pattern"].shape == (B, H, I, J) and seen["attn_scores"].shape == (B, H, I, J)


def test_a_row_that_sees_no_key_is_zero_in_pattern_and_z():
    q, k, v = tensors()
    mask = torch.ones(B, 1, I, J, dtype=torch.bool)
    mask[0, :, 2] = False  # row 2 of batch 0 sees nothing
    got, _, seen = attention(Call(q, k, v, dict(mask=mask)), (), hooked("pattern"))
    assert bool((seen["pattern"][0, :, 2] == 0).all()) and bool((got[0, :, 2] == 0).all())
    assert bool(seen["attn_scores"][0, :, 2].isneginf().all())


def test_edits_prepare_before_the_scores_hook():
    q, k, v = tensors()
    edges = torch.zeros(1, 1, I, J, dtype=torch.bool)
    edges[..., 1] = True
    scale = torch.linspace(0.5, 2.0, H, dtype=torch.float64)
    seen = []
    found = hooked("attn_scores", fn=lambda s, hook: seen.append(s.clone()))
    got, _, _ = attention(Call(q, k, v, {}), (Knockout(edges), ScaleHeads(scale)), found)
    want = qkv.edits.attention(q, k, v, [Knockout(edges), ScaleHeads(scale)])
    torch.testing.assert_close(got, want, **TOL)
    assert bool(seen[0][..., 1].isneginf().all())  # the knocked-out key, as the hook saw it


def test_backward_hooks_fire_at_each_point_with_the_activations_gradient():
    q, k, v = (t.requires_grad_() for t in tensors())
    grads = {}
    found = Hooked()
    for point in ("v", "attn_scores", "pattern", "z"):
        found.add("bwd", point, HookPoint(f"blocks.0.attn.hook_{point}"), lambda g, hook: grads.setdefault(hook.name, g), lambda: True)
    out, _, seen = attention(Call(q, k, v, dict(mask=qkv.masks.causal())), (), found)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out * weight).sum().backward()
    # d loss / d z in [batch, pos, head, d_head] is the weight transposed
    torch.testing.assert_close(grads["blocks.0.attn.hook_z"], weight.transpose(1, 2), **TOL)
    # d loss / d pattern = weight @ v_expandedᵀ
    v_full = v.detach().repeat_interleave(H // G, dim=1)
    torch.testing.assert_close(grads["blocks.0.attn.hook_pattern"], weight @ v_full.transpose(-1, -2), **TOL)
    assert grads["blocks.0.attn.hook_v"].shape == (B, J, G, E) and grads["blocks.0.attn.hook_attn_scores"].shape == (B, H, I, J)


def test_a_closed_blocks_backward_hooks_do_not_fire():
    q, k, v = (t.requires_grad_() for t in tensors())
    fired, is_open = [], [True]
    found = Hooked()
    found.add("bwd", "z", HookPoint("blocks.0.attn.hook_z"), lambda g, hook: fired.append(1), lambda: is_open[0])
    out, _, _ = attention(Call(q, k, v, {}), (), found)
    is_open[0] = False
    out.sum().backward()
    assert fired == []


def test_hook_point_names_its_layer():
    assert HookPoint("blocks.11.attn.hook_pattern").layer() == 11
    assert repr(HookPoint("blocks.2.attn.hook_z")) == "HookPoint(name='blocks.2.attn.hook_z')"


def test_a_row_that_sees_no_key_has_a_zero_gradient_not_nan():
    q, k, v = (t.requires_grad_() for t in tensors())
    mask = torch.ones(B, 1, I, J, dtype=torch.bool)
    mask[0, :, 2] = False
    delta = torch.zeros(B, H, I, J, dtype=torch.float64, requires_grad=True)
    grads = []
    found = hooked("attn_scores", fn=lambda s, hook: s + delta)
    found.add("bwd", "attn_scores", HookPoint("blocks.0.attn.hook_attn_scores"), lambda g, hook: grads.append(g), lambda: True)
    out, _, _ = attention(Call(q, k, v, dict(mask=mask)), (), found)
    out.sum().backward()
    assert bool(grads[0].isfinite().all()) and bool((grads[0][0, :, 2] == 0).all())
    assert bool(delta.grad.isfinite().all()) and bool(q.grad.isfinite().all())


def test_dropout_acts_before_the_pattern_hook_as_in_transformer_lens_bridge():
    q, k, v = tensors()
    seen = []
    found = hooked("pattern", fn=lambda p, hook: seen.append(p.clone()))
    torch.manual_seed(0)
    (out, weights), _, _ = attention(Call(q, k, v, dict(dropout=0.5, return_weights=True)), (), found)
    torch.manual_seed(0)
    dropped = torch.nn.functional.dropout(qkv.attention_weights(q, k), 0.5, training=True)
    torch.testing.assert_close(seen[0], dropped, **TOL)  # the hook sees the weights after dropout
    torch.testing.assert_close(weights, dropped, **TOL)  # and they are returned, as transformers' eager returns them
    torch.testing.assert_close(out, dropped @ v.repeat_interleave(H // G, dim=1), **TOL)


def test_return_lse_is_refused_where_hooks_change_scores_or_pattern():
    q, k, v = tensors()
    with pytest.raises(ValueError, match="return_lse"):
        attention(Call(q, k, v, dict(return_lse=True)), (), hooked("pattern"))
    got, _, _ = attention(Call(q, k, v, dict(return_lse=True)), (), hooked("z"))  # the engines' lse, z hooked
    torch.testing.assert_close(got[1], qkv.attention(q, k, v, return_lse=True)[1], **TOL)


@pytest.mark.parametrize("mod", [None, qkv.SoftCap(2.0), lambda s, b, h, i, j: torch.tanh(s)], ids=["none", "softcap", "tanh"])
def test_composed_gradients_equal_the_engines(mod):
    q, k, v = (t.requires_grad_() for t in tensors())
    options = dict(mask=qkv.masks.causal(), score_mod=mod)
    got, _, _ = attention(Call(q, k, v, dict(options)), (), hooked("pattern"))
    weight = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ours = torch.autograd.grad((got * weight).sum(), (q, k, v))
    theirs = torch.autograd.grad((qkv.attention(q, k, v, **options) * weight).sum(), (q, k, v))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL)


def test_a_16_bit_calls_pattern_is_hooked_in_its_dtype_and_its_scores_keep_their_range():
    q, k, v = (t.to(torch.float16) for t in tensors())
    bias = torch.zeros(1, 1, I, J, dtype=torch.float16)
    bias[..., 0, :3] = -1e5  # -inf if the logits were rounded to float16 (it holds up to 65504)
    seen = {}
    found = hooked("attn_scores", "pattern", fn=lambda t, hook: seen.update({hook.name.split("_", 1)[1]: t.dtype}))
    out, _, _ = attention(Call(q, k, v, dict(bias=bias)), (), found)
    assert seen == {"attn_scores": torch.float32, "pattern": torch.float16} and out.dtype == torch.float16
    want = qkv.attention(q.double(), k.double(), v.double(), bias=bias.double())
    assert (out.double() - want).abs().max() < 0.01  # row 0 included: its last keys still seen


def test_a_call_with_no_keys_gives_an_empty_pattern():
    q, k, v = tensors()
    got, _, seen = attention(Call(q, k[..., :0, :], v[..., :0, :], {}), (), hooked("pattern"))
    assert got.shape == (B, H, I, E) and seen["pattern"].shape == (B, H, I, 0)
    torch.testing.assert_close(got, qkv.attention(q, k[..., :0, :], v[..., :0, :]), **TOL)
