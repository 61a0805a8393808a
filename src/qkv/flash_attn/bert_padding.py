"""``flash_attn.bert_padding``'s two functions: a padded batch to packed tokens and back (``qkv.unpad_input``,
``qkv.pad_input``)."""

from ..varlen import pad_input, unpad_input

__all__ = ["pad_input", "unpad_input"]
