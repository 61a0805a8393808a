"""The CUDA path, checked without a GPU: which backend each call takes, that no CPU-only op runs off the CPU, and flex's lowering.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

What a CPU-only build can check, and how:

* **The dispatch table on CUDA tensors.** ``torch._subclasses.fake_tensor.FakeTensorMode``
  makes tensors with ``device="cuda"`` on a CPU-only build (shape, dtype and device, no
  data), and ``backends.choose`` / ``qkv.explain`` run on them. Indexing a fake CUDA
  tensor, or inverting a fake CUDA bool, fails on a CPU-only build ("PyTorch is not linked
  with support for cuda devices"), so the tensors the masks read (lengths, ids, dense
  masks) are real CPU tensors here: the dispatch reads their types and shapes only. The
  environment probe (``flex_gpu.environment``: a CUDA runtime, compute capability >= 8.0,
  Triton) finds no CUDA runtime on this build and is set to "available" for these tests.
* **No CPU-only op off the CPU.** Every kind of call, forward and backward, on ``meta``
  tensors (a device that is not the CPU: the engines take their public-op paths, as on
  CUDA), with the fused CPU kernel's entry points replaced by functions that fail and every
  aten op recorded by a ``TorchDispatchMode``: none is a oneDNN (``mkldnn``) or a
  ``_for_cpu`` op.
* **The lowering.** On CPU tensors the lowered call runs through flex_attention's own
  eager forward (flex has a CPU forward and no CPU backward) and is compared with the
  reference backend: float64 within 1e-10, float32 inputs against the float64 reference
  within 5e-5 (the bounds of ``tests/test_backends_chunked.py`` and
  ``tests/test_properties.py``); both materialise the same float64 (float32) logits, so
  the float64 difference is rounding of a few operations. The block lists are read back
  through ``qkv.masks.FlexBlocks`` (which honours them, as flex's kernels do and its eager
  forward does not) and must equal the mask entry by entry.

What needs a GPU (compiling and running flex's Triton kernels and SDPA's CUDA kernels,
gradients through flex, timings) is ``benchmarks/gpu_check.py``.
"""

import warnings
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv import backends, checks, projection
from qkv.backends import flex_gpu, local, sdpa
from qkv.backends.engines import fused_blocks
from qkv.backends.tiling import flash_cpu, flex_lowering, framing, threads

flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, G, D, E = 2, 4, 2, 16, 16
PLAIN = dict(score="scaled_dot", mask=None, bias=None, causal=False, scale=None, dropout=0.0, return_weights=False)


@pytest.fixture
def cuda_ready(monkeypatch):
    """flex's environment probe answers "available" (this build has no CUDA runtime to ask)."""
    monkeypatch.setattr(flex_gpu, "environment", lambda device: None)


@contextmanager
def fake_cuda():
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def cuda_inputs(i, j, heads=H, kv_heads=G, dtype=torch.float32):
    return (torch.empty(B, heads, i, D, device="cuda", dtype=dtype), torch.empty(B, kv_heads, j, D, device="cuda", dtype=dtype),
            torch.empty(B, kv_heads, j, E, device="cuda", dtype=dtype))  # fmt: skip


def _fake_cuda_score() -> qkv.scores.Additive:
    """A learned score with its parameters on the fake CUDA device, as q's (its parameters multiply q and k: one left on
    the CPU is refused at the call). Made under ``fake_cuda()``: ``Module.to("cuda")`` would need a CUDA build."""
    score = qkv.scores.Additive(D, D, 4)
    for module in score.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, device="cuda", dtype=p.dtype))
    return score


def head(q, k, v, **kw):
    return qkv.explain(q, k, v, **kw).splitlines()[0]


SDPA = "backend: sdpa (flash or efficient kernel, chosen by PyTorch)"
SDPA_MASK = "backend: sdpa (efficient kernel with a mask tensor, chosen by PyTorch)"
SDPA_LOWER_RIGHT = "backend: sdpa (flash or efficient kernel, causal_lower_right, chosen by PyTorch)"
FLEX = "backend: flex (compiled flex_attention)"
SMALL, LARGE = (64, 64), (2048, 2048)  # b·i·j = 8192 and 8M elements: below and above sdpa.MASK_ELEMENTS


