"""The segments backend: ``documents(ids) & rest`` as one call per document, against the reference.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size; b=2, h=6, g=3, d=11, e=13. Two batch rows
with different documents, one of them with a document that has no key.
"""

import pytest
import reference as ref
import torch

import qkv
from qkv import checks
from qkv.backends import segments
from qkv.masks import documents

B, H, G, D, E = 2, 6, 3, 11, 13
IDS_Q = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 6, 6, 6, 6, 7, 7, 9]])
IDS_K = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3], [5, 5, 6, 6, 6, 6, 7, 7, 7, 8, 8]])


def sine_mod(score, b, h, q_idx, kv_idx):
    """Reads every index: a document's own call must see the caller's batch row and positions."""
    return score + 0.3 * torch.sin(0.5 * q_idx - 0.3 * kv_idx + b + 0.2 * h)


def cases():
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(B, H, 9, 11, generator=gen, dtype=torch.float64)
    return {
        "documents": dict(mask=documents(IDS_Q, IDS_K)),
        "documents&causal": dict(mask=documents(IDS_Q, IDS_K) & qkv.masks.causal()),
        "causal&documents": dict(mask=qkv.masks.causal() & documents(IDS_Q, IDS_K)),
        "causal=True": dict(mask=documents(IDS_Q, IDS_K), causal=True),
        "window&lengths": dict(mask=documents(IDS_Q, IDS_K) & qkv.masks.window(1, 1) & qkv.masks.lengths(torch.tensor([11, 7]))),
        "alibi": dict(mask=documents(IDS_Q, IDS_K), bias=qkv.ALiBi(H).double(), causal=True),
        "dense_bias": dict(mask=documents(IDS_Q, IDS_K), bias=dense),
        "score_mod": dict(mask=documents(IDS_Q, IDS_K), score_mod=sine_mod),
        "softcap_sinks": dict(mask=documents(IDS_Q, IDS_K), score_mod=qkv.SoftCap(2.0), sinks=torch.randn(H, generator=gen, dtype=torch.float64)),
        "additive": dict(mask=documents(IDS_Q, IDS_K), score=qkv.scores.Additive(D, D, 5).double()),
    }


@pytest.mark.parametrize("name", list(cases()))
def test_one_call_per_document_equals_the_reference(name):
    kw = cases()[name]
    q, k, v = ref.random_qkv(B, H, G, 9, 11, D, E)
    req = checks.request(q, k, v, **{"score": "scaled_dot", "bias": None, "causal": False, "scale": None, "dropout": 0.0,
                                     "return_weights": False, **kw})  # fmt: skip
    assert segments.supports(req) is None
    assert qkv.explain(q, k, v, **kw).splitlines()[0] == "backend: segments"
    got = ref.run_with_grads(lambda: qkv.attention(q, k, v, return_lse=True, **kw), [q, k, v])
    want = ref.run_with_grads(lambda: qkv.attention(q, k, v, return_lse=True, backend="reference", **kw), [q, k, v])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_a_document_with_no_key_gives_zeros_and_no_mass():
    q, k, v = ref.random_qkv(B, H, G, 9, 11, D, E)
    out, lse = qkv.attention(q, k, v, mask=documents(IDS_Q, IDS_K), return_lse=True)
    assert torch.equal(out[1, :, 8], torch.zeros_like(out[1, :, 8]))  # document 9 of row 1 has no key
    assert bool(torch.isneginf(lse[1, :, 8]).all())


def test_what_it_does_not_take_goes_to_the_chunked_backend():
    q, k, v = ref.random_qkv(B, H, G, 9, 9, D, E)
    scattered = documents(torch.tensor([[0, 0, 1, 1, 0, 2, 2, 2, 2]] * 2))
    cases = {
        "a document's tokens are not contiguous": dict(mask=scattered),
        "it does not return weights": dict(mask=documents(IDS_Q), return_weights=True, weights_for={"rows": [1]}),
        "the location score reads key positions": dict(mask=documents(IDS_Q), score=qkv.scores.Location(D, 9).double()),
        "the mask has no lazy documents": dict(mask=qkv.masks.causal()),
    }
    for reason, kw in cases.items():
        text = qkv.explain(q, k, v, **kw)
        assert f"not segments: {reason}" in text, text
        got = qkv.attention(q, k, v, **kw)
        want = qkv.attention(q, k, v, backend="reference", **kw)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_each_document_takes_its_fastest_path(monkeypatch):
    """A packed causal batch is a causal square per document: SDPA with is_causal, no mask built."""
    q, k, v = (x.detach().float() for x in ref.random_qkv(1, H, G, 9, 9, D, E))
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    qkv.attention(q, k, v, mask=documents(IDS_Q[:1]) & qkv.masks.causal())
    assert calls == [(None, True)] * 3


@pytest.mark.parametrize("name", ["documents&causal", "softcap_sinks", "alibi"])
def test_without_gradients_each_piece_is_written_in_place_with_the_same_result(name):
    """Under no_grad the pieces go straight into the output (a lower peak); the values are those of the differentiable path."""
    kw = cases()[name]
    q, k, v = ref.random_qkv(B, H, G, 9, 11, D, E)
    want = qkv.attention(q, k, v, return_lse=True, **kw)
    with torch.no_grad():
        got = qkv.attention(q, k, v, return_lse=True, **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b.detach())


def test_varlen_without_gradients_equals_varlen_with_them():
    gen = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 5, 12, 13], dtype=torch.int32)  # an empty sequence and a one-token one
    q, k, v = (torch.randn(13, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = qkv.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    with torch.no_grad():
        got = qkv.varlen_attention(q, k, v, cu, cu, causal=True, return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
