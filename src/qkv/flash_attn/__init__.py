"""flash-attn's dialect: the ``flash_attn`` package's functions, with its signatures and semantics, on qkv.

Code written for flash-attn moves over by changing its import::

    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from qkv.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

and ``flash_attn.bert_padding``'s ``unpad_input`` / ``pad_input`` are
``qkv.flash_attn.bert_padding``'s. Every call runs forward and backward on a CPU (the kvcache
call forward only, as flash-attn's); where qkv's answer differs from flash-attn's kernels
(a row that sees no key: lse -inf, where flash-attn 2 writes +inf; ``return_attn_probs``: no
probabilities), the function's docstring says so.
"""

from ..varlen import varlen_attention as flash_attn_varlen_func
from . import bert_padding
from .batched import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache

__all__ = [
    "bert_padding",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
