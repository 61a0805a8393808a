"""Paged KV caches for serving: FlashInfer's page tables, many requests in one call.

``qkv.paged_attention`` (:mod:`.attention`) attends each request's queries to its pages;
``qkv.PagedKVCache`` (:mod:`.kv_cache`) hands out and frees the pages and writes the page
tables.
"""

from .attention import paged_attention
from .kv_cache import PagedKVCache, Step

__all__ = ["PagedKVCache", "Step", "paged_attention"]
