"""sbatch templates and the submitit launcher (`python -m slurm`). Built by issue #5."""
