"""Sigmoid attention: an elementwise sigmoid instead of the row softmax, with a bias of −log n.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``r = h/g``
query heads per KV head, ``i`` query length, ``j`` key length, ``d`` query/key size, ``e``
value size; ``it``/``jt`` the sides of a tile.

Ramapuram et al. 2024, "Theory, Analysis, and Best Practices for Sigmoid Self-Attention"
(arXiv 2409.04431), section 3::

    out_r = Σ_c σ(q_r · k_c / √d + b + bias_rc) v_c         over the allowed keys c,   b = −log n

Each weight is its own sigmoid, so the output is a plain sum with no normaliser: tiles of
keys can be summed in any order and the result is exact, with no running maximum or
rescaling. ``b = −log n`` (``n`` the sequence length) starts the total weight of a row near
1, which the paper shows is what makes training stable. A masked weight is 0 (not
σ(0) = ½). ``n`` defaults to the key length of the call; for decoding with a KV cache,
where each step sees fewer keys than the full pass, fix it (``length=`` / ``logit_bias=``)
so every step computes what the full pass does.

The kernel runs tile by tile (``TILE_ELEMENTS`` logits at a time, summed over batch and
heads), skips the tiles a lazy mask reports empty (``qkv.masks``' ``state()``) and builds no
mask on full ones. Its backward recomputes each tile (``σ' = σ(1 − σ)``)::

    dV += Pᵀ dO      dP = dO Vᵀ      dS = dP ∘ P ∘ (1 − P)      dQ += dS K / √d      dK += dSᵀ Q / √d

so training memory is one tile, not ``(h, i, j)``. Half-precision inputs accumulate in
float32. Checked against the formula written element by element in float64, and its
gradients against autograd through the materialised formula, in
the test suite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import checks
from .._args import finite_number
from .._trace import opaque_functions_refused
from ..backends.request import Request
from ..backends.tiling.tiles import NEG_INF, BiasSource, dense_tile, grouped, live_tiles, sum_to
from ..masks import Mask, Tile
from ..positional import LazyBias

#: Elements of one tile of logits, summed over batch and heads (16 MiB per float32 intermediate).
TILE_ELEMENTS = 2**22


@dataclass
class _Plan:
    mask: Mask | None
    lazy: LazyBias | None
    scale: float
    offset: float  # the constant b = −log n
    block_i: int
    block_j: int


def sigmoid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Mask | Tensor | None = None,
    causal: bool = False,
    bias: Tensor | LazyBias | None = None,
    scale: float | None = None,
    logit_bias: float | None = None,
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sigmoid attention; ``q (..., h, i, d)``, ``k (..., g, j, d)``, ``v (..., g, j, e)`` -> ``(..., h, i, e)``.

    Args:
        mask, causal, bias, scale: as in :func:`qkv.attention` (bool True = may attend;
            causal aligned bottom-right; a float or lazy bias added to the logits; default
            scale ``1/√d``).
        logit_bias: the constant ``b`` added to every logit; default ``−log j``.
        return_weights: also return the weights ``σ(·)`` ``(..., h, i, j)`` (0 where masked).
    """
    req = checks.request(q, k, v, score="scaled_dot", mask=mask, bias=bias, causal=causal, scale=scale,
                         dropout=0.0, return_weights=return_weights)  # fmt: skip
    if logit_bias is None:
        offset = -math.log(req.j) if req.j > 0 else 0.0
    elif isinstance(logit_bias, bool) or not isinstance(logit_bias, (int, float)) or not math.isfinite(logit_bias):
        raise ValueError(f"logit_bias: expected a finite float or None (−log of the key length), got {logit_bias!r}")
    else:
        offset = float(logit_bias)
    q, k, v = req.q, req.k, req.v  # (b, h, i, d): the one layout (qkv._layout)
    if q.shape[0] == 0 or req.heads == 0:  # as qkv.attention's empty call: the tiles divide by b·h and group by g
        tie = (q.sum() + k.sum() + v.sum()) * 0  # (in the inputs' graph: their gradients are 0)
        out = req.restore(q.new_zeros((*q.shape[:-1], v.shape[-1])) + tie)
        return (out, req.restore(q.new_zeros((*q.shape[:-1], req.j)) + tie)) if return_weights else out
    lazy = req.bias if isinstance(req.bias, LazyBias) else None
    dense = req.bias if isinstance(req.bias, Tensor) else None
    block_i, block_j = _blocks(req)
    plan = _Plan(req.mask, lazy, req.scale, offset, block_i, block_j)
    params = [] if lazy is None else list(lazy.parameters())
    if opaque_functions_refused():  # jit.trace or torch.func: the same tiles in public ops, differentiated by autograd
        out = req.restore(_public_forward(plan, q, k, v, dense))
    else:
        out = req.restore(SigmoidTiles.apply(plan, q, k, v, dense, *params))
    if not return_weights:
        return out
    return out, req.restore(_weights(plan, q, k, dense))


