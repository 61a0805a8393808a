"""``qkv.paged_attention`` keeps the plans of the tables it was last given: reused while their values repeat.

Shape legend: ``T`` query rows, ``h`` query heads, ``P`` page size; float64, to 1e-12 against
each request written out alone (``test_paged_attention.literal``).
"""

import threading

import pytest
import torch
from test_paged_attention import build, literal

import qkv
from qkv.paged import recent, table as table_module


def _plans_made(monkeypatch) -> list:
    """Every page table checked from now on (one per plan made)."""
    made = []
    real = table_module.page_table
    from qkv.paged import plan as plan_module

    monkeypatch.setattr(plan_module, "page_table", lambda *a: made.append(1) or real(*a))
    return made


def _close(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("qo_lens", [[1, 1, 1, 1], [1, 5, 1, 2]])
def test_a_steps_layers_plan_its_table_once_even_as_new_tensors_of_the_same_values(qo_lens, monkeypatch):
    """A model's layers call with the step's table: before, each call checked and laid it out again."""
    made = _plans_made(monkeypatch)
    q, cache, table = build(qo_lens, [70, 33, 129, 16], 16, seed=1)
    layers = [cache, cache.flip(-1).contiguous(), 2 * cache]
    for n, layer in enumerate(layers):
        given = table if n == 0 else tuple(x.clone() for x in table)  # the same values, other tensors
        _close(qkv.paged_attention(q, layer, *given, return_lse=True), literal(q, layer, table))
    assert len(made) == 1


@pytest.mark.parametrize("how", ["in place", "through numpy", "as int64", "fewer query rows"])
def test_a_table_whose_values_changed_in_any_way_gets_its_own_plan(how, monkeypatch):
    """A kept plan is used only for the values it was made from: a buffer rewritten behind autograd's version counter
    (a numpy view), a dtype, or a query count is a new table."""
    made = _plans_made(monkeypatch)
    q, cache, table = build([1, 1, 1], [20, 9, 13], 4, seed=8, spare=12)
    ids = table[2].clone()
    qkv.paged_attention(q, cache, table[0], table[1], ids, table[3])
    if how == "in place":
        ids.copy_(ids.flip(0))
    elif how == "through numpy":
        ids.numpy()[:] = ids.numpy()[::-1].copy()  # no version bump: the values alone tell
    elif how == "as int64":
        ids = ids.long()
    now = (table[0], table[1], ids, table[3])
    if how == "fewer query rows":
        now = (torch.tensor([0, 1, 2, 2]), table[1], ids, table[3])
        q = q[:2]
    _close(qkv.paged_attention(q, cache, *now, return_lse=True), literal(q, cache, now))
    assert len(made) == 2


def test_the_last_few_tables_are_kept_and_the_oldest_dropped(monkeypatch):
    made = _plans_made(monkeypatch)
    tables = [build([1, 1], [20 + n, 9], 4, seed=n) for n in range(recent.KEPT + 1)]
    for q, cache, table in tables[: recent.KEPT]:
        qkv.paged_attention(q, cache, *table)
    for q, cache, table in reversed(tables[: recent.KEPT]):  # alternating tables: each still kept
        _close(qkv.paged_attention(q, cache, *table, return_lse=True), literal(q, cache, table))
    assert len(made) == recent.KEPT
    q, cache, table = tables[-1]
    qkv.paged_attention(q, cache, *table)  # one more: the least recently used is dropped
    q, cache, table = tables[recent.KEPT - 1]
    qkv.paged_attention(q, cache, *table)
    assert len(made) == recent.KEPT + 2


def test_a_refused_table_is_refused_every_time_and_never_kept(monkeypatch):
    q, cache, table = build([1, 1], [20, 9], 4, seed=3)
    bad = (table[0], table[1], table[2].float(), table[3])
    for _ in range(2):
        with pytest.raises(TypeError, match="kv_indices"):
            qkv.paged_attention(q, cache, *bad)
    wrong = (table[0], table[1], torch.full_like(table[2], cache.shape[0]), table[3])
    for _ in range(2):
        with pytest.raises(ValueError, match="kv_indices"):
            qkv.paged_attention(q, cache, *wrong)


def test_threads_keep_their_own_plans(monkeypatch):
    made = _plans_made(monkeypatch)
    q, cache, table = build([1, 1, 1], [20, 9, 13], 4, seed=4)
    qkv.paged_attention(q, cache, *table)
    outs = []
    worker = threading.Thread(target=lambda: outs.append(qkv.paged_attention(q, cache, *table, return_lse=True)))
    worker.start()
    worker.join(timeout=60)
    _close(outs[0], literal(q, cache, table))
    assert len(made) == 2


def test_a_traced_call_keeps_nothing(monkeypatch):
    from qkv.paged import recent as module

    q, cache, table = build([1, 1], [20, 9], 4, seed=5)
    monkeypatch.setattr(module, "tracing", lambda: True)
    qkv.paged_attention(q, cache, *table)
    assert not getattr(module._local, "plans", [])


def test_a_buffers_unread_tail_is_neither_kept_nor_compared(monkeypatch):
    """FlashInfer's kv_indices is a buffer longer than the table: a kept plan held a copy of all of it, and a change in
    its unread tail made a new plan (a 16 MB buffer: 61 MiB kept, each call 3x slower)."""
    made = _plans_made(monkeypatch)
    q, cache, table = build([1, 1, 1], [20, 9, 13], 4, seed=9)
    used = table[2].numel()
    buffer = torch.full((used + 10_000,), 7, dtype=table[2].dtype)
    buffer[:used] = table[2]
    for tail in (7, 3):
        buffer[used:] = tail
        _close(qkv.paged_attention(q, cache, table[0], table[1], buffer, table[3], return_lse=True), literal(q, cache, table))
    assert len(made) == 1
    assert recent._local.plans[0][1][2].numel() == used  # the entries read, not the buffer
    buffer[0] = (int(buffer[0]) + 1) % cache.shape[0]  # an entry the table names: a new plan
    qkv.paged_attention(q, cache, table[0], table[1], buffer, table[3])
    assert len(made) == 2
