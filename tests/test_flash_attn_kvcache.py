"""``qkv.flash_attn.flash_attn_with_kvcache`` against flash-attn's docstring and test, written out per sequence in float64.

Shape legend: ``b`` batch, ``sq`` queries, ``sn`` new keys, ``h`` query heads, ``g`` KV heads,
``d`` query/key size, ``e`` value size, ``S`` cache capacity a sequence, ``P`` page size.
h=6, d=11, e=13 (so a swapped axis fails).

The oracle follows flash-attn's ``test_flash_attn_kvcache``: new keys rotated at
``cache_seqlens + t`` and written there; queries rotated at ``cache_seqlens + t`` when causal or
a window side is bounded (a side at least the cache's capacity is not), else all at
``cache_seqlens``; each sequence then attends to its keys ``cache_leftpad .. cache_seqlens + sn
- 1`` with the per-sequence formula (``flash_ref.sequence``).
"""

import random

import pytest
import torch

from qkv.flash_attn import flash_attn_with_kvcache

from flash_ref import rope, sequence

H, D, E = 6, 11, 13


def reference(q, k_cache, v_cache, k, v, *, cos=None, sin=None, lens=None, rows=None, pads=None, block_table=None,
              scale=None, causal=False, window=(-1, -1), softcap=0.0, interleaved=True, slopes=None):  # fmt: skip
    """``(out, lse, k_cache', v_cache')``: the call written out, on copies of the caches."""
    kc, vc = k_cache.clone(), v_cache.clone()
    b, sq = q.shape[:2]
    new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    P = kc.shape[1] if paged else None
    capacity = block_table.shape[1] * P if paged else kc.shape[1]
    lens = [capacity] * b if lens is None else lens
    rows = list(range(b)) if rows is None else rows
    pads = [0] * b if pads is None else pads

    def where(n, p):
        return (int(block_table[n, p // P]), p % P) if paged else (rows[n], p)

    for n in range(b):
        if new:
            positions = torch.arange(new) + lens[n]
            kn = k[n] if cos is None else rope(k[n], cos, sin, positions, interleaved)
            for t in range(new):
                kc[where(n, lens[n] + t)] = kn[t]
                vc[where(n, lens[n] + t)] = v[n, t]
    per_row = causal or tuple(window) != (-1, -1)  # flash-attn's docstring: "if causal or local"
    outs, lses = [], []
    for n in range(b):
        qn = q[n]
        if cos is not None:
            qn = rope(qn, cos, sin, lens[n] + (torch.arange(sq) if per_row else torch.zeros(sq, dtype=torch.long)),
                      interleaved)  # fmt: skip
        span = range(pads[n], lens[n] + new)
        keys = torch.stack([kc[where(n, p)] for p in span]) if len(span) else kc.new_zeros(0, *kc.shape[2:])
        values = torch.stack([vc[where(n, p)] for p in span]) if len(span) else vc.new_zeros(0, *vc.shape[2:])
        row = None if slopes is None else slopes if slopes.dim() == 1 else slopes[n]
        out, lse = sequence(qn, keys, values, scale=scale, causal=causal, window=window, softcap=softcap, slopes=row)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), kc, vc


def draw(seed):
    """A random call: its arguments for qkv and for the oracle."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    b, sq, g = rnd.randint(1, 4), rnd.choice([1, 1, 2, 5]), rnd.choice([1, 3, 6])
    e = rnd.choice([D, E])  # (values of the keys' size: the paged engine's fused kernel takes one size)
    new = rnd.choice([0, 1, 1, 3])
    paged = rnd.random() < 0.5
    if paged:
        P = rnd.choice([1, 3, 16])
        m = rnd.randint(1, 4) * (1 if P == 16 else 3)
        capacity, blocks = m * P, b * m + rnd.randint(0, 3)
        k_cache, v_cache = randn(blocks, P, g, D), randn(blocks, P, g, e)
        block_table = torch.randperm(blocks, generator=gen)[: b * m].reshape(b, m).to(torch.int32)
        extra = dict(block_table=block_table)
        ref_extra = dict(block_table=block_table)
    else:
        # (a capacity of 16, 32 or 256 keys is read as pages by the paged engine; others one call a sequence)
        capacity = rnd.choice([rnd.randint(max(new, 1), 20), 16, 32, 48, 256])
        B = b + rnd.randint(0, 2)
        k_cache, v_cache = randn(B, capacity, g, D), randn(B, capacity, g, e)
        extra, ref_extra = {}, {}
        if rnd.random() < 0.5:
            rows = rnd.sample(range(B), b)
            extra["cache_batch_idx"] = torch.tensor(rows, dtype=torch.int32)
            ref_extra["rows"] = rows
    lens = [rnd.randint(0, capacity - new) for _ in range(b)]
    given = None
    if new or rnd.random() < 0.7:
        given = torch.tensor(lens, dtype=torch.int32) if rnd.random() < 0.8 or b == 1 else None
        if given is None:  # one int for all
            lens = [lens[0]] * b
            given = lens[0]
    else:
        lens = None
    if not paged and rnd.random() < 0.3:
        pads = [rnd.randint(0, n) for n in (lens or [capacity] * b)]  # (at most the cache's length)
        extra["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
        ref_extra["pads"] = pads
    k = randn(b, new, g, D) if new else None
    v = randn(b, new, g, e) if new else None
    q = randn(b, sq, H, D)
    opts = dict(causal=rnd.random() < 0.5, softcap=rnd.choice([0.0, 0.0, 1.3]),
                window=rnd.choice([(-1, -1), (-1, -1), (2, -1), (3, 1), (0, 0), (capacity, -1), (1, capacity + 2)]))  # fmt: skip
    slopes = rnd.choice([None, None, "h", "bh"])
    if slopes is not None:
        opts["slopes"] = torch.rand((H,) if slopes == "h" else (b, H), generator=gen, dtype=torch.float64)
    if new and rnd.random() < 0.6:
        half = rnd.choice([2, 5])
        reach = max(lens) + max(sq, new)  # (flash-attn reads past its table where queries outnumber new keys)
        angle = torch.rand(reach + rnd.randint(0, 2), half, generator=gen, dtype=torch.float64) * 6.283
        opts.update(cos=angle.cos(), sin=angle.sin(), interleaved=rnd.random() < 0.5)
    return q, k_cache, v_cache, k, v, given, lens, extra, ref_extra, opts


@pytest.mark.parametrize("seed", range(120))
def test_random_calls_equal_flash_attns_formula_and_write_the_cache_as_it_does(seed):
    q, k_cache, v_cache, k, v, given, lens, extra, ref_extra, opts = draw(seed)
    want, want_lse, want_k, want_v = reference(q, k_cache, v_cache, k, v, lens=lens, **ref_extra, **opts)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, opts.get("cos"), opts.get("sin"), given, softmax_scale=None, causal=opts["causal"],
        window_size=opts["window"], softcap=opts["softcap"], rotary_interleaved=opts.get("interleaved", True),
        alibi_slopes=opts.get("slopes"), return_softmax_lse=True, **extra,
    )  # fmt: skip
    assert out.shape == want.shape and lse.shape == want_lse.shape == (q.shape[0], H, q.shape[1])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    live = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[live], want_lse[live], rtol=0, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), ~live)
    torch.testing.assert_close(k_cache, want_k, rtol=0, atol=1e-14)  # written in place, elsewhere untouched
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)


def test_a_decoding_loop_equals_attention_over_the_whole_prefix():
    """Appending one token a step with rotary, causal: each step's output is the full causal attention's row."""
    gen = torch.Generator().manual_seed(5)
    b, n, g, half = 2, 9, 3, 4
    angle = torch.rand(n, half, generator=gen, dtype=torch.float64) * 6.283
    cos, sin = angle.cos(), angle.sin()
    q, k, v = (torch.randn(b, n, heads, size, generator=gen, dtype=torch.float64)
               for heads, size in ((H, D), (g, D), (g, E)))  # fmt: skip
    k_cache, v_cache = torch.zeros(b, n, g, D, dtype=torch.float64), torch.zeros(b, n, g, E, dtype=torch.float64)
    steps = [flash_attn_with_kvcache(q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1], cos, sin,
                                     torch.full((b,), t, dtype=torch.int32), causal=True) for t in range(n)]  # fmt: skip
    full = flash_attn_with_kvcache(q, torch.zeros_like(k_cache), torch.zeros_like(v_cache), k, v, cos, sin, 0, causal=True)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)
    pos = torch.arange(n)
    for r in range(b):
        torch.testing.assert_close(k_cache[r], rope(k[r], cos, sin, pos, True), rtol=0, atol=1e-14)


def test_a_cache_whose_rows_are_not_one_block_of_memory_gives_the_same():
    """Rows that do not merge into pages (a cache laid out (S, B, g, d)) run one call a sequence, with one answer."""
    q, k_cache, v_cache, k, v, given, lens, extra, ref_extra, opts = draw(3)
    while "block_table" in extra or k_cache.shape[1] % 16:
        q, k_cache, v_cache, k, v, given, lens, extra, ref_extra, opts = draw(int(q.sum().abs() * 1000) % 997)
    kw = dict(causal=True, return_softmax_lse=True, **extra)
    a = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=given, **kw)
    strided = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (k_cache, v_cache)]
    b = flash_attn_with_kvcache(q, *strided, k, v, cache_seqlens=given, **kw)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-13)


def test_without_cache_seqlens_every_slot_is_a_key():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 1, H, D, generator=gen, dtype=torch.float64)
    k_cache, v_cache = torch.randn(2, 7, 2, D, generator=gen, dtype=torch.float64), torch.randn(2, 7, 2, E, generator=gen,
                                                                                                 dtype=torch.float64)  # fmt: skip
    out = flash_attn_with_kvcache(q, k_cache, v_cache)
    want, _, _, _ = reference(q, k_cache, v_cache, None, None)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def test_outputs_need_no_gradient_as_flash_attns_and_the_cache_is_still_written():
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, H, D, generator=gen, requires_grad=True)
    k_cache, v_cache = torch.zeros(1, 4, 2, D), torch.zeros(1, 4, 2, E)
    k, v = torch.randn(1, 1, 2, D, requires_grad=True), torch.randn(1, 1, 2, E, requires_grad=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2, return_softmax_lse=True)
    assert not out.requires_grad and not lse.requires_grad and lse.dtype == torch.float32
    assert torch.equal(k_cache[0, 2], k[0, 0].detach()) and k_cache[0, 3].abs().sum() == 0


def test_more_queries_than_keys_under_causal_leave_the_first_rows_empty():
    q = torch.randn(1, 4, H, D, dtype=torch.float64)
    k_cache, v_cache = torch.randn(1, 8, 1, D, dtype=torch.float64), torch.randn(1, 8, 1, E, dtype=torch.float64)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=2, causal=True, return_softmax_lse=True)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isneginf(lse[0, :, :2]).all()
    assert torch.isfinite(lse[0, :, 2:]).all()


def test_float32_is_within_float32s_reach_of_the_formula():
    q, k_cache, v_cache, k, v, given, lens, extra, ref_extra, opts = draw(11)
    opts = {**opts, "causal": True}
    want, _, _, _ = reference(q, k_cache, v_cache, k, v, lens=lens, **ref_extra, **opts)
    f = lambda x: None if x is None else x.float()  # noqa: E731
    out = flash_attn_with_kvcache(f(q), f(k_cache), f(v_cache), f(k), f(v), f(opts.get("cos")), f(opts.get("sin")), given,
                                  causal=True, window_size=opts["window"], softcap=opts["softcap"],
                                  rotary_interleaved=opts.get("interleaved", True), alibi_slopes=opts.get("slopes"),
                                  **extra)  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=0, atol=5e-6)


def _call(**over):
    q = torch.randn(2, 1, H, D)
    args = dict(q=q, k_cache=torch.zeros(2, 8, 2, D), v_cache=torch.zeros(2, 8, 2, E), k=torch.randn(2, 1, 2, D),
                v=torch.randn(2, 1, 2, E), cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))  # fmt: skip
    args.update(over)
    return flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("over, error, match", [
    (dict(cache_seqlens=torch.tensor([3, 8], dtype=torch.int32)), ValueError, "do not fit the cache's 8"),
    (dict(cache_seqlens=None), ValueError, "cache_seqlens: needed with new keys"),
    (dict(v=None), ValueError, "k, v: give both"),
    (dict(k=None, v=None, rotary_cos=torch.ones(8, 2), rotary_sin=torch.zeros(8, 2)), ValueError, "needs new keys"),
    (dict(rotary_cos=torch.ones(8, 2)), ValueError, "give both tables"),
    (dict(rotary_cos=torch.ones(5, 2), rotary_sin=torch.zeros(5, 2)), ValueError, "position 5 read"),
    (dict(rotary_cos=torch.ones(8, 6), rotary_sin=torch.zeros(8, 6)), ValueError, "rotary_dim = 2 · 6"),
    (dict(k_cache=torch.zeros(2, 8, 2, D, dtype=torch.float64)), TypeError, "k_cache: expected q's dtype"),
    (dict(k_cache=torch.zeros(2, 8, 4, D), v_cache=torch.zeros(2, 8, 4, E)), ValueError, "4 key/value heads must divide"),
    (dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)), ValueError, "cache_batch_idx: rows 0 .. 2"),
    (dict(cache_leftpad=torch.tensor([0, 7], dtype=torch.int32)), ValueError, "cache_leftpad: expected 0 .."),
    (dict(cache_leftpad=torch.tensor([0, 6], dtype=torch.int32)), ValueError, r"cache_seqlens \(\[3, 5\]\)"),
    (dict(causal="yes"), TypeError, "causal: expected a bool"),
    (dict(softmax_scale="0.1"), TypeError, "softmax_scale: expected a number"),
    (dict(cache_seqlens=torch.tensor([3.0, 5.0])), TypeError, "cache_seqlens: expected a 1-d integer tensor"),
    (dict(num_splits=-1), ValueError, "num_splits"),
    (dict(k_cache=torch.zeros(6, 4, 2, D), v_cache=torch.zeros(6, 4, 2, E), block_table=torch.tensor([[0, 1], [2, 3]]),
          cache_batch_idx=torch.tensor([0, 1])), ValueError, "cache_batch_idx: not with block_table"),
    (dict(k_cache=torch.zeros(6, 4, 2, D), v_cache=torch.zeros(6, 4, 2, E), block_table=torch.tensor([[0, 1], [2, 9]])),
     ValueError, "page ids must lie in 0 .. 5"),
    (dict(k_cache=torch.zeros(6, 4, 2, D), v_cache=torch.zeros(6, 4, 2, E), block_table=torch.tensor([[0], [2]])),
     ValueError, "do not fit the cache's 4"),
])  # fmt: skip
def test_errors_name_the_argument(over, error, match):
    with pytest.raises(error, match=match):
        _call(**over)


def test_a_contiguous_cache_is_read_as_pages_by_the_paged_engine_in_one_pass(monkeypatch):
    """A decoding step over a cache whose capacity a page size divides runs as one paged call, not one call a sequence."""
    import qkv.flash_attn.kvcache as kvcache
    from qkv.paged import PagedPlan

    calls, run = [], PagedPlan.run
    monkeypatch.setattr(PagedPlan, "run", lambda *a, **kw: calls.append(a) or run(*a, **kw))
    monkeypatch.setattr(kvcache, "packed_spans", None)  # (one call a sequence: not taken)
    gen = torch.Generator().manual_seed(8)
    b, S, g = 3, 32, 2
    q = torch.randn(b, 1, H, D, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(b + 1, S, g, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, 1, g, D, generator=gen, dtype=torch.float64) for _ in range(2))
    lens, rows = [0, 17, 31], [3, 0, 2]
    want, want_lse, want_k, want_v = reference(q, k_cache, v_cache, k, v, lens=lens, rows=rows, causal=True)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lens),
                                       cache_batch_idx=torch.tensor(rows), causal=True, return_softmax_lse=True)  # fmt: skip
    assert len(calls) == 1
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    torch.testing.assert_close((k_cache, v_cache), (want_k, want_v), rtol=0, atol=0)



def test_numpy_scalars_and_0d_tensors_are_read_as_flash_attns_bindings_read_them():
    import numpy as np

    q, k_cache, v_cache, k, v, given, lens, extra, ref_extra, opts = draw(4)
    kw = dict(cache_seqlens=given, window_size=opts["window"], **extra)
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, causal=True, softmax_scale=0.25,
                                   return_softmax_lse=True, num_splits=1, **kw)  # fmt: skip
    got = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, causal=np.bool_(True),
                                  softmax_scale=torch.tensor(0.25), return_softmax_lse=np.array([True])[0],
                                  num_splits=np.int64(1), **kw)  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
