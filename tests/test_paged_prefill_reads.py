"""A ragged prefill's reads: a request's consecutive pages as views, no output filled twice, no sum over a causal
output; each against the same attention written out alone (``test_paged_attention.literal``), float64 to 1e-12.

Shape legend: ``T`` query rows, ``h`` query heads, ``g`` KV heads, ``d`` head size, ``P`` page size.
"""

import pytest
import torch
from test_paged_attention import D, G, H, literal

import qkv
from qkv import checks
from qkv.backends import hidden_keys
from qkv.paged import pages as pages_module
from qkv.paged.table import page_table


def _ranged(qo_lens, kv_lens, P, gap=2, seed=0):
    """Each request's pages one consecutive run of ids, runs ``gap`` pages apart, in a shuffled request order."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // P) for n in kv_lens]
    starts, at = [], 0
    for c in counts:
        starts.append(at)
        at += c + gap
    cache = torch.randn(at + 1, 2, P, G, D, generator=gen, dtype=torch.float64)
    indices = [p for s, c in zip(starts, counts) for p in range(s, s + c)]
    indptr = [0, *torch.tensor(counts).cumsum(0).tolist()]
    last = [n - (c - 1) * P if c else 1 for n, c in zip(kv_lens, counts)]
    q = torch.randn(sum(qo_lens), H, D, generator=gen, dtype=torch.float64)
    qo = [0, *torch.tensor(qo_lens).cumsum(0).tolist()]
    return q, cache, tuple(torch.tensor(x) for x in (qo, indptr, indices, last))


def test_first_of_range_names_runs_of_consecutive_ids_only():
    ids = torch.tensor([4, 5, 6, 9, 2, 3, 7, 7])
    table = page_table(4, 16, 4, torch.tensor([0, 1, 2, 3, 4]), torch.tensor([0, 3, 4, 6, 8]), ids,
                       torch.tensor([4, 4, 4, 4]), torch.device("cpu"))  # fmt: skip
    assert [table.first_of_range(r) for r in range(4)] == [4, 9, 2, None]  # 7, 7: a repeat is not a run
    empty = page_table(1, 16, 4, torch.tensor([0, 1]), torch.tensor([0, 0]), ids, torch.tensor([1]), torch.device("cpu"))
    assert empty.first_of_range(0) is None


@pytest.mark.parametrize("P", [1, 4, 16])
@pytest.mark.parametrize("form", ["one tensor", "two pools", "HND"])
def test_prefill_chunks_over_consecutive_pages_are_read_as_views_and_equal_each_request_alone(P, form, monkeypatch):
    qo_lens, kv_lens = [5, 0, 7, 3, 2], [9, 4, 7, 40, 13]  # prefill chunks (a decoding step reads items)
    q, cache, table = _ranged(qo_lens, kv_lens, P)
    monkeypatch.setattr(pages_module.FloatPages, "take", lambda *a: pytest.fail("a consecutive run was copied"))
    given = {"one tensor": cache, "two pools": (cache[:, 0].contiguous(), cache[:, 1].contiguous()),
             "HND": cache.transpose(-2, -3).contiguous()}[form]  # fmt: skip
    for kw in ({}, {"window_left": 3}, {"causal": False}):
        got = qkv.paged_attention(q, given, *table, return_lse=True, kv_layout="HND" if form == "HND" else "NHD", **kw)
        want = literal(q, cache, table, causal=kw.get("causal", True), window_left=kw.get("window_left", -1))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_views_longer_than_a_tile_are_merged_as_copies_were(monkeypatch):
    from qkv.paged import requests

    monkeypatch.setattr(requests, "TILE_KEYS", 16)  # several tiles a request
    q, cache, table = _ranged([6, 20], [50, 37], 4)
    got = qkv.paged_attention(q, cache, *table, return_lse=True)
    for a, b in zip(got, literal(q, cache, table)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_every_row_is_written_though_the_output_starts_unfilled(monkeypatch):
    """Requests with no queries, no keys, and more queries than keys (rows before the first key see nothing): each row
    is its request's, even where the buffer held garbage."""
    real = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: real(self, *a, **kw).fill_(float("nan")))
    q, cache, table = _ranged([3, 0, 4, 2], [0, 5, 2, 9], 4)
    got = qkv.paged_attention(q, cache, *table, return_lse=True)
    want = literal(q, cache, table)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _request(i, j, mask, bias=None):
    q, k, v = torch.randn(1, 2, i, 4), torch.randn(1, 2, j, 4), torch.randn(1, 2, j, 4)
    return checks.request(q, k, v, score="scaled_dot", mask=mask, bias=bias, causal=False, scale=None, dropout=0.0,
                          return_weights=False)  # fmt: skip


