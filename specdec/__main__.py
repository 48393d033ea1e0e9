"""``python -m specdec``: the CLI (``specdec.apps.cli``)."""

import sys

from specdec.apps.cli import main

sys.exit(main())
