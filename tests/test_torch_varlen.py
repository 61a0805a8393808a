"""``qkv.varlen_attn`` / ``varlen_attn_out``: PyTorch's ``torch.nn.attention.varlen`` dialect, on a CPU.

Shape legend: ``T`` packed tokens, ``h`` query heads, ``g`` KV heads, ``d`` query/key size,
``e`` value size, ``P`` page size; ``sq``/``sk`` one sequence's lengths. h=6, g=3, d=11, e=13,
so a swapped axis fails (PyTorch's kernel needs e == d: qkv takes more).

The oracle is ``flash_ref.sequence``: each sequence's formula (bottom-right windows, zeros and
lse -inf for a query that sees no key) in float64, compared to 1e-12 (forward) and 1e-10
(gradients). The windows and scales are those of PyTorch's own ``test_varlen_vs_sdpa``, and its
batch-invariance test is run as it is written there (a permutation of the sequences changes no
sequence's output or gradients), bitwise.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qkv
from qkv import torch_varlen
from qkv.torch_varlen import AuxRequest, varlen_attn, varlen_attn_out

from flash_ref import sequence

H, G, D, E = 6, 3, 11, 13
#: PyTorch's test_varlen_vs_sdpa's windows (with 1025 past every length here)
WINDOWS = [(-1, -1), (-1, 0), (4, 0), (-1, 4), (0, 0), (1, 0), (0, 1), (0, -1), (4, 4), (8, 2), (1025, 1025)]
LSE = AuxRequest(lse=True)


def cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


def tokens(n, heads, size, seed, dtype=torch.float64, grad=False):
    x = torch.randn(n, heads, size, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return x.requires_grad_(grad)


def oracle(q, k, v, spans_q, spans_k, *, scale=None, window=(-1, -1)):
    """``(out (T_q, h, e), lse (h, T_q))``: each sequence's queries ``q[a : a + sq]`` over ``k[c : c + sk]``."""
    outs, lses = [], []
    for (a, sq), (c, sk) in zip(spans_q, spans_k):
        o, lse = sequence(q[a : a + sq], k[c : c + sk], v[c : c + sk], scale=scale, window=window)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def spans(lengths):
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return list(zip(starts, lengths))


@pytest.mark.parametrize("scale", [None, 0.1])
@pytest.mark.parametrize("window", WINDOWS)
def test_pytorchs_windows_and_scales_are_each_sequences_formula(window, scale):
    lengths = [5, 1, 9, 0, 12]
    q, k, v = tokens(27, H, D, 0), tokens(27, G, D, 1), tokens(27, G, E, 2)
    out, lse = varlen_attn(q, k, v, cu(lengths), cu(lengths), 12, 12, return_aux=LSE, scale=scale,
                           window_size=window, enable_gqa=True)  # fmt: skip
    want_out, want_lse = oracle(q, k, v, spans(lengths), spans(lengths), scale=scale, window=window)
    assert out.shape == (27, H, E) and lse.shape == (H, 27)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (2, 5)])
def test_queries_are_the_last_of_their_keys_and_gradients_are_the_formulas(window):
    lengths_q, lengths_k = [3, 7, 1, 4], [8, 7, 5, 2]  # sq < sk, sq == sk, and sq > sk (rows that see no key)
    q = tokens(15, H, D, 0, grad=True)
    k, v = tokens(22, G, D, 1, grad=True), tokens(22, G, E, 2, grad=True)
    out, lse = varlen_attn(q, k, v, cu(lengths_q), cu(lengths_k), 7, 8, return_aux=LSE, window_size=window,
                           enable_gqa=True)  # fmt: skip
    want_out, want_lse = oracle(q, k, v, spans(lengths_q), spans(lengths_k), window=window)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    cot = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), cot)
    want = torch.autograd.grad(want_out, (q, k, v), cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=0)


