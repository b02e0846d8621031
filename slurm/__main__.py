"""``python -m slurm {pretrain,finetune,data-prep} [options] -- STAGE_ARGS``: see
``slurm/launcher.py`` (and ``--help``)."""

from slurm.launcher import main

if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
