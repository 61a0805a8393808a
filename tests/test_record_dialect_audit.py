"""``qkv.record`` / ``qkv.edit`` in transformers models against TransformerLens' own definitions.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``e`` value size.

Oracle: TransformerLens' ``AbstractAttention.forward`` (``components/abstract_attention.py``,
``grouped_query_attention.py``), written out in float64 on the layer's own ``q, k, v`` (caught
on their way into qkv): ``hook_attn_scores (b, h, i, j) = q·k / attn_scale``, soft-capped
inside ``calculate_attention_scores``, position bias added, then ``IGNORE = -inf`` wherever
the causal mask (window included) joined with the padding mask hides a key;
``hook_pattern = softmax`` over keys with NaN (a row that sees nothing) set to 0; ``hook_z (b,
i, h, e) = pattern @ v``; a GQA model's K and V ``repeat_interleave``d to the query heads. A
16-bit model's ``q, k`` are upcast to float32 first (TransformerLens 2.x), so its scores and
pattern are float32 and ``z`` the model's dtype. Edits as TransformerLens hooks would make
them: ``hook_z`` zeroed or set to its mean, ``hook_attn_scores`` set to ``-inf`` at knocked-out
edges, ``hook_pattern`` overwritten at some rows. Tiny random models with distinct sizes (b=2,
h=6, g=2, i=7, e=4), left padding on the first sequence.
"""

import copy
import importlib.util

import pytest
import torch

import qkv
from qkv.edits import AblateHeads, Knockout, PatchPattern, ScaleHeads

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

if importlib.util.find_spec("transformers") is not None:
    import transformers

    from qkv.integrations import transformers as integration

    integration.register()

B, H, G, I, E, VOCAB = 2, 6, 2, 7, 4, 50
TOL = dict(atol=1e-12, rtol=0)  # float64
SMALL = dict(vocab_size=VOCAB, hidden_size=18, intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=H, num_key_value_heads=G, head_dim=E, attn_implementation="qkv")  # fmt: skip


@pytest.fixture
def caught(monkeypatch):
    """``{layer: (q, k, v, options, module)}`` of each layer's last call, caught as it enters qkv."""
    calls = {}
    plain = integration.edits_runner

    def spy(module):
        run = plain(module)

        def catch(q, k, v, **options):
            calls[module.layer_idx] = (q, k, v, options, module)
            return run(q, k, v, **options)

        return catch

    monkeypatch.setattr(integration, "edits_runner", spy)
    return calls


def _inputs():
    ids = torch.randint(1, VOCAB, (B, I), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, I, dtype=torch.long)
    mask[0, :3] = 0  # left padding: sequence 0's first three query rows see no key at all
    return ids, mask


def _keep(mask, i=I, window=None):
    """``(b, 1, i, j)``: TransformerLens' ``apply_causal_mask`` (queries at the last ``i`` positions), padding joined."""
    j = mask.shape[-1]
    query, key = torch.arange(j - i, j)[:, None], torch.arange(j)[None, :]
    causal = key <= query
    if window is not None:  # attn_type "local": key > query - window_size
        causal = causal & (key > query - window)
    return causal[None, None] & mask.bool()[:, None, None, :]


def transformer_lens(q, k, v, scale, keep, softcap=None, bias=None, dtype=torch.float64, hooks=None):
    """``(hook_attn_scores, hook_pattern, hook_z)`` as TransformerLens' attention computes them.

    ``hooks`` maps ``"attn_scores"`` / ``"pattern"`` to a function run at that hook point,
    whose result the layer goes on with, as ``run_with_hooks`` does.
    """
    hooks = hooks or {}
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))  # GroupedQueryAttention: KV head n // group
    scores = q.to(dtype) @ k.to(dtype).transpose(-1, -2) * scale
    if softcap is not None:  # calculate_attention_scores caps, before any bias and the mask
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:  # ALiBi / relative position bias, added before the mask
        scores = scores + bias.to(dtype)
    scores = torch.where(keep, scores, torch.tensor(float("-inf"), dtype=dtype))
    scores = hooks.get("attn_scores", lambda x: x)(scores)
    pattern = scores.softmax(-1)
    pattern = torch.where(pattern.isnan(), torch.zeros_like(pattern), pattern)
    pattern = hooks.get("pattern", lambda x: x)(pattern)
    z = (pattern.to(v.dtype) @ v).transpose(1, 2)  # (b, i, h, e)
    return scores, pattern, z


