"""Test set-up: one torch thread (the tensors are tiny; pytest-xdist runs a worker per core,
and more threads only spin-wait on a shared 2-core machine), fixed seeds, and the oneDNN
routes taken wherever they apply (``qkv._probe``: a timing probe would make the route, and
the float rounding, depend on how busy the machine is; ``tests/test_probe.py`` tests it), and
an inductor cache per CPU capability; and no page table's plan kept from one test to the next
(``qkv.paged.recent``: a test that patches how a plan is made must see its patch used)."""

import os
import tempfile

import pytest
import torch

# inductor's on-disk cache is keyed without ATEN_CPU_CAPABILITY: kernels built under one
# capability were loaded (and aborted, or gave garbage) under another, so each capability gets
# its own cache, set before anything imports inductor (qkv does not; torch.nn.attention.varlen does)
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"qkv-inductor-{torch.backends.cpu.get_cpu_capability().lower()}"),
)

from qkv import _probe  # noqa: E402
from qkv.paged import recent  # noqa: E402

torch.set_num_threads(1)
_probe.set_route("onednn")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    recent.forget()


@pytest.fixture(scope="session")
def dist_pool():
    """Four spawned gloo processes for the distributed tests (``tests/distributed_pool.py``)."""
    from distributed_pool import Pools

    pools = Pools()
    yield pools
    pools.close()
