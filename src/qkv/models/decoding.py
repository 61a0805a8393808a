"""Greedy and beam-search decoding for any step-wise decoder with attention.

Shape legend: ``b`` batch, ``k`` beam size, ``t`` generated steps, ``j`` source length,
``c`` target vocabulary size.

A model decodes here if it has ``bos_id``, ``eos_id`` and ``pad_id`` attributes and

* ``start(src (b, j), src_lengths (b,) or None) -> (memory, state)``: encode once; both
  are tuples of tensors whose first dim is the batch (so beams can be copied and
  reordered with ``index_select``);
* ``step(memory, state, token (b,), position: int) -> (log_probs (b, c), state, weights (b, j))``:
  one decoder step from the previous token, returning next-token log-probabilities and
  the attention weights used for them.

Beam search (as used by Sutskever et al. 2014 and Bahdanau et al. 2015) keeps the ``k``
best prefixes by total log-probability. A hypothesis that has produced EOS stays in the
beam with its score frozen (it may only be extended by padding, at no cost), so it
competes with the live ones until the end. The winner is the hypothesis with the highest
``log p / length^α`` (``length_penalty = α``; 0 compares raw sums, which favour short
outputs; 1 compares the mean log-probability per token). With ``k = 1`` this is exactly
greedy decoding (checked in the test suite). A batch of 0 rows decodes to
empty results after one step, as the transformers' ``generate`` does: no row is left unfinished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .._args import positive_int


class StepDecoder(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int

    def start(self, src: Tensor, src_lengths: Tensor | None) -> tuple[tuple, tuple]: ...

    def step(self, memory: tuple, state: tuple, token: Tensor, position: int) -> tuple[Tensor, tuple, Tensor]: ...


@dataclass(frozen=True)
class Decoded:
    """The output of :func:`greedy` and :func:`beam_search`, one hypothesis per batch row."""

    tokens: Tensor  # (b, t) long: generated ids (no bos), eos included, pad after it
    weights: Tensor  # (b, t, j): the attention weights behind each generated token; 0 after eos
    log_prob: Tensor  # (b,): total log-probability of the tokens up to and including eos
    lengths: Tensor  # (b,) long: tokens up to and including eos (t when no eos came)


def greedy(model: StepDecoder, src: Tensor, src_lengths: Tensor | None = None, *, max_len: int = 64) -> Decoded:
    """Decode ``src (b, j)``: the most probable token at every step until EOS or ``max_len`` tokens (no gradients)."""
    positive_int("max_len", max_len)
    with torch.no_grad():
        memory, state = model.start(src, src_lengths)
        b = src.shape[0]
        token = torch.full((b,), model.bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(b, dtype=torch.bool, device=src.device)
        log_prob = torch.zeros(b, device=src.device)
        lengths = torch.zeros(b, dtype=torch.long, device=src.device)
        tokens, weights = [], []
        for position in range(max_len):
            log_probs, state, w = model.step(memory, state, token, position)
            token = log_probs.argmax(dim=-1)
            token = token.masked_fill(finished, model.pad_id)
            gained = log_probs.gather(1, token[:, None]).squeeze(1)
            log_prob = log_prob + gained.masked_fill(finished, 0.0)
            weights.append(w.masked_fill(finished[:, None], 0.0))
            tokens.append(token)
            lengths = lengths + (~finished).long()
            finished = finished | (token == model.eos_id)
            if bool(finished.all()):
                break
        return Decoded(torch.stack(tokens, 1), torch.stack(weights, 1), log_prob, lengths)


def beam_search(
    model: StepDecoder,
    src: Tensor,
    src_lengths: Tensor | None = None,
    *,
    beam_size: int = 4,
    max_len: int = 64,
    length_penalty: float = 0.0,
) -> Decoded:
    """Beam search over ``src (b, j)`` with ``beam_size`` hypotheses per row; returns the best (no gradients).

    ``length_penalty`` is ``α`` in the final ranking ``log p / length^α`` (0 = raw sums).
    """
    positive_int("beam_size", beam_size)
    positive_int("max_len", max_len)
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) or length_penalty < 0:
        raise ValueError(f"length_penalty: expected a non-negative number, got {length_penalty!r}")
    k = beam_size
    with torch.no_grad():
        memory, state = model.start(src, src_lengths)
        b, device = src.shape[0], src.device
        # Every beam of a row starts as a copy of the row: (b, ...) -> (b·k, ...).
        memory, state = _repeat(memory, k), _repeat(state, k)
        token = torch.full((b * k,), model.bos_id, dtype=torch.long, device=device)
        score = torch.zeros(b, k, device=device)
        score[:, 1:] = float("-inf")  # the copies are identical: let only one of them expand at first
        finished = torch.zeros(b, k, dtype=torch.bool, device=device)
        lengths = torch.zeros(b, k, dtype=torch.long, device=device)
        tokens = torch.zeros(b, k, 0, dtype=torch.long, device=device)
        weights: Tensor | None = None
        rows = torch.arange(b, device=device)[:, None]  # (b, 1)
        for position in range(max_len):
            log_probs, state, w = model.step(memory, state, token, position)
            c = log_probs.shape[-1]
            log_probs = log_probs.view(b, k, c)
            # A finished hypothesis continues only with padding, at log-probability 0.
            frozen = torch.full((c,), float("-inf"), device=device)
            frozen[model.pad_id] = 0.0
            log_probs = torch.where(finished[..., None], frozen, log_probs)
            top, index = (score[..., None] + log_probs).view(b, k * c).topk(k, dim=1)  # (b, k)
            parent, new_token = index // c, index % c
            was_finished = finished.gather(1, parent)
            flat = (parent + rows * k).view(-1)  # (b·k,) rows of the flattened beams to keep
            state = _select(state, flat)
            w = w.view(b, k, w.shape[-1])[rows, parent].masked_fill(was_finished[..., None], 0.0)  # (b, k, j)
            weights = w[:, :, None] if weights is None else torch.cat([weights[rows, parent], w[:, :, None]], 2)
            tokens = torch.cat([tokens[rows, parent], new_token[..., None]], 2)
            lengths = lengths.gather(1, parent) + (~was_finished).long()
            finished = was_finished | (new_token == model.eos_id)
            score, token = top, new_token.view(-1)
            if bool(finished.all()):
                break
            if not length_penalty:
                # Log-probabilities are <= 0, so a live hypothesis can only lose score: once a
                # finished one beats every live one in its row, the search cannot change.
                live = score.masked_fill(finished, float("-inf")).amax(1)
                done = score.masked_fill(~finished, float("-inf")).amax(1)
                if bool((done >= live).all()):
                    break
        ranking = score / lengths.clamp(min=1).to(score.dtype) ** length_penalty if length_penalty else score
        best = ranking.argmax(dim=1)  # (b,)
        pick = torch.arange(b, device=device)
        return Decoded(tokens[pick, best], weights[pick, best], score[pick, best], lengths[pick, best])


def _repeat(tensors: tuple, k: int) -> tuple:
    return tuple(x.repeat_interleave(k, dim=0) if isinstance(x, Tensor) else x for x in tensors)


def _select(tensors: tuple, index: Tensor) -> tuple:
    return tuple(x.index_select(0, index) if isinstance(x, Tensor) else x for x in tensors)
