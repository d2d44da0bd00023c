"""``python -m server``: see :mod:`server.cli`."""

import sys

from server.cli import main

sys.exit(main())
