"""Tests of the approx suite (qkv.bench.approx) and its inputs (qkv.bench.inputs).

Closed-form checks of the error metric and of the scaling-exponent fit, the input families'
structure, and the suite run end to end on tiny sizes producing tables with the right
columns (the figures themselves are measured by ``qkv bench``, not here).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from qkv.bench import approx
from qkv.bench.inputs import FAMILIES, effective_keys, make_inputs, relative_error

TINY = approx.ApproxSetup(
    sizes=(64, 128), heads=2, dim_head=16, repeats=1, large_repeats=(1,), exact_large_repeats=(1,), big=64,
    fit_range=(64, 128), error_size=64, lsh_error_max=128, memory=False, peer_sizes=(), peer_repeats=1,
    reformer_peer_max=128, linformer_k=8, nb_features=16, landmarks=8, lsh_rounds=(1, 3), peer_lsh_rounds=2, lsh_chunk=16, steady_heap=False,
    family="gaussian",
)  # fmt: skip


# ---------------------------------------------------------------- metric and fit


def test_relative_error_closed_form():
    exact = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # ‖exact‖ = 5
    assert relative_error(exact, exact) == 0.0
    assert relative_error(exact * 1.1, exact) == pytest.approx(0.1)
    off = exact.clone()
    off[0, 1] = 1.5  # ‖diff‖ = 1.5
    assert relative_error(off, exact) == pytest.approx(0.3)


def test_relative_error_rejects_bad_input():
    with pytest.raises(ValueError, match=r"approx: expected the shape of exact \(2,\), got \(3,\)"):
        relative_error(torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match="exact: the reference output is all zeros"):
        relative_error(torch.ones(2), torch.zeros(2))


@pytest.mark.parametrize("power", [1.0, 1.15, 2.0])
def test_fit_exponent_recovers_power_law(power):
    sizes = [1024, 4096, 16384, 32768]
    seconds = [3e-9 * s**power for s in sizes]
    assert approx.fit_exponent(sizes, seconds) == pytest.approx(power)


def test_fit_exponent_uses_only_the_range_and_is_least_squares():
    # The point at 1024 lies far off the line and is outside [4096, 32768]: ignored.
    sizes = [1024, 4096, 16384, 32768]
    seconds = [100.0, 1.0, 4.0, 8.0]  # slope exactly 1 over the last three
    assert approx.fit_exponent(sizes, seconds) == pytest.approx(1.0)
    # Noisy points: the slope is the least-squares one, computed here by hand.
    xs = [math.log(s) for s in (4096, 16384, 32768)]
    ys = [math.log(t) for t in (1.0, 5.0, 8.0)]
    mx, my = sum(xs) / 3, sum(ys) / 3
    want = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert approx.fit_exponent(sizes, [100.0, 1.0, 5.0, 8.0]) == pytest.approx(want)
    with pytest.raises(ValueError, match="at least two sizes"):
        approx.fit_exponent([1024, 4096], [1.0, 2.0])


# ---------------------------------------------------------------- inputs


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_shapes_and_seed(family):
    q, k, v = make_inputs(family, 40, b=2, h=3, d=8, seed=1)
    assert q.shape == k.shape == v.shape == (2, 3, 40, 8)
    again = make_inputs(family, 40, b=2, h=3, d=8, seed=1)
    assert all(torch.equal(x, y) for x, y in zip((q, k, v), again))
    assert not torch.equal(q, make_inputs(family, 40, b=2, h=3, d=8, seed=2)[0])


def test_inputs_are_structured():
    spread = {f: effective_keys(*make_inputs(f, 512, h=2, d=32)[:2]) for f in FAMILIES}
    assert spread["gaussian"] > 100  # close to uniform rows
    for family in ("local", "lowrank_local", "peaked"):
        assert spread[family] < spread["gaussian"] / 5
    # local: the strongest key of a query is near it
    q, k, _ = make_inputs("local", 512, h=1, d=32)
    top = (q @ k.transpose(-1, -2))[0, 0].argmax(-1)
    assert (top - torch.arange(512)).abs().float().median() <= 4


def test_effective_keys_extremes():
    q = torch.zeros(1, 1, 4, 8)
    assert effective_keys(q, torch.randn(1, 1, 50, 8)) == pytest.approx(50)
    k = torch.eye(8)[None, None] * 100
    assert effective_keys(k, k) == pytest.approx(1, abs=1e-3)


def test_inputs_errors_name_the_argument():
    with pytest.raises(ValueError, match="family: expected one of"):
        make_inputs("noise", 8)
    with pytest.raises(ValueError, match="i: expected a positive int, got 0"):
        make_inputs("local", 0)


# ---------------------------------------------------------------- approx suite


def test_approx_suite_tiny_produces_the_tables(monkeypatch):
    # Known answers through the whole pipeline: "linear" replaced by exact attention (error 0)
    # and "performer" by twice exact attention (error exactly 1).
    real = approx.mechanism

    def fake(method, i, setup):
        if method == "linear":
            return real("exact", i, setup)
        if method == "performer":
            return lambda q, k, v: 2 * real("exact", i, setup)(q, k, v)
        return real(method, i, setup)

    monkeypatch.setattr(approx, "mechanism", fake)
    result = approx.run(TINY)
    for m in approx.methods(TINY):
        for i in TINY.sizes:
            assert len(result.times[m, i]) == 1 and result.times[m, i][0] > 0
    assert set(result.errors) == {(m, i) for m in approx.methods(TINY)[1:] for i in TINY.sizes}
    assert all(e >= 0 for e in result.errors.values())
    for i in TINY.sizes:
        assert result.errors["linear", i] == pytest.approx(0, abs=1e-6)
        assert result.errors["performer", i] == pytest.approx(1.0, abs=1e-6)
    text = result.markdown()
    assert "| method | i | time (s) | × faster than exact | peak RSS (MiB) | RSS added by the call (MiB) | error |" in text
    assert "| target | measured | status |" in text
    assert text.count("× faster than exact at i = 128") == 6 and text.count("time exponent 64–128") == 6
    assert "Reformer LSH, 1 round: time exponent" in text and "Reformer LSH, 3 rounds: time exponent" in text
    assert "| method | `gaussian`" in text and "`peaked`" in text
    assert "steady_heap" not in text and result.steady_heap is False  # TINY keeps glibc's default heap
    result.steady_heap = True
    assert "freed memory kept in the process while timing (glibc's mmap and trim thresholds at 1 GiB" in result.markdown()


def test_lsh_reference_is_shared_qk_without_self():
    q, _, v = make_inputs("gaussian", 12, h=1, d=4)
    keys = torch.nn.functional.normalize(q, dim=-1)
    logits = (q @ keys.transpose(-1, -2)) / 2  # scale 1/sqrt(4)
    logits = logits.masked_fill(torch.eye(12, dtype=torch.bool), float("-inf"))
    assert torch.allclose(approx.lsh_reference(q, v), logits.softmax(-1) @ v, atol=1e-5)


def test_memory_case_builds_one_call():
    call = approx.build(dict(suite="approx", method="linear", i=32, batch=1, heads=2, dim_head=8,
                             family="local", seed=0))  # fmt: skip
    assert call().shape == (1, 2, 32, 8)


def test_approx_section_ends_with_the_peer_table(monkeypatch):
    # run() hands peer_sizes to qkv.bench.peers' compare_peers and render() appends its table.
    row = dict(peer="linformer", i=64, ours=0.5, theirs=0.25, ratio=2.0, diff=1e-7, note="copied")
    monkeypatch.setattr(approx, "compare_peers", lambda setup, say: [row])
    text = approx.run(replace(TINY, peer_sizes=(64,))).markdown()
    assert text.rstrip().endswith("| linformer | 64 | 0.5 | 0.25 | 2.00 | 1.00e-07 | copied |")
