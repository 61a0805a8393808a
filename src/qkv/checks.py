"""Input checks for the functional API: every malformed call fails here, with a message a person can act on.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

Each error names the argument and prints what was expected and what was got, in the
caller's shapes. Nothing is broadcast silently: leading dims of q, k and v must be equal,
and masks and biases must broadcast to ``(..., h, i, j)`` without growing it. Once checked,
the call is reshaped to the one layout the backends see, ``(b, h, i, d)``,
with its masks and biases.
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch
from torch import Tensor

from . import score_mods
from ._args import meta_fix, probability
from ._layout import Layout, merge_lead
from .backends import hidden_keys
from .backends.request import Request
from .masks import Mask, Window, as_mask
from .positional import LazyBias
from .scores import Dot, ScaledDot, Score, make

#: The scores without parameters, one shared instance per name: a call that names its score
#: (the usual ``score="scaled_dot"``) gets it from here instead of building an ``nn.Module``,
#: which cost more than the rest of the checks together in a one-token decoding step.
_STATELESS: dict[str, Score] = {"dot": Dot(), "scaled_dot": ScaledDot()}
#: ``causal=True`` without another mask: one shared (immutable) causal window.
_CAUSAL = Window(None, 0)


def request(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score: str | Score,
    mask: Mask | Tensor | None,
    bias: Tensor | LazyBias | None,
    causal: bool,
    scale: float | None,
    dropout: float,
    return_weights: bool,
    generator: torch.Generator | None = None,
    sinks: Tensor | None = None,
    score_mod=None,
    return_lse: bool = False,
    hidden_after: bool = False,
) -> Request:
    """Validate one call and fold it into a :class:`Request`.

    Keys the mask hides from every query are made harmless here (``backends.hidden_keys.
    guard``), unless ``hidden_after``: then the caller, which chooses the backend and runs the
    call itself, guards a call that records gradients or is traced once it knows the backend
    may read such a key (``hidden_keys.reads``), and checks an inference call's output with
    ``hidden_keys.after``, which costs it less.
    """
    _tensors(q, k, v)
    named = _STATELESS.get(score) if isinstance(score, str) else None
    score = make(score) if named is None else named
    _shapes(q, k, v)
    score.check(q, k)
    if named is None and type(score) not in (Dot, ScaledDot):  # a learned score's parameters multiply q and k
        _on_device("score", score, q)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights: expected a bool, got {type(return_weights).__name__}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    target = (*q.shape[:-1], k.shape[-2])  # (..., h, i, j)
    mask = as_mask(mask)
    if mask is not None:
        _mask(mask, target, q)
        mask.check(q.shape[-2], k.shape[-2])
        mask.reset()
    bias = _bias(bias, target, q)
    if q.shape[-1] == 0 and isinstance(score, Dot):
        # No features: every logit is 0 (the sum of no products) whatever the scale, as PyTorch
        # gives it (its default 1/√0 multiplies nothing); 1/√d has no value here to compute. A
        # scale given is still checked. The engines get one zero feature, the same logits, as
        # some kernels refuse a size of 0.
        _scale(scale, score, 1)
        q, k, scale = one_zero_feature(q), one_zero_feature(k), 1.0
    else:
        scale = _scale(scale, score, q.shape[-1])
    if scale <= 0 and score.dot_form:
        # PyTorch's fused CPU kernel drops its own causal mask when the scale is not positive (its
        # hidden logits turn to nan: torch 2.13, also F.scaled_dot_product_attention's is_causal).
        # scale·q·k = (-scale)·(-q)·k exactly, and a scale of 0 is the logit 0·q·k on every engine.
        q, scale = (q.neg(), -scale) if scale < 0 else (q * 0.0, 1.0)
    dropout = probability("dropout", dropout)
    sinks = _sinks(sinks, q)
    score_mod = score_mods.check(score_mod)
    layout = Layout.of(q)
    if not layout.canonical:  # one reshape, here: every backend sees (b, h, i, d)
        q, k, v = (layout.to_canonical(x) for x in (q, k, v))
        mask = None if mask is None else mask.merge_lead(layout.lead)
        bias = merge_lead(bias, layout.lead) if isinstance(bias, Tensor) else bias
    if causal:
        mask = _CAUSAL if mask is None else mask & _CAUSAL
    req = Request(
        q=q, k=k, v=v, score=score, mask=mask, bias=bias, scale=scale, dropout=dropout,
        return_weights=return_weights, generator=generator, sinks=sinks, score_mod=score_mod, return_lse=return_lse,
        layout=None if layout.canonical else layout,
    )  # fmt: skip
    if hidden_after:
        return req
    return hidden_keys.guard(req)  # no NaN from a key no row sees, on any engine


def _tensors(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    dtype, device = q.dtype, q.device  # read once: a one-token decoding step runs these checks every call
    for name, x in (("k", k), ("v", v)):
        if x.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} like q, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{name}: expected device {device} like q, got {x.device}")


def _shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    qs, ks, vs = q.shape, k.shape, v.shape
    n = len(qs)
    if n < 2:
        raise ValueError(f"q: expected at least 2 dims (..., i, d), got shape {tuple(qs)}")
    for name, xs in (("k", ks), ("v", vs)):
        if len(xs) != n:
            raise ValueError(f"{name}: expected {n} dims like q {tuple(qs)}, got shape {tuple(xs)}")
    if vs[-2] != ks[-2]:
        raise ValueError(f"v: expected j={ks[-2]} positions like k, got {vs[-2]} (shape {tuple(vs)})")
    if n >= 3:
        if vs[-3] != ks[-3]:
            raise ValueError(f"v: expected g={ks[-3]} heads like k, got {vs[-3]}")
        h, g = qs[-3], ks[-3]
        # no heads at all (h = g = 0) is an empty call: a batch of 0 in the (b, i, d) form reads as it
        if (h % g != 0) if g else h != 0:
            raise ValueError(f"k: query heads h={h} must be a multiple of KV heads g, got g={g}")
    lead = qs[:-3]
    for name, xs in (("k", ks), ("v", vs)):
        if xs[:-3] != lead:
            raise ValueError(f"{name}: expected leading (batch) dims {tuple(lead)} like q, got {tuple(xs[:-3])}")


def broadcasts(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing it."""
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def _dim_names(n: int) -> list[str]:
    """Names of the ``n`` dims a mask broadcasts to: ``b, h, i, j`` from the right, ``...`` before ``b``."""
    return ["b", "h", "i", "j"][-n:] if n <= 4 else ["..."] * (n - 4) + ["b", "h", "i", "j"]


