"""Benchmark suite ``serving``: paged attention for many requests, against what a user would write instead.

Shape legend: ``R`` requests, ``h = 8`` query heads, ``g = 2`` KV heads, ``d = 64``, page size
``P = 16``, float32, under ``no_grad``.

* **decode** — one decoding step of 32 requests of random lengths 64 to 2048, their pages
  handed out by ``qkv.PagedKVCache`` as ``qkv.paged.serve`` has it hand them out (each request
  admitted with its whole length reserved, its prompt prefilled, then every request growing a
  token a step, side by side): ``qkv.paged_attention``
  against a Python loop of ``F.scaled_dot_product_attention`` over each request's own
  contiguous cache, and against SDPA on the requests padded to the longest with a mask
  (built once, as the padded cache is). ``paged_attention`` is called as a model's layers call
  it, with the step's table each time (its plan kept from the first call, ``qkv.paged.recent``);
  also its first call of a new table (the plan made: a step's first layer), the step's
  average over :data:`LAYERS` layers, and a ``qkv.paged.PagedPlan`` run (FlashInfer's plan and
  run). The caches' bytes: paged ``Σ ⌈len / P⌉ · P`` tokens against padded ``R · max``;
* **mixed** — 4 prefill chunks of 512 queries (after 512 cached keys) and 28 decoding steps
  in one call, against the same work as separate calls (one per chunk, one for the steps);
* **shared prefix** — 32 requests sharing a 1024-token prompt, each with its own 16 to 256
  further tokens: pages stored, and the step with the prompt's pages shared (attended once,
  merged by LSE) against each request holding its own copy;
* **int8** — the same decoding step over ``qkv.paged.Int8Pages`` (KIVI: keys per channel,
  values per token; each request's tokens written, so its partial last page is in full
  precision, as in serving): bytes per token against float32,
  and the step's time against the float32 paged step; its accuracy (next-token KL divergence
  and perplexity against float32) on the demo's word-stream language model, and on the
  packaged SmolLM2-135M where installed;
* **float8** — the decoding step with bfloat16 queries over FlashInfer's float8 pages against
  the same over bfloat16 pages.

Every timed call starts from cold caches (``measure.Evict``), as a layer of a model finds its
own cache: a step timed right after another over the same pages found them cached.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..paged import Int8Pages, PagedKVCache, PagedPlan, paged_attention
from ..paged.pages import as_pages
from ..paged.items import BLOCK_PAGES, item_pages
from .measure import evicting, interleaved
from .report import Targets, table
from .serving_latent import latent_lines

NAME = "serving"
DESCRIPTION = "paged attention: a decoding step of 32 requests, a ragged batch, a shared prompt, an int8 cache"

FULL = dict(requests=32, low=64, high=2048, chunk=512, prefix=1024, repeats=7, accuracy=True, cold=True)
QUICK = dict(requests=6, low=8, high=64, chunk=16, prefix=32, repeats=1, accuracy=False, cold=False)
H, G, D, P = 8, 2, 64, 16
#: Layers of a decoding step (SmolLM2-135M's 30): the first call of a step's table makes its plan, the others reuse it.
LAYERS = 30


class Table:
    """Some requests of a pool: their pages and lengths as FlashInfer's table, and a call over them."""

    def __init__(self, cache, pages: list[list[int]], lengths: list[int]):
        counts = [len(ps) for ps in pages]
        self.cache = cache
        longs = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        self.indices = longs([p for ps in pages for p in ps])
        self.indptr = longs([0, *torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()])
        self.last = longs([n - (c - 1) * P for n, c in zip(lengths, counts)])

    def attend(self, q, qo_lens: list[int]):
        return self.call(q, qo_lens)()

    def call(self, q, qo_lens: list[int]) -> Callable[[], torch.Tensor]:
        """The paged call over these requests, all four table tensors made beforehand, as a server holds them
        (the loop's caches and the padded call's mask are made beforehand too)."""
        qo = self._qo(qo_lens)
        return lambda: paged_attention(q, self.cache, qo, self.indptr, self.indices, self.last)

    def plan(self, qo_lens: list[int]) -> PagedPlan:
        """The table as a serving loop's step keeps it for all its layers (laid out by the first run)."""
        store = as_pages(self.cache)
        return PagedPlan(self._qo(qo_lens), self.indptr, self.indices, self.last, num_pages=store.num_pages,
                         page_size=store.page_size)  # fmt: skip

    @staticmethod
    def _qo(qo_lens: list[int]) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(qo_lens, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)


