"""qkv inside Hugging Face transformers: ``attn_implementation="qkv"``.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j``
key length, ``d`` query/key size, ``e`` value size.

    from transformers import AutoModel
    from qkv.integrations.transformers import register

    register()                                   # once per process
    model = AutoModel.from_pretrained(path, attn_implementation="qkv")
    out = model(**batch, output_attentions=True) # out.attentions: (b, h, i, j) per layer
    out = model(**batch, output_attentions=True, weights_for={"heads": [0, 3], "rows": [7]})
    out.attentions                               # per layer (b, 2, 1, j): only those weights

:func:`register` adds two entries to transformers' registries. ``AttentionInterface``
gets :func:`attention_forward`, which every attention layer of a model calls with
``q (b, h, i, d)``, ``k (b, g, j, d)``, ``v (b, g, j, e)``, the layer's mask and its
options, and which runs ``qkv.attention`` (its backends, lazy masks and fused paths) and
returns ``out (b, i, h, e)`` and, when the caller asked for them, the weights
``(b, h, i, j)``. ``AttentionMaskInterface`` gets
:func:`qkv.integrations.transformers_masks.mask_interface`, so the model hands each layer
qkv's own lazy mask (padding, causal, sliding window) instead of a dense one.

Options, as transformers passes them:

* ``scaling`` → ``scale``; ``dropout`` → ``dropout`` (transformers passes 0 in eval mode);
* ``is_causal`` (or the module's ``is_causal``): used only when the model built no mask
  (``attention_mask=None``) and ``i > 1``, as transformers' sdpa does; a one-token
  decode step sees every key. With a KV cache the keys end where the queries end, which is
  qkv's bottom-right alignment;
* ``sliding_window``: already in the mask the model built; used only when it built none;
* ``softcap`` (Gemma 2) → ``score_mod=qkv.SoftCap(softcap)``, ``c·tanh(s / c)`` on the
  scaled logits; ``s_aux`` (GPT-OSS) → ``sinks``, one logit per head in every row's
  softmax denominator;
* ``position_bias`` (T5-style models): added to the logits as ``bias``; a float 4-d
  ``attention_mask`` of 0 and the dtype's minimum (eager's) is read as the bool mask it is,
  unless a row blocks every key (eager and sdpa weigh each key 1/j there: kept additive);
* GQA (``g < h``) and ``d != e`` (DeepSeek's multi-head latent attention) are native;
* ``output_attentions`` (the call's, else the model config's) → ``return_weights=True``;
  transformers keeps every weight, so qkv's dispatcher materialises a layer's logits once
  (one softmax, then ``weights @ v``) up to ``qkv.backends.MATERIALISE_ELEMENTS`` of them,
  rather than run a fused engine and rebuild the weights; the integration itself never
  picks a backend.
* ``weights_for={"heads": ..., "rows": ...}``, a keyword of the model's forward call that
  transformers hands down to every layer (as it does ``position_ids``), with
  ``output_attentions``: the layer returns only those weights, ``(b, len(heads),
  len(rows), j)``, as ``qkv.attention(..., weights_for=...)`` does. They are rebuilt from
  the fused kernel's log-sum-exp one query block at a time, never by materialising, so a
  text of thousands of tokens never holds a layer's ``(b, h, i, j)`` weights. Only qkv's
  attention reads it: after :func:`register`, a model that runs another implementation
  (``"eager"``, ``"sdpa"``, ...) raises a ``TypeError`` on ``weights_for`` rather than
  ignore it and return every weight.

Packed batches (``DataCollatorWithFlattening``, with or without
``return_flash_attn_kwargs``): ``cu_seq_lens_q/k``, ``seq_idx`` and packed
``position_ids`` make each sequence a document of ``qkv.masks.documents``, run as its own
call, with no ``(T, T)`` mask (``transformers_packing``). Keywords that only describe the
inputs (``use_cache``, ``token_type_ids``, ...) are ignored; any other keyword with a
value raises a ``TypeError`` naming it: nothing is dropped silently. Unlike eager attention, returned weights are
those before dropout.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from ..backends import sdpa_direct, sdpa_plain
from ..functional import attention
from ..masks import Dense, Mask, Tile, Window, causal, window
from ..score_mods import SoftCap
from .transformers_edits import runner as edits_runner
from .transformers_masks import LayerMask, mask_interface
from .transformers_packing import documents_for, with_documents
from .._extras import install

#: The name models are loaded with: ``attn_implementation="qkv"``.
NAME = "qkv"

#: Keywords that describe the inputs or the model's bookkeeping, not the attention: the
#: positions are already in q and k (rotary) and in the mask, the cache already in k, v.
IGNORED = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "position_embeddings",
        "output_hidden_states",
        "output_router_logits",
        "num_items_in_batch",
        "return_dict",
        # packed batches: the offsets and ids are read (transformers_packing); flash's
        # maximum lengths only size its grid
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        # BERT-style segment ids: a tokenizer's output passed whole to a decoder reaches its
        # attention through the forward's **kwargs; eager ignores them, as an encoder has
        # already added them to its embeddings
        "token_type_ids",
    }
)


def register(name: str = NAME) -> None:
    """Make ``name`` (default ``"qkv"``) an attention implementation of transformers.

    After this, ``from_pretrained(..., attn_implementation="qkv")``,
    ``from_config(config, attn_implementation="qkv")`` and
    ``model.set_attn_implementation("qkv")`` run every attention layer on
    ``qkv.attention``. Calling it again is harmless.

    Raises:
        ImportError: transformers is not installed (``pip install "qkv[transformers]"``).
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise ImportError(
            "qkv.integrations.transformers.register() needs Hugging Face transformers: "
            f'{install("transformers")}: transformers, tokenizers, safetensors, gguf, accelerate'
        ) from err
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)
    _refuse_weights_for_elsewhere(AttentionInterface)