def _entries(rec, layer):
    return [rec[f"blocks.{layer}.attn.hook_{name}"] for name in ("attn_scores", "pattern", "z")]


def _assert_scores(ours, theirs):
    """-inf exactly where TransformerLens puts IGNORE, the same logits elsewhere."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    hidden = theirs == float("-inf")
    assert torch.equal(ours == float("-inf"), hidden)
    torch.testing.assert_close(ours[~hidden], theirs[~hidden], **TOL)


def _llama(**extra):
    return transformers.LlamaModel(transformers.LlamaConfig(**{**SMALL, **extra})).double().eval()


# ---------------------------------------------------------------- what is recorded


def test_gqa_left_padded_llama_records_transformer_lens_scores_pattern_and_z(caught):
    model = _llama()
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    for layer in (0, 1):
        q, k, v, _, module = caught[layer]
        theirs = transformer_lens(q, k, v, module.scaling, _keep(mask))
        scores, pattern, z = _entries(rec, layer)
        assert scores.shape == pattern.shape == (B, H, I, I) and z.shape == (B, I, H, E)
        _assert_scores(scores, theirs[0])
        torch.testing.assert_close(pattern, theirs[1], **TOL)
        torch.testing.assert_close(z, theirs[2], **TOL)
    assert bool((pattern[0, :, :3] == 0).all() and (z[0, :3] == 0).all())  # padded rows: NaN set to 0, z = 0


def test_chosen_heads_and_rows_index_query_heads_of_each_kv_head(caught):
    model = _llama()
    ids, mask = _inputs()
    heads, rows = [5, 1, 2], [6, 0]  # heads 5 and 1, 2 read KV heads 1 and 0; row 0 of sequence 0 is padding
    with torch.no_grad(), qkv.record(model, layers=1, heads=heads, rows=rows) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, _, module = caught[1]
    scores, pattern, z = transformer_lens(q, k, v, module.scaling, _keep(mask))
    ours = _entries(rec, 1)
    _assert_scores(ours[0], scores[:, heads][:, :, rows])
    torch.testing.assert_close(ours[1], pattern[:, heads][:, :, rows], **TOL)
    torch.testing.assert_close(ours[2], z[:, rows][:, :, heads], **TOL)


def test_a_cached_decoding_step_records_its_row_against_every_cached_key(caught):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).double().eval()
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model, layers=1, rows=[-1]) as rec:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    q, k, v, _, module = caught[1]  # the last step: one query row, I + 2 keys
    assert q.shape[-2] == 1 and k.shape[-2] == I + 2
    seen = torch.cat([mask, torch.ones(B, 2, dtype=mask.dtype)], dim=1)
    theirs = transformer_lens(q, k, v, module.scaling, _keep(seen, i=1))
    ours = _entries(rec, 1)
    _assert_scores(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    torch.testing.assert_close(ours[2], theirs[2], **TOL)


def test_gemma2_soft_cap_is_in_the_scores_before_the_mask_and_its_window(caught):
    config = transformers.Gemma2Config(**SMALL, attn_logit_softcapping=5.0, sliding_window=3, query_pre_attn_scalar=E)
    model = transformers.Gemma2Model(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8)  # logits well past the cap, so an uncapped score would show
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model) as rec:
        model(input_ids=ids, attention_mask=mask)
    assert config.layer_types[0] == "sliding_attention"
    for layer, window in ((0, 3), (1, None)):
        q, k, v, _, module = caught[layer]
        theirs = transformer_lens(q, k, v, module.scaling, _keep(mask, window=window), softcap=5.0)
        scores, pattern, z = _entries(rec, layer)
        _assert_scores(scores, theirs[0])
        assert scores[scores.isfinite()].abs().max() <= 5.0
        torch.testing.assert_close(pattern, theirs[1], **TOL)
        torch.testing.assert_close(z, theirs[2], **TOL)


def test_bert_padding_hides_keys_in_every_row_as_transformer_lens_encoder(caught):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=H,
                                     intermediate_size=16, attn_implementation="qkv")  # fmt: skip
    model = transformers.BertModel(config).double().eval()
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, _, module = caught[1]
    keep = mask.bool()[:, None, None, :].expand(B, 1, I, I)  # HookedEncoder: -inf added at padded keys only
    theirs = transformer_lens(q, k, v, module.scaling, keep)
    ours = _entries(rec, 1)
    _assert_scores(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    torch.testing.assert_close(ours[2], theirs[2], **TOL)


def test_t5_position_bias_is_added_before_the_mask(caught):
    config = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=E, d_ff=16, num_layers=2, num_heads=H,
                                   relative_attention_num_buckets=8, attn_implementation="qkv")  # fmt: skip
    model = transformers.T5EncoderModel(config).double().eval()
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, options, _ = caught[1]
    keep = mask.bool()[:, None, None, :].expand(B, 1, I, I)
    theirs = transformer_lens(q, k, v, 1.0, keep, bias=options["bias"])  # T5: no 1/sqrt(d)
    ours = _entries(rec, 1)
    _assert_scores(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], **TOL)


def test_sixteen_bit_scores_and_pattern_are_float32_as_transformer_lens_upcasts(caught):
    model = transformers.LlamaModel(transformers.LlamaConfig(**SMALL)).to(torch.bfloat16).eval()
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, _, module = caught[1]
    scores, pattern, z = _entries(rec, 1)
    assert (scores.dtype, pattern.dtype, z.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    theirs = transformer_lens(q, k, v, module.scaling, _keep(mask), dtype=torch.float32)
    hidden = theirs[0] == float("-inf")
    assert torch.equal(scores == float("-inf"), hidden)
    torch.testing.assert_close(scores[~hidden], theirs[0][~hidden], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pattern, theirs[1], atol=1e-6, rtol=0)  # float32, not rounded to bfloat16
    torch.testing.assert_close(pattern, scores.softmax(-1).nan_to_num(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(z, theirs[2], atol=2e-2, rtol=2e-2)


def test_sinks_are_no_key_so_pattern_rows_sum_below_one_as_transformers_eager_weights():
    config = transformers.GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1, sliding_window=3,
                                       experts_implementation="eager")  # fmt: skip
    model = transformers.GptOssModel(config).double().eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.normal_(generator=torch.Generator().manual_seed(2))
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids, mask = _inputs()
    with torch.no_grad(), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        weights = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions[1]
    scores, pattern, _ = _entries(rec, 1)
    real = mask.bool()[:, None, :, None].expand_as(pattern)  # eager's padded rows are its own convention
    torch.testing.assert_close(pattern[real], weights[real], **TOL)
    assert scores.shape == pattern.shape  # no column for the sink logit
    assert bool((pattern.sum(-1)[1] < 1 - 1e-3).all())


# ---------------------------------------------------------------- edits, as TransformerLens hooks make them


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_ablating_hook_z_reaches_the_output_projection(caught, how):
    model = _llama()
    ids = _inputs()[0]  # no padding: the mean runs over every position
    into_o_proj = {}
    hook = model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda m, args: into_o_proj.update(z=args[0]))
    try:
        with torch.no_grad(), qkv.edit(model, {1: AblateHeads([5, 1], how=how)}), qkv.record(model, layers=1, hooks=["z"]) as rec:
            model(input_ids=ids)
    finally:
        hook.remove()
    q, k, v, _, module = caught[1]
    z = transformer_lens(q, k, v, module.scaling, _keep(torch.ones(B, I)))[2].clone()
    for head in (5, 1):  # a hook on hook_z: z[:, :, head] = 0, or its mean over batch and positions
        z[:, :, head] = 0 if how == "zero" else z[:, :, head].mean((0, 1))
    torch.testing.assert_close(rec["blocks.1.attn.hook_z"], z, **TOL)
    torch.testing.assert_close(into_o_proj["z"], z.reshape(B, I, H * E), **TOL)


def test_knockout_is_minus_inf_in_hook_attn_scores_and_a_row_with_no_key_left_is_zero(caught):
    model = _llama()
    ids, mask = _inputs()
    edges = torch.rand(B, H, I, I, generator=torch.Generator().manual_seed(3)) < 0.3
    edges[1, 2, 4] = True  # sequence 1, head 2, row 4: every key knocked out (TransformerLens: NaN, set to 0)
    with torch.no_grad(), qkv.edit(model, {1: Knockout(edges)}), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, _, module = caught[1]
    knock_out = {"attn_scores": lambda scores: scores.masked_fill(edges, float("-inf"))}
    theirs = transformer_lens(q, k, v, module.scaling, _keep(mask), hooks=knock_out)
    ours = _entries(rec, 1)
    _assert_scores(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], **TOL)
    torch.testing.assert_close(ours[2], theirs[2], **TOL)
    assert bool((ours[1][1, 2, 4] == 0).all() and (ours[2][1, 4, 2] == 0).all())


def test_patching_hook_pattern_recomputes_z_with_each_query_heads_kv_head(caught):
    model = _llama()
    ids, mask = _inputs()
    heads, rows = [5, 1], [6, 4]
    with torch.no_grad(), qkv.record(model, layers=1, heads=heads, rows=rows, hooks=["pattern"]) as rec:
        model(input_ids=ids.flip(-1), attention_mask=mask)  # the "clean" run
    clean = rec["blocks.1.attn.hook_pattern"]
    with torch.no_grad(), qkv.edit(model, {1: PatchPattern(heads, rows, clean)}), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, _, module = caught[1]

    def patch(pattern):  # overwrite those heads' rows; z = pattern @ v follows the hook
        pattern = pattern.clone()
        for n, head in enumerate(heads):
            pattern[:, head, rows] = clean[:, n]
        return pattern

    scores, pattern, z = transformer_lens(q, k, v, module.scaling, _keep(mask), hooks={"pattern": patch})
    ours = _entries(rec, 1)
    _assert_scores(ours[0], scores)  # hook_attn_scores comes before the patch
    torch.testing.assert_close(ours[1], pattern, **TOL)
    torch.testing.assert_close(ours[2], z, **TOL)


def test_scale_heads_is_a_positive_factor_on_hook_attn_scores(caught):
    model = _llama()
    ids, mask = _inputs()
    scale = torch.tensor([0.5, 1.0, 2.0, 3.0, 1.5, 0.25], dtype=torch.float64)
    with torch.no_grad(), qkv.edit(model, {1: ScaleHeads(scale)}), qkv.record(model, layers=1) as rec:
        model(input_ids=ids, attention_mask=mask)
    q, k, v, _, module = caught[1]  # as the model made them: the edit acts inside the call
    tempered = {"attn_scores": lambda scores: scores * scale[:, None, None]}
    scores, pattern, z = transformer_lens(q, k, v, module.scaling, _keep(mask), hooks=tempered)
    ours = _entries(rec, 1)
    _assert_scores(ours[0], scores)
    torch.testing.assert_close(ours[1], pattern, **TOL)
    torch.testing.assert_close(ours[2], z, **TOL)