def _documents(i):
    return qkv.masks.documents(torch.repeat_interleave(torch.arange(4), i // 4))


#: (call kind, kwargs(i, j), expected head at SMALL, at LARGE); made under FakeTensorMode, the masks' tensors on the CPU
TABLE = [
    ("plain", lambda i, j: {}, SDPA, SDPA),
    ("causal", lambda i, j: {"causal": True}, SDPA, SDPA),
    ("dense bool mask", lambda i, j: {"mask": torch.rand(i, j) > 0.5}, SDPA_MASK, SDPA_MASK),
    ("dense float bias", lambda i, j: {"bias": torch.zeros(H, i, j, device="cuda")}, SDPA_MASK, SDPA_MASK),
    ("lengths", lambda i, j: {"mask": qkv.masks.lengths(torch.tensor([j // 2, j]))}, SDPA_MASK, FLEX),
    ("window", lambda i, j: {"mask": qkv.masks.window(8)}, SDPA_MASK, FLEX),
    ("documents & causal", lambda i, j: {"mask": _documents(i), "causal": True}, SDPA_MASK, FLEX),
    ("ALiBi", lambda i, j: {"bias": qkv.ALiBi(H), "causal": True}, FLEX, FLEX),
    ("T5 bias", lambda i, j: {"bias": qkv.RelativePositionBias(H, 8, 20)}, FLEX, FLEX),
    ("SoftCap score_mod", lambda i, j: {"score_mod": qkv.SoftCap(5.0), "causal": True}, FLEX, FLEX),
    ("user score_mod", lambda i, j: {"score_mod": lambda s, b, h, q_idx, kv_idx: s - 0.1 * (q_idx - kv_idx).abs()}, FLEX, FLEX),
    ("sinks", lambda i, j: {"sinks": torch.zeros(H, device="cuda")}, FLEX, FLEX),
    ("log-sum-exp", lambda i, j: {"return_lse": True, "causal": True}, FLEX, FLEX),
    ("every weight", lambda i, j: {"return_weights": True}, "backend: reference", "backend: reference"),
    ("some weights", lambda i, j: {"return_weights": True, "weights_for": {"rows": [1]}},
     "backend: chunked (online_softmax)", "backend: chunked (online_softmax)"),
    ("additive score", lambda i, j: {"score": _fake_cuda_score()}, "backend: chunked (online_softmax)",
     "backend: chunked (online_softmax)"),
    ("dropout", lambda i, j: {"dropout": 0.1, "causal": True}, SDPA, SDPA),
    ("dropout & ALiBi", lambda i, j: {"dropout": 0.1, "bias": qkv.ALiBi(H)}, "backend: chunked (online_softmax)",
     "backend: chunked (online_softmax)"),
    ("dropout & window", lambda i, j: {"dropout": 0.1, "mask": qkv.masks.window(8)}, SDPA_MASK, SDPA_MASK),  # flex has no dropout
]  # fmt: skip


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("kind, make, small, large", TABLE, ids=[row[0] for row in TABLE])
def test_the_backend_each_call_takes_on_cuda(cuda_ready, kind, make, small, large, size):
    i, j = size
    with fake_cuda():
        text = qkv.explain(*cuda_inputs(i, j), **make(i, j))
    assert text.splitlines()[0] == (small if size == SMALL else large), text


def test_a_plain_float64_call_names_sdpas_math_kernel(cuda_ready):
    """PyTorch's flash and efficient kernels take half and single precision: float64 runs its math kernel."""
    with fake_cuda():
        assert head(*cuda_inputs(64, 64, dtype=torch.float64)) == "backend: sdpa (math kernel (float64), chosen by PyTorch)"
        assert head(*cuda_inputs(64, 64), causal=True) == SDPA


def test_the_cuda_order_tries_sdpa_then_flex_and_lists_every_backend(cuda_ready):
    assert backends.CUDA_PREFERENCE == ("sdpa", "flex", "segments", "local", "chunked", "reference")
    assert set(backends.CUDA_PREFERENCE) == set(backends.REGISTRY)
    assert set(backends.PREFERENCE) | {"flex"} == set(backends.REGISTRY)  # the CPU's order has no flex
    with fake_cuda():
        text = qkv.explain(*cuda_inputs(*LARGE), bias=qkv.ALiBi(H))
    assert text == FLEX + "\n  not sdpa: a lazy bias would be materialised as an (h, i, j) tensor"
    with fake_cuda():
        text = qkv.explain(*cuda_inputs(*LARGE), mask=qkv.masks.window(8))
    assert text == FLEX + (
        "\n  not sdpa: the lazy mask would be materialised as a (1, 2048, 2048) tensor, more than 1048576 elements; "
        "flex_attention builds it by blocks"
    )


def test_causal_with_fewer_queries_than_keys_runs_lower_right_in_a_kernel(cuda_ready):
    with fake_cuda():
        assert head(*cuda_inputs(64, 256, kv_heads=H), causal=True) == SDPA_LOWER_RIGHT
        assert head(*cuda_inputs(1024, 4096, kv_heads=H), causal=True) == SDPA_LOWER_RIGHT
        assert head(*cuda_inputs(1, 4096, kv_heads=H), causal=True) == SDPA  # one query sees every key: unmasked
        # grouped KV heads: causal_lower_right's dispatch takes no enable_gqa, so a mask (small) or flex (large)
        assert head(*cuda_inputs(64, 256), causal=True) == SDPA_MASK
        assert head(*cuda_inputs(1024, 4096), causal=True) == FLEX
        # more queries than keys: the first i - j rows see nothing; a mask tensor and zeroed rows
        assert head(*cuda_inputs(256, 64, kv_heads=H), causal=True) == SDPA_MASK


def test_a_decoding_step_over_a_padded_cache_stays_on_sdpa(cuda_ready):
    with fake_cuda():
        assert head(*cuda_inputs(1, 4096), mask=qkv.masks.lengths(torch.tensor([4000, 4096])), causal=True) == SDPA_MASK


@pytest.mark.parametrize(
    "kw, reason",
    [
        (lambda: {"score": _fake_cuda_score()}, "flex: the concat score is not a dot product (flex_attention computes q·k)"),
        (lambda: {"return_weights": True, "weights_for": {"rows": [0]}}, "flex: flex_attention does not return weights"),
        (lambda: {"dropout": 0.1, "bias": qkv.ALiBi(H)}, "flex: flex_attention has no dropout"),
    ],
)
def test_flex_says_why_it_declines(cuda_ready, kw, reason):
    with fake_cuda():
        assert f"  not {reason}" in qkv.explain(*cuda_inputs(*SMALL), **kw()).splitlines()


def test_flex_declines_float64_masks_and_biases_it_cannot_lower_and_traced_calls(cuda_ready, monkeypatch):
    with fake_cuda():
        q, k, v = cuda_inputs(*SMALL, dtype=torch.float64)
        assert "  not flex: flex_attention's kernels are built for float16, bfloat16 and float32, got torch.float64" in (
            qkv.explain(q, k, v, bias=qkv.ALiBi(H)).splitlines())
        q, k, v = cuda_inputs(*SMALL)
        req = checks.request(q, k, v, **{**PLAIN, "bias": qkv.ALiBi(H)})
        block = framing.Block(0, 64, 0, 64, 64, 64)
        odd_mask = replace(req, mask=framing.Translated(qkv.masks.causal(), block))
        assert flex_gpu.supports(odd_mask) == "the mask Translated has no flex_attention lowering (qkv's own masks do)"
        odd_bias = replace(req, bias=framing.TranslatedBias(qkv.ALiBi(H), block))
        assert flex_gpu.supports(odd_bias) == "the lazy bias TranslatedBias is not shift-invariant: it has no flex_attention lowering"
        monkeypatch.setattr(flex_gpu, "tracing", lambda: True)
        assert flex_gpu.supports(req) == ("torch.compile, torch.export, torch.jit.trace or a torch.func transform runs the "
                                          "call (traced graphs use public ops)")


def test_without_flex_sdpa_materialises_larger_masks_on_cuda_before_the_chunked_engines(monkeypatch):
    monkeypatch.setattr(flex_gpu, "environment", lambda device: "Triton is not installed: flex_attention cannot be compiled")
    with fake_cuda():
        assert head(*cuda_inputs(*LARGE), mask=qkv.masks.window(8)) == SDPA_MASK  # 8M elements, below DEVICE_MASK_ELEMENTS
        text = qkv.explain(*cuda_inputs(8192, 40000), mask=qkv.masks.window(8))  # more than 2^28 elements
    assert text.splitlines()[0] == "backend: chunked (online_softmax)"
    assert "  not sdpa: the lazy mask would be materialised as a (1, 8192, 40000) tensor, more than 268435456 elements" in text.splitlines()


def test_flex_off_or_unavailable_leaves_cuda_calls_to_the_chunked_engines(monkeypatch):
    with fake_cuda():
        q, k, v = cuda_inputs(*SMALL)
        monkeypatch.setattr(flex_gpu, "_environment", {})
        # this build has no CUDA runtime: the probe itself says so
        assert "  not flex: this torch has no CUDA runtime to compile flex_attention for" in (
            qkv.explain(q, k, v, bias=qkv.ALiBi(H)).splitlines())
        monkeypatch.setattr(flex_gpu, "environment", lambda device: None)
        monkeypatch.setattr(flex_gpu, "ENABLED", False)
        text = qkv.explain(q, k, v, bias=qkv.ALiBi(H))
    assert text.splitlines()[0] == "backend: chunked (online_softmax)"
    assert "  not flex: qkv.backends.flex_gpu.ENABLED is False" in text.splitlines()
    assert "  not fused_blocks (engine): the fused CPU kernel needs CPU tensors, got cuda" in text.splitlines()


def test_on_the_cpu_flex_is_never_tried_and_cannot_be_forced():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((B, H, 9, D), (B, G, 9, D), (B, G, 9, E)))
    for kw in ({}, {"bias": qkv.ALiBi(H)}, {"score_mod": qkv.SoftCap(3.0)}, {"sinks": torch.zeros(H, dtype=torch.float64)}):
        assert "flex" not in qkv.explain(q, k, v, **kw)
    with pytest.raises(ValueError, match="backend: 'flex' cannot run this call: flex_attention on CPU has no backward; the CPU engines run this"):
        qkv.attention(q, k, v, backend="flex")
    q, k, v = (x.to("meta") for x in (q, k, v))
    assert flex_gpu.supports(checks.request(q, k, v, **PLAIN)) == "flex_attention is compiled here for CUDA tensors only, got meta"


# --------------------------------------------------------------------------- no CPU-only op off the CPU


class Ops(TorchDispatchMode):
    """Every aten op dispatched while it is on (this thread's: the tile loops run inline, threads.THREADS = 1)."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def _meta_calls(i):
    ids = torch.repeat_interleave(torch.arange(4), i // 4).to("meta")
    return {
        "plain": {}, "causal": {"causal": True},
        "lengths": {"mask": qkv.masks.lengths(torch.tensor([i // 2, i], device="meta"))},
        "window": {"mask": qkv.masks.window(8)}, "documents & causal": {"mask": qkv.masks.documents(ids), "causal": True},
        "dense bool mask": {"mask": torch.ones(i, i, dtype=torch.bool, device="meta")},
        "ALiBi": {"bias": qkv.ALiBi(H), "causal": True}, "T5 bias": {"bias": qkv.RelativePositionBias(H, 8, 20).to("meta")},
        "SoftCap": {"score_mod": qkv.SoftCap(5.0)}, "user score_mod": {"score_mod": lambda s, b, h, q_idx, kv_idx: s - 0.1 * (q_idx - kv_idx).abs()},
        "sinks": {"sinks": torch.zeros(H, device="meta", requires_grad=True), "causal": True},
        "log-sum-exp": {"return_lse": True, "mask": qkv.masks.window(8)}, "additive score": {"score": qkv.scores.Additive(D, D, 4).to("meta")},
        "dropout": {"dropout": 0.1, "causal": True}, "dropout & ALiBi": {"dropout": 0.1, "bias": qkv.ALiBi(H)},
    }  # fmt: skip


@pytest.mark.parametrize("i", [96, 1100], ids=["small", "past-MASK_ELEMENTS"])
def test_no_cpu_only_op_runs_on_tensors_off_the_cpu(monkeypatch, i):
    def fail(*args, **kwargs):
        raise AssertionError("a CPU-only kernel was called on tensors off the CPU")

    for module, attr in ((flash_cpu, "forward"), (flash_cpu, "backward"), (local, "_forward"), (fused_blocks, "_forward")):
        monkeypatch.setattr(module, attr, fail)
    monkeypatch.setattr(threads, "THREADS", 1)  # tile loops inline, so the dispatch mode sees their ops
    for kind, kw in _meta_calls(i).items():
        q, k, v = (torch.randn(s, device="meta", requires_grad=True) for s in ((B, H, i, D), (B, G, i, D), (B, G, i, E)))
        with Ops() as ops:
            result = qkv.attention(q, k, v, **kw)
            out = result[0] if isinstance(result, tuple) else result
            out.sum().backward()
        assert q.grad is not None and q.grad.shape == q.shape, kind
        cpu_only = sorted(name for name in ops.names if "mkldnn" in name or "_for_cpu" in name)
        assert not cpu_only, (kind, cpu_only)


def test_the_projections_onednn_route_is_for_cpu_tensors_only():
    for device in ("meta",):
        x, w = torch.empty(4096, 64, device=device), torch.empty(64, 64, device=device)
        assert not projection.uses_convolution(x, w)
    with fake_cuda():
        x, w = torch.empty(4096, 64, device="cuda"), torch.empty(64, 64, device="cuda")
        assert not projection.uses_convolution(x, w)


# --------------------------------------------------------------------------- the lowering, on CPU


I_LEN, J_LEN, DS, ES = 200, 300, 11, 13  # ragged blocks on both sides, i < j, head sizes below 16 (padded)
GEN = torch.Generator().manual_seed(3)
IDS_Q = torch.repeat_interleave(torch.arange(3), torch.tensor([50, 100, 50]))
IDS_K = torch.repeat_interleave(torch.arange(3), torch.tensor([100, 100, 100]))
TABLE_BIAS = torch.randn(1, H, I_LEN, J_LEN, generator=GEN, dtype=torch.float64)
REL = torch.randn(I_LEN + J_LEN, generator=GEN, dtype=torch.float64)

#: call kind -> kwargs of qkv.attention (float64; cast with the inputs)
LOWERED = {
    "causal": {"causal": True},
    "window": {"mask": qkv.masks.window(20, 5)},
    "offsets": {"mask": qkv.masks.offsets(1, 40), "return_lse": True},  # the last rows see no key
    "lengths & causal": {"mask": qkv.masks.lengths(torch.tensor([120, 300])), "causal": True},
    "starts | window": {"mask": qkv.masks.starts(torch.tensor([10, 250])) | qkv.masks.window(3)},
    "documents": {"mask": qkv.masks.documents(IDS_Q, IDS_K)},
    "dense mask (b, 1, i, j)": {"mask": torch.rand(B, 1, I_LEN, J_LEN, generator=GEN) > 0.3},
    "from_mask_mod per head": {"mask": qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (kv_idx % (h + 2)) != 0, H=H)},
    # made for B = 1: qkv reads it at b = 0 for every batch row (flex would pass b = 1 too)
    "from_mask_mod B = 1": {"mask": qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: kv_idx - q_idx < 50 + 1000 * b, B=1)},
    "ALiBi & causal": {"bias": qkv.ALiBi(H), "causal": True},
    "ALiBi one head": {"bias": qkv.ALiBi(1, slopes=torch.tensor([0.3]))},
    "T5 buckets": {"bias": "t5"},
    "dense bias (1, h, i, j)": {"bias": TABLE_BIAS},
    "SoftCap & lengths": {"score_mod": qkv.SoftCap(2.0), "mask": qkv.masks.lengths(torch.tensor([120, 300]))},
    "table score_mod": {"score_mod": lambda s, b, h, q_idx, kv_idx: s + REL[q_idx - kv_idx + J_LEN]},
    "ALiBi, score_mod, window": {"bias": qkv.ALiBi(H), "score_mod": lambda s, b, h, q_idx, kv_idx: s * (1 + 0.1 * h),
                                 "mask": qkv.masks.window(30, 30)},
    "sinks & causal": {"sinks": torch.randn(H, generator=GEN, dtype=torch.float64), "causal": True, "return_lse": True},
    "bilinear score": {"score": "bilinear", "causal": True},
}  # fmt: skip


def _kwargs(kind, dtype):
    """The call's kwargs with its float tensors and learned modules in ``dtype`` (ALiBi keeps its float64 slopes)."""
    kw = dict(LOWERED[kind])
    if kw.get("bias") == "t5":
        torch.manual_seed(5)
        kw["bias"] = qkv.RelativePositionBias(H, 8, 20).double()
    if kw.get("score") == "bilinear":
        torch.manual_seed(6)
        kw["score"] = qkv.scores.Bilinear(DS).double()
    for key, val in kw.items():
        if isinstance(val, torch.nn.Module) and not isinstance(val, qkv.ALiBi):
            kw[key] = val.to(dtype)
        elif isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            kw[key] = val.to(dtype)
    return kw


def _inputs(dtype, i=I_LEN, j=J_LEN):
    gen = torch.Generator().manual_seed(1)
    shapes = ((B, H, i, DS), (B, G, j, DS), (B, G, j, ES))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]


def _flex_forward(q, k, v, kw):
    """``(out, lse | None)`` of the lowered call through flex_attention's eager CPU forward."""
    keys = ("score", "mask", "bias", "causal", "scale", "dropout", "return_weights", "sinks", "score_mod", "return_lse")
    req = checks.request(q, k, v, **{**PLAIN, **{key: kw[key] for key in keys if key in kw}})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex warns that its eager forward is unfused
        out, _, lse = flex_gpu.forward(req, flex.flex_attention)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", list(LOWERED))
def test_the_lowered_call_through_flex_equals_the_reference(kind, dtype):
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=5e-5, atol=5e-5)
    inputs64 = _inputs(torch.float64)
    want = qkv.attention(*inputs64, backend="reference", **_kwargs(kind, torch.float64))
    out, lse = _flex_forward(*_inputs(dtype), _kwargs(kind, dtype))
    want_out = want[0] if isinstance(want, tuple) else want
    assert out.dtype == dtype and out.shape == want_out.shape
    torch.testing.assert_close(out.double(), want_out, **tol)
    if lse is not None:
        want_lse = want[1]
        assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))  # rows that see no key: -inf, as qkv's
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(lse.double()[finite], want_lse[finite], **tol)


def test_more_queries_than_keys_gives_the_rows_that_see_nothing_zeros():
    """Bottom-right causal with i > j: the first i - j rows see no key, in flex as in qkv."""
    q, k, v = _inputs(torch.float64, i=300, j=200)
    out, lse = _flex_forward(q, k, v, {"causal": True, "return_lse": True, "bias": qkv.ALiBi(H)})
    want_out, want_lse = qkv.attention(q, k, v, causal=True, return_lse=True, bias=qkv.ALiBi(H), backend="reference")
    assert torch.equal(out[:, :, :100], torch.zeros_like(out[:, :, :100])) and bool(torch.isneginf(lse[:, :, :100]).all())
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse[:, :, 100:], want_lse[:, :, 100:], rtol=1e-10, atol=1e-10)


def test_bfloat16_lowering_stays_within_a_bfloat16_rounding_of_the_reference():
    """bf16 inputs: flex's eager forward and qkv's reference on the same bf16 inputs, both float32 inside."""
    kw = _kwargs("ALiBi, score_mod, window", torch.bfloat16)
    out, _ = _flex_forward(*_inputs(torch.bfloat16), kw)
    want = qkv.attention(*_inputs(torch.bfloat16), backend="reference", **kw)
    assert out.dtype == torch.bfloat16
    # two bf16 roundings apart at most: each is the float32 result rounded once (p to bf16 before p @ v in both)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=2**-7 * float(want.abs().max()))


MASKS = {name: kw["mask"] for name, kw in LOWERED.items() if "mask" in kw}
MASKS["causal"] = qkv.masks.causal()
MASKS["flex BlockMask & lengths"] = None  # built in the test: torch's own BlockMask, combined with a qkv mask


def _block_request(mask, i=I_LEN, j=J_LEN):
    q, k, v = _inputs(torch.float32, i, j)
    return checks.request(q, k, v, **{**PLAIN, "mask": mask})


@pytest.mark.parametrize("name", list(MASKS))
def test_the_block_lists_and_mask_mod_give_the_mask_entry_by_entry(name):
    mask = MASKS[name]
    if mask is None:
        bm = flex.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 70, None, None, I_LEN, J_LEN, device="cpu")
        mask = qkv.masks.FlexBlocks(bm) & qkv.masks.lengths(torch.tensor([150, 300]))
    req = _block_request(mask)
    lowered = flex_lowering.block_mask(req, flex_lowering.mask_mod(req))
    got = qkv.masks.FlexBlocks(lowered).dense(I_LEN, J_LEN)  # the lists, and the mask_mod on partial blocks
    want = req.mask.dense(I_LEN, J_LEN)
    got, want = torch.broadcast_tensors(got, want)
    assert torch.equal(got, want)
    # the mask_mod alone, as flex's eager forward evaluates it (vmap over every entry)
    allowed = flex.create_mask(flex_lowering.mask_mod(req), B, H, I_LEN, J_LEN, device="cpu")
    assert torch.equal(allowed, req.mask.dense(I_LEN, J_LEN).expand(B, H, I_LEN, J_LEN))


