"""Tests of ``qkv.edits``: each edit on random tensors against the literal definition, in float64.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

Oracle: ``tests/reference.literal_attention`` (Python loops, double precision), with the
edit applied by hand as its paper or TransformerLens defines it. Distinct odd sizes (b=2,
h=6, g=3, i=5, j=7, d=11, e=13) so that a swapped axis fails.
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import bottom_right_causal, literal_attention, random_qkv

import qkv
from qkv.edits import AblateHeads, Knockout, PatchPattern, ScaleHeads, recorded
from qkv.edits.base import Call
from qkv.edits.knockout import Except

B, H, G, I, J, D, E = 2, 6, 3, 5, 7, 11, 13
TOL = dict(atol=1e-10, rtol=1e-10)


def _inputs(seed=0):
    return [x.detach() for x in random_qkv(B, H, G, I, J, D, E, seed=seed)]


def _literal(q, k, v, **kw):
    return literal_attention(q, k, v, scale=1 / math.sqrt(D), **kw)


def _edges(seed=1):
    """A random knockout, True = removed, that leaves every row at least one key."""
    edges = torch.rand(B, H, I, J, generator=torch.Generator().manual_seed(seed)) < 0.4
    edges[..., 0] = False
    return edges


# ---------------------------------------------------------------- each edit alone


@pytest.mark.parametrize("heads", [[1, 4], 2, slice(0, 6, 5), torch.tensor([5])])
def test_zero_ablation_zeroes_those_heads_only(heads):
    q, k, v = _inputs()
    out_ref, _ = _literal(q, k, v, mask=bottom_right_causal(I, J))
    out = qkv.edits.attention(q, k, v, AblateHeads(heads), causal=True)
    gone = torch.zeros(H, dtype=torch.bool)
    gone[torch.arange(H)[heads]] = True
    expected = torch.where(gone[:, None, None], torch.zeros(()), out_ref)
    torch.testing.assert_close(out, expected, **TOL)


def test_mean_ablation_is_transformer_lens_mean_over_batch_and_positions():
    q, k, v = _inputs()
    out_ref, _ = _literal(q, k, v)
    out = qkv.edits.attention(q, k, v, AblateHeads([0, 3], how="mean"))
    expected = out_ref.clone()
    for n in (0, 3):  # TransformerLens: z[:, :, n, :] = z[:, :, n, :].mean((0, 1)), z as (b, pos, head, e)
        expected[:, n] = out_ref.transpose(1, 2)[:, :, n, :].mean((0, 1))
    torch.testing.assert_close(out, expected, **TOL)


def test_ablation_to_a_given_value_per_head():
    q, k, v = _inputs()
    value = torch.randn(2, E, dtype=torch.float64)
    out = qkv.edits.attention(q, k, v, AblateHeads([4, 1], how=value))
    assert torch.equal(out[:, 4], value[0].expand(B, I, E)) and torch.equal(out[:, 1], value[1].expand(B, I, E))
    with pytest.raises(ValueError, match=r"AblateHeads: how expected a tensor of shape \(2, 13\)"):
        qkv.edits.attention(q, k, v, AblateHeads([4, 1], how=torch.zeros(3, E)))


@pytest.mark.parametrize("lazy", [False, True])
def test_knockout_is_minus_inf_added_at_those_edges(lazy):
    q, k, v = _inputs()
    if lazy:  # a lazy mask read as "these edges": the future, and keys more than one behind the diagonal
        offset = torch.arange(J) - torch.arange(I)[:, None] - (J - I)
        dense = (offset > 0) | (offset < -1)
        edges = _LazyEdges(dense)
    else:
        dense = edges = _edges()
    minus_inf = torch.zeros(dense.shape, dtype=torch.float64).masked_fill(dense, -math.inf)
    out_ref, w_ref = _literal(q, k, v, bias=minus_inf)
    out, w = qkv.edits.attention(q, k, v, Knockout(edges), return_weights=True)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(w, w_ref, **TOL)
    assert bool((w[dense.expand_as(w)] == 0).all())


class _LazyEdges(qkv.masks.Mask):
    """A lazy mask over a dense table, so Knockout takes its lazy route (``Except``)."""

    def __init__(self, table):
        self.table = table

    def tile(self, t):
        return self.table[t.i0 : t.i1, t.j0 : t.j1]

    def state(self, t):
        part = self.table[t.i0 : t.i1, t.j0 : t.j1]
        return "full" if bool(part.all()) else "empty" if not bool(part.any()) else "partial"


def test_knockout_joins_the_calls_mask_and_a_lazy_knockout_stays_lazy():
    q, k, v = _inputs()
    causal_edges = qkv.masks.causal()  # knocking out what causal allows leaves the future: a row may see nothing
    out = qkv.edits.attention(q, k, v, Knockout(causal_edges), causal=True)
    assert torch.equal(out, torch.zeros_like(out))  # every key of every row gone: zero rows, qkv's convention
    edited, call = qkv.edits.edited(q, k, v, Knockout(_edges()), causal=True)
    assert isinstance(call.options["mask"], qkv.masks.Mask)
    out_ref, _ = _literal(q, k, v, mask=bottom_right_causal(I, J) & ~_edges())
    torch.testing.assert_close(edited, out_ref, **TOL)


@pytest.mark.parametrize("route", ["fused", "score_mod"])
def test_scale_heads_multiplies_each_heads_logits(route):
    q, k, v = _inputs()
    scale = torch.tensor([0.5, 1.0, 2.0, 0.0, 3.0, 1.5], dtype=torch.float64)
    bias = torch.randn(I, J, dtype=torch.float64) if route == "score_mod" else None
    out, w = qkv.edits.attention(q, k, v, ScaleHeads(scale), bias=bias, return_weights=True)
    _, call = qkv.edits.edited(q, k, v, ScaleHeads(scale), bias=bias)
    assert (call.options.get("score_mod") is None) == (route == "fused")  # the fused route only scales q
    for n in range(H):
        sub = slice(n, n + 1)
        kv = slice(n // 2, n // 2 + 1)
        logits_bias = None if bias is None else scale[n] * bias
        out_n, w_n = literal_attention(q[:, sub], k[:, kv], v[:, kv], scale=float(scale[n]) / math.sqrt(D), bias=logits_bias)
        torch.testing.assert_close(out[:, sub], out_n, **TOL)
        torch.testing.assert_close(w[:, sub], w_n, **TOL)


def test_scale_heads_comes_before_the_calls_score_mod_and_gets_gradients():
    q, k, v = _inputs()
    scale = torch.linspace(0.5, 2.0, H, dtype=torch.float64).requires_grad_()
    cap = qkv.SoftCap(2.0)
    bias = torch.randn(I, J, dtype=torch.float64)
    out = qkv.edits.attention(q, k, v, ScaleHeads(scale), bias=bias, score_mod=cap)
    logits = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, 1)) / math.sqrt(D) + bias
    logits = 2.0 * torch.tanh(scale[:, None, None] * logits / 2.0)
    expected = logits.softmax(-1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, expected, **TOL)
    (grad,) = torch.autograd.grad(out.sum(), scale)
    (grad_ref,) = torch.autograd.grad(expected.sum(), scale)
    torch.testing.assert_close(grad, grad_ref, **TOL)


def test_patch_pattern_recomputes_only_those_rows():
    q, k, v = _inputs()
    pattern = torch.rand(B, 2, 2, J, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pattern = pattern / pattern.sum(-1, keepdim=True)
    out, w = qkv.edits.attention(q, k, v, PatchPattern([1, 4], [0, 3], pattern), return_weights=True)
    out_ref, w_ref = _literal(q, k, v)
    for a, n in enumerate((1, 4)):
        for c, r in enumerate((0, 3)):
            w_ref[:, n, r] = pattern[:, a, c]
            for f in range(E):  # literally: Σ_c α'[c] v[n // 2, c, f]
                out_ref[:, n, r, f] = sum(pattern[:, a, c, col] * v[:, n // 2, col, f] for col in range(J))
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(w, w_ref, **TOL)


def test_patch_pattern_shows_in_weights_for_and_checks_its_shape():
    q, k, v = _inputs()
    pattern = torch.full((2, 1, J), 1 / J, dtype=torch.float64)  # no batch dim: broadcast
    edit = PatchPattern([2, 5], 4, pattern)
    _, w = qkv.edits.attention(q, k, v, edit, return_weights=True, weights_for={"heads": [5, 0], "rows": [4, 1]})
    _, w_all = qkv.edits.attention(q, k, v, edit, return_weights=True)
    torch.testing.assert_close(w, w_all[:, [5, 0]][:, :, [4, 1]], **TOL)
    assert torch.equal(w[:, 0, 0], torch.full((B, J), 1 / J, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"PatchPattern: pattern expected shape \(\.\.\., 2, 1, 7\) \(heads, rows, j\), got \(2, 2, 7\)"):
        qkv.edits.attention(q, k, v, PatchPattern([2, 5], 4, torch.zeros(2, 2, J, dtype=torch.float64)))


# ---------------------------------------------------------------- composition and errors


def test_edits_compose_in_order():
    q, k, v = _inputs()
    edges = _edges()
    scale = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0, 3.0], dtype=torch.float64)
    pattern = torch.zeros(1, 1, J, dtype=torch.float64)
    pattern[..., 2] = 1.0
    edits = [Knockout(edges), ScaleHeads(scale), AblateHeads([0]), PatchPattern(0, 1, pattern)]
    out = qkv.edits.attention(q, k, v, edits)
    for n in range(H):
        kv = slice(n // 2, n // 2 + 1)
        out_n, _ = literal_attention(q[:, n : n + 1], k[:, kv], v[:, kv], scale=float(scale[n]) / math.sqrt(D), mask=~edges[:, n : n + 1])
        if n == 0:  # ablated, then its row 1 patched back: one-hot on key 2
            out_n = torch.zeros_like(out_n)
            out_n[:, 0, 1] = v[:, 0, 2]
        torch.testing.assert_close(out[:, n : n + 1], out_n, **TOL)
    ablate_last = qkv.edits.attention(q, k, v, [PatchPattern(0, 1, pattern), AblateHeads([0])])
    assert torch.equal(ablate_last[:, 0], torch.zeros(B, I, E, dtype=torch.float64))


def test_no_edits_is_qkv_attention():
    q, k, v = _inputs()
    assert torch.equal(qkv.edits.attention(q, k, v, [], causal=True), qkv.attention(q, k, v, causal=True))


def test_errors_name_the_argument():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"edits: expected a qkv.edits edit"):
        qkv.edits.attention(q, k, v, "ablate")
    with pytest.raises(ValueError, match=r"AblateHeads: heads: expected indices in \[0, 6\)"):
        qkv.edits.attention(q, k, v, AblateHeads([6]))
    with pytest.raises(ValueError, match=r"AblateHeads: how expected 'zero', 'mean' or a tensor"):
        AblateHeads([0], how="max")
    with pytest.raises(TypeError, match=r"Knockout: edges expected a bool tensor \(True = knocked out\)"):
        Knockout(torch.zeros(I, J))
    with pytest.raises(ValueError, match=r"ScaleHeads: scale expected 6 entries \(one per query head\), got 2"):
        qkv.edits.attention(q, k, v, ScaleHeads([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"q: edits name heads, so q needs a head dim"):
        qkv.edits.attention(q[0, 0], k[0, 0], v[0, 0], AblateHeads(0))



@pytest.mark.parametrize("make", [
    lambda heads: AblateHeads(heads),
    lambda heads: PatchPattern(heads, 0, torch.ones(1, 1, J)),
    lambda rows: PatchPattern(0, rows, torch.ones(1, 1, J)),
])
@pytest.mark.parametrize("bad", [torch.zeros(2, 2, dtype=torch.long), torch.tensor([0.0, 1.0]), torch.tensor([True]), [0, 1.5], ["0"], [True]])
def test_a_selection_no_call_could_take_is_refused_when_the_edit_is_made(make, bad):
    """A 2-d, float or bool tensor, or a list holding a non-int, fails at the edit, not at its first call."""
    with pytest.raises(TypeError, match=r"(AblateHeads|PatchPattern): (heads|rows): expected"):
        make(bad)



def test_a_head_or_row_named_twice_with_two_values_is_refused():
    """Two rows of ``how`` or ``pattern`` for one head (or row) would leave which one is used to chance."""
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"AblateHeads: heads: \[1, 1\] names head 1 twice"):
        qkv.edits.attention(q, k, v, AblateHeads([1, 1], how=torch.stack([torch.zeros(E), torch.ones(E)]).double()))
    pattern = torch.full((2, 1, J), 1 / J, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"PatchPattern: heads: \[0, -6\] names head 0 twice"):
        qkv.edits.attention(q, k, v, PatchPattern([0, -6], 0, pattern))
    with pytest.raises(ValueError, match=r"PatchPattern: rows: \[2, 2\] names row 2 twice"):
        qkv.edits.attention(q, k, v, PatchPattern(0, [2, 2], pattern.transpose(0, 1)))
    # the same value twice is no ambiguity: a zero or mean ablation may name a head twice
    torch.testing.assert_close(qkv.edits.attention(q, k, v, AblateHeads([1, 1])), qkv.edits.attention(q, k, v, AblateHeads([1])))


# ---------------------------------------------------------------- what a recording builds


def test_recorded_scores_pattern_and_z_for_chosen_heads_and_rows():
    q, k, v = _inputs()
    edges = _edges()
    bias = torch.randn(I, J, dtype=torch.float64)
    call = Call(q, k, v, {"mask": ~edges, "bias": bias, "causal": True})
    heads, rows = torch.tensor([4, 1]), torch.tensor([2, 4])
    allowed = ~edges & bottom_right_causal(I, J)
    logits = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, 1)) / math.sqrt(D) + bias
    logits = logits.masked_fill(~allowed, -math.inf)
    chosen = lambda x: x[:, heads][:, :, rows]  # noqa: E731
    torch.testing.assert_close(recorded.scores(call, heads, rows), chosen(logits), **TOL)
    out_ref, w_ref = _literal(q, k, v, mask=allowed, bias=bias)
    torch.testing.assert_close(recorded.pattern(call, heads, rows), chosen(w_ref), **TOL)
    assert recorded.z(out_ref, heads, rows).shape == (B, 2, 2, E)  # (b, pos, head, e)
    torch.testing.assert_close(recorded.z(out_ref, heads, rows), chosen(out_ref).transpose(1, 2), **TOL)


def test_a_lazy_knockout_keeps_a_memory_efficient_path_on_a_long_call():
    q, k, v = (torch.randn(1, 2, 2048, 16) for _ in range(3))
    beyond = Except(qkv.masks.window(left=64, right=0))  # knocked out: every key outside a 64-token window
    edit = Knockout(beyond)
    path = qkv.explain(q, k, v, **edit.prepare(Call(q, k, v, {"causal": True})).options)
    assert path.startswith("backend: chunked"), path  # tile by tile: the (i, j) logits are never materialised


def test_multi_head_attention_takes_edits_on_its_mechanism():
    """``mha.attention.edits``: zero-ablating a head equals zeroing that head's columns of W_O."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(dim=24, heads=4).double().eval()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    plain_weight = mha.out_proj.weight.detach().clone()
    mha.attention.edits = [qkv.edits.AblateHeads([1])]
    got = mha(x, causal=True)
    mha.attention.edits = None
    with torch.no_grad():
        mha.out_proj.weight[:, 6:12] = 0  # head 1's value columns (dim_value_head = 6)
    want = mha(x, causal=True)
    with torch.no_grad():
        mha.out_proj.weight.copy_(plain_weight)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(mha(x, causal=True), want)


