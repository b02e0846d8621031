"""The figures of the benchmarks page about single fast paths (each timed against its peer in
the same process), the LAMB step, compilation, and checkpoints."""

from __future__ import annotations

from benchmark_docs.util import (
    FAMILY,
    Results,
    md_table,
    registry,
    source,
    sources,
    x,
)

SECTIONS, section = registry()


@section
def tisa(res: Results) -> dict[str, str]:
    cpu = res("fast_paths_tisa_cpu.json")
    cpu_table = md_table(
        ["N", "softmax (s/step)", "TISA, SDPA with the bias (s/step)", "TISA / softmax"],
        [[r["seq"], f"{r['softmax_s']:.3f}", f"{r['tisa_sdpa_s']:.3f}",
          f"{r['tisa_sdpa_over_softmax']:.3f}"] for r in cpu["rows"]],
    )  # fmt: skip
    gpu = res("fast_paths_tisa_backends_gpu.json")
    rows = gpu["rows"]
    gpu_table = md_table(
        ["N", "padded: flex / SDPA (ms)", "unpadded: flex / SDPA (ms)"],
        [[r["seq"], f"{r['flex_padded_ms']:.1f} / {r['sdpa_padded_ms']:.1f}",
          f"{r['flex_unpadded_ms']:.1f} / {r['sdpa_unpadded_ms']:.1f}"] for r in rows],
    )  # fmt: skip

    def crossover(kind: str) -> int:
        """The shortest length from which flex is the faster at every length."""
        for i, r in enumerate(rows):
            if all(s[f"flex_{kind}_ms"] < s[f"sdpa_{kind}_ms"] for s in rows[i:]):
                return r["seq"]
        return 0

    agree = all(r["agree_padded"] and r["agree_unpadded"] for r in rows)
    return {
        "cpu_table": cpu_table,
        "cpu_source": source(res, "fast_paths_tisa_cpu.json"),
        "gpu_table": gpu_table,
        "gpu_source": source(res, "fast_paths_tisa_backends_gpu.json"),
        "padded_from": str(crossover("padded")),
        "unpadded_from": str(crossover("unpadded")),
        "flex_min_length": str(gpu["flex_min_length"]),
        "agree": "agree" if agree else "**disagree**",
    }


@section
def objective(res: Results) -> dict[str, str]:
    rel = "fast_paths_objective_cpu.json"
    r = res(rel)["rows"][0]
    table = md_table(
        ["loss terms", "ms (CPU)", "speed-up", "GB moved", "operators / kernels"],
        [["eager", f"{r['eager_ms']:.1f}", "1.00x", f"{r['eager_gb']:.2f}", r["eager_kernels"]],
         ["compiled", f"{r['compiled_ms']:.1f}", f"**{x(r['speedup'])}**",
          f"**{r['compiled_gb']:.2f}**", r["compiled_kernels"]]],
    )  # fmt: skip
    return {"table": table, "source": source(res, rel),
            "shape": f"{r['batch']} rows x {r['slots']} slots x {r['vocab']} tokens"}  # fmt: skip


@section
def norm_output(res: Results) -> dict[str, str]:
    rel = "fast_paths_norm_output_cpu.json"
    table = md_table(
        ["family (compiled)", "`fp32` ms", "`compute` ms", "`fp32` / `compute`"],
        [[FAMILY[r["family"]], f"{r['fp32_ms']:.1f}", f"{r['compute_ms']:.1f}",
          f"{r['speedup']:.2f}"] for r in res(rel)["rows"]],
    )  # fmt: skip
    return {"table": table, "source": source(res, rel)}


# ----------------------------------------------------------------------------- TransJect's maps