def test_seqused_k_keeps_the_first_keys_of_each_slot_and_aligns_the_queries_with_them():
    capacity, used, lengths_q = 10, [7, 3, 10, 0], [2, 3, 1, 1]
    q = tokens(7, H, D, 0)
    k, v = tokens(4 * capacity, G, D, 1), tokens(4 * capacity, G, E, 2)
    slots = cu([capacity] * 4)
    for window in [(-1, 0), (2, 0), (-1, -1)]:
        with torch.no_grad():
            out, lse = varlen_attn(q, k, v, cu(lengths_q), slots, 3, capacity, return_aux=LSE, window_size=window,
                                   enable_gqa=True, seqused_k=torch.tensor(used, dtype=torch.int32))  # fmt: skip
        want_out, want_lse = oracle(q, k, v, spans(lengths_q), [(s * capacity, n) for s, n in enumerate(used)],
                                    window=window)  # fmt: skip
        torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    assert torch.equal(out[-1], torch.zeros(H, E)) and torch.isneginf(lse[:, -1]).all()  # no key: zeros, -inf
    with pytest.raises(ValueError, match="seqused_k: sequence 1 uses 11 keys, more than its 10"):
        varlen_attn(q, k, v, cu(lengths_q), slots, 3, 11, enable_gqa=True, seqused_k=torch.tensor([7, 11, 10, 0]))


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("window", [(-1, 0), (5, 0), (-1, -1), (2, 3)])
def test_a_block_table_reads_each_sequences_pages_in_any_order(page, window):
    used, lengths_q = [13, 1, 30, 6], [1, 1, 4, 6]
    counts = [-(-n // page) for n in used]
    gen = torch.Generator().manual_seed(3)
    order = torch.randperm(sum(counts) + 3, generator=gen)  # a pool with pages no sequence holds
    k_pool = torch.randn(sum(counts) + 3, page, G, D, generator=gen, dtype=torch.float64)
    v_pool = torch.randn(sum(counts) + 3, page, G, E, generator=gen, dtype=torch.float64)
    table = torch.zeros(len(used), max(counts), dtype=torch.int32)
    packed_k, packed_v, taken = [], [], 0
    for s, n in enumerate(counts):
        ids = order[taken : taken + n]
        taken += n
        table[s, :n] = ids
        packed_k.append(k_pool[ids].reshape(-1, G, D)[: used[s]])
        packed_v.append(v_pool[ids].reshape(-1, G, E)[: used[s]])
    k, v = torch.cat(packed_k), torch.cat(packed_v)
    q = tokens(sum(lengths_q), H, D, 0)
    with torch.no_grad():
        out, lse = varlen_attn(q, k_pool, v_pool, cu(lengths_q), None, 6, 30, return_aux=LSE, window_size=window,
                               enable_gqa=True, seqused_k=torch.tensor(used, dtype=torch.int32), block_table=table)  # fmt: skip
        alone = varlen_attn(q, k_pool, v_pool, cu(lengths_q), cu(used), 6, 30, window_size=window, enable_gqa=True,
                            seqused_k=torch.tensor(used, dtype=torch.int32), block_table=table)  # fmt: skip
    want_out, want_lse = oracle(q, k, v, spans(lengths_q), spans(used), window=window)
    torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    torch.testing.assert_close(alone, out, atol=1e-12, rtol=0)  # cu_seq_k beside a table: read, not used


def test_seqused_k_and_block_table_are_inference_only_and_the_table_needs_seqused_k():
    q, k, v = tokens(4, H, D, 0, grad=True), tokens(4, G, D, 1), tokens(4, G, D, 2)
    pool = torch.zeros(2, 4, G, D, dtype=torch.float64)
    table = torch.tensor([[0]], dtype=torch.int32)
    used = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"^seqused_k is an inference-only parameter\.$"):
        varlen_attn(q, k, v, cu([4]), cu([4]), 4, 4, enable_gqa=True, seqused_k=used)
    with pytest.raises(RuntimeError, match=r"^block_table is an inference-only parameter\.$"):
        varlen_attn(q, pool, pool, cu([4]), None, 4, 4, enable_gqa=True, block_table=table)
    with torch.no_grad():
        varlen_attn(q, k, v, cu([4]), cu([4]), 4, 4, enable_gqa=True, seqused_k=used)
        varlen_attn(q, pool, pool, cu([4]), None, 4, 4, enable_gqa=True, seqused_k=used, block_table=table)
        with pytest.raises(ValueError, match="block_table: requires seqused_k"):
            varlen_attn(q, pool, pool, cu([4]), cu([4]), 4, 4, enable_gqa=True, block_table=table)
        with pytest.raises(ValueError, match="cu_seq_k: expected the offsets"):
            varlen_attn(q, k, v, cu([4]), None, 4, 4, enable_gqa=True)


def test_head_counts_are_checked_as_pytorch_checks_them_with_its_words():
    q, k = tokens(4, 6, 8, 0), tokens(4, 3, 8, 1)
    with pytest.raises(ValueError, match=r"^Expect query and key/value to have the same number of heads but got "
                                         r"Hq=6 and Hkv=3\. Try setting enable_gqa=True for GQA\.$"):  # fmt: skip
        varlen_attn(q, k, k, cu([4]), cu([4]), 4, 4)
    k4 = tokens(4, 4, 8, 1)
    with pytest.raises(ValueError, match=r"^Expect number of query heads to be a multiple of kv heads for GQA but got "
                                         r"Hq=6 and Hkv=4\.$"):  # fmt: skip
        varlen_attn(q, k4, k4, cu([4]), cu([4]), 4, 4, enable_gqa=True)
    same = tokens(4, 6, 8, 1)
    torch.testing.assert_close(varlen_attn(q, same, same, cu([4]), cu([4]), 4, 4, enable_gqa=True),
                               varlen_attn(q, same, same, cu([4]), cu([4]), 4, 4), atol=0, rtol=0)  # fmt: skip


def test_arguments_pytorch_refuses_or_the_kernel_would_misread_are_refused_by_name():
    q, k = tokens(6, 2, 8, 0), tokens(6, 2, 8, 1)
    with pytest.raises(ValueError, match=r"^window_size must have length 2, got 3$"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 6, 6, window_size=(-1, 0, 1))
    with pytest.raises(ValueError, match="window_size"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 6, 6, window_size=(-2, 0))
    with pytest.raises(ValueError, match="max_q: expected an int at least the longest sequence, 6"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 5, 6)
    with pytest.raises(TypeError, match="max_k: expected an int"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 6, None)
    with pytest.raises(ValueError, match="cu_seq_q: expected offsets from 0"):
        varlen_attn(q, k, k, cu([5]), cu([6]), 6, 6)
    with pytest.raises(ValueError, match="cu_seq_k: expected 3 offsets like cu_seq_q"):
        varlen_attn(q, k, k, cu([2, 4]), cu([6]), 6, 6)
    with pytest.raises(TypeError, match="num_splits"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 6, 6, num_splits="auto")
    with pytest.raises(TypeError, match="return_aux"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 6, 6, return_aux=True)
    with pytest.raises(ValueError, match="scale"):
        varlen_attn(q, k, k, cu([6]), cu([6]), 6, 6, scale=float("inf"))
    with pytest.raises(ValueError, match=r"value: expected \(6, 2\) \+ \(size,\) like key"):
        varlen_attn(q, k, tokens(6, 1, 8, 2), cu([6]), cu([6]), 6, 6)


def test_return_aux_and_num_splits_as_pytorch_takes_them():
    q, k, v = tokens(9, H, D, 0), tokens(9, G, D, 1), tokens(9, G, E, 2)
    args = (q, k, v, cu([4, 5]), cu([4, 5]), 5, 5)
    plain = varlen_attn(*args, enable_gqa=True)
    assert isinstance(plain, torch.Tensor)
    assert isinstance(varlen_attn(*args, enable_gqa=True, return_aux=AuxRequest()), torch.Tensor)
    out, lse = varlen_attn(*args, enable_gqa=True, return_aux=AuxRequest(lse=True))
    assert lse.shape == (H, 9) and lse.dtype == torch.float64
    torch.testing.assert_close(out, plain, atol=1e-12, rtol=0)  # (without an lse another kernel may run it)
    for splits in (1, 4, torch.tensor(2)):  # the CUDA kernel's split of the keys: nothing to change here
        assert torch.equal(varlen_attn(*args, enable_gqa=True, num_splits=splits), plain)
    vendor = pytest.importorskip("torch.nn.attention.varlen")
    out, lse = varlen_attn(*args, enable_gqa=True, return_aux=vendor.AuxRequest(lse=True))  # code that builds PyTorch's
    assert lse.shape == (H, 9) and isinstance(varlen_attn(*args, enable_gqa=True, return_aux=vendor.AuxRequest()),
                                              torch.Tensor)  # fmt: skip
    assert qkv.varlen_attn is varlen_attn and qkv.varlen_attn_out is varlen_attn_out


def test_importing_qkv_imports_no_compiler():
    """``torch.nn.attention.varlen`` imports ``torch._dynamo``: qkv's dialect does not import it, so ``import qkv`` stays
    light and inductor's settings (its cache directory) are read when a program compiles, after it sets them."""
    import subprocess
    import sys

    code = "import sys, qkv; assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_out_variant_writes_into_out_and_returns_it_without_a_gradient():
    q, k, v = tokens(9, H, D, 0, grad=True), tokens(9, G, D, 1), tokens(9, G, E, 2)
    out = torch.full((9, H, E), float("nan"), dtype=torch.float64)
    got = varlen_attn_out(out, q, k, v, cu([4, 5]), cu([4, 5]), 5, 5, enable_gqa=True, window_size=(-1, 0))
    assert got is out and not out.requires_grad  # PyTorch's out variant has no autograd formula either
    torch.testing.assert_close(out, varlen_attn(q, k, v, cu([4, 5]), cu([4, 5]), 5, 5, enable_gqa=True,
                                                window_size=(-1, 0)), atol=0, rtol=0)  # fmt: skip
    got, lse = varlen_attn_out(out, q, k, v, cu([4, 5]), cu([4, 5]), 5, 5, enable_gqa=True, return_aux=LSE)
    assert got is out and lse.shape == (H, 9)
    with pytest.raises(ValueError, match=r"out: expected a tensor \(9, 6, 13\)"):
        varlen_attn_out(torch.empty(9, H, D, dtype=torch.float64), q, k, v, cu([4, 5]), cu([4, 5]), 5, 5, enable_gqa=True)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (8, 2)])
