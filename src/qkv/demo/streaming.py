"""Demo step 5: decoding ten times past the training length with StreamingLLM's cache.

Shape legend: ``b`` test streams, ``n`` tokens per stream, ``L`` the training length,
``h`` heads.

A small causal language model (``qkv.models.CausalLM``, rotary positions) learns a stream
of made-up words (``qkv.tasks.make_word_stream_task``) from sequences of ``L`` tokens, then
reads test streams of ``n ≈ 10 L`` tokens (``4 L`` in a quick run). Its per-token loss is
measured three ways:

* **full cache, positions in the text** — every earlier token kept, the query at position
  ``t``: past ``L`` the rotary angles are ones the model never saw, and the loss climbs;
* **sliding window** — ``qkv.cache.StreamingCache(sink_tokens=0, window=L)``: the last
  ``L`` tokens, numbered within the cache, so no position exceeds the training range;
* **window + attention sinks** — ``StreamingCache(sink_tokens=4, window=L - 4)``: the
  first four tokens kept as well (Xiao et al. 2024), the same memory.

Both caches hold ``L`` positions whatever ``n`` is, and stay near the loss within the
training length. The first tokens matter to the extent the model puts attention on them;
the step measures that share (attention of the later queries of a training-length
stretch on the first token), since the paper's window baseline fails on large models
that put most of a head's attention there, and small models trained for seconds put far
less. The picture is perplexity (``exp`` of the mean loss) over stretches of ``L / 2``
tokens along the stream.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv import viz
from qkv.cache import DecoderCache, StreamingCache
from qkv.models import CausalLM, LMConfig
from qkv.tasks import make_word_stream_task

from .context import Context, Figure, Metric, StepResult
from .train import fit

NAME = "decoding past the training length"
SINKS = 4
#: A streaming cache meets its target when the perplexity of the last L tokens is at most
#: this times the perplexity within the training length.
KEEPS = 1.2


def _change(first: float, last: float) -> str:
    """How a perplexity went from the first to the last stretch, in words, with both numbers."""
    if last > KEEPS * first:
        return f"rises from {first:.2f} to {last:.2f} ({last / first:.1f}\u00d7)"
    if last < first / KEEPS:
        return f"falls from {first:.2f} to {last:.2f}"
    return f"stays near where it was ({first:.2f}, then {last:.2f})"


def caption(length: int, test_length: int, within: dict[str, float], beyond: dict[str, float],
            held: dict[str, int], share: float) -> str:  # fmt: skip
    """The figure's caption, every number and verdict in it taken from this run's measurements.

    ``within``/``beyond``/``held`` are keyed by the three caches in :func:`run`'s order. A
    quick run reads shorter streams and trains too briefly for the caches to keep their
    perplexity; the caption says what this run measured, not what a full run shows.
    """
    full, window, sinks = within
    return (
        f"Perplexity along test streams {test_length // length} times longer than the {length}-token "
        f"training sequences (log scale); each pair of numbers here is the perplexity of the first "
        f"{length} tokens, then of the last {length}. Keeping every token with its position in the text takes "
        f"the model to positions it never saw: its perplexity {_change(within[full], beyond[full])}. "
        f"The two streaming caches hold {held[window]} tokens, numbered within the cache (the last "
        f"{length}, or the first {SINKS} and the last {length - SINKS}), however long the stream, so "
        f"memory stays bounded; with the sliding window the perplexity {_change(within[window], beyond[window])}, "
        f"and with attention sinks it {_change(within[sinks], beyond[sinks])}. How much the first "
        "tokens add depends on how much attention the model puts on them; this small model puts "
        f"{100 * share:.1f}% on the first token."
    )


@torch.inference_mode()
def token_losses(model: CausalLM, ids: Tensor, cache: DecoderCache | None) -> Tensor:
    """``(b, n - 1)`` next-token losses of ``ids (b, n)``: one full pass, or token by token through ``cache``."""
    if cache is None:
        logits = model(ids[:, :-1])
    else:
        logits = torch.cat([model(ids[:, t : t + 1], cache=cache) for t in range(ids.shape[1] - 1)], dim=1)
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


@torch.inference_mode()
def first_token_share(model: CausalLM, ids: Tensor) -> float:
    """Mean attention weight on the first token, over the heads, layers and the later half of the queries."""
    _, weights = model(ids, return_weights=True)
    half = ids.shape[1] // 2
    return float(torch.stack([w[:, :, half:, 0].mean() for w in weights]).mean())


def run(ctx: Context) -> StepResult:
    length = 32 if ctx.quick else 64
    test_length = 4 * length if ctx.quick else 10 * length
    task = make_word_stream_task(n_train=256 if ctx.quick else 1024, length=length, n_test=4,
                                 test_length=test_length, seed=ctx.seed_for(5))  # fmt: skip
    config = LMConfig(vocab=len(task.vocabulary), dim=64, heads=4, layers=2, positional="rotary", max_len=length)
    model = CausalLM(config)
    steps = ctx.training_steps(full=300, quick=40)
    fit(model, lambda m, ids: m.loss(ids), (task.train,), ctx=ctx, steps=steps, generator=ctx.generator(5),
        batch_size=32, lr=3e-3, desc="language model")  # fmt: skip

    def streaming(sinks: int) -> DecoderCache:
        return DecoderCache(config.layers, layer_cache=lambda: StreamingCache(sink_tokens=sinks, window=length - sinks))

    caches = {
        "full cache, positions in the text": None,
        "sliding window": streaming(0),
        f"window + {SINKS} attention sinks": streaming(SINKS),
    }
    losses = {label: token_losses(model, task.test, cache) for label, cache in caches.items()}
    held = {label: (test_length - 1 if c is None else c.self_attn[0].length) for label, c in caches.items()}
    share = first_token_share(model, task.test[:, :length])

    # perplexity within the training length, and over the last stretch of L tokens
    within = {label: math.exp(loss[:, : length - 1].mean().item()) for label, loss in losses.items()}
    beyond = {label: math.exp(loss[:, -length:].mean().item()) for label, loss in losses.items()}
    stretch = length // 2
    starts = list(range(0, test_length - 1 - stretch + 1, stretch))
    centres = [s + stretch / 2 for s in starts]
    curves = {label: [math.exp(loss[:, s : s + stretch].mean().item()) for s in starts] for label, loss in losses.items()}
    viz.save(
        viz.curves(centres, curves, xlabel="position in the stream (tokens)", ylabel="perplexity",
                   marks={"training length": length}, log_y=True,
                   title=f"a language model trained on {length} tokens, reading {test_length}"),  # fmt: skip
        ctx.out / "streaming_perplexity.png",
    )
    ctx.echo(f"language model: 2 layers, 4 heads, rotary positions, trained on {length}-token sequences "
             f"for {steps} steps; 4 test streams of {test_length} tokens")  # fmt: skip
    width = max(len(label) for label in losses)
    ctx.echo(f"{'':{width}}  perplexity: first {length} tokens   last {length} tokens   positions held")
    for label in losses:
        ctx.echo(f"{label:{width}}  {within[label]:>27.2f}   {beyond[label]:>16.2f}   {held[label]:>14}")
    ctx.echo(f"attention on the first token (later queries, mean over heads and layers): {100 * share:.1f}%")

    metrics = []
    for label in losses:
        target = f"<= {KEEPS}" if label != "full cache, positions in the text" else ""
        metrics.append(Metric(NAME, label, f"perplexity, first {length} tokens", within[label]))
        metrics.append(Metric(NAME, label, f"perplexity, last {length} tokens", beyond[label]))
        metrics.append(Metric(NAME, label, f"last / first {length} tokens", beyond[label] / within[label], target))
    metrics.append(Metric(NAME, "language model", "attention on the first token", share, unit="%"))
    return StepResult(
        NAME,
        metrics=metrics,
        figures=[
            Figure(
                "streaming_perplexity.png",
                "Decoding past the training length",
                caption(length, test_length, within, beyond, held, share),
            )
        ],
        data={
            "training_length": length,
            "stream_length": test_length,
            "stretch_centres": centres,
            "perplexity": curves,
            "first_token_attention": share,
        },
    )
