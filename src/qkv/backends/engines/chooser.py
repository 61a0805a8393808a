"""The one place that picks the engine a call runs on.

Shape legend: none of its own (requests are ``(b, h, i, d)``, see ``backends.request``).

:data:`ENGINES` lists the engines fastest first; :func:`choose` takes the first that does
not refuse the request and keeps each faster one's reason. The chunked backend, a block
of keys (``engines.key_blocks``, for sequence parallelism) and ``qkv.explain`` all ask
here, so the engine ``explain`` names is the one that runs.
"""

from __future__ import annotations

from types import ModuleType

from ..request import Request
from . import alibi_column, fused_blocks, mod_tiles, online_softmax

#: The engines, fastest first; ``online_softmax`` runs every call, so the walk always ends.
ENGINES: tuple[ModuleType, ...] = (alibi_column, fused_blocks, mod_tiles, online_softmax)


def choose(req: Request) -> tuple[ModuleType, list[str]]:
    """The engine that runs ``req``, and ``"name: why not"`` for each faster one."""
    passed_over = []
    for engine in ENGINES:
        reason = engine.refuses(req)
        if reason is None:
            return engine, passed_over
        passed_over.append(f"{engine.name}: {reason}")
    raise RuntimeError("no engine runs this request")  # unreachable: online_softmax refuses nothing