def test_a_sequences_result_does_not_depend_on_its_neighbours_bitwise(window):
    """PyTorch's test_batch_invariance: permuted sequences give each sequence the same output and gradients."""
    lengths = [64, 128, 64, 128]
    seqs = [[tokens(n, 2, 32, 10 * s + i, dtype=torch.float32, grad=True) for i in range(3)] for s, n in enumerate(lengths)]

    def run(order):
        q, k, v = (torch.cat([seqs[s][i] for s in order]) for i in range(3))
        cot = torch.cat([torch.ones(lengths[s], 2, 32) * (s + 1) for s in order])
        out = varlen_attn(q, k, v, cu([lengths[s] for s in order]), cu([lengths[s] for s in order]), 128, 128,
                          window_size=window)  # fmt: skip
        grads = torch.autograd.grad(out, [x for s in order for x in seqs[s]], cot)
        per = {s: out[a : a + lengths[s]] for s, a in zip(order, cu([lengths[s] for s in order]).tolist())}
        return per, {s: grads[3 * n : 3 * n + 3] for n, s in enumerate(order)}

    base_out, base_grads = run([0, 1, 2, 3])
    perm_out, perm_grads = run([2, 0, 3, 1])
    for s in range(4):
        assert torch.equal(base_out[s], perm_out[s])
        assert all(torch.equal(a, b) for a, b in zip(base_grads[s], perm_grads[s]))


