"""Run under torchrun (2 ranks): every attention family x the given ZeRO stage / precision
pairs, a few real DeepSpeed steps each, then checks on the result. Rank 0 writes a JSON report.

    torchrun --nproc_per_node 2 tests/multiproc/zero_matrix.py SHARDS OUT STAGE:PRECISION[:OPTIONS] ...

OPTIONS: "ckpt" (activation checkpointing), "gas2" (2 micro-batches per step), joined by "-".
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pretrain_support import FAMILY, base_overrides

from engine.engine import shutdown
from engine.metrics import read_scalars
from engine.recipe import load_recipe
from model import diagnostics
from model.hub.release import load_release
from pretrain.config import pretrain_config
from pretrain.train import Trainer

STEPS = 3


def check_weights(trainer: Trainer, release: Path) -> dict:
    """Collective: the release equals the live model's weights (gathered under ZeRO-3)."""
    saved = load_file(str(release / "model.safetensors"))
    with trainer.engine.gathered_parameters() as module:
        live = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    worst = 0.0
    for name, value in live.items():
        # bf16 weights are the rounding of the fp32 master copies the release holds.
        expect = saved[name].to(value.dtype)
        worst = max(worst, (expect.float() - value.float()).abs().max().item())
    return {"same_keys": sorted(saved) == sorted(live), "max_diff_vs_live": worst}


def main() -> None:
    shards, out = Path(sys.argv[1]), Path(sys.argv[2])
    report = {}
    for spec in sys.argv[3:]:
        stage, precision, *options = spec.split(":")
        options = options[0].split("-") if options else []
        for family, extra in FAMILY.items():
            run_dir = out / f"zero{stage}-{precision}-{'-'.join(options) or 'plain'}-{family}"
            overrides = [
                *base_overrides(shards, run_dir, STEPS),
                *extra,
                f"engine.zero_stage={stage}",
                f"engine.precision={precision}",
                "train.diagnostics_every=3",
                "data.verify_checksums=false",
                f"engine.activation_checkpointing={'ckpt' in options}",
                f"engine.gradient_accumulation_steps={2 if 'gas2' in options else 1}",
            ]
            cfg = pretrain_config(load_recipe(None, overrides))
            trainer = Trainer(cfg)
            result = trainer.run()
            row = {"state": result.state, "step": result.step, "last": result.last_losses}
            row.update(check_weights(trainer, run_dir / "release"))
            if trainer.rank == 0:
                model = load_release(run_dir / "release")
                errors = diagnostics.orthogonality_errors(model)
                row["orthogonality_error"] = max(errors.values()) if errors else None
                row["tags"] = sorted(read_scalars(run_dir / "tensorboard"))
                row["finite"] = all(math.isfinite(v) for v in result.last_losses.values())
                if stage == "3":
                    from deepspeed.utils.zero_to_fp32 import (
                        get_fp32_state_dict_from_zero_checkpoint,
                    )

                    ds = get_fp32_state_dict_from_zero_checkpoint(
                        str(run_dir / "checkpoints"), tag=f"step_{STEPS:08d}"
                    )
                    saved = load_file(str(run_dir / "release" / "model.safetensors"))
                    row["zero_to_fp32_max_diff"] = max(
                        (saved[k] - v.float()).abs().max().item() for k, v in ds.items()
                    )
                    row["zero_to_fp32_missing"] = sorted(set(saved) - set(ds))
            report[f"{spec}:{family}"] = row
            del trainer
            torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        (out / "report.json").write_text(json.dumps(report, indent=2))
    shutdown()


if __name__ == "__main__":
    main()
    from engine.process_exit import exit_process

    exit_process(0)  # without the interpreter's teardown, as the commands end
