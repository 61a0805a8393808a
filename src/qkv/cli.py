"""The ``qkv`` command line: ``qkv demo``, ``qkv bench``, ``qkv plot``, ``qkv --version``."""

from __future__ import annotations

import argparse
import sys

import torch

from . import __version__


def tour() -> None:
    """The seed 002 worked example and one multi-head attention call."""
    import numpy as np

    import qkv

    words = torch.tensor([[1, 0, 0], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.float64)
    rng = np.random.RandomState(42)  # the seed's `random.seed(42)` then three `randint(3, size=(3, 3))`
    w_q, w_k, w_v = (torch.from_numpy(rng.randint(3, size=(3, 3))).double() for _ in range(3))
    out = qkv.attention(words @ w_q, words @ w_k, words @ w_v)
    print("seed 002: four words, W^Q, W^K, W^V from numpy seed 42, scaled dot-product attention")
    print(np.array2string(out.numpy(), precision=8))
    mha = qkv.MultiHeadAttention(dim=64, heads=8)
    x = torch.randn(2, 10, 64)
    y, w = mha(x, return_weights=True)
    print(f"MultiHeadAttention(dim=64, heads=8): x {tuple(x.shape)} -> y {tuple(y.shape)}, weights {tuple(w.shape)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qkv", description="Attention mechanisms for PyTorch.")
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="show attention at work")
    args = parser.parse_args(argv)
    if args.command == "demo":
        tour()
    return 0


if __name__ == "__main__":
    sys.exit(main())