def test_the_block_lists_are_create_block_masks_whatever_the_band(monkeypatch):
    mask = qkv.masks.lengths(torch.tensor([150, 300])) & qkv.masks.causal()
    req = _block_request(mask, 700, 900)
    mod = flex_lowering.mask_mod(req)
    want = flex.create_block_mask(mod, B, None, 700, 900, device="cpu")
    for band in (2**24, 1):  # one band; one query block per band
        monkeypatch.setattr(flex_lowering, "BAND_ELEMENTS", band)
        flex_lowering.clear_cache()
        got = flex_lowering.block_mask(req, mod)
        for attr in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(got, attr), getattr(want, attr)), attr
        for count, index in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            n = getattr(want, count)
            listed = torch.arange(want.kv_indices.shape[-1]) < n[..., None]
            assert torch.equal(getattr(got, index)[listed], getattr(want, index)[listed]), index


def test_a_torch_block_mask_alone_is_passed_to_flex_as_it_is():
    bm = flex.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, I_LEN, J_LEN, device="cpu")
    req = _block_request(qkv.masks.FlexBlocks(bm))
    assert flex_lowering.block_mask(req, flex_lowering.mask_mod(req)) is bm


def test_block_masks_are_reused_for_the_same_mask_and_rebuilt_when_its_tensors_change():
    flex_lowering.clear_cache()
    lengths = torch.tensor([150, 300])
    first = _block_request(qkv.masks.lengths(lengths) & qkv.masks.causal())
    again = _block_request(qkv.masks.lengths(lengths) & qkv.masks.causal())  # a new mask object: another layer's call
    made = flex_lowering.block_mask(first, flex_lowering.mask_mod(first))
    assert flex_lowering.block_mask(again, flex_lowering.mask_mod(again)) is made
    lengths[0] = 20  # in place: the cached lists are stale
    changed = flex_lowering.block_mask(again, flex_lowering.mask_mod(again))
    assert changed is not made
    assert torch.equal(qkv.masks.FlexBlocks(changed).dense(I_LEN, J_LEN), again.mask.dense(I_LEN, J_LEN).expand(B, 1, I_LEN, J_LEN))
    other = _block_request(qkv.masks.lengths(torch.tensor([150, 300])) & qkv.masks.causal())  # equal values, another tensor
    assert flex_lowering.block_mask(other, flex_lowering.mask_mod(other)) is not changed
    programs = _block_request(qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx))
    assert flex_lowering.block_mask(programs, None) is not flex_lowering.block_mask(programs, None)  # never cached


