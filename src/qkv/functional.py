"""The functional API: ``attention``, ``attention_weights``, ``merge`` and ``explain``.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``g`` KV heads, ``i`` query
length, ``j`` key length, ``d`` query/key size, ``e`` value size.

``q (..., h, i, d)``, ``k (..., g, j, d)``, ``v (..., g, j, e)`` -> ``out (..., h, i, e)`` and,
on request, ``weights (..., h, i, j)``: the layout of ``F.scaled_dot_product_attention``.
Inputs without a head dim, ``(i, d)``, also work. Each call is validated once and reshaped
to ``(b, h, i, d)`` (``qkv.checks``); a backend runs it (``qkv.backends.choose``, which
alone decides the path, and which :func:`explain` reports); its outputs return to the
caller's layout.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import backends, checks
from ._trace import concrete
from .backends import alibi_reach, engines, hidden_keys, sdpa_plain
from .backends.tiling.lse import merge_all
from .masks import Mask
from .module_inputs import KERAS_NAMES, autocast_on
from .positional import ALiBi, LazyBias
from .scores import Score


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    score: str | Score = "scaled_dot",
    mask: Mask | Tensor | None = None,
    bias: Tensor | LazyBias | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    generator: torch.Generator | None = None,
    weights_for: dict | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
    return_lse: bool = False,
    **unknown,
) -> Tensor | tuple[Tensor, ...]:
    """Attention: ``out = softmax(scale · score(q, k) + bias, masked) @ v``.

    Args:
        q, k, v: ``(..., h, i, d)``, ``(..., g, j, d)``, ``(..., g, j, e)``; ``h % g == 0``
            (grouped / multi-query KV heads). Leading dims must be equal.
        score: a name (``"dot"``, ``"scaled_dot"``) or a ``qkv.scores.Score`` object
            (``Bilinear``, ``Additive``, ``Location`` carry learned parameters).
        mask: bool, **True = may attend**, broadcastable to ``(..., h, i, j)``, or a lazy
            ``qkv.masks`` object (``causal()``, ``window(...)``, ``lengths(...)``, ``&``, ``|``).
        bias: float tensor broadcastable to ``(..., h, i, j)`` added to the logits, or a lazy
            bias (``qkv.ALiBi``, ``qkv.RelativePositionBias``). With ALiBi, a steep head leaves
            unread the keys whose weights are together below a quarter of the output's rounding
            (``qkv.backends.alibi_reach``; ``qkv.explain`` says so; a named ``backend`` reads all).
        causal: add a causal mask aligned bottom-right (the last query sees every key).
        scale: factor on the score; default the score's own (``1/√d`` for scaled dot, else 1).
        dropout: probability of dropping a weight. Applied whenever > 0, like
            ``F.scaled_dot_product_attention``; modules pass 0 in eval mode.
        return_weights: also return the weights ``(..., h, i, j)`` (before dropout).
        backend: ``"auto"`` or a backend name (``qkv.backends.REGISTRY``).
        generator: randomness for dropout, for reproducible runs.
        weights_for: with ``return_weights=True``, only some weights:
            ``{"heads": ..., "rows": ...}`` (either key optional), each an int, a slice, a
            range, a list of ints or a 1-d integer tensor. The weights are then
            ``(..., len(heads), len(rows), j)``; the chunked backend builds only those, so
            inspecting two heads of a long sequence never holds the ``(..., h, i, j)`` tensor.
        sinks: ``(h,)`` attention sinks, one logit per query head (learnable): each row's
            softmax denominator gains ``exp(sinks[h])`` and the sink has no value, so the
            weights over the keys sum to less than 1 (GPT-OSS; StreamingLLM's sink token).
        score_mod: ``fn(score, b, h, q_idx, kv_idx) -> score`` applied elementwise to the
            scaled logits after the bias and before the mask (``flex_attention``'s
            convention; ``qkv.score_mods``), e.g. ``qkv.SoftCap(c)``. The chunked backend runs
            it tile by tile, forward and backward; tensors it closes over get gradients.
        return_lse: also return each row's log-sum-exp ``lse (..., h, i)``, the natural log of
            its softmax denominator (with sinks, the whole denominator, sink included), so
            that attentions over disjoint keys merge exactly (:func:`merge`). Gradients flow
            through it. A row with no key (and no sink) has ``lse = -inf``.

    Returns:
        ``out (..., h, i, e)``; with ``return_weights`` and/or ``return_lse`` a tuple
        ``(out, weights, lse)`` of what was asked, in that order. A query whose keys are all
        masked gets zero output, zero weights and zero gradients. With ``return_weights=True`` and
        ``backend="auto"``, a call small enough is materialised (``qkv.backends.
        MATERIALISE_ELEMENTS``); a larger one, or one with ``weights_for``, gets its output
        from a fused engine and its weights rebuilt exactly from the log-sum-exp
        (``qkv.backends.tiling.weights_from_lse``).
    """
    if (
        bias is None and sinks is None and score_mod is None and weights_for is None
        and not unknown and return_weights is False and return_lse is False and backend == "auto"
        and (type(dropout) is float or type(dropout) is int) and dropout == 0
    ):  # fmt: skip
        out = sdpa_plain.plain(q, k, v, score, causal, scale, mask)  # a plain call: the kernel, no request built
        if out is not None:
            return out
    if unknown:
        foreign_keywords(unknown, FOREIGN_NAMES, "attention", "qkv.attention")
    q, k, v = autocast_inputs(q, k, v)
    req = checks.request(
        q, k, v, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        dropout=dropout, return_weights=return_weights, generator=generator, sinks=sinks,
        score_mod=score_mod, return_lse=return_lse, hidden_after=True,
    )  # fmt: skip
    if weights_for is not None:
        req = replace(req, weights_for=_weights_for(weights_for, req))
    split = alibi_reach.runs(req, backend)
    if split is not None:  # ALiBi's steep heads, each over the keys its weights can reach
        return _by_reach(req, split)
    return _run(req, backend)


def _run(req: backends.Request, backend: str) -> Tensor | tuple[Tensor, ...]:
    """A checked call on the backend ``choose`` picks: ``out``, and the weights and ``lse`` it asks for, in its layout."""
    impl, _ = backends.choose(req, backend)
    if hidden_keys.needs_guard_first(req):  # gradients or a trace: hidden keys zeroed first where the backend reads one
        out, weights, lse = impl.run(hidden_keys.guard(req) if hidden_keys.reads(impl, req) else req)
    else:  # inference: padding holding NaN shows in the output; only then run again on zeroed keys
        out, weights, lse = hidden_keys.after(req, impl, impl.run(req))
    results = [req.restore(out)]
    if req.return_weights:
        if req.weights_for is not None and not getattr(impl, "selects_weights", False):
            heads, rows = req.weights_for
            weights = weights if heads is None else weights.index_select(1, heads.to(weights.device))
            weights = weights if rows is None else weights.index_select(2, rows.to(weights.device))
        results.append(req.restore(weights))
    if req.return_lse:
        results.append(req.restore(lse))
    return results[0] if len(results) == 1 else tuple(results)


def _by_reach(req: backends.Request, runs: list) -> Tensor | tuple[Tensor, Tensor]:
    """``req`` (ALiBi, see ``backends.alibi_reach``) as one call per run of heads, each run's heads over the keys
    within its reach: ``out``, and ``lse`` where asked, joined along the heads in the caller's layout."""
    causal = req.mask is not None
    slopes = alibi_reach.head_slopes(req)
    outs, lses = [], []
    qs, ks, vs = _heads_of(req, runs)
    for run, q, k, v in zip(runs, qs, ks, vs):
        bias = ALiBi(run.b - run.a, slopes=slopes[run.a : run.b])
        sinks = None if req.sinks is None else req.sinks[run.a : run.b]
        if run.reach is None:  # the call's own mask, already checked: its heads as they are (their reach not sought again)
            result = _run(replace(req, q=q, k=k, v=v, bias=bias, sinks=sinks, layout=None), "auto")
        else:  # a window of its own, checked (and its hidden keys guarded) as any call's mask
            result = attention(q, k, v, score=req.score, mask=alibi_reach.window(run, causal), bias=bias,
                               scale=req.scale, sinks=sinks, return_lse=req.return_lse, backend=alibi_reach.BACKEND)  # fmt: skip
        outs.append(result[0] if req.return_lse else result)
        if req.return_lse:
            lses.append(result[1])
    out = req.restore(torch.cat(outs, 1))
    return (out, req.restore(torch.cat(lses, 1))) if req.return_lse else out


def _heads_of(req: backends.Request, runs: list) -> tuple[tuple[Tensor, ...], ...]:
    """Each run's query, key and value heads: one ``split`` of each where the runs' KV heads follow one another
    (its backward joins the runs' gradients in one tensor, where a slice's backward pads each run's to the whole
    size: three such at 4096 tokens raised a training call's peak by half the budget of ALiBi's memory target),
    slices where two runs share a KV head."""
    qs = req.q.split([r.b - r.a for r in runs], 1)
    if all(r.ka == (s.kb if s else 0) for s, r in zip([None, *runs], runs)):
        sizes = [r.kb - r.ka for r in runs]
        return qs, req.k.split(sizes, 1), req.v.split(sizes, 1)
    return qs, [req.k[:, r.ka : r.kb] for r in runs], [req.v[:, r.ka : r.kb] for r in runs]


def autocast_inputs(q: object, k: object, v: object) -> tuple:
    """``q, k, v`` in ``torch.autocast``'s dtype where it is on for their device, as it casts SDPA's inputs.

    Autocast casts ``F.scaled_dot_product_attention``'s floating inputs (not float64) to its
    dtype, so the plain lane's calls ran in bfloat16 under ``autocast("cpu", torch.bfloat16)``;
    qkv's engines and the reference are no op autocast knows, so a call with ALiBi, sinks or a
    ``score_mod`` stayed float32: a call's dtype depended on its options, and
    ``qkv.flex_attention`` with a ``score_mod`` answered float32 where flex answers bfloat16.
    The one rule for every entry: :func:`attention`'s full path (its plain lane calls SDPA,
    which autocast casts itself), :func:`explain`, and ``varlen_attention``, paged or packed.
    """
    if not isinstance(q, Tensor) or not autocast_on(q.device.type):
        return q, k, v
    to = torch.get_autocast_dtype(q.device.type)
    return tuple(x.to(to) if isinstance(x, Tensor) and x.is_floating_point() and x.dtype not in (to, torch.float64)
                 else x for x in (q, k, v))  # fmt: skip


_SDPA, _FLASH, _FLEX, _MHA = "F.scaled_dot_product_attention", "flash_attn_func", "flex_attention", "nn.MultiheadAttention.forward"
#: Other libraries' keywords for what ``qkv.attention`` takes, and what it calls them.
FOREIGN_NAMES = {
    "attn_mask": (_SDPA, "mask= (bool, True = may attend) or bias= (float, added to the logits)"),
    "is_causal": (_SDPA, "causal= (aligned bottom-right; qkv.scaled_dot_product_attention keeps SDPA's top-left)"),
    "dropout_p": (_SDPA, "dropout="),
    "enable_gqa": (_SDPA, "nothing: grouped KV heads (h % g == 0) are understood without a flag"),
    "softmax_scale": (_FLASH, "scale="),
    "window_size": (_FLASH, "mask=qkv.masks.window(left, right) (None for flash-attn's -1)"),
    "softcap": (_FLASH, "score_mod=qkv.SoftCap(cap)"),
    "alibi_slopes": (_FLASH, "bias=qkv.ALiBi(h, slopes=alibi_slopes)"),
    "return_attn_probs": (_FLASH, "return_weights=True (and return_lse=True)"),
    "cu_seqlens_q": ("flash_attn_varlen_func", "nothing: qkv.varlen_attention takes flash_attn_varlen_func's arguments as they are"),
    "cu_seq_q": ("torch.nn.attention.varlen.varlen_attn", "nothing: qkv.varlen_attn takes varlen_attn's arguments as they are"),
    "return_aux": ("torch.nn.attention.varlen.varlen_attn", "return_lse=True (qkv.varlen_attn takes return_aux as it is)"),
    "block_mask": (_FLEX, "mask=qkv.masks.from_mask_mod(mask_mod) (qkv.flex_attention takes a BlockMask as it is)"),
    "key_padding_mask": (_MHA, "mask= (bool, True = may attend: ~key_padding_mask[:, None, None, :])"),
    "need_weights": (_MHA, "return_weights="),
    "logits_soft_cap": ("FlashInfer", "score_mod=qkv.SoftCap(cap) (qkv.paged_attention takes logits_soft_cap as it is)"),
    "sm_scale": ("FlashInfer", "scale= (qkv.paged_attention takes sm_scale as it is)"),
    "window_left": ("FlashInfer", "mask=qkv.masks.window(left, 0) (qkv.paged_attention takes window_left as it is)"),
    **{name: KERAS_NAMES[name] for name in ("use_causal_mask", "return_attention_scores", "attention_mask")},
}


def foreign_keywords(unknown: dict, names: dict[str, tuple[str, str]], callee: str, ours: str) -> None:
    """A ``TypeError`` for the first keyword of ``unknown`` that ``callee`` does not take: with qkv's name for it
    where ``names`` (keyword -> (its library, what ``ours`` takes)) has one."""
    name = sorted(unknown)[0]
    if name in names:
        origin, hint = names[name]
        raise TypeError(f"{callee}: {name}= is {origin}'s keyword; {ours} takes {hint}")
    raise TypeError(f"{callee}() got an unexpected keyword argument {name!r}")


def foreign_call(module: str, query: object, mask: object, foreign: dict, names: dict[str, tuple[str, str]]) -> None:
    """Another library's call on a qkv module answered with qkv's form: its keywords (``names``, as
    :func:`foreign_keywords`), and Keras' lists, ``layer([query, value, key], mask=[query_mask, value_mask])``."""
    if foreign:
        foreign_keywords(foreign, names, module, "qkv's module")
    if isinstance(query, (list, tuple)) and query and all(isinstance(x, Tensor) for x in query):
        raise TypeError(f"query: got a {type(query).__name__}, Keras' [query, value, key]; {module} takes "
                        "(query, key, value) as arguments, the key and value in qkv's order")  # fmt: skip
    if isinstance(mask, (list, tuple)) and mask and all(x is None or isinstance(x, Tensor) for x in mask):
        raise TypeError(f"mask: got a {type(mask).__name__}, Keras' [query_mask, value_mask]; {module} takes one bool "
                        "mask, True = may attend (qkv.interop_keras: a value mask as mask=, a query mask's rows)")  # fmt: skip


def _weights_for(spec: object, req: backends.Request) -> tuple[Tensor | None, Tensor | None]:
    """Check ``weights_for`` and turn it into ``(heads, rows)`` index tensors (None = all)."""
    if not isinstance(spec, dict):
        raise TypeError(f"weights_for: expected a dict with keys 'heads' and/or 'rows', got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"heads", "rows"})
    if unknown:
        raise ValueError(f"weights_for: expected keys 'heads' and/or 'rows', got {unknown}")
    if not req.return_weights:
        raise ValueError("weights_for: selects which weights to return, so it needs return_weights=True, got False")
    if "heads" in spec and req.layout is not None and not req.layout.head_axis:
        raise ValueError(f"weights_for: 'heads' needs q with a head dim (..., h, i, d), got shape {tuple(req.q.shape[2:])}")
    sizes = {"heads": req.heads, "rows": req.i}
    return tuple(_indices(key, spec.get(key), sizes[key]) for key in ("heads", "rows"))  # type: ignore[return-value]


def _indices(key: str, value: object, size: int) -> Tensor | None:
    if value is None:
        return None
    if isinstance(value, slice):
        value = range(size)[value]
    if isinstance(value, bool):
        raise TypeError(f"weights_for: {key!r} expected an int, slice, range, list or integer tensor, got bool")
    if isinstance(value, int):
        value = [value]
    if isinstance(value, Tensor):
        if value.dtype.is_floating_point or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(
                f"weights_for: {key!r} expected a 1-d integer tensor, got {value.dtype} of shape {tuple(value.shape)}"
            )
        index = value.reshape(-1).long().cpu()
    elif isinstance(value, (list, tuple, range)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        index = torch.tensor(list(value), dtype=torch.long)
    else:
        raise TypeError(
            f"weights_for: {key!r} expected an int, slice, range, list or integer tensor, got {type(value).__name__}"
        )
    if index.numel() == 0:
        raise ValueError(f"weights_for: {key!r} selects nothing, expected at least one index in [0, {size})")
    index = torch.where(index < 0, index + size, index)
    # (traced, the values cannot be read: an index out of range fails in the gather instead)
    if concrete(index) and bool((index < 0).any() or (index >= size).any()):
        raise ValueError(f"weights_for: {key!r} expected indices in [0, {size}), got {value!r}")
    return index


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    score: str | Score = "scaled_dot",
    mask: Mask | Tensor | None = None,
    bias: Tensor | LazyBias | None = None,
    causal: bool = False,
    scale: float | None = None,
    weights_for: dict | None = None,
    backend: str = "auto",
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
) -> Tensor:
    """Only the weights ``α (..., h, i, j)`` of :func:`attention` (rows sum to 1, or 0 if fully masked, < 1 with sinks).

    ``weights_for`` selects heads and rows as in :func:`attention`. It is :func:`attention`
    on a one-column stand-in for the values, so the dispatcher decides as it does there: a
    call whose logits (times the additive score's hidden size) fit in
    ``qkv.backends.MATERIALISE_ELEMENTS`` is materialised, one softmax, the fastest way when
    the weights are the whole output anyway; a larger call, or one with ``weights_for``,
    runs the chunked backend, whose weights are rebuilt from its log-sum-exp in row chunks,
    so additive scores never build the ``(i, j, hidden)`` tensor and a few rows of a long
    sequence never build all ``(h, i, j)`` weights.
    """
    # One zero column stands in for the values: (..., g, j, 1), a broadcast view, no copy.
    stand_in = k.new_zeros(()).expand(*k.shape[:-1], 1)
    _, w = attention(
        q, k, stand_in, score=score, mask=mask, bias=bias, causal=causal, scale=scale,
        return_weights=True, backend=backend, weights_for=weights_for, sinks=sinks, score_mod=score_mod,
    )  # fmt: skip
    return w


def merge(outs: Sequence[Tensor], lses: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Attentions over disjoint sets of keys, merged into the attention over all of them: ``(out, lse)``.

    ``outs[n] (..., h, i, e)`` and ``lses[n] (..., h, i)`` are :func:`attention`'s output and
    log-sum-exp (``return_lse=True``) over the ``n``-th set of keys; the result is exactly
    the attention over their union (Milakov & Gimelshein 2018's merge, as in ring attention)::

        lse = log Σ_n exp(lse_n)          out = Σ_n exp(lse_n - lse) · out_n

    Differentiable in every ``out`` and ``lse``; a part whose row saw no key (``lse = -inf``)
    has weight 0, and a row no part saw gets ``out = 0``, ``lse = -inf``, with no NaN in the
    values or the gradients. Sinks belong to one part only (they are one more logit).
    Half-precision parts are weighed and summed in float32 and the result rounded once, to
    the parts' dtype (keep each part's ``out`` in float32 for a result rounded only once).
    FlashInfer's ``merge_state`` / ``merge_states`` (cascades) are this rule on base-2 ``lse``:
    multiply theirs by ``ln 2`` before merging here (``qkv.paged_attention``'s is natural already).
    No parts is refused: ``merge_states`` gives ``0, -inf`` there, its tensors carrying the shape
    an empty list lacks.
    """
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(f"merge: expected lists of outputs and log-sum-exps, got {type(outs).__name__}, {type(lses).__name__}")
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge: expected as many log-sum-exps as outputs (at least one), got {len(outs)} and {len(lses)}")
    for n, (out, lse) in enumerate(zip(outs, lses)):
        if not isinstance(out, Tensor) or not isinstance(lse, Tensor):
            raise TypeError(f"merge: part {n}: expected tensors, got {type(out).__name__}, {type(lse).__name__}")
        if tuple(out.shape[:-1]) != tuple(lse.shape) or out.shape != outs[0].shape:
            raise ValueError(
                f"merge: part {n}: expected out {tuple(outs[0].shape)} and lse {tuple(outs[0].shape[:-1])}, "
                f"got {tuple(out.shape)} and {tuple(lse.shape)}"
            )
    return merge_all(outs, lses)


def explain(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> str:
    """Which backend (and engine) ``attention(q, k, v, **kwargs)`` runs, and why faster ones were passed over.

    It asks the same two choosers the call does (``qkv.backends.choose``, then, for the
    chunked backend, ``qkv.backends.engines.choose``), so it names the path that runs. On
    CUDA it also names the kernel: ``backend: sdpa (flash or efficient kernel, chosen by
    PyTorch)``, ``backend: flex (compiled flex_attention)``.
    """
    # attention's keywords and no others (checks.request takes more, its own), each foreign name translated as there
    unknown = {name: value for name, value in kwargs.items() if name not in attention.__kwdefaults__}
    if unknown:
        foreign_keywords(unknown, FOREIGN_NAMES, "qkv.explain", "qkv.explain")
    backend = kwargs.pop("backend", "auto")
    kwargs.setdefault("score", "scaled_dot")
    kwargs.setdefault("mask", None)
    kwargs.setdefault("bias", None)
    kwargs.setdefault("causal", False)
    kwargs.setdefault("scale", None)
    kwargs.setdefault("dropout", 0.0)
    kwargs.setdefault("return_weights", False)
    weights_for = kwargs.pop("weights_for", None)
    req = checks.request(*autocast_inputs(q, k, v), **kwargs)
    if weights_for is not None:
        req = replace(req, weights_for=_weights_for(weights_for, req))
    split = alibi_reach.runs(req, backend)
    if split is not None:
        reach = ", ".join(f"heads {r.a}-{r.b - 1}: " + ("every key" if r.reach is None else
                          f"offsets within {r.reach}, backend {alibi_reach.BACKEND}") for r in split)  # fmt: skip
        return (f"split by ALiBi's reach: {len(split)} calls ({reach}); keys past a head's reach weigh less than a "
                "quarter of the output's rounding (qkv.backends.alibi_reach)")  # fmt: skip
    impl, passed_over = backends.choose(req, backend)
    head = f"backend: {impl.name}"
    kernel = getattr(impl, "kernel", None)  # what runs, in words, where a backend has several (CUDA's SDPA kernels)
    detail = None if kernel is None else kernel(req)
    if detail:
        head += f" ({detail})"
    lines = [f"  not {reason}" for reason in passed_over]
    if impl.name == "chunked":
        engine, engines_passed_over = engines.choose(req)
        head += f" ({engine.name})"
        lines += [f"  not {name} (engine):{why}" for name, _, why in (r.partition(":") for r in engines_passed_over)]
        other = getattr(engine, "backward_engine", lambda _: None)(req)  # a backward timed faster elsewhere
        if other is not None:
            lines.append(f"  backward: {other} (timed faster than {engine.name}'s own with this bias on this CPU)")
    return "\n".join([head, *lines])
