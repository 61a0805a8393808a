"""Only some attention weights from a transformers model: ``weights_for`` on the forward call.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

    from qkv.integrations.transformers_weights_for import NAME, register

    register()                                          # once per process
    model = AutoModel.from_pretrained(path, attn_implementation=NAME)
    out = model(input_ids, output_attentions=True, weights_for={"heads": [0, 3], "rows": [7]})
    out.attentions                                      # per layer (b, 2, 1, j), not (b, h, i, j)

transformers hands keyword arguments of a model's forward call down to every layer's
attention function (as it does ``position_ids``). The function registered here as
:data:`NAME` is qkv's own (:func:`qkv.integrations.transformers.attention_forward`) when
``weights_for`` is absent; with it, the layer's output still comes from that function, and
the weights of the chosen heads and query rows (``{"heads": ..., "rows": ...}``, as in
``qkv.attention``) from ``qkv.attention_weights`` on the same queries, keys, mask, bias and
scale. Those are built one query block at a time from the log-sum-exp, so a text of
thousands of tokens never holds a layer's ``(b, h, i, j)`` weights; the price is a second
``q·k`` per layer, paid only when weights are selected.

This sits on top of ``register()`` under its own name, so a model loaded with ``"qkv"``
is untouched. Should ``attention_forward`` accept ``weights_for`` itself (one keyword
passed on to ``qkv.attention``), models loaded with ``"qkv"`` would do this in one pass and
this module would be unnecessary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import functional
from . import transformers as integration
from .transformers_masks import mask_interface

#: The implementation name that honours ``weights_for``: ``attn_implementation=NAME``.
NAME = "qkv_weights_for"


def register(name: str = NAME) -> None:
    """Make ``name`` an attention implementation: qkv's, plus the ``weights_for`` keyword.

    Raises:
        ImportError: transformers is not installed (from ``qkv.integrations.transformers``).
    """
    integration.register()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_interface)


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    weights_for: dict | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """qkv's attention layer; with ``weights_for`` and ``output_attentions`` only those weights.

    Returns ``out (b, i, h, e)`` and ``None``, all weights ``(b, h, i, j)``, or the chosen
    ``(b, len(heads), len(rows), j)``.
    """
    wanted = integration._weights_wanted(module, kwargs.get("output_attentions"))
    if weights_for is None or not wanted:
        return integration.attention_forward(module, query, key, value, attention_mask, **kwargs)
    # The output exactly as "qkv" computes it (its checks of every keyword included)...
    out, _ = integration.attention_forward(module, query, key, value, attention_mask,
                                           **{**kwargs, "output_attentions": False})  # fmt: skip
    # ...and the chosen weights of the same attention: same mask, bias and scale.
    mask, bias = integration._mask_and_bias(
        module, attention_mask, query.shape[-2], key.shape[-2], kwargs.get("is_causal"), kwargs.get("sliding_window")
    )
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    weights = functional.attention_weights(
        query, key, mask=mask, bias=bias, scale=kwargs.get("scaling"), weights_for=weights_for
    )
    return out, weights
