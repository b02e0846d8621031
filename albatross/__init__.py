"""The ``albatross`` command: one entry point for every stage (``albatross/cli.py``); and what
every package shares, below all of them (these modules import nothing of the project): durable
writes and a full disk named (``files.py``), one writer per directory (``writer_lock.py``), and
every private name of torch, DeepSpeed and Python (``compat.py``)."""
