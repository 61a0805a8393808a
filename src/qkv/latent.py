"""Multi-head latent attention (MLA): keys and values through a shared low-rank latent,
a decoupled rotary part, and a cache of the latent only.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length (cached + new),
``d`` per-head "content" query/key size ``d_h``, ``r`` the rotary size ``d_R``, ``e``
per-head value size, ``c`` the KV latent size ``d_c``, ``dim`` model size.

DeepSeek-AI 2024, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
Language Model" (arXiv 2405.04434), section 2.1, equations 9-19, for the hidden state
``h_t`` of token ``t``::

    c^KV_t = W^DKV h_t                     (c)       the only per-token state that is cached,
    k^R_t  = RoPE(W^KR h_t)                (r)       with the rotary key shared by the heads
    k^C_t  = W^UK c^KV_t,  v^C_t = W^UV c^KV_t       (h·d), (h·e)
    c^Q_t  = W^DQ h_t                      (c')      query compression (optional: q = W^Q h_t)
    q^C_t  = W^UQ c^Q_t,   q^R_t = RoPE(W^QR c^Q_t)  (h·d), (h·r)
    q_t,n  = [q^C_t,n; q^R_t,n],   k_j,n = [k^C_j,n; k^R_j]           per head n: d + r
    o_t,n  = Σ_j softmax_j(q_t,n · k_j,n / √(d + r)) v^C_j,n
    u_t    = W^O [o_t,1; ...; o_t,h]

RoPE cannot act on ``k^C`` (a rotation between ``W^UK`` and the query would stop ``W^UK``
from being absorbed), hence the separate rotary part. **Absorbed decoding** (section 2.1.3):
``q^C_n · W^UK_n c = (W^UK_nᵀ q^C_n) · c``, and ``Σ_j α_j W^UV_n c_j = W^UV_n Σ_j α_j c_j``, so a
decoding step attends with the query ``[W^UK_nᵀ q^C_n; q^R_n]`` (size ``c + r``) over the
cached ``[c^KV_j; k^R_j]`` directly, as multi-query attention with one KV "head" whose values
are ``c^KV``, then applies ``W^UV_n`` to each head's ``c``-sized output: K and V are never
formed. The cache holds ``c + r`` numbers per token per layer against ``2·h·d`` for
multi-head attention (DeepSeek-V2: ``c = 4d``, ``r = d/2``, 4.5·d against 2·h·d).

DeepSeek's released models also normalise the two latents (RMSNorm on ``c^Q`` and
``c^KV``, ``latent_norm=True``); the paper's equations do not. Checked against the
equations above written out in float64 (RoPE as complex multiplication), absorbed against
naive, and cached decoding against the full pass, in the test suite.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import Tensor, nn

from ._args import positive_int as _positive
from ._args import probability
from .cache import KVCache, LatentCache
from .functional import attention
from .masks import Mask
from .positional import Rotary
from .positional.rope_scaling import softmax_factor
from .projection import Linear


class MultiHeadLatentAttention(nn.Module):
    """MLA self-attention, a drop-in for ``MultiHeadAttention`` on ``(b, i, dim)``; see the module docstring.

    Args:
        dim: model size.
        heads: heads ``h``.
        dim_head: per-head content query/key size ``d`` (default ``dim // heads``).
        rope_dim: per-head rotary size ``r`` (default ``d / 2``, as DeepSeek-V2), even.
        dim_value_head: per-head value size ``e`` (default ``d``).
        kv_rank: the KV latent size ``c`` (default ``4·d``, as DeepSeek-V2).
        query_rank: the query latent size ``c'``; None projects queries directly from ``h_t``.
        latent_norm: RMSNorm (ε = 1e-6) on the latents, as DeepSeek's released models.
        rotary: the rotary embedding of the ``r`` rotary dims (default ``Rotary(rope_dim)``).
        dropout: on the attention weights, in training mode.
        backend: passed to ``qkv.attention``.
    """

    def __init__(self, dim: int, heads: int, *, dim_head: int | None = None, rope_dim: int | None = None,
                 dim_value_head: int | None = None, kv_rank: int | None = None, query_rank: int | None = None,
                 latent_norm: bool = False, rotary: Rotary | None = None, dropout: float = 0.0,
                 backend: str = "auto"):  # fmt: skip
        super().__init__()
        _positive("dim", dim)
        _positive("heads", heads)
        if dim_head is None:
            if dim % heads:
                raise ValueError(f"dim: expected a multiple of heads={heads} when dim_head is not given, got dim={dim}")
            dim_head = dim // heads
        d = _positive("dim_head", dim_head)
        r = max(2, d // 2 - d // 2 % 2) if rope_dim is None else _positive("rope_dim", rope_dim)
        if r % 2:
            raise ValueError(f"rope_dim: expected an even size (rotated in pairs), got {r}")
        e = d if dim_value_head is None else _positive("dim_value_head", dim_value_head)
        c = 4 * d if kv_rank is None else _positive("kv_rank", kv_rank)
        if query_rank is not None:
            _positive("query_rank", query_rank)
        if rotary is None:
            rotary = Rotary(r)
        elif not isinstance(rotary, Rotary) or rotary.dim_head != r:
            raise ValueError(f"rotary: expected a qkv.Rotary of dim_head rope_dim={r}, got {rotary!r}")
        self.dim, self.heads, self.dim_head, self.rope_dim, self.dim_value_head = dim, heads, d, r, e
        self.kv_rank, self.query_rank = c, query_rank
        self.dropout, self.backend = probability("dropout", dropout), backend
        q_in = dim if query_rank is None else query_rank
        # the paper's matrices, named after it; no biases (the equations have none)
        self.q_down = None if query_rank is None else Linear(dim, query_rank, bias=False)  # W^DQ
        self.q_norm = nn.RMSNorm(query_rank, eps=1e-6) if latent_norm and query_rank is not None else None
        self.q_up = Linear(q_in, heads * d, bias=False)  # W^UQ (W^Q without compression)
        self.q_rope = Linear(q_in, heads * r, bias=False)  # W^QR
        self.kv_down = Linear(dim, c, bias=False)  # W^DKV
        self.kv_norm = nn.RMSNorm(c, eps=1e-6) if latent_norm else None
        self.k_up = Linear(c, heads * d, bias=False)  # W^UK
        self.v_up = Linear(c, heads * e, bias=False)  # W^UV
        self.k_rope = Linear(dim, r, bias=False)  # W^KR
        self.out_proj = Linear(heads * e, dim, bias=False)  # W^O
        self.rotary = rotary

    @property
    def scale(self) -> float:
        """``1 / √(d + r)``: the logits are those of the ``d + r``-sized heads, absorbed or not; under a YaRN rotary
        with ``mscale_all_dim`` (DeepSeek-V2/V3's configs), times ``(0.1 · mscale_all_dim · ln s + 1)²`` for its factor
        ``s > 1``, as DeepSeek's MLA (and transformers' ``yarn_apply_mscale``) scales the softmax."""
        return softmax_factor(self.rotary.scaling) / math.sqrt(self.dim_head + self.rope_dim)

    def latent(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The per-token state of ``x (b, j, dim)``: ``c^KV (b, 1, j, c)`` and the unrotated ``W^KR x (b, 1, j, r)``."""
        c_kv = self.kv_down(x)
        if self.kv_norm is not None:
            c_kv = self.kv_norm(c_kv)
        return c_kv[:, None], self.k_rope(x)[:, None]

    def queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q^C (b, h, i, d)`` and the unrotated ``q^R (b, h, i, r)`` of ``x (b, i, dim)``."""
        c_q = x if self.q_down is None else self.q_down(x)
        if self.q_norm is not None:
            c_q = self.q_norm(c_q)
        q_c = rearrange(self.q_up(c_q), "b i (h d) -> b h i d", h=self.heads)
        q_r = rearrange(self.q_rope(c_q), "b i (h r) -> b h i r", h=self.heads)
        return q_c, q_r

    def forward(self, x: Tensor, *, mask: Mask | Tensor | None = None, causal: bool = False,
                cache: KVCache | None = None, return_weights: bool = False,
                absorb: bool | None = None) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
        """``x (b, i, dim)`` -> ``(b, i, dim)``, and weights ``(b, h, i, j)`` with ``return_weights=True``.

        ``cache``: a :class:`qkv.cache.LatentCache` (or any ``KVCache``) that receives this
        call's latents; the queries attend to all of them. ``absorb``: attend over the latent
        with ``W^UK`` and ``W^UV`` folded into the query and the output (True), or form K and
        V (False); default absorbed for cached steps of one token, where it saves expanding
        the whole cache, and naive otherwise. Both compute the same function.
        """
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape (b, length, {self.dim}) (batch first), got {got}")
        if cache is not None and hasattr(cache, "attend"):  # a serving step over pages (qkv.paged.serve)
            if return_weights:
                raise ValueError("return_weights: a paged serving step does not build weights")
            return self._paged(x, cache)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache: expected a qkv.cache.LatentCache (or KVCache), got {type(cache).__name__}")
        q_c, q_r = self.queries(x)
        c_kv, k_r = self.latent(x)
        late = cache is not None and getattr(cache, "positions_in_cache", False)
        if not late:
            q_r, k_r = self.rotary.rotate(q_r, k_r, 0 if cache is None else cache.length)
        combined = None
        if cache is not None:
            c_kv, k_r = cache.update(c_kv, k_r)
            if late:  # a streaming cache: every key at its position in the cache
                q_r, k_r = self.rotary.rotate(q_r, k_r, 0)
            elif isinstance(cache, LatentCache):
                combined = cache.combined  # [c_KV; k^R] as stored: the absorbed key, no copy
        if absorb is None:
            absorb = cache is not None and x.shape[1] == 1
        common = dict(mask=mask, causal=causal, scale=self.scale, return_weights=return_weights,
                      dropout=self.dropout if self.training else 0.0, backend=self.backend)  # fmt: skip
        if absorb:
            result = self._absorbed(q_c, q_r, c_kv, k_r, combined, common)
        else:
            result = self._naive(q_c, q_r, c_kv, k_r, common)
        out, weights = result if return_weights else (result, None)
        y = self.out_proj(rearrange(out, "b h i e -> b i (h e)"))
        return (y, weights) if return_weights else y

    def _naive(self, q_c: Tensor, q_r: Tensor, c_kv: Tensor, k_r: Tensor, common: dict):
        """Form ``k = [W^UK c; k^R]`` and ``v = W^UV c`` for every key, then attend (training, prefill)."""
        h = self.heads
        k_c = rearrange(self.k_up(c_kv[:, 0]), "b j (h d) -> b h j d", h=h)
        v = rearrange(self.v_up(c_kv[:, 0]), "b j (h e) -> b h j e", h=h)
        k = torch.cat((k_c, k_r.expand(-1, h, -1, -1)), dim=-1)
        return attention(torch.cat((q_c, q_r), dim=-1), k, v, **common)

    def _absorbed(self, q_c: Tensor, q_r: Tensor, c_kv: Tensor, k_r: Tensor, combined: Tensor | None,
                  common: dict):  # fmt: skip
        """Attend over the latent: query ``[W^UKᵀ q^C; q^R]``, keys ``[c; k^R]``, values ``c``; then ``W^UV``."""
        q = self._absorbed_query(q_c, q_r)  # (b, h, i, c + r)
        keys = torch.cat((c_kv, k_r), dim=-1) if combined is None else combined  # (b, 1, j, c + r)
        # One query per head over one shared KV head: with nothing masked, the h heads are h
        # query rows of a single head (no key is repeated per head; PyTorch's grouped-query
        # path on CPU ran 20x slower here). A single query sees every key, so causal is moot.
        fold = q.shape[-2] == 1 and common["mask"] is None
        if fold:
            q = rearrange(q, "b h 1 c -> b 1 h c")
            common = {**common, "causal": False}
        result = attention(q, keys, c_kv, **common)  # multi-query: one KV head, values c^KV
        out, weights = result if common["return_weights"] else (result, None)
        if fold:
            out = rearrange(out, "b 1 h c -> b h 1 c")
            weights = None if weights is None else rearrange(weights, "b 1 h j -> b h 1 j")
        out = self._values(out)
        return (out, weights) if common["return_weights"] else out

    def _absorbed_query(self, q_c: Tensor, q_r: Tensor) -> Tensor:
        """``[W^UKᵀ q^C; q^R] (b, h, i, c + r)``: the query that attends to the latents themselves."""
        w_uk = rearrange(self.k_up.weight, "(h d) c -> h d c", h=self.heads)
        return torch.cat((torch.einsum("bhid,hdc->bhic", q_c, w_uk), q_r), dim=-1)

    def _values(self, out: Tensor) -> Tensor:
        """``W^UV`` per head on an attention over the latents: ``(b, h, i, c) -> (b, h, i, e)``."""
        w_uv = rearrange(self.v_up.weight, "(h e) c -> h e c", h=self.heads)
        return torch.einsum("bhic,hec->bhie", out, w_uv)

    def _paged(self, x: Tensor, layer) -> Tensor:
        """``x (1, T, dim)``: a packed step of many requests; ``layer`` writes each token's latent to its pages and
        attends (absorbed: the pages hold ``[c^KV; k^R]``, ``qkv.PagedKVCache(..., latent_dim=c)``)."""
        q_c, q_r = self.queries(x)
        c_kv, k_r = self.latent(x)
        q_r, k_r = self.rotary.rotate(q_r, k_r, positions=(layer.positions, layer.positions))
        latent = torch.cat((c_kv, k_r), dim=-1)  # (1, 1, T, c + r): the key, and the value to slice
        q = self._absorbed_query(q_c, q_r)
        out = layer.attend(q, latent, latent, sm_scale=self.scale)[..., : self.kv_rank]  # (1, h, T, c)
        return self.out_proj(rearrange(self._values(out), "b h i e -> b i (h e)"))

    def new_cache(self, max_len: int | None = None) -> LatentCache:
        """An empty :class:`qkv.cache.LatentCache` (``max_len`` preallocates)."""
        return LatentCache(max_len)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, heads={self.heads}, dim_head={self.dim_head}, rope_dim={self.rope_dim}, "
            f"dim_value_head={self.dim_value_head}, kv_rank={self.kv_rank}, query_rank={self.query_rank}"
        )
