"""``python -m pretrain --config configs/pretrain/<recipe>.yaml [section.key=value ...]``

Launch as one process, under ``torchrun`` / the ``deepspeed`` launcher, or with ``srun`` (one
task per GPU); see docs/pretraining.md. Exit codes: 0 finished or stopped with a checkpoint
(``run_dir/status.json`` says which), 1 failed, 2 bad config or input (nothing was started), a
second job in the same run directory, or a full disk (the message names the path; the last
complete checkpoint is kept and the same command resumes from it once there is space).
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.recipe import load_recipe
from pretrain.config import PretrainConfig, pretrain_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML recipe (configs/pretrain/*.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=1e-3 engine.zero_stage=2"
    )
    parser.add_argument(
        "--init",
        metavar="DIR",
        help="continue pretraining from a release or a local HF ALBERT checkpoint (its "
        "architecture and weights; = model.init_from=DIR)",
    )
    parser.add_argument(
        "--print-config", action="store_true", help="print the resolved config and exit"
    )
    parser.add_argument(
        "--status",
        action="store_true",
        help="print the run's state (completed, stopped or none) from run_dir/status.json and "
        "exit; batch scripts use it to decide whether to requeue",
    )
    # The `deepspeed` launcher passes --local_rank; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> PretrainConfig:
    """The run's config from parsed arguments (the recipe, its overrides, ``--init``); every
    launcher builds it here."""
    overrides = [*args.overrides, *([f"model.init_from={args.init}"] if args.init else [])]
    return pretrain_config(load_recipe(args.config, overrides))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"python -m pretrain: config error: {e}", file=sys.stderr)
        return 2
    if args.status:
        import json
        from pathlib import Path

        status = Path(cfg.train.run_dir) / "status.json"
        print(json.loads(status.read_text())["state"] if status.is_file() else "none")
        return 0
    if args.print_config:
        from engine.recipe import to_yaml

        print(to_yaml(cfg.to_dict()))
        return 0
    from albatross.files import DiskFullError
    from pretrain.train import SetupError, run

    try:
        result = run(cfg)
    except (SetupError, DiskFullError) as e:  # after a full disk the run resumes from its last
        print(f"python -m pretrain: {e}", file=sys.stderr)  # complete checkpoint
        return 2
    except Exception as e:  # another process of the job died: say so plainly, last
        from pathlib import Path

        from engine.checkpoint import CheckpointStore
        from engine.distributed import report_lost_peer

        root = Path(cfg.train.run_dir) / "checkpoints"
        tag = CheckpointStore(root).latest_tag()
        if not report_lost_peer(e, "python -m pretrain", tag and str(root / tag)):
            raise
        return 1
    return 0 if result.state in ("completed", "stopped") else 1


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