def test_bfloat16_is_within_twice_bfloat16_sdpas_error_as_pytorchs_test_bounds_it():
    lengths = [64, 192, 128]
    q, k, v = (tokens(384, 4, 64, i, dtype=torch.float32) for i in range(3))
    gold = oracle(q.double(), k.double(), v.double(), spans(lengths), spans(lengths), window=(-1, 0))[0]
    got = varlen_attn(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu(lengths), cu(lengths), 192, 192, window_size=(-1, 0))
    assert got.dtype == torch.bfloat16
    for a, n in spans(lengths):
        qs, ks, vs = (x[a : a + n].bfloat16().transpose(0, 1) for x in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        ref = gold[a : a + n]
        atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()  # PyTorch's test's rounding allowance
        assert (got[a : a + n].double() - ref).abs().max() <= 2 * (sdpa.double() - ref).abs().max() + atol


def test_on_cuda_half_precision_calls_pytorchs_own_kernel(monkeypatch):
    vendor = pytest.importorskip("torch.nn.attention.varlen")
    seen = {}

    def kernel(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return args[0]

    monkeypatch.setattr(vendor, "varlen_attn", kernel)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)  # (a CPU build has none)
    with FakeTensorMode():
        q = torch.empty(8, 4, 64, dtype=torch.bfloat16, device="cuda")
        assert torch_varlen._torch_kernel(q) is vendor
        assert torch_varlen._torch_kernel(q.float()) is None  # float32: not the kernel's, qkv's engines run it
        offsets = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
        varlen_attn(q, q, q, offsets, offsets, 8, 8, window_size=(-1, 0), num_splits=1)
    assert seen["kwargs"]["window_size"] == (-1, 0) and seen["kwargs"]["num_splits"] == 1
    assert torch_varlen._torch_kernel(torch.empty(2, 1, 8, dtype=torch.bfloat16)) is None  # the CPU: qkv's
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    with FakeTensorMode():
        assert torch_varlen._torch_kernel(torch.empty(8, 4, 64, dtype=torch.bfloat16, device="cuda")) is None


def test_a_key_buffer_with_room_past_the_last_offset_is_read_as_the_kernel_reads_it():
    lengths = [4, 5]
    q, k, v = tokens(9, H, D, 0), tokens(16, G, D, 1), tokens(16, G, E, 2)  # 7 rows of room after the keys
    out = varlen_attn(q, k, v, cu(lengths), cu(lengths), 5, 5, enable_gqa=True, window_size=(-1, 0))
    want = oracle(q, k, v, spans(lengths), spans(lengths), window=(-1, 0))[0]
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="cu_seq_q: expected offsets from 0, non-decreasing, ending at query's 12"):
        varlen_attn(tokens(12, H, D, 0), k, v, cu(lengths), cu(lengths), 5, 5, enable_gqa=True)  # rows left unwritten
    with pytest.raises(ValueError, match="cu_seq_k: offsets reach row 9, past key's 8 rows"):
        varlen_attn(q, k[:8], v[:8], cu(lengths), cu(lengths), 5, 5, enable_gqa=True)


