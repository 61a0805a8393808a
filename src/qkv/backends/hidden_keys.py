"""Keys no query sees never reach an output: zero the hidden keys that hold NaN or inf.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` queries, ``j`` keys,
``d`` key size, ``e`` value size.

A key masked for every query row of its batch row and head (padding, a KV cache's unfilled
slots, often made with ``torch.empty``) gets weight 0, but ``0 · NaN = NaN`` in
``weights @ v`` and ``NaN + (-inf) = NaN`` in an additive mask, so on any engine, PyTorch's
SDPA included, one non-finite value there would turn every row of the batch into NaN, and
a non-finite hidden key turns the gradient of the queries into NaN (``dS @ K`` with
``dS = 0`` there). The hidden keys are found once per call: ``Mask.hidden_keys`` (lazy
padding masks know them without a tensor; a dense mask is reduced over its rows) and the
columns a dense float bias sets to ``-inf`` for every row. Then, by what the call is:

* **recording gradients**, **traced** (``torch.compile``, ``torch.export``, meta
  tensors) or **on an accelerator**: :func:`guard`, before any engine. A traced call, or
  one on a GPU (where reading a value on the host would stall the stream), zeroes the
  hidden keys in copies of ``k`` and ``v`` unconditionally (the same result, branch-free);
  an eager CPU one reads the hidden keys alone (one gather and a sum of the
  padding, small beside a differentiated attention) and copies only when one is not finite;
* **inference** (no gradient): :func:`after`, once the engine ran. A non-finite hidden
  value shows in the output (``0 · NaN``; a non-finite hidden key alone leaves the forward
  finite, since every engine masks by selection), so a finite output is the answer, for the
  cost of one sum over it; otherwise the call runs again on zeroed copies. A one-token
  decoding step over a long padded cache thus pays nothing for reading its padding.

Either way a hidden key's gradient is 0 (no output depends on it).

A key hidden from some rows and seen by others (the future under a causal mask) is a real
input of the rows that see it, and a NaN there is theirs; the rows that do not see it may
get it too, through ``0 · NaN`` in ``weights @ v``, on every engine as in PyTorch's SDPA:
such a key is not padding, and its NaN is an error of the model that made it. Masks of
positions (``causal``, ``window``) hide no key from every row of a square call and report
none here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor

from .._trace import concrete
from .request import Request


def hidden_keys(req: Request) -> Tensor | None:
    """Bool ``(b|1, g|1, j, 1)``, True where a key is masked for every query row of its KV head; None if none known."""
    found = None if req.mask is None else req.mask.hidden_keys(req.i, req.j)
    bias = req.bias
    if isinstance(bias, Tensor) and bias.dim() == 4 and bias.shape[-1] == req.j:
        # (b|1, h|1, 1, j): a column is -inf in every row where its largest entry is (a nan is not);
        # one pass over the bias, where isneginf + all took two and a slow bool reduction
        if bias.shape[-2]:
            neg_inf = bias.detach().amax(dim=-2, keepdim=True) == float("-inf")
        else:
            neg_inf = torch.isneginf(bias).all(dim=-2, keepdim=True)
        found = neg_inf if found is None else found | neg_inf
    if found is None:
        return None
    found = found.to(req.k.device)  # a mask may live elsewhere (copied per tile by the engines)
    if found.shape[1] not in (1, req.kv_heads):  # (b, h, ...) query heads -> hidden from each head of a group
        found = found.unflatten(1, (req.kv_heads, -1)).all(dim=2)
    return found.transpose(-1, -2)


def zeroed(req: Request, hidden: Tensor) -> Request:
    """``req`` with copies of ``k`` and ``v`` whose hidden keys are 0."""
    return replace(req, k=req.k.masked_fill(hidden, 0), v=req.v.masked_fill(hidden, 0))


def guard(req: Request) -> Request:
    """Before the engine: ``req``, or :func:`zeroed` when a hidden key or value is not finite (or values cannot be read)."""
    hidden = hidden_keys(req)
    if hidden is None:
        return req
    k, v = req.k, req.v
    if concrete(k, v, hidden) and k.device.type == "cpu":
        at = hidden.expand(k.shape[0], -1, -1, -1)[..., 0]  # (b, g|1, j)
        if at.shape[1] == 1:  # the same keys hidden in every head (padding): index (b, j) only
            rows = at[:, 0].nonzero(as_tuple=True)
            k_at, v_at = k.transpose(1, 2)[rows], v.transpose(1, 2)[rows]  # (n, g, d): the hidden keys alone
        else:
            rows = at.nonzero(as_tuple=True)
            k_at, v_at = k[rows], v[rows]
        if rows[0].numel() == 0:
            return req
        # A sum is NaN or inf when one term is (or when it overflows: zeroing is then harmless);
        # one pass over the padding, no bool tensor, one read on the host.
        if math.isfinite(float(k_at.detach().sum() + v_at.detach().sum())):  # (Tensor.isfinite costs ~40 µs on a 0-d tensor)
            return req
    return zeroed(req, hidden)


def needs_guard_first(req: Request) -> bool:
    """True when :func:`guard` must run before the engine (gradients recorded, or values unreadable)."""
    if not concrete(req.k, req.v) or req.k.device.type != "cpu":
        return True  # traced, or an accelerator, where reading a value on the host is a sync
    return req.differentiated


def after(req: Request, run: Callable[[Request], tuple], result: tuple) -> tuple:
    """After an inference call: ``result`` when its output is finite, else ``run`` again on :func:`zeroed` inputs."""
    if req.mask is None and not isinstance(req.bias, Tensor):  # nothing can hide a key
        return result
    if math.isfinite(float(result[0].detach().sum())):
        return result
    hidden = hidden_keys(req)
    return result if hidden is None else run(zeroed(req, hidden))
