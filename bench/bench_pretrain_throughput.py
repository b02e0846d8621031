"""End-to-end pretraining throughput through the real engine: tokens/s, samples/s, MFU, memory.

Each point builds the recipe's model (``configs/pretrain/<recipe>[-<family>].yaml`` read with the
project's own recipe loader, so the family settings are the shipped ones) and trains it with
``engine.Engine`` as the recipes do: DeepSpeed, ZeRO-0 (``--zero-stage``), ``bf16-mixed`` on
CUDA (fp32 weights, bf16 autocast) and fp32 on CPU (``--precision``), the recipe's optimizer
(LAMB: the ``foreach`` implementation unless an ``--override optimizer.implementation=...``),
one process (a process group of one, rendezvous on a free local port). Each step is what
``pretrain.train.Trainer`` does: ``to_device`` -> ``forward(**model_inputs(batch, K))`` ->
``pretraining_loss`` -> ``backward(defer=True)`` -> ``step(defer=True)`` (no host
synchronisation inside the step), on synthetic batches shaped like the loader's (15% of the
tokens masked for MLM, random SOP labels; the MLM head decodes K positions per row, K the most
masked tokens of any row of the batches). ``--padding`` (default ``one-short-row``): the last
row of each batch is 10% shorter, as nearly every batch of the loader holds a short example
(ALBERT's short_seq_prob) and so carries a mask; ``none``: every row full length, the batch
reaches the model without a mask (``Engine.to_device``), as most do with
``data.group_by_length``. ``--accumulation K``: K micro-batches per optimizer step (the
``time/step`` of a step, its FLOPs K times one micro-batch's).

Timing: ``--warmup`` untimed steps, then ``--steps`` steps each ended by a device synchronisation;
the median step time gives tokens/s (positions computed, padding included) and samples/s. Then
``--steady-steps`` more steps (default: ``--steps`` on CUDA, none on the CPU) run back to back
with one synchronisation after the last, as the trainer runs between logging steps (the host
queues work ahead of the device): ``steady_step_s`` and ``steady_mfu``, the "steady" column. The split into
data (host -> device copy) / forward / backward / optimizer step comes from CUDA events (CPU: host
clocks); ``opt_share`` is the optimizer step's share of the step (the engine's part after the
last backward: clipping, the LAMB update, DeepSpeed's bookkeeping). MFU = ``model.flops.training_flops`` (3 x forward matmul FLOPs, the recompute of
activation checkpointing not counted) x sequences/s over ``engine.metrics.peak_flops`` of the
device for bf16, as the trainer logs it. Memory: ``torch.cuda.max_memory_allocated()`` over the
timed steps, less what earlier points of the process left allocated (``leftover_gb``);
``static_gb`` = allocated once the engine was built (weights, master weights, optimizer
state). A point that runs out of memory is retried at half the batch (twice at most) and says so.

Every family runs in its own subprocess (the points of one family share it): a crash or a leak
stays there. ``--interleave`` (CPU) runs every point in one subprocess instead and takes their
timed steps in turn, so that on a shared machine a change of load hits all points alike.
Configs:

* ``--preset albert`` (GPU): albert-base at seq 128 and 512, albert-large at seq 512, micro-batch
  64 (the recipes' ``engine.micro_batch_size``);
* ``--preset debug`` / ``small`` (CPU): the debug recipe (d=64, 4 layers, seq 64, batch 16) and a
  small one (d=256, 4 layers, 4 heads, seq 128, batch 16: bench_engine.py's model);
* ``--depth 12 24 48 96``: albert-base width with that many shared layer applications, activation
  checkpointing on, seq ``--seq`` (512) and batch ``--batch`` (32, the albert-base-96 recipe's
  micro-batch); softmax unless ``--families`` says otherwise.

    python -m bench.bench_pretrain_throughput --preset cpu --interleave --steps 8 --out bench/results/pretrain_cpu.json
    python -m bench.bench_pretrain_throughput --device cuda --preset albert --out pretrain_gpu.json
    python -m bench.bench_pretrain_throughput --device cuda --preset albert --zero-stage 2 --families softmax --out pretrain_zero2_gpu.json
    python -m bench.bench_pretrain_throughput --device cuda --depth 12 24 48 96 --out depth_gpu.json

Extra recipe overrides go after ``--override`` (e.g. ``optimizer.implementation=torch``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from bench.common import ROOT, free_port, module_command, subprocess_env, write_result

RECIPES = ROOT / "configs" / "pretrain"
FAMILIES = ("softmax", "tisa", "kernel", "transject")

SMALL_MODEL = {
    "model.hidden_size": 256,
    "model.embedding_size": 128,
    "model.num_hidden_layers": 4,
    "model.num_attention_heads": 4,
    "model.intermediate_size": 1024,
    "model.max_position_embeddings": 128,
}

# name -> (recipe base, seq, micro-batch, vocab, extra overrides)
PRESETS: dict[str, list[tuple[str, str, int, int, int, dict]]] = {
    "albert": [
        ("albert-base-128", "albert-base", 128, 64, 30000, {}),
        ("albert-base-512", "albert-base", 512, 64, 30000, {}),
        ("albert-large-512", "albert-large", 512, 64, 30000, {}),
    ],
    "debug": [("debug-64", "debug", 64, 16, 2000, {})],
    "small": [("small-128", "debug", 128, 16, 5460, SMALL_MODEL)],
}
PRESETS["cpu"] = PRESETS["debug"] + PRESETS["small"]
# --sdpa-priority names -> torch.nn.attention.SDPBackend members
SDPA_BACKENDS = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def recipe_path(base: str, family: str) -> Path:
    return RECIPES / (f"{base}.yaml" if family == "softmax" else f"{base}-{family}.yaml")


def add_single_point_args(p: argparse.ArgumentParser) -> None:
    """The options of a script that builds one `Measurement` per family (``profile_step``):
    the recipe, the batch and the engine settings this benchmark varies."""
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument(
        "--base", default="albert-base", help="recipe: configs/pretrain/<base>[-<family>]"
    )
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=30000)
    p.add_argument("--precision", default=None, help="default: bf16-mixed (CUDA), fp32 (CPU)")
    p.add_argument("--zero-stage", type=int, default=0)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--padding", default="one-short-row", choices=["one-short-row", "none"])


def finish_single_point_args(args: argparse.Namespace) -> None:
    """The precision's default by device, and the one-process rendezvous address."""
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def synthetic_batches(
    count: int, batch: int, seq: int, vocab: int, seed: int = 0, padded: bool = True
) -> list[dict]:
    """Batches with the loader's keys and dtypes (`data_prep.loader.PretrainingCollator`); with
    `padded`, the last row is 10% shorter (padding id 0, mask 0, no label there)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(5, vocab, (batch, seq), generator=g)
        ids[:, 0] = 2  # [CLS]
        types = torch.zeros(batch, seq, dtype=torch.long)
        types[:, seq // 2 :] = 1
        masked = torch.rand(batch, seq, generator=g) < 0.15
        masked[:, 0] = False
        masked[:, 1] = True  # at least one masked token per row
        attention = torch.ones(batch, seq, dtype=torch.long)
        if padded:
            short = seq - max(1, seq // 10)
            ids[-1, short:], attention[-1, short:], masked[-1, short:] = 0, 0, False
        out.append(
            {
                "input_ids": ids,
                "attention_mask": attention,
                "token_type_ids": types,
                "mlm_labels": torch.where(masked, ids, torch.full_like(ids, -100)),
                "sop_labels": torch.randint(0, 2, (batch,), generator=g),
            }
        )
    return out


def load_config(base: str, family: str, seq: int, batch: int, args, extra: dict):
    from engine.recipe import load_recipe
    from pretrain.config import pretrain_config

    overrides = {
        "data.shards": "synthetic",  # never opened: the batches are made here
        "data.max_seq_length": seq,
        "engine.backend": "deepspeed",
        "engine.zero_stage": args.zero_stage,
        "engine.precision": args.precision,
        "engine.micro_batch_size": batch,
        "engine.gradient_accumulation_steps": args.accumulation,
        "engine.device": args.device,
        **extra,
    }
    items = [f"{k}={v}" for k, v in overrides.items()] + list(args.override)
    return pretrain_config(load_recipe(recipe_path(base, family), items))


class Measurement:
    """One engine on its synthetic batches: `step` runs and times one training step (what
    `pretrain.train.Trainer._train_step` does), `record` keeps a timed one, `row` sums up."""

    def __init__(self, name: str, base: str, family: str, seq: int, batch: int, vocab: int,
                 args, extra: dict):  # fmt: skip
        import torch

        from engine.distributed import detect
        from engine.engine import Engine
        from engine.metrics import peak_flops
        from model.flops import training_flops
        from model.heads import EncoderForPretraining
        from pretrain.objective import objective_terms

        self.name, self.base, self.family, self.seq, self.batch = name, base, family, seq, batch
        self.args = args
        self.cfg = load_config(base, family, seq, batch, args, extra)
        self.model_cfg = self.cfg.encoder_config(vocab, 0)
        if self.model_cfg.max_position_embeddings < seq:
            raise ValueError(f"{name}: max_position_embeddings < {seq}")
        torch.manual_seed(0)
        model = EncoderForPretraining(self.model_cfg)
        self.params = sum(p.numel() for p in model.parameters())
        self.cuda = args.device == "cuda"
        if self.cuda:
            torch.cuda.empty_cache()
        # What earlier points of this process left allocated (DeepSpeed keeps some references).
        self.base_gb = torch.cuda.memory_allocated() / 2**30 if self.cuda else None
        cfg = self.cfg
        self.engine = Engine(model, cfg.engine, cfg.optimizer, cfg.schedule, detect())
        self.objective_terms = self.engine.compile_beside(objective_terms)  # as the trainer
        self.static_gb = torch.cuda.memory_allocated() / 2**30 if self.cuda else None
        batches = synthetic_batches(4, batch, seq, vocab, padded=args.padding != "none")
        # The MLM head's slots per row: the most masked tokens of any row (the trainer uses the
        # masking budget of a full row, which bounds the loader's rows the same way).
        self.max_masked = max(int((b["mlm_labels"] != -100).sum(1).max()) for b in batches)
        if self.cuda:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        self.batches = batches
        masked = max(1, int((batches[0]["mlm_labels"] != -100).sum()) // batch)
        self.accumulation = args.accumulation
        self.flops_per_step = (
            training_flops(self.model_cfg, seq, masked_tokens=masked) * batch * self.accumulation
        )
        dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(args.precision, torch.bfloat16)
        self.peak = peak_flops(self.engine.device, dtype)
        self.engine.train()
        self.totals: list[float] = []
        self.splits: list[list[float]] = []
        self.skipped = 0
        self.steady_s: float | None = None  # `steady`, when run
        self.first_step_s: float | None = None  # compilation included, when compiled

    def step(self, i: int) -> tuple[float, list[float], bool]:
        """(seconds, [data, forward, backward, optimizer] seconds, skipped) of one step."""
        import torch

        marks: list = []

        def mark() -> None:
            if self.cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append(event)
            else:
                marks.append(time.perf_counter())

        start = time.perf_counter()
        result = self._step(i, mark)
        if self.cuda:
            torch.cuda.synchronize()
            gaps = [marks[j].elapsed_time(marks[j + 1]) / 1e3 for j in range(len(marks) - 1)]
        else:
            gaps = [marks[j + 1] - marks[j] for j in range(len(marks) - 1)]
        # gaps: (data, forward, backward) per micro-batch, then the optimizer step
        phases = [sum(gaps[k : len(gaps) - 1 : 3]) for k in range(3)] + [gaps[-1]]
        seconds = time.perf_counter() - start
        if self.first_step_s is None:
            self.first_step_s = seconds
        return seconds, phases, bool(result.skipped)

    def _step(self, i: int, mark):
        """One optimizer step (``accumulation`` micro-batches), ``mark()`` before and after
        each phase; returns the engine's step result."""
        from pretrain.objective import model_inputs, pretraining_loss

        engine = self.engine
        for micro in range(self.accumulation):  # data, forward, backward marks per micro-batch
            cpu_batch = self.batches[(i * self.accumulation + micro) % len(self.batches)]
            mark()
            b = engine.to_device(cpu_batch)
            mark()
            out = engine.forward(**model_inputs(b, self.max_masked))
            loss = pretraining_loss(out, b, self.objective_terms)
            mark()
            engine.backward(loss.total, defer=True)
        mark()
        result = engine.step(defer=True)
        mark()
        return result

    def steady(self, first: int, n: int) -> None:
        """``n`` steps back to back, one device synchronisation after the last, as the trainer
        runs between logging steps: the host queues the next step's work while the device runs,
        which the per-step timing above (a synchronisation after every step, events between
        phases) does not let it do. ``steady_s``: seconds per step."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(first, first + n):
            self._step(i, lambda: None)
        if self.cuda:
            torch.cuda.synchronize()
        self.steady_s = (time.perf_counter() - start) / n

    def record(self, i: int) -> None:
        seconds, phases, skipped = self.step(i)
        self.totals.append(seconds)
        self.splits.append(phases)
        self.skipped += int(skipped)

    def row(self) -> dict:
        import torch

        from engine.metrics import mfu

        step_s = statistics.median(self.totals)
        split = {
            k: statistics.median(s[j] for s in self.splits)
            for j, k in enumerate(("data", "forward", "backward", "step"))
        }
        row = {
            "name": self.name,
            "family": self.family,
            "recipe": str(recipe_path(self.base, self.family).relative_to(ROOT)),
            "seq": self.seq,
            "batch": self.batch,
            "layers": self.model_cfg.num_hidden_layers,
            "hidden": self.model_cfg.hidden_size,
            "activation_checkpointing": self.cfg.engine.activation_checkpointing,
            "precision": self.args.precision,
            "zero_stage": self.args.zero_stage,
            "optimizer": f"{self.cfg.optimizer.name}/{type(self.engine.optimizer).__module__}."
            f"{type(self.engine.optimizer).__name__}",
            "deferred_step": self.engine.deferred,  # skips and schedule decided on the device
            "params": self.params,
            "step_s": step_s,
            "step_s_min": min(self.totals),  # the least disturbed step, on a shared machine
            "step_s_all": self.totals,
            "split_s": split,
            "opt_share": split["step"] / step_s,  # the optimizer step's share of the step
            "accumulation": self.accumulation,
            "padding": self.args.padding,
            "tokens_per_s": self.batch * self.accumulation * self.seq / step_s,
            "samples_per_s": self.batch * self.accumulation / step_s,
            "model_tflops_per_s": self.flops_per_step / step_s / 1e12,
            "mfu": mfu(self.flops_per_step / step_s, self.peak),
            "steady_step_s": self.steady_s,
            "steady_mfu": None
            if self.steady_s is None
            else mfu(self.flops_per_step / self.steady_s, self.peak),
            "skipped_steps": self.skipped,
            "sdpa_priority": self.args.sdpa_priority,
            # the first step of this engine: with engine.compile, the compilation too
            "first_step_s": self.first_step_s,
            "compiled": self.engine.compiled,
            # its folder, and the graphs loaded from it / compiled since the engine started
            "compile_cache": {
                "dir": str(self.engine.compile_cache),
                **self.engine.compile_cache_activity(),
            },
        }
        if self.cuda:
            row["leftover_gb"] = self.base_gb
            row["static_gb"] = self.static_gb - self.base_gb  # weights, master copy, optimizer
            row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30 - self.base_gb
        else:
            row["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return row


def steady_steps(m: Measurement, args) -> None:
    """After the timed steps, ``--steady-steps`` back to back (default: ``--steps`` on CUDA,
    none on the CPU)."""
    n = args.steady_steps if args.steady_steps is not None else (args.steps if m.cuda else 0)
    if n > 0:
        m.steady(args.warmup + args.steps, n)


def run_point(name: str, base: str, family: str, seq: int, batch: int, vocab: int, args, extra):
    """One measurement alone in this process; returns a result row (raises on failure)."""
    import torch

    m = Measurement(name, base, family, seq, batch, vocab, args, extra)
    for i in range(args.warmup):
        m.step(i)
    if m.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps):
        m.record(args.warmup + i)
    steady_steps(m, args)
    return m.row()  # the engine and batches go with `m` (run_group collects)


def run_interleaved(points: list[dict], args) -> None:
    """CPU, shared machine: every point's engine in this process, and the timed steps taken in
    turn (one step of each point, then the next round in reverse order), so that a change in
    the machine's load hits every point alike and their ratios stay fair."""
    ms: list[Measurement] = []
    for p in points:
        try:
            ms.append(
                Measurement(p["name"], p["base"], p["family"], p["seq"], p["batch"], p["vocab"],
                            args, p["extra"])
            )  # fmt: skip
        except Exception as e:
            row = {**p, "error": f"{type(e).__name__}: {e}"[:500]}
            print("ROW " + json.dumps(row, default=str), flush=True)
    for i in range(args.warmup):
        for m in ms:
            m.step(i)
    for i in range(args.steps):
        for m in ms if i % 2 == 0 else ms[::-1]:
            m.record(args.warmup + i)
    for m in ms:
        steady_steps(m, args)
        print("ROW " + json.dumps({**m.row(), "oom_batches": [], "interleaved": True}), flush=True)


