"""Property tests: random calls of ``qkv.attention`` against a float64 oracle written here.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``r = h / g`` query heads per
KV head, ``i`` query length, ``j`` key length, ``d`` query size (``dk`` the key size where a
score lets it differ), ``e`` value size, ``n`` the additive score's hidden size.

hypothesis draws whole calls: the layout (``(i, d)``, ``(h, i, d)``, ``(b, h, i, d)``,
``(a, b, h, i, d)``), grouped KV heads, ``i ≠ j``, ``d ≠ e``; a score (dot, scaled dot,
general, additive, location); a mask built from every lazy kind (causal, window, offsets,
lengths, starts, documents) and dense tensors, combined with ``&`` and ``|``, plus ``causal=True``; a dense
bias (sometimes learned) or a lazy one (ALiBi, T5 buckets); a scale; attention sinks and a
``score_mod`` (soft-capping, a learned per-head relative slope read from a closure, one that
reads the batch index); ``return_weights``, ``weights_for`` and ``return_lse``; float64 or float32; nan keys
and inf values at the keys no query may see (forward calls); and the backends' tile, block and chunk sizes
(and the padded split's thresholds), patched small for the call so that a 9-position sequence crosses every edge. Every backend
that ``qkv.backends.choose`` accepts for the call, and ``"auto"``, must agree with
:func:`oracle`, which computes the definition in float64 with plain tensor ops (its own
score formulas, ALiBi slopes and T5 buckets, bottom-right offsets and masks): outputs,
weights, ``attention_weights``, and the gradients of q, k, v, of a learned dense bias, of
the score's parameters, of the T5 table, of the sinks and of the tensor a ``score_mod`` reads.
On every ``"auto"`` call, ``qkv.explain`` must name the backend and engine the call takes
(recorded at their entry points, :class:`Taken`).

Size: 400 + 250 examples make about 2500 qkv calls (each test asserts its share, so a
strategy that stops reaching the backends fails), about 15 s of CPU on a quiet machine.
Reproducible: ``derandomize=True`` and no example database, so every run (and CI) makes
the same calls. A failure prints the minimal example hypothesis shrinks it to, as a
:class:`Case` (everything needed to rebuild the call: the tensors come from its ``seed``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import reference as ref
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qkv
from qkv import backends, checks
from qkv.backends import engines, local, padded_rows, sdpa_plain
from qkv.backends.engines import fused_blocks, online_softmax
from qkv.backends.tiling import additive_tiles, bias_grad
from qkv.backends.tiling import weights_from_lse as weights_module
from qkv.positional import ALiBi, RelativePositionBias

BACKENDS = (*backends.PREFERENCE, "auto")
#: examples per property (each makes one call per backend that runs it, plus the oracle)
EXAMPLES = {"forward": 400, "gradients": 250}
#: fewest qkv calls each property must have made (a check that the run tested what it says)
MIN_CALLS = {"forward": 1500, "gradients": 800}


def _settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],  # no "explain": noise
    )


# --------------------------------------------------------------------------- the calls


@dataclass(frozen=True)
class MaskLeaf:
    kind: str  # "causal", "window", "offsets", "lengths", "starts", "documents", "dense"
    args: tuple = ()  # window (left, right); offsets (lo, hi); lengths per batch row; ids_q, ids_k; dense shape + seed


@dataclass(frozen=True)
class MaskNode:
    op: str  # "&" or "|"
    a: MaskLeaf | MaskNode
    b: MaskLeaf | MaskNode
    dense_left: bool = False  # write it as `tensor & mask` (Mask.__rand__ / __ror__)


@dataclass(frozen=True)
class Case:
    """One call, described without tensors (they come from ``seed``)."""

    rank: int  # 2: (i, d); 3: (h, i, d); 4: (b, h, i, d); 5: (a, b, h, i, d)
    lead: tuple[int, ...]  # leading dims before the heads
    g: int
    r: int
    i: int
    j: int
    d: int
    dk: int  # key size (== d for the dot family)
    e: int
    dtype: torch.dtype
    score: str  # dot, scaled_dot, general, additive, location
    hidden: int  # additive n
    mask: MaskLeaf | MaskNode | None
    causal: bool
    bias: tuple | None  # ("dense", shape, learned) | ("alibi", heads) | ("t5", heads, buckets, max_distance, bidirectional, learned)
    scale: float | None
    return_weights: bool
    weights_for: tuple | None  # (heads, rows) as drawn (lists, slices, ints) or None
    sinks: tuple | None = None  # (learned,) : one sink logit per query head
    score_mod: tuple | None = None  # ("softcap", c) | ("relative", learned) | ("batch",)
    blocks: dict = field(default_factory=dict)  # patched sizes of the backends
    seed: int = 0
    poison: bool = False  # nan keys and inf values where no query of their KV head may look (forward calls)
    return_lse: bool = False  # the log-sum-exp too (forward calls)

    @property
    def h(self) -> int:
        return self.g * self.r


def _offset_bound(draw, low: int, high: int):
    return draw(st.one_of(st.none(), st.integers(low, high)))


@st.composite
def mask_leaf(draw, rank: int, lead: tuple[int, ...], h: int, i: int, j: int) -> MaskLeaf:
    kinds = ["causal", "window", "window", "offsets", "dense"] + (["lengths", "starts", "documents"] if rank >= 4 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "window":  # mostly narrow, so the local backend (2 · (block + left + right) <= j) runs too
        return MaskLeaf(kind, (draw(st.sampled_from([0, 0, 1, 1, 2, 4])), draw(st.sampled_from([0, 0, 1, 2, 4]))))
    if kind == "offsets":
        lo, hi = _offset_bound(draw, -6, 4), _offset_bound(draw, -4, 6)
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        return MaskLeaf(kind, (lo, hi))
    if kind in ("lengths", "starts"):  # right padding (keys below n) or left (keys from n on), per batch row
        return MaskLeaf(kind, tuple(draw(st.integers(0, j)) for _ in range(lead[-1])))
    if kind == "documents":  # sorted ids per batch row: packed documents, some with no query or no key
        ids = lambda n: tuple(sorted(draw(st.integers(0, 3)) for _ in range(n)))  # noqa: E731
        rows = draw(st.sampled_from([1, lead[-1]]))
        return MaskLeaf(kind, (tuple(ids(i) for _ in range(rows)), tuple(ids(j) for _ in range(rows))))
    if kind == "dense":
        full = (*lead, h, i, j)[-rank:]  # the target's dims (rank 2: (i, j))
        dims = len(full) - draw(st.integers(0, max(0, len(full) - 2)))  # may drop leading dims
        shape = tuple(draw(st.sampled_from([1, n])) for n in full[len(full) - dims :])
        return MaskLeaf(kind, (shape, draw(st.integers(0, 2**16)), draw(st.sampled_from([0.3, 0.6, 0.9]))))
    return MaskLeaf(kind)


@st.composite
def mask_tree(draw, rank, lead, h, i, j, depth: int = 2):
    if depth == 0 or draw(st.booleans()):
        return draw(mask_leaf(rank, lead, h, i, j))
    a = draw(mask_tree(rank, lead, h, i, j, depth - 1))
    b = draw(mask_tree(rank, lead, h, i, j, depth - 1))
    dense_left = isinstance(a, MaskLeaf) and a.kind == "dense" and not (isinstance(b, MaskLeaf) and b.kind == "dense")
    return MaskNode(draw(st.sampled_from("&|")), a, b, dense_left and draw(st.booleans()))


@st.composite
def cases(draw, *, grad: bool = False) -> Case:
    # One call in five has the shape the local backend runs (a dot-family score on (b, h, i, d),
    # a narrow window, enough keys); at random it would be about one in two hundred.
    windowed = draw(st.integers(0, 4)) == 0
    rank = 4 if windowed else draw(st.sampled_from([2, 3, 4, 4, 4, 5]))
    lead = tuple(draw(st.integers(1, 2)) for _ in range(max(0, rank - 3)))
    g, r = (1, 1) if rank == 2 else (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    h = g * r
    i, j = draw(st.integers(6 if windowed else 1, 9)), draw(st.integers(8 if windowed else 1, 12))
    score = draw(st.sampled_from(["dot", "scaled_dot", "general"] + ([] if windowed else ["additive", "location"])))
    d = draw(st.integers(1, 5))
    dk = d if score in ("dot", "scaled_dot") else draw(st.integers(1, 5))
    e = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    if windowed:
        mask = MaskLeaf("window", (draw(st.integers(0, 2)), draw(st.integers(0, 1))))
        if draw(st.booleans()):
            mask = MaskNode("&", mask, draw(st.sampled_from([MaskLeaf("causal"), MaskLeaf("offsets", (-3, None))])))
        if draw(st.booleans()):
            mask = MaskNode("&", mask, MaskLeaf("lengths", tuple(draw(st.integers(0, j)) for _ in range(lead[-1]))))
    else:
        mask = draw(st.one_of(st.none(), mask_tree(rank, lead, h, i, j)))
    bias_kind = draw(st.sampled_from([None, "dense", "alibi", "t5"]))
    bias = None
    if bias_kind == "dense":
        full = (*lead, h, i, j)[-rank:]
        shape = tuple(draw(st.sampled_from([1, n])) for n in full[draw(st.integers(0, max(0, len(full) - 2))) :])
        bias = ("dense", shape, grad and draw(st.booleans()))
    elif bias_kind == "alibi":
        bias = ("alibi", draw(st.sampled_from(sorted({1, h}))))
    elif bias_kind == "t5":
        bidirectional = draw(st.booleans())
        buckets = draw(st.integers(4 if bidirectional else 2, 10))
        per_direction = buckets // 2 if bidirectional else buckets
        max_distance = draw(st.integers(per_direction // 2 + 1, 12))
        bias = ("t5", draw(st.sampled_from(sorted({1, h}))), buckets, max_distance, bidirectional, grad and draw(st.booleans()))
    return_weights = not windowed and draw(st.booleans())
    weights_for = None
    if return_weights and draw(st.booleans()):
        pick_rows = draw(st.one_of(st.none(), st.lists(st.integers(-i, i - 1), min_size=1, max_size=4),
                                   st.builds(slice, st.integers(0, i - 1), st.just(None))))  # fmt: skip
        pick_heads = None if rank == 2 else draw(st.one_of(st.none(), st.integers(0, h - 1), st.lists(st.integers(0, h - 1), min_size=1, max_size=3)))
        if pick_rows is not None or pick_heads is not None:
            weights_for = (pick_heads, pick_rows)
    blocks = {
        "online": (draw(st.integers(1, 4)), draw(st.integers(1, 4))),
        "fused_rows": draw(st.integers(1, 4)),
        "diagonal_rows": draw(st.integers(1, 4)),
        "key_step": draw(st.integers(1, 4)),
        "local_block": draw(st.integers(1, 2)),
        "weights_chunk": draw(st.sampled_from([1, 8, 40, 2**22])),
        "additive_sub": draw(st.sampled_from([1, 6, 30, 2**19])),
        "band_rows": draw(st.integers(1, 4)),
        "grad_block": draw(st.sampled_from([1, 16, 2**21])),
        # a padded batch split by rows (segments): always, or never; its short rows in groups or one by one
        "padding_elements": draw(st.sampled_from([0, 24, 64, padded_rows.PADDING_ELEMENTS])),
        "row_elements": draw(st.sampled_from([1, 48, padded_rows.ROW_ELEMENTS])),
        "groups": draw(st.booleans()),  # what the timing of groups against a call per row chose
    }
    sinks = None if windowed or not draw(st.integers(0, 3)) == 0 else (grad and draw(st.booleans()),)
    score_mod = None
    if not windowed and draw(st.integers(0, 3)) == 0:
        kind = draw(st.sampled_from(["relative", "batch", "softcap"]))
        score_mod = {"softcap": ("softcap", draw(st.sampled_from([2.0, 5.0]))), "batch": ("batch",),
                     "relative": ("relative", grad and draw(st.booleans()))}[kind]  # fmt: skip
    return Case(
        rank=rank, lead=lead, g=g, r=r, i=i, j=j, d=d, dk=dk, e=e, dtype=dtype, score=score,
        hidden=draw(st.integers(1, 4)), mask=mask, causal=draw(st.booleans()), bias=bias,
        scale=draw(st.one_of(st.none(), st.sampled_from([0.3, 1.0, 1.7]))), return_weights=return_weights,
        weights_for=weights_for, sinks=sinks, score_mod=score_mod, blocks=blocks, seed=draw(st.integers(0, 2**16)),
        poison=not grad and draw(st.booleans()), return_lse=not grad and draw(st.booleans()),
    )  # fmt: skip


# --------------------------------------------------------------------------- building a call


class Built:
    """The tensors and objects of one :class:`Case`: what qkv gets, and the oracle's float64 twins."""

    def __init__(self, case: Case, grad: bool = False):
        c, gen = case, torch.Generator().manual_seed(case.seed)
        self.case = c
        heads = () if c.rank == 2 else (c.h,)
        kv_heads = () if c.rank == 2 else (c.g,)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        self.q = randn(*c.lead, *heads, c.i, c.d).to(c.dtype)
        self.k = randn(*c.lead, *kv_heads, c.j, c.dk).to(c.dtype)
        self.v = randn(*c.lead, *kv_heads, c.j, c.e).to(c.dtype)
        if grad:
            for x in (self.q, self.k, self.v):
                x.requires_grad_()
        # the score, its parameters in the call's dtype
        torch.manual_seed(c.seed)
        self.score = {
            "dot": lambda: "dot",
            "scaled_dot": lambda: "scaled_dot",
            "general": lambda: qkv.scores.Bilinear(c.d, c.dk),
            "additive": lambda: qkv.scores.Additive(c.d, c.dk, c.hidden, bias=bool(c.seed % 2)),
            "location": lambda: qkv.scores.Location(c.d, c.j + c.seed % 3),
        }[c.score]()
        if not isinstance(self.score, str):
            self.score = self.score.to(c.dtype)
            for p in self.score.parameters():
                p.requires_grad_(grad)
        self.mask, self.allowed = self._mask(c.mask, gen)
        self.bias = self._bias(c.bias, gen, grad)
        self.sinks = None
        if c.sinks is not None:
            self.sinks = torch.randn(c.h if c.rank > 2 else 1, generator=gen, dtype=torch.float64).to(c.dtype)
            self.sinks.requires_grad_(c.sinks[0])
        self.score_mod, self.mod_weight = None, None
        if c.score_mod is not None and c.score_mod[0] == "softcap":
            self.score_mod = qkv.SoftCap(c.score_mod[1])
        elif c.score_mod is not None and c.score_mod[0] == "relative":
            # a learned slope per head on the raw query-minus-key position, read from a closure
            w = torch.randn(c.h if c.rank > 2 else 1, generator=gen, dtype=torch.float64).mul_(0.3).to(c.dtype)
            self.mod_weight = w.requires_grad_(c.score_mod[1])

            def relative(score, b, h, q_idx, kv_idx):
                return score + w[h] * (q_idx - kv_idx)

            self.score_mod = relative
        elif c.score_mod is not None:
            self.score_mod = lambda score, b, h, q_idx, kv_idx: score - 0.25 * b  # flat batch index; 0.25 is exact in float32
        self.weights_for = None
        if c.weights_for is not None:
            heads, rows = c.weights_for
            self.weights_for = {k: v for k, v in (("heads", heads), ("rows", rows)) if v is not None}

    def _mask(self, node, gen):
        """``(mask for qkv, allowed bool for the oracle)``, both from the definitions."""
        c = self.case
        if node is None:
            return None, None
        if isinstance(node, MaskNode):
            ma, aa = self._mask(node.a, gen)
            mb, ab = self._mask(node.b, gen)
            if node.op == "&":
                return (ma & mb), aa & ab
            return (ma | mb), aa | ab
        offset = torch.arange(c.j)[None, :] - torch.arange(c.i)[:, None] - (c.j - c.i)  # (i, j)
        if node.kind == "causal":
            return qkv.masks.causal(), offset <= 0
        if node.kind == "window":
            left, right = node.args
            return qkv.masks.window(left, right), (offset >= -left) & (offset <= right)
        if node.kind == "offsets":
            lo, hi = node.args
            allowed = torch.ones(c.i, c.j, dtype=torch.bool)
            if lo is not None:
                allowed &= offset >= lo
            if hi is not None:
                allowed &= offset <= hi
            return qkv.masks.offsets(lo, hi), allowed
        if node.kind == "lengths":
            lengths = torch.tensor(node.args)
            return qkv.masks.lengths(lengths), (torch.arange(c.j)[None, :] < lengths[:, None])[:, None, None, :]
        if node.kind == "starts":
            starts = torch.tensor(node.args)
            return qkv.masks.starts(starts), (torch.arange(c.j)[None, :] >= starts[:, None])[:, None, None, :]
        if node.kind == "documents":
            ids_q, ids_k = torch.tensor(node.args[0]), torch.tensor(node.args[1])
            return qkv.masks.documents(ids_q, ids_k), (ids_q[:, :, None] == ids_k[:, None, :])[:, None]
        shape, seed, p = node.args
        dense = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p
        return dense, dense

    def _bias(self, spec, gen, grad):
        c = self.case
        if spec is None:
            return None
        if spec[0] == "dense":
            bias = torch.randn(spec[1], generator=gen, dtype=torch.float64).to(c.dtype)
            return bias.requires_grad_(spec[2])
        if spec[0] == "alibi":
            return ALiBi(spec[1])
        _, heads, buckets, max_distance, bidirectional, learned = spec
        torch.manual_seed(c.seed + 1)
        t5 = RelativePositionBias(heads, buckets, max_distance, bidirectional=bidirectional)
        with torch.no_grad():
            t5.embedding.weight.normal_(0, 0.5)  # large enough that a wrong bucket shows
        return t5.to(c.dtype).requires_grad_(learned)

    def kwargs(self) -> dict:
        c = self.case
        kw = dict(score=self.score, mask=self.mask, bias=self.bias, causal=c.causal, scale=c.scale,
                  return_weights=c.return_weights, sinks=self.sinks, score_mod=self.score_mod)  # fmt: skip
        if self.weights_for is not None:
            kw["weights_for"] = self.weights_for
        if c.return_lse:
            kw["return_lse"] = True
        return kw

    def runnable(self) -> list[str]:
        """The backends ``qkv.backends.choose`` accepts for this call, and ``auto``."""
        req = checks.request(
            self.q, self.k, self.v, score=self.score, mask=self.mask, bias=self.bias, causal=self.case.causal,
            scale=self.case.scale, dropout=0.0, return_weights=self.case.return_weights, sinks=self.sinks,
            score_mod=self.score_mod, return_lse=self.case.return_lse,
        )  # fmt: skip
        names = []
        for name in BACKENDS:
            try:
                backends.choose(req, name)
            except ValueError as error:
                assert "cannot run this call" in str(error), error
                continue
            names.append(name)
        return names


