"""Edits of attention for interpretability: ablate heads, knock out edges, patch patterns, temper heads.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

    from qkv.edits import AblateHeads, Knockout, PatchPattern, ScaleHeads
    out = qkv.edits.attention(q, k, v, [AblateHeads([0, 3]), Knockout(edges)], causal=True)

* :class:`AblateHeads` ``(heads, how="zero" | "mean")``: the heads' output ``z`` zeroed or
  replaced by its mean over batch and positions (``ablate.py``);
* :class:`Knockout` ``(edges)``: query→key edges removed (True = knocked out; a bool tensor
  or a lazy ``qkv.masks`` mask, which stays lazy) (``knockout.py``);
* :class:`ScaleHeads` ``(scale)``: head ``h``'s logits times ``scale[h]`` (``scale.py``);
* :class:`PatchPattern` ``(heads, rows, pattern)``: those weights replaced, ``α'V`` recomputed
  for those rows only (``patch.py``);
* :class:`PatchZ` ``(heads, rows, z)``: those heads' output ``z`` at those rows replaced, e.g.
  by a clean run's recorded ``hook_z`` (``patch_z.py``).

Edits compose as a list (``apply.py``); mask and logit edits keep qkv's memory-efficient
engines. In transformers models loaded with ``attn_implementation="qkv"``, ``qkv.edit`` and
``qkv.record`` apply them per layer and record TransformerLens' ``hook_attn_scores``,
``hook_pattern`` and ``hook_z`` (``qkv.integrations.transformers_edits``; ``recorded.py``).
"""

from . import recorded
from .ablate import AblateHeads
from .apply import attention, edited
from .base import Call, Edit
from .knockout import Knockout
from .patch import PatchPattern
from .patch_z import PatchZ
from .scale import ScaleHeads

__all__ = [
    "AblateHeads", "Call", "Edit", "Knockout", "PatchPattern", "PatchZ", "ScaleHeads", "attention", "edited", "recorded",
]  # fmt: skip
