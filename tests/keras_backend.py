"""Keras 3 on its torch backend for the tests that compare qkv with Keras' layers, or a skip of the module importing it.

``from keras_backend import keras, keras_dtypes, KERAS_MASK_WARNING`` before anything else imports keras:
the backend is chosen at keras' first import.
"""

import os

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported
os.environ.setdefault("KERAS_TORCH_DEVICE", "cpu")  # CPU tests, where Keras would take a GPU
try:
    import keras
    from keras.src.backend.common import dtypes as keras_dtypes
except ImportError as error:  # pragma: no cover - the extra is not installed
    pytest.skip(f"keras is not importable ({error}): pip install '.[keras]'", allow_module_level=True)
if keras.backend.backend() != "torch":  # pragma: no cover
    pytest.skip(f"keras runs on its {keras.backend.backend()} backend, set before this test imported it; "
                "these tests compare torch tensors (KERAS_BACKEND=torch)", allow_module_level=True)  # fmt: skip

#: Keras warns that its own projections drop the masks MultiHeadAttention has already read.
KERAS_MASK_WARNING = pytest.mark.filterwarnings("ignore:Layer '.*' \\(of type EinsumDense\\) was passed an input with a mask")

__all__ = ["KERAS_MASK_WARNING", "keras", "keras_dtypes"]
