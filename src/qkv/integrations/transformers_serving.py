"""qkv under transformers' continuous batching (``model.generate_batch``), on ``qkv.varlen_attention``.

Shape legend: ``T`` query tokens of one batch step (every request's new tokens end to end,
perhaps padded at the end), ``K`` keys read from the paged cache for them (each request's
keys end to end), ``n`` requests, ``h`` query heads, ``g`` KV heads, ``d`` query/key size,
``e`` value size.

    from qkv.integrations.transformers import register
    from qkv.integrations.transformers_serving import for_continuous_batching

    register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")
    for_continuous_batching(model)                 # now runs NAME, "qkv_flash_varlen"
    out = model.generate_batch(inputs=[ids_a, ids_b], generation_config=config,
                               continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=False))
    model.set_attn_implementation("qkv")           # back (generate works under either name)

The route (transformers >= 5.19). ``ContinuousBatchingManager.switch_to_cb_friendly_attn``
admits exactly ``"paged|eager"`` or ``"sdpa"``, or any name ``is_flash_attention_requested``
accepts: any name holding ``"flash"``. Registering qkv as ``"sdpa"`` would replace
transformers' sdpa for every model in the process, so :func:`serving_forward` is registered
under :data:`NAME` (``"flash"``, no FA version digit). Such a name gets what flash gets:
``attention_mask=None``, the keys each request has in the paged cache gathered end to end
(a sliding layer's last ``W - 1`` plus the new ones), ``cu_seq_lens_q (n + 1,)`` and the
layer type's ``cu_seq_lens_k (n + 1,)``, ``is_causal=True``. A request's queries are the
last ``sq`` of its ``sk`` keys: ``varlen_attention``'s bottom-right alignment. It runs
``varlen_attention(q (T, h, d), k (K, g, d), v (K, g, e), ...)`` with ``sliding_window`` W
as ``window_size=(W - 1, -1)``, ``softcap`` and ``s_aux`` (sinks), and returns
``out (1, T, h, e)`` (zeros in padded rows) and no weights. The model's layer updates the
paged cache (5.24); before, the attention function did, given ``cache`` (5.19 to 5.23):
:func:`serving_forward` then calls ``cache.update`` as transformers' own functions do.

One step outside the registries: ``from_pretrained`` and ``set_attn_implementation`` try to
import a flash-attn package or Hub kernel for a "flash" name and raise, so
:func:`for_continuous_batching` sets ``"qkv"`` with ``set_attn_implementation`` (transformers'
checks) and then writes :data:`NAME` to ``model.config._attn_implementation``, which every
layer looks its function up by. A call that is not a continuous-batching step (no
``write_index`` and ``cu_seq_lens_q``) goes to
``qkv.integrations.transformers.attention_forward``: ``generate`` and forwards are ``"qkv"``'s.

Not supported: CUDA graphs, which transformers turns on wherever CUDA is present for a
"flash" name (``varlen_attention`` reads the offsets on the host, which a capture forbids):
pass ``ContinuousBatchingConfig(use_cuda_graph=False)``; the block-table decode path (only
``flash_attention_2``/``_3``); attention weights; transformers < 5.19 (there continuous
batching renames the implementation ``"paged|<name>"``, whose function updates the cache
with another signature).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..varlen import varlen_attention
from .transformers import IGNORED, attention_forward
from .transformers import NAME as QKV_NAME
from .transformers import register as register_qkv

#: The implementation continuous batching runs: holds "flash" for transformers' gate.
NAME = "qkv_flash_varlen"

#: Keywords continuous batching hands every layer that only describe the batch or its cache.
SERVING_IGNORED = IGNORED | {"read_index", "write_index", "block_table", "logits_indices", "logits_processor_args"}


def register() -> None:
    """Add :data:`NAME` to transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Called by ``qkv.integrations.transformers.register()``; harmless to repeat.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .transformers_masks import mask_interface

    AttentionInterface.register(NAME, serving_forward)
    AttentionMaskInterface.register(NAME, mask_interface)  # outside continuous batching: qkv's lazy masks


def for_continuous_batching(model):
    """Make ``model`` run :data:`NAME`, which ``generate_batch`` admits; returns the model.

    Raises:
        NotImplementedError: transformers before 5.19, whose continuous batching runs
            ``"paged|<name>"`` implementations that update the paged cache themselves.
        ValueError: the model cannot run ``"qkv"`` (it does not dispatch through
            transformers' ``AttentionInterface``).
    """
    import transformers

    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 19):
        raise NotImplementedError(
            f"qkv's continuous batching needs transformers >= 5.19 (its admission of flash-like implementations); "
            f"this is {transformers.__version__}"
        )
    register_qkv()
    register()  # this module's name (transformers.register() does not import this module: no import circle)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(QKV_NAME)
        if model.config._attn_implementation != QKV_NAME:
            raise ValueError(
                f"{type(model).__name__} cannot run attn_implementation={QKV_NAME!r} (transformers left it at "
                f"{model.config._attn_implementation!r}), so it cannot run {NAME!r} either"
            )
        model.config._attn_implementation = NAME  # the config's setter; sub-configs follow
    return model


def serving_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """One layer of a continuous-batching step: ``query (1, h, T, d)``, ``key (1, g, K, d)``,
    ``value (1, g, K, e)`` -> ``(out (1, T, h, e), None)``; any other call goes to ``attention_forward``."""
    if "write_index" not in kwargs or "cu_seq_lens_q" not in kwargs:  # not a continuous-batching step
        return attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 is_causal=is_causal, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux,
                                 **kwargs)  # fmt: skip
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{NAME}: cannot run inside a CUDA graph (qkv.varlen_attention reads the sequence offsets on the host); "
            "pass continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=False) to generate_batch"
        )
    if kwargs.get("block_table") is not None:
        raise ValueError(f"{NAME}: the block-table decode path (keys left in the paged cache) is not supported")
    cache = kwargs.pop("cache", None)
    if cache is not None:  # transformers 5.19 to 5.23: the attention function updates the paged cache, as its own do
        key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]  # cu_k: the offsets of this layer's type
    _check_keywords(kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"{NAME}: expected one packed row (1, h, T, d), got query shape {tuple(query.shape)}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    left = -1
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
        left = sliding_window - 1  # a query sees itself and the W - 1 keys before it
    n_q, n_k = int(cu_q[-1]), int(cu_k[-1])  # beyond them: padding of a fixed-size batch
    q, k, v = (x[0, :, :n].transpose(0, 1) for x, n in ((query, n_q), (key, n_k), (value, n_k)))
    out = varlen_attention(
        q, k, v, cu_q, cu_k, dropout_p=float(dropout), softmax_scale=scaling, causal=bool(causal),
        window_size=(left, -1), softcap=float(softcap or 0.0), sinks=s_aux,
    )  # fmt: skip
    result = out.new_zeros(1, query.shape[-2], *out.shape[1:])
    result[0, :n_q] = out
    return result, None


def _check_keywords(kwargs: dict) -> None:
    """Raise on a keyword the serving path would drop (weights, ``weights_for``, anything unknown)."""
    unknown = sorted(name for name, value in kwargs.items()
                     if value is not None and value is not False and name not in SERVING_IGNORED)  # fmt: skip
    if unknown:
        raise TypeError(
            f"{NAME}: cannot honour the keyword argument(s) {unknown} in continuous batching (no attention weights; "
            f"it handles dropout, scaling, is_causal, sliding_window, softcap, s_aux and ignores {sorted(SERVING_IGNORED)})"
        )
