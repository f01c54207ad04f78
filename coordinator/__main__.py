"""``python -m coordinator``: the same as the ``pdserve`` command."""

import sys

from coordinator.cli import main

sys.exit(main())
