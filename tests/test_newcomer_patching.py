"""A TransformerLens user's first session with ``qkv.record`` / ``qkv.edit`` on the packaged SmolLM2-135M.

Shape legend: ``b`` batch, ``h = 9`` query heads, ``g = 3`` KV heads (query head ``n`` reads
KV head ``n // 3``), ``i`` query rows, ``j`` keys, ``e = 64`` head size; MiniLM has 12 heads of 32.

The classic workflows, each against the same thing done by hand on the model's own modules:
``hook_z`` is what ``o_proj`` reads (``(b, i, h·e)``, head ``n`` at columns ``n·e:(n+1)·e``),
so a forward pre-hook on ``o_proj`` that rewrites a head's slice is TransformerLens' hook on
``hook_z``. The prompt is the indirect-object one (Wang et al. 2022): clean "When Mary and John
went to the store, John gave a drink to", corrupted with "Mary" as the giver, measured by
``logit(Mary) - logit(John)`` at the last token. Token ids are written out, so no tokenizer
loads. Against transformers' eager attention the bound is twice the unedited gap (eager's
float32 softmax), as in ``tests/test_integrations_transformers_edits_smollm2.py``; against
the hand edit on the same qkv model it is 1e-5 in float32 and 1e-10 in float64. With and
without the KV cache, and a left-padded row against its prompt alone, agree to 1e-9 in float64.

Patching every head of every layer with the clean run's ``z`` reproduces the clean logits
only when the corruption lives inside attention (here an ablation): a corrupted token still
reaches the residual stream through its embedding and the MLPs.
"""

import contextlib
import copy

import pytest
import torch
from packaged_models import minilm_folder, smollm2_model

import qkv
from qkv.edits import AblateHeads, Knockout, PatchPattern, PatchZ, ScaleHeads
from qkv.masks import offsets

CLEAN = [2427, 5099, 284, 2322, 3514, 288, 260, 4249, 28, 2322, 4502, 253, 5968, 288]
CORRUPTED = CLEAN[:9] + [5099] + CLEAN[10:]  # "..., Mary gave a drink to": only position 9 differs
SHORT = [504, 2644, 2643, 335, 260]  # "The cat sat on the"
MARY, JOHN, PAD = 5099, 2322, 2
HEADS, E, LAYERS = 9, 64, 30


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_model("qkv")


@pytest.fixture(scope="module")
def smollm2_64(smollm2):
    """A float64 copy: there qkv's runs of one prompt agree to 1e-12 however they are batched or cached."""
    return copy.deepcopy(smollm2).double()


@pytest.fixture(scope="module")
def minilm():
    folder = minilm_folder()
    from transformers import AutoModel

    from qkv.integrations.transformers import register

    register()
    return AutoModel.from_pretrained(folder, attn_implementation="qkv").eval().double()


def ids(*rows):
    return torch.tensor(rows)


def logits(model, x, **kwargs):
    with torch.no_grad():
        return model(x, **kwargs).logits


def logit_diff(out):
    return out[:, -1, MARY] - out[:, -1, JOHN]


@contextlib.contextmanager
def on_z(attention_output, change, e=E):
    """TransformerLens' hook on ``hook_z`` by hand: ``change(z (b, i, h, e))`` rewrites what ``attention_output`` reads."""

    def pre(module, args):
        x = args[0].clone()  # (b, i, h·e)
        change(x.view(*x.shape[:-1], -1, e))  # a view: what change writes, x holds
        return (x, *args[1:])

    handle = attention_output.register_forward_pre_hook(pre)
    try:
        yield
    finally:
        handle.remove()


def o_proj(model, layer):
    return model.model.layers[layer].self_attn.o_proj


# ------------------------------------------------------------------ 1. record every head


def test_record_every_head_on_a_clean_and_a_corrupted_prompt(smollm2):
    seen = {}
    hooks = [o_proj(smollm2, n).register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, a[0].clone())) for n in range(LAYERS)]
    try:
        with torch.no_grad(), qkv.record(smollm2) as rec:  # run_with_cache: every layer, head and row
            got = smollm2(ids(CLEAN, CORRUPTED)).logits
    finally:
        for handle in hooks:
            handle.remove()
    assert len(rec) == 3 * LAYERS
    torch.testing.assert_close(got, logits(smollm2, ids(CLEAN, CORRUPTED)), atol=0, rtol=0)  # recording changes nothing
    for n in (0, 13, LAYERS - 1):
        z, pattern = rec[f"blocks.{n}.attn.hook_z"], rec[f"blocks.{n}.attn.hook_pattern"]  # (b, i, h, e), (b, h, i, j)
        assert z.shape == (2, 14, HEADS, E) and pattern.shape == (2, HEADS, 14, 14)
        torch.testing.assert_close(z.flatten(-2), seen[n], atol=1e-6, rtol=0)  # hook_z is what o_proj reads
        torch.testing.assert_close(pattern, rec[f"blocks.{n}.attn.hook_attn_scores"].softmax(-1), atol=1e-5, rtol=0)
        assert float(pattern.triu(1).abs().max()) == 0  # causal
        # before the changed token the two prompts are the same text, after it they are not
        torch.testing.assert_close(z[0, :9], z[1, :9], atol=1e-5, rtol=0)
        assert float((z[0, 9:] - z[1, 9:]).abs().max()) > 1e-3


