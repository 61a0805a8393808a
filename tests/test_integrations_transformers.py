"""Tests of ``qkv.integrations.transformers``: ``attn_implementation="qkv"`` against transformers' ``eager``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

Oracles: transformers' own ``eager`` attention (the literal softmax) on the same model and
inputs (sliced to the heads and rows ``weights_for`` chooses), and its ``sdpa`` attention for
calls without a mask. Real models: the packaged
all-MiniLM-L6-v2 (a BERT encoder) and SmolLM2-135M-Instruct (a Llama, from GGUF); the
other decoder families are tiny random models built from a config (no download).
"""

import importlib.util
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv
from qkv.integrations import packaged
from packaged_models import minilm_folder, smollm2_files, smollm2_model

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the transformers extra)")


def test_register_without_transformers_says_what_to_install(monkeypatch):
    from qkv.integrations import transformers as integration

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)
    with pytest.raises(ImportError, match=r'needs Hugging Face transformers: pip install "\.\[transformers\]" in qkv\'s folder: transformers'):
        integration.register()


def test_import_qkv_never_imports_transformers():
    # a fresh interpreter in which transformers cannot be imported at all
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import qkv, qkv.integrations, qkv.integrations.transformers, qkv.integrations.packaged\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


# ---------------------------------------------------------------- the attention function itself

if HAS_TRANSFORMERS:
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from qkv.integrations.transformers import attention_forward, register
    from qkv.integrations.transformers_masks import LayerMask

    register()


class _Layer(torch.nn.Module):
    """What transformers' attention functions read from a layer."""

    def __init__(self, is_causal: bool, groups: int = 1, output_attentions: bool = False):
        super().__init__()
        self.is_causal = is_causal
        self.num_key_value_groups = groups
        self.config = type("Config", (), {"output_attentions": output_attentions})()


def _qkv_inputs(b=2, h=6, g=3, i=5, j=7, d=11, e=13, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, i, d, generator=gen), torch.randn(b, g, j, d, generator=gen),
            torch.randn(b, g, j, e, generator=gen))  # fmt: skip


@needs_transformers
@pytest.mark.parametrize(("i", "j"), [(5, 5), (1, 7), (4, 4)])
@pytest.mark.parametrize("module_causal", [True, False])
@pytest.mark.parametrize("call_causal", [None, True, False])
def test_no_mask_takes_causality_from_the_call_like_sdpa(i, j, module_causal, call_causal):
    """attention_mask=None: causal when the call (else the module) says so and i > 1; GQA; d != e."""
    q, k, v = _qkv_inputs(i=i, j=j)
    layer = _Layer(module_causal, groups=2)
    out, weights = attention_forward(layer, q, k, v, None, scaling=0.3, is_causal=call_causal)
    expected, _ = sdpa_attention_forward(layer, q, k, v, None, scaling=0.3, is_causal=call_causal)
    assert weights is None and out.shape == (2, i, 6, 13)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_transformers
@pytest.mark.parametrize("budget", [2**26, 0])  # weights from materialised logits, or rebuilt after the fused kernel
def test_weights_are_returned_when_asked_by_the_call_or_the_config(budget, monkeypatch):
    monkeypatch.setattr(qkv.backends, "MATERIALISE_ELEMENTS", budget)
    q, k, v = _qkv_inputs()
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True  # every row sees a key
    out, weights = attention_forward(_Layer(False), q, k, v, mask, output_attentions=True)
    logits = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, dim=1)) / 11**0.5
    expected = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
    assert attention_forward(_Layer(False), q, k, v, mask, output_attentions=False)[1] is None
    assert attention_forward(_Layer(False, output_attentions=True), q, k, v, mask)[1] is not None
    # eager's float 4-d mask (0 / the dtype's minimum) is the same bool mask
    blocked = torch.zeros(2, 1, 5, 7).masked_fill(~mask, torch.finfo(torch.float32).min)
    out_blocked, _ = attention_forward(_Layer(False), q, k, v, blocked)
    torch.testing.assert_close(out_blocked, out, atol=1e-6, rtol=1e-5)


