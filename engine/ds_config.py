"""Your own DeepSpeed config, merged with the recipe: ``engine.deepspeed_config: ds_config.json``
(a JSON file, as DeepSpeed reads it) and ``engine.deepspeed`` (the same keys inline in the
recipe). The engine generates DeepSpeed's config from the recipe (``Engine.deepspeed_config``);
these two are merged over it, the file first, then the inline keys, after this module has
reconciled them with the recipe:

* ``"auto"`` (DeepSpeed's and Hugging Face's placeholder) anywhere means "take the recipe's
  value": the key is dropped, so the engine's generated value stands where it sets one and
  DeepSpeed's default elsewhere (e.g. ``zero_optimization.reduce_bucket_size: "auto"``).
* Keys the recipe owns are checked against it and then dropped (the generated value stands).
  A value that agrees is fine; one that contradicts the recipe is a conflict:

      train_micro_batch_size_per_gpu   engine.micro_batch_size
      gradient_accumulation_steps      engine.gradient_accumulation_steps
      train_batch_size                 micro_batch_size x gradient_accumulation_steps x the
                                       number of processes (checked against the real number
                                       when the engine starts; before that, it must be a
                                       multiple of micro_batch_size x gradient_accumulation)
      gradient_clipping                engine.gradient_clipping
      zero_optimization.stage          engine.zero_stage
      bf16.enabled (or bfloat16.)      engine.precision == "bf16" (DeepSpeed's bf16 mode)
      fp16.enabled                     engine.precision == "fp16"; with fp16 also loss_scale
                                       (0: dynamic), initial_scale_power, loss_scale_window,
                                       hysteresis, min_loss_scale vs engine.fp16_*
      torch_autocast.enabled / dtype   engine.precision == "bf16-mixed" (bfloat16)
      amp.enabled                      apex AMP: never (engine.precision sets the precision)
      optimizer, scheduler             the engine passes the recipe's optimizer and schedule
                                       to DeepSpeed as objects, so DeepSpeed's sections cannot
                                       apply: accepted only when every parameter is "auto"
                                       (then dropped); set optimizer.* / schedule.* instead

  Every conflict of both sources is listed in one ``ValueError`` (the CLIs exit 2 before any
  work), each with both values. A bf16 / fp16 / amp section of a precision the recipe does not
  use, once checked, is dropped whole.
* Everything else (offload, bucket sizes, communication settings, ...) is merged as given.

A file that is missing, not valid JSON (or JSON with a key twice, which DeepSpeed refuses too)
or not a JSON object is a ``ValueError`` naming the file.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model.typed_config import deep_merge

if TYPE_CHECKING:
    from engine.engine import EngineConfig

log = logging.getLogger(__name__)

AUTO = "auto"

FP16_KEYS = {
    "initial_scale_power": "fp16_initial_scale_power",
    "loss_scale_window": "fp16_loss_scale_window",
    "hysteresis": "fp16_hysteresis",
    "min_loss_scale": "fp16_min_loss_scale",
}
"""fp16 section keys -> the EngineConfig fields that set them."""

RECIPE_KEYS = {
    "lr": "optimizer.lr",
    "betas": "optimizer.betas",
    "eps": "optimizer.eps",
    "weight_decay": "optimizer.weight_decay",
    "warmup_max_lr": "optimizer.lr",
    "warmup_num_steps": "schedule.warmup_steps",
    "total_num_steps": "schedule.total_steps",
    "warmup_min_lr": "schedule.min_lr_ratio",
    "warmup_type": "schedule.decay",
}
"""DeepSpeed optimizer / scheduler parameters -> the recipe keys that set them."""


def load_json(path: str | os.PathLike) -> dict[str, Any]:
    """The DeepSpeed config in the JSON file ``path``; ``ValueError`` naming the file when it
    is missing, unreadable, not valid JSON, holds a key twice or is not a JSON object."""
    file = Path(path)
    where = f"engine.deepspeed_config={os.fspath(path)!r}"
    if not file.exists():
        raise ValueError(f"{where}: no such file")
    if not file.is_file():
        raise ValueError(f"{where}: not a file")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ValueError(f"the key {key!r} appears twice in one object")
            out[key] = value
        return out

    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot be read ({e})") from e
    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from e
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: a DeepSpeed config is a JSON object ({{...}}), got {type(data).__name__}"
        )
    return data


def drop_auto(node: Any) -> Any:
    """``node`` without the keys whose value is ``"auto"`` (recursively)."""
    if isinstance(node, dict):
        return {k: drop_auto(v) for k, v in node.items() if not _is_auto(v)}
    return node


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


def _leaves(node: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        out: list[tuple[str, Any]] = []
        for key, value in node.items():
            out.extend(_leaves(value, f"{prefix}.{key}"))
        return out
    return [(prefix, node)]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _flag(value: Any) -> bool | None:
    """A JSON ``enabled`` value as a bool (true/false, 1/0); None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    return None