# ------------------------------------------------------------------ 2. activation patching


def test_patching_nothing_or_a_runs_own_pattern_leaves_the_corrupted_run(smollm2):
    corrupted = logits(smollm2, ids(CORRUPTED))
    with qkv.edit(smollm2, {}):
        assert torch.equal(logits(smollm2, ids(CORRUPTED)), corrupted)
    with torch.no_grad(), qkv.record(smollm2, layers=[2, 15], hooks=("pattern",)) as own:
        smollm2(ids(CORRUPTED))
    every = {n: PatchPattern(slice(None), slice(None), own[f"blocks.{n}.attn.hook_pattern"]) for n in (2, 15)}
    with qkv.edit(smollm2, every):
        torch.testing.assert_close(logits(smollm2, ids(CORRUPTED)), corrupted, atol=1e-4, rtol=0)


def test_a_head_output_sweep_over_layers_equals_the_hook_z_patch_by_hand(smollm2):
    with torch.no_grad(), qkv.record(smollm2, hooks=("z",)) as clean:
        clean_logits = smollm2(ids(CLEAN)).logits
    corrupted = logits(smollm2, ids(CORRUPTED))
    swept = {}
    for layer, head in ((0, 2), (14, 4), (LAYERS - 1, 8)):  # one head per layer, its output at the last row
        z = clean[f"blocks.{layer}.attn.hook_z"]  # (1, 14, 9, 64)
        with qkv.edit(smollm2, {layer: PatchZ(head, -1, z[:, -1:, head : head + 1])}):
            got = logits(smollm2, ids(CORRUPTED))

        def by_hand(x, head=head, z=z):
            x[:, -1, head] = z[:, -1, head]

        with on_z(o_proj(smollm2, layer), by_hand):
            want = logits(smollm2, ids(CORRUPTED))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        swept[layer] = float(logit_diff(got) - logit_diff(corrupted))
    assert float(logit_diff(clean_logits)) > 0 > float(logit_diff(corrupted))  # the prompts do what they should
    assert max(abs(v) for v in swept.values()) > 1e-3  # some patch moved the metric

    # every head of every layer: the clean logits only where the corruption was inside attention
    ablated = {3: AblateHeads(slice(None)), 11: AblateHeads([0, 4, 8])}
    restore = {n: PatchZ(slice(None), slice(None), clean[f"blocks.{n}.attn.hook_z"]) for n in range(LAYERS)}
    with qkv.edit(smollm2, ablated):
        broken = logits(smollm2, ids(CLEAN))
        with qkv.edit(smollm2, restore):  # an inner block's edits come after the outer one's
            torch.testing.assert_close(logits(smollm2, ids(CLEAN)), clean_logits, atol=1e-5, rtol=0)
    assert float((broken - clean_logits).abs().max()) > 1e-2
    with qkv.edit(smollm2, restore):  # a corrupted token: its embedding and the MLPs still carry it
        assert float((logits(smollm2, ids(CORRUPTED)) - clean_logits).abs().max()) > 1e-2


