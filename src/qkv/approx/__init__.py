"""Approximate attention mechanisms: sub-quadratic stand-ins for softmax attention.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

Every class is a qkv *mechanism* (DESIGN.md): an ``nn.Module`` with
``forward(q (b, h, i, d), k (b, g, j, d), v (b, g, j, e), *, mask=None, causal=False,
return_weights=False)`` returning ``out (b, h, i, e)`` or ``(out, weights (b, h, i, j))``.
What each can honour:

=================  ======  ==================  ==============  =========================
class              causal  masks               cross (i != j)  weights (materialised)
=================  ======  ==================  ==============  =========================
Linformer          no      key padding         yes             effective ``P F``
LSHAttention       yes     any bool mask       no (shared QK)  effective, scattered
Performer          yes     key padding         yes             implicit ``φφᵀ/rowsum``
LinearAttention    yes     key padding         yes             implicit ``φφᵀ/rowsum``
NystromAttention   no      key padding         yes             ``F̃ Ã⁺ B̃``
=================  ======  ==================  ==============  =========================

What cannot be honoured raises ``ValueError`` naming the argument; those checks, which open
every forward call, are written once in their base, :class:`qkv.approx.base.ApproxAttention`.
Each module's math lives in a pure function beside it (``linformer_attention``, ``lsh_attention``,
``favor_attention``, ``linear_attention``, ``nystrom_attention``).
"""

from .linear import LinearAttention, elu_feature_map, kernel_attention, kernel_attention_weights, linear_attention
from .linformer import Linformer, linformer_attention, linformer_weights
from .nystrom import NystromAttention, iterative_pinv, nystrom_attention, segment_means
from .performer import Performer, favor_attention, favor_features, gaussian_features
from .reformer import LSHAttention, lsh_attention, lsh_buckets, random_rotations

__all__ = [
    "LSHAttention",
    "LinearAttention",
    "Linformer",
    "NystromAttention",
    "Performer",
    "elu_feature_map",
    "favor_attention",
    "favor_features",
    "gaussian_features",
    "iterative_pinv",
    "kernel_attention",
    "kernel_attention_weights",
    "linear_attention",
    "linformer_attention",
    "linformer_weights",
    "lsh_attention",
    "lsh_buckets",
    "nystrom_attention",
    "random_rotations",
    "segment_means",
]
