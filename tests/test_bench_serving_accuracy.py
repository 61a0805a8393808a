"""The int8 accuracy measurement's pieces: the KL/perplexity scores, and the paged attention function it gives transformers."""

import math

import torch

from qkv.bench import serving_accuracy as acc


def test_scores_are_zero_kl_for_equal_logits_and_the_perplexity_of_uniform_is_the_vocabulary():
    logits = torch.zeros(5, 7)
    kl, ppl_a, ppl_b = acc._scores(logits, logits, torch.arange(5))
    assert kl == 0.0 and math.isclose(ppl_a, 7.0) and math.isclose(ppl_b, 7.0)
    kl, _, _ = acc._scores(logits, torch.randn(5, 7), torch.arange(5))
    assert kl > 0


def test_the_paged_attention_function_equals_causal_attention_in_float_and_is_close_in_int8():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 37, 16, generator=gen)
    k, v = torch.randn(1, 2, 37, 16, generator=gen), torch.randn(1, 2, 37, 16, generator=gen)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    got, _ = acc._paged_forward(False)(None, q, k, v, None, scaling=16**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got8, _ = acc._paged_forward(True)(None, q, k, v, None, scaling=16**-0.5)
    assert 0 < (got8 - want).abs().max() < 5e-2
