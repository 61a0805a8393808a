"""Tests of ``qkv.edit`` and ``qkv.record`` (``qkv.integrations.transformers_edits``) on the packaged MiniLM.

Shape legend: ``b`` batch, ``h`` query heads, ``i`` query length, ``j`` key length, ``e``
value size.

Oracles: transformers' own ``eager`` attention on a float64 copy of all-MiniLM-L6-v2 (a
6-layer, 12-head BERT), edited by hand the way each edit is defined: a zero ablation as
``W_O``'s columns of that head zeroed, a knockout as ``-inf`` added to eager's logits at
those edges, a mean ablation as TransformerLens' (the head's ``z`` replaced by its mean over
batch and positions), a patch as ``z = α'V`` for that head and row written into eager's
output. The edited qkv runs must take qkv's engines, never an eager fall-back.
"""

import copy
import importlib.util

import pytest
import torch

import qkv
from qkv.edits import AblateHeads, Knockout, PatchPattern, ScaleHeads
from packaged_models import minilm_pair

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
LAYER, HEAD, ROW = 3, 5, 4  # the edited layer, head and query row
HEADS, E = 12, 32
TOL = dict(atol=1e-9, rtol=0)  # float64

SENTENCES = [
    "Attention lets every token look at every other token.",
    "The cat sat on the mat.",
    "A longer sentence, so that the two short ones above are padded on the right by the tokenizer.",
]

if HAS_TRANSFORMERS:
    from transformers import AutoTokenizer
    from transformers.models.bert import modeling_bert

    from qkv.integrations.transformers import register

    register()


@pytest.fixture(scope="module")
def minilm():
    model, eager, folder = minilm_pair()
    return model, eager, AutoTokenizer.from_pretrained(folder)


def _batch(tokenizer, padded=True):
    if padded:
        return tokenizer(SENTENCES, padding=True, return_tensors="pt")
    batch = tokenizer(SENTENCES, truncation=True, max_length=9, padding=True, return_tensors="pt")
    assert bool(batch["attention_mask"].bool().all())  # no padding: every position is a real token
    return batch


@pytest.fixture
def eager_layer(monkeypatch):
    """Edit eager attention at LAYER: ``edit(query, key, value, attention_mask) -> (mask, after)``."""

    def install(before=None, after=None):
        plain = modeling_bert.eager_attention_forward

        def forward(module, query, key, value, attention_mask, **kwargs):
            if module.layer_idx == LAYER and before is not None:
                attention_mask = before(attention_mask, query)
            out, weights = plain(module, query, key, value, attention_mask, **kwargs)  # out (b, i, h, e)
            if module.layer_idx == LAYER and after is not None:
                out = after(out, value)
            return out, weights

        monkeypatch.setattr(modeling_bert, "eager_attention_forward", forward)

    return install


@pytest.fixture
def engines(monkeypatch):
    """The backends qkv's dispatcher chose, and a guard that eager attention never runs."""
    chosen = []
    choose = qkv.backends.choose

    def spy(req, backend="auto"):
        impl, passed = choose(req, backend)
        chosen.append(impl.name)
        return impl, passed

    lane = qkv.backends.sdpa_plain.plain

    def lane_spy(*args):  # qkv.attention's plain-call lane: the sdpa kernel, without choose
        out = lane(*args)
        if out is not None:
            chosen.append("sdpa")
        return out

    monkeypatch.setattr(qkv.backends, "choose", spy)
    monkeypatch.setattr(qkv.backends.sdpa_plain, "plain", lane_spy)
    monkeypatch.setattr(modeling_bert, "eager_attention_forward", _no_eager)
    return chosen


def _no_eager(*args, **kwargs):
    raise AssertionError("eager attention ran inside a qkv model")


def _run(model, batch):
    with torch.no_grad():
        return model(**batch).last_hidden_state


def _real(batch):
    return batch["attention_mask"].bool()


