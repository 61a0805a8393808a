"""Continuous batching for qkv's causal LM: requests arrive and finish at different steps, over one paged cache.

Shape legend: ``T`` tokens of a step (every running request's new tokens, packed in one row),
``h`` query heads, ``g`` KV heads, ``d`` head size, ``V`` vocabulary.

Each step runs the model once on a packed row ``(1, T)``: a newly admitted request brings its
whole prompt (a prefill chunk), a running one its last token (a decoding step); each token
carries its own position, and every attention layer writes its keys and values to the
request's pages and attends with :func:`qkv.paged_attention` (:class:`PagedStep`). A request
is admitted when the pool has pages for its whole length (taken then, as one run of
consecutive pages where the pool has one: the attention reads it as one matrix), and its
pages return to the pool the step it finishes, so a long request does not hold the others' memory and a short one leaves early
(Yu et al. 2022, "Orca"; Kwon et al. 2023, vLLM).

    from qkv.paged.serve import Request, serve

    done = serve(model, [Request("a", prompt_a, 20), Request("b", prompt_b, 5, arrival=3)], cache)

Greedy decoding gives each request the tokens ``model.generate`` gives it alone (tested).
:func:`serve` takes every request up front (each with the step it arrives at) and returns
when all are done. A server's own loop, which admits requests as they come, streams their
tokens and cancels them, runs a :class:`Server` a step at a time:

    from qkv.paged.serve import Server

    server = Server(model, cache, eos_id=eos)
    server.add(Request("a", prompt_a, 20))
    while server.busy:
        for name, token in server.step().items():   # one forward pass: each running request's next token
            ...                                       # stream it; server.add(...) or server.cancel(name) between steps
    server.done                                       # {name: prompt and its tokens} of every finished request

Under both, a step is one call of the model on a :class:`PagedStep`, which a loop written by
hand runs the same way (``ids (1, T)``: every request's new tokens in ``step.requests``' order):

    from qkv.paged.serve import PagedStep

    cache.add("a")
    cache.add("b")
    step = cache.plan({"a": len(prompt_a), "b": len(prompt_b)})  # each request's new tokens: here its prompt
    ids = torch.cat([prompt_a, prompt_b])[None]  # (1, T), in step.requests' order
    logits = model(ids, cache=PagedStep(cache, step))[0]  # (T, V)
    next_tokens = logits[step.qo_indptr[1:] - 1].argmax(-1)  # (R,) each request's last row

(A request planned with 0 new tokens has no row: plan only the requests that bring tokens when
reading each one's last row, or take ``step.qo_indptr[1:] > step.qo_indptr[:-1]`` with it.) If
the model raises, the step's tokens stay planned and unwritten: free those requests.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.checks import check_ids
from ..models.lm import CausalLM
from .errors import OutOfPages, pages as count_pages
from .kv_cache import PagedKVCache, Step
from .quant import Int8Pages


@dataclass(frozen=True)
class Request:
    """A prompt ``(i,)`` of token ids, how many tokens to add, and the step it arrives at."""

    name: Hashable
    prompt: Tensor
    max_new_tokens: int
    arrival: int = 0

    def __post_init__(self):
        p = self.prompt
        if not isinstance(p, Tensor) or p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            got = p.dtype if isinstance(p, Tensor) else type(p).__name__
            raise TypeError(f"request {self.name!r}: prompt: expected an integer tensor of token ids, got {got}")
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"request {self.name!r}: prompt: expected shape (i,) with at least one token (the first "
                             f"step's logits come from it), got {tuple(p.shape)}")  # fmt: skip
        for what, value, low in (("max_new_tokens", self.max_new_tokens, 1), ("arrival", self.arrival, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"request {self.name!r}: {what}: expected an int >= {low}, got {value!r}")

    @property
    def length(self) -> int:
        """Its length when done, prompt and every new token: what admission reserves pages for."""
        return self.prompt.numel() + self.max_new_tokens

    def pages(self, page_size: int) -> int:
        return -(-self.length // page_size)


class PagedLayer:
    """What one attention layer sees of a step: the tokens' positions, and its pages to write and read."""

    def __init__(self, cache: PagedKVCache, layer: int, step: Step):
        self.cache, self.layer, self.step = cache, layer, step
        self.positions = step.positions

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **options) -> Tensor:
        """``q (1, h, T, d)``, the step's new ``k, v (1, g, T, d)`` -> ``(1, h, T, e)``; ``options`` go to
        ``qkv.paged_attention`` (``sm_scale``, ...)."""
        if q.shape[0] != 1:  # the step's table has one row of tokens: row 0 alone would be written and attended
            raise ValueError(f"ids: a paged step runs one packed row (1, T), every request's new tokens end to end "
                             f"in step.requests' order, got {q.shape[0]} rows")  # fmt: skip
        self.cache.write(self.layer, self.step, k[0].transpose(0, 1), v[0].transpose(0, 1))
        out = self.cache.attend(self.layer, self.step, q[0].transpose(0, 1), **options)  # (T, h, e)
        return out.transpose(0, 1)[None]


