"""Audit of ``attn_implementation="qkv"`` against transformers' own ``sdpa`` and ``eager``, in float64.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

Oracles: the same tiny random model (hidden size 32, 2 layers, 12 tokens) run with
``"sdpa"`` (outputs) and ``"eager"`` (weights, and outputs where a family has no sdpa), to
1e-10 in float64. transformers' eager takes its softmax in float32 whatever the inputs
(``softmax(..., dtype=torch.float32)``): about 1e-8 of error, and NaN at a left-padded row
(``finfo(float64).min`` becomes ``-inf``), so the ``eager64`` fixture keeps it in float64.
Families: Llama (GQA), Mistral (sliding window 4 < 12 tokens), Gemma 2 (soft-capping,
alternating sliding layers, ``query_pre_attn_scalar``), Gemma 3, GPT-2, BERT, T5 (relative
position bias, cross-attention). Differences transformers' eager and sdpa do not agree on,
or that qkv keeps on purpose, are strict xfails with the reason.
"""

import copy

import pytest
import torch

hf = pytest.importorskip("transformers")

from qkv.integrations.transformers import register  # noqa: E402

TOL = dict(atol=1e-10, rtol=0)
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)  # fmt: skip


@pytest.fixture(autouse=True)
def eager64(monkeypatch):
    """transformers' eager softmax in the inputs' float64, rather than its fixed float32 (see the module)."""
    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax64)
    register()


def _config(family: str):
    if family == "llama":
        return hf.LlamaConfig(**COMMON)
    if family == "mistral":
        return hf.MistralConfig(**COMMON, sliding_window=4)
    if family == "gemma2":  # sliding then global; the cap and the larger weights make the soft-capping bite
        return hf.Gemma2Config(**COMMON, sliding_window=4, attn_logit_softcapping=1.0, query_pre_attn_scalar=5,
                               initializer_range=0.3)  # fmt: skip
    if family == "gemma3":
        return hf.Gemma3TextConfig(**COMMON, sliding_window=4, query_pre_attn_scalar=5, initializer_range=0.3,
                                   layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    if family == "gpt2":  # each layer's scale divided by its index + 1
        return hf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                             scale_attn_by_inverse_layer_idx=True)  # fmt: skip
    if family == "bert":
        return hf.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=48)  # fmt: skip
    raise ValueError(family)


def _tiny(family: str):
    torch.manual_seed(0)
    kind = hf.AutoModel if family == "bert" else hf.AutoModelForCausalLM
    return kind.from_config(_config(family), attn_implementation="eager").to(torch.float64).eval()


def _run(model, impl: str, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs)


def _out(result) -> torch.Tensor:
    return result.logits if hasattr(result, "logits") else result.last_hidden_state


def _reference(family: str) -> str:
    return "eager" if family == "gemma2" else "sdpa"  # transformers refuses sdpa with Gemma 2's softcap


IDS = torch.randint(3, 64, (3, 12), generator=torch.Generator().manual_seed(1))
PADDING = torch.ones(3, 12, dtype=torch.long)
PADDING[1, :3] = 0  # left padding
PADDING[2, 9:] = 0  # right padding
FAMILIES = ["llama", "mistral", "gemma2", "gemma3", "gpt2", "bert"]


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_outputs_and_weights_equal_transformers(family, padded):
    """Outputs equal sdpa's (eager's for Gemma 2) and weights eager's, at every real query row."""
    model = _tiny(family)
    inputs = dict(input_ids=IDS, attention_mask=PADDING) if padded else dict(input_ids=IDS)
    real = PADDING.bool() if padded else torch.ones(3, 12, dtype=torch.bool)
    want = _out(_run(model, _reference(family), **inputs))
    eager = _run(model, "eager", **inputs, output_attentions=True).attentions
    ours = _run(model, "qkv", **inputs, output_attentions=True)
    torch.testing.assert_close(_out(ours)[real], want[real], **TOL)
    rows = real[:, None, :, None]
    for mine, theirs in zip(ours.attentions, eager, strict=True):
        torch.testing.assert_close(mine * rows, theirs * rows, **TOL)


