"""A reader of the classic papers checks qkv against the formulas, written out by hand.

Every score, multi-head attention, the sinusoidal table and the two README models are
recomputed here from the papers' equations with the modules' own parameters, in float64,
and must agree to 1e-12: context vectors, returned weights and gradients. Papers: Bahdanau
et al. 2015 (``e_ij = v_aᵀ tanh(W_a s_{i−1} + U_a h_j)``), Luong et al. 2015 (dot, general
``h_tᵀ W_a h̄_s``, concat ``v_aᵀ tanh(W_a [h_t; h̄_s])``, location ``softmax(W_a h_t)``,
local-p), Vaswani et al. 2017 (``qᵀk/√d``, ``concat(head_1..head_h) W^O``, ``PE``), Zhou et
al. 2018 (DIN's target attention).

Shape legend: ``b`` batch, ``h`` heads, ``i`` queries (decoder steps), ``j`` keys (source
positions), ``dq``/``dk`` query/key sizes, ``n`` the additive score's hidden size.
"""

import math

import pytest
import torch

import qkv
from qkv import scores
from qkv.models import Bahdanau, Luong, LuongAlignment, LuongConfig, Seq2SeqConfig, TargetAttention
from qkv.positional import SinusoidalEncoding, sinusoidal

F64 = torch.float64
B, I, J, DQ, DK = 2, 3, 4, 5, 6
KEEP = torch.tensor([[True] * J, [True] * (J - 2) + [False] * 2])  # (b, j): row 1 has 2 padded keys


def _randn(*shape, seed=0, grad=False):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_(grad)


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=1e-12)


def _by_element(fn, q, k):
    """``(b, i, j)`` logits ``fn(q_t, k_s, s)``, one query and one key at a time, as the papers write them."""
    return torch.stack([torch.stack([torch.stack([fn(q[n, t], k[n, s], s) for s in range(k.shape[1])])
                                     for t in range(q.shape[1])]) for n in range(q.shape[0])])  # fmt: skip


def _softmax_visible(e, keep):
    """``α_s = exp(e_s) / Σ_{visible s'} exp(e_s')`` on visible keys, 0 elsewhere (a row with none: all 0)."""
    top = e.masked_fill(~keep, -math.inf).amax(-1, keepdim=True).detach()
    ex = torch.exp(e - torch.where(torch.isfinite(top), top, 0.0)) * keep
    total = ex.sum(-1, keepdim=True)
    return ex / torch.where(total > 0, total, 1.0)


def _same_grads(ours, theirs, leaves, seed=9):
    """Gradients of one random linear functional of both results w.r.t. ``leaves``, compared."""
    r = [_randn(*t.shape, seed=seed + n) for n, t in enumerate(ours)]
    g_ours = torch.autograd.grad(sum((t * w).sum() for t, w in zip(ours, r)), leaves, retain_graph=True)
    g_theirs = torch.autograd.grad(sum((t * w).sum() for t, w in zip(theirs, r)), leaves, retain_graph=True)
    for a, b in zip(g_ours, g_theirs):
        _close(a, b)


def _bahdanau(s):  # Bahdanau's e_ij = v_aᵀ tanh(W_a s_{i−1} + U_a h_j), W_a = W_q, U_a = W_k
    return lambda si, hj, _: s.v @ torch.tanh(s.query_proj.weight @ si + s.key_proj.weight @ hj)


def _luong_concat(s):  # W_a = [W_q  W_k]: Luong's v_aᵀ tanh(W_a [h_t; h̄_s]) literally
    w_a = torch.cat([s.query_proj.weight, s.key_proj.weight], dim=1)
    return lambda ht, hs, _: s.v @ torch.tanh(w_a @ torch.cat([ht, hs]))


SCORES = {  # name: (score module, its size of q, of k, the paper's score of one pair)
    "dot": (lambda: scores.Dot(), DQ, DQ, lambda s: lambda ht, hs, _: ht @ hs),
    "scaled_dot": (lambda: scores.ScaledDot(), DQ, DQ, lambda s: lambda q, k, _: q @ k / math.sqrt(DQ)),
    "general": (lambda: scores.Bilinear(DQ, DK), DQ, DK, lambda s: lambda ht, hs, _: ht @ s.weight @ hs),
    "concat_luong": (lambda: scores.Additive(DQ, DK, hidden=3), DQ, DK, _luong_concat),
    "additive_bahdanau": (lambda: scores.Additive(DQ, DK, hidden=3), DQ, DK, _bahdanau),
    "location": (lambda: scores.Location(DQ, J, bias=False), DQ, DK,  # (W_a h_t)_s: softmax(W_a h_t) over s
                 lambda s: lambda ht, _, c: (s.proj.weight @ ht)[c]),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "reference", "chunked"])
