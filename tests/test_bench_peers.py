"""Tests of the peer comparison of the approx suite (qkv.bench.peers).

Each pair computes the same math on both sides (parameters copied in, or Reformer's
rotations shared), so the difference of the outputs is float32 rounding; a peer that is
not installed is skipped with a note; the table renders every row, skipped or measured.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest

from qkv.bench import approx, peers

TINY = approx.ApproxSetup(
    sizes=(64, 128), heads=2, dim_head=16, repeats=1, large_repeats=(1,), exact_large_repeats=(1,), big=64,
    fit_range=(64, 128), error_size=64, lsh_error_max=128, memory=False, peer_sizes=(128,), peer_repeats=1,
    reformer_peer_max=128, linformer_k=8, nb_features=16, landmarks=8, lsh_rounds=(1, 3), peer_lsh_rounds=2, lsh_chunk=16, steady_heap=False,
    family="gaussian",
)  # fmt: skip


def test_peers_same_math_and_skip(monkeypatch):
    for name in ("performer_pytorch", "linformer", "nystrom_attention", "reformer_pytorch"):
        pytest.importorskip(name)
    setup = TINY
    monkeypatch.setitem(sys.modules, "nystrom_attention", None)  # as if not installed
    rows = {row["peer"]: row for row in peers.compare_peers(setup, lambda _: None)}
    assert "not installed" in rows["nystrom-attention"]["skipped"]
    assert rows["linformer"]["diff"] < 1e-5  # same E, F and projections
    assert rows["reformer-pytorch"]["diff"] < 1e-4  # same rotations
    assert "with their eps set to 0: " in rows["performer-pytorch"]["note"]
    same = float(rows["performer-pytorch"]["note"].rsplit(": ", 1)[1])
    assert same < 1e-4
    assert all(row["ratio"] > 0 for row in rows.values() if "skipped" not in row)


def test_render_peers_rows_and_skips():
    rows = [dict(peer="linformer", i=4096, ours=0.5, theirs=0.25, ratio=2.0, diff=1e-7, note="copied"),
            dict(peer="reformer-pytorch", i=4096, skipped="not installed (reformer_pytorch)")]  # fmt: skip
    lines = peers.render_peers(rows, replace(TINY, peer_repeats=3, reformer_peer_max=4096))
    assert "median of 3 calls each" in lines[1] and "reformer-pytorch only at i ≤ 4K" in lines[1]
    assert lines[3] == "| peer | i | qkv (s) | peer (s) | ratio | difference | how compared |"
    assert lines[5] == "| linformer | 4K | 0.5 | 0.25 | 2.00 | 1.00e-07 | copied |"
    assert lines[6] == "| reformer-pytorch | 4K | | | | | skipped: not installed (reformer_pytorch) |"
    assert peers.render_peers([], TINY) == []
