"""flash-attn's dialect: the ``flash_attn`` package's functions, with its signatures and semantics, on qkv.

Code written for flash-attn moves over by changing its import::

    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from qkv.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

and ``flash_attn.bert_padding``'s functions are ``qkv.flash_attn.bert_padding``'s
(``flash_attn.flash_attn_interface``'s ``qkv.flash_attn.flash_attn_interface``'s).
``__version__`` is the flash-attn release whose API and semantics these follow, for code that
gates a feature on it. Every call runs forward and backward on a CPU (the kvcache
call forward only, as flash-attn's); where qkv's answer differs from flash-attn's kernels
(a row that sees no key: lse -inf, where flash-attn 2 writes +inf; ``return_attn_probs``: no
probabilities), the function's docstring says so.
"""

from . import bert_padding, flash_attn_interface
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

#: The flash-attn release whose functions these follow.
__version__ = "2.8.4"

__all__ = ["bert_padding", "flash_attn_func", "flash_attn_interface", "flash_attn_kvpacked_func",
           "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]  # fmt: skip
