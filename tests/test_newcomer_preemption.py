"""A newcomer's hand-written serving loop over ``qkv.PagedKVCache`` with vLLM-style recompute preemption.

Built only from README.md ("Serving many requests: a paged KV cache") and the docstrings it points to
(``qkv.PagedKVCache``, ``qkv.paged.kv_cache``, ``qkv.paged.serve``, ``PagedStep``, ``qkv.paged.OutOfPages``).

The loop: requests arrive at different steps; each step every running request grows by one token
(a decoding step) and newly admitted ones bring their whole prompt (a prefill chunk), all packed in one
``model(ids, cache=PagedStep(cache, step))`` call. The cache is too small for everything at once: when
``cache.plan(...)`` raises ``OutOfPages``, the most recently admitted running request is freed and put
back at the front of the queue; it is later re-admitted by re-running its prompt plus the tokens it had
generated so far (recompute preemption).
"""

from collections import deque
from dataclasses import dataclass, field

import pytest
import torch

import qkv
from qkv.models import CausalLM, LMConfig
from qkv.paged import OutOfPages
from qkv.paged.serve import PagedStep

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 61, 32, 4, 2, 2
HEAD_DIM = DIM // HEADS
PAGE = 4
NUM_PAGES = 8  # 32 tokens in all: far less than the requests below need together

# (name, prompt length, max_new_tokens, arrival step); each fits alone (<= 32 tokens)
SPECS = [("a", 9, 12, 0), ("b", 5, 10, 0), ("c", 7, 9, 1), ("d", 3, 14, 3), ("e", 6, 8, 5), ("f", 11, 6, 6)]


def make_model(dtype):
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab=VOCAB, dim=DIM, heads=HEADS, kv_heads=KV_HEADS, layers=LAYERS,
                              positional="rotary"))
    return model.to(dtype).eval()


def make_prompts():
    g = torch.Generator().manual_seed(1)
    return {name: torch.randint(VOCAB, (n,), generator=g) for name, n, _, _ in SPECS}


@dataclass
class Entry:
    name: str
    prompt: torch.Tensor
    max_new: int
    generated: list = field(default_factory=list)
    pending: int = 0  # tokens this entry feeds in the step being planned


@dataclass
class Stats:
    out_of_pages: list = field(default_factory=list)  # (needed, free, num_pages, expected_needed, free_before)
    preempted: list = field(default_factory=list)  # (step, name, tokens generated so far)
    readmitted: list = field(default_factory=list)
    steps: int = 0


def serve_by_hand(model, cache, prompts, specs=SPECS, max_steps=500):
    """Continuous batching with recompute preemption, written the way the README/docstrings suggest."""
    arrivals = sorted(specs, key=lambda s: s[3])
    waiting: deque[Entry] = deque()
    running: list[Entry] = []  # in the order admitted
    done: dict[str, torch.Tensor] = {}
    stats = Stats()
    ever_preempted = set()
    step_no = 0
    while arrivals or waiting or running:
        assert step_no < max_steps, "loop did not finish"
        while arrivals and arrivals[0][3] <= step_no:
            name, _, max_new, _ = arrivals.pop(0)
            waiting.append(Entry(name, prompts[name], max_new))

        # Running requests decode one token each (their last generated token).
        for e in running:
            e.pending = 1
        # Admit from the front of the queue while the step still fits ("pages_needed(new) <= free_pages").
        while waiting:
            e = waiting[0]
            e.pending = len(e.prompt) + len(e.generated)  # recompute: prompt and the tokens so far
            cache.add(e.name)  # pages_needed of a request not yet added says 0, so add it first
            new = {r.name: r.pending for r in running + [e]}
            if cache.pages_needed(new) <= cache.free_pages:
                waiting.popleft()
                running.append(e)
                if e.name in ever_preempted:
                    stats.readmitted.append((step_no, e.name, len(e.generated)))
            else:
                cache.free(e.name)  # an empty request: nothing to return
                break

        # Plan the step; on OutOfPages preempt the most recently admitted running request and retry.
        while True:
            new = {r.name: r.pending for r in running}
            expected, free_before, used_before = cache.pages_needed(new), cache.free_pages, cache.used_pages
            lengths_before = {r.name: cache.length(r.name) for r in running}
            try:
                step = cache.plan(new)
            except OutOfPages as err:
                stats.out_of_pages.append((err.needed, err.free, err.num_pages, expected, free_before))
                # "nothing changed"
                assert cache.used_pages == used_before and cache.free_pages == free_before
                assert {r.name: cache.length(r.name) for r in running} == lengths_before
                assert len(running) > 1, "a single request that fits alone ran out of pages"
                victim = running.pop()
                cache.free(victim.name)
                victim.pending = 0
                waiting.appendleft(victim)
                ever_preempted.add(victim.name)
                stats.preempted.append((step_no, victim.name, len(victim.generated)))
                continue
            assert expected <= free_before
            assert cache.used_pages == used_before + expected, "plan took other than pages_needed said"
            break

        if running:
            order = {r.name: r for r in running}
            assert tuple(step.requests) == tuple(r.name for r in running)  # plan keeps the dict's order
            chunks = []
            for name in step.requests:
                e = order[name]
                seq = torch.cat([e.prompt, torch.tensor(e.generated, dtype=torch.long)])
                chunks.append(seq[len(seq) - e.pending:])
            ids = torch.cat(chunks)[None]  # (1, T) in step.requests' order
            with torch.no_grad():
                logits = model(ids, cache=PagedStep(cache, step))[0]  # (T, V)
            next_tokens = logits[step.qo_indptr[1:] - 1].argmax(-1)
            for name, tok in zip(step.requests, next_tokens.tolist()):
                order[name].generated.append(tok)
            for e in list(running):
                assert cache.length(e.name) == len(e.prompt) + len(e.generated) - 1
                if len(e.generated) == e.max_new:
                    running.remove(e)
                    cache.free(e.name)
                    done[e.name] = torch.tensor(e.generated, dtype=torch.long)
        step_no += 1
    stats.steps = step_no
    return done, stats


