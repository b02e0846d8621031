"""``python -m albatross <command> ...``: the same as the ``albatross`` command."""

from albatross.cli import run

if __name__ == "__main__":
    run()
