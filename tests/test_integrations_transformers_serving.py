"""Tests of ``qkv.integrations.transformers_serving``: transformers' ``generate_batch`` on qkv's attention.

Shape legend: ``T`` query tokens of a step, ``K`` keys, ``n`` requests, ``h`` query heads,
``g`` KV heads, ``d`` head size.

Oracle: ``model.generate`` on each request alone, with ``attn_implementation="qkv"``
(itself checked against transformers' eager in ``test_integrations_transformers``): greedy
continuous batching over requests of different lengths, prefilled in chunks, must give the
same tokens. Tiny random models built from a config (no download).
"""

import importlib.util
import sys

import pytest
import torch

import qkv

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed (the transformers extra)")

if HAS_TRANSFORMERS:
    import transformers as hf
    from transformers import AutoModelForCausalLM, GenerationConfig

    from qkv.integrations import transformers_serving as serving
    from qkv.integrations.transformers import register

    register()
    NEW_ENOUGH = tuple(int(part) for part in hf.__version__.split(".")[:2]) >= (5, 19)

COMMON = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              head_dim=8)  # fmt: skip
PROMPTS = [[5, 9, 14], [7, 3, 22, 41, 8, 19, 30], list(range(10, 30)), [50, 12, 33, 4, 61, 9, 27, 45, 16, 38, 11]]


def _config(kind: str):
    if kind == "llama":  # multi-head: 6 query and 6 KV heads
        return hf.LlamaConfig(**COMMON, num_key_value_heads=6)
    if kind == "llama_gqa":  # 3 query heads per KV head
        return hf.LlamaConfig(**COMMON, num_key_value_heads=2)
    if kind == "gemma2":  # layer 0 sliding (window 4, shorter than the prompts), layer 1 global; softcap passed
        return hf.Gemma2Config(**COMMON, num_key_value_heads=2, sliding_window=4, final_logit_softcapping=None,
                               query_pre_attn_scalar=8)  # fmt: skip
    if kind == "mistral":  # every layer sliding, window 4
        return hf.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=4)
    raise ValueError(kind)


def _tiny(kind: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(kind), attn_implementation="qkv").eval()


def _varlen_spy(monkeypatch) -> list:
    """Record every ``varlen_attention`` call the serving function makes: (sequences, window, q rows, k rows)."""
    calls, real = [], serving.varlen_attention

    def spy(q, k, v, cu_q, cu_k, **kwargs):
        calls.append((len(cu_q) - 1, kwargs["window_size"], torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist()))
        return real(q, k, v, cu_q, cu_k, **kwargs)

    monkeypatch.setattr(serving, "varlen_attention", spy)
    return calls


SETTINGS = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=1)
# a small paged cache, and batches of at most 16 tokens: the 20-token prompt is prefilled in two chunks;
# no CUDA graphs (transformers turns them on wherever CUDA is present, even for a model on the CPU)
CB = dict(num_blocks=16, max_batch_tokens=16, page_size=16, use_cuda_graph=False)


@pytest.mark.parametrize("kind", ["llama", "llama_gqa", "gemma2", "mistral"])
@pytest.mark.skipif(not NEW_ENOUGH, reason="continuous batching with qkv needs transformers >= 5.19")
def test_generate_batch_equals_generate_on_each_request_alone(kind, monkeypatch):
    model = _tiny(kind)
    with torch.no_grad():
        alone = [model.generate(torch.tensor([p]), **SETTINGS)[0, len(p):].tolist() for p in PROMPTS]
    serving.for_continuous_batching(model)
    assert model.config._attn_implementation == serving.NAME
    calls = _varlen_spy(monkeypatch)
    out = model.generate_batch(inputs=PROMPTS, generation_config=GenerationConfig(**SETTINGS),
                               continuous_batching_config=hf.ContinuousBatchingConfig(**CB), progress_bar=False)  # fmt: skip
    batched = [out[f"req_{r}"].generated_tokens for r in range(len(PROMPTS))]
    assert batched == alone
    # the math ran in qkv, on several requests at once, chunked prefills (fewer queries than keys) included
    assert calls and max(n for n, *_ in calls) >= 2
    assert any(1 < sq < sk for _, _, qs, ks in calls for sq, sk in zip(qs, ks))
    windows = {w for _, w, *_ in calls}
    assert windows == {"gemma2": {(3, -1), (-1, -1)}, "mistral": {(3, -1)}}.get(kind, {(-1, -1)})
    if kind in ("gemma2", "mistral"):  # (without the window these two give other tokens) a sliding layer
        # reads at most W - 1 = 3 past keys per request from its cache
        assert all(sk - sq <= 3 for _, w, qs, ks in calls if w == (3, -1) for sq, sk in zip(qs, ks))


@pytest.mark.skipif(not NEW_ENOUGH, reason="continuous batching with qkv needs transformers >= 5.19")
def test_outside_continuous_batching_the_name_runs_qkv_and_can_be_switched_back():
    model = _tiny("llama_gqa")
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        plain = model.generate(ids, **SETTINGS)
        serving.for_continuous_batching(model)
        served = model.generate(ids, **SETTINGS)
        model.set_attn_implementation("qkv")
    assert torch.equal(served, plain) and model.config._attn_implementation == "qkv"


def _layer():
    return type("Layer", (torch.nn.Module,), {})()


def test_padded_step_with_empty_sequences_equals_each_sequence_alone():
    # what a fixed-size (padded) step hands a layer: 2 real requests, then a padding sequence
    # of length 0; queries and keys run past the offsets' last entry
    gen = torch.Generator().manual_seed(0)
    h, g, d = 4, 2, 8
    query, key, value = torch.randn(1, h, 8, d, generator=gen), torch.randn(1, g, 12, d, generator=gen), torch.randn(1, g, 12, d, generator=gen)
    cu_q, cu_k = torch.tensor([0, 3, 5, 5], dtype=torch.int32), torch.tensor([0, 4, 10, 10], dtype=torch.int32)
    out, weights = serving.serving_forward(_layer(), query, key, value, None, scaling=0.3, is_causal=True,
                                           cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, write_index=[], read_index=[])  # fmt: skip
    assert weights is None and out.shape == (1, 8, h, d)
    for (qa, qb), (ka, kb) in zip([(0, 3), (3, 5)], [(0, 4), (4, 10)]):
        expected = qkv.attention(query[:, :, qa:qb], key[:, :, ka:kb], value[:, :, ka:kb], causal=True, scale=0.3)
        torch.testing.assert_close(out[:, qa:qb], expected.transpose(1, 2), atol=1e-6, rtol=0)
    assert not out[:, 5:].any()


def test_what_it_cannot_honour_raises():
    q, kv = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    offsets = dict(cu_seq_lens_q=torch.tensor([0, 3]), cu_seq_lens_k=torch.tensor([0, 3]), write_index=[])
    with pytest.raises(TypeError, match="output_attentions"):
        serving.serving_forward(_layer(), q, kv, kv, None, output_attentions=True, **offsets)
    with pytest.raises(ValueError, match="block-table"):
        serving.serving_forward(_layer(), q, kv, kv, None, block_table=torch.zeros(1, 1, 1), **offsets)
    with pytest.raises(ValueError, match="sliding_window"):
        serving.serving_forward(_layer(), q, kv, kv, None, sliding_window=0, **offsets)


def test_older_transformers_say_what_they_need(monkeypatch):
    # before 5.19 continuous batching renames the implementation "paged|<name>" and wants it to update the cache
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.18.0")  # (from_config may swap the module)
    with pytest.raises(NotImplementedError, match=r"transformers >= 5.19"):
        serving.for_continuous_batching(None)
