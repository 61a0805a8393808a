"""qkv: attention mechanisms for PyTorch.

    import qkv
    out = qkv.attention(q, k, v)                         # q (b, h, i, d), k (b, g, j, d), v (b, g, j, e)
    mha = qkv.MultiHeadAttention(dim=512, heads=8)       # batch-first (b, i, dim)

See docs/DESIGN.md for the layers; every name exported here is public and stable.
"""

from importlib.metadata import PackageNotFoundError as _NotInstalled, version as _installed_version

from . import approx, backends, blocks, cache, edits, flash_attn, masks, models, paged, positional, score_mods, scores, tasks
from . import variants
from .attention import Attention, MultiHeadAttention
from .blocks import Decoder, Encoder, TransformerDecoderLayer, TransformerEncoderLayer
from .feed_forward import FeedForward
from .cache import DecoderCache, KVCache, LatentCache, StreamingCache
from .flex import flex_attention
from .functional import attention, attention_weights, explain, merge
from .integrations.transformers_edits import edit, record  # transformers models run with attn_implementation="qkv"
from .integrations.transformers_hooks import hooks, reset_hooks, run_with_cache, run_with_hooks  # TransformerLens' hook functions in them
from .latent import MultiHeadLatentAttention
from .paged import PagedKVCache, paged_attention, paged_latent_attention
from .positional import ALiBi, LearnedPositionalEmbedding, RelativePositionBias, Rotary, SinusoidalEncoding
from .score_mods import SoftCap
from .torch_sdpa import scaled_dot_product_attention
from .torch_varlen import varlen_attn, varlen_attn_out
from .varlen import pad_input, unpad_input, varlen_attention
from .variants import DifferentialAttention, OutputGate, QKNorm, SigmoidAttention

try:
    __version__ = _installed_version("qkv")
except _NotInstalled:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"

__all__ = [
    "ALiBi",
    "Attention",
    "Decoder",
    "DecoderCache",
    "DifferentialAttention",
    "Encoder",
    "FeedForward",
    "KVCache",
    "LatentCache",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "MultiHeadLatentAttention",
    "OutputGate",
    "PagedKVCache",
    "QKNorm",
    "RelativePositionBias",
    "Rotary",
    "SigmoidAttention",
    "SinusoidalEncoding",
    "SoftCap",
    "StreamingCache",
    "TransformerDecoderLayer",
    "TransformerEncoderLayer",
    "__version__",
    "approx",
    "attention",
    "attention_weights",
    "backends",
    "blocks",
    "cache",
    "edit",
    "edits",
    "explain",
    "flash_attn",
    "flex_attention",
    "hooks",
    "masks",
    "merge",
    "models",
    "pad_input",
    "paged",
    "paged_attention",
    "paged_latent_attention",
    "positional",
    "record",
    "reset_hooks",
    "run_with_cache",
    "run_with_hooks",
    "score_mods",
    "scaled_dot_product_attention",
    "scores",
    "tasks",
    "unpad_input",
    "variants",
    "varlen_attention",
    "varlen_attn",
    "varlen_attn_out",
]