def test_pattern_patching_of_grouped_heads_equals_clean_weights_times_corrupted_values(smollm2):
    layer, heads = 9, [4, 8]  # KV heads 1 and 2
    with torch.no_grad(), qkv.record(smollm2, layers=layer, heads=heads, rows=[-1], hooks=("pattern",)) as clean:
        smollm2(ids(CLEAN))
    pattern = clean[f"blocks.{layer}.attn.hook_pattern"]  # (1, 2, 1, 14)
    with qkv.edit(smollm2, {layer: PatchPattern(heads, -1, pattern)}):
        got = logits(smollm2, ids(CORRUPTED))
    values = {}
    v_proj = smollm2.model.layers[layer].self_attn.v_proj
    handle = v_proj.register_forward_hook(lambda m, a, out: values.__setitem__("v", out.view(1, 14, 3, E).transpose(1, 2)))

    def by_hand(x):
        for n, head in enumerate(heads):
            x[:, -1, head] = pattern[:, n, 0] @ values["v"][:, head // 3]  # (1, 14) @ (1, 14, e)

    try:
        with on_z(o_proj(smollm2, layer), by_hand):
            want = logits(smollm2, ids(CORRUPTED))
    finally:
        handle.remove()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float((got - logits(smollm2, ids(CORRUPTED))).abs().max()) > 1e-4  # the patch did something


# ------------------------------------------------------------------ 3. ablation


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("how", ["zero", "mean"])
def test_ablation_equals_zeroing_or_averaging_the_heads_slice_of_o_projs_input(smollm2, smollm2_64, how, dtype):
    model = smollm2 if dtype == torch.float32 else smollm2_64
    layer, head, x = 7, 4, ids(CLEAN, CORRUPTED)
    with qkv.edit(model, {layer: AblateHeads(head, how=how)}):
        got = logits(model, x)

    def by_hand(z):  # TransformerLens: z[:, :, head] = 0, or its mean over batch and positions
        z[:, :, head] = 0 if how == "zero" else z[:, :, head].mean((0, 1))

    with on_z(o_proj(model, layer), by_hand):
        want = logits(model, x)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=0)
    assert float((got - logits(model, x)).abs().max()) > 1e-3  # the head mattered
    if dtype == torch.float32 and how == "zero":  # and eager attention edited the same way
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        gap = float((logits(eager, x) - logits(model, x)).abs().max())
        with on_z(o_proj(eager, layer), by_hand):
            assert float((logits(eager, x) - got).abs().max()) <= 2 * gap


# ------------------------------------------------------------------ 4. the KV cache, padded batches


def generate(model, x, cache, **kwargs):
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=3, do_sample=False, use_cache=cache, pad_token_id=PAD,
                             output_logits=True, return_dict_in_generate=True, **kwargs)  # fmt: skip
    return out.sequences, torch.stack(out.logits, 1)  # (b, n + 3), (b, 3, vocab)


def test_edits_apply_alike_with_and_without_the_kv_cache(smollm2_64):
    model = smollm2_64
    with torch.no_grad(), qkv.record(model, layers=3, heads=[2], hooks=("z",)) as rec:
        model(ids(CLEAN))
    mean = rec["blocks.3.attn.hook_z"].mean((0, 1))  # (1, e): a fixed mean, which a cache cannot change
    edits = {3: AblateHeads(2, how=mean), 7: [AblateHeads([4]), ScaleHeads([0.5] * HEADS)], 12: Knockout(offsets(-1, -1))}
    with qkv.edit(model, edits):
        cached, cached_logits = generate(model, ids(CLEAN), True)
        fresh, fresh_logits = generate(model, ids(CLEAN), False)
    assert torch.equal(cached, fresh)
    torch.testing.assert_close(cached_logits, fresh_logits, atol=1e-9, rtol=0)
    assert float((cached_logits[:, 0] - logits(model, ids(CLEAN))[:, -1]).abs().max()) > 1e-2  # the edits mattered


def test_a_mean_ablation_in_a_decoding_step_is_refused_not_silently_skipped(smollm2):
    # the mean of one new token in a batch of one is its own z: the step would run unablated
    with qkv.edit(smollm2, {7: AblateHeads(4, how="mean")}), pytest.raises(ValueError, match=r"KV cache.*how=rec"):
        generate(smollm2, ids(SHORT), True)


def test_a_dense_knockout_or_a_patch_in_a_decoding_step_says_why_it_does_not_fit(smollm2):
    edges = torch.zeros(5, 5, dtype=torch.bool)
    edges[3:, 0] = True
    with torch.no_grad(), qkv.record(smollm2, layers=7, heads=[4], rows=[3], hooks=("pattern",)) as rec:
        smollm2(ids(SHORT))
    pattern = rec["blocks.7.attn.hook_pattern"]  # (1, 1, 1, 5)
    why = [
        (Knockout(edges), r"Knockout: edges of shape \(5, 5\).*\(1, 9, 1, 6\).*decoding step"),
        (PatchPattern(4, 3, pattern), r"PatchPattern: rows: .* this one has 1 \(a generate\(\) decoding step"),
    ]
    for edit, message in why:
        with qkv.edit(smollm2, {7: edit}):
            logits(smollm2, ids(SHORT))  # the prompt's own call fits
            with pytest.raises(ValueError, match=message):
                generate(smollm2, ids(SHORT), True)