def _names(target: tuple[int, ...]) -> str:
    """The legend of ``target`` as the messages print it: ``(b, h, i, j)``, ``(i, j)``, ``(..., b, h, i, j)``."""
    names = _dim_names(len(target))
    return f"({', '.join(names[-5:] if len(names) > 4 else names)})"


def _mask(mask: Mask, target: tuple[int, ...], q: Tensor) -> None:
    """Check a mask (every part of an ``&``/``|`` combination) against the call, in the caller's terms.

    Each message quotes what the caller passed (the tensor's shape, ``lengths``' key
    lengths), never the shape a lazy mask's tiles take inside, and the ``target`` the mask
    must broadcast to, named dim by dim.
    """
    from .masks import And, Dense, Or

    if isinstance(mask, (And, Or)):
        # A combination reports only its longer part's batch shape, so a second ``lengths`` (or
        # dense) part with another batch size would otherwise broadcast the output past ``q``.
        for part in (mask.a, mask.b):
            _mask(part, target, q)
        return
    if q.device.type != "meta":
        # Tiles copy a mask's tensors to q's device (a CPU mask serves a CUDA call), but a meta
        # tensor has a shape and no values: the copy would fail deep in a backend, unnamed.
        for what, x in mask.tensors():
            if x.device.type == "meta":
                raise ValueError(
                    f"mask: expected {what} on {q.device} like q, got one on meta (a meta tensor has a shape but no values)"
                )
    if isinstance(mask, Dense):
        _dense_shape(tuple(mask.mask.shape), target)
        return
    batch = tuple(mask.batch_shape())
    if not broadcasts((*batch, 1, 1), target):
        needs = _needs((*batch, 1, 1), target)
        raise ValueError(f"mask: {mask.describe()}; {needs}: a mask broadcasts to {_names(target)} = {target}")


def _dense_shape(shape: tuple[int, ...], target: tuple[int, ...]) -> None:
    if broadcasts(shape, target):
        return
    message = f"mask: expected shape broadcastable to {_names(target)} = {target}, got {shape}"
    if len(shape) == 2 and len(target) >= 4 and shape == (target[-4], target[-1]):
        # transformers' (b, j) padding layout. A 2-d mask is (i, j) whatever its values (when
        # b == i it broadcasts as such), so it is never read as (b, j): the caller says which.
        message += (
            "; a 2-d mask is (i, j), and a (b, j) padding mask (True = real key) goes in as "
            "mask=keep[:, None, None, :], or lazily as qkv.masks.lengths(keep.sum(-1)) for right padding "
            "(qkv.masks.starts(first_real_key) for left padding)"
        )
    if len(shape) == 3 and len(target) >= 4 and shape[0] in (1, target[-4]) and broadcasts(shape[-2:], target[-2:]):
        # a (b, i, j) mask, nn.MultiheadAttention's 3-d layout without its heads: qkv's dims are (b, h, i, j)
        message += "; a 3-d (b, i, j) mask goes in as mask[:, None] (one for every head)"
    raise ValueError(message)