@needs_transformers
def test_a_float_mask_with_other_values_is_a_bias_and_cannot_be_soft_capped():
    q, k, v = _qkv_inputs()
    bias = torch.randn(2, 1, 5, 7, generator=torch.Generator().manual_seed(3))
    out, _ = attention_forward(_Layer(False), q, k, v, bias)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"softcap: cannot be combined with an additive float attention_mask or position_bias"):
        attention_forward(_Layer(False), q, k, v, bias, softcap=5.0)


@needs_transformers
def test_softcap_and_sinks_equal_eager_formulas():
    """Gemma 2's cap c·tanh(s/c) on the scaled logits; GPT-OSS's sink logit in each row's denominator."""
    q, k, v = _qkv_inputs(i=6, j=6)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(4))
    out, weights = attention_forward(_Layer(True), q, k, v, None, scaling=0.5, softcap=0.7, s_aux=sinks,
                                     output_attentions=True)  # fmt: skip
    logits = 0.7 * torch.tanh(torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, dim=1)) * 0.5 / 0.7)
    logits = logits.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    with_sink = torch.cat([logits, sinks[None, :, None, None].expand(2, 6, 6, 1)], dim=-1)
    expected_weights = torch.softmax(with_sink, dim=-1)[..., :-1]
    expected = expected_weights @ v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    fused, _ = attention_forward(_Layer(True), q, k, v, None, scaling=0.5, softcap=0.7, s_aux=sinks)  # no weights
    torch.testing.assert_close(fused, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


@needs_transformers
def test_sliding_window_without_a_mask_is_applied_from_the_call():
    q, k, v = _qkv_inputs(i=6, j=6)
    out, _ = attention_forward(_Layer(True), q, k, v, None, sliding_window=3)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


@needs_transformers
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"block_indices": 3, "rope_deltas": 2}, TypeError, r"cannot honour the keyword argument\(s\) \['block_indices', 'rope_deltas'\]"),
        ({"cu_seq_lens_q": torch.tensor([0, 3])}, ValueError, r"cu_seq_lens_q: expected offsets from 0, non-decreasing, ending at the \d+ packed tokens"),
        ({"seq_idx": torch.zeros(3, dtype=torch.long)}, ValueError, r"seq_idx: expected a sequence index per token"),
        ({"sliding_window": 0}, ValueError, r"sliding_window: expected a positive int or None, got 0"),
    ],
)  # fmt: skip
def test_keywords_it_cannot_honour_raise(kwargs, error, message):
    q, k, v = _qkv_inputs()
    with pytest.raises(error, match=message):
        attention_forward(_Layer(True), q, k, v, None, **kwargs)


@needs_transformers
def test_masks_it_cannot_read_raise():
    q, k, v = _qkv_inputs()
    with pytest.raises(ValueError, match=r"attention_mask: expected a qkv mask or a 4-d \(b, 1, i, j\) tensor, got shape \(2, 7\)"):
        attention_forward(_Layer(False), q, k, v, torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"attention_mask: expected a qkv.masks mask, a 4-d tensor or None, got list"):
        attention_forward(_Layer(False), q, k, v, [[True]])


@needs_transformers
def test_ignored_keywords_and_none_values_pass():
    q, k, v = _qkv_inputs()
    plain, _ = attention_forward(_Layer(False), q, k, v, None)
    out, _ = attention_forward(
        _Layer(False), q, k, v, None, position_ids=torch.arange(5)[None], use_cache=True, cu_seq_lens_q=None,
        output_hidden_states=False, token_type_ids=torch.ones(2, 5, dtype=torch.long),
    )  # fmt: skip
    assert torch.equal(out, plain)


# ---------------------------------------------------------------- weights_for: only some heads and rows

CHOSEN = {"heads": [4, 1], "rows": [0, 6, -1]}  # unsorted, and from the end: the order is kept


def _chosen(weights: torch.Tensor) -> torch.Tensor:
    """``(b, h, i, j)`` weights cut to :data:`CHOSEN` by plain indexing (not qkv's)."""
    return weights[:, CHOSEN["heads"]][:, :, CHOSEN["rows"]]


