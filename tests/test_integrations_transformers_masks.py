"""Tests of ``qkv.integrations.transformers_masks``: transformers' mask requests as lazy qkv masks.

Shape legend: ``b`` batch, ``i`` query length, ``j`` key length.

The oracle is transformers' own ``sdpa_mask``, which builds the ``(b, 1, i, j)`` bool mask
of the same request literally (its mask function evaluated at every position).
"""

import pytest
import torch

from qkv import masks
from qkv.masks import Dense

transformers = pytest.importorskip("transformers", reason="transformers is not installed (the transformers extra)")
from transformers import masking_utils as mu  # noqa: E402

from qkv.integrations.transformers_masks import LayerMask, describe, mask_interface, padding_mask  # noqa: E402

B = 3


def _paddings(total: int) -> dict[str, torch.Tensor | None]:
    """2-d padding masks over ``total`` tokens (True = real), one kind of padding per entry."""
    cols = torch.arange(total)[None, :]
    first, end = torch.tensor([[0], [2], [total - 1]]), torch.tensor([[total], [total - 1], [total]])
    holes = torch.ones(B, total, dtype=torch.bool)
    holes[1, total - 2] = False  # a hole among the last keys (inside every window): not one run
    empty = torch.zeros(B, total, dtype=torch.bool)
    empty[0] = True  # rows 1 and 2 have no real token at all
    return {
        "none": None,
        "all real": torch.ones(B, total, dtype=torch.long),
        "left": (cols >= first).long(),
        "right": (cols < torch.tensor([[total], [3], [1]])).long(),
        "both": ((cols >= first) & (cols < end)).long(),
        "holes": holes.long(),
        "empty rows": empty.long(),
    }


# (q_length, kv_length, q_offset, kv_offset, tokens in the 2-d mask):
GEOMETRIES = {
    "prefill": (6, 6, 0, 0, 6),
    "decode": (1, 9, 8, 0, 9),
    "chunk after a cache": (3, 9, 6, 0, 9),
    "sliding cache decode": (1, 4, 8, 5, 9),
    "static cache prefill": (5, 12, 0, 0, 5),
    "static cache decode": (1, 12, 7, 0, 8),
}

FUNCTIONS = {
    "causal": (mu.causal_mask_function, None),
    "bidirectional": (mu.bidirectional_mask_function, None),
    "sliding causal": (mu.sliding_window_causal_mask_function(3), 3),
    "sliding bidirectional": (mu.sliding_window_bidirectional_mask_function(2), 2),
}


def _oracle(function, q_length, kv_length, q_offset, kv_offset, padding) -> torch.Tensor:
    mask = mu.sdpa_mask(
        batch_size=B, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=function, attention_mask=None if padding is None else padding.bool(),
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
    )  # fmt: skip
    return mask.expand(B, 1, q_length, kv_length)


def _parts(mask: masks.Mask) -> list[masks.Mask]:
    if isinstance(mask, (masks.And, masks.Or)):
        return _parts(mask.a) + _parts(mask.b)
    return [mask]


@pytest.mark.parametrize("function_name", list(FUNCTIONS))
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("padding_name", ["none", "all real", "left", "right", "both", "holes", "empty rows"])
def test_every_request_equals_transformers_dense_mask(function_name, geometry, padding_name):
    function, local_size = FUNCTIONS[function_name]
    q_length, kv_length, q_offset, kv_offset, tokens = GEOMETRIES[geometry]
    padding = _paddings(tokens)[padding_name]
    built = mask_interface(
        batch_size=B, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=function, attention_mask=None if padding is None else padding.bool(), local_size=local_size,
        allow_is_causal_skip=True, dtype=torch.float32, use_vmap=False,
    )  # fmt: skip
    assert isinstance(built, LayerMask) and built.shape == (B, 1, q_length, kv_length)
    expected = _oracle(function, q_length, kv_length, q_offset, kv_offset, padding)
    got = built.mask.dense(q_length, kv_length).expand(B, 1, q_length, kv_length)
    assert torch.equal(got, expected), built
    # lazy: only a padding mask with holes becomes a per-key bool tensor, never an (i, j) one
    dense_parts = [p for p in _parts(built.mask) if isinstance(p, Dense)]
    if padding_name == "holes":
        assert [tuple(p.mask.shape) for p in dense_parts] == [(B, 1, 1, kv_length)]
    else:
        assert dense_parts == []


