"""Edits and recordings inside transformers models run with ``attn_implementation="qkv"``: ``qkv.edit``, ``qkv.record``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``e`` value size; ``H`` and ``R`` the number of recorded heads and rows.

    with qkv.edit(model, {3: AblateHeads([0, 5]), 4: [Knockout(edges), ScaleHeads(s)]}):
        out = model(**batch)
    with qkv.record(model, layers=[3], heads=[0, 5], rows=[7]) as rec:
        model(**batch)
    rec["blocks.3.attn.hook_pattern"]            # (b, 2, 1, j)

transformers calls :func:`~qkv.integrations.transformers.attention_forward` once per layer
with the layer's module; that function asks :func:`runner` what to run. Outside these
context managers (or for a model not named in them) it is ``qkv.attention`` itself, a
context-variable read and no other cost. Inside, it is ``qkv.edits.attention`` with the
layer's edits (``module.layer_idx`` is the layer), followed by the recording. A context
variable, not a flag on the model, so threads and ``asyncio`` tasks running the same model
see only their own edits, and leaving the block (even by an exception) restores the model.
A thread started inside a block (``Thread(target=model.generate)`` with a streamer) runs
the model unedited: open the block inside the thread's function. In a hybrid model (Mamba or
convolution layers beside attention) the layers are the attention layers' own indices.
Under a static cache (``cache_implementation="static"``) edits and recordings see the keys
up to the last query's position, as a dynamic cache holds them (the cache's unfilled slots,
which no query sees, are left out), so masks aligned to the last key align alike.
Edits apply to every call, a ``generate()`` decoding step included (one query row against
the cached keys); ``AblateHeads(how="mean")``, whose mean there would be of the new token
alone, is refused in a call with cached keys.

Recordings are keyed with TransformerLens' names (Nanda & Bloom 2022), for the chosen
heads and rows only (``qkv.edits.recorded``): ``blocks.{l}.attn.hook_attn_scores (b, H,
R, j)``, ``blocks.{l}.attn.hook_pattern (b, H, R, j)`` and ``blocks.{l}.attn.hook_z (b, R,
H, e)``, index ``n`` of each axis being ``rec.heads[n]`` / ``rec.rows[n]``. They show the
edited run: a knocked-out edge is ``-inf`` in the scores and 0 in the pattern, a patched
row its pattern, an ablated head its new ``z``. A layer run twice in the block (a
generation step) keeps its last call. Scores and pattern are float32 at least, ``z`` in
the model's dtype (``qkv.edits.recorded`` lists each against TransformerLens' definition).
Does not import transformers.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..edits import hook_points, recorded
from ..edits.ablate import refuse_mean_with_cache
from ..edits.apply import edited
from ..edits.base import Call, Edit, as_edits, check_selection, indices
from ..edits.hook_points import HookPoint, Hooked
from ..functional import attention
from .lens_names import entry_name, layer_of

#: What ``qkv.record`` can build, TransformerLens' hook names.
HOOKS = ("attn_scores", "pattern", "z")
#: Also recordable when asked: ``hook_result (b, R, H, d_model)``, each head's ``z`` through its
#: columns of the layer's output projection (TransformerLens' per-head result, no bias).
OPTIONAL = ("result",)


@dataclass(eq=False)  # sessions are told apart by identity (two blocks with the same hooks are two)
class _Session:
    """One ``qkv.edit`` or ``qkv.record`` block: the model's attention modules and what to do in them."""

    layers: dict[int, int]  # id(attention module) -> its layer index
    edits: dict[int, tuple[Edit, ...]] = field(default_factory=dict)  # layer -> its edits, in order
    recording: Recording | None = None
    hooks: dict[int, list[tuple[str, str, HookPoint, Callable]]] = field(default_factory=dict)  # layer -> (dir, point, ...)
    open: bool = True  # False once the block has ended: its backward hooks fire no more
    order: int = field(default_factory=itertools.count().__next__)  # sessions run in the order they were made


