"""RoPE's frequencies stretched for contexts longer than training's: linear, dynamic NTK, YaRN and Llama 3.

Shape legend: ``r`` the rotated dims, ``k = 0 .. r/2 - 1`` a pair's index.

Plain RoPE turns pair ``k`` by ``θ_k = base^(-2k / r)`` per position. A model trained on
``L`` positions and run on more sees angles it never saw; each scheme below changes the
``θ_k`` (and YaRN the rotation's length too), in the form Hugging Face configs give it
(``rope_scaling`` / ``rope_parameters``: ``{"rope_type": ..., "factor": s, ...}``), so a
checkpoint's setting is passed as it is:

* ``"linear"`` (position interpolation, Chen et al. 2023): ``θ_k / s``;
* ``"dynamic"`` (dynamic NTK): the base grows with the sequence, ``n`` its positions (the
  cache's and the new ones; at least ``L``): ``base · (s·n/L - (s - 1))^(r / (r - 2))``. Keys
  cached under a shorter ``n`` keep their angles, as in transformers; rows standing elsewhere
  (a rank's shard, a serving step's requests) do not hold ``n`` and are refused;
* ``"yarn"`` (Peng et al. 2023, "YaRN"): pair ``k`` interpolated (``θ_k / s``) where its
  wavelength is long, kept where short, a linear ramp between the pairs that turn
  ``beta_fast`` (32) and ``beta_slow`` (1) times over ``L`` positions; and the rotated dims
  scaled by ``attention_factor`` (default ``0.1 ln s + 1``, or
  ``mscale(s, mscale) / mscale(s, mscale_all_dim)`` as DeepSeek's configs give it), which
  multiplies the logits' rotated part by its square;
* ``"llama3"`` (Llama 3.1): wavelengths ``2π/θ_k`` above ``L / low_freq_factor`` divided by
  ``s``, below ``L / high_freq_factor`` kept, between them a smooth blend.

``L`` is ``original_max_position_embeddings``. Checked against transformers'
``ROPE_INIT_FUNCTIONS`` in the test suite.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

#: Each scheme's settings: required, and optional with their defaults.
SCHEMES = {
    "default": ((), {}),
    "linear": (("factor",), {}),
    "dynamic": (("factor", "original_max_position_embeddings"), {}),
    "yarn": (("factor", "original_max_position_embeddings"),
             {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None,
              "truncate": True}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {}),
}  # fmt: skip


#: Plain RoPE's settings: the paper's frequencies.
DEFAULT = {"rope_type": "default"}


def scaling_settings(scaling: dict | None, base: float, rotated: float = 1.0) -> dict:
    """``scaling`` checked: ``{"rope_type": name, setting: value}`` with every setting its scheme reads.

    ``"type"`` is read as ``"rope_type"`` (older configs); ``"rope_theta"`` must equal ``base``
    and ``"partial_rotary_factor"`` the rotated share of the head, ``rotated`` (transformers 5's
    dicts carry both); a setting the scheme does not read is refused: silently ignoring one
    would run another scheme than the checkpoint's. YaRN's ``beta_fast``, ``beta_slow``,
    ``mscale`` and ``mscale_all_dim`` read 0 (or None) as not given, and ``truncate`` as a truth
    value, as transformers reads them.
    """
    if scaling is None:
        return dict(DEFAULT)
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling: expected a dict such as {{'rope_type': 'llama3', 'factor': 8.0, ...}}, got "
                        f"{type(scaling).__name__}")  # fmt: skip
    given = dict(scaling)
    kind = given.pop("rope_type", None) or given.pop("type", None) or "default"
    given.pop("type", None)
    if kind not in SCHEMES:
        raise ValueError(f"scaling: rope_type {kind!r} is not one of {sorted(SCHEMES)}")
    theta = given.pop("rope_theta", None)
    if theta is not None and not math.isclose(float(theta), base):
        raise ValueError(f"scaling: rope_theta {theta} differs from base={base}; pass base={theta}")
    share = given.pop("partial_rotary_factor", None)
    if share is not None and not math.isclose(float(share), rotated, abs_tol=1e-9):
        raise ValueError(f"scaling: partial_rotary_factor {share} differs from rotary_dim / dim_head = {rotated:g}; "
                         "pass rotary_dim = dim_head · partial_rotary_factor")  # fmt: skip
    required, optional = SCHEMES[kind]
    missing = [name for name in required if given.get(name) is None]
    if missing:
        # (transformers reads a dynamic scheme's L, and a YaRN factor left out, from the model config's
        # max_position_embeddings, which a rope_scaling dict alone does not hold)
        raise ValueError(f"scaling: rope_type {kind!r} needs {', '.join(missing)} (original_max_position_embeddings: "
                         "the positions the model was trained on, a config's max_position_embeddings where its "
                         "rope_scaling does not name it)")  # fmt: skip
    unknown = sorted(set(given) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"scaling: rope_type {kind!r} reads {sorted((*required, *optional))}, not {unknown}")
    zero_is_unset = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # transformers: `get(...) or default`
    given = {k: v for k, v in given.items() if not (k in zero_is_unset and v == 0)}
    settings = {"rope_type": kind, **optional, **{k: v for k, v in given.items() if v is not None or k == "truncate"}}
    for name, value in settings.items():
        if name in ("rope_type", "truncate") or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"scaling: {name} must be a finite number > 0, got {value!r}")
    if kind == "llama3" and settings["high_freq_factor"] <= settings["low_freq_factor"]:
        raise ValueError("scaling: llama3's high_freq_factor must exceed its low_freq_factor, got "
                         f"{settings['high_freq_factor']} and {settings['low_freq_factor']}")  # fmt: skip
    return settings


def frequencies(rotary_dim: int, base: float, settings: dict, length: int | None = None) -> tuple[Tensor, float]:
    """``(θ (r/2,) float64, attention_factor)`` of a scheme's ``settings`` (:func:`scaling_settings`); ``length``:
    the sequence's positions, ``max + 1`` (``"dynamic"`` only)."""
    kind, r = settings["rope_type"], rotary_dim
    exponents = torch.arange(0, r, 2, dtype=torch.float64) / r
    theta = base**-exponents
    if kind == "default":
        return theta, 1.0
    factor = settings["factor"]
    if kind == "linear":
        return theta / factor, 1.0
    original = settings["original_max_position_embeddings"]
    if kind == "dynamic":
        n = max(length or original, original)
        grown = base * ((factor * n / original) - (factor - 1)) ** (r / (r - 2)) if r > 2 else base
        return grown**-exponents, 1.0
    if kind == "llama3":
        # the blend clamped to [0, 1] is transformers' three ranges exactly (0 past L / low_freq_factor: θ / s; 1 below
        # L / high_freq_factor: θ), written as FlashInfer's kernel writes it, which also holds at low_freq_factor = 0
        low, high = settings["low_freq_factor"], settings["high_freq_factor"]
        blend = ((original * theta / (2 * math.pi) - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - blend) * theta / factor + blend * theta, 1.0
    return _yarn(theta, r, base, factor, original, settings)


def _yarn(theta: Tensor, r: int, base: float, factor: float, original: int, settings: dict) -> tuple[Tensor, float]:
    """YaRN's blend of interpolated and kept pairs, and its attention factor."""

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns ``turns`` times over L positions
        return r * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = pair_turning(settings["beta_fast"]), pair_turning(settings["beta_slow"])
    if settings["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(r // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)  # 0: kept, 1: interpolated
    blended = theta / factor * ramp + theta * (1 - ramp)
    attention = settings["attention_factor"]
    if attention is None:
        m, m_all = settings["mscale"], settings["mscale_all_dim"]
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return blended, float(attention)


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's length factor for a stretch of ``scale``: ``0.1 · m · ln s + 1`` (1 for ``s <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_factor(settings: dict) -> float:
    """What DeepSeek's MLA multiplies its softmax scale by under these settings (transformers' ``yarn_apply_mscale``):
    ``mscale(s, mscale_all_dim)²`` where a YaRN stretch gives ``mscale_all_dim``, else 1."""
    m = settings.get("mscale_all_dim")
    return mscale(settings["factor"], m) ** 2 if settings["rope_type"] == "yarn" and m else 1.0
