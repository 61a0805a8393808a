"""The serving suite's machinery at tiny sizes: its tables, targets and the pools it builds."""

import torch

from qkv.bench import serving


def test_quick_section_has_every_table_and_target():
    said = []
    text = serving.section(True, said.append)
    for heading in ("A decoding step", "A ragged batch", "A shared prompt", "Float8 pages", "Multi-head latent attention",
                    "Targets"):  # fmt: skip
        assert heading in text
    for target in ("average call) / loop of SDPA", "average call) / SDPA padded", "int8 cache: bytes per token", "in one call / separate calls"):
        assert target in text
    assert any(line.startswith("  decode:") for line in said)
    latent = next(line for line in said if line.startswith("  latent:"))
    assert float(latent.rsplit("largest difference ", 1)[1].rstrip(")")) < 1e-4  # paged MLA agrees with the loop


def test_the_pools_hold_each_request_s_keys_where_its_table_says():
    pool = serving.Pool([20, 40, 33], seed=0, shared=16)
    assert pool.pages[0][0] == pool.pages[1][0] == pool.pages[2][0]  # the shared prompt's page, once
    for r in range(3):
        k, _ = pool.contiguous(r)
        ids = pool.indices[pool.indptr[r] : pool.indptr[r + 1]]
        torch.testing.assert_close(k[0].transpose(0, 1), pool.data[ids, 0].reshape(-1, serving.G, serving.D)[: pool.lengths[r]])