def _custom_masks() -> dict[str, torch.Tensor]:
    """4-d masks a user hands the model, (b, 1, i, j): transformers passes them to every layer as they are."""
    n = IDS.shape[1]
    keep = torch.rand(3, 1, n, n, generator=torch.Generator().manual_seed(3)) < 0.6
    keep = (keep & torch.ones(n, n, dtype=torch.bool).tril()) | torch.eye(n, dtype=torch.bool)
    lowest = torch.finfo(torch.float64).min
    empty = keep.clone()
    empty[1, 0, 5] = False  # query 5 of row 1 may see no key
    bias = torch.randn(3, 1, n, n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return {
        "bool": keep,
        "bool-empty-row": empty,
        "float": torch.zeros(3, 1, n, n, dtype=torch.float64).masked_fill(~keep, lowest),
        "float-empty-row": torch.zeros(3, 1, n, n, dtype=torch.float64).masked_fill(~empty, lowest),
        "bias": bias.masked_fill(~keep, lowest),
    }


@pytest.mark.parametrize("name", list(_custom_masks()))
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_custom_4d_masks_equal_sdpa(family, name):
    """A custom 4-d mask: qkv equals sdpa everywhere (eager adds a bool mask as 0/1, so it is no oracle for bool).

    A float mask whose row blocks every key is, to eager and sdpa, a softmax of equal logits
    (``s + min`` rounds to ``min``): every key weighs ``1/j``; read as a bool mask it was
    qkv's fully masked row of zeros.
    """
    model = _tiny(family)
    mask = _custom_masks()[name]
    want = _out(_run(model, "sdpa", input_ids=IDS, attention_mask=mask))
    ours = _run(model, "qkv", input_ids=IDS, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(_out(ours), want, **TOL)
    if mask.dtype != torch.bool:  # eager reads a float mask as sdpa does
        eager = _run(model, "eager", input_ids=IDS, attention_mask=mask, output_attentions=True).attentions
        for mine, theirs in zip(ours.attentions, eager, strict=True):
            torch.testing.assert_close(mine, theirs, **TOL)


def test_a_soft_capped_model_refuses_a_float_mask_with_a_fully_blocked_row():
    """Gemma 2 with such a mask: eager caps and then adds it; qkv cannot, and says so rather than give zeros."""
    model = _tiny("gemma2")
    with pytest.raises(ValueError, match="softcap: cannot be combined with an additive float attention_mask"):
        _run(model, "qkv", input_ids=IDS, attention_mask=_custom_masks()["float-empty-row"])


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "gemma3", "gpt2"])
def test_greedy_generation_and_a_cached_prefill_chunk_equal_transformers(family):
    """generate() with a KV cache (left-padded batch and a lone prompt) gives the same tokens; a second prefill chunk
    (5 queries on 12 keys) the same logits."""
    model = _tiny(family)
    left = torch.ones(3, 12, dtype=torch.long)
    left[1, :3] = 0
    left[2, :7] = 0
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got, want = {}, {}
    for impl, into in ((_reference(family), want), ("qkv", got)):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            into["batch"] = model.generate(input_ids=IDS, attention_mask=left, **settings)
            into["one"] = model.generate(input_ids=IDS[:1], **settings)
            first = model(input_ids=IDS[:, :7], attention_mask=left[:, :7], use_cache=True)
            into["chunk"] = model(input_ids=IDS[:, 7:], attention_mask=left, past_key_values=first.past_key_values).logits
    assert torch.equal(got["batch"], want["batch"]) and torch.equal(got["one"], want["one"])
    torch.testing.assert_close(got["chunk"], want["chunk"], **TOL)


