"""The figures of the benchmarks page measured or counted on a CPU: the model step against HF
ALBERT, attention scaling, pretraining and the engine, the data pipeline, memory traffic."""

from __future__ import annotations

from benchmark_docs.util import (
    FAMILY,
    Results,
    gib,
    md_table,
    msec,
    pct,
    registry,
    source,
    sources,
    split_ms,
    step_ms,
    verdict,
    x,
)

SECTIONS, section = registry()


@section
def model(res: Results) -> dict[str, str]:
    rel = "model_cpu.json"
    rows = res(rel)["rows"]
    table = md_table(
        ["seq", "ours (s)", "HF ALBERT (s)", "ours / HF"],
        [[r["seq"], f"{r['ours_s']:.3f}", f"{r['theirs_s']:.3f}", f"**{r['ratio']:.3f}**"]
         for r in rows],
    )  # fmt: skip
    return {
        "cpu_table": table,
        "cpu_source": source(res, rel),
        "cpu_ratios": ", ".join(f"{r['ratio']:.3f} at seq {r['seq']}" for r in rows),
        "cpu_verdict": verdict(max(r["ratio"] for r in rows) <= 1.0),
    }


# ----------------------------------------------------------------------------- attention scaling

SCALING_FAMILIES = ["softmax", "tisa", "kernel", "kernel-elu", "transject"]


def scaling_tables(d: dict, with_memory: bool) -> tuple[str, str, dict]:
    """(times table, speed-up table, {(family, N): speed-up over softmax}) of a scaling result."""
    by = {(r["family"], r["N"]): r for r in d["rows"]}
    lengths = sorted({r["N"] for r in d["rows"]})
    fams = [f for f in SCALING_FAMILIES if any(f == r["family"] for r in d["rows"])]
    speed = {(f, n): by[("softmax", n)]["seconds"] / by[(f, n)]["seconds"]
             for f in fams for n in lengths if (f, n) in by and ("softmax", n) in by}  # fmt: skip

    def cell(r: dict) -> str:
        return f"{msec(r['seconds'])} ({r['peak_mb']:.0f})" if with_memory else msec(r["seconds"])

    unit = "ms (MB)" if with_memory else "ms"
    times = md_table(
        ["N", *(f"{FAMILY[f]} {unit}" for f in fams)],
        [[n, *(cell(by[(f, n)]) if (f, n) in by else "" for f in fams)] for n in lengths],
    )
    others = [f for f in fams if f != "softmax"]
    speedups = md_table(
        ["N", "softmax ms", *(FAMILY[f] for f in others)],
        [[n, msec(by[("softmax", n)]["seconds"]),
          *(x(speed[(f, n)]) if (f, n) in speed else "" for f in others)] for n in lengths],
    )  # fmt: skip
    return times, speedups, speed


def faster_from(speed: dict, family: str) -> int | None:
    """The shortest length from which `family` is at least softmax's speed at every length."""
    lengths = sorted(n for f, n in speed if f == family)
    for i, n in enumerate(lengths):
        if all(speed[(family, m)] >= 1.0 for m in lengths[i:]):
            return n
    return None


@section
def scaling(res: Results) -> dict[str, str]:
    cpu_times, cpu_speedups, speed = scaling_tables(res("scaling_cpu.json"), with_memory=True)
    linear = ("kernel", "kernel-elu", "transject")
    froms = {f: faster_from(speed, f) for f in linear}
    top = max(n for _, n in speed)
    out = {
        "cpu_times": cpu_times,
        "cpu_speedups": cpu_speedups,
        "cpu_source": source(res, "scaling_cpu.json"),
        "cpu_from": "; ".join(f"{FAMILY[f]} from N = {n}" for f, n in froms.items()),
        "cpu_top": ", ".join(f"{FAMILY[f]} {x(speed[(f, top)])}" for f in linear),
        "cpu_top_n": str(top),
        "cpu_tisa_top": x(speed[("tisa", top)]),
        "cpu_verdict": verdict(all(n is not None and n <= 1024 for n in froms.values())),
    }
    gpu = {
        "h100": "gpu_h100_transject/scaling_nomask/scaling_gpu.json",
        "h200": "gpu_h200/scaling_gpu.json",
        "compiled": "gpu_h100_compiled/scaling_compiled/scaling_gpu.json",
    }
    for key, rel in gpu.items():
        _, table, sp = scaling_tables(res(rel), with_memory=False)
        out[f"{key}_speedups"] = table
        out[f"{key}_source"] = source(res, rel)
        out[f"{key}_kernel_from"] = str(faster_from(sp, "kernel"))
        out[f"{key}_kernel_4096"] = x(sp[("kernel", 4096)])
        out[f"{key}_kernel_8192"] = x(sp[("kernel", 8192)])
        out[f"{key}_kernel_verdict"] = verdict(sp[("kernel", 4096)] >= 1.0)
        if ("transject", 16384) in sp:
            out[f"{key}_transject_16384"] = x(sp[("transject", 16384)])
            out[f"{key}_tisa_16384"] = x(sp[("tisa", 16384)])
    return out