@needs_transformers
@pytest.mark.parametrize("causal", [True, False])
def test_weights_for_selects_from_the_same_attention_without_materialising(causal, monkeypatch):
    from qkv.backends import reference

    q, k, v = _qkv_inputs(i=7, j=9)
    layer = _Layer(causal, groups=2)
    plain, _ = attention_forward(layer, q, k, v, None, scaling=0.3)
    _, every = attention_forward(layer, q, k, v, None, scaling=0.3, output_attentions=True)  # materialised

    def materialise(req):
        raise AssertionError("weights_for took the path that materialises every weight")

    monkeypatch.setattr(reference, "run", materialise)
    out, weights = attention_forward(layer, q, k, v, None, scaling=0.3, output_attentions=True, weights_for=CHOSEN)
    assert weights.shape == (2, 2, 3, 9)
    torch.testing.assert_close(weights, _chosen(every), atol=2e-6, rtol=0)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)
    _, from_config = attention_forward(_Layer(causal, output_attentions=True), q, k, v, None, scaling=0.3,
                                       weights_for=CHOSEN)  # fmt: skip
    torch.testing.assert_close(from_config, weights, atol=0, rtol=0)


@needs_transformers
def test_weights_for_needs_output_attentions_and_indices_in_range():
    q, k, v = _qkv_inputs(i=7)
    needs = r"weights_for: selects which of the weights output_attentions returns, so it needs output_attentions=True"
    with pytest.raises(ValueError, match=needs):
        attention_forward(_Layer(False), q, k, v, None, weights_for=CHOSEN)
    with pytest.raises(ValueError, match=r"weights_for: 'rows' expected indices in \[0, 7\), got \[9\]"):
        attention_forward(_Layer(False), q, k, v, None, output_attentions=True, weights_for={"rows": [9]})


