"""The decoding step the dialect suites time over pages, and the two calls a CPU user writes for it instead.

Shape legend: ``n`` requests, ``h = 8`` query heads, ``g = 2`` KV heads, ``d = 64``, ``P = 16``
page size; ``L`` the longest request's keys.

``n`` requests of random lengths up to ``longest`` keys (seeded: every suite that builds it times
the same step), one query each, their keys in pools ``(pages, P, g, d)`` (FlashInfer's ``NHD``
layout), each request's pages one after another or every page in a random order. What one writes
without a page table: a Python loop of ``F.scaled_dot_product_attention`` over each request's
contiguous keys (:meth:`Step.loop`), or one call over the batch padded to the longest request with
a bool key mask (:meth:`Step.padded`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

H, G, D, P = 8, 2, 64, 16


@dataclass
class Step:
    lens: list[int]  # each request's keys
    k_pool: Tensor  # (pages, P, g, d)
    v_pool: Tensor
    page_ids: list[Tensor]  # each request's pages, in order of its keys
    q: Tensor  # (n, h, d)
    own: list[tuple[Tensor, Tensor]]  # each request's keys and values, contiguous (1, g, len, d)
    padded_k: Tensor  # (n, g, L, d), zeros past each request
    padded_v: Tensor
    keep: Tensor  # (n, 1, 1, L) bool

    def loop(self) -> Tensor:
        """``(n, h, d)``: one SDPA call a request over its own keys."""
        return torch.cat([F.scaled_dot_product_attention(self.q[r, None, :, None], k, v, enable_gqa=True)[:, :, 0]
                          for r, (k, v) in enumerate(self.own)])  # fmt: skip

    def padded(self) -> Tensor:
        """``(n, h, d)``: one SDPA call over the padded batch, its key mask built once (as a cache keeps it)."""
        return F.scaled_dot_product_attention(self.q[:, :, None], self.padded_k, self.padded_v, attn_mask=self.keep,
                                              enable_gqa=True)[:, :, 0]  # fmt: skip

    def block_table(self) -> Tensor:
        """``(n, max pages)`` int32: each request's page ids, zeros past them (flash-attn's and PyTorch's table)."""
        table = torch.zeros(len(self.lens), max(len(ids) for ids in self.page_ids), dtype=torch.int32)
        for r, ids in enumerate(self.page_ids):
            table[r, : len(ids)] = ids
        return table


def decoding_step(requests: int, longest: int, shuffled: bool) -> Step:
    """The step of ``requests`` requests of 64 (or fewer, for a small ``longest``) to ``longest`` keys."""
    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    lens = [rnd.randint(min(64, longest), longest) for _ in range(requests)]
    counts = [-(-length // P) for length in lens]
    total = sum(counts)
    k_pool, v_pool = torch.randn(total, P, G, D, generator=gen), torch.randn(total, P, G, D, generator=gen)
    order = torch.randperm(total, generator=gen) if shuffled else torch.arange(total)
    page_ids = list(order.int().split(counts))
    q = torch.randn(requests, H, D, generator=gen)
    own = [(k_pool[ids.long()].reshape(1, -1, G, D)[:, :length].transpose(1, 2).contiguous(),
            v_pool[ids.long()].reshape(1, -1, G, D)[:, :length].transpose(1, 2).contiguous())
           for ids, length in zip(page_ids, lens)]  # fmt: skip
    L = max(lens)
    padded_k, padded_v = torch.zeros(requests, G, L, D), torch.zeros(requests, G, L, D)
    for r, (k, v) in enumerate(own):
        padded_k[r, :, : lens[r]], padded_v[r, :, : lens[r]] = k[0], v[0]
    keep = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
    return Step(lens, k_pool, v_pool, page_ids, q, own, padded_k, padded_v, keep)
