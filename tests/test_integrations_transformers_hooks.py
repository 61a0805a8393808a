"""Tests of ``qkv.hooks`` and ``qkv.run_with_hooks``: TransformerLens' hook functions in transformers models.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``e`` value size.

Oracle: transformers' eager attention replaced by TransformerLens' composition of an
attention layer (``abstract_attention.py``: values hooked, scores with ``-inf`` where the mask
hides a key, hooked, softmax with NaN set to 0, pattern hooked, ``z = pattern @ v`` hooked in
``[batch, pos, head, d_head]``), running the same hook functions, on float64 copies of the
packaged all-MiniLM-L6-v2 (12 heads) and SmolLM2-135M (9 heads on 3 KV heads, causal).
"""

import contextlib
import copy
import importlib.util
import warnings

import pytest
import torch

import qkv
from qkv.edits import AblateHeads, PatchPattern
from packaged_models import minilm_pair, smollm2_pair

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
LAYER, HEAD = 3, 5
TOL = dict(atol=1e-9, rtol=0)  # float64 throughout
SENTENCES = ["The cat sat on the mat.", "A longer sentence, so that the first one is padded on the right."]

if HAS_TRANSFORMERS:
    from transformers import AutoTokenizer
    from transformers.models.bert import modeling_bert
    from transformers.models.llama import modeling_llama


@pytest.fixture(scope="module")
def minilm():
    model, eager, folder = minilm_pair()
    return model, eager, AutoTokenizer.from_pretrained(folder)(SENTENCES, padding=True, return_tensors="pt")


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_pair()


class Point(torch.nn.Module):
    """TransformerLens' ``HookPoint``, its mechanism copied: an identity module whose forward hooks run the hook
    functions on its output and whose full backward hooks run the backward ones on its output's gradient."""

    def __init__(self, name):
        super().__init__()
        self.name, self.ctx = name, {}

    def forward(self, x):
        return x

    def layer(self):
        return int(self.name.split(".")[1])

    def add(self, fn, direction):
        if direction == "fwd":
            self.register_forward_hook(lambda module, args, output: fn(output, hook=self))
        else:
            def backward(module, grad_input, grad_output):
                returned = fn(grad_output[0], hook=self)
                return None if returned is None else (returned,)

            self.register_full_backward_hook(backward)


def lens_attention(fwd, bwd=(), rotated=False):
    """An eager attention function that composes the layer as TransformerLens does, with hooks ``[(name, fn)]``.

    ``rotated``: the model has rotated query and key before this function (their points are
    ``hook_rot_q``, ``hook_rot_k``).
    """
    points = {}

    def run(name, tensor):
        if name not in points:
            points[name] = Point(name)
            for direction, pairs in (("fwd", fwd), ("bwd", bwd)):
                for n, fn in pairs:
                    if n == name:
                        points[name].add(fn, direction)
        return points[name](tensor)

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        at = lambda point: f"blocks.{module.layer_idx}.attn.hook_{point}"
        group = query.shape[1] // key.shape[1]
        query = run(at("rot_q" if rotated else "q"), query.transpose(1, 2)).transpose(1, 2)  # hooked as (b, i, h, d)
        key = run(at("rot_k" if rotated else "k"), key.transpose(1, 2)).transpose(1, 2)  # (b, j, g, d)
        value = run(at("v"), value.transpose(1, 2)).transpose(1, 2)  # (b, j, g, e)
        scores = query @ key.repeat_interleave(group, 1).transpose(-1, -2) * scaling
        if attention_mask is not None:
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            scores = scores.masked_fill(~allowed, float("-inf"))
        scores = run(at("attn_scores"), scores)
        pattern = torch.softmax(scores, dim=-1)
        pattern = run(at("pattern"), torch.where(pattern.isnan(), 0.0, pattern))
        z = run(at("z"), (pattern @ value.repeat_interleave(group, 1)).transpose(1, 2))  # (b, i, h, e)
        return z.contiguous(), pattern

    return forward


