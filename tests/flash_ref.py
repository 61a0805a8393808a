"""The formulas of flash-attn's docstrings, written out per sequence in float64: the oracle of ``qkv.flash_attn``'s tests.

Shape legend: ``sq``/``sk`` one sequence's query and key lengths, ``h`` query heads, ``g`` KV
heads, ``d`` query/key size, ``e`` value size, ``r`` rotated dims.
"""

import math

import torch


def sequence(q, k, v, *, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """``(out (sq, h, e), lse (h, sq))`` of one sequence, ``q (sq, h, d)``, ``k (sk, g, d)``, ``v (sk, g, e)``.

    Bottom-right alignment: query ``r`` sits at key ``r + sk - sq``; ``causal`` sees keys up to
    it, ``window = (left, right)`` keys in ``[r + sk - sq - left, r + sk - sq + right]`` (-1:
    unbounded); the soft cap ``c · tanh(s / c)`` then ALiBi ``-slope · |r + sk - sq - c|``; a
    row with no key: zeros, lse -inf.
    """
    sq, h, d = q.shape
    sk, g = k.shape[:2]
    scale = d**-0.5 if scale is None else scale
    ks = k.transpose(0, 1).repeat_interleave(h // g, 0)  # (h, sk, d)
    vs = v.transpose(0, 1).repeat_interleave(h // g, 0)
    logits = scale * q.transpose(0, 1) @ ks.transpose(-1, -2)  # (h, sq, sk)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    if slopes is not None:
        logits = logits - slopes.double()[:, None, None] * (row - col).abs()
    logits = logits.masked_fill(~allowed(sq, sk, causal, window), -math.inf)
    lse = torch.logsumexp(logits, -1)  # (h, sq)
    live = torch.isfinite(lse)[..., None]
    w = torch.where(live, torch.exp(logits - torch.where(live, lse[..., None], 0.0)), 0.0)
    return (w @ vs).transpose(0, 1), lse


def allowed(sq, sk, causal, window):
    """``(sq, sk)`` bool: the keys each query sees, bottom-right (query ``r`` at key ``r + sk - sq``): up to it under
    ``causal``, within ``window = (left, right)`` (-1: unbounded)."""
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    right = 0 if causal else window[1]
    if window[0] >= 0:
        seen &= col >= row - window[0]
    if right >= 0:
        seen &= col <= row + right
    return seen


def rope(x, cos, sin, positions, interleaved):
    """``x (s, heads, d)`` with its first ``r = 2 · cos.shape[1]`` dims turned by ``cos, sin`` at ``positions (s,)``:
    each pair as a complex number times ``cos + i sin``; pairs ``(2i, 2i + 1)`` or ``(i, i + r/2)``."""
    half = cos.shape[1]
    r = 2 * half
    rot = x[..., :r].double()
    if interleaved:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
    else:
        z = torch.complex(rot[..., :half], rot[..., half:])
    turn = torch.complex(cos[positions].double(), sin[positions].double())[:, None, :]  # (s, 1, r/2)
    z = z * turn
    if interleaved:
        rot = torch.stack((z.real, z.imag), -1).flatten(-2)
    else:
        rot = torch.cat((z.real, z.imag), -1)
    return torch.cat((rot.to(x.dtype), x[..., r:]), -1)
