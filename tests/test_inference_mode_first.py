"""A first call under ``torch.inference_mode()`` (a serving loop's), then the same call outside it.

The one-time probes (``tile_math``'s timed forms) made their tensors in the caller's mode and
then timed in-place operations outside inference mode, and buffers kept between calls
(``Int8Pages``' scratch and half-filled pages, ``KVCache(max_len=...)``'s preallocated keys)
were made in inference mode and written in place by a later call: each raised "Inplace update
to inference tensor outside InferenceMode". The probes' cases run in a fresh process, where no
probe has run yet.
"""

import subprocess
import sys

import pytest

CASES = {
    "soft cap, float32": "q = torch.randn(1, 2, 64, 8); call = lambda: qkv.attention(q, q, q, score_mod=qkv.SoftCap(5.0))",
    "soft cap, bfloat16": "q = torch.randn(1, 2, 64, 8).bfloat16(); call = lambda: qkv.attention(q, q, q, score_mod=qkv.SoftCap(5.0))",
    "padded rows with a soft cap": (
        "q = torch.randn(2, 4, 64, 8); m = qkv.masks.lengths(torch.tensor([30, 64]))\n"
        "call = lambda: qkv.attention(q, q, q, mask=m, causal=True, score_mod=qkv.SoftCap(3.0))"
    ),
    "int8 pages": (
        "from qkv.paged import Int8Pages\n"
        "cache = Int8Pages(80, 4, 2, 8); pages = torch.arange(80).repeat_interleave(4); offs = torch.arange(4).repeat(80)\n"
        "cache.write(pages, offs, torch.randn(320, 2, 8), torch.randn(320, 2, 8))\n"
        "table = (torch.arange(3), torch.tensor([0, 10, 20]), torch.arange(20), torch.tensor([4, 4])); q = torch.randn(2, 4, 8)\n"
        "call = lambda: qkv.paged_attention(q, cache, *table)"
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_first_call_in_inference_mode_leaves_later_calls_working(case):
    code = (
        "import torch, qkv\n"
        f"{CASES[case]}\n"
        "with torch.inference_mode():\n"
        "    first = call()\n"
        "again = call()\n"
        "assert torch.allclose(first.float(), again.float(), atol=1e-5)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_an_int8_cache_prefilled_in_inference_mode_takes_the_next_step_outside_it():
    """A half-filled page's full-precision copy was made in the caller's mode, so the next write outside inference mode
    raised (a fork in inference mode too)."""
    import torch

    import qkv

    cache = qkv.PagedKVCache(16, 4, 2, 8, quantized=True)
    cache.add("a")
    with torch.inference_mode():
        step = cache.plan({"a": 6})  # page 0 full, page 1 half full
        cache.write(0, step, torch.randn(6, 2, 8), torch.randn(6, 2, 8))
        cache.fork("a", "b")
    with torch.no_grad():
        step = cache.plan({"a": 1, "b": 1})
        cache.write(0, step, torch.randn(2, 2, 8), torch.randn(2, 2, 8))
        assert cache.attend(0, step, torch.randn(2, 4, 8)).shape == (2, 4, 8)


@pytest.mark.parametrize("beams", [False, True])
def test_a_preallocated_kv_cache_filled_in_inference_mode_takes_the_next_token_outside_it(beams):
    import torch

    import qkv

    mha = qkv.MultiHeadAttention(dim=16, heads=2).eval()
    cache = qkv.KVCache(max_len=16)
    x = torch.randn(2, 5, 16)
    with torch.inference_mode():
        mha(x, cache=cache, causal=True)
        if beams:
            cache.reorder(torch.tensor([1, 1]))
    with torch.no_grad():
        assert mha(torch.randn(2, 1, 16), cache=cache, causal=True).shape == (2, 1, 16)
