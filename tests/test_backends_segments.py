"""The segments backend: ``documents(ids) & rest`` as one call per document, against the reference.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13. Two batch rows
with different documents, one of them with a document that has no key.
"""

import pytest
import reference as ref
import torch

import qkv
from qkv import checks
from qkv.backends import padded_rows, segments
from qkv.masks import documents

B, H, G, D, E = 2, 6, 3, 11, 13
IDS_Q = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 6, 6, 6, 6, 7, 7, 9]])
IDS_K = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3], [5, 5, 6, 6, 6, 6, 7, 7, 7, 8, 8]])


def sine_mod(score, b, h, q_idx, kv_idx):
    """Reads every index: a document's own call must see the caller's batch row and positions."""
    return score + 0.3 * torch.sin(0.5 * q_idx - 0.3 * kv_idx + b + 0.2 * h)


def cases():
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(B, H, 9, 11, generator=gen, dtype=torch.float64)
    return {
        "documents": dict(mask=documents(IDS_Q, IDS_K)),
        "documents&causal": dict(mask=documents(IDS_Q, IDS_K) & qkv.masks.causal()),
        "causal&documents": dict(mask=qkv.masks.causal() & documents(IDS_Q, IDS_K)),
        "causal=True": dict(mask=documents(IDS_Q, IDS_K), causal=True),
        "window&lengths": dict(mask=documents(IDS_Q, IDS_K) & qkv.masks.window(1, 1) & qkv.masks.lengths(torch.tensor([11, 7]))),
        "alibi": dict(mask=documents(IDS_Q, IDS_K), bias=qkv.ALiBi(H).double(), causal=True),
        "dense_bias": dict(mask=documents(IDS_Q, IDS_K), bias=dense),
        "score_mod": dict(mask=documents(IDS_Q, IDS_K), score_mod=sine_mod),
        "softcap_sinks": dict(mask=documents(IDS_Q, IDS_K), score_mod=qkv.SoftCap(2.0), sinks=torch.randn(H, generator=gen, dtype=torch.float64)),
        "additive": dict(mask=documents(IDS_Q, IDS_K), score=qkv.scores.Additive(D, D, 5).double()),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_one_call_per_document_equals_the_reference(name):
    kw = cases()[name]
    q, k, v = ref.random_qkv(B, H, G, 9, 11, D, E)
    req = checks.request(q, k, v, **{"score": "scaled_dot", "bias": None, "causal": False, "scale": None, "dropout": 0.0,
                                     "return_weights": False, **kw})  # fmt: skip
    assert segments.supports(req) is None
    assert qkv.explain(q, k, v, **kw).splitlines()[0] == "backend: segments"
    got = ref.run_with_grads(lambda: qkv.attention(q, k, v, return_lse=True, **kw), [q, k, v])
    want = ref.run_with_grads(lambda: qkv.attention(q, k, v, return_lse=True, backend="reference", **kw), [q, k, v])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_document_with_no_key_gives_zeros_and_no_mass():
    q, k, v = ref.random_qkv(B, H, G, 9, 11, D, E)
    out, lse = qkv.attention(q, k, v, mask=documents(IDS_Q, IDS_K), return_lse=True)
    assert torch.equal(out[1, :, 8], torch.zeros_like(out[1, :, 8]))  # document 9 of row 1 has no key
    assert bool(torch.isneginf(lse[1, :, 8]).all())


def test_what_it_does_not_take_goes_to_the_chunked_backend():
    q, k, v = ref.random_qkv(B, H, G, 9, 9, D, E)
    scattered = documents(torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2, 2]] * 2))
    cases = {
        "a document's tokens are not contiguous": dict(mask=scattered),
        "it does not return weights": dict(mask=documents(IDS_Q), return_weights=True, weights_for={"rows": [1]}),
        "the location score reads key positions": dict(mask=documents(IDS_Q), score=qkv.scores.Location(D, 9).double()),
        "the mask has no lazy documents": dict(mask=qkv.masks.causal()),
    }
    for reason, kw in cases.items():
        text = qkv.explain(q, k, v, **kw)
        assert f"not segments: {reason}" in text, text
        got = qkv.attention(q, k, v, **kw)
        want = qkv.attention(q, k, v, backend="reference", **kw)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_each_document_takes_its_fastest_path(monkeypatch):
    """A packed causal batch is a causal square per document: SDPA with is_causal, no mask built."""
    q, k, v = (x.detach().float() for x in ref.random_qkv(1, H, G, 9, 9, D, E))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    qkv.attention(q, k, v, mask=documents(IDS_Q[:1]) & qkv.masks.causal())
    assert calls == [(None, True)] * 3


