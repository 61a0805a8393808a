"""The recurrent encoder of the seq2seq models.

Shape legend: ``b`` batch, ``j`` source length (the keys of the decoder's attention),
``d`` encoder output size (``hidden`` per direction, times 2 when bidirectional), ``l``
layers × directions.

Bahdanau et al. 2015 ("Neural Machine Translation by Jointly Learning to Align and
Translate", section 3.2) encode the source with a bidirectional RNN and call the
concatenation ``h_j = [→h_j; ←h_j]`` the *annotation* of word ``j``: the forward half
summarises the words up to ``j``, the backward half the words from ``j`` on, so each
annotation describes the whole sentence with a focus around word ``j``. The annotations
are the keys and values the decoder attends over.

Padding: the source is packed (``nn.utils.rnn.pack_padded_sequence``), so the backward
RNN of a short sequence starts at its own last token rather than at the padding, and the
annotations are exactly those of the unpadded sequence (checked in
the test suite). Annotations at padded positions are zero.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._args import positive_int, probability
from .checks import check_ids, check_lengths


class RNNEncoder(nn.Module):
    """Embedding + (bi)directional GRU over a padded batch of token ids.

    Args:
        vocab_size: number of source token ids; ids must lie in ``[0, vocab_size)``.
        embed_dim: size of the token embeddings.
        hidden: GRU state size per direction.
        layers: stacked GRU layers.
        bidirectional: run a backward GRU too and concatenate (Bahdanau's annotations).
        pad_id: the padding id (its embedding is kept at zero).
        dropout: between stacked layers and on the embeddings, in training mode.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        hidden: int,
        *,
        layers: int = 1,
        bidirectional: bool = True,
        pad_id: int = 0,
        dropout: float = 0.0,
    ):
        super().__init__()
        sizes = {"vocab_size": vocab_size, "embed_dim": embed_dim, "hidden": hidden, "layers": layers}
        for arg, value in sizes.items():
            positive_int(arg, value)
        if not isinstance(pad_id, int) or not 0 <= pad_id < vocab_size:
            raise ValueError(f"pad_id: expected an id in [0, {vocab_size}), got {pad_id!r}")
        probability("dropout", dropout)
        self.vocab_size, self.hidden, self.layers = vocab_size, hidden, layers
        self.bidirectional = bool(bidirectional)
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.GRU(
            embed_dim, hidden, num_layers=layers, batch_first=True,
            bidirectional=self.bidirectional, dropout=dropout if layers > 1 else 0.0,
        )  # fmt: skip

    @property
    def out_dim(self) -> int:
        """Size ``d`` of each annotation."""
        return self.hidden * (2 if self.bidirectional else 1)

    def forward(self, src: Tensor, src_lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Encode ``src (b, j)`` ids with ``src_lengths (b,)`` real tokens per row (default all ``j``).

        Returns:
            ``annotations (b, j, d)`` (zero at padding) and the final states ``(l, b, hidden)``
            in ``nn.GRU`` order (layer by layer, forward then backward), each taken at the
            row's own last real token.
        """
        check_ids("src", src, self.vocab_size)
        b, j = src.shape
        if j == 0:
            raise ValueError(f"src: expected at least one token per row, got shape {tuple(src.shape)}")
        if src_lengths is None:
            src_lengths = torch.full((b,), j, dtype=torch.long, device=src.device)
        src_lengths = check_lengths("src_lengths", src_lengths, b, j)
        x = self.drop(self.embed(src))
        if b == 0:  # pack_padded_sequence refuses an empty batch; with no row, there is nothing to pack
            return self.rnn(x)
        # pack_padded_sequence wants the lengths on the CPU; enforce_sorted=False sorts internally.
        packed = nn.utils.rnn.pack_padded_sequence(x, src_lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, final = self.rnn(packed)
        annotations, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=j)
        return annotations, final

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, layers={self.layers}, bidirectional={self.bidirectional}"