class Pool(Table):
    """Requests' keys in a ``qkv.PagedKVCache``'s pages, laid out as serving lays them: each prompt (half
    its length) prefilled, then every request growing one token a step, side by side, until its
    length; with ``shared``, a first request holds that many tokens and every request forks it."""

    def __init__(self, lengths: list[int], seed: int = 0, shared: int = 0, quantized: bool = False):
        gen = torch.Generator().manual_seed(seed)
        cache = PagedKVCache(sum(-(-n // P) for n in lengths) + 2 * BLOCK_PAGES * len(lengths), P, G, D)
        if shared:
            cache.add("prompt")
            cache.plan({"prompt": shared})
        for r, n in enumerate(lengths):
            cache.fork("prompt", r) if shared else cache.add(r)
            cache.reserve(r, n)  # admitted with its whole length, as qkv.paged.serve admits a request
        cache.plan({r: (n - shared) // 2 for r, n in enumerate(lengths)})
        while any(cache.length(r) < n for r, n in enumerate(lengths)):
            cache.plan({r: 1 for r, n in enumerate(lengths) if cache.length(r) < n})
        pages = [cache.pages_of(r) for r in range(len(lengths))]
        self.data = torch.randn(cache.num_pages, 2, P, G, D, generator=gen)
        store = (self.data[:, 0].contiguous(), self.data[:, 1].contiguous())  # PagedKVCache's form: pools of their own
        if quantized:  # each request's tokens written, as serving writes them: its last page partial, in full precision
            store = Int8Pages(cache.num_pages, P, G, D)
            filled: dict[int, int] = {}
            for ids, n in zip(pages, lengths):
                for t, page in enumerate(ids):
                    filled[page] = max(filled.get(page, 0), min(P, n - t * P))
            ids = torch.tensor([page for page, count in filled.items() for _ in range(count)], dtype=torch.long)
            offsets = torch.tensor([o for count in filled.values() for o in range(count)], dtype=torch.long)
            store.write(ids, offsets, self.data[ids, 0, offsets], self.data[ids, 1, offsets])
        super().__init__(store, pages, lengths)
        self.pages, self.lengths = pages, lengths

    def part(self, requests: slice) -> Table:
        return Table(self.cache, self.pages[requests], self.lengths[requests])

    def contiguous(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request ``r``'s keys and values as ``(1, g, n, d)`` contiguous tensors."""
        pages = self.data[self.pages[r]]  # (c, 2, P, g, d)
        k = pages[:, 0].reshape(-1, G, D)[: self.lengths[r]].transpose(0, 1).contiguous()[None]
        v = pages[:, 1].reshape(-1, G, D)[: self.lengths[r]].transpose(0, 1).contiguous()[None]
        return k, v


def _lengths(cfg: dict, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(cfg["low"], cfg["high"] + 1, (n,), generator=gen).tolist()


def _decode(cfg: dict, say) -> tuple[list, Targets, dict]:
    lengths = _lengths(cfg, cfg["requests"], 0)
    pool = Pool(lengths)
    R = len(lengths)
    q = torch.randn(R, H, D, generator=torch.Generator().manual_seed(1))
    kv = [pool.contiguous(r) for r in range(R)]
    longest = max(lengths)
    kp = torch.zeros(R, G, longest, D)
    vp = torch.zeros(R, G, longest, D)
    for r, (k, v) in enumerate(kv):
        kp[r, :, : lengths[r]], vp[r, :, : lengths[r]] = k[0], v[0]
    keep = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]

    def loop():
        return torch.cat([F.scaled_dot_product_attention(q[r][None, :, None], k, v, enable_gqa=True)[0, :, 0][None]
                          for r, (k, v) in enumerate(kv)])  # fmt: skip

    plan = pool.plan([1] * R)
    fns = {
        "paged": pool.call(q, [1] * R),
        "paged, new table": lambda: pool.plan([1] * R).run(q, pool.cache),
        "paged, planned": lambda: plan.run(q, pool.cache),
        "loop": loop,
        "padded": lambda: F.scaled_dot_product_attention(q[:, :, None], kp, vp, attn_mask=keep, enable_gqa=True),
        "int8 paged": Pool(lengths, quantized=True).call(q, [1] * R),
    }
    with torch.no_grad():
        t = interleaved(fns, cfg["repeats"], before=evicting(cfg["cold"]))
    t["step"] = (t["paged, new table"] + (LAYERS - 1) * t["paged"]) / LAYERS  # a step's average call
    say("  decode: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items()))
    per_token = 2 * G * D * 4
    paged_bytes = sum(-(-n // P) * P for n in lengths) * per_token
    padded_bytes = R * longest * per_token
    int8_ratio = Int8Pages(1, P, G, D).bytes_per_token / per_token
    targets = Targets()
    step = f"decode step, {R} requests, paged_attention (a {LAYERS}-layer step's average call)"
    targets.add(f"{step} / loop of SDPA over contiguous caches ≤ 1.0", t["step"] / t["loop"], 1.0)
    targets.add(f"{step} / SDPA padded to the longest ≤ 0.6", t["step"] / t["padded"], 0.6)
    targets.add("int8 cache: bytes per token / float32's ≤ 0.3", int8_ratio, 0.3)
    targets.add("int8 cache: decode step / float32 paged step ≤ 1.5", t["int8 paged"] / t["paged"], 1.5)
    rows = [[f"{R} requests, lengths {cfg['low']}–{cfg['high']}", f"{t['paged'] * 1e3:.2f}",
             f"{t['paged, new table'] * 1e3:.2f}", f"{t['step'] * 1e3:.2f}", f"{t['paged, planned'] * 1e3:.2f}",
             f"{t['loop'] * 1e3:.2f}",
             f"{t['padded'] * 1e3:.2f}", f"{t['int8 paged'] * 1e3:.2f}", f"{paged_bytes / 2**20:.1f} MiB",
             f"{padded_bytes / 2**20:.1f} MiB"]]  # fmt: skip
    item = item_pages(P) * P
    slots = {"paged": sum(-(-n // item) * item for n in lengths), "padded": R * longest, "keys": sum(lengths)}
    return rows, targets, {"int8 ratio": int8_ratio, "slots": slots}


def _mixed(cfg: dict, say, targets: Targets) -> list:
    decodes = _lengths(cfg, cfg["requests"] - 4, 2)
    chunk = cfg["chunk"]
    lengths = [2 * chunk] * 4 + decodes  # the chunks follow as many cached keys
    pool = Pool(lengths, seed=3)
    qo = [chunk] * 4 + [1] * len(decodes)
    q = torch.randn(sum(qo), H, D, generator=torch.Generator().manual_seed(4))
    parts = [pool.part(slice(r, r + 1)) for r in range(4)]
    steps = pool.part(slice(4, None))

    calls = [parts[r].call(q[r * chunk : (r + 1) * chunk], [chunk]) for r in range(4)]
    calls.append(steps.call(q[4 * chunk :], [1] * len(decodes)))

    def separate():
        return torch.cat([call() for call in calls])

    with torch.no_grad():
        t = interleaved({"one call": pool.call(q, qo), "separate calls": separate}, cfg["repeats"],
                        before=evicting(cfg["cold"]))  # fmt: skip
    say(f"  mixed: one call {t['one call'] * 1e3:.1f} ms, separate {t['separate calls'] * 1e3:.1f} ms")
    targets.add(f"4 prefill chunks of {chunk} + {len(decodes)} decoding steps in one call / separate calls ≤ 1.2",
                t["one call"] / t["separate calls"], 1.2)  # fmt: skip
    return [[f"4 chunks of {chunk} + {len(decodes)} steps", f"{t['one call'] * 1e3:.1f}", f"{t['separate calls'] * 1e3:.1f}",
             f"{t['one call'] / t['separate calls']:.2f}"]]  # fmt: skip


def _shared(cfg: dict, say) -> list:
    R, prefix = cfg["requests"], cfg["prefix"]
    own = _lengths({"low": 16, "high": 256}, R, 5)
    lengths = [prefix + n for n in own]
    shared, alone = Pool(lengths, seed=6, shared=prefix), Pool(lengths, seed=6)
    q = torch.randn(R, H, D, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        t = interleaved({"shared": shared.call(q, [1] * R), "not shared": alone.call(q, [1] * R)},
                        cfg["repeats"], before=evicting(cfg["cold"]))  # fmt: skip
    say(f"  shared prefix: shared {t['shared'] * 1e3:.2f} ms, not shared {t['not shared'] * 1e3:.2f} ms")
    pages = lambda pool: len(set(pool.indices.tolist()))  # noqa: E731
    return [[f"{R} requests, {prefix}-token prompt + 16–256 own", str(pages(shared)), str(pages(alone)),
             f"{t['shared'] * 1e3:.2f}", f"{t['not shared'] * 1e3:.2f}", f"{t['shared'] / t['not shared']:.2f}"]]  # fmt: skip


def _float8(cfg: dict, say) -> list:
    """The decoding step's requests with bfloat16 queries over bfloat16 pages, and over FlashInfer's float8 pages."""
    lengths = _lengths(cfg, cfg["requests"], 0)
    pool = Pool(lengths)
    R = len(lengths)
    q = torch.randn(R, H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    k, v = pool.data[:, 0].contiguous(), pool.data[:, 1].contiguous()
    half = Table((k.to(torch.bfloat16), v.to(torch.bfloat16)), pool.pages, lengths)
    fp8 = Table((k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)), pool.pages, lengths)
    with torch.no_grad():
        t = interleaved({"bfloat16": half.call(q, [1] * R), "float8": fp8.call(q, [1] * R)},
                        cfg["repeats"], before=evicting(cfg["cold"]))  # fmt: skip
        exact = Table((k, v), pool.pages, lengths).attend(q.float(), [1] * R)
        gap = {name: float((table.attend(q, [1] * R).float() - exact).abs().max()) for name, table in
               (("bfloat16", half), ("float8", fp8))}  # fmt: skip
    say(f"  float8: bfloat16 pages {t['bfloat16'] * 1e3:.2f} ms, float8 pages {t['float8'] * 1e3:.2f} ms")
    return [[f"{R} requests, lengths {cfg['low']}–{cfg['high']}", f"{t['bfloat16'] * 1e3:.2f}", f"{t['float8'] * 1e3:.2f}",
             f"{t['float8'] / t['bfloat16']:.2f}", f"{gap['bfloat16']:.1e}", f"{gap['float8']:.1e}"]]  # fmt: skip


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    decode_rows, targets, decoded = _decode(cfg, say)
    mixed_rows = _mixed(cfg, say, targets)
    shared_rows = _shared(cfg, say)
    float8_rows = _float8(cfg, say)
    latent = latent_lines(cfg, _lengths(cfg, cfg["requests"], 0), say)
    lines = ["## Serving: paged attention (`qkv bench --suite serving`)", "",
             f"h = {H}, KV heads = {G}, d = {D}, page size {P}, float32, no_grad; times are medians in ms, side by side"
             + (", each call from cold caches (a buffer larger than the last-level cache written before it), as a "
                "model's layer finds its own cache." if cfg["cold"] else "."), "",
             "### A decoding step", ""]  # fmt: skip
    lines += table(["requests", "paged_attention, the step's table", "a new table", f"a {LAYERS}-layer step's average",
                    "PagedPlan.run", "loop of SDPA", "SDPA padded", "int8 paged", "paged cache", "padded cache"],
                   decode_rows) + [""]  # fmt: skip
    slots = decoded["slots"]
    lines += ["A model's layers call `paged_attention` with the step's table: the first call checks the table and lays "
              "out its items (the plan), the later ones find that plan kept for the same values (each call compares "
              "the four index tensors with the kept ones, entry by entry, a few µs) and pay only for their own keys, "
              "as `PagedPlan.run` does; a step's average call weighs the first by one layer in "
              f"{LAYERS}.", ""]
    lines += [f"Where the time goes: the paged step and both SDPA contenders run PyTorch's fused CPU kernel, whose "
              f"time follows the key slots it reads. The paged step reads {slots['paged']:,} (items of "
              f"{item_pages(P) * P} keys: the requests' {slots['keys']:,} keys and their last items' empty slots), the "
              f"padded call {slots['padded']:,}: {slots['paged'] / slots['padded']:.2f} of its slots before any host "
              "work, so the paged / padded target of 0.6 leaves the paged step's own work (laying out the table, "
              "merging a request's items by their log-sum-exp) almost no room; the loop reads the keys alone and "
              "pays a call per request instead.", ""]  # fmt: skip
    lines += ["### A ragged batch: prefill chunks and decoding steps in one call", ""]
    lines += table(["batch", "one call", "separate calls", "ratio"], mixed_rows) + [""]
    lines += ["### A shared prompt: pages stored once, attended once", ""]
    lines += table(["requests", "pages (shared)", "pages (not shared)", "step shared", "step not shared", "ratio"],
                   shared_rows) + [""]  # fmt: skip
    lines += ["### Float8 pages: the decoding step in bfloat16, pages in FlashInfer's float8", "",
              "The same step, bfloat16 queries over the pages in bfloat16 and in `float8_e4m3fn` (half the bytes per "
              "token: 0.25 of float32's), converted to bfloat16 a tile at a time as they are read; largest difference "
              "from the step in float32 over the float32 pages.", ""]  # fmt: skip
    lines += table(["requests", "bfloat16 pages", "float8 pages", "float8 / bfloat16", "bfloat16: difference",
                    "float8: difference"], float8_rows) + [""]  # fmt: skip
    lines += latent + [""]
    if cfg["accuracy"]:
        from .serving_accuracy import accuracy_lines

        lines += accuracy_lines(say) + [""]
    lines += ["### Targets", ""] + targets.lines()
    return "\n".join(lines)
