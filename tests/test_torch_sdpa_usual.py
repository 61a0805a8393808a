"""The SDPA drop-in's usual call goes straight to the plain lane; every other call runs the drop-in's checks.

Shape legend: ``N`` batch, ``Hq`` query heads, ``H`` KV heads, ``L`` query length, ``S`` key length.
"""

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv import torch_sdpa

N, HQ, H, L, S, E = 2, 6, 3, 5, 9, 8


def _inputs(heads=HQ, length=L, dtype=torch.float64):
    gen = torch.Generator().manual_seed(heads * 7 + length)
    q = torch.randn(N, HQ, length, E, generator=gen, dtype=dtype)
    k = torch.randn(N, heads, S, E, generator=gen, dtype=dtype)
    v = torch.randn(N, heads, S, E, generator=gen, dtype=dtype)
    return q, k, v


def _keep(shape):
    keep = torch.rand(*shape, generator=torch.Generator().manual_seed(1)) > 0.3
    keep[..., 0] = True
    return keep


USUAL = {
    "no mask": dict(),
    "grouped heads": dict(heads=H, enable_gqa=True),
    "bool (N, 1, L, S)": dict(mask=(N, 1, L, S)),
    "a decoding step's padding (N, 1, 1, S)": dict(length=1, mask=(N, 1, 1, S), heads=H, enable_gqa=True),
    "bool (1, Hq, L, S), a scale": dict(mask=(1, HQ, L, S), scale=0.3),
}


@pytest.mark.parametrize("case", list(USUAL))
def test_the_usual_call_skips_the_checks_and_equals_torch(case, monkeypatch):
    spec = dict(USUAL[case])
    q, k, v = _inputs(spec.pop("heads", HQ), spec.pop("length", L))
    mask = _keep(spec.pop("mask")) if "mask" in spec else None

    def refuse(*args):
        raise AssertionError("the usual call ran the drop-in's checks")

    monkeypatch.setattr(torch_sdpa, "_validate", refuse)
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, **spec)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **spec)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


OTHER = {
    "is_causal": dict(is_causal=True),
    "a float mask": dict(mask=torch.zeros(N, 1, L, S, dtype=torch.float64)),
    "a 2-d bool mask": dict(mask=torch.ones(L, S, dtype=torch.bool)),
    "a batch that broadcasts": dict(kv_batch=1),
    "dropout_p as an int": dict(dropout_p=0),
    "a scale as a 0-d tensor": dict(scale=torch.tensor(0.3)),
    "different head counts without enable_gqa": dict(heads=H),
}


@pytest.mark.parametrize("case", list(OTHER))
def test_every_other_call_runs_the_checks(case, monkeypatch):
    spec = dict(OTHER[case])
    q, k, v = _inputs(spec.pop("heads", HQ))
    if spec.pop("kv_batch", N) == 1:
        k, v = k[:1], v[:1]
    mask = spec.pop("mask", None)
    seen = []
    checks = torch_sdpa._validate
    monkeypatch.setattr(torch_sdpa, "_validate", lambda *a: seen.append(1) or checks(*a))
    try:
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=mask, **spec)
    except RuntimeError:
        assert case == "different head counts without enable_gqa"  # torch's broadcast error, from the checks
    assert seen


def test_a_usual_call_the_lane_declines_gets_the_full_paths_answer():
    """A nan in a key every query is masked from (a cache's unfilled slot): the lane's output is not finite, so the
    full path runs the call again on zeroed hidden keys, as without the lane."""
    q, k, v = _inputs(H, 1)
    keep = torch.ones(N, 1, 1, S, dtype=torch.bool)
    keep[:, ..., -2:] = False
    k[:, :, -1], v[:, :, -2] = float("nan"), float("inf")
    got = qkv.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k[..., :-2, :], v[..., :-2, :], enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_usual_looking_call_that_is_wrong_gets_the_drop_ins_message():
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="attn_mask: expected a shape broadcastable to the scores"):
        qkv.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(N, 1, L, S + 1, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="dtype"):
        qkv.scaled_dot_product_attention(q, k.float(), v)
