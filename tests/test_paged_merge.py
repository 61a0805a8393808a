"""The decoding step's merge of a request's items: shifted by its last item's lse, and the exact merge behind it.

Shape legend: ``I`` items, ``n`` requests, ``g`` KV heads, ``x`` query heads per KV head, ``e`` value size.
"""

import torch

import qkv
from qkv.paged import decode, items, route
from qkv.paged.pages import as_pages
from qkv.paged.plan import PagedPlan

H, G, D = 4, 2, 8


def _items(n: int, I: int, seed: int, spread: float):
    """Random items' ``out (I, g, x, e)`` and ``lse (I, g, x)`` in float64, owners ``0 .. n`` (``n``: a filler)."""
    gen = torch.Generator().manual_seed(seed)
    owner = torch.cat([torch.arange(n), torch.randint(0, n + 1, (I - n,), generator=gen)])
    owner = owner[torch.randperm(I, generator=gen)]
    out = torch.randn(I, G, H // G, D, generator=gen, dtype=torch.float64)
    lse = spread * torch.randn(I, G, H // G, generator=gen, dtype=torch.float64)
    return owner, out, lse


class _Shift:
    """The two fields of a step's layout the merge reads: each slot's owner's last slot, each request's last slot."""

    def __init__(self, owner: torch.Tensor, n: int):
        final = [max(i for i, o in enumerate(owner.tolist()) if o == r) for r in range(n)]
        self.final = torch.tensor(final)
        self.shift = torch.tensor([final[o] if o < n else 0 for o in owner.tolist()])


def test_the_merge_shifted_by_the_last_item_equals_the_merge_by_the_largest():
    for seed, spread in ((0, 1.0), (1, 20.0), (2, 100.0)):  # float64: items some 500 nats apart stay inside its range
        owner, out, lse = _items(6, 40, seed, spread)
        want = decode.merge_by_owner(out, lse, owner, 6)
        got = decode.merge_by_owner(out, lse, owner, 6, _Shift(owner, 6))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        # the definition: a softmax over every item of the request, by its lse
        for r in range(6):
            mine = owner == r
            w = torch.softmax(lse[mine], 0)
            torch.testing.assert_close(got[0][r], (w[..., None] * out[mine]).sum(0), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got[1][r], torch.logsumexp(lse[mine], 0), rtol=1e-12, atol=1e-12)


def test_a_shift_that_overflows_is_seen_and_the_step_merges_exactly():
    """A key far above the rest early in a request (an attention sink): its item's lse exceeds the last item's by
    more than float32's ``log(max) = 88.7``, so the shifted weights overflow; the step still equals the definition."""
    P, S = 4, items.BLOCK_PAGES
    L = S * P
    kv_lens = [3 * L + 5, 2 * L + 1, L - 3]
    gen = torch.Generator().manual_seed(3)
    pages, nxt = [], 0
    for n in kv_lens:  # aligned blocks, as qkv.PagedKVCache hands them out: the fused kernel's path
        nxt = -(-nxt // S) * S
        pages.append(list(range(nxt, nxt + -(-n // P))))
        nxt += len(pages[-1])
    cache = torch.randn(-(-nxt // S) * S, 2, P, G, D, generator=gen)
    q = torch.randn(len(kv_lens), H, D, generator=gen)
    q[:, :, :] = q[:1, :1, :]  # every head the same query, so one key can stand far above for all of them
    for ps in pages:  # the request's first key: 200 nats above the others for every head
        cache[ps[0], 0, 0] = q[0, 0] * (200 * D**0.5 / float(q[0, 0] @ q[0, 0]))
    table = (torch.arange(len(kv_lens) + 1), torch.tensor([0, *torch.tensor([len(p) for p in pages]).cumsum(0).tolist()]),
             torch.tensor([p for ps in pages for p in ps]), torch.tensor([n - (-(-n // P) - 1) * P for n in kv_lens]))  # fmt: skip

    # the shifted merge alone overflows on these items
    store = as_pages(cache)
    plan = PagedPlan(*table, num_pages=store.num_pages, page_size=P)
    steps = list(range(len(kv_lens)))
    where = items.layout(items.items(steps, [0] * len(steps), plan.table, store.num_pages), plan.table, P, None,
                         len(steps), q.device)  # fmt: skip
    from qkv.paged import decode_fused
    from qkv.paged.options import options

    opts = options(q, causal=True, window_left=-1, logits_soft_cap=0.0, sm_scale=None, alibi_slopes=None,
                   score_mod=None)  # fmt: skip
    q_at = q.view(len(steps), G, H // G, D).index_select(0, where.row)
    o, s = decode_fused.attend(q_at, None, where, store, opts, {})
    shifted, _ = decode.merge_by_owner(o, s, where.owner, len(steps), where)
    assert not torch.isfinite(shifted[:2]).all()

    got = qkv.paged_attention(q, cache, *table, return_lse=True)
    ref = qkv.paged_attention(q.double(), cache.double(), *table, return_lse=True, score_mod=lambda s, *_: s)
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].double(), ref[1], rtol=1e-5, atol=1e-4)


def test_each_requests_last_slot_holds_its_own_position(monkeypatch):
    """``Layout.final`` names the item holding key ``kv_len - 1`` (the query's own, always seen), in views and copies."""
    laid = []
    real = items.layout
    monkeypatch.setattr(decode, "layout", lambda *a: laid.append(real(*a)) or laid[-1])
    kv_lens = [70, 1, 200, 64, 65]
    P = 4
    for aligned in (True, False):
        gen = torch.Generator().manual_seed(5)
        counts = [-(-n // P) for n in kv_lens]
        S = items.BLOCK_PAGES
        ids, nxt = [], 0
        for c in counts:
            nxt = -(-nxt // S) * S if aligned else nxt + 1  # a page left out: consecutive, but off the blocks
            ids.append(list(range(nxt, nxt + c)))
            nxt += c
        cache = torch.randn(-(-nxt // S) * S + S, 2, P, G, D, generator=gen, dtype=torch.float64)
        table = (torch.arange(len(kv_lens) + 1), torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()]),
                 torch.tensor([p for ps in ids for p in ps]), torch.tensor([n - (c - 1) * P for n, c in zip(kv_lens, counts)]))  # fmt: skip
        q = torch.randn(len(kv_lens), H, D, generator=gen, dtype=torch.float64)
        monkeypatch.setattr(route, "runs_usable", lambda *a: False)  # every step through the items, not runs
        qkv.paged_attention(q, cache, *table)
        where = laid[-1]
        assert (where.ids is None) == aligned
        final = where.final.tolist()
        assert [int(where.base[f] + where.keys[f]) for f in final] == kv_lens
        assert where.owner[where.final].tolist() == list(range(len(kv_lens)))
        assert where.shift.tolist() == [final[o] if o < len(kv_lens) else 0 for o in where.owner.tolist()]
