"""``qkv.positional.rope_scaling``: RoPE's stretched frequencies against transformers' ``ROPE_INIT_FUNCTIONS``, and
``Rotary(scaling=...)`` against transformers' Llama rotary embedding.

Shape legend: ``r`` rotated dims, ``n`` positions, ``d`` head size.
"""

import math

import pytest
import torch

from qkv import Rotary
from qkv.positional.rope_scaling import frequencies, scaling_settings

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb  # noqa: E402

D, BASE = 64, 50000.0
SCHEMES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn, beta and mscale": {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.707},
    "yarn, given attention factor, untruncated": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                                                  "original_max_position_embeddings": 512, "truncate": False},
}  # fmt: skip


def hf_config(scheme: dict, max_positions: int = 4096) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * D, num_attention_heads=4, max_position_embeddings=max_positions,
                       rope_parameters={**scheme, "rope_theta": BASE})  # fmt: skip


@pytest.mark.parametrize("name", SCHEMES)
def test_frequencies_and_attention_factor_are_transformers(name):
    scheme = SCHEMES[name]
    theta, factor = frequencies(D, BASE, scaling_settings(scheme, BASE))
    want, want_factor = ROPE_INIT_FUNCTIONS[scheme["rope_type"]](hf_config(scheme), "cpu")
    torch.testing.assert_close(theta.float(), want, rtol=2e-6, atol=0)  # (transformers' are float32)
    assert factor == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("length", [100, 4096, 10000])
def test_dynamic_ntk_follows_the_sequence_as_transformers(length):
    scheme = {"rope_type": "dynamic", "factor": 2.0}
    settings = scaling_settings({**scheme, "original_max_position_embeddings": 4096}, BASE)
    theta, _ = frequencies(D, BASE, settings, length)
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_config(scheme), "cpu", seq_len=length)
    torch.testing.assert_close(theta.float(), want, rtol=2e-6, atol=0)
    if length <= 4096:  # within the trained positions: plain RoPE
        torch.testing.assert_close(theta, BASE ** -(torch.arange(0, D, 2, dtype=torch.float64) / D))


@pytest.mark.parametrize("name", ["llama3", "yarn", "yarn, beta and mscale"])
def test_rotary_turns_q_and_k_as_transformers_llama_rotary_embedding(name):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, D, generator=gen), torch.randn(2, 4, 9, D, generator=gen)
    positions = torch.tensor([0, 1, 2, 500, 1023, 1024, 3000, 8191, 20000])
    cos, sin = LlamaRotaryEmbedding(hf_config(SCHEMES[name]))(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    rotary = Rotary(D, base=BASE, interleaved=False, scaling=SCHEMES[name])  # transformers' pairs (k, k + d/2)
    # (transformers' angles are float32 products; qkv's float64: they part by float32's rounding of m·θ at m = 20000)
    torch.testing.assert_close(rotary.rotate_at(q, positions), want_q, rtol=0, atol=2e-3)
    torch.testing.assert_close(rotary.rotate_at(k, positions), want_k, rtol=0, atol=2e-3)
    near = slice(0, 3)  # positions 0, 1, 2: float32 angles exact enough to agree closely
    torch.testing.assert_close(rotary.rotate_at(q[:, :, near], positions[near]), want_q[:, :, near], rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn"])
def test_logits_still_depend_on_the_distance_alone(name):
    rotary = Rotary(D, base=BASE, scaling=SCHEMES[name])
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, D, generator=gen, dtype=torch.float64), torch.randn(1, 1, 1, D, generator=gen,
                                                                                  dtype=torch.float64)  # fmt: skip
    logits = [(rotary.rotate_at(q, torch.tensor([m + 3])) * rotary.rotate_at(k, torch.tensor([m]))).sum()
              for m in (0, 17, 5000)]  # fmt: skip
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-10, atol=0)
    torch.testing.assert_close(logits[0], logits[2], rtol=1e-9, atol=0)