def lens(model, monkeypatch, module, fwd, bwd=()):
    """``model`` (eager) running TransformerLens' composition with ``fwd`` / ``bwd`` hooks ``[(name, fn)]``."""
    rotated = module.__name__.endswith("llama")
    monkeypatch.setattr(module, "eager_attention_forward", lens_attention(fwd, bwd, rotated))
    return model


def zero_head(pattern, hook):
    pattern[:, HEAD] = 0  # in place, returning None: the change goes on


def hidden(model, batch):
    with torch.no_grad():
        return model(**batch).last_hidden_state


def real(batch):
    return batch["attention_mask"].bool()


@pytest.mark.parametrize(
    "name, fn",
    [
        ("hook_pattern", zero_head),
        ("hook_pattern", lambda p, hook: p * torch.linspace(0.5, 1.5, p.shape[-1], dtype=p.dtype)),  # a new tensor
        ("hook_attn_scores", lambda s, hook: s + torch.arange(s.shape[-1], dtype=s.dtype) / 4),  # -inf stays -inf
        ("hook_z", lambda z, hook: z.flip(1)),  # (b, i, h, e): positions reversed
        ("hook_v", lambda v, hook: v * (1 + torch.arange(v.shape[2], dtype=v.dtype)[:, None])),  # (b, j, g, e)
        ("hook_q", lambda q, hook: q * torch.linspace(0.0, 2.0, q.shape[2], dtype=q.dtype)[:, None]),  # (b, i, h, d)
        ("hook_k", lambda k, hook: k.roll(1, dims=1)),  # (b, j, g, d): each key moved one position on
    ],
    ids=["pattern-in-place", "pattern-returned", "scores", "z", "v", "q", "k"],
)
def test_each_hook_point_equals_transformer_lens_composition(minilm, monkeypatch, name, fn):
    model, eager, batch = minilm
    hooks = [(f"blocks.{LAYER}.attn.{name}", fn)]
    with qkv.hooks(model, fwd_hooks=hooks):
        ours = hidden(model, batch)
    theirs = hidden(lens(eager, monkeypatch, modeling_bert, hooks), batch)
    torch.testing.assert_close(ours[real(batch)], theirs[real(batch)], **TOL)
    assert (ours - hidden(model, batch))[real(batch)].abs().max() > 1e-4  # the hook mattered, and ended with the block


def test_hooks_see_transformer_lens_shapes_names_and_keep_ctx(minilm):
    model, _, batch = minilm
    b, n = batch["input_ids"].shape
    seen = []

    def look(tensor, hook):
        seen.append((hook.name, hook.layer(), tuple(tensor.shape)))
        hook.ctx["calls"] = hook.ctx.get("calls", 0) + 1

    with qkv.hooks(model, fwd_hooks=[(lambda name: name.startswith("blocks.1."), look)]) as hooked:
        assert hooked is model
        hidden(model, batch)
        hidden(model, batch)
    points = ["q", "k", "v", "attn_scores", "pattern", "z"]
    shapes = {"q": (b, n, 12, 32), "k": (b, n, 12, 32), "v": (b, n, 12, 32), "attn_scores": (b, 12, n, n),
              "pattern": (b, 12, n, n), "z": (b, n, 12, 32)}  # fmt: skip
    assert seen == [(f"blocks.1.attn.hook_{p}", 1, shapes[p]) for p in points] * 2  # in forward order, each call


def test_hooks_on_one_point_run_in_order_each_on_the_last_ones_result(minilm):
    model, _, batch = minilm
    got = []
    first = lambda z, hook: z * 0 + 1
    second = lambda z, hook: got.append(float(z.abs().max() - 1)) or z * 2
    name = f"blocks.{LAYER}.attn.hook_z"
    with qkv.hooks(model, fwd_hooks=[(name, first)]), qkv.hooks(model, fwd_hooks=[(name, second)]):
        with qkv.record(model, layers=LAYER, hooks=["z"]) as rec:
            hidden(model, batch)
    assert got == [0.0]  # the inner block's hook saw the outer one's result
    assert bool((rec[f"blocks.{LAYER}.attn.hook_z"] == 2).all())  # and the recording what the hooks left


