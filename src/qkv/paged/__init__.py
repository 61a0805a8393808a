"""Paged KV caches for serving: FlashInfer's page tables, many requests in one call.

``qkv.paged_attention`` (:mod:`.attention`) attends each request's queries to its pages (the plans of
the last tables it was given kept while their values repeat, :mod:`.recent`), a
``qkv.paged.PagedPlan`` (:mod:`.plan`) the same for every layer of a step, its table laid out once;
``qkv.PagedKVCache`` (:mod:`.kv_cache`) hands out and frees the pages and writes the page
tables (``qkv.paged.OutOfPages`` when the pool is full); ``qkv.paged.Int8Pages`` (:mod:`.quant`) holds the pages in int8, read a tile at a time;
``qkv.paged_latent_attention`` (:mod:`.latent`) is multi-head latent attention over FlashInfer's MLA pages.
"""

from .attention import paged_attention
from .errors import OutOfPages
from .kv_cache import PagedKVCache, Step
from .latent import LatentPages, paged_latent_attention
from .plan import PagedPlan
from .quant import Int8Pages

__all__ = ["Int8Pages", "LatentPages", "OutOfPages", "PagedKVCache", "PagedPlan", "Step", "paged_attention", "paged_latent_attention"]
