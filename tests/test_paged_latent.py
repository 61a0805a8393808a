"""``qkv.paged_latent_attention`` (FlashInfer's MLA pages) against the attention written out per request,
and a ``qkv.MultiHeadLatentAttention`` decoding step over pages against the same step over its own cache.

Shape legend: ``T`` query rows, ``h`` query heads, ``c`` latent size, ``r`` rotary size, ``P``
page size, ``R`` requests; float64, to 1e-12.
"""

import math

import pytest
import torch

import qkv
from qkv.paged import LatentPages

H, C, R_DIM = 4, 12, 4


def build(qo_lens, kv_lens, P, seed=0, one_buffer=False, spare=3):
    """Random MLA pools and a table with the pages in a random order; ``one_buffer``: the two pools are halves of one."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // P) for n in kv_lens]
    total = sum(counts) + spare
    buf = torch.randn(total, P, C + R_DIM, generator=gen, dtype=torch.float64)
    ckv, kpe = (buf[..., :C], buf[..., C:]) if one_buffer else (buf[..., :C].contiguous(), buf[..., C:].contiguous())
    order = torch.randperm(total, generator=gen).tolist()
    indices, indptr = [], [0]
    for c in counts:
        indices += [order.pop() for _ in range(c)]
        indptr.append(len(indices))
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()])
    T = sum(qo_lens)
    q_nope = torch.randn(T, H, C, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(T, H, R_DIM, generator=gen, dtype=torch.float64)
    table = (qo_indptr, torch.tensor(indptr), torch.tensor(indices, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32))
    return q_nope, q_pe, ckv, kpe, table


def literal(q_nope, q_pe, ckv, kpe, table, scale, causal=True):
    """Each request alone: its latent keys gathered, the logits ``q_nope·ckv + q_pe·kpe`` written out, a softmax."""
    qo_indptr, kv_indptr, kv_indices, kv_len = table
    outs, lses = [], []
    for r in range(len(qo_indptr) - 1):
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        ids = kv_indices[kv_indptr[r] : kv_indptr[r + 1]].long()
        n = int(kv_len[r])
        c, p = ckv[ids].reshape(-1, C)[:n], kpe[ids].reshape(-1, R_DIM)[:n]  # (n, c), (n, r)
        s = (torch.einsum("thc,nc->htn", q_nope[rows], c) + torch.einsum("thr,nr->htn", q_pe[rows], p)) * scale
        t = s.shape[1]
        if causal:
            s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)  # (h, t)
        w = torch.where(torch.isneginf(lse)[..., None], 0.0, torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("htn,nc->thc", w, c))
        lses.append(lse.T)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("P", [1, 16])
@pytest.mark.parametrize("one_buffer", [False, True], ids=["two pools", "one buffer"])
@pytest.mark.parametrize(
    ("qo_lens", "kv_lens"),
    [([1] * 6, [1, 17, 40, 3, 64, 100]),  # decoding steps: one fused call for every request
     ([5, 0, 1, 9, 1], [5, 7, 1, 30, 33])],  # prefill chunks, a request with no query, one key
    ids=["decoding", "ragged"],
)
def test_paged_latent_attention_equals_the_attention_written_out(P, one_buffer, qo_lens, kv_lens):
    q_nope, q_pe, ckv, kpe, table = build(qo_lens, kv_lens, P, one_buffer=one_buffer)
    scale = 1 / math.sqrt(24)
    out, lse = qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=scale, return_lse=True)
    want_out, want_lse = literal(q_nope, q_pe, ckv, kpe, table, scale)
    assert out.shape == (sum(qo_lens), H, C) and lse.shape == (sum(qo_lens), H)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    assert LatentPages(ckv, kpe).views == one_buffer


@pytest.mark.parametrize("one_buffer", [False, True], ids=["two pools", "one buffer"])
@pytest.mark.parametrize(("starts", "read"), [
    ([[0], [16], [32, 80], [64]], "blocks"),  # a request in two aligned blocks apart: items, read by blocks
    ([[0], [16], [32], [64]], "runs"),  # one run a request, even from block boundaries: a kernel call each
    ([[1], [17], [34], [66]], "runs"),
], ids=["aligned blocks", "aligned runs", "unaligned runs"])  # fmt: skip
def test_consecutive_pages_are_read_as_blocks_or_runs(one_buffer, starts, read, monkeypatch):
    """Requests whose pages lie one after the other, as ``qkv.PagedKVCache`` hands them out: each request one run
    (read by ``runs``, a kernel call a run, nothing to merge), or requests in several aligned blocks (items of 16
    pages read by ``blocks``). Each list of ``starts`` is where a request's runs of 16 pages (its last: the rest) begin."""
    P, kv_lens = 4, [30, 64, 100, 1]
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(96, P, C + R_DIM, generator=gen, dtype=torch.float64)
    ckv, kpe = (buf[..., :C], buf[..., C:]) if one_buffer else (buf[..., :C].contiguous(), buf[..., C:].contiguous())
    counts = [-(-n // P) for n in kv_lens]
    indices = [firsts[min(t // 16, len(firsts) - 1)] + t - 16 * min(t // 16, len(firsts) - 1)
               for firsts, c in zip(starts, counts) for t in range(c)]  # fmt: skip
    table = (torch.arange(5), torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()]), torch.tensor(indices),
             torch.tensor(kv_lens))  # fmt: skip
    q_nope = torch.randn(4, H, C, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(4, H, R_DIM, generator=gen, dtype=torch.float64)
    used = []
    real = getattr(LatentPages, read)
    monkeypatch.setattr(LatentPages, read, lambda self, *a: used.append(read) or real(self, *a))
    out = qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=0.3)
    assert used
    torch.testing.assert_close(out, literal(q_nope, q_pe, ckv, kpe, table, 0.3)[0], atol=1e-12, rtol=0)


def test_without_causal_every_query_sees_every_key():
    q_nope, q_pe, ckv, kpe, table = build([3, 2], [3, 9], 4)
    out = qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=0.2, causal=False)
    torch.testing.assert_close(out, literal(q_nope, q_pe, ckv, kpe, table, 0.2, causal=False)[0], atol=1e-12, rtol=0)


def _pages_of(x, P, order):
    """``x (j, w)`` cut into pages of ``P`` rows at the page ids ``order``, in a pool of ``len(order) + 2`` pages."""
    j, w = x.shape
    n = -(-j // P)
    pool = torch.randn(n + 2, P, w, dtype=x.dtype) * 1e3  # unwritten slots hold garbage, never seen
    padded = torch.cat((x, x.new_zeros(n * P - j, w))).view(n, P, w)
    pool[torch.tensor(order[:n])] = padded
    return pool


def test_a_latent_attention_decoding_step_over_pages_equals_the_step_over_its_cache():
    """A ``MultiHeadLatentAttention`` layer's one-token step: its cache's latents laid out in pages, attended
    with ``paged_latent_attention`` and ``W^UV`` / ``W^O`` applied, equals the module's own step (absorbed)."""
    torch.manual_seed(0)
    mla = qkv.MultiHeadLatentAttention(32, 4, dim_head=8, rope_dim=4, kv_rank=12).double().eval()
    prompt, step = torch.randn(1, 21, 32, dtype=torch.float64), torch.randn(1, 1, 32, dtype=torch.float64)
    with torch.no_grad():
        cache = mla.new_cache()
        mla(prompt, cache=cache, causal=True)
        want = mla(step, cache=cache)  # appends the step's latent, then attends (absorbed)
        # the same step by hand: the query absorbed, the cache (now 22 latents) in pages of 5
        q_c, q_r = mla.queries(step)
        q_r, _ = mla.rotary.rotate(q_r, q_r[:, :1], 21)
        w_uk = mla.k_up.weight.view(4, 8, 12)  # (h, d, c)
        q_nope = torch.einsum("bhid,hdc->bihc", q_c, w_uk)[0]  # (1, h, c)
        q_pe = q_r.transpose(1, 2)[0]  # (1, h, r)
        latents = cache.combined[0, 0]  # (22, c + r): [c^KV; k^R] of every position
        order = [6, 1, 4, 0, 2, 3, 5]
        ckv, kpe = _pages_of(latents[:, :12], 5, order), _pages_of(latents[:, 12:], 5, order)
        table = (torch.tensor([0, 1]), torch.tensor([0, 5]), torch.tensor(order[:5]), torch.tensor([22]))
        o = qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=mla.scale)  # (1, h, c)
        values = torch.einsum("thc,hec->the", o, mla.v_up.weight.view(4, -1, 12))  # W^UV per head
        got = mla.out_proj(values.reshape(1, 1, -1))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("grad", ["q_nope", "ckv"])
def test_a_backward_through_paged_latent_attention_raises(grad):
    """Its gradients were wrong and silent (the paged pass has no backward); the forward still runs."""
    q_nope, q_pe, ckv, kpe, table = build([1, 3], [9, 20], 4)
    {"q_nope": q_nope, "ckv": ckv}[grad].requires_grad_()
    out = qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=0.1)
    with torch.no_grad():
        assert torch.equal(out, qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=0.1))
    with pytest.raises(RuntimeError, match="has no backward"):
        out.sum().backward()