@section
def cayley(res: Results) -> dict[str, str]:
    files = {"CPU": "cayley_cpu.json", "H100": "gpu_h100_transject/cayley/cayley_gpu.json"}
    rows = []
    for where, rel in files.items():
        m = res(rel)["maps"]
        rows.append([f"{m['matrices']} maps of {m['width']} x {m['width']}, forward + backward, ms",
                     where, f"**{m['block_ms']:.1f}**",
                     f"{m['lu_ms']:.1f} ({x(m['lu_over_block'])})",
                     f"{m['torch_parametrization_ms']:.1f} ({x(m['torch_over_block'])})"])  # fmt: skip
    for label, key in (("largest error against the fp64 map", "max_error_vs_fp64"),
                       ("max \\|Q^T Q - I\\|", "orthogonality_error")):  # fmt: skip
        for where, rel in files.items():
            e = res(rel)["maps"]["errors"]
            rows.append([label, where, f"{e['block'][key]:.1e}", f"{e['lu'][key]:.1e}",
                         f"{e['torch_parametrization'][key]:.1e}"])  # fmt: skip
    for where, rel in files.items():
        s = res(rel)["transject_step"]
        rows.append([f"TransJect training step, {s['layers']} distinct layers, "
                     f"{s['batch']} x {s['seq']}, ms", where, f"**{s['block_ms']:.1f}**",
                     f"{s['lu_ms']:.1f} ({x(s['lu_over_block'])})", ""])  # fmt: skip
    table = md_table(["what", "machine", "block inverse", "LU solve", "torch's parametrization"],
                     rows)  # fmt: skip
    gpu = res(files["H100"])["maps"]
    return {"table": table, "source": sources(res, files.values()),
            "gpu_ms": f"{gpu['block_ms']:.1f} ms"}  # fmt: skip


@section
def orthogonal(res: Results) -> dict[str, str]:
    cache = res("fast_paths_orthogonal_cache_cpu.json")
    cache_table = md_table(
        ["N", "maps evaluated every forward (ms)", "maps kept (ms)", "gain", "softmax (ms)",
         "TransJect speed-up over softmax, evaluated -> kept"],
        [[r["seq"], f"{1e3 * r['transject_evaluated_s']:.1f}", f"{1e3 * r['transject_kept_s']:.1f}",
          x(r["kept_speedup"]), f"{1e3 * r['softmax_s']:.1f}",
          f"{x(r['transject_evaluated_over_softmax'])} -> {x(r['transject_kept_over_softmax'])}"]
         for r in cache["rows"]],
    )  # fmt: skip
    step_files = [
        ("fast_paths_orthogonal_step_cpu_d256.json", False),
        ("fast_paths_orthogonal_step_cpu_d768.json", False),
        ("fast_paths_orthogonal_step_compiled_cpu_d256.json", True),
        ("fast_paths_orthogonal_step_compiled_cpu_d768.json", True),
        ("fast_paths_orthogonal_compiled_acc1_cpu.json", True),
    ]
    rows = []
    for rel, compiled in step_files:
        d = res(rel)
        a, r = d["args"], d["rows"][0]
        saved = r.get("saved_per_micro_batch_ms")
        rows.append([f"d = {a['hidden']}, {a['layers']} layers, accumulation {r['accumulation']}"
                     + (", compiled" if compiled else ""),
                     f"{r['per_micro_batch_ms']:.0f}", f"{r['per_step_ms']:.0f}",
                     f"**{x(r['speedup'])}**", "" if saved is None else f"{saved:.0f} ms"])  # fmt: skip
    step_table = md_table(
        ["model", "maps every micro-batch (ms/step)", "maps once per step (ms/step)", "ratio",
         "saved per micro-batch but one"], rows)  # fmt: skip
    shard_files = res.glob("fast_paths_orthogonal_shard_cpu_*.json")
    shard_files.sort(key=lambda rel: (int(res(rel)["args"]["hidden"]), rel))
    rows = []
    for rel in shard_files:
        d = res(rel)
        a, r = d["args"], d["rows"][0]
        note = (
            f", `--shard-min-size {a['shard_min_size']}`" if a.get("shard_min_size") == "0" else ""
        )
        rows.append([f"d = {a['hidden']}, {a['layers']} layers, accumulation {r['accumulation']}{note}",
                     f"{r['every_rank_all_maps_ms']:.1f}", f"{r['sharded_ms']:.1f}",
                     f"**{x(r['speedup'])}**",
                     f"{r['maps_alone_every_rank_all_ms']:.1f} / {r['maps_alone_sharded_ms']:.1f} / "
                     f"{r['maps_alone_collectives_ms']:.1f}"])  # fmt: skip
    shard_table = md_table(
        ["model (2 ranks)", "every rank all maps (ms/step)", "sharded (ms/step)", "ratio",
         "maps alone: all / sharded / collectives (ms)"], rows)  # fmt: skip
    losers = [int(res(rel)["args"]["hidden"]) for rel in shard_files
              if res(rel)["rows"][0]["speedup"] < 1.0]  # fmt: skip
    return {
        "cache_table": cache_table,
        "cache_source": source(res, "fast_paths_orthogonal_cache_cpu.json"),
        "step_table": step_table,
        "step_source": sources(res, [rel for rel, _ in step_files]),
        "shard_table": shard_table,
        "shard_source": sources(res, shard_files),
        "shard_losers": ", ".join(f"d = {d}" for d in losers) or "none",
    }