def reference(model, prompts):
    with torch.no_grad():
        return {name: model.generate(prompts[name][None], n)[0, len(prompts[name]):]
                for name, _, n, _ in SPECS}


def test_recompute_preemption_float64_matches_generate():
    model = make_model(torch.float64)
    prompts = make_prompts()
    cache = qkv.PagedKVCache(num_pages=NUM_PAGES, page_size=PAGE, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             layers=LAYERS, dtype=torch.float64)
    done, stats = serve_by_hand(model, cache, prompts)

    # the cache really was too small: preemption happened, and preempted requests came back
    assert stats.preempted, "no preemption: the test does not exercise what it claims"
    assert {n for _, n, _ in stats.readmitted} == {n for _, n, _ in stats.preempted}
    assert any(k > 0 for _, _, k in stats.preempted), "no request was preempted mid-decode"
    # OutOfPages' attributes agree with pages_needed / free_pages taken just before plan
    for needed, free, num_pages, expected, free_before in stats.out_of_pages:
        assert (needed, free, num_pages) == (expected, free_before, NUM_PAGES)
        assert needed > free
    # no pages leak
    assert cache.used_pages == 0 and cache.free_pages == NUM_PAGES and list(cache.requests) == []

    ref = reference(model, prompts)
    assert set(done) == set(ref)
    for name in ref:
        assert torch.equal(done[name], ref[name]), name

    # qkv's own serve() over an equally small cache (it reserves whole lengths, never preempts) agrees too
    from qkv.paged.serve import Request, serve
    cache2 = qkv.PagedKVCache(num_pages=NUM_PAGES, page_size=PAGE, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                              layers=LAYERS, dtype=torch.float64)
    out = serve(model, [Request(n, prompts[n], k, arrival=t) for n, _, k, t in SPECS], cache2)
    for name in ref:
        assert torch.equal(out[name][len(prompts[name]):], ref[name]), name
    assert cache2.used_pages == 0


def test_out_of_pages_attributes_direct():
    cache = qkv.PagedKVCache(num_pages=NUM_PAGES, page_size=PAGE, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                             layers=LAYERS, dtype=torch.float64)
    cache.add("x")
    cache.add("y")
    cache.plan({"x": 13})  # 4 pages
    new = {"x": 3, "y": 10}  # x: 16 tokens (no new page), y: 3 pages; 4 free -> fits
    assert cache.pages_needed(new) == 3 and cache.free_pages == 4
    cache.plan(new)
    new = {"x": 1, "y": 3}  # x needs a 5th page, y a 4th: 2 > 1 free
    needed, free = cache.pages_needed(new), cache.free_pages
    with pytest.raises(OutOfPages) as info:
        cache.plan(new)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.needed, info.value.free, info.value.num_pages) == (needed, free, NUM_PAGES) == (2, 1, 8)
    assert cache.length("x") == 16 and cache.length("y") == 10 and cache.used_pages == 7
    cache.free("x")
    cache.free("y")
    assert cache.used_pages == 0


