"""Small models built from qkv's attention, each trainable on a CPU in minutes.

Transformers (``transformer.py``, ``lm.py``, ``classifier.py``):

* :class:`Transformer` / :class:`TransformerConfig` — encoder–decoder (translation).
* :class:`CausalLM` / :class:`LMConfig` — decoder-only language model with greedy,
  temperature and top-k generation, with or without a KV cache (:func:`sample_next`).
* :class:`EncoderClassifier` / :class:`ClassifierConfig` — encoder with mean, CLS or
  attention pooling (:class:`AttentionPooling`).
* :class:`BagOfWords` / :class:`BagOfWordsConfig` — the order-blind baseline.

Every model takes token ids ``(b, i)`` (int64) and optional ``lengths (b,)``, and returns
its attention weights with ``return_weights=True``.
"""

from .classifier import AttentionPooling, BagOfWords, BagOfWordsConfig, ClassifierConfig, EncoderClassifier
from .lm import CausalLM, LMConfig, sample_next
from .transformer import Transformer, TransformerConfig

# Recurrent and seq2seq models (rnn.py, seq2seq.py, luong.py, decoding.py, recommend.py) are
# written separately; their exports go below this line, and their names into __all__.

__all__ = [
    "AttentionPooling",
    "BagOfWords",
    "BagOfWordsConfig",
    "CausalLM",
    "ClassifierConfig",
    "EncoderClassifier",
    "LMConfig",
    "Transformer",
    "TransformerConfig",
    "sample_next",
]
