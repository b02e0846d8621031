"""``study report``: ``report.md``, ``report.json`` and figures in ``<out>/report/``.

For every number of the paper's table: the paper's number, ours (aggregated over seeds as the
paper aggregates: mean or median; the spread max - min), our mean's 95 % bootstrap interval
(``finetune.compare``: over the evaluation examples and the seeds), the difference ours - paper
and a plain verdict: **consistent** when the paper's number lies within our interval (widened by
the paper's reported spread, where it gives one), else **below** or **above** the paper. Then
each variant against the study's reference variant (paired over the same examples) beside the
paper's own difference: what the paper claims, and whether our runs agree. A report of any
scale but ``full`` says in its title that it is not the paper's protocol.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from study import figures
from study.graph import Graph
from study.results import TaskResult, baselines, export_matches, pretrain_summary, task_results


def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "–"
    return f"{value:+.1f}" if signed else f"{value:.1f}"


def _interval(result: TaskResult | None) -> str:
    if result is None or result.interval is None:
        return "–"
    i = result.interval
    return f"{100 * i.estimate:.1f} [{100 * i.low:.1f}, {100 * i.high:.1f}]"


def verdict(result: TaskResult | None, paper: float, spread: float) -> tuple[str, list | None]:
    """("consistent" | "below the paper" | "above the paper" | "not run", the interval of ours
    - paper in points)."""
    if result is None:
        return "not run", None
    if result.interval is None:
        return "no interval (no predictions saved)", None
    low, high = 100 * result.interval.low - paper, 100 * result.interval.high - paper
    if low - spread <= 0 <= high + spread:
        return "consistent", [low, high]
    return ("below the paper" if high + spread < 0 else "above the paper"), [low, high]


def _reported_as(graph: Graph, variant: str) -> str:
    return graph.spec.variants[variant].reported_as or variant


def _label(graph: Graph, variant: str) -> str:
    v = graph.spec.variants[variant]
    return v.label or variant


def paper_rows(graph: Graph, results: dict) -> list[dict[str, Any]]:
    paper = graph.spec.paper
    if paper is None:
        return []
    rows = []
    for variant in graph.spec.variants:
        numbers = paper.results.get(_reported_as(graph, variant), {})
        for task, number in numbers.items():
            if number is None:
                continue
            ours = results.get((variant, task))
            word, diff = verdict(ours, number, paper.spread)
            rows.append({"variant": variant, "task": task, "paper": number,
                         "ours": None if ours is None else ours.aggregate,
                         "spread": None if ours is None else ours.spread,
                         "seeds": 0 if ours is None else len(ours.values),
                         "interval": None if ours is None or ours.interval is None
                         else ours.interval.to_dict(),
                         "difference_interval": diff, "verdict": word,
                         "metric": ours.metric if ours else None})  # fmt: skip
    return rows


def reference_rows(graph: Graph, results: dict) -> list[dict[str, Any]]:
    """Each variant minus the reference variant, task by task (paired), with the paper's."""
    from finetune.compare import bootstrap_difference
    from study.results import _metric_fn

    ref = graph.spec.reference or next(iter(graph.spec.variants))
    paper = graph.spec.paper
    rows = []
    for (variant, task), mine in results.items():
        theirs = results.get((ref, task))
        if variant == ref or theirs is None or mine.predictions is None:
            continue
        if theirs.predictions is None or len(theirs.predictions[1]) != len(mine.predictions[1]):
            continue
        labels = mine.predictions[1]
        diff = bootstrap_difference(labels, mine.predictions[0], theirs.predictions[0],
                                    _metric_fn(mine.metric, task, labels))  # fmt: skip
        claimed = None
        if paper is not None:
            a = paper.results.get(_reported_as(graph, variant), {}).get(task)
            b = paper.results.get(_reported_as(graph, ref), {}).get(task)
            claimed = None if a is None or b is None else a - b
        agrees = None
        if claimed is not None:
            agrees = 100 * diff.low <= claimed <= 100 * diff.high
        rows.append({"variant": variant, "reference": ref, "task": task,
                     "difference": diff.to_dict(), "told_apart": diff.excludes_zero,
                     "paper_difference": claimed, "agrees": agrees})  # fmt: skip
    return rows


