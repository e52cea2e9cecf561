"""``python -m quiver_serve``: the ``quiver-serve`` command (``quiver_serve/cli.py``)."""

import sys

from quiver_serve.cli import main

if __name__ == "__main__":
    sys.argv[0] = "python -m quiver_serve"  # for --help and errors
    sys.exit(main())
