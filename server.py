#!/usr/bin/env python
"""``python server.py`` in a checkout: the ``quiver-serve`` command (``quiver_serve/cli.py``),
for running the daemon without installing the package. ``--help`` lists the options."""

import sys

from quiver_serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