@section
def eigen(res: Results) -> dict[str, str]:
    files = res.glob("fast_paths_eigen_products_a*_cpu.json")
    files.sort(key=lambda rel: float(res(rel)["args"]["anisotropy"]))
    names = {"fp32": "fp32", "bf16x3": "**bf16x3**", "bf16x1": "one bf16 product"}
    rows = []
    for rel in files:
        a = res(rel)["args"]["anisotropy"]
        for i, r in enumerate(res(rel)["rows"]):
            label = f"anisotropy {float(a):g}" if i == 0 else ""
            rows.append([label, names.get(r["products"], r["products"]), f"{r['lambda']:.1e}",
                         f"{r['lambda_worst']:.1e}", f"{r['reconstruction']:.1e}",
                         f"{r['grad_embeddings']:.1e}", f"{r['grad_basis']:.1e}"])  # fmt: skip
    table = md_table(
        ["spectrum", "products", "eigenvalues", "worst eigenvalue", "reconstruction loss",
         "grad embeddings", "grad basis"], rows)  # fmt: skip
    return {"table": table, "source": sources(res, files)}


@section
def kernel_mixing(res: Results) -> dict[str, str]:
    rel = "kernel_mixing_saved_cpu.json"
    r = res(rel)["rows"][0]
    table = md_table(
        ["kept for the backward (MB), one sequence of " + str(r["seq"]), "softmax",
         "kernel, default mixing", "kernel, `training_backend=triton`"],
        [["the attention's mixing", f"{r['softmax_saved_mb']:.1f}", f"{r['torch_saved_mb']:.1f}",
          f"{r['triton_saved_mb']:.1f}"],
         ["the whole layer", "", f"{r['layer_torch_saved_mb']:.1f}",
          f"{r['layer_triton_saved_mb']:.1f}"]],
    )  # fmt: skip
    return {"table": table, "source": source(res, rel),
            "error": f"{max(r['triton_rel_err_padded'], r['triton_rel_err_unpadded']):.1e}"}  # fmt: skip


# ----------------------------------------------------------------------------- LAMB