def test_only_a_layer_with_scores_or_pattern_hooks_builds_the_map(minilm, monkeypatch):
    model, _, batch = minilm
    built = []
    scores = qkv.edits.recorded.scores
    monkeypatch.setattr(qkv.edits.recorded, "scores", lambda *a: built.append(1) or scores(*a))
    with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", lambda z, hook: None)]):
        hidden(model, batch)
    assert built == []  # z hooks keep qkv's engines
    with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", zero_head)]):
        hidden(model, batch)
    assert built == [1]  # one layer of six composed


def test_recording_shows_the_hooked_pattern(minilm):
    model, eager, batch = minilm
    with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", zero_head)]):
        with qkv.record(model, layers=LAYER, heads=[HEAD, 0], rows=[1]) as rec:
            hidden(model, batch)
    pattern = rec[f"blocks.{LAYER}.attn.hook_pattern"]  # (b, 2, 1, j)
    assert bool((pattern[:, 0] == 0).all()) and bool((pattern[:, 1].sum(-1) - 1).abs().max() < 1e-9)
    with torch.no_grad():
        clean = eager(**batch, output_attentions=True).attentions[LAYER]
    torch.testing.assert_close(pattern[:, 1], clean[:, 0, 1:2], **TOL)


def test_edits_apply_before_the_hooks(minilm, monkeypatch):
    model, eager, batch = minilm
    n = batch["input_ids"].shape[1]
    patch = torch.full((1, 1, 1, n), 1.0 / n, dtype=torch.float64)  # head 0, row 2: uniform
    seen = []
    hooks = [(f"blocks.{LAYER}.attn.hook_pattern", lambda p, hook: seen.append(p[:, 0, 2].clone()) or p * 2)]
    with qkv.edit(model, {LAYER: [PatchPattern(0, 2, patch), AblateHeads(HEAD)]}), qkv.hooks(model, fwd_hooks=hooks):
        ours = hidden(model, batch)
    torch.testing.assert_close(seen[0], patch[0, 0].expand(2, n), **TOL)  # the hook saw the patched row

    def lens_edits(p, hook):  # the patch, then the hook's doubling; the ablation acts on z
        p = p.clone()
        p[:, 0, 2] = 1.0 / n
        return p * 2

    ablate = lambda z, hook: z.index_fill(2, torch.tensor([HEAD]), 0)
    theirs = hidden(lens(eager, monkeypatch, modeling_bert, [(hooks[0][0], lens_edits), (f"blocks.{LAYER}.attn.hook_z", ablate)]), batch)
    torch.testing.assert_close(ours[real(batch)], theirs[real(batch)], **TOL)


def test_backward_hooks_see_transformer_lens_gradients_and_may_replace_them(minilm, monkeypatch):
    model, eager, batch = minilm
    name = f"blocks.{LAYER}.attn.hook_pattern"
    ours, theirs = [], []
    halve = lambda g, hook: g / 2

    def loss(m):
        embeddings = m.embeddings.word_embeddings
        embeddings.weight.grad = None
        (m(**batch).last_hidden_state[real(batch)] ** 2).sum().backward()
        return embeddings.weight.grad.clone()

    bwd = [(name, lambda g, hook: ours.append(g.clone())), (name, halve)]
    with qkv.hooks(model, bwd_hooks=bwd):
        our_grad = loss(model)
    lens(eager, monkeypatch, modeling_bert, [], [(name, lambda g, hook: theirs.append(g.clone())), (name, halve)])
    their_grad = loss(eager)
    torch.testing.assert_close(ours[0], theirs[0], **TOL)  # (b, h, i, j): the gradient at the pattern
    torch.testing.assert_close(our_grad, their_grad, **TOL)  # the halved gradient flowed on
    assert (our_grad - loss(model)).abs().max() > 1e-6  # and the hooks ended with the block


