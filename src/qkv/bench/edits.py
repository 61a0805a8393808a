"""Benchmark suite ``edits``: recording and editing heads of a real model without switching to eager attention.

Shape legend: ``n`` tokens, ``L = 30`` layers, ``h = 9`` query heads of SmolLM2-135M.

The packaged SmolLM2-135M-Instruct (transformers, gguf and accelerate needed), its base model
(no vocabulary head: its ``(n, 49152)`` logits would dwarf what is measured), float32, under
``no_grad``:

* **memory** (a fresh process per case, peak resident memory above the loaded model, the
  high-water mark reset after loading): at ``n = 4096`` tokens, a plain qkv forward; the same
  while ``qkv.record`` keeps the pattern of two heads of one layer (every query row); and
  eager attention with ``output_attentions=True``, which keeps every layer's ``(h, n, n)``
  weights. Target: the recording's peak ≤ 1/8 of eager's;
* **time** at ``n = 1024``, interleaved: a plain qkv forward; the same with two heads of each
  of three layers ablated (``AblateHeads``); the same ablation written as TransformerLens hook
  functions on ``hook_z`` (``qkv.hooks``); a hook function on one layer's ``hook_pattern``
  (that layer composed with its ``(h, n, n)`` map) and on every layer's; eager attention, which
  composes every layer so (as TransformerLens does), and with ``output_attentions=True``, which
  keeps every layer's weights as a hook on every pattern sees them. Targets: the ablations ≤
  1.1× the plain run; the one-layer pattern hook ≤ 1.0× eager; every layer's ≤ 1.0× eager with
  its weights.
"""

from __future__ import annotations

from typing import Callable

import torch

from .measure import interleaved, peak_memory
from .report import Targets, table

NAME = "edits"
DESCRIPTION = "SmolLM2-135M: recording, ablating and hooking heads inside qkv's fused attention, against eager"

FULL = dict(memory_tokens=4096, time_tokens=1024, repeats=5)
QUICK = dict(memory_tokens=64, time_tokens=32, repeats=1)
LAYER, HEADS, ABLATED_LAYERS = 10, [0, 1], [3, 10, 20]


def _model(implementation: str):
    from transformers import AutoModelForCausalLM

    from ..integrations import packaged
    from ..integrations.transformers import register

    folder, gguf_file = packaged.smollm2()
    register()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, attn_implementation=implementation,
                                                 dtype=torch.float32).eval()  # fmt: skip
    return model.model  # the base model: no vocabulary head


def _ids(n: int) -> torch.Tensor:
    return torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(0))


def _reset_peak() -> None:
    """Start the high-water mark afresh (Linux: ``/proc/self/clear_refs``), so loading's peak is not counted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def build(spec: dict) -> Callable[[], object]:
    """One memory case in a fresh process: ``impl`` plain, record or eager, at ``tokens`` tokens."""
    import qkv

    impl = spec["impl"]
    model = _model("eager" if impl == "eager" else "qkv")
    ids = _ids(spec["tokens"])
    _reset_peak()

    def call():
        with torch.no_grad():
            if impl == "eager":
                return model(ids, output_attentions=True).attentions
            if impl == "record":
                with qkv.record(model, layers=LAYER, heads=HEADS, hooks=("pattern",)) as rec:
                    model(ids)
                return rec
            return model(ids)

    return call


def missing() -> str | None:
    from .decoding import missing as why

    return why()


def section(quick: bool, say: Callable[[str], None]) -> str:
    import qkv
    from qkv.edits import AblateHeads

    cfg = QUICK if quick else FULL
    head = ["## Edits: recording, ablating and hooking heads of SmolLM2-135M (`qkv bench --suite edits`)", ""]
    why = missing()
    if why is not None:
        say(f"  skipped: {why}")
        return "\n".join(head + [f"Not measured here: {why}."])
    targets = Targets()
    n = cfg["memory_tokens"]
    mem = {impl: peak_memory(NAME, {"impl": impl, "tokens": n}) for impl in ("plain", "record", "eager")}
    say("  memory: " + ", ".join(f"{k} {v['extra'] / 2**20:.0f} MiB" for k, v in mem.items()))
    ratio = mem["record"]["extra"] / max(1, mem["eager"]["extra"])
    targets.add(f"recording 2 heads of one layer at {n} tokens: peak / eager output_attentions' ≤ 1/8", ratio, 1 / 8)
    model = _model("qkv")
    ids = _ids(cfg["time_tokens"])
    ablate = {layer: AblateHeads(HEADS) for layer in ABLATED_LAYERS}

    def plain():
        with torch.no_grad():
            return model(ids)

    def ablated():
        with torch.no_grad(), qkv.edit(model, ablate):
            return model(ids)

    def zero_heads(z, hook):  # TransformerLens' way: z (b, pos, head, d_head) changed in place
        z[:, :, HEADS] = 0

    z_hooks = [(f"blocks.{layer}.attn.hook_z", zero_heads) for layer in ABLATED_LAYERS]
    pattern_hooks = [(f"blocks.{LAYER}.attn.hook_pattern", lambda p, hook: None)]
    every_pattern = [(lambda name: name.endswith("hook_pattern"), lambda p, hook: None)]
    eager = _model("eager")

    def hooked(hooks):
        def run():
            with torch.no_grad():
                return qkv.run_with_hooks(model, ids, fwd_hooks=hooks)

        return run

    def composed_everywhere(weights: bool):
        def run():
            with torch.no_grad():
                return eager(ids, output_attentions=weights)

        return run

    runs = {"plain": plain, "ablated": ablated, "hook_z ablation": hooked(z_hooks), "hook_pattern, one layer": hooked(pattern_hooks),
            "hook_pattern, every layer": hooked(every_pattern), "eager": composed_everywhere(False),
            "eager, output_attentions": composed_everywhere(True)}  # fmt: skip
    t = interleaved(runs, cfg["repeats"])
    say(f"  time at {cfg['time_tokens']} tokens: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t.items()))
    targets.add(f"ablating 2 heads in 3 layers at {cfg['time_tokens']} tokens: time / a plain qkv run ≤ 1.1", t["ablated"] / t["plain"], 1.1)
    targets.add("the same ablation as hook_z hook functions (qkv.hooks): time / a plain qkv run ≤ 1.1",
                t["hook_z ablation"] / t["plain"], 1.1)  # fmt: skip
    targets.add("a hook function on one layer's hook_pattern: time / eager attention ≤ 1.0",
                t["hook_pattern, one layer"] / t["eager"], 1.0)  # fmt: skip
    targets.add("a hook function on every layer's hook_pattern: time / eager with output_attentions ≤ 1.0",
                t["hook_pattern, every layer"] / t["eager, output_attentions"], 1.0)  # fmt: skip
    lines = head + [f"SmolLM2-135M-Instruct's base model, float32, no_grad; layer {LAYER}, heads {HEADS} recorded; "
                    f"heads {HEADS} of layers {ABLATED_LAYERS} ablated (by qkv.edit, and by hook functions on hook_z); "
                    f"an idle hook function on layer {LAYER}'s hook_pattern, and on every layer's.", ""]  # fmt: skip
    lines += table(["case", f"peak above the loaded model, {n} tokens"],
                   [[k, f"{v['extra'] / 2**20:.0f} MiB"] for k, v in mem.items()]) + [""]  # fmt: skip
    lines += table(["case", f"ms at {cfg['time_tokens']} tokens"], [[k, f"{v * 1e3:.0f}"] for k, v in t.items()]) + [""]
    lines += ["### Targets", ""] + targets.lines()
    return "\n".join(lines)
