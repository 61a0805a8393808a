"""Attribution views of ``qkv inspect``: head importance by ablation, and attention rollout.

Shape legend: ``l`` layers, ``h`` heads, ``n`` tokens of the text, ``d`` hidden size, ``m``
metrics.

**Head importance** (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than
One?"): for each layer ``l`` and head ``h``, the model runs once more with that head's
output ``z`` zeroed (``qkv.edit(model, {l: AblateHeads([h], how="zero")})``, qkv's fused
attention, no eager fall-back) and a metric compares that run with the clean one. Positive
means that removing the head changes (for a loss: hurts) the model's output. The metrics:

* a decoder (causal LM): ``loss``, the change of the mean next-token loss over the text
  (nats; tokens 1..n-1 predicted from those before); ``last``, the change of the loss of
  the last token alone (minus the change of its log-probability). The logits are the base
  model's final hidden states times its LM head: the input embeddings when they are tied
  (SmolLM2, most small LMs), else the ``lm_head`` of ``AutoModelForCausalLM`` loaded once
  more from the same place. Logit soft-capping or scaling that some models add is not
  applied;
* an encoder (the packaged MiniLM, a sentence encoder with mean pooling): ``embedding``,
  ``1 - cos`` between the mean-pooled final states of the ablated and the clean run (how
  far the sentence embedding turns, 0..2);
* both: ``states``, the mean over tokens of ``|h' - h| / |h|`` for the final hidden states.

One forward per (layer, head): ``l * h`` forwards, a second for MiniLM on a sentence, a
few minutes for a 30-layer model on a paragraph; ``layers`` limits them, and the layers
left out are NaN in the ``(m, l, h)`` result.

**Attention rollout** (Abnar & Zuidema 2020, "Quantifying Attention Flow in
Transformers"): per layer the head-averaged weights ``A_l (n, n)``, the residual added as
``Â_l = 0.5 A_l + 0.5 I`` (rows renormalised), and ``R_l = Â_l ... Â_0``; row ``i`` of
``R_l`` is how token ``i`` after layer ``l`` draws on the input tokens. The weights are
qkv's (``qkv.record``, or the page's capture when it holds every head and row); the
``(n, n)`` matrices are built only up to :data:`ROLLOUT_TOKENS` tokens.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .capture import Capture, Text
from .model import Loaded

__all__ = ["ROLLOUT_TOKENS", "Attribution", "Importance", "Metric", "Rollout", "attribute", "head_importance",
           "layer_attention", "rollout"]  # fmt: skip

#: The longest text whose rollout is built: (n, n) per layer.
ROLLOUT_TOKENS = 512


@dataclass(frozen=True)
class Metric:
    key: str  # "loss", "last", "embedding", "states"
    label: str  # shown in the page's metric control
    explain: str  # one sentence under the heat map


@dataclass(frozen=True)
class Importance:
    """``values (m, l, h)``: metric ``m`` after ablating head ``h`` of layer ``l``, NaN where not run."""

    metrics: tuple[Metric, ...]
    values: np.ndarray
    layers: tuple[int, ...]  # the layers that were run
    clean: dict[str, float]  # the clean run's value of the metrics that have one (the loss)
    note: str = ""  # why a metric is missing, or empty


@dataclass(frozen=True)
class Rollout:
    """``matrices (l, n, n)``: the rollout through each layer; None (with ``note``) when the text is too long."""

    matrices: np.ndarray | None
    note: str = ""


@dataclass(frozen=True)
class Attribution:
    importance: Importance
    rollout: Rollout


METRICS = {
    "loss": Metric("loss", "\u0394 loss over the text",
                   "The change of the mean next-token loss (nats) when the head is zeroed: positive, the head helps."),
    "last": Metric("last", "\u0394 loss of the last token",
                   "The change of the last token's loss, -\u0394 log p(last token | the text before), when the head is zeroed."),
    "embedding": Metric("embedding", "1 \u2212 cos of the sentence embedding",
                        "How far the mean-pooled final states (the sentence embedding) turn when the head is zeroed: "
                        "1 \u2212 cosine to the clean one."),
    "states": Metric("states", "relative change of the final states",
                     "The mean over tokens of |h\u2032 \u2212 h| / |h| for the final hidden states when the head is zeroed."),
}  # fmt: skip


# ---- rollout -------------------------------------------------------------------------------------


def rollout(attention: np.ndarray, residual: float = 0.5) -> np.ndarray:
    """``attention (l, n, n)`` head-averaged weights -> ``(l, n, n)``: ``R_l = Â_l ... Â_0``.

    ``Â = (1 - residual) A + residual I``, rows renormalised to sum to 1.
    """
    attention = np.asarray(attention, dtype=np.float64)
    if attention.ndim != 3 or attention.shape[1] != attention.shape[2]:
        raise ValueError(f"rollout: expected attention of shape (layers, n, n), got {attention.shape}")
    eye = np.eye(attention.shape[1])
    out = np.empty_like(attention)
    total = eye
    for layer, weights in enumerate(attention):
        mixed = (1.0 - residual) * weights + residual * eye
        mixed /= mixed.sum(axis=-1, keepdims=True)
        total = mixed @ total
        out[layer] = total
    return out


def layer_attention(loaded: Loaded, text: Text, capture: Capture | None = None) -> np.ndarray:
    """``(l, n, n)``: every layer's weights averaged over its heads, from qkv's attention.

    The page's capture is used when it holds every head and row; else one more forward
    records the pattern with ``qkv.record``.
    """
    if capture is not None and capture.selection.complete:
        return capture.weights.astype(np.float64).mean(axis=1)
    from ..integrations.transformers_edits import record

    input_ids = torch.tensor([text.ids], dtype=torch.long)
    with torch.inference_mode(), record(loaded.model, hooks=("pattern",)) as recording:
        loaded.model(input_ids=input_ids)
    layers = [recording[f"blocks.{layer}.attn.hook_pattern"] for layer in range(loaded.layers)]
    return np.stack([w[0].double().mean(0).numpy() for w in layers])


# ---- head importance -----------------------------------------------------------------------------


def _lm_head(loaded: Loaded) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Final hidden states -> logits, or None when the model has no LM head to be found."""
    model = loaded.model
    embed = model.get_input_embeddings()
    tied = getattr(model.config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    if tied and embed is not None:
        weight = embed.weight
        return lambda hidden: torch.nn.functional.linear(hidden, weight)
    if loaded.where is None:
        return None
    import transformers

    extra = {"gguf_file": loaded.where.gguf_file} if loaded.where.gguf_file else {}
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            full = transformers.AutoModelForCausalLM.from_pretrained(loaded.where.folder, **extra)
    except (OSError, ValueError, KeyError):
        return None
    head = full.get_output_embeddings()
    del full
    return None if head is None else head.eval()


def _final(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids).last_hidden_state[0].double()  # (n, d)


def _losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``(n - 1,)`` next-token losses: token ``t + 1`` from the logits at ``t``."""
    return torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="none")


def head_importance(
    loaded: Loaded, text: Text, *, layers: tuple[int, ...] | None = None, progress: Callable[[str], None] | None = None
) -> Importance:
    """The ``(m, l, h)`` importance of every head of ``layers`` (default: all), one forward each."""
    from ..edits import AblateHeads
    from ..integrations.transformers_edits import edit

    model = loaded.model
    layers = tuple(range(loaded.layers)) if layers is None else tuple(sorted(set(layers)))
    bad = [layer for layer in layers if not 0 <= layer < loaded.layers]
    if bad:
        raise ValueError(f"head_importance: layers {bad} are not in 0..{loaded.layers - 1}")
    ids = torch.tensor(text.ids, dtype=torch.long)
    input_ids = ids[None]
    note = ""
    head = _lm_head(loaded) if loaded.causal else None
    if loaded.causal and head is None:
        note = "no LM head found for this model: the loss metrics are left out"
    if loaded.causal and len(text.ids) < 2:
        head, note = None, "a one-token text has no next token: the loss metrics are left out"
    keys = (["loss", "last"] if head is not None else []) + ([] if loaded.causal else ["embedding"]) + ["states"]
    values = np.full((len(keys), loaded.layers, loaded.heads), np.nan)

    def measure(hidden: torch.Tensor) -> dict[str, float]:
        out = {"states": float(((hidden - clean_hidden).norm(dim=-1) / clean_hidden.norm(dim=-1).clamp_min(1e-12)).mean())}
        if "embedding" in keys:
            a, b = hidden.mean(0), clean_hidden.mean(0)
            out["embedding"] = float(1.0 - torch.nn.functional.cosine_similarity(a, b, dim=0))
        if head is not None:
            losses = _losses(head(hidden.to(dtype)), ids)
            out["loss"], out["last"] = float(losses.mean()), float(losses[-1])
        return out

    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        clean_hidden = _final(model, input_ids)
        clean = {k: v for k, v in measure(clean_hidden).items() if k in ("loss", "last")}
        for layer in layers:
            if progress is not None:
                progress(f"head importance: layer {layer} ({loaded.heads} forwards)")
            for h in range(loaded.heads):
                with edit(model, {layer: AblateHeads([h], how="zero")}):
                    scored = measure(_final(model, input_ids))
                for m, key in enumerate(keys):
                    values[m, layer, h] = scored[key] - clean.get(key, 0.0)
    return Importance(tuple(METRICS[k] for k in keys), values, layers, clean, note)


def attribute(
    loaded: Loaded,
    text: Text,
    capture: Capture | None = None,
    *,
    layers: tuple[int, ...] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Attribution:
    """Head importance (over ``layers``) and, for texts up to :data:`ROLLOUT_TOKENS` tokens, the rollout."""
    importance = head_importance(loaded, text, layers=layers, progress=progress)
    n = len(text.ids)
    if n > ROLLOUT_TOKENS:
        note = (f"no attention rollout: the text has {n} tokens, and the rollout is built only up to "
                f"{ROLLOUT_TOKENS} (its (n, n) matrices per layer)")  # fmt: skip
        return Attribution(importance, Rollout(None, note))
    return Attribution(importance, Rollout(rollout(layer_attention(loaded, text, capture))))


def top_heads(importance: Importance, count: int = 3) -> str:
    """One line: the ``count`` heads with the largest first metric, for the terminal."""
    metric = importance.metrics[0]
    values = importance.values[0]
    order = np.argsort(np.nan_to_num(values, nan=-np.inf), axis=None)[::-1][:count]
    picks = [np.unravel_index(k, values.shape) for k in order]
    shown = ", ".join(f"layer {int(l)} head {int(h)} ({values[l, h]:+.4g})" for l, h in picks if np.isfinite(values[l, h]))
    return f"most important heads by {metric.label}: {shown}"
