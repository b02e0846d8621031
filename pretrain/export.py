"""``python -m pretrain.export SOURCE [--step N] --out DIR [--format release|hf] [--overwrite]``

SOURCE is a pretraining run directory (train.run_dir: its checkpoints) or a release directory.

``--format release`` (default) writes a release (config.json + model.safetensors +
tokenizer.json, fp32) from a run's checkpoint: the newest complete one, or step N. Every
checkpoint already holds its weights consolidated to fp32 (gathered from ZeRO-3 partitions,
master weights under bf16/fp16), so this needs neither DeepSpeed nor the number of processes
the run used. The release is loaded once before it is written, so a damaged checkpoint is
reported instead of published.

``--format hf`` writes a directory that Hugging Face `transformers` loads without this project
(`model.hub.hf_export`): a native ALBERT checkpoint for softmax models with ALBERT's layout, else
the family's modeling code beside the weights (``trust_remote_code=True``); the tokenizer with
its special tokens; a model card (README.md) with the family, the sizes, the run's recipe, its
data and the validation metrics of the exported step.

An existing non-empty DIR is kept unless --overwrite. Errors (exit status 2) name the problem:
a SOURCE that is neither a run nor a release, no usable checkpoint, a family without a
Hugging Face export.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from engine.checkpoint import CheckpointError, CheckpointStore
from model.hub.hf_export import ExportError, ModelCardInfo, export_hf
from model.hub.release import export_release, is_release, read_release_config
from pretrain.config import RELEASE_DIR

FORMATS = ("release", "hf")


def _write(release: Path, out: Path, fmt: str, overwrite: bool, card: ModelCardInfo | None):
    if fmt == "hf":
        return export_hf(release, out, card=card, overwrite=overwrite)
    return export_release(release, out, overwrite=overwrite)


def export(
    run_dir: str | Path,
    out: str | Path,
    step: int | None = None,
    overwrite: bool = False,
    format: str = "release",
) -> Path:
    """The release of ``run_dir``'s checkpoint ``step`` (None: newest usable) written to
    ``out`` as a release (``format="release"``) or a Hugging Face directory (``"hf"``)."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {list(FORMATS)}")
    store = CheckpointStore(Path(run_dir) / "checkpoints")
    tags = store.candidates(step)
    if not tags:
        raise CheckpointError(store.root, "no complete checkpoint to export")
    errors = []
    for tag in tags:
        try:
            store.verify(tag)
            release = store.root / tag / RELEASE_DIR
            card = run_card(Path(run_dir), release) if format == "hf" else None
            return _write(release, Path(out), format, overwrite, card)
        except (FileExistsError, ExportError):
            raise  # not a damaged checkpoint: an older one would fail the same way
        except (CheckpointError, OSError, ValueError, RuntimeError) as e:
            if step is not None:
                raise
            errors.append(f"{tag}: {e}")
            warnings.warn(
                f"checkpoint {tag} cannot be exported ({e}); trying an older one", stacklevel=2
            )
    raise CheckpointError(store.root, "no exportable checkpoint: " + "; ".join(errors))


# ----------------------------------------------------------------------------- model card

RECIPE_KEYS = (
    "optimizer.name",
    "optimizer.lr",
    "optimizer.weight_decay",
    "schedule.warmup_steps",
    "schedule.total_steps",
    "schedule.decay",
    "train.steps",
    "engine.micro_batch_size",
    "engine.gradient_accumulation_steps",
    "engine.precision",
    "engine.zero_stage",
    "data.max_seq_length",
    "data.masking.mlm_probability",
    "data.masking.max_ngram",
    "data.masking.sop_probability",
    "model.init_from",
)
"""The run's settings the model card lists (those present in its config.yaml)."""


def _lookup(tree: dict[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def run_card(run_dir: Path, release: Path) -> ModelCardInfo:
    """What the model card says about a run's checkpoint: its step and tokens, the run's recipe
    (config.yaml) and data, and the last validation metrics at or before that step."""
    import yaml

    from engine.metrics import read_jsonl

    extra = read_release_config(release).get("extra") or {}
    step = extra.get("step")
    info = ModelCardInfo(source=f"pretraining run `{run_dir.resolve().name}`", step=step)
    info.tokens = extra.get("tokens")
    config_file = run_dir / "config.yaml"
    if config_file.is_file():
        resolved = yaml.safe_load(config_file.read_text()) or {}
        info.recipe = {
            key: value for key in RECIPE_KEYS if (value := _lookup(resolved, key)) is not None
        }
        phases = resolved.get("phases") or []
        if phases:
            info.recipe["phases"] = phases
        data = resolved.get("data") or {}
        identity = resolved.get("data_identity") or {}
        info.data = {
            "shards": Path(str(data.get("shards", "?"))).name,
            "tokenizer": Path(str(data.get("tokenizer", "?"))).name,
            **identity,
        }
    metrics = run_dir / "tensorboard" / "metrics.jsonl"
    if metrics.is_file():
        rows = read_jsonl(metrics.parent)
        evaluated = [
            s for s, row in rows.items() if "eval/loss/mlm" in row and (step is None or s <= step)
        ]
        if evaluated:
            last = max(evaluated)
            info.validation_step = last
            info.validation = {
                key: float(value)
                for key, value in rows[last].items()
                if key.startswith("eval/") and key != "eval/seconds"
            }
    return info


def release_card(release: Path) -> ModelCardInfo:
    extra = read_release_config(release).get("extra") or {}
    return ModelCardInfo(
        source=f"release `{release.resolve().name}`",
        step=extra.get("step"),
        tokens=extra.get("tokens"),
    )


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "source", help="a pretraining run directory (train.run_dir) or a release directory"
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="release",
        help="release (this project's) or hf (Hugging Face transformers); default: release",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    prog = "python -m pretrain.export"
    source = Path(args.source)
    try:
        if (source / "checkpoints").is_dir():
            path = export(source, args.out, args.step, args.overwrite, args.format)
        elif is_release(source):
            if args.step is not None:
                raise ValueError(f"--step: {source} is a release (one set of weights), not a run")
            card = release_card(source) if args.format == "hf" else None
            path = _write(source, Path(args.out), args.format, args.overwrite, card)
        else:
            what = "does not exist" if not source.exists() else "is neither"
            raise ValueError(
                f"{source} {what}"
                + (
                    " a pretraining run directory (no checkpoints/) nor a release (no "
                    "config.json with a format_version)"
                    if source.exists()
                    else ""
                )
            )
    except FileExistsError:
        print(f"{prog}: {args.out} is not empty; use --overwrite", file=sys.stderr)
        return 2
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    what = "Hugging Face directory" if args.format == "hf" else "release"
    print(f"{what} written to {path}")
    return 0


if __name__ == "__main__":
    from engine.process_exit import exit_process

    exit_process(main())
