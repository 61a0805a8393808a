"""The exact engines behind the ``chunked`` backend and sequence parallelism, under one contract.

Each engine computes exact softmax attention and every row's log-sum-exp, forward and
backward, in bounded memory (``contract``: ``refuses``, ``forward``, ``backward``).

==================  ==================================================================
``alibi_column``    ALiBi as one extra q/k column through the fused CPU kernel, where a
                    one-time timing says that beats the masked kernel on this CPU
``fused_blocks``    dot-form scores through PyTorch's fused CPU kernel per query block,
                    each block's bias and mask built lazily (or a strided offset view)
``mod_tiles``       dot-form scores with a ``score_mod``, in cache-sized tiles on threads
``online_softmax``  everything: any score, mask, bias, ``score_mod`` and dropout, tile by
                    tile with an online softmax and a recomputing backward
==================  ==================================================================

``chooser.choose`` picks the first that does not refuse a request (the only place that
does); ``call.run`` runs it under the one autograd wrapper (sinks, dropout seed,
parameters, weights); ``key_blocks`` runs it on one block of keys of a larger softmax.
Adding an engine: a module with ``name``, ``refuses``, ``forward`` and ``backward``
(``contract``), placed in ``chooser.ENGINES`` by speed.
"""

from __future__ import annotations

from .call import run
from .chooser import ENGINES, choose

__all__ = ["ENGINES", "choose", "run"]
