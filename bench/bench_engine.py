"""Training-step throughput of the engine against a plain PyTorch loop, same model, same batches.

    python -m bench.bench_engine [--hidden 256 --layers 4 --seq 128 --batch 16 --steps 30 --repeats 3]

One process on CPU (DeepSpeed with a process group of one over gloo). Variants:

* ``plain``: ``model(**inputs)`` -> loss -> ``backward`` -> ``clip_grad_norm_`` -> AdamW step,
  written out by hand (the nearest real peer: what a user would write without the engine);
* ``engine/torch``: ``engine.Engine`` with the plain-PyTorch backend;
* ``engine/deepspeed-zero0`` and ``engine/deepspeed-zero2``: ``engine.Engine`` with DeepSpeed.

The loss is the pretraining objective (``pretrain.objective``) on batches drawn once from the
real loader (shards of the embedded corpus), so data loading is not measured. Each variant runs
``--steps`` steps after 3 warm-up steps, ``--repeats`` times in interleaved order; the median is
reported. Results go to bench/results/engine.json; docs/benchmarks.md shows the ratio to
``plain`` (target: the engine within 15% of the plain loop).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_result
from data_prep.loader import PretrainingData, PretrainingLoader
from data_prep.shards import ShardConfig, build_shards
from data_prep.tokenizer import write_tokenizer
from engine.distributed import DistEnv
from engine.engine import Engine, EngineConfig
from engine.optim import OptimizerConfig, ScheduleConfig
from model import EncoderConfig, EncoderForPretraining
from pretrain.objective import model_inputs, pretraining_loss

WARMUP = 3


def make_batches(seq: int, batch: int, count: int) -> tuple[list[dict], int]:
    root = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    write_tokenizer(root / "tok", inputs=["embedded"], vocab_size=8000)
    tok = root / "tok" / "tokenizer.json"
    cfg = ShardConfig(inputs=("embedded",), num_shards=1, max_seq_length=seq, seed=0)
    build_shards(cfg, tok, root / "shards", workers=1)
    data = PretrainingData(root / "shards", max_seq_length=seq, tokenizer_path=tok)
    loader = PretrainingLoader(data, batch, static_shapes=True)
    it = iter(loader)
    return [next(it) for _ in range(count)], data.vocab_size


def max_masked(batches: list[dict]) -> int:
    """The MLM head's slots per row: the most masked tokens of any row (host batches)."""
    return max(int((b["mlm_labels"] != -100).sum(1).max()) for b in batches)


def build_model(args, vocab: int) -> EncoderForPretraining:
    torch.manual_seed(0)
    cfg = EncoderConfig.preset(
        "debug",
        vocab_size=vocab,
        hidden_size=args.hidden,
        embedding_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return EncoderForPretraining(cfg)


def run_plain(model, batches, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    for i in range(WARMUP + steps):
        if i == WARMUP:
            start = time.perf_counter()
        batch = batches[i % len(batches)]
        loss = pretraining_loss(model(**model_inputs(batch, max_masked(batches))), batch).total
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return steps / (time.perf_counter() - start)


def run_engine(engine: Engine, batches, steps: int) -> float:
    for i in range(WARMUP + steps):
        if i == WARMUP:
            start = time.perf_counter()
        batch = batches[i % len(batches)]
        inputs = model_inputs(batch, max_masked(batches))
        loss = pretraining_loss(engine.forward(**inputs), batch).total
        engine.backward(loss)
        engine.step()
    return steps / (time.perf_counter() - start)


def make_engine(args, vocab: int, backend: str, stage: int) -> Engine:
    dist = DistEnv(0, 0, 1, 1, 0, "127.0.0.1", args.port, "single")
    cfg = EngineConfig(
        backend=backend,
        zero_stage=stage,
        precision="fp32",
        micro_batch_size=args.batch,
        device="cpu",
    )
    opt = OptimizerConfig(name="adamw", lr=1e-4, weight_decay=0.01)
    sched = ScheduleConfig(warmup_steps=0, total_steps=10**6, decay="constant")
    return Engine(build_model(args, vocab), cfg, opt, sched, dist)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29517)
    parser.add_argument("--out", default="bench/results/engine.json")
    args = parser.parse_args()
    batches, vocab = make_batches(args.seq, args.batch, 8)
    engines = {
        "engine/torch": make_engine(args, vocab, "torch", 0),
        "engine/deepspeed-zero0": make_engine(args, vocab, "deepspeed", 0),
        "engine/deepspeed-zero2": make_engine(args, vocab, "deepspeed", 2),
    }
    plain_model = build_model(args, vocab)
    results: dict[str, list[float]] = {"plain": [], **{k: [] for k in engines}}
    for r in range(args.repeats):
        results["plain"].append(run_plain(plain_model, batches, args.steps))
        for name, engine in engines.items():
            results[name].append(run_engine(engine, batches, args.steps))
        print(f"repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in results.items()))
    base = statistics.median(results["plain"])
    rows = {
        name: {
            "steps_per_s": statistics.median(v),
            "all": v,
            "time_ratio_vs_plain": base / statistics.median(v),
        }
        for name, v in results.items()
    }
    print(f"\n{'variant':<24} {'steps/s':>8} {'time vs plain':>14}")
    for name, row in rows.items():
        print(f"{name:<24} {row['steps_per_s']:>8.2f} {row['time_ratio_vs_plain']:>14.3f}")
    write_result(args.out, {"meta": {"args": vars(args)}, "results": rows})


if __name__ == "__main__":
    main()
