"""The distributed benchmark suite: one rank's measurement, and the section's targets from given results."""

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
