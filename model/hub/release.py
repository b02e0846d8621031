"""The release directory: `config.json` + `model.safetensors` (+ `tokenizer.json`). Never pickle.

`config.json` holds the full encoder config, the head config and a format version;
`model.safetensors` holds fp32 weights (parametrized tensors as their free parameters, so a load
reproduces the saved model bit for bit). `save_release` and `load_release` are one call each.

Loading with a different head (e.g. a pretraining release into a classifier) keeps the encoder
weights, initialises the new head, and reports which head tensors were not loaded.

A release that cannot be what it claims is refused with a `ReleaseError` (a `ValueError`) naming
the file and the fault: a config.json that is not a release config, a truncated or corrupt
model.safetensors, weights that do not fit the config, or a tokenizer.json that does not belong
to the weights (`check_tokenizer`: its vocabulary size must be the model's `vocab_size`, and its
pad token the model's `pad_token_id`). `save_release` and `load_release` both run that check.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from albatross.files import staged_directory
from model.config import EncoderConfig, config_to_dict
from model.heads import build_model

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"

PAD_TOKENS = ("<pad>", "[PAD]")
"""Spellings of the padding token, ALBERT's first (as `data_prep.format.SPECIAL_TOKEN_NAMES`)."""

_NOT_ITS_TOKENIZER = "this tokenizer does not belong to these weights"


class ReleaseError(ValueError):
    """A release directory that cannot be used: the message names the file and the fault."""


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
    if tokenizer_file is not None:
        tok = Path(tokenizer_file)
        if not tok.is_file():
            raise FileNotFoundError(f"tokenizer file {tok} does not exist")
        _check_or_warn(tok, model.config, f"release {out}", "the model's config")
    config = {
        "format_version": FORMAT_VERSION,
        "encoder": config_to_dict(model.config),
        "head": model.head_config(),
        **({"extra": extra} if extra else {}),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with staged_directory(out, "a release", replace=True) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        weights = _fp32_contiguous(state_dict if state_dict is not None else model.state_dict())
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
        for f in tmp.iterdir():  # safetensors writes 0600
            _apply_umask(f)
    return out


def directory_digest(path: str | os.PathLike) -> str:
    """sha256 over every file below ``path`` (relative names and contents): what a checkpoint
    or release directory holds, wherever it is (identities of runs started from it)."""
    import hashlib

    root = Path(path)
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 23), b""):
                digest.update(chunk)
        h.update(f"{file.relative_to(root).as_posix()}\0{digest.hexdigest()}\n".encode())
    return h.hexdigest()


def export_release(
    source: str | os.PathLike, out: str | os.PathLike, overwrite: bool = True
) -> Path:
    """Copies the release ``source`` (e.g. a checkpoint's consolidated one) to ``out`` after
    loading it once, so a broken release is never published; atomic like ``save_release``."""
    source = Path(source)
    config = read_release_config(source)
    model = load_release(source)
    tok = source / TOKENIZER_FILE
    return save_release(
        out,
        model,
        tokenizer_file=tok if tok.is_file() else None,
        overwrite=overwrite,
        extra=config.get("extra"),
    )


def is_release(path: str | os.PathLike) -> bool:
    """A release dir (ours) rather than, e.g., an HF checkpoint: its config.json carries a
    ``format_version``."""
    config = Path(path) / CONFIG_FILE
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "format_version" in data


