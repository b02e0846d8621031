"""Slurm for every stage: sbatch templates (``*.sbatch``), a one-node test cluster
(``cluster.sh``) and the submitit launcher ``python -m slurm`` (``launcher.py``: one task per GPU,
preemption -> checkpoint -> requeue, job arrays for sharded data prep and sweeps; its parts are
``cli.py``, ``plan.py``, ``submit.py``, ``job.py`` and ``monitor.py``)."""