def test_kv_len_must_fit_in_its_pages():
    q_nope, q_pe, ckv, kpe, (qo, indptr, indices, kv_len) = build([1, 1], [5, 9], 4)
    with pytest.raises(ValueError, match=r"kv_len\[1\]: 13 keys but 3 pages of 4 \(expected 0 to 12\)"):
        qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, qo, indptr, indices, torch.tensor([5, 13]), sm_scale=0.1)
    with pytest.raises(ValueError, match=r"kv_len: expected one length per request \(2"):
        qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, qo, indptr, indices, torch.tensor([5]), sm_scale=0.1)


def test_sm_scale_has_no_default_and_shapes_are_checked():
    q_nope, q_pe, ckv, kpe, table = build([1], [5], 4)
    with pytest.raises(TypeError, match="sm_scale"):
        qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table)
    with pytest.raises(TypeError, match=r"sm_scale: expected a float"):
        qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe, *table, sm_scale=None)
    with pytest.raises(ValueError, match=r"q_nope, q_pe: expected \(total_q, num_heads, 12\) and \(total_q, num_heads, 4\)"):
        qkv.paged_latent_attention(q_nope, q_pe[..., :3], ckv, kpe, *table, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"kpe_cache: expected the pages, page size, dtype and device of ckv_cache"):
        qkv.paged_latent_attention(q_nope, q_pe, ckv, kpe[:-1], *table, sm_scale=0.1)
    with pytest.raises(ValueError, match=r"ckv_cache: expected ckv_cache \(num_pages, page_size, head_dim_ckv\)"):
        qkv.paged_latent_attention(q_nope, q_pe, ckv[..., None], kpe, *table, sm_scale=0.1)