@section
def lamb(res: Results) -> dict[str, str]:
    plain = res("lamb_cpu.json")["rows"]
    plain_table = md_table(
        ["recipe (tensors, parameters)", "ours, as the engine runs it (skippable)",
         "ours, plain", "`pytorch_optimizer.Lamb`"],
        [[f"{r['recipe']} ({r['tensors']}, {r['parameters'] / 1e6:.1f}M)",
          f"{r['ms']['ours_skippable']:.1f} ms", f"{r['ms']['ours_plain']:.1f} ms",
          f"{r['ms']['pytorch_optimizer']:.1f} ms"] for r in plain],
    )  # fmt: skip
    traffic = {r["recipe"]: r for r in res("lamb_traffic_cpu.json")["rows"]}
    compiled = res("lamb_compiled_cpu.json")["rows"]
    compiled_table = md_table(
        ["recipe (tensors, parameters)", "`foreach`, as the engine runs it", "`compiled`",
         "`pytorch_optimizer.Lamb`", "bytes per parameter, `foreach` -> `compiled`"],
        [[f"{r['recipe']} ({r['tensors']}, {r['parameters'] / 1e6:.1f}M)",
          f"{r['ms']['ours_skippable']:.1f} ms",
          f"**{r['ms']['ours_compiled']:.1f} ms** "
          f"({x(r['ms']['ours_skippable'] / r['ms']['ours_compiled'])})",
          f"{r['ms']['pytorch_optimizer']:.1f} ms",
          f"{traffic[r['recipe']]['ours_skippable_bytes_per_parameter']:.0f} -> "
          f"**{traffic[r['recipe']]['ours_compiled_bytes_per_parameter']:.0f}**"] for r in compiled],
    )  # fmt: skip
    diffs = [v for r in compiled for v in r["largest_weight_difference_vs_ours_skippable"].values()]
    return {
        "plain_table": plain_table,
        "plain_source": source(res, "lamb_cpu.json"),
        "compiled_table": compiled_table,
        "compiled_source": sources(res, ["lamb_compiled_cpu.json", "lamb_traffic_cpu.json"]),
        "difference": f"{max(diffs):.1e}",
    }


# ----------------------------------------------------------------------------- compilation


@section
def compile_cache(res: Results) -> dict[str, str]:
    rel = "compile_cache_cpu.json"
    rows = res(rel)["rows"]
    table = md_table(
        ["family", "first step, cold (s)", "warm (s)", "warm / cold", "process, cold (s)",
         "warm (s)", "graphs compiled cold / loaded warm", "joint graphs loaded warm",
         "later steps, warm / cold"],
        [[FAMILY[r["family"]], f"{r['cold']['first_step_s']:.1f}", f"{r['warm']['first_step_s']:.1f}",
          f"**{r['first_step_ratio']:.2f}**", f"{r['cold']['process_s']:.1f}",
          f"{r['warm']['process_s']:.1f}", f"{r['cold']['compiled']} / {r['warm']['loaded']}",
          f"{r['warm']['joint_loaded']} of {r['warm']['joint_loaded'] + r['warm']['joint_traced']}",
          f"{r['later_step_ratio']:.2f}"] for r in rows],
    )  # fmt: skip
    return {"table": table, "source": source(res, rel)}


@section
def compile_scope(res: Results) -> dict[str, str]:
    rel = "compile_scope_cpu.json"
    rows = res(rel)["rows"]
    table = md_table(
        ["point", "first step, encoder (s)", "layers (s)", "encoder / layers",
         "later step, encoder (s)", "layers (s)", "layers / encoder", "process, encoder (s)",
         "layers (s)", "peak GB (RSS), encoder / layers"],
        [[r["point"], f"{r['encoder']['first_step_s']:.1f}", f"{r['layers']['first_step_s']:.1f}",
          f"**{x(1 / r['first_step_ratio'])}**", f"{r['encoder']['later_step_s']:.3f}",
          f"{r['layers']['later_step_s']:.3f}", f"{r['later_step_ratio']:.3f}",
          f"{r['encoder']['process_s']:.1f}", f"{r['layers']['process_s']:.1f}",
          f"{r['encoder']['peak_gb']:.2f} / {r['layers']['peak_gb']:.2f}"] for r in rows],
    )  # fmt: skip
    prof = res("compile_scope_profile_cpu.json")["runs"]
    prows = []
    for name, run in prof.items():
        fam = run["families"][0]
        top = {t["op"]: t for t in fam["top"]}
        add, addmm = top.get("aten::add_", {}), top.get("aten::addmm", {})
        prows.append([name, f"{fam['self_ms_per_step']:.1f}",
                      f"{add.get('calls', 0):.0f} / {add.get('self_ms', 0.0):.1f}",
                      f"{addmm.get('calls', 0):.0f}",
                      f"{fam['kinds']['matrix products']['ms']:.1f}"])  # fmt: skip
    profile = md_table(
        ["family and scope", "host ms per step", "`add_` calls / ms", "`addmm` calls",
         "matrix products, ms"], prows)  # fmt: skip
    depth = [r for r in rows if r["point"].startswith("depth")]
    return {
        "table": table,
        "source": source(res, rel),
        "profile": profile,
        "profile_source": source(res, "compile_scope_profile_cpu.json"),
        "deepest": f"{x(1 / depth[-1]['first_step_ratio'])}" if depth else "",
    }