@pytest.mark.parametrize("i, j, make, hides", [
    (6, 6, lambda: qkv.masks.causal(), False),
    (3, 9, lambda: qkv.masks.causal(), False),  # a chunk after its cache: the last query sees every key
    (6, 6, lambda: qkv.masks.window(2, 0), False),
    (3, 9, lambda: qkv.masks.offsets(None, -6), True),  # PyTorch's top-left is_causal: keys from 3 on hidden
    (3, 9, lambda: qkv.masks.window(1, 0), True),  # keys before the first query's window
    (6, 6, lambda: qkv.masks.lengths(torch.tensor([4])), True),
    (6, 6, lambda: qkv.masks.lengths(torch.tensor([4])) & qkv.masks.causal(), True),
])  # fmt: skip
def test_offset_ranges_that_hide_no_key_skip_the_outputs_check(i, j, make, hides):
    assert hidden_keys.ranges_hide_none(_request(i, j, make())) is not hides


def test_a_tensor_bias_is_always_checked():
    assert not hidden_keys.ranges_hide_none(_request(6, 6, qkv.masks.causal(), bias=torch.zeros(1, 1, 6, 6)))


def test_a_causal_inference_call_reads_no_sum_of_its_output(monkeypatch):
    real = torch.Tensor.sum
    sums = []
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, **kw: sums.append(self.shape) or real(self, *a, **kw))
    q, k, v = torch.randn(1, 4, 64, 8), torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8)
    with torch.no_grad():
        out = qkv.attention(q, k, v, causal=True)
    assert (1, 4, 64, 8) not in sums and torch.isfinite(out).all()


