"""``qkv.PagedKVCache``: the page allocator behind ``qkv.paged_attention``.

Shape legend: ``T`` new tokens of a step (all requests), ``h`` query heads, ``g`` KV heads,
``d`` head size, ``P`` page size, ``L`` layers.

Every layer has a pool of ``num_pages`` pages of ``P`` tokens; a request owns a list of page
ids, the same in every layer (vLLM's block table). A request grows into the page after its
last one while that page is free and in the same aligned block of ``BLOCK_PAGES``, else into
a wholly free block: its keys lie in runs of whole blocks, which the attention reads as one
item each (no memory is reserved: every free page stays available to any request). A request's memory is its pages: it is
given pages as it grows and gives them back the moment it is freed, so the cache holds
``Σ ⌈len / P⌉`` pages, not ``requests × longest``. :meth:`fork` starts a request that shares
its parent's first tokens: full pages are shared (counted references), never copied; a shared
page that must take a new token is copied first (copy-on-write). ``paged_attention`` attends
shared leading pages once for all the requests that hold them.

A step::

    step = cache.plan({"a": 5, "b": 1})             # room for 5 new tokens of a, 1 of b
    for layer in range(L):
        ...                                           # q (T, h, d), k, v (T, g, d) of step.positions
        cache.write(layer, step, k, v)
        out = cache.attend(layer, step, q)            # qkv.paged_attention over the step's table
    cache.free("b")                                   # b's pages return to the pool now

With ``latent_dim=c`` (and ``kv_heads=1``, ``head_dim = c + r``) each layer's pool holds one
latent ``[c^KV; k^R]`` per token, as multi-head latent attention caches it
(``qkv.paged.LatentPages``): ``write`` takes the latents as ``k`` (and ``v``), ``attend`` returns
``(T, h, c + r)``, whose first ``c`` columns are the attention over the latents.

With ``dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``) the pools are FlashInfer's float8
cache: ``write`` rounds each token to float8, ``attend`` reads the pages as the queries' dtype.
``k_scale``, ``v_scale`` (a number, or one per layer) are its calibration: ``write`` stores
``k / k_scale`` and ``v / v_scale``, ``attend`` undoes them (``qkv.paged.pools``).

A step or a reservation the pool has too few free pages for raises ``qkv.paged.OutOfPages``.
"""

from __future__ import annotations

from collections.abc import Hashable
import torch
from torch import Tensor

from .._args import positive_int
from . import pools
from .attention import paged_attention
from .errors import OutOfPages, pages as count_pages
from .items import BLOCK_PAGES
from .pages import FloatPages
from .plan import PagedPlan
from .step import Step