_ACTIVE: ContextVar[tuple[_Session, ...]] = ContextVar("qkv_transformers_edits", default=())
#: Hook sessions kept after their block (``qkv.hooks(..., reset_hooks_end=False)``) until ``qkv.reset_hooks``, seen by
#: every thread, as TransformerLens keeps hooks on its modules. The model holds them (``transformers_hooks``); this set
#: only finds them, so a model and the hooks kept on it are freed together.
KEPT: weakref.WeakSet = weakref.WeakSet()


class Recording(Mapping):
    """The tensors recorded in a ``qkv.record`` block, a read-only dict keyed ``blocks.{l}.attn.hook_{name}``.

    ``heads`` and ``rows`` are the chosen indices (None: all) that the head and row axes of
    every entry follow. ``hooks`` names what each layer records: one tuple for all, or
    ``{layer: tuple}``. As TransformerLens' ``ActivationCache``, an entry is also found by
    ``(name, layer)``, ``(name, layer, "attn")`` or a shorthand: ``rec["pattern", 3]``,
    ``rec["pattern3"]`` (its aliases, a negative layer counting from the model's last attention
    layer: ``lens_names``), and :meth:`to`, :meth:`remove_batch_dim` and
    :meth:`stack_activation` are its methods.
    """

    def __init__(self, layers: set[int], heads, rows, hooks: tuple[str, ...] | dict[int, tuple[str, ...]],
                 known: Sequence[int] = ()):  # fmt: skip
        self.layers, self.heads, self.rows, self.hooks = layers, heads, rows, hooks
        self._known = list(known)  # the model's attention layers, ascending (for negative layers in keys)
        self._entries: dict[str, Tensor] = {}

    def __getitem__(self, key: str | tuple) -> Tensor:
        if not (isinstance(key, str) and key in self._entries):
            key = entry_name(key, self._known)
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"{key!r}: not recorded; recorded are {sorted(self._entries)}") from None

    def to(self, device) -> Recording:
        """Every entry moved to ``device``; returns the recording (TransformerLens' ``ActivationCache.to``)."""
        self._entries = {name: x.to(device) for name, x in self._entries.items()}
        return self

    def remove_batch_dim(self) -> Recording:
        """Every entry without its batch dim of 1; returns the recording (a batch of more than one is an error)."""
        wide = {name: tuple(x.shape) for name, x in self._entries.items() if x.dim() == 0 or x.shape[0] != 1}
        if wide:
            raise ValueError(f"remove_batch_dim: needs a batch of one, got {wide}")
        self._entries = {name: x[0] for name, x in self._entries.items()}
        return self

    def stack_activation(self, name: str, layer: int = -1) -> Tensor:
        """``(layers, ...)``: entry ``name`` of every attention layer before ``layer`` (-1 or None: every one), stacked."""
        chosen = self._known if layer in (-1, None) else [x for x in self._known if x < layer]
        return torch.stack([self[(name, x)] for x in chosen])

    def put(self, name: str, tensor: Tensor) -> None:
        """Keep ``tensor`` as entry ``name`` (``qkv.run_with_cache``'s hook functions fill a recording so)."""
        self._entries[name] = tensor

    def __iter__(self):
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, layer: int, call, edits: tuple[Edit, ...], out: Tensor, module: torch.nn.Module | None = None,
             seen: Mapping[str, Tensor] | None = None) -> None:  # fmt: skip
        """Record what ``layer``'s edited call computed; ``out (b, h, i, e)`` is its ``z`` after the edits (and hooks).

        ``seen`` holds the ``(b, h, i, j)`` scores and pattern as hook functions left them, where a hook built them
        (``qkv.hooks``): those are recorded, as TransformerLens' cache records what a hook returned.
        """
        seen = seen or {}
        heads = None if self.heads is None else indices("record: heads", self.heads, call.heads)
        try:
            rows = None if self.rows is None else indices("record: rows", self.rows, call.rows)
        except ValueError as error:  # rows count within each call: generate's later calls have one
            raise ValueError(f"{error}; layer {layer} was called with {call.rows} query rows (each decoding step of "
                             "generate() has one: rows=[-1] records each call's last row, the recording keeping the last call's)") from None  # fmt: skip
        with torch.no_grad():  # a recording is a look: no graph is kept alive by it
            built = {
                "attn_scores": lambda: _chosen(seen["attn_scores"], heads, rows) if "attn_scores" in seen else recorded.scores(call, heads, rows),
                "pattern": lambda: _chosen(seen["pattern"], heads, rows) if "pattern" in seen else recorded.pattern(call, heads, rows, edits),
                "z": lambda: recorded.z(out, heads, rows),
                "result": lambda: recorded.result(recorded.z(out, None, rows), heads, output_weight(module)),
            }
            for name in self.hooks.get(layer, ()) if isinstance(self.hooks, dict) else self.hooks:
                self._entries[f"blocks.{layer}.attn.hook_{name}"] = built[name]().detach()

    def __repr__(self) -> str:
        return f"Recording({ {k: tuple(v.shape) for k, v in self._entries.items()} })"


