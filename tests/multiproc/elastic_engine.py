"""Run under torchrun: the real DeepSpeed engine saves on one world size and resumes on another.

    torchrun --nproc_per_node W tests/multiproc/elastic_engine.py JOB [JOB ...]

JOB: OUT,STAGE,PRECISION,MODE[,STEP]; the jobs run one after the other in the same processes
(one process start-up for several cases), each with an engine of its own.

STAGE: a ZeRO stage (0-3) of the DeepSpeed backend, or "torch" (the plain PyTorch backend).

The global batch is fixed (GLOBAL sequences per optimizer step); each of the W ranks
accumulates GLOBAL / (MICRO x W) micro-batches. Sample p of step t is a pure function of (t, p),
and rank r takes the positions the pretraining loader would give it (micro-step m: positions
m*MICRO*W + r + W*j), so every world size trains on the same global batches.

MODE:
  run       train from scratch to step END, saving a checkpoint (engine.checkpoint's store,
            under OUT/checkpoints) at every step in SAVE_AT; dumps the consolidated state at
            every step to OUT/states/w<W>/step_<t>.pt (rank 0).
  resume    load the checkpoint of STEP from OUT/checkpoints (another world size: Engine.load
            converts it), dump the state right after the load (OUT/states/w<W>-from-<STEP>/
            step_<STEP>.pt) and at every later step up to END; saves the checkpoints of
            RESUME_SAVE_AT after STEP (so a third run can resume from those).

The dump: the consolidated fp32 weights (``Engine.consolidated_state_dict``), every
parameter's full ``exp_avg``/``exp_avg_sq`` (``deepspeed.utils.safe_get_full_optimizer_state``,
gathered from the partitions), the optimizer's step counts, the schedule's state and lr, and
the engine's micro-step counter.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import checkpoint as ckpt
from engine.engine import Engine, EngineConfig, shutdown
from engine.optim import OptimizerConfig, ScheduleConfig
from model.config import EncoderConfig
from model.heads import EncoderForPretraining
from pretrain.objective import model_inputs, pretraining_loss

GLOBAL = 8
MICRO = 2
SEQ = 16
VOCAB = 97
END = 6
SAVE_AT = (3,)
RESUME_SAVE_AT = (5,)


def model_config() -> EncoderConfig:
    # Odd sizes: ZeRO pads the flat partitions, and parameters straddle the rank boundary.
    return EncoderConfig.preset(
        "debug",
        vocab_size=VOCAB,
        hidden_size=24,
        embedding_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=40,
        max_position_embeddings=SEQ,
    )


def sample(step: int, position: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + position)
    ids = torch.randint(5, VOCAB, (SEQ,), generator=g)
    ids[0], ids[SEQ // 2], ids[-1] = 2, 3, 3
    labels = torch.full((SEQ,), -100)
    masked = torch.randperm(SEQ - 2, generator=g)[:3] + 1
    labels[masked] = ids[masked]
    ids[masked] = 4
    types = torch.zeros(SEQ, dtype=torch.long)
    types[SEQ // 2 + 1 :] = 1
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(SEQ, dtype=torch.long),
        "token_type_ids": types,
        "mlm_labels": labels,
        "sop_labels": torch.randint(0, 2, (), generator=g),
    }


def micro_batch(step: int, micro: int, rank: int, world: int) -> dict[str, torch.Tensor]:
    positions = [micro * MICRO * world + rank + world * j for j in range(MICRO)]
    examples = [sample(step, p) for p in positions]
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def dump(engine: Engine, path: Path) -> None:
    """Collective; rank 0 writes."""
    weights = engine.consolidated_state_dict()
    moments: dict[str, torch.Tensor] = {}
    steps: set[float] = set()
    ds = getattr(engine.backend, "ds", None)  # the DeepSpeed engine (None: torch backend)
    partitioned = engine.cfg.zero_stage > 0 or engine.cfg.precision == "bf16"
    base = ds.optimizer.optimizer if partitioned else engine.optimizer
    if partitioned and base.state:  # no state before the first step
        from deepspeed.utils import safe_get_full_optimizer_state

        wrapper = ds.optimizer
        if hasattr(wrapper, "_hp_optimizer_states_linked"):
            # ZeRO-1/2 and the bf16 optimizer link each parameter's view of the moments right
            # after the first group's first update, when the second group has no state yet
            # (DeepSpeed 0.19.8): link again, now that every group has its state.
            wrapper._hp_optimizer_states_linked = False
            wrapper._lazy_init_hp_params_optimizer_state()

        seen = set()
        for name, p in engine.module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            for key in ("exp_avg", "exp_avg_sq"):
                value = safe_get_full_optimizer_state(p, key)
                moments[f"{name}:{key}"] = value.detach().float().cpu().clone()
    elif not partitioned:
        for name, p in engine.module.named_parameters():
            state = base.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    moments[f"{name}:{key}"] = state[key].detach().float().cpu().clone()
    for state in base.state.values():
        if "step" in state:
            steps.add(float(state["step"]))
    if engine.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "weights": weights,
                "moments": moments,
                "optimizer_steps": sorted(steps),
                "scheduler": engine.scheduler.state_dict(),
                "lr": engine.lr,
                "groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in base.param_groups
                ],
                "micro_step": engine.micro_step,
                "world_size": engine.world_size,
            },
            path,
        )
    engine.barrier()


def train_step(engine: Engine, step: int) -> float:
    world = engine.world_size
    total = 0.0
    for m in range(engine.cfg.gradient_accumulation_steps):
        batch = micro_batch(step, m, engine.rank, world)
        out = engine.forward(**model_inputs(batch))
        loss = pretraining_loss(out, batch)
        engine.backward(loss.total)
        total += float(loss.total)
    result = engine.step()
    assert not result.skipped
    return total


def job(dist, out: Path, stage: str, precision: str, mode: str, start_step: int) -> None:
    """One case's launch (MODE above) on the ranks of this process group."""
    accumulation = GLOBAL // (MICRO * dist.world_size)
    cfg = EngineConfig(
        backend="torch" if stage == "torch" else "deepspeed",
        zero_stage=0 if stage == "torch" else int(stage),
        precision=precision,
        micro_batch_size=MICRO,
        gradient_accumulation_steps=accumulation,
        gradient_clipping=1.0,
        device="cpu",
    )
    torch.manual_seed(0)
    model = EncoderForPretraining(model_config())
    engine = Engine(
        model,
        cfg,
        OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.01),
        ScheduleConfig(warmup_steps=2, total_steps=20, decay="linear"),
        dist,
    )
    store = ckpt.CheckpointStore(
        out / "checkpoints",
        rank=engine.rank,
        world_size=engine.world_size,
        keep_last=0,
        barrier=engine.barrier,
    )
    report: dict = {"world_size": engine.world_size, "accumulation": accumulation}
    engine.train()
    if mode == "run":
        states = out / "states" / f"w{engine.world_size}"
        step = 0
        save_at = SAVE_AT
        dump(engine, states / f"step_{step}.pt")
    elif mode == "resume":
        states = out / "states" / f"w{engine.world_size}-from-{start_step}"
        path = out / "checkpoints" / ckpt.tag_for(start_step)
        t0 = time.perf_counter()
        engine.load(path)
        report["load_seconds"] = time.perf_counter() - t0
        step = start_step
        save_at = tuple(s for s in RESUME_SAVE_AT if s > start_step)
        universal = path / "universal"
        if (universal / "albatross_universal.json").is_file():
            report["universal"] = json.loads((universal / "albatross_universal.json").read_text())
        report["universal_files"] = sum(1 for p in universal.rglob("*") if p.is_file())
        dump(engine, states / f"step_{step}.pt")
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    while step < END:
        train_step(engine, step)
        step += 1
        dump(engine, states / f"step_{step}.pt")
        if step in save_at:
            staging = store.begin(step)
            engine.save(staging)
            store.commit(step, {"world_size": engine.world_size})
    if engine.rank == 0:
        (states / "report.json").write_text(json.dumps(report, indent=2))
    engine.barrier()
    # Gone before the next job's engine and before the process group is: a DeepSpeed engine
    # collected only at interpreter exit, after destroy_process_group, sometimes aborted the
    # process there ("terminate called without an active exception", seen once on 3 ranks
    # under ZeRO-3).
    del engine, store  # the store holds engine.barrier
    gc.collect()


def main() -> None:
    from engine.distributed import detect

    dist = detect()
    for spec in sys.argv[1:]:
        out, stage, precision, mode, *step = spec.split(",")
        job(dist, Path(out), stage, precision, mode, int(step[0]) if step else 0)
    shutdown()


if __name__ == "__main__":
    main()
    from engine.process_exit import exit_process

    exit_process(0)  # without the interpreter's teardown, as the commands end
