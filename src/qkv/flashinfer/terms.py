"""What a FlashInfer plan fixes besides its page table, and the one run behind every FlashInfer entry.

Shape legend: ``T`` query rows of all requests, ``h`` query heads, ``g`` KV heads, ``d`` key
size, ``e`` value size, ``R`` requests, ``N`` page entries of all requests, ``P`` page size.

FlashInfer's kernels (``attention/variants.cuh``, ``pos_enc.cuh``, ``prefill.cuh``) give request
``r``'s query ``t`` (its index among the request's ``qo_len`` queries, standing at position
``p = kv_len - qo_len + t``) and the key at position ``k`` the logit::

    s = sm_scale · q_scale · k_scale · q·k                  (pos_encoding_mode "NONE" or "ROPE_LLAMA")
    s = cap · tanh(s / cap)                                 logits_soft_cap = cap > 0
    s = sm · q·k + slope_h · (k - t)                        "ALIBI" (t, not p: 0 in a decoding step)
    s = cap · tanh((sm · q·k + slope_h · (k - t)) · sm / cap)   "ALIBI" with a cap (sm applied twice)

with ``slope_h`` FlashInfer's ``get_alibi_slopes(num_qo_heads)``; under ``"ROPE_LLAMA"`` q is
rotated at ``p`` and each key at ``k`` (Llama's halves, frequencies ``θ^(-2i/d) / rope_scale``,
``θ = rope_theta``, default 1e4) before the product. A key is seen when ``k <= p`` (``causal``, the
bottom-right alignment; ignored under a custom mask), ``k >= p - window_left`` (``window_left >=
0``) and, with a custom mask, its bit ``t · kv_len + k`` of the request's segment is set. The
``lse`` FlashInfer returns is base 2 (``log2 Σ 2^(s · log2 e)``), float32; a row that sees no key
gets ``out = 0``, ``lse = -inf``.

qkv runs this as ``qkv.paged_attention``: ALiBi and the custom mask as one ``score_mod`` at the
request's own positions (FlashInfer's distance and cap, exactly, ``lse`` included); under
``"ROPE_LLAMA"`` the call reads a rotated copy of the keys it names (FlashInfer rotates them
inside its kernel; on a CPU that copy is memory ∝ the keys read) and the rotated q and k are
rounded to their dtype, as FlashInfer's prefill kernel stores them.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from ..paged.options import calibration
from ..paged.pages import as_pages
from ..paged.plan import PagedPlan
from .quantization import segment_packbits
from .rope import llama_theta, rotate

POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class Terms:
    """A plan's terms: everything but the table and the tensors a run is given."""

    causal: bool
    pos_encoding_mode: str
    window_left: int
    logits_soft_cap: float  # 0: none
    sm_scale: float | None  # None: 1/√d
    rope_scale: float
    rope_theta: float
    mask: Tensor | None  # custom mask bits, little-endian, request r's from byte mask_start[r]
    mask_start: list[int] | None
    rope_rounds: bool = True  # rotated q and k rounded to their dtype (prefill kernels), or kept in float32 (decode's)


def terms(*, causal=False, pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, sm_scale=None,
          rope_scale=None, rope_theta=None, custom_mask=None, packed_custom_mask=None,
          mask_lengths: list[int] | None = None, rope_rounds: bool = True) -> Terms:  # fmt: skip
    """Checked terms; ``mask_lengths``: each request's ``qo_len · kv_len`` (the bits its mask segment holds)."""
    check_pos_encoding_mode(pos_encoding_mode)
    if isinstance(window_left, bool) or not isinstance(window_left, numbers.Integral) or window_left < -1:
        raise ValueError(f"window_left: expected -1 (no window) or a number of keys >= 0, got {window_left!r}")
    cap = 0.0 if logits_soft_cap is None else _number("logits_soft_cap", logits_soft_cap)
    if cap < 0:
        raise ValueError(f"logits_soft_cap: expected 0 (none) or a positive number, got {logits_soft_cap!r}")
    mask, start = None, None
    if packed_custom_mask is not None or custom_mask is not None:
        mask, start = _mask_bits(custom_mask, packed_custom_mask, mask_lengths)
    return Terms(bool(causal), pos_encoding_mode, int(window_left), cap,
                 None if sm_scale is None else _number("sm_scale", sm_scale),
                 1.0 if rope_scale is None else _number("rope_scale", rope_scale),
                 1e4 if rope_theta is None else _number("rope_theta", rope_theta), mask, start, rope_rounds)  # fmt: skip


def check_pos_encoding_mode(mode) -> None:
    if mode not in POS_ENCODING_MODES:
        raise ValueError(f"pos_encoding_mode: expected one of {POS_ENCODING_MODES}, got {mode!r}")


def check_layout(kv_layout) -> None:
    if kv_layout not in LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {LAYOUTS}, got {kv_layout!r}")


