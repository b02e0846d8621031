"""``python -m main_job --out runs/main [--families ...] [-- key=value ...]``: see
``main_job/pipeline.py``."""

import sys

from main_job.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