class PagedStep:
    """A step as a decoder cache: one :class:`PagedLayer` per layer (``qkv.blocks.Encoder`` reads ``self_attn``)."""

    paged = True

    def __init__(self, cache: PagedKVCache, step: Step):
        self.positions = step.positions
        self.self_attn = [PagedLayer(cache, n, step) for n in range(cache.layers)]


class Server:
    """Continuous batching a step at a time: requests join whenever they are added and leave when done or cancelled.

    ``model`` and ``cache`` as for :func:`serve`. :meth:`add` queues a request (its ``arrival``
    is :func:`serve`'s clock, not read here); :meth:`step` admits queued requests, in the order
    added, while the pool has pages for their whole length (prompt and ``max_new_tokens``:
    admission reserves them, so no running request is ever evicted), runs the model once over
    every running request and returns each one's next greedy token; a request that reaches
    ``max_new_tokens`` or ``eos_id`` moves to :attr:`done` (``{name: prompt and tokens (i + n,)}``)
    and its pages return to the pool. :meth:`cancel` stops a request at once. A name stays
    taken while its request waits, runs or sits in :attr:`done` (``done.pop(name)`` frees it).
    """

    def __init__(self, model, cache: PagedKVCache, *, eos_id: int | None = None):
        _check_model(model, cache)
        self.model, self.cache, self.eos_id = model, cache, eos_id
        self.waiting: list[Request] = []  # added, not yet admitted: in the order added
        self.done: dict[Hashable, Tensor] = {}
        self._tokens: dict[Hashable, list[int]] = {}  # running: its tokens so far, prompt included
        self._left: dict[Hashable, int] = {}  # running: tokens still to generate
        self._final: dict[Hashable, int] = {}  # running: its length when done, pages reserved up to it

    @property
    def running(self) -> list:
        """The admitted requests' names, in the order admitted."""
        return list(self._tokens)

    @property
    def busy(self) -> bool:
        """Whether a request waits or runs: :meth:`step` has work."""
        return bool(self.waiting or self._tokens)

    def add(self, request: Request) -> None:
        """Queue ``request``; checked now (its length against the cache, its token ids against the model)."""
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a qkv.paged.serve.Request, got {type(request).__name__}")
        _check_request(self.model, self.cache, request)
        self._queue(request)

    def _queue(self, request: Request) -> None:
        """:meth:`add` past the request's own checks (:func:`serve` made them, for every request, before any step)."""
        name = request.name
        if name in self._tokens or name in self.done or any(r.name == name for r in self.waiting):
            raise ValueError(f"request {name!r}: a request of this name is waiting, running or in server.done "
                             "(done.pop(name) frees the name)")  # fmt: skip
        if name in self.cache.requests:
            raise ValueError(f"request {name!r} is already in the cache; the server adds each request itself")
        self.waiting.append(request)

    def cancel(self, name: Hashable) -> Tensor | None:
        """Stop request ``name``: a waiting one leaves the queue (None); a running one returns its tokens so far
        (prompt included, ``(i + n,)``) and its pages go back to the pool now."""
        for n, r in enumerate(self.waiting):
            if r.name == name:
                del self.waiting[n]
                return None
        if name not in self._tokens:
            raise KeyError(f"request {name!r} is neither waiting nor running")
        tokens = self._tokens.pop(name)
        del self._left[name], self._final[name]
        self.cache.free(name)
        return torch.tensor(tokens)

    @torch.no_grad()
    def step(self) -> dict:
        """``{name: token}``: one forward pass, every running request's next greedy token (requests admitted first).

        ``{}`` when nothing waits or runs. A request that has been added but can never be
        admitted (nothing runs to free pages, and the cache's other requests hold them) raises
        ``qkv.paged.OutOfPages`` (a ``RuntimeError``) and stays queued; so does one whose name the
        cache's other user took since :meth:`add` (``ValueError``: it runs once they free it). If the model raises, the
        step's requests cannot go on (their step was planned, its keys never written): every
        running request is cancelled, and the error propagates.
        """
        cache = self.cache
        while self.waiting and _fits(cache, self._final, self.waiting[0]):
            r = self.waiting[0]
            cache.add(r.name)  # first: a name another user of the cache took since add() raises here, r still queued
            self.waiting.pop(0)
            self._tokens[r.name] = r.prompt.tolist()
            self._left[r.name], self._final[r.name] = r.max_new_tokens, r.length
            cache.reserve(r.name, r.length)  # its whole length, as one run of pages
        # each request's tokens its pages lack: a running one's last, an admitted one's prompt (also one admitted by
        # a step that raised before its forward pass: fed only its last token, it lost the rest of its prompt)
        tokens = {name: seq[cache.length(name) :] for name, seq in self._tokens.items()}
        new = {name: len(seq) for name, seq in tokens.items()}
        if not new:
            if self.waiting:  # nothing runs, and the pool still lacks the first request's pages
                r = self.waiting[0]
                need = r.pages(cache.page_size)
                raise OutOfPages(
                    f"request {r.name!r} needs {count_pages(need)} but only {cache.free_pages} of "
                    f"{cache.num_pages} are free, and no request of this server is running to free more; the "
                    f"cache's other requests ({list(cache.requests)[:4]}) hold the rest: free them first",
                    needed=need, free=cache.free_pages, num_pages=cache.num_pages,
                )  # fmt: skip
            return {}
        try:
            step = cache.plan(new)
            ids = torch.tensor([t for name in step.requests for t in tokens[name]], device=cache.device)[None]
            logits = self.model(ids, cache=PagedStep(cache, step))[0]  # (T, V)
        except BaseException:
            for name in self.running:
                self.cancel(name)
            raise
        picks = logits.index_select(0, step.qo_indptr[1:] - 1).argmax(-1).tolist()
        out = {}
        for name, token in zip(step.requests, picks):
            self._tokens[name].append(token)
            self._left[name] -= 1
            out[name] = token
            if self._left[name] == 0 or token == self.eos_id:
                self.done[name] = torch.tensor(self._tokens.pop(name))  # eos included, when it stopped the request
                del self._left[name], self._final[name]
                cache.free(name)  # its pages go back now
        return out