@pytest.mark.parametrize("name", sorted(SCORES))
def test_each_score_is_the_papers_formula(name, backend):
    make, dq, dk, formula = SCORES[name]
    score = make().double()
    q, k = _randn(B, I, dq, seed=1, grad=True), _randn(B, J, dk, seed=2, grad=True)
    ctx, w = qkv.Attention(score, backend=backend)(q, k, mask=KEEP[:, None, :], return_weights=True)
    alpha = _softmax_visible(_by_element(formula(score), q, k), KEEP[:, None, :])  # (b, i, j)
    _close(w, alpha)
    _close(ctx, alpha @ k)  # c_t = Σ_s α_ts h̄_s: the annotations are the values
    assert torch.all(w[1, :, J - 2 :] == 0)  # padding: exactly 0 weight
    _close(w.sum(-1), torch.ones(B, I, dtype=F64))  # a distribution over the visible keys
    _same_grads((ctx, w), (alpha @ k, alpha), [q, k, *score.parameters()])


def test_heads_layout_and_separate_values_as_in_the_readme():
    score = scores.Additive(DQ, DQ, hidden=3).double()  # README: qkv.attention(q, k, v, score=additive)
    q, k, v = _randn(B, 2, I, DQ, seed=3), _randn(B, 2, J, DQ, seed=4), _randn(B, 2, J, 2, seed=5)
    out, w = qkv.attention(q, k, v, score=score, mask=KEEP[:, None, None, :], return_weights=True)
    heads = [_softmax_visible(_by_element(_luong_concat(score), q[:, h], k[:, h]), KEEP[:, None, :]) for h in (0, 1)]
    _close(w, torch.stack(heads, 1))
    _close(out, w @ v)


def test_self_attention_without_projections_is_softmax_x_xt_x():
    x = _randn(B, I, DQ, seed=24)  # Dot's docstring: basic self-attention softmax(X Xᵀ) X, key = value = query
    y, w = qkv.Attention("dot")(x, return_weights=True)
    _close(w, _softmax_visible(x @ x.mT, torch.ones(B, I, I, dtype=torch.bool)))
    _close(y, w @ x)


def test_bias_options_are_extra_terms_on_the_paper_formulas():
    """Location's default ``bias=True`` is ``softmax(W_a h_t + b)``, Additive's ``bias=True`` ``W_q q + b``."""
    q, k = _randn(B, I, DQ, seed=6), _randn(B, J, DK, seed=7)
    loc = scores.Location(DQ, J).double()
    _close(loc.logits(q, k), _by_element(lambda ht, _, c: (loc.proj.weight @ ht + loc.proj.bias)[c], q, k))
    assert scores.Location(DQ, J, bias=False).proj.bias is None
    add = scores.Additive(DQ, DK, hidden=3, bias=True).double()
    paper = _by_element(lambda si, hj, _: add.v @ torch.tanh(add.query_proj(si) + add.key_proj.weight @ hj), q, k)
    _close(add.logits(q, k), paper)


def test_location_over_a_shorter_source_is_the_padded_one():
    # At most max_len keys: a source of j < L is the length-L softmax with positions ≥ j masked.
    loc = scores.Location(DQ, J).double()
    q = _randn(B, I, DQ, seed=8)
    short = qkv.Attention(loc)(q, _randn(B, J - 1, DK, seed=9), return_weights=True)[1]
    first = (torch.arange(J) < J - 1).expand(B, J)
    padded = qkv.Attention(loc)(q, _randn(B, J, DK, seed=9), mask=first, return_weights=True)[1]
    _close(short, padded[..., : J - 1])
    with pytest.raises(ValueError, match=r"k: the location score was built for at most max_len=4 keys, got j=5"):
        qkv.Attention(loc)(q, _randn(B, J + 1, DK))


