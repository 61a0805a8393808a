"""``qkv.paged.Int8Pages``: KIVI's int8 pages against the float values written into them.

Shape legend: ``N`` pages, ``P`` page size, ``h`` query heads, ``g`` KV heads, ``d`` head size.

Written through ``write`` as a server does (several tokens of several pages per call), a full
page reads back within half a scale step of what was written, a partial page exactly; and
``qkv.paged_attention`` over the int8 pages is exactly the attention over their dequantised
values (float64, 1e-12), for decoding steps, a prefill chunk and a shared prefix.
"""

import pytest
import torch

import qkv
from qkv.paged import Int8Pages

H, G = 4, 2


def fill(kv_lens, P, D, dtype, seed, shared=0, spare=3, consecutive=False):
    """Int8Pages and the float cache of the same values, written in interleaved chunks; ``(pages, cache, table)``.

    Pages lie in a random order (``consecutive``: each request's pages one run of ids, as
    ``qkv.PagedKVCache`` hands them out); request ``r > 0`` begins with request 0's first ``shared``
    full pages (a forked prompt; fewer where it is shorter); every request's last page may be partial.
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // P) for n in kv_lens]
    common = [min(shared, c - 1) if r else 0 for r, c in enumerate(counts)]
    own = [c - s for c, s in zip(counts, common)]
    N = sum(own) + spare
    free = list(range(N))[::-1] if consecutive else torch.randperm(N, generator=gen).tolist()
    lists, fills = [], {}
    for r, (n, c) in enumerate(zip(kv_lens, counts)):
        mine = lists[0][: common[r]] if r else []
        while len(mine) < c:
            p = free.pop()
            fills[p] = min(P, n - len(mine) * P)
            mine.append(p)
        lists.append(mine)
    cache = torch.zeros(N, 2, P, G, D, dtype=dtype)
    for p, f in fills.items():
        cache[p, :, :f] = torch.randn(2, f, G, D, generator=gen, dtype=dtype)
    pages = Int8Pages(N, P, G, D, dtype=dtype)
    chunks = {}  # page -> its offsets, cut into runs at random
    for p, f in fills.items():
        cuts = sorted(set(torch.randint(1, max(2, f), (2,), generator=gen).tolist()) | {0, f})
        chunks[p] = [list(range(a, b)) for a, b in zip(cuts, cuts[1:]) if b > a]
    for i in range(max(len(c) for c in chunks.values())):
        pairs = [(p, o) for p, c in chunks.items() if i < len(c) for o in c[i]]
        pairs = [pairs[j] for j in torch.randperm(len(pairs), generator=gen).tolist()]  # any order across pages
        page, offset = torch.tensor(pairs).T
        pages.write(page, offset, cache[page, 0, offset], cache[page, 1, offset])
    indptr = torch.tensor([0, *torch.tensor([len(m) for m in lists]).cumsum(0).tolist()])
    last = torch.tensor([n - (c - 1) * P for n, c in zip(kv_lens, counts)])
    table = (indptr, torch.tensor([p for m in lists for p in m]), last)
    return pages, cache, fills, table


def dequantised(pages):
    """The float cache ``(N, 2, P, g, d)`` the int8 pages read back as."""
    return torch.stack(pages.range(0, pages.num_pages), 1)


def test_full_pages_within_half_a_step_partial_pages_exact():
    P, D = 16, 8
    pages, cache, fills, _ = fill([37, 16, 5, 64, 80], P, D, torch.float32, seed=1)
    partial = {p for p, f in fills.items() if f < P}
    assert set(pages.residual) == partial  # only the partially filled pages are held in full precision
    K, V = dequantised(pages).unbind(1)
    for p, f in fills.items():
        if p in partial:
            assert torch.equal(K[p], cache[p, 0]) and torch.equal(V[p], cache[p, 1])
        else:
            sK = pages.key_scale[p].float()[None]  # (1, g, d): one per channel, over the page's tokens
            sV = pages.value_scale[p].float()[..., None]  # (P, g, 1): one per token
            assert ((K[p] - cache[p, 0]).abs() <= sK / 2 + 1e-6).all()
            assert ((V[p] - cache[p, 1]).abs() <= sV / 2 + 1e-6).all()
            assert not torch.equal(K[p], cache[p, 0])  # it was quantised
    ids = torch.tensor([*fills, *list(fills)[:3]])  # every page, then three again
    ids = ids[torch.randperm(len(ids))]
    k, v = pages.take(ids)
    assert torch.equal(k, K[ids]) and torch.equal(v, V[ids])
    k, v = pages.range(2, 6)
    assert torch.equal(k, K[2:6]) and torch.equal(v, V[2:6])


def test_a_zero_page_reads_zero_and_a_reused_page_starts_over():
    P, D = 4, 8
    pages = Int8Pages(2, P, G, D)
    pages.write(torch.zeros(P, dtype=torch.long), torch.arange(P), torch.zeros(P, G, D), torch.zeros(P, G, D))
    K, V = pages.take(torch.tensor([0]))
    assert 0 not in pages.residual and torch.equal(K, torch.zeros_like(K)) and torch.equal(V, torch.zeros_like(V))
    assert (pages.key_scale[0] > 0).all() and (pages.value_scale[0] > 0).all()  # never a zero scale
    k = torch.randn(1, G, D)
    pages.write(torch.tensor([0]), torch.tensor([0]), k, -k)  # the freed page handed out again
    assert pages.filled[0] == 1 and 0 in pages.residual
    K, V = pages.range(0, 1)
    assert torch.equal(K[0, 0], k[0]) and torch.equal(V[0, 0], -k[0]) and not K[0, 1:].any()


def attend(q, cache, qo_lens, table):
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()])
    return qkv.paged_attention(q, cache, qo_indptr, *table, return_lse=True)


CALLS = {
    "decoding steps": ([70, 90, 49, 200, 33], [1, 1, 1, 1, 1], 0),
    "a prefill chunk among steps": ([70, 16, 130, 5], [1, 1, 40, 3], 0),
    "a shared prefix": ([70, 90, 49, 200, 33], [1, 1, 1, 1, 1], 3),
}


@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("call", list(CALLS))
def test_attention_over_int8_pages_is_attention_over_their_values(P, call):
    kv_lens, qo_lens, shared = CALLS[call]
    pages, _, _, table = fill(kv_lens, P, 8, torch.float64, seed=P, shared=shared * 16 // P)
    q = torch.randn(sum(qo_lens), H, 8, dtype=torch.float64)
    got = attend(q, pages, qo_lens, table)
    want = attend(q, dequantised(pages), qo_lens, table)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", [0, 2])
def test_a_step_over_runs_of_int8_pages_dequantises_each_run_and_equals_their_values(monkeypatch, shared):
    """Consecutive pages take the fused kernel a run at a time, the partial last pages read from the residual."""
    from qkv.paged import route as paged

    kv_lens = [70, 90, 49, 200, 33, 16]
    pages, _, fills, table = fill(kv_lens, 16, 8, torch.float64, seed=3, shared=shared, consecutive=True)
    assert pages.residual  # partial last pages live in full precision
    used = []
    run = paged.decode_runs
    monkeypatch.setattr(paged, "decode_runs", lambda *a: used.append(1) or run(*a))
    q = torch.randn(len(kv_lens), H, 8, dtype=torch.float64)
    got = attend(q, pages, [1] * len(kv_lens), table)
    assert used  # the runs path ran
    want = attend(q, dequantised(pages), [1] * len(kv_lens), table)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    again = attend(q, pages, [1] * len(kv_lens), table)  # the buffers are reused: same answer
    for a, b in zip(again, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_int8_attention_is_close_to_float32_in_under_a_third_of_the_bytes():
    P, D = 16, 64
    kv_lens, qo_lens = [200, 77, 130, 16, 300], [1, 1, 20, 1, 1]
    pages, cache, fills, table = fill(kv_lens, P, D, torch.float32, seed=7)
    q = torch.randn(sum(qo_lens), H, D)
    (out, lse), (exact, exact_lse) = attend(q, pages, qo_lens, table), attend(q, cache, qo_lens, table)
    error = (out - exact).abs().max().item()
    print(f"int8 vs float32 pages: max |out error| {error:.2e}, max |lse error| {(lse - exact_lse).abs().max():.2e}")
    assert 0 < error < 2e-2
    float32 = 2 * G * D * 4
    assert pages.bytes_per_token == 2 * G * D + 4 * G * D / P + 4 * G  # float32 scales
    assert pages.bytes_per_token / float32 <= 0.3
    N, partial = pages.num_pages, sum(f < P for f in fills.values())
    assert pages.nbytes == N * P * G * D * 2 + N * G * D * 4 + N * P * G * 4 + partial * 2 * P * G * D * 4


def test_copy_page_of_a_full_and_of_a_partial_page():
    P, D = 4, 8
    pages = Int8Pages(4, P, G, D)
    k, v = torch.randn(P + 2, G, D), torch.randn(P + 2, G, D)
    pages.write(torch.tensor([0] * P + [1, 1]), torch.tensor([*range(P), 0, 1]), k, v)  # page 0 full, page 1 half
    pages.copy_page(0, 2)
    pages.copy_page(1, 3)
    K, V = pages.take(torch.tensor([0, 1, 2, 3]))
    assert torch.equal(K[2], K[0]) and torch.equal(V[2], V[0]) and 2 not in pages.residual
    assert torch.equal(K[3], K[1]) and torch.equal(V[3], V[1]) and torch.equal(K[3, :2], k[P:])
    # the copy is its own: filling page 3 quantises it and leaves page 1 as it was
    pages.write(torch.tensor([3, 3]), torch.tensor([2, 3]), torch.randn(2, G, D), torch.randn(2, G, D))
    assert 3 not in pages.residual and 1 in pages.residual and pages.filled[1] == 2
    assert torch.equal(pages.range(1, 2)[0][0], K[1])
    pages.copy_page(1, 2)  # a partial page over a full one
    assert torch.equal(pages.take(torch.tensor([2]))[0][0], K[1]) and pages.filled[2] == 2


def test_run_buffers_are_kept_between_steps_and_grow_only_for_a_longer_run():
    """One page per request (fewer pages than KV heads) works on fresh pages; the buffers are reused, then grown."""
    P, D = 4, 8
    pages = Int8Pages(8, P, G, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(2)
    values = torch.randn(8 * P, 2, G, D, generator=gen, dtype=torch.float64)
    pages.write(torch.arange(8).repeat_interleave(P), torch.arange(P).repeat(8), values[:, 0], values[:, 1])
    want_k, want_v = pages.range(0, 8)
    read = pages.runs([(3, 1)])
    k, v = read(0, P)  # (g, P, d)
    torch.testing.assert_close(k, want_k[3].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(v, want_v[3].transpose(0, 1), rtol=0, atol=0)
    buffer = pages._scratch.bufs["KV"].data_ptr()
    pages.runs([(5, 1), (0, 1)])(1, P)  # (descending: a run at a time)
    assert pages._scratch.bufs["KV"].data_ptr() == buffer  # kept
    k, _ = pages.runs([(2, 3)])(0, 3 * P - 1)  # a longer run: grown, and only the keys asked for
    assert k.shape == (G, 3 * P - 1, D)
    torch.testing.assert_close(k, want_k[2:5].reshape(3 * P, G, D)[: 3 * P - 1].transpose(0, 1), rtol=0, atol=0)


def test_runs_that_follow_each_other_are_dequantised_together_and_each_reads_its_own_pages(monkeypatch):
    """Ascending runs a few pages apart share one dequantisation (up to ``run_group_keys`` keys); a run before the
    last, one further than ``RUN_GAP_PAGES`` or past the budget starts a new one; every read is its run's keys."""
    from qkv.paged import quant

    P, D = 4, 8
    pages = Int8Pages(64, P, G, D, dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(64 * P, 2, G, D, generator=gen, dtype=torch.float64)
    pages.write(torch.arange(64).repeat_interleave(P), torch.arange(P).repeat(64), values[:, 0], values[:, 1])
    pages.write(torch.tensor([63, 63]), torch.tensor([0, 1]), values[:2, 0], values[:2, 1])  # page 63 restarted: partial
    want_k, want_v = pages.range(0, 64)
    ranges = [(0, 2), (3, 1), (6, 4), (2, 1), (30, 2), (33, 31)]  # (page 63, partial, in the last)
    widened, widen = [], Int8Pages._widen
    monkeypatch.setattr(Int8Pages, "_widen", lambda self, a, c, partial: widened.append((a, c)) or widen(self, a, c, partial))
    pages.run_group_keys = 16 * P  # groups of at most 16 pages
    read = pages.runs(ranges)
    for n, (p0, c) in enumerate(ranges):
        count = c * P - n % 2  # (a last page read short)
        k, v = read(n, count)
        torch.testing.assert_close(k, want_k[p0 : p0 + c].reshape(c * P, G, D)[:count].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(v, want_v[p0 : p0 + c].reshape(c * P, G, D)[:count].transpose(0, 1), rtol=0, atol=0)
    # 0-9 together; 2 is behind them; 30 lies more than RUN_GAP_PAGES past 2-3; 30-63 would pass the budget
    assert widened == [(0, 10), (2, 1), (30, 2), (33, 31)] and quant.RUN_GAP_PAGES < 30 - 3


def test_the_store_is_head_major_and_the_page_major_names_are_views_of_it():
    """A run of pages is one contiguous block per head (what the decoding step widens in one pass)."""
    P, D = 4, 8
    pages = Int8Pages(6, P, G, D)
    k, v = torch.randn(2 * P, G, D), torch.randn(2 * P, G, D)
    pages.write(torch.tensor([2] * P + [3] * P), torch.arange(P).repeat(2), k, v)
    head_major = pages.keys.permute(2, 0, 1, 3)  # (g, N, P, d)
    assert all(head_major[j, 2:4].is_contiguous() for j in range(G))
    assert pages.keys.shape == pages.values.shape == (6, P, G, D)
    assert pages.key_scale.shape == (6, G, D) and pages.value_scale.shape == (6, P, G)
    assert pages.key_scale.dtype == pages.value_scale.dtype == torch.float32
    K, V = pages.range(2, 4)  # page-major, as FlashInfer lays pages out
    assert K.is_contiguous() and K.shape == (2, P, G, D)
    assert torch.equal(K, pages.keys[2:4].float() * pages.key_scale[2:4, None])
    assert torch.equal(V, pages.values[2:4].float() * pages.value_scale[2:4, ..., None])
    pages.copy_page(2, 5)  # writes through the store: the views see them
    assert torch.equal(pages.keys[5], pages.keys[2]) and torch.equal(pages.value_scale[5], pages.value_scale[2])


def test_a_request_forked_inside_a_full_page_keeps_its_own_tokens_of_that_page_in_full_precision():
    """Copy-on-write of a full, quantised page for a child forked inside it: the child's page becomes a partial one
    (its tokens from the parent dequantised, the rest unwritten), its own later tokens are kept exactly, as an
    unshared request's are, and the page is quantised once the child fills it (it was re-quantised at every write
    with the parent's later tokens in its scales: 2e-2 off the written keys)."""
    P, D = 16, 8
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(48, G, D, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 3, 48, dtype=torch.float64)[:, None, None]
    v = torch.randn(48, G, D, generator=gen, dtype=torch.float64)
    cache = qkv.PagedKVCache(16, P, G, D, dtype=torch.float64, quantized=True)
    cache.add("parent")
    cache.write(0, cache.plan({"parent": 32}), k[:32], v[:32])  # two full pages, quantised
    pool = cache.pools[0]
    parent_page = cache.pages_of("parent")[1]
    parent_k = pool.range(parent_page, parent_page + 1)[0][0]  # (P, g, d) as the parent reads it
    cache.fork("parent", "child", length=20)  # 16 + 4 tokens: inside the parent's second page
    for t in range(20, 31):
        cache.write(0, cache.plan({"child": 1}), k[t : t + 1], v[t : t + 1])
    page = cache.pages_of("child")[1]
    assert page != parent_page and page in pool.residual and pool.filled[page] == 15
    keys = pool.range(page, page + 1)[0][0]
    torch.testing.assert_close(keys[:4], parent_k[:4], rtol=0, atol=0)  # the shared tokens, as the parent has them
    torch.testing.assert_close(keys[4:15], k[20:31], rtol=0, atol=0)  # the child's own, exactly
    cache.write(0, cache.plan({"child": 1}), k[31:32], v[31:32])
    assert page not in pool.residual and pool.filled[page] == P  # full: quantised, over the child's tokens only
    torch.testing.assert_close(pool.range(page, page + 1)[0][0, 4:], k[20:32], rtol=0.02, atol=0.02)


def _stored_keys(cache, r):
    """Request ``r``'s keys as its int8 pages hold them (dequantised; partial pages as written)."""
    pages = torch.tensor(cache.pages_of(r))
    return cache.pools[0].take(pages)[0].reshape(-1, G, 8)[: cache.length(r)]


@pytest.mark.parametrize("case", ["the parent freed", "the parent's later tokens, steps out of order",
                                  "the parent copies first, steps out of order"])  # fmt: skip
def test_a_forked_request_stores_its_own_tokens_as_an_unshared_request_does(case):
    """After a fork inside a page, the child's tokens of that page are stored as an unshared request holding the
    same tokens stores them, whoever holds the page (the child alone after the parent is freed, or after the parent
    copied it away) and in whatever order its steps are written: slots the parent wrote past the fork point are not
    counted as the child's (an int8 page was quantised with them in its scales: 2e-2 to 0.27 off)."""
    P, D = 16, 8
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(48, G, D, generator=gen, dtype=torch.float64) for _ in range(2))
    later_k, later_v = (torch.randn(6, G, D, generator=gen, dtype=torch.float64) * 20 for _ in range(2))
    cache = qkv.PagedKVCache(16, P, G, D, dtype=torch.float64, quantized=True)
    cache.add("parent")
    cache.write(0, cache.plan({"parent": 20 if case != "the parent freed" else 32}), *(
        (k[:20], v[:20]) if case != "the parent freed" else (k[:32], v[:32])))  # fmt: skip
    if case != "the parent freed":
        cache.write(0, cache.plan({"parent": 6}), later_k, later_v)  # past the fork point
    shared = _stored_keys(cache, "parent")[:20].clone()
    shared_v = cache.pools[0].take(torch.tensor(cache.pages_of("parent")))[1].reshape(-1, G, D)[:20].clone()
    cache.fork("parent", "child", length=20)
    if case == "the parent freed":
        cache.free("parent")
    elif case == "the parent copies first, steps out of order":
        cache.write(0, cache.plan({"parent": 1}), later_k[:1], later_v[:1])
    first, second = cache.plan({"child": 1}), cache.plan({"child": 11})
    twin = qkv.PagedKVCache(16, P, G, D, dtype=torch.float64, quantized=True)  # the same tokens, never shared
    twin.add("alone")
    twin.write(0, twin.plan({"alone": 20}), shared, shared_v)
    twin_first, twin_second = twin.plan({"alone": 1}), twin.plan({"alone": 11})
    order = [1, 0] if "out of order" in case else [0, 1]
    tokens = [(k[20:21], v[20:21]), (k[21:32], v[21:32])]
    for n in order:  # after each step (the page partial, then full): the same stored keys
        cache.write(0, (first, second)[n], *tokens[n])
        twin.write(0, (twin_first, twin_second)[n], *tokens[n])
        torch.testing.assert_close(_stored_keys(cache, "child"), _stored_keys(twin, "alone"), rtol=0, atol=0)
