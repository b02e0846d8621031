"""Run under torchrun (1 or 2 ranks): the engine's LAMB against a per-tensor reference.

For each ZeRO stage (0, 1, 2) and each step mode (synchronising ``step()``, deferred
``step(defer=True)``), a small model with matrices, an embedding, LayerNorm and biases (two
parameter groups) trains STEPS steps through ``engine.Engine`` (DeepSpeed, fp32, gradient
clipping, a schedule whose lr changes every step), each rank on its share of a fixed batch. The
reference is ``pytorch_optimizer.Lamb`` (the configuration ``engine.optim`` builds for
``implementation='torch'``) on an unwrapped copy, one process, the whole batch, the same
clipping and lrs. Rank 0 writes a JSON report: the largest difference per tensor, the weights,
and how many tensors DeepSpeed split between the ranks' flat partitions. A last run with
``pytorch_optimizer.Lamb`` on ZeRO-2 (per flat partition) is the control.

    torchrun --nproc_per_node 2 tests/multiproc/lamb_zero.py OUT.json
"""

from __future__ import annotations

import gc
import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.distributed import detect
from engine.engine import Engine, EngineConfig, shutdown
from engine.lamb import zero_layouts
from engine.optim import OptimizerConfig, ScheduleConfig, build_optimizer, lr_multiplier

STEPS = 5
BATCH = 8
CLIP = 0.5  # small enough to clip in every step
OPT = OptimizerConfig(name="lamb", implementation="foreach", lr=0.02, weight_decay=0.1)
SCHEDULE = ScheduleConfig(warmup_steps=2, total_steps=8, decay="linear")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(37, 12)
        self.hidden = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.out = nn.Linear(24, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.tanh(self.hidden(self.embedding(ids).mean(1)))))


class Scaled(nn.Module):
    """The no-decay group is one scalar: on 2 ranks one partition of it holds only padding (that
    rank must still join the other's all-reduces of the norms)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(37, 12)
        self.out = nn.Linear(12, 5, bias=False)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids).mean(1)) * self.scale


NETS = {"net": Net, "scaled": Scaled}


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 37, (BATCH, 6), generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def reference(initial: dict[str, torch.Tensor], net_cls: type = Net) -> dict[str, torch.Tensor]:
    net = net_cls()
    net.load_state_dict(initial)
    opt = build_optimizer(net, OptimizerConfig(**{**vars(OPT), "implementation": "torch"}))
    for step in range(STEPS):
        for group in opt.param_groups:
            group["lr"] = OPT.lr * lr_multiplier(step, SCHEDULE)
        ids, labels = data(step)
        opt.zero_grad()
        nn.functional.cross_entropy(net(ids), labels).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def run(
    stage: int,
    defer: bool,
    initial: dict[str, torch.Tensor],
    implementation: str = "foreach",
    net_cls: type = Net,
) -> tuple[dict, int]:
    dist = detect()
    net = net_cls()
    net.load_state_dict(initial)
    cfg = EngineConfig(
        backend="deepspeed",
        zero_stage=stage,
        precision="fp32",
        device="cpu",
        micro_batch_size=BATCH // dist.world_size,
        gradient_clipping=CLIP,
    )
    opt = OptimizerConfig(**{**vars(OPT), "implementation": implementation})
    engine = Engine(net, cfg, opt, SCHEDULE, dist)
    split = 0
    if stage > 0 and engine.flat_layouts:
        for _, layout in zero_layouts(engine.backend.ds.optimizer):
            pieces = {t: n for _, n, t in layout.pieces}
            counts = [0] * layout.num_tensors
            for t in pieces:
                counts[t] = 1
            sizes = torch.tensor(counts)
            torch.distributed.all_reduce(sizes)
            split += int((sizes > 1).sum())
    share = slice(dist.rank * cfg.micro_batch_size, (dist.rank + 1) * cfg.micro_batch_size)
    for step in range(STEPS):
        ids, labels = data(step)
        loss = nn.functional.cross_entropy(engine.forward(ids[share]), labels[share])
        engine.backward(loss, defer=defer)
        result = engine.step(defer=defer)
        if defer:
            result = result.resolve()
        assert not result.skipped, (stage, defer, step)
    state = engine.consolidated_state_dict()
    return state, split


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    initials = {
        name: {k: v.clone() for k, v in cls().state_dict().items()} for name, cls in NETS.items()
    }
    expecteds = {name: reference(initials[name], NETS[name]) for name in NETS}
    report: dict = {"world_size": detect().world_size, "runs": {}}
    # The last run is a control: pytorch_optimizer's LAMB, which knows no layout, on ZeRO-2's
    # flat buffers (trust ratio per flat partition): the comparison must see the difference.
    runs = [(stage, defer, "foreach", "net") for stage in (0, 1, 2) for defer in (False, True)]
    runs += [(2, True, "foreach", "scaled"), (2, False, "torch", "net")]
    # The compiled LAMB (the same step, its arithmetic compiled) on the flat buffers of ZeRO 1-2
    runs += [(1, False, "compiled", "net"), (2, True, "compiled", "net")]
    for stage, defer, implementation, net in runs:
        initial, expected = initials[net], expecteds[net]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*trust ratio is computed per flat")
            state, split = run(stage, defer, initial, implementation, NETS[net])
            diffs = {k: float((state[k] - expected[k]).abs().max()) for k in expected}
            moved = {k: float((expected[k] - initial[k]).abs().max()) for k in expected}
            name = f"zero{stage}-{'deferred' if defer else 'sync'}"
            if implementation != "foreach":
                name += f"-{implementation}"
            if net != "net":
                name += f"-{net}"
            report["runs"][name] = {
                "max_diff": diffs,
                "moved": moved,
                "split_tensors": split,
                "state": {k: v.tolist() for k, v in state.items()},
            }
    if detect().rank == 0:
        out.write_text(json.dumps(report))
    gc.collect()  # the runs' DeepSpeed engines (reference cycles) before the process group
    shutdown()


if __name__ == "__main__":
    main()
    from engine.process_exit import exit_process

    exit_process(0)  # without the interpreter's teardown, as the commands end
