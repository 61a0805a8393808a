"""What a paged call computes besides ``q·k``: scale, soft-cap, ALiBi, window, score_mod.

Shape legend: ``h`` query heads, ``g`` KV heads, ``x = h / g`` query heads per KV head.

The logit of a query at position ``qp`` and a key at position ``kp`` of the same request is,
in this order (qkv's ``score_mod`` last)::

    s = sm_scale · k_scale · q·k                  k_scale: a float8 cache's key scale (FlashInfer's), default 1
    s = cap · tanh(s / cap)                      logits_soft_cap = cap > 0 (Gemma 2)
    s = s + slope_h · (kp - qp)                  alibi_slopes (Press et al. 2022): 0 at the query, < 0 before
    s = score_mod(s, r, h, qp, kp)               qkv's score_mod: request r, positions in its sequence

and the key is seen when ``kp <= qp`` (``causal``) and ``kp >= qp - window_left``
(``window_left >= 0``). Each option alone is FlashInfer's, but for two choices. With both a
soft cap and ALiBi, FlashInfer's kernels (``variants.cuh``) cap ``(sm_scale · q·k + alibi) ·
sm_scale / cap``; qkv adds the ALiBi term to the capped logit, as a model that caps its
attention logits and then biases them computes. FlashInfer's ALiBi distance is
``kv_idx - q_idx`` with ``q_idx`` the query's index in its chunk (0 in decode), a constant per
row away from ``kp - qp``: the same weights, but its ``lse`` exceeds qkv's by
``slope · (kv_len - qo_len)``; qkv's, at true positions, merges across chunks.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class Options:
    scale: float
    causal: bool
    window_left: int  # -1: no window
    soft_cap: float  # 0: none
    alibi_slopes: Tensor | None  # (h,) float
    score_mod: Callable | None

    def logits(self, s: Tensor, qpos: Tensor, kpos: Tensor) -> Tensor:
        """Scaled, capped and ALiBi-biased logits ``s (..., g, x, keys)`` for ``qpos - kpos`` broadcast to it.

        ``qpos`` and ``kpos`` broadcast against ``s`` without its head dims: ``(..., 1, 1, keys)``.
        """
        s = s * self.scale
        if self.soft_cap > 0:
            s = self.soft_cap * torch.tanh(s / self.soft_cap)
        if self.alibi_slopes is not None:
            g, x = s.shape[-3], s.shape[-2]
            slopes = self.alibi_slopes.to(s.dtype).view(g, x, 1)
            s = s + slopes * (kpos - qpos).to(s.dtype)
        return s

    def seen(self, qpos: Tensor, kpos: Tensor) -> Tensor | None:
        """Bool: which keys a query sees by position (None: all)."""
        allowed = None
        if self.causal:
            allowed = kpos <= qpos
        if self.window_left >= 0:
            inside = kpos >= qpos - self.window_left
            allowed = inside if allowed is None else allowed & inside
        return allowed


def options(q: Tensor, *, causal, window_left, logits_soft_cap, sm_scale, alibi_slopes, score_mod,
            k_scale=None) -> Options:  # fmt: skip
    """Checked options for ``q (T, h, d)``; ``k_scale`` joins the scale, as FlashInfer folds it into ``sm_scale``."""
    k_scale = calibration("k_scale", k_scale)
    h, d = q.shape[1], q.shape[2]
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral) or window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or a number of keys >= 0, got {window_left!r}")
    window_left = int(window_left)  # (numpy's integers too, as FlashInfer takes any int)
    for name, x in (("logits_soft_cap", logits_soft_cap), ("sm_scale", sm_scale)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Real)):
            raise TypeError(f"{name}: expected a number, got {type(x).__name__}")
    cap = float(logits_soft_cap or 0.0)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"logits_soft_cap: expected 0 (none) or a positive number, got {logits_soft_cap!r}")
    if sm_scale is not None and not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite number or None, got {sm_scale!r}")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if k_scale is not None:
        scale *= k_scale
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor) or tuple(alibi_slopes.shape) != (h,):
            got = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, Tensor) else type(alibi_slopes).__name__
            raise ValueError(f"alibi_slopes: expected a tensor of shape ({h},), one slope per query head, got {got}")
        if not alibi_slopes.dtype.is_floating_point:
            raise TypeError(f"alibi_slopes: expected a floating-point tensor, got {alibi_slopes.dtype}")
        # FlashInfer's and flash-attn's slopes are float32: slope · distance in float32 cost a float64 call's
        # logits 2e-8, so the slopes take the logits' precision (float32 at least)
        alibi_slopes = alibi_slopes.to(torch.promote_types(alibi_slopes.dtype, torch.promote_types(q.dtype, torch.float32)))
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod: expected a callable score_mod(score, b, h, q_idx, kv_idx), got {type(score_mod).__name__}")
    return Options(scale, bool(causal), window_left, cap, alibi_slopes, score_mod)


def calibration(name: str, x) -> float | None:
    """A float8 cache's calibration scale (FlashInfer's ``k_scale``/``v_scale``) as a float: a number or a
    one-element tensor (FlashInfer's prefill takes either), finite."""
    if x is None:
        return None
    if isinstance(x, Tensor):
        if x.numel() != 1 or not (x.dtype.is_floating_point or x.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"{name}: expected a number or a one-element tensor, got a {x.dtype} tensor of shape "
                            f"{tuple(x.shape)}")  # fmt: skip
        x = float(x)  # a host read, as the paged engine reads its tables
    elif isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name}: expected a number or a one-element tensor, got {type(x).__name__}")
    if not math.isfinite(x):
        raise ValueError(f"{name}: expected a finite number or None, got {x!r}")
    return float(x)
