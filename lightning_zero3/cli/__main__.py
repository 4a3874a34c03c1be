"""``python -m lightning_zero3.cli fit ...``: the ``lightning-zero3`` command."""

import sys

from . import main

sys.exit(main())