@pytest.mark.parametrize("family", ["llama", "gemma2", "bert"])
def test_gradients_of_a_loss_equal_transformers(family):
    """d loss / d parameters equals sdpa's (eager's for Gemma 2) with grad enabled, labels on real tokens only."""
    model = _tiny(family)
    follows_real = torch.cat([torch.ones(3, 1, dtype=torch.bool), PADDING[:, :-1].bool()], 1)
    labels = IDS.masked_fill(~(PADDING.bool() & follows_real), -100)  # no loss on a row a padded token predicts
    grads = {}
    for impl in (_reference(family), "qkv"):
        copied = copy.deepcopy(model)
        copied.set_attn_implementation(impl)
        _loss(copied, labels).backward()
        grads[impl] = {name: p.grad for name, p in copied.named_parameters() if p.grad is not None}
    assert grads["qkv"].keys() == grads[_reference(family)].keys()
    for name, grad in grads["qkv"].items():
        torch.testing.assert_close(grad, grads[_reference(family)][name], **TOL, msg=name)


def _loss(model, labels: torch.Tensor) -> torch.Tensor:
    """The language-modelling loss; for the encoder (BERT), the squared sum of its real tokens' hidden states."""
    if not isinstance(model, hf.BertModel):
        return model(input_ids=IDS, attention_mask=PADDING, labels=labels).loss
    return (model(input_ids=IDS, attention_mask=PADDING).last_hidden_state * PADDING[..., None]).square().sum()


def test_t5_relative_bias_and_cross_attention_equal_transformers():
    """T5 (position_bias in every layer, causal decoder, cross-attention to a right-padded encoder): logits, the three
    kinds of weights and greedy tokens."""
    config = hf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    model = hf.AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager").to(torch.float64).eval()
    right = torch.ones(3, 12, dtype=torch.long)
    right[1, 8:] = 0
    right[2, 5:] = 0
    inputs = dict(input_ids=IDS, attention_mask=right, decoder_input_ids=IDS[:, :6])
    want = _run(model, "sdpa", **inputs).logits
    eager = _run(model, "eager", **inputs, output_attentions=True)
    ours = _run(model, "qkv", **inputs, output_attentions=True)
    torch.testing.assert_close(ours.logits, want, **TOL)
    for kind in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        for mine, theirs in zip(getattr(ours, kind), getattr(eager, kind), strict=True):
            torch.testing.assert_close(mine, theirs, **TOL)
    settings = dict(input_ids=IDS, attention_mask=right, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad():
        tokens = model.generate(**settings)
        model.set_attn_implementation("sdpa")
        assert torch.equal(tokens, model.generate(**settings))


def test_gpt2_reorder_and_upcast_equals_eagers_own_float32_path():
    """GPT-2's ``reorder_and_upcast_attn`` is an eager-only float32 path (float64 raises there); qkv and sdpa get the
    interface's call with the layer-scaled ``scaling``, and agree with it to float32 rounding."""
    config = hf.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                           scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True)  # fmt: skip
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    _equal_to_eager_in_float32(model)


def test_gpt_oss_sinks_equal_eager_in_float32():
    """gpt-oss (``s_aux`` sinks, sliding and global layers): its experts' grouped matmul has no float64, so float32."""
    config = hf.GptOssConfig(**COMMON, sliding_window=4, num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # initialised near 0; of size 1 they matter
    _equal_to_eager_in_float32(model)


def _equal_to_eager_in_float32(model) -> None:
    """Logits (1e-5) and attention weights (1e-6) at the real tokens, qkv against eager, on the padded batch."""
    eager = _run(model, "eager", input_ids=IDS, attention_mask=PADDING, output_attentions=True)
    ours = _run(model, "qkv", input_ids=IDS, attention_mask=PADDING, output_attentions=True)
    real = PADDING.bool()
    torch.testing.assert_close(ours.logits[real], eager.logits[real], atol=1e-5, rtol=0)
    for mine, theirs in zip(ours.attentions, eager.attentions, strict=True):
        torch.testing.assert_close(mine * real[:, None, :, None], theirs * real[:, None, :, None], atol=1e-6, rtol=0)


PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2]])