def sdpa_priority(names: list[str] | None):
    """A context in which SDPA prefers these backends in this order (``None``: torch's own)."""
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names], set_priority=True)


def run_group(points: list[dict], args) -> None:
    """Runs the points of one family in this process; prints one ``ROW {json}`` line each."""
    with sdpa_priority(args.sdpa_priority):
        _run_group(points, args)


def _run_group(points: list[dict], args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    warnings.filterwarnings("ignore", message=".*trust ratio is computed per flat.*")
    if args.interleave:
        run_interleaved(points, args)
        return
    for p in points:
        batch, tries = p["batch"], []
        while True:
            oom = False
            try:
                row = run_point(
                    p["name"], p["base"], p["family"], p["seq"], batch, p["vocab"], args,
                    p["extra"],
                )  # fmt: skip
                row["oom_batches"] = tries
            except torch.cuda.OutOfMemoryError:
                oom = True
            except Exception as e:
                row = {**p, "batch": batch, "error": f"{type(e).__name__}: {e}"[:500]}
            gc.collect()  # outside the except blocks: their tracebacks hold the engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if not oom:
                break
            tries.append(batch)
            if len(tries) > 2 or batch == 1:
                row = {**p, "batch": batch, "error": f"CUDA out of memory at batches {tries}"}
                break
            batch //= 2
        print("ROW " + json.dumps(row, default=str), flush=True)


def plan(args) -> dict[str, list[dict]]:
    """Family -> the points its subprocess runs."""
    groups: dict[str, list[dict]] = {}
    for family in args.families:
        points = []
        if args.depth:
            for layers in args.depth:
                extra = {
                    "model.num_hidden_layers": layers,
                    "engine.activation_checkpointing": not args.no_checkpointing,
                }
                points.append(
                    {"name": f"depth-{layers}", "base": "albert-base", "seq": args.seq or 512,
                     "batch": args.batch or 32, "vocab": 30000, "extra": extra}
                )  # fmt: skip
        else:
            for name, base, seq, batch, vocab, extra in PRESETS[args.preset]:
                if args.configs and name not in args.configs:
                    continue
                points.append(
                    {"name": name, "base": base, "seq": args.seq or seq,
                     "batch": args.batch or batch, "vocab": vocab, "extra": dict(extra)}
                )  # fmt: skip
        for p in points:
            p["family"] = family
        groups[family] = points
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS))
    parser.add_argument("--configs", nargs="+", default=None, help="subset of the preset's names")
    parser.add_argument("--depth", type=int, nargs="+", default=None, help="layer counts")
    parser.add_argument("--no-checkpointing", action="store_true", help="--depth without it")
    parser.add_argument("--families", nargs="+", default=None, choices=FAMILIES)
    parser.add_argument("--seq", type=int, default=None, help="override the config's length")
    parser.add_argument("--batch", type=int, default=None, help="override the micro-batch")
    parser.add_argument(
        "--accumulation", type=int, default=1, help="micro-batches per optimizer step"
    )
    parser.add_argument(
        "--padding",
        default="one-short-row",
        choices=["one-short-row", "none"],
        help="one-short-row: every batch padded, as the loader's nearly always are; none: "
        "full-length rows, no mask reaches the model (as with data.group_by_length)",
    )
    parser.add_argument(
        "--precision", default=None, help="default: bf16-mixed (CUDA, the recipes'), fp32 (CPU)"
    )
    parser.add_argument("--zero-stage", type=int, default=0, help="default: 0 (the recipes')")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--steady-steps",
        type=int,
        default=None,
        help="steps timed back to back after the timed ones (the steady column); default: "
        "--steps on CUDA, 0 on the CPU (where the host waits for every operator anyway)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per family")
    parser.add_argument(
        "--interleave", action="store_true",
        help="CPU: all points in one process, their timed steps taken in turn (fair ratios on a "
        "shared machine)",
    )  # fmt: skip
    parser.add_argument("--override", nargs="*", default=[], help="recipe overrides key=value")
    parser.add_argument(
        "--sdpa-priority", nargs="+", default=None, choices=sorted(SDPA_BACKENDS),
        help="SDPA backends in this order of preference for every step (torch.nn.attention."
        "sdpa_kernel with set_priority), e.g. cudnn flash efficient math; default: torch's",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--group", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.precision is None:
        args.precision = "bf16-mixed" if args.device == "cuda" else "fp32"
    if args.families is None:
        args.families = ["softmax"] if args.depth else list(FAMILIES)
    if args.preset is None:
        args.preset = "albert" if args.device == "cuda" else "cpu"
    if args.group is not None:
        run_group(json.loads(args.group), args)
        return
    if args.interleave and args.device != "cpu":
        parser.error("--interleave is for CPU runs (CUDA peak memory is per process)")

    rows = []
    started = time.perf_counter()
    groups = plan(args)
    if args.interleave:  # one process for all
        groups = {"all": [p for points in groups.values() for p in points]}
    for family, points in groups.items():
        if not points:
            continue
        argv = [a for a in sys.argv[1:]]
        cmd = module_command(
            "bench.bench_pretrain_throughput", *argv, "--group", json.dumps(points)
        )
        env = subprocess_env()
        t0 = time.perf_counter()
        try:
            res = subprocess.run(
                cmd, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=ROOT
            )
            stdout, stderr, code = res.stdout, res.stderr, res.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, code = f"timed out after {args.timeout} s", -1
        got = [json.loads(line[4:]) for line in stdout.splitlines() if line.startswith("ROW ")]
        done = {r["name"] for r in got}
        for p in points:
            if p["name"] not in done:
                tail = (stderr.strip().splitlines() or ["?"])[-1]
                got.append({**p, "error": f"exit {code}: {tail}"[:500]})
        for r in got:
            print(json.dumps({k: v for k, v in r.items() if k != "step_s_all"}), flush=True)
        print(f"[{family}: {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
        rows.extend(got)
        write(args, {"complete": False}, rows)  # what is done survives a kill of this process
    meta = meta_info(args)
    meta["wall_s"] = time.perf_counter() - started
    print_table(rows, meta)
    write(args, meta, rows)


def write(args, meta: dict, rows: list[dict]) -> None:
    write_result(args.out, {"args": vars(args), "meta": meta, "rows": rows})


def meta_info(args) -> dict:
    import torch

    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "threads": args.threads}
    try:
        import deepspeed

        meta["deepspeed"] = deepspeed.__version__
    except ImportError:
        meta["deepspeed"] = None
    if args.device == "cuda":
        from engine.metrics import peak_flops

        meta["device_name"] = torch.cuda.get_device_name()
        meta["peak_flops_bf16"] = peak_flops("cuda", torch.bfloat16)
    return meta


def print_table(rows: list[dict], meta: dict) -> None:
    where = meta.get("device_name") or f"CPU, {meta['threads']} threads"
    sdpa = next((r["sdpa_priority"] for r in rows if r.get("sdpa_priority")), None)
    sdpa = f", SDPA priority {' > '.join(sdpa)}" if sdpa else ""
    print(f"\n{where}, torch {meta['torch']}, DeepSpeed {meta['deepspeed']}{sdpa}\n")
    print(
        "| config | family | ZeRO | seq | batch | ckpt | step (s) median (min) | tokens/s | "
        "samples/s | MFU | steady step (s), MFU | data / fwd / bwd / opt (ms) | opt share | "
        "peak mem (GB) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['family']} | | {r['seq']} | {r['batch']} | | error: "
                  f"{r['error'][:80]} | | | | | | | |")  # fmt: skip
            continue
        s = r["split_s"]
        split = " / ".join(f"{s[k] * 1e3:.1f}" for k in ("data", "forward", "backward", "step"))
        mem = r.get("peak_gb", r.get("max_rss_gb"))
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        steady = "-"
        if r.get("steady_step_s") is not None:
            steady = f"{r['steady_step_s']:.4f}" + (
                "" if r.get("steady_mfu") is None else f", {100 * r['steady_mfu']:.1f}%"
            )
        batch = f"{r['batch']}" + (
            f" x {r['accumulation']}" if r.get("accumulation", 1) > 1 else ""
        )
        batch += f" (OOM at {r['oom_batches']})" if r["oom_batches"] else ""
        batch += " unpadded" if r.get("padding") == "none" else ""
        print(
            f"| {r['name']} | {r['family']} | {r['zero_stage']} | {r['seq']} | {batch} | "
            f"{'on' if r['activation_checkpointing'] else 'off'} | {r['step_s']:.4f} "
            f"({r['step_s_min']:.4f}) | "
            f"{r['tokens_per_s']:,.0f} | {r['samples_per_s']:.1f} | {mfu} | {steady} | {split} | "
            f"{100 * r['opt_share']:.1f}% | {mem:.2f} |"
        )


if __name__ == "__main__":
    main()
