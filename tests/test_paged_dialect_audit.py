"""``qkv.paged_attention``, ``PagedPlan``, ``qkv.merge`` and ``paged_latent_attention`` read in FlashInfer's dialect.

Shape legend: ``T`` query rows, ``h`` query heads, ``g`` KV heads, ``d`` head size, ``P`` page
size, ``R`` requests, ``c`` latent size, ``r`` rotary size.

Each case is one FlashInfer states in its documentation or tests (flashinfer-ai/flashinfer:
``prefill.py``/``decode.py`` plan and run, ``cascade.merge_state``, ``mla.BatchMLAPagedAttentionWrapper``;
``tests/attention/test_batch_prefill_kernels.py`` runs ``qo_len > kv_len`` without ``causal``,
``test_deepseek_mla.py`` requests with ``kv_len = 0``), checked against a float64 reference
written from those tests' reference implementations (natural-log ``lse``: FlashInfer's is
base 2, a documented difference).
"""


import pytest
import torch

import qkv

H, G, D = 4, 2, 8


def table_of(qo_lens, kv_lens, P, seed=0, dtype=torch.float64, idtype=torch.int32):
    """A pool with pages in a random order, and FlashInfer's four tensors naming them (0 pages: last = 0)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // P) for n in kv_lens]
    total = sum(counts) + 2
    cache = torch.randn(total, 2, P, G, D, generator=gen, dtype=torch.float64).to(dtype)
    order = torch.randperm(total, generator=gen).tolist()
    indices, indptr, last = [], [0], []
    for n, c in zip(kv_lens, counts):
        indices += [order.pop() for _ in range(c)]
        indptr.append(len(indices))
        last.append(n - (c - 1) * P if c else 0)
    qo = [0] + torch.tensor(qo_lens).cumsum(0).tolist()
    q = torch.randn(sum(qo_lens), H, D, generator=gen, dtype=torch.float64).to(dtype)
    table = tuple(torch.tensor(x, dtype=idtype) for x in (qo, indptr, indices, last))
    return q, cache, table


def reference(q, cache, table, *, causal=True, window_left=-1, cap=0.0, sm_scale=None, sinks=None):
    """FlashInfer's tests' reference (one request at a time, its pages joined), in float64.

    Logits ``cap · tanh(sm_scale · q·k / cap)``; query ``t`` of ``qo_len`` at position
    ``kv_len - qo_len + t``; a key is seen when ``kp <= qp`` (causal) and ``kp >= qp - window_left``;
    sinks join the softmax's denominator as one more logit, unscaled. Rows with no key: out 0.
    """
    qo, kv, ids, last = (x.long() for x in table)
    P = cache.shape[2]
    scale = D**-0.5 if sm_scale is None else sm_scale
    outs, lses = [], []
    for r in range(len(qo) - 1):
        qr = q[qo[r] : qo[r + 1]].double()
        pages = ids[kv[r] : kv[r + 1]]
        n = 0 if len(pages) == 0 else (len(pages) - 1) * P + int(last[r])
        k = cache[pages, 0].double().reshape(-1, G, D)[:n].repeat_interleave(H // G, 1)
        v = cache[pages, 1].double().reshape(-1, G, D)[:n].repeat_interleave(H // G, 1)
        t = qr.shape[0]
        qp, kp = torch.arange(n - t, n)[:, None], torch.arange(n)[None, :]
        s = torch.einsum("thd,nhd->htn", qr, k) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        seen = torch.ones(t, n, dtype=torch.bool)
        if causal:
            seen &= kp <= qp
        if window_left >= 0:
            seen &= kp >= qp - window_left
        s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, -1) if n else torch.full((H, t), float("-inf"), dtype=torch.float64)
        if sinks is not None:
            lse = torch.logaddexp(lse, sinks.double()[:, None])
        w = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("htn,nhd->thd", w, v))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


def close(got, want, tol=1e-12):
    out, lse = got
    assert torch.allclose(out.double(), want[0], atol=tol, rtol=0), (out.double() - want[0]).abs().max()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want[1]))
    fin = torch.isfinite(want[1])
    assert torch.allclose(lse.double()[fin], want[1][fin], atol=tol, rtol=0)


# -- what FlashInfer does and qkv matched before this audit (kept as guards) ---------------------------------------


@pytest.mark.parametrize("idtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("window_left", [-1, 0, 3])
@pytest.mark.parametrize("cap", [0.0, 0.7])
def test_window_soft_cap_and_scale_follow_flashinfers_formulas(idtype, window_left, cap):
    """``kv_idx >= qo_idx - window_left`` (0: the query's own key only); ``cap·tanh(sm_scale·q·k / cap)``."""
    q, cache, table = table_of([1, 5, 1, 3], [9, 13, 1, 3], 4, idtype=idtype)
    for causal in (True, False):
        got = qkv.paged_attention(q, cache, *table, causal=causal, window_left=window_left, logits_soft_cap=cap,
                                  sm_scale=0.3, return_lse=True)  # fmt: skip
        close(got, reference(q, cache, table, causal=causal, window_left=window_left, cap=cap, sm_scale=0.3))


def test_sinks_join_the_denominator_unscaled_and_the_tuple_form_reads_alike():
    """FlashInfer's ``sink_softmax``: the sink is one more logit, not multiplied by ``sm_scale``."""
    q, cache, table = table_of([1, 4, 1], [7, 9, 16], 4)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    want = reference(q, cache, table, sinks=sinks, sm_scale=0.2)
    close(qkv.paged_attention(q, cache, *table, sinks=sinks, sm_scale=0.2, return_lse=True), want)
    close(qkv.paged_attention(q, (cache[:, 0], cache[:, 1]), *table, sinks=sinks, sm_scale=0.2, return_lse=True), want)


def test_a_request_with_no_queries_is_skipped():
    for kv_lens in ([5, 0, 6], [5, 4, 6]):  # a request with no queries, with and without pages
        q, cache, table = table_of([2, 0, 1], kv_lens, 4)
        close(qkv.paged_attention(q, cache, *table, return_lse=True), reference(q, cache, table))


def test_lse_is_per_row_and_head_in_float32_for_half_precision_queries():
    """FlashInfer's ``lse``: ``(qo_indptr[-1], num_qo_heads)``, float32."""
    q, cache, table = table_of([1, 3], [5, 7], 4, dtype=torch.bfloat16)
    out, lse = qkv.paged_attention(q, cache, *table, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (4, H)


@pytest.mark.parametrize("bad, word", [
    (lambda t: (t[0], torch.tensor([1, 4, 5]), *t[2:]), "kv_indptr: expected an offsets tensor starting at 0"),
    (lambda t: (t[0], torch.tensor([0, 4, 3]), *t[2:]), "kv_indptr: offsets must not decrease"),
    (lambda t: (torch.tensor([0, 2, 1]), *t[1:]), "qo_indptr: offsets must not decrease"),
    (lambda t: (*t[:3], torch.tensor([0, 3])), r"kv_last_page_len\[0\]: expected 1 to 4"),
    (lambda t: (*t[:3], torch.tensor([5, 3])), r"kv_last_page_len\[0\]: expected 1 to 4"),
    (lambda t: (*t[:3], torch.tensor([3])), "different numbers of requests"),
])  # fmt: skip
def test_a_table_flashinfer_documents_as_invalid_is_refused_by_name(bad, word):
    q, cache, table = table_of([1, 1], [13, 3], 4)
    with pytest.raises(ValueError, match=word):
        qkv.paged_attention(q, cache, *bad(table))


def test_merge_follows_merge_state_and_keeps_a_row_no_part_saw_at_zero():
    """``merge_state``: ``s = log(e^{s_a} + e^{s_b})``, ``v = (e^{s_a} v_a + e^{s_b} v_b) / e^s`` (natural log here)."""
    gen = torch.Generator().manual_seed(3)
    v_a, v_b = (torch.randn(5, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    s_a, s_b = (torch.randn(5, H, generator=gen, dtype=torch.float64) for _ in range(2))
    s_a[0], s_b[0], s_b[1] = float("-inf"), float("-inf"), float("-inf")
    out, lse = qkv.merge([v_a, v_b], [s_a, s_b])
    want = torch.logaddexp(s_a, s_b)
    w_a = torch.where(torch.isneginf(want), 0.0, torch.exp(s_a - want))
    w_b = torch.where(torch.isneginf(want), 0.0, torch.exp(s_b - want))
    assert torch.allclose(out, w_a[..., None] * v_a + w_b[..., None] * v_b, atol=1e-14)
    assert torch.allclose(lse, want, atol=1e-14) and torch.equal(torch.isneginf(lse), torch.isneginf(want))
    assert torch.equal(out[0], torch.zeros(H, D, dtype=torch.float64))
    assert torch.allclose(out[1], v_a[1])


# -- differences found, fixed -------------------------------------------------------------------------------------


@pytest.mark.parametrize("window_left", [-1, 2])
def test_without_causal_more_queries_than_keys_see_every_key(window_left):
    """FlashInfer runs ``qo_len > kv_len`` without ``causal`` (test_batch_prefill_kernels: qo_len 577 over
    kv_len 54; test_deepseek_mla: kv_len 0): every query sees the request's keys, a request with no
    keys gives ``out = 0``, ``lse = -inf``. qkv refused the table whatever ``causal`` was."""
    q, cache, table = table_of([7, 1, 3, 1, 2], [3, 0, 0, 5, 9], 4)
    got = qkv.paged_attention(q, cache, *table, causal=False, window_left=window_left, return_lse=True)
    close(got, reference(q, cache, table, causal=False, window_left=window_left))
    plan = qkv.paged.PagedPlan(*table, num_pages=cache.shape[0], page_size=4)
    close(plan.run(q, cache, causal=False, window_left=window_left, return_lse=True),
          reference(q, cache, table, causal=False, window_left=window_left))  # fmt: skip


@pytest.mark.parametrize("window_left", [-1, 1])
def test_with_causal_rows_before_the_first_key_see_nothing(window_left):
    """FlashInfer's ``test_paged_prefill_fully_masked_rows`` (#4452): causal, ``qo_len = 34 > kv_len = 1``,
    bottom-right aligned: the first 33 rows see no key (``out = 0``, ``lse = -inf``), the last sees the key.
    qkv refused the table (an earlier audit read FlashInfer's skipped tests as "unsupported")."""
    q, cache, table = table_of([34, 3, 1, 2], [1, 2, 5, 0], 1)
    want = reference(q, cache, table, window_left=window_left)
    assert torch.isneginf(want[1][:33]).all() and torch.isfinite(want[1][33]).all()
    close(qkv.paged_attention(q, cache, *table, window_left=window_left, return_lse=True), want)
    plan = qkv.paged.PagedPlan(*table, num_pages=cache.shape[0], page_size=1)
    close(plan.run(q, cache, window_left=window_left, return_lse=True), want)


def test_paged_latent_attention_without_causal_takes_requests_with_no_keys():
    """FlashInfer's MLA test runs ``kv_len = 0`` requests (out 0) and ``qo_len > kv_len`` without causal."""
    gen = torch.Generator().manual_seed(5)
    P, h, c, r = 4, 3, 6, 2
    ckv, kpe = torch.randn(6, P, c, generator=gen, dtype=torch.float64), torch.randn(6, P, r, generator=gen, dtype=torch.float64)
    q_nope, q_pe = torch.randn(5, h, c, generator=gen, dtype=torch.float64), torch.randn(5, h, r, generator=gen, dtype=torch.float64)
    qo, kv, ids, kv_len = torch.tensor([0, 2, 5]), torch.tensor([0, 0, 1]), torch.tensor([4]), torch.tensor([0, 2])
    out, lse = qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, qo, kv, ids, kv_len, sm_scale=0.5, causal=False,
                                          return_lse=True)  # fmt: skip
    assert torch.equal(out[:2], torch.zeros(2, h, c, dtype=torch.float64)) and torch.isneginf(lse[:2]).all()
    s = 0.5 * (torch.einsum("thc,nc->thn", q_nope[2:], ckv[4, :2]) + torch.einsum("thr,nr->thn", q_pe[2:], kpe[4, :2]))
    assert torch.allclose(out[2:], torch.einsum("thn,nc->thc", torch.softmax(s, -1), ckv[4, :2]), atol=1e-12)
    assert torch.allclose(lse[2:], torch.logsumexp(s, -1), atol=1e-12)


@pytest.mark.parametrize("form", ["one tensor", "tuple"])
def test_an_hnd_cache_is_read_with_kv_layout_and_a_wrong_layout_name_is_refused(form):
    """FlashInfer's wrappers take ``kv_layout="HND"``: pages ``(g, P, d)``. With ``P == g`` the shapes cannot
    tell it from NHD: qkv read such a cache as NHD, silently wrong (by 1.96 here), having no way to be told."""
    q, cache, table = table_of([1, 3, 1, 1], [5, 7, 8, 8], 2)  # P = g = 2; requests 2 and 3 decode
    hnd = cache.transpose(2, 3).contiguous()  # (N, 2, g, P, d)
    kv = hnd if form == "one tensor" else (hnd[:, 0], hnd[:, 1])
    want = reference(q, cache, table)
    close(qkv.paged_attention(q, kv, *table, kv_layout="HND", return_lse=True), want)
    plan = qkv.paged.PagedPlan(*table, num_pages=cache.shape[0], page_size=2)
    close(plan.run(q, kv, kv_layout="HND", return_lse=True), want)
    with pytest.raises(ValueError, match="kv_layout: expected 'NHD' or 'HND'"):
        qkv.paged_attention(q, kv, *table, kv_layout="nhd")
    with pytest.raises(ValueError, match="kv_layout"):
        qkv.paged_attention(q, qkv.paged.Int8Pages(4, 2, G, D), *table, kv_layout="HND")


def test_kv_indices_longer_than_kv_indptr_names_keep_their_tail_unread():
    """FlashInfer reads ``kv_indices[:kv_indptr[-1]]`` only (its MLA plan documents ``[kv_indptr[-1]]`` "or larger";
    serving engines pass a buffer with a tail of ``torch.empty``): qkv refused any tail, even in range."""
    q, cache, table = table_of([1, 3, 1], [5, 7, 4], 4)
    tail = torch.tensor([-1, 10**6, 3], dtype=table[2].dtype)
    longer = (table[0], table[1], torch.cat((table[2], tail)), table[3])
    want = reference(q, cache, table)
    close(qkv.paged_attention(q, cache, *longer, return_lse=True), want)
    plan = qkv.paged.PagedPlan(*longer, num_pages=cache.shape[0], page_size=4)
    close(plan.run(q, cache, return_lse=True), want)
    with pytest.raises(ValueError, match=r"kv_indptr: the last offset \(5\) is past the end of kv_indices \(3\)"):
        qkv.paged_attention(q, cache, table[0], table[1], table[2][:3], table[3])


def latent_case(kv_lens, pages, qo_lens, r=2, seed=7):
    """MLA caches with ``pages[n]`` pages for request ``n`` (at least its keys need), and FlashInfer's MLA table."""
    gen = torch.Generator().manual_seed(seed)
    P, h, c = 4, 3, 6
    total = sum(pages) + 1
    ckv = torch.randn(total, P, c, generator=gen, dtype=torch.float64)
    kpe = torch.randn(total, P, r, generator=gen, dtype=torch.float64)
    ids = torch.randperm(total, generator=gen)[: sum(pages)]
    T = sum(qo_lens)
    q_nope = torch.randn(T, h, c, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(T, h, r, generator=gen, dtype=torch.float64)
    qo = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    kv = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    return q_nope, q_pe, ckv, kpe, qo, kv, ids.int(), torch.tensor(kv_lens, dtype=torch.int32)


def latent_reference(q_nope, q_pe, ckv, kpe, qo, kv, ids, kv_len, sm_scale, causal):
    """test_deepseek_mla's ``attention_ref``: logits ``sm_scale·(q_nope·ckv + q_pe·kpe)`` over the first ``kv_len``
    slots of the request's pages, bottom-right causal; a row with no key: ``out = 0``, ``lse = -inf``."""
    outs, lses = [], []
    for n in range(len(kv_len)):
        page = ids[kv[n] : kv[n + 1]].long()
        L = int(kv_len[n])
        n_slots = len(page) * ckv.shape[1]
        c_r, k_r = ckv[page].reshape(n_slots, -1)[:L], kpe[page].reshape(n_slots, kpe.shape[-1])[:L]
        rows = slice(int(qo[n]), int(qo[n + 1]))
        s = sm_scale * (torch.einsum("thc,nc->thn", q_nope[rows], c_r) + torch.einsum("thr,nr->thn", q_pe[rows], k_r))
        t = s.shape[0]
        if causal:
            s = s.masked_fill((torch.arange(L)[None, :] > torch.arange(L - t, L)[:, None])[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1) if L else torch.full(s.shape[:2], float("-inf"), dtype=s.dtype)
        w = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("thn,nc->thc", w, c_r))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("causal", [True, False])
def test_paged_latent_attention_reads_only_the_first_kv_len_slots_of_a_requests_pages(causal):
    """FlashInfer's MLA plan takes ``kv_len`` and ``kv_indptr`` apart (its scheduler bounds a request by ``kv_len``
    and reads pages from ``kv_indptr[r]``): pages past a request's keys are not read. qkv refused
    ``kv_len <= (pages - 1) · P`` (a request holding a page it has not begun to fill)."""
    args = latent_case([5, 0, 9, 3], [3, 1, 3, 1], [2, 0 if causal else 2, 1, 3])
    want = latent_reference(*args, sm_scale=0.4, causal=causal)
    got = qkv.paged_latent_attention(*args, sm_scale=0.4, causal=causal, return_lse=True)
    close(got, want)
    with pytest.raises(ValueError, match=r"kv_len\[0\]: 13 keys but 3 pages of 4"):
        qkv.paged_latent_attention(*args[:7], torch.tensor([13, 0, 9, 3]), sm_scale=0.4, causal=causal)


def test_paged_latent_attention_takes_no_rotary_part_and_causal_rows_before_the_first_key():
    """FlashInfer's MLA plan: "head_dim_kpe ... Zero is supported for NoPE MLA"; causal rows before a request's
    first key see nothing (as its paged prefill, #4452)."""
    for r in (0, 2):
        args = latent_case([2, 7], [1, 2], [4, 2], r=r)
        close(qkv.paged_latent_attention(*args, sm_scale=0.3, return_lse=True),
              latent_reference(*args, sm_scale=0.3, causal=True))  # fmt: skip


def test_alibi_gives_flashinfers_out_and_an_lse_at_true_positions():
    """FlashInfer's ALiBi logit is ``sm_scale·q·k + slope·(kv_idx - q_idx)``, ``q_idx`` the query's index in its chunk
    (0 in decode; variants.cuh, prefill.cuh): a constant per row away from qkv's ``slope·(kp - qp)``, so ``out``
    agrees and qkv's ``lse`` is FlashInfer's less ``slope·(kv_len - qo_len)`` (documented, deliberate: qkv's lse
    merges across chunks)."""
    q, cache, table = table_of([1, 4, 1], [7, 9, 16], 4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    out, lse = qkv.paged_attention(q, cache, *table, alibi_slopes=slopes, sm_scale=0.3, return_lse=True)
    qo, kv, ids, last = (x.long() for x in table)
    for r in range(3):
        n = int((kv[r + 1] - kv[r] - 1) * 4 + last[r])
        pages = ids[kv[r] : kv[r + 1]]
        k = cache[pages, 0].reshape(-1, G, D)[:n].repeat_interleave(H // G, 1)
        v = cache[pages, 1].reshape(-1, G, D)[:n].repeat_interleave(H // G, 1)
        rows = slice(int(qo[r]), int(qo[r + 1]))
        t = rows.stop - rows.start
        s = 0.3 * torch.einsum("thd,nhd->htn", q[rows], k) + slopes[:, None, None] * (
            torch.arange(n)[None, :] - torch.arange(t)[:, None])  # fmt: skip
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None], float("-inf"))
        fi_lse = torch.logsumexp(s, -1).T
        assert torch.allclose(out[rows], torch.einsum("htn,nhd->thd", torch.softmax(s, -1), v), atol=1e-12)
        assert torch.allclose(lse[rows], fi_lse - slopes * (n - t), atol=1e-12)


def test_merge_of_no_parts_is_refused_where_merge_states_gives_zeros():
    """``merge_states`` with ``num_index_sets = 0`` writes ``v = 0``, ``s = -inf`` (its tensors carry the shape);
    ``qkv.merge`` takes lists, and an empty list has no shape: refused by name (documented)."""
    with pytest.raises(ValueError, match="at least one"):
        qkv.merge([], [])


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def in_runs(qo_lens, kv_lens, P, seed=0):
    """A table whose requests each hold one run of consecutive pages from an odd id (not an item's block)."""
    q, cache, (qo, _, _, _) = table_of(qo_lens, kv_lens, P, seed)
    counts = [-(-n // P) for n in kv_lens]
    indices, indptr, at = [], [0], 1
    for c in counts:
        indices += range(at, at + c)
        indptr.append(len(indices))
        at += c + 1
    cache = torch.randn(at + 1, 2, P, G, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    last = [n - (c - 1) * P for n, c in zip(kv_lens, counts)]
    return q, cache, (qo, *(torch.tensor(x, dtype=torch.int32) for x in (indptr, indices, last)))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("layout", ["tensor", "tuple", "HND", "runs"])
@pytest.mark.parametrize("qo_lens", [[1, 1, 1], [1, 5, 0]], ids=["steps", "mixed"])
def test_float8_pages_under_a_wider_q_equal_the_attention_over_the_pages_widened(fp8, layout, qo_lens):
    """FlashInfer reads float8 pages (``kv_data_type`` float8) under a float16/bfloat16 ``q``; every float8 number is
    exact in float64, so a float64 ``q`` over float8 pages equals the reference over the pages widened to 1e-12,
    on each way the pages are read (views of aligned items, copies, runs of consecutive pages, prefill tiles)."""
    kv_lens = [37, 5, 20]
    if layout == "runs":
        q, cache, table = in_runs(qo_lens, kv_lens, 4)
    else:
        q, cache, table = table_of(qo_lens, kv_lens, 4)
    stored = cache.to(fp8)
    kv = stored
    if layout == "tuple":
        kv = (stored[:, 0].contiguous(), stored[:, 1].contiguous())
    elif layout == "HND":
        kv = stored.transpose(2, 3).contiguous()
    got = qkv.paged_attention(q, kv, *table, return_lse=True, kv_layout="HND" if layout == "HND" else "NHD")
    close(got, reference(q, stored.double(), table))


@pytest.mark.parametrize("fp8", FP8)
def test_float8_pages_in_aligned_blocks_read_as_the_pages_widened(fp8, monkeypatch):
    """``qkv.PagedKVCache`` hands out aligned blocks; requests grown side by side hold several (the item pass reads
    them as ranges of blocks); float8 pages there are read a tile at a time, converted, and equal the reference
    over the pages widened."""
    P = 4
    lengths = [70, 9, 130]
    cache = qkv.PagedKVCache(256, P, G, D, dtype=torch.float64)
    for r, n in enumerate(lengths):
        cache.add(r)
    cache.plan({r: min(n, 60) for r, n in enumerate(lengths)})  # a block of 16 pages each, then the rest after them
    cache.plan({r: n - 60 for r, n in enumerate(lengths) if n > 60})
    pages = [cache.pages_of(r) for r in range(len(lengths))]
    counts = [len(ps) for ps in pages]
    table = (torch.arange(len(lengths) + 1, dtype=torch.int32),
             torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32),
             torch.tensor([p for ps in pages for p in ps], dtype=torch.int32),
             torch.tensor([n - (c - 1) * P for n, c in zip(lengths, counts)], dtype=torch.int32))  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    stored = torch.randn(256, 2, P, G, D, generator=gen, dtype=torch.float64).to(fp8)
    q = torch.randn(len(lengths), H, D, generator=gen, dtype=torch.float64)
    kv = (stored[:, 0].contiguous(), stored[:, 1].contiguous())
    from qkv.paged import route

    aligned, decode = [], route.decode
    monkeypatch.setattr(route, "decode", lambda q, qpos, plan, *a: aligned.append(plan.aligned) or decode(q, qpos, plan, *a))
    close(qkv.paged_attention(q, kv, *table, return_lse=True), reference(q, stored.double(), table))
    assert aligned == [True]  # the item pass's ranges of aligned blocks, not copies or runs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_half_precision_query_over_float8_pages_follows_the_widened_reference(dtype):
    """The dialect's own case: a float16 or bfloat16 ``q`` over float8 pages, computed in float32 and rounded once."""
    q, cache, table = table_of([1, 3, 1], [5, 7, 40], 4, dtype=dtype)
    stored = cache.to(torch.float8_e4m3fn)
    out, lse = qkv.paged_attention(q, stored, *table, return_lse=True)
    want = reference(q, stored.double(), table)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}[dtype]
    assert torch.allclose(out.double(), want[0], atol=tol), (out.double() - want[0]).abs().max()
    assert torch.allclose(lse.double(), want[1], atol=tol), (lse.double() - want[1]).abs().max()


@pytest.mark.parametrize("options", [{}, {"logits_soft_cap": 0.5}, {"window_left": 3}, {"sinks": True}],
                         ids=["plain", "soft_cap", "window", "sinks"])  # fmt: skip
def test_k_scale_and_v_scale_are_flashinfers_calibration_scales(options):
    """FlashInfer's ``k_scale`` multiplies ``sm_scale`` (the logits, the soft cap's argument and the ``lse``
    with it) and ``v_scale`` the output after the kernel (after the sinks; the ``lse`` unscaled)."""
    q, cache, table = table_of([1, 4, 1], [9, 12, 33], 4)
    stored = cache.to(torch.float8_e5m2)
    opts = dict(options)
    sinks = torch.linspace(-1, 1, H, dtype=torch.float64) if opts.pop("sinks", False) else None
    got = qkv.paged_attention(q, stored, *table, k_scale=0.37, v_scale=2.5, sm_scale=0.6, sinks=sinks,
                              return_lse=True, **opts)  # fmt: skip
    out, lse = reference(q, stored.double(), table, sm_scale=0.6 * 0.37, sinks=sinks,
                         cap=opts.get("logits_soft_cap", 0.0), window_left=opts.get("window_left", -1))  # fmt: skip
    close(got, (2.5 * out, lse))
    plan = qkv.paged.PagedPlan(*table, num_pages=cache.shape[0], page_size=4)
    close(plan.run(q, stored, k_scale=0.37, v_scale=2.5, sm_scale=0.6, sinks=sinks, return_lse=True, **opts), (2.5 * out, lse))


@pytest.mark.parametrize("bad, error", [("k_scale", TypeError), ("v_scale", TypeError), ("k_nan", ValueError),
                                        ("v_inf", ValueError), ("k_tensor", TypeError)])  # fmt: skip
def test_bad_calibration_scales_are_named(bad, error):
    q, cache, table = table_of([1], [5], 4)
    kwargs = {"k_scale": {"k_scale": "1"}, "v_scale": {"v_scale": [1.0]}, "k_nan": {"k_scale": float("nan")},
              "v_inf": {"v_scale": float("inf")}, "k_tensor": {"k_scale": torch.ones(2)}}[bad]  # fmt: skip
    with pytest.raises(error, match=bad[0] + "_scale"):
        qkv.paged_attention(q, cache, *table, **kwargs)


def test_calibration_scales_may_be_one_element_tensors():
    """FlashInfer's prefill takes ``k_scale``/``v_scale`` as a float or a tensor (``Union[float, torch.Tensor]``)."""
    q, cache, table = table_of([1, 3], [5, 9], 4)
    stored = cache.to(torch.float8_e4m3fn)
    want = qkv.paged_attention(q, stored, *table, k_scale=0.5, v_scale=1.5, return_lse=True)
    close(qkv.paged_attention(q, stored, *table, k_scale=torch.tensor(0.5), v_scale=torch.tensor([1.5]), return_lse=True),
          tuple(x.double() for x in want))  # fmt: skip


@pytest.mark.parametrize("fp8", FP8)
def test_a_float8_query_is_refused_by_name(fp8):
    """FlashInfer's float8 ``q`` goes with its fp8 tensor-core kernels and a ``q_scale``; here the pages are widened
    to ``q``'s dtype, so a float8 ``q`` is refused by name (it failed inside PyTorch: "Promotion for Float8 Types")."""
    q, cache, table = table_of([1, 3], [5, 7], 4, dtype=torch.float16)
    with pytest.raises(TypeError, match="read under a float16, bfloat16, float32 or float64 q"):
        qkv.paged_attention(q.to(fp8), cache.to(fp8), *table)


def test_writes_into_float8_pages_round_to_them():
    """``FloatPages.write`` (a serving loop's append) stores a token rounded to the pages' float8, as FlashInfer's
    ``append_paged_kv_cache`` casts into an fp8 cache; reads give it back widened."""
    from qkv.paged.pages import as_pages

    stored = torch.zeros(3, 2, 4, G, D, dtype=torch.float8_e4m3fn)
    pages = as_pages(stored, "NHD", torch.float32)
    k = torch.randn(2, G, D)
    pages.write(torch.tensor([1, 2]), torch.tensor([0, 3]), k, 2 * k)
    K, V = pages.take(torch.tensor([1, 2]))
    assert K.dtype == torch.float32 and stored.dtype == torch.float8_e4m3fn
    assert torch.equal(K[0, 0], k[0].to(torch.float8_e4m3fn).float()) and torch.equal(V[1, 3], (2 * k[1]).to(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("query_dtype", [torch.float64, torch.bfloat16])
def test_a_paged_kv_cache_of_float8_pages_is_read_as_each_call_s_queries(query_dtype):
    """``PagedKVCache(dtype=float8)``: tokens written are rounded to float8, and each call reads the pages as its
    own q's dtype (float64 here: equal to the attention over the rounded tokens to 1e-12)."""
    P, lengths = 4, {"a": 5, "b": 9}
    cache = qkv.PagedKVCache(64, P, G, D, dtype=torch.float8_e4m3fn)
    for r in lengths:
        cache.add(r)
    step = cache.plan(lengths)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(14, G, D, generator=gen, dtype=torch.float64) for _ in range(2))
    cache.write(0, step, k, v)
    q = torch.randn(14, H, D, generator=gen, dtype=torch.float64)
    out = cache.attend(0, step, q.to(query_dtype))
    assert out.dtype == query_dtype
    k8, v8 = (x.to(torch.float8_e4m3fn).double() for x in (k, v))
    want = []
    for lo, n in ((0, 5), (5, 9)):
        s = torch.einsum("thd,nhd->htn", q[lo : lo + n], k8[lo : lo + n].repeat_interleave(H // G, 1)) * D**-0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want.append(torch.einsum("htn,nhd->thd", s.softmax(-1), v8[lo : lo + n].repeat_interleave(H // G, 1)))
    tol = 1e-12 if query_dtype == torch.float64 else 3e-2
    assert torch.allclose(out.double(), torch.cat(want), atol=tol), (out.double() - torch.cat(want)).abs().max()


@pytest.mark.parametrize("kind", ["quantized", "latent"])
def test_float8_is_refused_where_a_pool_dequantises_or_holds_latents(kind):
    options = {"quantized": True} if kind == "quantized" else {"latent_dim": 4}
    with pytest.raises(TypeError, match="float8 cache of keys and values"):
        qkv.PagedKVCache(8, 4, 1, 8, dtype=torch.float8_e4m3fn, **options)
    with pytest.raises(TypeError, match="16 bits or more"):
        qkv.paged.Int8Pages(8, 4, 1, 8, dtype=torch.float8_e5m2)


@pytest.mark.parametrize("fp8", FP8)
def test_a_value_beyond_float8_s_range_is_saturated_when_written(fp8):
    """``float8_e5m2`` overflows to inf (every output it reached was nan); a write saturates it to the format's
    largest, as PyTorch's ``float8_e4m3fn`` conversion does; a nan stays nan."""
    cache = qkv.PagedKVCache(4, 4, 1, 8, dtype=fp8)
    cache.add("a")
    step = cache.plan({"a": 3})
    k = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(0))
    k[1, 0, 0], k[2, 0, 1] = 1e6, -1e6
    cache.write(0, step, k, k.clone())
    keys = cache.layer(0)[0][cache.pages_of("a")[0]].float()  # (P, g, d) of FlashInfer's tuple form
    top = torch.finfo(fp8).max
    assert keys[1, 0, 0] == top and keys[2, 0, 1] == -top
    assert not cache.attend(0, step, torch.randn(3, 2, 8)).isnan().any()


def test_numpy_numbers_are_taken_for_window_left_and_the_latent_scale():
    """FlashInfer takes any int for ``window_left`` and any float for MLA's ``sm_scale``; numpy's were refused."""
    np = pytest.importorskip("numpy")
    q, cache, table = table_of([1, 3], [9, 6], 4)
    close(qkv.paged_attention(q, cache, *table, window_left=np.int64(3), return_lse=True),
          reference(q, cache, table, window_left=3))  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    ckv, kpe = torch.randn(4, 4, 6, generator=gen, dtype=torch.float64), torch.randn(4, 4, 2, generator=gen, dtype=torch.float64)
    q_nope, q_pe = torch.randn(1, 2, 6, generator=gen, dtype=torch.float64), torch.randn(1, 2, 2, generator=gen, dtype=torch.float64)
    args = (q_nope, q_pe, ckv, kpe, torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([3, 1]), torch.tensor([6]))
    assert torch.equal(qkv.paged_latent_attention(*args, sm_scale=np.float32(0.25)),
                       qkv.paged_latent_attention(*args, sm_scale=0.25))  # fmt: skip


def test_float8_latents_are_refused_by_name():
    """FlashInfer's MLA reads a float8 latent cache; qkv does not, and said "give q the cache's dtype", advice that
    then failed inside PyTorch ("Promotion for Float8 Types is not supported")."""
    ckv, kpe = torch.zeros(4, 4, 6).to(torch.float8_e4m3fn), torch.zeros(4, 4, 2).to(torch.float8_e4m3fn)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        q_nope, q_pe = torch.zeros(1, 2, 6).to(dtype), torch.zeros(1, 2, 2).to(dtype)
        with pytest.raises(TypeError, match=r"ckv_cache, kpe_cache: torch.float8_e4m3fn latents .* not supported"):
            qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, torch.tensor([0, 1]), torch.tensor([0, 1]),
                                       torch.tensor([0]), torch.tensor([3]), sm_scale=0.3)  # fmt: skip
