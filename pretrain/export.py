"""``python -m pretrain.export RUN_DIR [--step N] --out DIR [--overwrite]``

Writes a release (config.json + model.safetensors + tokenizer.json, fp32) from a pretraining
run's checkpoint: the newest complete one, or step N. Every checkpoint already holds its weights
consolidated to fp32 (gathered from ZeRO-3 partitions, master weights under bf16/fp16), so this
needs neither DeepSpeed nor the number of processes the run used. The release is loaded once
before it is written, so a damaged checkpoint is reported instead of published; an existing
non-empty DIR is kept unless --overwrite.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from engine.checkpoint import CheckpointError, CheckpointStore
from model.release import export_release
from pretrain.config import RELEASE_DIR


def export(
    run_dir: str | Path, out: str | Path, step: int | None = None, overwrite: bool = False
) -> Path:
    """The release of ``run_dir``'s checkpoint ``step`` (None: newest usable) written to ``out``."""
    store = CheckpointStore(Path(run_dir) / "checkpoints")
    tags = store.candidates(step)
    if not tags:
        raise CheckpointError(store.root, "no complete checkpoint to export")
    errors = []
    for tag in tags:
        try:
            store.verify(tag)
            return export_release(store.root / tag / RELEASE_DIR, Path(out), overwrite=overwrite)
        except FileExistsError:
            raise
        except (CheckpointError, OSError, ValueError, RuntimeError) as e:
            if step is not None:
                raise
            errors.append(f"{tag}: {e}")
            warnings.warn(
                f"checkpoint {tag} cannot be exported ({e}); trying an older one", stacklevel=2
            )
    raise CheckpointError(store.root, "no exportable checkpoint: " + "; ".join(errors))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="the pretraining run directory (train.run_dir)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("--out", required=True, help="release directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    try:
        path = export(args.run_dir, args.out, args.step, args.overwrite)
    except FileExistsError:
        print(
            f"python -m pretrain.export: {args.out} is not empty; use --overwrite", file=sys.stderr
        )
        return 2
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"python -m pretrain.export: {e}", file=sys.stderr)
        return 2
    print(f"release written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