def expand_pages(kv_cache, kv_layout: str):
    """A cache of one-slot pages given without their page axis (FlashInfer's ``_expand_4d`` / ``_expand_5d``: a
    ``(num_pages, g, d)`` tuple or a ``(num_pages, 2, g, d)`` tensor) with it; any other cache as it is."""
    axis = -3 if kv_layout == "NHD" else -2
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2 and all(isinstance(x, Tensor) and x.dim() == 3 for x in kv_cache):
        return tuple(x.unsqueeze(axis) for x in kv_cache)
    if isinstance(kv_cache, Tensor) and kv_cache.dim() == 4:
        return kv_cache.unsqueeze(axis)
    return kv_cache


def get_alibi_slopes(n_heads: int, device=None) -> Tensor:
    """FlashInfer's ALiBi slopes ``(n_heads,)`` float32: the powers ``m^k`` of ``m = 2^(-8/n)`` for the largest power of
    two ``n <= n_heads``, then the odd powers of ``2^(-4/n)`` for the heads past it (Press et al. 2022's recipe),
    raised in float32 as FlashInfer's ``torch.pow`` raises them (at 16 heads the last bit differs from ``2^(-8k/n)``)."""
    n = 2 ** math.floor(math.log2(n_heads))
    slopes = torch.pow(2.0 ** (-8.0 / n), torch.arange(1, 1 + n, device=device))
    if n < n_heads:
        slopes = torch.cat([slopes, torch.pow(2.0 ** (-4.0 / n), torch.arange(1, 1 + 2 * (n_heads - n), 2, device=device))])
    return slopes.float()


def run(plan: PagedPlan, q: Tensor, kv_cache, kv_layout: str, t: Terms, *, q_scale=None, k_scale=None, v_scale=None,
        sinks=None, out=None, lse=None, return_lse=False, o_dtype=None):  # fmt: skip
    """``out (T, h, e)`` or ``(out, lse (T, h))`` of ``plan``'s table over ``kv_cache`` under ``t`` (FlashInfer's base-2
    ``lse``); written into ``out`` / ``lse`` where given."""
    table = plan.table
    scale = (1.0 / math.sqrt(q.shape[-1]) if t.sm_scale is None else t.sm_scale)
    for name, x in (("q_scale", q_scale), ("k_scale", k_scale)):
        if (x := calibration(name, x)) is not None:  # FlashInfer folds both into sm_scale
            scale *= x
    out_dtype = q.dtype if o_dtype is None else o_dtype
    # FlashInfer accumulates in float32 and writes its output dtype: a wider output (or the decode kernel's float32
    # rotation) is computed in it here, the pages converted a tile at a time as they are read
    wide = out_dtype if out_dtype.itemsize > q.dtype.itemsize else None
    if t.pos_encoding_mode == "ROPE_LLAMA" and not t.rope_rounds and q.dtype.itemsize < 4:
        wide = torch.float32 if wide is None or wide.itemsize < 4 else wide
    if wide is not None:
        pages = as_pages(kv_cache, kv_layout, q.dtype)
        kv_cache, kv_layout, q = pages.reading(wide), "NHD", q.to(wide)
    if t.pos_encoding_mode == "ROPE_LLAMA":
        q, kv_cache, plan = _rotated(q, kv_cache, kv_layout, plan, t)
        kv_layout = "NHD"
    alibi = t.pos_encoding_mode == "ALIBI"
    wanted = return_lse or lse is not None  # (without it a prefill need not compute one: PyTorch's public kernel)
    answer = plan.run(q, kv_cache, causal=t.causal and t.mask is None, window_left=t.window_left,
                      logits_soft_cap=0.0 if alibi else t.logits_soft_cap, sm_scale=scale, sinks=sinks,
                      score_mod=_score_mod(t, table, q, scale), return_lse=wanted, kv_layout=kv_layout,
                      v_scale=v_scale)  # fmt: skip
    result, base_e = answer if wanted else (answer, None)
    result = into("out", out, result.to(out_dtype))
    if not wanted:
        return result
    base_2 = into("lse", lse, base_e / math.log(2.0))
    return (result, base_2) if return_lse else result


