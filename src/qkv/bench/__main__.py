"""``python -m qkv.bench``: see :mod:`qkv.bench`."""

import sys

from . import main

sys.exit(main())