@pytest.mark.parametrize("name", ["documents&causal", "softcap_sinks", "alibi"])
def test_without_gradients_each_piece_is_written_in_place_with_the_same_result(name):
    """Under no_grad the pieces go straight into the output (a lower peak); the values are those of the differentiable path."""
    kw = cases()[name]
    q, k, v = ref.random_qkv(B, H, G, 9, 11, D, E)
    want = qkv.attention(q, k, v, return_lse=True, **kw)
    with torch.no_grad():
        got = qkv.attention(q, k, v, return_lse=True, **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b.detach())


def test_varlen_without_gradients_equals_varlen_with_them():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)  # an empty sequence and a one-token one
    q, k, v = (torch.randn(13, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = qkv.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    with torch.no_grad():
        got = qkv.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# Padded batches: one call per batch row over its real keys.
PAD_B, PAD_I = 3, 12


def padded_cases():
    gen = torch.Generator().manual_seed(5)
    lengths, starts = torch.tensor([5, 12, 1]), torch.tensor([7, 0, 11])
    return {
        "lengths & causal": dict(mask=qkv.masks.lengths(lengths), causal=True),
        "starts & causal": dict(mask=qkv.masks.starts(starts) & qkv.masks.causal()),
        "lengths (bidirectional)": dict(mask=qkv.masks.lengths(lengths)),
        "causal & starts, window": dict(mask=qkv.masks.window(3) & qkv.masks.starts(starts)),
        "lengths & causal, alibi": dict(mask=qkv.masks.lengths(lengths), causal=True, bias=qkv.ALiBi(H).double()),
        "lengths & causal, dense bias": dict(mask=qkv.masks.lengths(lengths), causal=True,
                                             bias=torch.randn(PAD_B, H, PAD_I, PAD_I, generator=gen, dtype=torch.float64)),
        "starts & causal, score_mod": dict(mask=qkv.masks.starts(starts), causal=True, score_mod=sine_mod),
        "lengths & causal, sinks": dict(mask=qkv.masks.lengths(lengths), causal=True,
                                        sinks=torch.randn(H, generator=gen, dtype=torch.float64)),
    }  # fmt: skip


@pytest.fixture
def any_size(monkeypatch):
    """Small calls split too (the size thresholds are for speed, not for what is computed)."""
    monkeypatch.setattr(padded_rows, "PADDING_ELEMENTS", 0)
    monkeypatch.setattr(padded_rows, "ROW_ELEMENTS", 0)


@pytest.mark.parametrize("split_as", ["rows", "groups"])
@pytest.mark.parametrize("name", list(padded_cases()))
def test_a_padded_batch_row_by_row_equals_the_reference(name, split_as, monkeypatch):
    """Long rows: a call per row over its real keys; short rows: groups of rows, each group's mask built small."""
    kw = padded_cases()[name]
    if split_as == "groups" and "score_mod" in kw:
        pytest.skip("a score_mod reads the batch row: short rows with one go to the engines")
    # rows: every call splits by rows; groups: rows are "short" and two rows' mask is the most a group may build
    monkeypatch.setattr(padded_rows, "PADDING_ELEMENTS", 0 if split_as == "rows" else 2 * PAD_I * PAD_I)
    monkeypatch.setattr(padded_rows, "ROW_ELEMENTS", 0 if split_as == "rows" else 10**9)
    monkeypatch.setattr(padded_rows, "groups_faster", lambda *args: True)  # short rows: what the timing may choose
    if split_as == "groups":
        monkeypatch.setattr(qkv.backends.sdpa, "MASK_ELEMENTS", 2 * PAD_I * PAD_I)
    q, k, v = ref.random_qkv(PAD_B, H, G, PAD_I, PAD_I, D, E)
    assert qkv.explain(q, k, v, **kw).splitlines()[0] == "backend: segments"
    if split_as == "groups":  # each group's call is SDPA's (or the engines', for what SDPA does not take)
        calls = []
        real = padded_rows.run_row_groups
        monkeypatch.setattr(padded_rows, "run_row_groups", lambda req: calls.append(req.q.shape[0]) or real(req))
    got = ref.run_with_grads(lambda: qkv.attention(q, k, v, return_lse=True, **kw), [q, k, v])
    want = ref.run_with_grads(lambda: qkv.attention(q, k, v, return_lse=True, backend="reference", **kw), [q, k, v])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(qkv.attention(q, k, v, **kw), want[0], rtol=1e-10, atol=1e-10)
    if split_as == "groups":
        assert calls and set(calls) == {PAD_B}


def test_a_padded_causal_batch_is_one_is_causal_call_per_row(monkeypatch, any_size):
    """Right padding: the row's keys cut to its length, top-left causal; left padding: the rows that see a key, a square."""
    q, k, v = (x.detach().float() for x in ref.random_qkv(2, H, G, 10, 10, D, E))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    qkv.attention(q, k, v, mask=qkv.masks.lengths(torch.tensor([4, 10])), causal=True)
    assert calls == [(10, 4, None, True), (10, 10, None, True)]
    calls.clear()
    out = qkv.attention(q, k, v, mask=qkv.masks.starts(torch.tensor([3, 0])), causal=True)
    assert calls == [(7, 7, None, True), (10, 10, None, True)]
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))  # rows before the first real key see none