def test_zero_ablation_equals_eager_with_that_heads_columns_of_w_o_zeroed(minilm):
    model, eager, tokenizer = minilm
    batch = _batch(tokenizer)
    with qkv.edit(model, {LAYER: AblateHeads(HEAD)}):
        ours = _run(model, batch)
    w_o = eager.encoder.layer[LAYER].attention.output.dense.weight
    kept = w_o.detach().clone()
    with torch.no_grad():
        w_o[:, HEAD * E : (HEAD + 1) * E] = 0  # W_O's input columns of that head
    try:
        theirs = _run(eager, batch)
    finally:
        with torch.no_grad():
            w_o.copy_(kept)
    real = _real(batch)
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    assert (ours[real] - _run(model, batch)[real]).abs().max() > 1e-3  # the edit changed the output, and ended with the block


def test_knockout_equals_eager_with_minus_inf_at_those_edges(minilm, eager_layer):
    model, eager, tokenizer = minilm
    batch = _batch(tokenizer)
    n = batch["input_ids"].shape[1]
    edges = torch.rand(1, HEADS, n, n, generator=torch.Generator().manual_seed(0)) < 0.5
    edges[..., 0] = False  # every row keeps [CLS]: no row loses every key (eager would give NaN)
    with qkv.edit(model, {LAYER: Knockout(edges)}):
        ours = _run(model, batch)

    def minus_inf(mask, query):
        added = torch.zeros(edges.shape, dtype=query.dtype).masked_fill(edges, float("-inf"))
        if mask is None:
            return added
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, float("-inf"))
        return mask + added

    eager_layer(before=minus_inf)
    theirs = _run(eager, batch)
    real = _real(batch)
    torch.testing.assert_close(ours[real], theirs[real], **TOL)


def test_mean_ablation_equals_transformer_lens_definition(minilm, eager_layer):
    model, eager, tokenizer = minilm
    batch = _batch(tokenizer, padded=False)
    with qkv.edit(model, {LAYER: AblateHeads([HEAD, 0], how="mean")}):
        ours = _run(model, batch)

    def mean_ablated(z, value):  # z (b, pos, head, d_head), as TransformerLens' hook_z
        z = z.clone()
        for head in (HEAD, 0):
            z[:, :, head, :] = z[:, :, head, :].mean((0, 1))
        return z

    eager_layer(after=mean_ablated)
    torch.testing.assert_close(ours, _run(eager, batch), **TOL)


def test_patching_the_clean_pattern_into_a_corrupted_run(minilm, eager_layer):
    model, eager, tokenizer = minilm
    clean = tokenizer(["The cat sat on the mat."], return_tensors="pt")
    corrupted = tokenizer(["The dog sat on the rug."], return_tensors="pt")
    assert clean["input_ids"].shape == corrupted["input_ids"].shape
    with qkv.record(model, layers=LAYER, heads=HEAD, rows=ROW, hooks=["pattern"]) as rec:
        _run(model, clean)
    pattern = rec[f"blocks.{LAYER}.attn.hook_pattern"]  # (1, 1, 1, j)
    with torch.no_grad():
        clean_eager = eager(**clean, output_attentions=True).attentions[LAYER]
    torch.testing.assert_close(pattern, clean_eager[:, HEAD : HEAD + 1, ROW : ROW + 1], **TOL)
    with qkv.edit(model, {LAYER: PatchPattern(HEAD, ROW, pattern)}):
        ours = _run(model, corrupted)

    def patched(z, value):  # z (b, i, h, e); value (b, h, j, e): the corrupted run's
        z = z.clone()
        z[:, ROW, HEAD] = (pattern[:, 0, 0, :, None] * value[:, HEAD]).sum(1)  # Σ_c α'_c v_c
        return z

    eager_layer(after=patched)
    theirs = _run(eager, corrupted)
    torch.testing.assert_close(ours, theirs, **TOL)
    assert (ours - _run(model, corrupted)).abs().max() > 1e-4  # the patch mattered


def test_ablation_and_knockout_run_on_qkvs_engines(minilm, engines):
    model, _, tokenizer = minilm
    batch = _batch(tokenizer)
    with qkv.edit(model, {LAYER: [AblateHeads([1, 2]), Knockout(qkv.masks.window(left=2, right=2))], 0: ScaleHeads([2.0] * HEADS)}):
        _run(model, batch)
    assert len(engines) == 6 and "reference" not in engines, engines  # one fused call per layer, none materialised