def test_backward_hooks_fire_only_inside_their_block(minilm):
    model, _, batch = minilm
    fired = []
    with qkv.hooks(model, bwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", lambda g, hook: fired.append(hook.name))]):
        out = model(**batch).last_hidden_state.sum()
    out.backward()  # after the block: its hooks are gone, as TransformerLens removes them
    assert fired == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qkv.run_with_hooks(model, **batch, bwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", lambda g, hook: None)])
    assert any("bwd_hooks never fire" in str(w.message) for w in caught)


def test_run_with_hooks_returns_the_models_output(minilm):
    model, _, batch = minilm
    with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", zero_head)]):
        want = hidden(model, batch)
    with torch.no_grad():
        got = qkv.run_with_hooks(model, **batch, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", zero_head)])
    torch.testing.assert_close(got.last_hidden_state, want, **TOL)


def test_wrong_hooks_are_refused_with_what_qkv_offers(minilm):
    model, _, batch = minilm
    with pytest.raises(KeyError, match=r"blocks.0.hook_resid_pre.*\{hook_q, hook_k, hook_v, hook_attn_scores, hook_pattern, "
                                       r"hook_z\} for layers l in \[0, 1, 2, 3, 4, 5\]"):  # fmt: skip
        with qkv.hooks(model, fwd_hooks=[("blocks.0.hook_resid_pre", zero_head)]):
            pass
    with pytest.raises(KeyError, match="hook_rot_q and hook_rot_k where the model rotates them"):
        qkv.run_with_hooks(model, **batch, fwd_hooks=[("blocks.0.attn.hook_rot_q", zero_head)])
    with pytest.raises(TypeError, match="pairs, got dict"):
        qkv.run_with_hooks(model, **batch, fwd_hooks={"blocks.0.attn.hook_z": zero_head})
    with pytest.raises(TypeError, match="not callable"):
        qkv.run_with_hooks(model, **batch, fwd_hooks=[("blocks.0.attn.hook_z", "zero")])
    with pytest.raises(ValueError, match=r"blocks.0.attn.hook_z: a hook function returned shape \(2, 12\)"):
        qkv.run_with_hooks(model, **batch, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z[:, 0, :, 0])])
    with pytest.raises(TypeError, match="returns None or a tensor, got float"):
        qkv.run_with_hooks(model, **batch, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: 1.0)])
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match='attn_implementation="qkv"'):
        with qkv.hooks(eager, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)]):
            pass


def test_grouped_heads_and_causal_mask_in_smollm2(smollm2, monkeypatch):
    model, eager = smollm2
    ids = torch.randint(100, 40000, (2, 11), generator=torch.Generator().manual_seed(0))
    shapes = []

    def hooks():
        return [
            ("blocks.7.attn.hook_v", lambda v, hook: shapes.append(tuple(v.shape)) or v * 1.5),  # (b, j, g = 3, e)
            ("blocks.7.attn.hook_pattern", zero_head),
            ("blocks.4.attn.hook_rot_k", lambda k, hook: k.flip(1)),  # (b, j, g, d) after the rotary embedding
            ("blocks.4.attn.hook_rot_q", lambda q, hook: q * 0.5),
            ("blocks.2.attn.hook_attn_scores", lambda s, hook: s / 2),
        ]

    with torch.no_grad(), qkv.hooks(model, fwd_hooks=hooks()):
        ours = model(ids).logits
    with torch.no_grad():
        theirs = lens(eager, monkeypatch, modeling_llama, hooks()).to(torch.float64)(ids).logits
    assert shapes == [(2, 11, 3, 64), (2, 11, 3, 64)]
    torch.testing.assert_close(ours, theirs, atol=1e-7, rtol=0)  # eager's rotary tables in float32 in both
    assert (ours - model(ids).logits.detach()).abs().max() > 1e-3
    with pytest.raises(KeyError, match=r"'blocks.0.attn.hook_q' is not a hook point.*\{hook_rot_q, hook_rot_k, hook_v"):
        qkv.run_with_hooks(model, ids, fwd_hooks=[("blocks.0.attn.hook_q", zero_head)])


def test_hooks_fire_at_every_decoding_step_of_generate(smollm2):
    model, _ = smollm2
    ids = torch.randint(100, 40000, (1, 6), generator=torch.Generator().manual_seed(1))
    rows = []
    with qkv.hooks(model, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, hook: rows.append(tuple(p.shape)))]):
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert rows == [(1, 9, 6, 6), (1, 9, 1, 7), (1, 9, 1, 8)]  # the prompt, then one row a step against the cache