def _chosen_match_eager(model, batch) -> None:
    """``weights_for`` on ``"qkv"``: eager's weights sliced; real tokens' hidden states unchanged."""
    real = batch["attention_mask"].bool()
    assert not bool(real.all())  # the batch is padded
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(**batch, output_attentions=True)
        model.set_attn_implementation("qkv")
        plain = model(**batch)
        chosen = model(**batch, output_attentions=True, weights_for=CHOSEN)
    torch.testing.assert_close(chosen.last_hidden_state[real], eager.last_hidden_state[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(chosen.last_hidden_state[real], plain.last_hidden_state[real], atol=1e-5, rtol=0)
    keep = real[:, CHOSEN["rows"]]  # rows of padding tokens are not compared
    assert bool(keep.any()) and not bool(keep.all())
    for layer, (mine, theirs) in enumerate(zip(chosen.attentions, eager.attentions)):
        assert mine.shape == (real.shape[0], 2, 3, real.shape[1])
        torch.testing.assert_close(mine.transpose(1, 2)[keep], _chosen(theirs).transpose(1, 2)[keep], atol=1e-5,
                                   rtol=0, msg=f"layer {layer}")  # fmt: skip


# ---------------------------------------------------------------- MiniLM, a BERT encoder

SENTENCES = [
    "Attention lets every token look at every other token.",
    "The cat sat on the mat.",
    "A longer sentence, so that the two short ones above are padded on the right by the tokenizer.",
]


@pytest.fixture(scope="module")
def minilm():
    folder = minilm_folder()
    model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(folder)


def _mean_pooled(hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    summed = (hidden * real[..., None]).sum(1) / real.sum(1, keepdim=True)
    return torch.nn.functional.normalize(summed, dim=-1)


def test_minilm_qkv_equals_eager_on_a_padded_batch(minilm):
    model, tokenizer = minilm
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    assert not bool(real.all())  # the batch is padded
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager = model(**batch, output_attentions=True)
        model.set_attn_implementation("qkv")
        ours = model(**batch, output_attentions=True)
    assert model.config._attn_implementation == "qkv"
    torch.testing.assert_close(ours.last_hidden_state[real], eager.last_hidden_state[real], atol=1e-5, rtol=0)
    assert len(ours.attentions) == len(eager.attentions) == 6
    rows = real[:, None, :, None]  # weights of real queries (padded rows are padding's own business)
    for mine, theirs in zip(ours.attentions, eager.attentions):
        assert mine.shape == theirs.shape == (3, 12, real.shape[1], real.shape[1])
        torch.testing.assert_close(mine * rows, theirs * rows, atol=1e-5, rtol=0)
    cosine = (_mean_pooled(ours.last_hidden_state, real) * _mean_pooled(eager.last_hidden_state, real)).sum(-1)
    assert float((1 - cosine).abs().max()) <= 1e-6


def test_minilm_weights_for_on_a_right_padded_batch(minilm):
    model, tokenizer = minilm
    _chosen_match_eager(model, tokenizer(SENTENCES, padding=True, return_tensors="pt"))


EAGER_IGNORES = r'weights_for: only qkv\'s attention reads it, and this model runs attn_implementation=\'{}\'.*attn_implementation="qkv" after qkv.integrations.transformers.register\(\)'


def test_minilm_weights_for_on_an_eager_model_says_how_to_load_it(minilm):
    """It was ignored: an eager model returned all (b, h, i, j) weights as if weights_for were not there."""
    model, tokenizer = minilm
    batch = tokenizer(SENTENCES[:2], padding=True, return_tensors="pt")
    model.set_attn_implementation("eager")
    with torch.no_grad(), pytest.raises(TypeError, match=EAGER_IGNORES.format("eager")):
        model(**batch, output_attentions=True, weights_for=CHOSEN)
    with torch.no_grad():
        model.set_attn_implementation("qkv")  # the fix the message names
        chosen = model(**batch, output_attentions=True, weights_for=CHOSEN)
    assert chosen.attentions[0].shape == (2, 2, 3, batch["input_ids"].shape[1])


@needs_transformers
def test_other_attention_functions_refuse_weights_for_and_are_otherwise_unchanged():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q, k, v = _qkv_inputs()
    layer = _Layer(False, groups=2)
    assert ALL_ATTENTION_FUNCTIONS.get_interface("qkv", None) is attention_forward
    sdpa = ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    with pytest.raises(TypeError, match=EAGER_IGNORES.format("sdpa")):
        sdpa(layer, q, k, v, None, weights_for=CHOSEN)
    out, _ = sdpa(layer, q, k, v, None, scaling=0.3, weights_for=None)
    torch.testing.assert_close(out, sdpa_attention_forward(layer, q, k, v, None, scaling=0.3)[0], atol=0, rtol=0)
    wrapped = type(ALL_ATTENTION_FUNCTIONS).get_interface
    register()  # again: the lookup is wrapped once, not once per call
    assert type(ALL_ATTENTION_FUNCTIONS).get_interface is wrapped


@needs_transformers
@pytest.mark.skipif(packaged.minilm() is None, reason="the packaged all-MiniLM-L6-v2 is not installed (its tokenizer)")
def test_tiny_llama_weights_for_on_a_left_padded_bert_tokenizer_batch(tmp_path):
    """A Llama given a BERT tokenizer's whole output: its token_type_ids reach attention, ignored as eager does."""
    from inspect_models import tiny_llama

    folder = tiny_llama(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    assert "token_type_ids" in batch
    _chosen_match_eager(AutoModel.from_pretrained(folder, attn_implementation="eager").eval(), batch)


# ---------------------------------------------------------------- SmolLM2, a Llama decoder from GGUF


@pytest.fixture(scope="module")
def smollm2():
    folder, gguf_file = smollm2_files()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, padding_side="left")
    return smollm2_model("eager"), tokenizer


def test_smollm2_qkv_equals_eager_on_a_left_padded_batch(smollm2):
    model, tokenizer = smollm2
    batch = tokenizer(["The capital of France is", "Attention is"], padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    assert not bool(real[:, 0].all()) and bool(real[:, -1].all())  # padded on the left
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        eager_logits = model(**batch).logits
        eager_tokens = model.generate(**batch, **settings)
        model.set_attn_implementation("qkv")
        logits = model(**batch).logits
        tokens = model.generate(**batch, **settings)
    torch.testing.assert_close(logits[real], eager_logits[real], atol=1e-3, rtol=0)
    assert torch.equal(tokens, eager_tokens)


# ---------------------------------------------------------------- decoder families, tiny and random

def _switch_off_softcap_and_sinks(model) -> None:
    """Gemma 2 without logit soft-capping, GPT-OSS without sinks: to show that the tests exercise them."""
    for layer in model.model.layers:
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.data.fill_(-1e4)  # exp(-1e4) = 0: no sink
        if hasattr(layer.self_attn, "attn_logit_softcapping"):
            layer.self_attn.attn_logit_softcapping = None


COMMON = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, head_dim=8)  # fmt: skip


def _config(family: str, layers: int = 2):
    import transformers as hf

    common = {**COMMON, "num_hidden_layers": layers}
    if family == "llama":
        return hf.LlamaConfig(**common)
    if family == "gemma2":  # layer 0 sliding (window 4 < the 9 + 6 tokens), layer 1 global
        # logits soft-capped at 1; larger weights and scale than the defaults so the cap bites
        return hf.Gemma2Config(**common, sliding_window=4, attn_logit_softcapping=1.0, final_logit_softcapping=None,
                               query_pre_attn_scalar=8, initializer_range=0.3)  # fmt: skip
    if family == "gpt_oss":  # attention sinks in every layer; sliding (window 4) and global layers alternate
        return hf.GptOssConfig(**common, sliding_window=4, num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v2":  # multi-head latent attention: q/k size 8 + 4, value size 6
        return hf.DeepseekV2Config(
            **{**common, "num_key_value_heads": 6, "head_dim": None}, q_lora_rank=None, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        )  # fmt: skip
    raise ValueError(family)


def _tiny(family: str, layers: int = 2):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(family, layers), attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.self_attn, "sinks"):  # initialised near 0; logits of size 1 make them matter
                layer.self_attn.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(3, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(3, 9, dtype=torch.long)
    padding[1, :3] = 0
    padding[2, :7] = 0  # left-padded: rows of 9, 6 and 2 tokens
    return model, ids, padding


@needs_transformers
@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "deepseek_v2"])
def test_decoder_family_matches_eager_in_logits_and_greedy_generation(family):
    model, ids, padding = _tiny(family)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(attention_mask)
        return attention_forward(module, query, key, value, attention_mask, **kwargs)

    from transformers import AttentionInterface

    with torch.no_grad():
        eager_logits = model(input_ids=ids, attention_mask=padding).logits
        eager_tokens = model.generate(input_ids=ids, attention_mask=padding, **settings)
        eager_single = model.generate(input_ids=ids[:1], **settings)  # no padding: no 2-d mask at all
        AttentionInterface.register("qkv-spy", spy)
        from transformers.masking_utils import AttentionMaskInterface

        AttentionMaskInterface.register("qkv-spy", AttentionMaskInterface._global_mapping["qkv"])
        model.set_attn_implementation("qkv-spy")
        logits = model(input_ids=ids, attention_mask=padding).logits
        tokens = model.generate(input_ids=ids, attention_mask=padding, **settings)
        single = model.generate(input_ids=ids[:1], **settings)
    real = padding.bool()
    torch.testing.assert_close(logits[real], eager_logits[real], atol=1e-4, rtol=0)
    assert torch.equal(tokens, eager_tokens) and torch.equal(single, eager_single)
    # every layer got a lazy qkv mask (no dense one), a window in Gemma 2's sliding layers
    assert seen and all(isinstance(m, LayerMask) for m in seen)
    assert not any("Dense" in repr(m) for m in seen)
    assert any("window(left=3" in repr(m) for m in seen) == (family in ("gemma2", "gpt_oss"))
    if family in ("gemma2", "gpt_oss"):  # soft-capping / sinks matter here: without them the logits move
        model.set_attn_implementation("eager")
        _switch_off_softcap_and_sinks(model)
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=padding).logits
        assert float((plain - eager_logits)[real].abs().max()) > 1e-2


@needs_transformers
def test_padded_and_unpadded_generation_take_the_plain_lane_in_every_layer(monkeypatch):
    """A padded prompt, its decoding steps and an unpadded prompt reach the kernel without a request: a prompt
    through the plain lane (``qkv.backends.sdpa_plain.run``: the padding mask is one Dense tensor per forward, the
    causal mask ``causal=True``; the forward's second layer reuses the first layer's plan, kept on its mask), a
    decoding step straight to PyTorch's kernel (``qkv.backends.sdpa_direct``: its mask's tensor, or none)."""
    from qkv.backends import sdpa_direct, sdpa_plain

    model, ids, padding = _tiny("llama")
    model.set_attn_implementation("qkv")
    taken, planned, direct = [], [], []
    monkeypatch.setattr(sdpa_direct, "_WAYS", {})  # (no way kept by an earlier test: each shape's first call plans)
    run, plan = sdpa_plain.run, sdpa_plain.plan
    step, unmasked = sdpa_direct.decoding_step, sdpa_direct.unmasked
    monkeypatch.setattr(sdpa_plain, "run", lambda *args: (lambda out: taken.append(out is not None) or out)(run(*args)))
    monkeypatch.setattr(sdpa_plain, "plan", lambda *args: planned.append(True) or plan(*args))
    monkeypatch.setattr(sdpa_direct, "decoding_step", lambda *args: (lambda out: direct.append(("padded", type(out))) or out)(step(*args)))
    monkeypatch.setattr(sdpa_direct, "unmasked", lambda *args: (lambda out: direct.append(("bare", type(out))) or out)(unmasked(*args)))
    settings = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=padding, **settings)  # prefill + 2 steps, 2 layers each
        assert taken == [True] * 2, taken
        # the prompt's first layer and each step's (the door plans a shape once, by the lane's plan): the second
        # layers reuse them
        assert len(planned) == 3, planned
        assert direct == [("padded", torch.Tensor)] * 4, direct
        taken.clear()
        direct.clear()
        model.generate(input_ids=ids[:1], **settings)
        assert taken == [True] * 2, taken
        assert direct == [("bare", torch.Tensor)] * 4, direct


