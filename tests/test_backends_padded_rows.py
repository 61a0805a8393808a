"""Short rows of a padded batch: in groups or a call per row, as timed once per size class.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=4, h=4, g=2, i=j=24, d=8, e=8. The mask of
the whole batch is over the limit SDPA takes built, each row under the limit of short rows:
the probe decides. Its timings are replaced (a test asserts the choice made from them, never
a time).
"""

import pytest
import reference as ref
import torch

import qkv
from qkv.backends import padded_rows

B, H, G, I, D = 4, 4, 2, 24, 8
REAL = torch.tensor([24, 20, 15, 12])


@pytest.fixture
def short_rows(monkeypatch):
    """Every row short, the batch's mask over what SDPA takes built, groups of two rows; answers cleared."""
    monkeypatch.setattr(padded_rows, "PADDING_ELEMENTS", 2 * I * I)
    monkeypatch.setattr(qkv.backends.sdpa, "MASK_ELEMENTS", 2 * I * I)
    monkeypatch.setattr(padded_rows, "ROW_ELEMENTS", 10**9)
    monkeypatch.setattr(padded_rows, "_answers", {})


def timed(monkeypatch, groups: float, rows: float) -> list:
    """Replace the probe's clock: groups take ``groups`` s, a call per row ``rows`` s; returns the probes made."""
    made = []

    def best_times(*calls):
        for call in calls:
            call()  # each way runs, as the probe runs it (fresh inputs, the backward where gradients flow)
        made.append(len(calls))
        return [groups, rows]

    monkeypatch.setattr(padded_rows, "best_times", best_times)
    return made


def spy_calls(monkeypatch) -> list:
    """The (rows, query rows, keys, is_causal, mask given) of each SDPA kernel call."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[0], q.shape[-2], k.shape[-2], bool(kwargs.get("is_causal")), kwargs.get("attn_mask") is not None))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("faster", ["groups", "rows"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_the_faster_way_is_taken_and_both_equal_the_reference(faster, side, short_rows, monkeypatch):
    """Groups: one masked call per two rows; rows: one is_causal call per row over its real keys. Same result."""
    made = timed(monkeypatch, groups=1.0 if faster == "groups" else 2.0, rows=2.0 if faster == "groups" else 1.0)
    q, k, v = (x.detach().float().requires_grad_() for x in ref.random_qkv(B, H, G, I, I, D, D))
    mask = qkv.masks.lengths(REAL) if side == "right" else qkv.masks.starts(I - REAL)
    want = ref.run_with_grads(lambda: qkv.attention(q, k, v, mask=mask, causal=True, backend="reference"), [q, k, v])
    calls = spy_calls(monkeypatch)
    got = ref.run_with_grads(lambda: qkv.attention(q, k, v, mask=mask, causal=True), [q, k, v])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert made == [2]
    timed_calls = calls[-B:] if faster == "rows" else calls[-B // 2 :]  # the probe's own calls came first
    if faster == "groups":
        assert timed_calls == [(2, I, I, False, True)] * 2
    else:
        real = REAL.tolist()
        if side == "right":  # every query row, against the row's first keys, top-left causal
            assert timed_calls == [(1, I, n, True, False) for n in real]
        else:  # the rows that see a key, a causal square
            assert timed_calls == [(1, n, n, True, False) for n in real]


def test_a_size_class_is_timed_once_and_each_class_on_its_own(short_rows, monkeypatch):
    """Cached per dtype, gradients, padding side, heads, head sizes and row length (a power of two)."""
    made = timed(monkeypatch, groups=1.0, rows=2.0)
    q, k, v = ref.random_qkv(B, H, G, I, I, D, D)
    q, k, v = (x.detach().float() for x in (q, k, v))
    mask = qkv.masks.lengths(REAL)
    with torch.no_grad():
        for _ in range(3):
            qkv.attention(q, k, v, mask=mask, causal=True)
    assert made == [2]
    with torch.no_grad():
        qkv.attention(q, k, v, mask=qkv.masks.starts(I - REAL), causal=True)  # the other side
        qkv.attention(q[..., :20, :], k[..., :20, :], v[..., :20, :], mask=qkv.masks.lengths(REAL.clamp(max=20)),
                      causal=True)  # 20 rounds down to 16, 24 to 16 too: the same class  # fmt: skip
    qkv.attention(q.requires_grad_(), k, v, mask=mask, causal=True)  # gradients: another class
    assert made == [2, 2, 2]
    keys = list(padded_rows._answers)
    assert len(keys) == 3 and {key[1] for key in keys} == {False, True}


def test_the_probe_runs_the_backward_where_gradients_flow_and_not_under_inference_mode(short_rows, monkeypatch):
    """A class with gradients times forward + backward; the first call may come from inference mode."""
    backwards = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **kw: backwards.append(1) or real_grad(*a, **kw))
    timed(monkeypatch, groups=1.0, rows=2.0)
    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, I, I, D, D))
    with torch.inference_mode():
        out = qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True)
    assert out.is_inference() and not backwards
    q.requires_grad_()
    qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True).sum().backward()
    assert len(backwards) == 2 and q.grad is not None


def test_a_score_mod_runs_row_by_row_where_rows_are_faster_and_goes_elsewhere_where_groups_are(short_rows, monkeypatch):
    """A group's call renumbers the batch rows a score_mod reads: with groups chosen, the segments backend refuses."""
    q, k, v = ref.random_qkv(B, H, G, I, I, D, D)

    def mod(score, b, h, q_idx, kv_idx):
        return score + 0.1 * b

    mask = qkv.masks.lengths(REAL)
    want = qkv.attention(q, k, v, mask=mask, causal=True, score_mod=mod, backend="reference")
    for groups, rows, backend in ((2.0, 1.0, "segments"), (1.0, 2.0, None)):
        monkeypatch.setattr(padded_rows, "_answers", {})
        timed(monkeypatch, groups=groups, rows=rows)
        first = qkv.explain(q, k, v, mask=mask, causal=True, score_mod=mod).splitlines()[0]
        assert (first == "backend: segments") == (backend == "segments")
        torch.testing.assert_close(qkv.attention(q, k, v, mask=mask, causal=True, score_mod=mod), want,
                                   rtol=1e-10, atol=1e-10)  # fmt: skip


