"""``qkv.edit`` on the packaged SmolLM2-135M (a causal Llama with grouped heads), against eager edited by hand.

Shape legend: ``h = 9`` query heads, ``g = 3`` KV heads, ``e = 64`` head size, ``n`` tokens.

A zero ablation of head ``h`` of layer ``l`` equals the model with ``o_proj``'s columns of that
head zeroed (float64, 1e-9, both through qkv), and eager attention edited the same way; a
knockout of some edges equals eager with those edges masked. transformers' eager Llama takes
its softmax in float32 even in a float64 model, so against eager the bound is twice the gap
between the unedited qkv and eager runs (about 4e-5 on the logits), not 1e-9.
"""

import copy

import pytest
import torch

import qkv
from qkv.edits import AblateHeads, Knockout
from packaged_models import smollm2_pair

LAYER, HEAD, E = 7, 4, 64


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_pair()


def gap(models) -> float:
    """The largest logit difference between the unedited qkv and eager runs (eager's float32 softmax)."""
    model, eager = models
    with torch.no_grad():
        return float((model(ids()).logits - eager(ids()).logits).abs().max())


def ids():
    return torch.randint(100, 40000, (2, 13), generator=torch.Generator().manual_seed(0))


def test_zero_ablation_equals_eager_with_the_heads_columns_of_o_proj_zeroed(smollm2):
    model, eager = smollm2
    with torch.no_grad(), qkv.edit(model, {LAYER: AblateHeads([HEAD])}):
        got = model(ids()).logits
    zeroed, zeroed_eager = copy.deepcopy(model), copy.deepcopy(eager)
    with torch.no_grad():
        for m in (zeroed, zeroed_eager):
            m.model.layers[LAYER].self_attn.o_proj.weight[:, HEAD * E : (HEAD + 1) * E] = 0
        want = zeroed(ids()).logits
        want_eager = zeroed_eager(ids()).logits
        plain = model(ids()).logits
    torch.testing.assert_close(got, want, atol=1e-9, rtol=0)
    assert (got - want_eager).abs().max() <= 2 * gap(smollm2)
    assert (got - plain).abs().max() > 1e-3  # the head mattered


def test_knockout_equals_eager_with_those_edges_masked(smollm2, monkeypatch):
    model, eager = smollm2
    n = ids().shape[1]
    edges = torch.zeros(n, n, dtype=torch.bool)
    edges[5:, 0] = True  # no query after position 4 may see the first token
    with torch.no_grad(), qkv.edit(model, {LAYER: Knockout(edges)}):
        got = model(ids()).logits
    from transformers.models.llama import modeling_llama

    plain_eager = modeling_llama.eager_attention_forward

    def knocked(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == LAYER:
            attention_mask = attention_mask.masked_fill(edges, float("-inf"))
        return plain_eager(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", knocked)
    with torch.no_grad():
        want = eager(ids()).logits
    assert (got - want).abs().max() <= 2 * gap(smollm2)
    with torch.no_grad():
        assert (got - model(ids()).logits).abs().max() > 1e-3  # the edges mattered


def test_hook_result_is_each_heads_z_through_its_columns_of_o_proj(smollm2):
    model, _ = smollm2
    with torch.no_grad(), qkv.record(model, layers=LAYER, rows=[3, 12], hooks=("z", "result")) as rec:
        model(ids())
    z, result = rec[f"blocks.{LAYER}.attn.hook_z"], rec[f"blocks.{LAYER}.attn.hook_result"]  # (b, R, h, e), (b, R, h, d_model)
    o_proj = model.model.layers[LAYER].self_attn.o_proj
    with torch.no_grad():
        torch.testing.assert_close(result.sum(-2), o_proj(z.flatten(-2)), atol=1e-9, rtol=0)  # heads sum to the output
    with torch.no_grad(), qkv.record(model, layers=LAYER, heads=[HEAD, 1], rows=[3, 12], hooks=("result",)) as two:
        model(ids())
    torch.testing.assert_close(two[f"blocks.{LAYER}.attn.hook_result"], result[..., [HEAD, 1], :], atol=1e-12, rtol=0)