def _decoding_step_inputs(seed=0):
    """A padded batch's decoding step as generate() hands it to a layer: one query row, a LayerMask."""
    from qkv import masks

    q, k, v = _qkv_inputs(b=3, h=6, g=2, i=1, j=9, d=8, e=8, seed=seed)
    starts = torch.tensor([0, 3, 7])  # left padding: rows of 9, 6 and 2 keys
    return q, k, v, LayerMask(masks.starts(starts), (3, 1, 1, 9))


@needs_transformers
def test_a_decoding_step_goes_straight_to_the_plain_lane_and_equals_the_full_path(monkeypatch):
    """A one-token step with the model's own mask skips the keyword checks and dispatch of the full path
    (asserted: they are not reached) and gives what the full path gives."""
    from qkv.integrations import transformers as integration

    q, k, v, mask = _decoding_step_inputs()
    layer = _Layer(is_causal=True, groups=3)
    full, _ = integration.attention_forward(layer, q, k, v, mask, scaling=0.3, output_attentions=False,
                                            position_ids=torch.zeros(3, 1, dtype=torch.long))  # fmt: skip
    monkeypatch.setattr(integration, "_check_keywords", lambda kwargs: pytest.fail("the full path ran"))
    fast, weights = integration.attention_forward(layer, q, k, v, mask, scaling=0.3, output_attentions=False,
                                                  position_ids=torch.zeros(3, 1, dtype=torch.long))  # fmt: skip
    assert weights is None and fast.shape == (3, 1, 6, 8)
    keep = mask.mask.dense(1, 9, q.device)  # (3, 1, 1, 9)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                                            attn_mask=keep, scale=0.3).transpose(1, 2)  # fmt: skip
    torch.testing.assert_close(fast, want, atol=1e-6, rtol=0)
    assert torch.equal(fast, full)