def test_run_with_cache_holds_every_point_as_transformer_lens_keys_them(minilm, monkeypatch):
    model, eager, batch = minilm
    with torch.no_grad():
        out, cache = qkv.run_with_cache(model, **batch)
    points = ("q", "k", "v", "attn_scores", "pattern", "z")
    assert len(cache) == 6 * 6 and set(cache) == {f"blocks.{l}.attn.hook_{p}" for l in range(6) for p in points}
    torch.testing.assert_close(out.last_hidden_state, hidden(model, batch), **TOL)
    with torch.no_grad():
        weights = eager(**batch, output_attentions=True).attentions
    for layer in (0, 5):
        torch.testing.assert_close(cache["pattern", layer], weights[layer], **TOL)  # (name, layer) keys
    assert cache["attn", -1] is cache["blocks.5.attn.hook_pattern"] and cache["attn_logits", 2] is cache["attn_scores", 2]
    with qkv.record(model, layers=LAYER, hooks=("attn_scores", "z")) as rec:
        hidden(model, batch)
    torch.testing.assert_close(cache["attn_scores", LAYER], rec["attn_scores", LAYER], **TOL)
    torch.testing.assert_close(cache["z", LAYER], rec["z", LAYER], **TOL)
    assert not cache["z", 0].requires_grad


def test_run_with_cache_names_filter_device_and_batch_dim(minilm):
    model, _, batch = minilm
    one = {key: value[:1] for key, value in batch.items()}
    _, cache = qkv.run_with_cache(model, **one, names_filter=lambda name: name.endswith("hook_z"), remove_batch_dim=True)
    assert sorted(cache) == [f"blocks.{l}.attn.hook_z" for l in range(6)] and cache["z", 0].shape == (one["input_ids"].shape[1], 12, 32)
    _, cache = qkv.run_with_cache(model, **batch, names_filter=["blocks.1.attn.hook_v", "blocks.2.attn.hook_pattern"], device="cpu")
    assert sorted(cache) == ["blocks.1.attn.hook_v", "blocks.2.attn.hook_pattern"]
    _, cache = qkv.run_with_cache(model, **batch, names_filter="blocks.4.attn.hook_z")
    assert list(cache) == ["blocks.4.attn.hook_z"]
    with pytest.raises(KeyError, match="blocks.1.attn.hook_pattern.*not recorded"):
        cache["pattern", 1]
    with pytest.raises(ValueError, match="remove_batch_dim needs a batch of one"):
        qkv.run_with_cache(model, **batch, names_filter="blocks.4.attn.hook_z", remove_batch_dim=True)
    with pytest.raises(NotImplementedError, match="incl_bwd"):
        qkv.run_with_cache(model, **batch, incl_bwd=True)
    with pytest.raises(KeyError, match="names_filter: 'blocks.0.hook_resid_post' is not a hook point"):
        qkv.run_with_cache(model, **batch, names_filter=["blocks.0.hook_resid_post"])


def test_run_with_cache_inside_hooks_caches_what_the_hooks_left(minilm):
    model, _, batch = minilm
    with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", zero_head)]):
        _, cache = qkv.run_with_cache(model, **batch, names_filter=f"blocks.{LAYER}.attn.hook_pattern")
    assert bool((cache["pattern", LAYER][:, HEAD] == 0).all()) and bool((cache["pattern", LAYER][:, 0].sum(-1) > 0.99).all())


