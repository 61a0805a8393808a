"""TransformerLens' hook functions in transformers models run with ``attn_implementation="qkv"``: ``qkv.hooks``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``e`` value size.

Code written for TransformerLens' ``model.hooks(fwd_hooks=..., bwd_hooks=...)`` and
``model.run_with_hooks(...)`` runs on a transformers model unchanged but for the model
becoming the first argument::

    def knock_out_bos(pattern, hook):              # TransformerLens' signature: (activation, hook)
        pattern[:, :, :, 0] = 0                    # changed in place: returning None keeps it
    logits = qkv.run_with_hooks(model, ids, fwd_hooks=[("blocks.3.attn.hook_pattern", knock_out_bos)]).logits

A hook is ``(name, fn)``: ``name`` one hook point's name or a function of a name that says
``True`` for the points it wants; ``fn(activation, hook=point)`` returns None (the activation,
perhaps changed in place, goes on) or a tensor of the activation's shape to use instead;
``point.name``, ``point.layer()`` and ``point.ctx`` (a dict kept from one run to the next) are as
TransformerLens' ``HookPoint``'s. Backward hooks ``fn(grad, hook=point)`` see the gradient at
the point, the same for every hook there, and the last one's return replaces it (TransformerLens'
backward hooks on a ``HookPoint`` module), during a backward run inside the block or while
hooks kept by ``reset_hooks_end=False`` last (:func:`reset_hooks` removes them).

The points are those of each attention layer ``l`` (``qkv.edits.hook_points``):
``blocks.{l}.attn.hook_q (b, i, h, d)``, ``hook_k (b, j, g, d)``, ``hook_v (b, j, g, e)``,
``hook_attn_scores (b, h, i, j)``, ``hook_pattern (b, h, i, j)``, ``hook_z (b, i, h, e)``. The
query and key are what the attention function gets: where the layer rotates them first
(Llama's ``position_embeddings``) they are TransformerLens' ``hook_rot_q`` and ``hook_rot_k``,
and ``hook_q``/``hook_k`` are not offered. A hook gets its own copy of ``q``, ``k``, ``v`` and
``z``; in a call with cached keys a hook on the keys or values is refused (the cache holds the
earlier ones as computed, where TransformerLens hooks each once before caching it). The residual stream and
MLP points are not attention's (PyTorch's ``register_forward_hook`` on the model's modules
reaches those). A layer whose scores or pattern are hooked builds its ``(b, h, i, j)`` map, as
TransformerLens builds every layer's; the other layers run on qkv's engines. Does not import
transformers.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
import weakref
from typing import Callable, Iterator, Sequence

import torch

from ..edits.hook_points import POINTS, HookPoint
from .transformers_edits import _ACTIVE, KEPT, Recording, _active, _attention_layers, _Session, forward_source


#: Each model's hook points, one object per name, so that a point's ``ctx`` lasts from one block to the next.
_POINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: The attribute of a model that holds the hook sessions kept on it (``reset_hooks_end=False``).
_KEPT_ON_MODEL = "_qkv_kept_hooks"


@contextlib.contextmanager
def hooks(model: torch.nn.Module, fwd_hooks: Sequence = (), bwd_hooks: Sequence = (), reset_hooks_end: bool = True,
          clear_contexts: bool = False) -> Iterator[torch.nn.Module]:  # fmt: skip
    """Run ``fwd_hooks`` and ``bwd_hooks`` (``[(name or name filter, fn), ...]``) at ``model``'s attention hook points.

    TransformerLens' ``model.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts)``:
    yields the model; the hooks are removed when the block ends (a backward run after it fires
    no backward hook), unless ``reset_hooks_end=False``, which keeps them on the model, for
    every thread, until :func:`reset_hooks`; ``clear_contexts`` empties every hook point's
    ``ctx`` when they are removed. Blocks nest with each other and with ``qkv.edit`` and
    ``qkv.record``: at each point hooks run in the order they were added, edits apply before
    hooks, and recordings show what the hooks left.
    """
    found = _attention_layers(model, "hooks")
    names = hook_names(model, found)
    points = _POINTS.setdefault(model, {})
    session = _Session(found)
    for direction, given in (("fwd", fwd_hooks), ("bwd", bwd_hooks)):
        for name, fn in _pairs(f"{direction}_hooks", given):
            for chosen in _matching(name, names, f"{direction}_hooks"):
                layer, point = names[chosen]
                hook_point = points.setdefault(chosen, HookPoint(chosen))
                session.hooks.setdefault(layer, []).append((direction, point, hook_point, fn))
    if not reset_hooks_end:
        # held by the model, found through KEPT: freed with the model, whose layers' ids the session names
        vars(model).setdefault(_KEPT_ON_MODEL, []).append(session)
        KEPT.add(session)
        yield model
        return
    try:
        with _active(session):
            yield model
    finally:
        if clear_contexts:
            _clear_contexts(model)


def reset_hooks(model: torch.nn.Module, clear_contexts: bool = True) -> None:
    """Remove every hook on ``model`` (TransformerLens' ``reset_hooks``): those kept by ``reset_hooks_end=False``, and
    those of ``qkv.hooks`` blocks open in this thread, whose backward hooks fire no more either.

    ``clear_contexts`` (True, as TransformerLens') also empties every hook point's ``ctx``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"reset_hooks: expected a transformers model (a torch.nn.Module), got {type(model).__name__}")
    for session in vars(model).pop(_KEPT_ON_MODEL, []):
        session.open = False
        KEPT.discard(session)
    modules = {id(m) for m in model.modules()}
    for session in _ACTIVE.get():
        if session.hooks and set(session.layers) <= modules:
            session.hooks, session.open = {}, False
    if clear_contexts:
        _clear_contexts(model)


def run_with_hooks(model: torch.nn.Module, *model_args, fwd_hooks: Sequence = (), bwd_hooks: Sequence = (),
                   reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs):  # fmt: skip
    """``model(*model_args, **model_kwargs)`` with ``fwd_hooks`` run at its attention hook points (TransformerLens').

    As TransformerLens' ``run_with_hooks``, the hooks are removed when the forward returns, so
    ``bwd_hooks`` given here never fire (a warning says so) unless ``reset_hooks_end=False``
    keeps them on the model until :func:`reset_hooks`.
    """
    if bwd_hooks and reset_hooks_end:
        warnings.warn("run_with_hooks: the hooks are removed when the forward returns, before a backward pass can run, "
                      "so bwd_hooks never fire; pass reset_hooks_end=False (then qkv.reset_hooks(model)) or use "
                      "`with qkv.hooks(model, bwd_hooks=...)` around the forward and the backward", stacklevel=2)  # fmt: skip
    _refuse_lens_keywords("run_with_hooks", model_kwargs)
    with hooks(model, fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
        return model(*model_args, **model_kwargs)


def _clear_contexts(model: torch.nn.Module) -> None:
    """Empty the ``ctx`` of every hook point of ``model``."""
    for point in _POINTS.get(model, {}).values():
        point.ctx = {}


def run_with_cache(model: torch.nn.Module, *model_args, names_filter=None, device=None, remove_batch_dim: bool = False,
                   reset_hooks_end: bool = True, clear_contexts: bool = False, **model_kwargs):  # fmt: skip
    """``(output, cache)``: ``model(*model_args, **model_kwargs)`` and its attention hook points' activations.

    TransformerLens' ``run_with_cache`` over the points of :func:`hooks`: ``names_filter`` None
    (every point of every attention layer), a name, a list of names or a function of a name;
    the cache is a :class:`~qkv.integrations.transformers_edits.Recording`, keyed by name or by
    ``(name, layer)`` (``cache["pattern", 3]``), its tensors detached (moved to ``device`` if
    given; with ``remove_batch_dim`` a batch of one loses that dim). Hooks of an enclosing
    :func:`hooks` block run first, so the cache holds what they left. A layer whose scores or
    pattern are cached is composed with its map, as TransformerLens composes every layer;
    ``qkv.record`` keeps chosen heads and rows without it.
    """
    unsupported = [name for name in ("incl_bwd", "pos_slice") if model_kwargs.get(name) not in (None, False)]
    if unsupported:
        raise NotImplementedError(f"run_with_cache: {', '.join(unsupported)} not implemented; keep gradients with "
                                  "qkv.hooks' bwd_hooks, and slice positions from the cache's tensors")  # fmt: skip
    for name in ("incl_bwd", "pos_slice"):
        model_kwargs.pop(name, None)
    _refuse_lens_keywords("run_with_cache", model_kwargs)
    found = _attention_layers(model, "run_with_cache")
    known = sorted(set(found.values()))
    names = hook_names(model, found)
    if names_filter is None:
        chosen = list(names)
    elif isinstance(names_filter, (list, tuple)):  # as TransformerLens, names it has no point for are left out,
        chosen = [n for n in names_filter if n in names]  # unless none is one of its points
        if names_filter and not chosen:
            _matching(names_filter[0], names, "names_filter")  # the KeyError that says what qkv offers
    else:
        chosen = _matching(names_filter, names, "names_filter")
    cache = Recording(set(), None, None, (), known)

    def keep(tensor, hook):  # as each forward reaches the point, so the cache is on ``device`` from the start
        tensor = tensor.detach() if device is None else tensor.detach().to(device)
        if remove_batch_dim:
            if tensor.shape[0] != 1:
                raise ValueError(f"run_with_cache: remove_batch_dim needs a batch of one, got {hook.name} of shape {tuple(tensor.shape)}")
            tensor = tensor[0]
        cache.put(hook.name, tensor)

    with hooks(model, [(name, keep) for name in dict.fromkeys(chosen)], (), reset_hooks_end, clear_contexts):
        out = model(*model_args, **model_kwargs)
    return out, cache


#: HookedTransformer's forward keywords, which a transformers model does not take.
_LENS_KEYWORDS = ("return_type", "loss_per_token", "prepend_bos", "padding_side", "start_at_layer", "stop_at_layer",
                  "past_kv_cache", "shortformer_pos_embed", "tokens")  # fmt: skip


def _refuse_lens_keywords(caller: str, model_kwargs: dict) -> None:
    """A ``TypeError`` naming HookedTransformer's keywords in ``model_kwargs``, which would fail deep in the model."""
    found = [name for name in _LENS_KEYWORDS if name in model_kwargs]
    if found:
        raise TypeError(f"{caller}: {', '.join(found)} is TransformerLens' HookedTransformer's; a transformers model takes "
                        "input_ids (and attention_mask) and returns an output object: read .logits, or pass labels= "
                        "for .loss")  # fmt: skip


def _pairs(argument: str, given: Sequence) -> list[tuple[object, Callable]]:
    """``given`` as a list of ``(name or filter, fn)``; anything else is a ``TypeError`` naming ``argument``."""
    if isinstance(given, (str, dict)) or not isinstance(given, (list, tuple)):
        raise TypeError(f"{argument}: expected a list of (hook name or name filter, hook function) pairs, got {type(given).__name__}")
    pairs = []
    for entry in given:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise TypeError(f"{argument}: expected (hook name or name filter, hook function) pairs, got {entry!r}")
        name, fn = entry
        if not callable(fn):
            raise TypeError(f"{argument}: the hook for {name!r} is not callable: {fn!r}")
        if not (isinstance(name, str) or callable(name)):
            raise TypeError(f"{argument}: a hook name is a str or a function of a name returning bool, got {type(name).__name__}")
        pairs.append((name, fn))
    return pairs


def hook_names(model: torch.nn.Module, found: dict[int, int]) -> dict[str, tuple[int, str]]:
    """``{name: (layer, point)}``, every hook point of ``model``'s attention layers (``found``: ``{id(module): layer}``).

    The query and key points are named for what the attention function gets: ``hook_rot_q`` and
    ``hook_rot_k`` where the layer's forward rotates them first (it takes ``position_embeddings``
    or names a rotary embedding), ``hook_q`` and ``hook_k`` where it does not, neither where its
    source cannot be read.
    """
    names = {}
    for module in model.modules():
        if id(module) not in found:
            continue
        layer, rotated = found[id(module)], _rotates(type(module))
        query_key = {} if rotated is None else {"rot_q": "q", "rot_k": "k"} if rotated else {"q": "q", "k": "k"}
        for name, point in {**query_key, **{p: p for p in POINTS if p not in ("q", "k")}}.items():
            names[f"blocks.{layer}.attn.hook_{name}"] = (layer, point)
    return dict(sorted(names.items(), key=lambda item: (item[1][0], POINTS.index(item[1][1]))))


@functools.cache
def _rotates(cls: type) -> bool | None:
    """Whether ``cls.forward`` rotates queries and keys before the attention function (it calls an ``apply_…rotary…``
    or ``apply_…rope…`` function: Llama's ``apply_rotary_pos_emb``, Gemma 4's ``apply_multidimensional_rope``; DETR's
    additive ``position_embeddings`` are not a rotation); None where its source is unreadable."""
    source = forward_source(cls)
    return None if source is None else re.search(r"apply_\w*(rotary|rope)", source) is not None


def _matching(name, names: dict, argument: str) -> list[str]:
    """The hook points among ``names`` that ``name`` (a point's name, or a filter of names) chooses, in layer order."""
    if callable(name) and not isinstance(name, str):
        return [known for known in names if name(known)]  # as TransformerLens, a filter choosing none adds nothing
    if name in names:
        return [name]
    offered = sorted({n.split(".")[-1] for n in names}, key=lambda n: POINTS.index(n.removeprefix("hook_").removeprefix("rot_")))
    layers = sorted({layer for layer, _ in names.values()})
    raise KeyError(
        f"{argument}: {name!r} is not a hook point of this model's attention; qkv offers blocks.{{l}}.attn."
        f"{{{', '.join(offered)}}} for layers l in {layers} (the query and key as the attention function gets them: "
        "hook_rot_q and hook_rot_k where the model rotates them first; the residual stream and MLPs are reached by "
        "torch's register_forward_hook on the model's modules)"
    )
