"""The figures of the benchmarks page measured on a GPU: the model step against HF ALBERT, and
pretraining steps through the engine (the recipes compiled and eager, compiled against eager,
TransJect, the attention kernels' priority, where the device time goes, depth)."""

from __future__ import annotations

import re

from benchmark_docs.util import (
    FAMILY,
    Results,
    family_order,
    gpu_name,
    md_table,
    msec,
    pct,
    registry,
    run_settings,
    source,
    sources,
    split_ms,
    step_ms,
    verdict,
    x,
)

SECTIONS, section = registry()

COMPILED = "gpu_h100_compiled/compiled/pretrain_gpu.json"
"""The recipes compiled on an H100: the page's reference pretraining step."""
EAGER_ALL = "gpu_h200/pretrain_gpu.json"
"""Every recipe, eager, on an H200: the one table with every family and configuration."""


def rows_of(d: dict) -> dict[tuple[str, str], dict]:
    """A throughput result's rows that ran, by (config, family), families in table order."""
    rows = [r for r in d["rows"] if "step_s" in r]
    rows.sort(key=lambda r: family_order(r["family"]))
    return {(r["name"], r["family"]): r for r in rows}


def error_text(row: dict) -> str:
    """A throughput row that did not run: its error in a few words."""
    error = row["error"]
    found = re.search(r"Required: (\d+) Hardware limit: ?(\d+)", error)
    if found:
        need, have = (int(v) // 1024 for v in found.groups())
        return (
            f"does not compile (a kernel needs {need} KB of shared memory, the card has {have} KB)"
        )
    return error.splitlines()[0].replace("exit -1: ", "")


@section
def model_gpu(res: Results) -> dict[str, str]:
    files = ["gpu_h100_transject/call2_model_and_syncs_compiled/model_gpu.json",
             "gpu_h200/model_gpu.json"]  # fmt: skip
    rows, ratios = [], {}
    for rel in files:
        d = res(rel)
        for r in d["rows"]:
            ratios[(gpu_name(d), r["seq"])] = r["ratio"]
            rows.append([gpu_name(d), r["seq"], msec(r["ours_s"]), msec(r["theirs_s"]),
                         f"**{r['ratio']:.3f}**",
                         f"{r['ours_peak_mb']:.0f} / {r['theirs_peak_mb']:.0f}"])  # fmt: skip
    table = md_table(["GPU", "seq", "ours (ms)", "HF ALBERT (ms)", "ours / HF",
                      "peak MB, ours / HF"], rows)  # fmt: skip
    at512 = {gpu: v for (gpu, seq), v in ratios.items() if seq == 512}
    return {
        "table": table,
        "source": sources(res, files),
        "ratios_512": ", ".join(f"{v:.3f} ({gpu})" for gpu, v in at512.items()),
        "verdict": verdict(max(ratios.values()) <= 1.0),
        "verdict_06": verdict(max(at512.values()) <= 0.6),
    }


def pretrain_table(
    rows: list[tuple[str, dict, dict | None]], peer_label: str = "vs softmax"
) -> str:
    """(label, row, the softmax row of its run or None) -> the pretraining table."""
    return md_table(
        ["recipe", "step ms, median (min)", peer_label, "MFU", "forward / backward / optimizer ms",
         "optimizer share", "peak GB"],
        [[label, step_ms(r), x(r["step_s"] / peer["step_s"]) if peer else "", pct(r["mfu"]),
          split_ms(r), pct(r.get("opt_share")), f"{r['peak_gb']:.2f}"] for label, r, peer in rows],
    )  # fmt: skip


@section
def gpu_compiled(res: Results) -> dict[str, str]:
    d = res(COMPILED)
    by = rows_of(d)
    soft = by[("albert-base-512", "softmax")]
    rows = [(FAMILY[f], r, soft) for (_, f), r in by.items()]
    big = res("gpu_h100_compiled/batch128/pretrain_gpu.json")["rows"][0]
    rows.append((f"softmax, micro-batch {big['batch']}", big, None))
    failed = []
    for rel in ("gpu_h100_compiled/autotune/pretrain_gpu.json",
                "gpu_h100_compiled/tisa_flex_dense/pretrain_gpu.json"):  # fmt: skip
        a = res(rel)["args"]
        for r in res(rel)["rows"]:
            if "error" in r:
                what = ", ".join(f"`{o}`" for o in a["override"])
                failed.append(f"{FAMILY[r['family']]} with {what}: {error_text(r)}")
    tisa, tj = by[("albert-base-512", "tisa")], by[("albert-base-512", "transject")]
    readme = md_table(
        ["family", "step (ms)", "vs softmax", "MFU"],
        [[FAMILY[f], f"{1e3 * r['step_s']:.1f}", x(r["step_s"] / soft["step_s"]), pct(r["mfu"])]
         for (_, f), r in by.items()],
    )  # fmt: skip
    return {
        "table": pretrain_table(rows),
        "settings": run_settings(d),
        "source": sources(res, [COMPILED, "gpu_h100_compiled/batch128/pretrain_gpu.json"]),
        "failed": "; ".join(failed) + ".",
        "failed_source": sources(
            res,
            [
                "gpu_h100_compiled/autotune/pretrain_gpu.json",
                "gpu_h100_compiled/tisa_flex_dense/pretrain_gpu.json",
            ],
        ),
        "gpu": d["machine"]["gpu"],
        "date": d["date"][:10],
        "peak": f"{d['meta']['peak_flops_bf16'] / 1e12:.1f} TFLOP/s",
        "readme_table": readme,
        "softmax_mfu": pct(soft["mfu"]),
        "softmax_ms": f"{1e3 * soft['step_s']:.1f} ms",
        "batch128_mfu": pct(big["mfu"]),
        "tisa_ratio": x(tisa["step_s"] / soft["step_s"]),
        "transject_ratio": x(tj["step_s"] / soft["step_s"]),
        "transject_ratio_min": x(tj["step_s_min"] / soft["step_s_min"]),
        "tisa_verdict": verdict(tisa["step_s"] / soft["step_s"] <= 1.2),
        "transject_verdict": verdict(tj["step_s"] / soft["step_s"] <= 1.5),
        "mfu_verdict": verdict(soft["mfu"] >= 0.45),
        "opt_shares": ", ".join(f"{FAMILY[f]} {pct(r['opt_share'])}" for (_, f), r in by.items()),
        "opt_verdict": opt_verdict(by),
    }


def opt_verdict(by: dict) -> str:
    over = [FAMILY[f] for (_, f), r in by.items() if r["opt_share"] > 0.03]
    under = [FAMILY[f] for (_, f), r in by.items() if r["opt_share"] <= 0.03]
    if not over:
        return verdict(True)
    return (f"{verdict(True)} for {', '.join(under)}; " if under else "") + (
        f"{verdict(False)} for {', '.join(over)}"
    )


@section
def gpu_eager(res: Results) -> dict[str, str]:
    d = res(EAGER_ALL)
    by = rows_of(d)
    rows = [(f"{name}, {FAMILY[f]}", r, by[(name, "softmax")]) for (name, f), r in by.items()]
    rows.sort(key=lambda t: (t[1]["name"], list(FAMILY).index(t[1]["family"])))
    z2 = res("gpu_h200/pretrain_zero2_gpu.json")["rows"][0]
    z0 = by[(z2["name"], z2["family"])]
    shares = [r["opt_share"] for r in by.values()]
    return {
        "table": pretrain_table(rows),
        "settings": run_settings(d),
        "source": sources(res, [EAGER_ALL, "gpu_h200/pretrain_zero2_gpu.json"]),
        "zero2": (f"ZeRO-2 ({z2['name']}, softmax): {1e3 * z2['step_s']:.1f} ms, {pct(z2['mfu'])} "
                  f"MFU, optimizer share {pct(z2['opt_share'])}, against ZeRO-0's "
                  f"{1e3 * z0['step_s']:.1f} ms"),
        "opt_range": f"{pct(min(shares))} to {pct(max(shares))}",
        "large_mfu": pct(by[("albert-large-512", "softmax")]["mfu"]),
        "large_transject_peak": f"{by[('albert-large-512', 'transject')]['peak_gb']:.1f} GB",
    }  # fmt: skip


PAIRS = [  # eager result, compiled result, configs, on one machine (one call) or two
    (EAGER_ALL, "gpu_h200/compile/pretrain_gpu.json", "albert-base-512", True),
    (EAGER_ALL, "gpu_h200/compile_large/pretrain_gpu.json", "albert-large-512", False),
    ("gpu_h200/eager_nopad/pretrain_gpu.json", "gpu_h200/compile_nopad/pretrain_gpu.json", None, True),
    ("gpu_h100_transject/cayley/pretrain_gpu.json",
     "gpu_h100_transject/call3_transject_compiled_and_syncs/compiled_transject.json",
     "albert-base-512", False),
]  # fmt: skip


@section
def gpu_compile(res: Results) -> dict[str, str]:
    rows, speedups, best = [], {}, {}
    for eager_rel, comp_rel, config, same in PAIRS:
        eager, comp = res(eager_rel), res(comp_rel)
        e_rows = rows_of(eager)
        for r in sorted(comp["rows"], key=lambda r: (r["name"], family_order(r["family"]))):
            if (config and r["name"] != config) or (r["name"], r["family"]) not in e_rows:
                continue
            e = e_rows[(r["name"], r["family"])]
            skipped = r["skipped_steps"] == len(r["step_s_all"])
            ratio = e["step_s"] / r["step_s"]
            if not skipped:
                speedups.setdefault(r["family"], []).append(ratio)
                if r["family"] == "softmax":
                    best[r["name"]] = max(best.get(r["name"], 0.0), r["mfu"])
            batches = "unpadded" if r.get("padding") == "none" else "padded"
            rows.append([gpu_name(comp), r["name"], FAMILY[r["family"]], batches,
                         f"{1e3 * e['step_s']:.1f}",
                         f"{1e3 * r['step_s']:.1f}",
                         "every timed step skipped (non-finite)" if skipped else f"**{x(ratio)}**",
                         "" if skipped else pct(r["mfu"]),
                         "one" if same else "two of one kind"])  # fmt: skip
    table = md_table(["GPU", "config", "family", "batches", "eager ms", "compiled ms", "speed-up",
                      "compiled MFU", "machines"], rows)  # fmt: skip
    step = res("fast_paths_compile_gpu.json")
    srows = step["rows"]
    step_table = md_table(
        ["family", "first step, compiling (s)", "eager (ms)", "compiled (ms)", "speed-up"],
        [[FAMILY[r["family"]], f"{r['first_step_s']:.0f}", f"{1e3 * r['eager_s']:.1f}",
          f"{1e3 * r['compiled_s']:.1f}", x(r["speedup"])] for r in srows],
    )  # fmt: skip
    first = [r["first_step_s"] for r in srows]
    a = step["args"]
    return {
        "table": table,
        "source": sources(res, list(dict.fromkeys(p for pair in PAIRS for p in pair[:2]))),
        "range": ", ".join(
            f"{FAMILY[f]} {'/'.join(x(v) for v in vs)}" for f, vs in speedups.items()
        ),
        "transject": x(speedups["transject"][0]),
        "step_table": step_table,
        "step_source": source(res, "fast_paths_compile_gpu.json"),
        "step_shape": f"{a['layers']} layers, batch {a['batch']} x {a['seq'].strip('[]')}",
        "first_step": f"{min(first):.0f} to {max(first):.0f} s",
        "large_mfu": pct(best.get("albert-large-512", 0.0)),
        "base_mfu": pct(best.get("albert-base-512", 0.0)),
        "large_verdict": verdict(best.get("albert-large-512", 0.0) >= 0.5),
    }


@section
def gpu_transject(res: Results) -> dict[str, str]:
    base = res("gpu_h100_transject/cayley/pretrain_gpu.json")
    acc = res("gpu_h100_transject/accum8/pretrain_gpu.json")
    comp = res("gpu_h100_transject/call3_transject_compiled_and_syncs/compiled_transject.json")
    large = res("gpu_h100_transject/large_transject_64/pretrain_gpu.json")
    b, a = rows_of(base), rows_of(acc)
    key = ("albert-base-512", "softmax")
    rows = [
        ("softmax, eager", b[key], b[key]),
        ("TransJect, eager", b[("albert-base-512", "transject")], b[key]),
        ("TransJect, compiled", comp["rows"][0], None),
        ("softmax, eager, accumulation 8", a[key], a[key]),
        ("TransJect, eager, accumulation 8", a[("albert-base-512", "transject")], a[key]),
        ("TransJect albert-large, eager", large["rows"][0], None),
    ]
    lg = large["rows"][0]
    return {
        "table": pretrain_table(rows),
        "source": sources(
            res,
            [
                "gpu_h100_transject/cayley/pretrain_gpu.json",
                "gpu_h100_transject/call3_transject_compiled_and_syncs/compiled_transject.json",
                "gpu_h100_transject/accum8/pretrain_gpu.json",
                "gpu_h100_transject/large_transject_64/pretrain_gpu.json",
            ],
        ),
        "settings": run_settings(base),
        "large_peak": f"{lg['peak_gb']:.1f} GB",
        "large_batch": str(lg["batch"]),
        "gpu_memory": "80 GB" if "80GB" in large["machine"]["gpu"] else large["machine"]["gpu"],
    }


@section
def gpu_sdpa(res: Results) -> dict[str, str]:
    runs = {(pad, prio): rows_of(res(f"gpu_h100_transject/sdpa_{prio}_{pad}/pretrain_gpu.json"))
            for pad in ("none", "one-short-row") for prio in ("default", "cudnn")}  # fmt: skip
    rows = []
    for pad in ("none", "one-short-row"):
        for fam in ("softmax", "tisa"):
            cells = []
            for prio in ("default", "cudnn"):
                r = runs[(pad, prio)][("albert-base-512", fam)]
                cells.append(f"{1e3 * r['step_s']:.1f} ({pct(r['mfu'])})")
            rows.append(["unpadded" if pad == "none" else "one row padded", FAMILY[fam], *cells])
    table = md_table(
        ["batches", "family", "torch's order: ms (MFU)", "cuDNN first: ms (MFU)"], rows
    )

    def ratio(pad: str) -> str:
        r = runs[(pad, "default")]
        return x(
            r[("albert-base-512", "tisa")]["step_s"] / r[("albert-base-512", "softmax")]["step_s"]
        )

    files = [f"gpu_h100_transject/sdpa_{p}_{d}/pretrain_gpu.json"
             for d in ("none", "one-short-row") for p in ("default", "cudnn")]  # fmt: skip
    return {"table": table, "source": sources(res, files), "tisa_unpadded": ratio("none"),
            "tisa_padded": ratio("one-short-row")}  # fmt: skip


KINDS = ["matrix products", "fused by the compiler", "attention", "linear algebra", "optimizer",
         "copies and casts", "other"]  # fmt: skip


@section
def gpu_profile(res: Results) -> dict[str, str]:
    rel = "gpu_h100_compiled/profile/profile_gpu.json"
    fams = sorted(res(rel)["families"], key=lambda f: family_order(f["family"]))
    steps = rows_of(res(COMPILED))

    def cell(f: dict, kind: str) -> str:
        ms = f["kinds"].get(kind, {}).get("ms", 0.0)
        return f"{ms:.1f}" if ms >= 0.05 else ""

    rows = [[kind, *(cell(f, kind) for f in fams)] for kind in KINDS]
    rows.append(["device time per step", *(f"**{f['self_ms_per_step']:.1f}**" for f in fams)])
    rows.append(
        [
            "the measured step (above)",
            *(f"{1e3 * steps[('albert-base-512', f['family'])]['step_s']:.1f}" for f in fams),
        ]
    )
    table = md_table(["ms per step", *(FAMILY[f["family"]] for f in fams)], rows)
    by = {f["family"]: f for f in fams}
    soft, tisa = by["softmax"]["kinds"], by["tisa"]["kinds"]
    return {
        "table": table,
        "source": source(res, rel),
        "tisa_attention": f"{tisa['attention']['ms']:.1f} ms",
        "softmax_attention": f"{soft['attention']['ms']:.1f} ms",
        "softmax_fused": f"{soft['fused by the compiler']['ms']:.1f} ms",
        "softmax_products": f"{soft['matrix products']['ms']:.1f} ms",
    }


@section
def gpu_depth(res: Results) -> dict[str, str]:
    rel = "depth_gpu.json"
    d = res(rel)
    rows = d["rows"]
    table = md_table(
        ["layer applications", "step ms, median (min)", "tokens/s", "MFU",
         "forward / backward / optimizer ms", "peak GB"],
        [[r["layers"], step_ms(r), f"{r['tokens_per_s']:,.0f}", pct(r["mfu"]), split_ms(r),
          f"{r['peak_gb']:.2f}"] for r in rows],
    )  # fmt: skip
    first, last = rows[1], rows[-1]
    per = (last["peak_gb"] - first["peak_gb"]) / (last["layers"] - first["layers"]) * 1024
    state = last["batch"] * last["seq"] * last["hidden"] * 2 / 2**20
    return {
        "table": table,
        "source": source(res, rel),
        "settings": run_settings(d),
        "per_layer": f"{per:.1f} MiB",
        "hidden_state": f"{last['batch']} x {last['seq']} x {last['hidden']} x 2 bytes = {state:.0f} MiB",
    }
