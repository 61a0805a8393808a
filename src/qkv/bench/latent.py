"""Benchmark suite ``latent``: multi-head latent attention (DeepSeek-V2) decoding against
multi-head attention of the same size.

Shape legend: ``b`` batch, ``j`` cached tokens, ``dim`` model size, ``h`` heads, ``d`` head
size, ``c`` the KV latent size, ``r`` the rotary size.

Both modules have ``dim = 512``, ``h = 8`` heads of ``d = 64``; MLA uses DeepSeek-V2's
proportions, ``c = 4d = 256`` and ``r = d/2 = 32``, no query compression. Each decoding step
is one new token (``b = 1``) attending to a cache of ``j`` tokens, under
``torch.inference_mode``:

* **MHA** — ``qkv.MultiHeadAttention`` with a preallocated ``qkv.KVCache``: keys and values,
  ``2·h·d`` numbers per token;
* **MLA, absorbed** — ``qkv.MultiHeadLatentAttention`` with a ``qkv.LatentCache``: ``W^UK``
  folded into the query and ``W^UV`` into the output, attending over the cached
  ``[c^KV; k^R]``, ``c + r`` numbers per token;
* **MLA, naive** — the same module and cache with ``absorb=False``: K and V re-expanded
  from the whole latent cache at every step, what a cache of the latent costs without the
  absorption.

Reported: the cache's bytes per token (measured from the cache's tensors after the
prefill, ``cache.nbytes / cache.length``) and median step times relative to MHA, timed
interleaved (:func:`qkv.bench.measure.interleaved`); each step appends one token, so the
cache grows by the few timed steps only.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..attention import MultiHeadAttention
from ..cache import KVCache, LatentCache
from ..latent import MultiHeadLatentAttention
from .measure import interleaved
from .report import Targets, table

NAME = "latent"
DESCRIPTION = "multi-head latent attention (DeepSeek-V2) decoding vs multi-head attention: cache bytes and step time"

DIM, HEADS, DIM_HEAD = 512, 8, 64
FULL = dict(contexts=(1024, 4096), dtypes=("float32", "bfloat16"), repeats=30)
QUICK = dict(contexts=(64,), dtypes=("float32",), repeats=3)
#: DeepSeek-V2's proportions give (c + r) / (2·h·d) = 4.5 / 16 = 28%; the target allows that.
CACHE_TARGET = 0.3


def contenders(context: int, dtype: torch.dtype, repeats: int, seed: int = 0) -> tuple[dict, dict[str, int]]:
    """``({name: step}, {name: cache bytes per token})`` after prefilling ``context`` tokens."""
    torch.manual_seed(seed)
    mha = MultiHeadAttention(DIM, HEADS, dim_head=DIM_HEAD, bias=False).to(dtype).eval()
    mla = MultiHeadLatentAttention(DIM, HEADS, dim_head=DIM_HEAD).to(dtype).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randn(1, context, DIM, generator=gen).to(dtype)
    token = torch.randn(1, 1, DIM, generator=gen).to(dtype)
    room = context + 2 * repeats + 8  # the timed steps append one token each
    caches = {"MHA": KVCache(room), "MLA absorbed": LatentCache(room), "MLA naive": LatentCache(room)}
    steps: dict[str, Callable[[], object]] = {}
    with torch.inference_mode():
        mha(prompt, causal=True, cache=caches["MHA"])
        for name in ("MLA absorbed", "MLA naive"):
            mla(prompt, causal=True, cache=caches[name])
    per_token = {name: c.nbytes // c.length for name, c in caches.items()}

    def step(module, cache, **kwargs):
        def run():
            with torch.inference_mode():
                return module(token, cache=cache, **kwargs)

        return run

    steps["MHA"] = step(mha, caches["MHA"])
    steps["MLA absorbed"] = step(mla, caches["MLA absorbed"], absorb=True)
    steps["MLA naive"] = step(mla, caches["MLA naive"], absorb=False)
    return steps, per_token


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    targets = Targets()
    rows = []
    for name in cfg["dtypes"]:
        dtype = getattr(torch, name)
        for context in cfg["contexts"]:
            steps, per_token = contenders(context, dtype, cfg["repeats"])
            times = interleaved(steps, cfg["repeats"], warmup=2)
            share = per_token["MLA absorbed"] / per_token["MHA"]
            absorbed, naive = times["MLA absorbed"] / times["MHA"], times["MLA naive"] / times["MHA"]
            say(f"  {name} j={context}: cache {share:.3f} of MHA's; step absorbed {absorbed:.2f}x, naive {naive:.2f}x MHA")
            rows.append([name, context, per_token["MHA"], per_token["MLA absorbed"], f"{share:.3f}",
                         f"{times['MHA'] * 1e3:.2f}", f"{absorbed:.2f}", f"{naive:.2f}"])  # fmt: skip
            if context == max(cfg["contexts"]):
                targets.add(f"MLA cache bytes per token / MHA's ≤ {CACHE_TARGET} ({name})", share, CACHE_TARGET)
                targets.add(f"MLA absorbed step / naive step < 1 at j = {context} ({name})", absorbed / naive, 1.0)
    parts = [
        f"## Multi-head latent attention: decoding against MHA (dim {DIM}, {HEADS} heads of {DIM_HEAD})",
        "",
        f"MLA with DeepSeek-V2's proportions: KV latent c = {4 * DIM_HEAD}, rotary part r = {DIM_HEAD // 2}, "
        "no query compression. One new token per step, batch 1, inference mode; cache bytes per token "
        "(per layer) measured from the cache's tensors; step times are medians of interleaved rounds, "
        "relative to MHA's.",
        "",
    ]
    parts += table(["dtype", "cached tokens j", "MHA cache B/token", "MLA cache B/token", "MLA / MHA cache",
                    "MHA step ms", "MLA absorbed step / MHA", "MLA naive step / MHA"], rows)  # fmt: skip
    parts += ["", "### Targets", ""] + targets.lines()
    return "\n".join(parts)
