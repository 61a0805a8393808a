"""The additive score tile by tile, with a hand-written backward, for the online-softmax engine.

Shape legend: ``b`` batch (any leading dims), ``g`` KV heads, ``r = h / g`` query heads per
KV head, ``i`` query length, ``j`` key length, ``n`` the additive score's hidden size;
``it``/``jt`` the sides of a softmax tile, ``ib``/``jb`` the sides of a sub-block of it.

Bahdanau et al. 2015 (appendix A.1.2) / Luong et al. 2015 ("concat") score a query and a key
as ``s_ij = wᵀ tanh(a_i + b_j)``, where ``a = W_q q`` and ``b = W_k k`` are projected once per
call by ``Additive.prepare`` (autograd carries the gradient from ``a``, ``b`` on to
``W_q``, ``W_k`` and the inputs). What remains per pair is an ``n``-vector: a tile of
logits needs an ``(it, jt, n)`` intermediate, which is where almost all the time goes.
Two choices make it cheap:

1. **tanh without tanh.** ``tanh(x) = 2σ(2x) - 1``, so with ``u_ij = σ(2a_i + 2b_j)``::

       s_ij = (2w)ᵀ u_ij - Σ_n w_n

   and since ``σ(2a + 2b) = 1 / (1 + e^{-2a} e^{-2b})``, the exponentials can be taken once
   per call, ``A = e^{-2a}`` ``(i, n)`` and ``B = e^{-2b}`` ``(j, n)``, leaving per pair
   ``u = 1 / (1 + A_i B_j)``: one broadcast ``addcmul``, one in-place ``reciprocal_`` and
   one matrix-vector product per tile. On the benchmark machine (float32, AVX-512) that is
   about 0.13 ns per element where ``tanh`` alone takes 3 to 6 (``sigmoid`` 0.25 to 0.35). It is
   also accurate: ``u`` is within a few ulp relative, ``2u - 1`` within a few ulp of 1
   absolute, which is what ``tanh`` loses too once summed over ``n`` (checked against
   float64 in the test suite). Saturation is exact: ``A_i B_j``
   underflows to 0 (``u = 1``) or overflows to ``inf`` (``u = 0``), never ``0 · inf``,
   as long as ``A`` and ``B`` themselves are finite and non-zero, i.e. ``|2a|, |2b|`` below
   :func:`_exp_limit`. Inputs beyond it (a projection of 40 or more in float32, where
   every ``tanh`` is ±1 anyway) take ``u = sigmoid_(2a + 2b)`` instead, a broadcast add and
   an in-place sigmoid: slower, same formulas from there on.

2. **The backward by hand**, instead of autograd's chain of full-size temporaries. With the
   incoming logit gradient ``g_ij = ∂L/∂s_ij``, ``t = 2u - 1`` and ``1 - t² = 4u(1 - u)``::

       ∂L/∂w   = Σ_ij g_ij t_ij = 2 Σ_ij g_ij u_ij - Σ_ij g_ij        (a transposed matvec)
       ∂L/∂a_i = 4w ∘ Σ_j g_ij u_ij (1 - u_ij)                        (a reduction over j)
       ∂L/∂b_j = 4w ∘ Σ_i g_ij u_ij (1 - u_ij)                        (a reduction over i)

   The factors ``2``, ``4w`` and the ``Σ g`` term are applied once per call, not per tile.

The ``(ib, jb, n)`` intermediate lives in one scratch buffer, allocated once per call and
reused by every sub-block. Its size trades cache locality against the number of passes:
with one thread, :data:`SUB_ELEMENTS` keeps it near the L2 cache between its passes
(addcmul, reciprocal, matvec, reductions); with several, :data:`SUB_ELEMENTS_THREADED`
makes fewer, larger passes, since each one is a parallel region that a busy machine makes
expensive. The softmax tiles themselves (``it``, ``jt``) are the caller's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..._trace import concrete, tracing
from ...masks import Tile
from ...scores import Additive, Score

#: Elements of one ``(ib, jb, n)`` sub-block summed over batch and heads, with one intra-op
#: thread: 2 MiB in float32, about one core's L2 cache (1 MiB) plus what L3 streams in.
#: Measured at i = 1024, n = 128, one thread, forward + backward: 2^16 and 2^17 are 2x and
#: 1.4x slower than 2^19 (the Python loop's per-op overhead shows), 2^21 1.7x, 2^22 2.8x.
SUB_ELEMENTS = 2**19
#: The same with several intra-op threads. Each pass over a sub-block is then an OpenMP
#: parallel region, and on a busy machine every region waits for its threads to be
#: scheduled (milliseconds each), so fewer, larger passes win. Measured at i = 2048, two
#: threads, load average 3 to 8 on 2 cores, forward + backward against the materialised
#: path (three runs, each interleaved): 2^19 1.95x, 2^21 1.1x and 1.6x, 2^22 1.05x and
#: 0.76x, 2^23 0.92x, 2^24 0.87x and 0.92x. With one thread the same sizes cost 1.7x to
#: 3.8x of 2^19, so this is kept no larger than the busy case needs.
SUB_ELEMENTS_THREADED = 2**22


def _budget() -> int:
    """Elements of one sub-block (see :data:`SUB_ELEMENTS_THREADED` for why it depends on threads)."""
    if tracing():  # dynamo does not trace torch.get_num_threads: the single thread's budget, the smaller
        return SUB_ELEMENTS
    return SUB_ELEMENTS if torch.get_num_threads() == 1 else SUB_ELEMENTS_THREADED


def applies(score: Score) -> bool:
    """True for :class:`qkv.scores.Additive` itself and subclasses that keep its formula."""
    kind = type(score)
    return isinstance(score, Additive) and kind.prepare is Additive.prepare and kind.pairwise is Additive.pairwise


def _sides(rows: int, it: int, jt: int) -> tuple[int, int]:
    """``(ib, jb)``: near-square sub-blocks within the budget (:func:`_budget`) that split the tile evenly."""
    pairs = max(1, _budget() // rows)  # rows = batch x heads x n
    jb = min(jt, max(1, math.isqrt(pairs)))
    ib = min(it, max(1, pairs // jb))
    jb = -(-jt // -(-jt // jb))  # as many sub-blocks as before, of equal width
    ib = -(-it // -(-it // ib))
    return ib, jb


def _amax(x: Tensor) -> float:
    return float(x.abs().amax()) if x.numel() else 0.0


def _exp_limit(dtype: torch.dtype) -> float:
    """Largest ``|x|`` for which ``e^x`` and ``e^-x`` are finite, non-zero normal numbers, with margin."""
    return math.log(torch.finfo(dtype).max) - 8.0  # 80.7 in float32, 701.8 in float64


class AdditiveTiles:
    """One call's additive logits and their gradients, tile by tile (see the module docstring).

    ``a (..., g, r, i, n)`` and ``b (..., g, 1, j, n)`` are the prepared queries and keys
    (``_split`` layout), ``w (n,)`` the score's ``v``. Half-precision inputs are combined in
    float32, as the reference backend does.
    """

    def __init__(self, a: Tensor, b: Tensor, w: Tensor, *, grad: bool = False, grad_w: bool = False):
        dtype = torch.promote_types(a.dtype, torch.float32)
        a2, b2 = a.to(dtype) * 2, b.to(dtype) * 2  # σ(2x) gives tanh(x)
        # the sigmoid form is exact for every input; the faster exp form needs their range,
        # which is not read while tracing or on meta tensors (qkv._trace)
        self.exp_form = concrete(a2, b2) and bool(max(_amax(a2), _amax(b2)) <= _exp_limit(dtype))
        # u = 1 / (1 + x_a x_b) in exp form, u = σ(x_a + x_b) otherwise
        x_a, x_b = (torch.exp(-a2), torch.exp(-b2)) if self.exp_form else (a2, b2)
        self.x_a, self.x_b = x_a.unsqueeze(-2), x_b.unsqueeze(-3)  # (..., g, r, i, 1, n), (..., g, 1, 1, j, n)
        self.one = torch.ones((), dtype=dtype, device=a.device)
        w = w.detach().to(dtype)
        self.w, self.w2, self.w_sum = w, w * 2, w.sum()
        self.lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])  # (..., g, r)
        n = a.shape[-1]
        self.rows = math.prod(self.lead) * n
        self.buf = torch.empty(0, dtype=dtype, device=a.device)  # grown to the largest sub-block
        self.grad, self.grad_w = grad, grad_w
        if grad:
            self.da, self.db = torch.zeros_like(a2), torch.zeros_like(b2)
            self.dw_u = torch.zeros(n, dtype=dtype, device=a.device)  # Σ g u
            self.g_sum = torch.zeros((), dtype=dtype, device=a.device)  # Σ g

    def _blocks(self, t: Tile):
        """Yield ``(rows, cols, u)`` per sub-block: ``u = σ(2a + 2b)`` of shape ``(..., g, r, ib, jb, n)``."""
        it, jt, n = t.i1 - t.i0, t.j1 - t.j0, self.x_a.shape[-1]
        ib, jb = _sides(self.rows, it, jt)
        for r0 in range(0, it, ib):
            r1 = min(r0 + ib, it)
            xa = self.x_a[..., t.i0 + r0 : t.i0 + r1, :, :]  # (..., g, r, ib, 1, n)
            for c0 in range(0, jt, jb):
                c1 = min(c0 + jb, jt)
                xb = self.x_b[..., t.j0 + c0 : t.j0 + c1, :]  # (..., g, 1, 1, jb, n)
                shape = (*self.lead, r1 - r0, c1 - c0, n)
                if self.buf.numel() < math.prod(shape):
                    self.buf = self.buf.new_empty(math.prod(shape))
                u = self.buf[: math.prod(shape)].view(shape)
                if self.exp_form:
                    torch.addcmul(self.one, xa, xb, out=u).reciprocal_()
                else:
                    torch.add(xa, xb, out=u).sigmoid_()
                yield slice(r0, r1), slice(c0, c1), u

    def logits(self, t: Tile) -> Tensor:
        """``wᵀ tanh(a_i + b_j)`` for the tile's pairs, ``(..., g, r, it, jt)``, without autograd."""
        n = self.x_a.shape[-1]
        s = torch.empty((*self.lead, t.i1 - t.i0, t.j1 - t.j0), dtype=self.w.dtype, device=self.w.device)
        for rows, cols, u in self._blocks(t):
            s[..., rows, cols] = (u.view(-1, n) @ self.w2).view(u.shape[:-1])
        return s.sub_(self.w_sum)

    def backward(self, t: Tile, g: Tensor) -> None:
        """Accumulate the gradients of ``Σ g ∘ logits(t)``; ``g (..., g, r, it, jt)`` is ``∂L/∂s`` on the tile."""
        if not self.grad:
            raise ValueError("grad: this AdditiveTiles was built with grad=False, so it keeps no gradients")
        n = self.x_a.shape[-1]
        g = g.to(self.w.dtype)
        if self.grad_w:
            self.g_sum += g.sum()
        for rows, cols, u in self._blocks(t):
            gs = g[..., rows, cols].contiguous()
            if self.grad_w:
                self.dw_u.addmv_(u.view(-1, n).T, gs.view(-1))
            u.addcmul_(u, u, value=-1.0)  # u (1 - u) = (1 - t²) / 4, in place
            u.mul_(gs.unsqueeze(-1))
            self.da[..., t.i0 + rows.start : t.i0 + rows.stop, :] += u.sum(-2)
            # over the sub-block's rows and the r query heads that share a key head
            self.db[..., t.j0 + cols.start : t.j0 + cols.stop, :] += u.sum((-4, -3)).unsqueeze(-3)

    def grads(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(∂L/∂a, ∂L/∂b, ∂L/∂w)`` accumulated so far (``∂L/∂w`` is None unless ``grad_w``)."""
        four_w = 4 * self.w
        dw = 2 * self.dw_u - self.g_sum if self.grad_w else None
        return self.da * four_w, self.db * four_w, dw
