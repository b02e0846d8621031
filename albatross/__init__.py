"""The ``albatross`` command: one entry point for every stage (``albatross/cli.py``)."""
