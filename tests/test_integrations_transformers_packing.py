"""Packed batches through transformers with ``attn_implementation="qkv"``: the same logits and loss as one by one.

Shape legend: ``b`` batch, ``T`` packed tokens, ``V`` vocabulary.

A tiny Llama (causal, GQA) and a BERT-like encoder (bidirectional), built from configs with
seeded weights, are fed three sequences of 5, 3 and 7 tokens by transformers'
``DataCollatorWithFlattening``, with and without ``return_flash_attn_kwargs``; each
packed token's logits equal those of its sequence run alone (float32, 1e-5), and so does
the language model's loss. The layers never see a ``(T, T)`` mask: the segments backend
runs every sequence as its own call.
"""

import importlib.util

import pytest
import torch

import qkv

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

SEQUENCES = [[3, 17, 5, 9, 12], [7, 2, 40], [1, 8, 8, 30, 22, 11, 4]]


@pytest.fixture(scope="module")
def models():
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    from qkv.integrations.transformers import register

    register()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))  # fmt: skip
    bert = BertModel(BertConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=64), add_pooling_layer=False)  # fmt: skip
    for model in (llama, bert):
        model.set_attn_implementation("qkv")
        model.eval()
    return {"llama": llama, "bert": bert}


def packed_batch(flash_kwargs: bool) -> dict:
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": s} for s in SEQUENCES])


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_a_packed_causal_lm_equals_its_sequences_one_by_one(models, flash_kwargs, monkeypatch):
    llama = models["llama"]
    batch = packed_batch(flash_kwargs)
    assert ("cu_seq_lens_q" in batch) == flash_kwargs
    seen = []
    real = qkv.backends.segments.run
    monkeypatch.setattr(qkv.backends.segments, "run", lambda req: seen.append(req.i) or real(req))
    with torch.no_grad():
        packed = llama(**batch)
        alone = [llama(input_ids=torch.tensor([s]), labels=torch.tensor([s])) for s in SEQUENCES]
    assert seen == [sum(map(len, SEQUENCES))] * 2  # each layer: one packed call, run per document
    torch.testing.assert_close(packed.logits[0], torch.cat([a.logits[0] for a in alone]), rtol=1e-5, atol=1e-5)
    # the packed loss averages every predicted token: the sequences' losses weighted by their counts
    counts = torch.tensor([len(s) - 1 for s in SEQUENCES], dtype=torch.float32)
    expected = (torch.stack([a.loss for a in alone]) * counts).sum() / counts.sum()
    torch.testing.assert_close(packed.loss, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
def test_a_packed_encoder_equals_its_sequences_one_by_one(models, flash_kwargs):
    bert = models["bert"]
    batch = {k: v for k, v in packed_batch(flash_kwargs).items() if k != "labels"}
    with torch.no_grad():
        packed = bert(**batch).last_hidden_state[0]
        alone = [bert(input_ids=torch.tensor([s])).last_hidden_state[0] for s in SEQUENCES]
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_the_mask_transformers_builds_for_position_id_packing_is_lazy(models):
    """The causal LM's own mask function for packed position ids is read as documents & causal, not built densely."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )

    from qkv.integrations.transformers_masks import mask_interface

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    fn = and_masks(remap_positions_for_packed_sequence(causal_mask_function, positions), packed_sequence_mask_function(ids))
    mask = mask_interface(1, 9, 9, mask_function=fn).mask
    assert isinstance(mask, qkv.masks.And) and isinstance(mask.a, qkv.masks.Documents)
    dense = mask.tile(qkv.masks.Tile.whole(9, 9))
    want = (ids[0][:, None] == ids[0][None, :]) & (torch.arange(9)[None, :] <= torch.arange(9)[:, None])
    assert torch.equal(dense.expand(1, 1, 9, 9)[0, 0], want)


def test_bad_offsets_name_the_keyword(models):
    llama = models["llama"]
    batch = packed_batch(True)
    batch["cu_seq_lens_q"] = torch.tensor([0, 5, 9], dtype=torch.int32)  # ends before the 15 tokens
    with pytest.raises(ValueError, match=r"cu_seq_lens_q: expected offsets from 0, non-decreasing, ending at the 15 packed tokens"):
        llama(**batch)


def test_a_left_padded_batch_is_not_read_as_packed(models, monkeypatch):
    """generate's position ids of a left-padded batch restart at the padding: that is padding, not packing."""
    from qkv.backends import segments

    llama = models["llama"]
    ids = torch.tensor([[0, 0, 0, 5, 9, 12], [3, 17, 5, 9, 12, 7]])
    attention_mask = (ids != 0).long()
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # what generate passes
    monkeypatch.setattr(segments, "run", lambda req: pytest.fail("the padded batch ran as packed documents"))
    with torch.no_grad():
        logits = llama(input_ids=ids, attention_mask=attention_mask, position_ids=positions).logits
        alone = llama(input_ids=ids[:1, 3:], position_ids=positions[:1, 3:]).logits
    torch.testing.assert_close(logits[0, 3:], alone[0], atol=1e-5, rtol=1e-5)


def test_a_decoding_step_prepares_its_mask_once_for_every_layer(models, monkeypatch):
    """A step after a cache: the padded mask is made (and, being small, built as a tensor) once per forward."""
    from qkv.integrations import transformers_masks

    llama = models["llama"]
    made = []
    real = transformers_masks._for_call
    monkeypatch.setattr(transformers_masks, "_for_call", lambda *args: made.append(args[1:3]) or real(*args))
    ids = torch.tensor([[0, 0, 5, 9], [3, 17, 5, 9]])
    with torch.no_grad():
        out = llama.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=3, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    assert out.shape == (2, 7)
    assert made == [(4, 4), (1, 5), (1, 6)]  # one per forward, not one per layer (the model has 2)


def test_position_ids_shared_by_layers_are_read_once_and_a_change_is_seen():
    """Every layer gets the same position_ids tensor: read once; written in place or replaced, read again."""
    from qkv.integrations import transformers_packing as packing

    q, k = torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    reads = []
    real = packing._restarts
    packing._restarts = lambda *a: reads.append(1) or real(*a)
    try:
        first = [packing.documents_for(q, k, {"position_ids": positions}) for _ in range(3)]
        assert len(reads) == 1 and all(d is first[0] for d in first)
        positions[0, 3:] = torch.tensor([3, 4, 5])  # in place: now one sequence
        assert packing.documents_for(q, k, {"position_ids": positions}) is None and len(reads) == 2
        other = torch.tensor([[0, 1, 0, 1, 0, 1]])  # another tensor
        docs = packing.documents_for(q, k, {"position_ids": other})
        assert len(reads) == 3 and docs is not None
    finally:
        packing._restarts = real


@pytest.mark.parametrize(
    "positions, use_cache, attention_mask, packed",
    [
        ([[0, 1, 2, 10, 11, 12]], True, False, False),  # positions that jump: one sequence (flash_attention_2's reading)
        ([[0, 1, 2, 10, 11, 12]], False, False, True),  # no cache, no mask: transformers' own packing splits at the jump
        ([[0, 1, 2, 0, 1, 2]] * 2, True, False, False),  # a batch of two rows: not packing
        ([[0, 1, 2, 0, 1, 2]], False, False, True),  # a training forward: transformers' sdpa packs too
        ([[0, 1, 2, 0, 1, 2]], True, True, True),  # with a cache or an all-ones mask: packed, as flash_attention_2 reads it
        ([[3, 4, 0, 1, 2, 3]], False, True, False),  # the first token is not at the smallest position: not packing
    ],
    ids=["jump", "jump-no-cache", "two-rows", "restart-no-cache", "restart-cache-mask", "first-not-smallest"],
)
def test_position_ids_are_read_as_packing_where_transformers_reads_them_so(models, positions, use_cache, attention_mask, packed):
    """Where transformers' sdpa packs (no cache, no mask), qkv keeps its sequences; elsewhere qkv reads one row's
    positions as flash_attention_2 does: sequences start at the smallest position, a jump is not a start."""
    import copy

    llama = models["llama"]
    sdpa = copy.deepcopy(llama)
    sdpa.set_attn_implementation("sdpa")
    positions = torch.tensor(positions)
    ids = torch.randint(1, 48, positions.shape, generator=torch.Generator().manual_seed(5))
    kw = dict(input_ids=ids, position_ids=positions, use_cache=use_cache)
    if attention_mask:
        kw["attention_mask"] = torch.ones_like(ids)
    with torch.no_grad():
        got = llama(**kw).logits
        if packed:  # each sequence alone
            starts = [t for t in range(1, ids.shape[1]) if positions[0, t] != positions[0, t - 1] + 1]
            if kw.get("attention_mask") is not None or use_cache:
                starts = [t for t in range(1, ids.shape[1]) if positions[0, t] == positions[0].min()]
            bounds = [0, *starts, ids.shape[1]]
            want = torch.cat([llama(input_ids=ids[:, a:b], position_ids=positions[:, a:b] - positions[0, a:b].min(),
                                    use_cache=False).logits for a, b in zip(bounds, bounds[1:])], 1)  # fmt: skip
        else:
            want = sdpa(**kw).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
