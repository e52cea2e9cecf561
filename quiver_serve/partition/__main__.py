"""``python -m quiver_serve.partition``: see ``cli.py``."""

import sys

from quiver_serve.partition.cli import main

sys.exit(main())