def test_positions_are_the_plain_qkv_masks_when_queries_end_with_the_keys():
    """δ = 0 (every dynamic cache): the masks backends recognise (causal flag, block-local windows)."""
    common = dict(batch_size=2, q_length=5, kv_length=5)
    assert repr(mask_interface(**common, mask_function=mu.causal_mask_function).mask) == "causal()"
    sliding = mask_interface(**common, mask_function=mu.sliding_window_causal_mask_function(4), local_size=4).mask
    assert isinstance(sliding, masks.Window) and (sliding.left, sliding.right) == (3, 0)
    both = mask_interface(**common, mask_function=mu.sliding_window_bidirectional_mask_function(2)).mask
    assert (both.left, both.right) == (2, 2)
    padded = mask_interface(**common, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]).bool())
    assert repr(padded.mask) == "(causal() & starts([1, 0]))"
    assert repr(mask_interface(**common, mask_function=mu.bidirectional_mask_function).mask) == "window(left=None, right=None)"


def test_describe_reads_transformers_own_functions_only():
    assert describe(mu.causal_mask_function) == ("causal", None)
    assert describe(mu.bidirectional_mask_function) == ("bidirectional", None)
    assert describe(mu.sliding_window_causal_mask_function(7)) == ("sliding_causal", 7)
    assert describe(mu.sliding_window_bidirectional_mask_function(5)) == ("sliding_bidirectional", 5)
    assert describe(mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))) is None
    assert describe(mu.and_masks(mu.causal_mask_function, mu.causal_mask_function)) is None
    assert describe(lambda b, h, q, kv: kv <= q) is None


def test_other_patterns_are_built_by_transformers_densely():
    """Chunked attention (Llama 4) has no offset form: transformers' own (b, 1, i, j) bool mask, wrapped."""
    chunked = mu.chunked_causal_mask_function(3, torch.zeros(B, dtype=torch.long))
    padding = _paddings(8)["left"].bool()
    built = mask_interface(batch_size=B, q_length=8, kv_length=8, mask_function=chunked, attention_mask=padding)
    assert isinstance(built.mask, Dense) and built.mask.mask.shape == (B, 1, 8, 8)
    assert torch.equal(built.mask.mask, _oracle(chunked, 8, 8, 0, 0, padding))


def test_prepared_masks_pass_through_and_look_like_4d_tensors():
    """generate() with a static cache prepares masks, calls .contiguous() and hands them back."""
    built = mask_interface(batch_size=2, q_length=4, kv_length=4)
    assert built.contiguous() is built and built.ndim == 4 and built.dim() == 4
    again = mask_interface(batch_size=2, q_length=4, kv_length=4, attention_mask=built)
    assert again is built
    assert repr(built) == "LayerMask(causal(), shape=(2, 1, 4, 4))"


def test_padding_mask_lazy_forms_and_errors():
    real = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]])
    mask = padding_mask(real, 4)
    assert repr(mask) == "(starts([0, 1, 1]) & lengths([3, 4, 2]))"
    assert padding_mask(torch.ones(2, 5), 5) is None
    # keys past the 2-d mask (a static cache's empty slots) are padding
    assert repr(padding_mask(torch.ones(2, 3), 5)) == "lengths([3, 3])"
    # a window of the keys (a sliding cache): only columns kv_offset ... kv_offset + j count
    assert repr(padding_mask(real, 2, kv_offset=2)) == "lengths([1, 2, 0])"
    with pytest.raises(ValueError, match=r"attention_mask: expected a 2-d padding mask \(b, j\), got shape \(2, 1, 4\)"):
        padding_mask(torch.ones(2, 1, 4), 4)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_a_model_whose_attention_is_its_own_is_told_why_qkv_cannot_run_in_it(family):
    pytest.importorskip("transformers")
    from transformers import BloomConfig, BloomModel, MptConfig, MptModel

    from qkv.integrations.transformers import register
    from qkv.integrations.transformers_hooks import hooks

    register()
    config, cls = {"bloom": (BloomConfig(hidden_size=32, n_head=4, n_layer=1, vocab_size=100), BloomModel),
                   "mpt": (MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=100), MptModel)}[family]  # fmt: skip
    model = cls._from_config(config, attn_implementation="qkv").eval()
    assert model._supports_attention_backend is False  # transformers' own mark: it never calls the attention functions
    with pytest.raises((TypeError, AttributeError), match="_supports_attention_backend=False.*'sdpa' or 'eager'"):
        model(torch.randint(0, 100, (2, 5)))
    with pytest.raises(ValueError, match="calls transformers. attention functions"):
        with hooks(model):
            pass
