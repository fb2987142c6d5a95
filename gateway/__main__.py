"""``python -m gateway`` is the ``fencegate`` command."""

import sys

from gateway.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
