"""``python -m study plan|run|status|report SPEC``: see ``study/cli.py``."""

from study.cli import main

if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
