"""Small models built from qkv's attention, each trainable on a CPU in minutes.

Transformers (``transformer.py``, ``lm.py``, ``classifier.py``):

* :class:`Transformer` / :class:`TransformerConfig` — encoder–decoder (translation).
* :class:`CausalLM` / :class:`LMConfig` — decoder-only language model with greedy,
  temperature and top-k generation, with or without a KV cache (:func:`sample_next`).
* :class:`EncoderClassifier` / :class:`ClassifierConfig` — encoder with mean, CLS or
  attention pooling (:class:`AttentionPooling`).
* :class:`BagOfWords` / :class:`BagOfWordsConfig` — the order-blind baseline.

Recurrent (``rnn.py``, ``seq2seq.py``, ``luong.py``, ``decoding.py``) and recommendation
(``recommend.py``):

* :class:`Bahdanau`, :class:`Luong` (:class:`Seq2SeqConfig`, :class:`LuongConfig`) — GRU
  encoder–decoders with additive / dot / general / concat / location attention and global,
  local-m or local-p alignment; :func:`greedy` and :func:`beam_search` decoding.
* :class:`TargetAttention` — a candidate item attends over a user's history (DIN-style).

Every model takes token ids ``(b, i)`` (int64) and optional ``lengths (b,)``, and returns
its attention weights with ``return_weights=True``.
"""

from .classifier import AttentionPooling, BagOfWords, BagOfWordsConfig, ClassifierConfig, EncoderClassifier
from .lm import CausalLM, LMConfig
from .sampling import sample_next
from .transformer import Transformer, TransformerConfig


# Recurrent encoder-decoders with attention (Bahdanau; Luong global / local-m / local-p),
# their decoding, and target attention for recommendation.
from .decoding import Decoded, beam_search, greedy
from .luong import LuongAlignment, PositionPredictor
from .recommend import TargetAttention
from .rnn import RNNEncoder
from .seq2seq import Bahdanau, Luong, LuongConfig, Seq2SeqConfig

__all__ = [
    "AttentionPooling",
    "Bahdanau",
    "Decoded",
    "Luong",
    "LuongAlignment",
    "LuongConfig",
    "PositionPredictor",
    "RNNEncoder",
    "Seq2SeqConfig",
    "TargetAttention",
    "beam_search",
    "greedy",
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