def test_bahdanau_single_step_query():
    # The decoder state s_{i−1} (b, dq) against the annotations (b, j, dk): weights (b, j).
    score = scores.Additive(DQ, DK, hidden=3).double()
    s, h = _randn(B, DQ, seed=10, grad=True), _randn(B, J, DK, seed=11, grad=True)
    c, w = qkv.Attention(score)(s, h, mask=KEEP, return_weights=True)
    assert c.shape == (B, DK) and w.shape == (B, J)
    e = _by_element(_bahdanau(score), s[:, None], h)[:, 0]
    alpha = _softmax_visible(e, KEEP)
    _close(w, alpha)
    _close(c, torch.einsum("bj,bjd->bd", alpha, h))
    _same_grads((c, w), (torch.einsum("bj,bjd->bd", alpha, h), alpha), [s, h, *score.parameters()])


def _mha_by_hand(m, x, mem, keep):
    """Vaswani et al. 3.2.2: ``head_n = softmax(Q W_n^Q (K W_n^K)ᵀ / √d) V W_n^V``, ``[head_1; ...] W^O``."""
    heads, weights = [], []
    for n in range(m.heads):
        rows = slice(n * m.dim_head, (n + 1) * m.dim_head)  # W_n^Q, W_n^K, W_n^V: head n's rows
        qn, kn, vn = (z @ p.weight[rows].T + p.bias[rows] for z, p in ((x, m.q_proj), (mem, m.k_proj), (mem, m.v_proj)))
        a = _softmax_visible(qn @ kn.mT / math.sqrt(m.dim_head), keep[:, None, :])
        heads.append(a @ vn)
        weights.append(a)
    return torch.cat(heads, -1) @ m.out_proj.weight.T + m.out_proj.bias, torch.stack(weights, 1)


@pytest.mark.parametrize("cross", [False, True])
def test_multi_head_is_concat_heads_times_w_o(cross):
    torch.manual_seed(0)
    m = qkv.MultiHeadAttention(dim=6, heads=2).double()
    x = _randn(B, I, 6, seed=12, grad=True)
    mem = _randn(B, J, 6, seed=13, grad=True) if cross else x
    keep = KEEP if cross else torch.ones(B, I, dtype=torch.bool)
    y, w = m(x, mem if cross else None, mask=keep[:, None, None, :], return_weights=True)
    assert y.shape == (B, I, 6) and w.shape == (B, 2, I, J if cross else I)
    y_hand, w_hand = _mha_by_hand(m, x, mem, keep)
    _close(y, y_hand)
    _close(w, w_hand)
    if not cross:
        _close(m(x, x, x), y)  # self-attention is the call with query = key = value
    _same_grads((y, w), (y_hand, w_hand), [x, mem, *m.parameters()] if cross else [x, *m.parameters()])


def test_multi_head_against_torch_with_copied_weights():
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(6, 2, batch_first=True, dtype=F64)
    ours = qkv.MultiHeadAttention(dim=6, heads=2).double()
    with torch.no_grad():  # in_proj = [W^Q; W^K; W^V] stacked, as torch lays it out
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        theirs.out_proj.bias.copy_(ours.out_proj.bias)
    x, mem = _randn(B, I, 6, seed=14, grad=True), _randn(B, J, 6, seed=15, grad=True)
    y, w = ours(x, mem, mask=KEEP[:, None, None, :], return_weights=True)
    # torch's key_padding_mask is True = ignore, the opposite of qkv's masks
    y_t, w_t = theirs(x, mem, mem, key_padding_mask=~KEEP, average_attn_weights=False)
    _close(y, y_t)
    _close(w, w_t)
    _same_grads((y, w), (y_t, w_t), [x, mem])
    _close(qkv.MultiHeadAttention.from_torch(theirs)(x, mem, mask=KEEP[:, None, None, :]), y_t)


def test_unbatched_shapes_as_in_torch():
    m = qkv.MultiHeadAttention(dim=6, heads=2).double()
    y, w = m(_randn(I, 6, seed=16), _randn(J, 6, seed=17), return_weights=True)
    assert y.shape == (I, 6) and w.shape == (2, I, J)


