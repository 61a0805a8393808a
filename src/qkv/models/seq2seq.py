"""RNN encoder–decoders with attention: Bahdanau et al. 2015 and Luong et al. 2015.

Shape legend: ``b`` batch, ``j`` source length (keys), ``i`` target steps (queries),
``dh`` decoder state size (``hidden``), ``d`` annotation size (also ``hidden``: the
bidirectional encoder uses ``hidden // 2`` per direction), ``c`` target vocabulary size.

Both models encode the source with :class:`~qkv.models.rnn.RNNEncoder` into annotations
``h_j`` and, at every target step, attend over them with qkv's own attention
(``e_ij = a(query_i, h_j)``, ``α = softmax``, ``c_i = Σ_j α_ij h_j``). They differ in
the query and in where the context enters:

* :class:`Bahdanau` ("Neural Machine Translation by Jointly Learning to Align and
  Translate", section 3.1 and appendix A): additive score, query = the **previous**
  decoder state ``s_{i−1}``; the context goes into the GRU with the previous output
  embedding, ``s_i = GRU([E y_{i−1}; c_i], s_{i−1})``; ``s_0 = tanh(W_s ←h_1)``; output
  ``p(y_i) = softmax(W_o maxout(U_o s_i + V_o E y_{i−1} + C_o c_i))``.
* :class:`Luong` ("Effective Approaches to Attention-based Neural Machine Translation",
  section 3): query = the **current** state ``h_t = GRU(E y_{t−1}, h_{t−1})`` (with input
  feeding, ``GRU([E y_{t−1}; h̃_{t−1}], h_{t−1})``); any qkv score (dot, general, concat,
  location) and global / local-m / local-p alignment (:mod:`qkv.models.luong`); the
  attentional state ``h̃_t = tanh(W_c [c_t; h_t])`` and ``p(y_t) = softmax(W_s h̃_t)``.
  The paper's stacked LSTMs are GRUs here; ``h_0`` is the encoder's final states.

Both train with teacher forcing (:meth:`loss`) and decode with :meth:`greedy` and
:meth:`beam_search` (:mod:`qkv.models.decoding`). Inputs are named as in
``torch.nn.Transformer`` and :mod:`qkv.models.transformer`: ``src (b, j)`` source ids,
``src_lengths (b,)`` real source tokens per row, ``tgt`` target ids. A full target
sequence is ``bos y_1 … y_n eos`` padded with ``pad_id``, the layout of ``qkv.tasks``.
Checked in the test suite: teacher-forced logits equal step-by-step
decoding, padding does not change results, and each model overfits a tiny batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import positive_int, probability
from ..attention import Attention
from ..scores import ALIASES, Additive, Location, make
from .checks import check_ids, check_lengths, check_rows, check_tokens
from .decoding import Decoded, beam_search, greedy
from .luong import ALIGNMENTS, LuongAlignment, padding_mask
from .rnn import RNNEncoder


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Sizes and special ids shared by :class:`Bahdanau` and :class:`Luong`."""

    src_vocab: int  # number of source token ids; ids lie in [0, src_vocab)
    tgt_vocab: int  # number of target token ids; the size of the output softmax
    embed_dim: int = 64  # size of the source and target token embeddings
    hidden: int = 128  # decoder state size; the annotations too (hidden // 2 per direction)
    attention_dim: int = 128  # hidden size n of the additive (concat) score vᵀ tanh(W_q q + W_k k)
    encoder_layers: int = 1  # stacked bidirectional GRU layers in the encoder
    dropout: float = 0.0  # on embeddings and before the output layer, in training mode
    pad_id: int = 0  # padding id in both vocabularies (ignored by the loss)
    bos_id: int = 1  # target id that starts decoding
    eos_id: int = 2  # target id that ends a hypothesis
    # qkv backend of the attention step; "reference" materialises the (b, i, j) logits, which
    # at these sizes beats tiling them ("auto" picks the chunked backend for the additive
    # score: a training step took 1.6-2x as long, batch 64, 30 source characters, 1 CPU core).
    backend: str = "reference"

    def __post_init__(self):
        for name in ("src_vocab", "tgt_vocab", "embed_dim", "hidden", "attention_dim", "encoder_layers"):
            positive_int(name, getattr(self, name))
        if self.hidden % 2:
            raise ValueError(f"hidden: expected an even size (split over two encoder directions), got {self.hidden}")
        probability("dropout", self.dropout)
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.tgt_vocab:
                raise ValueError(f"{name}: expected an id in [0, {self.tgt_vocab}), got {value!r}")
        if self.pad_id >= self.src_vocab:
            raise ValueError(
                f"pad_id: expected an id in [0, {self.src_vocab}) of the source vocabulary, got {self.pad_id}"
            )