def read_release_config(release_dir: str | os.PathLike) -> dict[str, Any]:
    """The release's config.json, checked to be a release config of this format version
    (`ReleaseError` naming the file if not; FileNotFoundError if there is none)."""
    path = Path(release_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a release directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReleaseError(f"{path} is not valid JSON (truncated or corrupt?): {e}") from e
    if not isinstance(config, dict):
        raise ReleaseError(
            f"{path} is not a release config: a JSON {type(config).__name__}, not an object"
        )
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ReleaseError(
            f"{path}: unsupported release format_version {version!r} (expected {FORMAT_VERSION})"
        )
    for key in ("encoder", "head"):
        if not isinstance(config.get(key), dict):
            found = "missing" if key not in config else f"a {type(config[key]).__name__}"
            raise ReleaseError(f"{path}: {key!r} must be an object, found {found}")
    return config


def load_release(
    release_dir: str | os.PathLike,
    head: dict[str, Any] | None = None,
    map_location: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Builds the model from `config.json` and loads `model.safetensors`.

    `head` (e.g. {"type": "sequence_classification", "num_labels": 3}) replaces the saved head:
    encoder weights must all load; head weights load where names and shapes match.

    A `tokenizer.json` in the release is checked against the config (`check_tokenizer`); one
    that `tokenizers` cannot read is only warned about (the weights do not need it).
    Errors name the file: `ReleaseError` (a ValueError) for a bad config.json, a truncated or
    corrupt model.safetensors, weights that do not fit the config or a tokenizer of another
    vocabulary; FileNotFoundError for a missing config.json or model.safetensors.
    """
    release = Path(release_dir)
    config = read_release_config(release)
    config_path = release / CONFIG_FILE
    try:
        cfg = EncoderConfig.from_dict(config["encoder"])
    except (TypeError, ValueError) as e:
        raise ReleaseError(f"{config_path}: invalid encoder config: {e}") from e
    weights_path = release / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(
            f"{weights_path} not found: the release {release} is incomplete (no weights)"
        )
    tok = release / TOKENIZER_FILE
    if tok.is_file():
        _check_or_warn(tok, cfg, f"release {release}", str(config_path))
    saved_head = config["head"]
    use_saved = not head or head == saved_head
    if use_saved:
        try:
            model = build_model(cfg, saved_head)
        except (TypeError, ValueError) as e:
            raise ReleaseError(f"{config_path}: invalid head {saved_head}: {e}") from e
    else:
        model = build_model(cfg, head)  # the caller's head: its errors are the caller's
    state = _read_weights(weights_path, map_location)
    own = model.state_dict()
    wrong_shape = [
        f"{k} {tuple(v.shape)} (the config makes {tuple(own[k].shape)})"
        for k, v in state.items()
        if k in own and own[k].shape != v.shape
    ]
    if use_saved:
        missing = sorted(own.keys() - state.keys())
        unexpected = sorted(state.keys() - own.keys())
        if wrong_shape or missing or unexpected:
            raise _weights_mismatch(weights_path, config_path, wrong_shape, missing, unexpected)
        model.load_state_dict(state, strict=True)
        return model
    encoder_keys = {k for k in own if k.startswith("encoder.")}
    missing_encoder = sorted(encoder_keys - state.keys())
    wrong_encoder = [w for w in wrong_shape if w.startswith("encoder.")]
    if missing_encoder or wrong_encoder:
        raise _weights_mismatch(weights_path, config_path, wrong_encoder, missing_encoder, [])
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)
    fresh = sorted(set(own) - usable.keys())
    if fresh:
        log.info("head %s: newly initialised tensors %s", model.head_type, fresh)
    return model


def _read_weights(path: Path, map_location: str | torch.device) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device=str(map_location))
    except SafetensorError as e:
        raise ReleaseError(
            f"{path} is truncated or corrupt (safetensors cannot read it: {e}); copy or export "
            "the release again"
        ) from e


def _weights_mismatch(
    weights: Path, config: Path, wrong_shape: list[str], missing: list[str], unexpected: list[str]
) -> ReleaseError:
    def some(items: list[str]) -> str:
        return ", ".join(items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")

    parts = [
        f"{label}: {some(items)}"
        for label, items in (
            ("wrong shape", wrong_shape),
            ("missing", missing),
            ("not in the model", unexpected),
        )
        if items
    ]
    return ReleaseError(
        f"{weights} does not fit the model that {config} describes (weights of another model "
        f"or another config?): {'; '.join(parts)}"
    )


# ----------------------------------------------------------------------------- tokenizer


def check_tokenizer(
    release_or_tokenizer: str | os.PathLike,
    config: EncoderConfig | dict[str, Any] | None = None,
) -> Any:
    """Checks that a tokenizer belongs to a model; returns the `tokenizers.Tokenizer`.

    `release_or_tokenizer`: a release directory (its tokenizer.json) or a tokenizer.json.
    `config`: the model's `EncoderConfig`, its dict, or a whole release config (config.json's
    contents); None reads the release's config.json (for a tokenizer.json: the one beside it).

    The tokenizer's vocabulary (added tokens included) must have exactly the model's
    `vocab_size` entries (the project derives vocab_size from the tokenizer, unpadded), and
    its pad token (<pad> or [PAD]) must have the model's `pad_token_id`. A mismatch raises
    `ReleaseError` (a ValueError) naming the release, the tokenizer file and what differs;
    an unreadable tokenizer.json too; FileNotFoundError if there is none.
    """
    source = Path(release_or_tokenizer)
    tok_path = source / TOKENIZER_FILE if source.is_dir() else source
    release = tok_path.parent if (tok_path.parent / CONFIG_FILE).is_file() else None
    if not tok_path.is_file():
        where = f": the release {source} has no tokenizer" if source.is_dir() else ""
        raise FileNotFoundError(f"{tok_path} not found{where}")
    if config is None:
        if release is None:
            raise FileNotFoundError(
                f"{tok_path.parent / CONFIG_FILE} not found: pass the model config to check "
                f"{tok_path} against"
            )
        config = read_release_config(release)
        config_source = str(release / CONFIG_FILE)
    else:
        config_source = "the model's config"
    if isinstance(config, EncoderConfig):
        cfg = config
    else:
        cfg = EncoderConfig.from_dict(config.get("encoder", config))
    where = f"release {release}" if release is not None else f"tokenizer {tok_path}"
    tokenizer = _read_tokenizer(tok_path, where)
    _verify_tokenizer(tokenizer, tok_path, cfg, where, config_source)
    return tokenizer


def _read_tokenizer(path: Path, where: str) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        raise ReleaseError(
            f"{where}: {path} is not a readable tokenizer.json (HF tokenizers: {e})"
        ) from e


def _verify_tokenizer(
    tokenizer: Any, path: Path, cfg: EncoderConfig, where: str, config_source: str
) -> None:
    faults = []
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != cfg.vocab_size:
        beyond = " (its ids would run past the embedding table)" if size > cfg.vocab_size else ""
        faults.append(
            f"{path} has {size} tokens but the model's vocabulary has {cfg.vocab_size} "
            f"({config_source} vocab_size){beyond}"
        )
    pads = {s: tokenizer.token_to_id(s) for s in PAD_TOKENS}
    pads = {s: i for s, i in pads.items() if i is not None}
    if not pads:
        faults.append(
            f"the model pads with id {cfg.pad_token_id} ({config_source} pad_token_id) but {path} "
            f"has no padding token ({' or '.join(map(repr, PAD_TOKENS))})"
        )
    else:
        spelling, pad_id = next(iter(pads.items()))
        if pad_id != cfg.pad_token_id:
            faults.append(
                f"the model pads with id {cfg.pad_token_id} ({config_source} pad_token_id) but "
                f"in {path} {spelling!r} is id {pad_id}"
            )
    if faults:
        raise ReleaseError(f"{where}: {'; '.join(faults)}: {_NOT_ITS_TOKENIZER}")


def _check_or_warn(path: Path, cfg: EncoderConfig, where: str, config_source: str) -> None:
    """`check_tokenizer` for save/load: a mismatch raises; an unreadable file only warns."""
    try:
        tokenizer = _read_tokenizer(path, where)
    except ReleaseError as e:
        log.warning("%s; its vocabulary was not checked against the model", e)
        return
    _verify_tokenizer(tokenizer, path, cfg, where, config_source)


def tokenizer_path(release_dir: str | os.PathLike) -> Path | None:
    path = Path(release_dir) / TOKENIZER_FILE
    return path if path.is_file() else None
