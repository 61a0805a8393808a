"""flash-attn's batched and packed calls, each with its signature and the varlen call's semantics.

Shape legend: ``b`` batch, ``sq``/``sk`` query and key lengths, ``t`` packed tokens, ``h``
query heads, ``g`` KV heads, ``d`` query/key size, ``e`` value size.

``flash_attn_func(q (b, sq, h, d), k (b, sk, g, d), v (b, sk, g, e))`` is the varlen call
(``qkv.varlen_attention``) of ``b`` sequences of ``sq`` queries and ``sk`` keys each, with the
same per-sequence semantics: bottom-right ``causal`` and ``window_size``, ``softcap`` before
ALiBi ``(h,)`` or ``(b, h)``, rows that see no key 0. Every sequence then gets the same mask,
bias and modifier, so the batch runs as one ``qkv.attention`` call over ``(b, h, s, d)`` views
(as fast as SDPA over the same views, where one call a sequence took 1.5x at 64 sequences of
64); per-sequence slopes ``(b, h)`` run as the varlen call, the batch's rows end to end. It
returns ``out (b, sq, h, e)``, contiguous as flash-attn's, and with ``return_attn_probs``
``(out, softmax_lse (b, h, sq), None)``: flash-attn fills its third result, the
probabilities, only for testing with dropout; qkv never builds it.

The packed forms split their one tensor into views, so the gradient reaches it in place:

* ``flash_attn_qkvpacked_func(qkv (b, s, 3, h, d))``: ``q, k, v = qkv.unbind(2)``;
* ``flash_attn_kvpacked_func(q, kv (b, sk, 2, g, d))``: ``k, v = kv.unbind(2)``;
* ``flash_attn_varlen_qkvpacked_func(qkv (t, 3, h, d), cu_seqlens, max_seqlen)`` and
  ``flash_attn_varlen_kvpacked_func(q, kv (t, 2, g, d), cu_seqlens_q, cu_seqlens_k, ...)``.

Checked against a per-sequence float64 reference and against ``varlen_attention`` in the test
suite.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional import attention
from ..flash_args import scalars, window
from ..masks.positions import window_mask
from ..varlen import _logit_terms, _slopes, varlen_attention


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                    return_attn_probs: bool = False):  # fmt: skip
    """``out (b, sq, h, e)``, or ``(out, softmax_lse (b, h, sq), None)`` with ``return_attn_probs``: flash-attn's call."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name}: expected (batch, seqlen, heads, size), got {got}")
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    if k.shape[0] != b or v.shape[0] != b or v.shape[1] != sk:
        raise ValueError(f"k, v: expected (batch {b}, seqlen_k, heads, size) alike, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} for q {tuple(q.shape)}")  # fmt: skip
    if alibi_slopes is None or (isinstance(alibi_slopes, Tensor) and alibi_slopes.dim() == 1):
        return _one_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                         return_attn_probs)  # fmt: skip
    cu_q, cu_k = (torch.arange(0, (b + 1) * s, s, dtype=torch.int32) if s else torch.zeros(b + 1, dtype=torch.int32)
                  for s in (sq, sk))  # fmt: skip
    result = varlen_attention(
        q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k,
        sq, sk, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip
    if not return_attn_probs:
        return result.reshape(b, sq, *result.shape[1:])
    out, lse, probs = result
    return out.reshape(b, sq, *out.shape[1:]), lse.view(lse.shape[0], b, sq).transpose(0, 1).contiguous(), probs


def _one_call(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
              return_attn_probs):  # fmt: skip
    """The batch as one ``qkv.attention`` call where every sequence's terms are the same (no per-sequence slopes):
    the mask, bias and modifier the varlen call gives each sequence, given once."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    left, right = window(window_size, causal)
    _, return_attn_probs, softcap, softmax_scale, dropout_p = scalars(
        deterministic, return_attn_probs, softcap, softmax_scale, dropout_p)  # fmt: skip
    slopes = _slopes(alibi_slopes, h, b, q.device)
    bias, mod = _logit_terms(None if slopes is None else slopes[0], softcap, None, 0, sk - sq)
    result = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask=window_mask(left, right, sq, sk),
                       bias=bias, score_mod=mod, scale=softmax_scale, dropout=dropout_p,
                       return_lse=return_attn_probs)  # fmt: skip
    out, lse = result if return_attn_probs else (result, None)
    out = out.transpose(1, 2).contiguous()  # (b, sq, h, e), flash-attn's layout
    return (out, lse, None) if return_attn_probs else out


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                             causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False):  # fmt: skip
    """:func:`flash_attn_func` with ``kv (b, sk, 2, g, d)``: keys at ``kv[:, :, 0]``, values at ``kv[:, :, 1]``."""
    k, v = _unpacked("kv", kv, 2, 5, "(batch, seqlen_k, 2, heads_k, size)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)  # fmt: skip


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False):  # fmt: skip
    """:func:`flash_attn_func` with ``qkv (b, s, 3, h, d)``: queries, keys and values along dim 2."""
    q, k, v = _unpacked("qkv", qkv, 3, 5, "(batch, seqlen, 3, heads, size)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int | None, max_seqlen_k: int | None, dropout_p: float = 0.0,
                                    softmax_scale: float | None = None, causal: bool = False,
                                    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False):  # fmt: skip
    """``varlen_attention`` with ``kv (total_k, 2, g, d)``: keys at ``kv[:, 0]``, values at ``kv[:, 1]``."""
    k, v = _unpacked("kv", kv, 2, 4, "(total_k, 2, heads_k, size)")
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int | None, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False,
                                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False):  # fmt: skip
    """``varlen_attention`` of ``qkv (total, 3, h, d)``, one set of offsets for queries and keys."""
    q, k, v = _unpacked("qkv", qkv, 3, 4, "(total, 3, heads, size)")
    return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                            window_size, softcap, alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def _unpacked(name: str, x: object, parts: int, rank: int, shape: str) -> tuple[Tensor, ...]:
    """``x``'s ``parts`` tensors along its packing dim (``rank - 3``), as views."""
    if not isinstance(x, Tensor) or x.dim() != rank or x.shape[rank - 3] != parts:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name}: expected {shape}, got {got}")
    return x.unbind(rank - 3)
