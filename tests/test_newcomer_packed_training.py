"""A newcomer's packed causal-LM training, through each packing dialect the README offers.

Shape legend: ``t`` packed tokens, ``h`` query heads, ``g`` KV heads, ``d`` head size;
``sq``/``sk`` one document's query and key lengths. H=4, G=2 (grouped heads) everywhere.

Documents laid end to end in one row, as ``flash_attn_varlen_func`` takes them
(``cu_seqlens``), as a ``qkv.masks.documents`` mask, and as a FlexAttention mask program
(``create_block_mask`` / ``from_mask_mod``). The oracle is a loop over the documents, each
an unpacked call or the formula written out in float64 (bottom-right causal and windows as
flash-attn >= 2.1 documents them, zeros for a query that sees no key); outputs, log-sum-exps
and gradients (of q, k, v and of a tiny model's parameters) are compared to 1e-10. Then a
few hundred training steps on a task that cross-document leakage would solve, and
``torch.compile`` of the packed forward.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

import qkv
from qkv.masks import causal, documents, from_mask_mod

H, G, D = 4, 2, 8
LENGTHS = [6, 1, 0, 9, 2, 14]  # a document of one token, an empty one (a repeated offset), one across blocks


def cu_of(lengths, dtype=torch.int32):
    """flash-attn's ``cu_seqlens``: ``(b + 1,)`` offsets from 0."""
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(dtype)


def ids_of(lengths):
    """A document id per token (an empty document has no token, so no id)."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def packed(lq, lk=None, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lk = lq if lk is None else lk
    make = lambda t, n: torch.randn(t, n, D, generator=gen, dtype=dtype).requires_grad_()  # noqa: E731
    return make(sum(lq), H), make(sum(lk), G), make(sum(lk), G)


def formula(q, k, v, causal=False, window=(-1, -1), scale=None):
    """One document, unpacked, written out: ``q (sq, h, d)`` -> ``(out (sq, h, d), lse (h, sq))``.

    flash-attn's docstring: query ``r`` sees keys in ``[r + sk - sq - left, r + sk - sq + right]``;
    ``causal`` sets ``right = 0``; a row that sees nothing is 0 (its lse -inf).
    """
    sq, sk = q.shape[0], k.shape[0]
    k, v = (x.repeat_interleave(H // G, 1) for x in (k, v))
    logits = torch.einsum("ihd,jhd->hij", q, k) * (D**-0.5 if scale is None else scale)
    diag, col = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None]
    left, right = window[0], 0 if causal else window[1]
    seen = ((col >= diag - left) | (left < 0)) & ((col <= diag + right) | (right < 0))
    logits = logits.masked_fill(~seen, -math.inf)
    return torch.einsum("hij,jhd->ihd", logits.softmax(-1).nan_to_num(0.0), v), logits.logsumexp(-1)


def per_document(q, k, v, lq, lk=None, **kw):
    """The oracle: ``formula`` on each document alone, concatenated."""
    cq, ck = cu_of(lq).tolist(), cu_of(lq if lk is None else lk).tolist()
    parts = [formula(q[cq[s] : cq[s + 1]], k[ck[s] : ck[s + 1]], v[ck[s] : ck[s + 1]], **kw) for s in range(len(lq))]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts], -1)


def grads(out, lse, xs, seed=1):
    """Gradients of a random linear function of the output and of the finite lse."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    return torch.autograd.grad((out * w).sum() + lse.masked_fill(lse.isinf(), 0).sum(), xs)


def as_rows(x):
    """``(t, heads, d)`` -> one packed batch row ``(1, heads, t, d)`` (a view)."""
    return x.transpose(0, 1)[None]


def doc_causal_of(ids):
    def doc_causal(b, h, q_idx, kv_idx):  # FlexAttention's document mask, unchanged
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return doc_causal


def dialects(lengths):
    """Each packing dialect as ``attend(q, k, v) -> (out (t, h, d), lse (h, t))`` on packed tokens."""
    cu, ids, longest = cu_of(lengths), ids_of(lengths), max(lengths)
    block_mask = create_block_mask(doc_causal_of(ids), None, None, len(ids), len(ids), device="cpu", BLOCK_SIZE=8)
    unrow = lambda res: (res[0][0].transpose(0, 1), res[1][0])  # noqa: E731
    return {
        "varlen": lambda q, k, v: qkv.varlen_attention(q, k, v, cu, cu, longest, longest, dropout_p=0.0, causal=True,
                                                       return_lse=True),  # fmt: skip
        "documents": lambda q, k, v: unrow(qkv.attention(*map(as_rows, (q, k, v)), mask=documents(ids) & causal(),
                                                         return_lse=True)),  # fmt: skip
        "flex": lambda q, k, v: unrow(qkv.flex_attention(*map(as_rows, (q, k, v)), block_mask=block_mask,
                                                         enable_gqa=True, return_lse=True)),  # fmt: skip
        "mask_mod": lambda q, k, v: unrow(qkv.attention(*map(as_rows, (q, k, v)), return_lse=True,
                                                        mask=from_mask_mod(doc_causal_of(ids)))),  # fmt: skip
    }