def test_record_builds_transformer_lens_entries_for_chosen_heads_and_rows(minilm):
    model, eager, tokenizer = minilm
    batch = _batch(tokenizer)
    heads, rows = [7, 2], [0, 5, 3]
    with qkv.record(model, layers=[1, LAYER], heads=heads, rows=rows) as rec:
        ours = _run(model, batch)
    assert sorted(rec) == sorted(f"blocks.{layer}.attn.hook_{name}" for layer in (1, LAYER) for name in ("attn_scores", "pattern", "z"))
    torch.testing.assert_close(ours, _run(model, batch), atol=0, rtol=0)  # recording changes nothing
    with torch.no_grad():
        out = eager(**batch, output_attentions=True)
    b, n = batch["input_ids"].shape
    z_seen = {}

    def keep_z(module, args, output):  # the self-attention's output is z, (b, i, h·e), before W_O
        z_seen["z"] = output[0]

    hook = eager.encoder.layer[LAYER].attention.self.register_forward_hook(keep_z)
    try:
        _run(eager, batch)
    finally:
        hook.remove()
    pattern = rec[f"blocks.{LAYER}.attn.hook_pattern"]
    scores = rec[f"blocks.{LAYER}.attn.hook_attn_scores"]
    assert pattern.shape == scores.shape == (b, 2, 3, n)
    torch.testing.assert_close(pattern, out.attentions[LAYER][:, heads][:, :, rows], **TOL)
    padding = ~_real(batch)[:, None, None, :].expand_as(scores)
    assert bool((scores[padding] == float("-inf")).all()) and bool(scores[~padding].isfinite().all())
    torch.testing.assert_close(scores.softmax(-1), pattern, **TOL)
    z = rec[f"blocks.{LAYER}.attn.hook_z"]  # (b, pos, head, d_head)
    assert z.shape == (b, 3, 2, E)
    torch.testing.assert_close(z, z_seen["z"].view(b, n, HEADS, E)[:, rows][:, :, heads], **TOL)


def test_record_shows_the_edits_and_blocks_restore_the_model(minilm):
    model, _, tokenizer = minilm
    batch = _batch(tokenizer)
    with qkv.edit(model, {LAYER: AblateHeads(HEAD)}), qkv.record(model, layers=LAYER, heads=HEAD, hooks=("z",)) as rec:
        _run(model, batch)
    assert bool((rec[f"blocks.{LAYER}.attn.hook_z"] == 0).all())
    with qkv.record(model, layers=LAYER, heads=HEAD, hooks=("z",)) as rec:
        _run(model, batch)
    assert bool((rec[f"blocks.{LAYER}.attn.hook_z"] != 0).any())  # the edit ended with its block


def test_errors_say_what_to_do(minilm):
    model, eager, _ = minilm
    with pytest.raises(ValueError, match=r"edit: the model runs attn_implementation='eager'.*attn_implementation=\"qkv\""):
        with qkv.edit(eager, {0: AblateHeads(0)}):
            pass
    with pytest.raises(ValueError, match=r"edit: layers \[6\] are not attention layers of this model"):
        with qkv.edit(model, {6: AblateHeads(0)}):
            pass
    for key in (True, 1.0, "1"):  # True == 1 edited layer 1, silently
        with pytest.raises(TypeError, match=r"edit: layers are int indices, got \["):
            with qkv.edit(model, {key: AblateHeads(0)}):
                pass
    with pytest.raises(ValueError, match=r"record: hooks expected a list from"):
        with qkv.record(model, hooks=["q"]):
            pass
    with pytest.raises(KeyError, match=r"not recorded"):
        with qkv.record(model, layers=0) as rec:
            pass
        rec["blocks.0.attn.hook_z"]


def test_hook_result_needs_an_output_projection_on_the_attention_module(minilm):
    model, _, tokenizer = minilm
    with pytest.raises(ValueError, match="hook_result needs the layer's output projection"):
        with qkv.record(model, layers=LAYER, hooks=("result",)):
            model(**_batch(tokenizer))