def _title(graph: Graph) -> str:
    spec = graph.spec
    title = spec.title or spec.name
    note = spec.scales[graph.scale].description
    if spec.paper is None:
        return f"{title} — scale `{graph.scale}`" + (f" ({note})" if note else "")
    if graph.scale != "full":
        return f"{title} — scale `{graph.scale}`, NOT the paper's protocol ({note or 'smaller'})"
    return title


def build_report(graph: Graph, out: Path | None = None) -> tuple[str, dict[str, Any], list[str]]:
    """(report.md's text, report.json's data, the failed checks) written to ``out``."""
    out = out or graph.out / "report"
    (out / "figures").mkdir(parents=True, exist_ok=True)
    spec = graph.spec
    results = task_results(graph)
    rows = paper_rows(graph, results)
    diffs = reference_rows(graph, results)
    base = baselines(graph)
    pretraining = [p for n in graph.order() if n.kind == "pretrain"
                   if (p := pretrain_summary(n)) is not None]  # fmt: skip
    exports = {n.variant: export_matches(graph, n) for n in graph.order() if n.kind == "export"}
    checks = []
    for p in pretraining:
        if not p["check_loss"] or p["mlm_loss_first"] is None:
            continue
        if not p["mlm_loss_last"] < p["mlm_loss_first"]:
            checks.append(f"{p['node']}: the MLM loss did not decrease")
    checks += [f"{v}.export: the exported release differs from the run's"
               for v, same in exports.items() if same is False]  # fmt: skip

    md = [f"# {_title(graph)}", ""]
    if spec.paper is not None:
        p = spec.paper
        md += [f"Reproduces {p.table} of {p.citation}" + (f" ({p.url})" if p.url else "") + ".",
               "", f"Paper's protocol: {p.protocol} Aggregated over runs by the {p.aggregate} "
               f"({p.runs} runs per number).", ""]  # fmt: skip
        if p.notes:
            md += [p.notes, ""]
    if spec.description:
        md += [spec.description.strip(), ""]
    done = sum(n.is_done() for n in graph.order())
    md += [f"Scale `{graph.scale}`: {done} of {len(graph.nodes)} stages done; study directory "
           f"`{graph.out}`; made {time.strftime('%Y-%m-%d %H:%M %Z')}.", ""]  # fmt: skip
    if rows:
        md += ["## The paper's numbers beside ours", "",
               "x 100. Ours: the runs' aggregate (the paper's: "
               f"{spec.paper.aggregate}), spread = max - min over seeds, and the mean with its "
               "95% bootstrap interval; ours - paper: that interval minus the paper's number; "
               "consistent: the paper's number is inside our interval"
               + (f" widened by the paper's spread (±{spec.paper.spread})" if spec.paper.spread
                  else "") + ".", "",
               "| variant | task | metric | paper | ours | seeds | spread | mean [95% interval] | "
               "ours - paper | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            ours = results.get((r["variant"], r["task"]))
            d = r["difference_interval"]
            diff = "–" if d is None else f"[{d[0]:+.1f}, {d[1]:+.1f}]"
            md.append(f"| {_label(graph, r['variant'])} | {r['task']} | {r['metric'] or '–'} | "
                      f"{r['paper']:.1f} | {_pct(r['ours'])} | {r['seeds']} | "
                      f"{_pct(r['spread'])} | {_interval(ours)} | {diff} | {r['verdict']} |")  # fmt: skip
        counts: dict[str, int] = {}
        for r in rows:
            counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        md += ["", "Verdicts: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())), ""]
    ours_only = [r for k, r in results.items()
                 if not any(x["variant"] == k[0] and x["task"] == k[1] for x in rows)]  # fmt: skip
    if ours_only:
        md += ["## Our runs without a paper number", "",
               "| variant | task | metric | ours | seeds | spread | mean [95% interval] |",
               "|---|---|---|---|---|---|---|"]  # fmt: skip
        md += [
            f"| {_label(graph, r.variant)} | {r.task} | {r.metric} | {_pct(r.aggregate)} | "
            f"{len(r.values)} | {_pct(r.spread)} | {_interval(r)} |"
            for r in ours_only
        ]
        md.append("")
    if diffs:
        ref = diffs[0]["reference"]
        md += [f"## Each variant against {_label(graph, ref)}", "",
               "Ours: the difference of the means over seeds, x 100, with its 95% bootstrap "
               "interval (the same examples for both, paired); `*`: told apart (the interval "
               "excludes 0). Paper: the difference of the paper's numbers; agrees: inside our "
               "interval.", "",
               "| task | variant | ours | paper | agrees |", "|---|---|---|---|---|"]  # fmt: skip
        for r in diffs:
            d = r["difference"]
            star = " *" if r["told_apart"] else ""
            claimed = "–" if r["paper_difference"] is None else f"{r['paper_difference']:+.1f}"
            agrees = {None: "–", True: "yes", False: "no"}[r["agrees"]]
            md.append(f"| {r['task']} | {_label(graph, r['variant'])} | "
                      f"{100 * d['estimate']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"
                      f"{star} | {claimed} | {agrees} |")  # fmt: skip
        md.append("")
    if base:
        md += ["## Trivial baselines (test accuracy x 100)", "",
               "Fit on train, scored once on test (`python -m finetune.lra.baselines`): what a "
               "model must beat before it says anything about long-range reasoning.", "",
               "| task | " + " | ".join(sorted({k for b in base.values() for k in b})) + " |"]  # fmt: skip
        names = sorted({k for b in base.values() for k in b})
        md.append("|---" * (len(names) + 1) + "|")
        md += [f"| {t} | " + " | ".join(_pct(b.get(k)) for k in names) + " |"
               for t, b in sorted(base.items())]  # fmt: skip
        md.append("")
    if pretraining:
        md += ["## Pretraining", "",
               "| variant | steps | MLM loss first -> last | validation MLM | SOP acc | tokens/s | "
               "export matches |", "|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in pretraining:
            val = "–" if p["validation_mlm_loss"] is None else f"{p['validation_mlm_loss']:.3f}"
            sop = "–" if p["sop_accuracy_last"] is None else f"{p['sop_accuracy_last']:.2f}"
            tps = "–" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}"
            same = {None: "–", True: "yes", False: "NO"}[exports.get(p["variant"])]
            md.append(f"| {_label(graph, p['variant'])} | {p['steps']} | "
                      f"{p['mlm_loss_first']:.3f} -> {p['mlm_loss_last']:.3f} | {val} | {sop} | "
                      f"{tps} | {same} |")  # fmt: skip
        md.append("")
    pictures = _figures(graph, results, pretraining, out / "figures")
    if pictures:
        md += ["## Figures", ""] + [f"![{p.stem}](figures/{p.name})" for p in pictures] + [""]
    missing = [n.id for n in graph.order() if not n.is_done()]
    if missing:
        md += ["## Not done yet", "", ", ".join(missing) + " (`study status` says why).", ""]
    if checks:
        md += ["## Failed checks", ""] + [f"- {c}" for c in checks] + [""]
    data = {"study": spec.name, "scale": graph.scale, "title": _title(graph),
            "paper": None if spec.paper is None else {"citation": spec.paper.citation,
                                                      "table": spec.paper.table},
            "rows": rows, "ours": [r.to_dict() for r in results.values()],
            "differences": diffs, "baselines": base,
            "pretraining": [{k: v for k, v in p.items() if k != "curve"} for p in pretraining],
            "exports": exports, "missing": missing, "checks": checks}  # fmt: skip
    text = "\n".join(md)
    (out / "report.md").write_text(text)
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    return text, data, checks


def _figures(graph, results, pretraining, out: Path) -> list[Path]:
    paths: list[Path] = []
    paper = graph.spec.paper
    tasks = sorted({t for _, t in results})
    for task in tasks:
        rows = []
        for variant in graph.spec.variants:
            number = None
            if paper is not None:
                number = paper.results.get(_reported_as(graph, variant), {}).get(task)
            ours = results.get((variant, task))
            if ours is not None or number is not None:
                rows.append((_label(graph, variant), ours, number))
        paths.append(figures.score_figure(task, rows, out))
        curves = {_label(graph, v): r for (v, t), r in results.items() if t == task}
        curve = figures.finetuning_figure(task, curves, out)
        if curve is not None:
            paths.append(curve)
    picture = figures.pretraining_figure(
        {_label(graph, p["variant"]): p["curve"] for p in pretraining}, out
    )
    return [*paths, *([picture] if picture else [])]
