"""``python -m nbkit``: the command line (:mod:`nbkit.cli`)."""

import sys

from .cli import main

sys.exit(main())
