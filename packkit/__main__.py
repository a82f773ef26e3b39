"""``python -m packkit``: the ``packkit`` command (as ``python -m packkit.cli``)."""

import sys

from .cli import main

sys.exit(main())