@pytest.fixture(scope="module")
def gpt2():
    """A tiny GPT-2 (its projections are transformers' Conv1D, ``x @ W + b`` with W stored (in, out)), eager and qkv."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50, n_embd=48, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2Model(config).double().eval()
    model.set_attn_implementation("qkv")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return model, eager


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_gpt2_hook_result_is_each_heads_share_of_its_conv1d_output_projection(gpt2):
    model, _ = gpt2
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with qkv.record(model, layers=[1], hooks=("z", "result")) as rec:
        model(input_ids=ids)
    z, result = rec["blocks.1.attn.hook_z"], rec["blocks.1.attn.hook_result"]  # (b, i, h, e), (b, i, h, d_model)
    c_proj = model.h[1].attn.c_proj
    torch.testing.assert_close(result.sum(2), c_proj(z.flatten(2)) - c_proj.bias, **TOL)
    W = c_proj.weight.view(4, 12, 48)  # (h, e, d_model): rows of head n are its inputs to c_proj
    torch.testing.assert_close(result[:, :, 2], z[:, :, 2] @ W[2], **TOL)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_gpt2_returns_its_attention_weights_although_its_layers_keep_output_attentions_to_themselves(gpt2):
    model, eager = gpt2
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    got = model(input_ids=ids, output_attentions=True).attentions
    want = eager(input_ids=ids, output_attentions=True).attentions
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert model(input_ids=ids).attentions is None


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_an_encoder_decoder_whose_layers_share_indices_is_refused_and_its_encoder_can_be_edited():
    from transformers import BartConfig, BartModel

    torch.manual_seed(0)
    config = BartConfig(vocab_size=50, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64)  # fmt: skip
    model = BartModel(config).double().eval()
    model.set_attn_implementation("qkv")
    src, tgt = torch.randint(2, 50, (1, 6)), torch.randint(2, 50, (1, 3))
    with pytest.raises(ValueError, match=r"edit: 'encoder.layers.0.self_attn' and 'decoder.layers.0.self_attn' are both "
                                         r"attention layer 0 of BartModel"):  # fmt: skip
        with qkv.edit(model, {0: AblateHeads([0])}):
            pass
    with pytest.raises(ValueError, match=r"record: .* are both attention layer 0 of BartDecoder"):
        with qkv.record(model.get_decoder()):
            pass
    encoder = model.get_encoder()
    with torch.no_grad(), qkv.record(encoder, layers=[0], hooks=("pattern",)) as rec:
        clean = model(input_ids=src, decoder_input_ids=tgt)
    assert rec["blocks.0.attn.hook_pattern"].shape == (1, 4, 6, 6)
    with torch.no_grad(), qkv.edit(encoder, {0: AblateHeads([0])}):
        edited = model(input_ids=src, decoder_input_ids=tgt)
    assert not torch.equal(edited.encoder_last_hidden_state, clean.encoder_last_hidden_state)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_edit_counts_a_negative_layer_from_the_last_as_record_does(gpt2):
    model, _ = gpt2
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with qkv.edit(model, {-1: AblateHeads([1])}):
            negative = model(input_ids=ids).last_hidden_state
        with qkv.edit(model, {1: AblateHeads([1])}):
            positive = model(input_ids=ids).last_hidden_state
    torch.testing.assert_close(negative, positive, **TOL)
    with pytest.raises(ValueError, match=r"edit: layers \[1, -1\] name one layer twice"):
        with qkv.edit(model, {1: AblateHeads([0]), -1: AblateHeads([1])}):
            pass
    with pytest.raises(ValueError, match=r"edit: layers \[-3\] are not attention layers"):
        with qkv.edit(model, {-3: AblateHeads([0])}):
            pass


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_recording_rows_past_a_calls_own_rows_says_why(gpt2):
    model, _ = gpt2
    ids = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"record: rows.*; layer 0 was called with 1 query rows \(each decoding step"):
        with torch.no_grad(), qkv.record(model, rows=[4]):
            model(input_ids=ids[:, :1])


@pytest.fixture(scope="module")
def llama():
    """A tiny Llama for generate() (2 layers, 4 heads on 2 KV heads), float64, qkv's attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM._from_config(config, attn_implementation="qkv").double().eval()


