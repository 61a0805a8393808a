"""``flash_attn.flash_attn_interface``'s functions, for code that imports them from there (the same objects as
``qkv.flash_attn``'s)."""

from ..varlen import varlen_attention as flash_attn_varlen_func
from .batched import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .kvcache import flash_attn_with_kvcache

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
