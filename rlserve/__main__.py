"""``python -m rlserve ...`` = the ``rlserve`` command."""

import sys

from rlserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