@pytest.mark.parametrize("mask", ["lengths", "documents"])
def test_a_batch_whose_rows_see_no_key_still_gives_gradients(mask, any_size):
    """No segment to run (every row's keys padded away, or no document shared): zeros, and zero gradients."""
    q, k, v = ref.random_qkv(2, H, G, 10, 10, D, E)
    if mask == "lengths":
        m = qkv.masks.lengths(torch.tensor([0, 0]))
    else:  # queries in document 1, keys in document 2
        m = documents(torch.ones(2, 10, dtype=torch.long), torch.full((2, 10), 2, dtype=torch.long))
    assert qkv.explain(q, k, v, mask=m).splitlines()[0] == "backend: segments"
    out = qkv.attention(q, k, v, mask=m)
    assert out.requires_grad and torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_short_rows_whose_own_mask_is_over_the_group_size_go_one_by_one(monkeypatch):
    """A group holds at most PADDING_ELEMENTS of the mask: a row over it is its own call (never grouped again and again)."""
    monkeypatch.setattr(padded_rows, "PADDING_ELEMENTS", 50)  # below one row's 10 x 10 mask
    monkeypatch.setattr(padded_rows, "ROW_ELEMENTS", 10**9)  # every row "short"
    monkeypatch.setattr(padded_rows, "groups_faster", lambda *args: True)
    monkeypatch.setattr(padded_rows, "run_row_groups", lambda req: pytest.fail("grouped a row larger than a group"))
    q, k, v = ref.random_qkv(2, H, G, 10, 10, D, E)
    mask = qkv.masks.lengths(torch.tensor([4, 10]))
    want = qkv.attention(q, k, v, mask=mask, causal=True, backend="reference")
    torch.testing.assert_close(qkv.attention(q, k, v, mask=mask, causal=True), want, rtol=1e-10, atol=1e-10)


def test_a_one_key_wide_dense_mask_is_broadcast_not_one_key_of_padding(any_size):
    """``(b, 1, 1, 1)`` keeps or hides every key of its row (broadcast), where ``(b, 1, 1, j)`` would be padding."""
    q, k, v = ref.random_qkv(2, H, G, 6, 8, D, E)
    keep = torch.tensor([True, False]).view(2, 1, 1, 1)
    want = qkv.attention(q, k, v, mask=keep, backend="reference")
    torch.testing.assert_close(qkv.attention(q, k, v, mask=keep), want, rtol=1e-10, atol=1e-10)