def test_a_latent_attention_layer_serves_requests_from_paged_latents():
    """``qkv.PagedKVCache(..., latent_dim=c)`` holds one latent per token; a ``MultiHeadLatentAttention`` layer run on
    packed steps of two requests (a prefill of both, then decoding steps) equals each request alone on its
    ``LatentCache``."""
    from qkv.paged.serve import PagedStep

    torch.manual_seed(1)
    mla = qkv.MultiHeadLatentAttention(32, 4, dim_head=8, rope_dim=4, kv_rank=12).double().eval()
    tokens = {"a": torch.randn(1, 9, 32, dtype=torch.float64), "b": torch.randn(1, 5, 32, dtype=torch.float64)}
    prompt = {"a": 6, "b": 3}
    cache = qkv.PagedKVCache(16, 4, 1, 12 + 4, latent_dim=12, dtype=torch.float64)
    assert cache.nbytes == 16 * 4 * 16 * 8  # one latent per slot: keys and values are not held twice
    got = {r: [] for r in tokens}
    with torch.no_grad():
        for r in tokens:
            cache.add(r)
        done = dict.fromkeys(tokens, 0)
        for new in (prompt, {"a": 1, "b": 1}, {"a": 2, "b": 1}):  # a prefill, a decoding step, a chunk of 2 and a step
            step = cache.plan(new)
            x = torch.cat([tokens[r][:, done[r] : done[r] + n] for r, n in new.items()], 1)
            y = mla(x, cache=PagedStep(cache, step).self_attn[0])
            at = 0
            for r, n in new.items():
                got[r].append(y[:, at : at + n])
                at, done[r] = at + n, done[r] + n
        for r, x in tokens.items():
            alone = mla(x[:, : done[r]], causal=True)  # the whole sequence at once, no cache
            torch.testing.assert_close(torch.cat(got[r], 1), alone, atol=1e-12, rtol=0)


