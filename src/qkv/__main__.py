"""``python -m qkv``: the same command line as the ``qkv`` script."""

import sys

from .cli import main

sys.exit(main())