def test_backward_hooks_on_one_point_as_transformer_lens_runs_them(minilm, monkeypatch):
    model, eager, batch = minilm
    name = f"blocks.{LAYER}.attn.hook_z"
    halve = lambda g, hook: g / 2

    def grads(m, fwd, bwd, block=None):
        m.embeddings.word_embeddings.weight.grad = None
        seen = []
        bwd = [(n, (lambda g, hook: seen.append(g.clone())) if fn is None else fn) for n, fn in bwd]
        with block(m, fwd, bwd) if block else contextlib.nullcontext():
            if not block:
                lens(m, monkeypatch, modeling_bert, fwd, bwd)
            (m(**batch).last_hidden_state[real(batch)] ** 2).sum().backward()
        monkeypatch.undo()
        return m.embeddings.word_embeddings.weight.grad.clone(), seen

    double = lambda z, hook: z * 2
    cases = [
        ([], [(name, halve), (name, None)]),  # each sees the same gradient; the last non-None return wins
        ([], [(name, halve), (name, halve)]),  # halved once, not twice
        ([(name, double)], [(name, lambda g, hook: torch.ones_like(g))]),  # the return replaces the gradient
    ]  # at the point's input, before the forward hook's doubling
    for fwd, bwd in cases:
        ours, our_seen = grads(model, fwd, bwd, block=lambda m, f, b: qkv.hooks(m, fwd_hooks=f, bwd_hooks=b))
        theirs, their_seen = grads(eager, fwd, bwd)
        torch.testing.assert_close(ours, theirs, **TOL)
        assert len(our_seen) == len(their_seen)
        for a, b in zip(our_seen, their_seen):
            torch.testing.assert_close(a, b, **TOL)


def test_in_place_edits_never_reach_a_tensor_autograd_or_a_cache_keeps(minilm, smollm2):
    model, _, batch = minilm
    for point in ("q", "k", "v", "z"):
        def zero_in_place(t, hook):
            t[:, 0] = 0

        with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_{point}", zero_in_place)]):
            out = model(**batch).last_hidden_state
        out.sum().backward()  # no "modified by an inplace operation"
        with torch.no_grad(), qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_{point}", lambda t, hook: t.index_fill(1, torch.tensor([0]), 0))]):
            torch.testing.assert_close(out.detach(), model(**batch).last_hidden_state, **TOL)  # as a returned change
    llm, _ = smollm2
    ids = torch.randint(100, 40000, (1, 6), generator=torch.Generator().manual_seed(2))
    for name in ("blocks.3.attn.hook_v", "blocks.3.attn.hook_rot_k"):
        with pytest.raises(ValueError, match=r"come from the KV cache.*use_cache=False"):
            with qkv.hooks(llm, fwd_hooks=[(name, lambda t, hook: t.mul_(2))]):
                llm.generate(ids, max_new_tokens=2, do_sample=False)
        with qkv.hooks(llm, fwd_hooks=[(name, lambda t, hook: t.mul_(2))]):
            llm.generate(ids, max_new_tokens=2, do_sample=False, use_cache=False)