@pytest.mark.parametrize("dim", [6, 7])
def test_sinusoidal_is_sin_on_even_cos_on_odd(dim):
    # PE(pos, 2k) = sin(pos / 10000^(2k/d)), PE(pos, 2k+1) = cos(pos / 10000^(2k/d)); odd d drops the last cosine.
    start, length = 3, 9
    pe = lambda pos, c: (math.sin if c % 2 == 0 else math.cos)(pos / 10000 ** ((c - c % 2) / dim))  # noqa: E731
    expected = torch.tensor([[pe(pos, c) for c in range(dim)] for pos in range(start, start + length)], dtype=F64)
    _close(sinusoidal(length, dim, start=start, dtype=F64), expected)
    x = _randn(B, length, dim, seed=18)
    _close(SinusoidalEncoding(dim)(x, start), x + expected)


def test_padded_keys_never_matter_and_an_empty_row_gets_nothing():
    q, k, v = _randn(B, 1, I, DQ, seed=19), _randn(B, 1, J, DQ, seed=20), _randn(B, 1, J, 2, seed=21)
    keep = KEEP.clone()
    keep[0] = False  # row 0 sees no key at all
    out, w = qkv.attention(q, k, v, mask=keep[:, None, None, :], return_weights=True)
    assert torch.all(w[0] == 0) and torch.all(out[0] == 0)  # documented: zero output, zero weights
    assert torch.all(w[1, ..., J - 2 :] == 0)
    _close(w[1].sum(-1), torch.ones(1, I, dtype=F64))
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[1, :, J - 2 :], junk_v[1, :, J - 2 :] = 1e6, float("nan")  # whatever the padding holds
    out2, w2 = qkv.attention(q, junk_k, junk_v, mask=keep[:, None, None, :], return_weights=True)
    _close(out2, out)
    _close(w2, w)


# -- the README's models -------------------------------------------------------------------------------
SEQ = dict(src_vocab=11, tgt_vocab=9, embed_dim=4, hidden=6, attention_dim=5)
SRC = torch.tensor([[5, 3, 7, 4, 8], [6, 9, 3, 0, 0]])  # row 1: 3 real tokens, then padding (id 0)
LENGTHS, TGT = torch.tensor([5, 3]), torch.tensor([[1, 4, 5, 3], [1, 6, 3, 7]])  # decoder inputs, bos first


def test_bahdanau_weights_are_its_additive_alignment():
    torch.manual_seed(0)
    model = Bahdanau(Seq2SeqConfig(**SEQ)).double()
    _, w = model(SRC, TGT, LENGTHS, return_weights=True)
    assert w.shape == (2, 4, 5)
    annotations, _ = model.encoder(SRC, LENGTHS)
    a = model.attention.score
    s = torch.tanh(model.init_state(annotations[:, 0, 3:]))  # s_0 = tanh(W_s ←h_1)
    keep = torch.arange(5) < LENGTHS[:, None]
    steps = []
    for t in range(TGT.shape[1]):  # e_ij = v_aᵀ tanh(W_a s_{i−1} + U_a h_j), queried *before* the step
        e = _by_element(_bahdanau(a), s[:, None], annotations)[:, 0]
        alpha = _softmax_visible(e, keep)
        c = torch.einsum("bj,bjd->bd", alpha, annotations)
        s = model.cell(torch.cat([model.target_embed(TGT[:, t]), c], -1), s)  # s_i = GRU([E y_{i−1}; c_i], s_{i−1})
        steps.append(alpha)
    _close(w, torch.stack(steps, 1))
    assert torch.all(w[1, :, 3:] == 0)
    _close(w.sum(-1), torch.ones(2, 4, dtype=F64))


