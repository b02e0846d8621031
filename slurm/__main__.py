"""``python -m slurm {pretrain,finetune,data-prep} [options] -- STAGE_ARGS``: see
``slurm/launcher.py`` (and ``--help``)."""

import sys

from slurm.launcher import main

if __name__ == "__main__":
    sys.exit(main())
