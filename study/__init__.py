"""Studies: a paper's table (or a comparison of our own) as a graph of the project's stages,
run locally or on Slurm, reported beside the paper's numbers (``study/cli.py``)."""