@needs_transformers
def test_a_decoding_steps_nan_in_a_padded_slot_never_reaches_the_output():
    """The step's padding holds a nan and an inf (a cache from ``torch.empty``): PyTorch's kernel would give those
    rows nan; the step gives what it gives with the padded slots zeroed."""
    from qkv.integrations import transformers as integration

    q, k, v, mask = _decoding_step_inputs()
    layer = _Layer(is_causal=True, groups=3)
    clean, _ = integration.attention_forward(layer, q, k, v, mask, scaling=0.3)
    k, v = k.clone(), v.clone()
    k[1, :, 0], v[2, :, 6] = float("nan"), float("inf")  # row 1's padding starts 3 keys in, row 2's 7
    dirty, _ = integration.attention_forward(layer, q, k, v, mask, scaling=0.3)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=1e-6, rtol=0)


@needs_transformers
@pytest.mark.parametrize(
    "extra",
    [{"softcap": 2.0}, {"s_aux": torch.zeros(6)}, {"dropout": 0.5}, {"output_attentions": True},
     {"weights_for": {"heads": [1]}, "output_attentions": True}, {"cu_seq_lens_q": torch.tensor([0, 1, 2, 3]), "cu_seq_lens_k": torch.tensor([0, 9, 18, 27])},
     {"position_bias": torch.zeros(1, 6, 1, 9)}],
    ids=["softcap", "s_aux", "dropout", "output_attentions", "weights_for", "cu_seq_lens", "position_bias"],
)
def test_a_decoding_step_asking_for_more_takes_the_full_path(extra, monkeypatch):
    from qkv.integrations import transformers as integration

    q, k, v, mask = _decoding_step_inputs()
    checked = []
    real = integration._check_keywords
    monkeypatch.setattr(integration, "_check_keywords", lambda kwargs: checked.append(1) or real(kwargs))
    integration.attention_forward(_Layer(is_causal=True, groups=3), q, k, v, mask, **extra)
    assert checked == [1]


