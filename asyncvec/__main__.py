"""``python -m asyncvec``: the ``asyncvec`` command (``python -m asyncvec --help``)."""

import sys

from asyncvec.cli import main

if __name__ == "__main__":
    sys.exit(main())