def test_the_real_probe_times_both_ways_once_and_keeps_an_answer(short_rows):
    """Not replaced: both ways run on fresh inputs of the class (a boolean comes back, cached; no timing asserted)."""
    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, I, I, D, D))
    with torch.no_grad():
        out = qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True)
    (answer,) = padded_rows._answers.values()
    assert isinstance(answer, bool)
    want = qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_probe_times_the_calls_own_query_and_key_lengths_not_a_square(short_rows, monkeypatch):
    """A few queries over many keys (rows of a decoding step) are timed at that shape: never a (j, j) square."""
    shapes = []
    real_rows = padded_rows.run_row_groups
    monkeypatch.setattr(padded_rows, "run_row_groups", lambda req: shapes.append((req.i, req.j)) or real_rows(req))
    timed(monkeypatch, groups=1.0, rows=2.0)
    q, k, v = ref.random_qkv(B, H, G, 5, 80, D, D)
    with torch.no_grad():
        qkv.attention(q, k, v, mask=qkv.masks.lengths(torch.tensor([80, 70, 50, 41])))
    (key,) = padded_rows._answers
    assert (4, 64) == key[8:10] and shapes[0] == (4, 64)  # the probe's call, then the real one
    assert shapes[1] == (5, 80)


def _poisoned(side: str) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` whose padding (the keys each row's mask hides) holds nan and inf, and the padding mask."""
    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, I, I, D, D))
    for r, n in enumerate(REAL.tolist()):
        pad = slice(n, None) if side == "right" else slice(0, I - n)
        k[r, :, pad], v[r, :, pad] = float("nan"), float("inf")
    return q, k, v, qkv.masks.lengths(REAL) if side == "right" else qkv.masks.starts(I - REAL)


@pytest.mark.parametrize("side", ["right", "left"])
def test_rows_over_their_real_keys_skip_the_output_scan_and_groups_keep_it(side, short_rows, monkeypatch):
    """A call per row reads no padding key, so an inference call's output is not scanned for the nan one would bring;
    groups are given their padding, scanned, and run again on zeroed keys. Neither output holds a nan."""
    from qkv.backends import hidden_keys

    scans = []
    real_scan = hidden_keys.no_nan
    monkeypatch.setattr(hidden_keys, "no_nan", lambda out: scans.append(1) or real_scan(out))
    q, k, v, mask = _poisoned(side)
    clean = [torch.where(x.isfinite(), x, 0.0) for x in (k, v)]
    with torch.no_grad():
        want = qkv.attention(q, *clean, mask=mask, causal=True, backend="reference")
        for faster in ("rows", "groups"):
            monkeypatch.setattr(padded_rows, "_answers", {})
            timed(monkeypatch, groups=1.0 if faster == "groups" else 2.0, rows=2.0 if faster == "groups" else 1.0)
            scans.clear()
            got = qkv.attention(q, k, v, mask=mask, causal=True)
            assert not got.isnan().any()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert len(scans) == (1 if faster == "groups" else 0), faster


def test_a_padded_window_keeps_the_scan(short_rows, monkeypatch):
    """Under a window a row's own call may hide keys from every query it runs (and groups read the padding): only a
    padded causal square run a row at a time is known to read no hidden key."""
    from qkv.backends import segments

    def reads(mask, causal: bool, faster: str) -> bool:
        monkeypatch.setattr(padded_rows, "_answers", {})
        timed(monkeypatch, groups=1.0 if faster == "groups" else 2.0, rows=2.0 if faster == "groups" else 1.0)
        req = qkv.checks.request(q, k, v, score="scaled_dot", mask=mask, bias=None, causal=causal, scale=None,
                                 dropout=0.0, return_weights=False)  # fmt: skip
        return segments.reads_hidden_keys(req)

    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, I, I, D, D))
    with torch.no_grad():
        assert reads(qkv.masks.lengths(REAL) & qkv.masks.window(left=3, right=0), False, "rows")
        assert not reads(qkv.masks.lengths(REAL), True, "rows")
        assert not reads(qkv.masks.starts(I - REAL), True, "rows")
        assert not reads(qkv.masks.lengths(REAL), False, "rows")
        assert reads(qkv.masks.lengths(REAL), True, "groups")


def test_the_backends_are_walked_once_for_a_batch_of_plain_rows_and_per_row_otherwise(short_rows, monkeypatch):
    """Rows whose calls are plain (top-left is_causal, no bias) take the backend chosen for the first; a row with its
    own bias is chosen for on its own (a bias may change the answer)."""
    timed(monkeypatch, groups=2.0, rows=1.0)
    walks = []
    real_choose = qkv.backends.choose
    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, I, I, D, D))
    with torch.no_grad():
        qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True)  # the probe (its own walks) runs here
        monkeypatch.setattr(qkv.backends, "choose", lambda req, *a: walks.append(req.i) or real_choose(req, *a))
        qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True)
        assert len(walks) == 2  # the whole call's, then the first row's
        bias = torch.randn(B, 1, I, I)
        qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True, bias=bias)  # (its own size class's probe)
        walks.clear()
        got = qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True, bias=bias)
        assert len(walks) == 1 + B
        want = qkv.attention(q, k, v, mask=qkv.masks.lengths(REAL), causal=True, bias=bias, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_rows_that_read_no_hidden_key_are_not_guarded_and_their_gradients_stay_finite(side, short_rows, monkeypatch):
    """With gradients, a call per row skips the guard that zeroes hidden keys (none reaches a kernel, forward or
    backward); groups take it. Either way nan and inf in the padding reach no output or gradient."""
    from qkv.backends import hidden_keys

    guards = []
    real_guard = hidden_keys.guard
    monkeypatch.setattr(hidden_keys, "guard", lambda req: guards.append(1) or real_guard(req))
    q, k, v, mask = _poisoned(side)
    clean = [torch.where(x.isfinite(), x, 0.0) for x in (k, v)]
    inputs = [q.clone().requires_grad_(), *(x.clone().requires_grad_() for x in clean)]
    want = ref.run_with_grads(lambda: qkv.attention(*inputs, mask=mask, causal=True, backend="reference"), inputs)
    for faster in ("rows", "groups"):
        monkeypatch.setattr(padded_rows, "_answers", {})
        timed(monkeypatch, groups=1.0 if faster == "groups" else 2.0, rows=2.0 if faster == "groups" else 1.0)
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        qkv.attention(*inputs, mask=mask, causal=True)  # (the probe, which runs its own guarded calls)
        guards.clear()
        got = ref.run_with_grads(lambda: qkv.attention(*inputs, mask=mask, causal=True), inputs)
        assert len(guards) == (1 if faster == "groups" else 0), faster
        for a, b in zip(got, want):
            assert a.isfinite().all()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_dense_bias_that_hides_a_real_key_keeps_the_checks(short_rows, monkeypatch):
    """A ``-inf`` column of a dense bias hides a key among a row's real ones, which that row's call reads: a nan
    there still never reaches the output, with or without gradients."""
    timed(monkeypatch, groups=2.0, rows=1.0)
    q, k, v = (x.detach().float() for x in ref.random_qkv(B, H, G, I, I, D, D))
    bias = torch.zeros(B, 1, 1, I)
    bias[..., 2] = float("-inf")
    k[:, :, 2], v[:, :, 2] = float("nan"), float("inf")
    for grad in (False, True):
        inputs = [x.clone().requires_grad_(grad) for x in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = qkv.attention(*inputs, mask=qkv.masks.lengths(REAL), causal=True, bias=bias)
        assert not out.isnan().any()
        if grad:
            out.sum().backward()
            assert all(x.grad.isfinite().all() for x in inputs)
