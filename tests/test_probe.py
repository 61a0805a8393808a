"""qkv._probe: oneDNN or BLAS chosen per shape class by timing both once; the route can be fixed."""

import pytest
import torch

from qkv import _probe, projection
from qkv.approx import _common


class Clock:
    """A fake clock: each call of a route advances it by that route's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _routes(clock, blas_cost, onednn_cost, calls):
    def routes():
        calls.append(1)

        def blas():
            clock.now += blas_cost

        def onednn():
            clock.now += onednn_cost

        return blas, onednn

    return routes


@pytest.mark.parametrize(("blas", "onednn", "chosen"), [(2.0, 1.0, True), (1.0, 2.0, False), (1.0, 0.95, False)])
def test_the_faster_route_is_chosen_once_per_class(monkeypatch, blas, onednn, chosen):
    clock, calls = Clock(), []
    monkeypatch.setattr(_probe, "_clock", clock)
    probe = _probe.Probe("test")
    with _probe.route("auto"):
        assert probe.prefers_onednn(("a",), _routes(clock, blas, onednn, calls)) is chosen
        assert probe.prefers_onednn(("a",), _routes(clock, 9.0, 0.0, calls)) is chosen  # cached: not timed again
        assert len(calls) == 1
        assert probe.times[("a",)] == pytest.approx((blas, onednn))
        assert probe.report()[0].endswith("oneDNN" if chosen else "BLAS")


def test_a_fixed_route_is_not_timed(monkeypatch):
    probe, calls = _probe.Probe("test"), []
    for name, want in (("blas", False), ("onednn", True)):
        with _probe.route(name):
            assert probe.prefers_onednn(("b",), _routes(Clock(), 1.0, 2.0, calls)) is want
    assert calls == [] and probe.choices == {}


def test_while_compiling_an_unprobed_class_runs_blas(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    probe, calls = _probe.Probe("test"), []
    with _probe.route("auto"):
        assert probe.prefers_onednn(("c",), _routes(Clock(), 2.0, 1.0, calls)) is False
    assert calls == []


def test_route_names_are_checked_and_restored():
    before = _probe.get_route()
    with pytest.raises(ValueError, match=r"route: expected one of \('auto', 'blas', 'onednn'\), got 'mkl'"):
        _probe.set_route("mkl")
    with _probe.route("blas"):
        assert _probe.get_route() == "blas"
    assert _probe.get_route() == before


def test_the_environment_variable_sets_the_route():
    import subprocess
    import sys

    code = "from qkv import projection; print(projection.get_route())"
    for value in ("blas", "onednn"):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**__import__("os").environ, "QKV_ROUTE": value})
        assert done.stdout.strip() == value, done.stderr
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**__import__("os").environ, "QKV_ROUTE": "fast"})
    assert done.returncode != 0 and "QKV_ROUTE: expected one of ('auto', 'blas', 'onednn'), got 'fast'" in done.stderr


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_projection_and_grouped_matmul_follow_the_probe(monkeypatch):
    x, w = torch.randn(2048, 37), torch.randn(23, 37)
    for choice in (True, False):
        monkeypatch.setattr(projection.PROBE, "choices", {(37, 23, 2048): choice})
        with projection.route("auto"):
            assert projection.uses_convolution(x, w) is choice
            torch.testing.assert_close(projection.linear(x, w), torch.nn.functional.linear(x, w))
    with projection.route("blas"):
        assert not projection.uses_convolution(x, w)
    a, b = torch.randn(1, 64, 2048), torch.randn(1, 2048, 256)
    for choice in (True, False):
        monkeypatch.setattr(_common.GROUPED_PROBE, "choices", {(64, 2048, 256): choice})
        with projection.route("auto"):
            assert _common.grouped_uses_onednn(a, b) is choice
            torch.testing.assert_close(_common.grouped_matmul(a, b), torch.bmm(a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_real_probe_times_both_routes_at_the_capped_size():
    probe = projection.PROBE
    monkey = dict(probe.choices)
    try:
        probe.choices.clear()
        with projection.route("auto"):
            projection.uses_convolution(torch.empty(3 * 4096, 16), torch.empty(8, 16))  # 12288 tokens -> timed at 4096
        assert (16, 8, 4096) in probe.times and all(t > 0 for t in probe.times[(16, 8, 4096)])
    finally:
        probe.choices.clear()
        probe.choices.update(monkey)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_a_call_that_will_be_differentiated_is_probed_forward_and_backward(monkeypatch):
    """Training and inference are separate classes: the backward can favour the other library."""
    probe = projection.PROBE
    saved = dict(probe.choices), dict(probe.times)
    timed = []
    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: timed.append(1) or real_grad(*a, **k))
    try:
        probe.choices.clear()
        x, w = torch.randn(1024, 16), torch.randn(8, 16, requires_grad=True)
        with projection.route("auto"):
            with torch.no_grad():
                projection.uses_convolution(x, w)
            assert timed == [] and (16, 8, 1024) in probe.times
            projection.uses_convolution(x, w)
        assert (16, 8, 1024, "fwd+bwd") in probe.times and len(timed) >= 2  # both routes ran a backward
        y = projection.linear(x, w)  # whichever route was chosen, the gradient is F.linear's
        (g,) = torch.autograd.grad(y.sum(), w)
        torch.testing.assert_close(g, torch.autograd.grad(torch.nn.functional.linear(x, w).sum(), w)[0])
    finally:
        probe.choices.clear(), probe.times.clear()
        probe.choices.update(saved[0]), probe.times.update(saved[1])
