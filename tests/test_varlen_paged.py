"""``qkv.varlen_attention`` with flash-attn's ``block_table``: pages read where they lie, equal to the packed call.

Shape legend: ``t`` packed tokens, ``h`` query heads, ``g`` KV heads, ``d`` key and value size,
``b`` sequences, ``P`` page size; the sizes and the per-sequence oracle are ``test_varlen``'s.
"""

import pytest
import torch

import qkv
from qkv import varlen_paged
from test_varlen import D, G, H, oracle


def paged_case(lengths_q, lengths_k, P=4, seed=5):
    """flash-attn's paged varlen inputs: pools ``(num_blocks, P, G, D)`` in a shuffled order, a ``block_table``
    (b, n), and the same keys and values packed end to end (for the oracle)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // P) for n in lengths_k]
    order = torch.randperm(sum(counts) + 3, generator=gen)  # 3 pages no sequence names
    pools = [torch.randn(len(order), P, G, D, generator=gen, dtype=torch.float64) for _ in range(2)]
    width = max(counts) + 1
    table = torch.full((len(lengths_k), width), 10**6, dtype=torch.int32)  # entries past a sequence's pages: never read
    at = 0
    for s, c in enumerate(counts):
        table[s, :c] = order[at : at + c].to(torch.int32)
        at += c
    packed_kv = [torch.cat([pool[table[s, :c].long()].reshape(-1, G, D)[:n] for s, (c, n) in enumerate(zip(counts, lengths_k))])
                 for pool in pools]  # fmt: skip
    q = torch.randn(sum(lengths_q), H, D, generator=gen, dtype=torch.float64)
    cu = lambda ls: torch.tensor([0, *torch.cumsum(torch.tensor(ls), 0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, pools, table, packed_kv, cu(lengths_q), cu(lengths_k)


@pytest.mark.parametrize("kw", [
    dict(causal=True), dict(causal=False), dict(causal=True, window_size=(3, -1)), dict(causal=False, window_size=(2, -1)),
    dict(causal=True, softcap=5.0), dict(causal=True, alibi_slopes=torch.linspace(0.1, 0.6, H, dtype=torch.float64)),
    dict(causal=True, softmax_scale=0.4),
], ids=["causal", "full", "causal-window", "left-window", "softcap", "alibi", "scale"])  # fmt: skip
def test_a_block_table_reads_the_pages_as_flash_attn_does(kw):
    """``block_table``: sequence s's key c in page block_table[s, c // P], slot c % P; equal to the packed call."""
    lengths_q, lengths_k = [1, 4, 0, 1, 6], [9, 4, 5, 1, 13]
    q, (kc, vc), table, (k, v), cu_q, cu_k = paged_case(lengths_q, lengths_k)
    out, lse = qkv.varlen_attention(q, kc, vc, cu_q, cu_k, block_table=table, return_lse=True, **kw)
    oracle_kw = {"window_size": "window", "softmax_scale": "scale", "alibi_slopes": "alibi"}
    want, want_lse = oracle(q, k, v, cu_q, cu_k, **{oracle_kw.get(n, n): x for n, x in kw.items()})
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    triple = qkv.varlen_attention(q, kc, vc, cu_q, cu_k, 6, 13, 0.0, None, kw.get("causal", False), (-1, -1), 0.0, None,
                                  False, True, table)  # flash-attn's positional order, block_table 16th  # fmt: skip
    assert len(triple) == 3 and triple[2] is None


def test_a_block_table_refuses_what_it_does_not_take():
    """Dropout (flash-attn's paged kernel silently applies none), gradients, a score_mod, and a malformed table.

    A right window, ALiBi without causal and more queries than keys were refused here too; flash-attn computes
    them, and so does qkv now, over the keys gathered from their pages (``test_varlen_dialect_audit``)."""
    q, (kc, vc), table, _, cu_q, cu_k = paged_case([2, 3], [5, 7])
    far = table.clone()
    far[1, 0] = kc.shape[0]
    cases = [
        (dict(dropout_p=0.1), "dropout_p"), (dict(score_mod=lambda s, *a: s), "score_mod"),
        (dict(block_table=table[:1]), "block_table: expected a row per sequence"),
        (dict(block_table=table[:, :1]), "block_table: 1 blocks a row"), (dict(block_table=table.float()), "block_table"),
        (dict(block_table=far), r"block_table: page ids must lie in 0 \.\. 6 \(k's num_blocks\), got 0 \.\. 7"),
        (dict(v=vc[:, :3]), r"v: with block_table, expected pages \(7, 4, 3\) \+ \(size,\) like k"),
        (dict(sinks=torch.zeros(H, dtype=torch.float64, requires_grad=True)), "block_table: forward only"),
    ]  # fmt: skip
    for kw, word in cases:
        with pytest.raises((ValueError, TypeError), match=word):
            qkv.varlen_attention(**{"q": q, "k": kc, "v": vc, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                                    "block_table": table, **kw})  # fmt: skip


def test_a_kept_table_is_read_again_when_an_entry_changes_in_place():
    """A step's layers share a table: it is read once while its values repeat; an entry written in place (a page
    swapped in by the server) is read anew, and the call follows it."""
    q, (kc, vc), table, _, cu_q, cu_k = paged_case([3, 4], [9, 5])
    offsets_q, offsets_k = cu_q.tolist(), cu_k.tolist()
    first = varlen_paged.plan_of(kc, vc, table, offsets_q, offsets_k)
    assert varlen_paged.plan_of(kc, vc, table.clone(), offsets_q, offsets_k) is first  # the same values: kept
    with torch.no_grad():
        before = qkv.varlen_attention(q, kc, vc, cu_q, cu_k, causal=True, block_table=table)
        spare = (set(range(kc.shape[0])) - set(table.flatten().tolist())).pop()
        table[0, 1] = spare  # in place: sequence 0's second page is now another one
        assert varlen_paged.plan_of(kc, vc, table, offsets_q, offsets_k) is not first
        after = qkv.varlen_attention(q, kc, vc, cu_q, cu_k, causal=True, block_table=table)
        k, v = (varlen_paged.gather_pages(x, table, offsets_k) for x in (kc, vc))
        want = qkv.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(after, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(after[:3], before[:3])