# ----------------------------------------------------------------------------- CPU pretraining


@section
def cpu_pretrain(res: Results) -> dict[str, str]:
    rel = "pretrain_cpu.json"
    table = md_table(
        ["config", "family", "params", "step ms, median (min)", "tokens/s", "samples/s",
         "forward / backward / optimizer ms"],
        [[r["name"], FAMILY[r["family"]], f"{r['params'] / 1e6:.2f} M", step_ms(r),
          f"{r['tokens_per_s']:,.0f}", f"{r['samples_per_s']:.1f}", split_ms(r)]
         for r in res(rel)["rows"]],
    )  # fmt: skip
    eng = res("engine.json")["results"]
    names = {"plain": "plain PyTorch loop", "engine/torch": "engine, torch backend",
             "engine/deepspeed-zero0": "engine, DeepSpeed ZeRO-0",
             "engine/deepspeed-zero2": "engine, DeepSpeed ZeRO-2"}  # fmt: skip
    engine_table = md_table(
        ["variant", "steps/s", "time vs plain loop"],
        [[names.get(k, k), f"{v['steps_per_s']:.2f}", f"{v['time_ratio_vs_plain']:.3f}"]
         for k, v in eng.items()],
    )  # fmt: skip
    worst = max(v["time_ratio_vs_plain"] for v in eng.values())
    return {
        "table": table,
        "source": source(res, rel),
        "engine_table": engine_table,
        "engine_source": source(res, "engine.json"),
        "engine_worst": f"{100 * (worst - 1):.0f}%",
        "engine_verdict": verdict(worst <= 1.15),
    }


# ----------------------------------------------------------------------------- data


def loader_table(rows: list[dict]) -> str:
    return md_table(
        ["config", "seq", "batch", "workers", "loader alone, batches/s", "trainer step ms",
         "data wait ms", "data-wait share", "headroom"],
        [[r["config"], r["seq"], r["batch"], r["workers"], f"{r['loader']['batches_per_s']:.0f}",
          f"{1e3 * r['trainer']['step_total_s']:.1f}", f"{1e3 * r['trainer']['data_s']:.1f}",
          f"**{pct(r['trainer']['share']['data'])}**", f"{r['headroom']:.0f}x"] for r in rows],
    )  # fmt: skip


@section
def loader(res: Results) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, rel in (("cpu", "loader_cpu.json"), ("gpu", "loader_gpu.json")):
        rows = res(rel)["rows"]
        out[f"{key}_table"] = loader_table(rows)
        out[f"{key}_source"] = source(res, rel)
        workers = [r["trainer"]["share"]["data"] for r in rows if r["workers"] > 0]
        out[f"{key}_workers"] = ", ".join(pct(s) for s in workers)
        out[f"{key}_verdict"] = verdict(max(workers) < 0.05)
        out[f"{key}_no_workers"] = ", ".join(
            pct(r["trainer"]["share"]["data"]) for r in rows if r["workers"] == 0
        )
    return out


