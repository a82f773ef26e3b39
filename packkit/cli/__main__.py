"""``python -m packkit.cli``: the ``packkit`` command."""

from . import main

raise SystemExit(main())