@pytest.mark.parametrize("order", ["ablate-then-patch", "patch_z-then-patch"])
def test_an_idle_pattern_hook_changes_no_edit(minilm, order):
    model, _, batch = minilm
    n = batch["input_ids"].shape[1]
    patch = qkv.edits.PatchPattern(HEAD, [1, 2], torch.full((1, 1, 2, n), 1.0 / n, dtype=torch.float64))
    first = AblateHeads(HEAD) if order == "ablate-then-patch" else qkv.edits.PatchZ(HEAD, [1, 2], torch.ones(1, 2, 1, 32, dtype=torch.float64))
    with qkv.edit(model, {LAYER: [first, patch]}):
        want = hidden(model, batch)
        with qkv.hooks(model, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_pattern", lambda p, hook: None)]):
            got = hidden(model, batch)
    torch.testing.assert_close(got, want, **TOL)


def test_ctx_lasts_across_blocks_until_contexts_are_cleared(minilm):
    model, _, batch = minilm
    name = f"blocks.{LAYER}.attn.hook_z"

    def count(z, hook):
        hook.ctx["n"] = hook.ctx.get("n", 0) + 1

    for _ in range(3):
        with torch.no_grad():
            qkv.run_with_hooks(model, **batch, fwd_hooks=[(name, count)])
    seen = []
    with torch.no_grad():
        qkv.run_with_hooks(model, **batch, fwd_hooks=[(name, lambda z, hook: seen.append(dict(hook.ctx)))], clear_contexts=True)
        qkv.run_with_hooks(model, **batch, fwd_hooks=[(name, lambda z, hook: seen.append(dict(hook.ctx)))])
    assert seen == [{"n": 3}, {}]  # as TransformerLens' HookPoint keeps it; cleared when asked


def test_hooks_kept_after_the_block_until_reset_hooks(minilm):
    model, _, batch = minilm
    name = f"blocks.{LAYER}.attn.hook_z"
    fired = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # kept hooks: no warning that bwd_hooks never fire
            out = qkv.run_with_hooks(model, **batch, fwd_hooks=[(name, lambda z, hook: fired.append("fwd"))],
                                     bwd_hooks=[(name, lambda g, hook: fired.append("bwd"))], reset_hooks_end=False)  # fmt: skip
        out.last_hidden_state.sum().backward()
        hidden(model, batch)  # the forward hook is still on the model
        assert fired == ["fwd", "bwd", "fwd"]
    finally:
        qkv.reset_hooks(model)
    out = model(**batch).last_hidden_state
    out.sum().backward()
    assert fired == ["fwd", "bwd", "fwd"]  # removed, backward hooks of the earlier graph included


def test_hooks_kept_on_a_model_go_with_it(minilm):
    import gc
    import weakref

    from qkv.integrations.transformers_edits import KEPT

    model, _, batch = minilm
    other = copy.deepcopy(model)
    captured = torch.zeros(3)
    probe = weakref.ref(captured)
    with qkv.hooks(other, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", lambda z, hook, t=captured, m=other: None)],
                   reset_hooks_end=False):  # fmt: skip
        pass
    assert len(KEPT) == 1
    del other, captured
    gc.collect()
    assert len(KEPT) == 0 and probe() is None  # the model, its kept hooks and what they hold: freed together
    kept = torch.zeros(3)
    probe = weakref.ref(kept)
    for _ in range(3):
        qkv.run_with_hooks(model, **batch, fwd_hooks=[(f"blocks.{LAYER}.attn.hook_z", lambda z, hook, t=kept: None)],
                           reset_hooks_end=False)  # fmt: skip
        qkv.reset_hooks(model)
    del kept
    gc.collect()
    assert len(KEPT) == 0 and probe() is None  # reset_hooks lets go of them


def test_hooks_run_in_the_order_they_were_added(minilm):
    model, _, batch = minilm
    name, order = f"blocks.{LAYER}.attn.hook_z", []
    try:
        with qkv.hooks(model, fwd_hooks=[(name, lambda z, hook: order.append("outer"))]):
            with qkv.hooks(model, fwd_hooks=[(name, lambda z, hook: order.append("kept"))], reset_hooks_end=False):
                hidden(model, batch)
            hidden(model, batch)
        hidden(model, batch)
    finally:
        qkv.reset_hooks(model)
    assert order == ["outer", "kept", "outer", "kept", "kept"]


def test_reset_hooks_removes_every_hook_and_clears_contexts(minilm):
    model, _, batch = minilm
    name, fired = f"blocks.{LAYER}.attn.hook_z", []

    def count(z, hook):
        fired.append(hook.name)
        hook.ctx["n"] = hook.ctx.get("n", 0) + 1

    with qkv.hooks(model, fwd_hooks=[(name, count)]):
        hidden(model, batch)
        qkv.reset_hooks(model)  # as TransformerLens', the open block's hooks too
        hidden(model, batch)
    assert fired == [name]
    seen = []
    qkv.run_with_hooks(model, **batch, fwd_hooks=[(name, lambda z, hook: seen.append(dict(hook.ctx)))])
    assert seen == [{}]  # contexts cleared, as TransformerLens' reset_hooks does by default
    qkv.run_with_hooks(model, **batch, fwd_hooks=[(name, count)], reset_hooks_end=False)
    model.set_attn_implementation("eager")
    try:
        qkv.reset_hooks(model)  # whatever the model runs now
    finally:
        model.set_attn_implementation("qkv")
    hidden(model, batch)
    assert fired == [name, name]


def test_cache_keys_and_methods_as_transformer_lens_activation_cache(minilm):
    model, _, batch = minilm
    _, cache = qkv.run_with_cache(model, **batch)
    full = cache["blocks.0.attn.hook_pattern"]
    for key in ("pattern0", ("pattern", 0, "attn"), ("pattern", 0, "a"), ("attn", 0), ("pattern", -6), "attn0"):
        assert cache[key] is full, key
    assert cache["key", 2] is cache["k2"] is cache["blocks.2.attn.hook_k"] and cache["value", 1] is cache["v1a"]
    assert cache["query", 0] is cache["blocks.0.attn.hook_q"]
    with pytest.raises(KeyError, match="not attention's"):
        cache["pattern", 0, "mlp"]
    with pytest.raises(KeyError, match="resid_pre"):
        cache["resid_pre", 0]
    stacked = cache.stack_activation("pattern")
    assert stacked.shape == (6, *full.shape) and stacked[4] is not None and bool((stacked[2] == cache["pattern", 2]).all())
    assert cache.stack_activation("z", layer=2).shape[0] == 2
    assert cache.to("cpu") is cache
    with pytest.raises(ValueError, match="needs a batch of one"):
        cache.remove_batch_dim()
    _, one = qkv.run_with_cache(model, **{k: v[:1] for k, v in batch.items()}, names_filter="blocks.0.attn.hook_z")
    assert one.remove_batch_dim()["z", 0].dim() == 3


def test_names_filter_lists_leave_out_names_qkv_has_no_point_for(minilm):
    model, _, batch = minilm
    names = ["blocks.0.attn.hook_pattern", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]
    _, cache = qkv.run_with_cache(model, **batch, names_filter=names)
    assert list(cache) == ["blocks.0.attn.hook_pattern"]  # as TransformerLens' bridge: the others left out
    with pytest.raises(KeyError, match="blocks.0.hook_resid_post' is not a hook point"):
        qkv.run_with_cache(model, **batch, names_filter=names[1:])  # none of them: said, not an empty cache


def test_kept_caching_hooks_move_and_unbatch_every_run(minilm):
    model, _, batch = minilm
    one = {k: v[:1] for k, v in batch.items()}
    try:
        _, cache = qkv.run_with_cache(model, **one, names_filter="blocks.0.attn.hook_z", device="cpu",
                                      remove_batch_dim=True, reset_hooks_end=False)  # fmt: skip
        first = cache["z", 0]
        hidden(model, one)
        assert cache["z", 0] is not first and cache["z", 0].shape == first.shape == (one["input_ids"].shape[1], 12, 32)
    finally:
        qkv.reset_hooks(model)


def test_cross_attention_and_rotary_are_told_apart():
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.detr import modeling_detr as detr
    from transformers.models.gemma4 import modeling_gemma4 as gemma4
    from transformers.models.parakeet import modeling_parakeet as parakeet

    from qkv.integrations.transformers_edits import _crosses
    from qkv.integrations.transformers_hooks import _rotates

    assert _rotates(modeling_llama.LlamaAttention) and _rotates(gemma4.Gemma4VisionAttention)
    assert not _rotates(bert.BertSelfAttention) and not _rotates(detr.DetrSelfAttention)
    assert not _rotates(parakeet.ParakeetEncoderAttention)  # relative positions, not a rotation

    class MllamaTextCrossAttention(torch.nn.Module):
        pass

    marked = torch.nn.Module()
    marked.is_cross_attention = True
    assert _crosses(MllamaTextCrossAttention()) and _crosses(marked) and not _crosses(torch.nn.Module())


def test_hooked_transformer_keywords_and_names_are_answered(minilm):
    from qkv.integrations.lens_names import get_act_name

    model, _, batch = minilm
    with pytest.raises(TypeError, match="return_type is TransformerLens' HookedTransformer's.*logits"):
        qkv.run_with_hooks(model, **batch, return_type="loss")
    with pytest.raises(TypeError, match="prepend_bos"):
        qkv.run_with_cache(model, **batch, prepend_bos=True)
    assert get_act_name("pattern", 3) == "blocks.3.attn.hook_pattern" == get_act_name("attn3")
    assert get_act_name("k", 6, "a") == "blocks.6.attn.hook_k" and get_act_name("blocks.1.attn.hook_z") == "blocks.1.attn.hook_z"
    with pytest.raises(KeyError, match="'resid_pre' is not an attention point"):
        get_act_name("resid_pre", 2)
    seen = []
    qkv.run_with_hooks(model, **batch, fwd_hooks=[(get_act_name("z", 2), lambda z, hook: seen.append(hook.name))])
    assert seen == ["blocks.2.attn.hook_z"]