def _blocks(req: Request) -> tuple[int, int]:
    rows = req.q.shape[0] * req.q.shape[1]  # batch x heads
    budget = max(256, TILE_ELEMENTS // rows)
    block_j = min(max(req.j, 1), 1024, max(16, int(math.sqrt(budget))))
    block_i = min(max(req.i, 1), max(16, budget // block_j))
    return block_i, block_j


def _logits(plan: _Plan, q5: Tensor, k5: Tensor, bias: BiasSource, dense: Tensor | None, t: Tile, state: str):
    """``(..., h, it, jt)`` logits of one tile in float32 (or wider); masked entries ``-inf`` (σ = 0)."""
    acc = torch.promote_types(q5.dtype, torch.float32)  # a half-precision product would round every logit
    s = (q5[..., t.i0 : t.i1, :].to(acc) @ k5[..., t.j0 : t.j1, :].to(acc).transpose(-1, -2)).flatten(-4, -3)
    s = s * plan.scale + plan.offset
    if (b := bias.tile(t)) is not None:
        s = s + b.to(s.dtype)
    if dense is not None:
        s = s + dense_tile(dense, t).to(s.dtype)
    if state == "partial":
        s = s.masked_fill(~plan.mask.tile(t), NEG_INF)
    return s


def _public_forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None) -> Tensor:
    """:class:`SigmoidTiles`' forward in public ops, no in-place write: each block of rows summed over its tiles.

    For ``torch.jit.trace``, which records an autograd function as one opaque op holding this
    call's tensors (PyTorch crashes tracing this one), and ``torch.func``, which refuses one
    without ``setup_context`` and a batched in-place write. Autograd keeps each tile's weights
    for the backward: ``(h, i, j)`` memory, the cost of a traced graph.
    """
    i_len, j_len, g = q.shape[-2], k.shape[-2], k.shape[-3]
    acc = torch.promote_types(v.dtype, torch.float32)
    q5, k5, v5 = grouped(q, k, v)
    bias = BiasSource(plan.lazy, i_len, j_len, q.device)
    sums: dict[int, Tensor] = {}
    for t, state in live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, q.device):
        p = torch.sigmoid(_logits(plan, q5, k5, bias, dense, t, state))
        pv = (p.to(v.dtype).unflatten(-3, (g, -1)) @ v5[..., t.j0 : t.j1, :]).flatten(-4, -3).to(acc)
        sums[t.i0] = pv if t.i0 not in sums else sums[t.i0] + pv
    empty = lambda rows: torch.zeros((*q.shape[:-2], rows, v.shape[-1]), dtype=acc, device=v.device)  # noqa: E731
    blocks = [sums.get(i0, empty(min(plan.block_i, i_len - i0))) for i0 in range(0, i_len, plan.block_i)]
    return torch.cat(blocks, dim=-2).to(v.dtype) if blocks else empty(0).to(v.dtype)


class SigmoidTiles(torch.autograd.Function):
    """``(plan, q, k, v, dense_bias, *lazy_bias_params) -> out``; see the module docstring."""

    @staticmethod
    def forward(ctx, plan: _Plan, q: Tensor, k: Tensor, v: Tensor, dense: Tensor | None, *params: Tensor):
        i_len, j_len = q.shape[-2], k.shape[-2]
        acc = torch.promote_types(v.dtype, torch.float32)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=v.device)
        q5, k5, v5 = grouped(q, k, v)
        bias = BiasSource(plan.lazy, i_len, j_len, q.device)
        g = k.shape[-3]
        with torch.no_grad():
            for t, state in live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, q.device):
                p = torch.sigmoid(_logits(plan, q5, k5, bias, dense, t, state))
                pv = p.to(v.dtype).unflatten(-3, (g, -1)) @ v5[..., t.j0 : t.j1, :]
                out[..., t.i0 : t.i1, :] += pv.flatten(-4, -3)
        ctx.plan, ctx.params = plan, params
        ctx.save_for_backward(q, k, v, dense)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, d_out: Tensor):
        plan: _Plan = ctx.plan
        q, k, v, dense = ctx.saved_tensors
        i_len, j_len, g = q.shape[-2], k.shape[-2], k.shape[-3]
        acc = torch.promote_types(v.dtype, torch.float32)
        d_out5 = d_out.to(acc).unflatten(-3, (g, -1))  # (..., g, r, i, e)
        q5, k5, v5 = grouped(q, k, v)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        d_dense = torch.zeros(dense.shape, dtype=acc, device=dense.device) if ctx.needs_input_grad[4] else None
        trainable = [p for p in ctx.params if p.requires_grad]
        learned = plan.lazy is not None and bool(trainable)
        bias = BiasSource(plan.lazy, i_len, j_len, q.device, grad=learned)
        # shift-invariant biases (T5 buckets) take their gradient through one (h, L) profile
        leaves = [bias.profile] if bias.profile_graph is not None else trainable
        d_leaves = [torch.zeros_like(x) for x in leaves] if learned else []
        for t, state in live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, q.device):
            rows, cols = slice(t.i0, t.i1), slice(t.j0, t.j1)
            with torch.no_grad():
                p = torch.sigmoid(_logits(plan, q5, k5, bias, dense, t, state))
            do = d_out5[..., rows, :]
            p5 = p.unflatten(-3, (g, -1))  # (..., g, r, it, jt)
            dv[..., cols, :] += torch.einsum("...rij,...rie->...je", p5, do)
            dp = do @ v5[..., cols, :].to(acc).transpose(-1, -2)
            ds5 = dp * p5 * (1.0 - p5)  # masked weights are 0, so are their gradients
            dq[..., rows, :] += (ds5 @ k5[..., cols, :].to(acc)).flatten(-4, -3) * plan.scale
            dk[..., cols, :] += torch.einsum("...rij,...rid->...jd", ds5, q5[..., rows, :].to(acc)) * plan.scale
            ds = ds5.flatten(-4, -3)
            if d_dense is not None:
                dense_tile(d_dense, t).add_(sum_to(ds, dense_tile(dense, t).shape))
            if learned:
                with torch.enable_grad():
                    tile_bias = bias.tile(t)
                grads = torch.autograd.grad(tile_bias, leaves, sum_to(ds, tile_bias.shape).to(tile_bias.dtype),
                                            allow_unused=True)  # fmt: skip
                for total, grad in zip(d_leaves, grads):
                    if grad is not None:
                        total += grad
        d_params = d_leaves
        if learned and bias.profile_graph is not None:  # one backward through the bias: profile -> parameters
            d_params = list(torch.autograd.grad(bias.profile_graph, trainable, d_leaves[0].to(bias.profile_graph.dtype),
                                                allow_unused=True))  # fmt: skip
        it = iter(d_params)
        grads_params = [next(it) if p.requires_grad else None for p in ctx.params]
        d_dense = None if d_dense is None else d_dense.to(dense.dtype)
        return None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_dense, *grads_params