def small_blocks(case: Case, mp: pytest.MonkeyPatch) -> None:
    """Patch the backends' size constants to the case's (tiny) tiles, blocks and chunks."""
    b = case.blocks
    mp.setattr(online_softmax, "_blocks", lambda req: (min(req.i, b["online"][0]), min(req.j, b["online"][1])))
    rows = fused_blocks.rows_per_block  # a causal square runs whole (the kernel's own flag is top-left)

    def small_rows(plan, q, j_len, diagonal):
        whole = rows(plan, q, j_len, diagonal)
        return whole if plan.causal_square else min(whole, b["fused_rows"])

    mp.setattr(fused_blocks, "rows_per_block", small_rows)
    mp.setattr(fused_blocks, "DIAGONAL_ROWS", b["diagonal_rows"])
    mp.setattr(fused_blocks, "KEY_STEP", b["key_step"])
    mp.setattr(local, "block_size", lambda window: b["local_block"])
    mp.setattr(weights_module, "CHUNK_ELEMENTS", b["weights_chunk"])
    mp.setattr(additive_tiles, "SUB_ELEMENTS", b["additive_sub"])
    mp.setattr(additive_tiles, "SUB_ELEMENTS_THREADED", b["additive_sub"])
    mp.setattr(bias_grad, "BAND_ROWS", b["band_rows"])
    mp.setattr(bias_grad, "BLOCK_ELEMENTS", b["grad_block"])
    mp.setattr(padded_rows, "PADDING_ELEMENTS", b["padding_elements"])
    mp.setattr(padded_rows, "ROW_ELEMENTS", b["row_elements"])
    mp.setattr(padded_rows, "groups_faster", lambda *args: b["groups"])


