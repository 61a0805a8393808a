"""A first call under ``torch.inference_mode()`` (a serving loop's), then the same call outside it.

The one-time probes (``tile_math``'s timed forms) made their tensors in the caller's mode and
then timed in-place operations outside inference mode, and ``Int8Pages`` kept scratch buffers
made in inference mode that a later call wrote in place: both raised "Inplace update to
inference tensor outside InferenceMode". Each case runs in a fresh process, where no probe has
run yet.
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