class PagedKVCache:
    """Pages for ``layers`` layers, handed out to requests as they grow; see the module docstring."""

    def __init__(self, num_pages: int, page_size: int, kv_heads: int, head_dim: int, *, layers: int = 1,
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device="cpu",
                 quantized: bool = False, latent_dim: int | None = None, k_scale=None, v_scale=None):  # fmt: skip
        self.num_pages = positive_int("num_pages", num_pages)
        self.page_size = positive_int("page_size", page_size)
        self.layers = positive_int("layers", layers)
        self.pools = pools.make(num_pages, page_size, kv_heads, head_dim, layers, value_dim, dtype, device, quantized,
                                latent_dim)  # fmt: skip
        self._scales = pools.scales(k_scale, v_scale, layers, dtype)  # float8 pages hold k / k_scale, v / v_scale
        self.device = torch.device(device)
        self._refs = [0] * num_pages  # holders of each page; 0 = free
        self._free = num_pages
        blocks = -(-num_pages // BLOCK_PAGES)
        self._block_free = [min(BLOCK_PAGES, num_pages - b * BLOCK_PAGES) for b in range(blocks)]
        self._whole = set(range(blocks))  # blocks with every page free
        self._pages: dict[Hashable, list[int]] = {}
        self._length: dict[Hashable, int] = {}
        self._admitted: dict[Hashable, int] = {}  # a number per add/fork: a name freed and added again is another request
        self._admissions = 0
        self._frees = 0
        self._copies = 0  # copy-on-writes so far
        self._copied: dict[int, int] = {}  # page -> the count of its last copy-on-write as the source
        self._discard = [pool for pool in self.pools if hasattr(pool, "discard")]  # pools holding memory per page

    # ------------------------------------------------------------------ requests

    def add(self, request: Hashable) -> None:
        """Start an empty request."""
        if request in self._pages:
            raise ValueError(f"request {request!r} is already in the cache")
        self._pages[request], self._length[request] = [], 0
        self._admit(request)

    def fork(self, parent: Hashable, child: Hashable, length: int | None = None) -> None:
        """Start ``child`` holding ``parent``'s first ``length`` tokens (all by default), sharing their pages."""
        self._known(parent)
        if child in self._pages:
            raise ValueError(f"request {child!r} is already in the cache")
        n = self._length[parent] if length is None else length
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= self._length[parent]:
            raise ValueError(f"length: expected 0 to {self._length[parent]} (the parent's tokens), got {length!r}")
        pages = self._pages[parent][: -(-n // self.page_size)]
        for p in pages:
            self._refs[p] += 1
        self._pages[child], self._length[child] = list(pages), n
        self._admit(child)

    def free(self, request: Hashable) -> None:
        """End ``request``: its pages that no other request holds return to the pool now."""
        self._known(request)
        for p in self._pages.pop(request):
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._give_back(p)
        del self._length[request], self._admitted[request]
        self._frees += 1

    def length(self, request: Hashable) -> int:
        return self._length[self._known(request)]

    def pages_of(self, request: Hashable) -> list[int]:
        return list(self._pages[self._known(request)])

    @property
    def requests(self) -> list:
        return list(self._pages)

    @property
    def free_pages(self) -> int:
        return self._free

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._free

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's pool (allocated up front, as a serving engine does)."""
        return sum(pool.nbytes for pool in self.pools)

    # ------------------------------------------------------------------ steps

    def plan(self, new_tokens: dict) -> Step:
        """Room for ``{request: n}`` new tokens (0 is allowed: attend without appending); the step's table.

        Pages are taken from the pool; a shared page that would take a new token is copied
        first, in every layer. Raises ``qkv.paged.OutOfPages`` (a ``RuntimeError``; nothing
        changed) when the pool has too few pages.
        """
        requests = list(new_tokens)
        needed = self.pages_needed(new_tokens)  # (each request known, each count checked)
        if needed > self._free:
            whole = {r: -(-(self._length[r] + new_tokens[r]) // self.page_size) for r in requests}
            never = [f"; {r!r} would hold {n} pages, more than the whole cache: make num_pages larger or the request "
                     "shorter" for r, n in whole.items() if n > self.num_pages][:1]  # freeing others cannot help it
            raise OutOfPages(
                f"PagedKVCache: this step needs {count_pages(needed, more=True)} but {self._free} are free "
                f"(of {self.num_pages}){''.join(never) or '; free finished requests or make the cache larger'}",
                needed=needed, free=self._free, num_pages=self.num_pages,
            )
        page, offset, positions = [], [], []
        for r in requests:
            n, start = new_tokens[r], self._length[r]
            if n and start % self.page_size:
                self._own_last_page(r)
            for t in range(start, start + n):
                slot, where = divmod(t, self.page_size)
                if slot == len(self._pages[r]):
                    self._pages[r].append(self._take(self._pages[r][-1] if self._pages[r] else None))
                page.append(self._pages[r][slot])
                offset.append(where)
                positions.append(t)
            self._length[r] = start + n
        return self._step(requests, new_tokens, page, offset, positions)

    def pages_needed(self, new_tokens: dict) -> int:
        """Pages :meth:`plan` would take from the pool for ``{request: n}`` (new pages and copies); the requests
        must be in the cache (:meth:`add` one first, :meth:`free` it if it does not fit).

        A shared last page is copied by each of its holders that writes into it but the last:
        :meth:`plan` copies it for a writer while another request still holds it, so when every
        holder writes in one step the last finds it its own. Counting a copy per writer refused a
        step that fits the pool (parent and fork each taking one token into their shared page).
        """
        refs: dict[int, int] = {}  # the holders left of each shared last page, as plan's copies leave them
        needed = 0
        for r, n in new_tokens.items():
            self._known(r)  # as plan refuses it: a request not added (0 pages was a fit plan then refused)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"new_tokens[{r!r}]: expected a count >= 0, got {n!r}")
            start, have = self._length[r], len(self._pages[r])
            needed += max(0, -(-(start + n) // self.page_size) - have)
            if n and start % self.page_size:
                last = self._pages[r][(start - 1) // self.page_size]
                refs.setdefault(last, self._refs[last])
                if refs[last] > 1:
                    refs[last] -= 1
                    needed += 1
        return needed

    def write(self, layer: int, step: Step, k: Tensor, v: Tensor) -> None:
        """The step's new keys and values ``k, v (T, g, d)`` into layer ``layer``'s pages.

        Steps may be written in any order, with a float or an int8 cache (an int8 page is
        quantised once all its offsets are written).
        """
        self._current(step)
        self._uncopied(step)
        if k.shape[0] != step.page.numel() or v.shape[0] != step.page.numel():
            raise ValueError(f"k, v: expected {step.page.numel()} new tokens (the step's), got {k.shape[0]} and {v.shape[0]}")
        pool = self._pool(layer)
        if self._scales is not None:  # float8 pages hold the scaled tokens
            if k.dtype.itemsize == 1 or v.dtype.itemsize == 1:  # quantised already: by this scale or not, unknown
                raise TypeError(f"k, v: this float8 cache divides the tokens by its k_scale and v_scale; give them in "
                                f"the model's dtype (got {k.dtype} and {v.dtype}), not quantised already")  # fmt: skip
            k_scale, v_scale = self._scales[layer]
            k, v = k / k_scale, v / v_scale
        pool.write(step.page, step.offset, k, v)

    def attend(self, layer: int, step: Step, q: Tensor, **options):
        """``qkv.paged_attention`` of the step's queries ``q (T, h, d)`` over layer ``layer``'s pages (the step's
        plan, laid out by the first layer that runs it)."""
        self._current(step)
        pages = self.layer(layer)
        if self._scales is not None:
            given = sorted({"k_scale", "v_scale"} & set(options))
            if given:
                raise ValueError(f"{given[0]}: this cache holds its calibration scales (PagedKVCache(k_scale=..., "
                                 "v_scale=...)) and passes them itself")  # fmt: skip
            k_scale, v_scale = self._scales[layer]
            options = {**options, "k_scale": k_scale, "v_scale": v_scale}
        if step.plan is None:
            return paged_attention(q, pages, *step.table, **options)
        return step.plan.run(q, pages, **options)

    def layer(self, layer: int):
        """Layer ``layer``'s pages: FlashInfer's tuple ``(k_cache, v_cache)``, each ``(num_pages, P, g, d)``,
        an ``Int8Pages``, or (``latent_dim``) ``LatentPages``."""
        pool = self._pool(layer)
        return (pool.keys, pool.values) if isinstance(pool, FloatPages) else pool

    # ------------------------------------------------------------------ inside

    def _pool(self, layer: int):
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.layers:
            raise ValueError(f"layer: expected 0 to {self.layers - 1} (the cache's {self.layers} layers), got {layer!r}")
        return self.pools[layer]

    def _admit(self, request: Hashable) -> None:
        self._admissions += 1
        self._admitted[request] = self._admissions

    def _current(self, step: Step) -> None:
        """Refuse a step with a request freed since it was planned (its pages may be another request's now), or
        planned by another cache."""
        if not isinstance(step, Step):
            raise TypeError(f"step: expected a Step from PagedKVCache.plan, got {type(step).__name__}")
        if step.cache is not self:  # its page ids are another pool's: written here they land in others' pages
            raise ValueError("step: planned by another PagedKVCache (its page ids are that cache's); plan it with this one")
        if step.frees == self._frees:  # every layer's write and attend: nothing freed since the plan, nothing to look up
            return
        for r, admitted in zip(step.requests, step.admitted):
            if self._admitted.get(r) != admitted:
                raise ValueError(f"step: request {r!r} was freed after this step was planned, and its pages may hold "
                                 "another request's tokens now; plan a new step")  # fmt: skip

    def _uncopied(self, step: Step) -> None:
        """Refuse a write into a page copied (copy-on-write) since the step was planned.

        A later plan copies a shared page as it is then (a fork of the request, then a token in
        either of them): this step's tokens, written after the copy, reach one side only, and the
        other reads zeros or old keys where its length says it holds them.
        """
        if step.copies == self._copies:
            return
        copied = sorted({p for p in step.page.tolist() if self._copied.get(p, 0) > step.copies})
        if copied:
            raise ValueError(f"step: page(s) {copied[:4]} were copied (copy-on-write, after a fork) since this step was "
                             "planned, without its tokens; write every layer of a step before planning a step that "
                             "copies its pages (fork after writing)")  # fmt: skip

    def _known(self, request: Hashable) -> Hashable:
        if request not in self._pages:
            raise KeyError(f"request {request!r} is not in the cache (never added, or freed already)")
        return request

    def _own_last_page(self, request: Hashable) -> None:
        """Copy-on-write of the page holding the request's last token, when another request holds it too; then the
        page holds the request's tokens alone (slots past them that another holder wrote, before a fork's copy or
        before it was freed, unwritten again: an int8 page is then quantised over the request's own tokens)."""
        pages, at = self._pages[request], (self._length[request] - 1) // self.page_size
        last = pages[at]
        if self._refs[last] > 1:  # the other holders keep the original
            fresh = self._take(pages[at - 1] if at > 0 else None)
            for pool in self.pools:
                pool.copy_page(last, fresh)
            self._copies += 1
            self._copied[last] = self._copies
            self._refs[last] -= 1
            pages[at] = fresh
        kept = self._length[request] - at * self.page_size  # the request's tokens in that page, planned ones included
        for pool in self.pools:
            pool.keep_first(pages[at], kept)

    def reserve(self, request: Hashable, tokens: int) -> None:
        """Take the pages for ``request`` to reach ``tokens`` tokens now, in one run of consecutive ids where
        the pool has one (a serving loop that admits a request with its whole length reserves that much anyway).

        The attention then reads the request's keys as a few long runs (``qkv.paged.runs``).
        Pages beyond the request's length are held, not listed in its step's table.
        """
        self._known(request)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens: expected a count >= 0 (the request's length to hold pages for), got {tokens!r}")
        pages = self._pages[request]
        need = -(-tokens // self.page_size) - len(pages)
        if need <= 0:
            return
        if need > self._free:
            raise OutOfPages(f"PagedKVCache: reserving {count_pages(need)} but {self._free} are free (of {self.num_pages})",
                             needed=need, free=self._free, num_pages=self.num_pages)  # fmt: skip
        start = self._free_run(need, pages[-1] + 1 if pages else 0)
        for k in range(need):
            pages.append(self._claim(start + k) if start is not None else self._take(pages[-1] if pages else None))

    def _free_run(self, need: int, prefer: int) -> int | None:
        """The first id of ``need`` consecutive free pages: at ``prefer`` if free there, else the lowest such
        run starting on a block boundary (the attention reads aligned blocks as views, ``qkv.paged.decode``),
        else the lowest; or None."""
        def free_from(p: int) -> bool:
            return p + need <= self.num_pages and all(self._refs[q] == 0 for q in range(p, p + need))

        if free_from(prefer):
            return prefer
        lowest, run = None, 0
        for p, refs in enumerate(self._refs):
            run = run + 1 if refs == 0 else 0
            if run >= need:  # pages p - need + 1 .. p are free
                start = p - need + 1
                if start % BLOCK_PAGES == 0:
                    return start
                lowest = start if lowest is None else lowest
        return lowest

    def _take(self, after: int | None) -> int:
        """A free page: the one after ``after`` in its block if free, else the first page of a wholly free
        block, else the lowest free page. Requests so keep their keys in runs of whole blocks, which
        ``paged_attention`` reads as one item each (``qkv.paged.decode``)."""
        if after is not None and (after + 1) % BLOCK_PAGES and after + 1 < self.num_pages and self._refs[after + 1] == 0:
            p = after + 1
        elif self._whole:
            p = min(self._whole) * BLOCK_PAGES
        else:
            p = self._refs.index(0)
        return self._claim(p)

    def _claim(self, p: int) -> int:
        """Page ``p``, free until now, held by one request: the counts of free pages and blocks follow."""
        self._refs[p] = 1
        self._free -= 1
        b = p // BLOCK_PAGES
        self._whole.discard(b)
        self._block_free[b] -= 1
        return p

    def _give_back(self, p: int) -> None:
        """Page ``p`` back to the pool, and what a pool keeps for it (an int8 page's full-precision residual) freed now."""
        for pool in self._discard:
            pool.discard(p)
        self._free += 1
        b = p // BLOCK_PAGES
        self._block_free[b] += 1
        if self._block_free[b] == min(BLOCK_PAGES, self.num_pages - b * BLOCK_PAGES):
            self._whole.add(b)

    def _step(self, requests, new_tokens, page, offset, positions) -> Step:
        dev = self.device
        counts = [-(-self._length[r] // self.page_size) for r in requests]  # the pages holding tokens (not reserved ones)
        last = [self._length[r] - (c - 1) * self.page_size if c else 0 for r, c in zip(requests, counts)]
        qo = [0]
        for r in requests:
            qo.append(qo[-1] + new_tokens[r])
        kv = [0]
        for c in counts:
            kv.append(kv[-1] + c)
        indices = [p for r, c in zip(requests, counts) for p in self._pages[r][:c]]
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        table = (as_long(qo), as_long(kv), as_long(indices), as_long(last))
        plan = PagedPlan.once(*table, num_pages=self.num_pages, page_size=self.page_size, device=dev, total_q=qo[-1])
        return Step(tuple(requests), *table, as_long(page), as_long(offset), as_long(positions), plan,
                    tuple(self._admitted[r] for r in requests), self._frees, self._copies, self)  # fmt: skip