def test_padding_keys_holding_nan_are_never_read(any_size):
    q, k, v = ref.random_qkv(2, H, G, 10, 10, D, E)
    k, v = k.detach().clone(), v.detach().clone()
    k[0, :, 6:], v[0, :, 6:] = float("nan"), float("inf")
    mask = qkv.masks.lengths(torch.tensor([6, 10]))
    want = qkv.attention(q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0), mask=mask, causal=True, backend="reference")
    torch.testing.assert_close(qkv.attention(q, k, v, mask=mask, causal=True), want, rtol=1e-10, atol=1e-10)


def test_small_padded_batches_stay_one_call():
    q, k, v = ref.random_qkv(2, H, G, 10, 10, D, E)
    text = qkv.explain(q, k, v, mask=qkv.masks.lengths(torch.tensor([4, 10])), causal=True)
    assert "not segments: a padded batch's mask is small here" in text
    q, k, v = (torch.zeros(2, 1, n, 4) for n in (1024, 1024, 1024))
    assert qkv.explain(q, k, v, mask=qkv.masks.lengths(torch.tensor([4, 10])), causal=True).startswith("backend: segments")


def test_a_dense_key_padding_mask_counts_as_padding(any_size):
    """SDPA's dialect gives padding as a bool ``(b, 1, 1, j)``: a prefix per row is ``lengths``, a suffix ``starts``."""
    q, k, v = ref.random_qkv(2, H, G, 10, 10, D, E)
    cols = torch.arange(10)
    right = (cols < torch.tensor([[4], [10]]))[:, None, None, :]
    left = (cols >= torch.tensor([[3], [0]]))[:, None, None, :]
    holes = right.clone()
    holes[1, ..., 5] = False
    for keep, split in ((right, True), (left, True), (holes, False), (qkv.masks.as_mask(right) & qkv.masks.causal(), True)):
        text = qkv.explain(q, k, v, mask=keep)
        assert (text.splitlines()[0] == "backend: segments") is split, text
        if not split:
            assert "not segments: the dense mask keeps neither a prefix nor a suffix of each row's keys" in text
        got = ref.run_with_grads(lambda: qkv.attention(q, k, v, mask=keep, return_lse=True), [q, k, v])
        want = ref.run_with_grads(lambda: qkv.attention(q, k, v, mask=keep, return_lse=True, backend="reference"), [q, k, v])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _graph_nodes(out: torch.Tensor) -> list[str]:
    """The names of the autograd nodes behind ``out``."""
    seen, stack, names = set(), [out.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack += [nxt for nxt, _ in node.next_functions]
    return names


@pytest.mark.parametrize("batch", ["varlen", "padded"])
def test_segments_are_cut_from_their_inputs_once_never_sliced_one_by_one(batch, any_size):
    """A slice's backward fills a zero tensor of its whole input per segment: each input is split once instead."""
    if batch == "varlen":
        q, k, v = (torch.randn(40, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
        cu = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
        out = qkv.varlen_attention(q, k, v, cu, cu, causal=True)
        want = [qkv.attention(q[a:z].transpose(0, 1), k[a:z].transpose(0, 1), v[a:z].transpose(0, 1), causal=True,
                              backend="reference").transpose(0, 1) for a, z in ((0, 10), (10, 25), (25, 40))]  # fmt: skip
        want = torch.cat(want)
    else:
        q, k, v = ref.random_qkv(3, H, H, 12, 12, D, D)
        mask = qkv.masks.lengths(torch.tensor([12, 7, 4]))
        out = qkv.attention(q, k, v, mask=mask, causal=True)
        want = qkv.attention(q, k, v, mask=mask, causal=True, backend="reference")
    nodes = _graph_nodes(out)
    assert "SliceBackward0" not in nodes and ("SplitWithSizesBackward0" in nodes or "SplitBackward0" in nodes)
    got = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected = torch.autograd.grad(want, (q, k, v), torch.ones_like(want))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_pieces_cover_gaps_and_refuse_overlapping_ranges():
    x = torch.arange(10.0).view(1, 1, 10, 1)
    pieces = segments._pieces(x, [(2, 4), (4, 7)])
    assert sorted(pieces) == [(2, 4), (4, 7)] and pieces[(4, 7)].flatten().tolist() == [4.0, 5.0, 6.0]
    assert segments._pieces(x, [(0, 10)])[(0, 10)] is x
    assert segments._pieces(x, [(0, 5), (3, 8)]) == {}  # overlapping: each segment is sliced instead


def test_packed_documents_read_no_hidden_key_only_where_each_key_is_seen_by_its_own_document(monkeypatch):
    """Self-attention over packed documents (one set of ids, alone or with causal) reads no key hidden from every
    query: no output scan, no guard, and a nan in a key reaches only its own document's rows. Cross ids, or a
    window, may hide keys: those calls are still checked."""
    from qkv.backends import hidden_keys

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]] * B)
    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, 9, 9, D, E))

    def reads(mask, causal=False) -> bool:
        req = checks.request(q, k, v, score="scaled_dot", mask=mask, bias=None, causal=causal, scale=None,
                             dropout=0.0, return_weights=False)  # fmt: skip
        return segments.reads_hidden_keys(req)

    assert not reads(documents(ids)) and not reads(documents(ids), causal=True)
    assert reads(documents(ids) & qkv.masks.window(1, 0))
    k11, v11 = (x.detach().float() for x in ref.random_qkv(B, H, G, 9, 11, D, E)[1:])
    req = checks.request(q, k11, v11, score="scaled_dot", mask=documents(IDS_Q, IDS_K), bias=None, causal=False,
                         scale=None, dropout=0.0, return_weights=False)  # fmt: skip
    assert segments.reads_hidden_keys(req)

    checked = []
    for name in ("no_nan", "guard"):
        real = getattr(hidden_keys, name)
        monkeypatch.setattr(hidden_keys, name, lambda x, real=real, name=name: checked.append(name) or real(x))
    k[:, :, 4] = float("nan")  # a key of document 1 in every row: its rows are nan, the others' are not
    for grad in (False, True):
        inputs = [x.clone().requires_grad_(grad) for x in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = qkv.attention(*inputs, mask=documents(ids), causal=True)
        assert out[:, :, 4:5].isnan().all() and not out[:, :, :3].isnan().any() and not out[:, :, 5:].isnan().any()
    assert checked == []


def test_plain_segments_off_the_cpu_are_chosen_for_one_by_one(monkeypatch):
    """On CUDA flex keeps what inductor failed to compile per kind of call (short queries apart), so a short
    segment and a long one may go to different backends: each is asked for, not the first one's answer reused.
    Fake CUDA tensors stand in for a GPU with flex_attention, where the short kind failed to compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qkv.backends import choose, flex_gpu

    monkeypatch.setattr(flex_gpu, "_environment", {"cuda:0": None})
    monkeypatch.setattr(flex_gpu, "_uncompilable", {})
    with FakeTensorMode():

        def segment(n: int):  # one plain segment of a call with sinks (SDPA declines them): (1, h, n, d)
            q, k, v = (torch.empty(1, 4, n, 64, device="cuda") for _ in range(3))
            return checks.request(q, k, v, score="scaled_dot", mask=None, bias=None, causal=False, scale=None,
                                  dropout=0.0, return_weights=False, sinks=torch.zeros(4, device="cuda"))  # fmt: skip

        long, short = segment(200), segment(50)
        flex_gpu._uncompilable[flex_gpu._kind(short)] = "out of resource (as inductor reported it)"
        assert (choose(long)[0].name, choose(short)[0].name) == ("flex", "chunked")
        pick = segments._plain_chooser(choose)
        assert (pick(long).name, pick(short).name) == ("flex", "chunked")
        pick = segments._plain_chooser(choose)
        assert (pick(short).name, pick(long).name) == ("chunked", "flex")