def test_yarn_scales_the_rotated_dims_only():
    rotary = Rotary(D, rotary_dim=16, scaling=SCHEMES["yarn"])
    x = torch.randn(1, 1, 3, D, dtype=torch.float64)
    out = rotary.rotate_at(x, torch.arange(3))
    factor = 0.1 * math.log(4.0) + 1.0
    torch.testing.assert_close(out[..., 16:], x[..., 16:])
    torch.testing.assert_close(out[..., :16].norm(dim=-1), factor * x[..., :16].norm(dim=-1))


def test_no_scaling_is_the_papers_rope_and_older_configs_type_key_is_read():
    x = torch.randn(1, 2, 5, D, dtype=torch.float64)
    pos = torch.arange(5)
    torch.testing.assert_close(Rotary(D, scaling={"rope_type": "default"}).rotate_at(x, pos), Rotary(D).rotate_at(x, pos),
                               rtol=0, atol=0)  # fmt: skip
    torch.testing.assert_close(Rotary(D, scaling={"type": "linear", "factor": 2.0}).rotate_at(x, pos),
                               Rotary(D).rotate_at(x, pos / 2), rtol=0, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("scaling, error, match", [
    ("llama3", TypeError, "expected a dict"),
    ({"rope_type": "ntk"}, ValueError, "'ntk' is not one of"),
    ({"rope_type": "linear"}, ValueError, "needs factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, ValueError, "needs original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, ValueError, r"not \['low_freq_factor'\]"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}, ValueError, "rope_theta 500000.0 differs"),
    ({"rope_type": "linear", "factor": -2.0}, ValueError, "factor must be a finite number > 0"),
    ({**SCHEMES["llama3"], "high_freq_factor": 0.5}, ValueError, "must exceed its low_freq_factor"),
])  # fmt: skip
def test_bad_scaling_is_refused_by_name(scaling, error, match):
    with pytest.raises(error, match=match):
        Rotary(D, scaling=scaling)


@pytest.mark.parametrize("extra", [
    {"mscale": 0, "mscale_all_dim": 0.0, "beta_fast": 0},  # read as not given, as transformers reads them
    {"truncate": None},  # a truth value: no truncation
    {"mscale": 1.0, "mscale_all_dim": 0},
])  # fmt: skip
def test_yarn_reads_zeros_and_none_as_transformers(extra):
    scheme = {**SCHEMES["yarn"], **extra}
    theta, factor = frequencies(D, BASE, scaling_settings(scheme, BASE))
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(scheme), "cpu")
    torch.testing.assert_close(theta.float(), want, rtol=2e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_a_transformers_5_dict_with_partial_rotary_factor_is_taken_where_it_agrees():
    scheme = {**SCHEMES["llama3"], "partial_rotary_factor": 0.5}
    config = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, max_position_embeddings=4096,
                         rope_parameters={**scheme, "rope_theta": BASE})  # fmt: skip
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    rotary = Rotary(D, rotary_dim=D // 2, base=BASE, scaling={**scheme, "rope_theta": BASE})
    torch.testing.assert_close(rotary._fixed[0].float(), want, rtol=2e-6, atol=0)
    with pytest.raises(ValueError, match=r"partial_rotary_factor 0.5 differs from rotary_dim / dim_head = 1"):
        Rotary(D, base=BASE, scaling=scheme)


def test_dynamic_ntk_reads_the_sequence_length_never_a_shard_or_a_serving_steps():
    rotary = Rotary(D, scaling={"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 16})
    q, k = torch.randn(1, 2, 3, D, dtype=torch.float64), torch.randn(1, 2, 3, D, dtype=torch.float64)
    q_rot, k_rot = rotary.rotate(q, k, start=40)  # a cache of 40 and 3 new keys: a sequence of 43
    torch.testing.assert_close(k_rot, rotary.rotate_at(k, torch.arange(40, 43), length=43), rtol=0, atol=0)
    grown = Rotary(D, base=10000.0 * (2.0 * 43 / 16 - 1) ** (D / (D - 2)))  # the base dynamic NTK grows to at 43
    torch.testing.assert_close(q_rot, grown.rotate_at(q, torch.arange(40, 43)), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="dynamic NTK scaling reads its sequence's length"):
        rotary.rotate(q, k, positions=(torch.arange(3), torch.arange(3)))