def test_lengths_are_tensors_in_the_closures_not_ints():
    """A growing cache changes j every step: an int in a closure would make torch.compile recompile each time."""
    req = checks.request(*_inputs(torch.float32), **{**PLAIN, "causal": True, "bias": qkv.ALiBi(H)})

    def held(fn, depth=0):
        found = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # a branch's variable this call never assigned
                continue
            found.append(value)
            if callable(value) and depth < 2:
                found += held(value, depth + 1)
        return found

    values = held(flex_lowering.mask_mod(req)) + held(flex_lowering.score_mod(req))
    lengths = [x for x in values if isinstance(x, torch.Tensor) and x.dim() == 0]
    assert sorted(int(x) for x in lengths) == [J_LEN - I_LEN, J_LEN - I_LEN]  # the shift, in the mask and in ALiBi
    assert not [x for x in values if isinstance(x, int) and not isinstance(x, bool) and x != 0]


def _soft_cap_request(dtype, device):
    with fake_cuda():
        q, k, v = (torch.empty(B, H, 8, D, device=device, dtype=dtype) for _ in range(3))
        return checks.request(q, k, v, **{**PLAIN, "score_mod": qkv.SoftCap(5.0)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_soft_cap_on_cuda_is_lowered_as_the_same_function_through_a_sigmoid(dtype):
    """libdevice's tanh made flex's forward 2.2x slower than ``c·(2σ(2s/c) − 1)`` on an H200; the two agree to float32 ulps."""
    lowered = flex_lowering._kernel_form(qkv.SoftCap(5.0), _soft_cap_request(dtype, "cuda"))
    assert not isinstance(lowered, qkv.SoftCap)
    s = torch.cat([torch.linspace(-400, 400, 20001), torch.tensor([0.0, 1e-30, -1e-30, 3e38, -3e38])])
    assert (lowered(s, 0, 0, 0, 0) - 5.0 * torch.tanh(s / 5.0)).abs().max() <= 4 * 2.0**-24 * 5.0
    s64 = s.double().clamp(-1e4, 1e4).requires_grad_()
    (grad,) = torch.autograd.grad(lowered(s64, 0, 0, 0, 0).sum(), s64)
    assert torch.isfinite(grad).all()  # 4σ(1 − σ): no inf / inf far from 0
    assert torch.allclose(grad, 1 - torch.tanh(s64.detach() / 5.0) ** 2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype, device", [(torch.float32, "cuda"), (torch.float64, "cuda"), (torch.bfloat16, "cpu")])
def test_a_soft_cap_keeps_tanh_in_single_and_double_precision_and_off_cuda(dtype, device):
    cap = qkv.SoftCap(5.0)
    assert flex_lowering._kernel_form(cap, _soft_cap_request(dtype, device)) is cap


# --------------------------------------------------------------------------- sdpa's lower-right causal, wired


def test_sdpa_lower_right_causal_is_the_reference_forward_and_backward(monkeypatch):
    """The CUDA-only ``causal_lower_right`` path, run on the CPU (where PyTorch materialises it) to check its wiring."""
    monkeypatch.setattr(sdpa, "LOWER_RIGHT_DEVICES", ("cpu",))
    from torch.nn.attention.bias import CausalBias

    calls = []
    dispatch = CausalBias._dispatch
    monkeypatch.setattr(CausalBias, "_dispatch", staticmethod(lambda *a, **kw: calls.append(1) or dispatch(*a, **kw)))
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in ((B, H, 50, D), (B, H, 90, D), (B, H, 90, E)))
    out = qkv.attention(q, k, v, causal=True)
    assert calls, "causal_lower_right was not used"
    want = qkv.attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    cot = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(want, (q, k, v), cot), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_the_environment_probe_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(flex_gpu, "_environment", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert flex_gpu.environment(torch.device("cuda", 0)) == (
        "flex_attention's Triton kernels need compute capability 8.0 or newer, this GPU has 7.5")
    monkeypatch.setattr(flex_gpu, "_environment", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    import torch.utils._triton as triton_probe

    monkeypatch.setattr(triton_probe, "has_triton", lambda: False)
    assert flex_gpu.environment(torch.device("cuda", 0)) == "Triton is not installed: flex_attention cannot be compiled"
    monkeypatch.setattr(flex_gpu, "_environment", {})
    monkeypatch.setattr(triton_probe, "has_triton", lambda: True)
    assert flex_gpu.environment(torch.device("cuda", 0)) is None


# --------------------------------------------------------------------------- the lowering, compiled


@pytest.mark.slow
@pytest.mark.parametrize("config", ["masks, T5, score_mod", "BlockMask, ALiBi, SoftCap", "dense bias, offsets"])
def test_the_lowered_closures_compile_and_agree(config):
    """``torch.compile(flex_attention)`` traces every lowered closure (inductor's CPU kernel: forward, no lse).

    Dynamo's tracing of ``score_mod`` and ``mask_mod`` is the same for CUDA; only the kernel
    inductor writes differs (Triton there, C++ here). About 10 s per configuration; each
    starts from ``torch._dynamo.reset()``: after a recompile the CPU template's dynamic-shape
    version fails to build in this torch ("cur_qSplitSize8 was not declared"), a CPU-only bug.
    """
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen) for s in ((B, H, I_LEN, DS), (B, G, J_LEN, DS), (B, G, J_LEN, ES)))
    if config == "masks, T5, score_mod":
        per_head = qkv.masks.from_mask_mod(lambda b, h, q_idx, kv_idx: (kv_idx % (h + 2)) != 0, H=H)
        dense = torch.rand(B, 1, I_LEN, J_LEN, generator=gen) > 0.2
        mask = (qkv.masks.lengths(torch.tensor([120, 300])) & qkv.masks.window(40, 10)) | (
            qkv.masks.documents(IDS_Q, IDS_K) & dense & per_head)
        rel = REL.float()
        kw = {"mask": mask, "bias": qkv.RelativePositionBias(H, 8, 20), "score_mod": lambda s, b, h, q_idx, kv_idx: s + rel[q_idx - kv_idx + J_LEN]}
    elif config == "BlockMask, ALiBi, SoftCap":
        bm = flex.create_block_mask(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 70, None, None, I_LEN, J_LEN, device="cpu")
        kw = {"mask": qkv.masks.FlexBlocks(bm) & qkv.masks.starts(torch.tensor([10, 0])), "causal": True, "bias": qkv.ALiBi(H),
              "score_mod": qkv.SoftCap(3.0)}
    else:
        kw = {"bias": torch.randn(B, 1, I_LEN, J_LEN, generator=gen), "mask": qkv.masks.offsets(1, 40)}  # dead last rows
    torch._dynamo.reset()
    compiled = torch.compile(flex.flex_attention)
    req = checks.request(q, k, v, **{**PLAIN, **kw})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, _, _ = flex_gpu.forward(req, compiled)
    torch.testing.assert_close(out, qkv.attention(q, k, v, backend="reference", **kw), rtol=5e-5, atol=5e-5)


def test_a_call_inductor_has_no_kernel_for_is_retried_then_declined(monkeypatch):
    """flex_gpu.run: "no kernel" errors retry with small tiles, then the call runs on chunked and later ones are declined."""
    from qkv.backends import chunked, flex_gpu

    calls = []

    def failing(req, flex, kernel_options=None):
        calls.append(kernel_options)
        raise RuntimeError("NoValidChoicesError: No choices to select.")

    monkeypatch.setattr(flex_gpu, "forward", failing)
    monkeypatch.setattr(flex_gpu, "compiled", lambda: None)
    monkeypatch.setattr(flex_gpu, "_small_tiles", set())
    monkeypatch.setattr(flex_gpu, "_uncompilable", {})
    monkeypatch.setattr(chunked, "run", lambda req: ("chunked", None, None))
    q = torch.randn(1, 2, 5, 8)
    req = qkv.checks.request(q, q, q, score="scaled_dot", mask=None, bias=None, causal=True, scale=None, dropout=0.0,
                             return_weights=False)  # fmt: skip
    assert flex_gpu.run(req) == ("chunked", None, None)
    assert calls == [None, flex_gpu.SMALL_TILES]
    assert "no flex_attention kernel" in flex_gpu.declined(req)
    monkeypatch.setattr(flex_gpu, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("something else")))
    other = qkv.checks.request(q.double(), q.double(), q.double(), score="scaled_dot", mask=None, bias=None, causal=True, scale=None,
                               dropout=0.0, return_weights=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="something else"):
        flex_gpu.run(other)  # any other error is the caller's


def test_small_tiles_a_learned_call_needed_are_not_taken_by_a_call_that_learns_nothing(monkeypatch):
    """A learned T5 table's kernel asked for more shared memory than an H200 has, so its kind of call runs small
    tiles; a soft cap of the same shape (same dtype, head size, gradients, a score_mod or not) shared that kind and
    ran its forward on them too, 3x SDPA's time. What the kernel reads with a gradient is part of the kind."""
    from qkv.backends import flex_gpu
    from qkv.backends.request import bias_needs_grad

    seen = []

    def fits_unless_learned(req, flex, kernel_options=None):
        seen.append(kernel_options)
        reads = qkv.score_mods.closure_tensors(req.score_mod) if req.score_mod is not None else []
        if kernel_options is None and (bias_needs_grad(req) or any(x.requires_grad for x in reads)):
            raise RuntimeError("out of resource: shared memory")
        return ("ran", None, None)

    monkeypatch.setattr(flex_gpu, "forward", fits_unless_learned)
    monkeypatch.setattr(flex_gpu, "compiled", lambda: None)
    monkeypatch.setattr(flex_gpu, "_small_tiles", set())
    monkeypatch.setattr(flex_gpu, "_uncompilable", {})
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    table = torch.zeros(9, requires_grad=True)

    def call(**kw):
        kw = dict(dict(score="scaled_dot", mask=None, bias=None, causal=True, scale=None, dropout=0.0,
                       return_weights=False), **kw)  # fmt: skip
        return flex_gpu.run(qkv.checks.request(q, q, q, **kw))

    call(score_mod=lambda s, b, h, qi, ki: s + table[qi - ki + 4])
    call(score_mod=qkv.SoftCap(5.0))
    call(bias=qkv.RelativePositionBias(2, 4, 8))
    call(bias=qkv.ALiBi(2))
    assert seen == [None, flex_gpu.SMALL_TILES, None, None, flex_gpu.SMALL_TILES, None]


def _per_head(b, h, q_idx, kv_idx):
    return (kv_idx + h + b) % 3 != 0  # a pattern of its own for each head and batch row


@pytest.mark.parametrize("given", [False, True], ids=["FlexBlocks(bm)", "FlexBlocks(bm, batch, heads)"])
@pytest.mark.parametrize("combined", [False, True], ids=["alone", "& lengths"])
def test_a_block_mask_made_without_batch_and_heads_reads_its_mask_mod_as_the_cpu_does(given, combined):
    """``B=None, H=None``: qkv evaluates the mask_mod at b = h = 0 unless given the call's batch and heads (then at
    each row's and head's own, as flex does). Passed to flex as it is, or read through its block states inside an
    ``&``, the lowering gave the other reading (head 1 was 2.2 off)."""
    bm = flex.create_block_mask(_per_head, None, None, I_LEN, J_LEN, device="cpu")
    mask = qkv.masks.FlexBlocks(bm, B, H) if given else qkv.masks.FlexBlocks(bm)
    if combined:
        mask = mask & qkv.masks.lengths(torch.tensor([J_LEN, J_LEN]))  # hides nothing
    q, k, v = _inputs(torch.float64)
    want = qkv.attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(qkv.attention(q, k, v, mask=mask), want, rtol=1e-10, atol=1e-10)  # the CPU's engines
    out, _ = _flex_forward(q, k, v, {"mask": mask})
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)


def test_block_lists_of_bands_whose_batch_dims_differ_are_broadcast_together():
    """A block mask made for 3 batch rows whose mask_mod reads no b: its first band of tiles came from the program,
    (1, 1, ...), a later one from the block states, (3, 1, ...); the lists failed to expand."""
    bm = flex.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, 3, None, 129, 3, device="cpu")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, 2, n, 16, generator=gen, dtype=torch.float64) for n in (129, 3, 3))
    mask = qkv.masks.FlexBlocks(bm) & qkv.masks.causal()
    want = qkv.attention(q, k, v, mask=mask, backend="reference")
    out, _ = _flex_forward(q, k, v, {"mask": mask})
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