def test_num_splits_1_keeps_each_paged_sequence_bitwise_its_own_whatever_the_batch():
    """PyTorch's promise for ``num_splits=1``: a decoding step's requests, read together otherwise, each run alone."""
    gen = torch.Generator().manual_seed(4)
    pool_k, pool_v = torch.randn(12, 16, G, D, generator=gen), torch.randn(12, 16, G, D, generator=gen)
    q = torch.randn(3, H, D, generator=gen)
    table = torch.tensor([[3, 7, 0, 0], [1, 2, 4, 5], [9, 0, 0, 0]], dtype=torch.int32)
    used = torch.tensor([30, 61, 9], dtype=torch.int32)
    call = dict(enable_gqa=True, window_size=(-1, 0), num_splits=1, return_aux=LSE)
    with torch.no_grad():
        alone = [varlen_attn(q[s : s + 1], pool_k, pool_v, cu([1]), None, 1, 61, seqused_k=used[s : s + 1],
                             block_table=table[s : s + 1], **call) for s in range(3)]  # fmt: skip
        for order in ([0, 1, 2], [2, 0, 1]):
            out, lse = varlen_attn(q[order], pool_k, pool_v, cu([1, 1, 1]), None, 1, 61, seqused_k=used[order],
                                   block_table=table[order], **call)  # fmt: skip
            for n, s in enumerate(order):
                assert torch.equal(out[n : n + 1], alone[s][0]) and torch.equal(lse[:, n : n + 1], alone[s][1])
        for rows in (table[:2], torch.cat([table, table[:1]])):  # a row a sequence, checked before the table is cut
            with pytest.raises(ValueError, match=r"block_table: expected a row per sequence \(3\)"):
                varlen_attn(q, pool_k, pool_v, cu([1, 1, 1]), None, 1, 61, seqused_k=used, block_table=rows, **call)


