"""The serving suite's latent-attention lines: an MLA decoding step over pages against a loop of SDPA per request.

Shape legend: ``R`` requests, ``h`` heads, ``c`` latent size, ``r`` rotary size, ``P`` page size.

DeepSeek-V2-Lite's attention sizes: 16 heads, latent ``c = 512``, rotary ``r = 64``; a token
caches ``c + r = 576`` numbers per layer, against ``2·h·d = 4096`` for multi-head attention of
head size 128. The pages lie as ``qkv.PagedKVCache.reserve`` lays a request out (consecutive,
from a block boundary); each request's absorbed query ``[q_nope; q_pe]`` attends to its
latents. The loop is what a user with one contiguous cache per request runs: SDPA with the
latents as keys and values, the value's rotary columns dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..paged import paged_latent_attention
from ..paged.items import BLOCK_PAGES
from .measure import evicting, interleaved
from .report import table

HEADS, LATENT, ROPE, PAGE = 16, 512, 64, 16


def latent_lines(cfg: dict, lengths: list[int], say: Callable[[str], None]) -> list[str]:
    """The markdown lines of the MLA decoding step (one row), for the requests of ``lengths``."""
    gen = torch.Generator().manual_seed(11)
    R, width, scale = len(lengths), LATENT + ROPE, (128 + ROPE) ** -0.5
    counts = [-(-n // PAGE) for n in lengths]
    starts = [BLOCK_PAGES * sum(-(-c // BLOCK_PAGES) for c in counts[:r]) for r in range(R)]
    buf = torch.randn(starts[-1] + BLOCK_PAGES * -(-counts[-1] // BLOCK_PAGES), PAGE, width, generator=gen)
    one = (buf[..., :LATENT], buf[..., LATENT:])  # the two halves of one buffer: read where they lie
    two = (one[0].contiguous(), one[1].contiguous())  # pools of their own: a tile joined as it is read
    pages = [list(range(s, s + c)) for s, c in zip(starts, counts)]
    table_ = (torch.arange(R + 1), torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()]),
              torch.tensor([p for ps in pages for p in ps]), torch.tensor(lengths))  # fmt: skip
    q_nope = torch.randn(R, HEADS, LATENT, generator=gen)
    q_pe = torch.randn(R, HEADS, ROPE, generator=gen)
    q = torch.cat((q_nope, q_pe), -1)
    latents = [buf[ps].reshape(-1, width)[:n].contiguous()[None, None] for ps, n in zip(pages, lengths)]  # (1, 1, n, c + r)

    def loop():
        return torch.cat([F.scaled_dot_product_attention(q[r][None, None], kv, kv, scale=scale)[0, 0, :, :LATENT][None]
                          for r, kv in enumerate(latents)])  # fmt: skip

    fns = {
        "paged, one buffer": lambda: paged_latent_attention(q_nope, q_pe, *one, *table_, sm_scale=scale),
        "paged, two pools": lambda: paged_latent_attention(q_nope, q_pe, *two, *table_, sm_scale=scale),
        "loop": loop,
    }
    with torch.no_grad():
        gap = float((fns["paged, one buffer"]() - loop()).abs().max())
        t = interleaved(fns, cfg["repeats"], before=evicting(cfg["cold"]))
    say("  latent: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items()) + f" (largest difference {gap:.1e})")
    row = [f"{R} requests, lengths {min(lengths)}–{max(lengths)}", f"{t['paged, one buffer'] * 1e3:.2f}",
           f"{t['paged, two pools'] * 1e3:.2f}", f"{t['loop'] * 1e3:.2f}",
           f"{t['paged, one buffer'] / t['loop']:.2f}", f"{t['paged, two pools'] / t['loop']:.2f}", f"{gap:.1e}"]  # fmt: skip
    return [f"### Multi-head latent attention: a decoding step over MLA pages (h = {HEADS}, c = {LATENT}, r = {ROPE}, "
            f"page size {PAGE})", "",
            f"A token caches {width} numbers per layer, against {2 * HEADS * 128} for multi-head attention of head size "
            f"128 ({width / (2 * HEADS * 128):.2f}×). `qkv.paged_latent_attention` over FlashInfer's two MLA caches: "
            "halves of one buffer (read where they lie) or pools of their own (a tile joined as it is read); "
            "the loop runs SDPA per request over a contiguous copy of its latents. Largest difference: paged against the loop.",
            ""] + table(["requests", "paged, one buffer", "paged, two pools", "loop of SDPA", "one buffer / loop",
                         "two pools / loop", "largest difference"], [row])  # fmt: skip