#: The score names :class:`LuongConfig` takes, every ``qkv.scores`` name: Luong's dot, general, concat and location,
#: their aliases (bilinear for general; additive and mlp for concat) and the scaled dot.
LUONG_SCORES = tuple(ALIASES)


@dataclass(frozen=True)
class LuongConfig(Seq2SeqConfig):
    """:class:`Seq2SeqConfig` plus Luong's choices of score, alignment and input feeding."""

    score: str = "general"  # "dot", "general", "concat" or "location" (qkv.scores names)
    alignment: str = "global"  # "global", "local-m" or "local-p"
    window: int = 10  # D: local windows are [p_t - D, p_t + D]; local-p's σ = D / 2 (the paper's D = 10)
    input_feeding: bool = True  # feed h̃_{t-1} into the next step's GRU input
    max_src_len: int | None = None  # longest source the location score accepts (location only)

    def __post_init__(self):
        super().__post_init__()
        if self.score not in LUONG_SCORES:
            raise ValueError(f"score: expected one of {LUONG_SCORES} (Luong's four and qkv.scores' other names), "
                             f"got {self.score!r}")  # fmt: skip
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment: expected one of {ALIGNMENTS}, got {self.alignment!r}")
        positive_int("window", self.window)
        if self.score == "location":
            positive_int("max_src_len", self.max_src_len)


