"""The int8 paged cache's accuracy: next-token KL divergence and perplexity against the float32 cache.

Shape legend: ``n`` tokens of a text, ``V`` vocabulary, ``h`` query heads, ``g`` KV heads.

Each text is read once with every attention layer writing its keys and values to pages and
attending over them (``qkv.paged_attention``), the pages float32 or int8
(``qkv.paged.Int8Pages``: keys per channel, values per token; the partial last page in full
precision). The figures: the mean over positions of ``KL(p_float32 || p_int8)`` of the next
token, in nats, and the perplexity of the text under each.

* **the demo's word-stream language model** (demo step 5's: 2 layers, 4 heads, rotary,
  trained here for 300 steps on sequences of 64 tokens), read through ``qkv.paged.serve``'s
  paged step on 32 held-out streams of 64 tokens;
* **SmolLM2-135M-Instruct** (packaged; transformers, gguf and accelerate needed), read with a
  transformers attention function that writes each layer's keys and values to the pages and
  attends with ``qkv.paged_attention``, on a fixed English paragraph.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ..paged import PagedKVCache, paged_attention
from ..paged.serve import PagedStep
from .report import table

TEXT = (
    "The river rose through the night, and by morning the lower fields were under water. The farmers "
    "moved their animals to the hill behind the church, where the ground was dry and the grass was long. "
    "Nobody in the village could remember a flood like it; the oldest woman said her mother had spoken of "
    "one, many years before, when the bridge was still made of wood. By the afternoon the rain had stopped, "
    "and children came out to throw stones into the brown water and watch it carry branches towards the sea."
)


def _scores(logits_a: torch.Tensor, logits_b: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """``(KL(a || b) mean in nats, perplexity under a, perplexity under b)`` of next-token logits ``(n, V)``."""
    log_a, log_b = F.log_softmax(logits_a.double(), -1), F.log_softmax(logits_b.double(), -1)
    kl = float((log_a.exp() * (log_a - log_b)).sum(-1).mean())
    ppl = lambda lg: math.exp(float(F.nll_loss(lg, targets)))  # noqa: E731
    return kl, ppl(log_a), ppl(log_b)


def _demo_lm(say) -> list[str]:
    from ..models import CausalLM, LMConfig
    from ..tasks import make_word_stream_task

    length = 64
    task = make_word_stream_task(n_train=1024, length=length, n_test=32, test_length=length, seed=5)
    torch.manual_seed(5)
    model = CausalLM(LMConfig(vocab=len(task.vocabulary), dim=64, heads=4, layers=2, positional="rotary", max_len=length))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        batch = task.train[torch.randint(len(task.train), (32,), generator=gen)]
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    logits = {}
    with torch.no_grad():
        for kind in ("float32", "int8"):
            cache = PagedKVCache(64, 16, 4, 16, layers=2, quantized=kind == "int8")
            rows = []
            for n, ids in enumerate(task.test):
                cache.add(n)
                step = cache.plan({n: ids.numel()})
                rows.append(model(ids[None], cache=PagedStep(cache, step))[0, :-1])
                cache.free(n)
            logits[kind] = torch.cat(rows)
    targets = task.test[:, 1:].reshape(-1)
    kl, ppl_f, ppl_q = _scores(logits["float32"], logits["int8"], targets)
    say(f"  int8 accuracy, demo LM: KL {kl:.2e} nats, perplexity {ppl_f:.3f} -> {ppl_q:.3f}")
    return [f"demo word-stream LM (trained 300 steps), 32 × {length} tokens", f"{kl:.2e}", f"{ppl_f:.3f}", f"{ppl_q:.3f}"]


def _paged_forward(quantized: bool) -> Callable:
    """A transformers attention function: the layer's keys and values into pages, then ``qkv.paged_attention``."""
    from ..paged.pages import FloatPages

    def forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, h, n, d = query.shape
        g, P = key.shape[1], 16
        pages = -(-n // P)
        if quantized:
            from ..paged.quant import Int8Pages

            pool = Int8Pages(pages, P, g, d)
        else:
            pool = FloatPages(torch.zeros(pages, 2, P, g, d, dtype=key.dtype))
        ids, offsets = torch.arange(n) // P, torch.arange(n) % P
        pool.write(ids, offsets, key[0].transpose(0, 1), value[0].transpose(0, 1))
        out = paged_attention(query[0].transpose(0, 1), pool, torch.tensor([0, n]), torch.tensor([0, pages]),
                              torch.arange(pages), torch.tensor([n - (pages - 1) * P]), sm_scale=scaling)  # fmt: skip
        return out[None], None  # (1, n, h, d)

    return forward


def _smollm2(say) -> list[str] | None:
    from .decoding import missing

    if missing() is not None:
        say(f"  int8 accuracy, SmolLM2: skipped ({missing()})")
        return None
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from ..integrations import packaged

    folder, gguf_file = packaged.smollm2()
    for kind in ("float32", "int8"):
        AttentionInterface.register(f"qkv_paged_{kind}", _paged_forward(kind == "int8"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, attn_implementation="qkv_paged_float32",
                                                 dtype=torch.float32).eval()  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    logits = {}
    with torch.no_grad():
        for kind in ("float32", "int8"):
            model.set_attn_implementation(f"qkv_paged_{kind}")
            logits[kind] = model(ids, use_cache=False).logits[0, :-1]
    kl, ppl_f, ppl_q = _scores(logits["float32"], logits["int8"], ids[0, 1:])
    say(f"  int8 accuracy, SmolLM2: KL {kl:.2e} nats, perplexity {ppl_f:.3f} -> {ppl_q:.3f}")
    return [f"SmolLM2-135M-Instruct, a paragraph of {ids.shape[1]} tokens", f"{kl:.2e}", f"{ppl_f:.3f}", f"{ppl_q:.3f}"]


def accuracy_lines(say) -> list[str]:
    rows = [_demo_lm(say)]
    smol = _smollm2(say)
    if smol is not None:
        rows.append(smol)
    lines = ["### The int8 cache's accuracy against float32 (next token)", ""]
    return lines + table(["model, text", "KL(float32 ‖ int8), nats", "perplexity float32", "perplexity int8"], rows)