def runner(module: torch.nn.Module):
    """What ``attention_forward`` runs for ``module``: ``qkv.attention``, or it with the active edits and recordings."""
    sessions = _ACTIVE.get()
    if not sessions and not KEPT:
        return attention
    found = [s for s in (*KEPT, *sessions) if id(module) in s.layers]
    if not found:
        return attention
    layer = found[0].layers[id(module)]
    # only the blocks with something for this layer: the others' layers keep the plain call (a decoding step's door)
    mine = tuple(sorted((s for s in found if layer in s.edits or layer in s.hooks or
                         (s.recording is not None and layer in s.recording.layers)), key=lambda s: s.order))  # fmt: skip
    return functools.partial(_run, layer, mine, module) if mine else attention


def output_weight(module: torch.nn.Module | None) -> Tensor:
    """The layer's output projection ``W_O (d_model, h·e)``, found on its attention module."""
    for name in ("o_proj", "out_proj", "c_proj"):
        linear = getattr(module, name, None)
        if isinstance(getattr(linear, "weight", None), Tensor) and linear.weight.dim() == 2:
            # GPT-2's c_proj is transformers' Conv1D, ``x @ weight + bias``: its weight is stored (in, out)
            return linear.weight.t() if type(linear).__name__ == "Conv1D" else linear.weight
    raise ValueError(
        f"record: hook_result needs the layer's output projection W_O, and {type(module).__name__} holds none of "
        "o_proj, out_proj, c_proj (BERT-like models keep it outside the attention module); record 'z' and apply W_O"
    )


def _run(layer: int, sessions: tuple[_Session, ...], module, q: Tensor, k: Tensor, v: Tensor, **options):
    """``qkv.attention(q, k, v, **options)`` with ``layer``'s edits of every active block, then their recordings."""
    edits = tuple(e for s in sessions for e in s.edits.get(layer, ()))
    hooked = Hooked()
    for session in sessions:  # an outer block's hooks run before an inner one's
        for direction, point, hook_point, fn in session.hooks.get(layer, ()):
            hooked.add(direction, point, hook_point, fn, functools.partial(getattr, session, "open"))
    if q.shape[-2] < k.shape[-2]:  # keys before this call's queries: a KV cache (the layers here are self-attention)
        if (hooked.at("k") or hooked.at("v")) and not _crosses(module):
            raise ValueError(
                f"hooks: layer {layer}'s keys and values before this call's {q.shape[-2]} queries come from the KV cache, "
                "which holds them as computed, not as a hook on hook_k (hook_rot_k) or hook_v changed them (TransformerLens hooks each "
                "token's key and value once, before caching it); run without the cache (use_cache=False)"
            )
        refuse_mean_with_cache(edits, f"layer {layer}", q.shape[-2], k.shape[-2],
                               f"e.g. how=rec['blocks.{layer}.attn.hook_z'][:, :, heads].mean((0, 1)) of a qkv.record of "
                               "the prompt, or run without the cache (use_cache=False)")  # fmt: skip
    if hooked:
        result, call, seen = hook_points.attention(Call(q, k, v, dict(options)), edits, hooked)
    else:
        (result, call), seen = edited(q, k, v, edits, **options), {}
    out = result[0] if isinstance(result, tuple) else result
    for session in sessions:
        if session.recording is not None and layer in session.recording.layers:
            session.recording.take(layer, call, edits, out, module, seen)
    return result