# --------------------------------------------------------------------------- the oracle


def oracle(built: Built, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (..., h, i, e), weights (..., h, i, j))`` in float64, from the definitions.

    ``params``: float64 leaves standing for q, k, v, the dense bias and the score's and the
    T5 table's parameters (so their gradients can be compared).
    """
    c = built.case
    q, k, v = params["q"], params["k"], params["v"]
    if c.rank >= 3 and c.r > 1:  # query head n reads KV head n // r
        k, v = k.repeat_interleave(c.r, dim=-3), v.repeat_interleave(c.r, dim=-3)
    if c.score in ("dot", "scaled_dot"):
        s = q @ k.transpose(-1, -2)
    elif c.score == "general":
        s = q @ params["score.weight"] @ k.transpose(-1, -2)  # Luong: qᵀ W k
    elif c.score == "additive":
        qh = q @ params["score.query_proj.weight"].T + params.get("score.query_proj.bias", 0.0)
        kh = k @ params["score.key_proj.weight"].T
        s = torch.tanh(qh[..., :, None, :] + kh[..., None, :, :]) @ params["score.v"]  # Bahdanau: vᵀ tanh(Wq q + Wk k)
    else:
        s = (q @ params["score.proj.weight"].T + params["score.proj.bias"])[..., : c.j]  # Luong's location: (W q + b)_j
    scale = c.scale if c.scale is not None else (c.d**-0.5 if c.score == "scaled_dot" else 1.0)
    s = s * scale
    offset = torch.arange(c.j)[None, :] - torch.arange(c.i)[:, None] - (c.j - c.i)  # key minus query position
    if c.bias is not None and c.bias[0] == "dense":
        s = s + params["bias"]
    elif c.bias is not None:
        if c.bias[0] == "alibi":
            slopes = torch.tensor(ref.alibi_slopes(c.bias[1]), dtype=torch.float64)
            lazy = -slopes[:, None, None] * offset.abs().double()  # (heads, i, j)
        else:
            _, _, buckets, max_distance, bidirectional, _ = c.bias
            index = torch.tensor([[ref.t5_bucket(int(x), buckets, max_distance, bidirectional) for x in row] for row in offset])
            lazy = params["bias.embedding.weight"][index].permute(2, 0, 1)  # (heads, i, j)
        s = s + (lazy[0] if c.rank == 2 else lazy)  # (i, d) inputs have no head axis
    if c.score_mod is not None:  # after the bias, before the mask; raw positions, flat batch index
        q_idx, kv_idx = torch.arange(c.i)[:, None], torch.arange(c.j)[None, :]
        if c.score_mod[0] == "softcap":
            s = c.score_mod[1] * torch.tanh(s / c.score_mod[1])
        elif c.score_mod[0] == "relative":
            w = params["score_mod.w"]
            s = s + (w[0] if c.rank == 2 else w[:, None, None]) * (q_idx - kv_idx)
        else:
            flat = torch.arange(math.prod(c.lead), dtype=torch.float64).view(*c.lead, 1, 1, 1) if c.lead else 0.0
            s = s - 0.25 * flat
    allowed = built.allowed
    if c.causal:
        allowed = (offset <= 0) if allowed is None else allowed & (offset <= 0)
    if c.sinks is not None:  # one more logit per row, with no value: GPT-OSS's sink
        sink = params["sinks"] if c.rank > 2 else params["sinks"][0]
        sink = (sink[:, None, None] if c.rank > 2 else sink).expand(*s.shape[:-1], 1)
        if allowed is not None:
            s = s.masked_fill(~allowed.expand(s.shape), -math.inf)  # a dead row keeps its sink
        built.want_lse = torch.cat([s, sink], -1).logsumexp(-1).detach()
        return_w = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
        return return_w @ v, return_w
    if allowed is None:
        built.want_lse = s.logsumexp(-1).detach()
        w = s.softmax(-1)
    else:
        allowed = allowed.expand(s.shape)
        live = allowed.any(-1, keepdim=True)
        s = s.masked_fill(~allowed, -math.inf)
        built.want_lse = s.logsumexp(-1).detach()  # -inf on a row that sees nothing
        s = s.masked_fill(~live, 0.0)
        w = s.softmax(-1) * live  # a row that sees nothing: zero weights, zero output
    return w @ v, w


def poisoned(built: Built) -> tuple[torch.Tensor, torch.Tensor]:
    """``k, v`` with nan keys and inf values at the keys no query of their KV head may look at (issue: masked-out
    keys and values never reach an output). Cache padding from ``torch.empty`` holds such values."""
    c = built.case
    allowed = built.allowed
    if c.causal:
        offset = torch.arange(c.j)[None, :] - torch.arange(c.i)[:, None] - (c.j - c.i)
        allowed = (offset <= 0) if allowed is None else allowed & (offset <= 0)
    if allowed is None:
        return built.k, built.v
    if c.rank == 2:
        hidden = ~allowed.expand(c.i, c.j).any(-2)  # (j,)
    else:
        full = allowed.expand(*c.lead, c.h, c.i, c.j)
        hidden = ~full.reshape(*c.lead, c.g, c.r * c.i, c.j).any(-2)  # (..., g, j): no row of any head of the group
    k, v = built.k.detach().clone(), built.v.detach().clone()
    if c.score != "location":  # Luong's location score never reads the keys
        k[hidden] = float("nan")
    v[hidden] = float("inf")
    return k, v


def inputs(built: Built) -> dict[str, torch.Tensor]:
    """Every tensor a gradient may reach: q, k, v, the dense bias, the score's and the T5 table's parameters."""
    params = {"q": built.q, "k": built.k, "v": built.v}
    if not isinstance(built.score, str):
        params.update({f"score.{n}": p for n, p in built.score.named_parameters()})
    if isinstance(built.bias, torch.Tensor):
        params["bias"] = built.bias
    elif isinstance(built.bias, RelativePositionBias):
        params["bias.embedding.weight"] = built.bias.embedding.weight
    if built.sinks is not None:
        params["sinks"] = built.sinks
    if built.mod_weight is not None:
        params["score_mod.w"] = built.mod_weight
    return params


def oracle_params(built: Built) -> dict[str, torch.Tensor]:
    return {name: x.detach().double().requires_grad_() for name, x in inputs(built).items()}


def select(w: torch.Tensor, built: Built) -> torch.Tensor:
    """The oracle's weights cut to ``weights_for`` (independent of qkv's index handling)."""
    if built.case.weights_for is None:
        return w
    heads, rows = built.case.weights_for
    if rows is not None:
        index = list(range(built.case.i))[rows] if isinstance(rows, slice) else [x % built.case.i for x in rows]
        w = w[..., index, :]
    if heads is not None:
        w = w[..., [heads] if isinstance(heads, int) else heads, :, :]
    return w


def tolerance(dtype: torch.dtype, grad: bool = False) -> dict:
    if dtype == torch.float64:
        return dict(atol=1e-9, rtol=1e-7)
    return dict(atol=2e-4 if grad else 5e-5, rtol=2e-4 if grad else 5e-5)


class Taken:
    """The backend and the engine each call runs, recorded at their entry points, as ``qkv.explain`` words it."""

    def __init__(self, mp: pytest.MonkeyPatch):
        self.path: list[tuple[str, str]] = []
        for name, module in backends.REGISTRY.items():
            mp.setattr(module, "run", self._spy(module.run, "backend", name))
        mp.setattr(sdpa_plain, "plain", self._lane(sdpa_plain.plain))
        for engine in engines.ENGINES:
            mp.setattr(engine, "forward", self._spy(engine.forward, "engine", engine.name))
            mp.setattr(engine, "backward", self._spy(engine.backward, "backward", engine.name))

    def _spy(self, fn, kind: str, name: str):
        def spy(*args, **kwargs):
            self.path.append((kind, name))
            return fn(*args, **kwargs)

        return spy

    def _lane(self, fn):
        """``qkv.attention``'s plain-call lane runs the sdpa backend's kernel when it answers (not None)."""

        def spy(*args):
            out = fn(*args)
            if out is not None:
                self.path.append(("backend", "sdpa"))
            return out

        return spy

    def line(self) -> str:
        """``"backend: NAME"`` or ``"backend: chunked (ENGINE)"`` of the calls since the last line."""
        backend = next(name for kind, name in self.path if kind == "backend")
        engine = next((name for kind, name in self.path if kind == "engine"), None)
        self.path = []
        return f"backend: {backend}" + (f" ({engine})" if backend == "chunked" else "")


    def backward(self) -> str | None:
        """The engine whose backward ran last (an engine's backward may hand over to ``mod_tiles``'), or None."""
        names = [name for kind, name in self.path if kind == "backward"]
        self.path = []
        return names[-1] if names else None


def explained(built: Built) -> str:
    return qkv.explain(built.q, built.k, built.v, **built.kwargs()).splitlines()[0]


def explained_backward(built: Built) -> str | None:
    """The engine ``qkv.explain`` names on a ``backward:`` line, else None (the forward's engine runs it)."""
    lines = qkv.explain(built.q, built.k, built.v, **built.kwargs()).splitlines()
    return next((line.split()[1] for line in lines if line.startswith("  backward: ")), None)


# --------------------------------------------------------------------------- the properties

CALLS = {"forward": 0, "gradients": 0, "explained": 0}


@_settings(EXAMPLES["forward"])
@given(case=cases())
def _forward_property(case: Case) -> None:
    built = Built(case)
    want_out, want_w = oracle(built, oracle_params(built))
    want_w = select(want_w, built)
    k, v = poisoned(built) if case.poison else (built.k, built.v)
    with pytest.MonkeyPatch.context() as mp:
        small_blocks(case, mp)
        taken = Taken(mp)
        with torch.no_grad():
            for name in built.runnable():
                said = explained(built) if name == "auto" else None
                result = qkv.attention(built.q, k, v, backend=name, **built.kwargs())
                CALLS["forward"] += 1
                if said is not None:  # qkv.explain names the path the call took
                    assert taken.line() == said, (said, case)
                    CALLS["explained"] += 1
                taken.path = []
                result = list(result) if isinstance(result, tuple) else [result]
                lse = result.pop() if case.return_lse else None
                out, w = result if case.return_weights else (result[0], None)
                assert out.dtype == case.dtype and out.shape == want_out.shape, name
                if lse is not None:  # natural log, -inf where a row sees nothing (and has no sink)
                    torch.testing.assert_close(lse.double(), built.want_lse, **tolerance(case.dtype), msg=lambda m: f"{name} lse: {m}")
                torch.testing.assert_close(out.double(), want_out, **tolerance(case.dtype), msg=lambda m: f"{name} out: {m}")
                if w is not None:
                    assert w.dtype == case.dtype, name
                    torch.testing.assert_close(w.double(), want_w, **tolerance(case.dtype), msg=lambda m: f"{name} weights: {m}")
            # the weights alone, through the reference and the fast path
            if case.return_weights:
                kw = {key: val for key, val in built.kwargs().items() if key not in ("return_weights", "return_lse")}
                for name in ("auto", "chunked"):
                    w = qkv.attention_weights(built.q, k, backend=name, **kw)
                    CALLS["forward"] += 1
                    torch.testing.assert_close(w.double(), want_w, **tolerance(case.dtype), msg=lambda m: f"attention_weights {name}: {m}")


@_settings(EXAMPLES["gradients"])
@given(case=cases(grad=True))
def _gradient_property(case: Case) -> None:
    built = Built(case, grad=True)
    params = oracle_params(built)
    want_out, want_w = oracle(built, params)
    want_w = select(want_w, built)
    gen = torch.Generator().manual_seed(case.seed + 7)
    d_out = torch.randn(want_out.shape, generator=gen, dtype=torch.float64)
    d_w = torch.randn(want_w.shape, generator=gen, dtype=torch.float64) if case.return_weights else None
    loss = (want_out * d_out).sum() + ((want_w * d_w).sum() if d_w is not None else 0.0)
    leaves = {name: x for name, x in params.items()}
    want = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    theirs = {name: x for name, x in inputs(built).items() if x.requires_grad}
    with pytest.MonkeyPatch.context() as mp:
        small_blocks(case, mp)
        taken = Taken(mp)
        for name in built.runnable():
            said = explained(built) if name == "auto" else None
            said_backward = explained_backward(built) if name == "auto" else None
            result = qkv.attention(built.q, built.k, built.v, backend=name, **built.kwargs())
            CALLS["gradients"] += 1
            if said is not None:  # qkv.explain names the path the call took, with gradients on
                assert taken.line() == said, (said, case)
                CALLS["explained"] += 1
            taken.path = []
            out, w = result if case.return_weights else (result, None)
            total = (out.double() * d_out).sum() + ((w.double() * d_w).sum() if d_w is not None else 0.0)
            grads = torch.autograd.grad(total, list(theirs.values()), allow_unused=True)
            ran_backward = taken.backward()
            if said_backward is not None:  # a backward explain says another engine runs: it ran
                assert ran_backward == said_backward, (said_backward, ran_backward, case)
            for (param, x), got in zip(theirs.items(), grads):
                expected = want[param]
                expected = torch.zeros_like(params[param]) if expected is None else expected
                got = torch.zeros_like(x) if got is None else got
                torch.testing.assert_close(
                    got.double(), expected, **tolerance(case.dtype, grad=True), msg=lambda m: f"{name} d{param}: {m}"
                )


def test_forward_and_weights_of_random_calls_match_the_oracle():
    before, explained_before = CALLS["forward"], CALLS["explained"]
    _forward_property()
    assert CALLS["forward"] - before >= MIN_CALLS["forward"]
    assert CALLS["explained"] - explained_before >= EXAMPLES["forward"]  # every example's auto call


def test_gradients_of_random_calls_match_the_oracle():
    before, explained_before = CALLS["gradients"], CALLS["explained"]
    _gradient_property()
    assert CALLS["gradients"] - before >= MIN_CALLS["gradients"]
    assert CALLS["explained"] - explained_before >= EXAMPLES["gradients"]