@section
def grouping(res: Results) -> dict[str, str]:
    d = res("length_grouping_cpu.json")
    table = md_table(
        ["seq", "examples", "full-length examples", "batch", "grouping (window, chunk)",
         "unpadded batches", "padding share", "mean width"],
        [[r["seq"], r["examples"], pct(r["full_length_share"]), r["batch"],
          "off" if r["grouping"] == "off" else f"{r['window']}, {r['chunk']}",
          f"**{pct(r['unpadded_share'])}**", pct(r["padding_share"]), f"{r['mean_width']:.1f}"]
         for r in d["loader"]],
    )  # fmt: skip
    syn = {(r["seq"], r["batch"], r["world"], r["grouping"]): r for r in d["synthetic"]}
    synthetic = md_table(
        ["seq", "examples", "full-length", "batch x ranks", "unpadded, off", "unpadded, on",
         "padding share, off -> on"],
        [[s, syn[(s, b, w, "on")]["examples"], pct(syn[(s, b, w, "on")]["full_length_share"]),
          f"{b} x {w}", pct(syn[(s, b, w, "off")]["unpadded_share"]),
          f"**{pct(syn[(s, b, w, 'on')]['unpadded_share'])}**",
          f"{pct(syn[(s, b, w, 'off')]['padding_share'])} -> "
          f"{pct(syn[(s, b, w, 'on')]['padding_share'])}"]
         for s, b, w in sorted({k[:3] for k in syn})],
    )  # fmt: skip
    cost = md_table(
        ["seq", "batch", "loader batch, off (ms)", "on (ms)", "batch order, off (µs)", "on (µs)"],
        [[r["seq"], r["batch"], f"{1e3 * r['off']['batch_s']:.2f}",
          f"{1e3 * r['on']['batch_s']:.2f}", f"{1e6 * r['off']['order_s']:.1f}",
          f"{1e6 * r['on']['order_s']:.1f}"] for r in d["cost"]],
    )  # fmt: skip
    ft = res("fast_paths_grouping_cpu.json")
    finetune = md_table(
        ["batching", "padding share", "tokens computed", "epoch (s)"],
        [[name, pct(ft[key]["padding_share"]), f"{ft[key]['tokens_computed']:,}",
          f"{ft[key]['epoch_s']:.1f}"]
         for name, key in (("shuffled", "shuffled"), ("`group_by_length`", "grouped"))],
    )  # fmt: skip
    tokens = ft["shuffled"]["tokens_computed"] / ft["grouped"]["tokens_computed"]
    return {
        "table": table,
        "synthetic": synthetic,
        "cost": cost,
        "source": source(res, "length_grouping_cpu.json"),
        "finetune": finetune,
        "finetune_source": source(res, "fast_paths_grouping_cpu.json"),
        "finetune_tokens": x(tokens, 1),
        "finetune_epoch": x(ft["epoch_speedup"], 1),
    }


@section
def data_prep(res: Results) -> dict[str, str]:
    r = res("data_prep_cpu.json")["row"]
    table = md_table(
        ["corpus", "procs", "ours tokens/s", "HF tokens/s", "ours MB/s per proc",
         "HF MB/s per proc", "ours / HF", "peak RSS of the largest process, ours / HF (MB)"],
        [[f"{r['size_mb']:.0f} MB ({r['corpus_tokens'] / 1e6:.1f} M tokens)", r["procs"],
          f"{r['ours_tokens_per_s'] / 1e3:.0f}k", f"{r['theirs_tokens_per_s'] / 1e3:.0f}k",
          f"{r['ours_mb_per_s_per_proc']:.2f}", f"{r['theirs_mb_per_s_per_proc']:.2f}",
          f"**{r['ratio']:.2f}**", f"{r['ours_peak_rss_mb']:.0f} / {r['theirs_peak_rss_mb']:.0f}"]],
    )  # fmt: skip
    return {"table": table, "source": source(res, "data_prep_cpu.json"),
            "ratio": x(r["ratio"]), "verdict": verdict(r["ratio"] >= 1.0)}  # fmt: skip


@section
def sentences(res: Results) -> dict[str, str]:
    rel = "sentence_split_cpu.json"
    d = res(rel)
    ranked = sorted(d["results"].items(), key=lambda kv: -kv[1]["quality"]["f1"])
    rows = []
    for name, r in ranked:
        q, s = r["quality"], r["speed"]
        version = d["versions"].get(name)
        rows.append([f"{name} ({version})" if version else name,
                     f"{q['true_positives']} of {q['boundaries']}", q["false_positives"],
                     f"{q['precision']:.3f}", f"{q['recall']:.3f}", f"{q['f1']:.3f}",
                     f"{q['paragraphs_exact']}/{q['paragraphs']}",
                     f"{s['sentences_per_s'] / 1e3:.1f}k", f"{s['chars_per_s'] / 1e6:.2f}"])  # fmt: skip
    table = md_table(
        ["splitter (version)", "boundaries found", "false boundaries", "precision", "recall", "F1",
         "paragraphs exact", "sentences/s", "M characters/s"], rows)  # fmt: skip
    p = d["pipeline"]
    return {
        "table": table,
        "source": source(res, rel),
        "best": next(name for name, _ in ranked if name in d["versions"]),
        "split_document": f"{d['split_document']['chars_per_s'] / 1e6:.1f}",
        "pipeline": (f"`shards --sentences split` {p['shards_split_s']:.1f} s, `--sentences lines` "
                     f"{p['shards_lines_s']:.1f} s, on {p['characters'] / 1e6:.1f} M characters"),
    }  # fmt: skip


# ----------------------------------------------------------------------------- memory traffic


def by_family(d: dict) -> dict[str, dict]:
    return {r["family"]: r for r in d["rows"]}