def calibrate(model, prompts):
    """Largest |k| and |v| per layer over the prompts (vLLM's per-tensor calibration), divided by 448."""
    big = qkv.PagedKVCache(num_pages=64, page_size=PAGE, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           layers=LAYERS, dtype=torch.float32)
    kmax, vmax = [0.0] * LAYERS, [0.0] * LAYERS
    for name, p in prompts.items():
        big.add(name)
        step = big.plan({name: len(p)})
        with torch.no_grad():
            model(p[None], cache=PagedStep(big, step))
        pages = torch.tensor(big.pages_of(name))
        for layer in range(LAYERS):
            k_cache, v_cache = big.layer(layer)  # (num_pages, P, g, d) each
            k = k_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[: len(p)]
            v = v_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[: len(p)]
            kmax[layer] = max(kmax[layer], k.abs().max().item())
            vmax[layer] = max(vmax[layer], v.abs().max().item())
        big.free(name)
    assert big.used_pages == 0
    return [m / 448 for m in kmax], [m / 448 for m in vmax]


def test_float8_cache_with_calibration_in_the_same_loop():
    model = make_model(torch.float32)
    prompts = make_prompts()
    kw = dict(num_pages=NUM_PAGES, page_size=PAGE, kv_heads=KV_HEADS, head_dim=HEAD_DIM, layers=LAYERS)
    c32 = qkv.PagedKVCache(**kw, dtype=torch.float32)
    done32, stats32 = serve_by_hand(model, c32, prompts)
    assert c32.used_pages == 0 and stats32.preempted

    # the float32 loop is itself the greedy reference
    ref = reference(model, prompts)
    for name in ref:
        assert torch.equal(done32[name], ref[name]), name

    k_scale, v_scale = calibrate(model, prompts)
    c8 = qkv.PagedKVCache(**kw, dtype=torch.float8_e4m3fn, k_scale=k_scale, v_scale=v_scale)
    done8, stats8 = serve_by_hand(model, c8, prompts)
    assert c8.used_pages == 0 and c8.free_pages == NUM_PAGES
    # lengths alone decide the schedule, so preemption happens at the same steps
    assert stats8.preempted == [(s, n, k) for s, n, k in stats32.preempted]

    agree = total = 0
    first_diff = {}
    for name in done32:
        a, b = done32[name], done8[name]
        assert a.shape == b.shape
        same = (a == b).long()
        agree += int(same.sum())
        total += len(a)
        # tokens agree up to the first difference (prefix length)
        first_diff[name] = int(same.cumprod(0).sum())
    print(f"\nfloat8 (calibrated) vs float32 tokens: {agree}/{total} agree; agreeing prefix per request: "
          f"{first_diff}")
    # a loose sanity floor: the first greedy token of every request (prefill over fp8 pages) agrees
    assert all(v >= 1 for v in first_diff.values()), first_diff
    assert agree >= total // 2


def test_pages_needed_for_a_request_not_yet_added():
    """README: "cache.pages_needed(new) <= cache.free_pages says whether cache.plan(new) fits".

    For a name the cache does not hold, plan() raises KeyError, and pages_needed() answered 0, so an
    admission check made before cache.add(name) always said "fits": now the same KeyError (and the
    same ValueError for a negative count).
    """
    cache = qkv.PagedKVCache(num_pages=2, page_size=4, kv_heads=1, head_dim=8)
    for ask in (cache.plan, cache.pages_needed):
        with pytest.raises(KeyError, match="request 'new' is not in the cache"):
            ask({"new": 9})
    cache.add("a")
    for ask in (cache.plan, cache.pages_needed):
        with pytest.raises(ValueError, match="expected a count >= 0, got -1"):
            ask({"a": -1})
    assert cache.pages_needed({"a": 9}) == 3


def test_a_paged_step_over_a_cache_of_fewer_layers_names_both_counts():
    """A hand-written loop's cache made for another model: was a bare IndexError from inside the stack."""
    model = make_model(torch.float64)
    layers = LAYERS
    cache = qkv.PagedKVCache(8, 4, KV_HEADS, DIM // HEADS, layers=layers - 1, dtype=torch.float64)
    cache.add("a")
    step = cache.plan({"a": 3})
    with pytest.raises(ValueError, match=f"a PagedStep over a PagedKVCache of {layers - 1} layers, for a stack of {layers}"):
        model(torch.tensor([[1, 2, 3]]), cache=PagedStep(cache, step))
