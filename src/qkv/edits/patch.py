"""Attention-pattern patching: given weights for some heads and query rows, and ``α'V`` for those rows only.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``e`` value size; ``H`` and ``R`` the number of patched heads and
rows.

Activation patching (Vig et al. 2020; Meng et al. 2022; TransformerLens'
``patching.get_act_patch_attn_head_pattern_by_pos``) runs a model on a corrupted input with
one piece of a clean run put in. Here the piece is a head's attention pattern at some query
rows: for each patched head ``n`` and row ``r``::

    z[..., n, r, :] = Σ_c pattern[..., n, r, c] · v[..., n // (h/g), c, :]

with the patched call's own values ``v`` (the corrupted run's), the other rows and heads as
the call computed them. Only the patched rows are recomputed, ``H · R · j · e`` products,
never the ``(h, i, j)`` map; the call itself runs on qkv's engines unchanged. ``pattern`` is
typically the clean run's ``qkv.attention_weights(..., weights_for={"heads": heads, "rows":
rows})`` or a ``qkv.record`` entry. With dropout, the patched rows are not dropped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Call, Edit, check_batch, check_patch, patched


class PatchPattern(Edit):
    """Replace the attention weights of ``heads`` at query ``rows`` by ``pattern (..., H, R, j)``; recompute those rows."""

    def __init__(self, heads, rows, pattern: Tensor):
        check_patch("PatchPattern", heads, rows, "pattern", pattern, "(..., heads, rows, j)")
        self.heads, self.rows, self.pattern = heads, rows, pattern

    def _chosen(self, call: Call) -> tuple[Tensor, Tensor]:
        """The patched heads and rows as index tensors, with ``pattern``'s shape checked against them."""
        heads, rows = patched("PatchPattern", self.heads, self.rows, call)
        expected = (len(heads), len(rows), call.k.shape[-2])
        if tuple(self.pattern.shape[-3:]) != expected:
            raise ValueError(
                f"PatchPattern: pattern expected shape (..., {expected[0]}, {expected[1]}, {expected[2]}) "
                f"(heads, rows, j), got {tuple(self.pattern.shape)}; this call has {call.rows} query rows and "
                f"{expected[2]} keys (a generate() decoding step: 1 row, every key so far)"
            )
        check_batch("PatchPattern: pattern", self.pattern, call)
        return heads, rows

    def finish(self, call: Call, out: Tensor) -> Tensor:
        heads, rows = self._chosen(call)
        heads, rows = heads.to(out.device), rows.to(out.device)
        group = call.heads // call.kv_heads  # query heads per KV head
        v = call.v.index_select(-3, heads // group)  # (..., H, j, e)
        patched = self.pattern.to(device=v.device, dtype=v.dtype) @ v  # (..., H, R, e): only these rows
        out = out.clone()  # the caller's output stays as computed
        out[..., heads[:, None], rows[None, :], :] = patched.to(out.dtype).expand(*out.shape[:-3], *patched.shape[-3:])
        return out

    def weights(self, call: Call, weights: Tensor, heads: Tensor | None, rows: Tensor | None) -> Tensor:
        mine_h, mine_r = self._chosen(call)
        at_h, from_h = _match(mine_h, heads)
        at_r, from_r = _match(mine_r, rows)
        if len(at_h) == 0 or len(at_r) == 0:
            return weights  # none of the returned weights is patched
        device = weights.device
        part = self.pattern.to(device=device, dtype=weights.dtype)[..., from_h.to(device)[:, None], from_r.to(device)[None, :], :]
        weights = weights.clone()
        weights[..., at_h.to(device)[:, None], at_r.to(device)[None, :], :] = part.expand(*weights.shape[:-3], *part.shape[-3:])
        return weights

    def with_weights(self, call: Call, weights: Tensor) -> PatchPattern:
        heads, rows = self._chosen(call)
        mine = weights.index_select(-3, heads.to(weights.device)).index_select(-2, rows.to(weights.device))
        return PatchPattern(self.heads, self.rows, mine)

    def __repr__(self) -> str:
        return f"PatchPattern({self.heads!r}, {self.rows!r}, pattern{tuple(self.pattern.shape)})"


def _match(patched: Tensor, selected: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(at, source)``: positions in ``selected`` (None: all, position = index) of patched indices, and theirs in ``patched``."""
    if selected is None:
        return patched, torch.arange(len(patched))
    hit = selected.cpu()[:, None] == patched[None, :]  # (S, P)
    at, source = hit.nonzero(as_tuple=True)
    return at, source

