"""Benchmark: qkv's approximate mechanisms against the peer packages (part of the approx suite).

Shape legend: ``b`` batch, ``h`` heads, ``i`` sequence length (self-attention, ``j = i``),
``d`` query/key size (``e = d``), ``dim = h · d`` model size (peer modules with projections).

The same computation in performer-pytorch (Choromanski et al. 2021), linformer (Wang et al.
2020), nystrom-attention (Xiong et al. 2021) and reformer-pytorch (Kitaev et al. 2020),
with their parameters copied into ours so the math is the same (or, for Reformer, the hash
rotations shared), timed side by side: median of ``setup.peer_repeats`` calls of each side,
the two sides alternating which goes first, forward only under ``torch.inference_mode``.
The difference reported is ``‖ours − theirs‖_F / ‖theirs‖_F`` of the first calls. Peers whose
modules include the Q/K/V/O projections are compared with our mechanism inside
``qkv.MultiHeadAttention`` of the same ``dim`` and heads. A peer that is not installed is
skipped with a note (they are the benchmark-only ``peers`` extra).

:func:`compare_peers` is called by :func:`qkv.bench.approx.run` and :func:`render_peers` by
its report, so ``qkv bench --suite approx`` prints this table in its section; this module
only borrows the approx suite's setup, inputs and mechanisms (:mod:`qkv.bench.approx_setup`), so both sides of a pair see
what the main table measures.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch import Tensor

from .. import approx as qkv_approx  # the mechanisms (this package's approx is the suite)
from .approx_setup import ApproxSetup, inputs, lsh_queries, mechanism, size_label, timed
from .inputs import relative_error
from .._extras import install

PEERS = ("performer-pytorch", "linformer", "nystrom-attention", "reformer-pytorch")


def _zero_biases(mha) -> None:
    # the peers' q/k/v projections have no biases; ours start with random ones
    with torch.no_grad():
        for proj in (mha.q_proj, mha.k_proj, mha.v_proj):
            proj.bias.zero_()


def _peer_performer(i: int, setup: ApproxSetup):
    from performer_pytorch import FastAttention  # noqa: PLC0415

    q, k, v = inputs(i, setup)
    ours = mechanism("performer", i, setup)
    theirs = FastAttention(setup.dim_head, nb_features=setup.nb_features).eval()
    theirs.projection_matrix.copy_(ours.projection)
    # Theirs adds eps = 1e-4 to every feature after the max-subtraction; with that eps set to 0
    # (the only difference) the two should agree to float32 rounding.
    import performer_pytorch.performer_pytorch as theirs_module  # noqa: PLC0415

    defaults = theirs_module.softmax_kernel.__kwdefaults__
    eps, defaults["eps"] = defaults["eps"], 0.0
    try:
        same = relative_error(ours(q, k, v), theirs(q, k, v))
    finally:
        defaults["eps"] = eps
    note = (f"same projection matrix copied in; difference with their default eps={eps:g} added to every feature; "
            f"with their eps set to 0: {same:.1e}")  # fmt: skip
    return (lambda: ours(q, k, v)), (lambda: theirs(q, k, v)), note


def _projected_pair(i: int, setup: ApproxSetup, mechanism):
    """Our ``MultiHeadAttention`` with ``mechanism`` (q/k/v biases zeroed), and the input ``x (b, i, dim)``."""
    from ..attention import MultiHeadAttention  # noqa: PLC0415

    dim = setup.heads * setup.dim_head
    ours = MultiHeadAttention(dim, setup.heads, attention=mechanism).eval()
    _zero_biases(ours)
    x = torch.randn(setup.batch, i, dim, generator=torch.Generator().manual_seed(setup.seed))
    return ours, x


def _peer_linformer(i: int, setup: ApproxSetup):
    from linformer import LinformerSelfAttention  # noqa: PLC0415

    torch.manual_seed(setup.seed)
    dim = setup.heads * setup.dim_head
    theirs = LinformerSelfAttention(dim, seq_len=i, k=setup.linformer_k, heads=setup.heads).eval()
    ours, x = _projected_pair(i, setup, qkv_approx.Linformer(i, setup.linformer_k))
    with torch.no_grad():
        ours.q_proj.weight.copy_(theirs.to_q.weight)
        ours.k_proj.weight.copy_(theirs.to_k.weight)
        ours.v_proj.weight.copy_(theirs.to_v.weight)
        ours.out_proj.load_state_dict(theirs.to_out.state_dict())
        ours.attention.e_proj.copy_(theirs.proj_k.T)  # theirs (seq_len, k), ours (k, seq_len)
        ours.attention.f_proj.copy_(theirs.proj_v.T)
    note = "E, F and projections copied in; ours inside `qkv.MultiHeadAttention`"
    return (lambda: ours(x)), (lambda: theirs(x)), note


def _peer_nystrom(i: int, setup: ApproxSetup):
    from nystrom_attention import NystromAttention  # noqa: PLC0415

    torch.manual_seed(setup.seed)
    dim = setup.heads * setup.dim_head
    theirs = NystromAttention(dim, dim_head=setup.dim_head, heads=setup.heads, num_landmarks=setup.landmarks,
                              pinv_iterations=6, residual=False).eval()  # fmt: skip
    ours, x = _projected_pair(i, setup, qkv_approx.NystromAttention(setup.landmarks, pinv_iterations=6))
    with torch.no_grad():
        wq, wk, wv = theirs.to_qkv.weight.chunk(3, dim=0)
        ours.q_proj.weight.copy_(wq)
        ours.k_proj.weight.copy_(wk)
        ours.v_proj.weight.copy_(wv)
        ours.out_proj.load_state_dict(theirs.to_out[0].state_dict())
    note = ("residual=False, projections copied in; ours inside `qkv.MultiHeadAttention`; the pseudo-inverse "
            "starts from a per-head norm in ours, the max over all heads in theirs")  # fmt: skip
    return (lambda: ours(x)), (lambda: theirs(x)), note


def _peer_reformer(i: int, setup: ApproxSetup):
    from reformer_pytorch.reformer_pytorch import LSHAttention  # noqa: PLC0415

    b, h, d, r = setup.batch, setup.heads, setup.dim_head, setup.peer_lsh_rounds
    q, _, v = inputs(i, setup)
    q = lsh_queries(q, setup)
    theirs = LSHAttention(bucket_size=setup.lsh_chunk, n_hashes=r, causal=False,
                          allow_duplicate_attention=False, attend_across_buckets=False).eval()  # fmt: skip
    n_buckets = i // setup.lsh_chunk
    ours = qkv_approx.LSHAttention(d, n_buckets=n_buckets, n_hashes=r, chunk_size=setup.lsh_chunk,
                                   seed=setup.seed).eval()  # fmt: skip
    # Share the hash: theirs draws (1, d, r, n_buckets/2) from the global RNG on every call.
    torch.manual_seed(setup.seed)
    ours.rotations.copy_(torch.randn(1, d, r, n_buckets // 2)[0].permute(1, 0, 2))
    qk, vv = q.reshape(b * h, i, d), v.reshape(b * h, i, d)

    def theirs_call() -> Tensor:
        torch.manual_seed(setup.seed)
        return theirs(qk, vv)[0].reshape(b, h, i, d)

    note = (f"{r} rounds, same rotations; attend_across_buckets=False, allow_duplicate_attention=False; their "
            "first chunk also looks back at the last chunk (wrap-around), ours does not")  # fmt: skip
    return (lambda: ours(q, q, v)), theirs_call, note


_PEER_PAIRS = {"performer-pytorch": _peer_performer, "linformer": _peer_linformer,
               "nystrom-attention": _peer_nystrom, "reformer-pytorch": _peer_reformer}  # fmt: skip


def compare_peers(setup: ApproxSetup, say: Callable[[str], None]) -> list[dict]:
    """Rows ``{peer, i, ours, theirs (median seconds), ratio, diff, note}`` or ``{peer, i, skipped}``."""
    rows = []
    with torch.inference_mode():
        for i in setup.peer_sizes:
            for peer, pair in _PEER_PAIRS.items():
                if peer == "reformer-pytorch" and i > setup.reformer_peer_max:
                    continue
                try:
                    ours, theirs, note = pair(i, setup)
                except ImportError as err:
                    rows.append(dict(peer=peer, i=i, skipped=f"not installed ({err.name}); {install('peers')}"))
                    say(f"peer {peer}: skipped, not installed")
                    continue
                if i <= setup.big:
                    ours(), theirs()  # warm-up
                t_ours, t_theirs, outs = [], [], []
                for rep in range(setup.peer_repeats):
                    for side in ((0, 1) if rep % 2 == 0 else (1, 0)):
                        seconds, out = timed(ours if side == 0 else theirs)
                        (t_ours if side == 0 else t_theirs).append(seconds)
                        if rep == 0:
                            outs.append((side, out))
                got = dict(outs)
                row = dict(peer=peer, i=i, ours=statistics.median(t_ours), theirs=statistics.median(t_theirs),
                           diff=relative_error(got[0], got[1]), note=note)  # fmt: skip
                row["ratio"] = row["ours"] / row["theirs"]
                rows.append(row)
                say(f"peer {peer} i={i}: ours/theirs {row['ratio']:.2f}, diff {row['diff']:.2e}")
    return rows


def render_peers(rows: list[dict], setup: ApproxSetup) -> list[str]:
    """The peer table of the approx section (markdown lines); no lines when there are no rows."""
    if not rows:
        return []
    lines = ["", f"Peer packages, same configuration, median of {setup.peer_repeats} calls each, interleaved "
             "(ratio = qkv time / peer time, target ≤ 1; difference = relative Frobenius difference of "
             f"the outputs; reformer-pytorch only at i ≤ {size_label(setup.reformer_peer_max)}, where both sides "
             "already take seconds a call):", "",
             "| peer | i | qkv (s) | peer (s) | ratio | difference | how compared |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['peer']} | {size_label(row['i'])} | | | | | skipped: {row['skipped']} |")
            continue
        lines.append(f"| {row['peer']} | {size_label(row['i'])} | {row['ours']:.3g} | {row['theirs']:.3g} | "
                     f"{row['ratio']:.2f} | {row['diff']:.2e} | {row['note']} |")  # fmt: skip
    return lines