@section
def compile_cpu(res: Results) -> dict[str, str]:
    rel = "fast_paths_compile_cpu.json"
    rows = res(rel)["rows"]
    table = md_table(
        ["family", "first step, compiling (s)", "eager (s/step)", "compiled (s/step)", "speed-up"],
        [[FAMILY[r["family"]], f"{r['first_step_s']:.0f}", f"{r['eager_s']:.3f}",
          f"{r['compiled_s']:.3f}", x(r["speedup"])] for r in rows],
    )  # fmt: skip
    speed = [r["speedup"] for r in rows]
    return {"table": table, "source": source(res, rel),
            "range": f"{min(speed):.2f}x to {max(speed):.2f}x"}  # fmt: skip


# ----------------------------------------------------------------------------- checkpoints


@section
def checkpoints(res: Results) -> dict[str, str]:
    names = {"pretrain": "pretraining (debug recipe, 1 process)",
             "finetune": "fine-tuning (LRA ListOps, best-dev release and evaluation history)"}  # fmt: skip
    rows = []
    for stage in ("pretrain", "finetune"):
        d = res(f"kill_resume_{stage}_cpu.json")
        startup = sum("start-up" in o["when"] for o in d["outcomes"])
        same = "identical" if d["final_equals_uninterrupted"] else "**different**"
        rows.append([names[stage], f"{d['kills']} ({startup})",
                     f"{d['loadable_after_kill']} of {d['kills']}",
                     f"{same} (largest difference {d['max_weight_difference']:g})"])  # fmt: skip
    kills = md_table(["stage", "kills (during start-up)", "loadable after the kill",
                      "final weights vs uninterrupted"], rows)  # fmt: skip
    d = res("reshard_cpu.json")
    reshard = md_table(
        ["model", "parameters", "checkpoint", "convert (1 worker)",
         "1-rank load, conversion included", "2-rank load, same world size"],
        [[name, f"{m['parameters'] / 1e6:.1f} M", f"{m['checkpoint_mb']:.0f} MB",
          f"{m['convert_seconds_1_worker']:.1f} s", f"{m['load_seconds_1_process_with_conversion']:.1f} s",
          f"{m['load_seconds_2_processes_same_world']:.2f} s"]
         for name, m in d["models"].items() if m["parameters"] > 1e6],
    )  # fmt: skip
    big = [m for m in d["models"].values() if m["checkpoint_mb"] > 100]
    per_gb = sum(m["convert_seconds_1_worker"] for m in big) / sum(m["checkpoint_mb"] for m in big)
    return {
        "kills": kills,
        "kills_source": sources(
            res, ["kill_resume_pretrain_cpu.json", "kill_resume_finetune_cpu.json"]
        ),
        "reshard": reshard,
        "reshard_source": source(res, "reshard_cpu.json"),
        "reshard_per_gb": f"{1e3 * per_gb:.0f} s",
        "zero_stage": str(d["zero_stage"]),
        "unusable": str(
            sum(res(f"kill_resume_{s}_cpu.json")["unusable"] for s in ("pretrain", "finetune"))
        ),
    }
