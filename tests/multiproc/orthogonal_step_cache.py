"""Run under torchrun (2 ranks): the orthogonal step cache and map sharding across processes.

A small TransJect pretraining model trains STEPS optimizer steps of gradient accumulation
ACCUMULATION through ``engine.Engine`` on the torch backend (DDP: ``no_sync`` before the last
micro-batch, the all-reduce in its backward) and on DeepSpeed ZeRO 0, 1 and 2 (the reduction
of ZeRO 1-2 in the last backward), with activation checkpointing, each rank on its own
micro-batches, four ways: ``model.orthogonal_step_cache`` and ``orthogonal_shard_maps`` each off and
on; on the torch backend also both on under ``engine.compile`` (aot_eager). Rank 0 writes a JSON report: per run and way, whether the step cache was active and with
sharding, how many matrices each rank mapped, the largest difference between its weights and
those of the way with both off, and how far the weights moved.

    torchrun --nproc_per_node 2 tests/multiproc/orthogonal_step_cache.py OUT.json
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.distributed import detect
from engine.engine import Engine, EngineConfig, shutdown
from engine.optim import OptimizerConfig, ScheduleConfig
from model import EncoderConfig, EncoderForPretraining
from model.orthogonal_step import OrthogonalMapHooks

STEPS = 2
ACCUMULATION = 3
OPT = OptimizerConfig(name="lamb", lr=1e-3)
SCHEDULE = ScheduleConfig(warmup_steps=0, total_steps=8)
RUNS = [("torch", 0)] + [("deepspeed", stage) for stage in (0, 1, 2)]


def model(cache: bool = True, shard: bool = True) -> EncoderForPretraining:
    torch.manual_seed(0)
    cfg = EncoderConfig.preset(
        "debug",
        attention="transject",
        hidden_dropout_prob=0.0,
        num_hidden_layers=3,
        transject={"num_experts": 2},
        orthogonal_step_cache=cache,
        orthogonal_shard_maps=shard,
        orthogonal_shard_min_size=0,  # the debug model's maps are small
    )
    return EncoderForPretraining(cfg)


WAYS = {"off": (False, False), "cache": (True, False), "shard": (False, True), "both": (True, True)}


def run(
    backend: str, stage: int, cache: bool, shard: bool, compiled: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    dist = detect()
    cfg = EngineConfig(
        backend=backend,
        zero_stage=stage,
        precision="fp32",
        device="cpu",
        micro_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION,
        activation_checkpointing=True,
        compile=compiled,
        compile_backend="aot_eager",
    )
    engine = Engine(model(cache, shard), cfg, OPT, SCHEDULE, dist)
    hooks = [h for h in engine.step_hooks if isinstance(h, OrthogonalMapHooks)]
    steps = hooks[0].steps if hooks else None
    g = torch.Generator().manual_seed(1000 + dist.rank)  # each rank its own micro-batches
    for _ in range(STEPS * ACCUMULATION):
        ids = torch.randint(4, 512, (2, 12), generator=g)
        out = engine.forward(ids, torch.ones_like(ids, dtype=torch.bool))
        aux = sum(out.aux_losses.values(), torch.zeros(()))
        engine.backward(out.logits.square().mean() + out.sop_logits.square().mean() + aux)
        if engine.at_boundary:
            assert not engine.step().skipped
    state = engine.consolidated_state_dict()
    mapped = torch.tensor([steps.evaluations if steps is not None else -1])
    gathered = [torch.zeros_like(mapped) for _ in range(dist.world_size)]
    torch.distributed.all_gather(gathered, mapped)
    info = {
        "active": steps is not None,
        "sharded": steps is not None and steps.sharding is not None,
        "mapped_per_rank": [int(t) for t in gathered],
    }
    # Gone before the process group is: a DDP reducer (or DeepSpeed engine) collected only at
    # interpreter exit, after destroy_process_group, sometimes aborted the process there.
    del engine
    gc.collect()
    return state, info


def main() -> None:
    out = Path(sys.argv[1])
    initial = {k: v.clone() for k, v in model().state_dict().items()}
    report: dict = {"world_size": detect().world_size, "runs": {}}
    for backend, stage in RUNS:
        states, infos = {}, {}
        for way, (cache, shard) in WAYS.items():
            states[way], infos[way] = run(backend, stage, cache, shard)
        if backend == "torch":  # both on under engine.compile: maps eager, before the graph
            states["compiled"], infos["compiled"] = run(backend, stage, True, True, compiled=True)
        off = states["off"]
        report["runs"][f"{backend}-zero{stage}"] = {
            way: {
                **infos[way],
                "max_diff": max(float((states[way][k] - off[k]).abs().max()) for k in off),
            }
            for way in states
        } | {"moved": max(float((off[k] - initial[k]).abs().max()) for k in off)}
    if detect().rank == 0:
        out.write_text(json.dumps(report))
    shutdown()


if __name__ == "__main__":
    main()
    from engine.process_exit import exit_process

    exit_process(0)  # without the interpreter's teardown, as the commands end
