"""PyTorch's private fused CPU attention kernel, behind a probe: when a call may use it, and how.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its backward) is the kernel
behind ``F.scaled_dot_product_attention`` on the CPU. Unlike the public function it returns
the log-sum-exp, which the ``fused_blocks`` and ``alibi_column`` engines need (the ``local``
backend and the Reformer's chunks use it too). It is
private: a torch may lack it, refuse a dtype, or change it, and it runs on CPU tensors
only. So a backend asks :func:`unusable` before choosing it, and gets a reason when it may
not, which ``qkv.explain`` prints:

* the tensors are not on the CPU (a GPU, or ``meta`` for shape inference): public ops only;
* ``torch.compile`` / ``torch.export`` are tracing the call: the backends' Python-level
  block loops and custom autograd functions are left out of traced graphs, which get
  ``F.scaled_dot_product_attention`` instead;
* the probe failed: at first use for each dtype, the kernel's forward and backward run on
  a ``(1, 2, 3, 4)`` problem and are compared with the softmax written out; a missing op,
  an error or a wrong answer keeps every later call of that dtype on public ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._trace import TRACED, tracing

_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_op_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _rows(x: Tensor) -> Tensor:
    """``x`` with its last dim dense: the kernel reads q, k, v, out and d_out as if ``stride(-1) == 1`` (a
    ``[..., ::2]`` slice, a transposed or an expanded last dim gave wrong numbers or memory read as data;
    the public SDPA copies such inputs before calling it). Other strides it follows."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> tuple[Tensor, ...]:
    return _op.default(_rows(q), _rows(k), _rows(v), *args, **kwargs)


def _backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, *args, **kwargs) -> tuple[Tensor, ...]:
    return _op_backward.default(_rows(d_out), _rows(q), _rows(k), _rows(v), _rows(out), *args, **kwargs)


#: ``(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale=None) -> (out, lse)``, or None.
forward = None if _op is None else _forward
#: ``(d_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)``, or None.
backward = None if _op_backward is None else _backward

_probed: dict[torch.dtype, bool] = {}


def unusable(x: Tensor) -> str | None:
    """None when a call on tensors like ``x`` may use the fused CPU kernel, else why not."""
    if tracing():
        return TRACED
    if x.device.type != "cpu":
        return f"the fused CPU kernel needs CPU tensors, got {x.device.type}"
    if not works(x.dtype):
        return f"this torch's fused CPU kernel is missing or failed its check for {x.dtype}"
    return None


def works(dtype: torch.dtype) -> bool:
    """True when the kernel's forward and backward give the softmax's answer for ``dtype`` (probed once)."""
    if dtype not in _probed:
        _probed[dtype] = _probe(dtype)
    return _probed[dtype]


def _probe(dtype: torch.dtype) -> bool:
    if forward is None or backward is None:
        return False
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(1, 2, 3, 4, generator=gen).to(dtype) for _ in range(4))
    mask = torch.zeros(1, 2, 3, 3, dtype=dtype).masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    try:
        with torch.no_grad():
            out, lse = forward(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
            dq, dk, dv = backward(d_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=0.5)
        if dtype in (torch.float16, torch.bfloat16):
            # 64 x 64 and larger take the kernel's packed (VNNI) path, which raises where
            # ATEN_CPU_CAPABILITY is set below the CPU's own (avx2 on an AVX-512 CPU)
            wide = torch.zeros(1, 1, 64, 4, dtype=dtype)
            with torch.no_grad():
                wide_out, wide_lse = forward(wide, wide, wide, 0.0, True, scale=0.5)
                backward(wide, wide, wide, wide, wide_out, wide_lse, 0.0, True, scale=0.5)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    # the softmax and its gradient written out (no autograd: the probe may run under no_grad
    # or inference mode): dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)), dQ = s dS K, dK = s dSᵀ Q
    q64, k64, v64, do64 = (x.double() for x in (q, k, v, d_out))
    p = torch.softmax(q64 @ k64.mT * 0.5 + mask.double(), dim=-1)
    want = p @ v64
    ds = p * (do64 @ v64.mT - (do64 * want).sum(-1, keepdim=True))
    grads = (ds @ k64 * 0.5, ds.mT @ q64 * 0.5, p.mT @ do64)
    tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4
    got = (out, dq, dk, dv)
    return all(torch.allclose(a.double(), b, atol=tol, rtol=tol) for a, b in zip(got, (want, *grads)))


def mask_dtype(q: Tensor) -> torch.dtype:
    """dtype of additive masks for the kernel: float32 for half-precision inputs (it adds them in float32)."""
    return torch.promote_types(q.dtype, torch.float32)


def same_head_size(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad ``d`` or ``e`` so they match, as the kernel requires.

    Zeros appended to q and k leave every dot product unchanged; zeros appended to v add
    output columns that the caller slices off.
    """
    d, e = q.shape[-1], v.shape[-1]
    if d < e:
        q, k = F.pad(q, (0, e - d)), F.pad(k, (0, e - d))
    elif e < d:
        v = F.pad(v, (0, d - e))
    return q, k, v


def grouped_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """The kernel's backward; half-precision grouped heads get their key and value sums in float32.

    With ``g < h`` KV heads the kernel adds the ``h / g`` query heads' shares of dk and dv
    into one buffer of the input's precision; in bfloat16 that doubled their error against
    float64 at i = 4096, GQA 8/2 (a test in the suite holds the rule). So
    half-precision calls get the KV heads repeated, and the shares are summed here in float32.
    """
    group = q.shape[-3] // k.shape[-3]
    if group == 1 or q.dtype not in (torch.float16, torch.bfloat16):
        return backward(d_out, q, k, v, *args, **kwargs)
    gq, gk, gv = backward(d_out, q, k.repeat_interleave(group, -3), v.repeat_interleave(group, -3), *args, **kwargs)
    gk, gv = (x.unflatten(-3, (-1, group)).sum(-3, dtype=torch.float32).to(x.dtype) for x in (gk, gv))
    return gq, gk, gv
