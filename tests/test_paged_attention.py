"""``qkv.paged_attention`` against the same attention written literally on each request's contiguous keys.

Shape legend: ``T`` query rows, ``h`` query heads, ``g`` KV heads, ``d`` head size, ``P`` page
size, ``R`` requests; float64, to 1e-12.
"""


import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qkv

H, G, D = 4, 2, 8


def build(qo_lens, kv_lens, P, seed=0, shared=0, spare=3):
    """A random cache and table: pages in a random order, ``shared`` leading pages common to every request."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // P) for n in kv_lens]
    own = [c - (min(shared, c - 1) if shared else 0) for c in counts]
    total = sum(own) + shared + spare
    cache = torch.randn(total, 2, P, G, D, generator=gen, dtype=torch.float64)
    order = torch.randperm(total, generator=gen).tolist()
    prefix = order[:shared]
    free = order[shared:]
    indices, indptr, last = [], [0], []
    for n, c in zip(kv_lens, counts):
        mine = prefix[: min(shared, c - 1)] if shared else []
        while len(mine) < c:
            mine.append(free.pop())
        indices += mine
        indptr.append(len(indices))
        last.append(n - (c - 1) * P if c else 0)
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0).tolist()))
    q = torch.randn(sum(qo_lens), H, D, generator=gen, dtype=torch.float64)
    table = (qo_indptr, torch.tensor(indptr), torch.tensor(indices, dtype=torch.int32), torch.tensor(last, dtype=torch.int32))
    return q, cache, table


def literal(q, cache, table, *, causal=True, window_left=-1, cap=0.0, sinks=None, alibi=None, score_mod=None, scale=None):
    """Each request alone: its pages concatenated, the logits written out, a softmax."""
    qo_indptr, kv_indptr, kv_indices, last = table
    P = cache.shape[2]
    scale = D**-0.5 if scale is None else scale
    outs, lses = [], []
    for r in range(len(qo_indptr) - 1):
        qr = q[qo_indptr[r] : qo_indptr[r + 1]]  # (t, h, d)
        ids = kv_indices[kv_indptr[r] : kv_indptr[r + 1]].long()
        n = 0 if len(ids) == 0 else (len(ids) - 1) * P + int(last[r])
        k = cache[ids, 0].reshape(-1, G, D)[:n].repeat_interleave(H // G, 1)  # (n, h, d)
        v = cache[ids, 1].reshape(-1, G, D)[:n].repeat_interleave(H // G, 1)
        t = qr.shape[0]
        qp = torch.arange(n - t, n)[:, None]  # (t, 1)
        kp = torch.arange(n)[None, :]
        s = torch.einsum("thd,nhd->htn", qr, k) * scale  # (h, t, n)
        if cap:
            s = cap * torch.tanh(s / cap)
        if alibi is not None:
            s = s + alibi[:, None, None] * (kp - qp)[None]
        if score_mod is not None:
            hh = torch.arange(H)[:, None, None]
            s = score_mod(s, torch.full_like(hh, r), hh, qp[None], kp[None])
        seen = torch.ones(t, n, dtype=torch.bool)
        if causal:
            seen &= kp <= qp
        if window_left >= 0:
            seen &= kp >= qp - window_left
        s = s.masked_fill(~seen[None], float("-inf"))
        lse = torch.logsumexp(s, -1)  # (h, t)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks[:, None].to(lse.dtype))
        w = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("htn,nhd->thd", w, v))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


CASES = {
    "causal": {},
    "not causal": {"causal": False},
    "window": {"window_left": 5},
    "soft cap": {"cap": 2.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)},
    "alibi": {"alibi": torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)},
    "score_mod": {"score_mod": lambda s, b, h, q, kv: s + 0.1 * ((q - kv) % 3) - 0.05 * b},
    "scale": {"scale": 0.3},
}


def paged(q, cache, table, causal=True, window_left=-1, cap=0.0, sinks=None, alibi=None, score_mod=None, scale=None):
    return qkv.paged_attention(q, cache, *table, causal=causal, window_left=window_left, logits_soft_cap=cap,
                               sinks=sinks, alibi_slopes=alibi, score_mod=score_mod, sm_scale=scale, return_lse=True)  # fmt: skip


@pytest.mark.parametrize("P", [1, 16, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_equals_each_request_alone(P, case):
    gen = torch.Generator().manual_seed(P)
    R = 6
    kv_lens = [1, 0, *torch.randint(1, 300, (R - 2,), generator=gen).tolist()]
    qo_lens = [1, 0, 0, 1, 1, min(kv_lens[-1], 37)]  # decoding steps, no queries, a prefill chunk
    q, cache, table = build(qo_lens, kv_lens, P, seed=P)
    got = paged(q, cache, table, **CASES[case])
    want = literal(q, cache, table, **CASES[case])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["causal", "alibi", "soft cap", "sinks"])
def test_requests_sharing_a_prefix_equal_unshared_ones(case):
    """The cascade (shared pages attended once, merged by LSE) against each request alone, and against no sharing."""
    kv_lens, qo_lens = [70, 90, 49, 200, 33], [1, 1, 1, 1, 1]
    q, cache, table = build(qo_lens, kv_lens, 16, seed=3, shared=3)
    assert table[2][: 3].tolist() == table[2][table[1][1] : table[1][1] + 3].tolist()  # the same first pages
    got = paged(q, cache, table, **CASES[case])
    want = literal(q, cache, table, **CASES[case])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_ragged_batch_in_one_call_equals_its_parts():
    q, cache, table = build([40, 1, 1, 17, 1], [300, 5, 260, 17, 90], 16, seed=4)
    qo_indptr, kv_indptr, kv_indices, last = table
    whole, whole_lse = paged(q, cache, table)
    for r in range(5):
        part = (qo_indptr[r : r + 2] - qo_indptr[r], kv_indptr[r : r + 2] - kv_indptr[r],
                kv_indices[kv_indptr[r] : kv_indptr[r + 1]], last[r : r + 1])  # fmt: skip
        out, lse = paged(q[qo_indptr[r] : qo_indptr[r + 1]], cache, part)
        torch.testing.assert_close(whole[qo_indptr[r] : qo_indptr[r + 1]], out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(whole_lse[qo_indptr[r] : qo_indptr[r + 1]], lse, rtol=1e-12, atol=1e-12)


def test_float32_and_bfloat16_follow_float64():
    q, cache, table = build([1, 1, 9, 1], [100, 257, 40, 3], 16, seed=5)
    exact, _ = paged(q, cache, table)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        got, lse = paged(q.to(dtype), cache.to(dtype), table)
        assert got.dtype == dtype and lse.dtype == torch.float32
        assert (got.double() - exact).abs().max() < tol


@pytest.mark.parametrize("case", ["causal", "soft cap 30", "alibi", "window"])
def test_bfloat16_decoding_steps_follow_the_flash_rule(case):
    """bf16 pages and queries of |x| up to 4 (logits in the tens): against float64, at most twice as far off as eager
    attention in bf16 (float32 logits, weights rounded to bf16 before ``@ v``: qkv's reference backend on each
    request's keys), plus one bf16 rounding. The item products' logits were a bf16 product, rounded to 8 bits:
    a soft-capped step was 2x past the bound."""
    kw = {"soft cap 30": {"cap": 30.0}, "alibi": CASES["alibi"], "window": CASES["window"]}.get(case, {})
    q, cache, table = build([1, 1, 1], [700, 1500, 90], 16, seed=2)
    q, cache = ((x * 4).clamp(-4, 4).bfloat16() for x in (q, cache))
    exact, _ = paged(q.double(), cache.double(), table, **kw)
    got, _ = paged(q, cache, table, **kw)
    _, kv_indptr, kv_indices, last = table
    yard = []
    for r in range(3):
        ids = kv_indices[kv_indptr[r] : kv_indptr[r + 1]].long()
        n = (len(ids) - 1) * 16 + int(last[r])
        k, v = (cache[ids, s].reshape(-1, G, D)[:n].transpose(0, 1)[None] for s in (0, 1))  # (1, g, n, d)
        alibi = kw.get("alibi")
        bias = None if alibi is None else (alibi.view(H, 1, 1) * (torch.arange(n) - (n - 1))).bfloat16()[None]
        mask = qkv.masks.window(kw["window_left"], 0) if "window_left" in kw else None
        mod = qkv.SoftCap(kw["cap"]) if "cap" in kw else None
        yard.append(qkv.attention(q[r][None, :, None], k, v, bias=bias, mask=mask, score_mod=mod, backend="reference")[0, :, 0])
    yard = torch.stack(yard)
    bound = 2 * (yard.double() - exact).abs().max() + 2**-8 * exact.abs().max()
    assert (got.double() - exact).abs().max() <= bound


def test_errors_name_the_argument():
    q, cache, table = build([1, 2], [10, 20], 4)
    qo_indptr, kv_indptr, kv_indices, last = table
    bad = [
        ((q[:, :3],), ValueError, "not a multiple"),
        ((q, cache[:, :1]), ValueError, "kv_cache"),
        ((q, cache, torch.tensor([0, 1, 2])), ValueError, "qo_indptr"),
        ((q, cache, qo_indptr, kv_indptr, kv_indices, torch.tensor([0, 9])), ValueError, "kv_last_page_len"),
        ((q, cache, qo_indptr, kv_indptr, kv_indices + 100, last), ValueError, "kv_indices"),
        ((q, cache, qo_indptr, kv_indptr, kv_indices.float(), last), TypeError, "kv_indices"),
    ]
    for args, error, word in bad:
        full = list(args) + [cache, *table][len(args) - 1 :] if len(args) < 6 else list(args)
        with pytest.raises(error, match=word):
            qkv.paged_attention(*full)
    # (causal with more queries than keys is FlashInfer's fully masked rows: test_paged_dialect_audit)
    with pytest.raises(ValueError, match="window_left"):
        qkv.paged_attention(q, cache, *table, window_left=-2)
    with pytest.raises(ValueError, match="sinks"):
        qkv.paged_attention(q, cache, *table, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match=r"q: dtype torch.float32 but kv_cache computes in torch.float64"):
        qkv.paged_attention(q.float(), cache, *table)
    with pytest.raises(TypeError, match=r"kv_cache: keys and values in one dtype"):
        qkv.paged_attention(q, (cache[:, 0], cache[:, 1].float()), *table)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        qkv.paged_attention(q, cache, *table, causal="no")
    for name in ("sm_scale", "logits_soft_cap"):
        with pytest.raises(TypeError, match=f"{name}: expected a number, got str"):
            qkv.paged_attention(q, cache, *table, **{name: "a"})


@pytest.mark.parametrize("pages", ["float", "int8"])
def test_a_write_outside_the_pages_is_refused(pages):
    store = qkv.paged.Int8Pages(2, 4, 1, 8) if pages == "int8" else qkv.paged.pages.empty(2, 4, 1, 8, torch.float32, "cpu")
    k = torch.randn(1, 1, 8)
    for page, offset, error, word in ((0, 4, IndexError, "offset"), (0, -1, IndexError, "offset"), (2, 0, IndexError, "page")):
        with pytest.raises(error, match=word):
            store.write(torch.tensor([page]), torch.tensor([offset]), k, k)
    with pytest.raises(ValueError, match=r"k: expected \(1, 1, 8\)"):
        store.write(torch.tensor([0]), torch.tensor([0]), torch.randn(1, 1, 7), k)


@pytest.mark.parametrize("grad", ["q", "cache", "sinks", "alibi"])
@pytest.mark.parametrize("qo_lens", [[1], [1, 4], [1, 1]])
def test_a_backward_through_paged_attention_raises_instead_of_wrong_gradients(grad, qo_lens):
    """The decoding pass merges items by a log-sum-exp the fused kernel does not differentiate: its gradients
    were wrong (a query's off by 0.33 in 0.85), silently. The forward still runs with gradients enabled."""
    q, cache, table = build(qo_lens, [10, 20][: len(qo_lens)], 4)
    sinks, alibi = torch.zeros(H, dtype=torch.float64), torch.full((H,), 0.5, dtype=torch.float64)
    leaf = {"q": q, "cache": cache, "sinks": sinks, "alibi": alibi}[grad].requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of a tensor that requires grad read on the host
        out, lse = paged(q, cache, table, sinks=sinks, alibi=alibi)
    with torch.no_grad():
        want, want_lse = paged(q, cache, table, sinks=sinks, alibi=alibi)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert out.requires_grad and lse.requires_grad
    with pytest.raises(RuntimeError, match="has no backward.*torch.no_grad"):
        (out.sum() + lse.sum()).backward()
    assert leaf.grad is None
    with torch.no_grad():
        assert not paged(q, cache, table, sinks=sinks, alibi=alibi)[0].requires_grad


def test_the_tuple_form_and_blocks_of_pages_read_as_one_item_equal_the_definition():
    """(k_cache, v_cache), and requests holding aligned blocks of consecutive pages (read a block at a time)."""
    from qkv.paged import route as front
    from qkv.paged import items

    P, S = 4, items.BLOCK_PAGES
    assert items.item_pages(P) == S
    kv_lens = [3 * S * P + 5, S * P, 2 * P + 1, 9]
    gen = torch.Generator().manual_seed(8)
    pages, nxt = [], 0
    for n in kv_lens:  # each request from its own aligned block on
        nxt = -(-nxt // S) * S
        count = -(-n // P)
        pages.append(list(range(nxt, nxt + count)))
        nxt += count
    cache = torch.randn(-(-nxt // S) * S, 2, P, G, D, generator=gen, dtype=torch.float64)
    table = (torch.arange(len(kv_lens) + 1), torch.tensor([0, *torch.tensor([len(p) for p in pages]).cumsum(0).tolist()]),
             torch.tensor([p for ps in pages for p in ps]), torch.tensor([n - (-(-n // P) - 1) * P for n in kv_lens]))  # fmt: skip
    q = torch.randn(len(kv_lens), H, D, generator=gen, dtype=torch.float64)
    seen = []
    plan = front.items
    front.items = lambda *a: seen.append(plan(*a)) or seen[-1]
    try:
        for case in ("causal", "window", "alibi", "soft cap"):
            want = literal(q, cache, table, **CASES[case])
            for form in (cache, (cache[:, 0].contiguous(), cache[:, 1].contiguous())):
                got = paged(q, form, table, **CASES[case])
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    finally:
        front.items = plan
    assert seen and all(p.aligned and p.S == S for p in seen)


@pytest.mark.parametrize("where", ["cpu", "as off the cpu"])
@pytest.mark.parametrize("case", ["causal", "window", "alibi", "soft cap"])
@pytest.mark.parametrize("P", [4, 16])
def test_nan_in_unfilled_slots_and_unnamed_pages_never_reaches_an_output(case, P, where, monkeypatch):
    """A pool from ``torch.empty`` may hold nan anywhere no key was written: past each request's last key, in
    reserved pages after it, and in blocks between requests read as part of a range. The outputs are
    those of the same pool with those places zeroed. Off the CPU (where no value is read on the host: a
    GPU's stream would stall) the item products run without the CPU's fused kernels and zero unseen slots
    branch-free: the same outputs."""
    from qkv.paged import decode, decode_fused, route
    from qkv.paged.items import BLOCK_PAGES

    if where != "cpu":
        monkeypatch.setattr(decode, "concrete", lambda *xs: False)
        monkeypatch.setattr(decode_fused, "usable", lambda *a: False)
        monkeypatch.setattr(route, "runs_usable", lambda *a: False)

    S = BLOCK_PAGES
    gen = torch.Generator().manual_seed(P)
    kv_lens = [3 * P + 1, 2 * S * P + 5, 7, S * P]  # decoding steps: partial pages, partial blocks, a full block
    pages, nxt = [], 0
    for n in kv_lens:  # aligned blocks, one unnamed block between requests 1 and 2
        nxt = -(-nxt // S) * S + (S if len(pages) == 2 else 0)
        pages.append(list(range(nxt, nxt + -(-n // P))))
        nxt += -(-n // P)
    total = -(-nxt // S) * S
    clean = torch.zeros(total, 2, P, G, D, dtype=torch.float64)
    for ps, n in zip(pages, kv_lens):
        keys = torch.randn(len(ps) * P, 2, G, D, generator=gen, dtype=torch.float64)
        keys[n:] = 0
        clean[ps] = keys.view(len(ps), P, 2, G, D).transpose(1, 2)
    dirty = clean.clone()
    for ps, n in zip(pages, kv_lens):
        flat = dirty[ps].transpose(1, 2).reshape(len(ps) * P, 2, G, D)
        flat[n:] = float("nan")
        dirty[ps] = flat.view(len(ps), P, 2, G, D).transpose(1, 2)
    named = {p for ps in pages for p in ps}
    for p in range(total):
        if p not in named:
            dirty[p] = float("nan")
    table = (torch.arange(len(kv_lens) + 1), torch.tensor([0, *torch.tensor([len(p) for p in pages]).cumsum(0).tolist()]),
             torch.tensor([p for ps in pages for p in ps]), torch.tensor([n - (len(ps) - 1) * P for ps, n in zip(pages, kv_lens)]))  # fmt: skip
    q = torch.randn(len(kv_lens), H, D, generator=gen, dtype=torch.float64)
    want = literal(q, clean, table, **CASES[case])
    for form in (dirty, (dirty[:, 0].contiguous(), dirty[:, 1].contiguous())):
        got = paged(q, form, table, **CASES[case])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_nan_in_a_seen_key_reaches_its_own_request_only():
    """A nan a request sees makes its own output nan, as in the attention written out, and no other request's."""
    kv_lens, qo_lens = [40, 70, 33], [1, 1, 1]
    q, cache, table = build(qo_lens, kv_lens, 16, seed=4)
    ids = table[2][table[1][1] : table[1][2]].long()
    cache[ids[0], 1, 3] = float("nan")  # request 1's fourth value
    out, lse = paged(q, cache, table)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any() and not torch.isnan(lse[[0, 2]]).any()


@pytest.mark.parametrize("case", ["causal", "window", "alibi", "soft cap", "score_mod"])
def test_a_plan_run_for_several_layers_equals_a_call_per_layer(case, monkeypatch):
    """FlashInfer's plan and run: the table laid out once (items computed once), each layer's cache attended."""
    from qkv.paged import route

    kv_lens, qo_lens = [70, 90, 49, 200, 33], [1, 1, 5, 1, 1]
    q, cache, table = build(qo_lens, kv_lens, 16, seed=5)
    layers = [cache, cache.flip(-1).contiguous(), (2 * cache[:, 0].contiguous(), cache[:, 1].contiguous())]
    plan = qkv.paged.PagedPlan(*table, num_pages=cache.shape[0], page_size=16)
    laid_out = []
    original = route.items
    monkeypatch.setattr(route, "items", lambda *a: laid_out.append(1) or original(*a))
    opts = {k: v for k, v in CASES[case].items()}
    kw = dict(causal=opts.get("causal", True), window_left=opts.get("window_left", -1), logits_soft_cap=opts.get("cap", 0.0),
              alibi_slopes=opts.get("alibi"), score_mod=opts.get("score_mod"), return_lse=True)  # fmt: skip
    for layer in layers:
        got = plan.run(q, layer, **kw)
        want = literal(q, layer if isinstance(layer, torch.Tensor) else torch.stack(layer, 1), table, **opts)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert len(laid_out) <= 1  # decoding steps' items: once for the three layers (none with a score_mod)


def test_a_plan_refuses_a_call_it_was_not_made_for():
    q, cache, table = build([1, 1], [20, 9], 4, seed=6)
    plan = qkv.paged.PagedPlan(*table, num_pages=cache.shape[0], page_size=4)
    with pytest.raises(ValueError, match="query rows"):
        plan.run(q[:1], cache)
    with pytest.raises(ValueError, match="pages of"):
        plan.run(q, cache[:-1])
    with pytest.raises(ValueError, match="kv_indices"):
        qkv.paged.PagedPlan(*table, num_pages=2, page_size=4)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("mix", ["prefill and steps", "steps"])
def test_a_plan_is_the_table_when_it_was_made_whatever_the_caller_writes_into_its_buffer_after(dtype, mix):
    """An int64 ``kv_indices`` was kept as the caller's own tensor: refilled after the plan, a later run read the old
    pages where the first run had laid them out and the new ones elsewhere (prefill rows; other options)."""
    qo_lens = [1, 3, 1] if mix == "prefill and steps" else [1, 1, 1]
    q, cache, table = build(qo_lens, [20, 9, 13], 4, seed=8, spare=12)
    ids = table[2].to(dtype)
    planned = (table[0], table[1], ids, table[3])
    want_window = literal(q, cache, planned, window_left=3)
    want = literal(q, cache, planned)
    plan = qkv.paged.PagedPlan(*planned, num_pages=cache.shape[0], page_size=4)
    torch.testing.assert_close(plan.run(q, cache, window_left=3, return_lse=True), want_window, rtol=1e-12, atol=1e-12)
    ids.copy_(ids.flip(0))  # the caller's buffer refilled for another step
    torch.testing.assert_close(plan.run(q, cache, window_left=3, return_lse=True), want_window, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plan.run(q, cache, return_lse=True), want, rtol=1e-12, atol=1e-12)


def test_items_are_views_only_where_each_is_consecutive_pages_from_a_block_boundary():
    """A break in the page ids inside an item, an item off a block boundary or a block two items name: copies."""
    from qkv.paged.items import items
    from qkv.paged.table import page_table

    P = 16  # items of 16 pages

    def plan(*request_pages):
        ids = [p for ps in request_pages for p in ps]
        indptr = torch.tensor([0, *torch.tensor([len(ps) for ps in request_pages]).cumsum(0).tolist()])
        table = page_table(len(request_pages), 256, P, torch.arange(len(request_pages) + 1), indptr, torch.tensor(ids),
                           torch.full((len(request_pages),), P), "cpu")  # fmt: skip
        return items(list(range(len(request_pages))), [0] * len(request_pages), table, 256)

    whole = list(range(0, 20))  # blocks 0 and 1 (the second item: pages 16..19)
    assert plan(whole, list(range(32, 40))).block == [0, 1, 2]
    assert plan(list(range(0, 16)) + list(range(64, 70)), list(range(32, 40))).block == [0, 4, 2]  # a break between items
    assert not plan(list(range(0, 10)) + list(range(64, 70)), list(range(32, 40))).aligned  # a break inside an item
    assert not plan(list(range(1, 17)), list(range(32, 40))).aligned  # off a block boundary
    assert not plan(list(range(0, 5)), list(range(5, 9))).aligned  # the second off a block boundary
    assert not plan([0, 1, 2], [0, 1]).aligned  # one block, two items (a shared prefix's pages)


@st.composite
def paged_calls(draw):
    """Random tables: 1-6 requests of 0-70 keys (none, one, page boundaries, ragged last pages) and 0-8 queries each,
    decoding steps and prefill chunks together, page sizes 1 to 16, a shared prefix, every option at once."""
    R = draw(st.integers(1, 6))
    kv_lens = [draw(st.sampled_from([0, 1, draw(st.integers(2, 70))])) for _ in range(R)]
    qo_lens = [min(n, draw(st.sampled_from([0, 1, 1, draw(st.integers(2, 8))]))) for n in kv_lens]
    opts = {}
    if draw(st.booleans()):
        opts["causal"] = False
    if draw(st.booleans()):
        opts["window_left"] = draw(st.integers(0, 20))
    if draw(st.booleans()):
        opts["cap"] = 2.0
    if draw(st.booleans()):
        opts["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    if draw(st.booleans()):
        opts["alibi"] = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    if draw(st.integers(0, 3)) == 0:
        opts["score_mod"] = CASES["score_mod"]["score_mod"]
    if draw(st.booleans()):
        opts["scale"] = 0.3
    P = draw(st.sampled_from([1, 2, 3, 16]))
    shared = draw(st.sampled_from([0, 0, 1, 2]))
    return qo_lens, kv_lens, P, shared, opts, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=paged_calls())
def test_random_tables_equal_each_request_alone(call):
    qo_lens, kv_lens, P, shared, opts, seed = call
    q, cache, table = build(qo_lens, kv_lens, P, seed=seed, shared=shared if min(kv_lens) > shared * P else 0)
    got = paged(q, cache, table, **opts)
    want = literal(q, cache, table, **opts)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_off_the_cpu_a_step_reads_its_copied_pages_in_few_large_tiles():
    """Each operation of a tile is a kernel launch on a GPU: FlashInfer's one-tensor layout (whose ranges are copies)
    is read in tiles of ``DEVICE_TILE_KEYS`` there, ``TILE_KEYS`` on the CPU (whose caches hold a tile);
    the tuple layout's ranges are views on both, unbounded."""
    from qkv.paged.items import DEVICE_TILE_KEYS, TILE_KEYS, copy_tile_keys, tile_keys
    from qkv.paged.pages import FloatPages

    for device, want in (("cpu", TILE_KEYS), ("meta", DEVICE_TILE_KEYS)):
        pool = torch.zeros(8, 2, 16, 2, 4, device=device)
        assert tile_keys(FloatPages(pool)) == want
        assert tile_keys(FloatPages((pool[:, 0].contiguous(), pool[:, 1].contiguous()))) is None
        assert copy_tile_keys(torch.device(device)) == want
    assert DEVICE_TILE_KEYS > TILE_KEYS


def test_an_empty_pool_with_no_pages_named_is_an_empty_call():
    """No page in the cache and none named: nothing to attend (its error read "page ids must lie in 0 .. -1, got 0 .. 0",
    a range of ids no one passed)."""
    q = torch.randn(0, H, D, dtype=torch.float64)
    table = (torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0]), torch.zeros(0, dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32))
    out, lse = qkv.paged_attention(q, torch.zeros(0, 2, 16, G, D, dtype=torch.float64), *table, return_lse=True)
    assert out.shape == (0, H, D) and lse.shape == (0, H)


def _eager(q, cache, table, dtype):
    """Each request in float32 logits, its weights rounded to ``dtype`` before ``@ v`` (qkv's reference backend)."""
    qo_indptr, kv_indptr, kv_indices, last = table
    P, g, d = cache.shape[2], cache.shape[3], cache.shape[4]
    outs = []
    for r in range(len(qo_indptr) - 1):
        ids = kv_indices[kv_indptr[r] : kv_indptr[r + 1]].long()
        n = (len(ids) - 1) * P + int(last[r])
        k, v = (cache[ids, s].reshape(-1, g, d)[:n].repeat_interleave(q.shape[1] // g, 1).float() for s in (0, 1))
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[r].float(), k) * d**-0.5, -1)
        outs.append(torch.einsum("hn,nhd->hd", w.to(dtype).float(), v)[None])
    return torch.cat(outs).double()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["items", "runs", "shared prefix"])
def test_half_precision_parts_of_a_step_are_merged_before_rounding(layout, dtype):
    """A step's parts (items of 256 keys, runs of consecutive pages, a shared prefix) are merged by their
    log-sum-exp. Their outputs were each rounded to the pages' dtype first (the fused kernel's half output, a
    half merge): where parts cancel (values +c on some pages, -c on others, keys alike) 2-7x the flash rule's
    bound. Yardstick: each request eagerly, float32 logits, weights rounded before ``@ v``."""
    P, g, d = 16, 1, 16
    gen = torch.Generator().manual_seed(2)
    if layout == "items":
        pages, plus = [list(range(32))], set(range(16))  # one request of 512 keys: two items, the first +c
    elif layout == "runs":
        pages, plus = [[9, 10, 11, 12, 3, 4, 5, 6]], {9, 10, 11, 12}  # two runs of consecutive ids
    else:
        pages, plus = [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 6, 7]], {0, 1}  # two leading pages shared by 3 requests
    total = 1 + max(p for ps in pages for p in ps)
    k0 = torch.randn(d, generator=gen, dtype=torch.float64) * 2
    c = torch.rand(d, generator=gen, dtype=torch.float64) * 2 + 2
    cache = torch.zeros(total, 2, P, g, d, dtype=torch.float64)
    cache[:, 0] = (k0 + 0.3 * torch.randn(total, P, g, d, generator=gen, dtype=torch.float64)).clamp(-4, 4)
    for p in range(total):
        share = 1.0 if p in plus else -len(plus) / (len(pages[0]) - len(plus))
        cache[p, 1] = (share * c + 0.5 * torch.randn(P, g, d, generator=gen, dtype=torch.float64)).clamp(-4, 4)
    R = len(pages)
    q = ((torch.randn(R, 2, d, generator=gen, dtype=torch.float64) * 4).clamp(-4, 4) * 0.3).to(dtype)
    table = (torch.arange(R + 1), torch.tensor([0, *[len(ps) * (n + 1) for n, ps in enumerate(pages)]]),
             torch.tensor([p for ps in pages for p in ps], dtype=torch.int32), torch.full((R,), P, dtype=torch.int32))  # fmt: skip
    cache = cache.to(dtype)
    exact = qkv.paged_attention(q.double(), cache.double(), *table)
    got = qkv.paged_attention(q, cache, *table).double()
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    bound = 2 * (_eager(q, cache, table, dtype) - exact).abs().max() + eps * exact.abs().max()
    assert (got - exact).abs().max() <= bound


@pytest.mark.parametrize("P", [1, 16])
def test_float32_slopes_as_flashinfer_takes_them_keep_a_float64_calls_precision(P):
    """FlashInfer's and flash-attn's ALiBi slopes are float32: slope · distance was computed in float32,
    which cost a float64 call's logits about 2e-8 (the slopes now take the logits' precision)."""
    gen = torch.Generator().manual_seed(3)
    kv_lens = torch.randint(100, 300, (4,), generator=gen).tolist()
    qo_lens = [1, 1, 5, 1]  # decoding steps and a prefill chunk: both engines
    q, cache, table = build(qo_lens, kv_lens, P, seed=P)
    slopes = torch.rand(4, generator=gen) * 0.3  # float32, not powers of two
    got = paged(q, cache, table, alibi=slopes)
    want = literal(q, cache, table, alibi=slopes.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="alibi_slopes: expected a floating-point tensor"):
        paged(q, cache, table, alibi=torch.tensor([1, 2, 3, 4]))


@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("case", ["causal", "not causal", "window", "alibi", "soft cap", "sinks", "score_mod"])
def test_values_of_another_size_than_the_keys_as_flashinfers_head_dim_vo(P, case):
    """FlashInfer's paged prefill takes ``(k_cache, v_cache)`` of different head sizes (``head_dim_vo``); qkv refused
    them. Values of size ``E < D`` padded with zero columns to ``D`` give the same weights: the answer is the first
    ``E`` columns of that call's, which :func:`literal` computes."""
    E = 5
    gen = torch.Generator().manual_seed(P)
    kv_lens = [1, 0, *torch.randint(1, 300, (4,), generator=gen).tolist()]
    for qo_lens in ([1, 0, 0, 1, 1, min(kv_lens[-1], 37)], [1, 0, 1, 1, 1, 1]):  # a ragged call; decoding steps alone
        q, cache, table = build(qo_lens, kv_lens, P, seed=P)
        cache[:, 1, ..., E:] = 0
        got = paged(q, (cache[:, 0], cache[:, 1, ..., :E].contiguous()), table, **CASES[case])
        want = literal(q, cache, table, **CASES[case])
        assert got[0].shape == (q.shape[0], H, E)
        torch.testing.assert_close(got[0], want[0][..., :E], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


def test_a_paged_kv_cache_holds_values_of_their_own_size():
    cache = qkv.PagedKVCache(8, 4, G, D, value_dim=3, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    cache.add("a")
    step = cache.plan({"a": 6})
    k, v = torch.randn(6, G, D, generator=gen, dtype=torch.float64), torch.randn(6, G, 3, generator=gen, dtype=torch.float64)
    q = torch.randn(6, H, D, generator=gen, dtype=torch.float64)
    cache.write(0, step, k, v)
    want = qkv.attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], causal=True)
    torch.testing.assert_close(cache.attend(0, step, q), want[0].transpose(0, 1), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"value_dim: int8 \(quantized=True\)"):
        qkv.PagedKVCache(8, 4, G, D, value_dim=3, quantized=True)