@section
def traffic(res: Results) -> dict[str, str]:
    def table(rel: str, unit: str) -> str:
        d = res(rel)
        rows = by_family(d)
        soft = rows["softmax"]["target_gb"]
        a = d["args"]
        return md_table(
            ["family", f"{unit} / step", f"memory-bound {unit}", "KB / token",
             f"GB at {a['target_batch']} x {a['seq']}", f"ms at {a['bandwidth'] / 1e12:.2f} TB/s",
             "vs softmax"],
            [[FAMILY[f], r["ops_per_step"], r["memory_ops_per_step"], f"{r['per_token_kb']:.0f}",
              gib(r["target_gb"]), f"{r['target_ms']:.1f}", x(r["target_gb"] / soft)]
             for f, r in rows.items()],
        )  # fmt: skip

    e = by_family(res("traffic_per_token_cpu.json"))
    c = by_family(res("traffic_compiled_cpu.json"))
    fp32_c = by_family(res("traffic_compiled_norm_output_fp32_cpu.json"))
    fp32_e = by_family(res("traffic_per_token_norm_output_fp32_cpu.json"))
    norm = md_table(
        ["family", "compiled, LayerNorms return fp32 (GB)", "compiled, `compute` (GB)",
         "eager, fp32 (GB)", "eager, `compute` (GB)"],
        [[FAMILY[f], gib(fp32_c[f]["target_gb"]), gib(c[f]["target_gb"]),
          gib(fp32_e[f]["target_gb"]) if f in fp32_e else "",
          gib(e[f]["target_gb"]) if f in fp32_e else ""] for f in fp32_c],
    )  # fmt: skip
    f_e = by_family(res("traffic_forward_4096_cpu.json"))
    f_c = by_family(res("traffic_forward_4096_compiled_cpu.json"))
    forward = md_table(
        ["family", "eager: operators, GB", "compiled: kernels, GB"],
        [[FAMILY[f], f"{f_e[f]['ops_per_step']}, {gib(f_e[f]['target_gb'])}",
          f"{f_c[f]['ops_per_step']}, {gib(f_c[f]['target_gb'])}"] for f in f_e],
    )  # fmt: skip
    train = []
    for name, stem in (("softmax", "softmax"), ("kernel (aoglu)", "kernel_torch"),
                       ("kernel, `training_backend=triton`", "kernel_triton")):  # fmt: skip
        for mode, suffix in (("eager", ""), ("compiled", "_compiled")):
            train.append((f"{name}, {mode}", mode, res(f"traffic_train_4096/{stem}{suffix}.json")))
    soft = {m: d["rows"][0]["per_token_kb"] for n, m, d in train if n.startswith("softmax")}
    train_table = md_table(
        ["one layer's step, 8 x 4096", "operators (kernels)", "KB per token", "GB",
         "over softmax's KB per token"],
        [[name, d["rows"][0]["ops_per_step"], f"**{d['rows'][0]['per_token_kb']:.0f}**",
          gib(d["rows"][0]["target_gb"]),
          "" if name.startswith("softmax") else f"+{d['rows'][0]['per_token_kb'] - soft[mode]:.0f}"]
         for name, mode, d in train],
    )  # fmt: skip
    stream = by_family(res("traffic_compiled_transject_stream_compute_cpu.json"))["transject"]
    bandwidth = res("traffic_per_token_cpu.json")["args"]["bandwidth"]
    return {
        "eager": table("traffic_per_token_cpu.json", "operators"),
        "compiled": table("traffic_compiled_cpu.json", "kernels"),
        "eager_source": source(res, "traffic_per_token_cpu.json"),
        "compiled_source": source(res, "traffic_compiled_cpu.json"),
        "norm": norm,
        "norm_source": sources(
            res,
            [
                "traffic_compiled_norm_output_fp32_cpu.json",
                "traffic_per_token_norm_output_fp32_cpu.json",
            ],
        ),
        "norm_softmax": f"{gib(fp32_c['softmax']['target_gb'])} -> {gib(c['softmax']['target_gb'])}",
        "forward": forward,
        "forward_source": sources(
            res, ["traffic_forward_4096_cpu.json", "traffic_forward_4096_compiled_cpu.json"]
        ),
        "train": train_table,
        "train_source": sources(res, res.glob("traffic_train_4096/*.json")),
        "bandwidth": f"{bandwidth / 1e12:.2f} TB/s",
        "softmax_compiled_gb": gib(c["softmax"]["target_gb"]),
        "transject_compiled_ratio": x(c["transject"]["target_gb"] / c["softmax"]["target_gb"]),
        "kernel_compiled_ratio": x(c["kernel"]["target_gb"] / c["softmax"]["target_gb"]),
        "stream_gb": f"{gib(c['transject']['target_gb'])} -> {gib(stream['target_gb'])}",
        "stream_kernels": f"{c['transject']['ops_per_step']} -> {stream['ops_per_step']}",
        "stream_source": source(res, "traffic_compiled_transject_stream_compute_cpu.json"),
    }
