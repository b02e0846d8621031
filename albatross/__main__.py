"""``python -m albatross <command> ...``: the same as the ``albatross`` command."""

import sys

from albatross.cli import main

if __name__ == "__main__":
    sys.exit(main())
