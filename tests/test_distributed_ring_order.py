"""The ring's rounds walk a rank's pieces slot by slot in turn, so each round's work is about the same on every rank.

Under a causal mask the zigzag layout gives each rank an early and a late stretch of the
sequence; the other rank's queries see all of one and none of the other. Sent slot after
slot, one rank had twice its share of blocks for half the rounds while its peer waited at
every exchange (measured at P = 2, n = 16384 on a 2-core Intel Xeon: 1.3-1.7 s of a 9 s
forward + backward in waits, the step 10.9 s against 9.1 s with the pieces in turn).
"""

from __future__ import annotations

import pytest
import torch

from qkv import checks
from qkv.distributed import blocks, ring
from qkv.distributed.comm import Group
from qkv.distributed.layout import Layout

N, ROWS = 4096, 256


def _plans(world: int, kind: str = "zigzag") -> list[ring.RingPlan]:
    x = torch.empty(1, 1, N, 4)
    req = checks.request(x, x, x, score="scaled_dot", mask=None, bias=None, causal=True, scale=None, dropout=0.0,
                         return_weights=False)  # fmt: skip
    work = blocks.Work(req, N, N, 0, None, 1)
    lay = Layout(kind, N, world)
    spans = [lay.slot_spans(r) for r in range(world)]
    return [ring.plan_for(Group(None, world, r), work, spans, spans, lay.side, lay.side, ROWS * 4 * 8) for r in range(world)]


def _round_work(plan: ring.RingPlan) -> list[int]:
    """Blocks this rank computes in each round of the plan (its queries against the visiting piece)."""
    me = plan.group.rank
    return [len(list(plan.work.blocks(plan.q_pieces[me], plan.k_pieces[plan.peers(s)[1]], n))) for s, n in plan.rounds]


def _largest_lag(plans: list[ring.RingPlan]) -> int:
    """The most blocks one rank is ahead of another after any round (work done up to there)."""
    done = [0] * len(plans)
    lag = 0
    for t in range(len(plans[0].rounds)):
        for r, plan in enumerate(plans):
            done[r] += _round_work(plan)[t]
        lag = max(lag, max(done) - min(done))
    return lag


def test_pieces_are_walked_slot_by_slot_in_turn():
    pieces = blocks.Pieces.cut(((0, 600), (3000, 600)), 600, 256)  # two slots of 3 pieces
    assert pieces.slots == 2 and pieces.interleaved() == [0, 3, 1, 4, 2, 5]
    assert blocks.Pieces.cut(((0, 600),), 600, 256).interleaved() == [0, 1, 2]  # one slot: in order
    with pytest.raises(ValueError, match="3 pieces do not split into 2 slots"):  # none may be dropped
        blocks.Pieces(((0, 1, 0), (1, 1, 1), (2, 1, 2)), 2).interleaved()


def test_zigzag_causal_rounds_keep_every_rank_within_a_round_of_the_others(monkeypatch):
    for world in (2, 4):
        plans = _plans(world)
        assert [r for p in plans for r in p.rounds] == [r for _ in plans for r in plans[0].rounds]  # one order for all
        per_round = max(max(_round_work(p)) for p in plans)
        total = sum(_round_work(plans[0]))
        assert _largest_lag(plans) <= per_round, world
        if world == 2:  # slot after slot, one rank runs half its work ahead of the other
            monkeypatch.setattr(blocks.Pieces, "interleaved", lambda self: list(range(self.count)))
            assert _largest_lag(_plans(world)) >= total // 4
            monkeypatch.undo()
