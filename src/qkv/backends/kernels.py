"""PyTorch's private fused CPU attention kernel, behind a probe: when a call may use it.

Shape legend: ``b`` batch, ``h`` heads, ``i`` query length, ``j`` key length, ``d`` head size.

``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its backward) is the kernel
behind ``F.scaled_dot_product_attention`` on the CPU. Unlike the public function it returns
the log-sum-exp, which the ``chunked`` (``fused_blocks``) and ``local`` backends need. It is
private: a torch may lack it, refuse a dtype, or change it, and it runs on CPU tensors
only. So a backend asks :func:`unusable` before choosing it, and gets a reason when it may
not, which ``qkv.explain`` prints:

* the tensors are not on the CPU (a GPU, or ``meta`` for shape inference): public ops only;
* ``torch.compile`` / ``torch.export`` are tracing the call: the backends' Python-level
  block loops and custom autograd functions are left out of traced graphs, which get
  ``F.scaled_dot_product_attention`` instead (``qkv._trace``);
* the probe failed: at first use for each dtype, the kernel's forward and backward run on
  a ``(1, 2, 3, 4)`` problem and are compared with the softmax written out; a missing op,
  an error or a wrong answer keeps every later call of that dtype on public ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._trace import tracing

_op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_op_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
#: ``(q, k, v, dropout_p, is_causal, *, attn_mask=None, scale=None) -> (out, lse)``, or None.
forward = None if _op is None else _op.default
#: ``(d_out, q, k, v, out, lse, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)``, or None.
backward = None if _op_backward is None else _op_backward.default

_probed: dict[torch.dtype, bool] = {}


def unusable(x: Tensor) -> str | None:
    """None when a call on tensors like ``x`` may use the fused CPU kernel, else why not."""
    if tracing():
        return "torch.compile / torch.export is tracing the call (traced graphs use public ops)"
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
