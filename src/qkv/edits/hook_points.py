"""Hook functions at an attention call's hook points, as TransformerLens runs them.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

TransformerLens (Nanda & Bloom 2022) wraps each activation in a ``HookPoint``: a hook
function ``fn(activation, hook=point)`` sees the tensor and either returns None (the tensor,
perhaps changed in place, goes on) or a tensor that replaces it; several on one point run in
the order they were added, each on the last one's result. A backward hook ``fn(grad,
hook=point)`` sees the gradient of the loss with respect to that activation, and may return
one to use instead. The points of one call, each in TransformerLens' layout::

    q                (b, i, h, d)   the queries as the call gets them ([batch, pos, head, d_head])
    k                (b, j, g, d)   the keys as the call gets them
    v                (b, j, g, e)   the values as the call gets them
    attn_scores      (b, h, i, j)   scale · q·k + bias, score_mod, -inf where the mask hides a key
    pattern          (b, h, i, j)   softmax of the scores (0 in a row that sees no key)
    z                (b, i, h, e)   each head's output before W_O

(a caller names them: a model that rotates ``q`` and ``k`` before the call has
TransformerLens' ``hook_rot_q`` and ``hook_rot_k`` there). :func:`attention` runs one call
with them. With hooks at ``q``, ``k``, ``v`` or ``z`` alone it runs on qkv's engines; a hook
at the scores or the pattern needs the ``(b, h, i, j)`` map, so that call is composed the way
TransformerLens composes it (scores and softmax in float32 at least, the pattern in the call's
dtype, ``pattern @ v``), the map kept for the hooks and for the gradient, and every other call
keeps the engines.

Edits (``qkv.edits``) of the same call act on the inputs as the ``q``, ``k``, ``v`` hooks left
them, and before the later hooks at their own points: the scores a hook sees are those after
a knockout or a temperature, the pattern after a patch, ``z`` after an ablation; a pattern
hook's change to a patched row is kept (the row's ``z`` is computed from the pattern the hook
returned).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from . import recorded
from .apply import edited, selection
from .base import Call, Edit

#: The hook points of one attention call, in the order a forward reaches them.
POINTS = ("q", "k", "v", "attn_scores", "pattern", "z")


class HookPoint:
    """What a hook function gets as ``hook``: the point's ``name``, its ``layer()`` and a ``ctx`` dict for the hooks.

    As TransformerLens' ``HookPoint``, one object per point of a model, its ``ctx`` kept from
    one run and one block to the next until contexts are cleared.
    """

    def __init__(self, name: str):
        self.name = name
        self.ctx: dict = {}

    def layer(self) -> int:
        """The layer index of a ``blocks.{layer}.…`` name."""
        return int(self.name.split(".")[1])

    def __repr__(self) -> str:
        return f"HookPoint(name={self.name!r})"


class Hooked:
    """The hook functions of one call: ``forward[point]`` and ``backward[point]`` lists, in the order they run.

    A backward hook carries its block's ``is_open()``: as TransformerLens removes a block's
    hooks when the block ends, a backward run after it fires none.
    """

    def __init__(self):
        self.forward: dict[str, list[tuple[HookPoint, Callable]]] = {}
        self.backward: dict[str, list[tuple[HookPoint, Callable, Callable[[], bool]]]] = {}

    def add(self, direction: str, point: str, hook_point: HookPoint, fn: Callable, is_open: Callable[[], bool]) -> None:
        """Run ``fn`` at ``point`` (one of :data:`POINTS`) in ``direction`` ``"fwd"`` or ``"bwd"`` (while ``is_open()``)."""
        if direction == "fwd":
            self.forward.setdefault(point, []).append((hook_point, fn))
        else:
            self.backward.setdefault(point, []).append((hook_point, fn, is_open))

    def __bool__(self) -> bool:
        return bool(self.forward or self.backward)

    def at(self, point: str) -> bool:
        """Whether any hook runs at ``point``."""
        return point in self.forward or point in self.backward

    def fire(self, point: str, given: Tensor) -> Tensor:
        """``given`` through the forward hooks at ``point``, each on the last one's result; backward hooks attached.

        As TransformerLens' (a backward hook on a ``HookPoint`` module): every backward hook sees
        the gradient with respect to what the forward hooks left, the same for each, and the last
        one's non-None return replaces the gradient with respect to what the point was given.
        """
        tensor = given
        for hook_point, fn in self.forward.get(point, ()):
            returned = fn(tensor, hook=hook_point)
            if returned is not None:
                tensor = _replacement(hook_point.name, tensor, returned)
        backward = self.backward.get(point, ())
        if backward and tensor.requires_grad:  # in inference nothing flows back, so nothing fires (as in TransformerLens)
            replaced: list[Tensor | None] = [None]

            def seen(grad: Tensor) -> None:
                replaced[0] = None
                for hook_point, fn, is_open in backward:
                    returned = fn(grad, hook=hook_point) if is_open() else None
                    if returned is not None:
                        replaced[0] = _replacement(hook_point.name, grad, returned)

            tensor.register_hook(seen)
            if given.requires_grad:  # registered after ``seen`` where they are one tensor, so it runs second
                given.register_hook(lambda grad: replaced[0])
        return tensor


def attention(call: Call, edits: Sequence[Edit], hooked: Hooked):
    """``(result, call, seen)``: the edited ``call`` run with ``hooked``'s functions at its points.

    ``result`` is what ``qkv.attention`` returns for the call's options; ``call`` the edited
    call that ran (``q``, ``k``, ``v`` after their hooks); ``seen`` the hooked ``(b, h, i, j)``
    scores and pattern where the map was built (``{"attn_scores": ..., "pattern": ...}``), for recordings.
    A hook gets its own copy of ``q``, ``k``, ``v`` and ``z`` (changing one in place changes
    what the call reads next, never a KV cache's storage or a tensor autograd has saved).
    """
    inputs = [call.q, call.k, call.v]
    for n, point in enumerate(("q", "k", "v")):
        if hooked.at(point):  # (..., pos, heads, size), TransformerLens' [batch, pos, head, d_head]
            inputs[n] = hooked.fire(point, inputs[n].transpose(-3, -2).clone()).transpose(-3, -2)
    call = Call(*inputs, call.options)
    seen: dict[str, Tensor] = {}
    if hooked.at("attn_scores") or hooked.at("pattern"):
        result, call = _composed(call, edits, hooked, seen)
    else:
        result, call = edited(call.q, call.k, call.v, edits, **call.options)
    if hooked.at("z"):
        parts = list(result) if isinstance(result, tuple) else [result]
        z = hooked.fire("z", parts[0].transpose(-3, -2).clone())  # (..., i, h, e); the engine keeps its output
        parts[0] = z.transpose(-3, -2)
        result = parts[0] if len(parts) == 1 else tuple(parts)
    return result, call, seen


def _composed(call: Call, edits: Sequence[Edit], hooked: Hooked, seen: dict):
    """The call as TransformerLens composes it, with hooks on its scores and pattern: ``(result, call)``.

    Dropout (a model in training) acts before the pattern hook, as in TransformerLens' bridge:
    the hook and the returned weights see the weights after it, as transformers' eager returns
    them (``qkv.attention`` returns them before).
    """
    if call.options.get("return_lse"):
        raise ValueError("return_lse: the log-sum-exp of hooked scores or a hooked pattern describes neither; "
                         "hook the call without asking for it")  # fmt: skip
    for edit in edits:
        call = edit.prepare(call)
    options = call.options
    # (..., h, i, j) in float32 at least (a 16-bit model's logits rounded to its dtype lose range: a bias of -1e5 is
    # -inf in float16), the softmax too; the pattern in the call's dtype, as TransformerLens' bridge and eager give it
    scores = hooked.fire("attn_scores", recorded.scores(call, None, None))
    sinks = options.get("sinks")
    if sinks is None:
        empty = scores.amax(dim=-1, keepdim=True) == float("-inf") if scores.shape[-1] else None  # a row that sees no key
        if empty is not None and bool(empty.any()):  # 0, as TransformerLens sets it, with a zero gradient (not NaN)
            pattern = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        else:
            pattern = torch.softmax(scores, dim=-1)
    else:  # one more logit per row, with no value: the sink's share is dropped after the softmax
        column = sinks.to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
        pattern = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    # a NaN a hook put in the scores: 0, as TransformerLens; in place where no gradient needs the softmax's output (each
    # fresh (b, h, i, j) tensor costs its first touch of memory, as much as the softmax itself on a CPU)
    pattern = pattern.nan_to_num_(0.0) if not pattern.requires_grad else torch.nan_to_num(pattern, nan=0.0)
    pattern = pattern.to(call.q.dtype) if call.q.dtype.itemsize < 4 else pattern
    for edit in edits:
        pattern = edit.weights(call, pattern, None, None)
    if options.get("dropout", 0.0) > 0:
        pattern = torch.nn.functional.dropout(pattern, options["dropout"], training=True)
    pattern = hooked.fire("pattern", pattern)
    seen.update(attn_scores=scores, pattern=pattern)
    grouped = pattern.to(call.v.dtype).unflatten(-3, (call.kv_heads, -1))  # (..., g, h/g, i, j): head n reads KV head
    out = (grouped @ call.v.unsqueeze(-3)).flatten(-4, -3)  # n // (h/g), no copy of v; (..., h, i, e)
    for edit in edits:  # in order, as on the engines; a patch recomputes its rows from the pattern as hooked
        out = edit.with_weights(call, pattern).finish(call, out)
    if not options.get("return_weights"):
        return out, call
    heads, rows = selection(call)
    weights = pattern if heads is None else pattern.index_select(-3, heads.to(pattern.device))
    weights = weights if rows is None else weights.index_select(-2, rows.to(pattern.device))
    return (out, weights.to(call.q.dtype)), call


def _replacement(name: str, given: Tensor, returned: object) -> Tensor:
    """A hook's returned tensor in ``given``'s place, cast to its dtype and device; a shape not ``given``'s is refused."""
    if not isinstance(returned, Tensor):
        raise TypeError(f"{name}: a hook function returns None or a tensor, got {type(returned).__name__}")
    if returned.shape != given.shape:
        raise ValueError(f"{name}: a hook function returned shape {tuple(returned.shape)}, expected the shape it "
                         f"was given, {tuple(given.shape)}")  # fmt: skip
    return returned.to(device=given.device, dtype=given.dtype)


__all__ = ["POINTS", "HookPoint", "Hooked", "attention"]
