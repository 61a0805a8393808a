"""FlashInfer's ``BlockSparseAttentionWrapper``: attention under a block-sparse (BSR) mask, as its paged prefill.

Shape legend: ``M`` queries, ``N`` keys, ``R`` × ``C`` blocks, ``MB = ⌈M / R⌉`` block rows, ``NB =
N / C`` block columns, ``nnz`` stored blocks, ``h`` query heads, ``g`` KV heads, ``d`` head size.

The mask is SciPy's ``bsr_matrix`` layout: block row ``i`` keeps the key blocks
``indices[indptr[i] : indptr[i + 1]]``, each ``C`` keys, and ``mask (nnz, R, C)`` (optional) says
which entries of a kept block are seen. FlashInfer runs this as its paged prefill, and so does
this: block row ``i`` is a request of ``R`` queries (the last one ``M - (MB - 1) R``), the keys
``k (N, g, d)`` are ``NB`` pages of ``C`` rows read where they lie, and its pages are the block row's
indices. So ``causal``, ``"ROPE_LLAMA"`` and ``"ALIBI"`` see a key at its place among the block
row's kept keys, not at its column, as FlashInfer's kernels do. ``o_data_type`` defaults to float16,
FlashInfer's default, whatever ``q``'s dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .plans import Wrapper, dtype_of, refuse


def convert_bsr_mask_layout(mask: Tensor, indptr: Tensor) -> Tensor:
    """``mask (nnz, R, C)`` in FlashInfer's flattened layout ``(nnz · R · C,)``: block row by block row, each query's
    entries across the row's blocks in order."""
    nnz, R, C = mask.shape
    bounds = indptr.tolist()
    flat = torch.empty(nnz * R * C, dtype=mask.dtype, device=mask.device)
    for a, b in zip(bounds, bounds[1:]):
        flat[a * R * C : b * R * C] = mask[a:b].transpose(0, 1).reshape(-1)
    return flat


class BlockSparseAttentionWrapper(Wrapper):
    """Attention of ``q (M, h, d)`` over ``k, v (N, g, d)`` under a BSR block mask, FlashInfer's wrapper."""

    def __init__(self, float_workspace_buffer: Tensor | None = None, backend: str = "auto"):
        if str(backend).startswith("vsa"):
            raise NotImplementedError(f"backend: {backend!r} (a per-head block_mask kernel) is not supported; 'auto' is")
        super().__init__("NHD", False)

    def plan(self, indptr: Tensor, indices: Tensor, M: int, N: int, R: int, C: int, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, mask: Tensor | None = None, packed_mask: Tensor | None = None,
             causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, q_data_type="float16",
             kv_data_type=None, o_data_type="float16", non_blocking: bool = True, block_mask=None) -> None:  # fmt: skip
        """Plan the mask: block rows as requests of ``R`` queries over their key blocks as pages of ``C`` keys."""
        refuse(block_mask=block_mask)
        if indptr is None or indices is None:
            raise ValueError("indptr and indices are required for non-VSA backends.")
        if not all(isinstance(n, int) and n > 0 for n in (M, N, R, C)) or N % C:
            raise ValueError(f"M, N, R, C: expected positive ints with C dividing N, got {M}, {N}, {R}, {C}")
        rows = indptr.shape[0] - 1
        if rows != -(-M // R):
            raise ValueError(f"indptr: expected ⌈M / R⌉ + 1 = {-(-M // R) + 1} entries, got {rows + 1}")
        qo = [min(i * R, M) for i in range(rows + 1)]
        if indices.numel() and int(indices.max()) * C > N:
            raise ValueError("indices out of bound")
        if mask is not None and packed_mask is None:
            # the last block row holds M - (MB - 1) R queries: its first rows' entries, as FlashInfer's packing reads them
            blocks = indptr.tolist()
            mask = convert_bsr_mask_layout(mask, indptr)[: blocks[-1] * R * C - (rows * R - M) * (blocks[-1] - blocks[-2]) * C]
        self._planned.plan(torch.tensor(qo), indptr, indices, torch.full((rows,), C, dtype=torch.int64),
                           heads=(num_qo_heads, num_kv_heads), dims=(head_dim, head_dim), page_size=C,
                           dtypes=(dtype_of(q_data_type), dtype_of(kv_data_type or q_data_type), dtype_of(o_data_type)),
                           custom_mask=mask if packed_mask is None else None, packed_custom_mask=packed_mask,
                           causal=causal, pos_encoding_mode=pos_encoding_mode, logits_soft_cap=logits_soft_cap,
                           sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)  # fmt: skip
        self._N, self._C = N, C

    def run(self, q: Tensor, k: Tensor, v: Tensor, scale_q=None, scale_k=None, scale_v=None, out=None, lse=None,
            return_lse: bool = False, enable_pdl=None):  # fmt: skip
        """``out (M, h, d)`` in ``o_data_type``, or ``(out, lse (M, h))`` (base 2) with ``return_lse``."""
        refuse(scale_q=scale_q, scale_k=scale_k, scale_v=scale_v)
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != self._N:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"{name}: expected (N = {self._N}, num_kv_heads, head_dim) as planned, got {got}")
        pages = (k.reshape(-1, self._C, *k.shape[1:]), v.reshape(-1, self._C, *v.shape[1:]))  # (views when contiguous)
        return self._planned.run(q, pages, out=out, lse=lse, return_lse=return_lse)
