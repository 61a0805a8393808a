"""Positional information for attention: lazy biases (ALiBi, T5 buckets) and encodings.

See ``base.py`` for the two contracts (:class:`Positional`, :class:`LazyBias`).
"""

from .base import LazyBias, Positional
from .bias import ALiBi, RelativePositionBias, alibi_slopes, relative_buckets

__all__ = ["ALiBi", "LazyBias", "Positional", "RelativePositionBias", "alibi_slopes", "relative_buckets"]