def test_latent_pages_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match=r"latent_dim: MLA pages hold one latent .* got kv_heads=2"):
        qkv.PagedKVCache(8, 4, 2, 16, latent_dim=12)
    with pytest.raises(ValueError, match=r"latent_dim: .* quantized=True"):
        qkv.PagedKVCache(8, 4, 1, 16, latent_dim=12, quantized=True)
    pages = qkv.PagedKVCache(8, 4, 1, 16, latent_dim=12).layer(0)
    with pytest.raises(ValueError, match=r"k, v: expected the latents \(n, 1, 16\) as both"):
        pages.write(torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 1, 16), torch.zeros(1, 1, 12))


def test_a_forked_request_copies_a_shared_latent_page_before_writing_to_it():
    """Fork mid-page, then both requests take a token: the shared partial page is copied first (copy-on-write);
    each request's step equals its sequence alone."""
    from qkv.paged.serve import PagedStep

    torch.manual_seed(2)
    mla = qkv.MultiHeadLatentAttention(32, 4, dim_head=8, rope_dim=4, kv_rank=12).double().eval()
    shared = torch.randn(1, 6, 32, dtype=torch.float64)
    nxt = {"a": torch.randn(1, 1, 32, dtype=torch.float64), "b": torch.randn(1, 1, 32, dtype=torch.float64)}
    cache = qkv.PagedKVCache(16, 4, 1, 16, latent_dim=12, dtype=torch.float64)
    with torch.no_grad():
        cache.add("a")
        mla(shared, cache=PagedStep(cache, cache.plan({"a": 6})).self_attn[0])
        cache.fork("a", "b")
        assert cache.pages_of("a") == cache.pages_of("b")  # 6 tokens: a full page and a shared partial one
        y = mla(torch.cat((nxt["a"], nxt["b"]), 1), cache=PagedStep(cache, cache.plan({"a": 1, "b": 1})).self_attn[0])
        assert cache.pages_of("a")[-1] != cache.pages_of("b")[-1]
        for n, r in enumerate("ab"):
            alone = mla(torch.cat((shared, nxt[r]), 1), causal=True)[:, -1:]
            torch.testing.assert_close(y[:, n : n + 1], alone, atol=1e-12, rtol=0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_lower_precisions_stay_near_the_float64_answer(dtype, tol):
    q_nope, q_pe, ckv, kpe, table = build([1, 1, 4], [30, 7, 20], 4, one_buffer=True)
    want = literal(q_nope, q_pe, ckv, kpe, table, 0.2)[0]
    got = qkv.paged_latent_attention(q_nope.to(dtype), q_pe.to(dtype), ckv.to(dtype), kpe.to(dtype), *table, sm_scale=0.2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
