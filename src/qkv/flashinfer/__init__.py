"""FlashInfer's dialect: the ``flashinfer`` package's attention calls, with its signatures and semantics, on qkv.

Serving code written for FlashInfer moves over by changing its import::

    import flashinfer
    import qkv.flashinfer as flashinfer

``BatchDecodeWithPagedKVCacheWrapper``, ``BatchPrefillWithPagedKVCacheWrapper`` and
``BatchPrefillWithRaggedKVCacheWrapper`` (``plan`` once a step, ``run`` per layer), ``BatchAttention``
(the holistic wrapper: a mixed batch, key counts in its plan), ``BatchMLAPagedAttentionWrapper``
(multi-head latent attention over its two page pools), ``MultiLevelCascadeAttentionWrapper``
(shared prefixes in upper levels), ``BlockSparseAttentionWrapper`` (a BSR block mask),
``single_decode_with_kv_cache`` and
``single_prefill_with_kv_cache``, the cascade merges (``merge_state``, ``merge_state_in_place``,
``merge_states``), the page bookkeeping (``append_paged_kv_cache``, ``get_batch_indices_positions``,
``get_seq_lens``), the mask bit packing (``packbits``, ``segment_packbits``), the rotary embeddings
(``apply_rope``, ``apply_llama31_rope``, their ``_pos_ids`` and ``_inplace`` forms,
``apply_rope_with_cos_sin_cache``) and ``get_alibi_slopes``, under the module paths FlashInfer
gives them too (``qkv.flashinfer.decode``, ``.prefill``, ``.attention``, ``.mla``, ``.cascade``,
``.page``, ``.quantization``, ``.rope``, ``.sparse``). Every attention call runs on ``qkv.paged_attention`` (a
CPU or any device qkv runs on), forward only, as FlashInfer's kernels; its ``lse`` is base 2, as
FlashInfer's. ``__version__`` is the FlashInfer release whose API these follow. Options that pick a CUDA kernel or buffer are taken and change
nothing; options that would change the result and are not implemented here (custom JIT kernels,
NVFP4 caches, float8 queries' per-head scales, multi-item scoring, skip-softmax sparsity) raise
``NotImplementedError`` naming them.
"""

from . import attention, cascade, decode, mla, page, prefill, quantization, rope, single, sparse
from .attention import BatchAttention
from .cascade import MultiLevelCascadeAttentionWrapper, merge_state, merge_state_in_place, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .mla import BatchMLAPagedAttentionWrapper
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from .quantization import packbits, segment_packbits
from .rope import (
    apply_llama31_rope,
    apply_llama31_rope_inplace,
    apply_llama31_rope_pos_ids,
    apply_llama31_rope_pos_ids_inplace,
    apply_rope,
    apply_rope_inplace,
    apply_rope_pos_ids,
    apply_rope_pos_ids_inplace,
    apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from .sparse import BlockSparseAttentionWrapper
from .single import single_decode_with_kv_cache, single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse
from .terms import get_alibi_slopes

#: The FlashInfer release whose API and semantics these follow.
__version__ = "0.6.18"

__all__ = ["BatchAttention", "BatchDecodeWithPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
           "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "BlockSparseAttentionWrapper", "MultiLevelCascadeAttentionWrapper", "append_paged_kv_cache",
           "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
           "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
           "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
           "attention", "cascade", "decode", "get_alibi_slopes", "get_batch_indices_positions", "get_seq_lens",
           "merge_state", "merge_state_in_place", "merge_states", "mla", "packbits", "page", "prefill",
           "quantization", "rope", "segment_packbits", "single", "single_decode_with_kv_cache",
           "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse", "sparse"]  # fmt: skip