@needs_transformers
def test_a_decoding_step_with_an_unknown_keyword_or_weights_in_the_config_is_not_shortened():
    from qkv.integrations import transformers as integration

    q, k, v, mask = _decoding_step_inputs()
    with pytest.raises(TypeError, match=r"cannot honour the keyword argument\(s\) \['head_mask'\]"):
        integration.attention_forward(_Layer(is_causal=True, groups=3), q, k, v, mask, head_mask=torch.ones(6))
    out, weights = integration.attention_forward(_Layer(is_causal=True, groups=3, output_attentions=True), q, k, v, mask)
    assert weights is not None and weights.shape == (3, 6, 1, 9)
    torch.testing.assert_close(weights[1, :, 0, :3], torch.zeros(6, 3))  # the padding gets no weight


@needs_transformers
def test_padded_generation_under_inference_mode_equals_no_grad():
    """The padding mask a step builds under ``torch.inference_mode`` keeps no version counter: it is read, not
    cached (reading the counter raised a RuntimeError in every padded decoding step)."""
    model, ids, padding = _tiny("llama")
    model.set_attn_implementation("qkv")
    settings = dict(input_ids=ids, attention_mask=padding, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        fast = model.generate(**settings)
    with torch.no_grad():
        slow = model.generate(**settings)
    assert torch.equal(fast, slow)


@needs_transformers
def test_static_cache_generation_matches_eager():
    """A static cache's keys run past the tokens seen: the masks shift (δ < 0) and still agree.

    Three layers (sliding, global, sliding), so that the global layer's earlier rows, which
    the shift alone keeps causal in the prefill, feed the keys of the layer after it.
    """
    model, ids, padding = _tiny("gemma2", layers=3)
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        eager_tokens = model.generate(input_ids=ids, attention_mask=padding, **settings)
        model.set_attn_implementation("qkv")
        tokens = model.generate(input_ids=ids, attention_mask=padding, **settings)
    assert torch.equal(tokens, eager_tokens)


@needs_transformers
def test_decoder_weights_with_output_attentions_match_eager():
    model, ids, padding = _tiny("llama")
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=padding, output_attentions=True).attentions
        model.set_attn_implementation("qkv")
        ours = model(input_ids=ids, attention_mask=padding, output_attentions=True).attentions
    rows = padding.bool()[:, None, :, None]
    for mine, theirs in zip(ours, eager):
        assert mine.shape == theirs.shape == (3, 6, 9, 9)
        torch.testing.assert_close(mine * rows, theirs * rows, atol=1e-6, rtol=0)