def _needs(shape: tuple[int, ...], target: tuple[int, ...]) -> str:
    """What the call needs of a (lazy) mask's batch dims, by name: ``"the call needs b = 2 (or 1)"``."""
    if len(shape) > len(target):
        return "the call has no batch dim for it"
    names = _dim_names(len(target))[-len(shape) :]
    wrong = [(n, t) for n, s, t in zip(names, shape, target[-len(shape) :]) if s not in (1, t)]
    return "the call needs " + ", ".join(f"{n} = {t}" + ("" if t == 1 else " (or 1)") for n, t in wrong)


def _bias(bias: Tensor | LazyBias | None, target: tuple[int, ...], q: Tensor) -> Tensor | LazyBias | None:
    if bias is None:
        return None
    if isinstance(bias, LazyBias):
        h = target[-3] if len(target) >= 3 else 1
        if bias.heads not in (1, h):
            raise ValueError(f"bias: expected a lazy bias with 1 or {h} heads, got {bias.heads}")
        if q.device.type != "meta":  # its tiles are made on q's device, from its tensors wherever they are: not meta's
            held = held_tensor(bias)
            if held is not None and held.device.type == "meta":
                raise ValueError(f"bias: expected a lazy bias on {q.device} like q, got one on meta (a meta tensor "
                                 "has a shape but no values)")  # fmt: skip
        return bias
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias: expected a float tensor or a qkv.positional.LazyBias, got {type(bias).__name__}")
    if bias.dtype == torch.bool:
        raise TypeError("bias: expected a float tensor added to the logits, got a bool tensor (pass it as mask=)")
    if not bias.dtype.is_floating_point:
        raise TypeError(f"bias: expected a floating-point tensor, got {bias.dtype}")
    if bias.device != q.device:
        raise ValueError(f"bias: expected device {q.device} like q, got {bias.device}")
    if not broadcasts(tuple(bias.shape), target):
        raise ValueError(f"bias: expected shape broadcastable to {target}, got {tuple(bias.shape)}")
    if bias.dim() < 2:  # a (j,) row or one value: as (1, j) / (1, 1), the least rank the engines' tiles read
        bias = bias.reshape((1,) * (2 - bias.dim()) + tuple(bias.shape))
    return bias


def _on_device(name: str, module: torch.nn.Module, q: Tensor) -> None:
    """``ValueError`` for a module whose parameters are on another device than ``q`` (PyTorch's own message comes
    from deep inside its first product, naming neither)."""
    held = held_tensor(module, buffers=False)
    if held is None or held.device == q.device:
        return
    fix = meta_fix(q.device) if held.device.type == "meta" else f"call .to('{q.device}') on the {name}"
    raise ValueError(f"{name}: its parameters are on {held.device}, q on {q.device}; {fix}")


def held_tensor(module: torch.nn.Module, buffers: bool = True) -> Tensor | None:
    """The first parameter (or buffer) of ``module`` or of a module inside it, or None.

    Read from the modules' own dicts: ``nn.Module.parameters()`` builds generators and a set of
    the modules seen, 4-5 µs a call on the Intel Xeon, paid by every call given a lazy bias.
    """
    todo = [module]
    while todo:
        m = todo.pop()
        for x in itertools.chain(m._parameters.values(), m._buffers.values() if buffers else ()):
            if x is not None:
                return x
        todo.extend(m._modules.values())
    return None



def _sinks(sinks: Tensor | None, q: Tensor) -> Tensor | None:
    if sinks is None:
        return None
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks: expected a float tensor of shape (h,), got {type(sinks).__name__}")
    if not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks: expected a floating-point tensor (one logit per query head), got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks: expected device {q.device} like q, got {sinks.device}")
    h = q.shape[-3] if q.dim() >= 3 else 1
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks: expected shape ({h},), one logit per query head, got {tuple(sinks.shape)}")
    return sinks


def one_zero_feature(x: Tensor) -> Tensor:
    """``x (…, 0)`` with one zero feature appended: ``(…, 1)``, still in ``x``'s graph (its gradient stays ``(…, 0)``)."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], 1)], dim=-1)


def _scale(scale: float | None, score: Score, d: int) -> float:
    if scale is None:
        return score.default_scale(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale}")
    return float(scale)