@pytest.mark.parametrize("case", ["one-row", "two-rows", "padded", "flash-kwargs"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_training_forwards_equal_transformers(family, case):
    """Restarting position_ids of a training forward (no cache), as transformers packs them, with or without padding
    and flash's cu_seq_lens."""
    model = _tiny(family)
    inputs = dict(input_ids=IDS[:1], position_ids=PACKED[:1], use_cache=False)
    if case == "two-rows":
        inputs.update(input_ids=IDS[:2], position_ids=PACKED)
    if case == "padded":
        inputs["attention_mask"] = torch.tensor([[1] * 10 + [0] * 2])
    if case == "flash-kwargs":
        offsets = torch.tensor([0, 5, 8, 12])
        inputs.update(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=5, max_length_k=5)
    real = inputs.get("attention_mask", torch.ones(1, 12)).bool().expand(inputs["input_ids"].shape[0], -1)
    want = _run(model, _reference(family), **inputs).logits
    torch.testing.assert_close(_run(model, "qkv", **inputs).logits[real], want[real], **TOL)


def test_dropout_in_train_mode_has_eagers_statistics():
    """Dropout's draws differ; their mean (the eval output) and spread agree with eager's over 2000 draws."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from qkv.integrations.transformers import attention_forward

    layer = torch.nn.Module().train()
    layer.num_key_value_groups, layer.is_causal = 2, True
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 6, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    causal = torch.zeros(6, 6, dtype=torch.float64).masked_fill(torch.ones(6, 6).triu(1).bool(), torch.finfo(torch.float64).min)
    torch.manual_seed(1)
    ours = torch.stack([attention_forward(layer, q, k, v, None, dropout=0.5, scaling=0.35)[0] for _ in range(2000)])
    eager = torch.stack([eager_attention_forward(layer, q, k, v, causal[None, None], dropout=0.5, scaling=0.35)[0]
                         for _ in range(2000)])  # fmt: skip
    mean = eager_attention_forward(layer.eval(), q, k, v, causal[None, None], dropout=0.0, scaling=0.35)[0]
    assert not torch.equal(ours[0], ours[1])
    for draws in (ours, eager):  # standard error of each mean is about std / sqrt(2000) = 0.013
        assert float((draws.mean(0) - mean).abs().max()) < 0.08
    assert abs(float(ours.std(0).mean() / eager.std(0).mean()) - 1) < 0.05


# ---------------------------------------------------------------- differences kept, with the reason


@pytest.mark.xfail(strict=True, reason="deliberate: with a cache (an eval forward's default) qkv reads restarting "
                   "position_ids as packed sequences, as flash_attention_2 does; sdpa and eager read one sequence "
                   "(tests/test_integrations_transformers_packing.py pins qkv's reading)")  # fmt: skip
def test_packed_positions_with_a_cache_equal_sdpa():
    model = _tiny("llama")
    inputs = dict(input_ids=IDS[:1], position_ids=PACKED[:1])
    torch.testing.assert_close(_run(model, "qkv", **inputs).logits, _run(model, "sdpa", **inputs).logits, **TOL)


@pytest.mark.xfail(strict=True, reason="eager and sdpa disagree: a left-padded query row that sees no key is eager's "
                   "mean of every value (a softmax of equal minima) and sdpa's zeros; qkv gives zeros, as sdpa and "
                   "qkv's own convention do, so Gemma 2 (eager only) differs at padded rows, never at real ones")  # fmt: skip
def test_gemma2_padded_rows_equal_eager():
    model = _tiny("gemma2")
    want = _run(model, "eager", input_ids=IDS, attention_mask=PADDING).logits
    torch.testing.assert_close(_run(model, "qkv", input_ids=IDS, attention_mask=PADDING).logits, want, **TOL)


IMPL = "qkv"


@pytest.mark.xfail(strict=True, reason="documented: qkv returns the weights before dropout, eager those after it")
def test_weights_under_dropout_are_eagers_dropped_weights():
    model = _tiny("llama")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # read by each layer's forward in train mode
    model.set_attn_implementation(IMPL)
    model.train()
    weights = model(input_ids=IDS, output_attentions=True).attentions[0]
    assert not torch.allclose(weights.sum(-1), torch.ones(()).double())  # eager's dropped rows do not sum to 1