@needs_transformers
def test_weights_for_on_a_long_input_never_builds_a_layer_of_weights():
    from dispatch_ops import Largest

    model, _, _ = _tiny("llama")
    model.set_attn_implementation("qkv")
    i = 1536
    ids = torch.randint(3, 64, (1, i), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), Largest(new_only=True) as largest:
        out = model.model(input_ids=ids, output_attentions=True, weights_for={"rows": [0, 700, i - 1]})
    layer_of_weights = 6 * i * i * 4  # h x i x j float32: 54 MiB
    assert largest.nbytes < layer_of_weights / 16, (largest.nbytes, layer_of_weights)
    assert [tuple(w.shape) for w in out.attentions] == [(1, 6, 3, i)] * 2


@st.composite
def padded_batches(draw):
    """A decoder family, a batch of 1-3 rows of 1-10 positions, each row's mask left- or right-padded or with holes."""
    family = draw(st.sampled_from(["llama", "gemma2", "gpt_oss", "deepseek_v2"]))
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, 10))
    rows = []
    for _ in range(b):
        real = draw(st.integers(1, n))
        kind = draw(st.sampled_from(["left", "right", "holes"]))
        if kind == "left":
            rows.append([0] * (n - real) + [1] * real)
        elif kind == "right":
            rows.append([1] * real + [0] * (n - real))
        else:  # any pattern with at least one real token
            row = [draw(st.integers(0, 1)) for _ in range(n)]
            row[draw(st.integers(0, n - 1))] = 1
            rows.append(row)
    return family, torch.tensor(rows), draw(st.integers(0, 2**16))


@needs_transformers
@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=padded_batches())
def test_random_padded_batches_give_eager_logits(call):
    """Any padding pattern transformers accepts, on every family qkv serves: the logits of the real positions."""
    from transformers import AutoModelForCausalLM

    family, padding, seed = call
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager").eval()
    ids = torch.randint(3, 64, padding.shape, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=padding).logits
        model.set_attn_implementation("qkv")
        got = model(input_ids=ids, attention_mask=padding).logits
    real = padding.bool()
    torch.testing.assert_close(got[real], eager[real], atol=1e-4, rtol=0)


@needs_transformers
@settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=padded_batches())
def test_random_padded_batches_decode_like_eager(call):
    """Greedy decoding steps over the same padding (each step a one-token call with the padded cache):
    every step's logits as eager's, up to the first step where a near-tie could pick another token. The
    prompt's last position is made real, as generate expects (a padding position's logits mean nothing)."""
    from transformers import AutoModelForCausalLM

    family, padding, seed = call
    padding = padding.clone()
    padding[:, -1] = 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager").eval()
    ids = torch.randint(3, 64, padding.shape, generator=torch.Generator().manual_seed(seed))
    settings_ = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = model.generate(input_ids=ids, attention_mask=padding, **settings_)
        model.set_attn_implementation("qkv")
        got = model.generate(input_ids=ids, attention_mask=padding, **settings_)
    n = padding.shape[1]
    for step, (a, w) in enumerate(zip(got.logits, eager.logits)):
        torch.testing.assert_close(a, w, atol=1e-4, rtol=0, msg=lambda m: f"step {step}: {m}")
        if not torch.equal(got.sequences[:, n + step], eager.sequences[:, n + step]):
            break  # the same logits chose differently (a tie): later steps read different tokens
