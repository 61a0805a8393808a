"""The distributed benchmark suite: one rank's measurement, and the section's targets from given results."""

import os

import pytest

from qkv.bench import distributed as suite
from qkv.distributed import cost


def test_single_process_case_measures_memory_and_time():
    got = suite.rank_case(0, 1, {"n": 256, "kind": "alibi", "strategy": "single", "layout": "zigzag"})
    assert got["rows"] == 256 and got["peak"] >= 0 and got["seconds"] > 0 and got["forward"] == {}


def _fake_run(spec, world, say):
    n = spec["n"]
    peak = {1: 100.0, 2: 55.0, 4: 30.0}[world] * 2**20
    shard = n / world * suite.H * suite.D * 4
    work = [1000] * world if spec["layout"] == "zigzag" else [1000 * (r + 1) for r in range(world)]
    kv = (world - 1) * 2 * shard
    return [{"peak": peak, "forward": {"kv": kv}, "backward": {}, "elements": w, "seconds": 1.0 / world,
             "first": 1.0, "rows": n // world} for w in work]  # fmt: skip


def test_section_reports_targets(monkeypatch):
    monkeypatch.setattr(suite, "_run", _fake_run)
    monkeypatch.setattr(cost, "fit_link", lambda: cost.Link("test", 1e-5, 1e-10, "test"))
    monkeypatch.setattr(cost, "fit_compute", lambda sides: cost.Compute(1e-4, 1e-10))
    monkeypatch.setattr(suite, "_plot", lambda *a: None)
    monkeypatch.setattr(suite, "_available", lambda say: 1.5)
    text = suite.section(True, lambda line: None)
    assert "| causal: peak memory per rank / one process, P = 2 | 0.55 | met |" in text
    assert "| causal: peak memory per rank / one process, P = 4 | 0.3 | met |" in text
    assert "| causal: work max/min across ranks, zigzag, P = 4 | 1 | met |" in text
    assert "| causal | ring contiguous | 4 | 30.0 | 0.30 | " in text and "| 4.00 |" in text  # contiguous imbalance
    assert "cost model vs measured ring step, P = 2" in text
    assert "| cores free |" in text and "| 1.50 |" in text  # the measured free cores, beside the core count


@pytest.mark.parametrize("kind", ["causal", "alibi", "window"])
def test_keywords(kind):
    kw = suite._keywords({"kind": kind}, 8)
    assert kw["causal"] == (kind != "window")


def test_cost_check_uses_the_compute_timed_just_before_each_run(monkeypatch):
    """The host's speed drifts: the P = 2 and 4 checks predict from the block compute timed right before their runs
    (γ 1 and 2 ps here), not from the fit made at the end of the suite (γ 9 ps, for the extrapolation table)."""
    fits = iter([cost.Compute(0.0, 1e-12), cost.Compute(0.0, 2e-12), cost.Compute(0.0, 9e-12)])
    order = []
    monkeypatch.setattr(suite, "_run", lambda spec, world, say: order.append((spec["kind"], spec["strategy"], world))
                        or _fake_run(spec, world, say))  # fmt: skip
    monkeypatch.setattr(cost, "fit_link", lambda: cost.Link("test", 0.0, 1e-15, "test"))
    monkeypatch.setattr(cost, "fit_compute", lambda sides: (order.append("fit"), next(fits))[1])
    monkeypatch.setattr(suite, "_plot", lambda *a: None)
    monkeypatch.setattr(suite, "_available", lambda say: 2.0)
    text = suite.section(True, lambda line: None)
    # a fit right before each checked run (the causal zigzag ring), and the end's for the extrapolations
    assert [order[n + 1] for n, x in enumerate(order[:-1]) if x == "fit"] == [("causal", "ring", 2), ("causal", "ring", 4)]
    assert order[-1] == "fit"
    shape = cost.Shape(suite.QUICK_N, suite.H, suite.H, suite.D, suite.D)
    link = cost.Link("test", 0.0, 1e-15, "test")
    for p, gamma in ((2, 1e-12), (4, 2e-12)):
        share = cost.cores_per_rank(p, 2.0, max(1, (os.cpu_count() or 1) // p))  # 2.0: the free cores above
        predicted = cost.ring(shape, p, link, cost.Compute(0.0, gamma), cores=share)
        assert f"| {p} | {1.0 / p:.2f} | {gamma * 1e12:.1f} |" in text
        assert f"| {predicted:.2f} |" in text


def test_the_scaling_figure_goes_beside_the_results_file(tmp_path, monkeypatch):
    """A run with --out elsewhere (or --quick, in a temporary folder) leaves benchmarks/ as it was."""
    pytest.importorskip("matplotlib")
    import argparse

    import qkv.bench as bench

    seen = []
    monkeypatch.setattr(bench, "figures", bench.figures)  # restored after: run() sets it
    monkeypatch.setattr(bench, "_section", lambda module, quick: seen.append(bench.figures) or "")
    args = argparse.Namespace(suite=["distributed"], quick=True, out=tmp_path / "r.md", threads=None, summary=False,
                              case=None)  # fmt: skip
    before = bench.figures
    assert bench.run(args) == 0 and seen == [tmp_path]
    assert bench.figures == before  # restored: a later section of this process writes beside its own results
    monkeypatch.setattr(bench, "figures", tmp_path)
    runs = {("causal", "ring zigzag", 2): [{"seconds": 1.0}], ("causal", "ring zigzag", 4): [{"seconds": 1.0}],
            ("causal", "single", 1): [{"seconds": 2.0}]}  # fmt: skip
    name = suite._plot(1024, runs, cost.Link("test", 1e-5, 1e-10, "test"), cost.Compute(1e-4, 1e-10))
    assert name == "distributed_scaling.png" and (tmp_path / name).is_file()