@pytest.mark.parametrize("dialect", ["varlen", "documents", "flex", "mask_mod"])
def test_each_dialect_equals_the_per_document_loop_forward_and_backward(dialect):
    q, k, v = packed(LENGTHS)
    out, lse = dialects(LENGTHS)[dialect](q, k, v)
    ref, ref_lse = per_document(q, k, v, LENGTHS, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-10)
    for got, want in zip(grads(out, lse, (q, k, v)), grads(ref, ref_lse, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


CASES = {  # name: (lengths_q, lengths_k, varlen keywords), flash-attn's semantics per document
    "window and causal": ([5, 1, 0, 7], None, dict(causal=True, window_size=(2, 3))),  # causal sets right = 0
    "window both sides": ([5, 1, 0, 7], None, dict(window_size=(1, 2), softmax_scale=0.3)),
    "chunked prefill": ([3, 4, 1], [5, 6, 1], dict(causal=True)),  # queries are each document's last sq
    "queries outnumber keys": ([5, 4, 2], [2, 6, 0], dict(causal=True)),  # rows before the first key see none
    "an empty key document": ([3, 2, 2], [3, 0, 2], dict(causal=True)),
    "window, more keys": ([2, 3], [6, 3], dict(causal=True, window_size=(1, -1))),
}


@pytest.mark.parametrize("name", CASES)
def test_varlen_edges_follow_flash_attn_per_document(name):
    lq, lk, kw = CASES[name]
    q, k, v = packed(lq, lk)
    out, lse, s_dmask = qkv.varlen_attention(q, k, v, cu_of(lq), cu_of(lk or lq), return_attn_probs=True, **kw)
    window = kw.get("window_size") or (-1, -1)
    ref, ref_lse = per_document(q, k, v, lq, lk, causal=kw.get("causal", False), window=window,
                                scale=kw.get("softmax_scale"))  # fmt: skip
    assert s_dmask is None  # flash-attn fills it only for tests with dropout; the docstring says None
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-10)  # -inf where a row sees nothing
    for got, want in zip(grads(out, lse, (q, k, v)), grads(ref, ref_lse, (q, k, v))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_flash_attns_own_example_of_more_queries_than_keys():
    """flash-attn >= 2.1's docstring: seqlen_q = 5, seqlen_k = 2, causal masks rows 0 0 / 0 0 / 0 0 / 1 0 / 1 1,
    and an all-zero row gives output 0."""
    q, k, v = packed([5], [2])
    out, lse = qkv.varlen_attention(q, k, v, cu_of([5]), cu_of([2]), causal=True, return_lse=True)
    assert torch.equal(out[:3], torch.zeros_like(out[:3])) and bool(lse[:, :3].isneginf().all())
    torch.testing.assert_close(out[3], v[0].repeat_interleave(H // G, 0), rtol=0, atol=1e-12)  # one key: its value
    out.sum().backward()
    assert torch.equal(q.grad[:3], torch.zeros_like(q.grad[:3])) and q.grad[3:].abs().sum() > 0


def test_chunked_prefill_as_a_mask_program_and_what_documents_and_causal_mean():
    """cu_seqlens_q != cu_seqlens_k: a per-document bottom-right mask_mod is flash-attn's call; ``documents(ids_q,
    ids_k) & causal()`` is not: ``causal()`` is aligned to the whole call's corner (README's table says so)."""
    lq, lk = [3, 4, 1], [5, 6, 1]
    q, k, v = packed(lq, lk)
    want, _ = per_document(q, k, v, lq, lk, causal=True)
    idq, idk = ids_of(lq), ids_of(lk)
    q_pos = torch.arange(len(idq)) - cu_of(lq).long()[idq]
    k_pos = torch.arange(len(idk)) - cu_of(lk).long()[idk]
    shift = torch.tensor(lk) - torch.tensor(lq)

    def chunked(b, h, q_idx, kv_idx):
        return (idq[q_idx] == idk[kv_idx]) & (k_pos[kv_idx] <= q_pos[q_idx] + shift[idq[q_idx]])

    block_mask = create_block_mask(chunked, None, None, len(idq), len(idk), device="cpu", BLOCK_SIZE=4)
    flexed = qkv.flex_attention(*map(as_rows, (q, k, v)), block_mask=block_mask, enable_gqa=True)
    lazy = qkv.attention(*map(as_rows, (q, k, v)), mask=from_mask_mod(chunked))
    for got in (flexed, lazy):
        torch.testing.assert_close(got[0].transpose(0, 1), want, rtol=0, atol=1e-10)
    corner = qkv.attention(*map(as_rows, (q, k, v)), mask=documents(idq, idk) & causal())[0].transpose(0, 1)
    corner_diagonal = torch.arange(len(idq))[:, None] + len(idk) - len(idq)  # the call's bottom-right, i=8, j=12
    whole = (idq[:, None] == idk[None]) & (torch.arange(len(idk))[None] <= corner_diagonal)
    torch.testing.assert_close(corner, qkv.attention(*map(as_rows, (q, k, v)), mask=whole)[0].transpose(0, 1))
    assert (corner - want).abs().max() > 0.1  # the first document's queries see their own future there


def test_offsets_dtype_strides_and_layout_do_not_change_the_result():
    """int32 and int64 offsets, offsets that are a strided view, q/k/v that are slices of a fused projection
    with stride-0 heads: the same bits as contiguous inputs."""
    fused = torch.randn(sum(LENGTHS), H + 2 * G, D, dtype=torch.float64, requires_grad=True)
    q, k, v = fused.split([H, G, G], 1)
    k = k[:, :1].expand(-1, G, -1)  # one KV head broadcast to g
    base = qkv.varlen_attention(*(x.detach().contiguous() for x in (q, k, v)), cu_of(LENGTHS), cu_of(LENGTHS),
                                causal=True)  # fmt: skip
    strided = torch.stack([cu_of(LENGTHS, torch.int64), cu_of(LENGTHS, torch.int64)], 1)[:, 0]
    for cu in (cu_of(LENGTHS), cu_of(LENGTHS, torch.int64), strided):
        out = qkv.varlen_attention(q, k, v, cu, cu, causal=True)
        assert torch.equal(out, base)
    out.square().sum().backward()
    assert fused.grad[:, H + 1 : H + G].abs().sum() == 0 and fused.grad[:, H].abs().sum() > 0  # expanded head: one grad


@pytest.mark.parametrize("dialect", ["varlen", "documents", "flex"])
def test_bfloat16_is_float32_to_bf16_tolerance(dialect):
    lengths = [1, 40, 0, 23, 64]
    low = [x.detach().bfloat16().requires_grad_() for x in packed(lengths, dtype=torch.float32)]
    high = [x.detach().float().requires_grad_() for x in low]  # the same rounded inputs, computed in float32
    attend = dialects(lengths)[dialect]
    (out, lse), (ref, ref_lse) = attend(*low), attend(*high)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(lse.float(), ref_lse, rtol=1.6e-2, atol=2e-2)
    w = torch.randn(ref.shape)
    for got, want in zip(torch.autograd.grad((out.float() * w).sum(), low), torch.autograd.grad((ref * w).sum(), high)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_a_document_is_bitwise_alone_with_documents_and_a_mask_program():
    """The README's bitwise promise, through a ``documents`` mask alone or in front of a ``mask_mod``: one call
    per document, the same bits as the document's own unpacked call."""
    lengths = [37, 1, 70, 30]
    q, k, v = (x.detach().float() for x in packed(lengths))
    ids = ids_of(lengths)
    alone = qkv.attention(*(as_rows(x[38:108]) for x in (q, k, v)), causal=True)
    for mask in (documents(ids) & causal(), documents(ids) & from_mask_mod(doc_causal_of(ids))):
        assert torch.equal(qkv.attention(*map(as_rows, (q, k, v)), mask=mask)[..., 38:108, :], alone)


def test_a_mask_program_reading_b_needs_B_and_a_block_mask_reads_each_row():
    """Two rows packed differently: ``from_mask_mod(mm, B=2)`` and ``create_block_mask(mm, 2, ...)`` follow each
    row's ids; ``from_mask_mod(mm)`` (B=None: "reads no b", as the README says) evaluates row 0's for both."""
    ids = torch.stack([ids_of([6, 1, 9, 16]), ids_of([20, 12])])
    q, k, v = (torch.randn(2, n, 32, D, dtype=torch.float64) for n in (H, G, G))

    def mm(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    want = qkv.attention(q, k, v, mask=documents(ids) & causal())
    block_mask = create_block_mask(mm, 2, None, 32, 32, device="cpu", BLOCK_SIZE=8)
    torch.testing.assert_close(qkv.attention(q, k, v, mask=from_mask_mod(mm, B=2)), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(qkv.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True), want,
                               rtol=0, atol=1e-12)  # fmt: skip
    row0 = qkv.attention(q, k, v, mask=documents(ids[:1]) & causal())
    torch.testing.assert_close(qkv.attention(q, k, v, mask=from_mask_mod(mm)), row0, rtol=0, atol=1e-12)


BAD = [  # (cu_seqlens_q, keywords, error, what the message names)
    ([1, 5, 9], {}, ValueError, r"cu_seqlens_q: expected offsets from 0"),
    ([0, 6, 5, 9], {}, ValueError, r"non-decreasing"),
    ([0, 5, 8], {}, ValueError, r"ending at q's 9 tokens"),
    ([0.0, 5.0, 9.0], {}, TypeError, r"cu_seqlens_q: expected an integer tensor"),
    ([0, 5, 9], dict(max_seqlen_q=4), ValueError, r"max_seqlen_q: expected an int at least the longest sequence, 5"),
    ([0, 5, 9], dict(max_seqlen_k=4.0), TypeError, r"max_seqlen_k: expected an int"),
    ([0, 9], {}, ValueError, r"cu_seqlens_k: expected 2 offsets like cu_seqlens_q"),
]


@pytest.mark.parametrize("cu_q, kw, error, match", BAD)
def test_bad_offsets_are_refused_with_the_argument_named(cu_q, kw, error, match):
    q, k, v = packed([5, 4])
    with pytest.raises(error, match=match):
        qkv.varlen_attention(q, k, v, torch.tensor(cu_q), cu_of([5, 4]), causal=True, **kw)


# ---- a tiny causal LM on packed documents ------------------------------------------------

C, BOS, SPAN = 8, 0, 16  # content tokens 1..C; documents of 2..SPAN tokens, positions restart in each


class TinyLM(nn.Module):
    """Embeddings (token + position inside the document), one grouped-head attention layer, an MLP, a head."""

    def __init__(self, dim=32, dtype=torch.float32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(C + 1, dim, dtype=dtype), nn.Embedding(SPAN, dim, dtype=dtype)
        self.proj = nn.Linear(dim, (H + 2 * G) * (dim // H), dtype=dtype)
        self.out = nn.Linear(dim, dim, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim, dtype=dtype), nn.GELU(), nn.Linear(2 * dim, dim, dtype=dtype))
        self.head = nn.Linear(dim, C + 1, dtype=dtype)

    def forward(self, tokens, positions, attend):  # (t,) -> logits (t, C + 1); attend: (t, h, d) -> (t, h, d)
        x, dh = self.tok(tokens) + self.pos(positions), self.out.in_features // H
        q, k, v = (y.unflatten(-1, (-1, dh)) for y in self.proj(x).split([H * dh, G * dh, G * dh], -1))
        x = x + self.out(attend(q, k, v).flatten(-2))
        return self.head(x + self.mlp(x))


def positions_of(lengths):
    return torch.arange(sum(lengths)) - torch.repeat_interleave(cu_of(lengths).long()[:-1], torch.tensor(lengths))


def next_token_loss(logits, tokens, lengths):
    """Summed cross-entropy of each token's successor inside its document (no target across a boundary)."""
    inside = positions_of(lengths)[1:] > 0
    return F.cross_entropy(logits[:-1][inside], tokens[1:][inside], reduction="sum")


@pytest.mark.parametrize("dialect", ["varlen", "documents", "flex", "mask_mod"])
def test_model_gradients_equal_a_loop_of_unpacked_documents(dialect):
    torch.manual_seed(0)
    model = TinyLM(dtype=torch.float64)
    tokens = torch.randint(0, C + 1, (sum(LENGTHS),), generator=torch.Generator().manual_seed(2))
    attend = dialects(LENGTHS)[dialect]
    loss = next_token_loss(model(tokens, positions_of(LENGTHS), lambda q, k, v: attend(q, k, v)[0]), tokens, LENGTHS)
    got = torch.autograd.grad(loss, list(model.parameters()))
    alone, cu = 0.0, cu_of(LENGTHS).tolist()
    unpacked = lambda q, k, v: qkv.attention(*map(as_rows, (q, k, v)), causal=True)[0].transpose(0, 1)  # noqa: E731
    for s, n in enumerate(LENGTHS):
        doc = tokens[cu[s] : cu[s + 1]]
        alone = alone + next_token_loss(model(doc, torch.arange(n), unpacked), doc, [n])
    want = torch.autograd.grad(alone, list(model.parameters()))
    torch.testing.assert_close(loss, alone, rtol=0, atol=1e-10)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)


def batch(gen, rows, row_len=64):
    """Rows of documents ``[BOS, x, noise, x, noise, ...]``: ``x`` is the same in every document of a row,
    so the token after BOS is the previous document's ``x``, readable only across documents."""
    tokens, lengths = [], []
    for _ in range(rows):
        x, used = int(torch.randint(1, C + 1, (), generator=gen)), 0
        while used < row_len:
            n = min(int(torch.randint(2, SPAN + 1, (), generator=gen)), row_len - used)
            doc = torch.randint(1, C + 1, (n,), generator=gen)
            doc[0], doc[1::2] = BOS, x
            tokens.append(doc), lengths.append(n)
            used += n
    return torch.cat(tokens), lengths


def train(leaky, steps=200, rows=4):
    """Per-token losses after training with document masking (varlen_attention), or causal over whole rows."""
    torch.manual_seed(0)
    model, gen = TinyLM(), torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def attend_for(lengths, n_rows):
        if leaky:  # what packing without document masks computes: every earlier token of the row
            return lambda q, k, v: qkv.attention(*(x.unflatten(0, (n_rows, -1)).transpose(1, 2) for x in (q, k, v)),
                                                 causal=True).transpose(1, 2).flatten(0, 1)  # fmt: skip
        cu = cu_of(lengths)
        return lambda q, k, v: qkv.varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    for _ in range(steps):
        tokens, lengths = batch(gen, rows)
        loss = next_token_loss(model(tokens, positions_of(lengths), attend_for(lengths, rows)), tokens, lengths)
        opt.zero_grad()
        (loss / len(tokens)).backward()
        opt.step()
    with torch.no_grad():
        tokens, lengths = batch(torch.Generator().manual_seed(99), 16)
        logits = model(tokens, positions_of(lengths), attend_for(lengths, 16))
    nll, pos = F.cross_entropy(logits[:-1], tokens[1:], reduction="none"), positions_of(lengths)
    inside = pos[1:] == pos[:-1] + 1
    first_of_row = torch.arange(len(tokens) - 1) % 64 == 0  # (no earlier document to copy from)
    return {
        "copy": nll[inside & (pos[:-1] % 2 == 0) & (pos[:-1] > 0)].mean(),  # x from inside the document
        "noise": nll[inside & (pos[:-1] % 2 == 1)].mean(),
        "leak": nll[inside & (pos[:-1] == 0) & ~first_of_row].mean(),  # x from the previous document only
    }


def test_training_learns_inside_documents_and_nothing_across_them():
    masked, leaky = train(leaky=False), train(leaky=True)
    chance = math.log(C)
    assert masked["copy"] < 0.1 and abs(masked["noise"] - chance) < 0.15  # learned what a document holds
    assert abs(masked["leak"] - chance) < 0.15  # the previous document's token stays at chance
    assert leaky["leak"] < 0.5 * chance  # the task does reward leakage: a row-causal model reads it


def test_compiled_packed_forward_gives_the_same_outputs():
    """``torch.compile`` (no fullgraph promised: the offsets are read on the host) of each dialect's forward;
    new offsets of the same token count are honoured, not baked into the graph."""
    q, k, v = (x.detach().float() for x in packed(LENGTHS))
    other = [3, 3, 0, 7, 0, 19]
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, cu: qkv.varlen_attention(q, k, v, cu, cu, causal=True))
    for lengths in (LENGTHS, other):
        want = per_document(*(x.double() for x in (q, k, v)), lengths, causal=True)[0].float()
        torch.testing.assert_close(compiled(q, k, v, cu_of(lengths)), want, rtol=1e-5, atol=1e-6)
    want = per_document(*(x.double() for x in (q, k, v)), LENGTHS, causal=True)[0].float()
    for name in ("documents", "flex", "mask_mod"):  # (aot_eager: dynamo and autograd's tracing, no C++ compiler)
        torch._dynamo.reset()
        attend = dialects(LENGTHS)[name]
        got = torch.compile(lambda q, k, v: attend(q, k, v)[0], backend="aot_eager")(q, k, v)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
