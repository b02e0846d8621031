"""The figures of the benchmarks page from report files (mini-LRA, the paper studies) and the
targets' summary, which gathers the other sections' verdicts."""

from __future__ import annotations

from benchmark_docs.util import FAMILY, Results, md_table, registry, sources

SECTIONS, section = registry()


@section
def mini_lra(res: Results) -> dict[str, str]:
    from finetune.compare import Interval, format_interval
    from finetune.lra.mini import curve_table, interval_table, table

    rel = "mini_lra_cpu.json"
    d = res(rel)
    rows = d["rows"]
    by = {(r["task"], r["family"], r["init"]): r for r in rows}
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fams = list(dict.fromkeys(r["family"] for r in rows))
    inits = list(dict.fromkeys(r["init"] for r in rows))
    shortcut = d["shortcut"]
    short = md_table(
        ["model", *(f"{t}, {i}" for t in tasks for i in inits)],
        [["best shortcut baseline",
          *(f"{100 * shortcut[t]['accuracy']:.1f}" for t in tasks for _ in inits)]]
        + [[FAMILY[f], *(f"{100 * by[(t, f, i)]['median']:.1f} ± {50 * by[(t, f, i)]['spread']:.1f}"
                         for t in tasks for i in inits)] for f in fams],
    )  # fmt: skip

    def iv(task: str, fam: str, init: str, key: str) -> str:
        return format_interval(Interval(**by[(task, fam, init)]["intervals"][key]))

    return {
        "table": table(rows, d["baselines"]).strip(),
        "intervals": interval_table(rows).strip(),
        "curves": curve_table(rows).strip(),
        "source": sources(res, [rel]),
        "minutes": f"{d['minutes']:.1f}",
        "seeds": str(len(d["seeds"])),
        "readme_table": short,
        "transject_listops": (f"{iv('listops', 'transject', 'scratch', 'vs_softmax')} from scratch, "
                              f"{iv('listops', 'transject', 'self-pretrained', 'vs_softmax')} "
                              "self-pretrained"),
        "tisa_listops": iv("listops", "tisa", "scratch", "vs_softmax"),
        "listops_shortcut": f"{100 * shortcut['listops']['accuracy']:.1f}%",
        "text_shortcut": f"{100 * shortcut['text']['accuracy']:.1f}%",
    }  # fmt: skip


def study_status(by_scale: dict[str, dict]) -> str:
    """What a study's committed reports show: a full-scale comparison, or only that it runs."""
    if "full" in by_scale:
        verdicts: dict[str, int] = {}
        for r in by_scale["full"]["rows"]:
            verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
        return "the paper's scale ran: " + ", ".join(f"{n} {v}" for v, n in verdicts.items())
    scales = ", ".join(f"`{s}`" for s in by_scale)
    return f"every stage runs end to end (scale {scales}); the paper's scale has not run"


def short_citation(citation: str) -> str:
    """ "Yorsh, U., Kovalenko, A. (2022). Title" -> "Yorsh and Kovalenko (2022)"."""
    authors, _, rest = citation.partition("(")
    surnames = [p.strip() for p in authors.strip().rstrip(".").split(", ")][::2]
    year = rest.split(")")[0]
    names = (surnames[0] if len(surnames) == 1 else f"{surnames[0]} and {surnames[1]}"
             if len(surnames) == 2 else f"{surnames[0]} et al.")  # fmt: skip
    return f"{names} ({year})"


@section
def studies(res: Results) -> dict[str, str]:
    files = res.glob("studies/*.json")
    reports: dict[str, dict[str, dict]] = {}
    for rel in files:
        d = res(rel)
        reports.setdefault(d["study"], {})[d["scale"]] = d
    rows = []
    for name, by_scale in reports.items():
        paper = next(iter(by_scale.values()))["paper"]
        cited = f"{short_citation(paper['citation'])}, {paper['table']}" if paper else "–"
        status = study_status(by_scale)
        rows.append([f"`{name}`", cited, status])
    table = md_table(["study", "paper", "reproduction"], rows)
    return {"table": table, "source": sources(res, files), "readme": table}


README_BLOCK = """\
Measured figures, each with the command and the machine behind it:
[docs/benchmarks.md](docs/benchmarks.md).

**Pretraining step**, ALBERT-base at sequence length 512, micro-batch 64, the shipped recipes
compiled, one {{ gpu_compiled.gpu }} ({{ gpu_compiled.date }}):

{{ gpu_compiled.readme_table }}

**Mini-LRA on a CPU** (two small LRA-style tasks, every family from scratch and
self-pretrained, {{ mini_lra.seeds }} seeds; test accuracy in %, median ± half the spread):

{{ mini_lra.readme_table }}

**Paper studies** ([docs/studies.md](docs/studies.md)):

{{ studies.readme }}
"""
"""README.md's results block; its placeholders are this page's figures."""
