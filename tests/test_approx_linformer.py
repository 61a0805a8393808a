"""qkv.approx.linformer: Linformer against softmax(q (E k)ᵀ · scale) (F v) computed directly.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13 throughout.
"""

import math

import pytest
import torch

from qkv.approx import Linformer, linformer_weights
from approx_inputs import B, D, E, G, H, inputs


def repeat(x):
    return x.repeat_interleave(H // G, dim=1)


def direct(q, k, v, e_proj, f_proj):
    """Wang et al. eq. 7 head by head: softmax(q (E k)ᵀ / sqrt(d)) (F v), E and F cut to j columns."""
    j = k.shape[-2]
    k, v = repeat(k), repeat(v)
    heads = []
    for n in range(H):
        e_n = e_proj[n] if e_proj.dim() == 3 else e_proj
        f_n = f_proj[n] if f_proj.dim() == 3 else f_proj
        ek = e_n[:, :j] @ k[:, n]  # (b, k, d)
        fv = f_n[:, :j] @ v[:, n]  # (b, k, e)
        heads.append((q[:, n] @ ek.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ fv)
    return torch.stack(heads, dim=1)


def exact(q, k, v):
    return (q @ repeat(k).transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ repeat(v)


@pytest.mark.parametrize("share", ["headwise", "kv", "none"])
def test_equals_the_projected_softmax_computed_directly(share):
    q, k, v = inputs(5, 7)
    module = Linformer(9, 4, heads=H, share=share).double()
    f_proj = module.e_proj if share == "kv" else module.f_proj
    out = module(q, k, v)
    assert out.shape == (B, H, 5, E)
    torch.testing.assert_close(out, direct(q, k, v, module.e_proj, f_proj), atol=1e-10, rtol=0)


def test_identity_projections_give_exact_attention():
    q, k, v = inputs(5, 7)
    module = Linformer(7, 7).double()
    with torch.no_grad():
        module.e_proj.copy_(torch.eye(7))
        module.f_proj.copy_(torch.eye(7))
    torch.testing.assert_close(module(q, k, v), exact(q, k, v), atol=1e-10, rtol=0)


def test_sharing_options_own_the_right_parameters():
    assert [p.shape for p in Linformer(9, 4).parameters()] == [(4, 9), (4, 9)]
    assert [p.shape for p in Linformer(9, 4, share="kv").parameters()] == [(4, 9)]
    assert [p.shape for p in Linformer(9, 4, heads=H, share="none").parameters()] == [(H, 4, 9), (H, 4, 9)]
    # Entries start as the N(0, 1/k) random projection of the paper's Theorem 1.
    assert abs(Linformer(512, 64).e_proj.std().item() - 64**-0.5) < 0.01


def test_weights_effective_and_over_projected_keys():
    q, k, v = inputs(5, 7)
    module = Linformer(9, 4).double()
    out, weights = module(q, k, v, return_weights=True)
    assert weights.shape == (B, H, 5, 7)
    torch.testing.assert_close(weights @ repeat(v), out, atol=1e-10, rtol=0)
    probs = linformer_weights(q, repeat(k), module.e_proj[:, :7])
    assert probs.shape == (B, H, 5, 4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, 5, dtype=probs.dtype))


@pytest.mark.parametrize("share", ["headwise", "none"])
def test_key_padding_at_the_end_equals_dropping_the_padded_keys(share):
    q, k, v = inputs(5, 7)
    lengths = [7, 4]
    keep = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    module = Linformer(9, 4, heads=H, share=share).double()
    out, weights = module(q, k, v, mask=keep[:, None, None, :], return_weights=True)
    for n, length in enumerate(lengths):
        alone = module(q[n : n + 1], k[n : n + 1, :, :length], v[n : n + 1, :, :length])
        torch.testing.assert_close(out[n : n + 1], alone, atol=1e-12, rtol=0)
    assert weights[1, :, :, 4:].abs().max() == 0


def test_gradients_reach_inputs_and_projections():
    q, k, v = (x.float().requires_grad_(True) for x in inputs(5, 7))
    module = Linformer(9, 4)
    module(q, k, v).pow(2).sum().backward()
    for x in (q, k, v, module.e_proj, module.f_proj):
        assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "make, call, error, message",
    [
        (lambda: Linformer(9, 4), lambda m, q, k, v: m(q, k, v, causal=True), ValueError,
         r"causal: Linformer projects keys along the sequence, so it cannot be causal"),
        (lambda: Linformer(6, 4), lambda m, q, k, v: m(q, k, v), ValueError,
         r"k: Linformer\(seq_len=6\) projects at most 6 keys, got j=7"),
        (lambda: Linformer(9, 4), lambda m, q, k, v: m(q, k, v, mask=torch.ones(5, 7, dtype=torch.bool).tril()),
         ValueError, r"mask: Linformer only supports key padding masks .* varies along the query axis i"),
        (lambda: Linformer(9, 4, heads=4, share="none"), lambda m, q, k, v: m(q, k, v), ValueError,
         r"q: Linformer\(heads=4, share='none'\) has projections for 4 heads, got h=6"),
        (lambda: Linformer(9, 4), lambda m, q, k, v: m(q, k, v[:, :, :5]), ValueError, r"v: expected \(b, g, j, e\)"),
        (lambda: Linformer(9, 4, share="layer"), None, ValueError,
         r"share: expected one of \('none', 'headwise', 'kv'\), got 'layer'"),
        (lambda: Linformer(9, 4, share="none"), None, ValueError, r"heads: share='none' keeps one projection per head"),
        (lambda: Linformer(9, 0), None, ValueError, r"k: expected a positive int, got 0"),
        (lambda: Linformer(0), None, ValueError, r"seq_len: expected a positive int, got 0"),
    ],
)
def test_bad_arguments_raise_with_the_argument_named(make, call, error, message):
    with pytest.raises(error, match=message):
        module = make()
        call(module, *inputs(5, 7, dtype=torch.float32))


def test_chunked_softmax_and_interleaved_heads_equal_the_direct_form(monkeypatch):
    import qkv.approx.linformer as linformer_module

    monkeypatch.setattr(linformer_module, "CHUNK_ELEMENTS", 2 * H * 4)  # two query rows a chunk
    q, k, v = inputs(5, 7)
    module = Linformer(9, 4).double()
    want = direct(q, k, v, module.e_proj, module.f_proj)
    torch.testing.assert_close(module(q, k, v), want, atol=1e-10, rtol=0)
    # Heads interleaved in memory, (b, j, g, d) as MultiHeadAttention splits them: the
    # projection takes the one-matmul-per-batch-row path.
    k_mha = k.transpose(1, 2).contiguous().transpose(1, 2)
    v_mha = v.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(module(q, k_mha, v_mha), want, atol=1e-10, rtol=0)


def test_no_queries_give_an_empty_output():
    q, k, v = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 5)
    assert Linformer(16, 4)(q, k, v).shape == (1, 2, 0, 5)