@torch.no_grad()
def serve(model, requests: list[Request], cache: PagedKVCache, *, eos_id: int | None = None) -> dict:
    """``{name: prompt followed by its greedy tokens (i + n,)}`` for every request, run with continuous batching.

    ``model`` is a :class:`qkv.models.CausalLM` (rotary, learned, sinusoidal or no positions;
    or ``attention="latent"``, whose latents fit ``qkv.PagedKVCache(..., latent_dim=c)``);
    ``cache`` a :class:`qkv.PagedKVCache` with one layer per model layer, of the model's KV heads,
    head size and dtype (or a float8 dtype, read as the model's). Request ``r`` joins at step
    ``r.arrival`` (a :class:`Server` step is one forward pass); it stops after
    ``max_new_tokens`` or at ``eos_id`` (which its tokens then end with). Requests wait (in
    arrival order) while the pool lacks the pages for their whole length (prompt and
    ``max_new_tokens``: admission reserves it, so no running request is ever evicted). Model,
    cache and every request are checked before the first step: a request that can never run
    raises before the others have run.
    """
    server = Server(model, cache, eos_id=eos_id)  # checks the model and the cache
    for r in requests:
        _check_request(model, cache, r)
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise ValueError("requests: names must be distinct")
    held = [name for name in names if name in cache.requests]
    if held:
        raise ValueError(f"requests: {held[:4]} are already in the cache; serve adds each request itself")
    pending = sorted(requests, key=lambda r: r.arrival)
    clock = 0
    try:
        while pending or server.busy:
            while pending and pending[0].arrival <= clock:
                server._queue(pending.pop(0))
            if not server.busy:  # nothing has arrived yet
                clock = pending[0].arrival
                continue
            server.step()
            clock += 1
    finally:  # an error leaves no request of this call holding pages
        for name in server.running:
            server.cancel(name)
    return server.done