def _score_mod(t: Terms, table, q: Tensor, scale: float):
    """ALiBi at FlashInfer's distance (and cap) and the custom mask's bits, as one score_mod; None without either."""
    alibi = t.pos_encoding_mode == "ALIBI"
    if not alibi and t.mask is None:
        return None
    device = q.device
    # per request: where its queries start (p - t) and its key count, the mask segment's first byte
    before = torch.tensor([k - n for k, n in zip(table.kv_len, table.qo_len)], device=device)
    keys = torch.tensor(table.kv_len, device=device)
    slopes = get_alibi_slopes(q.shape[1], device).to(torch.promote_types(q.dtype, torch.float32)) if alibi else None
    cap = t.logits_soft_cap
    bits = t.mask.to(device) if t.mask is not None else None
    first = torch.tensor(t.mask_start, device=device) if t.mask is not None else None

    def flashinfer_terms(score, r, h, qp, kp):
        index = qp - before[r]  # t, the query's index in its request
        if alibi:
            score = score + slopes[h].to(score.dtype) * (kp - index).to(score.dtype)
            if cap > 0:
                score = cap * torch.tanh(score * (scale / cap))
        if bits is not None:
            bit = index * keys[r] + kp  # (keys past the request's, which no query sees, are clamped into the table)
            byte = (first[r] + torch.div(bit, 8, rounding_mode="floor")).clamp(0, max(bits.numel() - 1, 0))
            seen = (bits[byte].long() >> (bit % 8)) & 1
            score = torch.where(seen.bool() & (kp < keys[r]), score, float("-inf"))
        return score

    return flashinfer_terms


def _rotated(q: Tensor, kv_cache, kv_layout: str, plan: PagedPlan, t: Terms):
    """q and a copy of the keys the table names rotated at their positions (Llama's RoPE), with the plan over that copy."""
    table = plan.table
    theta = llama_theta(q.shape[-1], t.rope_theta, t.rope_scale)
    q_pos = torch.cat([torch.arange(k - n, k) for n, k in zip(table.qo_len, table.kv_len)] or [torch.zeros(0, dtype=torch.long)])
    q = rotate(q, q_pos.to(q.device), theta, interleave=False)  # (in float32 already where the decode kernel keeps it so)
    K, V = as_pages(kv_cache, kv_layout, q.dtype).take(table.indices)  # (N, P, g, d): every entry's page, in order
    N, P, g, d = K.shape
    entry = torch.cat([torch.arange(c) for c in table.page_count] or [torch.zeros(0, dtype=torch.long)])
    k_pos = (entry[:, None] * P + torch.arange(P)).reshape(-1).to(q.device)  # a key's place in its request
    K = rotate(K.reshape(N * P, g, d), k_pos, theta, interleave=False).view(N, P, g, d)
    return q, (K, V), PagedPlan.over_copy(plan)


def _mask_bits(custom_mask, packed_custom_mask, lengths: list[int] | None) -> tuple[Tensor, list[int]]:
    """The mask as FlashInfer's plan packs it: each request's ``qo_len · kv_len`` bits from a whole byte, little-endian."""
    sizes = [(n + 7) // 8 for n in lengths]
    start = [0]
    for s in sizes:
        start.append(start[-1] + s)
    if packed_custom_mask is not None:  # (FlashInfer ignores custom_mask then)
        if not isinstance(packed_custom_mask, Tensor) or packed_custom_mask.dtype != torch.uint8 or packed_custom_mask.dim() != 1:
            got = (f"{packed_custom_mask.dtype} of shape {tuple(packed_custom_mask.shape)}"
                   if isinstance(packed_custom_mask, Tensor) else type(packed_custom_mask).__name__)  # fmt: skip
            raise TypeError(f"packed_custom_mask: expected a 1-d uint8 tensor (packbits' output), got {got}")
        if packed_custom_mask.numel() != start[-1]:
            raise ValueError(f"packed_custom_mask: the requests' qo_len · kv_len bits, each request's from a whole byte "
                             f"(segment_packbits(..., bitorder='little'), what plan packs a custom_mask into), are "
                             f"{start[-1]} bytes, got {packed_custom_mask.numel()}")  # fmt: skip
        return packed_custom_mask.clone(), start[:-1]
    if not isinstance(custom_mask, Tensor):
        raise TypeError(f"custom_mask: expected a bool tensor, got {type(custom_mask).__name__}")
    if custom_mask.numel() != sum(lengths):
        raise ValueError(f"custom_mask: expected Σ qo_len · kv_len = {sum(lengths)} entries (each request's "
                         f"(qo_len, kv_len) mask flattened, one after another), got {custom_mask.numel()}")  # fmt: skip
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    bits, _ = segment_packbits(custom_mask.reshape(-1), bounds, bitorder="little")
    return bits, start[:-1]


def _number(name: str, x) -> float:
    if isinstance(x, Tensor) and x.numel() == 1 and not x.dtype.is_complex:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise TypeError(f"{name}: expected a finite number, got {x!r}")
    return float(x)


def into(name: str, buffer: Tensor | None, x: Tensor) -> Tensor:
    if buffer is None:
        return x
    if not isinstance(buffer, Tensor) or (buffer.shape, buffer.dtype, buffer.device) != (x.shape, x.dtype, x.device):
        got = f"{buffer.dtype} {tuple(buffer.shape)} on {buffer.device}" if isinstance(buffer, Tensor) else type(buffer).__name__
        raise ValueError(f"{name}: expected a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device} to write into, "
                         f"got {got}")  # fmt: skip
    return buffer.copy_(x)
