"""``python -m packkit.cli``: the ``packkit`` command."""

import sys

from . import main

sys.exit(main())
