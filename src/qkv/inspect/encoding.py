"""How the ``qkv inspect`` page carries its data: weights as 16-bit fixed point, JSON safe inside ``<script>``.

Shape legend: ``l`` layers, ``h`` heads, ``i`` query rows, ``j`` keys.
"""

from __future__ import annotations

import base64
import json

import numpy as np


def encode_weights(weights: np.ndarray) -> str:
    """``weights (l, h, i, j)`` in 0..1 as base64 of little-endian uint16 ``round(w * 65535)``."""
    fixed = np.round(np.clip(weights, 0.0, 1.0) * 65535.0).astype("<u2")
    return base64.b64encode(fixed.tobytes()).decode("ascii")


def script_json(payload: dict) -> str:
    """JSON that is safe inside a <script> element (no "</script>", no HTML specials)."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