def test_luong_weights_are_its_general_alignment_with_input_feeding():
    torch.manual_seed(0)
    model = Luong(LuongConfig(**SEQ, score="general", alignment="global")).double()
    logits, w = model(SRC, TGT, LENGTHS, return_weights=True)
    annotations, final = model.encoder(SRC, LENGTHS)
    h, h_tilde = torch.cat([final[-2], final[-1]], -1), torch.zeros(2, 6, dtype=F64)
    keep, w_a = torch.arange(5) < LENGTHS[:, None], model.alignment.score.weight
    steps, outs = [], []
    for t in range(TGT.shape[1]):  # h_t = GRU([E y_{t−1}; h̃_{t−1}], h_{t−1}); score(h_t, h̄_s) = h_tᵀ W_a h̄_s
        h = model.rnn(torch.cat([model.target_embed(TGT[:, t]), h_tilde], -1)[:, None], h[None])[1][0]
        alpha = _softmax_visible(torch.einsum("bd,de,bje->bj", h, w_a, annotations), keep)
        c = torch.einsum("bj,bjd->bd", alpha, annotations)
        h_tilde = torch.tanh(model.combine(torch.cat([c, h], -1)))  # h̃_t = tanh(W_c [c_t; h_t])
        steps.append(alpha)
        outs.append(model.out(h_tilde))  # W_s h̃_t
    _close(w, torch.stack(steps, 1))
    real = torch.isfinite(logits)  # pad and bos are -inf: the model never writes them
    _close(logits[real], torch.stack(outs, 1)[real])
    assert torch.all(w[1, :, 3:] == 0) and real[..., 3:].all()


def test_local_p_is_global_times_a_gaussian_around_p_t():
    al = LuongAlignment(scores.Dot(), "local-p", window=2, query_dim=DQ, predictor_hidden=3).double()
    q, k = _randn(B, I, DQ, seed=22), _randn(B, 5, DQ, seed=23)
    lengths = torch.tensor([5, 3])
    ctx, w = al(q, k, lengths)
    keep = torch.arange(5) < lengths[:, None, None]
    p = lengths[:, None] * torch.sigmoid(torch.tanh(q @ al.predictor.proj.weight.T) @ al.predictor.v.weight[0])
    dist = torch.arange(5, dtype=F64) - p[..., None]  # p_t = S · sigmoid(v_pᵀ tanh(W_p h_t)), σ = D/2
    expected = _softmax_visible(q @ k.mT, keep) * torch.exp(-(dist**2) / (2 * 1.0**2)) * (dist.abs() <= 2)
    _close(w, expected)
    _close(ctx, expected @ k)
    assert torch.all(w[1, :, 3:] == 0) and torch.all(w.sum(-1) <= 1 + 1e-12)  # not renormalised


def test_target_attention_is_din_pooling_with_softmax():
    torch.manual_seed(0)
    model = TargetAttention(12, dim=4, attention_dim=3, hidden=5).double()
    candidate, history = torch.tensor([3, 7, 5]), torch.tensor([[4, 8, 2, 0], [9, 0, 0, 0], [0, 0, 0, 0]])
    logits, w = model(candidate, history, return_weights=True)
    assert logits.shape == (3,) and w.shape == (3, 4)
    a, e_c, e_j = model.attention.score, model.items(candidate), model.items(history)
    keep = history != 0
    e = _by_element(_bahdanau(a), e_c[:, None], e_j)[:, 0]  # vᵀ tanh(W_q e_c + W_k e_j)
    alpha = _softmax_visible(e, keep)  # α_j = softmax_j vᵀ tanh(W_q e_c + W_k e_j) over real history items
    u = torch.einsum("bj,bjd->bd", alpha, e_j)  # u = Σ_j α_j e_j; the last user has none: u = 0
    hand = model.scorer(torch.cat([u, e_c, u * e_c], -1)).squeeze(-1)
    _close(w, alpha)
    _close(logits, hand)
    assert torch.all(w[~keep] == 0) and torch.all(w[2] == 0) and torch.all(u[2] == 0)
    _close(w[:2].sum(-1), torch.ones(2, dtype=F64))
    _same_grads((logits, w), (hand, alpha), list(model.parameters()))
    _close(model(candidate, torch.cat([history, torch.zeros(3, 2, dtype=torch.long)], 1)), logits)  # more padding


def _trains(model, loss_fn, steps=30):
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    losses = []
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.5 * losses[0], losses


def test_tiny_models_train_without_nan():
    torch.manual_seed(0)
    src = torch.randint(3, 11, (6, 5))
    src[3:, 3:] = 0
    lengths = torch.tensor([5, 5, 5, 3, 3, 3])
    tgt = torch.cat([torch.ones(6, 1, dtype=torch.long), src[:, :3] % 6 + 3, torch.full((6, 1), 2)], 1)  # bos y eos
    for model in (Bahdanau(Seq2SeqConfig(**SEQ)), Luong(LuongConfig(**SEQ, score="concat", alignment="local-p"))):
        _trains(model, lambda: model.loss(src, tgt, lengths))
    rec = TargetAttention(12, dim=4, attention_dim=3, hidden=5)
    cand, hist = torch.randint(1, 12, (16,)), torch.randint(0, 12, (16, 5))
    clicked = (hist % 2 == cand[:, None] % 2).logical_and(hist != 0).sum(1) >= 2
    _trains(rec, lambda: rec.loss(cand, hist, clicked))