@pytest.mark.parametrize("P", [1, 4])
def test_prefill_chunks_in_one_contiguous_pool_run_as_one_segmented_call_and_equal_each_request_alone(P, monkeypatch):
    """Every chunk's pages one range of a contiguous pool (FlashInfer's ragged wrapper's one-row pages): one
    segmented call for all of them, with or without the lse, beside decoding steps, requests of no query, no key,
    or more queries than keys; the same rows as the attention written out per request."""
    from qkv.paged import requests, route

    qo_lens, kv_lens = [5, 0, 1, 9, 3, 2], [9, 4, 30, 7, 0, 13]  # a step, more queries than keys, a request of no key
    q, cache, table = _ranged(qo_lens, kv_lens, P)
    pools = (cache[:, 0].contiguous(), cache[:, 1].contiguous())
    calls, single = [], requests.request
    segmented = requests.run_segments
    monkeypatch.setattr(requests, "run_segments", lambda *a, **kw: calls.append(1) or segmented(*a, **kw))
    monkeypatch.setattr(route, "request", lambda *a, **kw: pytest.fail("a chunk ran alone") or single(*a, **kw))
    for kw in ({}, {"window_left": 3}, {"causal": False}):
        want = literal(q, cache, table, causal=kw.get("causal", True), window_left=kw.get("window_left", -1))
        out, lse = qkv.paged_attention(q, pools, *table, return_lse=True, **kw)
        alone = qkv.paged_attention(q, pools, *table, **kw)  # no lse asked: the segments need not compute one
        torch.testing.assert_close(out, want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(alone, want[0], rtol=1e-12, atol=1e-12)
        assert lse.is_contiguous()
    assert len(calls) == 6


def test_prefill_chunks_with_logit_terms_or_pages_apart_run_a_request_at_a_time(monkeypatch):
    """A soft cap (or ALiBi, a score_mod) or a request whose pages are not one range: each chunk its own call."""
    from qkv.paged import requests

    qo_lens, kv_lens = [5, 3], [9, 40]
    q, cache, table = _ranged(qo_lens, kv_lens, 4)
    pools = (cache[:, 0].contiguous(), cache[:, 1].contiguous())
    monkeypatch.setattr(requests, "run_segments", lambda *a, **kw: pytest.fail("segmented"))
    got = qkv.paged_attention(q, pools, *table, logits_soft_cap=5.0)
    torch.testing.assert_close(got, literal(q, cache, table, cap=5.0)[0], rtol=1e-12, atol=1e-12)
    broken = (table[0], table[1], table[2].flip(0), table[3])  # the second request's pages out of order
    got = qkv.paged_attention(q, pools, *broken)
    torch.testing.assert_close(got, literal(q, cache, broken)[0], rtol=1e-12, atol=1e-12)


def test_v_scale_scales_the_output_when_no_lse_is_returned():
    """``v_scale`` (FlashInfer's calibration) without ``return_lse``: a prefill chunk in one segmented call, and a
    decoding batch with a request of no key, compute no lse, and the output is still scaled (it raised on the None)."""
    for qo_lens, kv_lens in (([5, 3], [9, 40]), ([1, 1, 1], [7, 0, 12])):
        q, cache, table = _ranged(qo_lens, kv_lens, 4)
        pools = (cache[:, 0].contiguous(), cache[:, 1].contiguous())
        want = literal(q, cache, table)[0]
        torch.testing.assert_close(qkv.paged_attention(q, pools, *table, v_scale=2.5), 2.5 * want, rtol=1e-12, atol=1e-12)
        out, lse = qkv.paged_attention(q, pools, *table, v_scale=2.5, return_lse=True)
        torch.testing.assert_close(out, 2.5 * want, rtol=1e-12, atol=1e-12)


def test_no_read_copies_or_dequantises_more_than_a_tile_of_a_long_request(monkeypatch):
    """A request of 10,000 keys: its scattered pages copied, its consecutive int8 pages dequantised, and a shared
    prompt of 8,992 keys (its pages scattered, or int8), each a bounded piece at a time (4096 keys; int8 runs 8192),
    never the whole cache; the results equal the attention written out."""
    from qkv.paged import Int8Pages
    from qkv.paged.requests import TILE_KEYS

    P, g, d, n = 16, 2, 8, 10_000
    c = n // P
    pieces = []

    def counting(cls, name):
        real = getattr(cls, name)

        def read(self, *a):
            out = real(self, *a)
            pieces.append(out[0].numel() // (g * d))
            return out

        monkeypatch.setattr(cls, name, read)

    counting(pages_module.FloatPages, "take")
    counting(Int8Pages, "_widen")
    counting(Int8Pages, "_dequantise")
    gen = torch.Generator().manual_seed(3)
    N = 2 * c + 40
    cache = torch.randn(N, 2, P, g, d, generator=gen, dtype=torch.float64)
    perm = torch.randperm(N, generator=gen).tolist()
    int8 = Int8Pages(N, P, g, d, dtype=torch.float64)
    int8.write(torch.arange(N).repeat_interleave(P), torch.arange(P).repeat(N), cache[:, 0].reshape(-1, g, d),
               cache[:, 1].reshape(-1, g, d))  # fmt: skip
    widened = torch.stack(int8.range(0, N), 1)  # (N, 2, P, g, d): what the int8 pages hold
    shared = perm[: c - 62]  # a prompt of (c - 62) full pages, then each request's own 62
    tables = {
        "one request, scattered pages": ([perm[:c]], [1]),
        "one request, consecutive pages": ([list(range(c))], [1]),
        "a shared prompt, scattered": ([shared + perm[c : c + 62], shared + perm[c + 62 : c + 124]], [1, 1]),
    }
    for label, (lists, qo) in tables.items():
        table = (torch.tensor([0, *torch.tensor(qo).cumsum(0).tolist()]),
                 torch.tensor([0, *torch.tensor([len(x) for x in lists]).cumsum(0).tolist()]),
                 torch.tensor([p for x in lists for p in x]), torch.full((len(lists),), P))  # fmt: skip
        q = torch.randn(sum(qo), 4, d, generator=gen, dtype=torch.float64)
        for kv, stored in ((cache, cache), (int8, widened)):
            pieces.clear()
            got = qkv.paged_attention(q, kv, *table)
            want = _literal_small(q, stored, table)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
            limit = int8.run_group_keys if kv is int8 and "consecutive" in label else TILE_KEYS
            assert max(pieces, default=0) <= limit, (label, type(kv).__name__, max(pieces))


def _literal_small(q, cache, table):
    """Each request alone, any head count: its pages concatenated, a softmax (``literal``'s, for these sizes)."""
    qo, indptr, indices, last = table
    P, g, d = cache.shape[2], cache.shape[3], cache.shape[4]
    outs = []
    for r in range(len(qo) - 1):
        ids = indices[indptr[r] : indptr[r + 1]]
        n = (len(ids) - 1) * P + int(last[r])
        k = cache[ids, 0].reshape(-1, g, d)[:n].repeat_interleave(q.shape[1] // g, 1)
        v = cache[ids, 1].reshape(-1, g, d)[:n].repeat_interleave(q.shape[1] // g, 1)
        qr = q[qo[r] : qo[r + 1]]
        s = torch.einsum("thd,khd->htk", qr, k) * d**-0.5
        s = s + torch.where(torch.arange(n) <= torch.arange(n - len(qr), n)[:, None], 0.0, float("-inf"))
        outs.append(torch.einsum("htk,khd->thd", s.softmax(-1), v))
    return torch.cat(outs)
