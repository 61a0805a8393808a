"""Tests of rotary position embeddings (``qkv.positional.rotary``).

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` per-head size, ``r`` rotated dims.
"""

import cmath

import pytest
import torch

import qkv
from qkv.positional import Rotary, apply_rotary, rotary_angles


def _complex_form(x, m, r, base=10000.0):
    """RoFormer eq. (12)-(13) with Python complex numbers: z_k = x_2k + i x_2k+1, z_k e^{i m θ_k}."""
    out = list(x)
    for k in range(r // 2):
        theta = base ** (-2 * k / r)
        z = complex(x[2 * k], x[2 * k + 1]) * cmath.exp(1j * m * theta)
        out[2 * k], out[2 * k + 1] = z.real, z.imag
    return out


@pytest.mark.parametrize("r", [6, 4])
def test_rotation_equals_the_complex_form_and_leaves_the_rest(r):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, dtype=torch.float64, generator=g)
    positions = torch.tensor([0, 5, 17])
    rope = Rotary(6, rotary_dim=r)
    got = rope.rotate_at(x, positions)
    expected = torch.tensor([_complex_form(x[n].tolist(), int(positions[n]), r) for n in range(3)], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(got[:, r:], x[:, r:], rtol=0, atol=0)  # partial rotary: untouched


def test_non_interleaved_is_the_same_rotation_on_permuted_dims():
    d = 8
    x = torch.randn(4, d, dtype=torch.float64)
    pos = torch.arange(4)
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # (2k, 2k+1) -> (k, k + d/2)
    halves = Rotary(d, interleaved=False).rotate_at(x[:, perm], pos)
    pairs = Rotary(d).rotate_at(x, pos)
    torch.testing.assert_close(halves, pairs[:, perm], rtol=0, atol=1e-12)


@pytest.mark.parametrize("interleaved", [True, False])
def test_dot_product_depends_only_on_relative_position(interleaved):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(10, dtype=torch.float64, generator=g)
    k = torch.randn(10, dtype=torch.float64, generator=g)
    rope = Rotary(10, rotary_dim=8, interleaved=interleaved)

    def logit(m, n):
        return float(rope.rotate_at(q[None], torch.tensor([m])) @ rope.rotate_at(k[None], torch.tensor([n]))[0])

    for m, n in [(3, 1), (7, 7), (2, 9)]:
        for shift in (1, 40, 1000):
            assert logit(m + shift, n + shift) == pytest.approx(logit(m, n), abs=1e-10)
    # and it does depend on m - n (otherwise the test above would pass for a no-op)
    assert abs(logit(3, 1) - logit(1, 3)) > 1e-3
    # norms are preserved: a rotation
    rotated = rope.rotate_at(q[None], torch.tensor([123]))
    torch.testing.assert_close(rotated.norm(), q.norm())


def test_rotate_aligns_queries_bottom_right_and_offsets_by_start():
    rope = Rotary(4)
    q = torch.randn(2, 3, 2, 4, dtype=torch.float64)  # (b, h, i=2, d)
    k = torch.randn(2, 1, 5, 4, dtype=torch.float64)  # (b, g, j=5, d)
    q2, k2 = rope.rotate(q, k, start=7)
    torch.testing.assert_close(k2, rope.rotate_at(k, torch.arange(7, 12)))
    torch.testing.assert_close(q2, rope.rotate_at(q, torch.tensor([10, 11])))  # the last two key positions


def test_rotary_in_multi_head_attention_is_shift_invariant():
    # With RoPE only relative position matters: attention over tokens 0..4 equals attention
    # over the same tokens placed at 10..14 (start=10), with every other weight unchanged.
    mha = qkv.MultiHeadAttention(12, 3, positional=Rotary(4)).double()
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    q = mha.q_proj(x).unflatten(-1, (3, 4)).transpose(1, 2)
    k = mha.k_proj(x).unflatten(-1, (3, 4)).transpose(1, 2)
    logits = []
    for start in (0, 10):
        q_rot, k_rot = mha.positional.rotate(q, k, start)
        logits.append(q_rot @ k_rot.transpose(-1, -2))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-10)
    y_rope, w = mha(x, causal=True, return_weights=True)
    mha.positional = None
    y_plain = mha(x, causal=True)
    assert w.shape == (2, 3, 5, 5)
    assert (y_rope - y_plain).abs().max() > 1e-4  # the rotation changed something


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="rotary_dim: expected an even number at most dim_head=8, got 5"):
        Rotary(8, rotary_dim=5)
    with pytest.raises(ValueError, match="rotary_dim: expected an even number at most dim_head=8, got 10"):
        Rotary(8, rotary_dim=10)
    with pytest.raises(ValueError, match=r"q: Rotary\(dim_head=8\) expects head size 8, got shape \(1, 1, 2, 6\)"):
        Rotary(8).rotate(torch.zeros(1, 1, 2, 6), torch.zeros(1, 1, 2, 8))
    with pytest.raises(ValueError, match="start: expected a non-negative int"):
        Rotary(8).rotate(torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 2, 8), start=-2)
    for base in (0.5, float("nan"), float("inf")):  # (nan gave nan outputs; inf zeroed every frequency but one)
        with pytest.raises(ValueError, match="base: expected a finite number > 1"):
            Rotary(8, base=base)
    x = torch.zeros(2, 2, 4, 8)
    for positions in (torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]), torch.tensor([3])):  # broadcast along the frequencies
        with pytest.raises(ValueError, match=r"positions: expected one per row of x \(4,\)"):
            Rotary(8).rotate_at(x, positions)


def test_angles_are_position_times_frequency():
    angles = rotary_angles(torch.tensor([0, 2]), 4, base=100.0)
    torch.testing.assert_close(angles, torch.tensor([[0.0, 0.0], [2.0, 2.0 / 10.0]], dtype=torch.float64))
    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    out = apply_rotary(x, rotary_angles(torch.tensor([1]), 4, base=100.0))
    one, tenth = torch.tensor(1.0), torch.tensor(0.1)  # angles of the two pairs at position 1
    expected = torch.stack([one.cos(), one.sin(), tenth.cos(), tenth.sin()])[None]
    torch.testing.assert_close(out, expected)