def _refuse_weights_for_elsewhere(interface: type) -> None:
    """Make every attention function but qkv's raise on ``weights_for`` instead of dropping it.

    ``weights_for`` is a keyword of the model's forward call that transformers hands down to
    whichever attention function the model runs; eager and sdpa take ``**kwargs`` and
    ignore it, so an eager model silently returned every weight. Models look their function
    up through ``AttentionInterface.get_interface(name, eager_default)`` (the eager default is
    each model's own), so that lookup is wrapped, once: a call with ``weights_for`` and any
    other function raises, a call without it reaches that function unchanged.
    """
    lookup = getattr(interface, "get_interface", None)
    if lookup is None or getattr(lookup, "_qkv_refuses_weights_for", False):
        return  # a transformers without the lookup, or already wrapped by an earlier register()

    def get_interface(self, attn_implementation, default):
        function = lookup(self, attn_implementation, default)
        return function if function is attention_forward else _without_weights_for(function, attn_implementation)

    get_interface._qkv_refuses_weights_for = True
    get_interface.__doc__ = lookup.__doc__
    interface.get_interface = get_interface


def _without_weights_for(function, attn_implementation: str | None):
    """``function`` (another attention implementation), raising on the ``weights_for`` only qkv's reads."""

    def forward(*args, weights_for: dict | None = None, **kwargs):
        if weights_for is not None:
            raise TypeError(
                f"weights_for: only qkv's attention reads it, and this model runs attn_implementation="
                f"{attn_implementation!r}, which would ignore it and return every weight; load the model with "
                'attn_implementation="qkv" after qkv.integrations.transformers.register() '
                '(or call model.set_attn_implementation("qkv"))'
            )
        return function(*args, **kwargs)

    return forward


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: LayerMask | Mask | Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    weights_for: dict | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """One attention layer for transformers: ``(out (b, i, h, e), weights (b, h, i, j) | None)``.

    ``query (b, h, i, d)``, ``key (b, g, j, d)``, ``value (b, g, j, e)``; ``attention_mask``
    is what :func:`~qkv.integrations.transformers_masks.mask_interface` built (a
    ``qkv.masks`` object), a prepared 4-d tensor (bool: True = may attend; float: added to
    the logits), or None. With ``weights_for`` (which needs ``output_attentions``) the
    weights are only the chosen ``(b, len(heads), len(rows), j)``.
    """
    if query.shape[-2] == 1 and type(attention_mask) is LayerMask:  # a decoding step of generate()
        out = _decoding_step(module, query, key, value, attention_mask, dropout, scaling,
                             (softcap, s_aux, position_bias, weights_for), kwargs)  # fmt: skip
        if out is not None:
            return out, None
    _check_keywords(kwargs)
    run = edits_runner(module)  # qkv.attention, or it with the edits and recordings of qkv.edit / qkv.record
    filled = getattr(attention_mask, "filled", None) if run is not attention else None  # (made on first use)
    if filled is not None and key.shape[-2] == attention_mask.shape[-1]:
        # a static cache's slots after the last query, which no query sees: edits and recordings get the keys a
        # dynamic cache holds, so that masks aligned to the last key (Knockout(offsets(...))) align as there
        key, value, attention_mask = key[..., : filled.shape[-1], :], value[..., : filled.shape[-1], :], filled
    mask, bias = _mask_and_bias(module, attention_mask, query.shape[-2], key.shape[-2], is_causal, sliding_window,
                                query.device)  # fmt: skip
    mask = with_documents(mask, documents_for(query, key, kwargs, mask))  # a packed batch: one call per sequence
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    score_mod = None
    if softcap is not None:
        if bias is not None:
            # qkv caps the logits after adding a bias; eager adds its float mask after capping
            raise ValueError(
                "softcap: cannot be combined with an additive float attention_mask or position_bias "
                "(qkv applies the cap after the bias, transformers' eager before); pass a bool mask"
            )
        score_mod = SoftCap(softcap)
    weights_wanted = _weights_wanted(module, kwargs.get("output_attentions"))
    if weights_for is not None and not weights_wanted:
        raise ValueError(
            "weights_for: selects which of the weights output_attentions returns, so it needs "
            "output_attentions=True (in the call or the model's config), got False"
        )
    result = run(
        query, key, value, mask=mask, bias=bias, scale=scaling, dropout=float(dropout),
        return_weights=weights_wanted, weights_for=weights_for,
        sinks=s_aux, score_mod=score_mod,
    )  # fmt: skip
    out, weights = result if weights_wanted else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _decoding_step(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: LayerMask,
                   dropout: float, scaling: float | None, extras: tuple, kwargs: dict) -> Tensor | None:  # fmt: skip
    """``out (b, 1, h, e)`` of a one-token step that asks for nothing but the model's own mask; else None.

    ``generate()`` calls each layer once per new token, and such a call ends in PyTorch's
    kernel anyway: this goes there straight (``qkv.backends.sdpa_direct`` where the step's mask
    is none or one bool tensor, else the plain lane, ``qkv.backends.sdpa_plain.plain``), without
    the keyword checks, mask dispatch, packing and edit lookups of the full path. Measured on the
    Intel Xeon (SmolLM2's shapes, a left-padded batch of 4): 6-8 µs less per layer call, about 7%
    of it (through the plain lane; the door took 1.6 µs more off on the AMD EPYC Zen 5). Anything the full path would treat otherwise (a keyword to honour
    or to refuse, weights, ``softcap``, ``s_aux``, ``position_bias``, ``weights_for``, dropout,
    packed offsets, an active ``qkv.edit`` / ``qkv.record`` block, a call ``plain`` declines)
    answers None and takes the full path.
    """
    if dropout or extras.count(None) != len(extras) or edits_runner(module) is not attention:
        return None
    if not kwargs.keys() <= _STEP_KEYS and (_unhandled(kwargs) or any(kwargs.get(name) is not None for name in _PACKED)):
        return None  # a keyword to refuse (the full path's message), or packed offsets
    if _weights_wanted(module, kwargs.get("output_attentions")):
        return None
    # The first layer of a forward plans the call; the others, same shapes and mask, reuse it (sdpa_plain keeps it on
    # the forward's mask, which for_call makes once). Measured in SmolLM2's greedy generate on the AMD EPYC Zen 4 (a
    # left-padded batch of 4): a layer's call took 230-245 µs against sdpa's 177 µs when every layer planned, the
    # kernel 125 of them: the checks, run from caches the model's matmuls have just emptied, cost more than where
    # they run once.
    step_mask = mask.for_call(1, key.shape[-2], query.device)
    # PyTorch's own kernel where its answer is qkv's (no mask, or a bool (b|1, 1, 1, j) tensor with the output
    # checked for nan: sdpa_direct), a few µs a layer less than the plain lane's plan lookup
    grouped = query.shape[1] != key.shape[1]
    if step_mask is None:
        out = sdpa_direct.unmasked(query, key, value, scaling, grouped)
    elif type(step_mask) is Dense and type(step_mask.mask) is Tensor:
        out = sdpa_direct.decoding_step(query, key, value, step_mask.mask, scaling, grouped)
    else:
        out = None
    if out is None:
        out = sdpa_plain.plain(query, key, value, "scaled_dot", False, scaling, step_mask)
    elif out is sdpa_direct.NOT_FINITE:
        return None  # a hidden key's nan or inf: the full path, which zeroes the hidden keys
    return None if out is None else out.transpose(1, 2).contiguous()


