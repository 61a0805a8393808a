"""A small token vocabulary shared by the task generators.

Shape legend: ``n`` sequences in a batch, ``t`` padded sequence length.

Every task in :mod:`qkv.tasks` turns its raw strings into ids with a :class:`Vocabulary`,
so padding is id 0 everywhere and a model's embedding table can use ``padding_idx=0``.
The four special tokens always come first, in a fixed order, so two vocabularies built
from the same token list are identical (and equal) no matter which data set they serve.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

__all__ = ["Vocabulary"]


def _check_int(name: str, value: object, *, minimum: int) -> int:
    """Return ``value`` if it is an int >= ``minimum``, else raise a ValueError naming it.

    Shared by the task generators so every count argument fails with the same message.
    """
    # bool is an int subclass; n_train=True is a mistake, not the number 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return value


class Vocabulary:
    """Maps tokens (any strings: words, characters) to integer ids and back.

    Ids ``0..3`` are the specials ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``; the given
    tokens follow in the order given (duplicates keep their first position). Order is
    kept rather than sorted so the caller decides it, e.g. digits in numeric order.

    >>> v = Vocabulary("abc")
    >>> v.encode("cab", eos=True)
    [6, 4, 5, 2]
    >>> "".join(v.decode([6, 4, 5, 2, 0]))
    'cab'
    """

    specials: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    unk_id: int = 3

    def __init__(self, tokens: Iterable[str]) -> None:
        itos = list(self.specials)
        stoi = {token: index for index, token in enumerate(itos)}
        for token in tokens:
            if not isinstance(token, str):
                raise TypeError(f"tokens: expected strings, got {type(token).__name__} {token!r}")
            if token in self.specials:
                raise ValueError(
                    f"tokens: expected no special tokens {self.specials}, got {token!r}"
                )
            if token not in stoi:
                stoi[token] = len(itos)
                itos.append(token)
        self._itos = tuple(itos)
        self._stoi = stoi

    # ------------------------------------------------------------------ lookups
    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocabulary):
            return NotImplemented
        return self._itos == other._itos

    def __hash__(self) -> int:
        return hash(self._itos)

    def __repr__(self) -> str:
        shown = ", ".join(repr(t) for t in self._itos[4:12])
        more = ", ..." if len(self._itos) > 12 else ""
        return f"Vocabulary({len(self)} tokens: specials, {shown}{more})"

    @property
    def tokens(self) -> tuple[str, ...]:
        """All tokens in id order, specials included (``tokens[i]`` has id ``i``)."""
        return self._itos

    def id(self, token: str) -> int:
        """The id of ``token``; unknown tokens map to ``unk_id``."""
        return self._stoi.get(token, self.unk_id)

    def token(self, index: int) -> str:
        """The token with id ``index``."""
        if not 0 <= int(index) < len(self._itos):
            raise ValueError(f"index: expected an id in [0, {len(self._itos)}), got {index}")
        return self._itos[int(index)]

    # --------------------------------------------------------- single sequences
    def encode(self, tokens: Iterable[str], *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``tokens`` (a string iterates as characters), optionally framed by bos/eos."""
        ids = [self._stoi.get(token, self.unk_id) for token in tokens]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int] | Tensor, *, keep_special: bool = False) -> list[str]:
        """Tokens of ``ids``.

        By default the output is what a person wants to read back: padding and bos are
        dropped and decoding stops at the first eos (anything a model writes after it is
        noise). ``keep_special=True`` returns every token literally.
        """
        if isinstance(ids, Tensor):
            if ids.dim() != 1:
                raise ValueError(f"ids: expected a 1-D tensor, got shape {tuple(ids.shape)}")
            ids = ids.tolist()
        out: list[str] = []
        for index in ids:
            index = int(index)
            if not keep_special:
                if index == self.eos_id:
                    break
                if index in (self.pad_id, self.bos_id):
                    continue
            out.append(self.token(index))
        return out

    # ------------------------------------------------------------------ batches
    def pad(
        self, sequences: Sequence[Sequence[int]], *, length: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Right-pad id sequences with ``pad_id``.

        Returns ``ids (n, t)`` LongTensor and ``lengths (n,)`` LongTensor, where ``t`` is
        ``length`` if given, else the longest sequence.
        """
        lengths = [len(seq) for seq in sequences]
        longest = max(lengths, default=0)
        if length is None:
            length = longest
        elif length < longest:
            raise ValueError(
                f"length: expected at least the longest sequence ({longest}), got {length}"
            )
        # One tensor from nested lists: much faster than filling rows one at a time.
        rows = [list(seq) + [self.pad_id] * (length - len(seq)) for seq in sequences]
        ids = torch.tensor(rows, dtype=torch.long).reshape(len(rows), length)
        return ids, torch.tensor(lengths, dtype=torch.long)

    def encode_batch(
        self,
        sequences: Iterable[Iterable[str]],
        *,
        bos: bool = False,
        eos: bool = False,
        length: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Encode and pad: ``ids (n, t)`` LongTensor and ``lengths (n,)`` LongTensor."""
        encoded = [self.encode(seq, bos=bos, eos=eos) for seq in sequences]
        return self.pad(encoded, length=length)

    def decode_batch(self, ids: Tensor, *, keep_special: bool = False) -> list[list[str]]:
        """Decode each row of ``ids (n, t)``; see :meth:`decode`."""
        if ids.dim() != 2:
            raise ValueError(f"ids: expected a 2-D (n, t) tensor, got shape {tuple(ids.shape)}")
        return [self.decode(row, keep_special=keep_special) for row in ids]
