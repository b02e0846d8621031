"""What a pretraining run opens and checks before it trains: its shards (per phase and the
held-out validation split), the identity of its data, its run directory (a run directory
holds one run: another config is refused, keys added to the code later with their old
behaviour as default do not count) and the checkpoint a resume would start from. Also the
run's result and its errors."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.format import TOKENIZER, sha256_file
from data_prep.loader import PretrainingData
from engine import checkpoint as ckpt
from engine import reshard
from engine.distributed import DistEnv
from engine.recipe import diff_keys, move_saved_keys
from model.config import EncoderConfig
from model.hub.release import directory_digest
from model.typed_config import config_dict, config_sections
from pretrain.config import (
    LOCATION_KEYS,
    RESUMABLE_CHANGES,
    Phase,
    PretrainConfig,
)

log = logging.getLogger("pretrain")

CONFIG_FILE = "config.yaml"
STATUS_FILE = "status.json"


class NonFiniteLossError(RuntimeError):
    """Too many steps in a row had a non-finite loss; the run saved a checkpoint and stopped."""


def nonfinite_message(run: int, step: int, skipped: int, path: object, compiled: bool) -> str:
    """The error that stops a run after `run` non-finite steps in a row."""
    message = (
        f"the loss was not finite in {run} steps in a row (up to step {step}; {skipped} "
        f"skipped in all). The weights are those of the last good step, saved in {path}. "
        "Lower optimizer.lr, check the data, or raise train.max_nonfinite_in_a_row."
    )
    if compiled and skipped >= step:  # not one good step: suspect the compiler first
        message += (
            " No step of this run was finite and engine.compile is on: try "
            "engine.compile=false (an earlier compiled TransJect did this on an H200)."
        )
    return message


class SetupError(ValueError):
    """Bad config or input, found before any training work (the CLI's exit 2)."""


@dataclass
class RunResult:
    state: str
    """``"completed"`` or ``"stopped"`` (signal / time budget; resumable)."""
    step: int
    """Optimizer steps done (including skipped ones)."""
    run_dir: Path
    release: Path | None
    """The exported release (completed runs with ``train.export_at_end``)."""
    last_losses: dict[str, float]
    """The last logged averages (``loss/mlm``, ...)."""
    reason: str = ""


def open_data(cfg: PretrainConfig, phase: Phase, rank: int) -> tuple[PretrainingData, Path]:
    """One phase's shard dataset and tokenizer path, both checked (rank 0 also checks the
    sha256s)."""
    shard_dir = Path(phase.shards)
    where = f"phases[{phase.index}].shards" if cfg.phases else "data.shards"
    if not shard_dir.is_dir():
        raise ValueError(f"{where}={str(shard_dir)!r}: no such directory")
    tokenizer = Path(cfg.data.tokenizer) if cfg.data.tokenizer else shard_dir / TOKENIZER
    if not tokenizer.is_file():
        raise ValueError(
            f"tokenizer {tokenizer} not found: set data.tokenizer to the tokenizer.json the "
            "shards were made with"
        )
    data = PretrainingData(
        shard_dir,
        max_seq_length=phase.max_seq_length,
        masking=cfg.data.masking,
        seed=cfg.train.seed,
        verify_checksums=cfg.data.verify_checksums and rank == 0,
        tokenizer_path=tokenizer,
    )
    return data, tokenizer


def open_phases(cfg: PretrainConfig, rank: int) -> tuple[list[PretrainingData], Path]:
    """Every phase's data (checked up front: a bad phase-2 directory fails before phase 1
    trains) and the run's tokenizer, which every phase must share."""
    datas, tokenizers = [], []
    for phase in cfg.resolved_phases():
        data, tokenizer = open_data(cfg, phase, rank)
        datas.append(data)
        tokenizers.append(tokenizer)
    first = sha256_file(tokenizers[0])
    for phase, tokenizer in zip(cfg.resolved_phases()[1:], tokenizers[1:]):
        if sha256_file(tokenizer) != first:
            raise ValueError(
                f"phase {phase.name!r} reads shards made with another tokenizer ({tokenizer}) "
                f"than the first phase ({tokenizers[0]}): every phase needs the same one"
            )
    return datas, tokenizers[0]


def open_validation(cfg: PretrainConfig) -> list[PretrainingData]:
    """Every phase's held-out validation split (a ShardError naming the flags when its shards
    have none: ``train.eval_every`` needs one)."""
    return [
        PretrainingData(
            Path(phase.shards),
            max_seq_length=phase.max_seq_length,
            masking=cfg.data.masking,
            seed=cfg.train.seed,
            split="validation",
        )
        for phase in cfg.resolved_phases()
    ]


def data_identity(
    datas: list[PretrainingData],
    tokenizer: Path,
    init: str | None = None,
    deepspeed_config: str | None = None,
) -> dict[str, str]:
    """What the run trains on, by content: a digest of the shards' sha256s (from the
    manifests, phase after phase), the tokenizer's sha256, when it continues from a
    checkpoint, the checkpoint's content, and with ``engine.deepspeed_config`` that file's
    sha256 (a file edited between two attempts is not the run's any more). A moved or copied
    shard directory or checkpoint keeps its identity."""
    import hashlib

    shards = [shard["sha256"] for data in datas for shard in data.manifest["shards"]]
    digest = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()
    identity = {"shards_sha256": digest, "tokenizer_sha256": sha256_file(tokenizer)}
    if init is not None:
        identity["init_sha256"] = directory_digest(init)
    if deepspeed_config is not None:
        identity["deepspeed_config_sha256"] = sha256_file(Path(deepspeed_config))
    return identity


ADDED_KEYS = (
    ("data_identity", False),
    ("phases", True),
    ("data_identity.deepspeed_config_sha256", False),
)
"""Keys of a run's config.yaml that are not config fields (the data's identity) or whose
default is no single value (the phases), added after run directories were first written:
(dotted key, whether it is left out only when its value now is empty). A run directory saved
without one is compared without it, so it still resumes. Config fields added later need no
entry here: see ``_without_fields_at_their_default``."""


def _typed_default(cls: type, key: str) -> tuple[bool, Any]:
    """``(known, default)`` of the dotted ``key`` of the config class ``cls``, as a saved
    config writes it (a section: its class's defaults as a dict)."""
    node: Any = cls
    for part in key.split("."):
        if not (isinstance(node, type) and dataclasses.is_dataclass(node)):
            return False, None
        sections = config_sections(node)
        if part in sections:
            node = sections[part]
            continue
        if node is PretrainConfig and part == "model":  # a dict field holding EncoderConfig
            node = EncoderConfig
            continue
        field = {f.name: f for f in dataclasses.fields(node) if f.init}.get(part)
        if field is None:
            return False, None
        if field.default is not dataclasses.MISSING:
            node = field.default
        elif field.default_factory is not dataclasses.MISSING:
            node = field.default_factory()
        else:
            return False, None
        if dataclasses.is_dataclass(node):
            node = type(node)
    if isinstance(node, type) and dataclasses.is_dataclass(node):
        return True, config_dict(node())
    return True, node


def _without_fields_at_their_default(
    saved: dict[str, Any], resolved: dict[str, Any]
) -> dict[str, Any]:
    """``resolved`` less the config fields ``saved`` does not have whose value is their
    default (a copy). A field added after a run started has, by the project's rule, a default
    that keeps the behaviour from before it existed (docs/config.md, "Compatibility"; the
    pinned run of the previous version in tests/fixtures/previous checks it): at that value it
    changes nothing, so the run resumes; at another value it is a real change and is refused."""
    out = copy.deepcopy(resolved)

    def walk(old: dict[str, Any], new: dict[str, Any], prefix: str) -> None:
        for name in list(new):
            key = f"{prefix}{name}"
            if name not in old:
                known, default = _typed_default(PretrainConfig, key)
                if known and new[name] == default:
                    del new[name]
            elif isinstance(old[name], dict) and isinstance(new[name], dict):
                walk(old[name], new[name], f"{key}.")

    walk(saved, out, "")
    return out


def _without_keys_added_since(saved: dict[str, Any], resolved: dict[str, Any]) -> dict[str, Any]:
    """``resolved`` less the ``ADDED_KEYS`` that ``saved`` does not have, and less the fields
    added since at their default (a copy)."""
    out = _without_fields_at_their_default(saved, resolved)
    for key, only_if_empty in ADDED_KEYS:
        *parents, last = key.split(".")
        old, new = saved, out
        for part in parents:
            old, new = old.get(part, {}), new.get(part)
            if not isinstance(old, dict) or not isinstance(new, dict):
                break
        else:
            if last not in old and last in new and not (only_if_empty and new[last]):
                del new[last]
    return out


def check_run_dir(run_dir: Path, resolved: dict[str, Any]) -> bool:
    """True when ``run_dir`` already holds this run (resume); ValueError when it holds another
    config (differences other than ``RESUMABLE_CHANGES``).

    Locations (``LOCATION_KEYS``: the run directory, the shard directory, the tokenizer path)
    are not compared, the content they name is (``data_identity``), so a run directory moved
    or copied elsewhere, or shards moved to another file system, resume. Run directories
    written before ``data_identity`` existed are compared without it."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        if run_dir.is_dir() and (run_dir / "checkpoints").exists():
            raise ValueError(f"{run_dir} has checkpoints but no {CONFIG_FILE}: not reusing it")
        return False
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(saved, dict)
    saved = move_saved_keys(saved)  # keys that moved since (engine.recipe.MOVED_KEYS)
    resolved = _without_keys_added_since(saved, resolved)
    ignored = (*RESUMABLE_CHANGES, *LOCATION_KEYS)
    # A listed key covers the keys under it (engine.compile_options.max_autotune_gemm).
    changed = [
        k
        for k in diff_keys(saved, resolved)
        if k not in ignored and not any(k.startswith(f"{key}.") for key in ignored)
    ]
    if changed:
        what = ""
        if "data_identity.deepspeed_config_sha256" in changed:
            what = (
                " (the file engine.deepspeed_config names was edited since the run started: "
                "restore it, or start another run)"
            )
        elif any(k.startswith("data_identity") for k in changed):
            what = " (the shards or the tokenizer have other content than the run was started with)"
        raise ValueError(
            f"{run_dir} holds a run with a different config ({path}); differing keys: "
            f"{changed}{what}. Use another train.run_dir, or restore those values to resume it."
        )
    return True


def rank_seed(seed: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def resume_accumulation(cfg: PretrainConfig, run_dir: Path, dist: DistEnv) -> int:
    """Before the process group and the engine, for a run that resumes: the checkpoint it
    would start from fits this run (its COMPLETE.json, sizes only; the content is checked when
    it loads). Returns the micro-batches per optimizer step on this number of processes: the
    config's, or on another number of processes than the checkpoint's, what keeps its global
    batch (global / (micro-batch x processes)). Raises ValueError (the CLI's exit 2) when the
    number of processes does not divide that, when the checkpoint's optimizer state cannot be
    re-partitioned, and for ``train.steps`` below the checkpoint's step."""
    store = ckpt.CheckpointStore(
        run_dir / "checkpoints", rank=dist.rank, world_size=dist.world_size
    )
    for tag in store.candidates():
        try:
            record = store.read_complete(tag, checksums=False)
        except ckpt.CheckpointError:
            continue  # the loop's resume reports it and falls back
        saved_world, step = int(record["world_size"]), int(record["step"])
        per_step = record["meta"].get(  # micro-batches per optimizer step, all ranks
            "micro_batches_per_step",
            cfg.engine.gradient_accumulation_steps * saved_world,  # older checkpoints
        )
        micro = cfg.phase_at(step).micro_batch_size
        accumulation = reshard.gradient_accumulation_for(micro * per_step, micro, dist.world_size)
        if (
            saved_world != dist.world_size
            and reshard.saved_world_size(store.root / tag) is not None
        ):
            reshard.check_convertible(store.root / tag)
        if step > cfg.total_steps:
            raise ValueError(
                f"train.steps={cfg.total_steps} is below the step of the checkpoint "
                f"to resume ({store.root / tag}, step {step}): raise train.steps to "
                f"{step} or more, or start a new train.run_dir"
            )
        return accumulation
    return cfg.engine.gradient_accumulation_steps
