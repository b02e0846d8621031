"""``python -m finetune glue ...`` (GLUE), ``glue-summary``, ``lra ...`` (Long Range Arena),
``lra-summary`` (every LRA run below a directory, beside the published numbers),
``lra-shards ...`` (an LRA task's inputs as pretraining shards, for self-pretraining),
``compare`` (can the runs of two or more models be told apart: bootstrap intervals).

Exit codes: 0 done, 2 bad arguments, config or data (nothing was trained), 75 stopped by a
signal (SIGTERM, SIGUSR1, SIGUSR2) or ``train.time_budget_minutes`` with a checkpoint saved: run
the same command again to resume (runs of a sweep that finished are skipped).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from albatross.files import DiskFullError
from albatross.writer_lock import DirectoryBusy
from engine.engine import shutdown


def _number(kind: type, option: str, key: str):
    """An argparse type for --seeds / --lrs that names the usual mistake: a dotted override
    after the option, which nargs="+" takes as one more value."""

    def parse(value: str):
        try:
            return kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not a number: {option} takes every value after it; put key=value "
                f"overrides before {option}, or set {key}=[...] as an override"
            ) from None

    return parse


def _documented(sub, name: str, module: str, help: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows ``module``'s docstring."""
    return sub.add_parser(
        name,
        help=help,
        description=importlib.import_module(module).__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m finetune", description=__doc__)
    sub = parser.add_subparsers(dest="suite", required=True)
    glue = _documented(
        sub, "glue", "finetune.glue.run", "GLUE tasks from a release or a local HF ALBERT"
    )
    glue.add_argument(
        "--task", required=True, help="cola|sst2|mrpc|stsb|qqp|mnli|qnli|rte|wnli|all"
    )
    glue.add_argument(
        "--data",
        required=True,
        help="GLUE data (the root, or one task's folder) in any of three layouts: the original "
        "TSVs (glue_data/<Task>/*.tsv, AX in diagnostic/diagnostic.tsv), HF "
        "DatasetDict.save_to_disk dirs (<config>/dataset_dict.json), or a Hub snapshot of "
        "nyu-mll/glue (<config>/<split>-00000-of-00001.parquet)",
    )
    glue.add_argument("--init", required=True, help="release dir, or a local HF ALBERT dir")
    glue.add_argument("--config", help="recipe (default: configs/finetune/glue/<task>.yaml)")
    glue.add_argument("--attention", choices=("softmax", "tisa"), help="HF import: attention")
    glue.add_argument(
        "--seeds", type=_number(int, "--seeds", "seeds"), nargs="+", help="one run per seed"
    )
    glue.add_argument(
        "--lrs", type=_number(float, "--lrs", "lrs"), nargs="+", help="learning-rate sweep"
    )
    glue.add_argument(
        "--no-summary",
        action="store_true",
        help="skip results.md and submission/ (array jobs; then run glue-summary)",
    )
    glue.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.eval_every=100")
    summary = sub.add_parser(
        "glue-summary", help="results.md, results.json and submission/ of a GLUE run dir"
    )
    summary.add_argument("run_dir", help="the run_dir of the GLUE runs")
    lra = _documented(
        sub, "lra", "finetune.lra.run", "a Long Range Arena task, from scratch or from a release"
    )
    lra.add_argument("--task", required=True, help="listops|text|retrieval|image|pathfinder|pathx")
    lra.add_argument("--data", required=True, help="the task's data directory (official layout)")
    lra.add_argument("--config", help="recipe (configs/finetune/lra/*.yaml)")
    lra.add_argument(
        "--protocol",
        choices=("lra", "skyformer"),
        help="use the shipped recipe configs/finetune/lra/<protocol>/<task>[-<family>].yaml",
    )
    lra.add_argument("--family", help="with --protocol: softmax|tisa|kernel|transject")
    lra.add_argument(
        "--no-summary",
        action="store_true",
        help="skip the run dir's results.md (array jobs; then run lra-summary)",
    )
    lra.add_argument("--init", help="release dir to start from (default: from scratch)")
    lra.add_argument(
        "--seeds", type=_number(int, "--seeds", "seeds"), nargs="+", help="one run per seed"
    )
    lra.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.eval_every=100")
    lra_summary = sub.add_parser(
        "lra-summary", help="results.md / results.json of every LRA run below a directory"
    )
    lra_summary.add_argument("run_dir", help="a directory holding LRA runs (searched recursively)")
    shards = _documented(
        sub,
        "lra-shards",
        "finetune.lra.shards",
        "an LRA task's training inputs as pretraining shards (self-pretraining)",
    )
    shards.add_argument(
        "--task", required=True, help="listops|text|retrieval|image|pathfinder|pathx"
    )
    shards.add_argument("--data", required=True, help="the task's data directory (official layout)")
    shards.add_argument("--out", required=True, help="the shard directory to write")
    shards.add_argument("--max-length", type=int, help="data tokens per document (default: task's)")
    shards.add_argument("--num-shards", type=int, default=1)
    shards.add_argument("--splits", nargs="+", default=["train"], help="splits whose inputs to use")
    shards.add_argument("--difficulty", help="Pathfinder / Path-X: easy|intermediate|hard")
    shards.add_argument("--split-seed", type=int, default=0, help="Pathfinder split seed")
    comp = _documented(
        sub, "compare", "finetune.compare", "scores of models and their differences, with intervals"
    )
    comp.add_argument(
        "models", nargs="+", help="one directory per model (its runs: every predictions.npz "
        "below it, one per seed); the first is the reference"
    )  # fmt: skip
    comp.add_argument("--split", required=True, help="a labelled evaluation set, e.g. dev, test")
    comp.add_argument("--metric", default="accuracy", help="accuracy|mcc|f1|pearson|spearman")
    comp.add_argument("--at", default="best", choices=("best", "last"), help="which evaluation")
    comp.add_argument("--resamples", type=int, default=2000, help="bootstrap rounds")
    comp.add_argument("--level", type=float, default=0.95, help="the intervals' level")
    comp.add_argument("--out", help="also write the rows as JSON here")
    comp.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from pathlib import Path

    from finetune.glue import run as glue_run

    try:
        if args.suite == "glue-summary":
            print(glue_run.summarise_dir(Path(args.run_dir)))
            return 0
        if args.suite == "lra-summary":
            from finetune.lra import run as lra_run

            print(lra_run.summarise_dir(Path(args.run_dir)))
            return 0
        if args.suite == "compare":
            from finetune import compare

            return compare.main(args)
        if args.suite == "lra-shards":
            from finetune.lra import shards as lra_shards

            return lra_shards.main(args)
        if args.suite == "lra":
            from finetune.lra import run as lra_run

            return lra_run.main(args, args.overrides)
        return glue_run.main(args, args.overrides)
    except (ValueError, FileNotFoundError, DiskFullError, DirectoryBusy) as e:
        print(f"python -m finetune {args.suite}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # another process of the job died: say so plainly, last
        from engine.distributed import report_lost_peer

        if not report_lost_peer(e, f"python -m finetune {args.suite}"):
            raise
        return 1
    finally:
        shutdown()


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