#: Keywords of a packed batch: its documents come from them (``transformers_packing``).
_PACKED = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"})
#: Keywords a decoding step may carry whatever their values (one set comparison per layer call).
_STEP_KEYS = (IGNORED - _PACKED) | {"output_attentions"}


def _unhandled(kwargs: dict) -> list[str]:
    """The keywords given a value that qkv neither reads nor may ignore (``output_attentions`` is read)."""
    return [name for name, value in kwargs.items() if value is not None and name not in IGNORED and name != "output_attentions"]


def _check_keywords(kwargs: dict) -> None:
    """Raise on any keyword qkv would otherwise drop (ignorable ones, and None values, pass)."""
    unknown = sorted(_unhandled(kwargs))
    if unknown:
        raise TypeError(
            f"qkv attention: cannot honour the keyword argument(s) {unknown} "
            f"(it handles dropout, scaling, is_causal, sliding_window, softcap, s_aux, position_bias, "
            f"output_attentions, weights_for and ignores {sorted(IGNORED)})"
        )


def _mask_and_bias(
    module: torch.nn.Module,
    attention_mask: LayerMask | Mask | Tensor | None,
    i: int,
    j: int,
    is_causal: bool | None,
    sliding_window: int | None,
    device: torch.device,
) -> tuple[Mask | None, Tensor | None]:
    """The mask (and, for a float 4-d mask, the bias) for ``qkv.attention``."""
    if isinstance(attention_mask, LayerMask):
        return attention_mask.for_call(i, j, device), None
    if isinstance(attention_mask, Mask):
        # built by mask_interface from what the model asked: causality and windows included.
        # A mask that hides nothing (a decode step without padding) is dropped, so the
        # call takes the fastest path; Dense masks are not scanned for that.
        if not isinstance(attention_mask, Dense) and attention_mask.state(Tile.whole(i, j)) == "full":
            return None, None
        return attention_mask, None
    if attention_mask is None:
        causal_call = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if sliding_window is not None:
            if not isinstance(sliding_window, int) or isinstance(sliding_window, bool) or sliding_window < 1:
                raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
            # transformers' windows: causal, a query sees itself and the W - 1 keys before;
            # bidirectional, every key at most W away
            mask = window(sliding_window - 1) if causal_call else Window(sliding_window, sliding_window)
            return (None if mask.state(Tile.whole(i, j)) == "full" else mask), None
        return (causal() if causal_call and i > 1 else None), None
    if isinstance(attention_mask, Tensor):
        if attention_mask.dim() != 4:
            raise ValueError(
                f"attention_mask: expected a qkv mask or a 4-d (b, 1, i, j) tensor, got shape {tuple(attention_mask.shape)}"
            )
        mask4 = attention_mask[..., :j]  # a static cache's mask may run past the keys
        if mask4.dtype == torch.bool:
            return Dense(mask4), None
        # eager's float mask: 0 where allowed, the dtype's minimum where not; that is a bool
        # mask (True = may attend). Any other float values are a bias added to the logits. So is
        # a mask with a row that blocks every key: there eager's and sdpa's logits all round to
        # the minimum (s + min = min), a softmax of equal values, 1/j per key, where a bool
        # mask's fully masked row is qkv's row of zeros.
        blocked = mask4 <= torch.finfo(mask4.dtype).min / 2
        if bool(((mask4 == 0) | blocked).all()) and not bool(blocked.all(-1).any()):
            return Dense(~blocked), None
        return None, mask4
    raise TypeError(
        f"attention_mask: expected a qkv.masks mask, a 4-d tensor or None, got {type(attention_mask).__name__} "
        '(load the model with attn_implementation="qkv" after qkv.integrations.transformers.register())'
    )


def _weights_wanted(module: torch.nn.Module, output_attentions: bool | None) -> bool:
    """The call's ``output_attentions``, else whether the model's output collector gathers attentions, else the
    model config's.

    A module whose ``forward`` takes ``output_attentions`` as a parameter of its own (GPT-2's)
    does not pass it on; transformers then gathers the weights its layers return through the
    collector its ``capture_outputs`` sets for the forward, read here.
    """
    if output_attentions is None:
        output_attentions = _collecting_attentions()
    if output_attentions is None:
        output_attentions = getattr(getattr(module, "config", None), "output_attentions", False)
    return bool(output_attentions)


def _collecting_attentions() -> bool | None:
    """Whether transformers' active output collector gathers attention weights; None where it has none."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = None if collector is None else collector.get()
    if not isinstance(collected, dict):
        return None
    return "attentions" in collected or "cross_attentions" in collected
