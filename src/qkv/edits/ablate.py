"""Head ablation: a head's output ``z`` set to zero or to its mean (Michel et al. 2019; TransformerLens).

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``i`` query length, ``e``
value size; ``H`` the number of ablated heads.

``z (..., h, i, e)`` is a head's attention output before the output projection ``W_O``
(TransformerLens' ``hook_z``). The layer's output is ``Σ_h z_h W_O[h] + b_O``, so

* ``how="zero"``: ``z_h ← 0`` removes head ``h``'s term, the same as zeroing its columns of
  ``W_O`` (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than One?", whose
  head mask multiplies ``z_h`` by 0);
* ``how="mean"``: ``z_h[n, r] ← mean over n', r' of z_h[n', r']``, the mean over the batch
  and the positions of this call (the mean ablation of the interpretability literature; some
  average over the batch alone, per position: patch that mean in with ``PatchZ``), so the head keeps its
  average contribution and loses what depends on the input. Padded positions count: pass
  a mean computed elsewhere (``how=`` a tensor ``(H, e)``, e.g. over a reference set
  recorded with ``qkv.record``) to leave them out. With a KV cache a call holds only the new
  positions, so its mean is not the sequence's (a decoding step of one token in a batch of
  one: that token's own ``z``, no ablation at all), and the same ablation with and without
  the cache would differ; ``MultiHeadAttention`` with a cache and the transformers
  integration refuse ``"mean"`` in a call with cached keys (:func:`refuse_mean_with_cache`).
  A tensor ``how=`` applies alike with and without the cache;
* ``how=`` a tensor ``(H, e)`` (or ``(e,)``): that value, one row per ablated head.

The attention itself runs unchanged on qkv's engines; the edit costs one pass over ``z``.
Checked against eager attention with ``W_O``'s columns zeroed, in qkv's own models
and through the transformers integration.
"""

from __future__ import annotations

from torch import Tensor

from .base import Call, Edit, as_edits, check_selection, indices, once_each


class AblateHeads(Edit):
    """Set the output ``z`` of some heads to zero (``how="zero"``), to its mean (``"mean"``) or to a given value."""

    def __init__(self, heads, how: str | Tensor = "zero"):
        check_selection("AblateHeads: heads", heads)
        if not isinstance(how, Tensor) and how not in ("zero", "mean"):
            raise ValueError(f"AblateHeads: how expected 'zero', 'mean' or a tensor (heads, e), got {how!r}")
        self.heads, self.how = heads, how

    def finish(self, call: Call, out: Tensor) -> Tensor:
        heads = indices("AblateHeads: heads", self.heads, call.heads).to(out.device)
        ablated = out.new_zeros(call.heads, dtype=bool).index_fill(0, heads, True)[:, None, None]  # (h, 1, 1)
        if isinstance(self.how, str) and self.how == "zero":
            return out.masked_fill(ablated, 0)  # a new tensor: the gradient of the kept heads flows, theirs is 0
        value = out.new_zeros(call.heads, out.shape[-1])  # (h, e), rows of the ablated heads filled below
        value = value.index_copy(0, heads, self._value(out, heads))
        return out.where(~ablated, value[:, None, :].to(out.dtype))

    def _value(self, out: Tensor, heads: Tensor) -> Tensor:
        """``(H, e)``: what the ablated heads' ``z`` becomes."""
        if isinstance(self.how, str):  # "mean": over every leading dim and every position, one vector per head
            chosen = out.index_select(-3, heads).movedim(-3, 0)  # (H, ..., i, e)
            return chosen.reshape(len(heads), -1, out.shape[-1]).mean(1)
        once_each("AblateHeads: heads", self.heads, heads.cpu(), "head")  # one row of how per head
        value = self.how.to(device=out.device, dtype=out.dtype)
        expected = (len(heads), out.shape[-1])
        if value.dim() == 1 and value.shape[0] == expected[1]:  # (e,): every ablated head alike (else the error below)
            value = value.expand(expected)
        if tuple(value.shape) != expected:
            raise ValueError(f"AblateHeads: how expected a tensor of shape {expected} (heads, e) or ({expected[1]},), got {tuple(self.how.shape)}")
        return value

    def __repr__(self) -> str:
        how = f"tensor{tuple(self.how.shape)}" if isinstance(self.how, Tensor) else repr(self.how)
        return f"AblateHeads({self.heads!r}, how={how})"


def refuse_mean_with_cache(edits, who: str, i: int, j: int, instead: str) -> None:
    """Refuse ``AblateHeads(how="mean")`` in a self-attention call with cached keys, where it would silently
    differ from the same run without the cache.

    The mean runs over the call's own positions; with a KV cache those are only the new ones
    (a decoding step: one token, whose mean in a batch of one is its own ``z``, so the head
    is not ablated at all), while without the cache every step averages the whole sequence
    again. No per-call mean makes the two agree; a fixed mean (``how=`` a tensor) does.
    ``who`` was called with ``i`` query rows against ``j`` keys; ``instead`` is its other way out.
    """
    if any(isinstance(e, AblateHeads) and isinstance(e.how, str) and e.how == "mean" for e in as_edits(edits)):
        raise ValueError(f"AblateHeads(how='mean'): {who} was called with {i} query rows against {j} keys, so the "
                         "earlier keys come from a KV cache and the mean would cover the new rows only (a decoding "
                         "step: one token, its own z, no ablation); pass a fixed mean, how= a tensor (heads, e) such "
                         f"as a recorded z's mean over the prompt, {instead}")  # fmt: skip