# ---------------------------------------------------------------- random compositions


@st.composite
def edit_lists(draw):
    """1-4 edits of every kind in any order, on calls with or without causal, grouped heads, float64."""
    heads_of = lambda: sorted(set(draw(st.lists(st.integers(0, H - 1), min_size=1, max_size=3))))  # noqa: E731
    kinds = draw(st.lists(st.sampled_from(["ablate", "mean", "knockout", "scale", "patch"]), min_size=1, max_size=4))
    specs = []
    for kind in kinds:
        if kind in ("ablate", "mean", "scale"):
            specs.append((kind, heads_of()))
        elif kind == "knockout":
            specs.append((kind, draw(st.integers(0, 2**16))))
        else:
            specs.append((kind, heads_of(), sorted(set(draw(st.lists(st.integers(0, I - 1), min_size=1, max_size=3))))))
    return specs, draw(st.booleans()), draw(st.integers(0, 2**16))


def _oracle(q, k, v, specs, causal, gen):
    """The definitions, in float64: logits tempered and masked, a softmax, then each output edit in list order."""
    r = H // G
    kr, vr = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    logits = q @ kr.transpose(-1, -2) / math.sqrt(D)
    allowed = torch.ones(B, H, I, J, dtype=torch.bool)
    if causal:
        allowed &= bottom_right_causal(I, J)
    edits = []
    for spec in specs:
        if spec[0] == "knockout":
            edges = torch.rand(B, H, I, J, generator=torch.Generator().manual_seed(spec[1])) < 0.4
            allowed &= ~edges
            edits.append(Knockout(edges))
        elif spec[0] == "scale":
            scale = torch.ones(H, dtype=torch.float64)
            scale[spec[1]] = torch.rand(len(spec[1]), generator=gen, dtype=torch.float64) * 3
            logits = logits * scale[:, None, None]
            edits.append(ScaleHeads(scale))
        elif spec[0] in ("ablate", "mean"):
            edits.append(AblateHeads(spec[1], how="zero" if spec[0] == "ablate" else "mean"))
        else:
            pattern = torch.rand(B, len(spec[1]), len(spec[2]), J, generator=gen, dtype=torch.float64)
            edits.append(PatchPattern(spec[1], spec[2], pattern / pattern.sum(-1, keepdim=True)))
    live = allowed.any(-1, keepdim=True)
    w = torch.where(allowed, logits, -math.inf).masked_fill(~live, 0.0).softmax(-1) * live
    z = w @ vr
    for spec, edit in zip(specs, edits):  # the output edits, in list order
        if spec[0] == "ablate":
            z[:, spec[1]] = 0.0
        elif spec[0] == "mean":
            z[:, spec[1]] = z[:, spec[1]].mean((0, 2), keepdim=True).expand_as(z[:, spec[1]])
        elif spec[0] == "patch":
            for a, n in enumerate(spec[1]):
                z[:, n, spec[2]] = edit.pattern[:, a] @ vr[:, n]
    return z, edits


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=edit_lists())
def test_random_compositions_of_edits_equal_their_definitions(case):
    specs, causal, seed = case
    q, k, v = _inputs(seed)
    want, edits = _oracle(q, k, v, specs, causal, torch.Generator().manual_seed(seed))
    torch.testing.assert_close(qkv.edits.attention(q, k, v, edits, causal=causal), want, **TOL)
