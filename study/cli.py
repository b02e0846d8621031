"""``albatross study plan|run|status|report SPEC`` (= ``python -m study ...``): a paper's table,
or a comparison of our own, as one command.

    albatross study plan configs/studies/transject-lra.yaml --scale full      # stages, GPU-hours
    albatross study run configs/studies/transject-lra.yaml --scale full --executor slurm \\
        --data lra=/datasets/lra_release --partition gpu
    albatross study status configs/studies/transject-lra.yaml --scale full   # pending/running/...
    albatross study report configs/studies/transject-lra.yaml --scale full   # report.md, figures
    albatross study run configs/studies/main.yaml --scale tiny               # seconds, on a CPU

``--scale``: one of the spec's scales (default: the first it lists). ``--out``: the study's
directory (default ``runs/studies/<name>/<scale>``). ``--data NAME=PATH``, ``--partition``,
``--account``: the user's settings (also in ``~/.config/albatross/settings.yaml``, see
``study/settings.py``).

``run --executor local`` (default) runs every stage that is not done on this machine, ``--jobs``
CPU slots at a time, and writes the report at the end. ``run --executor slurm`` submits them
(one job per stage, an array per fine-tuning grid, ordered by ``afterok`` dependencies) and
returns; ``--wait`` waits for them and writes the report. Running ``run`` again submits only
what is missing: finished stages are skipped, queued ones are not submitted twice, failed and
cancelled ones run again (from their checkpoints).

Exit codes: 0 done (``run``: all stages done, or submitted), 1 a stage failed or a report check
failed, 2 a bad spec, option or missing data (nothing was run or submitted).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

COMMANDS = ("plan", "run", "status", "report")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m study", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        p = sub.add_parser(name, help=f"{name} a study")
        p.add_argument("spec", help="a study spec (configs/studies/<name>.yaml)")
        p.add_argument("--scale", help="one of the spec's scales (default: its first)")
        p.add_argument("--out", help="the study directory (default runs/studies/<name>/<scale>)")
        p.add_argument("--data", action="append", default=[], metavar="NAME=PATH",
                       help="a data set's path (repeatable); overrides the settings file")  # fmt: skip
        if name == "plan":
            p.add_argument("--throughput", help="a pretraining benchmark JSON for the estimate")
        if name == "run":
            p.add_argument("--executor", choices=("local", "slurm"), default="local")
            p.add_argument("--jobs", type=int, help="local: CPU slots (default: all cores)")
            p.add_argument("--partition", help="slurm: the partition (settings: slurm.partition)")
            p.add_argument("--account", help="slurm: the account (settings: slurm.account)")
            p.add_argument("--wait", action="store_true", help="slurm: wait, then report")
            p.add_argument("--timeout", type=float, help="slurm --wait: give up after seconds")
    return parser


def _graph(args):
    from study.graph import build_graph
    from study.settings import load_settings
    from study.spec import load_spec

    spec = load_spec(args.spec)
    scale = args.scale or next(iter(spec.scales))
    settings = load_settings(args.data, getattr(args, "partition", None),
                             getattr(args, "account", None))  # fmt: skip
    out = Path(args.out or Path("runs") / "studies" / spec.name / scale)
    return build_graph(spec, scale, out, settings), settings


def plan(args) -> int:
    import os

    from study.estimate import THROUGHPUT, estimate, format_estimate
    from study.graph import missing_data

    graph, _ = _graph(args)
    spec = graph.spec
    print(f"# {spec.name} at scale `{graph.scale}`: {len(graph.nodes)} stages\n")
    print(f"Study directory: {graph.out}\n")
    print("| stage | needs | runs | resources per job | done | directory |")
    print("|---|---|---|---|---|---|")
    for node in graph.order():
        r = node.resources
        where = "local" if r.gpus_per_node == 0 else f"{r.nodes} x {r.gpus_per_node} GPU"
        res = f"{where}, {r.tasks()} task(s)/node, {r.time}"
        done = f"{len(node.elements) - len(node.missing())}/{len(node.elements)}"
        needs = ", ".join(node.deps) or "–"
        print(f"| {node.id} | {needs} | {len(node.elements)} | {res} | {done} | "
              f"{os.path.relpath(node.dir, graph.out)} |")  # fmt: skip
    problems = missing_data(graph)
    if problems:
        print("\nData to give before `run`:\n" + "\n".join(f"- {p}" for p in problems))
    throughput = Path(args.throughput) if args.throughput else THROUGHPUT
    rows = estimate(graph, throughput)
    if rows:
        print(f"\n## Estimated cost\n\n{format_estimate(rows, throughput)}")
        print("Throughput per GPU scales linearly with GPUs; fine-tuning sequences counted at "
              "their max_length (an upper bound); evaluation and start-up not counted.")  # fmt: skip
    return 0


def run(args) -> int:
    from study.graph import missing_data
    from study.ledger import study_lock

    graph, settings = _graph(args)
    problems = missing_data(graph)
    if problems:
        raise ValueError("missing data, nothing run:\n  " + "\n  ".join(problems))
    todo = [n for n in graph.order() if not n.is_done()]
    print(f"study {graph.spec.name} at scale {graph.scale}: {len(graph.nodes) - len(todo)} of "
          f"{len(graph.nodes)} stages done; {len(todo)} to run; {graph.out}", flush=True)  # fmt: skip
    if args.executor == "slurm":
        missing = [b for b in ("sbatch", "squeue") if shutil.which(b) is None]
        if missing:
            raise ValueError(f"{' and '.join(missing)} not found: this machine is not a Slurm "
                             "submit host (use --executor local)")  # fmt: skip
        from study.slurm_exec import submit_nodes

        with study_lock(graph.out):
            jobs = submit_nodes(graph, todo, settings)
        if not args.wait:
            return 0
        return wait_and_report(graph, jobs, args.timeout)
    from study.local import run_local

    with study_lock(graph.out):
        outcome = run_local(graph, todo, args.jobs)
    failed = {k: v for k, v in outcome.items() if v != "done"}
    status = report_summary(graph)
    for node_id, why in failed.items():
        print(f"study: {node_id}: {why}", file=sys.stderr)
    return 1 if failed else status


def wait_and_report(graph, jobs: dict[str, list[str]], timeout: float | None) -> int:
    from slurm.monitor import TERMINAL_STATES
    from study.slurm_exec import job_states
    from study.status import format_status, stage_states

    ids = sorted({j for js in jobs.values() for j in js})
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        states = job_states(ids)
        live = [j for j in ids if j in states and states[j] not in TERMINAL_STATES]
        if not live:
            break
        if deadline is not None and time.monotonic() > deadline:
            print(f"study: still running after {timeout} s: {' '.join(live)}", file=sys.stderr)
            return 1
        time.sleep(2)
    states = stage_states(graph)
    status = report_summary(graph)
    if any(s.state != "done" for s in states):
        print(format_status(graph, states), file=sys.stderr)
        return 1
    return status


def report_summary(graph) -> int:
    from study.report import build_report

    text, _, checks = build_report(graph)
    print(text)
    print(f"report: {graph.out / 'report' / 'report.md'}")
    return 1 if checks else 0


def status(args) -> int:
    from study.status import format_status, stage_states

    graph, _ = _graph(args)
    print(format_status(graph, stage_states(graph)))
    return 0


def report(args) -> int:
    graph, _ = _graph(args)
    return report_summary(graph)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from study.ledger import StudyBusy

    try:
        return {"plan": plan, "run": run, "status": status, "report": report}[args.command](args)
    except (ValueError, StudyBusy) as e:
        print(f"study {args.command}: error: {e}", file=sys.stderr)
        return 2
