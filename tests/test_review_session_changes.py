"""A review of one session's changes: autocast on every path, the reasons traced calls are given, the edits' checks.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; ``t`` packed tokens, ``P`` page size.
"""

import warnings

import pytest
import torch

import qkv
from qkv import scores
from qkv.edits import AblateHeads, Knockout, PatchPattern, PatchZ
from qkv.models.seq2seq import LUONG_SCORES

BF16 = torch.bfloat16


def test_the_plain_lane_with_a_row_that_sees_no_key_answers_in_autocasts_dtype():
    """The lane's padding plan zeroes a dead row with ones in q's dtype: float32 ones promoted autocast's bfloat16
    output back to float32, where the full path (and SDPA) answer bfloat16."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, generator=gen) for n in (1, 6, 6))
    mask = qkv.masks.lengths(torch.tensor([0, 5]))  # row 0 sees no key
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        got = qkv.attention(q, k, v, mask=mask)
        full = qkv.attention(q, k, v, mask=mask, backend="reference")
    assert got.dtype == full.dtype == BF16
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.float(), full.float(), rtol=0, atol=2e-2)


def _pages(k: torch.Tensor, cu: list[int], P: int, table: torch.Tensor) -> torch.Tensor:
    """``k (t, g, ·)`` laid into a pool ``(num_blocks, P, g, ·)`` at the pages ``table (b, n)`` names."""
    pool = torch.zeros(int(table.max()) + 1, P, *k.shape[1:])
    for s in range(len(cu) - 1):
        for c in range(cu[s + 1] - cu[s]):
            pool[table[s, c // P], c % P] = k[cu[s] + c]
    return pool


def test_varlen_with_a_block_table_read_in_place_answers_in_autocasts_dtype_like_the_packed_path():
    """The paged branch returned before the packed path's cast: float32 under autocast, where the same call on
    packed keys (and a call the paged engine has no form for, gathered) answered bfloat16."""
    gen = torch.Generator().manual_seed(1)
    cu = [0, 5, 12]
    q, k, v = (torch.randn(12, h, 16, generator=gen) for h in (4, 2, 2))
    table = torch.tensor([[0, 1, 0], [2, 3, 4]])
    kp, vp = _pages(k, cu, 4, table), _pages(v, cu, 4, table)
    offsets = torch.tensor(cu)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        packed, packed_lse = qkv.varlen_attention(q, k, v, offsets, offsets, causal=True, return_lse=True)
        paged, paged_lse = qkv.varlen_attention(q, kp, vp, offsets, offsets, causal=True, block_table=table,
                                                return_lse=True)  # fmt: skip
    assert packed.dtype == paged.dtype == BF16
    assert packed_lse.dtype == paged_lse.dtype == torch.float32  # README: the log-sum-exp stays float32
    torch.testing.assert_close(paged.float(), packed.float(), rtol=0, atol=2e-2)


def test_explain_under_a_torch_func_transform_names_it_among_the_tracers():
    """tracing() counts torch.func transforms now; the fused kernel's reason said only compile and export."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=gen) for _ in range(3))
    seen = {}

    def loss(q):
        seen["text"] = qkv.explain(q, k, v, mask=qkv.masks.window(2, 1))
        return q.sum()

    torch.func.grad(loss)(q)
    local = next(line for line in seen["text"].splitlines() if line.startswith("  not local:"))
    assert "torch.jit.trace or a torch.func transform" in local, local


def test_patch_z_puts_the_given_rows_in_and_refuses_another_batch():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 5, e, generator=gen) for e in (8, 8, 6))
    z = torch.randn(2, 2, 1, 6, generator=gen)  # (b, R, H, e): rows 1 and 3 of head 2
    out = qkv.edits.attention(q, k, v, PatchZ(2, [1, 3], z))
    plain = qkv.attention(q, k, v)
    torch.testing.assert_close(out[:, 2, [1, 3]], z[:, :, 0])
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[2, [1, 3]] = False
    torch.testing.assert_close(out[:, keep], plain[:, keep])
    torch.testing.assert_close(qkv.edits.attention(q, k, v, PatchZ(2, [1, 3], z[:1]))[1, 2, [1, 3]], z[0, :, 0])
    with pytest.raises(ValueError, match=r"PatchZ: z: \(3, 2, 1, 6\) has batch \(3,\), which does not broadcast"):
        qkv.edits.attention(q, k, v, PatchZ(2, [1, 3], torch.randn(3, 2, 1, 6)))
    pattern = torch.full((3, 1, 1, 5), 0.2)
    with pytest.raises(ValueError, match=r"PatchPattern: pattern: \(3, 1, 1, 5\) has batch \(3,\)"):
        qkv.edits.attention(q, k, v, PatchPattern(2, 1, pattern))


