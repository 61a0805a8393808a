"""A one-token decoding step through a stack of plain encoder layers over their ``KVCache`` s, in PyTorch calls only.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``j`` keys (cached + the new
one), ``d`` per-head query/key size, ``e`` per-head value size, ``dim`` model size.

A cached decoding step of a small model is bound by Python, not arithmetic. In the
``generation`` benchmark's model (2 layers, dim 256, one token a step) the 13 matrix
products read 6 MB of weights in about 0.26 ms, while the modules around them (23 module
calls a step, each input checked, a request built and the engines walked for each
attention call) cost as much again, spread thin: a fast path for the attention module
alone saved 2-3% of a step, this one for the whole stack 17-25% (the fastest of 25 runs
each, four sittings, Intel Xeon). :func:`stack` runs what ``TransformerEncoderLayer.forward``
runs for each layer,

    h = LN₁(x)        (pre-norm; post-norm normalises after each residual instead)
    q, k, v = h W^Q, h W^K, h W^V                  (b, h, 1, d), (b, g, 1, d), (b, g, 1, e)
    K, V = cache.append(k, v)                      (b, g, j, d), (b, g, j, e)
    x = x + softmax(q Kᵀ · scale) V W^O
    x = x + W₂ act(W₁ LN₂(x))

as functional calls on the modules' own parameters, for the commonest call of a decoder:
one new token of plain self-attention, no mask (one query after the cache sees every key,
causal or not) and no weights, in inference (no gradient recorded, nothing traced: the
cache's buffer is written in place). Every layer must be plain (:func:`plain`): the
default mechanism (``Attention``, dot or scaled-dot score, no edits, ``score_mod`` or
dropout, the ``"auto"`` backend), a positional module that only rotates (RoPE), ``nn.Linear``
projections, ``nn.LayerNorm`` s, qkv's ``FeedForward``, all of the input's size and dtype,
none of them training or running more than its class's ``forward`` (a hook, a ``forward``
set on the instance, ``module.compile()``), no ``TorchFunctionMode`` on, and a ``KVCache``
filled by the prompt with room for the token. Optional parts (``qk_norm``,
``gate``) are called as modules. Anything else takes the general path, which also gives
every error message; the layers are all checked before any cache is written, so a
declined step leaves nothing half done. The attention call is ``qkv.attention``'s plain
lane (``backends.sdpa_plain``), the one the general path reaches for the same call, and
every other operation is the one its module runs, so the output and the cache are the
same to the bit (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import has_torch_function

from ._trace import tracing
from .attention import Attention, MultiHeadAttention
from .backends import sdpa_plain
from .cache import KVCache
from .feed_forward import FeedForward
from .module_inputs import autocast_on, split_heads
from .projection import MIN_TOKENS, Linear
from .scores import Dot, ScaledDot


def stack(layers: nn.ModuleList, x: Tensor, caches: list, layer_type: type) -> Tensor | None:
    """``x (b, 1, dim)`` through every layer of ``layers`` (each a ``layer_type``, the encoder layer whose
    forward this replaces), appending to ``caches[n]``: ``(b, 1, dim)`` before the stack's final norm; or None.

    The caller (``Encoder.forward``) asks only without a mask, weights or foreign keywords.
    """
    if type(x) is not Tensor or x.dim() != 3 or x.shape[1] != 1 or x.shape[0] >= MIN_TOKENS:
        return None  # (from MIN_TOKENS rows qkv's Linear may route a product to oneDNN: the modules decide)
    if torch.is_grad_enabled() or tracing() or autocast_on(x.device.type) or _global_hooks() or has_torch_function((x,)):
        return None  # (a TorchFunctionMode would see other functions here than the modules call: F.layer_norm's)
    pairs = list(zip(layers._modules.values(), caches))
    if len(caches) != len(layers) or not all(plain(lay, c, x, layer_type) for lay, c in pairs):
        return None
    for layer, cache in pairs:
        x = _layer(layer, x, cache)
    return x


def plain(layer: nn.Module, cache: object, x: Tensor, layer_type: type) -> bool:
    """Whether :func:`_layer` computes ``layer(x, cache=cache)`` exactly (the module docstring lists what it takes)."""
    if type(layer) is not layer_type or layer.training:
        return False
    m = layer._modules
    mha, ff, norm1, norm2 = m["self_attn"], m["ff"], m["norm1"], m["norm2"]
    if type(mha) is not MultiHeadAttention or not mha.batch_first or type(ff) is not FeedForward or ff.training:
        return False
    s, f = mha._modules, ff._modules
    att, products = s["attention"], (s["q_proj"], s["k_proj"], s["v_proj"], s["out_proj"], f["w_in"], f["w_out"])
    if (type(att) is not Attention or att.edits is not None or att.score_mod is not None or att.backend != "auto"
            or type(att._modules["score"]) not in (Dot, ScaledDot) or (att.training and att.dropout)):  # fmt: skip
        return False
    if type(norm1) is not nn.LayerNorm or type(norm2) is not nn.LayerNorm or any(type(p) not in _LINEAR for p in products):
        return False
    if any(_intercepted(module) for module in (layer, mha, att, ff, norm1, norm2, *products)):
        return False
    positional = s.get("positional")
    if positional is not None and positional.bias() is not None:
        return False
    dim, dtype = (x.shape[-1],), x.dtype  # (the layer's own checks: the input's size, every product's dtype)
    if norm1.normalized_shape != dim or norm2.normalized_shape != dim or any(
            p.in_features != dim[0] for p in (products[0], products[1], products[2], products[4])) or any(
            t is not None and t.dtype != dtype for p in products for t in p._parameters.values()):  # fmt: skip
        return False
    if type(cache) is not KVCache or cache._k is None or cache.from_memory:
        return False  # (a StreamingCache, the prompt's call, a cross-attention memory)
    k, v = cache._k, cache._v
    return (k.dtype == x.dtype and k.device == x.device and k.shape[0] == x.shape[0] and k.shape[1] == mha.kv_heads
            and k.shape[3] == mha.dim_head and v.shape[3] == mha.dim_value_head
            and (cache.max_len is None or cache.length < cache.max_len))  # fmt: skip


def _layer(layer: nn.Module, x: Tensor, cache: KVCache) -> Tensor:
    """``TransformerEncoderLayer.forward`` of one new token over ``cache``, for a layer :func:`plain` took."""
    m = layer._modules
    mha, ff, norm1, norm2 = m["self_attn"], m["ff"]._modules, m["norm1"], m["norm2"]
    s = mha._modules
    h = _norm(norm1, x) if layer.norm_first else x
    q, k, v = split_heads(mha, _linear(s["q_proj"], h), _linear(s["k_proj"], h), _linear(s["v_proj"], h))
    if mha.qk_norm is not None:
        q, k = mha.qk_norm(q, k)
    positional = s.get("positional")
    if positional is not None:
        q, k = positional.rotate(q, k, cache.length)
    k, v = cache.append(k, v)
    att = s["attention"]
    out = sdpa_plain.plain(q, k, v, att.score, False, None)
    if out is None:  # (a call the lane declines, e.g. a dtype its kernel lacks: the mechanism itself)
        out = att(q, k, v)
    if mha.gate is not None:
        out = mha.gate(out, h)
    x = x + _linear(s["out_proj"], out.transpose(1, 2).flatten(2))  # "b h i e -> b i (h e)"
    if layer.norm_first:
        return x + _linear(ff["w_out"], m["ff"].hidden(_linear(ff["w_in"], _norm(norm2, x))))
    x = _norm(norm1, x)
    return _norm(norm2, x + _linear(ff["w_out"], m["ff"].hidden(_linear(ff["w_in"], x))))


#: The projections a step runs as ``F.linear``: qkv's ``Linear`` does too below ``projection.MIN_TOKENS`` rows,
#: which :func:`stack` keeps to.
_LINEAR = (Linear, nn.Linear)


def _linear(p: nn.Linear, x: Tensor) -> Tensor:
    parameters = p._parameters  # (not p.weight: nn.Module's __getattr__ is a measurable share of a step)
    return F.linear(x, parameters["weight"], parameters["bias"])


def _norm(n: nn.LayerNorm, x: Tensor) -> Tensor:
    # F.layer_norm's own call, without its wrapper's torch-function and cuDNN-flag lookups (the same kernel)
    parameters = n._parameters
    return torch.layer_norm(x, n.normalized_shape, parameters["weight"], parameters["bias"], n.eps)


def _intercepted(module: nn.Module) -> bool:
    """Whether calling ``module`` would run more than its class's ``forward``, which skipping its call would skip: a
    hook of its own, a ``forward`` set on the instance (accelerate's hooks), or ``module.compile()``'s compiled call."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
                or getattr(module, "_compiled_call_impl", None) is not None)  # fmt: skip


def _global_hooks() -> bool:
    """Whether a global module hook is registered (``nn.modules.module.register_module_forward_hook``)."""
    return bool(_MODULE._global_forward_hooks or _MODULE._global_forward_pre_hooks)


_MODULE = nn.modules.module