@pytest.mark.parametrize("grad", [False, True])
def test_no_subnormal_weights_when_the_logits_spread_far(grad):
    # Logits 400 apart: softmax weights down to e^-400 would be subnormal in float32 (slow on
    # many CPUs); they are floored at about finfo.tiny, and the output is unchanged.
    from dispatch_ops import Subnormals

    q, k, v = (x.float() for x in inputs(40, 64))
    module = Linformer(64, 16, scale=30.0)
    with torch.no_grad():
        # direct() scales by 1/√d: hand it q · 30 · √d for logits scaled by 30
        want = direct(q.double() * 30.0 * math.sqrt(D), k.double(), v.double(), module.e_proj.double(), module.f_proj.double())
    q.requires_grad_(grad)
    recorder = Subnormals()
    with torch.set_grad_enabled(grad), recorder:
        out = module(q, k, v)
    assert recorder.by_op == {}, recorder.by_op
    with torch.no_grad():  # the same formula in plain float32, subnormals and all
        plain32 = direct(q.detach() * 30.0 * math.sqrt(D), k, v, module.e_proj, module.f_proj)
    from reference import assert_flash_rule

    assert_flash_rule(out.detach(), plain32, want, floor=1e-6)
    plain = Subnormals()
    with plain:  # the same softmax without the floor does make them (the test can fail)
        (q.detach() @ (module.e_proj @ repeat(k)).transpose(-1, -2) * 30.0).softmax(-1)
    assert plain.by_op.get("_softmax.default", 0) > 0


@pytest.mark.parametrize("return_weights", [False, True])
def test_bfloat16_is_as_accurate_as_a_plain_bfloat16_form(monkeypatch, return_weights):
    # The flash-attention rule: error against float64 at most twice that of the formula
    # computed plainly in bfloat16; chunks of 8 query rows, so the streamed softmax crosses many.
    import qkv.approx.linformer as linformer_module
    from reference import assert_flash_rule

    monkeypatch.setattr(linformer_module, "CHUNK_ELEMENTS", 8 * 16)
    q, k, v = inputs(70, 90)
    module = Linformer(90, 16).double()
    want = direct(q, k, v, module.e_proj, module.f_proj)
    low = module.to(torch.bfloat16)
    got = low(q.bfloat16(), k.bfloat16(), v.bfloat16(), return_weights=return_weights)
    out = got[0] if return_weights else got
    assert out.dtype == torch.bfloat16
    plain = direct(q.bfloat16(), k.bfloat16(), v.bfloat16(), low.e_proj, low.f_proj)
    assert_flash_rule(out, plain, want, floor=1e-3)
    if return_weights:
        assert got[1].dtype == torch.bfloat16
        assert_flash_rule(got[1].double() @ repeat(v), plain, want, floor=1e-2)
