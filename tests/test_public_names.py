"""``import qkv``'s namespace: every public name is in ``qkv.__all__`` or is one of qkv's own modules."""

import types

import qkv


def test_every_public_name_of_qkv_is_exported_or_a_qkv_module():
    """A helper imported into ``qkv/__init__.py`` (``importlib.metadata.version`` was ``qkv.version``) is not an API."""
    stray = []
    for name in dir(qkv):
        if name.startswith("_") or name in qkv.__all__:
            continue
        value = getattr(qkv, name)
        if not (isinstance(value, types.ModuleType) and value.__name__.startswith("qkv.")):
            stray.append(name)
    assert stray == []


def test_everything_in_all_exists():
    assert [name for name in qkv.__all__ if not hasattr(qkv, name)] == []
