"""``python -m main_job --out runs/main [--families ...] [-- key=value ...]``: see
``main_job/pipeline.py``."""

from main_job.pipeline import main

if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
