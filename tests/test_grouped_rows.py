"""``qkv.backends.grouped_rows``: a grouped one-query call's form (rows of a KV head or ``enable_gqa``), timed once
per size class. The choice is asserted, never a time: the probe's timer is replaced by one that says which is faster.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``j`` keys, ``d`` head size.
"""

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.backends import grouped_rows, sdpa

B, H, G, J, D = 2, 8, 2, 64, 64  # b·h·j·d = grouped_rows.ROWS_ELEMENTS: grouping is considered


@pytest.fixture
def timer(monkeypatch):
    """The probe's timer replaced: ``timer.rows`` is the time it reports for rows (``enable_gqa`` takes 1), and
    ``timer.probes`` counts the probes; the kept answers are cleared before and after."""

    class Timer:
        rows, probes = 0.5, 0

        def __call__(self, rows, gqa):
            self.probes += 1
            return [self.rows, 1.0]

    t = Timer()
    monkeypatch.setattr(grouped_rows, "best_times", t)
    monkeypatch.setattr(grouped_rows, "_answers", {})
    return t


def _forms(monkeypatch) -> list:
    """The query shapes SDPA's kernel is called with, spied."""
    shapes = []
    kernel = F.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        if query.shape[-1] == D:  # (other probes of the library's first calls have other head sizes)
            shapes.append(tuple(query.shape))
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    return shapes


def _step(j=J, b=B, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(b, H, 1, D, generator=gen, dtype=dtype),
            torch.randn(b, G, j, D, generator=gen, dtype=dtype), torch.randn(b, G, j, D, generator=gen, dtype=dtype))


@pytest.mark.parametrize("rows_time, form", [(0.5, (B, G, H // G, D)), (0.95, (B, H, 1, D)), (2.0, (B, H, 1, D))],
                         ids=["rows faster", "a near tie: enable_gqa", "enable_gqa faster"])  # fmt: skip
def test_the_faster_form_is_taken_and_both_give_the_attention(rows_time, form, timer, monkeypatch):
    timer.rows = rows_time
    q, k, v = _step()
    shapes = _forms(monkeypatch)
    out = qkv.attention(q, k, v, backend="sdpa")
    monkeypatch.undo()
    assert shapes == [form]
    torch.testing.assert_close(out, qkv.attention(q, k, v, backend="reference"), atol=1e-12, rtol=1e-12)


def test_a_size_class_is_timed_once_and_a_new_class_again(timer, monkeypatch):
    """Keys and batch rounded down to powers of two: 64, 100 and 127 keys are one class, 128 another."""
    for j in (64, 64, 100, 127, 128):
        qkv.attention(*_step(j), backend="sdpa")
    assert timer.probes == 2
    qkv.attention(*_step(64, b=4), backend="sdpa")
    assert timer.probes == 3
    qkv.attention(*_step(64, dtype=torch.float32), backend="sdpa")
    assert timer.probes == 4


def test_a_padding_mask_is_part_of_the_class_and_the_rows_share_it(timer, monkeypatch):
    q, k, v = _step()
    keep = torch.arange(J)[None, None, None, :] >= torch.tensor([3, 0])[:, None, None, None]  # (b, 1, 1, j)
    shapes = _forms(monkeypatch)
    out = qkv.attention(q, k, v, mask=keep, backend="sdpa")
    assert shapes == [(B, G, H // G, D)] and timer.probes == 1
    qkv.attention(q, k, v, backend="sdpa")  # unmasked: another class
    assert timer.probes == 2
    torch.testing.assert_close(out, qkv.attention(q, k, v, mask=keep, backend="reference"), atol=1e-12, rtol=1e-12)


def test_a_model_s_later_layers_reuse_the_first_layer_s_choice(timer, monkeypatch):
    """The plain lane's kept plan (a decoding step's layers) carries the form: no probe, no key, per layer."""
    from qkv.backends import sdpa_plain

    q, k, v = (x.float() for x in _step())
    decided = sdpa_plain.plan(q, k, v, "scaled_dot", False, None)
    assert decided.grouping == "rows" and timer.probes == 1
    monkeypatch.setattr(grouped_rows, "faster", lambda *args: pytest.fail("asked again"))
    assert sdpa_plain.fits(decided, q, k, v)
    torch.testing.assert_close(sdpa_plain.run(decided, q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_the_probe_itself_runs_both_forms_and_answers_a_bool(monkeypatch):
    """The real timer, once, at a small class: an answer either way, kept."""
    monkeypatch.setattr(grouped_rows, "_answers", {})
    q, k, v = (x.float() for x in _step(j=256))
    assert grouped_rows.faster(q, k, v, None, None) in (True, False)
    assert len(grouped_rows._answers) == 1