def test_left_padded_rows_match_their_prompts_alone_edited_the_same_way(smollm2_64):
    model = smollm2_64
    padded = [PAD] * (len(CLEAN) - len(SHORT)) + SHORT
    mask = ids(CLEAN, padded).ne(PAD).long()
    mask[0] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # transformers numbers positions from 0 only if told
    edits = {7: [AblateHeads([4]), ScaleHeads([2.0] * HEADS)], 12: Knockout(offsets(-1, -1))}
    with qkv.edit(model, edits):
        batch = logits(model, ids(CLEAN, padded), attention_mask=mask, position_ids=positions)
        alone = [logits(model, ids(CLEAN)), logits(model, ids(SHORT))]
        torch.testing.assert_close(batch[0], alone[0][0], atol=1e-9, rtol=0)
        torch.testing.assert_close(batch[1, -len(SHORT) :], alone[1][0], atol=1e-9, rtol=0)
        tokens, steps = generate(model, ids(CLEAN, padded), True, attention_mask=mask)
        one, one_steps = generate(model, ids(SHORT), True)
    assert torch.equal(tokens[1, -3:], one[0, -3:])
    torch.testing.assert_close(steps[1], one_steps[0], atol=1e-9, rtol=0)
    assert float((alone[1] - logits(model, ids(SHORT))).abs().max()) > 1e-2  # the edits mattered


# ------------------------------------------------------------------ bad input


def test_bad_input_is_refused_with_an_error_that_names_it(smollm2):
    x = ids(SHORT)
    with torch.no_grad(), qkv.record(smollm2, layers=0, hooks=("pattern", "z")) as rec:
        smollm2(ids(SHORT, SHORT))  # a batch of 2, 5 tokens
    pattern, z = rec["blocks.0.attn.hook_pattern"], rec["blocks.0.attn.hook_z"]  # (2, 9, 5, 5), (2, 5, 9, 64)
    refused = [
        ({0: AblateHeads(9)}, x, r"AblateHeads: heads: expected indices in \[0, 9\)"),
        ({LAYERS: AblateHeads(0)}, x, r"edit: layers \[30\] are not attention layers"),
        ({0: PatchPattern(0, -1, pattern[:1, :1, -1:])}, ids(SHORT[:4]), r"pattern expected shape \(\.\.\., 1, 1, 4\)"),
        ({0: PatchPattern(0, -1, pattern[:, :1, -1:])}, x, r"PatchPattern: pattern: .* batch \(2,\).* batch \(1,\)"),
        ({0: PatchPattern(0, -1, pattern[:, :1, -1:])}, ids(*[SHORT] * 3), r"batch \(2,\).* batch \(3,\)"),
        ({0: PatchZ(0, -1, z[:, -1:, :1])}, ids(*[SHORT] * 3), r"PatchZ: z: .* batch \(2,\).* batch \(3,\)"),
        ({0: PatchZ([0, 1], -1, z[:, -1:, :1])}, ids(SHORT, SHORT), r"PatchZ: z expected shape \(\.\.\., 1, 2, 64\)"),
        ({0: AblateHeads(0, how=torch.zeros(E - 1))}, x, r"AblateHeads: how expected a tensor of shape \(1, 64\)"),
    ]
    for edits, run_on, message in refused:
        with pytest.raises(ValueError, match=message), qkv.edit(smollm2, edits):
            logits(smollm2, run_on)
    with pytest.raises(ValueError, match=r"record: layers: expected indices in \[0, 30\)"), qkv.record(smollm2, layers=-31):
        pass
    with pytest.raises(TypeError, match=r"PatchPattern: pattern expected a float tensor"):
        PatchPattern(0, -1, pattern.long())
    # a recording of another dtype is cast to the call's; one row of a recording patches every row alike
    with qkv.edit(smollm2, {0: PatchZ(0, -1, z[:1, -1:, :1].double())}):
        both = logits(smollm2, ids(SHORT, SHORT))
    with qkv.edit(smollm2, {0: PatchZ(0, -1, z[:1, -1:, :1])}):
        torch.testing.assert_close(both[:1], logits(smollm2, x), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ an encoder: all-MiniLM-L6-v2


def test_encoder_head_output_patching_and_ablation_equal_the_hook_on_its_output_dense(minilm):
    clean = ids([101, 1996, 4937, 2938, 2006, 1996, 13523, 1012, 102])  # [CLS] the cat sat on the mat . [SEP]
    corrupted = ids([101, 1996, 3899, 2938, 2006, 1996, 20452, 1012, 102])  # ... dog ... rug ...
    layer, head = 3, 5
    dense = minilm.encoder.layer[layer].attention.output.dense  # BERT keeps W_O outside its attention module
    with torch.no_grad(), qkv.record(minilm, layers=layer, hooks=("z",)) as rec:
        minilm(clean)
    z = rec[f"blocks.{layer}.attn.hook_z"]  # (1, 9, 12, 32)
    edits = {layer: [PatchZ(head, slice(None), z[:, :, head : head + 1]), AblateHeads(0)]}

    def by_hand(x):
        x[:, :, head], x[:, :, 0] = z[:, :, head], 0

    with torch.no_grad():
        with qkv.edit(minilm, edits):
            got = minilm(corrupted).last_hidden_state
        with on_z(dense, by_hand, e=32):
            want = minilm(corrupted).last_hidden_state
        plain = minilm(corrupted).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    assert float((got - plain).abs().max()) > 1e-3
