"""``qkv.PagedKVCache`` over a long random life: requests added, appended to, forked, freed, stepped together.

Shape legend: ``T`` new tokens of a step, ``h`` query heads, ``g`` KV heads, ``d`` head size,
``P`` page size.

A reference model keeps each request's keys and values as plain contiguous float64 tensors,
and each request's pages as *logical* pages (a fork shares its parent's, a copy-on-write gives
the writer a new one). After every operation: ``qkv.paged_attention`` over the cache's tables
equals attention over the reference tensors in every layer (1e-12; int8 pages within their
rounding), the cache's pages are the logical pages one for one (none held twice, none leaked),
and misuse is refused with nothing changed.
"""

import math
import random

import pytest
import torch

import qkv
from qkv.paged import OutOfPages

H, G, D, LAYERS = 4, 2, 8, 2


def reference(q, K, V):
    """Attention of ``q (n, h, d)`` at the last ``n`` of ``len(K)`` positions (bottom-right causal, grouped heads)."""
    n, L = q.shape[0], K.shape[0]
    K, V = K.repeat_interleave(H // G, 1), V.repeat_interleave(H // G, 1)  # (L, h, d)
    s = torch.einsum("nhd,lhd->hnl", q, K) / math.sqrt(D)
    s = s.masked_fill(torch.arange(L)[None] > torch.arange(L - n, L)[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), V), torch.logsumexp(s, -1).T


class Life:
    """A cache and its reference model, driven by random operations (``run``)."""

    def __init__(self, seed, P, num_pages, quantized=False):
        self.rng, self.gen = random.Random(seed), torch.Generator().manual_seed(seed)
        self.P, self.quantized = P, quantized
        self.cache = qkv.PagedKVCache(num_pages, P, G, D, layers=LAYERS, dtype=torch.float64, quantized=quantized)
        self.tol = dict(rtol=0, atol=0.05) if quantized else dict(rtol=1e-12, atol=1e-12)
        self.K: dict = {}  # name -> per layer (n, g, d)
        self.V: dict = {}
        self.logical: dict = {}  # name -> its logical pages
        self.next_page = self.next_name = 0
        self.freed: list = []
        self.initial_free, self.initial_bytes = self.cache.free_pages, self.cache.nbytes
        self.counts = dict.fromkeys(["add", "append", "token", "fork", "free", "step", "full", "misuse", "reserve"], 0)

    # ------------------------------------------------------------------ the model

    def new_page(self):
        self.next_page += 1
        return self.next_page

    def holders(self, page):
        return sum(page in pages for pages in self.logical.values())

    def need(self, new):
        """Pages a step takes: new pages, and a copy of a shared last page for each holder but the last to write."""
        held = {r: list(p) for r, p in self.logical.items()}
        count = 0
        for r, n in new.items():
            length = len(self.K[r][0])
            at = (length - 1) // self.P
            if n and length % self.P and sum(held[r][at] in p for p in held.values()) > 1:
                held[r][at] = object()
                count += 1
            count += max(0, -(-(length + n) // self.P) - len(held[r]))
        return count

    def state(self):
        c = self.cache
        return {r: (c.pages_of(r), c.length(r)) for r in c.requests}, c.free_pages

    # ------------------------------------------------------------------ checks

    def check(self):
        """Pages one for one with the logical pages; every request reads back its own keys in every layer."""
        c, P = self.cache, self.P
        assert sorted(c.requests, key=str) == sorted(self.logical, key=str)
        where: dict = {}
        for r, pages in self.logical.items():
            n = len(self.K[r][0])
            assert c.length(r) == n and len(pages) >= -(-n // P)  # reserved pages past its length are its own
            held = c.pages_of(r)
            assert len(held) == len(pages)
            for a, b in zip(pages, held):
                assert where.setdefault(a, b) == b  # a logical page lies in one page
        assert len(set(where.values())) == len(where)  # and no page holds two logical pages
        assert c.used_pages == len(where) and c.free_pages == self.initial_free - len(where)
        lengths = [len(self.K[r][0]) for r in self.logical]  # shared prefixes counted once: at most the sum
        assert c.used_pages <= sum(-(-n // P) for n in lengths) + sum(len(x) - -(-n // P) for x, n in
                                                                       zip(self.logical.values(), lengths))  # fmt: skip
        live = [r for r in c.requests if c.length(r)]
        if not live:
            return
        step = c.plan({r: 0 for r in live})
        rows = [self.rng.randint(1, min(3, c.length(r))) if self.rng.random() < 0.3 else 1 for r in live]
        qo = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
        for layer in range(LAYERS):
            q = torch.randn(int(qo[-1]), H, D, generator=self.gen, dtype=torch.float64)
            out, lse = qkv.paged_attention(q, c.layer(layer), qo, *step.table[1:], return_lse=True)
            for i, r in enumerate(live):
                want, want_lse = reference(q[qo[i] : qo[i + 1]], self.K[r][layer], self.V[r][layer])
                torch.testing.assert_close(out[qo[i] : qo[i + 1]], want, **self.tol)
                if not self.quantized:
                    torch.testing.assert_close(lse[qo[i] : qo[i + 1]], want_lse, **self.tol)

    # ------------------------------------------------------------------ operations

    def step(self, new):
        """Plan ``{request: n}``, write each layer's keys, attend, and compare; a step too large is refused intact."""
        c = self.cache
        before, need = self.state(), self.need(new)
        assert c.pages_needed(new) == need
        if need > c.free_pages:
            with pytest.raises(OutOfPages, match=f"needs {need} more page{'s' * (need != 1)} but {c.free_pages} are free") as e:
                c.plan(new)
            assert (e.value.needed, e.value.free, e.value.num_pages) == (need, c.free_pages, c.num_pages)
            assert self.state() == before
            self.counts["full"] += 1
            return False
        free = c.free_pages
        step = c.plan(new)
        assert c.free_pages == free - need
        for r, n in new.items():  # the model: copy-on-write of a shared partial last page, then new pages
            length = len(self.K[r][0])
            at = (length - 1) // self.P
            if n and length % self.P and self.holders(self.logical[r][at]) > 1:
                self.logical[r][at] = self.new_page()
            while len(self.logical[r]) < -(-(length + n) // self.P):
                self.logical[r].append(self.new_page())
        T = sum(new.values())
        assert step.requests == tuple(new) and step.page.numel() == T
        for layer in range(LAYERS):
            k, v, q = (torch.randn(T, x, D, generator=self.gen, dtype=torch.float64) for x in (G, G, H))
            c.write(layer, step, k, v)
            out, lse = c.attend(layer, step, q, return_lse=True)
            row = 0
            for r, n in new.items():
                self.K[r][layer] = torch.cat([self.K[r][layer], k[row : row + n]])
                self.V[r][layer] = torch.cat([self.V[r][layer], v[row : row + n]])
                if n:
                    want, want_lse = reference(q[row : row + n], self.K[r][layer], self.V[r][layer])
                    torch.testing.assert_close(out[row : row + n], want, **self.tol)
                    if not self.quantized:
                        torch.testing.assert_close(lse[row : row + n], want_lse, **self.tol)
                row += n
        return True

    def add(self):
        self.next_name += 1
        r = f"r{self.next_name}"
        self.cache.add(r)
        self.K[r], self.V[r] = ([torch.zeros(0, G, D, dtype=torch.float64)] * LAYERS for _ in "kv")
        self.logical[r] = []
        self.counts["add"] += 1
        self.step({r: self.rng.randint(0, 3 * self.P + 5)})  # its prompt: one prefill chunk
        return r

    def fork(self, parent):
        n, P = self.cache.length(parent), self.P
        cut = self.rng.choice([0, n, P * self.rng.randint(0, n // P), self.rng.randint(0, n)])  # boundary or mid-page
        self.next_name += 1
        child = f"r{self.next_name}"
        used = self.cache.used_pages
        self.cache.fork(parent, child, length=cut)
        assert self.cache.used_pages == used  # a fork takes no page: it shares them
        self.K[child] = [x[:cut].clone() for x in self.K[parent]]
        self.V[child] = [x[:cut].clone() for x in self.V[parent]]
        self.logical[child] = self.logical[parent][: -(-cut // P)]
        self.counts["fork"] += 1

    def reserve(self, r):
        """Pages for ``r`` to reach a random length, taken now; refused intact where the pool lacks them."""
        c, P = self.cache, self.P
        tokens = c.length(r) + self.rng.randint(0, 3 * P)
        need = max(0, -(-tokens // P) - len(self.logical[r]))
        before = self.state()
        if need > c.free_pages:
            with pytest.raises(OutOfPages, match=f"reserving {need} page{'s' * (need != 1)} but {c.free_pages} are free") as e:
                c.reserve(r, tokens)
            assert (e.value.needed, e.value.free) == (need, c.free_pages)
            assert self.state() == before
            self.counts["full"] += 1
            return
        c.reserve(r, tokens)
        assert c.free_pages == before[1] - need and c.pages_of(r)[: len(self.logical[r])] == before[0][r][0]
        self.logical[r] += [self.new_page() for _ in range(need)]
        self.counts["reserve"] += 1

    def free(self, r):
        c = self.cache
        if self.rng.random() < 0.5:  # a step planned before the free is refused after it, writes and reads alike
            others = [x for x in c.requests if x != r]
            stale = c.plan({r: 0, **{x: 0 for x in others[:2]}})
        else:
            stale = None
        before = c.used_pages
        c.free(r)
        gone = {p for p in self.logical.pop(r) if self.holders(p) == 0}
        assert c.used_pages == before - len(gone)  # its memory returns at once
        del self.K[r], self.V[r]
        self.freed.append(r)
        self.counts["free"] += 1
        if stale is not None:
            k = torch.zeros(0, G, D, dtype=torch.float64)
            snapshot = [c.layer(layer)[0].clone() for layer in range(LAYERS)] if not self.quantized else None
            with pytest.raises(ValueError, match=f"request {r!r} was freed after this step was planned"):
                c.write(0, stale, k, k)
            with pytest.raises(ValueError, match=f"request {r!r} was freed after this step was planned"):
                c.attend(LAYERS - 1, stale, torch.zeros(0, H, D, dtype=torch.float64))
            if snapshot is not None:
                assert all(torch.equal(c.layer(layer)[0], s) for layer, s in enumerate(snapshot))

    def misuse(self):
        """A freed request can be neither stepped, freed again nor forked; an over-large fork length is refused."""
        c = self.cache
        before = self.state()
        dead = self.rng.choice(self.freed)
        with pytest.raises(KeyError, match=f"request {dead!r} is not in the cache"):
            c.plan({dead: 1})
        with pytest.raises(KeyError, match=f"request {dead!r} is not in the cache"):
            c.free(dead)
        with pytest.raises(KeyError, match=f"request {dead!r} is not in the cache"):
            c.fork(dead, "orphan")
        if c.requests:
            r = self.rng.choice(c.requests)
            with pytest.raises(ValueError, match="length: expected 0 to"):
                c.fork(r, "orphan", length=c.length(r) + 1)
            with pytest.raises(KeyError, match="not in the cache"):  # a live request with a dead one: nothing done
                c.plan({r: 1, dead: 1})
        assert self.state() == before and "orphan" not in c.requests
        self.counts["misuse"] += 1

    def run(self, ops):
        rng = self.rng
        for _ in range(ops):
            live = self.cache.requests
            u = rng.random()
            if live and self.cache.free_pages < self.cache.num_pages // 4 and rng.random() < 0.5:
                self.free(rng.choice(live))  # a full pool: a serving loop frees a request (the rest still run out)
            elif not live or u < 0.15:
                self.add()
            elif u < 0.30:
                self.counts["append"] += self.step({rng.choice(live): rng.randint(2, 2 * self.P + 3)})
            elif u < 0.45:
                self.counts["token"] += self.step({rng.choice(live): 1})
            elif u < 0.60:
                self.fork(rng.choice(live))
            elif u < 0.72:
                self.free(rng.choice(live))
            elif u < 0.77:
                self.reserve(rng.choice(live))
            elif u < 0.92:
                chosen = rng.sample(live, rng.randint(1, len(live)))
                counts = [0, 1, 1, 1, rng.randint(1, self.P + 2)]
                self.counts["step"] += self.step({r: rng.choice(counts) for r in chosen})
            elif self.freed:
                self.misuse()
            self.check()
        for r in list(self.cache.requests):
            self.free(r)
        self.check()
        assert self.cache.free_pages == self.initial_free == self.cache.num_pages and self.cache.used_pages == 0
        assert self.cache.nbytes == self.initial_bytes  # int8 pages' full-precision copies went with their requests
        return self.counts


@pytest.mark.parametrize("P, num_pages, ops", [(1, 48, 120), (16, 16, 120), (128, 6, 80)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_random_life_of_requests_keeps_each_its_own_keys_and_every_page_accounted(seed, P, num_pages, ops):
    counts = Life(seed, P, num_pages).run(ops)
    assert counts["fork"] and counts["free"] and counts["step"]


@pytest.mark.parametrize("P, num_pages, ops", [(1, 48, 80), (16, 16, 80), (128, 6, 50)])
def test_a_random_life_over_int8_pages_keeps_the_same_accounts(P, num_pages, ops):
    life = Life(7, P, num_pages, quantized=True)
    life.run(ops)


# ---------------------------------------------------------------------- bugs the random life found


def test_a_parent_and_its_fork_both_writing_into_their_shared_page_need_one_copy_not_two():
    """Each holder of a shared last page was counted a copy, the last one too (which writes it in place):
    a step that fits the pool (as the same tokens planned one request at a time do) was refused."""
    cache = qkv.PagedKVCache(3, 4, G, D)
    cache.add("a")
    cache.plan({"a": 5})  # pages: 4 + 1 tokens
    cache.fork("a", "b")  # b shares both
    assert cache.free_pages == 1 and cache.pages_needed({"a": 1, "b": 1}) == 1
    step = cache.plan({"a": 1, "b": 1})  # a copies the shared page, b then holds it alone
    assert cache.free_pages == 0 and step.page.numel() == 2
    assert cache.pages_of("a")[1] != cache.pages_of("b")[1]


def test_freeing_an_int8_request_returns_its_partial_pages_full_precision_copies():
    """An int8 page holds its partial tokens in full precision; freed, that copy stayed until the page was
    written again, so after every request had ended the cache held more memory than when it began."""
    cache = qkv.PagedKVCache(4, 16, G, D, layers=2, quantized=True, dtype=torch.float64)
    empty = cache.nbytes
    cache.add("a")
    step = cache.plan({"a": 21})  # one full page (int8), one partial (full precision)
    k = torch.randn(21, G, D, dtype=torch.float64)
    for layer in range(2):
        cache.write(layer, step, k, k)
    assert cache.nbytes > empty
    cache.fork("a", "b", length=18)  # b shares the partial page: it stays while b holds it
    cache.free("a")
    assert cache.nbytes > empty
    cache.free("b")
    assert cache.nbytes == empty and all(not pool.residual for pool in cache.pools)
    cache.add("c")  # a page handed out again starts over
    step = cache.plan({"c": 3})
    for layer in range(2):
        cache.write(layer, step, k[:3], k[:3])
    K, _ = cache.layer(1).take(torch.tensor(cache.pages_of("c")))
    assert torch.equal(K[0, :3], k[:3]) and not K[0, 3:].any()


@pytest.mark.parametrize("writer", ["parent", "child"])
def test_a_step_planned_before_a_fork_copies_its_page_is_refused_after_it(writer):
    """A step's tokens written after a later plan copied their page (copy-on-write of a fork) reached one
    side only: the fork, or the parent, read zeros where its length said it had those keys."""
    cache = qkv.PagedKVCache(8, 4, G, D, dtype=torch.float64)
    cache.add("a")
    first = cache.plan({"a": 2})
    k = torch.randn(3, G, D, dtype=torch.float64)
    cache.write(0, first, k[:2], k[:2])
    pending = cache.plan({"a": 1})  # a's third token, into its page
    cache.fork("a", "b")  # b holds a's three tokens, the third not written yet
    cache.plan({"a" if writer == "parent" else "b": 1})  # copies the shared page as it is now
    with pytest.raises(ValueError, match=r"step: page\(s\) \[0\] were copied \(copy-on-write, after a fork\)"):
        cache.write(0, pending, k[2:], k[2:])
    cache.attend(0, pending, torch.randn(1, H, D, dtype=torch.float64))  # reading is still its own pages
    # written before the fork, the same steps are fine
    cache = qkv.PagedKVCache(8, 4, G, D, dtype=torch.float64)
    cache.add("a")
    step = cache.plan({"a": 3})
    cache.write(0, step, k, k)
    cache.fork("a", "b")
    step = cache.plan({"a": 1, "b": 1})
    cache.write(0, step, k[:2], k[:2])
    for r in "ab":
        K = cache.layer(0)[0][cache.pages_of(r)[0]]
        assert torch.equal(K[:3], k) and torch.equal(K[3], k[0 if r == "a" else 1])


def test_a_step_of_another_cache_and_a_reservation_that_is_not_a_count_are_refused():
    """A step carries page ids of the cache that planned it: another cache of the same size took its writes
    into pages its own requests hold. ``reserve`` took 2.5 tokens to a TypeError and True to one page."""
    one, other = (qkv.PagedKVCache(4, 4, G, D, dtype=torch.float64) for _ in range(2))
    one.add("a")
    other.add("b")
    step = one.plan({"a": 2})
    mine = other.plan({"b": 2})
    k = torch.randn(2, G, D, dtype=torch.float64)
    other.write(0, mine, k, k)
    q = torch.zeros(2, H, D, dtype=torch.float64)
    for call in (lambda: other.write(0, step, -k, -k), lambda: other.attend(0, step, q)):
        with pytest.raises(ValueError, match="step: planned by another PagedKVCache"):
            call()
    assert torch.equal(other.layer(0)[0][other.pages_of("b")[0], :2], k)
    for bad in (2.5, True, -1, "3"):
        with pytest.raises(ValueError, match="tokens: expected a count >= 0"):
            one.reserve("a", bad)
    assert one.pages_of("a") == [0] and one.free_pages == 3


@pytest.mark.parametrize("quantized", [False, True])
def test_steps_written_out_of_plan_order_keep_every_token(quantized):
    """Two steps planned into one page, the later written first: both steps' tokens are kept
    (an int8 page once started over at a write at offset 0, dropping the later step's tokens)."""
    P = 8
    cache = qkv.PagedKVCache(4, P, G, D, dtype=torch.float64, quantized=quantized)
    cache.add("r")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, P, G, D, generator=gen, dtype=torch.float64)
    first, second = cache.plan({"r": 3}), cache.plan({"r": P - 3})
    cache.write(0, second, k[3:], v[3:])
    cache.write(0, first, k[:3], v[:3])
    q = torch.randn(P - 3, H, D, generator=gen, dtype=torch.float64)  # the later step's queries, over all P tokens
    out, lse = cache.attend(0, second, q, return_lse=True)
    want, want_lse = reference(q, k, v)
    tol = dict(rtol=0, atol=0.05) if quantized else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    if quantized:  # the full page left the residual for int8
        assert not cache.layer(0).residual