def _check_model(model, cache: PagedKVCache) -> None:
    """Errors a caller can act on, before any step: else the first layer's attention raises about ``q`` (which
    the caller never sees)."""
    if not isinstance(model, CausalLM):
        raise TypeError("model: expected a qkv.models.CausalLM (a transformers model runs continuous batching as "
                        "qkv.integrations.transformers_serving.for_continuous_batching(model).generate_batch(...)), "
                        f"got {type(model).__name__}")  # fmt: skip
    c, pages = model.config, cache.pools[0]
    if cache.layers != c.layers:
        raise ValueError(f"cache: expected {c.layers} layers (the model's), got {cache.layers}")
    want = model.out.weight.dtype  # the dtype of its queries, keys and values
    if pages.dtype != want and pages.dtype.itemsize > 1:  # float8 pages are read as the queries' dtype
        quantized = ", quantized=True" if isinstance(pages, Int8Pages) else ""
        raise TypeError(f"cache: computes in {pages.dtype} but the model in {want}: make it qkv.PagedKVCache(..., "
                        f"dtype={want}{quantized}), a float8 cache, or call model.to({pages.dtype})")  # fmt: skip
    if c.attention == "multi_head":  # latent attention's pool is checked by its own writes
        shape, got = (c.kv_heads or c.heads, c.dim // c.heads), (pages.kv_heads, pages.head_dim)
        if got != shape:
            raise ValueError(f"cache: expected kv_heads={shape[0]}, head_dim={shape[1]} (the model's), "
                             f"got kv_heads={got[0]}, head_dim={got[1]}")  # fmt: skip


def _check_request(model, cache: PagedKVCache, r: Request) -> None:
    """A request that can never run, refused before any step: else it raises once others have run, their tokens lost."""
    c = model.config
    check_ids(f"request {r.name!r}: prompt", r.prompt, c.vocab, dims=1)
    n, i = r.pages(cache.page_size), r.prompt.numel()
    if n > cache.num_pages:
        raise ValueError(f"request {r.name!r}: {r.length} tokens (prompt {i} + max_new_tokens {r.max_new_tokens}) "
                         f"take {n} pages of {cache.page_size}, more than the cache's {cache.num_pages}: make "
                         "num_pages larger or the request shorter")  # fmt: skip
    if c.positional == "learned" and r.length - 1 > c.max_len:  # the last token is never fed back
        raise ValueError(f"request {r.name!r}: prompt {i} + max_new_tokens {r.max_new_tokens} feed the model "
                         f"{r.length - 1} positions (every token but the last), more than max_len={c.max_len} of "
                         "its learned positions")  # fmt: skip


def _fits(cache: PagedKVCache, final: dict, request: Request) -> bool:
    """Whether the pool holds ``request``'s pages to its last token, after every running request's growth.

    Admission reserves a request's whole length (prompt and every new token), so a step
    never runs out of pages and no running request has to be evicted.
    """
    P = cache.page_size
    whole = request.pages(P)  # at most num_pages: _check_request refused longer requests
    growth = sum(-(-n // P) - (len(cache.pages_of(name)) if name in cache.requests else 0) for name, n in final.items())
    return growth + whole <= cache.free_pages
