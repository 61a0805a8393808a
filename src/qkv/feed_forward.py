"""The position-wise feed-forward network of a transformer layer, and a GELU fast on small inputs.

Shape legend: ``dim`` model size, ``hidden`` inner width; inputs ``(..., dim)``.

Vaswani et al. 2017, "Attention Is All You Need", eq. 2: ``FFN(x) = W_2 act(W_1 x + b_1) + b_2``,
applied to each position alone (``qkv.blocks`` wraps it in a residual connection and a norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._args import positive_int, probability
from .module_inputs import input_dtype
from .projection import Linear

ACTIVATIONS = ("relu", "gelu", "swiglu")


class FeedForward(nn.Module):
    """Position-wise feed-forward network, applied to each position alone.

    ``relu`` / ``gelu``: ``W_2 act(W_1 x)`` (Vaswani et al. eq. 2; GELU from Hendrycks &
    Gimpel 2016, as in BERT/GPT). ``swiglu``: ``W_2 (Swish(W x) ⊙ V x)`` (Shazeer 2020, "GLU
    Variants Improve Transformer"); it has three matrices, so to match the parameter count
    of a ReLU network of width ``4·dim`` pass ``hidden ≈ 8·dim/3``.

    Args:
        dim: model size (input and output).
        hidden: inner width (default ``4 · dim``).
        activation: ``"relu"``, ``"gelu"`` or ``"swiglu"``.
        dropout: on the hidden activations, in training mode.
        bias: biases in the linear maps.
    """

    def __init__(self, dim: int, hidden: int | None = None, *, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True):  # fmt: skip
        super().__init__()
        positive_int("dim", dim)
        hidden = 4 * dim if hidden is None else positive_int("hidden", hidden)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        gated = activation == "swiglu"
        # one matrix producing both halves [W x; V x] of the gated form
        # qkv.projection.Linear: large float32 inputs run on oneDNN (1.6-1.8x faster here)
        self.w_in = Linear(dim, 2 * hidden if gated else hidden, bias=bias)
        self.w_out = Linear(hidden, dim, bias=bias)
        self.dropout = nn.Dropout(probability("dropout", dropout))

    def forward(self, x: Tensor) -> Tensor:
        """``x (b, i, dim) -> (b, i, dim)`` (any leading dims), in the parameters' dtype."""
        dim = self.w_in.in_features
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a tensor (..., {dim}), got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != dim:
            # PyTorch's "mat1 and mat2 shapes cannot be multiplied (6x16 and 32x128)" names neither side
            last = f"last dim {x.shape[-1]}" if x.dim() else "a 0-d tensor"
            raise ValueError(f"x: {last} differs from the layer's dim={dim}; expected shape (..., {dim}), "
                             f"got {tuple(x.shape)}")  # fmt: skip
        input_dtype("x", x, self.w_in.weight)
        return self.w_out(self.hidden(self.w_in(x)))

    def hidden(self, a: Tensor) -> Tensor:
        """The activation of ``a = W_1 x`` (``(..., 2 · hidden)`` for SwiGLU: both halves), dropout in training: ``(..., hidden)``."""
        if self.activation == "swiglu":
            gate, value = a.chunk(2, dim=-1)
            a = F.silu(gate) * value
        else:
            a = F.relu(a) if self.activation == "relu" else gelu(a)
        return self.dropout(a) if self.training else a  # identity in eval: skip the call


#: At most this many float32 CPU elements go to PyTorch's own GELU kernel rather than oneDNN's.
SMALL_GELU = 4096


def gelu(a: Tensor) -> Tensor:
    """``F.gelu(a)`` (exact, erf form), small float32 CPU inputs through PyTorch's own kernel.

    On the CPU PyTorch hands a contiguous float32 ``gelu`` to oneDNN, whose set-up costs
    about 15-20 µs a call: more than the arithmetic of a decoding step's ``4·dim``
    activations, and it slows the matrix products after it as well (a cached generation step
    of ``qkv bench --suite generation`` ran 6-10% faster without it). A non-contiguous input
    takes PyTorch's own vectorised kernel, so a small input is passed as a transposed
    ``(2, n/2)`` view: the same values (exact GELU either way; equal bit for bit, as
    tested), and the output comes back in ``a``'s layout.
    """
    n = a.numel()
    if n > SMALL_GELU or n % 2 or a.dtype != torch.float32 or a.device.type != "cpu" or not a.is_contiguous():
        return F.gelu(a)
    return F.gelu(a.view(2, n // 2).t()).t().view(a.shape)