def test_a_dense_knockout_of_another_call_is_refused_and_one_that_broadcasts_runs():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=gen) for _ in range(3))
    with pytest.raises(ValueError, match=r"Knockout: edges of shape \(4, 4\) do not broadcast .* \(2, 4, 5, 5\)"):
        qkv.edits.attention(q, k, v, Knockout(torch.zeros(4, 4, dtype=torch.bool)))
    edges = torch.zeros(5, 5, dtype=torch.bool)
    edges[:, 0] = True  # every row's edge to key 0: an (i, j) tensor broadcasts to the call
    torch.testing.assert_close(qkv.edits.attention(q, k, v, Knockout(edges)), qkv.attention(q, k, v, mask=~edges))


def test_luong_takes_every_score_name_and_only_those():
    assert set(LUONG_SCORES) == set(scores.ALIASES)


def test_a_mean_ablation_in_qkvs_own_cached_decoding_step_is_refused_as_in_transformers():
    """``mha.attention.edits`` with ``AblateHeads(how="mean")`` and a ``KVCache``: a step's mean was its own token's
    ``z`` (no ablation), silently unlike the same run without the cache; the prefill (no earlier keys) still runs."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 4).eval()
    mha.attention.edits = [AblateHeads([1], how="mean")]
    x = torch.randn(1, 5, 16)
    cache = qkv.KVCache()
    with torch.no_grad():
        torch.testing.assert_close(mha(x[:, :4], causal=True, cache=cache), mha(x[:, :4], causal=True))
        with pytest.raises(ValueError, match=r"MultiHeadAttention was called with 1 query rows against 5 keys"):
            mha(x[:, 4:], causal=True, cache=cache)
        mha.attention.edits = [AblateHeads([1], how=torch.zeros(1, 4))]  # a fixed mean: alike with and without
        torch.testing.assert_close(mha(x[:, 4:], causal=True, cache=cache)[:, -1], mha(x, causal=True)[:, -1])


def test_sigmoid_attention_traces_and_transforms_on_public_ops():
    """``SigmoidAttention``'s tile function was recorded by ``jit.trace`` as one opaque op (PyTorch crashed:
    ``unordered_map::at``) and refused by ``torch.func``: both now run its tiles in public ops, equal to eager."""
    from qkv.variants.sigmoid import sigmoid_attention

    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(16, 4, positional=qkv.ALiBi(4), attention=qkv.SigmoidAttention(length=9)).double()
    x, other = torch.randn(2, 9, 16, dtype=torch.float64), torch.randn(2, 9, 16, dtype=torch.float64)
    class Causal(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, t):
            return self.inner(t, causal=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # (shape checks read as constants: the trace's shapes)
        traced = torch.jit.trace(Causal(mha), (x,), check_trace=False)
    torch.testing.assert_close(traced(other), mha(other, causal=True), rtol=1e-12, atol=1e-12)
    q, k, v = (torch.randn(3, 2, 7, 4, dtype=torch.float64) for _ in range(3))
    mask = qkv.masks.lengths(torch.tensor([7, 5, 0]))
    batched = torch.func.vmap(lambda a, b, c: sigmoid_attention(a, b, c, causal=True))(q, k, v)
    torch.testing.assert_close(batched, sigmoid_attention(q, k, v, causal=True), rtol=1e-12, atol=1e-12)
    grad = torch.func.grad(lambda a: sigmoid_attention(a, k, v, mask=mask).square().sum())(q)
    q_ = q.clone().requires_grad_()
    sigmoid_attention(q_, k, v, mask=mask).square().sum().backward()
    torch.testing.assert_close(grad, q_.grad, rtol=1e-12, atol=1e-12)