class _Seq2Seq(nn.Module):
    """What both models share: the encoder, input checks, the loss and decoding."""

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        if not isinstance(config, Seq2SeqConfig):
            raise TypeError(f"config: expected a Seq2SeqConfig, got {type(config).__name__}")
        self.config = config
        self.pad_id, self.bos_id, self.eos_id = config.pad_id, config.bos_id, config.eos_id
        self.encoder = RNNEncoder(
            config.src_vocab, config.embed_dim, config.hidden // 2, layers=config.encoder_layers,
            bidirectional=True, pad_id=config.pad_id, dropout=config.dropout,
        )  # fmt: skip
        self.target_embed = nn.Embedding(config.tgt_vocab, config.embed_dim, padding_idx=config.pad_id)
        self.drop = nn.Dropout(config.dropout)

    # -- inputs ---------------------------------------------------------------------------
    def _src(self, src: Tensor, src_lengths: Tensor | None) -> tuple[Tensor, Tensor]:
        # before the lengths: an empty source has none in [1, 0] to give, whether given or defaulted
        check_tokens("src", check_ids("src", src, self.config.src_vocab), "the decoder starts from its encoding")
        b, j = src.shape
        if src_lengths is None:
            src_lengths = torch.full((b,), j, dtype=torch.long, device=src.device)
        return src, check_lengths("src_lengths", src_lengths, b, j)

    def _tgt(self, tgt: Tensor, src: Tensor) -> Tensor:
        check_ids("tgt", tgt, self.config.tgt_vocab)
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(
                f"tgt: expected the batch size of src ({src.shape[0]}), got {tgt.shape[0]} (shape {tuple(tgt.shape)})"
            )
        return tgt

    # -- the decoding protocol (qkv.models.decoding) ----------------------------------------
    def start(self, src: Tensor, src_lengths: Tensor | None = None) -> tuple[tuple, tuple]:
        """Encode ``src (b, j)``: ``memory = (annotations (b, j, d), src_lengths (b,))``, first decoder state."""
        src, src_lengths = self._src(src, src_lengths)
        annotations, final = self.encoder(src, src_lengths)
        memory = (annotations, src_lengths)
        return memory, self._initial_state(annotations, final)

    def step(self, memory: tuple, state: tuple, token: Tensor, position: int) -> tuple[Tensor, tuple, Tensor]:
        """One step from the previous ``token (b,)``: ``(log_probs (b, c), state, weights (b, j))``."""
        logits, state, weights = self._step(memory, state, self.target_embed(token), position)
        return F.log_softmax(self._never_specials(logits), dim=-1), state, weights

    def _never_specials(self, logits: Tensor) -> Tensor:
        # A model must not write padding or bos: they would corrupt scoring and decoding.
        # -inf (not finfo.min) so they get exactly zero probability; softmax stays finite.
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        banned[[self.pad_id, self.bos_id]] = True
        return logits.masked_fill(banned, float("-inf"))

    # -- training ---------------------------------------------------------------------------
    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_lengths: Tensor | None = None,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Teacher forcing: ``src (b, j)``, ``tgt (b, i)`` (starting with bos) -> ``logits (b, i, c)``.

        ``tgt`` is the decoder input: a full target ``bos … eos`` without its last column,
        as :meth:`loss` passes it. Step ``t`` reads ``tgt[:, t]`` and predicts the next
        token. The logits of ``pad_id`` and ``bos_id`` are ``-inf``: the model never
        writes them. With ``return_weights=True`` also the attention weights ``(b, i, j)``.
        An empty ``tgt (b, 0)`` gives empty logits and weights; an empty ``src`` is an error.
        """
        memory, state = self.start(src, src_lengths)
        self._tgt(tgt, src)
        logits, weights = self._teacher_forced(memory, state, self.target_embed(tgt))
        logits = self._never_specials(logits)
        return (logits, weights) if return_weights else logits

    def _teacher_forced(self, memory: tuple, state: tuple, embedded: Tensor) -> tuple[Tensor, Tensor]:
        if embedded.shape[1] == 0:
            return self._no_steps(memory, state)
        logits, weights = [], []
        for position in range(embedded.shape[1]):
            step_logits, state, w = self._step(memory, state, embedded[:, position], position)
            logits.append(step_logits)
            weights.append(w)
        return torch.stack(logits, 1), torch.stack(weights, 1)

    def _no_steps(self, memory: tuple, state: tuple) -> tuple[Tensor, Tensor]:
        """Logits ``(b, 0, c)`` and weights ``(b, 0, j)`` of an empty target, as slices of the model's tensors.

        There is no step to stack (``torch.stack`` refuses an empty list, ``nn.GRU`` a length
        of 0); slicing keeps the result in the graph, so a loss over it still backpropagates.
        """
        annotations, first = memory[0], state[0]  # (b, j, d), (b, dh)
        return self.out(first.unsqueeze(1)[:, :0]), annotations[..., :0].transpose(1, 2)

    def loss(self, src: Tensor, tgt: Tensor, src_lengths: Tensor | None = None) -> Tensor:
        """Mean cross-entropy of ``tgt[:, 1:]`` given ``src`` and ``tgt[:, :-1]``.

        ``tgt (b, u)`` is the full target: it starts with bos and ends with eos, then
        padding (ignored by the loss). A batch of 0 rows is an error, not a NaN mean over nothing.
        """
        check_rows("tgt", self._tgt(tgt, src))
        if tgt.shape[1] < 2:
            raise ValueError(f"tgt: expected at least bos and one token per row, got shape {tuple(tgt.shape)}")
        logits = self(src, tgt[:, :-1], src_lengths)
        return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten(), ignore_index=self.pad_id)

    def score_sequences(self, src: Tensor, tgt: Tensor, src_lengths: Tensor | None = None) -> Tensor:
        """Total log-probability ``(b,)`` of each ``tgt`` row given ``src``; padding counts 0.

        ``tgt (b, u)`` is the full target, as in :meth:`loss`: it starts with bos and ends
        with eos, then padding.
        """
        self._tgt(tgt, src)
        log_probs = F.log_softmax(self(src, tgt[:, :-1], src_lengths), dim=-1)
        gained = log_probs.gather(-1, tgt[:, 1:, None]).squeeze(-1)
        return gained.masked_fill(tgt[:, 1:] == self.pad_id, 0.0).sum(1)

    # -- decoding ---------------------------------------------------------------------------
    def greedy(self, src: Tensor, src_lengths: Tensor | None = None, *, max_len: int = 64) -> Decoded:
        """Greedy decoding of ``src (b, j)``; see :func:`qkv.models.decoding.greedy`."""
        return greedy(self, src, src_lengths, max_len=max_len)

    def beam_search(
        self,
        src: Tensor,
        src_lengths: Tensor | None = None,
        *,
        beam_size: int = 4,
        max_len: int = 64,
        length_penalty: float = 0.0,
    ) -> Decoded:
        """Beam search over ``src (b, j)``; see :func:`qkv.models.decoding.beam_search`."""
        return beam_search(
            self, src, src_lengths, beam_size=beam_size, max_len=max_len, length_penalty=length_penalty
        )


class Bahdanau(_Seq2Seq):
    """Bahdanau et al. 2015: bi-GRU encoder, additive attention queried by ``s_{i−1}``, GRU decoder.

    >>> model = Bahdanau(Seq2SeqConfig(src_vocab=40, tgt_vocab=15, hidden=32))
    >>> logits, weights = model(src, tgt[:, :-1], src_lengths, return_weights=True)
    """

    def __init__(self, config: Seq2SeqConfig):
        super().__init__(config)
        dh, e = config.hidden, config.embed_dim
        self.init_state = nn.Linear(dh // 2, dh)  # W_s: s_0 = tanh(W_s ←h_1)
        self.attention = Attention(Additive(dh, dh, config.attention_dim), backend=config.backend)
        self.cell = nn.GRUCell(e + dh, dh)
        self.deep_output = nn.Linear(dh + e + dh, 2 * dh)  # [U_o V_o C_o], two maxout pieces per unit
        self.out = nn.Linear(dh, config.tgt_vocab)  # W_o

    def _initial_state(self, annotations: Tensor, final: Tensor) -> tuple:
        backward_first = annotations[:, 0, self.config.hidden // 2 :]  # ←h_1: read the whole source
        return (torch.tanh(self.init_state(backward_first)),)

    def _step(self, memory: tuple, state: tuple, embedded: Tensor, position: int) -> tuple[Tensor, tuple, Tensor]:
        annotations, lengths = memory
        (s_prev,) = state
        keep = padding_mask(lengths, annotations.shape[1])  # (b, 1, j)
        # The query is the state *before* this step: the alignment decides what to read next.
        context, weights = self.attention(s_prev, annotations, mask=keep, return_weights=True)
        s = self.cell(torch.cat([embedded, context], -1), s_prev)
        pieces = self.deep_output(self.drop(torch.cat([s, embedded, context], -1)))
        t = pieces.view(*pieces.shape[:-1], self.config.hidden, 2).amax(-1)  # maxout over pairs (no -1: b may be 0)
        return self.out(self.drop(t)), (s,), weights


class Luong(_Seq2Seq):
    """Luong et al. 2015: bi-GRU encoder, GRU decoder queried by ``h_t``, global or local attention.

    >>> model = Luong(LuongConfig(src_vocab=40, tgt_vocab=15, score="dot", alignment="local-p"))
    """

    def __init__(self, config: LuongConfig):
        if not isinstance(config, LuongConfig):
            raise TypeError(f"config: expected a LuongConfig, got {type(config).__name__}")
        super().__init__(config)
        dh, e = config.hidden, config.embed_dim
        score = make(config.score, dh, dh, hidden=config.attention_dim, max_len=config.max_src_len)
        self.alignment = LuongAlignment(
            score, config.alignment, window=config.window, query_dim=dh, backend=config.backend
        )
        self.rnn = nn.GRU(e + (dh if config.input_feeding else 0), dh, batch_first=True)
        self.combine = nn.Linear(2 * dh, dh, bias=False)  # W_c: h̃_t = tanh(W_c [c_t; h_t])
        self.out = nn.Linear(dh, config.tgt_vocab)  # W_s

    def _src(self, src: Tensor, src_lengths: Tensor | None) -> tuple[Tensor, Tensor]:
        src, src_lengths = super()._src(src, src_lengths)
        score = self.alignment.score
        if isinstance(score, Location) and src.shape[1] > score.max_len:
            raise ValueError(
                f"src: the location score was built for max_src_len={score.max_len}, "
                f"got a source of length {src.shape[1]}"
            )
        return src, src_lengths

    def _initial_state(self, annotations: Tensor, final: Tensor) -> tuple:
        # The top layer's forward and backward final states, side by side: (b, dh).
        h0 = torch.cat([final[-2], final[-1]], dim=-1)
        return (h0, torch.zeros_like(h0))  # (h_{t-1}, h̃_{t-1})

    def _attend(self, memory: tuple, h: Tensor, first_step: int) -> tuple[Tensor, Tensor, Tensor]:
        """``h (b, i, dh)`` -> logits ``(b, i, c)``, ``h̃ (b, i, dh)``, weights ``(b, i, j)``."""
        annotations, lengths = memory
        context, weights = self.alignment(h, annotations, lengths, first_step=first_step)
        h_tilde = torch.tanh(self.combine(torch.cat([context, h], -1)))
        return self.out(self.drop(h_tilde)), h_tilde, weights

    def _step(self, memory: tuple, state: tuple, embedded: Tensor, position: int) -> tuple[Tensor, tuple, Tensor]:
        h_prev, h_tilde_prev = state
        x = torch.cat([embedded, h_tilde_prev], -1) if self.config.input_feeding else embedded
        _, h = self.rnn(x[:, None], h_prev[None])  # h: (1, b, dh)
        h = h[0]
        # The query is the state *after* reading this step's input (Luong's h_t).
        logits, h_tilde, weights = self._attend(memory, h[:, None], position)
        return logits[:, 0], (h, h_tilde[:, 0]), weights[:, 0]

    def _teacher_forced(self, memory: tuple, state: tuple, embedded: Tensor) -> tuple[Tensor, Tensor]:
        if self.config.input_feeding or embedded.shape[1] == 0:
            return super()._teacher_forced(memory, state, embedded)
        # Without input feeding the states do not depend on attention: run the GRU over
        # the whole target at once, then attend from every step in one call.
        h, _ = self.rnn(embedded, state[0][None])  # (b, i, dh)
        logits, _, weights = self._attend(memory, h, 0)
        return logits, weights