@contextlib.contextmanager
def edit(model: torch.nn.Module, edits: Mapping[int, Edit | Sequence[Edit]]) -> Iterator[None]:
    """Apply ``edits`` (``{layer: edit or [edits]}``) to ``model``'s attention layers inside the block.

    ``model`` runs ``attn_implementation="qkv"``; the edits are ``qkv.edits`` objects
    (``AblateHeads``, ``Knockout``, ``ScaleHeads``, ``PatchPattern``, ``PatchZ``). Blocks nest: an inner
    block's edits of a layer apply after the outer one's.
    """
    layers = _attention_layers(model, "edit")
    if not isinstance(edits, Mapping):
        raise TypeError(f"edit: expected a dict {{layer index: edit or list of edits}}, got {type(edits).__name__}")
    odd = [layer for layer in edits if isinstance(layer, bool) or not isinstance(layer, int)]
    if odd:  # True == 1: a bool key would edit layer 1, silently
        raise TypeError(f"edit: layers are int indices, got {odd}")
    known = sorted(set(layers.values()))
    at = {layer: layer_of(layer, known) for layer in edits}
    unknown = [layer for layer in edits if at[layer] not in known]
    if unknown:
        raise ValueError(f"edit: layers {unknown} are not attention layers of this model, expected indices in {known}")
    if len(set(at.values())) < len(at):
        raise ValueError(f"edit: layers {list(edits)} name one layer twice (a negative index counts from the last)")
    with _active(_Session(layers, edits={at[layer]: as_edits(e) for layer, e in edits.items()})):
        yield


@contextlib.contextmanager
def record(model: torch.nn.Module, layers=None, heads=None, rows=None, hooks: Sequence[str] = HOOKS) -> Iterator[Recording]:
    """Record TransformerLens' ``hook_attn_scores``, ``hook_pattern``, ``hook_z`` of ``model`` inside the block.

    ``layers``, ``heads`` and ``rows`` (query positions) are an int, a list, a range, a
    slice or None (all); ``hooks`` is a subset of ``("attn_scores", "pattern", "z")``, to which
    ``"result"`` (``hook_result (b, R, H, d_model)``, where the attention module holds ``W_O``) may be added: only
    those are built, each for the chosen heads and rows. Yields a :class:`Recording`,
    filled as the model runs.
    """
    found = _attention_layers(model, "record")
    known = sorted(set(found.values()))
    chosen = _recorded_layers(layers, known)
    for name, value in (("record: heads", heads), ("record: rows", rows)):
        if value is not None:
            check_selection(name, value)
    wrong = [h for h in hooks if h not in HOOKS + OPTIONAL] if not isinstance(hooks, str) else [hooks]
    if wrong:
        raise ValueError(f"record: hooks expected a list from {list(HOOKS + OPTIONAL)}, got {list(hooks) if not isinstance(hooks, str) else hooks!r}")
    recording = Recording(chosen, heads, rows, tuple(hooks), known)
    with _active(_Session(found, recording=recording)):
        yield recording


@contextlib.contextmanager
def _active(session: _Session) -> Iterator[None]:
    """``session`` among the active ones inside the block. Leaving removes it alone: blocks left out of order
    (``__exit__`` called by hand) leave no other block's session behind, as resetting the variable's token would."""
    _ACTIVE.set((*_ACTIVE.get(), session))
    try:
        yield
    finally:
        session.open = False
        _ACTIVE.set(tuple(s for s in _ACTIVE.get() if s is not session))


def _crosses(module: torch.nn.Module | None) -> bool:
    """Whether ``module`` is a cross-attention layer (its keys another sequence's, not a cache's): transformers marks
    them ``is_cross_attention`` or names them so (Mllama's ``MllamaTextCrossAttention``)."""
    return bool(getattr(module, "is_cross_attention", False)) or "crossattention" in type(module).__name__.lower()


def _chosen(full: Tensor, heads: Tensor | None, rows: Tensor | None) -> Tensor:
    """``full (..., h, i, j)`` at ``heads`` and ``rows`` (None: all), float32 at least as every recording's scores and
    pattern (hooks see a 16-bit model's in its dtype)."""
    if heads is not None:
        full = full.index_select(-3, heads.to(full.device))
    full = full if rows is None else full.index_select(-2, rows.to(full.device))
    return full.to(torch.promote_types(full.dtype, torch.float32))


