"""qkv.approx.reformer: LSH attention against dense masked softmax rebuilt here from the paper's definitions.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13 throughout.
"""

import math

import pytest
import torch

from qkv.approx import LSHAttention, lsh_buckets
from approx_inputs import B, D, E, G, H, inputs
from dispatch_ops import Largest


def repeat(x):
    return x.repeat_interleave(H // G, dim=1)


def self_masked_softmax(q, v, allowed):
    """Shared-QK attention (keys = q/|q|) over `allowed (b, h, i, i)`; a token attends to itself
    only when nothing else is allowed, and a row with nothing allowed is zero."""
    n = q.shape[-2]
    logits = q @ (q / q.norm(dim=-1, keepdim=True)).transpose(-1, -2) / math.sqrt(q.shape[-1])
    eye = torch.eye(n, dtype=torch.bool)
    others = allowed & ~eye
    alone = ~others.any(-1, keepdim=True)
    use = torch.where(alone, allowed & eye, others)
    weights = logits.masked_fill(~use, float("-inf")).softmax(-1).nan_to_num(0.0)
    return weights @ v, weights


def paper_buckets(x, rotation, factors):
    """Bucket of each row of ``x (..., d)`` for one round's ``rotation (d, Σ f/2)``: per factor
    argmax over [xR_f; −xR_f], the indices combined as digits (the first factor lowest)."""
    bucket = torch.zeros(x.shape[:-1], dtype=torch.long)
    col, place = 0, 1
    for f in factors:
        proj = x @ rotation[:, col : col + f // 2].to(x)
        bucket += place * torch.cat([proj, -proj], dim=-1).argmax(-1)
        col, place = col + f // 2, place * f
    return bucket


def union_of_rounds(q, rotations, chunk, factors=None, mask=None):
    """∪_r {(p, t): same bucket in round r, and t's chunk is p's or the one before, after sorting by (bucket, position)};
    a token a key padding ``mask (b|1, h|1, 1, j)`` hides sits in a bucket after every other."""
    b, h, n, _ = q.shape
    size = min(chunk, n)
    union = torch.zeros(b, h, n, n, dtype=torch.bool)
    factors = (2 * rotations.shape[-1],) if factors is None else factors
    for r in range(rotations.shape[0]):
        if rotations.shape[-1] == 0:
            bucket = torch.zeros(b, h, n, dtype=torch.long)
        else:
            bucket = paper_buckets(q, rotations[r], factors)
        if mask is not None and mask.shape[-2] == 1:
            bucket = torch.where(~mask.any(-2).expand(b, h, n), math.prod(factors), bucket)
        for x in range(b):
            for y in range(h):
                order = sorted(range(n), key=lambda t: (int(bucket[x, y, t]), t))
                chunk_of = torch.empty(n, dtype=torch.long)
                chunk_of[order] = torch.arange(n) // size
                same = bucket[x, y][:, None] == bucket[x, y][None, :]
                near = (chunk_of[None, :] == chunk_of[:, None]) | (chunk_of[None, :] == chunk_of[:, None] - 1)
                union[x, y] |= same & near
    return union


def causal(n):
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.mark.parametrize("n_hashes", [1, 3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_bucket_one_chunk_is_exact_shared_qk_attention(n_hashes, is_causal):
    q, k, v = inputs(9)
    module = LSHAttention(D, n_buckets=1, n_hashes=n_hashes, chunk_size=16, seed=0)
    out, weights = module(q, k, v, causal=is_causal, return_weights=True)
    allowed = causal(9).expand(B, H, 9, 9) if is_causal else torch.ones(B, H, 9, 9, dtype=torch.bool)
    want, want_weights = self_masked_softmax(q, repeat(v), allowed)
    assert out.shape == (B, H, 9, E)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(weights, want_weights, atol=1e-10, rtol=0)
    if is_causal:  # the first token has nothing but itself
        torch.testing.assert_close(out[:, :, 0], repeat(v)[:, :, 0])


def test_one_bucket_small_chunks_is_chunked_local_attention():
    q, k, v = inputs(13)  # 13 tokens in chunks of 4: the last chunk is padded
    module = LSHAttention(D, n_buckets=1, n_hashes=2, chunk_size=4, seed=0)
    chunk_of = torch.arange(13) // 4
    allowed = (chunk_of[None, :] == chunk_of[:, None]) | (chunk_of[None, :] == chunk_of[:, None] - 1)
    want, _ = self_masked_softmax(q, repeat(v), allowed.expand(B, H, 13, 13))
    torch.testing.assert_close(module(q, k, v), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_many_buckets_and_rounds_equal_softmax_over_the_union(is_causal, masked):
    n = 13
    q, k, v = inputs(n)
    module = LSHAttention(D, n_buckets=4, n_hashes=3, chunk_size=3, seed=1).eval()  # eval: no redraw
    mask = None
    if masked:  # any bool mask works, here padding plus a query-dependent pattern
        gen = torch.Generator().manual_seed(4)
        mask = (torch.rand(B, 1, n, n, generator=gen) < 0.8) & (torch.arange(n) < torch.tensor([[n], [9]]))[:, None, None, :]
    allowed = union_of_rounds(q, module.rotations, 3, mask=mask)
    if masked:
        allowed = allowed & mask
    if is_causal:
        allowed = allowed & causal(n)
    out, weights = module(q, k, v, mask=mask, causal=is_causal, return_weights=True)
    want, want_weights = self_masked_softmax(q, repeat(v), allowed)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    torch.testing.assert_close(weights, want_weights, atol=1e-10, rtol=0)
    assert 0 < allowed.float().mean() < 1  # the test really is sparse


@pytest.mark.parametrize("fill", [1.0, float("nan"), float("inf")])
def test_padding_moves_no_chunk_and_a_padded_row_equals_the_row_alone(fill):
    """Padded tokens were hashed and sorted with the real ones: what padding held moved real rows by 1.84, and a nan
    or inf there reached 56 of 384 real outputs (shared QK: a token's key is its query, which nothing zeroed)."""
    n, real = 16, 11
    q, k, v = inputs(n)
    module = LSHAttention(D, n_buckets=4, n_hashes=2, chunk_size=3, seed=2).eval()
    keep = (torch.arange(n) < real).view(1, 1, 1, n)
    padded = q.clone()
    padded[:, :, real:] = fill * torch.randn(B, H, n - real, D, dtype=q.dtype)
    out = module(padded, k, v, mask=keep)  # (k: its shape only; the keys are the queries)
    alone = module(q[:, :, :real], k[:, :, :real], v[:, :, :real])
    torch.testing.assert_close(out[:, :, :real], alone, atol=1e-12, rtol=0)
    assert torch.equal(out[:, :, real:], torch.zeros_like(out[:, :, real:]))  # a padded row sees no key


def test_a_key_an_edge_mask_hides_from_every_query_keeps_its_tokens_row():
    """An ``(i, j)`` mask hides edges: a token whose key no query may take (attend to no BOS) keeps its own query in
    its bucket and chunk, and its key, never read, may hold a nan."""
    n = 9
    q, k, v = inputs(n)
    module = LSHAttention(D, n_buckets=4, n_hashes=2, chunk_size=3, seed=3).eval()
    mask = torch.ones(1, 1, n, n, dtype=torch.bool)
    mask[..., 0] = False
    allowed = union_of_rounds(q, module.rotations, 3, mask=mask) & mask
    want, _ = self_masked_softmax(q, repeat(v), allowed)
    out = module(q, k, v, mask=mask)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
    assert out[:, :, 0].abs().amax() > 0  # the token's own row still attends
    q[:, :, 0] = float("nan")  # its query is its own row's: the other rows never read its key
    assert torch.isfinite(module(q, k, v, mask=mask)[:, :, 1:]).all()


@pytest.mark.parametrize("factors", [(8,), (2, 4), (4, 2, 6)])
def test_buckets_follow_the_paper_hash_and_factorised_buckets_combine_as_digits(factors):
    q, _, _ = inputs(40)
    q[0, 0, :3] = 0  # a zero vector ties everywhere: the first maximum wins, bucket 0
    module = LSHAttention(D, n_buckets=factors if len(factors) > 1 else factors[0], n_hashes=3, seed=0)
    assert module.rotations.shape == (3, D, sum(f // 2 for f in factors))
    got = lsh_buckets(q, module.rotations, module.n_buckets)
    assert got.shape == (B, H, 3, 40)
    for r in range(3):
        assert torch.equal(got[:, :, r], paper_buckets(q, module.rotations[r], factors))
    assert got.max() < math.prod(factors) and (got[0, 0, :, :3] == 0).all()
    assert len(got.unique()) > math.prod(factors) // 2  # the buckets are really used


def factorised_case(n, factors, chunk, seed, is_causal):
    """Inputs, a 3-round module with factorised buckets, and the pairs it may attend (rebuilt here)."""
    q, k, v = inputs(n)
    module = LSHAttention(D, n_buckets=factors, n_hashes=3, chunk_size=chunk, seed=seed).eval()
    allowed = union_of_rounds(q, module.rotations, chunk, factors=factors)
    return q, k, v, module, (allowed & causal(n) if is_causal else allowed)


@pytest.mark.parametrize("is_causal", [False, True])
def test_factorised_buckets_equal_softmax_over_the_union(is_causal, monkeypatch):
    import qkv.approx._lsh as lsh

    q, k, v, module, allowed = factorised_case(29, (2, 4), 4, 3, is_causal)
    want = self_masked_softmax(q, repeat(v), allowed)[0]
    torch.testing.assert_close(module(q, k, v, causal=is_causal), want, atol=1e-10, rtol=0)
    # the earlier-round test with int32 window codes (long sequences) gives the same result
    monkeypatch.setattr(lsh, "INT16_CODES", 0)
    torch.testing.assert_close(module(q, k, v, causal=is_causal), want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradients_equal_those_of_softmax_over_the_union(is_causal):
    q, k, v, module, allowed = factorised_case(13, (2, 2), 3, 1, is_causal)
    grad = torch.randn(B, H, 13, E, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    q1, v1 = q.clone().requires_grad_(True), v.clone().requires_grad_(True)
    (module(q1, k, v1, causal=is_causal) * grad).sum().backward()
    q2, v2 = q.clone().requires_grad_(True), v.clone().requires_grad_(True)
    (self_masked_softmax(q2, repeat(v2), allowed)[0] * grad).sum().backward()
    torch.testing.assert_close(q1.grad, q2.grad, atol=1e-9, rtol=0)
    torch.testing.assert_close(v1.grad, v2.grad, atol=1e-9, rtol=0)


def test_seeds_give_different_hashes_and_the_same_seed_repeats():
    q, k, v = inputs(64)
    a, b, c = (LSHAttention(D, n_buckets=8, seed=s) for s in (0, 0, 1))
    assert torch.equal(lsh_buckets(q, a.rotations), lsh_buckets(q, b.rotations))
    assert not torch.equal(lsh_buckets(q, a.rotations), lsh_buckets(q, c.rotations))
    a.eval(), b.eval()
    torch.testing.assert_close(a(q, k, v), b(q, k, v))
    assert LSHAttention(D, generator=torch.Generator().manual_seed(0)).rotations.shape == (4, D, 16)


def test_rotations_are_redrawn_every_training_step_and_kept_in_eval():
    q, k, v = inputs(9, dtype=torch.float32)
    module = LSHAttention(D, n_buckets=4, seed=0)
    start = module.rotations.clone()
    module.eval()
    module(q, k, v)
    assert torch.equal(module.rotations, start)
    module.train()
    module(q, k, v)
    assert not torch.equal(module.rotations, start)
    assert module.rotations.shape == (4, D, 2)


def test_fully_masked_row_gives_zeros_and_finite_gradients():
    q, k, v = (x.float().requires_grad_(True) for x in inputs(9))
    keep = torch.ones(B, 1, 1, 9, dtype=torch.bool)
    keep[1] = False
    out = LSHAttention(D, n_buckets=2, n_hashes=2, chunk_size=4, seed=0)(q, k, v, mask=keep)
    assert out[1].abs().max() == 0
    out.pow(2).sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(v.grad).all()
    assert q.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def test_long_sequence_never_builds_an_i_by_i_tensor():
    i, d, e = 8192, 16, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, i, c, generator=gen) for c in (d, d, e))
    module = LSHAttention(d, n_buckets=(8, 16), n_hashes=2, chunk_size=64, seed=0).eval()
    with Largest() as seen:
        out = module(q, k, v, causal=True, mask=torch.ones(1, 1, 1, i, dtype=torch.bool))
    assert out.shape == (1, 1, i, e) and torch.isfinite(out).all()
    # Logits are (rounds, i, 2 · chunk) = 2.1M floats, the table of all mask rows (one per
    # (lo, hi) pair, whatever i) 2.1M too; an (i, i) float tensor would be 67M.
    assert seen.nbytes <= 4 * max(2 * i * 2 * 64, (2 * 64 + 1) ** 2 * 2 * 64)
    assert seen.nbytes < 4 * i * i // 8


@pytest.mark.parametrize(
    "make, call, error, message",
    [
        (lambda: LSHAttention(D), lambda m, q, k, v: m(q, k[:, :, :5], v[:, :, :5]), ValueError,
         r"k: LSHAttention uses the queries as keys \(shared QK\), so it needs j == i=7, got j=5"),
        (lambda: LSHAttention(8), lambda m, q, k, v: m(q, k, v), ValueError, r"q: LSHAttention\(dim_head=8\) expects d=8, got d=11"),
        (lambda: LSHAttention(D), lambda m, q, k, v: m(q, k, v, mask=torch.ones(7, 6, dtype=torch.bool)), ValueError,
         r"mask: expected shape broadcastable to \(2, 6, 7, 7\), got \(7, 6\)"),
        (lambda: LSHAttention(D), lambda m, q, k, v: m(q[:, :4], k, v), ValueError,
         r"k: query heads h=4 must be a multiple of KV heads g, got g=3"),
        (lambda: LSHAttention(D, n_buckets=3), None, ValueError, r"n_buckets: expected 1 or an even number .* got 3"),
        (lambda: LSHAttention(D, n_buckets=(4, 3)), None, ValueError, r"n_buckets: expected factors that are even ints >= 2, got \(4, 3\)"),
        (lambda: LSHAttention(D, n_buckets=()), None, ValueError, r"n_buckets: expected factors .* got \(\)"),
        (lambda: LSHAttention(D, n_buckets=2.0), None, TypeError, r"n_buckets: expected an int or a sequence of ints, got float"),
        (lambda: LSHAttention(D, n_hashes=0), None, ValueError, r"n_hashes: expected a positive int, got 0"),
        (lambda: LSHAttention(D, chunk_size=0), None, ValueError, r"chunk_size: expected a positive int, got 0"),
        (lambda: LSHAttention(D, seed=0, generator=torch.Generator()), None, ValueError, r"seed: give seed or generator"),
        (lambda: LSHAttention(D, generator=0), None, TypeError, r"generator: expected a torch.Generator, got int"),
    ],
)
def test_bad_arguments_raise_with_the_argument_named(make, call, error, message):
    with pytest.raises(error, match=message):
        module = make()
        call(module, *inputs(7, dtype=torch.float32))


def test_buckets_given_to_the_function_must_match_the_rotations():
    from qkv.approx import lsh_attention, random_rotations

    q, _, v = inputs(8, dtype=torch.float32)
    rotations = random_rotations(2, D, (4, 4))
    with pytest.raises(ValueError, match=r"n_buckets: \(4, 8\) needs 6 rotation columns, the rotations have 4"):
        lsh_attention(q, repeat(v), rotations, n_buckets=(4, 8))
    # without n_buckets the columns are read as one factor: 8 buckets
    assert lsh_attention(q, repeat(v), rotations, chunk_size=4).shape == (B, H, 8, E)


def test_bfloat16_follows_float32_with_the_same_buckets():
    # bf16 inputs are hashed in float32 and the rounds combined by a float32 log-sum-exp, so
    # the output is the float32 result of the same (rounded) inputs, to bf16 precision
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 3, 200, 16, generator=gen) * 4).bfloat16()
    v = torch.randn(2, 3, 200, 16, generator=gen).bfloat16()
    module = LSHAttention(16, n_buckets=(4, 4), n_hashes=3, chunk_size=16, seed=0).eval()
    assert torch.equal(lsh_buckets(q, module.rotations, module.n_buckets), lsh_buckets(q.float(), module.rotations, module.n_buckets))
    with torch.inference_mode():
        got, want = module(q, q, v), module(q.float(), q.float(), v.float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_flash_kernel_and_plain_twin_agree():
    from qkv.approx._lsh import chunk_attention, plain_chunk_attention

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(5, n, 8, generator=gen, dtype=torch.float64) for n in (4, 8, 8))
    bias = torch.zeros(5, 4, 8, dtype=torch.float64)
    bias.masked_fill_(torch.rand(5, 4, 8, generator=gen) < 0.4, torch.finfo(torch.float64).min)
    bias[:, :, 0] = 0  # every row keeps a key
    out, lse = chunk_attention(q, k, v, bias, 0.3)
    want, want_lse = plain_chunk_attention(q, k, v, bias, 0.3)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("d, e", [(D, E), (E, E)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_slabs_and_blocks_do_not_change_the_result(monkeypatch, d, e, is_causal):
    # Tiny slabs and blocks: chunks of one slab span (b, h) rows, and blocks split the heads;
    # the mask rows come from two half-line tables instead of the table of all intervals.
    import qkv.approx._lsh_round as lsh_round
    import qkv.approx.reformer as reformer

    n = 23
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, n, d, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(B, G, n, e, generator=gen, dtype=torch.float64)
    module = LSHAttention(d, n_buckets=4, n_hashes=3, chunk_size=4, seed=2).eval()
    mask = torch.rand(B, 1, n, n, generator=gen) < 0.85
    want = module(q, q[:, :G], v, mask=mask, causal=is_causal)
    monkeypatch.setattr(reformer, "SLAB", 3 * 4 * 8)
    monkeypatch.setattr(reformer, "BLOCK_ROWS", 3 * 24)
    monkeypatch.setattr(lsh_round, "INTERVAL_TABLE", 0)
    lsh_round.interval_rows.cache_clear()  # the two half-line tables instead of one
    got = module(q, q[:, :G], v, mask=mask, causal=is_causal)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    allowed = union_of_rounds(q, module.rotations, 4) & mask
    if is_causal:
        allowed = allowed & causal(n)
    torch.testing.assert_close(got, self_masked_softmax(q, repeat(v), allowed)[0], atol=1e-10, rtol=0)


@pytest.mark.parametrize("high", [5, 2**15 + 3])  # numpy's int16 radix sort, then torch.sort
def test_bucket_sort_is_stable_and_equals_torch_sort(high):
    from qkv.approx._lsh import sort_buckets

    buckets = torch.randint(0, high, (3, 2, 500), generator=torch.Generator().manual_seed(0))
    got, order = sort_buckets(buckets)
    want, want_order = buckets.sort(dim=-1, stable=True)
    assert order.dtype == torch.long and torch.equal(got, want) and torch.equal(order, want_order)


@pytest.mark.parametrize("is_causal", [False, True])
def test_bfloat16_is_as_accurate_as_a_plain_bfloat16_form(is_causal):
    # The flash-attention rule against softmax over the union of the rounds' chunks, in float64
    # (the oracle) and plainly in bfloat16 (the baseline), both on the buckets of the bf16
    # inputs (hashed in float32, so they agree); the weights too (summed over rounds in float32).
    from reference import assert_flash_rule

    n = 60
    q, k, v = (x.bfloat16() for x in inputs(n, dtype=torch.float32, size=3.0))  # k unused: shared QK
    module = LSHAttention(D, n_buckets=4, n_hashes=3, chunk_size=6, seed=1).eval()
    allowed = union_of_rounds(q.double(), module.rotations, 6)
    if is_causal:
        allowed = allowed & causal(n)
    want, want_weights = self_masked_softmax(q.double(), repeat(v.double()), allowed)
    plain, plain_weights = self_masked_softmax(q, repeat(v), allowed)
    out, weights = module(q, k, v, causal=is_causal, return_weights=True)
    assert out.dtype == weights.dtype == torch.bfloat16
    assert_flash_rule(out, plain, want, floor=1e-3)
    assert_flash_rule(weights, plain_weights, want_weights, floor=1e-3)
    assert_flash_rule(module(q, k, v, causal=is_causal), plain, want, floor=1e-3)