@torch.no_grad()
def _weights(plan: _Plan, q: Tensor, k: Tensor, dense: Tensor | None) -> Tensor:
    """The ``(..., h, i, j)`` weights, built tile by tile (only on request)."""
    i_len, j_len = q.shape[-2], k.shape[-2]
    weights = q.new_zeros((*q.shape[:-1], j_len))
    q5, k5, _ = grouped(q, k, k)
    bias = BiasSource(plan.lazy, i_len, j_len, q.device)
    for t, state in live_tiles(plan.mask, plan.block_i, plan.block_j, i_len, j_len, q.device):
        weights[..., t.i0 : t.i1, t.j0 : t.j1] = torch.sigmoid(_logits(plan, q5, k5, bias, dense, t, state)).to(q.dtype)
    return weights


class SigmoidAttention(nn.Module):
    """Sigmoid attention as a ``MultiHeadAttention`` mechanism: ``attention=SigmoidAttention(length=n)``.

    Args:
        length: the sequence length ``n`` of ``b = −log n`` (the paper's choice, fixed per model
            so that cached decoding matches the full pass); default the key length of each call.
        logit_bias: ``b`` itself, instead of ``length``.
        scale: on ``q·k`` (default ``1/√d``).
    """

    accepts_bias = True  # ALiBi / T5 biases are added to the logits before the sigmoid

    def __init__(self, *, length: int | None = None, logit_bias: float | None = None, scale: float | None = None):
        super().__init__()
        if length is not None and logit_bias is not None:
            raise ValueError(f"logit_bias: give length (b = −log length) or logit_bias, not both; got {length}, {logit_bias}")
        if length is not None:
            if isinstance(length, bool) or not isinstance(length, int) or length < 1:
                raise ValueError(f"length: expected a positive int, got {length!r}")
            logit_bias = -math.log(length)
        # (checked here, not at the first forward)
        self.logit_bias = None if logit_bias is None else finite_number("logit_bias", logit_bias)
        self.scale = None if scale is None else finite_number("scale", scale)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Mask | Tensor | None = None, causal: bool = False,
                bias: Tensor | LazyBias | None = None, return_weights: bool = False):  # fmt: skip
        return sigmoid_attention(q, k, v, mask=mask, causal=causal, bias=bias, scale=self.scale,
                                 logit_bias=self.logit_bias, return_weights=return_weights)  # fmt: skip

    def extra_repr(self) -> str:
        shown = "−log j" if self.logit_bias is None else f"{self.logit_bias:.4g}"
        return f"logit_bias={shown}, scale={self.scale}"
