"""qkv.flashinfer's BatchMLAPagedAttentionWrapper against MLA's absorbed attention written out per request in float64."""

import math

import numpy as np
import pytest
import torch

import qkv.flashinfer as flashinfer


def _reference(q_nope, q_pe, ckv, kpe, sm_scale, causal):
    """``(out (n, h, c), lse base 2 (n, h))``: softmax(sm · (q_nope·ckv + q_pe·kpe)) @ ckv, bottom-right causal."""
    n, j = q_nope.shape[0], ckv.shape[0]
    s = sm_scale * (torch.einsum("nhc,jc->hnj", q_nope.double(), ckv.double()) + torch.einsum("nhr,jr->hnj", q_pe.double(), kpe.double()))
    if causal:
        s = s.masked_fill(torch.arange(j)[None, None, :] > (torch.arange(n) + j - n)[None, :, None], -math.inf)
    lse = torch.logsumexp(s, -1)
    w = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse.nan_to_num(neginf=0)[..., None]), 0.0)
    return torch.einsum("hnj,jc->nhc", w, ckv.double()), (lse / math.log(2.0)).T


@pytest.mark.parametrize("causal,page_size,rope", [(True, 1, 8), (True, 16, 8), (False, 4, 8), (True, 4, 0)])
def test_mla_matches_each_request_alone(causal, page_size, rope):
    rng = np.random.default_rng(page_size + rope)
    torch.manual_seed(page_size)
    h, c = 4, 32
    lens = [int(rng.integers(1, 50)) for _ in range(5)]
    qo = [int(rng.integers(1, min(4, n) + 1)) for n in lens]
    counts = [-(-n // page_size) + 1 for n in lens]  # one page more than the keys fill: never read
    total = sum(counts) + 2
    order = torch.from_numpy(rng.permutation(total)).int()
    ckv, kpe = torch.randn(total, page_size, c, dtype=torch.float64), torch.randn(total, page_size, rope, dtype=torch.float64)
    kv_indptr = torch.tensor([0, *np.cumsum(counts)], dtype=torch.int32)
    qo_indptr = torch.tensor([0, *np.cumsum(qo)], dtype=torch.int32)
    q_nope, q_pe = torch.randn(sum(qo), h, c, dtype=torch.float64), torch.randn(sum(qo), h, rope, dtype=torch.float64)
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    wrapper.plan(qo_indptr, kv_indptr, order, torch.tensor(lens, dtype=torch.int32), h, c, rope, page_size, causal, 0.3,
                 torch.float64, torch.float64)  # fmt: skip
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    _, natural = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=True)
    at = 0
    for r, (n, j) in enumerate(zip(qo, lens)):
        ids = order[kv_indptr[r] : kv_indptr[r + 1]].long()
        ref, ref_lse = _reference(q_nope[at : at + n], q_pe[at : at + n], ckv[ids].reshape(-1, c)[:j],
                                  kpe[ids].reshape(len(ids) * page_size, rope)[:j], 0.3, causal)  # fmt: skip
        torch.testing.assert_close(out[at : at + n], ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[at : at + n], ref_lse, atol=1e-12, rtol=0)
        torch.testing.assert_close(natural[at : at + n], ref_lse * math.log(2.0), atol=1e-12, rtol=0)
        at += n


def test_mla_checks_and_refusals():
    ints = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(0))
    ckv, kpe = torch.randn(2, 4, 16), torch.randn(2, 4, 8)
    q_nope, q_pe = torch.randn(1, 2, 16), torch.randn(1, 2, 8)
    with pytest.raises(RuntimeError, match="plan"):
        wrapper.run(q_nope, q_pe, ckv, kpe)
    wrapper.plan(ints([0, 1]), ints([0, 1]), ints([1]), ints([3]), 2, 16, 8, 4, True, 0.25, torch.float32, torch.float32)
    out = torch.empty(1, 2, 16)
    assert wrapper.run(q_nope, q_pe, ckv, kpe, out=out) is out
    with pytest.raises(ValueError, match="q_nope.dtype"):
        wrapper.run(q_nope.double(), q_pe.double(), ckv, kpe)
    with pytest.raises(ValueError, match="num_heads"):
        wrapper.run(torch.randn(1, 3, 16), torch.randn(1, 3, 8), ckv, kpe)
    with pytest.raises(NotImplementedError, match="page_table"):
        wrapper.run(q_nope, q_pe, ckv, kpe, page_table=ints([[1]]))
    with pytest.raises(NotImplementedError, match="cutlass"):
        flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(0), backend="cutlass")
