"""The scripts of ``examples/`` as modules, for their tests."""

import importlib.util
import sys
from pathlib import Path

FOLDER = Path(__file__).resolve().parent.parent / "examples"


def load(name: str):
    """``examples/{name}.py`` imported as module ``name`` (once; later calls give the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, FOLDER / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
