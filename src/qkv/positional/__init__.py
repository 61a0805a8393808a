"""Positional information for attention: lazy biases (ALiBi, T5 buckets), rotary embeddings
(RoPE) and absolute encodings (sinusoidal, learned) added to token embeddings.

See ``base.py`` for the two contracts (:class:`Positional`, :class:`LazyBias`).
"""

from .absolute import LearnedPositionalEmbedding, SinusoidalEncoding, sinusoidal
from .base import LazyBias, Positional
from .bias import ALiBi, RelativePositionBias, alibi_slopes, relative_buckets
from .rotary import Rotary, apply_rotary, rotary_angles

__all__ = [
    "ALiBi",
    "LazyBias",
    "LearnedPositionalEmbedding",
    "Positional",
    "RelativePositionBias",
    "Rotary",
    "SinusoidalEncoding",
    "alibi_slopes",
    "apply_rotary",
    "relative_buckets",
    "rotary_angles",
    "sinusoidal",
]
