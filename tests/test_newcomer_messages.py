"""Mistakes a newcomer made in a documentation audit, each answered at the call with the argument named.

Before, each of these got PyTorch's message from deep inside a product or a copy ("Tensor on
device cpu is not on the expected device meta!", "Cannot copy out of meta tensor; no data!"),
a shape the caller never made, or ``qkv.attention``'s wording from the SDPA drop-in.
"""

from __future__ import annotations

import pytest
import torch

import qkv


def test_module_and_input_on_different_devices_name_the_input_and_the_fix():
    mha = qkv.MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match=r"query: on meta, the module's parameters on cpu; call \.to\('meta'\) on the "
                                         r"module or \.to\('cpu'\) on the input"):  # fmt: skip
        mha(torch.randn(2, 5, 32, device="meta"))
    with pytest.raises(ValueError, match=r"key: on meta, the module's parameters on cpu"):
        mha(torch.randn(2, 5, 32), torch.randn(2, 7, 32, device="meta"))
    with pytest.raises(ValueError, match=r"query: on meta, the module's parameters on cpu"):
        mha(torch.randn(5, 32, device="meta"))  # unbatched
    # parameters on meta have no values: .to() cannot help, to_empty and a load can
    with pytest.raises(ValueError, match=r"query: on cpu, the module's parameters on meta \(shapes without values\); "
                                         r"make them with module.to_empty\(device='cpu'\) and load its weights"):  # fmt: skip
        qkv.MultiHeadAttention(32, 4).to("meta")(torch.randn(2, 5, 32))


def test_weights_an_offloading_hook_brings_in_just_in_time_still_run():
    """accelerate's offloading keeps the weights on meta and loads them in a hook as each projection runs: the device is
    read after a projection fails, never checked before it runs."""
    accelerate = pytest.importorskip("accelerate")
    x = torch.randn(2, 5, 32)
    ref = qkv.MultiHeadAttention(32, 4)
    offloaded = qkv.MultiHeadAttention(32, 4)
    offloaded.load_state_dict(ref.state_dict())
    accelerate.cpu_offload(offloaded, execution_device=torch.device("cpu"))
    assert offloaded.q_proj.weight.device.type == "meta"
    assert torch.equal(offloaded(x), ref(x)) and torch.equal(offloaded(x[0]), ref(x[0]))


def test_module_on_meta_with_meta_input_still_runs():
    mha = qkv.MultiHeadAttention(32, 4).to("meta")
    assert mha(torch.randn(2, 5, 32, device="meta")).shape == (2, 5, 32)


def test_token_ids_and_an_unbatched_input_of_the_wrong_size_get_the_callers_shape():
    mha = qkv.MultiHeadAttention(32, 4)
    with pytest.raises(TypeError, match=r"query: expected a floating-point tensor, got torch.int64 \(token ids go "
                                        r"through an embedding first\)"):  # fmt: skip
        mha(torch.randint(0, 100, (2, 10)))
    with pytest.raises(ValueError, match=r"query: expected shape \(b, length, 32\) \(batch first\), or \(length, 32\) "
                                         r"unbatched, got \(10, 64\)$"):  # fmt: skip
        mha(torch.randn(10, 64))
    with pytest.raises(ValueError, match=r"key: expected shape .* got \(7, 16\)$"):
        mha(torch.randn(5, 32), torch.randn(7, 16))
    with pytest.raises(ValueError, match=r"query: expected shape \(length, b, 32\) \(batch_first=False\), or "
                                         r"\(length, 32\) unbatched, got \(10, 64\)$"):  # fmt: skip
        qkv.MultiHeadAttention(32, 4, batch_first=False)(torch.randn(10, 64))


def test_a_learned_score_or_a_lazy_bias_on_meta_is_named():
    q = torch.randn(2, 4, 6, 8)
    with pytest.raises(ValueError, match=r"score: its parameters are on meta, q on cpu; make them with "
                                         r"\.to_empty\(device='cpu'\) and load its weights"):  # fmt: skip
        qkv.attention(q, q, q, score=qkv.scores.Additive(8, 8, hidden=4).to("meta"))
    with pytest.raises(ValueError, match=r"bias: expected a lazy bias on cpu like q, got one on meta"):
        qkv.attention(q, q, q, bias=qkv.ALiBi(4).to("meta"))
    # on q's device both run
    assert qkv.attention(q, q, q, score=qkv.scores.Additive(8, 8, hidden=4), bias=qkv.ALiBi(4)).shape == q.shape


def test_varlen_offsets_on_meta_are_named():
    x = torch.randn(10, 4, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q: its offsets are read on the host .* got a meta tensor"):
        qkv.varlen_attention(x, x, x, cu.to("meta"), cu, 6, 6)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: its offsets are read on the host .* got a meta tensor"):
        qkv.varlen_attention(x, x, x, cu, cu.to("meta"), 6, 6)


def test_paged_tables_and_pages_on_meta_are_named():
    q, cache = torch.randn(2, 4, 16), torch.randn(8, 2, 4, 2, 16)
    table = (torch.tensor([0, 1, 2]), torch.tensor([0, 2, 3]), torch.tensor([0, 1, 2]), torch.tensor([4, 3]))
    with pytest.raises(ValueError, match=r"qo_indptr: the page table's values are read on the host .* got a meta tensor"):
        qkv.paged_attention(q, cache, *(x.to("meta") for x in table))
    with pytest.raises(ValueError, match=r"kv_indices: .* got pages on meta"):
        qkv.paged_attention(q.to("meta"), cache.to("meta"), *table)
    assert qkv.paged_attention(q, cache, *table).shape == (2, 4, 16)


@pytest.mark.parametrize("call", [{}, {"is_causal": True}, {"attn_mask": torch.ones(8, 8, dtype=torch.bool)},
                                  {"attn_mask": torch.zeros(8, 8)}])  # fmt: skip
def test_sdpa_drop_in_names_a_key_of_another_size_as_pytorch_raises_it(call):
    q, k = torch.randn(2, 4, 8, 64), torch.randn(2, 4, 8, 16)
    with pytest.raises(RuntimeError, match=r"key: expected query's size E = 64 in its last dim .* got 16 "
                                           r"\(query \(2, 4, 8, 64\), key \(2, 4, 8, 16\)\)"):  # fmt: skip
        qkv.scaled_dot_product_attention(q, k, q, **call)
    with pytest.raises(RuntimeError):  # PyTorch's own type for it
        torch.nn.functional.scaled_dot_product_attention(q, k, q, **call)