def _generated(model, edits, **options):
    prompt = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), qkv.edit(model, edits):
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, **options)  # fmt: skip
    return torch.stack(out.scores)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_static_cache_knocks_out_the_edges_a_dynamic_cache_does(llama):
    """A static cache's keys run to its size: a mask aligned to the last key (``offsets(-1, -1)``, each token's edge to
    the one before) hit the unfilled slots instead, 0.157 away from the run without a cache."""
    from qkv.masks import offsets

    edits = {0: Knockout(offsets(-1, -1)), 1: [Knockout(offsets(-2, -2)), AblateHeads([1])]}
    want = _generated(llama, edits, use_cache=False)
    assert not torch.allclose(want, _generated(llama, {}, use_cache=False))  # the edits change the tokens' scores
    torch.testing.assert_close(_generated(llama, edits, cache_implementation="static"), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(_generated(llama, edits), want, rtol=0, atol=1e-12)
    prompt = torch.randint(1, 100, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), qkv.edit(llama, {0: AblateHeads(1, how="mean")}), qkv.record(llama, layers=0) as rec:
        llama.generate(prompt, max_new_tokens=1, do_sample=False, cache_implementation="static", pad_token_id=0)
    assert rec["blocks.0.attn.hook_pattern"].shape == (1, 4, 5, 5)  # the prompt's keys (mean ablation: no cache yet)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_hybrid_models_layers_are_its_attention_layers():
    """Mamba and convolution mixers carry a ``layer_idx`` too: an edit of one was accepted and ran nowhere, and
    Falcon-H1 (Mamba and attention under one index) was refused as an encoder-decoder."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(0)
    config = Lfm2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"])  # fmt: skip
    model = Lfm2ForCausalLM._from_config(config, attn_implementation="qkv").double().eval()
    ids = torch.randint(1, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"edit: layers \[0\] are not attention layers of this model, expected indices in \[1\]"):
        with qkv.edit(model, {0: AblateHeads([0])}):
            pass
    with torch.no_grad():
        plain = model(ids).logits
        with qkv.edit(model, {-1: AblateHeads([0, 1, 2, 3])}), qkv.record(model, layers=-1) as rec:
            ablated = model(ids).logits
        with qkv.record(model, layers=slice(0, 3)) as every:
            model(ids)
    assert not torch.allclose(plain, ablated) and list(rec) == list(every)[:3] and "blocks.1.attn.hook_z" in rec
    assert torch.equal(rec["blocks.1.attn.hook_z"], torch.zeros_like(rec["blocks.1.attn.hook_z"]))
    with pytest.raises(ValueError, match=r"record: layers \[2\] are not attention layers"):
        with qkv.record(model, layers=[1, 2]):
            pass


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_linear_attention_layer_named_attention_is_not_an_attention_layer():
    """MiniMax's lightning (linear) attention has a layer_idx and "Attention" in its name, but never calls the
    attention functions: an edit of it was accepted and changed nothing."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    config = MiniMaxConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1,
                           layer_types=["linear_attention", "full_attention"])  # fmt: skip
    model = MiniMaxForCausalLM._from_config(config, attn_implementation="qkv").eval()
    with pytest.raises(ValueError, match=r"edit: layers \[0\] are not attention layers of this model, expected indices in \[1\]"):
        with qkv.edit(model, {0: AblateHeads([0])}):
            pass


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_blocks_left_out_of_order_leave_no_edit_behind(gpt2):
    """``ContextVar.reset`` of the inner block's token put the outer block's session back after the outer had left."""
    model, _ = gpt2
    ids = torch.arange(6)[None]
    with torch.no_grad():
        plain = model(ids).last_hidden_state
        outer, inner = qkv.edit(model, {0: AblateHeads([0, 1, 2, 3])}), qkv.record(model, layers=1)
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)
        inner.__exit__(None, None, None)
        assert torch.equal(model(ids).last_hidden_state, plain)
