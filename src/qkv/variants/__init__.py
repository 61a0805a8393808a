"""Attention variants of current models, each a small module that plugs into ``MultiHeadAttention``.

* :class:`QKNorm` — per-head RMSNorm of q and k (``qk_norm=`` slot): Qwen 3, Gemma 3.
* :class:`OutputGate` — a sigmoid gate on each head's output (``gate=`` slot): Qiu et al. 2025.
* :class:`DifferentialAttention` — the difference of two softmax maps (``attention=``):
  Ye et al. 2024; :func:`differential_attention` is its functional core.
* :class:`SigmoidAttention` — sigmoid instead of softmax, bias ``−log n`` (``attention=``):
  Ramapuram et al. 2024; :func:`sigmoid_attention` is its tiled kernel.
"""

from .differential import DifferentialAttention, differential_attention, lambda_init
from .gate import OutputGate
from .qk_norm import QKNorm
from .sigmoid import SigmoidAttention, sigmoid_attention

__all__ = [
    "DifferentialAttention",
    "OutputGate",
    "QKNorm",
    "SigmoidAttention",
    "differential_attention",
    "lambda_init",
    "sigmoid_attention",
]