def _same_number(a: Any, b: float) -> bool:
    x = _number(a)
    return x is not None and math.isclose(x, float(b), rel_tol=1e-9, abs_tol=0.0)


def reconcile(
    extra: dict[str, Any], cfg: EngineConfig, source: str, world_size: int | None = None
) -> tuple[dict[str, Any], list[str]]:
    """``extra`` (a DeepSpeed config from ``source``) against the recipe ``cfg``: the part to
    merge over the generated config (``"auto"`` and the recipe's keys dropped; a given
    ``train_batch_size`` kept for the engine's check against the number of processes) and the
    conflicts, one line each (``key=theirs vs engine.field=ours``). ``world_size``: check
    ``train_batch_size`` exactly (None: only that it fits the recipe's batch layout)."""
    conflicts: list[str] = []

    def conflict(key: str, theirs: Any, ours: str) -> None:
        conflicts.append(f"{source}: {key}={json.dumps(theirs)} vs {ours}")

    out = copy.deepcopy(extra)
    for name in ("optimizer", "scheduler"):
        if name not in out:
            continue
        section = out.pop(name)
        if _is_auto(section):
            continue
        if not isinstance(section, dict):
            conflict(name, section, "the recipe's optimizer / schedule sections")
            continue
        given = [
            (key, value)
            for key, value in _leaves(section, name)
            if key != f"{name}.type" and not _is_auto(value)
        ]
        for key, value in given:
            param = key.rsplit(".", 1)[-1]
            ours = RECIPE_KEYS.get(param, "optimizer.*" if name == "optimizer" else "schedule.*")
            conflict(
                key,
                value,
                f"the recipe's {ours} (the engine hands DeepSpeed the recipe's {name} as an "
                f'object, so this section cannot apply: set {ours} in the recipe, or write "auto")',
            )
        if not given:
            log.info(
                '%s: the %s section (all "auto") is dropped: the recipe\'s %s is used',
                source,
                name,
                "optimizer" if name == "optimizer" else "schedule",
            )
    out = drop_auto(out)

    micro, accumulation = cfg.micro_batch_size, cfg.gradient_accumulation_steps
    if "train_micro_batch_size_per_gpu" in out:
        value = out.pop("train_micro_batch_size_per_gpu")
        if not _same_number(value, micro):
            conflict("train_micro_batch_size_per_gpu", value, f"engine.micro_batch_size={micro}")
    if "gradient_accumulation_steps" in out:
        value = out.pop("gradient_accumulation_steps")
        if not _same_number(value, accumulation):
            conflict(
                "gradient_accumulation_steps",
                value,
                f"engine.gradient_accumulation_steps={accumulation}",
            )
    if "train_batch_size" in out:
        value = out["train_batch_size"]
        per_process = micro * accumulation
        layout = (
            f"engine.micro_batch_size x engine.gradient_accumulation_steps x processes = "
            f"{micro} x {accumulation} x"
        )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            conflict("train_batch_size", value, f"{layout} processes (an integer)")
            out.pop("train_batch_size")
        elif world_size is not None:
            if value != per_process * world_size:
                conflict(
                    "train_batch_size",
                    value,
                    f"{layout} {world_size} = {per_process * world_size}",
                )
            out.pop("train_batch_size")
        elif value % per_process:
            conflict(
                "train_batch_size",
                value,
                f"{layout} N: not a multiple of {per_process} for any number of processes",
            )
            out.pop("train_batch_size")
    if "gradient_clipping" in out:
        value = out.pop("gradient_clipping")
        if not _same_number(value, cfg.gradient_clipping):
            conflict(
                "gradient_clipping", value, f"engine.gradient_clipping={cfg.gradient_clipping}"
            )
    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and "stage" in zero:
        value = zero.pop("stage")
        if not _same_number(value, cfg.zero_stage):
            conflict("zero_optimization.stage", value, f"engine.zero_stage={cfg.zero_stage}")
    elif zero is not None and not isinstance(zero, dict):
        conflict("zero_optimization", zero, "a section ({...}; its stage is engine.zero_stage)")
        out.pop("zero_optimization")
    _precision(out, cfg, conflict)
    return _prune(out), conflicts


