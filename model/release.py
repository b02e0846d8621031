"""The release directory: `config.json` + `model.safetensors` (+ `tokenizer.json`). Never pickle.

`config.json` holds the full encoder config, the head config and a format version;
`model.safetensors` holds fp32 weights (parametrized tensors as their free parameters, so a load
reproduces the saved model bit for bit). `save_release` and `load_release` are one call each.

Loading with a different head (e.g. a pretraining release into a classifier) keeps the encoder
weights, initialises the new head, and reports which head tensors were not loaded.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from model.config import EncoderConfig, config_to_dict
from model.heads import build_model

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"


def _fp32_contiguous(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, t in state.items():
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.float()
        out[key] = t.contiguous().clone()  # clone: safetensors refuses shared storage
    return out


def _apply_umask(path: Path, directory: bool = False) -> None:
    """Gives `path` the mode a plain mkdir / open would (0777 / 0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if directory else 0o666) & ~umask)


def save_release(
    out_dir: str | os.PathLike,
    model: torch.nn.Module,
    tokenizer_file: str | os.PathLike | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Writes a release dir atomically (a temp dir renamed into place).

    `state_dict` overrides `model.state_dict()` (e.g. weights consolidated from ZeRO-3).
    An existing non-empty `out_dir` is an error unless `overwrite=True`.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"release dir {out} already exists and is not empty (pass overwrite=True)"
        )
    config = {
        "format_version": FORMAT_VERSION,
        "encoder": config_to_dict(model.config),
        "head": model.head_config(),
        **({"extra": extra} if extra else {}),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    _apply_umask(tmp, directory=True)  # mkdtemp makes it 0700: collaborators could not read it
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        weights = _fp32_contiguous(state_dict if state_dict is not None else model.state_dict())
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer_file is not None:
            tok = Path(tokenizer_file)
            if not tok.is_file():
                raise FileNotFoundError(f"tokenizer file {tok} does not exist")
            shutil.copyfile(tok, tmp / TOKENIZER_FILE)
        for f in tmp.iterdir():  # safetensors writes 0600
            _apply_umask(f)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_release_config(release_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(release_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a release directory")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{path}: unsupported release format_version {version!r} (expected {FORMAT_VERSION})"
        )
    return config


def load_release(
    release_dir: str | os.PathLike,
    head: dict[str, Any] | None = None,
    map_location: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Builds the model from `config.json` and loads `model.safetensors`.

    `head` (e.g. {"type": "sequence_classification", "num_labels": 3}) replaces the saved head:
    encoder weights must all load; head weights load where names and shapes match.
    """
    release = Path(release_dir)
    config = read_release_config(release)
    cfg = EncoderConfig.from_dict(config["encoder"])
    saved_head = config["head"]
    model = build_model(cfg, head or saved_head)
    weights_path = release / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} not found")
    state = load_file(str(weights_path), device=str(map_location))
    if head is None or head == saved_head:
        model.load_state_dict(state, strict=True)
        return model
    own = model.state_dict()
    encoder_keys = {k for k in own if k.startswith("encoder.")}
    missing_encoder = sorted(encoder_keys - state.keys())
    if missing_encoder:
        raise ValueError(f"{weights_path} lacks encoder weights: {missing_encoder[:5]} ...")
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    fresh = sorted(set(own) - usable.keys())
    if fresh:
        log.info("head %s: newly initialised tensors %s", model.head_type, fresh)
    return model


def tokenizer_path(release_dir: str | os.PathLike) -> Path | None:
    path = Path(release_dir) / TOKENIZER_FILE
    return path if path.is_file() else None