def _recorded_layers(layers, known: list[int]) -> set[int]:
    """``record``'s ``layers`` as layer indices, ``known`` the attention layers' (ascending): where every layer attends
    (``0 .. n - 1``), as Python indexes a list of them; in a hybrid model, ints name attention layers (a negative one
    counts from the last of them) and a slice or range keeps the attention layers inside it."""
    if layers is None:
        return set(known)
    if known == list(range(len(known))):
        return set(indices("record: layers", layers, len(known)).tolist())
    if isinstance(layers, (slice, range)):
        inside = set(range(known[-1] + 1)[layers] if isinstance(layers, slice) else layers) & set(known)
        if not inside:
            raise ValueError(f"record: layers {layers!r} hold no attention layer of this model; its attention layers are {known}")
        return inside
    check_selection("record: layers", layers)
    given = [layers] if isinstance(layers, int) else layers.reshape(-1).tolist() if isinstance(layers, Tensor) else list(layers)
    at = [layer_of(x, known) for x in given]
    wrong = [x for x, y in zip(given, at) if y not in known]
    if wrong or not at:
        raise ValueError(f"record: layers {wrong} are not attention layers of this model, expected indices in {known}")
    return set(at)


def _attention_layers(model: torch.nn.Module, caller: str) -> dict[int, int]:
    """``{id(module): layer}`` for every attention module of ``model``: those with an integer ``layer_idx`` whose
    forward calls transformers' attention functions (``ALL_ATTENTION_FUNCTIONS``, which hands the call to
    qkv), else (source not readable) those whose class names attention, else all with a ``layer_idx``.

    A hybrid model's other mixers carry a ``layer_idx`` too (Jamba's and Bamba's Mamba, LFM2's
    short convolutions, Qwen3-Next's gated delta nets, MiniMax's lightning attention, Falcon-H1's
    Mamba beside the attention of the same layer): counted as attention layers, an edit of one
    ran nowhere, silently.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: expected a transformers model (a torch.nn.Module), got {type(model).__name__}")
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation != "qkv":
        raise ValueError(
            f'{caller}: the model runs attn_implementation={implementation!r}; edits and recordings need qkv\'s, '
            'so load it with attn_implementation="qkv" after qkv.integrations.transformers.register() '
            '(or call model.set_attn_implementation("qkv"))'
        )
    named = [(name, m) for name, m in model.named_modules() if isinstance(getattr(m, "layer_idx", None), int)]
    calling = [(name, m) for name, m in named if "ALL_ATTENTION_FUNCTIONS" in (forward_source(type(m)) or "")]
    if named and not calling and all(forward_source(type(m)) is not None for _, m in named):  # Bloom, MPT: their own
        raise ValueError(f"{caller}: no layer of {type(model).__name__} calls transformers' attention functions (its "
                         "attention computes its own), so qkv never runs in it")  # fmt: skip
    attending = [(name, m) for name, m in named if any(word in type(m).__name__.lower() for word in ("attention", "attn"))]
    named = calling or attending or named
    if not named:
        raise ValueError(f"{caller}: found no attention layers (modules with an integer layer_idx) in {type(model).__name__}")
    seen: dict[int, str] = {}
    for name, m in named:
        if m.layer_idx in seen:  # an encoder-decoder: its encoder, decoder and cross-attention share indices
            raise ValueError(
                f"{caller}: {seen[m.layer_idx]!r} and {name!r} are both attention layer {m.layer_idx} of "
                f"{type(model).__name__}, so an index cannot name one of them; give a stack whose attention "
                "layers have indices of their own, such as an encoder-decoder's encoder (model.get_encoder()); its "
                "decoder, whose self- and cross-attention share an index, is not supported"
            )
        seen[m.layer_idx] = name
    return {id(m): m.layer_idx for _, m in named}


@functools.cache
def forward_source(cls: type) -> str | None:
    """The source of ``cls.forward`` (None where it cannot be read): whether a layer calls transformers' attention
    functions (``ALL_ATTENTION_FUNCTIONS``) and whether it rotates its queries and keys first are read from it."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None