_Q, _K = torch.ones(2, 3, 4), torch.ones(2, 5, 4)  # (b, i, d), (b, j, d)
_MHA = qkv.MultiHeadAttention(8, 2)
_BOOL = dict(dtype=torch.bool)
BAD_INPUT = {  # what the caller got wrong: (the call, the message it must raise)
    "q of 1 dim": (lambda: qkv.attention(torch.ones(4), _K, _K),
                   r"q: expected at least 2 dims \(\.\.\., i, d\), got shape \(4,\)"),
    "query of 4 dims": (lambda: _MHA(torch.ones(2, 3, 3, 8)),
                        r"query: expected shape \(b, length, 8\) \(batch first\), got \(2, 3, 3, 8\)"),
    "dot of unequal sizes": (lambda: qkv.Attention("dot")(_Q, _K[..., :3]),
                             r"k: the dot score needs the same size for q and k, expected last dim 4, got 3"),
    "general of other sizes": (lambda: scores.Bilinear(4, 5)(_Q, _K), r"k: expected last dim 5 for this score, got 4"),
    "concat of other sizes": (lambda: scores.Additive(5, 4, hidden=3)(_Q, _K),
                              r"q: expected last dim 5 for this score, got 4"),
    "key of another batch": (lambda: qkv.Attention("dot")(_Q, _K[:1]), r"key: expected batch 2 like query, got 1"),
    "location, longer source": (lambda: qkv.Attention(scores.Location(4, 4))(_Q, _K),
                                r"k: the location score was built for at most max_len=4 keys, got j=5"),
    "Luong location, longer src": (lambda: Luong(LuongConfig(**SEQ, score="location", max_src_len=4))(SRC, TGT),
                                   r"src: the location score was built for max_src_len=4, got a source of length 5"),
    "mask (b, i, j) of other i": (lambda: qkv.Attention("dot")(_Q, _K, mask=torch.ones(2, 4, 5, **_BOOL)),
                                  r"mask: expected shape broadcastable to \(b, h, i, j\) = \(2, 1, 3, 5\)"),
    "padding mask of other j": (lambda: _MHA(torch.ones(2, 3, 8), mask=torch.ones(2, 1, 1, 4, **_BOOL)),
                                r"mask: expected .* \(b, h, i, j\) = \(2, 2, 3, 3\), got \(2, 1, 1, 4\)"),
    "unknown score (module)": (lambda: qkv.Attention("softdot"),
                               r"score: expected one of \[.*'dot'.*\] or a qkv.scores.Score, got 'softdot'"),
    "unknown score (function)": (lambda: qkv.attention(_Q, _K, _K, score="softdot"),
                                 r"score: expected one of .* got 'softdot'"),
    "unknown score (Luong)": (lambda: LuongConfig(**SEQ, score="softdot"),
                              r"score: expected one of \('dot', .*'mlp', 'location'\) .*got 'softdot'"),
    "learned score, no size": (lambda: qkv.Attention("general"),
                               r"score: 'general' has learned parameters, so it needs the query size"),
    "history of other batch": (lambda: TargetAttention(12, 4)(torch.tensor([1, 2]), torch.tensor([[1, 2]])),
                               r"history: expected one row per candidate \(b=2\), got 1"),
    "tgt of other batch": (lambda: Bahdanau(Seq2SeqConfig(**SEQ))(SRC, TGT[:1]),
                           r"tgt: expected the batch size of src \(2\), got 1"),
    "x of other dim": (lambda: SinusoidalEncoding(6)(torch.ones(2, 3, 5)),
                       r"x: expected shape \(b, i, 6\), got \(2, 3, 5\)"),
}


@pytest.mark.parametrize("call, message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_names_the_argument_and_what_was_expected(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_memory_of_another_batch_is_blamed_on_key():
    with pytest.raises(ValueError, match=r"^key: "):
        _MHA(torch.ones(2, 3, 8), torch.ones(3, 4, 8))
