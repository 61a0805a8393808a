"""Tests of ``qkv.MultiHeadLatentAttention`` (DeepSeek-V2's MLA) and its latent cache.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` content
query/key size per head, ``r`` rotary size, ``e`` value size per head, ``c`` KV latent size,
``dim`` model size.

The oracle writes the paper's equations 9-19 with the module's weight matrices in float64,
RoPE as a complex multiplication ``z_k · e^{i m θ_k}`` of the pairs ``(x_2k, x_2k+1)``.
"""

import math

import pytest
import torch

import qkv
from qkv.cache import KVCache, LatentCache, StreamingCache

DIM, H, D, R, E, C, CQ = 30, 3, 5, 4, 7, 11, 9


def _module(**kwargs):
    torch.manual_seed(0)
    kwargs = {**dict(dim_head=D, rope_dim=R, dim_value_head=E, kv_rank=C, query_rank=CQ), **kwargs}
    m = qkv.MultiHeadLatentAttention(DIM, H, **kwargs).double().eval()
    for norm in (m.q_norm, m.kv_norm):
        if norm is not None:
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
    return m


def _rope(x, positions, base=10000.0):
    """``x (..., n, r)`` rotated at ``positions (n,)``: pairs as complex numbers times ``e^{i m θ_k}``."""
    r = x.shape[-1]
    theta = torch.tensor([base ** (-2 * k / r) for k in range(r // 2)], dtype=torch.float64)
    z = torch.complex(x[..., 0::2], x[..., 1::2])
    z = z * torch.polar(torch.ones_like(theta), positions.double()[:, None] * theta)
    return torch.stack((z.real, z.imag), -1).flatten(-2)


def _rms(x, norm):
    return x if norm is None else norm.weight * x / torch.sqrt(x.square().mean(-1, keepdim=True) + norm.eps)


def _literal(m, x, allowed):
    """Equations 9-19 of DeepSeek-V2, per head, materialised."""
    n = x.shape[1]
    pos = torch.arange(n)
    c_kv = _rms(x @ m.kv_down.weight.T, m.kv_norm)  # c^KV = W^DKV h
    k_c = (c_kv @ m.k_up.weight.T).unflatten(-1, (H, D))  # k^C = W^UK c^KV   (b, j, h, d)
    v_c = (c_kv @ m.v_up.weight.T).unflatten(-1, (H, E))  # v^C = W^UV c^KV
    k_r = _rope(x @ m.k_rope.weight.T, pos)  # k^R = RoPE(W^KR h)       (b, j, r)
    c_q = x if m.q_down is None else _rms(x @ m.q_down.weight.T, m.q_norm)  # c^Q = W^DQ h
    q_c = (c_q @ m.q_up.weight.T).unflatten(-1, (H, D))  # q^C = W^UQ c^Q
    q_r = _rope((c_q @ m.q_rope.weight.T).unflatten(-1, (H, R)).transpose(1, 2), pos).transpose(1, 2)
    heads = []
    for head in range(H):
        q = torch.cat((q_c[:, :, head], q_r[:, :, head]), -1)  # [q^C; q^R]   (b, i, d + r)
        k = torch.cat((k_c[:, :, head], k_r), -1)  # [k^C; k^R]
        s = (q @ k.transpose(-1, -2) / math.sqrt(D + R)).masked_fill(~allowed, float("-inf"))
        heads.append(torch.softmax(s, -1) @ v_c[:, :, head])
    return torch.cat(heads, -1) @ m.out_proj.weight.T  # u = W^O [o_1; ...; o_h]


@pytest.mark.parametrize("query_rank", [CQ, None])
@pytest.mark.parametrize("latent_norm", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_and_absorbed_forms_equal_the_papers_equations(query_rank, latent_norm, causal):
    m = _module(query_rank=query_rank, latent_norm=latent_norm)
    x = torch.randn(2, 7, DIM, dtype=torch.float64)
    allowed = qkv.masks.causal().dense(7, 7) if causal else torch.ones(7, 7, dtype=torch.bool)
    want = _literal(m, x, allowed)
    for absorb in (False, True):
        torch.testing.assert_close(m(x, causal=causal, absorb=absorb), want, rtol=0, atol=1e-12)


def test_absorbed_weights_and_masks_equal_the_naive_ones():
    m = _module()
    x = torch.randn(2, 6, DIM, dtype=torch.float64)
    mask = qkv.masks.lengths(torch.tensor([6, 4])) & qkv.masks.window(3)
    y1, w1 = m(x, mask=mask, return_weights=True, absorb=False)
    y2, w2 = m(x, mask=mask, return_weights=True, absorb=True)
    torch.testing.assert_close(y2, y1, rtol=0, atol=1e-12)
    torch.testing.assert_close(w2, w1, rtol=0, atol=1e-12)
    assert w1.shape == (2, H, 6, 6)


@pytest.mark.parametrize("make", [LatentCache, lambda: LatentCache(12), KVCache])
@pytest.mark.parametrize("absorb", [None, False, True])
def test_cached_decoding_equals_the_full_pass(make, absorb):
    m = _module()
    x = torch.randn(2, 12, DIM, dtype=torch.float64)
    full = m(x, causal=True)
    cache = make()
    steps = [m(x[:, :4], causal=True, cache=cache, absorb=absorb)]
    steps += [m(x[:, t : t + 2], causal=True, cache=cache, absorb=absorb) for t in range(4, 8, 2)]
    steps += [m(x[:, t : t + 1], causal=True, cache=cache, absorb=absorb) for t in range(8, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-12)
    assert cache.length == 12


def test_latent_cache_holds_c_kv_and_the_rotary_key_only():
    m = _module()
    x = torch.randn(2, 5, DIM, dtype=torch.float64)
    cache = m.new_cache()
    m(x, causal=True, cache=cache)
    assert cache.latent.shape == (2, 1, 5, C) and cache.rope_keys.shape == (2, 1, 5, R)
    torch.testing.assert_close(cache.latent, (x @ m.kv_down.weight.T)[:, None], rtol=0, atol=1e-12)
    torch.testing.assert_close(cache.rope_keys[:, 0], _rope(x @ m.k_rope.weight.T, torch.arange(5)), rtol=0, atol=1e-12)
    assert cache.combined.data_ptr() == cache.latent.data_ptr()  # one buffer, no copy per step


def test_cache_bytes_per_token_against_multi_head_attention_of_the_same_size():
    # DeepSeek-V2's proportions: c = 4d, r = d/2; MHA of the same heads and head size
    dim, h, d = 128, 8, 16
    mla = qkv.MultiHeadLatentAttention(dim, h, dim_head=d).eval()
    mha = qkv.MultiHeadAttention(dim, h, dim_head=d).eval()
    assert (mla.kv_rank, mla.rope_dim) == (4 * d, d // 2)
    x = torch.randn(1, 50, dim)
    c1, c2 = mla.new_cache(), KVCache()
    with torch.no_grad():
        mla(x, causal=True, cache=c1)
        mha(x, causal=True, cache=c2)
    per_token = c1.nbytes / c1.length, c2.nbytes / c2.length
    assert per_token == ((4 * d + d // 2) * 4, 2 * h * d * 4)  # 288 vs 1024 bytes: 28.1%
    assert per_token[0] / per_token[1] == pytest.approx(4.5 / (2 * h))


def test_streaming_cache_puts_the_rotary_keys_at_their_positions_in_the_cache():
    m = _module()
    x = torch.randn(2, 11, DIM, dtype=torch.float64)
    cache = StreamingCache(sink_tokens=2, window=3)
    outs = [m(x[:, :5], causal=True, cache=cache)] + [m(x[:, t : t + 1], cache=cache) for t in range(5, 11)]
    out = torch.cat(outs, 1)
    for t in range(11):
        kept = list(range(t + 1)) if t < 5 else [0, 1, t - 2, t - 1, t]
        torch.testing.assert_close(out[:, t], m(x[:, kept], causal=True)[:, -1], rtol=0, atol=1e-12)


def test_gradients_reach_every_matrix():
    m = _module(latent_norm=True).train()
    x = torch.randn(1, 4, DIM, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: m(x, causal=True), (x,))
    m(x, causal=True).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: qkv.MultiHeadLatentAttention(30, 4), ValueError, "dim: expected a multiple of heads=4"),
        (lambda: qkv.MultiHeadLatentAttention(32, 4, rope_dim=3), ValueError, "rope_dim: expected an even size"),
        (lambda: qkv.MultiHeadLatentAttention(32, 4, rotary=qkv.Rotary(8)), ValueError,
         "rotary: expected a qkv.Rotary of dim_head rope_dim=4"),
        (lambda: qkv.MultiHeadLatentAttention(32, 4)(torch.randn(2, 3, 31)), ValueError,
         r"x: expected shape \(b, length, 32\)"),
        (lambda: qkv.MultiHeadLatentAttention(32, 4)(torch.randn(2, 3, 32), cache=[]), TypeError,
         "cache: expected a qkv.cache.LatentCache"),
    ],
)  # fmt: skip
def test_errors(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_deepseek_yarn_rotary_scales_the_softmax_as_deepseeks_mla():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    v3 = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    mla = qkv.MultiHeadLatentAttention(64, 4, dim_head=16, rope_dim=8, rotary=qkv.Rotary(8, scaling=v3))
    assert mla.scale == pytest.approx(yarn_apply_mscale(v3, 24 ** -0.5), rel=1e-12)
    assert mla.scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(40.0) + 1) ** 2, rel=1e-12)
    unset = qkv.Rotary(8, scaling={**v3, "mscale_all_dim": 0})  # (0: not given, as transformers reads it)
    plain = qkv.MultiHeadLatentAttention(64, 4, dim_head=16, rope_dim=8, rotary=unset)
    assert plain.scale == pytest.approx(yarn_apply_mscale({**v3, "mscale_all_dim": 0}, 24 ** -0.5), rel=1e-15)
    assert plain.scale == pytest.approx(24 ** -0.5, rel=1e-15) and transformers.__version__
