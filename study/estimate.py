"""The bill of a study before it is submitted: training tokens, FLOPs and GPU-hours per stage.

GPU-hours come from measured throughput: the pretraining benchmark's table
(``bench/results/gpu_h200/pretrain_gpu.json`` by default: every family at albert-base, seq 128
and 512, and albert-large, seq 512, one H200, bf16, the shipped recipes), matched on family,
width, depth and sequence length; fine-tuning uses the same model's row at its ``max_length``.
Where nothing was measured, the scale's ``tokens_per_s`` (given by the user) is used, else the
hours are left out and the tokens and FLOPs say the size. Assumptions, stated with the table:
throughput per GPU scales linearly with GPUs; fine-tuning sequences are counted at their
``max_length`` (an upper bound: batches are padded to their longest sequence); evaluation and
start-up are not counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from study.graph import Graph, Node
from study.spec import REPO

THROUGHPUT = REPO / "bench" / "results" / "gpu_h200" / "pretrain_gpu.json"
GPU_KINDS = ("pretrain", "lra-pretrain", "glue", "lra")


@dataclass
class Row:
    """One stage's (or one variant's stages of one kind) estimate."""

    what: str
    tokens: float
    pflops: float | None
    gpu_hours: float | None
    source: str


def load_throughput(path: Path = THROUGHPUT) -> tuple[dict[tuple, float], str]:
    """(family, hidden, layers, seq) -> tokens/s per GPU, and a line naming the measurement."""
    data = json.loads(Path(path).read_text())
    table = {}
    for row in data.get("rows", []):
        if row.get("tokens_per_s"):
            key = (row["family"], row["hidden"], row["layers"], row["seq"])
            table[key] = float(row["tokens_per_s"])
    device = data.get("meta", {}).get("device_name", "GPU")
    try:
        where = Path(path).resolve().relative_to(REPO)
    except ValueError:
        where = Path(path)
    return table, f"{device}, {where}"


def _encoder(model: dict[str, Any]):
    from model.config import EncoderConfig

    fields = {k: v for k, v in model.items() if k != "init_from"}
    try:
        return EncoderConfig.from_dict(fields)
    except (ValueError, TypeError):
        return EncoderConfig()


def _segments(node: Node, graph: Graph) -> tuple[Any, list[tuple[float, int]]]:
    """(the encoder config, [(sequences, seq length), ...]) a GPU stage trains on."""
    info = node.info
    world = node.resources.nodes * node.resources.tasks()
    if node.kind in ("pretrain", "lra-pretrain"):
        encoder = _encoder(info.get("model", {}))
        segments = [(p["steps"] * p["micro_batch"] * info["accumulation"] * world, p["seq"])
                    for p in info["phases"]]  # fmt: skip
        return encoder, segments
    runs = len(node.elements)
    if node.kind == "glue":
        source = graph.nodes.get(f"{node.variant}.pretrain")
        encoder = _encoder(source.info.get("model", {}) if source else {})
    else:
        encoder = _encoder(info.get("model", {}))
    sequences = runs * info["steps"] * info["batch"] * info.get("documents", 1)
    return encoder, [(sequences, info["seq"])]


def stage_estimate(node: Node, graph: Graph, table: dict[tuple, float], source: str) -> Row:
    from model.flops import FlopsNotCounted, training_flops

    encoder, segments = _segments(node, graph)
    family = node.info.get("family", encoder.attention)
    tokens = sum(n * seq for n, seq in segments)
    try:
        flops = sum(n * training_flops(encoder, seq) for n, seq in segments)
        pflops: float | None = flops / 1e15
    except (FlopsNotCounted, ValueError):
        pflops = None
    given = graph.spec.scales[graph.scale].stages[node.stage].tokens_per_s
    seconds, used = 0.0, []
    for n, seq in segments:
        rate = table.get((family, encoder.hidden_size, encoder.num_hidden_layers, seq))
        if rate is not None:
            used.append("measured")
        elif given:
            rate = given
            used.append("the scale's tokens_per_s")
        else:
            return Row(node.id, tokens, pflops, None, "not measured (set tokens_per_s)")
        seconds += n * seq / rate
    return Row(node.id, tokens, pflops, seconds / 3600, sorted(set(used))[0])


def estimate(graph: Graph, throughput: Path = THROUGHPUT) -> list[Row]:
    """One row per variant and stage kind (its nodes summed), then the total; the measurement
    used is ``measurement(throughput)``."""
    if graph.spec.scales[graph.scale].device == "cpu":
        return []
    table, source = load_throughput(throughput)
    groups: dict[str, list[Row]] = {}
    for node in graph.order():
        if node.kind in GPU_KINDS:
            groups.setdefault(f"{node.variant} {node.kind}", []).append(
                stage_estimate(node, graph, table, source)
            )
    rows = [_sum(name, group) for name, group in groups.items()]
    return [*rows, _sum("total", rows)] if rows else []


def _sum(name: str, rows: list[Row]) -> Row:
    hours = None if any(r.gpu_hours is None for r in rows) else sum(r.gpu_hours for r in rows)
    known = [r.gpu_hours for r in rows if r.gpu_hours is not None]
    pflops = None if any(r.pflops is None for r in rows) else sum(r.pflops for r in rows)
    sources = sorted({r.source for r in rows})
    if hours is None and known:
        sources = [f"{sum(known):,.0f} GPU-h measured, the rest not"]
    return Row(name, sum(r.tokens for r in rows), pflops, hours, "; ".join(sources))


def format_estimate(rows: list[Row], throughput: Path = THROUGHPUT) -> str:
    if not rows:
        return "No GPU estimate at a CPU scale.\n"
    lines = ["| stage | training tokens | training PFLOP | GPU-hours | throughput |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        hours = "–" if r.gpu_hours is None else f"{r.gpu_hours:,.1f}"
        pflops = "–" if r.pflops is None else f"{r.pflops:,.0f}"
        name = f"**{r.what}**" if r.what == "total" else r.what
        lines.append(f"| {name} | {r.tokens:.3g} | {pflops} | {hours} | {r.source} |")
    _, source = load_throughput(throughput)
    return "\n".join(lines) + f"\n\nMeasured throughput: {source}.\n"