def _prune(node: Any) -> Any:
    """``node`` without the sections left empty (their keys were the recipe's or "auto")."""
    if not isinstance(node, dict):
        return node
    pruned = {k: _prune(v) for k, v in node.items()}
    return {k: v for k, v in pruned.items() if not (isinstance(v, dict) and not v)}


def _precision(out: dict[str, Any], cfg: EngineConfig, conflict) -> None:
    precision = f"engine.precision={cfg.precision!r}"
    for name in ("bf16", "bfloat16"):
        if name not in out:
            continue
        section = out[name]
        if not isinstance(section, dict):
            conflict(name, section, f"a section with enabled: true|false ({precision})")
            out.pop(name)
            continue
        if "enabled" in section:
            enabled = section.pop("enabled")
            if _flag(enabled) is not (cfg.precision == "bf16"):
                conflict(
                    f"{name}.enabled",
                    enabled,
                    f"{precision} (DeepSpeed's bf16 mode is engine.precision='bf16'; "
                    "'bf16-mixed' is autocast over fp32 weights)",
                )
        if cfg.precision != "bf16":
            out.pop(name)
    if "fp16" in out:
        section = out["fp16"]
        if not isinstance(section, dict):
            conflict("fp16", section, f"a section with enabled: true|false ({precision})")
            out.pop("fp16")
        else:
            if "enabled" in section:
                enabled = section.pop("enabled")
                if _flag(enabled) is not (cfg.precision == "fp16"):
                    conflict("fp16.enabled", enabled, precision)
            if cfg.precision == "fp16":
                if "loss_scale" in section:
                    value = section.pop("loss_scale")
                    if not _same_number(value, 0):
                        conflict(
                            "fp16.loss_scale",
                            value,
                            "0 (the engine's fp16 uses dynamic loss scaling, engine.fp16_*)",
                        )
                for key, attr in FP16_KEYS.items():
                    if key in section:
                        value = section.pop(key)
                        if not _same_number(value, getattr(cfg, attr)):
                            conflict(f"fp16.{key}", value, f"engine.{attr}={getattr(cfg, attr)}")
            else:
                out.pop("fp16")
    if "amp" in out:
        section = out.pop("amp")
        enabled = section.get("enabled") if isinstance(section, dict) else section
        if _flag(enabled) is not False and enabled is not None:
            conflict(
                "amp.enabled",
                enabled,
                f"{precision} (apex AMP is not used: engine.precision sets the precision)",
            )
    if "torch_autocast" in out:
        section = out["torch_autocast"]
        mixed = cfg.precision == "bf16-mixed"
        if not isinstance(section, dict):
            conflict("torch_autocast", section, f"a section ({precision})")
            out.pop("torch_autocast")
            return
        if "enabled" in section:
            enabled = section.pop("enabled")
            if _flag(enabled) is not mixed:
                conflict(
                    "torch_autocast.enabled",
                    enabled,
                    f"{precision} (the engine autocasts with engine.precision='bf16-mixed')",
                )
        if "dtype" in section:
            dtype = section.pop("dtype")
            if mixed and str(dtype).replace("torch.", "") not in ("bfloat16", "bf16"):
                conflict("torch_autocast.dtype", dtype, f"{precision} (bfloat16)")
        if not mixed:
            out.pop("torch_autocast")


def resolve(cfg: EngineConfig, world_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config to merge over the generated one: ``engine.deepspeed_config``'s file
    reconciled with the recipe, then ``engine.deepspeed`` over it. ``ValueError`` listing every
    conflict of both (and naming the file when it cannot be read)."""
    conflicts: list[str] = []
    merged: dict[str, Any] = {}
    if cfg.deepspeed_config is not None:
        source = f"engine.deepspeed_config ({cfg.deepspeed_config})"
        kept, found = reconcile(load_json(cfg.deepspeed_config), cfg, source, world_size)
        merged, conflicts = kept, conflicts + found
    kept, found = reconcile(cfg.deepspeed, cfg, "engine.deepspeed", world_size)
    conflicts += found
    merged = deep_merge(merged, kept)
    if conflicts:
        raise ValueError(
            f"the DeepSpeed config contradicts the recipe in {len(conflicts)} key(s):\n  "
            + "\n  ".join(conflicts)
            + "\nSet these in the recipe (engine.*, optimizer.*, schedule.*), drop them from the "
            'DeepSpeed config, or write "auto" there to take the recipe\'s values.'
        )
    return merged
