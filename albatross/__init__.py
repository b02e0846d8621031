"""The ``albatross`` command: one entry point for every stage (``albatross/cli.py``); and the
file operations every package shares, below all of them (they import nothing of the project):
durable writes and a full disk named (``files.py``), one writer per directory
(``writer_lock.py``)."""
