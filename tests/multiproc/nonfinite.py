"""Run under torchrun (2 ranks): inject non-finite losses into a real DeepSpeed run.

Rank 1's loss is NaN at steps 3 and 4 (rank 0's is finite): both ranks must skip those updates
(weights, optimizer and schedule untouched). From step 7 on every loss is inf: after
max_nonfinite_in_a_row=3 such steps the run saves and raises NonFiniteLossError.

    torchrun --nproc_per_node 2 tests/multiproc/nonfinite.py SHARDS OUT
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain_support import base_overrides

import pretrain.train as train_module
from engine.engine import shutdown
from engine.recipe import load_recipe
from pretrain.config import pretrain_config

calls = {"n": 0}
original_loss = train_module.pretraining_loss


def poisoned_loss(output, batch, *terms):
    loss = original_loss(output, batch, *terms)
    calls["n"] += 1  # one micro-batch per step: call n is step n
    step, rank = calls["n"], torch.distributed.get_rank()
    if (step in (3, 4) and rank == 1) or step >= 7:
        loss.total = loss.total * (float("nan") if step < 7 else float("inf"))
    return loss


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    shards, out = Path(sys.argv[1]), Path(sys.argv[2])
    train_module.pretraining_loss = poisoned_loss
    overrides = [
        *base_overrides(shards, out / "run", 20),
        "engine.zero_stage=2",
        "train.max_nonfinite_in_a_row=3",
        "data.verify_checksums=false",
    ]
    trainer = train_module.Trainer(pretrain_config(load_recipe(None, overrides)))
    digests, lrs = {}, {}
    step_fn = trainer._train_step

    def recording_step(*args, **kwargs):
        before = digest(trainer.engine.module)
        result = step_fn(*args, **kwargs)
        digests[trainer.step + 1] = (before, digest(trainer.engine.module))
        lrs[trainer.step + 1] = result.deferred.lr
        return result

    trainer._train_step = recording_step
    error = None
    try:
        trainer.run()
    except train_module.NonFiniteLossError as e:
        error = str(e)
    if trainer.rank == 0:
        report = {
            "error": error,
            "step": trainer.step,
            "skipped": trainer.skipped,
            "unchanged": {s: a == b for s, (a, b) in digests.items()},
            "lrs": lrs,
            "complete_steps": trainer.store.complete_steps(),
            "final_digest": digests[max(digests)][1],
            "digest_after_6": digests[6][1],
        }
        (out / "report.json").write_text(json.dumps(report, indent=2))
    # The trainer and its DeepSpeed engine before the process group (not at interpreter exit).
    trainer = step_fn = None  # (closed over by recording_step: rebound, not deleted)
    gc.collect()
    shutdown()


if __name__ == "__main__":
    main()
    from engine.process_exit import exit_process

    exit_process(0)  # without the interpreter's teardown, as the commands end