def test_an_empty_paged_batch_and_sequences_with_no_key_answer_as_the_packed_call_does():
    with torch.no_grad():
        none = varlen_attn(tokens(0, H, D, 0), torch.zeros(2, 4, G, D, dtype=torch.float64),
                           torch.zeros(2, 4, G, E, dtype=torch.float64), cu([]), None, 0, 0, enable_gqa=True,
                           seqused_k=torch.zeros(0, dtype=torch.int32), block_table=torch.zeros(0, 3, dtype=torch.int32))  # fmt: skip
        assert none.shape == (0, H, E)
        split = varlen_attn(tokens(0, H, D, 0), torch.zeros(2, 4, G, D, dtype=torch.float64),
                            torch.zeros(2, 4, G, E, dtype=torch.float64), cu([]), None, 0, 0, enable_gqa=True,
                            seqused_k=torch.zeros(0, dtype=torch.int32), block_table=torch.zeros(0, 3, dtype=torch.int32),
                            num_splits=1)  # fmt: skip
        assert split.shape == (0, H, E)
        empty_pool = torch.zeros(0, 4, G, D, dtype=torch.float64)
        out, lse = varlen_attn(tokens(2, H, D, 0), empty_pool, empty_pool, cu([1, 1]), None, 1, 0, enable_gqa=True,
                               seqused_k=torch.zeros(2, dtype=torch.int32), block_table=torch.zeros(2, 1, dtype=torch.int32),
                               return_aux=LSE)  # fmt: skip
    assert torch.equal(out, torch.zeros(2, H, D, dtype=torch.float64)) and torch.isneginf(lse).all()


def test_enable_gqa_is_read_as_pytorchs_bool_argument():
    np = pytest.importorskip("numpy")
    q, k = tokens(4, 6, 8, 0), tokens(4, 3, 8, 1)
    want = varlen_attn(q, k, k, cu([4]), cu([4]), 4, 4, enable_gqa=True)
    for given in (np.bool_(True), 1, 2, 1.0, np.int64(1), torch.tensor(True), torch.tensor(1)):
        assert torch.equal(varlen_attn(q, k, k, cu([4]), cu([4]), 4, 4, enable_gqa=given), want)
    with pytest.raises(TypeError, match="enable_gqa"):
        varlen_attn(q, k, k, cu([4]), cu([4]), 4, 4, enable_gqa="yes")
